/* ep: the all-to-all dispatch and combine (see ep.h). One MoE layer,
 * forward: model.c's permuted rows (each rank's experts' rows contiguous) ->
 * all-to-all of the counts -> of the rows (rank-major) -> gather into
 * expert-major order -> the experts' products (model.c) -> gather back ->
 * all-to-all back; the backward the same on the gradients. Rows in the act
 * dtype, counts as floats (exact integers). Computes nothing but the
 * permutations' indices: the backend gathers. */
#include "ep.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

/* Row widths of the expert side, act elements. */
static size_t ep_C(const Ep *e) { return (size_t)e->m->shape.n_embd; }
static size_t ep_Fe(const Ep *e) { return (size_t)e->m->shape.moe.expert_hidden; }

/* model.recompute selective: the layers share one SwiGLU output. */
static int shares_act(const Ep *e) { return model_recomputes_experts(e->m->recompute); }
static void *layer_h_act(const Ep *e, const EpLayer *L) { return L->h_act ? L->h_act : e->h_act; }

static void layer_alloc(Ep *e, EpLayer *L, size_t rows) {
    const Backend *be = e->m->be;
    size_t ab = e->m->act_bytes, C = ep_C(e), Fe = ep_Fe(e);
    if (L->cap) {
        be->free(L->x), be->free(L->h);
        if (L->h_act) be->free(L->h_act);
        be->free(L->to_expert), be->free(L->to_source);
    }
    L->cap = rows;
    L->x = be->alloc(rows * C * ab);
    L->h = be->alloc(rows * 2 * Fe * ab);
    L->h_act = shares_act(e) ? NULL : be->alloc(rows * Fe * ab);
    L->to_expert = be->alloc(rows * sizeof(int32_t));
    L->to_source = be->alloc(rows * sizeof(int32_t));
}

static void shared_alloc(Ep *e, size_t rows) {
    const Backend *be = e->m->be;
    size_t ab = e->m->act_bytes, C = ep_C(e), Fe = ep_Fe(e);
    if (e->wcap) be->free(e->wire), be->free(e->y), be->free(e->dx), be->free(e->dh), be->free(e->dh_act);
    if (e->h_act) be->free(e->h_act);
    e->wcap = rows;
    e->h_act = shares_act(e) ? be->alloc(rows * Fe * ab) : NULL;
    e->wire = be->alloc(rows * C * ab);
    e->y = be->alloc(rows * C * ab);
    e->dx = be->alloc(rows * C * ab);
    e->dh = be->alloc(rows * 2 * Fe * ab);
    e->dh_act = be->alloc(rows * Fe * ab);
    e->idx_host = xrealloc(e->idx_host, 2 * rows * sizeof(int32_t));
}

/* Before MPI reads what the backend wrote (host memory); in device mode
 * comm orders the operation after the compute stream itself. */
static void fence(const Ep *e) {
    if (e->m->be->host_mem) e->m->be->sync();
}

/* send (ep, El) rows this rank sends to each rank's experts -> recv (ep, El)
 * rows each rank sends to this rank's experts. */
static void exchange_counts(Ep *e, const int32_t *send, int32_t *recv) {
    const Backend *be = e->m->be;
    size_t n = (size_t)e->ep * e->El;
    for (size_t i = 0; i < n; i++) e->cnt_host[i] = (float)send[i];
    be->to_device(e->cnt_dev, e->cnt_host, n * sizeof(float));
    fence(e);
    double t0 = kiln_now();
    comm_all_to_all(e->g, e->cnt_dev, e->cnt_dev + n, (size_t)e->El);
    e->blocked_s += kiln_now() - t0;
    be->to_host(e->cnt_host + n, e->cnt_dev + n, n * sizeof(float));
    for (size_t i = 0; i < n; i++) recv[i] = (int32_t)e->cnt_host[n + i];
}

/* Rows of a rank-major (ep, El) count table, per rank, as elements of C. */
static void per_rank(const Ep *e, const int32_t *cnt, size_t *out) {
    for (int d = 0; d < e->ep; d++) {
        size_t r = 0;
        for (int j = 0; j < e->El; j++) r += (size_t)cnt[(size_t)d * e->El + j];
        out[d] = r * ep_C(e);
    }
}

/* One exchange of rows: `send` rows per send_cnt to every rank, `recv`
 * rows per recv_cnt from every rank. */
static void exchange_rows(Ep *e, const void *send, const int32_t *send_cnt, void *recv, const int32_t *recv_cnt) {
    per_rank(e, send_cnt, e->sc);
    per_rank(e, recv_cnt, e->rc);
    fence(e);
    double t0 = kiln_now();
    comm_all_to_allv(e->g, send, e->sc, recv, e->rc, e->m->act_bytes);
    e->blocked_s += kiln_now() - t0;
}

/* Layer L's local expert ranges and the permutations between the received
 * order (rank s, then its rows for expert j) and the experts' (expert j,
 * then the ranks in order). */
static void build_perm(Ep *e, EpLayer *L) {
    const Backend *be = e->m->be;
    int ep = e->ep, El = e->El;
    L->off[0] = 0;
    for (int j = 0; j < El; j++) {
        int32_t r = 0;
        for (int s = 0; s < ep; s++) r += L->recv_cnt[(size_t)s * El + j];
        L->off[j + 1] = L->off[j] + r;
    }
    int32_t *te = e->idx_host, *ts = e->idx_host + L->rows;
    for (int j = 0; j < El; j++) e->cursor[j] = L->off[j];
    int32_t w = 0;
    for (int s = 0; s < ep; s++)
        for (int j = 0; j < El; j++) {
            int32_t c = L->recv_cnt[(size_t)s * El + j];
            for (int32_t i = 0; i < c; i++) te[e->cursor[j] + i] = w + i, ts[w + i] = e->cursor[j] + i;
            e->cursor[j] += c, w += c;
        }
    be->to_device(L->to_expert, te, (size_t)L->rows * sizeof(int32_t));
    be->to_device(L->to_source, ts, (size_t)L->rows * sizeof(int32_t));
}

/* Room for `rows` received rows in layer L and the shared buffers: capacity
 * mode sized them for the worst case at init; dropless grows them now (a
 * quarter more than asked, so a slowly rising load does not grow them every
 * step). */
static void need_rows(Ep *e, EpLayer *L, int layer, size_t rows) {
    if (rows <= L->cap && rows <= e->wcap) return;
    if (!e->dropless)
        kiln_fail(KILN_EXIT_RUNTIME, "ep: layer %d received %zu rows, more than the %zu the capacity allows", layer,
                  rows, L->cap);
    size_t want = rows + rows / 4;
    if (rows > L->cap) layer_alloc(e, L, want);
    if (rows > e->wcap) shared_alloc(e, want);
    if (want > e->grown_to) e->grown_to = want;
}

/* Layer l's state for the model's active activation slot: each micro-batch
 * a pipeline keeps in flight has its own, from its forward to its backward. */
static EpLayer *layer_of(Ep *e, int l) { return &e->layer[(size_t)e->m->cur_slot * e->m->shape.n_layer + l]; }

static void ep_dispatch(void *ctx, int layer, const void *xp, const int32_t *offsets, ModelExpertRows *r) {
    Ep *e = ctx;
    EpLayer *L = layer_of(e, layer);
    int ep = e->ep, El = e->El;
    for (int d = 0; d < ep; d++)
        for (int j = 0; j < El; j++) {
            int x = d * El + j;
            L->send_cnt[x] = offsets[x + 1] - offsets[x];
        }
    exchange_counts(e, L->send_cnt, L->recv_cnt);
    int64_t rows = 0, in = 0, out = 0;
    for (int d = 0; d < ep; d++)
        for (int j = 0; j < El; j++) {
            int x = d * El + j;
            rows += L->recv_cnt[x];
            if (d != e->rank) in += L->recv_cnt[x], out += L->send_cnt[x];
        }
    need_rows(e, L, layer, (size_t)rows);
    L->rows = (int)rows;
    exchange_rows(e, xp, L->send_cnt, e->wire, L->recv_cnt);
    build_perm(e, L);
    if (rows > 0) e->m->be->moe_gather(L->x, e->wire, L->to_expert, L->rows, (int)ep_C(e));
    e->sent += out, e->recv += in, e->rows += rows;
    *r = (ModelExpertRows){.e0 = e->m->expert_lo, .n = El, .off = L->off, .x = L->x, .h = L->h,
                           .h_act = layer_h_act(e, L), .y = e->y};
}

static void ep_combine(void *ctx, int layer, void *yp) {
    Ep *e = ctx;
    EpLayer *L = layer_of(e, layer);
    if (L->rows > 0) e->m->be->moe_gather(e->wire, e->y, L->to_source, L->rows, (int)ep_C(e));
    exchange_rows(e, e->wire, L->recv_cnt, yp, L->send_cnt);
}

static void ep_dispatch_grad(void *ctx, int layer, const void *dyp, ModelExpertRows *r) {
    Ep *e = ctx;
    EpLayer *L = layer_of(e, layer);
    exchange_rows(e, dyp, L->send_cnt, e->wire, L->recv_cnt);
    if (L->rows > 0) e->m->be->moe_gather(e->y, e->wire, L->to_expert, L->rows, (int)ep_C(e));
    *r = (ModelExpertRows){.e0 = e->m->expert_lo, .n = e->El, .off = L->off, .x = L->x, .h = L->h,
                           .h_act = layer_h_act(e, L), .dy = e->y, .dh_act = e->dh_act, .dh = e->dh, .dx = e->dx};
}

static void ep_combine_grad(void *ctx, int layer, void *dxp) {
    Ep *e = ctx;
    EpLayer *L = layer_of(e, layer);
    if (L->rows > 0) e->m->be->moe_gather(e->wire, e->dx, L->to_source, L->rows, (int)ep_C(e));
    exchange_rows(e, e->wire, L->recv_cnt, dxp, L->send_cnt);
}

size_t ep_plan_rows(const ArchSpec *s, int ep, int cp, int B, int T) {
    /* R slots a rank sends at most (its T / cp rows of each sequence);
     * capacity: each rank sends each expert at most cap rows of each of its
     * B sequences (under cp its chunks keep at most cap together) */
    size_t R = (size_t)B * (T / cp) * s->moe.top_k, worst = (size_t)ep * R, El = (size_t)(s->moe.n_experts / ep);
    int cap = arch_moe_capacity(s, T);
    if (cap <= 0) return 2 * R < worst ? 2 * R : worst;
    size_t c = (size_t)ep * B * El * (size_t)cap;
    return c < worst ? c : worst;
}

size_t ep_buffer_bytes(const ArchSpec *s, int ep, int cp, int layer_sets, int B, int T, size_t act_bytes,
                       ModelRecompute r) {
    if (ep <= 1 || s->mlp != MLP_MOE) return 0;
    size_t rows = ep_plan_rows(s, ep, cp, B, T), C = (size_t)s->n_embd, Fe = (size_t)s->moe.expert_hidden;
    size_t shared = model_recomputes_experts(r) ? Fe : 0; /* one h_act for every layer */
    size_t layer = rows * ((C + 3 * Fe - shared) * act_bytes + 2 * sizeof(int32_t));
    return (size_t)layer_sets * layer + rows * (3 * C + 3 * Fe + shared) * act_bytes;
}

/* Layers [*lo, *hi) of the model's activation slot i (its chunk's). */
static void slot_layers(const Model *m, int i, int *lo, int *hi) {
    int c = m->slots[i].chunk;
    *lo = m->chunk_lo[c], *hi = m->chunk_hi[c];
}

void ep_init(Ep *e, Model *m, CommGroup *g) {
    memset(e, 0, sizeof *e);
    e->m = m;
    e->g = g;
    e->ep = 1;
    if (!g || g->size <= 1) return;
    if (m->ep != g->size || m->ep_rank != g->rank)
        kiln_fail(KILN_EXIT_RUNTIME, "ep_init: the model is rank %d of ep %d, the group rank %d of %d", m->ep_rank,
                  m->ep, g->rank, g->size);
    if (!m->act_mem || !m->n_slots) kiln_fail(KILN_EXIT_RUNTIME, "ep_init: plan the model's activations first");
    const ArchSpec *s = &m->shape;
    e->ep = g->size, e->rank = g->rank, e->El = m->n_experts_here;
    e->dropless = arch_moe_capacity(s, m->T) <= 0;
    size_t rows = ep_plan_rows(s, e->ep, m->cp, m->B, m->T);
    if (rows > (1u << 24))
        kiln_fail(KILN_EXIT_USAGE, "key 'parallel.ep': %zu rows per layer would reach this rank, past the 2^24 the "
                  "counts exchange carries exactly; use a smaller micro-batch", rows);
    size_t n = (size_t)e->ep * e->El;
    /* one state per (activation slot, layer): a pipeline's micro-batches in
     * flight each keep their dispatch for their backward */
    e->n_slots = m->n_slots;
    e->layer = xcalloc((size_t)m->n_slots * s->n_layer, sizeof(EpLayer));
    for (int i = 0; i < m->n_slots; i++) {
        int lo, hi;
        slot_layers(m, i, &lo, &hi);
        for (int l = lo; l < hi; l++) {
            EpLayer *L = &e->layer[(size_t)i * s->n_layer + l];
            L->recv_cnt = xcalloc(n, sizeof(int32_t));
            L->send_cnt = xcalloc(n, sizeof(int32_t));
            L->off = xcalloc((size_t)e->El + 1, sizeof(int32_t));
            layer_alloc(e, L, rows);
            e->layer_sets++;
        }
    }
    shared_alloc(e, rows);
    e->cnt_dev = m->be->alloc(2 * n * sizeof(float));
    e->cnt_host = xcalloc(2 * n, sizeof(float));
    e->sc = xcalloc((size_t)e->ep, sizeof(size_t));
    e->rc = xcalloc((size_t)e->ep, sizeof(size_t));
    e->cursor = xcalloc((size_t)e->El, sizeof(int32_t));
    model_set_ep(m, &(ModelEp){e, ep_dispatch, ep_combine, ep_dispatch_grad, ep_combine_grad});
}

void ep_free(Ep *e) {
    if (e->ep > 1) {
        const Backend *be = e->m->be;
        model_set_ep(e->m, NULL);
        size_t n = (size_t)e->n_slots * e->m->shape.n_layer;
        for (size_t i = 0; i < n; i++) {
            EpLayer *L = &e->layer[i];
            if (!L->cap) continue; /* a layer of another chunk */
            be->free(L->x), be->free(L->h), be->free(L->to_expert), be->free(L->to_source);
            if (L->h_act) be->free(L->h_act);
            free(L->recv_cnt), free(L->send_cnt), free(L->off);
        }
        be->free(e->wire), be->free(e->y), be->free(e->dx), be->free(e->dh), be->free(e->dh_act);
        if (e->h_act) be->free(e->h_act);
        be->free(e->cnt_dev);
        free(e->layer), free(e->cnt_host), free(e->sc), free(e->rc), free(e->idx_host), free(e->cursor);
    }
    free(e->gathered);
    memset(e, 0, sizeof *e);
}

void ep_step_begin(Ep *e) {
    e->blocked_s = 0;
    e->sent = e->recv = e->rows = 0;
    e->grown_to = 0;
}

void ep_step_figures(Ep *e, CommGroup *world, EpFigures *out) {
    double mine[3] = {(double)e->sent, (double)e->recv, (double)e->rows};
    int w = world->size;
    if (!e->gathered) e->gathered = xmalloc((size_t)3 * w * sizeof(double));
    double *all = e->gathered;
    comm_all_gather_bytes(world, mine, all, sizeof mine);
    double most = 0, sum = 0;
    for (int r = 0; r < w; r++) {
        out->sent[r] = all[3 * r], out->recv[r] = all[3 * r + 1], out->rows[r] = all[3 * r + 2];
        most = out->rows[r] > most ? out->rows[r] : most;
        sum += out->rows[r];
    }
    out->imbalance = sum > 0 ? most / (sum / w) : 0;
}

double ep_step_blocked_s(const Ep *e) { return e->blocked_s; }

int ep_describe(const Ep *e, char *buf, size_t len) {
    if (e->ep <= 1) return 0;
    const Model *m = e->m;
    double mib = (double)ep_buffer_bytes(&m->shape, e->ep, m->cp, e->layer_sets, m->B, m->T, m->act_bytes,
                                         m->recompute) /
                 1048576.0;
    int lo, hi;
    slot_layers(m, 0, &lo, &hi);
    snprintf(buf, len, "expert parallel: %d ranks, experts %d..%d of %d here per layer; tokens by all-to-all; "
             "receive buffers %zu rows per layer and micro-batch in flight (%d such sets; %s), %.2f MiB", e->ep,
             m->expert_lo, m->expert_lo + e->El - 1, m->shape.moe.n_experts, e->layer[lo].cap, e->layer_sets,
             e->dropless ? "dropless: twice the balanced share, grown when a layer needs more"
                         : "the most the capacity lets every rank send", mib);
    return 1;
}
