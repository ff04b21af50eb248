/* train: one run from a resolved Config — backend, model, data, optimizer, the
 * step loop, evaluation, sampling and the run directory's files. Host logic
 * only: every tensor operation goes through the backend table. */
#include "train.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "comm.h"
#include "cp.h"
#include "data.h"
#include "ddp.h"
#include "fp8.h"
#include "ep.h"
#include "flight.h"
#include "mesh.h"
#include "tp.h"
#include "metrics.h"
#include "adafactor.h"
#include "model.h"
#include "muon.h"
#include "optim.h"
#include "pipe.h"
#include "plan.h"
#include "state.h"
#include "stop.h"
#include "testhooks.h"
#include "tokenizer.h"
#include "util.h"

/* MoE after an optimizer step: the step's expert loads summed over the dp
 * ranks (one collective, with the drop counts and the aux and z losses)
 * move the balancing bias (model.moe.bias_update_rate) and give the step's
 * router figures for the metrics (*out, whose load points into *buf); micro:
 * micro-batches per rank in the step. *buf is grown here once, the caller's
 * to free. */
typedef struct MoeStepBuf {
    int64_t *load; /* (n_layer, E) */
    double *sums;  /* (n_layer E + 4): the loads, drops, routed slots, aux and z on their way through the reduction */
} MoeStepBuf;

static void moe_after_step(Model *m, Ddp *d, Pipe *pipe, int micro, MetricsMoe *out, MoeStepBuf *buf) {
    const ArchSpec *s = &m->shape;
    if (s->mlp != MLP_MOE) return;
    size_t n = (size_t)s->n_layer * s->moe.n_experts;
    if (!buf->load) buf->load = xmalloc(n * sizeof(int64_t)), buf->sums = xmalloc((n + 4) * sizeof(double));
    double *sums = buf->sums;
    for (size_t i = 0; i < n; i++) sums[i] = (double)m->moe.load[i];
    sums[n] = (double)m->moe.drops, sums[n + 1] = (double)m->moe.routed;
    sums[n + 2] = m->moe.aux_sum, sums[n + 3] = m->moe.z_sum;
    /* the dp ranks route different sequences (expert parallelism's ep
     * ranks among them; tp ranks route the same ones): their loads add up.
     * Loads: integers below 2^53, exact in any order. */
    ddp_sum_n(d, sums, n + 4);
    if (pipe) pipe_sum(pipe, sums, n + 4); /* each stage has its own layers' loads, aux and z losses */
    int64_t *load = buf->load;
    double lo = INFINITY, hi = 0, sum = 0, sq = 0;
    for (size_t i = 0; i < n; i++) {
        load[i] = (int64_t)sums[i];
        double x = sums[i];
        lo = x < lo ? x : lo, hi = x > hi ? x : hi, sum += x, sq += x * x;
    }
    model_moe_update_bias(m, load);
    double mean = sum / (double)n, cv = mean > 0 ? sqrt(fmax(sq / (double)n - mean * mean, 0)) / mean : 0;
    double drops = sums[n], routed = sums[n + 1];
    /* the aux and z losses: their mean over the step's micro-batches on
     * every rank, the same figure on any layout */
    double mb = (double)micro * ddp_ranks(d);
    *out = (MetricsMoe){.aux = sums[n + 2] / mb, .z = sums[n + 3] / mb, .dropped = routed > 0 ? drops / routed : 0.0,
                        .load_min = lo, .load_max = hi, .load_cv = cv, .n_layer = s->n_layer,
                        .n_experts = s->moe.n_experts, .load = load};
}

/* --dry-run: the plan, without data or training. */
static void print_plan(const Config *c, const ArchSpec *s) {
    /* Counting needs the table, not the memory: a model on the CPU backend
     * with real arenas would allocate gigabytes for large shapes, so count
     * from the shape directly. */
    size_t params = arch_num_params(s);
    size_t nonemb = params - (size_t)s->padded_vocab * s->n_embd - (s->pos == POS_LEARNED ? (size_t)s->seq_len * s->n_embd : 0);
    double fpt = arch_flops_per_token(s, s->seq_len);
    int64_t tokens_per_step = c->total_tokens;
    printf("plan for %s (%s, %d layers, %d heads, %d wide, context %d, vocab %d padded to %d)\n", c->run_name, c->arch,
           s->n_layer, s->n_head, s->n_embd, s->seq_len, s->vocab_size, s->padded_vocab);
    printf("  parameters             %zu (%.2fM; %.2fM without embeddings)\n", params, params / 1e6, nonemb / 1e6);
    if (s->mlp == MLP_MOE)
        printf("  active per token       %zu (%.2fM: top %d of %d experts)\n", arch_num_active_params(s),
               arch_num_active_params(s) / 1e6, s->moe.top_k, s->moe.n_experts);
    printf("  FLOPs per token        %.4g (training: forward + backward)\n", fpt);
    /* per rank: dp auto resolves to the world size at launch; without a
     * launcher the plan shows one rank unless parallel.dp says how many */
    /* ep > 1 needs dp >= ep: the smallest such layout when dp is auto */
    int dp = c->dp > 0 ? c->dp : c->ep, tp = c->tp, cp = c->cp, sp = tp > 1 && strcmp(c->sequence_parallel, "false") != 0;
    char err[512];
    if (arch_tp_check(s, tp, err, sizeof err) != 0) kiln_fail(KILN_EXIT_USAGE, "%s", err);
    printf("  memory per rank        dp %d%s x tp %d x cp %d (ep %d)%s, ZeRO %d\n", dp,
           c->dp > 0 ? "" : " (parallel.dp: auto = ranks at launch)", tp, cp, c->ep,
           c->pp > 1 ? " (the whole model; pipeline stages below)" : "", c->zero);
    /* the same accounting `./train plan` uses (src/plan.c) */
    PlanLayout lay = plan_layout(c, dp);
    PlanMemory mem = plan_memory_per_rank(s, &lay);
    plan_print_state(&mem, dp * cp, c->zero);
    plan_print_activations(&mem);
    plan_print_tp(s, tp, sp, dp, c->ep, c->zero, c->micro_batch, c->grad_accum / dp);
    if (c->pp > 1) { /* each stage (./train plan --show-schedule draws the schedule) */
        PlanMemory worst;
        if (plan_print_pp(s, c, tp, dp, c->grad_accum / dp, 0, &worst, err, sizeof err) != 0)
            kiln_fail(KILN_EXIT_USAGE, "%s", err);
    }
    printf("  tokens per step        %lld (micro-batch %d x %d tokens x %d accumulation steps x %d ranks)\n",
           (long long)tokens_per_step, c->micro_batch, c->seq_len, c->grad_accum / dp, dp);
    printf("  micro-batches per step %d (%d per rank)\n", c->grad_accum, c->grad_accum / dp);
    printf("  steps                  %d\n", c->steps);
    long long total; /* batch.total_tokens goes to 2^62: the product may not fit */
    if (__builtin_mul_overflow((long long)tokens_per_step, (long long)c->steps, &total))
        printf("  tokens in total        %.3g (over 2^63)\n", (double)tokens_per_step * c->steps);
    else printf("  tokens in total        %lld (%.3g)\n", total, (double)total);
    printf("  FLOPs in total         %.4g\n", fpt * (double)tokens_per_step * c->steps);
}

/* Entries [first, first + count) of data.train or data.val as one loader
 * (data.train: all of them, a mixture; data.val: one set each). */
static DataLoader *open_data(const Config *c, const CfgSources *ss, int first, int count, const char *what, int shuffle,
                             int prefetch, int rank, int world) {
    DataSource src[CFG_MAX_SOURCES];
    for (int i = 0; i < count; i++)
        src[i] = (DataSource){ss->s[first + i].name, ss->s[first + i].path, ss->s[first + i].weight};
    DataOptions o = {.what = what, .sources = src, .n_sources = count, .mixture = ss->list, .B = c->micro_batch,
                     .T = c->seq_len, .vocab_size = c->vocab_size, .shuffle = shuffle, .seed = c->seed, .rank = rank,
                     .world = world, .prefetch = prefetch, .max_open = c->max_open_shards};
    return data_open(&o);
}

/* Mean loss over `batches` validation batches, always from the start of the
 * validation order so every evaluation sees the same tokens. */
static float evaluate(Model *m, Pipe *pipe, DataLoader *val, int batches, int B, int T, int32_t *inp, int32_t *tgt,
                      Ddp *d, int dp, int split) {
    data_rewind(val);
    double sum = 0.0;
    /* split: the dp ranks share the batches (the loader slices each global
     * batch by rank), so together they see the same samples as one rank */
    int mine = split ? batches / dp : batches;
    for (int i = 0; i < mine; i++) {
        data_next_batch(val, inp, tgt);
        /* pipeline: through every stage; the last has the loss */
        sum += pipe ? pipe_forward(pipe, inp, tgt, B, T) : model_forward(m, inp, tgt, B, T, 0.0f);
    }
    if (pipe) pipe_sum(pipe, &sum, 1);
    /* cp: each rank's mean is of its chunks, the same number of tokens on
     * every cp rank; ddp sums over dp x cp */
    int cp = ddp_ranks(d) / dp;
    if (split) sum = ddp_sum(d, sum) / cp;
    else if (cp > 1) sum = ddp_sum(d, sum) / (cp * dp);
    return (float)(sum / batches);
}

/* Draw the next token from logits[0..V) with temperature and top-k. */
static int sample_token(const float *logits, int V, float temperature, int top_k, Rng *rng, float *probs) {
    if (temperature <= 0.0f) {
        int best = 0;
        for (int i = 1; i < V; i++)
            if (logits[i] > logits[best]) best = i;
        return best;
    }
    float cutoff = -INFINITY;
    if (top_k > 0 && top_k < V) {
        /* the k-th largest logit, by partial selection on a copy */
        memcpy(probs, logits, (size_t)V * sizeof(float));
        for (int i = 0; i < top_k; i++) {
            int best = i;
            for (int j = i + 1; j < V; j++)
                if (probs[j] > probs[best]) best = j;
            float t = probs[i];
            probs[i] = probs[best];
            probs[best] = t;
        }
        cutoff = probs[top_k - 1];
    }
    float maxv = -INFINITY;
    for (int i = 0; i < V; i++)
        if (logits[i] > maxv) maxv = logits[i];
    double sum = 0.0;
    for (int i = 0; i < V; i++) {
        probs[i] = logits[i] >= cutoff ? (float)exp((logits[i] - maxv) / temperature) : 0.0f;
        sum += probs[i];
    }
    double u = rng_uniform_double(rng) * sum, acc = 0.0;
    for (int i = 0; i < V; i++) {
        acc += probs[i];
        if (u < acc && probs[i] > 0.0f) return i;
    }
    for (int i = V - 1; i >= 0; i--)
        if (probs[i] > 0.0f) return i;
    return 0;
}

/* Generate c->sample_tokens tokens after a start token and print them. The
 * model recomputes the whole window each token (no KV cache): sampling is
 * occasional and small next to training. */
static void generate(Model *m, Pipe *pipe, const Config *c, const Tokenizer *tok, uint64_t seed, int32_t *ctx,
                     FILE *out) {
    const ArchSpec *s = &m->gshape; /* the whole vocabulary, also under tp */
    int V = s->vocab_size, Tmax = m->T;
    float *logits = xmalloc((size_t)s->padded_vocab * sizeof(float));
    float *probs = xmalloc((size_t)s->padded_vocab * sizeof(float));
    Rng rng;
    rng_seed(&rng, seed);
    int eot = tok_eot(tok);
    int start = eot >= 0 ? eot : '\n';
    int n = 0;
    ctx[n++] = start;
    char buf[256];
    for (int i = 0; i < c->sample_tokens; i++) {
        /* keep the last Tmax tokens as the window */
        int off = n > Tmax ? n - Tmax : 0;
        int len = n - off;
        int next = 0;
        /* pipeline: the forward through every stage; the last draws the
         * token, every stage appends it */
        if (pipe) pipe_forward(pipe, ctx + off, NULL, 1, len);
        else model_forward(m, ctx + off, NULL, 1, len, 0.0f);
        if (!pipe || pipe->stage == pipe->p - 1) {
            model_logits_row(m, 0, len - 1, logits);
            next = sample_token(logits, V, c->sample_temperature, c->sample_top_k, &rng, probs);
        }
        if (pipe) next = pipe_share_from_last(pipe, next);
        if (next == eot) break;
        if (n == 2 * Tmax) { /* slide the buffer instead of growing it */
            memmove(ctx, ctx + Tmax, (size_t)Tmax * sizeof(int32_t));
            n = Tmax;
        }
        ctx[n++] = next;
        size_t k = tok_decode(tok, (uint32_t)next, buf, sizeof buf);
        if (k > sizeof buf) k = sizeof buf; /* a longer token was cut to the buffer */
        fwrite(buf, 1, k, out);
    }
    fputc('\n', out);
    fflush(out);
    free(logits);
    free(probs);
}

/* Muon's matrices, from the tensor table: the blocks' 2-D weights (q|k|v,
 * output, MLP, shared and routed experts); GPT-2's fused c_attn (a QKV_W with
 * no K_W after it) as its three row blocks unless optim.muon_split_qkv is
 * false. Embeddings, head, norms, biases and the router keep AdamW. */
static void train_set_muon(AdamW *o, const Model *m, const Config *c, int say) {
    OptimMatrix *mats = xmalloc((size_t)(3 * m->num_tensors + 1) * sizeof *mats);
    int n = 0;
    size_t muon_params = 0;
    for (int i = 0; i < m->num_tensors; i++) {
        const ParamInfo *p = &m->params[i];
        int r = p->role;
        if (!optim_muon_role(r) || p->ndim != 2 || !p->trained) continue;
        int fused = r == ROLE_QKV_W && (i + 1 >= m->num_tensors || m->params[i + 1].role != ROLE_K_W);
        int parts = fused && c->muon_split_qkv && p->shape[0] % 3 == 0 ? 3 : 1;
        /* under tp the arena holds this rank's part (shape) of the global matrix (gshape); a third of a
         * split c_attn is one row block of its global third */
        int rows = p->shape[0] / parts, cols = p->shape[1], grows = p->gshape[0] / parts, gcols = p->gshape[1];
        for (int k = 0; k < parts; k++)
            mats[n++] = (OptimMatrix){.off = p->offset + (size_t)k * rows * cols, .rows = rows, .cols = cols,
                                      .grows = grows, .gcols = gcols, .tp_dim = p->split.dim,
                                      .tp_parts = parts == 3 ? 1 : p->split.parts,
                                      .scale = optim_muon_scale(c->muon_scale, grows, gcols), .decay = p->decay,
                                      .tensor = i, .toff = (size_t)k * rows * cols};
        muon_params += p->numel;
    }
    optim_set_muon(o, mats, n, c->momentum, c->ns_steps);
    free(mats);
    if (say)
        printf("optim: muon on %d matrices (%zu parameters), adamw on the other %zu parameters\n", n, muon_params,
               m->num_params - muon_params);
}

static void write_resolved_config(const Config *c) {
    char path[1024];
    snprintf(path, sizeof path, "%s/config.yaml", c->run_dir);
    size_t len;
    char *text = cfg_yaml_text(c, &len);
    if (kiln_write_file_atomic(path, text, len) != 0) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot write", path);
    free(text);
}

int train_run(const Config *c, int dry_run) {
    TrainOptions o = {0};
    o.dry_run = dry_run;
    return train_run_with(c, &o);
}

/* Ranks, the mesh, the consistency check. Exits 2 on a layout that does not
 * fit the world or the batch. */
static void setup_parallel(const Config *c, const TrainOptions *topt, Mesh *mesh, int *accum) {
    comm_init(c->timeout_s);
    const CommInfo *ci = comm_info();
    comm_check_consistent(c->hash, topt->commit ? topt->commit : "unknown");
    /* from here on every collective is recorded (monitor.flight_records) and,
     * with monitor.check_collectives, agreed on before it runs */
    flight_open(&(FlightOptions){.run_dir = c->run_dir, .rank = ci->rank, .world = ci->world, .host = ci->host,
                                 .records = c->flight_records, .signals = 1});
    comm_check_collectives(c->check_collectives);
    MeshShape ms = {{c->pp, c->dp, c->cp, c->tp}, c->ep};
    char err[512];
    if (mesh_plan(&ms, ci->world, err, sizeof err) != 0) kiln_fail(KILN_EXIT_USAGE, "%s", err);
    mesh_init(mesh, &ms);
    int dp = ms.size[MESH_DP];
    if (c->grad_accum % dp)
        kiln_fail(KILN_EXIT_USAGE,
                  "key 'batch.total_tokens': %lld tokens are %d micro-batches of %d x %d, which do not split evenly "
                  "over %d data-parallel ranks; make it a multiple of micro_batch*seq_len*dp = %lld",
                  (long long)c->total_tokens, c->grad_accum, c->micro_batch, c->seq_len, dp,
                  (long long)c->micro_batch * c->seq_len * dp);
    *accum = c->grad_accum / dp;
}

/* A run once set up: what the step and the loop read. Filled by train_setup,
 * released by train_teardown. */
typedef struct TrainRun {
    const Config *c;
    const TrainOptions *topt;
    ArchSpec shape;                  /* the whole model's spec */
    Mesh mesh;
    CommGroup *dpg, *tpg, *ppg, *cpg;
    CommGroup *rg;                   /* replicated parameters' gradients sum over it: dp, or dp x cp */
    CommGroup *epg, *edpg;           /* expert parallelism: the ep group, the ranks holding the same experts */
    int rank, world, dp, dp_rank, tp, sp, pp, cp, ep;
    int accum;                       /* micro-batches per rank and step */
    const Backend *be;
    const char *desc;                /* the backend's description line */
    Tokenizer *tok;
    int B, T;                        /* micro-batch */
    DataLoader *train;
    DataLoader *vals[CFG_MAX_SOURCES]; /* one per validation set */
    DataLoader *val;                 /* vals[0], NULL without validation */
    int n_val, val_split;
    Model model;
    Ddp ddp;
    Tp tpx;
    Cp cpx;                          /* cp > 1: attention over the cp group */
    Ep epx;                          /* ep > 1: the MoE layers' all-to-alls over the ep group */
    double *ep_fig;                  /* ep > 1: (3 world) every rank's rows of the step (epf's arrays) */
    EpFigures epf;
    Pipe pipe;                       /* pp > 1: this rank's stage, schedule and channels */
    int cut[PIPE_MAX_STAGES + 1];    /* pp > 1: layers of each virtual stage */
    AdamW opt;
    MuonDist muon;                   /* optim.name muon: owners over ddp's group (x tp); be NULL: none */
    Adafactor adafactor;             /* optim.name adafactor; be NULL: none */
    Schedule sched;
    double fpt;                      /* training FLOPs per token */
    RunState rs;
    size_t shard_n;
    float *param_shard;              /* ZeRO-2/3: what checkpoints and hashes read */
    int start_step;
    Metrics *mx;
    /* metrics: tokens drawn from each source, each validation set's loss */
    const char *src_names[CFG_MAX_SOURCES], *val_names[CFG_MAX_SOURCES];
    uint64_t src_tokens[CFG_MAX_SOURCES];
    float val_losses[CFG_MAX_SOURCES];
    /* test hooks (docs/metrics.md, docs/parallel.md) */
    int inject_nan_step, inject_nan_after, pause_at_step, gated; /* testhooks.h; gated: gate */
    const char *tp_grads_file;
    const char *optim_dump;          /* testhooks.h optim_dump's directory, or NULL */
    float *param_host;               /* (num_params or shard_n) host: the parameter fingerprint */
    int skip_nonfinite;
    int dev_step;                    /* one rank, AdamW or Lion: the step's scalars stay on the device */
    int copy_fused;                  /* the optimizer's update writes the compute copy (optim_set_copy) */
    int sample_all;                  /* every rank runs the generation (rank 0 prints) */
    FILE *devnull;                   /* the other ranks' samples */
    int32_t *inp, *tgt;              /* (B,T) host */
    int32_t *ctx;                    /* (2T + 2) host: the generation window */
    float dloss;                     /* the mean over the global batch: every rank's gradients are summed */
    MoeStepBuf moe_buf;              /* MoE: the step's loads, all ranks (moe_after_step) */
    int step;                        /* the step being computed (0-based) */
} TrainRun;

/* One optimizer step as train_step saw it. */
typedef struct TrainStep {
    float loss, lr;
    OptimStepInfo info;
    MetricsMoe moe;
    double dt;     /* seconds: micro-batches, reduction and update */
    double idle;   /* pp > 1: seconds this rank waited for its pipeline neighbours */
    double bubble; /* pp > 1: the stages' idle time over their step time (NAN without pp) */
} TrainStep;

/* Backend, tokenizer, run directory, data, model, ddp/tp, optimizer,
 * checkpoint state and metrics: everything before the first step. */
static void train_setup(TrainRun *r, const Config *c, const TrainOptions *topt) {
    memset(r, 0, sizeof *r);
    r->c = c, r->topt = topt;
    arch_from_config(c, &r->shape);
    const ArchSpec *shape = &r->shape;
    setup_parallel(c, topt, &r->mesh, &r->accum);
    r->dpg = mesh_group(&r->mesh, MESH_GROUP_DP), r->tpg = mesh_group(&r->mesh, MESH_GROUP_TP);
    r->ppg = mesh_group(&r->mesh, MESH_GROUP_PP), r->pp = r->ppg->size;
    r->cpg = mesh_group(&r->mesh, MESH_GROUP_CP), r->cp = r->cpg->size;
    r->epg = mesh_group(&r->mesh, MESH_GROUP_EP), r->edpg = mesh_group(&r->mesh, MESH_GROUP_EDP);
    r->ep = r->epg->size;
    /* replicated parameters' gradients sum over every rank that computed
     * other tokens: dp, and under context parallelism dp x cp */
    r->rg = r->cp > 1 ? mesh_group(&r->mesh, MESH_GROUP_DPCP) : r->dpg;
    r->rank = r->mesh.rank, r->world = r->mesh.world, r->dp = r->dpg->size, r->dp_rank = r->dpg->rank;
    r->tp = r->tpg->size, r->sp = r->tp > 1 && strcmp(c->sequence_parallel, "false") != 0;
    int rank = r->rank, dp = r->dp, dp_rank = r->dp_rank, tp = r->tp, cp = r->cp;
    CommGroup *tpg = r->tpg, *cpg = r->cpg, *rg = r->rg;
    char tp_err[512];
    if (arch_tp_check(shape, tp, tp_err, sizeof tp_err) != 0) kiln_fail(KILN_EXIT_USAGE, "%s", tp_err);

    const Backend *be = r->be = backend_get(c->device);
    if (!be)
        kiln_fail(KILN_EXIT_USAGE, "key 'device': '%s' is not available in this build (./train --version lists the backends)",
                  c->device);
    if (be->select_device) be->select_device(comm_info()->local_rank, comm_info()->local_world);
    r->desc = be->init(c->threads);
    backend_set_precision(be, c->compute, c->attention, c->attention_deterministic); /* precision.* */
    /* MFU's denominator: the config's figure, else the GPU's datasheet peak,
     * else (the CPU) this machine's measured matrix-product rate, measured
     * before the model allocates so its buffers stay out of memory_peak */
    double peak = 0.0;
    char peak_src[160];
    const char *gpu = NULL;
    if (c->peak_gflops > 0) {
        peak = c->peak_gflops * 1e9;
        snprintf(peak_src, sizeof peak_src, "metrics.peak_gflops");
    } else if ((peak = metrics_peak_lookup(r->desc, c->compute, &gpu)) > 0) {
        snprintf(peak_src, sizeof peak_src, "%s %s dense, datasheet", gpu, c->compute);
    } else {
        peak = metrics_measure_matmul(be, 0.3);
        snprintf(peak_src, sizeof peak_src, "fp32 matmul rate measured at start-up");
    }

    r->tok = tok_open(c->tokenizer, c->tokenizer_file);
    if (tok_vocab_size(r->tok) > c->vocab_size)
        kiln_fail(KILN_EXIT_USAGE, "key 'model.vocab_size': %d is smaller than the %s tokenizer's %d ids", c->vocab_size,
                  c->tokenizer, tok_vocab_size(r->tok));

    if (kiln_mkdirs(c->run_dir) != 0) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot create the run directory", c->run_dir);
    if (rank == 0) write_resolved_config(c);

    int B = r->B = c->micro_batch, T = r->T = c->seq_len;
    /* each dp rank takes its slice of every global batch of the one global order */
    r->train = open_data(c, &c->train, 0, c->train.n, "data.train", 1, c->prefetch, dp_rank, dp);
    r->val_split = c->eval_batches % dp == 0, r->n_val = c->val.n;
    for (int i = 0; i < r->n_val; i++) {
        char what[CFG_NAME + 16];
        snprintf(what, sizeof what, c->val.list ? "data.val '%s'" : "data.val", c->val.s[i].name);
        r->vals[i] = open_data(c, &c->val, i, 1, what, 0, 0, r->val_split ? dp_rank : 0, r->val_split ? dp : 1);
    }
    r->val = r->vals[0];

    Model *model = &r->model;
    /* precision.master bf16: no fp32 arena (exit 2 unless act is bf16) */
    ModelOptions mo = {.decay_embeddings = c->decay_embeddings, .master_bf16 = !strcmp(c->master, "bf16"), .tp = tp,
                       .tp_rank = tpg->rank, .sequence_parallel = r->sp, .cp = cp, .cp_rank = cpg->rank,
                       .ep = r->ep, .ep_rank = r->mesh.ep_rank, .doc_masking = c->doc_masking,
                       .doc_reset = !strcmp(c->doc_positions, "reset"),
                       .doc_eot = c->eot_id >= 0 ? c->eot_id : tok_eot(r->tok),
                       .fp8 = plan_fp8_options(c), .recompute_every = c->recompute_every,
                       .loss_chunk = c->loss_chunk};
    if ((mo.doc_masking || mo.doc_reset) && mo.doc_eot < 0) /* config.c refuses the byte tokenizer's */
        kiln_fail(KILN_EXIT_USAGE, "key 'data.eot_id': the %s tokenizer has no end-of-text id; set data.eot_id",
                  c->tokenizer);
    PipeKind pk = (PipeKind)pipe_kind_parse(c->pp_schedule);
    if (r->pp > 1) {
        /* pipeline: this rank's stage (its chunks of layers), before any allocation */
        char err[512];
        if (pipe_check_shape(pk, r->pp, c->pp_virtual, r->accum, err, sizeof err) != 0 ||
            pipe_plan_stages(shape, r->pp, c->pp_virtual, c->pp_layers, c->n_pp_layers, r->cut, err, sizeof err) != 0)
            kiln_fail(KILN_EXIT_USAGE, "%s", err);
        pipe_model_options(r->ppg->rank, r->pp, c->pp_virtual, r->cut, &mo);
    }
    metrics_mark_rss_base(); /* before the model allocates: rss_base_mib */
    model_init(model, be, shape, &mo);
    model->gelu_fusion = strcmp(c->gelu_fusion, "off") != 0; /* precision.gelu_fusion */
    /* gradient buckets of 25 MB (PyTorch DDP's default): big enough that
     * per-message latency is small, small enough to overlap with backward.
     * Before the weights: ZeRO-2/3 lay the arena out by layer. */
    if (rg->size > 1 && be->stream) {
        /* device memory: the dp group's float collectives run through NCCL on
         * the backend's stream (comm.h, "NCCL"); doubles and bytes stay on MPI */
        comm_nccl_init(rg, c->run_dir);
        comm_nccl_device_mode(rg, be->stream());
    }
    /* expert parallelism: the ep group's all-to-alls and the EDP group's
     * expert-gradient sums, on the GPU through NCCL as dp's */
    if (r->ep > 1 && be->stream) {
        comm_nccl_init(r->epg, c->run_dir);
        comm_nccl_device_mode(r->epg, be->stream());
        if (r->edpg->size > 1) {
            comm_nccl_init(r->edpg, c->run_dir);
            comm_nccl_device_mode(r->edpg, be->stream());
        }
    }
    ddp_init(&r->ddp, model, rg, c->zero, (size_t)25 << 20, r->ep > 1 ? &(DdpExperts){r->edpg, r->epg} : NULL);
    /* tensor parallelism: the layers' collectives over the tp group (tp.c);
     * the gradient norm sums over it too */
    if (tp > 1 && be->stream) {
        comm_nccl_init(tpg, c->run_dir);
        comm_nccl_device_mode(tpg, be->stream());
    }
    tp_init(&r->tpx, model, tpg);
    ddp_set_tp(&r->ddp, tpg);
    /* the norm over every stage; a tied embedding's second copy (the last
     * stage's) is the first stage's, counted there */
    int last_stage = r->pp > 1 && r->ppg->rank == r->pp - 1;
    int tied_copy = r->pp > 1 && shape->tie_embeddings && (r->ppg->rank == 0 || last_stage);
    ddp_set_pp(&r->ddp, r->ppg,
               last_stage && shape->tie_embeddings ? model_tensor_index(model, -1, ROLE_TOK_EMB, -1) : -1, tied_copy);
    /* a resume overwrites the weights, so they are not drawn first (state_open
     * draws them if it loads nothing); ZeRO-3 shards them here and keeps no
     * whole copy to draw into later */
    int weights_unset = topt->resume && !c->init_from[0] && ddp_whole_params(&r->ddp);
    if (c->init_from[0]) {
        state_load_init_from(model, c->init_from, rank == 0);
    }
    else if (!weights_unset) model_init_weights(model, c->seed);
    ddp_shard_params(&r->ddp); /* ZeRO-2/3: take this rank's shard (ZeRO-3: drop the whole arena) */
    if (r->pp > 1) /* the schedule's activation slots, its channels (collective over pp) */
        pipe_init(&r->pipe, model, r->ppg, pk, c->pp_virtual, r->accum, r->cut, B, T,
                  model_recompute_parse(c->recompute), c->run_dir);
    else
        model_plan_activations(model, B, T, model_recompute_parse(c->recompute));
    /* context parallelism: attention over the cp group (cp.c), K/V buffers
     * for this rank's B x T / cp rows and heads */
    if (cp > 1) {
        if (be->stream) {
            comm_nccl_init(cpg, c->run_dir);
            comm_nccl_device_mode(cpg, be->stream());
        }
        AttnShape cap = {B, T / cp, model->shape.n_head, model->shape.n_kv_head, model->shape.head_dim, NULL};
        cp_init(&r->cpx, be, cpg, cp_mode_parse(c->cp_attention), &cap);
        cp_attach(&r->cpx, model);
    }
    ep_init(&r->epx, model, r->epg); /* ep > 1: the expert side's buffers for the planned micro-batch */
    r->ep_fig = r->ep > 1 ? xcalloc((size_t)3 * r->world, sizeof(double)) : NULL;
    if (r->ep_fig) r->epf = (EpFigures){r->ep_fig, r->ep_fig + r->world, r->ep_fig + 2 * r->world, 0};

    size_t opt_lo, opt_hi;
    ddp_optim_range(&r->ddp, &opt_lo, &opt_hi);
    optim_init_shard_dtype(&r->opt, be, model->num_params, model->num_decay, opt_lo, opt_hi, c->beta1, c->beta2,
                           c->eps, c->weight_decay, c->grad_clip, optim_state_bytes(c->optim_state) == 2,
                           optim_round_seed(c->seed));
    if (model->master_bf16) optim_set_params_bf16(&r->opt); /* the same seed: other bits of each element's hash */
    if (optim_kind(c->optim_name) == OPTIM_LION) optim_set_lion(&r->opt, c->lion_beta1, c->lion_beta2);
    if (optim_kind(c->optim_name) == OPTIM_MUON) {
        train_set_muon(&r->opt, model, c, rank == 0);
        /* owners over ddp's group (dp, or dp x cp) and tp; ddp runs its step */
        muon_dist_init(&r->muon, &r->opt, &r->ddp, tpg, rank == 0);
    }
    if (optim_kind(c->optim_name) == OPTIM_ADAFACTOR) {
        Adafactor *a = &r->adafactor;
        optim_set_adafactor(&r->opt, c->adafactor_beta1);
        adafactor_init(a, &r->opt, model, &r->ddp, tpg, c->adafactor_decay, c->adafactor_clip, c->adafactor_eps);
        if (rank == 0)
            printf("optim: adafactor, %d tensor(s) factored (%zu statistics), %zu elementwise second moments here, "
                   "%s\n", a->nf, a->nstat, a->nv, c->adafactor_beta1 > 0 ? "first moment m" : "no first moment");
    }
    r->sched = (Schedule){(SchedKind)optim_sched_kind(c->sched_kind), c->lr, c->warmup_steps, c->steps,
                          c->min_lr_ratio, c->decay_ratio};
    /* The step's host waits (docs/gpu.md): one rank with AdamW or Lion keeps
     * the losses, norm, clipping factor and skip flag on the device and reads
     * them once per step; without shards the update writes the compute copy. */
    int elementwise = r->opt.kind == OPTIM_ADAMW || r->opt.kind == OPTIM_LION;
    r->dev_step = r->world == 1 && elementwise;
    if (r->dev_step) model_set_loss_sink(model, &optim_scalars(&r->opt)->loss);
    r->copy_fused = ddp_whole_update(&r->ddp) && optim_set_copy(&r->opt, model_compute_copy(model));

    r->fpt = arch_flops_per_token(shape, T);
    /* checkpoints: collect the state table, resume, plan the writer (state.c) */
    r->param_shard = ddp_param_shard(&r->ddp, &r->shard_n); /* ZeRO-2/3: what checkpoints and hashes read */
    /* checkpoints: the ranks of ddp's group (dp x cp under cp) share the writes */
    StateMesh smesh = {.rank = rank, .world = r->world, .dp = rg->size, .zero = c->zero, .dp_rank = rg->rank,
                       .tp = tp, .tp_rank = tpg->rank, .ep = r->ep, .edp_rank = r->mesh.edp_rank, .g = comm_world(),
                       .pieces = ddp_optim_pieces(&r->ddp) ? &r->ddp : NULL,
                       .units = r->param_shard ? &r->ddp : NULL, .adafactor = r->adafactor.be ? &r->adafactor : NULL,
                       .cp = cp, .pp = r->pp, .pp_rank = r->ppg->rank, .weights_unset = weights_unset};
    r->start_step = state_open(&r->rs, c, &smesh, topt->resume, topt->force, topt->commit, model, &r->opt, r->train);
    model_params_changed(model); /* a resume loaded them: the compute copy follows */
    r->mx = metrics_open(c, rank, r->world, r->fpt, peak, peak_src, r->start_step);
    metrics_set_commit(r->mx, topt->commit);
    metrics_set_hw_flops(r->mx, model_hw_flops_per_token(shape, T, tp, (size_t)B * T / cp, model->recompute,
                                                         model->recompute_every, c->loss_chunk,
                                                         r->pp > 1 && pk == PIPE_ZB_H1));
    size_t olo, ohi;
    ddp_optim_range(&r->ddp, &olo, &ohi);
    metrics_set_layout(r->mx, &(MetricsLayout){.world = r->world, .pp = r->pp, .dp = dp, .cp = cp, .tp = tp,
                                               .ep = r->ep, .zero = c->zero, .param_floats = model->num_params,
                                               .grad_floats = ddp_grad_floats(&r->ddp), .optim_floats = ohi - olo});
    if (r->rs.resumed_path[0]) {
        MetricsResumed mr = {.step = r->rs.step, .tokens = r->rs.tokens, .world = r->rs.resumed_mesh.world,
                             .pp = r->rs.resumed_mesh.pp, .dp = r->rs.resumed_mesh.dp, .tp = r->rs.resumed_mesh.tp,
                             .ep = r->rs.resumed_mesh.ep, .resharded = r->rs.resharded};
        kiln_strlcpy(mr.checkpoint, r->rs.resumed_path, sizeof mr.checkpoint);
        metrics_set_resumed(r->mx, &mr);
    }
    r->rs.mx = r->mx;

    /* Test hook (docs/metrics.md): poison one gradient at this step, and
     * fingerprint the parameters after every step so a test can see that a
     * skipped step left them unchanged. */
    const TestHooks *th = testhooks();
    r->inject_nan_step = th->inject_nan_step;
    r->inject_nan_after = th->inject_nan_after; /* "N+": every step from N on */
    /* Test hook (docs/metrics.md): after step N, wait for a stop signal, so a
     * signal test cannot lose a race against the end of the run. */
    /* Test hook (docs/parallel.md): after the first step's gradient sync,
     * fingerprint every replicated tensor's gradient into FILE.rank<R>, so a
     * test can see that every tp rank holds the same */
    r->tp_grads_file = ddp_whole_params(&r->ddp) && !r->param_shard ? th->tp_grads : NULL;
    r->optim_dump = th->optim_dump;
    if (r->optim_dump) testhooks_optim_start(r->optim_dump, model, &r->opt, r->world);
    r->pause_at_step = th->pause_at_step;
    r->gated = th->gate != NULL;
    r->param_host = r->inject_nan_step > 0
                        ? xmalloc((r->param_shard ? r->shard_n : model->num_params) * sizeof(float)) : NULL;
    r->skip_nonfinite = strcmp(c->on_nonfinite, "skip") == 0;
    /* ZeRO-3: every rank samples (each forward gathers layers collectively);
     * ZeRO-2's forward only waits for refreshes every rank has posted */
    /* tp, cp, pp: every rank computes its part; ep: every forward is an all-to-all */
    r->sample_all = !ddp_whole_params(&r->ddp) || tp > 1 || cp > 1 || r->pp > 1 || r->ep > 1;
    r->devnull = r->sample_all && rank > 0 ? fopen("/dev/null", "w") : NULL;
    if (r->sample_all && rank > 0 && !r->devnull)
        kiln_fail(KILN_EXIT_RUNTIME, "/dev/null: cannot open (samples of rank %d)", rank);
    size_t N = (size_t)B * T;
    r->inp = xmalloc(N * sizeof(int32_t));
    r->tgt = xmalloc(N * sizeof(int32_t));
    r->ctx = xmalloc((size_t)2 * T * sizeof(int32_t) + 8);
    /* the mean over the global batch: every rank's gradients are summed */
    r->dloss = 1.0f / (float)(N * (size_t)r->accum * (size_t)dp);
    for (int i = 0; i < data_num_sources(r->train); i++) r->src_names[i] = data_source_name(r->train, i);
    for (int i = 0; i < r->n_val; i++) r->val_names[i] = c->val.s[i].name;
}

/* The start-up lines: backend, mesh, layout, resume, model, activations,
 * precision, data and batch. */
static void train_describe(TrainRun *r) {
    const Config *c = r->c;
    const ArchSpec *shape = &r->shape;
    Model *model = &r->model;
    Metrics *mx = r->mx;
    metrics_print(mx, "kiln %s | %s", KILN_VERSION, r->desc);
    char cdesc[256], mdesc[128];
    comm_describe(cdesc, sizeof cdesc);
    mesh_describe(&r->mesh.shape, mdesc, sizeof mdesc);
    metrics_print(mx, "%s | mesh %s | ZeRO %d", cdesc, mdesc, c->zero);
    char ddesc[512];
    if (ddp_describe_layout(&r->ddp, ddesc, sizeof ddesc)) metrics_print(mx, "%s", ddesc);
    if (ddp_describe_memory(&r->ddp, ddesc, sizeof ddesc)) metrics_print(mx, "%s", ddesc);
    if (ep_describe(&r->epx, ddesc, sizeof ddesc)) metrics_print(mx, "%s", ddesc);
    if (r->rs.resumed_msg[0]) metrics_print(mx, "%s", r->rs.resumed_msg);
    if (r->rs.data_note[0]) metrics_print(mx, "%s", r->rs.data_note);
    metrics_print(mx, "run %s -> %s", c->run_name, c->run_dir);
    metrics_print(mx, "model %s (%s MLP): %zu parameters (%.2fM), %.3g FLOPs/token", c->arch,
                  arch_mlp_name(shape->mlp), arch_num_params(shape), arch_num_params(shape) / 1e6, r->fpt);
    if (r->tp > 1)
        metrics_print(mx, "tensor parallel: %d ranks, %zu parameters here (heads %d of %d, kv heads %d of %d, MLP "
                      "width %d of %d, vocabulary rows %d), sequence parallel %s", r->tp, model_num_params(model),
                      model->shape.n_head, shape->n_head, model->shape.n_kv_head, shape->n_kv_head,
                      shape->mlp == MLP_MOE ? shape->ffn_hidden : model->shape.ffn_hidden, shape->ffn_hidden,
                      model->shape.padded_vocab, r->sp ? "on" : "off");
    if (r->cp > 1)
        metrics_print(mx, "context parallel: %d ranks, %s attention; each sequence of %d tokens is %d chunks of %d, "
                      "this rank holds chunks %d and %d (%d rows of every micro-batch); gradients sum over dp x cp = %d",
                      r->cp, cp_mode_name(r->cpx.mode), r->T, 2 * r->cp, r->T / (2 * r->cp),
                      model_cp_chunk(r->cp, r->cpg->rank, 0), model_cp_chunk(r->cp, r->cpg->rank, 1),
                      r->B * r->T / r->cp, r->rg->size);
    if (r->pp > 1) {
        const Pipe *p = &r->pipe;
        char here[256];
        size_t o = 0;
        for (int k = 0; k < model->n_chunks && o < sizeof here; k++)
            o += (size_t)snprintf(here + o, sizeof here - o, "%s%d..%d", k ? ", " : "", model->chunk_lo[k],
                                  model->chunk_hi[k] - 1);
        metrics_print(mx, "pipeline parallel: %d stages, %s%s, %d micro-batches per step; layers %s here (%zu "
                      "parameters), %d activation slot(s); bubble of the schedule %.1f%% of the step ((p-1)/%s = "
                      "%.1f%% of the compute)", r->pp, c->pp_schedule, c->pp_virtual > 1 ? " with virtual chunks" : "",
                      r->accum, here, model_num_params(model), model->n_slots, 100.0 * p->theory,
                      p->sched.kind == PIPE_INTERLEAVED ? "(v m)" : p->sched.kind == PIPE_ZB_H1 ? "(3m)" : "m",
                      100.0 * pipe_formula_bubble(p->sched.kind, r->pp, c->pp_virtual, r->accum));
    }
    int fused = model_gelu_fused(model, 0) || model_gelu_fused(model, 1);
    char every[64] = "";
    if (model->recompute == MODEL_RECOMPUTE_BLOCK && model->recompute_every > 1)
        snprintf(every, sizeof every, " every %d layers", model->recompute_every);
    metrics_print(mx, "activations: %.2f MiB for %s%d x %d micro-batch, %zu-byte activations, recompute %s%s%s",
                  model->act_size / 1048576.0, model->n_slots > 1 ? "the slots of a " : "a ", r->B, r->T,
                  model->act_bytes, model_recompute_name(model->recompute), every,
                  model->recompute == MODEL_RECOMPUTE_NONE ? ""
                  : model->recompute == MODEL_RECOMPUTE_BLOCK
                      ? " (a checkpointed layer keeps its input; the backward runs its forward again: bit-identical)"
                  : fused ? " (the backward recomputes them; the GeLU's last bits may differ from the fused forward's)"
                          : " (the backward recomputes them: bit-identical)");
    if (model->xent_rows)
        metrics_print(mx, "loss in chunks of %zu rows (model.loss_chunk): the head's logits of one chunk, %.2f MiB "
                          "instead of %.2f; the backward makes each chunk's again (one more head product)",
                      model->xent_rows, model->xent_rows * (double)model->shape.padded_vocab * model->act_bytes / 1048576.0,
                      (double)r->B * r->T / (model->cp > 1 ? model->cp : 1) * model->shape.padded_vocab *
                          model->act_bytes / 1048576.0);
    if (model->master_bf16)
        metrics_print(mx, "parameters: bf16 (precision.master), no fp32 master (%.2f MiB saved); AdamW rounds each "
                          "update stochastically; gradients fp32", model->num_params * 4.0 / 1048576.0);
    if (model->fp8.mode == FP8_BF16_OPERANDS)
        metrics_print(mx, "bf16 operands (precision.fp8: bf16): the fp8 products' operands (the weight gradients' "
                      "too) rounded to bf16 with no scale, products in fp32: a stand-in for bf16 compute "
                      "(docs/precision.md)");
    else if (model->fp8.mode != FP8_OFF)
        metrics_print(mx, "fp8 products (precision.fp8): %s scales%s%s, E4M3 forward, %s output gradients, weight "
                      "gradients %s, head %s; %s (docs/precision.md)", fp8_mode_name((Fp8Mode)model->fp8.mode),
                      model->fp8.pow2 ? " (powers of two)" : "", model->fp8.history ? ", delayed" : ", current",
                      fp8_format_name((Fp8Format)model->fp8.grad_fmt), model->fp8.wgrad ? "fp8" : "unquantised",
                      model->fp8.head ? "fp8" : "unquantised", model_fp8_products(model));
    metrics_print(mx, "gelu fusion: %s", !model->gelu_fusion ? "off (precision.gelu_fusion), fc product and GeLU separate"
                  : fused ? "on: fc product and GeLU fused (forward and backward) by the backend"
                          : "not offered by this backend: fc product and GeLU separate");
    char vtok[64] = "";
    uint64_t val_tokens = 0;
    for (int i = 0; i < r->n_val; i++) val_tokens += data_num_tokens(r->vals[i]);
    if (r->val) snprintf(vtok, sizeof vtok, ", %llu val tokens in %d set(s)", (unsigned long long)val_tokens, r->n_val);
    metrics_print(mx, "data: %llu train tokens in %d shard(s)%s; prefetch %d batch(es)",
                  (unsigned long long)data_num_tokens(r->train), data_num_shards(r->train), vtok, c->prefetch);
    if (c->train.list) {
        char mix[2048];
        data_describe(r->train, mix, sizeof mix);
        metrics_print(mx, "data: mixture of %d source(s): %s", c->train.n, mix);
    }
    if (model->doc_mask || model->doc_reset) /* docs/data.md, "Documents" */
        metrics_print(mx, "data: documents end at token %d (data.eot_id); attention %s; positions %s", model->doc_eot,
                      model->doc_mask ? "stops at them (data.doc_masking)" : "reads across them",
                      model->doc_reset ? "restart per document (data.doc_positions: reset)" : "count from the sequence's start");
    metrics_print(mx, "batch: %d x %d tokens x %d accumulation x %d rank(s) = %lld tokens/step, %d steps", r->B, r->T,
                  r->accum, r->dp, (long long)c->total_tokens, c->steps);
}

/* The plain accumulation loop: accum micro-batches, forward and backward
 * each; returns the sum of their losses. */
static double train_micro_batches(TrainRun *r, int step) {
    Model *model = &r->model;
    double loss_sum = 0.0;
    for (int micro = 0; micro < r->accum; micro++) {
        metrics_phase(r->mx, PHASE_DATA, step + 1);
        data_next_batch(r->train, r->inp, r->tgt);
        metrics_phase(r->mx, PHASE_FORWARD, step + 1);
        /* on the last micro-batch: post gradient buckets as layers finish */
        ddp_micro_begin(&r->ddp, micro == 0, micro == r->accum - 1);
        tp_micro_begin(&r->tpx, micro == 0, micro == r->accum - 1);
        cp_micro_begin(&r->cpx, micro == 0);
        loss_sum += model_forward(model, r->inp, r->tgt, r->B, r->T, r->dloss);
        metrics_phase(r->mx, PHASE_BACKWARD, step + 1);
        model_backward(model, micro > 0);
    }
    return loss_sum;
}

/* A pipeline schedule's compute points ddp and tp at where the gradients
 * stand (PipeHooks). */
static void pipe_compute_begin(void *ctx, int backward, int first, int last_of_chunk, int last_of_rank) {
    TrainRun *r = ctx;
    metrics_phase(r->mx, backward ? PHASE_BACKWARD : PHASE_FORWARD, r->step + 1);
    /* ZeRO 0-1: the rank's last backward posts the buckets as layers finish;
     * ZeRO 2-3: each chunk's last one reduce-scatters its layers */
    ddp_pipe_begin(&r->ddp, first, last_of_chunk, last_of_rank);
    tp_micro_begin(&r->tpx, first, last_of_chunk);
    cp_micro_begin(&r->cpx, first);
}

/* The pipeline's micro-batches: every stage reads the step's batches (the
 * first needs the tokens, the last the targets, and every stage's loader
 * stays at the same position), then runs its schedule. Returns the sum of
 * the losses, every stage's. */
static double train_pipeline(TrainRun *r, int step) {
    metrics_phase(r->mx, PHASE_DATA, step + 1);
    for (int micro = 0; micro < r->accum; micro++)
        data_next_batch(r->train, pipe_batch_tokens(&r->pipe, micro), pipe_batch_targets(&r->pipe, micro));
    metrics_phase(r->mx, PHASE_FORWARD, step + 1);
    r->step = step;
    return pipe_step(&r->pipe, r->dloss, &(PipeHooks){r, pipe_compute_begin});
}

/* One optimizer step: the micro-batches, the gradient reduction, the global
 * norm, clipping and the update. */
static TrainStep train_step(TrainRun *r, int step) {
    const Backend *be = r->be;
    Model *model = &r->model;
    Metrics *mx = r->mx;
    TrainStep out = {0};
    double t0 = kiln_now();
    out.lr = optim_lr(&r->sched, step);
    model_moe_reset(model);
    ep_step_begin(&r->epx);
    double loss_sum = r->pp > 1 ? train_pipeline(r, step) : train_micro_batches(r, step);
    tp_drain(&r->tpx); /* the backward's last tp collectives, with the deadline */
    if (r->ep > 1) {
        ep_step_figures(&r->epx, comm_world(), &r->epf); /* before evaluation: training rows only */
        if (r->epx.grown_to)
            metrics_print(mx, "expert parallel: step %d: a layer received more rows than its buffers held; grown to "
                          "%zu rows (dropless)", step + 1, r->epx.grown_to);
    }
    if (r->inject_nan_step > 0 &&
        (step + 1 == r->inject_nan_step || (r->inject_nan_after && step + 1 > r->inject_nan_step)))
        ddp_test_poison(&r->ddp); /* every rank: ZeRO 0/1 ranks each take the norm of their own copy */
    metrics_phase(mx, PHASE_SYNC, step + 1);
    if (r->pp > 1) { /* the tie holds: both copies of the embedding get the sum of their gradients */
        ddp_wait_grads(&r->ddp);
        pipe_tie_grads(&r->pipe);
    }
    double grad_norm = NAN;
    if (r->dev_step) ddp_reduce_grads_local(&r->ddp); /* the norm: optim_step_device's, on the device */
    else grad_norm = ddp_reduce_grads(&r->ddp);
    if (r->tp_grads_file && step == r->start_step) testhooks_replicated_grads(model, r->tp_grads_file, r->rank);
    if (r->optim_dump) testhooks_optim_grads(r->optim_dump, model, step + 1);
    if (r->dev_step) {
        /* the losses (the model's sink), norm, clipping and skip on the
         * device; the step's one host wait reads them after the update */
        metrics_phase(mx, PHASE_OPTIMIZER, step + 1);
        out.info = optim_step_device(&r->opt, model_param_arena(model), model->grad_mem, out.lr, r->accum, &out.loss);
    } else {
        /* the mean over every rank's micro-batches; under cp each rank's loss
         * is the mean of its chunks (the same token count on every cp rank) */
        out.loss = (float)(ddp_sum(&r->ddp, loss_sum) / (r->accum * ddp_ranks(&r->ddp)));
        metrics_phase(mx, PHASE_OPTIMIZER, step + 1);
        /* a non-finite loss skips the update even if its gradients look finite */
        out.info = (OptimStepInfo){grad_norm, 1.0f, 1};
        if (isfinite(out.loss)) out.info = ddp_optim_step(&r->ddp, &r->opt, out.lr, grad_norm);
    }
    if (r->optim_dump) testhooks_optim_step(r->optim_dump, model, step + 1, out.lr);
    if (isfinite(out.loss))
        moe_after_step(model, &r->ddp, r->pp > 1 ? &r->pipe : NULL, r->accum, &out.moe, &r->moe_buf);
    /* the next forward casts the compute copy again, unless the update wrote it */
    if (!r->copy_fused) model_params_changed(model);
    if (!r->dev_step) be->sync(); /* the device step's read has waited for everything already */
    out.dt = kiln_now() - t0;
    out.bubble = NAN;
    if (r->pp > 1) { /* the stages' idle time over their step time, all stages */
        double t[2] = {out.idle = r->pipe.idle_s, out.dt};
        pipe_sum(&r->pipe, t, 2);
        out.bubble = t[1] > 0 ? t[0] / t[1] : 0;
    }
    return out;
}

/* The step loop: steps, metrics, evaluation, samples, checkpoints, stops.
 * Returns 1 when a signal or the time limit stopped the run (checkpoint
 * written), else 0. */
static int train_loop(TrainRun *r) {
    const Config *c = r->c;
    const Backend *be = r->be;
    Model *model = &r->model;
    Metrics *mx = r->mx;
    int rank = r->rank, tp = r->tp, cp = r->cp;
    double step_time_sum = 0.0, blocked_sum = 0.0, tp_blocked_sum = 0.0, pp_idle_sum = 0.0, cp_blocked_sum = 0.0;
    double ep_blocked_sum = 0.0;
    /* a resumed run: how long the restart took, to the first step */
    double resume_s = r->rs.resumed_msg[0] ? kiln_process_age() : 0;
    char rsize[32];
    if (resume_s > 0)
        metrics_print(mx, "resume: %.2f s from process start to the first step (the checkpoint: %s loaded and "
                      "verified here in %.2f s, %.2f GB/s)", resume_s, kiln_fmt_bytes(r->rs.resume_gb * 1e9, rsize,
                      sizeof rsize), r->rs.resume_load_s,
                      r->rs.resume_load_s > 0 ? r->rs.resume_gb / r->rs.resume_load_s : 0);
    double t_start = kiln_now();
    float val_loss = NAN, last_loss = NAN;
    int skips_in_a_row = 0;

    int stopped = 0, steps_done = r->start_step;
    for (int step = r->start_step; step < c->steps && !stopped; step++) {
        TrainStep st = train_step(r, step);
        float loss = st.loss, lr = st.lr;
        OptimStepInfo info = st.info;
        MetricsMoe moe_ms = st.moe;
        int bad = !isfinite(loss) || info.nonfinite;
        double dt = st.dt;
        step_time_sum += dt, blocked_sum += ddp_step_blocked_s(&r->ddp), tp_blocked_sum += tp_step_blocked_s(&r->tpx);
        pp_idle_sum += st.idle, cp_blocked_sum += cp_step_blocked_s(&r->cpx), ep_blocked_sum += ep_step_blocked_s(&r->epx);
        if (!bad) last_loss = loss;
        int last = step == c->steps - 1;
        for (int i = 0; i < data_num_sources(r->train); i++) r->src_tokens[i] = data_source_tokens(r->train, i);
        MetricsData md = {.wait_s = data_take_wait_s(r->train), .n_sources = data_num_sources(r->train),
                          .source_names = r->src_names, .source_tokens = r->src_tokens,
                          .n_val = c->val.list ? r->n_val : 0, .val_names = r->val_names,
                          .val_losses = r->val_losses};
        MetricsStep ms = {step + 1, (int64_t)c->total_tokens * (step + 1), loss, NAN, lr, info.grad_norm,
                          info.grad_scale, dt, bad, 0, be->memory_peak ? be->memory_peak() / 1048576.0 : 0,
                          moe_ms.load ? &moe_ms : NULL, .comm_group = {cp > 1 ? "dpcp" : "dp", tp > 1 ? "tp" : NULL},
                          .comm_s = {ddp_step_blocked_s(&r->ddp), tp_step_blocked_s(&r->tpx)}, .data = &md,
                          .pp_bubble = st.bubble, .pp_bubble_theory = r->pp > 1 ? r->pipe.theory : NAN,
                          .ckpt = state_checkpoint_report(&r->rs),
                          .resume_s = step == r->start_step ? resume_s : 0};
        int g = tp > 1 ? 2 : 1; /* the next groups after dp's and tp's */
        if (cp > 1) ms.comm_group[g] = "cp", ms.comm_s[g++] = cp_step_blocked_s(&r->cpx);
        if (r->pp > 1) ms.comm_group[g] = "pp", ms.comm_s[g++] = st.idle; /* waiting for the neighbours */
        if (r->ep > 1) ms.comm_group[g] = "ep", ms.comm_s[g++] = ep_step_blocked_s(&r->epx);
        MetricsEp mep = {r->world, r->epf.sent, r->epf.recv, r->epf.rows, r->epf.imbalance};
        if (r->ep > 1) ms.ep = &mep;
        if (r->param_host) {
            /* ZeRO-2/3: this rank's fp32 shard (rank 0's is the one logged;
             * ZeRO-2's whole arena is still being refreshed) */
            size_t np = r->param_shard ? r->shard_n : model->num_params;
            if (r->param_shard) be->to_host(r->param_host, r->param_shard, np * sizeof(float));
            else model_params_to_host(model, r->param_host); /* precision.master bf16: widened */
            ms.param_hash = kiln_fnv1a(r->param_host, np * sizeof(float), KILN_FNV_INIT);
        }
        if (bad && !r->skip_nonfinite) {
            metrics_step(mx, &ms);
            metrics_fail(mx, KILN_EXIT_RUNTIME,
                         "step %d: non-finite %s (loss %g, gradient norm %g); parameters were not updated; "
                         "stopping (train.on_nonfinite: stop; `skip` would go on)",
                         step + 1, isfinite(loss) ? "gradient" : "loss", loss, info.grad_norm);
        }
        skips_in_a_row = bad ? skips_in_a_row + 1 : 0;
        if (bad && c->max_consecutive_skips > 0 && skips_in_a_row >= c->max_consecutive_skips) {
            metrics_step(mx, &ms);
            metrics_fail(mx, KILN_EXIT_RUNTIME,
                         "step %d: %d steps in a row were non-finite and skipped; the run is diverging: stopping "
                         "(train.max_consecutive_skips: %d; resume from an earlier checkpoint with a lower "
                         "optim.lr)",
                         step + 1, skips_in_a_row, c->max_consecutive_skips);
        }
        if (r->val && c->eval_every > 0 && ((step + 1) % c->eval_every == 0 || last)) {
            metrics_phase(mx, PHASE_EVAL, step + 1);
            double sum = 0;
            for (int i = 0; i < r->n_val; i++)
                sum += r->val_losses[i] =
                    evaluate(model, r->pp > 1 ? &r->pipe : NULL, r->vals[i], c->eval_batches, r->B, r->T, r->inp,
                             r->tgt, &r->ddp, r->dp, r->val_split);
            ms.val_loss = val_loss = (float)(sum / r->n_val); /* each set: the same number of tokens */
        } else {
            for (int i = 0; i < r->n_val; i++) r->val_losses[i] = NAN;
        }
        metrics_step(mx, &ms);
        char note[512];
        while (data_take_note(r->train, note, sizeof note)) metrics_print(mx, "%s", note);
        /* ZeRO-3: every rank runs the same generation; rank 0 prints it */
        if ((rank == 0 || r->sample_all) && c->sample_every > 0 && ((step + 1) % c->sample_every == 0 || last)) {
            metrics_phase(mx, PHASE_SAMPLE, step + 1);
            if (rank == 0) {
                metrics_bar_clear(mx);
                printf("--- sample at step %d ---\n", step + 1);
            }
            generate(model, r->pp > 1 ? &r->pipe : NULL, c, r->tok,
                     c->seed ^ (0x9e3779b97f4a7c15ULL * (uint64_t)(step + 1)), r->ctx, rank == 0 ? stdout : r->devnull);
            if (rank == 0) printf("---\n");
        }
        if (step + 1 == r->pause_at_step) stop_test_wait_signal();
        if (r->gated) stop_test_gate(step + 1);
        stopped = state_after_step(&r->rs, step + 1, last); /* enters PHASE_CHECKPOINT only when it saves */
        steps_done = step + 1;
    }
    int stop_reason = r->rs.stop_reason;
    state_close(&r->rs);
    if (stopped) {
        char why[256];
        snprintf(why, sizeof why, "stopped by %s after step %d; checkpoint written: resume with --resume auto",
                 stop_reason > 0 ? strsignal(stop_reason) : "the Slurm time limit", steps_done);
        metrics_print(mx, "%s (exit 75)", why);
        metrics_end(mx, KILN_EXIT_RESUME, why);
    }
    char vdone[64] = "";
    if (r->val && !isnan(val_loss)) snprintf(vdone, sizeof vdone, " | val loss %.4f", val_loss); /* not with eval_every 0 */
    char sdone[64] = "";
    if (metrics_skipped(mx)) snprintf(sdone, sizeof sdone, " | %d step(s) skipped", metrics_skipped(mx));
    metrics_print(mx, "done: %d steps in %.1f s | final loss %.4f%s%s", steps_done, kiln_now() - t_start, last_loss,
                  vdone, sdone);
    if (r->rg->size > 1 && step_time_sum > 0)
        metrics_print(mx, "data parallel: %.1f%% of step time blocked in gradient/parameter communication "
                          "(not overlapped with compute): %.3f of %.3f s",
                      100.0 * blocked_sum / step_time_sum, blocked_sum, step_time_sum);
    if (r->muon.be && step_time_sum > 0)
        metrics_print(mx, "muon: %.1f%% of step time in the owners' momentum and Newton-Schulz (%.3f of %.3f s), "
                      "%.1f%% blocked in its exchanges", 100.0 * r->muon.ns_s / step_time_sum, r->muon.ns_s,
                      step_time_sum, 100.0 * r->muon.comm_s / step_time_sum);
    if (tp > 1 && step_time_sum > 0)
        metrics_print(mx, "tensor parallel: %.1f%% of step time blocked in tp communication (activations and "
                          "partial gradients): %.3f of %.3f s", 100.0 * tp_blocked_sum / step_time_sum,
                      tp_blocked_sum, step_time_sum);
    if (cp > 1 && step_time_sum > 0)
        metrics_print(mx, "context parallel: %.1f%% of step time blocked waiting for K/V and dK/dV (%s; not overlapped "
                          "with attention): %.3f of %.3f s", 100.0 * cp_blocked_sum / step_time_sum,
                      cp_mode_name(r->cpx.mode), cp_blocked_sum, step_time_sum);
    if (r->ep > 1 && step_time_sum > 0)
        metrics_print(mx, "expert parallel: %.1f%% of step time blocked in the all-to-all (token rows and their "
                          "counts, forward and backward): %.3f of %.3f s", 100.0 * ep_blocked_sum / step_time_sum,
                      ep_blocked_sum, step_time_sum);
    if (r->pp > 1 && step_time_sum > 0)
        metrics_print(mx, "pipeline parallel: %.1f%% of step time idle waiting for a neighbour stage on this rank: "
                          "%.3f of %.3f s (the %s schedule's own bubble: %.1f%%)", 100.0 * pp_idle_sum / step_time_sum,
                      pp_idle_sum, step_time_sum, c->pp_schedule, 100.0 * r->pipe.theory);
    metrics_print(mx, "run directory: %s", c->run_dir);
    return stopped;
}

static void train_teardown(TrainRun *r) {
    metrics_close(r->mx);
    free(r->param_host);
    if (r->devnull) fclose(r->devnull);
    free(r->inp);
    free(r->tgt);
    free(r->ctx);
    optim_free(&r->opt);
    muon_dist_free(&r->muon);
    adafactor_free(&r->adafactor);
    if (r->pp > 1) pipe_free(&r->pipe);
    ddp_free(&r->ddp);
    tp_free(&r->tpx);
    cp_free(&r->cpx);
    ep_free(&r->epx);
    free(r->ep_fig);
    free(r->moe_buf.load);
    free(r->moe_buf.sums);
    model_free(&r->model);
    data_close(r->train);
    for (int i = 0; i < r->n_val; i++) data_close(r->vals[i]);
    tok_free(r->tok);
    if (r->be->shutdown) r->be->shutdown();
    mesh_free(&r->mesh);
    comm_finalize();
    flight_close();
}

int train_run_with(const Config *c, const TrainOptions *topt) {
    if (topt->dry_run) {
        ArchSpec shape;
        arch_from_config(c, &shape);
        /* count in the dtype of the backend the run would get here:
         * device auto on a machine without a GPU is the CPU's fp32 */
        Config *rc = xmalloc(sizeof *rc);
        *rc = *c;
        if (!strcmp(rc->device, "auto"))
            snprintf(rc->device, sizeof rc->device, "%s", backend_available("cuda") ? "cuda" : "cpu");
        print_plan(rc, &shape);
        free(rc);
        return KILN_EXIT_OK;
    }
    TrainRun *r = xcalloc(1, sizeof *r);
    train_setup(r, c, topt);
    train_describe(r);
    int stopped = train_loop(r);
    train_teardown(r);
    free(r);
    return stopped ? KILN_EXIT_RESUME : KILN_EXIT_OK;
}
