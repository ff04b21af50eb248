/* cuda_emu: the CUDA backend's SIMT kernels with their host wrappers
 * (cuda/embed_norm.cu, pointwise.cu, attention.cu, attention_block.cu), compiled for the CPU
 * against test/cuda_emu.h and compared op by op with the CPU backend on the
 * same random inputs, in both activation dtypes, at shapes that are not
 * multiples of any block size. Built and run by test/t_cuda_emu.sh; one
 * "ok"/"FAIL" line per check. Everything goes through the backend_cuda
 * table (backend_cuda.cu under the emulation: start-up, memory, the staging
 * ring, scratch, precision and the attention choice) except cuBLASLt
 * (matmul.cu), which is left out. Test buffers come from cudaMalloc, so
 * outputs start as garbage (NaN bytes): an element an op fails to write shows.
 *
 * Tolerances: max |cuda - cpu| / max |cpu| per tensor ("normalised"). Both
 * sides read the same values (inputs rounded to the activation dtype first)
 * and compute in fp32; they differ in summation order and in the store.
 *  - fp32 outputs 1e-5: sums of <= a few hundred terms in another order (warp
 *    butterflies, chunked column sums, tiled online softmax) differ by a few
 *    fp32 ulps of the largest term, ~1e-6 of the max; an indexing or mask bug
 *    errs by 1e-2 or more.
 *  - bf16 outputs 1e-2: the CUDA side rounds its fp32 result to bf16 once
 *    (half an ulp, 2^-9 = 2e-3 of an element, so at most that of the max),
 *    plus the fp32 differences above; 1e-2 is ~5x that.
 *  - exact (same bits): the embedding gradients (dwte, dwpe) and AdamW, which
 *    the README promises; the fp32 adds, the cast, embed forward and the
 *    residual add, whose one fp32 operation per element is the same on both
 *    sides, rounded once (compared after rounding the CPU's result).
 *  - sumsq 1e-12 relative: double sums of fp32 squares in another order. */
#include "cuda_emu.h"
#include "max_rel.h"
#include "test.h"

#include "../cuda/embed_norm.cu"
#include "../cuda/pointwise.cu"
#include "../cuda/llama.cu"
#include "../cuda/moe.cu"
#include "../cuda/attention.cu"
#include "../cuda/attention_tc.cu"
#include "../cuda/attention_block.cu"
#include "../cuda/fp8.cu"

/* cuDNN stand-in (the real graphs need a GPU; test_cudnn_graph checks their
 * descriptors). Off, it answers as a build without cuDNN; on
 * (test_attention_cudnn_fallback), it loads, plans any shape, runs the SIMT
 * kernels (so it passes the self-check) and fails every execute at batch size
 * emu_cudnn_fail_b, as an engine that planned a shape but cannot run it would. */
static int emu_cudnn_on, emu_cudnn_fail_b, emu_cudnn_calls;
static int emu_cudnn_jitter; /* the stand-in's backward flips the last bit of dqkv[0] every other call */
int cuda_attention_cudnn_load(char *why, size_t n) {
    if (!emu_cudnn_on) snprintf(why, n, "the emulation's cuDNN stand-in is off");
    return emu_cudnn_on;
}
const char *cuda_attention_cudnn_library(void) { return "the emulation's cuDNN stand-in"; }
int cuda_attention_cudnn_plan(int B, int T, int C, int NH, char *why, size_t n) { return cuda_attention_cudnn_load(why, n); }
int cuda_attention_cudnn_forward(void *out, float *lse, const void *qkv, int B, int T, int C, int NH, char *why,
                                 size_t n) {
    const AttnShape s = {B, T, NH, NH, C / NH, NULL};
    emu_cudnn_calls++;
    if (B == emu_cudnn_fail_b) return snprintf(why, n, "stand-in execute failure at B=%d", B), 0;
    cuda_attention_simt_forward(out, lse, qkv, &s);
    return 1;
}
int cuda_attention_cudnn_backward(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                                  int B, int T, int C, int NH, char *why, size_t n) {
    const AttnShape s = {B, T, NH, NH, C / NH, NULL};
    emu_cudnn_calls++;
    if (B == emu_cudnn_fail_b) return snprintf(why, n, "stand-in execute failure at B=%d", B), 0;
    cuda_attention_simt_backward(dqkv, dout, qkv, out, lse, &s);
    if (emu_cudnn_jitter && emu_cudnn_calls % 2) ((unsigned char *)dqkv)[0] ^= 1; /* as atomics' order would */
    return 1;
}
void cuda_attention_cudnn_reset(void) {}
void cuda_attention_cudnn_set_deterministic(int) {}
int cuda_attention_cudnn_fits(int C, int NH) { return (C / NH) % 8 == 0 && C / NH <= 128; }
extern "C" const char *cuda_cudnn_build_info(void) { return "cuDNN attention: the emulation's stand-in"; }
#include "../cuda/backend_cuda.cu"

#include <sys/wait.h>

#include <random>
#include <string>

/* matmul.cu (cuBLASLt) is left out: its entry points must not be reached. */
void cuda_matmul_init(void) {}
void cuda_matmul_shutdown(void) {}
void cuda_matmul_forward(void *, const void *, const void *, const void *, int, int, int) { emu_fail("matmul called"); }
void cuda_matmul_backward(void *, float *, float *, const void *, const void *, const void *, int, int, int, int) {
    emu_fail("matmul called");
}
void cuda_matmul_gelu_forward(void *, void *, const void *, const void *, const void *, int, int, int) {
    emu_fail("matmul called");
}
void cuda_matmul_backward_dgelu(void *, float *, float *, const void *, const void *, const void *, const void *, int, int,
                                int, int) {
    emu_fail("matmul called");
}
void cuda_fp8_matmul(const Fp8Matmul *) { emu_fail("matmul called"); }
int cuda_fp8_rowwise(void) { return 0; }
/* its products are cuBLASLt's: test/matmul_emu.cc tests it */
void cuda_newton_schulz(float *, int, int, int, float *) { emu_fail("matmul called"); }

#define TOL_F32 1e-5
#define TOL_BF16 1e-2
#define TOL_SUMSQ 1e-12
/* A column sum over 20000 (32770) rows: the CPU adds them one by one in
 * fp32, whose error grows with the row count (measured 4.3e-6 (5.3e-6) of the
 * max); 5e-5 is 10x that and still ~20x below a lost or doubled chunk (1/256,
 * 1/1024 of a sum). */
#define TOL_LONG_SUM 5e-5

typedef std::vector<float> Vec;
static size_t AB;                /* act bytes this round: 4 or 2 */
static const char *DT;           /* "fp32" or "bf16" */
static const Backend *cpu = &backend_cpu, *gpu = &backend_cuda;
static std::mt19937 gen(12345);  /* fixed inputs: a failure replays */
static int failures;

static Vec rnd(size_t n, float scale, float shift = 0.0f) {
    std::normal_distribution<float> d(0.0f, 1.0f);
    Vec v(n);
    for (auto &x : v) x = d(gen) * scale + shift;
    return v;
}
/* Random values that the act dtype holds exactly. */
static Vec rnd_act(size_t n, float scale, float shift = 0.0f) {
    Vec v = rnd(n, scale, shift);
    for (auto &x : v) x = backend_act_round(x, AB);
    return v;
}
static Vec act_round(Vec v) {
    for (auto &x : v) x = backend_act_round(x, AB);
    return v;
}
static void *dev_act(const Vec &h) {
    void *d;
    CUDA_CHECK(cudaMalloc(&d, h.size() * AB + 1));
    std::vector<unsigned char> s(h.size() * AB + 1);
    backend_f32_to_act(s.data(), h.data(), h.size(), AB);
    CUDA_CHECK(cudaMemcpy(d, s.data(), h.size() * AB, cudaMemcpyHostToDevice));
    return d;
}
static float *dev_f32(const Vec &h) {
    float *d;
    CUDA_CHECK(cudaMalloc(&d, h.size() * sizeof(float) + 1));
    CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice));
    return d;
}
static Vec get_act(const void *d, size_t n) {
    std::vector<unsigned char> s(n * AB + 1);
    CUDA_CHECK(cudaMemcpy(s.data(), d, n * AB, cudaMemcpyDeviceToHost));
    Vec h(n);
    backend_act_to_f32(h.data(), s.data(), n, AB);
    return h;
}
static Vec get_f32(const float *d, size_t n) {
    Vec h(n);
    CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
    return h;
}

static void report(const std::string &name, int ok, const char *fmt, double a, double b) {
    char detail[160];
    snprintf(detail, sizeof detail, fmt, a, b);
    printf("%s cuda_emu_%s_%s%s%s\n", ok ? "ok" : "FAIL", DT, name.c_str(), ok ? " # " : ": ", detail);
    failures += !ok;
}
static void report_s(const std::string &name, int ok, const char *detail) {
    printf("%s cuda_emu_%s_%s%s%s\n", ok ? "ok" : "FAIL", DT, name.c_str(), ok ? " # " : ": ", detail);
    failures += !ok;
}
/* Normalised max error against tol; NaN anywhere fails. */
static void check(const std::string &name, const Vec &got, const Vec &ref, double tol) {
    double err = test_max_rel(got.data(), ref.data(), ref.size());
    report(name, err <= tol, "err %.2e (tol %.0e)", err, tol);
}
/* Tolerance for an act output. */
static double tol_act() { return AB == 2 ? TOL_BF16 : TOL_F32; }
/* Same bits (two NaNs count as equal). */
static void check_exact(const std::string &name, const Vec &got, const Vec &ref) {
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < ref.size(); i++) {
        int same = memcmp(&got[i], &ref[i], 4) == 0 || (std::isnan(got[i]) && std::isnan(ref[i]));
        if (!same && !bad++) first = i;
    }
    report(name, bad == 0, "%.0f elements differ, first at %.0f (exact)", (double)bad, (double)first);
}

/* dev_act/dev_f32 copies placed `off` elements into a larger buffer: off 1
 * leaves the 16-byte packs of pointwise.cu for the element-wise fallback. */
static void *at(void *base, size_t off, size_t es) { return (unsigned char *)base + off * es; }
static void *dev_act_off(const Vec &h, size_t off) {
    Vec g(off, 0.0f);
    g.insert(g.end(), h.begin(), h.end());
    return dev_act(g);
}
static float *dev_f32_off(const Vec &h, size_t off) {
    Vec g(off, 0.0f);
    g.insert(g.end(), h.begin(), h.end());
    return dev_f32(g);
}

/* alloc zeroes; to_device through the staging ring (more copies than its
 * 8 slots, each source reused at once) and past it (over 1 MiB); to_host,
 * copy, zero. */
/* host_syncs counts the host's waits on the device: a blocking copy to the
 * device (over the staging ring's 1 MiB slots), a copy to the host and sync,
 * one each; an asynchronous zero or device copy none, nor a staged copy to
 * the device whose slot is free (a wait only when the host runs 8 copies
 * ahead of the device: never here, where every copy is done when its call
 * returns). */
static void test_host_syncs(void) {
    size_t big = ((size_t)1 << 20) + 16;
    std::vector<unsigned char> h(big);
    void *d, *e;
    CUDA_CHECK(cudaMalloc(&d, big));
    CUDA_CHECK(cudaMalloc(&e, big));
    unsigned long s0 = gpu->host_syncs();
    for (int k = 0; k < 20; k++) gpu->to_device(d, h.data(), 64); /* every slot taken twice */
    unsigned long s1 = gpu->host_syncs();
    gpu->zero(d, 64);
    gpu->copy(e, d, 64);
    unsigned long s2 = gpu->host_syncs();
    gpu->to_device(d, h.data(), big);
    gpu->to_host(h.data(), e, 64);
    gpu->sync();
    unsigned long s3 = gpu->host_syncs();
    report("host_syncs_counted", s1 == s0 && s2 == s1 && s3 - s2 == 3,
           "20 staged to_device + zero + copy + a blocking to_device + to_host + sync counted %.0f, want 3 "
           "(0 + 0 + 0 + 3)", (double)(s3 - s0), 0);
    cudaFree(d), cudaFree(e);
}

static void test_memory(void) {
    size_t big = ((size_t)1 << 20) + 12, nsmall = 11, small = 1000;
    unsigned char *z = (unsigned char *)gpu->alloc(small), *b = (unsigned char *)gpu->alloc(big);
    std::vector<unsigned char> h(big), src(big), back(big);
    gpu->to_host(h.data(), z, small);
    int ok = std::all_of(h.begin(), h.begin() + small, [](unsigned char c) { return c == 0; });
    report_s("alloc_zeroed", ok, ok ? "zeroed" : "NOT zeroed");
    std::vector<void *> d(nsmall);
    for (size_t k = 0; k < nsmall; k++) {
        d[k] = gpu->alloc(small);
        for (size_t i = 0; i < small; i++) src[i] = (unsigned char)(k * 31 + i);
        gpu->to_device(d[k], src.data(), small);
        memset(src.data(), 0, small); /* the source may be reused on return */
    }
    gpu->sync();
    ok = 1;
    for (size_t k = 0; k < nsmall; k++) {
        gpu->to_host(back.data(), d[k], small);
        for (size_t i = 0; i < small; i++) ok &= back[i] == (unsigned char)(k * 31 + i);
    }
    report_s("to_device_staged", ok, ok ? "all copies arrived" : "a staged copy was lost or overwritten");
    for (size_t i = 0; i < big; i++) src[i] = (unsigned char)(i * 7 + 3);
    gpu->to_device(b, src.data(), big);
    gpu->copy(z, b + 5, small);
    gpu->to_host(back.data(), b, big);
    gpu->to_host(h.data(), z, small);
    ok = memcmp(back.data(), src.data(), big) == 0 && memcmp(h.data(), src.data() + 5, small) == 0;
    report_s("to_device_large_copy", ok, ok ? "same bytes" : "bytes differ");
    gpu->zero(b + 3, 100);
    gpu->to_host(back.data(), b, big);
    ok = back[2] == src[2] && back[103] == src[103];
    for (size_t i = 3; i < 103; i++) ok &= back[i] == 0;
    report_s("zero", ok, ok ? "exactly the range zeroed" : "wrong range");
    for (size_t k = 0; k < nsmall; k++) gpu->free(d[k]);
    gpu->free(z), gpu->free(b);
}

static void test_cast(size_t n, size_t off) {
    Vec src = rnd(n, 10.0f);
    float specials[] = {NAN, INFINITY, -INFINITY, 3.0e38f, 1e-40f, -0.0f};
    for (size_t i = 0; i < 6 && i < n; i++) src[i * 3 % n] = specials[i];
    float *bs = dev_f32_off(src, off);
    void *bd;
    CUDA_CHECK(cudaMalloc(&bd, (n + off) * AB));
    void *dst = at(bd, off, AB);
    gpu->cast_to_act(dst, bs + off, n);
    check_exact("cast_to_act_n" + std::to_string(n) + (off ? "_unaligned" : ""), get_act(dst, n), act_round(src));
    cudaFree(bs), cudaFree(bd);
}

static void test_embed(void) {
    const int B = 3, T = 13, C = 48, V = 100, Vp = 128, N = B * T;
    std::vector<int32_t> tok(N);
    for (auto &t : tok) t = (int32_t)(gen() % V);
    tok[5] = tok[17] = tok[30] = 42; /* a token seen three times: its dwte row sums in position order */
    Vec wte = rnd_act((size_t)Vp * C, 1.0f), wpe = rnd_act((size_t)T * C, 1.0f);
    Vec ref((size_t)N * C);
    cpu->embed_forward(ref.data(), tok.data(), wte.data(), wpe.data(), B, T, C);
    int32_t *dtok;
    CUDA_CHECK(cudaMalloc(&dtok, N * sizeof(int32_t)));
    CUDA_CHECK(cudaMemcpy(dtok, tok.data(), N * sizeof(int32_t), cudaMemcpyHostToDevice));
    void *dwte_a = dev_act(wte), *dwpe_a = dev_act(wpe), *dout;
    CUDA_CHECK(cudaMalloc(&dout, (size_t)N * C * AB));
    gpu->embed_forward(dout, dtok, dwte_a, dwpe_a, B, T, C);
    check_exact("embed_forward", get_act(dout, (size_t)N * C), act_round(ref));
    cudaFree(dwte_a), cudaFree(dwpe_a), cudaFree(dout);

    /* the tokens read back from the device (tokens_host NULL: a host wait)
     * or given in host memory (none): the same plan, the same bits */
    for (int acc = 0; acc <= 1; acc++)
        for (int host = 0; host <= 1; host++) {
            Vec g = rnd_act((size_t)N * C, 1.0f), gwte = rnd((size_t)Vp * C, 1.0f), gwpe = rnd((size_t)T * C, 1.0f);
            Vec rwte = gwte, rwpe = gwpe;
            cpu->embed_backward(rwte.data(), rwpe.data(), g.data(), tok.data(), NULL, B, T, C, acc);
            void *dg = dev_act(g);
            float *dw = dev_f32(gwte), *dp = dev_f32(gwpe);
            unsigned long s0 = gpu->host_syncs();
            gpu->embed_backward(dw, dp, dg, dtok, host ? tok.data() : NULL, B, T, C, acc);
            unsigned long waits = gpu->host_syncs() - s0;
            std::string s = std::string(host ? "_host_tokens" : "") + (acc ? "_acc1" : "_acc0");
            check_exact("embed_backward_dwte" + s, get_f32(dw, rwte.size()), rwte);
            check_exact("embed_backward_dwpe" + s, get_f32(dp, rwpe.size()), rwpe);
            if (host)
                report("embed_backward_host_waits" + s, waits == 0, "%.0f host waits (want 0: the plan goes up "
                       "through the staging ring)", (double)waits, 0);
            cudaFree(dg), cudaFree(dw), cudaFree(dp);
        }
    cudaFree(dtok);

    /* wpe NULL (RoPE models: no learned positions): out = wte[tokens], and
     * embed_backward leaves the position gradient alone (dwte only). */
    Vec ref0((size_t)N * C);
    cpu->embed_forward(ref0.data(), tok.data(), wte.data(), NULL, B, T, C);
    CUDA_CHECK(cudaMalloc(&dtok, N * sizeof(int32_t)));
    CUDA_CHECK(cudaMemcpy(dtok, tok.data(), N * sizeof(int32_t), cudaMemcpyHostToDevice));
    dwte_a = dev_act(wte);
    CUDA_CHECK(cudaMalloc(&dout, (size_t)N * C * AB));
    gpu->embed_forward(dout, dtok, dwte_a, NULL, B, T, C);
    check_exact("embed_forward_no_wpe", get_act(dout, (size_t)N * C), act_round(ref0));
    for (int acc = 0; acc <= 1; acc++) {
        Vec g = rnd_act((size_t)N * C, 1.0f), gwte = rnd((size_t)Vp * C, 1.0f), rwte = gwte;
        cpu->embed_backward(rwte.data(), NULL, g.data(), tok.data(), NULL, B, T, C, acc);
        void *dg = dev_act(g);
        float *dw = dev_f32(gwte);
        gpu->embed_backward(dw, NULL, dg, dtok, acc ? tok.data() : NULL, B, T, C, acc);
        check_exact(std::string("embed_backward_no_wpe_dwte") + (acc ? "_acc1" : "_acc0"), get_f32(dw, rwte.size()),
                    rwte);
        cudaFree(dg), cudaFree(dw);
    }
    cudaFree(dwte_a), cudaFree(dout), cudaFree(dtok);
}

static void test_layernorm(int N, int C, double tol_sum = TOL_F32) {
    std::string sh = "_N" + std::to_string(N) + "_C" + std::to_string(C);
    Vec x = rnd_act((size_t)N * C, 2.0f, 0.5f), w = rnd_act(C, 1.0f, 1.0f), b = rnd_act(C, 0.5f);
    Vec out((size_t)N * C), mean(N), rstd(N);
    cpu->layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, 1e-5f);
    void *dx = dev_act(x), *dw = dev_act(w), *db = dev_act(b), *dout;
    float *dmean, *drstd;
    CUDA_CHECK(cudaMalloc(&dout, (size_t)N * C * AB));
    CUDA_CHECK(cudaMalloc(&dmean, N * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&drstd, N * sizeof(float)));
    gpu->layernorm_forward(dout, dmean, drstd, dx, dw, db, N, C, 1e-5f);
    check("layernorm_forward_out" + sh, get_act(dout, (size_t)N * C), out, tol_act());
    check("layernorm_forward_mean" + sh, get_f32(dmean, N), mean, TOL_F32);
    check("layernorm_forward_rstd" + sh, get_f32(drstd, N), rstd, TOL_F32);
    /* the backward of both reads the CPU's statistics */
    CUDA_CHECK(cudaMemcpy(dmean, mean.data(), N * sizeof(float), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(drstd, rstd.data(), N * sizeof(float), cudaMemcpyHostToDevice));
    for (int acc = 0; acc <= 1; acc++) {
        Vec g = rnd_act((size_t)N * C, 1.0f), dinp = rnd_act((size_t)N * C, 1.0f);
        Vec gw = rnd(C, 1.0f), gb = rnd(C, 1.0f);
        Vec rdinp = dinp, rgw = gw, rgb = gb;
        cpu->layernorm_backward(rdinp.data(), rgw.data(), rgb.data(), g.data(), x.data(), w.data(), mean.data(),
                                rstd.data(), N, C, acc);
        void *dg = dev_act(g), *ddinp = dev_act(dinp);
        float *dgw = dev_f32(gw), *dgb = dev_f32(gb);
        gpu->layernorm_backward(ddinp, dgw, dgb, dg, dx, dw, dmean, drstd, N, C, acc);
        std::string s = sh + (acc ? "_acc1" : "_acc0");
        check("layernorm_backward_dinp" + s, get_act(ddinp, (size_t)N * C), rdinp, tol_act());
        check("layernorm_backward_dw" + s, get_f32(dgw, C), rgw, tol_sum);
        check("layernorm_backward_db" + s, get_f32(dgb, C), rgb, tol_sum);
        cudaFree(dg), cudaFree(ddinp), cudaFree(dgw), cudaFree(dgb);
    }
    cudaFree(dx), cudaFree(dw), cudaFree(db), cudaFree(dout), cudaFree(dmean), cudaFree(drstd);
}

/* The bias gradient of matmul_backward (cuBLASLt's products are not
 * emulated; its dbias is embed_norm.cu's column sum): against the CPU
 * backend's matmul_backward with dinp NULL. */
static void test_colsum(int N, int OC, double tol) {
    const int C = 3;
    Vec g = rnd_act((size_t)N * OC, 1.0f), inp = rnd((size_t)N * C, 1.0f), w = rnd((size_t)OC * C, 1.0f);
    for (int acc = 0; acc <= 1; acc++) {
        Vec dw((size_t)OC * C, 0.0f), db = rnd(OC, 1.0f), rdb = db;
        cpu->matmul_backward(NULL, dw.data(), rdb.data(), g.data(), inp.data(), w.data(), N, C, OC, acc);
        void *dg = dev_act(g);
        float *ddb = dev_f32(db);
        cuda_colsum(ddb, dg, N, OC, acc);
        check("matmul_dbias_colsum_N" + std::to_string(N) + "_OC" + std::to_string(OC) + (acc ? "_acc1" : "_acc0"),
              get_f32(ddb, OC), rdb, tol);
        cudaFree(dg), cudaFree(ddb);
    }
}

static void test_pointwise(size_t n, size_t off) {
    std::string sh = "_n" + std::to_string(n) + (off ? "_unaligned" : "");
    Vec x = rnd_act(n, 2.0f), g = rnd_act(n, 1.0f), y = rnd_act(n, 1.0f), out(n), dinp(n);
    cpu->gelu_forward(out.data(), x.data(), n);
    cpu->gelu_backward(dinp.data(), x.data(), g.data(), n);
    void *bx = dev_act_off(x, off), *bg = dev_act_off(g, off), *by = dev_act_off(y, off), *bout;
    CUDA_CHECK(cudaMalloc(&bout, (n + off) * AB));
    void *dx = at(bx, off, AB), *dg = at(bg, off, AB), *dy = at(by, off, AB), *dout = at(bout, off, AB);
    gpu->gelu_forward(dout, dx, n);
    check("gelu_forward" + sh, get_act(dout, n), out, tol_act());
    gpu->gelu_backward(dout, dx, dg, n);
    check("gelu_backward" + sh, get_act(dout, n), dinp, tol_act());
    cpu->residual_forward(out.data(), x.data(), y.data(), n);
    gpu->residual_forward(dout, dx, dy, n);
    check_exact("residual_forward" + sh, get_act(dout, n), act_round(out));
    cudaFree(bx), cudaFree(bg), cudaFree(by), cudaFree(bout);

    Vec a = rnd(n, 1.0f), b = rnd(n, 1.0f), s(n);
    cpu->add(s.data(), a.data(), b.data(), n);
    float *ba = dev_f32_off(a, off), *bb = dev_f32_off(b, off), *bs;
    CUDA_CHECK(cudaMalloc(&bs, (n + off) * sizeof(float)));
    float *da = ba + off, *db = bb + off, *ds = bs + off;
    gpu->add(ds, da, db, n);
    check_exact("add" + sh, get_f32(ds, n), s);
    gpu->add(da, da, db, n); /* in place, as ddp.c may call it */
    check_exact("add_inplace" + sh, get_f32(da, n), s);
    cudaFree(ba), cudaFree(bb), cudaFree(bs);
}

/* Vocabulary-parallel cross-entropy and embeddings (tensor parallelism): P
 * slices of Vl columns (V real ones in all, the last slices short or
 * empty), each slice's xent_partial and xent_finish on the GPU against the
 * CPU's, and an embedding whose negative ids are other ranks' tokens. */
static void test_vocab_parallel(int N, int V, int P, int Vl) {
    std::string sh = "_N" + std::to_string(N) + "_V" + std::to_string(V) + "_P" + std::to_string(P);
    std::vector<int32_t> tg(N);
    for (auto &t : tg) t = (int32_t)(gen() % V);
    Vec stats_cpu((size_t)P * N * 3);
    float *dstats;
    CUDA_CHECK(cudaMalloc(&dstats, stats_cpu.size() * sizeof(float)));
    std::vector<Vec> parts;
    std::vector<std::vector<int32_t>> tls;
    std::vector<void *> dparts;
    std::vector<int32_t *> dtls;
    for (int p = 0; p < P; p++) {
        int valid = std::max(0, std::min(Vl, V - p * Vl));
        Vec x = rnd_act((size_t)N * Vl, 3.0f);
        std::vector<int32_t> tl(N);
        for (int i = 0; i < N; i++) tl[i] = tg[i] >= p * Vl && tg[i] < (p + 1) * Vl ? tg[i] - p * Vl : -1;
        cpu->xent_partial(stats_cpu.data() + (size_t)p * N * 3, x.data(), tl.data(), N, valid, Vl);
        int32_t *dtl;
        CUDA_CHECK(cudaMalloc(&dtl, N * sizeof(int32_t)));
        CUDA_CHECK(cudaMemcpy(dtl, tl.data(), N * sizeof(int32_t), cudaMemcpyHostToDevice));
        void *dx = dev_act(x);
        gpu->xent_partial(dstats + (size_t)p * N * 3, dx, dtl, N, valid, Vl);
        parts.push_back(x), tls.push_back(tl), dparts.push_back(dx), dtls.push_back(dtl);
    }
    /* an empty slice's max is -inf on both sides: compared as a plain number */
    Vec got = get_f32(dstats, stats_cpu.size()), want = stats_cpu;
    for (size_t i = 0; i < got.size(); i++) {
        if (got[i] == -INFINITY) got[i] = -1e30f;
        if (want[i] == -INFINITY) want[i] = -1e30f;
    }
    check("xent_partial_stats" + sh, got, want, TOL_F32);
    CUDA_CHECK(cudaMemcpy(dstats, stats_cpu.data(), stats_cpu.size() * sizeof(float), cudaMemcpyHostToDevice));
    float dloss = 1.0f / N;
    for (int p = 0; p < P; p++) {
        int valid = std::max(0, std::min(Vl, V - p * Vl));
        Vec rl = parts[p], rloss(N);
        cpu->xent_finish(rl.data(), rloss.data(), stats_cpu.data(), P, tls[p].data(), N, valid, Vl, dloss);
        float *dl;
        CUDA_CHECK(cudaMalloc(&dl, N * sizeof(float)));
        gpu->xent_finish(dparts[p], dl, dstats, P, dtls[p], N, valid, Vl, dloss);
        std::string s = sh + "_rank" + std::to_string(p);
        check("xent_finish_losses" + s, get_f32(dl, N), rloss, TOL_F32);
        check("xent_finish_dlogits" + s, get_act(dparts[p], (size_t)N * Vl), rl, tol_act());
        cudaFree(dl), cudaFree(dparts[p]), cudaFree(dtls[p]);
    }
    cudaFree(dstats);

    /* embeddings: every third id another rank's */
    const int B = 2, T = N / 2, C = 40;
    std::vector<int32_t> tok(B * T);
    for (int i = 0; i < B * T; i++) tok[i] = i % 3 == 1 ? -1 : (int32_t)(gen() % Vl);
    Vec wte = rnd_act((size_t)Vl * C, 1.0f), wpe = rnd_act((size_t)T * C, 1.0f), ref((size_t)B * T * C);
    cpu->embed_forward(ref.data(), tok.data(), wte.data(), wpe.data(), B, T, C);
    int32_t *dtok;
    CUDA_CHECK(cudaMalloc(&dtok, tok.size() * sizeof(int32_t)));
    CUDA_CHECK(cudaMemcpy(dtok, tok.data(), tok.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    void *dw = dev_act(wte), *dp = dev_act(wpe), *dout;
    CUDA_CHECK(cudaMalloc(&dout, ref.size() * AB));
    gpu->embed_forward(dout, dtok, dw, dp, B, T, C);
    check_exact("embed_forward_other_ranks_ids" + sh, get_act(dout, ref.size()), act_round(ref));
    Vec g = rnd_act(ref.size(), 1.0f), gwte = rnd((size_t)Vl * C, 1.0f), gwpe = rnd((size_t)T * C, 1.0f);
    Vec rwte = gwte, rwpe = gwpe;
    cpu->embed_backward(rwte.data(), rwpe.data(), g.data(), tok.data(), NULL, B, T, C, 0);
    void *dg = dev_act(g);
    float *dgw = dev_f32(gwte), *dgp = dev_f32(gwpe);
    gpu->embed_backward(dgw, dgp, dg, dtok, tok.data(), B, T, C, 0);
    check_exact("embed_backward_other_ranks_ids" + sh, get_f32(dgw, rwte.size()), rwte);
    cudaFree(dtok), cudaFree(dw), cudaFree(dp), cudaFree(dout), cudaFree(dg), cudaFree(dgw), cudaFree(dgp);
}

static void test_crossentropy(int N, int V, int Vp) {
    std::string sh = "_N" + std::to_string(N) + "_V" + std::to_string(V) + "_Vp" + std::to_string(Vp);
    std::vector<int32_t> tg(N);
    for (auto &t : tg) t = (int32_t)(gen() % V);
    tg[0] = V - 1;
    Vec logits = rnd_act((size_t)N * Vp, 3.0f);
    for (int i = 0; i < N; i++)
        for (int j = V; j < Vp; j++) logits[(size_t)i * Vp + j] = 7.0f; /* padding: ignored, then zeroed */
    int32_t *dtg;
    CUDA_CHECK(cudaMalloc(&dtg, N * sizeof(int32_t)));
    CUDA_CHECK(cudaMemcpy(dtg, tg.data(), N * sizeof(int32_t), cudaMemcpyHostToDevice));
    for (int grad = 0; grad <= 1; grad++) {
        float dloss = grad ? 1.0f / N : 0.0f;
        Vec rl = logits, rloss(N);
        cpu->crossentropy_forward(rl.data(), rloss.data(), tg.data(), N, V, Vp, dloss);
        void *dl = dev_act(logits);
        float *dloss_buf;
        CUDA_CHECK(cudaMalloc(&dloss_buf, N * sizeof(float)));
        gpu->crossentropy_forward(dl, dloss_buf, dtg, N, V, Vp, dloss);
        std::string s = sh + (grad ? "_dlogits" : "_nograd");
        check("crossentropy_losses" + s, get_f32(dloss_buf, N), rloss, TOL_F32);
        Vec gl = get_act(dl, (size_t)N * Vp);
        if (grad) {
            check("crossentropy_dlogits" + s, gl, rl, tol_act());
            Vec pad, rpad;
            for (int i = 0; i < N; i++)
                for (int j = V; j < Vp; j++) pad.push_back(gl[(size_t)i * Vp + j]), rpad.push_back(0.0f);
            if (!pad.empty()) check_exact("crossentropy_padding_zeroed" + s, pad, rpad);
        } else {
            check_exact("crossentropy_logits_untouched" + s, gl, logits);
        }
        cudaFree(dl), cudaFree(dloss_buf);
    }
    cudaFree(dtg);
}

static void test_adamw(size_t n) {
    Vec p = rnd(n, 1.0f), m = rnd(n, 0.01f), v = rnd(n, 1e-4f);
    for (auto &x : v) x = fabsf(x);
    float *dp = dev_f32(p), *dm = dev_f32(m), *dv = dev_f32(v);
    for (int t = 3; t <= 4; t++) { /* two steps: the second starts from each side's own first */
        Vec g = rnd(n, 1.0f);
        float *dg = dev_f32(g);
        cpu->adamw_update(p.data(), g.data(), m.data(), v.data(), n, 6e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, t, NULL, NULL);
        gpu->adamw_update(dp, dg, dm, dv, n, 6e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, t, NULL, NULL);
        cudaFree(dg);
    }
    check_exact("adamw_params_n" + std::to_string(n), get_f32(dp, n), p);
    check_exact("adamw_m_n" + std::to_string(n), get_f32(dm, n), m);
    check_exact("adamw_v_n" + std::to_string(n), get_f32(dv, n), v);
    cudaFree(dp), cudaFree(dm), cudaFree(dv);
}

/* Lion: the kernel must give the CPU's bits; a few elements with m = g = 0
 * take sign(0) = 0 (only weight decay moves them). */
static void test_lion(size_t n) {
    Vec p = rnd(n, 1.0f), m = rnd(n, 0.01f);
    for (size_t i = 0; i < n; i += 97) m[i] = 0.0f;
    float *dp = dev_f32(p), *dm = dev_f32(m);
    for (int t = 1; t <= 2; t++) { /* two steps: the second starts from each side's own first */
        Vec g = rnd(n, 1.0f);
        if (t == 1)
            for (size_t i = 0; i < n; i += 97) g[i] = 0.0f;
        float *dg = dev_f32(g);
        cpu->lion_update(p.data(), g.data(), m.data(), n, 1e-4f, 0.9f, 0.99f, 0.1f, 0.5f, NULL, NULL);
        gpu->lion_update(dp, dg, dm, n, 1e-4f, 0.9f, 0.99f, 0.1f, 0.5f, NULL, NULL);
        cudaFree(dg);
    }
    check_exact("lion_params_n" + std::to_string(n), get_f32(dp, n), p);
    check_exact("lion_m_n" + std::to_string(n), get_f32(dm, n), m);
    cudaFree(dp), cudaFree(dm);
}

/* Muon's elementwise ops: the CPU's bits, the momentum in place (u = grads)
 * as muon.c runs it under ZeRO 2/3 and apart; two steps. */
static void test_muon_ops(size_t n) {
    Vec p = rnd(n, 1.0f), m = rnd(n, 0.01f), u(n);
    float *dp = dev_f32(p), *dm = dev_f32(m), *du = dev_f32(u);
    for (int t = 1; t <= 2; t++) {
        Vec g = rnd(n, 1.0f), o = rnd(n, 0.05f);
        float *dg = dev_f32(g), *dgo = dev_f32(o);
        if (t == 1) {
            cpu->muon_momentum(u.data(), m.data(), g.data(), n, 0.95f, 0.5f);
            gpu->muon_momentum(du, dm, dg, n, 0.95f, 0.5f);
        } else { /* in place */
            cpu->muon_momentum(g.data(), m.data(), g.data(), n, 0.95f, 0.5f);
            gpu->muon_momentum(dg, dm, dg, n, 0.95f, 0.5f);
            u = g;
            CUDA_CHECK(cudaMemcpy(du, dg, n * sizeof(float), cudaMemcpyDeviceToDevice));
        }
        cpu->muon_apply(p.data(), o.data(), n, 0.02f, 1.7f, 0.1f);
        gpu->muon_apply(dp, dgo, n, 0.02f, 1.7f, 0.1f);
        cudaFree(dg), cudaFree(dgo);
    }
    check_exact("muon_momentum_m_n" + std::to_string(n), get_f32(dm, n), m);
    check_exact("muon_momentum_u_n" + std::to_string(n), get_f32(du, n), u);
    check_exact("muon_apply_params_n" + std::to_string(n), get_f32(dp, n), p);
    cudaFree(dp), cudaFree(dm), cudaFree(du);
}

/* Adafactor's ops on a (37, 29) tensor's run from mid-row 5 to 11 short of
 * the end (ZeRO cuts tensors anywhere) and on an unfactored run. The row
 * and column sums are double sums in another order stored in fp32: 1e-6 of
 * the largest (a few fp32 ulps; a lost or doubled row or column errs by
 * 1/29 or more); the sum of squares as sumsq (1e-12 relative); everything
 * elementwise, and the step given the same statistics, the CPU's bits. */
static void test_adafactor(void) {
    const size_t R = 37, C = 29, e0 = 5, n = R * C - 16;
    Vec g = rnd(n, 0.01f), p = rnd(n, 1.0f), m = rnd(n, 0.001f), rows(R, 0.5f), cols(C, 0.25f);
    float *dg = dev_f32(g), *dp = dev_f32(p), *dm = dev_f32(m), *drows = dev_f32(rows), *dcols = dev_f32(cols);
    cpu->adafactor_stats(rows.data(), cols.data(), g.data(), e0, n, (int)C, 0.5f, 1e-30f);
    gpu->adafactor_stats(drows, dcols, dg, e0, n, (int)C, 0.5f, 1e-30f);
    Vec grow = get_f32(drows, R), gcol = get_f32(dcols, C);
    check("adafactor_stats_rows", grow, rows, 1e-6);
    check("adafactor_stats_cols", gcol, cols, 1e-6);
    /* from here on both sides read the CPU's statistics */
    /* second moments are positive: |N(0, 1e-5)| + 1e-6 */
    auto pos = [](Vec x) { for (auto &e : x) e = fabsf(e) + 1e-6f; return x; };
    Vec r = pos(rnd(R, 1e-5f)), c = pos(rnd(C, 1e-5f)), sums = pos(rnd(R, 1e-4f));
    float *dr = dev_f32(r), *dc = dev_f32(c), *dsums = dev_f32(sums);
    cpu->adafactor_ema(r.data(), sums.data(), R, 0.42f, 1.0f / 29);
    gpu->adafactor_ema(dr, dsums, R, 0.42f, 1.0f / 29);
    check_exact("adafactor_ema", get_f32(dr, R), r);
    CUDA_CHECK(cudaMemcpy(dr, r.data(), R * 4, cudaMemcpyHostToDevice));
    double *dq;
    CUDA_CHECK(cudaMalloc((void **)&dq, sizeof(double)));
    double want, got;
    cpu->adafactor_usq(&want, g.data(), NULL, r.data(), c.data(), 2.1e-5f, e0, n, (int)C, 0.5f);
    gpu->adafactor_usq(dq, dg, NULL, dr, dc, 2.1e-5f, e0, n, (int)C, 0.5f);
    CUDA_CHECK(cudaMemcpy(&got, dq, sizeof got, cudaMemcpyDeviceToHost));
    report("adafactor_usq_factored", fabs(got - want) <= TOL_SUMSQ * want, "rel err %.2e (tol %.0e)",
           fabs(got - want) / want, TOL_SUMSQ);
    cpu->adafactor_apply(p.data(), g.data(), m.data(), NULL, r.data(), c.data(), 2.1e-5f, e0, n, (int)C, 0.5f, 0.7f,
                         0.01f, 0.9f, 0.1f);
    gpu->adafactor_apply(dp, dg, dm, NULL, dr, dc, 2.1e-5f, e0, n, (int)C, 0.5f, 0.7f, 0.01f, 0.9f, 0.1f);
    check_exact("adafactor_apply_factored_params", get_f32(dp, n), p);
    check_exact("adafactor_apply_factored_m", get_f32(dm, n), m);
    /* not factored: v, then the step without m */
    Vec v = pos(rnd(n, 1e-5f));
    float *dv = dev_f32(v);
    cpu->adafactor_second(v.data(), g.data(), n, 0.5f, 0.42f, 1e-30f);
    gpu->adafactor_second(dv, dg, n, 0.5f, 0.42f, 1e-30f);
    check_exact("adafactor_second", get_f32(dv, n), v);
    cpu->adafactor_usq(&want, g.data(), v.data(), NULL, NULL, 1.0f, 0, n, 1, 0.5f);
    gpu->adafactor_usq(dq, dg, dv, NULL, NULL, 1.0f, 0, n, 1, 0.5f);
    CUDA_CHECK(cudaMemcpy(&got, dq, sizeof got, cudaMemcpyDeviceToHost));
    report("adafactor_usq_elementwise", fabs(got - want) <= TOL_SUMSQ * want, "rel err %.2e (tol %.0e)",
           fabs(got - want) / want, TOL_SUMSQ);
    cpu->adafactor_apply(p.data(), g.data(), NULL, v.data(), NULL, NULL, 1.0f, 0, n, 1, 0.5f, 1.0f, 0.01f, 0.0f, 0.0f);
    gpu->adafactor_apply(dp, dg, NULL, dv, NULL, NULL, 1.0f, 0, n, 1, 0.5f, 1.0f, 0.01f, 0.0f, 0.0f);
    check_exact("adafactor_apply_elementwise", get_f32(dp, n), p);
    cudaFree(dg), cudaFree(dp), cudaFree(dm), cudaFree(drows), cudaFree(dcols), cudaFree(dr), cudaFree(dc);
    cudaFree(dsums), cudaFree(dq), cudaFree(dv);
}

/* bf16 moments (precision.optim_state bf16): the kernel must give the CPU's
 * bits, the stochastic rounding's included (both call sround.h with the same
 * (seed, t, idx0 + i)); idx0 nonzero as for a ZeRO-1 shard. Moments are
 * compared as the fp32 values of their bf16 bits. */
static void test_adamw_bf16(size_t n) {
    Vec p = rnd(n, 1.0f), m = rnd(n, 0.01f), v = rnd(n, 1e-4f);
    std::vector<uint16_t> m16(n), v16(n);
    for (size_t i = 0; i < n; i++) m16[i] = sround_bf16(m[i], 0x8000u), v16[i] = sround_bf16(fabsf(v[i]), 0x8000u);
    float *dp = dev_f32(p);
    uint16_t *dm, *dv;
    CUDA_CHECK(cudaMalloc(&dm, n * 2));
    CUDA_CHECK(cudaMalloc(&dv, n * 2));
    CUDA_CHECK(cudaMemcpy(dm, m16.data(), n * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dv, v16.data(), n * 2, cudaMemcpyHostToDevice));
    for (int t = 3; t <= 4; t++) {
        Vec g = rnd(n, 1.0f);
        float *dg = dev_f32(g);
        cpu->adamw_update_bf16(p.data(), g.data(), m16.data(), v16.data(), n, 6e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f,
                               t, 1234567ULL, 777, NULL, NULL);
        gpu->adamw_update_bf16(dp, dg, dm, dv, n, 6e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, t, 1234567ULL, 777, NULL, NULL);
        cudaFree(dg);
    }
    std::vector<uint16_t> gm(n), gv(n);
    CUDA_CHECK(cudaMemcpy(gm.data(), dm, n * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(gv.data(), dv, n * 2, cudaMemcpyDeviceToHost));
    Vec fm(n), fv(n), rm(n), rv(n);
    for (size_t i = 0; i < n; i++)
        fm[i] = sround_f32(gm[i]), fv[i] = sround_f32(gv[i]), rm[i] = sround_f32(m16[i]), rv[i] = sround_f32(v16[i]);
    check_exact("adamw_bf16_params_n" + std::to_string(n), get_f32(dp, n), p);
    check_exact("adamw_bf16_m_n" + std::to_string(n), fm, rm);
    check_exact("adamw_bf16_v_n" + std::to_string(n), fv, rv);
    cudaFree(dp), cudaFree(dm), cudaFree(dv);
}

/* bf16 parameters (precision.master bf16), with fp32 and bf16 moments: the
 * kernel must give the CPU's bits, the parameter's stochastic rounding (bits
 * 32..47 of the hash) included; idx0 nonzero as for an arena offset. */
static void test_adamw_p16(size_t n, int state16) {
    Vec p = rnd(n, 1.0f), m = rnd(n, 0.01f), v = rnd(n, 1e-4f);
    size_t sb = state16 ? 2 : 4;
    std::vector<uint16_t> p16(n);
    std::vector<unsigned char> ms(n * sb), vs(n * sb);
    for (size_t i = 0; i < n; i++) {
        p16[i] = sround_bf16(p[i], 0x8000u);
        float vi = fabsf(v[i]);
        if (state16) {
            uint16_t a = sround_bf16(m[i], 0x8000u), b = sround_bf16(vi, 0x8000u);
            memcpy(&ms[2 * i], &a, 2), memcpy(&vs[2 * i], &b, 2);
        } else {
            memcpy(&ms[4 * i], &m[i], 4), memcpy(&vs[4 * i], &vi, 4);
        }
    }
    uint16_t *dp;
    void *dm, *dv;
    CUDA_CHECK(cudaMalloc(&dp, n * 2));
    CUDA_CHECK(cudaMalloc(&dm, n * sb));
    CUDA_CHECK(cudaMalloc(&dv, n * sb));
    CUDA_CHECK(cudaMemcpy(dp, p16.data(), n * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dm, ms.data(), n * sb, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dv, vs.data(), n * sb, cudaMemcpyHostToDevice));
    for (int t = 3; t <= 4; t++) {
        Vec g = rnd(n, 1.0f);
        float *dg = dev_f32(g);
        cpu->adamw_update_p16(p16.data(), g.data(), ms.data(), vs.data(), sb, n, 6e-4f, 0.9f, 0.95f, 1e-8f, 0.1f,
                              0.5f, t, 1234567ULL, 777, NULL);
        gpu->adamw_update_p16(dp, dg, dm, dv, sb, n, 6e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, t, 1234567ULL, 777, NULL);
        cudaFree(dg);
    }
    std::vector<uint16_t> gp(n);
    std::vector<unsigned char> gm(n * sb), gv(n * sb);
    CUDA_CHECK(cudaMemcpy(gp.data(), dp, n * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(gm.data(), dm, n * sb, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(gv.data(), dv, n * sb, cudaMemcpyDeviceToHost));
    Vec fp(n), rp(n);
    for (size_t i = 0; i < n; i++) fp[i] = sround_f32(gp[i]), rp[i] = sround_f32(p16[i]);
    std::string sh = std::string(state16 ? "_state_bf16" : "_state_fp32") + "_n" + std::to_string(n);
    check_exact("adamw_p16_params" + sh, fp, rp);
    int same = gm == ms && gv == vs;
    report_s("adamw_p16_moments" + sh, same, same ? "the cpu backend's bits" : "moments differ from the cpu backend's bits");
    cudaFree(dp), cudaFree(dm), cudaFree(dv);
}

/* The optimizer updates' two extra inputs (backend.h adamw_update): the
 * compute copy written in the update's own pass, and the step's device
 * scalars. Per variant (AdamW with fp32 or bf16 moments, on fp32 or bf16
 * parameters; Lion), from the same start: the update without either gives
 * the CPU's bits; (1) with a copy, every buffer the same bits as without
 * one, and the copy the bits cast_to_act gives the unfused update's
 * parameters (bf16 parameters have no copy); (2) with StepScalars scale 0.5
 * the bits of grad_scale 0.5 (the argument, 9, ignored); (3) with skip set,
 * every buffer and the copy untouched. At off 1 every pointer sits 4 or 2
 * bytes past 16-byte alignment: element by element, not in 8-element packs. */
enum { OPT_ADAMW, OPT_ADAMW_S16, OPT_P16, OPT_P16_S16, OPT_LION, OPT_VARIANTS };
static const char *const opt_name[OPT_VARIANTS] = {"adamw", "adamw_bf16", "adamw_p16", "adamw_p16_bf16", "lion"};
static size_t opt_pbytes(int k) { return k == OPT_P16 || k == OPT_P16_S16 ? 2 : 4; }
static size_t opt_sbytes(int k) { return k == OPT_ADAMW_S16 || k == OPT_P16_S16 ? 2 : 4; }

typedef std::vector<unsigned char> Bytes;
struct OptState {
    Bytes p, m, v; /* n elements each, in the variant's storage */
};
/* Device copies of an OptState placed `off` elements into their buffers. */
struct OptDev {
    unsigned char *base[3];
    void *p, *m, *v;
};
static OptDev opt_upload(const OptState &h, int k, size_t n, size_t off) {
    OptDev d;
    const Bytes *src[3] = {&h.p, &h.m, &h.v};
    size_t es[3] = {opt_pbytes(k), opt_sbytes(k), opt_sbytes(k)};
    void **dst[3] = {&d.p, &d.m, &d.v};
    for (int i = 0; i < 3; i++) {
        CUDA_CHECK(cudaMalloc((void **)&d.base[i], (n + off) * es[i] + 1));
        *dst[i] = d.base[i] + off * es[i];
        CUDA_CHECK(cudaMemcpy(*dst[i], src[i]->data(), n * es[i], cudaMemcpyHostToDevice));
    }
    return d;
}
static OptState opt_download(const OptDev &d, int k, size_t n) {
    OptState h = {Bytes(n * opt_pbytes(k)), Bytes(n * opt_sbytes(k)), Bytes(n * opt_sbytes(k))};
    CUDA_CHECK(cudaMemcpy(h.p.data(), d.p, h.p.size(), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(h.m.data(), d.m, h.m.size(), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(h.v.data(), d.v, h.v.size(), cudaMemcpyDeviceToHost));
    return h;
}
static void opt_free(OptDev &d) {
    for (int i = 0; i < 3; i++) cudaFree(d.base[i]);
}
static int opt_same(const OptState &a, const OptState &b) { return a.p == b.p && a.m == b.m && a.v == b.v; }

static void opt_run(const Backend *be, int k, void *p, const float *g, void *m, void *v, size_t n, float gs,
                    const StepScalars *st, void *copy) {
    switch (k) {
    case OPT_ADAMW:
        be->adamw_update((float *)p, g, (float *)m, (float *)v, n, 6e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, gs, 3, st, copy);
        break;
    case OPT_ADAMW_S16:
        be->adamw_update_bf16((float *)p, g, (uint16_t *)m, (uint16_t *)v, n, 6e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, gs, 3,
                              99, 7, st, copy);
        break;
    case OPT_P16:
    case OPT_P16_S16:
        be->adamw_update_p16((uint16_t *)p, g, m, v, opt_sbytes(k), n, 6e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, gs, 3, 99, 7,
                             st);
        break;
    default:
        be->lion_update((float *)p, g, (float *)m, n, 1e-4f, 0.9f, 0.99f, 0.1f, gs, st, copy);
    }
}

/* n elements of storage es: fp32 of x, or bf16 bits of it (round to nearest). */
static Bytes opt_bytes(const Vec &x, size_t es) {
    Bytes b(x.size() * es);
    for (size_t i = 0; i < x.size(); i++) {
        if (es == 4) {
            memcpy(&b[4 * i], &x[i], 4);
        } else {
            uint16_t h = sround_bf16(x[i], 0x8000u);
            memcpy(&b[2 * i], &h, 2);
        }
    }
    return b;
}

static StepScalars *dev_scalars(float scale, int skip) {
    StepScalars h = {}, *d;
    h.scale = scale, h.skip = skip;
    CUDA_CHECK(cudaMalloc((void **)&d, sizeof h));
    CUDA_CHECK(cudaMemcpy(d, &h, sizeof h, cudaMemcpyHostToDevice));
    return d;
}

static void test_optim_fused(size_t n, size_t off) {
    std::string sh = "_n" + std::to_string(n) + (off ? "_unaligned" : "");
    StepScalars *half = dev_scalars(0.5f, 0), *skip = dev_scalars(0.5f, 1);
    for (int k = 0; k < OPT_VARIANTS; k++) {
        Vec p = rnd(n, 1.0f), m = rnd(n, 0.01f), v = rnd(n, 1e-4f), g = rnd(n, 1.0f);
        for (auto &x : v) x = fabsf(x);
        OptState h0 = {opt_bytes(p, opt_pbytes(k)), opt_bytes(m, opt_sbytes(k)), opt_bytes(v, opt_sbytes(k))};
        int copies = opt_pbytes(k) == 4; /* bf16 parameters are their own compute copy */
        float *dg = dev_f32_off(g, off);
        /* the CPU's bits */
        OptState ref = h0;
        opt_run(cpu, k, ref.p.data(), g.data(), ref.m.data(), ref.v.data(), n, 0.5f, NULL, NULL);
        /* unfused: the update, then the cast */
        OptDev a = opt_upload(h0, k, n, off);
        opt_run(gpu, k, a.p, dg + off, a.m, a.v, n, 0.5f, NULL, NULL);
        OptState ga = opt_download(a, k, n);
        report_s(std::string(opt_name[k]) + "_cpu_bits" + sh, opt_same(ga, ref),
                 opt_same(ga, ref) ? "the cpu backend's bits" : "differs from the cpu backend's bits");
        void *cast_base = NULL, *cast = NULL, *copy_base = NULL, *copy = NULL;
        if (copies) {
            CUDA_CHECK(cudaMalloc(&cast_base, (n + off) * AB + 1));
            CUDA_CHECK(cudaMalloc(&copy_base, (n + off) * AB + 1));
            cast = at(cast_base, off, AB), copy = at(copy_base, off, AB);
            gpu->cast_to_act(cast, (const float *)a.p, n);
        }
        /* (1) fused: the same buffers, and the cast's bits in the copy */
        OptDev b = opt_upload(h0, k, n, off);
        opt_run(gpu, k, b.p, dg + off, b.m, b.v, n, 0.5f, NULL, copy);
        int same = opt_same(opt_download(b, k, n), ga);
        if (copies) same = same && get_act(copy, n) == get_act(cast, n);
        if (copies)
            report_s(std::string(opt_name[k]) + "_fused_copy" + sh, same,
                     same ? "parameters, moments and the compute copy: the unfused update + cast_to_act's bits"
                          : "differs from the unfused update + cast_to_act");
        /* (2) the device's clipping factor */
        OptDev c = opt_upload(h0, k, n, off);
        opt_run(gpu, k, c.p, dg + off, c.m, c.v, n, 9.0f, half, NULL);
        same = opt_same(opt_download(c, k, n), ref);
        report_s(std::string(opt_name[k]) + "_device_scale" + sh, same,
                 same ? "StepScalars.scale 0.5: grad_scale 0.5's bits" : "differs from grad_scale 0.5's bits");
        /* (3) skip: nothing written, the copy included */
        OptDev d = opt_upload(h0, k, n, off);
        Vec sentinel(n, 7.0f);
        if (copies) {
            void *s = dev_act(sentinel);
            CUDA_CHECK(cudaMemcpy(copy, s, n * AB, cudaMemcpyDeviceToDevice));
            cudaFree(s);
        }
        opt_run(gpu, k, d.p, dg + off, d.m, d.v, n, 0.5f, skip, copy);
        same = opt_same(opt_download(d, k, n), h0) && (!copies || get_act(copy, n) == sentinel);
        report_s(std::string(opt_name[k]) + "_device_skip" + sh, same,
                 same ? "StepScalars.skip: every buffer untouched" : "a buffer changed under skip");
        opt_free(a), opt_free(b), opt_free(c), opt_free(d);
        cudaFree(dg), cudaFree(cast_base), cudaFree(copy_base);
    }
    cudaFree(half), cudaFree(skip);
}

/* The step's scalars (backend.h sumsq_acc, loss_acc, step_scalars) against
 * the CPU backend's. sumsq_acc: the same partials and tree as sumsq, added
 * to what *acc held: exactly start + sumsq + sumsq. loss_acc: the mean of
 * each call's N losses, summed in double in another order than the CPU's
 * row order and rounded to float, so at most one float ulp (2^-23 relative)
 * apart per call, 2 calls: 2.5e-7. step_scalars: the same rule (src/clip.h)
 * on the same inputs, so the same bits, skip and scale included: finite
 * with and without clipping, a zero norm, a NaN norm, an infinite loss and
 * a loss whose mean overflows float. */
static void test_step_scalars(void) {
    Vec x = rnd(5000, 2.0f), losses = rnd(3001, 1.0f, 4.0f);
    float *dx = dev_f32(x), *dl = dev_f32(losses);
    double *dacc;
    CUDA_CHECK(cudaMalloc((void **)&dacc, sizeof(double)));
    double start = 2.5, got, want = start + gpu->sumsq(dx, x.size()) + gpu->sumsq(dx, x.size());
    CUDA_CHECK(cudaMemcpy(dacc, &start, sizeof start, cudaMemcpyHostToDevice));
    gpu->sumsq_acc(dacc, dx, x.size());
    gpu->sumsq_acc(dacc, dx, x.size());
    CUDA_CHECK(cudaMemcpy(&got, dacc, sizeof got, cudaMemcpyDeviceToHost));
    report("sumsq_acc", got == want, "got %.17g, want %.17g (start + sumsq twice, exact)", got, want);
    double host = start;
    CUDA_CHECK(cudaMemcpy(dacc, &start, sizeof start, cudaMemcpyHostToDevice));
    for (int r = 0; r < 2; r++) {
        cpu->loss_acc(&host, losses.data(), (int)losses.size());
        gpu->loss_acc(dacc, dl, (int)losses.size());
    }
    CUDA_CHECK(cudaMemcpy(&got, dacc, sizeof got, cudaMemcpyDeviceToHost));
    double err = fabs(got - host) / host;
    report("loss_acc", err <= 2.5e-7, "rel err %.2e (tol 2.5e-7: a float ulp per call) vs %.9g", err, host);
    struct {
        double loss, sumsq;
        int micro;
        float clip;
    } cases[] = {{7.5, 4.0, 2, 1.0f},     {7.5, 0.25, 2, 1.0f},     {7.5, 4.0, 2, 0.0f}, {3.0, 0.0, 1, 1.0f},
                 {7.5, NAN, 2, 1.0f},     {INFINITY, 4.0, 2, 1.0f}, {1e300, 4.0, 2, 1.0f}};
    StepScalars *dst = dev_scalars(0, 0);
    int bad = 0;
    for (auto &c : cases) {
        StepScalars h = {}, g = {};
        h.loss = c.loss, h.sumsq = c.sumsq;
        CUDA_CHECK(cudaMemcpy(dst, &h, sizeof h, cudaMemcpyHostToDevice));
        cpu->step_scalars(&h, c.micro, c.clip);
        gpu->step_scalars(dst, c.micro, c.clip);
        CUDA_CHECK(cudaMemcpy(&g, dst, sizeof g, cudaMemcpyDeviceToHost));
        int skip_want = !std::isfinite(c.sumsq) || !std::isfinite((float)(c.loss / c.micro));
        bad += memcmp(&g, &h, sizeof g) != 0 || h.skip != skip_want;
    }
    report("step_scalars", bad == 0, "%.0f of %.0f cases differ from the cpu's bits or skip wrongly", bad,
           (double)(sizeof cases / sizeof cases[0]));
    cudaFree(dx), cudaFree(dl), cudaFree(dacc), cudaFree(dst);
}

static void test_sumsq(size_t n) {
    std::string sh = "_n" + std::to_string(n);
    Vec x = rnd(n, 3.0f);
    float *dx = dev_f32(x);
    double ref = cpu->sumsq(x.data(), n), got = gpu->sumsq(dx, n);
    double err = fabs(got - ref) / (ref > 0 ? ref : 1.0);
    report("sumsq" + sh, err <= TOL_SUMSQ, "rel err %.2e (tol %.0e)", err, TOL_SUMSQ);
    if (n > 10) {
        float bad[2] = {NAN, INFINITY};
        const char *names[2] = {"_nan", "_inf"};
        for (int k = 0; k < 2; k++) {
            CUDA_CHECK(cudaMemcpy(dx + n - 2, &bad[k], sizeof(float), cudaMemcpyHostToDevice));
            got = gpu->sumsq(dx, n);
            report("sumsq" + sh + names[k], !std::isfinite(got), "got %g (must be non-finite) %g", got, 0.0);
        }
    }
    cudaFree(dx);
}

/* fp8_amax along each axis and fp8_qdq (both formats, plain and power-of-two
 * scales, P = 2 rows of amaxes as two tp ranks give) against the CPU
 * backend's host reference: the same src/fp8.h rounding, so the same bits
 * (bf16: the CPU's fp32 result rounded once to bf16, as the kernel stores
 * it). Rows of different scales, an outlier, zeros and a NaN among the inputs. */
static void test_fp8(int rows, int cols) {
    std::string sh = "_" + std::to_string(rows) + "x" + std::to_string(cols);
    Vec x = rnd_act((size_t)rows * cols, 1.0f);
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) x[(size_t)i * cols + j] *= (float)(1 + i % 5) * 0.25f;
    x = act_round(x);
    x[7 % x.size()] = 300.0f;
    x[11 % x.size()] = 0.0f;
    void *dx = dev_act(x);
    const char *axes[3] = {"tensor", "row", "col"};
    for (int axis = -1; axis <= 1; axis++) {
        int n = fp8_amax_len(rows, cols, axis);
        Vec ref(2 * (size_t)n);
        fp8_amax_f32(ref.data(), x.data(), rows, cols, axis);
        for (int k = 0; k < n; k++) ref[(size_t)n + k] = ref[k] * (k % 2 ? 1.5f : 0.5f); /* the other rank's */
        float *da = dev_f32(ref);
        gpu->fp8_amax(da, dx, rows, cols, axis);
        check_exact(std::string("fp8_amax_") + axes[axis + 1] + sh, get_f32(da, n), Vec(ref.begin(), ref.begin() + n));
        CUDA_CHECK(cudaMemcpy(da, ref.data(), ref.size() * sizeof(float), cudaMemcpyHostToDevice));
        for (int fmt = 0; fmt < 3; fmt++) /* E4M3, E5M2, and bf16 rounding (precision.fp8: bf16; no scale) */
            for (int pow2 = 0; pow2 < (fmt < 2 ? 2 : 1); pow2++) {
                Vec want(x.size());
                fp8_qdq_f32(want.data(), x.data(), ref.data(), 2, rows, cols, axis, (Fp8Format)fmt, pow2);
                void *dy;
                CUDA_CHECK(cudaMalloc(&dy, x.size() * AB));
                gpu->fp8_qdq(dy, dx, da, 2, rows, cols, axis, fmt, pow2);
                check_exact(std::string("fp8_qdq_") + fp8_format_name((Fp8Format)fmt) + "_" + axes[axis + 1] +
                                (pow2 ? "_pow2" : "") + sh,
                            get_act(dy, x.size()), act_round(want));
                cudaFree(dy);
            }
        cudaFree(da);
    }
    cudaFree(dx);
}

/* fp8_cast (the codes for the fp8 products, one pass in 32 x 32 tiles)
 * against src/fp8.h's host encoder, to the byte: tensorwise (one scale for
 * q and the transposed qt, from the max of P = 2 amax rows as two tp ranks
 * give, the tensor's own amax recorded in the same pass as delayed scaling
 * does) and rowwise (q per row, qt per column of x), both formats, plain and
 * power-of-two scales; then q or qt alone. The inverse scales are 1 / s of
 * the host's s, the recorded amax the host's fp8_amax_f32. Shapes with
 * partial tiles both ways and one row wider than many tiles. */
static void test_fp8_cast(int rows, int cols) {
    std::string sh = "_" + std::to_string(rows) + "x" + std::to_string(cols);
    Vec x = rnd_act((size_t)rows * cols, 1.0f);
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) x[(size_t)i * cols + j] *= (float)(1 + (i + 2 * j) % 5) * 0.25f;
    x = act_round(x);
    x[7 % x.size()] = 300.0f;
    x[11 % x.size()] = 0.0f;
    void *dx = dev_act(x);
    size_t n = x.size();
    Vec ta(1), ra((size_t)rows), ca((size_t)cols);
    fp8_amax_f32(ta.data(), x.data(), rows, cols, FP8_AXIS_TENSOR);
    fp8_amax_f32(ra.data(), x.data(), rows, cols, FP8_AXIS_ROW);
    fp8_amax_f32(ca.data(), x.data(), rows, cols, FP8_AXIS_COL);
    for (int rowwise = 0; rowwise <= 1; rowwise++)
        for (int fmt = 0; fmt < 2; fmt++)
            for (int pow2 = 0; pow2 < 2; pow2++) {
                /* two rows of amaxes: this rank's and another's, larger for some entries */
                Vec aq = rowwise ? ra : ta, at = ca;
                size_t nq = aq.size(), nt = at.size();
                aq.resize(2 * nq), at.resize(2 * nt);
                for (size_t k = 0; k < nq; k++) aq[nq + k] = aq[k] * (k % 2 ? 1.5f : 0.5f);
                for (size_t k = 0; k < nt; k++) at[nt + k] = at[k] * (k % 3 ? 0.5f : 2.0f);
                std::vector<uint8_t> wq(n), wt(n);
                Vec wiq(rowwise ? rows : 1), wit(rowwise ? cols : 1);
                for (int i = 0; i < rows; i++)
                    for (int j = 0; j < cols; j++) {
                        int kq = rowwise ? i : 0;
                        float sq = fp8_scale(fmaxf(aq[kq], aq[nq + kq]), (Fp8Format)fmt, pow2);
                        float st = rowwise ? fp8_scale(fmaxf(at[j], at[nt + j]), (Fp8Format)fmt, pow2) : sq;
                        float v = x[(size_t)i * cols + j];
                        wq[(size_t)i * cols + j] = fp8_from_f32(v * sq, (Fp8Format)fmt);
                        wt[(size_t)j * rows + i] = fp8_from_f32(v * st, (Fp8Format)fmt);
                        wiq[kq] = 1.0f / sq;
                        wit[rowwise ? j : 0] = 1.0f / st;
                    }
                float *daq = dev_f32(aq), *dat = dev_f32(at), *iq, *it, *rec;
                uint8_t *q, *qt;
                CUDA_CHECK(cudaMalloc(&q, n));
                CUDA_CHECK(cudaMalloc(&qt, n));
                CUDA_CHECK(cudaMalloc(&iq, wiq.size() * 4));
                CUDA_CHECK(cudaMalloc(&it, wit.size() * 4));
                CUDA_CHECK(cudaMalloc(&rec, 4));
                Fp8Cast c;
                memset(&c, 0, sizeof c);
                c.q = q, c.qt = qt, c.inv_q = iq, c.inv_t = it, c.amax_q = daq, c.amax_t = dat, c.P_q = 2, c.P_t = 2;
                c.rowwise = rowwise, c.fmt = fmt, c.pow2 = pow2, c.amax_out = rowwise ? NULL : rec;
                gpu->fp8_cast(&c, dx, rows, cols);
                std::vector<uint8_t> gq(n), gt(n);
                CUDA_CHECK(cudaMemcpy(gq.data(), q, n, cudaMemcpyDeviceToHost));
                CUDA_CHECK(cudaMemcpy(gt.data(), qt, n, cudaMemcpyDeviceToHost));
                size_t bad = 0, bad1 = 0;
                for (size_t k = 0; k < n; k++) bad += gq[k] != wq[k], bad += gt[k] != wt[k];
                Vec giq = get_f32(iq, wiq.size()), git = get_f32(it, wit.size()), grec = get_f32(rec, 1);
                int inv_ok = memcmp(giq.data(), wiq.data(), wiq.size() * 4) == 0 &&
                             memcmp(git.data(), wit.data(), wit.size() * 4) == 0;
                int rec_ok = rowwise || grec[0] == ta[0];
                /* one of the two alone: the other buffer untouched (0xff from cudaMalloc) */
                CUDA_CHECK(cudaMemset(qt, 0xff, n));
                c.qt = NULL, c.amax_out = NULL;
                gpu->fp8_cast(&c, dx, rows, cols);
                CUDA_CHECK(cudaMemcpy(gq.data(), q, n, cudaMemcpyDeviceToHost));
                CUDA_CHECK(cudaMemcpy(gt.data(), qt, n, cudaMemcpyDeviceToHost));
                for (size_t k = 0; k < n; k++) bad1 += gq[k] != wq[k], bad1 += gt[k] != 0xff;
                c.qt = qt, c.q = NULL, c.inv_q = NULL, c.amax_q = rowwise ? NULL : daq;
                CUDA_CHECK(cudaMemset(q, 0xff, n));
                gpu->fp8_cast(&c, dx, rows, cols);
                CUDA_CHECK(cudaMemcpy(gq.data(), q, n, cudaMemcpyDeviceToHost));
                CUDA_CHECK(cudaMemcpy(gt.data(), qt, n, cudaMemcpyDeviceToHost));
                for (size_t k = 0; k < n; k++) bad1 += gq[k] != 0xff, bad1 += gt[k] != wt[k];
                std::string name = std::string("fp8_cast_") + (rowwise ? "rowwise_" : "tensorwise_") +
                                   fp8_format_name((Fp8Format)fmt) + (pow2 ? "_pow2" : "") + sh;
                char d[200];
                snprintf(d, sizeof d, "%zu of %zu codes differ from the host encoder, %zu of %zu with q or qt alone; "
                         "inverse scales %s, recorded amax %s", bad, 2 * n, bad1, 4 * n, inv_ok ? "exact" : "DIFFER",
                         rowwise ? "-" : rec_ok ? "exact" : "DIFFERS");
                report_s(name, bad == 0 && bad1 == 0 && inv_ok && rec_ok, d);
                cudaFree(daq), cudaFree(dat), cudaFree(q), cudaFree(qt), cudaFree(iq), cudaFree(it), cudaFree(rec);
            }
    cudaFree(dx);
}

/* A GPU before sm_89 (here the emulation reporting sm_86) refuses the
 * first fp8 op: exit 2, one line naming the key and the device's sm. */
static void old_gpu_child(void *) {
    emu_sm_major = 8, emu_sm_minor = 6, fp8_device_checked = 0;
    float *a;
    CUDA_CHECK(cudaMalloc(&a, 16));
    gpu->fp8_amax(a, a, 1, 1, FP8_AXIS_TENSOR);
}
static void test_fp8_old_gpu(void) {
    char err[512];
    int rc = test_run_child(old_gpu_child, NULL, err, sizeof err), lines = 0;
    for (char *c = err; *c; c++) lines += *c == '\n';
    if (lines && err[strlen(err) - 1] == '\n') err[strlen(err) - 1] = '\0';
    int ok = rc == 2 && lines == 1 && strstr(err, "key 'precision.fp8'") && strstr(err, "sm_86");
    report_s("fp8_refuses_before_sm89", ok, err[0] ? err : "no message");
}

/* impl "simt": attention.cu's kernels; "tc": the backend's choice (the
 * tensor-core kernels where the head size allows, with bf16 after a passed
 * self-check). */
/* Grouped K/V heads: NKV divides NH (NKV = NH is multi-head). tc: through
 * the backend's dispatch (tensor cores forced where they take the head size,
 * grouped shapes included), else the SIMT entry points directly. */
static int32_t *dev_i32(const std::vector<int32_t> &h) {
    int32_t *d;
    CUDA_CHECK(cudaMalloc(&d, h.size() * sizeof(int32_t) + 4));
    CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    return d;
}

/* Document starts (backend.h's AttnShape.doc, AttnBlock.q_doc) for rows at
 * positions pos0 .. pos0 + n - 1 of B sequences: sequence b's documents
 * start at 0 and at starts[b % 2] (ascending), so the two patterns differ. */
static std::vector<int32_t> doc_rows(int B, int n, int pos0, const std::vector<int> starts[2]) {
    std::vector<int32_t> d((size_t)B * n);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < n; i++) {
            int f = 0;
            for (int v : starts[b % 2]) f = v <= pos0 + i ? v : f;
            d[(size_t)b * n + i] = f;
        }
    return d;
}

/* doc 1: document masking, documents starting inside and across the 32-key
 * tiles and 64-row blocks (a one-token document among them); tc through the
 * backend's dispatch: the tensor cores where they take the shape (head size
 * a multiple of 16, bf16), else SIMT. */
static void test_attention(int B, int T, int NH, int NKV, int HD, int tc, int doc = 0) {
    char sh[80];
    snprintf(sh, sizeof sh, "%s%s_B%d_T%d_NH%d_NKV%d_HD%d", tc ? "_tc" : "_simt", doc ? "_doc" : "", B, T, NH, NKV, HD);
    const std::vector<int> starts[2] = {{T / 4, T / 4 + 1, T / 2 + 3, T - 2}, {2, 33, 70, 130}};
    std::vector<int32_t> hdoc = doc_rows(B, T, 0, starts);
    int32_t *ddoc = doc ? dev_i32(hdoc) : NULL;
    AttnShape ash = {B, T, NH, NKV, HD, doc ? hdoc.data() : NULL}, gsh = ash; /* the CPU's host doc, the GPU's device one */
    gsh.doc = ddoc;
    size_t n3 = (size_t)B * T * attn_qkv_width(&ash), nc = (size_t)B * T * NH * HD, nl = (size_t)B * NH * T;
    Vec qkv = rnd_act(n3, 1.0f), g = rnd_act(nc, 1.0f), out(nc), lse(nl), dqkv(n3);
    cpu->attention_forward(out.data(), lse.data(), qkv.data(), &ash);
    void *dq = dev_act(qkv), *dg = dev_act(g), *dout, *ddq;
    float *dlse;
    CUDA_CHECK(cudaMalloc(&dout, nc * AB));
    CUDA_CHECK(cudaMalloc(&ddq, n3 * AB));
    CUDA_CHECK(cudaMalloc(&dlse, nl * sizeof(float)));
    if (tc) gpu->attention_forward(dout, dlse, dq, &gsh);
    else cuda_attention_simt_forward(dout, dlse, dq, &gsh);
    check(std::string("attention_forward_out") + sh, get_act(dout, nc), out, tol_act());
    check(std::string("attention_forward_lse") + sh, get_f32(dlse, nl), lse, TOL_F32);
    /* the backward of both reads the CPU's out (in act) and lse */
    out = act_round(out);
    cpu->attention_backward(dqkv.data(), g.data(), qkv.data(), out.data(), lse.data(), &ash);
    void *dout2 = dev_act(out);
    CUDA_CHECK(cudaMemcpy(dlse, lse.data(), nl * sizeof(float), cudaMemcpyHostToDevice));
    if (tc) gpu->attention_backward(ddq, dg, dq, dout2, dlse, &gsh);
    else cuda_attention_simt_backward(ddq, dg, dq, dout2, dlse, &gsh);
    Vec got = get_act(ddq, n3);
    check(std::string("attention_backward_dqkv") + sh, got, dqkv, tol_act());
    /* run again: the group's dK/dV sums are the same bits */
    if (tc) gpu->attention_backward(ddq, dg, dq, dout2, dlse, &gsh);
    else cuda_attention_simt_backward(ddq, dg, dq, dout2, dlse, &gsh);
    check_exact(std::string("attention_backward_deterministic") + sh, get_act(ddq, n3), got);
    cudaFree(dq), cudaFree(dg), cudaFree(dout), cudaFree(ddq), cudaFree(dlse), cudaFree(dout2);
    if (ddoc) cudaFree(ddoc);
}

/* lse with -inf rows (queries that see no key): the same rows -inf on both
 * sides (else a NaN, which fails), the rest compared as check does. */
static void check_lse(const std::string &name, Vec got, Vec ref) {
    for (size_t i = 0; i < ref.size(); i++)
        if (ref[i] == -INFINITY) {
            got[i] = got[i] == -INFINITY ? 0.0f : NAN;
            ref[i] = 0.0f;
        }
    check(name, got, ref, TOL_F32);
}

/* Block attention (attention_block.cu): q out of qkv-wide rows, k | v packed,
 * causal at global positions (q_pos, k_pos); the forward of one block, then
 * a second block at k_pos2 merged into it; the backward of the first adds
 * into dq, dk, dv fp32 that start from the same random values on both sides. */
static void test_attention_block(int B, int Tq, int Tk, int NH, int NKV, int HD, int q_pos, int k_pos, int k_pos2,
                                 int doc = 0) {
    char sh[96];
    snprintf(sh, sizeof sh, "%s_B%d_Tq%d_Tk%d_NH%d_NKV%d_HD%d_q%d_k%d", doc ? "_doc" : "", B, Tq, Tk, NH, NKV, HD, q_pos,
             k_pos);
    /* doc 1: documents at global positions inside the first block's keys
     * (one of a single token) and inside the queries */
    const std::vector<int> starts[2] = {{k_pos + Tk / 3, k_pos + Tk / 3 + 1, q_pos + Tq / 2}, {k_pos + 1, q_pos + 1}};
    std::vector<int32_t> hdoc = doc_rows(B, Tq, q_pos, starts);
    int32_t *ddoc = doc ? dev_i32(hdoc) : NULL;
    AttnBlock s = {B, NH, NKV, HD, Tq, Tk, q_pos, k_pos, (NH + 2 * NKV) * HD, 2 * NKV * HD, doc ? hdoc.data() : NULL};
    AttnBlock gs = s; /* the GPU's, with the device copy of q_doc */
    gs.q_doc = ddoc;
    size_t nq = (size_t)B * Tq * s.q_ld, nk = (size_t)B * Tk * s.kv_ld, no = (size_t)B * Tq * NH * HD;
    size_t nl = (size_t)B * NH * Tq, kvo = (size_t)NKV * HD;
    Vec q = rnd_act(nq, 1.0f), kv = rnd_act(nk, 1.0f), kv2 = rnd_act(nk, 1.0f), g = rnd_act(no, 1.0f);
    Vec out(no), lse(nl);
    cpu->attention_block_forward(out.data(), lse.data(), q.data(), kv.data(), kv.data() + kvo, &s, 0);
    void *dq = dev_act(q), *dkv = dev_act(kv), *dkv2 = dev_act(kv2), *dg = dev_act(g), *dout;
    float *dlse;
    CUDA_CHECK(cudaMalloc(&dout, no * AB));
    CUDA_CHECK(cudaMalloc(&dlse, nl * sizeof(float)));
    gpu->attention_block_forward(dout, dlse, dq, dkv, (char *)dkv + kvo * AB, &gs, 0);
    check(std::string("attention_block_forward_out") + sh, get_act(dout, no), out, tol_act());
    check_lse(std::string("attention_block_forward_lse") + sh, get_f32(dlse, nl), lse);
    /* both sides merge the second block into the same (act-rounded) first */
    out = act_round(out);
    void *dout1 = dev_act(out);
    CUDA_CHECK(cudaMemcpy(dlse, lse.data(), nl * sizeof(float), cudaMemcpyHostToDevice));
    AttnBlock s2 = s, gs2 = gs;
    s2.k_pos = gs2.k_pos = k_pos2;
    cpu->attention_block_forward(out.data(), lse.data(), q.data(), kv2.data(), kv2.data() + kvo, &s2, 1);
    gpu->attention_block_forward(dout1, dlse, dq, dkv2, (char *)dkv2 + kvo * AB, &gs2, 1);
    check(std::string("attention_block_merge_out") + sh, get_act(dout1, no), out, tol_act());
    check_lse(std::string("attention_block_merge_lse") + sh, get_f32(dlse, nl), lse);
    /* the backward of the first block against the merged out, lse (the CPU's, in act) */
    out = act_round(out);
    void *dout2 = dev_act(out);
    CUDA_CHECK(cudaMemcpy(dlse, lse.data(), nl * sizeof(float), cudaMemcpyHostToDevice));
    Vec gq = rnd(nq, 1.0f), gkv = rnd(nk, 1.0f);
    float *ddq = dev_f32(gq), *ddkv = dev_f32(gkv);
    cpu->attention_block_backward(gq.data(), gkv.data(), gkv.data() + kvo, g.data(), q.data(), kv.data(),
                                  kv.data() + kvo, out.data(), lse.data(), &s);
    gpu->attention_block_backward(ddq, ddkv, ddkv + kvo, dg, dq, dkv, (char *)dkv + kvo * AB, dout2, dlse, &gs);
    check(std::string("attention_block_backward_dq") + sh, get_f32(ddq, nq), gq, TOL_F32);
    check(std::string("attention_block_backward_dkv") + sh, get_f32(ddkv, nk), gkv, TOL_F32);
    cudaFree(dq), cudaFree(dkv), cudaFree(dkv2), cudaFree(dg), cudaFree(dout), cudaFree(dlse), cudaFree(dout1);
    cudaFree(dout2), cudaFree(ddq), cudaFree(ddkv);
    if (ddoc) cudaFree(ddoc);
}

/* copy_2d: k | v columns out of qkv rows, and back into wider rows. */
static void test_copy_2d(void) {
    const size_t rows = 37, w = 100, sp = 164, dpitch = 120;
    std::vector<unsigned char> src(rows * sp), ref(rows * dpitch, 0xab);
    for (size_t i = 0; i < src.size(); i++) src[i] = (unsigned char)(i * 7 + 3);
    unsigned char *ds, *dd;
    CUDA_CHECK(cudaMalloc(&ds, src.size()));
    CUDA_CHECK(cudaMalloc(&dd, ref.size()));
    CUDA_CHECK(cudaMemcpy(ds, src.data(), src.size(), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dd, ref.data(), ref.size(), cudaMemcpyHostToDevice));
    std::vector<unsigned char> want = ref, got(ref.size());
    cpu->copy_2d(want.data(), dpitch, src.data() + 24, sp, w, rows);
    gpu->copy_2d(dd, dpitch, ds + 24, sp, w, rows);
    CUDA_CHECK(cudaMemcpy(got.data(), dd, got.size(), cudaMemcpyDeviceToHost));
    report_s("copy_2d", got == want, got == want ? "the cpu backend's bytes" : "bytes differ from the cpu backend's");
    cudaFree(ds), cudaFree(dd);
}

/* precision.attention auto with bf16 at a new shape: the first usable path
 * in the order cudnn, tensor_cores, simt runs; cuDNN is not built into the
 * emulation, so the tensor cores must: the backend's output has their bits.
 * Grouped K/V heads (NKV < NH) too. */
static void test_attention_auto(int NKV) {
    const int B = 1, T = 70, C = 96, NH = 2;
    const AttnShape ash = {B, T, NH, NKV, C / NH, NULL};
    size_t n3 = (size_t)B * T * attn_qkv_width(&ash), nc = (size_t)B * T * C, nl = (size_t)B * NH * T;
    Vec qkv = rnd_act(n3, 1.0f);
    void *dq = dev_act(qkv), *o1, *o2;
    float *l1, *l2;
    CUDA_CHECK(cudaMalloc(&o1, nc * AB));
    CUDA_CHECK(cudaMalloc(&o2, nc * AB));
    CUDA_CHECK(cudaMalloc(&l1, nl * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&l2, nl * sizeof(float)));
    gpu->attention_forward(o1, l1, dq, &ash);
    cuda_attention_tc_forward(o2, l2, dq, &ash);
    Vec a = get_act(o1, nc), b = get_act(o2, nc);
    int same = memcmp(a.data(), b.data(), nc * sizeof(float)) == 0;
    report_s(NKV < NH ? "attention_auto_picks_tensor_cores_grouped_kv" : "attention_auto_picks_tensor_cores", same,
             same ? "same bits as the tensor cores" : "auto's output differs from the tensor cores'");
    cudaFree(dq), cudaFree(o1), cudaFree(o2), cudaFree(l1), cudaFree(l2);
}

/* precision.attention auto, cuDNN kept (the stand-in passes the self-check,
 * which runs at B 2), then its execute fails at the training shape (B 3): one
 * warning, and the tensor cores compute that forward and backward (their
 * bits), and every later shape; cuDNN is never called again. */
static void test_attention_cudnn_fallback(void) {
    const int B = 3, T = 70, C = 96, NH = 2;
    emu_cudnn_on = 1, emu_cudnn_fail_b = B;
    gpu->set_attention("auto"); /* chooses again: self-checks the stand-in */
    int kept = strstr(cuda_attention_describe(), "among cudnn, tensor_cores") != NULL;
    report_s("attention_cudnn_selfcheck_b2_kept", kept, cuda_attention_describe());
    const AttnShape ash = {B, T, NH, NH, C / NH, NULL};
    size_t n3 = (size_t)B * T * 3 * C, nc = (size_t)B * T * C, nl = (size_t)B * NH * T;
    Vec qkv = rnd_act(n3, 1.0f), dout = rnd_act(nc, 1.0f);
    void *dq = dev_act(qkv), *dd = dev_act(dout), *o1, *o2, *g1, *g2;
    float *l1, *l2;
    CUDA_CHECK(cudaMalloc(&o1, nc * AB));
    CUDA_CHECK(cudaMalloc(&o2, nc * AB));
    CUDA_CHECK(cudaMalloc(&g1, n3 * AB));
    CUDA_CHECK(cudaMalloc(&g2, n3 * AB));
    CUDA_CHECK(cudaMalloc(&l1, nl * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&l2, nl * sizeof(float)));
    int calls0 = emu_cudnn_calls;
    gpu->attention_forward(o1, l1, dq, &ash); /* cuDNN fails: falls back, warns once */
    gpu->attention_backward(g1, dd, dq, o1, l1, &ash);
    cuda_attention_tc_forward(o2, l2, dq, &ash);
    cuda_attention_tc_backward(g2, dd, dq, o2, l2, &ash);
    int same = get_act(o1, nc) == get_act(o2, nc) && get_act(g1, n3) == get_act(g2, n3);
    int once = emu_cudnn_calls == calls0 + 1; /* the failed forward, and no cuDNN call after it */
    report_s("attention_cudnn_execute_fails_falls_back", same && once,
             !once ? "cuDNN was called again after its execute failed"
                   : same ? "the tensor cores' bits, forward and backward" : "output differs from the tensor cores'");
    const AttnShape later = {1, T, NH, NH, C / NH, NULL}; /* a new shape: not cuDNN's any more */
    gpu->attention_forward(o1, l1, dq, &later);
    report_s("attention_cudnn_dropped_for_later_shapes", emu_cudnn_calls == calls0 + 1,
             emu_cudnn_calls == calls0 + 1 ? "no cuDNN call" : "auto picked cuDNN again");
    emu_cudnn_on = 0, emu_cudnn_fail_b = 0;
    gpu->set_attention("auto");
    cudaFree(dq), cudaFree(dd), cudaFree(o1), cudaFree(o2), cudaFree(g1), cudaFree(g2), cudaFree(l1), cudaFree(l2);
}

/* precision.attention_deterministic: a cuDNN backward that is not the same
 * bits twice (the stand-in's jitter: one ulp of one element, well inside the
 * tolerance) fails the self-check unless the key allows it, and then the
 * description says it runs as asked. */
static void test_attention_cudnn_nondeterministic(void) {
    emu_cudnn_on = 1, emu_cudnn_jitter = 1;
    gpu->set_attention("auto");
    gpu->set_attention_deterministic(1); /* checks cuDNN again */
    const char *d = cuda_attention_describe();
    report_s("attention_cudnn_not_same_bits_refused", strstr(d, "cuDNN refused") && strstr(d, "NOT deterministic"), d);
    gpu->set_attention_deterministic(0);
    d = cuda_attention_describe();
    report_s("attention_cudnn_not_same_bits_kept_when_asked",
             strstr(d, "among cudnn, tensor_cores") && strstr(d, "as asked") &&
                 strstr(d, "non-deterministic (precision.attention_deterministic false)"), d);
    emu_cudnn_on = 0, emu_cudnn_jitter = 0;
    gpu->set_attention_deterministic(1);
}

/* ---------------------------------------------------------------------------
 * The Llama and MoE ops, same tolerances as above: act outputs tol_act(),
 * fp32 statistics and gradients TOL_F32 (sums of <= a few hundred terms in
 * another order); MoE index outputs exactly the CPU's (a counting sort has
 * one right answer). */

static Vec dev_i32_get(const int32_t *d, size_t n) {
    std::vector<int32_t> h(n);
    CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(int32_t), cudaMemcpyDeviceToHost));
    Vec v(n);
    for (size_t i = 0; i < n; i++) v[i] = (float)h[i]; /* small ints: exact in fp32 */
    return v;
}
static Vec i32_vec(const std::vector<int32_t> &h) { return Vec(h.begin(), h.end()); }

static void test_rmsnorm(int N, int C) {
    std::string sh = "_N" + std::to_string(N) + "_C" + std::to_string(C);
    Vec x = rnd_act((size_t)N * C, 2.0f, 0.5f), w = rnd_act(C, 1.0f, 1.0f), out((size_t)N * C), rstd(N);
    cpu->rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5f);
    void *dx = dev_act(x), *dw = dev_act(w), *dout;
    float *drstd;
    CUDA_CHECK(cudaMalloc(&dout, (size_t)N * C * AB));
    CUDA_CHECK(cudaMalloc(&drstd, N * sizeof(float)));
    gpu->rmsnorm_forward(dout, drstd, dx, dw, N, C, 1e-5f);
    check("rmsnorm_forward_out" + sh, get_act(dout, (size_t)N * C), out, tol_act());
    check("rmsnorm_forward_rstd" + sh, get_f32(drstd, N), rstd, TOL_F32);
    CUDA_CHECK(cudaMemcpy(drstd, rstd.data(), N * sizeof(float), cudaMemcpyHostToDevice));
    for (int acc = 0; acc <= 1; acc++) {
        Vec g = rnd_act((size_t)N * C, 1.0f), dinp = rnd_act((size_t)N * C, 1.0f), gw = rnd(C, 1.0f);
        Vec rdinp = dinp, rgw = gw;
        cpu->rmsnorm_backward(rdinp.data(), rgw.data(), g.data(), x.data(), w.data(), rstd.data(), N, C, acc);
        void *dg = dev_act(g), *ddinp = dev_act(dinp);
        float *dgw = dev_f32(gw);
        gpu->rmsnorm_backward(ddinp, dgw, dg, dx, dw, drstd, N, C, acc);
        std::string s = sh + (acc ? "_acc1" : "_acc0");
        check("rmsnorm_backward_dinp" + s, get_act(ddinp, (size_t)N * C), rdinp, tol_act());
        check("rmsnorm_backward_dw" + s, get_f32(dgw, C), rgw, TOL_F32);
        cudaFree(dg), cudaFree(ddinp), cudaFree(dgw);
    }
    cudaFree(dx), cudaFree(dw), cudaFree(dout), cudaFree(drstd);
}

/* residual_norm_forward (backend.h): res = a + b and the norm of res, which
 * must be the bits of the backend's own residual_forward then
 * layernorm_forward / rmsnorm_forward (model.recompute redoes the norm from
 * res alone), and within the norm's tolerance of the CPU's. off 1 places a
 * and b one element into their buffers: not 16-byte aligned, so where C is
 * whole packs the op runs the two kernels (the norm alone would read res in
 * packs); in_place: res is a. */
static void test_residual_norm(int N, int C, int rms, int bias, int off, int in_place) {
    std::string sh = std::string(rms ? "rmsnorm" : "layernorm") + "_N" + std::to_string(N) + "_C" + std::to_string(C) +
                     (bias ? "" : "_nobias") + (off ? "_unaligned" : "") + (in_place ? "_in_place" : "");
    size_t NC = (size_t)N * C;
    Vec a = rnd_act(NC, 2.0f, 0.5f), b = rnd_act(NC, 1.0f), w = rnd_act(C, 1.0f, 1.0f), bb = rnd_act(C, 0.5f);
    Vec res(NC), out(NC), mean(N), rstd(N);
    cpu->residual_forward(res.data(), a.data(), b.data(), NC);
    res = act_round(res);
    if (rms) cpu->rmsnorm_forward(out.data(), rstd.data(), res.data(), w.data(), N, C, 1e-5f);
    else cpu->layernorm_forward(out.data(), mean.data(), rstd.data(), res.data(), w.data(), bias ? bb.data() : NULL, N,
                                C, 1e-5f);
    void *ba = dev_act_off(a, off), *bbuf = dev_act_off(b, off), *dw = dev_act(w), *dbias = bias ? dev_act(bb) : NULL;
    void *da = at(ba, off, AB), *db = at(bbuf, off, AB), *dres, *dout, *cres = dev_act(a), *cout;
    float *dm, *dr, *cm, *cr;
    CUDA_CHECK(cudaMalloc(&dres, NC * AB + 1));
    CUDA_CHECK(cudaMalloc(&dout, NC * AB + 1));
    CUDA_CHECK(cudaMalloc(&cout, NC * AB + 1));
    CUDA_CHECK(cudaMalloc(&dm, N * sizeof(float) + 1));
    CUDA_CHECK(cudaMalloc(&dr, N * sizeof(float) + 1));
    CUDA_CHECK(cudaMalloc(&cm, N * sizeof(float) + 1));
    CUDA_CHECK(cudaMalloc(&cr, N * sizeof(float) + 1));
    /* the composition first: in place, the fused call then overwrites a */
    gpu->residual_forward(cres, da, db, NC);
    if (rms) gpu->rmsnorm_forward(cout, cr, cres, dw, N, C, 1e-5f);
    else gpu->layernorm_forward(cout, cm, cr, cres, dw, dbias, N, C, 1e-5f);
    void *r = in_place ? da : dres;
    gpu->residual_norm_forward(r, dout, rms ? NULL : dm, dr, da, db, dw, dbias, N, C, 1e-5f);
    check_exact("residual_norm_res_" + sh, get_act(r, NC), res);
    check_exact("residual_norm_out_is_composition_" + sh, get_act(dout, NC), get_act(cout, NC));
    check_exact("residual_norm_rstd_is_composition_" + sh, get_f32(dr, N), get_f32(cr, N));
    if (!rms) check_exact("residual_norm_mean_is_composition_" + sh, get_f32(dm, N), get_f32(cm, N));
    check("residual_norm_out_" + sh, get_act(dout, NC), out, tol_act());
    check("residual_norm_rstd_" + sh, get_f32(dr, N), rstd, TOL_F32);
    cudaFree(ba), cudaFree(bbuf), cudaFree(dw), cudaFree(dbias), cudaFree(dres), cudaFree(dout), cudaFree(cres);
    cudaFree(cout), cudaFree(dm), cudaFree(dr), cudaFree(cm), cudaFree(cr);
}

static std::string ash_name(const AttnShape &a) {
    char s[80];
    snprintf(s, sizeof s, "_B%d_T%d_NH%d_NKV%d_HD%d", a.B, a.T, a.NH, a.NKV, a.HD);
    return s;
}

/* rope: the table at positions pos0 .. pos0 + T - 1 of a longer one. */
/* doc 1: positions reset per document (AttnShape.doc, global starts: a
 * document every 5 positions from pos0 - 2 on). */
static void test_rope(const AttnShape &a0, int pos0, int doc = 0) {
    std::string sh = ash_name(a0) + "_pos" + std::to_string(pos0) + (doc ? "_doc" : "");
    AttnShape a = a0, ga = a0;
    std::vector<int32_t> hdoc((size_t)a.B * a.T);
    for (int i = 0; i < a.B * a.T; i++) hdoc[i] = std::max(0, pos0 - 2 + (i % a.T + 2) / 5 * 5);
    int32_t *ddoc = doc ? dev_i32(hdoc) : NULL;
    if (doc) a.doc = hdoc.data(), ga.doc = ddoc;
    int H2 = a.HD / 2, Tmax = pos0 + a.T + 3;
    size_t n = (size_t)a.B * a.T * attn_qkv_width(&a);
    Vec ang = rnd((size_t)Tmax * H2, 2.0f), tab((size_t)Tmax * 2 * H2);
    for (int t = 0; t < Tmax; t++)
        for (int i = 0; i < H2; i++) {
            tab[(size_t)t * 2 * H2 + i] = cosf(ang[(size_t)t * H2 + i]);
            tab[(size_t)t * 2 * H2 + H2 + i] = sinf(ang[(size_t)t * H2 + i]);
        }
    float *dtab = dev_f32(tab);
    for (int bwd = 0; bwd <= 1; bwd++) {
        Vec x = rnd_act(n, 1.0f), ref = x;
        (bwd ? cpu->rope_backward : cpu->rope_forward)(ref.data(), tab.data(), &a, pos0);
        void *dx = dev_act(x);
        (bwd ? gpu->rope_backward : gpu->rope_forward)(dx, dtab, &ga, pos0);
        check(std::string(bwd ? "rope_backward" : "rope_forward") + sh, get_act(dx, n), ref, tol_act());
        cudaFree(dx);
    }
    cudaFree(dtab);
    if (ddoc) cudaFree(ddoc);
}

static void test_qknorm(const AttnShape &a, int per_head) {
    std::string sh = ash_name(a) + (per_head ? "_per_head" : "_whole");
    int N = a.B * a.T, W = (a.NH + a.NKV) * a.HD, G = per_head ? a.NH + a.NKV : 2;
    int WQ = per_head ? a.HD : a.NH * a.HD, WK = per_head ? a.HD : a.NKV * a.HD;
    size_t n = (size_t)N * attn_qkv_width(&a);
    Vec x = rnd_act(n, 2.0f, 0.3f), qw = rnd_act(WQ, 1.0f, 1.0f), kw = rnd_act(WK, 1.0f, 1.0f);
    Vec ref = x, qk_in((size_t)N * W), rstd((size_t)N * G);
    cpu->qknorm_forward(ref.data(), qk_in.data(), rstd.data(), qw.data(), kw.data(), &a, per_head, 1e-6f);
    void *dx = dev_act(x), *dqw = dev_act(qw), *dkw = dev_act(kw), *dqk;
    float *drstd;
    CUDA_CHECK(cudaMalloc(&dqk, (size_t)N * W * AB));
    CUDA_CHECK(cudaMalloc(&drstd, (size_t)N * G * sizeof(float)));
    gpu->qknorm_forward(dx, dqk, drstd, dqw, dkw, &a, per_head, 1e-6f);
    check("qknorm_forward_qkv" + sh, get_act(dx, n), ref, tol_act());
    check_exact("qknorm_forward_qk_in" + sh, get_act(dqk, (size_t)N * W), qk_in);
    check("qknorm_forward_rstd" + sh, get_f32(drstd, (size_t)N * G), rstd, TOL_F32);
    CUDA_CHECK(cudaMemcpy(drstd, rstd.data(), (size_t)N * G * sizeof(float), cudaMemcpyHostToDevice));
    for (int acc = 0; acc <= 1; acc++) {
        Vec g = rnd_act(n, 1.0f), gq = rnd(WQ, 1.0f), gk = rnd(WK, 1.0f), rg = g, rgq = gq, rgk = gk;
        cpu->qknorm_backward(rg.data(), rgq.data(), rgk.data(), qk_in.data(), qw.data(), kw.data(), rstd.data(), &a,
                             per_head, acc);
        void *dg = dev_act(g);
        float *dgq = dev_f32(gq), *dgk = dev_f32(gk);
        gpu->qknorm_backward(dg, dgq, dgk, dqk, dqw, dkw, drstd, &a, per_head, acc);
        std::string s = sh + (acc ? "_acc1" : "_acc0");
        check("qknorm_backward_dqkv" + s, get_act(dg, n), rg, tol_act());
        check("qknorm_backward_dqw" + s, get_f32(dgq, WQ), rgq, TOL_F32);
        check("qknorm_backward_dkw" + s, get_f32(dgk, WK), rgk, TOL_F32);
        cudaFree(dg), cudaFree(dgq), cudaFree(dgk);
    }
    cudaFree(dx), cudaFree(dqw), cudaFree(dkw), cudaFree(dqk), cudaFree(drstd);
}

static void test_swiglu(int N, int F) {
    std::string sh = "_N" + std::to_string(N) + "_F" + std::to_string(F);
    Vec h = rnd_act((size_t)N * 2 * F, 2.0f), g = rnd_act((size_t)N * F, 1.0f);
    Vec out((size_t)N * F), dh((size_t)N * 2 * F);
    cpu->swiglu_forward(out.data(), h.data(), N, F);
    cpu->swiglu_backward(dh.data(), g.data(), h.data(), N, F);
    void *dhh = dev_act(h), *dg = dev_act(g), *dout, *ddh;
    CUDA_CHECK(cudaMalloc(&dout, (size_t)N * F * AB));
    CUDA_CHECK(cudaMalloc(&ddh, (size_t)N * 2 * F * AB));
    gpu->swiglu_forward(dout, dhh, N, F);
    gpu->swiglu_backward(ddh, dg, dhh, N, F);
    check("swiglu_forward" + sh, get_act(dout, (size_t)N * F), out, tol_act());
    check("swiglu_backward" + sh, get_act(ddh, (size_t)N * 2 * F), dh, tol_act());
    cudaFree(dhh), cudaFree(dg), cudaFree(dout), cudaFree(ddh);
}

/* The whole MoE chain: route, dispatch (from the CPU's topk, so both sides
 * permute alike), gather, combine and the backwards, each GPU op reading the
 * CPU's outputs of the earlier ones. cap 0 keeps every slot; a small cap
 * drops some (row_of -1). */
static void test_moe(int N, int S, int E, int K, int C, int sigmoid, int norm_topk, int use_bias, int cap) {
    char shc[112];
    snprintf(shc, sizeof shc, "_N%d_S%d_E%d_K%d_C%d%s%s%s_cap%d", N, S, E, K, C, sigmoid ? "_sigmoid" : "_softmax",
             norm_topk ? "_norm" : "", use_bias ? "_bias" : "", cap);
    std::string sh = shc;
    const int nseq = N / S;
    Vec logits = rnd_act((size_t)N * E, 2.0f), bias = rnd(E, 0.1f);
    std::vector<int32_t> topk((size_t)N * K);
    Vec gates((size_t)N * K), probs((size_t)N * E), stats((size_t)nseq * (E + 1));
    cpu->moe_route(topk.data(), gates.data(), probs.data(), stats.data(), logits.data(), use_bias ? bias.data() : NULL,
                   N, S, E, K, sigmoid, norm_topk);
    void *dlog = dev_act(logits);
    float *dbias = dev_f32(bias), *dgates, *dprobs, *dstats;
    int32_t *dtopk;
    CUDA_CHECK(cudaMalloc(&dgates, (size_t)N * K * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&dprobs, (size_t)N * E * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&dstats, stats.size() * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&dtopk, (size_t)N * K * sizeof(int32_t)));
    gpu->moe_route(dtopk, dgates, dprobs, dstats, dlog, use_bias ? dbias : NULL, N, S, E, K, sigmoid, norm_topk);
    check_exact("moe_route_topk" + sh, dev_i32_get(dtopk, (size_t)N * K), i32_vec(topk));
    check("moe_route_gates" + sh, get_f32(dgates, (size_t)N * K), gates, TOL_F32);
    check("moe_route_probs" + sh, get_f32(dprobs, (size_t)N * E), probs, TOL_F32);
    check("moe_route_stats" + sh, get_f32(dstats, stats.size()), stats, TOL_F32);
    CUDA_CHECK(cudaMemcpy(dgates, gates.data(), (size_t)N * K * sizeof(float), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dprobs, probs.data(), (size_t)N * E * sizeof(float), cudaMemcpyHostToDevice));

    std::vector<int32_t> offsets(E + 1), row_of((size_t)N * K), src((size_t)N * K, 0), counts((size_t)nseq * E);
    cpu->moe_dispatch(offsets.data(), row_of.data(), src.data(), counts.data(), topk.data(), N, S, E, K, cap);
    int R = offsets[E];
    int32_t *dt = dev_i32(topk), *doff, *drow, *dsrc, *dcnt;
    CUDA_CHECK(cudaMalloc(&doff, (E + 1) * sizeof(int32_t)));
    CUDA_CHECK(cudaMalloc(&drow, (size_t)N * K * sizeof(int32_t)));
    CUDA_CHECK(cudaMalloc(&dsrc, (size_t)N * K * sizeof(int32_t)));
    CUDA_CHECK(cudaMalloc(&dcnt, counts.size() * sizeof(int32_t)));
    gpu->moe_dispatch(doff, drow, dsrc, dcnt, dt, N, S, E, K, cap);
    check_exact("moe_dispatch_offsets" + sh, dev_i32_get(doff, E + 1), i32_vec(offsets));
    check_exact("moe_dispatch_row_of" + sh, dev_i32_get(drow, (size_t)N * K), i32_vec(row_of));
    check_exact("moe_dispatch_src" + sh, dev_i32_get(dsrc, R), Vec(src.begin(), src.begin() + R));
    check_exact("moe_dispatch_counts" + sh, dev_i32_get(dcnt, counts.size()), i32_vec(counts));
    /* the case is meant to drop (cap > 0) or keep everything (cap 0) */
    report("moe_dispatch_drops" + sh, cap > 0 ? R < N * K : R == N * K, "%.0f of %.0f slots kept",
           (double)R, (double)N * K);
    if (cap > 0) {
        /* per-sequence, per-expert limits (context parallelism's chunks): 0
         * up to cap, some below a sequence's load */
        std::vector<int32_t> caps((size_t)nseq * E), coff(E + 1), crow((size_t)N * K), csrc((size_t)N * K, 0);
        std::vector<int32_t> ccnt((size_t)nseq * E);
        for (size_t i = 0; i < caps.size(); i++) caps[i] = (int32_t)(i % (size_t)(cap + 1));
        cpu->moe_dispatch_capped(coff.data(), crow.data(), csrc.data(), ccnt.data(), topk.data(), N, S, E, K,
                                 caps.data());
        int32_t *dcaps = dev_i32(caps);
        gpu->moe_dispatch_capped(doff, drow, dsrc, dcnt, dt, N, S, E, K, dcaps);
        check_exact("moe_dispatch_capped_offsets" + sh, dev_i32_get(doff, E + 1), i32_vec(coff));
        check_exact("moe_dispatch_capped_row_of" + sh, dev_i32_get(drow, (size_t)N * K), i32_vec(crow));
        check_exact("moe_dispatch_capped_src" + sh, dev_i32_get(dsrc, coff[E]), Vec(csrc.begin(), csrc.begin() + coff[E]));
        cudaFree(dcaps);
        gpu->moe_dispatch(doff, drow, dsrc, dcnt, dt, N, S, E, K, cap); /* back to what the chain below reads */
    }
    int32_t *drow_c = dev_i32(row_of), *dsrc_c = dev_i32(src);

    Vec x = rnd_act((size_t)N * C, 1.0f), xp((size_t)R * C);
    cpu->moe_gather(xp.data(), x.data(), src.data(), R, C);
    void *dx = dev_act(x), *dxp;
    CUDA_CHECK(cudaMalloc(&dxp, (size_t)R * C * AB + 4));
    gpu->moe_gather(dxp, dx, dsrc_c, R, C);
    check_exact("moe_gather" + sh, get_act(dxp, (size_t)R * C), xp);

    Vec gx = rnd_act((size_t)N * C, 1.0f), gxp = rnd_act((size_t)R * C, 1.0f), rgx = gx;
    cpu->moe_gather_backward(rgx.data(), gxp.data(), row_of.data(), N, K, C);
    void *dgx = dev_act(gx), *dgxp = dev_act(gxp);
    gpu->moe_gather_backward(dgx, dgxp, drow_c, N, K, C);
    check("moe_gather_backward" + sh, get_act(dgx, (size_t)N * C), rgx, tol_act());

    Vec yp = rnd_act((size_t)R * C, 1.0f), out((size_t)N * C);
    cpu->moe_combine(out.data(), yp.data(), gates.data(), row_of.data(), N, K, C);
    void *dyp = dev_act(yp), *dout;
    CUDA_CHECK(cudaMalloc(&dout, (size_t)N * C * AB));
    gpu->moe_combine(dout, dyp, dgates, drow_c, N, K, C);
    check("moe_combine" + sh, get_act(dout, (size_t)N * C), out, tol_act());

    Vec g = rnd_act((size_t)N * C, 1.0f), dy((size_t)R * C), dgt((size_t)N * K);
    cpu->moe_combine_backward(dy.data(), dgt.data(), g.data(), yp.data(), gates.data(), row_of.data(), N, K, C);
    void *dg = dev_act(g), *ddy;
    float *ddgt;
    CUDA_CHECK(cudaMalloc(&ddy, (size_t)R * C * AB + 4));
    CUDA_CHECK(cudaMalloc(&ddgt, (size_t)N * K * sizeof(float)));
    gpu->moe_combine_backward(ddy, ddgt, dg, dyp, dgates, drow_c, N, K, C);
    check("moe_combine_backward_dyp" + sh, get_act(ddy, (size_t)R * C), dy, tol_act());
    check("moe_combine_backward_dgates" + sh, get_f32(ddgt, (size_t)N * K), dgt, TOL_F32);

    Vec aux = rnd((size_t)nseq * E, 0.1f), rdl((size_t)N * E);
    for (int zl = 0; zl <= 1; zl++) {
        float z = zl ? 1e-2f : 0.0f;
        const float *ax = zl ? aux.data() : NULL;
        cpu->moe_route_backward(rdl.data(), dgt.data(), probs.data(), topk.data(), gates.data(), logits.data(), ax, z,
                                N, S, E, K, sigmoid, norm_topk);
        float *ddg = dev_f32(dgt), *daux = dev_f32(aux);
        void *ddlog;
        CUDA_CHECK(cudaMalloc(&ddlog, (size_t)N * E * AB));
        gpu->moe_route_backward(ddlog, ddg, dprobs, dt, dgates, dlog, zl ? daux : NULL, z, N, S, E, K, sigmoid,
                                norm_topk);
        check("moe_route_backward" + sh + (zl ? "_aux_z" : ""), get_act(ddlog, (size_t)N * E), rdl, tol_act());
        cudaFree(ddg), cudaFree(daux), cudaFree(ddlog);
    }
    void *ptrs[] = {dlog, dbias, dgates, dprobs, dstats, dtopk, dt, doff, drow, dsrc, dcnt, drow_c, dsrc_c,
                    dx, dxp, dgx, dgxp, dyp, dout, dg, ddy, ddgt};
    for (void *p : ptrs) cudaFree(p);
}

/* Every op with a row count at 0 rows (an MoE micro-batch whose every slot
 * was dropped runs the experts' SwiGLU and gather on 0 rows): no launch of
 * an empty grid (the emulation refuses one as the GPU does, and the op's
 * CUDA_CHECK_LAUNCH ends the run), and what such a call defines — sums over
 * no rows, zeroed or kept per accumulate; MoE statistics and offsets 0 — the
 * CPU's exactly. Outputs with no rows are never read. */
static void test_zero_rows(void) {
    const int C = 40, F = 24, E = 4, K = 2, T = 7;
    const AttnShape a0 = {0, T, 6, 2, 10, NULL};
    Vec w = rnd_act(C, 1.0f, 1.0f), wq = rnd_act(a0.HD, 1.0f, 1.0f), wk = rnd_act(a0.HD, 1.0f, 1.0f);
    void *dw = dev_act(w), *dwq = dev_act(wq), *dwk = dev_act(wk), *dnone;
    CUDA_CHECK(cudaMalloc(&dnone, 64)); /* the (0, .) tensors: never read or written */
    float *fnone = (float *)dnone;
    int32_t *inone = (int32_t *)dnone;
    Vec tab((size_t)T * a0.HD, 0.5f);
    float *dtab = dev_f32(tab);
    gpu->rmsnorm_forward(dnone, fnone, dnone, dw, 0, C, 1e-5f);
    gpu->layernorm_forward(dnone, fnone, fnone, dnone, dw, dw, 0, C, 1e-5f);
    gpu->rope_forward(dnone, dtab, &a0, 0);
    gpu->rope_backward(dnone, dtab, &a0, 0);
    gpu->qknorm_forward(dnone, dnone, fnone, dwq, dwk, &a0, 1, 1e-6f);
    gpu->swiglu_forward(dnone, dnone, 0, F);
    gpu->swiglu_backward(dnone, dnone, dnone, 0, F);
    gpu->moe_gather(dnone, dnone, inone, 0, C);
    gpu->moe_gather_backward(dnone, dnone, inone, 0, K, C);
    gpu->moe_combine(dnone, dnone, fnone, inone, 0, K, C);
    gpu->moe_combine_backward(dnone, fnone, dnone, dnone, fnone, inone, 0, K, C);
    gpu->moe_route_backward(dnone, fnone, fnone, inone, fnone, dnone, NULL, 1e-2f, 0, T, E, K, 0, 1);
    for (int acc = 0; acc <= 1; acc++) {
        std::string s = acc ? "_acc1" : "_acc0";
        Vec g = rnd(C, 1.0f), gb = rnd(C, 1.0f), gq = rnd(a0.HD, 1.0f), gk = rnd(a0.HD, 1.0f);
        Vec rg = g, rgb = gb, rgq = gq, rgk = gk;
        cpu->rmsnorm_backward(NULL, rg.data(), NULL, NULL, w.data(), NULL, 0, C, acc);
        float *d1 = dev_f32(g);
        gpu->rmsnorm_backward(dnone, d1, dnone, dnone, dw, fnone, 0, C, acc);
        check_exact("zero_rows_rmsnorm_backward_dw" + s, get_f32(d1, C), rg);
        rg = g;
        cpu->layernorm_backward(NULL, rg.data(), rgb.data(), NULL, NULL, w.data(), NULL, NULL, 0, C, acc);
        float *d2 = dev_f32(g), *d3 = dev_f32(gb);
        gpu->layernorm_backward(dnone, d2, d3, dnone, dnone, dw, fnone, fnone, 0, C, acc);
        check_exact("zero_rows_layernorm_backward_dw" + s, get_f32(d2, C), rg);
        check_exact("zero_rows_layernorm_backward_db" + s, get_f32(d3, C), rgb);
        cpu->qknorm_backward(NULL, rgq.data(), rgk.data(), NULL, wq.data(), wk.data(), NULL, &a0, 1, acc);
        float *d4 = dev_f32(gq), *d5 = dev_f32(gk);
        gpu->qknorm_backward(dnone, d4, d5, dnone, dwq, dwk, fnone, &a0, 1, acc);
        check_exact("zero_rows_qknorm_backward_dqw" + s, get_f32(d4, a0.HD), rgq);
        check_exact("zero_rows_qknorm_backward_dkw" + s, get_f32(d5, a0.HD), rgk);
        Vec gte = rnd((size_t)3 * C, 1.0f), gpe = rnd((size_t)T * C, 1.0f), rte = gte, rpe = gpe;
        cpu->embed_backward(rte.data(), rpe.data(), NULL, NULL, NULL, 0, T, C, acc);
        float *d6 = dev_f32(gte), *d7 = dev_f32(gpe);
        gpu->embed_backward(d6, d7, dnone, inone, NULL, 0, T, C, acc);
        check_exact("zero_rows_embed_backward_dwte" + s, get_f32(d6, rte.size()), rte);
        check_exact("zero_rows_embed_backward_dwpe" + s, get_f32(d7, rpe.size()), rpe);
        cudaFree(d1), cudaFree(d2), cudaFree(d3), cudaFree(d4), cudaFree(d5), cudaFree(d6), cudaFree(d7);
    }
    /* no rows are no sequences: stats (0, E+1) and counts (0, E) are not
     * written (the sentinels stay), offsets are all 0 */
    Vec rstats(E + 1, -7.0f);
    cpu->moe_route(NULL, NULL, NULL, rstats.data(), NULL, NULL, 0, T, E, K, 0, 1);
    float *dstats = dev_f32(Vec(E + 1, -7.0f));
    gpu->moe_route(inone, fnone, fnone, dstats, dnone, NULL, 0, T, E, K, 0, 1);
    check_exact("zero_rows_moe_route_stats", get_f32(dstats, E + 1), rstats);
    std::vector<int32_t> off(E + 1, -7), cnt(E, -7);
    cpu->moe_dispatch(off.data(), NULL, NULL, cnt.data(), NULL, 0, T, E, K, 3);
    int32_t *doff = dev_i32(std::vector<int32_t>(E + 1, -7)), *dcnt = dev_i32(std::vector<int32_t>(E, -7));
    gpu->moe_dispatch(doff, inone, inone, dcnt, inone, 0, T, E, K, 3);
    check_exact("zero_rows_moe_dispatch_offsets", dev_i32_get(doff, E + 1), i32_vec(off));
    check_exact("zero_rows_moe_dispatch_counts", dev_i32_get(dcnt, E), i32_vec(cnt));
    report_s("zero_rows_launches", cudaGetLastError() == cudaSuccess,
             "every op at 0 rows returned without an invalid launch");
    void *ptrs[] = {dw, dwq, dwk, dnone, dtab, dstats, doff, dcnt};
    for (void *p : ptrs) cudaFree(p);
}

int main(void) {
    cpu->init(1);
    for (int bf = 0; bf <= 1; bf++) {
        AB = bf ? 2 : 4;
        DT = bf ? "bf16" : "fp32";
        gpu->init(0);
        /* with bf16 the attention self-check runs both kernel sets (T 200,
         * head size 64) and must pick the tensor cores */
        gpu->set_precision(DT);
        report("act_bytes", gpu->act_bytes() == AB, "act_bytes %.0f, want %.0f", (double)gpu->act_bytes(), (double)AB);
        test_memory();
        test_host_syncs();
        /* auto keeps the tensor cores as a candidate when their self-check
         * passes; cuDNN's stand-in starts off and must be refused, saying why */
        const char *desc = cuda_attention_describe();
        int want_tc = bf == 1, got_tc = strstr(desc, "among tensor_cores, simt (tensor cores passed") != NULL &&
                                        strstr(desc, "cuDNN refused: the emulation's cuDNN stand-in is off");
        printf("%s cuda_emu_%s_attention_choice%s%s\n", want_tc == got_tc ? "ok" : "FAIL", DT,
               want_tc == got_tc ? " # " : ": ", desc);
        failures += want_tc != got_tc;
        test_fp8(37, 48);
        if (!bf) test_fp8_old_gpu();
        test_fp8(5, 1100); /* rows longer than a block's threads */
        test_fp8_cast(37, 48);
        test_fp8_cast(5, 1100);
        test_fp8_cast(64, 96);
        test_cast(1001, 0);
        test_cast(1001, 1);
        test_cast(5, 0);
        test_embed();
        test_layernorm(37, 48);
        test_layernorm(201, 40); /* 7 backward chunks, the last one short; C not a multiple of 32 */
        test_layernorm(9, 42);   /* C of no whole 16-byte packs: element by element */
        test_layernorm(45, 264); /* rows of more vectors than a warp has lanes: 2 (bf16) or 3 column rounds */
        /* 1024 backward chunks of 33 rows, the last ones empty; a long sum as test_colsum's */
        test_layernorm(32770, 24, TOL_LONG_SUM);
        for (int rms = 0; rms <= 1; rms++) {
            test_residual_norm(37, 48, rms, 1, 0, 0);   /* 16-byte packs */
            test_residual_norm(37, 42, rms, 1, 0, 0);   /* element by element */
            test_residual_norm(45, 264, rms, 1, 0, 1);  /* several vectors per lane; res is a */
            test_residual_norm(37, 48, rms, 1, 1, 0);   /* a, b unaligned: the two kernels */
        }
        test_residual_norm(37, 48, 0, 0, 0, 0); /* LayerNorm without a bias */
        test_colsum(201, 100, TOL_F32);
        test_colsum(20000, 5, TOL_LONG_SUM); /* 256 chunks, the last ones empty */
        test_pointwise(1777, 0); /* 16-byte packs and a tail */
        test_pointwise(1777, 1); /* element by element */
        test_pointwise(3, 0);    /* tail only */
        test_crossentropy(37, 100, 128);
        test_crossentropy(5, 1000, 1024); /* rows wider than the block */
        test_crossentropy(3, 5000, 5056); /* more 16-byte packs in a row than threads in the block */
        test_crossentropy(7, 100, 103);   /* a row stride of no whole packs: element by element */
        test_vocab_parallel(8, 100, 2, 64);   /* 64 and 36 real columns */
        test_vocab_parallel(6, 1000, 4, 320); /* 320, 320, 320, 40: rows wider than the block */
        test_vocab_parallel(4, 70, 4, 64);    /* 64, 6, none, none */
        test_adamw(1003);
        test_adamw_bf16(1003);
        test_adamw_p16(1003, 0);
        test_adamw_p16(1003, 1);
        test_lion(1003);
        test_optim_fused(1003, 0); /* 8-element packs and a tail */
        test_optim_fused(1003, 1); /* element by element */
        test_step_scalars();
        test_muon_ops(1003);
        test_adafactor();
        test_sumsq(4099);
        test_sumsq(100);                  /* fewer elements than partial blocks */
        test_sumsq(0);
        for (int tc = 0; tc <= bf; tc++) {
            /* tc: through the backend's dispatch with the tensor cores forced
             * (auto would time them against SIMT per shape) */
            if (tc) gpu->set_attention("tensor_cores");
            test_attention(2, 37, 3, 3, 16, tc);  /* head size 16: 2 threads per row */
            test_attention(1, 70, 2, 2, 48, tc);  /* 48: 4 threads per row, a second tile */
            test_attention(1, 65, 1, 1, 100, tc); /* 100: 8 threads per row, dims past hs masked; SIMT only */
            test_attention(1, 1, 1, 1, 64, tc);   /* one row */
            /* grouped K/V heads: groups of 3 and 6 query heads, odd and
             * GPT-2 head sizes, one and two key tiles */
            test_attention(2, 37, 6, 2, 10, tc);
            test_attention(1, 70, 6, 1, 10, tc);
            test_attention(1, 37, 6, 2, 64, tc);
            test_attention(1, 70, 6, 1, 64, tc);
            test_attention(1, 70, 6, 2, 18, tc);
            test_attention(1, 140, 3, 1, 80, tc); /* the tensor cores' 8-fragment variant, two query blocks */
            /* document masking: tiles and 64-row blocks skipped before a
             * document's start, rows that see none of a tile */
            test_attention(2, 150, 2, 2, 16, tc, 1);
            test_attention(2, 37, 6, 2, 10, tc, 1);
            test_attention(1, 70, 2, 2, 48, tc, 1);
            test_attention(2, 150, 4, 2, 32, tc, 1);
            if (tc) gpu->set_attention("auto");
        }
        if (bf) test_attention_auto(2), test_attention_auto(1);
        if (bf) test_attention_cudnn_fallback();
        if (bf) test_attention_cudnn_nondeterministic();
        /* block attention (context parallelism): partial, diagonal, past and
         * empty-row blocks; grouped heads, 2, 4 and 8 threads per row; more
         * rows than a 64-row block and keys than a 32-key tile */
        test_attention_block(2, 7, 9, 4, 2, 6, 10, 5, 0);
        test_attention_block(1, 13, 13, 6, 2, 10, 0, 0, 13);
        test_attention_block(2, 5, 11, 3, 1, 40, 20, 0, 11);
        test_attention_block(1, 8, 6, 2, 2, 100, 0, 3, 100);
        test_attention_block(1, 70, 67, 2, 1, 16, 30, 0, 31);
        /* with documents: rows that see none, part or all of a block */
        test_attention_block(2, 7, 9, 4, 2, 6, 10, 5, 0, 1);
        test_attention_block(2, 13, 13, 6, 2, 10, 0, 0, 13, 1);
        test_attention_block(1, 70, 67, 2, 1, 16, 30, 0, 31, 1);
        test_attention_block(2, 150, 130, 2, 2, 16, 140, 0, 130, 1);
        test_copy_2d();
        test_rmsnorm(37, 70);
        test_rmsnorm(37, 48);  /* whole 16-byte packs */
        test_rmsnorm(45, 264); /* several column rounds in the backward */
        const AttnShape a18 = {1, 37, 6, 2, 18, NULL}, a10 = {2, 37, 6, 1, 10, NULL};
        test_rope(a18, 0);
        test_rope(a10, 5);
        test_rope(a18, 0, 1);
        test_rope(a10, 5, 1);
        for (int ph = 0; ph <= 1; ph++) {
            test_qknorm(a18, ph);
            test_qknorm(a10, ph);
        }
        test_swiglu(37, 45);
        /* one sequence (S = N) */
        test_moe(37, 37, 5, 2, 70, 0, 1, 0, 0);
        test_moe(37, 37, 5, 2, 70, 1, 1, 1, 0);
        test_moe(37, 37, 5, 2, 70, 0, 0, 0, 9);    /* capacity drops */
        test_moe(600, 600, 5, 2, 18, 1, 0, 1, 100); /* several dispatch tiles, drops */
        /* several sequences: per-sequence stats, loads, caps and aux rows */
        test_moe(39, 13, 5, 2, 70, 0, 1, 0, 0);     /* 3 x 13, all kept */
        test_moe(39, 13, 5, 2, 70, 0, 1, 1, 3);     /* 3 x 13, drops */
        test_moe(600, 100, 5, 2, 18, 1, 0, 1, 30);  /* 6 x 100, one tile each, drops */
        test_moe(900, 300, 5, 2, 18, 0, 1, 0, 100); /* 3 x 300, 3 tiles each (the last short), drops */
        test_moe(40, 2, 5, 2, 18, 1, 1, 0, 1);      /* sequences of two rows, cap 1 */
        test_zero_rows();
        gpu->shutdown();
    }
    return 0;
}
