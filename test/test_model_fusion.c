/* test_model_fusion: model.c's use of the backend's optional fused fc + GeLU
 * ops (backend.h: matmul_gelu_forward, matmul_backward_dgelu; model.h:
 * model_gelu_fused). With a backend offering them as the composition of its
 * own separate ops (test/fused_compose.h), on the CPU backend and on the bf16
 * emulation (test/emu_bf16.h), training with fusion on must take the fused
 * path in every layer, forward and backward, in every model.recompute mode,
 * and give the bits of the plain backend (no fused ops): every loss, the
 * gradients, the gradient norms and the final parameters. With gelu_fusion 0
 * the ops must not be called. Tolerance 0: the composition is the separate
 * ops, so any difference is a wiring bug (a wrong buffer, a missing
 * recomputation, the gradient of gelu(pre) taken for that of pre). What the
 * real fused ops do to the values is test_backend_cross's business (GPU). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "emu_bf16.h"
#include "fused_compose.h"
#include "model.h"
#include "optim.h"
#include "test.h"
#include "util.h"

static const ArchSpec shape0 = ARCH_GPT2_SHAPE(3, 2, 32, 16, 64);
enum { B = 2, T = 16, ACCUM = 2, STEPS = 3 };
#include "model_trace.h"

static void test_backend(const Backend *base, const char *tag) {
    char name[96];
    Trace ref;
    trace_train(base, shape0, MODEL_RECOMPUTE_NONE, 1, &ref); /* no fused ops offered: the separate ones */
    Backend fused = compose_fused(base);
    long want = (long)STEPS * ACCUM * shape0.n_layer;
    for (int r = MODEL_RECOMPUTE_NONE; r <= MODEL_RECOMPUTE_NORM_GELU; r++) {
        for (int fusion = 1; fusion >= 0; fusion--) {
            Trace t;
            compose_calls_fwd = compose_calls_bwd = 0;
            trace_train(&fused, shape0, (ModelRecompute)r, fusion, &t);
            long wf = fusion ? want : 0;
            snprintf(name, sizeof name, "fusion_%s_%s_%s", fusion ? "on" : "off",
                     model_recompute_name((ModelRecompute)r), tag);
            test_report(trace_same(&t, &ref) && compose_calls_fwd == wf && compose_calls_bwd == wf, name,
                        "%s; fused calls forward %ld backward %ld, want %ld (last loss %.9g vs %.9g)",
                        trace_same(&t, &ref) ? "bits equal" : "losses, gradients or parameters differ from the separate ops",
                        compose_calls_fwd, compose_calls_bwd, wf, t.loss[STEPS * ACCUM - 1],
                        ref.loss[STEPS * ACCUM - 1]);
            free(t.grads), free(t.params);
        }
    }
    /* the plain backend offers nothing, so asks for nothing */
    Model m;
    ArchSpec s = shape0;
    arch_resolve(&s);
    model_init(&m, base, &s, NULL);
    int plain = !model_gelu_fused(&m, 0) && !model_gelu_fused(&m, 1);
    model_free(&m);
    model_init(&m, &fused, &s, NULL);
    int offered = model_gelu_fused(&m, 0) && model_gelu_fused(&m, 1);
    m.gelu_fusion = 0;
    int off = !model_gelu_fused(&m, 0) && !model_gelu_fused(&m, 1);
    model_free(&m);
    snprintf(name, sizeof name, "fusion_choice_%s", tag);
    test_report(plain && offered && off, name, "model_gelu_fused: plain %d offered %d off %d (want 1 1 1)", plain,
                offered, off);
    free(ref.grads), free(ref.params);
}

/* ---------------------------------------------------------------------------
 * residual_norm_forward (backend.h): model.c leaves each residual add to the
 * norm that reads its result next, so every add but the stream's last before
 * a later pipeline stage goes through the fused op: 2L calls a forward
 * (norm2 of every layer, norm1 of every layer but the first, the final
 * norm). Training must give the bits of the same backend without the op
 * (the add, then the norm), in every model.recompute mode (the recomputed
 * norms read the res buffers the fused op wrote): LayerNorm with biases,
 * RMSNorm with SwiGLU, a MoE layer whose shared expert makes the pending add
 * in place (res3 += shared), a tensor-parallel rank and documents. */
static const Backend *rn_base;
static long rn_calls;
static void rn_counted(void *res, void *out, float *mean, float *rstd, const void *a, const void *b, const void *w,
                       const void *bias, int N, int C, float eps) {
    rn_calls++;
    rn_base->residual_norm_forward(res, out, mean, rstd, a, b, w, bias, N, C, eps);
}

#define RN_LLAMA                                                                                             \
    .family = ARCH_LLAMA, .n_layer = 3, .n_embd = 32, .n_head = 4, .n_kv_head = 2, .head_dim = 8, .seq_len = T, \
    .vocab_size = 64, .ffn_hidden = 48, .norm = NORM_RMSNORM, .pos = POS_ROPE, .rope_theta = 10000
static const struct {
    const char *name;
    ArchSpec spec;
    int tp, docs;
} rn_cases[] = {
    {"gpt2", ARCH_GPT2_SHAPE(3, 2, 32, 16, 64), 0, 0},
    {"llama", {RN_LLAMA, .mlp = MLP_SWIGLU}, 0, 0},
    {"moe_shared", {RN_LLAMA, .mlp = MLP_MOE,
                    .moe = {.n_experts = 4, .top_k = 2, .n_shared = 1, .expert_hidden = 16, .norm_topk = 1,
                            .aux_loss_coef = 0.01f, .z_loss_coef = 1e-3f}}, 0, 0},
    {"llama_tp2", {RN_LLAMA, .mlp = MLP_SWIGLU}, 2, 0},
    {"gpt2_docs", ARCH_GPT2_SHAPE(3, 2, 32, 16, 64), 0, 1},
};

static void test_residual_norm(const Backend *base, const char *tag) {
    Backend plain = *base, counted = *base;
    plain.residual_norm_forward = NULL;
    rn_base = base;
    counted.residual_norm_forward = rn_counted;
    for (size_t c = 0; c < sizeof rn_cases / sizeof rn_cases[0]; c++) {
        long want = (long)STEPS * ACCUM * 2 * rn_cases[c].spec.n_layer;
        for (int r = MODEL_RECOMPUTE_NONE; r <= MODEL_RECOMPUTE_NORM_GELU; r++) {
            TraceOpts op = {.r = (ModelRecompute)r, .gelu_fusion = 1, .tp = rn_cases[c].tp, .docs = rn_cases[c].docs};
            Trace ref, t;
            trace_train_opts(&plain, rn_cases[c].spec, op, &ref);
            rn_calls = 0;
            trace_train_opts(&counted, rn_cases[c].spec, op, &t);
            char name[96];
            snprintf(name, sizeof name, "residual_norm_%s_%s_%s", rn_cases[c].name,
                     model_recompute_name((ModelRecompute)r), tag);
            test_report(trace_same(&t, &ref) && rn_calls == want, name,
                        "%s; residual_norm_forward called %ld times, want %ld (last loss %.9g vs %.9g)",
                        trace_same(&t, &ref) ? "bits equal" : "losses, gradients or parameters differ from the add "
                                                              "then the norm",
                        rn_calls, want, t.loss[STEPS * ACCUM - 1], ref.loss[STEPS * ACCUM - 1]);
            free(t.grads), free(t.params), free(ref.grads), free(ref.params);
        }
    }
}

int main(void) {
    Backend emu = emu_bf16_backend();
    emu.init(2); /* the CPU backend's init */
    test_backend(&backend_cpu, "cpu");
    test_backend(&emu, "bf16_emu");
    test_residual_norm(&backend_cpu, "cpu");
    test_residual_norm(&emu, "bf16_emu");
    emu.shutdown();
    return 0;
}
