/* attention_tc: causal multi-head attention on bf16 tensor cores, forward and
 * backward, FlashAttention-2 style, for bf16 activations and head sizes that
 * are multiples of 16 up to 128. Same semantics as attention.cu's SIMT kernels
 * (backend.h), which remain the reference and the fallback: attention.cu
 * chooses between the two at start-up after comparing them (self-check).
 *
 * Why WMMA (nvcuda::wmma, 16x16x16 bf16 fragments, fp32 accumulators) and not
 * mma.sync PTX: its fragment layouts are opaque, so every tensor-core operand
 * goes through shared memory with an explicit leading dimension, which makes
 * each index checkable by reading and by a host emulation of the API; the
 * cost is shared-memory traffic that hand-placed mma.sync registers avoid.
 *
 * Tiling. A block is 4 warps (128 threads) over TC_B = 64 rows of one (b, h):
 * warp w owns rows 16w..16w+15 of the block for everything that is per row.
 *  - forward: 64 queries; loops over 64-key tiles up to the diagonal one. Per
 *    tile: K, V to shared; S = Q K^T (warp: 16 x 64, fp32, to shared); the
 *    warp's lanes run the online softmax on its rows (a pair of lanes per
 *    row, even/odd columns): scale, causal mask, running max m and sum l,
 *    P = exp(s - m) rounded to bf16 in shared, alpha = exp(m_old - m_new)
 *    applied to the row of O; then O += P V with O in shared fp32 (a
 *    fragment's layout is opaque, so the per-row rescale is done on the
 *    shared copy, which is loaded as the accumulator and stored back). End:
 *    out = O / l in bf16, lse = m + log l. l sums the fp32 p (not the bf16
 *    P), so lse is the log-sum-exp of the fp32 scaled scores as on the CPU.
 *  - backward, 3 kernels: D = rowsum(dO * O) (fp32, one warp per row); dK/dV
 *    over 64-key blocks looping over 64-query tiles from the diagonal on
 *    (warp: its 16 keys x 64 queries: S^T = K Q^T, dP^T = V dO^T,
 *    P^T = exp(scale S^T - lse) masked, dS^T = P^T (dP^T - D) scale, both
 *    rounded to bf16; dV += P^T dO, dK += dS^T Q in register fragments); dQ
 *    over 64-query blocks looping over key tiles up to the diagonal (S, dP,
 *    dS likewise for the warp's 16 queries; dQ += dS K).
 * Computing S^T directly for a warp's own keys gives P^T and dS^T in the row
 * layout its products need; no transposed tile is ever stored.
 *
 * Layouts. qkv (N,3C) bf16 = [q | k | v], head h in columns h*hs..; out,
 * dout (N,C) bf16; dqkv like qkv; lse, D (B,NH,T) fp32. Shared tiles are
 * row-major, bf16 rows of hs + 8 elements and fp32 rows of width + 4 (WMMA
 * wants ldm a multiple of 8 for bf16 and of 4 for fp32, and a 256-bit
 * aligned pointer: every fragment starts at a row multiple of 16 and a
 * column multiple of 16, and every region at a multiple of 128 bytes; the
 * padding shifts successive rows by 4 banks). Rows past T load as zero and
 * are never written. Global loads are 16-byte vectors (8 bf16): hs and C are
 * multiples of 16, and attention.cu's dispatch checks qkv's and dout's
 * alignment (every kiln buffer is 64-byte aligned).
 *
 * Documents (backend.h's AttnShape.doc, data.doc_masking): doc (B, T), the
 * first position of each row's document, or NULL. A query sees keys from
 * its document's start on as well; the forward and dQ start at the key tile
 * of the block's first row's document (doc is nondecreasing along a
 * sequence), dK/dV stop at the first query tile whose first query's
 * document starts after the block's keys. A row may then see none of a
 * tile: its softmax update is skipped (no exp2(-inf - -inf)).
 *
 * Determinism: no atomics; every sum (fragment products, the pair's
 * butterfly, the tile loops) runs in a fixed order, so the same inputs give
 * the same bits. Math is fp32 with fp32 accumulation; only the tensor-core
 * operands are bf16 (the inputs as stored, and P, dS rounded to nearest). */
#ifndef KILN_CUDA_EMU /* test/attention_tc_emu.cc runs the kernels on the CPU with test/cuda_emu.h's stand-ins */
#include <mma.h>
#endif

#include "common.cuh"

using namespace nvcuda;

#define TC_B 64            /* rows of a block, and of a tile */
#define TC_THREADS 128     /* 4 warps of 16 rows */
#define TC_LDS (TC_B + 4)  /* fp32 score tiles (64 columns): row stride */
#define TC_LDP (TC_B + 8)  /* bf16 probability tiles (64 columns): row stride */
#define TC_LOG2E 1.4426950408889634f
#define TC_LN2 0.6931471805599453f

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> FragA;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> FragB;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> FragBt; /* B = X^T of row-major X */
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FragC;

/* dst (16 x 64, row stride TC_LDS, fp32) at the warp's rows wr..wr+15 = rows
 * wr..wr+15 of A times the 64 rows of Bm transposed (A, Bm: bf16 tiles with
 * row stride ldh; nd 16-wide slices of the head dim): S = Q K^T and its kin. */
__device__ __forceinline__ void tc_warp_abt(float *dst, const bf16 *A, const bf16 *Bm, int ldh, int nd, int wr) {
    FragC acc[4];
#pragma unroll
    for (int j = 0; j < 4; j++) wmma::fill_fragment(acc[j], 0.0f);
    for (int dk = 0; dk < nd; dk++) {
        FragA a;
        wmma::load_matrix_sync(a, A + wr * ldh + dk * 16, ldh);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            FragBt bt;
            wmma::load_matrix_sync(bt, Bm + j * 16 * ldh + dk * 16, ldh);
            wmma::mma_sync(acc[j], a, bt, acc[j]);
        }
    }
#pragma unroll
    for (int j = 0; j < 4; j++) wmma::store_matrix_sync(dst + wr * TC_LDS + j * 16, acc[j], TC_LDS, wmma::mem_row_major);
}

/* Shared-memory plan of each kernel: byte offsets of its regions, each a
 * multiple of 128 bytes. `tile` is one (64, hs + 8) bf16 tile. */
struct TcSmem {
    size_t k, v, q, d, s, dp, p, ds, o, stat, total;
};
__host__ __device__ inline size_t tc_align(size_t bytes) { return (bytes + 127) & ~(size_t)127; }
__host__ __device__ inline TcSmem tc_smem(int hs, int backward) {
    size_t tile = tc_align((size_t)TC_B * (hs + 8) * sizeof(bf16));
    size_t ftile = tc_align((size_t)TC_B * TC_LDS * sizeof(float));
    size_t ptile = tc_align((size_t)TC_B * TC_LDP * sizeof(bf16));
    TcSmem L;
    /* K, V, then Q, dO: backward kernels stage their (64, hs + 4) fp32
     * results over two adjacent tiles (256 (hs + 8) >= 256 (hs + 4) bytes). */
    L.k = 0, L.v = tile, L.q = 2 * tile, L.d = 3 * tile;
    L.s = backward ? 4 * tile : 3 * tile; /* forward: no dO tile */
    if (backward) {
        L.dp = L.s + ftile;   /* dP (dQ) or dP^T (dK/dV), fp32 */
        L.p = L.dp + ftile;   /* P^T, bf16 (dK/dV only) */
        L.ds = L.p + ptile;   /* dS or dS^T, bf16 */
        L.o = L.ds;           /* unused */
        L.stat = L.ds + ptile;
    } else {
        L.dp = L.ds = L.s;    /* unused */
        L.p = L.s + ftile;    /* P, bf16 */
        L.o = L.p + ptile;    /* O, (64, hs + 4) fp32 */
        L.stat = L.o + tc_align((size_t)TC_B * (hs + 4) * sizeof(float));
    }
    L.total = L.stat + tc_align(2 * TC_B * sizeof(float)); /* two fp32 per row: m, l or lse, D */
    return L;
}

/* Rows [r0, r0 + 64) of one head's q, k, v (ld 3C) or dout (ld C) into a
 * shared (64, hs) tile of row stride ldd; rows past T read as zero. */
__device__ __forceinline__ void tc_load_tile(bf16 *dst, int ldd, const bf16 *src, size_t ld, int r0, int T,
                                             int hs) {
    int cpr = hs / 8; /* 16-byte chunks per row */
    for (int e = threadIdx.x; e < TC_B * cpr; e += blockDim.x) {
        int r = e / cpr, c = (e % cpr) * 8;
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (r0 + r < T) x = *reinterpret_cast<const uint4 *>(src + (size_t)(r0 + r) * ld + c);
        *reinterpret_cast<uint4 *>(dst + r * ldd + c) = x;
    }
}

/* A warp's 16 rows of an fp32 (64, hs + 4) staging tile to rows r0 + wr ..
 * of dst (stride ld), rounded to bf16; rows past T are not written. */
__device__ __forceinline__ void tc_store_rows(bf16 *dst, size_t ld, const float *stage, int ldo, int r0, int wr,
                                              int T, int hs) {
    int lane = threadIdx.x % 32;
    for (int e = lane; e < 16 * hs; e += 32) {
        int rr = e / hs, d = e % hs, t = r0 + wr + rr;
        if (t < T) dst[(size_t)t * ld + d] = __float2bfloat16_rn(stage[(wr + rr) * ldo + d]);
    }
}

/* ---------------------------------------------------------------------------
 * Forward. Grid (B*NH, ceil(T/64)); block y runs query tiles from the last
 * (the longest: most key tiles) down, so the short ones fill the tail. */
__global__ void __launch_bounds__(TC_THREADS)
    tc_forward_kernel(bf16 *out, float *lse, const bf16 *qkv, const int32_t *doc, int T, int C, int NH, float sl2) {
    KILN_DYN_SHARED(__align__(128) unsigned char, tc_smem_buf);
    int hs = C / NH, nd = hs / 16, bh = blockIdx.x, b = bh / NH, h = bh % NH;
    int q0 = (gridDim.y - 1 - blockIdx.y) * TC_B;
    TcSmem L = tc_smem(hs, 0);
    bf16 *Qs = (bf16 *)(tc_smem_buf + L.q), *Ks = (bf16 *)(tc_smem_buf + L.k), *Vs = (bf16 *)(tc_smem_buf + L.v);
    float *Ss = (float *)(tc_smem_buf + L.s), *Os = (float *)(tc_smem_buf + L.o);
    bf16 *Ps = (bf16 *)(tc_smem_buf + L.p);
    float *Ms = (float *)(tc_smem_buf + L.stat), *Ls = Ms + TC_B;
    int ldh = hs + 8, ldo = hs + 4;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wr = warp * 16;
    int r = lane >> 1, half = lane & 1, row = q0 + wr + r; /* softmax: lanes 2r, 2r+1 own row r */
    size_t ld = 3 * (size_t)C;
    const bf16 *Q = qkv + (size_t)b * T * ld + h * hs, *K = Q + C, *V = Q + 2 * C;
    float *Srow = Ss + (wr + r) * TC_LDS, *Orow = Os + (wr + r) * ldo;
    bf16 *Prow = Ps + (wr + r) * TC_LDP;

    tc_load_tile(Qs, ldh, Q, ld, q0, T, hs);
    for (int d = half; d < hs; d += 2) Orow[d] = 0.0f;
    float m = -INFINITY, l = 0.0f; /* row r's running max (log2 units) and sum */
    const int32_t *Dc = doc ? doc + (size_t)b * T : NULL;
    int first = Dc && row < T ? Dc[row] : 0, kbeg = Dc ? Dc[q0] / TC_B * TC_B : 0;
    for (int k0 = kbeg; k0 <= q0; k0 += TC_B) { /* key tiles up to the diagonal one */
        __syncthreads(); /* every warp is done with the previous K, V */
        tc_load_tile(Ks, ldh, K, ld, k0, T, hs);
        tc_load_tile(Vs, ldh, V, ld, k0, T, hs);
        __syncthreads();
        tc_warp_abt(Ss, Qs, Ks, ldh, nd, wr); /* S = Q K^T, the warp's 16 rows x 64 keys */
        __syncwarp();
        /* Online softmax of row r over columns half, half + 2, ...: scores in
         * log2 units (sl2 = log2(e) / sqrt(hs)). Without documents key k0
         * is visible to every row of the block (k0 <= q0), so mt and m_new
         * are finite; with them a row may have seen no key yet (mn -inf):
         * p = 0 and alpha = 1 on its zero O and l. A masked key gives p =
         * exp2(-inf) = 0 exactly. */
        float mt = -INFINITY;
        for (int jj = 0; jj < TC_B / 2; jj++) {
            int j = 2 * jj + half;
            float s = k0 + j <= row && k0 + j >= first ? Srow[j] * sl2 : -INFINITY;
            Srow[j] = s;
            mt = fmaxf(mt, s);
        }
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
        float mn = fmaxf(m, mt), alpha = mn == -INFINITY ? 1.0f : exp2f(m - mn), ps = 0.0f;
        for (int jj = 0; jj < TC_B / 2; jj++) {
            int j = 2 * jj + half;
            float p = mn == -INFINITY ? 0.0f : exp2f(Srow[j] - mn);
            ps += p;
            Prow[j] = __float2bfloat16_rn(p);
        }
        ps += __shfl_xor_sync(0xffffffffu, ps, 1);
        l = l * alpha + ps;
        m = mn;
        for (int d = half; d < hs; d += 2) Orow[d] *= alpha;
        __syncwarp();
        { /* O += P V: the warp's 16 rows x hs */
            FragA pa[4];
#pragma unroll
            for (int kk = 0; kk < 4; kk++) wmma::load_matrix_sync(pa[kk], Ps + wr * TC_LDP + kk * 16, TC_LDP);
            for (int dt = 0; dt < nd; dt++) {
                FragC o;
                wmma::load_matrix_sync(o, Os + wr * ldo + dt * 16, ldo, wmma::mem_row_major);
#pragma unroll
                for (int kk = 0; kk < 4; kk++) {
                    FragB vb;
                    wmma::load_matrix_sync(vb, Vs + kk * 16 * ldh + dt * 16, ldh);
                    wmma::mma_sync(o, pa[kk], vb, o);
                }
                wmma::store_matrix_sync(Os + wr * ldo + dt * 16, o, ldo, wmma::mem_row_major);
            }
        }
        __syncwarp();
    }
    if (half == 0) Ms[wr + r] = m, Ls[wr + r] = l;
    __syncwarp();
    /* out = O / l (l >= 1: the row's maximum contributes exp2(0)) */
    for (int e = lane; e < 16 * hs; e += 32) {
        int rr = e / hs, d = e % hs, t = q0 + wr + rr;
        if (t < T) out[((size_t)b * T + t) * C + h * hs + d] = __float2bfloat16_rn(Os[(wr + rr) * ldo + d] / Ls[wr + rr]);
    }
    /* lse = log(sum exp(s scale)) = m ln 2 + log l, m in log2 units */
    if (half == 0 && row < T) lse[(size_t)bh * T + row] = m * TC_LN2 + logf(l);
}

/* ---------------------------------------------------------------------------
 * Backward, part 1: D = rowsum(dO * O) (B,NH,T) fp32, one warp per (b, h, t). */
__global__ void tc_backward_d_kernel(float *Dbuf, const bf16 *dout, const bf16 *out, int B, int T, int C, int NH) {
    int hs = C / NH, lane = threadIdx.x % 32;
    size_t w = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; /* (b*NH + h)*T + t */
    if (w >= (size_t)B * NH * T) return;                                 /* whole warps leave */
    int t = (int)(w % T), bh = (int)(w / T), b = bh / NH, h = bh % NH;
    size_t base = ((size_t)b * T + t) * C + h * hs;
    float s = 0.0f;
    for (int d = lane; d < hs; d += 32) s += __bfloat162float(dout[base + d]) * __bfloat162float(out[base + d]);
    s = warp_sum(s);
    if (lane == 0) Dbuf[w] = s;
}

/* Backward, part 2: dK, dV. Grid (B*NH, ceil(T/64)): block y owns keys
 * k0 = 64 y .. (low y: the most query tiles, first). MAXD = the most 16-wide
 * column blocks of hs (4: hs <= 64, 8: hs <= 128): the register fragments
 * of dK and dV. */
template <int MAXD>
__global__ void __launch_bounds__(TC_THREADS)
    tc_backward_dkv_kernel(bf16 *dqkv, const float *Dbuf, const bf16 *dout, const bf16 *qkv, const float *lse,
                           const int32_t *doc, int T, int C, int NH, float scale, float sl2) {
    KILN_DYN_SHARED(__align__(128) unsigned char, tc_smem_buf);
    int hs = C / NH, nd = hs / 16, bh = blockIdx.x, b = bh / NH, h = bh % NH;
    int k0 = blockIdx.y * TC_B;
    TcSmem L = tc_smem(hs, 1);
    bf16 *Ks = (bf16 *)(tc_smem_buf + L.k), *Vs = (bf16 *)(tc_smem_buf + L.v);
    bf16 *Qs = (bf16 *)(tc_smem_buf + L.q), *dOs = (bf16 *)(tc_smem_buf + L.d);
    float *St = (float *)(tc_smem_buf + L.s), *dPt = (float *)(tc_smem_buf + L.dp);
    bf16 *Pt = (bf16 *)(tc_smem_buf + L.p), *dSt = (bf16 *)(tc_smem_buf + L.ds);
    float *Lq = (float *)(tc_smem_buf + L.stat), *Dq = Lq + TC_B; /* per query of the tile */
    int ldh = hs + 8;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wr = warp * 16;
    int r = lane >> 1, half = lane & 1, key = k0 + wr + r; /* lanes 2r, 2r+1 own key row r */
    size_t ld = 3 * (size_t)C;
    const bf16 *Q = qkv + (size_t)b * T * ld + h * hs, *K = Q + C, *V = Q + 2 * C;
    const bf16 *dO = dout + (size_t)b * T * C + h * hs;
    const float *Lg = lse + (size_t)bh * T, *Dg = Dbuf + (size_t)bh * T;
    float *Strow = St + (wr + r) * TC_LDS, *dPtrow = dPt + (wr + r) * TC_LDS;
    bf16 *Ptrow = Pt + (wr + r) * TC_LDP, *dStrow = dSt + (wr + r) * TC_LDP;

    tc_load_tile(Ks, ldh, K, ld, k0, T, hs);
    tc_load_tile(Vs, ldh, V, ld, k0, T, hs);
    FragC dk[MAXD], dv[MAXD];
#pragma unroll
    for (int t = 0; t < MAXD; t++) wmma::fill_fragment(dk[t], 0.0f), wmma::fill_fragment(dv[t], 0.0f);
    const int32_t *Dc = doc ? doc + (size_t)b * T : NULL;
    for (int i0 = k0; i0 < T; i0 += TC_B) { /* queries before k0 see none of these keys */
        if (Dc && Dc[i0] >= k0 + TC_B) break; /* nor (documents) any query from here on: the same for every thread */
        __syncthreads(); /* every warp is done with the previous Q, dO, Lq, Dq */
        tc_load_tile(Qs, ldh, Q, ld, i0, T, hs);
        tc_load_tile(dOs, ldh, dO, C, i0, T, hs);
        for (int i = threadIdx.x; i < TC_B; i += blockDim.x) {
            Lq[i] = i0 + i < T ? Lg[i0 + i] * TC_LOG2E : 0.0f;
            Dq[i] = i0 + i < T ? Dg[i0 + i] : 0.0f;
        }
        __syncthreads();
        /* S^T = K Q^T, then dP^T = V dO^T: the warp's 16 keys x 64 queries */
        tc_warp_abt(St, Ks, Qs, ldh, nd, wr);
        tc_warp_abt(dPt, Vs, dOs, ldh, nd, wr);
        __syncwarp();
        /* P^T and dS^T of key row r, queries half, half + 2, ...: query i0 + j
         * sees the key iff key <= i0 + j < T. */
        for (int jj = 0; jj < TC_B / 2; jj++) {
            int j = 2 * jj + half, qi = i0 + j;
            float p = qi >= key && qi < T && (!Dc || Dc[qi] <= key) ? exp2f(Strow[j] * sl2 - Lq[j]) : 0.0f;
            Ptrow[j] = __float2bfloat16_rn(p);
            dStrow[j] = __float2bfloat16_rn(p * (dPtrow[j] - Dq[j]) * scale);
        }
        __syncwarp();
        { /* dV += P^T dO, dK += dS^T Q */
            FragA pa[4], sa[4];
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                wmma::load_matrix_sync(pa[kk], Pt + wr * TC_LDP + kk * 16, TC_LDP);
                wmma::load_matrix_sync(sa[kk], dSt + wr * TC_LDP + kk * 16, TC_LDP);
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
    }
    __syncthreads(); /* every warp is done with Q, dO: their space stages dV, then dK */
    float *stage = (float *)(tc_smem_buf + L.q);
    int ldo = hs + 4;
    bf16 *dK = dqkv + (size_t)b * T * ld + C + h * hs, *dV = dK + C;
#pragma unroll
    for (int dt = 0; dt < MAXD; dt++)
        if (dt < nd) wmma::store_matrix_sync(stage + wr * ldo + dt * 16, dv[dt], ldo, wmma::mem_row_major);
    __syncwarp();
    tc_store_rows(dV, ld, stage, ldo, k0, wr, T, hs);
    __syncwarp(); /* the warp's rows of stage are read before dK overwrites them */
#pragma unroll
    for (int dt = 0; dt < MAXD; dt++)
        if (dt < nd) wmma::store_matrix_sync(stage + wr * ldo + dt * 16, dk[dt], ldo, wmma::mem_row_major);
    __syncwarp();
    tc_store_rows(dK, ld, stage, ldo, k0, wr, T, hs);
}

/* Backward, part 3: dQ. Grid (B*NH, ceil(T/64)), query tiles longest first
 * as in the forward. */
template <int MAXD>
__global__ void __launch_bounds__(TC_THREADS)
    tc_backward_dq_kernel(bf16 *dqkv, const float *Dbuf, const bf16 *dout, const bf16 *qkv, const float *lse,
                          const int32_t *doc, int T, int C, int NH, float scale, float sl2) {
    KILN_DYN_SHARED(__align__(128) unsigned char, tc_smem_buf);
    int hs = C / NH, nd = hs / 16, bh = blockIdx.x, b = bh / NH, h = bh % NH;
    int q0 = (gridDim.y - 1 - blockIdx.y) * TC_B;
    TcSmem L = tc_smem(hs, 1);
    bf16 *Ks = (bf16 *)(tc_smem_buf + L.k), *Vs = (bf16 *)(tc_smem_buf + L.v);
    bf16 *Qs = (bf16 *)(tc_smem_buf + L.q), *dOs = (bf16 *)(tc_smem_buf + L.d);
    float *Ss = (float *)(tc_smem_buf + L.s), *dPs = (float *)(tc_smem_buf + L.dp);
    bf16 *dSs = (bf16 *)(tc_smem_buf + L.ds);
    float *Lq = (float *)(tc_smem_buf + L.stat), *Dq = Lq + TC_B; /* per query of the block */
    int ldh = hs + 8;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wr = warp * 16;
    int r = lane >> 1, half = lane & 1, row = q0 + wr + r; /* lanes 2r, 2r+1 own query row r */
    size_t ld = 3 * (size_t)C;
    const bf16 *Q = qkv + (size_t)b * T * ld + h * hs, *K = Q + C, *V = Q + 2 * C;
    const bf16 *dO = dout + (size_t)b * T * C + h * hs;
    float *Srow = Ss + (wr + r) * TC_LDS, *dProw = dPs + (wr + r) * TC_LDS;
    bf16 *dSrow = dSs + (wr + r) * TC_LDP;

    tc_load_tile(Qs, ldh, Q, ld, q0, T, hs);
    tc_load_tile(dOs, ldh, dO, C, q0, T, hs);
    for (int i = threadIdx.x; i < TC_B; i += blockDim.x) {
        Lq[i] = q0 + i < T ? lse[(size_t)bh * T + q0 + i] * TC_LOG2E : 0.0f;
        Dq[i] = q0 + i < T ? Dbuf[(size_t)bh * T + q0 + i] : 0.0f;
    }
    FragC dq[MAXD];
#pragma unroll
    for (int t = 0; t < MAXD; t++) wmma::fill_fragment(dq[t], 0.0f);
    const int32_t *Dc = doc ? doc + (size_t)b * T : NULL;
    int first = Dc && row < T ? Dc[row] : 0, kbeg = Dc ? Dc[q0] / TC_B * TC_B : 0;
    for (int k0 = kbeg; k0 <= q0; k0 += TC_B) { /* key tiles up to the diagonal one */
        __syncthreads(); /* the previous K, V are no longer read (first time: Q, dO, Lq, Dq are in) */
        tc_load_tile(Ks, ldh, K, ld, k0, T, hs);
        tc_load_tile(Vs, ldh, V, ld, k0, T, hs);
        __syncthreads();
        /* S = Q K^T, then dP = dO V^T: the warp's 16 queries x 64 keys */
        tc_warp_abt(Ss, Qs, Ks, ldh, nd, wr);
        tc_warp_abt(dPs, dOs, Vs, ldh, nd, wr);
        __syncwarp();
        /* dS of query row r, keys half, half + 2, ...: key k0 + j is seen iff
         * k0 + j <= row (row < T; rows past T are never written). */
        float l2 = Lq[wr + r], Dr = Dq[wr + r];
        for (int jj = 0; jj < TC_B / 2; jj++) {
            int j = 2 * jj + half;
            float p = k0 + j <= row && k0 + j >= first && row < T ? exp2f(Srow[j] * sl2 - l2) : 0.0f;
            dSrow[j] = __float2bfloat16_rn(p * (dProw[j] - Dr) * scale);
        }
        __syncwarp();
        { /* dQ += dS K */
            FragA sa[4];
#pragma unroll
            for (int kk = 0; kk < 4; kk++) wmma::load_matrix_sync(sa[kk], dSs + wr * TC_LDP + kk * 16, TC_LDP);
#pragma unroll
            for (int dt = 0; dt < MAXD; dt++) {
                if (dt >= nd) break;
#pragma unroll
                for (int kk = 0; kk < 4; kk++) {
                    FragB kb;
                    wmma::load_matrix_sync(kb, Ks + kk * 16 * ldh + dt * 16, ldh);
                    wmma::mma_sync(dq[dt], sa[kk], kb, dq[dt]);
                }
            }
        }
    }
    __syncthreads(); /* every warp is done with K, V: their space stages dQ */
    float *stage = (float *)(tc_smem_buf + L.k);
    int ldo = hs + 4;
#pragma unroll
    for (int dt = 0; dt < MAXD; dt++)
        if (dt < nd) wmma::store_matrix_sync(stage + wr * ldo + dt * 16, dq[dt], ldo, wmma::mem_row_major);
    __syncwarp();
    tc_store_rows(dqkv + (size_t)b * T * ld + h * hs, ld, stage, ldo, q0, wr, T, hs);
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

int cuda_attention_tc_fits(int C, int NH) {
    int hs = C / NH;
    if (hs < 16 || hs > 128 || hs % 16 != 0) return 0;
    size_t need = tc_smem(hs, 1).total > tc_smem(hs, 0).total ? tc_smem(hs, 1).total : tc_smem(hs, 0).total;
    return need <= (size_t)tc_smem_optin();
}

/* Shared memory over 48 KiB needs an opt-in per kernel: raised once to the
 * largest size requested so far. */
template <typename F>
static void tc_allow_smem(F kernel, size_t bytes, size_t *allowed) {
    if (bytes <= *allowed) return;
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    *allowed = bytes;
}

void cuda_attention_tc_forward(void *out, float *lse, const void *qkv, const int32_t *doc, int B, int T, int C,
                               int NH) {
    static size_t allowed;
    int hs = C / NH;
    size_t sh = tc_smem(hs, 0).total;
    tc_allow_smem(tc_forward_kernel, sh, &allowed);
    float sl2 = TC_LOG2E / sqrtf((float)hs);
    dim3 grid(B * NH, (T + TC_B - 1) / TC_B);
    KLAUNCH(tc_forward_kernel, grid, TC_THREADS, sh, (bf16 *)out, lse, (const bf16 *)qkv, doc, T, C, NH, sl2);
    CUDA_CHECK_LAUNCH();
}

template <int MAXD>
static void tc_backward_run(bf16 *dqkv, const float *Dbuf, const bf16 *dout, const bf16 *qkv, const float *lse,
                            const int32_t *doc, int B, int T, int C, int NH) {
    static size_t allowed_kv, allowed_q;
    int hs = C / NH;
    size_t sh = tc_smem(hs, 1).total;
    tc_allow_smem(tc_backward_dkv_kernel<MAXD>, sh, &allowed_kv);
    tc_allow_smem(tc_backward_dq_kernel<MAXD>, sh, &allowed_q);
    float scale = 1.0f / sqrtf((float)hs), sl2 = TC_LOG2E * scale;
    dim3 grid(B * NH, (T + TC_B - 1) / TC_B);
    KLAUNCH(tc_backward_dkv_kernel<MAXD>, grid, TC_THREADS, sh, dqkv, Dbuf, dout, qkv, lse, doc, T, C, NH, scale, sl2);
    CUDA_CHECK_LAUNCH();
    KLAUNCH(tc_backward_dq_kernel<MAXD>, grid, TC_THREADS, sh, dqkv, Dbuf, dout, qkv, lse, doc, T, C, NH, scale, sl2);
    CUDA_CHECK_LAUNCH();
}

void cuda_attention_tc_backward(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                                const int32_t *doc, int B, int T, int C, int NH) {
    float *Dbuf = (float *)cuda_scratch(SCRATCH_ATTENTION, (size_t)B * NH * T * sizeof(float));
    size_t rows = (size_t)B * NH * T;
    KLAUNCH(tc_backward_d_kernel, cuda_blocks(rows * CUDA_WARP, 256), 256, 0, Dbuf, (const bf16 *)dout, (const bf16 *)out, B,
            T, C, NH);
    CUDA_CHECK_LAUNCH();
    /* D is read by both kernels below (same stream, in order); they write
     * disjoint columns of dqkv (k, v and q), so their order does not matter. */
    if (C / NH <= 64)
        tc_backward_run<4>((bf16 *)dqkv, Dbuf, (const bf16 *)dout, (const bf16 *)qkv, lse, doc, B, T, C, NH);
    else
        tc_backward_run<8>((bf16 *)dqkv, Dbuf, (const bf16 *)dout, (const bf16 *)qkv, lse, doc, B, T, C, NH);
}
#endif /* KILN_TC_KERNELS_ONLY */
