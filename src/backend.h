/* backend: the one place where the CPU and CUDA backends meet the host program.
 * A Backend is a table of functions on opaque device pointers; host code calls
 * through it and never asks which backend it has (STYLE.md rule 6).
 *
 * Shapes: B batch, T time, C channels, NH heads, hs = C/NH, N = B*T rows,
 * V vocabulary, Vp padded vocabulary, OC output channels. Row-major everywhere.
 * Weights of matrix products are (OC, C), as torch.nn.Linear stores them, and
 * out = inp @ w^T + bias.
 *
 * Gradient convention: an op's `accumulate` flag says whether parameter
 * gradients are added to (1) or overwrite (0) what the buffer holds; the first
 * micro-batch of an optimizer step passes 0, so gradients never need zeroing.
 * Input gradients (dinp) are overwritten unless the op says "+=". */
#ifndef KILN_BACKEND_H
#define KILN_BACKEND_H

#include <stddef.h>
#include <stdint.h>

typedef struct Backend {
    const char *name; /* "cpu", "cuda" */
    /* 1 if device pointers are host memory (the CPU backend): host MPI
     * collectives can then work on the arenas in place (data parallelism). */
    int host_mem;

    /* Start-up: threads is the CPU thread count (0 = all cores). Returns a
     * one-line description (device, library versions) for logs and --version. */
    const char *(*init)(int threads);
    void (*shutdown)(void);

    /* Memory. alloc returns zeroed device memory or fails the run (exit 1). */
    void *(*alloc)(size_t bytes);
    void (*free)(void *p);
    void (*to_device)(void *dst, const void *src, size_t bytes);
    void (*to_host)(void *dst, const void *src, size_t bytes);
    void (*copy)(void *dst, const void *src, size_t bytes); /* device to device */
    void (*zero)(void *dst, size_t bytes);
    void (*sync)(void);

    /* out(N,C) = wte[tokens] + wpe[t] */
    void (*embed_forward)(float *out, const int32_t *tokens, const float *wte, const float *wpe,
                          int B, int T, int C);
    /* dwte(Vp,C) += scatter of dout by token (always accumulates: the tied head
     * writes dwte first); dwpe(T,C) per `accumulate`. */
    void (*embed_backward)(float *dwte, float *dwpe, const float *dout, const int32_t *tokens,
                           int B, int T, int C, int accumulate);

    /* out(N,C) = (inp - mean) * rstd * w + b; mean, rstd (N) saved for backward. */
    void (*layernorm_forward)(float *out, float *mean, float *rstd, const float *inp,
                              const float *w, const float *b, int N, int C);
    /* dinp(N,C) += ; dw, db (C) per `accumulate`. */
    void (*layernorm_backward)(float *dinp, float *dw, float *db, const float *dout,
                               const float *inp, const float *w, const float *mean,
                               const float *rstd, int N, int C, int accumulate);

    /* out(N,OC) = inp(N,C) @ w(OC,C)^T + bias(OC); bias may be NULL. */
    void (*matmul_forward)(float *out, const float *inp, const float *w, const float *bias,
                           int N, int C, int OC);
    /* dinp(N,C) = dout @ w (skipped if NULL); dw(OC,C), dbias(OC) per
     * `accumulate` (dbias may be NULL). */
    void (*matmul_backward)(float *dinp, float *dw, float *dbias, const float *dout,
                            const float *inp, const float *w, int N, int C, int OC,
                            int accumulate);

    /* Causal multi-head attention. qkv(N,3C) holds [q | k | v], head h in
     * columns h*hs..(h+1)*hs of each; out(N,C); lse(B,NH,T) is the log-sum-exp
     * of each softmax row (scaled scores), kept for the backward pass so no
     * (T,T) matrix need be stored. */
    void (*attention_forward)(float *out, float *lse, const float *qkv, int B, int T, int C,
                              int NH);
    /* dqkv(N,3C) = gradient of the above. */
    void (*attention_backward)(float *dqkv, const float *dout, const float *qkv, const float *out,
                               const float *lse, int B, int T, int C, int NH);

    /* GeLU, tanh approximation (GPT-2). */
    void (*gelu_forward)(float *out, const float *inp, size_t n);
    void (*gelu_backward)(float *dinp, const float *inp, const float *dout, size_t n);

    /* out = a + b. */
    void (*add)(float *out, const float *a, const float *b, size_t n);

    /* Softmax + cross-entropy over the first V of Vp columns, fused.
     * losses(N) = -log softmax(logits)[target]. If dloss != 0, logits(N,Vp) is
     * overwritten in place by dlogits = (softmax - onehot) * dloss, with zeros
     * in the padded columns. targets(N) must be in [0, V). */
    void (*crossentropy_forward)(float *logits, float *losses, const int32_t *targets, int N,
                                 int V, int Vp, float dloss);

    /* AdamW on a contiguous range: p -= lr * (mhat / (sqrt(vhat) + eps) + wd * p),
     * with g = grad * grad_scale, bias corrections for step t (1-based). */
    void (*adamw_update)(float *params, const float *grads, float *m, float *v, size_t n,
                         float lr, float beta1, float beta2, float eps, float weight_decay,
                         float grad_scale, int t);

    /* Sum of squares in double; NaN or Inf in x makes the result non-finite. */
    double (*sumsq)(const float *x, size_t n);

    /* Optional hooks; NULL where a backend has no such notion (the CPU).
     * set_precision: precision.compute, called once after init: "fp32" (strict
     * fp32 products) or "bf16" (matrix products on bf16 tensor cores from the
     * fp32 data, fp32 accumulation). Storage stays fp32 either way.
     * memory_peak: the most device memory in use since init, in bytes.
     * stream: the stream (cudaStream_t) every op of the backend runs on, in
     * order; comm orders NCCL collectives against it (comm.h,
     * comm_nccl_device_mode). */
    void (*set_precision)(const char *compute);
    size_t (*memory_peak)(void);
    void *(*stream)(void);
    /* select_device: before init, the rank's index among the ranks of its
     * host and their count (one process per device: local rank r uses
     * device r, or the only visible one). */
    void (*select_device)(int local_rank, int local_world);
} Backend;

/* The CPU backend (always present). */
extern const Backend backend_cpu;

/* Look up a backend by name ("cpu", "cuda", "auto"); NULL if not compiled in. */
const Backend *backend_get(const char *name);

/* The backends this build holds, e.g. "cpu, cuda" (for --version). */
const char *backend_list(void);
/* One line per compiled-in accelerator backend naming the library versions
 * it was built against; "" when there is none. Needs no GPU or driver. */
const char *backend_build_info(void);
/* Nonzero if the named backend is compiled in and can run here (a GPU and a
 * driver for "cuda"). */
int backend_available(const char *name);

#endif
