/* data: the global sample order over one or more sources of shards, this rank's
 * slice of it, the prefetch thread and the position checkpoints save; reading a
 * sample is shard.c's. Never knows the model, the backend, or the ranks beyond
 * (rank, world). Global sample g comes from the source most behind its weight
 * (greedy, exact integer arithmetic); a source's k-th sample is index k % N of
 * epoch k / N of its own seeded permutation (docs/data.md, "Mixtures"). */
#include "data.h"
#include "shard.h"
#include "testhooks.h"
#include "util.h"

#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define DATA_STATE_VERSION 1
#define DATA_STATE_HEAD 4       /* version, sources, g, g0 */
#define DATA_STATE_PER_SOURCE 6 /* name hash, samples, weight units, position, drawn, blended */
#define DATA_WEIGHT_UNITS (1ull << 30)
#define DATA_DEFAULT_OPEN 64
/* Counters no run reaches (2^62 samples): past it a saved one is damage, and
 * sums of a few of them cannot overflow. */
#define DATA_COUNT_MAX ((uint64_t)1 << 62)

typedef struct DataSrc {
    char *name, *path;
    double weight;       /* the configured weight (over the largest where their sum overflows) */
    uint64_t units;      /* weight as an integer share of DATA_WEIGHT_UNITS: the blend is exact */
    uint64_t hash;       /* FNV-1a of the name: its identity in a checkpoint */
    ShardSet *set;
    uint64_t N;          /* samples */
    uint32_t *perm;      /* (N) when shuffling: the order of epoch perm_epoch */
    uint64_t perm_epoch;
    int perm_valid;
} DataSrc;

/* Where the order stands: after the last batch handed out, or (the
 * producer's own, and one per prefetched batch) after a batch made. */
typedef struct DataCursor {
    uint64_t g;      /* global samples drawn, all ranks */
    uint64_t *k;     /* (S) each source's place in its own stream: epoch k / N, index k % N */
    uint64_t *drawn; /* (S) samples drawn from each source: tokens seen = drawn * T */
    uint64_t *c;     /* (S) samples each source got since the blend began at g0 */
} DataCursor;

typedef struct DataSlot {
    int32_t *in, *tg;  /* (B,T) each: one prefetched batch */
    DataCursor after;  /* the order after it */
} DataSlot;

struct DataLoader {
    char *what;
    int B, T, vocab_size, shuffle, rank, world, mixture, S;
    uint64_t seed;
    DataSrc *src;        /* (S) in config order */
    uint64_t units;      /* sum of src[].units */
    uint64_t g0;         /* global sample where the blend's counts c start (a forced change moves it) */
    ShardCache *cache;
    DataCursor cur;      /* after the last batch handed out: what checkpoints save */
    uint64_t *noted;     /* (S) the epoch of each source last logged */
    double wait_s;
    uint64_t batches;    /* handed out by data_next_batch (counted for the test hook) */
    long hook_batch;     /* test hook: wait before this batch (1-based) while hook_file exists; 0 = off */
    char *hook_file;
    /* prefetch: a producer thread fills slots[tail % depth] from its own
     * cursor while data_next_batch takes slots[head % depth]; while it runs it
     * alone touches the shards, the cache and the permutations */
    int depth;
    DataSlot *slots;     /* (depth) */
    DataCursor prod;
    pthread_t thread;
    int running, stop, failed;
    uint64_t head, tail;
    ShardError err;      /* the producer's failure, reported when the consumer reaches it */
    pthread_mutex_t mu;
    pthread_cond_t filled, freed;
};

static void cursor_init(DataCursor *x, int S) {
    x->g = 0;
    x->k = xcalloc((size_t)3 * S, sizeof(uint64_t));
    x->drawn = x->k + S;
    x->c = x->k + 2 * S;
}

static void cursor_copy(DataCursor *dst, const DataCursor *src, int S) {
    dst->g = src->g;
    memcpy(dst->k, src->k, (size_t)3 * S * sizeof(uint64_t));
}

/* ---- the order ------------------------------------------------------------ */

/* Source of the next global sample: the largest deficit
 * units_s * (n + 1) - c_s * units, n = samples blended so far; ties to the
 * first. A source is picked only while behind (the deficits sum to a positive
 * number), so none is ever a whole sample ahead of its share. */
static int data_pick(const DataLoader *dl, const DataCursor *x) {
    if (dl->S == 1) return 0;
    __int128 n1 = (__int128)(x->g - dl->g0) + 1, best_d = 0;
    int best = 0;
    for (int s = 0; s < dl->S; s++) {
        __int128 d = (__int128)dl->src[s].units * n1 - (__int128)x->c[s] * (__int128)dl->units;
        if (s == 0 || d > best_d) best = s, best_d = d;
    }
    return best;
}

/* This epoch's order of one source: Fisher-Yates over an Rng seeded from
 * (seed, epoch) for a plain glob, as kiln has always done, or (seed, epoch,
 * name) for a source of a list, so that sources are shuffled independently. */
static const uint32_t *data_perm(const DataLoader *dl, DataSrc *src, uint64_t epoch) {
    if (src->perm_valid && src->perm_epoch == epoch) return src->perm;
    uint64_t key[3] = {dl->seed, epoch, src->hash};
    Rng r;
    rng_seed(&r, kiln_fnv1a(key, dl->mixture ? sizeof key : 2 * sizeof key[0], KILN_FNV_INIT));
    uint64_t n = src->N;
    for (uint64_t i = 0; i < n; i++) src->perm[i] = (uint32_t)i;
    for (uint64_t i = n - 1; i > 0; i--) {
        uint64_t j = rng_below(&r, i + 1);
        uint32_t tmp = src->perm[i];
        src->perm[i] = src->perm[j];
        src->perm[j] = tmp;
    }
    src->perm_epoch = epoch;
    src->perm_valid = 1;
    return src->perm;
}

/* The batch after cursor x (which it advances): all B * world samples of the
 * global batch are blended, this rank's are read. */
static int data_fill(DataLoader *dl, DataCursor *x, int32_t *in, int32_t *tg, ShardError *e) {
    const uint64_t world = (uint64_t)dl->world, per = (uint64_t)dl->B * world, T = (uint64_t)dl->T;
    for (uint64_t j = 0; j < per; j++) {
        int s = data_pick(dl, x);
        DataSrc *src = &dl->src[s];
        uint64_t k = x->k[s]++;
        x->drawn[s]++, x->c[s]++, x->g++;
        if (j % world != (uint64_t)dl->rank) continue;
        uint64_t epoch = k / src->N, idx = k % src->N;
        uint64_t sample = dl->shuffle ? data_perm(dl, src, epoch)[idx] : idx;
        size_t b = (size_t)(j / world);
        if (shard_read_sample(src->set, sample, in + b * T, tg + b * T, e) != 0) return -1;
    }
    return 0;
}

/* ---- prefetch ------------------------------------------------------------- */

static void *data_prefetch_main(void *arg) {
    DataLoader *dl = arg;
    pthread_mutex_lock(&dl->mu);
    for (;;) {
        while (!dl->stop && dl->tail - dl->head == (uint64_t)dl->depth) pthread_cond_wait(&dl->freed, &dl->mu);
        if (dl->stop) break;
        DataSlot *sl = &dl->slots[dl->tail % (uint64_t)dl->depth];
        pthread_mutex_unlock(&dl->mu);
        ShardError e;
        int rc = data_fill(dl, &dl->prod, sl->in, sl->tg, &e);
        if (rc == 0) cursor_copy(&sl->after, &dl->prod, dl->S);
        pthread_mutex_lock(&dl->mu);
        if (rc != 0) {
            dl->err = e;
            dl->failed = 1;
            pthread_cond_signal(&dl->filled);
            break;
        }
        dl->tail++;
        pthread_cond_signal(&dl->filled);
    }
    pthread_mutex_unlock(&dl->mu);
    return NULL;
}

static void data_prefetch_start(DataLoader *dl) {
    cursor_copy(&dl->prod, &dl->cur, dl->S);
    dl->head = dl->tail = 0;
    dl->stop = dl->failed = 0;
    /* signals (stop.c's SIGTERM/SIGUSR1) go to the main thread, not this one */
    sigset_t all, prev;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &prev);
    int rc = pthread_create(&dl->thread, NULL, data_prefetch_main, dl);
    pthread_sigmask(SIG_SETMASK, &prev, NULL);
    if (rc != 0) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot start the prefetch thread (error %d)", dl->what, rc);
    dl->running = 1;
}

/* Stop the producer; what it made ahead is dropped (the consumer's cursor
 * says where the order stands). */
static void data_prefetch_stop(DataLoader *dl) {
    if (!dl->running) return;
    pthread_mutex_lock(&dl->mu);
    dl->stop = 1;
    pthread_cond_signal(&dl->freed);
    pthread_mutex_unlock(&dl->mu);
    pthread_join(dl->thread, NULL);
    dl->running = 0;
}

/* ---- the loader ----------------------------------------------------------- */

DataLoader *data_open(const DataOptions *o) {
    if (o->B <= 0 || o->T <= 0 || o->vocab_size <= 0 || o->world <= 0 || o->rank < 0 || o->rank >= o->world ||
        o->n_sources <= 0 || o->prefetch < 0)
        kiln_fail(KILN_EXIT_USAGE, "%s: bad loader arguments B=%d T=%d vocab_size=%d rank=%d world=%d sources=%d",
                  o->what, o->B, o->T, o->vocab_size, o->rank, o->world, o->n_sources);
    DataLoader *dl = xcalloc(1, sizeof *dl);
    dl->what = xstrdup(o->what);
    dl->B = o->B, dl->T = o->T, dl->vocab_size = o->vocab_size, dl->shuffle = o->shuffle;
    dl->rank = o->rank, dl->world = o->world, dl->mixture = o->mixture, dl->seed = o->seed;
    dl->S = o->n_sources;
    dl->cache = shard_cache_new(o->max_open > 0 ? o->max_open : DATA_DEFAULT_OPEN);
    dl->src = xcalloc((size_t)dl->S, sizeof(DataSrc));
    double wmax = 0, wsum = 0, scale = 1;
    for (int s = 0; s < dl->S; s++) {
        double w = o->sources[s].weight;
        if (!(w > 0) || !isfinite(w))
            kiln_fail(KILN_EXIT_USAGE, "%s: source %d: weight %g must be finite and > 0", o->what, s, w);
        if (w > wmax) wmax = w;
        wsum += w;
    }
    if (!isfinite(wsum)) { /* weights near DBL_MAX: relative to the largest, or every share would be 0 */
        scale = wmax, wsum = 0;
        for (int s = 0; s < dl->S; s++) wsum += o->sources[s].weight / scale;
    }
    for (int s = 0; s < dl->S; s++) {
        const DataSource *ds = &o->sources[s];
        DataSrc *src = &dl->src[s];
        char name[32];
        snprintf(name, sizeof name, "source%d", s);
        src->name = xstrdup(ds->name ? ds->name : name);
        src->path = xstrdup(ds->path);
        src->weight = ds->weight / scale;
        long long u = llround(src->weight / wsum * (double)DATA_WEIGHT_UNITS);
        src->units = u > 0 ? (uint64_t)u : 1;
        dl->units += src->units;
        src->hash = kiln_fnv1a(src->name, strlen(src->name), KILN_FNV_INIT);
        char what[256];
        if (dl->mixture) snprintf(what, sizeof what, "%s source '%s'", o->what, src->name);
        else snprintf(what, sizeof what, "%s", o->what);
        src->set = shard_index(ds->path, what, o->T, o->vocab_size, dl->cache);
        src->N = shard_set_samples(src->set);
        if (o->shuffle) {
            if (src->N > UINT32_MAX)
                kiln_fail(KILN_EXIT_USAGE, "%s: %llu samples; one source's shuffled order holds at most 2^32 (split "
                          "it into several sources)", what, (unsigned long long)src->N);
            src->perm = xmalloc(src->N * sizeof(uint32_t));
        }
    }
    cursor_init(&dl->cur, dl->S);
    dl->noted = xcalloc((size_t)dl->S, sizeof(uint64_t));
    const TestHooks *th = testhooks();
    if (th->data_wait_file && !strcmp(o->what, "data.train"))
        dl->hook_batch = th->data_wait_batch, dl->hook_file = xstrdup(th->data_wait_file);
    dl->depth = o->prefetch;
    if (dl->depth) {
        size_t n = (size_t)o->B * o->T;
        dl->slots = xcalloc((size_t)dl->depth, sizeof(DataSlot));
        for (int i = 0; i < dl->depth; i++) {
            dl->slots[i].in = xmalloc(n * sizeof(int32_t));
            dl->slots[i].tg = xmalloc(n * sizeof(int32_t));
            cursor_init(&dl->slots[i].after, dl->S);
        }
        cursor_init(&dl->prod, dl->S);
        pthread_mutex_init(&dl->mu, NULL);
        pthread_cond_init(&dl->filled, NULL);
        pthread_cond_init(&dl->freed, NULL);
    }
    return dl;
}

void data_close(DataLoader *dl) {
    if (!dl) return;
    data_prefetch_stop(dl);
    if (dl->depth) {
        for (int i = 0; i < dl->depth; i++) free(dl->slots[i].in), free(dl->slots[i].tg), free(dl->slots[i].after.k);
        free(dl->slots);
        free(dl->prod.k);
        pthread_mutex_destroy(&dl->mu);
        pthread_cond_destroy(&dl->filled);
        pthread_cond_destroy(&dl->freed);
    }
    for (int s = 0; s < dl->S; s++) {
        shard_set_free(dl->src[s].set);
        free(dl->src[s].perm), free(dl->src[s].name), free(dl->src[s].path);
    }
    shard_cache_free(dl->cache);
    free(dl->src);
    free(dl->cur.k);
    free(dl->noted);
    free(dl->hook_file);
    free(dl->what);
    free(dl);
}

static void data_die(const ShardError *e) {
    kiln_fail_hint(e->code ? e->code : KILN_EXIT_USAGE, e->hint[0] ? e->hint : NULL, "%s", e->msg);
}

/* Test hook (docs/data.md; testhooks.h data_wait): before batch
 * data_wait_batch of data.train, create data_wait_file and wait until a test removes
 * it, having changed the shards under the running loader at a known point. */
static void data_test_wait(const DataLoader *dl) {
    FILE *f = fopen(dl->hook_file, "w");
    if (!f) kiln_fail(KILN_EXIT_RUNTIME, "test hook: cannot create %s", dl->hook_file);
    fclose(f);
    struct timespec ts = {0, 10 * 1000 * 1000};
    for (int i = 0; i < 6000 && access(dl->hook_file, F_OK) == 0; i++) nanosleep(&ts, NULL);
    if (access(dl->hook_file, F_OK) == 0) kiln_fail(KILN_EXIT_RUNTIME, "test hook: %s still there after 60 s", dl->hook_file);
}

void data_next_batch(DataLoader *dl, int32_t *inputs, int32_t *targets) {
    if (dl->hook_batch && (long)++dl->batches == dl->hook_batch) data_test_wait(dl);
    double t0 = kiln_now();
    if (!dl->depth) {
        ShardError e;
        if (data_fill(dl, &dl->cur, inputs, targets, &e) != 0) data_die(&e);
    } else {
        if (!dl->running) data_prefetch_start(dl);
        pthread_mutex_lock(&dl->mu);
        while (dl->head == dl->tail && !dl->failed) pthread_cond_wait(&dl->filled, &dl->mu);
        int have = dl->head != dl->tail;
        pthread_mutex_unlock(&dl->mu);
        if (!have) {
            /* the producer stopped at a bad shard: every batch before it has
             * been handed out, so the error comes at the same batch as without
             * prefetch */
            data_prefetch_stop(dl);
            data_die(&dl->err);
        }
        DataSlot *sl = &dl->slots[dl->head % (uint64_t)dl->depth];
        size_t n = (size_t)dl->B * dl->T;
        memcpy(inputs, sl->in, n * sizeof(int32_t));
        memcpy(targets, sl->tg, n * sizeof(int32_t));
        cursor_copy(&dl->cur, &sl->after, dl->S);
        pthread_mutex_lock(&dl->mu);
        dl->head++;
        pthread_cond_signal(&dl->freed);
        pthread_mutex_unlock(&dl->mu);
    }
    dl->wait_s += kiln_now() - t0;
}

static void data_mark_noted(DataLoader *dl) {
    for (int s = 0; s < dl->S; s++) dl->noted[s] = dl->cur.k[s] / dl->src[s].N;
}

void data_rewind(DataLoader *dl) {
    data_prefetch_stop(dl);
    dl->cur.g = 0;
    memset(dl->cur.k, 0, (size_t)3 * dl->S * sizeof(uint64_t));
    dl->g0 = 0;
    data_mark_noted(dl);
}

DataPos data_get_pos(const DataLoader *dl) {
    if (dl->S > 1) return (DataPos){0, dl->cur.g};
    uint64_t k = dl->cur.k[0], N = dl->src[0].N;
    return (DataPos){k / N, k % N};
}

void data_set_pos(DataLoader *dl, DataPos pos) {
    if (dl->S != 1)
        kiln_fail(KILN_EXIT_RUNTIME, "%s: a one-source position set on a mixture of %d sources", dl->what, dl->S);
    uint64_t N = dl->src[0].N;
    if (pos.index >= N)
        kiln_fail_hint(KILN_EXIT_USAGE, "the data changed since the checkpoint was written; resume with the same shards",
                       "%s: saved data position %llu is past the %llu samples of '%s'", dl->what,
                       (unsigned long long)pos.index, (unsigned long long)N, dl->src[0].path);
    char err[256] = "";
    if (data_pos_check(pos, err, sizeof err) != 0 || pos.epoch > (DATA_COUNT_MAX - pos.index) / N)
        kiln_fail(KILN_EXIT_USAGE, "%s: %s", dl->what, err[0] ? err : "the checkpoint's data position is past 2^62 samples");
    data_prefetch_stop(dl);
    uint64_t k = pos.epoch * N + pos.index;
    dl->cur.g = dl->cur.k[0] = dl->cur.drawn[0] = dl->cur.c[0] = k;
    dl->g0 = 0;
    data_mark_noted(dl);
}

/* ---- checkpoint state ----------------------------------------------------- */

size_t data_state_words(const DataLoader *dl) { return DATA_STATE_HEAD + (size_t)DATA_STATE_PER_SOURCE * dl->S; }

void data_get_state(const DataLoader *dl, uint64_t *w) {
    w[0] = DATA_STATE_VERSION, w[1] = (uint64_t)dl->S, w[2] = dl->cur.g, w[3] = dl->g0;
    for (int s = 0; s < dl->S; s++) {
        uint64_t *p = w + DATA_STATE_HEAD + DATA_STATE_PER_SOURCE * s;
        p[0] = dl->src[s].hash, p[1] = dl->src[s].N, p[2] = dl->src[s].units;
        p[3] = dl->cur.k[s], p[4] = dl->cur.drawn[s], p[5] = dl->cur.c[s];
    }
}

/* The saved source with this name hash, or NULL. */
static const uint64_t *data_saved_source(const uint64_t *w, uint64_t hash) {
    for (uint64_t s = 0; s < w[1]; s++) {
        const uint64_t *p = w + DATA_STATE_HEAD + DATA_STATE_PER_SOURCE * s;
        if (p[0] == hash) return p;
    }
    return NULL;
}

/* What differs between the saved mixture and this one, in words; "" if nothing. */
static void data_state_diff(const DataLoader *dl, const uint64_t *w, char *buf, size_t cap) {
    buf[0] = 0;
    for (int s = 0; s < dl->S; s++) {
        const DataSrc *src = &dl->src[s];
        const uint64_t *p = data_saved_source(w, src->hash);
        if (!p) snprintf(buf, cap, "source '%s' is new", src->name);
        else if (p[1] != src->N)
            snprintf(buf, cap, "source '%s' ('%s') holds %llu samples now, %llu when the checkpoint was written (its "
                     "shards changed)", src->name, src->path, (unsigned long long)src->N, (unsigned long long)p[1]);
        else if (p[2] != src->units) snprintf(buf, cap, "the weight of source '%s' changed", src->name);
        else if (p != w + DATA_STATE_HEAD + DATA_STATE_PER_SOURCE * s)
            snprintf(buf, cap, "the sources are in another order (source '%s')", src->name);
        if (buf[0]) return;
    }
    if (w[1] != (uint64_t)dl->S)
        snprintf(buf, cap, "%llu source(s) of the checkpoint are no longer in it", (unsigned long long)w[1] - (uint64_t)dl->S);
}


int data_state_check(const uint64_t *w, size_t n, char *err, size_t cap) {
    if (n < DATA_STATE_HEAD || w[0] != DATA_STATE_VERSION || w[1] > (1u << 20) ||
        n != DATA_STATE_HEAD + DATA_STATE_PER_SOURCE * w[1])
        return snprintf(err, cap, "the checkpoint's data state (%zu words, version %llu) is not one this kiln reads "
                        "(version %d): written by a newer kiln?", n, n ? (unsigned long long)w[0] : 0ull,
                        DATA_STATE_VERSION), -1;
    uint64_t g = w[2], g0 = w[3], blended = 0;
    if (g > DATA_COUNT_MAX || g0 > g)
        return snprintf(err, cap, "the checkpoint's data state says %llu samples drawn, the blend beginning at %llu: "
                        "not a position", (unsigned long long)g, (unsigned long long)g0), -1;
    for (uint64_t s = 0; s < w[1]; s++) {
        const uint64_t *p = w + DATA_STATE_HEAD + DATA_STATE_PER_SOURCE * s;
        if (p[1] == 0 || p[1] > DATA_COUNT_MAX || p[2] > DATA_WEIGHT_UNITS || p[3] > DATA_COUNT_MAX || p[4] > g ||
            p[5] > g - g0)
            return snprintf(err, cap, "the checkpoint's data state of source %llu (samples %llu, position %llu, drawn "
                            "%llu, blended %llu) does not fit its %llu samples drawn in all", (unsigned long long)s,
                            (unsigned long long)p[1], (unsigned long long)p[3], (unsigned long long)p[4],
                            (unsigned long long)p[5], (unsigned long long)g), -1;
        blended += p[5]; /* each <= 2^62, at most 2^20 of them: no overflow */
    }
    if (blended != g - g0)
        return snprintf(err, cap, "the checkpoint's data state blends %llu samples since sample %llu but says %llu were "
                        "drawn", (unsigned long long)blended, (unsigned long long)g0, (unsigned long long)g), -1;
    return 0;
}

int data_pos_check(DataPos pos, char *err, size_t cap) {
    if (pos.epoch <= DATA_COUNT_MAX && pos.index <= DATA_COUNT_MAX) return 0;
    return snprintf(err, cap, "the checkpoint's data position (epoch %llu, sample %llu) is past what any run draws",
                    (unsigned long long)pos.epoch, (unsigned long long)pos.index), -1;
}

void data_set_state(DataLoader *dl, const uint64_t *w, size_t n, int force, char *note, size_t cap) {
    note[0] = 0;
    char err[512];
    if (data_state_check(w, n, err, sizeof err) != 0) kiln_fail(KILN_EXIT_USAGE, "%s: %s", dl->what, err);
    data_prefetch_stop(dl);
    char diff[600];
    data_state_diff(dl, w, diff, sizeof diff);
    if (!diff[0]) { /* the same mixture: exactly where it was */
        dl->cur.g = w[2], dl->g0 = w[3];
        for (int s = 0; s < dl->S; s++) {
            const uint64_t *p = w + DATA_STATE_HEAD + DATA_STATE_PER_SOURCE * s;
            dl->cur.k[s] = p[3], dl->cur.drawn[s] = p[4], dl->cur.c[s] = p[5];
        }
        data_mark_noted(dl);
        return;
    }
    if (!force)
        kiln_fail_hint(KILN_EXIT_USAGE, "resume with the data of the checkpoint, or pass --force to continue each source "
                       "from its saved position", "key '%s': the checkpoint's mixture differs from this run's: %s",
                       dl->what, diff);
    /* --force: each source still present keeps its epoch and index (the next
     * epoch if the index is past its samples now), a new one starts at its
     * beginning, and the blend starts over here with the new weights */
    size_t o = (size_t)snprintf(note, cap, "data: --force: %s; the blend restarts at global sample %llu with this "
                                "run's weights;", diff, (unsigned long long)w[2]);
    dl->cur.g = dl->g0 = w[2];
    for (int s = 0; s < dl->S; s++) {
        DataSrc *src = &dl->src[s];
        const uint64_t *p = data_saved_source(w, src->hash);
        uint64_t epoch = 0, idx = 0;
        if (p) {
            epoch = p[3] / p[1], idx = p[3] % p[1];
            if (idx >= src->N) epoch++, idx = 0;
        }
        dl->cur.k[s] = epoch * src->N + idx;
        dl->cur.drawn[s] = p ? p[4] : 0;
        dl->cur.c[s] = 0;
        if (o < cap) {
            if (p)
                o += (size_t)snprintf(note + o, cap - o, " '%s' continues at epoch %llu, sample %llu of %llu;",
                                      src->name, (unsigned long long)epoch, (unsigned long long)idx,
                                      (unsigned long long)src->N);
            else o += (size_t)snprintf(note + o, cap - o, " '%s' starts at its beginning;", src->name);
        }
    }
    if (o < cap && o > 0 && note[o - 1] == ';') note[o - 1] = 0;
    data_mark_noted(dl);
}

/* ---- counts and messages -------------------------------------------------- */

uint64_t data_num_tokens(const DataLoader *dl) {
    uint64_t n = 0;
    for (int s = 0; s < dl->S; s++) n += shard_set_tokens(dl->src[s].set);
    return n;
}

uint64_t data_num_samples(const DataLoader *dl) {
    uint64_t n = 0;
    for (int s = 0; s < dl->S; s++) n += dl->src[s].N;
    return n;
}

int data_num_shards(const DataLoader *dl) {
    int n = 0;
    for (int s = 0; s < dl->S; s++) n += shard_set_count(dl->src[s].set);
    return n;
}

int data_num_sources(const DataLoader *dl) { return dl->S; }
const char *data_source_name(const DataLoader *dl, int i) { return dl->src[i].name; }
uint64_t data_source_tokens(const DataLoader *dl, int i) { return dl->cur.drawn[i] * (uint64_t)dl->T; }

double data_take_wait_s(DataLoader *dl) {
    double w = dl->wait_s;
    dl->wait_s = 0;
    return w;
}

int data_take_note(DataLoader *dl, char *buf, size_t cap) {
    for (int s = 0; s < dl->S; s++) {
        const DataSrc *src = &dl->src[s];
        uint64_t epoch = dl->cur.k[s] / src->N;
        if (epoch <= dl->noted[s]) continue;
        dl->noted[s] = epoch;
        if (dl->mixture)
            snprintf(buf, cap, "data: source '%s' of %s starts epoch %llu (%llu samples an epoch, reshuffled; global "
                     "sample %llu)", src->name, dl->what, (unsigned long long)epoch, (unsigned long long)src->N,
                     (unsigned long long)dl->cur.g);
        else
            snprintf(buf, cap, "data: %s starts epoch %llu (%llu samples an epoch%s)", dl->what,
                     (unsigned long long)epoch, (unsigned long long)src->N, dl->shuffle ? ", reshuffled" : "");
        return 1;
    }
    return 0;
}

void data_describe(const DataLoader *dl, char *buf, size_t cap) {
    size_t o = 0;
    double wsum = 0;
    for (int s = 0; s < dl->S; s++) wsum += dl->src[s].weight;
    for (int s = 0; s < dl->S && o < cap; s++) {
        const DataSrc *src = &dl->src[s];
        char share[48] = "";
        if (dl->mixture) snprintf(share, sizeof share, "%s: %.1f%%, ", src->name, 100.0 * src->weight / wsum);
        o += (size_t)snprintf(buf + o, cap - o, "%s%s%llu tokens in %d shard(s)", s ? "; " : "", share,
                              (unsigned long long)shard_set_tokens(src->set), shard_set_count(src->set));
    }
}
