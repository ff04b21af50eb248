/* fp8: the backend's fp8 amax and quantise-dequantise ops (backend.h) on act
 * tensors, rounding with src/fp8.h's own inline functions so the GPU and the
 * CPU backend agree to the bit; the products stay the backend's bf16
 * cuBLASLt ones (docs/precision.md: what the real fp8 path still needs). */
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

/* one block: out[0] = max of part (n) */
__global__ void fp8_max_kernel(float *out, const float *part, int n) {
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
        KLAUNCH(fp8_max_kernel, 1, 1024, 0, amax, rowmax, rows);
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

/* q = the fp8 codes of x s, row-major (rows, cols) or transposed (cols,
 * rows), s from the max over amax (P) (tensorwise); inv_scale[0] = 1 / s,
 * what cuBLASLt multiplies the product by. The transposed write is not
 * coalesced (a tiled transpose through shared memory would be: not yet). */
template <typename T>
__global__ void fp8_cast_kernel(uint8_t *q, float *inv_scale, const T *x, const float *amax, int P, int rows, int cols,
                                int fmt, int pow2, int transpose) {
    float a = 0.0f;
    for (int p = 0; p < P; p++) a = fmaxf(a, amax[p]);
    float s = fp8_scale(a, (Fp8Format)fmt, pow2);
    if (blockIdx.x == 0 && threadIdx.x == 0) inv_scale[0] = 1.0f / s;
    size_t total = (size_t)rows * cols;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
        size_t i = e / cols, j = e % cols;
        q[transpose ? j * rows + i : e] = fp8_from_f32(act_f(x[e]) * s, (Fp8Format)fmt);
    }
}

template <typename T>
static void fp8_cast_launch(uint8_t *q, float *inv_scale, const void *x, const float *amax, int P, int rows, int cols,
                            int fmt, int pow2, int transpose) {
    unsigned blocks = cuda_blocks((size_t)rows * cols, FP8_THREADS);
    if (blocks > 65535u) blocks = 65535u;
    KLAUNCH(fp8_cast_kernel<T>, blocks, FP8_THREADS, 0, q, inv_scale, (const T *)x, amax, P, rows, cols, fmt, pow2,
            transpose);
    CUDA_CHECK_LAUNCH();
}

void cuda_fp8_cast(uint8_t *q, float *inv_scale, const void *x, const float *amax, int P, int rows, int cols, int fmt,
                   int pow2, int transpose) {
    fp8_check_device();
    ACT_DISPATCH(fp8_cast_launch, q, inv_scale, x, amax, P, rows, cols, fmt, pow2, transpose);
}
