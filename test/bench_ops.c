/* bench_ops: time of each backend op at GPT-2 124M shapes, and what share of a
 * training step the non-matmul ops take. Not part of the suite (not test_*):
 *   gcc -std=c11 -O3 -march=native -fopenmp -D_GNU_SOURCE -Isrc -Itest \
 *       -I/usr/include/x86_64-linux-gnu/openblas-openmp test/bench_ops.c \
 *       src/cpu/backend_cpu.c src/backend.c src/util.c \
 *       -L/usr/lib/x86_64-linux-gnu/openblas-openmp \
 *       -Wl,-rpath,/usr/lib/x86_64-linux-gnu/openblas-openmp -lopenblas -lm -o /tmp/bench_ops
 *   /tmp/bench_ops [B T [threads [backend [precision]]]]
 * precision (a GPU backend's precision.compute, default bf16) sets the
 * activation dtype; activations and weights are in it, gradients of
 * parameters and the optimizer's arrays fp32, as in training. */
#include "backend.h"
#include "util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const Backend *be;
static size_t ab; /* activation element size */

/* n uniform values in [-scale, scale), on the device as fp32 (es 4) or in the
 * activation dtype (es = ab). */
static void *dev_rand_es(size_t n, Rng *r, float scale, size_t es) {
    float *h = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) h[i] = scale * (2.0f * rng_uniform(r) - 1.0f);
    backend_f32_to_act(h, h, n, es); /* in place */
    void *d = be->alloc(n * es);
    be->to_device(d, h, n * es);
    free(h);
    return d;
}
static void *dev_rand(size_t n, Rng *r, float scale) { return dev_rand_es(n, r, scale, ab); }
static float *dev_rand_f32(size_t n, Rng *r, float scale) { return dev_rand_es(n, r, scale, sizeof(float)); }

/* Best of `reps` timings of one op (after a warm-up call): seconds. */
#define TIME(var, reps, stmt)                                                                      \
    do {                                                                                           \
        stmt;                                                                                      \
        be->sync();                                                                                \
        var = 1e30;                                                                                \
        for (int r_ = 0; r_ < (reps); r_++) {                                                      \
            double t0_ = kiln_now();                                                               \
            stmt;                                                                                  \
            be->sync();                                                                            \
            double dt_ = kiln_now() - t0_;                                                         \
            var = dt_ < var ? dt_ : var;                                                           \
        }                                                                                          \
    } while (0)

int main(int argc, char **argv) {
    int B = argc > 2 ? atoi(argv[1]) : 4, T = argc > 2 ? atoi(argv[2]) : 64;
    int threads = argc > 3 ? atoi(argv[3]) : 0;
    be = backend_get(argc > 4 ? argv[4] : "cpu");
    if (!be) kiln_fail(KILN_EXIT_USAGE, "backend not in this build");
    printf("%s\n", be->init(threads));
    if (be->set_precision) be->set_precision(argc > 5 ? argv[5] : "bf16");
    ab = be->act_bytes();
    const int L = 12, C = 768, NH = 12, V = 50257, Vp = 50304, N = B * T;
    const size_t nparams = 124475904; /* GPT-2 124M with Vp = 50304, wpe of 1024 rows */
    Rng rng;
    rng_seed(&rng, 1);

    void *x = dev_rand((size_t)N * C, &rng, 1), *y = dev_rand((size_t)N * C, &rng, 1);
    void *x4 = dev_rand((size_t)N * 4 * C, &rng, 1), *y4 = dev_rand((size_t)N * 4 * C, &rng, 1);
    void *qkv = dev_rand((size_t)N * 3 * C, &rng, 1), *dqkv = dev_rand((size_t)N * 3 * C, &rng, 1);
    void *w = dev_rand((size_t)4 * C * C, &rng, 0.02f);
    float *dw = dev_rand_f32((size_t)4 * C * C, &rng, 1);
    void *bias = dev_rand(4 * C, &rng, 1);
    float *dbias = dev_rand_f32(4 * C, &rng, 1);
    void *wte = dev_rand((size_t)Vp * C, &rng, 0.02f);
    float *dwte = dev_rand_f32((size_t)Vp * C, &rng, 1);
    void *wpe = dev_rand((size_t)T * C, &rng, 0.02f);
    float *dwpe = dev_rand_f32((size_t)T * C, &rng, 1);
    void *logits = dev_rand((size_t)N * Vp, &rng, 1);
    float *losses = dev_rand_f32(N, &rng, 1);
    float *mean = dev_rand_f32(N, &rng, 1), *rstd = dev_rand_f32(N, &rng, 1);
    float *lse = dev_rand_f32((size_t)B * NH * T, &rng, 1);
    void *lnw = dev_rand(C, &rng, 1), *lnb = dev_rand(C, &rng, 1);
    int32_t *tok_h = xmalloc(N * sizeof(int32_t)), *tok = be->alloc(N * sizeof(int32_t));
    for (int i = 0; i < N; i++) tok_h[i] = (int32_t)rng_below(&rng, V);
    be->to_device(tok, tok_h, N * sizeof(int32_t));
    float *P = dev_rand_f32(nparams, &rng, 0.02f), *G = dev_rand_f32(nparams, &rng, 1e-3f);
    float *M = be->alloc(nparams * sizeof(float)), *Vv = be->alloc(nparams * sizeof(float));

    /* Warm the logits as a forward would (the CE op overwrites them). */
    be->matmul_forward(logits, x, wte, NULL, N, C, Vp);

    const int reps = 5;
    double t_mm_f[4], t_mm_b[4], t_head_f, t_head_b;
    int oc[4] = {3 * C, C, 4 * C, C}, ic[4] = {C, C, C, 4 * C};
    const char *mm_name[4] = {"qkv", "attproj", "fc", "fcproj"};
    for (int k = 0; k < 4; k++) {
        void *in = ic[k] == C ? x : x4, *out = oc[k] == 3 * C ? qkv : oc[k] == C ? y : y4;
        void *din = ic[k] == C ? y : y4;
        TIME(t_mm_f[k], reps, be->matmul_forward(out, in, w, bias, N, ic[k], oc[k]));
        TIME(t_mm_b[k], reps, be->matmul_backward(din, dw, dbias, out, in, w, N, ic[k], oc[k], 1));
    }
    TIME(t_head_f, 3, be->matmul_forward(logits, x, wte, NULL, N, C, Vp));
    TIME(t_head_b, 3, be->matmul_backward(y, dwte, NULL, logits, x, wte, N, C, Vp, 1));

    double t_ln_f, t_ln_b, t_att_f, t_att_b, t_gelu_f, t_gelu_b, t_add, t_ce, t_ce0, t_emb_f,
        t_emb_b, t_adam, t_sumsq;
    TIME(t_ln_f, reps, be->layernorm_forward(y, mean, rstd, x, lnw, lnb, N, C, 1e-5f));
    TIME(t_ln_b, reps, be->layernorm_backward(y, dw, dbias, x, x, lnw, mean, rstd, N, C, 1));
    TIME(t_att_f, reps, be->attention_forward(y, lse, qkv, &(AttnShape){B, T, NH, NH, C / NH, NULL}));
    TIME(t_att_b, reps, be->attention_backward(dqkv, x, qkv, y, lse, &(AttnShape){B, T, NH, NH, C / NH, NULL}));
    TIME(t_gelu_f, reps, be->gelu_forward(y4, x4, (size_t)N * 4 * C));
    TIME(t_gelu_b, reps, be->gelu_backward(y4, x4, y4, (size_t)N * 4 * C));
    TIME(t_add, reps, be->residual_forward(y, x, y, (size_t)N * C));
    TIME(t_ce0, 3, be->crossentropy_forward(logits, losses, tok, N, V, Vp, 0.0f));
    /* With dloss the logits turn into gradients; re-running on those is the
     * same work, so the timing stands. */
    TIME(t_ce, 3, be->crossentropy_forward(logits, losses, tok, N, V, Vp, 1e-3f));
    TIME(t_emb_f, reps, be->embed_forward(y, tok, wte, wpe, B, T, C));
    TIME(t_emb_b, reps, be->embed_backward(dwte, dwpe, y, tok, NULL, B, T, C, 1));
    TIME(t_adam, 3, be->adamw_update(P, G, M, Vv, nparams, 1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f, 3, NULL, NULL));
    TIME(t_sumsq, 3, (void)be->sumsq(G, nparams));

    double mm_layer = 0, flops_layer = 0;
    printf("\nGPT-2 124M, B=%d T=%d (N=%d), C=%d, NH=%d, Vp=%d; best of %d, ms\n", B, T, N, C, NH,
           Vp, reps);
    printf("%-26s %9s %9s %9s\n", "matmul (per layer)", "fwd", "bwd", "GFLOP/s");
    for (int k = 0; k < 4; k++) {
        double fl = 2.0 * N * ic[k] * oc[k];
        printf("%-26s %9.3f %9.3f %9.1f\n", mm_name[k], 1e3 * t_mm_f[k], 1e3 * t_mm_b[k],
               3 * fl / (t_mm_f[k] + t_mm_b[k]) / 1e9);
        mm_layer += t_mm_f[k] + t_mm_b[k];
        flops_layer += 3 * fl;
    }
    double fl_head = 2.0 * N * C * Vp;
    printf("%-26s %9.3f %9.3f %9.1f\n", "lm head (C->Vp)", 1e3 * t_head_f, 1e3 * t_head_b,
           3 * fl_head / (t_head_f + t_head_b) / 1e9);
    printf("%-26s %9s %9s\n", "other ops", "fwd", "bwd");
    printf("%-26s %9.3f %9.3f\n", "layernorm", 1e3 * t_ln_f, 1e3 * t_ln_b);
    printf("%-26s %9.3f %9.3f\n", "attention", 1e3 * t_att_f, 1e3 * t_att_b);
    printf("%-26s %9.3f %9.3f\n", "gelu (N,4C)", 1e3 * t_gelu_f, 1e3 * t_gelu_b);
    printf("%-26s %9.3f\n", "add (N,C)", 1e3 * t_add);
    printf("%-26s %9.3f %9.3f   (dloss=0, dloss!=0)\n", "crossentropy", 1e3 * t_ce0, 1e3 * t_ce);
    printf("%-26s %9.3f %9.3f\n", "embed", 1e3 * t_emb_f, 1e3 * t_emb_b);
    printf("%-26s %9.3f   (%zu params)\n", "adamw", 1e3 * t_adam, nparams);
    printf("%-26s %9.3f\n", "sumsq", 1e3 * t_sumsq);

    /* One training step as the model runs it: per layer 2 LN, attention, GeLU,
     * 2 residual adds forward; backward of each (the residual adds' backward are
     * "+=" in the LN backward, so no add there); head + CE; embed; optimizer and
     * grad-norm over all parameters. */
    double other_layer = 2 * (t_ln_f + t_ln_b) + t_att_f + t_att_b + t_gelu_f + t_gelu_b + 2 * t_add;
    double mm = L * mm_layer + t_head_f + t_head_b;
    double other = L * other_layer + t_ln_f + t_ln_b + t_ce + t_emb_f + t_emb_b; /* + ln_f */
    double opt = t_adam + t_sumsq;
    double flops = L * flops_layer + 3 * fl_head;
    double total = mm + other + opt;
    printf("\nstep estimate: matmul %.1f ms, other ops %.1f ms, adamw+sumsq %.1f ms, total %.1f ms\n",
           1e3 * mm, 1e3 * other, 1e3 * opt, 1e3 * total);
    printf("matmul share %.1f%% (%.1f GFLOP/s in sgemm, %.1f GFLOP/s over the step)\n",
           100 * mm / total, flops / mm / 1e9, flops / total / 1e9);
    return 0;
}
