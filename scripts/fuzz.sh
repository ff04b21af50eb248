#!/usr/bin/env bash
# make fuzz FUZZ_SECONDS=N: a campaign of N seconds per target (test/fuzz/),
# each from its committed seeds (test/fuzz/corpus/TARGET) into a corpus that
# grows across campaigns (build-fuzz/corpus/TARGET). Findings go to
# build-fuzz/crashes/TARGET-*, logs to build-fuzz/logs/TARGET.log; the table at
# the end gives executions, coverage and findings per target (the figures
# docs/testing.md records). Exit 1 if any target found something.
#   scripts/fuzz.sh SECONDS TARGET...   (make fuzz passes every target)
set -u
cd "$(dirname "$0")/.."
secs=${1:?usage: scripts/fuzz.sh SECONDS TARGET...}
shift
F=build-fuzz
mkdir -p $F/logs $F/crashes $F/seeds-big
# the tiktoken reader refuses any vocabulary but GPT-2's 50,256 ranks: start it
# from one that loads as well (every byte, then byte pairs; 560 KB, made here,
# not committed), and from GPT-2's own if scripts/fetch_gpt2_vocab.sh got it
if [ ! -f $F/seeds-big/gpt2_sized.tiktoken ]; then
    python3 - $F/seeds-big/gpt2_sized.tiktoken <<'PY'
import base64, sys
toks = [bytes([b]) for b in range(256)] + [bytes([a, b]) for a in range(256) for b in range(256)][:50000]
open(sys.argv[1], "w").write("".join("%s %d\n" % (base64.b64encode(t).decode(), r) for r, t in enumerate(toks)))
PY
fi
[ -f data/cache/gpt2.tiktoken ] && cp data/cache/gpt2.tiktoken $F/seeds-big/
found=0
rows=()
for t in "$@"; do
    bin=$F/fuzz_$t
    [ -x $bin ] || { echo "✗ $bin not built (make fuzz-build)"; exit 1; }
    mkdir -p $F/corpus/$t
    extra=()
    [ $t = tiktoken ] && extra=($F/seeds-big)
    dict=()
    [ -f test/fuzz/$t.dict ] && dict=(-dict=test/fuzz/$t.dict)
    before=$(ls $F/crashes | grep -c "^$t-")
    # -timeout: one input's limit (a hang is a finding); -rss_limit_mb: the
    # parent's memory (children are limited by libFuzzer's malloc limit)
    $bin -max_total_time=$secs -timeout=30 -rss_limit_mb=2048 -use_value_profile=1 -print_final_stats=1 "${dict[@]}" \
        -artifact_prefix=$F/crashes/$t- $F/corpus/$t test/fuzz/corpus/$t "${extra[@]}" >$F/logs/$t.log 2>&1
    rc=$?
    after=$(ls $F/crashes | grep -c "^$t-")
    last=$(grep -E '^#[0-9]+' $F/logs/$t.log | tail -1)
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' $F/logs/$t.log)
    cov=$(echo "$last" | grep -o 'cov: [0-9]*' | cut -d' ' -f2)
    ft=$(echo "$last" | grep -o 'ft: [0-9]*' | cut -d' ' -f2)
    corp=$(echo "$last" | grep -o 'corp: [0-9]*' | cut -d' ' -f2)
    speed=$(echo "$last" | grep -o 'exec/s: [0-9]*' | cut -d' ' -f2)
    new=$((after - before))
    [ $rc -ne 0 ] || [ $new -gt 0 ] && found=1
    rows+=("$(printf '%-12s %8s %12s %8s %6s %7s %6s   %s' $t ${secs}s "${execs:-?}" "${speed:-?}" "${cov:-?}" \
        "${ft:-?}" "${corp:-?}" "$([ $new -gt 0 ] || [ $rc -ne 0 ] && echo "exit $rc, $new new in $F/crashes" || echo none)")")
    echo "${rows[-1]}"
done
echo
printf '%-12s %8s %12s %8s %6s %7s %6s   %s\n' target time executions exec/s cov ft corpus findings
printf '%s\n' "${rows[@]}"
exit $found
