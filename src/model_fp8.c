/* model_fp8: the block's matrix products with fp8 operands (precision.fp8;
 * docs/precision.md). Each operand is quantised onto the fp8 grid with a
 * scale from its amax (backend.h fp8_amax, fp8_qdq), then multiplied by the
 * backend's matmul; the amax is reduced over the tp ranks (ModelTp) exactly
 * where tp splits the range it covers, so every tp layout scales as one rank
 * does. Never communicates but through the model's tp hooks. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fp8.h"
#include "model.h"
#include "testhooks.h"
#include "util.h"

/* The weight role of product `kind` (the tensor named in errors). */
static int mm_role(const Model *m, int kind) {
    switch (kind) {
    case MM_QKV: return ROLE_QKV_W;
    case MM_O: return ROLE_O_W;
    case MM_FC: return ROLE_FC_W;
    case MM_DOWN: return ROLE_DOWN_W;
    case MM_SHARED_GATE: return ROLE_SHARED_GATE_W;
    case MM_SHARED_DOWN: return ROLE_SHARED_DOWN_W;
    case MM_EXPERT_GATE: return ROLE_EXPERT_GATE_W;
    case MM_EXPERT_DOWN: return ROLE_EXPERT_DOWN_W;
    default: return m->shape.tie_embeddings ? ROLE_TOK_EMB : ROLE_HEAD_W;
    }
}

/* Which of a product's dimensions tensor parallelism splits: the output
 * (column-parallel: q/k/v, fc, the vocabulary-parallel head), the input
 * (row-parallel: o, down), or none (experts and shared experts are
 * replicated over tp). */
enum { SPLIT_NONE, SPLIT_OUT, SPLIT_IN };
static int mm_split(const Model *m, int kind) {
    if (m->tp <= 1) return SPLIT_NONE;
    if (kind == MM_QKV || kind == MM_FC || kind == MM_HEAD) return SPLIT_OUT;
    if (kind == MM_O || kind == MM_DOWN) return SPLIT_IN;
    return SPLIT_NONE;
}

/* Whether the product is one fp8 covers: the block's linear layers, and the
 * head with fp8_head. */
static int mm_is_fp8(const ModelFp8 *f, int kind) { return f->mode != FP8_OFF && (kind != MM_HEAD || f->head); }

/* (in, out) widths of product `kind` (local shapes). */
static void mm_dims(const ArchSpec *s, int kind, int *in, int *out) {
    int C = s->n_embd, Fe = s->moe.expert_hidden, S = s->moe.n_shared * Fe;
    switch (kind) {
    case MM_QKV: *in = C, *out = arch_qkv_width(s); break;
    case MM_O: *in = arch_q_width(s), *out = C; break;
    case MM_FC: *in = C, *out = arch_fc_width(s); break;
    case MM_DOWN: *in = s->ffn_hidden, *out = C; break;
    case MM_SHARED_GATE: *in = C, *out = 2 * S; break;
    case MM_SHARED_DOWN: *in = S, *out = C; break;
    case MM_EXPERT_GATE: *in = C, *out = 2 * Fe; break;
    case MM_EXPERT_DOWN: *in = Fe, *out = C; break;
    default: *in = C, *out = s->padded_vocab; break;
    }
}

/* Whether the architecture has product `kind`. */
static int mm_exists(const ArchSpec *s, int kind) {
    int moe = s->mlp == MLP_MOE;
    switch (kind) {
    case MM_FC: case MM_DOWN: return !moe;
    case MM_SHARED_GATE: case MM_SHARED_DOWN: return moe && s->moe.n_shared > 0;
    case MM_EXPERT_GATE: case MM_EXPERT_DOWN: return moe;
    default: return 1;
    }
}

/* History slots per layer: the block's products, and each routed expert's two. */
static int mm_slots_per_layer(const ArchSpec *s) { return MM_KINDS + 2 * (s->mlp == MLP_MOE ? s->moe.n_experts : 0); }

static int mm_history_slot(const Model *m, int l, int kind, int e) {
    int per = mm_slots_per_layer(&m->shape);
    if (kind == MM_HEAD) return m->shape.n_layer * per;
    return l * per + (kind < MM_KINDS ? kind : MM_KINDS + 2 * e + (kind - MM_EXPERT_GATE));
}

/* The buffers model_fp8_plan allocates for N rows, in elements (x, w, dout)
 * and amaxes (n: the most of one operand). */
typedef struct {
    size_t x, w, d, n;
} Fp8Sizes;
static Fp8Sizes fp8_sizes(const ArchSpec *s, const ModelFp8 *f, int ep, size_t N) {
    Fp8Sizes z = {0, 0, 0, 0};
    for (int kind = 0; kind <= MM_HEAD; kind++) {
        if (!mm_exists(s, kind) || !mm_is_fp8(f, kind)) continue;
        int in, out;
        mm_dims(s, kind, &in, &out);
        /* a routed expert takes each token at most once, from every ep rank's N under ep */
        size_t rows = N * (kind == MM_EXPERT_GATE || kind == MM_EXPERT_DOWN ? (size_t)ep : 1);
        z.x = z.x > rows * in ? z.x : rows * in;
        z.w = z.w > (size_t)out * in ? z.w : (size_t)out * in;
        z.d = z.d > rows * out ? z.d : rows * out;
        z.n = z.n > rows ? z.n : rows;
        z.n = z.n > (size_t)in ? z.n : (size_t)in;
        z.n = z.n > (size_t)out ? z.n : (size_t)out;
    }
    return z;
}
/* dout's act operand, or its codes and those of dout^T (a byte each) side by side */
static size_t fp8_qd_bytes(const Fp8Sizes *z, size_t act_bytes) {
    return z->d * act_bytes > 2 * z->d ? z->d * act_bytes : 2 * z->d;
}
static size_t fp8_inv_n(const Fp8Sizes *z) { return (z->n + 3) / 4 * 4; }
static int fp8_slots(const ArchSpec *s) { return s->n_layer * mm_slots_per_layer(s) + 1; }

void model_fp8_check(Model *m) {
    if (m->fp8.mode == FP8_OFF) return;
    if (!m->be->fp8_amax || !m->be->fp8_qdq)
        kiln_fail(KILN_EXIT_USAGE, "key 'precision.fp8': the %s backend has no fp8 operations; set precision.fp8: off",
                  m->be->name);
    /* bf16 operands are the CPU's stand-in for a bf16 run; a GPU has the real one */
    if (m->fp8.mode == FP8_BF16_OPERANDS) {
        if (!m->be->host_mem)
            kiln_fail(KILN_EXIT_USAGE, "key 'precision.fp8': bf16 is the CPU backend's stand-in for bf16 products; "
                      "on %s set precision.fp8: off and precision.compute: bf16", m->be->name);
        m->fp8_slots = fp8_slots(&m->shape);
        return; /* bf16 products take any shape */
    }
    /* a device backend's fp8 products store bf16; an fp32 run has nothing to gain */
    if (!m->be->host_mem && m->act_bytes == 4)
        kiln_fail(KILN_EXIT_USAGE, "keys 'precision.fp8', 'precision.compute': fp8 products need precision.compute: "
                  "bf16 on %s, got fp32; set precision.fp8: off or precision.compute: bf16", m->be->name);
    for (int kind = 0; kind <= MM_HEAD; kind++) {
        if (!mm_exists(&m->shape, kind) || !mm_is_fp8(&m->fp8, kind)) continue;
        int in, out, role = mm_role(m, kind), i = -1;
        mm_dims(&m->shape, kind, &in, &out);
        if (in % 16 == 0 && out % 16 == 0) continue;
        int e = kind == MM_EXPERT_GATE || kind == MM_EXPERT_DOWN ? 0 : -1;
        for (int l = kind == MM_HEAD ? -1 : 0; l < m->shape.n_layer && i < 0; l++)
            i = model_tensor_index(m, l, role, e);
        kiln_fail(KILN_EXIT_USAGE, "key 'precision.fp8': tensor '%s' makes a product of %d inputs and %d outputs%s, "
                  "not multiples of 16 as fp8 matrix products need; set precision.fp8: off or resize the model",
                  i >= 0 ? m->params[i].name : "?", in, out, m->tp > 1 ? " (this tp rank's part)" : "");
    }
    m->fp8_slots = fp8_slots(&m->shape);
}

/* The codes path's inverse scales (Model.fp8_inv), one vector each: x, w
 * (forward); dout, dout^T, w^T (input gradient, weight gradient); x^T. */
enum { INV_X, INV_W, INV_D, INV_DT, INV_WT, INV_XT, FP8_INVS };
static float *fp8_inv(const Model *m, int which) { return m->fp8_inv + (size_t)which * m->fp8_inv_n; }

size_t model_fp8_bytes(const ArchSpec *s, const ModelFp8 *f, int tp, int cp, int ep, size_t N, size_t act_bytes,
                       ModelFp8Bytes *parts) {
    ModelFp8Bytes b = {0, 0, 0};
    if (f->mode != FP8_OFF) {
        Fp8Sizes z = fp8_sizes(s, f, ep, N);
        b.operands = (z.x + z.w) * act_bytes + fp8_qd_bytes(&z, act_bytes);
        b.scales = (2 * (size_t)tp * cp * z.n + FP8_INVS * fp8_inv_n(&z) + 1) * sizeof(float);
        b.histories = f->history > 0 ? (size_t)fp8_slots(s) * MM_OPERANDS * f->history * tp * cp * sizeof(float) : 0;
    }
    if (parts) *parts = b;
    return b.operands + b.scales + b.histories;
}

void model_fp8_plan(Model *m, int N) {
    if (m->fp8.mode == FP8_OFF) return;
    model_fp8_free(m);
    Fp8Sizes z = fp8_sizes(&m->shape, &m->fp8, m->ep, (size_t)N);
    m->fp8_cap[0] = z.x, m->fp8_cap[1] = z.w, m->fp8_cap[2] = z.d;
    m->fp8_qx = m->be->alloc(z.x * m->act_bytes);
    m->fp8_qw = m->be->alloc(z.w * m->act_bytes);
    m->fp8_qd = m->be->alloc(fp8_qd_bytes(&z, m->act_bytes));
    m->fp8_amax_n = z.n;
    m->fp8_inv_n = fp8_inv_n(&z);
    m->fp8_local_amax = testhooks()->fp8_local_amax;
    m->fp8_amax = m->be->alloc(2 * (size_t)m->tp * m->cp * z.n * sizeof(float));
    m->fp8_inv = m->be->alloc((FP8_INVS * m->fp8_inv_n + 1) * sizeof(float));
    size_t h = (size_t)m->fp8_slots * MM_OPERANDS, hb = h * m->fp8.history * m->tp * m->cp * sizeof(float);
    if (m->fp8.history > 0) {
        m->fp8_hist = m->be->alloc(hb);
        m->be->zero(m->fp8_hist, hb);
        m->fp8_count = xcalloc(h, sizeof(int64_t));
    }
    size_t sb = model_fp8_snap_bytes(&m->shape, &m->fp8, m->tp, m->cp, m->n_slots, m->recompute);
    if (sb) m->fp8_snap = m->be->alloc(sb);
}

size_t model_fp8_snap_bytes(const ArchSpec *s, const ModelFp8 *f, int tp, int cp, int n_slots, ModelRecompute r) {
    if (f->mode == FP8_OFF || f->history <= 0 || r != MODEL_RECOMPUTE_BLOCK) return 0;
    return (size_t)n_slots * fp8_slots(s) * 2 * f->history * tp * cp * sizeof(float);
}

void model_fp8_free(Model *m) {
    void **bufs[] = {&m->fp8_qx, &m->fp8_qw, &m->fp8_qd, (void **)&m->fp8_amax, (void **)&m->fp8_hist,
                     (void **)&m->fp8_inv, (void **)&m->fp8_snap};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        if (*bufs[i]) m->be->free(*bufs[i]);
        *bufs[i] = NULL;
    }
    free(m->fp8_count);
    m->fp8_count = NULL;
}

/* Whether operand `operand` of product `kind` has the micro-batch's token
 * rows, which context parallelism splits over the cp ranks (each holds two
 * chunks of every sequence): the activations and output gradients, not the
 * weights (replicated over cp), and not a routed expert's rows (a rank calls
 * an expert's product only when it has rows for it, so no collective can
 * run there: an expert's amax is of this rank's rows, as under dp). */
static int mm_token_rows(const Model *m, int kind, int operand) {
    if (m->cp <= 1 || kind == MM_EXPERT_GATE || kind == MM_EXPERT_DOWN) return 0;
    return operand == MM_X || operand == MM_XB || operand == MM_D;
}

/* Which of operand `operand`'s dimensions (rows, columns) tp splits: x
 * (N, in) its columns under a row-parallel product; w (out, in) its rows
 * under a column-parallel one, its columns under a row-parallel one; dout
 * (N, out) its columns under a column-parallel one. */
static void mm_operand_split(const Model *m, int kind, int operand, int *rsplit, int *csplit) {
    int split = mm_split(m, kind);
    int in_s = split == SPLIT_IN, out_s = split == SPLIT_OUT;
    *rsplit = (operand == MM_W || operand == MM_WB) && out_s;
    *csplit = operand == MM_D ? out_s : in_s;
}

/* The groups an amax along `axis` is the max over: tp where tp splits the
 * range it covers (a whole tensor's, a row's columns, a column's rows), cp
 * where it runs over a token-row operand's rows; 1, 1 under the test hook
 * testhooks.h's fp8_local_amax (the known bug, each rank scaling by its own
 * part's amax, so that t_fp8.sh shows its tp and cp checks can fail). */
static void mm_groups(const Model *m, int kind, int operand, int axis, int *G, int *Gc) {
    int rsplit, csplit;
    mm_operand_split(m, kind, operand, &rsplit, &csplit);
    int gather = axis == FP8_AXIS_TENSOR ? rsplit || csplit : axis == FP8_AXIS_ROW ? csplit : rsplit;
    int cgather = axis != FP8_AXIS_ROW && mm_token_rows(m, kind, operand);
    *G = gather && !m->fp8_local_amax ? m->tp : 1;
    *Gc = cgather && !m->fp8_local_amax ? m->cp : 1;
}

/* After this rank's amax block `mine` (n) of a (Gc, G) set of blocks is
 * filled: gathered over tp (into its cp rank's G blocks), then over cp. */
static void fp8_gather(Model *m, float *mine, int n, int G, int Gc) {
    int g = G > 1 ? m->tp_rank : 0, gc = Gc > 1 ? m->cp_rank : 0;
    float *tpb = mine - (size_t)g * n, *row = tpb - (size_t)gc * G * n;
    if (G > 1) m->tpc.all_gather_f32(m->tpc.ctx, mine, tpb, (size_t)n);
    if (Gc > 1) m->cpc.all_gather_f32(m->cpc.ctx, tpb, row, (size_t)G * n);
}

/* BLOCK's copy of the ring a forward cast (operand x or w) of history slot
 * `slot` was scaled by, for the active activation set (Model.fp8_snap);
 * NULL for a backward operand or a product of a layer BLOCK keeps whole. */
static float *fp8_snap_of(const Model *m, int slot, int operand) {
    if (!m->fp8_snap || (operand != MM_X && operand != MM_W)) return NULL;
    int per = mm_slots_per_layer(&m->shape), l = slot < m->shape.n_layer * per ? slot / per : -1; /* -1: the head */
    if (!model_layer_recomputed(m, l)) return NULL;
    size_t ring = (size_t)m->fp8.history * m->tp * m->cp;
    size_t i = ((size_t)m->cur_slot * m->fp8_slots + slot) * 2 + (operand == MM_W);
    return m->fp8_snap + i * ring;
}

/* The amaxes the scales of one cast of operand `operand` come from: P rows
 * of n (fp8_amax_len) to take the max over. Current scaling: this cast's
 * own amax, every tp and cp rank's (G, Gc) in scratch half `half` (a cast
 * with both q's and qt's rowwise scales takes both). Delayed scaling
 * (tensorwise): the operand's ring of (history, cp, tp) amaxes, whose row
 * count % history this cast's amax replaces. The first cast of an operand
 * has no history yet and fills its row first (current scaling); every
 * later one is scaled by the history alone and records its own amax after
 * (*late: this rank's entry, for fp8_record), as Transformer Engine's
 * delayed scaling does, so that the cast and the amax can be one pass. */
static const float *fp8_scale_src(Model *m, const void *src, int rows, int cols, int axis, int kind, int slot,
                                  int operand, int half, int *P, float **late) {
    int n = fp8_amax_len(rows, cols, axis), G, Gc;
    mm_groups(m, kind, operand, axis, &G, &Gc);
    int g = G > 1 ? m->tp_rank : 0, gc = Gc > 1 ? m->cp_rank : 0;
    *late = NULL;
    if (m->fp8_hist) { /* tensorwise: n = 1; rows of tp x cp entries, those no rank writes 0 */
        int H = m->fp8.history, S = m->tp * m->cp;
        size_t k = (size_t)slot * MM_OPERANDS + operand;
        float *ring = m->fp8_hist + k * H * S, *mine = ring + (size_t)(m->fp8_count[k] % H) * S + gc * G + g;
        *P = H * S;
        /* BLOCK: a checkpointed layer's forward cast keeps the ring it is
         * scaled by (later casts of the operand, other micro-batches', move
         * the ring on); its recomputation is scaled by that copy and is no
         * cast of the history's */
        float *snap = fp8_snap_of(m, slot, operand);
        if (snap && m->recomputing) return snap;
        if (m->fp8_count[k]++ > 0) {
            *late = mine;
        } else {
            m->be->fp8_amax(mine, src, rows, cols, axis);
            fp8_gather(m, mine, 1, G, Gc);
        }
        if (snap) m->be->copy(snap, ring, (size_t)H * S * sizeof(float));
        return ring;
    }
    float *row = m->fp8_amax + (size_t)half * m->tp * m->cp * m->fp8_amax_n;
    float *mine = row + ((size_t)gc * G + g) * n;
    *P = G * Gc;
    m->be->fp8_amax(mine, src, rows, cols, axis);
    fp8_gather(m, mine, n, G, Gc);
    return row;
}

/* Delayed scaling, after a cast scaled by the history: its amax (`amax`,
 * device, from the cast's own pass; NULL: computed here) into this rank's
 * entry `mine` of the history, then gathered as the operand's amaxes are. */
static void fp8_record(Model *m, float *mine, const float *amax, const void *src, int rows, int cols, int kind,
                       int operand) {
    int G, Gc;
    mm_groups(m, kind, operand, FP8_AXIS_TENSOR, &G, &Gc);
    if (amax) m->be->copy(mine, amax, sizeof(float));
    else m->be->fp8_amax(mine, src, rows, cols, FP8_AXIS_TENSOR);
    fp8_gather(m, mine, 1, G, Gc);
}

/* The checkpoint's form of a ring: its H rows' maxima over their tp and cp
 * entries. A scale only ever reads the max of a whole ring, and a cast
 * replaces a row's every entry it uses, so a ring rebuilt with each row's
 * max in its first entry (0 in the others) scales every later cast alike:
 * the form is exact in the same layout and means the same in any other. */
size_t model_fp8_history_len(const Model *m) {
    return m->fp8_hist ? (size_t)m->fp8_slots * MM_OPERANDS * m->fp8.history : 0;
}
size_t model_fp8_count_len(const Model *m) { return m->fp8_hist ? (size_t)m->fp8_slots * MM_OPERANDS : 0; }

void model_fp8_history_get(const Model *m, float *hist, int64_t *count) {
    size_t n = model_fp8_history_len(m), S = (size_t)m->tp * m->cp;
    if (!n) return;
    float *ring = xmalloc(n * S * sizeof(float));
    if (m->be->host_mem) memcpy(ring, m->fp8_hist, n * S * sizeof(float));
    else m->be->to_host(ring, m->fp8_hist, n * S * sizeof(float));
    for (size_t r = 0; r < n; r++) {
        float a = 0.0f;
        for (size_t e = 0; e < S; e++) a = fmaxf(a, ring[r * S + e]);
        hist[r] = a;
    }
    free(ring);
    memcpy(count, m->fp8_count, model_fp8_count_len(m) * sizeof(int64_t));
}

void model_fp8_history_set(Model *m, const float *hist, const int64_t *count) {
    size_t n = model_fp8_history_len(m), S = (size_t)m->tp * m->cp;
    if (!n) return;
    float *ring = xcalloc(n * S, sizeof(float));
    for (size_t r = 0; r < n; r++) ring[r * S] = hist[r];
    if (m->be->host_mem) memcpy(m->fp8_hist, ring, n * S * sizeof(float));
    else m->be->to_device(m->fp8_hist, ring, n * S * sizeof(float));
    free(ring);
    memcpy(m->fp8_count, count, model_fp8_count_len(m) * sizeof(int64_t));
}

/* Whether history slot `slot` belongs to a routed expert's product. */
static int mm_slot_is_expert(const Model *m, int slot) {
    int per = mm_slots_per_layer(&m->shape);
    return slot < m->shape.n_layer * per && slot % per >= MM_KINDS;
}

int model_fp8_history_merge(const Model *m, const float *hist, const int64_t *count, int same_dp, int same_cp,
                            float *out, int64_t *out_count) {
    int H = m->fp8.history, carried = 0;
    for (int slot = 0; slot < m->fp8_slots; slot++)
        for (int op = 0; op < MM_OPERANDS; op++) {
            size_t k = (size_t)slot * MM_OPERANDS + op;
            if (out_count[k] > 0 || count[k] <= 0) continue;
            if (op != MM_W && op != MM_WB && (!same_dp || (mm_slot_is_expert(m, slot) && !same_cp))) continue;
            memcpy(out + k * H, hist + k * H, (size_t)H * sizeof(float));
            out_count[k] = count[k];
            carried++;
        }
    return carried;
}

/* dst (rows, cols) act = src quantised to fmt with scales along axis
 * (fp8_scale_src says from which amaxes); dst is returned. */
static const void *fp8_cast(Model *m, void *dst, const void *src, int rows, int cols, int axis, int fmt, int kind,
                            int slot, int operand) {
    if (m->fp8.mode == FP8_BF16_OPERANDS) { /* rounded to bf16: no scale, so no amax */
        m->be->fp8_qdq(dst, src, NULL, 0, rows, cols, FP8_AXIS_TENSOR, FP8_BF16, 0);
        return dst;
    }
    int P;
    float *late;
    const float *ring = fp8_scale_src(m, src, rows, cols, axis, kind, slot, operand, 0, &P, &late);
    m->be->fp8_qdq(dst, src, ring, P, rows, cols, axis, fmt, m->fp8.pow2);
    if (late) fp8_record(m, late, NULL, src, rows, cols, kind, operand);
    return dst;
}

/* The real fp8 product (backend.h fp8_cast, fp8_matmul: fp8 tensor cores)
 * where the backend has one: for tensorwise scales, and rowwise where its
 * products take per-row scales (cuBLASLt's outer-vector mode), for shapes
 * it takes (rows a multiple of 16 too: a generation forward's, or a routed
 * expert's, may not be). Else quantise-dequantise and the backend's
 * products, the same numerics. */
static int mm_real(const Model *m, int N) {
    const Backend *be = m->be;
    if (!be->fp8_matmul || N % 16) return 0;
    return m->fp8.mode == FP8_TENSORWISE || (m->fp8.mode == FP8_ROWWISE && be->fp8_rowwise && be->fp8_rowwise());
}

int model_fp8_tensor_cores(const Model *m) { return m->fp8.mode != FP8_OFF && mm_real(m, 0); }

const char *model_fp8_products(const Model *m) {
    if (model_fp8_tensor_cores(m))
        return m->fp8.mode == FP8_ROWWISE ? "fp8 tensor-core products (per-row scales: cuBLASLt's outer-vector mode)"
                                          : "fp8 tensor-core products";
    if (m->fp8.mode == FP8_BF16_OPERANDS) return "operands rounded to bf16 (no scale), products in fp32";
    if (m->be->fp8_matmul)
        return "quantised operands, products in the activation dtype (this GPU or cuBLASLt has no per-row fp8 "
               "scales: Hopper and cuBLAS 12.9 or later)";
    return "quantised operands, products in the activation dtype";
}

/* The codes of one operand src (rows, cols) in one pass (backend.h
 * Fp8Cast): q (rows, cols) scaled along the rows of src and/or qt (cols,
 * rows) along its columns (rowwise), or both by one scale (tensorwise), with
 * their inverse scales inv_q, inv_t; the amaxes as fp8_cast's. */
typedef struct {
    uint8_t *q, *qt;
    float *inv_q, *inv_t;
} Fp8Codes;
static void fp8_codes(Model *m, Fp8Codes o, const void *src, int rows, int cols, int fmt, int kind, int slot,
                      int operand) {
    Fp8Cast c = {.q = o.q, .qt = o.qt, .inv_q = o.inv_q, .inv_t = o.inv_t, .fmt = fmt, .pow2 = m->fp8.pow2};
    float *late = NULL;
    if (m->fp8.mode == FP8_ROWWISE) {
        c.rowwise = 1;
        if (o.q) c.amax_q = fp8_scale_src(m, src, rows, cols, FP8_AXIS_ROW, kind, slot, operand, 0, &c.P_q, &late);
        if (o.qt) c.amax_t = fp8_scale_src(m, src, rows, cols, FP8_AXIS_COL, kind, slot, operand, 1, &c.P_t, &late);
    } else {
        c.amax_q = fp8_scale_src(m, src, rows, cols, FP8_AXIS_TENSOR, kind, slot, operand, 0, &c.P_q, &late);
        if (late) c.amax_out = fp8_inv(m, FP8_INVS); /* the cast's own amax, recorded below */
    }
    m->be->fp8_cast(&c, src, rows, cols);
    if (late) fp8_record(m, late, c.amax_out, src, rows, cols, kind, operand);
}

/* A product larger than model_fp8_plan's buffers is a bug of the plan. */
static void fp8_fits(const Model *m, int N, int C, int OC) {
    size_t n = (size_t)N, c = (size_t)C, oc = (size_t)OC;
    if (n * c > m->fp8_cap[0] || oc * c > m->fp8_cap[1] || n * oc > m->fp8_cap[2] ||
        (n > m->fp8_amax_n || c > m->fp8_amax_n || oc > m->fp8_amax_n))
        kiln_fail(KILN_EXIT_RUNTIME, "fp8: a %d x %d x %d product is past the operand buffers planned (%zu, %zu, %zu "
                  "elements, %zu amaxes)", N, C, OC, m->fp8_cap[0], m->fp8_cap[1], m->fp8_cap[2], m->fp8_amax_n);
}

void model_mm_forward(Model *m, int l, int kind, int e, void *out, const void *inp, const void *w, const void *bias,
                      int N, int C, int OC) {
    if (!mm_is_fp8(&m->fp8, kind)) {
        m->be->matmul_forward(out, inp, w, bias, N, C, OC);
        return;
    }
    fp8_fits(m, N, C, OC);
    int slot = mm_history_slot(m, l, kind, e);
    if (mm_real(m, N)) { /* out^T = w x^T: a = w (OC, C), b = x (N, C), both K-major as they are */
        fp8_codes(m, (Fp8Codes){.q = m->fp8_qx, .inv_q = fp8_inv(m, INV_X)}, inp, N, C, FP8_E4M3, kind, slot, MM_X);
        fp8_codes(m, (Fp8Codes){.q = m->fp8_qw, .inv_q = fp8_inv(m, INV_W)}, w, OC, C, FP8_E4M3, kind, slot, MM_W);
        m->be->fp8_matmul(&(Fp8Matmul){.out = out, .a = m->fp8_qw, .b = m->fp8_qx, .sa = fp8_inv(m, INV_W),
                                       .sb = fp8_inv(m, INV_X), .fmt_a = FP8_E4M3, .fmt_b = FP8_E4M3,
                                       .rowwise = m->fp8.mode == FP8_ROWWISE, .bias = bias, .N = N, .K = C, .M = OC});
        return;
    }
    int axis = m->fp8.mode == FP8_ROWWISE ? FP8_AXIS_ROW : FP8_AXIS_TENSOR; /* both along C, the contraction */
    const void *qx = fp8_cast(m, m->fp8_qx, inp, N, C, axis, FP8_E4M3, kind, slot, MM_X);
    const void *qw = fp8_cast(m, m->fp8_qw, w, OC, C, axis, FP8_E4M3, kind, slot, MM_W);
    m->be->matmul_forward(out, qx, qw, bias, N, C, OC);
}

/* model_mm_backward on the fp8 tensor cores. dout's codes for both
 * products come from one cast: (N, OC) for dinp^T = w^T dout^T, contracting
 * over OC (a = w^T (C, OC), cast transposed), and (OC, N) for dW^T = x^T
 * dout, contracting over N (a = x^T (C, N), b = dout^T (OC, N)). */
static void mm_backward_real(Model *m, int kind, int slot, void *dinp, float *dw, float *dbias, const void *dout,
                             const void *inp, const void *w, int N, int C, int OC, int accumulate) {
    const Backend *be = m->be;
    int g = m->fp8.grad_fmt, rowwise = m->fp8.mode == FP8_ROWWISE;
    float *fp8_dw = m->fp8.wgrad ? dw : NULL;
    uint8_t *qd = m->fp8_qd, *qdt = qd + (size_t)N * OC;
    if (dinp || fp8_dw)
        fp8_codes(m, (Fp8Codes){.q = dinp ? qd : NULL, .qt = fp8_dw ? qdt : NULL, .inv_q = fp8_inv(m, INV_D),
                                .inv_t = fp8_inv(m, INV_DT)}, dout, N, OC, g, kind, slot, MM_D);
    if (dinp) {
        fp8_codes(m, (Fp8Codes){.qt = m->fp8_qw, .inv_t = fp8_inv(m, INV_WT)}, w, OC, C, FP8_E4M3, kind, slot, MM_WB);
        be->fp8_matmul(&(Fp8Matmul){.out = dinp, .a = m->fp8_qw, .b = qd, .sa = fp8_inv(m, INV_WT),
                                    .sb = fp8_inv(m, INV_D), .fmt_a = FP8_E4M3, .fmt_b = g, .rowwise = rowwise, .N = N,
                                    .K = OC, .M = C});
    }
    if (fp8_dw) {
        fp8_codes(m, (Fp8Codes){.qt = m->fp8_qx, .inv_t = fp8_inv(m, INV_XT)}, inp, N, C, FP8_E4M3, kind, slot, MM_XB);
        be->fp8_matmul(&(Fp8Matmul){.out = dw, .a = m->fp8_qx, .b = qdt, .sa = fp8_inv(m, INV_XT),
                                    .sb = fp8_inv(m, INV_DT), .fmt_a = FP8_E4M3, .fmt_b = g, .rowwise = rowwise,
                                    .out_f32 = 1, .accumulate = accumulate, .N = OC, .K = N, .M = C});
    }
    /* the bias gradient is a sum, not a product: from the unquantised dout, as dW with fp8_wgrad: bf16 */
    if (dbias || (dw && !fp8_dw))
        be->matmul_backward(NULL, fp8_dw ? NULL : dw, dbias, dout, inp, w, N, C, OC, accumulate);
}

/* dinp = dout @ w contracts over OC: rowwise scales dout per row and w per
 * column. dw = dout^T inp contracts over N: both per column. The bias
 * gradient is a sum, not a product: always from the unquantised dout. */
void model_mm_backward(Model *m, int l, int kind, int e, void *dinp, float *dw, float *dbias, const void *dout,
                       const void *inp, const void *w, int N, int C, int OC, int accumulate) {
    const Backend *be = m->be;
    if (!mm_is_fp8(&m->fp8, kind)) {
        be->matmul_backward(dinp, dw, dbias, dout, inp, w, N, C, OC, accumulate);
        return;
    }
    fp8_fits(m, N, C, OC);
    int slot = mm_history_slot(m, l, kind, e), g = m->fp8.grad_fmt;
    if (mm_real(m, N)) {
        mm_backward_real(m, kind, slot, dinp, dw, dbias, dout, inp, w, N, C, OC, accumulate);
        return;
    }
    int rowwise = m->fp8.mode == FP8_ROWWISE;
    const void *qd = NULL;
    if (dinp) {
        qd = fp8_cast(m, m->fp8_qd, dout, N, OC, rowwise ? FP8_AXIS_ROW : FP8_AXIS_TENSOR, g, kind, slot, MM_D);
        const void *qw = fp8_cast(m, m->fp8_qw, w, OC, C, rowwise ? FP8_AXIS_COL : FP8_AXIS_TENSOR, FP8_E4M3, kind,
                                  slot, MM_WB);
        be->matmul_backward(dinp, NULL, NULL, qd, NULL, qw, N, C, OC, accumulate);
    }
    if (!dw && !dbias) return;
    /* bf16 operands stand in for bf16 compute, whose weight-gradient product takes bf16 operands too */
    if (!(m->fp8.wgrad || m->fp8.mode == FP8_BF16_OPERANDS) || !dw) {
        be->matmul_backward(NULL, dw, dbias, dout, inp, w, N, C, OC, accumulate);
        return;
    }
    /* tensorwise: the dinp cast's dout serves; rowwise (or a split
     * backward's weight part): dout cast along its columns */
    if (rowwise || !qd)
        qd = fp8_cast(m, m->fp8_qd, dout, N, OC, rowwise ? FP8_AXIS_COL : FP8_AXIS_TENSOR, g, kind, slot, MM_D);
    const void *qx = fp8_cast(m, m->fp8_qx, inp, N, C, rowwise ? FP8_AXIS_COL : FP8_AXIS_TENSOR, FP8_E4M3, kind, slot,
                              MM_XB);
    be->matmul_backward(NULL, dw, NULL, qd, qx, w, N, C, OC, accumulate);
    if (dbias) be->matmul_backward(NULL, NULL, dbias, dout, inp, w, N, C, OC, accumulate);
}
