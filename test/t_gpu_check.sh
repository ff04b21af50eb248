#!/usr/bin/env bash
# scripts/cuda_check.sh in dry-run mode: what a GPU window would return must fit
# what the device tool brings back (at most 8 files, each at most 16 MiB, no
# deeper than two folders below $OUT, names of [A-Za-z0-9._-]; the summary the
# last thing printed, inside the 12,000-character tail). A scratch tree of the
# tracked files, a bundle packed from this build's binaries (what
# scripts/gpu_bundle.sh carries, without its several-minute STATIC=1 build), a
# fake nvidia-smi on PATH; --dry-run runs every section on the CPU backend at
# toy shapes. Nothing here depends on timing: the full run gets a limit no
# section can reach (every section runs), the short one a limit below every
# section's worst case (every section is skipped).
set -u
cd "$(dirname "$0")/.." || exit 1
. test/lib.sh
T=$(mktemp -d /tmp/kiln-t-gpu-check.XXXXXX)
[ -n "${KEEP:-}" ] || trap 'rm -rf "$T"' EXIT # KEEP=1 leaves the scratch folder
BINS="train build/test/test_ops build/test/test_backend_cross build/test/test_nccl build/test/bench_attention"
for b in $BINS; do
    [ -x "$b" ] || { skip gpu_check "$b not built (make -j2 and make $b)"; exit 0; }
done
if ! ./train --version | grep -q 'backends: .*cuda'; then skip gpu_check "no CUDA backend in this build"; exit 0; fi
command -v xz >/dev/null || { skip gpu_check "no xz here"; exit 0; }

tree=$T/tree
mkdir -p "$tree/.gpu" "$T/fakebin"
git ls-files -z | xargs -0 cp --parents -t "$tree"
tar -cf - $BINS | xz -0 -T2 > "$tree/.gpu/kiln-gpu.tar.xz"
echo "dryrun" > "$tree/.gpu/COMMIT"
git ls-files -z src cuda test Makefile | (cd "$tree" && xargs -0 sha256sum) > "$tree/.gpu/SOURCES.sha256"
cat > "$T/fakebin/nvidia-smi" <<'EOF'
#!/bin/sh
# a stand-in: the H200's answer to cuda_check's queries
case "$*" in
*noheader*) echo "NVIDIA H200, 570.00.00, 143771 MiB" ;;
*) echo "name, driver_version, memory.total [MiB], compute_cap"; echo "NVIDIA H200, 570.00.00, 143771 MiB, 9.0" ;;
esac
EOF
chmod +x "$T/fakebin/nvidia-smi"

# returned OUT STDOUT NAME: the checks on what would come back
returned() {
    local out=$1 log=$2 name=$3 n bad deep big
    n=$(find "$out" -type f | wc -l)
    bad=$(find "$out" -mindepth 1 | sed "s|^$out/||" | grep -v '^[A-Za-z0-9._/-]*$' | head -n 1)
    deep=$(find "$out" -mindepth 4 | head -n 1) # $OUT/a/b/file is depth 3
    big=$(find "$out" -type f -size +16384k | head -n 1)
    if [ "$n" -ge 2 ] && [ "$n" -le 8 ] && [ -z "$bad$deep$big" ]; then ok "${name}_files"
    else fail "${name}_files" "$n files (2..8), odd name '${bad}', too deep '${deep}', over 16 MiB '${big}': $(ls -R "$out" | head -c 300)"; fi
    # exactly: the summary, the archive, the headline metrics
    local other; other=$(cd "$out" && find . -type f | grep -vE '^\./(summary\.txt|logs\.tar\.gz|metrics_tiny_[a-z0-9_]+\.jsonl)$' | head -n 1)
    if [ -z "$other" ]; then ok "${name}_only_summary_archive_metrics"; else fail "${name}_only_summary_archive_metrics" "unexpected $other"; fi
    local sb; sb=$(stat -c %s "$out/summary.txt" 2>/dev/null || echo 0)
    local nl; nl=$(wc -l < "$out/summary.txt")
    # the summary is the output's tail, whole, and fits in the tool's 12,000 characters
    if [ "$sb" -gt 0 ] && [ "$sb" -le 10000 ] && [ "$(tail -n "$nl" "$log")" = "$(cat "$out/summary.txt")" ]; then
        ok "${name}_summary_is_tail"
    else fail "${name}_summary_is_tail" "summary $sb bytes, $nl lines; output ends: $(tail -n 2 "$log" | head -c 200)"; fi
    if tar -tzf "$out/logs.tar.gz" > "$T/list.txt" 2>/dev/null && ! grep -q 'checkpoints/\|^\./bin/' "$T/list.txt" &&
       grep -q 'cuda_check.log' "$T/list.txt"; then ok "${name}_archive"
    else fail "${name}_archive" "logs.tar.gz unreadable, holds checkpoints or binaries, or lacks the log: $(head -c 200 "$T/list.txt")"; fi
}

# 1. every section runs (a limit none can reach)
OUT=$T/out PATH="$T/fakebin:$PATH" TMPDIR=$T bash "$tree/scripts/cuda_check.sh" --dry-run --limit 100000 > "$T/full.txt" 2>&1
rc=$?
returned "$T/out" "$T/full.txt" gpu_check_dry
# headline first: op tables, then the two benchmarks, then the loss curves
order=$(awk '{print $1}' "$T/out/summary.txt" | grep -nE '^(test_ops|test_backend_cross|bench_124m_bf16|bench_1558m_bf16|tiny_cpu|tiny_cuda_bf16|test_nccl|bench_124m_fp32)$' | cut -d: -f2 | tr '\n' ' ')
if [ "$order" = "test_ops test_backend_cross bench_124m_bf16 bench_1558m_bf16 tiny_cpu tiny_cuda_bf16 test_nccl bench_124m_fp32 " ]; then
    ok gpu_check_dry_headline_first
else fail gpu_check_dry_headline_first "rows in order: $order"; fi
# on the CPU every row that is not CUDA-only passes: no FAIL, and the figures are there
nfail=$(grep -c ' FAIL ' "$T/out/summary.txt")
if [ $rc -eq 0 ] && [ "$nfail" -eq 0 ] && grep -q '^bench_1558m_bf16 *ok .*tok/s' "$T/out/summary.txt" &&
   grep -q '^tiny_cuda_bf16 *ok .*max rel diff' "$T/out/summary.txt" && [ -s "$T/out/metrics_tiny_cpu.jsonl" ]; then
    ok gpu_check_dry_passes
else fail gpu_check_dry_passes "exit $rc, $nfail FAIL rows: $(grep ' FAIL ' "$T/out/summary.txt" | cut -c1-120 | head -n 4)"; fi

# the attention bench's rows, as a GPU run carries them (there: per shape and path, and auto's against the targets)
if grep -q '^attn_small_default *ok .*TFLOP/s.*vs simt' "$T/out/summary.txt" &&
   grep -q '^attn_small_auto_target *note .*auto runs default.*target 350.*target 250' "$T/out/summary.txt"; then
    ok gpu_check_dry_attention_rows
else fail gpu_check_dry_attention_rows "$(grep '^attn' "$T/out/summary.txt" | cut -c1-160 | head -n 3)"; fi

# 2. every section skipped (a limit below any section's worst case): still a summary
OUT=$T/out2 PATH="$T/fakebin:$PATH" TMPDIR=$T bash "$tree/scripts/cuda_check.sh" --dry-run --limit 1 > "$T/short.txt" 2>&1
returned "$T/out2" "$T/short.txt" gpu_check_short
nskip=$(grep -c ' skip .*s left of --limit 1' "$T/out2/summary.txt")
if [ "$nskip" -ge 8 ] && ! grep -q '^bench_124m_bf16 *ok' "$T/out2/summary.txt"; then ok gpu_check_short_skips
else fail gpu_check_short_skips "$nskip sections skipped for time: $(head -c 300 "$T/out2/summary.txt")"; fi

# 3. a stale bundle, then a missing one: one line, exit 2, before anything runs
echo "/* changed */" >> "$tree/src/util.c"
OUT=$T/out3 PATH="$T/fakebin:$PATH" TMPDIR=$T bash "$tree/scripts/cuda_check.sh" --dry-run > "$T/stale.txt" 2>&1
rc=$?
if [ $rc -eq 2 ] && [ "$(wc -l < "$T/stale.txt")" -eq 1 ] && grep -q 'stale bundle.*src/util.c' "$T/stale.txt" &&
   grep -q '^bundle *FAIL' "$T/out3/summary.txt"; then ok gpu_check_stale_bundle
else fail gpu_check_stale_bundle "exit $rc: $(head -c 300 "$T/stale.txt")"; fi
rm -rf "$tree/.gpu"
OUT=$T/out4 PATH="$T/fakebin:$PATH" TMPDIR=$T bash "$tree/scripts/cuda_check.sh" > "$T/none.txt" 2>&1
rc=$?
if [ $rc -eq 2 ] && [ "$(wc -l < "$T/none.txt")" -eq 1 ] && grep -q 'no bundle.*make gpu-bundle' "$T/none.txt"; then
    ok gpu_check_no_bundle
else fail gpu_check_no_bundle "exit $rc: $(head -c 300 "$T/none.txt")"; fi
