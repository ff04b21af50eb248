/* ep: expert parallelism's exchanges: an MoE layer's routed token rows to
 * the ranks holding their experts and back, by all-to-all over the ep group,
 * forward and backward; owns the expert side's buffers. Never knows the
 * optimizer, the data or the dp group (ddp.c reduces expert gradients over
 * EDP). docs/parallel.md "Expert parallelism". */
#ifndef KILN_EP_H
#define KILN_EP_H

#include <stdint.h>

#include "comm.h"
#include "model.h"

/* The expert side of one MoE layer on this rank for one activation slot
 * (model_plan_slots: a micro-batch a pipeline keeps in flight): what the
 * slot's last forward dispatch received, kept for its backward. */
typedef struct EpLayer {
    int32_t *recv_cnt, *send_cnt; /* host (ep, El): rows from / to each rank, per local expert of the
                                     receiver (rank-major) */
    int32_t *off;                 /* host (El + 1): local expert j's rows [off[j], off[j+1]) */
    int rows;                     /* received: off[El] */
    size_t cap;                   /* rows the buffers below hold */
    void *x, *h, *h_act;          /* device (cap,C) (cap,2Fe) (cap,Fe) act: expert-major rows and the
                                     forward's activations (model.recompute selective: no h_act, the
                                     shared one's) */
    int32_t *to_expert, *to_source; /* device (cap): expert-major row r is received row to_expert[r];
                                       received row q is expert-major row to_source[q] */
} EpLayer;

typedef struct Ep {
    Model *m;
    CommGroup *g;          /* the ep group (size 1: ep_init installs nothing) */
    int ep, rank, El;      /* ranks, this one's place, experts per rank */
    int dropless;          /* model.moe.capacity_factor 0: receive buffers grow when a step needs it */
    EpLayer *layer;        /* [n_slots][n_layer]: the model's activation slots, each its chunk's layers
                              (cap 0 elsewhere) */
    int n_slots;           /* the model's activation slots at ep_init */
    int layer_sets;        /* (slot, layer) pairs with buffers */
    /* shared by the layers, one layer at a time (wcap rows) */
    size_t wcap;
    void *wire;            /* device (wcap,C) act: rows as they cross the wire, in rank order */
    void *y;               /* device (wcap,C) act: the experts' outputs; the backward's dy */
    void *dx, *dh, *dh_act;/* device (wcap,C) (wcap,2Fe) (wcap,Fe) act: the backward's scratch */
    void *h_act;           /* model.recompute selective: device (wcap,Fe) act, every layer's SwiGLU output
                              (the backward makes it again from the layer's h); else NULL */
    float *cnt_dev;        /* device (2 ep El): counts through the all-to-all (exact integers) */
    float *cnt_host;       /* host (2 ep El) */
    size_t *sc, *rc;       /* host (ep): elements to / from each rank for comm_all_to_allv */
    int32_t *idx_host;     /* host (2 wcap): building the permutations */
    int32_t *cursor;       /* host (El): the same */
    double *gathered;      /* host (3 world): ep_step_figures' all-gather, made at its first call */
    /* figures since ep_step_begin (training forwards' dispatches) */
    int64_t sent, recv, rows; /* rows to other ranks, from other ranks, run by this rank's experts */
    double blocked_s;      /* seconds in the ep group's collectives since ep_step_begin */
    size_t grown_to;       /* dropless: the rows a layer's buffers grew to since ep_step_begin (0: none) */
} Ep;

/* Rows each layer's buffers hold at start on an ep rank, for micro-batches
 * of B sequences of T tokens, T / cp of each on this rank under context
 * parallelism (ep_init's sizing, see below), and the bytes of the expert
 * side's buffers (layer_sets (slot, layer) pairs' and the shared ones:
 * n_layer without a pipeline), act_bytes per activation: what ./train plan
 * counts. Arithmetic only. */
size_t ep_plan_rows(const ArchSpec *s, int ep, int cp, int B, int T);
size_t ep_buffer_bytes(const ArchSpec *s, int ep, int cp, int layer_sets, int B, int T, size_t act_bytes,
                       ModelRecompute r);

/* Install the model's ep exchanges over g (model_set_ep) and allocate the
 * expert side's buffers for the planned micro-batch, one set per activation
 * slot (a pipeline's micro-batches in flight): after model_plan_activations
 * or model_plan_slots. m must have been built with ModelOptions.ep =
 * g->size and ep_rank = g->rank. Capacity mode: every buffer holds the most
 * rows the per-sequence capacity lets the ep ranks send here, so nothing is
 * ever allocated again; dropless: twice the balanced share (ep 2: the
 * worst case), grown (by a quarter more than needed) when a layer receives
 * more, which ep_step_begin's caller learns from grown_to. g may be NULL or
 * of size 1: nothing to do. */
void ep_init(Ep *e, Model *m, CommGroup *g);
void ep_free(Ep *e);

/* The start of a step: the figures count from zero. */
void ep_step_begin(Ep *e);

/* The step's figures of every rank in the world, gathered (a collective
 * over `world`, every rank calls it): rows sent to other ranks, received
 * from them and run by the rank's experts, summed over layers and
 * micro-batches; and the load imbalance, the most rows any rank's experts
 * ran over the mean. sent, recv, rows: (world) arrays the caller holds. */
typedef struct EpFigures {
    double *sent, *recv, *rows; /* (world) */
    double imbalance;           /* max rows / mean rows (1: balanced; 0: no rows) */
} EpFigures;
void ep_step_figures(Ep *e, CommGroup *world, EpFigures *out);

/* Seconds this rank spent in the ep group's collectives in the current step
 * (since ep_step_begin), counts and rows, forward and backward. */
double ep_step_blocked_s(const Ep *e);

/* The start-up line (ep 1: none, return 0): experts here and the buffers. */
int ep_describe(const Ep *e, char *buf, size_t len);

#endif
