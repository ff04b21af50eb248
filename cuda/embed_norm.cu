/* embed_norm: embeddings, LayerNorm and the deterministic column sums that
 * parameter gradients (dw, db, dbias) are made of. Mirrors src/cpu/backend_cpu.c
 * op for op; no float atomics anywhere, so every result is the same bits run
 * to run. Activations in either dtype (templates on T, common.cuh), fp32
 * statistics and parameter gradients. Never allocates except through the
 * grow-only scratch. */
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
 * LayerNorm (eps 1e-5, biased variance), one warp per row */

/* packed: C is whole 16-byte packs and every pointer 16-byte aligned (so is
 * every row), and lanes take packs lane, lane + 32, ...: at C = 768 in bf16,
 * 3 16-byte loads per lane and pass instead of 24 2-byte ones (25 calls a
 * step at GPT-2 124M, docs/benchmarks.md). Else element by element. Same
 * math per element; the sums' order differs (fp32 rounding). */
template <typename T_>
__global__ void layernorm_forward_kernel(T_ *out, float *mean, float *rstd, const T_ *inp, const T_ *w,
                                         const T_ *b, int N, int C, float eps, int packed) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    const T_ *x = inp + (size_t)row * C;
    T_ *o = out + (size_t)row * C;
    const int P = (int)PACK(T_), np = packed ? C / P : 0;
    float s = 0.0f;
    for (int i = lane; i < np; i += 32) {
        Pack<T_> p = pack_load(x + i * P);
#pragma unroll
        for (int k = 0; k < P; k++) s += act_f(p.v[k]);
    }
    for (int c = np * P + lane; c < C; c += 32) s += act_f(x[c]);
    float m = warp_sum(s) / C;
    /* Two passes, as the CPU backend: no cancellation for a large mean. */
    float v = 0.0f;
    for (int i = lane; i < np; i += 32) {
        Pack<T_> p = pack_load(x + i * P);
#pragma unroll
        for (int k = 0; k < P; k++) {
            float d = act_f(p.v[k]) - m;
            v += d * d;
        }
    }
    for (int c = np * P + lane; c < C; c += 32) {
        float d = act_f(x[c]) - m;
        v += d * d;
    }
    float r = 1.0f / sqrtf(warp_sum(v) / C + eps);
    for (int i = lane; i < np; i += 32) {
        Pack<T_> p = pack_load(x + i * P), pw = pack_load(w + i * P);
        if (b) {
            Pack<T_> pb = pack_load(b + i * P);
#pragma unroll
            for (int k = 0; k < P; k++) p.v[k] = act_from<T_>((act_f(p.v[k]) - m) * r * act_f(pw.v[k]) + act_f(pb.v[k]));
        } else {
#pragma unroll
            for (int k = 0; k < P; k++) p.v[k] = act_from<T_>((act_f(p.v[k]) - m) * r * act_f(pw.v[k]));
        }
        pack_store(o + i * P, p);
    }
    for (int c = np * P + lane; c < C; c += 32)
        o[c] = act_from<T_>((act_f(x[c]) - m) * r * act_f(w[c]) + (b ? act_f(b[c]) : 0.0f));
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

template <typename T_>
static void layernorm_forward_run(void *out, float *mean, float *rstd, const void *inp, const void *w,
                                  const void *b, int N, int C, float eps) {
    int packed = C % (int)PACK(T_) == 0 && aligned16(out) && aligned16(inp) && aligned16(w) && (!b || aligned16(b));
    KLAUNCH(layernorm_forward_kernel<T_>, cuda_blocks(N, 8), 256, 0, (T_ *)out, mean, rstd, (const T_ *)inp,
            (const T_ *)w, (const T_ *)b, N, C, eps, packed);
    CUDA_CHECK_LAUNCH();
}

void cuda_layernorm_forward(void *out, float *mean, float *rstd, const void *inp, const void *w,
                            const void *b, int N, int C, float eps) {
    ACT_DISPATCH(layernorm_forward_run, out, mean, rstd, inp, w, b, N, C, eps);
}

template <typename T_>
__global__ void layernorm_dinp_kernel(T_ *dinp, const T_ *dout, const T_ *inp, const T_ *w,
                                      const float *mean, const float *rstd, int N, int C) {
    /* dinp (N,C) +=, one warp per row */
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    const T_ *x = inp + (size_t)row * C, *d = dout + (size_t)row * C;
    float m = mean[row], r = rstd[row];
    float sd = 0.0f, sdn = 0.0f; /* mean(dnorm), mean(dnorm * norm) */
    for (int c = lane; c < C; c += 32) {
        float dn = act_f(d[c]) * act_f(w[c]);
        sd += dn;
        sdn += dn * (act_f(x[c]) - m) * r;
    }
    sd = warp_sum(sd) / C;
    sdn = warp_sum(sdn) / C;
    T_ *di = dinp + (size_t)row * C;
    for (int c = lane; c < C; c += 32) {
        float n = (act_f(x[c]) - m) * r;
        di[c] = act_from<T_>(act_f(di[c]) + (act_f(d[c]) * act_f(w[c]) - sd - n * sdn) * r);
    }
}

/* ---------------------------------------------------------------------------
 * Deterministic column sums. Rows are cut into a number of chunks that
 * depends only on N; block (x, chunk) sums 32 columns of its chunk with 8 row
 * lanes, combines the lanes in lane order and writes one partial per column;
 * a second kernel adds the partials in chunk order. With `inp` the summand of
 * the first output is dout * (inp - mean) * rstd (LayerNorm's dw) and the
 * second output gets plain dout (db); without, only the plain sum (dbias).
 * mean NULL is RMSNorm's dw: dout * inp * rstd, no second output. */

#define COLSUM_ROWS 8

static int colsum_chunks(int N) {
    int chunks = (N + 63) / 64; /* >= 64 rows per chunk ... */
    if (chunks < 1) chunks = 1; /* N 0: one empty chunk (a grid of 0 blocks is a launch error), sums 0 */
    return chunks < 256 ? chunks : 256; /* ... and at most 256 partials */
}

template <typename T_>
__global__ void colsum_partial_kernel(float *part_a, float *part_b, const T_ *dout, const T_ *inp,
                                      const float *mean, const float *rstd, int N, int C,
                                      int rows_per_chunk) {
    __shared__ float sa[COLSUM_ROWS][32], sb[COLSUM_ROWS][32];
    int tx = threadIdx.x, ty = threadIdx.y;
    int c = blockIdx.x * 32 + tx, chunk = blockIdx.y;
    int r0 = chunk * rows_per_chunk, r1 = min(N, r0 + rows_per_chunk);
    float a = 0.0f, b = 0.0f;
    if (c < C) {
        for (int r = r0 + ty; r < r1; r += COLSUM_ROWS) {
            float d = act_f(dout[(size_t)r * C + c]);
            if (inp) {
                a += d * (act_f(inp[(size_t)r * C + c]) - (mean ? mean[r] : 0.0f)) * rstd[r];
                b += d;
            } else {
                a += d;
            }
        }
    }
    sa[ty][tx] = a;
    sb[ty][tx] = b;
    __syncthreads();
    if (ty == 0 && c < C) {
        for (int k = 1; k < COLSUM_ROWS; k++) {
            a += sa[k][tx];
            b += sb[k][tx];
        }
        part_a[(size_t)chunk * C + c] = a;
        if (inp) part_b[(size_t)chunk * C + c] = b;
    }
}

/* The partials (chunks, C) summed per column: block (32, COLSUM_FIN_LANES)
 * over 32 columns, lane ty summing chunks ty, ty + LANES, ... in order, then
 * the lanes in lane order, then onto what out holds (accumulate). A single
 * thread per column summing all 256 partials serially made each call a chain
 * of dependent L2 loads on a handful of blocks (C / 256 of them): ~10 us per
 * output, ~70 calls a step at GPT-2 124M (docs/benchmarks.md's budget). */
#define COLSUM_FIN_LANES 32
__global__ void colsum_finish_kernel(float *out_a, float *out_b, const float *part_a,
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

template <typename T_>
static void colsum_run(float *out_a, float *out_b, const void *dout, const void *inp, const float *mean,
                       const float *rstd, int N, int C, int accumulate) {
    int chunks = colsum_chunks(N);
    int rows_per_chunk = (N + chunks - 1) / chunks;
    float *part = (float *)cuda_scratch(SCRATCH_COLSUM, (size_t)2 * chunks * C * sizeof(float));
    float *part_a = part, *part_b = part + (size_t)chunks * C;
    dim3 grid((C + 31) / 32, chunks), block(32, COLSUM_ROWS);
    KLAUNCH(colsum_partial_kernel<T_>, grid, block, 0, part_a, part_b, (const T_ *)dout, (const T_ *)inp, mean,
            rstd, N, C, rows_per_chunk);
    CUDA_CHECK_LAUNCH();
    KLAUNCH(colsum_finish_kernel, (C + 31) / 32, dim3(32, COLSUM_FIN_LANES), 0, out_a, out_b, part_a,
            inp ? part_b : NULL, chunks, C, accumulate);
    CUDA_CHECK_LAUNCH();
}

void cuda_colsum(float *dbias, const void *dout, int N, int OC, int accumulate) {
    ACT_DISPATCH(colsum_run, dbias, NULL, dout, NULL, NULL, NULL, N, OC, accumulate);
}

template <typename T_>
static void layernorm_backward_run(void *dinp, float *dw, float *db, const void *dout, const void *inp,
                                   const void *w, const float *mean, const float *rstd, int N, int C,
                                   int accumulate) {
    KLAUNCH(layernorm_dinp_kernel<T_>, cuda_blocks(N, 8), 256, 0, (T_ *)dinp, (const T_ *)dout, (const T_ *)inp,
            (const T_ *)w, mean, rstd, N, C);
    CUDA_CHECK_LAUNCH();
    colsum_run<T_>(dw, db, dout, inp, mean, rstd, N, C, accumulate);
}

void cuda_layernorm_backward(void *dinp, float *dw, float *db, const void *dout, const void *inp,
                             const void *w, const float *mean, const float *rstd, int N, int C,
                             int accumulate) {
    ACT_DISPATCH(layernorm_backward_run, dinp, dw, db, dout, inp, w, mean, rstd, N, C, accumulate);
}

/* ---------------------------------------------------------------------------
 * RMSNorm (Llama), one warp per row, as LayerNorm without the centring and
 * the bias: rstd = 1/sqrt(mean(x^2) + eps), out = x rstd w. */

template <typename T_>
__global__ void rmsnorm_forward_kernel(T_ *out, float *rstd, const T_ *inp, const T_ *w, int N, int C, float eps,
                                       int packed) {
    /* out, inp (N,C), w (C), rstd (N) */
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    const T_ *x = inp + (size_t)row * C;
    T_ *o = out + (size_t)row * C;
    const int P = (int)PACK(T_), np = packed ? C / P : 0;
    float s = 0.0f;
    for (int i = lane; i < np; i += 32) {
        Pack<T_> p = pack_load(x + i * P);
#pragma unroll
        for (int k = 0; k < P; k++) s += act_f(p.v[k]) * act_f(p.v[k]);
    }
    for (int c = np * P + lane; c < C; c += 32) s += act_f(x[c]) * act_f(x[c]);
    float r = 1.0f / sqrtf(warp_sum(s) / C + eps);
    for (int i = lane; i < np; i += 32) {
        Pack<T_> p = pack_load(x + i * P), pw = pack_load(w + i * P);
#pragma unroll
        for (int k = 0; k < P; k++) p.v[k] = act_from<T_>(act_f(p.v[k]) * r * act_f(pw.v[k]));
        pack_store(o + i * P, p);
    }
    for (int c = np * P + lane; c < C; c += 32) o[c] = act_from<T_>(act_f(x[c]) * r * act_f(w[c]));
    if (lane == 0) rstd[row] = r;
}

template <typename T_>
static void rmsnorm_forward_run(void *out, float *rstd, const void *inp, const void *w, int N, int C, float eps) {
    int packed = C % (int)PACK(T_) == 0 && aligned16(out) && aligned16(inp) && aligned16(w);
    KLAUNCH(rmsnorm_forward_kernel<T_>, cuda_blocks(N, 8), 256, 0, (T_ *)out, rstd, (const T_ *)inp, (const T_ *)w, N,
            C, eps, packed);
    CUDA_CHECK_LAUNCH();
}

void cuda_rmsnorm_forward(void *out, float *rstd, const void *inp, const void *w, int N, int C, float eps) {
    ACT_DISPATCH(rmsnorm_forward_run, out, rstd, inp, w, N, C, eps);
}

/* dinp += r (dy w) - x r^3 mean(dy w x), one warp per row. */
template <typename T_>
__global__ void rmsnorm_dinp_kernel(T_ *dinp, const T_ *dout, const T_ *inp, const T_ *w, const float *rstd, int N,
                                    int C) {
    /* dinp, dout, inp (N,C), w (C), rstd (N) */
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    const T_ *x = inp + (size_t)row * C, *d = dout + (size_t)row * C;
    float r = rstd[row], s = 0.0f;
    for (int c = lane; c < C; c += 32) s += act_f(d[c]) * act_f(w[c]) * act_f(x[c]);
    float k = r * r * r * (warp_sum(s) / C);
    T_ *di = dinp + (size_t)row * C;
    for (int c = lane; c < C; c += 32)
        di[c] = act_from<T_>(act_f(di[c]) + (r * (act_f(d[c]) * act_f(w[c])) - act_f(x[c]) * k));
}

template <typename T_>
static void rmsnorm_backward_run(void *dinp, float *dw, const void *dout, const void *inp, const void *w,
                                 const float *rstd, int N, int C, int accumulate) {
    KLAUNCH(rmsnorm_dinp_kernel<T_>, cuda_blocks(N, 8), 256, 0, (T_ *)dinp, (const T_ *)dout, (const T_ *)inp,
            (const T_ *)w, rstd, N, C);
    CUDA_CHECK_LAUNCH();
    colsum_run<T_>(dw, NULL, dout, inp, NULL, rstd, N, C, accumulate);
}

void cuda_rmsnorm_backward(void *dinp, float *dw, const void *dout, const void *inp, const void *w, const float *rstd,
                           int N, int C, int accumulate) {
    ACT_DISPATCH(rmsnorm_backward_run, dinp, dw, dout, inp, w, rstd, N, C, accumulate);
}

/* The column-sum finish for other files' partials (llama.cu's QK-norm
 * weight gradients): out(C) (+)= sum over chunks of part(chunks, C). */
int cuda_colsum_chunks(int N) { return colsum_chunks(N); }
void cuda_colsum_finish(float *out, const float *part, int chunks, int C, int accumulate) {
    KLAUNCH(colsum_finish_kernel, (C + 31) / 32, dim3(32, COLSUM_FIN_LANES), 0, out, NULL, part, NULL, chunks, C,
            accumulate);
    CUDA_CHECK_LAUNCH();
}
