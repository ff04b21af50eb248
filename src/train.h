/* train: run one training job from a resolved Config. */
#ifndef KILN_TRAIN_H
#define KILN_TRAIN_H

#include "config.h"

/* Train (or, with dry_run, print the plan). Returns an exit code. */
int train_run(const Config *c, int dry_run);

typedef struct TrainOptions {
    int dry_run;
    const char *resume; /* NULL: fresh; "auto": newest valid checkpoint or fresh; else a checkpoint dir */
    int force;          /* --force: accept config changes where that is well defined */
    const char *commit; /* recorded in checkpoints */
} TrainOptions;
int train_run_with(const Config *c, const TrainOptions *o);

#endif
