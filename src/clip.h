/* clip: global-norm clipping's rule and a step's scalars (backend.h
 * StepScalars), one definition compiled by the host (optim.c, the CPU
 * backend) and by nvcc (cuda/pointwise.cu's step_scalars kernel), so the
 * host and the device derive the same clipping factor from the same norm.
 * Double arithmetic only (IEEE division and square root on either side,
 * nothing an FMA could contract). Never allocates or keeps state. */
#ifndef KILN_CLIP_H
#define KILN_CLIP_H

#include <math.h>

#include "backend.h"

#ifdef __CUDACC__
#define CLIP_FN static __host__ __device__ __forceinline__
#else
#define CLIP_FN static inline
#endif

/* torch's clip_grad_norm_ factor for a finite gradient norm: grad_clip /
 * (norm + 1e-6) where that is below 1 (the 1e-6 guards a zero norm), else
 * 1; grad_clip 0 is off. Applied inside the update, so the gradients are
 * read once. */
CLIP_FN float clip_scale(double norm, float grad_clip) {
    if (grad_clip > 0.0f) {
        double coef = grad_clip / (norm + 1e-6);
        if (coef < 1.0) return (float)coef;
    }
    return 1.0f;
}

/* st's norm, loss_mean, scale and skip from its loss (the sum of `micro`
 * micro-batches' mean losses) and sumsq: a non-finite norm or loss skips
 * the update (scale 1), as optim_step_begin and train.c do on the host. */
CLIP_FN void clip_step_scalars(StepScalars *st, int micro, float grad_clip) {
    double norm = sqrt(st->sumsq);
    float loss = (float)(st->loss / micro);
    int skip = !isfinite(norm) || !isfinite(loss);
    st->norm = norm;
    st->loss_mean = loss;
    st->skip = skip;
    st->scale = skip ? 1.0f : clip_scale(norm, grad_clip);
}

#endif
