#!/usr/bin/env python3
"""gen_gpt2_ref.py: writes test/ref/gpt2_ref.bin, the float64 reference that
test/test_model_ref.c holds kiln's fp32 GPT-2 to. The model, the loss and the
AdamW steps are written out by hand here (no torch.nn, no torch.optim) so the
fixture is an independent account of what kiln must compute, not a copy of it.

Run with Debian's torch 1.13 (CPU):  /usr/bin/python3 test/ref/gen_gpt2_ref.py
Format and tolerances: test/ref/README.md."""
import math
import os
import struct
import sys

import torch

torch.set_default_dtype(torch.float64)

N_LAYER, N_HEAD, N_EMBD, SEQ_LEN = 2, 4, 32, 16
VOCAB, PADDED_VOCAB = 61, 64  # odd V on purpose: padding must not leak into the loss
B, T = 3, 16
N_STEPS = 6
LR, BETA1, BETA2, EPS, WD, CLIP = 1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0
SEED = 1337


def param_table():
    """(name, shape) in the listing order of src/model.h."""
    C, Vp = N_EMBD, PADDED_VOCAB
    t = [("wte", (Vp, C)), ("wpe", (SEQ_LEN, C))]
    for i in range(N_LAYER):
        h = "h.%d." % i
        t += [(h + "ln_1.weight", (C,)), (h + "ln_1.bias", (C,)),
              (h + "attn.c_attn.weight", (3 * C, C)), (h + "attn.c_attn.bias", (3 * C,)),
              (h + "attn.c_proj.weight", (C, C)), (h + "attn.c_proj.bias", (C,)),
              (h + "ln_2.weight", (C,)), (h + "ln_2.bias", (C,)),
              (h + "mlp.c_fc.weight", (4 * C, C)), (h + "mlp.c_fc.bias", (4 * C,)),
              (h + "mlp.c_proj.weight", (C, 4 * C)), (h + "mlp.c_proj.bias", (C,))]
    t += [("ln_f.weight", (C,)), ("ln_f.bias", (C,))]
    return t


def init_params(gen):
    """Non-trivial init so that a swapped gain/bias or a dropped bias shows:
    LayerNorm gains 1 + N(0, 0.1), every bias N(0, 0.02), weights and
    embeddings N(0, 0.02), padded rows of wte zero. Values are rounded to
    float32 (what the fixture stores) and then used as float64, so both sides
    start from bit-identical parameters."""
    params = {}
    for name, shape in param_table():
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
            x = 1.0 + 0.1 * x
        else:
            x = 0.02 * x
        if name == "wte":
            x[VOCAB:] = 0.0
        params[name] = x.to(torch.float32).to(torch.float64)
    return params


def layernorm(x, w, b):
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)  # biased, as GPT-2
    return (x - mean) / torch.sqrt(var + 1e-5) * w + b


def linear(x, w, b):
    return x @ w.t() + b  # w is (OC, C)


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def attention(qkv):
    """qkv (B,T,3C) = [q | k | v]; head h owns columns h*hs..(h+1)*hs of each."""
    Bb, Tt, C3 = qkv.shape
    C = C3 // 3
    hs = C // N_HEAD
    q, k, v = qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:]
    q = q.reshape(Bb, Tt, N_HEAD, hs).transpose(1, 2)  # (B,NH,T,hs)
    k = k.reshape(Bb, Tt, N_HEAD, hs).transpose(1, 2)
    v = v.reshape(Bb, Tt, N_HEAD, hs).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hs)  # (B,NH,T,T)
    causal = torch.ones(Tt, Tt, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    att = torch.softmax(scores, dim=-1)
    y = att @ v  # (B,NH,T,hs)
    return y.transpose(1, 2).reshape(Bb, Tt, C)


def forward(p, tokens, targets):
    """Returns logits (B,T,Vp) over every padded row and the mean loss over
    B*T, whose softmax runs over the first V columns only."""
    x = p["wte"][tokens] + p["wpe"][:T].unsqueeze(0)
    for i in range(N_LAYER):
        h = "h.%d." % i
        a = layernorm(x, p[h + "ln_1.weight"], p[h + "ln_1.bias"])
        a = linear(a, p[h + "attn.c_attn.weight"], p[h + "attn.c_attn.bias"])
        a = attention(a)
        x = x + linear(a, p[h + "attn.c_proj.weight"], p[h + "attn.c_proj.bias"])
        m = layernorm(x, p[h + "ln_2.weight"], p[h + "ln_2.bias"])
        m = gelu_tanh(linear(m, p[h + "mlp.c_fc.weight"], p[h + "mlp.c_fc.bias"]))
        x = x + linear(m, p[h + "mlp.c_proj.weight"], p[h + "mlp.c_proj.bias"])
    x = layernorm(x, p["ln_f.weight"], p["ln_f.bias"])
    logits = x @ p["wte"].t()  # tied head, (B,T,Vp)
    logp = torch.log_softmax(logits[..., :VOCAB], dim=-1)
    loss = -logp.gather(-1, targets.unsqueeze(-1)).mean()
    return logits, loss


def loss_and_grads(p, tokens, targets):
    leaves = {n: t.clone().requires_grad_(True) for n, t in p.items()}
    logits, loss = forward(leaves, tokens, targets)
    loss.backward()
    return logits.detach(), loss.item(), {n: t.grad.detach().clone() for n, t in leaves.items()}


def adamw_steps(p, tokens, targets):
    """N_STEPS of decoupled AdamW with global-norm clipping before the update.
    Weight decay applies to the 2-D tensors only (wte, wpe, matmul weights)."""
    p = {n: t.clone() for n, t in p.items()}
    m = {n: torch.zeros_like(t) for n, t in p.items()}
    v = {n: torch.zeros_like(t) for n, t in p.items()}
    losses, norms = [], []
    for step in range(1, N_STEPS + 1):
        _, loss, g = loss_and_grads(p, tokens, targets)
        total = math.sqrt(sum(float((gi ** 2).sum()) for gi in g.values()))
        scale = min(1.0, CLIP / (total + 1e-6))
        losses.append(loss)
        norms.append(total)
        for n in p:
            gi = g[n] * scale
            m[n] = BETA1 * m[n] + (1 - BETA1) * gi
            v[n] = BETA2 * v[n] + (1 - BETA2) * gi * gi
            mhat = m[n] / (1 - BETA1 ** step)
            vhat = v[n] / (1 - BETA2 ** step)
            wd = WD if p[n].dim() == 2 else 0.0
            p[n] = p[n] - LR * (mhat / (torch.sqrt(vhat) + EPS) + wd * p[n])
    return losses, norms, p


def f32(t):
    return t.detach().to(torch.float32).contiguous().numpy().tobytes()  # little-endian on x86


def main():
    assert sys.byteorder == "little"
    gen = torch.Generator().manual_seed(SEED)
    params = init_params(gen)
    tokens = torch.randint(0, VOCAB, (B, T), generator=gen)
    targets = torch.randint(0, VOCAB, (B, T), generator=gen)

    logits, loss, grads = loss_and_grads(params, tokens, targets)
    assert float(grads["wte"][VOCAB:].abs().max()) == 0.0
    losses, norms, final = adamw_steps(params, tokens, targets)
    assert losses[0] == loss

    table = param_table()
    out = bytearray(b"KILNREF1")
    out += struct.pack("<10i", N_LAYER, N_HEAD, N_EMBD, SEQ_LEN, VOCAB, PADDED_VOCAB, B, T,
                       N_STEPS, len(table))
    for name, _ in table:
        nb = name.encode()
        out += struct.pack("<i", len(nb)) + nb + struct.pack("<i", params[name].numel())
        out += f32(params[name])
    out += tokens.to(torch.int32).numpy().tobytes()
    out += targets.to(torch.int32).numpy().tobytes()
    out += f32(logits)
    out += struct.pack("<d", loss)
    for name, _ in table:
        out += f32(grads[name])
    out += struct.pack("<%dd" % N_STEPS, *losses)
    out += struct.pack("<%dd" % N_STEPS, *norms)
    for name, _ in table:
        out += f32(final[name])

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt2_ref.bin")
    with open(path, "wb") as f:
        f.write(out)
    print("wrote %s (%d bytes)" % (path, len(out)))
    print("loss %.10f  step losses %s" % (loss, " ".join("%.6f" % l for l in losses)))
    print("grad norms %s" % " ".join("%.6f" % n for n in norms))


if __name__ == "__main__":
    main()
