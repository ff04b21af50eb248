#!/usr/bin/env bash
# make bench: GPT-2 124M shape on the CPU backend at context 64 and 256; each
# point prints whole-step GFLOP/s next to the sgemm rate measured in the same
# process. The last line is the context-64 point, the headline.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${BENCH_STEPS:-5}
echo "== GPT-2 124M shape, micro-batch 4, context 256 =="
./train bench configs/bench-cpu.yaml --steps "$steps" --set model.seq_len=256 --set batch.total_tokens=1024
echo "== GPT-2 124M shape, micro-batch 4, context 64 =="
./train bench configs/bench-cpu.yaml --steps "$steps"
