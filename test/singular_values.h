/* singular_values.h: the singular values of a small float matrix in double,
 * for the Newton-Schulz band tests (test_optim.c on the CPU backend,
 * matmul_emu.cc on the CUDA backend's op under the emulation). Jacobi on the
 * smaller Gram matrix: plenty for matrices of a hundred rows. */
#ifndef KILN_TEST_SINGULAR_VALUES_H
#define KILN_TEST_SINGULAR_VALUES_H

#include <math.h>
#include <stdlib.h>

/* Singular values of x (r, c) in double: eigenvalues of the Gram matrix
 * x x^T (or x^T x, the smaller) by cyclic Jacobi rotations; sv (min(r, c)). */
static inline void singular_values(const float *x, int r, int c, double *sv) {
    int a = r < c ? r : c, tr = r > c;
    double *G = (double *)calloc((size_t)a * a, sizeof(double));
    for (int i = 0; i < a; i++)
        for (int j = 0; j < a; j++) {
            double acc = 0.0;
            for (int k = 0; k < (tr ? r : c); k++)
                acc += tr ? (double)x[(size_t)k * c + i] * x[(size_t)k * c + j]
                          : (double)x[(size_t)i * c + k] * x[(size_t)j * c + k];
            G[i * a + j] = acc;
        }
    for (int sweep = 0; sweep < 60; sweep++)
        for (int p = 0; p < a; p++)
            for (int q = p + 1; q < a; q++) {
                double apq = G[p * a + q];
                if (fabs(apq) < 1e-300) continue;
                double th = 0.5 * atan2(2 * apq, G[q * a + q] - G[p * a + p]), cs = cos(th), sn = sin(th);
                for (int k = 0; k < a; k++) { /* G <- J^T G J */
                    double gp = G[k * a + p], gq = G[k * a + q];
                    G[k * a + p] = cs * gp - sn * gq, G[k * a + q] = sn * gp + cs * gq;
                }
                for (int k = 0; k < a; k++) {
                    double gp = G[p * a + k], gq = G[q * a + k];
                    G[p * a + k] = cs * gp - sn * gq, G[q * a + k] = sn * gp + cs * gq;
                }
            }
    for (int i = 0; i < a; i++) sv[i] = sqrt(fmax(G[i * a + i], 0.0));
    free(G);
}

#endif
