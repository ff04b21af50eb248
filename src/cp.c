/* cp: context-parallel attention (see cp.h). Both modes compute the same
 * blocks in the same order: for step i = 0 .. cp-1 the keys of rank
 * (rank - i) mod cp, each of its two chunks against each local query chunk
 * that sees it (a chunk sees every earlier chunk whole, its own as a
 * triangle, no later one: fully masked blocks are skipped). So ring and
 * all-gather forwards give the same bits; backwards differ only in how dK/dV
 * are summed over the ranks. Device buffers only; the host waits on
 * communication, never on the device. */
#include "cp.h"

#include <string.h>

#include "util.h"

#define CP_TAG_KV 0x4350  /* the K/V block of a ring step */
#define CP_TAG_DKV 0x4351 /* its dK/dV accumulator */

static const char *const cp_mode_names[] = {"allgather", "ring"};

CpMode cp_mode_parse(const char *name) {
    for (int i = 0; i < 2; i++)
        if (strcmp(name, cp_mode_names[i]) == 0) return (CpMode)i;
    kiln_fail(KILN_EXIT_USAGE, "key 'parallel.cp_attention': '%s' is not one of allgather|ring", name);
}
const char *cp_mode_name(CpMode m) { return cp_mode_names[m == CP_RING]; }

/* One rank's packed k | v rows (N, S) act as a count of floats for comm:
 * bytes / 4, whole for both act sizes since S is even. */
static size_t kv_floats(const Cp *c, size_t N, int S) { return N * (size_t)S * c->ab / sizeof(float); }

size_t cp_buffer_bytes(const AttnShape *s, int cp, CpMode mode, size_t ab) {
    size_t N = (size_t)s->B * s->T, S = (size_t)2 * s->NKV * s->HD, F = sizeof(float);
    size_t kv = mode == CP_RING ? 2 : (size_t)cp, dkv = mode == CP_RING ? 3 : (size_t)cp + 1;
    size_t dq = ab == F ? 0 : N * (size_t)attn_qkv_width(s) * F;
    return kv * N * S * ab + dkv * N * S * F + dq;
}

void cp_init(Cp *c, const Backend *be, CommGroup *g, CpMode mode, const AttnShape *cap) {
    memset(c, 0, sizeof *c);
    c->be = be;
    c->g = g && g->size > 1 ? g : NULL;
    c->cp = c->g ? g->size : 1;
    c->rank = c->g ? g->rank : 0;
    c->mode = mode;
    c->ab = be->act_bytes();
    c->cap = *cap;
    if (cap->T % 2)
        kiln_fail(KILN_EXIT_RUNTIME, "cp_init: %d local rows per sequence are not two chunks", cap->T);
    size_t N = (size_t)cap->B * cap->T, S = (size_t)2 * cap->NKV * cap->HD;
    size_t nkv = mode == CP_RING ? 2 : (size_t)c->cp, ndkv = mode == CP_RING ? 3 : (size_t)c->cp + 1;
    c->kv = be->alloc(nkv * N * S * c->ab);
    c->dkv = be->alloc(ndkv * N * S * sizeof(float));
    if (c->ab != sizeof(float)) c->dqkv32 = be->alloc(N * (size_t)attn_qkv_width(cap) * sizeof(float));
}

void cp_free(Cp *c) {
    if (c->m) model_set_cp(c->m, NULL);
    if (c->be) {
        c->be->free(c->kv);
        c->be->free(c->dkv);
        if (c->dqkv32) c->be->free(c->dqkv32);
    }
    memset(c, 0, sizeof *c);
}

static void cp_check(const Cp *c, const AttnShape *s) {
    if (s->T % 2 || (size_t)s->B * s->T > (size_t)c->cap.B * c->cap.T || s->NH != c->cap.NH || s->NKV != c->cap.NKV ||
        s->HD != c->cap.HD)
        kiln_fail(KILN_EXIT_RUNTIME, "cp attention: local shape %d x %d (heads %d/%d of %d) is not two chunks within "
                  "the planned %d x %d (heads %d/%d of %d)", s->B, s->T, s->NH, s->NKV, s->HD, c->cap.B, c->cap.T,
                  c->cap.NH, c->cap.NKV, c->cap.HD);
}

/* Blocked time on the cp group; MPI progresses non-blocking transfers only
 * inside its calls, so the compute loop tests the request now and then. */
static void cp_wait(Cp *c, CommRequest *r) {
    double t0 = kiln_now();
    comm_wait(r);
    c->blocked_s += kiln_now() - t0;
}
static void cp_poke(CommRequest *r) {
    if (r && r->active) comm_test(r);
}

/* The per-block geometry shared by forward and backward: s the local shape,
 * Tc rows per chunk; local chunk q against chunk d of rank `src`. */
typedef struct CpGeo {
    int B, Tc, NH, NKV, HD, QKVW, S;
    const int32_t *doc; /* (2, B, Tc) document starts of the local rows (global positions), or NULL */
} CpGeo;

static CpGeo cp_geo(const AttnShape *s) {
    return (CpGeo){s->B, s->T / 2, s->NH, s->NKV, s->HD, attn_qkv_width(s), 2 * s->NKV * s->HD, s->doc};
}

/* The block of local query chunk q against key chunk d of rank src; 0 when
 * it is fully masked by causality (documents mask within the ops: q_doc is
 * the query chunk's document starts, global as the blocks' positions). */
static int cp_block(const Cp *c, const CpGeo *g, int q, int src, int d, AttnBlock *b) {
    int gq = model_cp_chunk(c->cp, c->rank, q), gk = model_cp_chunk(c->cp, src, d);
    if (gk > gq) return 0;
    *b = (AttnBlock){.B = g->B, .NH = g->NH, .NKV = g->NKV, .HD = g->HD, .Tq = g->Tc, .Tk = g->Tc,
                     .q_pos = gq * g->Tc, .k_pos = gk * g->Tc, .q_ld = g->QKVW, .kv_ld = g->S,
                     .q_doc = g->doc ? g->doc + (size_t)q * g->B * g->Tc : NULL};
    return 1;
}

/* This rank's k | v columns of qkv (N, QKVW) into a packed (N, S) buffer. */
static void cp_pack(const Cp *c, const CpGeo *g, void *dst, const void *qkv) {
    size_t N = (size_t)g->B * 2 * g->Tc, ab = c->ab;
    c->be->copy_2d(dst, (size_t)g->S * ab, (const char *)qkv + (size_t)g->NH * g->HD * ab, (size_t)g->QKVW * ab,
                   (size_t)g->S * ab, N);
}

/* The forward blocks against one rank's packed keys kvs; started[q]: local
 * chunk q holds a result to merge into. */
static void cp_forward_blocks(Cp *c, const CpGeo *g, void *out, float *lse, const void *qkv, const void *kvs, int src,
                              int started[2], CommRequest *pending) {
    size_t ab = c->ab, rows = (size_t)g->B * g->Tc;
    for (int q = 0; q < 2; q++)
        for (int d = 0; d < 2; d++) {
            AttnBlock b;
            if (!cp_block(c, g, q, src, d, &b)) continue;
            const char *k = (const char *)kvs + d * rows * g->S * ab;
            c->be->attention_block_forward((char *)out + q * rows * g->NH * g->HD * ab, lse + q * rows * g->NH,
                                           (const char *)qkv + q * rows * g->QKVW * ab, k,
                                           k + (size_t)g->NKV * g->HD * ab, &b, started[q]);
            started[q] = 1;
            cp_poke(pending);
        }
}

void cp_attention_forward(Cp *c, void *out, float *lse, const void *qkv, const AttnShape *s) {
    cp_check(c, s);
    CpGeo g = cp_geo(s);
    size_t N = (size_t)s->B * s->T, blk = N * g.S * c->ab, n = kv_floats(c, N, g.S);
    int started[2] = {0, 0}, cp = c->cp, r = c->rank;
    if (c->mode == CP_ALLGATHER) {
        char *all = c->kv;
        cp_pack(c, &g, all + r * blk, qkv);
        if (c->g) {
            double t0 = kiln_now();
            comm_all_gather(c->g, (const float *)(all + r * blk), (float *)all, n);
            c->blocked_s += kiln_now() - t0;
        }
        for (int i = 0; i < cp; i++) {
            int src = (r - i + cp) % cp;
            cp_forward_blocks(c, &g, out, lse, qkv, all + src * blk, src, started, NULL);
        }
        return;
    }
    /* ring: step i computes on the block of rank r - i while that block
     * goes on to r + 1 and the next arrives from r - 1 */
    char *cur = c->kv, *nxt = cur + blk;
    cp_pack(c, &g, cur, qkv);
    for (int i = 0; i < cp; i++) {
        int src = (r - i + cp) % cp, more = i < cp - 1;
        CommRequest req = {0};
        if (more) comm_isendrecv(c->g, (const float *)cur, (float *)nxt, n, (r + 1) % cp, (r - 1 + cp) % cp, CP_TAG_KV, &req);
        cp_forward_blocks(c, &g, out, lse, qkv, cur, src, started, more ? &req : NULL);
        if (more) {
            cp_wait(c, &req);
            char *t = cur;
            cur = nxt, nxt = t;
        }
    }
}

/* The backward blocks against one rank's packed keys kvs: dq into d32's q
 * columns (ld QKVW), dk | dv into the packed fp32 dkv (rows of S). */
static void cp_backward_blocks(Cp *c, const CpGeo *g, float *d32, float *dkv, const void *dout, const void *qkv,
                               const void *out, const float *lse, const void *kvs, int src, CommRequest *p1,
                               CommRequest *p2) {
    size_t ab = c->ab, rows = (size_t)g->B * g->Tc, KVW = (size_t)g->NKV * g->HD, Q = (size_t)g->NH * g->HD;
    for (int q = 0; q < 2; q++)
        for (int d = 0; d < 2; d++) {
            AttnBlock b;
            if (!cp_block(c, g, q, src, d, &b)) continue;
            const char *k = (const char *)kvs + d * rows * g->S * ab;
            float *dk = dkv + d * rows * g->S;
            c->be->attention_block_backward(d32 + q * rows * g->QKVW, dk, dk + KVW,
                                            (const char *)dout + q * rows * Q * ab,
                                            (const char *)qkv + q * rows * g->QKVW * ab, k, k + KVW * ab,
                                            (const char *)out + q * rows * Q * ab, lse + q * rows * g->NH, &b);
            cp_poke(p1);
            cp_poke(p2);
        }
}

void cp_attention_backward(Cp *c, void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                           const AttnShape *s) {
    cp_check(c, s);
    const Backend *be = c->be;
    CpGeo g = cp_geo(s);
    size_t N = (size_t)s->B * s->T, S = (size_t)g.S, blk = N * S * c->ab, n = kv_floats(c, N, g.S);
    int cp = c->cp, r = c->rank, next = (r + 1) % cp, prev = (r - 1 + cp) % cp;
    /* fp32 dq | dk | dv of the local rows: dqkv itself when act is fp32 */
    float *d32 = c->dqkv32 ? c->dqkv32 : dqkv;
    be->zero(d32, N * (size_t)g.QKVW * sizeof(float));
    const float *mine; /* (N, S) fp32: this rank's dk | dv, summed over every rank's queries */
    if (c->mode == CP_ALLGATHER) {
        char *all = c->kv;
        float *dall = c->dkv, *sum = dall + (size_t)cp * N * S;
        cp_pack(c, &g, all + r * blk, qkv);
        double t0 = kiln_now();
        if (c->g) comm_all_gather(c->g, (const float *)(all + r * blk), (float *)all, n);
        c->blocked_s += kiln_now() - t0;
        be->zero(dall, (size_t)cp * N * S * sizeof(float));
        for (int i = 0; i < cp; i++) {
            int src = (r - i + cp) % cp;
            cp_backward_blocks(c, &g, d32, dall + src * N * S, dout, qkv, out, lse, all + src * blk, src, NULL, NULL);
        }
        t0 = kiln_now();
        if (c->g) comm_reduce_scatter(c->g, dall, sum, N * S);
        else be->copy(sum, dall, N * S * sizeof(float));
        c->blocked_s += kiln_now() - t0;
        mine = sum;
    } else {
        /* ring: K/V go round as in the forward; block src's dK/dV
         * accumulator follows one step behind (ranks src, src+1, ... add
         * to it), computed into `part` while the previous step's is in
         * flight, and arrives complete at src after cp hops */
        char *cur = c->kv, *nxt = cur + blk;
        float *acc[2] = {c->dkv, c->dkv + N * S}, *part = c->dkv + 2 * N * S;
        int out_i = 0; /* acc[out_i] is being sent, acc[!out_i] received into */
        CommRequest dreq = {0};
        cp_pack(c, &g, cur, qkv);
        for (int i = 0; i < cp; i++) {
            int src = (r - i + cp) % cp, more = i < cp - 1;
            CommRequest kreq = {0};
            if (more) comm_isendrecv(c->g, (const float *)cur, (float *)nxt, n, next, prev, CP_TAG_KV, &kreq);
            float *into = i == 0 ? acc[0] : part;
            be->zero(into, N * S * sizeof(float));
            cp_backward_blocks(c, &g, d32, into, dout, qkv, out, lse, cur, src, more ? &kreq : NULL, &dreq);
            if (i > 0) { /* the accumulator of block src from ranks src .. r-1 */
                cp_wait(c, &dreq);
                out_i = !out_i;
                be->add(acc[out_i], acc[out_i], part, N * S);
            }
            if (c->g)
                comm_isendrecv(c->g, acc[out_i], acc[!out_i], N * S, next, prev, CP_TAG_DKV, &dreq);
            if (more) {
                cp_wait(c, &kreq);
                char *t = cur;
                cur = nxt, nxt = t;
            }
        }
        if (c->g) {
            cp_wait(c, &dreq); /* this rank's own block, complete */
            out_i = !out_i;
        }
        mine = acc[out_i];
    }
    /* dk | dv beside dq, then the whole row to act */
    be->copy_2d(d32 + (size_t)g.NH * g.HD, (size_t)g.QKVW * sizeof(float), mine, S * sizeof(float),
                S * sizeof(float), N);
    if (c->dqkv32) be->cast_to_act(dqkv, c->dqkv32, N * (size_t)g.QKVW);
}

/* ---- the model's hooks */

static void hook_sum_host(void *ctx, double *x, size_t n) {
    Cp *c = ctx;
    double t0 = kiln_now();
    comm_all_reduce_sum_f64(c->g, x, n);
    c->blocked_s += kiln_now() - t0;
}

static void hook_forward(void *ctx, void *out, float *lse, const void *qkv, const AttnShape *s) {
    cp_attention_forward(ctx, out, lse, qkv, s);
}
static void hook_backward(void *ctx, void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                          const AttnShape *s) {
    cp_attention_backward(ctx, dqkv, dout, qkv, out, lse, s);
}
static void hook_broadcast(void *ctx, void *buf, size_t n, int root) {
    Cp *c = ctx;
    double t0 = kiln_now();
    size_t bytes = n * c->ab;
    if (bytes % sizeof(float) == 0) comm_broadcast(c->g, buf, bytes / sizeof(float), root);
    else comm_broadcast_bytes(c->g, buf, bytes, root);
    c->blocked_s += kiln_now() - t0;
}

static void hook_all_gather_f32(void *ctx, const float *send, float *recv, size_t block) {
    Cp *c = ctx;
    double t0 = kiln_now();
    comm_all_gather(c->g, send, recv, block);
    c->blocked_s += kiln_now() - t0;
}

void cp_attach(Cp *c, Model *m) {
    if (m->cp != c->cp || m->cp_rank != c->rank)
        kiln_fail(KILN_EXIT_RUNTIME, "cp_attach: the model is rank %d of cp %d, the group rank %d of %d", m->cp_rank,
                  m->cp, c->rank, c->cp);
    c->m = m;
    if (c->cp == 1) return; /* the model runs the plain attention ops */
    ModelCp ops = {.ctx = c, .attention_forward = hook_forward, .attention_backward = hook_backward,
                   .broadcast = hook_broadcast, .sum_host = hook_sum_host,
                   .all_gather_f32 = hook_all_gather_f32};
    model_set_cp(m, &ops);
}

void cp_micro_begin(Cp *c, int first) {
    if (!first) return;
    c->total_s += c->blocked_s;
    c->blocked_s = 0;
}

double cp_step_blocked_s(const Cp *c) { return c->blocked_s; }
