/* cuda_emu.h: enough of CUDA (and of nvcuda::wmma) to compile the kernels in
 * cuda/ with the host C++ compiler and run them, with their host
 * wrappers, on the CPU (test/cuda_emu.cc, test/attention_tc_emu.cc). It checks
 * what a reader cannot: indexing, masks, launch shapes, shared-memory plans,
 * barrier placement. Never part of ./train.
 *
 * Model. KLAUNCH runs the blocks of a grid one after another; the threads of a
 * block are coroutines on one OS thread, switched only at barriers, warp by
 * warp so that warps drift apart as far as the barriers allow: __syncthreads,
 * __syncwarp and every shuffle (write, warp barrier, read, warp barrier) are
 * real barriers, so a thread reading what another wrote without one in between
 * sees the old value or garbage. A barrier some thread never reaches (an early
 * return before __syncthreads, a shuffle after a lane has exited) is reported
 * as a deadlock: undefined behaviour on a GPU. Dynamic shared memory and fresh
 * cudaMalloc memory are filled with garbage (NaN bytes) before use; a canary
 * behind every cudaMalloc buffer and behind dynamic shared memory catches
 * writes past the end, and guard pages around every cudaMalloc buffer catch
 * accesses further out (a read up to 255 bytes past the end reads the canary:
 * garbage). Launch shapes are checked as the hardware would (<= 1024 threads,
 * grid.y/z <= 65535, no empty grid, dynamic shared memory <= 48 KiB without
 * opt-in).
 *
 * Asynchronous copies into shared memory (cuda_pipeline.h's
 * __pipeline_memcpy_async, cp.async) land only at the issuing thread's
 * __pipeline_wait_prior that retires their batch; until then the destination
 * holds garbage, so a missing wait, commit or barrier after the wait, or a
 * refill of a buffer another warp still reads, shows. Blocks that hand work
 * to each other (kiln_flag_wait / kiln_flag_release, block order by an
 * atomicAdd ticket) run one after another, so a wait on a flag that no block
 * run before it has set is reported: on a GPU it would spin on a block that
 * may never start. emu_blocks_reversed runs a grid's blocks in reverse order.
 *
 * Not emulated: every interleaving (two orders of warps and of lanes are
 * tried, so a race can still hide), blocks running concurrently (cross-block
 * races; the memory ordering of the flags), static __shared__ arrays are not
 * refilled with garbage per block, fragment element order of WMMA (a fragment
 * is the whole 16x16 matrix in every lane; each lane stores 8 of its
 * elements, so every lane's copy must agree), asynchrony of
 * streams (every copy and launch is done when its call returns, so stream and
 * event ordering is not tested), device math's exact ulps, timing. */
#ifndef KILN_CUDA_EMU_H
#define KILN_CUDA_EMU_H
#define KILN_CUDA_EMU 1
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static /* one copy, shared by the block's coroutines; blocks run one at a time */
#define __align__(x) /* emu_smem is 128-byte aligned */
#define __restrict__ __restrict

using std::max;
using std::min;

/* ---- types */
struct __nv_bfloat16 { uint16_t u; }; /* bits only: no implicit conversions, as kernels must not rely on them */
typedef __nv_bfloat16 bf16;
struct uint3 { unsigned x, y, z; };
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct alignas(16) uint4 { unsigned x, y, z, w; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }

/* bf16 conversions as the device does them: round to nearest even; NaN
 * becomes the canonical 0x7fff (cvt.rn.bf16.f32). */
static inline float __bfloat162float(bf16 b) {
    uint32_t x = (uint32_t)b.u << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}
static inline bf16 __float2bfloat16_rn(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    bf16 b;
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        b.u = 0x7fff;
        return b;
    }
    x += 0x7fffu + ((x >> 16) & 1u);
    b.u = (uint16_t)(x >> 16);
    return b;
}
/* The IEEE-rounded intrinsics: plain operations (the test is built with
 * -ffp-contract=off, so none is fused). */
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }

/* ---- failures: one FAIL line and exit, the test's stderr gets the detail */
[[noreturn]] static inline void emu_fail(const char *what) {
    printf("FAIL cuda_emu: %s\n", what);
    fflush(stdout);
    exit(1);
}

/* ---- the thread machinery */
inline uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
inline unsigned emu_nthreads, emu_cur;  /* threads of the block; the one running */
inline unsigned long emu_progress;      /* barrier arrivals and thread exits */
inline std::vector<char *> emu_stack;
inline std::vector<char> emu_done;
inline const std::function<void()> *emu_body;
#define EMU_STACK (256 * 1024)

/* Coroutine switches. x86-64: a six-register swap (ucontext's swapcontext
 * makes a system call per switch, which made the test several times slower);
 * elsewhere ucontext. */
#if defined(__x86_64__)
inline std::vector<void *> emu_sp; /* each thread's saved stack pointer */
inline void *emu_main_sp;
extern "C" void emu_switch(void **save_sp, void *new_sp);
asm(".text\n.globl emu_switch\n.type emu_switch,@function\nemu_switch:\n"
    "pushq %rbp\npushq %rbx\npushq %r12\npushq %r13\npushq %r14\npushq %r15\n"
    "movq %rsp, (%rdi)\nmovq %rsi, %rsp\n"
    "popq %r15\npopq %r14\npopq %r13\npopq %r12\npopq %rbx\npopq %rbp\nret\n");
static inline void emu_yield() { emu_switch(&emu_sp[emu_cur], emu_main_sp); }
static inline void emu_resume(unsigned t) { emu_switch(&emu_main_sp, emu_sp[t]); }
static void emu_entry();
static inline void emu_start(unsigned t) {
    /* six zero registers, then emu_entry as the return address; rsp % 16 == 8 on its entry */
    void **frame = (void **)(emu_stack[t] + EMU_STACK - 80);
    for (int i = 0; i < 6; i++) frame[i] = 0;
    frame[6] = (void *)emu_entry;
    emu_sp[t] = frame;
}
static inline void emu_threads_resize(size_t n) { emu_sp.resize(std::max(emu_sp.size(), n)); }
#else
inline std::vector<ucontext_t> emu_ctx;
inline ucontext_t emu_main_ctx;
static inline void emu_yield() { swapcontext(&emu_ctx[emu_cur], &emu_main_ctx); }
static inline void emu_resume(unsigned t) { swapcontext(&emu_main_ctx, &emu_ctx[t]); }
static void emu_entry();
static inline void emu_start(unsigned t) {
    getcontext(&emu_ctx[t]);
    emu_ctx[t].uc_stack.ss_sp = emu_stack[t];
    emu_ctx[t].uc_stack.ss_size = EMU_STACK;
    emu_ctx[t].uc_link = NULL;
    makecontext(&emu_ctx[t], emu_entry, 0);
}
static inline void emu_threads_resize(size_t n) { emu_ctx.resize(std::max(emu_ctx.size(), n)); }
#endif

/* cp.async copies of each thread: issued since its last commit, and the
 * committed batches not yet waited for, oldest first (below). */
struct EmuCopy { void *dst; const void *src; size_t n, zfill; };
inline std::vector<std::vector<EmuCopy>> emu_pipe_open;
inline std::vector<std::vector<std::vector<EmuCopy>>> emu_pipe_batches;

struct EmuBar { unsigned count, gen; };
inline EmuBar emu_bar_block, emu_bar_warp[32];
static inline void emu_bar_wait(EmuBar &b, unsigned expected) {
    unsigned g = b.gen;
    emu_progress++;
    if (++b.count == expected) {
        b.count = 0;
        b.gen++;
        return;
    }
    while (b.gen == g) emu_yield();
}
static inline void __syncthreads() { emu_bar_wait(emu_bar_block, emu_nthreads); }
static inline void __syncwarp(unsigned mask = 0xffffffffu) {
    if (mask != 0xffffffffu) emu_fail("__syncwarp with a partial mask is not emulated");
    unsigned w = emu_cur / 32, lanes = std::min(32u, emu_nthreads - w * 32);
    emu_bar_wait(emu_bar_warp[w], lanes);
}

/* Shuffles through a per-warp exchange row. */
inline uint64_t emu_xch[32][32];
template <typename T> static inline T emu_shfl(unsigned mask, T v, unsigned src_lane, int keep) {
    static_assert(sizeof(T) <= 8, "shuffle of a type over 8 bytes");
    if (mask != 0xffffffffu) emu_fail("a shuffle with a partial mask is not emulated");
    unsigned w = emu_cur / 32, l = emu_cur % 32;
    memcpy(&emu_xch[w][l], &v, sizeof v);
    __syncwarp();
    T r = v;
    if (!keep) {
        if (w * 32 + src_lane >= emu_nthreads) emu_fail("a shuffle reads a lane past the end of the block");
        memcpy(&r, &emu_xch[w][src_lane], sizeof r);
    }
    __syncwarp();
    return r;
}
template <typename T> static inline T __shfl_xor_sync(unsigned mask, T v, int o, int width = 32) {
    unsigned l = emu_cur % 32;
    return emu_shfl(mask, v, (l & ~(unsigned)(width - 1)) | ((l % width) ^ (unsigned)o), 0);
}
template <typename T> static inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
    unsigned l = emu_cur % 32;
    return emu_shfl(mask, v, l + d, (l % width) + d >= (unsigned)width);
}
template <typename T> static inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
    unsigned l = emu_cur % 32;
    return emu_shfl(mask, v, l - d, (l % width) < d);
}
template <typename T> static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    unsigned l = emu_cur % 32;
    return emu_shfl(mask, v, (l & ~(unsigned)(width - 1)) + ((unsigned)src % width), 0);
}

/* Integer atomics: blocks run one at a time and threads switch only at
 * barriers, so a read-modify-write is atomic here as on the GPU. */
static inline unsigned atomicMax(unsigned *a, unsigned v) {
    unsigned old = *a;
    *a = old > v ? old : v;
    return old;
}
static inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}

/* ---- shared memory: one dynamic buffer (227 KiB, an H100/H200's most per
 * block) with a 4 KiB canary behind the launch's size */
#define EMU_SMEM_MAX (227 * 1024)
alignas(128) inline unsigned char emu_smem[EMU_SMEM_MAX + 4096];
inline size_t emu_smem_size; /* this launch's dynamic shared memory */
#define KILN_DYN_SHARED(type, name) type *name = (type *)emu_smem

/* ---- cuda_pipeline.h: 4-, 8- or 16-byte copies global -> shared, the last
 * zfill bytes zeroed. The destination is garbage from the issue to the wait
 * that retires the copy's batch (see the top). */
static inline void __pipeline_memcpy_async(void *dst, const void *src, size_t n, size_t zfill = 0) {
    unsigned char *d = (unsigned char *)dst;
    if ((n != 4 && n != 8 && n != 16) || zfill > n) emu_fail("__pipeline_memcpy_async: size not 4, 8 or 16, or zfill > size");
    if (d < emu_smem || d + n > emu_smem + emu_smem_size) emu_fail("__pipeline_memcpy_async: destination outside the launch's dynamic shared memory");
    if ((uintptr_t)dst % n || (uintptr_t)src % n) emu_fail("__pipeline_memcpy_async: a pointer not aligned to the copy's size");
    memset(dst, 0xff, n);
    emu_pipe_open[emu_cur].push_back(EmuCopy{dst, src, n, zfill});
}
static inline void __pipeline_commit() {
    emu_pipe_batches[emu_cur].push_back(emu_pipe_open[emu_cur]);
    emu_pipe_open[emu_cur].clear();
}
/* Every committed batch of this thread but the newest n has landed. */
static inline void __pipeline_wait_prior(size_t n) {
    auto &q = emu_pipe_batches[emu_cur];
    while (q.size() > n) {
        for (const EmuCopy &c : q.front()) {
            memcpy(c.dst, c.src, c.n - c.zfill);
            memset((unsigned char *)c.dst + c.n - c.zfill, 0, c.zfill);
        }
        q.erase(q.begin());
    }
}

/* ---- integer atomics and the flags blocks hand work over with (common.cuh):
 * blocks run one at a time, so a plain add is atomic and a flag a block waits
 * for must have been set by a block run before it. */
static inline int atomicAdd(int *p, int v) {
    int old = *p;
    *p = old + v;
    return old;
}
static inline void __threadfence() {}
static inline void kiln_flag_release(int *flag, int v) { *flag = v; }
static inline void kiln_flag_wait(const int *flag, int v) {
    if (*flag != v) {
        char m[200];
        snprintf(m, sizeof m, "a block waits for a flag to be %d, it is %d, and no block run before it sets it (on a GPU: a "
                 "wait on a later block, or forever)", v, *flag);
        emu_fail(m);
    }
}

/* ---- device memory: host memory with a canary behind each buffer */
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorMemoryAllocation = 2,
                   cudaErrorInvalidConfiguration = 9, cudaErrorNotReady = 600 };
enum cudaMemcpyKind { cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost,
                      cudaMemcpyDeviceToDevice, cudaMemcpyDefault };
typedef struct EmuStream *cudaStream_t;
#define cudaStreamLegacy ((cudaStream_t)0x1)
inline std::map<uintptr_t, size_t> emu_allocs;
inline cudaError_t emu_last_error = cudaSuccess;
static inline const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorNotReady: return "device not ready";
    }
    return "unknown error";
}
static inline cudaError_t cudaGetLastError() {
    cudaError_t e = emu_last_error;
    emu_last_error = cudaSuccess;
    return e;
}
static inline cudaError_t emu_error(cudaError_t e, const char *what) {
    fprintf(stderr, "cuda_emu: %s\n", what);
    return e;
}
/* A buffer ends at most 255 bytes before an inaccessible guard page (and
 * one precedes it): the start stays 256-byte aligned as cudaMalloc's is; the
 * slack behind the end is the canary, and an access further out faults. */
struct EmuMap { void *base; size_t len; };
inline std::map<uintptr_t, EmuMap> emu_maps;
static void emu_segv(int) {
    static const char m[] = "FAIL cuda_emu: an access outside every cudaMalloc buffer hit a guard page (SIGSEGV)\n";
    if (write(1, m, sizeof m - 1) < 0) {}
    _exit(1);
}
static inline cudaError_t cudaMalloc(void **p, size_t bytes) {
    static int handler;
    if (!handler) signal(SIGSEGV, emu_segv), handler = 1;
    size_t page = 4096, data = (bytes + 255 + page - 1) / page * page, len = data + 2 * page;
    unsigned char *base = (unsigned char *)mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return cudaErrorMemoryAllocation;
    mprotect(base, page, PROT_NONE);
    mprotect(base + page + data, page, PROT_NONE);
    unsigned char *end = base + page + data, *q = (unsigned char *)(((uintptr_t)(end - bytes)) & ~(uintptr_t)255);
    memset(q, 0xff, bytes); /* garbage (NaN in fp32 and bf16) until written */
    memset(q + bytes, 0xcd, end - (q + bytes));
    emu_allocs[(uintptr_t)q] = bytes;
    emu_maps[(uintptr_t)q] = EmuMap{base, len};
    *p = q;
    return cudaSuccess;
}
template <typename T> static inline cudaError_t cudaMalloc(T **p, size_t bytes) { return cudaMalloc((void **)p, bytes); }
/* 1 if [p, p + n) lies inside one cudaMalloc buffer. */
static inline int emu_is_device(const void *p, size_t n) {
    auto it = emu_allocs.upper_bound((uintptr_t)p);
    if (it == emu_allocs.begin()) return 0;
    --it;
    return (uintptr_t)p + n <= it->first + it->second;
}
static inline void emu_check_canaries() {
    for (auto &a : emu_allocs) {
        const unsigned char *c = (const unsigned char *)a.first + a.second;
        for (; (uintptr_t)c & 4095; c++)
            if (*c != 0xcd) emu_fail("a write past the end of a cudaMalloc buffer");
    }
}
static inline cudaError_t cudaFree(void *p) {
    if (!p) return cudaSuccess;
    if (!emu_allocs.count((uintptr_t)p)) return emu_error(cudaErrorInvalidValue, "cudaFree of a pointer cudaMalloc never gave");
    emu_check_canaries();
    emu_allocs.erase((uintptr_t)p);
    EmuMap m = emu_maps[(uintptr_t)p];
    emu_maps.erase((uintptr_t)p);
    munmap(m.base, m.len);
    return cudaSuccess;
}
static inline cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind kind) {
    if (n == 0) return cudaSuccess;
    if ((kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice) && !emu_is_device(dst, n))
        return emu_error(cudaErrorInvalidValue, "cudaMemcpy: the destination is not (all) device memory");
    if ((kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice) && !emu_is_device(src, n))
        return emu_error(cudaErrorInvalidValue, "cudaMemcpy: the source is not (all) device memory");
    memmove(dst, src, n);
    return cudaSuccess;
}
static inline cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind,
                                          cudaStream_t = 0) {
    return cudaMemcpy(dst, src, n, kind);
}
/* Rows of `width` bytes, each checked as cudaMemcpy checks one copy; pitches
 * below the width are the CUDA runtime's cudaErrorInvalidPitchValue. */
static inline cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                                            size_t rows, cudaMemcpyKind kind, cudaStream_t = 0) {
    if (rows > 1 && (dpitch < width || spitch < width))
        return emu_error(cudaErrorInvalidValue, "cudaMemcpy2DAsync: a pitch below the width");
    for (size_t r = 0; r < rows; r++) {
        cudaError_t e = cudaMemcpy((char *)dst + r * dpitch, (const char *)src + r * spitch, width, kind);
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}
static inline cudaError_t cudaMemset(void *p, int v, size_t n) {
    if (n && !emu_is_device(p, n)) return emu_error(cudaErrorInvalidValue, "cudaMemset of non-device memory");
    memset(p, v, n);
    return cudaSuccess;
}
static inline cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t = 0) { return cudaMemset(p, v, n); }
static inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }

/* ---- the device: one H100/H200-like GPU; events and streams are no-ops
 * (everything is done when a call returns) */
#define CUDART_VERSION 12040
struct cudaDeviceProp { char name[256]; int major, minor, multiProcessorCount; size_t totalGlobalMem; };
typedef struct EmuEvent *cudaEvent_t;
#define cudaEventDisableTiming 2
static inline cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return cudaSuccess; }
static inline cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : cudaErrorInvalidValue; }
/* the compute capability the emulated device reports (a test may lower it) */
static int emu_sm_major = 9, emu_sm_minor = 0;
static inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int) {
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "CPU emulation (test/cuda_emu.h)");
    p->major = emu_sm_major, p->minor = emu_sm_minor, p->multiProcessorCount = 1, p->totalGlobalMem = (size_t)1 << 30;
    return cudaSuccess;
}
static inline cudaError_t cudaRuntimeGetVersion(int *v) { *v = CUDART_VERSION; return cudaSuccess; }
static inline cudaError_t cudaDriverGetVersion(int *v) { *v = CUDART_VERSION; return cudaSuccess; }
static inline cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b) {
    size_t used = 0;
    for (auto &a : emu_allocs) used += a.second;
    *total_b = (size_t)1 << 30, *free_b = *total_b - used;
    return cudaSuccess;
}
static inline cudaError_t cudaMallocHost(void **p, size_t bytes) {
    *p = malloc(bytes ? bytes : 1);
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
static inline cudaError_t cudaFreeHost(void *p) { free(p); return cudaSuccess; }
static inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned) { *e = (cudaEvent_t)0x1; return cudaSuccess; }
static inline cudaError_t cudaEventDestroy(cudaEvent_t) { return cudaSuccess; }
static inline cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t = 0) { return cudaSuccess; }
static inline cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
static inline cudaError_t cudaEventQuery(cudaEvent_t) { return cudaSuccess; } /* recorded work is done */
/* cuBLASLt's version, for the backend's description line and for what
 * kiln asks of the library (matmul.cu cuda_fp8_rowwise: cuBLAS 12.9's
 * outer-vector scales); the library itself is test/cublaslt_emu.h
 * (test/matmul_emu.cc). A test lowers it to see kiln do without. */
#define CUBLAS_VER_MAJOR 0
#define CUBLAS_VER_MINOR 0
#define CUBLAS_VER_PATCH 0
inline size_t emu_lt_version = 130100; /* major 10000 + minor 100 + patch */
static inline size_t cublasLtGetVersion() { return emu_lt_version; }

/* ---- the device's limits */
enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerBlockOptin = 97 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
static inline cudaError_t cudaGetDevice(int *d) { *d = 0; return cudaSuccess; }
static inline cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr a, int) {
    if (a != cudaDevAttrMaxSharedMemoryPerBlockOptin) return cudaErrorInvalidValue;
    *v = EMU_SMEM_MAX;
    return cudaSuccess;
}
/* Dynamic shared memory each kernel may use, raised by cudaFuncSetAttribute. */
inline std::map<const void *, size_t> emu_smem_optin;
template <typename F> static inline cudaError_t cudaFuncSetAttribute(F *kernel, cudaFuncAttribute a, int v) {
    if (a != cudaFuncAttributeMaxDynamicSharedMemorySize || v < 0 || v > EMU_SMEM_MAX)
        return emu_error(cudaErrorInvalidValue, "cudaFuncSetAttribute: bad attribute or size");
    emu_smem_optin[reinterpret_cast<const void *>(kernel)] = (size_t)v;
    return cudaSuccess;
}
static inline size_t emu_smem_allowed(const void *kernel) {
    auto it = emu_smem_optin.find(kernel);
    return it == emu_smem_optin.end() || it->second < 48 * 1024 ? 48 * 1024 : it->second;
}
static inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }

/* ---- launches */
/* A thread's life: the kernel body, then back to the scheduler for good. */
static void emu_entry() {
    (*emu_body)();
    emu_done[emu_cur] = 1;
    emu_progress++;
    emu_yield();
    abort(); /* never resumed */
}
static inline void emu_set_thread(unsigned t) {
    emu_cur = t;
    threadIdx.x = t % blockDim.x;
    threadIdx.y = t / blockDim.x % blockDim.y;
    threadIdx.z = t / (blockDim.x * blockDim.y);
}
static inline void emu_run_block(unsigned n) {
    for (unsigned t = 0; t < n; t++) {
        emu_start(t);
        emu_done[t] = 0;
    }
    memset(&emu_bar_block, 0, sizeof emu_bar_block);
    memset(emu_bar_warp, 0, sizeof emu_bar_warp);
    emu_pipe_open.assign(n, {});
    emu_pipe_batches.assign(n, {});
    /* Warp by warp: a warp runs until all its threads wait at __syncthreads
     * (or are done), then the next; the order of warps, and of lanes within
     * a warp, flips from one round to the next. Warps thus drift as far apart
     * as the barriers allow, which shows a shared-memory race between warps
     * (one overwriting what another has yet to read) in at least one order. */
    unsigned live = n, nw = (n + 31) / 32;
    for (unsigned round = 0; live; round++) {
        unsigned long p0 = emu_progress;
        int rev = (round + blockIdx.x + blockIdx.y) & 1;
        for (unsigned k = 0; k < nw; k++) {
            unsigned w = rev ? nw - 1 - k : k, t0 = w * 32, t1 = std::min(n, t0 + 32);
            for (;;) {
                unsigned long pw = emu_progress;
                for (unsigned i = t0; i < t1; i++) {
                    unsigned t = rev ? t1 - 1 - (i - t0) : i;
                    if (emu_done[t]) continue;
                    emu_set_thread(t);
                    emu_resume(t);
                    if (emu_done[t]) live--;
                }
                if (emu_progress == pw) break;
            }
        }
        if (live && emu_progress == p0) {
            char m[200];
            snprintf(m, sizeof m, "deadlock in block (%u,%u,%u): %u of %u threads wait at a barrier that the others "
                     "never reach (exited, or at another barrier)", blockIdx.x, blockIdx.y, blockIdx.z, live, n);
            emu_fail(m);
        }
    }
    for (unsigned t = 0; t < n; t++)
        if (!emu_pipe_open[t].empty() || !emu_pipe_batches[t].empty())
            emu_fail("a thread ended with cp.async copies it never waited for (__pipeline_commit, __pipeline_wait_prior)");
}
inline int emu_blocks_reversed; /* a test may run grids last block first: the result must not depend on block order */
/* Runs f as the kernel body on every block of grid; smem_max is the dynamic
 * shared memory the kernel may use (48 KiB without cudaFuncSetAttribute). */
static inline void emu_launch(dim3 grid, dim3 block, size_t smem, const std::function<void()> &f,
                              size_t smem_max = 48 * 1024) {
    unsigned long long nt = (unsigned long long)block.x * block.y * block.z;
    if (nt == 0 || nt > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu ||
        grid.y > 65535 || grid.z > 65535 || smem > smem_max || smem > EMU_SMEM_MAX) {
        fprintf(stderr, "cuda_emu: invalid launch: grid (%u,%u,%u), block (%u,%u,%u), %zu bytes dynamic shared\n",
                grid.x, grid.y, grid.z, block.x, block.y, block.z, smem);
        emu_last_error = cudaErrorInvalidConfiguration;
        return;
    }
    unsigned n = (unsigned)nt;
    while (emu_stack.size() < n) emu_stack.push_back((char *)malloc(EMU_STACK));
    emu_threads_resize(n);
    emu_done.resize(std::max<size_t>(emu_done.size(), n));
    gridDim = grid, blockDim = block, emu_nthreads = n, emu_smem_size = smem, emu_body = &f;
    unsigned long long nb = (unsigned long long)grid.x * grid.y * grid.z;
    for (unsigned long long k = 0; k < nb; k++) { /* x fastest, then y, then z, as a GPU numbers blocks */
        unsigned long long i = emu_blocks_reversed ? nb - 1 - k : k;
        blockIdx = uint3{(unsigned)(i % grid.x), (unsigned)(i / grid.x % grid.y), (unsigned)(i / grid.x / grid.y)};
        memset(emu_smem, 0xff, smem);        /* garbage: reads of unwritten shared memory show */
        memset(emu_smem + smem, 0xa5, 4096); /* canary */
        emu_run_block(n);
        for (size_t j = smem; j < smem + 4096; j++)
            if (emu_smem[j] != 0xa5) emu_fail("shared memory written past the launch's dynamic size");
    }
    emu_check_canaries();
}
#define KLAUNCH(kernel, grid, block, smem, ...)                                                              \
    emu_launch(dim3(grid), dim3(block), (smem), [&] { kernel(__VA_ARGS__); },                              \
               emu_smem_allowed(reinterpret_cast<const void *>(&kernel)))

/* ---- nvcuda::wmma: 16x16x16 bf16 fragments, fp32 accumulators */
inline int emu_wmma_bad; /* set by a bad WMMA pointer or ldm; the test reads and clears it */
namespace nvcuda { namespace wmma {
struct matrix_a {}; struct matrix_b {}; struct accumulator {};
struct row_major {}; struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
template <typename Use, int M, int N, int K, typename T, typename L = void> struct fragment { float m[16][16]; };
template <typename F> void fill_fragment(F &f, float v) {
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) f.m[i][j] = v;
}
/* Records a pointer not 256-bit aligned, a tile reaching past the launch's
 * dynamic shared memory, one neither there nor inside one cudaMalloc buffer,
 * or a bad ldm. */
static inline void emu_check_ptr(const void *p, unsigned ldm, int es) {
    const unsigned char *c = (const unsigned char *)p;
    size_t extent = (15 * (size_t)ldm + 16) * es;
    if (c >= emu_smem && c < emu_smem + EMU_SMEM_MAX) {
        if ((c - emu_smem) % 32 != 0) emu_wmma_bad = 1;
        if ((size_t)(c - emu_smem) + extent > emu_smem_size) emu_wmma_bad = 2;
    } else if (emu_is_device(p, extent)) {
        if ((uintptr_t)c % 32 != 0) emu_wmma_bad = 1;
    } else emu_wmma_bad = 3;
    if (ldm % (es == 2 ? 8 : 4) != 0) emu_wmma_bad = 4;
}
template <typename Use, typename L>
void load_matrix_sync(fragment<Use, 16, 16, 16, bf16, L> &f, const bf16 *p, unsigned ldm) {
    emu_check_ptr(p, ldm, 2);
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++)
            f.m[i][j] = __bfloat162float(std::is_same<L, row_major>::value ? p[i * ldm + j] : p[j * ldm + i]);
}
static inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float> &f, const float *p, unsigned ldm, layout_t l) {
    emu_check_ptr(p, ldm, 4);
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) f.m[i][j] = l == mem_row_major ? p[i * ldm + j] : p[j * ldm + i];
}
static inline void store_matrix_sync(float *p, const fragment<accumulator, 16, 16, 16, float> &f, unsigned ldm, layout_t l) {
    emu_check_ptr(p, ldm, 4);
    unsigned lane = threadIdx.x % 32; /* each lane its share, so a lane that runs ahead overwrites what another has yet to load */
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++)
            if ((unsigned)(i * 16 + j) % 32 == lane) (l == mem_row_major ? p[i * ldm + j] : p[j * ldm + i]) = f.m[i][j];
}
template <typename LA, typename LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float> &d, const fragment<matrix_a, 16, 16, 16, bf16, LA> &a,
              const fragment<matrix_b, 16, 16, 16, bf16, LB> &b, const fragment<accumulator, 16, 16, 16, float> &c) {
    float r[16][16];
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) {
            float s = c.m[i][j];
            for (int k = 0; k < 16; k++) s += a.m[i][k] * b.m[k][j];
            r[i][j] = s;
        }
    memcpy(d.m, r, sizeof r);
}
}} // namespace nvcuda::wmma

#endif
