#!/usr/bin/env bash
# make bench's checkpoint points (docs/benchmarks.md, "Checkpoints"): the
# GPT-2 124M and 1.5B shapes' fp32 state (parameters, AdamW m and v; random,
# no training) written, verified and loaded next to a raw sequential write and
# read of the same size in the same folder, in the same run, as ratios; the
# 124M shape on 2 and 4 ranks (mpirun: each rank its share, aggregate rates);
# and a resumed 124M-shaped run's time from process start to its first step,
# its checkpoint out of the page cache.
#   BENCH_CKPT_DIR  the folder measured (default: a new one under $TMPDIR or /tmp)
#   BENCH_CKPT_BIG  0 skips the 1.5B point (18.7 GB on disk, twice)
set -euo pipefail
cd "$(dirname "$0")/.."
base=${BENCH_CKPT_DIR:-${TMPDIR:-/tmp}}
dir=$(mktemp -d "$base/kiln_bench_ckpt.XXXXXX")
trap 'rm -rf "$dir"' EXIT
reps=${BENCH_CKPT_REPS:-5}
echo "== checkpoints: GPT-2 124M shape, one rank, $reps reps in $dir =="
./train bench configs/gpt2-124m.yaml --checkpoint --dir "$dir/b" --reps "$reps"
big=(--set model.n_layer=48 --set model.n_head=25 --set model.n_embd=1600)
free_gb=$(df -Pk "$dir" | awk 'NR == 2 {print int($4 / 1e6)}')
if [ "${BENCH_CKPT_BIG:-1}" != 0 ] && [ "$free_gb" -ge 45 ]; then
    echo "== checkpoints: GPT-2 1.5B shape (48 x 1600), one rank, 1 rep =="
    ./train bench configs/gpt2-124m.yaml "${big[@]}" --checkpoint --dir "$dir/b" --reps 1
else
    echo "== checkpoints: GPT-2 1.5B shape skipped (BENCH_CKPT_BIG=0, or $free_gb GB free of the 45 needed) =="
fi
if command -v mpirun >/dev/null 2>&1 && ldd ./train | grep -q libmpi; then
    for np in 2 4; do
        echo "== checkpoints: GPT-2 124M shape, $np ranks (each its share; aggregate rates) =="
        mpirun --allow-run-as-root --oversubscribe --bind-to none -np $np ./train bench configs/gpt2-124m.yaml \
            --set run.threads=1 --checkpoint --dir "$dir/b" --reps 3 | grep -v '^bench checkpoint rep'
    done
else
    echo "== checkpoints on several ranks skipped: mpirun or an MPI build of ./train not found =="
fi
# A resumed run: one step of the GPT-2 124M shape (context 64) with a sync
# checkpoint, the checkpoint's pages dropped (posix_fadvise DONTNEED: clean
# pages, this run's files only), then --resume auto to step 2.
head -c 400000 data/austen.txt > "$dir/corpus.txt"
./train prepare --tokenizer byte --out "$dir/data" "$dir/corpus.txt" >/dev/null
R=(--set data.tokenizer=byte --set "data.train=$dir/data/train_*.bin" --set 'data.val=""' --set train.sample_every=0
   --set train.eval_every=0 --set metrics.peak_gflops=1 --set checkpoint.async=false --set run.dir="$dir/run")
./train configs/bench-cpu.yaml "${R[@]}" --set train.steps=1 --set checkpoint.every=1 >/dev/null 2>&1
python3 - "$dir/run/checkpoints" <<'PY'
import os, sys
for root, _, files in os.walk(sys.argv[1]):
    for f in files:
        fd = os.open(os.path.join(root, f), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
PY
echo "== checkpoints: a resumed GPT-2 124M-shaped run (CPU backend), its checkpoint out of the page cache =="
./train configs/bench-cpu.yaml "${R[@]}" --set train.steps=2 --set checkpoint.every=0 --resume auto 2>&1 \
    | grep -E '^resume: [0-9.]+ s'
grep -o '"resume_s":[0-9.]*' "$dir/run/metrics.jsonl"
