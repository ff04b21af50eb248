#!/usr/bin/env bash
# test/run.sh itself, on a scratch tree of fake test files: the closing line
# counts ok, FAIL and skip; under CI=true a skip of anything but a GPU-only
# check fails the run and names the check, a GPU-only skip does not; files
# run side by side keep their lines together; a file that exits non-zero or
# prints nothing is a failure of its own. One line per check.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_runner
rm -rf "$T"
. test/lib.sh
mkdir -p "$T/tree/test" "$T/tree/build/test"
cp test/run.sh "$T/tree/test/run.sh"
cat > "$T/tree/test/t_a.sh" <<'EOF'
echo "ok a_one"; echo "ok a_two"; echo "skip ops_cuda: no GPU"
EOF
cat > "$T/tree/test/t_b.sh" <<'EOF'
echo "ok b_one"; echo "skip b_needs_pkg: python package frob not installed"
EOF
cat > "$T/tree/test/t_quiet.sh" <<'EOF'
echo "nothing here"
EOF
cat > "$T/tree/test/t_dies.sh" <<'EOF'
echo "ok dies_first"; exit 3
EOF
# run ENV... -- TESTS: run.sh's output in $T/out.txt, its exit code in rc
run() {
    (cd "$T/tree" && env -u CI "$@" bash test/run.sh) > "$T/out.txt" 2>&1; rc=$?
}

run KILN_TESTS="t_a t_b"
last=$(tail -n 1 "$T/out.txt")
[ $rc -eq 0 ] && [ "$last" = "3 passed, 0 failed, 2 skipped" ] && ok runner_counts_skips \
    || fail runner_counts_skips "rc $rc, last line '$last'"

run CI=true KILN_TESTS="t_a t_b"
last=$(tail -n 1 "$T/out.txt")
if [ $rc -ne 0 ] && [ "$last" = "3 passed, 1 failed, 1 skipped" ] \
    && grep -q '^FAIL b_needs_pkg: skipped under CI=true (python package frob not installed)' "$T/out.txt" \
    && ! grep -q '^FAIL ops_cuda' "$T/out.txt"; then ok runner_ci_fails_non_gpu_skip
else fail runner_ci_fails_non_gpu_skip "rc $rc: $(tr '\n' '|' < "$T/out.txt")"; fi

run CI=true KILN_TESTS="t_a"
last=$(tail -n 1 "$T/out.txt")
[ $rc -eq 0 ] && [ "$last" = "2 passed, 0 failed, 1 skipped" ] && ok runner_ci_allows_gpu_only_skip \
    || fail runner_ci_allows_gpu_only_skip "rc $rc, last line '$last'"

run KILN_TEST_JOBS=2 KILN_TESTS="t_quiet t_dies t_a"
last=$(tail -n 1 "$T/out.txt")
if [ $rc -ne 0 ] && [ "$last" = "3 passed, 2 failed, 1 skipped" ] \
    && grep -q '^FAIL t_quiet: printed no result' "$T/out.txt" && grep -q '^FAIL t_dies: exited 3' "$T/out.txt" \
    && grep -A1 '^ok a_one' "$T/out.txt" | grep -q '^ok a_two'; then ok runner_failures_of_files
else fail runner_failures_of_files "rc $rc: $(tr '\n' '|' < "$T/out.txt")"; fi
