/* model_trace.h: train a small GPT-2 a few AdamW steps and record what the
 * run leaves behind, for tests that compare two ways of computing the same
 * thing bit for bit (test_model_recompute.c: recomputation against keeping
 * activations; test_model_fusion.c: fused ops against separate ones) or two
 * backends within a tolerance (test/model_emu.c: the emulated CUDA backend
 * against the CPU). The
 * including file defines B, T, ACCUM and STEPS (an enum) first. Each step is
 * ACCUM micro-batches (all but the first accumulate), each a different batch
 * of tokens below 64. */
#ifndef KILN_TEST_MODEL_TRACE_H
#define KILN_TEST_MODEL_TRACE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "model.h"
#include "optim.h"
#include "util.h"

#define TRACE_MOE_LOADS 64 /* n_layer * n_experts at most */

typedef struct {
    float loss[STEPS * ACCUM];
    double norm[STEPS];
    float *grads;  /* (num_params) after the last backward */
    float *params; /* (num_params) after the last step */
    size_t n;
    /* MoE models: slots routed to each (layer, expert) and slots dropped,
     * summed over every training forward (ModelMoeStats); 0 otherwise */
    int64_t moe_load[TRACE_MOE_LOADS];
    int64_t moe_routed, moe_drops;
} Trace;

static void trace_batch(int32_t *inp, int32_t *tgt, uint64_t seed) {
    Rng r;
    rng_seed(&r, seed);
    for (int i = 0; i < B * T; i++) inp[i] = (int32_t)rng_below(&r, 64), tgt[i] = (int32_t)rng_below(&r, 64);
}

/* What a run may vary: model.recompute, gelu_fusion, precision.master bf16
 * (master16: bf16 parameters, no fp32 arena; the backend must have bf16
 * activations) and precision.optim_state bf16 (state16). */
typedef struct {
    ModelRecompute r;
    int gelu_fusion, master16, state16;
    int tp, tp_rank; /* tp > 1: rank tp_rank's part of the model, on trace_tp's one-process collectives */
    int muon;        /* optim.name muon on the blocks' 2-D weights (trace_set_muon), lr 0.02 */
    int docs;        /* data.doc_masking and doc_positions reset, documents ending at id TRACE_EOT */
    int fp8;         /* precision.fp8 (Fp8Mode: 1 tensorwise, 2 rowwise), E5M2 gradients */
    int host_step;   /* the optimizer step with the norm read to the host (optim_step) and the compute
                        copy cast apart after it; else (AdamW) as a one-rank run steps: optim_step_device,
                        the updates writing the compute copy (optim_set_copy) */
    int fp8_wgrad;   /* precision.fp8_wgrad: 0 bf16, 1 fp8 */
    int fp8_history; /* precision.fp8_amax_history (tensorwise): 0 current scaling */
    int loss_chunk;  /* model.loss_chunk: rows of a chunk of the head (0: whole) */
} TraceOpts;
#define TRACE_EOT 5 /* ~1 token in 64 of trace_batch's: a document or two per sequence */

/* Muon as train.c sets it (train_set_muon): the blocks' 2-D weights, GPT-2's
 * fused c_attn as its three thirds, spectral scale, momentum 0.95, 5 steps. */
static void trace_set_muon(AdamW *o, const Model *m) {
    OptimMatrix mats[64];
    int n = 0;
    for (int i = 0; i < m->num_tensors && n + 3 <= 64; i++) {
        const ParamInfo *p = &m->params[i];
        int r = p->role;
        if (p->ndim != 2 || (r != ROLE_QKV_W && r != ROLE_O_W && r != ROLE_FC_W && r != ROLE_DOWN_W)) continue;
        int parts = r == ROLE_QKV_W ? 3 : 1, rows = p->shape[0] / parts, cols = p->shape[1];
        for (int k = 0; k < parts; k++)
            mats[n++] = (OptimMatrix){.off = p->offset + (size_t)k * rows * cols, .rows = rows, .cols = cols,
                                      .scale = optim_muon_scale("spectral", rows, cols), .decay = p->decay,
                                      .tensor = i, .toff = (size_t)k * rows * cols};
    }
    optim_set_muon(o, mats, n, 0.95f, 5);
}

/* Tensor parallelism on one process (TraceOpts.tp): the collectives of a tp
 * group whose other ranks hold exactly what this one does. Sums leave this
 * rank's partial sums as they are; gathers copy its block into every slot.
 * Not the whole model's function, but a deterministic one of the local
 * shapes (heads, kv heads, MLP width and vocabulary rows of one rank), the
 * same on every backend: what comparing the backends on a tp step needs. */
static void trace_tp_sum(void *ctx, void *buf, size_t n) { (void)ctx, (void)buf, (void)n; }
static void trace_tp_gather(void *ctx, void *buf, size_t block) {
    const Model *m = ctx;
    size_t bytes = block * m->act_bytes;
    for (int r = 0; r < m->tp; r++)
        if (r != m->tp_rank) m->be->copy((char *)buf + r * bytes, (char *)buf + m->tp_rank * bytes, bytes);
}
static void trace_tp_scatter(void *ctx, const void *send, void *recv, size_t block) {
    const Model *m = ctx;
    m->be->copy(recv, (const char *)send + m->tp_rank * block * m->act_bytes, block * m->act_bytes);
}
static void trace_tp_gather_f32(void *ctx, const float *send, float *recv, size_t block) {
    const Model *m = ctx;
    for (int r = 0; r < m->tp; r++)
        if (recv + r * block != send) m->be->copy(recv + r * block, send, block * sizeof(float));
}

/* Train shape s (resolved) from init seed 11 as `op` says, set up as train.c
 * does; the trace's buffers are the caller's to free. */
static void trace_train_opts(const Backend *be, ArchSpec s, TraceOpts op, Trace *t) {
    Model m;
    arch_resolve(&s);
    model_init(&m, be, &s, &(ModelOptions){.master_bf16 = op.master16, .tp = op.tp, .tp_rank = op.tp_rank,
                                           .doc_masking = op.docs, .doc_reset = op.docs, .doc_eot = TRACE_EOT,
                                           .fp8 = {.mode = op.fp8, .grad_fmt = 1 /* FP8_E5M2 */, .wgrad = op.fp8_wgrad,
                                                   .history = op.fp8_history},
                                           .loss_chunk = op.loss_chunk});
    ModelTp loop = {&m, trace_tp_sum, trace_tp_gather, trace_tp_scatter, trace_tp_gather_f32, NULL, NULL};
    if (op.tp > 1) model_set_tp(&m, &loop);
    m.gelu_fusion = op.gelu_fusion;
    model_init_weights(&m, 11);
    model_plan_activations(&m, B, T, op.r);
    AdamW o;
    optim_init_shard_dtype(&o, be, m.num_params, m.num_decay, 0, m.num_params, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f,
                           op.state16, 0x5eed);
    if (op.master16) optim_set_params_bf16(&o);
    if (op.muon) trace_set_muon(&o, &m);
    int dev_step = !op.muon && !op.host_step, fused = dev_step && optim_set_copy(&o, model_compute_copy(&m));
    int32_t inp[B * T], tgt[B * T];
    for (int step = 0; step < STEPS; step++) {
        for (int k = 0; k < ACCUM; k++) {
            trace_batch(inp, tgt, 100 + (uint64_t)(step * ACCUM + k));
            t->loss[step * ACCUM + k] = model_forward(&m, inp, tgt, B, T, 1.0f / (B * T * ACCUM));
            model_backward(&m, k > 0);
        }
        t->n = m.num_params;
        if (step == STEPS - 1) {
            t->grads = xmalloc(t->n * sizeof(float));
            be->to_host(t->grads, m.grad_mem, t->n * sizeof(float));
        }
        float lr = op.muon ? 0.02f : 3e-3f;
        t->norm[step] = dev_step ? optim_step_device(&o, model_param_arena(&m), m.grad_mem, lr, ACCUM, NULL).grad_norm
                                 : optim_step(&o, model_param_arena(&m), m.grad_mem, lr).grad_norm;
        if (!fused) model_params_changed(&m);
    }
    t->params = xmalloc(t->n * sizeof(float));
    model_params_to_host(&m, t->params);
    memset(t->moe_load, 0, sizeof t->moe_load);
    if (m.moe.load) {
        size_t nl = (size_t)m.shape.n_layer * m.shape.moe.n_experts;
        if (nl > TRACE_MOE_LOADS)
            kiln_fail(KILN_EXIT_RUNTIME, "model_trace: %zu MoE loads, room for %d", nl, TRACE_MOE_LOADS);
        memcpy(t->moe_load, m.moe.load, nl * sizeof(int64_t));
    }
    t->moe_routed = m.moe.routed, t->moe_drops = m.moe.drops;
    optim_free(&o);
    model_free(&m);
}

/* Model.recompute r and gelu_fusion, fp32 master and moments. */
static inline void trace_train(const Backend *be, ArchSpec s, ModelRecompute r, int gelu_fusion, Trace *t) {
    TraceOpts op = {.r = r, .gelu_fusion = gelu_fusion};
    trace_train_opts(be, s, op, t);
}

/* Every loss, gradient norm, gradient and parameter the same bits. */
static inline int trace_same(const Trace *a, const Trace *b) {
    return a->n == b->n && memcmp(a->loss, b->loss, sizeof a->loss) == 0 &&
           memcmp(a->norm, b->norm, sizeof a->norm) == 0 && memcmp(a->grads, b->grads, a->n * sizeof(float)) == 0 &&
           memcmp(a->params, b->params, a->n * sizeof(float)) == 0;
}

#endif
