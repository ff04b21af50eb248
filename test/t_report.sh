#!/usr/bin/env bash
# ./train report: two short runs overlaid in one self-contained HTML page
# (no scripts, nothing fetched), rendered by headless Chromium to a PNG in
# which the two runs' series colours must appear. Chromium is installed with
# apt-get if missing and the test is skipped if that is impossible. Prints one
# line per check.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_report
rm -rf "$T" && mkdir -p "$T"
. test/lib.sh

small_corpus "$T/data"
cat > "$T/small.yaml" <<EOF
run: {name: base, dir: "$T/base", seed: 7, threads: 1}
model: {n_layer: 2, n_head: 2, n_embd: 32, seq_len: 32, vocab_size: 256}
data: {train: "$T/data/train_*.bin", val: "$T/data/val_*.bin"}
batch: {micro_batch: 4, total_tokens: 256}
train: {steps: 40, eval_every: 10, eval_batches: 2, sample_every: 0}
schedule: {warmup_steps: 4}
metrics: {log_every: 40, peak_gflops: 50}
EOF
./train "$T/small.yaml" >"$T/out1.txt" 2>&1 || fail report_run_base "$(tail -n 3 "$T/out1.txt")"
./train "$T/small.yaml" --set run.name=fast --set run.dir="$T/fast" --set optim.lr=3e-3 >"$T/out2.txt" 2>&1 \
    || fail report_run_fast "$(tail -n 3 "$T/out2.txt")"

./train report "$T/base" "$T/fast" -o "$T/report.html" >"$T/out.txt" 2>&1
rc=$?
H="$T/report.html"
if [ $rc -eq 0 ] && [ -s "$H" ] && [ "$(grep -o '<svg' "$H" | wc -l)" -eq 7 ] && grep -q 'Loss' "$H" && grep -q 'Data wait per step' "$H" \
    && grep -q 'Learning rate' "$H" && grep -q 'Gradient norm' "$H" && grep -q 'Throughput' "$H" \
    && grep -q 'Model FLOPs utilisation' "$H" && grep -q '>base' "$H" && grep -q '>fast' "$H" \
    && grep -q 'lr: 0.003' "$H" && grep -q 'class="val"' "$H"; then
    ok report_html_written
else fail report_html_written "exit $rc: $(cat "$T/out.txt")"; fi
# self-contained: no scripts, no external stylesheets, images or fonts
if ! grep -qiE '<script|<link|<img|src=|@import|url\(http' "$H"; then ok report_self_contained
else fail report_self_contained "$(grep -oiE '<script|<link|<img|src=[^ ]*|@import|url\(http' "$H" | head -3)"; fi
# two runs with one run.name (a rerun elsewhere): the legend tells them apart
# by the shortest distinct tail of their directories
mkdir -p "$T/rerun" && cp -r "$T/base" "$T/rerun/base"
./train report "$T/base" "$T/rerun/base" -o "$T/same.html" >"$T/out.txt" 2>&1
if grep -q '>base (t_report/base)' "$T/same.html" && grep -q '>base (rerun/base)' "$T/same.html"; then
    ok report_same_name_labels
else fail report_same_name_labels "$(grep -o 'class="lg">[^<]*' "$T/same.html" | sort -u | head -4)"; fi
./train report "$T/base" >/dev/null 2>&1
if [ -s "$T/base/report.html" ]; then ok report_default_path; else fail report_default_path "no $T/base/report.html"; fi
./train report "$T/nothing" >"$T/out.txt" 2>&1
rc=$?
if [ $rc -eq 2 ] && grep -q 'nothing: not a run directory' "$T/out.txt"; then ok report_bad_dir
else fail report_bad_dir "exit $rc: $(cat "$T/out.txt")"; fi

# Render it. Chromium: from PATH, else apt-get (root only), else skip.
CHROME=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [ -z "$CHROME" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive \
             apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1; })
    CHROME=$(command -v chromium || true)
fi
if [ -z "$CHROME" ]; then skip report_rendered_in_chromium "chromium not installed and apt-get could not install it"; exit 0; fi
tools_python report_rendered_in_chromium || exit 0 # Pillow, from the tools venv
timeout 120 "$CHROME" --headless --no-sandbox --disable-gpu --hide-scrollbars --user-data-dir="$T/chrome" \
    --screenshot="$T/report.png" --window-size=1200,2000 "file://$H" >"$T/chrome.txt" 2>&1
if [ ! -s "$T/report.png" ]; then fail report_rendered_in_chromium "no screenshot: $(tail -n 3 "$T/chrome.txt")"; exit 0; fi
# Each run's colour (palette[0] #1f77b4, palette[1] #d62728) must cover a
# real share of the page: six charts of 2-px lines are thousands of pixels;
# 1500 rules out the legend swatches alone (a few hundred).
if "$TOOLS_PY" - "$T/report.png" >"$T/px.txt" 2>&1 <<'EOF'
import sys
from PIL import Image
im = Image.open(sys.argv[1]).convert("RGB")
px = list(im.getdata())
def near(c, tol=40):
    return sum(1 for p in px if abs(p[0]-c[0]) + abs(p[1]-c[1]) + abs(p[2]-c[2]) <= tol)
blue, red = near((0x1f, 0x77, 0xb4)), near((0xd6, 0x27, 0x28))
nonwhite = sum(1 for p in px if sum(p) < 720)
print("blue", blue, "red", red, "nonwhite", nonwhite, "size", im.size)
sys.exit(0 if blue > 1500 and red > 1500 and nonwhite > 20000 else 1)
EOF
then ok report_rendered_in_chromium; else fail report_rendered_in_chromium "$(cat "$T/px.txt")"; fi
