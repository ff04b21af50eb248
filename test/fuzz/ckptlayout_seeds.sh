#!/usr/bin/env bash
# The seeds of fuzz_ckptlayout (test/fuzz/corpus/ckptlayout/): the model of
# fuzz_ckptlayout.c's `sets` trained for two steps on one rank and on two
# ranks under tp, pp, cp, ep and ZeRO-1 (mpirun, the CPU backend), each
# checkpoints folder packed as the target reads it (layout byte, how byte,
# then "\n@@@NAME\n" files) and loaded onto its own layout and others, plus
# hand-made damage: a mesh of degrees that do not match the rank files, a
# rank file the manifest lists but the folder lacks, a shape changed, a
# truncated rank file, an expert past the model's, a `latest` naming ../.
# Lion: its one moment keeps each seed under 50 KB. Needs ./train built with
# MPI.   bash test/fuzz/ckptlayout_seeds.sh
set -eu
cd "$(dirname "$0")/../.."
out=test/fuzz/corpus/ckptlayout
W=/tmp/kiln-ckptlayout-seeds # the data paths fuzz_ckptlayout's config names: a resume compares them
rm -rf $W && mkdir -p $W
trap 'rm -rf "$W"' EXIT
head -c 60000 data/austen.txt > $W/a.txt
./train prepare --tokenizer byte --out $W/data --val-fraction 0.1 $W/a.txt >/dev/null
cat > $W/base.yaml <<YAML
run: {name: cl, dir: $W/r, seed: 7, threads: 1}
model: {arch: llama, n_layer: 2, n_head: 2, n_kv_head: 2, n_embd: 8, seq_len: 8, vocab_size: 256,
        tie_embeddings: true, mlp: moe, moe: {n_experts: 2, top_k: 1, expert_hidden: 8}}
data: {train: "$W/data/train_*.bin", val: "$W/data/val_*.bin"}
batch: {micro_batch: 2, total_tokens: 64}
train: {steps: 2, eval_every: 0, eval_batches: 1, sample_every: 0}
optim: {name: lion}
schedule: {warmup_steps: 1}
checkpoint: {every: 2, keep_last: 0, async: false}
metrics: {peak_gflops: 1, tensorboard: false, log_every: 100}
YAML
MPI=(timeout 300 mpirun --allow-run-as-root --oversubscribe -np 2)
./train $W/base.yaml --set run.dir=$W/one >/dev/null
for l in tp pp cp ep; do "${MPI[@]}" ./train $W/base.yaml --set parallel.$l=2 --set run.dir=$W/$l >/dev/null; done
"${MPI[@]}" ./train $W/base.yaml --set parallel.zero=1 --set run.dir=$W/dp >/dev/null

# pack NAME LAYOUT HOW CHECKPOINTS_DIR: the folder's latest and step_00000002/ files
pack() {
    local f=$out/$1 c=$4
    printf '%b%s' "\\x$(printf %02x $2)" "$3" > $f
    for p in latest step_00000002/manifest $(cd $c && ls step_00000002/rank*.bin); do
        [ -f $c/$p ] || continue
        printf '\n@@@%s\n' $p >> $f
        cat $c/$p >> $f
    done
    [ $(stat -c %s $f) -lt 51200 ] || { echo "$f: over 50 KB" >&2; exit 1; }
}
rm -rf $out && mkdir -p $out
# layouts[] of fuzz_ckptlayout.c: 0 one rank, 1/2 tp ranks, 3/4 pp stages,
# 5/6 ep ranks, 7 cp rank 1, 8 tp+ep rank 1, 9 pp stage 1 + tp rank 1, 10 ZeRO-1 rank 1
pack one_as_one 0 r $W/one/checkpoints;   pack one_as_tp1 2 r $W/one/checkpoints
pack one_as_ep1 6 f $W/one/checkpoints;   pack one_init_pp1 4 i $W/one/checkpoints
pack tp_as_one 0 r $W/tp/checkpoints;     pack tp_as_tp1 2 r $W/tp/checkpoints
pack tp_as_pp1tp1 9 r $W/tp/checkpoints;  pack tp_init_ep0 5 i $W/tp/checkpoints
pack pp_as_pp1 4 r $W/pp/checkpoints;     pack pp_as_tp0 1 f $W/pp/checkpoints
pack pp_init_one 0 i $W/pp/checkpoints
pack ep_as_ep1 6 r $W/ep/checkpoints;     pack ep_as_one 0 r $W/ep/checkpoints
pack ep_as_tp1ep1 8 r $W/ep/checkpoints
pack cp_as_cp1 7 r $W/cp/checkpoints;     pack cp_as_ep0 5 r $W/cp/checkpoints
pack dp_as_zero1 10 r $W/dp/checkpoints;  pack dp_init_tp1 2 i $W/dp/checkpoints
# damage (the target reseals the manifest's own checksum line)
H=$W/hostile
edit() { rm -rf $H && cp -r $W/$1/checkpoints $H && sed -i -E "$2" $H/step_00000002/manifest; }
edit tp 's/^mesh .*/mesh world=2 dp=1 tp=3 pp=1 cp=1 ep=1/';                  pack hostile_tp_degree_3 2 r $H
edit ep 's/^mesh .*/mesh world=2 dp=1 tp=1 pp=1 cp=1 ep=4/';                  pack hostile_ep_degree_4 6 r $H
edit tp 's/^file rank00001.bin (.*)/file rank00002.bin \1/; s/file=rank00001.bin/file=rank00002.bin/'
pack hostile_rank_file_missing 0 r $H
edit pp '0,/shape=\[8,8\]/s/shape=\[8,8\]/shape=[8,16]/';                     pack hostile_shape_changed 0 r $H
edit tp 's/(self_attn.q_proj.weight .*) box=0:4,0:8/\1 box=0:4,0:9/';        pack hostile_box_past_shape 2 r $H
edit ep 's/experts\.1\./experts.3./g';                                        pack hostile_expert_past_model 6 r $H
edit cp 's/range=0:64 /range=0:65 /';                                          pack hostile_range_past_tensor 7 r $H
edit tp 's/ bytes=4096 stored=4096/ bytes=4096 stored=40960/';                 pack hostile_stored_past_file 1 r $H
rm -rf $H && cp -r $W/tp/checkpoints $H && truncate -s 9000 $H/step_00000002/rank00001.bin
pack hostile_rank_file_truncated 2 r $H
rm -rf $H && cp -r $W/pp/checkpoints $H && printf '../../../etc\n' > $H/latest
pack hostile_latest_dotdot 4 r $H
ls -la $out
