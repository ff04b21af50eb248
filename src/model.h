/* model: GPT-2 as a parameter table plus a forward/backward graph of backend ops.
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
 * Parameter table, in listing order (the order of docs, fixtures and
 * checkpoints; C = n_embd, Vp = padded vocab, T = seq_len):
 *   wte (Vp,C)  wpe (T,C)
 *   per layer i: h.i.ln_1.weight (C)  h.i.ln_1.bias (C)
 *                h.i.attn.c_attn.weight (3C,C)  h.i.attn.c_attn.bias (3C)
 *                h.i.attn.c_proj.weight (C,C)   h.i.attn.c_proj.bias (C)
 *                h.i.ln_2.weight (C)  h.i.ln_2.bias (C)
 *                h.i.mlp.c_fc.weight (4C,C)     h.i.mlp.c_fc.bias (4C)
 *                h.i.mlp.c_proj.weight (C,4C)   h.i.mlp.c_proj.bias (C)
 *   ln_f.weight (C)  ln_f.bias (C)
 * The output head is tied to wte. In memory the arena holds the weight-decayed
 * tensors first, then the rest, so the optimizer updates two contiguous ranges
 * (ZeRO-2 and -3 lay it out layer by layer instead: model_layout_by_unit). */
#ifndef KILN_MODEL_H
#define KILN_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"

typedef struct ModelShape {
    int n_layer, n_head, n_embd, seq_len, vocab_size, padded_vocab;
} ModelShape;

typedef struct ParamInfo {
    char name[48];
    int ndim;
    int shape[2];
    size_t numel;
    size_t offset; /* elements from the start of the parameter arena */
    int decay;     /* 1 if weight decay applies */
} ParamInfo;

/* Per-layer views into the parameter (or gradient) arena, fp32. */
typedef struct LayerParams {
    float *ln1w, *ln1b;   /* (C) */
    float *qkvw, *qkvb;   /* (3C,C) (3C) */
    float *attprojw, *attprojb; /* (C,C) (C) */
    float *ln2w, *ln2b;   /* (C) */
    float *fcw, *fcb;     /* (4C,C) (4C) */
    float *fcprojw, *fcprojb; /* (C,4C) (C) */
} LayerParams;

typedef struct ParamViews {
    float *wte, *wpe; /* (Vp,C) (T,C) */
    LayerParams *layer; /* [n_layer] */
    float *lnfw, *lnfb; /* (C) */
} ParamViews;

/* The same views into the compute copy, act dtype: what the ops read. */
typedef struct LayerWeights {
    const void *ln1w, *ln1b;         /* (C) */
    const void *qkvw, *qkvb;         /* (3C,C) (3C) */
    const void *attprojw, *attprojb; /* (C,C) (C) */
    const void *ln2w, *ln2b;         /* (C) */
    const void *fcw, *fcb;           /* (4C,C) (4C) */
    const void *fcprojw, *fcprojb;   /* (C,4C) (C) */
} LayerWeights;

typedef struct WeightViews {
    const void *wte, *wpe; /* (Vp,C) (T,C) */
    LayerWeights *layer;   /* [n_layer] */
    const void *lnfw, *lnfb; /* (C) */
} WeightViews;

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
 * (model.recompute). Each mode includes the one before. The recomputation
 * runs the forward's op on the forward's inputs (saved in the arena), so
 * values, and every result after them, are bit-identical to NONE (except for
 * the GeLU output when the forward made it in a fused product:
 * model_gelu_fused); it costs one more gelu_forward (and two
 * layernorm_forward) per layer and backward. */
typedef enum {
    MODEL_RECOMPUTE_NONE,      /* keep ln1, ln2 and the GeLU output of every layer */
    MODEL_RECOMPUTE_GELU,      /* one (N,4C) GeLU output shared by all layers */
    MODEL_RECOMPUTE_NORM_GELU  /* + one (N,C) LayerNorm output for ln1 and ln2 of all layers */
} ModelRecompute;

/* "none", "gelu", "norm_gelu" (the config's values) and back; parse exits 2
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
    float *ln1_mean, *ln1_rstd; /* (N) */
    void *qkv;                  /* (N,3C) */
    void *atty;                 /* (N,C) */
    float *att_lse;             /* (B,NH,T) */
    void *res2;                 /* (N,C) residual after attention */
    void *ln2;                  /* (N,C) */
    float *ln2_mean, *ln2_rstd; /* (N) */
    void *fch;                  /* (N,4C) */
    void *fch_gelu;             /* (N,4C) */
    void *res3;                 /* (N,C) residual after the MLP = next layer's input */
} LayerActs;

/* Called by model_backward once gradients are complete for layer `layer` and
 * every later one (and ln_f): with layer = n_layer-1 down to 0, then -1 once
 * the embeddings' are too. Lets the caller start reducing gradients while the
 * backward pass goes on; model.c itself never communicates. */
typedef void (*ModelBackwardHook)(void *ctx, int layer);
/* ZeRO-2/3: called before layer `layer`'s forward (layer = -1: before the
 * embeddings, when wte/wpe/ln_f must be present) and before its backward
 * (backward = 1), so the caller can gather that layer's parameters into the
 * buffers the views point at (or wait for their refresh). It returns 1 when
 * the unit's parameter values may have changed since its last use (a gather
 * landed), and the model then casts its compute copy again before use. */
typedef int (*ModelLayerHook)(void *ctx, int layer, int backward);

typedef struct Model {
    ModelShape shape;
    const Backend *be;

    int num_tensors;
    ParamInfo *params; /* [num_tensors], listing order */
    size_t num_params;
    size_t num_decay;  /* arena elements [0, num_decay) are decayed */

    float *param_mem; /* device (arena_len >= num_params; zeros past num_params); NULL with master_bf16 */
    int master_bf16;  /* precision.master bf16: param16 is the parameters, no fp32 arena (see the top) */
    uint16_t *param16;/* device (arena_len) bf16 bits with master_bf16 (= cbuf[0].mem), else NULL */
    float *grad_mem;  /* device (arena_len); NULL after model_layout_by_unit */
    size_t arena_len; /* num_params, or more after model_pad_arenas (ZeRO's equal blocks) */
    ModelBackwardHook hook; /* NULL: none (see ModelBackwardHook) */
    void *hook_ctx;
    ModelLayerHook pre_hook; /* NULL: none; shares hook_ctx */
    ParamViews p, g;  /* fp32 master parameters (all NULL with master_bf16) and their gradients */
    size_t act_bytes; /* be->act_bytes(): 4 fp32, 2 bf16 */
    WeightViews w;    /* compute copy (act): p itself when act_bytes is 4 */
    ComputeBuf *cbuf; /* [n_cbuf] act_bytes 2: the compute copy's buffers */
    int n_cbuf;
    int *unit_cbuf;   /* [n_units] buffer holding each unit's compute copy */
    int *unit_stale;  /* [n_units] by-unit layout: the unit's compute copy must be cast again */

    /* ZeRO-2/3 (model_layout_by_unit): the arena is laid out unit by unit
     * (unit l < n_layer: layer l's 12 tensors; unit n_layer: wte, wpe, ln_f),
     * each unit's tensors in listing order, and the views may point into
     * per-unit buffers (model_bind_unit). n_units = 0: decayed-first layout. */
    int n_units;
    size_t *unit_off, *unit_len; /* [n_units] arena range of each unit */
    int layer_grads_fresh;       /* 1: layer gradients are overwritten by every
                                    backward (the caller accumulates them) */

    /* Activations, planned for micro-batch B x T (model_plan_activations);
     * void *: act dtype, float *: fp32. */
    int B, T;           /* planned capacity */
    ModelRecompute recompute; /* planned with it: what the backward recomputes */
    int gelu_fusion;    /* 1 (model_init's default; precision.gelu_fusion auto): the MLP's fc
                           product and its GeLU run as the backend's fused ops where it offers
                           them (model_gelu_fused); 0 (off): always as separate ops */
    int live_B, live_T; /* shape of the last forward */
    void *act_mem;
    size_t act_size;  /* bytes */
    void *encoded;    /* (N,C) */
    LayerActs *acts;  /* [n_layer] */
    void *lnf;        /* (N,C) */
    float *lnf_mean, *lnf_rstd; /* (N) */
    void *logits;     /* (N,Vp); dlogits in place after a training forward */
    float *losses;    /* (N) device */
    void *scratch;    /* forward: projection outputs; backward: gradient buffers */
    int32_t *tokens_dev, *targets_dev; /* (N) */
    float *losses_host; /* (N) */
    void *row_host;     /* (Vp) act: one logits row on its way to the host */
    int have_targets;   /* last forward had targets (backward allowed) */
} Model;

/* Derive padded_vocab (multiple of 64) and check divisibility; exits 2 naming the key. */
void model_shape_resolve(ModelShape *s);

/* Build the parameter table and allocate the parameter and gradient arenas. */
void model_init(Model *m, const Backend *be, const ModelShape *s, int decay_embeddings);
/* The same with master_bf16 = 1 for precision.master bf16 (see the top): the
 * backend must have bf16 activations and adamw_update_p16, else exit 2
 * naming the key. */
void model_init_dtype(Model *m, const Backend *be, const ModelShape *s, int decay_embeddings, int master_bf16);
void model_free(Model *m);
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

/* GPT-2 initialisation: N(0, 0.02) weights and embeddings, residual
 * projections (attn.c_proj, mlp.c_proj weights) scaled by 1/sqrt(2*n_layer),
 * zero biases, unit LayerNorm gains, zero padded rows of wte. Deterministic
 * from `seed`, independent of the backend and thread count. */
void model_init_weights(Model *m, uint64_t seed);

/* Plan and allocate activations for micro-batches up to B x T (T <= seq_len),
 * keeping or recomputing per `r`. The only activation allocation: forward
 * and backward allocate nothing. */
void model_plan_activations(Model *m, int B, int T, ModelRecompute r);

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
 * (dloss = 1 / (B*T*grad_accum) for a mean over the optimizer step). */
float model_forward(Model *m, const int32_t *tokens, const int32_t *targets, int B, int T,
                    float dloss);

/* Backward of the last forward (which must have had targets and dloss != 0).
 * accumulate = 0 on the first micro-batch of a step (gradients overwritten). */
void model_backward(Model *m, int accumulate);

/* Host copy of logits row (b, t) after a forward without targets: Vp floats
 * (converted from the activation dtype). */
void model_logits_row(const Model *m, int b, int t, float *out);

/* Counts. */
size_t model_num_params(const Model *m);
size_t model_num_nonembedding_params(const Model *m);
/* Training FLOPs per token: 6 x (non-embedding params + head C*V) plus the
 * attention term 6 * n_layer * T * C (causal: half of 12 L T C). */
double model_flops_per_token(const ModelShape *s, int T);
/* Bytes of the activation arena for micro-batch B x T, activations of
 * act_bytes each (statistics and losses fp32), recomputing per `r`: exactly
 * what model_plan_activations allocates. Every buffer is rounded up to 64
 * bytes; with X = the (N,4C) and Y = the (N,C) buffer so rounded, GELU is
 * (L-1) X smaller than NONE (L kept, one shared), NORM_GELU (2L-1) Y more. */
size_t model_activation_bytes(const ModelShape *s, int B, int T, size_t act_bytes, ModelRecompute r);

/* Find a tensor by name; NULL if absent. */
const ParamInfo *model_find_param(const Model *m, const char *name);

/* Load an llm.c GPT-2 checkpoint (magic 20240326, version 3 = fp32) into the
 * parameters. Shape disagreements with the model exit 2 naming the file and
 * the differing field. */
void model_load_llmc(Model *m, const char *path);

#endif
