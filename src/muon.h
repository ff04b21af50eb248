/* muon: Muon distributed layer-wise (Megatron's and torchtitan's scheme):
 * each matrix has one dp owner, balanced by Newton-Schulz cost, that gets its
 * gradient, keeps its momentum, orthogonalises it and sends the update to the
 * ranks holding its parameters; an expert-parallel rank's experts have their
 * owners among the ranks holding the same experts (EDP); under tp one rank of
 * the owner's tp group orthogonalises the gathered parts. Knows comm, the optimizer's matrices and
 * ddp's pieces; never the architecture or the checkpoint. docs/optimizers.md. */
#ifndef KILN_MUON_H
#define KILN_MUON_H

#include <stddef.h>

#include "comm.h"
#include "ddp.h"
#include "optim.h"

/* A run of one matrix's elements that travels between a holder (a rank
 * whose optimizer part holds them) and the matrix's owner. */
typedef struct MuonPiece {
    int mat;      /* optim's matrix index */
    int peer;     /* the other side: the owner for a piece held here, the holder for one owned here */
    size_t shard; /* holder: where the run lies in its optimizer buffers (params, and grads under ZeRO 2/3) */
    size_t xfer;  /* its place in the exchange buffers (peer * block + k); unused when peer is this rank */
    size_t own;   /* owner: where the run lies in obuf (the matrix at its momentum offset) */
    size_t n;
} MuonPiece;

/* A matrix part in one of the tp exchanges: to the matrix's tp owner
 * (gather 1) or back from it (gather 0), at xfer in the exchange buffers. */
typedef struct MuonTpRun {
    int mat, peer, gather;
    size_t xfer, n;
} MuonTpRun;

/* The matrices whose owners are the ranks of one group, and their
 * exchanges: the dense matrices over the dp group (MUON_DENSE), an
 * expert-parallel rank's experts over its EDP group (MUON_EXPERTS: every
 * rank of it holds the same experts at the same arena offsets). */
enum { MUON_DENSE = 0, MUON_EXPERTS, MUON_PLANS };
typedef struct MuonPlan {
    CommGroup *g;       /* NULL: one rank, no communication */
    int n, rank;        /* the group's size, this rank's place in it */
    MuonPiece *held;    /* [nheld] runs of the plan's matrices in this rank's optimizer part, by matrix */
    MuonPiece *owned;   /* [nowned] runs of this rank's matrices held by other ranks, by matrix */
    int nheld, nowned;
    size_t block;       /* floats per rank pair in the all-to-alls (ZeRO 1-3), padding included;
                           ZeRO 0: each rank's block of the all-gather (its matrices, padded) */
    size_t base;        /* ZeRO 0: where this rank's block starts in obuf (its first matrix of the plan) */
    size_t moved;       /* floats each rank receives in one exchange, padding included */
    size_t pad_total;   /* floats of padding in one exchange, all ranks together */
    float *sbuf, *rbuf; /* device (n block): exchange buffers (ZeRO 0: rbuf only); NULL without g */
} MuonPlan;

typedef struct MuonDist {
    const Backend *be;
    CommGroup *g;       /* the dp group; NULL: one rank, no communication */
    int dp, rank, zero; /* zero: the stage in effect (ddp_zero) */
    int ep;             /* expert parallelism: dp rank d holds the experts of EDP rank d / ep (1: none) */
    int nmat;
    int *kind;          /* [nmat] MUON_DENSE or MUON_EXPERTS (the arena's expert range) */
    int *owner;         /* [nmat] its owner's rank in its plan's group */
    int *mine;          /* [nmat] 1 where this rank owns the matrix */
    double *cost;       /* [dp] Newton-Schulz FLOPs per step of each dp rank */
    MuonPlan plan[MUON_PLANS];
    float *obuf;        /* device (the owned matrices back to back, or a block): gradients, then updates */
    /* Tensor parallelism (tp > 1): the tp group of this rank (its members
     * share its dp place, so they own the same matrices). */
    CommGroup *tpg;
    int tp, tpr;
    int *towner;        /* [nmat] the tp rank that orthogonalises each matrix of this dp owner (-1: another's) */
    double *tcost;      /* [dp tp] Newton-Schulz FLOPs per step of each (dp, tp) rank */
    size_t *gpos;       /* [nmat] on its tp owner: where the whole matrix lies in gbuf */
    MuonTpRun *tsend, *trecv; /* [ntsend] [ntrecv] the parts this rank sends and receives over tp */
    int ntsend, ntrecv;
    size_t tblock, tmoved; /* floats per tp pair, padding included; received per exchange */
    float *gbuf;        /* device: the whole matrices this rank orthogonalises, back to back */
    float *tsbuf, *trbuf; /* device (tp tblock) */
    double ns_s, comm_s; /* seconds in the owners' work (momentum and Newton-Schulz) and blocked in exchanges */
} MuonDist;

/* Plan it for optimizer o (after optim_set_muon) over d's dp group: owners by
 * Newton-Schulz cost (longest first, each to the least loaded rank: the same
 * on every rank; under expert parallelism the experts first, over EDP, then
 * the dense matrices over dp), the runs each rank sends and receives, the buffers; the
 * optimizer keeps only this rank's momentum (optim_muon_own) and ddp runs the
 * step (ddp_set_muon). tp: the tensor-parallel group (NULL or size 1: none);
 * the matrices are this rank's parts (OptimMatrix.tp_dim). say: print the
 * assignment and the traffic. */
void muon_dist_init(MuonDist *md, AdamW *o, Ddp *d, CommGroup *tp, int say);
void muon_dist_free(MuonDist *md);
/* Muon's matrices for one step: gradients to owners (ZeRO 2/3), momentum and
 * Newton-Schulz there, updates to the holders, each holder's step. params:
 * this rank's optimizer part; grads: the whole gradient arena (ZeRO 0-1) or
 * the gradient shard (ZeRO 2-3). Returns the seconds blocked in exchanges. */
double muon_dist_step(MuonDist *md, AdamW *o, float *params, const float *grads, float lr, float grad_scale);
/* Newton-Schulz FLOPs of a rows x cols matrix, ns steps (the owner's cost). */
double muon_ns_flops(int rows, int cols, int ns);
/* The indices 0..n-1 by cost c, largest first (ties: the lower index first). */
int *muon_order_by_cost(const double *c, int n);
/* Each matrix i taken in `order` (with kind[i] == want; kind NULL: all) to
 * the least loaded of `ranks` (the lowest on a tie): owner[i], and its cost
 * added to load[]. How the run places matrices, and the planner counts them. */
void muon_place(const int *order, int n, const double *c, const int *kind, int want, int ranks, double *load,
                int *owner);
/* One line, the assignment: matrices and Newton-Schulz GFLOP per owner and
 * their imbalance, and the traffic per step beside AdamW's. */
void muon_dist_describe(const MuonDist *md, const AdamW *o, char *buf, size_t n);

#endif
