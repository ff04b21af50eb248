/* attention: causal multi-head attention as flash-attention kernels in fp32
 * CUDA C. The forward streams K/V tiles through shared memory with an online
 * softmax and saves the log-sum-exp; the backward recomputes probabilities
 * from it, so no (T,T) matrix ever exists. The backward is two kernels — dQ
 * over query rows, then dK/dV over key rows — instead of FlashAttention-2's
 * atomics on dQ: every sum then runs in a fixed order and the result is the
 * same bits run to run (test_ops checks "deterministic"). With bf16
 * activations the tensor-core kernels of attention_tc.cu take over where they
 * apply; the end of this file chooses, after comparing the two (self-check).
 *
 * Threads: a group of TPK adjacent threads owns one row (a query, or a key in
 * the dK/dV kernel), TPK 2, 4 or 8 for head sizes up to 128 (GPT-2: 64, TPK
 * 4); the inner loops over a tile are attention_simt.cuh's, shared with
 * context parallelism's block kernels (attention_block.cu).
 *
 * Dtypes: qkv, out, dout and dqkv are act (template T_: fp32 or bf16, read
 * into fp32 registers and fp32 shared tiles, stored rounded); lse, D and every
 * sum are fp32. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention_simt.cuh"
#include "common.cuh"

/* ---------------------------------------------------------------------------
 * Grouped K/V heads (backend.h's AttnShape): a qkv row is [q (NH hs) | k (NKV
 * hs) | v (NKV hs)], ld = (NH + 2 NKV) hs wide; query head h reads kv head
 * h / (NH / NKV); out and dout rows are NH hs wide. */
struct AttDims {
    int T, NH, NKV, hs;
    size_t ld;  /* qkv row */
    size_t ldo; /* out, dout row */
    const int32_t *doc; /* (B, T) first position of each row's document, or NULL (backend.h) */
};

static AttDims att_dims(const AttnShape *s) {
    AttDims d;
    d.T = s->T, d.NH = s->NH, d.NKV = s->NKV, d.hs = s->HD;
    d.ld = (size_t)attn_qkv_width(s);
    d.ldo = (size_t)s->NH * s->HD;
    d.doc = s->doc;
    return d;
}

/* The first key row t of sequence b sees: its document's start, or 0. doc
 * is nondecreasing along a sequence, so a block's first row gives the first
 * key any of its rows sees, and the key tiles before it are skipped. */
__device__ __forceinline__ int att_first(const AttDims &a, int b, int t) {
    return a.doc && t < a.T ? a.doc[(size_t)b * a.T + t] : 0;
}

/* Column of query head h's k (v: + NKV hs) in a qkv row. */
__device__ __forceinline__ size_t att_kcol(const AttDims &a, int h) {
    return (size_t)a.NH * a.hs + (size_t)(h / (a.NH / a.NKV)) * a.hs;
}

/* ---------------------------------------------------------------------------
 * Forward. Block: ATT_BR query rows of one (b, h); grid (B*NH, ceil(T/ATT_BR)). */
template <int TPK, typename T_>
__global__ void __launch_bounds__(ATT_BR *TPK)
    att_forward_kernel(T_ *out, float *lse, const T_ *qkv, AttDims a, float scale) {
    KILN_DYN_SHARED(float, smem);
    int T = a.T, hs = a.hs, bh = blockIdx.x, b = bh / a.NH, h = bh % a.NH;
    float *Ks = smem, *Vs = smem + ATT_BC * hs; /* (ATT_BC, hs) each */
    float *Ss = Vs + ATT_BC * hs;                /* (ATT_BR, ATT_BC + 1) scores */
    int r0 = blockIdx.y * ATT_BR, lr = threadIdx.x / TPK, row = r0 + lr, sub = threadIdx.x % TPK;
    float *S = Ss + lr * (ATT_BC + 1);
    size_t ld = a.ld;
    const T_ *Q = qkv + (size_t)b * T * ld + h * hs, *K = qkv + (size_t)b * T * ld + att_kcol(a, h);
    const T_ *V = K + (size_t)a.NKV * hs;
    float q[ATT_D], o[ATT_D];
#pragma unroll
    for (int i = 0; i < ATT_D; i++) {
        int d = i * TPK + sub;
        q[i] = row < T && d < hs ? act_f(Q[(size_t)row * ld + d]) : 0.0f;
        o[i] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    int kend = min(T, r0 + ATT_BR); /* the block's rows see keys [kbeg, kend) */
    int kbeg = att_first(a, b, r0), first = att_first(a, b, row);
    for (int k0 = kbeg; k0 < kend; k0 += ATT_BC) {
        __syncthreads();
        att_load_tile(Ks, K, ld, k0, ATT_BC, T, hs);
        att_load_tile(Vs, V, ld, k0, ATT_BC, T, hs);
        __syncthreads();
        /* causal: row sees keys [its document's start, itself] */
        att_softmax_tile<TPK>(o, m, l, q, Ks, Vs, S, k0, first, row + 1, sub, hs, scale);
    }
    if (row < T) {
        float inv = 1.0f / l;
        T_ *O = out + ((size_t)b * T + row) * a.ldo + h * hs;
#pragma unroll
        for (int i = 0; i < ATT_D; i++) {
            int d = i * TPK + sub;
            if (d < hs) O[d] = act_from<T_>(o[i] * inv);
        }
        if (sub == 0) lse[(size_t)bh * T + row] = m + logf(l);
    }
}

/* ---------------------------------------------------------------------------
 * Backward, part 1: dQ, and D = rowsum(dO * O) for part 2. Block: ATT_BR query
 * rows of one (b, h). ds = p (dp - D) / sqrt(hs) with p = exp(s - lse). */
template <int TPK, typename T_>
__global__ void __launch_bounds__(ATT_BR *TPK)
    att_backward_dq_kernel(T_ *dqkv, float *Dbuf, const T_ *dout, const T_ *qkv, const T_ *out,
                           const float *lse, AttDims a, float scale) {
    KILN_DYN_SHARED(float, smem);
    int T = a.T, hs = a.hs, bh = blockIdx.x, b = bh / a.NH, h = bh % a.NH;
    float *Ks = smem, *Vs = smem + ATT_BC * hs;
    int r0 = blockIdx.y * ATT_BR, row = r0 + threadIdx.x / TPK, sub = threadIdx.x % TPK;
    size_t ld = a.ld, ldo = a.ldo;
    const T_ *Q = qkv + (size_t)b * T * ld + h * hs, *K = qkv + (size_t)b * T * ld + att_kcol(a, h);
    const T_ *V = K + (size_t)a.NKV * hs;
    const T_ *dO = dout + (size_t)b * T * ldo + h * hs, *O = out + (size_t)b * T * ldo + h * hs;
    float q[ATT_D], dor[ATT_D], dq[ATT_D];
    float part = 0.0f;
#pragma unroll
    for (int i = 0; i < ATT_D; i++) {
        int d = i * TPK + sub;
        int ok = row < T && d < hs;
        q[i] = ok ? act_f(Q[(size_t)row * ld + d]) : 0.0f;
        dor[i] = ok ? act_f(dO[(size_t)row * ldo + d]) : 0.0f;
        part += ok ? dor[i] * act_f(O[(size_t)row * ldo + d]) : 0.0f;
        dq[i] = 0.0f;
    }
    float Dt = att_group_sum<TPK>(part);
    float lt = row < T ? lse[(size_t)bh * T + row] : 0.0f;
    if (row < T && sub == 0) Dbuf[(size_t)bh * T + row] = Dt;
    int kend = min(T, r0 + ATT_BR), kbeg = att_first(a, b, r0), first = att_first(a, b, row);
    for (int k0 = kbeg; k0 < kend; k0 += ATT_BC) {
        __syncthreads();
        att_load_tile(Ks, K, ld, k0, ATT_BC, T, hs);
        att_load_tile(Vs, V, ld, k0, ATT_BC, T, hs);
        __syncthreads();
        att_dq_tile<TPK>(dq, q, dor, Ks, Vs, k0, first, row + 1, lt, Dt, sub, hs, scale);
    }
    if (row < T) {
        T_ *dQ = dqkv + ((size_t)b * T + row) * ld + h * hs;
#pragma unroll
        for (int i = 0; i < ATT_D; i++) {
            int d = i * TPK + sub;
            if (d < hs) dQ[d] = act_from<T_>(dq[i]);
        }
    }
}

/* Backward, part 2: dK and dV. Block: ATT_BK key rows of one (b, kv head),
 * each summing over the query heads of its group in head order and, per
 * head, over the queries that see it (rows >= the key) in row order: the
 * group's sum is one fixed chain of fp32 additions, with no atomics. */
template <int TPK, typename T_>
__global__ void __launch_bounds__(ATT_BK *TPK)
    att_backward_dkv_kernel(T_ *dqkv, const float *Dbuf, const T_ *dout, const T_ *qkv, const float *lse,
                            AttDims a, float scale) {
    KILN_DYN_SHARED(float, smem);
    int T = a.T, hs = a.hs, bkv = blockIdx.x, b = bkv / a.NKV, kvh = bkv % a.NKV, G = a.NH / a.NKV;
    float *Qs = smem, *dOs = smem + ATT_BQ * hs; /* (ATT_BQ, hs) each */
    float *Ls = dOs + ATT_BQ * hs, *Ds = Ls + ATT_BQ; /* (ATT_BQ) each */
    int *Lo = (int *)(Ds + ATT_BQ), *Hi = Lo + ATT_BQ; /* (ATT_BQ) each: query r sees keys [Lo, Hi) */
    int k0 = blockIdx.y * ATT_BK, key = k0 + threadIdx.x / TPK, sub = threadIdx.x % TPK;
    size_t ld = a.ld, ldo = a.ldo;
    const T_ *K = qkv + (size_t)b * T * ld + (size_t)a.NH * hs + (size_t)kvh * hs, *V = K + (size_t)a.NKV * hs;
    float k[ATT_D], v[ATT_D], dk[ATT_D], dv[ATT_D];
#pragma unroll
    for (int i = 0; i < ATT_D; i++) {
        int d = i * TPK + sub;
        int ok = key < T && d < hs;
        k[i] = ok ? act_f(K[(size_t)key * ld + d]) : 0.0f;
        v[i] = ok ? act_f(V[(size_t)key * ld + d]) : 0.0f;
        dk[i] = dv[i] = 0.0f;
    }
    for (int h = kvh * G; h < (kvh + 1) * G; h++) {
        const T_ *Q = qkv + (size_t)b * T * ld + h * hs, *dO = dout + (size_t)b * T * ldo + h * hs;
        const float *L = lse + ((size_t)b * a.NH + h) * T, *D = Dbuf + ((size_t)b * a.NH + h) * T;
        /* queries before k0 see none of these keys, nor (documents) those
         * whose document starts after the block's last key: the first such
         * query ends the loop, as documents only start later further on */
        int klast = min(T, k0 + ATT_BK) - 1;
        for (int i0 = k0; i0 < T; i0 += ATT_BQ) {
            __syncthreads();
            att_load_tile(Qs, Q, ld, i0, ATT_BQ, T, hs);
            att_load_tile(dOs, dO, ldo, i0, ATT_BQ, T, hs);
            for (int r = threadIdx.x; r < ATT_BQ; r += blockDim.x) {
                Ls[r] = i0 + r < T ? L[i0 + r] : 0.0f;
                Ds[r] = i0 + r < T ? D[i0 + r] : 0.0f;
                Lo[r] = att_first(a, b, i0 + r);
                Hi[r] = i0 + r < T ? i0 + r + 1 : 0; /* causal; none past T */
            }
            __syncthreads();
            if (att_first(a, b, i0) > klast) break; /* the same for every thread: no sync is skipped */
            att_dkv_tile<TPK>(dk, dv, k, v, Qs, dOs, Ls, Ds, Lo, Hi, key, sub, hs, scale);
        }
    }
    if (key < T) {
        T_ *dK = dqkv + ((size_t)b * T + key) * ld + (size_t)a.NH * hs + (size_t)kvh * hs, *dV = dK + (size_t)a.NKV * hs;
#pragma unroll
        for (int i = 0; i < ATT_D; i++) {
            int d = i * TPK + sub;
            if (d < hs) {
                dK[d] = act_from<T_>(dk[i]);
                dV[d] = act_from<T_>(dv[i]);
            }
        }
    }
}

/* ---------------------------------------------------------------------------
 * Dispatch on the head size. */

static int att_tpk(int hs) {
    for (int tpk = 2; tpk <= 8; tpk *= 2)
        if (hs <= ATT_D * tpk) return tpk;
    kiln_fail(KILN_EXIT_USAGE, "cuda attention: head size %d is over the supported %d", hs, 8 * ATT_D);
}

static void att_check_shape(const AttnShape *s) {
    if (s->NKV < 1 || s->NH % s->NKV != 0)
        kiln_fail(KILN_EXIT_USAGE, "cuda attention: n_kv_head %d does not divide n_head %d", s->NKV, s->NH);
}

template <typename T_>
static void att_forward_run(void *out, float *lse, const void *qkv, const AttnShape *s) {
    att_check_shape(s);
    AttDims a = att_dims(s);
    int hs = a.hs, tpk = att_tpk(hs);
    float scale = 1.0f / sqrtf((float)hs);
    dim3 grid(s->B * s->NH, (s->T + ATT_BR - 1) / ATT_BR);
    /* K, V tiles and the scores: <= 40 KiB at hs 128, under the 48 KiB default */
    size_t sh = ((size_t)2 * ATT_BC * hs + ATT_BR * (ATT_BC + 1)) * sizeof(float);
    T_ *o = (T_ *)out;
    const T_ *x = (const T_ *)qkv;
    switch (tpk) {
    case 2: KLAUNCH((att_forward_kernel<2, T_>), grid, ATT_BR * 2, sh, o, lse, x, a, scale); break;
    case 4: KLAUNCH((att_forward_kernel<4, T_>), grid, ATT_BR * 4, sh, o, lse, x, a, scale); break;
    default: KLAUNCH((att_forward_kernel<8, T_>), grid, ATT_BR * 8, sh, o, lse, x, a, scale); break;
    }
    CUDA_CHECK_LAUNCH();
}

void cuda_attention_simt_forward(void *out, float *lse, const void *qkv, const AttnShape *s) {
    ACT_DISPATCH(att_forward_run, out, lse, qkv, s);
}

template <typename T_>
static void att_backward_run(void *dqkv_, const void *dout_, const void *qkv_, const void *out_,
                             const float *lse, const AttnShape *s) {
    att_check_shape(s);
    AttDims a = att_dims(s);
    int hs = a.hs, tpk = att_tpk(hs), B = s->B, T = s->T;
    float scale = 1.0f / sqrtf((float)hs);
    float *Dbuf = (float *)cuda_scratch(SCRATCH_ATTENTION, (size_t)B * s->NH * T * sizeof(float));
    dim3 gq(B * s->NH, (T + ATT_BR - 1) / ATT_BR), gk(B * s->NKV, (T + ATT_BK - 1) / ATT_BK);
    size_t shq = (size_t)2 * ATT_BC * hs * sizeof(float);
    size_t shk = ((size_t)2 * ATT_BQ * hs + 2 * ATT_BQ) * sizeof(float) + 2 * ATT_BQ * sizeof(int);
    T_ *dqkv = (T_ *)dqkv_;
    const T_ *dout = (const T_ *)dout_, *qkv = (const T_ *)qkv_, *out = (const T_ *)out_;
    /* dQ first: it also writes D, which the dK/dV kernel reads (same stream). */
#define ATT_BACKWARD(TPK)                                                                                  \
    KLAUNCH((att_backward_dq_kernel<TPK, T_>), gq, ATT_BR * TPK, shq, dqkv, Dbuf, dout, qkv, out, lse, a,    \
            scale);                                                                                         \
    CUDA_CHECK_LAUNCH();                                                                                    \
    KLAUNCH((att_backward_dkv_kernel<TPK, T_>), gk, ATT_BK * TPK, shk, dqkv, Dbuf, dout, qkv, lse, a, scale)
    switch (tpk) {
    case 2: ATT_BACKWARD(2); break;
    case 4: ATT_BACKWARD(4); break;
    default: ATT_BACKWARD(8); break;
    }
#undef ATT_BACKWARD
    CUDA_CHECK_LAUNCH();
}

void cuda_attention_simt_backward(void *dqkv, const void *dout, const void *qkv, const void *out,
                                  const float *lse, const AttnShape *s) {
    ACT_DISPATCH(att_backward_run, dqkv, dout, qkv, out, lse, s);
}

/* ---------------------------------------------------------------------------
 * Which kernels run: precision.attention (set_attention) and the activation
 * dtype (set_precision). Three paths: these SIMT kernels (any dtype), the
 * tensor-core kernels of attention_tc.cu and cuDNN's fused attention
 * (attention_cudnn.cu), the last two bf16 only, so fp32 activations always
 * take SIMT (asking for another is a config error, exit 2).
 *
 * With bf16, set_precision self-checks each candidate the mode allows
 * against the SIMT kernels on the same random inputs (att_selfcheck: forward
 * and backward, backward run twice for determinism): a kiln bug, or a
 * toolchain, driver or library problem, shows up there instead of as a
 * silently wrong model.
 *  - `simt` never launches the others.
 *  - `tensor_cores` takes them whatever the check says (a failure warns).
 *  - `cudnn` must load libcudnn_graph.so.9, find an engine for the graphs and
 *    pass the check; any of these failing ends the run (exit 1: the library
 *    or GPU, not the config, is wrong), as does a head size it cannot take
 *    (exit 2: that is the config's n_embd / n_head).
 *  - `auto` keeps the candidates that pass (SIMT always) and runs the first
 *    that takes the shape in the order cudnn, tensor_cores, simt. The order
 *    is fixed, not timed: a choice by timing can differ between two runs of
 *    one config, or between data-parallel ranks when two paths are close,
 *    and then a rerun or a resume no longer computes the same bits (and
 *    under ZeRO-3, ranks whose sampled tokens differ would stop generating
 *    at different points and desynchronise their gathers). `make cuda-check`
 *    times all three (bench_attention); a path that is slower on some GPU is
 *    one config line away (precision.attention).
 * cuDNN plans a graph per shape (B, T, C, NH), at its first forward (the
 * backend learns the shape only there: set_precision runs before the model
 * plans its activations), and logs one line for it. Only the first
 * ATT_SHAPES shapes get a plan; later ones — generation's one-token-longer
 * contexts — run the best path that needs no per-shape plan (tensor cores if
 * usable, else SIMT), so sampling never plans cuDNN graphs token by token.
 * Every rank sees the same shapes in the same order, so every rank makes the
 * same choices. Per call, a head size or alignment a path does not handle
 * falls back to the SIMT kernels (qkv and dout 16-byte aligned: every kiln
 * buffer is); grouped K/V heads and documents never go to cuDNN.
 * precision.attention_deterministic false (set_deterministic) plans cuDNN's
 * backward with dQ summed by atomics, and its self-check then accepts a
 * backward that does not repeat bit for bit; it changes nothing else (every
 * kiln kernel sums in a fixed order), and warns where cuDNN is not kept. */

enum { ATT_AUTO, ATT_CUDNN, ATT_TENSOR_CORES, ATT_SIMT, ATT_MODES };
static const char *const att_mode_names[ATT_MODES] = {"auto", "cudnn", "tensor_cores", "simt"};
/* Paths, in auto's order of preference. */
enum { PATH_CUDNN, PATH_TC, PATH_SIMT, PATH_COUNT };
static const char *const att_path_names[PATH_COUNT] = {"cudnn", "tensor_cores", "simt"};

typedef struct {
    int ran, ok, det, failed; /* failed: an execute failed (cuDNN) */
    double out, lse, dqkv;    /* max |path - simt| / max |simt| */
} AttCheck;

static int att_mode = ATT_AUTO;
static int att_deterministic = 1;   /* precision.attention_deterministic: 0 lets cuDNN's backward use atomics */
static int att_precision_set;       /* set_precision has run since init: the choice can be made */
static int att_usable[PATH_COUNT];  /* may run (passed its self-check, or forced) */
static AttCheck att_check[PATH_COUNT];
static char att_cudnn_why[700];     /* why cuDNN is no candidate, for the log */
static char att_desc[700] = "attention: SIMT kernels";

#define ATT_SHAPES 4
static struct {
    int B, T, C, NH, NKV, path;
} att_shapes[ATT_SHAPES];
static int att_n_shapes, att_overflow_noted;

/* Self-check tolerance, max |path - simt| / max |simt| per tensor. Both read
 * the same bf16 inputs and store bf16 outputs: two roundings of nearby fp32
 * values can differ by one bf16 ulp, up to 2^-7 = 7.8e-3 of the largest
 * element; the tensor cores and cuDNN also round P and dS to bf16 before
 * their products (2^-9 each, errors that average out over a row: ~1e-3 of
 * the max). 2e-2 is 2x that sum; a wrong index, mask, scale, stride or missed
 * synchronisation errs by 0.1 or more. */
#define ATT_CHECK_TOL 2e-2

static double att_max_rel(const float *got, const float *ref, size_t n) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - ref[i]);
        if (!(d == d) || isinf(d)) return INFINITY; /* NaN or Inf */
        num = d > num ? d : num;
        den = fabs(ref[i]) > den ? fabs(ref[i]) : den;
    }
    return num / (den > 0.0 ? den : 1.0);
}

/* Device tensor to host fp32 (bf16 if act). */
static float *att_fetch(const void *d, size_t n, int act) {
    size_t es = act ? sizeof(bf16) : sizeof(float);
    void *s = xmalloc(n * es);
    float *h = (float *)xmalloc(n * sizeof(float));
    CUDA_HOST_WAIT(cudaMemcpy(s, d, n * es, cudaMemcpyDeviceToHost));
    backend_act_to_f32(h, s, n, es);
    free(s);
    return h;
}

/* Every path through one signature; the tensor-core and cuDNN kernels take
 * multi-head shapes only (NKV = NH), which the dispatch below guarantees. */
/* Each returns 1, or 0 when cuDNN's execute failed (att_exec_why says why). */
typedef int (*AttForward)(void *out, float *lse, const void *qkv, const AttnShape *s);
typedef int (*AttBackward)(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                           const AttnShape *s);
static char att_exec_why[640];
static int att_tc_forward(void *out, float *lse, const void *qkv, const AttnShape *s) {
    cuda_attention_tc_forward(out, lse, qkv, s);
    return 1;
}
static int att_tc_backward(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                           const AttnShape *s) {
    cuda_attention_tc_backward(dqkv, dout, qkv, out, lse, s);
    return 1;
}
static int att_simt_forward(void *out, float *lse, const void *qkv, const AttnShape *s) {
    cuda_attention_simt_forward(out, lse, qkv, s);
    return 1;
}
static int att_simt_backward(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                             const AttnShape *s) {
    cuda_attention_simt_backward(dqkv, dout, qkv, out, lse, s);
    return 1;
}
static int att_cudnn_forward(void *out, float *lse, const void *qkv, const AttnShape *s) {
    return cuda_attention_cudnn_forward(out, lse, qkv, s->B, s->T, s->NH * s->HD, s->NH, att_exec_why,
                                        sizeof att_exec_why);
}
static int att_cudnn_backward(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                              const AttnShape *s) {
    return cuda_attention_cudnn_backward(dqkv, dout, qkv, out, lse, s->B, s->T, s->NH * s->HD, s->NH, att_exec_why,
                                         sizeof att_exec_why);
}
static const AttForward att_fwd[PATH_COUNT] = {att_cudnn_forward, att_tc_forward, att_simt_forward};
static const AttBackward att_bwd[PATH_COUNT] = {att_cudnn_backward, att_tc_backward, att_simt_backward};

/* The self-check's shape: B > 1, so batch strides are checked; a T that is
 * not a multiple of the 64-row tiles; GPT-2's head size. */
#define ATT_CHECK_B 2
#define ATT_CHECK_NH 2
#define ATT_CHECK_T 200
#define ATT_CHECK_HS 64

/* Path `p`, forward and backward, against the SIMT kernels on random bf16
 * inputs; the backward of both reads the SIMT forward's out and lse, so each
 * pass is compared on its own. p's backward runs twice: same bits. */
static void att_selfcheck(int p) {
    const int B = ATT_CHECK_B, NH = ATT_CHECK_NH, T = ATT_CHECK_T, hs = ATT_CHECK_HS, C = NH * hs;
    size_t n3 = (size_t)B * T * 3 * C, nc = (size_t)B * T * C, nl = (size_t)B * NH * T;
    float *h = (float *)xmalloc(n3 * sizeof(float));
    bf16 *hq = (bf16 *)xmalloc(n3 * sizeof(bf16)), *hd = (bf16 *)xmalloc(nc * sizeof(bf16));
    Rng rng;
    rng_seed(&rng, 2718281828u);
    for (size_t i = 0; i < n3; i++) h[i] = rng_normal(&rng);
    backend_f32_to_act(hq, h, n3, sizeof(bf16));
    for (size_t i = 0; i < nc; i++) h[i] = rng_normal(&rng);
    backend_f32_to_act(hd, h, nc, sizeof(bf16));
    free(h);
    void *qkv, *dout, *out_s, *out_t, *dq_s, *dq_t, *dq_t2;
    float *lse_s, *lse_t;
    CUDA_CHECK(cudaMalloc(&qkv, n3 * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&dout, nc * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&out_s, nc * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&out_t, nc * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&dq_s, n3 * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&dq_t, n3 * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&dq_t2, n3 * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&lse_s, nl * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&lse_t, nl * sizeof(float)));
    CUDA_HOST_WAIT(cudaMemcpy(qkv, hq, n3 * sizeof(bf16), cudaMemcpyHostToDevice));
    CUDA_HOST_WAIT(cudaMemcpy(dout, hd, nc * sizeof(bf16), cudaMemcpyHostToDevice));
    free(hq), free(hd);

    const AttnShape ash = {B, T, NH, NH, hs, NULL};
    cuda_attention_simt_forward(out_s, lse_s, qkv, &ash);
    int ran = att_fwd[p](out_t, lse_t, qkv, &ash);
    cuda_attention_simt_backward(dq_s, dout, qkv, out_s, lse_s, &ash);
    ran = ran && att_bwd[p](dq_t, dout, qkv, out_s, lse_s, &ash);
    ran = ran && att_bwd[p](dq_t2, dout, qkv, out_s, lse_s, &ash);
    if (!ran) (void)cudaGetLastError(); /* a failed execute's launch error is not the next kernel's */
    CUDA_HOST_WAIT(cudaDeviceSynchronize());

    float *os = att_fetch(out_s, nc, 1), *ot = att_fetch(out_t, nc, 1);
    float *ls = att_fetch(lse_s, nl, 0), *lt = att_fetch(lse_t, nl, 0);
    float *gs = att_fetch(dq_s, n3, 1), *gt = att_fetch(dq_t, n3, 1), *gt2 = att_fetch(dq_t2, n3, 1);
    AttCheck *r = &att_check[p];
    r->ran = 1;
    r->out = att_max_rel(ot, os, nc);
    r->lse = att_max_rel(lt, ls, nl);
    r->dqkv = att_max_rel(gt, gs, n3);
    r->det = memcmp(gt, gt2, n3 * sizeof(float)) == 0;
    r->failed = !ran;
    /* the same bits twice, unless cuDNN's atomic backward was asked for */
    int det_ok = r->det || (p == PATH_CUDNN && !att_deterministic);
    r->ok = ran && r->out <= ATT_CHECK_TOL && r->lse <= ATT_CHECK_TOL && r->dqkv <= ATT_CHECK_TOL && det_ok;
    free(os), free(ot), free(ls), free(lt), free(gs), free(gt), free(gt2);
    void *dptr[] = {qkv, dout, out_s, out_t, dq_s, dq_t, dq_t2, lse_s, lse_t};
    for (size_t i = 0; i < sizeof dptr / sizeof dptr[0]; i++) CUDA_CHECK(cudaFree(dptr[i]));
}

static void att_figures(int p, char *s, size_t n) {
    const AttCheck *r = &att_check[p];
    if (r->failed) {
        snprintf(s, n, "self-check: %.150s", att_exec_why);
        return;
    }
    snprintf(s, n, "self-check vs SIMT: out %.1e, lse %.1e, dqkv %.1e (tol %.0e), %s", r->out, r->lse, r->dqkv,
             ATT_CHECK_TOL, r->det ? "deterministic" : p == PATH_CUDNN && !att_deterministic ? "not deterministic, as "
             "asked (precision.attention_deterministic false)" : "NOT deterministic");
}

/* The tensor-core candidate: att_usable[PATH_TC], and a warning if refused. */
static void att_choose_tc(void) {
    if (!cuda_attention_tc_fits(ATT_CHECK_HS)) { /* the self-check's head size: its shared memory does not fit */
        if (att_mode == ATT_TENSOR_CORES)
            kiln_warn("attention: this GPU's shared memory is too small for the tensor-core kernels: using SIMT");
        return;
    }
    if (!att_check[PATH_TC].ran) att_selfcheck(PATH_TC);
    att_usable[PATH_TC] = att_mode == ATT_TENSOR_CORES || att_check[PATH_TC].ok;
    if (!att_check[PATH_TC].ok) {
        char f[200];
        att_figures(PATH_TC, f, sizeof f);
        kiln_warn("attention: the tensor-core kernels disagree with the SIMT ones (%s): %s", f,
                  att_mode == ATT_TENSOR_CORES ? "using them anyway (precision.attention tensor_cores)"
                                               : "not using them (precision.attention tensor_cores forces them)");
    }
}

/* The cuDNN candidate: att_usable[PATH_CUDNN]; with precision.attention
 * cudnn every failure ends the run. */
static void att_choose_cudnn(void) {
    char why[640];
    int forced = att_mode == ATT_CUDNN;
    if (!cuda_attention_cudnn_load(why, sizeof why)) {
        if (forced)
            kiln_fail_hint(KILN_EXIT_RUNTIME, "precision.attention auto uses kiln's own kernels where cuDNN is missing",
                           "key 'precision.attention': cudnn: %s", why);
        snprintf(att_cudnn_why, sizeof att_cudnn_why, "%s", why);
        return;
    }
    if (!cuda_attention_cudnn_plan(ATT_CHECK_B, ATT_CHECK_T, ATT_CHECK_NH * ATT_CHECK_HS, ATT_CHECK_NH, why,
                                   sizeof why)) {
        if (forced)
            kiln_fail(KILN_EXIT_RUNTIME, "key 'precision.attention': cudnn: no cuDNN engine runs kiln's attention "
                                         "graph on this GPU (%s): %s", cuda_attention_cudnn_library(), why);
        snprintf(att_cudnn_why, sizeof att_cudnn_why, "no engine for the graph: %s", why);
        kiln_warn("attention: cuDNN not used: %s", att_cudnn_why);
        return;
    }
    if (!att_check[PATH_CUDNN].ran) att_selfcheck(PATH_CUDNN);
    char f[200];
    att_figures(PATH_CUDNN, f, sizeof f);
    if (!att_check[PATH_CUDNN].ok) {
        if (forced)
            kiln_fail(KILN_EXIT_RUNTIME, "key 'precision.attention': cudnn: cuDNN's fused attention (%s) disagrees "
                                         "with kiln's SIMT kernels (%s)", cuda_attention_cudnn_library(), f);
        if (att_check[PATH_CUDNN].failed) snprintf(att_cudnn_why, sizeof att_cudnn_why, "%s", f);
        else snprintf(att_cudnn_why, sizeof att_cudnn_why, "it disagrees with the SIMT kernels (%s)", f);
        kiln_warn("attention: cuDNN not used: %s", att_cudnn_why);
        return;
    }
    att_usable[PATH_CUDNN] = 1;
}

static void att_choose_paths(void);
/* The candidates, from att_mode and the activation dtype; writes att_desc.
 * Forgets the shapes chosen so far: they are chosen again. cuDNN's atomic
 * backward (att_deterministic 0) where cuDNN is not kept is a warning: kiln's
 * kernels are deterministic whatever the key says. */
static void att_choose(void) {
    att_choose_paths();
    if (att_deterministic || att_usable[PATH_CUDNN]) return;
    kiln_warn("key 'precision.attention_deterministic': false has no effect here: only cuDNN's backward has a "
              "non-deterministic form, and cuDNN does not run (%s); kiln's attention kernels are deterministic",
              !cuda_act_bf16 ? "fp32 activations" : att_mode == ATT_SIMT ? "precision.attention simt"
              : att_mode == ATT_TENSOR_CORES ? "precision.attention tensor_cores"
              : att_cudnn_why[0] ? att_cudnn_why : "not kept");
}
static void att_choose_paths(void) {
    att_usable[PATH_SIMT] = 1;
    att_usable[PATH_TC] = att_usable[PATH_CUDNN] = 0;
    att_n_shapes = att_overflow_noted = 0;
    att_cudnn_why[0] = '\0';
    if (!cuda_act_bf16) {
        if (att_mode == ATT_TENSOR_CORES || att_mode == ATT_CUDNN)
            kiln_fail(KILN_EXIT_USAGE, "key 'precision.attention': %s needs precision.compute bf16 (it reads bf16 "
                                       "activations)", att_mode_names[att_mode]);
        snprintf(att_desc, sizeof att_desc, "attention: SIMT kernels (fp32 activations)");
        return;
    }
    if (att_mode == ATT_SIMT) {
        snprintf(att_desc, sizeof att_desc, "attention: SIMT kernels (precision.attention simt)");
        return;
    }
    if (att_mode == ATT_AUTO || att_mode == ATT_TENSOR_CORES) att_choose_tc();
    if (att_mode == ATT_AUTO || att_mode == ATT_CUDNN) att_choose_cudnn();
    char ftc[200] = "", fdnn[200] = "";
    if (att_check[PATH_TC].ran) att_figures(PATH_TC, ftc, sizeof ftc);
    if (att_check[PATH_CUDNN].ran) att_figures(PATH_CUDNN, fdnn, sizeof fdnn);
    const char *nd = att_deterministic ? "" : "; cuDNN's backward non-deterministic (precision.attention_deterministic false)";
    if (att_mode == ATT_CUDNN)
        snprintf(att_desc, sizeof att_desc, "attention: cuDNN fused attention (%s; head sizes 8..128 in steps of 8, "
                 "else SIMT; %s%s)", cuda_attention_cudnn_library(), fdnn, nd);
    else if (att_mode == ATT_TENSOR_CORES)
        snprintf(att_desc, sizeof att_desc, "attention: %s%s%s)",
                 att_usable[PATH_TC] ? "tensor cores (forced by precision.attention" : "SIMT kernels (tensor cores "
                                                                                       "do not fit this GPU",
                 ftc[0] ? "; " : "", ftc);
    else
        snprintf(att_desc, sizeof att_desc, "attention: auto, the first that takes the shape among %s%s%s "
                 "(tensor cores %s%s%s; cuDNN %s%s%.400s%s)",
                 att_usable[PATH_CUDNN] ? "cudnn, " : "", att_usable[PATH_TC] ? "tensor_cores, " : "", "simt",
                 att_usable[PATH_TC] ? "passed" : "refused", ftc[0] ? ": " : "", ftc,
                 att_usable[PATH_CUDNN] ? "passed" : "refused", ": ",
                 att_usable[PATH_CUDNN] ? fdnn : (att_cudnn_why[0] ? att_cudnn_why : fdnn), att_usable[PATH_CUDNN] ? nd : "");
}

void cuda_attention_set_mode(const char *mode) {
    int m = -1;
    for (int i = 0; i < ATT_MODES; i++)
        if (strcmp(mode, att_mode_names[i]) == 0) m = i;
    if (m < 0)
        kiln_fail(KILN_EXIT_USAGE, "key 'precision.attention': '%s' is not one of auto|cudnn|tensor_cores|simt", mode);
    att_mode = m;
    if (att_precision_set) att_choose();
}

void cuda_attention_set_deterministic(int deterministic) {
    att_deterministic = deterministic != 0;
    cuda_attention_cudnn_set_deterministic(att_deterministic);
    att_check[PATH_CUDNN].ran = 0; /* another backward graph: checked again */
    if (att_precision_set) att_choose();
}

void cuda_attention_precision_changed(void) {
    att_precision_set = 1;
    att_choose();
}

const char *cuda_attention_describe(void) { return att_desc; }

void cuda_attention_reset(void) {
    att_mode = ATT_AUTO;
    att_deterministic = 1;
    att_precision_set = att_n_shapes = att_overflow_noted = 0;
    memset(att_usable, 0, sizeof att_usable);
    memset(att_check, 0, sizeof att_check);
    snprintf(att_desc, sizeof att_desc, "attention: SIMT kernels");
    cuda_attention_cudnn_reset();
}

/* 16-byte vector loads of qkv and dout (attention_tc.cu, cuDNN's alignment). */
static int att_aligned(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* Whether path p can take this shape at all (alignment is checked per call):
 * kiln's cuDNN graphs have one K/V head per query head (NKV = NH). */
static int att_path_fits(int p, int C, int NH, int NKV) {
    return p == PATH_SIMT || (p == PATH_TC && cuda_attention_tc_fits(C / NH)) ||
           (p == PATH_CUDNN && NKV == NH && cuda_attention_cudnn_fits(C, NH));
}

/* The tensor cores where they are usable for head size hs, else SIMT: what
 * runs where cuDNN does not (grouped K/V heads, documents, a failed execute). */
static int att_kiln_path(int hs) { return att_usable[PATH_TC] && cuda_attention_tc_fits(hs) ? PATH_TC : PATH_SIMT; }

/* auto at a new shape: the first usable path that takes it, in the order of
 * PATH_*; cuDNN only where it can plan the shape. Logs one line. */
static int att_pick(int B, int T, int C, int NH, int NKV) {
    char note[700] = "";
    int path = PATH_SIMT;
    for (int p = 0; p < PATH_COUNT; p++) {
        if (!att_usable[p] || !att_path_fits(p, C, NH, NKV)) continue;
        char why[640];
        if (p == PATH_CUDNN && !cuda_attention_cudnn_plan(B, T, C, NH, why, sizeof why)) {
            snprintf(note, sizeof note, " (cudnn: %s)", why);
            continue;
        }
        path = p;
        break;
    }
    printf("attention: B=%d T=%d NH=%d%s hs=%d: %s%s\n", B, T, NH, NKV == NH ? "" : " (grouped K/V)", C / NH,
           att_path_names[path], note);
    fflush(stdout);
    return path;
}

/* The path for this shape: chosen at its first call (see the top). */
static int att_path(int B, int T, int C, int NH, int NKV) {
    if (!cuda_act_bf16 || att_mode == ATT_SIMT) return PATH_SIMT;
    for (int i = 0; i < att_n_shapes; i++)
        if (att_shapes[i].B == B && att_shapes[i].T == T && att_shapes[i].C == C && att_shapes[i].NH == NH &&
            att_shapes[i].NKV == NKV)
            return att_shapes[i].path;
    int tc = att_kiln_path(C / NH);
    if (att_n_shapes == ATT_SHAPES) {
        if (!att_overflow_noted)
            printf("attention: more than %d shapes (generation's growing context): the others run %s\n", ATT_SHAPES,
                   att_path_names[tc]);
        att_overflow_noted = 1;
        return tc;
    }
    int path = tc;
    if (att_mode == ATT_CUDNN && NKV == NH) { /* grouped K/V heads: kiln's kernels (docs/gpu.md) */
        char why[640];
        if (!cuda_attention_cudnn_fits(C, NH))
            kiln_fail(KILN_EXIT_USAGE, "key 'precision.attention': cudnn needs a head size (model.n_embd / "
                                       "model.n_head) that is a multiple of 8 up to 128, not %d", C / NH);
        if (!cuda_attention_cudnn_plan(B, T, C, NH, why, sizeof why))
            kiln_fail(KILN_EXIT_RUNTIME, "key 'precision.attention': cudnn: no cuDNN engine runs attention at B=%d "
                                         "T=%d NH=%d hs=%d: %s", B, T, NH, C / NH, why);
        path = PATH_CUDNN;
    } else if (att_mode == ATT_AUTO) {
        path = att_pick(B, T, C, NH, NKV);
    }
    att_shapes[att_n_shapes].B = B, att_shapes[att_n_shapes].T = T, att_shapes[att_n_shapes].C = C;
    att_shapes[att_n_shapes].NH = NH, att_shapes[att_n_shapes].NKV = NKV, att_shapes[att_n_shapes].path = path;
    att_n_shapes++;
    return path;
}

/* cuDNN's execute failed at a shape it had planned (att_exec_why): with
 * precision.attention cudnn the run ends; with auto one warning, and cuDNN
 * is dropped for this and every later shape, which the next path in auto's
 * order takes (tensor cores where usable, else SIMT). Returns that path. A
 * failure on one data-parallel rank only leaves its ranks on different
 * paths: losses then differ by the paths' rounding, within the self-check's
 * tolerance, and the run goes on. */
static int att_cudnn_failed(int B, int T, int C, int NH) {
    (void)cudaGetLastError(); /* a failed launch inside cuDNN is not the next kernel's error */
    if (att_mode == ATT_CUDNN)
        kiln_fail(KILN_EXIT_RUNTIME, "key 'precision.attention': cudnn: attention at B=%d T=%d NH=%d hs=%d: %s", B, T,
                  NH, C / NH, att_exec_why);
    int fb = att_kiln_path(C / NH);
    kiln_warn("attention: cuDNN failed at B=%d T=%d NH=%d hs=%d (%s): kiln's %s kernels run attention from here on",
              B, T, NH, C / NH, att_exec_why, att_path_names[fb]);
    att_usable[PATH_CUDNN] = 0;
    for (int i = 0; i < att_n_shapes; i++)
        if (att_shapes[i].path == PATH_CUDNN) att_shapes[i].path = att_kiln_path(att_shapes[i].C / att_shapes[i].NH);
    return fb;
}

/* Grouped K/V heads (NKV < NH) never reach cuDNN (kiln's graphs assume
 * NKV = NH), nor does document masking (s->doc; the graphs know only the
 * causal mask): the shape's path is chosen without cuDNN, and a masked call
 * at a shape cuDNN runs takes the tensor cores if they are usable for it,
 * else SIMT. */
void cuda_attention_forward(void *out, float *lse, const void *qkv, const AttnShape *s) {
    int B = s->B, T = s->T, NH = s->NH, NKV = s->NKV, C = s->NH * s->HD;
    int p = att_path(B, T, C, NH, NKV);
    if (s->doc && p == PATH_CUDNN) p = att_kiln_path(s->HD);
    if (p != PATH_SIMT && (!att_aligned(qkv) || !att_aligned(out) || !att_path_fits(p, C, NH, NKV))) p = PATH_SIMT;
    if (!att_fwd[p](out, lse, qkv, s)) att_fwd[att_cudnn_failed(B, T, C, NH)](out, lse, qkv, s);
}

void cuda_attention_backward(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                             const AttnShape *s) {
    int B = s->B, T = s->T, NH = s->NH, NKV = s->NKV, C = s->NH * s->HD;
    int p = att_path(B, T, C, NH, NKV);
    if (s->doc && p == PATH_CUDNN) p = att_kiln_path(s->HD);
    if (p != PATH_SIMT && (!att_aligned(qkv) || !att_aligned(dout) || !att_aligned(out) || !att_aligned(dqkv) ||
                           !att_path_fits(p, C, NH, NKV)))
        p = PATH_SIMT;
    /* after a failed cuDNN backward the fallback reads cuDNN's out and lse:
     * the same quantities (the self-check holds lse to the SIMT kernels') */
    if (!att_bwd[p](dqkv, dout, qkv, out, lse, s)) att_bwd[att_cudnn_failed(B, T, C, NH)](dqkv, dout, qkv, out, lse, s);
}
