/* ckpt_bench: `./train bench CONFIG --checkpoint` — checkpoint write, verify
 * and load rates of the config's model state next to a raw sequential write
 * and read of the same size in the same folder, in the same run. */
#ifndef KILN_CKPT_BENCH_H
#define KILN_CKPT_BENCH_H

#include "config.h"

typedef struct CkptBenchOptions {
    const char *dir; /* the folder measured; NULL = <run.dir>/bench_checkpoint */
    int reps;        /* repetitions, interleaved (raw, checkpoint, raw, ...) */
    int keep;        /* leave the last checkpoint in dir */
} CkptBenchOptions;

/* Print the bench lines (rank 0); every rank of an MPI launch writes and
 * reads its share of the state. */
int ckpt_bench_run(const Config *c, const CkptBenchOptions *o);

#endif
