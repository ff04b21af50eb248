/* pipe: pipeline parallelism. The stages (contiguous layer ranges balanced by
 * cost), the schedules as data (a pure builder of every rank's action list
 * and a checker that simulates all the lists together), the text timeline,
 * and the executor that runs one rank's list on a model (pipe_exec.c). The
 * builder and checker know no model, backend or comm; the executor never
 * touches the optimizer, the data loader or metrics files. docs/parallel.md
 * "Pipeline parallelism". */
#ifndef KILN_PIPE_H
#define KILN_PIPE_H

#include <stddef.h>

#include "arch.h"

/* ---------------------------------------------------------------- stages */

/* Virtual stage s = c * pp + r runs chunk c of rank r (Megatron's interleaved
 * placement; v = 1: stage s is rank s). Layers of virtual stage s: [cut[s],
 * cut[s+1]); the embeddings go with layer 0, the final norm, head and loss
 * with the last layer. */
#define PIPE_MAX_STAGES 256 /* virtual stages: pp x pp_virtual */

/* Cut n_layer layers into V = pp * v contiguous stages: from `given` (V layer
 * counts, parallel.pp_layers; NULL or n_given 0: balanced), else minimising
 * the costliest stage (every layer costs its FLOPs, the last stage also the
 * head's and loss's), ties to the most even. cut has V + 1 entries. Returns 0,
 * or -1 with one line in err naming the keys. */
int pipe_plan_stages(const ArchSpec *s, int pp, int v, const int *given, int n_given, int *cut, char *err,
                     size_t errn);

/* ---------------------------------------------------------------- schedules */

typedef enum { PIPE_GPIPE, PIPE_1F1B, PIPE_INTERLEAVED, PIPE_ZB_H1 } PipeKind;
/* "gpipe", "1f1b", "interleaved_1f1b", "zb_h1" and back; parse returns -1 on anything else */
int pipe_kind_parse(const char *name);
const char *pipe_kind_name(PipeKind k);

typedef enum {
    PIPE_FWD,     /* forward of (micro, chunk) */
    PIPE_BWD,     /* its whole backward: input and weight gradients */
    PIPE_BWD_IN,  /* the input-gradient part (zb_h1's B) */
    PIPE_BWD_W,   /* the weight-gradient part (zb_h1's W), after its BWD_IN */
    PIPE_SEND,    /* post a non-blocking send to `peer` */
    PIPE_RECV     /* post a non-blocking receive from `peer` */
} PipeOp;

typedef enum { PIPE_ACT, PIPE_GRAD } PipeData; /* a stage's output activation; the gradient of its input */

/* One action of a rank's list. SEND: the data of (micro, chunk) this rank
 * made (ACT: chunk's output, to the next virtual stage; GRAD: the gradient
 * of chunk's input, to the previous one). RECV: the data chunk `chunk` of
 * this rank consumes (ACT: its input; GRAD: its output's gradient). slot:
 * the activation slot of (micro, chunk) on this rank (FWD, BWD*, RECV, SEND). */
typedef struct PipeAction {
    PipeOp op;
    PipeData data;
    int micro, chunk, peer, slot;
} PipeAction;

typedef struct PipeSchedule {
    PipeKind kind;
    int pp, v, micro;     /* ranks, chunks per rank, micro-batches per step */
    int *n;               /* [pp] actions of each rank */
    PipeAction **a;       /* [pp][n[r]] */
    int *slots;           /* [pp * v] activation slots chunk c of rank r holds: slots[r * v + c] */
} PipeSchedule;

/* What a schedule cannot run: one line naming the keys, -1; else 0
 * (interleaved needs v >= 2, micro-batches a multiple of pp and at least pp;
 * the others v = 1; every schedule pp >= 2). */
int pipe_check_shape(PipeKind k, int pp, int v, int micro, char *err, size_t errn);
/* Build every rank's list (pipe_check_shape first: exits 2 on a refused
 * shape). Pure: the same inputs give the same lists. */
void pipe_build(PipeSchedule *s, PipeKind k, int pp, int v, int micro);
void pipe_schedule_free(PipeSchedule *s);

/* Simulate all ranks' lists together. Posts never block; a FWD (BWD) waits
 * for its activation (gradient) to arrive, i.e. for the peer's SEND; a
 * compute that overwrites a slot's outgoing buffer waits for that earlier
 * SEND to be received; every send is waited for at the end. Rejects, with one
 * line naming the rank, action index and action: a compute whose input has
 * no receive posted before it, a backward before its forward (a weight part
 * before its input part), a repeated or missing action, a send without its
 * receive or a receive without its send (also out of order on one channel,
 * which NCCL would match wrongly), a slot reused while in use, and a
 * deadlock (each blocked rank and what it waits for). Returns 0 or -1. */
int pipe_check(const PipeSchedule *s, char *err, size_t errn);

/* "F m3 c1", "send act m3 c1 -> 2", ... (for messages and the timeline) */
void pipe_action_text(const PipeAction *a, char *buf, size_t n);

/* Unit-cost simulation of the lists (forward 1, whole backward 2, its input
 * and weight parts 1 each; messages free): the schedule's own bubble, idle
 * time over the step, the same on every rank's average: (p-1)/(m+p-1) for
 * 1F1B, i.e. the textbook (p-1)/m of the compute. Needs a valid schedule. */
double pipe_theory_bubble(const PipeSchedule *s);
/* The textbook formula as a fraction of the compute: (p-1)/m for gpipe and
 * 1F1B, (p-1)/(v m) interleaved, (p-1)/(3m) zb_h1 (a third of 1F1B's). */
double pipe_formula_bubble(PipeKind k, int pp, int v, int micro);

/* The timeline of that simulation as text: one row per rank, one cell per
 * time unit ("F3" forward of micro-batch 3, "B3 B3" its whole backward; zb_h1
 * "B3" its input part and "W3" its weight part; "." idle; interleaved cells
 * carry the chunk as a letter, "F3a" chunk 0). Returns the malloc'd text. */
char *pipe_timeline(const PipeSchedule *s);

/* ---------------------------------------------------------------- the executor (pipe_exec.c) */

#include "comm.h"
#include "model.h"

/* What the step loop does before each compute of a schedule: backward, a
 * backward or a part of one (else a forward); first, the step's first
 * compute; last_of_chunk, a backward (whole or weight part) of its chunk's
 * last micro-batch, whose grads_done hooks complete the chunk's gradients;
 * last_of_rank, the rank's last such backward. train.c points the
 * heartbeat's phase, ddp and tp at these (ddp_micro_begin, tp_micro_begin). */
typedef struct PipeHooks {
    void *ctx;
    void (*compute_begin)(void *ctx, int backward, int first, int last_of_chunk, int last_of_rank);
} PipeHooks;

/* One rank's pipeline: its schedule, model and channels. The channels are
 * two-rank groups split from the pp group, one per direction and kind of
 * data (activations to the next stage, gradients to the previous), so that
 * NCCL, which serialises a communicator's operations, sees each channel's
 * messages in the one order the checker verified. */
typedef struct Pipe {
    PipeSchedule sched;
    Model *m;
    CommGroup *pp;           /* the pp group: losses, evaluation's forward, the sampled token */
    CommGroup act_out, act_in, grad_out, grad_in; /* channels (size 0: none at this end) */
    CommGroup embed;         /* tied embeddings: the first and the last stage (size 0 elsewhere) */
    int stage, p, v, micro;  /* this rank's place, pp, chunks per rank, micro-batches per step */
    int B, T;
    int cut[PIPE_MAX_STAGES + 1]; /* layers of virtual stage s: [cut[s], cut[s+1]) */
    int32_t *tok, *tgt;      /* (micro, B T) host: the step's micro-batches (pipe_batch) */
    CommRequest *act_in_req, *grad_in_req, *act_out_req, *grad_out_req; /* [model slots]: the latest on each slot */
    int *act_in_micro, *grad_in_micro; /* [model slots]: micro-batch of the step's latest receive into each, -1 none */
    int last_backward;       /* index in this rank's list of its last backward (whole or weight part) */
    int tie;                 /* the embedding gradient is summed with the other end's */
    double idle_s;           /* this step: seconds waiting for a neighbour (receives, sends, the drain) */
    double theory;           /* the schedule's own bubble (pipe_theory_bubble) */
} Pipe;

/* Build and check the schedule (exit 1 naming rank and action if the
 * checker rejects it: a builder bug), split the channels (collective over
 * pp; each put in NCCL device mode when the backend has a stream) and plan
 * the model's activation slots for micro-batches of B x T with
 * recomputation r. The model was built with this rank's chunks
 * (pipe_model_options). */
void pipe_init(Pipe *p, Model *m, CommGroup *pp, PipeKind k, int v, int micro, const int *cut, int B, int T,
               ModelRecompute r, const char *run_dir);
void pipe_free(Pipe *p);
/* ModelOptions.chunks / layer ranges of pipeline rank `stage` of p, v
 * chunks each, for the cuts. */
void pipe_model_options(int stage, int p, int v, const int *cut, ModelOptions *o);
/* Host buffers for micro-batch `micro`'s tokens and targets (B T each),
 * filled by the caller before pipe_step. */
int32_t *pipe_batch_tokens(Pipe *p, int micro);
int32_t *pipe_batch_targets(Pipe *p, int micro);
/* One step's schedule: every forward and backward of this rank, the
 * messages posted as the list says and waited for at first use. Returns
 * the sum of the micro-batches' losses over the step, the same on every
 * rank of the pp group (the last stage computes it); p->idle_s is the
 * time this rank spent waiting for its neighbours, the final drain
 * included. */
double pipe_step(Pipe *p, float dloss, const PipeHooks *h);
/* Tied embeddings: the first and the last stage's token-embedding
 * gradients summed, in place on both (after the dp reduction has finished
 * with the buffer: ddp_wait_grads). Nothing elsewhere. */
void pipe_tie_grads(Pipe *p);
/* A forward of one batch through every stage (evaluation, generation;
 * between steps). Returns the loss on the last stage with targets, else 0;
 * the last stage's model then holds the logits. Collective over pp. */
float pipe_forward(Pipe *p, const int32_t *tokens, const int32_t *targets, int B, int T);
/* The last stage's value x on every rank of the pp group (the sampled token). */
int pipe_share_from_last(Pipe *p, int x);
/* x summed over the pp group, in place (double). */
void pipe_sum(Pipe *p, double *x, size_t n);

#endif
