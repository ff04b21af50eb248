/* train: one run from a resolved Config — backend, model, data, optimizer, the
 * step loop, evaluation, sampling and the run directory's files. Host logic
 * only: every tensor operation goes through the backend table. */
#include "train.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "comm.h"
#include "data.h"
#include "ddp.h"
#include "flight.h"
#include "mesh.h"
#include "tp.h"
#include "metrics.h"
#include "model.h"
#include "optim.h"
#include "plan.h"
#include "state.h"
#include "stop.h"
#include "tokenizer.h"
#include "util.h"

/* MoE after an optimizer step: the step's expert loads summed over the dp
 * ranks (one collective, with the drop counts) move the balancing bias
 * (model.moe.bias_update_rate) and give the step's router figures for the
 * metrics (*out, whose load points into *buf). *buf is grown here once, the
 * caller's to free. */
typedef struct MoeStepBuf {
    int64_t *load; /* (n_layer, E) */
    double *sums;  /* (n_layer E + 2): the loads, drops, routed slots on their way through the reduction */
} MoeStepBuf;

static void moe_after_step(Model *m, Ddp *d, MetricsMoe *out, MoeStepBuf *buf) {
    const ArchSpec *s = &m->shape;
    if (s->mlp != MLP_MOE) return;
    size_t n = (size_t)s->n_layer * s->moe.n_experts;
    if (!buf->load) buf->load = xmalloc(n * sizeof(int64_t)), buf->sums = xmalloc((n + 2) * sizeof(double));
    double *sums = buf->sums;
    for (size_t i = 0; i < n; i++) sums[i] = (double)m->moe.load[i];
    sums[n] = (double)m->moe.drops, sums[n + 1] = (double)m->moe.routed;
    ddp_sum_n(d, sums, n + 2); /* integers below 2^53: exact in any order */
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
    *out = (MetricsMoe){.aux = m->moe.aux, .z = m->moe.z, .dropped = routed > 0 ? drops / routed : 0.0,
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
    int dp = c->dp > 0 ? c->dp : 1, tp = c->tp, sp = tp > 1 && strcmp(c->sequence_parallel, "false") != 0;
    char err[512];
    if (arch_tp_check(s, tp, err, sizeof err) != 0) kiln_fail(KILN_EXIT_USAGE, "%s", err);
    printf("  memory per rank        dp %d%s x tp %d, ZeRO %d\n", dp,
           c->dp > 0 ? "" : " (parallel.dp: auto = ranks at launch)", tp, c->zero);
    /* the same accounting `./train plan` uses (src/plan.c) */
    PlanMemory mem = plan_memory_per_rank(s, tp, dp, c->zero, c->micro_batch, model_recompute_parse(c->recompute),
                                          optim_state_bytes(c->optim_state), plan_param_bytes(c->master));
    plan_print_state(&mem, dp, c->zero);
    plan_print_activations(&mem);
    plan_print_tp(s, tp, sp, dp, c->zero, c->micro_batch, c->grad_accum / dp);
    printf("  tokens per step        %lld (micro-batch %d x %d tokens x %d accumulation steps x %d ranks)\n",
           (long long)tokens_per_step, c->micro_batch, c->seq_len, c->grad_accum / dp, dp);
    printf("  micro-batches per step %d (%d per rank)\n", c->grad_accum, c->grad_accum / dp);
    printf("  steps                  %d\n", c->steps);
    printf("  tokens in total        %lld (%.3g)\n", (long long)tokens_per_step * c->steps,
           (double)tokens_per_step * c->steps);
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
static float evaluate(Model *m, DataLoader *val, int batches, int B, int T, int32_t *inp, int32_t *tgt, Ddp *d,
                      int split) {
    data_rewind(val);
    double sum = 0.0;
    /* split: the dp ranks share the batches (the loader slices each global
     * batch by rank), so together they see the same samples as one rank */
    int mine = split ? batches / ddp_ranks(d) : batches;
    for (int i = 0; i < mine; i++) {
        data_next_batch(val, inp, tgt);
        sum += model_forward(m, inp, tgt, B, T, 0.0f);
    }
    if (split) sum = ddp_sum(d, sum);
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
static void generate(Model *m, const Config *c, const Tokenizer *tok, uint64_t seed, int32_t *ctx, FILE *out) {
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
        model_forward(m, ctx + off, NULL, 1, len, 0.0f);
        model_logits_row(m, 0, len - 1, logits);
        int next = sample_token(logits, V, c->sample_temperature, c->sample_top_k, &rng, probs);
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
        int block = r == ROLE_QKV_W || r == ROLE_K_W || r == ROLE_V_W || r == ROLE_O_W || r == ROLE_FC_W ||
                    r == ROLE_UP_W || r == ROLE_DOWN_W || r == ROLE_SHARED_GATE_W || r == ROLE_SHARED_UP_W ||
                    r == ROLE_SHARED_DOWN_W || r == ROLE_EXPERT_GATE_W || r == ROLE_EXPERT_UP_W ||
                    r == ROLE_EXPERT_DOWN_W;
        if (!block || p->ndim != 2 || !p->trained) continue;
        int fused = r == ROLE_QKV_W && (i + 1 >= m->num_tensors || m->params[i + 1].role != ROLE_K_W);
        int parts = fused && c->muon_split_qkv && p->shape[0] % 3 == 0 ? 3 : 1;
        int rows = p->shape[0] / parts, cols = p->shape[1];
        for (int k = 0; k < parts; k++)
            mats[n++] = (OptimMatrix){.off = p->offset + (size_t)k * rows * cols, .rows = rows, .cols = cols,
                                      .scale = optim_muon_scale(c->muon_scale, rows, cols), .decay = p->decay};
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

/* KILN_TEST_TP_GRADS: one line per replicated tensor, its name and the
 * FNV-1a hash of its gradient's bytes. */
static void dump_replicated_grads(const Model *m, const char *path, int rank) {
    char name[1200];
    snprintf(name, sizeof name, "%s.rank%d", path, rank);
    FILE *f = fopen(name, "w");
    if (!f) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot write (KILN_TEST_TP_GRADS)", name);
    for (int i = 0; i < m->num_tensors; i++) {
        const ParamInfo *p = &m->params[i];
        if (p->split.dim >= 0) continue;
        float *g = xmalloc(p->numel * sizeof(float));
        m->be->to_host(g, m->gview[i], p->numel * sizeof(float));
        fprintf(f, "%s %016llx\n", p->name, (unsigned long long)kiln_fnv1a(g, p->numel * sizeof(float), KILN_FNV_INIT));
        free(g);
    }
    fclose(f);
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

int train_run_with(const Config *c, const TrainOptions *topt) {
    int dry_run = topt->dry_run;
    ArchSpec shape;
    arch_from_config(c, &shape);
    if (dry_run) {
        print_plan(c, &shape);
        return KILN_EXIT_OK;
    }

    Mesh mesh;
    int accum;
    setup_parallel(c, topt, &mesh, &accum);
    CommGroup *dpg = mesh_group(&mesh, MESH_GROUP_DP), *tpg = mesh_group(&mesh, MESH_GROUP_TP);
    int rank = mesh.rank, world = mesh.world, dp = dpg->size, dp_rank = dpg->rank;
    int tp = tpg->size, sp = tp > 1 && strcmp(c->sequence_parallel, "false") != 0;
    char tp_err[512];
    if (arch_tp_check(&shape, tp, tp_err, sizeof tp_err) != 0) kiln_fail(KILN_EXIT_USAGE, "%s", tp_err);

    const Backend *be = backend_get(c->device);
    if (!be)
        kiln_fail(KILN_EXIT_USAGE, "key 'device': '%s' is not available in this build (./train --version lists the backends)",
                  c->device);
    if (be->select_device) be->select_device(comm_info()->local_rank, comm_info()->local_world);
    const char *desc = be->init(c->threads);
    if (be->set_attention) be->set_attention(c->attention); /* precision.attention, chosen by set_precision */
    if (be->set_precision) be->set_precision(c->compute); /* precision.compute: GPU products */

    Tokenizer *tok = tok_open(c->tokenizer, c->tokenizer_file);
    if (tok_vocab_size(tok) > c->vocab_size)
        kiln_fail(KILN_EXIT_USAGE, "key 'model.vocab_size': %d is smaller than the %s tokenizer's %d ids", c->vocab_size,
                  c->tokenizer, tok_vocab_size(tok));

    if (kiln_mkdirs(c->run_dir) != 0) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot create the run directory", c->run_dir);
    if (rank == 0) write_resolved_config(c);

    int B = c->micro_batch, T = c->seq_len;
    /* each dp rank takes its slice of every global batch of the one global order */
    DataLoader *train = open_data(c, &c->train, 0, c->train.n, "data.train", 1, c->prefetch, dp_rank, dp);
    int val_split = c->eval_batches % dp == 0, n_val = c->val.n;
    DataLoader *vals[CFG_MAX_SOURCES] = {0}; /* one per validation set */
    for (int i = 0; i < n_val; i++) {
        char what[CFG_NAME + 16];
        snprintf(what, sizeof what, c->val.list ? "data.val '%s'" : "data.val", c->val.s[i].name);
        vals[i] = open_data(c, &c->val, i, 1, what, 0, 0, val_split ? dp_rank : 0, val_split ? dp : 1);
    }
    DataLoader *val = vals[0];

    Model model;
    /* precision.master bf16: no fp32 arena (exit 2 unless act is bf16) */
    model_init(&model, be, &shape,
               &(ModelOptions){.decay_embeddings = c->decay_embeddings, .master_bf16 = !strcmp(c->master, "bf16"),
                               .tp = tp, .tp_rank = tpg->rank, .sequence_parallel = sp});
    model.gelu_fusion = strcmp(c->gelu_fusion, "off") != 0; /* precision.gelu_fusion */
    /* gradient buckets of 25 MB (PyTorch DDP's default): big enough that
     * per-message latency is small, small enough to overlap with backward.
     * Before the weights: ZeRO-2/3 lay the arena out by layer. */
    Ddp ddp;
    if (dp > 1 && be->stream) {
        /* device memory: the dp group's float collectives run through NCCL on
         * the backend's stream (comm.h, "NCCL"); doubles and bytes stay on MPI */
        comm_nccl_init(dpg, c->run_dir);
        comm_nccl_device_mode(dpg, be->stream());
    }
    ddp_init(&ddp, &model, dpg, c->zero, (size_t)25 << 20);
    /* tensor parallelism: the layers' collectives over the tp group (tp.c);
     * the gradient norm sums over it too */
    if (tp > 1 && be->stream) {
        comm_nccl_init(tpg, c->run_dir);
        comm_nccl_device_mode(tpg, be->stream());
    }
    Tp tpx;
    tp_init(&tpx, &model, tpg);
    ddp_set_tp(&ddp, tpg);
    /* a resume overwrites the weights, so they are not drawn first (state_open
     * draws them if it loads nothing); ZeRO-3 shards them here and keeps no
     * whole copy to draw into later */
    int weights_unset = topt->resume && !c->init_from[0] && ddp_whole_params(&ddp);
    if (c->init_from[0]) {
        state_load_init_from(&model, c->init_from, rank == 0);
    }
    else if (!weights_unset) model_init_weights(&model, c->seed);
    ddp_shard_params(&ddp); /* ZeRO-2/3: take this rank's shard (ZeRO-3: drop the whole arena) */
    model_plan_activations(&model, B, T, model_recompute_parse(c->recompute));

    AdamW opt;
    size_t opt_lo, opt_hi;
    ddp_optim_range(&ddp, &opt_lo, &opt_hi);
    optim_init_shard_dtype(&opt, be, model.num_params, model.num_decay, opt_lo, opt_hi, c->beta1, c->beta2, c->eps,
                           c->weight_decay, c->grad_clip, optim_state_bytes(c->optim_state) == 2,
                           optim_round_seed(c->seed));
    if (model.master_bf16) optim_set_params_bf16(&opt); /* the same seed: other bits of each element's hash */
    if (optim_kind(c->optim_name) == OPTIM_LION) optim_set_lion(&opt, c->lion_beta1, c->lion_beta2);
    if (optim_kind(c->optim_name) == OPTIM_MUON) train_set_muon(&opt, &model, c, rank == 0);
    Schedule sched = {(SchedKind)optim_sched_kind(c->sched_kind), c->lr, c->warmup_steps, c->steps, c->min_lr_ratio,
                      c->decay_ratio};

    double fpt = arch_flops_per_token(&shape, T);
    /* MFU's denominator: the config's figure, else the GPU's datasheet peak,
     * else (the CPU) this machine's measured matrix-product rate */
    double peak = 0.0;
    char peak_src[160];
    const char *gpu = NULL;
    if (c->peak_gflops > 0) {
        peak = c->peak_gflops * 1e9;
        snprintf(peak_src, sizeof peak_src, "metrics.peak_gflops");
    } else if ((peak = metrics_peak_lookup(desc, c->compute, &gpu)) > 0) {
        snprintf(peak_src, sizeof peak_src, "%s %s dense, datasheet", gpu, c->compute);
    } else {
        peak = metrics_measure_matmul(be, 0.3);
        snprintf(peak_src, sizeof peak_src, "fp32 matmul rate measured at start-up");
    }
    /* checkpoints: collect the state table, resume, plan the writer (state.c) */
    RunState rs;
    size_t shard_n;
    float *param_shard = ddp_param_shard(&ddp, &shard_n); /* ZeRO-2/3: what checkpoints and hashes read */
    StateMesh smesh = {rank, world, dp, c->zero, dp_rank, tp, tpg->rank, comm_world(), param_shard ? &ddp : NULL,
                       weights_unset};
    int start_step = state_open(&rs, c, &smesh, topt->resume, topt->force, topt->commit, &model, &opt, train);
    model_params_changed(&model); /* a resume loaded them: the compute copy follows */
    Metrics *mx = metrics_open(c, rank, world, fpt, peak, peak_src, start_step);
    metrics_set_commit(mx, topt->commit);
    rs.mx = mx;
    metrics_print(mx, "kiln %s | %s", KILN_VERSION, desc);
    char cdesc[256], mdesc[128];
    comm_describe(cdesc, sizeof cdesc);
    mesh_describe(&mesh.shape, mdesc, sizeof mdesc);
    metrics_print(mx, "%s | mesh %s | ZeRO %d", cdesc, mdesc, c->zero);
    char ddesc[512];
    if (ddp_describe_layout(&ddp, ddesc, sizeof ddesc)) metrics_print(mx, "%s", ddesc);
    if (ddp_describe_memory(&ddp, ddesc, sizeof ddesc)) metrics_print(mx, "%s", ddesc);
    if (rs.resumed_msg[0]) metrics_print(mx, "%s", rs.resumed_msg);
    if (rs.data_note[0]) metrics_print(mx, "%s", rs.data_note);
    metrics_print(mx, "run %s -> %s", c->run_name, c->run_dir);
    metrics_print(mx, "model %s (%s MLP): %zu parameters (%.2fM), %.3g FLOPs/token", c->arch,
                  arch_mlp_name(shape.mlp), arch_num_params(&shape), arch_num_params(&shape) / 1e6, fpt);
    if (tp > 1)
        metrics_print(mx, "tensor parallel: %d ranks, %zu parameters here (heads %d of %d, kv heads %d of %d, MLP "
                      "width %d of %d, vocabulary rows %d), sequence parallel %s", tp, model_num_params(&model),
                      model.shape.n_head, shape.n_head, model.shape.n_kv_head, shape.n_kv_head,
                      shape.mlp == MLP_MOE ? shape.ffn_hidden : model.shape.ffn_hidden, shape.ffn_hidden,
                      model.shape.padded_vocab, sp ? "on" : "off");
    int fused = model_gelu_fused(&model, 0) || model_gelu_fused(&model, 1);
    metrics_print(mx, "activations: %.2f MiB for a %d x %d micro-batch, %zu-byte activations, recompute %s%s",
                  model.act_size / 1048576.0, B, T, model.act_bytes, model_recompute_name(model.recompute),
                  model.recompute == MODEL_RECOMPUTE_NONE ? ""
                  : fused ? " (the backward recomputes them; the GeLU's last bits may differ from the fused forward's)"
                          : " (the backward recomputes them: bit-identical)");
    if (model.master_bf16)
        metrics_print(mx, "parameters: bf16 (precision.master), no fp32 master (%.2f MiB saved); AdamW rounds each "
                          "update stochastically; gradients fp32", model.num_params * 4.0 / 1048576.0);
    metrics_print(mx, "gelu fusion: %s", !model.gelu_fusion ? "off (precision.gelu_fusion), fc product and GeLU separate"
                  : fused ? "on: fc product and GeLU fused (forward and backward) by the backend"
                          : "not offered by this backend: fc product and GeLU separate");
    char vtok[64] = "";
    uint64_t val_tokens = 0;
    for (int i = 0; i < n_val; i++) val_tokens += data_num_tokens(vals[i]);
    if (val) snprintf(vtok, sizeof vtok, ", %llu val tokens in %d set(s)", (unsigned long long)val_tokens, n_val);
    metrics_print(mx, "data: %llu train tokens in %d shard(s)%s; prefetch %d batch(es)",
                  (unsigned long long)data_num_tokens(train), data_num_shards(train), vtok, c->prefetch);
    if (c->train.list) {
        char mix[2048];
        data_describe(train, mix, sizeof mix);
        metrics_print(mx, "data: mixture of %d source(s): %s", c->train.n, mix);
    }
    /* metrics: tokens drawn from each source, each validation set's loss */
    const char *src_names[CFG_MAX_SOURCES], *val_names[CFG_MAX_SOURCES];
    uint64_t src_tokens[CFG_MAX_SOURCES];
    float val_losses[CFG_MAX_SOURCES];
    for (int i = 0; i < data_num_sources(train); i++) src_names[i] = data_source_name(train, i);
    for (int i = 0; i < n_val; i++) val_names[i] = c->val.s[i].name;
    metrics_print(mx, "batch: %d x %d tokens x %d accumulation x %d rank(s) = %lld tokens/step, %d steps", B, T,
                  accum, dp, (long long)c->total_tokens, c->steps);

    /* Test hook (docs/metrics.md): poison one gradient at this step, and
     * fingerprint the parameters after every step so a test can see that a
     * skipped step left them unchanged. */
    const char *nan_env = getenv("KILN_TEST_INJECT_NAN_STEP");
    int inject_nan_step = nan_env ? atoi(nan_env) : 0;
    int inject_nan_after = nan_env && strchr(nan_env, '+') != NULL; /* "N+": every step from N on */
    /* Test hook (docs/metrics.md): after step N, wait for a stop signal, so a
     * signal test cannot lose a race against the end of the run. */
    /* Test hook (docs/parallel.md): after the first step's gradient sync,
     * fingerprint every replicated tensor's gradient into FILE.rank<R>, so a
     * test can see that every tp rank holds the same */
    const char *tp_grads_file = ddp_whole_params(&ddp) && !param_shard ? getenv("KILN_TEST_TP_GRADS") : NULL;
    const char *pause_env = getenv("KILN_TEST_PAUSE_AT_STEP");
    int pause_at_step = pause_env ? atoi(pause_env) : 0;
    float *param_host = inject_nan_step > 0 ? xmalloc((param_shard ? shard_n : model.num_params) * sizeof(float)) : NULL;
    int skip_nonfinite = strcmp(c->on_nonfinite, "skip") == 0, skips_in_a_row = 0;
    /* ZeRO-3: every rank samples (each forward gathers layers collectively);
     * ZeRO-2's forward only waits for refreshes every rank has posted */
    int sample_all = !ddp_whole_params(&ddp) || tp > 1; /* tp: every rank computes its part */
    FILE *devnull = sample_all && rank > 0 ? fopen("/dev/null", "w") : NULL;
    if (sample_all && rank > 0 && !devnull) kiln_fail(KILN_EXIT_RUNTIME, "/dev/null: cannot open (samples of rank %d)", rank);
    size_t N = (size_t)B * T;
    int32_t *inp = xmalloc(N * sizeof(int32_t));
    int32_t *tgt = xmalloc(N * sizeof(int32_t));
    int32_t *ctx = xmalloc((size_t)2 * T * sizeof(int32_t) + 8);
    /* the mean over the global batch: every rank's gradients are summed */
    float dloss = 1.0f / (float)(N * (size_t)accum * (size_t)dp);
    double step_time_sum = 0.0, blocked_sum = 0.0, tp_blocked_sum = 0.0;
    /* a resumed run: how long the restart took, to the first step */
    double resume_s = rs.resumed_msg[0] ? kiln_process_age() : 0;
    char rsize[32];
    if (resume_s > 0)
        metrics_print(mx, "resume: %.2f s from process start to the first step (the checkpoint: %s loaded and "
                      "verified here in %.2f s, %.2f GB/s)", resume_s, kiln_fmt_bytes(rs.resume_gb * 1e9, rsize,
                      sizeof rsize), rs.resume_load_s, rs.resume_load_s > 0 ? rs.resume_gb / rs.resume_load_s : 0);
    double t_start = kiln_now();
    float val_loss = NAN, last_loss = NAN;

    MoeStepBuf moe_buf = {0}; /* MoE: the step's loads, all ranks (moe_after_step) */
    int stopped = 0, steps_done = start_step;
    for (int step = start_step; step < c->steps && !stopped; step++) {
        double t0 = kiln_now();
        float lr = optim_lr(&sched, step);
        double loss_sum = 0.0;
        model_moe_reset(&model);
        for (int micro = 0; micro < accum; micro++) {
            metrics_phase(mx, PHASE_DATA, step + 1);
            data_next_batch(train, inp, tgt);
            metrics_phase(mx, PHASE_FORWARD, step + 1);
            /* on the last micro-batch: post gradient buckets as layers finish */
            ddp_micro_begin(&ddp, micro == 0, micro == accum - 1);
            tp_micro_begin(&tpx, micro == 0, micro == accum - 1);
            loss_sum += model_forward(&model, inp, tgt, B, T, dloss);
            metrics_phase(mx, PHASE_BACKWARD, step + 1);
            model_backward(&model, micro > 0);
        }
        tp_drain(&tpx); /* the backward's last tp collectives, with the deadline */
        if (inject_nan_step > 0 && (step + 1 == inject_nan_step || (inject_nan_after && step + 1 > inject_nan_step))) {
            float poison = NAN;
            /* ZeRO-2/3: the gradient shard (there is no whole arena) */
            be->to_device(ddp_optim_grads(&ddp), &poison, sizeof poison);
        }
        metrics_phase(mx, PHASE_SYNC, step + 1);
        double grad_norm = ddp_reduce_grads(&ddp);
        if (tp_grads_file && step == start_step) dump_replicated_grads(&model, tp_grads_file, rank);
        float loss = (float)(ddp_sum(&ddp, loss_sum) / (accum * dp));
        metrics_phase(mx, PHASE_OPTIMIZER, step + 1);
        /* a non-finite loss skips the update even if its gradients look finite */
        OptimStepInfo info = {grad_norm, 1.0f, 1};
        if (isfinite(loss)) info = ddp_optim_step(&ddp, &opt, lr, grad_norm);
        MetricsMoe moe_ms = {0};
        if (isfinite(loss)) moe_after_step(&model, &ddp, &moe_ms, &moe_buf);
        model_params_changed(&model); /* the next forward casts the compute copy again */
        be->sync();
        int bad = !isfinite(loss) || info.nonfinite;
        double dt = kiln_now() - t0;
        step_time_sum += dt, blocked_sum += ddp_step_blocked_s(&ddp), tp_blocked_sum += tp_step_blocked_s(&tpx);
        if (!bad) last_loss = loss;
        int last = step == c->steps - 1;
        for (int i = 0; i < data_num_sources(train); i++) src_tokens[i] = data_source_tokens(train, i);
        MetricsData md = {.wait_s = data_take_wait_s(train), .n_sources = data_num_sources(train),
                          .source_names = src_names, .source_tokens = src_tokens, .n_val = c->val.list ? n_val : 0,
                          .val_names = val_names, .val_losses = val_losses};
        MetricsStep ms = {step + 1, (int64_t)c->total_tokens * (step + 1), loss, NAN, lr, info.grad_norm,
                          info.grad_scale, dt, bad, 0, be->memory_peak ? be->memory_peak() / 1048576.0 : 0,
                          moe_ms.load ? &moe_ms : NULL, .comm_group = {"dp", tp > 1 ? "tp" : NULL},
                          .comm_s = {ddp_step_blocked_s(&ddp), tp_step_blocked_s(&tpx)}, .data = &md,
                          .ckpt = state_checkpoint_report(&rs), .resume_s = step == start_step ? resume_s : 0};
        if (param_host) {
            /* ZeRO-2/3: this rank's fp32 shard (rank 0's is the one logged;
             * ZeRO-2's whole arena is still being refreshed) */
            size_t np = param_shard ? shard_n : model.num_params;
            if (param_shard) be->to_host(param_host, param_shard, np * sizeof(float));
            else model_params_to_host(&model, param_host); /* precision.master bf16: widened */
            ms.param_hash = kiln_fnv1a(param_host, np * sizeof(float), KILN_FNV_INIT);
        }
        if (bad && !skip_nonfinite) {
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
        if (val && c->eval_every > 0 && ((step + 1) % c->eval_every == 0 || last)) {
            metrics_phase(mx, PHASE_EVAL, step + 1);
            double sum = 0;
            for (int i = 0; i < n_val; i++)
                sum += val_losses[i] = evaluate(&model, vals[i], c->eval_batches, B, T, inp, tgt, &ddp, val_split);
            ms.val_loss = val_loss = (float)(sum / n_val); /* each set: the same number of tokens */
        } else {
            for (int i = 0; i < n_val; i++) val_losses[i] = NAN;
        }
        metrics_step(mx, &ms);
        char note[512];
        while (data_take_note(train, note, sizeof note)) metrics_print(mx, "%s", note);
        /* ZeRO-3: every rank runs the same generation; rank 0 prints it */
        if ((rank == 0 || sample_all) && c->sample_every > 0 && ((step + 1) % c->sample_every == 0 || last)) {
            metrics_phase(mx, PHASE_SAMPLE, step + 1);
            if (rank == 0) {
                metrics_bar_clear(mx);
                printf("--- sample at step %d ---\n", step + 1);
            }
            generate(&model, c, tok, c->seed ^ (0x9e3779b97f4a7c15ULL * (uint64_t)(step + 1)), ctx,
                     rank == 0 ? stdout : devnull);
            if (rank == 0) printf("---\n");
        }
        if (step + 1 == pause_at_step) stop_test_wait_signal();
        stopped = state_after_step(&rs, step + 1, last); /* enters PHASE_CHECKPOINT only when it saves */
        steps_done = step + 1;
    }
    int stop_reason = rs.stop_reason;
    state_close(&rs);
    if (stopped) {
        char why[256];
        snprintf(why, sizeof why, "stopped by %s after step %d; checkpoint written: resume with --resume auto",
                 stop_reason > 0 ? strsignal(stop_reason) : "the Slurm time limit", steps_done);
        metrics_print(mx, "%s (exit 75)", why);
        metrics_end(mx, KILN_EXIT_RESUME, why);
    }
    char vdone[64] = "";
    if (val && !isnan(val_loss)) snprintf(vdone, sizeof vdone, " | val loss %.4f", val_loss); /* not with eval_every 0 */
    char sdone[64] = "";
    if (metrics_skipped(mx)) snprintf(sdone, sizeof sdone, " | %d step(s) skipped", metrics_skipped(mx));
    metrics_print(mx, "done: %d steps in %.1f s | final loss %.4f%s%s", steps_done, kiln_now() - t_start, last_loss,
                  vdone, sdone);
    if (dp > 1 && step_time_sum > 0)
        metrics_print(mx, "data parallel: %.1f%% of step time blocked in gradient/parameter communication "
                          "(not overlapped with compute): %.3f of %.3f s",
                      100.0 * blocked_sum / step_time_sum, blocked_sum, step_time_sum);
    if (tp > 1 && step_time_sum > 0)
        metrics_print(mx, "tensor parallel: %.1f%% of step time blocked in tp communication (activations and "
                          "partial gradients): %.3f of %.3f s", 100.0 * tp_blocked_sum / step_time_sum,
                      tp_blocked_sum, step_time_sum);
    metrics_print(mx, "run directory: %s", c->run_dir);
    metrics_close(mx);
    free(param_host);
    if (devnull) fclose(devnull);

    free(inp);
    free(tgt);
    free(ctx);
    optim_free(&opt);
    ddp_free(&ddp);
    tp_free(&tpx);
    free(moe_buf.load);
    free(moe_buf.sums);
    model_free(&model);
    data_close(train);
    for (int i = 0; i < n_val; i++) data_close(vals[i]);
    tok_free(tok);
    if (be->shutdown) be->shutdown();
    mesh_free(&mesh);
    comm_finalize();
    flight_close();
    return stopped ? KILN_EXIT_RESUME : KILN_EXIT_OK;
}
