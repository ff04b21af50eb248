/* straggler: gathering every rank's step timings and finding the slow one.
 * One all-gather of (3 + STRAGGLER_GROUPS) doubles per rank per logged step;
 * the judgement is rank 0's, on plain arrays, so tests can feed it directly. */
#include "straggler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

#define HOST_LEN 64

struct Straggler {
    CommGroup *g;
    int world, rank;
    char *hosts;            /* [world][HOST_LEN] */
    double factor, min_excess;
    int persist;
    StragglerSample *all;   /* [world] */
    double *busy, *compute, *col, *tmp; /* [world]: col one field of every rank, tmp for sorting */
    StragglerStats st;
    int streak_rank, streak;
    int *warned, nwarned;   /* [world] */
};

Straggler *straggler_new(int world, double factor, double min_excess_s, int persist) {
    Straggler *s = xcalloc(1, sizeof *s);
    s->world = world > 0 ? world : 1;
    s->factor = factor, s->min_excess = min_excess_s, s->persist = persist > 0 ? persist : 1;
    s->hosts = xcalloc((size_t)s->world, HOST_LEN);
    for (int r = 0; r < s->world; r++) kiln_strlcpy(s->hosts + (size_t)r * HOST_LEN, "?", HOST_LEN);
    s->all = xcalloc((size_t)s->world, sizeof *s->all);
    s->busy = xcalloc((size_t)s->world, sizeof(double));
    s->compute = xcalloc((size_t)s->world, sizeof(double));
    s->col = xcalloc((size_t)s->world, sizeof(double));
    s->tmp = xcalloc((size_t)s->world, sizeof(double));
    s->warned = xcalloc((size_t)s->world, sizeof(int));
    s->streak_rank = -1;
    return s;
}

Straggler *straggler_open(CommGroup *g, const char *host, double factor, double min_excess_s, int persist) {
    CommGroup *grp = g && g->size > 1 ? g : NULL;
    Straggler *s = straggler_new(grp ? grp->size : 1, factor, min_excess_s, persist);
    s->g = grp;
    s->rank = grp ? grp->rank : 0;
    char mine[HOST_LEN] = {0};
    kiln_strlcpy(mine, host ? host : "?", sizeof mine);
    if (grp) comm_all_gather_bytes(grp, mine, s->hosts, HOST_LEN);
    else memcpy(s->hosts, mine, HOST_LEN);
    return s;
}

void straggler_close(Straggler *s) {
    if (!s) return;
    free(s->hosts), free(s->all), free(s->busy), free(s->compute), free(s->col), free(s->tmp), free(s->warned);
    free(s);
}

int straggler_world(const Straggler *s) { return s->world; }

const char *straggler_host(const Straggler *s, int r) {
    return r >= 0 && r < s->world ? s->hosts + (size_t)r * HOST_LEN : "?";
}

int straggler_warned(const Straggler *s, const int **ranks) {
    *ranks = s->warned;
    return s->nwarned;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of v[0..n) leaving out index skip (-1: none), sorted in tmp. */
static double median_without(const double *v, int n, int skip, double *tmp) {
    int m = 0;
    for (int i = 0; i < n; i++)
        if (i != skip) tmp[m++] = v[i];
    if (m == 0) return NAN;
    qsort(tmp, (size_t)m, sizeof(double), cmp_double);
    return m % 2 ? tmp[m / 2] : 0.5 * (tmp[m / 2 - 1] + tmp[m / 2]);
}

static StragglerSpread spread(const double *v, int n, double *tmp) {
    StragglerSpread r = {v[0], 0, v[0], 0};
    for (int i = 1; i < n; i++) {
        if (v[i] < r.min) r.min = v[i];
        if (v[i] > r.max) r.max = v[i], r.argmax = i;
    }
    r.median = median_without(v, n, -1, tmp);
    return r;
}

const StragglerStats *straggler_feed(Straggler *s, const StragglerSample *all) {
    int n = s->world;
    if (all != s->all) memcpy(s->all, all, (size_t)n * sizeof *all);
    StragglerStats *st = &s->st;
    memset(st, 0, sizeof *st);
    st->world = n, st->rank = s->all, st->busy = s->busy, st->compute = s->compute;
    for (int r = 0; r < n; r++) {
        const StragglerSample *x = &s->all[r];
        double comm = 0;
        for (int k = 0; k < STRAGGLER_GROUPS; k++) comm += x->comm_s[k];
        s->busy[r] = fmax(x->step_s - comm, 0.0);
        s->compute[r] = fmax(s->busy[r] - x->data_s, 0.0);
    }
    double *col = s->col;
    for (int r = 0; r < n; r++) col[r] = s->all[r].step_s;
    st->step = spread(col, n, s->tmp);
    for (int r = 0; r < n; r++) col[r] = s->all[r].data_s;
    st->data = spread(col, n, s->tmp);
    for (int k = 0; k < STRAGGLER_GROUPS; k++) {
        for (int r = 0; r < n; r++) col[r] = s->all[r].comm_s[k];
        st->comm[k] = spread(col, n, s->tmp);
    }
    st->compute_s = spread(s->compute, n, s->tmp);
    st->busy_s = spread(s->busy, n, s->tmp);

    /* the slowest against the median of the others: with few ranks the
     * slow one would pull a median that includes it towards itself */
    st->slowest = st->busy_s.argmax;
    double others = n > 1 ? median_without(s->busy, n, st->slowest, s->tmp) : s->busy[0];
    double top = s->busy[st->slowest];
    st->factor = others > 0 ? top / others : (top > 0 ? INFINITY : 1.0);
    st->slow = n > 1 && s->factor > 0 && st->factor > s->factor && top - others > s->min_excess;
    if (!st->slow) s->streak = 0, s->streak_rank = -1;
    else if (st->slowest == s->streak_rank) s->streak++;
    else s->streak = 1, s->streak_rank = st->slowest;
    st->streak = s->streak;
    st->warn = st->slow && s->streak == s->persist;
    if (st->warn) {
        int seen = 0;
        for (int i = 0; i < s->nwarned; i++) seen |= s->warned[i] == st->slowest;
        if (!seen) s->warned[s->nwarned++] = st->slowest;
    }
    return st;
}

const StragglerStats *straggler_gather(Straggler *s, const StragglerSample *mine) {
    if (s->g) comm_all_gather_bytes(s->g, mine, s->all, sizeof *mine);
    else s->all[0] = *mine;
    return s->rank == 0 ? straggler_feed(s, s->all) : NULL;
}
