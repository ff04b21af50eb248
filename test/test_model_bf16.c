/* test_model_bf16: the model's bf16 host logic on a machine with no GPU, through
 * emu_bf16 (the CPU ops behind bf16 activation storage, test/emu_bf16.h): the
 * compute copy is the master rounded to nearest even and follows every change
 * (model_params_changed), a training run tracks the fp32 CPU run, and ZeRO-3's
 * re-binding of parameter views to shared gather buffers casts each layer's
 * copy again after the pre-layer hook (also when the backward recomputes
 * LayerNorm and GeLU outputs, model.recompute). Also that an fp32 backend
 * keeps no copy at all (its compute views are the master's). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "emu_bf16.h"
#include "model.h"
#include "optim.h"
#include "test.h"
#include "util.h"

static Backend emu;
static const ArchSpec shape0 = ARCH_GPT2_SHAPE(4, 2, 32, 16, 64);
enum { B = 2, T = 16 };

static void batch(int32_t *inp, int32_t *tgt, uint64_t seed) {
    Rng r;
    rng_seed(&r, seed);
    for (int i = 0; i < B * T; i++) inp[i] = (int32_t)rng_below(&r, 64), tgt[i] = (int32_t)rng_below(&r, 64);
}

static void make(Model *m, const Backend *be) {
    ArchSpec s = shape0;
    arch_resolve(&s);
    model_init(m, be, &s, NULL);
}

/* Compute buffer k holds exactly the bf16 rounding of its master. */
static int copy_exact(const Model *m, int k) {
    const ComputeBuf *cb = &m->cbuf[k];
    uint16_t *want = xmalloc(cb->len * 2);
    backend_f32_to_act(want, cb->master, cb->len, 2);
    int same = memcmp(want, cb->mem, cb->len * 2) == 0;
    free(want);
    return same;
}

/* fp32: no compute buffers, the compute views are the master views. */
static void test_fp32_alias(void) {
    Model m;
    make(&m, &backend_cpu);
    int fc = (int)(model_find_param(&m, "h.1.mlp.c_fc.weight") - m.params);
    int lnfb = (int)(model_find_param(&m, "ln_f.bias") - m.params);
    int alias = m.act_bytes == 4 && m.n_cbuf == 0 && m.wview[0] == m.pview[0] && m.wview[fc] == m.pview[fc] &&
                m.wview[lnfb] == m.pview[lnfb];
    test_report(alias, "model_bf16_fp32_aliases_master", "an fp32 backend got a separate compute copy");
    model_free(&m);
}

/* The copy is cast at the first use after a change, and only then. */
static void test_copy_follows(void) {
    Model m;
    make(&m, &emu);
    model_init_weights(&m, 5);
    model_plan_activations(&m, B, T, MODEL_RECOMPUTE_NONE);
    int32_t inp[B * T], tgt[B * T];
    batch(inp, tgt, 1);
    int ok = m.act_bytes == 2 && m.n_cbuf == 1 && m.cbuf[0].stale;
    model_forward(&m, inp, tgt, B, T, 0.0f);
    ok = ok && !m.cbuf[0].stale && copy_exact(&m, 0);
    test_report(ok, "model_bf16_copy_cast_on_first_use", "the compute copy is not the master rounded to bf16");
    /* change the master (as an optimizer step would): stale until the next forward */
    float one = 1.0f;
    int fc = (int)(model_find_param(&m, "h.2.mlp.c_fc.weight") - m.params);
    m.be->to_device(m.pview[fc] + 3, &one, sizeof one);
    model_params_changed(&m);
    ok = m.cbuf[0].stale;
    model_forward(&m, inp, tgt, B, T, 0.0f);
    uint16_t got;
    m.be->to_host(&got, (const char *)m.wview[fc] + 3 * 2, 2);
    ok = ok && !m.cbuf[0].stale && copy_exact(&m, 0) && got == 0x3f80; /* bf16 1.0 */
    test_report(ok, "model_bf16_copy_follows_changes", "a changed master did not reach the compute copy");
    /* logits rows come back as floats with bf16 values */
    float row[64];
    model_logits_row(&m, 1, 3, row);
    ok = 1;
    for (int j = 0; j < 64; j++) ok = ok && isfinite(row[j]) && row[j] == backend_act_round(row[j], 2);
    test_report(ok, "model_bf16_logits_row", "a logits row is not bf16 values");
    size_t want = model_activation_bytes(&m.shape, B, T, 2, MODEL_RECOMPUTE_NONE);
    size_t fp32 = model_activation_bytes(&m.shape, B, T, 4, MODEL_RECOMPUTE_NONE);
    test_report(m.act_size == want && want < fp32 * 6 / 10, "model_bf16_activations_halved",
                "activation arena %zu bytes (fp32 %zu)", m.act_size, fp32);
    model_free(&m);
}

/* Losses of `steps` AdamW steps on one batch (overfitting it). */
static void train(const Backend *be, int steps, float *loss) {
    Model m;
    make(&m, be);
    model_init_weights(&m, 7);
    model_plan_activations(&m, B, T, MODEL_RECOMPUTE_NONE);
    AdamW o;
    optim_init(&o, be, m.num_params, m.num_decay, 0.9f, 0.95f, 1e-8f, 0.0f, 1.0f);
    int32_t inp[B * T], tgt[B * T];
    batch(inp, tgt, 2);
    for (int s = 0; s < steps; s++) {
        loss[s] = model_forward(&m, inp, tgt, B, T, 1.0f / (B * T));
        model_backward(&m, 0);
        optim_step(&o, m.param_mem, m.grad_mem, 3e-3f);
        model_params_changed(&m);
    }
    optim_free(&o);
    model_free(&m);
}

/* bf16 storage tracks fp32 within 1% per step (cuda_check's bf16 bar), and
 * both learn: a compute copy left stale would not. */
static void test_training_tracks_fp32(void) {
    enum { S = 12 };
    float a[S], b[S];
    train(&backend_cpu, S, a);
    train(&emu, S, b);
    double worst = 0;
    for (int s = 0; s < S; s++) worst = fmax(worst, fabs((double)a[s] - b[s]) / a[s]);
    int learns = a[S - 1] < 0.8f * a[0] && b[S - 1] < 0.8f * b[0];
    test_report(worst < 1e-2 && learns, "model_bf16_training_tracks_fp32",
                "max relative loss difference %.3g (tol 1e-2), loss %g -> %g fp32, %g -> %g bf16", worst, a[0],
                a[S - 1], b[0], b[S - 1]);
}

/* ZeRO-3 as ddp.c binds it, on one rank: layers alternate between two gather
 * buffers, wte/wpe/ln_f sit in a third, and the pre-layer hook "gathers" a
 * unit by copying it from a saved whole arena. Forward and backward must give
 * the unbound model's bits: layer l + 2 reuses layer l's compute buffer, so a
 * copy not cast again after the hook would compute with the wrong layer. */
typedef struct {
    Model *m;
    float *whole, *pbuf[2], *prest;
} Gather;

static int gather_hook(void *ctx, int layer, int backward) {
    Gather *g = ctx;
    Model *m = g->m;
    int u = layer < 0 ? m->shape.n_layer : layer;
    float *dst = layer < 0 ? g->prest : g->pbuf[layer % 2];
    m->be->copy(dst, g->whole + m->unit_off[u], m->unit_len[u] * sizeof(float));
    return 1; /* the slot's values changed */
}

/* Laid out by unit, the gradient views bound to one whole buffer (ddp.c
 * binds them to per-layer slots; a test model keeps every gradient). */
static float *bind_whole_grads(Model *m) {
    float *g = xcalloc(m->arena_len, sizeof(float));
    for (int u = 0; u < m->n_units; u++) model_bind_unit(m, u, NULL, g + m->unit_off[u]);
    return g;
}

/* r: what z recomputes in its backward (a never does): the recomputation
 * must come after the hook put the layer's values back in its slot and the
 * compute copy was cast again, or it computes with the layer two ahead. */
/* Initial LayerNorm gains are all 1 and biases 0: shift every parameter by
 * an amount that depends on its place, so no two layers are alike and a
 * layer computed with another's weights shows. */
static void distinct_layers(Model *m) {
    for (size_t i = 0; i < m->arena_len; i++) m->param_mem[i] += 0.01f * (float)((i * 7919) % 13) / 13.0f;
    model_params_changed(m);
}

static void test_zero3_rebinding(ModelRecompute r) {
    char name[96];
    const char *tag = r == MODEL_RECOMPUTE_NONE ? "" : "_recompute_norm_gelu";
    Model a, z;
    make(&a, &emu);
    make(&z, &emu);
    model_layout_by_unit(&a, 1);
    model_layout_by_unit(&z, 1);
    float *ga = bind_whole_grads(&a);
    model_init_weights(&a, 9);
    model_init_weights(&z, 9);
    distinct_layers(&a);
    distinct_layers(&z);
    model_plan_activations(&a, B, T, MODEL_RECOMPUTE_NONE);
    model_plan_activations(&z, B, T, r);
    int L = z.shape.n_layer;
    size_t layer_len = 0;
    for (int u = 0; u < L; u++) layer_len = z.unit_len[u] > layer_len ? z.unit_len[u] : layer_len;
    Gather g = {&z, xmalloc(z.arena_len * sizeof(float)), {0}, NULL};
    memcpy(g.whole, z.param_mem, z.arena_len * sizeof(float));
    float *gbuf[2], *grest = xcalloc(z.unit_len[L], sizeof(float));
    for (int s = 0; s < 2; s++) {
        g.pbuf[s] = xcalloc(layer_len, sizeof(float));
        gbuf[s] = xcalloc(layer_len, sizeof(float));
    }
    g.prest = xcalloc(z.unit_len[L], sizeof(float));
    /* as ddp_shard_params: the whole arena goes, every unit is re-bound */
    z.be->free(z.param_mem); /* the backend's buffer: its own free (the CPU backend counts it) */
    z.param_mem = NULL;
    for (int l = 0; l < L; l++) model_bind_unit(&z, l, g.pbuf[l % 2], gbuf[l % 2]);
    model_bind_unit(&z, L, g.prest, grest);
    model_set_hooks(&z, &(ModelHooks){.ctx = &g, .layer_begin = gather_hook});
    snprintf(name, sizeof name, "model_bf16_zero3_buffers%s", tag);
    test_report(z.n_cbuf == 3, name, "%d compute buffers for 3 gather buffers", z.n_cbuf);

    int32_t inp[B * T], tgt[B * T];
    batch(inp, tgt, 3);
    float la = model_forward(&a, inp, tgt, B, T, 1.0f / (B * T));
    float lz = model_forward(&z, inp, tgt, B, T, 1.0f / (B * T));
    snprintf(name, sizeof name, "model_bf16_zero3_forward%s", tag);
    test_report(la == lz, name, "loss %.9g bound to gather buffers, %.9g whole", lz, la);
    model_backward(&a, 0);
    model_backward(&z, 0);
    /* after the backward gbuf[l % 2] holds layers 1 and 0 (the last two done) */
    int same = memcmp(grest, ga + a.unit_off[L], a.unit_len[L] * sizeof(float)) == 0;
    for (int l = 0; l < 2; l++)
        same = same && memcmp(gbuf[l], ga + a.unit_off[l], a.unit_len[l] * sizeof(float)) == 0;
    snprintf(name, sizeof name, "model_bf16_zero3_backward%s", tag);
    test_report(same, name, "gradients differ from the unbound model's");
    model_free(&a);
    model_free(&z);
    for (int s = 0; s < 2; s++) free(g.pbuf[s]), free(gbuf[s]);
    free(g.prest), free(grest), free(g.whole), free(ga);
}

/* ZeRO-3 inside a pipeline stage (layers [lo, hi) of 4): the units of the
 * other stages' layers are empty, and so is the non-layer unit of a middle
 * stage; binding, gathering and casting skip them, and the stage computes
 * to the bit what it computes laid out whole. The stage's input (and,
 * without the head, its output's gradient) are the same bf16 values for
 * both; ddp.c then keeps the stage's gradients whole (one buffer). */
static void fill_act(void *dst, size_t n, uint64_t seed) {
    float *f = xmalloc(n * sizeof(float));
    Rng r;
    rng_seed(&r, seed);
    for (size_t i = 0; i < n; i++) f[i] = (float)rng_below(&r, 2001) / 1000.0f - 1.0f;
    backend_f32_to_act(dst, f, n, 2);
    free(f);
}

static void test_zero3_stage(int lo, int hi) {
    char name[96];
    snprintf(name, sizeof name, "model_bf16_zero3_stage_layers_%d_%d", lo, hi - 1);
    ArchSpec s = shape0;
    arch_resolve(&s);
    Model a, z;
    ModelOptions o = {.layer_lo = lo, .layer_hi = hi};
    model_init(&a, &emu, &s, &o);
    model_init(&z, &emu, &s, &o);
    model_layout_by_unit(&a, 1);
    model_layout_by_unit(&z, 1);
    float *ga = bind_whole_grads(&a);
    model_init_weights(&a, 9);
    model_init_weights(&z, 9);
    distinct_layers(&a);
    distinct_layers(&z);
    model_plan_activations(&a, B, T, MODEL_RECOMPUTE_NONE);
    model_plan_activations(&z, B, T, MODEL_RECOMPUTE_NONE);
    int L = z.shape.n_layer, empty = 0;
    size_t layer_len = 0;
    for (int u = 0; u <= L; u++) {
        if (u < L && z.unit_len[u] > layer_len) layer_len = z.unit_len[u];
        empty += z.unit_len[u] == 0;
    }
    Gather g = {&z, xmalloc(z.arena_len * sizeof(float)), {0}, NULL};
    memcpy(g.whole, z.param_mem, z.arena_len * sizeof(float));
    for (int k = 0; k < 2; k++) g.pbuf[k] = xcalloc(layer_len, sizeof(float));
    g.prest = xcalloc(z.unit_len[L] + 1, sizeof(float));
    float *gz = bind_whole_grads(&z);
    z.be->free(z.param_mem); /* the backend's buffer: its own free (the CPU backend counts it) */
    z.param_mem = NULL;
    for (int l = 0; l < L; l++) model_bind_unit(&z, l, g.pbuf[l % 2], NULL);
    model_bind_unit(&z, L, g.prest, NULL);
    model_set_hooks(&z, &(ModelHooks){.ctx = &g, .layer_begin = gather_hook});

    int32_t inp[B * T], tgt[B * T];
    batch(inp, tgt, 5);
    size_t nc = (size_t)B * T * s.n_embd;
    if (lo > 0) fill_act(model_stage_input(&a), nc, 11), fill_act(model_stage_input(&z), nc, 11);
    float la = model_forward(&a, inp, tgt, B, T, 1.0f / (B * T));
    float lz = model_forward(&z, inp, tgt, B, T, 1.0f / (B * T));
    int same_fwd = la == lz && (hi == L || !memcmp(model_stage_output(&a), model_stage_output(&z), nc * 2));
    if (hi < L) fill_act(model_stage_output_grad(&a), nc, 12), fill_act(model_stage_output_grad(&z), nc, 12);
    model_backward(&a, 0);
    model_backward(&z, 0);
    int same_bwd = !memcmp(ga, gz, a.arena_len * sizeof(float)) &&
                   (lo == 0 || !memcmp(model_stage_input_grad(&a), model_stage_input_grad(&z), nc * 2));
    /* units outside [lo, hi) are empty, and a middle stage's non-layer unit too */
    int want_empty = L - (hi - lo) + (lo > 0 && hi < L);
    test_report(same_fwd && same_bwd && empty == want_empty, name,
                "forward %s (loss %.9g / %.9g), backward %s, %d empty units (want %d)", same_fwd ? "equal" : "differs",
                lz, la, same_bwd ? "equal" : "differs", empty, want_empty);
    model_free(&a);
    model_free(&z);
    for (int k = 0; k < 2; k++) free(g.pbuf[k]);
    free(g.prest), free(g.whole), free(ga), free(gz);
}

/* ZeRO-2 as ddp.c runs it: the parameters stay in the whole arena (one
 * compute buffer over it), and after an optimizer step each unit's new
 * values land (an all-gather) at its first use in the next forward, when
 * the hook says so. Each unit's compute copy must then be cast again, that
 * unit's range only: a stale copy, or one cast before its unit landed,
 * computes with the old weights. */
typedef struct {
    Model *m;
    float *next; /* the values the "all-gathers" bring */
    int *fresh;  /* [n_units] a refresh is in flight */
} Refresh;

static int refresh_hook(void *ctx, int layer, int backward) {
    Refresh *r = ctx;
    Model *m = r->m;
    int u = layer < 0 ? m->shape.n_layer : layer;
    if (backward || !r->fresh[u]) return 0;
    m->be->copy(m->param_mem + m->unit_off[u], r->next + m->unit_off[u], m->unit_len[u] * sizeof(float));
    r->fresh[u] = 0;
    return 1;
}

static void test_zero2_refresh(ModelRecompute rc) {
    char name[96];
    snprintf(name, sizeof name, "model_bf16_zero2_refresh%s", rc == MODEL_RECOMPUTE_NONE ? "" : "_recompute_norm_gelu");
    Model a, y;
    make(&a, &emu);
    make(&y, &emu);
    model_layout_by_unit(&a, 1);
    model_layout_by_unit(&y, 1);
    float *ga = bind_whole_grads(&a), *gy = bind_whole_grads(&y);
    model_init_weights(&a, 9);
    model_init_weights(&y, 9);
    model_plan_activations(&a, B, T, MODEL_RECOMPUTE_NONE);
    model_plan_activations(&y, B, T, rc);
    int32_t inp[B * T], tgt[B * T];
    batch(inp, tgt, 4);
    float la = model_forward(&a, inp, tgt, B, T, 1.0f / (B * T));
    float ly = model_forward(&y, inp, tgt, B, T, 1.0f / (B * T));
    /* "a step": new weights; the reference model takes them directly */
    for (size_t i = 0; i < a.arena_len; i++) a.param_mem[i] *= 1.0f + 0.05f * (float)((i * 7919) % 13) / 13.0f;
    model_params_changed(&a);
    Refresh r = {&y, xmalloc(y.arena_len * sizeof(float)), xcalloc((size_t)y.n_units, sizeof(int))};
    memcpy(r.next, a.param_mem, a.arena_len * sizeof(float));
    for (int u = 0; u < y.n_units; u++) r.fresh[u] = 1;
    model_set_hooks(&y, &(ModelHooks){.ctx = &r, .layer_begin = refresh_hook});
    float la2 = model_forward(&a, inp, tgt, B, T, 1.0f / (B * T));
    float ly2 = model_forward(&y, inp, tgt, B, T, 1.0f / (B * T));
    model_backward(&a, 0);
    model_backward(&y, 0);
    int same = memcmp(ga, gy, a.arena_len * sizeof(float)) == 0;
    test_report(la == ly && la2 == ly2 && la2 != la && y.n_cbuf == 1 && same, name,
                "losses %.9g/%.9g before, %.9g/%.9g after the refresh (whole/refreshed), %d compute buffers, "
                "gradients %s", la, ly, la2, ly2, y.n_cbuf, same ? "equal" : "differ");
    model_free(&a);
    model_free(&y);
    free(ga), free(gy), free(r.next), free(r.fresh);
}

int main(void) {
    emu = emu_bf16_backend();
    emu.init(2);
    test_fp32_alias();
    test_copy_follows();
    test_training_tracks_fp32();
    test_zero3_rebinding(MODEL_RECOMPUTE_NONE);
    test_zero3_rebinding(MODEL_RECOMPUTE_NORM_GELU);
    test_zero3_stage(1, 3); /* a middle stage: no embeddings, no head */
    test_zero3_stage(2, 4); /* the last: the tied embedding as the head */
    test_zero3_stage(0, 2);
    test_zero2_refresh(MODEL_RECOMPUTE_NONE);
    test_zero2_refresh(MODEL_RECOMPUTE_NORM_GELU);
    emu.shutdown();
    return 0;
}
