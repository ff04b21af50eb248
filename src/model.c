/* model: the parameter table placed in arenas, the parameters' compute copy
 * (initial values: model_init.c), the activation arena (its plan and byte
 * counts: model_plan.c), and the forward/backward
 * block graph (GPT-2, Llama, MoE pieces by spec) expressed as backend ops.
 * Must never do arithmetic on tensors itself (that is the backend's: even the
 * compute copy is a backend cast), know the optimizer or data, or communicate
 * (parallel code runs through ModelHooks). */
#include "model.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

/* ---------------------------------------------------------------------------
 * The table and its views */

int model_tensor_index(const Model *m, int layer, int role, int expert) {
    int L = m->shape.n_layer;
    if (role < ROLE_LAYER_COUNT) return m->slot[(layer + 1) * ROLE_LAYER_COUNT + role];
    int E = m->shape.mlp == MLP_MOE ? m->shape.moe.n_experts : 0;
    if (layer < 0 || expert < 0 || expert >= E) return -1;
    return m->slot[(L + 1) * ROLE_LAYER_COUNT + ((size_t)layer * E + expert) * ROLE_EXPERT_COUNT +
                   (role - ROLE_LAYER_COUNT)];
}

int model_grads_ready_layer(const Model *m, int i) {
    const ParamInfo *p = &m->params[i];
    if (p->layer >= 0) return p->layer;
    return p->role == ROLE_TOK_EMB || p->role == ROLE_POS_EMB ? -1 : m->shape.n_layer - 1;
}

/* Views of (layer, role): compute copy, fp32 parameter, gradient; NULL where absent. */
static const void *W(const Model *m, int layer, int role) {
    int i = model_tensor_index(m, layer, role, -1);
    return i < 0 ? NULL : m->wview[i];
}
static float *G(const Model *m, int layer, int role) {
    int i = model_tensor_index(m, layer, role, -1);
    return i < 0 ? NULL : m->gview[i];
}
static const void *WX(const Model *m, int layer, int role, int e) { return m->wview[model_tensor_index(m, layer, role, e)]; }
static float *GX(const Model *m, int layer, int role, int e) { return m->gview[model_tensor_index(m, layer, role, e)]; }

/* Point views v[i] into arena `base`, by table row. */
static void bind_views(const Model *m, float *base, float **v) {
    for (int i = 0; i < m->num_tensors; i++) v[i] = base + m->params[i].offset;
}

/* Place tensor i at `off` (after tensor `prev`, -1 for none), returning the
 * next free offset. Offsets are multiples of 16 floats (64 bytes), so every
 * tensor starts cache-line aligned, except a tensor that follows the one
 * before it, which sits right after it (one product reads both). */
static size_t place(Model *m, int i, int prev, size_t off) {
    ParamInfo *p = &m->params[i];
    if (p->follows && prev == i - 1) off = m->params[prev].offset + m->params[prev].numel;
    p->offset = off;
    int next_follows = i + 1 < m->num_tensors && m->params[i + 1].follows;
    return next_follows ? off + p->numel : (off + p->numel + 15) / 16 * 16;
}

/* ---------------------------------------------------------------------------
 * The compute copy. act_bytes 4: its views are the fp32 views. act_bytes 2:
 * each distinct fp32 buffer the views point into (the arena; under ZeRO-3 the
 * gather buffers) has a compute buffer of the same layout, and a tensor's
 * compute view sits at the same element offset from its buffer's start. */

/* Compute buffer of unit u (u = n_layer: the non-layer tensors); 0 when the arena
 * is not laid out by unit. */
static int unit_buf(const Model *m, int u) { return m->unit_cbuf ? m->unit_cbuf[u] : 0; }

/* Derive every compute view from the fp32 view of the same tensor. */
static void bind_compute(Model *m) {
    for (int i = 0; i < m->num_tensors; i++) {
        if (m->master_bf16) { /* no fp32 views: the bf16 parameters, by arena offset */
            m->wview[i] = m->param16 + m->params[i].offset;
            continue;
        }
        float *master = m->pview[i];
        if (m->act_bytes == sizeof(float)) {
            m->wview[i] = master;
            continue;
        }
        const ComputeBuf *cb = &m->cbuf[unit_buf(m, model_unit_of(m, i))];
        m->wview[i] = (const char *)cb->mem + (size_t)(master - cb->master) * m->act_bytes;
    }
}

static void cbuf_free_all(Model *m) {
    for (int k = 0; k < m->n_cbuf; k++) m->be->free(m->cbuf[k].mem);
    m->n_cbuf = 0;
}

/* After the arena moved (init, layout, padding): one compute buffer over the
 * whole arena, stale. precision.master bf16: that buffer is the parameters
 * (param16), with no master to cast from: never stale. */
static void compute_reset(Model *m) {
    cbuf_free_all(m);
    if (m->act_bytes != sizeof(float)) {
        int cap = m->n_units + 1;
        m->cbuf = xrealloc(m->cbuf, (size_t)cap * sizeof(ComputeBuf));
        m->cbuf[0] = (ComputeBuf){m->param_mem, m->be->alloc(m->arena_len * m->act_bytes), m->arena_len,
                                  !m->master_bf16};
        m->n_cbuf = 1;
        m->param16 = m->master_bf16 ? m->cbuf[0].mem : NULL;
    }
    if (m->unit_cbuf) memset(m->unit_cbuf, 0, (size_t)m->n_units * sizeof(int));
    for (int u = 0; m->unit_stale && u < m->n_units; u++) m->unit_stale[u] = 1;
    bind_compute(m);
}

/* Unit u was re-bound to pbuf: give it the compute buffer of pbuf (made or
 * grown here, at setup), and free buffers no unit uses any more. */
static void compute_bind_unit(Model *m, int u, const float *pbuf) {
    if (m->act_bytes == sizeof(float)) {
        bind_compute(m);
        return;
    }
    int k = 0;
    while (k < m->n_cbuf && m->cbuf[k].master != pbuf) k++;
    if (k == m->n_cbuf) m->cbuf[m->n_cbuf++] = (ComputeBuf){pbuf, NULL, 0, 1};
    ComputeBuf *cb = &m->cbuf[k];
    if (cb->len < m->unit_len[u]) {
        if (cb->mem) m->be->free(cb->mem);
        cb->len = m->unit_len[u];
        cb->mem = m->be->alloc(cb->len * m->act_bytes);
    }
    cb->stale = 1;
    m->unit_cbuf[u] = k;
    m->unit_stale[u] = 1;
    for (int j = 0; j < m->n_cbuf;) {
        int used = 0;
        for (int v = 0; v < m->n_units; v++) used = used || m->unit_cbuf[v] == j;
        if (used) {
            j++;
            continue;
        }
        m->be->free(m->cbuf[j].mem);
        m->cbuf[j] = m->cbuf[--m->n_cbuf];
        for (int v = 0; v < m->n_units; v++)
            if (m->unit_cbuf[v] == m->n_cbuf) m->unit_cbuf[v] = j;
    }
    bind_compute(m);
}

void model_params_changed(Model *m) {
    if (m->master_bf16) return; /* the ops read the parameters themselves */
    for (int k = 0; k < m->n_cbuf; k++) m->cbuf[k].stale = 1;
    for (int u = 0; m->unit_stale && u < m->n_units; u++) m->unit_stale[u] = 1;
}

/* Before unit u's ops run: cast its compute copy if the master changed. Laid
 * out by unit, only the unit's own range (unit_len[u] elements from where its
 * first tensor's view says the unit starts): ZeRO-2 keeps the whole arena
 * in one buffer but refreshes it unit by unit as each gather lands. */
static void compute_refresh(Model *m, int u) {
    if (m->act_bytes == sizeof(float)) return;
    ComputeBuf *cb = &m->cbuf[unit_buf(m, u)];
    if (!m->unit_stale) {
        if (!cb->stale) return;
        m->be->cast_to_act(cb->mem, cb->master, cb->len);
        cb->stale = 0;
        return;
    }
    if (!m->unit_stale[u] || !m->unit_len[u]) return; /* empty: a pipeline stage's units of other stages */
    int first = 0;
    while (model_unit_of(m, first) != u) first++;
    const float *base = m->pview[first] - (m->params[first].offset - m->unit_off[u]);
    m->be->cast_to_act((char *)cb->mem + (size_t)(base - cb->master) * m->act_bytes, base, m->unit_len[u]);
    m->unit_stale[u] = 0;
}

/* Before layer `layer`'s forward or backward (-1: the embeddings, wte, wpe
 * and ln_f): the ZeRO-2/3 hook gathers (or waits for) the layer's
 * parameters and says whether they changed; then the compute copy. */
static void use_layer(Model *m, int layer, int backward) {
    int u = layer < 0 ? m->shape.n_layer : layer;
    if (m->hooks.layer_begin && m->hooks.layer_begin(m->hooks.ctx, layer, backward) && m->unit_stale)
        m->unit_stale[u] = 1;
    compute_refresh(m, u);
}

int model_unit_of(const Model *m, int i) {
    int l = m->params[i].layer;
    return l >= 0 ? l : m->shape.n_layer;
}

/* ZeRO's layouts shard and gather the fp32 master, which precision.master
 * bf16 does not have (the config refuses the pair; this is the backstop). */
static void need_master(const Model *m, const char *what) {
    if (m->master_bf16)
        kiln_fail(KILN_EXIT_USAGE, "key 'precision.master': bf16 keeps no fp32 parameters for %s; set "
                  "parallel.zero: 0 or precision.master: fp32", what);
}

void model_layout_by_unit(Model *m, size_t unit_align) {
    need_master(m, "ZeRO-2/3's layout");
    int L = m->shape.n_layer;
    if (unit_align < 1) unit_align = 1;
    m->n_units = L + 1;
    m->unit_off = xcalloc((size_t)m->n_units, sizeof(size_t));
    m->unit_len = xcalloc((size_t)m->n_units, sizeof(size_t));
    size_t off = 0;
    for (int u = 0; u < m->n_units; u++) {
        m->unit_off[u] = off;
        int prev = -1;
        for (int i = 0; i < m->num_tensors; i++) {
            if (model_unit_of(m, i) != u) continue;
            off = place(m, i, prev, off);
            prev = i;
        }
        off = m->unit_off[u] + (off - m->unit_off[u] + unit_align - 1) / unit_align * unit_align;
        m->unit_len[u] = off - m->unit_off[u];
    }
    m->num_decay = 0;
    m->num_params = m->arena_len = off;
    m->be->free(m->param_mem);
    m->be->free(m->grad_mem);
    m->param_mem = m->be->alloc(off * sizeof(float));
    m->grad_mem = NULL; /* the caller binds the gradient views (model_bind_unit) */
    bind_views(m, m->param_mem, m->pview);
    m->unit_cbuf = xcalloc((size_t)m->n_units, sizeof(int));
    m->unit_stale = xcalloc((size_t)m->n_units, sizeof(int));
    compute_reset(m);
}

void model_bind_unit(Model *m, int u, float *pbuf, float *gbuf) {
    need_master(m, "ZeRO-2/3's layers");
    for (int i = 0; i < m->num_tensors; i++) {
        if (model_unit_of(m, i) != u) continue;
        size_t at = m->params[i].offset - m->unit_off[u];
        if (pbuf) m->pview[i] = pbuf + at;
        if (gbuf) m->gview[i] = gbuf + at;
    }
    if (pbuf) compute_bind_unit(m, u, pbuf); /* NULL: the parameters stay where they are */
}

/* RoPE's table (seq_len, 2, HD/2): per position, cos then sin of pos * inv_freq[i], computed
 * as HF's Llama does in fp32 (inv_freq = 1 / theta^(2i/HD) in float, the
 * llama3 scaling on it, the angle rounded to float), so positions far from
 * 0 carry the same angles as the reference. */
static void rope_table(Model *m) {
    const ArchSpec *s = &m->shape;
    int H = s->head_dim / 2, T = s->seq_len;
    float *inv = xmalloc((size_t)H * sizeof(float)), *tab = xmalloc((size_t)2 * T * H * sizeof(float));
    for (int i = 0; i < H; i++) inv[i] = 1.0f / powf(s->rope_theta, (float)(2 * i) / (float)s->head_dim);
    const ArchRopeScaling *r = &s->rope_scaling;
    if (r->on) {
        /* HF _compute_llama3_parameters: long wavelengths are slowed by
         * `factor`, short ones kept, the band between blended smoothly. */
        float low_wl = (float)r->original_context / r->low_freq_factor;
        float high_wl = (float)r->original_context / r->high_freq_factor;
        for (int i = 0; i < H; i++) {
            float wl = 2.0f * (float)M_PI / inv[i];
            if (wl > low_wl) {
                inv[i] = inv[i] / r->factor;
            } else if (wl >= high_wl) {
                float smooth = ((float)r->original_context / wl - r->low_freq_factor) /
                               (r->high_freq_factor - r->low_freq_factor);
                inv[i] = (1.0f - smooth) * inv[i] / r->factor + smooth * inv[i];
            }
        }
    }
    for (int t = 0; t < T; t++)
        for (int i = 0; i < H; i++) {
            float a = (float)t * inv[i];
            tab[(size_t)t * 2 * H + i] = (float)cos((double)a);
            tab[(size_t)t * 2 * H + H + i] = (float)sin((double)a);
        }
    m->rope = m->be->alloc((size_t)2 * T * H * sizeof(float));
    m->be->to_device(m->rope, tab, (size_t)2 * T * H * sizeof(float));
    free(inv);
    free(tab);
}

void model_init(Model *m, const Backend *be, const ArchSpec *s, const ModelOptions *o) {
    ModelOptions none = {0};
    if (!o) o = &none;
    memset(m, 0, sizeof *m);
    m->gshape = *s;
    m->tp = o->tp > 1 ? o->tp : 1;
    m->tp_rank = m->tp > 1 ? o->tp_rank : 0;
    char err[512];
    if (arch_tp_check(s, m->tp, err, sizeof err) != 0) kiln_fail(KILN_EXIT_USAGE, "%s", err);
    arch_tp_local(s, m->tp, m->tp_rank, &m->shape);
    s = &m->shape; /* from here on: what this rank computes */
    m->sp = m->tp > 1 && o->sequence_parallel;
    int E_all = s->mlp == MLP_MOE ? s->moe.n_experts : 0;
    m->ep = o->ep > 1 ? o->ep : 1;
    m->ep_rank = m->ep > 1 ? o->ep_rank : 0;
    if (m->ep > 1 && (s->mlp != MLP_MOE || E_all % m->ep || m->ep_rank < 0 || m->ep_rank >= m->ep))
        kiln_fail(KILN_EXIT_USAGE, "keys 'parallel.ep', 'model.moe.n_experts': ep %d (rank %d) needs an MoE model "
                  "whose experts it divides (n_experts %d)", m->ep, m->ep_rank, E_all);
    m->n_experts_here = E_all / m->ep;
    m->expert_lo = m->ep_rank * m->n_experts_here;
    m->cp = o->cp > 1 ? o->cp : 1;
    m->cp_rank = m->cp > 1 ? o->cp_rank : 0;
    m->doc_mask = o->doc_masking, m->doc_reset = o->doc_reset, m->doc_eot = o->doc_eot;
    m->recompute_every = o->recompute_every > 0 ? o->recompute_every : 1;
    m->loss_chunk = o->loss_chunk;
    m->vocab_lo = m->tp_rank * m->shape.padded_vocab;
    m->be = be;
    m->gelu_fusion = 1; /* precision.gelu_fusion auto */
    m->act_bytes = be->act_bytes();
    m->fp8 = o->fp8;
    if (o->master_bf16 && (m->act_bytes != 2 || !be->adamw_update_p16))
        kiln_fail(KILN_EXIT_USAGE, "key 'precision.master': bf16 needs bf16 activations (device: cuda with "
                  "precision.compute: bf16), but the %s backend computes in %s; use precision.master: fp32",
                  be->name, m->act_bytes == 2 ? "bf16 without a bf16 parameter update" : "fp32");
    if (o->master_bf16 && s->mlp == MLP_MOE && s->moe.bias_update_rate > 0)
        kiln_fail(KILN_EXIT_USAGE, "key 'model.moe.bias_update_rate': the balancing bias is kept in fp32 "
                  "parameters, which precision.master: bf16 does not have; use precision.master: fp32");
    m->master_bf16 = o->master_bf16;
    int L = s->n_layer, E = s->mlp == MLP_MOE ? s->moe.n_experts : 0;
    if (o->chunks > MODEL_MAX_CHUNKS)
        kiln_fail(KILN_EXIT_USAGE, "model: %d pipeline chunks, at most %d", o->chunks, MODEL_MAX_CHUNKS);
    m->n_chunks = o->chunks > 1 ? o->chunks : 1;
    for (int c = 0; c < m->n_chunks; c++) {
        m->chunk_lo[c] = o->chunks > 1 ? o->chunk_lo[c] : o->layer_lo;
        m->chunk_hi[c] = o->chunks > 1 ? o->chunk_hi[c] : o->layer_hi ? o->layer_hi : L;
        if (m->chunk_lo[c] < (c ? m->chunk_hi[c - 1] : 0) || m->chunk_lo[c] >= m->chunk_hi[c] || m->chunk_hi[c] > L)
            kiln_fail(KILN_EXIT_USAGE, "model: layer range [%d, %d) is not a non-empty part of the %d layers%s",
                      m->chunk_lo[c], m->chunk_hi[c], L, c ? " after the chunk before it" : "");
    }
    m->layer_lo = m->chunk_lo[0], m->layer_hi = m->chunk_hi[0];
    m->has_embed = m->layer_lo == 0, m->has_head = m->layer_hi == L;
    int all, gall;
    ArchTensor *t = arch_tensors(s, o->decay_embeddings, &all), *keep = t;
    ArchTensor *gt = arch_tensors(&m->gshape, o->decay_embeddings, &gall), *gkeep = gt; /* same rows, global shapes */
    int n = 0;
    for (int i = 0; i < all; i++) {
        int in = 0, mine = t[i].expert < 0 || (t[i].expert >= m->expert_lo && t[i].expert < m->expert_lo + m->n_experts_here);
        for (int c = 0; c < m->n_chunks; c++) in = in || arch_tensor_in_stage(s, &t[i], m->chunk_lo[c], m->chunk_hi[c]);
        if (in && mine) keep[n] = t[i], gkeep[n++] = gt[i]; /* in place */
    }
    m->num_tensors = n;
    m->params = xcalloc((size_t)n, sizeof(ParamInfo));
    size_t nslot = (size_t)(L + 1) * ROLE_LAYER_COUNT + (size_t)L * E * ROLE_EXPERT_COUNT;
    m->slot = xmalloc(nslot * sizeof(int));
    for (size_t k = 0; k < nslot; k++) m->slot[k] = -1;
    for (int i = 0; i < n; i++) {
        ParamInfo *p = &m->params[i];
        snprintf(p->name, sizeof p->name, "%s", t[i].name);
        p->ndim = t[i].ndim;
        p->shape[0] = t[i].shape[0], p->shape[1] = t[i].shape[1];
        p->numel = t[i].numel;
        p->decay = t[i].decay;
        p->layer = t[i].layer, p->role = t[i].role, p->expert = t[i].expert;
        p->init = t[i].init, p->follows = t[i].follows, p->trained = t[i].trained;
        p->gshape[0] = gt[i].shape[0], p->gshape[1] = gt[i].shape[1];
        p->split = m->tp > 1 ? arch_tp_split(s, p->role) : (ArchTpSplit){-1, 1};
        int norm = p->role == ROLE_ATTN_NORM_W || p->role == ROLE_ATTN_NORM_B || p->role == ROLE_MLP_NORM_W ||
                   p->role == ROLE_MLP_NORM_B || p->role == ROLE_FINAL_NORM_W || p->role == ROLE_FINAL_NORM_B;
        p->tp_partial = m->tp > 1 && ((m->sp && norm) || p->role == ROLE_Q_NORM || p->role == ROLE_K_NORM);
        size_t k = p->role < ROLE_LAYER_COUNT
                       ? (size_t)(p->layer + 1) * ROLE_LAYER_COUNT + p->role
                       : (size_t)(L + 1) * ROLE_LAYER_COUNT + ((size_t)p->layer * E + p->expert) * ROLE_EXPERT_COUNT +
                             (p->role - ROLE_LAYER_COUNT);
        m->slot[k] = i;
    }
    free(t);
    free(gt);

    /* Arena placement: decayed tensors first, in listing order, then the
     * rest, so AdamW runs as two contiguous updates. Expert parallelism:
     * this rank's experts (all decayed) before the other decayed tensors,
     * one range whose gradients reduce over the EDP group. */
    size_t off = 0;
    if (m->ep > 1) {
        int prev = -1;
        for (int i = 0; i < n; i++) {
            if (m->params[i].expert < 0) continue;
            if (!m->params[i].decay)
                kiln_fail(KILN_EXIT_RUNTIME, "model: expert tensor '%s' is not weight-decayed; the expert-parallel "
                          "layout keeps experts in the decayed range", m->params[i].name);
            off = place(m, i, prev, off);
            prev = i;
        }
        m->expert_len = off;
    }
    for (int pass = 1; pass >= 0; pass--) {
        int prev = -1;
        for (int i = 0; i < n; i++) {
            if (m->params[i].decay != pass || (m->ep > 1 && m->params[i].expert >= 0)) continue;
            off = place(m, i, prev, off);
            prev = i;
        }
        if (pass == 1) m->num_decay = off;
    }
    m->num_params = off;
    m->arena_len = off;
    /* precision.master bf16: no fp32 arena; compute_reset allocates param16 */
    m->param_mem = o->master_bf16 ? NULL : be->alloc(off * sizeof(float));
    m->grad_mem = NULL; /* with the activations (grads_alloc): ddp_init may pad or relay the arena first */
    m->pview = xcalloc((size_t)n, sizeof(float *));
    m->gview = xcalloc((size_t)n, sizeof(float *));
    m->wview = xcalloc((size_t)n, sizeof(void *));
    if (!o->master_bf16) bind_views(m, m->param_mem, m->pview); /* else the p views stay NULL: nothing may read them */
    compute_reset(m);
    if (s->pos == POS_ROPE) rope_table(m);
    if (E) {
        m->moe.load = xcalloc((size_t)L * E, sizeof(int64_t));
    }
    model_fp8_check(m); /* names the tensors: after the table */
}

void model_set_hooks(Model *m, const ModelHooks *h) {
    if (h) m->hooks = *h;
    else memset(&m->hooks, 0, sizeof m->hooks);
}

void model_set_tp(Model *m, const ModelTp *t) {
    if (t) m->tpc = *t;
    else memset(&m->tpc, 0, sizeof m->tpc);
}

void model_set_ep(Model *m, const ModelEp *e) {
    if (e) m->epc = *e;
    else memset(&m->epc, 0, sizeof m->epc);
}

/* The gradient arena (arena_len floats), once, as the first activations are
 * planned: allocated in model_init it would sit beside ZeRO-1's padded copy
 * of the parameters and ZeRO-2/3's relaid ones (ddp_init, in between), a
 * start-up peak of twice the arenas above the run's steady state. ZeRO-2/3
 * bind their own gradient buffers (model_bind_unit). */
static void grads_alloc(Model *m) {
    if (m->grad_mem || m->unit_off) return;
    m->grad_mem = m->be->alloc(m->arena_len * sizeof(float));
    bind_views(m, m->grad_mem, m->gview);
}

/* Arena `a` (len floats) as a new one of n, its first len floats copied at
 * 0 and the rest from `split` moved up to n - (len - split); the old one is
 * freed before the next arena is copied, so start-up holds one extra. */
static float *arena_regrow(const Backend *be, float *a, size_t len, size_t n, size_t split) {
    float *b = be->alloc(n * sizeof(float));
    be->copy(b, a, split * sizeof(float));
    be->copy(b + (n - (len - split)), a + split, (len - split) * sizeof(float));
    be->free(a);
    return b;
}

void model_pad_experts(Model *m, size_t n) {
    if (m->ep <= 1 || n <= m->expert_len) return;
    need_master(m, "ZeRO's expert blocks");
    const Backend *be = m->be;
    size_t d = n - m->expert_len, len = m->arena_len + d, x = m->expert_len;
    m->param_mem = arena_regrow(be, m->param_mem, m->arena_len, len, x);
    if (m->grad_mem) m->grad_mem = arena_regrow(be, m->grad_mem, m->arena_len, len, x);
    for (int i = 0; i < m->num_tensors; i++)
        if (m->params[i].expert < 0) m->params[i].offset += d;
    m->arena_len = len, m->num_params += d, m->num_decay += d, m->expert_len = n;
    bind_views(m, m->param_mem, m->pview);
    if (m->grad_mem) bind_views(m, m->grad_mem, m->gview);
    compute_reset(m);
}

void model_set_cp(Model *m, const ModelCp *c) {
    if (c) m->cpc = *c;
    else memset(&m->cpc, 0, sizeof m->cpc);
}

int model_tp_boxes(const Model *m, int i, ModelBox box[MODEL_MAX_BOXES]) {
    const ParamInfo *p = &m->params[i];
    size_t g0 = (size_t)p->gshape[0], g1 = p->ndim == 2 ? (size_t)p->gshape[1] : 1;
    size_t l0 = (size_t)p->shape[0], l1 = p->ndim == 2 ? (size_t)p->shape[1] : 1, r = (size_t)m->tp_rank;
    if (p->split.dim < 0) {
        box[0] = (ModelBox){0, g0, 0, g1, 0};
        return 1;
    }
    if (p->split.dim == 1) {
        box[0] = (ModelBox){0, g0, r * l1, (r + 1) * l1, 0};
        return 1;
    }
    /* rows: each of the parts holds lp local rows, from global row k gp + r lp */
    size_t parts = (size_t)p->split.parts, lp = l0 / parts, gp = g0 / parts;
    int n = 0;
    for (size_t k = 0; k < parts; k++) {
        size_t r0 = k * gp + r * lp, r1 = r0 + lp;
        if (parts == 1 && r1 > g0) r1 = g0; /* the vocabulary's padding rows past the logical tensor */
        if (r0 >= r1) continue;
        box[n++] = (ModelBox){r0, r1, 0, g1, k * lp * l1};
    }
    return n;
}

static void slots_free(Model *m);

void model_free(Model *m) {
    if (m->be) {
        m->be->free(m->param_mem);
        m->be->free(m->grad_mem);
        if (m->act_mem) m->be->free(m->act_mem);
        cbuf_free_all(m);
        model_fp8_free(m);
    }
    free(m->params);
    free(m->pview);
    free(m->gview);
    free(m->wview);
    free(m->slot);
    free(m->moe.load);
    free(m->stats_host);
    free(m->auxg_host);
    free(m->counts_host);
    free(m->seq_host);
    free(m->chunk_host);
    free(m->caps_host);
    if (m->be && m->rope) m->be->free(m->rope);
    free(m->cbuf);
    free(m->unit_cbuf);
    free(m->unit_stale);
    free(m->row_host);
    free(m->tok_host);
    free(m->tgt_host);
    free(m->pad_host);
    free(m->cp_tok);
    free(m->cp_tgt);
    free(m->doc_full);
    slots_free(m);
    free(m->losses_host);
    free(m->unit_off);
    free(m->unit_len);
    memset(m, 0, sizeof *m);
}

void model_pad_arenas(Model *m, size_t n) {
    if (n <= m->arena_len) return;
    need_master(m, "ZeRO's equal blocks");
    const Backend *be = m->be;
    m->param_mem = arena_regrow(be, m->param_mem, m->arena_len, n, m->arena_len);
    if (m->grad_mem) m->grad_mem = arena_regrow(be, m->grad_mem, m->arena_len, n, m->arena_len);
    m->arena_len = n;
    bind_views(m, m->param_mem, m->pview);
    if (m->grad_mem) bind_views(m, m->grad_mem, m->gview);
    compute_reset(m);
}

void model_params_from_host(Model *m, const float *host) {
    if (m->master_bf16) {
        uint16_t *h16 = xmalloc(m->num_params * sizeof(uint16_t));
        backend_f32_to_act(h16, host, m->num_params, 2); /* nearest even */
        m->be->to_device(m->param16, h16, m->num_params * sizeof(uint16_t));
        free(h16);
    } else {
        m->be->to_device(m->param_mem, host, m->num_params * sizeof(float));
    }
    model_params_changed(m);
}

void model_params_to_host(const Model *m, float *host) {
    if (m->master_bf16) {
        uint16_t *h16 = xmalloc(m->num_params * sizeof(uint16_t));
        m->be->to_host(h16, m->param16, m->num_params * sizeof(uint16_t));
        backend_act_to_f32(host, h16, m->num_params, 2); /* exact */
        free(h16);
    } else {
        m->be->to_host(host, m->param_mem, m->num_params * sizeof(float));
    }
}

void *model_param_arena(const Model *m) { return m->master_bf16 ? (void *)m->param16 : (void *)m->param_mem; }

void *model_compute_copy(const Model *m) {
    if (m->act_bytes == sizeof(float) || m->master_bf16 || m->unit_cbuf || m->n_cbuf != 1) return NULL;
    return m->cbuf[0].master == m->param_mem ? m->cbuf[0].mem : NULL;
}

void model_set_loss_sink(Model *m, double *sink) { m->loss_sink = sink; }

static size_t zmax(size_t a, size_t b) { return a > b ? a : b; }

/* The active set's fields, to and from its ModelSlot. */
static void slot_save(Model *m, ModelSlot *sl) {
    sl->acts = m->acts, sl->encoded = m->encoded, sl->stage_dout = m->stage_dout, sl->stage_din = m->stage_din;
    sl->lnf = m->lnf, sl->logits = m->logits, sl->lnf_mean = m->lnf_mean, sl->lnf_rstd = m->lnf_rstd;
    sl->losses = m->losses, sl->aux = m->aux, sl->tokens_dev = m->tokens_dev, sl->targets_dev = m->targets_dev;
    sl->tokens_host = m->tokens_host;
    sl->doc_dev = m->doc_dev, sl->doc_host = m->doc_host;
    sl->live_B = m->live_B, sl->live_T = m->live_T, sl->live_sp = m->live_sp, sl->have_targets = m->have_targets;
    sl->weight_pending = m->weight_pending, sl->live_dloss = m->live_dloss;
}

static void slot_load(Model *m, const ModelSlot *sl) {
    m->acts = sl->acts, m->encoded = sl->encoded, m->stage_dout = sl->stage_dout, m->stage_din = sl->stage_din;
    m->lnf = sl->lnf, m->logits = sl->logits, m->lnf_mean = sl->lnf_mean, m->lnf_rstd = sl->lnf_rstd;
    m->losses = sl->losses, m->aux = sl->aux, m->tokens_dev = sl->tokens_dev, m->targets_dev = sl->targets_dev;
    m->tokens_host = sl->tokens_host;
    m->doc_dev = sl->doc_dev, m->doc_host = sl->doc_host;
    m->live_B = sl->live_B, m->live_T = sl->live_T, m->live_sp = sl->live_sp, m->have_targets = sl->have_targets;
    m->weight_pending = sl->weight_pending, m->live_dloss = sl->live_dloss;
    m->layer_lo = m->chunk_lo[sl->chunk], m->layer_hi = m->chunk_hi[sl->chunk];
    m->has_embed = m->layer_lo == 0, m->has_head = m->layer_hi == m->shape.n_layer;
}

static void slots_free(Model *m) {
    if (!m->slots) return;
    slot_save(m, &m->slots[m->cur_slot]);
    for (int i = 0; i < m->n_slots; i++) {
        ModelSlot *sl = &m->slots[i];
        for (int l = 0; sl->acts && l < m->shape.n_layer; l++) free(sl->acts[l].offsets_host);
        free(sl->acts);
        if (m->be) m->be->free(sl->tokens_dev), m->be->free(sl->targets_dev);
        if (m->be && sl->doc_dev) m->be->free(sl->doc_dev);
        free(sl->doc_host), free(sl->tokens_host);
    }
    free(m->slots);
    m->slots = NULL, m->n_slots = m->cur_slot = 0;
    slot_load(m, &(ModelSlot){0});
}

void model_plan_activations(Model *m, int B, int T, ModelRecompute r) { model_plan_slots(m, B, T, r, NULL, 0); }

void model_plan_slots(Model *m, int B, int T, ModelRecompute r, const int *slots, int split) {
    if (T > m->shape.seq_len)
        kiln_fail(KILN_EXIT_USAGE, "micro-batch length %d exceeds model.seq_len = %d", T, m->shape.seq_len);
    if (T % (2 * m->cp))
        kiln_fail(KILN_EXIT_USAGE, "keys 'model.seq_len', 'parallel.cp': a sequence of %d tokens does not split into "
                  "2 x cp = %d chunks; make seq_len a multiple of %d", T, 2 * m->cp, 2 * m->cp);
    int Tl = T / m->cp; /* the rows of each sequence this rank holds */
    grads_alloc(m);
    if (m->act_mem) {
        m->be->free(m->act_mem);
        slots_free(m);
        free(m->losses_host);
        free(m->row_host);
        free(m->cp_tok);
        free(m->cp_tgt);
    }
    m->B = B;
    m->T = T;
    m->recompute = r;
    m->split_backward = split;
    ActPlan pl = {.chunks = m->n_chunks, .split = split, .every = m->recompute_every, .loss_chunk = m->loss_chunk};
    m->n_slots = 0;
    for (int c = 0; c < m->n_chunks; c++) {
        pl.lo[c] = m->chunk_lo[c], pl.hi[c] = m->chunk_hi[c], pl.slots[c] = slots && slots[c] > 0 ? slots[c] : 1;
        m->chunk_slot0[c] = m->n_slots, m->chunk_slots[c] = pl.slots[c];
        m->n_slots += pl.slots[c];
    }
    m->slots = xcalloc((size_t)m->n_slots, sizeof(ModelSlot));
    size_t N = (size_t)B * Tl;
    for (int c = 0; c < m->n_chunks; c++)
        for (int k = 0; k < pl.slots[c]; k++) {
            ModelSlot *sl = &m->slots[m->chunk_slot0[c] + k];
            sl->chunk = c;
            sl->acts = xcalloc((size_t)m->shape.n_layer, sizeof(LayerActs));
            sl->tokens_dev = m->be->alloc(N * sizeof(int32_t));
            sl->tokens_host = xcalloc(N, sizeof(int32_t));
            sl->targets_dev = m->be->alloc(N * sizeof(int32_t));
            if (m->doc_mask || m->doc_reset) {
                sl->doc_dev = m->be->alloc(N * sizeof(int32_t));
                sl->doc_host = xcalloc(N, sizeof(int32_t));
            }
            if (m->shape.mlp == MLP_MOE)
                for (int l = pl.lo[c]; l < pl.hi[c]; l++)
                    sl->acts[l].offsets_host = xcalloc((size_t)m->shape.moe.n_experts + 1, sizeof(int32_t));
        }
    m->act_size = model_plan_bytes(&m->shape, B, Tl, m->act_bytes, r, &pl, m->tp, m->cp, m->sp, m->ep, NULL);
    m->act_mem = m->be->alloc(m->act_size);
    model_plan_bytes(&m->shape, B, Tl, m->act_bytes, r, &pl, m->tp, m->cp, m->sp, m->ep, m);
    m->cur_slot = 0;
    slot_load(m, &m->slots[0]);
    if (m->shape.mlp == MLP_MOE) {
        size_t E = (size_t)m->shape.moe.n_experts;
        size_t RG = (size_t)B * (m->cp > 1 ? 2 : 1); /* routing groups (moe_group_rows) */
        m->stats_host = xrealloc(m->stats_host, RG * (E + 1) * sizeof(float));
        m->auxg_host = xrealloc(m->auxg_host, RG * E * sizeof(float));
        m->counts_host = xrealloc(m->counts_host, RG * E * sizeof(int32_t));
        m->seq_host = xrealloc(m->seq_host, (size_t)B * (2 * E + 1) * sizeof(double));
        if (m->cp > 1) {
            m->chunk_host = xrealloc(m->chunk_host, (size_t)2 * m->cp * B * E * sizeof(double));
            m->caps_host = xrealloc(m->caps_host, RG * E * sizeof(int32_t));
        }
    }
    m->losses_host = xcalloc(N, sizeof(float));
    model_fp8_plan(m, (int)N);
    m->row_host = xcalloc((size_t)m->tp * m->shape.padded_vocab, m->act_bytes);
    if (m->tp > 1) {
        m->pad_host = xrealloc(m->pad_host, (size_t)T * sizeof(int32_t));
        m->tok_host = xrealloc(m->tok_host, N * sizeof(int32_t));
        m->tgt_host = xrealloc(m->tgt_host, N * sizeof(int32_t));
    }
    m->cp_tok = m->cp > 1 ? xcalloc((size_t)B * Tl, sizeof(int32_t)) : NULL;
    m->cp_tgt = m->cp > 1 ? xcalloc((size_t)B * Tl, sizeof(int32_t)) : NULL;
    if (m->doc_mask || m->doc_reset) m->doc_full = xrealloc(m->doc_full, (size_t)B * T * sizeof(int32_t));
}

/* Set k of chunk c; exits 1 naming both when there is none. */
static int slot_index(const Model *m, int chunk, int k) {
    if (!m->slots || chunk < 0 || chunk >= m->n_chunks || k < 0 || k >= m->chunk_slots[chunk])
        kiln_fail(KILN_EXIT_RUNTIME, "model: no activation slot %d of chunk %d (%d chunk(s) planned)", k, chunk,
                  m->n_chunks);
    return m->chunk_slot0[chunk] + k;
}

void model_use_slot(Model *m, int chunk, int k) {
    int i = slot_index(m, chunk, k);
    if (i == m->cur_slot) return;
    slot_save(m, &m->slots[m->cur_slot]);
    m->cur_slot = i;
    slot_load(m, &m->slots[i]);
}

/* Set (chunk, k) as it is now: the active one's fields live in the Model. */
static ModelSlot slot_view(const Model *m, int chunk, int k) {
    int i = slot_index(m, chunk, k);
    ModelSlot sl = m->slots[i];
    if (i == m->cur_slot) slot_save((Model *)m, &sl);
    return sl;
}

void *model_slot_input(const Model *m, int chunk, int k) { return slot_view(m, chunk, k).encoded; }
const void *model_slot_output(const Model *m, int chunk, int k) {
    return slot_view(m, chunk, k).acts[m->chunk_hi[chunk] - 1].res3;
}
void *model_slot_output_grad(const Model *m, int chunk, int k) { return slot_view(m, chunk, k).stage_dout; }
const void *model_slot_input_grad(const Model *m, int chunk, int k) { return slot_view(m, chunk, k).stage_din; }

int model_stage_rows(const Model *m, int B, int T) {
    if (m->cp > 1) T = 2 * ((T + 2 * m->cp - 1) / (2 * m->cp)); /* this rank's rows of each sequence */
    int N = B * T;
    /* sequence parallelism: model_forward pads one sequence to a multiple of tp */
    if (m->sp && m->cp == 1 && N % m->tp) N = (N + m->tp - 1) / m->tp * m->tp;
    return m->sp && N % m->tp == 0 ? N / m->tp : N;
}

void *model_stage_input(const Model *m) { return m->encoded; }
const void *model_stage_output(const Model *m) { return m->acts[m->layer_hi - 1].res3; }
void *model_stage_output_grad(const Model *m) { return m->stage_dout; }
const void *model_stage_input_grad(const Model *m) { return m->stage_din ? m->stage_din : m->scratch; }

int model_gelu_fused(const Model *m, int backward) {
    if (!m->gelu_fusion || m->shape.mlp != MLP_GELU || m->fp8.mode) return 0; /* fp8: quantised operands */
    return backward ? m->be->matmul_backward_dgelu != NULL : m->be->matmul_gelu_forward != NULL;
}

/* ---------------------------------------------------------------------------
 * The block graph. Row counts: N = B*T tokens; widths from the spec. */

static AttnShape attn_shape(const ArchSpec *s, int B, int T) {
    return (AttnShape){B, T, s->n_head, s->n_kv_head, s->head_dim, NULL};
}

/* Bytes offset of `rows` rows of `width` act elements. */
static void *act_at(const Model *m, const void *base, size_t rows, size_t width) {
    return (char *)base + rows * width * m->act_bytes;
}

/* Where a forward's product outputs go until the residual add: the
 * scratch, or while a backward recomputes a layer (whose scratch then holds
 * the backward's gradients) BLOCK's own buffer. */
static void *fwd_proj(const Model *m) { return m->recomputing ? m->rec_proj : m->scratch; }

/* Rows of the residual stream, x, or x = a + b not yet added: a block
 * leaves its residual add to the norm that reads x next, so a backend that
 * fuses the two (residual_norm_forward) does both in one pass. */
typedef struct Resid {
    void *x;           /* (rows, C) act */
    const void *a, *b; /* b non-NULL: x = a + b is pending */
} Resid;

/* Rows that are there already (nothing pending: x is only read). */
static Resid resid_rows(const void *x) { return (Resid){.x = (void *)x}; }

/* out (N,C) = norm(x); a pending add is written first, by the same call
 * where the backend fuses them (the bits of the two ops either way). */
static void norm_forward(const Model *m, void *out, float *mean, float *rstd, Resid x, const void *w,
                         const void *b, int N) {
    const ArchSpec *s = &m->shape;
    const Backend *be = m->be;
    int ln = s->norm == NORM_LAYERNORM, C = s->n_embd;
    if (x.b && be->residual_norm_forward) {
        be->residual_norm_forward(x.x, out, ln ? mean : NULL, rstd, x.a, x.b, w, ln ? b : NULL, N, C, s->norm_eps);
        return;
    }
    if (x.b) be->residual_forward(x.x, x.a, x.b, (size_t)N * C);
    if (ln) be->layernorm_forward(out, mean, rstd, x.x, w, b, N, C, s->norm_eps);
    else be->rmsnorm_forward(out, rstd, x.x, w, N, C, s->norm_eps);
}

static void norm_backward(const Model *m, void *dx, float *dw, float *db, const void *dout, const void *x,
                          const void *w, const float *mean, const float *rstd, int N, int acc) {
    const ArchSpec *s = &m->shape;
    if (s->norm == NORM_LAYERNORM) m->be->layernorm_backward(dx, dw, db, dout, x, w, mean, rstd, N, s->n_embd, acc);
    else m->be->rmsnorm_backward(dx, dw, dout, x, w, rstd, N, s->n_embd, acc);
}

/* ---------------------------------------------------------------------------
 * Tensor parallelism (docs/parallel.md "Tensor parallelism"): the residual
 * stream holds all N rows on every tp rank, or under sequence parallelism
 * (live_sp) its own n = N/tp rows, from row tp_rank n. Column-parallel
 * products read all N rows of their input and give this rank's columns;
 * row-parallel products give partial sums of all N rows, reduced into the
 * residual's rows. With tp 1 every helper is the plain op. */

/* Rows of the residual stream held here, and where they start among the N. */
static int res_rows(const Model *m, int N) { return m->live_sp ? N / m->tp : N; }
static size_t res_first(const Model *m, int N) { return m->live_sp ? (size_t)m->tp_rank * (N / m->tp) : 0; }

/* out (N,C) = norm(x) of the residual rows x (a pending add written first):
 * under sequence parallelism each rank norms its rows in place in `out` and
 * the rows are gathered. */
static void norm_in(const Model *m, void *out, float *mean, float *rstd, Resid x, const void *w, const void *b,
                    int N) {
    size_t C = (size_t)m->shape.n_embd;
    int n = res_rows(m, N);
    norm_forward(m, act_at(m, out, res_first(m, N), C), mean, rstd, x, w, b, n);
    if (m->live_sp) m->tpc.all_gather(m->tpc.ctx, out, (size_t)n * C);
}

/* A row-parallel product's partial sums (N,C) at `partial` onto the
 * residual rows: summed over the tp ranks (a reduce-scatter into `spare`
 * (n,C) under sequence parallelism, else an all-reduce in place). Returns
 * where the reduced rows are. tp 1: partial itself. */
static const void *row_reduce(const Model *m, void *partial, void *spare, int N) {
    size_t C = (size_t)m->shape.n_embd;
    if (m->tp == 1) return partial;
    if (m->live_sp) {
        m->tpc.reduce_scatter(m->tpc.ctx, partial, spare, (size_t)res_rows(m, N) * C);
        return spare;
    }
    m->tpc.all_reduce(m->tpc.ctx, partial, (size_t)N * C);
    return partial;
}

/* A column-parallel product's input gradient: partial sums (N,C) over this
 * rank's columns, reduced as row_reduce does. */
#define col_grad_reduce row_reduce

/* The gradient of all N rows of the residual from this rank's rows d: under
 * sequence parallelism gathered into `full` (N,C); else d itself. */
static const void *grad_gather(const Model *m, const void *d, void *full, int N) {
    size_t C = (size_t)m->shape.n_embd;
    if (!m->live_sp) return d;
    int n = res_rows(m, N);
    m->be->copy(act_at(m, full, res_first(m, N), C), d, (size_t)n * C * m->act_bytes);
    m->tpc.all_gather(m->tpc.ctx, full, (size_t)n * C);
    return full;
}

/* Before a host read of a device buffer under tp (ModelTp.drain). */
static void tp_drain(const Model *m) {
    if (m->tpc.drain) m->tpc.drain(m->tpc.ctx);
}

/* Row-parallel products add their (replicated) bias once: on tp rank 0,
 * before the sum over the ranks. Its gradient, from the gradient of all N
 * rows, is complete on every rank. */
static const void *row_bias(const Model *m, int l, int role) { return m->tp_rank == 0 ? W(m, l, role) : NULL; }

/* ---------------------------------------------------------------------------
 * Context parallelism (model.h ModelCp): the rows are this rank's two chunks
 * of every sequence, chunk-major; what depends on positions runs per chunk. */

/* First position of local chunk c, for chunks of Tc tokens. */
static int cp_pos(const Model *m, int c, int Tc) { return model_cp_chunk(m->cp, m->cp_rank, c) * Tc; }

/* This rank's chunks of the (B, T) host ids into buf (B, 2 Tc) chunk-major;
 * positions past T (a generation's padding) read token 0. */
static const int32_t *cp_take(const Model *m, int32_t *buf, const int32_t *ids, int B, int T, int Tc) {
    for (int c = 0; c < 2; c++)
        for (int b = 0; b < B; b++)
            for (int i = 0; i < Tc; i++) {
                int t = cp_pos(m, c, Tc) + i;
                buf[((size_t)c * B + b) * Tc + i] = t < T ? ids[(size_t)b * T + t] : 0;
            }
    return buf;
}

/* ---------------------------------------------------------------------------
 * Documents (ModelOptions.doc_*, docs/data.md "Documents") */

void model_doc_starts(const int32_t *tokens, int B, int T, int eot, int32_t *doc) {
    for (int b = 0; b < B; b++) {
        int start = 0;
        for (int i = 0; i < T; i++) {
            doc[(size_t)b * T + i] = start;
            if (tokens[(size_t)b * T + i] == eot) start = i + 1;
        }
    }
}

/* The documents of this forward's rows: from the (B, T) host ids (whole
 * sequences) into doc_host, rows as tokens_dev (under cp this rank's chunks,
 * chunk-major, global positions; rows past T, a generation's padding, stay
 * in the last document), and on to doc_dev. */
static void doc_rows(Model *m, const int32_t *tokens, int B, int T, int Tl) {
    model_doc_starts(tokens, B, T, m->doc_eot, m->doc_full);
    if (m->cp == 1) {
        memcpy(m->doc_host, m->doc_full, (size_t)B * T * sizeof(int32_t));
    } else {
        int Tc = Tl / 2;
        for (int c = 0; c < 2; c++)
            for (int b = 0; b < B; b++)
                for (int i = 0; i < Tc; i++) {
                    int t = cp_pos(m, c, Tc) + i;
                    m->doc_host[((size_t)c * B + b) * Tc + i] = m->doc_full[(size_t)b * T + (t < T ? t : T - 1)];
                }
    }
    m->be->to_device(m->doc_dev, m->doc_host, (size_t)B * Tl * sizeof(int32_t));
}

/* Runs of rows in one document (documents with learned positions): within
 * each local chunk (cp: 2, else the whole sequence) of each sequence, the
 * rows [row, row + len) of tokens_dev whose positions are p0 .. p0 + len - 1
 * counted from their document's start. Fills the run at *it and moves *it
 * past it; 0 when the rows are done. */
typedef struct DocRun {
    size_t row;
    int len, p0;
} DocRun;
static int doc_next_run(const Model *m, int B, int T, int *it, DocRun *r) {
    /* *it walks the N rows; a run ends where the document changes or a
     * sequence (chunk) ends */
    int chunks = m->cp > 1 ? 2 : 1, Tc = T / chunks, N = B * T;
    if (*it >= N) return 0;
    int i0 = *it, seg = i0 / Tc, c = m->cp > 1 ? seg / B : 0, i = i0 % Tc;
    int g0 = (m->cp > 1 ? cp_pos(m, c, Tc) : 0) + i, d = m->doc_host[i0], i1 = i0 + 1;
    while (i1 < (seg + 1) * Tc && m->doc_host[i1] == d) i1++;
    *r = (DocRun){(size_t)i0, i1 - i0, g0 - d};
    *it = i1;
    return 1;
}

/* Embeddings of the N = B T rows (T local) into e: wte[tokens] + wpe at each
 * row's global position (wpe NULL: none, or another tp rank adds them);
 * with data.doc_positions reset at its position in its document, one run
 * of rows at a time. */
static void embed_rows(const Model *m, void *e, int B, int T) {
    const void *wte = W(m, -1, ROLE_TOK_EMB), *wpe = row_bias(m, -1, ROLE_POS_EMB);
    int C = m->shape.n_embd;
    if (wpe && m->doc_reset) {
        DocRun r;
        for (int it = 0; doc_next_run(m, B, T, &it, &r);)
            m->be->embed_forward(act_at(m, e, r.row, C), m->tokens_dev + r.row, wte, act_at(m, wpe, r.p0, C), 1,
                                 r.len, C);
        return;
    }
    if (m->cp == 1) {
        m->be->embed_forward(e, m->tokens_dev, wte, wpe, B, T, C);
        return;
    }
    int Tc = T / 2;
    for (int c = 0; c < 2; c++)
        m->be->embed_forward(act_at(m, e, (size_t)c * B * Tc, C), m->tokens_dev + (size_t)c * B * Tc, wte,
                             wpe ? act_at(m, wpe, cp_pos(m, c, Tc), C) : NULL, B, Tc, C);
}

/* Their backward from dtop (N,C): dwte +=, dwpe per `acc` (under cp only this
 * rank's positions get a gradient; the rest are zero until the sum over cp). */
static void embed_rows_backward(const Model *m, const void *dtop, int B, int T, int acc) {
    float *dwte = G(m, -1, ROLE_TOK_EMB), *dwpe = G(m, -1, ROLE_POS_EMB);
    int C = m->shape.n_embd;
    if (dwpe && m->doc_reset) {
        if (!acc) m->be->zero(dwpe, (size_t)m->shape.seq_len * C * sizeof(float));
        DocRun r;
        for (int it = 0; doc_next_run(m, B, T, &it, &r);)
            m->be->embed_backward(dwte, dwpe + (size_t)r.p0 * C, act_at(m, dtop, r.row, C), m->tokens_dev + r.row,
                                  m->tokens_host + r.row, 1, r.len, C, 1);
        return;
    }
    if (m->cp == 1) {
        m->be->embed_backward(dwte, dwpe, dtop, m->tokens_dev, m->tokens_host, B, T, C, acc);
        return;
    }
    int Tc = T / 2;
    if (dwpe && !acc) m->be->zero(dwpe, (size_t)m->shape.seq_len * C * sizeof(float));
    for (int c = 0; c < 2; c++)
        m->be->embed_backward(dwte, dwpe ? dwpe + (size_t)cp_pos(m, c, Tc) * C : NULL,
                              act_at(m, dtop, (size_t)c * B * Tc, C), m->tokens_dev + (size_t)c * B * Tc,
                              m->tokens_host + (size_t)c * B * Tc, B, Tc, C, 1);
}

/* RoPE on qkv (N, QKVW) at each row's global position, or its inverse;
 * with data.doc_positions reset at its position in its document (the op
 * subtracts doc, backend.h). */
static void rope_rows(const Model *m, void *qkv, const AttnShape *sh, int backward) {
    void (*op)(void *, const float *, const AttnShape *, int) = backward ? m->be->rope_backward : m->be->rope_forward;
    AttnShape c = *sh;
    c.doc = m->doc_reset ? m->doc_dev : NULL;
    if (m->cp == 1) {
        op(qkv, m->rope, &c, 0);
        return;
    }
    c.T = sh->T / 2;
    for (int k = 0; k < 2; k++) {
        AttnShape ck = c;
        if (c.doc) ck.doc = c.doc + (size_t)k * sh->B * c.T;
        op(act_at(m, qkv, (size_t)k * sh->B * c.T, (size_t)attn_qkv_width(sh)), m->rope, &ck, cp_pos(m, k, c.T));
    }
}

/* res2 = x + o_proj(attention(rope(qknorm(qkv_proj(norm1(x)))))), returned
 * pending for norm2 (x's own pending add is written by norm1) */
static Resid attn_forward(Model *m, int l, Resid x, int B, int T) {
    const Backend *be = m->be;
    const ArchSpec *s = &m->shape;
    LayerActs *a = &m->acts[l];
    int N = B * T, C = s->n_embd, Q = arch_q_width(s);
    AttnShape sh = attn_shape(s, B, T);
    sh.doc = m->doc_mask ? m->doc_dev : NULL; /* data.doc_masking */
    void *proj = fwd_proj(m); /* (N,C) lives only until the residual add consumes it */
    norm_in(m, a->ln1, a->ln1_mean, a->ln1_rstd, x, W(m, l, ROLE_ATTN_NORM_W), W(m, l, ROLE_ATTN_NORM_B), N);
    model_mm_forward(m, l, MM_QKV, -1, a->qkv, a->ln1, W(m, l, ROLE_QKV_W), W(m, l, ROLE_QKV_B), N, C, arch_qkv_width(s));
    if (s->qk_norm != QKNORM_NONE)
        be->qknorm_forward(a->qkv, a->qk_in, a->qk_rstd, W(m, l, ROLE_Q_NORM), W(m, l, ROLE_K_NORM), &sh,
                           s->qk_norm == QKNORM_HEAD, s->norm_eps);
    if (s->pos == POS_ROPE) rope_rows(m, a->qkv, &sh, 0);
    if (m->cp > 1) m->cpc.attention_forward(m->cpc.ctx, a->atty, a->att_lse, a->qkv, &sh);
    else be->attention_forward(a->atty, a->att_lse, a->qkv, &sh);
    model_mm_forward(m, l, MM_O, -1, proj, a->atty, W(m, l, ROLE_O_W), row_bias(m, l, ROLE_O_B), N, Q, C);
    const void *out = row_reduce(m, proj, act_at(m, proj, N, C), N);
    return (Resid){a->res2, x.x, out};
}

/* The dense MLP's activation from its first product: GeLU or SwiGLU. */
static void mlp_activation(const Model *m, const LayerActs *a, int N) {
    const ArchSpec *s = &m->shape;
    if (s->mlp == MLP_SWIGLU) m->be->swiglu_forward(a->fch_gelu, a->fch, N, s->ffn_hidden);
    else m->be->gelu_forward(a->fch_gelu, a->fch, (size_t)N * s->ffn_hidden);
}

/* The rows layer l's routed experts run on here: with expert parallelism
 * what the ep group sent (ModelEp.dispatch), else the layer's own. */
static void expert_rows(Model *m, int l, ModelExpertRows *r) {
    LayerActs *a = &m->acts[l];
    if (m->epc.dispatch) {
        m->epc.dispatch(m->epc.ctx, l, a->xp, a->offsets_host, r);
        return;
    }
    *r = (ModelExpertRows){.e0 = 0, .n = m->shape.moe.n_experts, .off = a->offsets_host, .x = a->xp, .h = a->hp,
                           .h_act = a->hp_act, .y = a->yp};
}

/* Routed experts on their rows: local expert j owns rows [off[j], off[j+1])
 * of r->x (a grouped product: one per expert); its gate and up weights
 * follow each other, so one product. */
static void experts_forward(Model *m, int l, const ModelExpertRows *r) {
    const Backend *be = m->be;
    const ArchSpec *s = &m->shape;
    int C = s->n_embd, Fe = s->moe.expert_hidden;
    const int32_t *off = r->off;
    for (int j = 0; j < r->n; j++) {
        int n = off[j + 1] - off[j];
        if (n > 0)
            model_mm_forward(m, l, MM_EXPERT_GATE, r->e0 + j, act_at(m, r->h, off[j], 2 * Fe),
                             act_at(m, r->x, off[j], C), WX(m, l, ROLE_EXPERT_GATE_W, r->e0 + j), NULL, n, C, 2 * Fe);
    }
    if (off[r->n] > 0) be->swiglu_forward(r->h_act, r->h, off[r->n], Fe);
    for (int j = 0; j < r->n; j++) {
        int n = off[j + 1] - off[j];
        if (n > 0)
            model_mm_forward(m, l, MM_EXPERT_DOWN, r->e0 + j, act_at(m, r->y, off[j], C),
                             act_at(m, r->h_act, off[j], Fe), WX(m, l, ROLE_EXPERT_DOWN_W, r->e0 + j), NULL, n, Fe, C);
    }
}

/* Rows of one routing group for B sequences of T local rows: the router's
 * statistics and loads are kept per group (backend.h: S). A group is a
 * sequence; under cp one of this rank's two chunks of one (ModelCp's
 * chunk-major rows: group g is local chunk g / B of sequence g % B), whose
 * figures are summed into the sequence's over the cp ranks (moe_forward;
 * a capacity's limits: moe_cp_caps). */
static int moe_group_rows(const Model *m, int T) { return m->cp > 1 ? T / 2 : T; }

/* Under cp with a capacity (cap per whole sequence): the limits of this
 * rank's chunks (groups of gr rows) in m->moe_caps, so that they keep the
 * slots one rank keeps of the whole sequence: each chunk, per expert, what
 * the capacity leaves after the sequence's earlier chunks, whichever rank
 * holds them. The chunks' loads (a dropless dispatch's counts) at their
 * global chunk index, summed over the cp ranks (an all-gather), give the
 * earlier chunks' loads. */
static void moe_cp_caps(Model *m, const LayerActs *a, int N, int gr, int cap) {
    const Backend *be = m->be;
    int E = m->shape.moe.n_experts, K = m->shape.moe.top_k, B = N / (2 * gr), cp = m->cp;
    be->moe_dispatch(a->offsets, a->row_of, a->src, a->counts, a->topk, N, gr, E, K, 0);
    tp_drain(m);
    be->to_host(m->counts_host, a->counts, (size_t)2 * B * E * sizeof(int32_t));
    m->moe.host_reads++;
    double *all = m->chunk_host; /* (2 cp, B, E): every chunk's loads, global chunk order */
    memset(all, 0, (size_t)2 * cp * B * E * sizeof(double));
    for (int c = 0; c < 2; c++) {
        int gc = model_cp_chunk(cp, m->cp_rank, c);
        for (size_t i = 0; i < (size_t)B * E; i++) all[(size_t)gc * B * E + i] = m->counts_host[(size_t)c * B * E + i];
    }
    m->cpc.sum_host(m->cpc.ctx, all, (size_t)2 * cp * B * E); /* exact: integers */
    for (int c = 0; c < 2; c++) {
        int gc = model_cp_chunk(cp, m->cp_rank, c);
        for (size_t i = 0; i < (size_t)B * E; i++) {
            double before = 0;
            for (int k = 0; k < gc; k++) before += all[(size_t)k * B * E + i];
            m->caps_host[(size_t)c * B * E + i] = before < cap ? cap - (int32_t)before : 0;
        }
    }
    be->to_device(m->moe_caps, m->caps_host, (size_t)2 * B * E * sizeof(int32_t));
}

/* res3 = res2 + sum_k gate * expert(x) (+ the shared experts), its last
 * add returned pending for the next norm; router statistics into the losses
 * and loads. */
static Resid moe_forward(Model *m, int l, int N, int T, float dloss, int train) {
    const Backend *be = m->be;
    const ArchSpec *s = &m->shape;
    const ArchMoe *mo = &s->moe;
    LayerActs *a = &m->acts[l];
    int C = s->n_embd, E = mo->n_experts, K = mo->top_k;
    void *proj = fwd_proj(m);
    int bi = model_tensor_index(m, l, ROLE_ROUTER_BIAS, -1);
    be->matmul_forward(a->router, a->ln2, W(m, l, ROLE_ROUTER_W), NULL, N, C, E);
    int gr = moe_group_rows(m, T), G = N / gr; /* G routing groups of gr rows */
    be->moe_route(a->topk, a->gates, a->probs, a->stats, a->router, bi < 0 ? NULL : m->pview[bi], N, gr, E, K,
                  mo->sigmoid, mo->norm_topk);
    /* per whole sequence: under cp of its real tokens (the padding of a
     * generation's context comes after them, so it never takes their slots) */
    int cap = arch_moe_capacity(s, m->cp > 1 ? m->cp_tokens : T);
    if (m->cp > 1 && cap > 0) { /* a chunk keeps what the sequence's earlier chunks leave */
        moe_cp_caps(m, a, N, gr, cap);
        be->moe_dispatch_capped(a->offsets, a->row_of, a->src, a->counts, a->topk, N, gr, E, K, m->moe_caps);
    } else {
        be->moe_dispatch(a->offsets, a->row_of, a->src, a->counts, a->topk, N, gr, E, K, cap);
    }
    /* The experts' row ranges decide the products' sizes: the one host
     * synchronisation of an MoE layer. */
    tp_drain(m);
    be->to_host(a->offsets_host, a->offsets, (size_t)(E + 1) * sizeof(int32_t));
    m->moe.host_reads++;
    be->moe_gather(a->xp, a->ln2, a->src, a->offsets_host[E], C);
    ModelExpertRows rows;
    expert_rows(m, l, &rows);
    experts_forward(m, l, &rows);
    if (m->epc.combine) m->epc.combine(m->epc.ctx, l, a->yp); /* the outputs back to their rows' ranks */
    /* Under tp every rank runs the whole layer on all N rows (experts are
     * replicated over tp) and adds its own residual rows. */
    size_t n = (size_t)res_rows(m, N) * C;
    const void *mine = act_at(m, proj, res_first(m, N), C);
    be->moe_combine(proj, a->yp, a->gates, a->row_of, N, K, C);
    Resid res3 = {a->res3, a->res2, mine};
    if (mo->n_shared > 0) { /* the shared experts' product reuses proj: the routed add is done first */
        be->residual_forward(a->res3, a->res2, mine, n);
        int S = mo->n_shared * mo->expert_hidden;
        model_mm_forward(m, l, MM_SHARED_GATE, -1, a->sh, a->ln2, W(m, l, ROLE_SHARED_GATE_W), NULL, N, C, 2 * S);
        be->swiglu_forward(a->sh_act, a->sh, N, S);
        model_mm_forward(m, l, MM_SHARED_DOWN, -1, proj, a->sh_act, W(m, l, ROLE_SHARED_DOWN_W), NULL, N, S, C);
        res3.a = a->res3;
    }
    /* Losses per sequence b of Tg tokens (T, or under cp the T cp of the
     * whole sequence), averaged over the B sequences: aux_b = E sum_e f_be
     * P_be (f = load / (Tg K), P = mean prob), z = mean lse^2; the aux
     * gradient per (group, expert) for the backward. Under cp each
     * sequence's loads and sums are its groups' summed over the cp ranks
     * first, so every rank has the figures of one rank's whole sequence. */
    int B = N / T, Tg = T * m->cp;
    be->to_host(m->counts_host, a->counts, (size_t)G * E * sizeof(int32_t));
    be->to_host(m->stats_host, a->stats, (size_t)G * (E + 1) * sizeof(float));
    m->moe.host_reads += 2;
    double *q = m->seq_host; /* (B, 2E+1): per sequence its loads (E), prob sums (E), lse^2 sum */
    memset(q, 0, (size_t)B * (2 * E + 1) * sizeof(double));
    int64_t routed = 0;
    for (int g = 0; g < G; g++) {
        const int32_t *cnt = m->counts_host + (size_t)g * E;
        const float *st = m->stats_host + (size_t)g * (E + 1);
        double *qb = q + (size_t)(g % B) * (2 * E + 1);
        for (int e = 0; e < E; e++) {
            qb[e] += cnt[e], qb[E + e] += st[e];
            routed += cnt[e];
            if (train) m->moe.load[(size_t)l * E + e] += cnt[e]; /* this rank's tokens: the caller sums the ranks */
        }
        qb[2 * E] += st[E];
    }
    if (m->cp > 1) m->cpc.sum_host(m->cpc.ctx, q, (size_t)B * (2 * E + 1));
    double aux = 0, z = 0;
    for (int b = 0; b < B; b++) {
        const double *qb = q + (size_t)b * (2 * E + 1);
        for (int e = 0; e < E; e++) {
            double f = qb[e] / ((double)Tg * K);
            aux += f * qb[E + e] / Tg;
            for (int g = b; g < G; g += B) m->auxg_host[(size_t)g * E + e] = (float)(mo->aux_loss_coef * E * f * dloss);
        }
        z += qb[2 * E];
    }
    if (!m->recomputing) { /* the figures of the forward, counted once */
        m->moe.aux += E * aux / B;
        m->moe.z += z / ((double)B * Tg);
    }
    if (train) {
        m->moe.routed += routed;
        m->moe.drops += routed - a->offsets_host[E];
    }
    be->to_device(m->aux + (size_t)l * G * E, m->auxg_host, (size_t)G * E * sizeof(float));
    return res3;
}

/* res3 = res2 + mlp(norm2(res2)): GeLU, SwiGLU or MoE; res2 comes pending
 * from attn_forward, res3 goes pending to the next norm. */
static Resid mlp_forward(Model *m, int l, Resid res2, int N, int T, int fuse, float dloss, int train) {
    const Backend *be = m->be;
    const ArchSpec *s = &m->shape;
    LayerActs *a = &m->acts[l];
    int C = s->n_embd, F = s->ffn_hidden;
    void *proj = fwd_proj(m);
    norm_in(m, a->ln2, a->ln2_mean, a->ln2_rstd, res2, W(m, l, ROLE_MLP_NORM_W), W(m, l, ROLE_MLP_NORM_B), N);
    if (s->mlp == MLP_MOE) return moe_forward(m, l, N, T, dloss, train);
    if (fuse) {
        be->matmul_gelu_forward(a->fch_gelu, a->fch, a->ln2, W(m, l, ROLE_FC_W), W(m, l, ROLE_FC_B), N, C, F);
    } else {
        model_mm_forward(m, l, MM_FC, -1, a->fch, a->ln2, W(m, l, ROLE_FC_W), W(m, l, ROLE_FC_B), N, C, arch_fc_width(s));
        mlp_activation(m, a, N);
    }
    model_mm_forward(m, l, MM_DOWN, -1, proj, a->fch_gelu, W(m, l, ROLE_DOWN_W), row_bias(m, l, ROLE_DOWN_B), N, F, C);
    const void *out = row_reduce(m, proj, act_at(m, proj, N, C), N);
    return (Resid){a->res3, a->res2, out};
}

/* The output head: tied to the token embedding, or its own weight. */
static int head_index(const Model *m) {
    return model_tensor_index(m, -1, m->shape.tie_embeddings ? ROLE_TOK_EMB : ROLE_HEAD_W, -1);
}

/* Token ids as rows of this rank's vocabulary slice, -1 for another rank's
 * (tp > 1; host scratch buf); the ids themselves with tp 1. */
static const int32_t *local_ids(const Model *m, int32_t *buf, const int32_t *ids, int N) {
    if (m->tp == 1) return ids;
    int lo = m->vocab_lo, rows = m->shape.padded_vocab;
    for (int i = 0; i < N; i++) buf[i] = ids[i] >= lo && ids[i] < lo + rows ? ids[i] - lo : -1;
    return buf;
}

/* The rows of one chunk of the head for a forward of N rows: N when the head
 * runs whole (model.loss_chunk 0, or a chunk of at least N rows). */
static size_t head_chunk_rows(const Model *m, int N) {
    return m->xent_rows && m->xent_rows < (size_t)N ? m->xent_rows : (size_t)N;
}

/* The head on rows [r0, r0 + n) of the final norm's output: logits (n,Vp) =
 * lnf @ head^T into the logits buffer (under tp this rank's vocabulary
 * columns), and with xent their losses (losses[r0..]); dloss != 0 turns the
 * logits into dlogits in place. Vocabulary-parallel, no rank holds a whole
 * row of logits: one all-gather of (max, sum of exponentials, target logit)
 * per row, per chunk. Each row's logits and loss depend on that row alone,
 * so a chunk's are the whole head's. */
static void head_rows(Model *m, size_t r0, int n, int xent, float dloss) {
    const ArchSpec *s = &m->shape;
    const Backend *be = m->be;
    int C = s->n_embd, V = s->vocab_size, Vp = s->padded_vocab;
    model_mm_forward(m, -1, MM_HEAD, -1, m->logits, act_at(m, m->lnf, r0, (size_t)C), m->wview[head_index(m)], NULL, n,
                     C, Vp);
    m->logits_r0 = (long)r0;
    if (!xent) return;
    const int32_t *tgt = m->targets_dev + r0;
    float *losses = m->losses + r0;
    if (m->tp == 1) {
        be->crossentropy_forward(m->logits, losses, tgt, n, V, Vp, dloss);
    } else {
        float *all = m->xent_stats, *mine = all + (size_t)m->tp_rank * n * 3;
        be->xent_partial(mine, m->logits, tgt, n, V, Vp);
        m->tpc.all_gather_f32(m->tpc.ctx, mine, all, (size_t)n * 3);
        be->xent_finish(m->logits, losses, all, m->tp, tgt, n, V, Vp, dloss);
    }
}

/* The head's backward on the forward's N rows: from the dlogits the whole
 * forward left (one chunk) or, chunked, each chunk's made again with the
 * forward's dloss; the input gradient dln (N,C) when dln, the weight's
 * accumulated (the first chunk per `accumulate`) when dw. */
static void head_backward(Model *m, void *dln, float *dw, int N, int accumulate) {
    const ArchSpec *s = &m->shape;
    int C = s->n_embd, head = head_index(m);
    size_t rows = head_chunk_rows(m, N);
    for (size_t r0 = 0; r0 < (size_t)N; r0 += rows) {
        int n = (int)(N - r0 < rows ? N - r0 : rows);
        if (rows < (size_t)N) head_rows(m, r0, n, 1, m->live_dloss);
        model_mm_backward(m, -1, MM_HEAD, -1, dln ? act_at(m, dln, r0, (size_t)C) : NULL, dw, NULL, m->logits,
                          act_at(m, m->lnf, r0, (size_t)C), m->wview[head], n, C, s->padded_vocab,
                          accumulate || r0 > 0);
    }
    if (rows < (size_t)N) tp_drain(m);
}

float model_forward(Model *m, const int32_t *tokens, const int32_t *targets, int B, int T, float dloss) {
    const Backend *be = m->be;
    const ArchSpec *s = &m->shape;
    if (B > m->B || T > m->T || B * T > m->B * m->T)
        kiln_fail(KILN_EXIT_RUNTIME, "model_forward: batch %dx%d exceeds the planned %dx%d", B, T, m->B, m->T);
    if (m->weight_pending)
        kiln_fail(KILN_EXIT_RUNTIME, "model_forward: this slot's weight part of its last backward has not run");
    if (m->tp > 1 && !m->tpc.all_reduce)
        kiln_fail(KILN_EXIT_RUNTIME, "model_forward: a tensor-parallel model without its collectives (model_set_tp)");
    if (m->ep > 1 && !m->epc.dispatch)
        kiln_fail(KILN_EXIT_RUNTIME, "model_forward: an expert-parallel model without its exchanges (model_set_ep)");
    const int32_t *seq_tokens = tokens; /* (B, T) whole sequences, for the documents */
    int seq_T = T;
    if (m->cp > 1) {
        /* from here on T is this rank's rows per sequence: its two chunks
         * of the sequence, padded at the end to 2 cp chunks (generation) */
        if (!m->cpc.attention_forward)
            kiln_fail(KILN_EXIT_RUNTIME, "model_forward: a context-parallel model without its hooks (model_set_cp)");
        if (targets && T % (2 * m->cp))
            kiln_fail(KILN_EXIT_USAGE, "model_forward: %d tokens do not split into 2 x cp = %d chunks", T, 2 * m->cp);
        m->cp_tokens = T; /* an MoE capacity is of the real tokens (generation pads) */
        int Tc = (T + 2 * m->cp - 1) / (2 * m->cp);
        tokens = cp_take(m, m->cp_tok, tokens, B, T, Tc);
        if (targets) targets = cp_take(m, m->cp_tgt, targets, B, T, Tc);
        T = 2 * Tc;
    }
    int N = B * T, C = s->n_embd;
    if (m->sp && m->cp == 1 && N % m->tp != 0) {
        /* Sequence parallelism needs rows that split evenly. One sequence
         * without targets (generation) is padded with its last token to a
         * multiple of tp: attention is causal, so the padding changes no
         * real position's logits (seq_len divides by tp: it fits). */
        int Tp = (T + m->tp - 1) / m->tp * m->tp;
        if (B != 1 || targets || dloss != 0.0f || Tp > m->T)
            kiln_fail(KILN_EXIT_RUNTIME, "model_forward: %d x %d tokens do not split over the %d tp ranks (sequence "
                      "parallelism pads only one sequence without targets)", B, T, m->tp);
        memcpy(m->pad_host, tokens, (size_t)T * sizeof(int32_t));
        for (int t = T; t < Tp; t++) m->pad_host[t] = tokens[T - 1];
        return model_forward(m, m->pad_host, NULL, 1, Tp, 0.0f);
    }
    /* under cp a rank's rows that do not split over tp (generation) run
     * with every tp rank holding them all: the same function */
    m->live_sp = m->sp && N % m->tp == 0;
    if ((size_t)(m->live_sp ? N / m->tp : N) > m->res_rows)
        kiln_fail(KILN_EXIT_RUNTIME, "model_forward: %d x %d tokens exceed the residual stream's %zu rows", B, T,
                  m->res_rows);
    memcpy(m->tokens_host, local_ids(m, m->tok_host, tokens, N), (size_t)N * sizeof(int32_t));
    be->to_device(m->tokens_dev, m->tokens_host, (size_t)N * sizeof(int32_t));
    if (m->doc_mask || m->doc_reset) doc_rows(m, seq_tokens, B, seq_T, T);
    int fuse_fwd = model_gelu_fused(m, 0);
    int train = dloss != 0.0f && (targets || !m->has_head);
    m->moe.aux = m->moe.z = 0;

    use_layer(m, -1, 0);
    if (m->has_embed) {
        /* vocabulary-parallel: each rank embeds its own tokens (others read
         * zero rows), rank 0 adds the positions, and the sum goes to the
         * residual rows */
        void *e = m->live_sp ? m->scratch : m->encoded;
        embed_rows(m, e, B, T);
        const void *enc = row_reduce(m, e, m->encoded, N);
        if (enc != m->encoded) be->copy(m->encoded, enc, (size_t)N * C * m->act_bytes);
    }
    /* (N,C) residual stream entering layer l (its rows under sequence
     * parallelism); after the first layer, the add that makes it is pending:
     * the layer's first norm (or the final one) writes it. Nothing touches
     * the scratch holding its second term until then. */
    Resid x = resid_rows(m->encoded);
    for (int l = m->layer_lo; l < m->layer_hi; l++) {
        use_layer(m, l, 0);
        Resid res2 = attn_forward(m, l, x, B, T);
        x = mlp_forward(m, l, res2, N, T, fuse_fwd, dloss, train);
    }
    if (train && s->mlp == MLP_MOE) m->moe.aux_sum += m->moe.aux, m->moe.z_sum += m->moe.z;
    m->live_B = B;
    m->live_T = T;
    m->live_dloss = dloss;
    if (!m->has_head) { /* the output stays in the last layer's res3 for the next stage */
        if (x.b) be->residual_forward(x.x, x.a, x.b, (size_t)res_rows(m, N) * C);
        m->have_targets = dloss != 0.0f;
        return 0.0f;
    }
    norm_in(m, m->lnf, m->lnf_mean, m->lnf_rstd, x, W(m, -1, ROLE_FINAL_NORM_W), W(m, -1, ROLE_FINAL_NORM_B), N);
    m->live_B = B;
    m->live_T = T;
    m->have_targets = 0;
    if (targets) be->to_device(m->targets_dev, local_ids(m, m->tgt_host, targets, N), (size_t)N * sizeof(int32_t));
    size_t rows = head_chunk_rows(m, N);
    if (rows == (size_t)N) {
        head_rows(m, 0, N, targets != NULL, dloss); /* the whole logits; dlogits in place for the backward */
    } else {
        /* chunked loss: each chunk's logits live only for its own loss; the
         * backward makes them again (head_rows). Without targets
         * (generation) model_logits_row computes the chunk it reads. */
        m->logits_r0 = -1;
        for (size_t r0 = 0; targets && r0 < (size_t)N; r0 += rows)
            head_rows(m, r0, (int)(N - r0 < rows ? N - r0 : rows), 1, 0.0f);
    }
    if (!targets) return 0.0f;
    tp_drain(m);
    if (m->loss_sink && dloss != 0.0f) { /* stays on the device: no host wait */
        be->loss_acc(m->loss_sink, m->losses, N);
        m->have_targets = 1;
        return 0.0f;
    }
    be->to_host(m->losses_host, m->losses, (size_t)N * sizeof(float));
    double sum = 0.0;
    for (int i = 0; i < N; i++) sum += m->losses_host[i];
    m->have_targets = dloss != 0.0f;
    return (float)(sum / N);
}

/* Backward scratch, carved from m->scratch after the forward is done with it. */
typedef struct BackScratch {
    void *dres, *dbuf, *dbuf2, *dqkv, *dln;  /* (N,C) (N,wide) (N,wider) (N,QKVW) (N,C) act */
    void *dfull;                             /* tp > 1: (N,C) act, a gathered or reduced gradient */
    void *dyp, *dxp, *dhp, *dhp_act, *dlogits; /* MoE: (R,C) (R,C) (R,2Fe) (R,Fe) (N,E) act */
    float *dgates;                           /* (N,K) fp32 */
} BackScratch;

static BackScratch back_scratch(const Model *m, int N) {
    const ArchSpec *s = &m->shape;
    size_t C = (size_t)s->n_embd, Q = (size_t)arch_q_width(s), FF = (size_t)s->ffn_hidden;
    int moe = s->mlp == MLP_MOE;
    size_t S = moe ? (size_t)s->moe.n_shared * s->moe.expert_hidden : 0;
    size_t wide = zmax(zmax(Q, FF), zmax(S, C)), wider = zmax((size_t)arch_fc_width(s), 2 * S);
    BackScratch b = {0};
    b.dres = m->scratch;
    b.dbuf = act_at(m, b.dres, N, C);
    b.dbuf2 = act_at(m, b.dbuf, N, wide);
    b.dqkv = act_at(m, b.dbuf2, N, wider);
    b.dln = act_at(m, b.dqkv, N, (size_t)arch_qkv_width(s));
    void *end = act_at(m, b.dln, N, C);
    if (m->tp > 1) {
        b.dfull = end;
        end = act_at(m, b.dfull, N, C);
    }
    if (moe) {
        size_t R = (size_t)N * s->moe.top_k, Fe = (size_t)s->moe.expert_hidden;
        b.dyp = end;
        b.dxp = act_at(m, b.dyp, R, C);
        b.dhp = act_at(m, b.dxp, R, C);
        b.dhp_act = act_at(m, b.dhp, R, 2 * Fe);
        b.dlogits = act_at(m, b.dhp_act, R, Fe);
        /* fp32 after act data: round the byte offset up to 4 */
        uintptr_t p = (uintptr_t)act_at(m, b.dlogits, N, (size_t)s->moe.n_experts);
        b.dgates = (float *)((p + 3) / 4 * 4);
    }
    return b;
}

/* An expert with no rows this micro-batch: its gradients are zero (written
 * when this backward overwrites rather than adds). e: global expert. */
static void expert_zero_grads(const Model *m, int l, int e, int acc) {
    if (acc) return;
    const ArchSpec *s = &m->shape;
    size_t w = (size_t)s->moe.expert_hidden * s->n_embd * sizeof(float);
    m->be->zero(GX(m, l, ROLE_EXPERT_GATE_W, e), 2 * w); /* gate and up follow each other */
    m->be->zero(GX(m, l, ROLE_EXPERT_DOWN_W, e), w);
}

/* dln (N,C) = gradient of the MoE layer's input (the normed res2) from
 * dtop = d(res3) of all N rows; parameter gradients per acc. */
static void moe_backward(Model *m, int l, int N, const void *dtop, const BackScratch *b, int acc) {
    const Backend *be = m->be;
    const ArchSpec *s = &m->shape;
    const ArchMoe *mo = &s->moe;
    const LayerActs *a = &m->acts[l];
    int C = s->n_embd, E = mo->n_experts, K = mo->top_k, Fe = mo->expert_hidden;
    /* SELECTIVE: the SwiGLU outputs and the permuted rows again, by the
     * forward's ops on its kept products and (recomputed) norm2 output */
    int rec = model_recomputes_experts(m->recompute);
    if (mo->n_shared > 0) {
        int S = mo->n_shared * Fe;
        if (rec) be->swiglu_forward(a->sh_act, a->sh, N, S);
        model_mm_backward(m, l, MM_SHARED_DOWN, -1, b->dbuf, G(m, l, ROLE_SHARED_DOWN_W), NULL, dtop, a->sh_act,
                            W(m, l, ROLE_SHARED_DOWN_W), N, S, C, acc);
        be->swiglu_backward(b->dbuf2, b->dbuf, a->sh, N, S);
        model_mm_backward(m, l, MM_SHARED_GATE, -1, b->dln, G(m, l, ROLE_SHARED_GATE_W), NULL, b->dbuf2, a->ln2, W(m, l, ROLE_SHARED_GATE_W),
                            N, C, 2 * S, acc);
    } else {
        be->zero(b->dln, (size_t)N * C * m->act_bytes);
    }
    be->moe_combine_backward(b->dyp, b->dgates, dtop, a->yp, a->gates, a->row_of, N, K, C);
    /* the experts' rows: here, or (expert parallelism) dyp's rows sent to
     * the experts' ranks and this rank's experts' rows received */
    ModelExpertRows r;
    if (m->epc.dispatch_grad) {
        m->epc.dispatch_grad(m->epc.ctx, l, b->dyp, &r);
    } else {
        r = (ModelExpertRows){.e0 = 0, .n = E, .off = a->offsets_host, .x = a->xp, .h = a->hp, .h_act = a->hp_act,
                              .y = a->yp, .dy = b->dyp, .dh_act = b->dhp_act, .dh = b->dhp, .dx = b->dxp};
        if (rec) be->moe_gather(a->xp, a->ln2, a->src, a->offsets_host[E], C);
    }
    const int32_t *off = r.off;
    if (rec && off[r.n] > 0) be->swiglu_forward(r.h_act, r.h, off[r.n], Fe);
    for (int j = 0; j < r.n; j++) {
        int n = off[j + 1] - off[j], e = r.e0 + j;
        if (n == 0) continue;
        model_mm_backward(m, l, MM_EXPERT_DOWN, e, act_at(m, r.dh_act, off[j], Fe), GX(m, l, ROLE_EXPERT_DOWN_W, e), NULL,
                            act_at(m, r.dy, off[j], C), act_at(m, r.h_act, off[j], Fe),
                            WX(m, l, ROLE_EXPERT_DOWN_W, e), n, Fe, C, acc);
    }
    if (off[r.n] > 0) be->swiglu_backward(r.dh, r.dh_act, r.h, off[r.n], Fe);
    for (int j = 0; j < r.n; j++) {
        int n = off[j + 1] - off[j], e = r.e0 + j;
        if (n == 0) {
            expert_zero_grads(m, l, e, acc);
            continue;
        }
        model_mm_backward(m, l, MM_EXPERT_GATE, e, act_at(m, r.dx, off[j], C), GX(m, l, ROLE_EXPERT_GATE_W, e), NULL,
                            act_at(m, r.dh, off[j], 2 * Fe), act_at(m, r.x, off[j], C),
                            WX(m, l, ROLE_EXPERT_GATE_W, e), n, C, 2 * Fe, acc);
    }
    if (m->epc.combine_grad) m->epc.combine_grad(m->epc.ctx, l, b->dxp); /* the inputs' gradient back */
    be->moe_gather_backward(b->dln, b->dxp, a->row_of, N, K, C);
    /* the router: its gates' gradient plus the aux and z losses' */
    be->moe_route_backward(b->dlogits, b->dgates, a->probs, a->topk, a->gates, a->router,
                           m->aux + (size_t)l * (N / moe_group_rows(m, m->live_T)) * E, mo->z_loss_coef * m->live_dloss * N,
                           N, moe_group_rows(m, m->live_T), E, K, mo->sigmoid, mo->norm_topk);
    be->matmul_backward(b->dbuf, G(m, l, ROLE_ROUTER_W), NULL, b->dlogits, a->ln2, W(m, l, ROLE_ROUTER_W), N, C, E,
                        acc);
    be->residual_forward(b->dln, b->dln, b->dbuf, (size_t)N * C);
    int bi = model_tensor_index(m, l, ROLE_ROUTER_BIAS, -1);
    if (bi >= 0 && !acc) be->zero(m->gview[bi], (size_t)E * sizeof(float)); /* steered, not trained */
}

/* Which part of a backward runs: the whole, or the input part of a split
 * one (the products' weight gradients left for model_backward_weight). */
typedef enum { PART_WHOLE, PART_INPUT } BackPart;

/* A product's weight (bias) gradient view, or NULL in the input part. */
static float *GW(const Model *m, int l, int role, BackPart part) { return part == PART_INPUT ? NULL : G(m, l, role); }

/* The input part keeps a product's output gradient (N rows of w act
 * elements) for the weight part. */
static void keep_grad(const Model *m, void *dst, const void *src, int N, size_t w, BackPart part) {
    if (part == PART_INPUT && dst != src) m->be->copy(dst, src, (size_t)N * w * m->act_bytes);
}

/* d(res2) += through the MLP, from dres = d(res3). */
static void mlp_backward(Model *m, int l, int N, const BackScratch *b, int acc, int fuse, int rec_act, int rec_norm,
                         BackPart part) {
    const Backend *be = m->be;
    const ArchSpec *s = &m->shape;
    const LayerActs *a = &m->acts[l];
    int C = s->n_embd, F = s->ffn_hidden;
    /* the input part reads neither the MLP activation nor norm2's output
     * (only the products' weight gradients do); MoE layers compute all of
     * their gradients in it */
    int input = part == PART_INPUT && s->mlp != MLP_MOE;
    rec_act = rec_act && !input, rec_norm = rec_norm && !input;
    /* Recomputation (model.recompute) comes after use_layer: the layer's
     * parameters are gathered and its compute copy is fresh. The shared
     * buffers get this layer's values again by the forward's own ops on its
     * saved inputs; the norm also rewrites its saved statistics, with the
     * same values. */
    if (rec_norm)
        norm_in(m, a->ln2, a->ln2_mean, a->ln2_rstd, resid_rows(a->res2), W(m, l, ROLE_MLP_NORM_W),
                W(m, l, ROLE_MLP_NORM_B), N);
    /* tp: the products read the gradient of all N rows */
    const void *dtop = grad_gather(m, b->dres, b->dfull, N);
    const void *dnorm; /* the gradient of this rank's rows of norm2's output */
    if (s->mlp == MLP_MOE) {
        /* replicated over tp: dln is the same whole gradient on every rank */
        moe_backward(m, l, N, dtop, b, acc);
        dnorm = act_at(m, b->dln, res_first(m, N), C);
    } else {
        /* down's dw reads the activation, recomputed here by its op even
         * when the forward made it in the fused product (so with fusion the
         * recomputed values may differ from the forward's in the last bit:
         * see model.h) */
        if (rec_act) mlp_activation(m, a, N);
        keep_grad(m, a->d_down, dtop, N, (size_t)C, part);
        if (fuse) {
            be->matmul_backward_dgelu(b->dbuf2, GW(m, l, ROLE_DOWN_W, part), GW(m, l, ROLE_DOWN_B, part), dtop,
                                      a->fch_gelu, W(m, l, ROLE_DOWN_W), a->fch, N, F, C, acc);
        } else {
            model_mm_backward(m, l, MM_DOWN, -1, b->dbuf, GW(m, l, ROLE_DOWN_W, part), GW(m, l, ROLE_DOWN_B, part), dtop, a->fch_gelu,
                                W(m, l, ROLE_DOWN_W), N, F, C, acc);
            if (s->mlp == MLP_SWIGLU) be->swiglu_backward(b->dbuf2, b->dbuf, a->fch, N, F);
            else be->gelu_backward(b->dbuf2, a->fch, b->dbuf, (size_t)N * F);
        }
        keep_grad(m, a->d_fc, b->dbuf2, N, (size_t)arch_fc_width(s), part); /* fch is read: after the GeLU's backward */
        model_mm_backward(m, l, MM_FC, -1, b->dln, GW(m, l, ROLE_FC_W, part), GW(m, l, ROLE_FC_B, part), b->dbuf2, a->ln2,
                            W(m, l, ROLE_FC_W), N, C, arch_fc_width(s), acc);
        dnorm = col_grad_reduce(m, b->dln, b->dfull, N);
    }
    norm_backward(m, b->dres, G(m, l, ROLE_MLP_NORM_W), G(m, l, ROLE_MLP_NORM_B), dnorm, a->res2,
                  W(m, l, ROLE_MLP_NORM_W), a->ln2_mean, a->ln2_rstd, res_rows(m, N), acc);
}

/* The key bias's exact gradient is zero: it adds q_i . b_k to every score of
 * query i, and softmax over the keys ignores a shift shared by a whole row
 * (learned positions, no qk norm: nothing transforms k after it). Its fp32
 * gradient is rounding noise in the order of the sums, which optimizers that
 * divide by a gradient's own size (AdamW, Lion, Adafactor) turn into lr-sized
 * steps that differ with the layout; Adafactor's per-tensor update clipping
 * spreads that into the q and v biases (issue 16). Keep the exact zero. */
static void key_bias_exact(const Model *m, int l) {
    const ArchSpec *s = &m->shape;
    if (s->pos != POS_LEARNED || s->qk_norm != QKNORM_NONE) return;
    size_t kv = (size_t)s->n_kv_head * s->head_dim; /* this tp rank's k width */
    float *qkv = G(m, l, ROLE_QKV_B), *k = G(m, l, ROLE_K_B); /* gpt2's [q | k | v] (local); llama's k_proj.bias */
    if (k) m->be->zero(k, kv * sizeof(float));
    else if (qkv && s->family == ARCH_GPT2) m->be->zero(qkv + arch_q_width(s), kv * sizeof(float));
}

/* d(x_in) += through attention, from dres = d(res2). */
static void attn_backward(Model *m, int l, const void *x_in, int B, int T, const BackScratch *b, int acc,
                          int rec_norm, BackPart part) {
    const Backend *be = m->be;
    const ArchSpec *s = &m->shape;
    const LayerActs *a = &m->acts[l];
    int N = B * T, C = s->n_embd, Q = arch_q_width(s);
    AttnShape sh = attn_shape(s, B, T);
    sh.doc = m->doc_mask ? m->doc_dev : NULL; /* data.doc_masking */
    rec_norm = rec_norm && part != PART_INPUT; /* norm1's output is read by qkv's weight gradient only */
    const void *dtop = grad_gather(m, b->dres, b->dfull, N); /* tp: all N rows */
    keep_grad(m, a->d_o, dtop, N, (size_t)C, part);
    model_mm_backward(m, l, MM_O, -1, b->dbuf, GW(m, l, ROLE_O_W, part), GW(m, l, ROLE_O_B, part), dtop, a->atty,
                        W(m, l, ROLE_O_W), N, Q, C, acc);
    if (m->cp > 1) m->cpc.attention_backward(m->cpc.ctx, b->dqkv, b->dbuf, a->qkv, a->atty, a->att_lse, &sh);
    else be->attention_backward(b->dqkv, b->dbuf, a->qkv, a->atty, a->att_lse, &sh);
    if (s->pos == POS_ROPE) rope_rows(m, b->dqkv, &sh, 1);
    if (s->qk_norm != QKNORM_NONE)
        be->qknorm_backward(b->dqkv, G(m, l, ROLE_Q_NORM), G(m, l, ROLE_K_NORM), a->qk_in, W(m, l, ROLE_Q_NORM),
                            W(m, l, ROLE_K_NORM), a->qk_rstd, &sh, s->qk_norm == QKNORM_HEAD, acc);
    if (rec_norm)
        norm_in(m, a->ln1, a->ln1_mean, a->ln1_rstd, resid_rows(x_in), W(m, l, ROLE_ATTN_NORM_W),
                W(m, l, ROLE_ATTN_NORM_B), N);
    keep_grad(m, a->d_qkv, b->dqkv, N, (size_t)arch_qkv_width(s), part); /* attention has read qkv */
    model_mm_backward(m, l, MM_QKV, -1, b->dln, GW(m, l, ROLE_QKV_W, part), GW(m, l, ROLE_QKV_B, part), b->dqkv, a->ln1,
                        W(m, l, ROLE_QKV_W), N, C, arch_qkv_width(s), acc);
    if (part != PART_INPUT) key_bias_exact(m, l);
    const void *dnorm = col_grad_reduce(m, b->dln, b->dfull, N);
    norm_backward(m, b->dres, G(m, l, ROLE_ATTN_NORM_W), G(m, l, ROLE_ATTN_NORM_B), dnorm, x_in,
                  W(m, l, ROLE_ATTN_NORM_W), a->ln1_mean, a->ln1_rstd, res_rows(m, N), acc);
}

/* BLOCK (model.recompute): checkpointed layer l's forward again, from its
 * kept input x_in, into the workspace its views point at, after use_layer
 * (ZeRO-3's gather of the layer for its backward serves the recomputation
 * too: no second gather). The forward's own ops on the same inputs and
 * weights, with its tp, cp and ep exchanges (every rank of a group
 * recomputes the same layer at the same point of the schedule); it counts
 * no MoE loads, drops or aux and z losses again, and fp8 casts take the
 * scales their forward took (model_fp8.c). attn_only: up to attention's
 * output projection (what an MoE layer's weight part reads). */
static void recompute_layer(Model *m, int l, const void *x_in, int attn_only) {
    int B = m->live_B, T = m->live_T;
    m->recomputing = 1;
    Resid res2 = attn_forward(m, l, resid_rows(x_in), B, T);
    if (!attn_only) (void)mlp_forward(m, l, res2, B * T, T, model_gelu_fused(m, 0), m->live_dloss, 0);
    m->recomputing = 0;
}

/* The whole backward, or its input part (see model_backward_input). */
static void backward_run(Model *m, int accumulate, BackPart part) {
    const Backend *be = m->be;
    const ArchSpec *s = &m->shape;
    if (!m->have_targets)
        kiln_fail(KILN_EXIT_RUNTIME, "model_backward: the last forward had dloss = 0 (or no targets with the head)");
    if (m->weight_pending)
        kiln_fail(KILN_EXIT_RUNTIME, "model_backward: this slot's weight part of its last backward has not run");
    if (part == PART_INPUT && !m->split_backward)
        kiln_fail(KILN_EXIT_RUNTIME, "model_backward_input: the activations were not planned for a split backward");
    int B = m->live_B, T = m->live_T, N = B * T;
    int C = s->n_embd, L = s->n_layer;
    BackScratch b = back_scratch(m, N);
    if (m->has_head) {
        /* head: logits now hold dlogits (N,Vp); the non-layer tensors are still
         * gathered (the hook holds them for the whole step), their compute copy fresh */
        int head = head_index(m);
        const void *x_last = m->acts[m->layer_hi - 1].res3;
        compute_refresh(m, L);
        /* the input part keeps dlogits where they are, in the slot's logits
         * (chunked: the weight part makes them again) */
        head_backward(m, b.dln, part == PART_INPUT ? NULL : m->gview[head], N, accumulate);
        const void *dnorm = col_grad_reduce(m, b.dln, b.dfull, N); /* tp: the head is column-parallel */
        be->zero(b.dres, (size_t)N * C * m->act_bytes);
        norm_backward(m, b.dres, G(m, -1, ROLE_FINAL_NORM_W), G(m, -1, ROLE_FINAL_NORM_B), dnorm, x_last,
                      W(m, -1, ROLE_FINAL_NORM_W), m->lnf_mean, m->lnf_rstd, res_rows(m, N), accumulate);
    } else {
        be->copy(b.dres, m->stage_dout, (size_t)N * C * m->act_bytes); /* from the next stage */
    }
    /* ZeRO-2/3: each backward writes fresh layer gradients; the caller adds them up */
    int acc_layer = accumulate && !m->layer_grads_fresh;
    int rec_act = model_recomputes_gelu(m->recompute) && s->mlp != MLP_MOE;
    int rec_nrm = model_recomputes_norm(m->recompute);
    int fuse_bwd = model_gelu_fused(m, 1);
    for (int l = m->layer_hi - 1; l >= m->layer_lo; l--) {
        use_layer(m, l, 1);
        const void *x_in = l > m->layer_lo ? m->acts[l - 1].res3 : m->encoded;
        if (model_layer_recomputed(m, l)) recompute_layer(m, l, x_in, 0);
        mlp_backward(m, l, N, &b, acc_layer, fuse_bwd, rec_act, rec_nrm, part);
        attn_backward(m, l, x_in, B, T, &b, acc_layer, rec_nrm, part);
        if (part == PART_INPUT) continue; /* the layer's gradients are complete after its weight part */
        if (m->tpc.grads_done) m->tpc.grads_done(m->tpc.ctx, l);
        if (m->hooks.grads_done) m->hooks.grads_done(m->hooks.ctx, l);
    }
    /* the token embedding's gradient always accumulates in embed_backward:
     * the tied head wrote it first, else it starts from zero here. Without
     * the embeddings, b.dres is the input's gradient (model_stage_input_grad). */
    if (m->has_embed) {
        float *dwte = G(m, -1, ROLE_TOK_EMB);
        if (!(s->tie_embeddings && m->has_head) && !accumulate)
            be->zero(dwte, (size_t)s->padded_vocab * C * sizeof(float));
        /* tp: every rank scatters the gradient of all N rows into its own
         * vocabulary rows; each computes the whole position gradient */
        const void *dtop = grad_gather(m, b.dres, b.dfull, N);
        embed_rows_backward(m, dtop, B, T, accumulate);
    } else if (m->stage_din) {
        /* the input's gradient, this rank's rows of it, for the previous stage */
        be->copy(m->stage_din, b.dres, (size_t)res_rows(m, N) * C * m->act_bytes);
    }
    m->have_targets = 0;
    if (part == PART_INPUT) {
        m->weight_pending = 1;
        return;
    }
    if (m->tpc.grads_done) m->tpc.grads_done(m->tpc.ctx, -1);
    if (m->hooks.grads_done) m->hooks.grads_done(m->hooks.ctx, -1);
}

void model_backward(Model *m, int accumulate) { backward_run(m, accumulate, PART_WHOLE); }

void model_backward_input(Model *m, int accumulate) { backward_run(m, accumulate, PART_INPUT); }

void model_backward_weight(Model *m, int accumulate) {
    const ArchSpec *s = &m->shape;
    if (!m->weight_pending)
        kiln_fail(KILN_EXIT_RUNTIME, "model_backward_weight: no input part of a backward ran on this slot before");
    int B = m->live_B, T = m->live_T, N = B * T;
    int C = s->n_embd, L = s->n_layer, F = s->ffn_hidden, Q = arch_q_width(s);
    if (m->has_head) { /* dlogits (N,Vp) are still in the slot's logits (chunked: made again) */
        compute_refresh(m, L);
        head_backward(m, NULL, m->gview[head_index(m)], N, accumulate);
    }
    int acc = accumulate && !m->layer_grads_fresh;
    int rec_act = model_recomputes_gelu(m->recompute) && s->mlp != MLP_MOE;
    int rec_nrm = model_recomputes_norm(m->recompute);
    for (int l = m->layer_hi - 1; l >= m->layer_lo; l--) {
        use_layer(m, l, 1);
        const LayerActs *a = &m->acts[l];
        const void *x_in = l > m->layer_lo ? m->acts[l - 1].res3 : m->encoded;
        /* BLOCK: the input part's recomputation was overwritten since; an
         * MoE layer's weight part is attention's products only */
        if (model_layer_recomputed(m, l)) recompute_layer(m, l, x_in, s->mlp == MLP_MOE);
        /* each product's weight gradient from its kept output gradient and
         * its input: recomputed by the forward's op where model.recompute
         * dropped it (norm2's, the MLP activation, norm1's) */
        if (s->mlp != MLP_MOE) {
            if (rec_nrm)
                norm_in(m, a->ln2, a->ln2_mean, a->ln2_rstd, resid_rows(a->res2), W(m, l, ROLE_MLP_NORM_W),
                        W(m, l, ROLE_MLP_NORM_B), N);
            if (rec_act) mlp_activation(m, a, N);
            model_mm_backward(m, l, MM_DOWN, -1, NULL, G(m, l, ROLE_DOWN_W), G(m, l, ROLE_DOWN_B), a->d_down, a->fch_gelu,
                                W(m, l, ROLE_DOWN_W), N, F, C, acc);
            model_mm_backward(m, l, MM_FC, -1, NULL, G(m, l, ROLE_FC_W), G(m, l, ROLE_FC_B), a->d_fc, a->ln2, W(m, l, ROLE_FC_W), N,
                                C, arch_fc_width(s), acc);
        }
        model_mm_backward(m, l, MM_O, -1, NULL, G(m, l, ROLE_O_W), G(m, l, ROLE_O_B), a->d_o, a->atty, W(m, l, ROLE_O_W), N, Q, C,
                            acc);
        if (rec_nrm)
            norm_in(m, a->ln1, a->ln1_mean, a->ln1_rstd, resid_rows(x_in), W(m, l, ROLE_ATTN_NORM_W), W(m, l, ROLE_ATTN_NORM_B),
                    N);
        model_mm_backward(m, l, MM_QKV, -1, NULL, G(m, l, ROLE_QKV_W), G(m, l, ROLE_QKV_B), a->d_qkv, a->ln1, W(m, l, ROLE_QKV_W),
                            N, C, arch_qkv_width(s), acc);
        key_bias_exact(m, l);
        if (m->tpc.grads_done) m->tpc.grads_done(m->tpc.ctx, l);
        if (m->hooks.grads_done) m->hooks.grads_done(m->hooks.ctx, l);
    }
    if (m->tpc.grads_done) m->tpc.grads_done(m->tpc.ctx, -1);
    if (m->hooks.grads_done) m->hooks.grads_done(m->hooks.ctx, -1);
    m->weight_pending = 0;
    (void)B;
}

void model_moe_reset(Model *m) {
    if (!m->moe.load) return;
    memset(m->moe.load, 0, (size_t)m->shape.n_layer * m->shape.moe.n_experts * sizeof(int64_t));
    m->moe.routed = m->moe.drops = 0;
    m->moe.aux_sum = m->moe.z_sum = 0;
    m->moe.host_reads = 0;
}

void model_moe_update_bias(Model *m, const int64_t *load) {
    const ArchSpec *s = &m->shape;
    if (s->mlp != MLP_MOE || s->moe.bias_update_rate <= 0) return;
    int E = s->moe.n_experts;
    float *bias = m->stats_host; /* (E) of its (B, E+1): free between steps */
    for (int l = 0; l < s->n_layer; l++) {
        int i = model_tensor_index(m, l, ROLE_ROUTER_BIAS, -1);
        if (i < 0) continue; /* config.c refuses the bias with ZeRO-2/3, whose shards would not see this */
        m->be->to_host(bias, m->pview[i], (size_t)E * sizeof(float));
        double mean = 0;
        for (int e = 0; e < E; e++) mean += (double)load[(size_t)l * E + e];
        mean /= E;
        for (int e = 0; e < E; e++) {
            double d = mean - (double)load[(size_t)l * E + e];
            bias[e] += s->moe.bias_update_rate * (float)((d > 0) - (d < 0));
        }
        m->be->to_device(m->pview[i], bias, (size_t)E * sizeof(float));
    }
    model_params_changed(m);
}

void model_logits_row(Model *m, int b, int t, float *out) {
    size_t row = (size_t)b * m->live_T + (size_t)t, Vp = (size_t)m->shape.padded_vocab;
    int root = 0; /* cp: the rank holding position t */
    if (m->cp > 1) {
        int Tc = m->live_T / 2, g = t / Tc, c = g >= m->cp;
        root = c ? 2 * m->cp - 1 - g : g;
        row = ((size_t)c * m->live_B + b) * Tc + (size_t)(t % Tc);
    }
    int N = m->live_B * m->live_T;
    size_t rows = head_chunk_rows(m, N);
    if (m->logits_r0 < 0 || row < (size_t)m->logits_r0 || row >= (size_t)m->logits_r0 + rows) {
        /* chunked loss: the chunk that holds the row (no collective: each
         * rank its own rows, under tp its own columns) */
        size_t r0 = row / rows * rows;
        head_rows(m, r0, (int)(N - r0 < rows ? N - r0 : rows), 0, 0.0f);
    }
    const char *src = (const char *)m->logits + (row - (size_t)m->logits_r0) * Vp * m->act_bytes;
    if (m->tp > 1) { /* every rank's columns, in rank order: the global vocabulary */
        m->be->copy((char *)m->row_dev + (size_t)m->tp_rank * Vp * m->act_bytes, src, Vp * m->act_bytes);
        m->tpc.all_gather(m->tpc.ctx, m->row_dev, Vp);
        src = m->row_dev;
    }
    size_t n = (size_t)m->gshape.padded_vocab;
    if (m->cp > 1) { /* the other cp ranks computed another chunk's rows: root's row to all */
        if (src != m->row_dev) m->be->copy(m->row_dev, src, n * m->act_bytes);
        m->cpc.broadcast(m->cpc.ctx, m->row_dev, n, root);
        src = m->row_dev;
    }
    tp_drain(m);
    m->be->to_host(m->row_host, src, n * m->act_bytes);
    backend_act_to_f32(out, m->row_host, n, m->act_bytes);
}

size_t model_num_params(const Model *m) {
    size_t n = 0;
    for (int i = 0; i < m->num_tensors; i++) n += m->params[i].numel;
    return n;
}

size_t model_num_nonembedding_params(const Model *m) {
    size_t n = model_num_params(m);
    for (int i = 0; i < m->num_tensors; i++)
        if (m->params[i].role == ROLE_TOK_EMB || m->params[i].role == ROLE_POS_EMB) n -= m->params[i].numel;
    return n;
}

const ParamInfo *model_find_param(const Model *m, const char *name) {
    for (int i = 0; i < m->num_tensors; i++)
        if (strcmp(m->params[i].name, name) == 0) return &m->params[i];
    return NULL;
}

/* llm.c's GPT-2 checkpoint: 256 int32 header, then each parameter kind
 * stacked over layers, in llm.c's order. */

void model_load_llmc(Model *m, const char *path) {
    const ArchSpec *s = &m->shape;
    if (!m->has_embed || !m->has_head)
        kiln_fail(KILN_EXIT_USAGE, "%s: an llm.c checkpoint loads into a whole model, not a pipeline stage", path);
    if (s->family != ARCH_GPT2 || s->norm != NORM_LAYERNORM || s->pos != POS_LEARNED || s->mlp != MLP_GELU ||
        !s->bias || !s->tie_embeddings || s->qk_norm != QKNORM_NONE || s->ffn_hidden != 4 * s->n_embd ||
        s->head_dim * s->n_head != s->n_embd)
        kiln_fail(KILN_EXIT_USAGE, "%s: an llm.c checkpoint is a GPT-2 (model.arch: gpt2 with its defaults); the "
                  "config's model differs (key 'init.from')", path);
    uint64_t fsize;
    int fd = kiln_open_read(path, 0, &fsize);
    FILE *f = fd >= 0 ? fdopen(fd, "rb") : NULL;
    if (!f) {
        kiln_fail_hint(KILN_EXIT_USAGE, "init.from names an llm.c GPT-2 checkpoint such as gpt2_124M.bin",
                       "%s: cannot open llm.c checkpoint (key 'init.from'): %s", path, kiln_strerror(errno));
    }
    int32_t h[256];
    if (fread(h, sizeof(int32_t), 256, f) != 256) {
        fclose(f);
        kiln_fail(KILN_EXIT_USAGE, "%s: truncated llm.c checkpoint header", path);
    }
    if (h[0] != 20240326) {
        fclose(f);
        kiln_fail(KILN_EXIT_USAGE, "%s: bad magic %d (an llm.c GPT-2 checkpoint has 20240326)", path, h[0]);
    }
    if (h[1] != 3) {
        fclose(f);
        kiln_fail(KILN_EXIT_USAGE, "%s: llm.c checkpoint version %d; only version 3 (fp32) is supported", path, h[1]);
    }
    int maxT = h[2], V = h[3], L = h[4], NH = h[5], C = h[6], Vp = h[7];
    const char *bad = NULL;
    int have = 0, want = 0;
    if (L != s->n_layer) bad = "model.n_layer", have = L, want = s->n_layer;
    else if (NH != s->n_head) bad = "model.n_head", have = NH, want = s->n_head;
    else if (C != s->n_embd) bad = "model.n_embd", have = C, want = s->n_embd;
    else if (V != s->vocab_size) bad = "model.vocab_size", have = V, want = s->vocab_size;
    else if (maxT < s->seq_len) bad = "model.seq_len", have = maxT, want = s->seq_len;
    else if (Vp < V || Vp > 1 << 30 || maxT > 1 << 24) bad = "padded_vocab", have = Vp, want = s->padded_vocab;
    if (bad) {
        fclose(f);
        kiln_fail(KILN_EXIT_USAGE, "%s: llm.c checkpoint has %s = %d but the config says %d", path, bad, have, want);
    }
    size_t Cz = (size_t)C, Lz = (size_t)L;
    /* llm.c order: wte, wpe, ln1w, ln1b, qkvw, qkvb, attprojw, attprojb, ln2w,
     * ln2b, fcw, fcb, fcprojw, fcprojb, lnfw, lnfb. */
    size_t per_layer_sizes[12] = {Cz, Cz, 3 * Cz * Cz, 3 * Cz, Cz * Cz, Cz, Cz, Cz, 4 * Cz * Cz, 4 * Cz, 4 * Cz * Cz, Cz};
    size_t total = (size_t)Vp * Cz + (size_t)maxT * Cz + 2 * Cz;
    for (int k = 0; k < 12; k++) total += Lz * per_layer_sizes[k];
    if (fsize != 1024 + total * sizeof(float)) {
        fclose(f);
        kiln_fail(KILN_EXIT_USAGE, "%s: file holds %llu bytes but its header implies %zu (truncated or not fp32)", path,
                  (unsigned long long)fsize, 1024 + total * sizeof(float));
    }
    fseek(f, 1024, SEEK_SET);
    float *src = xmalloc(total * sizeof(float));
    if (fread(src, sizeof(float), total, f) != total) {
        fclose(f);
        free(src);
        kiln_fail(KILN_EXIT_USAGE, "%s: read error", path);
    }
    fclose(f);
    float *host = xcalloc(m->num_params, sizeof(float));
    const float *p = src;
    const ParamInfo *P = m->params;
    memcpy(host + P[model_tensor_index(m, -1, ROLE_TOK_EMB, -1)].offset, p, (size_t)V * Cz * sizeof(float)); /* padded rows stay zero */
    p += (size_t)Vp * Cz;
    memcpy(host + P[model_tensor_index(m, -1, ROLE_POS_EMB, -1)].offset, p, (size_t)s->seq_len * Cz * sizeof(float));
    p += (size_t)maxT * Cz;
    static const int roles[12] = {ROLE_ATTN_NORM_W, ROLE_ATTN_NORM_B, ROLE_QKV_W,      ROLE_QKV_B,
                                  ROLE_O_W,         ROLE_O_B,         ROLE_MLP_NORM_W, ROLE_MLP_NORM_B,
                                  ROLE_FC_W,        ROLE_FC_B,        ROLE_DOWN_W,     ROLE_DOWN_B};
    for (int k = 0; k < 12; k++) {
        for (int l = 0; l < L; l++) {
            const ParamInfo *info = &P[model_tensor_index(m, l, roles[k], -1)];
            memcpy(host + info->offset, p, per_layer_sizes[k] * sizeof(float));
            p += per_layer_sizes[k];
        }
    }
    memcpy(host + P[model_tensor_index(m, -1, ROLE_FINAL_NORM_W, -1)].offset, p, Cz * sizeof(float));
    memcpy(host + P[model_tensor_index(m, -1, ROLE_FINAL_NORM_B, -1)].offset, p + Cz, Cz * sizeof(float));
    model_params_from_host(m, host);
    free(host);
    free(src);
}

