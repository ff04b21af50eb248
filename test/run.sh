#!/usr/bin/env bash
# The whole suite: every C test binary (build/test/test_*) and every shell test
# (test/t_*.sh). Each prints one line per check, "ok NAME", "FAIL NAME: why" or
# "skip NAME: why"; this script counts them and ends with "N passed, N failed".
set -u
cd "$(dirname "$0")/.."
export KILN_TEST_TMP=$(mktemp -d /tmp/kiln-test.XXXXXX)
trap 'rm -rf "$KILN_TEST_TMP"' EXIT
log="$KILN_TEST_TMP/suite.log"
: > "$log"
run_one() {
    local name=$1; shift
    local out rc
    out=$("$@" 2>"$KILN_TEST_TMP/stderr.txt"); rc=$?
    printf '%s\n' "$out" | grep -E '^(ok|FAIL|skip) ' | tee -a "$log"
    if [ $rc -ne 0 ]; then
        echo "FAIL $name: exited $rc; stderr: $(tail -n 3 "$KILN_TEST_TMP/stderr.txt" | tr '\n' ' ')" | tee -a "$log"
    elif ! printf '%s\n' "$out" | grep -qE '^(ok|FAIL|skip) '; then
        echo "FAIL $name: printed no result" | tee -a "$log"
    fi
}
# KILN_TESTS="test_config t_train ...": those only (make sanitize's part of the suite)
if [ -n "${KILN_TESTS:-}" ]; then
    for n in $KILN_TESTS; do
        case $n in
        test_*) run_one "$n" "build/test/$n" ;;
        *) run_one "$n" bash "test/$n.sh" ;;
        esac
    done
else
    for t in build/test/test_*; do
        [ -x "$t" ] || continue
        case "$t" in *.d) continue;; esac
        run_one "$(basename "$t")" "$t"
    done
    for t in test/t_*.sh; do
        [ -f "$t" ] || continue
        run_one "$(basename "$t" .sh)" bash "$t"
    done
fi
passed=$(grep -c '^ok ' "$log")
failed=$(grep -c '^FAIL ' "$log")
skipped=$(grep -c '^skip ' "$log")
if [ "$skipped" -gt 0 ]; then
    echo "$passed passed, $failed failed, $skipped skipped"
else
    echo "$passed passed, $failed failed"
fi
[ "$failed" -eq 0 ]
