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
# section's worst case (every section is skipped); the hang checks assert the
# exit code and the summary's words, never a measured time (a hung step is
# killed by `timeout` at a limit of a few seconds, and the whole check is
# bounded by an outer timeout far above what it needs).
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
# the manifest as make gpu-bundle writes it (its inputs, from this build's .d files)
bash scripts/gpu_bundle.sh --manifest "$tree" > "$tree/.gpu/SOURCES.sha256" || { fail gpu_check_manifest "gpu_bundle.sh --manifest failed"; exit 0; }
cp -a "$tree/.gpu" "$T/gpu.orig"
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
    # the summary is the output's tail, whole, and fits in the tool's 12,000 characters;
    # it ends with what was not reached and the total
    if [ "$sb" -gt 0 ] && [ "$sb" -le 10000 ] && [ "$(tail -n "$nl" "$log")" = "$(cat "$out/summary.txt")" ] &&
       [ "$(tail -n 2 "$out/summary.txt" | awk '{print $1}' | tr '\n' ' ')" = "not_reached total " ]; then
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
# headline first, and the summary starts with it: every op against the CPU
# (fp32, bf16), the 124M step's loss against the CPU, the two benchmarks,
# cuDNN attention; then the fp8 rows; then the rest
order=$(awk '{print $1}' "$T/out/summary.txt" | grep -nE '^(ops_vs_cpu_fp32|ops_vs_cpu_bf16|step124m_fp32|step124m_bf16|bench_124m_bf16|bench_1558m_bf16|attention_cudnn|bench_124m_fp8_tensorwise|fp8_gap_rowwise|test_ops|tiny_cpu|tiny_cuda_bf16|test_nccl|bench_124m_fp32)$' | cut -d: -f2 | tr '\n' ' ')
want="ops_vs_cpu_fp32 ops_vs_cpu_bf16 step124m_fp32 step124m_bf16 bench_124m_bf16 bench_1558m_bf16 attention_cudnn bench_124m_fp8_tensorwise fp8_gap_rowwise test_ops tiny_cpu tiny_cuda_bf16 test_nccl bench_124m_fp32 "
if [ "$order" = "$want" ] && [ "$(head -n 1 "$T/out/summary.txt" | awk '{print $1}')" = ops_vs_cpu_fp32 ] &&
   grep -q '^not_reached *ok *every section asked for ran' "$T/out/summary.txt"; then
    ok gpu_check_dry_headline_first
else fail gpu_check_dry_headline_first "rows in order: $order; first: $(head -n 1 "$T/out/summary.txt" | cut -c1-60)"; fi
# on the CPU every row that is not CUDA-only passes: no FAIL, and the figures are there
nfail=$(grep -c ' FAIL ' "$T/out/summary.txt")
if [ $rc -eq 0 ] && [ "$nfail" -eq 0 ] && grep -q '^bench_1558m_bf16 *ok .*tok/s' "$T/out/summary.txt" &&
   grep -q '^tiny_cuda_bf16 *ok .*max rel diff' "$T/out/summary.txt" && [ -s "$T/out/metrics_tiny_cpu.jsonl" ] &&
   grep -q '^step124m_bf16 *ok .*loss step 1 cpu .* step 2 cpu' "$T/out/summary.txt"; then
    ok gpu_check_dry_passes
else fail gpu_check_dry_passes "exit $rc, $nfail FAIL rows: $(grep ' FAIL ' "$T/out/summary.txt" | cut -c1-120 | head -n 4)"; fi

# the attention bench's rows, as a GPU run carries them (there: per shape and path, and auto's against the targets)
if grep -q '^attn_small_default *ok .*TFLOP/s.*vs simt' "$T/out/summary.txt" &&
   grep -q '^attn_small_auto_target *note .*auto runs default.*target 350.*target 250' "$T/out/summary.txt"; then
    ok gpu_check_dry_attention_rows
else fail gpu_check_dry_attention_rows "$(grep '^attn' "$T/out/summary.txt" | cut -c1-160 | head -n 3)"; fi

# 2. every section skipped (a limit below any section's worst case: 25 s is
# 10 s once the 15 s kept for the summary are set aside, room for the GPU
# probe, none for a section): still a summary
OUT=$T/out2 PATH="$T/fakebin:$PATH" TMPDIR=$T bash "$tree/scripts/cuda_check.sh" --dry-run --limit 25 > "$T/short.txt" 2>&1
returned "$T/out2" "$T/short.txt" gpu_check_short
nskip=$(grep -c ' skip .*s left of --limit 25' "$T/out2/summary.txt")
if [ "$nskip" -ge 8 ] && ! grep -q '^bench_124m_bf16 *ok' "$T/out2/summary.txt" &&
   grep -q '^not_reached *skip .*ops(cut short).*bench_variants(cut short)' "$T/out2/summary.txt"; then ok gpu_check_short_skips
else fail gpu_check_short_skips "$nskip sections skipped for time: $(head -c 300 "$T/out2/summary.txt")"; fi

# 3. --only: just the named sections, the others listed as not selected
OUT=$T/out5 PATH="$T/fakebin:$PATH" TMPDIR=$T bash "$tree/scripts/cuda_check.sh" --dry-run --only nccl,ops --limit 100000 > "$T/only.txt" 2>&1
rc=$?
rows=$(awk '{print $1}' "$T/out5/summary.txt" | grep -vE '^(gpu|binary|not_reached|total)$' | tr '\n' ' ')
if [ $rc -eq 0 ] && [ "$rows" = "ops_vs_cpu_fp32 ops_vs_cpu_bf16 test_nccl " ] &&
   grep -q '^not_reached *ok .*--only nccl,ops' "$T/out5/summary.txt"; then ok gpu_check_only
else fail gpu_check_only "exit $rc, rows: $rows"; fi
OUT=$T/out6 PATH="$T/fakebin:$PATH" TMPDIR=$T bash "$tree/scripts/cuda_check.sh" --dry-run --only benchmark > "$T/only_bad.txt" 2>&1
rc=$?
if [ $rc -eq 2 ] && [ "$(wc -l < "$T/only_bad.txt")" -eq 1 ] && grep -q "no section 'benchmark' (sections: ops, step124m, bench" "$T/only_bad.txt"; then
    ok gpu_check_only_unknown
else fail gpu_check_only_unknown "exit $rc: $(head -c 300 "$T/only_bad.txt")"; fi

# 4. a hung step (the test hook: it ignores SIGTERM and has a child of its
# own) is killed at its hard limit, SIGKILL to its process group; the row
# says it timed out, the check goes on to the next section and fails
hang=$$
KILN_CHECK_TEST_HANG=ops:2 OUT=$T/out7 PATH="$T/fakebin:$PATH" TMPDIR=$T timeout -k 5 300 \
    bash "$tree/scripts/cuda_check.sh" --dry-run --only ops,nccl --limit 100000 > "$T/hang.txt" 2>&1
rc=$?
if [ $rc -eq 1 ] && grep -q '^ops_vs_cpu_fp32 *FAIL .*timed out: killed at its hard limit of 2 s' "$T/out7/summary.txt" &&
   grep -q '^test_nccl ' "$T/out7/summary.txt" && grep -q '^not_reached *skip .*ops(cut short)' "$T/out7/summary.txt" &&
   grep -q 'SIGKILL: it ignored SIGTERM' "$T/hang.txt" && ! pgrep -f "sleep 3599\.[0-9]" > /dev/null; then
    ok gpu_check_hang_killed
else fail gpu_check_hang_killed "exit $rc (124: the outer timeout): $(grep -E '^(ops_vs|not_reached|test_nccl)' "$T/out7/summary.txt" | cut -c1-140)"; fi
# the check's own limit: a step that would hang for good is cut to what is
# left of --limit (30 s, less the 15 s kept for the summary, less the 5 s
# between SIGTERM and SIGKILL): here nvidia-smi, as a hung GPU hangs it,
# which no section's time check guards; the check then ends with its summary,
# naming every section as not reached
KILN_CHECK_TEST_HANG=gpu OUT=$T/out8 PATH="$T/fakebin:$PATH" TMPDIR=$T timeout -k 5 120 \
    bash "$tree/scripts/cuda_check.sh" --dry-run --limit 30 > "$T/limit.txt" 2>&1
rc=$?
if [ $rc -eq 2 ] && grep -q '^gpu *FAIL .*nvidia-smi hung: timed out' "$T/out8/summary.txt" &&
   grep -q '^not_reached *skip .*ops(not reached) step124m(not reached) bench(not reached)' "$T/out8/summary.txt" &&
   grep -q '^total *FAIL' "$T/out8/summary.txt"; then
    ok gpu_check_limit_bounds_a_hang
else fail gpu_check_limit_bounds_a_hang "exit $rc (124: the outer timeout, the check overran): $(tail -n 3 "$T/limit.txt" | cut -c1-140)"; fi

# 5. a tampered bundle: a changed main.c, a file the manifest does not list,
# a listed file gone, then no bundle: one line, exit 2, before anything runs
tampered() { # NAME WANT: the check refuses in one line matching WANT
    OUT=$T/out_$1 PATH="$T/fakebin:$PATH" TMPDIR=$T bash "$tree/scripts/cuda_check.sh" --dry-run > "$T/$1.txt" 2>&1
    local rc=$?
    if [ $rc -eq 2 ] && [ "$(wc -l < "$T/$1.txt")" -eq 1 ] && grep -q "$2" "$T/$1.txt" &&
       grep -q '^bundle *FAIL' "$T/out_$1/summary.txt"; then ok "gpu_check_$1"
    else fail "gpu_check_$1" "exit $rc: $(head -c 300 "$T/$1.txt")"; fi
}
cp "$tree/main.c" "$T/main.c.orig"
echo "/* changed */" >> "$tree/main.c"
tampered stale_main_c 'stale bundle.*main.c'
cp "$T/main.c.orig" "$tree/main.c"
echo "/* changed */" >> "$tree/src/util.c"
tampered stale_bundle 'stale bundle.*src/util.c'
cp src/util.c "$tree/src/util.c"
grep -v ' main.c$' "$T/gpu.orig/SOURCES.sha256" > "$tree/.gpu/SOURCES.sha256"
tampered manifest_omits_main_c 'manifest .*does not list main.c'
cp "$T/gpu.orig/SOURCES.sha256" "$tree/.gpu/SOURCES.sha256"
echo "int x;" > "$tree/src/extra.c"
tampered manifest_omits_new_file 'does not list src/extra.c'
rm "$tree/src/extra.c"
rm -rf "$tree/.gpu"
OUT=$T/out4 PATH="$T/fakebin:$PATH" TMPDIR=$T bash "$tree/scripts/cuda_check.sh" > "$T/none.txt" 2>&1
rc=$?
if [ $rc -eq 2 ] && [ "$(wc -l < "$T/none.txt")" -eq 1 ] && grep -q 'no bundle.*make gpu-bundle' "$T/none.txt"; then
    ok gpu_check_no_bundle
else fail gpu_check_no_bundle "exit $rc: $(head -c 300 "$T/none.txt")"; fi
