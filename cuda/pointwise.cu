/* pointwise: GeLU, the adds, the fp32 -> activation-dtype cast, fused
 * softmax + cross-entropy, AdamW, Lion, Muon's elementwise steps (and
 * Newton-Schulz's ends), Adafactor's, the sum of squares and the step's
 * device scalars. Activations in either dtype (templates on T_), arithmetic
 * in fp32; AdamW and sumsq are fp32 only (AdamW's moments, and with
 * precision.master bf16 its parameters, may be bf16). Each mirrors the CPU
 * backend's formula in the same order; AdamW and Lion are written with
 * explicitly rounded intrinsics (no FMA contraction) so their updates are
 * the CPU's bit for bit. Reductions run in a fixed tree: the same bits every
 * run. GeLU, the adds, the cast and the optimizers move 128 bits per load
 * and store where their pointers are aligned. */
#include <string.h>

#include "common.cuh"
#include "clip.h" /* after common.cuh: backend.h with C linkage */
#include "sround.h"

#define GELU_SCALE 0.7978845608028654f /* sqrt(2/pi) */

static unsigned grid_for(size_t n, unsigned threads) {
    unsigned b = cuda_blocks(n, threads);
    return b > 65536 ? 65536 : b; /* grid-stride loops cover the rest */
}
#define GRID_STRIDE(i, n)                                                                     \
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n);                   \
         i += (size_t)gridDim.x * blockDim.x)

/* The elementwise kernels take 16-byte packs (common.cuh: Pack, pack_load,
 * pack_store, aligned16) over the first n / PACK * PACK elements when every
 * pointer is 16-byte aligned (the host checks; arena buffers are), then single
 * elements for the tail, or for everything when a pointer is not aligned. The
 * math per element is the scalar code's, so the result is the same bits
 * either way. */
/* Packs to take over n elements given the pointers' alignment, and a grid for
 * the larger of the packed and the tail loops. */
template <typename T_> static size_t packs_for(size_t n, int aligned) { return aligned ? n / PACK(T_) : 0; }
template <typename T_> static unsigned grid_packed(size_t n, size_t packs) {
    size_t tail = n - packs * PACK(T_);
    return grid_for(packs > tail ? packs : tail, 256);
}
/* Elements [i0, n), grid-strided: the tail after the packs. */
#define GRID_STRIDE_FROM(i, i0, n)                                                            \
    for (size_t i = (i0) + blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n);            \
         i += (size_t)gridDim.x * blockDim.x)

__device__ __forceinline__ float gelu_f(float x) {
    float u = GELU_SCALE * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.0f + tanhf(u));
}
__device__ __forceinline__ float gelu_grad_f(float x, float d) {
    float u = GELU_SCALE * (x + 0.044715f * x * x * x);
    float th = tanhf(u);
    float sech2 = 1.0f - th * th;
    float du = GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
    return d * (0.5f * (1.0f + th) + 0.5f * x * sech2 * du);
}

template <typename T_>
__global__ void gelu_forward_kernel(T_ *out, const T_ *inp, size_t n, size_t packs) {
    GRID_STRIDE(i, packs) {
        Pack<T_> x = pack_load(inp + i * PACK(T_)), o;
#pragma unroll
        for (int k = 0; k < (int)PACK(T_); k++) o.v[k] = act_from<T_>(gelu_f(act_f(x.v[k])));
        pack_store(out + i * PACK(T_), o);
    }
    GRID_STRIDE_FROM(i, packs * PACK(T_), n) out[i] = act_from<T_>(gelu_f(act_f(inp[i])));
}

template <typename T_>
__global__ void gelu_backward_kernel(T_ *dinp, const T_ *inp, const T_ *dout, size_t n, size_t packs) {
    GRID_STRIDE(i, packs) {
        Pack<T_> x = pack_load(inp + i * PACK(T_)), d = pack_load(dout + i * PACK(T_)), o;
#pragma unroll
        for (int k = 0; k < (int)PACK(T_); k++) o.v[k] = act_from<T_>(gelu_grad_f(act_f(x.v[k]), act_f(d.v[k])));
        pack_store(dinp + i * PACK(T_), o);
    }
    GRID_STRIDE_FROM(i, packs * PACK(T_), n) dinp[i] = act_from<T_>(gelu_grad_f(act_f(inp[i]), act_f(dout[i])));
}

template <typename T_>
__global__ void add_kernel(T_ *out, const T_ *a, const T_ *b, size_t n, size_t packs) {
    GRID_STRIDE(i, packs) {
        Pack<T_> x = pack_load(a + i * PACK(T_)), y = pack_load(b + i * PACK(T_)), o;
#pragma unroll
        for (int k = 0; k < (int)PACK(T_); k++) o.v[k] = act_from<T_>(act_f(x.v[k]) + act_f(y.v[k]));
        pack_store(out + i * PACK(T_), o);
    }
    GRID_STRIDE_FROM(i, packs * PACK(T_), n) out[i] = act_from<T_>(act_f(a[i]) + act_f(b[i]));
}

/* fp32 -> bf16, round to nearest even (the compute copy of the parameters):
 * packs of 8 outputs from two 16-byte loads. */
__global__ void cast_bf16_kernel(bf16 *dst, const float *src, size_t n, size_t packs) {
    GRID_STRIDE(i, packs) {
        Pack<float> x0 = pack_load(src + i * 8), x1 = pack_load(src + i * 8 + 4);
        Pack<bf16> o;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            o.v[k] = __float2bfloat16_rn(x0.v[k]);
            o.v[k + 4] = __float2bfloat16_rn(x1.v[k]);
        }
        pack_store(dst + i * 8, o);
    }
    GRID_STRIDE_FROM(i, packs * PACK(bf16), n) dst[i] = __float2bfloat16_rn(src[i]);
}

template <typename T_>
static void gelu_forward_run(void *out, const void *inp, size_t n) {
    size_t packs = packs_for<T_>(n, aligned16(out) && aligned16(inp));
    KLAUNCH(gelu_forward_kernel<T_>, grid_packed<T_>(n, packs), 256, 0, (T_ *)out, (const T_ *)inp, n, packs);
    CUDA_CHECK_LAUNCH();
}
template <typename T_>
static void gelu_backward_run(void *dinp, const void *inp, const void *dout, size_t n) {
    size_t packs = packs_for<T_>(n, aligned16(dinp) && aligned16(inp) && aligned16(dout));
    KLAUNCH(gelu_backward_kernel<T_>, grid_packed<T_>(n, packs), 256, 0, (T_ *)dinp, (const T_ *)inp,
            (const T_ *)dout, n, packs);
    CUDA_CHECK_LAUNCH();
}
template <typename T_>
static void add_run(void *out, const void *a, const void *b, size_t n) {
    size_t packs = packs_for<T_>(n, aligned16(out) && aligned16(a) && aligned16(b));
    KLAUNCH(add_kernel<T_>, grid_packed<T_>(n, packs), 256, 0, (T_ *)out, (const T_ *)a, (const T_ *)b, n, packs);
    CUDA_CHECK_LAUNCH();
}

void cuda_gelu_forward(void *out, const void *inp, size_t n) {
    if (n) ACT_DISPATCH(gelu_forward_run, out, inp, n);
}
void cuda_gelu_backward(void *dinp, const void *inp, const void *dout, size_t n) {
    if (n) ACT_DISPATCH(gelu_backward_run, dinp, inp, dout, n);
}
void cuda_residual_forward(void *out, const void *a, const void *b, size_t n) {
    if (n) ACT_DISPATCH(add_run, out, a, b, n);
}
void cuda_add(float *out, const float *a, const float *b, size_t n) {
    if (n) add_run<float>(out, a, b, n);
}
void cuda_cast_to_act(void *dst, const float *src, size_t n) {
    if (!n) return;
    if (!cuda_act_bf16) {
        CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, 0));
        return;
    }
    size_t packs = packs_for<bf16>(n, aligned16(dst) && aligned16(src));
    KLAUNCH(cast_bf16_kernel, grid_packed<bf16>(n, packs), 256, 0, (bf16 *)dst, src, n, packs);
    CUDA_CHECK_LAUNCH();
}

/* ---------------------------------------------------------------------------
 * Softmax + cross-entropy, one block per row: max and sum of exp in one pass
 * (each thread keeps its own running max and a sum scaled to it, combined
 * over the block at the end), the loss, and (if dloss != 0) dlogits =
 * (softmax - onehot) * dloss in place, zero padding: two passes over the
 * row, the second mostly from L2, where a max pass, a sum pass and a write
 * pass read the (Vp) row three times. At GPT-2 scale the logits are N x 50304
 * bf16, 1.6 GB: the op is one of a step's largest memory-bound items
 * (docs/benchmarks.md). Rows move in 16-byte packs when the row stride and
 * the pointer allow, else element by element; the math per element is the
 * same either way. fmaxf-style compares skip NaN as the CPU's compare does;
 * a NaN logit still reaches the loss through the sum. */
#define CE_THREADS 512

/* x folded into a thread's running (max m, sum s of exp(x_i - m)). */
__device__ __forceinline__ void ce_online(float x, float &m, float &s) {
    if (x > m) {
        s = s * expf(m - x) + 1.0f; /* m = -inf at first: s = 0 * 0 + 1 */
        m = x;
    } else if (x != -INFINITY) {
        s += expf(x - m); /* NaN x: NaN, as on the CPU */
    }
}

template <typename T_>
__global__ void crossentropy_kernel(T_ *logits, float *losses, const int32_t *targets, int V, int Vp,
                                    float dloss, int packed) {
    __shared__ float red[32];
    T_ *x = logits + (size_t)blockIdx.x * Vp;
    const int P = (int)PACK(T_);
    int tg = targets[blockIdx.x];
    float xt = act_f(x[tg]); /* read before any thread writes the row */
    float m = -INFINITY, s = 0.0f;
    if (packed) {
        for (int i = threadIdx.x; i < Vp / P; i += blockDim.x) {
            Pack<T_> p = pack_load(x + (size_t)i * P);
#pragma unroll
            for (int k = 0; k < P; k++)
                if (i * P + k < V) ce_online(act_f(p.v[k]), m, s);
        }
    } else {
        for (int j = threadIdx.x; j < V; j += blockDim.x) ce_online(act_f(x[j]), m, s);
    }
    float mx = block_max(m, red);
    s = block_sum(m == -INFINITY ? 0.0f : s * expf(m - mx), red);
    /* block_sum's barriers also order every read of xt before the writes */
    if (threadIdx.x == 0) losses[blockIdx.x] = mx + logf(s) - xt;
    if (dloss == 0.0f) return;
    float k = dloss / s;
    if (packed) {
        for (int i = threadIdx.x; i < Vp / P; i += blockDim.x) {
            Pack<T_> p = pack_load(x + (size_t)i * P);
#pragma unroll
            for (int e = 0; e < P; e++) {
                int j = i * P + e;
                float g = expf(act_f(p.v[e]) - mx) * k;
                p.v[e] = act_from<T_>(j >= V ? 0.0f : j == tg ? g - dloss : g);
            }
            pack_store(x + (size_t)i * P, p);
        }
    } else {
        for (int j = threadIdx.x; j < V; j += blockDim.x) {
            float g = expf(act_f(x[j]) - mx) * k;
            x[j] = act_from<T_>(j == tg ? g - dloss : g);
        }
        for (int j = V + threadIdx.x; j < Vp; j += blockDim.x) x[j] = act_from<T_>(0.0f);
    }
}

template <typename T_>
static void crossentropy_run(void *logits, float *losses, const int32_t *targets, int N, int V, int Vp,
                             float dloss) {
    /* packs need every row to start 16-byte aligned and to hold whole packs */
    int packed = aligned16(logits) && Vp % (int)PACK(T_) == 0;
    KLAUNCH(crossentropy_kernel<T_>, N, CE_THREADS, 0, (T_ *)logits, losses, targets, V, Vp, dloss, packed);
    CUDA_CHECK_LAUNCH();
}

void cuda_crossentropy_forward(void *logits, float *losses, const int32_t *targets, int N, int V,
                               int Vp, float dloss) {
    if (N > 0) ACT_DISPATCH(crossentropy_run, logits, losses, targets, N, V, Vp, dloss);
}

/* Vocabulary-parallel cross-entropy (tensor parallelism; backend.h), one
 * block per row like the kernel above. Part 1: this rank's (max, sum of exp
 * scaled to it, target logit or 0). */
template <typename T_>
__global__ void xent_partial_kernel(float *stats, const T_ *logits, const int32_t *targets, int V, int Vp) {
    __shared__ float red[32];
    const T_ *x = logits + (size_t)blockIdx.x * Vp;
    float m = -INFINITY, s = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) ce_online(act_f(x[j]), m, s);
    float mx = block_max(m, red);
    s = block_sum(m == -INFINITY ? 0.0f : s * expf(m - mx), red);
    if (threadIdx.x == 0) {
        int tg = targets[blockIdx.x];
        float *st = stats + (size_t)blockIdx.x * 3;
        st[0] = mx, st[1] = s, st[2] = tg >= 0 ? act_f(x[tg]) : 0.0f;
    }
}

/* Part 2: every rank's stats of the row (rank order, as the CPU combines
 * them), the loss, and dlogits of this rank's columns in place. */
template <typename T_>
__global__ void xent_finish_kernel(T_ *logits, float *losses, const float *stats_all, int P, const int32_t *targets,
                                   int N, int V, int Vp, float dloss) {
    int i = blockIdx.x;
    float mx = -INFINITY, s = 0.0f, xt = 0.0f;
    for (int p = 0; p < P; p++) mx = fmaxf(mx, stats_all[((size_t)p * N + i) * 3]);
    for (int p = 0; p < P; p++) {
        const float *st = stats_all + ((size_t)p * N + i) * 3;
        if (st[1] > 0.0f) s += st[1] * expf(st[0] - mx);
        xt += st[2];
    }
    if (threadIdx.x == 0) losses[i] = mx + logf(s) - xt;
    if (dloss == 0.0f) return;
    T_ *x = logits + (size_t)i * Vp;
    int tg = targets[i];
    float k = dloss / s;
    for (int j = threadIdx.x; j < Vp; j += blockDim.x) {
        float g = j < V ? expf(act_f(x[j]) - mx) * k : 0.0f;
        x[j] = act_from<T_>(j == tg ? g - dloss : g);
    }
}

template <typename T_>
static void xent_partial_run(float *stats, const void *logits, const int32_t *targets, int N, int V, int Vp) {
    KLAUNCH(xent_partial_kernel<T_>, N, CE_THREADS, 0, stats, (const T_ *)logits, targets, V, Vp);
    CUDA_CHECK_LAUNCH();
}

template <typename T_>
static void xent_finish_run(void *logits, float *losses, const float *stats_all, int P, const int32_t *targets, int N,
                            int V, int Vp, float dloss) {
    KLAUNCH(xent_finish_kernel<T_>, N, CE_THREADS, 0, (T_ *)logits, losses, stats_all, P, targets, N, V, Vp, dloss);
    CUDA_CHECK_LAUNCH();
}

void cuda_xent_partial(float *stats, const void *logits, const int32_t *targets, int N, int V, int Vp) {
    if (N > 0) ACT_DISPATCH(xent_partial_run, stats, logits, targets, N, V, Vp);
}

void cuda_xent_finish(void *logits, float *losses, const float *stats_all, int P, const int32_t *targets, int N, int V,
                      int Vp, float dloss) {
    if (N > 0) ACT_DISPATCH(xent_finish_run, logits, losses, stats_all, P, targets, N, V, Vp, dloss);
}

/* ---------------------------------------------------------------------------
 * The elementwise optimizers (backend.h adamw_update, adamw_update_bf16,
 * adamw_update_p16, lion_update): the CPU backend's expressions with each
 * operation rounded on its own, so both give the same bits. One kernel per
 * optimizer reads and writes every buffer once: 8 elements per thread and
 * pass through 16-byte loads and stores (two of fp32, one of bf16) when
 * every pointer is 16-byte aligned (the arena's tensors are), the rest one
 * by one with the same math. The clipping factor is an argument, or read
 * with the skip flag from the step's device scalars (StepScalars), so the
 * host never waits for the norm. With a compute copy (C_: the act dtype),
 * the new fp32 parameter rounded to act goes out in the same pass: the
 * cast kernel's bits, without its second read of the master. */

/* What every element's update takes; b1c = 1 - beta1 and b2c = 1 - beta2
 * in float, as the CPU computes them; bc1, bc2 the bias corrections of step
 * t; seed and idx0 key the stochastic rounding of bf16 moments and
 * parameters (sround.h). */
struct OptArgs {
    float lr, beta1, beta2, b1c, b2c, eps, wd, grad_scale, bc1, bc2;
    uint64_t t, seed, idx0;
};

static OptArgs opt_args(float lr, float beta1, float beta2, float eps, float wd, float grad_scale, int t,
                        uint64_t seed, uint64_t idx0) {
    OptArgs a = {lr, beta1, beta2, 1.0f - beta1, 1.0f - beta2, eps, wd, grad_scale, 1.0f, 1.0f, (uint64_t)t,
                 seed, idx0};
    if (t > 0) { /* bias corrections once, in double, as the CPU does */
        a.bc1 = (float)(1.0 - pow((double)beta1, t));
        a.bc2 = (float)(1.0 - pow((double)beta2, t));
    }
    return a;
}

/* 8 consecutive elements, moved in 16-byte packs. */
template <typename T_> struct Oct {
    T_ v[8];
};
template <typename T_> __device__ __forceinline__ Oct<T_> oct_load(const T_ *p) {
    Oct<T_> x;
#pragma unroll
    for (int k = 0; k < 8; k += (int)PACK(T_)) {
        Pack<T_> q = pack_load(p + k);
#pragma unroll
        for (int j = 0; j < (int)PACK(T_); j++) x.v[k + j] = q.v[j];
    }
    return x;
}
template <typename T_> __device__ __forceinline__ void oct_store(T_ *p, const Oct<T_> &x) {
#pragma unroll
    for (int k = 0; k < 8; k += (int)PACK(T_)) {
        Pack<T_> q;
#pragma unroll
        for (int j = 0; j < (int)PACK(T_); j++) q.v[j] = x.v[k + j];
        pack_store(p + k, q);
    }
}

/* A moment or parameter held as fp32, or as bf16 bits (uint16_t) widened
 * exactly and stored rounded stochastically with the random bits r. */
__device__ __forceinline__ float opt_load(float x) { return x; }
__device__ __forceinline__ float opt_load(uint16_t x) { return sround_f32(x); }
__device__ __forceinline__ void opt_store(float &d, float x, uint32_t) { d = x; }
__device__ __forceinline__ void opt_store(uint16_t &d, float x, uint32_t r) { d = sround_bf16(x, r); }

/* The step's clipping factor: the argument, or the device scalars' (0 when
 * they say skip: the caller then changes nothing). */
__device__ __forceinline__ int opt_scale(const StepScalars *st, float *gs) {
    if (!st) return 1;
    if (st->skip) return 0;
    *gs = st->scale;
    return 1;
}

/* One AdamW element i of the range (P_, S_: the parameter's and the
 * moments' storage); returns the new parameter in fp32. The random bits of
 * bf16 storage: the hash's bits 0..15 for m, 16..31 for v, 32..47 for p. */
template <typename P_, typename S_>
__device__ __forceinline__ float adamw_elem(P_ &p, float grad, S_ &m, S_ &v, const OptArgs &a, float gs,
                                            size_t i) {
    float g = __fmul_rn(grad, gs);
    float mi = __fadd_rn(__fmul_rn(a.beta1, opt_load(m)), __fmul_rn(a.b1c, g));
    float vi = __fadd_rn(__fmul_rn(a.beta2, opt_load(v)), __fmul_rn(__fmul_rn(a.b2c, g), g));
    uint64_t r = sizeof(P_) == 2 || sizeof(S_) == 2 ? sround_hash(a.seed, a.t, a.idx0 + i) : 0;
    opt_store(m, mi, (uint32_t)r);
    opt_store(v, vi, (uint32_t)(r >> 16));
    float mhat = __fdiv_rn(mi, a.bc1), vhat = __fdiv_rn(vi, a.bc2);
    float pv = opt_load(p);
    float upd = __fadd_rn(__fdiv_rn(mhat, __fadd_rn(__fsqrt_rn(vhat), a.eps)), __fmul_rn(a.wd, pv));
    float pn = __fsub_rn(pv, __fmul_rn(a.lr, upd));
    opt_store(p, pn, (uint32_t)(r >> 32));
    return pn;
}

template <typename P_, typename S_, typename C_>
__global__ void adamw_kernel(P_ *params, const float *grads, S_ *m, S_ *v, C_ *copy, size_t n, size_t octs,
                             OptArgs a, const StepScalars *st) {
    float gs = a.grad_scale;
    if (!opt_scale(st, &gs)) return;
    GRID_STRIDE(k, octs) {
        size_t i = k * 8;
        Oct<P_> p = oct_load(params + i);
        Oct<float> g = oct_load(grads + i);
        Oct<S_> mm = oct_load(m + i), vv = oct_load(v + i);
        Oct<C_> c;
#pragma unroll
        for (int j = 0; j < 8; j++) c.v[j] = act_from<C_>(adamw_elem(p.v[j], g.v[j], mm.v[j], vv.v[j], a, gs, i + j));
        oct_store(params + i, p);
        oct_store(m + i, mm);
        oct_store(v + i, vv);
        if (copy) oct_store(copy + i, c);
    }
    GRID_STRIDE_FROM(i, octs * 8, n) {
        float pn = adamw_elem(params[i], grads[i], m[i], v[i], a, gs, i);
        if (copy) copy[i] = act_from<C_>(pn);
    }
}

/* Lion: p -= lr (sign(beta1 m + (1 - beta1) g) + wd p), then m = beta2 m + (1 - beta2) g. */
__device__ __forceinline__ float lion_elem(float &p, float grad, float &m, const OptArgs &a, float gs) {
    float g = __fmul_rn(grad, gs);
    float mi = m;
    float c = __fadd_rn(__fmul_rn(a.beta1, mi), __fmul_rn(a.b1c, g));
    float s = (float)((c > 0.0f) - (c < 0.0f));
    float pv = p;
    p = __fsub_rn(pv, __fmul_rn(a.lr, __fadd_rn(s, __fmul_rn(a.wd, pv))));
    m = __fadd_rn(__fmul_rn(a.beta2, mi), __fmul_rn(a.b2c, g));
    return p;
}

template <typename C_>
__global__ void lion_kernel(float *params, const float *grads, float *m, C_ *copy, size_t n, size_t octs, OptArgs a,
                            const StepScalars *st) {
    float gs = a.grad_scale;
    if (!opt_scale(st, &gs)) return;
    GRID_STRIDE(k, octs) {
        size_t i = k * 8;
        Oct<float> p = oct_load(params + i), g = oct_load(grads + i), mm = oct_load(m + i);
        Oct<C_> c;
#pragma unroll
        for (int j = 0; j < 8; j++) c.v[j] = act_from<C_>(lion_elem(p.v[j], g.v[j], mm.v[j], a, gs));
        oct_store(params + i, p);
        oct_store(m + i, mm);
        if (copy) oct_store(copy + i, c);
    }
    GRID_STRIDE_FROM(i, octs * 8, n) {
        float pn = lion_elem(params[i], grads[i], m[i], a, gs);
        if (copy) copy[i] = act_from<C_>(pn);
    }
}

/* Whole octs when every pointer allows them, and a grid for the larger of
 * the octs and the tail. */
static size_t opt_octs(size_t n, int aligned) { return aligned ? n / 8 : 0; }
static unsigned opt_grid(size_t n, size_t octs) {
    size_t tail = n - octs * 8;
    return grid_for(octs > tail ? octs : tail, 256);
}

/* The launches, C_ the compute copy's type: act (ACT_DISPATCH), or bf16
 * with no copy. A copy equal to the parameters (fp32 act: model.c aliases
 * the master) is not written twice. */
template <typename C_, typename P_, typename S_>
static void adamw_run(P_ *params, const float *grads, S_ *m, S_ *v, void *copy, size_t n, const OptArgs &a,
                      const StepScalars *st) {
    C_ *c = copy == (void *)params ? NULL : (C_ *)copy;
    int aligned = aligned16(params) && aligned16(grads) && aligned16(m) && aligned16(v) && (!c || aligned16(c));
    size_t octs = opt_octs(n, aligned);
    KLAUNCH((adamw_kernel<P_, S_, C_>), opt_grid(n, octs), 256, 0, params, grads, m, v, c, n, octs, a, st);
    CUDA_CHECK_LAUNCH();
}

template <typename C_>
static void lion_run(float *params, const float *grads, float *m, void *copy, size_t n, const OptArgs &a,
                     const StepScalars *st) {
    C_ *c = copy == (void *)params ? NULL : (C_ *)copy;
    int aligned = aligned16(params) && aligned16(grads) && aligned16(m) && (!c || aligned16(c));
    size_t octs = opt_octs(n, aligned);
    KLAUNCH(lion_kernel<C_>, opt_grid(n, octs), 256, 0, params, grads, m, c, n, octs, a, st);
    CUDA_CHECK_LAUNCH();
}

void cuda_adamw_update(float *params, const float *grads, float *m, float *v, size_t n, float lr, float beta1,
                       float beta2, float eps, float weight_decay, float grad_scale, int t, const StepScalars *st,
                       void *copy) {
    if (!n) return;
    OptArgs a = opt_args(lr, beta1, beta2, eps, weight_decay, grad_scale, t, 0, 0);
    ACT_DISPATCH(adamw_run, params, grads, m, v, copy, n, a, st);
}

void cuda_lion_update(float *params, const float *grads, float *m, size_t n, float lr, float beta1, float beta2,
                      float weight_decay, float grad_scale, const StepScalars *st, void *copy) {
    if (!n) return;
    OptArgs a = opt_args(lr, beta1, beta2, 0.0f, weight_decay, grad_scale, 0, 0, 0);
    ACT_DISPATCH(lion_run, params, grads, m, copy, n, a, st);
}

/* bf16 moments: read into fp32, stored through sround_bf16 with the CPU's random bits. */
void cuda_adamw_update_bf16(float *params, const float *grads, uint16_t *m, uint16_t *v, size_t n, float lr,
                            float beta1, float beta2, float eps, float weight_decay, float grad_scale, int t,
                            uint64_t seed, uint64_t idx0, const StepScalars *st, void *copy) {
    if (!n) return;
    OptArgs a = opt_args(lr, beta1, beta2, eps, weight_decay, grad_scale, t, seed, idx0);
    ACT_DISPATCH(adamw_run, params, grads, m, v, copy, n, a, st);
}

/* bf16 parameters (precision.master bf16): read into fp32, stored through
 * sround_bf16 with bits 32..47 of the element's hash; moments fp32 or bf16;
 * no copy (the parameters are the compute copy). */
void cuda_adamw_update_p16(uint16_t *params, const float *grads, void *m, void *v, size_t state_bytes, size_t n,
                           float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale, int t,
                           uint64_t seed, uint64_t idx0, const StepScalars *st) {
    if (!n) return;
    OptArgs a = opt_args(lr, beta1, beta2, eps, weight_decay, grad_scale, t, seed, idx0);
    if (state_bytes == 2) adamw_run<bf16>(params, grads, (uint16_t *)m, (uint16_t *)v, NULL, n, a, st);
    else adamw_run<bf16>(params, grads, (float *)m, (float *)v, NULL, n, a, st);
}

/* ---------------------------------------------------------------------------
 * Sum of squares in double: SUMSQ_BLOCKS fixed contiguous ranges (independent
 * of the device), each reduced by a fixed tree, then the partials in order. */
#define SUMSQ_BLOCKS 512
#define SUMSQ_THREADS 256

__device__ __forceinline__ double block_sum_d(double v, double *shared) {
    int lane = threadIdx.x % 32, wid = threadIdx.x / 32, nw = blockDim.x / 32;
    v = warp_sum_d(v);
    if (lane == 0) shared[wid] = v;
    __syncthreads();
    v = lane < nw ? shared[lane] : 0.0;
    return warp_sum_d(v);
}

__global__ void sumsq_partial_kernel(double *part, const float *x, size_t n) {
    __shared__ double red[32];
    size_t q = n / SUMSQ_BLOCKS, r = n % SUMSQ_BLOCKS, k = blockIdx.x;
    size_t i0 = q * k + (k < r ? k : r), i1 = i0 + q + (k < r ? 1 : 0);
    double s = 0.0;
    for (size_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) s += (double)x[i] * x[i];
    s = block_sum_d(s, red);
    if (threadIdx.x == 0) part[k] = s;
}

/* *result = (accumulate ? *result : 0) + the partials' sum */
__global__ void sumsq_final_kernel(double *result, const double *part, int accumulate) {
    __shared__ double red[32];
    double s = block_sum_d(part[threadIdx.x], red); /* blockDim.x == SUMSQ_BLOCKS */
    if (threadIdx.x == 0) *result = accumulate ? *result + s : s;
}

static void sumsq_to(double *result, const float *x, size_t n, int accumulate) {
    double *part = (double *)cuda_scratch(SCRATCH_SUMSQ, (SUMSQ_BLOCKS + 1) * sizeof(double));
    KLAUNCH(sumsq_partial_kernel, SUMSQ_BLOCKS, SUMSQ_THREADS, 0, part, x, n);
    CUDA_CHECK_LAUNCH();
    KLAUNCH(sumsq_final_kernel, 1, SUMSQ_BLOCKS, 0, result ? result : part + SUMSQ_BLOCKS, part, accumulate);
    CUDA_CHECK_LAUNCH();
}

double cuda_sumsq(const float *x, size_t n) {
    sumsq_to(NULL, x, n, 0);
    double s = 0.0, *part = (double *)cuda_scratch(SCRATCH_SUMSQ, (SUMSQ_BLOCKS + 1) * sizeof(double));
    CUDA_HOST_WAIT(cudaMemcpy(&s, part + SUMSQ_BLOCKS, sizeof s, cudaMemcpyDeviceToHost));
    return s;
}

/* The step's scalars (backend.h StepScalars), with no host wait: the sum of
 * squares added to a device double, the same partials and tree as sumsq's
 * (so the same bits); a micro-batch's mean loss, one block summing the N
 * losses in double in a fixed order (threads take rows tid, tid + 1024, ...,
 * then the block's tree), rounded to float as model_forward rounds it; and
 * the norm, clipping factor and skip flag by src/clip.h's rule, the host's. */
void cuda_sumsq_acc(double *acc, const float *x, size_t n) { sumsq_to(acc, x, n, 1); }

#define LOSS_THREADS 1024
/* bounds = its launch (one block of LOSS_THREADS): without them ptxas may
 * allocate more than 64 registers a thread, and a 1024-thread launch fails */
__global__ void __launch_bounds__(LOSS_THREADS) loss_acc_kernel(double *acc, const float *losses, int N) {
    __shared__ double red[32];
    double s = 0.0;
    for (int i = threadIdx.x; i < N; i += blockDim.x) s += (double)losses[i];
    s = block_sum_d(s, red);
    if (threadIdx.x == 0) *acc += (double)(float)(s / N);
}

void cuda_loss_acc(double *acc, const float *losses, int N) {
    if (N <= 0) return;
    KLAUNCH(loss_acc_kernel, 1, LOSS_THREADS, 0, acc, losses, N);
    CUDA_CHECK_LAUNCH();
}

__global__ void step_scalars_kernel(StepScalars *st, int micro, float grad_clip) {
    if (threadIdx.x == 0) clip_step_scalars(st, micro, grad_clip);
}

void cuda_step_scalars(StepScalars *st, int micro, float grad_clip) {
    KLAUNCH(step_scalars_kernel, 1, CUDA_WARP, 0, st, micro, grad_clip);
    CUDA_CHECK_LAUNCH();
}

/* ---------------------------------------------------------------------------
 * Muon (backend.h muon_momentum, muon_apply): the CPU backend's expressions
 * with each operation rounded on its own, so both give the same bits. u may
 * be grads (each element is read before it is written). */
__global__ void muon_momentum_kernel(float *u, float *m, const float *grads, size_t n, float mu, float grad_scale) {
    const float mc = 1.0f - mu;
    GRID_STRIDE(i, n) {
        float g = __fmul_rn(grads[i], grad_scale);
        float mi = __fadd_rn(__fmul_rn(mu, m[i]), __fmul_rn(mc, g));
        m[i] = mi;
        u[i] = __fadd_rn(__fmul_rn(mc, g), __fmul_rn(mu, mi));
    }
}

void cuda_muon_momentum(float *u, float *m, const float *grads, size_t n, float momentum, float grad_scale) {
    if (!n) return;
    KLAUNCH(muon_momentum_kernel, grid_for(n, 256), 256, 0, u, m, grads, n, momentum, grad_scale);
    CUDA_CHECK_LAUNCH();
}

__global__ void muon_apply_kernel(float *params, const float *o, size_t n, float lr, float scale, float wd) {
    GRID_STRIDE(i, n) {
        float p = params[i];
        params[i] = __fsub_rn(p, __fmul_rn(lr, __fadd_rn(__fmul_rn(scale, o[i]), __fmul_rn(wd, p))));
    }
}

void cuda_muon_apply(float *params, const float *o, size_t n, float lr, float scale, float weight_decay) {
    if (!n) return;
    KLAUNCH(muon_apply_kernel, grid_for(n, 256), 256, 0, params, o, n, lr, scale, weight_decay);
    CUDA_CHECK_LAUNCH();
}

/* Newton-Schulz's ends (matmul.cu runs the products). The Frobenius norm
 * stays on the device: the sumsq partials, then 1 / (sqrt(sum) + 1e-7) as a
 * float, read by the kernel that scales x (rows, cols) fp32 into X (a, b)
 * act, transposed when tr; cuda_ns_finish writes X back into x's layout. */
__global__ void ns_inv_norm_kernel(float *inv, const double *part) {
    __shared__ double red[32];
    double s = block_sum_d(part[threadIdx.x], red); /* blockDim.x == SUMSQ_BLOCKS */
    if (threadIdx.x == 0) *inv = (float)(1.0 / (sqrt(s) + 1e-7));
}

template <typename T_>
__global__ void ns_prepare_kernel(T_ *X, const float *x, const float *inv, int rows, int cols, int tr) {
    size_t n = (size_t)rows * cols, b = tr ? (size_t)rows : (size_t)cols;
    float s = *inv;
    GRID_STRIDE(e, n) { /* e indexes X (a, b): row p, column q */
        size_t p = e / b, q = e % b;
        X[e] = act_from<T_>(__fmul_rn(x[tr ? q * cols + p : p * cols + q], s));
    }
}

template <typename T_>
static void ns_prepare_run(void *X, const float *x, const float *inv, int rows, int cols, int tr) {
    KLAUNCH(ns_prepare_kernel<T_>, grid_for((size_t)rows * cols, 256), 256, 0, (T_ *)X, x, inv, rows, cols, tr);
    CUDA_CHECK_LAUNCH();
}

void cuda_ns_prepare(void *X, const float *x, int rows, int cols) {
    size_t n = (size_t)rows * cols;
    double *part = (double *)cuda_scratch(SCRATCH_NS, (SUMSQ_BLOCKS + 1) * sizeof(double));
    float *inv = (float *)(part + SUMSQ_BLOCKS);
    KLAUNCH(sumsq_partial_kernel, SUMSQ_BLOCKS, SUMSQ_THREADS, 0, part, x, n);
    CUDA_CHECK_LAUNCH();
    KLAUNCH(ns_inv_norm_kernel, 1, SUMSQ_BLOCKS, 0, inv, part);
    CUDA_CHECK_LAUNCH();
    ACT_DISPATCH(ns_prepare_run, X, x, inv, rows, cols, rows > cols);
}

template <typename T_>
__global__ void ns_finish_kernel(float *x, const T_ *X, int rows, int cols, int tr) {
    size_t n = (size_t)rows * cols, b = tr ? (size_t)rows : (size_t)cols;
    GRID_STRIDE(e, n) {
        size_t p = e / b, q = e % b;
        x[tr ? q * cols + p : p * cols + q] = act_f(X[e]);
    }
}

template <typename T_>
static void ns_finish_run(float *x, const void *X, int rows, int cols, int tr) {
    KLAUNCH(ns_finish_kernel<T_>, grid_for((size_t)rows * cols, 256), 256, 0, x, (const T_ *)X, rows, cols, tr);
    CUDA_CHECK_LAUNCH();
}

void cuda_ns_finish(float *x, const void *X, int rows, int cols) {
    ACT_DISPATCH(ns_finish_run, x, X, rows, cols, rows > cols);
}

/* ---------------------------------------------------------------------------
 * Adafactor (backend.h adafactor_*). The elementwise steps are the CPU
 * backend's expressions with each operation rounded on its own (the same
 * bits); the statistics and the update's sum of squares are sums in double
 * in a fixed tree (the same bits every run, the CPU's to a few ulps). */
__global__ void adafactor_rows_kernel(float *rows, const float *grads, size_t e0, size_t n, size_t C, size_t r0,
                                      size_t r1, float grad_scale, float eps1) {
    __shared__ double red[32];
    for (size_t i = r0 + blockIdx.x; i < r1; i += gridDim.x) {
        size_t a = i * C > e0 ? i * C : e0, b = (i + 1) * C < e0 + n ? (i + 1) * C : e0 + n;
        double s = 0.0;
        for (size_t e = a + threadIdx.x; e < b; e += blockDim.x) {
            float g = __fmul_rn(grads[e - e0], grad_scale);
            s += (double)__fadd_rn(__fmul_rn(g, g), eps1);
        }
        s = block_sum_d(s, red);
        if (threadIdx.x == 0) rows[i] = __fadd_rn(rows[i], (float)s);
        __syncthreads(); /* red is reused by the next row */
    }
}

__global__ void adafactor_cols_kernel(float *cols, const float *grads, size_t e0, size_t n, size_t C, size_t r0,
                                      size_t r1, float grad_scale, float eps1) {
    GRID_STRIDE(j, C) {
        double s = 0.0;
        int any = 0;
        for (size_t i = r0; i < r1; i++) {
            size_t e = i * C + j;
            if (e < e0 || e >= e0 + n) continue;
            float g = __fmul_rn(grads[e - e0], grad_scale);
            s += (double)__fadd_rn(__fmul_rn(g, g), eps1), any = 1;
        }
        if (any) cols[j] = __fadd_rn(cols[j], (float)s);
    }
}

void cuda_adafactor_stats(float *rows, float *cols, const float *grads, size_t e0, size_t n, int cols_n,
                          float grad_scale, float eps1) {
    if (!n) return;
    size_t C = (size_t)cols_n, r0 = e0 / C, r1 = (e0 + n - 1) / C + 1, nr = r1 - r0;
    KLAUNCH(adafactor_rows_kernel, nr < 65536 ? (unsigned)nr : 65536u, 256, 0, rows, grads, e0, n, C, r0, r1, grad_scale,
            eps1);
    CUDA_CHECK_LAUNCH();
    KLAUNCH(adafactor_cols_kernel, grid_for(C, 256), 256, 0, cols, grads, e0, n, C, r0, r1, grad_scale, eps1);
    CUDA_CHECK_LAUNCH();
}

__global__ void adafactor_ema_kernel(float *state, const float *sums, size_t n, float beta2, float scale) {
    const float b2c = 1.0f - beta2;
    GRID_STRIDE(i, n) state[i] = __fadd_rn(__fmul_rn(beta2, state[i]), __fmul_rn(b2c, __fmul_rn(scale, sums[i])));
}

void cuda_adafactor_ema(float *state, const float *sums, size_t n, float beta2, float scale) {
    if (!n) return;
    KLAUNCH(adafactor_ema_kernel, grid_for(n, 256), 256, 0, state, sums, n, beta2, scale);
    CUDA_CHECK_LAUNCH();
}

__global__ void adafactor_second_kernel(float *v, const float *grads, size_t n, float grad_scale, float beta2,
                                        float eps1) {
    const float b2c = 1.0f - beta2;
    GRID_STRIDE(i, n) {
        float g = __fmul_rn(grads[i], grad_scale);
        v[i] = __fadd_rn(__fmul_rn(beta2, v[i]), __fmul_rn(b2c, __fadd_rn(__fmul_rn(g, g), eps1)));
    }
}

void cuda_adafactor_second(float *v, const float *grads, size_t n, float grad_scale, float beta2, float eps1) {
    if (!n) return;
    KLAUNCH(adafactor_second_kernel, grid_for(n, 256), 256, 0, v, grads, n, grad_scale, beta2, eps1);
    CUDA_CHECK_LAUNCH();
}

__device__ __forceinline__ float adafactor_u(const float *grads, const float *v, const float *r, const float *c,
                                             float rmean, size_t e0, size_t k, size_t C, float grad_scale) {
    float g = __fmul_rn(grads[k], grad_scale);
    if (!r) return __fdiv_rn(g, __fsqrt_rn(v[k]));
    size_t e = e0 + k;
    return __fdiv_rn(__fdiv_rn(g, __fsqrt_rn(__fdiv_rn(r[e / C], rmean))), __fsqrt_rn(c[e % C]));
}

__global__ void adafactor_usq_partial_kernel(double *part, const float *grads, const float *v, const float *r,
                                             const float *c, float rmean, size_t e0, size_t n, size_t C,
                                             float grad_scale) {
    __shared__ double red[32];
    size_t q = n / SUMSQ_BLOCKS, rr = n % SUMSQ_BLOCKS, k = blockIdx.x;
    size_t i0 = q * k + (k < rr ? k : rr), i1 = i0 + q + (k < rr ? 1 : 0);
    double s = 0.0;
    for (size_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
        float u = adafactor_u(grads, v, r, c, rmean, e0, i, C, grad_scale);
        s += (double)u * u;
    }
    s = block_sum_d(s, red);
    if (threadIdx.x == 0) part[k] = s;
}

__global__ void adafactor_usq_final_kernel(double *out, const double *part) {
    __shared__ double red[32];
    double s = block_sum_d(part[threadIdx.x], red); /* blockDim.x == SUMSQ_BLOCKS */
    if (threadIdx.x == 0) *out = s;
}

void cuda_adafactor_usq(double *out, const float *grads, const float *v, const float *r, const float *c, float rmean,
                        size_t e0, size_t n, int cols_n, float grad_scale) {
    double *part = (double *)cuda_scratch(SCRATCH_ADAFACTOR, SUMSQ_BLOCKS * sizeof(double));
    KLAUNCH(adafactor_usq_partial_kernel, SUMSQ_BLOCKS, SUMSQ_THREADS, 0, part, grads, v, r, c, rmean, e0, n,
            (size_t)cols_n, grad_scale);
    CUDA_CHECK_LAUNCH();
    KLAUNCH(adafactor_usq_final_kernel, 1, SUMSQ_BLOCKS, 0, out, part);
    CUDA_CHECK_LAUNCH();
}

__global__ void adafactor_apply_kernel(float *params, const float *grads, float *m, const float *v, const float *r,
                                       const float *c, float rmean, size_t e0, size_t n, size_t C, float grad_scale,
                                       float inv_clip, float lr, float beta1, float wd) {
    const float b1c = 1.0f - beta1;
    GRID_STRIDE(k, n) {
        float u = __fmul_rn(adafactor_u(grads, v, r, c, rmean, e0, k, C, grad_scale), inv_clip);
        if (m) {
            float mk = __fadd_rn(__fmul_rn(beta1, m[k]), __fmul_rn(b1c, u));
            m[k] = mk;
            u = mk;
        }
        float p = params[k];
        params[k] = __fsub_rn(p, __fmul_rn(lr, __fadd_rn(u, __fmul_rn(wd, p))));
    }
}

void cuda_adafactor_apply(float *params, const float *grads, float *m, const float *v, const float *r, const float *c,
                          float rmean, size_t e0, size_t n, int cols_n, float grad_scale, float inv_clip, float lr,
                          float beta1, float weight_decay) {
    if (!n) return;
    KLAUNCH(adafactor_apply_kernel, grid_for(n, 256), 256, 0, params, grads, m, v, r, c, rmean, e0, n, (size_t)cols_n,
            grad_scale, inv_clip, lr, beta1, weight_decay);
    CUDA_CHECK_LAUNCH();
}
