/* moe: mixture-of-experts routing and the permutation of tokens to experts
 * and back (backend.h's moe_* ops). Index outputs are the CPU backend's
 * exactly: the dispatch is a counting sort over tiles of slots in (t, k)
 * order with integer counters, no atomics; every float sum runs in the CPU's
 * order (experts, then k, then rows). Never allocates except through the
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
 * Routing: one thread per row (E is tens to a few hundred), then one thread
 * per statistic summing the rows in order. */
template <typename T_>
__global__ void moe_route_kernel(int32_t *topk, float *gates, float *probs, const T_ *logits, const float *bias,
                                 int N, int E, int K, int sigmoid, int norm_topk) {
    /* topk, gates (N,K), probs (N,E), logits (N,E), bias (E) or NULL */
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= N) return;
    const T_ *x = logits + (size_t)t * E;
    float *p = probs + (size_t)t * E;
    if (sigmoid) {
        for (int e = 0; e < E; e++) p[e] = 1.0f / (1.0f + expf(-act_f(x[e])));
    } else {
        float lse = moe_row_lse(x, E);
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
        sel[k] = best;
        gt[k] = p[best];
        sum += p[best];
        prev_s = bs, prev_e = best;
    }
    if (norm_topk)
        for (int k = 0; k < K; k++) gt[k] /= sum;
}

template <typename T_>
__global__ void moe_stats_kernel(float *stats, const float *probs, const T_ *logits, int N, int E) {
    /* stats (E+1): [e] = sum of probs[., e], [E] = sum of lse^2, rows in order */
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e > E) return;
    float s = 0.0f;
    if (e < E)
        for (int t = 0; t < N; t++) s += probs[(size_t)t * E + e];
    else
        for (int t = 0; t < N; t++) {
            float l = moe_row_lse(logits + (size_t)t * E, E);
            s += l * l;
        }
    stats[e] = s;
}

template <typename T_>
static void moe_route_run(int32_t *topk, float *gates, float *probs, float *stats, const void *logits,
                          const float *bias, int N, int E, int K, int sigmoid, int norm_topk) {
    KLAUNCH(moe_route_kernel<T_>, cuda_blocks(N, 128), 128, 0, topk, gates, probs, (const T_ *)logits, bias, N, E, K,
            sigmoid, norm_topk);
    CUDA_CHECK_LAUNCH();
    KLAUNCH(moe_stats_kernel<T_>, cuda_blocks(E + 1, 128), 128, 0, stats, probs, (const T_ *)logits, N, E);
    CUDA_CHECK_LAUNCH();
}

void cuda_moe_route(int32_t *topk, float *gates, float *probs, float *stats, const void *logits, const float *bias,
                    int N, int E, int K, int sigmoid, int norm_topk) {
    ACT_DISPATCH(moe_route_run, topk, gates, probs, stats, logits, bias, N, E, K, sigmoid, norm_topk);
}

/* ---------------------------------------------------------------------------
 * Dispatch: a counting sort of the N K slots by expert, stable in (t, k)
 * order. Slots are cut into tiles of MOE_TILE; (1) one thread per tile
 * counts its slots per expert, (2) one thread per expert turns the tile
 * counts into exclusive prefixes (the expert's rank of each tile's first
 * slot) and the load, then offsets follow with the cap, (3) one thread per
 * tile walks its slots in order and places them. cnt (tiles, E) int32. */
#define MOE_TILE 256

__global__ void moe_tile_count_kernel(int32_t *cnt, const int32_t *topk, int NK, int E, int tiles) {
    int tile = blockIdx.x * blockDim.x + threadIdx.x;
    if (tile >= tiles) return;
    int32_t *c = cnt + (size_t)tile * E;
    for (int e = 0; e < E; e++) c[e] = 0;
    int i1 = min(NK, (tile + 1) * MOE_TILE);
    for (int i = tile * MOE_TILE; i < i1; i++) c[topk[i]]++;
}

__global__ void moe_prefix_kernel(int32_t *offsets, int32_t *counts, int32_t *cnt, int E, int tiles, int cap) {
    /* one block */
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int32_t run = 0;
        for (int tile = 0; tile < tiles; tile++) {
            int32_t c = cnt[(size_t)tile * E + e];
            cnt[(size_t)tile * E + e] = run;
            run += c;
        }
        counts[e] = run;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        offsets[0] = 0;
        for (int e = 0; e < E; e++) offsets[e + 1] = offsets[e] + (cap > 0 && counts[e] > cap ? cap : counts[e]);
    }
}

__global__ void moe_place_kernel(int32_t *row_of, int32_t *src, int32_t *cnt, const int32_t *offsets,
                                 const int32_t *topk, int NK, int E, int K, int tiles, int cap) {
    int tile = blockIdx.x * blockDim.x + threadIdx.x;
    if (tile >= tiles) return;
    int32_t *c = cnt + (size_t)tile * E;
    int i1 = min(NK, (tile + 1) * MOE_TILE);
    for (int i = tile * MOE_TILE; i < i1; i++) {
        int e = topk[i], j = c[e]++;
        if (cap > 0 && j >= cap) {
            row_of[i] = -1;
        } else {
            row_of[i] = offsets[e] + j;
            src[offsets[e] + j] = i / K;
        }
    }
}

void cuda_moe_dispatch(int32_t *offsets, int32_t *row_of, int32_t *src, int32_t *counts, const int32_t *topk, int N,
                       int E, int K, int cap) {
    int NK = N * K, tiles = (NK + MOE_TILE - 1) / MOE_TILE;
    if (tiles < 1) tiles = 1;
    int32_t *cnt = (int32_t *)cuda_scratch(SCRATCH_MOE, (size_t)tiles * E * sizeof(int32_t));
    KLAUNCH(moe_tile_count_kernel, cuda_blocks(tiles, 128), 128, 0, cnt, topk, NK, E, tiles);
    CUDA_CHECK_LAUNCH();
    KLAUNCH(moe_prefix_kernel, 1, 256, 0, offsets, counts, cnt, E, tiles, cap);
    CUDA_CHECK_LAUNCH();
    KLAUNCH(moe_place_kernel, cuda_blocks(tiles, 128), 128, 0, row_of, src, cnt, offsets, topk, NK, E, K, tiles, cap);
    CUDA_CHECK_LAUNCH();
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
                                          float z_coef, int N, int E, int K, int sigmoid, int norm_topk) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= N) return;
    const float *p = probs + (size_t)t * E, *dg = dgates + (size_t)t * K, *g = gates + (size_t)t * K;
    const int32_t *sel = topk + (size_t)t * K;
    float *a = abuf + (size_t)t * E;
    for (int e = 0; e < E; e++) a[e] = aux ? aux[e] : 0.0f;
    if (norm_topk) {
        /* g_k = p_k / S: dL/dp_j = (dg_j - sum_k dg_k g_k) / S */
        float S = 0.0f, dgg = 0.0f;
        for (int k = 0; k < K; k++) S += p[sel[k]], dgg += dg[k] * g[k];
        for (int k = 0; k < K; k++) a[sel[k]] += (dg[k] - dgg) / S;
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
                                   int E, int K, int sigmoid, int norm_topk) {
    float *abuf = (float *)cuda_scratch(SCRATCH_MOE_GRAD, (size_t)N * E * sizeof(float));
    KLAUNCH(moe_route_backward_kernel<T_>, cuda_blocks(N, 128), 128, 0, (T_ *)dlogits, abuf, dgates, probs, topk,
            gates, (const T_ *)logits, aux, z_coef, N, E, K, sigmoid, norm_topk);
    CUDA_CHECK_LAUNCH();
}

void cuda_moe_route_backward(void *dlogits, const float *dgates, const float *probs, const int32_t *topk,
                             const float *gates, const void *logits, const float *aux, float z_coef, int N, int E,
                             int K, int sigmoid, int norm_topk) {
    ACT_DISPATCH(moe_route_backward_run, dlogits, dgates, probs, topk, gates, logits, aux, z_coef, N, E, K, sigmoid,
                 norm_topk);
}
