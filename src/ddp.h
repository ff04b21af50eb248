/* ddp: data parallelism over the mesh's dp group — the gradient all-reduce in
 * buckets posted from inside the backward pass (ZeRO 0 and 1), the
 * reduce-scatter of ZeRO-2, the global gradient norm, the optimizer step over
 * this rank's shard and the parameter all-gather; ZeRO-3's per-layer gathers
 * and reduce-scatters from the model's layer hooks. Knows the model's parameter
 * table, the optimizer and comm; never the data, metrics or checkpoints.
 * With one rank every call is a plain local step, bit-identical to before. */
#ifndef KILN_DDP_H
#define KILN_DDP_H

#include <stddef.h>

#include "comm.h"
#include "mesh.h"
#include "model.h"
#include "optim.h"

/* A bucket: up to two contiguous ranges of the gradient arena (one in the
 * weight-decayed group, one in the other), all of whose tensors are complete
 * once the backward pass has finished layer `layer` (-1: the embeddings). */
typedef struct DdpBucket {
    int layer;
    size_t off[2], len[2]; /* floats; len 0 = no range in that group */
} DdpBucket;

typedef struct Ddp {
    Model *m;
    CommGroup *g;        /* the dp group (NULL or size 1: no communication) */
    int dp, rank, zero;
    ShardRange shard;    /* zero >= 1: this rank's block of the padded arena */
    float *grad_shard;   /* zero 2: device (block) reduce-scatter target */
    DdpBucket *b;        /* [nb], in posting order (last layer first) */
    int nb, posted;
    CommRequest *req;    /* [2 * nb] */
    int overlap;         /* 1: buckets are posted from the backward hook */
    /* ZeRO-3 (z3: zero 3 over more than one rank): parameters, gradients
     * and optimizer state are sharded unit by unit (model_layout_by_unit:
     * unit l < L is layer l, unit L is wte, wpe and ln_f). Each unit's arena
     * range is split with mesh_shard_range; this rank's blocks lie back to
     * back in the shard buffers, unit u's at at[u]. */
    int z3;
    int nu;                   /* units: n_layer + 1 */
    ShardRange *us;           /* [nu] this rank's part of each unit (unit-local offsets) */
    size_t *at;               /* [nu] where unit u's block starts in the shard buffers */
    size_t shard_len;         /* sum of the blocks */
    float *pshard, *gshard;   /* device (shard_len): parameters; summed gradients */
    OptimSegment *seg;        /* [nseg] runs of one tensor inside the shard, for AdamW */
    int nseg;
    float *pbuf[2], *gbuf[2]; /* device (layer unit padded): gathered parameters and
                                 this rank's gradients of layers l with l % 2 == slot */
    float *rs_tmp[2];         /* device (layer block): reduce-scatter targets */
    float *prest, *grest;     /* device (unit L padded): wte/wpe/ln_f, held gathered
                                 for the whole forward and backward */
    int held[2];              /* layer pbuf[slot] holds (-1 none); valid until the optimizer step */
    int rest_held;
    CommRequest greq[2];      /* gathers into pbuf[slot] in flight */
    CommRequest rreq[2];      /* reduce-scatters from gbuf[slot] in flight */
    int rlayer[2];            /* layer of rreq[slot] */
    int first, last;          /* the micro-batch being computed is the step's first / last */
    /* time this rank spent blocked in communication, and step count, since
     * ddp_init: the part of communication not hidden behind computation */
    double blocked_s, step_blocked_s;
} Ddp;

/* Plan buckets of about bucket_bytes (25 MB is PyTorch DDP's default) from
 * the model's parameter table; for zero 3 lay the model's arena out by unit
 * (before weights are initialised or loaded; then ddp_shard_params); for zero 1-2 pad the model's arenas to the
 * shard layout (call before weights are loaded or initialised is not needed:
 * padding keeps values). g may be NULL for one rank. */
void ddp_init(Ddp *d, Model *m, CommGroup *g, int zero, size_t bucket_bytes);
void ddp_free(Ddp *d);
/* The shard of the optimizer state this rank owns: [lo, hi) of the arena
 * (the whole arena for zero 0). */
void ddp_optim_range(const Ddp *d, size_t *lo, size_t *hi);

/* Before the backward pass of the step's last micro-batch: install the hook
 * that posts each bucket's all-reduce as soon as its layer is done. */
void ddp_arm(Ddp *d);
/* Before each micro-batch's forward: first / last of the step. Arms the
 * bucket hook on the last (ddp_arm); ZeRO-3 keeps its hooks installed and
 * needs to know where gradients go (overwrite, add, reduce-scatter). */
void ddp_micro_begin(Ddp *d, int first, int last);
/* ZeRO-3, after the weights are initialised or loaded into the model's whole
 * arena: keep this rank's blocks, free the whole arenas and point the views
 * at the gather buffers. Nothing for other stages. */
void ddp_shard_params(Ddp *d);
/* After the last backward: complete the gradient reduction (wait for the
 * buckets, or reduce-scatter for ZeRO-2) and return the global gradient norm
 * (L2, before clipping) of the summed gradients. */
double ddp_reduce_grads(Ddp *d);
/* AdamW over this rank's part with the global norm, then (zero >= 1) the
 * all-gather that gives every rank the updated parameters. Same return as
 * optim_step_norm; with a non-finite norm nothing is updated anywhere. */
OptimStepInfo ddp_optim_step(Ddp *d, AdamW *o, float lr, double grad_norm);

/* Sum of x over the dp group (losses for logging), in double. */
double ddp_sum(Ddp *d, double x);

#endif
