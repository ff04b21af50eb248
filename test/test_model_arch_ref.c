/* test_model_arch_ref: holds kiln's fp32 Llama and MoE block graphs on the CPU
 * backend to independent references (test/ref/<name>_ref.bin, KILNARC1
 * format): the float64 hand-written ones from gen_arch_ref.py (logits, loss,
 * MoE aux and z, every gradient, six clipped AdamW steps) and HuggingFace's
 * own fp32 Llama (hf_llama_ref.bin: logits, loss, gradients). Never
 * regenerates a fixture; never edits the model under test. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "model.h" /* first: the ArchSpec-built model's model.h includes arch.h */
#include "ref_reader.h"
#include "test.h"
#include "util.h"

/* Until model.h builds from an ArchSpec (it then includes arch.h), this test
 * only says so, so the suite keeps building. */
#ifndef KILN_ARCH_H
int main(void) {
    printf("skip arch_ref: model.h does not build from an ArchSpec yet\n");
    return 0;
}
#else

#define ARC_MAX_TENSORS 128

_Static_assert(sizeof(ArchFamily) == sizeof(int) && sizeof(ArchMlp) == sizeof(int), "enum fields are ints");

/* The fixture, parsed. Arrays are aligned copies that f.r owns. */
typedef struct ArcFixture {
    RefReader r; /* the file and the copies of its arrays */
    ArchSpec spec;
    int B, T, n_steps, decay_embeddings, dropped_slots;
    float lr, beta1, beta2, eps, weight_decay, grad_clip;
    int num_tensors;
    char names[ARC_MAX_TENSORS][64];
    int ndim[ARC_MAX_TENSORS], shape[ARC_MAX_TENSORS][2];
    size_t numel[ARC_MAX_TENSORS];
    const float *params[ARC_MAX_TENSORS];
    const int32_t *tokens, *targets; /* (B,T) */
    const float *logits;             /* (B,T,Vp) */
    double loss, aux, z;             /* mean CE; MoE aux and z summed over layers */
    const float *grads[ARC_MAX_TENSORS];
    const double *step_losses, *grad_norms; /* (n_steps) */
    const float *final[ARC_MAX_TENSORS];    /* n_steps > 0 only */
} ArcFixture;

/* Header keys: an ArchSpec field or a run field of the fixture. */
typedef struct ArcKey {
    const char *name;
    char kind; /* 'i' int32, 'f' float32 */
    int in_spec;
    size_t offset;
} ArcKey;

#define SPEC_I(field) {#field, 'i', 1, offsetof(ArchSpec, field)}
#define SPEC_F(field) {#field, 'f', 1, offsetof(ArchSpec, field)}
#define RUN_I(field) {#field, 'i', 0, offsetof(ArcFixture, field)}
#define RUN_F(field) {#field, 'f', 0, offsetof(ArcFixture, field)}
static const ArcKey arc_keys[] = {
    SPEC_I(family), SPEC_I(n_layer), SPEC_I(n_head), SPEC_I(n_kv_head), SPEC_I(head_dim), SPEC_I(n_embd),
    SPEC_I(seq_len), SPEC_I(vocab_size), SPEC_I(padded_vocab), SPEC_I(ffn_hidden), SPEC_I(norm),
    SPEC_F(norm_eps), SPEC_I(pos), SPEC_F(rope_theta), SPEC_I(rope_scaling.on), SPEC_F(rope_scaling.factor),
    SPEC_F(rope_scaling.low_freq_factor), SPEC_F(rope_scaling.high_freq_factor),
    SPEC_I(rope_scaling.original_context), SPEC_I(qk_norm), SPEC_I(mlp), SPEC_I(bias), SPEC_I(tie_embeddings),
    SPEC_I(moe.n_experts), SPEC_I(moe.top_k), SPEC_I(moe.n_shared), SPEC_I(moe.expert_hidden),
    SPEC_I(moe.sigmoid), SPEC_I(moe.norm_topk), SPEC_F(moe.capacity_factor), SPEC_F(moe.aux_loss_coef),
    SPEC_F(moe.z_loss_coef), SPEC_F(moe.bias_update_rate),
    RUN_I(B), RUN_I(T), RUN_I(n_steps), RUN_I(decay_embeddings), RUN_I(dropped_slots), RUN_F(lr),
    RUN_F(beta1), RUN_F(beta2), RUN_F(eps), RUN_F(weight_decay), RUN_F(grad_clip),
};

static void arc_free(ArcFixture *f) {
    rr_free(&f->r);
    memset(f, 0, sizeof *f);
}

/* One header key into the spec or the fixture; -1 on an unknown name. */
static int arc_set_key(ArcFixture *f, const char *name, char kind, const void *val) {
    for (size_t i = 0; i < sizeof arc_keys / sizeof arc_keys[0]; i++) {
        const ArcKey *k = &arc_keys[i];
        if (strcmp(k->name, name) != 0 || k->kind != kind) continue;
        char *base = k->in_spec ? (char *)&f->spec : (char *)f;
        memcpy(base + k->offset, val, 4); /* int32 into int/enum, float32 into float */
        return 0;
    }
    return -1;
}

/* 0 on success; on failure `why` says what was wrong. Format: test/ref/README.md. */
static int arc_load(ArcFixture *f, const char *path, char *why, size_t why_len) {
    memset(f, 0, sizeof *f);
    f->r.blob = kiln_read_file(path, &f->r.len);
    if (!f->r.blob) {
        snprintf(why, why_len, "cannot read %s (run from the repo root; regenerate with "
                 "/usr/bin/python3 test/ref/gen_arch_ref.py)", path);
        return -1;
    }
    const void *magic = rr_take(&f->r, 8);
    if (!magic || memcmp(magic, "KILNARC1", 8) != 0) {
        snprintf(why, why_len, "%s: bad magic, expected KILNARC1", path);
        return -1;
    }
    int n_keys;
    if (rr_take_i32(&f->r, &n_keys) || n_keys < 1 || n_keys > 256) goto truncated;
    for (int i = 0; i < n_keys; i++) {
        int name_len;
        char name[64], kind;
        if (rr_take_i32(&f->r, &name_len) || name_len < 1 || name_len >= (int)sizeof name) goto truncated;
        const char *p = rr_take(&f->r, (size_t)name_len + 1 + 4);
        if (!p) goto truncated;
        memcpy(name, p, (size_t)name_len);
        name[name_len] = '\0';
        kind = p[name_len];
        if (arc_set_key(f, name, kind, p + name_len + 1)) {
            snprintf(why, why_len, "%s: unknown header key %s (kind %c)", path, name, kind);
            return -1;
        }
    }
    if (rr_take_i32(&f->r, &f->num_tensors) || f->num_tensors < 1 || f->num_tensors > ARC_MAX_TENSORS ||
        f->B < 1 || f->T < 1 || f->n_steps < 0) {
        snprintf(why, why_len, "%s: implausible header (num_tensors=%d B=%d T=%d n_steps=%d)", path,
                 f->num_tensors, f->B, f->T, f->n_steps);
        return -1;
    }
    for (int i = 0; i < f->num_tensors; i++) {
        int name_len;
        if (rr_take_i32(&f->r, &name_len) || name_len < 1 || name_len >= 64) goto truncated;
        const void *name = rr_take(&f->r, (size_t)name_len);
        if (!name) goto truncated;
        memcpy(f->names[i], name, (size_t)name_len);
        f->names[i][name_len] = '\0';
        if (rr_take_i32(&f->r, &f->ndim[i]) || f->ndim[i] < 1 || f->ndim[i] > 2) goto truncated;
        f->numel[i] = 1;
        f->shape[i][1] = 1;
        for (int d = 0; d < f->ndim[i]; d++) {
            if (rr_take_i32(&f->r, &f->shape[i][d]) || f->shape[i][d] < 1) goto truncated;
            f->numel[i] *= (size_t)f->shape[i][d];
        }
        if (!(f->params[i] = rr_take_array(&f->r, f->numel[i] * sizeof(float)))) goto truncated;
    }
    size_t N = (size_t)f->B * f->T;
    if (!(f->tokens = rr_take_array(&f->r, N * sizeof(int32_t)))) goto truncated;
    if (!(f->targets = rr_take_array(&f->r, N * sizeof(int32_t)))) goto truncated;
    if (!(f->logits = rr_take_array(&f->r, N * f->spec.padded_vocab * sizeof(float)))) goto truncated;
    const void *l = rr_take(&f->r, 3 * sizeof(double));
    if (!l) goto truncated;
    memcpy(&f->loss, l, sizeof(double));
    memcpy(&f->aux, (const char *)l + 8, sizeof(double));
    memcpy(&f->z, (const char *)l + 16, sizeof(double));
    for (int i = 0; i < f->num_tensors; i++)
        if (!(f->grads[i] = rr_take_array(&f->r, f->numel[i] * sizeof(float)))) goto truncated;
    if (!(f->step_losses = rr_take_array(&f->r, (size_t)f->n_steps * sizeof(double)))) goto truncated;
    if (!(f->grad_norms = rr_take_array(&f->r, (size_t)f->n_steps * sizeof(double)))) goto truncated;
    for (int i = 0; f->n_steps > 0 && i < f->num_tensors; i++)
        if (!(f->final[i] = rr_take_array(&f->r, f->numel[i] * sizeof(float)))) goto truncated;
    if (f->r.pos != f->r.len) {
        snprintf(why, why_len, "%s: %zu trailing bytes", path, f->r.len - f->r.pos);
        return -1;
    }
    return 0;
truncated:
    snprintf(why, why_len, "%s: truncated at byte %zu of %zu", path, f->r.pos, f->r.len);
    return -1;
}

/* kiln's table against the fixture's: same names in the same (listing)
 * order, same shapes; decay exactly on the 2-D tensors, all of them inside
 * [0, num_decay) where the optimizer decays. 0 on success. */
static int arc_check_layout(const Model *m, const ArcFixture *f, char *why, size_t why_len) {
    if (m->num_tensors != f->num_tensors) {
        snprintf(why, why_len, "kiln has %d tensors, the fixture %d", m->num_tensors, f->num_tensors);
        return -1;
    }
    for (int i = 0; i < f->num_tensors; i++) {
        const ParamInfo *pi = &m->params[i];
        if (strcmp(pi->name, f->names[i]) != 0) {
            snprintf(why, why_len, "tensor %d: kiln %s, fixture %s", i, pi->name, f->names[i]);
            return -1;
        }
        if (pi->ndim != f->ndim[i] || pi->shape[0] != f->shape[i][0] ||
            (pi->ndim == 2 && pi->shape[1] != f->shape[i][1]) || pi->numel != f->numel[i]) {
            snprintf(why, why_len, "%s: kiln shape (%d,%d) ndim %d, fixture (%d,%d) ndim %d", pi->name,
                     pi->shape[0], pi->ndim == 2 ? pi->shape[1] : 0, pi->ndim, f->shape[i][0],
                     f->ndim[i] == 2 ? f->shape[i][1] : 0, f->ndim[i]);
            return -1;
        }
        int in_decay_range = pi->offset + pi->numel <= m->num_decay;
        if (pi->decay != (pi->ndim == 2) || in_decay_range != pi->decay) {
            snprintf(why, why_len, "%s: decay=%d ndim=%d offset=%zu num_decay=%zu", pi->name, pi->decay,
                     pi->ndim, pi->offset, m->num_decay);
            return -1;
        }
    }
    return 0;
}

/* The fixture's tensors (initial or final set) into the model's arena. */
static void arc_set_params(Model *m, const ArcFixture *f, const float *const *vals, float *host) {
    for (int i = 0; i < f->num_tensors; i++)
        memcpy(host + m->params[i].offset, vals[i], f->numel[i] * sizeof(float));
    model_params_from_host(m, host);
}

/* One optimizer step as test_model_ref.c (and train.c) does it: forward +
 * backward, clip by global norm, AdamW over the decayed range and the rest.
 * Returns the CE before the update; *norm gets the unclipped grad norm. */
static float arc_adamw_step(Model *m, float *opt_m, float *opt_v, const ArcFixture *f, int t, double *norm) {
    const Backend *be = m->be;
    float loss = model_forward(m, f->tokens, f->targets, f->B, f->T, 1.0f / (float)(f->B * f->T));
    model_backward(m, 0);
    double total = sqrt(be->sumsq(m->grad_mem, m->num_params));
    float scale = (float)fmin(1.0, f->grad_clip / (total + 1e-6));
    *norm = total;
    size_t nd = m->num_decay, nr = m->num_params - m->num_decay;
    be->adamw_update(m->param_mem, m->grad_mem, opt_m, opt_v, nd, f->lr, f->beta1, f->beta2, f->eps,
                     f->weight_decay, scale, t, NULL, NULL);
    be->adamw_update(m->param_mem + nd, m->grad_mem + nd, opt_m + nd, opt_v + nd, nr, f->lr, f->beta1, f->beta2,
                     f->eps, 0.0f, scale, t, NULL, NULL);
    return loss;
}

static double max_abs_diff(const float *a, const float *ref, size_t n) {
    double w = 0.0;
    for (size_t i = 0; i < n; i++) w = fmax(w, fabs((double)a[i] - (double)ref[i]));
    return w;
}

static double rel_diff(double a, double ref) { return fabs(a - ref) / fmax(fabs(ref), 1e-30); }

static int verbose;
#define NOTE(...) (verbose ? printf(__VA_ARGS__) : 0)

/* Bounds for one fixture; see the table in main. */
typedef struct ArcTol {
    double logits, loss, moe_rel, grad_rel, step_rel, final;
} ArcTol;

/* Tolerances. Against the float64 references every difference is kiln's
 * fp32 rounding from identical float32 parameters; the bounds are those of
 * test_model_ref.c, whose GPT-2 errors were measured (logits 9e-8, loss 2e-7,
 * gradients 5.5e-7 relative, step values 5e-8, final params 7e-7) and set
 * ~10x above, since these graphs are as deep (two layers of O(1)
 * activations, |logits| < 1) and add only elementwise ops (RMSNorm, RoPE,
 * SwiGLU, router softmax/sigmoid) that each cost an ulp or two:
 * - logits 1e-6 abs; loss (~4.1) 2e-6 abs.
 * - aux (~2-6) and z (~25-30), sums over two layers of means over 48 tokens:
 *   relative 1e-6 (~10 ulp). A routing difference (another expert chosen)
 *   moves aux by >1e-3: the fixtures' top-k margins are >= 4e-4 in prob.
 * - gradients, per tensor max|diff| / max|ref|: 5e-6. An expert that no slot
 *   reaches has an exactly zero gradient on both sides (rel 0).
 * - step losses and unclipped norms, relative: 1e-6.
 * - final params, abs: 5e-6 (a missing weight decay moves a 0.02 weight by
 *   6 lr 0.1 0.02 = 1.2e-5; a wrong bias correction moves every element by
 *   ~5e-4). No tensor here has an identically zero true gradient (no biases),
 *   so AdamW's amplification of fp32 noise (the GPT-2 key bias) does not arise.
 * Against HF fp32 (hf_llama_ref.bin) both sides are fp32 with different
 * summation orders, each ~1e-7 from the truth on O(1) values: bounds 2x the
 * float64 ones (logits 2e-6, loss 4e-6, gradients 1e-5); a real mismatch
 * (RoPE layout, eps, GQA mapping) moves logits by >1e-3. */
static const ArcTol tol_f64 = {.logits = 1e-6, .loss = 2e-6, .moe_rel = 1e-6, .grad_rel = 5e-6,
                               .step_rel = 1e-6, .final = 5e-6};
static const ArcTol tol_hf32 = {.logits = 2e-6, .loss = 4e-6, .moe_rel = 1e-6, .grad_rel = 1e-5,
                                .step_rel = 1e-6, .final = 5e-6};

static void arc_run(const char *stem, const ArcTol *tol) {
    char path[128], name[128], why[256];
    snprintf(path, sizeof path, "test/ref/%s_ref.bin", stem);
    ArcFixture f;
#define NAME(check) (snprintf(name, sizeof name, "arch_ref_%s_%s", stem, check), name)
    if (arc_load(&f, path, why, sizeof why)) {
        test_report(0, NAME("fixture"), "%s", why);
        arc_free(&f);
        return;
    }
    ArchSpec s = f.spec;
    int fixture_vp = s.padded_vocab;
    s.padded_vocab = 0; /* derived: kiln must pad the same way */
    arch_resolve(&s);
    if (s.padded_vocab != fixture_vp) {
        test_report(0, NAME("fixture"), "kiln pads vocab %d to %d, the fixture to %d", s.vocab_size,
                    s.padded_vocab, fixture_vp);
        arc_free(&f);
        return;
    }
    const Backend *be = &backend_cpu;
    Model m;
    model_init(&m, be, &s, &(ModelOptions){.decay_embeddings = f.decay_embeddings});
    int B = f.B, T = f.T, Vp = s.padded_vocab, V = s.vocab_size, N = B * T, C = s.n_embd;
    model_plan_activations(&m, B, T, MODEL_RECOMPUTE_NONE);
    int layout_ok = arc_check_layout(&m, &f, why, sizeof why) == 0;
    test_report(layout_ok, NAME("layout"), "%s", why);
    if (!layout_ok) {
        model_free(&m);
        arc_free(&f);
        return;
    }
    float *host = xmalloc(m.num_params * sizeof(float));
    memset(host, 0, m.num_params * sizeof(float));
    arc_set_params(&m, &f, f.params, host);

    /* logits: forward without targets */
    model_forward(&m, f.tokens, NULL, B, T, 0.0f);
    float *row = xmalloc((size_t)Vp * sizeof(float));
    double worst_logit = 0.0;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            model_logits_row(&m, b, t, row);
            worst_logit = fmax(worst_logit, max_abs_diff(row, f.logits + ((size_t)b * T + t) * Vp, (size_t)Vp));
        }
    NOTE("# %s logits max abs err %.3e\n", stem, worst_logit);
    test_report(worst_logit < tol->logits, NAME("logits"), "max abs err %.3e (tol %.0e)", worst_logit,
                tol->logits);

    /* loss, MoE aux and z */
    float loss = model_forward(&m, f.tokens, f.targets, B, T, 1.0f / (float)N);
    double loss_err = fabs((double)loss - f.loss);
    NOTE("# %s loss %.8f ref %.8f err %.3e\n", stem, loss, f.loss, loss_err);
    test_report(loss_err < tol->loss, NAME("loss"), "kiln %.8f ref %.8f err %.3e (tol %.0e)", loss, f.loss,
                loss_err, tol->loss);
    if (s.mlp == MLP_MOE) {
        double ea = rel_diff(m.moe.aux, f.aux), ez = rel_diff(m.moe.z, f.z);
        NOTE("# %s aux %.8f ref %.8f (rel %.2e) z %.8f ref %.8f (rel %.2e); ref dropped slots %d\n", stem,
             (double)m.moe.aux, f.aux, ea, (double)m.moe.z, f.z, ez, f.dropped_slots);
        test_report(ea < tol->moe_rel && ez < tol->moe_rel, NAME("moe_losses"),
                    "aux %.8f ref %.8f rel %.2e, z %.8f ref %.8f rel %.2e (tol %.0e)", (double)m.moe.aux, f.aux,
                    ea, (double)m.moe.z, f.z, ez, tol->moe_rel);
    }

    /* gradients of the objective */
    model_backward(&m, 0);
    float *grads = xmalloc(m.num_params * sizeof(float));
    be->to_host(grads, m.grad_mem, m.num_params * sizeof(float));
    double worst_grad = 0.0;
    int worst_i = 0, pad_nonzero = 0;
    for (int i = 0; i < m.num_tensors; i++) {
        const ParamInfo *pi = &m.params[i];
        double ref_max = 0.0;
        for (size_t k = 0; k < pi->numel; k++) ref_max = fmax(ref_max, fabs((double)f.grads[i][k]));
        double err = max_abs_diff(grads + pi->offset, f.grads[i], pi->numel);
        double rel = ref_max > 0.0 ? err / ref_max : (err > 0.0 ? INFINITY : 0.0);
        NOTE("# %s grad %-40s rel err %.3e (max|ref| %.3e)\n", stem, pi->name, rel, ref_max);
        if (rel > worst_grad) worst_grad = rel, worst_i = i;
        /* padded vocab rows see zero dlogits and no tokens: exactly zero */
        if (!strcmp(pi->name, "embed_tokens.weight") || !strcmp(pi->name, "lm_head.weight"))
            for (size_t k = (size_t)V * C; k < pi->numel; k++) pad_nonzero |= grads[pi->offset + k] != 0.0f;
    }
    test_report(worst_grad < tol->grad_rel && !pad_nonzero, NAME("grads"), "worst %s rel err %.3e (tol %.0e)%s",
                m.params[worst_i].name, worst_grad, tol->grad_rel,
                pad_nonzero ? "; padded vocab rows have nonzero gradient" : "");

    if (f.n_steps > 0) {
        float *opt_m = be->alloc(m.num_params * sizeof(float));
        float *opt_v = be->alloc(m.num_params * sizeof(float));
        be->zero(opt_m, m.num_params * sizeof(float));
        be->zero(opt_v, m.num_params * sizeof(float));
        double worst_step = 0.0, worst_norm = 0.0;
        for (int t = 1; t <= f.n_steps; t++) {
            double norm;
            float l = arc_adamw_step(&m, opt_m, opt_v, &f, t, &norm);
            double le = rel_diff(l, f.step_losses[t - 1]), ne = rel_diff(norm, f.grad_norms[t - 1]);
            NOTE("# %s step %d loss %.8f (ref %.8f, rel %.2e) norm %.8f (ref %.8f, rel %.2e)\n", stem, t, l,
                 f.step_losses[t - 1], le, norm, f.grad_norms[t - 1], ne);
            worst_step = fmax(worst_step, le);
            worst_norm = fmax(worst_norm, ne);
        }
        test_report(worst_step < tol->step_rel && worst_norm < tol->step_rel, NAME("adamw_losses"),
                    "loss rel err %.3e, grad norm rel err %.3e (tol %.0e)", worst_step, worst_norm, tol->step_rel);
        model_params_to_host(&m, host);
        double worst_final = 0.0;
        int worst_fi = 0;
        for (int i = 0; i < m.num_tensors; i++) {
            double e = max_abs_diff(host + m.params[i].offset, f.final[i], m.params[i].numel);
            NOTE("# %s final %-40s max abs err %.3e\n", stem, m.params[i].name, e);
            if (e > worst_final) worst_final = e, worst_fi = i;
        }
        test_report(worst_final < tol->final, NAME("adamw_params"), "worst %s max abs err %.3e (tol %.0e)",
                    m.params[worst_fi].name, worst_final, tol->final);
        be->free(opt_m);
        be->free(opt_v);
    }
#undef NAME
    free(grads);
    free(row);
    free(host);
    model_free(&m);
    arc_free(&f);
}

int main(void) {
    verbose = getenv("KILN_TEST_VERBOSE") != NULL;
    backend_cpu.init(0);
    arc_run("llama", &tol_f64);
    arc_run("llama_qknorm", &tol_f64);
    arc_run("moe", &tol_f64);
    arc_run("moe_sigmoid", &tol_f64);
    arc_run("hf_llama", &tol_hf32);
    backend_cpu.shutdown();
    return 0;
}
#endif /* KILN_ARCH_H */
