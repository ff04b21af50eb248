/* model: GPT-2's parameter table, initialisation, the parameters' compute
 * copy, the activation plan, and the forward/backward graph expressed as
 * backend ops. Must never do arithmetic on tensors itself (that is the
 * backend's: even the compute copy is a backend cast) nor know the optimizer
 * or data. */
#include "model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

void model_shape_resolve(ModelShape *s) {
    if (s->n_layer < 1 || s->n_head < 1 || s->n_embd < 1 || s->seq_len < 1 || s->vocab_size < 2)
        kiln_fail(KILN_EXIT_USAGE, "model: sizes must be positive (n_layer=%d n_head=%d n_embd=%d seq_len=%d vocab_size=%d)",
                  s->n_layer, s->n_head, s->n_embd, s->seq_len, s->vocab_size);
    if (s->n_embd % s->n_head != 0)
        kiln_fail(KILN_EXIT_USAGE, "key 'model.n_embd': %d is not divisible by model.n_head = %d", s->n_embd,
                  s->n_head);
    /* Padding the vocabulary to a multiple of 64 keeps the head's matrix
     * products on aligned, vector-friendly sizes (GPT-2: 50257 -> 50304). */
    s->padded_vocab = (s->vocab_size + 63) / 64 * 64;
}

/* One row of the parameter table, before placement in the arena. */
static void add_param(Model *m, int *count, const char *name, int d0, int d1, int decay) {
    ParamInfo *p = &m->params[(*count)++];
    snprintf(p->name, sizeof p->name, "%s", name);
    p->ndim = d1 > 0 ? 2 : 1;
    p->shape[0] = d0;
    p->shape[1] = d1 > 0 ? d1 : 0;
    p->numel = (size_t)d0 * (size_t)(d1 > 0 ? d1 : 1);
    p->decay = decay;
}

/* The view pointer of table entry `i` in `v`. */
static float **view_slot(const Model *m, ParamViews *v, int i) {
    int L = m->shape.n_layer;
    if (i == 0) return &v->wte;
    if (i == 1) return &v->wpe;
    if (i == 2 + 12 * L) return &v->lnfw;
    if (i == 3 + 12 * L) return &v->lnfb;
    LayerParams *lp = &v->layer[(i - 2) / 12];
    float **slots[12] = {&lp->ln1w,     &lp->ln1b, &lp->qkvw, &lp->qkvb, &lp->attprojw, &lp->attprojb,
                         &lp->ln2w,     &lp->ln2b, &lp->fcw,  &lp->fcb,  &lp->fcprojw,  &lp->fcprojb};
    return slots[(i - 2) % 12];
}

/* The same slot in the compute views. */
static const void **wview_slot(Model *m, int i) {
    int L = m->shape.n_layer;
    WeightViews *v = &m->w;
    if (i == 0) return &v->wte;
    if (i == 1) return &v->wpe;
    if (i == 2 + 12 * L) return &v->lnfw;
    if (i == 3 + 12 * L) return &v->lnfb;
    LayerWeights *lw = &v->layer[(i - 2) / 12];
    const void **slots[12] = {&lw->ln1w, &lw->ln1b, &lw->qkvw, &lw->qkvb, &lw->attprojw, &lw->attprojb,
                              &lw->ln2w, &lw->ln2b, &lw->fcw,  &lw->fcb,  &lw->fcprojw,  &lw->fcprojb};
    return slots[(i - 2) % 12];
}

/* Point the views of `v` into arena `base`, by table index. */
static void bind_views(const Model *m, float *base, ParamViews *v) {
    for (int i = 0; i < m->num_tensors; i++) *view_slot(m, v, i) = base + m->params[i].offset;
}

/* ---------------------------------------------------------------------------
 * The compute copy. act_bytes 4: its views are the fp32 views. act_bytes 2:
 * each distinct fp32 buffer the views point into (the arena; under ZeRO-3 the
 * gather buffers) has a compute buffer of the same layout, and a tensor's
 * compute view sits at the same element offset from its buffer's start. */

/* Compute buffer of unit u (u = n_layer: wte, wpe, ln_f); 0 when the arena
 * is not laid out by unit. */
static int unit_buf(const Model *m, int u) { return m->unit_cbuf ? m->unit_cbuf[u] : 0; }

/* Derive every compute view from the fp32 view of the same tensor. */
static void bind_compute(Model *m) {
    for (int i = 0; i < m->num_tensors; i++) {
        if (m->master_bf16) { /* no fp32 views: the bf16 parameters, by arena offset */
            *wview_slot(m, i) = m->param16 + m->params[i].offset;
            continue;
        }
        float *master = *view_slot(m, &m->p, i);
        if (m->act_bytes == sizeof(float)) {
            *wview_slot(m, i) = master;
            continue;
        }
        const ComputeBuf *cb = &m->cbuf[unit_buf(m, model_unit_of(m, i))];
        *wview_slot(m, i) = (const char *)cb->mem + (size_t)(master - cb->master) * m->act_bytes;
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
    if (!m->unit_stale[u]) return;
    int first = 0;
    while (model_unit_of(m, first) != u) first++;
    const float *base = *view_slot(m, &m->p, first) - (m->params[first].offset - m->unit_off[u]);
    m->be->cast_to_act((char *)cb->mem + (size_t)(base - cb->master) * m->act_bytes, base, m->unit_len[u]);
    m->unit_stale[u] = 0;
}

/* Before layer `layer`'s forward or backward (-1: the embeddings, wte, wpe
 * and ln_f): the ZeRO-2/3 hook gathers (or waits for) the layer's
 * parameters and says whether they changed; then the compute copy. */
static void use_layer(Model *m, int layer, int backward) {
    int u = layer < 0 ? m->shape.n_layer : layer;
    if (m->pre_hook && m->pre_hook(m->hook_ctx, layer, backward) && m->unit_stale) m->unit_stale[u] = 1;
    compute_refresh(m, u);
}

int model_unit_of(const Model *m, int i) {
    int L = m->shape.n_layer;
    return i >= 2 && i < 2 + 12 * L ? (i - 2) / 12 : L;
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
        for (int i = 0; i < m->num_tensors; i++) {
            if (model_unit_of(m, i) != u) continue;
            m->params[i].offset = off;
            off += (m->params[i].numel + 15) / 16 * 16;
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
    bind_views(m, m->param_mem, &m->p);
    m->unit_cbuf = xcalloc((size_t)m->n_units, sizeof(int));
    m->unit_stale = xcalloc((size_t)m->n_units, sizeof(int));
    compute_reset(m);
}

void model_bind_unit(Model *m, int u, float *pbuf, float *gbuf) {
    need_master(m, "ZeRO-2/3's layers");
    for (int i = 0; i < m->num_tensors; i++) {
        if (model_unit_of(m, i) != u) continue;
        size_t at = m->params[i].offset - m->unit_off[u];
        if (pbuf) *view_slot(m, &m->p, i) = pbuf + at;
        if (gbuf) *view_slot(m, &m->g, i) = gbuf + at;
    }
    if (pbuf) compute_bind_unit(m, u, pbuf); /* NULL: the parameters stay where they are */
}

void model_init(Model *m, const Backend *be, const ModelShape *s, int decay_embeddings) {
    model_init_dtype(m, be, s, decay_embeddings, 0);
}

void model_init_dtype(Model *m, const Backend *be, const ModelShape *s, int decay_embeddings, int master_bf16) {
    memset(m, 0, sizeof *m);
    m->shape = *s;
    m->be = be;
    m->gelu_fusion = 1; /* precision.gelu_fusion auto */
    m->act_bytes = be->act_bytes();
    if (master_bf16 && (m->act_bytes != 2 || !be->adamw_update_p16))
        kiln_fail(KILN_EXIT_USAGE, "key 'precision.master': bf16 needs bf16 activations (device: cuda with "
                  "precision.compute: bf16), but the %s backend computes in %s; use precision.master: fp32",
                  be->name, m->act_bytes == 2 ? "bf16 without a bf16 parameter update" : "fp32");
    m->master_bf16 = master_bf16;
    int L = s->n_layer, C = s->n_embd;
    m->num_tensors = 2 + 12 * L + 2;
    m->params = xcalloc((size_t)m->num_tensors, sizeof(ParamInfo));
    int n = 0;
    char name[48];
    add_param(m, &n, "wte", s->padded_vocab, C, decay_embeddings);
    add_param(m, &n, "wpe", s->seq_len, C, decay_embeddings);
    for (int l = 0; l < L; l++) {
#define P(suffix, d0, d1, decay)                                   \
    snprintf(name, sizeof name, "h.%d." suffix, l);                \
    add_param(m, &n, name, d0, d1, decay)
        P("ln_1.weight", C, 0, 0);
        P("ln_1.bias", C, 0, 0);
        P("attn.c_attn.weight", 3 * C, C, 1);
        P("attn.c_attn.bias", 3 * C, 0, 0);
        P("attn.c_proj.weight", C, C, 1);
        P("attn.c_proj.bias", C, 0, 0);
        P("ln_2.weight", C, 0, 0);
        P("ln_2.bias", C, 0, 0);
        P("mlp.c_fc.weight", 4 * C, C, 1);
        P("mlp.c_fc.bias", 4 * C, 0, 0);
        P("mlp.c_proj.weight", C, 4 * C, 1);
        P("mlp.c_proj.bias", C, 0, 0);
#undef P
    }
    add_param(m, &n, "ln_f.weight", C, 0, 0);
    add_param(m, &n, "ln_f.bias", C, 0, 0);

    /* Arena placement: decayed tensors first, in listing order, then the rest,
     * so AdamW runs as two contiguous updates. Offsets are multiples of 16
     * floats (64 bytes) so every tensor starts cache-line aligned. */
    size_t off = 0;
    for (int pass = 1; pass >= 0; pass--) {
        for (int i = 0; i < n; i++) {
            if (m->params[i].decay != pass) continue;
            m->params[i].offset = off;
            off += (m->params[i].numel + 15) / 16 * 16;
        }
        if (pass == 1) m->num_decay = off;
    }
    m->num_params = off;
    m->arena_len = off;
    /* precision.master bf16: no fp32 arena; compute_reset allocates param16 */
    m->param_mem = master_bf16 ? NULL : be->alloc(off * sizeof(float));
    m->grad_mem = be->alloc(off * sizeof(float));
    m->p.layer = xcalloc((size_t)L, sizeof(LayerParams));
    m->g.layer = xcalloc((size_t)L, sizeof(LayerParams));
    m->w.layer = xcalloc((size_t)L, sizeof(LayerWeights));
    if (!master_bf16) bind_views(m, m->param_mem, &m->p); /* else the p views stay NULL: nothing may read them */
    bind_views(m, m->grad_mem, &m->g);
    compute_reset(m);
}

void model_free(Model *m) {
    if (m->be) {
        m->be->free(m->param_mem);
        m->be->free(m->grad_mem);
        if (m->act_mem) m->be->free(m->act_mem);
        if (m->tokens_dev) m->be->free(m->tokens_dev);
        if (m->targets_dev) m->be->free(m->targets_dev);
        cbuf_free_all(m);
    }
    free(m->params);
    free(m->p.layer);
    free(m->g.layer);
    free(m->w.layer);
    free(m->cbuf);
    free(m->unit_cbuf);
    free(m->unit_stale);
    free(m->row_host);
    free(m->acts);
    free(m->losses_host);
    free(m->unit_off);
    free(m->unit_len);
    memset(m, 0, sizeof *m);
}

void model_pad_arenas(Model *m, size_t n) {
    if (n <= m->arena_len) return;
    need_master(m, "ZeRO's equal blocks");
    const Backend *be = m->be;
    float *p = be->alloc(n * sizeof(float)), *g = be->alloc(n * sizeof(float));
    be->copy(p, m->param_mem, m->arena_len * sizeof(float));
    be->copy(g, m->grad_mem, m->arena_len * sizeof(float));
    be->free(m->param_mem);
    be->free(m->grad_mem);
    m->param_mem = p, m->grad_mem = g, m->arena_len = n;
    bind_views(m, m->param_mem, &m->p);
    bind_views(m, m->grad_mem, &m->g);
    compute_reset(m);
}

static int ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

void model_init_weights(Model *m, uint64_t seed) {
    /* Drawn on the host in listing order from one stream, so the initial
     * weights depend only on the seed and the shape. */
    float *host = xcalloc(m->num_params, sizeof(float));
    Rng rng;
    rng_seed(&rng, seed);
    float resid_scale = 1.0f / sqrtf(2.0f * (float)m->shape.n_layer);
    for (int i = 0; i < m->num_tensors; i++) {
        const ParamInfo *p = &m->params[i];
        float *w = host + p->offset;
        if (ends_with(p->name, "ln_1.weight") || ends_with(p->name, "ln_2.weight") ||
            ends_with(p->name, "ln_f.weight")) {
            for (size_t j = 0; j < p->numel; j++) w[j] = 1.0f;
        } else if (p->ndim == 2) {
            float std = 0.02f;
            if (ends_with(p->name, "c_proj.weight")) std *= resid_scale;
            size_t rows = (size_t)p->shape[0];
            /* The padded rows of wte stay zero: no token maps to them. */
            if (strcmp(p->name, "wte") == 0) rows = (size_t)m->shape.vocab_size;
            for (size_t j = 0; j < rows * (size_t)p->shape[1]; j++) w[j] = std * rng_normal(&rng);
        }
        /* biases stay zero */
    }
    model_params_from_host(m, host);
    free(host);
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

static const char *const recompute_names[] = {"none", "gelu", "norm_gelu"};

ModelRecompute model_recompute_parse(const char *name) {
    for (int r = 0; r < 3; r++)
        if (strcmp(name, recompute_names[r]) == 0) return (ModelRecompute)r;
    kiln_fail(KILN_EXIT_USAGE, "key 'model.recompute': expected one of none, gelu, norm_gelu, got '%s'", name);
}

const char *model_recompute_name(ModelRecompute r) {
    return r >= MODEL_RECOMPUTE_NONE && r <= MODEL_RECOMPUTE_NORM_GELU ? recompute_names[r] : "?";
}

/* Activation plan: the bytes each buffer needs, in one arena; act tensors
 * of act_bytes each, statistics fp32, every buffer 64-byte aligned (so with
 * fp32 the layout is the same as when everything was fp32). Also used by
 * --dry-run through model_activation_bytes, so the two can never disagree.
 * What `r` recomputes gets one buffer that every layer's view points at,
 * after the layers (so NONE's layout is unchanged). */
static size_t plan_bytes(const ModelShape *s, int B, int T, size_t ab, ModelRecompute r, Model *m) {
    size_t N = (size_t)B * T, C = (size_t)s->n_embd, NH = (size_t)s->n_head, F = sizeof(float);
    size_t off = 0;
    /* Without a model, only count: views are written into a throwaway. */
    Model sink;
    LayerActs sink_layer;
    int assign = m != NULL;
    if (!m) {
        memset(&sink, 0, sizeof sink);
        m = &sink;
    }
    int keep_gelu = r < MODEL_RECOMPUTE_GELU, keep_norm = r < MODEL_RECOMPUTE_NORM_GELU;
#define TAKE(ptr, count, esize)                                 \
    do {                                                        \
        if (assign) (ptr) = (void *)((char *)m->act_mem + off); \
        off += ((size_t)(count) * (esize) + 63) / 64 * 64;      \
    } while (0)
    TAKE(m->encoded, N * C, ab);
    for (int l = 0; l < s->n_layer; l++) {
        LayerActs *a = assign ? &m->acts[l] : &sink_layer;
        if (keep_norm) TAKE(a->ln1, N * C, ab);
        TAKE(a->ln1_mean, N, F);
        TAKE(a->ln1_rstd, N, F);
        TAKE(a->qkv, N * 3 * C, ab);
        TAKE(a->atty, N * C, ab);
        TAKE(a->att_lse, N * NH, F);
        TAKE(a->res2, N * C, ab);
        if (keep_norm) TAKE(a->ln2, N * C, ab);
        TAKE(a->ln2_mean, N, F);
        TAKE(a->ln2_rstd, N, F);
        TAKE(a->fch, N * 4 * C, ab);
        if (keep_gelu) TAKE(a->fch_gelu, N * 4 * C, ab);
        TAKE(a->res3, N * C, ab);
    }
    void *gelu_shared = NULL, *ln_shared = NULL; /* (N,4C) (N,C) act */
    if (!keep_gelu) TAKE(gelu_shared, N * 4 * C, ab);
    if (!keep_norm) TAKE(ln_shared, N * C, ab);
    for (int l = 0; assign && l < s->n_layer; l++) {
        if (!keep_gelu) m->acts[l].fch_gelu = gelu_shared;
        if (!keep_norm) m->acts[l].ln1 = m->acts[l].ln2 = ln_shared;
    }
    TAKE(m->lnf, N * C, ab);
    TAKE(m->lnf_mean, N, F);
    TAKE(m->lnf_rstd, N, F);
    TAKE(m->logits, N * (size_t)s->padded_vocab, ab);
    TAKE(m->losses, N, F);
    /* forward: projection outputs (N,C); backward: dresidual (N,C), dbuf and
     * dbuf2 (N,4C) each, dqkv (N,3C), dln (N,C); all act */
    TAKE(m->scratch, N * C + 2 * N * 4 * C + N * 3 * C + N * C, ab);
#undef TAKE
    return off;
}

size_t model_activation_bytes(const ModelShape *s, int B, int T, size_t act_bytes, ModelRecompute r) {
    return plan_bytes(s, B, T, act_bytes, r, NULL);
}

void model_plan_activations(Model *m, int B, int T, ModelRecompute r) {
    if (T > m->shape.seq_len)
        kiln_fail(KILN_EXIT_USAGE, "micro-batch length %d exceeds model.seq_len = %d", T, m->shape.seq_len);
    if (m->act_mem) {
        m->be->free(m->act_mem);
        m->be->free(m->tokens_dev);
        m->be->free(m->targets_dev);
        free(m->acts);
        free(m->losses_host);
        free(m->row_host);
    }
    m->B = B;
    m->T = T;
    m->recompute = r;
    m->acts = xcalloc((size_t)m->shape.n_layer, sizeof(LayerActs));
    m->act_size = plan_bytes(&m->shape, B, T, m->act_bytes, r, NULL);
    m->act_mem = m->be->alloc(m->act_size);
    plan_bytes(&m->shape, B, T, m->act_bytes, r, m);
    m->tokens_dev = m->be->alloc((size_t)B * T * sizeof(int32_t));
    m->targets_dev = m->be->alloc((size_t)B * T * sizeof(int32_t));
    m->losses_host = xcalloc((size_t)B * T, sizeof(float));
    m->row_host = xcalloc((size_t)m->shape.padded_vocab, m->act_bytes);
}

int model_gelu_fused(const Model *m, int backward) {
    if (!m->gelu_fusion) return 0;
    return backward ? m->be->matmul_backward_dgelu != NULL : m->be->matmul_gelu_forward != NULL;
}

float model_forward(Model *m, const int32_t *tokens, const int32_t *targets, int B, int T, float dloss) {
    const Backend *be = m->be;
    const ModelShape *s = &m->shape;
    if (B > m->B || T > m->T || B * T > m->B * m->T)
        kiln_fail(KILN_EXIT_RUNTIME, "model_forward: batch %dx%d exceeds the planned %dx%d", B, T, m->B, m->T);
    int N = B * T, C = s->n_embd, NH = s->n_head, L = s->n_layer;
    be->to_device(m->tokens_dev, tokens, (size_t)N * sizeof(int32_t));
    int fuse_fwd = model_gelu_fused(m, 0);

    use_layer(m, -1, 0);
    be->embed_forward(m->encoded, m->tokens_dev, m->w.wte, m->w.wpe, B, T, C);
    const void *x = m->encoded; /* (N,C) residual stream entering layer l */
    for (int l = 0; l < L; l++) {
        use_layer(m, l, 0);
        const LayerWeights *w = &m->w.layer[l];
        LayerActs *a = &m->acts[l];
        /* The projections' outputs live in scratch only until the residual
         * add consumes them; the backward pass never needs them. */
        void *proj = m->scratch;
        be->layernorm_forward(a->ln1, a->ln1_mean, a->ln1_rstd, x, w->ln1w, w->ln1b, N, C, 1e-5f);
        be->matmul_forward(a->qkv, a->ln1, w->qkvw, w->qkvb, N, C, 3 * C);
        be->attention_forward(a->atty, a->att_lse, a->qkv, &(AttnShape){B, T, NH, NH, C / NH});
        be->matmul_forward(proj, a->atty, w->attprojw, w->attprojb, N, C, C);
        be->residual_forward(a->res2, x, proj, (size_t)N * C);
        be->layernorm_forward(a->ln2, a->ln2_mean, a->ln2_rstd, a->res2, w->ln2w, w->ln2b, N, C, 1e-5f);
        if (fuse_fwd) {
            be->matmul_gelu_forward(a->fch_gelu, a->fch, a->ln2, w->fcw, w->fcb, N, C, 4 * C);
        } else {
            be->matmul_forward(a->fch, a->ln2, w->fcw, w->fcb, N, C, 4 * C);
            be->gelu_forward(a->fch_gelu, a->fch, (size_t)N * 4 * C);
        }
        be->matmul_forward(proj, a->fch_gelu, w->fcprojw, w->fcprojb, N, 4 * C, C);
        be->residual_forward(a->res3, a->res2, proj, (size_t)N * C);
        x = a->res3;
    }
    be->layernorm_forward(m->lnf, m->lnf_mean, m->lnf_rstd, x, m->w.lnfw, m->w.lnfb, N, C, 1e-5f);
    /* tied head: logits (N,Vp) = lnf @ wte^T */
    be->matmul_forward(m->logits, m->lnf, m->w.wte, NULL, N, C, s->padded_vocab);

    m->live_B = B;
    m->live_T = T;
    m->have_targets = 0;
    if (!targets) return 0.0f;
    be->to_device(m->targets_dev, targets, (size_t)N * sizeof(int32_t));
    be->crossentropy_forward(m->logits, m->losses, m->targets_dev, N, s->vocab_size, s->padded_vocab, dloss);
    be->to_host(m->losses_host, m->losses, (size_t)N * sizeof(float));
    double sum = 0.0;
    for (int i = 0; i < N; i++) sum += m->losses_host[i];
    m->have_targets = dloss != 0.0f;
    return (float)(sum / N);
}

void model_backward(Model *m, int accumulate) {
    const Backend *be = m->be;
    const ModelShape *s = &m->shape;
    if (!m->have_targets)
        kiln_fail(KILN_EXIT_RUNTIME, "model_backward: the last forward had no targets or dloss = 0");
    int B = m->live_B, T = m->live_T, N = B * T;
    int C = s->n_embd, NH = s->n_head, L = s->n_layer;
    size_t NC = (size_t)N * C, ab = m->act_bytes;
    /* gradient buffers in scratch, act dtype */
    char *dresidual = m->scratch;           /* (N,C) gradient of the residual stream */
    char *dbuf = dresidual + NC * ab;       /* (N,4C) */
    char *dbuf2 = dbuf + 4 * NC * ab;       /* (N,4C) */
    char *dqkv = dbuf2 + 4 * NC * ab;       /* (N,3C) */
    char *dln = dqkv + 3 * NC * ab;         /* (N,C) gradient of a norm's output */
    const void *x_last = L > 0 ? m->acts[L - 1].res3 : m->encoded;

    /* head: logits now hold dlogits (N,Vp); wte and ln_f are still gathered
     * (the hook holds them for the whole step), their compute copy fresh */
    compute_refresh(m, L);
    be->matmul_backward(dln, m->g.wte, NULL, m->logits, m->lnf, m->w.wte, N, C, s->padded_vocab, accumulate);
    be->zero(dresidual, NC * ab);
    be->layernorm_backward(dresidual, m->g.lnfw, m->g.lnfb, dln, x_last, m->w.lnfw, m->lnf_mean, m->lnf_rstd,
                           N, C, accumulate);
    /* ZeRO-2/3: each backward writes fresh layer gradients; the caller adds them up */
    int acc_layer = accumulate && !m->layer_grads_fresh;
    int recompute_gelu = m->recompute >= MODEL_RECOMPUTE_GELU;
    int recompute_norm = m->recompute >= MODEL_RECOMPUTE_NORM_GELU;
    int fuse_bwd = model_gelu_fused(m, 1);
    for (int l = L - 1; l >= 0; l--) {
        use_layer(m, l, 1);
        const LayerWeights *w = &m->w.layer[l];
        const LayerParams *gw = &m->g.layer[l];
        const LayerActs *a = &m->acts[l];
        const void *x_in = l > 0 ? m->acts[l - 1].res3 : m->encoded;
        /* Recomputation (model.recompute) comes after use_layer: the layer's
         * parameters are gathered and its compute copy is fresh. The shared
         * buffers get this layer's values again by the forward's own ops on
         * its saved inputs; LayerNorm also rewrites its saved mean and rstd,
         * with the same values. */
        /* MLP: res3 = res2 + c_proj(gelu(c_fc(ln2(res2)))). c_proj's dw reads
         * the GeLU output, recomputed here by the GeLU op even when the forward
         * made it in the fused product (so with fusion the recomputed values
         * may differ from the forward's in the last bit: see model.h). */
        if (recompute_gelu) be->gelu_forward(a->fch_gelu, a->fch, (size_t)N * 4 * C);
        if (fuse_bwd) {
            be->matmul_backward_dgelu(dbuf2, gw->fcprojw, gw->fcprojb, dresidual, a->fch_gelu, w->fcprojw, a->fch,
                                      N, 4 * C, C, acc_layer);
        } else {
            be->matmul_backward(dbuf, gw->fcprojw, gw->fcprojb, dresidual, a->fch_gelu, w->fcprojw, N, 4 * C, C,
                                acc_layer);
            be->gelu_backward(dbuf2, a->fch, dbuf, (size_t)N * 4 * C);
        }
        if (recompute_norm)
            be->layernorm_forward(a->ln2, a->ln2_mean, a->ln2_rstd, a->res2, w->ln2w, w->ln2b, N, C, 1e-5f);
        be->matmul_backward(dln, gw->fcw, gw->fcb, dbuf2, a->ln2, w->fcw, N, C, 4 * C, acc_layer);
        be->layernorm_backward(dresidual, gw->ln2w, gw->ln2b, dln, a->res2, w->ln2w, a->ln2_mean, a->ln2_rstd, N,
                               C, acc_layer);
        /* attention: res2 = x_in + c_proj(attn(c_attn(ln1(x_in)))) */
        be->matmul_backward(dbuf, gw->attprojw, gw->attprojb, dresidual, a->atty, w->attprojw, N, C, C,
                            acc_layer);
        be->attention_backward(dqkv, dbuf, a->qkv, a->atty, a->att_lse, &(AttnShape){B, T, NH, NH, C / NH});
        if (recompute_norm)
            be->layernorm_forward(a->ln1, a->ln1_mean, a->ln1_rstd, x_in, w->ln1w, w->ln1b, N, C, 1e-5f);
        be->matmul_backward(dln, gw->qkvw, gw->qkvb, dqkv, a->ln1, w->qkvw, N, C, 3 * C, acc_layer);
        be->layernorm_backward(dresidual, gw->ln1w, gw->ln1b, dln, x_in, w->ln1w, a->ln1_mean, a->ln1_rstd, N, C,
                               acc_layer);
        if (m->hook) m->hook(m->hook_ctx, l);
    }
    be->embed_backward(m->g.wte, m->g.wpe, dresidual, m->tokens_dev, B, T, C, accumulate);
    if (m->hook) m->hook(m->hook_ctx, -1);
    m->have_targets = 0;
}

void model_logits_row(const Model *m, int b, int t, float *out) {
    size_t row = (size_t)b * m->live_T + (size_t)t, Vp = (size_t)m->shape.padded_vocab;
    m->be->to_host(m->row_host, (const char *)m->logits + row * Vp * m->act_bytes, Vp * m->act_bytes);
    backend_act_to_f32(out, m->row_host, Vp, m->act_bytes);
}

size_t model_num_params(const Model *m) {
    size_t n = 0;
    for (int i = 0; i < m->num_tensors; i++) n += m->params[i].numel;
    return n;
}

size_t model_num_nonembedding_params(const Model *m) {
    size_t n = model_num_params(m);
    return n - m->params[0].numel - m->params[1].numel;
}

double model_flops_per_token(const ModelShape *s, int T) {
    double L = s->n_layer, C = s->n_embd, V = s->vocab_size;
    /* per layer: qkv 3C^2 + proj C^2 + fc 4C^2 + fcproj 4C^2 weights */
    double matmul_params = L * 12.0 * C * C + C * V;
    /* Each weight costs 2 FLOPs forward and 4 backward per token. Attention
     * scores and the weighted sum cost 2*2*T*C per token and layer forward,
     * twice that backward: 12*L*T*C, halved because the mask is causal. */
    return 6.0 * matmul_params + 6.0 * L * T * C;
}

const ParamInfo *model_find_param(const Model *m, const char *name) {
    for (int i = 0; i < m->num_tensors; i++)
        if (strcmp(m->params[i].name, name) == 0) return &m->params[i];
    return NULL;
}

/* llm.c's GPT-2 checkpoint: 256 int32 header, then each parameter kind
 * stacked over layers, in llm.c's order. */
void model_load_llmc(Model *m, const char *path) {
    const ModelShape *s = &m->shape;
    FILE *f = fopen(path, "rb");
    if (!f) {
        kiln_fail_hint(KILN_EXIT_USAGE, "init.from names an llm.c GPT-2 checkpoint such as gpt2_124M.bin",
                       "%s: cannot open llm.c checkpoint (key 'init.from')", path);
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
    fseek(f, 0, SEEK_END);
    long fsize = ftell(f);
    if (fsize < 0 || (size_t)fsize != 1024 + total * sizeof(float)) {
        fclose(f);
        kiln_fail(KILN_EXIT_USAGE, "%s: file holds %ld bytes but its header implies %zu (truncated or not fp32)", path,
                  fsize, 1024 + total * sizeof(float));
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
    memcpy(host + m->params[0].offset, p, (size_t)V * Cz * sizeof(float)); /* padded rows stay zero */
    p += (size_t)Vp * Cz;
    memcpy(host + m->params[1].offset, p, (size_t)s->seq_len * Cz * sizeof(float));
    p += (size_t)maxT * Cz;
    for (int k = 0; k < 12; k++) {
        for (int l = 0; l < L; l++) {
            const ParamInfo *info = &m->params[2 + 12 * l + k];
            memcpy(host + info->offset, p, per_layer_sizes[k] * sizeof(float));
            p += per_layer_sizes[k];
        }
    }
    memcpy(host + m->params[2 + 12 * L].offset, p, Cz * sizeof(float));
    memcpy(host + m->params[3 + 12 * L].offset, p + Cz, Cz * sizeof(float));
    model_params_from_host(m, host);
    free(host);
    free(src);
}
