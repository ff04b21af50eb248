/* fp8: the backend's fp8 amax and quantise-dequantise ops (backend.h) on act
 * tensors, rounding with src/fp8.h's own inline functions so the GPU and the
 * CPU backend agree to the bit, and the casts that write fp8 codes for the
 * fp8 products (cuda/matmul.cu cuda_fp8_matmul). */
#include <math.h>

#include "common.cuh"
extern "C" {
#include "fp8.h"
}

#define FP8_THREADS 256

/* fp8 needs the tensor cores of Ada and Hopper (sm_89+): checked once. */
static int fp8_device_checked;
static void fp8_check_device(void) {
    if (fp8_device_checked) return;
    int dev;
    cudaDeviceProp p;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
    if (p.major * 10 + p.minor < 89)
        kiln_fail(KILN_EXIT_USAGE, "key 'precision.fp8': %s is sm_%d%d, fp8 tensor cores need sm_89 or later; set "
                  "precision.fp8: off", p.name, p.major, p.minor);
    fp8_device_checked = 1;
}

/* one block per row: out[row] = max |x| over its cols */
template <typename T>
__global__ void fp8_amax_rows_kernel(float *out, const T *x, int rows, int cols) {
    __shared__ float sh[32];
    int r = blockIdx.x;
    float m = 0.0f;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) m = fmaxf(m, fabsf(act_f(x[(size_t)r * cols + j])));
    m = block_max(m, sh);
    if (threadIdx.x == 0) out[r] = m;
}

/* one thread per column: out[col] = max |x| over the rows (coalesced across threads) */
template <typename T>
__global__ void fp8_amax_cols_kernel(float *out, const T *x, int rows, int cols) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cols) return;
    float m = 0.0f;
    for (int i = 0; i < rows; i++) m = fmaxf(m, fabsf(act_f(x[(size_t)i * cols + j])));
    out[j] = m;
}

/* one block of FP8_MAX_THREADS: out[0] = max of part (n); the bounds match the
 * launch, so ptxas keeps to the 64 registers a 1024-thread block may use */
#define FP8_MAX_THREADS 1024
__global__ void __launch_bounds__(FP8_MAX_THREADS) fp8_max_kernel(float *out, const float *part, int n) {
    __shared__ float sh[32];
    float m = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, part[i]);
    m = block_max(m, sh);
    if (threadIdx.x == 0) out[0] = m;
}

template <typename T>
static void fp8_amax_launch(float *amax, const void *x_, int rows, int cols, int axis) {
    const T *x = (const T *)x_;
    if (axis == FP8_AXIS_COL) {
        KLAUNCH(fp8_amax_cols_kernel<T>, cuda_blocks((size_t)cols, FP8_THREADS), FP8_THREADS, 0, amax, x, rows, cols);
        CUDA_CHECK_LAUNCH();
        return;
    }
    float *rowmax = axis == FP8_AXIS_ROW ? amax : (float *)cuda_scratch(SCRATCH_FP8, (size_t)rows * sizeof(float));
    KLAUNCH(fp8_amax_rows_kernel<T>, rows, FP8_THREADS, 0, rowmax, x, rows, cols);
    CUDA_CHECK_LAUNCH();
    if (axis == FP8_AXIS_TENSOR) {
        KLAUNCH(fp8_max_kernel, 1, FP8_MAX_THREADS, 0, amax, rowmax, rows);
        CUDA_CHECK_LAUNCH();
    }
}

void cuda_fp8_amax(float *amax, const void *x, int rows, int cols, int axis) {
    fp8_check_device();
    if (rows <= 0 || cols <= 0) {
        CUDA_CHECK(cudaMemset(amax, 0, (size_t)fp8_amax_len(rows, cols, axis) * sizeof(float)));
        return;
    }
    ACT_DISPATCH(fp8_amax_launch, amax, x, rows, cols, axis);
}

/* y = round_fp8(x s) / s, s from the max over the P rows of amax (P, n) */
template <typename T>
__global__ void fp8_qdq_kernel(T *y, const T *x, const float *amax, int P, int rows, int cols, int axis, int fmt,
                               int pow2) {
    size_t total = (size_t)rows * cols;
    int n = fp8_amax_len(rows, cols, axis);
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
        int i = (int)(e / cols), j = (int)(e % cols);
        int k = axis == FP8_AXIS_TENSOR ? 0 : axis == FP8_AXIS_ROW ? i : j;
        float a = 0.0f;
        for (int p = 0; p < P; p++) a = fmaxf(a, amax[(size_t)p * n + k]);
        float s = fp8_scale(a, (Fp8Format)fmt, pow2);
        y[e] = act_from<T>(fp8_round_fast(act_f(x[e]) * s, (Fp8Format)fmt) / s);
    }
}

template <typename T>
static void fp8_qdq_launch(void *y, const void *x, const float *amax, int P, int rows, int cols, int axis, int fmt,
                           int pow2) {
    size_t total = (size_t)rows * cols;
    unsigned blocks = cuda_blocks(total, FP8_THREADS);
    if (blocks > 65535u) blocks = 65535u;
    KLAUNCH(fp8_qdq_kernel<T>, blocks, FP8_THREADS, 0, (T *)y, (const T *)x, amax, P, rows, cols, axis, fmt, pow2);
    CUDA_CHECK_LAUNCH();
}

void cuda_fp8_qdq(void *y, const void *x, const float *amax, int P, int rows, int cols, int axis, int fmt, int pow2) {
    if ((size_t)rows * cols == 0) return;
    ACT_DISPATCH(fp8_qdq_launch, y, x, amax, P, rows, cols, axis, fmt, pow2);
}

/* The cast (backend.h fp8_cast, Fp8Cast): one pass over x in 32 x 32
 * tiles. A block reads its tile row by row (coalesced), writes q's codes
 * where they lie and, for qt, stages the codes in shared memory and writes
 * the transposed tile row by row too (coalesced: the naive transposed write
 * strides by rows bytes per thread). Tensorwise, q and qt share one scale
 * and each code is computed once; rowwise, q's code of (i, j) uses row i's
 * scale and qt's column j's. amax_out: the block's max |x| (NaN ignored, as
 * fp8_amax) into an unsigned atomic max of the float's bits, which orders
 * non-negative floats as their values, so the result is exact and the same
 * whatever order the blocks run in. */
#define FP8_TILE 32
#define FP8_TILE_THREADS 256 /* 8 warps: each thread takes 4 of the tile's rows */

template <typename T>
__global__ void fp8_cast_kernel(Fp8Cast c, const T *x, int rows, int cols) {
    __shared__ uint8_t tile[FP8_TILE][FP8_TILE + 4]; /* codes for qt; the pad spreads a column over banks */
    __shared__ float s_row[FP8_TILE], s_col[FP8_TILE], sh[32];
    const int r0 = blockIdx.x * FP8_TILE, c0 = blockIdx.y * FP8_TILE;
    const int t = threadIdx.x, tx = t % FP8_TILE, ty = t / FP8_TILE, rstep = FP8_TILE_THREADS / FP8_TILE;
    const Fp8Format fmt = (Fp8Format)c.fmt;
    if (t < FP8_TILE && (c.rowwise ? c.q != NULL : t == 0)) { /* q's scales: this tile's rows, or the one scale */
        int i = r0 + t, n = c.rowwise ? rows : 1, e = c.rowwise ? i : 0;
        float a = 0.0f;
        for (int p = 0; p < c.P_q && e < n; p++) a = fmaxf(a, c.amax_q[(size_t)p * n + e]);
        float s = fp8_scale(a, fmt, c.pow2);
        s_row[t] = s;
        if (!c.rowwise && blockIdx.x == 0 && blockIdx.y == 0) {
            if (c.inv_q) c.inv_q[0] = 1.0f / s;
            if (c.inv_t) c.inv_t[0] = 1.0f / s;
        } else if (c.rowwise && c.inv_q && blockIdx.y == 0 && i < rows) {
            c.inv_q[i] = 1.0f / s;
        }
    } else if (t >= FP8_TILE && t < 2 * FP8_TILE && c.rowwise && c.qt) { /* qt's: this tile's columns */
        int j = c0 + t - FP8_TILE;
        float a = 0.0f;
        for (int p = 0; p < c.P_t && j < cols; p++) a = fmaxf(a, c.amax_t[(size_t)p * cols + j]);
        float s = fp8_scale(a, fmt, c.pow2);
        s_col[t - FP8_TILE] = s;
        if (c.inv_t && blockIdx.x == 0 && j < cols) c.inv_t[j] = 1.0f / s;
    }
    __syncthreads();
    float m = 0.0f;
    for (int k = ty; k < FP8_TILE; k += rstep) {
        int i = r0 + k, j = c0 + tx;
        if (i >= rows || j >= cols) continue;
        float v = act_f(x[(size_t)i * cols + j]);
        m = fmaxf(m, fabsf(v));
        uint8_t code = fp8_from_f32(v * s_row[c.rowwise ? k : 0], fmt);
        if (c.q) c.q[(size_t)i * cols + j] = code;
        if (c.qt) tile[k][tx] = c.rowwise ? fp8_from_f32(v * s_col[tx], fmt) : code;
    }
    if (c.qt) {
        __syncthreads();
        for (int k = ty; k < FP8_TILE; k += rstep) { /* qt row c0 + k, columns r0 .. r0 + 31 */
            int j = c0 + k, i = r0 + tx;
            if (j < cols && i < rows) c.qt[(size_t)j * rows + i] = tile[tx][k];
        }
    }
    if (c.amax_out) {
        m = block_max(m, sh);
        if (t == 0) atomicMax((unsigned *)c.amax_out, __float_as_uint(m));
    }
}

template <typename T>
static void fp8_cast_launch(const Fp8Cast *c, const void *x, int rows, int cols) {
    dim3 grid((unsigned)((rows + FP8_TILE - 1) / FP8_TILE), (unsigned)((cols + FP8_TILE - 1) / FP8_TILE));
    KLAUNCH(fp8_cast_kernel<T>, grid, FP8_TILE_THREADS, 0, *c, (const T *)x, rows, cols);
    CUDA_CHECK_LAUNCH();
}

void cuda_fp8_cast(const Fp8Cast *c, const void *x, int rows, int cols) {
    fp8_check_device();
    if (c->amax_out) CUDA_CHECK(cudaMemsetAsync(c->amax_out, 0, sizeof(float), 0));
    if ((size_t)rows * cols == 0) return;
    ACT_DISPATCH(fp8_cast_launch, c, x, rows, cols);
}
