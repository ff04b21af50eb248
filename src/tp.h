/* tp: tensor (and sequence) parallelism's communication. The model computes
 * its own part of every layer (Megatron's split: model.h ModelTp,
 * arch_tp_split); this module runs the collectives it asks for over the tp
 * group, and sums the gradients that each tp rank has only a part of.
 * Never knows the optimizer, the data or the dp group (ddp.c reduces over
 * dp, after this module has summed over tp). docs/parallel.md "Tensor
 * parallelism". */
#ifndef KILN_TP_H
#define KILN_TP_H

#include "comm.h"
#include "model.h"

typedef struct Tp {
    Model *m;
    CommGroup *g;      /* the tp group (size 1: tp_init installs nothing) */
    int last;          /* the micro-batch being computed is the step's last */
    double blocked_s;  /* seconds in tp collectives since tp_step_begin */
    double total_s;    /* and since tp_init */
} Tp;

/* Install the model's tp collectives over g (model_set_tp). m must have been
 * built with ModelOptions.tp = g->size and tp_rank = g->rank. g may be NULL
 * or of size 1: nothing to do. */
void tp_init(Tp *t, Model *m, CommGroup *g);
void tp_free(Tp *t);

/* Before each micro-batch's forward: whether it is the step's first / last.
 * Partial gradients that accumulate over micro-batches (all but ZeRO-2/3's
 * layer gradients) are summed over tp once, on the last. */
void tp_micro_begin(Tp *t, int first, int last);

/* Wait, bounded by parallel.timeout_s, for the tp collectives still in
 * flight (on a GPU they are stream-ordered: comm_nccl_stream_ordered); after
 * the backward, before the host waits on the device. */
void tp_drain(Tp *t);

/* Seconds this rank spent blocked in tp collectives in the current step
 * (since the first micro-batch). On a GPU the collectives are ordered on the
 * device, so this is the host's enqueue and drain time, not the device's. */
double tp_step_blocked_s(const Tp *t);

#endif
