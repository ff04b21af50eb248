/* adafactor: the factored second moments and the clipped step over this
 * rank's runs. Per step: the runs' row and column sums of g^2 + eps1 (one
 * all-reduce over dp, one over tp for the dimensions a split cuts), their
 * moving averages (the same on every rank), the row averages' sum per
 * tensor and the update's sum of squares per tensor (two small host
 * reductions), then each run's update. */
#include "adafactor.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

/* The vector of a split tensor's dimension that the split cuts is partial
 * over tp (the other ranks hold the other rows or columns): those go first
 * in the statistics, so one tp all-reduce covers them; an expert-parallel
 * rank's experts (never split over tp) last, so one EDP all-reduce covers
 * theirs and one dp all-reduce the rest. */
static void place_stats(Adafactor *a) {
    size_t at = 0;
    for (int pass = 0; pass < 3; pass++) { /* 0: the vectors partial over tp; 1: the other dense; 2: experts */
        for (int k = 0; k < a->nf; k++) {
            AdafactorFactor *f = &a->f[k];
            int rows_partial = a->tp && f->split == 1, cols_partial = a->tp && f->split == 0;
            int rp = f->expert ? 2 : rows_partial ? 0 : 1, cp = f->expert ? 2 : cols_partial ? 0 : 1;
            if (rp == pass) f->r = at, at += (size_t)f->rows;
            if (cp == pass) f->c = at, at += (size_t)f->cols;
        }
        if (pass == 0) a->nsplit = at;
        if (pass == 1) a->ndense = at;
    }
    a->nstat = at;
}

void adafactor_init(Adafactor *a, AdamW *o, const Model *m, Ddp *d, CommGroup *tp, float decay, float clip,
                    float eps1) {
    memset(a, 0, sizeof *a);
    a->be = o->be;
    a->dp = ddp_zero(d) >= 1 ? ddp_group(d) : NULL; /* ZeRO 0: every dp rank holds the whole part */
    a->edp = ddp_zero(d) >= 1 ? ddp_expert_group(d) : NULL; /* ZeRO-1's expert block: over EDP */
    size_t xlen = ddp_expert_len(d);
    a->tp = tp && tp->size > 1 ? tp : NULL;
    a->tp_rank = a->tp ? tp->rank : 0;
    a->decay = decay, a->clip = clip, a->eps1 = eps1, a->beta1 = o->beta1;
    a->nt = m->num_tensors;
    a->numel = xcalloc((size_t)a->nt, sizeof(double));
    a->tsplit = xcalloc((size_t)a->nt, sizeof(int));
    a->texpert = xcalloc((size_t)a->nt, sizeof(int));
    int *fac_of = xmalloc((size_t)a->nt * sizeof(int));
    a->f = xcalloc((size_t)a->nt + 1, sizeof(AdafactorFactor));
    for (int i = 0; i < a->nt; i++) {
        const ParamInfo *p = &m->params[i];
        a->numel[i] = (double)p->gshape[0] * (p->ndim == 2 ? p->gshape[1] : 1);
        a->tsplit[i] = p->split.dim >= 0;
        a->texpert[i] = p->offset < xlen;
        if (a->texpert[i] && a->tsplit[i])
            kiln_fail(KILN_EXIT_RUNTIME, "adafactor: expert tensor %s is split over tp", p->name);
        fac_of[i] = -1;
        if (p->ndim != 2 || !p->trained) continue;
        fac_of[i] = a->nf;
        a->f[a->nf++] = (AdafactorFactor){.tensor = i, .rows = p->shape[0], .cols = p->shape[1],
                                          .grows = p->gshape[0], .gcols = p->gshape[1], .split = p->split.dim,
                                          .parts = p->split.parts, .expert = a->texpert[i]};
    }
    place_stats(a);
    /* the runs: this rank's pieces cut at the tensors */
    size_t cap = 16;
    a->p = xmalloc(cap * sizeof(AdafactorPiece));
    DdpPiece dp;
    for (int k = 0; ddp_rank_piece(d, ddp_rank(d), k, &dp); k++)
        for (int i = 0; i < a->nt; i++) {
            const ParamInfo *p = &m->params[i];
            size_t lo = dp.lo > p->offset ? dp.lo : p->offset, hi = dp.hi < p->offset + p->numel ? dp.hi : p->offset + p->numel;
            if (lo >= hi || !p->trained) continue;
            if ((size_t)a->np == cap) a->p = xrealloc(a->p, (cap *= 2) * sizeof(AdafactorPiece));
            AdafactorPiece *r = &a->p[a->np++];
            *r = (AdafactorPiece){.tensor = i, .fac = fac_of[i], .at = dp.par + (lo - dp.lo), .n = hi - lo,
                                  .st = dp.at + (lo - dp.lo), .toff = lo - p->offset, .decay = p->decay};
            if (r->fac < 0) r->v = a->nv, a->nv += r->n;
        }
    free(fac_of);
    const Backend *be = a->be;
    a->sums = be->alloc((a->nstat + 1) * sizeof(float));
    a->stat = be->alloc((a->nstat + 1) * sizeof(float));
    a->v = be->alloc((a->nv + 1) * sizeof(float));
    a->usq_dev = be->alloc(((size_t)a->np + 1) * sizeof(double));
    a->stat_host = xcalloc(a->nstat + 1, sizeof(float));
    a->rsum = xcalloc((size_t)a->nf + 1, sizeof(double));
    a->usq = xcalloc((size_t)a->np + 1, sizeof(double));
    a->q = xcalloc(2 * (size_t)a->nt + 1, sizeof(double));
    ddp_set_adafactor(d, a);
}

void adafactor_free(Adafactor *a) {
    if (a->be) {
        a->be->free(a->sums), a->be->free(a->stat), a->be->free(a->v), a->be->free(a->usq_dev);
    }
    free(a->p), free(a->f), free(a->numel), free(a->tsplit), free(a->texpert), free(a->stat_host), free(a->rsum);
    free(a->usq);
    free(a->q);
    memset(a, 0, sizeof *a);
}

void adafactor_zero(Adafactor *a) {
    a->be->zero(a->stat, a->nstat * sizeof(float));
    a->be->zero(a->v, a->nv * sizeof(float));
}

/* Before MPI reads what the backend wrote, and before the host reads device
 * memory that tp's stream-ordered collectives write (comm_drain: with the
 * deadline). */
static void fence(const Adafactor *a) {
    if (a->tp) comm_drain(a->tp);
    if (a->be->host_mem) a->be->sync();
}

OptimStepInfo adafactor_step(Adafactor *a, AdamW *o, float *params, const float *grads, float lr, double grad_norm) {
    const Backend *be = a->be;
    OptimStepInfo info = optim_step_begin(o, grad_norm);
    if (info.nonfinite) return info;
    float gs = info.grad_scale, beta2 = (float)(1.0 - pow((double)o->t, -(double)a->decay));
    /* the row and column sums of g^2 + eps1, over every rank's runs */
    be->zero(a->sums, a->nstat * sizeof(float));
    for (int k = 0; k < a->np; k++) {
        const AdafactorPiece *r = &a->p[k];
        if (r->fac < 0) continue;
        const AdafactorFactor *f = &a->f[r->fac];
        be->adafactor_stats(a->sums + f->r, a->sums + f->c, grads + r->at, r->toff, r->n, f->cols, gs, a->eps1);
    }
    if (a->dp && a->ndense) {
        fence(a);
        comm_all_reduce_sum(a->dp, a->sums, a->ndense);
    }
    if (a->edp && a->nstat > a->ndense) {
        fence(a);
        comm_all_reduce_sum(a->edp, a->sums + a->ndense, a->nstat - a->ndense);
    }
    if (a->tp && a->nsplit) {
        fence(a);
        comm_all_reduce_sum(a->tp, a->sums, a->nsplit);
    }
    /* their moving averages: of the row means (over the global columns) and the column means */
    for (int k = 0; k < a->nf; k++) {
        const AdafactorFactor *f = &a->f[k];
        be->adafactor_ema(a->stat + f->r, a->sums + f->r, (size_t)f->rows, beta2, 1.0f / (float)f->gcols);
        be->adafactor_ema(a->stat + f->c, a->sums + f->c, (size_t)f->cols, beta2, 1.0f / (float)f->grows);
    }
    for (int k = 0; k < a->np; k++)
        if (a->p[k].fac < 0) be->adafactor_second(a->v + a->p[k].v, grads + a->p[k].at, a->p[k].n, gs, beta2, a->eps1);
    /* each factored tensor's mean row average: a row split over tp sums over it
     * (the others are whole on every tp rank: tp rank 0's counts) */
    fence(a);
    be->to_host(a->stat_host, a->stat, a->nstat * sizeof(float));
    for (int k = 0; k < a->nf; k++) {
        const AdafactorFactor *f = &a->f[k];
        double s = 0;
        for (int i = 0; i < f->rows; i++) s += a->stat_host[f->r + (size_t)i];
        a->rsum[k] = a->tp && f->split != 0 && a->tp_rank > 0 ? 0.0 : s;
    }
    if (a->tp && a->nf) comm_all_reduce_sum_f64(a->tp, a->rsum, (size_t)a->nf);
    /* the update's sum of squares per tensor, for clipping: over dp, and over tp
     * for split tensors (a tensor whole on every tp rank: tp rank 0's) */
    for (int k = 0; k < a->np; k++) {
        const AdafactorPiece *r = &a->p[k];
        const AdafactorFactor *f = r->fac >= 0 ? &a->f[r->fac] : NULL;
        float rmean = f ? (float)(a->rsum[r->fac] / f->grows) : 1.0f;
        be->adafactor_usq(a->usq_dev + k, grads + r->at, f ? NULL : a->v + r->v, f ? a->stat + f->r : NULL,
                          f ? a->stat + f->c : NULL, rmean, r->toff, r->n, f ? f->cols : 1, gs);
    }
    fence(a);
    be->to_host(a->usq, a->usq_dev, (size_t)a->np * sizeof(double));
    int nt = a->nt;
    memset(a->q, 0, 2 * (size_t)nt * sizeof(double));
    for (int k = 0; k < a->np; k++) {
        int t = a->p[k].tensor;
        if (!a->tp || a->tsplit[t] || a->tp_rank == 0) a->q[t + (a->texpert[t] ? nt : 0)] += a->usq[k];
    }
    if (a->dp) comm_all_reduce_sum_f64(a->dp, a->q, (size_t)nt);
    if (a->edp) comm_all_reduce_sum_f64(a->edp, a->q + nt, (size_t)nt);
    for (int t = 0; t < nt; t++) a->q[t] += a->q[nt + t];
    if (a->tp) comm_all_reduce_sum_f64(a->tp, a->q, (size_t)nt);
    /* the step */
    for (int k = 0; k < a->np; k++) {
        const AdafactorPiece *r = &a->p[k];
        const AdafactorFactor *f = r->fac >= 0 ? &a->f[r->fac] : NULL;
        float rmean = f ? (float)(a->rsum[r->fac] / f->grows) : 1.0f;
        double rms = sqrt(a->q[r->tensor] / a->numel[r->tensor]);
        float inv_clip = a->clip > 0 && rms > a->clip ? (float)(a->clip / rms) : 1.0f;
        be->adafactor_apply(params + r->at, grads + r->at, a->beta1 > 0 ? (float *)o->m + r->st : NULL,
                            f ? NULL : a->v + r->v, f ? a->stat + f->r : NULL, f ? a->stat + f->c : NULL, rmean,
                            r->toff, r->n, f ? f->cols : 1, gs, inv_clip, lr, a->beta1,
                            r->decay ? o->weight_decay : 0.0f);
    }
    return info;
}

/* Where a factored tensor's vector of dimension `dim` lies in the global one:
 * this rank's blocks when tp splits that dimension, else the whole. */
static void vector_boxes(const Adafactor *a, const AdafactorFactor *f, int dim, AdafactorState *s) {
    size_t local = (size_t)(dim == 0 ? f->rows : f->cols), global = (size_t)(dim == 0 ? f->grows : f->gcols);
    s->glen = global;
    if (!a->tp || f->split != dim) {
        s->nbox = 1, s->part = 0;
        s->g0[0] = 0, s->n[0] = global < local ? global : local, s->at[0] = 0;
        return;
    }
    /* parts blocks, each split over the ranks: local block k from global k gp + rank lp */
    size_t parts = (size_t)f->parts, lp = local / parts, gp = global / parts, r = (size_t)a->tp_rank;
    s->nbox = 0, s->part = 1;
    for (size_t k = 0; k < parts; k++) {
        size_t g0 = k * gp + r * lp, g1 = g0 + lp;
        if (parts == 1 && g1 > global) g1 = global; /* the vocabulary's padding past the logical tensor */
        if (g0 >= g1) continue;
        s->g0[s->nbox] = g0, s->n[s->nbox] = g1 - g0, s->at[s->nbox] = k * lp;
        s->nbox++;
    }
}

int adafactor_state(const Adafactor *a, int k, AdafactorState *s) {
    memset(s, 0, sizeof *s);
    if (k < 2 * a->nf) {
        const AdafactorFactor *f = &a->f[k / 2];
        int dim = k % 2;
        s->prefix = dim == 0 ? "optim.v_row/" : "optim.v_col/";
        s->tensor = f->tensor;
        s->ptr = a->stat + (dim == 0 ? f->r : f->c);
        s->len = (size_t)(dim == 0 ? f->rows : f->cols);
        s->vector = 1;
        vector_boxes(a, f, dim, s);
        return 1;
    }
    int j = k - 2 * a->nf, seen = 0;
    for (int i = 0; i < a->np; i++) {
        const AdafactorPiece *r = &a->p[i];
        if (r->fac >= 0 || seen++ < j) continue;
        s->prefix = "optim.v/";
        s->tensor = r->tensor;
        s->ptr = a->v + r->v;
        s->len = r->n, s->toff = r->toff;
        return 1;
    }
    return 0;
}
