#!/usr/bin/env bash
# make valgrind, after its build: memcheck over one tiny training run (6
# steps: evaluation, sampling, TensorBoard events, asynchronous checkpoints at
# steps 3 and 6) and its resume from step 6 to 9. Each must end with exit 0 and
# memcheck's "ERROR SUMMARY: 0 errors": no invalid read or write, no use of an
# uninitialised value, no memory definitely or indirectly lost at exit. What
# memcheck calls "possibly lost" is not counted: the OpenMP pool's threads
# still hold their stacks when the process ends (libgomp's, not kiln's).
# The logs stay in build-vg/logs/. docs/testing.md, "Valgrind".
set -u
cd "$(dirname "$0")/.."
V=$PWD/build-vg/train
[ -x $V ] || { echo "FAIL valgrind: $V not built (make valgrind builds it)"; exit 1; }
command -v valgrind >/dev/null || { echo "skip valgrind: valgrind not installed (make deps installs it)"; exit 0; }
T=$PWD/build-vg/run
L=$PWD/build-vg/logs
rm -rf $T $L && mkdir -p $T $L
. test/lib.sh
head -c 60000 data/austen.txt > $T/corpus.txt
$V prepare --tokenizer byte --out $T/data --val-fraction 0.1 $T/corpus.txt >/dev/null || { fail valgrind_prepare "prepare failed"; exit 1; }
cat > $T/tiny.yaml <<YAML
run: {name: vg, dir: "$T/run", seed: 7}
model: {n_layer: 2, n_head: 2, n_embd: 32, seq_len: 32, vocab_size: 256}
data: {train: "$T/data/train_*.bin", val: "$T/data/val_*.bin"}
batch: {micro_batch: 4, total_tokens: 256}
train: {steps: 6, eval_every: 3, eval_batches: 2, sample_every: 6, sample_tokens: 8}
schedule: {warmup_steps: 2}
checkpoint: {every: 3, keep_last: 0}
metrics: {peak_gflops: 1, tensorboard: true, log_every: 1}
YAML
vg() {
    local name=$1; shift
    valgrind --error-exitcode=99 --leak-check=full --show-leak-kinds=definite,indirect \
        --errors-for-leak-kinds=definite,indirect --track-origins=yes --log-file=$L/$name.log "$@" >$L/$name.out 2>&1
    local rc=$?
    local summary=$(grep -o 'ERROR SUMMARY: [0-9]* errors' $L/$name.log)
    if [ $rc -eq 0 ] && [ "$summary" = "ERROR SUMMARY: 0 errors" ]; then
        ok valgrind_$name
        echo "  $summary; $(grep -o 'definitely lost: .*' $L/$name.log); $(grep -o 'total heap usage: .*' $L/$name.log)"
    else fail valgrind_$name "exit $rc, ${summary:-no summary} ($L/$name.log)"; fi
}
vg train $V $T/tiny.yaml
vg resume $V $T/tiny.yaml --set train.steps=9 --resume auto
grep -q 'resumed from .*step_00000006 at step 6' $L/resume.out && ok valgrind_resume_resumed_at_6 \
    || fail valgrind_resume_resumed_at_6 "$(grep -E 'resumed|error' $L/resume.out | head -2)"
