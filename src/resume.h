/* resume: choosing the checkpoint a run continues from (--resume auto|DIR)
 * and deciding whether the new config may continue it. Loading itself is
 * ckpt's; what the table holds is train.c's. */
#ifndef KILN_RESUME_H
#define KILN_RESUME_H

#include <stddef.h>
#include <stdint.h>

#include "ckpt.h"

enum {
    RESUME_DATA_CHANGED = 1, /* data.train changed under --force: each source continues from its own position */
    RESUME_DIRTY = 2       /* a corrupt checkpoint was partly loaded before being skipped */
};

/* Compare the checkpoint's resolved config with this run's, key by key.
 * Allowed changes are printed (unless `quiet`: ranks other than 0, which see
 * the same changes); a forbidden one exits 2 naming the key, unless `force`
 * and the key is one where forcing is well defined (docs: README
 * "Checkpoints and resuming"). Returns RESUME_* flags. */
int resume_check_config(const char *ckpt_dir, const char *saved_yaml, const char *new_yaml, int force, int quiet);

/* Several ranks resuming together (NULL: one rank): agree(ctx, failed) is a
 * collective returning nonzero if any rank failed; bcast(ctx, buf, n) sends
 * rank 0's buffer to every rank. Rank 0 picks each candidate checkpoint and
 * every rank tries to load its part of it; one that fails anywhere is skipped
 * everywhere, so all ranks resume from the same step. */
typedef struct ResumeSync {
    int rank;
    int (*agree)(void *ctx, int failed);
    void (*bcast)(void *ctx, void *buf, size_t n);
    void *ctx;
} ResumeSync;

/* What a loaded checkpoint's values must satisfy (NULL: anything): after
 * each load, check(ctx, dir, state, words, err, cap) sees them in the
 * table's memory and the checkpoint's "data.train.state" (NULL when it has
 * none); nonzero, with one line in err naming the entry, rejects the
 * checkpoint as damaged: auto skips it, a directory exits 2. A checksum
 * proves the bytes are the ones written, not that they mean a state. */
typedef struct ResumeCheck {
    int (*check)(void *ctx, const char *dir, const uint64_t *state, size_t words, char *err, size_t cap);
    void *ctx;
} ResumeCheck;

/* mode "auto": the newest complete checkpoint under `root` whose checksums
 * verify, skipping (and naming) corrupt ones; none -> 0 (start fresh).
 * Otherwise mode is a checkpoint directory; any failure exits 2.
 * On success fills the table's memory, *info and path, and returns 1. */
int resume_load(const char *mode, const char *root, const CkptTable *t, const char *new_yaml, int force,
                CkptInfo *info, char *path, size_t cap, int *flags, const ResumeSync *sync, const ResumeCheck *check);

#endif
