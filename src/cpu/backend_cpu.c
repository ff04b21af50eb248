/* backend_cpu: the reference backend. fp32 ops in C + OpenMP, every matrix product
 * through OpenBLAS sgemm. The activation dtype is fp32 (act_bytes 4): the
 * void * of backend.h's act tensors are float * here. Results are bit-reproducible for a fixed thread count:
 * static schedules only, no float atomics, reductions combined in a fixed order.
 * Must never allocate inside an op in steady state, nor know about models. */
#include "backend.h"
#include "clip.h"
#include "fp8.h"
#include "sround.h"
#include "util.h"

#include <cblas.h>
#include <math.h>
#ifdef __AVX__
#include <immintrin.h>
#endif
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* OpenBLAS extensions; declared here so we do not depend on which cblas.h
 * variant the include path finds. */
extern void openblas_set_num_threads(int num_threads);
extern char *openblas_get_config(void);
extern int openblas_get_parallel(void);

#define CPU_ALIGN 64
#define CPU_GELU_SCALE 0.7978845608028654f /* sqrt(2/pi) */

static char cpu_desc[256];

/* ---------------------------------------------------------------------------
 * Vectorisable exp. libm's expf/tanhf are scalar calls that GCC turns into SIMD
 * only under -ffast-math; cross-entropy (N x Vp exps) and GeLU (N x 4C tanh per
 * layer) would then cost a visible share of the step. This is the Cephes expf
 * polynomial (max error 1.4 ulp measured over [-87, 88]) written without
 * float branches, which GCC will not if-convert, so loops around it vectorise;
 * it is also the same on every machine, whatever the libm. Edge behaviour:
 * |x| is first clamped to 88 (NaN left alone, so it propagates), giving
 * exp(x >= 88) = 1.65e38 rather than inf and exp(x <= -87.7) = 0 exactly. */
static inline float cpu_expf(float x) {
    union { float f; uint32_t i; } u = {x};
    uint32_t a = u.i & 0x7fffffffu;
    /* 0x42b00000 is 88.0f, 0x7f800000 inf: finite or infinite beyond 88. */
    u.i = a > 0x42b00000u && a <= 0x7f800000u ? (u.i & 0x80000000u) | 0x42b00000u : u.i;
    x = u.f;
    /* n = round(x / ln2) by the 1.5 * 2^23 trick: exact for |x| <= 88. */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f; /* ln2 in two parts: r exact to ~1 ulp */
    r = r - n * -2.12194440e-4f;
    float r2 = r * r;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r2 + r + 1.0f;
    int32_t k = (int32_t)n; /* [-127, 127], or INT_MIN for NaN (p is NaN then) */
    union { uint32_t i; float f; } e;
    e.i = k < -126 ? 0u : (uint32_t)(k + 127) << 23; /* 2^k, 0 below the normals */
    return p * e.f;
}

/* tanh(u) = 1 - 2 / (exp(2u) + 1). Absolute error ~2e-7, which is all GeLU
 * needs (it uses 1 + tanh and 1 - tanh^2); relative accuracy near 0 is not. */
static inline float cpu_tanhf(float u) {
    return 1.0f - 2.0f / (cpu_expf(2.0f * u) + 1.0f);
}

/* ---------------------------------------------------------------------------
 * Start-up and memory */

/* memory_peak's count: the bytes asked of cpu_alloc (before the rounding to
 * CPU_ALIGN and without the header), those of live buffers and the most live
 * at once since init, the figure `./train plan` predicts. Atomic: nothing
 * calls alloc from two threads today, but a counter that is wrong under a
 * future prefetch thread would be wrong silently. */
static _Atomic size_t cpu_mem_used, cpu_mem_peak;

static const char *cpu_init(int threads) {
    atomic_store(&cpu_mem_peak, atomic_load(&cpu_mem_used)); /* memory_peak counts from init */
    if (threads <= 0) threads = omp_get_num_procs();
    omp_set_num_threads(threads);
    openblas_set_num_threads(threads);
    int par = openblas_get_parallel();
    const char *kind = par == 2 ? "OpenMP" : par == 1 ? "pthreads" : "sequential";
    /* The config reads "OpenBLAS 0.3.21 NO_LAPACKE ... Zen MAX_THREADS=64": put
     * the threading kind after the version. */
    const char *cfg = openblas_get_config();
    char ver[32] = "";
    int used = 0;
    if (!cfg) cfg = "";
    if (sscanf(cfg, "OpenBLAS %31s %n", ver, &used) >= 1) cfg += used;
    snprintf(cpu_desc, sizeof cpu_desc, "cpu: %d threads, OpenBLAS %s (%s) %s", threads, ver, kind,
             cfg);
    if (par == 1)
        /* A pthreads OpenBLAS spins its own pool against ours: both slow down. */
        kiln_warn("OpenBLAS is the pthreads build; link the OpenMP build for full speed");
    return cpu_desc;
}

static float *cpu_scratch; /* attention scratch, below */
static size_t cpu_scratch_floats;

static void cpu_free(void *p);

static void cpu_shutdown(void) {
    cpu_free(cpu_scratch);
    cpu_scratch = NULL;
    cpu_scratch_floats = 0;
}

/* Each buffer is preceded by a CPU_ALIGN-byte header holding its requested
 * size, so free can subtract it and the buffer stays aligned. */
static void *cpu_alloc(size_t bytes) {
    size_t n = (bytes + CPU_ALIGN - 1) / CPU_ALIGN * CPU_ALIGN;
    if (n == 0) n = CPU_ALIGN;
    char *p = aligned_alloc(CPU_ALIGN, CPU_ALIGN + n);
    if (!p) kiln_fail(KILN_EXIT_RUNTIME, "cpu backend: out of memory allocating %zu bytes", bytes);
    memset(p + CPU_ALIGN, 0, n);
    *(size_t *)p = bytes;
    size_t used = atomic_fetch_add(&cpu_mem_used, bytes) + bytes;
    size_t peak = atomic_load(&cpu_mem_peak);
    while (used > peak && !atomic_compare_exchange_weak(&cpu_mem_peak, &peak, used)) {}
    return p + CPU_ALIGN;
}

static void cpu_free(void *p) {
    if (!p) return;
    char *base = (char *)p - CPU_ALIGN;
    atomic_fetch_sub(&cpu_mem_used, *(size_t *)base);
    free(base);
}

/* The most bytes live through cpu_alloc at once since init (backend.h). */
static size_t cpu_memory_peak(void) { return atomic_load(&cpu_mem_peak); }

static void cpu_memcpy(void *dst, const void *src, size_t bytes) {
    if (bytes) memmove(dst, src, bytes);
}

static void cpu_zero(void *dst, size_t bytes) {
    if (bytes) memset(dst, 0, bytes);
}

static void cpu_sync(void) {}

/* The activation dtype is fp32: no precision choice, and the compute copy
 * of the parameters is the master itself (model.c aliases it; a cast is a
 * copy). */
static size_t cpu_act_bytes(void) { return sizeof(float); }
static void cpu_cast_to_act(void *dst, const float *src, size_t n) {
    cpu_memcpy(dst, src, n * sizeof(float));
}

/* ---------------------------------------------------------------------------
 * Embedding */

static void cpu_embed_forward(void *out_, const int32_t *tokens, const void *wte_,
                              const void *wpe_, int B, int T, int C) {
    /* out (B*T,C), tokens (B*T), wte (Vp,C), wpe (T,C) or NULL (no learned positions) */
    float *out = out_;
    const float *wte = wte_, *wpe = wpe_;
    #pragma omp parallel for schedule(static)
    for (int i = 0; i < B * T; i++) {
        float *o = out + (size_t)i * C;
        if (tokens[i] < 0) { /* another tp rank's token: zero, plus the position */
            for (int c = 0; c < C; c++) o[c] = wpe ? wpe[(size_t)(i % T) * C + c] : 0.0f;
            continue;
        }
        const float *we = wte + (size_t)tokens[i] * C;
        if (!wpe) {
            memcpy(o, we, (size_t)C * sizeof(float));
            continue;
        }
        const float *pe = wpe + (size_t)(i % T) * C;
        for (int c = 0; c < C; c++) o[c] = we[c] + pe[c];
    }
}

static void cpu_embed_backward(float *dwte, float *dwpe, const void *dout_, const int32_t *tokens,
                               const int32_t *tokens_host, int B, int T, int C, int accumulate) {
    /* dwte (Vp,C) +=, dwpe (T,C), dout (B*T,C), tokens (B*T) (host memory: tokens_host is not needed) */
    const float *dout = dout_;
    /* Threads own channel ranges, so repeated tokens never race and every sum
     * runs in token order: deterministic for any thread count. */
    #pragma omp parallel
    {
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        int c0 = (int)((long)C * id / nt), c1 = (int)((long)C * (id + 1) / nt);
        for (int i = 0; i < B * T; i++) {
            if (tokens[i] < 0) continue; /* another tp rank's token */
            float *dw = dwte + (size_t)tokens[i] * C;
            const float *d = dout + (size_t)i * C;
            for (int c = c0; c < c1; c++) dw[c] += d[c];
        }
    }
    if (!dwpe) return;
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) {
        float *dp = dwpe + (size_t)t * C;
        if (!accumulate)
            for (int c = 0; c < C; c++) dp[c] = 0.0f;
        for (int b = 0; b < B; b++) {
            const float *d = dout + ((size_t)b * T + t) * C;
            for (int c = 0; c < C; c++) dp[c] += d[c];
        }
    }
}

/* ---------------------------------------------------------------------------
 * LayerNorm (eps 1e-5 and biased variance, as torch.nn.LayerNorm) */

/* One row: o (C) = the norm of x (C), its statistics into *mean, *rstd.
 * Both the norm alone and the fused residual add run it, so they agree to
 * the bit (backend.h residual_norm_forward). */
static void cpu_layernorm_row(float *o, float *mean, float *rstd, const float *x, const float *w, const float *b,
                              int C, float eps) {
    float s = 0.0f;
    #pragma omp simd reduction(+ : s)
    for (int c = 0; c < C; c++) s += x[c];
    float m = s / C;
    /* Two passes (mean, then squared deviations): no cancellation when the
     * residual stream drifts to a large mean. */
    float v = 0.0f;
    #pragma omp simd reduction(+ : v)
    for (int c = 0; c < C; c++) {
        float d = x[c] - m;
        v += d * d;
    }
    float r = 1.0f / sqrtf(v / C + eps);
    if (b)
        for (int c = 0; c < C; c++) o[c] = (x[c] - m) * r * w[c] + b[c];
    else
        for (int c = 0; c < C; c++) o[c] = (x[c] - m) * r * w[c];
    *mean = m;
    *rstd = r;
}

static void cpu_layernorm_forward(void *out_, float *mean, float *rstd, const void *inp_,
                                  const void *w_, const void *b_, int N, int C, float eps) {
    /* out (N,C), mean (N), rstd (N), inp (N,C), w (C), b (C) or NULL */
    float *out = out_;
    const float *inp = inp_, *w = w_, *b = b_;
    #pragma omp parallel for schedule(static)
    for (int i = 0; i < N; i++)
        cpu_layernorm_row(out + (size_t)i * C, &mean[i], &rstd[i], inp + (size_t)i * C, w, b, C, eps);
}

static void cpu_layernorm_backward(void *dinp_, float *dw, float *db, const void *dout_,
                                   const void *inp_, const void *w_, const float *mean,
                                   const float *rstd, int N, int C, int accumulate) {
    /* dinp (N,C) +=, dw (C), db (C) or NULL, dout (N,C), inp (N,C), w (C), mean (N), rstd (N) */
    float *dinp = dinp_;
    const float *dout = dout_, *inp = inp_, *w = w_;
    #pragma omp parallel
    {
        /* Rows for dinp ... */
        #pragma omp for schedule(static)
        for (int i = 0; i < N; i++) {
            const float *x = inp + (size_t)i * C;
            const float *d = dout + (size_t)i * C;
            float m = mean[i], r = rstd[i];
            float sd = 0.0f, sdn = 0.0f; /* mean(dnorm), mean(dnorm * norm) */
            #pragma omp simd reduction(+ : sd, sdn)
            for (int c = 0; c < C; c++) {
                float dn = d[c] * w[c];
                sd += dn;
                sdn += dn * (x[c] - m) * r;
            }
            sd /= C;
            sdn /= C;
            float *di = dinp + (size_t)i * C;
            for (int c = 0; c < C; c++) {
                float n = (x[c] - m) * r;
                di[c] += (d[c] * w[c] - sd - n * sdn) * r;
            }
        }
        /* ... then channel ranges for dw, db: each column summed over rows in
         * row order by one thread, so no partial buffers and no races. */
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        int c0 = (int)((long)C * id / nt), c1 = (int)((long)C * (id + 1) / nt);
        if (!accumulate)
            for (int c = c0; c < c1; c++) {
                dw[c] = 0.0f;
                if (db) db[c] = 0.0f;
            }
        for (int i = 0; i < N; i++) {
            const float *x = inp + (size_t)i * C;
            const float *d = dout + (size_t)i * C;
            float m = mean[i], r = rstd[i];
            for (int c = c0; c < c1; c++) dw[c] += d[c] * (x[c] - m) * r;
            if (db)
                for (int c = c0; c < c1; c++) db[c] += d[c];
        }
    }
}

/* ---------------------------------------------------------------------------
 * RMSNorm (Llama; HF LlamaRMSNorm in fp32) */

/* One row, as cpu_layernorm_row. */
static void cpu_rmsnorm_row(float *o, float *rstd, const float *x, const float *w, int C, float eps) {
    float s = 0.0f;
    #pragma omp simd reduction(+ : s)
    for (int c = 0; c < C; c++) s += x[c] * x[c];
    float r = 1.0f / sqrtf(s / C + eps);
    for (int c = 0; c < C; c++) o[c] = x[c] * r * w[c];
    *rstd = r;
}

static void cpu_rmsnorm_forward(void *out_, float *rstd, const void *inp_, const void *w_, int N, int C,
                                float eps) {
    /* out (N,C), rstd (N), inp (N,C), w (C) */
    float *out = out_;
    const float *inp = inp_, *w = w_;
    #pragma omp parallel for schedule(static)
    for (int i = 0; i < N; i++) cpu_rmsnorm_row(out + (size_t)i * C, &rstd[i], inp + (size_t)i * C, w, C, eps);
}

/* The residual add and the norm after it, row by row (the row is still in
 * cache when the norm reads it); the same row functions as the norms alone. */
static void cpu_residual_norm_forward(void *res_, void *out_, float *mean, float *rstd, const void *a_,
                                      const void *b_, const void *w_, const void *bias_, int N, int C, float eps) {
    /* res, out, a, b (N,C); mean (N) or NULL (RMSNorm), rstd (N); w, bias (C) */
    float *res = res_, *out = out_;
    const float *a = a_, *b = b_, *w = w_, *bias = bias_;
    #pragma omp parallel for schedule(static)
    for (int i = 0; i < N; i++) {
        size_t off = (size_t)i * C;
        for (int c = 0; c < C; c++) res[off + c] = a[off + c] + b[off + c];
        if (mean) cpu_layernorm_row(out + off, &mean[i], &rstd[i], res + off, w, bias, C, eps);
        else cpu_rmsnorm_row(out + off, &rstd[i], res + off, w, C, eps);
    }
}

/* One group's gradient through y = x r w, r = (mean(x^2) + eps)^-1/2:
 * dx = r (dy w) - x r^3 mean(dy w x). dx may alias dy (QK-norm works in place). */
static void cpu_rms_group_backward(float *dx, const float *dy, const float *x, const float *w, float r,
                                   int n, int add) {
    /* dx, dy, x, w (n) */
    float s = 0.0f;
    #pragma omp simd reduction(+ : s)
    for (int c = 0; c < n; c++) s += dy[c] * w[c] * x[c];
    float k = r * r * r * (s / n);
    if (add)
        for (int c = 0; c < n; c++) dx[c] += r * (dy[c] * w[c]) - x[c] * k;
    else
        for (int c = 0; c < n; c++) dx[c] = r * (dy[c] * w[c]) - x[c] * k;
}

static void cpu_rmsnorm_backward(void *dinp_, float *dw, const void *dout_, const void *inp_, const void *w_,
                                 const float *rstd, int N, int C, int accumulate) {
    /* dinp (N,C) +=, dw (C), dout (N,C), inp (N,C), w (C), rstd (N) */
    float *dinp = dinp_;
    const float *dout = dout_, *inp = inp_, *w = w_;
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int i = 0; i < N; i++)
            cpu_rms_group_backward(dinp + (size_t)i * C, dout + (size_t)i * C, inp + (size_t)i * C, w,
                                   rstd[i], C, 1);
        /* dw by channel ranges, rows in order (as layernorm's). */
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        int c0 = (int)((long)C * id / nt), c1 = (int)((long)C * (id + 1) / nt);
        if (!accumulate)
            for (int c = c0; c < c1; c++) dw[c] = 0.0f;
        for (int i = 0; i < N; i++) {
            const float *x = inp + (size_t)i * C, *d = dout + (size_t)i * C;
            float r = rstd[i];
            for (int c = c0; c < c1; c++) dw[c] += d[c] * x[c] * r;
        }
    }
}

/* ---------------------------------------------------------------------------
 * RoPE, rotate-half, in place on the q and k heads of qkv */

/* sign +1 rotates by the angle (forward), -1 by its negative (backward). */
static void cpu_rope_apply(float *qkv, const float *rope, const AttnShape *sh, int pos0, float sign) {
    /* qkv (N, QKVW), rope (Tmax, 2, HD/2) */
    int N = sh->B * sh->T, HD = sh->HD, H2 = sh->HD / 2, heads = sh->NH + sh->NKV;
    int ld = attn_qkv_width(sh);
    #pragma omp parallel for schedule(static)
    for (int r = 0; r < N; r++) {
        const float *cs = rope + (size_t)(pos0 + r % sh->T - (sh->doc ? sh->doc[r] : 0)) * 2 * H2, *sn = cs + H2;
        float *row = qkv + (size_t)r * ld;
        for (int h = 0; h < heads; h++) {
            float *x = row + (size_t)h * HD;
            #pragma omp simd
            for (int i = 0; i < H2; i++) {
                float a = x[i], b = x[i + H2], c = cs[i], s = sign * sn[i];
                x[i] = a * c - b * s;
                x[i + H2] = b * c + a * s;
            }
        }
    }
}

static void cpu_rope_forward(void *qkv, const float *rope, const AttnShape *sh, int pos0) {
    cpu_rope_apply(qkv, rope, sh, pos0, 1.0f);
}

/* The rotation is orthogonal: its transpose, the gradient map, is the inverse rotation. */
static void cpu_rope_backward(void *dqkv, const float *rope, const AttnShape *sh, int pos0) {
    cpu_rope_apply(dqkv, rope, sh, pos0, -1.0f);
}

/* ---------------------------------------------------------------------------
 * QK-norm: RMSNorm groups over the first (NH + NKV) HD columns of each qkv row */

/* Group g of a row: its first column, its size and its weight offset;
 * q groups come first (NH of them per head, else one). */
typedef struct {
    int G, GQ, HD, NH, NKV, per_head;
} CpuQkGroups;

static CpuQkGroups cpu_qk_groups(const AttnShape *sh, int per_head) {
    CpuQkGroups q = {per_head ? sh->NH + sh->NKV : 2, per_head ? sh->NH : 1, sh->HD, sh->NH, sh->NKV,
                     per_head};
    return q;
}
static int cpu_qk_start(const CpuQkGroups *q, int g) {
    return q->per_head ? g * q->HD : g ? q->NH * q->HD : 0;
}
static int cpu_qk_size(const CpuQkGroups *q, int g) {
    return q->per_head ? q->HD : g ? q->NKV * q->HD : q->NH * q->HD;
}

static void cpu_qknorm_forward(void *qkv_, void *qk_in_, float *rstd, const void *qw_, const void *kw_,
                               const AttnShape *sh, int per_head, float eps) {
    /* qkv (N, QKVW) in place, qk_in (N, (NH+NKV) HD), rstd (N, G), qw, kw (HD or NH HD, NKV HD) */
    float *qkv = qkv_, *qk_in = qk_in_;
    const float *qw = qw_, *kw = kw_;
    CpuQkGroups q = cpu_qk_groups(sh, per_head);
    int N = sh->B * sh->T, ld = attn_qkv_width(sh), W = (sh->NH + sh->NKV) * sh->HD;
    #pragma omp parallel for schedule(static)
    for (int i = 0; i < N; i++) {
        float *row = qkv + (size_t)i * ld, *saved = qk_in + (size_t)i * W;
        memcpy(saved, row, (size_t)W * sizeof(float));
        for (int g = 0; g < q.G; g++) {
            int n = cpu_qk_size(&q, g);
            float *x = row + cpu_qk_start(&q, g);
            const float *w = g < q.GQ ? qw : kw;
            float s = 0.0f;
            #pragma omp simd reduction(+ : s)
            for (int c = 0; c < n; c++) s += x[c] * x[c];
            float r = 1.0f / sqrtf(s / n + eps);
            for (int c = 0; c < n; c++) x[c] = x[c] * r * w[c];
            rstd[(size_t)i * q.G + g] = r;
        }
    }
}

static void cpu_qknorm_backward(void *dqkv_, float *dqw, float *dkw, const void *qk_in_, const void *qw_,
                                const void *kw_, const float *rstd, const AttnShape *sh, int per_head,
                                int accumulate) {
    /* dqkv (N, QKVW) in place, dqw, dkw (as qw, kw), qk_in (N, (NH+NKV) HD), rstd (N, G) */
    float *dqkv = dqkv_;
    const float *qk_in = qk_in_, *qw = qw_, *kw = kw_;
    CpuQkGroups q = cpu_qk_groups(sh, per_head);
    int N = sh->B * sh->T, ld = attn_qkv_width(sh), W = (sh->NH + sh->NKV) * sh->HD;
    int WQ = cpu_qk_size(&q, 0), WK = per_head ? sh->HD : cpu_qk_size(&q, 1);
    /* Weight gradients first (they read dqkv before it is overwritten): threads
     * own ranges of the joined [dqw | dkw], each summed in (row, group) order. */
    #pragma omp parallel
    {
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        int j0 = (int)((long)(WQ + WK) * id / nt), j1 = (int)((long)(WQ + WK) * (id + 1) / nt);
        for (int j = j0; j < j1; j++) {
            float *dw = j < WQ ? dqw + j : dkw + (j - WQ);
            if (!accumulate) *dw = 0.0f;
        }
        for (int i = 0; i < N; i++) {
            const float *d = dqkv + (size_t)i * ld, *x = qk_in + (size_t)i * W, *r = rstd + (size_t)i * q.G;
            for (int g = 0; g < q.G; g++) {
                int isq = g < q.GQ, base = isq ? 0 : WQ, n = cpu_qk_size(&q, g), st = cpu_qk_start(&q, g);
                float *dw = isq ? dqw : dkw;
                int c0 = j0 - base > 0 ? j0 - base : 0, c1 = j1 - base < n ? j1 - base : n;
                for (int c = c0; c < c1; c++) dw[c] += d[st + c] * x[st + c] * r[g];
            }
        }
    }
    #pragma omp parallel for schedule(static)
    for (int i = 0; i < N; i++) {
        float *d = dqkv + (size_t)i * ld;
        const float *x = qk_in + (size_t)i * W;
        for (int g = 0; g < q.G; g++) {
            int st = cpu_qk_start(&q, g);
            cpu_rms_group_backward(d + st, d + st, x + st, g < q.GQ ? qw : kw, rstd[(size_t)i * q.G + g],
                                   cpu_qk_size(&q, g), 0);
        }
    }
}

/* ---------------------------------------------------------------------------
 * Matrix products (row-major; w is (OC,C) so the forward is inp @ w^T) */

static void cpu_matmul_forward(void *out_, const void *inp_, const void *w_, const void *bias_,
                               int N, int C, int OC) {
    /* out (N,OC), inp (N,C), w (OC,C), bias (OC) or NULL */
    float *out = out_;
    const float *inp = inp_, *w = w_, *bias = bias_;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, w, C, 0.0f,
                out, OC);
    if (bias) {
        #pragma omp parallel for schedule(static)
        for (int i = 0; i < N; i++) {
            float *o = out + (size_t)i * OC;
            for (int j = 0; j < OC; j++) o[j] += bias[j];
        }
    }
}

static void cpu_matmul_backward(void *dinp_, float *dw, float *dbias, const void *dout_,
                                const void *inp_, const void *w_, int N, int C, int OC,
                                int accumulate) {
    /* dinp (N,C) or NULL, dw (OC,C) or NULL, dbias (OC) or NULL, dout (N,OC), inp (N,C), w (OC,C) */
    float *dinp = dinp_;
    const float *dout = dout_, *inp = inp_, *w = w_;
    if (dinp)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, OC, w, C,
                    0.0f, dinp, C);
    /* beta = 0 ignores what dw held (even NaN), per the BLAS definition. */
    if (dw)
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, inp, C,
                    accumulate ? 1.0f : 0.0f, dw, C);
    if (dbias) {
        /* Column sums by channel range: rows in order, vectorised across columns. */
        #pragma omp parallel
        {
            int nt = omp_get_num_threads(), id = omp_get_thread_num();
            int j0 = (int)((long)OC * id / nt), j1 = (int)((long)OC * (id + 1) / nt);
            if (!accumulate)
                for (int j = j0; j < j1; j++) dbias[j] = 0.0f;
            for (int i = 0; i < N; i++) {
                const float *d = dout + (size_t)i * OC;
                for (int j = j0; j < j1; j++) dbias[j] += d[j];
            }
        }
    }
}

/* fp8 (backend.h): the host reference itself, on fp32 activations. */
static void cpu_fp8_amax(float *amax, const void *x, int rows, int cols, int axis) {
    fp8_amax_f32(amax, x, rows, cols, axis);
}

static void cpu_fp8_qdq(void *y, const void *x, const float *amax, int P, int rows, int cols, int axis, int fmt,
                        int pow2) {
    fp8_qdq_f32(y, x, amax, P, rows, cols, axis, (Fp8Format)fmt, pow2);
}

/* ---------------------------------------------------------------------------
 * Causal attention, one (b, h) pair per task, in blocks of query rows: the
 * scores of a block against the keys it may see are one sgemm, so are P @ V
 * and the four products of the backward pass (5x the loop version's speed at
 * T = 256). Scores are recomputed in the backward pass from the saved
 * log-sum-exp, so memory is a (block, T) scratch per thread rather than
 * (B, NH, T, T). The sgemm calls run inside an OpenMP region, where the
 * OpenMP build of OpenBLAS stays single-threaded: the result does not depend
 * on the thread count. */

#define CPU_ATT_BLOCK 64 /* query rows per block: ~25% of the block is masked at T = 256 */

/* Grow-only scratch for the attention blocks (cpu_scratch, freed by
 * shutdown), kept for the whole run so the step does not allocate; ops are
 * called from one host thread at a time. */
static float *cpu_scratch_get(size_t floats) {
    if (floats > cpu_scratch_floats) {
        cpu_free(cpu_scratch);
        cpu_scratch = cpu_alloc(floats * sizeof(float)); /* exits on failure */
        cpu_scratch_floats = floats;
    }
    return cpu_scratch;
}

static inline float cpu_dot(const float *a, const float *b, int n) {
    float s = 0.0f;
    #pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* The first key row t of sequence b sees: its document's start (backend.h's
 * AttnShape.doc), or 0. doc is nondecreasing along a sequence, so a block
 * of rows r0.. sees no key before first_key(r0): the keys before it are
 * skipped whole. */
static inline int att_first_key(const int32_t *doc, int b, int T, int t) {
    return doc ? doc[(size_t)b * T + t] : 0;
}

static void cpu_attention_forward(void *out_, float *lse, const void *qkv_, const AttnShape *sh) {
    /* out (B*T, NH*HD), lse (B,NH,T), qkv (B*T, (NH+2NKV)*HD), doc (B,T) or NULL */
    float *out = out_;
    const float *qkv = qkv_;
    int B = sh->B, T = sh->T, NH = sh->NH, hs = sh->HD, group = sh->NH / sh->NKV;
    int ld = attn_qkv_width(sh), OC = NH * hs, TB = T < CPU_ATT_BLOCK ? T : CPU_ATT_BLOCK;
    float scale = 1.0f / sqrtf((float)hs);
    float *scratch = cpu_scratch_get((size_t)omp_get_max_threads() * TB * T);
    #pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++) {
            float *S = scratch + (size_t)omp_get_thread_num() * TB * T; /* (TB, T) */
            const float *row = qkv + (size_t)b * T * ld;
            const float *Q = row + h * hs, *K = row + OC + (h / group) * hs, *V = K + sh->NKV * hs;
            float *O = out + (size_t)b * T * OC + h * hs;
            float *L = lse + ((size_t)b * NH + h) * T;
            for (int r0 = 0; r0 < T; r0 += TB) {
                int nb = T - r0 < TB ? T - r0 : TB, r1 = r0 + nb; /* rows see keys [k0, r1) */
                int k0 = att_first_key(sh->doc, b, T, r0), w = r1 - k0;
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nb, w, hs, scale,
                            Q + (size_t)r0 * ld, ld, K + (size_t)k0 * ld, ld, 0.0f, S, w);
                for (int i = 0; i < nb; i++) {
                    float *p = S + (size_t)i * w;
                    int t = r0 + i, lo = att_first_key(sh->doc, b, T, t) - k0, hi = t - k0; /* keys [lo, hi] */
                    float mx = -INFINITY, sum = 0.0f;
                    #pragma omp simd reduction(max : mx)
                    for (int j = lo; j <= hi; j++) mx = p[j] > mx ? p[j] : mx;
                    #pragma omp simd reduction(+ : sum)
                    for (int j = lo; j <= hi; j++) {
                        p[j] = cpu_expf(p[j] - mx);
                        sum += p[j];
                    }
                    float inv = 1.0f / sum;
                    for (int j = lo; j <= hi; j++) p[j] *= inv;
                    for (int j = 0; j < lo; j++) p[j] = 0.0f;      /* another document */
                    for (int j = hi + 1; j < w; j++) p[j] = 0.0f;  /* causal mask */
                    L[t] = mx + logf(sum);
                }
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nb, hs, w, 1.0f, S, w,
                            V + (size_t)k0 * ld, ld, 0.0f, O + (size_t)r0 * OC, OC);
            }
        }
}

static void cpu_attention_backward(void *dqkv_, const void *dout_, const void *qkv_,
                                   const void *out_, const float *lse, const AttnShape *sh) {
    /* dqkv (B*T, (NH+2NKV)*HD) overwritten, dout (B*T, NH*HD), qkv (B*T, (NH+2NKV)*HD),
     * out (B*T, NH*HD), lse (B,NH,T), doc (B,T) or NULL */
    float *dqkv = dqkv_;
    const float *dout = dout_, *qkv = qkv_, *out = out_;
    int B = sh->B, T = sh->T, NH = sh->NH, NKV = sh->NKV, hs = sh->HD, group = NH / NKV;
    int ld = attn_qkv_width(sh), OC = NH * hs, TB = T < CPU_ATT_BLOCK ? T : CPU_ATT_BLOCK;
    float scale = 1.0f / sqrtf((float)hs);
    float *scratch = cpu_scratch_get((size_t)omp_get_max_threads() * 2 * TB * T);
    /* Each (b, kv head) task owns its dk, dv columns and the dq columns of
     * the query heads that read them: the "+=" over query heads and blocks
     * never races and sums in (head, block) order. */
    #pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++)
        for (int kh = 0; kh < NKV; kh++) {
            float *P = scratch + (size_t)omp_get_thread_num() * 2 * TB * T; /* (TB, T) */
            float *dS = P + (size_t)TB * T;                                    /* (TB, T) */
            size_t row = (size_t)b * T * ld;
            const float *K = qkv + row + OC + kh * hs, *V = K + NKV * hs;
            float *dK = dqkv + row + OC + kh * hs, *dV = dK + NKV * hs;
            for (int t = 0; t < T; t++) {
                memset(dK + (size_t)t * ld, 0, hs * sizeof(float));
                memset(dV + (size_t)t * ld, 0, hs * sizeof(float));
            }
            for (int h = kh * group; h < (kh + 1) * group; h++) {
                const float *Q = qkv + row + h * hs;
                float *dQ = dqkv + row + h * hs;
                const float *dO = dout + (size_t)b * T * OC + h * hs;
                const float *O = out + (size_t)b * T * OC + h * hs;
                const float *L = lse + ((size_t)b * NH + h) * T;
                for (int r0 = 0; r0 < T; r0 += TB) {
                    int nb = T - r0 < TB ? T - r0 : TB, r1 = r0 + nb;
                    int k0 = att_first_key(sh->doc, b, T, r0), w = r1 - k0; /* keys [k0, r1) */
                    const float *Qb = Q + (size_t)r0 * ld, *dOb = dO + (size_t)r0 * OC;
                    const float *Kb = K + (size_t)k0 * ld, *Vb = V + (size_t)k0 * ld;
                    /* P = softmax(scale Q K^T) from lse; dS = dO V^T for now. */
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nb, w, hs, scale, Qb, ld, Kb,
                                ld, 0.0f, P, w);
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nb, w, hs, 1.0f, dOb, OC, Vb,
                                ld, 0.0f, dS, w);
                    for (int i = 0; i < nb; i++) {
                        int t = r0 + i, lo = att_first_key(sh->doc, b, T, t) - k0, hi = t - k0;
                        float *p = P + (size_t)i * w, *ds = dS + (size_t)i * w;
                        float D = cpu_dot(dO + (size_t)t * OC, O + (size_t)t * OC, hs);
                        float lt = L[t];
                        /* ds = p (dp - D), with the 1/sqrt(hs) of both dq and dk folded in. */
                        #pragma omp simd
                        for (int j = lo; j <= hi; j++) {
                            p[j] = cpu_expf(p[j] - lt);
                            ds[j] = p[j] * (ds[j] - D) * scale;
                        }
                        for (int j = 0; j < lo; j++) p[j] = ds[j] = 0.0f;      /* another document */
                        for (int j = hi + 1; j < w; j++) p[j] = ds[j] = 0.0f;  /* causal mask */
                    }
                    /* dQ_b = dS K;  dK += dS^T Q_b;  dV += P^T dO_b */
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nb, hs, w, 1.0f, dS, w, Kb,
                                ld, 0.0f, dQ + (size_t)r0 * ld, ld);
                    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, w, hs, nb, 1.0f, dS, w, Qb,
                                ld, 1.0f, dK + (size_t)k0 * ld, ld);
                    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, w, hs, nb, 1.0f, P, w, dOb, OC,
                                1.0f, dV + (size_t)k0 * ld, ld);
                }
            }
        }
}

/* ---------------------------------------------------------------------------
 * Block attention (context parallelism, backend.h's AttnBlock): the same
 * blocked sgemm scheme as above, with the causal mask at global positions.
 * Keys sit at contiguous positions, so the keys a query sees are a prefix of
 * the block: [0, att_visible(s, i)). */

static inline int att_visible(const AttnBlock *s, int i) {
    long v = (long)s->q_pos + i - s->k_pos + 1;
    return v < 0 ? 0 : v > s->Tk ? s->Tk : (int)v;
}

/* The first key of the block that query i of sequence b may see: its
 * document's start (AttnBlock.q_doc) relative to the block, or 0. Queries
 * see [att_first(i), att_visible(i)); both ends are nondecreasing in i. */
static inline int att_first(const AttnBlock *s, int b, int i) {
    if (!s->q_doc) return 0;
    long f = (long)s->q_doc[(size_t)b * s->Tq + i] - s->k_pos;
    return f < 0 ? 0 : f > s->Tk ? s->Tk : (int)f;
}

/* out, lse of one row merged with a block's (ob, lb): backend.h's formula;
 * lse -inf (no key seen yet) on either side takes the other. */
static void att_merge_row(float *o, float *l, const float *ob, float lb, int hs) {
    if (lb == -INFINITY) return;
    if (*l == -INFINITY) {
        memcpy(o, ob, (size_t)hs * sizeof(float));
        *l = lb;
        return;
    }
    float m = *l > lb ? *l : lb;
    float ln = m + logf(expf(*l - m) + expf(lb - m));
    float a = expf(*l - ln), c = expf(lb - ln);
    for (int d = 0; d < hs; d++) o[d] = a * o[d] + c * ob[d];
    *l = ln;
}

static void cpu_attention_block_forward(void *out_, float *lse, const void *q_, const void *k_, const void *v_,
                                        const AttnBlock *s, int merge) {
    /* out (B Tq, NH HD), lse (B, NH, Tq), q (B Tq rows, ld q_ld), k, v (B Tk rows, ld kv_ld), q_doc (B, Tq) or NULL */
    float *out = out_;
    const float *q = q_, *k = k_, *v = v_;
    int Tq = s->Tq, Tk = s->Tk, NH = s->NH, hs = s->HD, group = NH / s->NKV, OC = NH * hs;
    int TB = Tq < CPU_ATT_BLOCK ? Tq : CPU_ATT_BLOCK;
    size_t qld = (size_t)s->q_ld, kld = (size_t)s->kv_ld, per = (size_t)TB * Tk + (size_t)TB * hs;
    float scale = 1.0f / sqrtf((float)hs);
    float *scratch = cpu_scratch_get((size_t)omp_get_max_threads() * per);
    #pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < s->B; b++)
        for (int h = 0; h < NH; h++) {
            float *S = scratch + (size_t)omp_get_thread_num() * per, *Ob = S + (size_t)TB * Tk; /* (TB,Tk) (TB,hs) */
            const float *Q = q + (size_t)b * Tq * qld + h * hs, *K = k + (size_t)b * Tk * kld + (h / group) * hs;
            const float *V = v + (size_t)b * Tk * kld + (h / group) * hs;
            float *O = out + (size_t)b * Tq * OC + h * hs, *L = lse + ((size_t)b * NH + h) * Tq;
            for (int r0 = 0; r0 < Tq; r0 += TB) {
                /* the block's rows see keys [k0, kn) */
                int nb = Tq - r0 < TB ? Tq - r0 : TB, kn = att_visible(s, r0 + nb - 1), k0 = att_first(s, b, r0);
                if (kn <= k0) {
                    for (int i = 0; i < nb && !merge; i++) {
                        memset(O + (size_t)(r0 + i) * OC, 0, (size_t)hs * sizeof(float));
                        L[r0 + i] = -INFINITY;
                    }
                    continue;
                }
                int w = kn - k0;
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nb, w, hs, scale, Q + (size_t)r0 * qld, (int)qld,
                            K + (size_t)k0 * kld, (int)kld, 0.0f, S, w);
                float lb[CPU_ATT_BLOCK];
                for (int i = 0; i < nb; i++) {
                    float *p = S + (size_t)i * w;
                    int lo = att_first(s, b, r0 + i) - k0, nv = att_visible(s, r0 + i) - k0; /* keys [lo, nv) */
                    float mx = -INFINITY, sum = 0.0f;
                    for (int j = lo; j < nv; j++) mx = p[j] > mx ? p[j] : mx;
                    #pragma omp simd reduction(+ : sum)
                    for (int j = lo; j < nv; j++) {
                        p[j] = cpu_expf(p[j] - mx);
                        sum += p[j];
                    }
                    float inv = nv > lo ? 1.0f / sum : 0.0f;
                    for (int j = lo; j < nv; j++) p[j] *= inv;
                    for (int j = 0; j < lo && j < w; j++) p[j] = 0.0f;      /* another document */
                    for (int j = nv > lo ? nv : lo; j < w; j++) p[j] = 0.0f; /* causal mask */
                    lb[i] = nv > lo ? mx + logf(sum) : -INFINITY;
                }
                if (!merge) {
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nb, hs, w, 1.0f, S, w, V + (size_t)k0 * kld,
                                (int)kld, 0.0f, O + (size_t)r0 * OC, OC);
                    memcpy(L + r0, lb, (size_t)nb * sizeof(float));
                    continue;
                }
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nb, hs, w, 1.0f, S, w, V + (size_t)k0 * kld,
                            (int)kld, 0.0f, Ob, hs);
                for (int i = 0; i < nb; i++)
                    att_merge_row(O + (size_t)(r0 + i) * OC, L + r0 + i, Ob + (size_t)i * hs, lb[i], hs);
            }
        }
}

static void cpu_attention_block_backward(float *dq, float *dk, float *dv, const void *dout_, const void *q_,
                                         const void *k_, const void *v_, const void *out_, const float *lse,
                                         const AttnBlock *s) {
    /* dq += (rows as q), dk, dv += (rows as k); dout, out (B Tq, NH HD); lse (B, NH, Tq); q_doc (B, Tq) or NULL */
    const float *dout = dout_, *q = q_, *k = k_, *v = v_, *out = out_;
    int Tq = s->Tq, Tk = s->Tk, NH = s->NH, NKV = s->NKV, hs = s->HD, group = NH / NKV, OC = NH * hs;
    int TB = Tq < CPU_ATT_BLOCK ? Tq : CPU_ATT_BLOCK;
    size_t qld = (size_t)s->q_ld, kld = (size_t)s->kv_ld;
    float scale = 1.0f / sqrtf((float)hs);
    float *scratch = cpu_scratch_get((size_t)omp_get_max_threads() * 2 * TB * Tk);
    /* As cpu_attention_backward: each (b, kv head) task owns its dk, dv
     * columns and the dq columns of its query heads, so nothing races and
     * every sum runs in (head, query block) order. */
    #pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < s->B; b++)
        for (int kh = 0; kh < NKV; kh++) {
            float *P = scratch + (size_t)omp_get_thread_num() * 2 * TB * Tk, *dS = P + (size_t)TB * Tk; /* (TB,Tk) */
            const float *K = k + (size_t)b * Tk * kld + kh * hs, *V = v + (size_t)b * Tk * kld + kh * hs;
            float *dK = dk + (size_t)b * Tk * kld + kh * hs, *dV = dv + (size_t)b * Tk * kld + kh * hs;
            for (int h = kh * group; h < (kh + 1) * group; h++) {
                const float *Q = q + (size_t)b * Tq * qld + h * hs, *dO = dout + (size_t)b * Tq * OC + h * hs;
                const float *O = out + (size_t)b * Tq * OC + h * hs, *L = lse + ((size_t)b * NH + h) * Tq;
                float *dQ = dq + (size_t)b * Tq * qld + h * hs;
                for (int r0 = 0; r0 < Tq; r0 += TB) {
                    int nb = Tq - r0 < TB ? Tq - r0 : TB, kn = att_visible(s, r0 + nb - 1), k0 = att_first(s, b, r0);
                    if (kn <= k0) continue; /* these queries see none of the block */
                    int w = kn - k0;
                    const float *Qb = Q + (size_t)r0 * qld, *dOb = dO + (size_t)r0 * OC;
                    const float *Kb = K + (size_t)k0 * kld, *Vb = V + (size_t)k0 * kld;
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nb, w, hs, scale, Qb, (int)qld, Kb, (int)kld,
                                0.0f, P, w);
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nb, w, hs, 1.0f, dOb, OC, Vb, (int)kld, 0.0f,
                                dS, w);
                    for (int i = 0; i < nb; i++) {
                        int t = r0 + i, lo = att_first(s, b, t) - k0, nv = att_visible(s, t) - k0;
                        float *p = P + (size_t)i * w, *ds = dS + (size_t)i * w;
                        float D = cpu_dot(dO + (size_t)t * OC, O + (size_t)t * OC, hs), lt = L[t];
                        #pragma omp simd
                        for (int j = lo; j < nv; j++) {
                            p[j] = cpu_expf(p[j] - lt);
                            ds[j] = p[j] * (ds[j] - D) * scale;
                        }
                        for (int j = 0; j < lo && j < w; j++) p[j] = ds[j] = 0.0f;      /* another document */
                        for (int j = nv > lo ? nv : lo; j < w; j++) p[j] = ds[j] = 0.0f; /* causal mask */
                    }
                    /* dQ_b += dS K;  dK += dS^T Q_b;  dV += P^T dO_b */
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nb, hs, w, 1.0f, dS, w, Kb, (int)kld, 1.0f,
                                dQ + (size_t)r0 * qld, (int)qld);
                    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, w, hs, nb, 1.0f, dS, w, Qb, (int)qld, 1.0f,
                                dK + (size_t)k0 * kld, (int)kld);
                    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, w, hs, nb, 1.0f, P, w, dOb, OC, 1.0f,
                                dV + (size_t)k0 * kld, (int)kld);
                }
            }
        }
}

static void cpu_copy_2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t rows) {
    for (size_t r = 0; r < rows; r++) memmove((char *)dst + r * dpitch, (const char *)src + r * spitch, width);
}

/* ---------------------------------------------------------------------------
 * Elementwise */

static void cpu_gelu_forward(void *out_, const void *inp_, size_t n) {
    /* out (n), inp (n) */
    float *out = out_;
    const float *inp = inp_;
    #pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) {
        float x = inp[i];
        float u = CPU_GELU_SCALE * (x + 0.044715f * x * x * x);
        out[i] = 0.5f * x * (1.0f + cpu_tanhf(u));
    }
}

static void cpu_gelu_backward(void *dinp_, const void *inp_, const void *dout_, size_t n) {
    /* dinp (n) overwritten, inp (n), dout (n) */
    float *dinp = dinp_;
    const float *inp = inp_, *dout = dout_;
    #pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) {
        float x = inp[i];
        float u = CPU_GELU_SCALE * (x + 0.044715f * x * x * x);
        float th = cpu_tanhf(u);
        float sech2 = 1.0f - th * th;
        float du = CPU_GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
        dinp[i] = dout[i] * (0.5f * (1.0f + th) + 0.5f * x * sech2 * du);
    }
}

static void cpu_add(float *out, const float *a, const float *b, size_t n) {
    /* out (n), a (n), b (n) */
    #pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

/* The residual stream is fp32 here: the same add. */
static void cpu_residual_forward(void *out, const void *a, const void *b, size_t n) {
    cpu_add(out, a, b, n);
}

/* ---------------------------------------------------------------------------
 * SwiGLU: h rows are [gate (F) | up (F)] */

static void cpu_swiglu_forward(void *out_, const void *h_, int N, int F) {
    /* out (N,F), h (N,2F) */
    float *out = out_;
    const float *h = h_;
    #pragma omp parallel for schedule(static)
    for (int i = 0; i < N; i++) {
        const float *g = h + (size_t)i * 2 * F, *u = g + F;
        float *o = out + (size_t)i * F;
        #pragma omp simd
        for (int j = 0; j < F; j++) o[j] = g[j] / (1.0f + cpu_expf(-g[j])) * u[j];
    }
}

static void cpu_swiglu_backward(void *dh_, const void *dout_, const void *h_, int N, int F) {
    /* dh (N,2F) overwritten, dout (N,F), h (N,2F) */
    float *dh = dh_;
    const float *dout = dout_, *h = h_;
    #pragma omp parallel for schedule(static)
    for (int i = 0; i < N; i++) {
        const float *g = h + (size_t)i * 2 * F, *u = g + F, *d = dout + (size_t)i * F;
        float *dg = dh + (size_t)i * 2 * F, *du = dg + F;
        #pragma omp simd
        for (int j = 0; j < F; j++) {
            float sg = 1.0f / (1.0f + cpu_expf(-g[j])), silu = g[j] * sg;
            /* silu' = sg (1 + g (1 - sg)) */
            dg[j] = d[j] * u[j] * sg * (1.0f + g[j] * (1.0f - sg));
            du[j] = d[j] * silu;
        }
    }
}

/* ---------------------------------------------------------------------------
 * Mixture of experts: routing, the permutation and its inverse. Index work is
 * serial (O(N K)); row copies and sums are parallel over the rows they write. */

/* Max and log-sum-exp of one row of router logits, the sum in expert order. */
static float cpu_row_lse(const float *x, int E, float *mx_out) {
    float mx = -INFINITY, s = 0.0f;
    for (int e = 0; e < E; e++) mx = x[e] > mx ? x[e] : mx;
    for (int e = 0; e < E; e++) s += cpu_expf(x[e] - mx);
    if (mx_out) *mx_out = mx;
    return mx + logf(s);
}

static void cpu_moe_route(int32_t *topk, float *gates, float *probs, float *stats, const void *logits_,
                          const float *bias, int N, int S, int E, int K, int sigmoid, int norm_topk) {
    /* topk (N,K), gates (N,K), probs (N,E), stats (N/S, E+1), logits (N,E), bias (E) or NULL */
    const float *logits = logits_;
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < N; t++) {
        const float *x = logits + (size_t)t * E;
        float *p = probs + (size_t)t * E;
        if (sigmoid) {
            for (int e = 0; e < E; e++) p[e] = 1.0f / (1.0f + cpu_expf(-x[e]));
        } else {
            float lse = cpu_row_lse(x, E, NULL);
            for (int e = 0; e < E; e++) p[e] = cpu_expf(x[e] - lse);
        }
        /* The k-th pick is the best expert ranked after the (k-1)-th in the
         * order (score descending, index ascending): K passes, no mask. */
        int32_t *sel = topk + (size_t)t * K;
        float *gt = gates + (size_t)t * K, prev_s = INFINITY, sum = 0.0f;
        int prev_e = -1;
        for (int k = 0; k < K; k++) {
            int best = -1;
            float bs = -INFINITY;
            for (int e = 0; e < E; e++) {
                float s = p[e] + (bias ? bias[e] : 0.0f);
                int after = s < prev_s || (s == prev_s && e > prev_e);
                if (after && (best < 0 || s > bs)) best = e, bs = s;
            }
            if (best < 0) best = k; /* only NaN scores left: stay in bounds (the loss is NaN anyway) */
            sel[k] = best;
            gt[k] = p[best];
            sum += p[best];
            prev_s = bs, prev_e = best;
        }
        if (norm_topk)
            for (int k = 0; k < K; k++) gt[k] /= sum;
    }
    /* Statistics by ownership of (sequence, [0, E]): each a sum in row
     * order; index E recomputes the rows' lse rather than keep a buffer for it. */
    #pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < N / S; b++)
        for (int e = 0; e <= E; e++) {
            float s = 0.0f;
            if (e < E)
                for (int t = b * S; t < (b + 1) * S; t++) s += probs[(size_t)t * E + e];
            else
                for (int t = b * S; t < (b + 1) * S; t++) {
                    float l = cpu_row_lse(logits + (size_t)t * E, E, NULL);
                    s += l * l;
                }
            stats[(size_t)b * (E + 1) + e] = s;
        }
}

/* The most slots sequence b keeps for expert e: its caps entry, else cap (<= 0: all). */
static int moe_limit(const int32_t *caps, int cap, int b, int E, int e) {
    if (caps) return caps[(size_t)b * E + e];
    return cap > 0 ? cap : INT32_MAX;
}

static void moe_dispatch_impl(int32_t *offsets, int32_t *row_of, int32_t *src, int32_t *counts,
                              const int32_t *topk, int N, int S, int E, int K, int cap, const int32_t *caps) {
    /* offsets (E+1), row_of (N,K), src (N K), counts (N/S, E), topk (N,K), caps (N/S, E) or NULL */
    int nseq = N / S;
    for (int i = 0; i < nseq * E; i++) counts[i] = 0;
    for (int i = 0; i < N * K; i++) counts[(size_t)(i / K / S) * E + topk[i]]++;
    /* each expert's rows: the kept slots of every sequence, in token order */
    offsets[0] = 0;
    for (int e = 0; e < E; e++) {
        int kept = 0;
        for (int b = 0; b < nseq; b++) {
            int c = counts[(size_t)b * E + e], lim = moe_limit(caps, cap, b, E, e);
            kept += c > lim ? lim : c;
        }
        offsets[e + 1] = offsets[e] + kept;
    }
    /* cursor per expert over the whole micro-batch, taken per sequence */
    int *cursor = (int *)cpu_scratch_get(2 * (size_t)E), *in_seq = cursor + E; /* int-sized floats */
    for (int e = 0; e < E; e++) cursor[e] = 0;
    for (int b = 0; b < nseq; b++) {
        for (int e = 0; e < E; e++) in_seq[e] = 0;
        for (int i = b * S * K; i < (b + 1) * S * K; i++) {
            int e = topk[i], j = in_seq[e]++;
            if (j >= moe_limit(caps, cap, b, E, e)) {
                row_of[i] = -1;
            } else {
                int r = offsets[e] + cursor[e]++;
                row_of[i] = r;
                src[r] = i / K;
            }
        }
    }
}

static void cpu_moe_dispatch(int32_t *offsets, int32_t *row_of, int32_t *src, int32_t *counts,
                             const int32_t *topk, int N, int S, int E, int K, int cap) {
    moe_dispatch_impl(offsets, row_of, src, counts, topk, N, S, E, K, cap, NULL);
}

static void cpu_moe_dispatch_capped(int32_t *offsets, int32_t *row_of, int32_t *src, int32_t *counts,
                                    const int32_t *topk, int N, int S, int E, int K, const int32_t *caps) {
    moe_dispatch_impl(offsets, row_of, src, counts, topk, N, S, E, K, 0, caps);
}

static void cpu_moe_gather(void *xp_, const void *x_, const int32_t *src, int R, int C) {
    /* xp (R,C), x (N,C), src (R) */
    float *xp = xp_;
    const float *x = x_;
    #pragma omp parallel for schedule(static)
    for (int r = 0; r < R; r++) memcpy(xp + (size_t)r * C, x + (size_t)src[r] * C, (size_t)C * sizeof(float));
}

static void cpu_moe_gather_backward(void *dx_, const void *dxp_, const int32_t *row_of, int N, int K, int C) {
    /* dx (N,C) +=, dxp (R,C), row_of (N,K) */
    float *dx = dx_;
    const float *dxp = dxp_;
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < N; t++) {
        float *d = dx + (size_t)t * C;
        for (int k = 0; k < K; k++) {
            int r = row_of[(size_t)t * K + k];
            if (r < 0) continue;
            const float *s = dxp + (size_t)r * C;
            for (int c = 0; c < C; c++) d[c] += s[c];
        }
    }
}

static void cpu_moe_combine(void *out_, const void *yp_, const float *gates, const int32_t *row_of, int N,
                            int K, int C) {
    /* out (N,C), yp (R,C), gates (N,K), row_of (N,K) */
    float *out = out_;
    const float *yp = yp_;
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < N; t++) {
        float *o = out + (size_t)t * C;
        for (int c = 0; c < C; c++) o[c] = 0.0f;
        for (int k = 0; k < K; k++) {
            int r = row_of[(size_t)t * K + k];
            if (r < 0) continue;
            const float *y = yp + (size_t)r * C;
            float g = gates[(size_t)t * K + k];
            for (int c = 0; c < C; c++) o[c] += g * y[c];
        }
    }
}

static void cpu_moe_combine_backward(void *dyp_, float *dgates, const void *dout_, const void *yp_,
                                     const float *gates, const int32_t *row_of, int N, int K, int C) {
    /* dyp (R,C), dgates (N,K), dout (N,C), yp (R,C), gates (N,K), row_of (N,K) */
    float *dyp = dyp_;
    const float *dout = dout_, *yp = yp_;
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < N; t++) {
        const float *d = dout + (size_t)t * C;
        for (int k = 0; k < K; k++) {
            size_t s = (size_t)t * K + k;
            int r = row_of[s];
            if (r < 0) {
                dgates[s] = 0.0f;
                continue;
            }
            float *dy = dyp + (size_t)r * C, g = gates[s];
            for (int c = 0; c < C; c++) dy[c] = g * d[c];
            dgates[s] = cpu_dot(d, yp + (size_t)r * C, C);
        }
    }
}

static void cpu_moe_route_backward(void *dlogits_, const float *dgates, const float *probs, const int32_t *topk,
                                   const float *gates, const void *logits_, const float *aux, float z_coef,
                                   int N, int S, int E, int K, int sigmoid, int norm_topk) {
    /* dlogits (N,E), dgates (N,K), probs (N,E), topk (N,K), gates (N,K), logits (N,E),
     * aux (N/S, E) or NULL */
    float *dlogits = dlogits_;
    const float *logits = logits_;
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < N; t++) {
        const float *p = probs + (size_t)t * E, *dg = dgates + (size_t)t * K, *g = gates + (size_t)t * K;
        const int32_t *sel = topk + (size_t)t * K;
        float *a = dlogits + (size_t)t * E; /* dL/dprobs first, then dL/dlogits in place */
        const float *ax = aux ? aux + (size_t)(t / S) * E : NULL;
        for (int e = 0; e < E; e++) a[e] = ax ? ax[e] : 0.0f;
        if (norm_topk) {
            /* g_k = p_k / Z, Z = sum_j p_j: dL/dp_j = (dg_j - sum_k dg_k g_k) / Z */
            float Z = 0.0f, dgg = 0.0f;
            for (int k = 0; k < K; k++) Z += p[sel[k]], dgg += dg[k] * g[k];
            for (int k = 0; k < K; k++) a[sel[k]] += (dg[k] - dgg) / Z;
        } else {
            for (int k = 0; k < K; k++) a[sel[k]] += dg[k];
        }
        if (sigmoid) {
            for (int e = 0; e < E; e++) a[e] *= p[e] * (1.0f - p[e]);
        } else {
            float ap = 0.0f;
            for (int e = 0; e < E; e++) ap += a[e] * p[e];
            for (int e = 0; e < E; e++) a[e] = p[e] * (a[e] - ap);
        }
        /* z-loss z_coef mean_t lse_t^2: d/dlogit_e = z_coef 2 lse softmax_e / N.
         * It penalises the logits' size, so with a sigmoid router too it uses
         * the row's softmax and lse, not the sigmoid probs. */
        if (z_coef != 0.0f) {
            const float *x = logits + (size_t)t * E;
            float lse = cpu_row_lse(x, E, NULL), k2 = z_coef * 2.0f * lse / N;
            for (int e = 0; e < E; e++) a[e] += k2 * cpu_expf(x[e] - lse);
        }
    }
}

/* ---------------------------------------------------------------------------
 * Softmax + cross-entropy, fused */

static void cpu_crossentropy_forward(void *logits_, float *losses, const int32_t *targets, int N,
                                     int V, int Vp, float dloss) {
    /* logits (N,Vp) -> dlogits in place if dloss != 0, losses (N), targets (N) */
    float *logits = logits_;
    #pragma omp parallel for schedule(static)
    for (int i = 0; i < N; i++) {
        float *x = logits + (size_t)i * Vp;
        float mx = -INFINITY;
        #pragma omp simd reduction(max : mx)
        for (int j = 0; j < V; j++) mx = x[j] > mx ? x[j] : mx;
        int tg = targets[i];
        float xt = x[tg]; /* kept: the loop below may overwrite it */
        /* Float partial sums in SIMD lanes: ~V/8 terms each, relative error
         * far below what a loss of a few nats can show. */
        float s = 0.0f;
        if (dloss != 0.0f) {
            #pragma omp simd reduction(+ : s)
            for (int j = 0; j < V; j++) {
                x[j] = cpu_expf(x[j] - mx);
                s += x[j];
            }
        } else {
            #pragma omp simd reduction(+ : s)
            for (int j = 0; j < V; j++) s += cpu_expf(x[j] - mx);
        }
        losses[i] = mx + logf(s) - xt;
        if (dloss != 0.0f) {
            /* x holds exp(logit - max): dlogits = (softmax - onehot) * dloss. */
            float k = dloss / s;
            for (int j = 0; j < V; j++) x[j] *= k;
            x[tg] -= dloss;
            for (int j = V; j < Vp; j++) x[j] = 0.0f;
        }
    }
}

static void cpu_xent_partial(float *stats, const void *logits_, const int32_t *targets, int N, int V, int Vp) {
    /* stats (N,3) = [max, sum exp(x - max), target logit or 0]; logits (N,Vp), targets (N) local or < 0 */
    const float *logits = logits_;
    #pragma omp parallel for schedule(static)
    for (int i = 0; i < N; i++) {
        const float *x = logits + (size_t)i * Vp;
        float mx = -INFINITY, s = 0.0f;
        #pragma omp simd reduction(max : mx)
        for (int j = 0; j < V; j++) mx = x[j] > mx ? x[j] : mx;
        #pragma omp simd reduction(+ : s)
        for (int j = 0; j < V; j++) s += cpu_expf(x[j] - mx);
        float *st = stats + (size_t)i * 3;
        st[0] = mx, st[1] = s, st[2] = targets[i] >= 0 ? x[targets[i]] : 0.0f;
    }
}

/* The global max and sum of exponentials of row i from every rank's stats,
 * in rank order (so every rank computes the same). */
static void xent_combine(const float *stats_all, int P, int N, int i, float *M, float *S, float *xt) {
    float mx = -INFINITY, s = 0.0f, t = 0.0f;
    for (int p = 0; p < P; p++) mx = fmaxf(mx, stats_all[((size_t)p * N + i) * 3]);
    for (int p = 0; p < P; p++) {
        const float *st = stats_all + ((size_t)p * N + i) * 3;
        if (st[1] > 0.0f) s += st[1] * cpu_expf(st[0] - mx);
        t += st[2];
    }
    *M = mx, *S = s, *xt = t;
}

static void cpu_xent_finish(void *logits_, float *losses, const float *stats_all, int P, const int32_t *targets,
                            int N, int V, int Vp, float dloss) {
    /* logits (N,Vp) -> dlogits in place if dloss != 0; losses (N); stats_all (P,N,3) */
    float *logits = logits_;
    #pragma omp parallel for schedule(static)
    for (int i = 0; i < N; i++) {
        float mx, s, xt;
        xent_combine(stats_all, P, N, i, &mx, &s, &xt);
        losses[i] = mx + logf(s) - xt;
        if (dloss == 0.0f) continue;
        float *x = logits + (size_t)i * Vp, k = dloss / s;
        for (int j = 0; j < V; j++) x[j] = cpu_expf(x[j] - mx) * k;
        if (targets[i] >= 0) x[targets[i]] -= dloss;
        for (int j = V; j < Vp; j++) x[j] = 0.0f;
    }
}

/* ---------------------------------------------------------------------------
 * Optimizer and reductions */

/* AdamW on elements [i0, i1). GCC will not vectorise sqrtf without
 * -fno-math-errno (it guards each call with an errno branch), and the scalar
 * loop, with its three divisions and a square root per element, takes ~3x the
 * memory time over 124M parameters. So with AVX the body runs 8 wide on
 * intrinsics; every operation is IEEE-exact (mul, add, div, sqrt, no FMA),
 * in the same order as the scalar tail, so both give the same bits. */
static void cpu_adamw_range(float *params, const float *grads, float *m, float *v, size_t i0,
                            size_t i1, float lr, float beta1, float beta2, float eps, float wd,
                            float grad_scale, float bc1, float bc2) {
    /* params, grads, m, v: elements [i0, i1) */
    size_t i = i0;
#ifdef __AVX__
    const __m256 vb1 = _mm256_set1_ps(beta1), vb1c = _mm256_set1_ps(1.0f - beta1);
    const __m256 vb2 = _mm256_set1_ps(beta2), vb2c = _mm256_set1_ps(1.0f - beta2);
    const __m256 vgs = _mm256_set1_ps(grad_scale), vlr = _mm256_set1_ps(lr);
    const __m256 veps = _mm256_set1_ps(eps), vwd = _mm256_set1_ps(wd);
    const __m256 vbc1 = _mm256_set1_ps(bc1), vbc2 = _mm256_set1_ps(bc2);
    for (; i + 8 <= i1; i += 8) {
        __m256 g = _mm256_mul_ps(_mm256_loadu_ps(grads + i), vgs);
        __m256 mi = _mm256_add_ps(_mm256_mul_ps(vb1, _mm256_loadu_ps(m + i)), _mm256_mul_ps(vb1c, g));
        __m256 vi = _mm256_add_ps(_mm256_mul_ps(vb2, _mm256_loadu_ps(v + i)),
                                  _mm256_mul_ps(_mm256_mul_ps(vb2c, g), g));
        _mm256_storeu_ps(m + i, mi);
        _mm256_storeu_ps(v + i, vi);
        __m256 mhat = _mm256_div_ps(mi, vbc1), vhat = _mm256_div_ps(vi, vbc2);
        __m256 p = _mm256_loadu_ps(params + i);
        __m256 upd = _mm256_add_ps(_mm256_div_ps(mhat, _mm256_add_ps(_mm256_sqrt_ps(vhat), veps)),
                                   _mm256_mul_ps(vwd, p));
        _mm256_storeu_ps(params + i, _mm256_sub_ps(p, _mm256_mul_ps(vlr, upd)));
    }
#endif
    for (; i < i1; i++) {
        float g = grads[i] * grad_scale;
        float mi = beta1 * m[i] + (1.0f - beta1) * g;
        float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        float mhat = mi / bc1, vhat = vi / bc2;
        params[i] -= lr * (mhat / (sqrtf(vhat) + eps) + wd * params[i]);
    }
}

/* The step's device scalars (backend.h: st NULL, or its scale and skip),
 * shared by the updates: 0 when the update must leave everything as it is. */
static int cpu_step_scale(const StepScalars *st, float *grad_scale) {
    if (!st) return 1;
    if (st->skip) return 0;
    *grad_scale = st->scale;
    return 1;
}

/* The compute copy (backend.h copy): act is fp32 here, so a copy of the new
 * parameters (a test backend with bf16 act wraps the updates instead). */
static void cpu_update_copy(void *copy, const float *params, size_t n) {
    if (copy && copy != (const void *)params) cpu_memcpy(copy, params, n * sizeof(float));
}

static void cpu_adamw_update(float *params, const float *grads, float *m, float *v, size_t n,
                             float lr, float beta1, float beta2, float eps, float weight_decay,
                             float grad_scale, int t, const StepScalars *st, void *copy) {
    /* params, grads, m, v (n) */
    if (!cpu_step_scale(st, &grad_scale)) return;
    /* Bias corrections once, in double, for step t (1-based). */
    float bc1 = (float)(1.0 - pow((double)beta1, t));
    float bc2 = (float)(1.0 - pow((double)beta2, t));
    #pragma omp parallel
    {
        size_t nt = (size_t)omp_get_num_threads(), id = (size_t)omp_get_thread_num();
        /* Static ranges, 16-float (64 B) aligned so threads never share a line. */
        size_t blocks = (n + 15) / 16;
        size_t i0 = blocks * id / nt * 16, i1 = blocks * (id + 1) / nt * 16;
        i0 = i0 < n ? i0 : n;
        i1 = i1 < n ? i1 : n;
        cpu_adamw_range(params, grads, m, v, i0, i1, lr, beta1, beta2, eps, weight_decay,
                        grad_scale, bc1, bc2);
    }
    cpu_update_copy(copy, params, n);
}

/* Lion (backend.h lion_update): a plain loop, which GCC vectorises (no
 * sqrt or division); each operation rounded on its own in the CUDA kernel's
 * order, so both give the same bits. */
static void cpu_lion_update(float *params, const float *grads, float *m, size_t n, float lr, float beta1,
                            float beta2, float weight_decay, float grad_scale, const StepScalars *st, void *copy) {
    /* params, grads, m (n) */
    if (!cpu_step_scale(st, &grad_scale)) return;
    const float b1c = 1.0f - beta1, b2c = 1.0f - beta2;
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        float g = grads[i] * grad_scale;
        float c = beta1 * m[i] + b1c * g;
        float s = (float)((c > 0.0f) - (c < 0.0f));
        float p = params[i];
        params[i] = p - lr * (s + weight_decay * p);
        m[i] = beta2 * m[i] + b2c * g;
    }
    cpu_update_copy(copy, params, n);
}

static void cpu_muon_momentum(float *u, float *m, const float *grads, size_t n, float momentum, float grad_scale) {
    /* u, m, grads (n) */
    const float mc = 1.0f - momentum;
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        float g = grads[i] * grad_scale;
        float mi = momentum * m[i] + mc * g;
        m[i] = mi;
        u[i] = mc * g + momentum * mi;
    }
}

/* Quintic Newton-Schulz (Keller Jordan's coefficients), fp32 through
 * OpenBLAS. The wide orientation (a = min(rows, cols) rows) keeps A = X X^T
 * at a x a, the cheaper Gram matrix. */
static void cpu_newton_schulz(float *x, int rows, int cols, int steps, float *work) {
    const float ca = 3.4445f, cb = -4.7750f, cc = 2.0315f;
    int tr = rows > cols, a = tr ? cols : rows, b = tr ? rows : cols;
    size_t ab = (size_t)a * b;
    float *X = work, *Y = work + ab, *A = Y + ab, *B = A + (size_t)a * a; /* X Y (a, b), A B (a, a) */
    double sq = 0.0;
    for (size_t i = 0; i < ab; i++) sq += (double)x[i] * x[i];
    float inv = (float)(1.0 / (sqrt(sq) + 1e-7));
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) X[tr ? (size_t)j * b + i : (size_t)i * b + j] = x[(size_t)i * cols + j] * inv;
    for (int k = 0; k < steps; k++) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, a, a, b, 1.0f, X, b, X, b, 0.0f, A, a);
        memcpy(B, A, (size_t)a * a * sizeof(float));
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, a, a, a, cc, A, a, A, a, cb, B, a);
        memcpy(Y, X, ab * sizeof(float));
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, a, b, a, 1.0f, B, a, X, b, ca, Y, b);
        float *t = X;
        X = Y, Y = t;
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) x[(size_t)i * cols + j] = X[tr ? (size_t)j * b + i : (size_t)i * b + j];
}

static void cpu_muon_apply(float *params, const float *o, size_t n, float lr, float scale, float weight_decay) {
    /* params, o (n) */
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) params[i] -= lr * (scale * o[i] + weight_decay * params[i]);
}

/* AdamW with bf16 moments (backend.h adamw_update_bf16): the scalar body of
 * cpu_adamw_range, each operation IEEE-rounded in the same order as the CUDA
 * kernel, and the stores through sround_bf16. Scalar only: the optimizer is
 * a small part of a CPU step, and the CPU is the reference here. */
static void cpu_adamw_update_bf16(float *params, const float *grads, uint16_t *m, uint16_t *v, size_t n,
                                  float lr, float beta1, float beta2, float eps, float weight_decay,
                                  float grad_scale, int t, uint64_t seed, uint64_t idx0, const StepScalars *st,
                                  void *copy) {
    /* params, grads (n) fp32; m, v (n) bf16 bits */
    if (!cpu_step_scale(st, &grad_scale)) return;
    float bc1 = (float)(1.0 - pow((double)beta1, t));
    float bc2 = (float)(1.0 - pow((double)beta2, t));
    const float b1c = 1.0f - beta1, b2c = 1.0f - beta2;
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        float g = grads[i] * grad_scale;
        float mi = beta1 * sround_f32(m[i]) + b1c * g;
        float vi = beta2 * sround_f32(v[i]) + b2c * g * g;
        uint64_t r = sround_hash(seed, (uint64_t)t, idx0 + i);
        m[i] = sround_bf16(mi, (uint32_t)r);
        v[i] = sround_bf16(vi, (uint32_t)(r >> 16));
        float mhat = mi / bc1, vhat = vi / bc2;
        params[i] -= lr * (mhat / (sqrtf(vhat) + eps) + weight_decay * params[i]);
    }
    cpu_update_copy(copy, params, n);
}

/* AdamW on bf16 parameters (backend.h adamw_update_p16): the scalar body
 * of cpu_adamw_update_bf16 with the parameter read from bf16 and stored
 * through sround_bf16 with bits 32..47 of the element's hash; the moments
 * fp32 or bf16 per state_bytes. The reference for the CUDA kernel. */
static void cpu_adamw_update_p16(uint16_t *params, const float *grads, void *m, void *v, size_t state_bytes,
                                 size_t n, float lr, float beta1, float beta2, float eps, float weight_decay,
                                 float grad_scale, int t, uint64_t seed, uint64_t idx0, const StepScalars *st) {
    /* params (n) bf16 bits; grads (n) fp32; m, v (n) fp32 or bf16 bits */
    if (!cpu_step_scale(st, &grad_scale)) return;
    float bc1 = (float)(1.0 - pow((double)beta1, t));
    float bc2 = (float)(1.0 - pow((double)beta2, t));
    const float b1c = 1.0f - beta1, b2c = 1.0f - beta2;
    float *mf = m, *vf = v;
    uint16_t *mh = m, *vh = v;
    int s16 = state_bytes == 2;
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        float g = grads[i] * grad_scale;
        float mi = beta1 * (s16 ? sround_f32(mh[i]) : mf[i]) + b1c * g;
        float vi = beta2 * (s16 ? sround_f32(vh[i]) : vf[i]) + b2c * g * g;
        uint64_t r = sround_hash(seed, (uint64_t)t, idx0 + i);
        if (s16) {
            mh[i] = sround_bf16(mi, (uint32_t)r);
            vh[i] = sround_bf16(vi, (uint32_t)(r >> 16));
        } else {
            mf[i] = mi;
            vf[i] = vi;
        }
        float mhat = mi / bc1, vhat = vi / bc2;
        float p = sround_f32(params[i]);
        p -= lr * (mhat / (sqrtf(vhat) + eps) + weight_decay * p);
        params[i] = sround_bf16(p, (uint32_t)(r >> 32));
    }
}

/* Fixed chunking independent of the thread count, partials summed in chunk
 * order: the same bits for any number of threads. */
#define CPU_SUMSQ_CHUNKS 256

/* Adafactor (backend.h adafactor_*). The statistics: each row's terms in
 * element order (threads own rows), each column's over the run's rows in
 * row order (threads own columns), in double. The updates: scalar per
 * element, each operation rounded on its own, as the CUDA kernels. */
static void cpu_adafactor_stats(float *rows, float *cols, const float *grads, size_t e0, size_t n, int cols_n,
                                float grad_scale, float eps1) {
    /* rows (tensor rows), cols (cols_n) accumulated; grads (n) */
    if (!n) return;
    size_t C = (size_t)cols_n, r0 = e0 / C, r1 = (e0 + n - 1) / C + 1;
    #pragma omp parallel for schedule(static)
    for (size_t i = r0; i < r1; i++) {
        size_t a = i * C > e0 ? i * C : e0, b = (i + 1) * C < e0 + n ? (i + 1) * C : e0 + n;
        double s = 0.0;
        for (size_t e = a; e < b; e++) {
            float g = grads[e - e0] * grad_scale;
            s += (double)(g * g + eps1);
        }
        rows[i] += (float)s;
    }
    #pragma omp parallel for schedule(static)
    for (size_t j = 0; j < C; j++) {
        double s = 0.0;
        int any = 0;
        for (size_t i = r0; i < r1; i++) {
            size_t e = i * C + j;
            if (e < e0 || e >= e0 + n) continue;
            float g = grads[e - e0] * grad_scale;
            s += (double)(g * g + eps1), any = 1;
        }
        if (any) cols[j] += (float)s;
    }
}

static void cpu_adafactor_ema(float *state, const float *sums, size_t n, float beta2, float scale) {
    /* state, sums (n) */
    const float b2c = 1.0f - beta2;
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) state[i] = beta2 * state[i] + b2c * (scale * sums[i]);
}

static void cpu_adafactor_second(float *v, const float *grads, size_t n, float grad_scale, float beta2, float eps1) {
    /* v, grads (n) */
    const float b2c = 1.0f - beta2;
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        float g = grads[i] * grad_scale;
        v[i] = beta2 * v[i] + b2c * (g * g + eps1);
    }
}

/* The unclipped update of element k (backend.h adafactor_usq). */
static inline float cpu_adafactor_u(const float *grads, const float *v, const float *r, const float *c, float rmean,
                                    size_t e0, size_t k, size_t C, float grad_scale) {
    float g = grads[k] * grad_scale;
    if (!r) return g / sqrtf(v[k]);
    size_t e = e0 + k;
    return g / sqrtf(r[e / C] / rmean) / sqrtf(c[e % C]);
}

static void cpu_adafactor_usq(double *out, const float *grads, const float *v, const float *r, const float *c,
                              float rmean, size_t e0, size_t n, int cols_n, float grad_scale) {
    /* grads, v (n); r (rows), c (cols_n) */
    double s = 0.0;
    #pragma omp parallel for schedule(static) reduction(+ : s)
    for (size_t k = 0; k < n; k++) {
        float u = cpu_adafactor_u(grads, v, r, c, rmean, e0, k, (size_t)cols_n, grad_scale);
        s += (double)u * u;
    }
    *out = s;
}

static void cpu_adafactor_apply(float *params, const float *grads, float *m, const float *v, const float *r,
                                const float *c, float rmean, size_t e0, size_t n, int cols_n, float grad_scale,
                                float inv_clip, float lr, float beta1, float weight_decay) {
    /* params, grads, m, v (n); r (rows), c (cols_n) */
    const float b1c = 1.0f - beta1;
    #pragma omp parallel for schedule(static)
    for (size_t k = 0; k < n; k++) {
        float u = cpu_adafactor_u(grads, v, r, c, rmean, e0, k, (size_t)cols_n, grad_scale) * inv_clip;
        if (m) {
            float mk = beta1 * m[k] + b1c * u;
            m[k] = mk;
            u = mk;
        }
        float p = params[k];
        params[k] = p - lr * (u + weight_decay * p);
    }
}

static double cpu_sumsq(const float *x, size_t n) {
    /* x (n) */
    double part[CPU_SUMSQ_CHUNKS];
    size_t q = n / CPU_SUMSQ_CHUNKS, r = n % CPU_SUMSQ_CHUNKS;
    #pragma omp parallel for schedule(static)
    for (int k = 0; k < CPU_SUMSQ_CHUNKS; k++) {
        size_t uk = (size_t)k;
        size_t i0 = q * uk + (uk < r ? uk : r);
        size_t i1 = i0 + q + (uk < r ? 1 : 0);
        double s = 0.0;
        #pragma omp simd reduction(+ : s)
        for (size_t i = i0; i < i1; i++) s += (double)x[i] * x[i];
        part[k] = s;
    }
    double s = 0.0;
    for (int k = 0; k < CPU_SUMSQ_CHUNKS; k++) s += part[k];
    return s;
}

/* The step's scalars (backend.h): plain host arithmetic here, the loss
 * summed in row order as model_forward sums it when it reads the losses. */
static void cpu_sumsq_acc(double *acc, const float *x, size_t n) { *acc += cpu_sumsq(x, n); }
static void cpu_loss_acc(double *acc, const float *losses, int N) {
    /* losses (N) */
    double sum = 0.0;
    for (int i = 0; i < N; i++) sum += losses[i];
    *acc += (float)(sum / N);
}
static void cpu_step_scalars(StepScalars *st, int micro, float grad_clip) { clip_step_scalars(st, micro, grad_clip); }

const Backend backend_cpu = {
    .name = "cpu",
    .host_mem = 1,
    .init = cpu_init,
    .shutdown = cpu_shutdown,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .to_device = cpu_memcpy,
    .to_host = cpu_memcpy,
    .copy = cpu_memcpy,
    .copy_2d = cpu_copy_2d,
    .zero = cpu_zero,
    .sync = cpu_sync,
    .act_bytes = cpu_act_bytes,
    .cast_to_act = cpu_cast_to_act,
    .embed_forward = cpu_embed_forward,
    .embed_backward = cpu_embed_backward,
    .layernorm_forward = cpu_layernorm_forward,
    .layernorm_backward = cpu_layernorm_backward,
    .matmul_forward = cpu_matmul_forward,
    .matmul_backward = cpu_matmul_backward,
    .fp8_amax = cpu_fp8_amax,
    .fp8_qdq = cpu_fp8_qdq,
    .attention_forward = cpu_attention_forward,
    .attention_backward = cpu_attention_backward,
    .attention_block_forward = cpu_attention_block_forward,
    .attention_block_backward = cpu_attention_block_backward,
    .rmsnorm_forward = cpu_rmsnorm_forward,
    .rmsnorm_backward = cpu_rmsnorm_backward,
    .rope_forward = cpu_rope_forward,
    .rope_backward = cpu_rope_backward,
    .qknorm_forward = cpu_qknorm_forward,
    .qknorm_backward = cpu_qknorm_backward,
    .swiglu_forward = cpu_swiglu_forward,
    .swiglu_backward = cpu_swiglu_backward,
    .moe_route = cpu_moe_route,
    .moe_dispatch = cpu_moe_dispatch,
    .moe_dispatch_capped = cpu_moe_dispatch_capped,
    .moe_gather = cpu_moe_gather,
    .moe_gather_backward = cpu_moe_gather_backward,
    .moe_combine = cpu_moe_combine,
    .moe_combine_backward = cpu_moe_combine_backward,
    .moe_route_backward = cpu_moe_route_backward,
    .gelu_forward = cpu_gelu_forward,
    .gelu_backward = cpu_gelu_backward,
    /* No fused matmul + GeLU: here it would be the composition itself, which
     * model.c already runs when these are NULL; offering it would only make
     * "fused" mean nothing (tests wrap the CPU ops as the composition). */
    .matmul_gelu_forward = NULL,
    .matmul_backward_dgelu = NULL,
    .residual_forward = cpu_residual_forward,
    .residual_norm_forward = cpu_residual_norm_forward,
    .add = cpu_add,
    .crossentropy_forward = cpu_crossentropy_forward,
    .xent_partial = cpu_xent_partial,
    .xent_finish = cpu_xent_finish,
    .adamw_update = cpu_adamw_update,
    .adamw_update_bf16 = cpu_adamw_update_bf16,
    .adamw_update_p16 = cpu_adamw_update_p16,
    .lion_update = cpu_lion_update,
    .muon_momentum = cpu_muon_momentum,
    .newton_schulz = cpu_newton_schulz,
    .muon_apply = cpu_muon_apply,
    .adafactor_stats = cpu_adafactor_stats,
    .adafactor_ema = cpu_adafactor_ema,
    .adafactor_second = cpu_adafactor_second,
    .adafactor_usq = cpu_adafactor_usq,
    .adafactor_apply = cpu_adafactor_apply,
    .sumsq = cpu_sumsq,
    .sumsq_acc = cpu_sumsq_acc,
    .loss_acc = cpu_loss_acc,
    .step_scalars = cpu_step_scalars,
    .memory_peak = cpu_memory_peak,
};
