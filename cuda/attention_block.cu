/* attention_block: block attention for context parallelism (backend.h's
 * AttnBlock): queries of one block against the keys of another, causal at
 * global positions, with a forward that merges into an earlier block's
 * output by log-sum-exp and a backward that adds into fp32 dq, dk, dv. SIMT
 * kernels around attention.cu's inner loops (attention_simt.cuh: its layout
 * of threads and dims, its fixed summation orders, no atomics), written for
 * any q and k/v row strides so q can be read out of a qkv buffer and k, v out
 * of a packed [k | v] one. Any dtype; head sizes up to 128.
 *
 * A block's keys sit at contiguous positions, so the keys a query sees are a
 * prefix [0, nv) of the block: nv = clamp(q_pos + i - k_pos + 1, 0, Tk).
 * Every row may see none (an empty prefix: the shared online softmax leaves
 * such a row at m = -inf, l = 0). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include "attention_simt.cuh"
#include "common.cuh"

/* Keys of the block that query row i sees: [0, attb_nv). */
__device__ __forceinline__ int attb_nv(const AttnBlock &s, int i) {
    int v = s.q_pos + i - s.k_pos + 1;
    return v < 0 ? 0 : v > s.Tk ? s.Tk : v;
}

/* The first key of the block query row i of sequence b sees: its document's
 * start (AttnBlock.q_doc) relative to the block, or 0. Rows see
 * [attb_first, attb_nv); both ends are nondecreasing in i, so a block's
 * first row gives the first key any of its rows sees. */
__device__ __forceinline__ int attb_first(const AttnBlock &s, int b, int i) {
    if (!s.q_doc || i >= s.Tq) return 0;
    int f = s.q_doc[(size_t)b * s.Tq + i] - s.k_pos;
    return f < 0 ? 0 : f > s.Tk ? s.Tk : f;
}

/* ---------------------------------------------------------------------------
 * Forward. Block: ATT_BR query rows of one (b, h); grid (B NH, ceil(Tq / ATT_BR)). */
template <int TPK, typename T_>
__global__ void __launch_bounds__(ATT_BR *TPK)
    attb_forward_kernel(T_ *out, float *lse, const T_ *q, const T_ *k, const T_ *v, AttnBlock s, float scale,
                        int merge) {
    KILN_DYN_SHARED(float, smem);
    int hs = s.HD, NH = s.NH, bh = blockIdx.x, b = bh / NH, h = bh % NH, g = h / (NH / s.NKV);
    float *Ks = smem, *Vs = smem + ATT_BC * hs; /* (ATT_BC, hs) each */
    float *Ss = Vs + ATT_BC * hs;                /* (ATT_BR, ATT_BC + 1) scores */
    int r0 = blockIdx.y * ATT_BR, lr = threadIdx.x / TPK, row = r0 + lr, sub = threadIdx.x % TPK;
    float *S = Ss + lr * (ATT_BC + 1);
    size_t qld = s.q_ld, kld = s.kv_ld, ldo = (size_t)NH * hs;
    const T_ *Q = q + (size_t)b * s.Tq * qld + h * hs, *K = k + (size_t)b * s.Tk * kld + g * hs;
    const T_ *V = v + (size_t)b * s.Tk * kld + g * hs;
    float qr[ATT_D], o[ATT_D];
#pragma unroll
    for (int i = 0; i < ATT_D; i++) {
        int d = i * TPK + sub;
        qr[i] = row < s.Tq && d < hs ? act_f(Q[(size_t)row * qld + d]) : 0.0f;
        o[i] = 0.0f;
    }
    int nv = attb_nv(s, row), kend = attb_nv(s, min(s.Tq, r0 + ATT_BR) - 1); /* the block sees keys [kbeg, kend) */
    int first = attb_first(s, b, row), kbeg = attb_first(s, b, r0);
    float m = -INFINITY, l = 0.0f;
    for (int k0 = kbeg; k0 < kend; k0 += ATT_BC) {
        __syncthreads();
        att_load_tile(Ks, K, kld, k0, ATT_BC, s.Tk, hs);
        att_load_tile(Vs, V, kld, k0, ATT_BC, s.Tk, hs);
        __syncthreads();
        att_softmax_tile<TPK>(o, m, l, qr, Ks, Vs, S, k0, first, nv, sub, hs, scale);
    }
    float lb = l > 0.0f ? m + logf(l) : -INFINITY, inv = l > 0.0f ? 1.0f / l : 0.0f;
    float *L = lse + (size_t)bh * s.Tq + row;
    /* the old lse is read by every thread of the group before sub 0 rewrites it */
    float lo = merge && row < s.Tq ? *L : -INFINITY;
    __syncwarp();
    if (row >= s.Tq) return;
    T_ *O = out + ((size_t)b * s.Tq + row) * ldo + h * hs;
    if (merge && lb == -INFINITY) return; /* nothing new for this row */
    float a = 0.0f, c = inv, ln = lb;
    if (merge && lo != -INFINITY) {
        float mm = fmaxf(lo, lb);
        ln = mm + logf(expf(lo - mm) + expf(lb - mm));
        a = expf(lo - ln), c = expf(lb - ln) * inv;
    }
#pragma unroll
    for (int i = 0; i < ATT_D; i++) {
        int d = i * TPK + sub;
        if (d < hs) O[d] = act_from<T_>(a != 0.0f ? a * act_f(O[d]) + c * o[i] : c * o[i]);
    }
    if (sub == 0) *L = ln;
}

/* ---------------------------------------------------------------------------
 * Backward, part 1: dq += and D = rowsum(dO * O) for part 2. Block: ATT_BR
 * query rows of one (b, h). ds = p (dp - D) / sqrt(hs) with p = exp(s - lse). */
template <int TPK, typename T_>
__global__ void __launch_bounds__(ATT_BR *TPK)
    attb_backward_dq_kernel(float *dq, float *Dbuf, const T_ *dout, const T_ *q, const T_ *k, const T_ *v,
                            const T_ *out, const float *lse, AttnBlock s, float scale) {
    KILN_DYN_SHARED(float, smem);
    int hs = s.HD, NH = s.NH, bh = blockIdx.x, b = bh / NH, h = bh % NH, g = h / (NH / s.NKV);
    float *Ks = smem, *Vs = smem + ATT_BC * hs;
    int r0 = blockIdx.y * ATT_BR, row = r0 + threadIdx.x / TPK, sub = threadIdx.x % TPK;
    size_t qld = s.q_ld, kld = s.kv_ld, ldo = (size_t)NH * hs;
    const T_ *Q = q + (size_t)b * s.Tq * qld + h * hs, *K = k + (size_t)b * s.Tk * kld + g * hs;
    const T_ *V = v + (size_t)b * s.Tk * kld + g * hs;
    const T_ *dO = dout + (size_t)b * s.Tq * ldo + h * hs, *O = out + (size_t)b * s.Tq * ldo + h * hs;
    float qr[ATT_D], dor[ATT_D], dqr[ATT_D];
    float part = 0.0f;
#pragma unroll
    for (int i = 0; i < ATT_D; i++) {
        int d = i * TPK + sub;
        int ok = row < s.Tq && d < hs;
        qr[i] = ok ? act_f(Q[(size_t)row * qld + d]) : 0.0f;
        dor[i] = ok ? act_f(dO[(size_t)row * ldo + d]) : 0.0f;
        part += ok ? dor[i] * act_f(O[(size_t)row * ldo + d]) : 0.0f;
        dqr[i] = 0.0f;
    }
    float Dt = att_group_sum<TPK>(part);
    float lt = row < s.Tq ? lse[(size_t)bh * s.Tq + row] : 0.0f;
    if (row < s.Tq && sub == 0) Dbuf[(size_t)bh * s.Tq + row] = Dt;
    int nv = attb_nv(s, row), kend = attb_nv(s, min(s.Tq, r0 + ATT_BR) - 1);
    int first = attb_first(s, b, row), kbeg = attb_first(s, b, r0);
    for (int k0 = kbeg; k0 < kend; k0 += ATT_BC) {
        __syncthreads();
        att_load_tile(Ks, K, kld, k0, ATT_BC, s.Tk, hs);
        att_load_tile(Vs, V, kld, k0, ATT_BC, s.Tk, hs);
        __syncthreads();
        att_dq_tile<TPK>(dqr, qr, dor, Ks, Vs, k0, first, nv, lt, Dt, sub, hs, scale);
    }
    if (row < s.Tq) {
        float *dQ = dq + ((size_t)b * s.Tq + row) * qld + h * hs;
#pragma unroll
        for (int i = 0; i < ATT_D; i++) {
            int d = i * TPK + sub;
            if (d < hs) dQ[d] += dqr[i];
        }
    }
}

/* Backward, part 2: dk += and dv +=. Block: ATT_BK key rows of one (b, kv
 * head), summing over the query heads of its group in head order and, per
 * head, over the queries that see each key in row order: one fixed chain. */
template <int TPK, typename T_>
__global__ void __launch_bounds__(ATT_BK *TPK)
    attb_backward_dkv_kernel(float *dk, float *dv, const float *Dbuf, const T_ *dout, const T_ *q, const T_ *k,
                             const T_ *v, const float *lse, AttnBlock s, float scale) {
    KILN_DYN_SHARED(float, smem);
    int hs = s.HD, NH = s.NH, bkv = blockIdx.x, b = bkv / s.NKV, kvh = bkv % s.NKV, G = NH / s.NKV;
    float *Qs = smem, *dOs = smem + ATT_BQ * hs;      /* (ATT_BQ, hs) each */
    float *Ls = dOs + ATT_BQ * hs, *Ds = Ls + ATT_BQ; /* (ATT_BQ) each */
    int *Lo = (int *)(Ds + ATT_BQ), *Hi = Lo + ATT_BQ; /* (ATT_BQ) each: query r sees keys [Lo, Hi) of the block */
    int k0 = blockIdx.y * ATT_BK, key = k0 + threadIdx.x / TPK, sub = threadIdx.x % TPK;
    size_t qld = s.q_ld, kld = s.kv_ld, ldo = (size_t)NH * hs;
    const T_ *K = k + (size_t)b * s.Tk * kld + (size_t)kvh * hs, *V = v + (size_t)b * s.Tk * kld + (size_t)kvh * hs;
    float kr[ATT_D], vr[ATT_D], dkr[ATT_D], dvr[ATT_D];
#pragma unroll
    for (int i = 0; i < ATT_D; i++) {
        int d = i * TPK + sub;
        int ok = key < s.Tk && d < hs;
        kr[i] = ok ? act_f(K[(size_t)key * kld + d]) : 0.0f;
        vr[i] = ok ? act_f(V[(size_t)key * kld + d]) : 0.0f;
        dkr[i] = dvr[i] = 0.0f;
    }
    /* the first query that sees key k0, the block's earliest: queries before it see none of these keys */
    int qstart = max(0, s.k_pos + k0 - s.q_pos), klast = min(s.Tk, k0 + ATT_BK) - 1;
    for (int h = kvh * G; h < (kvh + 1) * G; h++) {
        const T_ *Q = q + (size_t)b * s.Tq * qld + h * hs, *dO = dout + (size_t)b * s.Tq * ldo + h * hs;
        const float *L = lse + ((size_t)b * NH + h) * s.Tq, *D = Dbuf + ((size_t)b * NH + h) * s.Tq;
        for (int i0 = qstart; i0 < s.Tq; i0 += ATT_BQ) {
            __syncthreads();
            att_load_tile(Qs, Q, qld, i0, ATT_BQ, s.Tq, hs);
            att_load_tile(dOs, dO, ldo, i0, ATT_BQ, s.Tq, hs);
            for (int r = threadIdx.x; r < ATT_BQ; r += blockDim.x) {
                Ls[r] = i0 + r < s.Tq ? L[i0 + r] : 0.0f;
                Ds[r] = i0 + r < s.Tq ? D[i0 + r] : 0.0f;
                Lo[r] = attb_first(s, b, i0 + r);
                Hi[r] = i0 + r < s.Tq ? attb_nv(s, i0 + r) : 0;
            }
            __syncthreads();
            /* documents: from the first query whose document starts after
             * the block's last key on, no query sees these keys (the same
             * for every thread: no sync is skipped) */
            if (attb_first(s, b, i0) > klast) break;
            att_dkv_tile<TPK>(dkr, dvr, kr, vr, Qs, dOs, Ls, Ds, Lo, Hi, key, sub, hs, scale);
        }
    }
    if (key < s.Tk) {
        float *dK = dk + ((size_t)b * s.Tk + key) * kld + (size_t)kvh * hs;
        float *dV = dv + ((size_t)b * s.Tk + key) * kld + (size_t)kvh * hs;
#pragma unroll
        for (int i = 0; i < ATT_D; i++) {
            int d = i * TPK + sub;
            if (d < hs) {
                dK[d] += dkr[i];
                dV[d] += dvr[i];
            }
        }
    }
}

/* ---------------------------------------------------------------------------
 * Host entries: dispatch on the head size (threads per row) and the dtype. */

static int attb_tpk(const AttnBlock *s) {
    if (s->NKV < 1 || s->NH % s->NKV != 0)
        kiln_fail(KILN_EXIT_USAGE, "cuda block attention: n_kv_head %d does not divide n_head %d", s->NKV, s->NH);
    for (int tpk = 2; tpk <= 8; tpk *= 2)
        if (s->HD <= ATT_D * tpk) return tpk;
    kiln_fail(KILN_EXIT_USAGE, "cuda block attention: head size %d is over the supported %d", s->HD, 8 * ATT_D);
}

template <typename T_>
static void attb_forward_run(void *out, float *lse, const void *q, const void *k, const void *v, const AttnBlock *s,
                             int merge) {
    int tpk = attb_tpk(s), hs = s->HD;
    if (s->B == 0 || s->Tq == 0) return;
    float scale = 1.0f / sqrtf((float)hs);
    dim3 grid(s->B * s->NH, (s->Tq + ATT_BR - 1) / ATT_BR);
    size_t sh = ((size_t)2 * ATT_BC * hs + ATT_BR * (ATT_BC + 1)) * sizeof(float); /* <= 40 KiB at hs 128 */
    T_ *o = (T_ *)out;
    const T_ *qq = (const T_ *)q, *kk = (const T_ *)k, *vv = (const T_ *)v;
    switch (tpk) {
    case 2: KLAUNCH((attb_forward_kernel<2, T_>), grid, ATT_BR * 2, sh, o, lse, qq, kk, vv, *s, scale, merge); break;
    case 4: KLAUNCH((attb_forward_kernel<4, T_>), grid, ATT_BR * 4, sh, o, lse, qq, kk, vv, *s, scale, merge); break;
    default: KLAUNCH((attb_forward_kernel<8, T_>), grid, ATT_BR * 8, sh, o, lse, qq, kk, vv, *s, scale, merge); break;
    }
    CUDA_CHECK_LAUNCH();
}

void cuda_attention_block_forward(void *out, float *lse, const void *q, const void *k, const void *v,
                                  const AttnBlock *s, int merge) {
    ACT_DISPATCH(attb_forward_run, out, lse, q, k, v, s, merge);
}

template <typename T_>
static void attb_backward_run(float *dq, float *dk, float *dv, const void *dout_, const void *q_, const void *k_,
                              const void *v_, const void *out_, const float *lse, const AttnBlock *s) {
    int tpk = attb_tpk(s), hs = s->HD;
    if (s->B == 0 || s->Tq == 0 || s->Tk == 0) return;
    float scale = 1.0f / sqrtf((float)hs);
    float *Dbuf = (float *)cuda_scratch(SCRATCH_ATTENTION, (size_t)s->B * s->NH * s->Tq * sizeof(float));
    dim3 gq(s->B * s->NH, (s->Tq + ATT_BR - 1) / ATT_BR), gk(s->B * s->NKV, (s->Tk + ATT_BK - 1) / ATT_BK);
    size_t shq = (size_t)2 * ATT_BC * hs * sizeof(float);
    size_t shk = ((size_t)2 * ATT_BQ * hs + 2 * ATT_BQ) * sizeof(float) + 2 * ATT_BQ * sizeof(int);
    const T_ *dout = (const T_ *)dout_, *q = (const T_ *)q_, *k = (const T_ *)k_, *v = (const T_ *)v_;
    const T_ *out = (const T_ *)out_;
    /* dq first: it also writes D, which the dk/dv kernel reads (same stream) */
#define ATTB_BACKWARD(TPK)                                                                                       \
    KLAUNCH((attb_backward_dq_kernel<TPK, T_>), gq, ATT_BR * TPK, shq, dq, Dbuf, dout, q, k, v, out, lse, *s,     \
            scale);                                                                                               \
    CUDA_CHECK_LAUNCH();                                                                                          \
    KLAUNCH((attb_backward_dkv_kernel<TPK, T_>), gk, ATT_BK * TPK, shk, dk, dv, Dbuf, dout, q, k, v, lse, *s, scale)
    switch (tpk) {
    case 2: ATTB_BACKWARD(2); break;
    case 4: ATTB_BACKWARD(4); break;
    default: ATTB_BACKWARD(8); break;
    }
#undef ATTB_BACKWARD
    CUDA_CHECK_LAUNCH();
}

void cuda_attention_block_backward(float *dq, float *dk, float *dv, const void *dout, const void *q, const void *k,
                                   const void *v, const void *out, const float *lse, const AttnBlock *s) {
    ACT_DISPATCH(attb_backward_run, dq, dk, dv, dout, q, k, v, out, lse, s);
}
