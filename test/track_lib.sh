# For the tracking tests (t_mlflow.sh, t_prometheus.sh, t_straggler.sh,
# t_summary.sh, t_launcher_log.sh): a small run config, waiting for a step,
# and the venv with the tools' own readers. Source after test/lib.sh.

# track_config FILE NAME: a 2-layer model, 12 steps of 512 tokens (a multiple
# of 4 ranks' micro-batches), evaluations at 6 and 12, one thread a rank,
# checkpoints every 4 steps written synchronously (complete before step 5
# starts, so a kill -9 later always finds step 4's).
track_config() {
    cat > "$1" <<EOC
run: {name: $2, dir: "$T/$2", seed: 7, threads: 1}
model: {n_layer: 2, n_head: 2, n_embd: 32, seq_len: 32, vocab_size: 256}
data: {train: "$T/data/train_*.bin", val: "$T/data/val_*.bin"}
batch: {micro_batch: 4, total_tokens: 512}
train: {steps: 12, eval_every: 6, eval_batches: 4, sample_every: 0}
schedule: {warmup_steps: 2}
checkpoint: {every: 4, async: false}
metrics: {log_every: 1, peak_gflops: 50}
EOC
}

# wait_step FILE N: until FILE (a jsonl) holds N lines; 60 s at most.
wait_step() { for _ in $(seq 1200); do [ "$(cat "$1" 2>/dev/null | wc -l)" -ge "$2" ] && return 0; sleep 0.05; done; return 1; }

# MPIRUN: root in containers, more ranks than cores on a 2-core machine.
MPIRUN=(timeout 180 mpirun --allow-run-as-root --oversubscribe)
have_mpi() { command -v mpirun >/dev/null 2>&1 && ldd ./train | grep -q libmpi; }

# track_python NAME: set PY to the tools venv's python (test/lib.sh
# tools_python), or print "skip NAME" / "FAIL NAME" and return 1.
track_python() { tools_python "$1" || return 1; PY=$TOOLS_PY; }
