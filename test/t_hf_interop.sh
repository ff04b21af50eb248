#!/usr/bin/env bash
# HuggingFace interop end to end: a tiny GPT-2, a Llama (GQA, untied head)
# and an OLMoE-style MoE train 3 steps on the CPU with a padded vocabulary
# (300 -> 320 rows), `./train export --format hf` writes them (fp32 and
# bf16), and test/hf_interop.py checks HF's logits against kiln's, both round
# trips bit for bit, and a random HF model loaded through init.from. An MoE
# with shared experts is refused with one line. The interpreter is
# $KILN_HF_PY (default .venv-hf/bin/python, made by scripts/setup_hf.sh);
# without transformers it prints skip lines.
set -u
cd "$(dirname "$0")/.."
. test/lib.sh
py=${KILN_HF_PY:-.venv-hf/bin/python}
if [ ! -x "$py" ] || ! "$py" -c 'import torch, transformers, safetensors' 2>/dev/null; then
    echo "skip hf_interop: transformers not installed ($py; scripts/setup_hf.sh makes it)"
    exit 0
fi
[ -x build/test/hf_tool ] || { fail hf_interop "build/test/hf_tool not built (make test builds it)"; exit 0; }
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_hf_interop
rm -rf "$T" && mkdir -p "$T"
small_corpus "$T/data" || exit 0

common=(--set model.n_layer=2 --set model.n_embd=64 --set model.n_head=4 --set model.seq_len=32
    --set model.vocab_size=300 --set train.steps=3 --set train.eval_every=0 --set train.sample_every=0
    --set schedule.warmup_steps=1 --set checkpoint.every=0 --set batch.micro_batch=4 --set batch.total_tokens=128
    --set run.threads=2 --set metrics.tensorboard=false
    --set "data.train=$T/data/train_*.bin" --set "data.val=$T/data/val_*.bin")
declare -A cfgs=(
    [gpt2]="configs/tiny.yaml"
    [llama]="configs/llama-tiny.yaml --set model.n_kv_head=2 --set model.ffn_hidden=96"
    [olmoe]="configs/moe-tiny.yaml --set model.n_kv_head=2 --set model.moe.n_shared=0 --set model.qk_norm=full
             --set model.moe.n_experts=4 --set model.moe.expert_hidden=32"
)
for name in gpt2 llama olmoe; do
    run="$T/$name"
    # shellcheck disable=SC2086
    if ! ./train ${cfgs[$name]} "${common[@]}" --set "run.dir=$run" >"$T/$name.train.txt" 2>&1; then
        fail "hf_${name}_train" "$(tail -n 2 "$T/$name.train.txt" | tr '\n' ' ')"; continue
    fi
    ckpt=$(ls -d "$run"/checkpoints/step_* | tail -n 1)
    if ! ./train export "$run" --format hf --out "$T/${name}_hf32" >"$T/$name.export.txt" 2>&1 ||
        ! ./train export "$ckpt" --format hf --out "$T/${name}_hf16" --dtype bf16 >>"$T/$name.export.txt" 2>&1; then
        fail "hf_${name}_export" "$(tail -n 2 "$T/$name.export.txt" | tr '\n' ' ')"; continue
    fi
    ok "hf_${name}_export"
    "$py" test/hf_interop.py "$name" "$run/config.yaml" "$ckpt" "$T/${name}_hf32" "$T/${name}_hf16" "$T" 2>"$T/$name.py.txt" ||
        fail "hf_${name}_python" "$(tail -n 2 "$T/$name.py.txt" | tr '\n' ' ')"
done

# Shared experts have no exact HF counterpart: export refuses with one line, exit 2.
./train configs/moe-tiny.yaml "${common[@]}" --set train.steps=1 --set "run.dir=$T/shared" >/dev/null 2>&1
expect hf_export_refuses_shared_experts 2 "n_shared 1: OLMoE has no shared experts" -- \
    ./train export "$T/shared" --format hf --out "$T/shared_hf"
# A checkpoint tensor renamed in the HF file: init.from names it and exits 2.
if [ -d "$T/llama_hf32" ]; then
    "$py" - "$T/llama_hf32/model.safetensors" "$T/bad.safetensors" <<'PY'
import sys
from safetensors.numpy import load_file, save_file
t = load_file(sys.argv[1])
t["model.layers.0.mlp.up_projX.weight"] = t.pop("model.layers.0.mlp.up_proj.weight")
save_file(t, sys.argv[2], metadata={"format": "pt"})
PY
    expect hf_import_names_missing_tensor 2 "tensor 'model.layers.0.mlp.up_proj.weight' .* is missing" -- \
        build/test/hf_tool "$T/llama/config.yaml" "$T/bad.safetensors" --dump "$T/x.safetensors"
fi
# The run's own path: ./train with init.from an HF directory says what it loaded.
if [ -d "$T/llama_hf32" ]; then
    # shellcheck disable=SC2086
    expect hf_train_init_from 0 "init.from: HuggingFace weights of .*llama_hf32/model.safetensors" -- \
        ./train ${cfgs[llama]} "${common[@]}" --set train.steps=1 --set "init.from=$T/llama_hf32" --set "run.dir=$T/llama_from_hf"
fi
