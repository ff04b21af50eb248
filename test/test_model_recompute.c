/* test_model_recompute: model.recompute. The activation arena shrinks by
 * exactly the per-layer buffers it drops (less the one shared buffer each),
 * and training with gelu or norm_gelu gives the bits of training without
 * recomputation — every micro-batch's loss, every step's gradients and
 * gradient norm, the final parameters — on the CPU backend and on the bf16
 * emulation (test/emu_bf16.h: the GPU's default dtype, and a compute copy
 * that must be fresh when the recomputation reads the weights). Tolerance
 * 0 throughout: the recomputation runs the forward's own op on the forward's
 * own inputs, so any difference is a bug (a stale shared buffer, another
 * layer's values, a recomputation before the layer's weights are there). */
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

/* 3 layers, so the shared buffers are overwritten by a later layer before the
 * backward needs an earlier one's values; N*C*2 bytes a multiple of 64, so no
 * buffer is rounded and the savings are the products themselves. */
static const ModelShape shape0 = {3, 2, 32, 16, 64, 0};
enum { B = 2, T = 16, ACCUM = 2, STEPS = 4 };

static void batch(int32_t *inp, int32_t *tgt, uint64_t seed) {
    Rng r;
    rng_seed(&r, seed);
    for (int i = 0; i < B * T; i++) inp[i] = (int32_t)rng_below(&r, 64), tgt[i] = (int32_t)rng_below(&r, 64);
}

static ModelShape resolved(ModelShape s) {
    model_shape_resolve(&s);
    return s;
}

/* none - gelu = (L-1) (N,4C) buffers, gelu - norm_gelu = (2L-1) (N,C) ones,
 * in either dtype; and the planned arena is what model_activation_bytes says. */
static void test_bytes(const Backend *be, const char *tag) {
    char name[96];
    ModelShape s = resolved(shape0);
    size_t ab = be->act_bytes(), N = (size_t)B * T, C = (size_t)s.n_embd, L = (size_t)s.n_layer;
    size_t none = model_activation_bytes(&s, B, T, ab, MODEL_RECOMPUTE_NONE);
    size_t gelu = model_activation_bytes(&s, B, T, ab, MODEL_RECOMPUTE_GELU);
    size_t norm = model_activation_bytes(&s, B, T, ab, MODEL_RECOMPUTE_NORM_GELU);
    snprintf(name, sizeof name, "recompute_bytes_%s", tag);
    test_report(none - gelu == (L - 1) * N * 4 * C * ab && gelu - norm == (2 * L - 1) * N * C * ab, name,
                "none %zu gelu %zu norm_gelu %zu bytes; want savings %zu and %zu", none, gelu, norm,
                (L - 1) * N * 4 * C * ab, (2 * L - 1) * N * C * ab);
    int same = 1;
    for (int r = MODEL_RECOMPUTE_NONE; r <= MODEL_RECOMPUTE_NORM_GELU; r++) {
        Model m;
        model_init(&m, be, &s, 0);
        model_plan_activations(&m, B, T, (ModelRecompute)r);
        same = same && m.act_size == model_activation_bytes(&s, B, T, ab, (ModelRecompute)r);
        /* shared: every layer's view is one buffer */
        if (r >= MODEL_RECOMPUTE_GELU) same = same && m.acts[0].fch_gelu == m.acts[2].fch_gelu;
        if (r >= MODEL_RECOMPUTE_NORM_GELU) same = same && m.acts[0].ln1 == m.acts[2].ln2;
        model_free(&m);
    }
    snprintf(name, sizeof name, "recompute_planned_%s", tag);
    test_report(same, name, "a planned arena differs from model_activation_bytes, or a buffer is not shared");
}

/* GPT-2 124M, micro-batch 16 x 1024 (the figure --dry-run prints): every
 * buffer is a multiple of 64 bytes, so the savings are the products. */
static void test_bytes_124m(void) {
    ModelShape s = resolved((ModelShape){12, 12, 768, 1024, 50257, 0});
    size_t N = 16 * 1024, C = 768, ok = 1;
    for (size_t ab = 2; ab <= 4; ab += 2) {
        size_t none = model_activation_bytes(&s, 16, 1024, ab, MODEL_RECOMPUTE_NONE);
        size_t gelu = model_activation_bytes(&s, 16, 1024, ab, MODEL_RECOMPUTE_GELU);
        size_t norm = model_activation_bytes(&s, 16, 1024, ab, MODEL_RECOMPUTE_NORM_GELU);
        ok = ok && none - gelu == 11 * N * 4 * C * ab && gelu - norm == 23 * N * C * ab;
    }
    test_report((int)ok, "recompute_bytes_gpt2_124m", "savings are not 11 x (N,4C) and 23 x (N,C)");
}

/* What a run leaves behind, for comparison bit for bit. */
typedef struct {
    float loss[STEPS * ACCUM];
    double norm[STEPS];
    float *grads;  /* (num_params) after the last backward */
    float *params; /* (num_params) after the last step */
    size_t n;
} Trace;

/* STEPS AdamW steps of ACCUM micro-batches each (the second accumulates),
 * each micro-batch a different batch. */
static void train(const Backend *be, ModelRecompute r, Trace *t) {
    Model m;
    ModelShape s = resolved(shape0);
    model_init(&m, be, &s, 0);
    model_init_weights(&m, 11);
    model_plan_activations(&m, B, T, r);
    AdamW o;
    optim_init(&o, be, m.num_params, m.num_decay, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f);
    int32_t inp[B * T], tgt[B * T];
    for (int step = 0; step < STEPS; step++) {
        for (int k = 0; k < ACCUM; k++) {
            batch(inp, tgt, 100 + (uint64_t)(step * ACCUM + k));
            t->loss[step * ACCUM + k] = model_forward(&m, inp, tgt, B, T, 1.0f / (B * T * ACCUM));
            model_backward(&m, k > 0);
        }
        t->n = m.num_params;
        if (step == STEPS - 1) {
            t->grads = xmalloc(t->n * sizeof(float));
            be->to_host(t->grads, m.grad_mem, t->n * sizeof(float));
        }
        t->norm[step] = optim_step(&o, m.param_mem, m.grad_mem, 3e-3f).grad_norm;
        model_params_changed(&m);
    }
    t->params = xmalloc(t->n * sizeof(float));
    be->to_host(t->params, m.param_mem, t->n * sizeof(float));
    optim_free(&o);
    model_free(&m);
}

static void test_bit_identical(const Backend *be, const char *tag) {
    Trace ref;
    train(be, MODEL_RECOMPUTE_NONE, &ref);
    for (int r = MODEL_RECOMPUTE_GELU; r <= MODEL_RECOMPUTE_NORM_GELU; r++) {
        Trace t;
        train(be, (ModelRecompute)r, &t);
        char name[96];
        snprintf(name, sizeof name, "recompute_%s_bit_identical_%s", model_recompute_name((ModelRecompute)r), tag);
        int losses = memcmp(t.loss, ref.loss, sizeof t.loss) == 0, norms = memcmp(t.norm, ref.norm, sizeof t.norm) == 0;
        int grads = memcmp(t.grads, ref.grads, t.n * sizeof(float)) == 0;
        int params = memcmp(t.params, ref.params, t.n * sizeof(float)) == 0;
        test_report(losses && norms && grads && params, name,
                    "losses %s, gradient norms %s, gradients %s, parameters %s (last loss %.9g vs %.9g)",
                    losses ? "equal" : "differ", norms ? "equal" : "differ", grads ? "equal" : "differ",
                    params ? "equal" : "differ", t.loss[STEPS * ACCUM - 1], ref.loss[STEPS * ACCUM - 1]);
        free(t.grads), free(t.params);
    }
    /* and the run learned: identical to a run that does nothing would prove little */
    int learns = ref.loss[STEPS * ACCUM - 1] < ref.loss[0] && isfinite(ref.loss[0]);
    char name[96];
    snprintf(name, sizeof name, "recompute_reference_learns_%s", tag);
    test_report(learns, name, "loss %g -> %g", ref.loss[0], ref.loss[STEPS * ACCUM - 1]);
    free(ref.grads), free(ref.params);
}

/* The names are the config's (model.recompute) and parse back. */
static void test_names(void) {
    int ok = 1;
    for (int r = MODEL_RECOMPUTE_NONE; r <= MODEL_RECOMPUTE_NORM_GELU; r++)
        ok = ok && model_recompute_parse(model_recompute_name((ModelRecompute)r)) == (ModelRecompute)r;
    test_report(ok && !strcmp(model_recompute_name(MODEL_RECOMPUTE_NORM_GELU), "norm_gelu"), "recompute_names",
                "names do not round-trip");
}

int main(void) {
    Backend emu = emu_bf16_backend();
    emu.init(2); /* the CPU backend's init: emu is its table with bf16 act ops */
    test_names();
    test_bytes(&backend_cpu, "fp32");
    test_bytes(&emu, "bf16");
    test_bytes_124m();
    test_bit_identical(&backend_cpu, "cpu");
    test_bit_identical(&emu, "bf16_emu");
    emu.shutdown();
    return 0;
}
