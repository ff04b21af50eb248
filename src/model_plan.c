/* model_plan: the activation arena's plan and byte counts (model.h,
 * ActPlan): every buffer a micro-batch's forward and backward keep, for
 * each model.recompute mode, pipeline slots, tp, sp, cp and ep shares and the
 * chunked loss. model_plan_slots (model.c) lays the arena out with it, and
 * ./train plan and --dry-run count with it, so the two cannot disagree.
 * Arithmetic only: nothing here allocates or runs an op. */
#include "model.h"

#include <string.h>

#include "util.h"

static const char *const recompute_names[MODEL_RECOMPUTE_MODES] = {"none", "gelu", "norm_gelu", "block",
                                                                               "selective"};

ModelRecompute model_recompute_parse(const char *name) {
    for (int r = 0; r < MODEL_RECOMPUTE_MODES; r++)
        if (strcmp(name, recompute_names[r]) == 0) return (ModelRecompute)r;
    kiln_fail(KILN_EXIT_USAGE, "key 'model.recompute': expected one of none, gelu, norm_gelu, block, selective, "
              "got '%s'", name);
}

const char *model_recompute_name(ModelRecompute r) {
    return r >= MODEL_RECOMPUTE_NONE && r < MODEL_RECOMPUTE_MODES ? recompute_names[r] : "?";
}

/* Widths of the backward's scratch buffers (act elements per row). */
typedef struct ScratchPlan {
    size_t dres, dbuf, dbuf2, dqkv, dln; /* per row of N */
    size_t moe_rows, moe_C, moe_2F, moe_F; /* MoE: R permuted rows of dyp/dxp (C), dhp (2Fe), dhp_act (Fe) */
} ScratchPlan;

static size_t zmax(size_t a, size_t b) { return a > b ? a : b; }


size_t model_loss_rows(const ArchSpec *s, size_t N, int loss_chunk) {
    size_t rows = (size_t)loss_chunk;
    if (loss_chunk == 0) return 0;
    if (loss_chunk < 0) {
        rows = 4 * N * (size_t)s->n_embd / (size_t)s->padded_vocab;
        rows = rows >= 64 ? rows / 64 * 64 : rows > 0 ? rows : 1;
    }
    return rows < N ? rows : 0;
}

double model_hw_flops_per_token(const ArchSpec *g, int T, int tp, size_t rows, ModelRecompute r, int every,
                                int loss_chunk, int split) {
    double fpt = arch_flops_per_token(g, T), head = 2.0 * g->n_embd * g->vocab_size;
    double layer_fwd = (fpt - 3 * head) / (3.0 * g->n_layer), hw = fpt;
    for (int l = 0; l < g->n_layer; l++) hw += model_recompute_layer(r, every, l) ? layer_fwd * (split ? 2 : 1) : 0;
    ArchSpec local;
    arch_tp_local(g, tp > 1 ? tp : 1, 0, &local);
    if (model_loss_rows(&local, rows, loss_chunk)) hw += head * (split ? 2 : 1);
    return hw;
}

int model_recompute_layer(ModelRecompute r, int every, int l) {
    return r == MODEL_RECOMPUTE_BLOCK && l % (every > 0 ? every : 1) == 0;
}

int model_layer_recomputed(const Model *m, int l) {
    return l >= 0 && model_recompute_layer(m->recompute, m->recompute_every, l);
}

/* Which shared buffers GELU, NORM_GELU and SELECTIVE recompute into (BLOCK
 * keeps all in every layer it keeps whole, and in its workspace). */
int model_recomputes_gelu(ModelRecompute r) {
    return r == MODEL_RECOMPUTE_GELU || r == MODEL_RECOMPUTE_NORM_GELU || r == MODEL_RECOMPUTE_SELECTIVE;
}
int model_recomputes_norm(ModelRecompute r) { return r == MODEL_RECOMPUTE_NORM_GELU || r == MODEL_RECOMPUTE_SELECTIVE; }
int model_recomputes_experts(ModelRecompute r) { return r == MODEL_RECOMPUTE_SELECTIVE; }

/* The arena being laid out: with base set, each take() returns its place;
 * without (counting only), NULL, written into throwaway views. Every buffer
 * is 64-byte aligned. */
typedef struct Take {
    char *base;
    size_t off;
} Take;

static void *take(Take *t, size_t count, size_t esize) {
    void *p = t->base ? t->base + t->off : NULL;
    t->off += (count * esize + 63) / 64 * 64;
    return p;
}

/* Widths of one layer's buffers (plan_bytes). */
typedef struct LayerDims {
    size_t N, Nres, C, NH, Q, QKVW, QK, G, FF, FCW, E, K, Fe, S, R, RG, ab;
    int moe, qk_norm, ep;
} LayerDims;

/* One layer's activations kept whole; keep_gelu, keep_norm, keep_moe: its
 * own MLP activation, norm outputs and MoE permuted rows and SwiGLU outputs
 * (else a shared buffer's, pointed at later). */
static void take_layer(Take *t, LayerActs *a, const LayerDims *d, int keep_gelu, int keep_norm, int keep_moe,
                       int split) {
    size_t N = d->N, C = d->C, ab = d->ab, F = sizeof(float), I = sizeof(int32_t), R = d->R;
    if (keep_norm) a->ln1 = take(t, N * C, ab);
    a->ln1_mean = take(t, N, F);
    a->ln1_rstd = take(t, N, F);
    a->qkv = take(t, N * d->QKVW, ab);
    if (d->qk_norm) {
        a->qk_in = take(t, N * d->QK, ab);
        a->qk_rstd = take(t, N * d->G, F);
    }
    a->atty = take(t, N * d->Q, ab);
    a->att_lse = take(t, N * d->NH, F);
    a->res2 = take(t, d->Nres * C, ab);
    if (keep_norm) a->ln2 = take(t, N * C, ab);
    a->ln2_mean = take(t, N, F);
    a->ln2_rstd = take(t, N, F);
    if (!d->moe) {
        a->fch = take(t, N * d->FCW, ab);
        if (keep_gelu) a->fch_gelu = take(t, N * d->FF, ab);
    } else {
        a->router = take(t, N * d->E, ab);
        a->probs = take(t, N * d->E, F);
        a->gates = take(t, N * d->K, F);
        a->stats = take(t, d->RG * (d->E + 1), F);
        a->topk = take(t, N * d->K, I);
        a->row_of = take(t, N * d->K, I);
        a->src = take(t, R, I);
        a->offsets = take(t, d->E + 1, I);
        a->counts = take(t, d->RG * d->E, I);
        if (keep_moe) a->xp = take(t, R * C, ab);
        if (d->ep <= 1) { /* expert parallelism: the expert side's activations are ep.c's */
            a->hp = take(t, R * 2 * d->Fe, ab);
            if (keep_moe) a->hp_act = take(t, R * d->Fe, ab);
        }
        a->yp = take(t, R * C, ab);
        if (d->S) {
            a->sh = take(t, N * 2 * d->S, ab);
            if (keep_moe) a->sh_act = take(t, N * d->S, ab);
        }
    }
    a->res3 = take(t, d->Nres * C, ab);
    if (split) {
        /* the input part is done with qkv, res2, fch and res3 (a layer's
         * output, read by the layer above, whose backward ran first);
         * recomputation still reads fch (the MLP activation) and res2, res3
         * (the norms' inputs); and the residual's N/tp rows under sequence
         * parallelism are too few for the gradients of all N */
        int own_res = !keep_norm || d->Nres < N;
        a->d_qkv = a->qkv;
        if (own_res) a->d_o = take(t, N * C, ab);
        else a->d_o = a->res2;
        if (!d->moe && !keep_gelu) a->d_fc = take(t, N * d->FCW, ab);
        else a->d_fc = d->moe ? NULL : a->fch;
        if (!d->moe && own_res) a->d_down = take(t, N * C, ab);
        else a->d_down = d->moe ? NULL : a->res3;
    }
}

/* A layer BLOCK checkpoints: its output (the next layer's input) and, for a
 * split backward, the four products' output gradients (its recomputations
 * overwrite the workspace in between); the rest is the workspace's. */
static void take_checkpointed(Take *t, LayerActs *a, const LayerDims *d, int split) {
    a->res3 = take(t, d->Nres * d->C, d->ab);
    if (!split) return;
    a->d_qkv = take(t, d->N * d->QKVW, d->ab);
    a->d_o = take(t, d->N * d->C, d->ab);
    a->d_fc = d->moe ? NULL : take(t, d->N * d->FCW, d->ab);
    a->d_down = d->moe ? NULL : take(t, d->N * d->C, d->ab);
}

/* Activation plan: the bytes each buffer needs, in one arena; act tensors
 * of act_bytes each, statistics fp32, every buffer 64-byte aligned (so with
 * fp32 the layout is the same as when everything was fp32). Also used by
 * --dry-run through model_activation_bytes, so the two can never disagree.
 * Each set (a chunk's slot) holds its input, its layers' activations, the
 * head's outputs or the output gradient, the input gradient (a chunk without
 * the embeddings) and the MoE aux gradients. What `r` recomputes gets one
 * buffer that every layer of every set points at, after the sets (BLOCK: a
 * whole layer's, the workspace, and its products' outputs); so do the
 * cross-entropy statistics, the logits row and the scratch. MoE activations
 * are kept except by BLOCK and (their pointwise outputs) SELECTIVE. A
 * layer's bytes depend on its kind alone (each buffer is rounded by
 * itself), so counting takes each kind's once: the planner's search counts
 * millions of arenas. */
size_t model_plan_bytes(const ArchSpec *s, int B, int T, size_t ab, ModelRecompute r, const ActPlan *pl, int tp,
                        int cp, int seq_par, int ep, Model *m) {
    size_t N = (size_t)B * T, C = (size_t)s->n_embd, F = sizeof(float), I = sizeof(int32_t);
    int moe = s->mlp == MLP_MOE;
    LayerDims d = {
        .N = N, .C = C, .NH = (size_t)s->n_head, .Q = (size_t)arch_q_width(s), .QKVW = (size_t)arch_qkv_width(s),
        .QK = (size_t)(s->n_head + s->n_kv_head) * s->head_dim,
        .G = s->qk_norm == QKNORM_HEAD ? (size_t)(s->n_head + s->n_kv_head) : 2, .FF = (size_t)s->ffn_hidden,
        .FCW = (size_t)arch_fc_width(s), .E = moe ? (size_t)s->moe.n_experts : 0, .K = moe ? (size_t)s->moe.top_k : 0,
        .Fe = moe ? (size_t)s->moe.expert_hidden : 0, .ab = ab, .moe = moe, .qk_norm = s->qk_norm != QKNORM_NONE,
        .ep = ep};
    /* the residual stream's rows: under sequence parallelism a rank's N/tp
     * (every forward splits: model_forward pads one sequence to a multiple
     * of tp) */
    d.Nres = tp > 1 && seq_par && cp == 1 ? (N + (size_t)tp - 1) / (size_t)tp : N;
    d.S = moe ? (size_t)s->moe.n_shared * d.Fe : 0;
    d.R = N * d.K;
    d.RG = cp > 1 ? 2 * (size_t)B : (size_t)B; /* MoE routing groups (moe_group_rows) */
    size_t E = d.E, K = d.K, R = d.R, RG = d.RG, S = d.S, Fe = d.Fe, FF = d.FF, FCW = d.FCW, Q = d.Q;
    /* Without a model, only count: views are written into a throwaway. */
    Model sink;
    ModelSlot sink_slot;
    LayerActs sink_layer;
    int assign = m != NULL;
    if (!m) {
        memset(&sink, 0, sizeof sink);
        m = &sink;
    }
    Take t = {.base = assign ? (char *)m->act_mem : NULL};
    if (assign) m->res_rows = d.Nres;
    int keep_gelu = !model_recomputes_gelu(r) || moe, keep_norm = !model_recomputes_norm(r), any_ckpt = 0;
    int keep_moe = !moe || !model_recomputes_experts(r);
    /* chunked loss: no logits outlive the head's forward or backward, so one
     * chunk's buffer serves every set (model_loss_rows) */
    size_t xent_rows = model_loss_rows(s, N, pl->loss_chunk);
    size_t whole_bytes = 0, ckpt_bytes = 0; /* counting: one layer of each kind */
    if (!assign) {
        Take w = {0}, k = {0};
        take_layer(&w, &sink_layer, &d, keep_gelu, keep_norm, keep_moe, pl->split);
        take_checkpointed(&k, &sink_layer, &d, pl->split);
        whole_bytes = w.off, ckpt_bytes = k.off;
    }
    int set = 0;
    for (int c = 0; c < pl->chunks; c++) {
        size_t set_start = t.off;
        for (int k = 0; k < pl->slots[c]; k++, set++) {
            if (!assign && k == 1) { /* counting: a chunk's sets are alike */
                t.off += (t.off - set_start) * (size_t)(pl->slots[c] - 1);
                set += pl->slots[c] - 1;
                break;
            }
            ModelSlot *sl = assign ? &m->slots[set] : &sink_slot;
            int lo = pl->lo[c], hi = pl->hi[c];
            sl->encoded = take(&t, d.Nres * C, ab);
            for (int l = lo; l < hi; l++) {
                LayerActs *a = assign ? &sl->acts[l] : &sink_layer;
                if (!assign) {
                    int ck = model_recompute_layer(r, pl->every, l);
                    t.off += ck ? ckpt_bytes : whole_bytes;
                    any_ckpt |= ck;
                    continue;
                }
                if (model_recompute_layer(r, pl->every, l)) {
                    take_checkpointed(&t, a, &d, pl->split);
                    any_ckpt = 1;
                } else {
                    take_layer(&t, a, &d, keep_gelu, keep_norm, keep_moe, pl->split);
                }
            }
            if (hi == s->n_layer) {
                sl->lnf = take(&t, N * C, ab);
                sl->lnf_mean = take(&t, N, F);
                sl->lnf_rstd = take(&t, N, F);
                sl->logits = xent_rows ? NULL : take(&t, N * (size_t)s->padded_vocab, ab);
                sl->losses = take(&t, N, F);
            } else {
                sl->stage_dout = take(&t, N * C, ab);
            }
            if (lo > 0) sl->stage_din = take(&t, d.Nres * C, ab); /* the residual rows this rank holds */
            if (moe) sl->aux = take(&t, RG * E * s->n_layer, F);
        }
    }
    if (moe && cp > 1) m->moe_caps = take(&t, RG * E, I); /* one layer's chunk limits (moe_cp_caps) */
    void *gelu_shared = NULL, *ln_shared = NULL; /* (N,F) (N,C) act */
    if (!keep_gelu) gelu_shared = take(&t, N * FF, ab);
    if (!keep_norm) ln_shared = take(&t, N * C, ab);
    /* SELECTIVE's MoE buffers: the permuted rows (R,C), the experts' SwiGLU
     * output (R,Fe) (ep.c's under expert parallelism) and the shared
     * experts' (N,S) */
    void *xp_shared = NULL, *hp_act_shared = NULL, *sh_act_shared = NULL;
    if (!keep_moe) {
        xp_shared = take(&t, R * C, ab);
        if (ep <= 1) hp_act_shared = take(&t, R * Fe, ab);
        if (S) sh_act_shared = take(&t, N * S, ab);
    }
    LayerActs ws = {0};
    m->rec_proj = NULL;
    if (any_ckpt) {
        take_layer(&t, &ws, &d, 1, 1, 1, 0);
        m->rec_proj = take(&t, 2 * N * C, ab);
    }
    if (assign) m->rec_ws = ws;
    for (int i = 0; assign && i < set; i++)
        for (int l = pl->lo[m->slots[i].chunk]; l < pl->hi[m->slots[i].chunk]; l++) {
            LayerActs *a = &m->slots[i].acts[l];
            if (!keep_gelu) a->fch_gelu = gelu_shared;
            if (!keep_norm) a->ln1 = a->ln2 = ln_shared;
            if (!keep_moe) a->xp = xp_shared, a->hp_act = hp_act_shared, a->sh_act = sh_act_shared;
            if (model_recompute_layer(r, pl->every, l)) { /* the workspace's views, but its own kept ones */
                LayerActs own = *a;
                *a = ws;
                a->res3 = own.res3, a->offsets_host = own.offsets_host;
                a->d_qkv = own.d_qkv, a->d_o = own.d_o, a->d_fc = own.d_fc, a->d_down = own.d_down;
            }
        }
    if (xent_rows) {
        void *logits = take(&t, xent_rows * (size_t)s->padded_vocab, ab);
        for (int i = 0; assign && i < set; i++)
            if (pl->hi[m->slots[i].chunk] == s->n_layer) m->slots[i].logits = logits;
    }
    if (assign) m->xent_rows = xent_rows;
    if (tp > 1) m->xent_stats = take(&t, (size_t)tp * N * 3, F);
    if (tp > 1 || cp > 1) m->row_dev = take(&t, (size_t)tp * s->padded_vocab, ab);
    /* forward: projection outputs (N,C); backward: dresidual (N,C), dbuf (N,
     * the widest of NH HD, F, S, C), dbuf2 (N, the widest of the first MLP
     * product and 2S), dqkv (N,QKVW), dln (N,C); MoE: dyp and dxp (R,C),
     * dhp (R,2Fe), dhp_act (R,Fe), dlogits (N,E) act, dgates (N,K) fp32;
     * all act unless said */
    ScratchPlan sp = {.dres = C, .dbuf = zmax(zmax(Q, FF), zmax(S, C)), .dbuf2 = zmax(FCW, 2 * S), .dqkv = d.QKVW,
                      .dln = C};
    size_t scratch = N * (sp.dres + sp.dbuf + sp.dbuf2 + sp.dqkv + sp.dln);
    if (moe) scratch += R * (2 * C + 3 * Fe) + N * E + (N * K * F + ab - 1) / ab + 64;
    if (tp > 1) scratch += N * C; /* dfull (N,C): a gathered gradient; the forward's reduce-scatter target */
    m->scratch = take(&t, scratch, ab);
    return t.off;
}

static ActPlan whole_plan(const ArchSpec *s, int every, int loss_chunk) {
    ActPlan p = {.chunks = 1, .hi = {s->n_layer}, .slots = {1}, .every = every, .loss_chunk = loss_chunk};
    return p;
}

size_t model_activation_bytes(const ArchSpec *s, int B, int T, size_t act_bytes, ModelRecompute r) {
    ActPlan p = whole_plan(s, 1, 0);
    return model_plan_bytes(s, B, T, act_bytes, r, &p, 1, 1, 0, 1, NULL);
}

size_t model_activation_bytes_rank(const ArchSpec *s, int tp, int cp, int ep, int sp, int B, int T, size_t act_bytes,
                                   ModelRecompute r, int every, int loss_chunk) {
    ArchSpec l;
    arch_tp_local(s, tp, 0, &l); /* rank 0 holds the most vocabulary rows */
    ActPlan p = whole_plan(s, every, loss_chunk);
    return model_plan_bytes(&l, B, T / cp, act_bytes, r, &p, tp, cp, sp, ep, NULL);
}

size_t model_activation_bytes_stage(const ArchSpec *s, int tp, int cp, int sp, int ep, int B, int T, size_t act_bytes,
                                    ModelRecompute r, int every, int loss_chunk, int chunks, const int *lo,
                                    const int *hi, const int *slots, int split) {
    ArchSpec l;
    arch_tp_local(s, tp, 0, &l);
    ActPlan p = {.chunks = chunks, .split = split, .every = every, .loss_chunk = loss_chunk};
    if (chunks < 1 || chunks > MODEL_MAX_CHUNKS) return 0;
    for (int c = 0; c < chunks; c++) p.lo[c] = lo[c], p.hi[c] = hi[c], p.slots[c] = slots[c];
    if (cp < 1) cp = 1;
    return model_plan_bytes(&l, B, T / cp, act_bytes, r, &p, tp, cp, sp, ep, NULL);
}
