#!/usr/bin/env bash
# Llama and MoE architectures through checkpoint, resume and data parallelism
# on the CPU backend: a run stopped by SIGUSR1 and resumed is bit-identical to
# an uninterrupted one; 2 and 4 Open MPI ranks under ZeRO 0-3 match one rank
# of the same global batch; a ZeRO-3 resume is bit-identical; a checkpoint of
# another architecture is refused naming the key; bad values of the new model
# keys are one line and exit 2. One line per check.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_arch_resume
rm -rf "$T"
. test/ckpt_lib.sh
ckpt_setup
Y=$T/tiny.yaml

# The architectures, on ckpt_lib's tiny shape (2 layers, 32 wide, context 32):
#   llama  GQA (4 query heads of 8, 2 key/value heads), RoPE, SwiGLU, untied head
#   qkn    Llama with multi-query attention, per-head QK-norm, tied embeddings
#   moe    Llama blocks with MoE MLPs: 4 experts top 2 plus 1 shared expert
#   moecap the same with capacity_factor 1 (tokens beyond capacity dropped)
#   moebias the same, dropless, DeepSeek-V3 balancing bias (rate 0.01) and no
#           aux loss (that method replaces the aux loss; it also keeps this
#           check apart from the aux loss's, see moe below)
LLAMA="--set model.arch=llama --set model.n_head=4 --set model.n_kv_head=2 --set model.ffn_hidden=64"
QKN="--set model.arch=llama --set model.n_head=4 --set model.n_kv_head=1 --set model.qk_norm=head --set model.tie_embeddings=true --set model.ffn_hidden=64"
MOE="--set model.arch=llama --set model.n_head=4 --set model.n_kv_head=2 --set model.mlp=moe --set model.moe.n_experts=4 --set model.moe.top_k=2 --set model.moe.n_shared=1 --set model.moe.expert_hidden=32"
MOECAP="$MOE --set model.moe.capacity_factor=1"
MOEBIAS="$MOE --set model.moe.bias_update_rate=0.01 --set model.moe.aux_loss_coef=0"
# moenoaux (multi-rank only): moe without the aux loss, the control that
# tells a failure of moe's aux-loss path from one of the experts' layout
MOENOAUX="$MOE --set model.moe.aux_loss_coef=0"
flags() { case $1 in llama) echo "$LLAMA" ;; qkn) echo "$QKN" ;; moe) echo "$MOE" ;; moecap) echo "$MOECAP" ;;
    moebias) echo "$MOEBIAS" ;; moenoaux) echo "$MOENOAUX" ;; esac; }

# The shapes asked for are the ones built: the tensor table of a checkpoint
# (GQA: k_proj is 2 heads x 8 = 16 rows; untied: lm_head; tied: none; QK-norm
# per head: an 8-wide q_norm; MoE: 4 experts, a shared one, a router bias).
# wait_step FILE N: until FILE (metrics.jsonl) holds N lines; 60 s at most
wait_step() { for _ in $(seq 1200); do [ "$(cat "$1" 2>/dev/null | wc -l)" -ge "$2" ] && return 0; sleep 0.05; done; return 1; }

# 1. One rank: 20 steps straight (cosine schedule, a checkpoint every 5)
# against the same run stopped by SIGUSR1 after step 7 (between checkpoints:
# the signal's own save) and resumed with --resume auto. Every step's loss and
# the final parameters and whole state (optimizer moments, router bias, data
# position, RNG) bit for bit. The run waits after step 7 until the signal has
# come (KILN_TEST_PAUSE_AT_STEP), so nothing depends on timing.
for a in llama qkn moe moecap moebias; do
    A=$(flags $a)
    # log_every 10: the MoE line with the dropped fraction (checked for moecap)
    ./train $Y $A --set metrics.log_every=10 --set run.dir=$T/$a/ref >$T/$a.ref.txt 2>&1
    KILN_TEST_PAUSE_AT_STEP=7 ./train $Y $A --set metrics.log_every=10 --set run.dir=$T/$a/sig >$T/$a.sig1.txt 2>&1 &
    pid=$!
    wait_step $T/$a/sig/metrics.jsonl 7
    kill -USR1 $pid
    wait $pid
    rc1=$?
    ./train $Y $A --set metrics.log_every=10 --set run.dir=$T/$a/sig --resume auto >$T/$a.sig2.txt 2>&1
    rc2=$?
    ref=$(sums $T/$a/ref/checkpoints/step_00000020)
    if [ $rc1 -eq 75 ] && [ $rc2 -eq 0 ] && [ -n "$ref" ] && [ "$(resumed $T/$a/sig)" = "7 1 false" ] \
        && [ "$(losses $T/$a/ref/metrics.jsonl)" = "$(losses $T/$a/sig/metrics.jsonl)" ] \
        && [ "$(sums $T/$a/sig/checkpoints/step_00000020)" = "$ref" ]; then
        ok arch_resume_bit_identical_$a
    else fail arch_resume_bit_identical_$a "stop rc $rc1, resume rc $rc2: $(grep -h -m3 -E 'resumed|error' $T/$a.sig*.txt); sums '$(sums $T/$a/sig/checkpoints/step_00000020)' vs '$ref'"; fi
done
info() { ./train ckpt-info $T/$1/ref/checkpoints/step_00000020 2>&1; }
info llama | grep -q 'tensor layers.0.self_attn.k_proj.weight *f32 *\[16,32\]' && info llama | grep -q 'tensor lm_head.weight' \
    && ok arch_llama_gqa_untied_tensors || fail arch_llama_gqa_untied_tensors "$(info llama | grep -m2 -E 'k_proj|lm_head')"
info qkn | grep -q 'tensor layers.0.self_attn.q_norm.weight *f32 *\[8\]' && ! info qkn | grep -q 'tensor lm_head' \
    && ok arch_qk_norm_tied_tensors || fail arch_qk_norm_tied_tensors "$(info qkn | grep -m3 -E 'norm|lm_head')"
info moebias | grep -q 'tensor layers.1.mlp.experts.3.down_proj.weight' && info moebias | grep -q 'tensor layers.0.mlp.shared_experts' \
    && info moebias | grep -q 'tensor layers.0.mlp.gate.e_score_correction_bias' \
    && ok arch_moe_tensors || fail arch_moe_tensors "$(info moebias | grep -m3 mlp)"
# capacity 1 must actually drop tokens (else the capacity path went untested):
# a positive dropped percentage in step 20's progress line; dropless prints 0
if grep -E '^step 20/' $T/moecap.ref.txt | grep -qE 'drop ([1-9][0-9.]*|0\.0*[1-9][0-9]*)%' \
    && grep -E '^step 20/' $T/moe.ref.txt | grep -q 'drop 0.00%'; then
    ok arch_moe_capacity_drops
else fail arch_moe_capacity_drops "$(grep -h '^step 20/' $T/moecap.ref.txt $T/moe.ref.txt)"; fi
# the balancing bias moved (zeros at init; the checkpoint entry's crc32c of 16
# zero bytes is that of an untouched bias and of its zero optimizer moments)
zero=$(info moebias | grep 'optim.m/layers.0.mlp.gate.e_score_correction_bias' | grep -o 'crc32c [0-9a-f]*')
bias=$(info moebias | grep ' layers.0.mlp.gate.e_score_correction_bias' | grep -o 'crc32c [0-9a-f]*')
[ -n "$bias" ] && [ "$bias" != "$zero" ] && ok arch_moe_bias_moves || fail arch_moe_bias_moves "bias '$bias', zeros '$zero'"

# 2. Several ranks (Open MPI) against one rank on the same global batch: 512
# tokens a step = 4 micro-batches of 4 x 32 (2 per rank on 2 ranks, 1 on 4).
# Tolerance as test/t_dp.sh and docs/parallel.md "Correctness" argue: loss at
# every step within relative 1e-5, final parameters within absolute 1e-5 (the
# ranks' gradient sums reassociate one rank's: a few ulps per sum).
# Constant schedule, so a 10-step run has the 20-step run's learning rates.
# The subset, and why it covers the code paths:
#   llama  zero 0, 1, 2, 3 on 2 ranks: the four gradient/optimizer layouts
#          (all-reduce; sharded moments; reduce-scatter during the backward;
#          parameters gathered per layer) over the Llama tensor table (no
#          biases, separate q/k/v, gate/up); zero 0 and 3 on 4 ranks: the
#          shard boundaries move (a rank owns pieces of tensors, not whole ones)
#          and accumulation becomes 1 micro-batch per rank.
#   qkn    zero 1 and 3 on 2 ranks: the tied embedding (one tensor read by the
#          embedding and the head, one gradient from both) sharded and
#          gathered, and the per-head q/k norm weights.
#   moe    zero 0 and 3 on 2 ranks: expert, shared-expert and router tensors in
#          both the replicated and the gathered layout (moenoaux zero 0: the
#          same without the aux loss: the aux loss and capacity are per
#          sequence, so no layout changes them); moecap zero 3: the same
#          tokens drop as on one rank.
#   moebias zero 0 and 1 on 2 ranks: the bias is updated after the optimizer
#          step from loads summed over the ranks, outside the gradient path,
#          on the whole arena every rank holds (ZeRO-2/3 are refused with
#          it: their master shards would not see the update).
if ! command -v mpirun >/dev/null 2>&1 || ! ldd ./train | grep -q libmpi; then
    skip arch_dp "no mpirun or ./train is not an MPI build (make deps, then make)"
else
MPIRUN=(timeout 120 mpirun --allow-run-as-root --oversubscribe)
S="--set batch.total_tokens=512 --set checkpoint.async=false --set checkpoint.every=10 --set schedule.kind=constant"
for a in llama qkn moe moenoaux moecap moebias; do
    ./train $Y $(flags $a) $S --set run.dir=$T/dp/$a.1 >$T/dp.$a.1.txt 2>&1 || fail arch_dp_reference_$a "$(tail -n 2 $T/dp.$a.1.txt)"
done
for c in llama:2:0 llama:2:1 llama:2:2 llama:2:3 llama:4:0 llama:4:3 qkn:2:1 qkn:2:3 \
    moe:2:0 moe:2:3 moenoaux:2:0 moecap:2:3 moebias:2:0 moebias:2:1; do
    IFS=: read -r a np z <<<"$c"
    D=$T/dp/$a.np$np.z$z
    "${MPIRUN[@]}" -np $np ./train $Y $(flags $a) $S --set parallel.zero=$z --set run.dir=$D >$D.txt 2>&1
    rc=$?
    why=$(close_losses $T/dp/$a.1/metrics.jsonl $D/metrics.jsonl 2>&1)
    # A single token routed the other way at a near tie (route_flip) leaves
    # the checkpoint before it to compare: step 10, if the flip came later.
    at=20 flip=$(route_flip $T/dp/$a.1/metrics.jsonl $D/metrics.jsonl 2>/dev/null)
    [ -n "$flip" ] && [ "$flip" -gt 10 ] && at=10
    diff=$(./train ckpt-diff $T/dp/$a.1/checkpoints/step_000000$at $D/checkpoints/step_000000$at --quiet --tol 1e-5 2>&1)
    drc=$?
    [ $at -eq 10 ] && diff="$diff (step 10: one token routed the other way at step $flip)"
    if [ $rc -eq 0 ] && [ $drc -eq 0 ] && [ -z "$why" ]; then ok "arch_dp_equiv_${a}_np${np}_zero$z${flip:+ # $diff}"
    else fail arch_dp_equiv_${a}_np${np}_zero$z "rc $rc: ${why:-losses within 1e-5}; $diff $(grep -m2 error $D.txt)"; fi
done
# ZeRO-3 on 2 ranks, 10 steps, then --resume auto to 20: bit-identical to the
# uninterrupted 2-rank ZeRO-3 run (same layout, same summation order).
# For moebias also ZeRO-0, which checks that the ranks hold the same bias:
# the checkpoint holds rank 0's copy and both ranks resume from it, so had
# rank 1's bias (from its own loads, not the summed ones) differed, its
# routing and so the losses after step 10 would differ from the
# uninterrupted run's bit for bit.
for c in llama:3 qkn:3 moe:3 moebias:1 moebias:0; do
    IFS=: read -r a z <<<"$c"
    D=$T/dp/$a.half.z$z
    "${MPIRUN[@]}" -np 2 ./train $Y $(flags $a) $S --set parallel.zero=$z --set run.dir=$D --set train.steps=10 >$D.1.txt 2>&1
    "${MPIRUN[@]}" -np 2 ./train $Y $(flags $a) $S --set parallel.zero=$z --set run.dir=$D --resume auto >$D.2.txt 2>&1
    rc=$?
    ref=$(sums $T/dp/$a.np2.z$z/checkpoints/step_00000020)
    if [ $rc -eq 0 ] && [ -n "$ref" ] && [ "$(resumed $D)" = "10 2 false" ] \
        && [ "$(losses $T/dp/$a.np2.z$z/metrics.jsonl)" = "$(losses $D/metrics.jsonl)" ] \
        && [ "$(sums $D/checkpoints/step_00000020)" = "$ref" ]; then
        ok arch_dp_resume_bit_identical_${a}_np2_zero$z
    else fail arch_dp_resume_bit_identical_${a}_np2_zero$z "rc $rc: $(grep -h -m2 -E 'resumed|error' $D.*.txt); sums '$(sums $D/checkpoints/step_00000020)' vs '$ref'"; fi
done
fi

# The balancing bias with ZeRO-2/3: refused naming the key.
expect arch_refuse_moebias_zero3 2 "key 'model.moe.bias_update_rate'" -- ./train $Y $(flags moebias) --set parallel.zero=3 --dry-run

# 3. Resuming a checkpoint with another architecture: refused, exit 2, one
# error line naming the key and both values (then a hint line).
refuse() { # NAME PATTERN ARGS...
    local name=$1 pat=$2; shift 2
    if expect "$name" 2 "$pat" -- ./train $Y "$@" && [ "$(grep -c 'kiln: error' "$T/err.txt")" -ne 1 ]; then
        fail "${name}_one_line" "$(cat "$T/err.txt")"
    fi
}
./train $Y --set run.dir=$T/gpt2 --set train.steps=5 >/dev/null 2>&1
refuse arch_refuse_gpt2_as_llama "cannot resume with a changed key 'model.arch': gpt2 -> llama" \
    --set run.dir=$T/gpt2 --set model.arch=llama --resume auto
refuse arch_refuse_llama_kv_heads "cannot resume with a changed key 'model.n_kv_head': 2 -> 1" \
    $LLAMA --set run.dir=$T/llama/ref --set model.n_kv_head=1 --resume auto
refuse arch_refuse_llama_qk_norm "changed key 'model.qk_norm': none -> head" \
    $LLAMA --set run.dir=$T/llama/ref --set model.qk_norm=head --resume auto
refuse arch_refuse_moe_experts "changed key 'model.moe.n_experts': 4 -> 8" \
    $MOE --set run.dir=$T/moe/ref --set model.moe.n_experts=8 --resume auto
# keys of the nested blocks are named in full (model.rope_scaling.factor)
refuse arch_refuse_llama_rope_scaling "changed key 'model.rope_scaling.factor': 0 -> 8" $LLAMA --set run.dir=$T/llama/ref \
    --set model.rope_scaling.factor=8 --set model.rope_scaling.low_freq_factor=1 --set model.rope_scaling.high_freq_factor=4 \
    --set model.rope_scaling.original_context=16 --resume auto
refuse arch_refuse_llama_ckpt_as_gpt2 "changed key 'model.arch': llama -> gpt2" \
    --set run.dir=$T/other --resume $T/llama/ref/checkpoints/step_00000010
# --force does not override a shape change
refuse arch_refuse_kv_heads_force "changed key 'model.n_kv_head'" \
    $LLAMA --set run.dir=$T/llama/ref --set model.n_kv_head=1 --resume auto --force

# 4. Bad values of the new keys: one line, exit 2, naming the key.
bad() { # NAME PATTERN ARGS...
    local name=$1 pat=$2; shift 2
    if expect "$name" 2 "$pat" -- ./train $Y --set run.dir=$T/bad "$@" && [ "$(wc -l < "$T/err.txt")" -ne 1 ]; then
        fail "${name}_one_line" "$(cat "$T/err.txt")"
    fi
}
bad arch_bad_kv_heads_divide "key 'model.n_kv_head': 3 does not divide model.n_head = 4" \
    --set model.arch=llama --set model.n_head=4 --set model.n_kv_head=3
bad arch_bad_head_dim_odd_rope "key 'model.head_dim'.*7 must be even" --set model.arch=llama --set model.head_dim=7
bad arch_bad_top_k "key 'model.moe.top_k': 5 .*n_experts = 4" $MOE --set model.moe.top_k=5
bad arch_bad_rope_scaling_partial "key 'model.rope_scaling'.*low_freq_factor" --set model.arch=llama --set model.rope_scaling.factor=8
bad arch_bad_moe_gpt2 "key 'model.mlp': moe needs model.arch: llama" --set model.arch=gpt2 --set model.mlp=moe
bad arch_bad_qk_norm_value "key 'model.qk_norm': expected one of none, head, full, got 'layer'" --set model.arch=llama --set model.qk_norm=layer
bad arch_bad_norm_eps_zero "key 'model.norm_eps'.*\(0, 1\]" --set model.norm_eps=0
