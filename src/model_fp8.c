/* model_fp8: the block's matrix products with fp8 operands (precision.fp8;
 * docs/precision.md). Each operand is quantised onto the fp8 grid with a
 * scale from its amax (backend.h fp8_amax, fp8_qdq), then multiplied by the
 * backend's matmul; the amax is reduced over the tp ranks (ModelTp) exactly
 * where tp splits the range it covers, so every tp layout scales as one rank
 * does. Never communicates but through the model's tp hooks. */
#include <stdlib.h>
#include <string.h>

#include "fp8.h"
#include "model.h"
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
static int mm_is_fp8(const Model *m, int kind) { return m->fp8.mode != FP8_OFF && (kind != MM_HEAD || m->fp8.head); }

/* (in, out) widths of product `kind` (local shapes). */
static void mm_dims(const Model *m, int kind, int *in, int *out) {
    const ArchSpec *s = &m->shape;
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
static int mm_exists(const Model *m, int kind) {
    const ArchSpec *s = &m->shape;
    int moe = s->mlp == MLP_MOE;
    switch (kind) {
    case MM_FC: case MM_DOWN: return !moe;
    case MM_SHARED_GATE: case MM_SHARED_DOWN: return moe && s->moe.n_shared > 0;
    case MM_EXPERT_GATE: case MM_EXPERT_DOWN: return moe;
    default: return 1;
    }
}

static int mm_history_slot(const Model *m, int l, int kind, int e) {
    int per = MM_KINDS + 2 * m->shape.moe.n_experts;
    if (kind == MM_HEAD) return m->shape.n_layer * per;
    return l * per + (kind < MM_KINDS ? kind : MM_KINDS + 2 * e + (kind - MM_EXPERT_GATE));
}

void model_fp8_check(Model *m) {
    if (m->fp8.mode == FP8_OFF) return;
    if (!m->be->fp8_amax || !m->be->fp8_qdq)
        kiln_fail(KILN_EXIT_USAGE, "key 'precision.fp8': the %s backend has no fp8 operations; set precision.fp8: off",
                  m->be->name);
    /* a device backend's fp8 products store bf16; an fp32 run has nothing to gain */
    if (!m->be->host_mem && m->act_bytes == 4)
        kiln_fail(KILN_EXIT_USAGE, "keys 'precision.fp8', 'precision.compute': fp8 products need precision.compute: "
                  "bf16 on %s, got fp32; set precision.fp8: off or precision.compute: bf16", m->be->name);
    for (int kind = 0; kind <= MM_HEAD; kind++) {
        if (!mm_exists(m, kind) || !mm_is_fp8(m, kind)) continue;
        int in, out, role = mm_role(m, kind), i = -1;
        mm_dims(m, kind, &in, &out);
        if (in % 16 == 0 && out % 16 == 0) continue;
        int e = kind == MM_EXPERT_GATE || kind == MM_EXPERT_DOWN ? 0 : -1;
        for (int l = kind == MM_HEAD ? -1 : 0; l < m->shape.n_layer && i < 0; l++)
            i = model_tensor_index(m, l, role, e);
        kiln_fail(KILN_EXIT_USAGE, "key 'precision.fp8': tensor '%s' makes a product of %d inputs and %d outputs%s, "
                  "not multiples of 16 as fp8 matrix products need; set precision.fp8: off or resize the model",
                  i >= 0 ? m->params[i].name : "?", in, out, m->tp > 1 ? " (this tp rank's part)" : "");
    }
    int per = MM_KINDS + 2 * m->shape.moe.n_experts;
    m->fp8_slots = m->shape.n_layer * per + 1;
}

void model_fp8_plan(Model *m, int N) {
    if (m->fp8.mode == FP8_OFF) return;
    model_fp8_free(m);
    size_t x = 0, w = 0, d = 0, n = (size_t)N;
    for (int kind = 0; kind <= MM_HEAD; kind++) {
        if (!mm_exists(m, kind) || !mm_is_fp8(m, kind)) continue;
        int in, out;
        mm_dims(m, kind, &in, &out);
        x = x > n * in ? x : n * in;
        w = w > (size_t)out * in ? w : (size_t)out * in;
        d = d > n * out ? d : n * out;
        n = n > (size_t)in ? n : (size_t)in;
        n = n > (size_t)out ? n : (size_t)out;
    }
    m->fp8_qx = m->be->alloc(x * m->act_bytes);
    m->fp8_qw = m->be->alloc(w * m->act_bytes);
    m->fp8_qd = m->be->alloc(d * m->act_bytes);
    m->fp8_amax_n = n;
    m->fp8_local_amax = getenv("KILN_TEST_FP8_LOCAL_AMAX") != NULL;
    m->fp8_amax = m->be->alloc((size_t)m->tp * m->cp * n * sizeof(float));
    m->fp8_inv = m->be->alloc(4 * sizeof(float));
    size_t h = (size_t)m->fp8_slots * MM_OPERANDS;
    if (m->fp8.history > 0) {
        m->fp8_hist = m->be->alloc(h * m->fp8.history * m->tp * m->cp * sizeof(float));
        m->fp8_count = xcalloc(h, sizeof(int64_t));
    }
}

void model_fp8_free(Model *m) {
    void **bufs[] = {&m->fp8_qx, &m->fp8_qw, &m->fp8_qd, (void **)&m->fp8_amax, (void **)&m->fp8_hist,
                     (void **)&m->fp8_inv};
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

/* The amax scratch of one cast: G tp x Gc cp blocks of n, this rank's at
 * (cp_rank G + tp_rank) n; with a history the operand's ring of (history,
 * Gc, G) blocks, this cast's row the next. *P gets the blocks the cast
 * takes the max of. Then fills this rank's block (the backend's amax) and
 * gathers over tp, then over cp (as one block of G n). */
static float *fp8_amax_ring(Model *m, const void *src, int rows, int cols, int axis, int n, int G, int Gc, int slot,
                            int operand, int *P) {
    int g = G > 1 ? m->tp_rank : 0, gc = Gc > 1 ? m->cp_rank : 0;
    float *ring = m->fp8_amax, *row = ring;
    *P = G * Gc;
    if (m->fp8_hist) { /* tensorwise: n = 1 */
        int H = m->fp8.history;
        size_t k = (size_t)slot * MM_OPERANDS + operand;
        ring = m->fp8_hist + k * H * m->tp * m->cp;
        row = ring + (size_t)(m->fp8_count[k] % H) * G * Gc;
        m->fp8_count[k]++;
        *P = H * G * Gc;
    }
    float *mine = row + ((size_t)gc * G + g) * n, *tpb = row + (size_t)gc * G * n;
    m->be->fp8_amax(mine, src, rows, cols, axis);
    if (G > 1) m->tpc.all_gather_f32(m->tpc.ctx, mine, tpb, (size_t)n);
    if (Gc > 1) m->cpc.all_gather_f32(m->cpc.ctx, tpb, row, (size_t)G * n);
    return ring;
}

size_t model_fp8_history_len(const Model *m) {
    return m->fp8_hist ? (size_t)m->fp8_slots * MM_OPERANDS * m->fp8.history * m->tp * m->cp : 0;
}
size_t model_fp8_count_len(const Model *m) { return m->fp8_hist ? (size_t)m->fp8_slots * MM_OPERANDS : 0; }

void model_fp8_history_get(const Model *m, float *hist, int64_t *count) {
    size_t n = model_fp8_history_len(m);
    if (!n) return;
    if (m->be->host_mem) memcpy(hist, m->fp8_hist, n * sizeof(float));
    else m->be->to_host(hist, m->fp8_hist, n * sizeof(float));
    memcpy(count, m->fp8_count, model_fp8_count_len(m) * sizeof(int64_t));
}

void model_fp8_history_set(Model *m, const float *hist, const int64_t *count) {
    size_t n = model_fp8_history_len(m);
    if (!n) return;
    if (m->be->host_mem) memcpy(m->fp8_hist, hist, n * sizeof(float));
    else m->be->to_device(m->fp8_hist, hist, n * sizeof(float));
    memcpy(m->fp8_count, count, model_fp8_count_len(m) * sizeof(int64_t));
}

/* dst (rows, cols) act = src quantised to fmt with scales along axis.
 * rsplit, csplit: tp splits the matrix's rows, columns, so an amax whose
 * range covers a split dimension is the max over the tp ranks (gathered, and
 * the cast takes the max of the rows); an amax over a token-row operand's
 * rows (tensorwise, or per column) is the max over the cp ranks too. With a
 * history the operand's amax takes the next row of its (history, cp, tp)
 * ring, and the scale comes from the max of the whole ring, this cast's
 * amax included. */
static const void *fp8_cast(Model *m, void *dst, const void *src, int rows, int cols, int axis, int fmt, int rsplit,
                            int csplit, int kind, int slot, int operand) {
    int n = fp8_amax_len(rows, cols, axis);
    int gather = axis == FP8_AXIS_TENSOR ? rsplit || csplit : axis == FP8_AXIS_ROW ? csplit : rsplit;
    int cgather = axis != FP8_AXIS_ROW && mm_token_rows(m, kind, operand);
    /* test hook (docs/metrics.md): the known bug, each rank scaling by its own
     * part's amax, so that t_fp8.sh shows its tp and cp checks can fail */
    if (m->fp8_local_amax) gather = cgather = 0;
    int P;
    const float *ring = fp8_amax_ring(m, src, rows, cols, axis, n, gather ? m->tp : 1, cgather ? m->cp : 1, slot,
                                      operand, &P);
    m->be->fp8_qdq(dst, src, ring, P, rows, cols, axis, fmt, m->fp8.pow2);
    return dst;
}

/* The real fp8 product (backend.h fp8_cast, fp8_matmul: fp8 tensor cores)
 * where the backend has one, for tensorwise scales and shapes it takes
 * (rows a multiple of 16 too: a generation forward's may not be); fp8
 * weight gradients stay on the quantise-dequantise path. */
static int mm_real(const Model *m, int N) {
    return m->be->fp8_matmul && m->fp8.mode == FP8_TENSORWISE && N % 16 == 0;
}

/* As fp8_cast above, into codes: q (rows, cols) or transposed; inv (1) = 1 / scale. */
static void fp8_cast_codes(Model *m, uint8_t *q, float *inv, const void *src, int rows, int cols, int fmt, int split,
                           int kind, int slot, int operand, int transpose) {
    int G = split && !m->fp8_local_amax ? m->tp : 1;
    int Gc = mm_token_rows(m, kind, operand) && !m->fp8_local_amax ? m->cp : 1, P;
    const float *ring = fp8_amax_ring(m, src, rows, cols, FP8_AXIS_TENSOR, 1, G, Gc, slot, operand, &P);
    m->be->fp8_cast(q, inv, src, ring, P, rows, cols, fmt, m->fp8.pow2, transpose);
}

void model_mm_forward(Model *m, int l, int kind, int e, void *out, const void *inp, const void *w, const void *bias,
                      int N, int C, int OC) {
    if (!mm_is_fp8(m, kind)) {
        m->be->matmul_forward(out, inp, w, bias, N, C, OC);
        return;
    }
    int split = mm_split(m, kind), slot = mm_history_slot(m, l, kind, e);
    if (mm_real(m, N)) {
        fp8_cast_codes(m, m->fp8_qx, m->fp8_inv, inp, N, C, FP8_E4M3, split == SPLIT_IN, kind, slot, MM_X, 0);
        fp8_cast_codes(m, m->fp8_qw, m->fp8_inv + 1, w, OC, C, FP8_E4M3, split != SPLIT_NONE, kind, slot, MM_W, 0);
        m->be->fp8_matmul(out, m->fp8_qw, m->fp8_qx, m->fp8_inv + 1, m->fp8_inv, FP8_E4M3, FP8_E4M3, bias, N, C, OC);
        return;
    }
    int axis = m->fp8.mode == FP8_ROWWISE ? FP8_AXIS_ROW : FP8_AXIS_TENSOR; /* both along C, the contraction */
    const void *qx = fp8_cast(m, m->fp8_qx, inp, N, C, axis, FP8_E4M3, 0, split == SPLIT_IN, kind, slot, MM_X);
    const void *qw = fp8_cast(m, m->fp8_qw, w, OC, C, axis, FP8_E4M3, split == SPLIT_OUT, split == SPLIT_IN, kind, slot,
                              MM_W);
    m->be->matmul_forward(out, qx, qw, bias, N, C, OC);
}

/* dinp = dout @ w contracts over OC: rowwise scales dout per row and w per
 * column. dw = dout^T inp contracts over N: both per column. The bias
 * gradient is a sum, not a product: always from the unquantised dout. */
void model_mm_backward(Model *m, int l, int kind, int e, void *dinp, float *dw, float *dbias, const void *dout,
                       const void *inp, const void *w, int N, int C, int OC, int accumulate) {
    const Backend *be = m->be;
    if (!mm_is_fp8(m, kind)) {
        be->matmul_backward(dinp, dw, dbias, dout, inp, w, N, C, OC, accumulate);
        return;
    }
    int split = mm_split(m, kind), slot = mm_history_slot(m, l, kind, e), g = m->fp8.grad_fmt;
    int rowwise = m->fp8.mode == FP8_ROWWISE;
    int in_s = split == SPLIT_IN, out_s = split == SPLIT_OUT;
    const void *qd = NULL;
    if (dinp && mm_real(m, N) && !m->fp8.wgrad) {
        /* dinp (N,C) = dout (N,OC) @ w: TN with a = w^T (C, OC), b = dout (N, OC) */
        fp8_cast_codes(m, m->fp8_qd, m->fp8_inv + 2, dout, N, OC, g, out_s, kind, slot, MM_D, 0);
        fp8_cast_codes(m, m->fp8_qw, m->fp8_inv + 3, w, OC, C, FP8_E4M3, split != SPLIT_NONE, kind, slot, MM_WB, 1);
        be->fp8_matmul(dinp, m->fp8_qw, m->fp8_qd, m->fp8_inv + 3, m->fp8_inv + 2, FP8_E4M3, g, NULL, N, OC, C);
        dinp = NULL;
    }
    if (dinp) {
        qd = fp8_cast(m, m->fp8_qd, dout, N, OC, rowwise ? FP8_AXIS_ROW : FP8_AXIS_TENSOR, g, 0, out_s, kind, slot, MM_D);
        const void *qw = fp8_cast(m, m->fp8_qw, w, OC, C, rowwise ? FP8_AXIS_COL : FP8_AXIS_TENSOR, FP8_E4M3, out_s,
                                  in_s, kind, slot, MM_WB);
        be->matmul_backward(dinp, NULL, NULL, qd, NULL, qw, N, C, OC, accumulate);
    }
    if (!dw && !dbias) return;
    if (!m->fp8.wgrad || !dw) {
        be->matmul_backward(NULL, dw, dbias, dout, inp, w, N, C, OC, accumulate);
        return;
    }
    /* tensorwise: the dinp cast's dout serves; rowwise (or a split
     * backward's weight part): dout cast along its columns */
    if (rowwise || !qd)
        qd = fp8_cast(m, m->fp8_qd, dout, N, OC, rowwise ? FP8_AXIS_COL : FP8_AXIS_TENSOR, g, 0, out_s, kind, slot, MM_D);
    const void *qx = fp8_cast(m, m->fp8_qx, inp, N, C, rowwise ? FP8_AXIS_COL : FP8_AXIS_TENSOR, FP8_E4M3, 0, in_s,
                              kind, slot, MM_XB);
    be->matmul_backward(NULL, dw, NULL, qd, qx, w, N, C, OC, accumulate);
    if (dbias) be->matmul_backward(NULL, NULL, dbias, dout, inp, w, N, C, OC, accumulate);
}
