#!/usr/bin/env bash
# make bench: checkpoints against the disk, the data loader at 10,000 shards, then the GPT-2 124M shape on the CPU
# backend at context 64 and 256, a Llama and an MoE point of the same size at 256; each
# point prints whole-step GFLOP/s next to the sgemm rate measured in the same
# process; 2-rank data-, tensor-, context-parallel, pipeline and expert-parallel
# points come first (when MPI is built in).
# The last line is the context-64 point, the headline.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${BENCH_STEPS:-5}
# Checkpoints: write, verify and load against the disk's raw rates, 1 to 4
# ranks, and a resumed run's start-up (scripts/bench_ckpt.sh)
bash scripts/bench_ckpt.sh
# The planner's time model against measured steps of 1- and 2-rank layouts
# (scripts/bench_plan.sh; the ratios docs/planner.md records)
bash scripts/bench_plan.sh
# The data loader (test/bench_data.c): start-up time, memory and open files of
# a glob of 10,000 small shards (.bin and .bin.zst), and the wait for data per
# step with prefetch off and on when every batch must decompress shards.
if [ -x build/test/bench_data ]; then
    echo "== data loader: 10,000 shards x 2048 tokens; prefetch 0 and 4 on a 50 ms step =="
    build/test/bench_data 10000 2048 | sed 's/ under .*//'
fi
# Data parallelism: the same shape on 2 ranks (one thread each) through
# mpirun, real (byte-level) tokens: plain DP (25 MB gradient buckets
# all-reduced during the backward pass) and ZeRO-2 (each layer's gradients
# reduce-scattered during the backward, parameters all-gathered per layer
# after the optimizer step and waited for in the next forward). Reported: the
# fraction of step time each rank spends blocked in communication (the part
# not overlapped), and the run's wall time (the "done:" line: everything,
# including what happens between steps).
if command -v mpirun >/dev/null 2>&1 && ldd ./train | grep -q libmpi; then
    dir=$(mktemp -d)
    trap 'rm -rf "$dir"' EXIT
    head -c 400000 data/austen.txt > "$dir/corpus.txt"
    ./train prepare --tokenizer byte --out "$dir/data" "$dir/corpus.txt" >/dev/null
    for zero in 0 2; do
        echo "== GPT-2 124M shape, 2 ranks x 1 thread, data parallel, ZeRO $zero, global batch 2 x 4 x 64 =="
        mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 ./train configs/bench-cpu.yaml \
            --set data.tokenizer=byte --set "data.train=$dir/data/train_*.bin" --set 'data.val=""' \
            --set run.threads=1 --set batch.total_tokens=512 --set train.steps="$steps" --set train.sample_every=0 \
            --set train.eval_every=0 --set checkpoint.every=0 --set checkpoint.final=false \
            --set metrics.peak_gflops=1 --set metrics.log_every=1 --set parallel.zero=$zero \
            --set run.dir="$dir/run$zero" 2>&1 | grep -E '^step|^done|data parallel' | sed 's/ | MFU[^|]*//'
    done
    # Tensor parallelism: the same shape split over 2 ranks (tp 2, sequence
    # parallel), each rank computing half the heads, MLP width and vocabulary
    # on the same micro-batch, next to one rank with one thread on that batch.
    # Reported: step times, and the fraction of step time blocked in the tp
    # group's collectives (four all-gathers and four reduce-scatters of the
    # residual per layer, all on the critical path: nothing overlaps them here).
    TPS=(--set data.tokenizer=byte --set "data.train=$dir/data/train_*.bin" --set 'data.val=""' --set run.threads=1
         --set batch.total_tokens=256 --set train.steps="$steps" --set train.sample_every=0 --set train.eval_every=0
         --set checkpoint.every=0 --set checkpoint.final=false --set metrics.peak_gflops=1 --set metrics.log_every=1)
    echo "== GPT-2 124M shape, 1 rank x 1 thread, batch 4 x 64 (the tp point's reference) =="
    ./train configs/bench-cpu.yaml "${TPS[@]}" --set run.dir="$dir/tp1" 2>&1 | grep -E '^step|^done' \
        | sed 's/ | MFU[^|]*//'
    echo "== GPT-2 124M shape, 2 ranks x 1 thread, tensor parallel tp 2 (sequence parallel), batch 4 x 64 =="
    mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 ./train configs/bench-cpu.yaml "${TPS[@]}" \
        --set parallel.tp=2 --set run.dir="$dir/tp2" 2>&1 | grep -E '^step|^done|tensor parallel: [0-9.]*%' \
        | sed 's/ | MFU[^|]*//'
    # Context parallelism: a tiny Llama (configs/llama-tiny-32k.yaml's shape:
    # 2 layers, 2 heads over 1 kv head of 16, 32 wide) at 8,192 tokens, where
    # attention is nearly all the work; 2 ranks (cp 2, ring) each hold 2 of the
    # 4 chunks and pass K/V round the ring while computing the current block,
    # next to one rank with one thread on the whole sequence. Reported: step
    # times, and the fraction of step time blocked waiting for K/V and dK/dV
    # (the part of the ring's transfers not hidden behind attention).
    CPS=(--set "data.train=$dir/data/train_*.bin" --set 'data.val=""' --set run.threads=1 --set model.seq_len=8192
         --set batch.total_tokens=8192 --set train.steps="$steps" --set checkpoint.every=0 --set checkpoint.final=false
         --set metrics.peak_gflops=1 --set metrics.log_every=1 --set parallel.cp_attention=ring)
    echo "== tiny Llama, 1 rank x 1 thread, 1 x 8192 tokens (the cp point's reference) =="
    ./train configs/llama-tiny-32k.yaml "${CPS[@]}" --set parallel.cp=1 --set run.dir="$dir/cp1" 2>&1 \
        | grep -E '^step|^done' | sed 's/ | MFU[^|]*//'
    echo "== tiny Llama, 2 ranks x 1 thread, context parallel cp 2 (ring), 1 x 8192 tokens =="
    mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 ./train configs/llama-tiny-32k.yaml "${CPS[@]}" \
        --set parallel.cp=2 --set run.dir="$dir/cp2" 2>&1 | grep -E '^step|^done|context parallel: [0-9.]*%' \
        | sed 's/ | MFU[^|]*//'
    # Pipeline parallelism: the same shape cut into 2 stages (by cost: 9
    # layers, then 3 and the head) on 2 ranks x 1 thread, 8 micro-batches of
    # 1 x 64 a step, 1f1b and zb_h1, next to one rank with one thread running
    # the same 8 micro-batches. Reported: step times, the measured bubble
    # (time a stage waits for its neighbour over the step, mean of the
    # stages) beside the schedule's (unit costs: (p-1)/(m+p-1) of the step for
    # 1F1B, a third of its idle time for zb_h1).
    PPS=(--set data.tokenizer=byte --set "data.train=$dir/data/train_*.bin" --set 'data.val=""' --set run.threads=1
         --set batch.micro_batch=1 --set batch.total_tokens=512 --set train.steps="$steps" --set train.sample_every=0
         --set train.eval_every=0 --set checkpoint.every=0 --set checkpoint.final=false --set metrics.peak_gflops=1
         --set metrics.log_every=1)
    echo "== GPT-2 124M shape, 1 rank x 1 thread, 8 micro-batches of 1 x 64 (the pp point's reference) =="
    ./train configs/bench-cpu.yaml "${PPS[@]}" --set run.dir="$dir/pp1" 2>&1 | grep -E '^step|^done' \
        | sed 's/ | MFU[^|]*//'
    for sched in 1f1b zb_h1; do
        echo "== GPT-2 124M shape, 2 ranks x 1 thread, pipeline pp 2, $sched, 8 micro-batches of 1 x 64 =="
        mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 ./train configs/bench-cpu.yaml "${PPS[@]}" \
            --set parallel.pp=2 --set parallel.pp_schedule=$sched --set run.dir="$dir/pp2$sched" 2>&1 \
            | grep -E '^step|^done|^pipeline parallel' | sed 's/ | MFU[^|]*//'
    done
    # Expert parallelism: configs/moe-tiny.yaml's shape made wider (256
    # channels, 8 experts of width 512, top 2, one shared expert), a global
    # batch of 2 micro-batches of 8 x 128: one rank with one thread runs both;
    # 2 ranks with ep 2 run one each, every rank holding 4 of the 8 experts
    # and sending the rows for the other 4 by all-to-all. Reported: step
    # times, and the fraction of step time blocked in the ep group's
    # all-to-alls (the rows and their counts, forward and backward; it
    # includes waiting for the rank whose experts got more rows).
    EPS=(--set data.tokenizer=byte --set "data.train=$dir/data/train_*.bin" --set 'data.val=""' --set run.threads=1
         --set model.n_embd=256 --set model.moe.expert_hidden=512 --set batch.micro_batch=8
         --set batch.total_tokens=2048 --set train.steps="$steps" --set train.sample_every=0 --set train.eval_every=0
         --set checkpoint.every=0 --set checkpoint.final=false --set metrics.peak_gflops=1 --set metrics.log_every=1)
    echo "== MoE (moe-tiny, 256 wide, 8 experts x 512), 1 rank x 1 thread, 2 micro-batches of 8 x 128 (the ep point's reference) =="
    ./train configs/moe-tiny.yaml "${EPS[@]}" --set run.dir="$dir/ep1" 2>&1 | grep -E '^step|^done' \
        | sed 's/ | MFU[^|]*//; s/ | moe .*//'
    echo "== the same MoE, 2 ranks x 1 thread, expert parallel ep 2 (4 experts per rank), 1 micro-batch each =="
    mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 ./train configs/moe-tiny.yaml "${EPS[@]}" \
        --set parallel.ep=2 --set run.dir="$dir/ep2" 2>&1 | grep -E '^step|^done|expert parallel: [0-9.]*%' \
        | sed 's/ | MFU[^|]*//; s/ | moe .*//'
    # what the flight recorder and monitor.check_collectives cost per step (docs/parallel.md)
    bash scripts/bench_flight.sh 2 1000 5
else
    echo "== data-, tensor-, context-parallel, pipeline and expert-parallel points skipped: mpirun or an MPI build of ./train not found =="
fi
# Llama at about GPT-2 124M's size (12 x 768, GQA 12 heads / 4 kv heads,
# SwiGLU 2048, RoPE, untied head) and an MoE of the same trunk (8 experts of
# width 1024, top 2, one shared expert): their ratios sit next to GPT-2's.
echo "== Llama ~125M shape (12 x 768, 12/4 heads, SwiGLU 2048), micro-batch 4, context 256 =="
./train bench configs/bench-cpu.yaml --steps "$steps" --set model.arch=llama --set model.n_kv_head=4 \
    --set model.seq_len=256 --set batch.total_tokens=1024
echo "== MoE on that trunk (8 experts x 1024 wide, top 2, 1 shared), micro-batch 4, context 256 =="
./train bench configs/bench-cpu.yaml --steps "$steps" --set model.arch=llama --set model.n_kv_head=4 \
    --set model.mlp=moe --set model.moe.n_experts=8 --set model.moe.top_k=2 --set model.moe.n_shared=1 \
    --set model.moe.expert_hidden=1024 --set model.seq_len=256 --set batch.total_tokens=1024
echo "== GPT-2 124M shape, micro-batch 4, context 256 =="
./train bench configs/bench-cpu.yaml --steps "$steps" --set model.seq_len=256 --set batch.total_tokens=1024
echo "== GPT-2 124M shape, micro-batch 4, context 64 =="
./train bench configs/bench-cpu.yaml --steps "$steps"
