#!/usr/bin/env bash
# compare_optimizers.sh: AdamW, Muon, Lion and Adafactor on configs/tiny.yaml
# (GPT-2) and configs/llama-tiny.yaml (Llama, GQA) for the same tokens, each at
# its tuned learning rate, and one ./train report page overlaying every run.
#
#   scripts/compare_optimizers.sh [--out DIR] [--steps N] [--sweep] [--sweep-steps N] [--threads N]
#                                 [--time-rounds N]
#
# --sweep first tries three learning rates per optimizer and model for
# --sweep-steps steps (cosine to the same floor), then doubles (or halves)
# past the best while it is the grid's edge, at most twice, and keeps the one
# with the lowest validation loss; without it the rates this script found on
# 2026-12-01 (docs/optimizers.md, "Comparison") are used. A run whose
# directory already holds its completed summary (same steps, same rate) is
# not run again, so an interrupted comparison continues. Every run: the
# config's batch (4096 tokens a step), cosine schedule with 30 warmup steps,
# --steps steps (default 300), validation every 50 steps on the same 10
# batches, one thread (a loaded machine's OpenMP barriers otherwise dominate),
# no checkpoints or samples. Muon runs with optim.muon_scale match_adamw, so
# one optim.lr serves its matrices and the AdamW part alike; Adafactor with
# its defaults (no first moment). Step times: a machine shared with other
# work changes speed from minute to minute, so after the runs every
# optimizer is timed again in --time-rounds (3) rounds of 20 steps,
# interleaved (round 1: every model and optimizer, then round 2, ...), each
# run's median step over steps 6-20, the median of the rounds reported; and
# Muon's runs measure their own Newton-Schulz share of the step. Writes
# DIR/<model>-<optimizer>/ run directories, DIR/report.html, DIR/summary.md
# (final validation loss, step time, Muon's Newton-Schulz share) and, with
# chromium, DIR/report.png. Needs data/austen (make data).
set -eu
cd "$(dirname "$0")/.."
OUT=runs/compare_optimizers STEPS=300 SWEEP=0 SWEEP_STEPS=100 THREADS=1 ROUNDS=3
while [ $# -gt 0 ]; do
    case $1 in
        --out) OUT=$2; shift 2 ;;
        --steps) STEPS=$2; shift 2 ;;
        --sweep) SWEEP=1; shift ;;
        --sweep-steps) SWEEP_STEPS=$2; shift 2 ;;
        --threads) THREADS=$2; shift 2 ;;
        --time-rounds) ROUNDS=$2; shift 2 ;;
        *) echo "compare_optimizers.sh: unknown argument '$1' (see the comment at the top)" >&2; exit 2 ;;
    esac
done
[ -x ./train ] || { echo "compare_optimizers.sh: ./train not built (make)" >&2; exit 2; }
[ -f data/austen/train_000000.bin ] || { echo "compare_optimizers.sh: no data/austen (make data)" >&2; exit 2; }
mkdir -p "$OUT"

MODELS="tiny llama-tiny"
OPTIMS="adamw muon lion adafactor"
# the sweep's grid, and the rates it chose (the default without --sweep)
grid() {
    case $1 in
        adamw) echo "1.5e-3 3e-3 6e-3" ;;
        muon) echo "3e-3 6e-3 1.2e-2" ;;
        lion) echo "3e-4 6e-4 1.2e-3" ;;
        adafactor) echo "3e-3 1e-2 3e-2" ;;
    esac
}
tuned() { # MODEL OPTIM: what --sweep chose on 2026-12-01 (docs/optimizers.md)
    case $1-$2 in
        tiny-adamw) echo 3e-3 ;; tiny-muon) echo 0.024 ;; tiny-lion) echo 1.2e-3 ;; tiny-adafactor) echo 0.0015 ;;
        llama-tiny-adamw) echo 6e-3 ;; llama-tiny-muon) echo 0.024 ;; llama-tiny-lion) echo 0.0024 ;;
        llama-tiny-adafactor) echo 3e-3 ;;
    esac
}
extra() { [ "$1" = muon ] && echo "--set optim.muon_scale=match_adamw" || true; }

# run MODEL OPTIM LR STEPS DIR [--set ...]
run() {
    local model=$1 opt=$2 lr=$3 steps=$4 dir=$5
    shift 5
    if [ -f "$dir/summary.json" ] && python3 -c "
import json, sys; s = json.load(open(sys.argv[1] + '/summary.json')); c = open(sys.argv[1] + '/config.yaml').read()
sys.exit(not (s['status'] == 'completed' and s['steps'] == int(sys.argv[2]) and '  lr: ' + sys.argv[3] + '\n' in c))" \
        "$dir" "$steps" "$(python3 -c "import sys; print('%g' % float(sys.argv[1]))" "$lr")" 2>/dev/null; then
        return 0
    fi
    rm -rf "$dir"
    # shellcheck disable=SC2046
    ./train configs/$model.yaml --set run.name="$model-$opt" --set run.dir="$dir" --set run.threads=$THREADS \
        --set optim.name=$opt --set optim.lr=$lr $(extra $opt) --set train.steps=$steps \
        --set train.eval_every=50 --set train.sample_every=0 --set checkpoint.every=0 \
        --set checkpoint.final=false --set metrics.tensorboard=false "$@" >"$dir.txt" 2>&1 \
        || { echo "compare_optimizers.sh: $model $opt lr $lr failed: $(tail -n 2 "$dir.txt")" >&2; exit 1; }
}
val_loss() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['final_val_loss'])" "$1/summary.json"; }

for model in $MODELS; do
    for opt in $OPTIMS; do
        lr=$(tuned $model $opt)
        if [ $SWEEP = 1 ]; then
            cands=$(grid $opt) best="" tried=""
            for round in 0 1 2; do
                for cand in $cands; do
                    case " $tried " in *" $cand "*) continue ;; esac
                    tried="$tried $cand"
                    d=$OUT/sweep/$model-$opt-$cand
                    mkdir -p "$OUT/sweep"
                    run $model $opt $cand $SWEEP_STEPS "$d"
                    v=$(val_loss "$d")
                    echo "sweep $model $opt lr $cand: val loss $v"
                    if [ -z "$best" ] || python3 -c "import sys; sys.exit(not float(sys.argv[1]) < float(sys.argv[2]))" \
                        "$v" "$bestv"; then best=$cand bestv=$v; fi
                done
                # the best at an edge of what was tried: one step further out
                lo=$(printf '%s\n' $tried | sort -g | head -1) hi=$(printf '%s\n' $tried | sort -g | tail -1)
                if [ "$best" = "$hi" ]; then cands=$(python3 -c "import sys; print('%g' % (2 * float(sys.argv[1])))" $hi)
                elif [ "$best" = "$lo" ]; then cands=$(python3 -c "import sys; print('%g' % (float(sys.argv[1]) / 2))" $lo)
                else break; fi
                [ $round -lt 2 ] || break
            done
            lr=$best
        fi
        echo "run $model $opt lr $lr, $STEPS steps"
        run $model $opt $lr $STEPS "$OUT/$model-$opt"
        echo "$lr" >"$OUT/$model-$opt.lr"
    done
done

# the interleaved timing runs (no evaluation, every step logged)
for round in $(seq 1 "$ROUNDS"); do
    mkdir -p "$OUT/timing"
    for model in $MODELS; do
        for opt in $OPTIMS; do
            echo "timing round $round: $model $opt"
            run $model $opt "$(cat "$OUT/$model-$opt.lr")" 20 "$OUT/timing/$model-$opt-$round" \
                --set train.eval_every=0 --set metrics.log_every=1
        done
    done
done

dirs=()
for model in $MODELS; do for opt in $OPTIMS; do dirs+=("$OUT/$model-$opt"); done; done
./train report "${dirs[@]}" -o "$OUT/report.html" >/dev/null
python3 - "$OUT" "$ROUNDS" $MODELS -- $OPTIMS >"$OUT/summary.md" <<'PY'
import glob, json, re, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
k = sys.argv.index("--")
models, optims = sys.argv[3:k], sys.argv[k + 1:]
def step_time(d):  # the median step over steps 6..20 of a timing run
    t = [json.loads(l)["step_time_s"] for l in open(d + "/metrics.jsonl")]
    return statistics.median(t[5:])
def ns_share(d):
    for line in open(d + "/log/rank0.txt"):
        g = re.search(r"muon: ([0-9.]+)% of step time in the owners' momentum and Newton-Schulz", line)
        if g:
            return float(g.group(1))
    return None
print("| model | optimizer | lr | val loss | step time (s) | vs AdamW | Newton-Schulz share |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for m in models:
    base = None
    for o in optims:
        d = "%s/%s-%s" % (out, m, o)
        s = json.load(open(d + "/summary.json"))
        lr = open(d + ".lr").read().strip()
        runs = ["%s/timing/%s-%s-%d" % (out, m, o, r) for r in range(1, rounds + 1)]
        st = statistics.median(step_time(r) for r in runs)
        base = st if o == "adamw" else base
        shares = [x for x in (ns_share(r) for r in runs + [d]) if x is not None]
        ns = "%.1f%%" % statistics.median(shares) if shares else "-"
        rel = "%.2fx" % (st / base) if base else "-"
        print("| %s | %s | %s | %.4f | %.3f | %s | %s |" % (m, o, lr, s["final_val_loss"], st, rel, ns))
PY
cat "$OUT/summary.md"
CHROME=$(command -v chromium || command -v chromium-browser || true)
if [ -n "$CHROME" ]; then
    timeout 120 "$CHROME" --headless --no-sandbox --disable-gpu --hide-scrollbars --user-data-dir="$OUT/chrome" \
        --screenshot="$OUT/report.png" --window-size=1200,1800 "file://$(cd "$OUT" && pwd)/report.html" \
        >"$OUT/chrome.txt" 2>&1 || true
    [ -s "$OUT/report.png" ] && echo "screenshot: $OUT/report.png"
fi
echo "report: $OUT/report.html"
