/* adafactor: Adafactor (Shazeer & Stern 2018) over this rank's optimizer
 * part: factored second moments of each 2-D tensor (row and column averages,
 * their sums over dp (over EDP for an expert-parallel rank's experts) and,
 * where tp splits, over tp), elementwise ones for the
 * rest, update clipping, relative step off. Knows the tensor table, ddp's
 * pieces and comm; never the data or the checkpoint (state.c asks
 * adafactor_state). docs/optimizers.md. */
#ifndef KILN_ADAFACTOR_H
#define KILN_ADAFACTOR_H

#include <stddef.h>

#include "comm.h"
#include "ddp.h"
#include "model.h"
#include "optim.h"

/* One tensor's run of elements in this rank's optimizer part. */
typedef struct AdafactorPiece {
    int tensor;   /* the model's table row */
    int fac;      /* its factored tensor (Adafactor.f), or -1: an elementwise second moment */
    size_t at, n; /* where the run lies in the params and grads ddp hands the optimizer, its length */
    size_t st;    /* where it lies in the optimizer state (m): at, but ZeRO-1 under ep packs the blocks */
    size_t toff;  /* its first element's index in the (local) tensor */
    size_t v;     /* not factored: where its second moment lies in Adafactor.v */
    int decay;
} AdafactorPiece;

/* A factored (2-D) tensor: every rank keeps its statistics, of this rank's
 * part under tp (rows x cols of the global grows x gcols). */
typedef struct AdafactorFactor {
    int tensor;
    int rows, cols, grows, gcols;
    int split, parts; /* tp: -1 not split, 0 rows, 1 columns; in `parts` blocks (GPT-2's q|k|v: 3) */
    int expert;       /* an expert-parallel rank's expert: its sums run over EDP, not dp */
    size_t r, c;      /* where its row (rows) and column (cols) vectors lie in sums and stat */
} AdafactorFactor;

typedef struct Adafactor {
    const Backend *be;
    CommGroup *dp, *tp; /* reduce over: dp when the runs are ZeRO shards, tp when tp > 1; else NULL */
    CommGroup *edp;     /* the experts' runs are ZeRO shards over EDP (ep > 1, ZeRO 1); else NULL */
    int tp_rank;
    float decay, clip, eps1, beta1;
    AdafactorPiece *p;
    int np;
    AdafactorFactor *f;
    int nf;
    int nt;             /* the model's tensors */
    double *numel;      /* [nt] elements of each global tensor */
    int *tsplit;        /* [nt] 1 if tp splits the tensor */
    int *texpert;       /* [nt] 1 if it is one of an expert-parallel rank's experts */
    size_t nstat, nsplit; /* floats of the statistics; the first nsplit are partial over tp */
    size_t ndense;      /* the first ndense are the dense tensors' (summed over dp), the rest the experts'
                           (over EDP) */
    float *sums, *stat; /* device (nstat): this step's row and column sums; their moving averages (state) */
    float *stat_host;   /* host (nstat) */
    double *rsum;       /* host (nf): the sum of each factored tensor's row averages */
    float *v;           /* device (nv): the second moments of the runs not factored (state) */
    size_t nv;
    double *usq_dev, *usq; /* device, host (np): each run's sum of the update's squares */
    double *q;          /* host (2 nt): each tensor's; the experts' first in [nt, 2 nt) (summed over EDP) */
} Adafactor;

/* Plan it over this rank's optimizer part (ddp's pieces) of model m, for
 * optimizer o (optim_set_adafactor first); tp: the tensor-parallel group
 * (NULL or size 1: none). Allocates the state (zero); ddp runs the step
 * (ddp_set_adafactor). */
void adafactor_init(Adafactor *a, AdamW *o, const Model *m, Ddp *d, CommGroup *tp, float decay, float clip,
                    float eps1);
void adafactor_free(Adafactor *a);
/* One step over the part: params and grads are this rank's optimizer
 * buffers (as ddp hands them to the optimizer). The norm check, clipping and
 * step count are optim's (optim_step_begin). */
OptimStepInfo adafactor_step(Adafactor *a, AdamW *o, float *params, const float *grads, float lr, double grad_norm);
/* Zero the state (a fresh start after a partial load). */
void adafactor_zero(Adafactor *a);

/* Entry k of the state this rank holds, for the checkpoint (0 past the
 * last): "optim.v_row/" (a factored tensor's row averages, a vector of its
 * global rows), "optim.v_col/" (columns), "optim.v/" (a run's elementwise
 * second moments: the tensor's elements [toff, toff + len), as the AdamW
 * moments). A vector lies at ptr (len floats, device) as `nbox` runs, run j
 * at ptr + at[j] being the global vector's [g0[j], g0[j] + n[j]); `part` 1
 * when they are this tp rank's own (a split), 0 when the whole vector, the
 * same on every tp rank. Every vector is the same on every dp rank (an
 * expert's: on every rank of its EDP group). */
typedef struct AdafactorState {
    const char *prefix;
    int tensor;
    float *ptr;
    size_t len, toff;
    int vector;       /* 1: a row or column vector (glen, boxes below); 0: a run of the tensor */
    size_t glen;
    size_t g0[3], n[3], at[3];
    int nbox, part;
} AdafactorState;
int adafactor_state(const Adafactor *a, int k, AdafactorState *s);

#endif
