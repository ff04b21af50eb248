/* embed_norm: embeddings, LayerNorm and RMSNorm (and the residual add fused
 * with either), and the deterministic column sums that parameter gradients
 * (dw, db, dbias) are made of. Mirrors src/cpu/backend_cpu.c op for op; no
 * float atomics anywhere, so every result is the same bits run to run.
 * Activations in either dtype (templates on T, common.cuh), fp32 statistics
 * and parameter gradients. Never allocates except through the grow-only
 * scratch. */
#include <stdlib.h>
#include <string.h>

#include "common.cuh"

/* ---------------------------------------------------------------------------
 * Embedding */

template <typename T_>
__global__ void embed_forward_kernel(T_ *out, const int32_t *tokens, const T_ *wte, const T_ *wpe,
                                     int N, int T, int C) {
    /* out (N,C), tokens (N), wte (Vp,C), wpe (T,C) or NULL (no learned positions: a copy of the row) */
    size_t total = (size_t)N * C;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x) {
        size_t i = e / C, c = e % C;
        /* a negative id is another tp rank's token: a zero row */
        const T_ we = tokens[i] < 0 ? act_from<T_>(0.0f) : wte[(size_t)tokens[i] * C + c];
        out[e] = wpe ? act_from<T_>(act_f(we) + act_f(wpe[(i % T) * C + c])) : we;
    }
}

template <typename T_>
static void embed_forward_run(void *out, const int32_t *tokens, const void *wte, const void *wpe, int B,
                              int T, int C) {
    size_t n = (size_t)B * T * C;
    unsigned blocks = cuda_blocks(n, 256);
    if (blocks > 65536) blocks = 65536;
    KLAUNCH(embed_forward_kernel<T_>, blocks, 256, 0, (T_ *)out, tokens, (const T_ *)wte, (const T_ *)wpe, B * T, T, C);
    CUDA_CHECK_LAUNCH();
}

void cuda_embed_forward(void *out, const int32_t *tokens, const void *wte, const void *wpe, int B, int T,
                        int C) {
    ACT_DISPATCH(embed_forward_run, out, tokens, wte, wpe, B, T, C);
}

/* dwte without float atomics: positions are bucketed by token on the host
 * (llm.c's approach; N int32 down and up, a few tens of microseconds, at the
 * end of the backward pass where the host waits anyway), then block (r, y)
 * sums run r — every position of one token, in position order — over 128
 * channels, starting from what dwte holds. That is the CPU backend's order of
 * additions exactly, so dwte is the same bits on both backends given the same
 * dout. Layout of `plan`: run_tok[R], run_start[R + 1], pos[N]. */
template <typename T_>
__global__ void embed_dwte_kernel(float *dwte, const T_ *dout, const int32_t *plan, int R, int C) {
    int r = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int32_t *run_start = plan + R, *pos = plan + 2 * R + 1;
    float *dst = dwte + (size_t)plan[r] * C + c;
    float acc = *dst;
    for (int k = run_start[r]; k < run_start[r + 1]; k++) acc += act_f(dout[(size_t)pos[k] * C + c]);
    *dst = acc;
}

/* Host side of the bucketing, grow-only buffers kept for the run. */
static int32_t *embed_host_tok, *embed_host_plan, *embed_host_count;
static size_t embed_host_n, embed_host_vocab;

static void *embed_grow(void *p, size_t bytes) {
    void *q = realloc(p, bytes);
    if (!q) kiln_fail(KILN_EXIT_RUNTIME, "cuda backend: out of host memory (%zu bytes)", bytes);
    return q;
}

void cuda_embed_free_host(void) {
    free(embed_host_tok), free(embed_host_plan), free(embed_host_count);
    embed_host_tok = embed_host_plan = embed_host_count = NULL;
    embed_host_n = embed_host_vocab = 0;
}

/* Counting sort of positions by token (stable); returns the number of runs.
 * Negative ids (other tp ranks' tokens) are left out. */
static int embed_plan(const int32_t *tok, int N) {
    int32_t vmax = 0;
    int kept = 0;
    for (int i = 0; i < N; i++) {
        vmax = tok[i] > vmax ? tok[i] : vmax;
        kept += tok[i] >= 0;
    }
    size_t vocab = (size_t)vmax + 1;
    if (vocab > embed_host_vocab) {
        embed_host_count = (int32_t *)embed_grow(embed_host_count, (vocab + 1) * sizeof(int32_t));
        embed_host_vocab = vocab;
    }
    int32_t *count = embed_host_count;
    memset(count, 0, (vocab + 1) * sizeof(int32_t));
    for (int i = 0; i < N; i++)
        if (tok[i] >= 0) count[tok[i] + 1]++;
    int R = 0;
    for (size_t v = 0; v < vocab; v++) R += count[v + 1] > 0;
    int32_t *run_tok = embed_host_plan, *run_start = run_tok + R, *pos = run_start + R + 1;
    int r = 0;
    for (size_t v = 0; v < vocab; v++) { /* count[v] becomes the start of v's bucket */
        if (count[v + 1] > 0) {
            run_tok[r] = (int32_t)v;
            run_start[r] = count[v];
            r++;
        }
        count[v + 1] += count[v];
    }
    run_start[R] = kept;
    for (int i = 0; i < N; i++)
        if (tok[i] >= 0) pos[count[tok[i]]++] = i; /* in position order: stable */
    return R;
}

template <typename T_>
__global__ void embed_dwpe_kernel(float *dwpe, const T_ *dout, int B, int T, int C, int accumulate) {
    /* dwpe (T,C), dout (B*T,C); b summed in order from 0, as the CPU does */
    size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (e >= (size_t)T * C) return;
    float acc = accumulate ? dwpe[e] : 0.0f;
    for (int b = 0; b < B; b++) acc += act_f(dout[(size_t)b * T * C + e]);
    dwpe[e] = acc;
}

/* dwpe NULL: no learned positions (RoPE), no position gradient. R 0 (no
 * rows): dwte keeps what it holds, dwpe is zeroed or kept per accumulate. */
template <typename T_>
static void embed_backward_kernels(float *dwte, float *dwpe, const void *dout, const int32_t *plan, int R,
                                   int B, int T, int C, int accumulate) {
    if (R > 0) { /* a grid of 0 blocks is a launch error */
        dim3 grid(R, (C + 127) / 128);
        KLAUNCH(embed_dwte_kernel<T_>, grid, 128, 0, dwte, (const T_ *)dout, plan, R, C);
        CUDA_CHECK_LAUNCH();
    }
    if (!dwpe) return;
    KLAUNCH(embed_dwpe_kernel<T_>, cuda_blocks((size_t)T * C, 256), 256, 0, dwpe, (const T_ *)dout, B, T, C, accumulate);
    CUDA_CHECK_LAUNCH();
}

void cuda_embed_backward(float *dwte, float *dwpe, const void *dout, const int32_t *tokens,
                         const int32_t *tokens_host, int B, int T, int C, int accumulate) {
    int N = B * T;
    if (N == 0) { /* no tokens: only dwpe's zeroing (accumulate 0) is left to do */
        ACT_DISPATCH(embed_backward_kernels, dwte, dwpe, dout, (const int32_t *)NULL, 0, B, T, C, accumulate);
        return;
    }
    if ((size_t)N > embed_host_n) {
        embed_host_tok = (int32_t *)embed_grow(embed_host_tok, (size_t)N * sizeof(int32_t));
        embed_host_plan = (int32_t *)embed_grow(embed_host_plan, (size_t)(3 * N + 1) * sizeof(int32_t));
        embed_host_n = (size_t)N;
    }
    /* the ids from the host when the caller has them there: reading them
     * back would wait for the device */
    if (!tokens_host) {
        CUDA_HOST_WAIT(cudaMemcpy(embed_host_tok, tokens, (size_t)N * sizeof(int32_t), cudaMemcpyDeviceToHost));
        tokens_host = embed_host_tok;
    }
    int R = embed_plan(tokens_host, N);
    size_t plan_bytes = (size_t)(2 * R + 1 + N) * sizeof(int32_t);
    int32_t *plan = (int32_t *)cuda_scratch(SCRATCH_EMBED, (size_t)(3 * N + 1) * sizeof(int32_t));
    cuda_stage_to_device(plan, embed_host_plan, plan_bytes); /* queued, no wait: the staging ring */
    ACT_DISPATCH(embed_backward_kernels, dwte, dwpe, dout, plan, R, B, T, C, accumulate);
}

/* ---------------------------------------------------------------------------
 * LayerNorm (eps 1e-5, biased variance) and RMSNorm (Llama: rstd =
 * 1/sqrt(mean(x^2) + eps), out = x rstd w), one warp per row, and the
 * residual add fused with either (backend.h residual_norm_forward).
 *
 * Every kernel here is a template on W, the elements a lane moves at once:
 * W = PACK(T_), one 16-byte load or store (8 bf16 or 4 fp32), when C is whole
 * packs and every pointer 16-byte aligned (so is every row), else W = 1. A
 * lane takes the vectors lane, lane + 32, ... of its row in every pass: at
 * C = 768 in bf16, 3 loads per lane and pass instead of 24. */

template <typename T_, int W> __device__ __forceinline__ void vec_load(float (&f)[W], const T_ *p) {
    if constexpr (W == 1) {
        f[0] = act_f(*p);
    } else {
        static_assert(W == PACK(T_), "a vector is one element or one 16-byte pack");
        Pack<T_> x = pack_load(p);
#pragma unroll
        for (int k = 0; k < W; k++) f[k] = act_f(x.v[k]);
    }
}
template <typename T_, int W> __device__ __forceinline__ void vec_store(T_ *p, const float (&f)[W]) {
    if constexpr (W == 1) {
        *p = act_from<T_>(f[0]);
    } else {
        Pack<T_> x;
#pragma unroll
        for (int k = 0; k < W; k++) x.v[k] = act_from<T_>(f[k]);
        pack_store(p, x);
    }
}

/* The first pass of a norm over one row (element offset `off`): the norm's
 * input x is a's row, or with b the residual add x = a + b, rounded to act
 * as residual_forward rounds it and stored in res. Returns where x's row is,
 * and in *sum this lane's sum of x (sq 0) or of x^2 (sq 1), in the order the
 * norm alone sums x: so a fused call gives the bits of the add then the
 * norm. Every later pass gives a lane the vectors it stored itself; the
 * __syncwarp orders the stores for the warp anyway. */
template <typename T_, int W>
__device__ __forceinline__ const T_ *norm_row_first(T_ *res, const T_ *a, const T_ *b, size_t off, int C, int lane,
                                                    int sq, float *sum) {
    float s = 0.0f;
    for (int c = lane * W; c < C; c += 32 * W) {
        float x[W];
        vec_load<T_, W>(x, a + off + c);
        if (b) {
            float y[W];
            vec_load<T_, W>(y, b + off + c);
#pragma unroll
            for (int k = 0; k < W; k++) x[k] = act_f(act_from<T_>(x[k] + y[k]));
            vec_store<T_, W>(res + off + c, x);
        }
#pragma unroll
        for (int k = 0; k < W; k++) s += sq ? x[k] * x[k] : x[k];
    }
    *sum = s;
    if (!b) return a + off;
    __syncwarp();
    return res + off;
}

/* out (N,C), mean, rstd (N); x = a (N,C) or, with b, res = a + b (N,C);
 * w (C), bias (C) or NULL */
template <typename T_, int W>
__global__ void layernorm_forward_kernel(T_ *out, float *mean, float *rstd, T_ *res, const T_ *a, const T_ *b,
                                         const T_ *w, const T_ *bias, int N, int C, float eps) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    size_t off = (size_t)row * C;
    float s;
    const T_ *x = norm_row_first<T_, W>(res, a, b, off, C, lane, 0, &s);
    float m = warp_sum(s) / C;
    /* Two passes, as the CPU backend: no cancellation for a large mean. */
    float v = 0.0f;
    for (int c = lane * W; c < C; c += 32 * W) {
        float f[W];
        vec_load<T_, W>(f, x + c);
#pragma unroll
        for (int k = 0; k < W; k++) {
            float d = f[k] - m;
            v += d * d;
        }
    }
    float r = 1.0f / sqrtf(warp_sum(v) / C + eps);
    for (int c = lane * W; c < C; c += 32 * W) {
        float f[W], g[W];
        vec_load<T_, W>(f, x + c);
        vec_load<T_, W>(g, w + c);
        if (bias) {
            float h[W];
            vec_load<T_, W>(h, bias + c);
#pragma unroll
            for (int k = 0; k < W; k++) f[k] = (f[k] - m) * r * g[k] + h[k];
        } else {
#pragma unroll
            for (int k = 0; k < W; k++) f[k] = (f[k] - m) * r * g[k];
        }
        vec_store<T_, W>(out + off + c, f);
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

/* out (N,C), rstd (N); x as layernorm_forward_kernel's; w (C) */
template <typename T_, int W>
__global__ void rmsnorm_forward_kernel(T_ *out, float *rstd, T_ *res, const T_ *a, const T_ *b, const T_ *w, int N,
                                       int C, float eps) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    size_t off = (size_t)row * C;
    float s;
    const T_ *x = norm_row_first<T_, W>(res, a, b, off, C, lane, 1, &s);
    float r = 1.0f / sqrtf(warp_sum(s) / C + eps);
    for (int c = lane * W; c < C; c += 32 * W) {
        float f[W], g[W];
        vec_load<T_, W>(f, x + c);
        vec_load<T_, W>(g, w + c);
#pragma unroll
        for (int k = 0; k < W; k++) f[k] = f[k] * r * g[k];
        vec_store<T_, W>(out + off + c, f);
    }
    if (lane == 0) rstd[row] = r;
}

/* Whole 16-byte packs: C a multiple of the pack and every pointer aligned
 * (NULL ones aside). */
template <typename T_> static int norm_packed(int C, const void *const *p, int n) {
    int ok = C % (int)PACK(T_) == 0;
    for (int i = 0; i < n; i++) ok = ok && (!p[i] || aligned16(p[i]));
    return ok;
}

/* A norm forward (mean NULL: RMSNorm, bias NULL then) of x = a, or of res =
 * a + b with b. */
template <typename T_>
static void norm_forward_run(void *out, float *mean, float *rstd, void *res, const void *a, const void *b,
                             const void *w, const void *bias, int N, int C, float eps) {
    const void *ptrs[] = {out, res, a, b, w, bias};
    const int P = (int)PACK(T_);
    unsigned blocks = cuda_blocks(N, 8); /* 8 warps (rows) per block of 256 */
    if (norm_packed<T_>(C, ptrs, 6)) {
        if (mean)
            KLAUNCH((layernorm_forward_kernel<T_, P>), blocks, 256, 0, (T_ *)out, mean, rstd, (T_ *)res, (const T_ *)a,
                    (const T_ *)b, (const T_ *)w, (const T_ *)bias, N, C, eps);
        else
            KLAUNCH((rmsnorm_forward_kernel<T_, P>), blocks, 256, 0, (T_ *)out, rstd, (T_ *)res, (const T_ *)a,
                    (const T_ *)b, (const T_ *)w, N, C, eps);
    } else {
        if (mean)
            KLAUNCH((layernorm_forward_kernel<T_, 1>), blocks, 256, 0, (T_ *)out, mean, rstd, (T_ *)res, (const T_ *)a,
                    (const T_ *)b, (const T_ *)w, (const T_ *)bias, N, C, eps);
        else
            KLAUNCH((rmsnorm_forward_kernel<T_, 1>), blocks, 256, 0, (T_ *)out, rstd, (T_ *)res, (const T_ *)a,
                    (const T_ *)b, (const T_ *)w, N, C, eps);
    }
    CUDA_CHECK_LAUNCH();
}

void cuda_layernorm_forward(void *out, float *mean, float *rstd, const void *inp, const void *w,
                            const void *b, int N, int C, float eps) {
    ACT_DISPATCH(norm_forward_run, out, mean, rstd, NULL, inp, NULL, w, b, N, C, eps);
}

void cuda_rmsnorm_forward(void *out, float *rstd, const void *inp, const void *w, int N, int C, float eps) {
    ACT_DISPATCH(norm_forward_run, out, (float *)NULL, rstd, NULL, inp, NULL, w, NULL, N, C, eps);
}

/* One launch instead of the add's and the norm's, and res is not read back
 * from HBM. Where C is whole packs but a or b is not 16-byte aligned (never
 * in the model: its act buffers are), the norm alone would read res in packs
 * while the fused kernel could not: the two ops run instead, so the result
 * is always the composition's bits. */
void cuda_residual_norm_forward(void *res, void *out, float *mean, float *rstd, const void *a, const void *b,
                                const void *w, const void *bias, int N, int C, float eps) {
    /* res, out, a, b (N,C) act; mean (N) fp32 or NULL (RMSNorm); rstd (N) fp32; w, bias (C) act */
    int P = 16 / (cuda_act_bf16 ? 2 : 4); /* elements per pack */
    if (C % P == 0 && !(aligned16(a) && aligned16(b))) {
        cuda_residual_forward(res, a, b, (size_t)N * C);
        a = res, b = NULL;
    }
    ACT_DISPATCH(norm_forward_run, out, mean, rstd, b ? res : NULL, a, b, w, bias, N, C, eps);
}

/* ---------------------------------------------------------------------------
 * Norm backward, one kernel: block k takes chunk k of the rows (how many
 * depends only on N) and writes
 *  - dinp += of its rows, one warp per row (two passes over the row: the
 *    row's two sums, then the gradient), and
 *  - its partial sums of dw (and LayerNorm's db) over its rows: row lane ty
 *    (the warp) sums rows ty, ty + 8, ... of the chunk, lane tx the vectors
 *    tx, tx + 32, ... of the columns, then the 8 row lanes are added in
 *    order through shared memory. The chunk's rows were just read by the
 *    first part, so this re-read comes from L1/L2, not HBM.
 * colsum_finish_kernel then adds the partials in chunk order onto dw (db)
 * per `accumulate`. No float atomics: the same bits every run, whatever the
 * GPU. mean NULL is RMSNorm: dinp += r (dy w) - x r^3 mean(dy w x), dw =
 * sum dy x r, no db. */

#define NORM_BWD_WARPS 8

/* Chunks of at least 32 rows, at most 1024 of them (one block each: 512 at
 * GPT-2's 16,384 rows, ~4 per SM on an H100); N 0 is one empty chunk (a grid
 * of 0 blocks is a launch error) whose sums are 0. */
static int norm_bwd_chunks(int N) {
    int chunks = (N + 31) / 32;
    if (chunks < 1) chunks = 1;
    return chunks < 1024 ? chunks : 1024;
}

template <typename T_, int W>
__global__ void __launch_bounds__(32 * NORM_BWD_WARPS)
    norm_backward_kernel(T_ *dinp, float *part_w, float *part_b, const T_ *dout, const T_ *inp, const T_ *w,
                         const float *mean, const float *rstd, int N, int C, int rows_per_chunk) {
    /* dinp, dout, inp (N,C) +=; part_w, part_b (chunks, C): this block's row; w (C); mean, rstd (N) */
    __shared__ float sw[NORM_BWD_WARPS][W][32], sb[NORM_BWD_WARPS][W][32];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, chunk = blockIdx.x;
    int r0 = chunk * rows_per_chunk, r1 = min(N, r0 + rows_per_chunk);
    for (int row = r0 + warp; row < r1; row += NORM_BWD_WARPS) {
        const T_ *x = inp + (size_t)row * C, *d = dout + (size_t)row * C;
        T_ *di = dinp + (size_t)row * C;
        float m = mean ? mean[row] : 0.0f, r = rstd[row];
        float s1 = 0.0f, s2 = 0.0f; /* LayerNorm: sum dnorm, sum dnorm norm; RMSNorm: s2 = sum dy w x */
        for (int c = lane * W; c < C; c += 32 * W) {
            float fx[W], fd[W], fw[W];
            vec_load<T_, W>(fx, x + c), vec_load<T_, W>(fd, d + c), vec_load<T_, W>(fw, w + c);
#pragma unroll
            for (int k = 0; k < W; k++) {
                float dn = fd[k] * fw[k];
                s1 += dn;
                s2 += mean ? dn * (fx[k] - m) * r : dn * fx[k];
            }
        }
        s1 = warp_sum(s1) / C;
        s2 = warp_sum(s2) / C;
        float k3 = r * r * r * s2; /* RMSNorm */
        for (int c = lane * W; c < C; c += 32 * W) {
            float fx[W], fd[W], fw[W], g[W];
            vec_load<T_, W>(fx, x + c), vec_load<T_, W>(fd, d + c), vec_load<T_, W>(fw, w + c);
            vec_load<T_, W>(g, di + c);
#pragma unroll
            for (int k = 0; k < W; k++)
                g[k] += mean ? (fd[k] * fw[k] - s1 - (fx[k] - m) * r * s2) * r : r * (fd[k] * fw[k]) - fx[k] * k3;
            vec_store<T_, W>(di + c, g);
        }
    }
    for (int c0 = 0; c0 < C; c0 += 32 * W) { /* every thread runs every round: the barriers */
        int c = c0 + lane * W;
        float aw[W], ab[W];
#pragma unroll
        for (int k = 0; k < W; k++) aw[k] = ab[k] = 0.0f;
        if (c < C) {
            for (int row = r0 + warp; row < r1; row += NORM_BWD_WARPS) {
                float fx[W], fd[W], m = mean ? mean[row] : 0.0f, r = rstd[row];
                vec_load<T_, W>(fx, inp + (size_t)row * C + c), vec_load<T_, W>(fd, dout + (size_t)row * C + c);
#pragma unroll
                for (int k = 0; k < W; k++) {
                    aw[k] += fd[k] * (fx[k] - m) * r;
                    ab[k] += fd[k];
                }
            }
        }
#pragma unroll
        for (int k = 0; k < W; k++) sw[warp][k][lane] = aw[k], sb[warp][k][lane] = ab[k];
        __syncthreads();
        if (warp == 0 && c < C) {
            for (int j = 1; j < NORM_BWD_WARPS; j++)
#pragma unroll
                for (int k = 0; k < W; k++) aw[k] += sw[j][k][lane], ab[k] += sb[j][k][lane];
#pragma unroll
            for (int k = 0; k < W; k++) {
                part_w[(size_t)chunk * C + c + k] = aw[k];
                if (part_b) part_b[(size_t)chunk * C + c + k] = ab[k];
            }
        }
        __syncthreads(); /* the next round's stores wait for warp 0's reads */
    }
}

/* The partials (chunks, C) summed per column: block (32, COLSUM_FIN_LANES)
 * over 32 columns, lane ty summing chunks ty, ty + LANES, ... in order, then
 * the lanes in lane order, then onto what out holds (accumulate). A single
 * thread per column summing all 256 partials serially made each call a chain
 * of dependent L2 loads on a handful of blocks (C / 256 of them): ~10 us per
 * output, ~70 calls a step at GPT-2 124M (docs/benchmarks.md's budget). */
#define COLSUM_FIN_LANES 32
/* bounds = the launch's 32 x COLSUM_FIN_LANES = 1024 threads (64 registers at most) */
__global__ void __launch_bounds__(32 * COLSUM_FIN_LANES) colsum_finish_kernel(float *out_a, float *out_b, const float *part_a,
                                     const float *part_b, int chunks, int C, int accumulate) {
    __shared__ float sa[COLSUM_FIN_LANES][33], sb[COLSUM_FIN_LANES][33];
    int tx = threadIdx.x, ty = threadIdx.y, c = blockIdx.x * 32 + tx;
    float a = 0.0f, b = 0.0f;
    if (c < C) {
        for (int k = ty; k < chunks; k += COLSUM_FIN_LANES) {
            a += part_a[(size_t)k * C + c];
            if (out_b) b += part_b[(size_t)k * C + c];
        }
    }
    sa[ty][tx] = a;
    sb[ty][tx] = b;
    __syncthreads();
    if (ty != 0 || c >= C) return;
    for (int k = 1; k < COLSUM_FIN_LANES; k++) a += sa[k][tx], b += sb[k][tx];
    out_a[c] = accumulate ? out_a[c] + a : a;
    if (out_b) out_b[c] = accumulate ? out_b[c] + b : b;
}

static void colsum_finish_run(float *out_a, float *out_b, const float *part_a, const float *part_b, int chunks, int C,
                              int accumulate) {
    KLAUNCH(colsum_finish_kernel, (C + 31) / 32, dim3(32, COLSUM_FIN_LANES), 0, out_a, out_b, part_a, part_b, chunks,
            C, accumulate);
    CUDA_CHECK_LAUNCH();
}

template <typename T_>
static void norm_backward_run(void *dinp, float *dw, float *db, const void *dout, const void *inp, const void *w,
                              const float *mean, const float *rstd, int N, int C, int accumulate) {
    int chunks = norm_bwd_chunks(N), rows_per_chunk = (N + chunks - 1) / chunks;
    float *part = (float *)cuda_scratch(SCRATCH_COLSUM, (size_t)2 * chunks * C * sizeof(float));
    float *part_w = part, *part_b = db ? part + (size_t)chunks * C : NULL;
    const void *ptrs[] = {dinp, dout, inp, w};
    const int P = (int)PACK(T_);
    if (norm_packed<T_>(C, ptrs, 4))
        KLAUNCH((norm_backward_kernel<T_, P>), chunks, 32 * NORM_BWD_WARPS, 0, (T_ *)dinp, part_w, part_b,
                (const T_ *)dout, (const T_ *)inp, (const T_ *)w, mean, rstd, N, C, rows_per_chunk);
    else
        KLAUNCH((norm_backward_kernel<T_, 1>), chunks, 32 * NORM_BWD_WARPS, 0, (T_ *)dinp, part_w, part_b,
                (const T_ *)dout, (const T_ *)inp, (const T_ *)w, mean, rstd, N, C, rows_per_chunk);
    CUDA_CHECK_LAUNCH();
    colsum_finish_run(dw, db, part_w, part_b, chunks, C, accumulate);
}

void cuda_layernorm_backward(void *dinp, float *dw, float *db, const void *dout, const void *inp,
                             const void *w, const float *mean, const float *rstd, int N, int C,
                             int accumulate) {
    ACT_DISPATCH(norm_backward_run, dinp, dw, db, dout, inp, w, mean, rstd, N, C, accumulate);
}

void cuda_rmsnorm_backward(void *dinp, float *dw, const void *dout, const void *inp, const void *w, const float *rstd,
                           int N, int C, int accumulate) {
    ACT_DISPATCH(norm_backward_run, dinp, dw, (float *)NULL, dout, inp, w, (const float *)NULL, rstd, N, C,
                 accumulate);
}

/* ---------------------------------------------------------------------------
 * Deterministic column sums: the bias gradient where cuBLASLt's BGRADB
 * epilogue does not take a product (matmul.cu), and no rows. Rows are cut
 * into a number of chunks that depends only on N; block (x, chunk) sums 32
 * columns of its chunk with 8 row lanes, combines the lanes in lane order and
 * writes one partial per column; colsum_finish_kernel adds the partials in
 * chunk order. */

#define COLSUM_ROWS 8

static int colsum_chunks(int N) {
    int chunks = (N + 63) / 64; /* >= 64 rows per chunk ... */
    if (chunks < 1) chunks = 1; /* N 0: one empty chunk (a grid of 0 blocks is a launch error), sums 0 */
    return chunks < 256 ? chunks : 256; /* ... and at most 256 partials */
}

template <typename T_>
__global__ void colsum_partial_kernel(float *part, const T_ *dout, int N, int C, int rows_per_chunk) {
    __shared__ float sa[COLSUM_ROWS][32];
    int tx = threadIdx.x, ty = threadIdx.y;
    int c = blockIdx.x * 32 + tx, chunk = blockIdx.y;
    int r0 = chunk * rows_per_chunk, r1 = min(N, r0 + rows_per_chunk);
    float a = 0.0f;
    if (c < C)
        for (int r = r0 + ty; r < r1; r += COLSUM_ROWS) a += act_f(dout[(size_t)r * C + c]);
    sa[ty][tx] = a;
    __syncthreads();
    if (ty == 0 && c < C) {
        for (int k = 1; k < COLSUM_ROWS; k++) a += sa[k][tx];
        part[(size_t)chunk * C + c] = a;
    }
}

template <typename T_>
static void colsum_run(float *dbias, const void *dout, int N, int C, int accumulate) {
    int chunks = colsum_chunks(N);
    int rows_per_chunk = (N + chunks - 1) / chunks;
    float *part = (float *)cuda_scratch(SCRATCH_COLSUM, (size_t)chunks * C * sizeof(float));
    dim3 grid((C + 31) / 32, chunks), block(32, COLSUM_ROWS);
    KLAUNCH(colsum_partial_kernel<T_>, grid, block, 0, part, (const T_ *)dout, N, C, rows_per_chunk);
    CUDA_CHECK_LAUNCH();
    colsum_finish_run(dbias, NULL, part, NULL, chunks, C, accumulate);
}

void cuda_colsum(float *dbias, const void *dout, int N, int OC, int accumulate) {
    ACT_DISPATCH(colsum_run, dbias, dout, N, OC, accumulate);
}

/* The column-sum finish for other files' partials (llama.cu's QK-norm
 * weight gradients): out(C) (+)= sum over chunks of part(chunks, C). */
int cuda_colsum_chunks(int N) { return colsum_chunks(N); }
void cuda_colsum_finish(float *out, const float *part, int chunks, int C, int accumulate) {
    colsum_finish_run(out, NULL, part, NULL, chunks, C, accumulate);
}
