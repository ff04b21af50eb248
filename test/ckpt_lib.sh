# Shared by test/t_resume.sh, t_ckpt_corrupt.sh, t_ckpt_kill.sh: a tiny corpus,
# a tiny model (2 layers, 32 wide, context 32: ~10 ms a step on 2 cores), and
# helpers. Source it after setting T (the test's scratch directory).
. test/lib.sh
# step, tokens and loss of every metrics.jsonl line (timings differ run to run)
losses() { grep -o '"step":[0-9]*,"tokens":[0-9]*,"loss":[^,]*' "$1"; }
# close_losses A B: the same steps and tokens in two metrics.jsonl files, every
# loss within relative 1e-5 (several ranks vs one: test/t_dp.sh says why);
# prints the first difference and fails
close_losses() {
    python3 - "$1" "$2" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
if [x["step"] for x in a] != [x["step"] for x in b] or not a:
    print("steps differ: %d vs %d lines" % (len(a), len(b))); sys.exit(1)
for x, y in zip(a, b):
    if x["tokens"] != y["tokens"] or abs(x["loss"] - y["loss"]) > 1e-5 * abs(x["loss"]):
        print("step %d: loss %r vs %r, tokens %d vs %d" % (x["step"], x["loss"], y["loss"], x["tokens"], y["tokens"]))
        sys.exit(1)
PY
}
# route_flip A B: MoE runs (metrics.jsonl A, B) whose expert loads first
# differ at some step by exactly one token moved between two experts of one
# layer print that step; else nothing. That is a near tie in the router's
# top-k, decided the other way by the summation order of another layout (seen
# on an AVX-512 machine: one of 1,024 routing decisions at step 20 of 20),
# not a layout bug, which moves many tokens or breaks the losses first.
route_flip() {
    python3 - "$1" "$2" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
for x, y in zip(a, b):
    la, lb = x.get("moe_load"), y.get("moe_load")
    if la == lb:
        continue
    d = [q - p for ra, rb in zip(la or [], lb or []) for p, q in zip(ra, rb)]
    moved = [r for r, (ra, rb) in enumerate(zip(la or [], lb or [])) if ra != rb]
    if len(la or []) == len(lb or []) and len(moved) == 1 and sorted(v for v in d if v) == [-1, 1]:
        print(x["step"])
    break
PY
}
# the parameter checksum and whole-state checksum of a checkpoint
sums() { ./train ckpt-info "$1" 2>/dev/null | grep '^params checksum'; }
ckpt_setup() {
    mkdir -p "$T"
    if [ ! -f "$T/data/train_000000.bin" ]; then
        small_corpus "$T/data"
    fi
    # metrics.peak_gflops skips the start-up matmul measurement: these runs
    # restart often. One thread: on a loaded 2-core machine OpenMP barriers
    # spin against other jobs and a step takes 10x longer.
    cat > "$T/tiny.yaml" <<YAML
run: {name: ck, dir: "$T/run", seed: 7, threads: 1}
model: {n_layer: 2, n_head: 2, n_embd: 32, seq_len: 32, vocab_size: 256}
data: {train: "$T/data/train_*.bin", val: "$T/data/val_*.bin"}
batch: {micro_batch: 4, total_tokens: 256}
train: {steps: 20, eval_every: 10, eval_batches: 2, sample_every: 0}
schedule: {warmup_steps: 2}
checkpoint: {every: 5, keep_last: 0}
metrics: {peak_gflops: 1, tensorboard: false, log_every: 100}
YAML
}

# dry_matches DRY_TXT RUN_MIB: --dry-run's activations line (its first
# "  activations" figure, in its unit) is the start-up line's RUN_MIB, both
# printed to 2 decimals (0.005 MiB) and within 1% (the dry-run's unit
# rounds a GiB figure to 10 MiB)
dry_matches() {
    python3 - "$(grep -E '^  activations ' "$1" | head -1 | awk '{print $(NF-1), $NF}')" "$2" <<'PY'
import sys
v, unit = sys.argv[1].split()
kib = float(v) * {"KiB": 1, "MiB": 1024, "GiB": 1024 * 1024}[unit]
sys.exit(0 if abs(kib - float(sys.argv[2]) * 1024) <= 0.005 * 1024 + 0.01 * kib else 1)
PY
}
