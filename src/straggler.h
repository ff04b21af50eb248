/* straggler: which rank is slowing a multi-rank job down. At each logged step
 * every rank hands in its own timings; one all-gather over the world gives
 * rank 0 everyone's, and rank 0 ranks them and says when one rank stays slow.
 * Knows comm; never the model, the data or the files metrics.c writes. */
#ifndef KILN_STRAGGLER_H
#define KILN_STRAGGLER_H

#include "comm.h"

#define STRAGGLER_GROUPS 4 /* process groups a rank reports blocked time for ("dp", "tp", ...) */

/* One rank's timings, seconds per step (means since the last logged step),
 * and its peak memory, which ranks.jsonl carries alongside. */
typedef struct StragglerSample {
    double step_s;                   /* wall time of the step (evaluation excluded) */
    double data_s;                   /* in the data phase: waiting for batches */
    double comm_s[STRAGGLER_GROUPS]; /* blocked in each group's collectives */
    double device_mib;               /* peak device memory so far, MiB (0: the backend has no figure) */
    double rss_mib, rss_base_mib;    /* peak resident memory so far and before the model (metrics_mark_rss_base), MiB */
} StragglerSample;

/* min, median, max over the ranks, and the rank holding the max. */
typedef struct StragglerSpread {
    double min, median, max;
    int argmax;
} StragglerSpread;

/* What rank 0 knows after a gather. Busy time = step time minus time blocked
 * in communication: in a synchronous job every rank's step takes as long as
 * the slowest one's, and only busy time tells who made the others wait. */
typedef struct StragglerStats {
    int world;
    const StragglerSample *rank; /* [world] */
    const double *busy;          /* [world] busy seconds per step */
    const double *compute;       /* [world] busy minus data wait */
    StragglerSpread step, data, compute_s, busy_s, comm[STRAGGLER_GROUPS];
    int slowest;                 /* the rank with the most busy time */
    double factor;               /* its busy time / the median of the other ranks' */
    int slow;                    /* 1: this gather finds it slow (factor and excess over the thresholds) */
    int streak;                  /* logged steps in a row the same rank was slow */
    int warn;                    /* 1: the streak just reached the threshold: warn now (once per streak) */
} StragglerStats;

typedef struct Straggler Straggler;

/* Collective over g (NULL or size 1: this process alone): shares host names.
 * factor: a rank is slow when its busy time exceeds factor times the other
 * ranks' median (0: never) and by more than min_excess_s; persist: slow
 * logged steps in a row before the warning. */
Straggler *straggler_open(CommGroup *g, const char *host, double factor, double min_excess_s, int persist);
/* The same without a group, for `world` ranks whose samples the caller
 * hands to straggler_feed (tests); hosts are "?". */
Straggler *straggler_new(int world, double factor, double min_excess_s, int persist);
void straggler_close(Straggler *s);
/* Collective over g: everyone's sample to everyone; returns rank 0's view
 * (valid until the next call), NULL on other ranks. */
const StragglerStats *straggler_gather(Straggler *s, const StragglerSample *mine);
/* Rank 0's half of straggler_gather with every rank's sample given
 * (all[straggler_world()]). */
const StragglerStats *straggler_feed(Straggler *s, const StragglerSample *all);
int straggler_world(const Straggler *s);
/* Host of world rank r, as that rank named it. */
const char *straggler_host(const Straggler *s, int r);
/* Ranks that were ever warned about, in the order warned; returns the count. */
int straggler_warned(const Straggler *s, const int **ranks);

#endif
