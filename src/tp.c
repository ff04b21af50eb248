/* tp: the tensor-parallel collectives and the sums of partial gradients over
 * the tp group (see tp.h). Activations travel in the model's act dtype. */
#include "tp.h"

#include <string.h>

#include "util.h"

static void tp_fail_dtype(const Tp *t) {
    kiln_fail(KILN_EXIT_USAGE, "key 'parallel.tp': %zu-byte activations cannot be reduced over the tp group "
              "(fp32 activations only in this build); set precision.compute: fp32 or parallel.tp: 1",
              t->m->act_bytes);
}

static void tp_all_reduce(void *ctx, void *buf, size_t n) {
    Tp *t = ctx;
    double t0 = kiln_now();
    if (t->m->act_bytes == 4) comm_all_reduce_sum(t->g, buf, n);
    else if (t->m->act_bytes == 2) comm_all_reduce_sum_bf16(t->g, buf, n);
    else tp_fail_dtype(t);
    t->blocked_s += kiln_now() - t0;
}

/* A gather moves bytes: act of any size travels as floats when it packs
 * evenly, else as bytes (MPI; the NCCL path needs float counts). */
static void tp_all_gather(void *ctx, void *buf, size_t block) {
    Tp *t = ctx;
    double t0 = kiln_now();
    size_t bytes = block * t->m->act_bytes;
    char *mine = (char *)buf + (size_t)t->g->rank * bytes;
    if (bytes % sizeof(float) == 0) comm_all_gather(t->g, (const float *)mine, buf, bytes / sizeof(float));
    else comm_all_gather_bytes(t->g, mine, buf, bytes);
    t->blocked_s += kiln_now() - t0;
}

static void tp_reduce_scatter(void *ctx, const void *send, void *recv, size_t block) {
    Tp *t = ctx;
    double t0 = kiln_now();
    if (t->m->act_bytes == 4) comm_reduce_scatter(t->g, send, recv, block);
    else if (t->m->act_bytes == 2) comm_reduce_scatter_bf16(t->g, send, recv, block);
    else tp_fail_dtype(t);
    t->blocked_s += kiln_now() - t0;
}

static void tp_all_gather_f32(void *ctx, const float *send, float *recv, size_t block) {
    Tp *t = ctx;
    double t0 = kiln_now();
    comm_all_gather(t->g, send, recv, block);
    t->blocked_s += kiln_now() - t0;
}

/* The gradients of layer `layer` (or of the non-layer tensors complete at
 * this hook) that each rank holds a part of: summed over tp. A gradient that
 * accumulates over the step's micro-batches is summed once, on the last; one
 * that each backward writes afresh (ZeRO-2/3's layer gradients, which ddp
 * then adds into its shard) is summed every micro-batch. */
static void tp_grads_done(void *ctx, int layer) {
    Tp *t = ctx;
    Model *m = t->m;
    double t0 = kiln_now();
    for (int i = 0; i < m->num_tensors; i++) {
        const ParamInfo *p = &m->params[i];
        if (!p->tp_partial || model_grads_ready_layer(m, i) != layer) continue;
        int fresh = p->layer >= 0 && m->layer_grads_fresh;
        if (fresh || t->last) comm_all_reduce_sum(t->g, m->gview[i], p->numel);
    }
    t->blocked_s += kiln_now() - t0;
}

static void tp_drain_hook(void *ctx) { tp_drain(ctx); }

void tp_drain(Tp *t) {
    if (!t->g || t->g->size <= 1) return;
    double t0 = kiln_now();
    comm_drain(t->g);
    t->blocked_s += kiln_now() - t0;
}

void tp_init(Tp *t, Model *m, CommGroup *g) {
    memset(t, 0, sizeof *t);
    t->m = m;
    t->g = g;
    t->last = 1;
    if (!g || g->size <= 1) return;
    if (m->tp != g->size || m->tp_rank != g->rank)
        kiln_fail(KILN_EXIT_RUNTIME, "tp_init: the model is rank %d of tp %d, the group rank %d of %d", m->tp_rank,
                  m->tp, g->rank, g->size);
    if (m->act_bytes != 4 && m->act_bytes != 2) tp_fail_dtype(t);
    /* on a GPU the layers' collectives are ordered on the device: no host
     * wait inside a layer (the host drains them before it reads) */
    if (g->dev) comm_nccl_stream_ordered(g);
    ModelTp ops = {t, tp_all_reduce, tp_all_gather, tp_reduce_scatter, tp_all_gather_f32, tp_grads_done,
                   tp_drain_hook};
    model_set_tp(m, &ops);
}

void tp_free(Tp *t) {
    if (t->m && t->g && t->g->size > 1) model_set_tp(t->m, NULL);
    memset(t, 0, sizeof *t);
}

void tp_micro_begin(Tp *t, int first, int last) {
    if (first) {
        t->total_s += t->blocked_s;
        t->blocked_s = 0;
    }
    t->last = last;
}

double tp_step_blocked_s(const Tp *t) { return t->blocked_s; }
