#!/usr/bin/env python3
"""gen_arch_ref.py: writes test/ref/{llama,llama_qknorm,moe,moe_sigmoid}_ref.bin,
the float64 references that test/test_model_arch_ref.c holds kiln's fp32
Llama and MoE block graphs to. Everything is written out by hand here (no
torch.nn, no torch.optim), parameterised by a spec whose fields are kiln's
ArchSpec (src/arch.h), so a fixture is an independent account of what kiln
must compute. hf_llama_check.py imports this file and holds it to HuggingFace.

Run with Debian's torch 1.13 (CPU):  /usr/bin/python3 test/ref/gen_arch_ref.py
Format and tolerances: test/ref/README.md.

Definitions (kiln's; docs/architectures.md states the same):
  RMSNorm(x, w)  = x * rsqrt(mean(x^2) + eps) * w                 (over the last axis)
  RoPE, rotate-half (HF layout), per head vector x (HD), i < HD/2, j = i + HD/2:
      x_i' = x_i cos a - x_j sin a,  x_j' = x_j cos a + x_i sin a,
      a = pos * inv_freq[i],  inv_freq[i] = theta^(-2i/HD)
      llama3 scaling (HF _compute_llama3_parameters), wavelen = 2 pi / inv_freq:
        wavelen > orig/low_ff  -> inv_freq / factor
        wavelen < orig/high_ff -> inv_freq
        otherwise s = (orig/wavelen - low_ff) / (high_ff - low_ff),
                  inv_freq = (1 - s) inv_freq / factor + s inv_freq
      The angle table is float64 here.
  Attention: q = x Wq^T (NH heads), k = x Wk^T, v = x Wv^T (NKV heads each);
      qk_norm head: q_h = RMSNorm(q_h, q_norm), k_h = RMSNorm(k_h, k_norm) over
      each head's HD (eps = norm_eps), after the projection, before RoPE;
      causal softmax(q k^T / sqrt(HD)); query head h reads kv head h // (NH/NKV);
      out = concat_h(y_h) Wo^T.
  SwiGLU(x) = down(silu(gate(x)) * up(x)),  silu(u) = u * sigmoid(u).
  Block: x += attn(RMSNorm(x, input_layernorm)); x += mlp(RMSNorm(x, post_attention_layernorm)).
  Head: logits = RMSNorm(x, norm) @ lm_head^T, or @ embed_tokens^T when tied;
      loss = mean over the B*T tokens of cross-entropy over the first V columns.
  MoE layer on its normed input x (N = B*T tokens of the micro-batch):
      logits = x Wr^T (N,E); probs = softmax(logits) or sigmoid(logits);
      the top_k experts by probs (ties to the lower index; balancing bias 0 here);
      gates = chosen probs, / their sum when norm_topk (always for sigmoid);
      expert_e(x) = down_e(silu(gate_e x) * up_e x);
      out_t = sum_k gate_{t,k} expert_{i_{t,k}}(x_t) + shared(x_t),
      shared = a SwiGLU of width n_shared * Fe (absent when n_shared = 0).
      Per sequence b (T tokens), so that no figure depends on how sequences
      are grouped into micro-batches or ranks:
      capacity: cap = ceil(capacity_factor * T * top_k / E) (0: no cap); each
      expert keeps the first cap slots of each sequence in (token, k) order;
      dropped slots add nothing.
      aux = mean_b E * sum_e f_be P_be, f_be = slots of b routed to e before
      drops / (T top_k) (a constant: no gradient), P_be = mean over b's tokens
      of probs[t, e]; z = mean_t logsumexp(logits_t)^2.
  Objective (what the gradients are of) = loss + aux_loss_coef * sum_layers aux
      + z_loss_coef * sum_layers z; the recorded loss is the cross-entropy alone.
  AdamW: as gen_gpt2_ref.py: lr 1e-3, betas (0.9, 0.95), eps 1e-8, decoupled
      weight decay 0.1 on the 2-D tensors (embeddings, lm_head and the router
      included, as the GPT-2 fixture decays wte/wpe), bias-corrected, after
      clipping by global norm 1.0: scale = min(1, 1 / (norm + 1e-6))."""
import math
import os
import struct
import sys

import torch

torch.set_default_dtype(torch.float64)

N_STEPS = 6
LR, BETA1, BETA2, EPS, WD, CLIP = 1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0
VOCAB, PADDED_VOCAB = 61, 64  # odd V on purpose: padding must not leak into the loss

# ArchSpec enum values (src/arch.h order).
FAMILY = {"gpt2": 0, "llama": 1}
NORM = {"layernorm": 0, "rmsnorm": 1}
POS = {"learned": 0, "rope": 1}
MLP = {"gelu": 0, "swiglu": 1, "moe": 2}
QKNORM = {"none": 0, "head": 1, "full": 2}

NO_MOE = dict(n_experts=0, top_k=0, n_shared=0, expert_hidden=0, sigmoid=0, norm_topk=0,
              capacity_factor=0.0, aux_loss_coef=0.0, z_loss_coef=0.0, bias_update_rate=0.0)
NO_SCALING = dict(on=0, factor=1.0, low_freq_factor=1.0, high_freq_factor=1.0, original_context=0)


def base_spec(**kw):
    s = dict(family="llama", n_layer=2, n_head=4, n_kv_head=2, head_dim=8, n_embd=32, seq_len=16,
             vocab_size=VOCAB, padded_vocab=PADDED_VOCAB, ffn_hidden=40, norm="rmsnorm", norm_eps=1e-5,
             pos="rope", rope_theta=10000.0, rope_scaling=dict(NO_SCALING), qk_norm="none", mlp="swiglu",
             bias=0, tie_embeddings=0, moe=dict(NO_MOE))
    for k, v in kw.items():
        if isinstance(v, dict):
            s[k] = dict(s[k], **v)
        else:
            s[k] = v
    return s


# The fixtures: (file stem, spec, B, seed). Seeds are chosen so that every
# top-k margin stays > 1e-4 over the six steps (main() asserts it) and, for
# moe_sigmoid, so that the capacity drops slots.
CASES = [
    ("llama", base_spec(), 3, 1337),
    ("llama_qknorm", base_spec(n_kv_head=1, head_dim=12, qk_norm="head", tie_embeddings=1,
                               rope_scaling=dict(on=1, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                 original_context=8)), 2, 1338),
    ("moe", base_spec(mlp="moe", ffn_hidden=0,
                      moe=dict(n_experts=5, top_k=2, n_shared=1, expert_hidden=24, sigmoid=0, norm_topk=1,
                               capacity_factor=0.0, aux_loss_coef=0.01, z_loss_coef=0.001)), 3, 1353),
    ("moe_sigmoid", base_spec(mlp="moe", ffn_hidden=0, n_kv_head=4, tie_embeddings=1,
                              moe=dict(n_experts=6, top_k=2, n_shared=0, expert_hidden=24, sigmoid=1,
                                       norm_topk=1, capacity_factor=1.0, aux_loss_coef=0.01,
                                       z_loss_coef=0.0)), 3, 1355),
]


def f32r(x):
    """x rounded to float32 (what kiln's float spec fields hold), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def param_table(s):
    """(name, shape) in kiln's listing order (HF layout without "model.")."""
    C, Vp, NH, NKV, HD = s["n_embd"], s["padded_vocab"], s["n_head"], s["n_kv_head"], s["head_dim"]
    t = [("embed_tokens.weight", (Vp, C))]
    for l in range(s["n_layer"]):
        p = "layers.%d." % l
        t += [(p + "input_layernorm.weight", (C,)),
              (p + "self_attn.q_proj.weight", (NH * HD, C)),
              (p + "self_attn.k_proj.weight", (NKV * HD, C)),
              (p + "self_attn.v_proj.weight", (NKV * HD, C))]
        if s["qk_norm"] == "head":
            t += [(p + "self_attn.q_norm.weight", (HD,)), (p + "self_attn.k_norm.weight", (HD,))]
        t += [(p + "self_attn.o_proj.weight", (C, NH * HD)),
              (p + "post_attention_layernorm.weight", (C,))]
        if s["mlp"] == "swiglu":
            F = s["ffn_hidden"]
            t += [(p + "mlp.gate_proj.weight", (F, C)), (p + "mlp.up_proj.weight", (F, C)),
                  (p + "mlp.down_proj.weight", (C, F))]
        else:
            m = s["moe"]
            E, Fe, S = m["n_experts"], m["expert_hidden"], m["n_shared"]
            t += [(p + "mlp.gate.weight", (E, C))]
            for e in range(E):
                q = p + "mlp.experts.%d." % e
                t += [(q + "gate_proj.weight", (Fe, C)), (q + "up_proj.weight", (Fe, C)),
                      (q + "down_proj.weight", (C, Fe))]
            if S > 0:
                q = p + "mlp.shared_experts."
                t += [(q + "gate_proj.weight", (S * Fe, C)), (q + "up_proj.weight", (S * Fe, C)),
                      (q + "down_proj.weight", (C, S * Fe))]
    t += [("norm.weight", (C,))]
    if not s["tie_embeddings"]:
        t += [("lm_head.weight", (Vp, C))]
    return t


def init_params(s, gen):
    """Not kiln's init, so that a swapped or dropped gain shows: norm gains
    (and qk-norm weights) 1 + N(0, 0.1), the router N(0, 0.5) so routing is
    decisive (top-k margins well above fp32 noise), other weights N(0, 0.02);
    padded rows of embed_tokens and lm_head zero. Rounded to float32, then
    used as float64, so both sides start from identical numbers."""
    params = {}
    for name, shape in param_table(s):
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        if len(shape) == 1:
            x = 1.0 + 0.1 * x
        elif name.endswith("mlp.gate.weight"):
            x = 0.5 * x
        else:
            x = 0.02 * x
        if name in ("embed_tokens.weight", "lm_head.weight"):
            x[s["vocab_size"]:] = 0.0
        params[name] = x.to(torch.float32).to(torch.float64)
    return params


def rmsnorm(x, w, eps):
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w


def silu(u):
    return u * torch.sigmoid(u)


def rope_inv_freq(s):
    """(HD/2) float64 inverse frequencies, llama3-scaled when rope_scaling.on."""
    HD = s["head_dim"]
    theta = f32r(s["rope_theta"])
    inv = torch.tensor([theta ** (-2.0 * i / HD) for i in range(HD // 2)], dtype=torch.float64)
    r = s["rope_scaling"]
    if r["on"]:
        factor, lo, hi = f32r(r["factor"]), f32r(r["low_freq_factor"]), f32r(r["high_freq_factor"])
        orig = float(r["original_context"])
        out = []
        for f in inv.tolist():
            wavelen = 2.0 * math.pi / f
            if wavelen > orig / lo:
                out.append(f / factor)
            elif wavelen < orig / hi:
                out.append(f)
            else:
                sm = (orig / wavelen - lo) / (hi - lo)
                out.append((1.0 - sm) * f / factor + sm * f)
        inv = torch.tensor(out, dtype=torch.float64)
    return inv


def rope(x, inv_freq):
    """x (B,H,T,HD), rotate-half pairs (i, i + HD/2)."""
    T, half = x.shape[2], x.shape[3] // 2
    a = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (T, HD/2)
    cos, sin = torch.cos(a), torch.sin(a)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention(s, p, pre, x, inv_freq):
    B, T, C = x.shape
    NH, NKV, HD = s["n_head"], s["n_kv_head"], s["head_dim"]
    eps = f32r(s["norm_eps"])
    q = (x @ p[pre + "q_proj.weight"].t()).reshape(B, T, NH, HD)
    k = (x @ p[pre + "k_proj.weight"].t()).reshape(B, T, NKV, HD)
    v = (x @ p[pre + "v_proj.weight"].t()).reshape(B, T, NKV, HD)
    if s["qk_norm"] == "head":
        q = rmsnorm(q, p[pre + "q_norm.weight"], eps)
        k = rmsnorm(k, p[pre + "k_norm.weight"], eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B,H,T,HD)
    q, k = rope(q, inv_freq), rope(k, inv_freq)
    kv_of = torch.tensor([h // (NH // NKV) for h in range(NH)])
    k, v = k[:, kv_of], v[:, kv_of]  # (B,NH,T,HD)
    scores = q @ k.transpose(-1, -2) / math.sqrt(HD)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    att = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    y = (att @ v).transpose(1, 2).reshape(B, T, NH * HD)
    return y @ p[pre + "o_proj.weight"].t()


def swiglu(x, wg, wu, wd):
    return (silu(x @ wg.t()) * (x @ wu.t())) @ wd.t()


def moe(s, p, pre, x, stats):
    """MoE MLP on the normed input x (B,T,C). Appends this layer's routing
    facts to stats: top-k margin, dropped slots, aux, z."""
    m = s["moe"]
    B, T, C = x.shape
    N, E, K = B * T, m["n_experts"], m["top_k"]
    xs = x.reshape(N, C)
    logits = xs @ p[pre + "gate.weight"].t()  # (N,E)
    probs = torch.sigmoid(logits) if m["sigmoid"] else torch.softmax(logits, dim=-1)
    srt = torch.sort(probs.detach(), dim=-1, descending=True, stable=True)  # stable: ties to the lower index
    idx = srt.indices[:, :K]  # (N,K), k = 0 the largest
    margin = float((srt.values[:, K - 1] - srt.values[:, K]).min())
    gates = probs.gather(1, idx)
    if m["sigmoid"] or m["norm_topk"]:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    cf = f32r(m["capacity_factor"])
    cap = math.ceil(cf * T * K / E) if cf > 0 else 0
    keep = torch.ones(N, K)
    seen = [[0] * E for _ in range(B)]  # per sequence
    for t in range(N):  # (token, k) order
        for j in range(K):
            e = int(idx[t, j])
            seen[t // T][e] += 1
            if cap and seen[t // T][e] > cap:
                keep[t, j] = 0.0
    out = torch.zeros(N, C)
    for e in range(E):
        q = pre + "experts.%d." % e
        ye = swiglu(xs, p[q + "gate_proj.weight"], p[q + "up_proj.weight"], p[q + "down_proj.weight"])  # (N,C)
        w = ((idx == e).to(torch.float64) * keep * gates).sum(dim=1)  # (N): this expert's gate per token
        out = out + w[:, None] * ye
    if m["n_shared"] > 0:
        q = pre + "shared_experts."
        out = out + swiglu(xs, p[q + "gate_proj.weight"], p[q + "up_proj.weight"], p[q + "down_proj.weight"])
    counts = torch.tensor(seen, dtype=torch.float64)  # (B,E) slots per sequence and expert before drops
    P = probs.reshape(B, T, E).mean(dim=1)  # (B,E)
    aux = (E * ((counts / (T * K)) * P).sum(dim=1)).mean()
    z = (torch.logsumexp(logits, dim=-1) ** 2).mean()
    stats.append(dict(margin=margin, dropped=int(N * K - keep.sum().item()), aux=aux, z=z))
    return out.reshape(B, T, C)


def forward(s, p, tokens, targets, inv_freq=None):
    """Returns (logits (B,T,Vp), mean CE, objective, per-layer MoE stats).
    inv_freq overrides the RoPE table (hf_llama_check.py feeds HF's)."""
    if inv_freq is None:
        inv_freq = rope_inv_freq(s)
    eps = f32r(s["norm_eps"])
    x = p["embed_tokens.weight"][tokens]
    stats = []
    for l in range(s["n_layer"]):
        pre = "layers.%d." % l
        x = x + attention(s, p, pre + "self_attn.", rmsnorm(x, p[pre + "input_layernorm.weight"], eps), inv_freq)
        h = rmsnorm(x, p[pre + "post_attention_layernorm.weight"], eps)
        if s["mlp"] == "swiglu":
            x = x + swiglu(h, p[pre + "mlp.gate_proj.weight"], p[pre + "mlp.up_proj.weight"],
                           p[pre + "mlp.down_proj.weight"])
        else:
            x = x + moe(s, p, pre + "mlp.", h, stats)
    x = rmsnorm(x, p["norm.weight"], eps)
    head = p["embed_tokens.weight"] if s["tie_embeddings"] else p["lm_head.weight"]
    logits = x @ head.t()
    loss = None
    obj = None
    if targets is not None:
        logp = torch.log_softmax(logits[..., :s["vocab_size"]], dim=-1)
        loss = -logp.gather(-1, targets.unsqueeze(-1)).mean()
        obj = loss
        if stats:
            m = s["moe"]
            obj = obj + f32r(m["aux_loss_coef"]) * sum(st["aux"] for st in stats) \
                + f32r(m["z_loss_coef"]) * sum(st["z"] for st in stats)
    return logits, loss, obj, stats


def loss_and_grads(s, p, tokens, targets):
    leaves = {n: t.clone().requires_grad_(True) for n, t in p.items()}
    logits, loss, obj, stats = forward(s, leaves, tokens, targets)
    obj.backward()
    grads = {n: t.grad.detach().clone() for n, t in leaves.items()}
    return logits.detach(), loss.item(), stats, grads


def adamw_steps(s, p, tokens, targets):
    """N_STEPS of decoupled AdamW after global-norm clipping, decay on the 2-D
    tensors only; returns per-step CE losses, unclipped norms, min top-k
    margins and the final parameters."""
    p = {n: t.clone() for n, t in p.items()}
    m = {n: torch.zeros_like(t) for n, t in p.items()}
    v = {n: torch.zeros_like(t) for n, t in p.items()}
    losses, norms, margins = [], [], []
    for step in range(1, N_STEPS + 1):
        _, loss, stats, g = loss_and_grads(s, p, tokens, targets)
        total = math.sqrt(sum(float((gi ** 2).sum()) for gi in g.values()))
        scale = min(1.0, CLIP / (total + 1e-6))
        losses.append(loss)
        norms.append(total)
        margins.append(min([st["margin"] for st in stats], default=float("inf")))
        for n in p:
            gi = g[n] * scale
            m[n] = BETA1 * m[n] + (1 - BETA1) * gi
            v[n] = BETA2 * v[n] + (1 - BETA2) * gi * gi
            mhat = m[n] / (1 - BETA1 ** step)
            vhat = v[n] / (1 - BETA2 ** step)
            wd = WD if p[n].dim() == 2 else 0.0
            p[n] = p[n] - LR * (mhat / (torch.sqrt(vhat) + EPS) + wd * p[n])
    return losses, norms, margins, p


def f32(t):
    return t.detach().to(torch.float32).contiguous().numpy().tobytes()  # little-endian on x86


def spec_keys(s, B, T, n_steps, dropped):
    """The header's (name, kind, value) list: ArchSpec fields (enum values as
    in src/arch.h), then the run's."""
    r, m = s["rope_scaling"], s["moe"]
    keys = [("family", "i", FAMILY[s["family"]]), ("n_layer", "i", s["n_layer"]), ("n_head", "i", s["n_head"]),
            ("n_kv_head", "i", s["n_kv_head"]), ("head_dim", "i", s["head_dim"]), ("n_embd", "i", s["n_embd"]),
            ("seq_len", "i", s["seq_len"]), ("vocab_size", "i", s["vocab_size"]),
            ("padded_vocab", "i", s["padded_vocab"]), ("ffn_hidden", "i", s["ffn_hidden"]),
            ("norm", "i", NORM[s["norm"]]), ("norm_eps", "f", s["norm_eps"]), ("pos", "i", POS[s["pos"]]),
            ("rope_theta", "f", s["rope_theta"]), ("rope_scaling.on", "i", r["on"]),
            ("rope_scaling.factor", "f", r["factor"]), ("rope_scaling.low_freq_factor", "f", r["low_freq_factor"]),
            ("rope_scaling.high_freq_factor", "f", r["high_freq_factor"]),
            ("rope_scaling.original_context", "i", r["original_context"]),
            ("qk_norm", "i", QKNORM[s["qk_norm"]]), ("mlp", "i", MLP[s["mlp"]]), ("bias", "i", s["bias"]),
            ("tie_embeddings", "i", s["tie_embeddings"])]
    for k in ("n_experts", "top_k", "n_shared", "expert_hidden", "sigmoid", "norm_topk"):
        keys.append(("moe." + k, "i", m[k]))
    for k in ("capacity_factor", "aux_loss_coef", "z_loss_coef", "bias_update_rate"):
        keys.append(("moe." + k, "f", m[k]))
    keys += [("B", "i", B), ("T", "i", T), ("n_steps", "i", n_steps), ("decay_embeddings", "i", 1),
             ("dropped_slots", "i", dropped), ("lr", "f", LR), ("beta1", "f", BETA1), ("beta2", "f", BETA2),
             ("eps", "f", EPS), ("weight_decay", "f", WD), ("grad_clip", "f", CLIP)]
    return keys


def write_fixture(path, s, B, T, tokens, targets, params, logits, loss, aux, z, grads, dropped,
                  losses=(), norms=(), final=None):
    """See test/ref/README.md, "Format (KILNARC1)". n_steps = len(losses);
    the final-parameter section is present only when n_steps > 0."""
    table = param_table(s)
    out = bytearray(b"KILNARC1")
    keys = spec_keys(s, B, T, len(losses), dropped)
    out += struct.pack("<i", len(keys))
    for name, kind, val in keys:
        nb = name.encode()
        out += struct.pack("<i", len(nb)) + nb + kind.encode()
        out += struct.pack("<i", int(val)) if kind == "i" else struct.pack("<f", float(val))
    out += struct.pack("<i", len(table))
    for name, shape in table:
        nb = name.encode()
        out += struct.pack("<i", len(nb)) + nb + struct.pack("<i", len(shape))
        out += struct.pack("<%di" % len(shape), *shape)
        assert tuple(params[name].shape) == tuple(shape)
        out += f32(params[name])
    out += tokens.to(torch.int32).numpy().tobytes()
    out += targets.to(torch.int32).numpy().tobytes()
    out += f32(logits)
    out += struct.pack("<3d", loss, aux, z)
    for name, _ in table:
        out += f32(grads[name])
    out += struct.pack("<%dd" % len(losses), *losses)
    out += struct.pack("<%dd" % len(norms), *norms)
    if losses:
        for name, _ in table:
            out += f32(final[name])
    with open(path, "wb") as f:
        f.write(out)
    return len(out)


def make_case(stem, s, B, seed):
    T = s["seq_len"]
    gen = torch.Generator().manual_seed(seed)
    params = init_params(s, gen)
    tokens = torch.randint(0, s["vocab_size"], (B, T), generator=gen)
    targets = torch.randint(0, s["vocab_size"], (B, T), generator=gen)
    logits, loss, stats, grads = loss_and_grads(s, params, tokens, targets)
    for n in ("embed_tokens.weight", "lm_head.weight"):
        if n in grads:
            assert float(grads[n][s["vocab_size"]:].abs().max()) == 0.0
    losses, norms, margins, final = adamw_steps(s, params, tokens, targets)
    assert losses[0] == loss
    aux = float(sum(st["aux"] for st in stats)) if stats else 0.0
    z = float(sum(st["z"] for st in stats)) if stats else 0.0
    dropped = sum(st["dropped"] for st in stats)
    if stats:
        assert min(margins) > 1e-4, "%s: top-k margin %.2e too small; pick another seed" % (stem, min(margins))
    if s["mlp"] == "moe" and s["moe"]["capacity_factor"] > 0:
        assert dropped > 0, "%s: capacity dropped nothing; pick another seed" % stem
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), stem + "_ref.bin")
    n = write_fixture(path, s, B, T, tokens, targets, params, logits, loss, aux, z, grads, dropped,
                      losses, norms, final)
    print("wrote %s (%d bytes, %d params)" % (path, n, sum(t.numel() for t in params.values())))
    print("  loss %.10f  aux %.8f  z %.8f  dropped slots %d (per layer %s)" %
          (loss, aux, z, dropped, [st["dropped"] for st in stats]))
    print("  step losses %s" % " ".join("%.6f" % l for l in losses))
    print("  grad norms  %s" % " ".join("%.6f" % n for n in norms))
    if stats:
        print("  min top-k margin per step %s" % " ".join("%.2e" % mg for mg in margins))


def main():
    assert sys.byteorder == "little"
    only = sys.argv[1:]
    for stem, s, B, seed in CASES:
        if not only or stem in only:
            make_case(stem, s, B, seed)


if __name__ == "__main__":
    main()
