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

void muon_dist_init(MuonDist *md, AdamW *o, Ddp *d, int say) {
    memset(md, 0, sizeof *md);
    md->be = o->be;
    md->g = ddp_group(d);
    md->dp = ddp_ranks(d);
    md->rank = ddp_rank(d);
    md->zero = ddp_zero(d);
    md->nmat = o->nmat;
    md->owner = xcalloc((size_t)(o->nmat + 1), sizeof(int));
    md->cost = xcalloc((size_t)md->dp, sizeof(double));
    assign_owners(md, o);
    optim_muon_own(o, md->owner, md->rank);
    if (md->zero == 0) plan_replicated(md, o);
    else plan_runs(md, o, d);
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
    }
    free(md->owner), free(md->cost), free(md->held), free(md->owned);
    memset(md, 0, sizeof *md);
}

void muon_dist_describe(const MuonDist *md, const AdamW *o, char *buf, size_t n) {
    int *count = xcalloc((size_t)md->dp, sizeof(int));
    for (int i = 0; i < md->nmat; i++) count[md->owner[i]]++;
    double most = 0, sum = 0;
    for (int r = 0; r < md->dp; r++) most = md->cost[r] > most ? md->cost[r] : most, sum += md->cost[r];
    size_t k = (size_t)snprintf(buf, n, "optim: muon owners over %d dp rank(s): matrices", md->dp);
    for (int r = 0; r < md->dp && k < n; r++) k += (size_t)snprintf(buf + k, n - k, "%s%d", r ? "/" : " ", count[r]);
    if (k < n) k += (size_t)snprintf(buf + k, n - k, ", Newton-Schulz GFLOP per step");
    for (int r = 0; r < md->dp && k < n; r++)
        k += (size_t)snprintf(buf + k, n - k, "%s%.4g", r ? "/" : " ", md->cost[r] / 1e9);
    if (k < n)
        k += (size_t)snprintf(buf + k, n - k, " (max/mean %.3f)", sum > 0 ? most / (sum / md->dp) : 1.0);
    if (md->dp > 1 && k < n) {
        const char *how = md->zero == 0   ? "an all-gather of the updates"
                          : md->zero == 1 ? "an all-to-all of the updates to their holders"
                                          : "all-to-alls of the gradients to their owners and the updates back";
        int rounds = md->zero >= 2 ? 2 : 1;
        double slots = md->zero == 0 ? (double)md->block * md->dp : (double)md->block * md->dp * (md->dp - 1);
        /* AdamW's gradient reduction: a ring all-reduce (ZeRO 0-1) sends 2 (dp - 1) / dp of the
         * arena per rank, a reduce-scatter and an all-gather (ZeRO 2) the same */
        double adamw = 2.0 * (md->dp - 1) / md->dp * (double)o->n * 4.0 / 1e6;
        snprintf(buf + k, n - k, "; per step each rank receives %.4g MB beyond AdamW's %.4g MB (%s, %.1f%% padding)",
                 rounds * (double)md->moved * 4.0 / 1e6, adamw, how, slots > 0 ? 100.0 * md->pad_total / slots : 0.0);
    }
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
    /* the owner's work: momentum and look-ahead into obuf, orthogonalised there */
    double t0 = kiln_now();
    for (int i = 0; i < o->nmat; i++) {
        const OptimMatrix *x = &o->mats[i];
        if (md->owner[i] != md->rank) continue;
        float *u = md->obuf + x->mom;
        optim_muon_momentum(o, i, md->zero >= 2 ? u : grads + x->off, grad_scale, u);
        optim_muon_orthogonalise(o, u, x->rows, x->cols);
    }
    be->sync(); /* so the time is the work's, not the exchange's */
    md->ns_s += kiln_now() - t0;
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
