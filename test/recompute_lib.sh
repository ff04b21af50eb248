# Shared by t_recompute_block.sh and t_recompute_selective.sh (source after
# ckpt_setup): their config Y and settings S (6 steps of 4 layers, a
# checkpoint at the end), the LLAMA and MOE shapes, and
# recompute_pair MODE NAME NP ARGS..., which trains
# the config with recompute none and with MODE (ARGS may set
# recompute_every), and the losses, gradient norms, validation losses and MoE
# figures printed, and the final checkpoint's parameters and optimizer
# state, must be the same bits. One line: recompute_MODE_NAME.
Y=$T/tiny.yaml
S="--set train.steps=6 --set checkpoint.every=6 --set checkpoint.async=false --set train.eval_every=3"
S="$S --set model.n_layer=4 --set batch.total_tokens=512"
LLAMA="--set model.arch=llama --set model.n_head=8 --set model.n_kv_head=4 --set model.n_embd=64 --set model.ffn_hidden=96"
MOE="$LLAMA --set model.mlp=moe --set model.moe.n_experts=4 --set model.moe.top_k=2 --set model.moe.expert_hidden=32"
MOE="$MOE --set model.moe.n_shared=1 --set model.moe.aux_loss_coef=0.01 --set model.moe.z_loss_coef=0.001"
figures() {
    grep -o '"step":[0-9]*,"tokens":[0-9]*,"loss":[^,]*\|"grad_norm":[^,]*\|"val_loss":[^,]*\|"moe_[a-z_]*":[^a-z]*' "$1"
}
MPI=0
command -v mpirun >/dev/null 2>&1 && ldd ./train | grep -q libmpi && MPI=1

recompute_pair() {
    local mode=$1 name=$2 np=$3
    shift 3
    local run=(./train) tag=recompute_${mode}_$name
    if [ "$np" -gt 1 ]; then
        if [ $MPI = 0 ]; then skip $tag "no MPI build or mpirun"; return; fi
        run=(timeout 300 mpirun --allow-run-as-root --oversubscribe -np "$np" ./train)
    fi
    "${run[@]}" $Y $S "$@" --set model.recompute=none --set model.recompute_every=1 --set run.dir=$T/${name}_none >$T/${name}_none.txt 2>&1
    local rc0=$?
    "${run[@]}" $Y $S "$@" --set model.recompute=$mode --set run.dir=$T/${name}_$mode >$T/${name}_$mode.txt 2>&1
    local rc1=$?
    local a=$T/${name}_none b=$T/${name}_$mode
    if [ $rc0 -eq 0 ] && [ $rc1 -eq 0 ] && [ -s $b/metrics.jsonl ] && [ "$(figures $a/metrics.jsonl)" = "$(figures $b/metrics.jsonl)" ] \
        && ./train ckpt-diff $a/checkpoints/step_00000006 $b/checkpoints/step_00000006 --quiet --tol 0 >$T/${name}_diff.txt 2>&1
    then ok $tag
    else fail $tag "rc $rc0/$rc1: $(grep -m1 -h error $a.txt $b.txt) $(diff <(figures $a/metrics.jsonl) <(figures $b/metrics.jsonl) | head -4 | tr '\n' ' ') $(head -c 200 $T/${name}_diff.txt)"
    fi
}
