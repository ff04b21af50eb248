/* ddp: data parallelism over the mesh's dp group — the gradient all-reduce in
 * buckets posted from inside the backward pass (ZeRO 0 and 1), the global
 * gradient norm, the optimizer step over this rank's shard and the parameter
 * all-gather; and the unit-sharded mode of ZeRO 2 and 3: per-layer
 * reduce-scatters of gradients from the model's layer hooks, and per-layer
 * parameter gathers (ZeRO-3) or refreshes after the optimizer step (ZeRO-2).
 * Knows the model's parameter table, the optimizer and comm; never the data,
 * metrics or checkpoints. With one rank every call is a plain local step,
 * bit-identical to before. */
#ifndef KILN_DDP_H
#define KILN_DDP_H

#include <stddef.h>

#include "comm.h"
#include "mesh.h"
#include "model.h"
#include "optim.h"

/* A bucket: up to three contiguous ranges of the gradient arena (one in the
 * weight-decayed group, one in the other, one among an expert-parallel
 * model's experts, which reduce over their own group), all of whose tensors
 * are complete once the backward pass has finished layer `layer` (-1: the
 * embeddings). */
#define DDP_GROUPS 3
typedef struct DdpBucket {
    int layer;
    size_t off[DDP_GROUPS], len[DDP_GROUPS]; /* floats; len 0 = no range in that group */
} DdpBucket;

/* Expert parallelism (a model with ep > 1): its expert tensors' gradients
 * reduce over edp (the ranks that hold the same experts: EDP), and their
 * squares join the gradient norm over ep (the ranks holding the others). */
typedef struct DdpExperts {
    CommGroup *edp, *ep;
} DdpExperts;

/* Declared here so callers can hold one by value; its fields are ddp.c's own
 * (other modules ask through the calls at the end of this file). */
typedef struct Ddp {
    Model *m;
    CommGroup *g;        /* the dp group (NULL or size 1: no communication) */
    int dp, rank, zero;
    ShardRange shard;    /* zero 1: this rank's block of the padded arena */
    DdpBucket *b;        /* [nb], in posting order (last layer first) */
    int nb, posted;
    CommRequest *req;    /* [DDP_GROUPS * nb] */
    int overlap;         /* 1: buckets are posted from the backward hook */
    int armed;           /* the hook posts buckets (between ddp_arm and ddp_reduce_grads) */
    /* Unit-sharded mode (units: ZeRO 2 or 3 over more than one rank). The
     * arena is laid out by unit (model_layout_by_unit: unit l < L is layer l,
     * unit L is wte, wpe and ln_f), each unit padded to dp equal blocks, and
     * this rank's block of every unit lies back to back in the shard buffers,
     * unit u's at at[u]. Each backward writes a layer's gradients fresh into
     * one of two slots (layer l in slot l % 2); they are reduce-scattered
     * right after that layer's backward and added into the gradient shard.
     * AdamW updates the fp32 parameter shard. Then:
     *   whole_params = 1 (ZeRO-2): the model's whole parameter arena stays
     *     resident; after the optimizer step each unit is all-gathered back
     *     into it (posted at once, waited for at the unit's first use);
     *   whole_params = 0 (ZeRO-3): only the shard stays; layers are gathered
     *     one ahead into two slots, wte/wpe/ln_f for a whole step. */
    int units, whole_params;
    int nu;                   /* units: n_layer + 1 */
    ShardRange *us;           /* [nu] this rank's part of each unit (unit-local offsets) */
    size_t *at;               /* [nu] where unit u's block starts in the shard buffers */
    size_t shard_len;         /* sum of the blocks */
    float *pshard, *gshard;   /* device (shard_len): fp32 parameters; summed gradients */
    OptimSegment *seg;        /* [nseg] runs of one tensor inside the shard, for AdamW */
    int nseg;
    size_t slot_len;          /* floats of a layer slot: the largest layer unit */
    float *gbuf[2];           /* device (slot_len): this rank's gradients of layers l, l % 2 == slot */
    float *rs_tmp[2];         /* device (layer block): reduce-scatter targets */
    float *grest;             /* device (unit L): wte/wpe/ln_f gradients, accumulated over
                                 the step's micro-batches, reduce-scattered after the last */
    CommRequest rreq[2];      /* reduce-scatters from gbuf[slot] in flight */
    int rlayer[2];            /* layer of rreq[slot] */
    /* ZeRO-3 only (whole_params = 0) */
    float *pbuf[2];           /* device (slot_len): gathered parameters of layers l, l % 2 == slot */
    float *prest;             /* device (unit L): wte/wpe/ln_f, held gathered for the whole
                                 forward and backward */
    int held[2];              /* layer pbuf[slot] holds (-1 none); valid until the optimizer step */
    int rest_held;
    CommRequest greq[2];      /* gathers into pbuf[slot] in flight */
    /* ZeRO-2 only (whole_params = 1) */
    CommRequest *preq;        /* [nu] all-gathers of unit u into the whole arena, in flight
                                 from the optimizer step until the unit's next use */
    int *refreshed;           /* [nu] ZeRO-2: a refresh was posted since the unit was last used
                                 (its compute copy must be cast again) */
    int first, last;          /* the micro-batch being computed is the step's first / last (a
                                 pipeline: last, the backward that completes its chunk's gradients) */
    /* Pipeline parallelism (ddp_set_pp before ddp_shard_params): a stage's
     * micro-batches interleave forwards and backwards (and zb_h1 splits a
     * backward in two), so a layer's gradients do not fit two slots. They
     * accumulate whole over the step in gacc instead (the stage's gradients,
     * unit by unit at unit_off), and each unit is reduce-scattered once,
     * straight into its shard: a layer's after its chunk's last backward,
     * wte/wpe/ln_f's in ddp_reduce_grads. A stage holding a tied embedding's
     * copy (tied) all-reduces that unit whole in ddp_wait_grads instead, as
     * ZeRO 0-1 do, before the copies are summed (pipe_tie_grads), then takes
     * its block: both copies then get the same bits, whatever order the dp
     * collective adds in (a reduce-scatter's blocks of the two stages' units
     * lie differently). */
    int accum_grads, tied;
    int rest_reduced;         /* tied: unit n_layer is all-reduced in gacc this step */
    float *gacc;              /* device (arena_len): the stage's gradients, accumulate_grads only */
    CommRequest *ureq;        /* [nu] reduce-scatter of unit u from gacc into the shard */
    int *rs_posted;           /* [nu] this step's reduce-scatter of unit u was posted */
    /* Tensor parallelism (ddp_set_tp): the gradient norm adds this rank's
     * parts of the tp-split tensors and, on tp rank 0 only, the replicated
     * ones, then sums over tp. runs: arena ranges [lo, hi) of tensors that
     * are split (split 1) or replicated (0), in arena order. */
    int poison;          /* ddp_test_poison: the next ddp_reduce_grads poisons its gradients */
    CommGroup *tp;
    size_t *run_lo, *run_hi;
    int *run_split, nrun;
    /* Expert parallelism (DdpExperts): the arena's [0, dense0) holds this
     * rank's experts (model.h expert_len), the tensors that reduce over dp
     * lie after it. eg: EDP (NULL when of size 1: an expert's gradient is
     * whole on its one holder); epg: the ep group. ZeRO-1 shards the dense
     * range over dp (shard, relative to dense0) and the expert range over
     * EDP (xshard); the optimizer's state then holds the two blocks back to
     * back (zseg: its segments; ddp_shard_piece: its pieces). */
    CommGroup *eg, *epg;
    size_t dense0;
    ShardRange xshard;
    size_t xlen;         /* the expert range's length before ZeRO-1 padded it (xshard's n) */
    OptimSegment *zseg;
    int nzseg;
    /* Pipeline parallelism (ddp_set_pp): the norm also sums over the pp
     * group, leaving out arena range [skip_lo, skip_hi) (a tied embedding's
     * second copy, on the last stage) */
    CommGroup *pp;
    size_t skip_lo, skip_hi;
    struct MuonDist *muon;    /* optim.name muon: its distributed step (ddp_set_muon), else NULL */
    struct Adafactor *adafactor; /* optim.name adafactor: its step (ddp_set_adafactor), else NULL */
    /* time this rank spent blocked in communication, and step count, since
     * ddp_init: the part of communication not hidden behind computation */
    double blocked_s, step_blocked_s;
} Ddp;

/* Plan buckets of about bucket_bytes (25 MB is PyTorch DDP's default) from
 * the model's parameter table (ZeRO 0-1; for zero 1 the arenas are padded to
 * the shard layout, keeping values); for zero 2-3 over more than one rank lay
 * the model's arena out by unit and plan the unit shards (before weights are
 * initialised or loaded; then ddp_shard_params). g may be NULL for one rank;
 * ZeRO 2 and 3 on one rank are plain training (zero becomes 0). ex: the
 * expert groups of a model with ep > 1 (ZeRO 0 or 1 only), else NULL. */
void ddp_init(Ddp *d, Model *m, CommGroup *g, int zero, size_t bucket_bytes, const DdpExperts *ex);
/* ZeRO-2/3 pad each unit (a layer; wte/wpe/ln_f) to a multiple of this many
 * floats (64 x dp): the planner counts the same padded units. */
size_t ddp_unit_align(int dp);
void ddp_free(Ddp *d);
/* The shard of the optimizer state this rank owns: [lo, hi) of the arena
 * (the whole arena for zero 0). */
void ddp_optim_range(const Ddp *d, size_t *lo, size_t *hi);

/* Before the backward pass of the step's last micro-batch: install the hook
 * that posts each bucket's all-reduce as soon as its layer is done. */
void ddp_arm(Ddp *d);
/* Before each micro-batch's forward: first / last of the step. Arms the
 * bucket hook on the last (ddp_arm); ZeRO-2/3 keep their hooks installed and
 * need to know where gradients go (overwrite, add, reduce-scatter). */
void ddp_micro_begin(Ddp *d, int first, int last);
/* Pipeline parallelism, before each compute of a schedule: first, the step's
 * first compute; last_of_chunk, a backward (whole or weight part) that
 * completes its chunk's gradients (ZeRO-2/3 then reduce-scatter each layer
 * as it finishes); last_of_rank, the rank's last one (ZeRO 0-1 post their
 * buckets from it, when every chunk is complete). */
void ddp_pipe_begin(Ddp *d, int first, int last_of_chunk, int last_of_rank);
/* ZeRO-2/3, after the weights are initialised or loaded into the model's
 * whole arena: copy this rank's blocks into the fp32 parameter shard (ZeRO-3
 * then frees the whole arena), allocate the gradient shard and slots (and
 * ZeRO-3's gather buffers), point the views at them and install the layer
 * hooks. Nothing for other stages. */
void ddp_shard_params(Ddp *d);
/* ZeRO-2, after a resume loaded the whole parameters into the model's arena:
 * take this rank's blocks into the fp32 shard again (a local copy). Nothing
 * for other stages (ZeRO-3 loads its shard directly). */
void ddp_params_loaded(Ddp *d);
/* ZeRO-2: wait for the parameter refreshes still in flight (before a
 * checkpoint, which may outlast parallel.timeout_s, and at the end). The
 * model's forward waits for each unit by itself; nothing for other stages. */
void ddp_params_ready(Ddp *d);
/* After the last backward: complete the gradient reduction (wait for the
 * buckets or the last reduce-scatters) and return the global gradient norm
 * (L2, before clipping) of the summed gradients. */
double ddp_reduce_grads(Ddp *d);
/* ZeRO 0-1: the first half of ddp_reduce_grads alone, every bucket posted
 * and waited for (the gradient arena is reduced and free to touch); the
 * call after it then only computes the norm. ZeRO 2-3 in a pipeline stage
 * with a tied embedding's copy: its wte/wpe/ln_f unit all-reduced, whole
 * (the other units are ddp_reduce_grads'). */
void ddp_wait_grads(Ddp *d);
/* One rank, nothing to exchange (train.c's one-rank step, whose norm
 * optim_step_device takes on the device): what ddp_reduce_grads does but
 * the norm (the test hook's poison). Exits 1 on a layout with a collective. */
void ddp_reduce_grads_local(Ddp *d);
/* 1 when each ddp_optim_step updates this rank's whole arena in one
 * optimizer range and nothing after it changes the parameters (ZeRO 0, or
 * one rank: no shard, no gather), so the update may write the compute copy
 * (optim_set_copy). */
int ddp_whole_update(const Ddp *d);
/* AdamW over this rank's part with the global norm, then the all-gather that
 * gives every rank the updated parameters (ZeRO-1: blocking; ZeRO-2: posted
 * per unit and waited for in the next forward; ZeRO-3: none, the next forward
 * gathers). Same return as optim_step_norm; with a non-finite norm nothing is
 * updated anywhere. */
OptimStepInfo ddp_optim_step(Ddp *d, AdamW *o, float lr, double grad_norm);

/* Floats of gradient storage this rank holds: the whole arena (ZeRO 0-1), or
 * the shard + two layer slots + reduce-scatter targets + wte/wpe/ln_f's
 * buffer (ZeRO 2-3). What the start-up line reports. */
size_t ddp_grad_floats(const Ddp *d);

/* Tensor parallelism: the model's tensors are this rank's parts (ModelOptions.tp);
 * the global gradient norm then also sums over the tp group g, counting each
 * replicated tensor once. After ddp_init. g NULL or size 1: nothing. */
void ddp_set_tp(Ddp *d, CommGroup *g);

/* Pipeline parallelism: the model is one stage of pp; the global gradient
 * norm also sums over the pp group g, counting every parameter once: tensor
 * `skip` (a table index, or -1) is left out here (the last stage's copy of a
 * tied embedding, which the first stage counts). tied: this stage holds a
 * copy of a tied embedding (the first or the last). ZeRO-2/3 accumulate the
 * stage's gradients over the step (Ddp.accum_grads). After ddp_init and
 * ddp_set_tp, before ddp_shard_params. g NULL or size 1: nothing. */
void ddp_set_pp(Ddp *d, CommGroup *g, int skip, int tied);

/* Test hook (testhooks.h inject_nan_step): the next ddp_reduce_grads writes a
 * NaN into the first gradient element on this rank once the reduction is
 * complete, before the norm: no collective is in flight on the buffer then
 * (poisoning it earlier raced with ZeRO 0/1's overlapped all-reduces). */
void ddp_test_poison(Ddp *d);

/* Sum of x over the dp group (losses for logging), in double. */
double ddp_sum(Ddp *d, double x);
/* x[0..n) summed over the dp group in place, one collective. */
void ddp_sum_n(Ddp *d, double *x, size_t n);

/* What other modules ask of a Ddp (checkpoints, the step loop's logs and
 * test hooks). */

/* Ranks in the dp group (1: no communication). */
int ddp_ranks(const Ddp *d);
/* 1 while the model's whole parameter arena lives on this rank (all stages
 * but ZeRO-3). */
int ddp_whole_params(const Ddp *d);
/* ZeRO-2/3: the fp32 parameter shard the optimizer updates, device (*n
 * floats; n may be NULL); NULL and *n = 0 for other stages (the optimizer
 * updates the model's arena). */
float *ddp_param_shard(const Ddp *d, size_t *n);
/* The gradients this rank's optimizer reads, device: the gradient shard
 * (ZeRO-2/3) or the model's gradient arena. */
float *ddp_optim_grads(const Ddp *d);

/* ZeRO-2/3: one unit's block on this rank. Blocks lie back to back in the
 * parameter shard and in the optimizer moments; at is where this one
 * starts there, [lo, hi) its real elements in the model's arena (floats).
 * ZeRO-1 under expert parallelism: the dense block and the expert block,
 * back to back in the moments only (the parameters stay in the arena). */
typedef struct DdpPiece {
    size_t at, lo, hi;
    size_t par; /* where its parameters and gradients lie in the buffers ddp_optim_step hands the
                   optimizer: at, but the arena element lo under ZeRO-1 with expert parallelism */
} DdpPiece;
/* Piece i of this rank's shard into *p; 0 past the last (at once for
 * stages other than ZeRO-2/3 and ZeRO-1 under expert parallelism). */
int ddp_shard_piece(const Ddp *d, int i, DdpPiece *p);
/* 1 when the optimizer's state is laid out by ddp_shard_piece's pieces
 * (ZeRO-2/3, and ZeRO-1 under expert parallelism) rather than as arena
 * range [lo, hi) of ddp_optim_range. */
int ddp_optim_pieces(const Ddp *d);

/* Piece i of rank `rank`'s optimizer part: arena elements [lo, hi) stored
 * at `at` in that rank's optimizer state and at `par` in the params and
 * grads that ddp_optim_step hands the optimizer: ZeRO 0 the whole arena,
 * ZeRO 1 its block of the padded arena (at 0, i = 0 only), ZeRO 2/3 its
 * block of unit i; ZeRO 1 under expert parallelism its dense block (i = 0)
 * and the expert block of its EDP rank (i = 1; the range in that rank's own
 * arena, which holds its experts). 0 past the last. What muon.c plans its
 * exchanges with and adafactor.c its runs. */
int ddp_rank_piece(const Ddp *d, int rank, int i, DdpPiece *p);
/* The ZeRO stage in effect (0 on one rank for any parallel.zero), the dp
 * group (NULL for one rank) and this rank's place in it. */
int ddp_zero(const Ddp *d);
CommGroup *ddp_group(const Ddp *d);
int ddp_rank(const Ddp *d);
/* Expert parallelism (ep > 1): the arena's [0, ddp_expert_len) holds this
 * rank's experts (0 without ep); ddp_expert_group their EDP group (NULL
 * when each expert has one holder, or without ep); ddp_expert_peer the dp
 * group's rank of EDP rank e of this rank's EDP group. */
size_t ddp_expert_len(const Ddp *d);
CommGroup *ddp_expert_group(const Ddp *d);
int ddp_expert_peer(const Ddp *d, int e);
/* Muon distributed over the dp group (muon.c): ddp_optim_step runs its
 * step after the elementwise part, before the parameters travel. */
struct MuonDist;
void ddp_set_muon(Ddp *d, struct MuonDist *md);
/* Adafactor (adafactor.c): ddp_optim_step runs its step instead of the
 * elementwise optimizer's. */
struct Adafactor;
void ddp_set_adafactor(Ddp *d, struct Adafactor *a);

/* Seconds this rank spent blocked in communication in the current step
 * (reset as it begins): after ddp_optim_step, the whole step's. */
double ddp_step_blocked_s(const Ddp *d);
/* The start-up lines (one rank: none, return 0): how the state is split
 * and what is sent when; the gradient buffers held here. */
int ddp_describe_layout(const Ddp *d, char *buf, size_t len);
int ddp_describe_memory(const Ddp *d, char *buf, size_t len);

#endif
