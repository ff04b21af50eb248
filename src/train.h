/* train: run one training job from a resolved Config. */
#ifndef KILN_TRAIN_H
#define KILN_TRAIN_H

#include "config.h"

/* Train (or, with dry_run, print the plan). Returns an exit code. */
int train_run(const Config *c, int dry_run);

#endif
