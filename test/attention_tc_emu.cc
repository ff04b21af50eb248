/* attention_tc_emu: the tensor-core attention kernels of cuda/attention_tc.cu,
 * compiled for the CPU against test/cuda_emu.h and run on small shapes
 * (T not a multiple of the 64- and 128-row tiles, T = 1, head sizes 16..128
 * and both register-fragment variants, grouped K/V heads, documents),
 * compared with a double-precision attention forward and backward on the
 * same bf16 inputs. Each shape runs twice, the second time with every grid's
 * blocks in reverse order: the outputs must be the same bits (the backward's
 * dQ sums follow the ticket order, never the block index). Built and run by
 * test/t_attention_tc_emu.sh; one "ok"/"FAIL" line per shape. The emulation
 * lands each cp.async copy only at its wait and fails a block that waits for
 * a turn no earlier block gave (test/cuda_emu.h). What it cannot show is the
 * GPU itself: real fragment layouts, races the barriers hide, the memory
 * ordering of the turn flags, speed; scripts/cuda_check.sh covers those.
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

/* n elements of device memory (test/cuda_emu.h's cudaMalloc: garbage until
 * written, guard pages around), readable from the host as the emulation's is. */
template <typename T> static T *dev(size_t n) {
    void *p = NULL;
    if (cudaMalloc(&p, n * sizeof(T)) != cudaSuccess) { printf("FAIL attention_tc_emu: cudaMalloc\n"); exit(1); }
    return (T *)p;
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

/* Forward, then backward, as attention_tc.cu's host side launches them. */
static void run(bf16 *out, float *lse, bf16 *dqkv, unsigned char *scratch, const bf16 *qkv, const bf16 *dout,
                const AttnShape &s) {
    TcDims a = tc_dims(&s);
    float sl2 = TC_LOG2E / sqrtf((float)s.HD), scale = 1.0f / sqrtf((float)s.HD);
    dim3 grid(s.B * s.NH, (s.T + TC_BQ - 1) / TC_BQ);
    size_t shf = tc_smem(s.HD, 0).total, shb = tc_smem(s.HD, 1).total;
    if (s.HD <= 64) launch(grid, TC_FWD_THREADS, shf, [&] { tc_forward_kernel<4>(out, lse, qkv, a, sl2); });
    else launch(grid, TC_FWD_THREADS, shf, [&] { tc_forward_kernel<8>(out, lse, qkv, a, sl2); });
    TcScratch S = tc_scratch_plan(s.B, s.T, s.NH, s.HD);
    float *D = (float *)(scratch + S.d), *acc = (float *)(scratch + S.acc);
    int *sync = (int *)(scratch + S.sync);
    size_t rows = (size_t)s.B * s.NH * s.T;
    launch(dim3((unsigned)((rows * 32 + 255) / 256)), 256, 0, [&] { tc_backward_d_kernel(D, dout, out, s.B, s.T, s.NH, s.HD); });
    cudaMemset(sync, 0, S.sync_bytes);
    unsigned blocks = (unsigned)(s.B * s.NKV * ((s.T + TC_BK - 1) / TC_BK));
    if (s.HD <= 64) launch(blocks, TC_BWD_THREADS, shb, [&] { tc_backward_kernel<4>(dqkv, acc, sync, D, dout, qkv, lse, a, scale, sl2); });
    else launch(blocks, TC_BWD_THREADS, shb, [&] { tc_backward_kernel<8>(dqkv, acc, sync, D, dout, qkv, lse, a, scale, sl2); });
}

/* docs 1: document masking (AttnShape.doc), documents from 0, T/5, T/5 + 1
 * (one token), T/2 + 3 and T - 2 in sequence 0 and from 0, 70 in sequence 1:
 * inside and across the tiles, tiles skipped before a document. */
static int check(int B, int NH, int NKV, int T, int hs, float qscale, int docs = 0) {
    int W = (NH + 2 * NKV) * hs, C = NH * hs, G = NH / NKV;
    size_t N = (size_t)B * T, n3 = N * W, nc = N * C, nl = (size_t)B * NH * T;
    int32_t *doc = dev<int32_t>(N);
    const int st[2][4] = {{T / 5, T / 5 + 1, T / 2 + 3, T - 2}, {70, 70, 70, 70}};
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            int f = 0;
            for (int k = 0; k < 4 && docs; k++) f = st[b % 2][k] <= t && st[b % 2][k] > f ? st[b % 2][k] : f;
            doc[(size_t)b * T + t] = f;
        }
    bf16 *qkv = dev<bf16>(n3), *dout = dev<bf16>(nc), *out = dev<bf16>(nc), *dqkv = dev<bf16>(n3);
    bf16 *out2 = dev<bf16>(nc), *dqkv2 = dev<bf16>(n3);
    float *lse = dev<float>(nl), *lse2 = dev<float>(nl);
    TcScratch S = tc_scratch_plan(B, T, NH, hs);
    unsigned char *scratch = dev<unsigned char>(S.total);
    for (size_t i = 0; i < n3; i++) qkv[i] = rb(qscale);
    for (size_t i = 0; i < nc; i++) dout[i] = rb(1.0f);
    const AttnShape sh = {B, T, NH, NKV, hs, docs ? doc : NULL};
    run(out, lse, dqkv, scratch, qkv, dout, sh);
    emu_blocks_reversed = 1;
    run(out2, lse2, dqkv2, scratch, qkv, dout, sh);
    emu_blocks_reversed = 0;
    int same = !memcmp(out, out2, nc * sizeof(bf16)) && !memcmp(lse, lse2, nl * sizeof(float)) &&
               !memcmp(dqkv, dqkv2, n3 * sizeof(bf16));
    /* double reference on the same bf16 inputs; the backward uses the kernel's own bf16 out in D, as the real backward does */
    auto X = [&](size_t i) { return (double)__bfloat162float(qkv[i]); };
    auto qi = [&](int b, int t, int h) { return ((size_t)b * T + t) * W + (size_t)h * hs; };
    auto ki = [&](int b, int t, int h) { return ((size_t)b * T + t) * W + (size_t)(NH + h / G) * hs; };
    auto vi = [&](int b, int t, int h) { return ((size_t)b * T + t) * W + (size_t)(NH + NKV + h / G) * hs; };
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
                for (int c = 0; c < hs; c++) d += X(qi(b, t, h) + c) * X(ki(b, j, h) + c);
                s[j] = d * sc; mx = std::max(mx, s[j]);
            }
            double sum = 0; for (int j = j0; j <= t; j++) sum += exp(s[j] - mx);
            rl[((size_t)b * NH + h) * T + t] = mx + log(sum);
            for (int j = j0; j <= t; j++) P[(size_t)t * T + j] = exp(s[j] - mx) / sum;
            for (int c = 0; c < hs; c++) {
                double o = 0; for (int j = 0; j <= t; j++) o += P[(size_t)t * T + j] * X(vi(b, j, h) + c);
                ro[((size_t)b * T + t) * C + h * hs + c] = o;
            }
        }
        for (int t = 0; t < T; t++) {
            size_t ob = ((size_t)b * T + t) * C + h * hs;
            double D = 0; for (int c = 0; c < hs; c++) D += (double)__bfloat162float(dout[ob + c]) * __bfloat162float(out[ob + c]);
            for (int j = 0; j <= t; j++) {
                double dp = 0; for (int c = 0; c < hs; c++) dp += (double)__bfloat162float(dout[ob + c]) * X(vi(b, j, h) + c);
                double p = P[(size_t)t * T + j], ds = p * (dp - D) * sc;
                for (int c = 0; c < hs; c++) {
                    rg[vi(b, j, h) + c] += p * __bfloat162float(dout[ob + c]);
                    rg[qi(b, t, h) + c] += ds * X(ki(b, j, h) + c);
                    rg[ki(b, j, h) + c] += ds * X(qi(b, t, h) + c);
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
    int ok = eo <= 1e-2 && el <= 1e-5 && eg <= 1e-2 && same && !emu_wmma_bad;
    printf("%s attention_tc_emu_B%d_NH%d%s_T%d_hs%d%s%s%s out %.2e (bf16 store alone %.2e), lse %.2e, dqkv %.2e (bf16 store "
           "alone %.2e)%s%s\n",
           ok ? "ok" : "FAIL", B, NH, NKV < NH ? ("_NKV" + std::to_string(NKV)).c_str() : "", T, hs,
           qscale > 1 ? "_peaked" : "", docs ? "_doc" : "", ok ? " #" : ":", eo, maxrel(qo, ro), el, eg, maxrel(qg, rg),
           same ? ", blocks reversed: same bits" : ", blocks reversed: OTHER BITS",
           emu_wmma_bad ? ", bad WMMA pointer or ldm" : "");
    emu_wmma_bad = 0;
    void *bufs[] = {doc, qkv, dout, out, dqkv, out2, dqkv2, lse, lse2, scratch};
    for (void *p : bufs) cudaFree(p);
    return ok;
}

int main(void) {
    check(1, 2, 2, 200, 64, 1.0f);  /* the start-up self-check's shape: GPT-2's head size */
    check(2, 1, 1, 70, 16, 1.0f);   /* two batches; a second, partial key tile */
    check(1, 1, 1, 1, 16, 1.0f);    /* one row */
    check(1, 3, 3, 130, 48, 1.0f);  /* 3 column blocks in the 4-fragment variant; 2 rows in the second query block */
    check(1, 1, 1, 150, 80, 1.0f);  /* 5 column blocks in the 8-fragment variant */
    check(1, 2, 2, 129, 128, 1.0f); /* the largest head; 1 row in the last tile */
    check(1, 1, 1, 200, 64, 3.0f);  /* peaked softmax (scores ~ 9x larger) */
    /* grouped K/V heads: 2 and 3 query heads per K/V head, both variants */
    check(2, 4, 2, 150, 32, 1.0f);
    check(1, 3, 1, 140, 80, 1.0f);
    /* document masking: tiles skipped, rows that see none of a tile, both variants, with grouped heads */
    check(2, 2, 2, 200, 64, 1.0f, 1);
    check(2, 1, 1, 150, 80, 1.0f, 1);
    check(1, 1, 1, 200, 64, 3.0f, 1);
    check(2, 4, 2, 150, 32, 1.0f, 1);
    return 0;
}
