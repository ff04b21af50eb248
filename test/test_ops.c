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
            e->out[(size_t)i * e->C + c] = e->wte[(size_t)e->tok[i] * e->C + c] +
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
    be->embed_backward(d_dwte, d_dwpe, d_R, d_tok, B, T, C, 0);
    down(dwte1, d_dwte, (size_t)Vp * C);
    down(dwpe1, d_dwpe, (size_t)T * C);
    check(t->name, "backward_dwte", err_rel(dwte1, plus(garbage, gwte, 1.0, (size_t)Vp * C), (size_t)Vp * C), TOL_BWD);
    check(t->name, "backward_dwpe", err_rel(dwpe1, gwpe, (size_t)T * C), TOL_BWD);

    float *dwte2 = hf((size_t)Vp * C), *dwpe2 = hf((size_t)T * C);
    be->embed_backward(d_dwte, d_dwpe, d_R, d_tok, B, T, C, 1);
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

typedef struct {
    int B, T, C, NH;
    double *qkv, *R, *out, *lse;
} AttRef;

static void att_ref(AttRef *a) {
    int T = a->T, C = a->C, NH = a->NH, hs = C / NH;
    double s[T];
    for (int b = 0; b < a->B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                const double *q = a->qkv + ((size_t)b * T + t) * 3 * C + h * hs;
                double mx = -INFINITY, sum = 0.0;
                for (int j = 0; j <= t; j++) {
                    s[j] = dot_d(q, a->qkv + ((size_t)b * T + j) * 3 * C + C + h * hs, hs) / sqrt(hs);
                    mx = s[j] > mx ? s[j] : mx;
                }
                for (int j = 0; j <= t; j++) sum += exp(s[j] - mx);
                double *o = a->out + ((size_t)b * T + t) * C + h * hs;
                for (int c = 0; c < hs; c++) o[c] = 0.0;
                for (int j = 0; j <= t; j++) {
                    const double *v = a->qkv + ((size_t)b * T + j) * 3 * C + 2 * C + h * hs;
                    for (int c = 0; c < hs; c++) o[c] += exp(s[j] - mx) / sum * v[c];
                }
                a->lse[((size_t)b * NH + h) * T + t] = mx + log(sum);
            }
}
static double att_loss(void *ctx) {
    AttRef *a = ctx;
    att_ref(a);
    return dot_d(a->out, a->R, (size_t)a->B * a->T * a->C);
}

static void test_attention(const OpTest *t) {
    int B = t->B, T = t->T, C = t->C, NH = t->NH, N = B * T;
    size_t N3 = (size_t)N * 3 * C, NC = (size_t)N * C, NL = (size_t)B * NH * T;
    float *qkv = quant(randn(N3, 1.0f, 0.0f), N3), *R = quant(randn(NC, 1.0f, 0.0f), NC);
    AttRef a = {B, T, C, NH, to_d(qkv, N3), to_d(R, NC), hd(NC), hd(NL)};
    void *d_qkv = da(qkv, N3), *d_out = da(NULL, NC);
    float *d_lse = df(NULL, NL);
    float *out = hf(NC), *lse = hf(NL);
    be->attention_forward(d_out, d_lse, d_qkv, &(AttnShape){B, T, NH, NH, C / NH});
    down_a(out, d_out, NC);
    down(lse, d_lse, NL);
    att_ref(&a);
    check(t->name, "forward", err_rel(out, a.out, NC), TOL_FWD);
    check(t->name, "forward_lse", err_rel(lse, a.lse, NL), TOL_FWD);

    double *g = hd(N3);
    fd_grad(att_loss, &a, a.qkv, N3, g);
    void *d_dqkv = da(filled(N3, NAN), N3), *d_R = da(R, NC);
    float *dqkv = hf(N3), *dqkv2 = hf(N3);
    be->attention_backward(d_dqkv, d_R, d_qkv, d_out, d_lse, &(AttnShape){B, T, NH, NH, C / NH});
    down_a(dqkv, d_dqkv, N3);
    check(t->name, "backward", err_rel(dqkv, g, N3), TOL_BWD);

    /* Same inputs, same bits: no races, no order-dependent sums (exact). */
    be->attention_backward(d_dqkv, d_R, d_qkv, d_out, d_lse, &(AttnShape){B, T, NH, NH, C / NH});
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
    be->attention_forward(d_out, d_lse, d_qkv2, &(AttnShape){B, T, NH, NH, C / NH});
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
    be->attention_forward(d_out, d_lse, d_qkv3, &(AttnShape){B, T, NH, NH, C / NH});
    down_a(out, d_out, NC);
    down(lse, d_lse, NL);
    check(t->name, "large_scores", maxd(err_rel(out, a.out, NC), err_rel(lse, a.lse, NL)), TOL_LARGE);
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
        printf("skip ops_%s_%s: the backend offers no fused matmul + GeLU ops\n", label, t->name);
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
        be->adamw_update(d_p, d_g, d_m, d_v, n, lr, b1, b2, eps, wd, gs, step);
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

/* ---------------------------------------------------------------------------
 * The table. Small shapes keep the finite differences fast; the "_odd" cases
 * use sizes that are not multiples of the SIMD width or the thread count. */

static const OpTest op_tests[] = {
    /* name                run             B  T   C  NH   V    Vp  fp32_only */
    {"embed",            test_embed,       2, 5,  8,  0,  11,   16, 0},
    {"embed_odd",        test_embed,       3, 7,  5,  0,  13,   13, 0},
    {"layernorm",        test_layernorm,   2, 5,  8,  0,   0,    0, 0},
    {"layernorm_odd",    test_layernorm,   1, 7, 37,  0,   0,    0, 0},
    {"matmul",           test_matmul,      2, 5,  8,  0,  11,    0, 0},
    {"matmul_odd",       test_matmul,      1, 7, 37,  0,  13,    0, 0},
    {"attention",        test_attention,   2, 5,  8,  2,   0,    0, 0},
    {"attention_odd",    test_attention,   2, 7, 15,  3,   0,    0, 0},
    /* T over the CPU backend's 64-row query blocks: two blocks, the last partial. */
    {"attention_blocks", test_attention,   1, 70, 6,  2,   0,    0, 0},
    /* hs 16, a multiple of 16: on CUDA with bf16 the tensor-core kernels
     * (precision.attention auto), two 64-row tiles, the last partial. */
    {"attention_hs16",   test_attention,   1, 70, 16, 1,   0,    0, 0},
    {"gelu",             test_gelu,        1, 1, 1003, 0,  0,    0, 0},
    /* OC 16: a GeLU aux cuBLASLt takes; 13: one it cannot (ld not a multiple
     * of 8), so the CUDA backend's fallback runs */
    {"matmul_gelu",      test_matmul_gelu, 2, 5,  8,  0,  16,    0, 0},
    {"matmul_gelu_odd",  test_matmul_gelu, 1, 7, 37,  0,  13,    0, 0},
    {"add",              test_add,         1, 1, 1003, 0,  0,    0, 0},
    {"crossentropy",     test_crossentropy, 2, 5, 0,  0,  11,   16, 0},
    {"crossentropy_odd", test_crossentropy, 1, 3, 0,  0, 997, 1024, 0},
    {"adamw",            test_adamw,       1, 1, 1037, 0,  0,    0, 1},
    {"sumsq",            test_sumsq,       1, 1, 100003, 0, 0,   0, 1},
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
        be->shutdown();
    }
    return 0;
}
