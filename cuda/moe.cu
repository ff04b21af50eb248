/* moe: mixture-of-experts routing and the permutation of tokens to experts
 * and back (backend.h's moe_* ops). Index outputs are the CPU backend's
 * exactly: the dispatch is a counting sort over tiles of slots in (t, k)
 * order with integer counters per (sequence, expert), no atomics; every float
 * sum runs in the CPU's order (experts, then k, then a sequence's rows). Never allocates except through the
 * grow-only scratch. */
#include <math.h>

#include "common.cuh"

/* Max and log-sum-exp of one row of router logits, the sum in expert order. */
template <typename T_> __device__ float moe_row_lse(const T_ *x, int E) {
    float mx = -INFINITY, s = 0.0f;
    for (int e = 0; e < E; e++) mx = fmaxf(mx, act_f(x[e]));
    for (int e = 0; e < E; e++) s += expf(act_f(x[e]) - mx);
    return mx + logf(s);
}

/* ---------------------------------------------------------------------------
 * Routing: one thread per row (E is tens to a few hundred), which also keeps
 * the row's lse^2 (the same function of the same logits as the CPU's
 * recomputation), then one thread per (sequence, statistic) summing that
 * sequence's rows in order. */
template <typename T_>
__global__ void moe_route_kernel(int32_t *topk, float *gates, float *probs, float *lse2, const T_ *logits,
                                 const float *bias, int N, int E, int K, int sigmoid, int norm_topk) {
    /* topk, gates (N,K), probs (N,E), lse2 (N), logits (N,E), bias (E) or NULL */
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= N) return;
    const T_ *x = logits + (size_t)t * E;
    float *p = probs + (size_t)t * E;
    float lse = moe_row_lse(x, E);
    lse2[t] = lse * lse;
    if (sigmoid) {
        for (int e = 0; e < E; e++) p[e] = 1.0f / (1.0f + expf(-act_f(x[e])));
    } else {
        for (int e = 0; e < E; e++) p[e] = expf(act_f(x[e]) - lse);
    }
    /* The k-th pick is the best expert ranked after the (k-1)-th in the order
     * (score descending, index ascending): ties go to the lower index. */
    int32_t *sel = topk + (size_t)t * K;
    float *gt = gates + (size_t)t * K, prev_s = INFINITY, sum = 0.0f;
    int prev_e = -1;
    for (int k = 0; k < K; k++) {
        int best = -1;
        float bs = -INFINITY;
        for (int e = 0; e < E; e++) {
            float s = p[e] + (bias ? bias[e] : 0.0f);
            int after = s < prev_s || (s == prev_s && e > prev_e);
            if (after && (best < 0 || s > bs)) best = e, bs = s;
        }
        if (best < 0) best = k; /* only NaN scores left: stay in bounds, as the CPU */
        sel[k] = best;
        gt[k] = p[best];
        sum += p[best];
        prev_s = bs, prev_e = best;
    }
    if (norm_topk)
        for (int k = 0; k < K; k++) gt[k] /= sum;
}

__global__ void moe_stats_kernel(float *stats, const float *probs, const float *lse2, int nseq, int S, int E) {
    /* stats (nseq, E+1): [b][e] = sum of probs[., e], [b][E] = sum of lse^2,
     * over sequence b's S rows in order */
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nseq * (E + 1)) return;
    int b = i / (E + 1), e = i % (E + 1);
    int t0 = b * S, t1 = t0 + S;
    float s = 0.0f;
    if (e < E)
        for (int t = t0; t < t1; t++) s += probs[(size_t)t * E + e];
    else
        for (int t = t0; t < t1; t++) s += lse2[t];
    stats[i] = s;
}

template <typename T_>
static void moe_route_run(int32_t *topk, float *gates, float *probs, float *stats, const void *logits,
                          const float *bias, int N, int S, int E, int K, int sigmoid, int norm_topk) {
    if (N <= 0) return; /* no rows, no sequences: nothing to write */
    int nseq = N / S;
    float *lse2 = (float *)cuda_scratch(SCRATCH_MOE_LSE, (size_t)N * sizeof(float));
    KLAUNCH(moe_route_kernel<T_>, cuda_blocks(N, 128), 128, 0, topk, gates, probs, lse2, (const T_ *)logits, bias, N,
            E, K, sigmoid, norm_topk);
    CUDA_CHECK_LAUNCH();
    KLAUNCH(moe_stats_kernel, cuda_blocks((size_t)nseq * (E + 1), 128), 128, 0, stats, probs, lse2, nseq, S, E);
    CUDA_CHECK_LAUNCH();
}

void cuda_moe_route(int32_t *topk, float *gates, float *probs, float *stats, const void *logits, const float *bias,
                    int N, int S, int E, int K, int sigmoid, int norm_topk) {
    ACT_DISPATCH(moe_route_run, topk, gates, probs, stats, logits, bias, N, S, E, K, sigmoid, norm_topk);
}

/* ---------------------------------------------------------------------------
 * Dispatch: a counting sort of the N K slots by expert, stable in (t, k)
 * order, counted and capped per (sequence, expert). Each sequence's S K slots
 * are cut into tps tiles of at most MOE_TILE (a tile never spans two
 * sequences); (1) one thread per tile counts its slots per expert, (2) one
 * thread per expert walks the sequences in order: the tile counts become
 * exclusive prefixes within the sequence (the expert's in-sequence rank of
 * each tile's first slot), the sequence's total is its load, and base is the
 * kept slots of the earlier sequences; then offsets follow, (3) one thread
 * per tile walks its slots in order and places the first cap of each
 * sequence. Scratch: cnt (tiles, E) then base (nseq, E), int32. */
#define MOE_TILE 256

__global__ void moe_tile_count_kernel(int32_t *cnt, const int32_t *topk, int SK, int tps, int E, int tiles) {
    int tile = blockIdx.x * blockDim.x + threadIdx.x;
    if (tile >= tiles) return;
    int32_t *c = cnt + (size_t)tile * E;
    for (int e = 0; e < E; e++) c[e] = 0;
    int b = tile / tps, j = tile % tps;
    int i0 = b * SK + j * MOE_TILE, i1 = min((b + 1) * SK, i0 + MOE_TILE);
    for (int i = i0; i < i1; i++) c[topk[i]]++;
}

/* The most slots sequence b keeps for expert e: its caps entry, else cap (<= 0: all). */
__device__ int32_t moe_limit(const int32_t *caps, int cap, int b, int E, int e) {
    if (caps) return caps[(size_t)b * E + e];
    return cap > 0 ? cap : 0x7fffffff;
}

__global__ void moe_prefix_kernel(int32_t *offsets, int32_t *counts, int32_t *cnt, int32_t *base, int nseq, int tps,
                                  int E, int cap, const int32_t *caps) {
    /* one block */
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int32_t kept = 0;
        for (int b = 0; b < nseq; b++) {
            int32_t run = 0;
            for (int j = 0; j < tps; j++) {
                size_t at = ((size_t)b * tps + j) * E + e;
                int32_t c = cnt[at];
                cnt[at] = run;
                run += c;
            }
            counts[(size_t)b * E + e] = run;
            base[(size_t)b * E + e] = kept;
            int32_t lim = moe_limit(caps, cap, b, E, e);
            kept += run > lim ? lim : run;
        }
        offsets[e + 1] = kept; /* this expert's rows, summed below */
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int32_t acc = 0;
        offsets[0] = 0;
        for (int e = 0; e < E; e++) {
            acc += offsets[e + 1];
            offsets[e + 1] = acc;
        }
    }
}

__global__ void moe_place_kernel(int32_t *row_of, int32_t *src, int32_t *cnt, const int32_t *base,
                                 const int32_t *offsets, const int32_t *topk, int SK, int tps, int E, int K, int tiles,
                                 int cap, const int32_t *caps) {
    int tile = blockIdx.x * blockDim.x + threadIdx.x;
    if (tile >= tiles) return;
    int32_t *c = cnt + (size_t)tile * E;
    int b = tile / tps, j0 = tile % tps;
    const int32_t *bs = base + (size_t)b * E;
    int i0 = b * SK + j0 * MOE_TILE, i1 = min((b + 1) * SK, i0 + MOE_TILE);
    for (int i = i0; i < i1; i++) {
        int e = topk[i], j = c[e]++;
        if (j >= moe_limit(caps, cap, b, E, e)) {
            row_of[i] = -1;
        } else {
            int r = offsets[e] + bs[e] + j;
            row_of[i] = r;
            src[r] = i / K;
        }
    }
}

static void moe_dispatch_run(int32_t *offsets, int32_t *row_of, int32_t *src, int32_t *counts, const int32_t *topk,
                             int N, int S, int E, int K, int cap, const int32_t *caps) {
    int nseq = N > 0 ? N / S : 0, SK = S * K;
    int tps = nseq > 0 && SK > 0 ? (SK + MOE_TILE - 1) / MOE_TILE : 0, tiles = nseq * tps;
    size_t words = ((size_t)tiles + nseq) * E;
    int32_t *cnt = (int32_t *)cuda_scratch(SCRATCH_MOE, (words ? words : 1) * sizeof(int32_t));
    int32_t *base = cnt + (size_t)tiles * E;
    if (tiles > 0) {
        KLAUNCH(moe_tile_count_kernel, cuda_blocks(tiles, 128), 128, 0, cnt, topk, SK, tps, E, tiles);
        CUDA_CHECK_LAUNCH();
    }
    /* always: offsets are defined (all 0) for no rows too */
    KLAUNCH(moe_prefix_kernel, 1, 256, 0, offsets, counts, cnt, base, nseq, tps, E, cap, caps);
    CUDA_CHECK_LAUNCH();
    if (tiles > 0) {
        KLAUNCH(moe_place_kernel, cuda_blocks(tiles, 128), 128, 0, row_of, src, cnt, base, offsets, topk, SK, tps, E,
                K, tiles, cap, caps);
        CUDA_CHECK_LAUNCH();
    }
}

void cuda_moe_dispatch(int32_t *offsets, int32_t *row_of, int32_t *src, int32_t *counts, const int32_t *topk, int N,
                       int S, int E, int K, int cap) {
    moe_dispatch_run(offsets, row_of, src, counts, topk, N, S, E, K, cap, NULL);
}

void cuda_moe_dispatch_capped(int32_t *offsets, int32_t *row_of, int32_t *src, int32_t *counts, const int32_t *topk,
                              int N, int S, int E, int K, const int32_t *caps) {
    moe_dispatch_run(offsets, row_of, src, counts, topk, N, S, E, K, 0, caps);
}

/* ---------------------------------------------------------------------------
 * Gather, combine and their backwards: one thread per output element, the
 * k sums in k order. */
static unsigned moe_blocks(size_t n) {
    unsigned b = cuda_blocks(n, 256);
    return b > 65536 ? 65536 : b;
}

template <typename T_> __global__ void moe_gather_kernel(T_ *xp, const T_ *x, const int32_t *src, int R, int C) {
    /* xp (R,C), x (N,C), src (R) */
    size_t total = (size_t)R * C;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x)
        xp[e] = x[(size_t)src[e / C] * C + e % C];
}

template <typename T_>
__global__ void moe_gather_backward_kernel(T_ *dx, const T_ *dxp, const int32_t *row_of, int N, int K, int C) {
    /* dx (N,C) +=, dxp (R,C), row_of (N,K) */
    size_t total = (size_t)N * C;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
        size_t t = e / C, c = e % C;
        float acc = act_f(dx[e]);
        for (int k = 0; k < K; k++) {
            int r = row_of[t * K + k];
            if (r >= 0) acc += act_f(dxp[(size_t)r * C + c]);
        }
        dx[e] = act_from<T_>(acc);
    }
}

template <typename T_>
__global__ void moe_combine_kernel(T_ *out, const T_ *yp, const float *gates, const int32_t *row_of, int N, int K,
                                   int C) {
    /* out (N,C), yp (R,C), gates, row_of (N,K) */
    size_t total = (size_t)N * C;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
        size_t t = e / C, c = e % C;
        float acc = 0.0f;
        for (int k = 0; k < K; k++) {
            int r = row_of[t * K + k];
            if (r >= 0) acc += gates[t * K + k] * act_f(yp[(size_t)r * C + c]);
        }
        out[e] = act_from<T_>(acc);
    }
}

template <typename T_>
__global__ void moe_combine_dyp_kernel(T_ *dyp, const T_ *dout, const float *gates, const int32_t *row_of, int N,
                                       int K, int C) {
    /* dyp (R,C): row row_of[t][k] = gates[t][k] dout[t] */
    size_t total = (size_t)N * K * C;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
        size_t s = e / C, c = e % C;
        int r = row_of[s];
        if (r >= 0) dyp[(size_t)r * C + c] = act_from<T_>(gates[s] * act_f(dout[(s / K) * C + c]));
    }
}

template <typename T_>
__global__ void moe_combine_dgates_kernel(float *dgates, const T_ *dout, const T_ *yp, const int32_t *row_of, int N,
                                          int K, int C) {
    /* dgates (N,K) = dot(dout[t], yp[row_of[t][k]]), one warp per slot */
    int s = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (s >= N * K) return;
    int r = row_of[s];
    if (r < 0) {
        if (lane == 0) dgates[s] = 0.0f;
        return;
    }
    const T_ *d = dout + (size_t)(s / K) * C, *y = yp + (size_t)r * C;
    float acc = 0.0f;
    for (int c = lane; c < C; c += 32) acc += act_f(d[c]) * act_f(y[c]);
    acc = warp_sum(acc);
    if (lane == 0) dgates[s] = acc;
}

template <typename T_> static void moe_gather_run(void *xp, const void *x, const int32_t *src, int R, int C) {
    if (R <= 0) return;
    KLAUNCH(moe_gather_kernel<T_>, moe_blocks((size_t)R * C), 256, 0, (T_ *)xp, (const T_ *)x, src, R, C);
    CUDA_CHECK_LAUNCH();
}
template <typename T_>
static void moe_gather_backward_run(void *dx, const void *dxp, const int32_t *row_of, int N, int K, int C) {
    KLAUNCH(moe_gather_backward_kernel<T_>, moe_blocks((size_t)N * C), 256, 0, (T_ *)dx, (const T_ *)dxp, row_of, N,
            K, C);
    CUDA_CHECK_LAUNCH();
}
template <typename T_>
static void moe_combine_run(void *out, const void *yp, const float *gates, const int32_t *row_of, int N, int K, int C) {
    KLAUNCH(moe_combine_kernel<T_>, moe_blocks((size_t)N * C), 256, 0, (T_ *)out, (const T_ *)yp, gates, row_of, N, K,
            C);
    CUDA_CHECK_LAUNCH();
}
template <typename T_>
static void moe_combine_backward_run(void *dyp, float *dgates, const void *dout, const void *yp, const float *gates,
                                     const int32_t *row_of, int N, int K, int C) {
    KLAUNCH(moe_combine_dyp_kernel<T_>, moe_blocks((size_t)N * K * C), 256, 0, (T_ *)dyp, (const T_ *)dout, gates,
            row_of, N, K, C);
    CUDA_CHECK_LAUNCH();
    KLAUNCH(moe_combine_dgates_kernel<T_>, cuda_blocks((size_t)N * K, 8), 256, 0, dgates, (const T_ *)dout,
            (const T_ *)yp, row_of, N, K, C);
    CUDA_CHECK_LAUNCH();
}

void cuda_moe_gather(void *xp, const void *x, const int32_t *src, int R, int C) {
    ACT_DISPATCH(moe_gather_run, xp, x, src, R, C);
}
void cuda_moe_gather_backward(void *dx, const void *dxp, const int32_t *row_of, int N, int K, int C) {
    ACT_DISPATCH(moe_gather_backward_run, dx, dxp, row_of, N, K, C);
}
void cuda_moe_combine(void *out, const void *yp, const float *gates, const int32_t *row_of, int N, int K, int C) {
    ACT_DISPATCH(moe_combine_run, out, yp, gates, row_of, N, K, C);
}
void cuda_moe_combine_backward(void *dyp, float *dgates, const void *dout, const void *yp, const float *gates,
                               const int32_t *row_of, int N, int K, int C) {
    ACT_DISPATCH(moe_combine_backward_run, dyp, dgates, dout, yp, gates, row_of, N, K, C);
}

/* ---------------------------------------------------------------------------
 * Router backward, one thread per row, as the CPU: dL/dprobs into the fp32
 * scratch row a (N,E), then through the probs function in place, then the
 * z-loss term, stored to dlogits in act. */
template <typename T_>
__global__ void moe_route_backward_kernel(T_ *dlogits, float *abuf, const float *dgates, const float *probs,
                                          const int32_t *topk, const float *gates, const T_ *logits, const float *aux,
                                          float z_coef, int N, int S, int E, int K, int sigmoid, int norm_topk) {
    /* aux (N/S, E) or NULL: row t reads its sequence's row t / S */
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= N) return;
    const float *p = probs + (size_t)t * E, *dg = dgates + (size_t)t * K, *g = gates + (size_t)t * K;
    const int32_t *sel = topk + (size_t)t * K;
    float *a = abuf + (size_t)t * E;
    const float *ax = aux ? aux + (size_t)(t / S) * E : NULL;
    for (int e = 0; e < E; e++) a[e] = ax ? ax[e] : 0.0f;
    if (norm_topk) {
        /* g_k = p_k / Z, Z = sum_j p_j: dL/dp_j = (dg_j - sum_k dg_k g_k) / Z */
        float Z = 0.0f, dgg = 0.0f;
        for (int k = 0; k < K; k++) Z += p[sel[k]], dgg += dg[k] * g[k];
        for (int k = 0; k < K; k++) a[sel[k]] += (dg[k] - dgg) / Z;
    } else {
        for (int k = 0; k < K; k++) a[sel[k]] += dg[k];
    }
    if (sigmoid) {
        for (int e = 0; e < E; e++) a[e] *= p[e] * (1.0f - p[e]);
    } else {
        float ap = 0.0f;
        for (int e = 0; e < E; e++) ap += a[e] * p[e];
        for (int e = 0; e < E; e++) a[e] = p[e] * (a[e] - ap);
    }
    const T_ *x = logits + (size_t)t * E;
    T_ *o = dlogits + (size_t)t * E;
    if (z_coef != 0.0f) {
        /* the z-loss uses the row's softmax and lse whatever the probs function */
        float lse = moe_row_lse(x, E), k2 = z_coef * 2.0f * lse / N;
        for (int e = 0; e < E; e++) a[e] += k2 * expf(act_f(x[e]) - lse);
    }
    for (int e = 0; e < E; e++) o[e] = act_from<T_>(a[e]);
}

template <typename T_>
static void moe_route_backward_run(void *dlogits, const float *dgates, const float *probs, const int32_t *topk,
                                   const float *gates, const void *logits, const float *aux, float z_coef, int N,
                                   int S, int E, int K, int sigmoid, int norm_topk) {
    float *abuf = (float *)cuda_scratch(SCRATCH_MOE_GRAD, (size_t)N * E * sizeof(float));
    KLAUNCH(moe_route_backward_kernel<T_>, cuda_blocks(N, 128), 128, 0, (T_ *)dlogits, abuf, dgates, probs, topk,
            gates, (const T_ *)logits, aux, z_coef, N, S, E, K, sigmoid, norm_topk);
    CUDA_CHECK_LAUNCH();
}

void cuda_moe_route_backward(void *dlogits, const float *dgates, const float *probs, const int32_t *topk,
                             const float *gates, const void *logits, const float *aux, float z_coef, int N, int S,
                             int E, int K, int sigmoid, int norm_topk) {
    ACT_DISPATCH(moe_route_backward_run, dlogits, dgates, probs, topk, gates, logits, aux, z_coef, N, S, E, K, sigmoid,
                 norm_topk);
}
