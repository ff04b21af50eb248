/* bench_attention: attention forward and backward throughput of a backend at
 * GPT-2's attention shapes, T 1024 and head size 64: 124M (B 16, 12 heads)
 * and 1.5B (B 8, 25 heads), the micro-batches scripts/cuda_check.sh benches
 * the models at; on each attention path the backend offers (CUDA with bf16
 * activations: precision.attention simt, tensor_cores and, where the
 * start-up self-check kept it, cudnn and cudnn with
 * precision.attention_deterministic false), then `auto`, the path a run
 * takes, against the targets. Not part of the suite (not test_*):
 * scripts/cuda_check.sh runs it on a GPU, its dry run on the CPU backend at
 * the small shape, and test/t_model_emu.sh on the CUDA emulation:
 *   build/test/bench_attention [backend [precision [doc_len [shapes]]]]
 * backend cuda and precision bf16 by default; doc_len > 0: document masking
 * (AttnShape.doc) with documents of doc_len tokens, the FLOPs still counting
 * the whole causal half (the skipped blocks show as a rate above the dense
 * one); shapes: gpt2 (default: 124m and 1558m), 124m, 1558m, or small (B 2,
 * T 256, 2 heads of 64: a check that the paths run, one timing each).
 *
 * Lines: "# " the backend's description (the candidates auto kept, with the
 * self-checks' figures) and the FLOP convention; per path and shape
 * "bench_attention shape=... impl=... fwd_ms= bwd_ms= fwd_tflops=
 * bwd_tflops= total_tflops= err_out= err_dqkv=", the errors max |x - simt| /
 * max |simt| on the same inputs (out, dqkv; each backward reads its own
 * forward's out and lse, as in training); per shape "bench_attention_auto
 * shape=... path=... fwd_tflops= bwd_tflops= target_fwd=350 target_bwd=250
 * fwd_target=met|below bwd_target=met|below", path the one whose bits auto's
 * output has ("other" if none).
 *
 * FLOPs, FlashAttention-2's convention: 2 per multiply-add, the causal half
 * only. The forward's two products (Q K^T and P V) over all T x T pairs
 * would be 4 B T^2 NH hs; causal, half: 2 B NH T^2 hs. The backward 2.5x
 * that (five products: Q K^T again, dV = P^T dO, dP = dO V^T, dQ = dS K,
 * dK = dS^T Q). Softmax exponentials and the D = rowsum(dO O) pass are not
 * counted. Targets (issue 20, for an H200; printed beside any GPU's figures):
 * >= 350 TFLOP/s forward, >= 250 backward for the path auto takes. Timings:
 * best of REPS after a warm-up call (one call at the small shape). */
#include "backend.h"
#include "util.h"
#include "max_rel.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define REPS 5
#define TARGET_FWD 350.0 /* TFLOP/s, H200, issue 20 */
#define TARGET_BWD 250.0

static const Backend *be;

typedef struct {
    const char *name;
    int B, T, NH, hs;
} Shape;

/* n normal values scaled by s, on the device in the activation dtype. */
static void *dev_randn(size_t n, Rng *r, float s, size_t ab) {
    float *h = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) h[i] = s * rng_normal(r);
    backend_f32_to_act(h, h, n, ab); /* in place */
    void *d = be->alloc(n * ab);
    be->to_device(d, h, n * ab);
    free(h);
    return d;
}

/* The tensors of one shape, on the device. */
typedef struct {
    AttnShape s;
    void *qkv, *dout, *out, *dqkv;
    float *lse;
    size_t n3, nc;
} Bufs;

/* Best of reps timings of `which` (0 forward, 1 backward), seconds. */
static double best_time(int which, Bufs *x, int reps) {
    double best = 1e30;
    for (int r = 0; r <= reps; r++) {
        be->sync();
        double t0 = kiln_now();
        if (which == 0) be->attention_forward(x->out, x->lse, x->qkv, &x->s);
        else be->attention_backward(x->dqkv, x->dout, x->qkv, x->out, x->lse, &x->s);
        be->sync();
        double dt = kiln_now() - t0;
        if ((r > 0 || reps == 0) && dt < best) best = dt; /* r = 0: warm-up, unless it is the only one */
    }
    return best;
}

/* Device act tensor (n) to host fp32. */
static float *fetch(const void *d, size_t n, size_t ab) {
    void *s = xmalloc(n * ab);
    float *h = xmalloc(n * sizeof(float));
    be->to_host(s, d, n * ab);
    backend_act_to_f32(h, s, n, ab);
    free(s);
    return h;
}

/* FNV-1a of a host buffer: which path's bits auto's output has. */
static uint64_t hash_bytes(const void *p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ ((const unsigned char *)p)[i]) * 1099511628211ull;
    return h;
}

/* One shape: every path, then auto against the targets. */
static void bench_shape(const Shape *sh, const char *desc, int doc_len, int reps, Rng *rng, size_t ab) {
    Bufs x = {.s = {sh->B, sh->T, sh->NH, sh->NH, sh->hs, NULL}};
    int C = sh->NH * sh->hs;
    size_t N = (size_t)sh->B * sh->T;
    x.n3 = N * 3 * C, x.nc = N * C;
    int32_t *doc = NULL; /* (B, T) device: each row's document start */
    if (doc_len > 0) {
        int32_t *h = xmalloc(N * sizeof(int32_t));
        for (size_t i = 0; i < N; i++) h[i] = (int32_t)((i % sh->T) / doc_len * doc_len);
        doc = be->alloc(N * sizeof(int32_t));
        be->to_device(doc, h, N * sizeof(int32_t));
        free(h);
        x.s.doc = doc;
    }
    x.qkv = dev_randn(x.n3, rng, 1.0f, ab), x.dout = dev_randn(x.nc, rng, 1.0f, ab);
    x.out = be->alloc(x.nc * ab), x.dqkv = be->alloc(x.n3 * ab);
    x.lse = be->alloc((size_t)sh->B * sh->NH * sh->T * sizeof(float));
    double fwd_flops = 2.0 * sh->B * sh->NH * (double)sh->T * sh->T * sh->hs, bwd_flops = 2.5 * fwd_flops;
    /* the paths: SIMT first (the errors' reference), auto last */
    enum { P_SIMT, P_TC, P_CUDNN, P_CUDNN_ATOMIC, P_AUTO, P_N };
    static const char *const names[P_N] = {"simt", "tensor_cores", "cudnn", "cudnn_atomic", "auto"};
    int run[P_N] = {1, 0, 0, 0, 1};
    int paths = ab == 2 && be->set_attention;
    run[P_TC] = paths && strstr(desc, "tensor cores passed") != NULL;
    run[P_CUDNN] = run[P_CUDNN_ATOMIC] = paths && strstr(desc, "among cudnn") != NULL;
    run[P_CUDNN_ATOMIC] = run[P_CUDNN_ATOMIC] && be->set_attention_deterministic;
    uint64_t hash[P_N] = {0};
    double tf[P_N] = {0}, tb[P_N] = {0};
    float *ref_out = NULL, *ref_dqkv = NULL;
    for (int k = 0; k < P_N; k++) {
        if (!run[k]) continue;
        if (k == P_CUDNN_ATOMIC) { /* chosen again under auto: a refused atomic graph is a line, not an exit */
            be->set_attention("auto");
            be->set_attention_deterministic(0);
            if (!strstr(desc, "among cudnn")) { /* desc: the backend's line, rewritten as the choice changes */
                printf("# skip cudnn_atomic: auto does not keep cuDNN's atomic backward: %s\n", desc);
                be->set_attention_deterministic(1);
                continue;
            }
        }
        if (paths) be->set_attention(k == P_CUDNN_ATOMIC ? "cudnn" : names[k]);
        tf[k] = best_time(0, &x, reps);
        tb[k] = best_time(1, &x, reps);
        float *h_out = fetch(x.out, x.nc, ab), *h_dqkv = fetch(x.dqkv, x.n3, ab);
        hash[k] = hash_bytes(h_out, x.nc * sizeof(float)) ^ hash_bytes(h_dqkv, x.n3 * sizeof(float)) * 3;
        if (k == P_SIMT) ref_out = h_out, ref_dqkv = h_dqkv;
        printf("bench_attention shape=%s impl=%s doc_len=%d B=%d T=%d NH=%d hs=%d fwd_ms=%.3f bwd_ms=%.3f "
               "fwd_tflops=%.2f bwd_tflops=%.2f total_tflops=%.2f err_out=%.1e err_dqkv=%.1e\n",
               sh->name, paths ? names[k] : k == P_AUTO ? "auto" : "default", doc_len, sh->B, sh->T, sh->NH,
               sh->hs, 1e3 * tf[k], 1e3 * tb[k], fwd_flops / tf[k] / 1e12, bwd_flops / tb[k] / 1e12,
               (fwd_flops + bwd_flops) / (tf[k] + tb[k]) / 1e12, test_max_rel(h_out, ref_out, x.nc),
               test_max_rel(h_dqkv, ref_dqkv, x.n3));
        fflush(stdout);
        if (k == P_CUDNN_ATOMIC) be->set_attention_deterministic(1);
        if (k != P_SIMT) free(h_out), free(h_dqkv);
        if (k == P_SIMT && !paths) break; /* one path: auto is it */
    }
    if (paths) be->set_attention("auto");
    const char *path = "default"; /* a backend without the choice: its one path */
    if (paths) {
        path = "other";
        for (int k = P_CUDNN; k >= P_SIMT; k--) /* auto's order; the atomic form only when asked */
            if (run[k] && hash[k] == hash[P_AUTO]) path = names[k];
    }
    int a = paths ? P_AUTO : P_SIMT;
    double gf = fwd_flops / tf[a] / 1e12, gb = bwd_flops / tb[a] / 1e12;
    printf("bench_attention_auto shape=%s path=%s fwd_tflops=%.2f bwd_tflops=%.2f target_fwd=%.0f target_bwd=%.0f "
           "fwd_target=%s bwd_target=%s\n",
           sh->name, path, gf, gb, TARGET_FWD, TARGET_BWD, gf >= TARGET_FWD ? "met" : "below",
           gb >= TARGET_BWD ? "met" : "below");
    fflush(stdout);
    free(ref_out), free(ref_dqkv);
    be->free(x.qkv), be->free(x.dout), be->free(x.out), be->free(x.dqkv), be->free(x.lse);
    if (doc) be->free(doc);
}

int main(int argc, char **argv) {
    const char *name = argc > 1 ? argv[1] : "cuda", *prec = argc > 2 ? argv[2] : "bf16";
    const char *which = argc > 4 ? argv[4] : "gpt2";
    int doc_len = argc > 3 ? atoi(argv[3]) : 0;
    static const Shape shapes[] = {
        {"124m", 16, 1024, 12, 64}, /* GPT-2 124M at micro-batch 16 */
        {"1558m", 8, 1024, 25, 64}, /* GPT-2 1.5B at micro-batch 8 */
        {"small", 2, 256, 2, 64},   /* the CPU and the emulation */
    };
    int want[3] = {!strcmp(which, "gpt2") || !strcmp(which, "124m"), !strcmp(which, "gpt2") || !strcmp(which, "1558m"),
                   !strcmp(which, "small")};
    if (!want[0] && !want[1] && !want[2]) {
        fprintf(stderr, "bench_attention: shapes '%s' is not one of gpt2|124m|1558m|small\n", which);
        return 2;
    }
    be = backend_get(name);
    if (!be || !backend_available(name)) {
        printf("skip bench_attention: %s\n", be ? "no GPU" : "backend not in this build");
        return 0;
    }
    const char *desc = be->init(0);
    if (be->set_precision) be->set_precision(prec);
    printf("# %s\n", desc); /* after set_precision: says which paths `auto` kept */
    printf("# FLOPs: the causal half, 2 per multiply-add: forward 2 B NH T^2 hs (half of 4 B T^2 NH hs), backward "
           "2.5x (five products, FlashAttention-2's count); targets (H200): forward >= %.0f, backward >= %.0f "
           "TFLOP/s for auto's path\n", TARGET_FWD, TARGET_BWD);
    size_t ab = be->act_bytes();
    Rng rng;
    rng_seed(&rng, 1);
    for (int i = 0; i < 3; i++)
        if (want[i]) bench_shape(&shapes[i], desc, doc_len, i == 2 ? 0 : REPS, &rng, ab);
    be->shutdown();
    return 0;
}
