/* attention_tc_emu: the tensor-core attention kernels of cuda/attention_tc.cu,
 * compiled for the CPU against test/cuda_emu.h and run on small shapes
 * (T not a multiple of the 64-row tiles, T = 1, head sizes 16..128 and both
 * register-fragment variants), compared with a double-precision attention
 * forward and backward on the same bf16 inputs. Built and run by
 * test/t_attention_tc_emu.sh; one "ok"/"FAIL" line per shape. What it cannot
 * show is the GPU itself: real fragment layouts, races the barriers hide,
 * speed; scripts/cuda_check.sh covers those.
 *
 * Tolerances, max |kernel - reference| / max |reference| per tensor:
 *  - out, dqkv 1e-2: the kernels store bf16, so one rounding (up to 2^-8 of
 *    the largest element, 3.9e-3; the line shows what that rounding alone
 *    gives) plus P and dS rounded to bf16 before their products (measured
 *    adding < 1e-3). A wrong index, mask or missing barrier gives > 0.1.
 *  - lse 1e-5: fp32 scores from exact bf16 products and fp32 sums, exp2 and
 *    log in fp32 (measured ~1e-7). */
#include "cuda_emu.h"
#define KILN_TC_KERNELS_ONLY
#include "../cuda/attention_tc.cu"
#include <functional>
#include <random>

/* The kernels' dynamic shared memory is opted in up to the GPU's maximum
 * (attention_tc.cu's host side does it with cudaFuncSetAttribute). */
static void launch(dim3 grid, unsigned threads, size_t smem, const std::function<void()> &f) {
    emu_launch(grid, dim3(threads), smem, f, EMU_SMEM_MAX);
    if (cudaGetLastError() != cudaSuccess) { printf("FAIL attention_tc_emu: launch refused (%zu bytes of shared memory)\n", smem); exit(1); }
}

static std::mt19937 gen(7); /* fixed inputs: a failure replays */
static bf16 rb(float s) { std::normal_distribution<float> n(0, s); return __float2bfloat16_rn(n(gen)); }
static double maxrel(const std::vector<double> &got, const std::vector<double> &ref) {
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); i++) {
        double d = fabs(got[i] - ref[i]);
        if (std::isnan(d)) return INFINITY;
        num = std::max(num, d); den = std::max(den, fabs(ref[i]));
    }
    return num / (den ? den : 1);
}

/* docs 1: document masking (AttnShape.doc), documents from 0, T/5, T/5 + 1
 * (one token), T/2 + 3 and T - 2 in sequence 0 and from 0, 70 in sequence 1:
 * inside and across the 64-row tiles, tiles skipped before a document. */
static int check(int B, int NH, int T, int hs, float qscale, int docs = 0) {
    int C = NH * hs; size_t N = (size_t)B * T, n3 = N * 3 * C, nc = N * C, nl = (size_t)B * NH * T;
    std::vector<int32_t> doc(N);
    const int st[2][4] = {{T / 5, T / 5 + 1, T / 2 + 3, T - 2}, {70, 70, 70, 70}};
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            int f = 0;
            for (int k = 0; k < 4 && docs; k++) f = st[b % 2][k] <= t && st[b % 2][k] > f ? st[b % 2][k] : f;
            doc[(size_t)b * T + t] = f;
        }
    const int32_t *dd = docs ? doc.data() : NULL;
    std::vector<bf16> qkv(n3), dout(nc), out(nc), dqkv(n3);
    for (auto &x : qkv) x = rb(qscale);
    for (auto &x : dout) x = rb(1.0f);
    for (auto &x : out) x.u = 0x7fc0; /* NaN: rows never written stay NaN */
    for (auto &x : dqkv) x.u = 0x7fc0;
    std::vector<float> lse(nl, NAN), Dbuf(nl, NAN);
    float sl2 = TC_LOG2E / sqrtf((float)hs), scale = 1.0f / sqrtf((float)hs);
    dim3 grid(B * NH, (T + TC_B - 1) / TC_B);
    launch(grid, TC_THREADS, tc_smem(hs, 0).total, [&] { tc_forward_kernel(out.data(), lse.data(), qkv.data(), dd, T, C, NH, sl2); });
    size_t rows = (size_t)B * NH * T;
    launch(dim3((unsigned)((rows * 32 + 255) / 256)), 256, 0, [&] { tc_backward_d_kernel(Dbuf.data(), dout.data(), out.data(), B, T, C, NH); });
    size_t sh = tc_smem(hs, 1).total;
    if (hs <= 64) {
        launch(grid, TC_THREADS, sh, [&] { tc_backward_dkv_kernel<4>(dqkv.data(), Dbuf.data(), dout.data(), qkv.data(), lse.data(), dd, T, C, NH, scale, sl2); });
        launch(grid, TC_THREADS, sh, [&] { tc_backward_dq_kernel<4>(dqkv.data(), Dbuf.data(), dout.data(), qkv.data(), lse.data(), dd, T, C, NH, scale, sl2); });
    } else {
        launch(grid, TC_THREADS, sh, [&] { tc_backward_dkv_kernel<8>(dqkv.data(), Dbuf.data(), dout.data(), qkv.data(), lse.data(), dd, T, C, NH, scale, sl2); });
        launch(grid, TC_THREADS, sh, [&] { tc_backward_dq_kernel<8>(dqkv.data(), Dbuf.data(), dout.data(), qkv.data(), lse.data(), dd, T, C, NH, scale, sl2); });
    }
    /* double reference on the same bf16 inputs; the backward uses the kernel's own bf16 out in D, as the real backward does */
    auto X = [&](size_t i) { return (double)__bfloat162float(qkv[i]); };
    std::vector<double> ro(nc), rl(nl), rg(n3, 0.0), go(nc), gl(nl), gg(n3);
    double sc = 1.0 / sqrt((double)hs);
    for (int b = 0; b < B; b++) for (int h = 0; h < NH; h++) {
        std::vector<double> P((size_t)T * T, 0.0);
        for (int t = 0; t < T; t++) {
            double mx = -INFINITY;
            std::vector<double> s(t + 1, -INFINITY);
            int j0 = doc[(size_t)b * T + t]; /* keys [j0, t]: its document's */
            for (int j = j0; j <= t; j++) {
                double d = 0;
                for (int c = 0; c < hs; c++) d += X(((size_t)b * T + t) * 3 * C + h * hs + c) * X(((size_t)b * T + j) * 3 * C + C + h * hs + c);
                s[j] = d * sc; mx = std::max(mx, s[j]);
            }
            double sum = 0; for (int j = j0; j <= t; j++) sum += exp(s[j] - mx);
            rl[((size_t)b * NH + h) * T + t] = mx + log(sum);
            for (int j = j0; j <= t; j++) P[(size_t)t * T + j] = exp(s[j] - mx) / sum;
            for (int c = 0; c < hs; c++) {
                double o = 0; for (int j = 0; j <= t; j++) o += P[(size_t)t * T + j] * X(((size_t)b * T + j) * 3 * C + 2 * C + h * hs + c);
                ro[((size_t)b * T + t) * C + h * hs + c] = o;
            }
        }
        for (int t = 0; t < T; t++) {
            size_t ob = ((size_t)b * T + t) * C + h * hs;
            double D = 0; for (int c = 0; c < hs; c++) D += (double)__bfloat162float(dout[ob + c]) * __bfloat162float(out[ob + c]);
            for (int j = 0; j <= t; j++) {
                double dp = 0; for (int c = 0; c < hs; c++) dp += (double)__bfloat162float(dout[ob + c]) * X(((size_t)b * T + j) * 3 * C + 2 * C + h * hs + c);
                double p = P[(size_t)t * T + j], ds = p * (dp - D) * sc;
                for (int c = 0; c < hs; c++) {
                    rg[((size_t)b * T + j) * 3 * C + 2 * C + h * hs + c] += p * __bfloat162float(dout[ob + c]);
                    rg[((size_t)b * T + t) * 3 * C + h * hs + c] += ds * X(((size_t)b * T + j) * 3 * C + C + h * hs + c);
                    rg[((size_t)b * T + j) * 3 * C + C + h * hs + c] += ds * X(((size_t)b * T + t) * 3 * C + h * hs + c);
                }
            }
        }
    }
    for (size_t i = 0; i < nc; i++) go[i] = __bfloat162float(out[i]);
    for (size_t i = 0; i < nl; i++) gl[i] = lse[i];
    for (size_t i = 0; i < n3; i++) gg[i] = __bfloat162float(dqkv[i]);
    /* what a perfect kernel with bf16 stores would score */
    std::vector<double> qo(nc), qg(n3);
    for (size_t i = 0; i < nc; i++) qo[i] = __bfloat162float(__float2bfloat16_rn((float)ro[i]));
    for (size_t i = 0; i < n3; i++) qg[i] = __bfloat162float(__float2bfloat16_rn((float)rg[i]));
    double eo = maxrel(go, ro), el = maxrel(gl, rl), eg = maxrel(gg, rg);
    int ok = eo <= 1e-2 && el <= 1e-5 && eg <= 1e-2 && !emu_wmma_bad;
    printf("%s attention_tc_emu_B%d_NH%d_T%d_hs%d%s%s%s out %.2e (bf16 store alone %.2e), lse %.2e, dqkv %.2e (bf16 store "
           "alone %.2e)%s\n",
           ok ? "ok" : "FAIL", B, NH, T, hs, qscale > 1 ? "_peaked" : "", docs ? "_doc" : "", ok ? " #" : ":", eo, maxrel(qo, ro), el, eg,
           maxrel(qg, rg), emu_wmma_bad ? ", bad WMMA pointer or ldm" : "");
    emu_wmma_bad = 0;
    return ok;
}

int main(void) {
    check(1, 2, 200, 64, 1.0f);  /* the start-up self-check's shape: GPT-2's head size */
    check(2, 1, 70, 16, 1.0f);   /* two batches; a second, partial tile */
    check(1, 1, 1, 16, 1.0f);    /* one row */
    check(1, 3, 130, 48, 1.0f);  /* 3 column blocks in the 4-fragment variant */
    check(1, 1, 150, 80, 1.0f);  /* 5 column blocks in the 8-fragment variant */
    check(1, 2, 129, 128, 1.0f); /* the largest head; 1 row in the last tile */
    check(1, 1, 200, 64, 3.0f);  /* peaked softmax (scores ~ 9x larger) */
    /* document masking: tiles skipped, rows that see none of a tile, both variants */
    check(2, 2, 200, 64, 1.0f, 1);
    check(2, 1, 150, 80, 1.0f, 1);
    check(1, 1, 200, 64, 3.0f, 1);
    return 0;
}
