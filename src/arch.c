/* arch: the spec's constraints, its tensor table and its counts. Everything
 * that knows which tensors an architecture has lives here, so the model,
 * ZeRO, checkpoints, the plan and interop read one table. Never allocates
 * tensors or touches a backend. */
#include "arch.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "util.h"

static int parse_enum(const char *key, const char *s, const char *const *names, int n) {
    for (int i = 0; i < n; i++)
        if (strcmp(s, names[i]) == 0) return i;
    char all[128] = "";
    for (int i = 0; i < n; i++) {
        strncat(all, names[i], sizeof all - strlen(all) - 1);
        if (i + 1 < n) strncat(all, ", ", sizeof all - strlen(all) - 1);
    }
    kiln_fail(KILN_EXIT_USAGE, "key '%s': expected one of %s, got '%s'", key, all, s);
}

static const char *const family_names[] = {"gpt2", "llama"};
static const char *const norm_names[] = {"layernorm", "rmsnorm"};
static const char *const pos_names[] = {"learned", "rope"};
static const char *const mlp_names[] = {"gelu", "swiglu", "moe"};
static const char *const qk_names[] = {"none", "head", "full"};

ArchFamily arch_family_parse(const char *s) { return (ArchFamily)parse_enum("model.arch", s, family_names, 2); }
ArchNorm arch_norm_parse(const char *s) { return (ArchNorm)parse_enum("model.norm", s, norm_names, 2); }
ArchPos arch_pos_parse(const char *s) { return (ArchPos)parse_enum("model.pos", s, pos_names, 2); }
ArchMlp arch_mlp_parse(const char *s) { return (ArchMlp)parse_enum("model.mlp", s, mlp_names, 3); }
ArchQkNorm arch_qk_norm_parse(const char *s) { return (ArchQkNorm)parse_enum("model.qk_norm", s, qk_names, 3); }
const char *arch_family_name(ArchFamily f) { return f >= 0 && f < 2 ? family_names[f] : "?"; }
const char *arch_mlp_name(ArchMlp m) { return m >= 0 && m < 3 ? mlp_names[m] : "?"; }

/* Llama's SwiGLU width: 2/3 of 4C, rounded up to a multiple of 256. */
static int llama_ffn(int C) { return ((8 * C / 3) + 255) / 256 * 256; }

void arch_resolve(ArchSpec *s) {
    if (s->n_layer < 1 || s->n_head < 1 || s->n_embd < 1 || s->seq_len < 1 || s->vocab_size < 2)
        kiln_fail(KILN_EXIT_USAGE, "model: sizes must be positive (n_layer=%d n_head=%d n_embd=%d seq_len=%d vocab_size=%d)",
                  s->n_layer, s->n_head, s->n_embd, s->seq_len, s->vocab_size);
    if (s->n_kv_head == 0) s->n_kv_head = s->n_head;
    if (s->n_kv_head < 1 || s->n_head % s->n_kv_head)
        kiln_fail(KILN_EXIT_USAGE, "key 'model.n_kv_head': %d does not divide model.n_head = %d", s->n_kv_head,
                  s->n_head);
    if (s->head_dim == 0) {
        if (s->n_embd % s->n_head)
            kiln_fail(KILN_EXIT_USAGE, "key 'model.n_embd': %d is not divisible by model.n_head = %d (or set "
                      "model.head_dim)", s->n_embd, s->n_head);
        s->head_dim = s->n_embd / s->n_head;
    }
    if (s->head_dim < 1)
        kiln_fail(KILN_EXIT_USAGE, "key 'model.head_dim': expected a positive number, got %d", s->head_dim);
    if (s->pos == POS_ROPE && s->head_dim % 2)
        kiln_fail(KILN_EXIT_USAGE, "key 'model.head_dim': RoPE rotates pairs, so %d must be even", s->head_dim);
    if (s->family == ARCH_GPT2 && s->n_kv_head != s->n_head)
        kiln_fail(KILN_EXIT_USAGE, "key 'model.n_kv_head': gpt2's fused c_attn has n_head kv heads; use model.arch: "
                  "llama for grouped-query attention");
    if (s->norm_eps <= 0) s->norm_eps = 1e-5f;
    if (s->pos == POS_ROPE && !(s->rope_theta > 1))
        kiln_fail(KILN_EXIT_USAGE, "key 'model.rope_theta': expected a number > 1, got %g", s->rope_theta);
    const ArchRopeScaling *r = &s->rope_scaling;
    if (r->on && (!(r->factor >= 1) || !(r->low_freq_factor > 0) || !(r->high_freq_factor > r->low_freq_factor) ||
                  r->original_context < 1))
        kiln_fail(KILN_EXIT_USAGE, "key 'model.rope_scaling': needs factor >= 1, low_freq_factor > 0, "
                  "high_freq_factor > low_freq_factor and original_context >= 1 (got %g, %g, %g, %d)",
                  r->factor, r->low_freq_factor, r->high_freq_factor, r->original_context);
    if (r->on && s->pos != POS_ROPE)
        kiln_fail(KILN_EXIT_USAGE, "key 'model.rope_scaling': applies to model.pos: rope only");
    if (s->qk_norm == QKNORM_FULL && s->family == ARCH_GPT2)
        kiln_fail(KILN_EXIT_USAGE, "key 'model.qk_norm': full needs model.arch: llama");
    if (s->ffn_hidden == 0) s->ffn_hidden = s->mlp == MLP_GELU ? 4 * s->n_embd : llama_ffn(s->n_embd);
    if (s->ffn_hidden < 1)
        kiln_fail(KILN_EXIT_USAGE, "key 'model.ffn_hidden': expected a positive number, got %d", s->ffn_hidden);
    ArchMoe *m = &s->moe;
    if (s->mlp == MLP_MOE) {
        if (s->family == ARCH_GPT2)
            kiln_fail(KILN_EXIT_USAGE, "key 'model.mlp': moe needs model.arch: llama (its experts are SwiGLU)");
        if (m->n_experts < 1)
            kiln_fail(KILN_EXIT_USAGE, "key 'model.moe.n_experts': expected at least 1 expert, got %d", m->n_experts);
        if (m->top_k < 1 || m->top_k > m->n_experts)
            kiln_fail(KILN_EXIT_USAGE, "key 'model.moe.top_k': %d must be between 1 and model.moe.n_experts = %d",
                      m->top_k, m->n_experts);
        if (m->expert_hidden == 0) m->expert_hidden = s->ffn_hidden;
        if (m->n_shared < 0 || m->expert_hidden < 1)
            kiln_fail(KILN_EXIT_USAGE, "key 'model.moe.expert_hidden': expected a positive width, got %d",
                      m->expert_hidden);
        if (m->capacity_factor < 0 || m->aux_loss_coef < 0 || m->z_loss_coef < 0 || m->bias_update_rate < 0)
            kiln_fail(KILN_EXIT_USAGE, "key 'model.moe': capacity_factor, aux_loss_coef, z_loss_coef and "
                      "bias_update_rate must be >= 0");
        if (m->sigmoid) m->norm_topk = 1; /* sigmoid scores do not sum to one: always renormalised */
    }
    /* Padding the vocabulary to a multiple of 64 keeps the head's matrix
     * products on aligned, vector-friendly sizes (GPT-2: 50257 -> 50304). */
    s->padded_vocab = (s->vocab_size + 63) / 64 * 64;
}

/* "auto" takes the preset's value; "true"/"false" and named values their own. */
static int tri(const char *v, int preset) { return !strcmp(v, "auto") ? preset : !strcmp(v, "true"); }

void arch_from_config(const Config *c, ArchSpec *s) {
    memset(s, 0, sizeof *s);
    s->family = arch_family_parse(c->arch);
    int llama = s->family == ARCH_LLAMA;
    s->n_layer = c->n_layer, s->n_head = c->n_head, s->n_kv_head = c->n_kv_head, s->head_dim = c->head_dim;
    s->n_embd = c->n_embd, s->seq_len = c->seq_len, s->vocab_size = c->vocab_size, s->ffn_hidden = c->ffn_hidden;
    s->norm = strcmp(c->norm, "auto") ? arch_norm_parse(c->norm) : llama ? NORM_RMSNORM : NORM_LAYERNORM;
    s->norm_eps = c->norm_eps;
    s->pos = strcmp(c->pos, "auto") ? arch_pos_parse(c->pos) : llama ? POS_ROPE : POS_LEARNED;
    s->rope_theta = c->rope_theta;
    s->rope_scaling = (ArchRopeScaling){c->rope_factor > 0, c->rope_factor, c->rope_low, c->rope_high, c->rope_orig};
    s->qk_norm = arch_qk_norm_parse(c->qk_norm);
    s->mlp = strcmp(c->mlp, "auto") ? arch_mlp_parse(c->mlp) : llama ? MLP_SWIGLU : MLP_GELU;
    s->bias = tri(c->bias, !llama);
    s->tie_embeddings = tri(c->tie_embeddings, !llama);
    s->moe = (ArchMoe){.n_experts = c->moe_experts, .top_k = c->moe_top_k, .n_shared = c->moe_shared,
                       .expert_hidden = c->moe_hidden, .sigmoid = !strcmp(c->moe_router, "sigmoid"),
                       .norm_topk = !strcmp(c->moe_norm_topk, "true"), .capacity_factor = c->moe_capacity,
                       .aux_loss_coef = c->moe_aux, .z_loss_coef = c->moe_z, .bias_update_rate = c->moe_bias_rate};
    arch_resolve(s);
}

int arch_moe_capacity(const ArchSpec *s, int T) {
    if (s->mlp != MLP_MOE || s->moe.capacity_factor <= 0) return 0;
    double cap = ceil((double)s->moe.capacity_factor * T * s->moe.top_k / s->moe.n_experts);
    return cap < 1 ? 1 : (int)cap;
}

/* ------------------------------------------------------------ the table */

typedef struct TableBuilder {
    ArchTensor *t;
    int n, cap;
    int layer, expert;
    const char *prefix;
} TableBuilder;

static void add(TableBuilder *b, const char *name, int role, int d0, int d1, int init, int decay, int follows) {
    if (b->n == b->cap) {
        b->cap = b->cap ? 2 * b->cap : 64;
        b->t = xrealloc(b->t, (size_t)b->cap * sizeof(ArchTensor));
    }
    ArchTensor *t = &b->t[b->n++];
    memset(t, 0, sizeof *t);
    /* prefix + name, cut to the field (a copy, not snprintf: the planner's
     * search builds these tables thousands of times) */
    size_t np = strlen(b->prefix), nn = strlen(name), cap = sizeof t->name - 1;
    if (np > cap) np = cap;
    if (nn > cap - np) nn = cap - np;
    memcpy(t->name, b->prefix, np);
    memcpy(t->name + np, name, nn);
    t->name[np + nn] = '\0';
    t->layer = b->layer;
    t->role = role;
    t->expert = b->expert;
    t->ndim = d1 > 0 ? 2 : 1;
    t->shape[0] = d0;
    t->shape[1] = d1 > 0 ? d1 : 0;
    t->numel = (size_t)d0 * (size_t)(d1 > 0 ? d1 : 1);
    t->init = init;
    t->decay = decay;
    t->follows = follows;
    t->trained = role != ROLE_ROUTER_BIAS;
}

static void add_norm(TableBuilder *b, const ArchSpec *s, const char *w, const char *bias, int role_w, int role_b,
                     int C) {
    add(b, w, role_w, C, 0, INIT_ONES, 0, 0);
    if (s->bias && s->norm == NORM_LAYERNORM) add(b, bias, role_b, C, 0, INIT_ZEROS, 0, 0);
}

/* GPT-2's names (llm.c's and HF GPT2Model's without the transformer. prefix). */
static void gpt2_layer(TableBuilder *b, const ArchSpec *s) {
    int C = s->n_embd, QKV = arch_qkv_width(s), Q = arch_q_width(s), F = s->ffn_hidden;
    add_norm(b, s, "ln_1.weight", "ln_1.bias", ROLE_ATTN_NORM_W, ROLE_ATTN_NORM_B, C);
    add(b, "attn.c_attn.weight", ROLE_QKV_W, QKV, C, INIT_NORMAL, 1, 0);
    if (s->bias) add(b, "attn.c_attn.bias", ROLE_QKV_B, QKV, 0, INIT_ZEROS, 0, 0);
    if (s->qk_norm == QKNORM_HEAD) {
        add(b, "attn.q_norm.weight", ROLE_Q_NORM, s->head_dim, 0, INIT_ONES, 0, 0);
        add(b, "attn.k_norm.weight", ROLE_K_NORM, s->head_dim, 0, INIT_ONES, 0, 0);
    }
    add(b, "attn.c_proj.weight", ROLE_O_W, C, Q, INIT_NORMAL_RESID, 1, 0);
    if (s->bias) add(b, "attn.c_proj.bias", ROLE_O_B, C, 0, INIT_ZEROS, 0, 0);
    add_norm(b, s, "ln_2.weight", "ln_2.bias", ROLE_MLP_NORM_W, ROLE_MLP_NORM_B, C);
    add(b, "mlp.c_fc.weight", ROLE_FC_W, F, C, INIT_NORMAL, 1, 0);
    if (s->mlp == MLP_SWIGLU) add(b, "mlp.c_fc2.weight", ROLE_UP_W, F, C, INIT_NORMAL, 1, 1);
    if (s->bias) {
        add(b, "mlp.c_fc.bias", ROLE_FC_B, F, 0, INIT_ZEROS, 0, 0);
        if (s->mlp == MLP_SWIGLU) add(b, "mlp.c_fc2.bias", ROLE_UP_B, F, 0, INIT_ZEROS, 0, 1);
    }
    add(b, "mlp.c_proj.weight", ROLE_DOWN_W, C, F, INIT_NORMAL_RESID, 1, 0);
    if (s->bias) add(b, "mlp.c_proj.bias", ROLE_DOWN_B, C, 0, INIT_ZEROS, 0, 0);
}

/* Llama's names: HF LlamaForCausalLM's without the model. prefix; MoE as
 * OLMoE / DeepSeek name their router, experts and shared experts. */
static void llama_layer(TableBuilder *b, const ArchSpec *s) {
    int C = s->n_embd, HD = s->head_dim, Q = arch_q_width(s), KV = s->n_kv_head * HD, F = s->ffn_hidden;
    add_norm(b, s, "input_layernorm.weight", "input_layernorm.bias", ROLE_ATTN_NORM_W, ROLE_ATTN_NORM_B, C);
    add(b, "self_attn.q_proj.weight", ROLE_QKV_W, Q, C, INIT_NORMAL, 1, 0);
    add(b, "self_attn.k_proj.weight", ROLE_K_W, KV, C, INIT_NORMAL, 1, 1);
    add(b, "self_attn.v_proj.weight", ROLE_V_W, KV, C, INIT_NORMAL, 1, 1);
    if (s->bias) {
        add(b, "self_attn.q_proj.bias", ROLE_QKV_B, Q, 0, INIT_ZEROS, 0, 0);
        add(b, "self_attn.k_proj.bias", ROLE_K_B, KV, 0, INIT_ZEROS, 0, 1);
        add(b, "self_attn.v_proj.bias", ROLE_V_B, KV, 0, INIT_ZEROS, 0, 1);
    }
    if (s->qk_norm != QKNORM_NONE) {
        int full = s->qk_norm == QKNORM_FULL;
        add(b, "self_attn.q_norm.weight", ROLE_Q_NORM, full ? Q : HD, 0, INIT_ONES, 0, 0);
        add(b, "self_attn.k_norm.weight", ROLE_K_NORM, full ? KV : HD, 0, INIT_ONES, 0, 0);
    }
    add(b, "self_attn.o_proj.weight", ROLE_O_W, C, Q, INIT_NORMAL_RESID, 1, 0);
    if (s->bias) add(b, "self_attn.o_proj.bias", ROLE_O_B, C, 0, INIT_ZEROS, 0, 0);
    add_norm(b, s, "post_attention_layernorm.weight", "post_attention_layernorm.bias", ROLE_MLP_NORM_W,
             ROLE_MLP_NORM_B, C);
    if (s->mlp != MLP_MOE) {
        int swiglu = s->mlp == MLP_SWIGLU;
        add(b, swiglu ? "mlp.gate_proj.weight" : "mlp.up_proj.weight", ROLE_FC_W, F, C, INIT_NORMAL, 1, 0);
        if (swiglu) add(b, "mlp.up_proj.weight", ROLE_UP_W, F, C, INIT_NORMAL, 1, 1);
        if (s->bias) {
            add(b, swiglu ? "mlp.gate_proj.bias" : "mlp.up_proj.bias", ROLE_FC_B, F, 0, INIT_ZEROS, 0, 0);
            if (swiglu) add(b, "mlp.up_proj.bias", ROLE_UP_B, F, 0, INIT_ZEROS, 0, 1);
        }
        add(b, "mlp.down_proj.weight", ROLE_DOWN_W, C, F, INIT_NORMAL_RESID, 1, 0);
        if (s->bias) add(b, "mlp.down_proj.bias", ROLE_DOWN_B, C, 0, INIT_ZEROS, 0, 0);
        return;
    }
    const ArchMoe *m = &s->moe;
    int Fe = m->expert_hidden;
    add(b, "mlp.gate.weight", ROLE_ROUTER_W, m->n_experts, C, INIT_NORMAL, 1, 0);
    if (m->bias_update_rate > 0)
        add(b, "mlp.gate.e_score_correction_bias", ROLE_ROUTER_BIAS, m->n_experts, 0, INIT_ZEROS, 0, 0);
    char name[64];
    for (int e = 0; e < m->n_experts; e++) {
        b->expert = e;
        snprintf(name, sizeof name, "mlp.experts.%d.gate_proj.weight", e);
        add(b, name, ROLE_EXPERT_GATE_W, Fe, C, INIT_NORMAL, 1, 0);
        snprintf(name, sizeof name, "mlp.experts.%d.up_proj.weight", e);
        add(b, name, ROLE_EXPERT_UP_W, Fe, C, INIT_NORMAL, 1, 1);
        snprintf(name, sizeof name, "mlp.experts.%d.down_proj.weight", e);
        add(b, name, ROLE_EXPERT_DOWN_W, C, Fe, INIT_NORMAL_RESID, 1, 0);
    }
    b->expert = -1;
    if (m->n_shared > 0) {
        int S = m->n_shared * Fe;
        add(b, "mlp.shared_experts.gate_proj.weight", ROLE_SHARED_GATE_W, S, C, INIT_NORMAL, 1, 0);
        add(b, "mlp.shared_experts.up_proj.weight", ROLE_SHARED_UP_W, S, C, INIT_NORMAL, 1, 1);
        add(b, "mlp.shared_experts.down_proj.weight", ROLE_SHARED_DOWN_W, C, S, INIT_NORMAL_RESID, 1, 0);
    }
}

static ArchTensor *arch_build_tensors(const ArchSpec *s, int decay_embeddings, int *n) {
    TableBuilder b = {.layer = -1, .expert = -1, .prefix = ""};
    int C = s->n_embd, gpt2 = s->family == ARCH_GPT2;
    add(&b, gpt2 ? "wte" : "embed_tokens.weight", ROLE_TOK_EMB, s->padded_vocab, C, INIT_NORMAL, decay_embeddings, 0);
    if (s->pos == POS_LEARNED)
        add(&b, gpt2 ? "wpe" : "embed_positions.weight", ROLE_POS_EMB, s->seq_len, C, INIT_NORMAL, decay_embeddings, 0);
    char prefix[32];
    for (int l = 0; l < s->n_layer; l++) {
        snprintf(prefix, sizeof prefix, gpt2 ? "h.%d." : "layers.%d.", l);
        b.prefix = prefix;
        b.layer = l;
        if (gpt2) gpt2_layer(&b, s);
        else llama_layer(&b, s);
    }
    b.prefix = "";
    b.layer = -1;
    add_norm(&b, s, gpt2 ? "ln_f.weight" : "norm.weight", gpt2 ? "ln_f.bias" : "norm.bias", ROLE_FINAL_NORM_W,
             ROLE_FINAL_NORM_B, C);
    if (!s->tie_embeddings) add(&b, "lm_head.weight", ROLE_HEAD_W, s->padded_vocab, C,
                                INIT_NORMAL, 1, 0);
    *n = b.n;
    return b.t;
}

/* The tables built last, by spec: ./train plan --search counts thousands of
 * layouts over a handful of (tp-local) shapes, and building a table names
 * every tensor. A hit returns a copy, so callers free it as before. The
 * spec is compared byte for byte (ints and floats only: no padding). One
 * thread builds models and plans (model_init, plan): no lock. */
#define ARCH_MEMO 16
typedef struct ArchMemo {
    ArchSpec s;
    int decay, n;
    ArchTensor *t;
    int counted;       /* params and weights below are set */
    size_t params;     /* arch_num_params */
    double weights;    /* arch_flops_per_token's matmul weights a token passes through */
} ArchMemo;
static ArchMemo arch_memo[ARCH_MEMO];
static int arch_memo_next;

static ArchMemo *arch_memo_of(const ArchSpec *s, int decay_embeddings) {
    for (int i = 0; i < ARCH_MEMO; i++)
        if (arch_memo[i].t && arch_memo[i].decay == decay_embeddings && !memcmp(&arch_memo[i].s, s, sizeof *s))
            return &arch_memo[i];
    ArchMemo *e = &arch_memo[arch_memo_next++ % ARCH_MEMO];
    free(e->t);
    memset(e, 0, sizeof *e);
    e->t = arch_build_tensors(s, decay_embeddings, &e->n);
    e->s = *s, e->decay = decay_embeddings;
    return e;
}

const ArchTensor *arch_tensors_view(const ArchSpec *s, int decay_embeddings, int *n) {
    const ArchMemo *e = arch_memo_of(s, decay_embeddings);
    *n = e->n;
    return e->t;
}

/* The counts every layout's plan reads, once per table: the parameters,
 * and the matmul weights a token passes through (every 2-D tensor of a
 * layer except the experts it is not routed to, plus the head, tied or
 * not; the embeddings are lookups). */
static const ArchMemo *arch_counted(const ArchSpec *s) {
    ArchMemo *e = arch_memo_of(s, 0);
    if (e->counted) return e;
    const ArchTensor *t = e->t;
    for (int i = 0; i < e->n; i++) {
        e->params += t[i].numel;
        if (t[i].layer < 0 || t[i].ndim != 2) continue;
        e->weights += (double)t[i].numel * (t[i].expert >= 0 ? (double)s->moe.top_k / s->moe.n_experts : 1.0);
    }
    e->counted = 1;
    return e;
}

ArchTensor *arch_tensors(const ArchSpec *s, int decay_embeddings, int *n) {
    const ArchTensor *v = arch_tensors_view(s, decay_embeddings, n);
    ArchTensor *t = xmalloc((size_t)(*n > 0 ? *n : 1) * sizeof *t);
    memcpy(t, v, (size_t)*n * sizeof *t);
    return t;
}

int arch_tensor_in_stage(const ArchSpec *s, const ArchTensor *t, int lo, int hi) {
    if (t->layer >= 0) return t->layer >= lo && t->layer < hi;
    int first = lo == 0, last = hi == s->n_layer;
    switch (t->role) {
    case ROLE_TOK_EMB: return first || (last && s->tie_embeddings);
    case ROLE_POS_EMB: return first;
    default: return last; /* final norm, head */
    }
}

/* ------------------------------------------------------------ tensor parallelism */

ArchTpSplit arch_tp_split(const ArchSpec *s, int role) {
    switch (role) {
    case ROLE_QKV_W:
    case ROLE_QKV_B: return (ArchTpSplit){0, s->family == ARCH_GPT2 ? 3 : 1};
    case ROLE_K_W: case ROLE_V_W: case ROLE_K_B: case ROLE_V_B:
    case ROLE_FC_W: case ROLE_UP_W: case ROLE_FC_B: case ROLE_UP_B:
    case ROLE_TOK_EMB: case ROLE_HEAD_W: return (ArchTpSplit){0, 1};
    case ROLE_O_W:
    case ROLE_DOWN_W: return (ArchTpSplit){1, 1};
    default: return (ArchTpSplit){-1, 1};
    }
}

int arch_tp_check(const ArchSpec *s, int tp, char *err, size_t errn) {
    if (tp <= 1) return 0;
    if (s->n_head % tp) {
        snprintf(err, errn, "keys 'parallel.tp', 'model.n_head': tp %d must divide the %d attention heads (each "
                 "rank computes whole heads)", tp, s->n_head);
        return -1;
    }
    if (s->n_kv_head % tp) {
        snprintf(err, errn, "keys 'parallel.tp', 'model.n_kv_head': tp %d must divide the %d kv heads (each rank "
                 "holds whole kv-head groups; replicating kv heads over tp is not supported)", tp, s->n_kv_head);
        return -1;
    }
    if (s->mlp != MLP_MOE && s->ffn_hidden % tp) {
        snprintf(err, errn, "keys 'parallel.tp', 'model.ffn_hidden': tp %d must divide the MLP width %d", tp,
                 s->ffn_hidden);
        return -1;
    }
    if (s->qk_norm == QKNORM_FULL) {
        snprintf(err, errn, "keys 'parallel.tp', 'model.qk_norm': full normalises over every head at once, which "
                 "tensor parallelism splits; use qk_norm: head or none, or parallel.tp: 1");
        return -1;
    }
    return 0;
}

void arch_tp_local(const ArchSpec *g, int tp, int rank, ArchSpec *l) {
    *l = *g;
    if (tp <= 1) return;
    l->n_head = g->n_head / tp;
    l->n_kv_head = g->n_kv_head / tp;
    if (g->mlp != MLP_MOE) l->ffn_hidden = g->ffn_hidden / tp;
    int rows = arch_tp_vocab_rows(g, tp), lo = rank * rows;
    l->padded_vocab = rows;
    l->vocab_size = g->vocab_size <= lo ? 0 : g->vocab_size - lo < rows ? g->vocab_size - lo : rows;
}

/* ------------------------------------------------------------ counts */

size_t arch_num_params(const ArchSpec *s) { return arch_counted(s)->params; }

size_t arch_num_active_params(const ArchSpec *s) {
    size_t all = arch_num_params(s);
    if (s->mlp != MLP_MOE) return all;
    size_t per_expert = 3 * (size_t)s->moe.expert_hidden * s->n_embd;
    return all - (size_t)s->n_layer * (size_t)(s->moe.n_experts - s->moe.top_k) * per_expert;
}

double arch_flops_per_token(const ArchSpec *s, int T) {
    double w = arch_counted(s)->weights + (double)s->n_embd * s->vocab_size; /* + the head */
    /* Each weight costs 2 FLOPs forward and 4 backward per token. Attention
     * scores and the weighted sum cost 2*2*T*d per token and layer forward
     * (d = n_head head_dim), twice that backward: 12 L T d, halved because
     * the mask is causal. */
    return 6.0 * w + 6.0 * s->n_layer * (double)T * arch_q_width(s);
}
