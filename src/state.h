/* state: everything a checkpoint of a training run holds, gathered from the
 * model, optimizer, loader and step loop into one ckpt table; resuming it;
 * deciding when to save (checkpoint.every, the end, a signal, the Slurm
 * deadline). The step loop calls three functions; ckpt never sees these types. */
#ifndef KILN_STATE_H
#define KILN_STATE_H

#include <stdint.h>

#include "ckpt.h"
#include "config.h"
#include "data.h"
#include "model.h"
#include "optim.h"
#include "util.h"

typedef struct RunState {
    const Config *c;
    Model *m;
    AdamW *o;
    DataLoader *train;
    const char *commit;
    CkptTable table;
    CkptOptions opts;
    CkptWriter *writer;
    char *config_text; /* resolved YAML, saved as the blob "config.yaml" */
    /* blobs, refreshed before each save */
    int64_t step, tokens, optim_t;
    double elapsed_s;
    uint64_t data_pos[2]; /* epoch, index */
    Rng rng;              /* "rng.train": the loop's own stream (see state.c) */
    double elapsed_base, t_start; /* seconds before this process; kiln_now() at open */
    int64_t last_saved;   /* step of the newest checkpoint on disk, -1 none */
    int stop_reason;      /* signal number, or -1 for the Slurm deadline */
} RunState;

/* Collect the table, resume per `resume` (NULL = fresh, "auto", or a
 * directory), plan the writer, install the signal handlers. Returns the
 * number of steps already done (0 when fresh). */
int state_open(RunState *s, const Config *c, const char *resume, int force, const char *commit, Model *m, AdamW *o,
               DataLoader *train);
/* After a step: `done` steps complete, `last` if it was the final one.
 * Saves when due; returns 1 when the run must stop now (signal or deadline;
 * the checkpoint is written), else 0. Exits 1 if a save fails. */
int state_after_step(RunState *s, int done, int last);
/* Wait for a write in flight (exit 1 if it failed), free. */
void state_close(RunState *s);
/* init.from naming a kiln checkpoint directory: load its parameters only.
 * Returns 0 if `dir` is not a kiln checkpoint (the caller tries llm.c). */
int state_init_from(Model *m, const char *dir);

#endif
