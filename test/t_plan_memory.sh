#!/usr/bin/env bash
# The planner's memory against what the CPU backend allocates (issue 33 §2):
# scripts/plan_memory_table.sh runs each layout 2 steps and plans it, and a row
# more than 2% off its measured peak (peak_device_mib, the bytes live through
# the backend's alloc) fails. The layouts: one rank, each recompute mode, fp8
# tensorwise and rowwise, MoE with selective on one rank and under ep 2, dp with ZeRO 0-3, tp with and without sp, the four
# pipeline schedules, pp x dp with ZeRO 1 and 3, cp ring and allgather on 2 and
# 4 ranks, MoE on one rank, under ep 2, ep 2 x dp 2 and dropless, ZeRO 1-3 at
# micro-batch 1 (start-up's transients: the gradient arena now comes with the
# activations, after ddp_init pads or relays the parameters), ZeRO 1-3 on the
# wider model, bf16 moments, Lion, Muon on one rank and at dp 2 ZeRO 1,
# Adafactor and doc masking (40 rows).
# RSS: peak_rss_mib less rss_base_mib (VmRSS before the model allocates)
# against the plan plus the checkpoint writer's host buffers (the table's
# rss_pred) within 10% (issue 33 §2) on the one- and two-rank rows (RSS_ROWS:
# measured 1.03-1.09; one rank's ~1.5 MiB over is the data loader's and the
# libraries' pages, two ranks' ~2.5 MiB Open MPI's). The 4-rank rows are not
# held, for the reason measured in docs/planner.md "Memory model": Open MPI's
# own buffers for the collectives, which kiln neither allocates nor can
# count, grow with ranks and messages: +3 MiB on the tiny 4-rank rows
# (1.07-1.10, too near the bound to hold), +18 to +44 MiB on the wide ones
# (1.11-1.25). ~60 s on 2 cores.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_plan_memory
rm -rf "$T" && mkdir -p "$T"
. test/lib.sh
ROWS="one_rank recompute_gelu recompute_norm_gelu fp8_tensorwise fp8_rowwise dp2_zero0 dp2_zero1 dp2_zero2 dp2_zero3
tp2_sp tp2_nosp pp2_gpipe pp2_1f1b pp2_interleaved pp2_zb_h1 cp2_ring cp2_allgather moe_one_rank moe_ep2
recompute_block moe_selective moe_ep2_selective moe_ep2_dp2_zero1 moe_dropless_ep2 cp4_ring cp4_allgather pp2_dp2_zero1 pp2_dp2_zero3 dp4_zero1_mb1 dp4_zero2_mb1
dp4_zero3_mb1 wide_dp4_zero1_mb1 wide_dp4_zero2_mb1 wide_dp4_zero3_mb1 optim_state_bf16 lion muon adafactor
muon_dp2_zero1 doc_masking"
RSS_ROWS="one_rank recompute_gelu recompute_norm_gelu fp8_tensorwise fp8_rowwise dp2_zero0 dp2_zero1 dp2_zero2 dp2_zero3 tp2_sp tp2_nosp pp2_gpipe pp2_1f1b pp2_interleaved pp2_zb_h1 cp2_ring cp2_allgather moe_one_rank moe_ep2 recompute_block moe_selective moe_ep2_selective moe_dropless_ep2 optim_state_bf16 lion muon adafactor muon_dp2_zero1 doc_masking"
# shellcheck disable=SC2086
KILN_PLAN_TABLE_DIR="$T/w" KILN_PLAN_RSS_TOL=1e9 bash scripts/plan_memory_table.sh $ROWS > "$T/table.txt" 2>&1
for name in $ROWS; do
    line=$(grep -E "^$name " "$T/table.txt")
    if [ -z "$line" ]; then fail "plan_memory_$name" "no row: $(grep -m1 "$name" "$T/table.txt")"
    elif echo "$line" | grep -q ' OFF'; then fail "plan_memory_$name" "$line"
    else ok "plan_memory_$name ($(echo "$line" | awk '{print $3 " MiB measured, " $4 " predicted"}'))"; fi
done
# RSS: 10% of the plan plus the checkpoint writer's buffers (issue 33 §2)
for name in $RSS_ROWS; do
    line=$(grep -E "^$name " "$T/table.txt")
    q=$(echo "$line" | awk '{print $8}')
    if [ -z "$line" ] || ! awk -v q="$q" 'BEGIN { exit !(q >= 0.90 && q <= 1.10) }'; then
        fail "plan_rss_$name" "${line:-no row}"
    else ok "plan_rss_$name ($(echo "$line" | awk '{print $6 " MiB RSS over the baseline, " $7 " predicted"}'))"; fi
done
