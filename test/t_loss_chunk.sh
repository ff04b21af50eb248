#!/usr/bin/env bash
# model.loss_chunk composed with every layout, on the CPU backend: each pair
# trains the same config with the whole logits and with the head in chunks
# of 48 of a rank's rows (a micro-batch's 128: chunks of 48, 48 and 32; 64
# rows under cp 2: 48 and 16), and the losses (validation too) and the final
# checkpoint must agree within the suite's equivalence tolerance for another
# partition of the same products: relative 1e-5, parameters and optimizer
# state 1e-5 (OpenBLAS sums a row in a tail tile in another order, so the
# rows of a 48-row product need not carry the bits of the 128-row one's;
# test_model_loss_chunk.c measures it; a wrong chunk moves them by percents).
# Also: vocabulary-parallel tp (each chunk's statistics gathered), z-loss and
# MoE, documents, every pipeline schedule (zb_h1's weight part makes the
# chunk's dlogits again), cp in both modes, ep, ZeRO-3, block recompute,
# `auto`; the generated text (model_logits_row computing the chunk of the
# row it reads); the smaller arena at start-up beside --dry-run; a resume
# that turns chunking on; the refusals. One line a check.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_loss_chunk
rm -rf "$T"
. test/ckpt_lib.sh
ckpt_setup
Y=$T/tiny.yaml
S="--set train.steps=6 --set checkpoint.every=6 --set checkpoint.async=false --set train.eval_every=3"
S="$S --set model.n_layer=4 --set batch.total_tokens=512"
LLAMA="--set model.arch=llama --set model.n_head=8 --set model.n_kv_head=4 --set model.n_embd=64 --set model.ffn_hidden=96"
MOE="$LLAMA --set model.mlp=moe --set model.moe.n_experts=4 --set model.moe.top_k=2 --set model.moe.expert_hidden=32"
MOE="$MOE --set model.moe.n_shared=1 --set model.moe.aux_loss_coef=0.01 --set model.moe.z_loss_coef=0.001"
MPI=0
command -v mpirun >/dev/null 2>&1 && ldd ./train | grep -q libmpi && MPI=1
# val_loss within relative 1e-5 (close_losses reads the training losses)
close_val() {
    python3 - "$1" "$2" <<'PY'
import json, sys
a = [json.loads(l).get("val_loss") for l in open(sys.argv[1])]
b = [json.loads(l).get("val_loss") for l in open(sys.argv[2])]
a, b = [x for x in a if x is not None], [x for x in b if x is not None]
if len(a) != len(b) or not a or any(abs(x - y) > 1e-5 * abs(x) for x, y in zip(a, b)):
    print("val_loss %r vs %r" % (a, b)); sys.exit(1)
PY
}

# pair NAME NP ARGS...: the whole head against model.loss_chunk (48 unless ARGS set it)
pair() {
    local name=$1 np=$2
    shift 2
    local run=(./train)
    if [ "$np" -gt 1 ]; then
        if [ $MPI = 0 ]; then skip loss_chunk_$name "no MPI build or mpirun"; return; fi
        run=(timeout 300 mpirun --allow-run-as-root --oversubscribe -np "$np" ./train)
    fi
    local a=$T/${name}_whole b=$T/${name}_chunk
    "${run[@]}" $Y $S --set model.loss_chunk=48 "$@" --set model.loss_chunk=0 --set run.dir=$a >$a.txt 2>&1
    local rc0=$?
    "${run[@]}" $Y $S --set model.loss_chunk=48 "$@" --set run.dir=$b >$b.txt 2>&1
    local rc1=$?
    local why="" diff="" drc=1
    # the chunked run says so (rank 0 prints: a pipeline's rank 0 has no head)
    [[ "$*" == *parallel.pp=* ]] || grep -q 'loss in chunks of' $b.txt || why="no 'loss in chunks' line"
    if [ $rc0 -eq 0 ] && [ $rc1 -eq 0 ]; then
        why="$(close_losses $a/metrics.jsonl $b/metrics.jsonl 2>&1) $(close_val $a/metrics.jsonl $b/metrics.jsonl 2>&1)"
        diff=$(./train ckpt-diff $a/checkpoints/step_00000006 $b/checkpoints/step_00000006 --quiet --tol 1e-5 2>&1) && drc=0
    fi
    if [ $rc0 -eq 0 ] && [ $rc1 -eq 0 ] && [ $drc -eq 0 ] && [ -z "${why// /}" ]; then ok loss_chunk_$name
    else fail loss_chunk_$name "rc $rc0/$rc1: $why $(head -c 200 <<<"$diff") $(grep -m1 -h error $a.txt $b.txt)"
    fi
}

pair gpt2_tied 1
pair gpt2_auto 1 --set model.loss_chunk=auto --set model.n_embd=32
pair llama_docmask 1 $LLAMA --set data.doc_masking=true --set data.eot_id=10
pair moe_zloss 1 $MOE --set model.moe.capacity_factor=1.25
pair block_recompute 1 $LLAMA --set model.recompute=block
pair accum4 1 $LLAMA --set batch.total_tokens=2048
pair tp2_sp 2 $LLAMA --set parallel.tp=2 --set parallel.sequence_parallel=true
pair tp2_gpt2_tied 2 --set parallel.tp=2
pair pp2_1f1b 2 --set parallel.pp=2
pair pp2_gpipe 2 $LLAMA --set parallel.pp=2 --set parallel.pp_schedule=gpipe
pair pp2_interleaved 2 $LLAMA --set parallel.pp=2 --set parallel.pp_schedule=interleaved_1f1b --set parallel.pp_virtual=2
pair pp2_zb_h1 2 --set parallel.pp=2 --set parallel.pp_schedule=zb_h1
pair cp2_allgather 2 $LLAMA --set parallel.cp=2 --set parallel.cp_attention=allgather
pair cp2_ring_docmask 2 $LLAMA --set parallel.cp=2 --set parallel.cp_attention=ring --set data.doc_masking=true --set data.eot_id=10
pair ep2 2 $MOE --set parallel.ep=2 --set model.moe.capacity_factor=1.25
pair zero3 2 --set parallel.zero=3

# hardware FLOPs: metrics.jsonl's hfu counts the backward's second head
# product (2 C V a token) beside the model FLOPs MFU counts: GPT-2, 4 layers
# 32 wide, context 32, vocabulary 256: 6 (4 x 12 x 32^2 + 32 x 256) + 6 x 4
# x 32 x 32 = 368640 a token, + 16384; the whole head has no hfu
if python3 - $T/gpt2_tied_chunk/metrics.jsonl $T/gpt2_tied_whole/metrics.jsonl <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
want = (368640 + 16384) / 368640
ok = all(abs(x["hfu"] / x["mfu"] - want) < 1e-4 for x in a) and not any("hfu" in x for x in b)
sys.exit(0 if ok and a else 1)
PY
then ok loss_chunk_hardware_flops
else fail loss_chunk_hardware_flops "$(grep -o '"mfu":[^,]*,"hfu":[^,]*' $T/gpt2_tied_chunk/metrics.jsonl | head -2)"; fi

# the start-up line: the logits of one chunk, not the micro-batch's (GPT-2
# tied: vocabulary 256 padded to 256, 4-byte activations: 128 x 256 x 4 =
# 128 KiB whole, 48 x 256 x 4 = 48 KiB chunked, 80 KiB less; each figure is
# printed to 0.01 MiB, so within 10.24 KiB)
act() { grep -o 'activations: [0-9.]* MiB' "$1" | awk '{print $2}'; }
if python3 -c "import sys; sys.exit(0 if abs(($(act $T/gpt2_tied_whole.txt) - $(act $T/gpt2_tied_chunk.txt)) * 1024 - 80) <= 10.24 else 1)"; then
    ok loss_chunk_startup_line_smaller
else fail loss_chunk_startup_line_smaller "$(act $T/gpt2_tied_whole.txt) -> $(act $T/gpt2_tied_chunk.txt) MiB"; fi
grep -q 'loss in chunks of 48 rows' $T/gpt2_tied_chunk.txt && ok loss_chunk_startup_says_so \
    || fail loss_chunk_startup_says_so "$(grep -m1 'activations' $T/gpt2_tied_chunk.txt)"
# --dry-run counts what the run allocates (both printed to 2 decimals)
./train $Y $S --set model.loss_chunk=48 --dry-run >$T/dry.txt 2>&1
if dry_matches $T/dry.txt "$(act $T/gpt2_tied_chunk.txt)"
then ok loss_chunk_dry_run_matches_run
else fail loss_chunk_dry_run_matches_run "dry-run '$(grep -m1 -E '^  activations ' $T/dry.txt)', run $(act $T/gpt2_tied_chunk.txt) MiB"; fi

# generation: contexts of up to 32 tokens in chunks of 16, so the sampled
# row's chunk is made on demand (one rank and tp 2): the text of the whole head
G="--set train.sample_every=6 --set train.sample_tokens=40"
gen() { sed -n '/--- sample/,/^---$/p' "$1"; }
./train $Y $S $LLAMA $G --set run.dir=$T/gen_whole >$T/gen_whole.txt 2>&1
./train $Y $S $LLAMA $G --set model.loss_chunk=16 --set run.dir=$T/gen_chunk >$T/gen_chunk.txt 2>&1
[ -n "$(gen $T/gen_whole.txt)" ] && [ "$(gen $T/gen_whole.txt)" = "$(gen $T/gen_chunk.txt)" ] \
    && ok loss_chunk_generation_same_text \
    || fail loss_chunk_generation_same_text "$(gen $T/gen_whole.txt | head -c 120) vs $(gen $T/gen_chunk.txt | head -c 120)"
if [ $MPI = 1 ]; then
    timeout 300 mpirun --allow-run-as-root --oversubscribe -np 2 ./train $Y $S $LLAMA $G --set parallel.tp=2 \
        --set model.loss_chunk=16 --set run.dir=$T/gen_tp2 >$T/gen_tp2.txt 2>&1
    [ "$(gen $T/gen_whole.txt)" = "$(gen $T/gen_tp2.txt)" ] && ok loss_chunk_generation_tp2_same_text \
        || fail loss_chunk_generation_tp2_same_text "$(gen $T/gen_tp2.txt | head -c 120)"
else skip loss_chunk_generation_tp2_same_text "no MPI build or mpirun"; fi

# Resume: 3 steps whole, then to 6 in chunks: allowed with a note, and
# within the tolerance of 6 steps straight
K="--set schedule.kind=constant --set checkpoint.every=3"
./train $Y $S $K --set run.dir=$T/straight >$T/straight.txt 2>&1
./train $Y $S $K --set run.dir=$T/switch --set train.steps=3 >$T/switch0.txt 2>&1
./train $Y $S $K --set run.dir=$T/switch --set model.loss_chunk=48 --resume auto >$T/switch.txt 2>&1
rc=$?
if [ $rc -eq 0 ] && grep -q "resume: key 'model.loss_chunk': 0 -> 48" $T/switch.txt \
    && ./train ckpt-diff $T/straight/checkpoints/step_00000006 $T/switch/checkpoints/step_00000006 --quiet --tol 1e-5 \
        >$T/switch_diff.txt 2>&1; then ok loss_chunk_change_on_resume
else fail loss_chunk_change_on_resume "rc $rc; $(grep -E 'resume|error' $T/switch.txt | head -3) $(head -c 200 $T/switch_diff.txt)"; fi

expect loss_chunk_fp8_head 2 "model.loss_chunk.*precision.fp8_head" -- \
    ./train $Y --set model.loss_chunk=64 --set precision.fp8=tensorwise --set precision.fp8_head=true
expect loss_chunk_negative 2 "model.loss_chunk" -- ./train $Y --set model.loss_chunk=-3
expect loss_chunk_word 2 "model.loss_chunk" -- ./train $Y --set model.loss_chunk=some
