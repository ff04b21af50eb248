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
static void emu_embed_backward(float *dwte, float *dwpe, const void *dout, const int32_t *tokens, int B, int T,
                               int C, int accumulate) {
    float *d = emu_wide(dout, (size_t)B * T * C);
    backend_cpu.embed_backward(dwte, dwpe, d, tokens, B, T, C, accumulate);
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

/* The CPU backend's table with the act ops above; memory, fp32 ops as is. */
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
    b.attention_forward = emu_attention_forward;
    b.attention_backward = emu_attention_backward;
    b.gelu_forward = emu_gelu_forward;
    b.gelu_backward = emu_gelu_backward;
    b.residual_forward = emu_residual_forward;
    b.crossentropy_forward = emu_crossentropy_forward;
    return b;
}

#endif
