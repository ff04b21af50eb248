/* muon: the owner-based distributed Muon step. The plan is pure arithmetic
 * that every rank computes alike (owners, runs, block sizes), so the
 * exchanges need no agreement: one all-to-all gathers the gradients of every
 * owner's matrices (ZeRO 2/3), one scatters the updates back (ZeRO 1-3), or
 * one all-gather gives every rank every update (ZeRO 0). */
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

/* Longest processing time first: matrices by cost, largest first (ties by
 * index), each to the least loaded rank (ties to the lowest): within 4/3 of
 * the best balance, and the same on every rank. */
static void assign_owners(MuonDist *md, const AdamW *o) {
    int n = o->nmat;
    int *order = xmalloc((size_t)(n + 1) * sizeof(int));
    double *c = xmalloc((size_t)(n + 1) * sizeof(double));
    for (int i = 0; i < n; i++) order[i] = i, c[i] = muon_ns_flops(o->mats[i].grows, o->mats[i].gcols, o->ns_steps);
    for (int i = 1; i < n; i++) /* insertion sort: a few hundred matrices at most */
        for (int j = i; j > 0 && (c[order[j]] > c[order[j - 1]] ||
                                  (c[order[j]] == c[order[j - 1]] && order[j] < order[j - 1])); j--) {
            int t = order[j];
            order[j] = order[j - 1], order[j - 1] = t;
        }
    for (int k = 0; k < n; k++) {
        int best = 0;
        for (int r = 1; r < md->dp; r++)
            if (md->cost[r] < md->cost[best]) best = r;
        md->owner[order[k]] = best;
        md->cost[best] += c[order[k]];
    }
    free(order);
    free(c);
}

/* The runs: every rank's optimizer part cut at the matrices' bounds. A
 * holder sends its runs of owner o's matrices in matrix order into block o;
 * o reads them from block h in the same order, so both sides agree on every
 * position without asking. pair[h * dp + o] counts the floats h sends o. */
static void plan_runs(MuonDist *md, const AdamW *o, const Ddp *d) {
    int dp = md->dp;
    size_t *pair = xcalloc((size_t)dp * dp, sizeof(size_t));
    size_t cap_h = 16, cap_o = 16;
    md->held = xmalloc(cap_h * sizeof(MuonPiece));
    md->owned = xmalloc(cap_o * sizeof(MuonPiece));
    for (int pass = 0; pass < 2; pass++) {
        /* pass 0 counts the pairs (the block), pass 1 places the runs */
        memset(pair, 0, (size_t)dp * dp * sizeof(size_t));
        md->nheld = md->nowned = 0;
        for (int i = 0; i < o->nmat; i++) {
            const OptimMatrix *x = &o->mats[i];
            size_t lo = x->off, hi = x->off + (size_t)x->rows * x->cols;
            int own = md->owner[i];
            for (int h = 0; h < dp; h++) {
                DdpPiece p;
                for (int k = 0; ddp_rank_piece(d, h, k, &p); k++) {
                    size_t a = p.lo > lo ? p.lo : lo, b = p.hi < hi ? p.hi : hi;
                    if (a >= b) continue;
                    size_t n = b - a, *at = &pair[(size_t)h * dp + own];
                    MuonPiece run = {.mat = i, .shard = p.at + (a - p.lo), .own = x->mom + (a - lo), .n = n};
                    if (pass == 1 && h == md->rank) {
                        run.peer = own, run.xfer = (size_t)own * md->block + *at;
                        if ((size_t)md->nheld == cap_h) md->held = xrealloc(md->held, (cap_h *= 2) * sizeof run);
                        md->held[md->nheld++] = run;
                    }
                    if (pass == 1 && own == md->rank && h != md->rank) {
                        run.peer = h, run.xfer = (size_t)h * md->block + *at;
                        if ((size_t)md->nowned == cap_o) md->owned = xrealloc(md->owned, (cap_o *= 2) * sizeof run);
                        md->owned[md->nowned++] = run;
                    }
                    if (h != own) *at += n;
                }
            }
        }
        if (pass == 0) {
            md->block = 0;
            size_t total = 0;
            for (size_t k = 0; k < (size_t)dp * dp; k++) {
                md->block = pair[k] > md->block ? pair[k] : md->block;
                total += pair[k];
            }
            md->pad_total = md->block * (size_t)dp * (dp - 1) - total;
        }
    }
    md->moved = (size_t)(dp - 1) * md->block; /* each all-to-all: a block from every other rank */
    free(pair);
}

/* ZeRO 0: every rank applies every update, so each owner's block of the
 * all-gather holds its matrices back to back; every rank holds everything. */
static void plan_replicated(MuonDist *md, const AdamW *o) {
    int dp = md->dp;
    size_t *len = xcalloc((size_t)dp, sizeof(size_t));
    md->held = xmalloc((size_t)(o->nmat + 1) * sizeof(MuonPiece));
    md->owned = xmalloc(sizeof(MuonPiece));
    md->nheld = md->nowned = 0;
    for (int i = 0; i < o->nmat; i++) {
        const OptimMatrix *x = &o->mats[i];
        size_t n = (size_t)x->rows * x->cols;
        len[md->owner[i]] += n;
        md->held[md->nheld++] = (MuonPiece){.mat = i, .peer = md->owner[i], .shard = x->off, .own = x->mom,
                                            .xfer = x->mom, .n = n};
    }
    size_t total = 0;
    md->block = 0;
    for (int r = 0; r < dp; r++) md->block = len[r] > md->block ? len[r] : md->block, total += len[r];
    for (int k = 0; k < md->nheld; k++) md->held[k].xfer += (size_t)md->held[k].peer * md->block;
    md->pad_total = md->block * (size_t)dp - total;
    md->moved = (size_t)(dp - 1) * md->block; /* a ring all-gather: every other rank's block */
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
            if (md->owner[i] == d) order[m++] = i;
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
        if (md->owner[i] != md->rank) md->towner[i] = -1;
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
    md->owner = xcalloc((size_t)(o->nmat + 1), sizeof(int));
    md->cost = xcalloc((size_t)md->dp, sizeof(double));
    assign_owners(md, o);
    optim_muon_own(o, md->owner, md->rank);
    if (md->zero == 0) plan_replicated(md, o);
    else plan_runs(md, o, d);
    if (md->tpg) plan_tp(md, o);
    size_t obuf = o->mm_len > md->block ? o->mm_len : md->block;
    md->obuf = md->be->alloc((obuf + 1) * sizeof(float));
    if (md->g) {
        if (md->zero > 0) md->sbuf = md->be->alloc(((size_t)md->dp * md->block + 1) * sizeof(float));
        md->rbuf = md->be->alloc(((size_t)md->dp * md->block + 1) * sizeof(float));
    }
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
        if (md->sbuf) md->be->free(md->sbuf);
        if (md->rbuf) md->be->free(md->rbuf);
        if (md->gbuf) md->be->free(md->gbuf), md->be->free(md->tsbuf), md->be->free(md->trbuf);
    }
    free(md->owner), free(md->cost), free(md->held), free(md->owned);
    free(md->towner), free(md->tcost), free(md->gpos), free(md->tsend), free(md->trecv);
    memset(md, 0, sizeof *md);
}

void muon_dist_describe(const MuonDist *md, const AdamW *o, char *buf, size_t n) {
    int *count = xcalloc((size_t)md->dp, sizeof(int));
    for (int i = 0; i < md->nmat; i++) count[md->owner[i]]++;
    /* the cost per rank: per dp owner, or under tp per (dp, tp) rank, dp-major */
    int slots = md->dp * md->tp;
    const double *cost = md->tpg ? md->tcost : md->cost;
    double most = 0, sum = 0;
    for (int r = 0; r < slots; r++) most = cost[r] > most ? cost[r] : most, sum += cost[r];
    size_t k = (size_t)snprintf(buf, n, "optim: muon owners over %d dp rank(s)", md->dp);
    if (md->tpg && k < n) k += (size_t)snprintf(buf + k, n - k, " x %d tp", md->tp);
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
        double pad = md->zero == 0 ? (double)md->block * md->dp : (double)md->block * md->dp * (md->dp - 1);
        /* AdamW's gradient reduction: a ring all-reduce (ZeRO 0-1) sends 2 (dp - 1) / dp of the
         * arena per rank, a reduce-scatter and an all-gather (ZeRO 2) the same */
        double adamw = 2.0 * (md->dp - 1) / md->dp * (double)o->n * 4.0 / 1e6;
        k += (size_t)snprintf(buf + k, n - k, "; per step each rank receives %.4g MB beyond AdamW's %.4g MB (%s, "
                              "%.1f%% padding)", rounds * (double)md->moved * 4.0 / 1e6, adamw, how,
                              pad > 0 ? 100.0 * md->pad_total / pad : 0.0);
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

static void all_to_all(MuonDist *md) {
    double t0 = kiln_now();
    fence(md);
    comm_all_to_all(md->g, md->sbuf, md->rbuf, md->block);
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

double muon_dist_step(MuonDist *md, AdamW *o, float *params, const float *grads, float lr, float grad_scale) {
    const Backend *be = md->be;
    const size_t F = sizeof(float);
    int comm = md->g && md->block > 0;
    double comm0 = md->comm_s;
    /* ZeRO 2/3: each owner's matrices gathered into obuf from their shards */
    if (md->zero >= 2) {
        for (int k = 0; k < md->nheld; k++) {
            const MuonPiece *r = &md->held[k];
            if (r->peer == md->rank) be->copy(md->obuf + r->own, grads + r->shard, r->n * F);
            else be->copy(md->sbuf + r->xfer, grads + r->shard, r->n * F);
        }
        if (comm) all_to_all(md);
        for (int k = 0; k < md->nowned; k++)
            be->copy(md->obuf + md->owned[k].own, md->rbuf + md->owned[k].xfer, md->owned[k].n * F);
    }
    /* the owner's work: momentum and look-ahead into obuf, orthogonalised there
     * (under tp: on the whole matrix, at its tp owner) */
    double t0 = kiln_now(), comm1 = md->comm_s;
    for (int i = 0; i < o->nmat; i++) {
        const OptimMatrix *x = &o->mats[i];
        if (md->owner[i] != md->rank) continue;
        float *u = md->obuf + x->mom;
        optim_muon_momentum(o, i, md->zero >= 2 ? u : grads + x->off, grad_scale, u);
        if (!md->tpg) optim_muon_orthogonalise(o, u, x->rows, x->cols);
    }
    if (md->tpg) tp_orthogonalise(md, o);
    if (md->tpg) comm_drain(md->tpg); /* tp's collectives may be stream-ordered: with the deadline first */
    be->sync(); /* so the time is the work's, not the exchange's */
    md->ns_s += kiln_now() - t0 - (md->comm_s - comm1); /* tp's exchanges are comm_s's */
    /* the updates to the holders, and each holder's step */
    if (md->zero == 0) {
        if (comm) {
            double t1 = kiln_now();
            fence(md);
            comm_all_gather(md->g, md->obuf, md->rbuf, md->block);
            md->comm_s += kiln_now() - t1;
        }
        for (int k = 0; k < md->nheld; k++) {
            const MuonPiece *r = &md->held[k];
            const float *src = r->peer == md->rank || !comm ? md->obuf + r->own : md->rbuf + r->xfer;
            optim_muon_apply(o, r->mat, params + r->shard, src, r->n, lr);
        }
        return md->comm_s - comm0;
    }
    for (int k = 0; k < md->nowned; k++)
        be->copy(md->sbuf + md->owned[k].xfer, md->obuf + md->owned[k].own, md->owned[k].n * F);
    if (comm) all_to_all(md);
    for (int k = 0; k < md->nheld; k++) {
        const MuonPiece *r = &md->held[k];
        const float *src = r->peer == md->rank ? md->obuf + r->own : md->rbuf + r->xfer;
        optim_muon_apply(o, r->mat, params + r->shard, src, r->n, lr);
    }
    return md->comm_s - comm0;
}
