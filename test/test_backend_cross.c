/* test_backend_cross: every op of an accelerator backend against the CPU
 * backend at GPT-2 shapes (head sizes 32, 64 and 128, T = 256, C = 768), on
 * fresh random inputs. test_ops checks each op against double references at
 * small shapes; this one reaches the tile, block and head-size paths that only
 * real shapes take. With no GPU it prints one "skip" line. */
#include "backend.h"
#include "test.h"
#include "util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Tolerances, relative to max |cpu| of the tensor compared.
 * TOL_X 1e-5: fp32 both sides, sums of a few hundred terms in different
 *   orders: a few 1e-7 each way, 1e-5 leaves a margin and catches any real bug.
 * TOL_X_SUM 1e-4: sums over the 512 rows (dw, dbias, dwpe, LayerNorm's
 *   dw/db) and attention's backward, whose p (dp - D) subtracts nearly equal
 *   terms: rounding grows with the row count and the cancellation.
 * TOL_X_BF16 2e-2: matrix products from bf16-rounded inputs (2^-9 relative
 *   each) over C = 768 terms with random signs, fp32 accumulation.
 * "exact": embed_backward's dwte and AdamW are written to add in the CPU's
 *   order without fused multiply-adds, so their bits must agree. */
#define TOL_X 1e-5
#define TOL_X_SUM 1e-4
#define TOL_X_BF16 2e-2

static const Backend *cpu, *dev;
static Rng rng;

static float *rnd(size_t n, float scale) {
    float *x = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = scale * rng_normal(&rng);
    return x;
}
static float *up(const float *h, size_t n) {
    float *d = dev->alloc(n * sizeof(float));
    dev->to_device(d, h, n * sizeof(float));
    return d;
}
/* max |got - ref| / max |ref| with `got` on the device; infinite on NaN. */
static double xerr(const float *dgot, const float *ref, size_t n) {
    float *got = xmalloc(n * sizeof(float));
    dev->sync();
    dev->to_host(got, dgot, n * sizeof(float));
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - ref[i]);
        if (isnan(d)) num = INFINITY;
        num = d > num ? d : num;
        den = fabs(ref[i]) > den ? fabs(ref[i]) : den;
    }
    free(got);
    return num / (den > 0 ? den : 1.0);
}
static int xsame(const float *dgot, const float *ref, size_t n) {
    float *got = xmalloc(n * sizeof(float));
    dev->sync();
    dev->to_host(got, dgot, n * sizeof(float));
    int same = memcmp(got, ref, n * sizeof(float)) == 0;
    free(got);
    return same;
}
static void report(const char *what, double err, double tol) {
    char name[96];
    snprintf(name, sizeof name, "cross_%s_%s", dev->name, what);
    test_report(err <= tol, name, "max relative difference to the cpu backend %.3g > %.3g", err, tol);
}

static void cross_attention(int B, int T, int C, int NH) {
    size_t N = (size_t)B * T, n3 = N * 3 * C, nc = N * C, nl = (size_t)B * NH * T;
    float *qkv = rnd(n3, 1.0f), *dout = rnd(nc, 1.0f);
    float *out = xmalloc(nc * 4), *lse = xmalloc(nl * 4), *dqkv = xmalloc(n3 * 4);
    cpu->attention_forward(out, lse, qkv, B, T, C, NH);
    cpu->attention_backward(dqkv, dout, qkv, out, lse, B, T, C, NH);
    float *d_qkv = up(qkv, n3), *d_dout = up(dout, nc);
    float *d_out = dev->alloc(nc * 4), *d_lse = dev->alloc(nl * 4), *d_dqkv = dev->alloc(n3 * 4);
    dev->attention_forward(d_out, d_lse, d_qkv, B, T, C, NH);
    dev->attention_backward(d_dqkv, d_dout, d_qkv, d_out, d_lse, B, T, C, NH);
    char what[64];
    snprintf(what, sizeof what, "attention_hs%d_forward", C / NH);
    report(what, fmax(xerr(d_out, out, nc), xerr(d_lse, lse, nl)), TOL_X);
    snprintf(what, sizeof what, "attention_hs%d_backward", C / NH);
    report(what, xerr(d_dqkv, dqkv, n3), TOL_X_SUM);
    free(qkv), free(dout), free(out), free(lse), free(dqkv);
    dev->free(d_qkv), dev->free(d_dout), dev->free(d_out), dev->free(d_lse), dev->free(d_dqkv);
}

static void cross_matmul(int N, int C, int OC, const char *tag, double tol_fwd, double tol_bwd) {
    size_t nc = (size_t)N * C, oc = (size_t)OC * C, no = (size_t)N * OC;
    float *inp = rnd(nc, 1.0f), *w = rnd(oc, 0.05f), *bias = rnd(OC, 1.0f), *dout = rnd(no, 1.0f);
    float *out = xmalloc(no * 4), *dinp = xmalloc(nc * 4), *dw = xmalloc(oc * 4), *db = xmalloc(OC * 4);
    cpu->matmul_forward(out, inp, w, bias, N, C, OC);
    cpu->matmul_backward(dinp, dw, db, dout, inp, w, N, C, OC, 0);
    float *d_inp = up(inp, nc), *d_w = up(w, oc), *d_bias = up(bias, OC), *d_dout = up(dout, no);
    float *d_out = dev->alloc(no * 4), *d_dinp = dev->alloc(nc * 4), *d_dw = dev->alloc(oc * 4);
    float *d_db = dev->alloc(OC * 4);
    dev->matmul_forward(d_out, d_inp, d_w, d_bias, N, C, OC);
    dev->matmul_backward(d_dinp, d_dw, d_db, d_dout, d_inp, d_w, N, C, OC, 0);
    char what[64];
    snprintf(what, sizeof what, "%s_forward", tag);
    report(what, xerr(d_out, out, no), tol_fwd);
    snprintf(what, sizeof what, "%s_backward", tag);
    report(what, fmax(fmax(xerr(d_dinp, dinp, nc), xerr(d_dw, dw, oc)), xerr(d_db, db, OC)), tol_bwd);
    free(inp), free(w), free(bias), free(dout), free(out), free(dinp), free(dw), free(db);
    dev->free(d_inp), dev->free(d_w), dev->free(d_bias), dev->free(d_dout), dev->free(d_out);
    dev->free(d_dinp), dev->free(d_dw), dev->free(d_db);
}

static void cross_rest(int B, int T, int C, int V, int Vp) {
    size_t N = (size_t)B * T, nc = N * C;
    /* LayerNorm */
    float *x = rnd(nc, 1.0f), *w = rnd(C, 1.0f), *b = rnd(C, 1.0f), *dout = rnd(nc, 1.0f);
    for (size_t i = 0; i < nc; i++) x[i] += 3.0f;
    float *out = xmalloc(nc * 4), *mean = xmalloc(N * 4), *rstd = xmalloc(N * 4);
    float *dinp = xcalloc(nc, 4), *dw = xmalloc(C * 4), *db = xmalloc(C * 4);
    cpu->layernorm_forward(out, mean, rstd, x, w, b, (int)N, C);
    cpu->layernorm_backward(dinp, dw, db, dout, x, w, mean, rstd, (int)N, C, 0);
    float *d_x = up(x, nc), *d_w = up(w, C), *d_b = up(b, C), *d_dout = up(dout, nc);
    float *d_out = dev->alloc(nc * 4), *d_mean = dev->alloc(N * 4), *d_rstd = dev->alloc(N * 4);
    float *d_dinp = dev->alloc(nc * 4), *d_dw = dev->alloc(C * 4), *d_db = dev->alloc(C * 4);
    dev->layernorm_forward(d_out, d_mean, d_rstd, d_x, d_w, d_b, (int)N, C);
    dev->layernorm_backward(d_dinp, d_dw, d_db, d_dout, d_x, d_w, d_mean, d_rstd, (int)N, C, 0);
    report("layernorm_forward", xerr(d_out, out, nc), TOL_X);
    report("layernorm_backward", fmax(xerr(d_dinp, dinp, nc), fmax(xerr(d_dw, dw, C), xerr(d_db, db, C))),
           TOL_X_SUM);

    /* GeLU (inputs and gradients of LayerNorm's size) */
    cpu->gelu_forward(out, x, nc);
    dev->gelu_forward(d_out, d_x, nc);
    report("gelu_forward", xerr(d_out, out, nc), TOL_X);
    cpu->gelu_backward(dinp, x, dout, nc);
    dev->gelu_backward(d_dinp, d_x, d_dout, nc);
    report("gelu_backward", xerr(d_dinp, dinp, nc), TOL_X);

    /* Embedding: dwte on top of a random prior, a skewed token mix (one token
     * a third of the time: long runs). */
    int32_t *tok = xmalloc(N * 4);
    for (size_t i = 0; i < N; i++) tok[i] = rng_below(&rng, 3) == 0 ? 7 : (int32_t)rng_below(&rng, (uint64_t)V);
    float *wte = rnd((size_t)Vp * C, 1.0f), *wpe = rnd((size_t)T * C, 1.0f);
    float *dwte = rnd((size_t)Vp * C, 1.0f), *dwpe = xmalloc((size_t)T * C * 4);
    int32_t *d_tok = dev->alloc(N * 4);
    dev->to_device(d_tok, tok, N * 4);
    float *d_wte = up(wte, (size_t)Vp * C), *d_wpe = up(wpe, (size_t)T * C);
    float *d_dwte = up(dwte, (size_t)Vp * C), *d_dwpe = dev->alloc((size_t)T * C * 4);
    cpu->embed_forward(out, tok, wte, wpe, B, T, C);
    dev->embed_forward(d_out, d_tok, d_wte, d_wpe, B, T, C);
    test_report(xsame(d_out, out, nc), "cross_embed_forward", "differs from the cpu backend (one add: exact)");
    cpu->embed_backward(dwte, dwpe, dout, tok, B, T, C, 0);
    dev->embed_backward(d_dwte, d_dwpe, d_dout, d_tok, B, T, C, 0);
    test_report(xsame(d_dwte, dwte, (size_t)Vp * C) && xsame(d_dwpe, dwpe, (size_t)T * C), "cross_embed_backward_exact",
                "dwte or dwpe differ from the cpu backend's bits");

    /* Cross-entropy with dlogits in place; padding garbage. */
    size_t nv = N * Vp;
    float *logits = rnd(nv, 3.0f), *losses = xmalloc(N * 4);
    for (size_t i = 0; i < N; i++)
        for (int j = V; j < Vp; j++) logits[i * Vp + j] = 1e4f;
    int32_t *tg = xmalloc(N * 4);
    for (size_t i = 0; i < N; i++) tg[i] = (int32_t)rng_below(&rng, (uint64_t)V);
    float *d_logits = up(logits, nv), *d_losses = dev->alloc(N * 4);
    int32_t *d_tg = dev->alloc(N * 4);
    dev->to_device(d_tg, tg, N * 4);
    cpu->crossentropy_forward(logits, losses, tg, (int)N, V, Vp, 1.0f / N);
    dev->crossentropy_forward(d_logits, d_losses, d_tg, (int)N, V, Vp, 1.0f / N);
    report("crossentropy_loss", xerr(d_losses, losses, N), TOL_X);
    report("crossentropy_dlogits", xerr(d_logits, logits, nv), TOL_X);

    /* AdamW and sumsq over 1M elements. */
    size_t n = (size_t)1 << 20;
    float *p = rnd(n, 1.0f), *g = rnd(n, 1.0f), *m = rnd(n, 0.1f), *v = xmalloc(n * 4);
    for (size_t i = 0; i < n; i++) v[i] = 0.01f * rng_uniform(&rng);
    float *d_p = up(p, n), *d_g = up(g, n), *d_m = up(m, n), *d_v = up(v, n);
    cpu->adamw_update(p, g, m, v, n, 6e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.7f, 5);
    dev->adamw_update(d_p, d_g, d_m, d_v, n, 6e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.7f, 5);
    test_report(xsame(d_p, p, n) && xsame(d_m, m, n) && xsame(d_v, v, n), "cross_adamw_exact",
                "AdamW differs from the cpu backend's bits");
    double s_cpu = cpu->sumsq(g, n), s_dev = dev->sumsq(d_g, n);
    /* double sums of 1M squares in different orders: ~1e-16 x sqrt(n) */
    report("sumsq", fabs(s_cpu - s_dev) / s_cpu, 1e-12);

    free(x), free(w), free(b), free(dout), free(out), free(mean), free(rstd), free(dinp), free(dw), free(db);
    free(tok), free(wte), free(wpe), free(dwte), free(dwpe), free(logits), free(losses), free(tg);
    free(p), free(g), free(m), free(v);
    void *dptr[] = {d_x, d_w, d_b, d_dout, d_out, d_mean, d_rstd, d_dinp, d_dw, d_db, d_tok, d_wte, d_wpe,
                    d_dwte, d_dwpe, d_logits, d_losses, d_tg, d_p, d_g, d_m, d_v};
    for (size_t i = 0; i < sizeof dptr / sizeof dptr[0]; i++) dev->free(dptr[i]);
}

int main(int argc, char **argv) {
    const char *name = argc > 1 ? argv[1] : "cuda";
    cpu = backend_get("cpu");
    dev = backend_get(name);
    if (!dev || !backend_available(name)) {
        printf("skip cross_%s: %s\n", name, dev ? "no GPU" : "backend not in this build");
        return 0;
    }
    cpu->init(0);
    dev->init(0);
    /* Fresh inputs each run (notes/gpu-checks.md); the seed is printed so a
     * failure can be replayed with KILN_CROSS_SEED. */
    const char *env = getenv("KILN_CROSS_SEED");
    uint64_t seed = env ? strtoull(env, NULL, 10) : (uint64_t)time(NULL);
    printf("# cross seed %llu\n", (unsigned long long)seed);
    rng_seed(&rng, seed);
    if (dev->set_precision) dev->set_precision("fp32");
    cross_attention(2, 256, 768, 24); /* hs 32 */
    cross_attention(2, 256, 768, 12); /* hs 64: GPT-2 */
    cross_attention(1, 200, 768, 6);  /* hs 128, T not a multiple of any tile */
    cross_matmul(512, 768, 2304, "matmul", TOL_X, TOL_X_SUM);
    cross_matmul(512, 768, 1000, "matmul_oddoc", TOL_X, TOL_X_SUM);
    cross_rest(2, 256, 768, 1000, 1024);
    if (dev->set_precision) {
        dev->set_precision("bf16");
        cross_matmul(512, 768, 2304, "matmul_bf16", TOL_X_BF16, TOL_X_BF16);
    }
    dev->shutdown();
    cpu->shutdown();
    return 0;
}
