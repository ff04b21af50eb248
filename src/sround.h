/* sround: bf16 storage of fp32 values with stochastic rounding, shared by the
 * CPU and CUDA backends (one definition, compiled by both, so they round to the
 * same bits). Integer-only: no floating-point operation whose rounding could
 * differ between a host compiler and nvcc. Never allocates or keeps state. */
#ifndef KILN_SROUND_H
#define KILN_SROUND_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define SROUND_FN static __host__ __device__ __forceinline__
#else
#define SROUND_FN static inline
#endif

/* 64 random bits from (seed, step, element index): a counter-based hash
 * (splitmix64's finaliser over an odd-multiplier combination), so any element
 * of any step gets its bits without a stream to advance: the same bits on
 * every backend, thread count and launch shape, and after a resume. */
SROUND_FN uint64_t sround_hash(uint64_t seed, uint64_t step, uint64_t idx) {
    uint64_t z = seed ^ (step * 0x9e3779b97f4a7c15ULL) ^ (idx * 0xd1b54a32d192ed03ULL);
    z ^= z >> 30;
    z *= 0xbf58476d1ce4e5b9ULL;
    z ^= z >> 27;
    z *= 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return z;
}

/* fp32 x -> bf16 bits, rounded stochastically with the 16 random bits r:
 * adding r to the 16 bits bf16 drops and truncating rounds the magnitude up
 * with probability (dropped bits) / 2^16, so E[result] = x (unbiased) and
 * updates far below one bf16 ulp still move the value on average. Inf and NaN
 * pass through (NaN stays NaN); a magnitude within one ulp of the largest
 * finite bf16 may round up to Inf, as round-to-nearest would. */
SROUND_FN uint16_t sround_bf16(float x, uint32_t r) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    if ((b & 0x7f800000u) == 0x7f800000u) return (uint16_t)((b >> 16) | ((b & 0xffffu) ? 0x40u : 0u));
    return (uint16_t)((b + (r & 0xffffu)) >> 16);
}

/* bf16 bits -> fp32 (exact). */
SROUND_FN float sround_f32(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float x;
    memcpy(&x, &b, sizeof x);
    return x;
}

#endif
