#!/usr/bin/env bash
# ./train compare and the report's config differences: two runs that differ in
# optim.lr (and a third in the batch size) compared side by side -- the keys
# that differ and nothing else, the loss at equal tokens, throughput, and a
# verdict that names the run metrics.jsonl says has the lower validation loss
# at the last common evaluation; `./train report A B` gets the same keys in a
# table; bad usage exits 2. Prints one line per check.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_compare
rm -rf "$T" && mkdir -p "$T"
. test/lib.sh
. test/track_lib.sh

small_corpus "$T/data"
track_config "$T/c.yaml" base
./train "$T/c.yaml" >"$T/a.txt" 2>&1 || fail compare_run_base "$(tail -n 2 "$T/a.txt")"
./train "$T/c.yaml" --set run.name=hot --set run.dir="$T/hot" --set optim.lr=3e-3 >"$T/b.txt" 2>&1 \
    || fail compare_run_hot "$(tail -n 2 "$T/b.txt")"
# half the tokens per step, twice the steps: the same tokens in all
./train "$T/c.yaml" --set run.name=small --set run.dir="$T/small" --set batch.total_tokens=256 --set train.steps=24 \
    --set train.eval_every=12 >"$T/c.txt" 2>&1 || fail compare_run_small "$(tail -n 2 "$T/c.txt")"

./train compare "$T/base" "$T/hot" >"$T/cmp.txt" 2>&1
rc=$?
if [ $rc -eq 0 ] && grep -q '^config: 1 key differs' "$T/cmp.txt" && grep -qE '^  optim.lr +0.0006 +0.003$' "$T/cmp.txt"; then
    ok compare_config_keys_differ
else fail compare_config_keys_differ "exit $rc: $(head -n 12 "$T/cmp.txt")"; fi
if [ "$(sed -n '/^loss at equal tokens/,/^$/p' "$T/cmp.txt" | grep -cE '^  [0-9]+ ')" -eq 4 ] \
    && grep -qE '^  tokens/s ' "$T/cmp.txt" && grep -qE '^  MFU +[0-9.]+% +[0-9.]+%$' "$T/cmp.txt"; then
    ok compare_loss_and_throughput_tables
else fail compare_loss_and_throughput_tables "$(cat "$T/cmp.txt")"; fi
# the verdict: the lower validation loss at the last common evaluation (6144 tokens),
# as metrics.jsonl has it, or no clear difference when within 1%
if python3 - "$T" "$T/cmp.txt" <<'EOF'
import json, sys
T, out = sys.argv[1], open(sys.argv[2]).read()
val = {n: [r for r in map(json.loads, open(f"{T}/{n}/metrics.jsonl")) if "val_loss" in r][-1] for n in ("base", "hot")}
assert val["base"]["tokens"] == val["hot"]["tokens"] == 6144
verdict = [l for l in out.splitlines() if l.startswith("verdict: ")][0]
lo, hi = sorted(val, key=lambda n: val[n]["val_loss"])
if (val[hi]["val_loss"] - val[lo]["val_loss"]) / val[hi]["val_loss"] < 0.01:
    assert verdict.startswith("verdict: no clear difference in validation loss at 6144 tokens"), verdict
else:
    assert verdict.startswith(f"verdict: {lo} has the lowest validation loss at 6144 tokens: {val[lo]['val_loss']:.4f}"), verdict
EOF
then ok compare_verdict_follows_metrics; else fail compare_verdict_follows_metrics "$(grep verdict "$T/cmp.txt")"; fi

./train compare "$T/base" "$T/hot" "$T/small" >"$T/cmp3.txt" 2>&1
if grep -q '^config: 4 keys differ' "$T/cmp3.txt" && grep -qE '^  batch.total_tokens +512 +512 +256$' "$T/cmp3.txt" \
    && grep -q '^verdict: ' "$T/cmp3.txt"; then
    ok compare_three_runs
else fail compare_three_runs "$(head -n 14 "$T/cmp3.txt")"; fi

./train report "$T/base" "$T/hot" -o "$T/r.html" >/dev/null 2>&1
if grep -q '<h2>Config differences</h2>' "$T/r.html" && grep -q '<tr><td>optim.lr</td><td>0.0006</td><td>0.003</td></tr>' "$T/r.html"; then
    ok report_config_differences_table
else fail report_config_differences_table "$(grep -o '<h2>[^<]*' "$T/r.html" | tr '\n' ' ')"; fi
./train report "$T/base" -o "$T/one.html" >/dev/null 2>&1
if ! grep -q 'Config differences' "$T/one.html"; then ok report_one_run_no_differences
else fail report_one_run_no_differences "a table for one run"; fi

expect compare_needs_two_runs 2 'compare: needs at least two run directories, got 1' -- ./train compare "$T/base"
expect compare_bad_dir 2 'nothing: not a run directory' -- ./train compare "$T/base" "$T/nothing"
