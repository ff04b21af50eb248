/* optim: learning-rate schedules, global-norm clipping and the elementwise
 * optimizers (AdamW, Lion) over the model's parameter arena. Owns the
 * optimizer state arenas (m, v). Never reads data or knows the model's
 * architecture: it sees flat arenas and the split point between decayed and
 * undecayed parameters. docs/optimizers.md. */
#ifndef KILN_OPTIM_H
#define KILN_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"

typedef enum { SCHED_CONSTANT, SCHED_LINEAR, SCHED_COSINE, SCHED_WSD } SchedKind;

typedef struct Schedule {
    SchedKind kind;
    float lr;           /* peak */
    int warmup_steps;   /* linear warmup from lr/warmup to lr */
    int steps;          /* total optimizer steps */
    float min_lr_ratio; /* floor = lr * min_lr_ratio */
    float decay_ratio;  /* wsd: fraction of steps in the final linear decay */
} Schedule;

/* "cosine" | "linear" | "constant" | "wsd" -> kind; -1 if unknown. */
int optim_sched_kind(const char *name);
/* Learning rate for optimizer step `step` (0-based). */
float optim_lr(const Schedule *s, int step);

/* optim.name */
typedef enum { OPTIM_ADAMW, OPTIM_LION, OPTIM_MUON, OPTIM_ADAFACTOR } OptimKind;

/* Muon: one logical matrix of the arena, row-major at element `off`. Under
 * tensor parallelism rows x cols is this rank's part of a grows x gcols
 * matrix (muon.c gathers the parts); otherwise the two shapes are equal. */
typedef struct OptimMatrix {
    size_t off;
    int rows, cols;
    int grows, gcols;
    int tp_dim;   /* how the global matrix splits over tp ranks: -1 not (each holds all of it), */
    int tp_parts; /* 0 rows, 1 columns; in tp_parts equal blocks, each split over the ranks */
    float scale;  /* optim.muon_scale's factor for the global shape */
    int decay;    /* weight decay applies */
    int tensor;   /* the caller's tag: its row of the model's tensor table (checkpoint names) */
    size_t toff;  /* where it starts in that tensor (GPT-2's k third: rows * cols) */
    int owner;    /* who orthogonalises it, as optim_muon_own numbers them (optim_set_muon: 0, every
                     matrix local; muon.c: 1 on its owner, 0 elsewhere) */
    size_t mom;   /* where its momentum starts in its owner's AdamW.mm (owners' matrices back to back) */
} OptimMatrix;

/* The optimizer of the arena: AdamW unless optim_set_lion made it Lion (the
 * struct keeps its historical name). */
typedef struct AdamW {
    const Backend *be;
    OptimKind kind;
    void *m, *v;       /* device (hi - lo) state_bytes each: moments of arena elements [lo, hi),
                          fp32 or bf16 bits (precision.optim_state); Lion: m only, v NULL */
    size_t state_bytes;/* 4 (fp32 moments) or 2 (bf16, stochastically rounded: sround.h) */
    uint64_t seed;     /* bf16 moments and parameters: the rounding's random bits come from (seed, t, element) */
    size_t param_bytes;/* 4 (fp32 master) or 2 (precision.master bf16: the step functions' params are bf16
                          bits, stored back with stochastic rounding: backend.h adamw_update_p16) */
    size_t n;          /* parameters (the whole arena) */
    size_t n_decay;    /* [0, n_decay) get weight decay */
    size_t lo, hi;     /* the elements this rank updates: [0, n), or its ZeRO shard */
    float beta1, beta2, eps, weight_decay, grad_clip;
    int t;             /* optimizer steps taken */
    /* Muon (optim_set_muon): these matrices get Muon, every other element
     * AdamW (m and v stay unused over the matrices' elements) */
    OptimMatrix *mats; /* host (nmat), by offset */
    int nmat, ns_steps;
    float momentum;
    float *mm;         /* device (mm_len): the momentum of the matrices this rank owns, back to back */
    size_t mm_len;
    int muon_dist;     /* 1 once muon.c took the matrices over (muon_dist_init): the step functions
                          then update the AdamW elements only */
    int muon_rank;     /* this rank's place among the owners (0 until optim_muon_own) */
    float *u, *ns_work;/* device: the largest matrix's Nesterov update; newton_schulz's work */
    void *copy;        /* device (n) act, or NULL: the compute copy the updates write (optim_set_copy) */
    StepScalars *st;   /* device: the step's scalars (optim_step_device), made at first use */
    const StepScalars *st_now; /* what the updates read in optim_step_device's update, else NULL */
} AdamW;

typedef struct OptimStepInfo {
    double grad_norm;  /* global L2 norm before clipping */
    float grad_scale;  /* factor applied by clipping (1 = none) */
    int nonfinite;     /* gradient had NaN/Inf: no update was made */
} OptimStepInfo;

void optim_init(AdamW *o, const Backend *be, size_t n, size_t n_decay, float beta1, float beta2, float eps,
                float weight_decay, float grad_clip);
/* ZeRO-1: state and updates for arena elements [lo, hi) only (ZeRO-2/3:
 * [0, shard_len) of the shard buffers, with optim_step_segments). */
void optim_init_shard(AdamW *o, const Backend *be, size_t n, size_t n_decay, size_t lo, size_t hi, float beta1,
                      float beta2, float eps, float weight_decay, float grad_clip);
/* The same with the moments stored as bf16 when state_bf16 is nonzero
 * (precision.optim_state: bf16), their stochastic rounding drawn from seed. */
void optim_init_shard_dtype(AdamW *o, const Backend *be, size_t n, size_t n_decay, size_t lo, size_t hi,
                            float beta1, float beta2, float eps, float weight_decay, float grad_clip,
                            int state_bf16, uint64_t seed);
/* precision.master bf16: from now on the step functions take the parameters
 * as bf16 bits (uint16_t, the model's param16) and round their update
 * stochastically from o->seed; before the first step. */
void optim_set_params_bf16(AdamW *o);
/* The rounding seed of a run with run.seed `run_seed`: one on every rank (the
 * bits follow the arena element, not the rank), apart from the other streams
 * drawn from run.seed. train.c and bench.c both use it. */
static inline uint64_t optim_round_seed(uint64_t run_seed) { return run_seed ^ 0x6f7074696d2e7372ULL; }
/* Lion instead of AdamW, with its own betas (optim.lion_betas); before the
 * first step, fp32 state and parameters only. Frees v: Lion keeps m alone. */
void optim_set_lion(AdamW *o, float beta1, float beta2);
/* Adafactor instead of AdamW (adafactor.c runs its step): beta1 > 0 keeps
 * a first moment in m, else m is freed too; v is freed (adafactor.c keeps
 * the second moments). Before the first step, fp32 state and parameters. */
void optim_set_adafactor(AdamW *o, float beta1);
/* The start of a step that adafactor.c (or another caller) runs itself:
 * the norm check, clipping's factor and the step count. */
OptimStepInfo optim_step_begin(AdamW *o, double grad_norm);
/* Muon on `mats` (copied; disjoint, inside [0, n)), AdamW with the
 * settings given at init on the rest; before the first step, fp32 state and
 * parameters. Every matrix is owned here (owner 0) with its momentum in mm,
 * and optim_step does the whole step, which needs the whole arena (lo 0, hi
 * n); muon.c distributes it over dp ranks instead (optim_muon_own). */
void optim_set_muon(AdamW *o, const OptimMatrix *mats, int nmat, float momentum, int ns_steps);
/* muon.c: matrix k (optim's order) is owned by owner[k]; this rank (`rank`)
 * keeps the momentum of its own matrices only (mm reallocated, zero), and
 * the step functions leave every matrix to muon.c from now on. Before the
 * first step. */
void optim_muon_own(AdamW *o, const int *owner, int rank);
/* On matrix k's owner: the momentum from its gradient g (rows * cols of
 * the matrix as muon.c assembled it, clipped by grad_scale) and the
 * Nesterov look-ahead into out (the same size). */
void optim_muon_momentum(AdamW *o, int k, const float *g, float grad_scale, float *out);
/* x (rows, cols) in place: the quintic Newton-Schulz of optim.ns_steps. */
void optim_muon_orthogonalise(AdamW *o, float *x, int rows, int cols);
/* Matrix k's step on n of its elements: params -= lr (scale O + wd params). */
void optim_muon_apply(const AdamW *o, int k, float *params, const float *O, size_t n, float lr);
/* 1 if matrix k's momentum lives on this rank (it owns the matrix). */
int optim_muon_owned(const AdamW *o, int k);
/* 1 if arena element `off` lies in a Muon matrix. */
int optim_muon_covers(const AdamW *o, size_t off);
/* Zero every state buffer and the step count (a fresh start after a
 * partial load). */
void optim_zero_state(AdamW *o);
/* optim.muon_scale for a (rows, cols) matrix: "spectral" sqrt(max(1,
 * rows/cols)), "match_adamw" 0.2 sqrt(max(rows, cols)); -1 if unknown. */
float optim_muon_scale(const char *kind, int rows, int cols);
/* 1 if a 2-D trained tensor of this ArchRole gets Muon (train.c picks its
 * matrices by it; the planner counts their buffers by it). */
int optim_muon_role(int role);
/* Floats of Newton-Schulz work for a rows x cols matrix (backend.h
 * newton_schulz); optim_set_muon allocates the largest, as the planner counts. */
size_t optim_muon_work_floats(int rows, int cols);
/* "adamw" | "lion" | "muon" | "adafactor" -> kind; -1 if unknown. */
int optim_kind(const char *name);
void optim_free(AdamW *o);
/* "fp32" -> 4, "bf16" -> 2 (precision.optim_state); 0 if unknown. */
size_t optim_state_bytes(const char *name);

/* One step: norm of grads, clip, update params in place with `lr`. A
 * non-finite gradient norm leaves params and state untouched. params: the
 * arena, param_bytes per element (fp32, or bf16 bits: optim_set_params_bf16). */
OptimStepInfo optim_step(AdamW *o, void *params, const float *grads, float lr);
/* The same with the global gradient norm computed by the caller (data
 * parallelism: from every rank's shard). params and grads point at arena
 * element o->lo (grads may be a shard buffer); hi - lo elements are updated,
 * the weight-decay boundary clipped into the range. */
OptimStepInfo optim_step_norm(AdamW *o, void *params, const float *grads, float lr, double grad_norm);

/* The compute copy of the arena (act, the arena's layout: model.h
 * model_compute_copy) for the updates to write in their own pass, so no
 * separate cast reads the master after a step. Taken only where each step
 * updates every element of the arena here and nothing changes the
 * parameters after it: AdamW or Lion on fp32 parameters over the whole
 * arena ([lo, hi) = [0, n)), optim_step and optim_step_norm (segments
 * refuse it). Returns 1 if taken; 0 (or copy NULL) leaves the caller to
 * mark the copy stale after each step, as before. */
int optim_set_copy(AdamW *o, void *copy);

/* The step's scalars on the device (backend.h StepScalars), zero, made at
 * the first call: model_set_loss_sink points the model at its loss. */
StepScalars *optim_scalars(AdamW *o);

/* One step of a rank that needs no collective for its norm, with no host
 * wait before the update: the sum of squares of grads over the whole arena
 * (as optim_step), the step's scalars derived on the device from it and
 * from the losses of `micro` micro-batches the model added to them, the
 * update reading the clipping factor and the skip flag there; then the
 * step's one host wait, a read of the scalars, for the returned info and
 * *loss (the step's mean loss, NaN-checked like the norm). A skipped step
 * takes back its step count; the scalars are zero again afterwards. AdamW
 * or Lion over the whole arena (lo 0, hi n). */
OptimStepInfo optim_step_device(AdamW *o, void *params, const float *grads, float lr, int micro, float *loss);

/* ZeRO-2/3: a run of `n` elements at `off` of the shard buffers (params, grads,
 * m and v alike), all weight-decayed or all not. `at`: where the run's
 * params and grads are, from the pointers optim_step_segments gets (ZeRO-2/3:
 * the shard buffers, at = off; ZeRO-1 under expert parallelism: the model's
 * arena, whose dense and expert blocks sit apart while their state lies
 * back to back). */
typedef struct OptimSegment {
    size_t off, n;
    int decay;
    size_t at;
    size_t arena; /* the arena element at off (Muon leaves its matrices' segments out) */
} OptimSegment;
/* One step over the segments (the optimizer state holds the whole shard:
 * optim_init_shard(..., 0, shard_len)), with the caller's global norm. */
OptimStepInfo optim_step_segments(AdamW *o, void *params, const float *grads, const OptimSegment *seg, int nseg,
                                  float lr, double grad_norm);

#endif
