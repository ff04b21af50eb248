/* ddp: gradient synchronisation and the sharded optimizer step over the dp
 * group. ZeRO 0-1: the gradient arena is laid out decayed-first (model.h), so
 * a layer's gradients are not contiguous; but within each of the two groups
 * the tensors lie in listing order, and the backward pass completes them from
 * the last layer to the first. The tensors complete after layer l's backward
 * are therefore a suffix of each group, and a bucket is two contiguous ranges.
 * ZeRO 2-3 lay the arena out by layer instead and shard each layer: see the
 * "ZeRO-2 and -3" section below and docs/parallel.md. */
#include "ddp.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "adafactor.h"
#include "muon.h"
#include "util.h"

/* Before a collective reads what the backend wrote. Host memory (MPI): the
 * backend's queue must have drained. Device memory (NCCL device mode): comm
 * orders the collective after the compute stream by an event, and a device
 * synchronisation would also wait, without a deadline, for collectives in
 * flight (comm.h) -- so nothing. */
static void host_comm_fence(const Ddp *d) {
    if (d->m->be->host_mem) d->m->be->sync();
}

/* Bucket group of tensor i: 0 weight-decayed, 1 not, 2 an expert of an
 * expert-parallel model (its own range, first in the arena). */
static int bucket_group(const Ddp *d, int i) {
    const ParamInfo *p = &d->m->params[i];
    if (d->m->ep > 1 && p->expert >= 0) return 2;
    return p->decay ? 0 : 1;
}

static void plan_buckets(Ddp *d, size_t bucket_floats) {
    Model *m = d->m;
    int L = m->shape.n_layer;
    size_t gend[DDP_GROUPS] = {m->num_decay, m->num_params, d->dense0}, gbeg[DDP_GROUPS] = {d->dense0, m->num_decay, 0};
    /* start[g][l+1]: lowest offset in group g of a tensor ready at hook >= l;
     * l runs -1..L, start[g][L+1] = the group's end */
    size_t *start[DDP_GROUPS];
    int ok = 1;
    for (int g = 0; g < DDP_GROUPS; g++) {
        start[g] = xmalloc((size_t)(L + 2) * sizeof(size_t));
        for (int l = -1; l <= L; l++) start[g][l + 1] = gend[g];
        /* the suffix property: in arena order, ready layers never decrease */
        int last = -2;
        size_t last_off = 0;
        for (int pass = 0; pass < m->num_tensors; pass++) {
            /* tensors of this group by offset (the table is in listing order,
             * which is arena order within a group) */
            const ParamInfo *p = &m->params[pass];
            if (bucket_group(d, pass) != g) continue;
            int r = model_grads_ready_layer(m, pass);
            if (p->offset < last_off || r < last) ok = 0;
            last = r, last_off = p->offset;
            if (p->offset < start[g][r + 1]) start[g][r + 1] = p->offset;
        }
        for (int l = L - 1; l >= -1; l--)
            if (start[g][l + 2] < start[g][l + 1]) start[g][l + 1] = start[g][l + 2];
        (void)gbeg;
    }
    d->b = xcalloc((size_t)(L + 1), sizeof(DdpBucket));
    d->nb = 0;
    if (!ok) {
        /* one bucket at the end (never expected for arch.c's tables) */
        DdpBucket *b = &d->b[d->nb++];
        b->layer = -1;
        for (int g = 0; g < DDP_GROUPS; g++) b->off[g] = gbeg[g], b->len[g] = gend[g] - gbeg[g];
    } else {
        size_t hi[DDP_GROUPS] = {gend[0], gend[1], gend[2]};
        for (int l = L - 1; l >= -1; l--) {
            size_t pend = 0;
            for (int g = 0; g < DDP_GROUPS; g++) pend += hi[g] - start[g][l + 1];
            if (pend == 0 || (pend < bucket_floats && l > -1)) continue;
            DdpBucket *b = &d->b[d->nb++];
            b->layer = l;
            for (int g = 0; g < DDP_GROUPS; g++) {
                b->off[g] = start[g][l + 1];
                b->len[g] = hi[g] - start[g][l + 1];
                hi[g] = start[g][l + 1];
            }
        }
    }
    for (int g = 0; g < DDP_GROUPS; g++) free(start[g]);
    d->req = xcalloc((size_t)(DDP_GROUPS * d->nb), sizeof(CommRequest));
}

/* ------------------------------------------------------- ZeRO-2 and -3 */

static int unit_pre_hook(void *ctx, int layer, int backward);
static void unit_post_hook(void *ctx, int layer);
static void ddp_hook(void *ctx, int layer);

/* Plan the unit shards and the optimizer's segments, and allocate the fp32
 * parameter shard; the other buffers wait for ddp_shard_params. */
size_t ddp_unit_align(int dp) { return (size_t)64 * (size_t)(dp > 1 ? dp : 1); }

static void unit_init(Ddp *d) {
    Model *m = d->m;
    int L = m->shape.n_layer;
    /* each unit a multiple of dp blocks of 64 floats: a unit's all-gather
     * then lands exactly on its arena range (ZeRO-2 gathers in place) */
    model_layout_by_unit(m, ddp_unit_align(d->dp));
    d->units = 1;
    d->whole_params = d->zero == 2;
    d->nu = m->n_units;
    d->us = xcalloc((size_t)d->nu, sizeof(ShardRange));
    d->at = xcalloc((size_t)d->nu, sizeof(size_t));
    d->seg = xcalloc((size_t)m->num_tensors, sizeof(OptimSegment));
    for (int u = 0; u < d->nu; u++) {
        d->us[u] = mesh_shard_range(m->unit_len[u], d->dp, d->rank, 64);
        if (d->us[u].padded_n != m->unit_len[u])
            kiln_fail(KILN_EXIT_RUNTIME, "ddp: unit %d of %zu floats does not split into %d blocks", u,
                      m->unit_len[u], d->dp);
        d->at[u] = d->shard_len;
        d->shard_len += d->us[u].block;
        if (u < L && m->unit_len[u] > d->slot_len) d->slot_len = m->unit_len[u];
    }
    /* each tensor's part inside this rank's block of its unit */
    for (int i = 0; i < m->num_tensors; i++) {
        const ParamInfo *p = &m->params[i];
        int u = model_unit_of(m, i);
        size_t lo = m->unit_off[u] + d->us[u].lo, hi = m->unit_off[u] + d->us[u].hi;
        size_t a = p->offset > lo ? p->offset : lo, b = p->offset + p->numel < hi ? p->offset + p->numel : hi;
        if (a >= b) continue;
        size_t k = d->at[u] + (a - lo);
        d->seg[d->nseg++] = (OptimSegment){.off = k, .n = b - a, .decay = p->decay, .at = k, .arena = a};
    }
    d->pshard = m->be->alloc((d->shard_len + 1) * sizeof(float));
    d->held[0] = d->held[1] = d->rlayer[0] = d->rlayer[1] = -1;
    if (d->whole_params) {
        d->preq = xcalloc((size_t)d->nu, sizeof(CommRequest));
        d->refreshed = xcalloc((size_t)d->nu, sizeof(int));
    }
}

/* The gradient shard, slots and targets (and ZeRO-3's gather buffers), once:
 * nothing is allocated per step. Called after ZeRO-3 freed the whole arena,
 * so start-up never holds it next to these. The views point at them from
 * here on. */
static void unit_alloc(Ddp *d) {
    Model *m = d->m;
    const Backend *be = m->be;
    int L = m->shape.n_layer;
    d->gshard = be->alloc((d->shard_len + 1) * sizeof(float));
    size_t layer_block = d->slot_len / (size_t)d->dp;
    for (int s = 0; s < 2; s++) {
        if (!d->accum_grads) {
            d->gbuf[s] = be->alloc((d->slot_len + 1) * sizeof(float));
            d->rs_tmp[s] = be->alloc((layer_block + 1) * sizeof(float));
        }
        if (!d->whole_params) d->pbuf[s] = be->alloc((d->slot_len + 1) * sizeof(float));
    }
    if (!d->whole_params) d->prest = be->alloc((m->unit_len[L] + 1) * sizeof(float));
    if (d->accum_grads) {
        /* pipeline: the stage's whole gradients, zero between tensors (the norm reads the padding) */
        d->gacc = be->alloc((m->arena_len + 1) * sizeof(float));
        be->zero(d->gacc, (m->arena_len + 1) * sizeof(float));
        d->ureq = xcalloc((size_t)d->nu, sizeof(CommRequest));
        d->rs_posted = xcalloc((size_t)d->nu, sizeof(int));
        for (int u = 0; u <= L; u++) model_bind_unit(m, u, u < L ? d->pbuf[u % 2] : d->prest, d->gacc + m->unit_off[u]);
        m->layer_grads_fresh = 0; /* the model accumulates over the micro-batches */
        return;
    }
    d->grest = be->alloc(m->unit_len[L] * sizeof(float));
    for (int l = 0; l < L; l++) model_bind_unit(m, l, d->pbuf[l % 2], d->gbuf[l % 2]);
    model_bind_unit(m, L, d->prest, d->grest);
    m->layer_grads_fresh = 1;
}

/* This rank's blocks of the whole arena into the fp32 parameter shard. */
static void unit_take_blocks(Ddp *d) {
    Model *m = d->m;
    for (int u = 0; u < d->nu; u++)
        m->be->copy(d->pshard + d->at[u], m->param_mem + m->unit_off[u] + d->us[u].lo,
                    (d->us[u].hi - d->us[u].lo) * sizeof(float));
}

void ddp_shard_params(Ddp *d) {
    if (!d->units) return;
    Model *m = d->m;
    unit_take_blocks(d);
    if (!d->whole_params) {
        m->be->free(m->param_mem);
        m->param_mem = NULL;
    }
    unit_alloc(d); /* ZeRO-2: pbuf and prest are NULL, the parameter views stay */
    model_set_hooks(m, &(ModelHooks){.ctx = d, .layer_begin = unit_pre_hook, .grads_done = unit_post_hook});
}

void ddp_params_loaded(Ddp *d) {
    if (d->units && d->whole_params) unit_take_blocks(d);
}

static void blocked(Ddp *d, double t0) {
    double dt = kiln_now() - t0;
    d->blocked_s += dt, d->step_blocked_s += dt;
}

/* ZeRO-2: unit u's refreshed parameters are in the whole arena when this
 * returns; the refreshes of later units get a turn of MPI's progress (it
 * only moves inside MPI calls). */
static void z2_need(Ddp *d, int u) {
    if (d->preq[u].active) {
        double t0 = kiln_now();
        comm_wait(&d->preq[u]);
        blocked(d, t0);
    }
    if (d->g->dev) return; /* NCCL progresses on its own */
    for (int v = 0; v < d->nu; v++)
        if (d->preq[v].active) comm_test(&d->preq[v]);
}

/* ZeRO-2: 1 the first time unit u is asked for after its refresh was posted. */
static int z2_changed(Ddp *d, int u) {
    int r = d->refreshed[u];
    d->refreshed[u] = 0;
    return r;
}

void ddp_params_ready(Ddp *d) {
    if (!d->units || !d->whole_params) return;
    double t0 = kiln_now();
    for (int u = 0; u < d->nu; u++)
        if (d->preq[u].active) comm_wait(&d->preq[u]);
    blocked(d, t0);
}

/* ZeRO-2, after the optimizer step: post every unit's all-gather from the
 * shard into the whole arena, in the order the next forward needs them
 * (wte/wpe first, then layer 0 up). Lazy, not eager: a blocking gather here
 * would sit fully exposed between the optimizer and the next forward (there
 * is no computation to hide it behind), whereas each unit waited for at its
 * first use overlaps with the forward of the layers before it, and with
 * anything else done between steps; only wte/wpe's (needed first) is
 * exposed. The memory is the same either way: the whole arena is resident.
 * With NCCL the same posts run on the communication stream. */
static void z2_post_refresh(Ddp *d) {
    Model *m = d->m;
    int L = m->shape.n_layer;
    host_comm_fence(d); /* the shard is updated before MPI reads it */
    for (int k = 0; k <= L; k++) {
        int u = k == 0 ? L : k - 1;
        if (!d->us[u].block) continue; /* a pipeline stage's units of other stages' layers are empty */
        comm_iall_gather(d->g, d->pshard + d->at[u], m->param_mem + m->unit_off[u], d->us[u].block, &d->preq[u]);
        d->refreshed[u] = 1;
    }
}

/* ZeRO-3: post the all-gather of layer l's parameters into its slot (prefetch). */
static void z3_post_gather(Ddp *d, int l) {
    int s = l % 2;
    if (l < 0 || l >= d->m->shape.n_layer || d->held[s] == l || !d->us[l].block) return; /* empty: another stage's */
    if (d->greq[s].active) comm_wait(&d->greq[s]); /* never expected: the slot's last layer is done */
    comm_iall_gather(d->g, d->pshard + d->at[l], d->pbuf[s], d->us[l].block, &d->greq[s]);
    d->held[s] = l;
}

/* ZeRO-3: layer l's parameters are in pbuf[l % 2] when this returns. */
static void z3_need(Ddp *d, int l) {
    int s = l % 2;
    z3_post_gather(d, l);
    if (d->greq[s].active) {
        double t0 = kiln_now();
        comm_wait(&d->greq[s]);
        blocked(d, t0);
    }
}

/* Finish the reduce-scatter from gbuf[slot] and add it to the layer's shard. */
static void unit_finish_rs(Ddp *d, int s) {
    int l = d->rlayer[s];
    if (l < 0) return;
    double t0 = kiln_now();
    comm_wait(&d->rreq[s]);
    blocked(d, t0);
    float *dst = d->gshard + d->at[l];
    size_t n = d->us[l].block;
    if (d->first) d->m->be->copy(dst, d->rs_tmp[s], n * sizeof(float));
    else d->m->be->add(dst, dst, d->rs_tmp[s], n);
    d->rlayer[s] = -1;
}

/* Pipeline (accum_grads): post unit u's reduce-scatter from the stage's
 * gradients straight into its shard, once a step; the others in flight get
 * a turn of MPI's progress. */
static void unit_post_rs(Ddp *d, int u) {
    if (d->rs_posted[u]) return;
    d->rs_posted[u] = 1;
    if (!d->us[u].block) return;
    if (u == d->nu - 1 && d->rest_reduced) { /* all-reduced whole (ddp_wait_grads): this rank's block of it */
        d->m->be->copy(d->gshard + d->at[u], d->gacc + d->m->unit_off[u] + d->us[u].start,
                       d->us[u].block * sizeof(float));
        d->rest_reduced = 0;
        return;
    }
    host_comm_fence(d);
    comm_ireduce_scatter(d->g, d->gacc + d->m->unit_off[u], d->gshard + d->at[u], d->us[u].block, &d->ureq[u]);
    if (d->g->dev) return;
    for (int v = 0; v < d->nu; v++)
        if (d->ureq[v].active) comm_test(&d->ureq[v]);
}

/* Pipeline (accum_grads), after the last backward and the tied embedding's
 * sum: every unit's reduce-scatter posted (wte/wpe/ln_f's now) and done. */
static void unit_finish_accum(Ddp *d) {
    double t0 = kiln_now();
    for (int u = d->nu - 1; u >= 0; u--) unit_post_rs(d, u);
    for (int u = 0; u < d->nu; u++) {
        if (d->ureq[u].active) comm_wait(&d->ureq[u]);
        d->rs_posted[u] = 0;
    }
    blocked(d, t0);
}

/* Returns 1 when the unit's parameter values may differ from its last use
 * (the model then casts its compute copy again): ZeRO-2, the first use after
 * a refresh was posted; ZeRO-3, always (the slot held another layer). */
static int unit_pre_hook(void *ctx, int layer, int backward) {
    Ddp *d = ctx;
    int L = d->m->shape.n_layer;
    if (layer < 0) {
        if (d->whole_params) {
            z2_need(d, L);
            return z2_changed(d, L);
        }
        int fresh = !d->rest_held; /* wte/wpe/ln_f stay gathered until the optimizer step */
        if (fresh && d->us[L].block) { /* a middle pipeline stage has none */
            double t0 = kiln_now();
            comm_all_gather(d->g, d->pshard + d->at[L], d->prest, d->us[L].block);
            blocked(d, t0);
        }
        d->rest_held = 1;
        z3_post_gather(d, d->m->layer_lo); /* the first layer of the stage (or chunk) being run */
        return fresh;
    }
    if (backward && !d->accum_grads) unit_finish_rs(d, layer % 2); /* gbuf[slot] is about to be overwritten */
    if (d->whole_params) {
        if (!backward) z2_need(d, layer);
        return z2_changed(d, layer);
    }
    z3_need(d, layer);
    z3_post_gather(d, backward ? layer - 1 : layer + 1);
    return 1;
}

/* After layer l's backward: reduce-scatter its gradients (every micro-batch:
 * at most two layers' whole gradients ever exist); after the embeddings' on
 * the last micro-batch, the accumulated wte/wpe/ln_f gradients. */
static void unit_post_hook(void *ctx, int layer) {
    Ddp *d = ctx;
    Model *m = d->m;
    if (d->accum_grads) {
        if (layer >= 0 && d->last) unit_post_rs(d, layer);
        return; /* wte/wpe/ln_f: ddp_reduce_grads, after the tied embedding's sum */
    }
    if (layer >= 0) {
        int s = layer % 2;
        host_comm_fence(d);
        comm_ireduce_scatter(d->g, d->gbuf[s], d->rs_tmp[s], d->us[layer].block, &d->rreq[s]);
        d->rlayer[s] = layer;
        /* MPI progresses only inside MPI calls: the prefetch of layer l-1
         * (ZeRO-3) and layer l+1's reduce-scatter share the other slot */
        if (d->greq[1 - s].active) comm_test(&d->greq[1 - s]);
        if (d->rreq[1 - s].active) comm_test(&d->rreq[1 - s]);
        return;
    }
    double t0 = kiln_now();
    for (int s = 0; s < 2; s++) unit_finish_rs(d, s);
    if (d->last) {
        int L = m->shape.n_layer;
        host_comm_fence(d);
        comm_reduce_scatter(d->g, d->grest, d->gshard + d->at[L], d->us[L].block);
    }
    blocked(d, t0);
}

/* Sum of squares of the gradients at g, which hold arena elements [lo, hi):
 * under tp, this rank's parts of split tensors and (tp rank 0) the
 * replicated tensors; padding between tensors is zero either way. */
static double grad_sumsq(const Ddp *d, const float *g, size_t lo, size_t hi) {
    const Backend *be = d->m->be;
    if (!d->tp) return be->sumsq(g, hi - lo);
    double sq = 0;
    for (int r = 0; r < d->nrun; r++) {
        size_t a = d->run_lo[r] > lo ? d->run_lo[r] : lo, b = d->run_hi[r] < hi ? d->run_hi[r] : hi;
        if (a < b && (d->run_split[r] || d->tp->rank == 0)) sq += be->sumsq(g + (a - lo), b - a);
    }
    return sq;
}

void ddp_test_poison(Ddp *d) { d->poison = 1; }

void ddp_set_tp(Ddp *d, CommGroup *g) {
    Model *m = d->m;
    if (!g || g->size <= 1) return;
    d->tp = g;
    int n = m->num_tensors;
    int *order = xmalloc((size_t)n * sizeof(int));
    for (int i = 0; i < n; i++) order[i] = i;
    for (int i = 1; i < n; i++) /* by arena offset (a few hundred tensors: insertion sort) */
        for (int j = i; j > 0 && m->params[order[j]].offset < m->params[order[j - 1]].offset; j--) {
            int t = order[j];
            order[j] = order[j - 1], order[j - 1] = t;
        }
    d->run_lo = xmalloc((size_t)n * sizeof(size_t));
    d->run_hi = xmalloc((size_t)n * sizeof(size_t));
    d->run_split = xmalloc((size_t)n * sizeof(int));
    d->nrun = 0;
    for (int k = 0; k < n; k++) {
        const ParamInfo *p = &m->params[order[k]];
        int split = p->split.dim >= 0, r = d->nrun;
        if (r > 0 && d->run_split[r - 1] == split) {
            d->run_hi[r - 1] = p->offset + p->numel;
            continue;
        }
        d->run_lo[r] = p->offset, d->run_hi[r] = p->offset + p->numel, d->run_split[r] = split;
        d->nrun++;
    }
    free(order);
}

/* The global gradient norm from every rank's shard (padding is zero). */
static void poison_if_asked(Ddp *d, float *g) {
    if (!d->poison) return;
    float nan = NAN;
    d->m->be->to_device(g, &nan, sizeof nan);
    d->poison = 0;
}

/* grad_sumsq of arena elements [lo, hi) at g, leaving out the pipeline's
 * skipped range (a tied embedding's second copy). */
static double piece_sumsq(const Ddp *d, const float *g, size_t lo, size_t hi) {
    size_t a = d->skip_lo < lo ? lo : d->skip_lo > hi ? hi : d->skip_lo;
    size_t b = d->skip_hi < a ? a : d->skip_hi > hi ? hi : d->skip_hi;
    double sq = a > lo ? grad_sumsq(d, g, lo, a) : 0;
    if (hi > b) sq += grad_sumsq(d, g + (b - lo), b, hi);
    return sq;
}

static double unit_norm(Ddp *d) {
    if (d->accum_grads) unit_finish_accum(d);
    double t0 = kiln_now();
    double sq = 0;
    poison_if_asked(d, d->gshard);
    if (!d->tp && !d->pp) {
        sq = d->m->be->sumsq(d->gshard, d->shard_len);
    } else {
        DdpPiece p;
        for (int i = 0; ddp_shard_piece(d, i, &p); i++) sq += piece_sumsq(d, d->gshard + p.at, p.lo, p.hi);
    }
    comm_all_reduce_sum_f64(d->g, &sq, 1);
    if (d->tp) comm_all_reduce_sum_f64(d->tp, &sq, 1);
    if (d->pp) comm_all_reduce_sum_f64(d->pp, &sq, 1);
    blocked(d, t0);
    return sqrt(sq);
}

void ddp_micro_begin(Ddp *d, int first, int last) {
    d->first = first, d->last = last;
    if (first) d->step_blocked_s = 0;
    if (!d->units && last) ddp_arm(d);
}

void ddp_pipe_begin(Ddp *d, int first, int last_of_chunk, int last_of_rank) {
    ddp_micro_begin(d, first, d->units ? last_of_chunk : last_of_rank);
}

/* A group whose float collectives take the backend's buffers: host memory
 * (MPI), or NCCL device mode. */
static void need_device_mode(const Ddp *d, const CommGroup *g, const char *key, int n) {
    if (g && !d->m->be->host_mem && !g->dev)
        kiln_fail(KILN_EXIT_RUNTIME,
                  "%s = %d on the '%s' backend: group '%s' must be in NCCL device mode before ddp_init "
                  "(comm_nccl_device_mode)", key, n, d->m->be->name, g->name);
}

/* Expert parallelism: the groups, and ZeRO-1's expert block over EDP (the
 * expert region padded to equal blocks before the dense blocks are planned). */
static void experts_init(Ddp *d, const DdpExperts *ex) {
    Model *m = d->m;
    if (m->ep <= 1) return;
    if (!ex || !ex->ep || ex->ep->size != m->ep)
        kiln_fail(KILN_EXIT_RUNTIME, "ddp_init: an expert-parallel model (ep %d) needs its ep and EDP groups",
                  m->ep);
    if (d->zero >= 2)
        kiln_fail(KILN_EXIT_USAGE, "key 'parallel.zero': expert parallelism runs with ZeRO 0 or 1, got %d", d->zero);
    d->epg = ex->ep;
    d->eg = ex->edp && ex->edp->size > 1 ? ex->edp : NULL;
    need_device_mode(d, d->eg, "parallel.dp / parallel.ep", d->eg ? d->eg->size : 1);
    int ne = d->eg ? d->eg->size : 1, re = d->eg ? d->eg->rank : 0;
    if (d->zero >= 1) {
        d->xlen = m->expert_len;
        d->xshard = mesh_shard_range(m->expert_len, ne, re, 64);
        model_pad_experts(m, d->xshard.padded_n);
    }
    d->dense0 = m->expert_len;
}

/* ZeRO-1 under expert parallelism: the optimizer's segments, the dense
 * block (split at the weight-decay boundary) then the expert block (all
 * decayed: model.c places experts among the decayed tensors), their state
 * back to back, their parameters and gradients where the arena has them. */
static void experts_segments(Ddp *d) {
    Model *m = d->m;
    d->zseg = xcalloc(3, sizeof(OptimSegment));
    size_t a = d->dense0 + d->shard.lo, b = d->dense0 + d->shard.hi, k = 0, nd = m->num_decay;
    size_t mid = a > nd ? a : b < nd ? b : nd;
    if (mid > a) d->zseg[d->nzseg++] = (OptimSegment){.off = k, .n = mid - a, .decay = 1, .at = a, .arena = a}, k += mid - a;
    if (b > mid) d->zseg[d->nzseg++] = (OptimSegment){.off = k, .n = b - mid, .decay = 0, .at = mid, .arena = mid}, k += b - mid;
    if (d->xshard.hi > d->xshard.lo)
        d->zseg[d->nzseg++] = (OptimSegment){.off = k, .n = d->xshard.hi - d->xshard.lo, .decay = 1,
                                             .at = d->xshard.lo, .arena = d->xshard.lo};
}

void ddp_init(Ddp *d, Model *m, CommGroup *g, int zero, size_t bucket_bytes, const DdpExperts *ex) {
    memset(d, 0, sizeof *d);
    d->m = m;
    d->g = g && g->size > 1 ? g : NULL;
    d->dp = d->g ? g->size : 1;
    d->rank = d->g ? g->rank : 0;
    d->zero = zero;
    need_device_mode(d, d->g, "parallel.dp", d->dp);
    /* ZeRO 2 and 3 on one rank have nothing to shard: plain training */
    if (zero >= 2 && !d->g) d->zero = zero = 0;
    experts_init(d, ex);
    if (zero >= 2) {
        unit_init(d);
        return;
    }
    d->shard = mesh_shard_range(m->num_params - d->dense0, d->dp, d->rank, 64);
    if (zero >= 1) model_pad_arenas(m, d->dense0 + d->shard.padded_n);
    if (zero >= 1 && m->ep > 1) experts_segments(d);
    plan_buckets(d, bucket_bytes / sizeof(float));
    d->overlap = d->g != NULL;
    if (d->overlap) model_set_hooks(m, &(ModelHooks){.ctx = d, .grads_done = ddp_hook});
}

void ddp_free(Ddp *d) {
    const Backend *be = d->m->be;
    model_set_hooks(d->m, NULL);
    if (d->units) {
        ddp_params_ready(d); /* no request may outlive its buffers */
        be->free(d->pshard);
        if (d->gshard) be->free(d->gshard);
        if (d->grest) be->free(d->grest);
        if (d->prest) be->free(d->prest);
        if (d->gacc) be->free(d->gacc);
        for (int s = 0; s < 2; s++) {
            if (d->gbuf[s]) be->free(d->gbuf[s]), be->free(d->rs_tmp[s]);
            if (d->pbuf[s]) be->free(d->pbuf[s]);
        }
        if (d->ureq)
            for (int u = 0; u < d->nu; u++)
                if (d->ureq[u].active) comm_wait(&d->ureq[u]);
        free(d->us), free(d->at), free(d->seg), free(d->preq), free(d->refreshed), free(d->ureq), free(d->rs_posted);
    }
    free(d->zseg);
    free(d->b);
    free(d->req);
    free(d->run_lo), free(d->run_hi), free(d->run_split);
    memset(d, 0, sizeof *d);
}

void ddp_optim_range(const Ddp *d, size_t *lo, size_t *hi) {
    if (d->units) *lo = 0, *hi = d->shard_len;
    else if (d->zseg) *lo = 0, *hi = (d->shard.hi - d->shard.lo) + (d->xshard.hi - d->xshard.lo);
    else if (d->zero >= 1) *lo = d->shard.lo, *hi = d->shard.hi;
    else *lo = 0, *hi = d->m->num_params;
}

size_t ddp_grad_floats(const Ddp *d) {
    if (!d->units) return d->m->arena_len;
    if (d->accum_grads) return d->shard_len + d->m->arena_len;
    return d->shard_len + 2 * d->slot_len + 2 * (d->slot_len / (size_t)d->dp) + d->m->unit_len[d->nu - 1];
}

/* Dense ranges reduce over dp, the expert range over EDP (nothing to add
 * when each expert has one holder). */
static void post_bucket(Ddp *d, int i) {
    DdpBucket *b = &d->b[i];
    for (int g = 0; g < DDP_GROUPS; g++) {
        CommGroup *grp = g == 2 ? d->eg : d->g;
        if (b->len[g] && grp)
            comm_iall_reduce_sum(grp, d->m->grad_mem + b->off[g], b->len[g], &d->req[DDP_GROUPS * i + g]);
    }
}

/* Called by model_backward after each layer: post the buckets now complete,
 * and let MPI progress the ones in flight (it only does inside MPI calls). */
static void ddp_hook(void *ctx, int layer) {
    Ddp *d = ctx;
    if (!d->armed) return;
    while (d->posted < d->nb && d->b[d->posted].layer >= layer) post_bucket(d, d->posted++);
    for (int i = 0; i < DDP_GROUPS * d->posted; i++)
        if (d->req[i].active) comm_test(&d->req[i]);
}

void ddp_arm(Ddp *d) {
    d->posted = 0;
    d->step_blocked_s = 0;
    d->armed = d->overlap;
}

void ddp_wait_grads(Ddp *d) {
    if (d->accum_grads && d->tied && !d->rest_reduced) {
        Model *m = d->m;
        int L = m->shape.n_layer;
        double t0 = kiln_now();
        host_comm_fence(d);
        comm_all_reduce_sum(d->g, d->gacc + m->unit_off[L], m->unit_len[L]);
        blocked(d, t0);
        d->rest_reduced = 1;
    }
    if (d->units) return;
    d->armed = 0;
    if (d->g) {
        double t0 = kiln_now();
        while (d->posted < d->nb) post_bucket(d, d->posted++); /* hook not armed (never with overlap) */
        for (int i = 0; i < DDP_GROUPS * d->nb; i++)
            if (d->req[i].active) comm_wait(&d->req[i]);
        blocked(d, t0);
    }
}

void ddp_set_pp(Ddp *d, CommGroup *g, int skip, int tied) {
    if (!g || g->size <= 1) return;
    d->pp = g;
    d->accum_grads = d->units;
    d->tied = tied;
    if (skip >= 0) d->skip_lo = d->m->params[skip].offset, d->skip_hi = d->skip_lo + d->m->params[skip].numel;
}

double ddp_reduce_grads(Ddp *d) {
    Model *m = d->m;
    if (d->units) return unit_norm(d);
    ddp_wait_grads(d);
    poison_if_asked(d, m->grad_mem);
    /* pipeline: all but the skipped range, in the two runs around it (a
     * tied embedding's copy: never in the expert range); expert
     * parallelism: the dense range here, the experts' below */
    size_t n = m->num_params, a = d->skip_lo < n ? d->skip_lo : n, b = d->skip_hi < n ? d->skip_hi : n;
    if (a < d->dense0) a = d->dense0;
    if (b < a) b = a;
    double sq = grad_sumsq(d, m->grad_mem + d->dense0, d->dense0, a);
    if (b < n) sq += grad_sumsq(d, m->grad_mem + b, b, n);
    if (m->ep > 1) {
        /* each expert once: the ep ranks hold different experts, the EDP
         * ranks (after the reduction) the same */
        double t0 = kiln_now(), sx = grad_sumsq(d, m->grad_mem, 0, d->dense0);
        comm_all_reduce_sum_f64(d->epg, &sx, 1);
        blocked(d, t0);
        sq += sx;
    }
    if (d->tp) comm_all_reduce_sum_f64(d->tp, &sq, 1);
    if (d->pp) comm_all_reduce_sum_f64(d->pp, &sq, 1);
    return sqrt(sq);
}

void ddp_reduce_grads_local(Ddp *d) {
    if (d->g || d->tp || d->pp || d->units || d->m->ep > 1)
        kiln_fail(KILN_EXIT_RUNTIME, "ddp: the one-rank gradient path on a layout with collectives");
    ddp_wait_grads(d);
    poison_if_asked(d, d->m->grad_mem);
}

int ddp_whole_update(const Ddp *d) { return !d->units && !d->zseg && (d->zero == 0 || !d->g); }

/* Muon's matrices (muon.c), after the elementwise part: params is this
 * rank's optimizer part, grads the whole gradient arena (ZeRO 0-1) or the
 * shard (ZeRO 2-3). Its exchanges count as time blocked. */
static void muon_after(Ddp *d, AdamW *o, float *params, const float *grads, float lr, float grad_scale) {
    double comm_s = muon_dist_step(d->muon, o, params, grads, lr, grad_scale);
    d->blocked_s += comm_s, d->step_blocked_s += comm_s;
}

void ddp_set_muon(Ddp *d, struct MuonDist *md) { d->muon = md; }

void ddp_set_adafactor(Ddp *d, struct Adafactor *a) { d->adafactor = a; }

OptimStepInfo ddp_optim_step(Ddp *d, AdamW *o, float lr, double grad_norm) {
    Model *m = d->m;
    if (d->units) {
        OptimStepInfo info = d->adafactor ? adafactor_step(d->adafactor, o, d->pshard, d->gshard, lr, grad_norm)
                                          : optim_step_segments(o, d->pshard, d->gshard, d->seg, d->nseg, lr,
                                                                grad_norm);
        if (d->muon && !info.nonfinite) muon_after(d, o, d->pshard, d->gshard, lr, info.grad_scale);
        if (!d->whole_params) {
            /* the gathered copies are stale now: the next forward gathers again */
            d->held[0] = d->held[1] = -1, d->rest_held = 0;
        } else if (!info.nonfinite) {
            z2_post_refresh(d); /* a skipped step changed nothing: nothing to refresh */
        }
        return info;
    }
    if (d->zero == 0) {
        OptimStepInfo info = d->adafactor ? adafactor_step(d->adafactor, o, m->param_mem, m->grad_mem, lr, grad_norm)
                                          : optim_step_norm(o, model_param_arena(m), m->grad_mem, lr, grad_norm);
        if (d->muon && !info.nonfinite) muon_after(d, o, m->param_mem, m->grad_mem, lr, info.grad_scale);
        return info;
    }
    if (d->zseg) {
        /* ZeRO-1 under expert parallelism: this rank's dense block and
         * expert block (Muon's matrices: their owners over dp and over EDP,
         * muon.c), then each gathered over its own group */
        OptimStepInfo info = d->adafactor ? adafactor_step(d->adafactor, o, m->param_mem, m->grad_mem, lr, grad_norm)
                                          : optim_step_segments(o, m->param_mem, m->grad_mem, d->zseg, d->nzseg, lr,
                                                                grad_norm);
        if (info.nonfinite) return info;
        if (d->muon) muon_after(d, o, m->param_mem, m->grad_mem, lr, info.grad_scale);
        host_comm_fence(d);
        double t0 = kiln_now();
        float *dense = m->param_mem + d->dense0;
        if (d->g) comm_all_gather(d->g, dense + d->shard.start, dense, d->shard.block);
        if (d->eg) comm_all_gather(d->eg, m->param_mem + d->xshard.start, m->param_mem, d->xshard.block);
        blocked(d, t0);
        return info;
    }
    OptimStepInfo info = d->adafactor ? adafactor_step(d->adafactor, o, m->param_mem + d->shard.lo,
                                                       m->grad_mem + d->shard.lo, lr, grad_norm)
                                      : optim_step_norm(o, m->param_mem + d->shard.lo, m->grad_mem + d->shard.lo, lr,
                                                        grad_norm);
    if (d->muon && !info.nonfinite) muon_after(d, o, m->param_mem + d->shard.lo, m->grad_mem, lr, info.grad_scale);
    if (info.nonfinite || !d->g) return info; /* every rank skipped: the norm is global */
    host_comm_fence(d);
    double t0 = kiln_now();
    /* in place: this rank's block is already where the gathered arena wants it */
    comm_all_gather(d->g, m->param_mem + d->shard.start, m->param_mem, d->shard.block);
    blocked(d, t0);
    return info;
}

double ddp_sum(Ddp *d, double x) {
    ddp_sum_n(d, &x, 1);
    return x;
}

void ddp_sum_n(Ddp *d, double *x, size_t n) {
    if (d->g) comm_all_reduce_sum_f64(d->g, x, n);
}

int ddp_ranks(const Ddp *d) { return d->dp; }

int ddp_whole_params(const Ddp *d) { return !d->units || d->whole_params; }

float *ddp_param_shard(const Ddp *d, size_t *n) {
    if (n) *n = d->units ? d->shard_len : 0;
    return d->units ? d->pshard : NULL;
}

float *ddp_optim_grads(const Ddp *d) { return d->units ? d->gshard : d->m->grad_mem; }

int ddp_shard_piece(const Ddp *d, int i, DdpPiece *p) {
    if (d->zseg) {
        size_t nd = d->shard.hi - d->shard.lo;
        if (i == 0) *p = (DdpPiece){.at = 0, .lo = d->dense0 + d->shard.lo, .hi = d->dense0 + d->shard.hi,
                                    .par = d->dense0 + d->shard.lo};
        else if (i == 1) *p = (DdpPiece){.at = nd, .lo = d->xshard.lo, .hi = d->xshard.hi, .par = d->xshard.lo};
        return i < 2;
    }
    if (!d->units || i >= d->nu) return 0;
    size_t off = d->m->unit_off[i];
    *p = (DdpPiece){.at = d->at[i], .lo = off + d->us[i].lo, .hi = off + d->us[i].hi, .par = d->at[i]};
    return 1;
}

int ddp_optim_pieces(const Ddp *d) { return d->units || d->zseg; }

int ddp_rank_piece(const Ddp *d, int rank, int i, DdpPiece *p) {
    const Model *m = d->m;
    if (d->zseg) {
        /* dp rank `rank`'s dense block, then its EDP rank's expert block (its state after the dense block's) */
        if (i > 1) return 0;
        ShardRange s = mesh_shard_range(m->num_params - d->dense0, d->dp, rank, 64);
        if (i == 0) {
            *p = (DdpPiece){.at = 0, .lo = d->dense0 + s.lo, .hi = d->dense0 + s.hi, .par = d->dense0 + s.lo};
            return 1;
        }
        ShardRange x = mesh_shard_range(d->xlen, d->eg ? d->eg->size : 1, rank / d->epg->size, 64);
        *p = (DdpPiece){.at = s.hi - s.lo, .lo = x.lo, .hi = x.hi, .par = x.lo};
        return 1;
    }
    if (!d->units) {
        if (i > 0) return 0;
        ShardRange s = mesh_shard_range(m->num_params, d->dp, rank, 64);
        if (d->zero == 0) s.lo = 0, s.hi = m->num_params;
        *p = (DdpPiece){.at = 0, .lo = s.lo, .hi = s.hi, .par = 0};
        return 1;
    }
    if (i >= d->nu) return 0;
    /* every rank's block of a unit has the same size, so the same place in its shard buffers */
    ShardRange s = mesh_shard_range(m->unit_len[i], d->dp, rank, 64);
    *p = (DdpPiece){.at = d->at[i], .lo = m->unit_off[i] + s.lo, .hi = m->unit_off[i] + s.hi, .par = d->at[i]};
    return 1;
}

size_t ddp_expert_len(const Ddp *d) { return d->dense0; }

CommGroup *ddp_expert_group(const Ddp *d) { return d->eg; }

int ddp_expert_peer(const Ddp *d, int e) { return d->epg ? e * d->epg->size + d->epg->rank : e; }

int ddp_zero(const Ddp *d) { return d->zero; }

CommGroup *ddp_group(const Ddp *d) { return d->g; }

int ddp_rank(const Ddp *d) { return d->rank; }

double ddp_step_blocked_s(const Ddp *d) { return d->step_blocked_s; }

int ddp_describe_layout(const Ddp *d, char *buf, size_t len) {
    size_t np = d->m->num_params, lo, hi;
    if (d->dp == 1) return 0;
    if (d->units && !d->whole_params)
        snprintf(buf, len, "data parallel: %d ranks, ZeRO-3: parameters, gradients and optimizer state sharded by "
                           "layer (%zu of %zu elements here), layers gathered one ahead, gradients reduce-scattered "
                           "%s", d->dp, d->shard_len, np,
                 d->accum_grads ? "once a step, each layer after its last micro-batch's backward (pipeline)"
                                : "after each layer's backward");
    else if (d->units)
        snprintf(buf, len, "data parallel: %d ranks, ZeRO-2: parameters whole; gradients reduce-scattered layer by "
                           "layer during the %sbackward into a shard, optimizer state and fp32 parameters sharded "
                           "(%zu of %zu elements here); parameters all-gathered per layer after the optimizer step, "
                           "waited for at first use", d->dp, d->accum_grads ? "last micro-batch's " : "",
                 d->shard_len, np);
    else {
        ddp_optim_range(d, &lo, &hi);
        int k = snprintf(buf, len, "data parallel: %d ranks, %d gradient bucket(s) all-reduced during backward; "
                         "optimizer state %zu of %zu elements here", d->dp, d->nb, hi - lo, np);
        if (d->m->ep > 1 && k > 0 && (size_t)k < len && d->eg)
            snprintf(buf + k, len - k, "; the %zu expert elements reduce over edp (%d ranks holding the same "
                     "experts)%s", d->dense0, d->eg->size, d->zseg ? ", their optimizer state sharded over it" : "");
        else if (d->m->ep > 1 && k > 0 && (size_t)k < len)
            snprintf(buf + k, len - k, "; the %zu expert elements are whole on this rank, their only holder (edp "
                     "1: nothing to reduce)", d->dense0);
    }
    return 1;
}

int ddp_describe_memory(const Ddp *d, char *buf, size_t len) {
    if (d->dp == 1) return 0;
    const char *what = d->accum_grads ? " (1/dp shard and the stage's whole gradients, accumulated over the "
                                        "step's micro-batches and reduce-scattered once)"
                       : d->units ? " (1/dp shard, two layer slots and their reduce-scatter targets, "
                                    "wte/wpe/ln_f's whole gradients)" : "";
    snprintf(buf, len, "data parallel: gradient buffers here %zu floats, parameters %zu%s", ddp_grad_floats(d),
             d->m->num_params, what);
    return 1;
}
