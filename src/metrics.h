/* metrics: what a run tells the people watching it. Owns the progress line (a
 * live bar on a terminal), RUN_DIR/metrics.jsonl, TensorBoard event files, the
 * per-rank log, warnings, the heartbeat file and the watchdog thread. Reads
 * numbers the step loop hands it; never touches the model, data or backend.
 *
 * Schema of every file written here: docs/metrics.md. */
#ifndef KILN_METRICS_H
#define KILN_METRICS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "config.h"

/* What a rank is doing, for the heartbeat and the watchdog. */
typedef enum {
    PHASE_INIT,
    PHASE_DATA,
    PHASE_FORWARD,
    PHASE_BACKWARD,
    PHASE_SYNC,
    PHASE_OPTIMIZER,
    PHASE_EVAL,
    PHASE_SAMPLE,
    PHASE_CHECKPOINT,
    PHASE_DONE,
    PHASE_COUNT
} MetricsPhase;

const char *metrics_phase_name(MetricsPhase p);

#define METRICS_COMM_GROUPS 4 /* process groups a step reports blocked time for */

/* One optimizer step as the loop saw it. */
typedef struct MetricsStep {
    int step;            /* 1-based, steps completed */
    int64_t tokens;      /* tokens seen so far, all ranks */
    float loss;          /* mean training loss of the step */
    float val_loss;      /* NAN when not evaluated at this step */
    float lr;
    double grad_norm;    /* before clipping */
    float grad_scale;    /* clipping factor (1 = none) */
    double step_time_s;  /* forward + backward + optimizer, excluding eval and samples */
    int skipped;         /* 1: non-finite loss or gradient, no update made */
    uint64_t param_hash; /* test hook only (0 = absent): FNV-1a of the parameters */
    double device_mib;   /* peak device memory since start, MiB (0 = the backend has none: CPU) */
    const struct MetricsMoe *moe; /* MoE models: the router's figures; NULL otherwise */
    /* seconds this rank was blocked in each process group's collectives in
     * the step ("dp": ddp_step_blocked_s); comm_group NULL past the last */
    const char *comm_group[METRICS_COMM_GROUPS];
    double comm_s[METRICS_COMM_GROUPS];
    const struct MetricsData *data; /* the step's data figures; NULL: none */
    /* pipeline parallelism (0 or NAN without): the stages' time idle waiting
     * for a neighbour over their step time, and the schedule's own bubble */
    double pp_bubble, pp_bubble_theory;
    const struct MetricsEp *ep;     /* expert parallelism's figures; NULL: ep 1 */
    const struct MetricsCkpt *ckpt; /* a checkpoint whose write completed since the last line; NULL: none */
    double resume_s;     /* the first step of a resumed run: seconds from process start to its start; 0 otherwise */
} MetricsStep;

/* Expert parallelism (parallel.ep > 1), the step's exchanges of routed token
 * rows summed over MoE layers and micro-batches, per world rank: rows sent
 * to other ranks' experts, received from other ranks, and run by the rank's
 * own experts (its load); and the load imbalance over the ranks, the
 * largest load over the mean. */
typedef struct MetricsEp {
    int world;
    const double *sent, *recv, *rows; /* (world) */
    double imbalance;
} MetricsEp;

/* A checkpoint, once its write is done: this rank's figures. */
typedef struct MetricsCkpt {
    int64_t step;   /* the step it holds */
    double pause_s; /* the step loop's pause for it (async: the staging copy, after any wait for the write before) */
    double write_s; /* its write: this rank's file on disk and the checkpoint complete */
    double gb;      /* bytes of this rank's file, 1e9 */
} MetricsCkpt;

/* A step's data: the wait for batches, tokens drawn from each source of
 * data.train so far, and each named validation set's loss. */
typedef struct MetricsData {
    double wait_s;                   /* seconds this rank waited for batches in the step */
    int n_sources;
    const char *const *source_names; /* (n_sources) */
    const uint64_t *source_tokens;   /* (n_sources) all ranks */
    int n_val;                       /* named sets (data.val a list); 0 for a plain glob (val_loss alone) */
    const char *const *val_names;    /* (n_val) */
    const float *val_losses;         /* (n_val) NAN when not evaluated at this step */
} MetricsData;

/* One step of an MoE model: losses of the step's last micro-batch (summed
 * over layers), slots dropped by capacity, and the loads (slots routed to
 * each expert, all micro-batches and ranks) of every layer. */
typedef struct MetricsMoe {
    double aux, z, dropped;     /* dropped: fraction of routed slots */
    double load_min, load_max, load_cv; /* over every (layer, expert) */
    int n_layer, n_experts;
    const int64_t *load;        /* (n_layer, n_experts) */
} MetricsMoe;

typedef struct Metrics Metrics;

/* Open the run's metric files under c->run_dir for `rank` (of `world`;
 * collective over the world when world > 1: ranks share their host names).
 * flops_per_token: training FLOPs per token (arch_flops_per_token);
 * peak_flops: one device's peak FLOP/s (0 = MFU not reported); peak_source
 * says where it came from ("measured sgemm", "table: H100 SXM bf16", "config").
 * start_step > 0 (resume): metrics.jsonl keeps its lines up to that step and
 * is appended to. Starts the watchdog when monitor.stall_timeout_s > 0. */
/* The hardware FLOPs a token costs (model_hw_flops_per_token): where
 * recomputation makes them more than the model FLOPs, metrics.jsonl's lines
 * carry "hfu", their utilisation of the peak, beside "mfu". */
void metrics_set_hw_flops(Metrics *m, double flops_per_token);
Metrics *metrics_open(const Config *c, int rank, int world, double flops_per_token, double peak_flops,
                      const char *peak_source, int start_step);
/* Stop the watchdog, heartbeat phase "done"; rank 0 writes RUN_DIR/summary.json,
 * the last Prometheus snapshot and ends the MLflow run (status from
 * metrics_end, else "completed"); flush and close. */
void metrics_close(Metrics *m);
/* How the run ends, for summary.json, MLflow and Prometheus: exit code and a
 * one-line reason ("completed", "stopped by SIGTERM after step 40 ..."). A
 * kiln_fail after metrics_open records its own code and message. */
void metrics_end(Metrics *m, int exit_code, const char *reason);
/* The build's commit, for summary.json and the MLflow run's tags. */
void metrics_set_commit(Metrics *m, const char *commit);
/* The run's layout, for summary.json's "layout" (what tests and scripts
 * read instead of the start-up lines): ranks per dimension, ZeRO stage and
 * this rank's (rank 0's) buffer sizes in floats. */
typedef struct MetricsLayout {
    int world, pp, dp, cp, tp, ep, zero;
    size_t param_floats;  /* parameters held by this rank (its tp part, stage, experts) */
    size_t grad_floats;   /* its gradient buffers (ddp_grad_floats) */
    size_t optim_floats;  /* elements of the optimizer state it updates */
} MetricsLayout;
void metrics_set_layout(Metrics *m, const MetricsLayout *l);
/* A resumed run's origin, for summary.json's "resumed": the checkpoint, its
 * step and tokens, and the layout it was written by (pp, dp, tp, ep; 0 where
 * the checkpoint does not say); resharded: the layout changed. */
typedef struct MetricsResumed {
    char checkpoint[1200];
    long long step, tokens;
    int world, pp, dp, tp, ep, resharded;
} MetricsResumed;
void metrics_set_resumed(Metrics *m, const MetricsResumed *r);

/* Record one step: metrics.jsonl, TensorBoard, the progress line or bar (rank
 * 0; a full line every log_every steps, at evaluations and at the end),
 * warnings (loss spike, non-finite gradient norm, slow step, straggler), the
 * heartbeat, MLflow, Prometheus. Collective over the world when world > 1
 * (every rank calls it for every step): at steps that are multiples of
 * log_every, and the last, every rank's timings are gathered to rank 0
 * (ranks.jsonl, docs/metrics.md "Stragglers"). */
void metrics_step(Metrics *m, const MetricsStep *s);

/* The rank enters `phase` of step `step` (1-based: the step being computed).
 * Cheap: an atomic store and, at most about once a second within a step, a
 * heartbeat rewrite. Progress for the watchdog is any phase change. */
void metrics_phase(Metrics *m, MetricsPhase phase, int step);

/* A line for stdout (rank 0) and the rank's log, clearing the live bar first. */
void metrics_print(Metrics *m, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* "warning: step N: ..." on stderr and in the rank's log. */
void metrics_warn(Metrics *m, int step, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* "kiln: error: ..." on stderr and in the rank's log, then exit with `code`. */
void metrics_fail(Metrics *m, int code, const char *fmt, ...) __attribute__((noreturn, format(printf, 3, 4)));
/* Clear the live bar before something else writes to stdout (samples). */
void metrics_bar_clear(Metrics *m);

/* Steps skipped so far for non-finite values (train.on_nonfinite: skip). */
int metrics_skipped(const Metrics *m);

/* ---- peak FLOP/s ---- */

/* Peak dense FLOP/s of a GPU named in `device_desc` (substring match on names
 * like "H100", "A100") for compute dtype "bf16" or "fp32"; 0 if not in the
 * table. *name receives the table row's name. */
double metrics_peak_lookup(const char *device_desc, const char *dtype, const char **name);
/* Measured fp32 matrix-product rate of the backend in FLOP/s, within about
 * `budget_s` seconds, at a GPT-2-small-sized product. */
struct Backend;
double metrics_measure_matmul(const struct Backend *be, double budget_s);

/* ---- pieces exposed for tests and for report/status ---- */

/* CRC32C (Castagnoli) and TensorFlow's masked form used by TFRecord. */
uint32_t metrics_crc32c(const void *data, size_t n);
uint32_t metrics_crc32c_masked(const void *data, size_t n);
/* Encode one Event with scalar values into buf (returns bytes; cap >= 64 +
 * sum of tag lengths + 16 per value). file_version != NULL: the first event. */
size_t metrics_tb_encode(uint8_t *buf, size_t cap, double wall_time, int64_t step, const char *file_version,
                         int n, const char *const *tags, const float *values);
/* Frame a record: uint64 length, masked CRC of the length, data, masked CRC of data. */
void metrics_tb_write_record(FILE *f, const uint8_t *data, size_t n);

/* Peak resident set size of this process, MiB. */
double metrics_peak_rss_mib(void);
/* Note the resident set now (VmRSS) as the baseline that rss_base_mib logs:
 * the trainer calls it before the model allocates, so peak_rss_mib minus it
 * is what `./train plan` predicts (docs/planner.md "Memory model"). */
void metrics_mark_rss_base(void);
double metrics_rss_base_mib(void);

#endif
