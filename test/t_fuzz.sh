#!/usr/bin/env bash
# The fuzz targets (test/fuzz/, built by make test where clang's libFuzzer is
# found) as a regression check: each runs its committed seed corpus, the inputs
# earlier campaigns found included, then mutates it for a few seconds. A crash,
# a sanitizer report, a hang or a refusal that is not one error line with exit
# 2 fails its check; -seed=1 makes the mutations the same on every run, so a
# check fails on a finding in the code, never on the draw. Campaigns are `make fuzz` (docs/testing.md, "Fuzzing").
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_fuzz
rm -rf "$T" && mkdir -p "$T"
. test/lib.sh
targets="config shard manifest tiktoken pretok llmc safetensors hfdir runs ckptlayout mlflow"
# fuzz_config's dictionary names every key of the table (a key added later
# must be added: bash scripts/fuzz_config_dict.sh > test/fuzz/config.dict)
absent=$(./train config-doc | grep '^| `' | awk -F'`' '{print $2}' | while read -r k; do
    grep -qxF "\"$k=\"" test/fuzz/config.dict || printf ' %s' "$k"; done)
if [ -z "$absent" ]; then ok fuzz_config_dict_names_every_key
else fail fuzz_config_dict_names_every_key "test/fuzz/config.dict lacks$absent (bash scripts/fuzz_config_dict.sh > test/fuzz/config.dict)"; fi
missing=""
for t in $targets; do [ -x build-fuzz/fuzz_$t ] || missing="$missing $t"; done
if [ -n "$missing" ]; then
    skip fuzz_regression "no libFuzzer build of$missing (clang with libFuzzer: make deps, then make fuzz-build)"
    exit 0
fi
for t in $targets; do
    mkdir -p $T/$t
    dict=()
    [ -f test/fuzz/$t.dict ] && dict=(-dict=test/fuzz/$t.dict)
    # a few seconds: the seeds themselves first, then what mutation reaches
    build-fuzz/fuzz_$t -seed=1 -max_total_time=4 -timeout=30 -rss_limit_mb=2048 -print_final_stats=1 "${dict[@]}" \
        -artifact_prefix=$T/crash-$t- $T/$t test/fuzz/corpus/$t >$T/$t.log 2>&1
    rc=$?
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' $T/$t.log)
    seeds=$(ls test/fuzz/corpus/$t | wc -l)
    if [ $rc -eq 0 ] && [ "${runs:-0}" -ge "$seeds" ]; then ok fuzz_${t}_regression
    else fail fuzz_${t}_regression "exit $rc after ${runs:-0} runs: $(grep -m 3 -E 'fuzz:|ERROR|SUMMARY|runtime error' $T/$t.log | tr '\n' ' ')"; fi
done
