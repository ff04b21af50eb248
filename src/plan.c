/* plan: `./train plan` — checks that a parallel layout is valid for N GPUs
 * (ranks, batch divisibility, memory per rank) and suggests the smallest ZeRO
 * stage and largest micro-batch that fit. Arithmetic only: it must never
 * allocate a model, start a backend or talk to other ranks. */
#include "plan.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "cp.h"
#include "ddp.h"
#include "ep.h"
#include "fp8.h"
#include "hw.h"
#include "mesh.h"
#include "muon.h"
#include "optim.h"
#include "pipe.h"
#include "util.h"

static const char *plan_usage =
    "usage: ./train plan CONFIG.yaml [--set key.path=value]... --gpus N [--nodes K] [--hardware NAME|FILE.yaml]\n"
    "                    [--gpu-mem GB] [--search [--top K]] [--json] [--show-schedule] [--auto-sets]\n"
    "\n"
    "--search: every layout of the N GPUs (dp x tp x pp x cp, ep folded into dp x cp; ZeRO 0-3; micro-batch;\n"
    "model.recompute; sequence parallelism; pipeline schedule and virtual stages; cp's attention exchange)\n"
    "that kiln's own config checks accept and whose memory fits, ranked by the predicted step time; the\n"
    "best K (default 5) with their memory and time breakdowns, MFU, the --set flags and an srun line.\n"
    "--hardware: h100 (default), h200, h800, a100-80, a100-40, b200, gb200-nvl72, cpu (this machine,\n"
    "measured once and cached), or a YAML profile (docs/planner.md). --nodes defaults to N / the profile's\n"
    "GPUs per node. --json: the same as one JSON object (docs/planner.md \"JSON\").\n"
    "--auto-sets: for job scripts (scripts/train.sbatch): with parallel.layout auto, the best layout's\n"
    "--set flags, one argument a line; with parallel.layout fixed, nothing (exit 0).\n"
    "Without --search: the config's own layout, its memory and time; when it does not fit, the change\n"
    "that makes it fit.\n"
    "\n"
    "Checks the config's parallel layout on N GPUs (in total, over K nodes): that the ranks and\n"
    "batch.total_tokens divide, and that one rank's memory fits; then suggests the smallest\n"
    "parallel.zero and the largest batch.micro_batch that fit, and predicts the step's time.\n"
    "Memory per rank = parameters + gradients + optimizer state (per ZeRO stage, as --dry-run\n"
    "counts them) + activations of one micro-batch + precision.fp8's buffers + 32 MiB cuBLAS\n"
    "workspace, all + 5%, each in the dtype the backend stores it: fp32 master, gradients and\n"
    "state (AdamW's m and v in bf16 with precision.optim_state bf16; no master with precision.master\n"
    "bf16); activations in bf16 on a GPU with precision.compute bf16 (device auto is planned as a GPU),\n"
    "plus the bf16 compute copy of the parameters, else fp32. Activations follow model.recompute\n"
    "(none, gelu, norm_gelu: less memory for recomputation in the backward).\n"
    "With parallel.pp > 1 each pipeline stage is counted (its layers, its activation slots for the\n"
    "schedule's micro-batches in flight) with the schedule's bubble, and the costliest stage decides;\n"
    "--show-schedule prints the schedule as a text timeline (one rank a row, one forward a cell).\n"
    "\n"
    "exit: 0 valid and fits (--search: some layout fits); 2 invalid, does not fit, or bad usage (one line\n"
    "says what to change)\n";

size_t plan_num_params(const ArchSpec *s) { return arch_num_params(s); }

/* Parameters of one layer (every layer has the same table rows). */
double plan_layer_params(const ArchSpec *s) {
    int n;
    const ArchTensor *t = arch_tensors_view(s, 0, &n);
    double sum = 0;
    for (int i = 0; i < n; i++)
        if (t[i].layer == 0) sum += (double)t[i].numel;
    return sum;
}

size_t plan_param_bytes(const char *master) { return strcmp(master, "bf16") == 0 ? 2 : 4; }

/* Routed-expert parameters of the whole model (tp does not split them). */
double plan_expert_params(const ArchSpec *s) {
    if (s->mlp != MLP_MOE) return 0;
    return (double)s->n_layer * s->moe.n_experts * 3.0 * s->moe.expert_hidden * s->n_embd;
}

/* The overhead (workspace and margin) and the total, once the rest is counted. */
static void plan_finish(PlanMemory *m) {
    m->state += m->compute_copy;
    double fp8 = (double)(m->fp8.operands + m->fp8.scales + m->fp8.histories);
    double counted = m->state + m->activations + fp8 + PLAN_WORKSPACE_BYTES;
    m->overhead = PLAN_WORKSPACE_BYTES + PLAN_MARGIN * counted;
    m->total = m->state + m->activations + fp8 + m->overhead;
}

ModelFp8 plan_fp8_options(const Config *c) {
    return (ModelFp8){.mode = fp8_mode_parse(c->fp8), .grad_fmt = fp8_format_parse(c->fp8_grad),
                      .wgrad = !strcmp(c->fp8_wgrad, "fp8"), .history = c->fp8_amax_history,
                      .pow2 = c->fp8_pow2_scales, .head = c->fp8_head};
}

size_t plan_act_bytes(const Config *c) {
    return !strcmp(c->device, "cpu") || !strcmp(c->compute, "fp32") ? 4 : 2;
}

PlanLayout plan_layout(const Config *c, int dp) {
    return (PlanLayout){.tp = c->tp, .sp = c->tp > 1 && strcmp(c->sequence_parallel, "false") != 0, .cp = c->cp,
                        .cp_mode = cp_mode_parse(c->cp_attention), .dp = dp, .ep = c->ep, .zero = c->zero,
                        .micro_batch = c->micro_batch, .recompute = model_recompute_parse(c->recompute),
                        .recompute_every = c->recompute_every, .loss_chunk = c->loss_chunk,
                        .moment_bytes = optim_state_bytes(c->optim_state), .param_bytes = plan_param_bytes(c->master),
                        .act_bytes = plan_act_bytes(c), .fp8 = plan_fp8_options(c),
                        .muon = optim_kind(c->optim_name) == OPTIM_MUON, .muon_split_qkv = c->muon_split_qkv};
}

/* Muon's buffers on its busiest owner (optim.c optim_set_muon, muon.c
 * muon_dist_init): the matrices train.c picks (optim_muon_role), owned by
 * cost, largest first, to the least loaded of the dp ranks (muon.c
 * assign_owners); the owner's momentum (+1), a staging buffer as large
 * (obuf), u (the largest matrix) and the Newton-Schulz work
 * (optim_muon_work_floats). With dp ranks: ZeRO 0's all-gather target of
 * dp blocks (the largest owner's matrices each); ZeRO >= 1's send and
 * receive buffers of dp blocks, a block the owner's matrices over dp (an
 * even spread of each owner's matrices over the shards, which the test
 * layouts have; plan_runs' block is the largest pair). tp's and ep's
 * exchange buffers (muon.c plan_tp, the expert plan) are not counted. */
static double plan_muon_bytes(const ArchSpec *s, const PlanLayout *l, int dp, int chunks, const int *lo,
                              const int *hi) {
    int n;
    ArchTensor *t = arch_tensors(s, 0, &n);
    double *cost = xcalloc((size_t)3 * n + 1, sizeof(double)), *size = xcalloc((size_t)3 * n + 1, sizeof(double));
    double *load = xcalloc((size_t)dp, sizeof(double)), *owned = xcalloc((size_t)dp, sizeof(double));
    size_t most = 1, work = 1;
    int k = 0;
    for (int i = 0; i < n; i++) {
        int in = 0;
        for (int c = 0; c < chunks; c++) in = in || arch_tensor_in_stage(s, &t[i], lo[c], hi[c]);
        if (!in || t[i].ndim != 2 || !t[i].trained || !optim_muon_role(t[i].role)) continue;
        int fused = t[i].role == ROLE_QKV_W && (i + 1 >= n || t[i + 1].role != ROLE_K_W);
        int parts = fused && l->muon_split_qkv && t[i].shape[0] % 3 == 0 ? 3 : 1;
        int rows = t[i].shape[0] / parts, cols = t[i].shape[1];
        for (int p = 0; p < parts; p++, k++) {
            size[k] = (double)rows * cols;
            cost[k] = muon_ns_flops(rows, cols, 1);
            if ((size_t)rows * cols > most) most = (size_t)rows * cols;
            if (optim_muon_work_floats(rows, cols) > work) work = optim_muon_work_floats(rows, cols);
        }
    }
    int *order = muon_order_by_cost(cost, k), *owner = xcalloc((size_t)k + 1, sizeof(int));
    muon_place(order, k, cost, NULL, 0, dp, load, owner);
    for (int i = 0; i < k; i++) owned[owner[i]] += size[i];
    free(order), free(owner);
    double mm = 0;
    for (int r = 0; r < dp; r++) mm = owned[r] > mm ? owned[r] : mm;
    double floats = 2 * (mm + 1) + (double)most + (double)work; /* momentum, obuf, u, ns_work */
    if (dp > 1 && l->zero == 0) floats += dp * mm + 1;          /* the all-gather's dp blocks */
    if (dp > 1 && l->zero >= 1) floats += 2 * (dp * ceil(mm / dp) + 1);
    free(t), free(cost), free(size), free(load), free(owned);
    return floats * 4;
}

/* fp8's buffers into m's total, for N rows of act_bytes activations. */
static void plan_add_fp8(PlanMemory *m, const ArchSpec *local, const PlanLayout *l, int ep, int sets) {
    size_t N = (size_t)l->micro_batch * (local->seq_len / l->cp);
    model_fp8_bytes(local, &l->fp8, l->tp, l->cp, ep, N, m->act_bytes, &m->fp8);
    /* BLOCK with delayed scaling: each set's copies of its forward casts' rings */
    m->fp8.histories += model_fp8_snap_bytes(local, &l->fp8, l->tp, l->cp, sets, l->recompute);
}

/* The activation dtype's figures into m (act_by_mode filled), and the bf16
 * compute copy of an fp32 master (model.c: one cast of the whole arena; under
 * ZeRO-3 one per gathered unit, whose fp32 buffers params_gathered counts). */
static void plan_pick_dtype(PlanMemory *m, const PlanLayout *l, double whole_params) {
    m->act_bytes = l->act_bytes == 2 ? 2 : 4;
    int k = m->act_bytes == 2;
    m->activations = m->act_by_mode[l->recompute][k];
    m->activations_other = m->act_by_mode[l->recompute][!k];
    if (m->act_bytes == 2 && m->param_bytes == 4)
        m->compute_copy = m->params_gathered > 0 ? m->params_gathered / 2 : whole_params * 2;
}

PlanMemory plan_memory_per_rank(const ArchSpec *g, const PlanLayout *lay) {
    int tp = lay->tp, sp = lay->sp, cp = lay->cp, cp_mode = lay->cp_mode, dp = lay->dp, ep = lay->ep, zero = lay->zero;
    int micro_batch = lay->micro_batch;
    ModelRecompute recompute = lay->recompute;
    size_t moment_bytes = lay->moment_bytes, param_bytes = lay->param_bytes;
    PlanMemory m = {0};
    ArchSpec local;
    arch_tp_local(g, tp, 0, &local); /* tp 1: the spec itself */
    const ArchSpec *s = &local;
    dp *= cp; /* ZeRO shards over every rank holding the same parameters: dp x cp */
    m.param_bytes = param_bytes;
    if (ep < 1 || s->mlp != MLP_MOE) ep = 1;
    /* expert parallelism: the experts not held here leave the count; their
     * ZeRO-1 state splits over dp / ep holders, so the shard stays 1/dp */
    double all = (double)plan_num_params(s), experts = plan_expert_params(s);
    double L = s->n_layer, params = all - experts + experts / ep;
    double shard = (double)(((size_t)all + (size_t)dp - 1) / (size_t)dp);
    double layer = plan_layer_params(s), rest = params - L * layer;
    if (zero >= 2 && dp > 1) {
        /* each unit padded to ddp_unit_align floats, its shard a 1/dp of that */
        double a = (double)ddp_unit_align(dp);
        layer = ceil(layer / a) * a, rest = ceil(rest / a) * a;
        params = L * layer + rest, shard = params / dp + 1; /* pshard's one spare float */
        /* ZeRO 2 and 3 (ddp.c, unit-sharded): a 1/dp shard of the gradients
         * and the optimizer state; each backward writes a layer's whole
         * gradients into one of two slots and reduce-scatters them into the
         * shard, and wte/wpe/ln_f's whole gradients (written at both ends of
         * the backward: the tied head and the embedding) are reduce-scattered
         * after the step's last micro-batch; each slot's reduce-scatter lands
         * in a 1/dp block before it is added to the shard */
        m.grads = shard * 4;
        m.grads_unreduced = (2 * layer + rest + 2 * layer / dp) * 4;
        m.optim = shard * 2 * moment_bytes; /* m and v */
        if (zero == 3) {
            /* parameters: the shard, plus two layers gathered (one
             * computing, one prefetched) and wte/wpe/ln_f for the whole pass */
            m.params = shard * 4;
            m.params_gathered = (2 * layer + rest) * 4;
        } else {
            /* parameters whole and resident, plus the fp32 shard AdamW
             * updates, all-gathered back into the whole after the step */
            m.params = params * 4;
            m.params_shard = shard * 4;
        }
    } else {
        /* the backward pass accumulates into a whole gradient arena on every
         * rank (ZeRO 2 and 3 on one rank are plain training); the parameters
         * are fp32, or bf16 without a master (precision.master bf16) */
        m.params = params * (double)param_bytes;
        m.grads = params * 4;
        m.optim = (zero == 1 ? shard : params) * 2 * moment_bytes;
    }
    int whole[1] = {0}, end[1] = {s->n_layer};
    m.muon = lay->muon ? plan_muon_bytes(s, lay, dp, 1, whole, end) : 0;
    m.state = m.params + m.params_shard + m.params_gathered + m.grads + m.grads_unreduced + m.optim + m.muon;
    /* fp32 activations: the upper bound (bf16 halves them, see plan_usage) */
    AttnShape cps = {micro_batch, s->seq_len / cp, s->n_head, s->n_kv_head, s->head_dim, NULL};
    for (int r = MODEL_RECOMPUTE_NONE; r < MODEL_RECOMPUTE_MODES; r++)
        for (int k = 0; k < 2; k++) {
            size_t ab = k ? 2 : sizeof(float);
            m.act_by_mode[r][k] = (double)model_activation_bytes_rank(g, tp, cp, ep, sp, micro_batch, s->seq_len, ab,
                                                                      (ModelRecompute)r, lay->recompute_every,
                                                                      lay->loss_chunk);
            if (cp > 1) m.act_by_mode[r][k] += (double)cp_buffer_bytes(&cps, cp, (CpMode)cp_mode, ab);
            m.act_by_mode[r][k] += (double)ep_buffer_bytes(s, ep, cp, s->n_layer, micro_batch, s->seq_len, ab,
                                                           (ModelRecompute)r);
        }
    m.cp_buffers = cp > 1 ? (double)cp_buffer_bytes(&cps, cp, (CpMode)cp_mode, lay->act_bytes == 2 ? 2 : 4) : 0;
    m.recompute = recompute;
    m.loss_chunk = lay->loss_chunk;
    for (int k = 0; k < 3; k++) {
        int lc[3] = {0, -1, lay->loss_chunk};
        m.arena_by_chunk[k] = (double)model_activation_bytes_rank(g, tp, cp, ep, sp, micro_batch, s->seq_len,
                                                                  lay->act_bytes == 2 ? 2 : 4, recompute,
                                                                  lay->recompute_every, lc[k]);
    }
    plan_pick_dtype(&m, lay, params);
    plan_add_fp8(&m, s, lay, ep, 1);
    plan_finish(&m);
    return m;
}

/* A (tp-local) shape's parameters by layer under ep (rank 0's experts
 * only), and its tensors of no layer: what a stage's count needs, kept per
 * (shape, ep) as arch_tensors keeps its tables (the search counts every
 * stage of millions of layouts over a handful of shapes; the spec is
 * compared byte for byte). Sums of integers below 2^53: exact in any order. */
typedef struct {
    ArchSpec s;
    int ep;
    double *per_layer;  /* [n_layer] */
    ArchTensor *rest;   /* the embeddings, final norm, head */
    int n_rest;
} StageCounts;
#define STAGE_MEMO 8
static StageCounts stage_memo[STAGE_MEMO];
static int stage_memo_next;

static const StageCounts *stage_counts(const ArchSpec *local, int ep) {
    for (int i = 0; i < STAGE_MEMO; i++)
        if (stage_memo[i].per_layer && stage_memo[i].ep == ep && !memcmp(&stage_memo[i].s, local, sizeof *local))
            return &stage_memo[i];
    StageCounts *c = &stage_memo[stage_memo_next++ % STAGE_MEMO];
    free(c->per_layer), free(c->rest);
    c->s = *local, c->ep = ep, c->n_rest = 0;
    c->per_layer = xcalloc((size_t)local->n_layer + 1, sizeof(double));
    int n;
    const ArchTensor *t = arch_tensors_view(local, 0, &n);
    c->rest = xcalloc((size_t)n + 1, sizeof(ArchTensor));
    for (int i = 0; i < n; i++) {
        if (t[i].expert >= 0 && ep > 1 && t[i].expert >= local->moe.n_experts / ep) continue; /* rank 0's experts */
        if (t[i].layer >= 0) c->per_layer[t[i].layer] += (double)t[i].numel;
        else c->rest[c->n_rest++] = t[i];
    }
    return c;
}

/* One pipeline rank: its chunks' tensors (under ep its experts) and
 * activation slots, with the expert side's buffers per slot. ZeRO shards
 * over the stage's dp x cp ranks; ZeRO-2/3 hold the stage's whole gradients
 * (accumulated over the step, reduce-scattered once: ddp.c accum_grads). */
static PlanMemory plan_memory_stage(const ArchSpec *g, const PlanLayout *lay, int chunks, const int *lo, const int *hi,
                                    const int *slots, int split) {
    int tp = lay->tp, sp = lay->sp, cp = lay->cp, cp_mode = lay->cp_mode, dp = lay->dp, ep = lay->ep, zero = lay->zero;
    int micro_batch = lay->micro_batch;
    ModelRecompute rec = lay->recompute;
    size_t moment_bytes = lay->moment_bytes, param_bytes = lay->param_bytes;
    PlanMemory m = {0};
    ArchSpec local;
    arch_tp_local(g, tp, 0, &local);
    const StageCounts *sc = stage_counts(&local, ep);
    double params = 0, layer = 0, rest = 0; /* the stage's, its largest layer's, its non-layer tensors' */
    for (int k = 0; k < chunks; k++)
        for (int l = lo[k]; l < hi[k]; l++) {
            params += sc->per_layer[l];
            layer = sc->per_layer[l] > layer ? sc->per_layer[l] : layer;
        }
    for (int i = 0; i < sc->n_rest; i++) {
        int in = 0;
        for (int k = 0; k < chunks; k++) in = in || arch_tensor_in_stage(&local, &sc->rest[i], lo[k], hi[k]);
        if (in) params += (double)sc->rest[i].numel, rest += (double)sc->rest[i].numel;
    }
    int sets = 0, n_sets = 0; /* (slot, layer) pairs: ep.c's buffers; activation sets */
    for (int k = 0; k < chunks; k++) sets += slots[k] * (hi[k] - lo[k]), n_sets += slots[k];
    dp *= cp;
    double shard = (double)(((size_t)params + (size_t)dp - 1) / (size_t)dp);
    m.param_bytes = param_bytes;
    m.count = params;
    if (zero >= 2 && dp > 1) { /* the stage's units padded as ddp pads them (ddp_unit_align) */
        double a = (double)ddp_unit_align(dp), padded = ceil(rest / a) * a;
        for (int k = 0; k < chunks; k++)
            for (int l = lo[k]; l < hi[k]; l++) padded += ceil(sc->per_layer[l] / a) * a;
        layer = ceil(layer / a) * a, rest = ceil(rest / a) * a, params = padded, shard = params / dp + 1;
    }
    if (zero >= 2 && dp > 1) {
        m.grads = shard * 4;
        m.grads_unreduced = params * 4;
        m.optim = shard * 2 * moment_bytes;
        if (zero == 3) m.params = shard * 4, m.params_gathered = (2 * layer + rest) * 4;
        else m.params = params * 4, m.params_shard = shard * 4;
    } else {
        m.params = params * (double)param_bytes;
        m.grads = params * 4;
        m.optim = (zero == 1 ? shard : params) * 2 * moment_bytes;
    }
    m.muon = lay->muon ? plan_muon_bytes(&local, lay, dp, chunks, lo, hi) : 0;
    m.state = m.params + m.params_shard + m.params_gathered + m.grads + m.grads_unreduced + m.optim + m.muon;
    AttnShape cps = {micro_batch, local.seq_len / cp, local.n_head, local.n_kv_head, local.head_dim, NULL};
    for (int r = MODEL_RECOMPUTE_NONE; r < MODEL_RECOMPUTE_MODES; r++)
        for (int k = 0; k < 2; k++) {
            size_t ab = k ? 2 : sizeof(float);
            m.act_by_mode[r][k] = (double)model_activation_bytes_stage(g, tp, cp, sp, ep, micro_batch, g->seq_len, ab,
                                                                       (ModelRecompute)r, lay->recompute_every,
                                                                       lay->loss_chunk, chunks, lo, hi, slots, split) +
                                  (double)ep_buffer_bytes(g, ep, cp, sets, micro_batch, g->seq_len, ab, (ModelRecompute)r);
            if (cp > 1) m.act_by_mode[r][k] += (double)cp_buffer_bytes(&cps, cp, (CpMode)cp_mode, ab);
        }
    m.cp_buffers = cp > 1 ? (double)cp_buffer_bytes(&cps, cp, (CpMode)cp_mode, lay->act_bytes == 2 ? 2 : 4) : 0;
    m.recompute = rec;
    m.loss_chunk = lay->loss_chunk;
    for (int k = 0; k < 3; k++) {
        int lc[3] = {0, -1, lay->loss_chunk};
        m.arena_by_chunk[k] = (double)model_activation_bytes_stage(g, tp, cp, sp, ep, micro_batch, g->seq_len,
                                                                   lay->act_bytes == 2 ? 2 : 4, rec,
                                                                   lay->recompute_every, lc[k], chunks, lo, hi,
                                                                   slots, split);
    }
    plan_pick_dtype(&m, lay, params);
    plan_add_fp8(&m, &local, lay, ep, n_sets);
    plan_finish(&m);
    return m;
}

/* The schedules the planner has built, by (kind, pp, v, micro): whether
 * pipe_check accepts it, its bubble and its slots. Building and simulating
 * a schedule is the cost of a search (thousands of layouts share a few
 * dozen schedules), so each is built once per process. */
typedef struct {
    int kind, p, v, micro, ok;
    double bubble;
    int *slots; /* [p * v] */
    char err[256];
} PlanPipeEntry;
static PlanPipeEntry *plan_pipes;
static int plan_npipes, plan_cappipes;

const int *plan_pipe_info(int kind, int p, int v, int micro, double *bubble, char *err, size_t errn) {
    for (int i = 0; i < plan_npipes; i++) {
        PlanPipeEntry *e = &plan_pipes[i];
        if (e->kind == kind && e->p == p && e->v == v && e->micro == micro) {
            if (!e->ok) snprintf(err, errn, "%s", e->err);
            if (bubble) *bubble = e->bubble;
            return e->ok ? e->slots : NULL;
        }
    }
    if (plan_npipes == plan_cappipes) {
        plan_cappipes = plan_cappipes ? 2 * plan_cappipes : 32;
        plan_pipes = xrealloc(plan_pipes, (size_t)plan_cappipes * sizeof *plan_pipes);
    }
    PlanPipeEntry *e = &plan_pipes[plan_npipes++];
    memset(e, 0, sizeof *e);
    e->kind = kind, e->p = p, e->v = v, e->micro = micro;
    if (pipe_check_shape((PipeKind)kind, p, v, micro, e->err, sizeof e->err) == 0) {
        PipeSchedule sc;
        pipe_build(&sc, (PipeKind)kind, p, v, micro);
        if (pipe_check(&sc, e->err, sizeof e->err) == 0) {
            e->ok = 1;
            e->bubble = pipe_theory_bubble(&sc);
            e->slots = xmalloc((size_t)p * v * sizeof(int));
            memcpy(e->slots, sc.slots, (size_t)p * v * sizeof(int));
        }
        pipe_schedule_free(&sc);
    }
    if (!e->ok) snprintf(err, errn, "%s", e->err);
    if (bubble) *bubble = e->bubble;
    return e->ok ? e->slots : NULL;
}

int plan_memory_pp(const ArchSpec *s, const PlanLayout *lay, int kind, int p, int v, const int *given, int n_given,
                   int micro, PlanMemory *worst, PlanMemory *stages, double *bubble, char *err, size_t errn) {
    int cut[PIPE_MAX_STAGES + 1];
    PipeKind k = (PipeKind)kind;
    const int *sl = plan_pipe_info(kind, p, v, micro, bubble, err, errn);
    if (!sl) return -1;
    if (pipe_plan_stages(s, p, v, given, n_given, cut, err, errn) != 0) return -1;
    for (int r = 0; r < p; r++) {
        int lo[MODEL_MAX_CHUNKS], hi[MODEL_MAX_CHUNKS], slots[MODEL_MAX_CHUNKS];
        for (int ch = 0; ch < v && ch < MODEL_MAX_CHUNKS; ch++)
            lo[ch] = cut[ch * p + r], hi[ch] = cut[ch * p + r + 1], slots[ch] = sl[r * v + ch];
        PlanMemory m = plan_memory_stage(s, lay, v, lo, hi, slots, k == PIPE_ZB_H1);
        if (stages) stages[r] = m;
        if (r == 0 || m.total > worst->total) *worst = m;
    }
    return 0;
}

int plan_print_pp(const ArchSpec *s, const Config *c, int tp, int dp, int micro, int show_timeline,
                  PlanMemory *worst, char *err, size_t errn) {
    int p = c->pp, v = c->pp_virtual, cut[PIPE_MAX_STAGES + 1];
    PipeKind k = (PipeKind)pipe_kind_parse(c->pp_schedule);
    PlanLayout lay = plan_layout(c, dp);
    lay.tp = tp;
    PlanMemory *st = xcalloc((size_t)p, sizeof *st);
    double theory;
    if (plan_memory_pp(s, &lay, k, p, v, c->pp_layers, c->n_pp_layers, micro, worst, st, &theory, err, errn) != 0) {
        free(st);
        return -1;
    }
    pipe_plan_stages(s, p, v, c->pp_layers, c->n_pp_layers, cut, err, errn);
    double formula = pipe_formula_bubble(k, p, v, micro);
    printf("  pipeline               pp %d, %s%s, %d micro-batches per rank and step: bubble %.1f%% of the step "
           "(%s = %.1f%% of the compute)\n", p, c->pp_schedule, v > 1 ? " with virtual chunks" : "", micro,
           100.0 * theory, k == PIPE_INTERLEAVED ? "(p-1)/(v m)" : k == PIPE_ZB_H1 ? "(p-1)/(3m)" : "(p-1)/m",
           100.0 * formula);
    const int *sl = plan_pipe_info(k, p, v, micro, NULL, err, errn); /* built and checked above */
    for (int r = 0; r < p; r++) {
        int held = 0;
        char layers[256];
        size_t o = 0;
        for (int ch = 0; ch < v && ch < MODEL_MAX_CHUNKS; ch++) {
            held += sl[r * v + ch];
            if (o < sizeof layers)
                o += (size_t)snprintf(layers + o, sizeof layers - o, "%s%d..%d", ch ? ", " : "", cut[ch * p + r],
                                      cut[ch * p + r + 1] - 1);
        }
        printf("  stage %-16d layers %s%s%s: %.2fM parameters, %d activation slot(s) %.2f MiB; %.2f GiB per rank\n",
               r, layers, r == 0 ? " + embeddings" : "", r == p - 1 ? " + head" : "",
               st[r].count / 1e6, held, st[r].activations / 1048576.0, st[r].total / (1024.0 * 1024 * 1024));
    }
    free(st);
    if (show_timeline) {
        PipeSchedule sc;
        pipe_build(&sc, k, p, v, micro);
        char *t = pipe_timeline(&sc);
        printf("  schedule               one rank a row, one time unit a cell (a forward; %s)\n", k == PIPE_ZB_H1 ?
               "B the input part of a backward, W its weight part" : "a backward takes two");
        for (char *line = strtok(t, "\n"); line; line = strtok(NULL, "\n")) printf("    %s\n", line);
        free(t);
        pipe_schedule_free(&sc);
    }
    return 0;
}

PlanComm plan_comm_per_step(const ArchSpec *s, int tp, int sp, int dp, int ep, int zero, int micro_batch, int micro,
                            size_t act_bytes) {
    PlanComm c = {0};
    if (ep < 1 || s->mlp != MLP_MOE) ep = 1;
    double N = (double)micro_batch * s->seq_len, NC = N * s->n_embd * (double)act_bytes;
    if (tp > 1) {
        double k = tp, ag = (k - 1) / k, ar = 2 * ag; /* per byte of the whole buffer */
        int moe = s->mlp == MLP_MOE, L = s->n_layer;
        double per;
        if (sp) {
            /* a dense layer: gather before and reduce-scatter after each of
             * the two split products, forward; gather the gradient and
             * reduce-scatter the input gradient of each, backward. MoE: the
             * attention's four, the MLP's input gathered forward and its
             * output gradient backward. The embedding and the head one each way. */
            per = (L * (moe ? 6.0 : 8.0) + 4.0) * ag * NC;
            c.tp_collectives = L * (moe ? 6 : 8) + 4;
        } else {
            /* an all-reduce after each row-parallel product (forward) and
             * of each column-parallel input gradient (backward) */
            per = (L * (moe ? 2.0 : 4.0) + 2.0) * ar * NC;
            c.tp_collectives = L * (moe ? 2 : 4) + 2;
        }
        per += ag * tp * N * 3 * 4; /* the cross-entropy statistics */
        c.tp = per * micro;
        c.tp_collectives += 1;
    }
    if (dp > 1) {
        ArchSpec l;
        arch_tp_local(s, tp, 0, &l);
        double X = plan_expert_params(&l) * 4, P = (double)arch_num_params(&l) * 4 - X, k = dp, ag = (k - 1) / k;
        double ke = (double)dp / ep, age = (ke - 1) / ke;
        /* ZeRO 0/1: one all-reduce (ZeRO-1: reduce-scatter + all-gather, the
         * same bytes); ZeRO 2: each micro-batch's backward reduce-scatters
         * every layer (ddp.c's unit mode), then the parameters' all-gather
         * after the step; ZeRO 3: the reduce-scatters, and the forward's and
         * backward's gathers of every layer in every micro-batch; the
         * experts over EDP (whole with ep 1) */
        if (zero <= 1) c.dp = 2 * ag * P + 2 * age * X / ep;
        else if (zero == 2) c.dp = (micro + 1.0) * ag * (P + X);
        else c.dp = 3.0 * micro * ag * (P + X);
    }
    if (ep > 1) {
        double rows = (double)micro_batch * s->seq_len * s->moe.top_k;
        c.ep = 4.0 * s->n_layer * micro * (ep - 1.0) / ep * rows * s->n_embd * (double)act_bytes;
    }
    return c;
}

void plan_print_tp(const ArchSpec *s, int tp, int sp, int dp, int ep, int zero, int micro_batch, int micro) {
    if (tp <= 1 && dp <= 1) return;
    if (tp > 1) {
        ArchSpec l;
        arch_tp_local(s, tp, 0, &l);
        printf("  tensor parallel        tp %d, sequence parallel %s: per rank %d of %d heads, %d of %d kv heads, MLP "
               "%d of %d, vocabulary rows %d (%d padded to %d x %d)%s\n", tp, sp ? "on" : "off", l.n_head, s->n_head,
               l.n_kv_head, s->n_kv_head, s->mlp == MLP_MOE ? s->ffn_hidden : l.ffn_hidden, s->ffn_hidden,
               l.padded_vocab, s->vocab_size, l.padded_vocab, tp,
               s->mlp == MLP_MOE ? "; MoE layers replicated over tp" : "");
    }
    if (ep > 1 && s->mlp == MLP_MOE)
        printf("  expert parallel        ep %d: per rank %d of %d experts per layer, up to %zu rows received per "
               "layer (%s)\n", ep, s->moe.n_experts / ep, s->moe.n_experts, ep_plan_rows(s, ep, 1, micro_batch, s->seq_len),
               arch_moe_capacity(s, s->seq_len) > 0 ? "the capacity's worst case" : "dropless: grown when needed");
    PlanComm c32 = plan_comm_per_step(s, tp, sp, dp, ep, zero, micro_batch, micro, 4);
    PlanComm c16 = plan_comm_per_step(s, tp, sp, dp, ep, zero, micro_batch, micro, 2);
    if (tp > 1)
        printf("  comm per step, tp      %.4g GB sent per rank (%.4g GB with bf16 activations), %d collectives per "
               "micro-batch\n", c32.tp / 1e9, c16.tp / 1e9, c32.tp_collectives);
    if (dp > 1) printf("  comm per step, dp      %.4g GB sent per rank (fp32 gradients, ZeRO %d)\n", c32.dp / 1e9, zero);
    if (ep > 1 && s->mlp == MLP_MOE)
        printf("  comm per step, ep      %.4g GB sent per rank (%.4g GB with bf16 activations; an even load), 4 "
               "all-to-alls per MoE layer and micro-batch\n", c32.ep / 1e9, c16.ep / 1e9);
}

void plan_print_bytes(const char *what, double bytes) {
    const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (bytes >= 1024.0 && u < 4) bytes /= 1024.0, u++;
    printf("  %-22s %9.2f %s\n", what, bytes, unit[u]);
}

#define GIB (1024.0 * 1024.0 * 1024.0)

void plan_print_activations(const PlanMemory *m) {
    int k = m->act_bytes == 2; /* act_by_mode's column of the counted dtype */
    const char *dt = k ? "bf16" : "fp32", *other = k ? "fp32" : "bf16";
    char what[64];
    plan_print_bytes("activations", m->activations); /* in dt: the one the total counts */
    if (m->cp_buffers > 0) plan_print_bytes("  of which cp K/V", m->cp_buffers);
    snprintf(what, sizeof what, "activations, %s", other);
    plan_print_bytes(what, m->activations_other);
    const double(*by)[2] = m->act_by_mode;
    if (m->recompute == MODEL_RECOMPUTE_NONE)
    {
        char sel[64] = ""; /* selective: where it differs from norm_gelu (MoE layers) */
        if (by[MODEL_RECOMPUTE_SELECTIVE][k] != by[MODEL_RECOMPUTE_NORM_GELU][k])
            snprintf(sel, sizeof sel, ", selective %.2f GiB", (by[0][k] - by[MODEL_RECOMPUTE_SELECTIVE][k]) / GIB);
        printf("  recompute              none (model.recompute: gelu would take %.2f GiB less in %s, norm_gelu "
               "%.2f GiB, block %.2f GiB%s)\n", (by[0][k] - by[1][k]) / GIB, dt, (by[0][k] - by[2][k]) / GIB,
               (by[0][k] - by[MODEL_RECOMPUTE_BLOCK][k]) / GIB, sel);
    }
    else
        printf("  recompute              %s (model.recompute): %.2f GiB less than none in %s, %.2f GiB in %s\n",
               model_recompute_name(m->recompute), (by[0][k] - m->activations) / GIB, dt,
               (by[0][!k] - m->activations_other) / GIB, other);
    const double *a = m->arena_by_chunk; /* whole, auto, as set */
    if (m->loss_chunk != 0)
        printf("  loss in chunks         model.loss_chunk %s: %.2f GiB less than the whole logits in %s\n",
               m->loss_chunk < 0 ? "auto" : "as set", (a[0] - a[2]) / GIB, dt);
    else if (a[0] > a[1])
        printf("  loss in chunks         none (model.loss_chunk: auto would take %.2f GiB less in %s)\n",
               (a[0] - a[1]) / GIB, dt);
    const ModelFp8Bytes *f = &m->fp8;
    if (f->operands + f->scales + f->histories > 0) {
        plan_print_bytes("fp8 buffers", (double)(f->operands + f->scales + f->histories));
        plan_print_bytes("  operands and codes", (double)f->operands);
        plan_print_bytes("  amaxes, scales", (double)f->scales);
        if (f->histories) plan_print_bytes("  amax histories", (double)f->histories);
    }
}

void plan_print_state(const PlanMemory *m, int dp, int zero) {
    if (zero >= 2 && dp > 1) {
        if (zero == 3) {
            plan_print_bytes("parameters (1/dp)", m->params);
            plan_print_bytes("  + gathered", m->params_gathered);
        } else {
            plan_print_bytes("parameters", m->params);
            plan_print_bytes("  + fp32 shard (1/dp)", m->params_shard);
        }
        plan_print_bytes("gradients (1/dp)", m->grads);
        plan_print_bytes("  + unreduced", m->grads_unreduced);
        plan_print_bytes("optimizer state (1/dp)", m->optim);
    } else {
        plan_print_bytes(m->param_bytes == 2 ? "parameters, bf16" : "parameters", m->params);
        plan_print_bytes("gradients", m->grads);
        plan_print_bytes(zero == 1 ? "optimizer state (1/dp)" : "optimizer state", m->optim);
    }
    if (m->muon > 0) plan_print_bytes("  + muon buffers", m->muon);
    if (m->compute_copy > 0) plan_print_bytes("bf16 compute copy", m->compute_copy);
    plan_print_bytes("params + grads + optim", m->state);
}

static long plan_parse_count(const char *flag, const char *v) {
    char *end;
    errno = 0;
    long n = strtol(v, &end, 10);
    if (!*v || *end || errno || n < 1 || n > 1000000)
        kiln_fail(KILN_EXIT_USAGE, "%s: expected a count in [1, 1000000], got '%s'", flag, v);
    return n;
}

/* The value of `--flag V` or `--flag=V` at argv[*i], or NULL if argv[*i] is another flag. */
static const char *plan_flag_value(const char *flag, int argc, char **argv, int *i) {
    size_t n = strlen(flag);
    if (strncmp(argv[*i], flag, n) != 0) return NULL;
    if (argv[*i][n] == '=') return argv[*i] + n + 1;
    if (argv[*i][n] != '\0') return NULL;
    if (*i + 1 >= argc) kiln_fail(KILN_EXIT_USAGE, "%s needs a value (./train plan --help)", flag);
    return argv[++*i];
}

/* Divisors of n, largest first; returns how many (at most cap). */
static int plan_divisors(int64_t n, int *out, int cap) {
    int k = 0, hi = 0;
    int small[64], large[64];
    for (int64_t d = 1; d * d <= n && k < 64 && hi < 64; d++) {
        if (n % d) continue;
        small[k++] = (int)d;
        if (d != n / d && n / d <= INT32_MAX) large[hi++] = (int)(n / d);
    }
    int m = 0;
    for (int j = 0; j < hi && m < cap; j++) m++, out[m - 1] = large[j];
    for (int j = k - 1; j >= 0 && m < cap; j--) m++, out[m - 1] = small[j];
    return m;
}

int plan_main(int argc, char **argv) {
    const char *config_path = NULL;
    const char **sets = xcalloc((size_t)argc, sizeof(char *));
    int nsets = 0, gpus = 0, nodes = 1;
    double gpu_gib = 80.0;
    int gpu_mem_given = 0, show_schedule = 0, search = 0, json = 0, top = 5, nodes_given = 0, auto_sets = 0;
    const char *hardware = "h100";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "--show-schedule")) {
            show_schedule = 1;
        } else if (!strcmp(a, "--search")) {
            search = 1;
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else if (!strcmp(a, "--auto-sets")) {
            auto_sets = search = 1;
        } else if ((v = plan_flag_value("--top", argc, argv, &i))) {
            top = (int)plan_parse_count("--top", v);
        } else if ((v = plan_flag_value("--hardware", argc, argv, &i))) {
            hardware = v;
        } else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(plan_usage, stdout);
            free(sets);
            return KILN_EXIT_OK;
        } else if ((v = plan_flag_value("--set", argc, argv, &i))) {
            sets[nsets++] = v;
        } else if ((v = plan_flag_value("--gpus", argc, argv, &i))) {
            gpus = (int)plan_parse_count("--gpus", v);
        } else if ((v = plan_flag_value("--nodes", argc, argv, &i))) {
            nodes = (int)plan_parse_count("--nodes", v), nodes_given = 1;
        } else if ((v = plan_flag_value("--gpu-mem", argc, argv, &i))) {
            char *end;
            errno = 0;
            gpu_gib = strtod(v, &end);
            if (!*v || *end || errno || !(gpu_gib > 0) || gpu_gib > 1e6)
                kiln_fail(KILN_EXIT_USAGE, "--gpu-mem: expected GiB per GPU, a number in (0, 1e6], got '%s'", v);
            gpu_mem_given = 1;
        } else if (a[0] == '-') {
            kiln_fail_hint(KILN_EXIT_USAGE, "./train plan --help lists the flags", "unknown flag '%s'", a);
        } else if (!config_path) {
            config_path = a;
        } else {
            kiln_fail(KILN_EXIT_USAGE, "more than one config file given ('%s' and '%s')", config_path, a);
        }
    }
    if (!config_path) kiln_fail(KILN_EXIT_USAGE, "plan: no config file given (./train plan --help)");
    if (!gpus) kiln_fail(KILN_EXIT_USAGE, "plan: --gpus N is required: how many GPUs in total (./train plan --help)");
    if (gpus % nodes)
        kiln_fail(KILN_EXIT_USAGE, "--gpus %d do not split evenly over --nodes %d (give the total, a multiple of the nodes)",
                  gpus, nodes);

    Config c;
    cfg_load(&c, config_path, sets, nsets);
    free(sets);
    ArchSpec s;
    arch_from_config(&c, &s);
    /* the machine: a profile's memory unless --gpu-mem says otherwise; the
     * allocation's GPUs per node (--nodes) over the profile's */
    HwProfile hw;
    hw_resolve(hardware, &hw);
    if (hw.threads > 0 && !strcmp(c.device, "auto")) /* this machine: the CPU backend, fp32 */
        snprintf(c.device, sizeof c.device, "cpu");
    if (gpu_mem_given) hw.mem_bytes = gpu_gib * GIB;
    else gpu_gib = hw.mem_bytes / GIB;
    if (!nodes_given) {
        nodes = gpus > hw.gpus_per_node ? (gpus + hw.gpus_per_node - 1) / hw.gpus_per_node : 1;
        if (gpus % nodes)
            kiln_fail(KILN_EXIT_USAGE, "--gpus %d do not fill whole nodes of %d GPUs (%s); give --nodes", gpus,
                      hw.gpus_per_node, hw.name);
    }
    hw.gpus_per_node = gpus / nodes;
    /* cpu: the ranks of one machine share its all-cores rate */
    if (hw.node_flops > 0 && hw.node_flops / hw.gpus_per_node < hw.flops_fp32)
        hw.flops_bf16 = hw.flops_fp32 = hw.node_flops / hw.gpus_per_node;
    if (auto_sets && strcmp(c.layout, "auto")) return KILN_EXIT_OK; /* the config fixes its layout */
    if (search || json) return plan_search_main(&c, &s, &hw, config_path, gpus, nodes, search, json, top, auto_sets);
    double cap = gpu_gib * GIB;

    /* Validity. dp: the config's, or auto = every GPU; a mismatch is reported
     * and the rest is planned for dp = gpus. */
    char problem[768] = "";
    MeshShape ms = {{c.pp, c.dp, c.cp, c.tp}, c.ep};
    char err[512];
    if (mesh_plan(&ms, gpus, err, sizeof err) != 0) {
        snprintf(problem, sizeof problem, "%s", err);
        ms.size[MESH_DP] = gpus / (c.pp * c.cp * c.tp);
    }
    int dp = ms.size[MESH_DP];
    int tp = c.tp, sp = tp > 1 && strcmp(c.sequence_parallel, "false") != 0;
    if (!problem[0]) arch_tp_check(&s, tp, problem, sizeof problem);
    int64_t per_sample = (int64_t)c.seq_len * dp; /* tokens of one sample on every rank */
    int64_t unit = (int64_t)c.micro_batch * per_sample;
    int64_t rank_samples = c.total_tokens % per_sample ? 0 : c.total_tokens / per_sample;
    if (!problem[0] && c.total_tokens % unit) {
        int64_t lo = c.total_tokens / unit * unit;
        char alt[160] = "";
        if (rank_samples)
            snprintf(alt, sizeof alt, ", or batch.micro_batch to a divisor of %lld", (long long)rank_samples);
        char nearest[96];
        if (lo) snprintf(nearest, sizeof nearest, "%lld or %lld", (long long)lo, (long long)(lo + unit));
        else snprintf(nearest, sizeof nearest, "%lld", (long long)unit);
        snprintf(problem, sizeof problem,
                 "key 'batch.total_tokens': %lld tokens do not split into micro-batches of %d x %d tokens on %d "
                 "ranks; set it to a multiple of micro_batch*seq_len*dp = %lld (nearest: %s)%s",
                 (long long)c.total_tokens, c.micro_batch, c.seq_len, dp, (long long)unit, nearest, alt);
    }

    PlanLayout lay = plan_layout(&c, dp);
    size_t pb = lay.param_bytes;
    PlanMemory m = plan_memory_per_rank(&s, &lay);
    if (c.pp > 1) rank_samples = 0; /* no suggestion yet: the stages above say what each rank holds */
    size_t params = plan_num_params(&s);
    printf("plan for %s (%s, %d layers, %d heads, %d wide, context %d, vocab %d padded to %d): %zu parameters "
           "(%.2fM)\n", c.run_name, c.arch, s.n_layer, s.n_head, s.n_embd, s.seq_len, s.vocab_size, s.padded_vocab,
           params, params / 1e6);
    printf("  GPUs                   %d (%d node%s x %d), %.2f GiB each (%s%s)\n", gpus, nodes, nodes > 1 ? "s" : "",
           gpus / nodes, gpu_gib, hw.name, gpu_mem_given ? ", --gpu-mem" : "; --hardware, --gpu-mem GB");
    printf("  layout                 dp %d x tp %d x pp %d x cp %d (ep %d), ZeRO %d%s\n", dp, c.tp, c.pp, c.cp, c.ep,
           c.zero, c.dp > 0 ? "" : " (parallel.dp: auto)");
    if (c.cp > 1)
        printf("  context parallel       cp %d (%s): each rank holds 2 of %d chunks of %d tokens, %d of every "
               "sequence's %d\n", c.cp, c.cp_attention, 2 * c.cp, c.seq_len / (2 * c.cp), c.seq_len / c.cp, c.seq_len);
    if (!problem[0]) plan_print_tp(&s, tp, sp, dp, c.ep, c.zero, c.micro_batch, c.grad_accum / dp);
    if (!problem[0] && c.pp > 1) { /* each stage; the costliest decides */
        PlanMemory worst = {0};
        if (plan_print_pp(&s, &c, tp, dp, c.grad_accum / dp, show_schedule, &worst, problem, sizeof problem) == 0)
            m = worst;
    }
    if (!problem[0])
        printf("  batch                  %lld tokens = %d ranks x %d accumulation steps x micro-batch %d x %d tokens\n",
               (long long)c.total_tokens, dp, c.grad_accum / dp, c.micro_batch, c.seq_len);
    else
        printf("  batch                  %lld tokens, micro-batch %d x %d tokens: INVALID (below)\n",
               (long long)c.total_tokens, c.micro_batch, c.seq_len);
    printf("  memory per rank        fp32 storage (%sgradients%s; activations in %s)\n",
           plan_param_bytes(c.master) == 2 ? "bf16 parameters without a master; " : "parameters, ",
           optim_state_bytes(c.optim_state) == 2 ? "; AdamW m and v in bf16" : ", AdamW m and v",
           m.act_bytes == 2 ? "bf16, the CUDA backend's precision.compute bf16" : "fp32");
    plan_print_state(&m, dp * c.cp, c.zero);
    plan_print_activations(&m);
    plan_print_bytes("overhead", m.overhead);
    printf("                         (32 MiB cuBLAS workspace + 5%% margin for the allocator and the uncounted)\n");
    plan_print_bytes("total per rank", m.total);
    plan_print_bytes("GPU memory", cap);
    if (!problem[0]) { /* the time model (docs/planner.md "Time model") for the layout as configured */
        Config *cc = xmalloc(sizeof *cc);
        *cc = c;
        PlanCand k;
        char terr[1024];
        if (plan_evaluate(&c, cc, &s, &hw, gpus, nodes, &k, terr, sizeof terr) >= 0) {
            const PlanTime *t = &k.time;
            printf("  time per step          %.3f s on %s: compute %.1f ms, tp %.1f, cp %.1f, ep %.1f, bubble %.1f, "
                   "pp p2p %.1f, dp %.1f exposed of %.1f, optimizer %.1f\n", t->step, hw.name, t->compute * 1e3,
                   t->tp * 1e3, t->cp * 1e3, t->ep * 1e3, t->bubble * 1e3, t->pp_p2p * 1e3, t->dp * 1e3,
                   t->dp_total * 1e3, t->optim * 1e3);
            printf("  throughput             %.0f tokens/s per GPU, MFU %.1f%% (of %.0f TFLOP/s)\n",
                   t->tokens_per_s_per_gpu, 100 * t->mfu, t->peak / 1e12);
        }
        free(cc);
    }

    /* Suggestion: smallest ZeRO stage, then largest micro-batch dividing this
     * rank's samples per step, that fits. Needs a whole number of samples per
     * rank; otherwise only total_tokens can change. */
    int best_zero = -1, best_mb = 0;
    PlanMemory best = {0}, least = {0};
    int least_zero = -1;
    if (rank_samples > 0) {
        int div[128];
        int nd = plan_divisors(rank_samples, div, 128);
        /* precision.master bf16 is ZeRO 0 only (its parameters are not sharded) */
        int max_zero = pb == 2 ? 0 : c.ep > 1 ? 1 : 3; /* and expert parallelism ZeRO 0 or 1 */
        for (int z = 0; z <= max_zero && best_zero < 0; z++) {
            for (int j = 0; j < nd; j++) {
                PlanLayout lz = lay;
                lz.zero = z, lz.micro_batch = div[j];
                PlanMemory t = plan_memory_per_rank(&s, &lz);
                if (t.total <= cap) {
                    best_zero = z, best_mb = div[j], best = t;
                    break;
                }
            }
            PlanLayout l1 = lay;
            l1.zero = z, l1.micro_batch = 1;
            PlanMemory t1 = plan_memory_per_rank(&s, &l1);
            if (least_zero < 0 || t1.total < least.total) least = t1, least_zero = z;
        }
    }
    char flags[512] = "";
    PlanCand change;
    if (best_zero >= 0) {
        int n = 0;
        if (c.dp > 0 && c.dp != dp) n += snprintf(flags + n, sizeof flags - n, "--set parallel.dp=auto ");
        snprintf(flags + n, sizeof flags - n, "--set parallel.zero=%d --set batch.micro_batch=%d", best_zero, best_mb);
        printf("suggest: %s   (%.2f GiB of %.2f GiB per rank; %lld micro-batches per rank per step%s)\n", flags,
               best.total / GIB, gpu_gib, (long long)(rank_samples / best_mb),
               best_zero == c.zero && best_mb == c.micro_batch && !(c.dp > 0 && c.dp != dp) ? "; as configured" : "");
    } else if ((rank_samples > 0 || c.pp > 1) && m.total > cap && !problem[0] &&
               plan_cheapest_change(&c, &s, &hw, gpus, nodes, &change) == 0) {
        /* ZeRO and the micro-batch alone do not make it fit: the layout with
         * the fewest keys changed that does (tp, sp, pp, cp, recompute ...) */
        char lt[256];
        plan_cand_layout_text(&change, lt, sizeof lt);
        snprintf(flags, sizeof flags, "%s", change.set);
        best_zero = change.run.lay.zero;
        printf("suggest: %s   (%.2f GiB of %.2f GiB per rank: %s; the fewest keys changed that fit, %d; "
               "./train plan --search ranks every layout)\n", flags, change.mem.total / GIB, gpu_gib, lt,
               change.changes);
    } else if (rank_samples > 0) {
        printf("suggest: nothing fits in %.2f GiB: the smallest layout (ZeRO %d, micro-batch 1) needs %.2f GiB per "
               "rank, and no other layout of %d GPUs fits (./train plan --search); use more GPUs or GPUs with "
               "more memory\n", gpu_gib, least_zero, least.total / GIB, gpus);
    } else if (c.pp > 1) {
        printf("suggest: none (the stages above: the configured ZeRO stage and micro-batch)\n");
    } else {
        printf("suggest: none until batch.total_tokens is a multiple of seq_len*dp = %lld\n", (long long)per_sample);
    }

    if (problem[0]) {
        printf("verdict: invalid layout\n");
        fflush(stdout);
        fprintf(stderr, "kiln: error: %s\n", problem);
        return KILN_EXIT_USAGE;
    }
    if (m.total <= cap) {
        printf("verdict: fits: %.2f GiB of %.2f GiB per rank (%.2f GiB free)\n", m.total / GIB, gpu_gib,
               (cap - m.total) / GIB);
        return KILN_EXIT_OK;
    }
    if (best_zero >= 0)
        printf("verdict: does not fit: %.2f GiB per rank, %.2f GiB over the %.2f GiB of a GPU; use %s\n",
               m.total / GIB, (m.total - cap) / GIB, gpu_gib, flags);
    else
        printf("verdict: does not fit: %.2f GiB per rank, %.2f GiB over the %.2f GiB of a GPU; no ZeRO stage or "
               "micro-batch fits (at least %.2f GiB needed): use more GPUs or GPUs with more memory\n",
               m.total / GIB, (m.total - cap) / GIB, gpu_gib, rank_samples > 0 ? least.total / GIB : m.total / GIB);
    return KILN_EXIT_USAGE;
}
