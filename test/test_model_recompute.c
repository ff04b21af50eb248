/* test_model_recompute: model.recompute. The activation arena shrinks by
 * exactly the per-layer buffers it drops (less the one shared buffer each),
 * and training with gelu or norm_gelu gives the bits of training without
 * recomputation — every micro-batch's loss, every step's gradients and
 * gradient norm, the final parameters — on the CPU backend and on the bf16
 * emulation (test/emu_bf16.h: the GPU's default dtype, and a compute copy
 * that must be fresh when the recomputation reads the weights); selective
 * too, on an MoE model with a shared expert and a capacity that drops slots
 * (its experts' and shared expert's SwiGLU outputs and the permuted rows
 * are shared buffers the backward fills again), loads and drops counted
 * once. Tolerance
 * 0 throughout: the recomputation runs the forward's own op on the forward's
 * own inputs, so any difference is a bug (a stale shared buffer, another
 * layer's values, a recomputation before the layer's weights are there). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "emu_bf16.h"
#include "ep.h"
#include "model.h"
#include "optim.h"
#include "test.h"
#include "util.h"

/* 3 layers, so the shared buffers are overwritten by a later layer before the
 * backward needs an earlier one's values; N*C*2 bytes a multiple of 64, so no
 * buffer is rounded and the savings are the products themselves. */
static const ArchSpec shape0 = ARCH_GPT2_SHAPE(3, 2, 32, 16, 64);
enum { B = 2, T = 16, ACCUM = 2, STEPS = 4 };
#include "model_trace.h"

/* MoE, 3 layers: 4 experts top-2, one shared expert, capacity factor 1
 * (cap = ceil(T * 2 / 4) = 8 slots per expert and sequence: slots drop),
 * aux and z losses. */
static const ArchSpec moe0 = {.family = ARCH_LLAMA, .n_layer = 3, .n_head = 4, .n_kv_head = 2, .n_embd = 32,
                              .head_dim = 8, .seq_len = T, .vocab_size = 64, .ffn_hidden = 64, .norm = NORM_RMSNORM,
                              .pos = POS_ROPE, .rope_theta = 10000, .mlp = MLP_MOE,
                              .moe = {.n_experts = 4, .top_k = 2, .n_shared = 1, .expert_hidden = 32, .norm_topk = 1,
                                      .capacity_factor = 1.0f, .aux_loss_coef = 0.01f, .z_loss_coef = 1e-3f}};

static ArchSpec resolved(ArchSpec s) {
    arch_resolve(&s);
    return s;
}

/* none - gelu = (L-1) (N,4C) buffers, gelu - norm_gelu = (2L-1) (N,C) ones,
 * in either dtype; and the planned arena is what model_activation_bytes says. */
static void test_bytes(const Backend *be, const char *tag) {
    char name[96];
    ArchSpec s = resolved(shape0);
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
        model_init(&m, be, &s, NULL);
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

/* BLOCK keeps one (N,C) output per layer where NONE keeps a whole layer
 * (X: what one more layer adds to NONE's arena), and adds one whole layer,
 * the workspace, and its (2N,C) product outputs: NONE - BLOCK = (L-1) X -
 * (L+2) (N,C). With recompute_every 2 the odd layers stay whole. Every
 * checkpointed layer's views but its output are the workspace's. */
static void test_bytes_block(const Backend *be, const char *tag) {
    char name[96];
    ArchSpec s = resolved(shape0), s2 = s;
    s2.n_layer = s.n_layer - 1;
    size_t ab = be->act_bytes(), NC = (size_t)B * T * s.n_embd * ab, L = (size_t)s.n_layer;
    size_t none = model_activation_bytes(&s, B, T, ab, MODEL_RECOMPUTE_NONE);
    size_t X = none - model_activation_bytes(&s2, B, T, ab, MODEL_RECOMPUTE_NONE);
    size_t block = model_activation_bytes(&s, B, T, ab, MODEL_RECOMPUTE_BLOCK);
    size_t every2 = model_activation_bytes_rank(&s, 1, 1, 1, 0, B, T, ab, MODEL_RECOMPUTE_BLOCK, 2, 0);
    /* every 2 of 3 layers: 0 and 2 checkpointed, 1 whole */
    size_t want2 = none - (2 - 1) * X + (2 + 2) * NC;
    snprintf(name, sizeof name, "recompute_block_bytes_%s", tag);
    test_report(none - block == (L - 1) * X - (L + 2) * NC && every2 == want2, name,
                "none %zu block %zu (want %zu) every 2 %zu (want %zu) bytes", none, block,
                none - ((L - 1) * X - (L + 2) * NC), every2, want2);
    Model m;
    model_init(&m, be, &s, NULL);
    model_plan_activations(&m, B, T, MODEL_RECOMPUTE_BLOCK);
    int views = m.act_size == block && m.acts[0].qkv == m.acts[2].qkv && m.acts[0].ln2 == m.acts[1].ln2 &&
                m.acts[0].res3 != m.acts[1].res3 && m.acts[1].res3 != m.acts[2].res3 && m.acts[0].qkv == m.rec_ws.qkv;
    model_free(&m);
    snprintf(name, sizeof name, "recompute_block_planned_%s", tag);
    test_report(views, name, "the arena differs from model_activation_bytes, or a view is not the workspace's");
}

/* SELECTIVE drops, of each MoE layer, the permuted rows (R,C), the experts'
 * SwiGLU output (R,Fe) and the shared expert's (N,S), for one shared
 * buffer of each: norm_gelu - selective = (L-1) of them; on a dense model
 * it is norm_gelu. Under ep the expert side's are ep.c's: (R,C) only, and
 * ep_buffer_bytes shares its layers' SwiGLU outputs. */
static void test_bytes_selective(const Backend *be, const char *tag) {
    char name[96];
    ArchSpec s = resolved(moe0), d = resolved(shape0);
    size_t ab = be->act_bytes(), N = (size_t)B * T, C = (size_t)s.n_embd, L = (size_t)s.n_layer;
    size_t R = N * s.moe.top_k, Fe = (size_t)s.moe.expert_hidden, S = (size_t)s.moe.n_shared * Fe;
    size_t norm = model_activation_bytes(&s, B, T, ab, MODEL_RECOMPUTE_NORM_GELU);
    size_t sel = model_activation_bytes(&s, B, T, ab, MODEL_RECOMPUTE_SELECTIVE);
    size_t want = (L - 1) * (R * C + R * Fe + N * S) * ab;
    size_t norm2 = model_activation_bytes_rank(&s, 1, 1, 2, 0, B, T, ab, MODEL_RECOMPUTE_NORM_GELU, 1, 0);
    size_t sel2 = model_activation_bytes_rank(&s, 1, 1, 2, 0, B, T, ab, MODEL_RECOMPUTE_SELECTIVE, 1, 0);
    size_t want2 = (L - 1) * (R * C + N * S) * ab;
    size_t epn = ep_buffer_bytes(&s, 2, 1, (int)L, B, T, ab, MODEL_RECOMPUTE_NORM_GELU);
    size_t eps = ep_buffer_bytes(&s, 2, 1, (int)L, B, T, ab, MODEL_RECOMPUTE_SELECTIVE);
    size_t rows = ep_plan_rows(&s, 2, 1, B, T);
    int dense = model_activation_bytes(&d, B, T, ab, MODEL_RECOMPUTE_SELECTIVE) ==
                model_activation_bytes(&d, B, T, ab, MODEL_RECOMPUTE_NORM_GELU);
    snprintf(name, sizeof name, "recompute_selective_bytes_%s", tag);
    test_report(norm - sel == want && norm2 - sel2 == want2 && epn - eps == (L - 1) * rows * Fe * ab && dense, name,
                "norm_gelu - selective %zu (want %zu), under ep 2 %zu (want %zu), ep buffers %zu (want %zu), dense "
                "equal %d", norm - sel, want, norm2 - sel2, want2, epn - eps, (L - 1) * rows * Fe * ab, dense);
    Model m;
    model_init(&m, be, &s, NULL);
    model_plan_activations(&m, B, T, MODEL_RECOMPUTE_SELECTIVE);
    int views = m.act_size == sel && m.acts[0].xp == m.acts[2].xp && m.acts[0].hp_act == m.acts[1].hp_act &&
                m.acts[0].sh_act == m.acts[2].sh_act && m.acts[0].hp != m.acts[1].hp && m.acts[0].yp != m.acts[2].yp &&
                m.acts[0].ln1 == m.acts[2].ln2;
    model_free(&m);
    snprintf(name, sizeof name, "recompute_selective_planned_%s", tag);
    test_report(views, name, "the arena differs from model_activation_bytes, or a buffer is (not) shared");
}

/* GPT-2 124M, micro-batch 16 x 1024 (the figure --dry-run prints): every
 * buffer is a multiple of 64 bytes, so the savings are the products. */
static void test_bytes_124m(void) {
    ArchSpec s = resolved((ArchSpec)ARCH_GPT2_SHAPE(12, 12, 768, 1024, 50257));
    size_t N = 16 * 1024, C = 768, ok = 1;
    for (size_t ab = 2; ab <= 4; ab += 2) {
        size_t none = model_activation_bytes(&s, 16, 1024, ab, MODEL_RECOMPUTE_NONE);
        size_t gelu = model_activation_bytes(&s, 16, 1024, ab, MODEL_RECOMPUTE_GELU);
        size_t norm = model_activation_bytes(&s, 16, 1024, ab, MODEL_RECOMPUTE_NORM_GELU);
        ok = ok && none - gelu == 11 * N * 4 * C * ab && gelu - norm == 23 * N * C * ab;
    }
    test_report((int)ok, "recompute_bytes_gpt2_124m", "savings are not 11 x (N,4C) and 23 x (N,C)");
}

static void test_bit_identical(const Backend *be, const char *tag) {
    Trace ref;
    trace_train(be, shape0, MODEL_RECOMPUTE_NONE, 1, &ref);
    for (int r = MODEL_RECOMPUTE_GELU; r < MODEL_RECOMPUTE_MODES; r++) {
        Trace t;
        trace_train(be, shape0, (ModelRecompute)r, 1, &t);
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

/* MoE: selective (and norm_gelu, which keeps the MoE buffers) against none,
 * every bit, and the same loads and drops (counted once, not again by a
 * recomputation). */
static void test_bit_identical_moe(const Backend *be, const char *tag) {
    Trace ref;
    trace_train(be, moe0, MODEL_RECOMPUTE_NONE, 1, &ref);
    ModelRecompute modes[] = {MODEL_RECOMPUTE_NORM_GELU, MODEL_RECOMPUTE_SELECTIVE, MODEL_RECOMPUTE_BLOCK};
    for (int i = 0; i < 3; i++) {
        Trace t;
        trace_train(be, moe0, modes[i], 1, &t);
        char name[96];
        snprintf(name, sizeof name, "recompute_%s_moe_bit_identical_%s", model_recompute_name(modes[i]), tag);
        int same = trace_same(&t, &ref), loads = memcmp(t.moe_load, ref.moe_load, sizeof t.moe_load) == 0 &&
                                                 t.moe_routed == ref.moe_routed && t.moe_drops == ref.moe_drops;
        test_report(same && loads && ref.moe_drops > 0, name,
                    "trace %s, loads %s (routed %lld/%lld, dropped %lld/%lld; the reference must drop some)",
                    same ? "equal" : "differs", loads ? "equal" : "differ", (long long)t.moe_routed,
                    (long long)ref.moe_routed, (long long)t.moe_drops, (long long)ref.moe_drops);
        free(t.grads), free(t.params);
    }
    free(ref.grads), free(ref.params);
}

/* The names are the config's (model.recompute) and parse back. */
static void test_names(void) {
    int ok = 1;
    for (int r = MODEL_RECOMPUTE_NONE; r < MODEL_RECOMPUTE_MODES; r++)
        ok = ok && model_recompute_parse(model_recompute_name((ModelRecompute)r)) == (ModelRecompute)r;
    test_report(ok && !strcmp(model_recompute_name(MODEL_RECOMPUTE_NORM_GELU), "norm_gelu") &&
                    !strcmp(model_recompute_name(MODEL_RECOMPUTE_BLOCK), "block") &&
                    !strcmp(model_recompute_name(MODEL_RECOMPUTE_SELECTIVE), "selective"), "recompute_names",
                "names do not round-trip");
}

int main(void) {
    Backend emu = emu_bf16_backend();
    emu.init(2); /* the CPU backend's init: emu is its table with bf16 act ops */
    test_names();
    test_bytes(&backend_cpu, "fp32");
    test_bytes(&emu, "bf16");
    test_bytes_block(&backend_cpu, "fp32");
    test_bytes_block(&emu, "bf16");
    test_bytes_selective(&backend_cpu, "fp32");
    test_bytes_selective(&emu, "bf16");
    test_bytes_124m();
    test_bit_identical(&backend_cpu, "cpu");
    test_bit_identical(&emu, "bf16_emu");
    test_bit_identical_moe(&backend_cpu, "cpu");
    test_bit_identical_moe(&emu, "bf16_emu");
    emu.shutdown();
    return 0;
}
