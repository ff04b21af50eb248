/* attention_tc: causal attention (grouped K/V heads too) on bf16 tensor
 * cores, forward and backward, in FlashAttention-2's structure, for bf16
 * activations and head sizes that are multiples of 16 up to 128. Same
 * semantics as attention.cu's SIMT kernels (backend.h), which remain the
 * reference and the fallback: attention.cu chooses between the paths at
 * start-up after comparing them (self-check).
 *
 * Why WMMA (nvcuda::wmma, 16x16x16 bf16 fragments, fp32 accumulators) and not
 * mma.sync PTX: its fragment layouts are opaque, so every tensor-core operand
 * goes through shared memory with an explicit leading dimension, which makes
 * each index checkable by reading and by a host emulation of the API; the
 * cost is shared-memory traffic that hand-placed mma.sync registers avoid.
 *
 * Forward. A block is 8 warps (256 threads) over TC_BQ = 128 query rows of
 * one (b, h); warp w owns rows 16w..16w+15 and holds their Q as register
 * fragments. Key tiles of TC_BK = 64 stream through shared memory double
 * buffered: tile i+1's K and V are in flight (cp.async, the pipeline
 * primitives) while tile i is computed. Per tile a warp computes S = Q K^T
 * (16 x 64, fp32, into its own shared region), then the online softmax with
 * the warp spread over the columns: lane c owns keys c and c + 32 of all 16
 * rows; the rows' maxima come from one all-reduce over the warp
 * (tc_rows_allreduce: 32 shuffles for 16 rows), the row sums l stay per lane
 * and are summed once at the end (as FlashAttention-2 defers them). P =
 * exp2(s - m) is rounded to bf16 in shared memory; P V goes into a fresh
 * fragment, staged in shared memory, and each lane adds its columns into its
 * O, held in registers (O *= alpha first). A warp whose rows see none of a
 * tile (past the diagonal, or before their documents) skips it. End: out =
 * O / l in bf16, lse = m ln 2 + log l (m in log2 units; l sums the fp32 p,
 * not the bf16 P, so lse is the CPU's).
 *
 * Backward: D = rowsum(dO * O) first (fp32, one warp per row), then one
 * kernel over key blocks of TC_BK keys (4 warps, 16 keys each) of one (b, kv
 * head), looping over the query heads of the group and over their 64-query
 * tiles from the diagonal on, Q and dO double buffered like K, V above. Five
 * products per tile, FlashAttention-2's: S^T = K Q^T and dP^T = V dO^T (the
 * warp's 16 keys x 64 queries: computing the transposes directly gives P^T
 * and dS^T in the row layout their products need), dV += P^T dO and dK +=
 * dS^T Q (register fragments, the whole loop), dQ += dS K. Lanes own query
 * columns, so lse and D are per-lane constants of a tile: no shuffles.
 *
 * dQ in a fixed order, without float atomics. FlashAttention-2 adds each key
 * block's dS K into dQ with atomicAdd, in whatever order the blocks run; here
 * the key blocks that see a query tile take turns (FlashAttention-3's
 * deterministic backward does the same): the one on the diagonal first, the
 * block of the tile's first document last. A block waits for its turn on a
 * flag per (b, h, query tile), adds its product to the fp32 partial sum in
 * the dq_acc scratch (the first writes it, the last rounds the total into
 * dqkv in bf16), and passes the turn on. Blocks take their (b, kv head, key
 * block) from a ticket (atomicAdd at start), diagonal-most block first, so
 * the block a block waits for has started and the wait ends; blocks of one
 * head then run as a wavefront one tile apart. The dK/dV sums run over a
 * block's own loop in order. Every sum has one order: same inputs, same bits.
 *
 * Layouts. qkv (N, (NH + 2 NKV) hs) bf16 = [q (NH heads) | k (NKV) | v
 * (NKV)]: query head h reads kv head h / (NH / NKV); out, dout (N, NH hs)
 * bf16; dqkv like qkv; lse, D (B,NH,T) fp32; dq_acc (B,NH,ceil(T/64)*64,hs)
 * fp32. Shared tiles are row-major, bf16 rows of hs + 8 elements and fp32
 * rows of width + 4 (WMMA wants ldm a multiple of 8 for bf16 and of 4 for
 * fp32, and a 256-bit aligned pointer: every fragment starts at a row
 * multiple of 16 and a column multiple of 16, and every region at a multiple
 * of 128 bytes; the padding shifts successive rows by 4 banks). Rows past T
 * load as zero and are never written. Global loads are 16-byte vectors (8
 * bf16): hs and the row widths are multiples of 16, and attention.cu's
 * dispatch checks qkv's and dout's alignment (every kiln buffer is 64-byte
 * aligned).
 *
 * Documents (backend.h's AttnShape.doc, data.doc_masking): doc (B, T), the
 * first position of each row's document, or NULL. A query sees keys from
 * its document's start on as well; doc is nondecreasing along a sequence, so
 * the forward starts at the key tile of the block's first row's document and
 * a warp skips tiles before its first row's, and a key block stops at the
 * first query tile whose first query's document starts after its keys. A
 * row may then see none of a tile: its softmax update leaves it as it was
 * (no exp2(-inf - -inf)). */
#ifndef KILN_CUDA_EMU /* test/attention_tc_emu.cc runs the kernels on the CPU with test/cuda_emu.h's stand-ins */
#include <cuda_pipeline.h>
#include <mma.h>
#endif

#include "common.cuh"

using namespace nvcuda;

#define TC_BQ 128          /* forward: query rows of a block, 8 warps x 16 */
#define TC_BK 64           /* keys of a tile; backward: keys of a block, queries of a tile */
#define TC_FWD_THREADS 256 /* 8 warps */
#define TC_BWD_THREADS 128 /* 4 warps */
#define TC_LDS (TC_BK + 4) /* fp32 score tiles (64 columns): row stride */
#define TC_LDP (TC_BK + 8) /* bf16 probability tiles (64 columns): row stride */
#define TC_LOG2E 1.4426950408889634f
#define TC_LN2 0.6931471805599453f

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> FragA;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::col_major> FragAt; /* A = X^T of row-major X */
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> FragB;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> FragBt; /* B = X^T of row-major X */
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FragC;

/* The shape as the kernels read it (from backend.h's AttnShape). */
struct TcDims {
    int T, NH, NKV, hs;
    size_t ld;          /* qkv and dqkv row: (NH + 2 NKV) hs */
    size_t ldo;         /* out and dout row: NH hs */
    const int32_t *doc; /* (B, T) first position of each row's document, or NULL */
};

/* Column of query head h's k in a qkv row (its v: + NKV hs). */
__host__ __device__ inline size_t tc_kcol(const TcDims &a, int h) {
    return (size_t)a.NH * a.hs + (size_t)(h / (a.NH / a.NKV)) * a.hs;
}

/* Shared-memory plan of each kernel: byte offsets of its regions, each a
 * multiple of 128 bytes. `tile` is one (64, hs + 8) bf16 tile.
 *  forward:  K[2], V[2] tiles; per warp (8) a region for its Q rows (bf16),
 *            then its scores S (fp32) / P (bf16) / the P V staging (fp32),
 *            and its rows' first keys.
 *  backward: K, V; Q[2], dO[2]; dS^T (64 keys x 64 queries, bf16, shared by
 *            the warps: dQ reads every warp's rows); per warp (4) S^T and
 *            dP^T (fp32; at the end the staging of dK, dV and of a last
 *            dQ), P^T (bf16); the ticket. */
struct TcSmem {
    size_t k, v, q, d, dst, warp, warp_bytes, ticket, total, tile;
};
__host__ __device__ inline size_t tc_align(size_t bytes) { return (bytes + 127) & ~(size_t)127; }
__host__ __device__ inline size_t tc_max(size_t a, size_t b) { return a > b ? a : b; }
__host__ __device__ inline TcSmem tc_smem(int hs, int backward) {
    TcSmem L;
    L.tile = tc_align((size_t)TC_BK * (hs + 8) * sizeof(bf16));
    size_t scores = (size_t)16 * TC_LDS * sizeof(float), staging = (size_t)16 * (hs + 4) * sizeof(float);
    L.k = 0;
    if (!backward) {
        L.v = 2 * L.tile, L.q = L.d = L.dst = L.ticket = 0; /* no Q, dO, dS^T tiles, no ticket */
        L.warp = 4 * L.tile;
        /* + 16 int32 behind: the first key each row sees (documents) */
        L.warp_bytes = tc_align(tc_max(tc_max(scores, staging), (size_t)16 * (hs + 8) * sizeof(bf16)) + 16 * sizeof(int));
        L.total = L.warp + (TC_FWD_THREADS / 32) * L.warp_bytes;
    } else {
        L.v = L.tile, L.q = 2 * L.tile, L.d = 4 * L.tile, L.dst = 6 * L.tile;
        L.warp = L.dst + tc_align((size_t)TC_BK * TC_LDP * sizeof(bf16));
        /* S^T, dP^T, P^T; a staging (16, hs + 4) fp32 fits in S^T and dP^T (hs <= 128) */
        L.warp_bytes = tc_align(2 * scores + (size_t)16 * TC_LDP * sizeof(bf16));
        L.ticket = L.warp + (TC_BWD_THREADS / 32) * L.warp_bytes;
        L.total = L.ticket + 128;
    }
    return L;
}

/* Rows [r0, r0 + 64) of one head (ld apart) into a shared (64, hs) tile of
 * row stride ldd by 16-byte asynchronous copies, which land at the caller's
 * __pipeline_wait_prior for the batch they are committed with; rows past n
 * are zeroed with plain stores. */
__device__ __forceinline__ void tc_issue_tile(bf16 *dst, int ldd, const bf16 *src, size_t ld, int r0, int n, int hs) {
    int cpr = hs / 8; /* 16-byte chunks per row */
    for (int e = threadIdx.x; e < TC_BK * cpr; e += blockDim.x) {
        int r = e / cpr, c = (e % cpr) * 8;
        if (r0 + r < n) __pipeline_memcpy_async(dst + r * ldd + c, src + (size_t)(r0 + r) * ld + c, 16);
        else *reinterpret_cast<uint4 *>(dst + r * ldd + c) = make_uint4(0u, 0u, 0u, 0u);
    }
}

/* A warp's 16 rows of an fp32 (16, hs + 4) staging tile to rows t0.. of dst
 * (stride ld), rounded to bf16; rows at or past T are not written. */
__device__ __forceinline__ void tc_store_rows(bf16 *dst, size_t ld, const float *stage, int t0, int T, int hs) {
    int lane = threadIdx.x % 32;
    for (int e = lane; e < 16 * hs; e += 32) {
        int rr = e / hs, d = e % hs, t = t0 + rr;
        if (t < T) dst[(size_t)t * ld + d] = __float2bfloat16_rn(stage[rr * (hs + 4) + d]);
    }
}

struct TcMax {
    __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct TcSum {
    __device__ float operator()(float a, float b) const { return a + b; }
};

/* v[r]: this lane's part of row r, for a warp's 16 rows; on return every
 * lane holds op over the 32 lanes, for every row. Halving exchanges (lane
 * bit 4 keeps rows 8..15 and sends 0..7, bit 3 then half of those, ...: 8 +
 * 4 + 2 + 1 shuffles) leave lanes 2r and 2r + 1 with row r over 16 lanes, one
 * more pairs them, 16 broadcasts spread the rows: 32 shuffles for what 16
 * butterflies do in 80. The order is fixed and op commutative, so every lane
 * gets the same bits, run after run. */
/* One halving step of tc_rows_allreduce: N values held, the partner lane ^ N. */
template <int N, typename Op>
__device__ __forceinline__ void tc_rows_halve(float v[16], Op op) {
    int hi = (threadIdx.x & N) != 0;
#pragma unroll
    for (int i = 0; i < N / 2; i++) {
        float send = hi ? v[i] : v[i + N / 2], keep = hi ? v[i + N / 2] : v[i];
        v[i] = op(keep, __shfl_xor_sync(0xffffffffu, send, N));
    }
}
template <typename Op>
__device__ __forceinline__ void tc_rows_allreduce(float v[16], Op op) {
    tc_rows_halve<16>(v, op);
    tc_rows_halve<8>(v, op);
    tc_rows_halve<4>(v, op);
    tc_rows_halve<2>(v, op);
    float row = op(v[0], __shfl_xor_sync(0xffffffffu, v[0], 1)); /* row (lane >> 1), complete */
#pragma unroll
    for (int r = 0; r < 16; r++) v[r] = __shfl_sync(0xffffffffu, row, 2 * r);
}

/* dst (16 x 64, row stride TC_LDS, fp32) = the 16 rows of A times the 64
 * rows of Bm transposed (A, Bm: bf16 tiles with row stride ldh; nd 16-wide
 * slices of the head dim): S^T = K Q^T and dP^T = V dO^T. */
__device__ __forceinline__ void tc_warp_abt(float *dst, const bf16 *A, const bf16 *Bm, int ldh, int nd) {
    FragC acc[4];
#pragma unroll
    for (int j = 0; j < 4; j++) wmma::fill_fragment(acc[j], 0.0f);
    for (int dk = 0; dk < nd; dk++) {
        FragA a;
        wmma::load_matrix_sync(a, A + dk * 16, ldh);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            FragBt bt;
            wmma::load_matrix_sync(bt, Bm + j * 16 * ldh + dk * 16, ldh);
            wmma::mma_sync(acc[j], a, bt, acc[j]);
        }
    }
#pragma unroll
    for (int j = 0; j < 4; j++) wmma::store_matrix_sync(dst + j * 16, acc[j], TC_LDS, wmma::mem_row_major);
}

/* ---------------------------------------------------------------------------
 * Forward. Grid (B*NH, ceil(T/128)); block y runs query blocks from the last
 * (the longest: most key tiles) down, so the short ones fill the tail. MAXD =
 * the most 16-wide column blocks of hs (4: hs <= 64, 8: hs <= 128), so a lane
 * holds MAXD / 2 columns of O per row (c, c + 32, ...). */

/* One key tile for one warp: the online-softmax update of its 16 rows (m, l
 * per row, O in registers), from K, V in shared memory and its Q fragments.
 * W: the warp's region; fst: its rows' first visible keys (documents), in
 * shared memory (held in registers they were put on the stack). */
template <int MAXD>
__device__ __forceinline__ void tc_forward_tile(float m[16], float l[16], float o[16][MAXD / 2], float *W,
                                                const FragA *qa, const bf16 *Ks, const bf16 *Vs, const int *fst,
                                                int k0, int r0, int hs, float sl2) {
    int lane = threadIdx.x % 32, nd = hs / 16, ldh = hs + 8;
    { /* S = Q K^T: 16 rows x 64 keys */
        FragC acc[4];
#pragma unroll
        for (int j = 0; j < 4; j++) wmma::fill_fragment(acc[j], 0.0f);
#pragma unroll
        for (int dk = 0; dk < MAXD; dk++) {
            if (dk >= nd) break;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                FragBt kb;
                wmma::load_matrix_sync(kb, Ks + j * 16 * ldh + dk * 16, ldh);
                wmma::mma_sync(acc[j], qa[dk], kb, acc[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; j++) wmma::store_matrix_sync(W + j * 16, acc[j], TC_LDS, wmma::mem_row_major);
    }
    __syncwarp();
    /* Scores in log2 units (sl2 = log2(e) / sqrt(hs)), masked to -inf: key
     * k0 + j is seen by row r0 + r iff fst[r] <= k0 + j <= r0 + r. */
    float s[16][2], mt[16];
#pragma unroll
    for (int r = 0; r < 16; r++) {
#pragma unroll
        for (int c = 0; c < 2; c++) {
            int j = lane + 32 * c, key = k0 + j;
            s[r][c] = key <= r0 + r && key >= fst[r] ? W[r * TC_LDS + j] * sl2 : -INFINITY;
        }
        mt[r] = fmaxf(s[r][0], s[r][1]);
    }
    tc_rows_allreduce(mt, TcMax());
    __syncwarp(); /* every lane has read S: P takes its place */
    bf16 *P = (bf16 *)W;
    /* Without documents every row sees key k0 <= its own position in the
     * first tile, so m is finite from then on; with them a row may have seen
     * no key yet (mn -inf): p = 0 and alpha = 1 on its zero O and l. A masked
     * key gives p = exp2(-inf) = 0 exactly. */
#pragma unroll
    for (int r = 0; r < 16; r++) {
        float mn = fmaxf(m[r], mt[r]), alpha = mn == -INFINITY ? 1.0f : exp2f(m[r] - mn);
        float p0 = mn == -INFINITY ? 0.0f : exp2f(s[r][0] - mn), p1 = mn == -INFINITY ? 0.0f : exp2f(s[r][1] - mn);
        l[r] = l[r] * alpha + (p0 + p1);
        m[r] = mn;
#pragma unroll
        for (int c = 0; c < MAXD / 2; c++) o[r][c] *= alpha;
        P[r * TC_LDP + lane] = __float2bfloat16_rn(p0);
        P[r * TC_LDP + lane + 32] = __float2bfloat16_rn(p1);
    }
    __syncwarp();
    FragA pa[4];
#pragma unroll
    for (int kk = 0; kk < 4; kk++) wmma::load_matrix_sync(pa[kk], P + kk * 16, TC_LDP);
    __syncwarp(); /* P is in every lane's fragments: W takes the P V staging */
    const int ldo = hs + 4;
#pragma unroll
    for (int dt = 0; dt < MAXD; dt++) { /* P V: 16 rows x hs, into a fresh fragment */
        if (dt >= nd) break;
        FragC pv;
        wmma::fill_fragment(pv, 0.0f);
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            FragB vb;
            wmma::load_matrix_sync(vb, Vs + kk * 16 * ldh + dt * 16, ldh);
            wmma::mma_sync(pv, pa[kk], vb, pv);
        }
        wmma::store_matrix_sync(W + dt * 16, pv, ldo, wmma::mem_row_major);
    }
    __syncwarp();
#pragma unroll
    for (int r = 0; r < 16; r++)
#pragma unroll
        for (int c = 0; c < MAXD / 2; c++)
            if (lane + 32 * c < hs) o[r][c] += W[r * ldo + lane + 32 * c];
    /* the caller's __syncthreads follows before the next tile's scores overwrite W */
}

template <int MAXD>
__global__ void __launch_bounds__(TC_FWD_THREADS) tc_forward_kernel(bf16 *out, float *lse, const bf16 *qkv, TcDims a, float sl2) {
    KILN_DYN_SHARED(__align__(128) unsigned char, tc_smem_buf);
    const int T = a.T, hs = a.hs, nd = hs / 16, bh = blockIdx.x, b = bh / a.NH, h = bh % a.NH;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * TC_BQ;
    const TcSmem L = tc_smem(hs, 0);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = q0 + warp * 16, ldh = hs + 8;
    float *W = (float *)(tc_smem_buf + L.warp + warp * L.warp_bytes);
    const bf16 *Q = qkv + (size_t)b * T * a.ld + (size_t)h * hs, *K = qkv + (size_t)b * T * a.ld + tc_kcol(a, h);
    const bf16 *V = K + (size_t)a.NKV * hs;
    const int32_t *Dc = a.doc ? a.doc + (size_t)b * T : NULL;
    const int kend = min(T, q0 + TC_BQ), kbeg = Dc ? Dc[q0] / TC_BK * TC_BK : 0; /* key tiles [kbeg, kend) */

    /* the first K, V tile is in flight while the warps take their Q rows */
    tc_issue_tile((bf16 *)(tc_smem_buf + L.k), ldh, K, a.ld, kbeg, T, hs);
    tc_issue_tile((bf16 *)(tc_smem_buf + L.v), ldh, V, a.ld, kbeg, T, hs);
    __pipeline_commit();
    bf16 *Qw = (bf16 *)W;
    for (int e = lane; e < 16 * (hs / 8); e += 32) {
        int r = e / (hs / 8), c = (e % (hs / 8)) * 8;
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (r0 + r < T) x = *reinterpret_cast<const uint4 *>(Q + (size_t)(r0 + r) * a.ld + c);
        *reinterpret_cast<uint4 *>(Qw + r * ldh + c) = x;
    }
    __syncwarp();
    FragA qa[MAXD];
#pragma unroll
    for (int dk = 0; dk < MAXD; dk++)
        if (dk < nd) wmma::load_matrix_sync(qa[dk], Qw + dk * 16, ldh);
    __syncwarp(); /* the fragments are loaded before W is reused */
    int *fst = (int *)((unsigned char *)W + L.warp_bytes) - 16;
    if (lane < 16) fst[lane] = Dc && r0 + lane < T ? Dc[r0 + lane] : 0;
    __syncwarp();
    float m[16], l[16], o[16][MAXD / 2];
#pragma unroll
    for (int r = 0; r < 16; r++) {
        m[r] = -INFINITY, l[r] = 0.0f;
#pragma unroll
        for (int c = 0; c < MAXD / 2; c++) o[r][c] = 0.0f;
    }
    /* The warp's rows see keys [fst[0], r0 + 15] at most: it skips the
     * tiles outside (the same for all its lanes), and has nothing at all
     * when its rows start at or past T. */
    for (int k0 = kbeg, it = 0; k0 < kend; k0 += TC_BK, it++) {
        int buf = it & 1;
        if (k0 + TC_BK < kend) { /* the next tile into the other buffer, freed by the last barrier */
            tc_issue_tile((bf16 *)(tc_smem_buf + L.k + (buf ^ 1) * L.tile), ldh, K, a.ld, k0 + TC_BK, T, hs);
            tc_issue_tile((bf16 *)(tc_smem_buf + L.v + (buf ^ 1) * L.tile), ldh, V, a.ld, k0 + TC_BK, T, hs);
            __pipeline_commit();
            __pipeline_wait_prior(1);
        } else {
            __pipeline_wait_prior(0);
        }
        __syncthreads(); /* this tile's copies, every thread's, have landed */
        if (r0 < T && k0 <= r0 + 15 && k0 + TC_BK > fst[0])
            tc_forward_tile<MAXD>(m, l, o, W, qa, (const bf16 *)(tc_smem_buf + L.k + buf * L.tile),
                                  (const bf16 *)(tc_smem_buf + L.v + buf * L.tile), fst, k0, r0, hs, sl2);
        __syncthreads(); /* every warp is done with this buffer before it is refilled */
    }
    if (r0 >= T) return; /* whole warps: no barrier follows */
    tc_rows_allreduce(l, TcSum()); /* l >= 1 for rows < T: a row's own key gives exp2(0) at its maximum */
#pragma unroll
    for (int r = 0; r < 16; r++) {
        int t = r0 + r;
        if (t >= T) break;
        bf16 *O = out + ((size_t)b * T + t) * a.ldo + (size_t)h * hs;
#pragma unroll
        for (int c = 0; c < MAXD / 2; c++)
            if (lane + 32 * c < hs) O[lane + 32 * c] = __float2bfloat16_rn(o[r][c] / l[r]);
        if (lane == r) lse[(size_t)bh * T + t] = m[r] * TC_LN2 + logf(l[r]); /* lse = log sum exp(s scale) */
    }
}

/* ---------------------------------------------------------------------------
 * Backward, part 1: D = rowsum(dO * O) (B,NH,T) fp32, one warp per (b, h, t). */
__global__ void tc_backward_d_kernel(float *Dbuf, const bf16 *dout, const bf16 *out, int B, int T, int NH, int hs) {
    int lane = threadIdx.x % 32;
    size_t w = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; /* (b*NH + h)*T + t */
    if (w >= (size_t)B * NH * T) return;                                 /* whole warps leave */
    int t = (int)(w % T), bh = (int)(w / T), b = bh / NH, h = bh % NH;
    size_t base = ((size_t)b * T + t) * NH * hs + (size_t)h * hs;
    float s = 0.0f;
    for (int d = lane; d < hs; d += 32) s += __bfloat162float(dout[base + d]) * __bfloat162float(out[base + d]);
    s = warp_sum(s);
    if (lane == 0) Dbuf[w] = s;
}

/* Backward, part 2: one key block's tile for one warp: S^T, dP^T of its 16
 * keys x the 64 queries, P^T into its region and dS^T into the shared dSt
 * rows, then dV += P^T dO, dK += dS^T Q. key0: the warp's first key. */
template <int MAXD>
__device__ __forceinline__ void tc_backward_tile(FragC *dk, FragC *dv, float *St, float *dPt, bf16 *Pt, bf16 *dSw,
                                                 const bf16 *Kw, const bf16 *Vw, const bf16 *Qs, const bf16 *dOs,
                                                 const float *Lg, const float *Dg, const int32_t *Dc, int key0,
                                                 int i0, int T, int hs, float scale, float sl2) {
    int lane = threadIdx.x % 32, nd = hs / 16, ldh = hs + 8;
    tc_warp_abt(St, Kw, Qs, ldh, nd);   /* S^T = K Q^T */
    tc_warp_abt(dPt, Vw, dOs, ldh, nd); /* dP^T = V dO^T */
    __syncwarp();
    /* lane's queries i0 + lane + 32c: lse (in log2 units), D, first key */
    float l2[2], Dq[2];
    int qi[2], fq[2];
#pragma unroll
    for (int c = 0; c < 2; c++) {
        qi[c] = i0 + lane + 32 * c;
        int ok = qi[c] < T;
        l2[c] = ok ? Lg[qi[c]] * TC_LOG2E : 0.0f, Dq[c] = ok ? Dg[qi[c]] : 0.0f;
        fq[c] = ok ? (Dc ? Dc[qi[c]] : 0) : T; /* past T: no key is seen */
    }
    /* query qi sees key iff fq <= key <= qi (fq = T past the end) */
#pragma unroll
    for (int r = 0; r < 16; r++) {
        int key = key0 + r;
#pragma unroll
        for (int c = 0; c < 2; c++) {
            int j = lane + 32 * c;
            float p = qi[c] >= key && key >= fq[c] ? exp2f(St[r * TC_LDS + j] * sl2 - l2[c]) : 0.0f;
            Pt[r * TC_LDP + j] = __float2bfloat16_rn(p);
            dSw[r * TC_LDP + j] = __float2bfloat16_rn(p * (dPt[r * TC_LDS + j] - Dq[c]) * scale);
        }
    }
    __syncwarp();
    FragA pa[4], sa[4];
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        wmma::load_matrix_sync(pa[kk], Pt + kk * 16, TC_LDP);
        wmma::load_matrix_sync(sa[kk], dSw + kk * 16, TC_LDP);
    }
#pragma unroll
    for (int dt = 0; dt < MAXD; dt++) {
        if (dt >= nd) break;
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            FragB x;
            wmma::load_matrix_sync(x, dOs + kk * 16 * ldh + dt * 16, ldh);
            wmma::mma_sync(dv[dt], pa[kk], x, dv[dt]);
            wmma::load_matrix_sync(x, Qs + kk * 16 * ldh + dt * 16, ldh);
            wmma::mma_sync(dk[dt], sa[kk], x, dk[dt]);
        }
    }
}

/* One warp's 16 queries (q0w..) of a tile: dQ (+)= dS K over the block's
 * 64 keys, dS read as the transpose of the shared dS^T. The first in a
 * tile's order starts from zero, the others from the fp32 partial acc (ld
 * hs); the last rounds the total into dqkv's rows (stride ld) through the
 * warp's staging W, the others store the partial back. */
template <int MAXD>
__device__ __forceinline__ void tc_backward_dq(float *acc, bf16 *dq, size_t ld, float *W, const bf16 *dSt,
                                               const bf16 *Ks, int qw, int q0w, int T, int hs, int first, int last) {
    int nd = hs / 16, ldh = hs + 8;
    FragAt sa[4];
#pragma unroll
    for (int kk = 0; kk < 4; kk++) wmma::load_matrix_sync(sa[kk], dSt + kk * 16 * TC_LDP + qw, TC_LDP);
#pragma unroll
    for (int dt = 0; dt < MAXD; dt++) {
        if (dt >= nd) break;
        FragC x;
        if (first) wmma::fill_fragment(x, 0.0f);
        else wmma::load_matrix_sync(x, acc + dt * 16, hs, wmma::mem_row_major);
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            FragB kb;
            wmma::load_matrix_sync(kb, Ks + kk * 16 * ldh + dt * 16, ldh);
            wmma::mma_sync(x, sa[kk], kb, x);
        }
        if (last) wmma::store_matrix_sync(W + dt * 16, x, hs + 4, wmma::mem_row_major);
        else wmma::store_matrix_sync(acc + dt * 16, x, hs, wmma::mem_row_major);
    }
    if (last) {
        __syncwarp();
        tc_store_rows(dq, ld, W, q0w, T, hs);
    }
}

/* Backward, part 3: dK, dV of one key block and its turns at dQ. Grid
 * B*NKV*ceil(T/64) blocks, 1-D: each takes its (b, kv head, key block) from
 * the ticket sync[0], diagonal-most key block of a (b, kv head) first; turn
 * of (b, h, query tile q) in sync[1 + (b NH + h) nq + q]: how many blocks
 * have added to its dQ (key block j's turn is q - j). sync starts zeroed. */
template <int MAXD>
__global__ void __launch_bounds__(TC_BWD_THREADS)
    tc_backward_kernel(bf16 *dqkv, float *dq_acc, int *sync, const float *Dbuf, const bf16 *dout, const bf16 *qkv,
                       const float *lse, TcDims a, float scale, float sl2) {
    KILN_DYN_SHARED(__align__(128) unsigned char, tc_smem_buf);
    const int T = a.T, hs = a.hs, nd = hs / 16, ldh = hs + 8, nq = (T + TC_BK - 1) / TC_BK, G = a.NH / a.NKV;
    const TcSmem L = tc_smem(hs, 1);
    int *ticket = (int *)(tc_smem_buf + L.ticket);
    if (threadIdx.x == 0) *ticket = atomicAdd(&sync[0], 1);
    __syncthreads();
    const int tk = *ticket, bg = tk / nq, j = nq - 1 - tk % nq, b = bg / a.NKV, g = bg % a.NKV, k0 = j * TC_BK;
    const int warp = threadIdx.x / 32, wr = warp * 16;
    bf16 *Ks = (bf16 *)(tc_smem_buf + L.k), *Vs = (bf16 *)(tc_smem_buf + L.v), *dSt = (bf16 *)(tc_smem_buf + L.dst);
    float *St = (float *)(tc_smem_buf + L.warp + warp * L.warp_bytes), *dPt = St + 16 * TC_LDS;
    bf16 *Pt = (bf16 *)(dPt + 16 * TC_LDS);
    const bf16 *X = qkv + (size_t)b * T * a.ld, *dO0 = dout + (size_t)b * T * a.ldo;
    const bf16 *K = X + (size_t)a.NH * hs + (size_t)g * hs, *V = K + (size_t)a.NKV * hs;
    const int32_t *Dc = a.doc ? a.doc + (size_t)b * T : NULL;
    /* Query tiles q = j, j + 1, ... of every head of the group: the first
     * whose first query's document starts after these keys ends them
     * (documents only start later further on); the same count per head. */
    int nt = 0;
    while (j + nt < nq && !(Dc && Dc[(j + nt) * TC_BK] >= k0 + TC_BK)) nt++;
    const int total = G * nt;

    tc_issue_tile(Ks, ldh, K, a.ld, k0, T, hs);
    tc_issue_tile(Vs, ldh, V, a.ld, k0, T, hs);
    tc_issue_tile((bf16 *)(tc_smem_buf + L.q), ldh, X + (size_t)g * G * hs, a.ld, k0, T, hs);
    tc_issue_tile((bf16 *)(tc_smem_buf + L.d), ldh, dO0 + (size_t)g * G * hs, a.ldo, k0, T, hs);
    __pipeline_commit();
    FragC dk[MAXD], dv[MAXD];
#pragma unroll
    for (int t = 0; t < MAXD; t++) wmma::fill_fragment(dk[t], 0.0f), wmma::fill_fragment(dv[t], 0.0f);
    for (int it = 0; it < total; it++) {
        const int h = g * G + it / nt, q = j + it % nt, i0 = q * TC_BK, buf = it & 1;
        if (it + 1 < total) { /* the next tile into the other buffers, freed by the last barrier */
            int hn = g * G + (it + 1) / nt, in = (j + (it + 1) % nt) * TC_BK;
            tc_issue_tile((bf16 *)(tc_smem_buf + L.q + (buf ^ 1) * L.tile), ldh, X + (size_t)hn * hs, a.ld, in, T, hs);
            tc_issue_tile((bf16 *)(tc_smem_buf + L.d + (buf ^ 1) * L.tile), ldh, dO0 + (size_t)hn * hs, a.ldo, in, T,
                          hs);
            __pipeline_commit();
            __pipeline_wait_prior(1);
        } else {
            __pipeline_wait_prior(0);
        }
        __syncthreads(); /* this tile's copies (and K, V the first time), every thread's, have landed */
        const bf16 *Qs = (const bf16 *)(tc_smem_buf + L.q + buf * L.tile);
        const float *Lg = lse + ((size_t)b * a.NH + h) * T, *Dg = Dbuf + ((size_t)b * a.NH + h) * T;
        tc_backward_tile<MAXD>(dk, dv, St, dPt, Pt, dSt + wr * TC_LDP, Ks + wr * ldh, Vs + wr * ldh, Qs,
                               (const bf16 *)(tc_smem_buf + L.d + buf * L.tile), Lg, Dg, Dc, k0 + wr, i0, T, hs,
                               scale, sl2);
        /* dQ: the key blocks that see tile q add in the order q, q - 1, ...
         * down to the block of its first query's document */
        const int first = q == j, last = j == (Dc ? Dc[i0] / TC_BK : 0);
        int *turn = sync + 1 + ((size_t)b * a.NH + h) * nq + q;
        if (!first && threadIdx.x == 0) kiln_flag_wait(turn, q - j);
        __syncthreads(); /* every warp's dS^T rows are in; so is the partial dQ of the block before */
        float *acc = dq_acc + (((size_t)b * a.NH + h) * nq * TC_BK + (size_t)i0 + wr) * hs;
        tc_backward_dq<MAXD>(acc, dqkv + (size_t)b * T * a.ld + (size_t)h * hs, a.ld, St, dSt, Ks, wr, i0 + wr, T, hs,
                             first, last);
        __syncthreads(); /* every warp's partial is stored, and done with the buffers before they are refilled */
        if (!last && threadIdx.x == 0) kiln_flag_release(turn, q - j + 1);
    }
    /* dV, then dK, through the warp's staging (S^T, dP^T) into dqkv's rows */
    bf16 *dK = dqkv + (size_t)b * T * a.ld + (size_t)a.NH * hs + (size_t)g * hs, *dV = dK + (size_t)a.NKV * hs;
#pragma unroll
    for (int dt = 0; dt < MAXD; dt++)
        if (dt < nd) wmma::store_matrix_sync(St + dt * 16, dv[dt], hs + 4, wmma::mem_row_major);
    __syncwarp();
    tc_store_rows(dV, a.ld, St, k0 + wr, T, hs);
    __syncwarp(); /* the staging is read before dK overwrites it */
#pragma unroll
    for (int dt = 0; dt < MAXD; dt++)
        if (dt < nd) wmma::store_matrix_sync(St + dt * 16, dk[dt], hs + 4, wmma::mem_row_major);
    __syncwarp();
    tc_store_rows(dK, a.ld, St, k0 + wr, T, hs);
}

/* The scratch of one backward call, carved from one buffer: D (B,NH,T) fp32,
 * sync (1 + B NH ceil(T/64)) int32, dq_acc (B,NH,ceil(T/64)*64,hs) fp32,
 * each region 256-byte aligned. */
struct TcScratch {
    size_t d, sync, acc, total, sync_bytes;
};
static inline TcScratch tc_scratch_plan(int B, int T, int NH, int hs) {
    size_t nq = (size_t)(T + TC_BK - 1) / TC_BK, bh = (size_t)B * NH;
    TcScratch S;
    S.d = 0;
    S.sync = (bh * T * sizeof(float) + 255) & ~(size_t)255;
    S.sync_bytes = (1 + bh * nq) * sizeof(int);
    S.acc = (S.sync + S.sync_bytes + 255) & ~(size_t)255;
    S.total = S.acc + bh * nq * TC_BK * hs * sizeof(float);
    return S;
}

static inline TcDims tc_dims(const AttnShape *s) {
    TcDims a;
    a.T = s->T, a.NH = s->NH, a.NKV = s->NKV, a.hs = s->HD;
    a.ld = (size_t)attn_qkv_width(s), a.ldo = (size_t)s->NH * s->HD, a.doc = s->doc;
    return a;
}

/* ---------------------------------------------------------------------------
 * Host entry points (test/attention_tc_emu.cc defines KILN_TC_KERNELS_ONLY:
 * it launches the kernels itself) */
#ifndef KILN_TC_KERNELS_ONLY

/* Largest dynamic shared memory a block may opt into on device 0 (bytes). */
static int tc_smem_optin(void) {
    static int optin = -1;
    if (optin < 0) {
        int dev = 0;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    }
    return optin;
}

int cuda_attention_tc_fits(int hs) {
    if (hs < 16 || hs > 128 || hs % 16 != 0) return 0;
    return tc_max(tc_smem(hs, 1).total, tc_smem(hs, 0).total) <= (size_t)tc_smem_optin();
}

/* Shared memory over 48 KiB needs an opt-in per kernel: raised once to the
 * largest size requested so far. */
template <typename F>
static void tc_allow_smem(F kernel, size_t bytes, size_t *allowed) {
    if (bytes <= *allowed) return;
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    *allowed = bytes;
}

template <int MAXD>
static void tc_forward_run(bf16 *out, float *lse, const bf16 *qkv, const AttnShape *s) {
    static size_t allowed;
    size_t sh = tc_smem(s->HD, 0).total;
    tc_allow_smem(tc_forward_kernel<MAXD>, sh, &allowed);
    float sl2 = TC_LOG2E / sqrtf((float)s->HD);
    dim3 grid(s->B * s->NH, (s->T + TC_BQ - 1) / TC_BQ);
    KLAUNCH(tc_forward_kernel<MAXD>, grid, TC_FWD_THREADS, sh, out, lse, qkv, tc_dims(s), sl2);
    CUDA_CHECK_LAUNCH();
}

void cuda_attention_tc_forward(void *out, float *lse, const void *qkv, const AttnShape *s) {
    if (s->HD <= 64) tc_forward_run<4>((bf16 *)out, lse, (const bf16 *)qkv, s);
    else tc_forward_run<8>((bf16 *)out, lse, (const bf16 *)qkv, s);
}

template <int MAXD>
static void tc_backward_run(bf16 *dqkv, unsigned char *scratch, const TcScratch &S, const bf16 *dout,
                            const bf16 *qkv, const float *lse, const AttnShape *s) {
    static size_t allowed;
    size_t sh = tc_smem(s->HD, 1).total;
    tc_allow_smem(tc_backward_kernel<MAXD>, sh, &allowed);
    float scale = 1.0f / sqrtf((float)s->HD), sl2 = TC_LOG2E * scale;
    unsigned blocks = (unsigned)(s->B * s->NKV * ((s->T + TC_BK - 1) / TC_BK));
    KLAUNCH(tc_backward_kernel<MAXD>, blocks, TC_BWD_THREADS, sh, dqkv, (float *)(scratch + S.acc),
            (int *)(scratch + S.sync), (const float *)(scratch + S.d), dout, qkv, lse, tc_dims(s), scale, sl2);
    CUDA_CHECK_LAUNCH();
}

void cuda_attention_tc_backward(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                                const AttnShape *s) {
    TcScratch S = tc_scratch_plan(s->B, s->T, s->NH, s->HD);
    unsigned char *scratch = (unsigned char *)cuda_scratch(SCRATCH_ATTENTION, S.total);
    size_t rows = (size_t)s->B * s->NH * s->T;
    KLAUNCH(tc_backward_d_kernel, cuda_blocks(rows * CUDA_WARP, 256), 256, 0, (float *)(scratch + S.d),
            (const bf16 *)dout, (const bf16 *)out, s->B, s->T, s->NH, s->HD);
    CUDA_CHECK_LAUNCH();
    CUDA_CHECK(cudaMemsetAsync(scratch + S.sync, 0, S.sync_bytes, cudaStreamLegacy)); /* the ticket and the turns */
    if (s->HD <= 64) tc_backward_run<4>((bf16 *)dqkv, scratch, S, (const bf16 *)dout, (const bf16 *)qkv, lse, s);
    else tc_backward_run<8>((bf16 *)dqkv, scratch, S, (const bf16 *)dout, (const bf16 *)qkv, lse, s);
}
#endif /* KILN_TC_KERNELS_ONLY */
