/* matmul_emu: cuda/matmul.cu (the cuBLASLt products, the bias, GeLU and
 * bias-gradient epilogues, their fallbacks) on the CPU against test/cublaslt_emu.h's
 * cuBLASLt, compared with the CPU backend's cblas products through the
 * Backend tables, in both activation dtypes. What the other emulation
 * (cuda_emu.cc) leaves out: the row-major/column-major transposes, leading
 * dimensions and types of each product, the attribute sizes cublasLt.h
 * types, the pointers the heuristic must see, the stream, and that every
 * descriptor is destroyed. Built and run by test/t_matmul_emu.sh; one
 * "ok"/"FAIL" line per check.
 *
 * Tolerances: max |cuda - cpu| / max |cpu| per tensor, as cuda_emu.cc.
 *  - fp32 1e-5: sums of <= 40 products in another order than OpenBLAS's,
 *    a few fp32 ulps of the largest term; a transposed or mis-strided operand
 *    errs by O(1).
 *  - bf16 1e-2: the CUDA side stores bf16 once (2^-9 of an element); the
 *    fused GeLU reads the unrounded product where the reference reads it
 *    rounded to bf16, one more 2^-9 through a GeLU whose slope is <= 1.13;
 *    1e-2 is ~3x their sum. */
#include "cuda_emu.h"
#include "max_rel.h"
#include "singular_values.h"
#include "cublaslt_emu.h"
#include "test.h"

#include "../cuda/embed_norm.cu"
#include "../cuda/pointwise.cu"
#include "../cuda/llama.cu"
#include "../cuda/moe.cu"
#include "../cuda/attention.cu"
#include "../cuda/attention_tc.cu"
#include "../cuda/attention_block.cu"
#include "../cuda/fp8.cu"
#include "../cuda/attention_cudnn.cu" /* without KILN_CUDNN: its "not built in" side */
#include "../cuda/matmul.cu"
#include "../cuda/backend_cuda.cu"

#include <random>

/* the fp8 tests' designated initializers leave the other members zero, as in C */
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#include <string>

typedef std::vector<float> Vec;
static size_t AB;       /* act bytes this round */
static const char *DT;  /* "fp32" or "bf16" */
static const Backend *cpu = &backend_cpu, *gpu = &backend_cuda;
static std::mt19937 gen(4242);
static int failures;

static Vec rnd_act(size_t n, float scale) {
    std::normal_distribution<float> d(0.0f, 1.0f);
    Vec v(n);
    for (auto &x : v) x = backend_act_round(d(gen) * scale, AB);
    return v;
}
static Vec act_round(Vec v) {
    for (auto &x : v) x = backend_act_round(x, AB);
    return v;
}
/* A device buffer of n act (es = AB) or fp32 (es = 4) elements placed `off`
 * elements into its allocation (cudaMalloc's start is 256-byte aligned). */
static void *dev_put(const Vec &h, size_t off, size_t es) {
    void *d;
    CUDA_CHECK(cudaMalloc(&d, (h.size() + off) * es + 1));
    std::vector<unsigned char> s(h.size() * es + 1);
    backend_f32_to_act(s.data(), h.data(), h.size(), es);
    unsigned char *p = (unsigned char *)d + off * es;
    CUDA_CHECK(cudaMemcpy(p, s.data(), h.size() * es, cudaMemcpyHostToDevice));
    return p;
}
static void *dev_out(size_t n, size_t es) { /* garbage (NaN) until written */
    void *d;
    CUDA_CHECK(cudaMalloc(&d, n * es + 1));
    return d;
}
static Vec get(const void *d, size_t n, size_t es) {
    std::vector<unsigned char> s(n * es + 1);
    CUDA_CHECK(cudaMemcpy(s.data(), d, n * es, cudaMemcpyDeviceToHost));
    Vec h(n);
    backend_act_to_f32(h.data(), s.data(), n, es);
    return h;
}
static void report(const std::string &name, int ok, const std::string &detail) {
    printf("%s matmul_emu_%s_%s%s%s\n", ok ? "ok" : "FAIL", DT, name.c_str(), ok ? " # " : ": ", detail.c_str());
    failures += !ok;
}
static void check(const std::string &name, const Vec &got, const Vec &ref, double tol) {
    double err = test_max_rel(got.data(), ref.data(), ref.size());
    char b[96];
    snprintf(b, sizeof b, "err %.2e (tol %.0e)", err, tol);
    report(name, err <= tol, b);
}
static double tol_act() { return AB == 2 ? 1e-2 : 1e-5; }
static double tol_f32() { return AB == 2 ? 1e-2 : 1e-5; } /* fp32 gradients of bf16 inputs: same sums, fp32 store */

/* Did cuBLASLt run this epilogue for an (m, ldaux) product (a usable plan)? */
static int fused(int epi, int m) {
    for (int i = 0; i < mm_nplans; i++)
        if (mm_plans[i].key.epi == epi && mm_plans[i].key.m == m && mm_plans[i].usable) return 1;
    return 0;
}
/* The plans of an (m, n, k) product with this epilogue: how many, how many usable. */
static void plans_of(int epi, int m, int n, int k, int *count, int *usable) {
    *count = *usable = 0;
    for (int i = 0; i < mm_nplans; i++) {
        const MmKey *q = &mm_plans[i].key;
        if (q->epi != epi || q->m != m || q->n != n || q->k != k) continue;
        (*count)++;
        *usable += mm_plans[i].usable;
    }
}

/* matmul_forward with a bias at element offset boff (0: 256-byte aligned;
 * 16: 32 bytes in bf16, as model tensors are; 1: the add-bias fallback;
 * -1: no bias), then matmul_backward, both accumulate modes. */
static void test_matmul(int N, int C, int OC, int boff) {
    std::string s = "N" + std::to_string(N) + "_C" + std::to_string(C) + "_OC" + std::to_string(OC) +
                    (boff < 0 ? "_nobias" : "_boff" + std::to_string(boff));
    Vec inp = rnd_act((size_t)N * C, 1.0f), w = rnd_act((size_t)OC * C, 0.3f), b = rnd_act(OC, 0.5f);
    Vec dout = rnd_act((size_t)N * OC, 1.0f);
    void *dinp_ = dev_put(inp, 0, AB), *dw_ = dev_put(w, 0, AB), *db_ = boff < 0 ? NULL : dev_put(b, boff, AB);
    void *dout_ = dev_put(dout, 0, AB), *out_ = dev_out((size_t)N * OC, AB);
    Vec ref((size_t)N * OC);
    cpu->matmul_forward(ref.data(), inp.data(), w.data(), boff < 0 ? NULL : b.data(), N, C, OC);
    gpu->matmul_forward(out_, dinp_, dw_, db_, N, C, OC);
    check("forward_" + s, get(out_, (size_t)N * OC, AB), act_round(ref), tol_act());
    for (int acc = 0; acc <= 1; acc++) {
        Vec dw0 = rnd_act((size_t)OC * C, 1.0f), dbias0 = rnd_act(OC, 1.0f);
        Vec rdinp((size_t)N * C), rdw = dw0, rdb = dbias0;
        cpu->matmul_backward(rdinp.data(), rdw.data(), rdb.data(), dout.data(), inp.data(), w.data(), N, C, OC, acc);
        void *gdinp = dev_out((size_t)N * C, AB);
        float *gdw = (float *)(acc ? dev_put(dw0, 0, 4) : dev_out((size_t)OC * C, 4));
        float *gdb = (float *)(acc ? dev_put(dbias0, 0, 4) : dev_out(OC, 4));
        gpu->matmul_backward(gdinp, gdw, gdb, dout_, dinp_, dw_, N, C, OC, acc);
        std::string a = acc ? "_acc1" : "_acc0";
        check("backward_dinp_" + s + a, get(gdinp, (size_t)N * C, AB), act_round(rdinp), tol_act());
        check("backward_dw_" + s + a, get(gdw, (size_t)OC * C, 4), rdw, tol_f32());
        check("backward_dbias_" + s + a, get(gdb, OC, 4), rdb, tol_f32());
    }
    if (N == 0) return; /* no product: the column sum's zero */
    /* dbias came from the dw product (m C, n OC, k N): into dbias (acc 0) and
     * into the scratch (acc 1), two plans by the vector's alignment, or one */
    int count, usable;
    plans_of(CUBLASLT_EPILOGUE_BGRADB, C, OC, N, &count, &usable);
    char msg[96];
    snprintf(msg, sizeof msg, "%d BGRADB plans for the dw product, %d usable", count, usable);
    report("backward_dbias_bgradb_" + s, count >= 1 && usable == count, msg);
}

/* A descriptor as cublasLtMatmulDescCreate(32F, 32F) and kiln's attributes
 * make it (BIAS_DATA_TYPE unset), for the refusal checks. */
static EmuLtDesc lt_desc(int32_t ta, int32_t tb, uint32_t epi, const void *bias) {
    return EmuLtDesc{CUBLAS_COMPUTE_32F, CUDA_R_32F, ta, tb, epi, bias, NULL, 0, NULL, NULL, -1, {0}, NULL};
}

/* BGRADB as cublasLt.h documents it, on the stand-in's own checks: kiln's
 * dw layout (A not transposed, B transposed) with fp32 C takes it; no bias
 * pointer, a BIAS_DATA_TYPE other than C's, another layout and BGRADA are
 * refused; the attribute's size is checked; and a bias type other than D's
 * for the bias epilogue is refused too. */
static void test_bgradb_refusals(void) {
    float dummy[4];
    /* m 8, n 12, k 16: A (m, k), B (n, k) transposed, C = D (m, n) fp32 */
    EmuLtDesc d = lt_desc(CUBLAS_OP_N, CUBLAS_OP_T, CUBLASLT_EPILOGUE_BGRADB, dummy);
    EmuLtLayout A = {CUDA_R_16BF, 8, 16, 8}, B = {CUDA_R_16BF, 12, 16, 12}, D = {CUDA_R_32F, 8, 12, 8};
    int ok = emu_lt_validate(&d, &A, &B, &D, &D) == CUBLAS_STATUS_SUCCESS;
    EmuLtDesc t = d;
    t.bias_type = CUDA_R_32F;
    int same_type = emu_lt_validate(&t, &A, &B, &D, &D) == CUBLAS_STATUS_SUCCESS;
    t.bias_type = CUDA_R_16BF;
    int other_type = emu_lt_validate(&t, &A, &B, &D, &D) == CUBLAS_STATUS_NOT_SUPPORTED;
    t = d;
    t.bias = NULL;
    int no_ptr = emu_lt_validate(&t, &A, &B, &D, &D) == CUBLAS_STATUS_INVALID_VALUE;
    t = d;
    t.ta = CUBLAS_OP_T, t.tb = CUBLAS_OP_N;
    EmuLtLayout At = {CUDA_R_16BF, 16, 8, 16}, Bn = {CUDA_R_16BF, 16, 12, 16};
    int layout = emu_lt_validate(&t, &At, &Bn, &D, &D) == CUBLAS_STATUS_NOT_SUPPORTED;
    t = d;
    t.epi = CUBLASLT_EPILOGUE_BGRADA;
    int bgrada = emu_lt_validate(&t, &A, &B, &D, &D) == CUBLAS_STATUS_NOT_SUPPORTED;
    t = d;
    t.epi = CUBLASLT_EPILOGUE_BIAS;
    t.bias_type = CUDA_R_16BF;
    int bias_type = emu_lt_validate(&t, &A, &B, &D, &D) == CUBLAS_STATUS_NOT_SUPPORTED;
    int64_t wide = CUDA_R_32F;
    int size = cublasLtMatmulDescSetAttribute(&d, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &wide, sizeof wide) ==
               CUBLAS_STATUS_INVALID_VALUE;
    char msg[240];
    snprintf(msg, sizeof msg, "NT fp32 C accepted %d (BIAS_DATA_TYPE fp32 %d); refused: bf16 bias gradient %d, no bias "
             "pointer %d, TN %d, BGRADA %d, a bf16 bias for fp32 D %d, an 8-byte BIAS_DATA_TYPE %d", ok, same_type,
             other_type, no_ptr, layout, bgrada, bias_type, size);
    report("bgradb_cublaslt_refusals", ok && same_type && other_type && no_ptr && layout && bgrada && bias_type && size,
           msg);
}

/* A cuBLASLt with no BGRADB algorithm for a shape: the bias gradient is the
 * column sum, both accumulate modes right, and the refusal is kept in the
 * shape's plans: a later call asks the heuristic nothing. */
static void test_bgradb_fallback(void) {
    const int N = 29, C = 16, OC = 24; /* a shape no other check uses */
    Vec inp = rnd_act((size_t)N * C, 1.0f), w = rnd_act((size_t)OC * C, 0.3f), dout = rnd_act((size_t)N * OC, 1.0f);
    void *ginp = dev_put(inp, 0, AB), *gw = dev_put(w, 0, AB), *gdout = dev_put(dout, 0, AB);
    Vec db0 = rnd_act(OC, 1.0f), rdw((size_t)OC * C), rdb = db0;
    float *gdw = (float *)dev_out((size_t)OC * C, 4), *gdb = (float *)dev_put(db0, 0, 4);
    emu_lt_no_algo_epi = CUBLASLT_EPILOGUE_BGRADB;
    for (int acc = 0; acc <= 1; acc++) {
        cpu->matmul_backward(NULL, rdw.data(), rdb.data(), dout.data(), inp.data(), w.data(), N, C, OC, acc);
        gpu->matmul_backward(NULL, gdw, gdb, gdout, ginp, gw, N, C, OC, acc);
    }
    int calls = emu_lt_heuristic_calls;
    cpu->matmul_backward(NULL, rdw.data(), rdb.data(), dout.data(), inp.data(), w.data(), N, C, OC, 1);
    gpu->matmul_backward(NULL, gdw, gdb, gdout, ginp, gw, N, C, OC, 1);
    int again = emu_lt_heuristic_calls - calls, count, usable;
    emu_lt_no_algo_epi = 0;
    plans_of(CUBLASLT_EPILOGUE_BGRADB, C, OC, N, &count, &usable);
    check("bgradb_fallback_dw", get(gdw, (size_t)OC * C, 4), rdw, tol_f32());
    check("bgradb_fallback_dbias", get(gdb, OC, 4), rdb, tol_f32());
    char b[128];
    snprintf(b, sizeof b, "%d refused BGRADB plans kept (%d usable), %d heuristic queries on the third call", count,
             usable, again);
    report("bgradb_fallback_chosen_once", count >= 1 && usable == 0 && again == 0, b);
    cudaFree(ginp), cudaFree(gw), cudaFree(gdout), cudaFree(gdw), cudaFree(gdb);
}

/* matmul_gelu_forward and matmul_backward_dgelu against the compositions
 * backend.h names; want_fused: whether cuBLASLt should take the epilogues
 * (aux leading dimensions OC and C multiples of 8). */
static void test_gelu(int N, int C, int OC, int boff, int want_fused) {
    std::string s = "N" + std::to_string(N) + "_C" + std::to_string(C) + "_OC" + std::to_string(OC) + "_boff" +
                    std::to_string(boff);
    Vec inp = rnd_act((size_t)N * C, 1.0f), w = rnd_act((size_t)OC * C, 0.3f), b = rnd_act(OC, 0.5f);
    void *ginp = dev_put(inp, 0, AB), *gw = dev_put(w, 0, AB), *gb = dev_put(b, boff, AB);
    void *gpre = dev_out((size_t)N * OC, AB), *gout = dev_out((size_t)N * OC, AB);
    Vec rpre((size_t)N * OC), rout((size_t)N * OC);
    cpu->matmul_forward(rpre.data(), inp.data(), w.data(), b.data(), N, C, OC);
    rpre = act_round(rpre);
    cpu->gelu_forward(rout.data(), rpre.data(), rout.size());
    gpu->matmul_gelu_forward(gout, gpre, ginp, gw, gb, N, C, OC);
    check("gelu_forward_pre_" + s, get(gpre, rpre.size(), AB), rpre, tol_act());
    check("gelu_forward_out_" + s, get(gout, rout.size(), AB), act_round(rout), tol_act());
    int f = fused(CUBLASLT_EPILOGUE_GELU_AUX_BIAS, OC);
    report("gelu_forward_fused_" + s, f == want_fused, f ? "GELU_AUX_BIAS epilogue" : "separate GeLU kernel");

    /* backward of fc2 (input gelu(pre2), pre2 (N, C)) */
    Vec pre2 = rnd_act((size_t)N * C, 1.0f), g2((size_t)N * C), dout = rnd_act((size_t)N * OC, 1.0f);
    cpu->gelu_forward(g2.data(), pre2.data(), g2.size());
    g2 = act_round(g2);
    Vec tmp((size_t)N * C), rdinp((size_t)N * C), rdw((size_t)OC * C), rdb(OC);
    cpu->matmul_backward(tmp.data(), rdw.data(), rdb.data(), dout.data(), g2.data(), w.data(), N, C, OC, 0);
    tmp = act_round(tmp);
    cpu->gelu_backward(rdinp.data(), pre2.data(), tmp.data(), rdinp.size());
    void *gpre2 = dev_put(pre2, 0, AB), *gg2 = dev_put(g2, 0, AB), *gdout = dev_put(dout, 0, AB);
    void *gdinp = dev_out((size_t)N * C, AB);
    float *gdw = (float *)dev_out((size_t)OC * C, 4), *gdb = (float *)dev_out(OC, 4);
    gpu->matmul_backward_dgelu(gdinp, gdw, gdb, gdout, gg2, gw, gpre2, N, C, OC, 0);
    check("dgelu_dinp_" + s, get(gdinp, rdinp.size(), AB), act_round(rdinp), tol_act());
    check("dgelu_dw_" + s, get(gdw, rdw.size(), 4), rdw, tol_f32());
    check("dgelu_dbias_" + s, get(gdb, OC, 4), rdb, tol_f32());
    f = fused(CUBLASLT_EPILOGUE_DGELU, C);
    report("dgelu_fused_" + s, f == want_fused, f ? "DGELU epilogue" : "separate GeLU backward");
}

/* More distinct shapes than the plan table holds (an MoE run brings new
 * expert row counts every micro-batch): the least recently used plan makes
 * room, a shape used all along keeps its plan, and every product is right. */
static void test_plan_eviction(void) {
    const int C = 8, OC = 16, NMAX = MM_MAX_PLANS + 40, NHOT = 5;
    Vec inp = rnd_act((size_t)NMAX * C, 1.0f), w = rnd_act((size_t)OC * C, 0.3f);
    void *di = dev_put(inp, 0, AB), *dw = dev_put(w, 0, AB), *out = dev_out((size_t)NMAX * OC, AB);
    double err = 0.0;
    for (int n = NHOT + 1; n <= NMAX; n++) {
        gpu->matmul_forward(out, di, dw, NULL, NHOT, C, OC); /* the hot shape, every time */
        gpu->matmul_forward(out, di, dw, NULL, n, C, OC);
        Vec ref((size_t)n * OC);
        cpu->matmul_forward(ref.data(), inp.data(), w.data(), NULL, n, C, OC);
        double e = test_max_rel(get(out, (size_t)n * OC, AB).data(), act_round(ref).data(), ref.size());
        err = e > err || e != e ? e : err;
    }
    int hot = 0;
    for (int i = 0; i < mm_nplans; i++) hot |= mm_plans[i].key.n == NHOT && mm_plans[i].usable;
    char b[160];
    snprintf(b, sizeof b, "%d shapes through a table of %d: hot shape %s, worst err %.2e (tol %.0e)", NMAX - NHOT + 1,
             mm_nplans, hot ? "kept" : "EVICTED", err, tol_act());
    report("plan_table_evicts_least_recent", hot && mm_nplans == MM_MAX_PLANS && err <= tol_act(), b);
    cudaFree(di), cudaFree(dw), cudaFree(out);
}

/* Newton-Schulz (backend.h newton_schulz) on Gaussian matrices of several
 * aspect ratios (wide, tall, square; sizes whose work buffers start off 256
 * bytes) against the CPU backend's fp32 iteration, and its singular values.
 * fp32: 1e-5 as the products (the same 15 products in another summation
 * order, a few ulps). bf16: every product is stored in bf16 (2^-9 relative),
 * which the iteration's slope (up to 3.4445 per step where singular values
 * are small) spreads: the output differs from fp32's by a few percent of its
 * largest element (measured up to 3.6e-2 over these shapes); 5e-2, while a
 * wrong transpose or coefficient errs by O(1).
 * The band: the quintic lifts a small singular value by at most 3.4445 a
 * step, so five steps bring one of the normalised input (sigma / |G|_F)
 * above 0.7 / 3.4445^5 = 1.4e-3 into about [0.68, 1.14] (test_optim:
 * fp32); a square Gaussian matrix can have singular values below that (one
 * of these draws has 5.7e-5, which exact arithmetic takes to 0.028), so
 * singular values whose input lies under 2e-3 are left out and counted.
 * The band of the fp32 test, [0.65, 1.2], in both dtypes (measured: fp32
 * [0.682, 1.133], bf16 [0.681, 1.133]). */
static int sv_cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void test_newton_schulz(double *lo, double *hi, int *left_out) {
    static const int shapes[][2] = {{32, 32}, {16, 64}, {64, 16}, {24, 72}, {100, 30}, {7, 13}};
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (auto &sh : shapes) {
        int r = sh[0], c = sh[1], a = r < c ? r : c;
        size_t n = (size_t)r * c, wn = 2 * n + 2 * (size_t)a * a + 256;
        Vec x(n);
        for (auto &v : x) v = 3.0f * d(gen);
        Vec ref = x, work(wn);
        cpu->newton_schulz(ref.data(), r, c, 5, work.data());
        float *dx = (float *)dev_put(x, 0, 4), *dw = (float *)dev_out(wn, 4);
        gpu->newton_schulz(dx, r, c, 5, dw);
        Vec got = get(dx, n, 4);
        std::string s = std::to_string(r) + "x" + std::to_string(c);
        check("newton_schulz_" + s, got, ref, AB == 2 ? 5e-2 : 1e-5);
        std::vector<double> sv(a), s0(a);
        singular_values(got.data(), r, c, sv.data());
        singular_values(x.data(), r, c, s0.data());
        qsort(sv.data(), a, sizeof(double), sv_cmp); /* small to large: the quintic keeps their order */
        qsort(s0.data(), a, sizeof(double), sv_cmp);
        double frob = 0;
        for (double v : s0) frob += v * v;
        for (int k = 0; k < a; k++) {
            if (s0[k] / sqrt(frob) < 2e-3) {
                (*left_out)++;
                continue;
            }
            *lo = sv[k] < *lo ? sv[k] : *lo, *hi = sv[k] > *hi ? sv[k] : *hi;
        }
        CUDA_CHECK(cudaFree(dx));
        CUDA_CHECK(cudaFree(dw));
    }
}

/* fp8 products (bf16 round): fp8_cast's codes and inverse scales into
 * cuda_fp8_matmul's TN cuBLASLt product, forward (x, w as they are, with a
 * bias), the input gradient (dout in E5M2, w cast transposed) and the weight
 * gradient (x^T and dout^T, fp32 out added to what dw held), tensorwise
 * (one scale each) or rowwise (cuBLASLt's outer-vector scales: per row of
 * x and w; per row of dout and column of w; per column of dout and x),
 * against the CPU backend's fp8 emulation: the same quantisation (fp8_qdq
 * along the same axes), fp32 products of the dequantised operands. Both
 * sum the same exact fp8 products (an E4M3 x E5M2 product has at most 7
 * significant bits) in fp32 in other orders and apply the scales once
 * (here) or per element (the CPU, each dequantised element then a rounding
 * of 2^-24 off): a few fp32 ulps of the largest term. Act outputs are then
 * stored in bf16 (2^-9): bf16's 1e-2; the fp32 weight gradient keeps the
 * file's fp32 1e-5 (measured well under it). Then the stand-in's fp8
 * refusals, each as cublasLt.h and the cuBLAS documentation state it (or
 * stricter: a missing scale). */
static void emu_cast(const Fp8Cast &c, const void *x, int rows, int cols) { gpu->fp8_cast(&c, x, rows, cols); }
static void emu_mm(const Fp8Matmul &p) { gpu->fp8_matmul(&p); }
static void test_fp8_matmul(int N, int C, int OC, int rowwise) {
    std::string s = std::string(rowwise ? "rowwise" : "tensorwise") + "_N" + std::to_string(N) + "_C" +
                    std::to_string(C) + "_OC" + std::to_string(OC);
    Vec x = rnd_act((size_t)N * C, 1.0f), w = rnd_act((size_t)OC * C, 0.05f), b = rnd_act(OC, 0.5f);
    Vec dout = rnd_act((size_t)N * OC, 1e-3f), dw0 = rnd_act((size_t)OC * C, 0.1f);
    for (int i = 0; i < N; i++) /* rows of different magnitudes: rowwise scales differ */
        for (int j = 0; j < C; j++) x[(size_t)i * C + j] = backend_act_round(x[(size_t)i * C + j] * (1 + i % 7), AB);
    void *gx = dev_put(x, 0, AB), *gw = dev_put(w, 0, AB), *gb = dev_put(b, 16, AB), *gd = dev_put(dout, 0, AB);
    uint8_t *qx = (uint8_t *)dev_out((size_t)N * C, 1), *qw = (uint8_t *)dev_out((size_t)OC * C, 1);
    uint8_t *qd = (uint8_t *)dev_out((size_t)N * OC, 1), *qdt = (uint8_t *)dev_out((size_t)N * OC, 1);
    int n = N > C ? N : C;
    n = n > OC ? n : OC;
    float *amax[6], *inv[6];
    for (int k = 0; k < 6; k++) amax[k] = (float *)dev_out(n, 4), inv[k] = (float *)dev_out(n, 4);
    int row = rowwise ? FP8_AXIS_ROW : FP8_AXIS_TENSOR, col = rowwise ? FP8_AXIS_COL : FP8_AXIS_TENSOR;
    /* host reference: amaxes, quantised operands along each product's contraction, fp32 products */
    Vec ax(n), aw(n), ad(n), adc(n), awc(n), axc(n);
    fp8_amax_f32(ax.data(), x.data(), N, C, row);
    fp8_amax_f32(aw.data(), w.data(), OC, C, row);
    fp8_amax_f32(ad.data(), dout.data(), N, OC, row);
    fp8_amax_f32(adc.data(), dout.data(), N, OC, col);
    fp8_amax_f32(awc.data(), w.data(), OC, C, col);
    fp8_amax_f32(axc.data(), x.data(), N, C, col);
    Vec qxh(x.size()), qwh(w.size()), qdh(dout.size()), qdc(dout.size()), qwc(w.size()), qxc(x.size());
    fp8_qdq_f32(qxh.data(), x.data(), ax.data(), 1, N, C, row, FP8_E4M3, 0);
    fp8_qdq_f32(qwh.data(), w.data(), aw.data(), 1, OC, C, row, FP8_E4M3, 0);
    fp8_qdq_f32(qdh.data(), dout.data(), ad.data(), 1, N, OC, row, FP8_E5M2, 0);
    fp8_qdq_f32(qdc.data(), dout.data(), adc.data(), 1, N, OC, col, FP8_E5M2, 0);
    fp8_qdq_f32(qwc.data(), w.data(), awc.data(), 1, OC, C, col, FP8_E4M3, 0);
    fp8_qdq_f32(qxc.data(), x.data(), axc.data(), 1, N, C, col, FP8_E4M3, 0);
    Vec ref((size_t)N * OC), rdinp((size_t)N * C), rdw = dw0;
    cpu->matmul_forward(ref.data(), qxh.data(), qwh.data(), b.data(), N, C, OC);
    cpu->matmul_backward(rdinp.data(), NULL, NULL, qdh.data(), NULL, qwc.data(), N, C, OC, 0);
    cpu->matmul_backward(NULL, rdw.data(), NULL, qdc.data(), qxc.data(), w.data(), N, C, OC, 1);
    /* the GPU side, as model_fp8.c runs it */
    gpu->fp8_amax(amax[0], gx, N, C, row);
    gpu->fp8_amax(amax[1], gw, OC, C, row);
    emu_cast(Fp8Cast{.q = qx, .inv_q = inv[0], .amax_q = amax[0], .P_q = 1, .rowwise = rowwise}, gx, N, C);
    emu_cast(Fp8Cast{.q = qw, .inv_q = inv[1], .amax_q = amax[1], .P_q = 1, .rowwise = rowwise}, gw, OC, C);
    void *out = dev_out((size_t)N * OC, AB);
    emu_mm(Fp8Matmul{.out = out, .a = qw, .b = qx, .sa = inv[1], .sb = inv[0], .fmt_a = FP8_E4M3,
                                 .fmt_b = FP8_E4M3, .rowwise = rowwise, .bias = gb, .N = N, .K = C, .M = OC});
    check("fp8_forward_bias_" + s, get(out, (size_t)N * OC, AB), act_round(ref), 1e-2);
    gpu->fp8_amax(amax[2], gd, N, OC, row);
    gpu->fp8_amax(amax[3], gd, N, OC, col);
    gpu->fp8_amax(amax[4], gw, OC, C, col);
    gpu->fp8_amax(amax[5], gx, N, C, col);
    emu_cast(Fp8Cast{.q = qd, .qt = qdt, .inv_q = inv[2], .inv_t = inv[3], .amax_q = amax[2],
                             .amax_t = amax[3], .P_q = 1, .P_t = 1, .rowwise = rowwise, .fmt = FP8_E5M2}, gd, N, OC);
    emu_cast(Fp8Cast{.qt = qw, .inv_t = inv[4], .amax_q = amax[1], .amax_t = amax[4], .P_q = 1, .P_t = 1,
                             .rowwise = rowwise}, gw, OC, C); /* w^T (C, OC) */
    void *dinp = dev_out((size_t)N * C, AB);
    emu_mm(Fp8Matmul{.out = dinp, .a = qw, .b = qd, .sa = inv[4], .sb = inv[2], .fmt_a = FP8_E4M3,
                                 .fmt_b = FP8_E5M2, .rowwise = rowwise, .N = N, .K = OC, .M = C});
    check("fp8_dinp_e5m2_" + s, get(dinp, (size_t)N * C, AB), act_round(rdinp), 1e-2);
    emu_cast(Fp8Cast{.qt = qx, .inv_t = inv[5], .amax_q = amax[0], .amax_t = amax[5], .P_q = 1, .P_t = 1,
                             .rowwise = rowwise}, gx, N, C); /* x^T (C, N) */
    float *dw = (float *)dev_put(dw0, 0, 4);
    emu_mm(Fp8Matmul{.out = dw, .a = qx, .b = qdt, .sa = inv[5], .sb = inv[3], .fmt_a = FP8_E4M3,
                                 .fmt_b = FP8_E5M2, .rowwise = rowwise, .out_f32 = 1, .accumulate = 1, .N = OC, .K = N,
                                 .M = C});
    check("fp8_wgrad_accumulate_" + s, get(dw, (size_t)OC * C, 4), rdw, 1e-5);
}

/* The stand-in's fp8 refusals: the layout and type rules of cublasLtMatmul's
 * fp8 kernels, then outer-vector scaling's (both A and B, nothing else
 * changed, compute capability 9.0, cuBLAS 12.9, no D scale), and a scaling
 * mode on a bf16 product; cuda_fp8_rowwise follows the device and library. */
static void test_fp8_refusals(void) {
    EmuLtDesc d = lt_desc(CUBLAS_OP_T, CUBLAS_OP_N, CUBLASLT_EPILOGUE_DEFAULT, NULL);
    /* m 32, n 48, k 64: A (k, m) transposed, B (k, n), D (m, n) */
    EmuLtLayout A = {CUDA_R_8F_E4M3, 64, 32, 64}, B = {CUDA_R_8F_E5M2, 64, 48, 64}, D = {CUDA_R_16BF, 32, 48, 32};
    int ok = emu_lt_validate(&d, &A, &B, &D, &D) == CUBLAS_STATUS_SUCCESS;
    EmuLtDesc nn = d;
    nn.ta = CUBLAS_OP_N;
    EmuLtLayout An = {CUDA_R_8F_E4M3, 32, 64, 32};
    int layout = emu_lt_validate(&nn, &An, &B, &D, &D) == CUBLAS_STATUS_NOT_SUPPORTED;
    EmuLtLayout B55 = B, Ak = {CUDA_R_8F_E4M3, 24, 32, 24}, Bk = {CUDA_R_8F_E5M2, 24, 48, 24};
    EmuLtLayout A55 = A;
    A55.type = B55.type = CUDA_R_8F_E5M2;
    int both_e5m2 = emu_lt_validate(&d, &A55, &B55, &D, &D) == CUBLAS_STATUS_NOT_SUPPORTED;
    int k16 = emu_lt_validate(&d, &Ak, &Bk, &D, &D) == CUBLAS_STATUS_NOT_SUPPORTED;
    EmuLtLayout Ald = {CUDA_R_8F_E4M3, 64, 32, 72}; /* ld 72: not a multiple of 16 */
    int ld16 = emu_lt_validate(&d, &Ald, &B, &D, &D) == CUBLAS_STATUS_NOT_SUPPORTED;
    EmuLtLayout Bbf = {CUDA_R_16BF, 64, 48, 64};
    int mixed = emu_lt_validate(&d, &A, &Bbf, &D, &D) == CUBLAS_STATUS_NOT_SUPPORTED;
    EmuLtDesc gelu = d;
    gelu.epi = CUBLASLT_EPILOGUE_GELU_AUX;
    int epi = emu_lt_validate(&gelu, &A, &B, &D, &D) == CUBLAS_STATUS_NOT_SUPPORTED;
    /* no scales: cublasLtMatmul refuses */
    cublasLtMatmulAlgo_t algo;
    memset(&algo, 0, sizeof algo);
    algo.valid = 1;
    void *a = dev_out(64 * 32, 1), *bb = dev_out(64 * 48, 1), *dd = dev_out(32 * 48, 2);
    float one = 1.0f, zero = 0.0f;
    int scales = cublasLtMatmul(mm_handle, &d, &one, a, &A, bb, &B, &zero, dd, &D, dd, &D, &algo, NULL, 0, 0) ==
                 CUBLAS_STATUS_INVALID_VALUE;
    float *sc = (float *)dev_put(Vec(48, 1.0f), 0, 4);
    d.scale_a = d.scale_b = sc;
    int runs = cublasLtMatmul(mm_handle, &d, &one, a, &A, bb, &B, &zero, dd, &D, dd, &D, &algo, NULL, 0, 0) ==
               CUBLAS_STATUS_SUCCESS;
    int misaligned = cublasLtMatmul(mm_handle, &d, &one, (char *)a + 8, &A, bb, &B, &zero, dd, &D, dd, &D, &algo,
                                    NULL, 0, 0) == CUBLAS_STATUS_NOT_SUPPORTED;
    char msg[400];
    snprintf(msg, sizeof msg, "TN accepted %d, runs with scales %d; refused: NN %d, E5M2 x E5M2 %d, k 24 %d, ld 72 %d, "
             "fp8 x bf16 %d, GELU_AUX %d, no scales %d, A 8-byte aligned %d", ok, runs, layout, both_e5m2, k16, ld16,
             mixed, epi, scales, misaligned);
    report("fp8_cublaslt_refusals",
           ok && runs && layout && both_e5m2 && k16 && ld16 && mixed && epi && scales && misaligned, msg);

    /* outer-vector scales: m 32 (A's vector), n 48 (B's) */
    int32_t vec = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F, scalar = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    EmuLtDesc v = d;
    int set = cublasLtMatmulDescSetAttribute(&v, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &vec, sizeof vec) == 0 &&
              cublasLtMatmulDescSetAttribute(&v, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &vec, sizeof vec) == 0;
    int vok = set && emu_lt_validate(&v, &A, &B, &D, &D) == CUBLAS_STATUS_SUCCESS &&
              cublasLtMatmul(mm_handle, &v, &one, a, &A, bb, &B, &zero, dd, &D, dd, &D, &algo, NULL, 0, 0) ==
                  CUBLAS_STATUS_SUCCESS;
    int64_t wide = vec;
    int size = cublasLtMatmulDescSetAttribute(&v, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &wide, sizeof wide) ==
               CUBLAS_STATUS_INVALID_VALUE;
    EmuLtDesc one_side = d;
    cublasLtMatmulDescSetAttribute(&one_side, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &vec, sizeof vec);
    int only_a = emu_lt_validate(&one_side, &A, &B, &D, &D) == CUBLAS_STATUS_NOT_SUPPORTED;
    EmuLtDesc cmode = v;
    int32_t blk = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    cublasLtMatmulDescSetAttribute(&cmode, CUBLASLT_MATMUL_DESC_C_SCALE_MODE, &blk, sizeof blk);
    int other = emu_lt_validate(&cmode, &A, &B, &D, &D) == CUBLAS_STATUS_NOT_SUPPORTED;
    EmuLtDesc dscale = v;
    cublasLtMatmulDescSetAttribute(&dscale, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, &sc, sizeof sc);
    int no_d = cublasLtMatmul(mm_handle, &dscale, &one, a, &A, bb, &B, &zero, dd, &D, dd, &D, &algo, NULL, 0, 0) ==
               CUBLAS_STATUS_INVALID_VALUE;
    EmuLtDesc bf = v;
    bf.ta = CUBLAS_OP_N;
    EmuLtLayout Abf = {CUDA_R_16BF, 32, 64, 32}, Bbf2 = {CUDA_R_16BF, 64, 48, 64};
    int narrow = emu_lt_validate(&bf, &Abf, &Bbf2, &D, &D) == CUBLAS_STATUS_INVALID_VALUE;
    emu_sm_major = 8, emu_sm_minor = 9;
    int ada = emu_lt_validate(&v, &A, &B, &D, &D) == CUBLAS_STATUS_NOT_SUPPORTED;
    mm_fp8_rowwise = -1;
    int ada_kiln = gpu->fp8_rowwise() == 0;
    emu_sm_major = 10, emu_sm_minor = 0;
    int blackwell = emu_lt_validate(&v, &A, &B, &D, &D) == CUBLAS_STATUS_NOT_SUPPORTED;
    emu_sm_major = 9, emu_sm_minor = 0;
    emu_lt_version = 120800;
    EmuLtDesc old = d;
    int v128 = cublasLtMatmulDescSetAttribute(&old, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &vec, sizeof vec) ==
               CUBLAS_STATUS_INVALID_VALUE;
    mm_fp8_rowwise = -1;
    int old_kiln = gpu->fp8_rowwise() == 0;
    emu_lt_version = 130100;
    mm_fp8_rowwise = -1;
    int hopper_kiln = gpu->fp8_rowwise() == 1;
    (void)scalar;
    snprintf(msg, sizeof msg, "both OUTER_VEC_32F runs %d; refused: int64 mode %d, A only %d, C mode changed %d, D scale "
             "%d, on bf16 operands %d, sm_89 %d, sm_100 %d, cuBLAS 12.8 %d; kiln's rowwise products: sm_90 13.1 %d, "
             "sm_89 off %d, 12.8 off %d", vok, size, only_a, other, no_d, narrow, ada, blackwell, v128, hopper_kiln,
             ada_kiln, old_kiln);
    report("fp8_cublaslt_outer_vec_refusals", vok && size && only_a && other && no_d && narrow && ada && blackwell &&
           v128 && hopper_kiln && ada_kiln && old_kiln, msg);
}

/* An outer-vector scale shorter than its matrix's m or n: a GPU would read
 * past it, so the stand-in fails the test (in a child here, its message
 * checked). */
static void short_vector_child(void *) {
    uint8_t *a = (uint8_t *)dev_out(64 * 32, 1), *b = (uint8_t *)dev_out(64 * 48, 1);
    void *out = dev_out(32 * 48, 2);
    float *sa = (float *)dev_put(Vec(32, 1.0f), 0, 4), *sb = (float *)dev_put(Vec(47, 1.0f), 0, 4);
    emu_mm(Fp8Matmul{.out = out, .a = a, .b = b, .sa = sa, .sb = sb, .rowwise = 1, .N = 48, .K = 64, .M = 32});
}
static void test_fp8_short_vector(void) {
    char out[512];
    int rc = test_run_child_fd(short_vector_child, NULL, 1, out, sizeof out);
    size_t n = strlen(out);
    if (n > 0 && out[n - 1] == '\n') out[n - 1] = '\0';
    report("fp8_outer_vec_short_scale_fails", rc != 0 && strstr(out, "outer-vector scale"), out[0] ? out : "no message");
}

int main(void) {
    cpu->init(1);
    for (int bf = 0; bf <= 1; bf++) {
        AB = bf ? 2 : 4;
        DT = bf ? "bf16" : "fp32";
        gpu->init(0);
        gpu->set_attention("simt"); /* no attention self-check: this test is about the products */
        gpu->set_precision(DT);
        test_matmul(37, 24, 40, 0);
        test_matmul(37, 24, 40, 16); /* a model tensor's bias: 32 bytes (bf16) or 64 (fp32) aligned */
        test_matmul(37, 24, 40, 1);  /* under 16 bytes: the add-bias kernel */
        test_matmul(5, 20, 36, -1);
        test_matmul(0, 24, 40, 16); /* no rows (an expert given no tokens): dw, dbias 0 or kept */
        test_gelu(37, 24, 40, 16, 1);
        test_gelu(37, 20, 36, 16, 0); /* aux ld 36 and 20: not multiples of 8, the separate ops */
        test_bgradb_fallback();
        if (!bf) test_bgradb_refusals();
        test_plan_eviction();
        if (bf) {
            for (int rowwise = 0; rowwise <= 1; rowwise++) {
                test_fp8_matmul(48, 64, 32, rowwise);
                test_fp8_matmul(16, 32, 80, rowwise);
            }
            test_fp8_refusals();
            test_fp8_short_vector();
        }
        double lo = 1e9, hi = 0;
        int left_out = 0;
        test_newton_schulz(&lo, &hi, &left_out);
        char b[160];
        snprintf(b, sizeof b, "singular values in [%.4f, %.4f], want within [0.65, 1.2] (%d below 2e-3 of |G|_F left "
                 "out)", lo, hi, left_out);
        report("newton_schulz_singular_values", lo >= 0.65 && hi <= 1.2, b);
        gpu->shutdown();
        report("descriptors_destroyed", emu_lt_live == 0, std::to_string(emu_lt_live) + " cuBLASLt objects live");
    }
    return failures ? 1 : 0;
}
