/* common.cuh: what every file of the CUDA backend shares — the checked-call
 * macro family, launch helpers, block reductions, the grow-only scratch, and
 * the declarations of the op entry points each .cu file defines. Never
 * included by host C code: the backend meets the host only in backend.h. */
#ifndef KILN_CUDA_COMMON_CUH
#define KILN_CUDA_COMMON_CUH

#ifndef KILN_CUDA_EMU /* test/cuda_emu.h stands in for the CUDA headers on the CPU */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#endif
#include <stddef.h>
#include <stdint.h>
#include <string.h>

extern "C" {
#include "backend.h"
#include "util.h"
}

/* Every CUDA runtime call goes through CUDA_CHECK; every kernel launch is
 * followed by CUDA_CHECK_LAUNCH(), which reads cudaGetLastError so a bad
 * launch configuration is reported at its own line, not at the next sync.
 * Failures are runtime errors (exit 1) naming the call, file and line. */
#define CUDA_CHECK(call)                                                                      \
    do {                                                                                      \
        cudaError_t kiln_err_ = (call);                                                       \
        if (kiln_err_ != cudaSuccess)                                                         \
            kiln_fail(KILN_EXIT_RUNTIME, "cuda: %s:%d: %s failed: %s", __FILE__, __LINE__,    \
                      #call, cudaGetErrorString(kiln_err_));                                  \
    } while (0)
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

/* The activation dtype (backend.h): 1 when it is bf16 (precision.compute
 * bf16), 0 for fp32; set by set_precision before any buffer exists. Kernels
 * that touch act tensors are templates on their storage type `T` (float or
 * bf16), instantiated for both; each op's host entry picks one with
 * ACT_DISPATCH. Loads widen to fp32 (act_f), stores round to nearest even
 * (act_from<T>); all arithmetic in between is fp32. */
extern int cuda_act_bf16;
/* Host waits on the device (backend.h host_syncs): every synchronous copy,
 * stream or event wait of the backend counts one, through CUDA_HOST_WAIT. */
extern unsigned long cuda_host_syncs;
#define CUDA_HOST_WAIT(call)  \
    do {                      \
        cuda_host_syncs++;    \
        CUDA_CHECK(call);     \
    } while (0)
typedef __nv_bfloat16 bf16;
__device__ __forceinline__ float act_f(float x) { return x; }
__device__ __forceinline__ float act_f(bf16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T act_from(float x);
template <> __device__ __forceinline__ float act_from<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 act_from<bf16>(float x) { return __float2bfloat16_rn(x); }
/* ACT_DISPATCH(fn, args...): fn<bf16>(args) or fn<float>(args) per the dtype. */
#define ACT_DISPATCH(fn, ...)                \
    do {                                     \
        if (cuda_act_bf16) fn<bf16>(__VA_ARGS__);  \
        else fn<float>(__VA_ARGS__);         \
    } while (0)

/* Every kernel launch is KLAUNCH(kernel, grid, block, smem, args...): the
 * chevron launch on the default stream under nvcc; under the CPU emulation
 * (test/cuda_emu.h, KILN_CUDA_EMU) a call that runs every block of the grid
 * with blockDim emulated threads. A kernel name with a template comma goes in
 * parentheses. Dynamic shared memory is declared with KILN_DYN_SHARED(type,
 * name) for the same reason (the emulation hands out its own buffer). */
#ifndef KILN_CUDA_EMU
#define KLAUNCH(kernel, grid, block, smem, ...) kernel<<<grid, block, smem>>>(__VA_ARGS__)
#define KILN_DYN_SHARED(type, name) extern __shared__ type name[]
#endif

/* A hand-over between blocks (attention_tc.cu's dQ sums in a fixed order):
 * the writer's block finishes its global writes, __syncthreads, then one
 * thread releases the flag; the reader's one thread spins until it holds the
 * value, then __syncthreads before the block reads. Spin only on blocks that
 * started before this one (an atomicAdd ticket taken at the start orders
 * them): those are resident, so the wait ends. The CPU emulation has its own. */
#ifndef KILN_CUDA_EMU
__device__ __forceinline__ void kiln_flag_release(int *flag, int v) {
    __threadfence();
    asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(flag), "r"(v) : "memory");
}
__device__ __forceinline__ void kiln_flag_wait(const int *flag, int v) {
    for (;;) {
        int x;
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(x) : "l"(flag) : "memory");
        if (x == v) return;
        __nanosleep(32);
    }
}
#endif

/* 128-bit loads and stores: a Pack holds 16 bytes of T_ (8 bf16 or 4 fp32)
 * and moves as one uint4; aligned16 is the host's check that a pointer may
 * be read or written in packs. */
template <typename T_> struct alignas(16) Pack {
    T_ v[16 / sizeof(T_)];
};
#define PACK(T_) (16 / sizeof(T_))
template <typename T_> __device__ __forceinline__ Pack<T_> pack_load(const T_ *p) {
    uint4 bits = *reinterpret_cast<const uint4 *>(p);
    Pack<T_> x;
    memcpy(&x, &bits, sizeof bits);
    return x;
}
template <typename T_> __device__ __forceinline__ void pack_store(T_ *p, const Pack<T_> &x) {
    uint4 bits;
    memcpy(&bits, &x, sizeof bits);
    *reinterpret_cast<uint4 *>(p) = bits;
}
static inline int aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* Device-side launch configuration. */
#define CUDA_WARP 32
static inline unsigned cuda_blocks(size_t n, unsigned threads) {
    size_t b = (n + threads - 1) / threads;
    return (unsigned)(b > 0x7fffffffu ? 0x7fffffffu : (b ? b : 1));
}

/* Warp sums with a fixed butterfly: the same order every run. */
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Block-wide sum or max (blockDim.x a multiple of 32, <= 1024); every thread
 * gets the result. `shared` holds 32 floats. Fixed order: deterministic. */
__device__ __forceinline__ float block_sum(float v, float *shared) {
    int lane = threadIdx.x % 32, wid = threadIdx.x / 32, nw = blockDim.x / 32;
    v = warp_sum(v);
    __syncthreads(); /* shared may still be read by a previous call */
    if (lane == 0) shared[wid] = v;
    __syncthreads();
    v = lane < nw ? shared[lane] : 0.0f;
    return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float *shared) {
    int lane = threadIdx.x % 32, wid = threadIdx.x / 32, nw = blockDim.x / 32;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) shared[wid] = v;
    __syncthreads();
    v = lane < nw ? shared[lane] : -INFINITY;
    return warp_max(v);
}

/* Grow-only device scratch, one slot per user, kept for the whole run so the
 * step loop never allocates after its first call (freed by shutdown). Ops run
 * on one stream in order, so a slot is never used by two kernels at once. */
enum {
    SCRATCH_COLSUM,    /* column-sum partials (norm dw/db, dbias); BGRADB's dbias when it is not written in place */
    SCRATCH_EMBED,     /* token buckets for the dwte scatter */
    SCRATCH_ATTENTION, /* the attention backward: D = rowsum(dO * O); the tensor cores also their dQ turns, fp32 dQ partials */
    SCRATCH_SUMSQ,     /* sumsq partials */
    SCRATCH_CUDNN,     /* cuDNN attention's workspace, grown when a shape is planned */
    SCRATCH_MOE,       /* moe_dispatch's per-tile expert counters and per-sequence bases */
    SCRATCH_MOE_GRAD,  /* moe_route_backward's fp32 dL/dprobs rows */
    SCRATCH_MOE_LSE,   /* moe_route's per-row lse^2 for the z-loss statistic */
    SCRATCH_NS,        /* Newton-Schulz's norm: sumsq partials and 1 / norm */
    SCRATCH_ADAFACTOR, /* Adafactor's update sum-of-squares partials */
    SCRATCH_FP8,       /* fp8_amax's per-row partials of a tensorwise amax */
    SCRATCH_COUNT
};
void *cuda_scratch(int slot, size_t bytes);
/* backend.h to_device: up to 1 MiB through a pinned staging ring, queued on
 * the stream with no host wait (src may be reused at once); larger, a
 * blocking copy (backend_cuda.cu). */
void cuda_stage_to_device(void *dst, const void *src, size_t bytes);
void cuda_scratch_free_all(void);

/* Op entry points, one family per file (the Backend table is in backend_cuda.cu). */
/* embed_norm.cu */
void cuda_embed_forward(void *out, const int32_t *tokens, const void *wte, const void *wpe, int B,
                        int T, int C);
void cuda_embed_backward(float *dwte, float *dwpe, const void *dout, const int32_t *tokens,
                         const int32_t *tokens_host, int B, int T, int C, int accumulate);
void cuda_embed_free_host(void);
void cuda_layernorm_forward(void *out, float *mean, float *rstd, const void *inp, const void *w,
                            const void *b, int N, int C, float eps);
void cuda_layernorm_backward(void *dinp, float *dw, float *db, const void *dout, const void *inp,
                             const void *w, const float *mean, const float *rstd, int N, int C,
                             int accumulate);
void cuda_rmsnorm_forward(void *out, float *rstd, const void *inp, const void *w, int N, int C, float eps);
void cuda_rmsnorm_backward(void *dinp, float *dw, const void *dout, const void *inp, const void *w, const float *rstd,
                           int N, int C, int accumulate);
void cuda_residual_norm_forward(void *res, void *out, float *mean, float *rstd, const void *a, const void *b,
                                const void *w, const void *bias, int N, int C, float eps);
/* dbias(OC) fp32 (+)= column sums of dout(N,OC) act, deterministic. */
void cuda_colsum(float *dbias, const void *dout, int N, int OC, int accumulate);
/* The column sums' chunk count for N rows, and their fixed-order finish:
 * out(C) fp32 (+)= the sum over chunks of part(chunks, C) fp32. */
int cuda_colsum_chunks(int N);
void cuda_colsum_finish(float *out, const float *part, int chunks, int C, int accumulate);
/* matmul.cu */
void cuda_matmul_init(void);
void cuda_matmul_shutdown(void);
void cuda_matmul_forward(void *out, const void *inp, const void *w, const void *bias, int N, int C,
                         int OC);
void cuda_matmul_backward(void *dinp, float *dw, float *dbias, const void *dout, const void *inp,
                          const void *w, int N, int C, int OC, int accumulate);
void cuda_matmul_gelu_forward(void *out_gelu, void *pre, const void *inp, const void *w, const void *bias, int N,
                              int C, int OC);
void cuda_matmul_backward_dgelu(void *dinp, float *dw, float *dbias, const void *dout, const void *inp,
                                const void *w, const void *pre, int N, int C, int OC, int accumulate);
/* fp8.cu: backend.h's fp8_amax, fp8_qdq and fp8_cast (src/fp8.h's rounding, to the bit). */
void cuda_fp8_amax(float *amax, const void *x, int rows, int cols, int axis);
void cuda_fp8_qdq(void *y, const void *x, const float *amax, int P, int rows, int cols, int axis, int fmt, int pow2);
void cuda_fp8_cast(const Fp8Cast *c, const void *x, int rows, int cols);
/* matmul.cu: backend.h's fp8_matmul through cuBLASLt's fp8 kernels, and
 * whether they take rowwise (outer-vector) scales here. */
void cuda_fp8_matmul(const Fp8Matmul *p);
int cuda_fp8_rowwise(void);
/* attention.cu: the backend's attention ops choose between the SIMT kernels
 * (any dtype and head size up to 128), the tensor-core ones of
 * attention_tc.cu and cuDNN's fused attention (attention_cudnn.cu); set_mode
 * is precision.attention (auto | cudnn | tensor_cores | simt),
 * precision_changed runs after set_precision (the self-checks the first time
 * they are needed), describe is the line for the backend's description, reset
 * is for shutdown. */
void cuda_attention_forward(void *out, float *lse, const void *qkv, const AttnShape *s);
void cuda_attention_backward(void *dqkv, const void *dout, const void *qkv, const void *out,
                             const float *lse, const AttnShape *s);
/* The SIMT kernels take any AttnShape (grouped K/V heads, head sizes up to 128). */
void cuda_attention_simt_forward(void *out, float *lse, const void *qkv, const AttnShape *s);
void cuda_attention_simt_backward(void *dqkv, const void *dout, const void *qkv, const void *out,
                                  const float *lse, const AttnShape *s);
void cuda_attention_set_mode(const char *mode);
/* precision.attention_deterministic (backend.h's set_attention_deterministic). */
void cuda_attention_set_deterministic(int deterministic);
void cuda_attention_precision_changed(void);
const char *cuda_attention_describe(void);
void cuda_attention_reset(void);
/* attention_block.cu: context parallelism's block attention (backend.h's AttnBlock), SIMT, any dtype. */
void cuda_attention_block_forward(void *out, float *lse, const void *q, const void *k, const void *v,
                                  const AttnBlock *s, int merge);
void cuda_attention_block_backward(float *dq, float *dk, float *dv, const void *dout, const void *q, const void *k,
                                   const void *v, const void *out, const float *lse, const AttnBlock *s);
/* attention_tc.cu: bf16 act only, any AttnShape (grouped K/V heads,
 * documents); fits says whether head size hs is supported and the kernels'
 * shared memory fits this GPU; qkv and dout 16-byte aligned. */
int cuda_attention_tc_fits(int hs);
void cuda_attention_tc_forward(void *out, float *lse, const void *qkv, const AttnShape *s);
void cuda_attention_tc_backward(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                                const AttnShape *s);
/* attention_cudnn.cu: bf16 act only, cuDNN opened at run time. load: 1 when
 * libcudnn_graph.so.9 (or libcudnn.so.9) is loaded, else 0 with why; library:
 * its version and path; fits: head sizes the graphs support; plan: 1 when
 * forward and backward plans exist for the shape (made now if needed, with
 * the workspace), else 0 with why; forward/backward run a planned shape (an
 * unplannable one is a runtime error) and return 1, or 0 with why when cuDNN's
 * execute fails (attention.cu then runs kiln's kernels); qkv, out, dout, dqkv
 * 16-byte aligned. Test hook: KILN_TEST_CUDNN_FAIL_B=N fails every execute at
 * batch size N (scripts/cuda_check.sh checks the fallback with it). */
int cuda_attention_cudnn_load(char *why, size_t n);
const char *cuda_attention_cudnn_library(void);
int cuda_attention_cudnn_fits(int C, int NH);
int cuda_attention_cudnn_plan(int B, int T, int C, int NH, char *why, size_t n);
int cuda_attention_cudnn_forward(void *out, float *lse, const void *qkv, int B, int T, int C, int NH, char *why,
                                 size_t n);
int cuda_attention_cudnn_backward(void *dqkv, const void *dout, const void *qkv, const void *out,
                                  const float *lse, int B, int T, int C, int NH, char *why, size_t n);
void cuda_attention_cudnn_reset(void);
/* precision.attention_deterministic: 0 plans and runs the backward whose dQ
 * the engine accumulates with atomics (faster, not the same bits run to
 * run); plans are kept per form. */
void cuda_attention_cudnn_set_deterministic(int deterministic);
/* llama.cu */
void cuda_rope_forward(void *qkv, const float *rope, const AttnShape *s, int pos0);
void cuda_rope_backward(void *dqkv, const float *rope, const AttnShape *s, int pos0);
void cuda_qknorm_forward(void *qkv, void *qk_in, float *rstd, const void *qw, const void *kw, const AttnShape *s,
                         int per_head, float eps);
void cuda_qknorm_backward(void *dqkv, float *dqw, float *dkw, const void *qk_in, const void *qw, const void *kw,
                          const float *rstd, const AttnShape *s, int per_head, int accumulate);
void cuda_swiglu_forward(void *out, const void *h, int N, int F);
void cuda_swiglu_backward(void *dh, const void *dout, const void *h, int N, int F);
/* moe.cu */
void cuda_moe_route(int32_t *topk, float *gates, float *probs, float *stats, const void *logits, const float *bias,
                    int N, int S, int E, int K, int sigmoid, int norm_topk);
void cuda_moe_dispatch(int32_t *offsets, int32_t *row_of, int32_t *src, int32_t *counts, const int32_t *topk, int N,
                       int S, int E, int K, int cap);
void cuda_moe_dispatch_capped(int32_t *offsets, int32_t *row_of, int32_t *src, int32_t *counts, const int32_t *topk,
                              int N, int S, int E, int K, const int32_t *caps);
void cuda_moe_gather(void *xp, const void *x, const int32_t *src, int R, int C);
void cuda_moe_gather_backward(void *dx, const void *dxp, const int32_t *row_of, int N, int K, int C);
void cuda_moe_combine(void *out, const void *yp, const float *gates, const int32_t *row_of, int N, int K, int C);
void cuda_moe_combine_backward(void *dyp, float *dgates, const void *dout, const void *yp, const float *gates,
                               const int32_t *row_of, int N, int K, int C);
void cuda_moe_route_backward(void *dlogits, const float *dgates, const float *probs, const int32_t *topk,
                             const float *gates, const void *logits, const float *aux, float z_coef, int N, int S,
                             int E, int K, int sigmoid, int norm_topk);
/* pointwise.cu */
void cuda_cast_to_act(void *dst, const float *src, size_t n);
void cuda_gelu_forward(void *out, const void *inp, size_t n);
void cuda_gelu_backward(void *dinp, const void *inp, const void *dout, size_t n);
void cuda_residual_forward(void *out, const void *a, const void *b, size_t n);
void cuda_add(float *out, const float *a, const float *b, size_t n);
void cuda_crossentropy_forward(void *logits, float *losses, const int32_t *targets, int N, int V,
                               int Vp, float dloss);
void cuda_xent_partial(float *stats, const void *logits, const int32_t *targets, int N, int V, int Vp);
void cuda_xent_finish(void *logits, float *losses, const float *stats_all, int P, const int32_t *targets, int N, int V,
                      int Vp, float dloss);
void cuda_adamw_update(float *params, const float *grads, float *m, float *v, size_t n, float lr, float beta1,
                       float beta2, float eps, float weight_decay, float grad_scale, int t, const StepScalars *st,
                       void *copy);
void cuda_lion_update(float *params, const float *grads, float *m, size_t n, float lr, float beta1, float beta2,
                      float weight_decay, float grad_scale, const StepScalars *st, void *copy);
void cuda_adamw_update_bf16(float *params, const float *grads, uint16_t *m, uint16_t *v, size_t n, float lr,
                            float beta1, float beta2, float eps, float weight_decay, float grad_scale, int t,
                            uint64_t seed, uint64_t idx0, const StepScalars *st, void *copy);
void cuda_adamw_update_p16(uint16_t *params, const float *grads, void *m, void *v, size_t state_bytes, size_t n,
                           float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale, int t,
                           uint64_t seed, uint64_t idx0, const StepScalars *st);
double cuda_sumsq(const float *x, size_t n);
void cuda_sumsq_acc(double *acc, const float *x, size_t n);
void cuda_loss_acc(double *acc, const float *losses, int N);
void cuda_step_scalars(StepScalars *st, int micro, float grad_clip);
void cuda_muon_momentum(float *u, float *m, const float *grads, size_t n, float momentum, float grad_scale);
void cuda_muon_apply(float *params, const float *o, size_t n, float lr, float scale, float weight_decay);
/* Newton-Schulz's ends: x (rows, cols) fp32 over its Frobenius norm (+ 1e-7)
 * into X (a, b) act, a = min(rows, cols), transposed when rows > cols; and X
 * back into x's layout (pointwise.cu). The iteration: matmul.cu. */
void cuda_adafactor_stats(float *rows, float *cols, const float *grads, size_t e0, size_t n, int cols_n,
                          float grad_scale, float eps1);
void cuda_adafactor_ema(float *state, const float *sums, size_t n, float beta2, float scale);
void cuda_adafactor_second(float *v, const float *grads, size_t n, float grad_scale, float beta2, float eps1);
void cuda_adafactor_usq(double *out, const float *grads, const float *v, const float *r, const float *c, float rmean,
                        size_t e0, size_t n, int cols_n, float grad_scale);
void cuda_adafactor_apply(float *params, const float *grads, float *m, const float *v, const float *r, const float *c,
                          float rmean, size_t e0, size_t n, int cols_n, float grad_scale, float inv_clip, float lr,
                          float beta1, float weight_decay);
void cuda_ns_prepare(void *X, const float *x, int rows, int cols);
void cuda_ns_finish(float *x, const void *X, int rows, int cols);
void cuda_newton_schulz(float *x, int rows, int cols, int steps, float *work);

#endif
