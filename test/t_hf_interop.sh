#!/usr/bin/env bash
# HuggingFace interop end to end: a tiny GPT-2, a Llama (GQA, untied head)
# and an OLMoE-style MoE train 3 steps on the CPU with a padded vocabulary
# (300 -> 320 rows), `./train export --format hf` writes them (fp32 and
# bf16), and test/hf_interop.py checks HF's logits against kiln's, both round
# trips bit for bit, a random HF model loaded through init.from, greedy
# decoding, and sharded files both ways. Then: llm.c's file out and back;
# ZeRO-3 and tensor-parallel checkpoints of 2 ranks exported and read back
# bit for bit; a config.json that disagrees refused. An MoE with shared
# experts is refused with one line. The interpreter is
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
        ! ./train export "$ckpt" --format hf --out "$T/${name}_hf16" --dtype bf16 >>"$T/$name.export.txt" 2>&1 ||
        ! ./train export "$ckpt" --format hf --out "$T/${name}_sharded" --max-shard-size 30KB \
            >>"$T/$name.export.txt" 2>&1; then
        fail "hf_${name}_export" "$(tail -n 2 "$T/$name.export.txt" | tr '\n' ' ')"; continue
    fi
    ok "hf_${name}_export"
    "$py" test/hf_interop.py "$name" "$run/config.yaml" "$ckpt" "$T/${name}_hf32" "$T/${name}_hf16" "$T" \
        "$T/${name}_sharded" 2>"$T/$name.py.txt" ||
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

# llm.c out: the GPT-2 checkpoint as llm.c's file, read back through
# init.from: every parameter bit-identical (both sides fp32, the same order).
if [ -d "$T/gpt2" ]; then
    ckpt=$(ls -d "$T"/gpt2/checkpoints/step_* | tail -n 1)
    if ./train export "$ckpt" --format llmc --out "$T/gpt2.bin" >"$T/llmc.txt" 2>&1 &&
        build/test/hf_tool "$T/gpt2/config.yaml" "$ckpt" --dump "$T/llmc_a.safetensors" &&
        build/test/hf_tool "$T/gpt2/config.yaml" "$T/gpt2.bin" --dump "$T/llmc_b.safetensors" &&
        cmp -s "$T/llmc_a.safetensors" "$T/llmc_b.safetensors"; then ok hf_llmc_round_trip
    else fail hf_llmc_round_trip "$(tail -n 2 "$T/llmc.txt")"; fi
    expect hf_llmc_refuses_llama 2 "an llm.c checkpoint is a GPT-2" -- \
        ./train export "$T/llama" --format llmc --out "$T/llama.bin"
fi

# Checkpoints of several ranks: ZeRO-3 shards (GPT-2) and tensor-parallel
# boxes (Llama, tp 2) export to the same HF files as a one-rank checkpoint of
# the same parameters would: kiln -> HF -> kiln bit-identical.
if command -v mpirun >/dev/null 2>&1 && ldd ./train | grep -q libmpi; then
    MPIRUN=(timeout 300 mpirun --allow-run-as-root --oversubscribe -np 2)
    for lay in "gpt2 --set parallel.zero=3" "llama --set parallel.tp=2"; do
        name=${lay%% *} extra=${lay#* }
        run="$T/${name}_mr"
        # shellcheck disable=SC2086
        "${MPIRUN[@]}" ./train ${cfgs[$name]} "${common[@]}" --set run.threads=1 --set batch.total_tokens=256 $extra \
            --set "run.dir=$run" \
            >"$T/${name}_mr.txt" 2>&1
        ckpt=$(ls -d "$run"/checkpoints/step_* 2>/dev/null | tail -n 1)
        if [ -n "$ckpt" ] && ./train export "$ckpt" --format hf --out "$T/${name}_mr_hf" >>"$T/${name}_mr.txt" 2>&1 &&
            build/test/hf_tool "$run/config.yaml" "$ckpt" --dump "$T/${name}_mr_a.safetensors" &&
            build/test/hf_tool "$run/config.yaml" "$T/${name}_mr_hf" --dump "$T/${name}_mr_b.safetensors" &&
            cmp -s "$T/${name}_mr_a.safetensors" "$T/${name}_mr_b.safetensors"; then ok "hf_${name}_multirank_round_trip"
        else fail "hf_${name}_multirank_round_trip" "$(grep -m2 -E 'error' "$T/${name}_mr.txt")"; fi
    done
    # init.from an HF directory under tp 2: each rank takes its part, and the
    # run trains as the one-rank run from the same weights (losses within
    # 1e-5 relative: t_tp.sh says why)
    if [ -d "$T/llama_hf32" ]; then
        . test/ckpt_lib.sh
        I=(--set "init.from=$T/llama_hf32" --set train.steps=3 --set run.threads=1)
        # shellcheck disable=SC2086
        ./train ${cfgs[llama]} "${common[@]}" "${I[@]}" --set "run.dir=$T/tp_init1" >"$T/tp_init1.txt" 2>&1
        # shellcheck disable=SC2086
        "${MPIRUN[@]}" ./train ${cfgs[llama]} "${common[@]}" "${I[@]}" --set parallel.tp=2 --set "run.dir=$T/tp_init2" \
            >"$T/tp_init2.txt" 2>&1
        why=$(close_losses "$T/tp_init1/metrics.jsonl" "$T/tp_init2/metrics.jsonl" 2>&1)
        [ -z "$why" ] && grep -q 'init.from: HuggingFace weights' "$T/tp_init2.txt" && ok hf_import_under_tp2 \
            || fail hf_import_under_tp2 "$why $(grep -m2 error "$T/tp_init2.txt")"
    fi
fi

# config.json that disagrees with the config's model in a field the shapes
# cannot show (kv heads 4 vs 2 would also change shapes; the RoPE base does not)
if [ -d "$T/llama_hf32" ]; then
    mkdir -p "$T/llama_badcfg"
    cp "$T/llama_hf32/model.safetensors" "$T/llama_badcfg/"
    sed 's/"rope_theta": [0-9.e+]*/"rope_theta": 500000/' "$T/llama_hf32/config.json" > "$T/llama_badcfg/config.json"
    expect hf_import_checks_config_json 2 "config.json: key 'rope_theta' is 500000, the config's model.rope_theta is 10000" -- \
        build/test/hf_tool "$T/llama/config.yaml" "$T/llama_badcfg" --dump "$T/x2.safetensors"
fi

# GPT-2's tokenizer files: a GPT-2 run on the BPE tokenizer exports vocab.json
# and merges.txt made from kiln's tiktoken ranks; HF's GPT2Tokenizer (and the
# fast one) encode 200 KB of Austen and a text of awkward cases (contractions,
# digits, whitespace runs, accents, emoji) to exactly the ids kiln's
# prepare wrote.
if [ -f data/cache/gpt2.tiktoken ]; then
    mkdir -p "$T/tok"
    head -c 200000 data/austen.txt > "$T/tok/a.txt"
    printf "It's 2,048 tokens...   don't\n\n\tcafé naïve – “quoted” 日本語 😀 x\r\ny'all 3.14159  \n" > "$T/tok/b.txt"
    ok_all=1
    for f in a b; do
        ./train prepare --tokenizer gpt2 --no-eot --val-fraction 0 --out "$T/tok/$f" "$T/tok/$f.txt" >/dev/null 2>&1 || ok_all=0
    done
    # shellcheck disable=SC2086
    ./train configs/tiny.yaml "${common[@]}" --set model.vocab_size=50257 --set data.tokenizer=gpt2 \
        --set data.tokenizer_file=data/cache/gpt2.tiktoken --set "data.train=$T/tok/a/train_*.bin" --set 'data.val=""' \
        --set train.steps=1 --set "run.dir=$T/tok/run" >"$T/tok/train.txt" 2>&1 || ok_all=0
    ./train export "$T/tok/run" --format hf --out "$T/tok/hf" >"$T/tok/export.txt" 2>&1 || ok_all=0
    if [ $ok_all -eq 1 ] && "$py" - "$T/tok" <<'PY'; then ok hf_gpt2_tokenizer_files
import sys
import numpy as np
from transformers import AutoTokenizer
d = sys.argv[1]
for f in ("a", "b"):
    raw = open(f"{d}/{f}/train_000000.bin", "rb").read()
    kiln = np.frombuffer(raw[1024:], dtype=np.uint16).tolist()
    text = open(f"{d}/{f}.txt", encoding="utf-8", newline="").read()  # keep \r\n as written
    for fast in (False, True):
        tok = AutoTokenizer.from_pretrained(f"{d}/hf", use_fast=fast)
        ids = tok.encode(text)
        if ids != kiln:
            i = next((k for k, (x, y) in enumerate(zip(ids, kiln)) if x != y), min(len(ids), len(kiln)))
            sys.exit(f"{f}.txt, fast={fast}: first difference at token {i} of {len(kiln)}")
PY
    else fail hf_gpt2_tokenizer_files "$(tail -n 2 "$T/tok/export.txt")"; fi
fi

# A pipeline stage (layers [1, 2) of 2, with the final norm and head) loads its
# part of a whole HF model: every tensor it holds is the whole model's.
if [ -d "$T/llama_hf32" ]; then
    if build/test/hf_tool "$T/llama/config.yaml" "$T/llama_hf32" --dump "$T/whole.safetensors" &&
        build/test/hf_tool "$T/llama/config.yaml" "$T/llama_hf32" --stage 1 2 --dump "$T/stage.safetensors" &&
        "$py" - "$T/whole.safetensors" "$T/stage.safetensors" <<'PY'; then ok hf_import_into_stage
import sys
from safetensors.numpy import load_file
w, s = load_file(sys.argv[1]), load_file(sys.argv[2])
assert s and set(s) < set(w), sorted(set(s) - set(w))
assert all(k.startswith("layers.1.") or not k.startswith("layers.") for k in s), "another layer in the stage"
assert all(s[k].tobytes() == w[k].tobytes() for k in s), "a tensor differs"
PY
    else fail hf_import_into_stage "the stage's tensors differ from the whole model's"; fi
fi
