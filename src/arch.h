/* arch: the architecture spec (GPT-2, Llama, MoE pieces chosen by config) and
 * the tensor table it implies: every parameter's name, layer, role, global
 * shape and initialisation. Counts (parameters, FLOPs) come from here too.
 * Knows no backend, no memory and no file format; formulas: docs/architectures.md. */
#ifndef KILN_ARCH_H
#define KILN_ARCH_H

#include <stddef.h>

typedef enum { ARCH_GPT2, ARCH_LLAMA } ArchFamily; /* the preset; also the naming scheme */
typedef enum { NORM_LAYERNORM, NORM_RMSNORM } ArchNorm;
typedef enum { POS_LEARNED, POS_ROPE } ArchPos;
typedef enum { MLP_GELU, MLP_SWIGLU, MLP_MOE } ArchMlp;
typedef enum { QKNORM_NONE, QKNORM_HEAD, QKNORM_FULL } ArchQkNorm; /* FULL: over the whole projection (OLMoE) */

/* Llama 3.1's frequency-dependent RoPE scaling (HF rope_type "llama3"). */
typedef struct ArchRopeScaling {
    int on;
    float factor, low_freq_factor, high_freq_factor;
    int original_context; /* original_max_position_embeddings */
} ArchRopeScaling;

typedef struct ArchMoe {
    int n_experts, top_k, n_shared; /* routed experts, chosen per token, always-on experts */
    int expert_hidden;              /* width of one expert's SwiGLU */
    int sigmoid;                    /* router: 0 softmax, 1 sigmoid (gates then always renormalised) */
    int norm_topk;                  /* renormalise the chosen gates to sum to one */
    float capacity_factor;          /* 0: dropless; else cap = ceil(cf * seq_tokens * top_k / n_experts) per sequence */
    float aux_loss_coef, z_loss_coef, bias_update_rate;
} ArchMoe;

typedef struct ArchSpec {
    ArchFamily family;
    int n_layer, n_head, n_kv_head, head_dim, n_embd, seq_len, vocab_size;
    int padded_vocab; /* derived: vocab_size rounded up to a multiple of 64 */
    int ffn_hidden;   /* dense MLP width */
    ArchNorm norm;
    float norm_eps;
    ArchPos pos;
    float rope_theta;
    ArchRopeScaling rope_scaling;
    ArchQkNorm qk_norm;
    ArchMlp mlp;
    int bias;           /* linear and norm biases */
    int tie_embeddings; /* the head reads the token embedding */
    ArchMoe moe;
} ArchSpec;

/* Parameter roles: what the model does with a tensor. Layer roles repeat per
 * layer; EXPERT_* repeat per expert of a layer. */
typedef enum {
    ROLE_TOK_EMB, ROLE_POS_EMB, ROLE_FINAL_NORM_W, ROLE_FINAL_NORM_B, ROLE_HEAD_W, /* layer -1 */
    ROLE_ATTN_NORM_W, ROLE_ATTN_NORM_B,
    ROLE_QKV_W, ROLE_K_W, ROLE_V_W, /* QKV_W is q (llama) or all of q|k|v (gpt2); K, V follow it in memory */
    ROLE_QKV_B, ROLE_K_B, ROLE_V_B,
    ROLE_Q_NORM, ROLE_K_NORM,
    ROLE_O_W, ROLE_O_B,
    ROLE_MLP_NORM_W, ROLE_MLP_NORM_B,
    ROLE_FC_W, ROLE_UP_W, ROLE_FC_B, ROLE_UP_B, /* FC is GeLU's c_fc or SwiGLU's gate; UP follows it */
    ROLE_DOWN_W, ROLE_DOWN_B,
    ROLE_ROUTER_W, ROLE_ROUTER_BIAS, /* ROUTER_BIAS: the balancing bias, not trained by gradient */
    ROLE_SHARED_GATE_W, ROLE_SHARED_UP_W, ROLE_SHARED_DOWN_W,
    ROLE_LAYER_COUNT,
    ROLE_EXPERT_GATE_W = ROLE_LAYER_COUNT, ROLE_EXPERT_UP_W, ROLE_EXPERT_DOWN_W,
    ROLE_COUNT
} ArchRole;
#define ROLE_EXPERT_COUNT (ROLE_COUNT - ROLE_LAYER_COUNT)

typedef enum {
    INIT_NORMAL,       /* N(0, 0.02) */
    INIT_NORMAL_RESID, /* N(0, 0.02 / sqrt(2 n_layer)): projections into the residual stream */
    INIT_ONES,         /* norm gains */
    INIT_ZEROS         /* biases, the balancing bias */
} ArchInit;

typedef struct ArchTensor {
    char name[64];
    int layer;  /* -1: embeddings, final norm, head */
    int role;   /* ArchRole */
    int expert; /* -1 unless an EXPERT_* role */
    int ndim;
    int shape[2];
    size_t numel;
    int init;   /* ArchInit */
    int decay;  /* weight decay applies (2-D weights; embeddings per optim.decay_embeddings) */
    int follows; /* 1: placed right after the previous tensor, no padding (K after Q, up after gate):
                    the two are read as one product */
    int trained; /* 0: no gradient (ROUTER_BIAS) */
} ArchTensor;

/* Parse enum names (the config's values); exit 2 naming the key on anything else. */
ArchFamily arch_family_parse(const char *s);
ArchNorm arch_norm_parse(const char *s);
ArchPos arch_pos_parse(const char *s);
ArchMlp arch_mlp_parse(const char *s);
ArchQkNorm arch_qk_norm_parse(const char *s);
const char *arch_family_name(ArchFamily f);
const char *arch_mlp_name(ArchMlp m);

/* The resolved spec of a loaded config: the model.arch preset decides every
 * `auto` key (docs/architectures.md), then arch_resolve. */
struct Config;
void arch_from_config(const struct Config *c, ArchSpec *s);

/* Fill derived fields (padded_vocab; head_dim, n_kv_head, ffn_hidden and
 * expert_hidden where 0) and check every constraint, exiting 2 with one line
 * naming the key. */
void arch_resolve(ArchSpec *s);

/* The tensor table in listing order (docs, checkpoints, fixtures): a
 * malloc'd array of *n entries. */
ArchTensor *arch_tensors(const ArchSpec *s, int decay_embeddings, int *n);
/* The same table without a copy: the memo's own, to read before the next
 * arch_tensors or arch_tensors_view call (which may replace it), never to
 * free. The planner's search reads it for every layout it counts. */
const ArchTensor *arch_tensors_view(const ArchSpec *s, int decay_embeddings, int *n);

/* Whether tensor t belongs to the pipeline stage of layers [lo, hi): its
 * layer's tensors; the embeddings with layer 0; the final norm and head with
 * the last layer, and with them the token embedding when the head is tied
 * to it (a first and a last stage then each hold a copy, whose gradients the
 * pipeline adds). */
int arch_tensor_in_stage(const ArchSpec *s, const ArchTensor *t, int lo, int hi);

/* ------------------------------------------------------------ tensor parallelism
 * How each tensor splits over the tp ranks (Megatron's layout;
 * docs/parallel.md "Tensor parallelism"): column-parallel products (q, k, v;
 * c_fc / gate, up; the token embedding and head by vocabulary rows) split
 * their output rows, dim 0, and their biases with them; row-parallel products
 * (the attention output, the MLP's down) split their input columns, dim 1;
 * everything else is replicated: norms, the row-parallel biases, learned
 * positions, QK-norm gains, and whole MoE layers (router, experts, shared
 * experts: not split by tp; expert parallelism is its own strategy). GPT-2's
 * fused c_attn is q | k | v: each of the three parts splits by heads, so
 * `parts` is 3 and a rank holds rows [part p's slice] of each part in turn. */
typedef struct ArchTpSplit {
    int dim;   /* -1 replicated, 0 rows, 1 columns */
    int parts; /* the dimension is `parts` equal blocks, each split over the ranks (1 or 3) */
} ArchTpSplit;
ArchTpSplit arch_tp_split(const ArchSpec *s, int role);

/* Whether the spec splits over tp ranks: heads, kv heads (tp must divide
 * n_kv_head; kv heads are never replicated), the MLP width; QK-norm over the
 * whole projection is refused. Returns 0, or -1 with one line in err naming
 * the keys. */
int arch_tp_check(const ArchSpec *s, int tp, char *err, size_t errn);

/* Vocabulary rows each tp rank holds: vocab_size rounded up to 64 tp, over
 * tp. The logical token embedding keeps padded_vocab (64) rows; a rank's rows
 * past it are padding too. */
static inline int arch_tp_vocab_rows(const ArchSpec *s, int tp) { return (s->vocab_size + 64 * tp - 1) / (64 * tp) * 64; }

/* The spec tp rank `rank` computes with: n_head, n_kv_head and ffn_hidden
 * over tp, padded_vocab its vocabulary rows and vocab_size the real tokens
 * among them (0 on ranks past the vocabulary). Its tensor table holds the
 * local shapes under the global names. tp 1: the spec itself. */
void arch_tp_local(const ArchSpec *g, int tp, int rank, ArchSpec *local);

/* Widths. */
static inline int arch_q_width(const ArchSpec *s) { return s->n_head * s->head_dim; }
static inline int arch_qkv_width(const ArchSpec *s) { return (s->n_head + 2 * s->n_kv_head) * s->head_dim; }
/* Rows of the first MLP product: ffn_hidden (GeLU) or 2 ffn_hidden (SwiGLU: gate | up). */
static inline int arch_fc_width(const ArchSpec *s) { return s->mlp == MLP_GELU ? s->ffn_hidden : 2 * s->ffn_hidden; }
/* Expert capacity for a sequence of T tokens (0: dropless). */
int arch_moe_capacity(const ArchSpec *s, int T);

/* Counts. Total parameters; active per token (MoE: top_k of the routed
 * experts, all of the rest); training FLOPs per token at context T:
 * 6 x (active matmul weights incl. the head) + 6 n_layer T (NH HD) for
 * causal attention (half of 12 L T d: the mask). */
size_t arch_num_params(const ArchSpec *s);
size_t arch_num_active_params(const ArchSpec *s);
double arch_flops_per_token(const ArchSpec *s, int T);

#endif
