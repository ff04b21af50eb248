#!/usr/bin/env bash
# Document masking and per-document positions (data.doc_masking,
# data.doc_positions reset; docs/data.md "Documents") through ./train on the
# CPU backend under real Open MPI: the byte corpus with data.eot_id 32 (every
# space ends a document: ~6 documents in each 32-token sequence, many across
# the cp chunks and pipeline micro-batches), a tiny GPT-2 (learned positions)
# and a tiny Llama (RoPE, grouped-query attention), each against its one-rank
# run under dp 2 with ZeRO 2, cp 2 (all-gather and ring), cp 2 x dp 2 with
# ZeRO 3, tp 2 (sequence parallel), pp 2, an MoE Llama under ep 2 and
# ep 2 x tp 2; that the documents change the
# losses at all; bad keys refused naming them. One line per check.
#
# Tolerances as test/t_cp.sh argues (docs/parallel.md, "Correctness"): every
# layout computes the same function in another association order, so the
# loss at every step within relative 1e-5 and every final parameter within
# absolute 1e-5. The documents are found from each micro-batch's input ids
# on every rank (model_doc_starts), so a rank that got them wrong (a chunk's
# starts at local positions, a stage without them) misses by 1e-3 or more.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_docmask
rm -rf "$T"
. test/ckpt_lib.sh
if ! command -v mpirun >/dev/null 2>&1; then skip docmask "mpirun not found (make deps installs openmpi-bin)"; exit 0; fi
if ! ldd ./train | grep -q libmpi; then skip docmask "./train is not an MPI build (make deps, then make)"; exit 0; fi
ckpt_setup
Y=$T/tiny.yaml
MPIRUN=(timeout 300 mpirun --allow-run-as-root --oversubscribe)
S="--set batch.total_tokens=512 --set train.steps=6 --set checkpoint.every=6 --set checkpoint.async=false"
S="$S --set model.vocab_size=300 --set train.eval_every=3"
D="--set data.doc_masking=true --set data.doc_positions=reset --set data.eot_id=32"
GPT2="--set model.n_head=4 $D"
LLAMA="--set model.arch=llama --set model.n_head=8 --set model.n_kv_head=4 --set model.n_embd=64 --set model.ffn_hidden=96 $D"
MOE="$LLAMA --set model.mlp=moe --set model.moe.n_experts=4 --set model.moe.top_k=2 --set model.moe.expert_hidden=32"

# equiv NAME MODEL NP SETTINGS...: the run against the model's one-rank reference
equiv() {
    local name=$1 model=$2 np=$3; shift 3
    local R=$T/$name
    "${MPIRUN[@]}" -np $np ./train $Y $S ${!model} "$@" --set run.dir=$R >$R.txt 2>&1
    local rc=$? why diff drc=1
    why=$(close_losses $T/ref_$model/metrics.jsonl $R/metrics.jsonl 2>&1)
    diff=$(./train ckpt-diff $T/ref_$model/checkpoints/step_00000006 $R/checkpoints/step_00000006 --quiet --tol 1e-5 \
        2>&1) && drc=0
    if [ $rc -eq 0 ] && [ $drc -eq 0 ] && [ -z "$why" ]; then
        ok "docmask_equiv_$name # $(./train ckpt-diff $T/ref_$model/checkpoints/step_00000006 \
            $R/checkpoints/step_00000006 --tol 1e-5 2>&1 | grep -o 'params max abs diff [^ ]*')"
    else fail docmask_equiv_$name "rc $rc: $why $diff $(grep -m2 error $R.txt)"; fi
}

for model in GPT2 LLAMA MOE; do
    ./train $Y $S ${!model} --set run.dir=$T/ref_$model >$T/ref_$model.txt 2>&1 \
        || fail docmask_reference_$model "$(tail -n 3 $T/ref_$model.txt)"
done

grep -q 'data: documents end at token 32 (data.eot_id); attention stops at them (data.doc_masking); positions restart per document' \
    $T/ref_GPT2.txt && ok docmask_start_up_line || fail docmask_start_up_line "$(grep -m2 'data:' $T/ref_GPT2.txt)"

# the documents matter: without them the losses move by far more than 1e-5
for model in GPT2 LLAMA; do
    ./train $Y $S ${!model} --set data.doc_masking=false --set data.doc_positions=continue \
        --set run.dir=$T/plain_$model >$T/plain_$model.txt 2>&1
    d=$(python3 - $T/ref_$model/metrics.jsonl $T/plain_$model/metrics.jsonl <<'PY'
import json, sys
a = [json.loads(l)["loss"] for l in open(sys.argv[1])]
b = [json.loads(l)["loss"] for l in open(sys.argv[2])]
print("%.3g" % max(abs(x - y) / abs(y) for x, y in zip(a, b)))
PY
)
    python3 -c "import sys; sys.exit(0 if float('$d') > 1e-3 else 1)" 2>/dev/null \
        && ok "docmask_${model,,}_changes_losses # max relative loss difference $d" \
        || fail docmask_${model,,}_changes_losses "losses with and without documents differ by only $d"
done

equiv gpt2_dp2_zero2 GPT2 2 --set parallel.zero=2
equiv gpt2_cp2_allgather GPT2 2 --set parallel.cp=2
equiv llama_gqa_cp2_ring LLAMA 2 --set parallel.cp=2 --set parallel.cp_attention=ring
equiv llama_gqa_cp2_dp2_zero3 LLAMA 4 --set parallel.cp=2 --set parallel.zero=3
equiv llama_gqa_tp2_sp LLAMA 2 --set parallel.tp=2
equiv gpt2_tp2_nosp GPT2 2 --set parallel.tp=2 --set parallel.sequence_parallel=false
equiv gpt2_pp2_1f1b GPT2 2 --set parallel.pp=2
equiv llama_gqa_pp2_zb_h1 LLAMA 2 --set parallel.pp=2 --set parallel.pp_schedule=zb_h1
equiv moe_ep2 MOE 2 --set parallel.ep=2
equiv moe_ep2_tp2 MOE 4 --set parallel.ep=2 --set parallel.tp=2

# bad keys: one line naming the key, exit 2
expect_usage() {
    local name=$1 want=$2; shift 2
    local out rc
    out=$(./train $Y $S "$@" --set run.dir=$T/$name 2>&1); rc=$?
    if [ $rc -eq 2 ] && printf '%s\n' "$out" | grep -q "$want"; then ok docmask_refuses_$name
    else fail docmask_refuses_$name "rc $rc: $(printf '%s\n' "$out" | grep -m2 kiln)"; fi
}
expect_usage byte_without_eot "key 'data.eot_id': documents" --set data.doc_masking=true
expect_usage reset_byte_without_eot "key 'data.eot_id': documents" --set data.doc_positions=reset
expect_usage eot_past_vocab "key 'data.eot_id': 300 is not an id" --set data.doc_masking=true --set data.eot_id=300
expect_usage bad_positions "data.doc_positions" --set data.doc_positions=restart

# generation with documents: the context padded to 2 cp chunks (padding rows
# in the last document) and one rank's text on cp 2
G="--set train.sample_every=6 --set train.sample_tokens=40"
./train $Y $S $LLAMA $G --set run.dir=$T/gen1 2>&1 | sed -n '/--- sample/,/^---$/p' >$T/gen1.txt
"${MPIRUN[@]}" -np 2 ./train $Y $S $LLAMA $G --set parallel.cp=2 --set run.dir=$T/gen2 2>&1 \
    | sed -n '/--- sample/,/^---$/p' >$T/gen2.txt
[ -s $T/gen1.txt ] && cmp -s $T/gen1.txt $T/gen2.txt && ok docmask_cp2_generation_same_text \
    || fail docmask_cp2_generation_same_text "$(head -c 200 $T/gen1.txt) vs $(head -c 200 $T/gen2.txt)"

# resume: switching documents on is refused (the same batches, another
# function of them), --force continues with them
R="$S --set train.steps=4 --set checkpoint.every=2"
./train $Y $R --set train.steps=2 --set run.dir=$T/rs >$T/rs1.txt 2>&1
out=$(./train $Y $R $D --set run.dir=$T/rs --resume auto 2>&1); rc=$?
if [ $rc -eq 2 ] && printf '%s\n' "$out" | grep -q "changed key 'data.doc_masking': false -> true"; then
    ok docmask_resume_refuses_switching_on
else fail docmask_resume_refuses_switching_on "rc $rc: $(printf '%s\n' "$out" | grep -m2 kiln)"; fi
./train $Y $R $D --set run.dir=$T/rs --resume auto --force >$T/rs2.txt 2>&1 && grep -q '"step":4' $T/rs/metrics.jsonl \
    && ok docmask_resume_force_continues || fail docmask_resume_force_continues "$(grep -m2 kiln $T/rs2.txt)"
