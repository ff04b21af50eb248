/* fp8: host reference of the fp8 amax and quantise-dequantise ops (fp8.h),
 * used by the CPU backend and the tests; names of the config's values. */
#include "fp8.h"

#include <string.h>

/* A max is exact in any order, so threads may split the rows freely. */
void fp8_amax_f32(float *amax, const float *x, int rows, int cols, int axis) {
    if (axis == FP8_AXIS_COL) {
        for (int j = 0; j < cols; j++) amax[j] = 0.0f;
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < cols; j++) amax[j] = fmaxf(amax[j], fabsf(x[(size_t)i * cols + j]));
        return;
    }
    float t = 0.0f;
    #pragma omp parallel for reduction(max : t)
    for (int i = 0; i < rows; i++) {
        float r = 0.0f;
        for (int j = 0; j < cols; j++) r = fmaxf(r, fabsf(x[(size_t)i * cols + j]));
        if (axis == FP8_AXIS_ROW) amax[i] = r;
        t = fmaxf(t, r);
    }
    if (axis == FP8_AXIS_TENSOR) amax[0] = t;
}

void fp8_qdq_f32(float *y, const float *x, const float *amax, int P, int rows, int cols, int axis, Fp8Format f,
                 int pow2) {
    int n = fp8_amax_len(rows, cols, axis);
    #pragma omp parallel for
    for (int i = 0; i < rows; i++) {
        float s = 1.0f;
        for (int j = 0; j < cols; j++) {
            if (j == 0 || axis == FP8_AXIS_COL) { /* the scale changes per column only along COL */
                int k = axis == FP8_AXIS_TENSOR ? 0 : axis == FP8_AXIS_ROW ? i : j;
                float a = 0.0f;
                for (int p = 0; p < P; p++) a = fmaxf(a, amax[(size_t)p * n + k]);
                s = fp8_scale(a, f, pow2);
            }
            size_t e = (size_t)i * cols + j;
            y[e] = fp8_round_fast(x[e] * s, f) / s;
        }
    }
}

int fp8_mode_parse(const char *s) {
    if (!strcmp(s, "off")) return FP8_OFF;
    if (!strcmp(s, "tensorwise")) return FP8_TENSORWISE;
    if (!strcmp(s, "rowwise")) return FP8_ROWWISE;
    if (!strcmp(s, "bf16")) return FP8_BF16_OPERANDS;
    return -1;
}

int fp8_format_parse(const char *s) {
    if (!strcmp(s, "e4m3")) return FP8_E4M3;
    if (!strcmp(s, "e5m2")) return FP8_E5M2;
    return -1;
}

const char *fp8_mode_name(Fp8Mode m) {
    return m == FP8_TENSORWISE ? "tensorwise" : m == FP8_ROWWISE ? "rowwise" : m == FP8_BF16_OPERANDS ? "bf16" : "off";
}
const char *fp8_format_name(Fp8Format f) { return f == FP8_E5M2 ? "e5m2" : f == FP8_BF16 ? "bf16" : "e4m3"; }
