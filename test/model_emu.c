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
 * 3e-3 (test/model_trace.h), each step as a one-rank run steps
 * (optim_step_device: norm, clipping and skip on the device, the update
 * writing the compute copy). That step must give the bits of the host-norm
 * step with the separate cast (TraceOpts.host_step), and wait for the
 * device as often as docs/gpu.md says (check_host_syncs: a count). What
 * is compared, against the reference run:
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
 *    [3.1e-3: the logits' own bf16 store, 2^-9, on top of the forward's].
 *
 * Muon (optim.name muon on the blocks' 2-D weights, lr 0.02; the rest
 * AdamW), whose Newton-Schulz runs through cuBLASLt's products: fp32 with
 * GPT-2's fp32 tolerances [0, 6.5e-9, 1.4e-6, 4.5e-5]; bf16, the
 * iteration's products stored in bf16 against the CPU's fp32 iteration
 * (updates a few percent apart: test/matmul_emu.cc), with the bf16 ones
 * [2.6e-4, 1.1e-3, 5.5e-2, 9.4e-2].
 *
 * The Llama and MoE cases (arch_cases: GQA + RoPE + SwiGLU untied; MQA +
 * per-head QK-norm + tied; MoE softmax router 4 experts top-2 + 1 shared;
 * MoE sigmoid router with capacity factor 1, ~10% of slots dropped), the
 * same run and CPU reference in fp32 (arch_cases below):
 *  - fp32: as GPT-2 but grads 3e-5 [3.7e-6, the q and k projections: their
 *    gradients come through RoPE's backward and, under GQA, sum over the
 *    query heads of a kv head, a few more ulps than GPT-2's 7.4e-7]; losses [1.1e-7], grad norms [8.9e-8], params [4.0e-6] keep
 *    GPT-2's. MoE routing exact: every (layer, expert) load and the drop
 *    count the CPU's [0 slots moved]; fp32 scores closer than a few ulps
 *    would be needed to flip a choice, and none are at this size.
 *  - bf16 Llama: as GPT-2's bf16 but grads 0.2 [6.7e-2, the RMSNorm gains:
 *    a 48-element sum over 80 rows of bf16 products of both signs that
 *    mostly cancel, so its relative error is the largest of any tensor].
 *  - bf16 MoE: the router scores are bf16 products of bf16 inputs, so a
 *    token whose two best scores are closer than that noise (~2^-8) picks
 *    another expert than the fp32 CPU (measured: 6 and 11 of 1920 slots).
 *    That is a legitimate difference, not a rounding error of the same
 *    computation: the moved token's gradient lands on another expert's
 *    weights, so per-tensor gradients and updates are not compared. What
 *    is: losses 1e-3 [9.9e-5] and grad norms 1e-2 [2.7e-3], as GPT-2's
 *    (a moved slot at init changes a loss by far less than its bf16
 *    noise), and the slots routed otherwise, at most 5% [0.57%], which a
 *    wrong top-k, gate or dispatch index (moving most slots) fails. The
 *    fp32 cases above check the routing and every gradient exactly. */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend.h"
#include "emu_bf16.h"
#include "max_rel.h"
#include "model.h"
#include "optim.h"
#include "util.h"

static const ArchSpec shape0 = ARCH_GPT2_SHAPE(2, 3, 48, 48, 70);
enum { B = 2, T = 40, ACCUM = 2, STEPS = 3 };
#include "model_trace.h"
#include "test.h"

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
static const Tol TOL_FP32_ARCH = {1e-5, 1e-5, 3e-5, 1e-4};
static const Tol TOL_BF16_LLAMA = {1e-3, 1e-2, 0.2, 0.2};
/* The tp cases in bf16: one rank's part with model_trace.h's stand-in
 * collectives, whose unreduced partial sums and duplicated cross-entropy
 * statistics make a function further from the fp32 one per bf16 store than
 * a whole model is [1.7e-3, 1.2e-2, 0.15, 0.17]: about 2-5x that. */
static const Tol TOL_BF16_TP = {1e-2, 5e-2, 0.3, 0.4};
static const Tol TOL_BF16_MOE = {1e-3, 1e-2, 0, 0}; /* losses and grad norms only */
/* fp8 products against the CPU's fp8 emulation behind bf16 storage: an
 * operand that the two sides hold a bf16 ulp apart near a midpoint of the
 * fp8 grid rounds to neighbours a whole grid step apart (2^-4 relative for
 * E4M3, 2^-3 for E5M2), so the bf16 differences come out about 2-3x larger
 * [measured, qdq path: losses 2.7e-4, grad norms 9.3e-3, grads 0.116 (a norm
 * gain), params 0.136]: 2e-3, 5e-2, 0.3, 0.4 (TOL_BF16_TP's). These check
 * the plumbing (the model's fp8 path runs on the GPU backend and lands
 * near the CPU's); the ops themselves are checked to the bit in
 * cuda_emu.cc and the fp8 product in matmul_emu.cc. */
static const Tol TOL_BF16_FP8 = {2e-3, 5e-2, 0.3, 0.4};
void model_emu_set_sm(int major, int minor); /* model_emu_cuda.cc */
unsigned long long model_emu_mm_clock(void);
int model_emu_fp8_plans(unsigned long long since, int outer_vec);
static const double TOL_BF16_MOVED = 0.05;           /* of the routed slots */

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

/* Four lines: losses, grad norms, grads, params of `got` against `ref`, the
 * parameter table `lay` (initial values: the update's origin); full 0: the
 * first two only. */
static void compare_lay(const char *tag, const Trace *got, const Trace *ref, Tol tol, const Model *lay, int full) {
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
    if (!full) return;
    e = 0.0;
    const char *worst = "";
    for (int k = 0; k < lay->num_tensors; k++) {
        const ParamInfo *p = &lay->params[k];
        double d = rel_l2(got->grads + p->offset, ref->grads + p->offset, p->numel);
        if (!(d <= e)) e = d, worst = p->name;
    }
    snprintf(name, sizeof name, "%s_grads", tag);
    report(got->n == ref->n && e <= tol.grads, name, "worst tensor %s: rel L2 err %.2e (tol %.0e)", worst, e,
           tol.grads);
    size_t n = ref->n;
    const float *p0 = lay->param_mem;
    float *dg = xmalloc(n * sizeof(float)), *dr = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) dg[i] = got->params[i] - p0[i], dr[i] = ref->params[i] - p0[i];
    e = rel_l2(dg, dr, n);
    snprintf(name, sizeof name, "%s_params", tag);
    report(e <= tol.params, name, "update rel L2 err %.2e (tol %.0e; update norm %.3g)", e, tol.params,
           sqrt(backend_cpu.sumsq(dr, n)));
    free(dg), free(dr);
}
static void compare(const char *tag, const Trace *got, const Trace *ref, Tol tol) {
    compare_lay(tag, got, ref, tol, &layout, 1);
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

/* ---------------------------------------------------------------------------
 * The Llama and MoE architectures (src/arch.h), each trained as the GPT-2
 * run above (same B, T, steps, lr, seeds; head size 16, so the tensor-core
 * attention takes them) on the CPU and on the emulated GPU. */
#define LLAMA_BASE                                                                                          \
    .family = ARCH_LLAMA, .n_layer = 2, .n_embd = 48, .head_dim = 16, .seq_len = T, .vocab_size = 70,    \
    .ffn_hidden = 64, .norm = NORM_RMSNORM, .pos = POS_ROPE, .rope_theta = 10000
typedef struct {
    const char *name;
    ArchSpec spec;
    int tp, tp_rank; /* tp > 1: one rank's part (model_trace.h's one-process collectives) */
    int docs;        /* TraceOpts.docs: document masking, positions reset */
} ArchCase;
static ArchCase arch_cases[] = {
    /* GQA (4 query heads on 2 kv heads; q width 64 != n_embd 48), RoPE, SwiGLU, untied head */
    {"llama_gqa", {LLAMA_BASE, .n_head = 4, .n_kv_head = 2, .mlp = MLP_SWIGLU}, 0, 0, 0},
    /* MQA (3 on 1), per-head QK-norm, the head tied to the token embedding */
    {"llama_qknorm_tied", {LLAMA_BASE, .n_head = 3, .n_kv_head = 1, .qk_norm = QKNORM_HEAD, .mlp = MLP_SWIGLU,
                           .tie_embeddings = 1}, 0, 0, 0},
    /* softmax router, 4 experts top-2 renormalised, one shared expert, aux and z losses */
    {"moe_softmax_shared", {LLAMA_BASE, .n_head = 4, .n_kv_head = 2, .mlp = MLP_MOE,
                            .moe = {.n_experts = 4, .top_k = 2, .n_shared = 1, .expert_hidden = 32, .norm_topk = 1,
                                    .aux_loss_coef = 0.01f, .z_loss_coef = 1e-3f}}, 0, 0, 0},
    /* sigmoid router, capacity factor 1: cap = ceil(80 * 2 / 4) = 40 slots per expert, so slots drop */
    {"moe_sigmoid_capacity", {LLAMA_BASE, .n_head = 4, .n_kv_head = 2, .mlp = MLP_MOE,
                              .moe = {.n_experts = 4, .top_k = 2, .expert_hidden = 32, .sigmoid = 1,
                                      .capacity_factor = 1.0f, .aux_loss_coef = 0.01f, .z_loss_coef = 1e-3f}}, 0, 0, 0},
    /* tensor-parallel steps on one rank's local shapes: GQA with 2 of 4 heads and 1 of 2 kv heads, 32 of 64
     * MLP rows, vocabulary rows 0-63 (rank 0: the trace's ids are all below 64); GPT-2 over tp 3, rank 1: one
     * head, c_attn's q | k | v parts, vocabulary rows 64-127 of which 6 are real, so every id is another
     * rank's (a zero row, plus the position) */
    {"llama_gqa_tp2_rank0", {LLAMA_BASE, .n_head = 4, .n_kv_head = 2, .mlp = MLP_SWIGLU}, 2, 0, 0},
    {"gpt2_tp3_rank1", ARCH_GPT2_SHAPE(2, 3, 48, 48, 70), 3, 1, 0},
    /* document masking with positions reset: GQA and RoPE (the SIMT attention's masks, RoPE per document);
     * GPT-2's learned positions per document (embeddings run by run), head size 16 (bf16: the tensor cores' masks) */
    {"llama_gqa_docs", {LLAMA_BASE, .n_head = 4, .n_kv_head = 2, .mlp = MLP_SWIGLU}, 0, 0, 1},
    {"gpt2_docs", ARCH_GPT2_SHAPE(2, 3, 48, 48, 70), 0, 0, 1},
};
enum { N_ARCH = sizeof arch_cases / sizeof arch_cases[0] };
static Model arch_layout[N_ARCH]; /* each case's parameter table and initial values, on the CPU */
static Trace arch_ref[N_ARCH];    /* each case's CPU run */

/* Slots the two runs routed differently: half the L1 distance of the
 * per-(layer, expert) loads (a slot moved from one expert to another counts
 * once), and the drop counts. */
static int64_t moved_slots(const Trace *a, const Trace *b) {
    int64_t d = 0;
    for (int i = 0; i < TRACE_MOE_LOADS; i++) d += a->moe_load[i] > b->moe_load[i] ? a->moe_load[i] - b->moe_load[i]
                                                                                  : b->moe_load[i] - a->moe_load[i];
    return d / 2;
}

static void arch_refs(void) {
    TraceOpts plain = {.r = MODEL_RECOMPUTE_NONE, .gelu_fusion = 1};
    for (int i = 0; i < N_ARCH; i++) {
        ArchCase *c = &arch_cases[i];
        arch_resolve(&c->spec);
        Trace *r = &arch_ref[i];
        model_init(&arch_layout[i], &backend_cpu, &c->spec, &(ModelOptions){.tp = c->tp, .tp_rank = c->tp_rank});
        model_init_weights(&arch_layout[i], 11);
        TraceOpts o = plain;
        o.tp = c->tp, o.tp_rank = c->tp_rank, o.docs = c->docs;
        trace_train_opts(&backend_cpu, c->spec, o, r);
        /* Not "learns": every micro-batch is a new batch of random targets, so
         * 6 losses near ln 70 = 4.25 need not fall; finite and moving is what
         * the comparison needs (an update of norm 0 would compare as equal). */
        int finite = 1;
        for (int k = 0; k < STEPS * ACCUM; k++) finite &= isfinite(r->loss[k]);
        for (int k = 0; k < STEPS; k++) finite &= isfinite(r->norm[k]) && r->norm[k] > 0;
        char name[96];
        snprintf(name, sizeof name, "%s_reference_finite", c->name);
        report(finite, name, "CPU loss %.6g -> %.6g, grad norm %.4g -> %.4g", r->loss[0], r->loss[STEPS * ACCUM - 1],
               r->norm[0], r->norm[STEPS - 1]);
        if (c->spec.moe.capacity_factor > 0) {
            snprintf(name, sizeof name, "%s_reference_drops", c->name);
            report(r->moe_drops > 0, name, "%lld of %lld slots dropped on the CPU", (long long)r->moe_drops,
                   (long long)r->moe_routed);
        }
    }
}

/* Every architecture on the started GPU. precision.compute fp32: the full
 * comparison, and an MoE run must route every slot as the CPU did (the
 * per-expert loads and drops the same). bf16: Llama the full comparison;
 * MoE losses, grad norms and how many slots moved (the comment at the top). */
static void arch_run_all(const char *prec) {
    int bf16 = strcmp(prec, "bf16") == 0;
    TraceOpts plain = {.r = MODEL_RECOMPUTE_NONE, .gelu_fusion = 1};
    for (int i = 0; i < N_ARCH; i++) {
        const ArchCase *c = &arch_cases[i];
        const Trace *ref = &arch_ref[i];
        int moe = c->spec.mlp == MLP_MOE;
        char tag[96], name[128];
        snprintf(tag, sizeof tag, "%s_%s", prec, c->name);
        Trace t;
        TraceOpts o = plain;
        o.tp = c->tp, o.tp_rank = c->tp_rank, o.docs = c->docs;
        trace_train_opts(gpu, c->spec, o, &t);
        compare_lay(tag, &t, ref, bf16 ? (moe ? TOL_BF16_MOE : c->tp > 1 ? TOL_BF16_TP : TOL_BF16_LLAMA) : TOL_FP32_ARCH,
                    &arch_layout[i],
                    !(bf16 && moe));
        if (moe) {
            int64_t moved = moved_slots(&t, ref);
            int same_total = t.moe_routed == ref->moe_routed;
            snprintf(name, sizeof name, "%s_routing", tag);
            if (!bf16)
                report(same_total && moved == 0 && t.moe_drops == ref->moe_drops, name,
                       "%lld of %lld slots routed otherwise than on the CPU, drops %lld vs %lld (want the same)",
                       (long long)moved, (long long)ref->moe_routed, (long long)t.moe_drops,
                       (long long)ref->moe_drops);
            else
                report(same_total && moved <= ref->moe_routed * TOL_BF16_MOVED, name,
                       "%lld of %lld slots (%.2e) routed otherwise than on the CPU (tol %.0e), drops %lld vs %lld",
                       (long long)moved, (long long)ref->moe_routed, (double)moved / ref->moe_routed,
                       TOL_BF16_MOVED, (long long)t.moe_drops, (long long)ref->moe_drops);
        }
        trace_free(&t);
    }
}

/* precision.fp8 with fp32 activations on the GPU backend (mode 1), and
 * its bf16 operands anywhere on the GPU (mode 3: the CPU's stand-in for
 * bf16 compute): model_init refuses (exit 2, one line naming the key
 * `want` says), in a child process. */
static void init_fp8_child(void *mode) {
    Model m;
    ArchSpec s = shape0;
    arch_resolve(&s);
    model_init(&m, gpu, &s, &(ModelOptions){.fp8 = {.mode = *(int *)mode}});
}
static void check_fp8_refused(int mode, const char *want, const char *name) {
    char err[512];
    int rc = test_run_child(init_fp8_child, &mode, err, sizeof err), lines = 0;
    for (char *c = err; *c; c++) lines += *c == '\n';
    if (lines && err[strlen(err) - 1] == '\n') err[strlen(err) - 1] = '\0';
    report(rc == 2 && lines == 1 && strstr(err, want) != NULL, name, "%s", err[0] ? err : "no message");
}

/* Host waits per optimizer step (backend.h host_syncs: `./train bench`'s
 * host_syncs_per_step), counted, never timed: a one-rank step as train.c
 * and bench.c run it (the model's loss sink, ACCUM micro-batches,
 * optim_step_device, the updates writing the compute copy) waits for the
 * device once, when it reads the step's scalars. MoE routing's reads are
 * counted apart (ModelMoeStats.host_reads): per MoE layer and micro-batch
 * the experts' row offsets (the products' sizes) and the routing groups'
 * loads and statistics (the auxiliary loss and its gradient, on the host),
 * 3, each a wait. The most over steps 2 to 4 (step 1 makes the compute
 * copy's first cast and the plans). */
static void check_host_syncs(const char *tag, ArchSpec s, int per_moe_layer_micro) {
    arch_resolve(&s);
    Model m;
    model_init(&m, gpu, &s, NULL);
    model_init_weights(&m, 11);
    model_plan_activations(&m, B, T, MODEL_RECOMPUTE_NONE);
    AdamW o;
    optim_init(&o, gpu, m.num_params, m.num_decay, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f);
    int fused = optim_set_copy(&o, model_compute_copy(&m));
    model_set_loss_sink(&m, &optim_scalars(&o)->loss);
    int32_t inp[B * T], tgt[B * T];
    unsigned long most = 0;
    int64_t moe_most = 0;
    float loss = NAN;
    for (int step = 0; step < 4; step++) {
        unsigned long s0 = gpu->host_syncs();
        model_moe_reset(&m);
        for (int k = 0; k < ACCUM; k++) {
            trace_batch(inp, tgt, 500 + (uint64_t)(step * ACCUM + k));
            model_forward(&m, inp, tgt, B, T, 1.0f / (B * T * ACCUM));
            model_backward(&m, k > 0);
        }
        optim_step_device(&o, model_param_arena(&m), m.grad_mem, 3e-3f, ACCUM, &loss);
        if (!fused) model_params_changed(&m);
        unsigned long n = gpu->host_syncs() - s0;
        if (step > 0 && n > most) most = n;
        if (step > 0 && m.moe.host_reads > moe_most) moe_most = m.moe.host_reads;
    }
    int moe_layers = s.mlp == MLP_MOE ? s.n_layer : 0;
    int64_t moe_allowed = (int64_t)per_moe_layer_micro * moe_layers * ACCUM;
    char name[96];
    snprintf(name, sizeof name, "%s_host_syncs_per_step", tag);
    report(most == 1 + (unsigned long)moe_most && moe_most == moe_allowed && isfinite(loss), name,
           "%lu host waits in a step: %lu besides MoE routing's %lld reads (want 1, the step's scalars, and %lld: "
           "3 per MoE layer and micro-batch), last loss %.5g", most, most - (unsigned long)moe_most,
           (long long)moe_most, (long long)moe_allowed, loss);
    optim_free(&o);
    model_free(&m);
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
    TraceOpts plain = {.r = MODEL_RECOMPUTE_NONE, .gelu_fusion = 1}, state16 = plain, master16 = plain, muon = plain;
    state16.state16 = 1;
    master16.master16 = 1;
    muon.muon = 1;
    Trace ref, ref_s16, ref_m16, ref_muon, t, u;
    trace_train_opts(&backend_cpu, shape0, plain, &ref);
    trace_train_opts(&backend_cpu, shape0, muon, &ref_muon);
    trace_train_opts(&backend_cpu, shape0, state16, &ref_s16);
    trace_train_opts(&emu, shape0, master16, &ref_m16);
    report(isfinite(ref.loss[0]) && ref.loss[STEPS * ACCUM - 1] < ref.loss[0], "reference_learns",
           "CPU loss %.6g -> %.6g", ref.loss[0], ref.loss[STEPS * ACCUM - 1]);
    float *row32 = xmalloc((size_t)s.padded_vocab * sizeof(float)), *row16 = xmalloc((size_t)s.padded_vocab * sizeof(float));
    eval_row(&backend_cpu, row32);
    eval_row(&emu, row16); /* the bf16 row: the CPU forward with bf16 stores */
    arch_refs();

    /* precision.compute fp32: SIMT attention, the fused GeLU products (model.c's default) */
    gpu_start("fp32", "auto");
    run_case("fp32", plain, &ref, TOL_FP32);
    run_case("fp32_optim_state_bf16", state16, &ref_s16, TOL_FP32_STATE16);
    run_case("fp32_muon", muon, &ref_muon, TOL_FP32);
    /* model.loss_chunk on the CUDA kernels (offset rows of the logits,
     * losses and targets): against the CPU's whole head, in the tolerance */
    TraceOpts chunked = plain;
    chunked.loss_chunk = 24; /* 80 rows: 24, 24, 24, 8 */
    run_case("fp32_loss_chunk", chunked, &ref, TOL_FP32);
    check_eval("fp32", row32, 1e-5);
    check_fp8_refused(1, "keys 'precision.fp8', 'precision.compute'", "fp32_fp8_refused");
    check_fp8_refused(3, "key 'precision.fp8': bf16 is the CPU backend's stand-in", "fp32_fp8_bf16_operands_refused");
    arch_run_all("fp32");
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
    /* the one-rank step (device scalars, the update writing the compute
     * copy) against the host-norm step with its separate cast: the same bits */
    for (int k = 0; k < 2; k++) {
        TraceOpts dev = k ? state16 : plain, host = dev;
        host.host_step = 1;
        trace_train_opts(gpu, shape0, dev, &t);
        trace_train_opts(gpu, shape0, host, &u);
        same = trace_same(&t, &u);
        report(same, k ? "bf16_optim_state_bf16_fused_step_bit_identical" : "bf16_fused_step_bit_identical",
               "%s", same ? "every loss, grad norm, gradient and parameter the same bits as the host-norm step with "
                            "a separate cast" : "differs from the host-norm step with a separate cast");
        trace_free(&t), trace_free(&u);
    }
    check_host_syncs("bf16_gpt2", shape0, 3);
    check_host_syncs("bf16_llama_gqa", arch_cases[0].spec, 3);
    check_host_syncs("bf16_moe_softmax_shared", arch_cases[2].spec, 3);
    run_case("bf16_optim_state_bf16", state16, &ref_s16, TOL_BF16);
    run_case("bf16_master_bf16", master16, &ref_m16, TOL_BF16);
    run_case("bf16_muon", muon, &ref_muon, TOL_BF16);
    run_case("bf16_loss_chunk", chunked, &ref, TOL_BF16);
    /* fp8 products (model_fp8.c on cuda/fp8.cu's ops: tensorwise through
     * cuBLASLt's fp8 product, rowwise quantise-dequantise and bf16
     * products) against the CPU ops behind bf16 storage with the same fp8
     * quantisation (TOL_BF16_FP8 says why those tolerances) */
    struct {
        const char *name;
        int mode, wgrad, history, sm;
    } f8s[] = {
        {"bf16_fp8_tensorwise_cublaslt_fp8", 1, 0, 0, 90},
        {"bf16_fp8_rowwise_cublaslt_outer_vec", 2, 0, 0, 90},
        {"bf16_fp8_tensorwise_delayed_wgrad_fp8_cublaslt", 1, 1, 4, 90},
        {"bf16_fp8_rowwise_wgrad_fp8_cublaslt_outer_vec", 2, 1, 0, 90},
        {"bf16_fp8_rowwise_sm89_qdq", 2, 1, 0, 89}, /* no outer-vector scales there: quantised operands */
    };
    for (size_t k = 0; k < sizeof f8s / sizeof f8s[0]; k++) {
        TraceOpts f8 = plain;
        f8.fp8 = f8s[k].mode, f8.fp8_wgrad = f8s[k].wgrad, f8.fp8_history = f8s[k].history;
        trace_train_opts(&emu, shape0, f8, &t);
        model_emu_set_sm(f8s[k].sm / 10, f8s[k].sm % 10);
        unsigned long long clock0 = model_emu_mm_clock();
        run_case(f8s[k].name, f8, &t, TOL_BF16_FP8);
        /* the path taken: cuBLASLt's fp8 products with scalar or outer-vector scales, or none (quantised operands) */
        int vec = model_emu_fp8_plans(clock0, 1), sc = model_emu_fp8_plans(clock0, 0);
        int want_vec = f8s[k].mode == 2 && f8s[k].sm == 90, want_sc = f8s[k].mode == 1;
        char path_name[96];
        snprintf(path_name, sizeof path_name, "%s_path", f8s[k].name);
        report((vec > 0) == want_vec && (sc > 0) == want_sc, path_name, "%d fp8 product shapes with outer-vector "
               "scales, %d with scalar ones (cuBLASLt plans used)", vec, sc);
        model_emu_set_sm(9, 0);
        trace_free(&t);
    }
    check_eval("bf16", row16, 1e-2);
    arch_run_all("bf16");
    gpu_stop("bf16_tensor_cores");

    /* precision.compute bf16, SIMT attention */
    gpu_start("bf16", "simt");
    run_case("bf16_simt", plain, &ref, TOL_BF16);
    gpu_stop("bf16_simt");

    trace_free(&ref), trace_free(&ref_s16), trace_free(&ref_m16), trace_free(&ref_muon);
    free(row32), free(row16);
    for (int i = 0; i < N_ARCH; i++) trace_free(&arch_ref[i]), model_free(&arch_layout[i]);
    model_free(&layout);
    return 0;
}
