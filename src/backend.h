/* backend: the one place where the CPU and CUDA backends meet the host program.
 * A Backend is a table of functions on opaque device pointers; host code calls
 * through it and never asks which backend it has (STYLE.md rule 6).
 *
 * Shapes: B batch, T time, C channels, NH heads, hs = C/NH, N = B*T rows,
 * V vocabulary, Vp padded vocabulary, OC output channels. Row-major everywhere.
 * Weights of matrix products are (OC, C), as torch.nn.Linear stores them, and
 * out = inp @ w^T + bias.
 *
 * Dtypes. Every tensor is one of two kinds, stated at each argument:
 *  - "act": the activation dtype, whose element size act_bytes() gives once
 *    set_precision has run: 4 (fp32) on the CPU and on CUDA with
 *    precision.compute fp32, 2 (bf16) on CUDA with bf16. Activations, their
 *    gradients (dinp, dout, dqkv, dlogits) and the compute copy of the
 *    parameters that ops read (w, bias, wte, ...) are act; they travel as
 *    void * so no host code can do float arithmetic on them by mistake.
 *  - fp32 (float *): statistics (LayerNorm mean/rstd, attention lse, losses),
 *    parameter gradients (dw, dbias, dwte, ...: accumulated in fp32 whatever
 *    act is), the fp32 master parameters and optimizer state (adamw_update,
 *    sumsq, add); the AdamW moments may instead be bf16 (adamw_update_bf16),
 *    and with precision.master bf16 the parameters themselves are bf16 bits
 *    (adamw_update_p16: no fp32 master; the compute copy is the parameters).
 * Arithmetic inside an op is fp32 with fp32 accumulation on every backend;
 * act only changes what is loaded and stored (bf16 stores round to nearest
 * even). Host code sizes act buffers with act_bytes() and converts with
 * backend_f32_to_act / backend_act_to_f32 below.
 *
 * Gradient convention: an op's `accumulate` flag says whether parameter
 * gradients are added to (1) or overwrite (0) what the buffer holds; the first
 * micro-batch of an optimizer step passes 0, so gradients never need zeroing.
 * Input gradients (dinp) are overwritten unless the op says "+=". */
#ifndef KILN_BACKEND_H
#define KILN_BACKEND_H

#include <stddef.h>
#include <stdint.h>

/* The shape of one attention call: B sequences of T tokens, NH query heads
 * and NKV key/value heads (NKV divides NH: NKV = NH is multi-head, 1
 * multi-query), HD dims per head. doc (document masking, data.doc_masking):
 * NULL is plain causal attention; else int32 (B, T) device memory, the
 * position where each row's document starts, nondecreasing along a
 * sequence: row (b, i) sees keys j with doc[b T + i] <= j <= i (a
 * block-diagonal causal mask). Under context parallelism the rows are the
 * rank's chunks and doc holds global positions (cp.c reads it). */
typedef struct AttnShape {
    int B, T, NH, NKV, HD;
    const int32_t *doc;
} AttnShape;

/* Row width of the qkv buffer: (NH + 2 NKV) HD. */
static inline int attn_qkv_width(const AttnShape *s) { return (s->NH + 2 * s->NKV) * s->HD; }

/* One block of attention under context parallelism (cp.c): for each of B
 * sequences, Tq queries at global positions q_pos .. q_pos + Tq - 1 against
 * Tk keys and values at k_pos .. k_pos + Tk - 1; a query sees the keys at
 * positions <= its own (causal at global positions), so a block may be
 * whole, triangular or partly empty. Heads as AttnShape (NH over NKV, HD
 * dims). Row (b, i) of q is q + (b Tq + i) q_ld elements, query head h at
 * column h HD; row (b, j) of k and of v is k (v) + (b Tk + j) kv_ld, kv head
 * g at column g HD: q may point into a qkv buffer (q_ld = its width) and k,
 * v into a packed [k | v] one. out and dout rows are NH HD wide, (B Tq) rows. */
typedef struct AttnBlock {
    int B, NH, NKV, HD;
    int Tq, Tk;       /* queries and keys per sequence */
    int q_pos, k_pos; /* global positions of the first query and the first key */
    int q_ld, kv_ld;  /* row strides (elements) of q, and of k and v */
    /* NULL, or int32 (B, Tq) device: the global position where each query's
     * document starts (nondecreasing along a sequence); query i then sees
     * the keys at global positions in [q_doc[b Tq + i], q_pos + i]. */
    const int32_t *q_doc;
} AttnBlock;

/* One training step's scalars, in device memory (optim.h
 * optim_step_device), so that a step needs no host wait before its update:
 * the micro-batches' mean losses and the gradients' sum of squares
 * accumulate into it (loss_acc, sumsq_acc), step_scalars derives the norm,
 * the clipping factor and the skip flag from them (src/clip.h's rule, the
 * host's), the optimizer updates read scale and skip from it, and the host
 * reads the whole struct once, at the step's end. Zero at a step's start. */
typedef struct StepScalars {
    double loss;     /* sum of the micro-batches' mean losses, each rounded to float first (loss_acc) */
    double sumsq;    /* the gradients' sum of squares (sumsq_acc) */
    double norm;     /* sqrt(sumsq) */
    float loss_mean; /* (float)(loss / micro-batches) */
    float scale;     /* the clipping factor the updates apply: 1 without clipping or when skipped */
    int32_t skip;    /* 1: the norm or loss_mean is not finite, and the updates change nothing */
    int32_t pad;
} StepScalars;

/* One fp8 cast (backend.h fp8_cast): the E4M3/E5M2 codes (src/fp8.h) of x
 * (rows, cols) act times its scales, written in one pass over x as q
 * (rows, cols) and/or its transpose qt (cols, rows) (Hopper's fp8 products
 * take only K-major operands, so a product contracting over x's rows needs
 * x^T). A scale is s = fp8_scale(a, fmt, pow2) of a = the max over the P
 * rows of an amax (P, n) fp32 (the tp and cp ranks' amaxes, or a
 * delayed-scaling history), as fp8_qdq's; inv = 1 / s is what the product
 * multiplies by. rowwise 0: one scale (amax_q, n 1) for q and qt; rowwise 1:
 * q per row of x (amax_q (P_q, rows)) and qt per column of x, i.e. per row
 * of qt (amax_t (P_t, cols)). */
typedef struct Fp8Cast {
    uint8_t *q, *qt;                 /* (rows, cols), (cols, rows) codes; either may be NULL */
    float *inv_q, *inv_t;            /* device fp32 (1) or (rows), (1) or (cols): 1 / scale; NULL with q, qt */
    const float *amax_q, *amax_t;    /* device fp32 (P_q, n), (P_t, cols); amax_t unused unless rowwise */
    int P_q, P_t;
    int rowwise, fmt, pow2;          /* Fp8Format fmt */
    float *amax_out; /* NULL, or device fp32 (1): max |x| (tensorwise), from the same pass (delayed scaling) */
} Fp8Cast;

/* One fp8 product (backend.h fp8_matmul): out (N, M) = sum over k of
 * b[n][k] sb[n] a[m][k] sa[m] (+ bias[m]) (+ out with accumulate), fp32
 * accumulation; a (M, K) codes of fmt_a and b (N, K) of fmt_b, both K-major
 * (the "TN" layout, the only one Hopper's fp8 kernels take), not both E5M2;
 * N, K, M multiples of 16. sa, sb: device fp32 inverse scales (Fp8Cast's
 * inv), one each, or with rowwise sa (M) and sb (N) (cuBLASLt's outer-
 * vector scales). out: act, or fp32 with out_f32 (a weight gradient, which
 * accumulate adds to, as matmul_backward's dw). */
typedef struct Fp8Matmul {
    void *out;
    const uint8_t *a, *b;
    const float *sa, *sb;
    int fmt_a, fmt_b, rowwise;
    const void *bias; /* (M) act or NULL; act out only */
    int out_f32, accumulate;
    int N, K, M;
} Fp8Matmul;

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
    /* rows of `width` bytes, device to device, the starts `dpitch` and
     * `spitch` bytes apart (cudaMemcpy2D): packs k | v columns out of qkv rows, places a tp part's column block in its matrix
     * (muon.c) */
    void (*copy_2d)(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t rows);
    void (*zero)(void *dst, size_t bytes);
    void (*sync)(void);

    /* Element size of the activation dtype (see the top): 4 or 2. Fixed by
     * set_precision, which must run before any act buffer is allocated. */
    size_t (*act_bytes)(void);
    /* dst(n) act = src(n) fp32, rounded to nearest even (a copy when act is
     * fp32): refreshes the compute copy of the parameters from the master. */
    void (*cast_to_act)(void *dst, const float *src, size_t n);

    /* out(N,C) act = wte[tokens] + wpe[t]; wte (Vp,C), wpe (T,C) act; wpe
     * NULL: no learned positions (RoPE), out = wte[tokens]. A negative token
     * id reads a zero row (vocabulary-parallel embeddings: another tp rank
     * holds that token's row), so out = wpe[t] or 0. */
    void (*embed_forward)(void *out, const int32_t *tokens, const void *wte, const void *wpe,
                          int B, int T, int C);
    /* dwte(Vp,C) fp32 += scatter of dout (N,C) act by token (always
     * accumulates: the tied head writes dwte first; negative token ids add
     * nothing); dwpe(T,C) fp32 per `accumulate`, or NULL (no learned positions).
     * tokens_host: NULL, or the same N ids in host memory, so a backend that
     * plans the scatter on the host (CUDA) need not read them back, which
     * would wait for the device. */
    void (*embed_backward)(float *dwte, float *dwpe, const void *dout, const int32_t *tokens,
                           const int32_t *tokens_host, int B, int T, int C, int accumulate);

    /* out(N,C) act = (inp - mean) * rstd * w + b, rstd = 1/sqrt(var + eps)
     * (biased variance, as torch.nn.LayerNorm); inp (N,C), w, b (C) act, b
     * may be NULL (model.bias false); mean, rstd (N) fp32 saved for backward. */
    void (*layernorm_forward)(void *out, float *mean, float *rstd, const void *inp,
                              const void *w, const void *b, int N, int C, float eps);
    /* dinp(N,C) act +=; dw, db (C) fp32 per `accumulate` (db may be NULL);
     * dout, inp (N,C), w (C) act; mean, rstd (N) fp32. */
    void (*layernorm_backward)(void *dinp, float *dw, float *db, const void *dout,
                               const void *inp, const void *w, const float *mean,
                               const float *rstd, int N, int C, int accumulate);

    /* RMSNorm (Llama): out(N,C) act = inp * rstd * w, rstd(N) fp32 =
     * 1/sqrt(mean(inp^2) + eps), saved for backward; inp (N,C), w (C) act.
     * Computed in fp32 whatever act is, as HF's LlamaRMSNorm does. */
    void (*rmsnorm_forward)(void *out, float *rstd, const void *inp, const void *w, int N, int C,
                            float eps);
    /* dinp(N,C) act +=; dw(C) fp32 per `accumulate`; dout, inp (N,C), w (C)
     * act; rstd (N) fp32 from the forward. */
    void (*rmsnorm_backward)(void *dinp, float *dw, const void *dout, const void *inp, const void *w,
                             const float *rstd, int N, int C, int accumulate);

    /* out(N,OC) act = inp(N,C) @ w(OC,C)^T + bias(OC), all act; bias may be NULL. */
    void (*matmul_forward)(void *out, const void *inp, const void *w, const void *bias,
                           int N, int C, int OC);
    /* dinp(N,C) act = dout @ w; dw(OC,C), dbias(OC) fp32 per `accumulate`;
     * each of the three skipped if NULL (a pipeline's split backward computes
     * dinp in one call and dw, dbias in a later one); dout (N,OC), inp (N,C),
     * w (OC,C) act. */
    void (*matmul_backward)(void *dinp, float *dw, float *dbias, const void *dout,
                            const void *inp, const void *w, int N, int C, int OC,
                            int accumulate);

    /* Causal attention with grouped K/V heads (AttnShape below). qkv(N, QKVW)
     * act holds per row [q heads | k heads | v heads], QKVW = (NH + 2 NKV) HD,
     * head h of q in columns h*HD..(h+1)*HD; query head h reads kv head
     * h / (NH / NKV); scores are scaled by 1/sqrt(HD). out(N, NH HD) act;
     * lse(B,NH,T) fp32 is the log-sum-exp of each softmax row (scaled
     * scores), kept for the backward pass so no (T,T) matrix need be stored.
     * GPT-2 is NKV = NH, HD = C / NH. */
    void (*attention_forward)(void *out, float *lse, const void *qkv, const AttnShape *s);
    /* dqkv(N, QKVW) act = gradient of the above (overwritten; a kv head's
     * gradient sums over the query heads that read it); dout, out (N, NH HD) act. */
    void (*attention_backward)(void *dqkv, const void *dout, const void *qkv, const void *out,
                               const float *lse, const AttnShape *s);

    /* Block attention (AttnBlock above), the pieces context parallelism
     * builds whole-sequence attention from. out(B Tq, NH HD) act, lse(B, NH,
     * Tq) fp32 (scaled scores, as attention_forward's); q, k, v act.
     * merge 0: out, lse = this block's attention; a query that sees no key of
     * the block gets out 0, lse -inf. merge 1: out, lse hold the attention of
     * the same queries over other keys, and become that over both:
     *   lse' = log(e^lse + e^lse_b), out' = e^(lse - lse') out + e^(lse_b - lse') out_b,
     * so merging blocks in any order gives the attention over their union. */
    void (*attention_block_forward)(void *out, float *lse, const void *q, const void *k, const void *v,
                                    const AttnBlock *s, int merge);
    /* The backward of one block, given the final out and lse of its queries
     * (merged over every key block: then p = exp(score - lse) is the true
     * probability and the blocks' gradients add up): dq += (rows as q, ld
     * q_ld), dk += and dv += (rows as k, ld kv_ld), all fp32, so the sums over
     * blocks and ranks round once; dout, out (B Tq, NH HD) act; lse fp32. */
    void (*attention_block_backward)(float *dq, float *dk, float *dv, const void *dout, const void *q,
                                     const void *k, const void *v, const void *out, const float *lse,
                                     const AttnBlock *s);

    /* Rotary position embedding on the q and k heads of qkv (N, QKVW) act,
     * in place, rotate-half layout (HF's Llama: no interleaving): for a head
     * vector x and i < HD/2, j = i + HD/2, with c = cs[t][i], s = sn[t][i]:
     *   x_i' = x_i c - x_j s,   x_j' = x_j c + x_i s.
     * The table rope (Tmax, 2, HD/2) fp32, made by the model, holds for each
     * position p its HD/2 cosines then its HD/2 sines (per position, so the op
     * needs no Tmax: row r reads position p = pos0 + r % T; pos0 = 0 for a
     * whole sequence, the shard's first position under context parallelism).
     * With s->doc (data.doc_positions reset) positions restart at each
     * document: row r's is pos0 + r % T - doc[r] (doc holds global
     * positions, as for attention). v is untouched. rope_backward applies the inverse rotation (angle -a):
     * on dqkv it turns gradients of rotated q, k into gradients of the
     * unrotated ones, in place. */
    void (*rope_forward)(void *qkv, const float *rope, const AttnShape *s, int pos0);
    void (*rope_backward)(void *dqkv, const float *rope, const AttnShape *s, int pos0);

    /* QK-norm: RMSNorm of q and k in qkv (N, QKVW) act, in place, before
     * RoPE. per_head 1 (Qwen3): each head's HD values are one group, weights
     * qw, kw (HD) act; per_head 0 (OLMoE): all NH HD q values of a row are
     * one group (qw (NH HD)) and all NKV HD k values another (kw (NKV HD)).
     * qk_in (N, (NH + NKV) HD) act receives the values before the norm (q
     * then k), rstd (N, G) fp32 the statistics, G = NH + NKV groups per row
     * (per_head) or 2. */
    void (*qknorm_forward)(void *qkv, void *qk_in, float *rstd, const void *qw, const void *kw,
                           const AttnShape *s, int per_head, float eps);
    /* dqkv's q and k parts, gradients of the normalised values on entry,
     * become gradients of the values before the norm, in place (v untouched);
     * dqw, dkw fp32 per `accumulate`; qk_in, rstd from the forward. */
    void (*qknorm_backward)(void *dqkv, float *dqw, float *dkw, const void *qk_in, const void *qw,
                            const void *kw, const float *rstd, const AttnShape *s, int per_head,
                            int accumulate);

    /* GeLU, tanh approximation (GPT-2); every tensor act (n). */
    void (*gelu_forward)(void *out, const void *inp, size_t n);
    void (*gelu_backward)(void *dinp, const void *inp, const void *dout, size_t n);

    /* SwiGLU (Llama's MLP): h(N, 2F) act holds per row [gate (F) | up (F)]
     * (one product with gate_proj's rows then up_proj's); out(N,F) act =
     * silu(gate) * up, silu(x) = x / (1 + exp(-x)). */
    void (*swiglu_forward)(void *out, const void *h, int N, int F);
    /* dh(N,2F) act = gradient of the above w.r.t. h; dout (N,F), h (N,2F) act. */
    void (*swiglu_backward)(void *dh, const void *dout, const void *h, int N, int F);

    /* Mixture of experts (model.mlp moe; docs/architectures.md). Routing is
     * deterministic: ties between equal scores go to the lower expert index.
     * The N rows are N / S sequences of S tokens (S divides N): statistics,
     * loads and capacity are per sequence, so they do not depend on how
     * sequences are grouped into micro-batches and ranks.
     *
     * moe_route: logits (N,E) act from the router product. probs (N,E) fp32 =
     * softmax(logits) (sigmoid 0) or sigmoid(logits) (sigmoid 1), saved for
     * backward. Selection: the K experts with the largest probs + bias (bias
     * (E) fp32 or NULL: DeepSeek-V3's balancing bias, used for selection
     * only), in descending order, into topk (N,K) int32. gates (N,K) fp32 =
     * the chosen probs, divided by their sum when norm_topk (the sum is taken
     * of the probs, not probs + bias). stats (N/S, E + 1) fp32, per sequence
     * b: [b][e] = sum over its S rows of probs[., e], [b][E] = sum of lse^2
     * where lse = logsumexp of the row's logits (the z-loss), both summed in
     * row order. */
    void (*moe_route)(int32_t *topk, float *gates, float *probs, float *stats, const void *logits,
                      const float *bias, int N, int S, int E, int K, int sigmoid, int norm_topk);
    /* moe_dispatch: the permutation. Slot (t, k) goes to expert topk[t][k];
     * each expert takes its slots in token order (t, then k), at most cap of
     * each sequence's (cap <= 0: all; a sequence's later ones are dropped).
     * offsets (E+1) int32: expert e owns permuted rows [offsets[e],
     * offsets[e+1]); row_of (N,K) int32: the permuted row of slot (t,k), -1 if
     * dropped; src (N K) int32: token of each permuted row (rows past
     * offsets[E] are unused). counts (N/S, E) int32: slots of each sequence
     * routed to each expert before any drop (the load). */
    void (*moe_dispatch)(int32_t *offsets, int32_t *row_of, int32_t *src, int32_t *counts,
                         const int32_t *topk, int N, int S, int E, int K, int cap);
    /* moe_dispatch with a limit per sequence and expert instead of one cap:
     * sequence b keeps at most caps[b][e] >= 0 of its slots for expert e
     * (caps (N/S, E) int32 device), its first in token order; the rest as
     * moe_dispatch. Context parallelism's chunks of a sequence: each gets
     * what the capacity leaves after the earlier chunks. */
    void (*moe_dispatch_capped)(int32_t *offsets, int32_t *row_of, int32_t *src, int32_t *counts,
                                const int32_t *topk, int N, int S, int E, int K, const int32_t *caps);
    /* xp(R, C) act = x[src[r]] for the R = offsets[E] permuted rows. */
    void (*moe_gather)(void *xp, const void *x, const int32_t *src, int R, int C);
    /* dx(N,C) act += sum over k of dxp[row_of[t][k]] (dropped slots skipped),
     * in k order: the backward of moe_gather. */
    void (*moe_gather_backward)(void *dx, const void *dxp, const int32_t *row_of, int N, int K, int C);
    /* out(N,C) act = sum over k of gates[t][k] * yp[row_of[t][k]] (dropped
     * slots add nothing), in k order, accumulated in fp32; yp (R,C) act. */
    void (*moe_combine)(void *out, const void *yp, const float *gates, const int32_t *row_of, int N,
                        int K, int C);
    /* The backward of moe_combine: dyp(R,C) act = gates[t][k] * dout[t] for
     * row r = row_of[t][k]; dgates(N,K) fp32 = dot(dout[t], yp[r]) (0 for a
     * dropped slot); dout (N,C) act. */
    void (*moe_combine_backward)(void *dyp, float *dgates, const void *dout, const void *yp,
                                 const float *gates, const int32_t *row_of, int N, int K, int C);
    /* The router's backward: dlogits(N,E) act (overwritten) = gradient through
     * gates (from dgates, following norm_topk and the probs function; the
     * selection is constant) plus the auxiliary losses': aux (N/S, E) fp32 or
     * NULL adds aux[t / S][e] to dL/dprobs[t][e] (the load-balancing loss,
     * whose gradient is the same for every row of a sequence), and z_coef adds
     * z_coef * 2 lse softmax(logits)[e] / N (the router z-loss, mean over N
     * rows; softmax and lse of the logits under a sigmoid router too). probs,
     * topk, gates from moe_route; logits (N,E) act. */
    void (*moe_route_backward)(void *dlogits, const float *dgates, const float *probs,
                               const int32_t *topk, const float *gates, const void *logits,
                               const float *aux, float z_coef, int N, int S, int E, int K,
                               int sigmoid, int norm_topk);

    /* Optional fused MLP ops, NULL where the backend has nothing faster than
     * the separate ops (the CPU). Host code uses them when present and
     * model.gelu_fusion allows, else the composition named on each; never by
     * backend name. They compute the same function as that composition, but
     * need not give its bits: the GeLU is applied to the fp32 product before
     * any act store, and may be the library's own tanh-approximation code.
     * matmul_gelu_forward: pre(N,OC) act = inp(N,C) @ w(OC,C)^T + bias(OC),
     * out_gelu(N,OC) act = gelu(pre); all act, bias non-NULL. Composition:
     * matmul_forward(pre, ...) then gelu_forward(out_gelu, pre, N*OC). */
    void (*matmul_gelu_forward)(void *out_gelu, void *pre, const void *inp, const void *w, const void *bias,
                                int N, int C, int OC);
    /* The backward of a product whose input was gelu(pre): as matmul_backward
     * (inp(N,C) = gelu(pre) act, the forward's input; dw(OC,C), dbias(OC)
     * fp32 per `accumulate`, either may be NULL; dout(N,OC), w(OC,C) act), but
     * dinp(N,C) act = (dout @ w) * gelu'(pre(N,C) act), the gradient of pre,
     * not of gelu(pre). Composition: matmul_backward(tmp, dw, dbias, dout,
     * inp, w, ...) then gelu_backward(dinp, pre, tmp, N*C). */
    void (*matmul_backward_dgelu)(void *dinp, float *dw, float *dbias, const void *dout, const void *inp,
                                  const void *w, const void *pre, int N, int C, int OC, int accumulate);

    /* out = a + b, act (n): the residual stream. */
    void (*residual_forward)(void *out, const void *a, const void *b, size_t n);
    /* Optional (NULL: model.c runs the composition): the residual add and the
     * norm that reads its result, in one pass. res(N,C) act = a + b, as
     * residual_forward; out(N,C) act = the norm of res with its statistics,
     * as layernorm_forward(out, mean, rstd, res, w, bias, ...) computes it,
     * or with mean NULL as rmsnorm_forward(out, rstd, res, w, ...) (bias
     * NULL). a, b (N,C), w, bias (C) act; res may be a (in place). Every
     * backend gives the bits of that composition, so a norm recomputed from
     * res alone (model.recompute) is the one the forward saved. */
    void (*residual_norm_forward)(void *res, void *out, float *mean, float *rstd, const void *a, const void *b,
                                  const void *w, const void *bias, int N, int C, float eps);
    /* out = a + b, fp32 (n): gradient shards (ddp.c). */
    void (*add)(float *out, const float *a, const float *b, size_t n);

    /* Softmax + cross-entropy over the first V of Vp columns, fused; math in
     * fp32. losses(N) fp32 = -log softmax(logits)[target]. If dloss != 0,
     * logits(N,Vp) act is overwritten in place by dlogits = (softmax - onehot)
     * * dloss, with zeros in the padded columns. targets(N) must be in [0, V). */
    void (*crossentropy_forward)(void *logits, float *losses, const int32_t *targets, int N,
                                 int V, int Vp, float dloss);
    /* Vocabulary-parallel cross-entropy (tensor parallelism), in two parts
     * around one all-gather; each of the P tp ranks holds logits(N,Vp) act
     * for its Vp vocabulary columns, of which the first V (0 <= V <= Vp) are
     * real; targets(N) are local column ids, negative when another rank
     * holds the target. Part 1: stats(N,3) fp32 = per row [m = max of the V
     * logits (-inf if V = 0), s = sum of exp(logit - m), the target's logit
     * (0 if not here)]. */
    void (*xent_partial)(float *stats, const void *logits, const int32_t *targets, int N, int V, int Vp);
    /* Part 2, with every rank's stats gathered in rank order, stats_all(P,N,3):
     * M = max_p m_p, S = sum_p s_p exp(m_p - M), losses(N) fp32 = M + log S -
     * sum_p t_p, the same on every rank. If dloss != 0, logits become dlogits
     * = (exp(logit - M) / S - onehot) * dloss in place, zeros past V. */
    void (*xent_finish)(void *logits, float *losses, const float *stats_all, int P, const int32_t *targets,
                        int N, int V, int Vp, float dloss);

    /* AdamW on a contiguous range, all fp32: p -= lr * (mhat / (sqrt(vhat) + eps) + wd * p),
     * with g = grad * grad_scale, bias corrections for step t (1-based).
     * The last two arguments, shared by the updates below: st NULL, or the
     * step's device scalars (StepScalars above), whose scale replaces
     * grad_scale and whose skip leaves every buffer as it was; copy NULL,
     * or copy(n) act, the compute copy of these parameters, which receives
     * each new parameter rounded to act (to nearest even: cast_to_act's
     * bits) in the same pass, so no separate cast need read the master. */
    void (*adamw_update)(float *params, const float *grads, float *m, float *v, size_t n,
                         float lr, float beta1, float beta2, float eps, float weight_decay,
                         float grad_scale, int t, const StepScalars *st, void *copy);
    /* The same update with m and v stored as bf16 (precision.optim_state
     * bf16: half the optimizer memory): m(n) v(n) bf16 bits are read into
     * fp32, updated in fp32 exactly as adamw_update does (the parameter step
     * uses the unrounded fp32 moments), and stored back rounded
     * stochastically (sround.h) with the random bits of sround_hash(seed, t,
     * idx0 + i) for element i: the low 16 bits for m, the next 16 for v.
     * Every backend gives the same bits. */
    void (*adamw_update_bf16)(float *params, const float *grads, uint16_t *m, uint16_t *v, size_t n,
                              float lr, float beta1, float beta2, float eps, float weight_decay,
                              float grad_scale, int t, uint64_t seed, uint64_t idx0, const StepScalars *st,
                              void *copy);
    /* The same update on bf16 parameters (precision.master bf16: the bf16
     * compute copy is the parameters, no fp32 master): params(n) bf16 bits
     * are read into fp32, the step is computed in fp32 exactly as above, and
     * the new parameter is stored rounded stochastically with bits 32..47 of
     * sround_hash(seed, t, idx0 + i), a stream apart from the moments' (bits
     * 0..31). m(n) v(n) are fp32 (state_bytes 4, as adamw_update) or bf16
     * bits (2, as adamw_update_bf16). grads fp32. Every backend gives the
     * same bits; st as above (no copy: the parameters are the compute
     * copy). A backend may leave it NULL where act is never bf16; the
     * CPU backend has it as the reference the CUDA kernel is checked against
     * (and for tests' bf16 emulation), though a CPU run never calls it: with
     * fp32 activations the config refuses precision.master bf16. */
    void (*adamw_update_p16)(uint16_t *params, const float *grads, void *m, void *v, size_t state_bytes, size_t n,
                             float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale,
                             int t, uint64_t seed, uint64_t idx0, const StepScalars *st);

    /* Lion (Chen et al. 2023) on a contiguous range, all fp32: with g = grad *
     * grad_scale, p -= lr * (sign(beta1 m + (1 - beta1) g) + wd * p), then
     * m = beta2 m + (1 - beta2) g; sign(0) = 0. One state buffer m(n);
     * st and copy as adamw_update's. */
    void (*lion_update)(float *params, const float *grads, float *m, size_t n, float lr, float beta1, float beta2,
                        float weight_decay, float grad_scale, const StepScalars *st, void *copy);

    /* Muon (docs/optimizers.md) on one matrix; a backend without them
     * leaves all three NULL and optim.name muon is refused on it.
     * muon_momentum, fp32: g = grad * grad_scale, m = mu m + (1 - mu) g, and
     * the Nesterov look-ahead u = (1 - mu) g + mu m; u, m, grads (n); u may
     * be grads (in place). Every backend gives the same bits. */
    void (*muon_momentum)(float *u, float *m, const float *grads, size_t n, float momentum, float grad_scale);
    /* x (rows, cols) fp32 in place: X = x / (||x||_F + 1e-7), transposed to
     * (cols, rows) when rows > cols, then `steps` quintic iterations
     * A = X X^T, X = 3.4445 X + (-4.7750 A + 2.0315 A A) X, products by the
     * backend's matmul in the activation dtype (each stored in it: bf16 on
     * CUDA, fp32 on the CPU); the result back in x's layout, fp32. work:
     * 2 rows cols + 2 min(rows, cols)^2 + 256 floats. */
    void (*newton_schulz)(float *x, int rows, int cols, int steps, float *work);
    /* p -= lr * (scale * o + wd * p); params, o (n). */
    void (*muon_apply)(float *params, const float *o, size_t n, float lr, float scale, float weight_decay);

    /* Adafactor (Shazeer & Stern 2018; docs/optimizers.md), fp32, on a run
     * of n elements of one tensor, element k being the tensor's element
     * e = e0 + k, row e / cols and column e % cols of a factored (2-D)
     * tensor; g = grad * grad_scale.
     * adafactor_stats: rows[e / cols] += and cols[e % cols] += g^2 + eps1,
     * each row's and column's terms summed in double in element order. */
    void (*adafactor_stats)(float *rows, float *cols, const float *grads, size_t e0, size_t n, int cols_n,
                            float grad_scale, float eps1);
    /* state(n) = beta2 state + (1 - beta2) scale sums(n): the factored
     * statistics' moving averages (scale: 1 / the count they sum). */
    void (*adafactor_ema)(float *state, const float *sums, size_t n, float beta2, float scale);
    /* not factored: v(n) = beta2 v + (1 - beta2) (g^2 + eps1) */
    void (*adafactor_second)(float *v, const float *grads, size_t n, float grad_scale, float beta2, float eps1);
    /* The unclipped update u = g / sqrt(r[row] / rmean) / sqrt(c[col]) for a
     * factored tensor (r, c its row and column averages, rmean the mean of
     * all its r), else u = g / sqrt(v[k]); adafactor_usq writes the sum of
     * u^2 over the run, in double, to *out (device memory). adafactor_apply:
     * u *= inv_clip; with m (n, else NULL) m = beta1 m + (1 - beta1) u and
     * u = m; params -= lr (u + wd params). r, c NULL: v is used. */
    void (*adafactor_usq)(double *out, const float *grads, const float *v, const float *r, const float *c,
                          float rmean, size_t e0, size_t n, int cols_n, float grad_scale);
    void (*adafactor_apply)(float *params, const float *grads, float *m, const float *v, const float *r,
                            const float *c, float rmean, size_t e0, size_t n, int cols_n, float grad_scale,
                            float inv_clip, float lr, float beta1, float weight_decay);

    /* fp8 products (precision.fp8; src/fp8.h has the formats and the host
     * reference, docs/precision.md the rules). NULL where a backend has
     * none (precision.fp8 is then refused). fp8_amax: amax (fp8_amax_len)
     * fp32 = max |x| of x (rows, cols) act along axis (Fp8Axis: the whole
     * tensor, each row, each column; NaN ignored). fp8_qdq: y (rows, cols)
     * act = x quantised onto the grid of fmt (Fp8Format) and back, with the
     * scale s = fp8_scale(a, fmt, pow2) of a = the max over the P rows of
     * amax (P, fp8_amax_len) fp32 (the tp ranks' amaxes, or a delayed-
     * scaling history): y = round_fp8(x s) / s, saturating; y may be x. A
     * product of such operands in fp32 is the fp8 product's numerics. */
    void (*fp8_amax)(float *amax, const void *x, int rows, int cols, int axis);
    void (*fp8_qdq)(void *y, const void *x, const float *amax, int P, int rows, int cols, int axis, int fmt,
                    int pow2);
    /* Optional, NULL where the backend has no fp8 tensor cores (the CPU):
     * the real fp8 product, used by host code when present (else fp8_qdq
     * and the matmul ops). fp8_cast: the codes of x in one pass (Fp8Cast
     * above); fp8_matmul: the product of such codes (Fp8Matmul above);
     * fp8_rowwise: 1 if fp8_matmul takes per-row scales (rowwise 1), else
     * 0 (then host code quantises rowwise operands with fp8_qdq). */
    void (*fp8_cast)(const Fp8Cast *c, const void *x, int rows, int cols);
    void (*fp8_matmul)(const Fp8Matmul *p);
    int (*fp8_rowwise)(void);

    /* Sum of squares of fp32 x, in double; NaN or Inf in x makes the result non-finite. */
    double (*sumsq)(const float *x, size_t n);
    /* The step's scalars (StepScalars above), on the device, no host wait.
     * sumsq_acc: *acc (device double) += sumsq(x, n), the same sum as sumsq's.
     * loss_acc: *acc (device double) += the mean of losses(N) fp32, summed
     * in double and rounded to float (model_forward's return value; the CPU
     * sums in row order, a GPU in a fixed tree: the last bits of the double
     * sum may differ). step_scalars: st's norm, loss_mean (over `micro`
     * micro-batches), scale (src/clip.h, optim.grad_clip) and skip from its
     * loss and sumsq. */
    void (*sumsq_acc)(double *acc, const float *x, size_t n);
    void (*loss_acc)(double *acc, const float *losses, int N);
    void (*step_scalars)(StepScalars *st, int micro, float grad_clip);

    /* Optional hooks; NULL where a backend has no such notion (the CPU has
     * only memory_peak).
     * set_precision: precision.compute, called once after init and before any
     * allocation: "fp32" (act is fp32, strict fp32 products) or "bf16" (act is
     * bf16: half the activation memory and bandwidth, matrix products on bf16
     * tensor cores with fp32 accumulation). Without it act is fp32.
     * set_attention: precision.attention, which attention kernels run when
     * act is bf16: "auto" (tensor cores if a start-up self-check against
     * the SIMT kernels passes; the default), "tensor_cores" (needs bf16) or
     * "simt". Call it before set_precision, which makes the choice (and may
     * run the self-check); called later, it switches at once. The choice
     * appears in the description line init returned.
     * set_attention_deterministic: precision.attention_deterministic; 0 lets
     * an attention backward that sums with atomics run where the backend has
     * one (CUDA: cuDNN's), so its gradients are no longer the same bits run
     * to run; 1 (the default) keeps every sum in a fixed order. Call it
     * before set_precision, as set_attention.
     * memory_peak: the most device memory in use since init, in bytes
     * (CUDA: total minus free as cudaMemGetInfo reports it; the CPU: the
     * bytes requested of its alloc and not yet freed, the host's RSS aside).
     * host_syncs: how many times the host has waited on the device since
     * init (synchronous copies, stream and event waits; `./train bench`
     * prints them per step).
     * stream: the stream (cudaStream_t) every op of the backend runs on, in
     * order; comm orders NCCL collectives against it (comm.h,
     * comm_nccl_device_mode). */
    void (*set_precision)(const char *compute);
    void (*set_attention)(const char *impl);
    void (*set_attention_deterministic)(int deterministic);
    size_t (*memory_peak)(void);
    unsigned long (*host_syncs)(void);
    void *(*stream)(void);
    /* select_device: before init, the rank's index among the ranks of its
     * host and their count (one process per device: local rank r uses
     * device r, or the only visible one). */
    void (*select_device)(int local_rank, int local_world);
} Backend;

/* Host-side conversions between fp32 and an activation dtype of act_bytes
 * (4: a copy; 2: bf16, round to nearest even, NaN stays NaN), for buffers
 * crossing to or from the host (test inputs, logits rows). f32_to_act may
 * convert in place (dst == src); act_to_f32 may not. */
void backend_f32_to_act(void *dst, const float *src, size_t n, size_t act_bytes);
void backend_act_to_f32(float *dst, const void *src, size_t n, size_t act_bytes);
/* x rounded to the activation dtype and back (x itself for fp32). */
float backend_act_round(float x, size_t act_bytes);

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
/* precision.compute, precision.attention and precision.attention_deterministic
 * to a backend just after init, in the order its hooks want: the attention
 * keys first, set_precision (which makes the attention choice) last. A
 * backend without set_attention_deterministic (the CPU: every sum in a fixed
 * order) is told nothing, and deterministic 0 there is one warning. */
void backend_set_precision(const Backend *be, const char *compute, const char *attention, int deterministic);

#endif
