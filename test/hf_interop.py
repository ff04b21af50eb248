"""test/t_hf_interop.sh's HF side, for one trained kiln run:
  python hf_interop.py NAME RUN_CONFIG CKPT EXPORT_FP32 EXPORT_BF16 WORKDIR
Prints one ok/FAIL line per check:
  hf_NAME_logits       HF (AutoModelForCausalLM, fp32) on the exported model
                       vs kiln's forward of the checkpoint (build/test/hf_tool)
  hf_NAME_bf16_logits  the bf16 export, widened, vs kiln's fp32 logits
  hf_NAME_kiln_rt      kiln -> HF -> kiln: every parameter bit-identical
  hf_NAME_import       a random HF model (save_pretrained) loaded by kiln
                       through init.from: kiln's logits vs HF's
  hf_NAME_hf_rt        HF -> kiln -> HF: every tensor bit-identical
  hf_NAME_greedy       20 tokens of greedy decoding: HF's (its forward and the
                       argmax of the last row, as generate(do_sample=False)) and
                       kiln's give the same ids (a step whose best two logits
                       are within 1e-4 x max(1, |logit|) on kiln's side is a
                       near tie either side may take: the comparison stops
                       there, and the line says so)
  hf_NAME_sharded      the export written in shards (--max-shard-size), read
                       by HF (same logits as the single file) and by kiln
                       (bit-identical parameters); a random HF model saved in
                       shards loads into kiln with HF's logits
Tolerances: fp32 on both sides, differing only in summation order and
library GeLU/exp/rsqrt: errors of order 1e-6 relative per op, a few 1e-6
after two layers of width 64; 1e-4 x max(1, max|logit|) leaves room and
still fails any wrong mapping (a transposed or swapped tensor moves logits by
O(1)). bf16 weights carry a relative error of 2^-9 each: 5e-2 x max|logit|."""
import subprocess
import sys

import numpy as np
import torch
from safetensors.numpy import load_file
from transformers import AutoConfig, AutoModelForCausalLM

name, cfg, ckpt, exp32, exp16, work, sharded = sys.argv[1:8]
TOOL = "build/test/hf_tool"
torch.manual_seed(0)


def report(ok, check, why):
    print(f"ok {check}" + (f" ({why})" if why else "") if ok else f"FAIL {check}: {why}", flush=True)


def kiln_logits(init_from, tokens):
    out = f"{work}/{name}_logits.bin"
    subprocess.run([TOOL, cfg, init_from, "--logits", out] + [str(t) for t in tokens], check=True)
    return np.fromfile(out, dtype=np.float32).reshape(len(tokens), -1)


def hf_logits(path, tokens, dtype=torch.float32):
    m = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype).float().eval()
    with torch.no_grad():
        return m(torch.tensor([tokens])).logits[0].numpy()


def compare(a, b, rel):
    if a.shape != b.shape:
        return False, f"shapes {a.shape} vs {b.shape}"
    err, scale = float(np.abs(a - b).max()), max(1.0, float(np.abs(a).max()))
    return err <= rel * scale, f"max |diff| {err:.3g}, tolerance {rel * scale:.3g}"


def same_tensors(a, b):
    x, y = load_file(a), load_file(b)
    if x.keys() != y.keys():
        return False, f"names differ: {sorted(set(x) ^ set(y))[:4]}"
    for k in x:
        if x[k].shape != y[k].shape or x[k].tobytes() != y[k].tobytes():
            return False, f"tensor {k} differs"
    return True, ""


vocab = AutoConfig.from_pretrained(exp32).vocab_size
tokens = [int(t) for t in torch.randint(0, vocab, (24,))]

k = kiln_logits(ckpt, tokens)
ok, why = compare(k, hf_logits(exp32, tokens), 1e-4)
report(ok, f"hf_{name}_logits", why)
ok, why = compare(k, hf_logits(exp16, tokens, torch.bfloat16), 5e-2)
report(ok, f"hf_{name}_bf16_logits", why)

subprocess.run([TOOL, cfg, ckpt, "--dump", f"{work}/{name}_p1.safetensors"], check=True)
subprocess.run([TOOL, cfg, exp32, "--dump", f"{work}/{name}_p2.safetensors"], check=True)
ok, why = same_tensors(f"{work}/{name}_p1.safetensors", f"{work}/{name}_p2.safetensors")
report(ok, f"hf_{name}_kiln_rt", why)

# A random HF model of the same configuration, saved the HF way.
hf_dir = f"{work}/{name}_hf_random"
config = AutoConfig.from_pretrained(exp32)
model = AutoModelForCausalLM.from_config(config).float().eval()
with torch.no_grad():  # HF zero-inits biases and sets norm gains to 1: move them so the mapping is seen
    for n_, p in model.named_parameters():
        if p.dim() == 1:
            p.add_(0.1 * torch.randn_like(p))
model.save_pretrained(hf_dir, safe_serialization=True)
ok, why = compare(kiln_logits(hf_dir, tokens), hf_logits(hf_dir, tokens), 1e-4)
report(ok, f"hf_{name}_import", why)
subprocess.run([TOOL, cfg, hf_dir, "--export", f"{work}/{name}_hf_again"], check=True)
ok, why = same_tensors(f"{hf_dir}/model.safetensors", f"{work}/{name}_hf_again/model.safetensors")
report(ok, f"hf_{name}_hf_rt", why)


# Greedy decoding: 20 new tokens after 4.
prompt = tokens[:4]
out = f"{work}/{name}_greedy.txt"
subprocess.run([TOOL, cfg, ckpt, "--greedy", out, "20"] + [str(t) for t in prompt], check=True)
kiln_ids, gaps = [], []
for line in open(out):
    i, g = line.split()
    kiln_ids.append(int(i)), gaps.append(float(g))
# HF's side: its forward over the whole sequence each step and the argmax of
# the last row, which is what generate(do_sample=False) computes (generate
# itself imports torch.distributed.fsdp, which Debian's torch 1.13 cannot
# import under Python 3.11)
m = AutoModelForCausalLM.from_pretrained(exp32, torch_dtype=torch.float32).float().eval()
seq = list(prompt)
with torch.no_grad():
    for _ in range(20):
        seq.append(int(m(torch.tensor([seq])).logits[0, -1].argmax()))
hf_ids = seq[len(prompt):]
same, why = True, "20 of 20 the same"
for step, (a, b) in enumerate(zip(kiln_ids, hf_ids)):
    if a != b:
        k = kiln_logits(ckpt, prompt + kiln_ids[:step])[-1]
        near = gaps[step] <= 1e-4 * max(1.0, float(np.abs(k).max()))
        same, why = near, (f"the same up to step {step}, a near tie there (best two {gaps[step]:.2g} apart)" if near
                           else f"step {step}: kiln {a}, HF {b}, kiln's best two logits {gaps[step]:.3g} apart")
        break
report(same and len(hf_ids) == 20, f"hf_{name}_greedy", why)

# Sharded: the export in several files, read by HF and by kiln.
ok, why = compare(hf_logits(exp32, tokens), hf_logits(sharded, tokens), 0.0)
import json, os
idx = json.load(open(f"{sharded}/model.safetensors.index.json"))
files = sorted(set(idx["weight_map"].values()))
subprocess.run([TOOL, cfg, sharded, "--dump", f"{work}/{name}_p3.safetensors"], check=True)
ok2, why2 = same_tensors(f"{work}/{name}_p1.safetensors", f"{work}/{name}_p3.safetensors")
hf_sh = f"{work}/{name}_hf_random_sharded"
model.save_pretrained(hf_sh, safe_serialization=True, max_shard_size="30KB")
ok3, why3 = compare(kiln_logits(hf_sh, tokens), hf_logits(hf_sh, tokens), 1e-4)
nsh = len(set(json.load(open(f"{hf_sh}/model.safetensors.index.json"))["weight_map"].values()))
report(ok and ok2 and ok3 and len(files) > 1 and nsh > 1, f"hf_{name}_sharded",
       f"{len(files)} kiln shards: {why}; {why2 or 'parameters bit-identical'}; {nsh} HF shards: {why3}")
