/* doctor: `./train doctor RUN_DIR` (see doctor.h). Reads the flight files,
 * one flat JSON object per line as flight.c writes them, and the heartbeats;
 * prints what each rank was doing and its findings. Must never write into the
 * run directory, and never trust a file's contents past what it checks. */
#include "doctor.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "util.h"

#define DNAME 32

typedef struct DOp {
    uint64_t id, seq, coll, count;
    int first, gsize, peer, step, p2p; /* first: world rank of the group's rank 0 (-1: not yet known) */
    double posted, started, completed; /* unix seconds; NAN = not yet */
    char group[DNAME], op[DNAME], dtype[8], phase[16];
} DOp;

typedef struct DRank {
    int flight, hb;                    /* which of its files were read */
    char host[64], reason[24], phase[16];
    int pid, detail, step;
    double time;                       /* of the dump */
    const DOp *wait;                   /* the operation it waits in, or NULL */
    DOp *ops;                          /* [n] in posting order */
    int n;
    int hb_step, hb_pid, hb_stalled;
    char hb_phase[16], hb_host[64];
    double hb_time;
    char culprit[400];                 /* why it is named; "" = not */
} DRank;

typedef struct Doc {
    const char *dir;
    FILE *out;
    DoctorOptions o;
    int world;
    DRank *r; /* [world] */
    double newest;
} Doc;

/* The phases of a step in order (metrics.h): ties are broken by how far a rank got. */
static const char *phase_order[] = {"init", "data",   "forward", "backward",   "sync",
                                    "optimizer", "eval", "sample", "checkpoint", "done"};
#define NPHASE ((int)(sizeof phase_order / sizeof phase_order[0]))
static int phase_index(const char *p) {
    for (int i = 0; i < NPHASE; i++)
        if (strcmp(p, phase_order[i]) == 0) return i;
    return NPHASE; /* unknown: after the others */
}

/* ---------------------------------------------------------------- reading */

/* The value after "key": in one line; NULL if absent. */
static const char *jval(const char *line, const char *key) {
    char pat[48];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(line, pat);
    return p ? p + strlen(pat) : NULL;
}
static double jnum(const char *line, const char *key) {
    const char *v = jval(line, key);
    if (!v || *v == 'n') return NAN;
    char *e;
    double x = strtod(v, &e);
    return e == v ? NAN : x;
}
static int jint(const char *line, const char *key, int dflt) {
    double x = jnum(line, key);
    return x >= INT_MIN && x <= INT_MAX ? (int)x : dflt; /* NaN, inf, 1e11: the default */
}
static uint64_t ju64(const char *line, const char *key) {
    const char *v = jval(line, key);
    return v ? strtoull(v, NULL, 10) : 0;
}
static void jstr(const char *line, const char *key, char *out, size_t n) {
    out[0] = 0;
    const char *v = jval(line, key);
    if (!v || *v != '"') return;
    v++;
    size_t i = 0;
    while (v[i] && v[i] != '"' && i + 1 < n) out[i] = v[i], i++;
    out[i] = 0;
}

static DRank *rank_slot(Doc *d, int rank) {
    if (rank < 0 || rank > (1 << 22)) return NULL;
    if (rank >= d->world) {
        d->r = xrealloc(d->r, (size_t)(rank + 1) * sizeof(DRank));
        memset(d->r + d->world, 0, (size_t)(rank + 1 - d->world) * sizeof(DRank));
        d->world = rank + 1;
    }
    return &d->r[rank];
}

static void read_flight(Doc *d, const char *path) {
    size_t len = 0;
    char *text = kiln_read_file(path, &len);
    if (!text) kiln_fail(KILN_EXIT_USAGE, "%s: cannot read: %s", path, kiln_strerror(errno));
    char *nl = strchr(text, '\n');
    if (!nl || strncmp(text, "{\"format\":\"kiln-flight\",\"version\":1,", 36) != 0)
        kiln_fail(KILN_EXIT_USAGE, "%s: not a kiln flight recorder file (version 1)", path);
    *nl = 0;
    DRank *r = rank_slot(d, jint(text, "rank", -1));
    if (!r) kiln_fail(KILN_EXIT_USAGE, "%s: no valid \"rank\"", path);
    r->flight = 1;
    jstr(text, "host", r->host, sizeof r->host);
    jstr(text, "reason", r->reason, sizeof r->reason);
    jstr(text, "phase", r->phase, sizeof r->phase);
    r->pid = jint(text, "pid", 0);
    r->detail = jint(text, "detail", -1);
    r->step = jint(text, "step", 0);
    r->time = jnum(text, "time");
    int world = jint(text, "world", 0);
    if (world > 0) rank_slot(d, world - 1), r = rank_slot(d, jint(text, "rank", -1));
    if (r->time > d->newest) d->newest = r->time;
    uint64_t waiting = ju64(text, "waiting");
    int cap = 0;
    for (char *p = nl + 1; *p; p++) cap += *p == '\n';
    r->ops = xcalloc((size_t)cap + 1, sizeof(DOp));
    for (char *line = nl + 1; *line;) {
        char *e = strchr(line, '\n');
        if (e) *e = 0;
        if (strncmp(line, "{\"id\":", 6) == 0) {
            DOp *o = &r->ops[r->n++];
            o->id = ju64(line, "id");
            o->seq = ju64(line, "seq");
            o->coll = ju64(line, "coll");
            o->count = ju64(line, "count");
            o->first = jint(line, "group_first", -1);
            o->gsize = jint(line, "group_size", 0);
            o->peer = jint(line, "peer", -1);
            o->step = jint(line, "step", 0);
            o->posted = jnum(line, "posted");
            o->started = jnum(line, "started");
            o->completed = jnum(line, "completed");
            jstr(line, "group", o->group, sizeof o->group);
            jstr(line, "op", o->op, sizeof o->op);
            jstr(line, "dtype", o->dtype, sizeof o->dtype);
            jstr(line, "phase", o->phase, sizeof o->phase);
            o->p2p = strcmp(o->op, "send") == 0 || strcmp(o->op, "recv") == 0;
            if (!o->op[0] || isnan(o->posted))
                kiln_fail(KILN_EXIT_USAGE, "%s: a record without \"op\" or \"posted\": %.80s", path, line);
            if (o->id == waiting) r->wait = o;
        }
        if (!e) break;
        line = e + 1;
    }
    free(text);
}

static void read_heartbeat(Doc *d, const char *path) {
    size_t len = 0;
    char *text = kiln_read_file_max(path, KILN_SMALL_FILE_MAX, &len);
    if (!text) return; /* a heartbeat is advisory: one being rewritten is skipped */
    DRank *r = rank_slot(d, jint(text, "rank", -1));
    if (r && !isnan(jnum(text, "time"))) {
        r->hb = 1;
        r->hb_step = jint(text, "step", 0);
        r->hb_pid = jint(text, "pid", 0);
        r->hb_stalled = jint(text, "stalled", 0);
        r->hb_time = jnum(text, "time");
        jstr(text, "phase", r->hb_phase, sizeof r->hb_phase);
        jstr(text, "host", r->hb_host, sizeof r->hb_host);
        int world = jint(text, "world", 0);
        if (world > 0) rank_slot(d, world - 1);
        if (d->r[jint(text, "rank", 0)].hb_time > d->newest) d->newest = d->r[jint(text, "rank", 0)].hb_time;
    }
    free(text);
}

/* Every rank<N>.json in dir/sub, through fn; returns how many. */
static int read_dir(Doc *d, const char *sub, void (*fn)(Doc *, const char *)) {
    char path[2048];
    snprintf(path, sizeof path, "%s/%s", d->dir, sub);
    DIR *dir = opendir(path);
    if (!dir) return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(dir)) != NULL) {
        int rank, k = 0;
        if (sscanf(e->d_name, "rank%d.json%n", &rank, &k) != 1 || e->d_name[k]) continue;
        snprintf(path, sizeof path, "%s/%s/%s", d->dir, sub, e->d_name);
        fn(d, path);
        n++;
    }
    closedir(dir);
    return n;
}

/* ---------------------------------------------------------------- wording */

static const char *host_of(const DRank *r) { return r->host[0] ? r->host : r->hb_host[0] ? r->hb_host : "?"; }

/* "dp all_reduce #10 (1 f64)" */
static void op_desc(const DOp *o, char *buf, size_t n) {
    char extra[48] = "";
    if (strcmp(o->op, "broadcast") == 0 && o->peer >= 0) snprintf(extra, sizeof extra, ", root rank %d", o->peer);
    else if (strcmp(o->op, "send") == 0) snprintf(extra, sizeof extra, ", to rank %d", o->peer);
    else if (strcmp(o->op, "recv") == 0) snprintf(extra, sizeof extra, ", from rank %d", o->peer);
    if (strcmp(o->dtype, "none") == 0) snprintf(buf, n, "%s %s #%llu", o->group, o->op, (unsigned long long)o->seq);
    else snprintf(buf, n, "%s %s #%llu (%llu %s%s)", o->group, o->op, (unsigned long long)o->seq,
                  (unsigned long long)o->count, o->dtype, extra);
}

/* "all_reduce of 896 f32", "broadcast of 8 bytes from rank 0", "barrier" */
static void call_desc(const DOp *o, char *buf, size_t n) {
    char extra[48] = "";
    if (strcmp(o->op, "broadcast") == 0 && o->peer >= 0) snprintf(extra, sizeof extra, " from rank %d", o->peer);
    if (strcmp(o->dtype, "none") == 0) snprintf(buf, n, "%s", o->op);
    else snprintf(buf, n, "%s of %llu %s%s", o->op, (unsigned long long)o->count, o->dtype, extra);
}

/* "0,1,3" from flags[world] */
static void rank_list(const int *flags, int world, char *buf, size_t n) {
    size_t k = 0;
    buf[0] = 0;
    for (int i = 0; i < world && k + 12 < n; i++)
        if (flags[i]) k += (size_t)snprintf(buf + k, n - k, "%s%d", k ? "," : "", i);
}
static int count_flags(const int *flags, int world) {
    int c = 0;
    for (int i = 0; i < world; i++) c += flags[i] != 0;
    return c;
}

static void name_culprit(Doc *d, int rank, const char *why) {
    DRank *r = &d->r[rank];
    if (!r->culprit[0]) kiln_strlcpy(r->culprit, why, sizeof r->culprit);
}

/* ---------------------------------------------------------------- matching */

static int same_group(const DOp *a, const DOp *b) { return a->first == b->first && strcmp(a->group, b->group) == 0; }
static int same_call(const DOp *a, const DOp *b) {
    return strcmp(a->op, b->op) == 0 && strcmp(a->dtype, b->dtype) == 0 && a->count == b->count &&
           (strcmp(a->op, "broadcast") != 0 || a->peer == b->peer);
}
/* Rank r's collective number `coll` on the group of `like`; NULL if not in its window. */
static const DOp *find_coll(const DRank *r, const DOp *like, uint64_t coll) {
    for (int i = r->n - 1; i >= 0; i--)
        if (!r->ops[i].p2p && r->ops[i].coll == coll && same_group(&r->ops[i], like)) return &r->ops[i];
    return NULL;
}
/* Rank r's latest collective on the group of `like`; NULL if none. */
static const DOp *last_on(const DRank *r, const DOp *like) {
    for (int i = r->n - 1; i >= 0; i--)
        if (!r->ops[i].p2p && same_group(&r->ops[i], like)) return &r->ops[i];
    return NULL;
}
/* Is rank q in the group of `like`? Its window says so, or the group is the whole world. */
static int member(const Doc *d, int q, const DOp *like) {
    if (like->gsize == d->world) return 1;
    return last_on(&d->r[q], like) != NULL;
}

/* Distinct groups (name, first member) over every rank's window; out[] points at one op of each. */
static int list_groups(const Doc *d, const DOp **out, int max) {
    int n = 0;
    for (int q = 0; q < d->world; q++)
        for (int i = 0; i < d->r[q].n; i++) {
            const DOp *o = &d->r[q].ops[i];
            if (o->first < 0 || o->p2p) continue; /* -1: the exchange that makes a group */
            int seen = 0;
            for (int k = 0; k < n && !seen; k++) seen = same_group(out[k], o);
            if (!seen && n < max) out[n++] = o;
        }
    return n;
}

/* ---------------------------------------------------------------- findings */

static int is_fatal(const char *reason) {
    return strcmp(reason, "SIGSEGV") == 0 || strcmp(reason, "SIGABRT") == 0 || strcmp(reason, "SIGBUS") == 0;
}

/* Crashed ranks, and ranks whose watchdog fired outside a collective (stuck
 * in compute or I/O: the others wait for them). */
static void find_crashes(Doc *d) {
    for (int q = 0; q < d->world; q++) {
        DRank *r = &d->r[q];
        if (r->flight && strcmp(r->reason, "stall") == 0) {
            char desc[160], why[400];
            if (r->wait) {
                op_desc(r->wait, desc, sizeof desc);
                fprintf(d->out, "stall: rank %d's watchdog fired while it waited in %s\n", q, desc);
                continue;
            }
            fprintf(d->out, "stall: rank %d on %s (pid %d) made no progress in step %d, phase %s, outside any "
                            "collective (the watchdog fired): stuck in compute or I/O\n",
                    q, host_of(r), r->pid, r->step, r->phase);
            snprintf(why, sizeof why, "stuck in step %d, phase %s, outside any collective (watchdog)", r->step,
                     r->phase);
            name_culprit(d, q, why);
            continue;
        }
        if (!r->flight || !is_fatal(r->reason)) continue;
        char last[160] = "none recorded", why[400];
        if (r->n) op_desc(&r->ops[r->n - 1], last, sizeof last);
        const DOp *lo = r->n ? &r->ops[r->n - 1] : NULL;
        fprintf(d->out, "crash: rank %d on %s (pid %d) died of %s in step %d, phase %s; its last operation: %s%s\n",
                q, host_of(r), r->pid, r->reason, r->step, r->phase, last,
                !lo ? "" : !isnan(lo->completed) ? " (completed)" : " (not completed)");
        snprintf(why, sizeof why, "died of %s in step %d, phase %s", r->reason, r->step, r->phase);
        name_culprit(d, q, why);
    }
}

/* Ranks that called different collectives at the same number of one group:
 * the first such number per group, the majority's call against the others. */
static int find_mismatches(Doc *d, const DOp *const *groups, int ng) {
    int *in = xcalloc((size_t)d->world, sizeof(int)), found = 0;
    for (int gi = 0; gi < ng; gi++) {
        const DOp *g = groups[gi];
        uint64_t worst = UINT64_MAX;
        /* the lowest collective number at which two ranks' windows disagree */
        int ref = -1;
        for (int q = 0; q < d->world && ref < 0; q++)
            if (last_on(&d->r[q], g)) ref = q;
        for (int q = 0; q < d->world; q++) {
            if (q == ref) continue;
            const DRank *r = &d->r[q];
            for (int i = 0; i < r->n; i++) {
                const DOp *o = &r->ops[i];
                if (o->p2p || !same_group(o, g) || o->coll >= worst) continue;
                const DOp *x = find_coll(&d->r[ref], g, o->coll);
                if (x && !same_call(x, o)) worst = o->coll;
            }
        }
        if (worst == UINT64_MAX) continue;
        /* classes of calls at that number: the largest is the reference */
        const DOp *at[64];
        int na = 0, best = -1, best_n = 0;
        for (int q = 0; q < d->world; q++) {
            const DOp *o = find_coll(&d->r[q], g, worst);
            if (!o) continue;
            int k = 0;
            while (k < na && !same_call(at[k], o)) k++;
            if (k == na && na < 64) at[na++] = o;
        }
        for (int k = 0; k < na; k++) {
            int c = 0;
            for (int q = 0; q < d->world; q++) {
                const DOp *o = find_coll(&d->r[q], g, worst);
                c += o && same_call(o, at[k]);
            }
            if (c > best_n) best_n = c, best = k;
        }
        char line[2048], desc[160], list[512];
        int k = 0;
        memset(in, 0, (size_t)d->world * sizeof(int));
        for (int q = 0; q < d->world; q++) {
            const DOp *o = find_coll(&d->r[q], g, worst);
            in[q] = o && same_call(o, at[best]);
        }
        rank_list(in, d->world, list, sizeof list);
        op_desc(at[best], desc, sizeof desc);
        k += snprintf(line + k, sizeof line - k, "mismatch: group %s's collective #%llu: rank%s %s called %s", g->group,
                      (unsigned long long)at[best]->seq, count_flags(in, d->world) > 1 ? "s" : "", list, desc);
        for (int q = 0; q < d->world && k < (int)sizeof line - 300; q++) {
            const DOp *o = find_coll(&d->r[q], g, worst);
            if (!o || in[q]) continue;
            op_desc(o, desc, sizeof desc);
            k += snprintf(line + k, sizeof line - k, "; rank %d on %s called %s (step %d, phase %s)", q,
                          host_of(&d->r[q]), desc, o->step, o->phase);
            char why[400];
            snprintf(why, sizeof why, "called %s where the others called %s #%llu", desc, at[best]->op,
                     (unsigned long long)at[best]->seq);
            name_culprit(d, q, why);
        }
        fprintf(d->out, "%s\n", line);
        found++;
    }
    free(in);
    return found;
}

/* Was the job hung when the files were written? A dump of a hang's reason,
 * or an operation waited on past --stuck-after. */
static int hang_context(const Doc *d) {
    for (int q = 0; q < d->world; q++) {
        const DRank *r = &d->r[q];
        if (!r->flight) continue;
        if (strcmp(r->reason, "timeout") == 0 || strcmp(r->reason, "peer_timeout") == 0 ||
            strcmp(r->reason, "stall") == 0 || strcmp(r->reason, "mismatch") == 0 ||
            strcmp(r->reason, "comm_error") == 0)
            return 1;
        if (r->wait && r->time - r->wait->posted >= d->o.stuck_after_s) return 1;
    }
    return 0;
}

/* Where rank q is instead: "waits in world all_reduce_max #5 (3 f64) (step 3, phase optimizer)" */
static void where_instead(const Doc *d, int q, char *buf, size_t n) {
    const DRank *r = &d->r[q];
    char desc[160];
    if (r->flight && r->wait) {
        op_desc(r->wait, desc, sizeof desc);
        snprintf(buf, n, "waits in %s instead (step %d, phase %s)", desc, r->wait->step, r->wait->phase);
    } else if (r->flight) {
        snprintf(buf, n, "is not in a collective: step %d, phase %s (stuck in compute or I/O?)", r->step, r->phase);
    } else if (r->hb) {
        snprintf(buf, n, "wrote no flight file (it never answered: stuck outside a collective, or dead); its "
                         "heartbeat says step %d, phase %s, %.1f s before the newest file",
                 r->hb_step, r->hb_phase, d->newest - r->hb_time);
    } else {
        snprintf(buf, n, "left no flight file and no heartbeat");
    }
}

/* The collective most ranks wait in, and every member of its group that is not there. */
static void find_hang(Doc *d) {
    if (!hang_context(d)) return;
    /* classes of waits: (group, collective number, call) */
    const DOp *cls[256];
    int ncls = 0, cnt[256] = {0};
    for (int q = 0; q < d->world; q++) {
        const DOp *w = d->r[q].flight ? d->r[q].wait : NULL;
        if (!w) continue;
        int k = 0;
        while (k < ncls && !(same_group(cls[k], w) && cls[k]->coll == w->coll && cls[k]->p2p == w->p2p &&
                             same_call(cls[k], w)))
            k++;
        if (k == ncls) {
            if (ncls == 256) continue;
            cls[ncls++] = w;
        }
        cnt[k]++;
    }
    if (ncls == 0) {
        fprintf(d->out, "hang: no rank was waiting in an operation when its file was written\n");
        return;
    }
    /* the largest class; on a tie, the one furthest back in the step: the
     * ranks there wait for one that went ahead (a skipped collective) */
    int best = 0;
    for (int k = 1; k < ncls; k++) {
        const DOp *a = cls[k], *b = cls[best];
        int earlier = a->step < b->step || (a->step == b->step && phase_index(a->phase) < phase_index(b->phase));
        if (cnt[k] > cnt[best] || (cnt[k] == cnt[best] && earlier)) best = k;
    }
    const DOp *ref = cls[best];
    int *in = xcalloc((size_t)d->world, sizeof(int));
    double waited = 0;
    for (int q = 0; q < d->world; q++) {
        const DOp *w = d->r[q].flight ? d->r[q].wait : NULL;
        in[q] = w && same_group(w, ref) && w->coll == ref->coll && same_call(w, ref);
        if (in[q] && d->r[q].time - w->posted > waited) waited = d->r[q].time - w->posted;
    }
    char list[512], desc[160], line[4096];
    rank_list(in, d->world, list, sizeof list);
    op_desc(ref, desc, sizeof desc);
    int k = snprintf(line, sizeof line, "hang: rank%s %s wait%s in %s, posted in step %d, phase %s, for up to %.1f s",
                     count_flags(in, d->world) > 1 ? "s" : "", list, count_flags(in, d->world) > 1 ? "" : "s", desc,
                     ref->step, ref->phase, waited);
    int missing = 0, unknown = ref->gsize;
    for (int q = 0; q < d->world && k < (int)sizeof line - 600; q++) {
        if (in[q]) {
            unknown--;
            continue;
        }
        if (!member(d, q, ref)) continue;
        unknown--;
        const DRank *r = &d->r[q];
        char why[400], where[300];
        const DOp *last = ref->p2p ? NULL : last_on(r, ref);
        where_instead(d, q, where, sizeof where);
        if (last && last->coll < ref->coll) {
            call_desc(last, desc, sizeof desc);
            k += snprintf(line + k, sizeof line - k, "; rank %d on %s never posted it: it is at %s #%llu (%s, %s in "
                                                     "step %d, phase %s) and %s",
                          q, host_of(r), ref->group, (unsigned long long)last->seq, desc,
                          isnan(last->completed) ? "not completed" : "completed", last->step, last->phase, where);
            snprintf(why, sizeof why, "never posted %s %s #%llu (it is at #%llu)", ref->group, ref->op,
                     (unsigned long long)ref->seq, (unsigned long long)last->seq);
        } else if (last && last->coll == ref->coll) {
            op_desc(last, desc, sizeof desc);
            k += snprintf(line + k, sizeof line - k, "; rank %d on %s posted %s as that collective%s%s", q,
                          host_of(r), desc, r->wait == last ? " and waits in it" : " and ",
                          r->wait == last ? "" : where);
            snprintf(why, sizeof why, "called %s where the others wait in %s %s #%llu", desc, ref->group, ref->op,
                     (unsigned long long)ref->seq);
        } else if (last) {
            op_desc(last, desc, sizeof desc);
            k += snprintf(line + k, sizeof line - k, "; rank %d on %s is past it (at %s) and %s", q, host_of(r), desc,
                          where);
            snprintf(why, sizeof why, "past %s %s #%llu while others wait in it", ref->group, ref->op,
                     (unsigned long long)ref->seq);
        } else {
            k += snprintf(line + k, sizeof line - k, "; rank %d on %s never posted it and %s", q, host_of(r), where);
            snprintf(why, sizeof why, "never posted %s %s #%llu", ref->group, ref->op, (unsigned long long)ref->seq);
        }
        name_culprit(d, q, why);
        missing++;
    }
    if (unknown > 0 && k < (int)sizeof line - 200)
        k += snprintf(line + k, sizeof line - k, "; %d more member(s) of group %s left no file to say where they are",
                      unknown, ref->group);
    if (!missing && unknown <= 0 && k < (int)sizeof line - 200)
        snprintf(line + k, sizeof line - k, "; every member is there: the operation itself does not complete "
                                            "(network, NCCL: see docs/parallel.md)");
    fprintf(d->out, "%s\n", line);
    free(in);
}

/* Per phase, who arrives last at the collectives every rank's window holds:
 * lateness = its post time minus the first rank's (hosts' clocks: on several
 * hosts their skew adds in). */
static void find_slow(Doc *d, const DOp *const *groups, int ng) {
    int W = d->world;
    double *late = xcalloc((size_t)(NPHASE + 1) * W, sizeof(double));
    int *last = xcalloc((size_t)(NPHASE + 1) * W, sizeof(int));
    int matched[NPHASE + 1] = {0}, total = 0, lo_step = 0, hi_step = 0, nr = 0;
    const DOp **at = xcalloc((size_t)W, sizeof(DOp *));
    for (int gi = 0; gi < ng; gi++) {
        const DOp *g = groups[gi];
        int ref = -1, members = 0;
        for (int q = 0; q < W; q++)
            if (last_on(&d->r[q], g)) members++, ref = ref < 0 ? q : ref;
        if (members < 2) continue;
        nr = members > nr ? members : nr;
        const DRank *rr = &d->r[ref];
        for (int i = 0; i < rr->n; i++) {
            const DOp *o = &rr->ops[i];
            if (o->p2p || !same_group(o, g) || isnan(o->completed)) continue;
            int all = 1;
            double first = INFINITY;
            int who_last = -1;
            double t_last = -INFINITY;
            for (int q = 0; q < W && all; q++) {
                at[q] = NULL;
                if (!last_on(&d->r[q], g)) continue;
                at[q] = find_coll(&d->r[q], g, o->coll);
                all = at[q] && !isnan(at[q]->completed) && same_call(at[q], o);
                if (all && at[q]->posted < first) first = at[q]->posted;
                if (all && at[q]->posted > t_last) t_last = at[q]->posted, who_last = q;
            }
            if (!all) continue;
            for (int q = 0; q < W; q++) {
                if (!at[q]) continue;
                int p = phase_index(at[q]->phase);
                late[(size_t)p * W + q] += at[q]->posted - first;
            }
            int p = phase_index(o->phase);
            matched[p]++;
            last[(size_t)p * W + who_last]++;
            if (!total || o->step < lo_step) lo_step = o->step;
            if (!total || o->step > hi_step) hi_step = o->step;
            total++;
        }
    }
    if (total == 0) {
        fprintf(d->out, "slow: no collective is in every rank's window: nothing to compare\n");
    } else {
        fprintf(d->out, "slow: %d collective(s) held by every member's window (steps %d-%d, groups of up to %d "
                        "ranks); by the phase each was posted in, the rank that arrives last:\n",
                total, lo_step, hi_step, nr);
        for (int p = 0; p <= NPHASE; p++) {
            if (!matched[p]) continue;
            int worst = 0;
            for (int q = 1; q < W; q++)
                if (late[(size_t)p * W + q] > late[(size_t)p * W + worst]) worst = q;
            double others = 0;
            for (int q = 0; q < W; q++)
                if (q != worst && late[(size_t)p * W + q] > others) others = late[(size_t)p * W + q];
            double mean = late[(size_t)p * W + worst] / matched[p] * 1e3, omean = others / matched[p] * 1e3;
            int lasts = last[(size_t)p * W + worst];
            /* a straggler: last at three quarters of at least 4 collectives, --slow-ms late on average */
            int straggler = matched[p] >= 4 && 4 * lasts >= 3 * matched[p] && mean >= d->o.slow_ms;
            fprintf(d->out, "  %-10s rank %d on %s arrives %.2f ms after the first on average, last at %d of %d "
                            "(the other ranks: at most %.2f ms)%s\n",
                    p < NPHASE ? phase_order[p] : "other", worst, host_of(&d->r[worst]), mean, lasts, matched[p],
                    omean, straggler ? "  <- straggler" : "");
            if (straggler) {
                char why[400];
                snprintf(why, sizeof why, "straggler in phase %s: %.1f ms late on average, last at %d of %d collectives",
                         p < NPHASE ? phase_order[p] : "other", mean, lasts, matched[p]);
                name_culprit(d, worst, why);
            }
        }
    }
    free(at);
    free(late);
    free(last);
}

/* ---------------------------------------------------------------- report */

static void print_ranks(Doc *d, int nflight, int nhb) {
    fprintf(d->out, "doctor: %s: %d rank(s); flight files from %d, heartbeats from %d\n", d->dir, d->world, nflight,
            nhb);
    for (int q = 0; q < d->world; q++) {
        const DRank *r = &d->r[q];
        char desc[160];
        if (r->flight) {
            char asked[32] = "";
            if (strcmp(r->reason, "peer_timeout") == 0) snprintf(asked, sizeof asked, " of rank %d", r->detail);
            fprintf(d->out, "  rank %d on %s (pid %d): file written on %s%s at step %d, phase %s; ", q, host_of(r),
                    r->pid, r->reason, asked, r->step, r->phase);
            if (r->wait) {
                op_desc(r->wait, desc, sizeof desc);
                fprintf(d->out, "waits %.1f s in %s\n", r->time - r->wait->posted, desc);
            } else {
                fprintf(d->out, "not waiting in a collective\n");
            }
        } else if (r->hb) {
            fprintf(d->out, "  rank %d on %s (pid %d): no flight file; heartbeat: step %d, phase %s%s\n", q, host_of(r),
                    r->hb_pid, r->hb_step, r->hb_phase, r->hb_stalled ? " (the watchdog fired)" : "");
        } else {
            fprintf(d->out, "  rank %d: no flight file, no heartbeat\n", q);
        }
    }
}

int doctor_run(const char *run_dir, const DoctorOptions *o, FILE *out) {
    struct stat st;
    if (stat(run_dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
        fprintf(stderr, "kiln: error: %s: not a directory (./train doctor RUN_DIR: a run's run.dir)\n", run_dir);
        return KILN_EXIT_USAGE;
    }
    Doc d = {.dir = run_dir, .out = out, .o = *o};
    int nhb = read_dir(&d, "heartbeat", read_heartbeat);
    int nflight = read_dir(&d, "flight", read_flight);
    if (nflight == 0 && nhb == 0) {
        fprintf(stderr, "kiln: error: %s: no flight/ or heartbeat/ files: not a run directory, or a run that never "
                        "started\n", run_dir);
        free(d.r);
        return KILN_EXIT_USAGE;
    }
    print_ranks(&d, nflight, nhb);
    if (nflight == 0) {
        fprintf(out, "no flight recorder files in %s/flight/: no rank hit a timeout, stall or fatal signal (a "
                     "healthy run writes none); for a snapshot of a running job send SIGUSR2 to every rank "
                     "(scancel --signal=USR2 JOB, or kill -USR2 the mpirun)\n", run_dir);
    } else {
        const DOp *groups[256];
        int ng = list_groups(&d, groups, 256);
        find_crashes(&d);
        /* a mismatch is why the ranks wait: the hang would only repeat it */
        if (!find_mismatches(&d, groups, ng)) find_hang(&d);
        find_slow(&d, groups, ng);
    }
    int named = 0;
    for (int q = 0; q < d.world; q++)
        if (d.r[q].culprit[0]) {
            fprintf(out, "culprit: rank %d on %s (pid %d): %s\n", q, host_of(&d.r[q]),
                    d.r[q].pid ? d.r[q].pid : d.r[q].hb_pid, d.r[q].culprit);
            named++;
        }
    fprintf(out, named ? "doctor: %d culprit(s) named (exit %d)\n" : "doctor: no culprit found (exit %d)\n",
            named ? named : DOCTOR_CLEAN, named ? DOCTOR_CULPRIT : DOCTOR_CLEAN);
    for (int q = 0; q < d.world; q++) free(d.r[q].ops);
    free(d.r);
    return named ? DOCTOR_CULPRIT : DOCTOR_CLEAN;
}

int doctor_main(int argc, char **argv) {
    DoctorOptions o = {.stuck_after_s = 10, .slow_ms = 5};
    const char *dir = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        double *v = strcmp(a, "--stuck-after") == 0 ? &o.stuck_after_s : strcmp(a, "--slow-ms") == 0 ? &o.slow_ms : NULL;
        if (v) {
            char *e = NULL;
            if (i + 1 < argc) *v = strtod(argv[++i], &e);
            if (!e || *e || !(*v >= 0))
                kiln_fail(KILN_EXIT_USAGE, "%s: expected a number >= 0, got '%s'", a, i < argc ? argv[i] : "");
        } else if (a[0] == '-') {
            kiln_fail_hint(KILN_EXIT_USAGE, "./train --help lists doctor's flags", "doctor: unknown flag '%s'", a);
        } else if (!dir) {
            dir = a;
        } else {
            kiln_fail(KILN_EXIT_USAGE, "doctor: one run directory, got '%s' and '%s'", dir, a);
        }
    }
    if (!dir) kiln_fail(KILN_EXIT_USAGE, "usage: ./train doctor RUN_DIR [--stuck-after S] [--slow-ms MS]");
    return doctor_run(dir, &o, stdout);
}
