#!/usr/bin/env bash
# The planner's memory against what the CPU backend allocates (issue 33 §2):
# scripts/plan_memory_table.sh runs each layout 2 steps and plans it, and a row
# more than 2% off its measured peak (peak_device_mib, the bytes live through
# the backend's alloc) fails. The layouts: one rank, each recompute mode, fp8
# tensorwise and rowwise, dp with ZeRO 0-3, tp with and without sp, the four
# pipeline schedules, pp x dp with ZeRO 1 and 3, cp ring and allgather on 2 and
# 4 ranks, MoE on one rank, under ep 2, ep 2 x dp 2 and dropless, ZeRO 2 and 3
# at micro-batch 1, bf16 moments, Lion, Adafactor and doc masking (32 rows).
# Not held yet, and so not listed (docs/planner.md "Memory model"): ZeRO-1 and
# -3 start-up transients at micro-batch 1 (model_pad_arenas holds the old and
# new arenas together) and Muon's own buffers. ~30 s on 2 cores.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_plan_memory
rm -rf "$T" && mkdir -p "$T"
. test/lib.sh
ROWS="one_rank recompute_gelu recompute_norm_gelu fp8_tensorwise fp8_rowwise dp2_zero0 dp2_zero1 dp2_zero2 dp2_zero3
tp2_sp tp2_nosp pp2_gpipe pp2_1f1b pp2_interleaved pp2_zb_h1 cp2_ring cp2_allgather moe_one_rank moe_ep2
moe_ep2_dp2_zero1 moe_dropless_ep2 cp4_ring cp4_allgather pp2_dp2_zero1 pp2_dp2_zero3 dp4_zero2_mb1 dp4_zero3_mb1
wide_dp4_zero2_mb1 optim_state_bf16 lion adafactor doc_masking"
# shellcheck disable=SC2086
KILN_PLAN_TABLE_DIR="$T/w" bash scripts/plan_memory_table.sh $ROWS > "$T/table.txt" 2>&1
for name in $ROWS; do
    line=$(grep -E "^$name " "$T/table.txt")
    if [ -z "$line" ]; then fail "plan_memory_$name" "no row: $(grep -m1 "$name" "$T/table.txt")"
    elif echo "$line" | grep -q ' OFF'; then fail "plan_memory_$name" "$line"
    else ok "plan_memory_$name ($(echo "$line" | awk '{print $3 " MiB measured, " $4 " predicted"}'))"; fi
done
