/* test_fp8: the fp8 formats and scaling rules of src/fp8.h against their
 * definitions (OCP 8-bit floats: E4M3 fn, E5M2) and a double reference. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/backend.h"
#include "../src/fp8.h"
#include "test.h"

static const char *fname[2] = {"e4m3", "e5m2"};

static int is_nan_code(uint8_t c, Fp8Format f) {
    return f == FP8_E4M3 ? (c & 0x7F) == 0x7F : (c & 0x7C) == 0x7C && (c & 3);
}
static int is_inf_code(uint8_t c, Fp8Format f) { return f == FP8_E5M2 && (c & 0x7F) == 0x7C; }

/* Every code decodes and encodes back to itself (NaNs decode to NaN; E5M2's
 * infinities decode to Inf and, the casts being saturating, encode to +-max). */
static void test_round_trip(Fp8Format f) {
    int bad = 0, nans = 0;
    char why[128] = "";
    for (int c = 0; c < 256; c++) {
        float v = fp8_to_f32((uint8_t)c, f);
        uint8_t back = fp8_from_f32(v, f);
        uint8_t want = is_nan_code((uint8_t)c, f) ? back : is_inf_code((uint8_t)c, f) ? (uint8_t)((c & 0x80) | 0x7B) : (uint8_t)c;
        if (is_nan_code((uint8_t)c, f)) {
            nans++;
            if (!isnan(v) || !isnan(fp8_to_f32(back, f))) bad++;
        } else if (back != want) {
            if (!bad) snprintf(why, sizeof why, "code 0x%02x -> %g -> 0x%02x", c, v, back);
            bad++;
        }
    }
    /* E4M3 fn: one NaN pattern per sign; E5M2: three mantissas per sign */
    int want_nans = f == FP8_E4M3 ? 2 : 6;
    char name[64];
    snprintf(name, sizeof name, "fp8_%s_round_trip_256", fname[f]);
    test_report(!bad && nans == want_nans, name, "%d bad (%s), %d NaN codes (want %d)", bad, why, nans, want_nans);
}

/* Values with known codes: the largest, 1, the smallest normal and subnormal. */
static void test_table(void) {
    struct { Fp8Format f; float v; uint8_t code; } t[] = {
        {FP8_E4M3, 448.0f, 0x7E},  {FP8_E4M3, 1.0f, 0x38},        {FP8_E4M3, -2.0f, 0xC0},
        {FP8_E4M3, 0x1p-6f, 0x08}, {FP8_E4M3, 0x1p-9f, 0x01},      {FP8_E4M3, 0x7p-9f, 0x07},
        {FP8_E4M3, 240.0f, 0x77},  {FP8_E4M3, 0.0f, 0x00},         {FP8_E4M3, -0.0f, 0x80},
        {FP8_E5M2, 57344.0f, 0x7B}, {FP8_E5M2, 1.0f, 0x3C},        {FP8_E5M2, 0x1p-14f, 0x04},
        {FP8_E5M2, 0x1p-16f, 0x01}, {FP8_E5M2, 0x3p-16f, 0x03},     {FP8_E5M2, -1.5f, 0xBE},
    };
    int bad = 0;
    char why[160] = "";
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        uint8_t c = fp8_from_f32(t[i].v, t[i].f);
        float back = fp8_to_f32(t[i].code, t[i].f);
        if (c != t[i].code || back != t[i].v || signbit(back) != signbit(t[i].v)) {
            if (!bad) snprintf(why, sizeof why, "%s %g: code 0x%02x (want 0x%02x), decode %g", fname[t[i].f], t[i].v, c,
                               t[i].code, back);
            bad++;
        }
    }
    test_report(!bad, "fp8_known_codes", "%s", why);
}

/* Between every two neighbouring finite values (subnormals and the step from
 * 0 included, both signs): the midpoint goes to the one with the even code
 * (ties to even), the next float above it to the upper, the one below to the
 * lower. */
static void test_midpoints(Fp8Format f) {
    int bad = 0, checked = 0;
    char why[160] = "";
    int maxcode = f == FP8_E4M3 ? 0x7E : 0x7B;
    for (int sign = 0; sign < 2; sign++)
        for (int c = 0; c < maxcode; c++) {
            uint8_t lo = (uint8_t)(c | (sign << 7)), hi = (uint8_t)((c + 1) | (sign << 7));
            float a = fp8_to_f32(lo, f), b = fp8_to_f32(hi, f);
            float mid = (a + b) * 0.5f; /* exact: both have few bits */
            uint8_t even = (c & 1) ? hi : lo;
            uint8_t got = fp8_from_f32(mid, f);
            uint8_t up = fp8_from_f32(nextafterf(mid, b), f), down = fp8_from_f32(nextafterf(mid, a), f);
            checked++;
            if (got != even || up != hi || down != lo) {
                if (!bad) snprintf(why, sizeof why, "between %g and %g: mid %g -> 0x%02x (want 0x%02x), up 0x%02x, "
                                   "down 0x%02x", a, b, mid, got, even, up, down);
                bad++;
            }
        }
    char name[64];
    snprintf(name, sizeof name, "fp8_%s_midpoints_ties_to_even", fname[f]);
    test_report(!bad && checked == 2 * maxcode, name, "%d of %d wrong: %s", bad, checked, why);
}

/* Saturation and the special values. */
static void test_saturation(Fp8Format f) {
    float mx = fp8_max(f);
    uint8_t maxc = f == FP8_E4M3 ? 0x7E : 0x7B;
    /* the midpoint between max and the next grid value (a NaN code for E4M3,
     * the infinity's place for E5M2) and all beyond saturate */
    float next = f == FP8_E4M3 ? 480.0f : 65536.0f;
    float over[] = {nextafterf(mx, INFINITY), (mx + next) * 0.5f, next, 1e30f, FLT_MAX, INFINITY};
    int bad = 0;
    for (size_t i = 0; i < sizeof over / sizeof over[0]; i++) {
        if (fp8_from_f32(over[i], f) != maxc) bad++;
        if (fp8_from_f32(-over[i], f) != (0x80 | maxc)) bad++;
    }
    int nan_ok = isnan(fp8_to_f32(fp8_from_f32(NAN, f), f)) && isnan(fp8_to_f32(fp8_from_f32(-NAN, f), f));
    int inf_ok = f == FP8_E4M3 ? 1 : isinf(fp8_to_f32(0x7C, f)) && fp8_to_f32(0xFC, f) < 0;
    /* below half the smallest subnormal: zero, sign kept; half of it ties to 0 (even) */
    float sub = f == FP8_E4M3 ? 0x1p-9f : 0x1p-16f;
    int under_ok = fp8_from_f32(sub * 0.25f, f) == 0 && fp8_from_f32(-sub * 0.25f, f) == 0x80 &&
                   fp8_from_f32(sub * 0.5f, f) == 0 && fp8_from_f32(sub * 0.5001f, f) == 1;
    char name[64];
    snprintf(name, sizeof name, "fp8_%s_saturation_nan_inf_underflow", fname[f]);
    test_report(!bad && nan_ok && inf_ok && under_ok, name, "%d overflow casts wrong, nan %d inf %d underflow %d", bad,
                nan_ok, inf_ok, under_ok);
}

/* Deterministic N(0, 1) samples (Box-Muller on a 64-bit LCG). */
static uint64_t rng = 88172645463325252ull;
static double uniform(void) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return ((rng >> 11) + 0.5) * 0x1p-53;
}
static float gauss(void) { return (float)(sqrt(-2.0 * log(uniform())) * cos(2.0 * M_PI * uniform())); }

static double sqnr_db(const double *ref, const float *got, size_t n) {
    double s = 0, e = 0;
    for (size_t i = 0; i < n; i++) {
        s += ref[i] * ref[i];
        e += (ref[i] - got[i]) * (ref[i] - got[i]);
    }
    return 10.0 * log10(s / e);
}

/* SQNR of quantised Gaussian tensors with an outlier-free amax scale, per
 * format and axis. Floors: torchao's test_float8_utils asserts >= 25 dB for
 * its casts; E4M3's 3 mantissa bits give ~31 dB on N(0,1), E5M2's 2 bits
 * ~25 dB, so the E5M2 floor is 22 dB (gradients, where range matters more
 * than precision). */
static void test_sqnr_casts(void) {
    enum { R = 64, Cc = 512 };
    static float x[R * Cc], y[R * Cc], amax[R * Cc];
    static double xd[R * Cc];
    for (int i = 0; i < R * Cc; i++) xd[i] = x[i] = gauss() * (1.0f + (float)(i / Cc)); /* rows of growing scale */
    for (int f = 0; f < 2; f++)
        for (int axis = -1; axis <= 1; axis++) {
            fp8_amax_f32(amax, x, R, Cc, axis);
            fp8_qdq_f32(y, x, amax, 1, R, Cc, axis, (Fp8Format)f, 0);
            double db = sqnr_db(xd, y, R * Cc);
            double floor_db = f == FP8_E4M3 ? 25.0 : 22.0;
            char name[80];
            snprintf(name, sizeof name, "fp8_sqnr_cast_%s_axis%d (%.1f dB >= %.0f)", fname[f], axis, db, floor_db);
            test_report(db >= floor_db, name, "%.2f dB", db);
        }
}

/* SQNR of a product out = a b^T with both operands quantised (E4M3, the
 * forward's format), against the double product of the unquantised
 * operands: torchao's floor for fp8 outputs is 18 dB. */
static void test_sqnr_product(void) {
    enum { M = 64, K = 256, N = 96 };
    static float a[M * K], b[N * K], qa[M * K], qb[N * K], am[M * K], bm[N * K], out[M * N];
    static double ref[M * N];
    for (int i = 0; i < M * K; i++) a[i] = gauss();
    for (int i = 0; i < N * K; i++) b[i] = gauss() * 0.02f;
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0;
            for (int k = 0; k < K; k++) s += (double)a[i * K + k] * b[j * K + k];
            ref[i * N + j] = s;
        }
    for (int mode = 0; mode < 2; mode++) { /* tensorwise; rowwise along the contraction dimension */
        int axis = mode ? FP8_AXIS_ROW : FP8_AXIS_TENSOR;
        fp8_amax_f32(am, a, M, K, axis);
        fp8_amax_f32(bm, b, N, K, axis);
        fp8_qdq_f32(qa, a, am, 1, M, K, axis, FP8_E4M3, mode);
        fp8_qdq_f32(qb, b, bm, 1, N, K, axis, FP8_E4M3, mode);
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) {
                float s = 0;
                for (int k = 0; k < K; k++) s += qa[i * K + k] * qb[j * K + k];
                out[i * N + j] = s;
            }
        double db = sqnr_db(ref, out, M * N);
        char name[80];
        snprintf(name, sizeof name, "fp8_sqnr_product_%s (%.1f dB >= 18)", mode ? "rowwise_pow2" : "tensorwise", db);
        test_report(db >= 18.0, name, "%.2f dB", db);
    }
}

/* fp8_scale against max / amax in double: within one fp32 rounding (half an
 * ulp, relative 2^-24); pow2: the largest power of two not above it. */
static void test_scales(void) {
    int bad = 0;
    char why[160] = "";
    for (int i = 0; i < 4000; i++) {
        float amax = (float)exp((uniform() - 0.5) * 80.0); /* 1e-17 .. 1e17, through the floor */
        for (int f = 0; f < 2; f++) {
            double ref = fp8_max((Fp8Format)f) / fmax((double)amax, (double)FP8_AMAX_FLOOR);
            float s = fp8_scale(amax, (Fp8Format)f, 0), p = fp8_scale(amax, (Fp8Format)f, 1);
            int e;
            double pref = ldexp(1.0, (frexp(ref, &e), e - 1));
            if (fabs(s - ref) > ref * 0x1p-24 || (double)p != pref) {
                if (!bad) snprintf(why, sizeof why, "amax %g %s: scale %.9g vs %.9g, pow2 %g vs %g", amax, fname[f], s,
                                   ref, p, pref);
                bad++;
            }
        }
    }
    int special = fp8_scale(NAN, FP8_E4M3, 0) == 1.0f && fp8_scale(INFINITY, FP8_E5M2, 1) == 1.0f &&
                  fp8_scale(0.0f, FP8_E4M3, 0) == 448.0f / FP8_AMAX_FLOOR;
    test_report(!bad && special, "fp8_scales_vs_double", "%d wrong: %s; special %d", bad, why, special);
}

/* amax along each axis, and the qdq's max over P rows of amaxes (the tp
 * ranks' or a history's): the largest one sets the scale. */
static void test_amax_rows(void) {
    float x[6] = {1, -5, 2, 3, 0.5f, -4}; /* (2, 3) */
    float t[1], r[2], c[3];
    fp8_amax_f32(t, x, 2, 3, FP8_AXIS_TENSOR);
    fp8_amax_f32(r, x, 2, 3, FP8_AXIS_ROW);
    fp8_amax_f32(c, x, 2, 3, FP8_AXIS_COL);
    int ok = t[0] == 5 && r[0] == 5 && r[1] == 4 && c[0] == 3 && c[1] == 5 && c[2] == 4;
    /* history of 3 amaxes: 1, 448 (the max), 7 -> scale 1, so x = 304, the midpoint of the grid's 288 and 320,
     * goes to the even 320 (a scale from 7 would have saturated it to 448 / 64) */
    float hist[3] = {1, 448, 7}, in = 304.0f, out;
    fp8_qdq_f32(&out, &in, hist, 3, 1, 1, FP8_AXIS_TENSOR, FP8_E4M3, 0);
    test_report(ok && out == 320.0f, "fp8_amax_axes_and_history_max", "axes %d, qdq %g (want 320)", ok, out);
}

/* fp8_round_fast (the CPU ops' path) equals the code-level fp8_round on
 * every grid value, every midpoint and its neighbours, and random floats of
 * every magnitude (bit patterns drawn uniformly). */
static void test_fast_round(void) {
    int bad = 0;
    char why[128] = "";
    for (int f = 0; f < 2; f++) {
        for (int c = 0; c < 256; c++) {
            float a = fp8_to_f32((uint8_t)c, (Fp8Format)f), b = fp8_to_f32((uint8_t)(c + 1), (Fp8Format)f);
            float vals[5] = {a, (a + b) * 0.5f, nextafterf((a + b) * 0.5f, INFINITY),
                             nextafterf((a + b) * 0.5f, -INFINITY), a * 1.5f};
            for (int k = 0; k < 5; k++) {
                float r = fp8_round(vals[k], (Fp8Format)f), q = fp8_round_fast(vals[k], (Fp8Format)f);
                if (!(r == q && signbit(r) == signbit(q)) && !(isnan(r) && isnan(q))) {
                    if (!bad) snprintf(why, sizeof why, "%s %g: %g vs %g", fname[f], vals[k], r, q);
                    bad++;
                }
            }
        }
        for (int i = 0; i < 200000; i++) {
            union { uint32_t u; float x; } v = {(uint32_t)(uniform() * 4294967296.0)};
            float r = fp8_round(v.x, (Fp8Format)f), q = fp8_round_fast(v.x, (Fp8Format)f);
            if (!(r == q && signbit(r) == signbit(q)) && !(isnan(r) && isnan(q))) {
                if (!bad) snprintf(why, sizeof why, "%s %g: %g vs %g", fname[f], v.x, r, q);
                bad++;
            }
        }
    }
    test_report(!bad, "fp8_fast_round_equals_codes", "%d differ: %s", bad, why);
}

/* precision.fp8: bf16's rounding (fp8_round_fast with FP8_BF16, and
 * fp8_qdq_f32 with it and no amax) against the backends' own bf16 store
 * (backend_act_round, src/sround.h's conversion): random bit patterns
 * (NaNs, infinities, subnormals among them), every tie between two bf16
 * neighbours of both parities and the floats either side. */
static void test_bf16_round(void) {
    int bad = 0, n = 0;
    char why[128] = "";
    float xs[3 * 4096 + 200000];
    for (uint32_t h = 0; h < 4096; h++) { /* bf16 patterns 0x0000.. spread over the exponents */
        union { uint32_t u; float x; } v = {((h * 16u) << 16) | 0x8000u}; /* exactly half a bf16 ulp above */
        xs[n++] = v.x, xs[n++] = nextafterf(v.x, INFINITY), xs[n++] = nextafterf(v.x, -INFINITY);
    }
    for (int i = 0; i < 200000; i++) {
        union { uint32_t u; float x; } v = {(uint32_t)(uniform() * 4294967296.0)};
        xs[n++] = v.x;
    }
    float *y = malloc(sizeof xs);
    fp8_qdq_f32(y, xs, NULL, 0, 1, n, FP8_AXIS_TENSOR, FP8_BF16, 0);
    for (int i = 0; i < n; i++) {
        float want = backend_act_round(xs[i], 2), q = fp8_round_fast(xs[i], FP8_BF16);
        int same = (isnan(want) && isnan(q) && isnan(y[i])) ||
                   (want == q && signbit(want) == signbit(q) && y[i] == q && signbit(y[i]) == signbit(q));
        if (!same && !bad++) snprintf(why, sizeof why, "%a: %a (qdq %a) vs %a", xs[i], q, y[i], want);
    }
    free(y);
    test_report(!bad, "fp8_bf16_operands_round_as_bf16_stores", "%d of %d differ: %s", bad, n, why);
}

int main(void) {
    test_fast_round();
    test_bf16_round();
    for (int f = 0; f < 2; f++) {
        test_round_trip((Fp8Format)f);
        test_midpoints((Fp8Format)f);
        test_saturation((Fp8Format)f);
    }
    test_table();
    test_sqnr_casts();
    test_sqnr_product();
    test_scales();
    test_amax_rows();
    int names = fp8_mode_parse("rowwise") == FP8_ROWWISE && fp8_mode_parse("bf16") == FP8_BF16_OPERANDS &&
                fp8_mode_parse("on") == -1 && fp8_format_parse("bf16") == -1 &&
                fp8_format_parse("e5m2") == FP8_E5M2 && fp8_format_parse("E5M2") == -1;
    test_report(names, "fp8_names_parse", "mode/format parse wrong");
    return 0;
}
