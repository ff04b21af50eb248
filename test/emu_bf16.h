/* emu_bf16.h: a test-only Backend that stores activations in bf16 on the host
 * (act_bytes 2) and computes with the CPU backend: each op widens its act
 * inputs to fp32, runs the CPU op, and rounds its act outputs to bf16 (round
 * to nearest even), which is the CUDA backend's contract for precision.compute
 * bf16 (fp32 math, bf16 stores). It lets the suite run, on a machine with no
 * GPU, the host logic that only a bf16 backend reaches: model.c's compute copy
 * (cast, staleness, ZeRO-3 re-binding), activation planning in bytes, logits
 * rows, and test_ops' bf16 table and tolerances. Not a fast path: every op
 * allocates its fp32 copies. Include it from one test file only per binary. */
#ifndef KILN_EMU_BF16_H
#define KILN_EMU_BF16_H

#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "util.h"

#define EMU_AB 2 /* bf16 */

/* fp32 copy of n act elements (NULL stays NULL). */
static float *emu_wide(const void *x, size_t n) {
    if (!x) return NULL;
    float *f = xmalloc((n ? n : 1) * sizeof(float));
    backend_act_to_f32(f, x, n, EMU_AB);
    return f;
}
/* Round fp32 f back into act x, then free f. */
static void emu_store(void *x, float *f, size_t n) {
    if (!x) return;
    backend_f32_to_act(x, f, n, EMU_AB);
    free(f);
}

static size_t emu_act_bytes(void) { return EMU_AB; }
static void emu_cast_to_act(void *dst, const float *src, size_t n) { backend_f32_to_act(dst, src, n, EMU_AB); }

static void emu_embed_forward(void *out, const int32_t *tokens, const void *wte, const void *wpe, int B, int T,
                              int C) {
    int N = B * T, rows = 0;
    for (int i = 0; i < N; i++) rows = tokens[i] + 1 > rows ? tokens[i] + 1 : rows; /* wte rows read */
    float *o = xmalloc((size_t)N * C * sizeof(float)), *we = emu_wide(wte, (size_t)rows * C);
    float *pe = emu_wide(wpe, (size_t)T * C);
    backend_cpu.embed_forward(o, tokens, we, pe, B, T, C);
    emu_store(out, o, (size_t)N * C);
    free(we), free(pe);
}
static void emu_embed_backward(float *dwte, float *dwpe, const void *dout, const int32_t *tokens,
                               const int32_t *tokens_host, int B, int T, int C, int accumulate) {
    float *d = emu_wide(dout, (size_t)B * T * C);
    backend_cpu.embed_backward(dwte, dwpe, d, tokens, tokens_host, B, T, C, accumulate);
    free(d);
}
static void emu_layernorm_forward(void *out, float *mean, float *rstd, const void *inp, const void *w,
                                  const void *b, int N, int C, float eps) {
    size_t NC = (size_t)N * C;
    float *o = xmalloc(NC * sizeof(float)), *x = emu_wide(inp, NC), *wf = emu_wide(w, C), *bf = emu_wide(b, C);
    backend_cpu.layernorm_forward(o, mean, rstd, x, wf, bf, N, C, eps);
    emu_store(out, o, NC);
    free(x), free(wf), free(bf);
}
static void emu_layernorm_backward(void *dinp, float *dw, float *db, const void *dout, const void *inp,
                                   const void *w, const float *mean, const float *rstd, int N, int C,
                                   int accumulate) {
    size_t NC = (size_t)N * C;
    float *di = emu_wide(dinp, NC), *d = emu_wide(dout, NC), *x = emu_wide(inp, NC), *wf = emu_wide(w, C);
    backend_cpu.layernorm_backward(di, dw, db, d, x, wf, mean, rstd, N, C, accumulate);
    emu_store(dinp, di, NC);
    free(d), free(x), free(wf);
}
static void emu_matmul_forward(void *out, const void *inp, const void *w, const void *bias, int N, int C,
                               int OC) {
    float *o = xmalloc((size_t)N * OC * sizeof(float)), *x = emu_wide(inp, (size_t)N * C);
    float *wf = emu_wide(w, (size_t)OC * C), *bf = emu_wide(bias, OC);
    backend_cpu.matmul_forward(o, x, wf, bf, N, C, OC);
    emu_store(out, o, (size_t)N * OC);
    free(x), free(wf), free(bf);
}
static void emu_matmul_backward(void *dinp, float *dw, float *dbias, const void *dout, const void *inp,
                                const void *w, int N, int C, int OC, int accumulate) {
    float *di = dinp ? xmalloc((size_t)N * C * sizeof(float)) : NULL;
    float *d = emu_wide(dout, (size_t)N * OC), *x = emu_wide(inp, (size_t)N * C), *wf = emu_wide(w, (size_t)OC * C);
    backend_cpu.matmul_backward(di, dw, dbias, d, x, wf, N, C, OC, accumulate);
    emu_store(dinp, di, (size_t)N * C);
    free(d), free(x), free(wf);
}
static void emu_attention_forward(void *out, float *lse, const void *qkv, const AttnShape *sh) {
    size_t N = (size_t)sh->B * sh->T, C = (size_t)sh->NH * sh->HD, W = (size_t)attn_qkv_width(sh);
    float *o = xmalloc(N * C * sizeof(float)), *q = emu_wide(qkv, N * W);
    backend_cpu.attention_forward(o, lse, q, sh);
    emu_store(out, o, N * C);
    free(q);
}
static void emu_attention_backward(void *dqkv, const void *dout, const void *qkv, const void *out,
                                   const float *lse, const AttnShape *sh) {
    size_t N = (size_t)sh->B * sh->T, C = (size_t)sh->NH * sh->HD, W = (size_t)attn_qkv_width(sh);
    float *dq = xmalloc(N * W * sizeof(float)), *d = emu_wide(dout, N * C), *q = emu_wide(qkv, N * W);
    float *o = emu_wide(out, N * C);
    backend_cpu.attention_backward(dq, d, q, o, lse, sh);
    emu_store(dqkv, dq, N * W);
    free(d), free(q), free(o);
}
/* Elements a block's q (k, v) rows span: the last row's start plus its heads. */
static size_t emu_span(int rows, int ld, int width) { return rows > 0 ? (size_t)(rows - 1) * ld + width : 0; }
static void emu_attention_block_forward(void *out, float *lse, const void *q, const void *k, const void *v,
                                        const AttnBlock *s, int merge) {
    size_t NO = (size_t)s->B * s->Tq * s->NH * s->HD;
    float *o = merge ? emu_wide(out, NO) : xmalloc((NO ? NO : 1) * sizeof(float));
    float *qf = emu_wide(q, emu_span(s->B * s->Tq, s->q_ld, s->NH * s->HD));
    float *kf = emu_wide(k, emu_span(s->B * s->Tk, s->kv_ld, s->NKV * s->HD));
    float *vf = emu_wide(v, emu_span(s->B * s->Tk, s->kv_ld, s->NKV * s->HD));
    backend_cpu.attention_block_forward(o, lse, qf, kf, vf, s, merge);
    emu_store(out, o, NO);
    free(qf), free(kf), free(vf);
}
static void emu_attention_block_backward(float *dq, float *dk, float *dv, const void *dout, const void *q,
                                         const void *k, const void *v, const void *out, const float *lse,
                                         const AttnBlock *s) {
    size_t NO = (size_t)s->B * s->Tq * s->NH * s->HD;
    float *d = emu_wide(dout, NO), *o = emu_wide(out, NO);
    float *qf = emu_wide(q, emu_span(s->B * s->Tq, s->q_ld, s->NH * s->HD));
    float *kf = emu_wide(k, emu_span(s->B * s->Tk, s->kv_ld, s->NKV * s->HD));
    float *vf = emu_wide(v, emu_span(s->B * s->Tk, s->kv_ld, s->NKV * s->HD));
    backend_cpu.attention_block_backward(dq, dk, dv, d, qf, kf, vf, o, lse, s);
    free(d), free(o), free(qf), free(kf), free(vf);
}
static void emu_gelu_forward(void *out, const void *inp, size_t n) {
    float *o = xmalloc((n ? n : 1) * sizeof(float)), *x = emu_wide(inp, n);
    backend_cpu.gelu_forward(o, x, n);
    emu_store(out, o, n);
    free(x);
}
static void emu_gelu_backward(void *dinp, const void *inp, const void *dout, size_t n) {
    float *di = xmalloc((n ? n : 1) * sizeof(float)), *x = emu_wide(inp, n), *d = emu_wide(dout, n);
    backend_cpu.gelu_backward(di, x, d, n);
    emu_store(dinp, di, n);
    free(x), free(d);
}
static void emu_residual_forward(void *out, const void *a, const void *b, size_t n) {
    float *o = xmalloc((n ? n : 1) * sizeof(float)), *x = emu_wide(a, n), *y = emu_wide(b, n);
    backend_cpu.add(o, x, y, n);
    emu_store(out, o, n);
    free(x), free(y);
}
static void emu_crossentropy_forward(void *logits, float *losses, const int32_t *targets, int N, int V, int Vp,
                                     float dloss) {
    size_t n = (size_t)N * Vp;
    float *x = emu_wide(logits, n);
    backend_cpu.crossentropy_forward(x, losses, targets, N, V, Vp, dloss);
    if (dloss != 0.0f) emu_store(logits, x, n); /* dloss 0 leaves the logits untouched */
    else free(x);
}

static void emu_xent_partial(float *stats, const void *logits, const int32_t *targets, int N, int V, int Vp) {
    float *x = emu_wide(logits, (size_t)N * Vp);
    backend_cpu.xent_partial(stats, x, targets, N, V, Vp);
    free(x);
}
static void emu_xent_finish(void *logits, float *losses, const float *stats_all, int P, const int32_t *targets,
                            int N, int V, int Vp, float dloss) {
    size_t n = (size_t)N * Vp;
    float *x = emu_wide(logits, n);
    backend_cpu.xent_finish(x, losses, stats_all, P, targets, N, V, Vp, dloss);
    if (dloss != 0.0f) emu_store(logits, x, n);
    else free(x);
}

/* An fp32 output buffer of n (>= 1) floats. */
static float *emu_floats(size_t n) { return xmalloc((n ? n : 1) * sizeof(float)); }

static void emu_rmsnorm_forward(void *out, float *rstd, const void *inp, const void *w, int N, int C, float eps) {
    size_t NC = (size_t)N * C;
    float *o = xmalloc(NC * sizeof(float)), *x = emu_wide(inp, NC), *wf = emu_wide(w, C);
    backend_cpu.rmsnorm_forward(o, rstd, x, wf, N, C, eps);
    emu_store(out, o, NC);
    free(x), free(wf);
}
static void emu_rmsnorm_backward(void *dinp, float *dw, const void *dout, const void *inp, const void *w,
                                 const float *rstd, int N, int C, int accumulate) {
    size_t NC = (size_t)N * C;
    float *di = emu_wide(dinp, NC), *d = emu_wide(dout, NC), *x = emu_wide(inp, NC), *wf = emu_wide(w, C);
    backend_cpu.rmsnorm_backward(di, dw, d, x, wf, rstd, N, C, accumulate);
    emu_store(dinp, di, NC);
    free(d), free(x), free(wf);
}
/* The CPU's fused op works on fp32 sums, not on res rounded to bf16: the
 * composition of this backend's own ops is the contract (backend.h). */
static void emu_residual_norm_forward(void *res, void *out, float *mean, float *rstd, const void *a, const void *b,
                                      const void *w, const void *bias, int N, int C, float eps) {
    emu_residual_forward(res, a, b, (size_t)N * C);
    if (mean) emu_layernorm_forward(out, mean, rstd, res, w, bias, N, C, eps);
    else emu_rmsnorm_forward(out, rstd, res, w, N, C, eps);
}
static void emu_rope_forward(void *qkv, const float *rope, const AttnShape *sh, int pos0) {
    size_t n = (size_t)sh->B * sh->T * attn_qkv_width(sh);
    float *q = emu_wide(qkv, n);
    backend_cpu.rope_forward(q, rope, sh, pos0);
    emu_store(qkv, q, n);
}
static void emu_rope_backward(void *dqkv, const float *rope, const AttnShape *sh, int pos0) {
    size_t n = (size_t)sh->B * sh->T * attn_qkv_width(sh);
    float *q = emu_wide(dqkv, n);
    backend_cpu.rope_backward(q, rope, sh, pos0);
    emu_store(dqkv, q, n);
}
/* QK-norm weights: HD each (per_head) or NH HD and NKV HD. */
static size_t emu_qk_wq(const AttnShape *sh, int per_head) { return (size_t)(per_head ? 1 : sh->NH) * sh->HD; }
static size_t emu_qk_wk(const AttnShape *sh, int per_head) { return (size_t)(per_head ? 1 : sh->NKV) * sh->HD; }
static void emu_qknorm_forward(void *qkv, void *qk_in, float *rstd, const void *qw, const void *kw,
                               const AttnShape *sh, int per_head, float eps) {
    size_t N = (size_t)sh->B * sh->T, n = N * attn_qkv_width(sh), ni = N * (sh->NH + sh->NKV) * sh->HD;
    float *q = emu_wide(qkv, n), *in = xmalloc(ni * sizeof(float));
    float *qwf = emu_wide(qw, emu_qk_wq(sh, per_head)), *kwf = emu_wide(kw, emu_qk_wk(sh, per_head));
    backend_cpu.qknorm_forward(q, in, rstd, qwf, kwf, sh, per_head, eps);
    emu_store(qkv, q, n);
    emu_store(qk_in, in, ni);
    free(qwf), free(kwf);
}
static void emu_qknorm_backward(void *dqkv, float *dqw, float *dkw, const void *qk_in, const void *qw,
                                const void *kw, const float *rstd, const AttnShape *sh, int per_head,
                                int accumulate) {
    size_t N = (size_t)sh->B * sh->T, n = N * attn_qkv_width(sh), ni = N * (sh->NH + sh->NKV) * sh->HD;
    float *d = emu_wide(dqkv, n), *in = emu_wide(qk_in, ni);
    float *qwf = emu_wide(qw, emu_qk_wq(sh, per_head)), *kwf = emu_wide(kw, emu_qk_wk(sh, per_head));
    backend_cpu.qknorm_backward(d, dqw, dkw, in, qwf, kwf, rstd, sh, per_head, accumulate);
    emu_store(dqkv, d, n);
    free(in), free(qwf), free(kwf);
}
static void emu_swiglu_forward(void *out, const void *h, int N, int F) {
    size_t NF = (size_t)N * F;
    float *o = emu_floats(NF), *x = emu_wide(h, 2 * NF);
    backend_cpu.swiglu_forward(o, x, N, F);
    emu_store(out, o, NF);
    free(x);
}
static void emu_swiglu_backward(void *dh, const void *dout, const void *h, int N, int F) {
    size_t NF = (size_t)N * F;
    float *dx = emu_floats(2 * NF), *d = emu_wide(dout, NF), *x = emu_wide(h, 2 * NF);
    backend_cpu.swiglu_backward(dx, d, x, N, F);
    emu_store(dh, dx, 2 * NF);
    free(d), free(x);
}
static void emu_moe_route(int32_t *topk, float *gates, float *probs, float *stats, const void *logits,
                          const float *bias, int N, int S, int E, int K, int sigmoid, int norm_topk) {
    float *x = emu_wide(logits, (size_t)N * E);
    backend_cpu.moe_route(topk, gates, probs, stats, x, bias, N, S, E, K, sigmoid, norm_topk);
    free(x);
}
/* Permuted rows referenced by row_of (N,K): 1 + the largest. */
static size_t emu_moe_rows(const int32_t *row_of, int N, int K) {
    int32_t r = -1;
    for (size_t i = 0; i < (size_t)N * K; i++) r = row_of[i] > r ? row_of[i] : r;
    return (size_t)(r + 1);
}
static void emu_moe_gather(void *xp, const void *x, const int32_t *src, int R, int C) {
    int rows = 0;
    for (int r = 0; r < R; r++) rows = src[r] + 1 > rows ? src[r] + 1 : rows; /* x rows read */
    float *o = emu_floats((size_t)R * C), *xf = emu_wide(x, (size_t)rows * C);
    backend_cpu.moe_gather(o, xf, src, R, C);
    emu_store(xp, o, (size_t)R * C);
    free(xf);
}
static void emu_moe_gather_backward(void *dx, const void *dxp, const int32_t *row_of, int N, int K, int C) {
    size_t R = emu_moe_rows(row_of, N, K);
    float *d = emu_wide(dx, (size_t)N * C), *dp = emu_wide(dxp, R * C);
    backend_cpu.moe_gather_backward(d, dp, row_of, N, K, C);
    emu_store(dx, d, (size_t)N * C);
    free(dp);
}
static void emu_moe_combine(void *out, const void *yp, const float *gates, const int32_t *row_of, int N, int K,
                            int C) {
    size_t R = emu_moe_rows(row_of, N, K);
    float *o = emu_floats((size_t)N * C), *y = emu_wide(yp, R * C);
    backend_cpu.moe_combine(o, y, gates, row_of, N, K, C);
    emu_store(out, o, (size_t)N * C);
    free(y);
}
static void emu_moe_combine_backward(void *dyp, float *dgates, const void *dout, const void *yp, const float *gates,
                                     const int32_t *row_of, int N, int K, int C) {
    size_t R = emu_moe_rows(row_of, N, K);
    /* rows no slot references are not written: start from what dyp holds */
    float *dy = emu_wide(dyp, R * C), *d = emu_wide(dout, (size_t)N * C), *y = emu_wide(yp, R * C);
    backend_cpu.moe_combine_backward(dy, dgates, d, y, gates, row_of, N, K, C);
    emu_store(dyp, dy, R * C);
    free(d), free(y);
}
static void emu_moe_route_backward(void *dlogits, const float *dgates, const float *probs, const int32_t *topk,
                                   const float *gates, const void *logits, const float *aux, float z_coef, int N,
                                   int S, int E, int K, int sigmoid, int norm_topk) {
    size_t NE = (size_t)N * E;
    float *dl = emu_floats(NE), *x = emu_wide(logits, NE);
    backend_cpu.moe_route_backward(dl, dgates, probs, topk, gates, x, aux, z_coef, N, S, E, K, sigmoid, norm_topk);
    emu_store(dlogits, dl, NE);
    free(x);
}

/* The CPU backend's table with the act ops above; memory, fp32 ops as is. */
/* fp8: the CPU's host reference on the widened values, the result rounded
 * once to bf16 (cuda/fp8.cu's contract). */
static void emu_fp8_amax(float *amax, const void *x, int rows, int cols, int axis) {
    float *f = emu_wide(x, (size_t)rows * cols);
    backend_cpu.fp8_amax(amax, f, rows, cols, axis);
    free(f);
}
static void emu_fp8_qdq(void *y, const void *x, const float *amax, int P, int rows, int cols, int axis, int fmt,
                        int pow2) {
    float *f = emu_wide(x, (size_t)rows * cols);
    backend_cpu.fp8_qdq(f, f, amax, P, rows, cols, axis, fmt, pow2);
    emu_store(y, f, (size_t)rows * cols);
}

/* The updates' compute copy (backend.h adamw_update's copy) is bf16 here:
 * the CPU's update without it, then the cast (skipped with the update). */
static int emu_copy_due(const StepScalars *st, void *copy) { return copy && !(st && st->skip); }
static void emu_adamw_update(float *params, const float *grads, float *m, float *v, size_t n, float lr, float beta1,
                             float beta2, float eps, float wd, float grad_scale, int t, const StepScalars *st,
                             void *copy) {
    backend_cpu.adamw_update(params, grads, m, v, n, lr, beta1, beta2, eps, wd, grad_scale, t, st, NULL);
    if (emu_copy_due(st, copy)) emu_cast_to_act(copy, params, n);
}
static void emu_adamw_update_bf16(float *params, const float *grads, uint16_t *m, uint16_t *v, size_t n, float lr,
                                  float beta1, float beta2, float eps, float wd, float grad_scale, int t,
                                  uint64_t seed, uint64_t idx0, const StepScalars *st, void *copy) {
    backend_cpu.adamw_update_bf16(params, grads, m, v, n, lr, beta1, beta2, eps, wd, grad_scale, t, seed, idx0, st,
                                  NULL);
    if (emu_copy_due(st, copy)) emu_cast_to_act(copy, params, n);
}
static void emu_lion_update(float *params, const float *grads, float *m, size_t n, float lr, float beta1, float beta2,
                            float wd, float grad_scale, const StepScalars *st, void *copy) {
    backend_cpu.lion_update(params, grads, m, n, lr, beta1, beta2, wd, grad_scale, st, NULL);
    if (emu_copy_due(st, copy)) emu_cast_to_act(copy, params, n);
}

static Backend emu_bf16_backend(void) {
    Backend b = backend_cpu;
    b.name = "emu_bf16";
    b.act_bytes = emu_act_bytes;
    b.cast_to_act = emu_cast_to_act;
    b.embed_forward = emu_embed_forward;
    b.embed_backward = emu_embed_backward;
    b.layernorm_forward = emu_layernorm_forward;
    b.layernorm_backward = emu_layernorm_backward;
    b.matmul_forward = emu_matmul_forward;
    b.matmul_backward = emu_matmul_backward;
    b.fp8_amax = emu_fp8_amax;
    b.fp8_qdq = emu_fp8_qdq;
    b.attention_forward = emu_attention_forward;
    b.attention_backward = emu_attention_backward;
    b.attention_block_forward = emu_attention_block_forward;
    b.attention_block_backward = emu_attention_block_backward;
    b.gelu_forward = emu_gelu_forward;
    b.gelu_backward = emu_gelu_backward;
    b.rmsnorm_forward = emu_rmsnorm_forward;
    b.rmsnorm_backward = emu_rmsnorm_backward;
    b.rope_forward = emu_rope_forward;
    b.rope_backward = emu_rope_backward;
    b.qknorm_forward = emu_qknorm_forward;
    b.qknorm_backward = emu_qknorm_backward;
    b.swiglu_forward = emu_swiglu_forward;
    b.swiglu_backward = emu_swiglu_backward;
    b.moe_route = emu_moe_route; /* moe_dispatch: indices only, the CPU's */
    b.moe_gather = emu_moe_gather;
    b.moe_gather_backward = emu_moe_gather_backward;
    b.moe_combine = emu_moe_combine;
    b.moe_combine_backward = emu_moe_combine_backward;
    b.moe_route_backward = emu_moe_route_backward;
    b.residual_forward = emu_residual_forward;
    b.residual_norm_forward = emu_residual_norm_forward;
    b.crossentropy_forward = emu_crossentropy_forward;
    b.xent_partial = emu_xent_partial;
    b.xent_finish = emu_xent_finish;
    b.adamw_update = emu_adamw_update;
    b.adamw_update_bf16 = emu_adamw_update_bf16;
    b.lion_update = emu_lion_update;
    return b;
}

#endif
