#!/usr/bin/env bash
# Data mixtures through ./train on the CPU backend: each source's share of the
# tokens within the greedy blend's bound at every step; a small source running
# through epochs (logged); named validation sets; the data figures in
# metrics.jsonl and TensorBoard; prefetch on and off with the same losses;
# resume bit-identical mid-mixture and mid-epoch of one source; the same
# global order on 1, 2 and 4 MPI ranks; a changed mixture refused naming
# data.train or, with --force, continued per source; shards deleted or
# truncated under a running job; bad data keys. One line per check.
#
# Shares (docs/data.md): a source is picked only while behind its share, so
# after n samples its count c satisfies c - w n < 1, and since the deviations
# sum to 0 each is above -(S - 1): with S = 3 sources and seq_len 32 every
# source's tokens are within (-64, 32) of w x tokens, at every step.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_data_mix
rm -rf "$T"
mkdir -p "$T"
. test/ckpt_lib.sh
prep() { # prep DIR OFFSET BYTES VAL_FRACTION [more prepare flags]
    local dir=$1 off=$2 n=$3 vf=$4; shift 4
    tail -c +$((off + 1)) data/austen.txt | head -c $n > "$dir.txt"
    ./train prepare --tokenizer byte --out "$dir" --val-fraction $vf --shard-tokens 20000 "$@" "$dir.txt" >/dev/null 2>"$dir.err" \
        || fail data_mix_prepare "$(cat "$dir.err")"
}
prep "$T/web" 0 60000 0.1
prep "$T/code" 1000000 60000 0.1
prep "$T/math" 2000000 3000 0 # one shard, 93 samples of 33 tokens: exhausted after ~58 steps
Y=$T/mix.yaml
cat > "$Y" <<YAML
run: {name: mix, dir: "$T/ref", seed: 7, threads: 1}
model: {n_layer: 2, n_head: 2, n_embd: 32, seq_len: 32, vocab_size: 256}
data:
  train: [{path: "$T/web/train_*.bin", weight: 0.5, name: web},
          {path: "$T/code/train_*.bin", weight: 0.3},
          {path: "$T/math/train_*.bin", weight: 0.2, name: math}]
  val: [{name: web, path: "$T/web/val_*.bin"}, {name: code, path: "$T/code/val_*.bin"}]
batch: {micro_batch: 4, total_tokens: 256}
train: {steps: 80, eval_every: 20, eval_batches: 2, sample_every: 0}
schedule: {kind: constant, warmup_steps: 2}
checkpoint: {every: 20, keep_last: 0, async: false}
metrics: {peak_gflops: 1, tensorboard: true, log_every: 100}
YAML
# by_source FILE: step and tokens_by_source of every line (what must match exactly)
by_source() { grep -o '"step":[0-9]*,\|"tokens_by_source":{[^}]*}' "$1" | tr -d '\n'; }

./train $Y >$T/ref.txt 2>&1
rc=$?
if [ $rc -eq 0 ] && grep -q "data: mixture of 3 source(s): web: 50.0%" $T/ref.txt \
    && grep -q "data: source 'math' of data.train starts epoch 1" $T/ref.txt \
    && ! grep -q "source 'web' of data.train starts epoch" $T/ref.txt; then ok data_mix_runs_and_logs_epochs
else fail data_mix_runs_and_logs_epochs "rc $rc: $(grep -E 'error|data:' $T/ref.txt | head -3)"; fi

python3 - $T/ref/metrics.jsonl > $T/shares.txt 2>&1 <<'PY'
import json, sys
w = {"web": 0.5, "code_train": 0.3, "math": 0.2}
rows = [json.loads(l) for l in open(sys.argv[1])]
worst = {k: [0, 0] for k in w}
for r in rows:
    by = r["tokens_by_source"]
    assert set(by) == set(w), by
    assert sum(by.values()) == r["tokens"], (r["step"], by, r["tokens"])
    for k, x in by.items():
        d = x - w[k] * r["tokens"]
        worst[k] = [max(worst[k][0], d), min(worst[k][1], d)]
        assert -64 < d < 32, (r["step"], k, x, w[k] * r["tokens"])
    assert r["data_wait_s"] >= 0
print("ok", len(rows), worst)
PY
[ $? -eq 0 ] && ok data_mix_shares_within_one_sample || fail data_mix_shares_within_one_sample "$(tail -n 2 $T/shares.txt)"

python3 - $T/ref/metrics.jsonl > $T/val.txt 2>&1 <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ev = [r for r in rows if "val_loss" in r]
assert [r["step"] for r in ev] == [20, 40, 60, 80], [r["step"] for r in ev]
for r in ev:
    m = (r["val/web"] + r["val/code"]) / 2
    assert abs(m - r["val_loss"]) < 1e-5 * r["val_loss"], r
assert not any("val/web" in r for r in rows if "val_loss" not in r)
PY
[ $? -eq 0 ] && grep -q 'val [0-9.]* (web [0-9.]*, code [0-9.]*)' $T/ref.txt && ok data_mix_val_per_set \
    || fail data_mix_val_per_set "$(tail -n 2 $T/val.txt)"

if tools_python data_mix_tensorboard_tags; then
    "$TOOLS_PY" - $T/ref > $T/tb.txt 2>&1 <<'PY'
import glob, json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
d = sys.argv[1]
ea = EventAccumulator(glob.glob(d + "/events.out.tfevents.*")[0], size_guidance={"scalars": 0}); ea.Reload()
tags = set(ea.Tags()["scalars"])
want = {"data/tokens/web", "data/tokens/code_train", "data/tokens/math", "val/web", "val/code", "val/loss", "perf/data_wait_s"}
assert want <= tags, want - tags
last = json.loads(open(d + "/metrics.jsonl").readlines()[-1])
for k, v in last["tokens_by_source"].items():
    got = ea.Scalars("data/tokens/" + k)[-1]
    assert got.step == last["step"] and got.value == v, (k, got, v)
assert abs(ea.Scalars("val/web")[-1].value - last["val/web"]) < 1e-5
PY
    [ $? -eq 0 ] && ok data_mix_tensorboard_tags || fail data_mix_tensorboard_tags "$(tail -n 2 $T/tb.txt)"
fi

# prefetch on and off, one shard open at a time: the same losses, bit for bit
./train $Y --set run.dir=$T/p0 --set data.prefetch=0 >$T/p0.txt 2>&1
./train $Y --set run.dir=$T/p8 --set data.prefetch=8 --set data.max_open_shards=1 >$T/p8.txt 2>&1
if [ "$(losses $T/ref/metrics.jsonl)" = "$(losses $T/p0/metrics.jsonl)" ] \
    && [ "$(losses $T/ref/metrics.jsonl)" = "$(losses $T/p8/metrics.jsonl)" ] && grep -q 'prefetch 0 batch' $T/p0.txt; then
    ok data_mix_prefetch_identical_losses
else fail data_mix_prefetch_identical_losses "$(grep -h error $T/p0.txt $T/p8.txt | head -2)"; fi

# resume from step 40 (math mid-epoch 0) and from step 60 (math early in
# epoch 1): the same losses, tokens per source and parameters as straight through
REFSUM=$(sums $T/ref/checkpoints/step_00000080)
for at in 40 60; do
    D=$T/half$at
    ./train $Y --set run.dir=$D --set train.steps=$at >/dev/null 2>&1
    m=$(grep -o '"math":[0-9]*' $D/metrics.jsonl | tail -n 1 | cut -d: -f2)
    ./train $Y --set run.dir=$D --resume auto >$D.txt 2>&1
    rc=$?
    s=$((m / 32))
    if [ $rc -eq 0 ] && [ $((s % 93)) -ne 0 ] && [ "$(losses $T/ref/metrics.jsonl)" = "$(losses $D/metrics.jsonl)" ] \
        && [ "$(by_source $T/ref/metrics.jsonl)" = "$(by_source $D/metrics.jsonl)" ] \
        && [ "$(sums $D/checkpoints/step_00000080)" = "$REFSUM" ]; then
        ok data_mix_resume_bit_identical_step$at
    else fail data_mix_resume_bit_identical_step$at "rc $rc, math at sample $s (epoch $((s / 93))): $(grep -E 'error|resum' $D.txt | head -2)"; fi
done
s=$(( $(grep -o '"math":[0-9]*' $T/half60/metrics.jsonl | sed -n 60p | cut -d: -f2) / 32 ))
[ $s -gt 93 ] && ok data_mix_resume_crosses_epoch_of_one_source || fail data_mix_resume_crosses_epoch_of_one_source "math at sample $s at step 60"

# the same global order on 1, 2 and 4 ranks: 16 samples a step, 4 micro-batches of 4
if command -v mpirun >/dev/null 2>&1 && ldd ./train | grep -q libmpi; then
    MPIRUN=(timeout 180 mpirun --allow-run-as-root --oversubscribe)
    R="--set batch.total_tokens=512 --set train.steps=30 --set checkpoint.every=0"
    ./train $Y $R --set run.dir=$T/np1 >/dev/null 2>&1
    for np in 2 4; do
        "${MPIRUN[@]}" -np $np ./train $Y $R --set run.dir=$T/np$np >$T/np$np.txt 2>&1
        rc=$?
        why=$(close_losses $T/np1/metrics.jsonl $T/np$np/metrics.jsonl 2>&1)
        if [ $rc -eq 0 ] && [ -z "$why" ] && [ "$(by_source $T/np1/metrics.jsonl)" = "$(by_source $T/np$np/metrics.jsonl)" ]; then
            ok data_mix_same_order_np$np
        else fail data_mix_same_order_np$np "rc $rc: $why $(grep -m2 error $T/np$np.txt)"; fi
    done
else skip data_mix_same_order_ranks "no MPI build or mpirun"; fi

# A changed mixture: refused naming data.train (one line), continued per source with --force
W2='data.train=[{path: "'$T'/web/train_*.bin", weight: 0.2, name: web}, {path: "'$T'/code/train_*.bin", weight: 0.3}, {path: "'$T'/math/train_*.bin", weight: 0.5, name: math}]'
./train $Y --set run.dir=$T/base40 --set train.steps=40 >/dev/null 2>&1
cp -r $T/base40 $T/chg
if expect data_mix_resume_changed_weights_refused 2 "changed key 'data.train'" -- ./train $Y --set run.dir=$T/chg --set "$W2" --resume auto; then
    [ "$(grep -c 'kiln: error' $T/err.txt)" = 1 ] && ok data_mix_refusal_one_line || fail data_mix_refusal_one_line "$(cat $T/err.txt)"
fi
expect data_mix_resume_changed_weights_force 0 "data: --force: the weight of source 'web' changed; the blend restarts at global sample 320 .*'math' continues at epoch 0, sample" -- \
    ./train $Y --set run.dir=$T/chg --set "$W2" --resume auto --force
# the same config over changed shards (math gains one): refused, then forced
cp -r $T/base40 $T/grow
cp $T/web/train_000000.bin $T/math/train_000001.bin
expect data_mix_resume_shards_changed_refused 2 "key 'data.train': the checkpoint's mixture differs from this run's: source 'math' .* holds 717 samples now, 93 when" -- \
    ./train $Y --set run.dir=$T/grow --resume auto
expect data_mix_resume_shards_changed_force 0 "'math' continues at epoch 0, sample" -- ./train $Y --set run.dir=$T/grow --resume auto --force
rm -f $T/math/train_000001.bin
# a damaged data.train.state: --resume DIR names it (exit 2); --resume auto
# skips that checkpoint and still ends bit-identical
cp -r $T/base40 $T/dmg
C=$T/dmg/checkpoints/step_00000040
off=$(sed -n 's/^entry name=data.train.state .* offset=\([0-9]*\) .*/\1/p' $C/manifest)
python3 -c "import sys; p, o = sys.argv[1], int(sys.argv[2]) + 20; b = bytearray(open(p, 'rb').read()); b[o] ^= 0x40; open(p, 'wb').write(b)" $C/rank00000.bin "${off:-0}"
expect data_mix_damaged_state_dir 2 "step_00000040.*data.train.state" -- ./train $Y --set run.dir=$T/dmg --resume $C
./train $Y --set run.dir=$T/dmg --resume auto >$T/dmg.txt 2>&1
if [ -n "$off" ] && grep -q "skipping .*step_00000040" $T/dmg.txt && grep -q "resumed from .*step_00000020" $T/dmg.txt \
    && [ "$(losses $T/ref/metrics.jsonl)" = "$(losses $T/dmg/metrics.jsonl)" ]; then ok data_mix_damaged_state_skipped
else fail data_mix_damaged_state_skipped "offset '$off': $(grep -E 'skipping|resumed|error' $T/dmg.txt | head -3)"; fi
# a plain glob's checkpoint resumed by a mixture (--force): sources are matched by name, and
# the glob's name (web_train) is not 'web', so every source starts at its beginning
./train $Y --set run.dir=$T/plain --set "data.train=$T/web/train_*.bin" --set train.steps=10 >/dev/null 2>&1
expect data_mix_from_plain_glob_force 0 "data: --force: source 'web' is new; .*'web' starts at its beginning" -- ./train $Y --set run.dir=$T/plain --resume auto --force

# Shards deleted or truncated under a running job: the run waits before batch
# 21 (KILN_TEST_DATA_WAIT_AT_BATCH) until the test has changed a shard, then
# goes on; the next read of that shard stops it with one line naming it, exit 2,
# also when the prefetch thread finds it.
for c in "deleted:0:bin" "deleted:4:bin" "truncated:4:bin" "truncated:0:bin" "deleted:4:zst"; do
    what=${c%%:*}; rest=${c#*:}; pf=${rest%%:*}; ext=${rest#*:}
    D=$T/gone_${what}_$pf$ext
    mkdir -p $D
    if [ $ext = zst ]; then
        ./train prepare --tokenizer byte --out $D/web --val-fraction 0 --shard-tokens 10000 --zstd 1 $T/web.txt >/dev/null
        victim=$D/web/train_000002.bin.zst
    else
        ./train prepare --tokenizer byte --out $D/web --val-fraction 0 --shard-tokens 10000 $T/web.txt >/dev/null
        victim=$D/web/train_000002.bin
    fi
    KILN_TEST_DATA_WAIT_AT_BATCH=21 KILN_TEST_DATA_WAIT_FILE=$D/wait timeout 120 ./train $Y --set run.dir=$D/run \
        --set "data.train=$D/web/train_*" --set data.prefetch=$pf --set train.steps=200 --set checkpoint.every=0 \
        >$D/out.txt 2>$D/err.txt &
    pid=$!
    for _ in $(seq 1200); do [ -f $D/wait ] && break; sleep 0.05; done
    if [ $what = deleted ]; then rm -f $victim; else truncate -s 3000 $victim; fi
    rm -f $D/wait
    wait $pid
    rc=$?
    n=$(grep -c 'kiln: error' $D/err.txt)
    if [ $rc -eq 2 ] && [ "$n" = 1 ] && grep -q "kiln: error: $victim: .*while the run goes on\|kiln: error: $victim: cannot open" $D/err.txt; then
        ok data_shard_${what}_mid_run_prefetch${pf}_$ext
    else fail data_shard_${what}_mid_run_prefetch${pf}_$ext "rc $rc, $n error lines: $(head -c 400 $D/err.txt)"; fi
done

# Bad data keys: exit 2, one line naming the key.
bad() { # bad NAME PATTERN --set ...
    local name=$1 pat=$2; shift 2
    if expect "$name" 2 "$pat" -- ./train $Y --dry-run "$@"; then
        [ "$(grep -c 'kiln: error' $T/err.txt)" = 1 ] || fail "${name}_one_line" "$(cat $T/err.txt)"
    fi
}
bad data_bad_weight "key 'data.train\[0\].weight': expected a number > 0, got 'heavy'" --set 'data.train=[{path: a, weight: heavy}]'
bad data_bad_weight_negative "key 'data.train\[1\].weight': expected a number > 0, got '-1'" --set 'data.train=[{path: a}, {path: b, weight: -1}]'
bad data_missing_path "key 'data.train\[0\].path': required" --set 'data.train=[{weight: 1}]'
bad data_unknown_source_key "unknown key 'data.train\[0\].wieght'" --set 'data.train=[{path: a, wieght: 2}]'
bad data_duplicate_names "key 'data.train\[1\].name': 'web' is also the name of data.train\[0\]" --set 'data.train=[{path: x/web/*.bin}, {path: y/web/*.bin}]'
bad data_bad_name "key 'data.train\[0\].name': expected a name" --set 'data.train=[{path: a, name: "we b"}]'
bad data_train_mapping "key 'data.train': expected a glob \(a string\) or a list of sources" --set 'data.train={path: a}'
bad data_train_empty "key 'data.train': expected 1 to 16 entries, got 0" --set 'data.train=[]'
bad data_val_weight "unknown key 'data.val\[0\].weight'" --set 'data.val=[{name: a, path: a, weight: 2}]'
bad data_val_name_loss "key 'data.val\[0\].name': 'loss' is taken" --set 'data.val=[{name: loss, path: a}]'
bad data_bad_prefetch "key 'data.prefetch': expected an integer in \[0, 64\], got 'many'" --set data.prefetch=many
bad data_bad_prefetch_negative "key 'data.prefetch': expected an integer in \[0, 64\]" --set data.prefetch=-1
bad data_bad_max_open "key 'data.max_open_shards': expected an integer in \[1, 65536\]" --set data.max_open_shards=0
printf 'data:\n  train:\n    - {path: a, weight: 1}\n    - {path: b, weight: lots}\n' > $T/badw.yaml
expect data_bad_weight_file_line 2 "badw.yaml:4: key 'data.train\[1\].weight'" -- ./train $T/badw.yaml --dry-run
expect data_missing_source_glob 2 "data.train source 'math': no files match" -- ./train $Y --set "data.train=[{path: '$T/web/train_*.bin'}, {path: '$T/nothing/*.bin', name: math}]"
expect data_help_force 0 "data.train \(sources, weights or" -- ./train --help
expect data_help_prepare_flags 0 "--format text\|jsonl" -- ./train --help

# Weights near DBL_MAX (token counts, say) whose sum overflows keep their
# shares: they were all 0% (weight / inf), each source one unit of the blend
# whatever its weight; a share below a unit is still one unit, never none.
./train $Y --set train.steps=2 --set run.dir=$T/huge --set "data.train=[{path: '$T/web/train_*.bin', weight: 1.5e308, name: web},
    {path: '$T/code/train_*.bin', weight: 0.5e308, name: code}, {path: '$T/math/train_*.bin', weight: 1e-300, name: math}]" >$T/huge.txt 2>&1
rc=$?
if [ $rc -eq 0 ] && grep -q "web: 75.0%.*code: 25.0%.*math: 0.0%" $T/huge.txt; then ok data_mix_weights_summing_past_dbl_max
else fail data_mix_weights_summing_past_dbl_max "rc $rc: $(grep -E 'error|mixture' $T/huge.txt | head -2)"; fi
