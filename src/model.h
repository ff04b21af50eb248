/* model: one block graph (GPT-2, Llama, MoE pieces chosen by the spec) as backend ops.
 * Owns the parameter, gradient and activation arenas (one allocation each)
 * and the parameters' compute copy; tensors are views into them. Knows no
 * file formats but llm.c's checkpoint, no optimizer and no data loader.
 *
 * Dtypes (backend.h): parameters, their gradients and optimizer state are
 * fp32 (the master, which checkpoints hold). Ops read the parameters through
 * a compute copy in the activation dtype, act_bytes = be->act_bytes(): with
 * 4 (fp32: the CPU, CUDA fp32) it is the master itself, no copy; with 2
 * (bf16) the model casts the master into it after the values change
 * (model_params_changed) or its views are re-bound (ZeRO-3), at the first
 * use. Activations are act; statistics and losses fp32.
 *
 * precision.master bf16 (act_bytes 2, no ZeRO): there is no fp32 master.
 * The compute copy is the parameters (param16, bf16 bits; the optimizer
 * updates it with stochastic rounding), param_mem and the p views are NULL,
 * and host code reaches the values only through model_params_to_host /
 * model_params_from_host (exact widening; rounding to nearest even).
 * Gradients stay fp32.
 *
 * The parameter table is arch.c's (arch_tensors): one row per tensor with
 * its layer, role and global shape; views are indexed by table row and found
 * by (layer, role, expert), never by name or index arithmetic. In memory the
 * arena holds the weight-decayed tensors first, then the rest, so the
 * optimizer updates two contiguous ranges (ZeRO-2 and -3 lay it out layer by
 * layer instead: model_layout_by_unit; expert parallelism puts this rank's
 * experts, all decayed, before the other decayed tensors, so that they
 * reduce as one range over their own group); a tensor marked `follows` sits right
 * after the one before it, so the two are read as one product (Llama's q, k,
 * v; SwiGLU's gate and up). The block graph and its formulas:
 * docs/architectures.md. */
#ifndef KILN_MODEL_H
#define KILN_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "arch.h"
#include "backend.h"

/* GPT-2 of the given sizes (the gpt2 preset), resolved: what tests and
 * tools that only ever mean GPT-2 start from. */
#define ARCH_GPT2_SHAPE(L, NH, C, T, V)                                                             \
    {.family = ARCH_GPT2, .n_layer = (L), .n_head = (NH), .n_embd = (C), .seq_len = (T),             \
     .vocab_size = (V), .norm = NORM_LAYERNORM, .pos = POS_LEARNED, .mlp = MLP_GELU, .bias = 1,      \
     .tie_embeddings = 1}

/* A row of the tensor table (arch.h) placed in the arena. */
typedef struct ParamInfo {
    char name[64];
    int ndim;
    int shape[2];
    size_t numel;
    size_t offset; /* elements from the start of the parameter arena */
    int decay;     /* 1 if weight decay applies */
    int layer, role, expert, init, follows, trained; /* as ArchTensor */
    /* Tensor parallelism (ModelOptions.tp > 1; else gshape = shape, no split):
     * shape is this rank's part of the global tensor gshape, split as
     * arch_tp_split says (model_tp_boxes: where the part lies); tp_partial:
     * the gradient each tp rank computes is a partial sum that tp.c adds up
     * over the tp group (sequence-parallel norms see a shard of the tokens;
     * QK-norm gains see a rank's heads). */
    int gshape[2];
    ArchTpSplit split;
    int tp_partial;
} ParamInfo;

/* Where tensor i's local elements lie in the global tensor viewed as
 * (gshape[0], the rest): rows [r0, r1) x columns [c0, c1), stored row-major
 * in the local tensor from element `at`. One box, or one per part of a
 * split (GPT-2's q | k | v: 3); none for a rank whose vocabulary rows are all
 * padding. Rows of a part past the global tensor are local padding (zeros). */
typedef struct ModelBox {
    size_t r0, r1, c0, c1, at;
} ModelBox;
#define MODEL_MAX_BOXES 3

/* One buffer of the compute copy (act_bytes 2 only): the cast of `len`
 * floats of the fp32 buffer `master` (the arena, or one of ZeRO-3's gather
 * buffers), same layout. Stale: the master changed since the last cast. */
typedef struct ComputeBuf {
    const float *master;
    void *mem; /* device (len) act */
    size_t len;
    int stale;
} ComputeBuf;

/* What the backward pass recomputes instead of keeping per layer
 * (model.recompute). GELU and NORM_GELU each include the one before: the
 * recomputation runs the forward's op on the forward's inputs (saved in the
 * arena), so values, and every result after them, are bit-identical to NONE
 * (except for the GeLU output when the forward made it in a fused product:
 * model_gelu_fused); it costs one more activation op (GeLU or SwiGLU; and
 * two norms) per layer and backward. MoE layers keep their activations.
 * BLOCK keeps only the input of each checkpointed layer (every
 * recompute_every-th: model_layer_recomputed) and runs the layer's whole
 * forward again just before its backward, into one workspace all such
 * layers share: the same ops on the same inputs and weights, so again
 * bit-identical, for one more forward of each checkpointed layer (two under
 * a split backward: its weight part recomputes again). SELECTIVE keeps every
 * product's output and attention's output with its log-sum-exp, and
 * recomputes the pointwise work between them: NORM_GELU's norms and dense
 * activation, and in MoE layers the experts' and shared experts' SwiGLU
 * outputs and the routed rows' permuted copy of norm2's output (without
 * expert parallelism: under it those rows came by all-to-all and are kept).
 * RoPE stays applied in the kept q, k (the rotated rows replace the
 * product's at the same size: recomputing them would save nothing), and so
 * does QK-norm's input. No product runs again: bit-identical for a pointwise
 * op per buffer. */
typedef enum {
    MODEL_RECOMPUTE_NONE,      /* keep ln1, ln2 and the MLP activation of every layer */
    MODEL_RECOMPUTE_GELU,      /* one (N,F) activation (GeLU or SwiGLU output) shared by all layers */
    MODEL_RECOMPUTE_NORM_GELU, /* + one (N,C) norm output for ln1 and ln2 of all layers */
    MODEL_RECOMPUTE_BLOCK,     /* a checkpointed layer keeps its output (the next one's input) only */
    MODEL_RECOMPUTE_SELECTIVE  /* NORM_GELU + MoE layers' activations and permuted rows: products' outputs only */
} ModelRecompute;
#define MODEL_RECOMPUTE_MODES 5

/* "none", "gelu", "norm_gelu", "block", "selective" (the config's values) and back; parse exits 2
 * naming model.recompute on anything else. */
ModelRecompute model_recompute_parse(const char *name);
const char *model_recompute_name(ModelRecompute r);

/* Per-layer activations saved for the backward pass (B,T as allocated);
 * void *: act dtype, float *: fp32. Under recomputation, ln1 and ln2 (for
 * NORM_GELU) and fch_gelu point into one buffer shared by every layer: the
 * forward leaves the last layer's values there, and the backward writes
 * layer l's again just before it reads them. */
typedef struct LayerActs {
    void *ln1;                  /* (N,C) */
    float *ln1_mean, *ln1_rstd; /* (N); mean unused by RMSNorm */
    void *qkv;                  /* (N,QKVW) after QK-norm and RoPE: what attention read */
    void *qk_in;                /* (N,(NH+NKV)HD) q, k before QK-norm; NULL without it */
    float *qk_rstd;             /* (N,G) QK-norm statistics */
    void *atty;                 /* (N,NH HD) */
    float *att_lse;             /* (B,NH,T); cp: (2,B,NH,Tc), one per local chunk (cp.h) */
    void *res2;                 /* (N,C) residual after attention */
    void *ln2;                  /* (N,C) */
    float *ln2_mean, *ln2_rstd; /* (N) */
    void *fch;                  /* (N,F) GeLU pre-activation, or (N,2F) SwiGLU's gate | up */
    void *fch_gelu;             /* (N,F) the activation (GeLU or SwiGLU output) */
    void *res3;                 /* (N,C) residual after the MLP = next layer's input */
    /* MoE (R = N K permuted rows at most, S = n_shared expert_hidden) */
    void *router;               /* (N,E) router logits */
    float *probs, *gates, *stats; /* (N,E) (N,K) (B,E+1); cp: (2B,E+1), per local chunk of a sequence */
    int32_t *topk, *row_of, *src, *offsets, *counts; /* (N,K) (N,K) (R) (E+1) (B,E); cp: (2B,E) */
    int32_t *offsets_host;      /* (E+1) host copy: the experts' row ranges */
    void *xp, *hp, *hp_act, *yp; /* (R,C) (R,2Fe) (R,Fe) (R,C) */
    void *sh, *sh_act;          /* (N,2S) (N,S) shared experts */
    /* A split backward (model_backward_input, then model_backward_weight):
     * the output gradients of the four products, kept from the input part for
     * the weight part, in buffers the input part no longer needs (qkv, res2,
     * fch, res3) or, where recomputation still reads those, their own. */
    void *d_qkv, *d_o, *d_fc, *d_down; /* (N,QKVW) (N,C) (N,FCW) (N,C); dense MLP only for d_fc, d_down */
} LayerActs;

/* Per-step MoE figures of the last training forward, summed over MoE layers
 * (aux, z) or over layers and micro-batches since model_moe_reset (loads). */
typedef struct ModelMoeStats {
    double aux, z;         /* last forward: sum over layers of the aux and z losses */
    double aux_sum, z_sum; /* since reset: aux and z of every training forward, added up */
    int64_t *load;         /* (n_layer, E) since reset: slots routed to each expert */
    int64_t routed, drops; /* since reset: slots routed, and dropped by capacity */
    int64_t host_reads;    /* since reset: device-to-host reads the routing made (expert row offsets that size
                              the products, loads and router statistics for the auxiliary losses): on a GPU
                              each waits for the device (docs/gpu.md, "A training step") */
} ModelMoeStats;

/* What parallel code needs to run inside the model's passes; model.c itself
 * never communicates. One table, set once (model_set_hooks); NULL members
 * are skipped.
 *  layer_begin: before layer `layer`'s forward (layer = -1: before the
 *   embeddings, when the non-layer tensors must be present) and before its
 *   backward (backward = 1), so ZeRO-2/3 can gather the layer's parameters
 *   into the buffers the views point at; returns 1 when the layer's values
 *   may have changed since its last use (the model then casts its compute
 *   copy again).
 *  grads_done: once the gradients of layer `layer` and every later one (and
 *   the final norm and head) are complete: layer = n_layer-1 down to 0, then
 *   -1 once the embeddings' are too. */
typedef struct ModelHooks {
    void *ctx;
    int (*layer_begin)(void *ctx, int layer, int backward);
    void (*grads_done)(void *ctx, int layer);
} ModelHooks;

/* Tensor parallelism (tp.c fills it; model.c itself never communicates):
 * collectives over the tp group inside a layer, on act buffers (n or block
 * elements of act_bytes each) unless said. NULL table (tp 1): none run.
 *  all_reduce: buf (n) summed over the ranks, in place.
 *  all_gather: buf (tp block) holds this rank's block at rank * block; every
 *   rank's block arrives in place.
 *  reduce_scatter: send (tp block) summed over the ranks; recv (block) gets
 *   this rank's block of the sum.
 *  all_gather_f32: fp32 send (block) -> recv (tp block), rank order.
 *  grads_done: before ModelHooks.grads_done of the same layer: the partial
 *   gradients (ParamInfo.tp_partial) that are complete are summed.
 *  drain: see below. */
typedef struct ModelTp {
    void *ctx;
    void (*all_reduce)(void *ctx, void *buf, size_t n);
    void (*all_gather)(void *ctx, void *buf, size_t block);
    void (*reduce_scatter)(void *ctx, const void *send, void *recv, size_t block);
    void (*all_gather_f32)(void *ctx, const float *send, float *recv, size_t block);
    void (*grads_done)(void *ctx, int layer);
    /* before the host reads a device buffer (losses, MoE row ranges, a
     * logits row): the collectives still in flight are waited for, with the
     * deadline (on a GPU they are ordered on the device, not on the host) */
    void (*drain)(void *ctx);
} ModelTp;

#define MODEL_MAX_CHUNKS 16

/* The rows one rank's routed experts run on in an MoE layer: without expert
 * parallelism the layer's own permuted rows for all E experts; with it, the
 * rows the ep group sent to this rank's experts (ModelEp). Local expert j,
 * global expert e0 + j, owns rows [off[j], off[j+1]); R = off[n]. */
typedef struct ModelExpertRows {
    int e0, n;                   /* first global expert, experts here */
    const int32_t *off;          /* (n+1) host */
    void *x, *h, *h_act;         /* (R,C) (R,2Fe) (R,Fe) act: inputs and the forward's saved activations */
    void *y;                     /* (R,C) act: the forward's outputs */
    void *dy, *dh_act, *dh, *dx; /* backward: (R,C) the outputs' gradient; scratch (R,Fe) (R,2Fe); (R,C)
                                    the inputs' gradient */
} ModelExpertRows;

/* Expert parallelism (ep.c fills it; model.c itself never communicates):
 * the all-to-all exchanges of an MoE layer, over the ep group. NULL table
 * (ep 1): the layer runs every expert on its own rows.
 *  dispatch: xp (R,C) act holds layer l's permuted rows, expert e's at
 *   [offsets[e], offsets[e+1]) (offsets (E+1) host, global experts, so the
 *   rows for each rank are contiguous): each goes to its expert's rank;
 *   *rows gets the rows this rank's experts run on (x, h, h_act, y, off).
 *  combine: rows->y of the last dispatch of layer l back to where each row
 *   came from: yp (R,C) gets its rows' expert outputs, in xp's order.
 *  dispatch_grad: the backward's dispatch: dyp (R,C), yp's gradient, to the
 *   experts' ranks; *rows as dispatch gave, with dy filled and the scratch.
 *  combine_grad: rows->dx back into dxp (R,C), xp's gradient. */
typedef struct ModelEp {
    void *ctx;
    void (*dispatch)(void *ctx, int layer, const void *xp, const int32_t *offsets, ModelExpertRows *rows);
    void (*combine)(void *ctx, int layer, void *yp);
    void (*dispatch_grad)(void *ctx, int layer, const void *dyp, ModelExpertRows *rows);
    void (*combine_grad)(void *ctx, int layer, void *dxp);
} ModelEp;

/* Context parallelism (cp.c fills it; model.c itself never communicates).
 * Layout: each sequence of T tokens is 2 cp chunks of Tc = T / (2 cp)
 * tokens; cp rank r holds chunks model_cp_chunk(cp, r, 0) = r and
 * model_cp_chunk(cp, r, 1) = 2 cp - 1 - r, and its N = B 2 Tc rows are
 * chunk-major: [its first chunk of every sequence | its second chunk of
 * every sequence], two (B, Tc) blocks. Everything per token runs on these
 * rows (embeddings and RoPE at the chunks' global positions); attention
 * needs every earlier key, through the hooks:
 *  attention_forward / attention_backward: backend.h's attention ops for
 *   the local rows (s: B sequences of T = 2 Tc local rows), over the whole
 *   sequence; lse (N NH floats) laid out as the hook likes.
 *  broadcast: buf (n) act from cp rank root to every cp rank (a logits row).
 *  sum_host: x (n) host doubles summed over the cp ranks, in place (an MoE
 *   layer's per-sequence loads and router sums, and its chunks' loads for a
 *   capacity: with these it routes as one rank).
 * NULL table (cp 1): the model runs the backend's attention ops. */
typedef struct ModelCp {
    void *ctx;
    void (*attention_forward)(void *ctx, void *out, float *lse, const void *qkv, const AttnShape *s);
    void (*attention_backward)(void *ctx, void *dqkv, const void *dout, const void *qkv, const void *out,
                               const float *lse, const AttnShape *s);
    void (*broadcast)(void *ctx, void *buf, size_t n, int root);
    void (*sum_host)(void *ctx, double *x, size_t n);
    /* send: block fp32 (device); recv: (cp, block), rank i's at i block (in
     * place when send == recv + rank block): fp8's amaxes (model_fp8.c) */
    void (*all_gather_f32)(void *ctx, const float *send, float *recv, size_t block);
} ModelCp;
/* Global chunk index of local chunk c (0, 1) on cp rank `rank` of cp. */
static inline int model_cp_chunk(int cp, int rank, int c) { return c ? 2 * cp - 1 - rank : rank; }

/* fp8 products (precision.fp8 keys; docs/precision.md, model_fp8.c). */
typedef struct ModelFp8 {
    int mode;     /* Fp8Mode: FP8_OFF (none), FP8_TENSORWISE, FP8_ROWWISE */
    int grad_fmt; /* Fp8Format of the output gradients in the backward */
    int wgrad;    /* 1: the weight-gradient product's operands in fp8 too */
    int history;  /* 0: current scaling; N: delayed, the max of the last N amaxes (tensorwise) */
    int pow2;     /* scales rounded down to powers of two */
    int head;     /* the output head's product too */
} ModelFp8;

/* model_init's options. */
typedef struct ModelOptions {
    int decay_embeddings; /* optim.decay_embeddings */
    int layer_lo, layer_hi; /* a pipeline stage: layers [lo, hi) (0, 0: all); the embeddings come with
                               layer 0, the final norm and head with the last (arch_tensor_in_stage) */
    int chunks;           /* > 1: an interleaved pipeline rank's chunks instead, chunk c the layers
                             [chunk_lo[c], chunk_hi[c]) (ascending, disjoint); the tensors of all */
    int chunk_lo[MODEL_MAX_CHUNKS], chunk_hi[MODEL_MAX_CHUNKS];
    int master_bf16;      /* precision.master bf16 (see the top): the backend must have bf16
                             activations and adamw_update_p16, else exit 2 naming the key */
    int tp, tp_rank;      /* tensor parallelism: this rank's part of a model split over tp ranks
                             (0, 0: one rank); the spec must pass arch_tp_check */
    int sequence_parallel;/* tp > 1: norms and residuals on N/tp-row shards of the tokens */
    int ep, ep_rank;      /* expert parallelism: this rank holds experts [ep_rank E/ep, (ep_rank+1) E/ep)
                             of every MoE layer, the first in its arena (0, 0: all; ep divides E) */
    int cp, cp_rank;      /* context parallelism: this rank's two chunks of every sequence (ModelCp;
                             0, 0: whole sequences) */
    int doc_masking;      /* data.doc_masking: attention stops at documents (model_doc_starts) */
    int doc_reset;        /* data.doc_positions reset: positions (RoPE, learned) restart per document */
    int doc_eot;          /* the end-of-text id that ends a document (with either of the two above) */
    ModelFp8 fp8;         /* fp8 products; mode 0: none */
    int recompute_every;  /* model.recompute_every: under MODEL_RECOMPUTE_BLOCK layer l is
                             checkpointed when l % k == 0 (0: 1, every layer) */
    int loss_chunk;       /* model.loss_chunk: the head and its loss in chunks of this many of a
                             rank's rows (model_loss_rows); 0: the whole logits, -1: auto */
} ModelOptions;


/* One activation set (model_plan_slots): what one micro-batch in flight
 * keeps from its forward to its backward on one chunk of layers. The
 * active set's fields are the Model's own (encoded, acts, lnf, ...; the
 * forward and backward read those); model_use_slot swaps them. */
typedef struct ModelSlot {
    int chunk;
    LayerActs *acts;               /* [n_layer]: the chunk's layers */
    void *encoded;                 /* (N,C) */
    void *stage_dout, *stage_din;  /* (N,C): a chunk without the head / without the embeddings, else NULL */
    void *lnf, *logits;            /* (N,C) (N,Vp): the chunk with the head */
    float *lnf_mean, *lnf_rstd, *losses, *aux;
    int32_t *tokens_dev, *targets_dev; /* (N) */
    int32_t *tokens_host;              /* (N) host: what tokens_dev holds (the embedding backward's plan) */
    int32_t *doc_dev, *doc_host;       /* (N) device and host: documents (Model's), or NULL */
    int live_B, live_T, live_sp, have_targets, weight_pending;
    float live_dloss;
} ModelSlot;

typedef struct Model {
    ArchSpec shape;     /* what this rank computes: the spec, or under tp its local part (arch_tp_local) */
    ArchSpec gshape;    /* the whole model's spec (= shape without tp) */
    int tp, tp_rank;    /* tensor parallelism: ranks and this one's place (tp 1: none) */
    int sp;             /* sequence parallelism (tp > 1): the residual stream is row-sharded */
    int live_sp;        /* the last forward ran sequence-parallel (sp, and B*T divides by tp) */
    size_t res_rows;    /* rows the residual stream's buffers hold (N, or N/tp under sp) */
    int vocab_lo;       /* first global vocabulary row of this rank's embedding and head */
    ModelTp tpc;        /* the tp collectives (model_set_tp); all NULL: tp 1 */
    int ep, ep_rank;    /* expert parallelism: ranks and this one's place (ep 1: none) */
    int expert_lo, n_experts_here; /* the routed experts this rank holds: [lo, lo + n) of each MoE layer */
    size_t expert_len;  /* ep > 1: the arena's [0, expert_len) holds them (and padding), every other
                           tensor after it (decayed first); 0 with ep 1 */
    ModelEp epc;        /* the ep exchanges (model_set_ep); all NULL: ep 1 */
    int cp, cp_rank;    /* context parallelism: ranks and this one's place (cp 1: none) */
    ModelCp cpc;        /* the cp hooks (model_set_cp); all NULL: cp 1 */
    const Backend *be;
    int layer_lo, layer_hi;   /* the layers this model runs: [lo, hi) of shape.n_layer (the active chunk's) */
    int has_embed, has_head;  /* lo == 0: embeds tokens; hi == n_layer: the final norm, head and loss */
    int n_chunks;             /* pipeline chunks (1 but for interleaved schedules) */
    int chunk_lo[MODEL_MAX_CHUNKS], chunk_hi[MODEL_MAX_CHUNKS];

    int num_tensors;
    ParamInfo *params; /* [num_tensors], listing order */
    size_t num_params;
    size_t num_decay;  /* arena elements [0, num_decay) are decayed */

    float *param_mem; /* device (arena_len >= num_params; zeros past num_params); NULL with master_bf16 */
    int master_bf16;  /* precision.master bf16: param16 is the parameters, no fp32 arena (see the top) */
    uint16_t *param16;/* device (arena_len) bf16 bits with master_bf16 (= cbuf[0].mem), else NULL */
    float *grad_mem;  /* device (arena_len); NULL after model_layout_by_unit */
    size_t arena_len; /* num_params, or more after model_pad_arenas (ZeRO's equal blocks) */
    ModelHooks hooks; /* all NULL: none */
    float **pview, **gview; /* [num_tensors] fp32 master parameters (all NULL with master_bf16), gradients */
    size_t act_bytes; /* be->act_bytes(): 4 fp32, 2 bf16 */
    const void **wview; /* [num_tensors] compute copy (act): pview itself when act_bytes is 4 */
    int *slot;          /* [(n_layer + 1) ROLE_LAYER_COUNT + n_layer E ROLE_EXPERT_COUNT] table row of
                           (layer, role[, expert]), -1 where absent (see model_tensor_index) */
    float *rope;        /* device (seq_len, 2, head_dim/2) fp32 RoPE cos, sin per position; NULL without RoPE */
    ModelMoeStats moe;
    ComputeBuf *cbuf; /* [n_cbuf] act_bytes 2: the compute copy's buffers */
    int n_cbuf;
    int *unit_cbuf;   /* [n_units] buffer holding each unit's compute copy */
    int *unit_stale;  /* [n_units] by-unit layout: the unit's compute copy must be cast again */

    /* ZeRO-2/3 (model_layout_by_unit): the arena is laid out unit by unit
     * (unit l < n_layer: layer l's tensors; unit n_layer: the embeddings, final norm and head),
     * each unit's tensors in listing order, and the views may point into
     * per-unit buffers (model_bind_unit). n_units = 0: decayed-first layout.
     * A pipeline stage's units of the other stages' layers are empty (length 0). */
    int n_units;
    size_t *unit_off, *unit_len; /* [n_units] arena range of each unit */
    int layer_grads_fresh;       /* 1: layer gradients are overwritten by every
                                    backward (the caller accumulates them) */

    /* Activations, planned for micro-batch B x T (model_plan_activations);
     * void *: act dtype, float *: fp32. */
    int B, T;           /* planned capacity */
    ModelRecompute recompute; /* planned with it: what the backward recomputes */
    int recompute_every;      /* BLOCK: every k-th layer is checkpointed (model_layer_recomputed) */
    int recomputing;          /* 1 while a backward runs a checkpointed layer's forward again: the
                                 forward writes no statistics and fp8 casts take their saved scales */
    LayerActs rec_ws;         /* BLOCK: the workspace of the checkpointed layers' activations */
    void *rec_proj;           /* BLOCK: (2N,C) act, the recomputed forward's product outputs (the
                                 forward's own are in the scratch, which then holds the backward's) */
    int gelu_fusion;    /* 1 (model_init's default; precision.gelu_fusion auto): the MLP's fc
                           product and its GeLU run as the backend's fused ops where it offers
                           them (model_gelu_fused); 0 (off): always as separate ops */
    int live_B, live_T; /* shape of the last forward (cp: live_T local rows per sequence, 2 Tc) */
    int cp_tokens;      /* cp > 1: the tokens of a sequence the forward running was given (before its padding) */
    void *act_mem;
    size_t act_size;  /* bytes */
    void *encoded;    /* (N,C) the embeddings, or a later stage's input (model_stage_input) */
    void *stage_dout; /* (N,C) a stage without the head: the gradient of its output (model_stage_output_grad) */
    void *stage_din;  /* (N,C) a stage without the embeddings: the gradient of its input (model_stage_input_grad) */
    LayerActs *acts;  /* [n_layer] */
    void *lnf;        /* (N,C) */
    float *aux;       /* (n_layer, B, E) device: the aux loss's gradient per sequence and expert (cp: per
                         routing group, 2B of them: each stat below too) */
    float *stats_host, *auxg_host; /* (B, E+1) (B, E) host: one layer's router stats, aux gradient */
    int32_t *counts_host;          /* (B, E) host: one layer's loads per sequence */
    double *seq_host;              /* (B, 2E+1) host: one layer's loads, prob and lse^2 sums per whole sequence */
    double *chunk_host;            /* cp > 1: (2 cp, B, E) host: every chunk's loads (a capacity's limits) */
    int32_t *caps_host, *moe_caps; /* cp > 1: (2B, E) host, device: this rank's chunks' limits per expert */
    float *lnf_mean, *lnf_rstd; /* (N) */
    void *logits;     /* (N,Vp); dlogits in place after a training forward. Chunked loss
                         (xent_rows > 0): (xent_rows,Vp), one buffer for every slot, holding
                         rows [logits_r0, logits_r0 + xent_rows) (-1: none) */
    int loss_chunk;   /* ModelOptions.loss_chunk */
    size_t xent_rows; /* planned rows of a chunk of the head (model_loss_rows); 0: whole */
    long logits_r0;
    float *losses;    /* (N) device */
    void *scratch;    /* forward: projection outputs; backward: gradient buffers */
    int32_t *tokens_dev, *targets_dev; /* (N) */
    int32_t *tokens_host;              /* (N) host: what tokens_dev holds, so no backward reads it back */
    int32_t *cp_tok, *cp_tgt;          /* cp > 1: (N) host, this rank's chunks of the tokens and targets */
    /* documents (ModelOptions.doc_*): the global position where each of
     * this rank's rows' document starts (rows as tokens_dev), on the device
     * for attention and RoPE and on the host for learned positions; doc_full
     * (B, T) host: the same for whole sequences, before cp takes its chunks */
    int doc_mask, doc_reset, doc_eot;
    int32_t *doc_dev, *doc_host, *doc_full;
    float *losses_host; /* (N) */
    double *loss_sink;  /* device, or NULL: where a training forward adds its mean loss (model_set_loss_sink) */
    void *row_host;     /* (tp Vp) act: one logits row on its way to the host */
    /* tensor parallelism (tp > 1) */
    int32_t *tok_host, *tgt_host; /* (N) host: token and target ids as local vocabulary rows, -1 elsewhere */
    int32_t *pad_host;  /* (T) host: one sequence padded to a multiple of tp (sequence parallelism) */
    float *xent_stats;  /* device (N,3) this rank's cross-entropy statistics, then (tp,N,3) all */
    void *row_dev;      /* device (tp Vp) act: one logits row gathered over the tp ranks (and broadcast over cp) */
    int have_targets;   /* last forward had targets (backward allowed) */
    int weight_pending; /* model_backward_input ran, model_backward_weight not yet */
    float live_dloss;   /* its dloss: the aux and z losses' gradient scale */
    /* activation sets (model_plan_slots): slots[chunk_slot0[c] + k] is slot k of chunk c */
    ModelSlot *slots;
    int n_slots, cur_slot;
    int chunk_slot0[MODEL_MAX_CHUNKS], chunk_slots[MODEL_MAX_CHUNKS];
    int split_backward; /* planned for model_backward_input / _weight */
    /* fp8 (model_fp8.c): the quantised operands of one product at a time,
     * amax scratch and delayed-scaling histories */
    ModelFp8 fp8;
    /* the operands of one product at a time, at the largest product's sizes:
     * quantised act (N, in) (out, in) (N, out), or on the fp8 tensor-core
     * path (model_fp8.c mm_real) their codes, fp8_qd holding dout's (N, out)
     * and then dout^T's (out, N) */
    void *fp8_qx, *fp8_qw, *fp8_qd;
    size_t fp8_cap[3];  /* their elements: x, w, dout (a routed expert's rows: up to ep N) */
    float *fp8_amax;    /* device (2, cp, tp, fp8_amax_n): one cast's amaxes, every tp and cp rank's (two axes) */
    float *fp8_inv;     /* device (FP8_INVS, fp8_inv_n) + 1: the codes' inverse scales, then an amax (delayed) */
    size_t fp8_amax_n;  /* the most amaxes of one operand: max(N, widths) */
    size_t fp8_inv_n;   /* fp8_amax_n rounded up to 16 bytes */
    float *fp8_hist;    /* device (fp8_slots, MM_OPERANDS, history, cp, tp) amax rings; NULL: current scaling */
    int64_t *fp8_count; /* (fp8_slots, MM_OPERANDS) host: casts so far of each operand (its history row) */
    float *fp8_snap;    /* BLOCK with delayed scaling: device (n_slots, fp8_slots, 2, history, cp, tp),
                           the ring each forward cast (x, w) of a checkpointed layer was scaled by,
                           so that its recomputation casts with the same scale and records nothing */
    int fp8_slots;      /* products with histories: n_layer (MM_KINDS + 2 E) + 1 (the head) */
    int fp8_local_amax; /* test hook fp8_local_amax (testhooks.h): no tp reduction of amaxes (wrong on purpose) */
} Model;

/* Build the parameter table of the resolved spec `s` (arch_resolve) and
 * allocate the parameter and gradient arenas; o NULL: all options 0. */
void model_init(Model *m, const Backend *be, const ArchSpec *s, const ModelOptions *o);
void model_free(Model *m);
/* Install the hook table (see ModelHooks); NULL removes it. */
void model_set_hooks(Model *m, const ModelHooks *h);
/* Install the tensor-parallel collectives (see ModelTp); needed before a
 * forward when tp > 1. */
void model_set_tp(Model *m, const ModelTp *t);
/* Install the expert-parallel exchanges (see ModelEp); needed before a
 * forward when ep > 1. */
void model_set_ep(Model *m, const ModelEp *e);
/* Grow the arena's expert region to n >= expert_len floats (zeros at its
 * end), moving every other tensor up by the difference, so it splits into
 * equal ZeRO blocks over the EDP group. Keeps the parameter values. */
void model_pad_experts(Model *m, size_t n);

/* Install the context-parallel hooks (see ModelCp); needed before a forward
 * when cp > 1. */
void model_set_cp(Model *m, const ModelCp *c);
/* Tensor i's boxes in its global tensor (ModelBox); returns how many. */
int model_tp_boxes(const Model *m, int i, ModelBox box[MODEL_MAX_BOXES]);
/* Table row of (layer, role, expert) (layer -1 for non-layer roles, expert
 * -1 for non-expert roles); -1 if the architecture has no such tensor. */
int model_tensor_index(const Model *m, int layer, int role, int expert);
/* The hook at which tensor i's gradient is complete (ModelHooks.grads_done):
 * its layer; the final norm's and the untied head's n_layer-1; the
 * embeddings' -1. */
int model_grads_ready_layer(const Model *m, int i);
/* Grow both arenas to n >= num_params floats (zero padding at the end), so a
 * flat arena splits into equal ZeRO blocks. Keeps the parameter values. */
void model_pad_arenas(Model *m, size_t n);

/* ZeRO-2/3: lay the parameter arena out unit by unit (see Model.n_units)
 * instead of decayed-first, each unit's length rounded up to a multiple of
 * unit_align floats (ddp: 64 x dp, so a unit splits into dp equal blocks);
 * tensor names and shapes stay, offsets change, values are not kept (call
 * before initialising or loading weights). The whole gradient arena is freed
 * and not replaced: the caller binds every unit's gradient views to its own
 * buffers (model_bind_unit) before a backward. num_decay becomes 0: the
 * optimizer then asks each tensor's ParamInfo.decay. */
void model_layout_by_unit(Model *m, size_t unit_align);
/* Unit of tensor `i` (table index) under model_layout_by_unit. */
int model_unit_of(const Model *m, int i);
/* Point unit u's parameter and gradient views at pbuf and gbuf, which hold
 * the unit's arena range [unit_off[u], unit_off[u] + unit_len[u]); a NULL
 * buffer leaves those views where they are. With a bf16 compute copy, units
 * bound to the same pbuf share one compute buffer (allocated here, at setup),
 * cast again whenever the pre-layer hook says the values changed. */
void model_bind_unit(Model *m, int u, float *pbuf, float *gbuf);

/* The fp32 parameters changed (optimizer step, checkpoint load): the compute
 * copy is cast again before the next use. A flag; nothing runs here (and
 * nothing at all with master_bf16: the copy is the parameters). */
void model_params_changed(Model *m);

/* The first num_params parameters to and from host fp32, arena order: the
 * fp32 master as is, or with master_bf16 the bf16 parameters widened
 * (exact) / rounded to nearest even (values already bf16 are kept to the
 * bit). from_host marks the compute copy stale. */
void model_params_to_host(const Model *m, float *host);
void model_params_from_host(Model *m, const float *host);
/* What the optimizer updates: param_mem (fp32) or, with master_bf16, param16. */
void *model_param_arena(const Model *m);
/* The compute copy of the whole arena when there is one to cast (act bf16,
 * fp32 master, the arena in one buffer: not ZeRO-2/3's layout), for an
 * optimizer to write in its update (optim_set_copy); else NULL. Its
 * elements follow the arena's (act_bytes each). */
void *model_compute_copy(const Model *m);

/* Initialisation by each tensor's ArchInit (src/model_init.c): N(0, 0.02)
 * weights and embeddings, residual projections (attention output, MLP down)
 * scaled by 1/sqrt(2*n_layer), zero biases, unit norm gains, zero padded
 * rows of the token embedding and head. The values of one stream drawn in
 * the whole table's listing order: deterministic from `seed`, independent of
 * the backend, the thread count and the layout (a stage, tp rank or ep rank
 * holds the whole model's values of its part). Drawn on all threads, each
 * jumping to its piece of the stream; a rank draws only what it keeps. */
void model_init_weights(Model *m, uint64_t seed);

/* Plan and allocate activations for micro-batches up to B x T (T <= seq_len),
 * keeping or recomputing per `r`. The only activation allocation: forward
 * and backward allocate nothing. One set per chunk (model_plan_slots).
 * Under cp, T is the whole sequence (a multiple of 2 cp) and the buffers
 * hold this rank's B x T / cp rows. */
void model_plan_activations(Model *m, int B, int T, ModelRecompute r);
/* The same with slots[c] activation sets for chunk c (a pipeline schedule's
 * micro-batches in flight; slots NULL: one each), and with split 1 the
 * buffers a split backward keeps (LayerActs.d_*). Each set holds its own
 * input, per-layer activations, head outputs, output and input gradients
 * and token ids; recomputation's shared buffers and the scratch are shared
 * by all. */
void model_plan_slots(Model *m, int B, int T, ModelRecompute r, const int *slots, int split);
/* Make slot k of chunk c the active set: the forward and backward that
 * follow run chunk c's layers on its buffers. */
void model_use_slot(Model *m, int chunk, int k);
/* A set's stage buffers (as model_stage_* below, for set (chunk, k) whether
 * active or not): its input, output, output gradient, input gradient. */
void *model_slot_input(const Model *m, int chunk, int k);
const void *model_slot_output(const Model *m, int chunk, int k);
void *model_slot_output_grad(const Model *m, int chunk, int k);
const void *model_slot_input_grad(const Model *m, int chunk, int k);

/* Whether the forward (backward = 0) or the backward (1) runs the fc product
 * and its GeLU as one fused op (backend.h: matmul_gelu_forward,
 * matmul_backward_dgelu): gelu_fusion is on and the backend offers it. The
 * fused ops compute the same function with other rounding (the GeLU of the
 * unrounded product, the library's GeLU code), so fusion changes results in
 * the last bits; and under model.recompute the backward's recomputed GeLU
 * (the GeLU op on the kept pre-activation) may differ from the fused forward's
 * in the last bit, so recomputation is bit-identical to none only when
 * fusion is off or not offered (the CPU backend offers none). */
int model_gelu_fused(const Model *m, int backward);

/* Forward. tokens, targets: host (B,T). With targets, returns the mean loss
 * and fills losses_host; else returns 0 and leaves logits intact. With
 * dloss != 0 the logits buffer is turned into dlogits for model_backward
 * (dloss = 1 / (B*T*grad_accum) for a mean over the optimizer step).
 * Under cp every cp rank passes the same whole (B,T) batch and computes its
 * chunks (ModelCp): the mean loss and losses_host are of its B T / cp
 * tokens (the caller averages over the cp ranks; dloss stays 1 / (B T
 * accum ...) of the whole sequence). T must divide by 2 cp for training; a
 * forward without targets (generation) pads the sequence at its end. */
/* Documents in (B, T) token ids: doc[b T + i] = the position where token i's
 * document starts. A token after `eot` starts a new document, so the eot
 * belongs to the document it ends (Megatron's reset_attention_mask). */
void model_doc_starts(const int32_t *tokens, int B, int T, int eot, int32_t *doc);

float model_forward(Model *m, const int32_t *tokens, const int32_t *targets, int B, int T,
                    float dloss);
/* From now on a training forward (targets and dloss != 0) adds its mean
 * loss to *sink, device memory (backend.h loss_acc: the same number it
 * would return), and returns 0 without reading the losses to the host: no
 * host wait per micro-batch (optim_step_device reads the step's sum). A
 * forward without dloss (evaluation) still returns its loss. NULL: off. */
void model_set_loss_sink(Model *m, double *sink);

/* Backward of the last forward (which must have had dloss != 0, and targets
 * on the stage with the head). accumulate = 0 on the first micro-batch of a
 * step (gradients overwritten). */
void model_backward(Model *m, int accumulate);
/* The same backward in two parts (zero-bubble schedules; planned with
 * split): the input part computes every input gradient, the norm, QK-norm,
 * embedding and MoE gradients, and keeps the products' output gradients;
 * the weight part, later, the products' weight and bias gradients from them
 * (recomputing what model.recompute dropped), then the grads_done hooks.
 * Together they give model_backward's gradients to the bit. */
void model_backward_input(Model *m, int accumulate);
void model_backward_weight(Model *m, int accumulate);

/* Pipeline stages (ModelOptions.layer_lo/hi). A stage without the embeddings
 * reads its input (N,C) act from model_stage_input, which the caller fills
 * before model_forward (whose tokens it ignores); a stage without the head
 * leaves its output in model_stage_output after the forward (model_forward
 * returns 0 and takes no targets) and reads the gradient of that output from
 * model_stage_output_grad, filled by the caller before model_backward; after
 * the backward, a stage without the embeddings leaves the gradient of its
 * input in model_stage_input_grad (until the next forward). With the
 * outputs of one stage copied into the next, the stages compute exactly what
 * the whole model does. */
void *model_stage_input(const Model *m);
const void *model_stage_output(const Model *m);
void *model_stage_output_grad(const Model *m);
const void *model_stage_input_grad(const Model *m);

/* Rows of the residual stream a stage holds and sends for a B x T batch:
 * its own B T / tp under sequence parallelism (one sequence padded to a
 * multiple of tp first, as model_forward does), else all B T (of this
 * rank's rows under cp). */
int model_stage_rows(const Model *m, int B, int T);

/* Host copy of logits row (b, t) after a forward without targets:
 * gshape.padded_vocab floats (converted from the activation dtype). Under tp
 * a collective: every tp rank calls it, and the row is gathered; under cp
 * too (t is the global position; its chunk's rank broadcasts the row). */
void model_logits_row(Model *m, int b, int t, float *out);

/* Counts (arch.h has the formulas): the tensors this rank holds (under tp,
 * its parts; arch_num_params(&m->gshape) is the whole model's). */
size_t model_num_params(const Model *m);
size_t model_num_nonembedding_params(const Model *m);
/* Bytes of the activation arena for micro-batch B x T, activations of
 * act_bytes each (statistics and losses fp32), recomputing per `r`: exactly
 * what model_plan_activations allocates. Every buffer is rounded up to 64
 * bytes; with X = the (N,F) and Y = the (N,C) buffer so rounded, GELU is
 * (L-1) X smaller than NONE (L kept, one shared), NORM_GELU (2L-1) Y more. */
size_t model_activation_bytes(const ArchSpec *s, int B, int T, size_t act_bytes, ModelRecompute r);
/* The same for one rank of a model split over tp ranks (ModelOptions.tp)
 * and cp ranks (ModelOptions.cp): its local widths, its B x T / cp rows,
 * tp's own buffers, and with sequence parallelism (sp, cp 1) the residual
 * stream's buffers at N/tp rows (the norms' outputs, which the
 * column-parallel products read, keep all N rows); cp.c's K/V buffers are
 * not in the arena (cp_buffer_bytes); with ep > 1 (ModelOptions.ep) neither
 * are the expert side's, which are ep.c's (ep_buffer_bytes). */
size_t model_activation_bytes_rank(const ArchSpec *s, int tp, int cp, int ep, int sp, int B, int T, size_t act_bytes,
                                   ModelRecompute r, int every, int loss_chunk);

/* The same for a pipeline rank (tp 1: the spec itself; sp its sequence
 * parallelism; cp: its B x T / cp rows; ep > 1: without the expert side's
 * buffers, ep.c's): its chunks, chunk c the layers [lo[c], hi[c]) in
 * slots[c] activation sets, with the kept output gradients of a split
 * backward when split: exactly what model_plan_slots allocates. */
size_t model_activation_bytes_stage(const ArchSpec *s, int tp, int cp, int sp, int ep, int B, int T, size_t act_bytes,
                                    ModelRecompute r, int every, int loss_chunk, int chunks, const int *lo,
                                    const int *hi, const int *slots, int split);
/* Chunked loss (model.loss_chunk): the rows of one chunk of the output head
 * and its cross-entropy for a rank with N rows and local shape s (its
 * vocabulary columns under tp), or 0 when the head runs whole. loss_chunk
 * 0: whole; > 0: that many rows; -1 (auto): the rows whose logits hold at
 * most 4 N C elements, four (N,C) activations' worth, in whole 64-row
 * tiles. A chunk of N rows or more is the whole head. */
size_t model_loss_rows(const ArchSpec *s, size_t N, int loss_chunk);
/* Hardware FLOPs a token costs in training: arch_flops_per_token(g, T) (the
 * model FLOPs MFU counts) plus what recomputation repeats: a checkpointed
 * layer's forward (a third of its training FLOPs) per block layer, and the
 * head's product 2 C V under a chunked loss (loss_chunk, rows the rank's
 * rows per micro-batch, tp its vocabulary split); both twice under a split
 * backward (zb_h1's weight part remakes them). gelu and norm_gelu repeat
 * pointwise work only, not counted. */
double model_hw_flops_per_token(const ArchSpec *g, int T, int tp, size_t rows, ModelRecompute r, int every,
                                int loss_chunk, int split);
/* Whether mode r with recompute_every k checkpoints layer l (BLOCK: l % k
 * == 0); model_layer_recomputed is the planned model's. */
int model_recompute_layer(ModelRecompute r, int every, int l);
int model_layer_recomputed(const Model *m, int l);
/* Whether mode r drops MoE layers' SwiGLU outputs and permuted rows
 * (SELECTIVE; ep.c then shares its own layers' SwiGLU outputs too). */
int model_recomputes_experts(ModelRecompute r);

/* MoE: zero the loads and drop counts (the start of an optimizer step). */
void model_moe_reset(Model *m);
/* MoE with moe.bias_update_rate > 0 (DeepSeek-V3's auxiliary-loss-free
 * balancing), after the optimizer step: each layer's balancing bias moves by
 * rate * sign(mean load - load) per expert, from `load` (n_layer, E): the
 * loads of the whole step, all micro-batches and (summed by the caller) all
 * ranks. Not a gradient step: the bias only steers selection. */
void model_moe_update_bias(Model *m, const int64_t *load);

/* fp8 products (model_fp8.c). The block's products by kind; an expert's
 * two are MM_EXPERT_GATE/DOWN with its index. */
enum { MM_QKV, MM_O, MM_FC, MM_DOWN, MM_SHARED_GATE, MM_SHARED_DOWN, MM_KINDS, MM_EXPERT_GATE = MM_KINDS,
       MM_EXPERT_DOWN, MM_HEAD };
/* The quantised operands a product's scales belong to: forward input and
 * weight, output gradient, and the backward's own casts of input and weight
 * (rowwise scales run along another axis there). */
enum { MM_X, MM_W, MM_D, MM_XB, MM_WB, MM_OPERANDS };
/* model_init: every fp8 product's dimensions multiples of 16 (else exit 2
 * naming the tensor), the backend's ops present, the dtype allowed. */
void model_fp8_check(Model *m);
/* model_plan_slots: the operand buffers for N rows; model_free: their release. */
void model_fp8_plan(Model *m, int N);
/* What model_fp8_plan allocates on the device for a (tp-local) shape s and
 * N rows of act_bytes activations: the operands' buffers (quantised act,
 * or their fp8 codes and transposed codes), the amax scratch and inverse
 * scales, and delayed scaling's rings; returns their sum (0 with fp8 off). */
typedef struct ModelFp8Bytes {
    size_t operands, scales, histories;
} ModelFp8Bytes;
size_t model_fp8_bytes(const ArchSpec *s, const ModelFp8 *f, int tp, int cp, int ep, size_t N, size_t act_bytes,
                       ModelFp8Bytes *parts);
/* Bytes of Model.fp8_snap for n_slots activation sets: BLOCK recompute with
 * delayed scaling only, else 0. */
size_t model_fp8_snap_bytes(const ArchSpec *s, const ModelFp8 *f, int tp, int cp, int n_slots, ModelRecompute r);
void model_fp8_free(Model *m);
/* Delayed scaling's state (precision.fp8_amax_history > 0, else 0 and
 * nothing), as the checkpoint holds it ("fp8.amax_history",
 * "fp8.amax_count"; state.c): for each (fp8_slots, MM_OPERANDS) operand its
 * history's amaxes, (history) fp32 in ring order (each the max over the tp
 * and cp ranks' entries of its row: all the scales read), and its cast
 * count, int64 (the next row: count % history). get copies them to host
 * buffers of these lengths, set back. */
size_t model_fp8_history_len(const Model *m);
size_t model_fp8_count_len(const Model *m);
void model_fp8_history_get(const Model *m, float *hist, int64_t *count);
void model_fp8_history_set(Model *m, const float *hist, const int64_t *count);
/* A resume in another layout (state.c): out, out_count (this layout's) take
 * the histories of hist, count (one rank's of the old layout, same lengths)
 * that mean the same here and that out has none of yet (count 0): a
 * weight's always (replicated over dp and cp, its amax reduced over tp where
 * tp splits it: the same on every rank that holds the layer, in any
 * layout); an activation's or output gradient's only when same_dp (the
 * rank's micro-batches are the same sequences: amaxes reduced over tp and
 * cp make them the same on each of a dp rank's tp and cp ranks), and for a
 * routed expert's (amaxes of this rank's rows, not reduced over cp) only
 * when same_cp too. Returns how many it took. */
int model_fp8_history_merge(const Model *m, const float *hist, const int64_t *count, int same_dp, int same_cp,
                            float *out, int64_t *out_count);
/* Whether fp8 products run on fp8 tensor cores here (else as quantised
 * operands and the backend's products; model_fp8.c mm_real), and in words
 * for the start-up line. */
int model_fp8_tensor_cores(const Model *m);
const char *model_fp8_products(const Model *m);
/* out (N,OC) = inp (N,C) @ w (OC,C)^T + bias, and its backward, as
 * backend.h's matmul_forward / matmul_backward, for product `kind` of layer
 * l (expert e, else -1; the head: l -1, MM_HEAD): with fp8 on, the operands
 * quantised first (E4M3 forward; the output gradient in grad_fmt), their
 * amaxes reduced over the tp ranks where tp splits the range they cover. */
void model_mm_forward(Model *m, int l, int kind, int e, void *out, const void *inp, const void *w, const void *bias,
                      int N, int C, int OC);
void model_mm_backward(Model *m, int l, int kind, int e, void *dinp, float *dw, float *dbias, const void *dout,
                       const void *inp, const void *w, int N, int C, int OC, int accumulate);

/* Find a tensor by name; NULL if absent. */
const ParamInfo *model_find_param(const Model *m, const char *name);

/* Load an llm.c GPT-2 checkpoint (magic 20240326, version 3 = fp32) into the
 * parameters. Shape disagreements with the model exit 2 naming the file and
 * the differing field. */
void model_load_llmc(Model *m, const char *path);

/* The activation arena's plan, for model.c and model_plan.c (which
 * implements it) only; the rest of kiln counts through the
 * model_activation_bytes functions above, which run the same plan. */
/* What an activation arena holds: chunk c's layers [lo[c], hi[c]) in
 * slots[c] sets each; split: a split backward's kept output gradients;
 * every: BLOCK's recompute_every. */
typedef struct ActPlan {
    int chunks, lo[MODEL_MAX_CHUNKS], hi[MODEL_MAX_CHUNKS], slots[MODEL_MAX_CHUNKS], split, every;
    int loss_chunk; /* model.loss_chunk (model_loss_rows) */
} ActPlan;

/* The arena's bytes for micro-batches of B x T local rows (T: after cp's
 * split), act_bytes per activation, recompute r; with m, also lay it out at
 * m->act_mem and point m's slots' views into it (NULL: count only). */
size_t model_plan_bytes(const ArchSpec *s, int B, int T, size_t act_bytes, ModelRecompute r, const ActPlan *pl,
                        int tp, int cp, int seq_par, int ep, Model *m);

/* Whether mode r keeps no MLP activation (GELU, NORM_GELU, SELECTIVE) and
 * no norm outputs (NORM_GELU, SELECTIVE) per layer: the backward makes them
 * again into one shared buffer (BLOCK keeps them in its workspace). */
int model_recomputes_gelu(ModelRecompute r);
int model_recomputes_norm(ModelRecompute r);

#endif
