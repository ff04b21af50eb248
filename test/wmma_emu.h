/* wmma_emu.h: just enough of CUDA and nvcuda::wmma to run the kernels of
 * cuda/attention_tc.cu on the CPU (test/attention_tc_emu.cc), so their
 * indexing, masks, fragment layouts, shared-memory plan and synchronisation
 * are checked where there is no GPU. One block at a time; each CUDA thread is
 * a pthread; __syncthreads and __syncwarp are barriers; shuffles go through a
 * per-warp exchange array. A WMMA fragment is the whole 16x16 matrix in every
 * lane; load/store follow the documented row/col-major meaning of ldm, and
 * only lane 0 stores, so a read before the warp's __syncwarp sees stale data
 * (the harness fills shared memory with garbage before each block). Not
 * emulated: fragment element order (the kernels never touch it), timing. */
#ifndef KILN_WMMA_EMU_H
#define KILN_WMMA_EMU_H
#define KILN_WMMA_EMU 1
#include <pthread.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__
#define __align__(x) __attribute__((aligned(x)))

struct bf16 { uint16_t u; }; /* bits; conversions round to nearest even as cuda_bf16.h */
static inline float __bfloat162float(bf16 b) { uint32_t x = (uint32_t)b.u << 16; float f; memcpy(&f, &x, 4); return f; }
static inline bf16 __float2bfloat16_rn(float f) {
    uint32_t x; memcpy(&x, &f, 4);
    bf16 b;
    if ((x & 0x7fffffffu) > 0x7f800000u) { b.u = (uint16_t)((x >> 16) | 0x40); return b; }
    x += 0x7fffu + ((x >> 16) & 1u);
    b.u = (uint16_t)(x >> 16);
    return b;
}
struct alignas(16) uint4 { unsigned x, y, z, w; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
struct uint3e { unsigned x, y, z; };
struct dim3 { unsigned x, y, z; dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {} };
extern thread_local uint3e threadIdx;
extern uint3e blockIdx;
extern dim3 blockDim, gridDim;
void __syncthreads();
void __syncwarp(unsigned mask = 0xffffffffu);
float __shfl_xor_sync(unsigned mask, float v, int o);
static inline float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
#define CUDA_WARP 32

namespace nvcuda { namespace wmma {
struct matrix_a {}; struct matrix_b {}; struct accumulator {};
struct row_major {}; struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
template <typename Use, int M, int N, int K, typename T, typename L = void> struct fragment { float m[16][16]; };
template <typename F> void fill_fragment(F &f, float v) { for (int i = 0; i < 16; i++) for (int j = 0; j < 16; j++) f.m[i][j] = v; }
/* Records a pointer outside shared memory or not 256-bit aligned, a tile
 * reaching past the launch's dynamic shared memory, or a bad ldm. */
void emu_check_ptr(const void *p, unsigned ldm, int es);
template <typename Use, typename L> void load_matrix_sync(fragment<Use, 16, 16, 16, bf16, L> &f, const bf16 *p, unsigned ldm) {
    emu_check_ptr(p, ldm, 2);
    for (int i = 0; i < 16; i++) for (int j = 0; j < 16; j++)
        f.m[i][j] = __bfloat162float(std::is_same<L, row_major>::value ? p[i * ldm + j] : p[j * ldm + i]);
}
static inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float> &f, const float *p, unsigned ldm, layout_t l) {
    emu_check_ptr(p, ldm, 4);
    for (int i = 0; i < 16; i++) for (int j = 0; j < 16; j++) f.m[i][j] = l == mem_row_major ? p[i * ldm + j] : p[j * ldm + i];
}
static inline void store_matrix_sync(float *p, const fragment<accumulator, 16, 16, 16, float> &f, unsigned ldm, layout_t l) {
    emu_check_ptr(p, ldm, 4);
    if (threadIdx.x % 32 != 0) return;
    for (int i = 0; i < 16; i++) for (int j = 0; j < 16; j++) (l == mem_row_major ? p[i * ldm + j] : p[j * ldm + i]) = f.m[i][j];
}
template <typename LA, typename LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float> &d, const fragment<matrix_a, 16, 16, 16, bf16, LA> &a,
              const fragment<matrix_b, 16, 16, 16, bf16, LB> &b, const fragment<accumulator, 16, 16, 16, float> &c) {
    float r[16][16];
    for (int i = 0; i < 16; i++) for (int j = 0; j < 16; j++) {
        float s = c.m[i][j];
        for (int k = 0; k < 16; k++) s += a.m[i][k] * b.m[k][j];
        r[i][j] = s;
    }
    memcpy(d.m, r, sizeof r);
}
}}

#endif
