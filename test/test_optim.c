/* test_optim: learning-rate schedules (warmup, floor, each kind's shape), the
 * optimizer step's clipping and non-finite handling, and bf16 AdamW moments
 * (precision.optim_state bf16: stochastic rounding, accuracy, determinism),
 * Lion and Muon against their math in double, Newton-Schulz's singular values,
 * on the CPU backend. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "optim.h"
#include "singular_values.h"
#include "sround.h"
#include "test.h"
#include "util.h"

/* Schedules are computed in double and returned as float: 1e-6 relative is a
 * few float ulps, far below any real schedule error (a wrong step shifts the
 * value by a whole 1/steps). */
static int near(float a, double b) { return fabs((double)a - b) <= 1e-6 * fabs(b) + 1e-12; }

static void test_schedules(void) {
    Schedule s = {SCHED_COSINE, 1.0f, 10, 110, 0.1f, 0.2f};
    int ok = near(optim_lr(&s, 0), 0.1) && near(optim_lr(&s, 4), 0.5) && near(optim_lr(&s, 9), 1.0);
    test_report(ok, "optim_warmup_linear", "warmup lr %g %g %g", optim_lr(&s, 0), optim_lr(&s, 4), optim_lr(&s, 9));

    /* cosine: peak right after warmup, halfway at the midpoint, floor at the last step */
    ok = near(optim_lr(&s, 10), 1.0) && near(optim_lr(&s, 59), 0.1 + 0.9 * 0.5 * (1 + cos(M_PI * 49.0 / 99))) &&
         near(optim_lr(&s, 109), 0.1) && near(optim_lr(&s, 500), 0.1);
    test_report(ok, "optim_cosine_shape", "cosine lr at 10, 59, 109: %g %g %g", optim_lr(&s, 10), optim_lr(&s, 59),
                optim_lr(&s, 109));

    s.kind = SCHED_LINEAR;
    ok = near(optim_lr(&s, 10), 1.0) && near(optim_lr(&s, 109), 0.1) &&
         near(optim_lr(&s, 10 + 33), 0.1 + 0.9 * (1.0 - 33.0 / 99));
    test_report(ok, "optim_linear_shape", "linear lr %g %g", optim_lr(&s, 43), optim_lr(&s, 109));

    s.kind = SCHED_CONSTANT;
    ok = near(optim_lr(&s, 10), 1.0) && near(optim_lr(&s, 109), 1.0) && near(optim_lr(&s, 3), 0.4);
    test_report(ok, "optim_constant_shape", "constant lr %g %g", optim_lr(&s, 10), optim_lr(&s, 109));

    /* wsd: 110 steps, decay over the last 22 (steps 88..109) */
    s.kind = SCHED_WSD;
    ok = near(optim_lr(&s, 50), 1.0) && near(optim_lr(&s, 87), 1.0) && near(optim_lr(&s, 88), 1.0) &&
         near(optim_lr(&s, 109), 0.1) && near(optim_lr(&s, 88 + 7), 0.1 + 0.9 * (1.0 - 7.0 / 21));
    test_report(ok, "optim_wsd_shape", "wsd lr at 87, 95, 109: %g %g %g", optim_lr(&s, 87), optim_lr(&s, 95),
                optim_lr(&s, 109));

    /* monotone after warmup for the decaying kinds, never below the floor */
    int mono = 1;
    SchedKind kinds[3] = {SCHED_COSINE, SCHED_LINEAR, SCHED_WSD};
    for (int k = 0; k < 3; k++) {
        s.kind = kinds[k];
        for (int i = 11; i < 130; i++)
            if (optim_lr(&s, i) > optim_lr(&s, i - 1) || optim_lr(&s, i) < 0.1f * (1 - 1e-6f)) mono = 0;
    }
    test_report(mono, "optim_schedules_monotone_above_floor", "a schedule rose or fell below the floor");

    ok = optim_sched_kind("cosine") == SCHED_COSINE && optim_sched_kind("wsd") == SCHED_WSD &&
         optim_sched_kind("step") == -1;
    test_report(ok, "optim_sched_kind_names", "name lookup wrong");
}

static void test_step(void) {
    const Backend *be = &backend_cpu;
    be->init(1);
    enum { N = 40, ND = 24 };
    float *p = be->alloc(N * sizeof(float)), *g = be->alloc(N * sizeof(float));
    float hp[N], hg[N], out[N];
    for (int i = 0; i < N; i++) {
        hp[i] = 0.5f + 0.01f * i;
        hg[i] = (i % 2 ? 1.0f : -1.0f) * (0.1f + 0.02f * i);
    }
    double norm = 0.0;
    for (int i = 0; i < N; i++) norm += (double)hg[i] * hg[i];
    norm = sqrt(norm);
    be->to_device(p, hp, sizeof hp);
    be->to_device(g, hg, sizeof hg);
    AdamW o;
    optim_init(&o, be, N, ND, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f);
    OptimStepInfo info = optim_step(&o, p, g, 0.01f);
    be->to_host(out, p, sizeof out);
    /* the norm is a double sum of 40 floats: 1e-9 relative is generous */
    int ok = fabs(info.grad_norm - norm) < 1e-9 * norm && norm > 1.0 &&
             fabs(info.grad_scale - 1.0 / (norm + 1e-6)) < 1e-6;
    test_report(ok, "optim_clip_scale", "norm %g (want %g) scale %g", info.grad_norm, norm, info.grad_scale);
    /* First AdamW step: mhat/sqrt(vhat) = sign(g) exactly up to eps, so each
     * parameter moves by lr (plus lr*wd*p where decayed). 1e-6: float ulps. */
    int upd = 1;
    for (int i = 0; i < N; i++) {
        double wd = i < ND ? 0.1 : 0.0;
        double want = hp[i] - 0.01 * ((hg[i] > 0 ? 1.0 : -1.0) + wd * hp[i]);
        if (fabs(out[i] - want) > 1e-6) upd = 0;
    }
    test_report(upd, "optim_first_step_and_decay_split", "first-step update or the decay split is wrong");

    hg[3] = NAN;
    be->to_device(g, hg, sizeof hg);
    float before[N];
    be->to_host(before, p, sizeof before);
    info = optim_step(&o, p, g, 0.01f);
    be->to_host(out, p, sizeof out);
    ok = info.nonfinite && memcmp(before, out, sizeof out) == 0 && o.t == 1;
    test_report(ok, "optim_nonfinite_no_update", "nonfinite %d, t %d", info.nonfinite, o.t);
    optim_free(&o);
    be->free(p);
    be->free(g);
}

/* Stochastic rounding: the mean of many roundings of one value is the value.
 * x sits 0.3 of a bf16 ulp above a bf16 number, so round-to-nearest would be
 * off by 0.3 ulp; each rounding is the lower or upper neighbour (Bernoulli
 * 0.3), so the mean of K has standard error ulp * sqrt(0.3 * 0.7 / K). Pass
 * within 5 standard errors (a false failure once in ~1.7 million). For each
 * 16-bit stream the optimizer draws from one hash: bits 0..15 (moment m),
 * 16..31 (v) and 32..47 (the parameter with precision.master bf16). */
static void test_sround(void) {
    const int K = 200000;
    const float xs[3] = {1.0f + 0.3f / 128, -3.0f - 0.3f * 3.0f / 128 * 0.5f, 0x1p-20f * (1.0f + 0.3f / 128)};
    int ok = 1;
    char what[1024] = "";
    for (int c = 0; c < 9; c++) {
        float x = xs[c % 3];
        int shift = 16 * (c / 3);
        /* bf16 ulp at x: 2^(exponent - 7) */
        int e;
        frexpf(fabsf(x), &e);
        double ulp = ldexp(1.0, e - 1 - 7);
        double lo = sround_f32(sround_bf16(x, 0)), frac = (fabs(x) - fabs(lo)) / ulp;
        double sum = 0.0;
        for (int i = 0; i < K; i++) {
            uint16_t h = sround_bf16(x, (uint32_t)(sround_hash(42, 7, (uint64_t)i) >> shift));
            double y = sround_f32(h);
            if (fabs(y - lo) > 0 && fabs(fabs(y) - fabs(lo) - ulp) > 0) ok = 0; /* a neighbour, nothing else */
            sum += y;
        }
        double se = ulp * sqrt(frac * (1 - frac) / K), err = sum / K - x;
        if (!(fabs(err) <= 5 * se) || frac < 0.1) ok = 0;
        snprintf(what + strlen(what), sizeof what - strlen(what), " bits %d.., x %g: mean-x %.3g (se %.3g);", shift,
                 x, err, se);
    }
    /* Inf and NaN pass through; an exact bf16 value stays put whatever r */
    ok = ok && isinf(sround_f32(sround_bf16(INFINITY, 0xffff))) && isnan(sround_f32(sround_bf16(NAN, 0xffff))) &&
         sround_f32(sround_bf16(1.5f, 0xffff)) == 1.5f;
    test_report(ok, "optim_sround_unbiased", "%s", what);
}

/* One AdamW run over n elements for `steps` steps, bf16 or fp32 moments, with
 * the given rounding seed; grads from a fixed formula. Returns params in p. */
static void run_adamw(float *hp, size_t n, size_t nd, int bf16, uint64_t seed, int steps, void *m_out, void *v_out) {
    const Backend *be = &backend_cpu;
    float *p = be->alloc(n * sizeof(float)), *g = be->alloc(n * sizeof(float));
    float *hg = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) hp[i] = 0.02f * sinf(0.37f * (float)i);
    be->to_device(p, hp, n * sizeof(float));
    AdamW o;
    optim_init_shard_dtype(&o, be, n, nd, 0, n, 0.9f, 0.95f, 1e-8f, 0.1f, 0.0f, bf16, seed);
    for (int t = 1; t <= steps; t++) {
        for (size_t i = 0; i < n; i++) hg[i] = 1e-3f * sinf(1.3f * (float)i + 0.7f * (float)t) + 2e-4f * cosf(0.05f * (float)i);
        be->to_device(g, hg, n * sizeof(float));
        optim_step(&o, p, g, 1e-3f);
    }
    be->to_host(hp, p, n * sizeof(float));
    if (m_out) be->to_host(m_out, o.m, n * o.state_bytes);
    if (v_out) be->to_host(v_out, o.v, n * o.state_bytes);
    optim_free(&o);
    be->free(p);
    be->free(g);
    free(hg);
}

/* bf16 moments against AdamW in double with exact moments, and determinism. */
static void test_bf16_state(void) {
    enum { N = 4096, ND = 3000, STEPS = 50 };
    static float pb[N], pf[N], pb2[N], pb3[N];
    static uint16_t mb[N], vb[N], mb2[N], vb2[N], mb3[N];
    run_adamw(pb, N, ND, 1, 99, STEPS, mb, vb);
    run_adamw(pf, N, ND, 0, 0, STEPS, NULL, NULL);
    /* double reference: the same gradients, moments never rounded */
    double worst_b = 0, worst_f = 0, mean_b = 0;
    for (size_t i = 0; i < N; i++) {
        double p = 0.02f * sinf(0.37f * (float)i), m = 0, v = 0, wd = i < ND ? 0.1 : 0.0;
        for (int t = 1; t <= STEPS; t++) {
            double g = 1e-3f * sinf(1.3f * (float)i + 0.7f * (float)t) + 2e-4f * cosf(0.05f * (float)i);
            m = 0.9 * m + 0.1 * g;
            v = 0.95 * v + 0.05 * g * g;
            double mh = m / (1 - pow(0.9, t)), vh = v / (1 - pow(0.95, t));
            p -= 1e-3 * (mh / (sqrt(vh) + 1e-8) + wd * p);
        }
        double eb = fabs(pb[i] - p), ef = fabs(pf[i] - p);
        worst_b = eb > worst_b ? eb : worst_b;
        worst_f = ef > worst_f ? ef : worst_f;
        mean_b += eb / N;
    }
    /* Every step moves a parameter by ~lr = 1e-3 (|mhat/sqrt(vhat)| <= ~1).
     * A bf16 store errs by under one ulp (2^-7 relative), zero-mean
     * (stochastic), about 2^-8 rms, and so does the step it feeds; the signs
     * are random from step to step, so over 50 steps the drift is a random
     * walk of sqrt(50) * 1e-3 * 2^-8 = 2.8e-5 rms (measured mean 2.8e-5).
     * Pass: mean under 6e-5 (twice that), worst under 4e-4 = 50 * 1e-3 *
     * 2^-7, every step's error at its largest and of one sign (measured
     * 1.8e-4). fp32 moments: float rounding, 1e-6. */
    int ok = worst_b < 4e-4 && mean_b < 6e-5 && worst_f < 1e-6;
    test_report(ok, "optim_bf16_state_vs_double", "bf16 moments: worst %.3g mean %.3g; fp32: worst %.3g", worst_b,
                mean_b, worst_f);

    run_adamw(pb2, N, ND, 1, 99, STEPS, mb2, vb2);
    run_adamw(pb3, N, ND, 1, 100, STEPS, mb3, NULL);
    ok = memcmp(pb, pb2, sizeof pb) == 0 && memcmp(mb, mb2, sizeof mb) == 0 && memcmp(vb, vb2, sizeof vb) == 0 &&
         memcmp(mb, mb3, sizeof mb) != 0;
    test_report(ok, "optim_bf16_state_deterministic", "same seed gave other bits, or another seed the same");

    /* memory: the moments take 2 bytes each */
    AdamW o;
    optim_init_shard_dtype(&o, &backend_cpu, N, ND, 0, N, 0.9f, 0.95f, 1e-8f, 0.1f, 0.0f, 1, 1);
    size_t sb = o.state_bytes;
    ok = sb == 2 && optim_state_bytes("bf16") == 2 && optim_state_bytes("fp32") == 4 &&
         optim_state_bytes("fp16") == 0;
    optim_free(&o);
    test_report(ok, "optim_bf16_state_bytes", "state_bytes %zu", sb);
}

/* Lion over 5 steps against the math in double (Chen et al. 2023, with
 * clip_grad_norm_'s clipping and decoupled decay on [0, ND)): c = b1 m +
 * (1 - b1) g, p -= lr (sign(c) + wd p), m = b2 m + (1 - b2) g. Each float
 * step rounds a few operations on O(0.02) parameters (~1e-9 each), so 5
 * steps stay below 1e-7 absolute; a wrong sign would move an element by
 * 2 lr = 2e-3. m: 1e-6 of its largest element (a few float roundings per
 * step; elementwise relative error is meaningless where m cancels to ~0). */
static void test_lion_vs_double(void) {
    enum { N = 4096, ND = 3000, STEPS = 5 };
    const Backend *be = &backend_cpu;
    const float lr = 1e-3f, b1 = 0.9f, b2 = 0.99f, wd = 0.1f, clip = 0.02f;
    static float hp[N], hg[N], hm[N];
    static double rp[N], rm[N];
    for (size_t i = 0; i < N; i++) hp[i] = 0.02f * sinf(0.37f * (float)i), rp[i] = hp[i], rm[i] = 0.0;
    float *p = be->alloc(N * sizeof(float)), *g = be->alloc(N * sizeof(float));
    be->to_device(p, hp, sizeof hp);
    AdamW o;
    optim_init_shard_dtype(&o, be, N, ND, 0, N, 0.9f, 0.95f, 1e-8f, wd, clip, 0, 0);
    optim_set_lion(&o, b1, b2);
    int clipped = 1;
    for (int t = 1; t <= STEPS; t++) {
        double sq = 0.0;
        for (size_t i = 0; i < N; i++) {
            hg[i] = 1e-3f * sinf(1.3f * (float)i + 0.7f * (float)t) + 2e-4f * cosf(0.05f * (float)i);
            sq += (double)hg[i] * hg[i];
        }
        be->to_device(g, hg, sizeof hg);
        OptimStepInfo info = optim_step(&o, p, g, lr);
        double coef = clip / (sqrt(sq) + 1e-6);
        if (coef >= 1.0) coef = 1.0, clipped = 0;
        for (size_t i = 0; i < N; i++) {
            double gi = hg[i] * coef, c = b1 * rm[i] + (1.0 - b1) * gi;
            double w = i < ND ? wd : 0.0;
            rp[i] -= lr * ((c > 0) - (c < 0) + w * rp[i]);
            rm[i] = b2 * rm[i] + (1.0 - b2) * gi;
        }
        (void)info;
    }
    be->to_host(hp, p, sizeof hp);
    be->to_host(hm, o.m, sizeof hm);
    double ep = 0.0, em = 0.0, mmax = 0.0;
    for (size_t i = 0; i < N; i++) {
        ep = fmax(ep, fabs(hp[i] - rp[i]));
        em = fmax(em, fabs(hm[i] - rm[i]));
        mmax = fmax(mmax, fabs(rm[i]));
    }
    em /= mmax;
    test_report(clipped && ep < 1e-7 && em < 1e-6 && o.v == NULL, "optim_lion_vs_double",
                "5 steps: params max abs err %.3g (tol 1e-7), m max err / max |m| %.3g (tol 1e-6), clipped %d", ep, em,
                clipped);
    printf("# lion vs double over 5 steps: params max abs err %.3g, m max err / max |m| %.3g\n", ep, em);
    optim_free(&o);
    be->free(p);
    be->free(g);
}

/* Newton-Schulz: five quintic steps take every singular value of a
 * normalised matrix into about [0.7, 1.2]: the coefficients trade exactness
 * for speed, so the iteration oscillates around 1 rather than converging,
 * its lower turning point near 0.68 (measured 0.6818); hence [0.65, 1.2], for
 * matrices whose smallest singular value is not tiny, which holds for random
 * Gaussian matrices of these sizes. */
static void test_newton_schulz(void) {
    const Backend *be = &backend_cpu;
    static const int shapes[][2] = {{32, 32}, {16, 64}, {64, 16}, {24, 72}, {100, 30}};
    Rng rng;
    rng_seed(&rng, 11);
    double lo = 1e9, hi = 0.0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int r = shapes[s][0], c = shapes[s][1], a = r < c ? r : c;
        float *x = malloc((size_t)r * c * sizeof(float));
        float *w = malloc((2 * (size_t)r * c + 2 * (size_t)a * a) * sizeof(float));
        double *sv = malloc((size_t)a * sizeof(double));
        for (int i = 0; i < r * c; i++) x[i] = 3.0f * rng_normal(&rng);
        be->newton_schulz(x, r, c, 5, w);
        singular_values(x, r, c, sv);
        for (int i = 0; i < a; i++) lo = fmin(lo, sv[i]), hi = fmax(hi, sv[i]);
        free(x), free(w), free(sv);
    }
    test_report(lo >= 0.65 && hi <= 1.2, "optim_newton_schulz_singular_values",
                "singular values in [%.4f, %.4f], want within [0.65, 1.2]", lo, hi);
    printf("# newton_schulz 5 steps, shapes 32x32 16x64 64x16 24x72 100x30: singular values in [%.4f, %.4f]\n", lo,
           hi);
}

/* Newton-Schulz in double, the same algorithm; x (r, c) in place. */
static void ns_double(double *x, int r, int c, int steps) {
    int tr = r > c, a = tr ? c : r, b = tr ? r : c;
    double *X = malloc((size_t)a * b * sizeof(double)), *Y = malloc((size_t)a * b * sizeof(double));
    double *A = malloc((size_t)a * a * sizeof(double)), *B = malloc((size_t)a * a * sizeof(double));
    double sq = 0.0;
    for (int i = 0; i < r * c; i++) sq += x[i] * x[i];
    double nrm = sqrt(sq) + 1e-7;
    for (int i = 0; i < r; i++)
        for (int j = 0; j < c; j++) X[tr ? j * b + i : i * b + j] = x[i * c + j] / nrm;
    for (int k = 0; k < steps; k++) {
        for (int i = 0; i < a; i++)
            for (int j = 0; j < a; j++) {
                double acc = 0.0;
                for (int l = 0; l < b; l++) acc += X[i * b + l] * X[j * b + l];
                A[i * a + j] = acc;
            }
        for (int i = 0; i < a; i++)
            for (int j = 0; j < a; j++) {
                double acc = 0.0;
                for (int l = 0; l < a; l++) acc += A[i * a + l] * A[l * a + j];
                B[i * a + j] = -4.7750 * A[i * a + j] + 2.0315 * acc;
            }
        for (int i = 0; i < a; i++)
            for (int j = 0; j < b; j++) {
                double acc = 0.0;
                for (int l = 0; l < a; l++) acc += B[i * a + l] * X[l * b + j];
                Y[i * b + j] = 3.4445 * X[i * b + j] + acc;
            }
        memcpy(X, Y, (size_t)a * b * sizeof(double));
    }
    for (int i = 0; i < r; i++)
        for (int j = 0; j < c; j++) x[i * c + j] = X[tr ? j * b + i : i * b + j];
    free(X), free(Y), free(A), free(B);
}

/* Muon over 5 steps against its math in double: an arena of AdamW elements,
 * a wide (12, 20) and a tall (30, 10) matrix (decayed), more AdamW elements
 * past n_decay; clipping engaged. Per matrix: m = mu m + (1 - mu) g, u =
 * (1 - mu) g + mu m, p -= lr (scale NS5(u) + wd p); the rest AdamW with bias
 * corrections. Tolerance: the fp32 Newton-Schulz runs 15 products whose
 * rounding (~1e-7 relative each) the iteration's slope near 1 amplifies a few
 * times; with lr 0.02 the parameters' error stays below 1e-6 abs (measured
 * 4.6e-7), against per-element steps of ~lr * scale / sqrt(numel) ~ 1e-3. */
static void test_muon_vs_double(void) {
    enum { N = 700, ND = 640, STEPS = 5 };
    const Backend *be = &backend_cpu;
    const float lr = 0.02f, mu = 0.95f, wd = 0.1f, clip = 0.5f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f;
    OptimMatrix mats[2] = {{.off = 100, .rows = 12, .cols = 20, .decay = 1}, {.off = 340, .rows = 30, .cols = 10, .decay = 1}};
    for (int i = 0; i < 2; i++) mats[i].scale = optim_muon_scale("spectral", mats[i].rows, mats[i].cols);
    static float hp[N], hg[N], hm[N];
    static double rp[N], rm[N], rv[N], u[N];
    for (size_t i = 0; i < N; i++) hp[i] = 0.02f * sinf(0.37f * (float)i), rp[i] = hp[i], rm[i] = rv[i] = 0.0;
    float *p = be->alloc(N * sizeof(float)), *g = be->alloc(N * sizeof(float));
    be->to_device(p, hp, sizeof hp);
    AdamW o;
    optim_init_shard_dtype(&o, be, N, ND, 0, N, b1, b2, eps, wd, clip, 0, 0);
    optim_set_muon(&o, mats, 2, mu, 5);
    int clipped = 1;
    for (int t = 1; t <= STEPS; t++) {
        double sq = 0.0;
        for (size_t i = 0; i < N; i++) {
            hg[i] = 0.03f * sinf(1.3f * (float)i + 0.7f * (float)t) + 0.01f * cosf(0.05f * (float)i * t);
            sq += (double)hg[i] * hg[i];
        }
        be->to_device(g, hg, sizeof hg);
        optim_step(&o, p, g, lr);
        double coef = clip / (sqrt(sq) + 1e-6);
        if (coef >= 1.0) coef = 1.0, clipped = 0;
        coef = (float)coef; /* the step applies the clipping factor as a float */
        double bc1 = 1.0 - pow(b1, t), bc2 = 1.0 - pow(b2, t);
        for (size_t i = 0; i < N; i++) {
            int in = (i >= 100 && i < 340) || (i >= 340 && i < 640);
            double gi = hg[i] * coef;
            if (in) {
                rm[i] = mu * rm[i] + (1.0 - mu) * gi;
                u[i] = (1.0 - mu) * gi + mu * rm[i];
            } else {
                rm[i] = b1 * rm[i] + (1.0 - b1) * gi;
                rv[i] = b2 * rv[i] + (1.0 - b2) * gi * gi;
                rp[i] -= lr * (rm[i] / bc1 / (sqrt(rv[i] / bc2) + eps) + (i < ND ? wd : 0.0) * rp[i]);
            }
        }
        for (int k = 0; k < 2; k++) {
            size_t off = mats[k].off, n = (size_t)mats[k].rows * mats[k].cols;
            ns_double(u + off, mats[k].rows, mats[k].cols, 5);
            double sc = sqrt(fmax(1.0, (double)mats[k].rows / mats[k].cols));
            for (size_t i = off; i < off + n; i++) rp[i] -= lr * (sc * u[i] + wd * rp[i]);
        }
    }
    be->to_host(hp, p, sizeof hp);
    be->to_host(hm, o.m, sizeof hm); /* AdamW's m; Muon's momentum is in mm, each matrix at its mom */
    for (int k = 0; k < 2; k++)
        be->to_host(hm + o.mats[k].off, o.mm + o.mats[k].mom, (size_t)o.mats[k].rows * o.mats[k].cols * sizeof(float));
    double ep = 0.0, em = 0.0, mmax = 0.0;
    for (size_t i = 0; i < N; i++) {
        ep = fmax(ep, fabs(hp[i] - rp[i]));
        em = fmax(em, fabs(hm[i] - rm[i]));
        mmax = fmax(mmax, fabs(rm[i]));
    }
    em /= mmax;
    test_report(clipped && ep < 1e-6 && em < 1e-6, "optim_muon_vs_double",
                "5 steps: params max abs err %.3g (tol 1e-6), m max err / max |m| %.3g (tol 1e-6), clipped %d", ep,
                em, clipped);
    printf("# muon vs double over 5 steps: params max abs err %.3g, m max err / max |m| %.3g\n", ep, em);
    optim_free(&o);
    be->free(p);
    be->free(g);
}

int main(void) {
    test_schedules();
    test_step();
    test_sround();
    test_bf16_state();
    test_lion_vs_double();
    test_newton_schulz();
    test_muon_vs_double();
    return 0;
}
