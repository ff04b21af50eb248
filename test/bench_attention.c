/* bench_attention: attention forward + backward throughput of a backend at
 * GPT-2 124M's attention shape (T 1024, C 768, NH 12: hs 64) for B = 8 and
 * 16, on each attention implementation the backend offers (CUDA with bf16
 * activations: precision.attention simt, tensor_cores and, where the start-up
 * self-check kept it as a candidate of `auto`, cudnn). Not part of the suite
 * (not test_*); scripts/cuda_check.sh runs it on a GPU:
 *   build/test/bench_attention [backend [precision [doc_len [B]]]]   (cuda bf16 by default)
 * doc_len > 0: document masking (AttnShape.doc) with documents of doc_len
 * tokens; the FLOP figures still count the whole causal half (so they show
 * the speed-up of the skipped blocks as a rate above the dense one). B: one
 * batch size instead of 8 and 16 (a CPU run).
 * It prints the backend's description line (the candidates `auto` kept, with
 * the self-checks' figures), then one line per implementation and batch with
 * its times and its max error against the SIMT kernels' results on the same
 * inputs (max |x - simt| / max |simt|, out and dqkv; the backward of each
 * reads its own forward's out and lse, as in training).
 *
 * FLOPs are counted for the causal half only, 2 per multiply-add: the forward
 * does Q K^T and P V over the lower triangle, 2 * 2 * B*NH * T^2/2 * hs =
 * 2 B NH T^2 hs; the backward 2.5x that (five such products: Q K^T again,
 * dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q), so forward + backward is
 * 7 B NH T^2 hs. Softmax exponentials and the D = rowsum(dO O) pass are not
 * counted. Timings: best of REPS after a warm-up call. */
#include "backend.h"
#include "util.h"
#include "max_rel.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define REPS 5

static const Backend *be;

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

/* Best of REPS timings of `which` (0 forward, 1 backward), seconds. */
static double best_time(int which, void *out, float *lse, void *qkv, void *dout, void *dqkv, int B, int T, int C,
                        int NH, const int32_t *doc) {
    double best = 1e30;
    for (int r = 0; r <= REPS; r++) {
        be->sync();
        double t0 = kiln_now();
        if (which == 0) be->attention_forward(out, lse, qkv, &(AttnShape){B, T, NH, NH, C / NH, doc});
        else be->attention_backward(dqkv, dout, qkv, out, lse, &(AttnShape){B, T, NH, NH, C / NH, doc});
        be->sync();
        double dt = kiln_now() - t0;
        if (r > 0 && dt < best) best = dt; /* r = 0: warm-up */
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


int main(int argc, char **argv) {
    const char *name = argc > 1 ? argv[1] : "cuda", *prec = argc > 2 ? argv[2] : "bf16";
    be = backend_get(name);
    if (!be || !backend_available(name)) {
        printf("skip bench_attention: %s\n", be ? "no GPU" : "backend not in this build");
        return 0;
    }
    const char *desc = be->init(0);
    if (be->set_precision) be->set_precision(prec);
    printf("# %s\n", desc); /* after set_precision: says which attention `auto` chose */
    size_t ab = be->act_bytes();
    const int T = 1024, C = 768, NH = 12, hs = C / NH, doc_len = argc > 3 ? atoi(argv[3]) : 0;
    int Bs[] = {8, 16}, nB = 2;
    if (argc > 4) Bs[0] = atoi(argv[4]), nB = 1;
    /* simt first: the reference of the error columns */
    const char *impls[] = {"simt", "tensor_cores", "cudnn"};
    int nimpl = ab == 2 && be->set_attention ? (strstr(desc, "among cudnn") ? 3 : 2) : 1;
    Rng rng;
    rng_seed(&rng, 1);
    for (int bi = 0; bi < nB; bi++) {
        int B = Bs[bi];
        size_t N = (size_t)B * T;
        int32_t *doc = NULL; /* (B, T) device: each row's document start */
        if (doc_len > 0) {
            int32_t *h = xmalloc(N * sizeof(int32_t));
            for (size_t i = 0; i < N; i++) h[i] = (int32_t)((i % T) / doc_len * doc_len);
            doc = be->alloc(N * sizeof(int32_t));
            be->to_device(doc, h, N * sizeof(int32_t));
            free(h);
        }
        void *qkv = dev_randn(N * 3 * C, &rng, 1.0f, ab), *dout = dev_randn(N * C, &rng, 1.0f, ab);
        void *out = be->alloc(N * C * ab), *dqkv = be->alloc(N * 3 * C * ab);
        float *lse = be->alloc((size_t)B * NH * T * sizeof(float));
        double fwd_flops = 2.0 * B * NH * (double)T * T * hs, bwd_flops = 2.5 * fwd_flops;
        float *ref_out = NULL, *ref_dqkv = NULL;
        for (int k = 0; k < nimpl; k++) {
            if (nimpl > 1) be->set_attention(impls[k]);
            double tf = best_time(0, out, lse, qkv, dout, dqkv, B, T, C, NH, doc);
            double tb = best_time(1, out, lse, qkv, dout, dqkv, B, T, C, NH, doc);
            float *h_out = fetch(out, N * C, ab), *h_dqkv = fetch(dqkv, N * 3 * C, ab);
            if (k == 0) ref_out = h_out, ref_dqkv = h_dqkv;
            printf("bench_attention impl=%s doc_len=%d B=%d T=%d C=%d NH=%d fwd_ms=%.3f bwd_ms=%.3f fwd_tflops=%.2f "
                   "bwd_tflops=%.2f total_tflops=%.2f err_out=%.1e err_dqkv=%.1e\n",
                   nimpl > 1 ? impls[k] : "default", doc_len, B, T, C, NH, 1e3 * tf, 1e3 * tb, fwd_flops / tf / 1e12,
                   bwd_flops / tb / 1e12, (fwd_flops + bwd_flops) / (tf + tb) / 1e12,
                   test_max_rel(h_out, ref_out, N * C), test_max_rel(h_dqkv, ref_dqkv, N * 3 * C));
            fflush(stdout);
            if (k > 0) free(h_out), free(h_dqkv);
        }
        free(ref_out), free(ref_dqkv);
        if (nimpl > 1) be->set_attention("auto");
        be->free(qkv), be->free(dout), be->free(out), be->free(dqkv), be->free(lse);
        if (doc) be->free(doc);
    }
    be->shutdown();
    return 0;
}
