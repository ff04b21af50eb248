/* prom: the run as a Prometheus text-format file (exposition format 0.0.4,
 * with HELP and TYPE lines) for node-exporter's textfile collector. Formats
 * the numbers it is handed and replaces the file atomically; never reads
 * the run. Metric names and meanings: docs/metrics.md "Prometheus". */
#ifndef KILN_PROM_H
#define KILN_PROM_H

#include <stddef.h>

#define PROM_PHASES 16

/* One snapshot. NAN (or -1 for the ints marked so) leaves a metric out. */
typedef struct PromSnapshot {
    const char *run;             /* run.name: the `run` label of every sample */
    int running;                 /* 1 while training; 0 once it ended */
    int exit_code;               /* when running == 0 */
    int step, steps;             /* completed, planned */
    double tokens;
    double loss, val_loss;       /* the last step's; the last evaluation's */
    double tok_per_s, mfu, step_s;
    double start_unix;           /* when this process started the run */
    double progress_unix;        /* Unix time of the last progress (any phase change) */
    double since_progress_s;     /* seconds from then to this snapshot */
    int nphase;
    const char *phase_name[PROM_PHASES];
    double phase_s[PROM_PHASES]; /* seconds spent in each phase by this process */
    double ckpt_age_s;           /* since the newest complete checkpoint was written */
    int ckpt_step;               /* its step (-1: none) */
    int world;
    int slowest_rank;            /* -1: one rank, or not gathered yet */
    double slowest_factor;
    int nonfinite_skipped;
} PromSnapshot;

/* The file's text (malloc'd, NUL-terminated; *len its length). */
char *prom_text(const PromSnapshot *s, size_t *len);
/* Write it to path through path.tmp and a rename (a reader, node-exporter
 * included, sees the old file or the new one; .tmp is not *.prom, so the
 * collector never reads the half-written one). 0, or -1 on an I/O error. */
int prom_write(const char *path, const PromSnapshot *s);

#endif
