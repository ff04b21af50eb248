/* max_rel.h: the suite's measure of agreement between two float tensors,
 * max |got - ref| / max |ref| (normalised by the largest reference element,
 * so a tolerance reads as a fraction of the tensor's scale), infinite if got
 * holds a NaN or an Inf. C and C++ (the CUDA emulation tests). */
#ifndef KILN_TEST_MAX_REL_H
#define KILN_TEST_MAX_REL_H

#include <math.h>
#include <stddef.h>

static inline double test_max_rel(const float *got, const float *ref, size_t n) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - ref[i]);
        if (!(d == d) || isinf(d)) return INFINITY;
        num = d > num ? d : num;
        den = fabs(ref[i]) > den ? fabs(ref[i]) : den;
    }
    return num / (den > 0.0 ? den : 1.0);
}

#endif
