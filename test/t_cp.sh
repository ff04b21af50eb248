#!/usr/bin/env bash
# Context parallelism on the CPU backend under real Open MPI: the attention of
# both modes (ring, all-gather) against the one-rank op for cp 2, 3 and 4 and
# positions at model level (build/test/test_cp); whole models (a tiny GPT-2
# with learned positions and a tiny Llama with RoPE and grouped-query
# attention) at cp 2 and cp 4 against one rank, cp 2 x tp 2 and cp 2 x dp 2
# (ZeRO 1, 2 and 3); an MoE at cp 2 and 4, dropless, with the balancing bias
# and with a capacity, also under expert parallelism (ep 2 x cp 2, ep 4 over
# cp 2 x dp 2); generation;
# a checkpoint resumed cp 2 -> cp 1 -> cp 4;
# layouts that do not split refused on every rank; ./train plan's activation
# memory per rank falling with cp. One line per check.
#
# Tolerances (docs/parallel.md, "Correctness"): context parallelism computes
# the same function in another association order: attention's softmax sums
# and P V products per chunk, merged by log-sum-exp; dK/dV and the replicated
# gradients summed over the cp ranks; the loss as the mean of per-rank means
# of equal token counts. A few fp32 ulps (~1e-7 relative) per reassociation,
# which through 2 layers and 6 AdamW steps stays far below 1e-5 (measured:
# losses agree to the 6 digits metrics.jsonl prints, parameters within
# ~1e-6). So: the loss at every step within relative 1e-5, every final
# parameter within absolute 1e-5 (parameters are O(0.02-1)). A chunk at a
# wrong position or a block merged wrongly moves the first loss by 1e-3 or
# more (test_cp's counterfactuals: logits off by 0.3 and more).
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_cp
rm -rf "$T"
. test/ckpt_lib.sh
if ! command -v mpirun >/dev/null 2>&1; then skip cp "mpirun not found (make deps installs openmpi-bin)"; exit 0; fi
if ! ldd ./train | grep -q libmpi; then skip cp "./train is not an MPI build (make deps, then make)"; exit 0; fi
ckpt_setup
Y=$T/tiny.yaml
MPIRUN=(timeout 300 mpirun --allow-run-as-root --oversubscribe)

# 1. attention ops and positions: test_cp prints its own ok/FAIL lines (rank 0)
for np in 2 3 4; do
    out=$("${MPIRUN[@]}" -np $np ./build/test/test_cp 2>&1); rc=$?
    printf '%s\n' "$out" | grep -E '^(ok|FAIL) '
    [ $rc -eq 0 ] || fail cp_attention_np$np "exited $rc: $(printf '%s\n' "$out" | tail -n 3)"
done

# 2. whole models. 512 tokens a step = 4 micro-batches of 4 x 32 (1 or 2 per
# dp rank); seq_len 32 is 4 chunks of 8 at cp 2, 8 of 4 at cp 4.
S="--set batch.total_tokens=512 --set train.steps=6 --set checkpoint.every=6 --set checkpoint.async=false"
S="$S --set model.vocab_size=300 --set train.eval_every=3"
GPT2="--set model.n_head=4"
LLAMA="--set model.arch=llama --set model.n_head=8 --set model.n_kv_head=4 --set model.n_embd=64 --set model.ffn_hidden=96"

# equiv NAME MODEL NP SETTINGS...: the run against the model's one-rank reference
equiv() {
    local name=$1 model=$2 np=$3; shift 3
    local D=$T/$name
    "${MPIRUN[@]}" -np $np ./train $Y $S ${!model} "$@" --set run.dir=$D >$D.txt 2>&1
    local rc=$? why diff drc=1
    why=$(close_losses $T/ref_$model/metrics.jsonl $D/metrics.jsonl 2>&1)
    diff=$(./train ckpt-diff $T/ref_$model/checkpoints/step_00000006 $D/checkpoints/step_00000006 --quiet --tol 1e-5 \
        2>&1) && drc=0
    if [ $rc -eq 0 ] && [ $drc -eq 0 ] && [ -z "$why" ]; then
        ok "cp_equiv_$name # $(./train ckpt-diff $T/ref_$model/checkpoints/step_00000006 \
            $D/checkpoints/step_00000006 --tol 1e-5 2>&1 | grep -o 'params max abs diff [^ ]*')"
    else fail cp_equiv_$name "rc $rc: $why $diff $(grep -m2 error $D.txt)"; fi
}

for model in GPT2 LLAMA; do
    ./train $Y $S ${!model} --set run.dir=$T/ref_$model >$T/ref_$model.txt 2>&1 \
        || fail cp_reference_$model "$(tail -n 3 $T/ref_$model.txt)"
done
equiv gpt2_cp2_allgather GPT2 2 --set parallel.cp=2
equiv gpt2_cp4_ring GPT2 4 --set parallel.cp=4 --set parallel.cp_attention=ring
equiv llama_gqa_cp2_ring LLAMA 2 --set parallel.cp=2 --set parallel.cp_attention=ring
equiv llama_gqa_cp4_allgather LLAMA 4 --set parallel.cp=4
equiv llama_gqa_cp4_ring LLAMA 4 --set parallel.cp=4 --set parallel.cp_attention=ring
equiv llama_gqa_cp2_tp2_sp_ring LLAMA 4 --set parallel.cp=2 --set parallel.tp=2 --set parallel.cp_attention=ring
equiv gpt2_cp2_tp2_nosp GPT2 4 --set parallel.cp=2 --set parallel.tp=2 --set parallel.sequence_parallel=false
equiv llama_gqa_cp2_dp2_zero1 LLAMA 4 --set parallel.cp=2 --set parallel.zero=1
equiv gpt2_cp2_dp2_zero3_ring GPT2 4 --set parallel.cp=2 --set parallel.zero=3 --set parallel.cp_attention=ring
equiv llama_gqa_cp2_dp2_zero2_ring LLAMA 4 --set parallel.cp=2 --set parallel.zero=2 --set parallel.cp_attention=ring

# MoE under cp: each rank routes its two chunks of every sequence; the loads
# and the router's sums of a sequence are summed over the cp ranks before
# the aux loss, its gradient and the balancing bias use them, and with a
# capacity each chunk keeps, per expert, what the sequence's earlier chunks
# (on any rank) leave of it: one rank's routing and drops. Checked besides
# the losses and parameters: the step's expert loads and dropped fraction
# equal, aux and z within relative 1e-5 (t_ep.sh says why). With expert
# parallelism too (the ep group inside dp x cp: the cp pair itself, or
# across dp). capacity_factor 1 drops about 11% of the slots here.
MOE="$LLAMA --set model.mlp=moe --set model.moe.n_experts=4 --set model.moe.top_k=2 --set model.moe.expert_hidden=32"
MOE="$MOE --set model.moe.n_shared=1 --set model.moe.aux_loss_coef=0.01 --set model.moe.z_loss_coef=0.001"
BIAS="$MOE --set model.moe.router=sigmoid --set model.moe.bias_update_rate=0.001"
CAP="$MOE --set model.moe.capacity_factor=1"
moe_same() {
    python3 - "$1" "$2" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
if len(a) != len(b) or not a or "moe_load" not in a[0]:
    print("%d vs %d lines, moe_load %s" % (len(a), len(b), "moe_load" in (a or [{}])[0])); sys.exit(1)
for x, y in zip(a, b):
    if x.get("moe_load") != y.get("moe_load") or abs(x["moe_dropped"] - y["moe_dropped"]) > 1e-12:
        print("step %d: loads %s vs %s, dropped %r vs %r" % (x["step"], x.get("moe_load"), y.get("moe_load"),
                                                             x["moe_dropped"], y["moe_dropped"])); sys.exit(1)
    for k in ("moe_aux", "moe_z"):
        if abs(x[k] - y[k]) > 1e-5 * abs(x[k]) + 1e-12:
            print("step %d: %s %r vs %r" % (x["step"], k, x[k], y[k])); sys.exit(1)
PY
}
for model in MOE BIAS CAP; do
    ./train $Y $S ${!model} --set run.dir=$T/ref_$model >$T/ref_$model.txt 2>&1 \
        || fail cp_reference_$model "$(tail -n 3 $T/ref_$model.txt)"
done
# moe_equiv NAME MODEL NP SETTINGS...: equiv, and the router's figures
moe_equiv() {
    local name=$1 model=$2
    equiv "$@"
    local why
    why=$(moe_same $T/ref_$model/metrics.jsonl $T/$name/metrics.jsonl 2>&1)
    [ -z "$why" ] && ok cp_moe_figures_$name || fail cp_moe_figures_$name "$why"
}
moe_equiv moe_cp2_ring MOE 2 --set parallel.cp=2 --set parallel.cp_attention=ring
moe_equiv moe_cp4 MOE 4 --set parallel.cp=4
moe_equiv moe_bias_cp2_dp2_zero1 BIAS 4 --set parallel.cp=2 --set parallel.zero=1
moe_equiv moe_ep2_cp2 MOE 2 --set parallel.cp=2 --set parallel.ep=2
moe_equiv moe_bias_ep2_cp2_dp2_zero1 BIAS 4 --set parallel.cp=2 --set parallel.ep=2 --set parallel.zero=1
moe_equiv moe_ep4_cp2_dp2 MOE 4 --set parallel.cp=2 --set parallel.ep=4
moe_equiv moe_capacity_cp2 CAP 2 --set parallel.cp=2
moe_equiv moe_capacity_cp4_ring CAP 4 --set parallel.cp=4 --set parallel.cp_attention=ring
moe_equiv moe_capacity_ep2_cp2 CAP 2 --set parallel.cp=2 --set parallel.ep=2
moe_equiv moe_capacity_ep4_cp2_dp2_zero1 CAP 4 --set parallel.cp=2 --set parallel.ep=4 --set parallel.zero=1
# tp replicates the MoE layer: each tp rank's cp group sums its own copy
moe_equiv moe_capacity_cp2_tp2_sp CAP 4 --set parallel.cp=2 --set parallel.tp=2
# generation with a capacity: the context padded to 2 cp chunks, the
# capacity of its real tokens (the padding comes after them): one rank's text
G="--set train.sample_every=6 --set train.sample_tokens=40"
./train $Y $S $CAP $G --set run.dir=$T/moe_gen1 2>&1 | sed -n '/--- sample/,/^---$/p' >$T/moe_gen1.txt
"${MPIRUN[@]}" -np 2 ./train $Y $S $CAP $G --set parallel.cp=2 --set run.dir=$T/moe_gen2 2>&1 \
    | sed -n '/--- sample/,/^---$/p' >$T/moe_gen2.txt
[ -s $T/moe_gen1.txt ] && cmp -s $T/moe_gen1.txt $T/moe_gen2.txt && ok cp_moe_capacity_generation_same_text \
    || fail cp_moe_capacity_generation_same_text "$(head -c 200 $T/moe_gen1.txt) vs $(head -c 200 $T/moe_gen2.txt)"
python3 -c "import json,sys; d=[json.loads(l)['moe_dropped'] for l in open(sys.argv[1])]; sys.exit(0 if min(d) > 0.01 else 1)" \
    $T/ref_CAP/metrics.jsonl && ok cp_moe_capacity_drops || fail cp_moe_capacity_drops "the capacity case drops nothing"

grep -q 'context parallel: 2 ranks, ring attention; each sequence of 32 tokens is 4 chunks of 8, this rank holds chunks 0 and 3' \
    $T/llama_gqa_cp2_ring.txt && ok cp_start_up_line || fail cp_start_up_line "$(grep -m2 'context parallel' $T/llama_gqa_cp2_ring.txt)"
why=$(ranks_comm_why $T/llama_gqa_cp2_ring cp 2) # blocked on K/V, from ranks.jsonl
[ -z "$why" ] && ok cp_reports_blocked_fraction || fail cp_reports_blocked_fraction "$why"

# 3. generation: every cp rank runs the forward on its chunks (the context
# padded to 2 cp chunks), the chunk's rank broadcasts the logits row, and
# every rank draws the same token: the text of one rank.
G="--set train.sample_every=6 --set train.sample_tokens=40"
./train $Y $S $LLAMA $G --set run.dir=$T/gen1 2>&1 | sed -n '/--- sample/,/^---$/p' >$T/gen1.txt
"${MPIRUN[@]}" -np 2 ./train $Y $S $LLAMA $G --set parallel.cp=2 --set run.dir=$T/gen2 2>&1 \
    | sed -n '/--- sample/,/^---$/p' >$T/gen2.txt
[ -s $T/gen1.txt ] && cmp -s $T/gen1.txt $T/gen2.txt && ok cp_generation_same_text \
    || fail cp_generation_same_text "$(head -c 200 $T/gen1.txt) vs $(head -c 200 $T/gen2.txt)"

# 4. resume on another cp: cp 2 for 8 steps -> one rank to 14 -> cp 4 (ring)
# to 20, against 20 steps on one rank (constant schedule; the checkpoint and
# the data position are those of the whole sequence, whatever cp).
C="$S $LLAMA --set schedule.kind=constant --set checkpoint.every=2 --set train.steps=20"
./train $Y $C --set run.dir=$T/cref >$T/cref.txt 2>&1
"${MPIRUN[@]}" -np 2 ./train $Y $C --set parallel.cp=2 --set run.dir=$T/rs --set train.steps=8 >$T/rs1.txt 2>&1
./train $Y $C --set run.dir=$T/rs --set train.steps=14 --resume auto >$T/rs2.txt 2>&1
"${MPIRUN[@]}" -np 4 ./train $Y $C --set parallel.cp=4 --set parallel.cp_attention=ring --set run.dir=$T/rs \
    --resume auto >$T/rs3.txt 2>&1
rc=$?
why=$(close_losses $T/cref/metrics.jsonl $T/rs/metrics.jsonl 2>&1)
diff=$(./train ckpt-diff $T/cref/checkpoints/step_00000020 $T/rs/checkpoints/step_00000020 --quiet --tol 1e-5 2>&1)
drc=$?
if [ $rc -eq 0 ] && [ $drc -eq 0 ] && [ -z "$why" ] && grep -q 'cp 4 x tp 1' $T/rs3.txt; then ok cp_resume_cp2_cp1_cp4
else fail cp_resume_cp2_cp1_cp4 "rc $rc: $why $diff $(grep -m2 -h error $T/rs[123].txt)"; fi

# 5. layouts that do not split: one line, exit 2 (test/lib.sh mpi_refuse).
refuse() { mpi_refuse cp "$@"; }
refuse seq_len_cp3 3 "does not split into 2 x cp = 6 chunks" $LLAMA --set parallel.cp=3
refuse ranks 3 "to be a multiple of pp x cp x tp = 2" $LLAMA --set parallel.cp=2

# 6. ./train plan: a rank's activations fall with cp (its T / cp rows of
# every buffer; the K/V buffers of cp.c added), for the 32k-token config, in
# the fp32 this bound was set for (device cpu; bf16's fp32 statistics fall less)
for cp in 1 2 4; do
    ./train plan configs/llama-tiny-32k.yaml --gpus $cp --set parallel.cp=$cp --set device=cpu >$T/plan$cp.txt 2>&1 \
        || fail cp_plan_cp$cp "$(tail -n 2 $T/plan$cp.txt)"
done
a=$(for cp in 1 2 4; do awk '$1 == "activations" && NF == 3 {print $2 $3}' $T/plan$cp.txt; done | tr '\n' ' ')
python3 - "$T/plan1.txt" "$T/plan2.txt" "$T/plan4.txt" <<'PY' && ok "cp_plan_activations_fall # $a" \
    || fail cp_plan_activations_fall "$a"
import re, sys
units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
v = []
for p in sys.argv[1:]:
    m = re.search(r"^  activations +([0-9.]+) (\w+)$", open(p).read(), re.M)
    v.append(float(m.group(1)) * units[m.group(2)])
sys.exit(0 if v[0] > 1.8 * v[1] and v[1] > 1.8 * v[2] > 0 else 1)
PY
grep -q "context parallel       cp 4 (ring): each rank holds 2 of 8 chunks of 4096 tokens" $T/plan4.txt \
    && ok cp_plan_layout_line || fail cp_plan_layout_line "$(grep -m1 "context parallel  " $T/plan4.txt)"
