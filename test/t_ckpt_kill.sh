#!/usr/bin/env bash
# kill -9 at random moments — mid-step and mid-write (a checkpoint every step)
# — then --resume auto, over and over. The run must end with exactly the
# parameters, optimizer state and losses of an uninterrupted run, and no
# resume may ever meet a damaged checkpoint (a kill leaves only step_N.tmp/,
# which is never loaded).
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_ckpt_kill
rm -rf "$T"
. test/ckpt_lib.sh
ckpt_setup
KILLS=${KILN_KILLS:-25}
STEPS=150
for async in false true; do
    Y="$T/tiny.yaml --set train.steps=$STEPS --set checkpoint.every=1 --set checkpoint.keep_last=2 --set train.eval_every=50 --set checkpoint.async=$async"
    ./train $Y --set run.dir=$T/ref_$async >/dev/null 2>&1
    REF=$(sums $T/ref_$async/checkpoints/$(printf 'step_%08d' $STEPS))
    D=$T/run_$async
    kills=0 bad="" resumes=""
    RANDOM=$(( 12345 + ${#async} ))
    while [ $kills -lt $KILLS ]; do
        ./train $Y --set run.dir=$D --resume auto >$T/out_$kills.txt 2>&1 &
        pid=$!
        # 20..400 ms: start-up, steps and writes all get hit
        sleep "0.$(printf '%03d' $(( 20 + RANDOM % 380 )))"
        kill -9 $pid 2>/dev/null
        wait $pid 2>/dev/null
        kills=$((kills + 1))
        grep -q 'skipping' $T/out_$kills.txt 2>/dev/null && bad="$bad $(grep skipping $T/out_$kills.txt)"
        grep -q 'skipping' $T/out_$((kills - 1)).txt && bad="$bad $(grep skipping $T/out_$((kills - 1)).txt)"
        s=$(grep -o 'resumed from [^ ]*' $T/out_$((kills - 1)).txt | sed 's/.*step_0*//')
        resumes="$resumes ${s:-0}"
        # latest, when present, always names a complete checkpoint
        if [ -f $D/checkpoints/latest ] && [ ! -f "$D/checkpoints/$(cat $D/checkpoints/latest)/manifest" ]; then
            bad="$bad latest->$(cat $D/checkpoints/latest) incomplete"
        fi
    done
    ./train $Y --set run.dir=$D --resume auto >$T/final.txt 2>&1
    rc=$?
    grep -q 'skipping' $T/final.txt && bad="$bad $(grep skipping $T/final.txt)"
    got=$(sums $D/checkpoints/$(printf 'step_%08d' $STEPS))
    if [ $rc -eq 0 ] && [ -z "$bad" ] && [ -n "$REF" ] && [ "$got" = "$REF" ] \
        && [ "$(losses $D/metrics.jsonl)" = "$(losses $T/ref_$async/metrics.jsonl)" ]; then
        ok "ckpt_kill9_x${KILLS}_async_${async}_bit_identical"
    else
        fail "ckpt_kill9_x${KILLS}_async_${async}_bit_identical" "rc $rc; bad:$bad; got '$got' want '$REF'; resumed at:$resumes"
    fi
    echo "# async=$async: resumed at steps$resumes" >&2
done
