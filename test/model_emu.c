/* model_emu: the whole model on the CUDA backend under the CPU emulation —
 * src/model.c's forward and backward (activation plan, scratch, compute-copy
 * casts, recomputation, GeLU fusion, token staging, host reads of losses and
 * logits rows) and src/optim.c's AdamW, on the backend_cuda table that
 * test/model_emu_cuda.cc builds from every file of cuda/ over test/cuda_emu.h
 * and test/cublaslt_emu.h — trained a few steps and compared with the CPU
 * backend (and, for precision.master bf16, with test/emu_bf16.h, the CPU
 * ops behind bf16 storage: the CPU backend refuses bf16 parameters). Built
 * and run by test/t_model_emu.sh; one "ok"/"FAIL" line per check, an "ok"
 * carrying its measured figure after '#'.
 *
 * The run: GPT-2 with 2 layers, 3 heads of 16 (the tensor-core attention's
 * smallest head), n_embd 48, vocab 70 padded to 128, micro-batch 2 x 40 (T
 * not a multiple of any tile), 2 micro-batches per step, 3 AdamW steps at lr
 * 3e-3 (test/model_trace.h). What is compared, against the reference run:
 *  - losses: every micro-batch's mean loss, relative error;
 *  - grad norms: each step's global gradient norm, relative error;
 *  - grads: the last step's gradients, ||got - ref|| / ||ref|| per tensor,
 *    the worst tensor (L2, not max: a max is ruled by single elements);
 *  - params: the final parameters as the update they received, ||dgot -
 *    dref|| / ||dref|| with d = final - initial, over the whole arena. Not
 *    per tensor: the key bias's gradient is zero in exact arithmetic (the
 *    softmax ignores a constant per row) and AdamW divides each gradient by
 *    its own size, so there the step follows rounding noise on either side
 *    (measured: worst tensor 3.8e-4 of its update in fp32, 0.5..0.9 in bf16,
 *    while the whole arena's update agrees 100x better).
 *
 * Tolerances, each about 5-10x what was measured (figures in brackets: the
 * worst of the cases that use the tolerance, at the commit adding them):
 *  - fp32 (precision.compute fp32; every sum in fp32 in another order than
 *    OpenBLAS's or the CPU's loops, so a few ulps per op, compounding through
 *    2 layers, 6 backwards and 3 updates): losses 1e-5 [0: same bits],
 *    grad norms 1e-5 [9.2e-9], grads 1e-5 [7.4e-7], params 1e-4 [1.9e-5,
 *    mostly the key bias above]. An indexing, mask or cast bug errs by 1e-2
 *    or more.
 *  - fp32 with bf16 moments: both sides round the moments stochastically with
 *    the same random bits, but a moment a few ulps off can round to the other
 *    bf16 neighbour (2^-8 of it), moving that parameter and the next
 *    gradients: grads 1e-4 [1.3e-5], params 2e-4 [2.9e-5]; losses and norms
 *    as fp32 [0, 1.4e-6].
 *  - bf16 (activations, their gradients and the weights' compute copy stored
 *    in bf16, 2^-9 relative per store; the reference keeps fp32): losses
 *    1e-3 [8.8e-5: a mean over 80 tokens averages the per-token errors],
 *    grad norms 1e-2 [2.2e-3], grads 0.1 [4.0e-2 worst tensor, 1.6e-2 the
 *    whole arena: a dozen bf16 stores per layer on the way back], params 0.2
 *    [6.0e-2: gradients near zero step by +-lr on noise, as above]. The
 *    same for bf16 parameters against test/emu_bf16.h, whose stochastic
 *    rounding draws the same bits [5.6e-5, 1.1e-3, 3.0e-2, 5.7e-2]. A stale
 *    compute copy or a lost token changes the losses by 4e-3 or more
 *    (measured with each planted).
 *  - model.recompute norm_gelu against none, bf16, fusion off: 0 (the same
 *    ops on the same inputs; with fusion on the recomputed GeLU may differ in
 *    the last bit, model.h).
 *  - eval (a forward without targets at T 23, one logits row read to the
 *    host): as an op of cuda_emu.cc, max |got - ref| / max |ref| 1e-5 fp32
 *    [9.4e-8], 1e-2 bf16 against the CPU with bf16 stores (test/emu_bf16.h)
 *    [3.1e-3: the logits' own bf16 store, 2^-9, on top of the forward's]. */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "emu_bf16.h"
#include "max_rel.h"
#include "model.h"
#include "optim.h"
#include "util.h"

static const ArchSpec shape0 = ARCH_GPT2_SHAPE(2, 3, 48, 48, 70);
enum { B = 2, T = 40, ACCUM = 2, STEPS = 3 };
#include "model_trace.h"

/* test/model_emu_cuda.cc */
extern const Backend backend_cuda;
size_t model_emu_live_buffers(void);
int model_emu_live_cublaslt(void);

static const Backend *gpu = &backend_cuda;
static Model layout;         /* the parameter table (names, offsets) and initial values, on the CPU */
static int failures;

static void report(int ok, const char *name, const char *fmt, ...) {
    char detail[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    printf("%s model_emu_%s%s%s\n", ok ? "ok" : "FAIL", name, ok ? " # " : ": ", detail);
    fflush(stdout);
    failures += !ok;
}

typedef struct {
    double loss, norm, grads, params;
} Tol;
/* the tolerances of the comment at the top */
static const Tol TOL_FP32 = {1e-5, 1e-5, 1e-5, 1e-4};
static const Tol TOL_FP32_STATE16 = {1e-5, 1e-5, 1e-4, 2e-4};
static const Tol TOL_BF16 = {1e-3, 1e-2, 0.1, 0.2};

/* ||a - r|| / ||r|| over n elements; NaN stays NaN (and fails every test). */
static double rel_l2(const float *a, const float *r, size_t n) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - r[i];
        num += d * d, den += (double)r[i] * r[i];
    }
    return sqrt(num) / (den > 0.0 ? sqrt(den) : 1.0);
}
static double rel(double a, double r) { return fabs(a - r) / fabs(r); }

/* Four lines: losses, grad norms, grads, params of `got` against `ref`. */
static void compare(const char *tag, const Trace *got, const Trace *ref, Tol tol) {
    char name[96];
    double e = 0.0;
    int at = 0;
    for (int i = 0; i < STEPS * ACCUM; i++) {
        double d = rel(got->loss[i], ref->loss[i]);
        if (!(d <= e)) e = d, at = i;
    }
    snprintf(name, sizeof name, "%s_losses", tag);
    report(e <= tol.loss, name, "max rel err %.2e (tol %.0e), at micro-batch %d: %.7g vs %.7g", e, tol.loss, at,
           got->loss[at], ref->loss[at]);
    e = 0.0, at = 0;
    for (int s = 0; s < STEPS; s++) {
        double d = rel(got->norm[s], ref->norm[s]);
        if (!(d <= e)) e = d, at = s;
    }
    snprintf(name, sizeof name, "%s_grad_norms", tag);
    report(e <= tol.norm, name, "max rel err %.2e (tol %.0e), at step %d: %.7g vs %.7g", e, tol.norm, at,
           got->norm[at], ref->norm[at]);
    e = 0.0;
    const char *worst = "";
    for (int k = 0; k < layout.num_tensors; k++) {
        const ParamInfo *p = &layout.params[k];
        double d = rel_l2(got->grads + p->offset, ref->grads + p->offset, p->numel);
        if (!(d <= e)) e = d, worst = p->name;
    }
    snprintf(name, sizeof name, "%s_grads", tag);
    report(got->n == ref->n && e <= tol.grads, name, "worst tensor %s: rel L2 err %.2e (tol %.0e)", worst, e,
           tol.grads);
    size_t n = ref->n;
    const float *p0 = layout.param_mem;
    float *dg = xmalloc(n * sizeof(float)), *dr = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) dg[i] = got->params[i] - p0[i], dr[i] = ref->params[i] - p0[i];
    e = rel_l2(dg, dr, n);
    snprintf(name, sizeof name, "%s_params", tag);
    report(e <= tol.params, name, "update rel L2 err %.2e (tol %.0e; update norm %.3g)", e, tol.params,
           sqrt(backend_cpu.sumsq(dr, n)));
    free(dg), free(dr);
}

static void trace_free(Trace *t) { free(t->grads), free(t->params); }

/* The emulated backend started for compute ("fp32"/"bf16") with attention
 * `att`; its description line names what it chose. */
/* One case on the emulated GPU: train with opts, compare with ref, free. */
static void run_case(const char *tag, TraceOpts opts, const Trace *ref, Tol tol) {
    Trace t;
    trace_train_opts(gpu, shape0, opts, &t);
    compare(tag, &t, ref, tol);
    trace_free(&t);
}

static void gpu_start(const char *compute, const char *att) {
    const char *desc = gpu->init(0);
    gpu->set_attention(att);
    gpu->set_precision(compute);
    size_t want = strcmp(compute, "bf16") == 0 ? 2 : 4;
    char name[64];
    snprintf(name, sizeof name, "%s_%s_started", compute, att);
    report(gpu->act_bytes() == want, name, "%s", desc);
}
/* Every buffer and cuBLASLt object the run made is gone after shutdown. */
static void gpu_stop(const char *tag) {
    gpu->shutdown();
    size_t bufs = model_emu_live_buffers();
    int lt = model_emu_live_cublaslt();
    char name[64];
    snprintf(name, sizeof name, "%s_nothing_leaked", tag);
    report(bufs == 0 && lt == 0, name, "%zu device buffers, %d cuBLASLt objects live after shutdown", bufs, lt);
}

/* The sampling path: a forward without targets at a shorter T (and B 2),
 * one logits row (b 1, the last t) read to the host. */
enum { EVAL_T = 23 };
static void eval_row(const Backend *be, float *row) {
    ArchSpec s = shape0;
    arch_resolve(&s);
    Model m;
    model_init(&m, be, &s, NULL);
    model_init_weights(&m, 11);
    model_plan_activations(&m, B, T, MODEL_RECOMPUTE_NONE);
    int32_t tok[B * EVAL_T];
    for (int i = 0; i < B * EVAL_T; i++) tok[i] = (int32_t)((i * 37 + 5) % shape0.vocab_size);
    model_forward(&m, tok, NULL, B, EVAL_T, 0.0f);
    model_logits_row(&m, 1, EVAL_T - 1, row);
    model_free(&m);
}
static void check_eval(const char *tag, const float *ref, double tol) {
    int Vp = layout.shape.padded_vocab, V = shape0.vocab_size;
    float *row = xmalloc((size_t)Vp * sizeof(float));
    eval_row(gpu, row);
    double e = test_max_rel(row, ref, (size_t)V); /* NaN: infinite, fails */
    double den = 0.0; /* the reference row's scale: all zero is a row no forward wrote */
    for (int i = 0; i < V; i++) den = fabs(ref[i]) > den ? fabs(ref[i]) : den;
    int pad_zero = 1;
    for (int i = V; i < Vp; i++) pad_zero &= row[i] == 0.0f; /* padded rows of wte are zero: so are their logits */
    char name[64];
    snprintf(name, sizeof name, "%s_eval_logits_row", tag);
    report(e <= tol && den > 0.0 && pad_zero, name, "max err %.2e of max |logit| (tol %.0e)%s%s", e, tol,
           den > 0.0 ? "" : "; the reference row is all zero (a row the forward never wrote)",
           pad_zero ? "" : "; a padded column is not 0");
    free(row);
}

int main(void) {
    ArchSpec s = shape0;
    arch_resolve(&s);
    backend_cpu.init(2);
    model_init(&layout, &backend_cpu, &s, NULL);
    model_init_weights(&layout, 11);
    Backend emu = emu_bf16_backend(); /* the CPU backend's table with bf16 act ops */

    /* the references, on the CPU: fp32 moments, bf16 moments, and bf16
     * parameters on the bf16 emulation */
    TraceOpts plain = {MODEL_RECOMPUTE_NONE, 1, 0, 0}, state16 = plain, master16 = plain;
    state16.state16 = 1;
    master16.master16 = 1;
    Trace ref, ref_s16, ref_m16, t, u;
    trace_train_opts(&backend_cpu, shape0, plain, &ref);
    trace_train_opts(&backend_cpu, shape0, state16, &ref_s16);
    trace_train_opts(&emu, shape0, master16, &ref_m16);
    report(isfinite(ref.loss[0]) && ref.loss[STEPS * ACCUM - 1] < ref.loss[0], "reference_learns",
           "CPU loss %.6g -> %.6g", ref.loss[0], ref.loss[STEPS * ACCUM - 1]);
    float *row32 = xmalloc((size_t)s.padded_vocab * sizeof(float)), *row16 = xmalloc((size_t)s.padded_vocab * sizeof(float));
    eval_row(&backend_cpu, row32);
    eval_row(&emu, row16); /* the bf16 row: the CPU forward with bf16 stores */

    /* precision.compute fp32: SIMT attention, the fused GeLU products (model.c's default) */
    gpu_start("fp32", "auto");
    run_case("fp32", plain, &ref, TOL_FP32);
    run_case("fp32_optim_state_bf16", state16, &ref_s16, TOL_FP32_STATE16);
    check_eval("fp32", row32, 1e-5);
    gpu_stop("fp32");

    /* precision.compute bf16, tensor-core attention */
    gpu_start("bf16", "tensor_cores");
    run_case("bf16_tensor_cores", plain, &ref, TOL_BF16);
    TraceOpts unfused = plain, unfused_norm = plain;
    unfused.gelu_fusion = unfused_norm.gelu_fusion = 0;
    unfused_norm.r = MODEL_RECOMPUTE_NORM_GELU;
    trace_train_opts(gpu, shape0, unfused, &t);
    compare("bf16_tensor_cores_unfused", &t, &ref, TOL_BF16);
    trace_train_opts(gpu, shape0, unfused_norm, &u);
    int same = trace_same(&t, &u);
    report(same, "bf16_recompute_norm_gelu_bit_identical", "%s (last loss %.9g vs %.9g)",
           same ? "every loss, grad norm, gradient and parameter the same bits as recompute none"
                : "losses, grad norms, grads or params differ from recompute none",
           u.loss[STEPS * ACCUM - 1], t.loss[STEPS * ACCUM - 1]);
    trace_free(&t), trace_free(&u);
    run_case("bf16_optim_state_bf16", state16, &ref_s16, TOL_BF16);
    run_case("bf16_master_bf16", master16, &ref_m16, TOL_BF16);
    check_eval("bf16", row16, 1e-2);
    gpu_stop("bf16_tensor_cores");

    /* precision.compute bf16, SIMT attention */
    gpu_start("bf16", "simt");
    run_case("bf16_simt", plain, &ref, TOL_BF16);
    gpu_stop("bf16_simt");

    trace_free(&ref), trace_free(&ref_s16), trace_free(&ref_m16);
    free(row32), free(row16);
    model_free(&layout);
    return 0;
}
