/* bench: step throughput vs the backend's matmul rate, side by side. */
#ifndef KILN_BENCH_H
#define KILN_BENCH_H

#include "config.h"

/* Time `steps` optimizer steps (after one warm-up) on random tokens and the
 * backend's matmul rate at the model's shapes; print the bench lines. */
int bench_run(const Config *c, int steps);

#endif
