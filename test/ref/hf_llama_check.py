#!/usr/bin/env python3
"""hf_llama_check.py: holds gen_arch_ref.py's hand-written float64 block graph
to HuggingFace's own LlamaForCausalLM and MixtralForCausalLM on the same
weights, and checks (or, with --write, writes) test/ref/hf_llama_ref.bin:
HF's float32 logits, loss and gradients for test_model_arch_ref.c to hold
kiln's fp32 model to. Never used by the trainer.

Run:  .venv-hf/bin/python test/ref/hf_llama_check.py [--write]
(transformers==4.46.3 over Debian's torch 1.13: scripts/setup_hf.sh).
Prints one "ok ..." or "FAIL ..." line per check; exit status 1 on any FAIL.

HF computes RMSNorm, softmax and the RoPE table in float32 even inside a
float64 model (precision policy, not semantics). For the float64 comparisons
those casts are patched out for the duration of the call only: the same
operations in the same order, in float64. The float32 fixture uses HF as is."""
import contextlib
import math
import os
import struct
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_arch_ref as ref  # noqa: E402

import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.mixtral import modeling_mixtral  # noqa: E402

B, T = 3, 16
FIXTURE = os.path.join(HERE, "hf_llama_ref.bin")
# Bounds. float64 against float64 with different summation orders: ~1e-15
# per op, a few hundred ops deep; 1e-10 leaves 1e4 of room and is still
# 1e3 below any float32 cast that slipped through (~1e-7).
TOL_F64 = 1e-10
# inv_freq: HF's table is float32 (rel 6e-8 rounding); a wrong formula is O(1).
TOL_INV_FREQ_REL = 1e-6
# The committed fixture against HF fp32 recomputed here: bit-identical on the
# machine that wrote it; other BLAS builds reorder fp32 sums (~1e-7 on O(1)
# logits), so 1e-5.
TOL_FIXTURE = 1e-5

failures = 0


def report(ok, name, msg):
    global failures
    failures += 0 if ok else 1
    print("%s %s: %s" % ("ok" if ok else "FAIL", name, msg))


# ---- float64 patches: HF's forced float32 casts removed ----
_softmax = torch.nn.functional.softmax


def _softmax64(x, dim=None, _stacklevel=3, dtype=None):
    if x.dtype == torch.float64:
        dtype = None
    return _softmax(x, dim=dim, dtype=dtype)


def _rmsnorm64(self, h):
    var = h.pow(2).mean(-1, keepdim=True)
    return self.weight * (h * torch.rsqrt(var + self.variance_epsilon))


def _llama_rope64(self, x, position_ids):
    freqs = position_ids[:, :, None].to(torch.float64) * self.inv_freq.to(torch.float64)[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _mixtral_rope64(self, x, seq_len=None):
    freqs = torch.arange(seq_len, dtype=torch.float64)[:, None] * self.inv_freq.to(torch.float64)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


@contextlib.contextmanager
def hf_float64():
    saved = [(torch.nn.functional, "softmax", _softmax64),
             (modeling_llama.LlamaRMSNorm, "forward", _rmsnorm64),
             (modeling_llama.LlamaRotaryEmbedding, "forward", _llama_rope64),
             (modeling_mixtral.MixtralRMSNorm, "forward", _rmsnorm64),
             (modeling_mixtral.MixtralRotaryEmbedding, "forward", _mixtral_rope64)]
    old = [(o, n, getattr(o, n)) for o, n, _ in saved]
    for o, n, f in saved:
        setattr(o, n, f)
    try:
        yield
    finally:
        for o, n, f in old:
            setattr(o, n, f)


# ---- weights between HF and kiln names ----
def hf_to_kiln(sd, spec):
    """HF state dict -> kiln parameter dict (float64): drop "model.", pad
    embed_tokens / lm_head rows to padded_vocab with zeros, Mixtral's
    block_sparse_moe.experts.e.w1/w3/w2 -> mlp.experts.e.gate/up/down_proj."""
    V, Vp = spec["vocab_size"], spec["padded_vocab"]
    out = {}
    for k, v in sd.items():
        k = k[len("model."):] if k.startswith("model.") else k
        k = k.replace("block_sparse_moe.", "mlp.").replace(".w1.", ".gate_proj.") \
             .replace(".w3.", ".up_proj.").replace(".w2.", ".down_proj.")
        v = v.detach().to(torch.float64)
        if k in ("embed_tokens.weight", "lm_head.weight"):
            v = torch.cat([v, torch.zeros(Vp - V, v.shape[1], dtype=v.dtype)], dim=0)
        out[k] = v
    if spec["tie_embeddings"]:
        out.pop("lm_head.weight", None)
    names = [n for n, _ in ref.param_table(spec)]
    assert sorted(names) == sorted(out), (sorted(set(names) ^ set(out)))
    return {n: out[n] for n in names}


def kiln_to_hf(p, spec):
    V = spec["vocab_size"]
    out = {}
    for k, v in p.items():
        if k in ("embed_tokens.weight", "lm_head.weight"):
            v = v[:V]
        if k != "lm_head.weight":
            k = "model." + k
        k = k.replace("mlp.experts.", "block_sparse_moe.experts.").replace("mlp.gate.", "block_sparse_moe.gate.")
        k = k.replace("gate_proj.", "w1.").replace("up_proj.", "w3.").replace("down_proj.", "w2.") \
            if "block_sparse_moe.experts." in k else k
        out[k] = v.clone()
    return out


def randomise(model, gen):
    """HF's init leaves norm gains at 1, where a swapped or dropped gain would
    not show: gains 1 + N(0, 0.1), weights N(0, 0.02), padded nothing (HF has
    no padding). Rounded to float32 so the fp32 and fp64 models share values."""
    with torch.no_grad():
        for n, t in model.named_parameters():
            x = torch.randn(t.shape, generator=gen, dtype=torch.float64)
            x = 1.0 + 0.1 * x if t.dim() == 1 else 0.02 * x
            t.copy_(x.to(torch.float32).to(t.dtype))


def llama_config(spec, dtype):
    r = spec["rope_scaling"]
    kw = dict(vocab_size=spec["vocab_size"], hidden_size=spec["n_embd"], intermediate_size=spec["ffn_hidden"],
              num_hidden_layers=spec["n_layer"], num_attention_heads=spec["n_head"],
              num_key_value_heads=spec["n_kv_head"], head_dim=spec["head_dim"],
              max_position_embeddings=spec["seq_len"], rms_norm_eps=ref.f32r(spec["norm_eps"]),
              rope_theta=ref.f32r(spec["rope_theta"]), tie_word_embeddings=bool(spec["tie_embeddings"]),
              attention_bias=False, mlp_bias=False, torch_dtype=dtype, attn_implementation="eager")
    if r["on"]:
        kw["rope_scaling"] = dict(rope_type="llama3", factor=r["factor"], low_freq_factor=r["low_freq_factor"],
                                  high_freq_factor=r["high_freq_factor"],
                                  original_max_position_embeddings=r["original_context"])
    return LlamaConfig(**kw)


def hf_inv_freq(model):
    for mod in model.modules():
        if hasattr(mod, "inv_freq"):
            return mod.inv_freq.detach().to(torch.float64)
    raise RuntimeError("no rotary embedding found")


def compare_f64(name, spec, hf64, tokens, targets):
    """Logits, loss and every gradient of the CE: HF float64 vs the reference."""
    p = hf_to_kiln(hf64.state_dict(), spec)
    inv_hf = hf_inv_freq(hf64)
    inv_ref = ref.rope_inv_freq(spec)
    rel = float(((inv_ref - inv_hf).abs() / inv_ref).max())
    report(rel < TOL_INV_FREQ_REL, "hf_%s_inv_freq" % name, "rope table rel diff %.2e vs HF's float32 (tol %.0e)"
           % (rel, TOL_INV_FREQ_REL))
    with hf_float64():
        hf64.zero_grad()
        lg_hf = hf64(input_ids=tokens).logits
        loss_hf = torch.nn.functional.cross_entropy(lg_hf.reshape(-1, lg_hf.shape[-1]), targets.reshape(-1))
        loss_hf.backward()
    grads_hf = hf_to_kiln({n: t.grad for n, t in hf64.named_parameters()}, spec) if not spec["tie_embeddings"] \
        else hf_to_kiln({n: t.grad for n, t in hf64.named_parameters() if n != "lm_head.weight"}, spec)
    # the reference on HF's own (float32-valued) inv_freq, so the RoPE formula
    # is judged above and everything else here
    leaves = {n: t.clone().requires_grad_(True) for n, t in p.items()}
    lg, loss, _, _ = ref.forward(spec, leaves, tokens, targets, inv_freq=inv_hf)
    loss.backward()
    V = spec["vocab_size"]
    dl = float((lg[..., :V].detach() - lg_hf.detach()).abs().max())
    pad = float(lg[..., V:].detach().abs().max())
    dloss = abs(loss.item() - loss_hf.item())
    dg = max(float((leaves[n].grad - grads_hf[n]).abs().max()) / max(float(grads_hf[n].abs().max()), 1e-30)
             for n in p)
    ok = dl < TOL_F64 and dloss < TOL_F64 and dg < TOL_F64 and pad == 0.0
    report(ok, "hf_%s_f64" % name, "max |logit diff| %.2e, loss diff %.2e, worst grad rel diff %.2e (tol %.0e)"
           % (dl, dloss, dg, TOL_F64))
    return dl


def fixture_f32(spec, hf64, tokens, targets):
    """HF float32 as shipped, on the same float32-valued weights: logits
    (padded with zero columns to Vp), CE loss and its gradients."""
    hf32 = LlamaForCausalLM(llama_config(spec, torch.float32)).float()
    hf32.load_state_dict({k: v.to(torch.float32) for k, v in hf64.state_dict().items()})
    hf32.zero_grad()
    lg = hf32(input_ids=tokens).logits  # (B,T,V) float32
    loss = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), targets.reshape(-1))
    loss.backward()
    V, Vp = spec["vocab_size"], spec["padded_vocab"]
    logits = torch.cat([lg.detach(), torch.zeros(B, T, Vp - V)], dim=-1)
    params = hf_to_kiln(hf32.state_dict(), spec)
    grads = hf_to_kiln({n: t.grad for n, t in hf32.named_parameters()}, spec)
    return params, logits, loss.item(), grads


def read_fixture_logits(path, n):
    """The logits section of a KILNARC1 file (n floats), parsed just far enough."""
    with open(path, "rb") as f:
        b = f.read()
    pos = 8
    (nk,) = struct.unpack_from("<i", b, pos); pos += 4
    for _ in range(nk):
        (ln,) = struct.unpack_from("<i", b, pos); pos += 4 + ln + 1 + 4
    (nt,) = struct.unpack_from("<i", b, pos); pos += 4
    for _ in range(nt):
        (ln,) = struct.unpack_from("<i", b, pos); pos += 4 + ln
        (nd,) = struct.unpack_from("<i", b, pos); pos += 4
        shape = struct.unpack_from("<%di" % nd, b, pos); pos += 4 * nd
        pos += 4 * math.prod(shape)
    pos += 2 * 4 * B * T
    return torch.tensor(struct.unpack_from("<%df" % n, b, pos), dtype=torch.float64)


def main():
    write = "--write" in sys.argv[1:]
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(4242)
    tokens = torch.randint(0, ref.VOCAB, (B, T), generator=gen)
    targets = torch.randint(0, ref.VOCAB, (B, T), generator=gen)

    # (a) Llama as llama_ref.bin's spec; then MQA, head_dim 12 (q width 48 != C),
    # tied, llama3-scaled RoPE, as llama_qknorm_ref.bin's minus the QK-norm
    # (HF 4.46 has no Qwen3).
    spec = ref.base_spec()
    hf64 = LlamaForCausalLM(llama_config(spec, torch.float64)).double()
    randomise(hf64, gen)
    compare_f64("llama", spec, hf64, tokens, targets)

    spec3 = ref.base_spec(n_kv_head=1, head_dim=12, tie_embeddings=1,
                          rope_scaling=dict(on=1, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                            original_context=8))
    hf64_3 = LlamaForCausalLM(llama_config(spec3, torch.float64)).double()
    randomise(hf64_3, gen)
    compare_f64("llama_mqa_llama3rope", spec3, hf64_3, tokens, targets)

    # (a') Mixtral: moe_ref.bin's spec without the shared expert, the
    # reference's own init (router N(0, 0.5)) loaded into HF.
    specm = ref.base_spec(mlp="moe", ffn_hidden=0,
                          moe=dict(n_experts=5, top_k=2, n_shared=0, expert_hidden=24, sigmoid=0, norm_topk=1,
                                   capacity_factor=0.0, aux_loss_coef=0.0, z_loss_coef=0.0))
    pm = ref.init_params(specm, torch.Generator().manual_seed(1353))
    mcfg = MixtralConfig(vocab_size=ref.VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                         rms_norm_eps=ref.f32r(1e-5), rope_theta=10000.0, sliding_window=None,
                         num_local_experts=5, num_experts_per_tok=2, router_jitter_noise=0.0,
                         tie_word_embeddings=False, torch_dtype=torch.float64, attn_implementation="eager")
    mix = MixtralForCausalLM(mcfg).double()
    mix.load_state_dict(kiln_to_hf(pm, specm))
    compare_f64("mixtral", specm, mix, tokens, targets)

    # (b) the fp32 fixture
    params, logits, loss, grads = fixture_f32(spec, hf64, tokens, targets)
    n = B * T * spec["padded_vocab"]
    if write:
        size = ref.write_fixture(FIXTURE, spec, B, T, tokens, targets, params, logits, loss, 0.0, 0.0, grads, 0)
        print("wrote %s (%d bytes), HF fp32 loss %.8f" % (FIXTURE, size, loss))
    elif not os.path.exists(FIXTURE):
        report(False, "hf_llama_fixture", "%s missing: run with --write" % FIXTURE)
    else:
        d = float((read_fixture_logits(FIXTURE, n) - logits.reshape(-1).to(torch.float64)).abs().max())
        report(d < TOL_FIXTURE, "hf_llama_fixture", "committed logits vs HF fp32 now: max diff %.2e (tol %.0e)"
               % (d, TOL_FIXTURE))
    print("transformers %s, torch %s: %d failed" % (transformers.__version__, torch.__version__, failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
