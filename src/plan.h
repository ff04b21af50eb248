/* plan: `./train plan` — does a layout fit N GPUs of G GiB (divisibility of
 * ranks and batch, memory per rank), and which ZeRO stage and micro-batch to
 * use. Pure arithmetic from the config and the model shape: allocates no
 * arenas, starts no backend, talks to no rank. */
#ifndef KILN_PLAN_H
#define KILN_PLAN_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "model.h"

/* Fixed overhead every rank pays on top of the arenas: the cuBLASLt
 * workspace, then a margin for the allocator and what is not counted. */
#define PLAN_WORKSPACE_BYTES (32.0 * 1024 * 1024)
#define PLAN_MARGIN 0.05

/* Memory of one rank, in bytes, by the dtype the backend stores each in: the
 * fp32 master, gradients and optimizer state (AdamW's m and v in bf16 with
 * precision.optim_state bf16); activations in act_bytes (4: the CPU backend
 * and CUDA fp32; 2: CUDA bf16, which also keeps a bf16 compute copy of the
 * parameters). */
typedef struct PlanMemory {
    double params;          /* whole parameters (ZeRO 0-2), or the 1/dp shard (ZeRO-3) */
    size_t param_bytes;     /* 4 (fp32 master) or 2 (precision.master bf16, ZeRO 0: no fp32 arena) */
    double params_shard;    /* ZeRO-2: the fp32 1/dp shard AdamW updates; else 0 */
    double params_gathered; /* ZeRO-3: two layers + wte/wpe/ln_f gathered; else 0 */
    double grads;           /* whole gradient arena (ZeRO 0-1), or the 1/dp shard (ZeRO 2-3) */
    double grads_unreduced; /* ZeRO 2-3: two layers' + the embeddings' whole gradients
                               (+ two 1/dp reduce-scatter targets); a pipeline stage: its whole
                               gradients (accumulated over the step); else 0 */
    double count;           /* parameters counted (elements; a pipeline stage's own) */
    double optim;           /* AdamW m and v: whole, or 1/dp (ZeRO >= 1) */
    double muon;            /* optim.name muon: momentum, Newton-Schulz work, owner exchange buffers (in state) */
    double compute_copy;    /* act_bytes 2 with an fp32 master: the bf16 compute copy of the parameters
                               (model.c's cbuf: the whole arena, or ZeRO-3's gathered units) */
    double state;           /* params + grads + optim (+ shard, gathered, unreduced, compute copy) */
    size_t act_bytes;       /* 4 or 2: the activations' dtype counted in `activations` and fp8 */
    double activations;     /* model_activation_bytes for one micro-batch in act_bytes, with `recompute` (+ cp's buffers) */
    double cp_buffers;      /* of which context parallelism's K/V and dK/dV buffers (cp_buffer_bytes) */
    double activations_other; /* the same in the other dtype (bf16 when act_bytes is 4), for the report; not in total */
    double act_by_mode[MODEL_RECOMPUTE_MODES][2]; /* the same for each ModelRecompute, [0] fp32 [1] bf16 */
    ModelFp8Bytes fp8;      /* precision.fp8's buffers (model_fp8_bytes) in act_bytes; in total */
    ModelRecompute recompute; /* model.recompute */
    int loss_chunk;         /* model.loss_chunk */
    double arena_by_chunk[3]; /* the activation arena alone (no cp, ep buffers) in act_bytes with
                                 loss_chunk 0 (the whole logits), auto, and as set */
    double overhead;        /* PLAN_WORKSPACE_BYTES + PLAN_MARGIN of the rest */
    double total;           /* state + activations + fp8 + overhead */
} PlanMemory;

/* Parameters of a GPT-2 shape, counted from the shape (no table, no arena):
 * wte (Vp,C) + wpe (T,C) + L x (12 C^2 + 13 C) + ln_f 2C. */
size_t plan_num_params(const ArchSpec *s);
/* Parameters of one layer (every layer has the same table rows), and the
 * routed experts' of the whole model (0 for a dense one). */
double plan_layer_params(const ArchSpec *s);
double plan_expert_params(const ArchSpec *s);

/* The per-rank memory of data parallelism over dp ranks at ZeRO stage `zero`
 * with micro-batches of micro_batch x seq_len tokens: the accounting of
 * ddp.c's arenas, and the one `--dry-run` prints. */
/* moment_bytes: AdamW's m and v per element, 4 (fp32) or 2 (precision.optim_state bf16);
 * param_bytes: the parameters', 4 (fp32 master) or 2 (precision.master bf16, ZeRO 0 only). */
/* tp > 1: one rank's part of a model split over tp ranks (its local
 * tensors, rank 0's: the most vocabulary rows); sp: sequence parallelism
 * (the residual stream's activations over tp). cp > 1: its B x T / cp
 * rows of activations plus cp.c's K/V buffers for cp_mode (a CpMode), and
 * ZeRO's shards over dp x cp ranks. ep > 1 (ZeRO 0 or 1): the rank holds
 * n_experts / ep of each layer's experts, whose ZeRO-1 state is split over
 * the dp / ep ranks holding the same ones, and the expert side's receive
 * buffers (ep_buffer_bytes) replace the model's own. */
/* fp8: precision.fp8's operand buffers, amaxes, scales and histories
 * (model_fp8_bytes). The layout and precision come in a PlanLayout, which
 * plan_layout fills from a config. */
/* act_bytes: the activations' (plan_act_bytes). */
typedef struct PlanLayout {
    int tp, sp, cp, cp_mode, dp, ep, zero, micro_batch;
    ModelRecompute recompute;
    int recompute_every; /* model.recompute_every (BLOCK) */
    int loss_chunk;      /* model.loss_chunk (model_loss_rows): the head in chunks of rows */
    size_t moment_bytes, param_bytes, act_bytes;
    ModelFp8 fp8;
    int muon, muon_split_qkv; /* optim.name muon (its buffers: plan_muon_bytes), optim.muon_split_qkv */
} PlanLayout;
struct Config;
PlanLayout plan_layout(const struct Config *c, int dp);
/* The activation dtype a GPU run of c stores (device cpu or precision.compute
 * fp32: 4; else 2, the CUDA bf16 path: device auto is planned as a GPU). */
size_t plan_act_bytes(const struct Config *c);
/* precision.fp8's keys as the model takes them (train.c, bench.c). */
ModelFp8 plan_fp8_options(const struct Config *c);
PlanMemory plan_memory_per_rank(const ArchSpec *s, const PlanLayout *l);

/* Bytes one rank sends per optimizer step, by group (ring algorithms: an
 * all-reduce of B bytes sends 2 (k-1)/k B, an all-gather or a
 * reduce-scatter (k-1)/k B): tp's activations (act_bytes each) and partial
 * gradients for `micro` micro-batches of micro_batch x seq_len tokens, and
 * dp's gradients (and ZeRO's parameter gathers) of the rank's tensors. */
/* ep > 1: the all-to-alls of routed rows (four per MoE layer and
 * micro-batch: dispatch and combine, forward and backward, an even load
 * assumed: (ep-1)/ep of a rank's N top_k rows leave it each time), and dp's
 * expert gradients over EDP (dp / ep ranks). */
typedef struct PlanComm {
    double tp, dp, ep;
    int tp_collectives; /* tp collectives per micro-batch (forward and backward) */
} PlanComm;
PlanComm plan_comm_per_step(const ArchSpec *s, int tp, int sp, int dp, int ep, int zero, int micro_batch, int micro,
                            size_t act_bytes);
/* The tensor- and expert-parallel lines of --dry-run and ./train plan: the
 * split per rank and the communication per step. */
void plan_print_tp(const ArchSpec *s, int tp, int sp, int dp, int ep, int zero, int micro_batch, int micro);
/* "fp32" -> 4, "bf16" -> 2 (precision.master). */
size_t plan_param_bytes(const char *master);

/* One "  %-22s %9.2f <unit>" line of a byte count (B, KiB, ... TiB). */
void plan_print_bytes(const char *what, double bytes);

/* Print the state lines ("parameters", "gradients", "optimizer state",
 * "params + grads + optim", with ZeRO-2's shard and ZeRO-2/3's gathered and
 * unreduced lines) in the `--dry-run` format: "  %-22s %9.2f %s". */
void plan_print_state(const PlanMemory *m, int dp, int zero);

/* The activation lines, in the same format: "activations" (fp32, the one
 * counted in the total), "activations, bf16", a "recompute" line naming
 * model.recompute and what it saves (none: what the other modes would
 * take), and with precision.fp8 its buffers. */
void plan_print_activations(const PlanMemory *m);

/* Pipeline parallelism (pp > 1): the schedule (its bubble, the textbook
 * formula, with show_timeline its text timeline) and each stage's layers,
 * parameters, activation slots and memory per rank (ZeRO 0-1, as the run
 * allocates them), for micro micro-batches per data-parallel rank. *worst:
 * the costliest stage's memory, for the verdict. Returns 0, or -1 with the
 * reason in err (a schedule or stage cut that cannot run). */
/* The same without printing, for a layout l of p stages (kind a PipeKind, v
 * chunks each, the stage layers `given` or balanced): each stage's memory
 * into stages[p] (NULL: not kept), the costliest into *worst, the
 * schedule's own bubble into *bubble. Returns 0 or -1 with err. */
/* A schedule's checked facts, built once per process and kept: its slots
 * per (rank, chunk) ([p * v]) and the bubble, or NULL with err. */
const int *plan_pipe_info(int kind, int p, int v, int micro, double *bubble, char *err, size_t errn);
int plan_memory_pp(const ArchSpec *s, const PlanLayout *l, int kind, int p, int v, const int *given, int n_given,
                   int micro, PlanMemory *worst, PlanMemory *stages, double *bubble, char *err, size_t errn);
int plan_print_pp(const ArchSpec *s, const struct Config *c, int tp, int dp, int micro, int show_timeline,
                  PlanMemory *worst, char *err, size_t errn);

/* ---------------------------------------------------------------- time (plan_time.c) */

/* A whole layout for the time model and the search: the memory layout plus
 * the pipeline and the step's micro-batches per data-parallel rank. */
struct HwProfile;
typedef struct PlanRun {
    PlanLayout lay;
    int pp, pp_virtual, pp_schedule; /* pp_schedule a PipeKind */
    const int *pp_layers;            /* parallel.pp_layers (n_pp_layers 0: stages cut by cost) */
    int n_pp_layers;
    int micro;                       /* micro-batches per dp rank and step (grad_accum / dp) */
    int gpus, nodes;
    const char *optim;               /* optim.name */
    int ns_steps;                    /* Muon's Newton-Schulz iterations */
} PlanRun;

/* Seconds of one optimizer step, by term (docs/planner.md "Time model").
 * compute: the costliest pipeline rank's products, attention and pointwise
 * work over its micro-batches (recompute included); tp, cp, ep: their
 * collectives' exposed time on that rank; bubble: the schedule's idle time
 * (pipe_theory_bubble of kiln's own lists); pp_p2p: the fill and drain's
 * activation messages; dp: the gradient reductions and ZeRO's gathers not
 * hidden behind the backward (dp_total of which dp_hidden is hidden);
 * optim: the update, a memory-bound pass over the rank's state. */
typedef struct PlanTime {
    double compute, recompute, tp, cp, cp_hidden, ep, bubble, pp_p2p, dp, dp_total, dp_hidden, optim, step;
    double tokens_per_s_per_gpu, mfu;
    double model_flops;     /* per GPU and step (6 N per token + attention: arch_flops_per_token) */
    double hw_flops;        /* the same with recompute's extra work */
    double peak;            /* the FLOP/s MFU is against: bf16 (fp32 with 4-byte activations) */
    int tp_intra, cp_intra, ep_intra, dp_intra, pp_intra; /* 1: the group stays inside a node */
} PlanTime;
PlanTime plan_time(const ArchSpec *s, const PlanRun *r, const struct HwProfile *hw, int64_t total_tokens);
/* A collective's seconds, alpha-beta: `bytes` of the whole buffer over k
 * ranks on a link of bw bytes/s and lat seconds a hop; kind 0 all-reduce
 * (ring 2(k-1)/k B, latency the lesser of ring 2(k-1) and tree 2 log2 k hops),
 * 1 all-gather or reduce-scatter ((k-1)/k B), 2 all-to-all ((k-1)/k B),
 * 3 a point-to-point message (B, one hop). */
double plan_collective_s(int kind, double bytes, int k, double bw, double lat);

/* ---------------------------------------------------------------- search (plan_search.c) */

/* ./train plan's --search and the cheapest change for a layout that does
 * not fit: every layout of `gpus` (dp x tp x pp x cp, ep folded into dp x cp;
 * ZeRO 0-3; micro-batch; recompute; sequence parallelism; the pipeline's
 * schedule and virtual stages) the config's own validation accepts and whose
 * memory fits, ranked by plan_time. */
typedef struct PlanCand {
    PlanRun run;
    PlanMemory mem;
    PlanTime time;
    int changes; /* keys that differ from the config's */
    char set[512]; /* the --set flags, space-separated */
} PlanCand;
/* Fill *out (malloc'd, *n of them, best first) with every fitting layout.
 * Returns how many layouts were considered in all (*rejected: of which
 * refused by validation, *too_big: did not fit). */
int plan_search(const struct Config *c, const ArchSpec *s, const struct HwProfile *hw, int gpus, int nodes,
                PlanCand **out, int *n, int *rejected, int *too_big);

/* One layout, c (a copy of base with its layout keys changed; grad_accum is
 * derived again): 0 valid and fits hw's memory, 1 valid but too big, -1
 * refused by kiln's own checks (err says why). *k is filled unless -1. */
int plan_evaluate(const struct Config *base, struct Config *c, const ArchSpec *s, const struct HwProfile *hw,
                  int gpus, int nodes, PlanCand *k, char *err, size_t errn);
/* One line of a layout ("dp 8 x tp 2 (sp) x pp 1 x cp 1 (ep 1), ZeRO 1, ..."). */
void plan_cand_layout_text(const PlanCand *k, char *buf, size_t n);
/* The text block of one ranked layout: memory and time breakdowns, MFU,
 * the ./train and srun lines; with next (the runner-up), why it wins. */
void plan_print_cand(const PlanCand *k, int rank, const char *config, int nodes, int per_node, const PlanCand *next);
/* --json: one object (docs/planner.md "JSON"): fits, gpus, nodes, hardware,
 * layouts best first (n of k), and error when the config's layout is refused. */
void plan_json(FILE *f, int fits, int gpus, int nodes, const struct HwProfile *hw, const PlanCand *k, int n,
               const char *error);

/* ./train plan --search and/or --json (plan_main's flags); sets_only
 * (--auto-sets): the best layout's --set flags alone, one argument a line.
 * Returns the exit code. */
int plan_search_main(const struct Config *c, const ArchSpec *s, const struct HwProfile *hw, const char *config,
                     int gpus, int nodes, int search, int json, int top, int sets_only);
/* The fitting layout with the fewest keys changed from c's (then the
 * fastest): 0 and *out, or -1 if none fits. */
int plan_cheapest_change(const struct Config *c, const ArchSpec *s, const struct HwProfile *hw, int gpus, int nodes,
                         PlanCand *out);

/* `./train plan CONFIG [--set k=v]... --gpus N [--gpu-mem GB] [--nodes K]`;
 * argv[0] is "plan". Returns 0 (valid, fits) or 2 (does not; one line says
 * what to change); bad usage exits 2. */
int plan_main(int argc, char **argv);

#endif
