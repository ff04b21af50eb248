/* test_model_stages: a model split into pipeline stages (ModelOptions
 * layer_lo/hi) computes what the whole model does. Two or three stages of
 * GPT-2 (tied head: the first and last stage each hold the token
 * embedding), a Llama with GQA and QK-norm (untied) and an MoE, on the CPU:
 * each stage's output copied into the next stage's input, the gradient of
 * each stage's input back into the previous one's output gradient. Then
 * what a pipeline schedule needs: two micro-batches in flight in two
 * activation slots, ranks holding several chunks (interleaved), the
 * backward split into its input and weight parts (zero-bubble), with and
 * without recomputation: the gradients of the whole model's accumulation;
 * and that the plan's count of a stage's activations (with cp) is what the
 * model allocates. Never communicates; the copies stand in for a pipeline's send and receive. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "model.h"
#include "test.h"
#include "util.h"

enum { B = 2, T = 16, MAX_STAGES = 3 };

/* Same ops on the same inputs in the same order: the CPU backend gives the
 * same bits, so parameters, losses and gradients are compared exactly;
 * except the tied token embedding, whose gradient the whole model adds up in
 * one buffer (head, then embedding) and the stages in two: their sum agrees
 * to float rounding (TOL_TIED, a few ulps of the largest entry). */
#define TOL_TIED 1e-6

static int32_t tokens[B * T], targets[B * T];

/* max |a - b| / max |b| over tensor `name` of the two models' views */
static double rel_diff(const float *a, const float *b, size_t n) {
    double d = 0, s = 0;
    for (size_t i = 0; i < n; i++) {
        d = fmax(d, fabs((double)a[i] - b[i]));
        s = fmax(s, fabs((double)b[i]));
    }
    return s > 0 ? d / s : d;
}

static void run_case(const char *name, ArchSpec s, const int *cuts, int nst) {
    arch_resolve(&s);
    const Backend *be = &backend_cpu;
    size_t NC = (size_t)B * T * s.n_embd;
    Model whole, st[MAX_STAGES];
    model_init(&whole, be, &s, NULL);
    model_init_weights(&whole, 7);
    model_plan_activations(&whole, B, T, MODEL_RECOMPUTE_NONE);
    float dloss = 1.0f / (B * T);
    float loss_whole = model_forward(&whole, tokens, targets, B, T, dloss);
    model_backward(&whole, 0);
    for (int k = 0; k < nst; k++) {
        model_init(&st[k], be, &s, &(ModelOptions){.layer_lo = cuts[k], .layer_hi = cuts[k + 1]});
        model_init_weights(&st[k], 7);
        model_plan_activations(&st[k], B, T, MODEL_RECOMPUTE_NONE);
    }
    /* the same initial values, tensor by tensor */
    int same_init = 1, tensors = 0;
    for (int k = 0; k < nst; k++)
        for (int i = 0; i < st[k].num_tensors; i++) {
            const ParamInfo *p = model_find_param(&whole, st[k].params[i].name);
            same_init = same_init && p && !memcmp(st[k].pview[i], whole.pview[p - whole.params], p->numel * 4);
            tensors++;
        }
    char what[96];
    snprintf(what, sizeof what, "stages_%s_init", name);
    test_report(same_init && tensors >= whole.num_tensors, what, "a stage's initial values differ from the whole model's");
    float loss = 0;
    for (int k = 0; k < nst; k++) {
        if (k > 0) memcpy(model_stage_input(&st[k]), model_stage_output(&st[k - 1]), NC * sizeof(float));
        loss = model_forward(&st[k], tokens, k == nst - 1 ? targets : NULL, B, T, dloss);
    }
    snprintf(what, sizeof what, "stages_%s_loss", name);
    test_report(loss == loss_whole, what, "loss %.9g, the whole model's %.9g", loss, loss_whole);
    for (int k = nst - 1; k >= 0; k--) {
        if (k < nst - 1) memcpy(model_stage_output_grad(&st[k]), model_stage_input_grad(&st[k + 1]), NC * sizeof(float));
        model_backward(&st[k], 0);
    }
    /* every gradient; the tied embedding as the sum of its copies */
    int exact = 1;
    double tied = 0;
    char worst[64] = "";
    for (int i = 0; i < whole.num_tensors; i++) {
        const ParamInfo *p = &whole.params[i];
        float *sum = xcalloc(p->numel, sizeof(float));
        int copies = 0;
        for (int k = 0; k < nst; k++) {
            const ParamInfo *q = model_find_param(&st[k], p->name);
            if (!q) continue;
            const float *g = st[k].gview[q - st[k].params];
            for (size_t j = 0; j < p->numel; j++) sum[j] += g[j];
            copies++;
        }
        if (copies == 1 && memcmp(sum, whole.gview[i], p->numel * 4)) {
            exact = 0;
            snprintf(worst, sizeof worst, "%s", p->name);
        }
        if (copies > 1) tied = fmax(tied, rel_diff(sum, whole.gview[i], p->numel));
        free(sum);
    }
    snprintf(what, sizeof what, "stages_%s_grads", name);
    test_report(exact && tied <= TOL_TIED, what, "gradient of %s differs; tied embedding rel %.2e (tol %.0e)",
                worst[0] ? worst : "(none)", tied, TOL_TIED);
    for (int k = 0; k < nst; k++) model_free(&st[k]);
    model_free(&whole);
}

/* A pipeline of V = p v virtual stages (cuts[V+1]) on p rank models, rank r
 * holding chunks c of stages c p + r, two slots per chunk: both
 * micro-batches' forwards, then their backwards (whole, or input parts and
 * then weight parts), against the whole model accumulating the two. */
static void run_pipeline(const char *name, ArchSpec s, const int *cuts, int p, int v, int split, ModelRecompute rec) {
    arch_resolve(&s);
    const Backend *be = &backend_cpu;
    int V = p * v;
    size_t NC = (size_t)B * T * s.n_embd;
    int32_t tok2[2][B * T], tgt2[2][B * T];
    for (int m = 0; m < 2; m++)
        for (int i = 0; i < B * T; i++) tok2[m][i] = tokens[(i + 5 * m) % (B * T)], tgt2[m][i] = targets[(i + 3 * m) % (B * T)];
    float dloss = 1.0f / (2 * B * T);
    Model whole, rk[MAX_STAGES];
    model_init(&whole, be, &s, NULL);
    model_init_weights(&whole, 7);
    model_plan_activations(&whole, B, T, MODEL_RECOMPUTE_NONE);
    float lw[2];
    for (int m = 0; m < 2; m++) {
        lw[m] = model_forward(&whole, tok2[m], tgt2[m], B, T, dloss);
        model_backward(&whole, m > 0);
    }
    for (int r = 0; r < p; r++) {
        ModelOptions o = {.chunks = v};
        for (int c = 0; c < v; c++) o.chunk_lo[c] = cuts[c * p + r], o.chunk_hi[c] = cuts[c * p + r + 1];
        if (v == 1) o.chunks = 0, o.layer_lo = o.chunk_lo[0], o.layer_hi = o.chunk_hi[0];
        model_init(&rk[r], be, &s, &o);
        model_init_weights(&rk[r], 7);
        int slots[MODEL_MAX_CHUNKS];
        for (int c = 0; c < v; c++) slots[c] = 2;
        model_plan_slots(&rk[r], B, T, rec, slots, split);
    }
    float lp[2] = {0, 0};
    for (int m = 0; m < 2; m++)
        for (int vs = 0; vs < V; vs++) {
            Model *x = &rk[vs % p];
            model_use_slot(x, vs / p, m);
            if (vs > 0) memcpy(model_stage_input(x), model_slot_output(&rk[(vs - 1) % p], (vs - 1) / p, m), NC * 4);
            float l = model_forward(x, tok2[m], vs == V - 1 ? tgt2[m] : NULL, B, T, dloss);
            if (vs == V - 1) lp[m] = l;
        }
    for (int m = 0; m < 2; m++)
        for (int vs = V - 1; vs >= 0; vs--) {
            Model *x = &rk[vs % p];
            model_use_slot(x, vs / p, m);
            if (vs < V - 1)
                memcpy(model_stage_output_grad(x), model_slot_input_grad(&rk[(vs + 1) % p], (vs + 1) / p, m), NC * 4);
            if (split) model_backward_input(x, m > 0);
            else model_backward(x, m > 0);
        }
    for (int m = 0; split && m < 2; m++)
        for (int vs = V - 1; vs >= 0; vs--) {
            model_use_slot(&rk[vs % p], vs / p, m);
            model_backward_weight(&rk[vs % p], m > 0);
        }
    char what[96];
    snprintf(what, sizeof what, "stages_%s_loss", name);
    test_report(lp[0] == lw[0] && lp[1] == lw[1], what, "losses %.9g %.9g, the whole model's %.9g %.9g", lp[0], lp[1],
                lw[0], lw[1]);
    int exact = 1;
    double tied = 0;
    char worst[96] = "";
    for (int i = 0; i < whole.num_tensors; i++) {
        const ParamInfo *q = &whole.params[i];
        float *sum = xcalloc(q->numel, sizeof(float));
        int copies = 0;
        for (int r = 0; r < p; r++) {
            const ParamInfo *t = model_find_param(&rk[r], q->name);
            if (!t) continue;
            const float *g = rk[r].gview[t - rk[r].params];
            for (size_t j = 0; j < q->numel; j++) sum[j] += g[j];
            copies++;
        }
        if (copies == 1 && memcmp(sum, whole.gview[i], q->numel * 4)) exact = 0, snprintf(worst, sizeof worst, "%s", q->name);
        if (copies != 1 && copies != 2) exact = 0, snprintf(worst, sizeof worst, "%s (%d copies)", q->name, copies);
        if (copies > 1) tied = fmax(tied, rel_diff(sum, whole.gview[i], q->numel));
        free(sum);
    }
    snprintf(what, sizeof what, "stages_%s_grads", name);
    test_report(exact && tied <= TOL_TIED, what, "gradient of %s differs; tied embedding rel %.2e (tol %.0e)",
                worst[0] ? worst : "(none)", tied, TOL_TIED);
    for (int r = 0; r < p; r++) model_free(&rk[r]);
    model_free(&whole);
}

/* What ./train plan counts for a pipeline rank (model_activation_bytes_stage)
 * is what the model allocates for it (model_plan_slots), under context
 * parallelism too (a stage's B x T / cp rows), for chunks, slots and the
 * split backward. */
static void test_plan_bytes(const char *name, ArchSpec s, int cp, int chunks, const int *lo, const int *hi,
                            int split) {
    arch_resolve(&s);
    ModelOptions o = {.cp = cp, .cp_rank = cp - 1, .chunks = chunks > 1 ? chunks : 0};
    int slots[MODEL_MAX_CHUNKS];
    for (int c = 0; c < chunks; c++) o.chunk_lo[c] = lo[c], o.chunk_hi[c] = hi[c], slots[c] = 2 + c;
    if (chunks == 1) o.layer_lo = lo[0], o.layer_hi = hi[0];
    Model m;
    model_init(&m, &backend_cpu, &s, &o);
    model_plan_slots(&m, B, T, MODEL_RECOMPUTE_NONE, slots, split);
    size_t want = model_activation_bytes_stage(&s, 1, cp, 0, 1, B, T, 4, MODEL_RECOMPUTE_NONE, 1, 0, chunks, lo, hi, slots,
                                               split);
    char what[96];
    snprintf(what, sizeof what, "stages_plan_bytes_%s", name);
    test_report(m.act_size == want, what, "the model allocates %zu bytes, the plan counts %zu", m.act_size, want);
    model_free(&m);
}

int main(void) {
    backend_cpu.init(0);
    Rng rng;
    rng_seed(&rng, 99);
    for (int i = 0; i < B * T; i++) {
        tokens[i] = (int32_t)rng_below(&rng, 61);
        targets[i] = (int32_t)rng_below(&rng, 61);
    }
    ArchSpec gpt2 = ARCH_GPT2_SHAPE(4, 2, 32, T, 61);
    run_case("gpt2_tied", gpt2, (int[]){0, 1, 3, 4}, 3);
    ArchSpec llama = {.family = ARCH_LLAMA, .n_layer = 4, .n_head = 4, .n_kv_head = 2, .n_embd = 32, .seq_len = T,
                      .vocab_size = 61, .norm = NORM_RMSNORM, .pos = POS_ROPE, .rope_theta = 10000,
                      .qk_norm = QKNORM_HEAD, .mlp = MLP_SWIGLU, .ffn_hidden = 40};
    run_case("llama", llama, (int[]){0, 2, 4}, 2);
    ArchSpec moe = llama;
    moe.qk_norm = QKNORM_NONE, moe.mlp = MLP_MOE;
    moe.moe = (ArchMoe){.n_experts = 4, .top_k = 2, .n_shared = 1, .expert_hidden = 16, .norm_topk = 1,
                        .capacity_factor = 1.0f, .aux_loss_coef = 0.01f, .z_loss_coef = 0.001f};
    run_case("moe", moe, (int[]){0, 3, 4}, 2);
    /* a schedule's shapes: slots, chunks, the split backward, recomputation
     * (bit-identical on the CPU: no fused GeLU) */
    ArchSpec qkn = llama;
    qkn.qk_norm = QKNORM_HEAD;
    run_pipeline("slots_gpt2", gpt2, (int[]){0, 2, 4}, 2, 1, 0, MODEL_RECOMPUTE_NONE);
    run_pipeline("split_gpt2", gpt2, (int[]){0, 1, 3, 4}, 3, 1, 1, MODEL_RECOMPUTE_NONE);
    run_pipeline("split_gpt2_recompute_gelu", gpt2, (int[]){0, 2, 4}, 2, 1, 1, MODEL_RECOMPUTE_GELU);
    run_pipeline("split_llama_recompute_norm", qkn, (int[]){0, 2, 4}, 2, 1, 1, MODEL_RECOMPUTE_NORM_GELU);
    run_pipeline("split_moe", moe, (int[]){0, 1, 4}, 2, 1, 1, MODEL_RECOMPUTE_NORM_GELU);
    run_pipeline("chunks_gpt2", gpt2, (int[]){0, 1, 2, 3, 4}, 2, 2, 0, MODEL_RECOMPUTE_NONE);
    run_pipeline("chunks_llama_recompute", qkn, (int[]){0, 1, 2, 3, 4}, 2, 2, 0, MODEL_RECOMPUTE_NORM_GELU);
    test_plan_bytes("gpt2_last", gpt2, 1, 1, (int[]){2}, (int[]){4}, 1);
    test_plan_bytes("gpt2_middle_cp2", gpt2, 2, 1, (int[]){1}, (int[]){3}, 0);
    test_plan_bytes("llama_chunks_cp2_split", llama, 2, 2, (int[]){0, 2}, (int[]){1, 4}, 1);
    test_plan_bytes("gpt2_first_cp4", gpt2, 4, 1, (int[]){0}, (int[]){2}, 0);
    backend_cpu.shutdown();
    return 0;
}
