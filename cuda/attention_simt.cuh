/* attention_simt.cuh: the inner loops the SIMT attention kernels share —
 * attention.cu's (whole sequences) and attention_block.cu's (context
 * parallelism's blocks): one key tile of the online softmax, one key tile of
 * dQ, one query tile of dK/dV, for one row. The kernels around them own the
 * indexing, the tile loads and what a row sees; here a row sees the keys of
 * a half-open range [lo, hi), so the causal mask, documents and a block's
 * offsets are all the caller's. No device state, no launches.
 *
 * Threads: a group of TPK adjacent threads owns one row; thread `sub` of a
 * group holds head dims sub, sub + TPK, ... (interleaved, so a warp's reads
 * of one shared row hit distinct banks) — ATT_D = 16 dims each, TPK 2, 4 or
 * 8, so head sizes up to 128. Dot products are per-thread partial sums
 * combined by a butterfly within the group (a group never spans two warps).
 * Key and query loops are not unrolled: unrolling 32 keys x 16 dims made the
 * kernels spill and took minutes to compile. Every sum runs in one fixed
 * order: the same inputs give the same bits. */
#ifndef KILN_ATTENTION_SIMT_CUH
#define KILN_ATTENTION_SIMT_CUH

#include "common.cuh"

#define ATT_D 16  /* head dims per thread */
#define ATT_BR 64 /* query rows per block (forward, dQ) */
#define ATT_BC 32 /* keys per shared tile (forward, dQ) */
#define ATT_BK 64 /* key rows per block (dK/dV) */
#define ATT_BQ 32 /* query rows per shared tile (dK/dV) */

template <int TPK>
__device__ __forceinline__ float att_group_sum(float v) {
#pragma unroll
    for (int o = TPK / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Rows [r0, r0 + rows) of one head (ld apart) into a shared (rows, hs) fp32
 * tile; rows past n read as zero. */
template <typename T_>
__device__ __forceinline__ void att_load_tile(float *dst, const T_ *src, size_t ld, int r0, int rows, int n, int hs) {
    for (int e = threadIdx.x; e < rows * hs; e += blockDim.x) {
        int r = e / hs, d = e % hs;
        dst[e] = r0 + r < n ? act_f(src[(size_t)(r0 + r) * ld + d]) : 0.0f;
    }
}

/* The online softmax of one row over the ATT_BC keys k0.. in Ks, Vs ((ATT_BC,
 * hs) fp32, shared): m, l (the row's running max and sum) and its o dims are
 * updated; keys k0 + j in [lo, hi) are seen. S: the row's ATT_BC scores in
 * shared memory, written by the group's sub 0. A masked key adds exactly
 * nothing (exp(-inf) = 0), so changing an unseen k or v leaves an output's
 * bits unchanged; a row that has seen no key yet (m -inf) is left as it was,
 * no exp(-inf - -inf). Every thread of the warp calls it (a __syncwarp). */
template <int TPK>
__device__ __forceinline__ void att_softmax_tile(float o[ATT_D], float &m, float &l, const float q[ATT_D],
                                                 const float *Ks, const float *Vs, float *S, int k0, int lo, int hi,
                                                 int sub, int hs, float scale) {
    float mt = -INFINITY;
#pragma unroll 1
    for (int j = 0; j < ATT_BC; j++) {
        float part = 0.0f;
#pragma unroll
        for (int i = 0; i < ATT_D; i++) {
            int d = i * TPK + sub;
            if (d < hs) part += q[i] * Ks[j * hs + d];
        }
        float dot = att_group_sum<TPK>(part);
        float sj = k0 + j >= lo && k0 + j < hi ? dot * scale : -INFINITY;
        if (sub == 0) S[j] = sj;
        mt = fmaxf(mt, sj);
    }
    __syncwarp(); /* the group's scores, written by its sub 0, are visible */
    float m_new = fmaxf(m, mt);
    if (m_new == -INFINITY) return;
    float alpha = expf(m - m_new); /* m = -inf: 0, and o, l are 0 anyway */
    l *= alpha;
#pragma unroll
    for (int i = 0; i < ATT_D; i++) o[i] *= alpha;
#pragma unroll 1
    for (int j = 0; j < ATT_BC; j++) {
        float p = expf(S[j] - m_new);
        l += p;
#pragma unroll
        for (int i = 0; i < ATT_D; i++) {
            int d = i * TPK + sub;
            if (d < hs) o[i] += p * Vs[j * hs + d];
        }
    }
    m = m_new;
}

/* dQ of one row over the ATT_BC keys k0.. in Ks, Vs: dq += ds k for the keys
 * in [lo, hi), ds = p (dp - D) scale, p = exp(s scale - lse); q, dO: the
 * row's dims, lse and D its statistics. */
template <int TPK>
__device__ __forceinline__ void att_dq_tile(float dq[ATT_D], const float q[ATT_D], const float dor[ATT_D],
                                            const float *Ks, const float *Vs, int k0, int lo, int hi, float lse,
                                            float D, int sub, int hs, float scale) {
#pragma unroll 1
    for (int j = 0; j < ATT_BC; j++) {
        float ps = 0.0f, pp = 0.0f;
#pragma unroll
        for (int i = 0; i < ATT_D; i++) {
            int d = i * TPK + sub;
            if (d < hs) {
                ps += q[i] * Ks[j * hs + d];
                pp += dor[i] * Vs[j * hs + d];
            }
        }
        float s = att_group_sum<TPK>(ps), dp = att_group_sum<TPK>(pp);
        if (k0 + j >= lo && k0 + j < hi) {
            float p = expf(s * scale - lse);
            float ds = p * (dp - D) * scale;
#pragma unroll
            for (int i = 0; i < ATT_D; i++) {
                int d = i * TPK + sub;
                if (d < hs) dq[i] += ds * Ks[j * hs + d];
            }
        }
    }
}

/* dK, dV of one key row over the ATT_BQ queries in Qs, dOs ((ATT_BQ, hs)
 * fp32, shared), in row order: query r sees the key (index `key` in the
 * caller's numbering) iff Lo[r] <= key < Hi[r]; Ls, Ds: its lse and D. */
template <int TPK>
__device__ __forceinline__ void att_dkv_tile(float dk[ATT_D], float dv[ATT_D], const float k[ATT_D],
                                             const float v[ATT_D], const float *Qs, const float *dOs, const float *Ls,
                                             const float *Ds, const int *Lo, const int *Hi, int key, int sub, int hs,
                                             float scale) {
#pragma unroll 1
    for (int r = 0; r < ATT_BQ; r++) {
        float ps = 0.0f, pp = 0.0f;
#pragma unroll
        for (int i = 0; i < ATT_D; i++) {
            int d = i * TPK + sub;
            if (d < hs) {
                ps += k[i] * Qs[r * hs + d];
                pp += v[i] * dOs[r * hs + d];
            }
        }
        float s = att_group_sum<TPK>(ps), dp = att_group_sum<TPK>(pp);
        if (key >= Lo[r] && key < Hi[r]) {
            float p = expf(s * scale - Ls[r]);
            float ds = p * (dp - Ds[r]) * scale;
#pragma unroll
            for (int i = 0; i < ATT_D; i++) {
                int d = i * TPK + sub;
                if (d < hs) {
                    dv[i] += p * dOs[r * hs + d];
                    dk[i] += ds * Qs[r * hs + d];
                }
            }
        }
    }
}

#endif
