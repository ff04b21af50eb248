#!/usr/bin/env bash
# The seeds of fuzz_mlflow (test/fuzz/corpus/mlflow/): real MLflow stores that
# ./train (metrics.mlflow, experiment kiln-fuzz, a tiny model) left behind --
# a run killed with kill -9 after step 6 (checkpoint at 4: its metric files
# hold steps 5 and 6, which a resume from 4 cuts), the same run resumed to
# the end, and a second run beside it -- each packed as the target reads it
# (the HOW byte, then "\n@@@NAME\n" files under store/ and run/; the store's
# path in mlflow.json as @STORE@), plus hand-made damage: run and experiment
# ids in mlflow.json or a meta.yaml that lead out of the store (../, an
# absolute path, a newline), a truncated or empty meta.yaml, metric lines
# with a huge step, NaN or no newline, a metrics file that is a directory, a
# FIFO or a link out of the store, experiment and run directories that are
# links. params/ and artifacts/ are left out of the packs (kiln only writes
# them), which keeps each seed under 8 KB.   bash test/fuzz/mlflow_seeds.sh
set -eu
cd "$(dirname "$0")/../.."
out=test/fuzz/corpus/mlflow
W=$(mktemp -d /tmp/kiln-mlflow-seeds.XXXXXX)
trap 'rm -rf "$W"' EXIT
head -c 60000 data/austen.txt > $W/a.txt
./train prepare --tokenizer byte --out $W/data --val-fraction 0.1 $W/a.txt >/dev/null
cat > $W/a.yaml <<YAML
run: {name: a, dir: $W/a, seed: 7, threads: 1}
model: {n_layer: 1, n_head: 2, n_embd: 16, seq_len: 16, vocab_size: 256}
data: {train: "$W/data/train_*.bin", val: "$W/data/val_*.bin"}
batch: {micro_batch: 2, total_tokens: 64}
train: {steps: 8, eval_every: 4, eval_batches: 1, sample_every: 0}
schedule: {warmup_steps: 1}
checkpoint: {every: 4, async: false}
metrics: {log_every: 1, peak_gflops: 1, tensorboard: false, mlflow: $W/store, mlflow_experiment: kiln-fuzz}
YAML
# wait_step FILE N: until FILE holds N lines (60 s at most)
wait_step() { for _ in $(seq 1200); do [ "$(cat "$1" 2>/dev/null | wc -l)" -ge "$2" ] && return 0; sleep 0.05; done; return 1; }

# pack NAME HOW STORE RUN_DIR: the store's meta.yaml, metrics and tags files, and RUN_DIR/mlflow.json
pack() {
    local f=$out/$1 s=$3 r=$4
    printf '%s' "$2" > $f
    for p in $(cd $s && find . -name meta.yaml -o -path '*/metrics/*' -type f -o -path '*/tags/mlflow.runName' | sed 's|^\./||' | sort); do
        printf '\n@@@store/%s\n' $p >> $f
        sed "s|$W/store|@STORE@|g" $s/$p >> $f
    done
    if [ -f $r/mlflow.json ]; then
        printf '\n@@@run/mlflow.json\n' >> $f
        sed "s|$W/store|@STORE@|g" $r/mlflow.json >> $f
    fi
    [ $(stat -c %s $f) -lt 8192 ] || { echo "$f: over 8 KB" >&2; exit 1; }
}
# add NAME LINE...: append files (already "\n@@@NAME\nBYTES" text) to a copy of seed base
add() { local f=$out/$1 b=$out/$2; shift 2; [ $f = $b ] || cp $b $f; for l in "$@"; do printf '%b' "$l" >> $f; done; }
# edit NAME BASE SED: a copy of seed BASE through sed -E
edit() { sed -E "$3" $out/$2 > $out/$1; }
# drop NAME BASE REGEX: a copy of seed BASE without the files whose names match REGEX (a
# link or FIFO of that name can then be made: fuzz_unpack keeps a name's first kind)
drop() { python3 -c 'import re,sys; t=open(sys.argv[1],"rb").read().split(b"\n@@@"); open(sys.argv[2],"wb").write(b"\n@@@".join(x for i, x in enumerate(t) if i == 0 or not re.search(sys.argv[3].encode(), x.split(b"\n")[0])))' $out/$2 $out/$1 "$3"; }

rm -rf $out && mkdir -p $out
KILN_TEST_PAUSE_AT_STEP=6 ./train $W/a.yaml >$W/a1.txt 2>&1 &
pid=$!
wait_step $W/a/metrics.jsonl 6
kill -9 $pid 2>/dev/null || true
wait $pid 2>/dev/null || true
rm -rf $W/killed && mkdir $W/killed && cp -r $W/store $W/a $W/killed/
pack killed_resume_4 r $W/killed/store $W/killed/a
pack killed_fresh f $W/killed/store $W/killed/a
pack killed_resume_2 "$(printf '\x02')" $W/killed/store $W/killed/a
./train $W/a.yaml --resume auto >$W/a2.txt 2>&1
./train $W/a.yaml --set run.name=b --set run.dir=$W/b >$W/b.txt 2>&1
pack finished_two_runs_resume r $W/store $W/a
pack finished_two_runs_fresh f $W/store $W/b

# damage: ids out of the store (run and experiment ids of the killed seed)
K=$out/killed_resume_4
exp=$(sed -n 's/.*"experiment_id":"\([^"]*\)".*/\1/p' $W/killed/a/mlflow.json)
run=$(sed -n 's/.*"run_id":"\([^"]*\)".*/\1/p' $W/killed/a/mlflow.json)
edit hostile_run_id_dotdot killed_resume_4 "s|\"run_id\":\"$run\"|\"run_id\":\"../../out\"|"
add hostile_run_id_dotdot hostile_run_id_dotdot '\n@@@out/meta.yaml\nstart_time: 1\nstatus: 1\n'
edit hostile_exp_id_dotdot killed_resume_4 "s|\"experiment_id\":\"$exp\"|\"experiment_id\":\"..\"|"
add hostile_exp_id_dotdot hostile_exp_id_dotdot "\n@@@$run/meta.yaml\nstart_time: 1\n"
edit hostile_run_id_slash killed_resume_4 "s|\"run_id\":\"$run\"|\"run_id\":\"$run/../../../../out\"|"
edit hostile_run_id_absolute killed_resume_4 "s|\"run_id\":\"$run\"|\"run_id\":\"/etc/kiln-fuzz\"|"
edit hostile_run_id_newline killed_resume_4 "s|\"run_id\":\"$run\"|\"run_id\":\"$run\\n\"|"
printf '\n@@@store/%s/%s%s/meta.yaml\nstart_time: 5\n' $exp $run x >> $out/hostile_run_id_newline
edit hostile_exp_id_empty killed_resume_4 "s|\"experiment_id\":\"$exp\"|\"experiment_id\":\"\"|"
edit hostile_store_other killed_resume_4 "s|\"store\":\"@STORE@\"|\"store\":\"/tmp\"|"
# meta.yaml damage
edit hostile_meta_truncated killed_resume_4 '/^@@@store\/[0-9]+\/[0-9a-f]+\/meta.yaml/,/^start_time/{/^(start_time|status|tags|user_id)/d}'
edit hostile_meta_start_huge killed_resume_4 's/^start_time: .*/start_time: 999999999999999999999999/'
edit hostile_meta_start_quoted killed_resume_4 "s/^start_time: .*/start_time: '/"
edit hostile_exp_meta_name_dotdot killed_fresh "s/^name: .*/name: '..\/..\/out'/"
# metric lines: a huge step, NaN, inf, no newline, garbage, a step past int
edit hostile_metric_lines killed_resume_4 '/^@@@store\/.*\/metrics\/loss$/a 1 nan 3\n1 inf 4\n1 1e999 99999999999999999999\n-1 1 -2147483649\nx y z\n1 2 2147483647'
printf '\n@@@store/%s/%s/metrics/lr\n1765000000000 0.001 3' $exp $run >> $out/hostile_metric_lines
# a metrics file that is a directory, a FIFO, a link out of the store (to out/f and to out/)
drop hostile_metric_dir killed_resume_4 'metrics/val_loss$'
add hostile_metric_dir hostile_metric_dir "\n@@@store/$exp/$run/metrics/val_loss/x/\n"
drop hostile_metric_fifo killed_resume_4 'metrics/lr$'
add hostile_metric_fifo hostile_metric_fifo "\n@@@store/$exp/$run/metrics/lr|\n"
add hostile_metric_fifo_other killed_resume_4 "\n@@@store/$exp/$run/metrics/zzz|\n"
drop hostile_metric_link killed_resume_4 'metrics/loss$'
add hostile_metric_link hostile_metric_link "\n@@@store/$exp/$run/metrics/loss.lnk\nf" "\n@@@out/f\nkeep\n"
drop hostile_metric_link_dangling killed_resume_4 'metrics/lr$'
add hostile_metric_link_dangling hostile_metric_link_dangling "\n@@@store/$exp/$run/metrics/lr.lnk\nf" "\n@@@out/x\n"
# directories of the run and the experiment that are links out of the store
for d in tags metrics artifacts params; do
    drop hostile_${d}_dir_link killed_resume_4 "/$d/"
    add hostile_${d}_dir_link hostile_${d}_dir_link "\n@@@store/$exp/$run/$d.lnk\nd" "\n@@@out/x\n"
done
sed -E "s|@@@store/$exp/|@@@out/|" $K > $out/hostile_exp_dir_link
printf '\n@@@store/%s.lnk\nd' $exp >> $out/hostile_exp_dir_link
sed -E "s|@@@store/$exp/$run/|@@@out/|" $K > $out/hostile_run_dir_link
printf '\n@@@store/%s/%s.lnk\nd' $exp $run >> $out/hostile_run_dir_link
# the experiment's directory a link, a fresh run (found by its meta.yaml's name)
sed -E "s|@@@store/$exp/|@@@out/|" $out/killed_fresh > $out/hostile_exp_dir_link_fresh
printf '\n@@@store/%s.lnk\nd' $exp >> $out/hostile_exp_dir_link_fresh
# no store at all (a fresh one: the Default experiment), a store that is a file
printf 'f' > $out/empty_fresh
printf 'r\n@@@run/mlflow.json\n{"store":"@STORE@","experiment_id":"0","run_id":"00"}\n' > $out/no_store_resume
printf 'f\n@@@store\nnot a directory\n' > $out/hostile_store_file
ls -la $out
du -sb $out
