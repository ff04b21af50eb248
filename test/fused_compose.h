/* fused_compose.h: a test-only wrapper giving a backend the optional fused
 * MLP ops of backend.h (matmul_gelu_forward, matmul_backward_dgelu) as the
 * composition of its own separate ops, with a count of their calls. Every
 * value is then the separate ops' bit for bit, so a test can check, on a
 * machine without a GPU, that model.c takes the fused path when offered and
 * allowed (and only then) and wires its buffers as the unfused path does;
 * test_backend_cross also runs its fused-op checks on it. One base at a time
 * per binary (the ops reach it through a static). */
#ifndef KILN_FUSED_COMPOSE_H
#define KILN_FUSED_COMPOSE_H

#include "backend.h"

static const Backend *compose_base;
static long compose_calls_fwd, compose_calls_bwd;

static void compose_matmul_gelu_forward(void *out_gelu, void *pre, const void *inp, const void *w,
                                        const void *bias, int N, int C, int OC) {
    compose_calls_fwd++;
    compose_base->matmul_forward(pre, inp, w, bias, N, C, OC);
    compose_base->gelu_forward(out_gelu, pre, (size_t)N * OC);
}
static void compose_matmul_backward_dgelu(void *dinp, float *dw, float *dbias, const void *dout, const void *inp,
                                          const void *w, const void *pre, int N, int C, int OC, int accumulate) {
    compose_calls_bwd++;
    compose_base->matmul_backward(dinp, dw, dbias, dout, inp, w, N, C, OC, accumulate);
    /* in place: the CPU's and emu_bf16's gelu_backward read each element of
     * dout before writing it in dinp */
    compose_base->gelu_backward(dinp, pre, dinp, (size_t)N * C);
}

/* base's table plus the two fused ops; base must outlive the copy. */
static Backend compose_fused(const Backend *base) {
    compose_base = base;
    compose_calls_fwd = compose_calls_bwd = 0;
    Backend b = *base;
    b.matmul_gelu_forward = compose_matmul_gelu_forward;
    b.matmul_backward_dgelu = compose_matmul_backward_dgelu;
    return b;
}

#endif
