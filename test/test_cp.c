/* test_cp: context-parallel attention (src/cp.c), ring and all-gather,
 * forward and backward, against the single-rank attention op of the CPU
 * backend on the whole sequence. Every rank builds the same random qkv and
 * dout of B sequences of T tokens, takes its two chunks (model.h ModelCp's
 * layout), runs cp_attention_forward / _backward over the world as the cp
 * group, and compares its rows of out, lse and dqkv with the reference's
 * rows at the same global positions. Run directly it is cp 1 (both chunks on
 * one rank, the block schedule without exchanges); test/t_cp.sh runs it
 * under mpirun with 2, 3 and 4 ranks. Only rank 0 prints; a check fails if
 * any rank saw it fail.
 *
 * Tolerance 1e-5 of max |reference| per tensor: both sides compute in fp32
 * from the same inputs; the blocks add their softmax sums, P V products and
 * gradients in another association order (per chunk, merged by
 * log-sum-exp; dK/dV summed over ranks), a few ulps (~1e-7) per element, as
 * test_ops' TOL_FWD argues. A wrong position, mask, chunk or merge errs by
 * 1e-2 or more. The ring's and the all-gather's forwards run the same
 * blocks in the same order: the same bits (exact). Measured: at most 1.7e-6.
 *
 * Positions (model level): a tiny GPT-2 whose token embeddings are zero, so
 * its logits depend on the positions alone (learned wpe), and a tiny Llama
 * (RoPE) with sharp attention, each run under cp on every rank and as one rank on the whole
 * sequence with the same weights: every rank's logits rows against the
 * reference's rows at their global positions, 1e-5 as above. Then the
 * check is shown to have the power to fail: with the position table (wpe,
 * or RoPE's) rewritten so that each rank's global positions read its local
 * ones' rows (what a rank computing at local positions would do), the same
 * forward must miss the reference by more than 100x the tolerance. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "comm.h"
#include "cp.h"
#include "test.h"
#include "util.h"

#define TOL 1e-5

static int R, W;
static const Backend *be = &backend_cpu;

static void check(const char *name, int ok, const char *why, double v) {
    double bad = ok ? 0.0 : 1.0, worst = v;
    comm_all_reduce_sum_f64(comm_world(), &bad, 1);
    comm_all_reduce_max_f64(comm_world(), &worst, 1);
    if (R == 0 && bad == 0.0) printf("ok %s # %s: %.3g\n", name, why, worst); /* the figure, for the record */
    else if (R == 0) test_report(0, name, "%s: %.3g (on %g rank(s))", why, worst, bad);
    fflush(stdout);
}

static double max_rel(const float *got, const float *ref, size_t n) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - ref[i]);
        if (isnan(d)) return INFINITY;
        num = d > num ? d : num;
        den = fabs(ref[i]) > den ? fabs(ref[i]) : den;
    }
    return num / (den > 0.0 ? den : 1.0);
}

/* Rows of a (B, T, w) tensor at this rank's chunks, chunk-major (B, 2 Tc, w). */
static float *take_rows(const float *x, int B, int T, int w, int cp, int rank) {
    int Tc = T / (2 * cp);
    float *out = xmalloc((size_t)B * 2 * Tc * w * sizeof(float));
    for (int c = 0; c < 2; c++)
        for (int b = 0; b < B; b++)
            memcpy(out + ((size_t)c * B + b) * Tc * w, x + ((size_t)b * T + model_cp_chunk(cp, rank, c) * Tc) * w,
                   (size_t)Tc * w * sizeof(float));
    return out;
}

static void run(int B, int Tc, int NH, int NKV, int HD) {
    int cp = W, T = 2 * cp * Tc;
    AttnShape g = {B, T, NH, NKV, HD}, l = {B, 2 * Tc, NH, NKV, HD};
    int QKVW = attn_qkv_width(&g), Q = NH * HD;
    size_t NG = (size_t)B * T, NL = (size_t)B * 2 * Tc;
    Rng rng;
    rng_seed(&rng, 99 + (uint64_t)T * 7 + NKV); /* the same inputs on every rank */
    float *qkv = xmalloc(NG * QKVW * sizeof(float)), *dout = xmalloc(NG * Q * sizeof(float));
    for (size_t i = 0; i < NG * QKVW; i++) qkv[i] = rng_normal(&rng);
    for (size_t i = 0; i < NG * Q; i++) dout[i] = rng_normal(&rng);
    float *out = xmalloc(NG * Q * sizeof(float)), *lse = xmalloc((size_t)B * NH * T * sizeof(float));
    float *dqkv = xmalloc(NG * QKVW * sizeof(float));
    be->attention_forward(out, lse, qkv, &g);
    be->attention_backward(dqkv, dout, qkv, out, lse, &g);
    float *lq = take_rows(qkv, B, T, QKVW, cp, R), *ld = take_rows(dout, B, T, Q, cp, R);
    float *ro = take_rows(out, B, T, Q, cp, R), *rd = take_rows(dqkv, B, T, QKVW, cp, R);
    float *rl = xmalloc(NL * NH * sizeof(float)); /* the reference's lse at this rank's rows: (2, B, NH, Tc) */
    for (int c = 0; c < 2; c++)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < NH; h++)
                memcpy(rl + (((size_t)c * B + b) * NH + h) * Tc,
                       lse + ((size_t)b * NH + h) * T + model_cp_chunk(cp, R, c) * Tc, (size_t)Tc * sizeof(float));
    float *o[2], *L = xmalloc(NL * NH * sizeof(float)), *d = xmalloc(NL * QKVW * sizeof(float));
    char name[160];
    for (int mode = 0; mode < 2; mode++) {
        Cp c;
        cp_init(&c, be, comm_world(), (CpMode)mode, &l);
        o[mode] = xmalloc(NL * Q * sizeof(float));
        cp_attention_forward(&c, o[mode], L, lq, &l);
        cp_attention_backward(&c, d, ld, lq, o[mode], L, &l);
        const char *mn = cp_mode_name((CpMode)mode);
        snprintf(name, sizeof name, "cp%d_%s_B%d_T%d_NH%d_NKV%d_HD%d", cp, mn, B, T, NH, NKV, HD);
        char full[200];
        double e = max_rel(o[mode], ro, NL * Q);
        snprintf(full, sizeof full, "%s_forward_out", name);
        check(full, e <= TOL, "max relative error", e);
        e = max_rel(L, rl, NL * NH);
        snprintf(full, sizeof full, "%s_forward_lse", name);
        check(full, e <= TOL, "max relative error", e);
        e = max_rel(d, rd, NL * QKVW);
        snprintf(full, sizeof full, "%s_backward_dqkv", name);
        check(full, e <= TOL, "max relative error", e);
        cp_free(&c);
    }
    int same = memcmp(o[0], o[1], NL * Q * sizeof(float)) == 0;
    snprintf(name, sizeof name, "cp%d_ring_forward_same_bits_as_allgather_T%d_NKV%d", cp, T, NKV);
    check(name, same, "same bits (1) or not (0)", same);
    free(o[0]), free(o[1]), free(L), free(d), free(rl), free(lq), free(ld), free(ro), free(rd);
    free(qkv), free(dout), free(out), free(lse), free(dqkv);
}

/* The logits (B 2 Tc, Vp) of this rank's rows from a forward without
 * targets of model `s` under cp (cp_attach over the world), and the one-rank
 * reference's (B T, Vp) on the same tokens and weights. */
static void positions(const char *what, ArchSpec s, int zero_wte, CpMode mode) {
    int cp = W, B = 2, T = s.seq_len, Tc = T / (2 * cp);
    arch_resolve(&s);
    int Vp = s.padded_vocab;
    int32_t *tok = xmalloc((size_t)B * T * sizeof(int32_t));
    Rng rng;
    rng_seed(&rng, 5);
    for (int i = 0; i < B * T; i++) tok[i] = (int32_t)rng_below(&rng, (uint64_t)s.vocab_size);
    Model ref, m;
    model_init(&ref, be, &s, NULL);
    model_init(&m, be, &s, &(ModelOptions){.cp = cp, .cp_rank = R});
    model_init_weights(&ref, 3);
    model_init_weights(&m, 3);
    if (zero_wte) { /* no token signal: the logits are a function of the position */
        int i = model_tensor_index(&ref, -1, ROLE_TOK_EMB, -1);
        be->zero(ref.pview[i], ref.params[i].numel * sizeof(float));
        be->zero(m.pview[i], m.params[i].numel * sizeof(float));
    } else {
        /* sharp attention (q, k weights x 30: scores of ~10), so that the
         * rotations, which change only the scores, show in the logits */
        for (int l = 0; l < s.n_layer; l++)
            for (int role = ROLE_QKV_W; role <= ROLE_K_W; role++) {
                int i = model_tensor_index(&ref, l, role, -1);
                for (size_t j = 0; j < ref.params[i].numel; j++) ref.pview[i][j] *= 30.0f, m.pview[i][j] *= 30.0f;
            }
    }
    model_plan_activations(&ref, B, T, MODEL_RECOMPUTE_NONE);
    model_plan_activations(&m, B, T, MODEL_RECOMPUTE_NONE);
    Cp c = {0};
    if (cp > 1) {
        AttnShape cap = {B, 2 * Tc, m.shape.n_head, m.shape.n_kv_head, m.shape.head_dim};
        cp_init(&c, be, comm_world(), mode, &cap);
        cp_attach(&c, &m);
    }
    model_forward(&ref, tok, NULL, B, T, 0.0f);
    model_forward(&m, tok, NULL, B, T, 0.0f);
    const float *lr = ref.logits, *lm = m.logits; /* CPU backend: host memory, fp32 */
    size_t n = (size_t)B * 2 * Tc * Vp;
    float *want = xmalloc(n * sizeof(float));
    for (int k = 0; k < 2; k++) /* the reference's rows at this rank's positions, chunk-major (cp 1: all, in order) */
        for (int b = 0; b < B; b++)
            memcpy(want + ((size_t)k * B + b) * Tc * Vp,
                   lr + ((size_t)b * T + (cp > 1 ? model_cp_chunk(cp, R, k) : k) * Tc) * Vp, (size_t)Tc * Vp * sizeof(float));
    if (cp == 1) memcpy(want, lr, n * sizeof(float));
    char name[128];
    double e = max_rel(lm, want, n);
    snprintf(name, sizeof name, "cp%d_%s_positions_%s_logits", cp, cp_mode_name(mode), what);
    check(name, e <= TOL, "max relative error of the logits at global positions", e);
    if (cp > 1) {
        /* The counterfactual: every rank on its local positions 0 .. 2 Tc - 1.
         * The table's rows at its global positions get those of its local
         * ones (wpe, or RoPE's cos | sin), and the forward runs again; it
         * must miss the reference by far more than the tolerance. */
        int pi = model_tensor_index(&m, -1, ROLE_POS_EMB, -1);
        float *tab = pi >= 0 ? m.pview[pi] : m.rope;
        size_t w = pi >= 0 ? (size_t)s.n_embd : (size_t)s.head_dim; /* floats per position */
        float *orig = xmalloc((size_t)T * w * sizeof(float));
        memcpy(orig, tab, (size_t)T * w * sizeof(float));
        for (int k = 0; k < 2; k++)
            memcpy(tab + (size_t)model_cp_chunk(cp, R, k) * Tc * w, orig + (size_t)k * Tc * w, (size_t)Tc * w * sizeof(float));
        model_params_changed(&m);
        model_forward(&m, tok, NULL, B, T, 0.0f);
        double d = max_rel(lm, want, n);
        snprintf(name, sizeof name, "cp%d_%s_positions_%s_local_would_fail", cp, cp_mode_name(mode), what);
        check(name, d > 100 * TOL, "max relative error of the logits with local positions (must exceed 1e-3)", d);
        free(orig);
    }
    cp_free(&c);
    model_free(&m);
    model_free(&ref);
    free(tok), free(want);
}

int main(void) {
    comm_init(120);
    R = comm_info()->rank, W = comm_info()->world;
    be->init(1);
    /* chunks of 7, 37 and 70 tokens: T = 2 cp Tc is no multiple of the
     * CPU's 64-row blocks or CUDA's 32/64 tiles; 70 spans two CPU blocks */
    run(2, 7, 6, 2, 10);  /* GQA: groups of 3 */
    run(1, 37, 4, 4, 8);  /* multi-head */
    run(1, 70, 6, 1, 10); /* multi-query */
    /* positions: sequences of 2 cp x 6 tokens (every rank's second chunk is
     * past the first 2 Tc positions) */
    int T = 12 * W;
    for (int mode = 0; mode < 2; mode++) {
        ArchSpec gpt2 = ARCH_GPT2_SHAPE(2, 2, 16, T, 37);
        gpt2.tie_embeddings = 0; /* a head of its own: zero token embeddings leave it */
        positions("gpt2_wpe", gpt2, 1, (CpMode)mode);
        positions("llama_rope", (ArchSpec){.family = ARCH_LLAMA, .n_layer = 2, .n_head = 4, .n_kv_head = 2,
                                           .n_embd = 32, .seq_len = T, .vocab_size = 37, .norm = NORM_RMSNORM,
                                           .pos = POS_ROPE, .rope_theta = 10000, .mlp = MLP_SWIGLU,
                                           .ffn_hidden = 40},
                  0, (CpMode)mode);
    }
    be->shutdown();
    comm_finalize();
    return 0;
}
