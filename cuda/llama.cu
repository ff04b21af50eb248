/* llama: the element- and group-wise ops of Llama-family blocks — RoPE,
 * QK-norm and SwiGLU — on act tensors in either dtype, fp32 math. Mirrors
 * src/cpu/backend_cpu.c; QK-norm's weight gradients are chunked partials
 * with a fixed-order finish (embed_norm.cu's), never float atomics. */
#include <math.h>

#include "common.cuh"

/* ---------------------------------------------------------------------------
 * RoPE, rotate-half, in place on the NH + NKV q and k heads of each qkv row.
 * One thread per (row, head, i < HD/2) pair; rope (Tmax, 2, HD/2) fp32 holds
 * each position's cos then sin, as the CPU backend reads it. sign -1 is the
 * inverse rotation (the backward: the rotation's transpose). doc (N) or
 * NULL: positions restart at each row's document start (backend.h). */
template <typename T_>
__global__ void rope_kernel(T_ *qkv, const float *rope, int N, int T, int heads, int HD, int ld, int pos0,
                            const int32_t *doc, float sign) {
    /* qkv (N, ld) in place */
    int H2 = HD / 2;
    size_t total = (size_t)N * heads * H2;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
        int i = (int)(e % H2);
        size_t rh = e / H2;
        int h = (int)(rh % heads), r = (int)(rh / heads);
        const float *cs = rope + (size_t)(pos0 + r % T - (doc ? doc[r] : 0)) * 2 * H2;
        float c = cs[i], s = sign * cs[H2 + i];
        T_ *x = qkv + (size_t)r * ld + (size_t)h * HD;
        float a = act_f(x[i]), b = act_f(x[i + H2]);
        x[i] = act_from<T_>(a * c - b * s);
        x[i + H2] = act_from<T_>(b * c + a * s);
    }
}

template <typename T_>
static void rope_run(void *qkv, const float *rope, const AttnShape *s, int pos0, float sign) {
    int N = s->B * s->T, heads = s->NH + s->NKV;
    unsigned blocks = cuda_blocks((size_t)N * heads * (s->HD / 2), 256);
    if (blocks > 65536) blocks = 65536;
    KLAUNCH(rope_kernel<T_>, blocks, 256, 0, (T_ *)qkv, rope, N, s->T, heads, s->HD, attn_qkv_width(s), pos0, s->doc, sign);
    CUDA_CHECK_LAUNCH();
}

void cuda_rope_forward(void *qkv, const float *rope, const AttnShape *s, int pos0) {
    ACT_DISPATCH(rope_run, qkv, rope, s, pos0, 1.0f);
}
void cuda_rope_backward(void *dqkv, const float *rope, const AttnShape *s, int pos0) {
    ACT_DISPATCH(rope_run, dqkv, rope, s, pos0, -1.0f);
}

/* ---------------------------------------------------------------------------
 * QK-norm: RMSNorm groups over the first (NH + NKV) HD columns of a qkv row.
 * per_head: NH q groups then NKV k groups of HD; else one q group (NH HD)
 * and one k group (NKV HD). q groups first: g < GQ. One warp per (row, group). */
struct QkGroups {
    int G, GQ, HD, NH, NKV, per_head;
};

static QkGroups qk_groups(const AttnShape *s, int per_head) {
    QkGroups q = {per_head ? s->NH + s->NKV : 2, per_head ? s->NH : 1, s->HD, s->NH, s->NKV, per_head};
    return q;
}
__host__ __device__ __forceinline__ int qk_start(const QkGroups &q, int g) {
    return q.per_head ? g * q.HD : g ? q.NH * q.HD : 0;
}
__host__ __device__ __forceinline__ int qk_size(const QkGroups &q, int g) {
    return q.per_head ? q.HD : g ? q.NKV * q.HD : q.NH * q.HD;
}

template <typename T_>
__global__ void qknorm_forward_kernel(T_ *qkv, T_ *qk_in, float *rstd, const T_ *qw, const T_ *kw, QkGroups q, int N,
                                      int ld, int W, float eps) {
    /* qkv (N, ld) in place, qk_in (N, W), rstd (N, G) */
    int wid = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (wid >= N * q.G) return;
    int row = wid / q.G, g = wid % q.G, st = qk_start(q, g), n = qk_size(q, g);
    T_ *x = qkv + (size_t)row * ld + st, *saved = qk_in + (size_t)row * W + st;
    const T_ *w = g < q.GQ ? qw : kw;
    float s = 0.0f;
    for (int c = lane; c < n; c += 32) {
        float v = act_f(x[c]);
        saved[c] = x[c];
        s += v * v;
    }
    float r = 1.0f / sqrtf(warp_sum(s) / n + eps);
    for (int c = lane; c < n; c += 32) x[c] = act_from<T_>(act_f(x[c]) * r * act_f(w[c]));
    if (lane == 0) rstd[(size_t)row * q.G + g] = r;
}

template <typename T_>
static void qknorm_forward_run(void *qkv, void *qk_in, float *rstd, const void *qw, const void *kw, const AttnShape *s,
                               int per_head, float eps) {
    QkGroups q = qk_groups(s, per_head);
    int N = s->B * s->T;
    KLAUNCH(qknorm_forward_kernel<T_>, cuda_blocks((size_t)N * q.G, 8), 256, 0, (T_ *)qkv, (T_ *)qk_in, rstd,
            (const T_ *)qw, (const T_ *)kw, q, N, attn_qkv_width(s), (s->NH + s->NKV) * s->HD, eps);
    CUDA_CHECK_LAUNCH();
}

void cuda_qknorm_forward(void *qkv, void *qk_in, float *rstd, const void *qw, const void *kw, const AttnShape *s,
                         int per_head, float eps) {
    ACT_DISPATCH(qknorm_forward_run, qkv, qk_in, rstd, qw, kw, s, per_head, eps);
}

/* Weight-gradient partials of one set of groups (the q ones or the k ones):
 * groups g0 .. g0 + ng - 1 of width wd, starting at column col0; thread j of
 * chunk c sums dy * x * rstd over the chunk's rows, then the groups, in order. */
template <typename T_>
__global__ void qknorm_dw_partial_kernel(float *part, const T_ *dqkv, const T_ *qk_in, const float *rstd, int N,
                                         int ld, int W, int G, int col0, int g0, int ng, int wd, int rows_per_chunk) {
    /* part (chunks, wd) */
    int j = blockIdx.x * blockDim.x + threadIdx.x, chunk = blockIdx.y;
    if (j >= wd) return;
    int r0 = chunk * rows_per_chunk, r1 = min(N, r0 + rows_per_chunk);
    float acc = 0.0f;
    for (int r = r0; r < r1; r++)
        for (int h = 0; h < ng; h++) {
            size_t c = (size_t)col0 + (size_t)h * wd + j;
            acc += act_f(dqkv[(size_t)r * ld + c]) * act_f(qk_in[(size_t)r * W + c]) * rstd[(size_t)r * G + g0 + h];
        }
    part[(size_t)chunk * wd + j] = acc;
}

/* dy (in dqkv) -> dx in place: r (dy w) - x r^3 mean(dy w x), one warp per group. */
template <typename T_>
__global__ void qknorm_dx_kernel(T_ *dqkv, const T_ *qk_in, const T_ *qw, const T_ *kw, const float *rstd, QkGroups q,
                                 int N, int ld, int W) {
    int wid = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (wid >= N * q.G) return;
    int row = wid / q.G, g = wid % q.G, st = qk_start(q, g), n = qk_size(q, g);
    T_ *d = dqkv + (size_t)row * ld + st;
    const T_ *x = qk_in + (size_t)row * W + st, *w = g < q.GQ ? qw : kw;
    float r = rstd[(size_t)row * q.G + g], s = 0.0f;
    for (int c = lane; c < n; c += 32) s += act_f(d[c]) * act_f(w[c]) * act_f(x[c]);
    float k = r * r * r * (warp_sum(s) / n); /* every lane has read its d before any writes */
    for (int c = lane; c < n; c += 32) d[c] = act_from<T_>(r * (act_f(d[c]) * act_f(w[c])) - act_f(x[c]) * k);
}

template <typename T_>
static void qknorm_backward_run(void *dqkv, float *dqw, float *dkw, const void *qk_in, const void *qw, const void *kw,
                                const float *rstd, const AttnShape *s, int per_head, int accumulate) {
    QkGroups q = qk_groups(s, per_head);
    int N = s->B * s->T, ld = attn_qkv_width(s), W = (s->NH + s->NKV) * s->HD;
    int chunks = cuda_colsum_chunks(N), rows_per_chunk = (N + chunks - 1) / chunks;
    /* weight gradients first: they read dqkv before the dx kernel overwrites it */
    for (int set = 0; set < 2; set++) {
        int g0 = set ? q.GQ : 0, ng = set ? q.G - q.GQ : q.GQ, wd = qk_size(q, g0);
        float *part = (float *)cuda_scratch(SCRATCH_COLSUM, (size_t)chunks * wd * sizeof(float));
        dim3 grid((wd + 127) / 128, chunks);
        KLAUNCH(qknorm_dw_partial_kernel<T_>, grid, 128, 0, part, (const T_ *)dqkv, (const T_ *)qk_in, rstd, N, ld, W,
                q.G, qk_start(q, g0), g0, ng, wd, rows_per_chunk);
        CUDA_CHECK_LAUNCH();
        cuda_colsum_finish(set ? dkw : dqw, part, chunks, wd, accumulate);
    }
    KLAUNCH(qknorm_dx_kernel<T_>, cuda_blocks((size_t)N * q.G, 8), 256, 0, (T_ *)dqkv, (const T_ *)qk_in,
            (const T_ *)qw, (const T_ *)kw, rstd, q, N, ld, W);
    CUDA_CHECK_LAUNCH();
}

void cuda_qknorm_backward(void *dqkv, float *dqw, float *dkw, const void *qk_in, const void *qw, const void *kw,
                          const float *rstd, const AttnShape *s, int per_head, int accumulate) {
    ACT_DISPATCH(qknorm_backward_run, dqkv, dqw, dkw, qk_in, qw, kw, rstd, s, per_head, accumulate);
}

/* ---------------------------------------------------------------------------
 * SwiGLU: h rows [gate (F) | up (F)], out = silu(gate) up. One thread per
 * output element. */
template <typename T_>
__global__ void swiglu_forward_kernel(T_ *out, const T_ *h, int N, int F) {
    /* out (N,F), h (N,2F) */
    size_t total = (size_t)N * F;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
        size_t i = e / F, j = e % F;
        float g = act_f(h[i * 2 * F + j]), u = act_f(h[i * 2 * F + F + j]);
        out[e] = act_from<T_>(g / (1.0f + expf(-g)) * u);
    }
}

template <typename T_>
__global__ void swiglu_backward_kernel(T_ *dh, const T_ *dout, const T_ *h, int N, int F) {
    /* dh (N,2F) overwritten, dout (N,F), h (N,2F); silu' = sg (1 + g (1 - sg)) */
    size_t total = (size_t)N * F;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
        size_t i = e / F, j = e % F;
        float g = act_f(h[i * 2 * F + j]), u = act_f(h[i * 2 * F + F + j]), d = act_f(dout[e]);
        float sg = 1.0f / (1.0f + expf(-g));
        dh[i * 2 * F + j] = act_from<T_>(d * u * sg * (1.0f + g * (1.0f - sg)));
        dh[i * 2 * F + F + j] = act_from<T_>(d * (g * sg));
    }
}

static unsigned swiglu_blocks(int N, int F) {
    unsigned b = cuda_blocks((size_t)N * F, 256);
    return b > 65536 ? 65536 : b;
}

/* N 0 happens: the experts' SwiGLU over a micro-batch whose every slot was
 * dropped (offsets[E] 0); nothing to write, so no launch. */
template <typename T_> static void swiglu_forward_run(void *out, const void *h, int N, int F) {
    if ((size_t)N * F == 0) return;
    KLAUNCH(swiglu_forward_kernel<T_>, swiglu_blocks(N, F), 256, 0, (T_ *)out, (const T_ *)h, N, F);
    CUDA_CHECK_LAUNCH();
}
template <typename T_> static void swiglu_backward_run(void *dh, const void *dout, const void *h, int N, int F) {
    if ((size_t)N * F == 0) return;
    KLAUNCH(swiglu_backward_kernel<T_>, swiglu_blocks(N, F), 256, 0, (T_ *)dh, (const T_ *)dout, (const T_ *)h, N, F);
    CUDA_CHECK_LAUNCH();
}

void cuda_swiglu_forward(void *out, const void *h, int N, int F) { ACT_DISPATCH(swiglu_forward_run, out, h, N, F); }
void cuda_swiglu_backward(void *dh, const void *dout, const void *h, int N, int F) {
    ACT_DISPATCH(swiglu_backward_run, dh, dout, h, N, F);
}
