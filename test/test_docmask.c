/* test_docmask: documents inside a sequence (ModelOptions doc_masking,
 * doc_reset; docs/data.md "Documents") at model level on the CPU backend.
 * Two sequences packed with documents that end in an end-of-text token (one
 * of a single token, one across the sequence end) run with document masking
 * and positions reset must give each token the loss it gets when its
 * document runs alone (B 1, T its length, positions from 0), and the
 * gradients of the packed batch must be the sum of the documents' (each run
 * with the packed batch's loss scale). GPT-2 (learned positions, tied head)
 * and a Llama with GQA (RoPE). Then the checks are shown to have the power
 * to fail: without the mask the losses must miss, and with GPT-2's learned
 * positions also without the reset (RoPE is relative: under the mask its
 * losses do not change without the reset; test_ops checks its reset).
 * Also model_doc_starts on a hand-made row.
 *
 * Tolerances. Losses 1e-5 relative to the largest: the same fp32 ops on the
 * same values, except that the packed attention's products run over the
 * masked keys too (their p is exactly 0, so they add exact zeros) and sgemm
 * may block differently by width: a few ulps per op, ~1e-6 after the
 * layers (test_ops' TOL_FWD argument). Gradients 1e-5 of each tensor's
 * largest entry: the per-document sums add the same terms in another order
 * (per document, then over documents). A missing mask or reset changes the
 * losses by 1e-2 and more (measured below: "would fail" must exceed 1e-3). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "model.h"
#include "resume.h"
#include "test.h"
#include "util.h"

#define TOL 1e-5
enum { B = 2, T = 32, V = 61, EOT = 60 };

static int32_t tokens[B * T], targets[B * T];
/* document lengths per sequence (each ends in EOT but the last, which runs past T) */
static const int lens[B][6] = {{5, 1, 12, 14, 0}, {20, 12, 0}};

static double rel(const float *a, const float *b, size_t n) {
    double d = 0, s = 0;
    for (size_t i = 0; i < n; i++) {
        d = fmax(d, fabs((double)a[i] - b[i]));
        s = fmax(s, fabs((double)b[i]));
    }
    return isnan(d) ? INFINITY : s > 0 ? d / s : d;
}

static void make_batch(void) {
    Rng rng;
    rng_seed(&rng, 11);
    int32_t stream[B * T];
    for (int b = 0; b < B; b++) {
        int at = 0;
        for (int k = 0; lens[b][k]; k++) {
            for (int j = 0; j < lens[b][k]; j++) stream[b * T + at + j] = (int32_t)rng_below(&rng, EOT);
            at += lens[b][k];
            if (at < T) stream[b * T + at - 1] = EOT; /* the document's last token */
        }
    }
    memcpy(tokens, stream, sizeof tokens);
    for (int b = 0; b < B; b++) /* next-token targets within each row; the row's last predicts a fresh id */
        for (int i = 0; i < T; i++) targets[b * T + i] = i + 1 < T ? stream[b * T + i + 1] : (int32_t)rng_below(&rng, EOT);
}

/* The packed batch's per-token losses (N) and gradients (all tensors,
 * concatenated) with the given options. */
static float *run_packed(ArchSpec *s, ModelOptions o, float **grads, size_t *ng) {
    Model m;
    model_init(&m, &backend_cpu, s, &o);
    model_init_weights(&m, 5);
    model_plan_activations(&m, B, T, MODEL_RECOMPUTE_NONE);
    model_forward(&m, tokens, targets, B, T, 1.0f / (B * T));
    float *loss = xmalloc(sizeof(float) * B * T);
    memcpy(loss, m.losses_host, sizeof(float) * B * T);
    if (grads) {
        model_backward(&m, 0);
        size_t n = 0;
        for (int i = 0; i < m.num_tensors; i++) n += m.params[i].numel;
        *grads = xmalloc(n * sizeof(float)), *ng = n, n = 0;
        for (int i = 0; i < m.num_tensors; i++) {
            memcpy(*grads + n, m.gview[i], m.params[i].numel * sizeof(float));
            n += m.params[i].numel;
        }
    }
    model_free(&m);
    return loss;
}

static void run_case(const char *name, ArchSpec s) {
    arch_resolve(&s);
    char what[96];
    float *g_pack;
    size_t ng;
    ModelOptions docs = {.doc_masking = 1, .doc_reset = 1, .doc_eot = EOT};
    float *l_pack = run_packed(&s, docs, &g_pack, &ng);

    /* each document alone, the gradients accumulated */
    Model m;
    model_init(&m, &backend_cpu, &s, NULL);
    model_init_weights(&m, 5);
    model_plan_activations(&m, 1, T, MODEL_RECOMPUTE_NONE);
    float *l_sep = xmalloc(sizeof(float) * B * T);
    int first = 1;
    for (int b = 0; b < B; b++) {
        int at = 0;
        for (int k = 0; lens[b][k]; k++) {
            int n = lens[b][k];
            model_forward(&m, tokens + b * T + at, targets + b * T + at, 1, n, 1.0f / (B * T));
            memcpy(l_sep + b * T + at, m.losses_host, (size_t)n * sizeof(float));
            model_backward(&m, !first);
            first = 0, at += n;
        }
    }
    double eg = 0;
    size_t off = 0;
    for (int i = 0; i < m.num_tensors; i++) {
        eg = fmax(eg, rel(g_pack + off, m.gview[i], m.params[i].numel));
        off += m.params[i].numel;
    }
    snprintf(what, sizeof what, "docmask_%s_losses_equal_separate_documents", name);
    double el = rel(l_pack, l_sep, B * T);
    test_report(el <= TOL, what, "max relative error %.3g > %.3g", el, (double)TOL);
    printf("# %s: losses %.3g, gradients %.3g (max relative error)\n", name, el, eg);
    snprintf(what, sizeof what, "docmask_%s_gradients_equal_separate_documents", name);
    test_report(off == ng && eg <= TOL, what, "max relative error %.3g > %.3g", eg, (double)TOL);

    /* the power to fail: positions continuing, or no mask */
    float *l_noreset = run_packed(&s, (ModelOptions){.doc_masking = 1, .doc_eot = EOT}, NULL, NULL);
    float *l_nomask = run_packed(&s, (ModelOptions){.doc_reset = 1, .doc_eot = EOT}, NULL, NULL);
    double er = rel(l_noreset, l_sep, B * T), em = rel(l_nomask, l_sep, B * T);
    printf("# %s: without the reset %.3g, without the mask %.3g\n", name, er, em);
    if (s.pos == POS_ROPE) {
        /* RoPE scores depend on relative positions only: under the mask a
         * document's shift changes nothing (to rounding), reset or not */
        snprintf(what, sizeof what, "docmask_%s_rope_relative_without_reset", name);
        test_report(er <= TOL, what, "the losses with positions continuing differ by %.3g", er);
    } else {
        snprintf(what, sizeof what, "docmask_%s_without_reset_would_fail", name);
        test_report(er > 100 * TOL, what, "the losses with positions continuing differ only by %.3g", er);
    }
    snprintf(what, sizeof what, "docmask_%s_without_mask_would_fail", name);
    test_report(em > 100 * TOL, what, "the losses without the mask differ only by %.3g", em);
    model_free(&m);
    free(l_pack), free(g_pack), free(l_sep), free(l_noreset), free(l_nomask);
}

int main(void) {
    backend_cpu.init(0);
    /* model_doc_starts: the token after each eot (9) starts a document */
    int32_t row[8] = {1, 9, 2, 3, 9, 9, 4, 9}, doc[8], want[8] = {0, 0, 2, 2, 2, 5, 6, 6};
    model_doc_starts(row, 1, 8, 9, doc);
    test_report(!memcmp(doc, want, sizeof doc), "docmask_doc_starts", "starts differ from 0 0 2 2 2 5 6 6");
    /* a checkpoint from before the keys existed resumes with them off (a
     * refusal would exit 2 here, so the line below would never print) */
    resume_check_config("ckpt", "data:\n  prefetch: 4\n",
                        "data:\n  prefetch: 4\n  doc_masking: false\n  doc_positions: continue\n  eot_id: -1\n", 0, 1);
    test_report(1, "docmask_resume_checkpoint_without_the_keys", "refused");
    make_batch();
    ArchSpec gpt2 = ARCH_GPT2_SHAPE(2, 2, 32, T, V);
    run_case("gpt2", gpt2);
    ArchSpec llama = {.family = ARCH_LLAMA, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 32, .seq_len = T,
                      .vocab_size = V, .norm = NORM_RMSNORM, .pos = POS_ROPE, .rope_theta = 10000,
                      .mlp = MLP_SWIGLU, .ffn_hidden = 40};
    run_case("llama", llama);
    backend_cpu.shutdown();
    return 0;
}
