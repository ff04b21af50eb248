/* muon: the owner-based distributed Muon step. The plan is pure arithmetic
 * that every rank computes alike (owners, runs, block sizes), so the
 * exchanges need no agreement: one all-to-all gathers the gradients of every
 * owner's matrices (ZeRO 2/3), one scatters the updates back (ZeRO 1-3), or
 * one all-gather gives every rank every update (ZeRO 0); under expert
 * parallelism the experts' updates take the same way over EDP. */
#include "muon.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

double muon_ns_flops(int rows, int cols, int ns) {
    double a = rows < cols ? rows : cols, b = rows < cols ? cols : rows;
    /* per iteration A = X X^T (2 a^2 b), A A (2 a^3), (b A + c A A) X (2 a^2 b) */
    return ns * (4.0 * a * a * b + 2.0 * a * a * a);
}

/* Matrix i's costs sorted, largest first (ties by index). */
int *muon_order_by_cost(const double *c, int n) {
    int *order = xmalloc((size_t)(n + 1) * sizeof(int));
    for (int i = 0; i < n; i++) order[i] = i;
    for (int i = 1; i < n; i++) /* insertion sort: a few hundred matrices at most */
        for (int j = i; j > 0 && (c[order[j]] > c[order[j - 1]] ||
                                  (c[order[j]] == c[order[j - 1]] && order[j] < order[j - 1])); j--) {
            int t = order[j];
            order[j] = order[j - 1], order[j - 1] = t;
        }
    return order;
}

void muon_place(const int *order, int n, const double *c, const int *kind, int want, int ranks, double *load,
                int *owner) {
    for (int k = 0; k < n; k++) {
        int i = order[k], best = 0;
        if (kind && kind[i] != want) continue;
        for (int r = 1; r < ranks; r++)
            if (load[r] < load[best]) best = r;
        owner[i] = best;
        load[best] += c[i];
    }
}

static int *by_cost(const AdamW *o, double *c) {
    for (int i = 0; i < o->nmat; i++) c[i] = muon_ns_flops(o->mats[i].grows, o->mats[i].gcols, o->ns_steps);
    return muon_order_by_cost(c, o->nmat);
}

/* Longest processing time first: matrices by cost, largest first, each to
 * the least loaded rank (ties to the lowest): within 4/3 of the best
 * balance, and the same on every rank. The experts first, over EDP (every
 * EDP group's experts have the same shapes, so every group assigns alike),
 * then the dense matrices over dp, each dp rank starting from its experts'
 * load. */
static void assign_owners(MuonDist *md, const AdamW *o) {
    int n = o->nmat, ne = md->plan[MUON_EXPERTS].n;
    double *c = xmalloc((size_t)(n + 1) * sizeof(double)), *xload = xcalloc((size_t)ne, sizeof(double));
    int *order = by_cost(o, c);
    muon_place(order, n, c, md->kind, MUON_EXPERTS, ne, xload, md->owner);
    for (int r = 0; r < md->dp; r++) md->cost[r] = xload[r / md->ep];
    muon_place(order, n, c, md->kind, MUON_DENSE, md->dp, md->cost, md->owner);
    for (int i = 0; i < n; i++) md->mine[i] = md->owner[i] == md->plan[md->kind[i]].rank;
    free(order);
    free(c);
    free(xload);
}

/* 1 if dp rank d owns matrix i (under ep: d's own expert of the same index). */
static int owned_by(const MuonDist *md, int i, int d) {
    return md->owner[i] == (md->kind[i] == MUON_EXPERTS ? d / md->ep : d);
}

/* The runs of plan k: every rank's optimizer part cut at the matrices'
 * bounds. A holder sends its runs of owner o's matrices in matrix order into
 * block o; o reads them from block h in the same order, so both sides agree
 * on every position without asking. pair[h * n + o] counts the floats h
 * sends o. */
static void plan_runs(MuonDist *md, int kind, const AdamW *o, const Ddp *d) {
    MuonPlan *pl = &md->plan[kind];
    int n = pl->n;
    size_t *pair = xcalloc((size_t)n * n, sizeof(size_t));
    size_t cap_h = 16, cap_o = 16;
    pl->held = xmalloc(cap_h * sizeof(MuonPiece));
    pl->owned = xmalloc(cap_o * sizeof(MuonPiece));
    for (int pass = 0; pass < 2; pass++) {
        /* pass 0 counts the pairs (the block), pass 1 places the runs */
        memset(pair, 0, (size_t)n * n * sizeof(size_t));
        pl->nheld = pl->nowned = 0;
        for (int i = 0; i < o->nmat; i++) {
            const OptimMatrix *x = &o->mats[i];
            if (md->kind[i] != kind) continue;
            size_t lo = x->off, hi = x->off + (size_t)x->rows * x->cols;
            int own = md->owner[i];
            for (int h = 0; h < n; h++) {
                DdpPiece p;
                int hr = kind == MUON_EXPERTS ? ddp_expert_peer(d, h) : h; /* h's rank in ddp's group */
                for (int k = 0; ddp_rank_piece(d, hr, k, &p); k++) {
                    size_t a = p.lo > lo ? p.lo : lo, b = p.hi < hi ? p.hi : hi;
                    if (a >= b) continue;
                    size_t len = b - a, *at = &pair[(size_t)h * n + own];
                    MuonPiece run = {.mat = i, .shard = p.par + (a - p.lo), .own = x->mom + (a - lo), .n = len};
                    if (pass == 1 && h == pl->rank) {
                        run.peer = own, run.xfer = (size_t)own * pl->block + *at;
                        if ((size_t)pl->nheld == cap_h) pl->held = xrealloc(pl->held, (cap_h *= 2) * sizeof run);
                        pl->held[pl->nheld++] = run;
                    }
                    if (pass == 1 && own == pl->rank && h != pl->rank) {
                        run.peer = h, run.xfer = (size_t)h * pl->block + *at;
                        if ((size_t)pl->nowned == cap_o) pl->owned = xrealloc(pl->owned, (cap_o *= 2) * sizeof run);
                        pl->owned[pl->nowned++] = run;
                    }
                    if (h != own) *at += len;
                }
            }
        }
        if (pass == 0) {
            pl->block = 0;
            size_t total = 0;
            for (size_t k = 0; k < (size_t)n * n; k++) {
                pl->block = pair[k] > pl->block ? pair[k] : pl->block;
                total += pair[k];
            }
            pl->pad_total = pl->block * (size_t)n * (n - 1) - total;
        }
    }
    pl->moved = (size_t)(n - 1) * pl->block; /* each all-to-all: a block from every other rank */
    free(pair);
}

/* ZeRO 0: every rank applies every update of the plan's matrices, so each
 * owner's block of the all-gather holds its matrices back to back (as they
 * lie in its momentum: the experts, which come first in the arena, then the
 * dense ones); every rank holds everything. */
static void plan_replicated(MuonDist *md, int kind, const AdamW *o) {
    MuonPlan *pl = &md->plan[kind];
    int n = pl->n, first = 1;
    size_t *len = xcalloc((size_t)n, sizeof(size_t));
    pl->held = xmalloc((size_t)(o->nmat + 1) * sizeof(MuonPiece));
    pl->owned = xmalloc(sizeof(MuonPiece));
    pl->nheld = pl->nowned = 0;
    pl->base = 0;
    for (int i = 0; i < o->nmat; i++) {
        const OptimMatrix *x = &o->mats[i];
        if (md->kind[i] != kind) continue;
        size_t sz = (size_t)x->rows * x->cols;
        int own = md->owner[i];
        if (md->mine[i] && first) pl->base = x->mom - len[own], first = 0;
        pl->held[pl->nheld++] = (MuonPiece){.mat = i, .peer = own, .shard = x->off, .own = x->mom, .xfer = len[own],
                                            .n = sz};
        len[own] += sz;
    }
    size_t total = 0;
    pl->block = 0;
    for (int r = 0; r < n; r++) pl->block = len[r] > pl->block ? len[r] : pl->block, total += len[r];
    for (int k = 0; k < pl->nheld; k++) pl->held[k].xfer += (size_t)pl->held[k].peer * pl->block;
    pl->pad_total = pl->block * (size_t)n - total;
    pl->moved = (size_t)(n - 1) * pl->block; /* a ring all-gather: every other rank's block */
    free(len);
}

/* ---------------------------------------------------- tensor parallelism */

/* Where tp rank r's part of matrix x lies in the whole (grows x gcols)
 * matrix: rows [r0, r1) x columns [c0, c1), stored row-major in the part from
 * element `at`. One box, or one per block of a matrix in tp_parts blocks
 * (GPT-2's fused q|k|v kept whole: 3); the whole matrix when not split. */
typedef struct MuonBox {
    size_t r0, r1, c0, c1, at;
} MuonBox;

static int tp_boxes(const MuonDist *md, const OptimMatrix *x, int r, MuonBox b[3]) {
    size_t rows = (size_t)x->rows, cols = (size_t)x->cols, gr = (size_t)x->grows, gc = (size_t)x->gcols;
    if (md->tp <= 1 || x->tp_dim < 0) {
        b[0] = (MuonBox){0, gr, 0, gc, 0};
        return 1;
    }
    if (x->tp_dim == 1) {
        b[0] = (MuonBox){0, gr, (size_t)r * cols, (size_t)(r + 1) * cols, 0};
        return 1;
    }
    size_t parts = (size_t)x->tp_parts, lp = rows / parts, gp = gr / parts;
    for (size_t k = 0; k < parts; k++) b[k] = (MuonBox){k * gp + (size_t)r * lp, k * gp + (size_t)(r + 1) * lp, 0, gc,
                                                        k * lp * cols};
    return (int)parts;
}

/* Rank r's part (row-major, its layout in the arena) into the whole matrix g
 * (to_whole) or back out of it; a column block row by row (copy_2d). */
static void tp_move(const MuonDist *md, const OptimMatrix *x, int r, float *g, float *part, int to_whole) {
    MuonBox b[3];
    int nb = tp_boxes(md, x, r, b);
    size_t gc = (size_t)x->gcols, F = sizeof(float);
    for (int k = 0; k < nb; k++) {
        size_t w = b[k].c1 - b[k].c0, h = b[k].r1 - b[k].r0;
        float *gp = g + b[k].r0 * gc + b[k].c0, *pp = part + b[k].at;
        if (w == gc) md->be->copy(to_whole ? gp : pp, to_whole ? pp : gp, h * w * F);
        else if (to_whole) md->be->copy_2d(gp, gc * F, pp, w * F, w * F, h);
        else md->be->copy_2d(pp, w * F, gp, gc * F, w * F, h);
    }
}

/* Within each dp owner's tp group: its matrices to tp ranks by cost (as the
 * owners: longest first to the least loaded); then the runs of the two tp
 * exchanges for this rank. A split matrix's part travels to its tp owner
 * (the gather) and back (the scatter); a matrix not split (the same on every
 * tp rank, MoE experts) only back. Positions as in plan_runs. */
static void plan_tp(MuonDist *md, const AdamW *o) {
    int n = o->nmat, tp = md->tp;
    md->towner = xmalloc((size_t)(n + 1) * sizeof(int));
    md->gpos = xcalloc((size_t)(n + 1), sizeof(size_t));
    md->tcost = xcalloc((size_t)md->dp * tp, sizeof(double));
    for (int d = 0; d < md->dp; d++) {
        double *load = md->tcost + (size_t)d * tp;
        int *order = xmalloc((size_t)(n + 1) * sizeof(int)), m = 0;
        for (int i = 0; i < n; i++)
            if (owned_by(md, i, d)) order[m++] = i;
        double *c = xmalloc((size_t)(n + 1) * sizeof(double));
        for (int i = 0; i < n; i++) c[i] = muon_ns_flops(o->mats[i].grows, o->mats[i].gcols, o->ns_steps);
        for (int i = 1; i < m; i++)
            for (int j = i; j > 0 && (c[order[j]] > c[order[j - 1]] ||
                                      (c[order[j]] == c[order[j - 1]] && order[j] < order[j - 1])); j--) {
                int t = order[j];
                order[j] = order[j - 1], order[j - 1] = t;
            }
        for (int k = 0; k < m; k++) {
            int best = 0;
            for (int r = 1; r < tp; r++)
                if (load[r] < load[best]) best = r;
            if (d == md->rank) md->towner[order[k]] = best;
            load[best] += c[order[k]];
        }
        free(order);
        free(c);
    }
    for (int i = 0; i < n; i++)
        if (!md->mine[i]) md->towner[i] = -1;
    size_t *gpair = xcalloc((size_t)tp * tp, sizeof(size_t)), *spair = xcalloc((size_t)tp * tp, sizeof(size_t));
    md->tsend = xmalloc((size_t)(2 * n * tp + 1) * sizeof(MuonTpRun));
    md->trecv = xmalloc((size_t)(2 * n * tp + 1) * sizeof(MuonTpRun));
    for (int pass = 0; pass < 2; pass++) {
        memset(gpair, 0, (size_t)tp * tp * sizeof(size_t));
        memset(spair, 0, (size_t)tp * tp * sizeof(size_t));
        md->ntsend = md->ntrecv = 0;
        size_t gl = 0;
        for (int i = 0; i < n; i++) {
            const OptimMatrix *x = &o->mats[i];
            int t = md->towner[i];
            if (t < 0) continue;
            if (t == md->tpr) md->gpos[i] = gl, gl += (size_t)x->grows * x->gcols;
            size_t part = (size_t)x->rows * x->cols;
            for (int r = 0; r < tp; r++) {
                if (r == t) continue;
                size_t *g = &gpair[(size_t)r * tp + t], *s = &spair[(size_t)t * tp + r];
                if (pass == 1 && x->tp_dim >= 0 && r == md->tpr)
                    md->tsend[md->ntsend++] = (MuonTpRun){i, t, 1, (size_t)t * md->tblock + *g, part};
                if (pass == 1 && x->tp_dim >= 0 && t == md->tpr)
                    md->trecv[md->ntrecv++] = (MuonTpRun){i, r, 1, (size_t)r * md->tblock + *g, part};
                if (pass == 1 && t == md->tpr)
                    md->tsend[md->ntsend++] = (MuonTpRun){i, r, 0, (size_t)r * md->tblock + *s, part};
                if (pass == 1 && r == md->tpr)
                    md->trecv[md->ntrecv++] = (MuonTpRun){i, t, 0, (size_t)t * md->tblock + *s, part};
                if (x->tp_dim >= 0) *g += part;
                *s += part;
            }
        }
        if (pass == 0) {
            md->tblock = 0;
            for (size_t k = 0; k < (size_t)tp * tp; k++) {
                md->tblock = gpair[k] > md->tblock ? gpair[k] : md->tblock;
                md->tblock = spair[k] > md->tblock ? spair[k] : md->tblock;
            }
            md->gbuf = md->be->alloc((gl + 1) * sizeof(float));
        }
    }
    md->tmoved = (size_t)(tp - 1) * md->tblock;
    md->tsbuf = md->be->alloc(((size_t)tp * md->tblock + 1) * sizeof(float));
    md->trbuf = md->be->alloc(((size_t)tp * md->tblock + 1) * sizeof(float));
    free(gpair);
    free(spair);
}

void muon_dist_init(MuonDist *md, AdamW *o, Ddp *d, CommGroup *tp, int say) {
    memset(md, 0, sizeof *md);
    md->be = o->be;
    md->g = ddp_group(d);
    md->dp = ddp_ranks(d);
    md->rank = ddp_rank(d);
    md->zero = ddp_zero(d);
    md->nmat = o->nmat;
    md->tpg = tp && tp->size > 1 ? tp : NULL;
    md->tp = md->tpg ? tp->size : 1;
    md->tpr = md->tpg ? tp->rank : 0;
    /* expert parallelism: the arena's expert range, owned over EDP */
    size_t xlen = ddp_expert_len(d);
    CommGroup *eg = ddp_expert_group(d);
    int ne = eg ? eg->size : 1;
    md->ep = xlen ? md->dp / ne : 1;
    md->plan[MUON_DENSE] = (MuonPlan){.g = md->g, .n = md->dp, .rank = md->rank};
    md->plan[MUON_EXPERTS] = (MuonPlan){.g = eg, .n = ne, .rank = eg ? eg->rank : 0};
    md->kind = xcalloc((size_t)(o->nmat + 1), sizeof(int));
    md->owner = xcalloc((size_t)(o->nmat + 1), sizeof(int));
    md->mine = xcalloc((size_t)(o->nmat + 1), sizeof(int));
    for (int i = 0; i < o->nmat; i++) md->kind[i] = o->mats[i].off < xlen ? MUON_EXPERTS : MUON_DENSE;
    md->cost = xcalloc((size_t)md->dp, sizeof(double));
    assign_owners(md, o);
    optim_muon_own(o, md->mine, 1); /* owner 1: this rank */
    size_t obuf = o->mm_len;
    for (int k = 0; k < MUON_PLANS; k++) {
        MuonPlan *pl = &md->plan[k];
        if (md->zero == 0) plan_replicated(md, k, o);
        else plan_runs(md, k, o, d);
        if (pl->base + pl->block > obuf) obuf = pl->base + pl->block;
        if (pl->g) {
            if (md->zero > 0) pl->sbuf = md->be->alloc(((size_t)pl->n * pl->block + 1) * sizeof(float));
            pl->rbuf = md->be->alloc(((size_t)pl->n * pl->block + 1) * sizeof(float));
        }
    }
    if (md->tpg) plan_tp(md, o);
    md->obuf = md->be->alloc((obuf + 1) * sizeof(float));
    ddp_set_muon(d, md);
    if (say) {
        char line[1024];
        muon_dist_describe(md, o, line, sizeof line);
        printf("%s\n", line);
    }
}

void muon_dist_free(MuonDist *md) {
    if (md->be) {
        md->be->free(md->obuf);
        for (int k = 0; k < MUON_PLANS; k++) {
            if (md->plan[k].sbuf) md->be->free(md->plan[k].sbuf);
            if (md->plan[k].rbuf) md->be->free(md->plan[k].rbuf);
        }
        if (md->gbuf) md->be->free(md->gbuf), md->be->free(md->tsbuf), md->be->free(md->trbuf);
    }
    for (int k = 0; k < MUON_PLANS; k++) free(md->plan[k].held), free(md->plan[k].owned);
    free(md->kind), free(md->owner), free(md->mine), free(md->cost);
    free(md->towner), free(md->tcost), free(md->gpos), free(md->tsend), free(md->trecv);
    memset(md, 0, sizeof *md);
}

void muon_dist_describe(const MuonDist *md, const AdamW *o, char *buf, size_t n) {
    int *count = xcalloc((size_t)md->dp, sizeof(int)), nx = 0;
    for (int i = 0; i < md->nmat; i++) {
        nx += md->kind[i] == MUON_EXPERTS;
        for (int r = 0; r < md->dp; r++) count[r] += owned_by(md, i, r);
    }
    /* the cost per rank: per dp owner, or under tp per (dp, tp) rank, dp-major */
    int slots = md->dp * md->tp;
    const double *cost = md->tpg ? md->tcost : md->cost;
    double most = 0, sum = 0;
    for (int r = 0; r < slots; r++) most = cost[r] > most ? cost[r] : most, sum += cost[r];
    size_t k = (size_t)snprintf(buf, n, "optim: muon owners over %d dp rank(s)", md->dp);
    if (md->tpg && k < n) k += (size_t)snprintf(buf + k, n - k, " x %d tp", md->tp);
    if (md->ep > 1 && k < n)
        k += (size_t)snprintf(buf + k, n - k, " (the %d expert matrices here over the %d edp rank(s) holding them)",
                              nx, md->plan[MUON_EXPERTS].n);
    if (k < n) k += (size_t)snprintf(buf + k, n - k, ": matrices");
    for (int r = 0; r < md->dp && k < n; r++) k += (size_t)snprintf(buf + k, n - k, "%s%d", r ? "/" : " ", count[r]);
    if (k < n) k += (size_t)snprintf(buf + k, n - k, ", Newton-Schulz GFLOP per step%s", md->tpg ? " per dp x tp rank" : "");
    for (int r = 0; r < slots && k < n; r++) k += (size_t)snprintf(buf + k, n - k, "%s%.4g", r ? "/" : " ", cost[r] / 1e9);
    if (k < n) k += (size_t)snprintf(buf + k, n - k, " (max/mean %.3f)", sum > 0 ? most / (sum / slots) : 1.0);
    if (md->dp > 1 && k < n) {
        const char *how = md->zero == 0   ? "an all-gather of the updates"
                          : md->zero == 1 ? "an all-to-all of the updates to their holders"
                                          : "all-to-alls of the gradients to their owners and the updates back";
        int rounds = md->zero >= 2 ? 2 : 1;
        double moved = 0, pad = 0, pad_total = 0;
        for (int p = 0; p < MUON_PLANS; p++) {
            const MuonPlan *pl = &md->plan[p];
            moved += (double)pl->moved;
            pad += md->zero == 0 ? (double)pl->block * pl->n : (double)pl->block * pl->n * (pl->n - 1);
            pad_total += (double)pl->pad_total;
        }
        /* AdamW's gradient reduction: a ring all-reduce (ZeRO 0-1) sends 2 (dp - 1) / dp of the
         * arena per rank, a reduce-scatter and an all-gather (ZeRO 2) the same */
        double adamw = 2.0 * (md->dp - 1) / md->dp * (double)o->n * 4.0 / 1e6;
        k += (size_t)snprintf(buf + k, n - k, "; per step each rank receives %.4g MB beyond AdamW's %.4g MB (%s, "
                              "%.1f%% padding)", rounds * moved * 4.0 / 1e6, adamw, how,
                              pad > 0 ? 100.0 * pad_total / pad : 0.0);
    }
    if (md->tpg && k < n)
        snprintf(buf + k, n - k, "; tp: %.4g MB received per step (the parts to each matrix's tp owner and back)",
                 2.0 * (double)md->tmoved * 4.0 / 1e6);
    free(count);
}

/* Before MPI reads what the backend wrote (host memory); nothing in NCCL
 * device mode, which orders itself after the compute stream (ddp.c says why). */
static void fence(const MuonDist *md) {
    if (md->be->host_mem) md->be->sync();
}

static void all_to_all(MuonDist *md, MuonPlan *pl) {
    double t0 = kiln_now();
    fence(md);
    comm_all_to_all(pl->g, pl->sbuf, pl->rbuf, pl->block);
    md->comm_s += kiln_now() - t0;
}

/* One tp all-to-all: the parts to their tp owners (gather) or back. */
static void tp_exchange(MuonDist *md, const AdamW *o, int gather) {
    const size_t F = sizeof(float);
    for (int k = 0; k < md->ntsend; k++) {
        const MuonTpRun *r = &md->tsend[k];
        const OptimMatrix *x = &o->mats[r->mat];
        if (r->gather != gather) continue;
        if (gather) md->be->copy(md->tsbuf + r->xfer, md->obuf + x->mom, r->n * F);
        else tp_move(md, x, r->peer, md->gbuf + md->gpos[r->mat], md->tsbuf + r->xfer, 0);
    }
    if (md->tblock > 0) {
        double t0 = kiln_now();
        fence(md);
        comm_all_to_all(md->tpg, md->tsbuf, md->trbuf, md->tblock);
        md->comm_s += kiln_now() - t0;
    }
    for (int k = 0; k < md->ntrecv; k++) {
        const MuonTpRun *r = &md->trecv[k];
        const OptimMatrix *x = &o->mats[r->mat];
        if (r->gather != gather) continue;
        if (gather) tp_move(md, x, r->peer, md->gbuf + md->gpos[r->mat], md->trbuf + r->xfer, 1);
        else md->be->copy(md->obuf + x->mom, md->trbuf + r->xfer, r->n * F);
    }
}

/* Under tp, after the look-aheads: every tp owner gathers its matrices'
 * parts, orthogonalises the whole matrices and sends the parts back. */
static void tp_orthogonalise(MuonDist *md, AdamW *o) {
    tp_exchange(md, o, 1);
    for (int i = 0; i < o->nmat; i++) {
        const OptimMatrix *x = &o->mats[i];
        if (md->towner[i] != md->tpr) continue;
        float *g = md->gbuf + md->gpos[i];
        tp_move(md, x, md->tpr, g, md->obuf + x->mom, 1); /* this rank's own part (or all of it) */
        optim_muon_orthogonalise(o, g, x->grows, x->gcols);
        tp_move(md, x, md->tpr, g, md->obuf + x->mom, 0);
    }
    tp_exchange(md, o, 0);
}

/* Plan pl's updates to their holders (ZeRO 0: an all-gather, every rank
 * holds every matrix; ZeRO 1-3: an all-to-all), and each holder's step. */
static void send_updates(MuonDist *md, MuonPlan *pl, AdamW *o, float *params, float lr) {
    const Backend *be = md->be;
    const size_t F = sizeof(float);
    int comm = pl->g && pl->block > 0;
    if (md->zero == 0) {
        if (comm) {
            double t1 = kiln_now();
            fence(md);
            comm_all_gather(pl->g, md->obuf + pl->base, pl->rbuf, pl->block);
            md->comm_s += kiln_now() - t1;
        }
        for (int k = 0; k < pl->nheld; k++) {
            const MuonPiece *r = &pl->held[k];
            const float *src = r->peer == pl->rank || !comm ? md->obuf + r->own : pl->rbuf + r->xfer;
            optim_muon_apply(o, r->mat, params + r->shard, src, r->n, lr);
        }
        return;
    }
    for (int k = 0; k < pl->nowned; k++)
        be->copy(pl->sbuf + pl->owned[k].xfer, md->obuf + pl->owned[k].own, pl->owned[k].n * F);
    if (comm) all_to_all(md, pl);
    for (int k = 0; k < pl->nheld; k++) {
        const MuonPiece *r = &pl->held[k];
        const float *src = r->peer == pl->rank ? md->obuf + r->own : pl->rbuf + r->xfer;
        optim_muon_apply(o, r->mat, params + r->shard, src, r->n, lr);
    }
}

double muon_dist_step(MuonDist *md, AdamW *o, float *params, const float *grads, float lr, float grad_scale) {
    const Backend *be = md->be;
    const size_t F = sizeof(float);
    double comm0 = md->comm_s;
    /* ZeRO 2/3 (never with experts: ddp refuses ep there): each owner's
     * matrices gathered into obuf from their shards */
    if (md->zero >= 2) {
        MuonPlan *pl = &md->plan[MUON_DENSE];
        for (int k = 0; k < pl->nheld; k++) {
            const MuonPiece *r = &pl->held[k];
            if (r->peer == pl->rank) be->copy(md->obuf + r->own, grads + r->shard, r->n * F);
            else be->copy(pl->sbuf + r->xfer, grads + r->shard, r->n * F);
        }
        if (pl->g && pl->block > 0) all_to_all(md, pl);
        for (int k = 0; k < pl->nowned; k++)
            be->copy(md->obuf + pl->owned[k].own, pl->rbuf + pl->owned[k].xfer, pl->owned[k].n * F);
    }
    /* the owner's work: momentum and look-ahead into obuf, orthogonalised there
     * (under tp: on the whole matrix, at its tp owner) */
    double t0 = kiln_now(), comm1 = md->comm_s;
    for (int i = 0; i < o->nmat; i++) {
        const OptimMatrix *x = &o->mats[i];
        if (!md->mine[i]) continue;
        float *u = md->obuf + x->mom;
        optim_muon_momentum(o, i, md->zero >= 2 ? u : grads + x->off, grad_scale, u);
        if (!md->tpg) optim_muon_orthogonalise(o, u, x->rows, x->cols);
    }
    if (md->tpg) tp_orthogonalise(md, o);
    if (md->tpg) comm_drain(md->tpg); /* tp's collectives may be stream-ordered: with the deadline first */
    be->sync(); /* so the time is the work's, not the exchange's */
    md->ns_s += kiln_now() - t0 - (md->comm_s - comm1); /* tp's exchanges are comm_s's */
    /* the updates to the holders, and each holder's step: the experts over
     * EDP, the rest over dp */
    for (int k = 0; k < MUON_PLANS; k++) send_updates(md, &md->plan[k], o, params, lr);
    return md->comm_s - comm0;
}
