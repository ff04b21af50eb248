#!/usr/bin/env bash
# Expert parallelism on the CPU backend under real Open MPI: the dispatcher
# test (build/test/test_ep at ep 2 and 4: dispatch -> identity expert ->
# combine gives every token times the sum of its gates, capacity and
# dropless, ranks and experts without rows); a tiny MoE Llama at ep 2, ep 4,
# ep 2 x dp 2 (ZeRO 0 and 1), ep 2 x tp 2 and pp 2 x ep 2 (every pipeline
# schedule) against one rank, with a capacity factor and dropless with the
# auxiliary-loss-free bias; Muon and Adafactor at ep 2, ep 2 x dp 2 and ep 2 x
# tp 2, resumed ep 2 -> ep 1 and ep 1 -> ep 2 x dp 2; the checkpoint
# resharded ep 4 -> ep 1 -> ep 2 and pp 2 x ep 2 -> one rank -> pp 2 x ep 2,
# data position included; the
# figures in metrics.jsonl; layouts refused on every rank. One line per check.
#
# Tolerances (docs/parallel.md, "Correctness"): the experts' products see the
# rows of several ranks' micro-batches at once, so each expert's weight
# gradient is one sum over more rows instead of several sums added (and
# EDP's all-reduce adds the rest): the same numbers in another association
# order, a few ulps (~1e-7 relative) each. Through 2 layers and 6 AdamW
# steps that stays far below 1e-5 (measured: losses equal to the 6 digits
# metrics.jsonl prints, parameters within 3e-7; pp 2 x ep 2 within 2.8e-7,
# interleaved on 4 layers 4.9e-7: the stages of this untied Llama reorder
# no sum, only the grad norm's). So: every step's loss within
# relative 1e-5, every final parameter and moment within absolute 1e-5
# (ckpt-diff; the balancing bias moves by +-rate = 1e-3 a step, so a single
# different sign is caught), the aux and z losses within relative 1e-5 (their
# inputs, the router's probabilities, carry the parameters' ulps), and the
# expert loads equal: routing is a comparison of scores whose gaps are far
# larger than the ulps, so any difference there is a bug.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_ep
rm -rf "$T"
. test/ckpt_lib.sh
if ! command -v mpirun >/dev/null 2>&1; then skip ep "mpirun not found (make deps installs openmpi-bin)"; exit 0; fi
if ! ldd ./train | grep -q libmpi; then skip ep "./train is not an MPI build (make deps, then make)"; exit 0; fi
ckpt_setup
Y=$T/tiny.yaml
MPIRUN=(timeout 300 mpirun --allow-run-as-root --oversubscribe)

# The dispatcher on 2 and 4 ranks: rank 0 prints the checks (ep2_*, ep4_*).
BIN=build/test/test_ep
if [ -x $BIN ]; then
    for np in 2 4; do
        out=$("${MPIRUN[@]}" -np $np $BIN 2>$T/test_ep$np.err); rc=$?
        printf '%s\n' "$out" | grep -E '^(ok|FAIL|skip) '
        n=$(printf '%s\n' "$out" | grep -c '^ok ')
        if [ $rc -eq 0 ] && [ "$n" -ge 40 ]; then ok ep${np}_dispatcher_complete
        else fail ep${np}_dispatcher_complete "exit $rc, $n ok lines: $(tail -c 300 $T/test_ep$np.err)"; fi
    done
else
    fail ep_dispatcher "$BIN not built (make build/test/test_ep)"
fi

# 512 tokens a step = 4 micro-batches of 4 x 32: 1 per rank on 4 ranks, 2 on 2.
S="--set batch.total_tokens=512 --set train.steps=6 --set checkpoint.every=3 --set checkpoint.async=false"
S="$S --set model.vocab_size=300 --set train.eval_every=3"
LLAMA="--set model.arch=llama --set model.n_head=8 --set model.n_kv_head=4 --set model.n_embd=64 --set model.ffn_hidden=96"
# 4 experts (ep 4: one per rank), top 2, a shared expert, capacity 1.25
MOE="$LLAMA --set model.mlp=moe --set model.moe.n_experts=4 --set model.moe.top_k=2 --set model.moe.expert_hidden=32"
MOE="$MOE --set model.moe.n_shared=1 --set model.moe.capacity_factor=1.25 --set model.moe.aux_loss_coef=0.01"
MOE="$MOE --set model.moe.z_loss_coef=0.001"
# Muon (the experts' owners among their EDP group) and Adafactor (the
# experts' statistics summed over EDP) on the capacity model, their rates
# as t_muon.sh's and t_adafactor.sh's
MUON="$MOE --set optim.name=muon --set optim.lr=0.02 --set schedule.kind=constant"
ADAF="$MOE --set optim.name=adafactor --set optim.lr=0.01 --set schedule.kind=constant"
LION="$MOE --set optim.name=lion --set optim.lr=0.0003 --set schedule.kind=constant"
# one expert per ep rank over 3 layers: 9 equal expert tensors, so ZeRO-1's
# two EDP blocks cut the fifth in half (with 12 every tensor stays whole in
# one block, and a sum left out of the EDP reduction would go unseen)
CUT="--set model.n_layer=3 --set model.moe.n_experts=2 --set model.moe.top_k=1"
MUON_CUT="$MUON $CUT"
ADAF_CUT="$ADAF $CUT"
# dropless, sigmoid router, DeepSeek-V3's balancing bias
FREE="$LLAMA --set model.mlp=moe --set model.moe.n_experts=4 --set model.moe.top_k=2 --set model.moe.expert_hidden=32"
FREE="$FREE --set model.moe.router=sigmoid --set model.moe.capacity_factor=0 --set model.moe.bias_update_rate=0.001"

# moe_same REF RUN: the step's expert loads equal, aux and z within relative
# 1e-5, every step; prints the first difference
moe_same() {
    python3 - "$1" "$2" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
for x, y in zip(a, b):
    if x.get("moe_load") != y.get("moe_load"):
        print("step %d: loads %s vs %s" % (x["step"], x.get("moe_load"), y.get("moe_load"))); sys.exit(1)
    for k in ("moe_aux", "moe_z"):
        if abs(x[k] - y[k]) > 1e-5 * abs(x[k]) + 1e-12:
            print("step %d: %s %r vs %r" % (x["step"], k, x[k], y[k])); sys.exit(1)
if len(a) != len(b) or not a or "moe_load" not in a[0]:
    print("%d vs %d lines, moe_load %s" % (len(a), len(b), "moe_load" in (a or [{}])[0])); sys.exit(1)
PY
}

# equiv NAME MODEL NP EP TP ZERO [ARGS...]: the run against the model's one-rank reference
equiv() {
    local name=$1 model=$2 np=$3 ep=$4 tp=$5 z=$6
    shift 6
    local D=$T/$name
    "${MPIRUN[@]}" -np $np ./train $Y $S ${!model} --set parallel.ep=$ep --set parallel.tp=$tp --set parallel.zero=$z \
        --set run.dir=$D "$@" >$D.txt 2>&1
    local rc=$? why moe diff drc=1
    why=$(close_losses $T/ref_$model/metrics.jsonl $D/metrics.jsonl 2>&1)
    moe=$(moe_same $T/ref_$model/metrics.jsonl $D/metrics.jsonl 2>&1)
    diff=$(./train ckpt-diff $T/ref_$model/checkpoints/step_00000006 $D/checkpoints/step_00000006 --quiet --tol 1e-5 \
        2>&1) && drc=0
    if [ $rc -eq 0 ] && [ $drc -eq 0 ] && [ -z "$why" ] && [ -z "$moe" ]; then ok ep_equiv_$name
    else fail ep_equiv_$name "rc $rc: $why $moe $diff $(grep -m2 error $D.txt)"; fi
}

MOE4="$MOE --set model.n_layer=4"
for model in MOE FREE MOE4 MUON ADAF MUON_CUT ADAF_CUT LION; do
    ./train $Y $S ${!model} --set run.dir=$T/ref_$model >$T/ref_$model.txt 2>&1 \
        || fail ep_reference_$model "$(tail -n 3 $T/ref_$model.txt)"
done
equiv capacity_ep2 MOE 2 2 1 0
equiv capacity_ep4 MOE 4 4 1 0
equiv capacity_ep2_dp2 MOE 4 2 1 0
equiv capacity_ep2_dp2_zero1 MOE 4 2 1 1
equiv capacity_ep2_tp2 MOE 4 2 2 0
equiv capacity_ep2_zero1 MOE 2 2 1 1
equiv dropless_bias_ep2 FREE 2 2 1 0
equiv dropless_bias_ep4 FREE 4 4 1 0
equiv dropless_bias_ep2_dp2_zero1 FREE 4 2 1 1
equiv dropless_bias_ep2_tp2 FREE 4 2 2 0
equiv dropless_bias_ep2_tp2_zero1 FREE 4 2 2 1
# every collective agreed on before it runs (monitor.check_collectives): the
# all-to-alls' per-rank counts differ, the calls must not
equiv capacity_ep2_dp2_checked MOE 4 2 1 1 --set monitor.check_collectives=true
# the checkpoint writes are shared (docs/parallel.md, "Checkpoints"): in ep 2
# on 4 ranks under ZeRO 0 each EDP pair cuts its experts in two and all four
# ranks cut the rest, so every rank wrote pieces of both (and ckpt-diff above
# assembled them on one rank)
info=$(./train ckpt-info $T/capacity_ep2_dp2/checkpoints/step_00000006 2>&1)
xr=$(printf '%s\n' "$info" | grep ' tensor ' | grep '\.experts\.' | grep -o ' rank [0-9]* ' | sort -u | wc -l)
dr=$(printf '%s\n' "$info" | grep ' tensor ' | grep -v -e '\.experts\.' -e ' optim\.' | grep -o ' rank [0-9]* ' \
    | sort -u | wc -l)
[ "$xr" -eq 4 ] && [ "$dr" -eq 4 ] && ok ep_checkpoint_shares_over_edp_and_dp \
    || fail ep_checkpoint_shares_over_edp_and_dp "expert pieces from $xr rank(s), the rest from $dr (want 4 and 4)"

# With a pipeline (pp 2 x dp 2, ep 2 inside each stage's dp): every
# micro-batch in flight keeps its own dispatch state (ep.c: one per
# activation slot) from its forward to its backward; the ep group lies in one
# stage (mesh.c), so its ranks run the same action list and issue the
# all-to-alls in one order. Every schedule: zb_h1's all-to-alls of the
# backward run in its input part (B); interleaved on 4 layers (MOE4).
PP="--set parallel.pp=2 --set parallel.pp_schedule"
equiv pp2_1f1b_capacity MOE 4 2 1 0 $PP=1f1b
equiv pp2_gpipe_capacity MOE 4 2 1 1 $PP=gpipe
equiv pp2_zb_h1_capacity MOE 4 2 1 0 $PP=zb_h1
equiv pp2_1f1b_dropless_bias FREE 4 2 1 1 $PP=1f1b
equiv pp2_zb_h1_dropless_bias FREE 4 2 1 0 $PP=zb_h1
equiv pp2_interleaved_capacity MOE4 4 2 1 0 $PP=interleaved_1f1b --set parallel.pp_virtual=2
# and with context parallelism inside the stages (pp 2 x cp 2, the ep pair
# the cp pair): MoE's cp sums and the capacity split over chunks run in
# every slot's forward
equiv pp2_cp2_1f1b_capacity MOE 4 2 1 0 $PP=1f1b --set parallel.cp=2
equiv pp2_cp2_zb_h1_dropless_bias FREE 4 2 1 1 $PP=zb_h1 --set parallel.cp=2
D=$T/pp2_1f1b_capacity
grep -q 'micro-batch in flight (2 such sets' $D.txt && ok ep_pp_start_up_line \
    || fail ep_pp_start_up_line "$(grep -m1 'expert parallel' $D.txt)"

# Muon and Adafactor under ep: the tolerances above hold. Muon's Newton-
# Schulz amplifies the gradient sums' rounding along small singular
# directions (t_muon.sh: one step's update within 1e-5 relative), measured
# here: final parameters within 1.7e-6 of one rank (the worst an AdamW
# tensor, lm_head), moments within 1e-8; Adafactor within 2.4e-7. ZeRO 0 and
# 1, EDP of 1 (ep 2) and 2 (ep 2 x dp 2), and ep 2 x tp 2 (the experts,
# replicated over tp, orthogonalised by their tp owner).
# The optimizer state is also compared relative to the reference's, entry by
# entry (test/ckpt_update.py --state): Adafactor's averages are of g^2
# (~1e-7 here), which ckpt-diff's absolute 1e-5 cannot tell from zero.
# Measured 1.1e-6 to 2.5e-6 (the gradients' reassociation through six
# steps); a statistic summed over the wrong group is off by its whole size
# (relative ~1: half a tensor's sums, or another expert's), so 1e-4.
state_close() { # NAME MODEL
    local why
    why=$($NPY test/ckpt_update.py --state $T/ref_$2/checkpoints/step_00000006 $T/$1/checkpoints/step_00000006 \
        --tol 1e-4 2>&1) && ok ep_state_$1 || fail ep_state_$1 "$why"
    echo "# $1: $why"
}
# Muon on the cut model (top 1 of 2 experts, lr 0.02 on its AdamW part too)
# is touchier: the same model on 4 dp ranks without ep (main's code) ends
# 7.9e-5 from one rank in lm_head, ep 2 x dp 2 8.2e-5, past 1e-5 absolute.
# So its parameters are compared as six steps' updates from the start, |dB -
# dA| / |dA| per tensor (test/ckpt_update.py): measured 1.6e-5 without ep
# and 1.7e-5 with; an expert's update lost or applied to another's holder is
# off by ~1, so 1e-4.
./train $Y $S $MUON_CUT --set optim.lr=0 --set train.steps=1 --set checkpoint.every=1 --set run.dir=$T/start_MUON_CUT \
    >$T/start_MUON_CUT.txt 2>&1
equiv_update() { # NAME MODEL NP EP TP ZERO
    local name=$1 model=$2 D=$T/$1 rc why moe upd
    "${MPIRUN[@]}" -np $3 ./train $Y $S ${!model} --set parallel.ep=$4 --set parallel.tp=$5 --set parallel.zero=$6 \
        --set run.dir=$D >$D.txt 2>&1
    rc=$?
    why=$(close_losses $T/ref_$model/metrics.jsonl $D/metrics.jsonl 2>&1)
    moe=$(moe_same $T/ref_$model/metrics.jsonl $D/metrics.jsonl 2>&1)
    local urc=1
    upd=$($NPY test/ckpt_update.py $T/start_$model/checkpoints/step_00000001 $T/ref_$model/checkpoints/step_00000006 \
        $D/checkpoints/step_00000006 --tol 1e-4 2>&1) && urc=0
    if [ $rc -eq 0 ] && [ $urc -eq 0 ] && [ -z "$why" ] && [ -z "$moe" ]; then ok ep_equiv_$name
    else fail ep_equiv_$name "rc $rc: $why $moe $upd $(grep -m2 error $D.txt)"; fi
    echo "# $name: $upd"
}
for opt in MUON ADAF; do
    o=$(printf '%s' $opt | tr A-Z a-z)
    equiv ${o}_ep2 $opt 2 2 1 0
    equiv ${o}_ep2_zero1 $opt 2 2 1 1
    equiv ${o}_ep2_dp2 $opt 4 2 1 0
    equiv ${o}_ep2_dp2_zero1 $opt 4 2 1 1
    equiv ${o}_ep2_tp2_zero1 $opt 4 2 2 1
    [ $opt = ADAF ] && equiv ${o}_cut_ep2_dp2_zero1 ${opt}_CUT 4 2 1 1
    [ $opt = MUON ] && equiv_update ${o}_cut_ep2_dp2_zero1 ${opt}_CUT 4 2 1 1
    state_close ${o}_ep2_dp2 $opt
    state_close ${o}_ep2_dp2_zero1 $opt
    state_close ${o}_cut_ep2_dp2_zero1 ${opt}_CUT
done
# the experts' owners: over the 2 EDP ranks of each ep rank, the dense matrices over dp
grep -q 'muon owners over 4 dp rank(s) (the 12 expert matrices here over the 2 edp rank(s) holding them)' \
    $T/muon_ep2_dp2_zero1.txt && ok ep_muon_expert_owners_over_edp \
    || fail ep_muon_expert_owners_over_edp "$(grep -m1 'muon owners' $T/muon_ep2_dp2_zero1.txt)"
grep -h 'muon owners' $T/muon_ep2_dp2_zero1.txt | sed 's/^/# /'
# each expert's momentum written once, by its owner: expert 1 (ep rank 0's
# second) is owned by EDP rank 1 of ep rank 0, world rank 2
n=$(./train ckpt-info $T/muon_ep2_dp2_zero1/checkpoints/step_00000006 | grep -c 'optim.m/layers.0.mlp.experts.1.down_proj.weight ')
r=$(./train ckpt-info $T/muon_ep2_dp2_zero1/checkpoints/step_00000006 | grep -c 'optim.m/layers.0.mlp.experts.1.down_proj.weight .* rank 2 ')
[ "$n" -eq 1 ] && [ "$r" -eq 1 ] && ok ep_muon_expert_momentum_once || fail ep_muon_expert_momentum_once "$n entries, $r from rank 2"
# with a pipeline too (pp 2 x ep 2 over dp 2, ZeRO 1): measured parameters
# within 6.2e-7 (Muon) and 2.4e-7 (Adafactor), state within 2.1e-6 relative
equiv muon_pp2_ep2_zero1 MUON 4 2 1 1 $PP=1f1b
equiv adafactor_pp2_ep2_zero1 ADAF 4 2 1 1 $PP=zb_h1
state_close muon_pp2_ep2_zero1 MUON
state_close adafactor_pp2_ep2_zero1 ADAF
# Lion (sign of the interpolated momentum, one state buffer) through the
# ZeRO-1 segments over dp and EDP: measured parameters equal to one rank's
# (a sign is robust to the sums' reassociation), momentum within 5e-10
equiv lion_ep2_dp2_zero1 LION 4 2 1 1
state_close lion_ep2_dp2_zero1 LION
# resharded: ep 2 x dp 2 ZeRO 1 for 3 steps -> one rank to 6, and one rank
# for 3 -> ep 2 x dp 2 ZeRO 1 to 6, against six steps on one rank
for opt in MUON ADAF; do
    o=$(printf '%s' $opt | tr A-Z a-z)
    for dir in down up; do
        D=$T/${o}_reshard_$dir
        if [ $dir = down ]; then
            "${MPIRUN[@]}" -np 4 ./train $Y $S ${!opt} --set parallel.ep=2 --set parallel.zero=1 --set train.steps=3 \
                --set run.dir=$D >$D.1.txt 2>&1
            ./train $Y $S ${!opt} --set run.dir=$D --resume auto >$D.txt 2>&1
        else
            ./train $Y $S ${!opt} --set train.steps=3 --set run.dir=$D >$D.1.txt 2>&1
            "${MPIRUN[@]}" -np 4 ./train $Y $S ${!opt} --set parallel.ep=2 --set parallel.zero=1 --set run.dir=$D \
                --resume auto >$D.txt 2>&1
        fi
        rc=$?
        why=$(close_losses $T/ref_$opt/metrics.jsonl $D/metrics.jsonl 2>&1)
        drc=1
        diff=$(./train ckpt-diff $T/ref_$opt/checkpoints/step_00000006 $D/checkpoints/step_00000006 --quiet --tol 1e-5 \
            2>&1) && drc=0
        rs=$(resumed_why $D/summary.json ep=2 to.world=1)
        [ $dir = up ] && rs=$(resumed_why $D/summary.json ep=1 to.world=4 to.ep=2)
        if [ $rc -eq 0 ] && [ $drc -eq 0 ] && [ -z "$why" ] && [ -z "$rs" ]; then
            ok ep_${o}_reshard_$dir
        else fail ep_${o}_reshard_$dir "rc $rc: $why $rs $diff $(grep -m2 -h -e error -e resharded $D.txt)"; fi
    done
done

# Generation under ep: every rank runs the forwards (each MoE layer an
# all-to-all) and draws the same tokens: the text of one rank.
G="--set train.sample_every=6 --set train.sample_tokens=40"
./train $Y $S $MOE $G --set run.dir=$T/gen1 2>&1 | sed -n '/--- sample/,/^---$/p' >$T/gen1.txt
"${MPIRUN[@]}" -np 2 ./train $Y $S $MOE $G --set parallel.ep=2 --set run.dir=$T/gen2 2>&1 \
    | sed -n '/--- sample/,/^---$/p' >$T/gen2.txt
[ -s $T/gen1.txt ] && cmp -s $T/gen1.txt $T/gen2.txt && ok ep_generation_same_text \
    || fail ep_generation_same_text "$(head -c 200 $T/gen1.txt) vs $(head -c 200 $T/gen2.txt)"

# ./train plan: the experts per rank and the all-to-alls' bytes; ZeRO 2 refused
out=$(./train plan configs/moe-tiny.yaml --gpus 2 --set parallel.ep=2 2>&1); rc=$?
[ $rc -eq 0 ] && printf '%s\n' "$out" | grep -q 'expert parallel        ep 2: per rank 4 of 8 experts' &&
    printf '%s\n' "$out" | grep -q 'comm per step, ep' && ok ep_plan_lines || fail ep_plan_lines "rc $rc: $out"
out=$(./train plan configs/moe-tiny.yaml --gpus 2 --set parallel.ep=2 --set parallel.zero=3 2>&1); rc=$?
[ $rc -eq 2 ] && printf '%s\n' "$out" | grep -q 'ZeRO 0 or 1' && ok ep_plan_refuses_zero3 \
    || fail ep_plan_refuses_zero3 "rc $rc: $out"

# The balancing bias moved in the reference (rate 0.001 a step, by the sign
# of each expert's distance from the mean load), so the comparisons above
# compared a bias that changed: between steps 3 and 6 it moves by 0.001 to
# 0.003 unless every load sat exactly at the mean.
d=$(./train ckpt-diff $T/ref_FREE/checkpoints/step_00000003 $T/ref_FREE/checkpoints/step_00000006 2>&1 \
    | awk '/^ *layers.0.mlp.gate.e_score_correction_bias / {print $NF}')
if [ -n "$d" ] && python3 -c "import sys; sys.exit(0 if float('$d') >= 5e-4 else 1)"; then ok ep_reference_bias_moves
else fail ep_reference_bias_moves "layer 0's bias moved by '$d' from step 3 to 6"; fi

# The figures: per-rank rows sent, received and run, the imbalance, the
# all-to-all's blocked time (metrics.jsonl, ranks at logged steps, the end).
D=$T/capacity_ep4
python3 - $D/metrics.jsonl <<'PY' && ok ep_metrics_rows_per_rank || fail ep_metrics_rows_per_rank "$(head -c 300 $D/metrics.jsonl)"
import json, sys
for l in open(sys.argv[1]):
    x = json.loads(l)
    s, r, w = x["ep_sent"], x["ep_recv"], x["ep_rows"]
    assert len(s) == len(r) == len(w) == 4 and sum(s) == sum(r) > 0 and x["ep_imbalance"] >= 1
    # every slot kept is run once: 2 layers x (slots routed - dropped), all ranks
    kept = sum(sum(v) for v in x["moe_load"]) * (1 - x["moe_dropped"])
    assert abs(sum(w) - kept) < 0.5, (sum(w), kept)
PY
why=$(ranks_comm_why $D ep 4) # the all-to-all's blocked time per rank
[ -z "$why" ] && ok ep_metrics_blocked_time || fail ep_metrics_blocked_time "$why"
grep -q 'expert parallel: 4 ranks, experts 0..0 of 4 here' $D.txt && ok ep_start_up_line \
    || fail ep_start_up_line "$(grep -m2 'expert parallel' $D.txt)"
# each ep rank wrote its own experts: rank 3 holds expert 3
n=$(./train ckpt-info $D/checkpoints/step_00000006 | grep 'experts.3.' | grep -c ' rank 3 ')
[ "$n" -gt 0 ] && ok ep_checkpoint_experts_per_rank || fail ep_checkpoint_experts_per_rank "no expert 3 pieces from rank 3"

# Resharding: ep 4 (dp 4) for 8 steps -> one rank to 14 -> ep 2 x dp 2 with
# ZeRO 1 to 20, against 20 steps on one rank (constant schedule: a shorter run
# has the same learning rates; the data position is global, so it carries over).
C="$S $MOE --set schedule.kind=constant --set checkpoint.every=2 --set train.steps=20"
./train $Y $C --set run.dir=$T/cref >$T/cref.txt 2>&1
"${MPIRUN[@]}" -np 4 ./train $Y $C --set parallel.ep=4 --set run.dir=$T/rs --set train.steps=8 >$T/rs1.txt 2>&1
./train $Y $C --set run.dir=$T/rs --set train.steps=14 --resume auto >$T/rs2.txt 2>&1
cp $T/rs/summary.json $T/rs2.summary.json 2>/dev/null
"${MPIRUN[@]}" -np 4 ./train $Y $C --set parallel.ep=2 --set parallel.zero=1 --set run.dir=$T/rs --resume auto \
    >$T/rs3.txt 2>&1
rc=$?
why=$(close_losses $T/cref/metrics.jsonl $T/rs/metrics.jsonl 2>&1)
moe=$(moe_same $T/cref/metrics.jsonl $T/rs/metrics.jsonl 2>&1)
diff=$(./train ckpt-diff $T/cref/checkpoints/step_00000020 $T/rs/checkpoints/step_00000020 --quiet --tol 1e-5 2>&1)
drc=$?
rs="$(resumed_why $T/rs2.summary.json ep=4 to.world=1)$(resumed_why $T/rs/summary.json ep=1 to.world=4 to.dp=4 to.ep=2)"
if [ $rc -eq 0 ] && [ $drc -eq 0 ] && [ -z "$why" ] && [ -z "$moe" ] && [ -z "$rs" ]; then ok ep_reshard_ep4_ep1_ep2dp2
else fail ep_reshard_ep4_ep1_ep2dp2 "rc $rc: $why $moe $rs $diff $(grep -m2 -h -e error -e resumed $T/rs[123].txt)"; fi

# From a pipeline and back: pp 2 x ep 2 (1f1b) for 8 steps -> one rank to 14
# -> pp 2 x ep 2 (zb_h1, ZeRO 1) to 20, against the same 20 steps on one rank.
"${MPIRUN[@]}" -np 4 ./train $Y $C --set parallel.ep=2 $PP=1f1b --set run.dir=$T/rp --set train.steps=8 \
    >$T/rp1.txt 2>&1
./train $Y $C --set run.dir=$T/rp --set train.steps=14 --resume auto >$T/rp2.txt 2>&1
cp $T/rp/summary.json $T/rp2.summary.json 2>/dev/null
"${MPIRUN[@]}" -np 4 ./train $Y $C --set parallel.ep=2 $PP=zb_h1 --set parallel.zero=1 --set run.dir=$T/rp \
    --resume auto >$T/rp3.txt 2>&1
rc=$?
why=$(close_losses $T/cref/metrics.jsonl $T/rp/metrics.jsonl 2>&1)
moe=$(moe_same $T/cref/metrics.jsonl $T/rp/metrics.jsonl 2>&1)
diff=$(./train ckpt-diff $T/cref/checkpoints/step_00000020 $T/rp/checkpoints/step_00000020 --quiet --tol 1e-5 2>&1)
drc=$?
rs="$(resumed_why $T/rp2.summary.json world=4 pp=2 ep=2 to.world=1)$(resumed_why $T/rp/summary.json world=1 to.pp=2 to.dp=2)"
if [ $rc -eq 0 ] && [ $drc -eq 0 ] && [ -z "$why" ] && [ -z "$moe" ] && [ -z "$rs" ]; then ok ep_reshard_pp2ep2_ep1_pp2ep2
else fail ep_reshard_pp2ep2_ep1_pp2ep2 "rc $rc: $why $moe $rs $diff $(grep -m2 -h -e error -e resumed $T/rp[123].txt)"; fi

# The same layout resumed is the same run, bit for bit (DESIGN.md: nothing
# is lost): ep 2 x dp 2, ZeRO 1, dropless with the bias, 3 steps + 3 resumed
# against 6 straight (constant schedule: the shorter run has the same rates).
B="$S $FREE --set schedule.kind=constant --set parallel.ep=2 --set parallel.zero=1"
"${MPIRUN[@]}" -np 4 ./train $Y $B --set run.dir=$T/bit_full >$T/bit_full.txt 2>&1
"${MPIRUN[@]}" -np 4 ./train $Y $B --set run.dir=$T/bit_res --set train.steps=3 >$T/bit_res1.txt 2>&1
"${MPIRUN[@]}" -np 4 ./train $Y $B --set run.dir=$T/bit_res --resume auto >$T/bit_res2.txt 2>&1
rc=$?
diff=$(./train ckpt-diff $T/bit_full/checkpoints/step_00000006 $T/bit_res/checkpoints/step_00000006 --quiet --tol 0 2>&1)
drc=$?
if [ $rc -eq 0 ] && [ $drc -eq 0 ] && [ "$(losses $T/bit_full/metrics.jsonl)" = "$(losses $T/bit_res/metrics.jsonl)" ] &&
   grep -q 'resumed from' $T/bit_res2.txt; then ok ep_resume_bit_identical
else fail ep_resume_bit_identical "rc $rc: $diff $(grep -m2 -h error $T/bit_*.txt)"; fi

# HuggingFace interop: init.from an HF directory under ep 2 (each rank takes
# its experts from the whole files) trains as one rank from it does, and the
# ep run's checkpoint (experts from both ranks) exports whole. OLMoE's layout:
# no shared experts, softmax router, QK-norm over the whole projection.
OLMOE="$LLAMA --set model.qk_norm=full --set model.mlp=moe --set model.moe.n_experts=4 --set model.moe.top_k=2"
OLMOE="$OLMOE --set model.moe.expert_hidden=32"
H="$S $OLMOE --set train.steps=3"
./train $Y $H --set run.dir=$T/hf_src >$T/hf_src.txt 2>&1 &&
    ./train export $T/hf_src/checkpoints/step_00000003 --format hf --out $T/hf_dir >$T/hf_export.txt 2>&1
./train $Y $H --set "init.from=$T/hf_dir" --set run.dir=$T/hf_one >$T/hf_one.txt 2>&1
"${MPIRUN[@]}" -np 2 ./train $Y $H --set "init.from=$T/hf_dir" --set parallel.ep=2 --set run.dir=$T/hf_ep2 >$T/hf_ep2.txt 2>&1
rc=$?
why=$(close_losses $T/hf_one/metrics.jsonl $T/hf_ep2/metrics.jsonl 2>&1)
diff=$(./train ckpt-diff $T/hf_one/checkpoints/step_00000003 $T/hf_ep2/checkpoints/step_00000003 --quiet --tol 1e-5 2>&1)
drc=$?
if [ $rc -eq 0 ] && [ $drc -eq 0 ] && [ -z "$why" ] && grep -q 'init.from: HuggingFace weights' $T/hf_ep2.txt &&
   ./train export $T/hf_ep2/checkpoints/step_00000003 --format hf --out $T/hf_ep2_dir >$T/hf_export2.txt 2>&1
then ok ep_hf_init_from_and_export
else fail ep_hf_init_from_and_export "rc $rc: $why $diff $(grep -m2 -h error $T/hf_*.txt)"; fi

# Layouts refused: one line, exit 2, before any allocation (test/lib.sh mpi_refuse).
refuse() { mpi_refuse ep "$@"; }
refuse experts_ep3 3 "ep 3 must divide the 4 experts" $MOE --set parallel.ep=3 --set batch.total_tokens=384
refuse dense_model 2 "spreads MoE experts over ranks" $LLAMA --set parallel.ep=2
refuse zero2 2 "expert parallelism runs with ZeRO 0 or 1" $MOE --set parallel.ep=2 --set parallel.zero=2
refuse dp_not_multiple 2 "must divide dp x cp" $MOE --set parallel.ep=4 --set model.moe.n_experts=8
