/* state: everything a checkpoint of a training run holds, gathered from the
 * model, optimizer, loader and step loop into one ckpt table; resuming it;
 * deciding when to save (checkpoint.every, the end, a signal, the Slurm
 * deadline). The step loop calls three functions; ckpt never sees these types. */
#ifndef KILN_STATE_H
#define KILN_STATE_H

#include <stdint.h>

#include "ckpt.h"
#include "comm.h"
#include "config.h"
#include "data.h"
#include "metrics.h"
#include "model.h"
#include "optim.h"
#include "util.h"

/* Where this rank sits: world rank and size, the dp group, the ZeRO stage;
 * g = the world group (NULL: one rank). AdamW's [lo, hi) says which optimizer
 * elements this rank holds. */
typedef struct StateMesh {
    int rank, world, dp, zero;
    int dp_rank, tp, tp_rank; /* each dp rank writes its share (ZeRO 0/1: of the arena; state.c);
                                 tensor parallelism: each tp rank its parts of the split tensors,
                                 tp rank 0 the replicated ones */
    int ep, edp_rank;  /* expert parallelism: the ep ranks' experts differ; each rank of an EDP
                          group (dp / ep ranks) writes its share of them (edp_rank = dp_rank
                          without ep) */
    CommGroup *g;
    const struct Ddp *pieces; /* the optimizer state is laid out by this Ddp's pieces
                                 (ddp_optim_pieces: ZeRO-2/3, ZeRO-1 under expert
                                 parallelism); NULL: as the arena range [lo, hi) */
    struct Ddp *units; /* ZeRO-2/3 over several ranks: the fp32 parameters and the
                          optimizer state live in its shard buffers, unit by
                          unit (ZeRO-2 also keeps the whole parameters in the
                          model's arena); NULL otherwise */
    struct Adafactor *adafactor; /* optim.name adafactor: its second moments (adafactor_state) */
    int cp;            /* context parallelism: dp above counts dp x cp (the ranks sharing the writes) */
    int pp, pp_rank;   /* pipeline parallelism: each stage writes its own layers; a tied
                          embedding's copy on the last stage (pp > 1) is the first stage's,
                          which writes it (0, 0: one stage) */
    int weights_unset; /* 1: the model's weights were not drawn (a resume fills them;
                          state_open draws them if it loads nothing) */
} StateMesh;

typedef struct RunState {
    const Config *c;
    Model *m;
    AdamW *o;
    DataLoader *train;
    const char *commit;
    StateMesh mesh;
    struct Metrics *mx;   /* set by the caller after metrics_open: messages go through it */
    CkptTable table;      /* what this rank loads on resume */
    CkptTable save_table; /* what this rank writes (replicated state: rank 0 only) */
    CkptOptions opts;
    CkptWriter *writer;
    char *config_text; /* resolved YAML, saved as the blob "config.yaml" */
    /* blobs, refreshed before each save */
    int64_t step, tokens, optim_t;
    double elapsed_s;
    uint64_t data_pos[2]; /* epoch, index: "data.train.pos", as kiln saved it before mixtures */
    uint64_t *data_state; /* (data_words) "data.train.state": the loader's whole position (data.h) */
    size_t data_words;
    Rng rng;              /* "rng.train" (rank 0), "rng.train/rankN": the loop's own stream (see state.c) */
    float *fp8_hist;      /* (model_fp8_history_len) "fp8.amax_history[/rankN]": delayed scaling's */
    int64_t *fp8_count;   /* (model_fp8_count_len) "fp8.amax_count[/rankN]": histories, NULL without */
    char resumed_msg[1600]; /* "resumed from ..." for the caller to print, "" if fresh */
    char resumed_path[1200]; /* the checkpoint resumed from, "" if fresh (summary.json) */
    CkptMesh resumed_mesh;   /* the layout that wrote it (0s where the manifest does not say) */
    int resharded;           /* the layout changed across the resume */
    char data_note[1600];   /* what a forced resume did with the data (data_set_state), "" if nothing */
    double elapsed_base, t_start; /* seconds before this process; kiln_now() at open */
    int64_t last_saved;   /* step of the newest checkpoint on disk, -1 none */
    int stop_reason;      /* signal number, or -1 for the Slurm deadline */
    /* the saves' figures, for metrics.jsonl (state_checkpoint_report) */
    double save_pause_s;  /* the step loop's pause for the newest save */
    int64_t save_step;    /* its step */
    int64_t done_step;    /* the newest save whose write was seen complete, -1 none */
    MetricsCkpt report;   /* its figures, until a line takes them */
    int report_ready;
    double resume_load_s; /* seconds the resume took to load and verify its checkpoint (0: fresh) */
    double resume_gb;     /* the bytes this rank loaded, 1e9 */
} RunState;

/* Collect the table, resume per `resume` (NULL = fresh, "auto", or a
 * directory), plan the writer, install the signal handlers. Returns the
 * number of steps already done (0 when fresh). */
int state_open(RunState *s, const Config *c, const StateMesh *mesh, const char *resume, int force, const char *commit,
               Model *m, AdamW *o, DataLoader *train);
/* After a step: `done` steps complete, `last` if it was the final one.
 * Saves when due; returns 1 when the run must stop now (signal or deadline;
 * the checkpoint is written), else 0. Exits 1 if a save fails. With several
 * ranks the stop flags are agreed (any rank's signal stops all at the same
 * step). A save enters the checkpoint phase of s->mx (only then). */
int state_after_step(RunState *s, int done, int last);
/* Wait for a write in flight (exit 1 if it failed), free. */
void state_close(RunState *s);
/* The figures of a save whose write completed since the last call (for
 * the next metrics.jsonl line), or NULL. */
const MetricsCkpt *state_checkpoint_report(RunState *s);
/* init.from naming a kiln checkpoint directory: load its parameters only
 * (and say so when `say`: rank 0). Returns 0 if `dir` is not a kiln
 * checkpoint (the caller tries llm.c). */
int state_init_from(Model *m, const char *dir, int say);
/* init.from, whatever it names: a kiln checkpoint directory, an HF
 * directory or .safetensors file (hf_init_from), else an llm.c file. */
void state_load_init_from(Model *m, const char *path, int say);
/* The entries a run without ZeRO-2/3 saves and loads for the model and
 * AdamW: every parameter (fp32 entries; precision.master bf16's widened
 * exactly on save, rounded to nearest even on load) and, unless o is NULL,
 * the moments of o's range [lo, hi). For state_open, init.from and tests. */
void state_table_add(CkptTable *t, Model *m, AdamW *o);

#endif
