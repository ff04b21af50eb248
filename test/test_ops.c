/* test_ops: every op of a Backend against a double-precision reference written
 * here: forward values, backward against central finite differences of that
 * reference, and the accumulate / "+=" contracts of backend.h. Takes any
 * Backend (names ops_<backend>_<op>_<check>), so the CUDA backend reuses it;
 * the bf16 table also runs here on emu_bf16 (the CPU ops behind bf16
 * storage, test/emu_bf16.h), so its conversions and tolerances are
 * exercised before a GPU runs them. */
#include "backend.h"
#include "emu_bf16.h"
#include "fused_compose.h"
#include "test.h"
#include "util.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------
 * Tolerances, each relative to the scale (max |reference|) of the tensor checked.
 *
 * TOL_FWD 1e-5: an fp32 kernel against the double reference. Each output is a
 *   short chain of float ops (sums of <= ~40 terms here, exp, sqrt), each with
 *   rounding 6e-8, so errors of ~1e-6 are expected; 1e-5 leaves a 10x margin
 *   and still catches any wrong index or formula (errors of O(1)).
 * TOL_BWD 1e-4: fp32 backward against finite differences of the double
 *   reference. The differences themselves are good to ~1e-9 (eps = 1e-5 in
 *   double: truncation eps^2 ~ 1e-10, rounding 1e-16 / eps ~ 1e-11), but the
 *   float kernels subtract nearly equal terms (layernorm: dnorm - mean(dnorm)
 *   - norm * mean(dnorm * norm); attention: p (dp - D)), which magnifies their
 *   rounding 10-100x over the forward's.
 * TOL_ACC 1e-6: a second call with accumulate = 1 must give twice the first.
 *   Not bit-exact: the second call adds its terms one by one into the old
 *   value ((g + x) + y rather than 2 (x + y)), a few roundings of 6e-8.
 * TOL_LARGE 1e-4: attention with scores near -200: each score carries float
 *   rounding ulp(200) ~ 1.5e-5 into exp, so errors of a few 1e-6 are real
 *   (measured 3.5e-6); a missing max-subtraction gives O(1) errors.
 * TOL_ADAM 1e-6: AdamW in float against double, compared on p, m, v: a few
 *   roundings of each (~6e-8) per element.
 * TOL_ADAM_DELTA 1e-4: the update p_new - p_old compared with the double one.
 *   It is ~lr relative to p, so the rounding of p (6e-8 |p|) becomes ~1e-5 of
 *   the update at lr = 1e-2.
 * TOL_SUMSQ 1e-10: double accumulation of 1e5 exactly representable squares:
 *   error <= n * 2^-53 ~ 1e-11.
 * The CUDA backend runs the table twice: with precision "fp32" under these
 * same tolerances (activations fp32, its kernels fp32 and cuBLASLt strictly
 * fp32), then with precision "bf16" (activations stored in bf16) every op
 * that has activation tensors, under TOL_BF16_SCALE times them (names
 * ops_cuda_bf16_*). Inputs of the activation dtype are rounded to it on the
 * host first (quant), so the double reference sees what the kernel reads.
 * TOL_BF16_SCALE 1e3: the math stays fp32, so the error is the rounding of
 *   each bf16 store, up to 2^-9 = 2e-3 of the value (8 significant bits),
 *   plus what one rounded intermediate does downstream (attention's backward
 *   reads the bf16 forward output in D = rowsum(dO * O), then subtracts
 *   nearly equal terms). 1e3 x TOL_FWD = 1e-2 (forward), 1e3 x TOL_BWD = 0.1
 *   (backward vs finite differences): loose, yet a wrong index or formula
 *   still errs by O(1). fp32 tensors (parameter gradients, statistics) only
 *   carry the bf16 rounding of the activations they are made from.
 * Checks marked "exact" stay exact on every backend (the add's reference is
 *   rounded to the activation dtype once, as the op's store is). */
#define TOL_FWD 1e-5
#define TOL_BWD 1e-4
#define TOL_ACC 1e-6
#define TOL_LARGE 1e-4
#define TOL_ADAM 1e-6
#define TOL_ADAM_DELTA 1e-4
#define TOL_SUMSQ 1e-10
#define FD_EPS 1e-5
#define TOL_BF16_SCALE 1e3
/* TOL_GELU_EPI 5e-3: the optional fused matmul + GeLU ops, whose GeLU may be
 * a library's own (cuBLASLt's epilogue: formula and precision undocumented;
 * a hardware tanh would err up to ~1e-3 of the max, test_backend_cross.c
 * says why). Checked unscaled: with bf16 the larger of it and the scaled
 * TOL_FWD / TOL_BWD applies. */
#define TOL_GELU_EPI 5e-3

static const Backend *be;
static double tol_scale = 1.0;
static const char *label; /* backend name in check names, e.g. "cuda_bf16" */
static Rng rng;

/* ---------------------------------------------------------------------------
 * Buffers: host scratch and device buffers live until the end of one op test. */

#define MAX_BUFS 64
static void *host_bufs[MAX_BUFS], *dev_bufs[MAX_BUFS];
static int n_host, n_dev;

static void *hbuf(size_t bytes) {
    if (n_host == MAX_BUFS) kiln_fail(KILN_EXIT_RUNTIME, "test_ops: too many host buffers");
    return host_bufs[n_host++] = xcalloc(1, bytes ? bytes : 1);
}
static float *hf(size_t n) { return hbuf(n * sizeof(float)); }
static double *hd(size_t n) { return hbuf(n * sizeof(double)); }

static void *dbuf(const void *host, size_t bytes) {
    if (n_dev == MAX_BUFS) kiln_fail(KILN_EXIT_RUNTIME, "test_ops: too many device buffers");
    void *d = dev_bufs[n_dev++] = be->alloc(bytes ? bytes : 1);
    if (host && bytes) be->to_device(d, host, bytes);
    return d;
}
static float *df(const float *host, size_t n) { return dbuf(host, n * sizeof(float)); }
static void down(float *host, const float *dev, size_t n) {
    be->sync();
    be->to_host(host, dev, n * sizeof(float));
}

/* Tensors of the activation dtype (backend.h: ab bytes each, fp32 or bf16).
 * Inputs are rounded to it on the host first (quant), so the double
 * reference sees exactly the values the op reads; da uploads converted, down_a
 * converts back. With fp32 all three are plain copies. */
static size_t ab;
static float *quant(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = backend_act_round(x[i], ab);
    return x;
}
static void *da(const float *host, size_t n) {
    void *d = dbuf(NULL, n * ab);
    if (host && n) {
        void *h = hbuf(n * ab);
        backend_f32_to_act(h, host, n, ab);
        be->to_device(d, h, n * ab);
    }
    return d;
}
static void down_a(float *host, const void *dev, size_t n) {
    void *h = hbuf(n * ab);
    be->sync();
    be->to_host(h, dev, n * ab);
    backend_act_to_f32(host, h, n, ab);
}

static void bufs_free(void) {
    while (n_host) free(host_bufs[--n_host]);
    while (n_dev) be->free(dev_bufs[--n_dev]);
}

static float *randn(size_t n, float scale, float offset) {
    float *x = hf(n);
    for (size_t i = 0; i < n; i++) x[i] = offset + scale * rng_normal(&rng);
    return x;
}
static float *filled(size_t n, float v) {
    float *x = hf(n);
    for (size_t i = 0; i < n; i++) x[i] = v;
    return x;
}
static double *to_d(const float *x, size_t n) {
    double *d = hd(n);
    for (size_t i = 0; i < n; i++) d[i] = x[i];
    return d;
}

/* ---------------------------------------------------------------------------
 * Comparisons and reporting */

/* max |got - ref| / max |ref|; infinite if got holds a NaN. */
static double err_rel(const float *got, const double *ref, size_t n) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - ref[i]);
        if (isnan(d)) return INFINITY;
        num = d > num ? d : num;
        den = fabs(ref[i]) > den ? fabs(ref[i]) : den;
    }
    return num / (den > 0.0 ? den : 1.0);
}
static double maxd(double a, double b) { return isnan(a) || isnan(b) ? INFINITY : a > b ? a : b; }

static void check(const char *op, const char *what, double err, double tol) {
    char name[128];
    snprintf(name, sizeof name, "ops_%s_%s_%s", label, op, what);
    tol *= tol_scale;
    test_report(err <= tol, name, "max relative error %.3g > tolerance %.3g", err, tol);
}
static void check_exact(const char *op, const char *what, int ok, const char *why) {
    char name[128];
    snprintf(name, sizeof name, "ops_%s_%s_%s", label, op, what);
    test_report(ok, name, "%s", why);
}

/* Central differences of a scalar loss over one input array of the reference. */
static void fd_grad(double (*loss)(void *), void *ctx, double *x, size_t n, double *g) {
    for (size_t i = 0; i < n; i++) {
        double save = x[i];
        x[i] = save + FD_EPS;
        double lp = loss(ctx);
        x[i] = save - FD_EPS;
        double lm = loss(ctx);
        x[i] = save;
        g[i] = (lp - lm) / (2.0 * FD_EPS);
    }
}
static double dot_d(const double *a, const double *b, size_t n) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}
/* ref[i] = base[i] + k * g[i], the expected content after "+=". */
static double *plus(const float *base, const double *g, double k, size_t n) {
    double *r = hd(n);
    for (size_t i = 0; i < n; i++) r[i] = (base ? base[i] : 0.0) + k * g[i];
    return r;
}
static double err_twice(const float *second, const float *first, size_t n) {
    double *r = hd(n);
    for (size_t i = 0; i < n; i++) r[i] = 2.0 * first[i];
    return err_rel(second, r, n);
}

/* ---------------------------------------------------------------------------
 * The op table: one small struct per case. */

typedef struct OpTest {
    const char *name; /* op name in the check names, e.g. "layernorm_odd" */
    void (*run)(const struct OpTest *t);
    int B, T, C, NH, V, Vp; /* shapes; elementwise ops use n = B*T*C */
    int fp32_only;          /* 1: no activation tensors (not rerun in bf16) */
    int NKV, HD;            /* kv heads and head width (GQA, RoPE, QK-norm; MoE: HD = expert width) */
    int opt;                /* op-specific: QK-norm per_head; MoE's MOE_* bits */
} OpTest;

/* ---- embed --------------------------------------------------------------- */

typedef struct {
    int B, T, C;
    const int32_t *tok;
    double *wte, *wpe, *R, *out;
} EmbedRef;

static void embed_ref(EmbedRef *e) {
    for (int i = 0; i < e->B * e->T; i++)
        for (int c = 0; c < e->C; c++)
            e->out[(size_t)i * e->C + c] = (e->tok[i] < 0 ? 0.0 : e->wte[(size_t)e->tok[i] * e->C + c]) +
                                           e->wpe[(size_t)(i % e->T) * e->C + c];
}
static double embed_loss(void *ctx) {
    EmbedRef *e = ctx;
    embed_ref(e);
    return dot_d(e->out, e->R, (size_t)e->B * e->T * e->C);
}

static void test_embed(const OpTest *t) {
    int B = t->B, T = t->T, C = t->C, V = t->V, Vp = t->Vp, N = B * T;
    int32_t *tok = hbuf(N * sizeof(int32_t));
    for (int i = 0; i < N; i++) tok[i] = (int32_t)rng_below(&rng, (uint64_t)V);
    tok[N - 1] = tok[0]; /* a repeated token: the scatter must add, not store */
    /* opt: vocabulary-parallel ids, every third token another tp rank's (-1: a zero row) */
    for (int i = 1; t->opt && i < N - 1; i += 3) tok[i] = -1;
    float *wte = quant(randn((size_t)Vp * C, 1.0f, 0.0f), (size_t)Vp * C);
    float *wpe = quant(randn((size_t)T * C, 1.0f, 0.0f), (size_t)T * C);
    float *R = quant(randn((size_t)N * C, 1.0f, 0.0f), (size_t)N * C);
    EmbedRef e = {B, T, C, tok, to_d(wte, (size_t)Vp * C), to_d(wpe, (size_t)T * C),
                  to_d(R, (size_t)N * C), hd((size_t)N * C)};

    void *d_out = da(NULL, (size_t)N * C);
    float *out = hf((size_t)N * C);
    int32_t *d_tok = dbuf(tok, N * sizeof(int32_t));
    void *d_wte = da(wte, (size_t)Vp * C), *d_wpe = da(wpe, (size_t)T * C);
    be->embed_forward(d_out, d_tok, d_wte, d_wpe, B, T, C);
    down_a(out, d_out, (size_t)N * C);
    embed_ref(&e);
    check(t->name, "forward", err_rel(out, e.out, (size_t)N * C), TOL_FWD);

    double *gwte = hd((size_t)Vp * C), *gwpe = hd((size_t)T * C);
    fd_grad(embed_loss, &e, e.wte, (size_t)Vp * C, gwte);
    fd_grad(embed_loss, &e, e.wpe, (size_t)T * C, gwpe);
    float *garbage = randn((size_t)Vp * C, 1.0f, 0.0f); /* dwte always accumulates */
    float *d_dwte = df(garbage, (size_t)Vp * C);
    float *d_dwpe = df(filled((size_t)T * C, NAN), (size_t)T * C); /* accumulate 0 overwrites */
    void *d_R = da(R, (size_t)N * C);
    float *dwte1 = hf((size_t)Vp * C), *dwpe1 = hf((size_t)T * C);
    be->embed_backward(d_dwte, d_dwpe, d_R, d_tok, NULL, B, T, C, 0);
    down(dwte1, d_dwte, (size_t)Vp * C);
    down(dwpe1, d_dwpe, (size_t)T * C);
    check(t->name, "backward_dwte", err_rel(dwte1, plus(garbage, gwte, 1.0, (size_t)Vp * C), (size_t)Vp * C), TOL_BWD);
    check(t->name, "backward_dwpe", err_rel(dwpe1, gwpe, (size_t)T * C), TOL_BWD);

    float *dwte2 = hf((size_t)Vp * C), *dwpe2 = hf((size_t)T * C);
    be->embed_backward(d_dwte, d_dwpe, d_R, d_tok, NULL, B, T, C, 1);
    down(dwte2, d_dwte, (size_t)Vp * C);
    down(dwpe2, d_dwpe, (size_t)T * C);
    check(t->name, "accumulate", err_twice(dwpe2, dwpe1, (size_t)T * C), TOL_ACC);
    check(t->name, "dwte_adds", err_rel(dwte2, plus(garbage, gwte, 2.0, (size_t)Vp * C), (size_t)Vp * C),
          TOL_BWD);
}

/* ---- layernorm ------------------------------------------------------------ */

typedef struct {
    int N, C;
    double *inp, *w, *b, *R, *out, *mean, *rstd;
} LnRef;

static void ln_ref(LnRef *l) {
    for (int i = 0; i < l->N; i++) {
        const double *x = l->inp + (size_t)i * l->C;
        double m = 0.0, v = 0.0;
        for (int c = 0; c < l->C; c++) m += x[c];
        m /= l->C;
        for (int c = 0; c < l->C; c++) v += (x[c] - m) * (x[c] - m);
        double r = 1.0 / sqrt(v / l->C + 1e-5); /* torch.nn.LayerNorm: eps 1e-5, biased */
        for (int c = 0; c < l->C; c++)
            l->out[(size_t)i * l->C + c] = (x[c] - m) * r * l->w[c] + l->b[c];
        l->mean[i] = m;
        l->rstd[i] = r;
    }
}
static double ln_loss(void *ctx) {
    LnRef *l = ctx;
    ln_ref(l);
    return dot_d(l->out, l->R, (size_t)l->N * l->C);
}

static void test_layernorm(const OpTest *t) {
    int N = t->B * t->T, C = t->C;
    size_t NC = (size_t)N * C;
    /* Offset 3: a residual stream with a non-zero mean (tests the variance). */
    float *inp = quant(randn(NC, 1.0f, 3.0f), NC), *w = quant(randn(C, 0.5f, 1.0f), C);
    float *b = quant(randn(C, 0.5f, 0.0f), C), *R = quant(randn(NC, 1.0f, 0.0f), NC);
    LnRef l = {N, C, to_d(inp, NC), to_d(w, C), to_d(b, C), to_d(R, NC), hd(NC), hd(N), hd(N)};
    void *d_inp = da(inp, NC), *d_w = da(w, C), *d_b = da(b, C), *d_out = da(NULL, NC);
    float *d_mean = df(NULL, N), *d_rstd = df(NULL, N);
    float *out = hf(NC), *mean = hf(N), *rstd = hf(N);
    be->layernorm_forward(d_out, d_mean, d_rstd, d_inp, d_w, d_b, N, C, 1e-5f);
    down_a(out, d_out, NC);
    down(mean, d_mean, N);
    down(rstd, d_rstd, N);
    ln_ref(&l);
    check(t->name, "forward", err_rel(out, l.out, NC), TOL_FWD);
    check(t->name, "forward_stats", maxd(err_rel(mean, l.mean, N), err_rel(rstd, l.rstd, N)), TOL_FWD);

    double *ginp = hd(NC), *gw = hd(C), *gb = hd(C);
    fd_grad(ln_loss, &l, l.inp, NC, ginp);
    fd_grad(ln_loss, &l, l.w, C, gw);
    fd_grad(ln_loss, &l, l.b, C, gb);
    float *prior = quant(randn(NC, 1.0f, 0.0f), NC); /* dinp is "+=": the residual gradient */
    void *d_dinp = da(prior, NC), *d_R = da(R, NC);
    float *d_dw = df(filled(C, NAN), C), *d_db = df(filled(C, NAN), C);
    float *dinp1 = hf(NC), *dw1 = hf(C), *db1 = hf(C);
    be->layernorm_backward(d_dinp, d_dw, d_db, d_R, d_inp, d_w, d_mean, d_rstd, N, C, 0);
    down_a(dinp1, d_dinp, NC);
    down(dw1, d_dw, C);
    down(db1, d_db, C);
    /* dinp is checked on the gradient part, dinp - prior, since prior is O(1) too. */
    float *g1 = hf(NC);
    for (size_t i = 0; i < NC; i++) g1[i] = dinp1[i] - prior[i];
    check(t->name, "backward_dinp", err_rel(g1, ginp, NC), TOL_BWD);
    check(t->name, "backward_dparams", maxd(err_rel(dw1, gw, C), err_rel(db1, gb, C)), TOL_BWD);

    float *dinp2 = hf(NC), *dw2 = hf(C), *db2 = hf(C);
    be->layernorm_backward(d_dinp, d_dw, d_db, d_R, d_inp, d_w, d_mean, d_rstd, N, C, 1);
    down_a(dinp2, d_dinp, NC);
    down(dw2, d_dw, C);
    down(db2, d_db, C);
    for (size_t i = 0; i < NC; i++) g1[i] = dinp2[i] - prior[i];
    check(t->name, "accumulate", maxd(err_twice(dw2, dw1, C), err_twice(db2, db1, C)), TOL_ACC);
    check(t->name, "dinp_adds", err_rel(g1, plus(NULL, ginp, 2.0, NC), NC), TOL_BWD);
}

/* ---- matmul --------------------------------------------------------------- */

typedef struct {
    int N, C, OC;
    double *inp, *w, *bias, *R, *out; /* bias NULL: none */
} MmRef;

static void mm_ref(MmRef *m) {
    for (int i = 0; i < m->N; i++)
        for (int o = 0; o < m->OC; o++)
            m->out[(size_t)i * m->OC + o] = dot_d(m->inp + (size_t)i * m->C, m->w + (size_t)o * m->C, m->C) +
                                            (m->bias ? m->bias[o] : 0.0);
}
static double mm_loss(void *ctx) {
    MmRef *m = ctx;
    mm_ref(m);
    return dot_d(m->out, m->R, (size_t)m->N * m->OC);
}

static void test_matmul(const OpTest *t) {
    int N = t->B * t->T, C = t->C, OC = t->V;
    size_t NC = (size_t)N * C, OCC = (size_t)OC * C, NO = (size_t)N * OC;
    float *inp = quant(randn(NC, 1.0f, 0.0f), NC), *w = quant(randn(OCC, 1.0f, 0.0f), OCC);
    float *bias = quant(randn(OC, 1.0f, 0.0f), OC), *R = quant(randn(NO, 1.0f, 0.0f), NO);
    MmRef m = {N, C, OC, to_d(inp, NC), to_d(w, OCC), to_d(bias, OC), to_d(R, NO), hd(NO)};
    void *d_inp = da(inp, NC), *d_w = da(w, OCC), *d_bias = da(bias, OC), *d_out = da(NULL, NO);
    float *out = hf(NO);
    be->matmul_forward(d_out, d_inp, d_w, d_bias, N, C, OC);
    down_a(out, d_out, NO);
    mm_ref(&m);
    check(t->name, "forward", err_rel(out, m.out, NO), TOL_FWD);
    be->matmul_forward(d_out, d_inp, d_w, NULL, N, C, OC);
    down_a(out, d_out, NO);
    m.bias = NULL;
    mm_ref(&m);
    check(t->name, "forward_nobias", err_rel(out, m.out, NO), TOL_FWD);

    m.bias = to_d(bias, OC);
    double *ginp = hd(NC), *gw = hd(OCC), *gb = hd(OC);
    fd_grad(mm_loss, &m, m.inp, NC, ginp);
    fd_grad(mm_loss, &m, m.w, OCC, gw);
    fd_grad(mm_loss, &m, m.bias, OC, gb);
    /* NaN garbage everywhere: dinp is overwritten, and accumulate 0 overwrites. */
    void *d_dinp = da(filled(NC, NAN), NC), *d_R = da(R, NO);
    float *d_dw = df(filled(OCC, NAN), OCC), *d_db = df(filled(OC, NAN), OC);
    float *dinp1 = hf(NC), *dw1 = hf(OCC), *db1 = hf(OC);
    be->matmul_backward(d_dinp, d_dw, d_db, d_R, d_inp, d_w, N, C, OC, 0);
    down_a(dinp1, d_dinp, NC);
    down(dw1, d_dw, OCC);
    down(db1, d_db, OC);
    check(t->name, "backward",
          maxd(maxd(err_rel(dinp1, ginp, NC), err_rel(dw1, gw, OCC)), err_rel(db1, gb, OC)), TOL_BWD);

    float *dinp2 = hf(NC), *dw2 = hf(OCC), *db2 = hf(OC);
    be->matmul_backward(d_dinp, d_dw, d_db, d_R, d_inp, d_w, N, C, OC, 1);
    down_a(dinp2, d_dinp, NC);
    down(dw2, d_dw, OCC);
    down(db2, d_db, OC);
    check(t->name, "accumulate", maxd(err_twice(dw2, dw1, OCC), err_twice(db2, db1, OC)), TOL_ACC);
    check_exact(t->name, "dinp_overwrites", memcmp(dinp2, dinp1, NC * sizeof(float)) == 0,
                "dinp of the second call differs from the first (it must be overwritten)");

    /* No dinp, no dbias (the first layer's input, the bias-free head). */
    float *d_dw3 = df(filled(OCC, NAN), OCC), *dw3 = hf(OCC);
    be->matmul_backward(NULL, d_dw3, NULL, d_R, d_inp, d_w, N, C, OC, 0);
    down(dw3, d_dw3, OCC);
    check(t->name, "backward_nodinp_nobias", err_rel(dw3, gw, OCC), TOL_BWD);
}

/* ---- attention ------------------------------------------------------------ */

/* The reference for every head layout: NH query heads over NKV kv heads
 * (GPT-2's is NKV = NH, HD = C / NH). */
typedef struct {
    AttnShape s;
    double *qkv, *R, *out, *lse; /* qkv (N, (NH + 2 NKV) HD), R, out (N, NH HD), lse (B, NH, T) */
} AttRef;

static void att_ref(AttRef *a) {
    int T = a->s.T, NH = a->s.NH, hs = a->s.HD, ld = attn_qkv_width(&a->s), OC = NH * hs;
    int group = NH / a->s.NKV;
    double s[T];
    for (int b = 0; b < a->s.B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                const double *q = a->qkv + ((size_t)b * T + t) * ld + h * hs;
                const double *k0 = a->qkv + (size_t)b * T * ld + OC + (h / group) * hs;
                const double *v0 = k0 + a->s.NKV * hs;
                double mx = -INFINITY, sum = 0.0;
                int j0 = a->s.doc ? a->s.doc[(size_t)b * T + t] : 0; /* its document's first key */
                for (int j = j0; j <= t; j++) {
                    s[j] = dot_d(q, k0 + (size_t)j * ld, hs) / sqrt(hs);
                    mx = s[j] > mx ? s[j] : mx;
                }
                for (int j = j0; j <= t; j++) s[j] = exp(s[j] - mx), sum += s[j];
                double *o = a->out + ((size_t)b * T + t) * OC + h * hs;
                for (int c = 0; c < hs; c++) o[c] = 0.0;
                for (int j = j0; j <= t; j++) {
                    const double *v = v0 + (size_t)j * ld, pj = s[j] / sum;
                    for (int c = 0; c < hs; c++) o[c] += pj * v[c];
                }
                a->lse[((size_t)b * NH + h) * T + t] = mx + log(sum);
            }
}
static double att_loss(void *ctx) {
    AttRef *a = ctx;
    att_ref(a);
    return dot_d(a->out, a->R, (size_t)a->s.B * a->s.T * a->s.NH * a->s.HD);
}

static void test_attention(const OpTest *t) {
    int B = t->B, T = t->T, C = t->C, NH = t->NH, N = B * T;
    size_t N3 = (size_t)N * 3 * C, NC = (size_t)N * C, NL = (size_t)B * NH * T;
    float *qkv = quant(randn(N3, 1.0f, 0.0f), N3), *R = quant(randn(NC, 1.0f, 0.0f), NC);
    AttRef a = {{B, T, NH, NH, C / NH, NULL}, to_d(qkv, N3), to_d(R, NC), hd(NC), hd(NL)};
    void *d_qkv = da(qkv, N3), *d_out = da(NULL, NC);
    float *d_lse = df(NULL, NL);
    float *out = hf(NC), *lse = hf(NL);
    be->attention_forward(d_out, d_lse, d_qkv, &(AttnShape){B, T, NH, NH, C / NH, NULL});
    down_a(out, d_out, NC);
    down(lse, d_lse, NL);
    att_ref(&a);
    check(t->name, "forward", err_rel(out, a.out, NC), TOL_FWD);
    check(t->name, "forward_lse", err_rel(lse, a.lse, NL), TOL_FWD);

    double *g = hd(N3);
    fd_grad(att_loss, &a, a.qkv, N3, g);
    void *d_dqkv = da(filled(N3, NAN), N3), *d_R = da(R, NC);
    float *dqkv = hf(N3), *dqkv2 = hf(N3);
    be->attention_backward(d_dqkv, d_R, d_qkv, d_out, d_lse, &(AttnShape){B, T, NH, NH, C / NH, NULL});
    down_a(dqkv, d_dqkv, N3);
    check(t->name, "backward", err_rel(dqkv, g, N3), TOL_BWD);

    /* Same inputs, same bits: no races, no order-dependent sums (exact). */
    be->attention_backward(d_dqkv, d_R, d_qkv, d_out, d_lse, &(AttnShape){B, T, NH, NH, C / NH, NULL});
    down_a(dqkv2, d_dqkv, N3);
    check_exact(t->name, "deterministic", memcmp(dqkv, dqkv2, N3 * sizeof(float)) == 0,
                "two identical backward calls differ");

    /* Causality: new k, v for the last position leave every earlier output
     * and lse bit-identical (exact). */
    for (int b = 0; b < B; b++)
        for (int c = C; c < 3 * C; c++) qkv[((size_t)b * T + T - 1) * 3 * C + c] += 5.0f;
    quant(qkv, N3);
    void *d_qkv2 = da(qkv, N3);
    float *out2 = hf(NC), *lse2 = hf(NL);
    be->attention_forward(d_out, d_lse, d_qkv2, &(AttnShape){B, T, NH, NH, C / NH, NULL});
    down_a(out2, d_out, NC);
    down(lse2, d_lse, NL);
    int same = 1, moved = 0;
    for (int b = 0; b < B; b++)
        for (int tt = 0; tt < T; tt++) {
            size_t o = ((size_t)b * T + tt) * C;
            int eq = memcmp(out + o, out2 + o, C * sizeof(float)) == 0;
            for (int h = 0; h < NH; h++)
                eq = eq && lse[((size_t)b * NH + h) * T + tt] == lse2[((size_t)b * NH + h) * T + tt];
            if (tt < T - 1) same = same && eq;
            else moved = moved || !eq;
        }
    check_exact(t->name, "causal", same && moved,
                same ? "changing the last k, v did not change the last output"
                     : "a future k, v changed an earlier output");

    /* Scores near -100 sqrt(hs) (q ~ -10, k ~ +10): only a softmax that
     * subtracts its row maximum survives exp underflow. */
    for (size_t i = 0; i < N3; i++) {
        int c = (int)(i % (3 * (size_t)C));
        if (c < 2 * C) qkv[i] = (c < C ? -10.0f : 10.0f) + 0.5f * rng_normal(&rng);
    }
    quant(qkv, N3);
    void *d_qkv3 = da(qkv, N3);
    a.qkv = to_d(qkv, N3);
    att_ref(&a);
    be->attention_forward(d_out, d_lse, d_qkv3, &(AttnShape){B, T, NH, NH, C / NH, NULL});
    down_a(out, d_out, NC);
    down(lse, d_lse, NL);
    check(t->name, "large_scores", maxd(err_rel(out, a.out, NC), err_rel(lse, a.lse, NL)), TOL_LARGE);
}

/* Grouped K/V heads: NH query heads read NKV < NH kv heads (t->NKV), head
 * width HD (t->HD) independent of any C. Forward, lse and backward against
 * finite differences, as above; a kv head's gradient sums over its group. */
static void test_attention_gqa(const OpTest *t) {
    AttnShape sh = {t->B, t->T, t->NH, t->NKV, t->HD, NULL};
    int N = sh.B * sh.T;
    size_t NW = (size_t)N * attn_qkv_width(&sh), NO = (size_t)N * sh.NH * sh.HD, NL = (size_t)sh.B * sh.NH * sh.T;
    float *qkv = quant(randn(NW, 1.0f, 0.0f), NW), *R = quant(randn(NO, 1.0f, 0.0f), NO);
    AttRef a = {sh, to_d(qkv, NW), to_d(R, NO), hd(NO), hd(NL)};
    void *d_qkv = da(qkv, NW), *d_out = da(NULL, NO);
    float *d_lse = df(NULL, NL), *out = hf(NO), *lse = hf(NL);
    be->attention_forward(d_out, d_lse, d_qkv, &sh);
    down_a(out, d_out, NO);
    down(lse, d_lse, NL);
    att_ref(&a);
    check(t->name, "forward", err_rel(out, a.out, NO), TOL_FWD);
    check(t->name, "forward_lse", err_rel(lse, a.lse, NL), TOL_FWD);

    double *g = hd(NW);
    fd_grad(att_loss, &a, a.qkv, NW, g);
    void *d_dqkv = da(filled(NW, NAN), NW), *d_R = da(R, NO);
    float *dqkv = hf(NW);
    be->attention_backward(d_dqkv, d_R, d_qkv, d_out, d_lse, &sh);
    down_a(dqkv, d_dqkv, NW);
    check(t->name, "backward", err_rel(dqkv, g, NW), TOL_BWD);
}

/* Document masking (AttnShape.doc): each sequence of T tokens holds
 * documents starting at the positions a table gives (sequence b: its own
 * pattern, with a one-token document and a document across CPU blocks of 64
 * rows at T = 70). Forward, lse and backward against the reference and
 * finite differences, as above; then every document's rows run alone
 * through the unmasked op (B = 1, T = its length) must give the same out,
 * lse and dqkv: a masked batch is its documents run separately. Same
 * tolerance, as both sides are fp32 kernels against one double truth. */
static void test_attention_doc(const OpTest *t) {
    AttnShape sh = {t->B, t->T, t->NH, t->NKV, t->HD, NULL};
    int B = sh.B, T = sh.T, W = attn_qkv_width(&sh), OC = sh.NH * sh.HD, N = B * T;
    size_t NW = (size_t)N * W, NO = (size_t)N * OC, NL = (size_t)B * sh.NH * T;
    int32_t *doc = hbuf((size_t)N * sizeof(int32_t));
    for (int b = 0; b < B; b++) {
        /* starts: b 0 at 0, T/4, T/4 + 1, T - 3; b 1 at 0, 2, T/2 (and so on, by b % 2) */
        int st[4] = {0, T / 4, T / 4 + 1, T - 3}, st1[4] = {0, 2, T / 2, T / 2};
        for (int i = 0; i < T; i++) {
            int d = 0;
            for (int k = 0; k < 4; k++) {
                int v = b % 2 ? st1[k] : st[k];
                d = v <= i && v > d ? v : d;
            }
            doc[(size_t)b * T + i] = d;
        }
    }
    float *qkv = quant(randn(NW, 1.0f, 0.0f), NW), *R = quant(randn(NO, 1.0f, 0.0f), NO);
    AttnShape hs_ = sh, ds = sh; /* the reference reads doc on the host, the op on the device */
    hs_.doc = doc;
    ds.doc = dbuf(doc, (size_t)N * sizeof(int32_t));
    AttRef a = {hs_, to_d(qkv, NW), to_d(R, NO), hd(NO), hd(NL)};
    void *d_qkv = da(qkv, NW), *d_out = da(NULL, NO);
    float *d_lse = df(NULL, NL), *out = hf(NO), *lse = hf(NL);
    be->attention_forward(d_out, d_lse, d_qkv, &ds);
    down_a(out, d_out, NO);
    down(lse, d_lse, NL);
    att_ref(&a);
    check(t->name, "forward", err_rel(out, a.out, NO), TOL_FWD);
    check(t->name, "forward_lse", err_rel(lse, a.lse, NL), TOL_FWD);

    double *g = hd(NW);
    fd_grad(att_loss, &a, a.qkv, NW, g);
    void *d_dqkv = da(filled(NW, NAN), NW), *d_R = da(R, NO);
    float *dqkv = hf(NW);
    be->attention_backward(d_dqkv, d_R, d_qkv, d_out, d_lse, &ds);
    down_a(dqkv, d_dqkv, NW);
    check(t->name, "backward", err_rel(dqkv, g, NW), TOL_BWD);

    /* each document alone, unmasked, its results placed where the masked
     * op put its rows (so_, sl_, sd_ as out, lse, dqkv) */
    float *so_ = hf(NO), *sl_ = hf(NL), *sd_ = hf(NW), *f = hf(NW);
    void *h = hbuf(NW * ab);
    void *d_sq = da(NULL, NW), *d_sr = da(NULL, NO), *d_so = da(NULL, NO), *d_sd = da(NULL, NW);
    float *d_sl = df(NULL, NL);
    for (int b = 0; b < B; b++)
        for (int i0 = 0; i0 < T;) {
            int i1 = i0 + 1, NHl;
            while (i1 < T && doc[(size_t)b * T + i1] == i0) i1++;
            int len = i1 - i0;
            size_t r0 = (size_t)b * T + i0;
            AttnShape one = {1, len, sh.NH, sh.NKV, sh.HD, NULL};
            backend_f32_to_act(h, qkv + r0 * W, (size_t)len * W, ab);
            be->to_device(d_sq, h, (size_t)len * W * ab);
            backend_f32_to_act(h, R + r0 * OC, (size_t)len * OC, ab);
            be->to_device(d_sr, h, (size_t)len * OC * ab);
            be->attention_forward(d_so, d_sl, d_sq, &one);
            be->attention_backward(d_sd, d_sr, d_sq, d_so, d_sl, &one);
            be->sync();
            be->to_host(h, d_so, (size_t)len * OC * ab);
            backend_act_to_f32(so_ + r0 * OC, h, (size_t)len * OC, ab);
            be->to_host(h, d_sd, (size_t)len * W * ab);
            backend_act_to_f32(sd_ + r0 * W, h, (size_t)len * W, ab);
            NHl = sh.NH * len;
            be->to_host(f, d_sl, (size_t)NHl * sizeof(float));
            for (int hh = 0; hh < sh.NH; hh++)
                memcpy(sl_ + ((size_t)b * sh.NH + hh) * T + i0, f + (size_t)hh * len, (size_t)len * sizeof(float));
            i0 = i1;
        }
    double e_out = err_rel(so_, to_d(out, NO), NO), e_lse = err_rel(sl_, to_d(lse, NL), NL);
    double e_dqkv = err_rel(sd_, to_d(dqkv, NW), NW);
    check(t->name, "separate_forward", maxd(e_out, e_lse), TOL_FWD);
    check(t->name, "separate_backward", e_dqkv, TOL_BWD);
}

/* ---- block attention (context parallelism) -------------------------------- */

/* The reference: queries q (B Tq, QW) (heads in the first NH HD columns of
 * rows QW wide) against keys and values kv (B Tk, 2 NKV HD) packed [k | v],
 * causal at the global positions q_pos + i, k_pos + j. A query that sees no
 * key: out 0, lse -inf. */
typedef struct {
    AttnBlock s;
    double *q, *kv, *R, *out, *lse; /* q (B Tq, q_ld), kv (B Tk, kv_ld), R, out (B Tq, NH HD), lse (B, NH, Tq) */
} BlkRef;

static void blk_ref(BlkRef *a) {
    const AttnBlock *s = &a->s;
    int NH = s->NH, hs = s->HD, OC = NH * hs, group = NH / s->NKV;
    double sc[s->Tk > 0 ? s->Tk : 1];
    for (int b = 0; b < s->B; b++)
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < s->Tq; i++) {
                const double *q = a->q + ((size_t)b * s->Tq + i) * s->q_ld + h * hs;
                double *o = a->out + ((size_t)b * s->Tq + i) * OC + h * hs, mx = -INFINITY, sum = 0.0;
                int nv = s->q_pos + i - s->k_pos + 1, j0 = s->q_doc ? s->q_doc[(size_t)b * s->Tq + i] - s->k_pos : 0;
                nv = nv < 0 ? 0 : nv > s->Tk ? s->Tk : nv;
                j0 = j0 < 0 ? 0 : j0 > nv ? nv : j0; /* keys [j0, nv): its document's, up to itself */
                for (int j = j0; j < nv; j++) {
                    sc[j] = dot_d(q, a->kv + ((size_t)b * s->Tk + j) * s->kv_ld + (h / group) * hs, hs) / sqrt(hs);
                    mx = sc[j] > mx ? sc[j] : mx;
                }
                for (int j = j0; j < nv; j++) sc[j] = exp(sc[j] - mx), sum += sc[j];
                for (int c = 0; c < hs; c++) o[c] = 0.0;
                for (int j = j0; j < nv; j++) {
                    const double *v = a->kv + ((size_t)b * s->Tk + j) * s->kv_ld + (s->NKV + h / group) * hs;
                    for (int c = 0; c < hs; c++) o[c] += sc[j] / sum * v[c];
                }
                a->lse[((size_t)b * NH + h) * s->Tq + i] = nv > j0 ? mx + log(sum) : -INFINITY;
            }
}
static double blk_loss(void *ctx) {
    BlkRef *a = ctx;
    blk_ref(a);
    return dot_d(a->out, a->R, (size_t)a->s.B * a->s.Tq * a->s.NH * a->s.HD);
}
/* err_rel of lse, where the reference's -inf (no key seen) must be -inf exactly. */
static double lse_err(const float *got, const double *ref, size_t n) {
    double *fin = hd(n);
    float *g = hf(n);
    for (size_t i = 0; i < n; i++) {
        int none = ref[i] == -INFINITY;
        if (none && got[i] != -INFINITY) return INFINITY;
        fin[i] = none ? 0.0 : ref[i], g[i] = none ? 0.0f : got[i];
    }
    return err_rel(g, fin, n);
}
/* Keys [j0, j1) of every sequence of kv (B Tk rows) as a packed buffer of their own. */
static float *blk_keys(const float *kv, const AttnBlock *s, int j0, int j1) {
    float *out = hf((size_t)s->B * (j1 - j0) * s->kv_ld);
    for (int b = 0; b < s->B; b++)
        memcpy(out + (size_t)b * (j1 - j0) * s->kv_ld, kv + ((size_t)b * s->Tk + j0) * s->kv_ld,
               (size_t)(j1 - j0) * s->kv_ld * sizeof(float));
    return out;
}

/* T is Tq, C is Tk, V and Vp are q_pos and k_pos (NKV, HD as for GQA). q
 * rows sit in qkv-like rows wider than NH HD (q_ld), k and v in one packed
 * buffer. Checks: the forward of the whole block (merge 0); the same keys as
 * two blocks merged later-half first (any order is the union's attention);
 * the backward of the two halves, added into dq, dk, dv that start from
 * other values (the "+=" contract), against finite differences of the
 * whole block's reference. */
static void test_attention_block(const OpTest *t) {
    AttnBlock s = {.B = t->B, .NH = t->NH, .NKV = t->NKV, .HD = t->HD, .Tq = t->T, .Tk = t->C, .q_pos = t->V,
                   .k_pos = t->Vp};
    s.q_ld = (s.NH + 2 * s.NKV) * s.HD, s.kv_ld = 2 * s.NKV * s.HD;
    AttnBlock sd = s; /* what the op gets: q_doc on the device */
    if (t->opt) {
        /* document masking: documents start at global 0, a third into the
         * keys, one token later (a one-token document) and half-way through
         * the queries, so the halves below hold rows that see none, some or
         * all of their keys */
        int starts[] = {s.k_pos + s.Tk / 3, s.k_pos + s.Tk / 3 + 1, s.q_pos + s.Tq / 2};
        int32_t *doc = hbuf((size_t)s.B * s.Tq * sizeof(int32_t));
        for (int b = 0; b < s.B; b++)
            for (int i = 0; i < s.Tq; i++) {
                int g = s.q_pos + i, d = 0;
                for (int k = 0; k < 3; k++) d = starts[k] <= g && starts[k] > d ? starts[k] : d;
                doc[(size_t)b * s.Tq + i] = d;
            }
        s.q_doc = doc;
        sd.q_doc = dbuf(doc, (size_t)s.B * s.Tq * sizeof(int32_t));
    }
    size_t NQ = (size_t)s.B * s.Tq * s.q_ld, NK = (size_t)s.B * s.Tk * s.kv_ld;
    size_t NO = (size_t)s.B * s.Tq * s.NH * s.HD, NL = (size_t)s.B * s.NH * s.Tq;
    float *q = quant(randn(NQ, 1.0f, 0.0f), NQ), *kv = quant(randn(NK, 1.0f, 0.0f), NK);
    float *R = quant(randn(NO, 1.0f, 0.0f), NO);
    BlkRef a = {s, to_d(q, NQ), to_d(kv, NK), to_d(R, NO), hd(NO), hd(NL)};
    blk_ref(&a);
    void *d_q = da(q, NQ), *d_kv = da(kv, NK), *d_out = da(filled(NO, NAN), NO);
    float *d_lse = df(filled(NL, NAN), NL), *out = hf(NO), *lse = hf(NL);
    size_t kvo = (size_t)s.NKV * s.HD * ab; /* v's columns after k's, in bytes */
    be->attention_block_forward(d_out, d_lse, d_q, d_kv, (char *)d_kv + kvo, &sd, 0);
    down_a(out, d_out, NO);
    down(lse, d_lse, NL);
    check(t->name, "forward", err_rel(out, a.out, NO), TOL_FWD);
    check(t->name, "forward_lse", lse_err(lse, a.lse, NL), TOL_FWD);

    int h = s.Tk / 2;
    AttnBlock s1 = sd, s2 = sd;
    s1.Tk = h, s2.Tk = s.Tk - h, s2.k_pos = s.k_pos + h;
    void *d_k1 = da(blk_keys(kv, &s, 0, h), (size_t)s.B * h * s.kv_ld);
    void *d_k2 = da(blk_keys(kv, &s, h, s.Tk), (size_t)s.B * (s.Tk - h) * s.kv_ld);
    be->attention_block_forward(d_out, d_lse, d_q, d_k2, (char *)d_k2 + kvo, &s2, 0);
    be->attention_block_forward(d_out, d_lse, d_q, d_k1, (char *)d_k1 + kvo, &s1, 1);
    down_a(out, d_out, NO);
    down(lse, d_lse, NL);
    check(t->name, "merged", maxd(err_rel(out, a.out, NO), lse_err(lse, a.lse, NL)), TOL_FWD);

    double *gq = hd(NQ), *gkv = hd(NK);
    fd_grad(blk_loss, &a, a.q, NQ, gq);
    fd_grad(blk_loss, &a, a.kv, NK, gkv);
    /* dq, dk, dv start at base values: the op adds */
    float *bq = randn(NQ, 1.0f, 0.0f), *bkv = randn(NK, 1.0f, 0.0f);
    float *b1 = blk_keys(bkv, &s, 0, h), *b2 = blk_keys(bkv, &s, h, s.Tk);
    float *d_dq = df(bq, NQ), *d_dk1 = df(b1, (size_t)s.B * h * s.kv_ld);
    float *d_dk2 = df(b2, (size_t)s.B * (s.Tk - h) * s.kv_ld);
    void *d_R = da(R, NO);
    size_t fo = (size_t)s.NKV * s.HD; /* dv's columns, in floats */
    be->attention_block_backward(d_dq, d_dk2, d_dk2 + fo, d_R, d_q, d_k2, (char *)d_k2 + kvo, d_out, d_lse, &s2);
    be->attention_block_backward(d_dq, d_dk1, d_dk1 + fo, d_R, d_q, d_k1, (char *)d_k1 + kvo, d_out, d_lse, &s1);
    float *dq = hf(NQ), *dk1 = hf((size_t)s.B * h * s.kv_ld), *dk2 = hf((size_t)s.B * (s.Tk - h) * s.kv_ld);
    down(dq, d_dq, NQ);
    down(dk1, d_dk1, (size_t)s.B * h * s.kv_ld);
    down(dk2, d_dk2, (size_t)s.B * (s.Tk - h) * s.kv_ld);
    /* only the q heads' columns of dq are the op's; the rest must keep their base */
    float *dkv = hf(NK);
    for (int b = 0; b < s.B; b++) {
        memcpy(dkv + (size_t)b * s.Tk * s.kv_ld, dk1 + (size_t)b * h * s.kv_ld, (size_t)h * s.kv_ld * sizeof(float));
        memcpy(dkv + ((size_t)b * s.Tk + h) * s.kv_ld, dk2 + (size_t)b * (s.Tk - h) * s.kv_ld,
               (size_t)(s.Tk - h) * s.kv_ld * sizeof(float));
    }
    int qw = s.NH * s.HD, rest_same = 1;
    for (size_t i = 0; i < NQ; i++) {
        if ((int)(i % s.q_ld) >= qw) rest_same = rest_same && dq[i] == bq[i], gq[i] = 0.0;
    }
    check(t->name, "backward_dq", err_rel(dq, plus(bq, gq, 1.0, NQ), NQ), TOL_BWD);
    check(t->name, "backward_dkv", err_rel(dkv, plus(bkv, gkv, 1.0, NK), NK), TOL_BWD);
    check_exact(t->name, "backward_q_columns_only", rest_same, "dq changed columns past the q heads");
}

/* ---- gelu, add ------------------------------------------------------------ */

typedef struct {
    size_t n;
    double *x, *R, *out;
} GeluRef;

static double gelu_d(double x) {
    return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}
static double gelu_loss(void *ctx) {
    GeluRef *r = ctx;
    double s = 0.0;
    for (size_t i = 0; i < r->n; i++) s += gelu_d(r->x[i]) * r->R[i];
    return s;
}

static void test_gelu(const OpTest *t) {
    size_t n = (size_t)t->B * t->T * t->C;
    float *x = randn(n, 2.0f, 0.0f), *R = randn(n, 1.0f, 0.0f);
    /* Saturated tails and zero, where tanh approximations go wrong. */
    x[0] = 0.0f, x[1] = 10.0f, x[2] = -10.0f, x[3] = 30.0f, x[4] = -30.0f, x[5] = 1e-4f;
    quant(x, n), quant(R, n);
    GeluRef r = {n, to_d(x, n), to_d(R, n), hd(n)};
    for (size_t i = 0; i < n; i++) r.out[i] = gelu_d(r.x[i]);
    void *d_x = da(x, n), *d_out = da(NULL, n);
    float *out = hf(n);
    be->gelu_forward(d_out, d_x, n);
    down_a(out, d_out, n);
    check(t->name, "forward", err_rel(out, r.out, n), TOL_FWD);

    double *g = hd(n);
    fd_grad(gelu_loss, &r, r.x, n, g);
    void *d_R = da(R, n), *d_dx = da(filled(n, NAN), n);
    float *dx = hf(n);
    be->gelu_backward(d_dx, d_x, d_R, n);
    down_a(dx, d_dx, n);
    check(t->name, "backward", err_rel(dx, g, n), TOL_BWD);
}

/* ---- fused matmul + GeLU (backend.h: optional) ------------------------------ */

static double gelu_grad_d(double x) {
    double k = 0.7978845608028654, u = k * (x + 0.044715 * x * x * x), th = tanh(u);
    return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * k * (1.0 + 3.0 * 0.044715 * x * x);
}

/* Forward: pre = inp @ w^T + bias, out = gelu(pre). Backward (of a product
 * whose input was gelu(pre), here pre (N,OC) -> (N,C)): dpre = (R @ w2) *
 * gelu'(pre), dw2 = R^T gelu(pre), db2 = colsum(R). Direct double references:
 * the compositions they replace are checked against finite differences above. */
static void test_matmul_gelu(const OpTest *t) {
    if (!be->matmul_gelu_forward || !be->matmul_backward_dgelu) {
        /* an optional op (backend.h) this backend does not offer: no check to
         * run, so no skip line either (a skip is a check that could not run) */
        printf("# ops_%s_%s: not offered by this backend (optional fused matmul + GeLU)\n", label, t->name);
        return;
    }
    int N = t->B * t->T, C = t->C, OC = t->V;
    size_t NC = (size_t)N * C, OCC = (size_t)OC * C, NO = (size_t)N * OC;
    float *inp = quant(randn(NC, 1.0f, 0.0f), NC), *w = quant(randn(OCC, 0.5f, 0.0f), OCC);
    float *bias = quant(randn(OC, 1.0f, 0.0f), OC);
    double *pre = hd(NO), *out = hd(NO);
    for (int i = 0; i < N; i++)
        for (int o = 0; o < OC; o++) {
            double s = bias[o];
            for (int c = 0; c < C; c++) s += (double)inp[(size_t)i * C + c] * w[(size_t)o * C + c];
            pre[(size_t)i * OC + o] = s, out[(size_t)i * OC + o] = gelu_d(s);
        }
    void *d_inp = da(inp, NC), *d_w = da(w, OCC), *d_bias = da(bias, OC), *d_pre = da(NULL, NO), *d_out = da(NULL, NO);
    float *got_pre = hf(NO), *got_out = hf(NO);
    be->matmul_gelu_forward(d_out, d_pre, d_inp, d_w, d_bias, N, C, OC);
    down_a(got_pre, d_pre, NO);
    down_a(got_out, d_out, NO);
    check(t->name, "forward_pre", err_rel(got_pre, pre, NO), TOL_FWD);
    check(t->name, "forward_gelu", err_rel(got_out, out, NO), fmax(TOL_GELU_EPI / tol_scale, TOL_FWD));

    /* backward: the forward's stored pre and gelu(pre) are its inputs */
    float *w2 = quant(randn(OCC, 0.5f, 0.0f), OCC), *R = quant(randn(NC, 1.0f, 0.0f), NC), *g = hf(NO);
    for (size_t i = 0; i < NO; i++) g[i] = backend_act_round((float)gelu_d(got_pre[i]), ab);
    double *dpre = hd(NO), *dw2 = hd(OCC), *db2 = hd(C);
    for (int i = 0; i < N; i++)
        for (int o = 0; o < OC; o++) {
            double s = 0.0;
            for (int c = 0; c < C; c++) s += (double)R[(size_t)i * C + c] * w2[(size_t)c * OC + o];
            dpre[(size_t)i * OC + o] = s * gelu_grad_d(got_pre[(size_t)i * OC + o]);
        }
    for (int c = 0; c < C; c++) {
        for (int o = 0; o < OC; o++) {
            double s = 0.0;
            for (int i = 0; i < N; i++) s += (double)R[(size_t)i * C + c] * g[(size_t)i * OC + o];
            dw2[(size_t)c * OC + o] = s;
        }
        double s = 0.0;
        for (int i = 0; i < N; i++) s += R[(size_t)i * C + c];
        db2[c] = s;
    }
    void *d_w2 = da(w2, OCC), *d_R = da(R, NC), *d_g = da(g, NO), *d_dpre = da(filled(NO, NAN), NO);
    float *d_dw2 = df(filled(OCC, NAN), OCC), *d_db2 = df(filled(C, NAN), C);
    float *got_dpre = hf(NO), *got_dw2 = hf(OCC), *got_db2 = hf(C);
    be->matmul_backward_dgelu(d_dpre, d_dw2, d_db2, d_R, d_g, d_w2, d_pre, N, OC, C, 0);
    down_a(got_dpre, d_dpre, NO);
    down(got_dw2, d_dw2, OCC);
    down(got_db2, d_db2, C);
    check(t->name, "backward_dpre", err_rel(got_dpre, dpre, NO), fmax(TOL_GELU_EPI / tol_scale, TOL_FWD));
    check(t->name, "backward_dparams", maxd(err_rel(got_dw2, dw2, OCC), err_rel(got_db2, db2, C)), TOL_FWD);
}

static void test_add(const OpTest *t) {
    size_t n = (size_t)t->B * t->T * t->C;
    float *a = quant(randn(n, 1.0f, 0.0f), n), *b = quant(randn(n, 1.0f, 0.0f), n), *out = hf(n);
    /* the residual stream, act: fp32 math, one rounding to act (exact) */
    void *d_a = da(a, n), *d_b = da(b, n), *d_out = da(NULL, n);
    be->residual_forward(d_out, d_a, d_b, n);
    down_a(out, d_out, n);
    int ok = 1;
    for (size_t i = 0; i < n; i++) ok = ok && out[i] == backend_act_round(a[i] + b[i], ab);
    check_exact(t->name, "forward", ok, "out != a + b");
    /* fp32 gradient shards (ddp.c): one fp32 rounding (exact) */
    float *d_fa = df(a, n), *d_fb = df(b, n), *d_fout = df(NULL, n);
    be->add(d_fout, d_fa, d_fb, n);
    down(out, d_fout, n);
    ok = 1;
    for (size_t i = 0; i < n; i++) ok = ok && out[i] == a[i] + b[i];
    check_exact(t->name, "fp32", ok, "fp32 out != a + b");
}

/* ---- crossentropy --------------------------------------------------------- */

typedef struct {
    int N, V, Vp;
    const int32_t *tg;
    double *logits, *losses, dloss; /* logits (N,Vp) */
} CeRef;

static void ce_ref(CeRef *c) {
    for (int i = 0; i < c->N; i++) {
        const double *x = c->logits + (size_t)i * c->Vp;
        double mx = -INFINITY, s = 0.0;
        for (int j = 0; j < c->V; j++) mx = x[j] > mx ? x[j] : mx;
        for (int j = 0; j < c->V; j++) s += exp(x[j] - mx);
        c->losses[i] = mx + log(s) - x[c->tg[i]];
    }
}
static double ce_loss(void *ctx) {
    CeRef *c = ctx;
    ce_ref(c);
    double s = 0.0;
    for (int i = 0; i < c->N; i++) s += c->losses[i];
    return c->dloss * s;
}

static void test_crossentropy(const OpTest *t) {
    int N = t->B * t->T, V = t->V, Vp = t->Vp;
    size_t NV = (size_t)N * Vp;
    /* The odd case sits at -100: exp underflows unless the row max is subtracted. */
    float *logits = randn(NV, 3.0f, Vp > 64 ? -100.0f : 0.0f);
    /* Padding holds garbage larger than any logit: it must be ignored. */
    for (int i = 0; i < N; i++)
        for (int j = V; j < Vp; j++) logits[(size_t)i * Vp + j] = 1e4f;
    quant(logits, NV);
    int32_t *tg = hbuf(N * sizeof(int32_t));
    for (int i = 0; i < N; i++) tg[i] = (int32_t)rng_below(&rng, (uint64_t)V);
    tg[0] = V - 1; /* the last real column, next to the padding */
    const float dloss = 0.37f;
    CeRef c = {N, V, Vp, tg, to_d(logits, NV), hd(N), dloss};
    ce_ref(&c);
    void *d_logits = da(logits, NV);
    float *d_losses = df(NULL, N), *losses = hf(N), *after = hf(NV);
    int32_t *d_tg = dbuf(tg, N * sizeof(int32_t));
    be->crossentropy_forward(d_logits, d_losses, d_tg, N, V, Vp, 0.0f);
    down(losses, d_losses, N);
    down_a(after, d_logits, NV);
    check(t->name, "loss", err_rel(losses, c.losses, N), TOL_FWD);
    check_exact(t->name, "dloss0_untouched", memcmp(after, logits, NV * sizeof(float)) == 0,
                "dloss = 0 modified the logits");

    double *g = hd(NV); /* FD over the real columns; padding gradient is 0 */
    for (int i = 0; i < N; i++) fd_grad(ce_loss, &c, c.logits + (size_t)i * Vp, V, g + (size_t)i * Vp);
    be->crossentropy_forward(d_logits, d_losses, d_tg, N, V, Vp, dloss);
    down(losses, d_losses, N);
    down_a(after, d_logits, NV);
    check(t->name, "loss_with_grad", err_rel(losses, c.losses, N), TOL_FWD);
    check(t->name, "dlogits", err_rel(after, g, NV), TOL_BWD);
    int zeros = 1;
    for (int i = 0; i < N; i++)
        for (int j = V; j < Vp; j++) zeros = zeros && after[(size_t)i * Vp + j] == 0.0f;
    check_exact(t->name, "padding_zero", zeros, "padded columns of dlogits are not 0");
}

/* Vocabulary-parallel cross-entropy (tensor parallelism): the dense case's
 * logits split into P column slices of Vl (NH = P), slice p holding
 * clamp(V - p Vl, 0, Vl) real columns, each processed as its rank would
 * (xent_partial, the stats of all slices in rank order, xent_finish); the
 * losses and every slice's dlogits against the dense reference and its
 * finite differences. Same tolerances as crossentropy: the slices' partial
 * sums of exponentials only reassociate the dense sum. */
static void test_xent_parallel(const OpTest *t) {
    int N = t->B * t->T, V = t->V, P = t->NH, Vl = (t->Vp + P - 1) / P, W = P * Vl;
    size_t NW = (size_t)N * W, nl = (size_t)N * Vl;
    float *logits = randn(NW, 3.0f, V > 64 ? -100.0f : 0.0f);
    for (int i = 0; i < N; i++)
        for (int j = V; j < W; j++) logits[(size_t)i * W + j] = 1e4f; /* padding: ignored */
    quant(logits, NW);
    int32_t *tg = hbuf(N * sizeof(int32_t)), *tl = hbuf(N * sizeof(int32_t));
    for (int i = 0; i < N; i++) tg[i] = (int32_t)rng_below(&rng, (uint64_t)V);
    tg[0] = V - 1;
    const float dloss = 0.37f;
    CeRef c = {N, V, W, tg, to_d(logits, NW), hd(N), dloss};
    ce_ref(&c);
    double *g = hd(NW);
    for (int i = 0; i < N; i++) fd_grad(ce_loss, &c, c.logits + (size_t)i * W, V, g + (size_t)i * W);
    float *all = df(NULL, (size_t)P * N * 3), *part = hf(nl), *losses = hf(N), *got = hf(NW);
    void **d_part = calloc((size_t)P, sizeof(void *));
    int32_t **d_tl = calloc((size_t)P, sizeof(int32_t *));
    for (int p = 0; p < P; p++) {
        int valid = V - p * Vl < 0 ? 0 : V - p * Vl > Vl ? Vl : V - p * Vl;
        for (int i = 0; i < N; i++) {
            memcpy(part + (size_t)i * Vl, logits + (size_t)i * W + (size_t)p * Vl, Vl * sizeof(float));
            tl[i] = tg[i] >= p * Vl && tg[i] < (p + 1) * Vl ? tg[i] - p * Vl : -1;
        }
        d_part[p] = da(part, nl);
        d_tl[p] = dbuf(tl, N * sizeof(int32_t));
        be->xent_partial((float *)((char *)all + (size_t)p * N * 3 * sizeof(float)), d_part[p], d_tl[p], N, valid,
                         Vl);
    }
    double worst = 0;
    for (int p = 0; p < P; p++) {
        int valid = V - p * Vl < 0 ? 0 : V - p * Vl > Vl ? Vl : V - p * Vl;
        float *d_losses = df(NULL, N);
        be->xent_finish(d_part[p], d_losses, all, P, d_tl[p], N, valid, Vl, dloss);
        down(losses, d_losses, N);
        double e = err_rel(losses, c.losses, N);
        worst = e > worst ? e : worst;
        down_a(part, d_part[p], nl);
        for (int i = 0; i < N; i++) memcpy(got + (size_t)i * W + (size_t)p * Vl, part + (size_t)i * Vl, Vl * sizeof(float));
    }
    check(t->name, "loss_every_rank", worst, TOL_FWD);
    check(t->name, "dlogits", err_rel(got, g, NW), TOL_BWD);
    int zeros = 1;
    for (int i = 0; i < N; i++)
        for (int j = V; j < W; j++) zeros = zeros && got[(size_t)i * W + j] == 0.0f;
    check_exact(t->name, "padding_zero", zeros, "padded columns of dlogits are not 0");
    free(d_part);
    free(d_tl);
}

/* ---- adamw ---------------------------------------------------------------- */

static void test_adamw(const OpTest *t) {
    size_t n = (size_t)t->B * t->T * t->C;
    const float lr = 1e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f, gs = 0.5f;
    for (int pass = 0; pass < 2; pass++) {
        int step = pass ? 7 : 1; /* t = 1: the largest bias correction */
        float *p = randn(n, 1.0f, 0.0f), *g = randn(n, 1.0f, 0.0f);
        float *m = pass ? randn(n, 0.1f, 0.0f) : filled(n, 0.0f);
        float *v = filled(n, 0.0f);
        if (pass)
            for (size_t i = 0; i < n; i++) v[i] = 0.01f * rng_uniform(&rng);
        double *rp = hd(n), *rm = hd(n), *rv = hd(n);
        double bc1 = 1.0 - pow(b1, step), bc2 = 1.0 - pow(b2, step);
        for (size_t i = 0; i < n; i++) {
            double gi = (double)g[i] * gs;
            rm[i] = (double)b1 * m[i] + (1.0 - (double)b1) * gi;
            rv[i] = (double)b2 * v[i] + (1.0 - (double)b2) * gi * gi;
            double mhat = rm[i] / bc1, vhat = rv[i] / bc2;
            rp[i] = p[i] - (double)lr * (mhat / (sqrt(vhat) + eps) + (double)wd * p[i]);
        }
        float *d_p = df(p, n), *d_g = df(g, n), *d_m = df(m, n), *d_v = df(v, n);
        be->adamw_update(d_p, d_g, d_m, d_v, n, lr, b1, b2, eps, wd, gs, step, NULL, NULL);
        float *p2 = hf(n), *m2 = hf(n), *v2 = hf(n), *delta = hf(n);
        down(p2, d_p, n);
        down(m2, d_m, n);
        down(v2, d_v, n);
        double *rdelta = hd(n);
        for (size_t i = 0; i < n; i++) delta[i] = p2[i] - p[i], rdelta[i] = rp[i] - p[i];
        const char *what = pass ? "t7" : "t1";
        char w2[32];
        snprintf(w2, sizeof w2, "%s_delta", what);
        check(t->name, what, maxd(maxd(err_rel(p2, rp, n), err_rel(m2, rm, n)), err_rel(v2, rv, n)), TOL_ADAM);
        check(t->name, w2, err_rel(delta, rdelta, n), TOL_ADAM_DELTA);
    }
}

/* ---- sumsq ---------------------------------------------------------------- */

static void test_sumsq(const OpTest *t) {
    size_t n = (size_t)t->B * t->T * t->C;
    float *x = randn(n, 1.0f, 0.0f);
    long double ref = 0.0L;
    for (size_t i = 0; i < n; i++) ref += (long double)x[i] * x[i];
    float *d_x = df(x, n);
    double s = be->sumsq(d_x, n);
    check(t->name, "value", fabs(s - (double)ref) / (double)ref, TOL_SUMSQ);
    check(t->name, "small", fabs(be->sumsq(d_x, 3) - ((double)x[0] * x[0] + (double)x[1] * x[1] + (double)x[2] * x[2])) /
                                ((double)x[0] * x[0] + (double)x[1] * x[1] + (double)x[2] * x[2]),
          TOL_SUMSQ);
    /* A single bad value anywhere must surface (the NaN / overflow check). */
    x[n / 3] = NAN;
    float *d_nan = df(x, n);
    check_exact(t->name, "nan", isnan(be->sumsq(d_nan, n)), "NaN in x gave a finite sum");
    x[n / 3] = -INFINITY;
    float *d_inf = df(x, n);
    check_exact(t->name, "inf", isinf(be->sumsq(d_inf, n)), "-Inf in x gave a finite sum");
}

/* ---- rmsnorm -------------------------------------------------------------- */

#define RMS_EPS 1e-6 /* Llama's */

typedef struct {
    int N, C;
    double *inp, *w, *R, *out, *rstd;
} RmsRef;

static void rms_ref(RmsRef *r) {
    for (int i = 0; i < r->N; i++) {
        const double *x = r->inp + (size_t)i * r->C;
        double s = 0.0;
        for (int c = 0; c < r->C; c++) s += x[c] * x[c];
        double rs = 1.0 / sqrt(s / r->C + RMS_EPS);
        for (int c = 0; c < r->C; c++) r->out[(size_t)i * r->C + c] = x[c] * rs * r->w[c];
        r->rstd[i] = rs;
    }
}
static double rms_loss(void *ctx) {
    RmsRef *r = ctx;
    rms_ref(r);
    return dot_d(r->out, r->R, (size_t)r->N * r->C);
}

static void test_rmsnorm(const OpTest *t) {
    int N = t->B * t->T, C = t->C;
    size_t NC = (size_t)N * C;
    /* Offset 1: RMSNorm does not centre, so a mean must not be removed. */
    float *inp = quant(randn(NC, 1.0f, 1.0f), NC), *w = quant(randn(C, 0.5f, 1.0f), C);
    float *R = quant(randn(NC, 1.0f, 0.0f), NC);
    RmsRef r = {N, C, to_d(inp, NC), to_d(w, C), to_d(R, NC), hd(NC), hd(N)};
    void *d_inp = da(inp, NC), *d_w = da(w, C), *d_out = da(NULL, NC);
    float *d_rstd = df(NULL, N), *out = hf(NC), *rstd = hf(N);
    be->rmsnorm_forward(d_out, d_rstd, d_inp, d_w, N, C, (float)RMS_EPS);
    down_a(out, d_out, NC);
    down(rstd, d_rstd, N);
    rms_ref(&r);
    check(t->name, "forward", err_rel(out, r.out, NC), TOL_FWD);
    check(t->name, "forward_rstd", err_rel(rstd, r.rstd, N), TOL_FWD);

    double *ginp = hd(NC), *gw = hd(C);
    fd_grad(rms_loss, &r, r.inp, NC, ginp);
    fd_grad(rms_loss, &r, r.w, C, gw);
    float *prior = quant(randn(NC, 1.0f, 0.0f), NC); /* dinp is "+=" */
    void *d_dinp = da(prior, NC), *d_R = da(R, NC);
    float *d_dw = df(filled(C, NAN), C), *dinp1 = hf(NC), *dw1 = hf(C), *g1 = hf(NC);
    be->rmsnorm_backward(d_dinp, d_dw, d_R, d_inp, d_w, d_rstd, N, C, 0);
    down_a(dinp1, d_dinp, NC);
    down(dw1, d_dw, C);
    for (size_t i = 0; i < NC; i++) g1[i] = dinp1[i] - prior[i];
    check(t->name, "backward_dinp", err_rel(g1, ginp, NC), TOL_BWD);
    check(t->name, "backward_dw", err_rel(dw1, gw, C), TOL_BWD);

    float *dinp2 = hf(NC), *dw2 = hf(C);
    be->rmsnorm_backward(d_dinp, d_dw, d_R, d_inp, d_w, d_rstd, N, C, 1);
    down_a(dinp2, d_dinp, NC);
    down(dw2, d_dw, C);
    for (size_t i = 0; i < NC; i++) g1[i] = dinp2[i] - prior[i];
    check(t->name, "accumulate", err_twice(dw2, dw1, C), TOL_ACC);
    check(t->name, "dinp_adds", err_rel(g1, plus(NULL, ginp, 2.0, NC), NC), TOL_BWD);
}

/* ---- residual add + norm (optional) -------------------------------------- */

/* res = a + b, then the norm of res (opt 0: LayerNorm with a bias, 1:
 * RMSNorm, 2: LayerNorm without): res exactly a + b rounded once; out and
 * the statistics the bits of the backend's own residual_forward then norm
 * (backend.h: a recomputed norm must match the forward's), and within
 * TOL_FWD of the double reference on res. */
static void test_residual_norm(const OpTest *t) {
    if (!be->residual_norm_forward) {
        printf("# ops_%s_%s: not offered by this backend (optional fused residual add + norm)\n", label, t->name);
        return;
    }
    int N = t->B * t->T, C = t->C, rms = t->opt == 1, bias = t->opt == 0;
    size_t NC = (size_t)N * C;
    float eps = rms ? (float)RMS_EPS : 1e-5f;
    float *a = quant(randn(NC, 1.0f, 3.0f), NC), *b = quant(randn(NC, 1.0f, 0.0f), NC);
    float *w = quant(randn(C, 0.5f, 1.0f), C), *bb = bias ? quant(randn(C, 0.5f, 0.0f), C) : filled(C, 0.0f);
    void *d_a = da(a, NC), *d_b = da(b, NC), *d_w = da(w, C), *d_bias = bias ? da(bb, C) : NULL;
    void *d_res = da(NULL, NC), *d_out = da(NULL, NC), *c_res = da(NULL, NC), *c_out = da(NULL, NC);
    float *d_mean = df(NULL, N), *d_rstd = df(NULL, N), *c_mean = df(NULL, N), *c_rstd = df(NULL, N);
    be->residual_norm_forward(d_res, d_out, rms ? NULL : d_mean, d_rstd, d_a, d_b, d_w, d_bias, N, C, eps);
    be->residual_forward(c_res, d_a, d_b, NC);
    if (rms) be->rmsnorm_forward(c_out, c_rstd, c_res, d_w, N, C, eps);
    else be->layernorm_forward(c_out, c_mean, c_rstd, c_res, d_w, d_bias, N, C, eps);
    float *res = hf(NC), *out = hf(NC), *mean = hf(N), *rstd = hf(N);
    float *cout = hf(NC), *cmean = hf(N), *crstd = hf(N);
    down_a(res, d_res, NC), down_a(out, d_out, NC), down(rstd, d_rstd, N);
    down_a(cout, c_out, NC), down(crstd, c_rstd, N);
    if (!rms) down(mean, d_mean, N), down(cmean, c_mean, N);
    int ok = 1;
    for (size_t i = 0; i < NC; i++) ok = ok && res[i] == backend_act_round(a[i] + b[i], ab);
    check_exact(t->name, "res", ok, "res != a + b");
    int same = !memcmp(out, cout, NC * sizeof(float)) && !memcmp(rstd, crstd, N * sizeof(float)) &&
               (rms || !memcmp(mean, cmean, N * sizeof(float)));
    check_exact(t->name, "is_composition", same, "out or the statistics differ from residual_forward then the norm");
    double *x = to_d(res, NC), *ref = hd(NC), *rmean = hd(N), *rrstd = hd(N);
    if (rms) {
        RmsRef r = {N, C, x, to_d(w, C), NULL, ref, rrstd};
        rms_ref(&r);
    } else {
        LnRef l = {N, C, x, to_d(w, C), to_d(bb, C), NULL, ref, rmean, rrstd};
        ln_ref(&l);
    }
    check(t->name, "forward", err_rel(out, ref, NC), TOL_FWD);
    check(t->name, "forward_stats", maxd(err_rel(rstd, rrstd, N), rms ? 0.0 : err_rel(mean, rmean, N)), TOL_FWD);
}

/* ---- rope ----------------------------------------------------------------- */

/* The table (Tmax, 2, HD/2): per position HD/2 cosines then HD/2 sines of
 * p theta^(-2i/HD), theta 1e4, made in double and stored fp32 as a model would. */
static float *rope_table(int Tmax, int HD) {
    int H2 = HD / 2;
    float *tab = hf((size_t)Tmax * HD);
    for (int p = 0; p < Tmax; p++)
        for (int i = 0; i < H2; i++) {
            double a = p * pow(1e4, -2.0 * i / HD);
            tab[(size_t)p * HD + i] = (float)cos(a);
            tab[(size_t)p * HD + H2 + i] = (float)sin(a);
        }
    return tab;
}

typedef struct {
    AttnShape s;
    int pos0;
    const float *tab;
    double *qkv, *R, *out;
} RopeRef;

static void rope_ref(RopeRef *r) {
    int N = r->s.B * r->s.T, ld = attn_qkv_width(&r->s), HD = r->s.HD, H2 = HD / 2;
    memcpy(r->out, r->qkv, (size_t)N * ld * sizeof(double));
    for (int i = 0; i < N; i++) {
        int p = r->pos0 + i % r->s.T - (r->s.doc ? r->s.doc[i] : 0); /* doc: positions restart per document */
        const float *cs = r->tab + (size_t)p * HD, *sn = cs + H2;
        for (int h = 0; h < r->s.NH + r->s.NKV; h++) {
            const double *x = r->qkv + (size_t)i * ld + h * HD;
            double *o = r->out + (size_t)i * ld + h * HD;
            for (int k = 0; k < H2; k++) {
                o[k] = x[k] * cs[k] - x[k + H2] * sn[k];
                o[k + H2] = x[k + H2] * cs[k] + x[k] * sn[k];
            }
        }
    }
}
static double rope_loss(void *ctx) {
    RopeRef *r = ctx;
    rope_ref(r);
    return dot_d(r->out, r->R, (size_t)r->s.B * r->s.T * attn_qkv_width(&r->s));
}

/* pos0 (t->V) > 0: a context-parallel shard's positions; the table is longer
 * than pos0 + T, so a wrong Tmax-based stride would read the wrong rows.
 * opt 1: positions reset per document (AttnShape.doc, global starts: the
 * rows' own positions pos0 + i, documents from pos0 - 2 on, every 3rd
 * row, so a row's position in its document is 0, 1 or 2; the first ones
 * start before the shard as under context parallelism). */
static void test_rope(const OpTest *t) {
    AttnShape sh = {t->B, t->T, t->NH, t->NKV, t->HD, NULL};
    int N = sh.B * sh.T, ld = attn_qkv_width(&sh), pos0 = t->V, vcol = (sh.NH + sh.NKV) * sh.HD;
    size_t NW = (size_t)N * ld;
    const float *tab = rope_table(pos0 + sh.T + 5, sh.HD);
    float *d_tab = df(tab, (size_t)(pos0 + sh.T + 5) * sh.HD);
    float *qkv = quant(randn(NW, 1.0f, 0.0f), NW), *R = quant(randn(NW, 1.0f, 0.0f), NW);
    AttnShape dsh = sh; /* what the op gets: doc on the device */
    if (t->opt) {
        int32_t *doc = hbuf((size_t)N * sizeof(int32_t));
        for (int i = 0; i < N; i++) {
            int g = pos0 + i % sh.T, d = pos0 - 2 + (g - pos0 + 2) / 3 * 3;
            doc[i] = d < 0 ? 0 : d;
        }
        sh.doc = doc;
        dsh.doc = dbuf(doc, (size_t)N * sizeof(int32_t));
    }
    RopeRef r = {sh, pos0, tab, to_d(qkv, NW), to_d(R, NW), hd(NW)};
    void *d_qkv = da(qkv, NW);
    float *out = hf(NW);
    be->rope_forward(d_qkv, d_tab, &dsh, pos0);
    down_a(out, d_qkv, NW);
    rope_ref(&r);
    check(t->name, "forward", err_rel(out, r.out, NW), TOL_FWD);
    int vsame = 1;
    for (int i = 0; i < N; i++)
        for (int c = vcol; c < ld; c++) vsame = vsame && out[(size_t)i * ld + c] == qkv[(size_t)i * ld + c];
    check_exact(t->name, "v_untouched", vsame, "rope_forward changed v");

    double *g = hd(NW);
    fd_grad(rope_loss, &r, r.qkv, NW, g);
    void *d_R = da(R, NW);
    float *dq = hf(NW);
    be->rope_backward(d_R, d_tab, &dsh, pos0);
    down_a(dq, d_R, NW);
    check(t->name, "backward", err_rel(dq, g, NW), TOL_BWD);
}

/* ---- qknorm --------------------------------------------------------------- */

typedef struct {
    AttnShape s;
    int per_head;
    double *qkv, *qw, *kw, *R, *out, *rstd; /* qkv, R, out (N, QKVW); rstd (N, G) */
} QkRef;

static void qk_ref(QkRef *q) {
    int N = q->s.B * q->s.T, ld = attn_qkv_width(&q->s), HD = q->s.HD, NH = q->s.NH, NKV = q->s.NKV;
    int G = q->per_head ? NH + NKV : 2;
    memcpy(q->out, q->qkv, (size_t)N * ld * sizeof(double));
    for (int i = 0; i < N; i++)
        for (int g = 0; g < G; g++) {
            int isq = q->per_head ? g < NH : g == 0;
            int st = q->per_head ? g * HD : g ? NH * HD : 0, n = q->per_head ? HD : g ? NKV * HD : NH * HD;
            const double *x = q->qkv + (size_t)i * ld + st, *w = isq ? q->qw : q->kw;
            double s = 0.0;
            for (int c = 0; c < n; c++) s += x[c] * x[c];
            double r = 1.0 / sqrt(s / n + RMS_EPS);
            for (int c = 0; c < n; c++) q->out[(size_t)i * ld + st + c] = x[c] * r * w[c];
            q->rstd[(size_t)i * G + g] = r;
        }
}
static double qk_loss(void *ctx) {
    QkRef *q = ctx;
    qk_ref(q);
    return dot_d(q->out, q->R, (size_t)q->s.B * q->s.T * attn_qkv_width(&q->s));
}

/* t->opt: per_head. dqkv enters as R for the whole row: its v part must come
 * back unchanged (exact), its q, k parts as the gradient before the norm. */
static void test_qknorm(const OpTest *t) {
    AttnShape sh = {t->B, t->T, t->NH, t->NKV, t->HD, NULL};
    int per_head = t->opt, N = sh.B * sh.T, ld = attn_qkv_width(&sh), QK = (sh.NH + sh.NKV) * sh.HD;
    int G = per_head ? sh.NH + sh.NKV : 2, WQ = per_head ? sh.HD : sh.NH * sh.HD, WK = per_head ? sh.HD : sh.NKV * sh.HD;
    size_t NW = (size_t)N * ld;
    float *qkv = quant(randn(NW, 1.0f, 0.5f), NW), *R = quant(randn(NW, 1.0f, 0.0f), NW);
    float *qw = quant(randn(WQ, 0.5f, 1.0f), WQ), *kw = quant(randn(WK, 0.5f, 1.0f), WK);
    QkRef q = {sh, per_head, to_d(qkv, NW), to_d(qw, WQ), to_d(kw, WK), to_d(R, NW), hd(NW), hd((size_t)N * G)};
    void *d_qkv = da(qkv, NW), *d_in = da(NULL, (size_t)N * QK), *d_qw = da(qw, WQ), *d_kw = da(kw, WK);
    float *d_rstd = df(NULL, (size_t)N * G), *out = hf(NW), *in = hf((size_t)N * QK), *rstd = hf((size_t)N * G);
    be->qknorm_forward(d_qkv, d_in, d_rstd, d_qw, d_kw, &sh, per_head, (float)RMS_EPS);
    down_a(out, d_qkv, NW);
    down_a(in, d_in, (size_t)N * QK);
    down(rstd, d_rstd, (size_t)N * G);
    qk_ref(&q);
    check(t->name, "forward", err_rel(out, q.out, NW), TOL_FWD);
    check(t->name, "forward_rstd", err_rel(rstd, q.rstd, (size_t)N * G), TOL_FWD);
    int saved = 1;
    for (int i = 0; i < N; i++)
        saved = saved && memcmp(in + (size_t)i * QK, qkv + (size_t)i * ld, QK * sizeof(float)) == 0;
    check_exact(t->name, "qk_in", saved, "qk_in is not the q, k values before the norm");

    double *g = hd(NW), *gq = hd(WQ), *gk = hd(WK);
    for (int i = 0; i < N; i++) fd_grad(qk_loss, &q, q.qkv + (size_t)i * ld, QK, g + (size_t)i * ld);
    for (int i = 0; i < N; i++)
        for (int c = QK; c < ld; c++) g[(size_t)i * ld + c] = R[(size_t)i * ld + c]; /* v: dqkv unchanged */
    fd_grad(qk_loss, &q, q.qw, WQ, gq);
    fd_grad(qk_loss, &q, q.kw, WK, gk);
    void *d_d = da(R, NW);
    float *d_dqw = df(filled(WQ, NAN), WQ), *d_dkw = df(filled(WK, NAN), WK);
    float *dq = hf(NW), *dqw1 = hf(WQ), *dkw1 = hf(WK), *dqw2 = hf(WQ), *dkw2 = hf(WK);
    be->qknorm_backward(d_d, d_dqw, d_dkw, d_in, d_qw, d_kw, d_rstd, &sh, per_head, 0);
    down_a(dq, d_d, NW);
    down(dqw1, d_dqw, WQ);
    down(dkw1, d_dkw, WK);
    check(t->name, "backward", err_rel(dq, g, NW), TOL_BWD);
    check(t->name, "backward_dw", maxd(err_rel(dqw1, gq, WQ), err_rel(dkw1, gk, WK)), TOL_BWD);
    int vsame = 1;
    for (int i = 0; i < N; i++)
        for (int c = QK; c < ld; c++) vsame = vsame && dq[(size_t)i * ld + c] == R[(size_t)i * ld + c];
    check_exact(t->name, "v_untouched", vsame, "qknorm_backward changed dqkv's v part");
    void *d_d2 = da(R, NW); /* in place: a fresh incoming gradient */
    be->qknorm_backward(d_d2, d_dqw, d_dkw, d_in, d_qw, d_kw, d_rstd, &sh, per_head, 1);
    down(dqw2, d_dqw, WQ);
    down(dkw2, d_dkw, WK);
    check(t->name, "accumulate", maxd(err_twice(dqw2, dqw1, WQ), err_twice(dkw2, dkw1, WK)), TOL_ACC);
}

/* ---- swiglu --------------------------------------------------------------- */

typedef struct {
    int N, F;
    double *h, *R;
} SwiRef;

static double silu_d(double x) { return x / (1.0 + exp(-x)); }
static double swi_loss(void *ctx) {
    SwiRef *r = ctx;
    double s = 0.0;
    for (int i = 0; i < r->N; i++)
        for (int j = 0; j < r->F; j++)
            s += silu_d(r->h[(size_t)i * 2 * r->F + j]) * r->h[(size_t)i * 2 * r->F + r->F + j] * r->R[(size_t)i * r->F + j];
    return s;
}

static void test_swiglu(const OpTest *t) {
    int N = t->B * t->T, F = t->C;
    size_t NF = (size_t)N * F;
    float *h = randn(2 * NF, 2.0f, 0.0f), *R = quant(randn(NF, 1.0f, 0.0f), NF);
    h[0] = 30.0f, h[1] = -30.0f, h[2] = 0.0f; /* saturated gates and zero */
    quant(h, 2 * NF);
    SwiRef r = {N, F, to_d(h, 2 * NF), to_d(R, NF)};
    double *ref = hd(NF);
    for (int i = 0; i < N; i++)
        for (int j = 0; j < F; j++)
            ref[(size_t)i * F + j] = silu_d(r.h[(size_t)i * 2 * F + j]) * r.h[(size_t)i * 2 * F + F + j];
    void *d_h = da(h, 2 * NF), *d_out = da(NULL, NF);
    float *out = hf(NF);
    be->swiglu_forward(d_out, d_h, N, F);
    down_a(out, d_out, NF);
    check(t->name, "forward", err_rel(out, ref, NF), TOL_FWD);

    double *g = hd(2 * NF);
    fd_grad(swi_loss, &r, r.h, 2 * NF, g);
    void *d_R = da(R, NF), *d_dh = da(filled(2 * NF, NAN), 2 * NF);
    float *dh = hf(2 * NF);
    be->swiglu_backward(d_dh, d_R, d_h, N, F);
    down_a(dh, d_dh, 2 * NF);
    check(t->name, "backward", err_rel(dh, g, 2 * NF), TOL_BWD);
}

/* ---- moe ------------------------------------------------------------------ */
/* Rows: N = B T tokens, C the token width, E = V experts, K = Vp chosen per
 * token, opt bits MOE_SIGMOID, MOE_NORM (norm_topk), MOE_BIAS. */

#define MOE_SIGMOID 1
#define MOE_NORM 2
#define MOE_BIAS 4

/* p (E) = softmax or sigmoid of x (E); returns the logsumexp of x. */
static double moe_probs_d(const double *x, int E, int sigmoid, double *p) {
    double mx = -INFINITY, s = 0.0;
    for (int e = 0; e < E; e++) mx = x[e] > mx ? x[e] : mx;
    for (int e = 0; e < E; e++) s += exp(x[e] - mx);
    double lse = mx + log(s);
    for (int e = 0; e < E; e++) p[e] = sigmoid ? 1.0 / (1.0 + exp(-x[e])) : exp(x[e] - lse);
    return lse;
}

/* Router logits a backend sees (quantised). Separated: each row a random
 * permutation of E levels 0.5 apart plus noise 0.05, so no two scores are
 * near a tie and finite differences never cross a selection boundary. */
static float *moe_logits(int N, int E, int separated) {
    float *x = randn((size_t)N * E, 1.5f, 0.0f);
    if (separated) {
        int *perm = hbuf((size_t)E * sizeof(int));
        for (int t = 0; t < N; t++) {
            for (int e = 0; e < E; e++) perm[e] = e;
            for (int e = E - 1; e > 0; e--) {
                int j = (int)rng_below(&rng, (uint64_t)e + 1), tmp = perm[e];
                perm[e] = perm[j], perm[j] = tmp;
            }
            for (int e = 0; e < E; e++)
                x[(size_t)t * E + e] = 0.5f * (perm[e] - 0.5f * E) + 0.05f * rng_normal(&rng);
        }
    }
    return quant(x, (size_t)N * E);
}

static void test_moe_route(const OpTest *t) {
    int N = t->B * t->T, E = t->V, K = t->Vp, sig = !!(t->opt & MOE_SIGMOID), norm = !!(t->opt & MOE_NORM);
    size_t NE = (size_t)N * E, NK = (size_t)N * K;
    float *logits = moe_logits(N, E, 0), *bias = t->opt & MOE_BIAS ? randn(E, 0.1f, 0.0f) : NULL;
    double *x = to_d(logits, NE), *p = hd(NE), *gates = hd(NK), *stats = hd(E + 1);
    int32_t *topk = hbuf(NK * sizeof(int32_t));
    for (int e = 0; e <= E; e++) stats[e] = 0.0;
    for (int i = 0; i < N; i++) {
        double *pi = p + (size_t)i * E, lse = moe_probs_d(x + (size_t)i * E, E, sig, pi), sum = 0.0;
        /* Selection by sorting ranks: expert e beats f if its score is larger, or equal with e < f. */
        for (int e = 0; e < E; e++) {
            int rank = 0;
            for (int f = 0; f < E; f++) {
                double se = pi[e] + (bias ? bias[e] : 0.0), sf = pi[f] + (bias ? bias[f] : 0.0);
                rank += sf > se || (sf == se && f < e);
            }
            if (rank < K) topk[(size_t)i * K + rank] = e;
        }
        for (int k = 0; k < K; k++) sum += pi[topk[(size_t)i * K + k]];
        for (int k = 0; k < K; k++) gates[(size_t)i * K + k] = pi[topk[(size_t)i * K + k]] / (norm ? sum : 1.0);
        for (int e = 0; e < E; e++) stats[e] += pi[e];
        stats[E] += lse * lse;
    }
    void *d_x = da(logits, NE);
    float *d_bias = bias ? df(bias, E) : NULL, *d_g = df(NULL, NK), *d_p = df(NULL, NE), *d_s = df(NULL, E + 1);
    int32_t *d_topk = dbuf(NULL, NK * sizeof(int32_t)), *got_topk = hbuf(NK * sizeof(int32_t));
    float *got_g = hf(NK), *got_p = hf(NE), *got_s = hf(E + 1);
    be->moe_route(d_topk, d_g, d_p, d_s, d_x, d_bias, N, N, E, K, sig, norm);
    be->sync();
    be->to_host(got_topk, d_topk, NK * sizeof(int32_t));
    down(got_g, d_g, NK);
    down(got_p, d_p, NE);
    down(got_s, d_s, E + 1);
    check_exact(t->name, "topk", memcmp(got_topk, topk, NK * sizeof(int32_t)) == 0,
                "the chosen experts or their order differ from the reference");
    check(t->name, "probs", err_rel(got_p, p, NE), TOL_FWD);
    check(t->name, "gates", err_rel(got_g, gates, NK), TOL_FWD);
    check(t->name, "stats", maxd(err_rel(got_s, stats, E), err_rel(got_s + E, stats + E, 1)), TOL_FWD);

    /* Ties: equal logits (and no bias) give experts 0..K-1 in order; a second
     * call gives the same bits (exact). */
    void *d_eq = da(filled(NE, 0.25f), NE);
    int32_t *eq_topk = hbuf(NK * sizeof(int32_t));
    be->moe_route(d_topk, d_g, d_p, d_s, d_eq, NULL, N, N, E, K, sig, norm);
    be->sync();
    be->to_host(eq_topk, d_topk, NK * sizeof(int32_t));
    int ok = 1;
    for (size_t i = 0; i < NK; i++) ok = ok && eq_topk[i] == (int32_t)(i % K);
    check_exact(t->name, "ties_lower_index", ok, "equal scores did not go to the lower expert index");
    be->moe_route(d_topk, d_g, d_p, d_s, d_x, d_bias, N, N, E, K, sig, norm);
    float *g2 = hf(NK), *p2 = hf(NE), *s2 = hf(E + 1);
    int32_t *topk2 = hbuf(NK * sizeof(int32_t));
    be->sync();
    be->to_host(topk2, d_topk, NK * sizeof(int32_t));
    down(g2, d_g, NK);
    down(p2, d_p, NE);
    down(s2, d_s, E + 1);
    check_exact(t->name, "deterministic",
                !memcmp(topk2, got_topk, NK * sizeof(int32_t)) && !memcmp(g2, got_g, NK * 4) &&
                    !memcmp(p2, got_p, NE * 4) && !memcmp(s2, got_s, (E + 1) * 4),
                "two identical moe_route calls differ");
}

/* The dispatch reference, expert-major (a different loop order from a
 * counting sort): expert e's slots are those with topk == e in (t, k) order. */
static void dispatch_ref(int32_t *off, int32_t *row_of, int32_t *src, int32_t *counts, const int32_t *topk, int N,
                         int E, int K, int cap) {
    off[0] = 0;
    for (int e = 0; e < E; e++) {
        int n = 0;
        for (int i = 0; i < N * K; i++) {
            if (topk[i] != e) continue;
            if (cap <= 0 || n < cap) {
                row_of[i] = off[e] + n;
                src[off[e] + n] = i / K;
            } else {
                row_of[i] = -1;
            }
            n++;
        }
        counts[e] = n;
        off[e + 1] = off[e] + (cap > 0 && n > cap ? cap : n);
    }
}

/* Index work only (fp32_only). The last expert is never chosen: a zero-token
 * expert must have an empty row range. */
static void test_moe_dispatch(const OpTest *t) {
    int N = t->B * t->T, E = t->V, K = t->Vp;
    size_t NK = (size_t)N * K, I = sizeof(int32_t);
    int32_t *topk = hbuf(NK * I);
    for (int i = 0; i < N; i++)
        for (int k = 0; k < K; k++) {
            int e, dup;
            do {
                e = (int)rng_below(&rng, (uint64_t)E - 1), dup = 0;
                for (int j = 0; j < k; j++) dup = dup || topk[(size_t)i * K + j] == e;
            } while (dup);
            topk[(size_t)i * K + k] = e;
        }
    int32_t *d_topk = dbuf(topk, NK * I), *d_off = dbuf(NULL, (E + 1) * I), *d_row = dbuf(NULL, NK * I);
    int32_t *d_src = dbuf(NULL, NK * I), *d_cnt = dbuf(NULL, E * I);
    int caps[2] = {(int)(NK / E / 2), 0};
    const char *what[2] = {"cap", "dropless"};
    for (int c = 0; c < 2; c++) {
        int32_t *off = hbuf((E + 1) * I), *row = hbuf(NK * I), *src = hbuf(NK * I), *cnt = hbuf(E * I);
        int32_t *roff = hbuf((E + 1) * I), *rrow = hbuf(NK * I), *rsrc = hbuf(NK * I), *rcnt = hbuf(E * I);
        dispatch_ref(roff, rrow, rsrc, rcnt, topk, N, E, K, caps[c]);
        be->moe_dispatch(d_off, d_row, d_src, d_cnt, d_topk, N, N, E, K, caps[c]);
        be->sync();
        be->to_host(off, d_off, (E + 1) * I);
        be->to_host(row, d_row, NK * I);
        be->to_host(src, d_src, NK * I);
        be->to_host(cnt, d_cnt, E * I);
        int ok = !memcmp(off, roff, (E + 1) * I) && !memcmp(row, rrow, NK * I) && !memcmp(cnt, rcnt, E * I) &&
                 !memcmp(src, rsrc, (size_t)roff[E] * I);
        check_exact(t->name, what[c], ok, "offsets, row_of, src or counts differ from the reference");
        int drops = 0, want = 0;
        for (size_t i = 0; i < NK; i++) drops += row[i] < 0;
        for (int e = 0; e < E; e++) want += caps[c] > 0 && cnt[e] > caps[c] ? cnt[e] - caps[c] : 0;
        char w[32];
        snprintf(w, sizeof w, "%s_drops", what[c]);
        check_exact(t->name, w, drops == want && (c == 1 ? drops == 0 : drops > 0) && off[E] == (int)NK - drops,
                    "dropped slots do not match the loads over the capacity");
        if (c == 0) {
            int order = 1;
            for (int e = 0; e < E; e++)
                for (int r = off[e] + 1; r < off[e + 1]; r++) order = order && src[r - 1] <= src[r];
            check_exact(t->name, "token_order", order, "an expert's rows are not in token order");
        } else {
            check_exact(t->name, "zero_expert", cnt[E - 1] == 0 && off[E - 1] == off[E],
                        "an expert with no tokens has a non-empty row range");
        }
    }
}

/* Capped dispatch (context parallelism's chunks): a sequence of T tokens
 * cut into B chunks (groups of S = T / B), each chunk dispatched with the
 * limits the capacity leaves after the earlier chunks (cap minus their
 * loads, at least 0), keeps exactly the slots one dispatch of the whole
 * sequence with cap keeps; and limits all equal to cap are moe_dispatch.
 * Exact: index work. */
static void test_moe_dispatch_capped(const OpTest *t) {
    int G = t->B, T = t->T, S = T / G, N = T, E = t->V, K = t->Vp;
    size_t NK = (size_t)N * K, I = sizeof(int32_t), GE = (size_t)G * E;
    int32_t *topk = hbuf(NK * I);
    for (int i = 0; i < N; i++)
        for (int k = 0; k < K; k++) {
            int e, dup;
            do {
                e = (int)rng_below(&rng, (uint64_t)E), dup = 0;
                for (int j = 0; j < k; j++) dup = dup || topk[(size_t)i * K + j] == e;
            } while (dup);
            topk[(size_t)i * K + k] = e;
        }
    int cap = (int)(NK / E / 2); /* half the mean load: every chunk order matters */
    int32_t *d_topk = dbuf(topk, NK * I), *d_off = dbuf(NULL, (E + 1) * I), *d_row = dbuf(NULL, NK * I);
    int32_t *d_src = dbuf(NULL, NK * I), *d_cnt = dbuf(NULL, GE * I);
    int32_t *whole_row = hbuf(NK * I), *whole_off = hbuf((E + 1) * I), *cnt = hbuf(GE * I), *row = hbuf(NK * I);
    int32_t *off = hbuf((E + 1) * I), *caps = hbuf(GE * I);
    be->moe_dispatch(d_off, d_row, d_src, d_cnt, d_topk, N, T, E, K, cap);
    be->sync();
    be->to_host(whole_row, d_row, NK * I);
    be->to_host(whole_off, d_off, (E + 1) * I);
    /* the chunks' loads, then each chunk's limits */
    be->moe_dispatch(d_off, d_row, d_src, d_cnt, d_topk, N, S, E, K, 0);
    be->sync();
    be->to_host(cnt, d_cnt, GE * I);
    for (int e = 0; e < E; e++)
        for (int g = 0, before = 0; g < G; before += cnt[(size_t)g * E + e], g++)
            caps[(size_t)g * E + e] = cap > before ? cap - before : 0;
    int32_t *d_caps = dbuf(caps, GE * I);
    be->moe_dispatch_capped(d_off, d_row, d_src, d_cnt, d_topk, N, S, E, K, d_caps);
    be->sync();
    be->to_host(row, d_row, NK * I);
    be->to_host(off, d_off, (E + 1) * I);
    int same = !memcmp(off, whole_off, (E + 1) * I), drops = 0;
    for (size_t i = 0; i < NK; i++) same = same && (row[i] < 0) == (whole_row[i] < 0), drops += row[i] < 0;
    check_exact(t->name, "chunks_keep_the_sequence_slots", same && drops > 0,
                "the chunks' capped dispatch keeps other slots than the whole sequence's (or drops none)");
    /* limits all cap: the plain op, every output */
    for (size_t i = 0; i < GE; i++) caps[i] = cap;
    int32_t *d_caps2 = dbuf(caps, GE * I), *row2 = hbuf(NK * I), *off2 = hbuf((E + 1) * I);
    be->moe_dispatch(d_off, d_row, d_src, d_cnt, d_topk, N, S, E, K, cap);
    be->sync();
    be->to_host(row, d_row, NK * I);
    be->to_host(off, d_off, (E + 1) * I);
    be->moe_dispatch_capped(d_off, d_row, d_src, d_cnt, d_topk, N, S, E, K, d_caps2);
    be->sync();
    be->to_host(row2, d_row, NK * I);
    be->to_host(off2, d_off, (E + 1) * I);
    check_exact(t->name, "uniform_limits_are_moe_dispatch",
                !memcmp(row, row2, NK * I) && !memcmp(off, off2, (E + 1) * I),
                "limits all equal to cap differ from moe_dispatch with cap");
}

/* Sequences: with S = T < N, the router's statistics, the dispatch's loads,
 * capacity and drops, and the aux gradient are each sequence's alone, as if
 * each ran by itself (S = N = T): the figures then do not depend on how
 * sequences are grouped into micro-batches and ranks. Exact: each per-sequence
 * sum runs over the same rows in the same order. */
/* The expert owning permuted row r (offsets (E+1)). */
static int topk_expert_of(const int32_t *off, int E, int r) {
    int e = 0;
    while (e + 1 < E && off[e + 1] <= r) e++;
    return e;
}

static void test_moe_sequences(const OpTest *t) {
    int B = t->B, T = t->T, N = B * T, E = t->V, K = t->Vp, cap = 2;
    size_t NE = (size_t)N * E, NK = (size_t)N * K, I = sizeof(int32_t);
    float *logits = moe_logits(N, E, 0);
    void *d_x = da(logits, NE);
    float *d_g = df(NULL, NK), *d_p = df(NULL, NE), *d_s = df(NULL, (size_t)B * (E + 1));
    int32_t *d_topk = dbuf(NULL, NK * I), *d_off = dbuf(NULL, (E + 1) * I), *d_row = dbuf(NULL, NK * I);
    int32_t *d_src = dbuf(NULL, NK * I), *d_cnt = dbuf(NULL, (size_t)B * E * I);
    be->moe_route(d_topk, d_g, d_p, d_s, d_x, NULL, N, T, E, K, 0, 1);
    be->moe_dispatch(d_off, d_row, d_src, d_cnt, d_topk, N, T, E, K, cap);
    float *aux = randn((size_t)B * E, 0.1f, 0.0f), *dg = randn(NK, 1.0f, 0.0f);
    float *d_aux = df(aux, (size_t)B * E), *d_dg = df(dg, NK);
    void *d_dl = da(NULL, NE);
    be->moe_route_backward(d_dl, d_dg, d_p, d_topk, d_g, d_x, d_aux, 0.0f, N, T, E, K, 0, 1);
    be->sync();
    float *st = hf((size_t)B * (E + 1)), *dl = hf(NE);
    int32_t *off = hbuf((E + 1) * I), *row = hbuf(NK * I), *src = hbuf(NK * I), *cnt = hbuf((size_t)B * E * I);
    be->to_host(st, d_s, (size_t)B * (E + 1) * sizeof(float));
    down_a(dl, d_dl, NE);
    be->to_host(off, d_off, (E + 1) * I), be->to_host(row, d_row, NK * I);
    be->to_host(src, d_src, NK * I), be->to_host(cnt, d_cnt, (size_t)B * E * I);
    /* each sequence alone */
    int same_stats = 1, same_counts = 1, same_rows = 1, same_grad = 1, kept = 0;
    int32_t *cursor = hbuf((size_t)E * I);
    memset(cursor, 0, (size_t)E * I);
    float *st1 = hf(E + 1), *dl1 = hf((size_t)T * E);
    int32_t *off1 = hbuf((E + 1) * I), *row1 = hbuf((size_t)T * K * I), *src1 = hbuf((size_t)T * K * I);
    int32_t *cnt1 = hbuf((size_t)E * I);
    for (int b = 0; b < B; b++) {
        size_t r0 = (size_t)b * T;
        void *xb = (char *)d_x + r0 * E * be->act_bytes();
        int32_t *tb = d_topk + r0 * K;
        float *gb = d_g + r0 * K, *pb = d_p + r0 * E;
        be->moe_route(tb, gb, pb, d_s, xb, NULL, T, T, E, K, 0, 1);
        be->moe_dispatch(d_off, d_row, d_src, d_cnt, tb, T, T, E, K, cap);
        be->moe_route_backward(d_dl, d_dg + r0 * K, pb, tb, gb, xb, d_aux + (size_t)b * E, 0.0f, T, T, E, K, 0, 1);
        be->sync();
        be->to_host(st1, d_s, (E + 1) * sizeof(float));
        down_a(dl1, d_dl, (size_t)T * E);
        be->to_host(off1, d_off, (E + 1) * I), be->to_host(row1, d_row, (size_t)T * K * I);
        be->to_host(src1, d_src, (size_t)T * K * I), be->to_host(cnt1, d_cnt, (size_t)E * I);
        same_stats = same_stats && !memcmp(st1, st + (size_t)b * (E + 1), (E + 1) * sizeof(float));
        same_counts = same_counts && !memcmp(cnt1, cnt + (size_t)b * E, (size_t)E * I);
        same_grad = same_grad && !memcmp(dl1, dl + r0 * E, (size_t)T * E * sizeof(float));
        /* the micro-batch's rows of expert e: each sequence's kept slots in turn */
        for (int i = 0; i < T * K; i++) {
            int whole = row[r0 * K + (size_t)i];
            if (row1[i] < 0) {
                same_rows = same_rows && whole < 0;
                continue;
            }
            int e = topk_expert_of(off1, E, row1[i]);
            int want = off[e] + cursor[e] + (row1[i] - off1[e]);
            same_rows = same_rows && whole == want && src[whole] == (int)r0 + src1[row1[i]];
            kept++;
        }
        for (int e = 0; e < E; e++) cursor[e] += off1[e + 1] - off1[e];
    }
    check_exact(t->name, "stats", same_stats, "a sequence's router statistics differ from its own run");
    check_exact(t->name, "loads", same_counts, "a sequence's loads differ from its own run");
    check_exact(t->name, "capacity", same_rows && kept == off[E] && kept < N * K,
                "the capacity is not applied per sequence, or the rows are not each sequence's kept slots in turn");
    check_exact(t->name, "aux_grad", same_grad, "a sequence's router gradient differs from its own run");
    /* Routing is the same on one thread as on all (the CPU backend's
     * threads own rows and experts; other backends ignore the count). */
    int nt = omp_get_max_threads();
    omp_set_num_threads(1);
    be->moe_route(d_topk, d_g, d_p, d_s, d_x, NULL, N, T, E, K, 0, 1);
    be->moe_dispatch(d_off, d_row, d_src, d_cnt, d_topk, N, T, E, K, cap);
    be->sync();
    omp_set_num_threads(nt);
    float *st2 = hf((size_t)B * (E + 1));
    int32_t *row2 = hbuf(NK * I), *src2 = hbuf(NK * I);
    be->to_host(st2, d_s, (size_t)B * (E + 1) * sizeof(float));
    be->to_host(row2, d_row, NK * I), be->to_host(src2, d_src, NK * I);
    check_exact(t->name, "one_thread", !memcmp(st2, st, (size_t)B * (E + 1) * sizeof(float)) &&
                !memcmp(row2, row, NK * I) && !memcmp(src2, src, (size_t)off[E] * I),
                "routing on one thread differs from routing on all");
}

/* Dropless MoE equals the dense sum: gather, one product per expert on its
 * row range (backend matmul_forward: expert e is W_e (D = t->HD, C)),
 * combine; against sum_k gate_k W_{e_k} x_t in double. Then with a capacity
 * (most late tokens dropped): dropped slots add nothing, a token with every
 * slot dropped gets 0 and dgates 0 there; and moe_gather_backward's "+=". */
static void test_moe_dense(const OpTest *t) {
    int N = t->B * t->T, C = t->C, D = t->HD, E = t->V, K = t->Vp;
    size_t NK = (size_t)N * K, NC = (size_t)N * C, I = sizeof(int32_t);
    float *x = quant(randn(NC, 1.0f, 0.0f), NC), *W = quant(randn((size_t)E * D * C, 0.5f, 0.0f), (size_t)E * D * C);
    float *logits = moe_logits(N, E, 0);
    void *d_x = da(x, NC), *d_W = da(W, (size_t)E * D * C), *d_l = da(logits, (size_t)N * E);
    float *d_g = df(NULL, NK), *d_p = df(NULL, (size_t)N * E), *d_s = df(NULL, E + 1), *gates = hf(NK);
    int32_t *d_topk = dbuf(NULL, NK * I), *topk = hbuf(NK * I), *off = hbuf((E + 1) * I), *row = hbuf(NK * I);
    int32_t *d_off = dbuf(NULL, (E + 1) * I), *d_row = dbuf(NULL, NK * I), *d_src = dbuf(NULL, NK * I);
    int32_t *d_cnt = dbuf(NULL, E * I);
    void *d_xp = da(NULL, NK * C), *d_yp = da(NULL, NK * D), *d_out = da(NULL, (size_t)N * D);
    be->moe_route(d_topk, d_g, d_p, d_s, d_l, NULL, N, N, E, K, 0, 1);
    be->sync();
    be->to_host(topk, d_topk, NK * I);
    down(gates, d_g, NK);
    int caps[2] = {0, 3};
    for (int c = 0; c < 2; c++) {
        be->moe_dispatch(d_off, d_row, d_src, d_cnt, d_topk, N, N, E, K, caps[c]);
        be->sync();
        be->to_host(off, d_off, (E + 1) * I);
        be->to_host(row, d_row, NK * I);
        be->moe_gather(d_xp, d_x, d_src, off[E], C);
        for (int e = 0; e < E; e++)
            if (off[e + 1] > off[e])
                be->matmul_forward((char *)d_yp + (size_t)off[e] * D * ab, (char *)d_xp + (size_t)off[e] * C * ab,
                                   (char *)d_W + (size_t)e * D * C * ab, NULL, off[e + 1] - off[e], C, D);
        be->moe_combine(d_out, d_yp, d_g, d_row, N, K, D);
        float *out = hf((size_t)N * D);
        double *ref = hd((size_t)N * D);
        down_a(out, d_out, (size_t)N * D);
        int zero = 1, all_dropped = 0;
        for (int i = 0; i < N; i++) {
            int kept = 0;
            for (int d = 0; d < D; d++) {
                double s = 0.0;
                for (int k = 0; k < K; k++) {
                    if (row[(size_t)i * K + k] < 0) continue;
                    const float *w = W + ((size_t)topk[(size_t)i * K + k] * D + d) * C;
                    double y = 0.0;
                    for (int j = 0; j < C; j++) y += (double)w[j] * x[(size_t)i * C + j];
                    s += gates[(size_t)i * K + k] * y;
                }
                ref[(size_t)i * D + d] = s;
            }
            for (int k = 0; k < K; k++) kept += row[(size_t)i * K + k] >= 0;
            if (!kept) {
                all_dropped++;
                for (int d = 0; d < D; d++) zero = zero && out[(size_t)i * D + d] == 0.0f;
            }
        }
        check(t->name, c ? "capped_equals_dense" : "dropless_equals_dense", err_rel(out, ref, (size_t)N * D), TOL_FWD);
        if (c) {
            check_exact(t->name, "all_dropped_zero", zero && all_dropped > 0,
                        all_dropped ? "a token with every slot dropped got a non-zero output"
                                    : "the capacity dropped no token entirely (test shape too loose)");
            float *d_dg = df(filled(NK, NAN), NK), *dg = hf(NK);
            void *d_dyp = da(NULL, NK * D), *d_dout = da(randn((size_t)N * D, 1.0f, 0.0f), (size_t)N * D);
            be->moe_combine_backward(d_dyp, d_dg, d_dout, d_yp, d_g, d_row, N, K, D);
            down(dg, d_dg, NK);
            int dz = 1;
            for (size_t i = 0; i < NK; i++) dz = dz && (row[i] >= 0 ? isfinite(dg[i]) : dg[i] == 0.0f);
            check_exact(t->name, "dropped_dgates_zero", dz, "a dropped slot's dgates is not 0");
        }
    }
    /* gather_backward (capped rows, as left by the loop): dx += sum_k dxp[row_of] */
    float *prior = quant(randn(NC, 1.0f, 0.0f), NC), *dxp = quant(randn(NK * C, 1.0f, 0.0f), NK * C), *dx = hf(NC);
    double *g = hd(NC);
    for (int i = 0; i < N; i++)
        for (int j = 0; j < C; j++) {
            double s = 0.0;
            for (int k = 0; k < K; k++)
                if (row[(size_t)i * K + k] >= 0) s += dxp[(size_t)row[(size_t)i * K + k] * C + j];
            g[(size_t)i * C + j] = s;
        }
    void *d_dx = da(prior, NC), *d_dxp = da(dxp, NK * C);
    be->moe_gather_backward(d_dx, d_dxp, d_row, N, K, C);
    down_a(dx, d_dx, NC);
    check(t->name, "gather_backward_adds", err_rel(dx, plus(prior, g, 1.0, NC), NC), TOL_FWD);
}

/* The router's and combine's backward against finite differences of
 * L = sum(Rm . out) + sum_t,e aux_e probs_te + z mean_t lse_t^2, out_t =
 * sum_k gate_tk yp[row_of_tk], through the probs function and norm_topk with
 * the selection held fixed (the backend's topk). */
typedef struct {
    int N, E, K, D, sig, norm;
    const int32_t *topk, *row_of;
    double *logits, *yp, *Rm, *aux, z, *out; /* logits (N,E), yp (N K, D), Rm, out (N, D) */
} MoeRef;

static double moe_loss(void *ctx) {
    MoeRef *m = ctx;
    double L = 0.0, p[64];
    for (int t = 0; t < m->N; t++) {
        double lse = moe_probs_d(m->logits + (size_t)t * m->E, m->E, m->sig, p), S = 0.0;
        for (int k = 0; k < m->K; k++) S += p[m->topk[(size_t)t * m->K + k]];
        for (int d = 0; d < m->D; d++) {
            double o = 0.0;
            for (int k = 0; k < m->K; k++) {
                size_t s = (size_t)t * m->K + k;
                o += p[m->topk[s]] / (m->norm ? S : 1.0) * m->yp[(size_t)m->row_of[s] * m->D + d];
            }
            m->out[(size_t)t * m->D + d] = o;
            L += m->Rm[(size_t)t * m->D + d] * o;
        }
        for (int e = 0; e < m->E; e++) L += m->aux[e] * p[e];
        L += m->z * lse * lse / m->N;
    }
    return L;
}

static void test_moe_backward(const OpTest *t) {
    int N = t->B * t->T, D = t->C, E = t->V, K = t->Vp, sig = !!(t->opt & MOE_SIGMOID), norm = !!(t->opt & MOE_NORM);
    size_t NK = (size_t)N * K, NE = (size_t)N * E, ND = (size_t)N * D, I = sizeof(int32_t);
    const float z = 0.3f; /* larger than a run's 1e-3, so the term shows in the gradient */
    float *logits = moe_logits(N, E, 1), *yp = quant(randn(NK * D, 1.0f, 0.0f), NK * D);
    float *Rm = quant(randn(ND, 1.0f, 0.0f), ND), *aux = randn(E, 0.1f, 0.0f);
    void *d_l = da(logits, NE), *d_yp = da(yp, NK * D), *d_Rm = da(Rm, ND), *d_out = da(NULL, ND);
    float *d_g = df(NULL, NK), *d_p = df(NULL, NE), *d_s = df(NULL, E + 1), *d_aux = df(aux, E);
    int32_t *d_topk = dbuf(NULL, NK * I), *topk = hbuf(NK * I), *row = hbuf(NK * I);
    int32_t *d_off = dbuf(NULL, (E + 1) * I), *d_row = dbuf(NULL, NK * I), *d_src = dbuf(NULL, NK * I);
    int32_t *d_cnt = dbuf(NULL, E * I);
    be->moe_route(d_topk, d_g, d_p, d_s, d_l, NULL, N, N, E, K, sig, norm);
    be->moe_dispatch(d_off, d_row, d_src, d_cnt, d_topk, N, N, E, K, 0);
    be->sync();
    be->to_host(topk, d_topk, NK * I);
    be->to_host(row, d_row, NK * I);
    MoeRef m = {N, E, K, D, sig, norm, topk, row, to_d(logits, NE), to_d(yp, NK * D), to_d(Rm, ND), to_d(aux, E), z, hd(ND)};
    moe_loss(&m);
    float *out = hf(ND);
    be->moe_combine(d_out, d_yp, d_g, d_row, N, K, D);
    down_a(out, d_out, ND);
    check(t->name, "combine", err_rel(out, m.out, ND), TOL_FWD);

    double *glog = hd(NE), *gyp = hd(NK * D), *gg = hd(NK);
    fd_grad(moe_loss, &m, m.logits, NE, glog);
    fd_grad(moe_loss, &m, m.yp, NK * D, gyp);
    for (size_t s = 0; s < NK; s++) gg[s] = dot_d(m.Rm + (s / K) * D, m.yp + (size_t)row[s] * D, D);
    float *d_dg = df(filled(NK, NAN), NK), *dg = hf(NK), *dyp = hf(NK * D), *dl = hf(NE);
    void *d_dyp = da(filled(NK * D, NAN), NK * D), *d_dl = da(filled(NE, NAN), NE);
    be->moe_combine_backward(d_dyp, d_dg, d_Rm, d_yp, d_g, d_row, N, K, D);
    be->moe_route_backward(d_dl, d_dg, d_p, d_topk, d_g, d_l, d_aux, z, N, N, E, K, sig, norm);
    down(dg, d_dg, NK);
    down_a(dyp, d_dyp, NK * D);
    down_a(dl, d_dl, NE);
    check(t->name, "combine_backward_dyp", err_rel(dyp, gyp, NK * D), TOL_BWD);
    check(t->name, "combine_backward_dgates", err_rel(dg, gg, NK), TOL_FWD);
    check(t->name, "route_backward", err_rel(dl, glog, NE), TOL_BWD);
}

/* ---------------------------------------------------------------------------
 * The table. Small shapes keep the finite differences fast; the "_odd" cases
 * use sizes that are not multiples of the SIMD width or the thread count. */

static const OpTest op_tests[] = {
    /* name                run             B  T   C  NH   V    Vp  fp32_only NKV HD opt */
    {"embed",            test_embed,       2, 5,  8,  0,  11,   16, 0, 0, 0, 0},
    {"embed_odd",        test_embed,       3, 7,  5,  0,  13,   13, 0, 0, 0, 0},
    {"layernorm",        test_layernorm,   2, 5,  8,  0,   0,    0, 0, 0, 0, 0},
    {"layernorm_odd",    test_layernorm,   1, 7, 37,  0,   0,    0, 0, 0, 0, 0},
    {"matmul",           test_matmul,      2, 5,  8,  0,  11,    0, 0, 0, 0, 0},
    {"matmul_odd",       test_matmul,      1, 7, 37,  0,  13,    0, 0, 0, 0, 0},
    {"attention",        test_attention,   2, 5,  8,  2,   0,    0, 0, 0, 0, 0},
    {"attention_odd",    test_attention,   2, 7, 15,  3,   0,    0, 0, 0, 0, 0},
    /* T over the CPU backend's 64-row query blocks: two blocks, the last partial. */
    {"attention_blocks", test_attention,   1, 70, 6,  2,   0,    0, 0, 0, 0, 0},
    /* hs 16, a multiple of 16: on CUDA with bf16 the tensor-core kernels
     * (precision.attention auto), two 64-row tiles, the last partial. */
    {"attention_hs16",   test_attention,   1, 70, 16, 1,   0,    0, 0, 0, 0, 0},
    {"gelu",             test_gelu,        1, 1, 1003, 0,  0,    0, 0, 0, 0, 0},
    /* OC 16: a GeLU aux cuBLASLt takes; 13: one it cannot (ld not a multiple
     * of 8), so the CUDA backend's fallback runs */
    {"matmul_gelu",      test_matmul_gelu, 2, 5,  8,  0,  16,    0, 0, 0, 0, 0},
    {"matmul_gelu_odd",  test_matmul_gelu, 1, 7, 37,  0,  13,    0, 0, 0, 0, 0},
    {"add",              test_add,         1, 1, 1003, 0,  0,    0, 0, 0, 0, 0},
    {"crossentropy",     test_crossentropy, 2, 5, 0,  0,  11,   16, 0, 0, 0, 0},
    {"crossentropy_odd", test_crossentropy, 1, 3, 0,  0, 997, 1024, 0, 0, 0, 0},
    /* tp 2: slices of 8 hold 8 and 3 real columns; tp 4 over 1024: the last
     * holds 229; tp 4 over 16: ranks 2 and 3 hold none */
    {"xent_tp2",         test_xent_parallel, 2, 5, 0, 2,  11,   16, 0, 0, 0, 0},
    {"xent_tp4_odd",     test_xent_parallel, 1, 3, 0, 4, 997, 1024, 0, 0, 0, 0},
    {"xent_tp4_empty",   test_xent_parallel, 2, 3, 0, 4,  11,   32, 0, 0, 0, 0},
    {"embed_vocab_parallel", test_embed,   2, 5,  8,  0,  11,   16, 0, 0, 0, 1},
    {"adamw",            test_adamw,       1, 1, 1037, 0,  0,    0, 1, 0, 0, 0},
    {"sumsq",            test_sumsq,       1, 1, 100003, 0, 0,   0, 1, 0, 0, 0},
    /* Llama ops on odd shapes (no multiple of 8, 16 or 64). GQA: NH 6 over
     * NKV 2, then multi-query (NKV 1), HD 10 independent of C. RoPE: V is pos0. */
    {"attention_gqa",    test_attention_gqa, 1, 37, 0, 6,  0,    0, 0,        2, 10, 0},
    {"attention_mqa",    test_attention_gqa, 1, 37, 0, 6,  0,    0, 0,        1, 10, 0},
    /* Block attention (context parallelism): T is Tq, C is Tk, V q_pos, Vp
     * k_pos. A partly visible block (row 0 sees 6 keys, rows 3 on all 9);
     * a diagonal one (the chunk against itself); one wholly in the past; one
     * whose first queries see nothing (out 0, lse -inf); and one over the
     * CPU's 64-row query blocks, none a multiple of any block size. */
    {"attention_doc",    test_attention_doc, 2, 37, 0, 4,  0,    0, 0,        2, 6, 0},
    {"attention_doc_blocks", test_attention_doc, 2, 70, 0, 2, 0, 0, 0,        1, 4, 0},
    /* hs 16, NKV = NH: on CUDA with bf16 the tensor cores (never cuDNN,
     * whose graphs know only the causal mask) */
    {"attention_doc_hs16", test_attention_doc, 1, 70, 0, 1, 0, 0, 0,          1, 16, 0},
    {"attention_block",  test_attention_block, 2, 7, 9, 4, 10,   5, 0,        2, 6, 0},
    {"attention_block_diag", test_attention_block, 1, 13, 13, 6, 0, 0, 0,     2, 10, 0},
    {"attention_block_past", test_attention_block, 2, 5, 11, 3, 20, 0, 0,     1, 8, 0},
    {"attention_block_empty_rows", test_attention_block, 1, 8, 6, 2, 0, 3, 0, 2, 6, 0},
    {"attention_block_rows70", test_attention_block, 1, 70, 67, 2, 30, 0, 0,  1, 4, 0},
    {"attention_block_doc", test_attention_block, 2, 7, 9, 4, 10,   5, 0,     2, 6, 1},
    {"attention_block_doc_diag", test_attention_block, 1, 13, 13, 6, 0, 0, 0, 2, 10, 1},
    {"attention_block_doc_rows70", test_attention_block, 1, 70, 67, 2, 30, 0, 0, 1, 4, 1},
    {"rmsnorm",          test_rmsnorm,     1, 37, 70, 0,   0,    0, 0, 0, 0, 0},
    /* the residual add fused with the norm after it: LayerNorm with and
     * without a bias, RMSNorm; C 37 (no 16-byte packs) and 48 (packs) */
    {"residual_layernorm", test_residual_norm, 1, 37, 37, 0, 0,  0, 0, 0, 0, 0},
    {"residual_layernorm_nobias", test_residual_norm, 2, 5, 48, 0, 0, 0, 0, 0, 0, 2},
    {"residual_rmsnorm", test_residual_norm, 1, 37, 48, 0, 0,    0, 0, 0, 0, 1},
    {"rope",             test_rope,        2, 9,  0,  3,   0,    0, 0,        1, 18, 0},
    {"rope_pos0",        test_rope,        1, 7,  0,  6,  13,    0, 0,        2, 10, 0},
    {"rope_doc",         test_rope,        2, 9,  0,  3,   0,    0, 0,        1, 18, 1},
    {"rope_doc_pos0",    test_rope,        1, 7,  0,  6,  13,    0, 0,        2, 10, 1},
    {"qknorm_head",      test_qknorm,      2, 5,  0,  3,   0,    0, 0,        1, 18, 1},
    {"qknorm_full",      test_qknorm,      2, 5,  0,  6,   0,    0, 0,        2, 10, 0},
    {"swiglu",           test_swiglu,      1, 37, 45, 0,   0,    0, 0, 0, 0, 0},
    /* MoE: V is E, Vp is K, opt MOE_*; dense: C in, HD out per expert. */
    {"moe_route_softmax", test_moe_route,  1, 37, 0,  0,   7,    3, 0,        0, 0, MOE_NORM},
    {"moe_route_sigmoid_bias", test_moe_route, 1, 37, 0, 0, 9,   2, 0,        0, 0, MOE_SIGMOID | MOE_NORM | MOE_BIAS},
    {"moe_route_raw",    test_moe_route,   1, 37, 0,  0,   5,    2, 0,        0, 0, 0},
    {"moe_dispatch",     test_moe_dispatch, 1, 37, 0, 0,   6,    2, 1, 0, 0, 0},
    {"moe_sequences",    test_moe_sequences, 3, 13, 0, 0,  5,    2, 0, 0, 0, 0},
    {"moe_dispatch_capped", test_moe_dispatch_capped, 4, 40, 0, 0, 5, 2, 1, 0, 0, 0},
    {"moe_dense",        test_moe_dense,   1, 37, 10, 0,   5,    2, 0,        0, 6, 0},
    {"moe_backward_softmax", test_moe_backward, 1, 13, 5, 0, 7,  3, 0,        0, 0, 0},
    {"moe_backward_softmax_norm", test_moe_backward, 1, 13, 5, 0, 7, 3, 0,    0, 0, MOE_NORM},
    {"moe_backward_sigmoid", test_moe_backward, 1, 13, 5, 0, 7,  3, 0,        0, 0, MOE_SIGMOID},
    {"moe_backward_sigmoid_norm", test_moe_backward, 1, 13, 5, 0, 7, 3, 0,    0, 0, MOE_SIGMOID | MOE_NORM},
};

/* Run the table on `be` under `tag` (with the activation dtype be has now);
 * with act_only, the ops that have activation tensors. */
static void run_table(const char *tag, double scale, int act_only) {
    label = tag;
    tol_scale = scale;
    ab = be->act_bytes();
    rng_seed(&rng, 1234);
    for (size_t i = 0; i < sizeof op_tests / sizeof op_tests[0]; i++) {
        if (act_only && op_tests[i].fp32_only) continue;
        op_tests[i].run(&op_tests[i]);
        bufs_free();
    }
}

/* memory_peak on a backend whose alloc this process counts itself (the
 * CPU's: requested bytes, backend.h): after a fresh init the peak is the
 * bytes still live, each alloc raises it by its request while it is the
 * highest, a free lowers only the live count. Exact: sizes are integers. */
static void check_memory_peak(const Backend *b) {
    char name[64];
    snprintf(name, sizeof name, "ops_%s_memory_peak", b->name);
    b->shutdown();
    b->init(0);
    size_t base = b->memory_peak();
    void *p = b->alloc(1000), *q = b->alloc(3000); /* not multiples of the alignment */
    size_t two = b->memory_peak();
    b->free(p);
    void *r = b->alloc(500); /* live 3500 < 4000: no new peak */
    size_t after_free = b->memory_peak();
    b->free(q), b->free(r);
    void *s = b->alloc(4001); /* live 4001: one byte over */
    size_t last = b->memory_peak();
    b->free(s);
    b->free(NULL); /* a no-op, as free(NULL) */
    test_report(two == base + 4000 && after_free == base + 4000 && last == base + 4001 && b->memory_peak() == last,
                name, "base %zu: peaks %zu %zu %zu, wanted +4000 +4000 +4001", base, two, after_free, last);
}

int main(int argc, char **argv) {
    /* Default: every backend this build holds, then emu_bf16; or the one
     * named on the command line. */
    const char *names[] = {"cpu", "cuda", "emu_bf16"};
    int nb = 3;
    if (argc > 1) names[0] = argv[1], nb = 1;
    /* emu_bf16 with the fused ops as the composition of its own
     * (fused_compose.h), so their checks and bf16 tolerances run here too */
    static Backend emu_plain;
    emu_plain = emu_bf16_backend();
    Backend emu = compose_fused(&emu_plain);
    for (int k = 0; k < nb; k++) {
        if (strcmp(names[k], "emu_bf16") == 0) {
            be = &emu;
            be->init(0);
            run_table(be->name, TOL_BF16_SCALE, 1);
            be->shutdown();
            continue;
        }
        be = backend_get(names[k]);
        char name[64];
        snprintf(name, sizeof name, "ops_%s", names[k]);
        if (!be) {
            if (argc > 1) test_report(0, name, "backend not in this build");
            continue;
        }
        if (!backend_available(names[k])) {
            /* Compiled in, but no device here (CI): say so, do not fail. */
            printf("skip %s: no GPU\n", name);
            continue;
        }
        be->init(0);
        if (be->set_precision) {
            be->set_precision("fp32");
            run_table(be->name, 1.0, 0);
            be->set_precision("bf16");
            char tag[32];
            snprintf(tag, sizeof tag, "%s_bf16", be->name);
            run_table(tag, TOL_BF16_SCALE, 1);
        } else {
            run_table(be->name, 1.0, 0);
        }
        if (be->memory_peak && be->host_mem) check_memory_peak(be);
        be->shutdown();
    }
    return 0;
}
