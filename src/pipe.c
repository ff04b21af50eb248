/* pipe: stage cuts, the schedules' action lists, their checker, unit-cost
 * simulation and text timeline (see pipe.h). Pure: no model, backend or comm;
 * nothing here allocates after pipe_build but the checker's own scratch. */
#include "pipe.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

/* ---------------------------------------------------------------- names */

static const char *const kind_names[] = {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1"};

int pipe_kind_parse(const char *name) {
    for (int k = 0; k < 4; k++)
        if (!strcmp(name, kind_names[k])) return k;
    return -1;
}

const char *pipe_kind_name(PipeKind k) { return k >= 0 && k <= PIPE_ZB_H1 ? kind_names[k] : "?"; }

void pipe_action_text(const PipeAction *a, char *buf, size_t n) {
    static const char *ops[] = {"F", "B", "B-input", "B-weight"};
    const char *d = a->data == PIPE_ACT ? "act" : "grad";
    if (a->op == PIPE_SEND) snprintf(buf, n, "send %s m%d c%d -> rank %d", d, a->micro, a->chunk, a->peer);
    else if (a->op == PIPE_RECV) snprintf(buf, n, "recv %s m%d c%d <- rank %d", d, a->micro, a->chunk, a->peer);
    else if (a->op >= PIPE_FWD && a->op <= PIPE_BWD_W) snprintf(buf, n, "%s m%d c%d", ops[a->op], a->micro, a->chunk);
    else snprintf(buf, n, "op %d m%d c%d", (int)a->op, a->micro, a->chunk);
}

/* ---------------------------------------------------------------- stages */

/* One layer's training FLOPs per token and the head's (with the loss): the
 * cost model of the balanced cut (arch_flops_per_token's terms). */
static void layer_costs(const ArchSpec *s, double *layer, double *head) {
    double all = arch_flops_per_token(s, s->seq_len);
    *head = 6.0 * s->n_embd * s->vocab_size;
    *layer = (all - *head) / s->n_layer;
}

int pipe_plan_stages(const ArchSpec *s, int pp, int v, const int *given, int n_given, int *cut, char *err,
                     size_t errn) {
    int V = pp * v, L = s->n_layer;
    if (V > PIPE_MAX_STAGES) {
        snprintf(err, errn, "keys 'parallel.pp', 'parallel.pp_virtual': %d x %d virtual stages, at most %d", pp, v,
                 PIPE_MAX_STAGES);
        return -1;
    }
    if (L < V) {
        snprintf(err, errn, "keys 'parallel.pp', 'parallel.pp_virtual': %d x %d = %d stages need at least one layer "
                 "each, but model.n_layer is %d", pp, v, V, L);
        return -1;
    }
    cut[0] = 0;
    if (given && n_given > 0) {
        if (n_given != V) {
            snprintf(err, errn, "key 'parallel.pp_layers': %d entries, but pp x pp_virtual = %d stages need one "
                     "layer count each", n_given, V);
            return -1;
        }
        for (int i = 0; i < V; i++) {
            if (given[i] < 1) {
                snprintf(err, errn, "key 'parallel.pp_layers': entry %d is %d; every stage needs at least one "
                         "layer", i, given[i]);
                return -1;
            }
            cut[i + 1] = cut[i] + given[i];
        }
        if (cut[V] != L) {
            snprintf(err, errn, "key 'parallel.pp_layers': the counts add up to %d layers, model.n_layer is %d",
                     cut[V], L);
            return -1;
        }
        return 0;
    }
    /* best[i][k]: the least costliest-stage cost of layers [0, k) in i
     * stages, ties broken by the least sum of squared stage costs */
    double cl, ch;
    layer_costs(s, &cl, &ch);
    size_t W = (size_t)L + 1;
    double *best = xmalloc((size_t)(V + 1) * W * sizeof(double)), *sq = xmalloc((size_t)(V + 1) * W * sizeof(double));
    int *from = xmalloc((size_t)(V + 1) * W * sizeof(int));
    for (size_t j = 0; j < (size_t)(V + 1) * W; j++) best[j] = INFINITY, sq[j] = INFINITY, from[j] = -1;
    best[0] = 0, sq[0] = 0;
    for (int i = 1; i <= V; i++)
        for (int k = i; k <= L - (V - i); k++)
            for (int j = i - 1; j < k; j++) {
                double prev = best[(size_t)(i - 1) * W + j];
                if (!isfinite(prev)) continue;
                double c = (k - j) * cl + (i == V ? ch : 0.0);
                double b = prev > c ? prev : c, q = sq[(size_t)(i - 1) * W + j] + c * c;
                size_t at = (size_t)i * W + k;
                /* 1e-9 relative: costs are sums of the same few numbers */
                if (b < best[at] * (1 - 1e-9) || (b <= best[at] * (1 + 1e-9) && q < sq[at])) {
                    best[at] = b, sq[at] = q, from[at] = j;
                }
            }
    int k = L;
    for (int i = V; i >= 1; i--) {
        cut[i] = k;
        k = from[(size_t)i * W + k];
    }
    free(best), free(sq), free(from);
    return 0;
}

/* ---------------------------------------------------------------- shapes */

int pipe_check_shape(PipeKind k, int pp, int v, int micro, char *err, size_t errn) {
    if (pp < 2 || pp * v > PIPE_MAX_STAGES) {
        snprintf(err, errn, "key 'parallel.pp': a pipeline schedule needs 2 to %d stages (pp x pp_virtual), got %d x "
                 "%d", PIPE_MAX_STAGES, pp, v);
        return -1;
    }
    if (micro < 1) {
        snprintf(err, errn, "key 'batch.total_tokens': no micro-batch per data-parallel rank to pipeline");
        return -1;
    }
    if (k == PIPE_INTERLEAVED) {
        if (v < 2) {
            snprintf(err, errn, "key 'parallel.pp_virtual': interleaved_1f1b needs at least 2 chunks per rank, got "
                     "%d (pp_virtual 1 is plain 1f1b)", v);
            return -1;
        }
        if (micro % pp || micro < pp) {
            snprintf(err, errn, "keys 'batch.total_tokens', 'parallel.pp': interleaved_1f1b runs micro-batches in "
                     "groups of pp, but %d micro-batches per data-parallel rank are not a multiple of pp = %d; make "
                     "grad_accum / dp a multiple of %d", micro, pp, pp);
            return -1;
        }
    } else if (v != 1) {
        snprintf(err, errn, "key 'parallel.pp_virtual': %d chunks per rank need parallel.pp_schedule: "
                 "interleaved_1f1b (%s runs one)", v, pipe_kind_name(k));
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- the builder */

/* A rank's compute order before communication is placed: FWD / BWD /
 * BWD_IN / BWD_W of (micro, chunk). */
typedef struct Order {
    PipeAction *a;
    int n, cap;
} Order;

static void order_push(Order *o, PipeOp op, int micro, int chunk) {
    if (o->n == o->cap) o->cap = o->cap ? 2 * o->cap : 64, o->a = xrealloc(o->a, (size_t)o->cap * sizeof(PipeAction));
    o->a[o->n++] = (PipeAction){.op = op, .micro = micro, .chunk = chunk, .peer = -1, .slot = -1};
}

static void order_gpipe(Order *o, int M) {
    for (int m = 0; m < M; m++) order_push(o, PIPE_FWD, m, 0);
    for (int m = 0; m < M; m++) order_push(o, PIPE_BWD, m, 0);
}

/* 1F1B (PipeDream-flush): p - r - 1 warm-up forwards, then one forward and
 * one backward in turn, then the remaining backwards. */
static void order_1f1b(Order *o, int p, int r, int M) {
    int w = p - r - 1 < M ? p - r - 1 : M;
    for (int m = 0; m < w; m++) order_push(o, PIPE_FWD, m, 0);
    for (int i = 0; i < M - w; i++) order_push(o, PIPE_FWD, w + i, 0), order_push(o, PIPE_BWD, i, 0);
    for (int i = M - w; i < M; i++) order_push(o, PIPE_BWD, i, 0);
}

/* Megatron-LM's interleaved 1F1B: virtual micro-batch k of M v runs chunk
 * (k mod pv) / p (backwards: v - 1 minus that) on micro-batch (k / pv) p +
 * k mod p; (p - r - 1) 2 + (v - 1) p warm-up forwards (all of them when
 * M = p). */
static void order_interleaved(Order *o, int p, int v, int r, int M) {
    int total = M * v, w = M == p ? total : (p - r - 1) * 2 + (v - 1) * p;
    if (w > total) w = total;
#define CHUNK(k, fwd) ((fwd) ? ((k) % (p * v)) / p : v - 1 - ((k) % (p * v)) / p)
#define MICRO(k) (((k) / (p * v)) * p + (k) % p)
    for (int k = 0; k < w; k++) order_push(o, PIPE_FWD, MICRO(k), CHUNK(k, 1));
    for (int i = 0; i < total - w; i++) {
        int k = w + i;
        order_push(o, PIPE_FWD, MICRO(k), CHUNK(k, 1));
        order_push(o, PIPE_BWD, MICRO(i), CHUNK(i, 0));
    }
    for (int i = total - w; i < total; i++) order_push(o, PIPE_BWD, MICRO(i), CHUNK(i, 0));
#undef CHUNK
#undef MICRO
}

/* ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): the backward
 * split into B (input gradient) and W (weight gradient). Each rank keeps
 * 1F1B's order of forwards and B's and, in unit time steps, runs the next of
 * them when its input has arrived; otherwise (or when a forward would hold
 * more than p micro-batches, 1F1B's peak on the first stage) the oldest
 * pending W; the rest of the W's at the end. The W's fill 1F1B's bubbles,
 * leaving (p-1)(F + B - W) idle, a third of 1F1B's (p-1)(F + B + W) at equal
 * costs. */
static void order_zb_h1(Order *o, int p, int M) {
    Order *fb = xcalloc((size_t)p, sizeof(Order)); /* 1F1B's order, B for the whole backward */
    for (int r = 0; r < p; r++) order_1f1b(&fb[r], p, r, M);
    int *next = xcalloc((size_t)p, sizeof(int)), *nw = xcalloc((size_t)p, sizeof(int));
    int *nf = xcalloc((size_t)p, sizeof(int)), *nb = xcalloc((size_t)p, sizeof(int));
    long *fdone = xmalloc((size_t)p * M * sizeof(long)), *bdone = xmalloc((size_t)p * M * sizeof(long));
    for (size_t i = 0; i < (size_t)p * M; i++) fdone[i] = bdone[i] = -1;
#define DONE_BY(arr, r, m, t) ((arr)[(size_t)(r) * M + (m)] >= 0 && (arr)[(size_t)(r) * M + (m)] <= (t))
    int left = p;
    for (long t = 0; left > 0; t++) {
        /* every rank's action of time step t, from what finished by t */
        int op[PIPE_MAX_STAGES];
        for (int r = 0; r < p; r++) {
            op[r] = -1;
            if (next[r] < fb[r].n) {
                const PipeAction *x = &fb[r].a[next[r]];
                int m = x->micro;
                if (x->op == PIPE_FWD && m - nw[r] < p && (r == 0 || DONE_BY(fdone, r - 1, m, t))) op[r] = PIPE_FWD;
                if (x->op == PIPE_BWD && DONE_BY(fdone, r, m, t) && (r == p - 1 || DONE_BY(bdone, r + 1, m, t)))
                    op[r] = PIPE_BWD_IN;
            }
            if (op[r] < 0 && nw[r] < nb[r]) op[r] = PIPE_BWD_W;
        }
        for (int r = 0; r < p; r++) {
            if (op[r] == PIPE_FWD) {
                fdone[(size_t)r * M + nf[r]] = t + 1;
                order_push(&o[r], PIPE_FWD, nf[r]++, 0), next[r]++;
            } else if (op[r] == PIPE_BWD_IN) {
                bdone[(size_t)r * M + nb[r]] = t + 1;
                order_push(&o[r], PIPE_BWD_IN, nb[r]++, 0), next[r]++;
            } else if (op[r] == PIPE_BWD_W) {
                order_push(&o[r], PIPE_BWD_W, nw[r]++, 0);
                if (nw[r] == M) left--;
            }
        }
    }
#undef DONE_BY
    for (int r = 0; r < p; r++) free(fb[r].a);
    free(fb), free(next), free(nw), free(nf), free(nb), free(fdone), free(bdone);
}

static int release_op(PipeKind k) { return k == PIPE_ZB_H1 ? PIPE_BWD_W : PIPE_BWD; }

/* A receive to place: before compute `at` of its rank's order. */
typedef struct Post {
    PipeAction a;
    int at, seq;
} Post;

static int post_cmp(const void *x, const void *y) {
    const Post *a = x, *b = y;
    return a->at != b->at ? (a->at > b->at) - (a->at < b->at) : (a->seq > b->seq) - (a->seq < b->seq);
}

/* Where each rank's order runs each (chunk, micro-batch)'s forward and its
 * releasing op: [(r * v + chunk) * M + micro], -1 if absent; an index,
 * since a search builds schedules of thousands of micro-batches and a scan
 * per receive made that quadratic. */
static void order_index(const Order *o, int p, int v, int M, int rel, int *at_fwd, int *at_rel) {
    for (size_t i = 0; i < (size_t)p * v * M; i++) at_fwd[i] = at_rel[i] = -1;
    for (int r = 0; r < p; r++)
        for (int i = 0; i < o[r].n; i++) {
            const PipeAction *x = &o[r].a[i];
            size_t k = ((size_t)r * v + x->chunk) * M + x->micro;
            if (x->op == PIPE_FWD && at_fwd[k] < 0) at_fwd[k] = i;
            if ((int)x->op == rel && at_rel[k] < 0) at_rel[k] = i;
        }
}

/* Communication around the compute orders: each send right after the
 * compute that makes its data; each receive as early as its buffer allows
 * (an activation: once the slot's previous micro-batch is released; a
 * gradient: after its forward), never ahead of an earlier message of the
 * same channel (so NCCL, which matches in order, pairs them right). Slots:
 * micro-batch m of chunk c uses slot m mod K_c, K_c the most micro-batches
 * the order holds at once (forwards and releases run in micro-batch order). */
static void place_comm(PipeSchedule *s, Order *o) {
    int p = s->pp, v = s->v, M = s->micro, V = p * v;
    int rel = release_op(s->kind);
    for (int r = 0; r < p; r++)
        for (int c = 0; c < v; c++) {
            int held = 0, most = 0;
            for (int i = 0; i < o[r].n; i++) {
                if (o[r].a[i].chunk != c) continue;
                if (o[r].a[i].op == PIPE_FWD) held++;
                if ((int)o[r].a[i].op == rel) held--;
                most = held > most ? held : most;
            }
            s->slots[r * v + c] = most > 0 ? most : 1;
        }
    Post **posts = xcalloc((size_t)p, sizeof(Post *));
    int *np = xcalloc((size_t)p, sizeof(int)), *cap = xcalloc((size_t)p, sizeof(int));
    int *at_fwd = xmalloc((size_t)p * v * M * sizeof(int)), *at_rel = xmalloc((size_t)p * v * M * sizeof(int));
    order_index(o, p, v, M, rel, at_fwd, at_rel);
    /* each channel is (sender rank, data): its receiver is fixed */
    for (int src = 0; src < p; src++)
        for (int d = 0; d < 2; d++) {
            int last_at = 0, seq = 0;
            for (int i = 0; i < o[src].n; i++) {
                const PipeAction *x = &o[src].a[i];
                int vs = x->chunk * p + src;
                int makes = d == PIPE_ACT ? x->op == PIPE_FWD && vs < V - 1
                                          : (x->op == PIPE_BWD || x->op == PIPE_BWD_IN) && vs > 0;
                if (!makes) continue;
                int to = d == PIPE_ACT ? vs + 1 : vs - 1, dst = to % p, c = to / p, m = x->micro;
                int K = s->slots[dst * v + c], at;
                if (d == PIPE_ACT) {
                    at = m >= K ? at_rel[((size_t)dst * v + c) * M + m - K] + 1 : 0;
                } else {
                    at = at_fwd[((size_t)dst * v + c) * M + m] + 1;
                }
                if (at < last_at) at = last_at;
                last_at = at;
                if (np[dst] == cap[dst]) {
                    cap[dst] = cap[dst] ? 2 * cap[dst] : 64;
                    posts[dst] = xrealloc(posts[dst], (size_t)cap[dst] * sizeof(Post));
                }
                posts[dst][np[dst]++] = (Post){{.op = PIPE_RECV, .data = (PipeData)d, .micro = m, .chunk = c,
                                                .peer = src, .slot = m % K},
                                               at, (src * 2 + d) * (M * v + 1) + seq++};
            }
        }
    for (int r = 0; r < p; r++) {
        qsort(posts[r], (size_t)np[r], sizeof(Post), post_cmp);
        int n = 0, k = 0, total = o[r].n + np[r];
        for (int i = 0; i < o[r].n; i++) {
            const PipeAction *x = &o[r].a[i];
            int vs = x->chunk * p + r;
            if (x->op == PIPE_FWD && vs < V - 1) total++;
            if ((x->op == PIPE_BWD || x->op == PIPE_BWD_IN) && vs > 0) total++;
        }
        PipeAction *out = xmalloc((size_t)total * sizeof(PipeAction));
        for (int i = 0; i < o[r].n; i++) {
            while (k < np[r] && posts[r][k].at <= i) out[n++] = posts[r][k++].a;
            PipeAction x = o[r].a[i];
            int vs = x.chunk * p + r, K = s->slots[r * v + x.chunk];
            x.slot = x.micro % K;
            out[n++] = x;
            if (x.op == PIPE_FWD && vs < V - 1)
                out[n++] = (PipeAction){.op = PIPE_SEND, .data = PIPE_ACT, .micro = x.micro, .chunk = x.chunk,
                                        .peer = (vs + 1) % p, .slot = x.slot};
            if ((x.op == PIPE_BWD || x.op == PIPE_BWD_IN) && vs > 0)
                out[n++] = (PipeAction){.op = PIPE_SEND, .data = PIPE_GRAD, .micro = x.micro, .chunk = x.chunk,
                                        .peer = (vs - 1) % p, .slot = x.slot};
        }
        while (k < np[r]) out[n++] = posts[r][k++].a; /* none: every receive precedes its consumer */
        s->a[r] = out;
        s->n[r] = n;
        free(posts[r]);
    }
    free(posts), free(np), free(cap), free(at_fwd), free(at_rel);
}

void pipe_build(PipeSchedule *s, PipeKind k, int pp, int v, int micro) {
    char err[512];
    if (pipe_check_shape(k, pp, v, micro, err, sizeof err) != 0) kiln_fail(KILN_EXIT_USAGE, "%s", err);
    memset(s, 0, sizeof *s);
    s->kind = k, s->pp = pp, s->v = v, s->micro = micro;
    s->n = xcalloc((size_t)pp, sizeof(int));
    s->a = xcalloc((size_t)pp, sizeof(PipeAction *));
    s->slots = xcalloc((size_t)pp * v, sizeof(int));
    Order *o = xcalloc((size_t)pp, sizeof(Order));
    if (k == PIPE_ZB_H1) order_zb_h1(o, pp, micro);
    for (int r = 0; r < pp && k != PIPE_ZB_H1; r++) {
        if (k == PIPE_GPIPE) order_gpipe(&o[r], micro);
        else if (k == PIPE_1F1B) order_1f1b(&o[r], pp, r, micro);
        else order_interleaved(&o[r], pp, v, r, micro);
    }
    place_comm(s, o);
    for (int r = 0; r < pp; r++) free(o[r].a);
    free(o);
}

void pipe_schedule_free(PipeSchedule *s) {
    for (int r = 0; s->a && r < s->pp; r++) free(s->a[r]);
    free(s->a), free(s->n), free(s->slots);
    memset(s, 0, sizeof *s);
}

/* ---------------------------------------------------------------- the checker */

/* Per-rank bookkeeping of the simulation, indexed [chunk * M + micro]. */
typedef struct RankSim {
    int pc;
    double t;          /* clock of the unit-cost simulation */
    int *fwd, *bwd_in, *bwd_w; /* action index that ran it, -1 not yet */
    int *recv_act, *recv_grad; /* action index of the receive posted, -1 none */
    int *send_act, *send_grad; /* action index of the send posted, -1 none */
    double *act_at, *grad_at;  /* arrival time of the received data (the send's time) */
    double *act_post, *grad_post; /* time the receive was posted */
    int *occupant;     /* [chunk * slots_max + slot]: micro-batch in the slot, -1 free */
    int *out_act, *out_grad; /* [chunk * slots_max + slot]: micro-batch of the latest send from the slot, -1 none */
    double busy;
} RankSim;

typedef struct Sim {
    const PipeSchedule *s;
    int V, kmax;
    RankSim *rk;
    char *err;
    size_t errn;
    char **grid;   /* pipe_timeline: [pp] rows of `cells` cells of cw characters, or NULL */
    int cw, cells;
} Sim;

static int fail_at(Sim *sim, int r, int i, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int fail_at(Sim *sim, int r, int i, const char *fmt, ...) {
    char what[96] = "", why[400];
    if (i >= 0 && i < sim->s->n[r]) pipe_action_text(&sim->s->a[r][i], what, sizeof what);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    if (i >= 0) snprintf(sim->err, sim->errn, "%s schedule: rank %d, action %d (%s): %s", pipe_kind_name(sim->s->kind),
                         r, i, what, why);
    else snprintf(sim->err, sim->errn, "%s schedule: rank %d: %s", pipe_kind_name(sim->s->kind), r, why);
    return -1;
}

static void sim_free(Sim *sim) {
    for (int r = 0; sim->rk && r < sim->s->pp; r++) {
        RankSim *k = &sim->rk[r];
        free(k->fwd), free(k->bwd_in), free(k->bwd_w), free(k->recv_act), free(k->recv_grad), free(k->send_act);
        free(k->send_grad), free(k->act_at), free(k->grad_at), free(k->act_post), free(k->grad_post);
        free(k->occupant), free(k->out_act), free(k->out_grad);
    }
    free(sim->rk);
}

static int *ints(size_t n) {
    int *x = xmalloc(n * sizeof(int));
    for (size_t i = 0; i < n; i++) x[i] = -1;
    return x;
}
static double *times(size_t n) {
    double *x = xmalloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++) x[i] = -1;
    return x;
}

static void sim_init(Sim *sim, const PipeSchedule *s, char *err, size_t errn) {
    memset(sim, 0, sizeof *sim);
    sim->s = s, sim->err = err, sim->errn = errn, sim->V = s->pp * s->v;
    sim->kmax = 1;
    for (int i = 0; i < s->pp * s->v; i++) sim->kmax = s->slots[i] > sim->kmax ? s->slots[i] : sim->kmax;
    size_t mc = (size_t)s->micro * s->v, ks = (size_t)s->v * sim->kmax;
    sim->rk = xcalloc((size_t)s->pp, sizeof(RankSim));
    for (int r = 0; r < s->pp; r++) {
        RankSim *k = &sim->rk[r];
        k->fwd = ints(mc), k->bwd_in = ints(mc), k->bwd_w = ints(mc), k->recv_act = ints(mc), k->recv_grad = ints(mc);
        k->send_act = ints(mc), k->send_grad = ints(mc);
        k->act_at = times(mc), k->grad_at = times(mc), k->act_post = times(mc), k->grad_post = times(mc);
        k->occupant = ints(ks), k->out_act = ints(ks), k->out_grad = ints(ks);
    }
}

/* Static checks of rank r's list alone: fields, order of each (micro,
 * chunk)'s actions, receives before their consumers, slots. */
static int check_rank(Sim *sim, int r) {
    const PipeSchedule *s = sim->s;
    int p = s->pp, v = s->v, M = s->micro, V = sim->V, split = s->kind == PIPE_ZB_H1;
    RankSim *k = &sim->rk[r];
    for (int i = 0; i < s->n[r]; i++) {
        const PipeAction *a = &s->a[r][i];
        if (a->op < PIPE_FWD || a->op > PIPE_RECV || a->micro < 0 || a->micro >= M || a->chunk < 0 || a->chunk >= v)
            return fail_at(sim, r, i, "micro-batch, chunk or operation out of range (%d micro-batches, %d chunks)", M,
                           v);
        int K = s->slots[r * v + a->chunk];
        if (a->slot < 0 || a->slot >= K)
            return fail_at(sim, r, i, "slot %d, but chunk %d holds %d slot(s)", a->slot, a->chunk, K);
        int vs = a->chunk * p + r, x = a->chunk * M + a->micro, *occ = &k->occupant[a->chunk * sim->kmax + a->slot];
        int first = vs == 0, last = vs == V - 1;
        switch (a->op) {
        case PIPE_FWD:
            if (k->fwd[x] >= 0) return fail_at(sim, r, i, "a second forward (the first is action %d)", k->fwd[x]);
            if (!first && k->recv_act[x] < 0)
                return fail_at(sim, r, i, "uses its input activation before any receive of it is posted");
            if (first && *occ >= 0)
                return fail_at(sim, r, i, "slot %d still holds micro-batch %d, whose backward has not run", a->slot,
                               *occ);
            if (!first && *occ != a->micro)
                return fail_at(sim, r, i, "its input was received into another slot");
            *occ = a->micro;
            k->fwd[x] = i;
            break;
        case PIPE_BWD:
        case PIPE_BWD_IN:
            if (split != (a->op == PIPE_BWD_IN))
                return fail_at(sim, r, i, "%s splits the backward %s", pipe_kind_name(s->kind),
                               split ? "into its input and weight parts" : "into none: one whole backward");
            if (k->fwd[x] < 0) return fail_at(sim, r, i, "a backward before its forward");
            if (k->bwd_in[x] >= 0)
                return fail_at(sim, r, i, "a second backward (the first is action %d)", k->bwd_in[x]);
            if (!last && k->recv_grad[x] < 0)
                return fail_at(sim, r, i, "uses its output gradient before any receive of it is posted");
            if (*occ != a->micro) return fail_at(sim, r, i, "slot %d does not hold this micro-batch", a->slot);
            k->bwd_in[x] = i;
            if (a->op == PIPE_BWD) *occ = -1, k->bwd_w[x] = i;
            break;
        case PIPE_BWD_W:
            if (!split) return fail_at(sim, r, i, "%s has no separate weight-gradient pass", pipe_kind_name(s->kind));
            if (k->bwd_in[x] < 0) return fail_at(sim, r, i, "a weight gradient before its input gradient");
            if (k->bwd_w[x] >= 0)
                return fail_at(sim, r, i, "a second weight pass (the first is action %d)", k->bwd_w[x]);
            if (*occ != a->micro) return fail_at(sim, r, i, "slot %d does not hold this micro-batch", a->slot);
            k->bwd_w[x] = i;
            *occ = -1;
            break;
        case PIPE_SEND: {
            int to = a->data == PIPE_ACT ? vs + 1 : vs - 1;
            if (to < 0 || to >= V)
                return fail_at(sim, r, i, "virtual stage %d has no %s stage to send to", vs,
                               a->data == PIPE_ACT ? "next" : "previous");
            if (a->peer != to % p) return fail_at(sim, r, i, "stage %d is on rank %d, not %d", to, to % p, a->peer);
            if (a->data == PIPE_ACT ? k->fwd[x] < 0 : k->bwd_in[x] < 0)
                return fail_at(sim, r, i, "sends %s before computing it", a->data == PIPE_ACT ? "an activation"
                                                                                               : "a gradient");
            int *sent = a->data == PIPE_ACT ? &k->send_act[x] : &k->send_grad[x];
            if (*sent >= 0) return fail_at(sim, r, i, "a second send of it (the first is action %d)", *sent);
            *sent = i;
            break;
        }
        case PIPE_RECV: {
            int from = a->data == PIPE_ACT ? vs - 1 : vs + 1;
            if (from < 0 || from >= V)
                return fail_at(sim, r, i, "virtual stage %d has no %s stage to receive from", vs,
                               a->data == PIPE_ACT ? "previous" : "next");
            if (a->peer != from % p)
                return fail_at(sim, r, i, "stage %d is on rank %d, not %d", from, from % p, a->peer);
            int *got = a->data == PIPE_ACT ? &k->recv_act[x] : &k->recv_grad[x];
            if (*got >= 0) return fail_at(sim, r, i, "a second receive of it (the first is action %d)", *got);
            if (a->data == PIPE_ACT) {
                if (k->fwd[x] >= 0) return fail_at(sim, r, i, "receives the input of a forward that already ran");
                if (*occ >= 0)
                    return fail_at(sim, r, i, "slot %d still holds micro-batch %d, whose backward has not run",
                                   a->slot, *occ);
                *occ = a->micro;
            } else {
                if (k->bwd_in[x] >= 0)
                    return fail_at(sim, r, i, "receives the gradient of a backward that already ran");
                if (*occ != a->micro) return fail_at(sim, r, i, "slot %d does not hold this micro-batch", a->slot);
            }
            *got = i;
            break;
        }
        }
    }
    /* everything of every (micro, chunk) is there */
    for (int c = 0; c < v; c++)
        for (int m = 0; m < M; m++) {
            int x = c * M + m, vs = c * p + r;
            const char *missing = k->fwd[x] < 0 ? "its forward" : k->bwd_in[x] < 0 ? "its backward"
                                  : k->bwd_w[x] < 0 ? "its weight-gradient pass"
                                  : vs < V - 1 && k->send_act[x] < 0 ? "the send of its activation"
                                  : vs > 0 && k->send_grad[x] < 0 ? "the send of its input gradient" : NULL;
            if (missing) return fail_at(sim, r, -1, "micro-batch %d of chunk %d lacks %s", m, c, missing);
        }
    return 0;
}

/* Every channel (sender, data) carries its messages in the order the
 * receiver posts them: the k-th send is the k-th receive. */
static int check_channels(Sim *sim) {
    const PipeSchedule *s = sim->s;
    int p = s->pp, V = sim->V;
    for (int src = 0; src < p; src++)
        for (int d = 0; d < 2; d++) {
            int dst = d == PIPE_ACT ? (src + 1) % p : (src + p - 1) % p;
            int j = 0; /* the receiver's next receive of this channel */
            for (int i = 0; i < s->n[src]; i++) {
                const PipeAction *a = &s->a[src][i];
                if (a->op != PIPE_SEND || (int)a->data != d) continue;
                int to = (d == PIPE_ACT ? a->chunk * p + src + 1 : a->chunk * p + src - 1);
                while (j < s->n[dst] && !(s->a[dst][j].op == PIPE_RECV && (int)s->a[dst][j].data == d &&
                                          s->a[dst][j].peer == src))
                    j++;
                if (j == s->n[dst])
                    return fail_at(sim, src, i, "rank %d posts no receive for it", dst);
                const PipeAction *b = &s->a[dst][j];
                if (b->micro != a->micro || b->chunk * p + dst != to) {
                    char t[96];
                    pipe_action_text(b, t, sizeof t);
                    return fail_at(sim, src, i, "rank %d's matching receive in channel order is action %d (%s): "
                                   "sends and receives of one channel must come in the same order", dst, j, t);
                }
                j++;
                (void)V;
            }
            for (; j < s->n[dst]; j++) {
                const PipeAction *b = &s->a[dst][j];
                if (b->op == PIPE_RECV && (int)b->data == d && b->peer == src)
                    return fail_at(sim, dst, j, "rank %d never sends it", src);
            }
        }
    return 0;
}

static double op_cost(const PipeSchedule *s, PipeOp op) {
    if (op == PIPE_FWD) return 1;
    if (op == PIPE_BWD) return 2;
    if (op == PIPE_BWD_IN || op == PIPE_BWD_W) return 1;
    return 0;
}

/* Whether rank r's next action can run now, and from when (*at). A send's
 * data, once posted, arrives at its post time; waiting on an earlier send
 * from a slot needs its receive posted. */
static int sim_ready(Sim *sim, int r, double *at, char *why, size_t whyn) {
    const PipeSchedule *s = sim->s;
    int p = s->pp, M = s->micro, V = sim->V;
    RankSim *k = &sim->rk[r];
    const PipeAction *a = &s->a[r][k->pc];
    int vs = a->chunk * p + r, x = a->chunk * M + a->micro;
    *at = k->t;
    if (a->op == PIPE_FWD && vs > 0) {
        RankSim *q = &sim->rk[(vs - 1) % p];
        int y = ((vs - 1) / p) * M + a->micro;
        if (q->send_act[y] < 0 || q->send_act[y] >= q->pc) {
            snprintf(why, whyn, "waits for the activation of micro-batch %d from rank %d", a->micro, (vs - 1) % p);
            return 0;
        }
        *at = fmax(*at, k->act_at[x]);
    }
    if ((a->op == PIPE_BWD || a->op == PIPE_BWD_IN) && vs < V - 1) {
        RankSim *q = &sim->rk[(vs + 1) % p];
        int y = ((vs + 1) / p) * M + a->micro;
        if (q->send_grad[y] < 0 || q->send_grad[y] >= q->pc) {
            snprintf(why, whyn, "waits for the gradient of micro-batch %d from rank %d", a->micro, (vs + 1) % p);
            return 0;
        }
        *at = fmax(*at, k->grad_at[x]);
    }
    /* overwriting a slot's outgoing buffer: its last send must be received */
    int prev = -1, d = -1;
    if (a->op == PIPE_FWD && vs < V - 1) prev = k->out_act[a->chunk * sim->kmax + a->slot], d = PIPE_ACT;
    if ((a->op == PIPE_BWD || a->op == PIPE_BWD_IN) && vs > 0)
        prev = k->out_grad[a->chunk * sim->kmax + a->slot], d = PIPE_GRAD;
    if (prev >= 0 && prev != a->micro) {
        int to = d == PIPE_ACT ? vs + 1 : vs - 1;
        RankSim *q = &sim->rk[to % p];
        int y = (to / p) * M + prev;
        int posted = d == PIPE_ACT ? q->recv_act[y] : q->recv_grad[y];
        if (posted < 0 || posted >= q->pc) {
            snprintf(why, whyn, "waits for rank %d to receive the %s of micro-batch %d from slot %d", to % p,
                     d == PIPE_ACT ? "activation" : "gradient", prev, a->slot);
            return 0;
        }
        *at = fmax(*at, d == PIPE_ACT ? q->act_post[y] : q->grad_post[y]);
    }
    return 1;
}

/* Run rank r's next action at time `at`. */
static void sim_step(Sim *sim, int r, double at) {
    const PipeSchedule *s = sim->s;
    int p = s->pp, M = s->micro;
    RankSim *k = &sim->rk[r];
    const PipeAction *a = &s->a[r][k->pc];
    int vs = a->chunk * p + r, x = a->chunk * M + a->micro;
    double dur = op_cost(s, a->op);
    if (sim->grid && dur > 0) {
        static const char letter[] = {'F', 'B', 'B', 'W'};
        char cell[32];
        if (s->v > 1) snprintf(cell, sizeof cell, "%c%d%c", letter[a->op], a->micro, 'a' + a->chunk);
        else snprintf(cell, sizeof cell, "%c%d", letter[a->op], a->micro);
        for (int u = 0; u < (int)dur && (int)at + u < sim->cells; u++) {
            char *at_cell = sim->grid[r] + (size_t)((int)at + u) * sim->cw;
            int n = (int)strlen(cell);
            memset(at_cell, ' ', (size_t)sim->cw);
            memcpy(at_cell, cell, (size_t)(n < sim->cw ? n : sim->cw));
        }
    }
    k->t = at + dur;
    k->busy += dur;
    if (a->op == PIPE_SEND) {
        int to = a->data == PIPE_ACT ? vs + 1 : vs - 1;
        RankSim *q = &sim->rk[to % p];
        int y = (to / p) * M + a->micro;
        if (a->data == PIPE_ACT) q->act_at[y] = at, k->out_act[a->chunk * sim->kmax + a->slot] = a->micro;
        else q->grad_at[y] = at, k->out_grad[a->chunk * sim->kmax + a->slot] = a->micro;
    } else if (a->op == PIPE_RECV) {
        if (a->data == PIPE_ACT) k->act_post[x] = at;
        else k->grad_post[x] = at;
    }
    k->pc++;
}

/* The dynamic part: run all lists; 0, or -1 naming every blocked rank. At
 * the end of its list a rank waits until every send it posted is received. */
static int simulate(Sim *sim, double *makespan) {
    const PipeSchedule *s = sim->s;
    int p = s->pp;
    for (;;) {
        int progress = 0, done = 0;
        for (int r = 0; r < p; r++) {
            RankSim *k = &sim->rk[r];
            if (k->pc == s->n[r]) {
                done++;
                continue;
            }
            double at;
            char why[160];
            while (k->pc < s->n[r] && sim_ready(sim, r, &at, why, sizeof why)) sim_step(sim, r, at), progress = 1;
        }
        if (done == p) break;
        if (!progress) {
            size_t o = (size_t)snprintf(sim->err, sim->errn, "%s schedule deadlocks:", pipe_kind_name(s->kind));
            for (int r = 0; r < p && o < sim->errn; r++) {
                RankSim *k = &sim->rk[r];
                if (k->pc == s->n[r]) continue;
                double at;
                char why[160], what[96];
                sim_ready(sim, r, &at, why, sizeof why);
                pipe_action_text(&s->a[r][k->pc], what, sizeof what);
                o += (size_t)snprintf(sim->err + o, sim->errn - o, " rank %d at action %d (%s) %s;", r, k->pc, what,
                                      why);
            }
            if (o < sim->errn && o > 0) sim->err[o - 1] = 0;
            return -1;
        }
    }
    /* the step ends when every send is received: all receives are posted by now */
    double end = 0;
    for (int r = 0; r < p; r++) end = fmax(end, sim->rk[r].t);
    *makespan = end;
    return 0;
}

static int check_all(Sim *sim, double *makespan) {
    const PipeSchedule *s = sim->s;
    if (!s->n || !s->a || !s->slots || s->pp < 1 || s->v < 1 || s->micro < 1) {
        snprintf(sim->err, sim->errn, "schedule: empty");
        return -1;
    }
    for (int r = 0; r < s->pp; r++)
        if (check_rank(sim, r) != 0) return -1;
    if (check_channels(sim) != 0) return -1;
    /* the static pass used the slot tables: start the dynamic one afresh */
    for (int r = 0; r < s->pp; r++) {
        RankSim *k = &sim->rk[r];
        for (int i = 0; i < s->v * sim->kmax; i++) k->out_act[i] = k->out_grad[i] = -1;
        for (int i = 0; i < s->n[r]; i++) {
            const PipeAction *a = &s->a[r][i];
            int x = a->chunk * s->micro + a->micro;
            if (a->op == PIPE_RECV) (a->data == PIPE_ACT ? k->recv_act : k->recv_grad)[x] = i;
            if (a->op == PIPE_SEND) (a->data == PIPE_ACT ? k->send_act : k->send_grad)[x] = i;
        }
    }
    return simulate(sim, makespan);
}

int pipe_check(const PipeSchedule *s, char *err, size_t errn) {
    Sim sim;
    sim_init(&sim, s, err, errn);
    double end;
    int rc = check_all(&sim, &end);
    sim_free(&sim);
    return rc;
}

/* ---------------------------------------------------------------- bubbles and the timeline */

double pipe_theory_bubble(const PipeSchedule *s) {
    Sim sim;
    char err[1024];
    sim_init(&sim, s, err, sizeof err);
    double end = 0, idle = 0;
    if (check_all(&sim, &end) != 0 || end <= 0) {
        sim_free(&sim);
        return NAN;
    }
    for (int r = 0; r < s->pp; r++) idle += end - sim.rk[r].busy;
    sim_free(&sim);
    return idle / (s->pp * end);
}

double pipe_formula_bubble(PipeKind k, int pp, int v, int micro) {
    double b = (double)(pp - 1) / micro;
    if (k == PIPE_INTERLEAVED) b /= v;
    if (k == PIPE_ZB_H1) b /= 3;
    return b;
}

char *pipe_timeline(const PipeSchedule *s) {
    Sim sim;
    char err[1024];
    sim_init(&sim, s, err, sizeof err);
    double end = 0;
    int rc = check_all(&sim, &end);
    sim_free(&sim);
    if (rc != 0) {
        size_t n = strlen(err) + 16;
        char *t = xmalloc(n);
        snprintf(t, n, "invalid: %s\n", err);
        return t;
    }
    /* the same simulation again, painting each compute into its cells */
    int digits = snprintf(NULL, 0, "%d", s->micro - 1);
    sim_init(&sim, s, err, sizeof err);
    sim.cw = 1 + digits + (s->v > 1) + 1, sim.cells = (int)end;
    size_t row = (size_t)sim.cells * sim.cw + 1;
    sim.grid = xcalloc((size_t)s->pp, sizeof(char *));
    for (int r = 0; r < s->pp; r++) {
        sim.grid[r] = xmalloc(row);
        for (int c = 0; c < sim.cells; c++)
            snprintf(sim.grid[r] + (size_t)c * sim.cw, (size_t)sim.cw + 1, "%-*s", sim.cw, ".");
    }
    check_all(&sim, &end);
    size_t total = (row + 16) * s->pp + 1, o = 0;
    char *out = xmalloc(total);
    out[0] = 0;
    for (int r = 0; r < s->pp; r++) {
        o += (size_t)snprintf(out + o, total - o, "rank %d | %s\n", r, sim.grid[r]);
        free(sim.grid[r]);
    }
    free(sim.grid);
    sim.grid = NULL;
    sim_free(&sim);
    return out;
}
