#!/usr/bin/env bash
# Every optimizer against its math in float64 (test/optim_ref.py, numpy):
# five steps of the tiny GPT-2 (and a tiny Llama for Muon: separate q, k, v)
# with clipping engaged and a warmup, kiln's own gradients replayed through
# the reference (KILN_TEST_OPTIM_DUMP), every parameter compared after every
# step. One line per optimizer, its figures after '#'.
# Tolerance 1e-6 absolute: kiln rounds each step to fp32 parameters of
# magnitude up to ~1 (norm gains), whose ulp is 1.2e-7, so a correct step is
# off by an ulp or two per step (measured: 1.3e-7 to 2.1e-7 over the five
# steps); a wrong formula, sign, bias correction or decay split moves
# elements by a whole update, 3e-4 (Lion) to 0.1 (Adafactor).
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_optim_ref
rm -rf "$T"
. test/ckpt_lib.sh
PY=/usr/bin/python3
if ! $PY -c "import numpy, yaml" 2>/dev/null; then skip optim_ref "no numpy or yaml for $PY (make deps)"; exit 0; fi
ckpt_setup
Y=$T/tiny.yaml
C="--set train.steps=5 --set checkpoint.every=0 --set train.eval_every=0 --set schedule.warmup_steps=2"
C="$C --set optim.grad_clip=0.5"
LLAMA="--set model.arch=llama --set model.n_head=4 --set model.n_kv_head=2 --set model.ffn_hidden=96"
# ref NAME OPTIM LR [--set ...]
ref() {
    local name=$1 opt=$2 lr=$3 D=$T/$1
    shift 3
    KILN_TEST_OPTIM_DUMP=$D/dump ./train $Y $C --set optim.name=$opt --set optim.lr=$lr "$@" --set run.dir=$D \
        >$D.txt 2>&1 || { fail optim_ref_$name "run: $(grep -m2 -i error $D.txt)"; return; }
    local out
    out=$($PY test/optim_ref.py $D $D/dump --tol 1e-6 2>&1) && ok "optim_ref_$name # $out" || fail optim_ref_$name "$out"
}
ref adamw adamw 1e-3
ref lion lion 1e-4
ref muon muon 0.02
ref muon_llama muon 0.02 $LLAMA
ref muon_match_adamw muon 1e-3 --set optim.muon_scale=match_adamw --set optim.muon_split_qkv=false
ref adafactor adafactor 0.01
ref adafactor_beta1 adafactor 0.01 --set optim.adafactor_beta1=0.9 --set optim.adafactor_clip=0.5
