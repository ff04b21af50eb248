/* cp: context parallelism's attention. Every sequence of a micro-batch is
 * cut into 2 cp chunks; cp rank r holds chunks r and 2 cp - 1 - r (model.h
 * ModelCp: the layout), so with a causal mask every rank does the same
 * attention work. The model computes everything per token on its chunks;
 * this module gives its queries the keys and values of the whole sequence,
 * over the cp group, by all-gather or around a ring, and computes attention
 * block by block (backend.h AttnBlock), merged by log-sum-exp. Never knows
 * the optimizer, the data or the dp group (gradients sum over dp x cp in
 * ddp.c). docs/parallel.md "Context parallelism". */
#ifndef KILN_CP_H
#define KILN_CP_H

#include "comm.h"
#include "model.h"

typedef enum { CP_ALLGATHER = 0, CP_RING } CpMode;

/* "allgather" | "ring" (parallel.cp_attention) and back; parse exits 2 naming the key. */
CpMode cp_mode_parse(const char *name);
const char *cp_mode_name(CpMode m);

/* S = 2 KVW = 2 NKV HD (a packed k | v row), N = B T local rows. */
typedef struct Cp {
    const Backend *be;
    CommGroup *g;       /* the cp group (NULL: one rank) */
    int cp, rank;
    CpMode mode;
    size_t ab;          /* act bytes */
    AttnShape cap;      /* the largest local shape (B sequences of T = 2 Tc rows) the buffers hold */
    void *kv;           /* act: allgather (cp, N, S) every rank's k | v; ring (2, N, S) the block computed on and
                           the one arriving */
    float *dkv;         /* fp32: allgather (cp + 1, N, S) every rank's dk | dv, then this rank's sum; ring (3, N, S)
                           the accumulator in flight each way and this step's block */
    float *dqkv32;      /* fp32 (N, QKVW) dq | dk | dv before the cast to act; NULL with fp32 act (dqkv itself) */
    Model *m;           /* cp_attach's model, NULL for none */
    double blocked_s;   /* seconds waiting on the cp group since cp_micro_begin's first micro-batch */
    double total_s;     /* and since cp_init */
} Cp;

/* Buffers for local shapes up to cap (the model's local heads: under tp its
 * part). g NULL or of size 1 runs the same block schedule on one rank (two
 * chunks, no exchange): what test_cp checks against the plain op. */
void cp_init(Cp *c, const Backend *be, CommGroup *g, CpMode mode, const AttnShape *cap);
void cp_free(Cp *c);
/* Install the model's ModelCp hooks; the model must have been built with
 * ModelOptions.cp = c->cp, cp_rank = c->rank. */
void cp_attach(Cp *c, Model *m);

/* Attention of this rank's local rows over the whole sequence. s: the local
 * shape, B sequences of T = 2 Tc rows in ModelCp's chunk-major layout; qkv
 * (B T, QKVW) act after RoPE; out (B T, NH HD) act; lse (2, B, NH, Tc) fp32
 * (per local chunk) for the backward. */
void cp_attention_forward(Cp *c, void *out, float *lse, const void *qkv, const AttnShape *s);
/* dqkv (B T, QKVW) act, overwritten: the gradient of this rank's q, k, v
 * (the keys' and values' summed over every rank's queries); dout, out (B T,
 * NH HD) act; lse from the forward. */
void cp_attention_backward(Cp *c, void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                           const AttnShape *s);

/* Before each micro-batch: the first of a step resets the step's blocked time. */
void cp_micro_begin(Cp *c, int first);
/* Seconds blocked on the cp group (K/V, dK/dV, logits rows) this step. */
double cp_step_blocked_s(const Cp *c);

/* Bytes of the buffers cp_init allocates for the local shape (B, 2 Tc per
 * sequence) with act_bytes activations: what ./train plan adds per rank. */
size_t cp_buffer_bytes(const AttnShape *local, int cp, CpMode mode, size_t act_bytes);

#endif
