/* fp8: the OCP 8-bit float formats (E4M3 "fn", E5M2) as exact host code, and
 * the scaling rules of precision.fp8 (docs/precision.md). The reference that
 * the backends' fp8 ops follow; knows nothing of models or devices.
 *
 * E4M3 (fn): bias 7, 3 mantissa bits, max 448, no infinities, NaN S.1111.111.
 * E5M2: bias 15, 2 mantissa bits, max 57344, infinities and NaNs (IEEE-like).
 * Casts round to nearest, ties to even, onto the grid (subnormals included),
 * and saturate: a finite value past the largest, and an infinity, become
 * +-max (CUDA's __NV_SATFINITE); NaN stays NaN. */
#ifndef KILN_FP8_H
#define KILN_FP8_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* The inline functions serve the CUDA kernels too (cuda/fp8.cu), so that
 * both backends round the same way to the bit. */
#ifdef __CUDACC__
#define FP8_FN static inline __host__ __device__
#else
#define FP8_FN static inline
#endif

/* FP8_BF16 is not an fp8 format: bf16, round to nearest even with no scale
 * (infinities and NaN kept), for precision.fp8: bf16 (below). */
typedef enum { FP8_E4M3 = 0, FP8_E5M2 = 1, FP8_BF16 = 2 } Fp8Format;

/* precision.fp8: the products' operands in fp8 with one scale per tensor
 * (Fp8Axis below says along which axis a row's runs) or per row, or in bf16
 * without a scale: the CPU's stand-in for a bf16 run, the same products'
 * operands rounded as bf16 tensor cores would take them. */
typedef enum { FP8_OFF = 0, FP8_TENSORWISE = 1, FP8_ROWWISE = 2, FP8_BF16_OPERANDS = 3 } Fp8Mode;

/* The amax a scale is computed from never goes below this (torchao's EPS):
 * an all-zero tensor gets a finite scale, max / 1e-12. */
#define FP8_AMAX_FLOOR 1e-12f

#define FP8_E4M3_MAX 448.0f
#define FP8_E5M2_MAX 57344.0f

FP8_FN float fp8_max(Fp8Format f) { return f == FP8_E4M3 ? FP8_E4M3_MAX : FP8_E5M2_MAX; }

/* Round-to-nearest-even saturating cast. The value a is written as r q, q the
 * grid's step at a's binade (2^(e - mbits), or the subnormal step below the
 * smallest normal); r = rint(a / q) is exact because q is a power of two, and
 * the code is (e + bias) << mbits plus r's mantissa, so a carry into the next
 * binade (r = 2^(mbits+1)) and the subnormal-to-normal step land on the right
 * code without a special case. */
FP8_FN uint8_t fp8_from_f32(float x, Fp8Format f) {
    const int mbits = f == FP8_E4M3 ? 3 : 2, bias = f == FP8_E4M3 ? 7 : 15;
    const int maxcode = f == FP8_E4M3 ? 0x7E : 0x7B; /* 448 = 1.110b 2^8; 57344 = 1.11b 2^15 */
    uint8_t sign = signbit(x) ? 0x80 : 0;
    if (isnan(x)) return (uint8_t)(sign | (f == FP8_E4M3 ? 0x7F : 0x7E));
    float a = fabsf(x);
    if (a >= 2.0f * fp8_max(f)) return (uint8_t)(sign | maxcode); /* also +-inf: satfinite */
    const int emin = 1 - bias;
    int e;
    frexpf(a, &e);
    e -= 1; /* a = 1.m 2^e */
    if (a == 0.0f || e < emin) e = emin;
    float q = ldexpf(1.0f, e - mbits);
    int r = (int)rintf(a / q); /* the default rounding mode: to nearest even */
    int code = e == emin && r < (1 << mbits) ? r : ((e + bias) << mbits) + (r - (1 << mbits));
    if (code > maxcode) code = maxcode;
    return (uint8_t)(sign | code);
}

FP8_FN float fp8_to_f32(uint8_t c, Fp8Format f) {
    const int mbits = f == FP8_E4M3 ? 3 : 2, bias = f == FP8_E4M3 ? 7 : 15;
    const int emask = f == FP8_E4M3 ? 0xF : 0x1F;
    float s = (c & 0x80) ? -1.0f : 1.0f;
    int ex = (c >> mbits) & emask, man = c & ((1 << mbits) - 1);
    if (f == FP8_E4M3 && (c & 0x7F) == 0x7F) return NAN;
    if (f == FP8_E5M2 && ex == emask) return man ? NAN : s * INFINITY;
    if (ex == 0) return s * ldexpf((float)man, 1 - bias - mbits);
    return s * ldexpf((float)((1 << mbits) | man), ex - bias - mbits);
}

/* x rounded onto the format's grid (cast and back). */
FP8_FN float fp8_round(float x, Fp8Format f) { return fp8_to_f32(fp8_from_f32(x, f), f); }

/* The same value without the codes (the CPU backend's quantise-dequantise
 * runs it on every operand element): in the normal range the fp32 bits are
 * rounded to mbits mantissa bits to nearest even by an integer add (a carry
 * into the exponent is the next binade); below the smallest normal, a / q
 * for the subnormal step q is exact and rintf rounds to even. test_fp8
 * checks it equals fp8_round on every midpoint and on random floats. */
FP8_FN float fp8_round_fast(float x, Fp8Format f) {
    if (f == FP8_BF16) { /* bf16: 7 mantissa bits, fp32's exponent range, so no subnormal or saturation case */
        if (isnan(x)) return x;
        union { float f; uint32_t u; } v = {x};
        v.u += 0x7FFFu + ((v.u >> 16) & 1u);
        v.u &= 0xFFFF0000u;
        return v.f;
    }
    const int mbits = f == FP8_E4M3 ? 3 : 2;
    const float mx = fp8_max(f), min_normal = f == FP8_E4M3 ? 0x1p-6f : 0x1p-14f;
    float a = fabsf(x);
    if (isnan(x)) return x;
    if (a >= min_normal) {
        union { float f; uint32_t u; } v = {a};
        const int sh = 23 - mbits;
        v.u += ((1u << (sh - 1)) - 1u) + ((v.u >> sh) & 1u);
        v.u &= ~((1u << sh) - 1u);
        a = v.f; /* an infinity stays one; saturation follows */
    } else {
        const float q = min_normal * (f == FP8_E4M3 ? 0.125f : 0.25f);
        a = rintf(a / q) * q;
    }
    a = a > mx ? mx : a;
    return copysignf(a, x);
}

/* The scale that maps an amax onto the format's largest value: s = max /
 * max(amax, FP8_AMAX_FLOOR), in fp32; pow2: rounded down to a power of two
 * (so scaling and unscaling are exact). A non-finite amax (a NaN or Inf in
 * the tensor) gives s = 1: the cast then saturates and keeps the NaN, so the
 * loss shows it instead of a zero scale hiding it. */
FP8_FN float fp8_scale(float amax, Fp8Format f, int pow2) {
    if (!isfinite(amax) || f == FP8_BF16) return 1.0f;
    float s = fp8_max(f) / fmaxf(amax, FP8_AMAX_FLOOR);
    if (pow2) {
        int e;
        frexpf(s, &e);
        s = ldexpf(1.0f, e - 1);
    }
    return s;
}

/* The axis of a scale. Scales of a (rows, cols) matrix: FP8_AXIS_TENSOR one
 * for the whole (amax over all), FP8_AXIS_ROW one per row (amax over its
 * columns), FP8_AXIS_COL one per column (amax over its rows). Rowwise fp8
 * scales each operand of a product along the contraction dimension, so a
 * product's operands take ROW or COL by where that dimension lies. */
typedef enum { FP8_AXIS_TENSOR = -1, FP8_AXIS_ROW = 0, FP8_AXIS_COL = 1 } Fp8Axis;

/* Number of amax values of a (rows, cols) matrix along `axis`. */
FP8_FN int fp8_amax_len(int rows, int cols, int axis) {
    return axis == FP8_AXIS_TENSOR ? 1 : axis == FP8_AXIS_ROW ? rows : cols;
}

/* Host reference of the backends' fp8 ops (backend.h fp8_amax, fp8_qdq), on
 * fp32 (rows, cols) matrices. fp8_amax_f32: amax (fp8_amax_len) = max |x|
 * along axis (NaN ignored, as fmaxf does). fp8_qdq_f32: with a_j the max
 * over the P rows of amax (P, n) of entry j (P > 1: the amaxes of several
 * tp ranks or of a delayed-scaling history) and s = fp8_scale(a_j), y =
 * fp8_round(x s) / s; y may be x. */
#ifdef __cplusplus
extern "C" {
#endif
void fp8_amax_f32(float *amax, const float *x, int rows, int cols, int axis);
void fp8_qdq_f32(float *y, const float *x, const float *amax, int P, int rows, int cols, int axis, Fp8Format f,
                 int pow2);

/* "off" | "tensorwise" | "rowwise" -> Fp8Mode; -1 if none. "e4m3" | "e5m2" -> Fp8Format; -1. */
int fp8_mode_parse(const char *s);
int fp8_format_parse(const char *s);
const char *fp8_mode_name(Fp8Mode m);
const char *fp8_format_name(Fp8Format f);
#ifdef __cplusplus
}
#endif

#endif
