/* config: owns the key table (name, type, default, range, doc) and everything
 * generated from it: YAML parsing, --set overrides, the resolved YAML and the
 * markdown reference. Never reads anything but the config, never accepts a
 * value the table does not allow, never exits with anything but code 2. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* open_memstream */
#endif
#include "config.h"
#include "arch.h"
#include "util.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <ctype.h>
#include <yaml.h>

typedef enum { CT_INT, CT_INT64, CT_U64, CT_FLOAT, CT_BOOL, CT_STR, CT_ENUM, CT_PAIR, CT_SOURCES, CT_INTS } CfgType;

enum {
    CF_HI_OPEN = 1, /* range is [lo, hi) rather than [lo, hi] */
    CF_AUTO = 2,    /* int key that also accepts `auto`, meaning 0 */
    CF_LO_OPEN = 4, /* range is (lo, hi] rather than [lo, hi] */
    CF_WEIGHTS = 8, /* CT_SOURCES: entries take a weight (data.train) */
    CF_AUTO_NEG = 16 /* with CF_AUTO: `auto` means -1 (0 is a value of its own) */
};

typedef struct {
    const char *key;     /* dotted path: "optim.lr"; no dot = top-level scalar */
    CfgType type;
    size_t off, size;    /* offsetof / sizeof the field in Config */
    size_t off2;         /* CT_PAIR: the second float; CT_SOURCES: the CfgSources; CT_INTS: the count */
    const char *def;     /* default, as YAML text (parsed like user input) */
    double lo, hi;       /* range; hi = INFINITY: bounded only by the type */
    int flags;
    const char *choices; /* CT_ENUM: "a|b|c" */
    const char *doc;     /* one line of markdown, no '|' */
} CfgKey;

#define FLD(f) offsetof(Config, f), sizeof(((Config *)0)->f)
#define KINT(k, f, d, lo, hi, doc) {k, CT_INT, FLD(f), 0, d, lo, hi, 0, NULL, doc}
#define KINTA(k, f, d, lo, hi, doc) {k, CT_INT, FLD(f), 0, d, lo, hi, CF_AUTO, NULL, doc}
#define KINTAN(k, f, d, lo, hi, doc) {k, CT_INT, FLD(f), 0, d, lo, hi, CF_AUTO | CF_AUTO_NEG, NULL, doc}
#define KI64(k, f, d, lo, hi, doc) {k, CT_INT64, FLD(f), 0, d, lo, hi, 0, NULL, doc}
#define KU64(k, f, d, doc) {k, CT_U64, FLD(f), 0, d, 0, INFINITY, 0, NULL, doc}
#define KFLT(k, f, d, lo, hi, doc) {k, CT_FLOAT, FLD(f), 0, d, lo, hi, 0, NULL, doc}
#define KFLTF(k, f, d, lo, hi, fl, doc) {k, CT_FLOAT, FLD(f), 0, d, lo, hi, fl, NULL, doc}
#define KBOOL(k, f, d, doc) {k, CT_BOOL, FLD(f), 0, d, 0, 0, 0, NULL, doc}
#define KSTR(k, f, d, doc) {k, CT_STR, FLD(f), 0, d, 0, 0, 0, NULL, doc}
#define KENUM(k, f, d, ch, doc) {k, CT_ENUM, FLD(f), 0, d, 0, 0, 0, ch, doc}
#define KPAIR(k, f1, f2, d, lo, hi, fl, doc) \
    {k, CT_PAIR, FLD(f1), offsetof(Config, f2), d, lo, hi, fl, NULL, doc}
/* A list of ints, each in [lo, hi], at most CFG_MAX_INTS, its count in n. */
#define KINTS(k, f, n, d, lo, hi, doc) {k, CT_INTS, FLD(f), offsetof(Config, n), d, lo, hi, 0, NULL, doc}
/* A glob string (kept in `glob`) or a list of sources (all in `srcs`). */
#define KSRC(k, glob, srcs, d, fl, doc) {k, CT_SOURCES, FLD(glob), offsetof(Config, srcs), d, 0, 0, fl, NULL, doc}
#define INF INFINITY
#define TWO62 4611686018427387904.0

/* The one table. Order here is the order of the resolved YAML and the docs. */
static const CfgKey cfg_keys[] = {
    KSTR("run.name", run_name, "\"tiny\"", "name of the run; the run directory defaults to `runs/<run.name>`"),
    KSTR("run.dir", run_dir, "\"\"", "run directory; `\"\"` means `runs/<run.name>`"),
    KU64("run.seed", seed, "1337", "seed of every random decision (init, data order, sampling)"),
    KINT("run.threads", threads, "0", 0, 1024, "CPU threads; 0 = all cores"),
    KENUM("device", device, "auto", "auto|cpu|cuda", "backend; `auto` picks `cuda` when a GPU is present, else `cpu`"),
    KENUM("model.arch", arch, "gpt2", "gpt2|llama",
          "preset (docs/architectures.md): `gpt2` is LayerNorm, learned positions, GeLU, biases, tied head; `llama` "
          "is RMSNorm, RoPE, SwiGLU, no biases, untied head; each `auto` key below follows it"),
    KINT("model.n_layer", n_layer, "4", 1, 1024, "transformer blocks"),
    KINT("model.n_head", n_head, "4", 1, 1024, "attention (query) heads"),
    KINTA("model.n_kv_head", n_kv_head, "auto", 0, 1024,
          "key/value heads (grouped-query attention; `auto` = n_head, 1 = multi-query); must divide n_head"),
    KINTA("model.head_dim", head_dim, "auto", 0, 1024, "dimensions per head; `auto` = n_embd / n_head"),
    KINT("model.n_embd", n_embd, "128", 8, 65536, "embedding width"),
    KINT("model.seq_len", seq_len, "256", 2, 1048576, "tokens per sequence (context length)"),
    KINT("model.vocab_size", vocab_size, "256", 2, INT_MAX, "vocabulary size; padded to a multiple of 64 internally"),
    KENUM("model.norm", norm, "auto", "auto|layernorm|rmsnorm", "normalisation of every block and the final norm"),
    KFLTF("model.norm_eps", norm_eps, "1.0e-5", 0, 1, CF_LO_OPEN, "epsilon of every norm"),
    KENUM("model.pos", pos, "auto", "auto|learned|rope", "positions: a learned table, or rotary embeddings"),
    KFLTF("model.rope_theta", rope_theta, "10000", 1, INF, CF_LO_OPEN, "RoPE base (Llama 3: 500000)"),
    KENUM("model.qk_norm", qk_norm, "none", "none|head|full",
          "RMSNorm of q and k before RoPE: over each head (Qwen3) or the whole projection (OLMoE)"),
    KENUM("model.mlp", mlp, "auto", "auto|gelu|swiglu|moe", "the block's MLP"),
    KINTA("model.ffn_hidden", ffn_hidden, "auto", 0, 1 << 24,
          "MLP width; `auto` = 4 n_embd (GeLU) or 8 n_embd / 3 rounded up to 256 (SwiGLU)"),
    KENUM("model.bias", bias, "auto", "auto|true|false", "biases on the linear layers and LayerNorms"),
    KENUM("model.tie_embeddings", tie_embeddings, "auto", "auto|true|false", "the output head reads the token embedding"),
    KENUM("model.recompute", recompute, "none", "none|gelu|norm_gelu|block|selective",
          "activation memory for backward time: `gelu` keeps no GeLU output per layer (the backward recomputes "
          "each from the saved fc output into one shared buffer: L-1 fewer (B,T,4C) tensors, one more GeLU per "
          "layer), `norm_gelu` also no LayerNorm outputs (recomputed from the saved layer inputs and statistics: "
          "2L-1 fewer (B,T,C), two more LayerNorms per layer); `block` keeps only each checkpointed layer's "
          "input (B,T,C) and runs its whole forward again just before its backward, into one layer's workspace "
          "(torchtitan's full, Megatron's full recompute: one more forward of those layers, two under zb_h1's "
          "split backward, whose weight part recomputes again); `selective` keeps every product's and "
          "attention's output and recomputes the pointwise work between them: `norm_gelu`'s norms and "
          "activation, and in MoE layers the experts' and shared experts' SwiGLU outputs and (without ep) the "
          "routed rows' permuted copy (torchtitan's selective op policy without its every-other product); "
          "results are bit-identical to `none` (on GPU "
          "`gelu`, `norm_gelu` and `selective` with `precision.gelu_fusion: off`: with fusion their recomputed GeLU may differ "
          "in the last bit; `block` recomputes with the forward's own ops, fused or not), and `--dry-run` and "
          "`./train plan` print the activation memory of the mode"),
    KINT("model.recompute_every", recompute_every, "1", 1, 1024,
         "with `model.recompute: block`: checkpoint layer l when l % k == 0 and keep the others whole (1: every "
         "layer; 2: every other, about half the memory saving for half the recomputation)"),
    KINTAN("model.loss_chunk", loss_chunk, "0", 0, 1 << 24,
           "the output head and its cross-entropy in chunks of this many of a rank's rows (its tokens of a "
           "micro-batch, after cp's split), so the whole (tokens x vocabulary) logits never exist: one chunk's "
           "buffer instead; the backward makes each chunk's logits again (one more head product: 2 N C V FLOPs, "
           "twice under zb_h1). 0: the whole logits; `auto`: chunks whose logits hold at most 4 N C elements (in "
           "64-row tiles; none when that is all N). Losses and gradients equal the whole head's (docs/gpu.md "
           "\"Memory\" gives the bound); not with `precision.fp8_head`"),
    KFLT("model.rope_scaling.factor", rope_factor, "0", 0, INF,
         "Llama 3.1 RoPE scaling: 0 = off; else >= 1 with the three keys below"),
    KFLT("model.rope_scaling.low_freq_factor", rope_low, "0", 0, INF, "Llama 3.1 scaling: low-frequency factor (1)"),
    KFLT("model.rope_scaling.high_freq_factor", rope_high, "0", 0, INF, "Llama 3.1 scaling: high-frequency factor (4)"),
    KINT("model.rope_scaling.original_context", rope_orig, "0", 0, INT_MAX,
         "Llama 3.1 scaling: the context the model was trained at (8192)"),
    KINT("model.moe.n_experts", moe_experts, "8", 1, 4096, "routed experts per MoE layer"),
    KINT("model.moe.top_k", moe_top_k, "2", 1, 4096, "experts each token is routed to"),
    KINT("model.moe.n_shared", moe_shared, "0", 0, 64, "shared experts every token passes through"),
    KINTA("model.moe.expert_hidden", moe_hidden, "auto", 0, 1 << 24, "SwiGLU width of one expert; `auto` = ffn_hidden"),
    KENUM("model.moe.router", moe_router, "softmax", "softmax|sigmoid", "router scores (math in fp32)"),
    KENUM("model.moe.norm_topk", moe_norm_topk, "true", "true|false",
          "renormalise the chosen gates to sum to one (Mixtral true, OLMoE false; sigmoid always)"),
    KFLT("model.moe.capacity_factor", moe_capacity, "0", 0, 1024,
         "0 = dropless; else each expert takes at most ceil(factor * tokens * top_k / n_experts) slots"),
    KFLT("model.moe.aux_loss_coef", moe_aux, "0.01", 0, 100, "load-balancing loss E sum_i f_i P_i, per layer"),
    KFLT("model.moe.z_loss_coef", moe_z, "0.001", 0, 100, "router z-loss mean(logsumexp(logits)^2), per layer"),
    KFLT("model.moe.bias_update_rate", moe_bias_rate, "0", 0, 1,
         "DeepSeek-V3 auxiliary-loss-free balancing: per-expert selection bias moved by rate * sign(mean load - load) each step"),
    KSRC("data.train", train_glob, train, "\"data/austen/train_*.bin\"", CF_WEIGHTS,
         "training token shards: a glob, or a mixture, a list of `{path: GLOB, weight: W, name: N}` (weight "
         "default 1, shares are weight / sum; name default from the glob, as in metrics' `tokens_by_source`): "
         "samples are blended so each source's share of the tokens follows its weight, each source reshuffled "
         "every epoch of its own (docs/data.md)"),
    KSRC("data.val", val_glob, val, "\"data/austen/val_*.bin\"", 0,
         "validation shards: a glob (logged as `val_loss`), or a list of named sets `{name: N, path: GLOB}`, each "
         "evaluated and logged as `val/<name>` (`val_loss` is then their mean); `\"\"` = no validation"),
    KENUM("data.tokenizer", tokenizer, "byte", "byte|gpt2", "tokenizer used to decode samples"),
    KSTR("data.tokenizer_file", tokenizer_file, "\"\"", "tiktoken-format rank file; required when `data.tokenizer` is `gpt2`"),
    KINT("data.prefetch", prefetch, "4", 0, 64,
         "batches of `data.train` a background thread reads (and decompresses) while the step runs; 0 = read in "
         "the step; the batches are the same either way (metrics' `data_wait_s` shows the wait that is left)"),
    KINT("data.max_open_shards", max_open_shards, "64", 1, 65536,
         "shards each loader keeps open (file handles; an open `.bin.zst` also holds its decompressed tokens in "
         "memory); the least recently read is closed first"),
    KBOOL("data.doc_masking", doc_masking, "false",
          "attention stops at document boundaries inside a sequence (a block-diagonal causal mask): a token "
          "after a `data.eot_id` token starts a new document, the end-of-text token ends its own (docs/data.md)"),
    KENUM("data.doc_positions", doc_positions, "continue", "continue|reset",
          "`reset`: positions (RoPE or learned) restart at 0 at each document's first token; `continue`: the "
          "position in the sequence"),
    KINT("data.eot_id", eot_id, "-1", -1, INT_MAX,
         "the token id that ends a document for `data.doc_masking` / `data.doc_positions`; -1 = the tokenizer's "
         "end-of-text id (gpt2: the rank file's, 50256 for GPT-2's; the byte tokenizer has none, so set it, e.g. 10 for lines)"),
    KINT("batch.micro_batch", micro_batch, "8", 1, 65536, "sequences per forward/backward pass"),
    KI64("batch.total_tokens", total_tokens, "16384", 1, TWO62,
         "tokens per optimizer step, all ranks; a multiple of `micro_batch*seq_len`"),
    KINT("train.steps", steps, "2000", 1, INT_MAX, "optimizer steps"),
    KINT("train.eval_every", eval_every, "100", 0, INF, "steps between validation passes; 0 = off"),
    KINT("train.eval_batches", eval_batches, "20", 1, INF, "micro-batches per validation pass"),
    KINT("train.sample_every", sample_every, "500", 0, INF, "steps between text samples; 0 = off"),
    KINT("train.sample_tokens", sample_tokens, "200", 1, 1e6, "tokens per sample"),
    KFLT("train.sample_temperature", sample_temperature, "1.0", 0, 100, "sampling temperature; 0 = greedy"),
    KINT("train.sample_top_k", sample_top_k, "0", 0, INF, "sample from the k most likely tokens; 0 = all"),
    KENUM("train.on_nonfinite", on_nonfinite, "stop", "skip|stop",
          "a non-finite loss or gradient norm: `skip` the update (parameters unchanged, counted) or `stop` with exit 1"),
    KINT("train.max_consecutive_skips", max_consecutive_skips, "10", 0, INF,
         "with `on_nonfinite: skip`, stop (exit 1) after this many skipped steps in a row: a run that "
         "stays non-finite is diverging, not unlucky; 0 = never stop"),
    KENUM("optim.name", optim_name, "adamw", "adamw|lion|muon|adafactor",
          "optimizer (docs/optimizers.md): `adamw`; `lion` (sign of the interpolated momentum, one state "
          "buffer; takes `optim.lion_betas`, `lr`, `weight_decay` and `grad_clip`, not `betas` or `eps`); `muon` "
          "(the blocks' 2-D matrices orthogonalised by Newton-Schulz, each on one dp rank, an expert's on one "
          "rank of its EDP group; embeddings, head, gains, biases and the router keep AdamW with `betas`, "
          "`eps`); `adafactor` (factored second moments of every 2-D tensor, update clipping, relative step "
          "off: `optim.adafactor_*`, `lr`, `weight_decay`)"),
    KFLT("optim.lr", lr, "6.0e-4", 0, 10, "peak learning rate"),
    KPAIR("optim.betas", beta1, beta2, "[0.9, 0.95]", 0, 1, CF_HI_OPEN, "AdamW `[beta1, beta2]`"),
    /* eps = 0 divides 0 by 0 wherever a gradient is always zero (the padded
     * rows of wte), and the NaN spreads through the tied head */
    KFLTF("optim.eps", eps, "1.0e-8", 0, 1, CF_LO_OPEN, "AdamW epsilon"),
    KFLT("optim.weight_decay", weight_decay, "0.1", 0, 10, "decoupled weight decay of the matrices"),
    KFLT("optim.grad_clip", grad_clip, "1.0", 0, 1e9, "clip the global gradient norm to this; 0 = off"),
    KPAIR("optim.lion_betas", lion_beta1, lion_beta2, "[0.9, 0.99]", 0, 1, CF_HI_OPEN,
          "Lion `[beta1, beta2]`: the update's sign is of beta1 m + (1 - beta1) g; m moves with beta2"),
    KFLT("optim.momentum", momentum, "0.95", 0, 0.999999, "Muon's Nesterov momentum"),
    KINT("optim.ns_steps", ns_steps, "5", 1, 100, "Muon's quintic Newton-Schulz iterations"),
    KENUM("optim.muon_scale", muon_scale, "spectral", "spectral|match_adamw",
          "Muon's update scale for a (rows, cols) matrix: `spectral` sqrt(max(1, rows/cols)); `match_adamw` 0.2 "
          "sqrt(max(rows, cols)), an update RMS like AdamW's so its lr and weight_decay carry over"),
    KBOOL("optim.muon_split_qkv", muon_split_qkv, "true",
          "Muon orthogonalises GPT-2's fused c_attn as its q, k and v thirds (false: as one matrix)"),
    KFLTF("optim.adafactor_decay", adafactor_decay, "0.8", 0, 1, CF_LO_OPEN,
          "Adafactor's second-moment decay: beta2 at step t is 1 - t^-decay (0.8, the paper's)"),
    KFLT("optim.adafactor_clip", adafactor_clip, "1.0", 0, 1e9,
         "Adafactor's update clipping: each tensor's update is cut to this RMS; 0 = off"),
    KFLTF("optim.adafactor_eps", adafactor_eps, "1.0e-30", 0, 1, CF_LO_OPEN,
          "Adafactor's epsilon, added to g^2 before the moments average it"),
    KFLT("optim.adafactor_beta1", adafactor_beta1, "0", 0, 0.999999,
         "Adafactor's first moment of the clipped update (0 = none, the paper's: no m, the factored state alone)"),
    KBOOL("optim.decay_embeddings", decay_embeddings, "true", "apply weight decay to the embedding tables too"),
    KENUM("schedule.kind", sched_kind, "cosine", "cosine|linear|constant|wsd", "learning-rate shape after warmup"),
    KINT("schedule.warmup_steps", warmup_steps, "100", 0, INF, "steps of linear warmup from 0"),
    KFLT("schedule.min_lr_ratio", min_lr_ratio, "0.1", 0, 1, "final learning rate as a fraction of `optim.lr`"),
    KFLT("schedule.decay_ratio", decay_ratio, "0.2", 0, 1, "`wsd`: fraction of the steps spent in the final decay"),
    KINTA("parallel.dp", dp, "auto", 0, INF, "data-parallel ranks; `auto` (or 0) = world size / (tp x pp x cp)"),
    KINT("parallel.zero", zero, "0", 0, 3, "ZeRO stage over the dp group: 0 replicates everything, 1 shards optimizer state, 2 + gradients, 3 + parameters (FSDP: layers gathered for forward and backward); with pp > 1 each stage's dp group shards that stage's layers"),
    KINT("parallel.tp", tp, "1", 1, INF, "tensor-parallel ranks (Megatron's split of heads, MLP width and vocabulary; "
         "consecutive ranks, so keep it within a node); must divide n_head, n_kv_head and ffn_hidden"),
    KENUM("parallel.sequence_parallel", sequence_parallel, "auto", "auto|true|false",
          "tp > 1: norms and residuals on N/tp-token shards (all-gather before, reduce-scatter after the split "
          "products); `auto` is on when tp > 1"),
    KINT("parallel.pp", pp, "1", 1, INF, "pipeline stages: the layers cut into pp contiguous ranges, one per rank of "
         "a pipeline (the slowest mesh dimension, so stages cross nodes); docs/parallel.md \"Pipeline parallelism\""),
    KENUM("parallel.pp_schedule", pp_schedule, "1f1b", "gpipe|1f1b|interleaved_1f1b|zb_h1",
          "pp > 1: the order of micro-batches' forwards and backwards: `gpipe` (all forwards, then all backwards; "
          "holds every micro-batch), `1f1b` (one forward, one backward; at most pp in flight), "
          "`interleaved_1f1b` (pp_virtual chunks per rank, bubble / pp_virtual; micro-batches a multiple of pp), "
          "`zb_h1` (zero-bubble: the backward split into input and weight parts, the weight parts filling the "
          "bubble, about a third of 1f1b's)"),
    KINT("parallel.pp_virtual", pp_virtual, "1", 1, 16,
         "chunks of layers per pipeline rank (`interleaved_1f1b` needs 2 or more; the others 1)"),
    KINTS("parallel.pp_layers", pp_layers, n_pp_layers, "[]", 1, INF,
          "layers of each of the pp x pp_virtual virtual stages, in order (they add up to model.n_layer); `[]` = "
          "cut by cost: each layer's FLOPs, the last stage also the head's"),
    KINT("parallel.cp", cp, "1", 1, INF, "context-parallel ranks: each sequence is cut into 2 cp chunks and rank r "
         "holds chunks r and 2cp-1-r (every rank the same causal attention work); everything per token runs on "
         "the chunks, attention exchanges K and V over the cp ranks (`cp_attention`); `model.seq_len` must be a "
         "multiple of 2 cp; replicated gradients sum over dp x cp, and ZeRO shards over dp x cp; MoE layers "
         "route as one rank (a sequence's loads summed over cp, a capacity split over its chunks)"),
    KENUM("parallel.cp_attention", cp_attention, "allgather", "allgather|ring",
          "cp > 1: `allgather` gathers every rank's K and V before attention and reduce-scatters their gradients "
          "(simple; memory cp x the local K/V), `ring` passes K/V blocks around the cp ranks while attention runs "
          "on the current one, merging by log-sum-exp, and dK/dV after them (memory 2 blocks)"),
    KINT("parallel.ep", ep, "1", 1, INF, "expert-parallel ranks (MoE): each of ep consecutive ranks of dp x cp "
         "holds n_experts / ep whole experts, tokens travel to them by all-to-all; must divide "
         "`model.moe.n_experts` and dp x cp; ZeRO 0 or 1; with `pp` inside each stage"),
    KENUM("parallel.layout", layout, "fixed", "fixed|auto",
          "`fixed`: the degrees above as given; `auto`: scripts/train.sbatch picks dp, tp, pp, cp, ep, ZeRO, "
          "micro-batch, recompute, sequence parallelism and the pipeline schedule with `./train plan --search` for "
          "the allocation it got, at every start (a requeue onto fewer nodes resumes on the new layout); ./train "
          "itself runs the degrees it is given (docs/planner.md \"Job scripts\")"),
    KFLT("parallel.timeout_s", timeout_s, "300", 0.1, 1e7, "seconds any collective may wait before the run stops naming the missing rank (env KILN_COMM_TIMEOUT_S overrides)"),
    KENUM("precision.compute", compute, "bf16", "bf16|fp32", "activation dtype on GPU: `bf16` stores activations, their gradients and the weights' compute copy in bf16 (half the memory; fp32 math and accumulation, matrix products on tensor cores), `fp32` is strict fp32; the CPU backend is always fp32"),
    KENUM("precision.attention", attention, "auto", "auto|cudnn|tensor_cores|simt",
          "attention kernels on GPU with `compute: bf16`: `cudnn` (cuDNN's fused flash attention; libcudnn_graph.so.9 is opened at run time, head size a multiple of 8 up to 128), `tensor_cores` (kiln's bf16 WMMA kernels, fp32 accumulation), `simt` (fp32 CUDA cores), or `auto` = the first of cuDNN, the tensor cores and SIMT that passes a start-up self-check against the SIMT kernels and takes the shape (a fixed order, not timed, so reruns and every rank make the same choice; the log gives the self-check figures and one line per shape; a missing cuDNN is a note, not an error); `cudnn` that cannot load the library, finds no engine or fails the self-check stops the run (exit 1), as does a head size it cannot take (exit 2); with `compute: fp32` attention is always `simt` (`cudnn` or `tensor_cores` is then an error, exit 2); the CPU backend ignores the key"),
    KBOOL("precision.attention_deterministic", attention_deterministic, "true",
          "GPU attention's backward sums in a fixed order, so a run (and a resume) gives the same bits; `false` "
          "lets cuDNN's backward accumulate dQ with atomics (its faster form, cudnn-frontend's default): "
          "gradients then differ in the last bits from run to run, a resumed run is no longer bit-identical and "
          "loss curves agree within rounding; kiln's own kernels are always deterministic, so `false` is refused "
          "where cuDNN cannot run attention (device: cpu, compute: fp32, attention: simt or tensor_cores, "
          "grouped K/V heads, data.doc_masking, parallel.cp > 1) and a warning where it turns out not to (no "
          "cuDNN, a failed self-check, device: auto finding no GPU)"),
    KENUM("precision.gelu_fusion", gelu_fusion, "auto", "auto|off",
          "the MLP's fc product and its GeLU: `auto` runs them as one op where the backend has one (CUDA: cuBLASLt's "
          "GELU_AUX_BIAS epilogue forward, DGELU backward; a shape cuBLASLt refuses falls back with a warning), "
          "`off` as a product and a GeLU kernel; the epilogue applies cuBLASLt's own GeLU to the unrounded product, "
          "so losses differ in the last bits (within bf16 rounding), and with fusion `model.recompute` is no longer "
          "bit-identical to `none`; the CPU backend has no fused op and ignores the key"),
    KENUM("precision.master", master, "fp32", "fp32|bf16",
          "dtype of the parameters the optimizer updates: `fp32` keeps an fp32 master (cast to the compute "
          "copy after each step); `bf16` (llm.c's mode without master weights) makes the bf16 compute copy the "
          "parameters: no fp32 arena, 4 bytes per parameter saved (GPT-2 1.5B: 6.2 GB), each AdamW update "
          "computed in fp32 and stored with stochastic rounding (random bits from `run.seed`, the step and the "
          "element: deterministic, the same on every data-parallel rank). Needs `precision.compute: bf16` on "
          "`device: cuda` and `parallel.zero: 0`. Gradients and moments as before; checkpoints hold fp32 "
          "either way (bf16 widened exactly), so a run may resume with the other setting"),
    KENUM("precision.optim_state", optim_state, "fp32", "fp32|bf16",
          "dtype of AdamW's moments m and v in memory: `bf16` halves the optimizer state (GPT-2 1.5B: 6.2 GB "
          "instead of 12.5 GB); the update still runs in fp32 and stores the moments back with stochastic "
          "rounding (unbiased; random bits hashed from `run.seed`, the step and the element, so runs are "
          "deterministic and CPU and CUDA agree to the bit); checkpoints hold fp32 moments either way, so a run "
          "may resume with the other setting"),
    KENUM("precision.fp8", fp8, "off", "off|tensorwise|rowwise|bf16",
          "fp8 matrix products for the block's linear layers (q/k/v, attention output, MLP, experts; "
          "docs/precision.md): activations and weights cast to E4M3 with a scale from their amax, output "
          "gradients to `fp8_grad`; `tensorwise` one scale per tensor, `rowwise` one per row along the "
          "product's contraction dimension; the CPU backend quantises and multiplies in fp32 (an exact "
          "emulation of the numerics, for validation); every product's dimensions must be multiples of 16 "
          "(else exit 2 naming the tensor); not with `compute: fp32` on CUDA; under `parallel.ep` > 1 `rowwise` "
          "only. `bf16`: the same products' operands (the weight gradients' too) rounded to bf16 (nearest even, no "
          "scale), products in fp32: "
          "the CPU backend's stand-in for a bf16 run, the reference `scripts/fp8_validate.sh` compares fp8 with"),
    KENUM("precision.fp8_grad", fp8_grad, "e5m2", "e5m2|e4m3",
          "fp8: format of the output gradients in the backward (E5M2: range; E4M3: precision)"),
    KENUM("precision.fp8_wgrad", fp8_wgrad, "bf16", "bf16|fp8",
          "fp8: the weight-gradient product dW = dout^T x in the activation dtype (`bf16`; fp32 on the CPU) or "
          "with both operands in fp8 (`fp8`)"),
    KINT("precision.fp8_amax_history", fp8_amax_history, "0", 0, 1024,
         "fp8: 0 = current scaling (each cast's scale from the tensor's own amax); N = delayed scaling from the "
         "largest amax of the same operand's last N casts, its own recorded in the same pass (the first cast "
         "uses its own); `tensorwise` only; the histories are checkpointed, and a resume in another layout "
         "carries those that mean the same there (docs/precision.md)"),
    KBOOL("precision.fp8_pow2_scales", fp8_pow2_scales, "false",
          "fp8: round every scale down to a power of two (scaling then loses no bits)"),
    KBOOL("precision.fp8_head", fp8_head, "false",
          "fp8: the output head's product in fp8 too (off by default: the logits feed the softmax directly, "
          "and the head's large vocabulary dimension holds most of a small model's outliers)"),
    KINT("checkpoint.every", ckpt_every, "500", 0, INF, "steps between checkpoints; 0 = off (a final one is still written, see `checkpoint.final`)"),
    KINT("checkpoint.keep_last", ckpt_keep_last, "3", 0, INF,
         "keep the newest this many checkpoints, deleting older ones once a newer one is complete; 0 = keep all"),
    KINT("checkpoint.keep_every", ckpt_keep_every, "0", 0, INF,
         "checkpoints at multiples of this step are milestones, never deleted; 0 = none"),
    KBOOL("checkpoint.async", ckpt_async, "true",
          "copy the state into a host buffer (allocated once) and write it from a background thread; at most one write in flight"),
    KINT("checkpoint.compress", ckpt_compress, "0", 0, 19, "zstd level of the tensor data; 0 = uncompressed"),
    KBOOL("checkpoint.direct_io", ckpt_direct_io, "true",
          "read and write checkpoint files with O_DIRECT where the file system takes it (large aligned chunks, "
          "kept out of the page cache); false: through the page cache"),
    KBOOL("checkpoint.final", ckpt_final, "true", "write a checkpoint after the last step"),
    KFLT("checkpoint.before_time_limit", ckpt_before_limit, "0", 0, 1e7,
         "under Slurm: save and exit 75 this many seconds before the job's end time; 0 = off"),
    KSTR("checkpoint.dir", ckpt_dir, "\"\"", "where checkpoints go; `\"\"` means `<run.dir>/checkpoints`"),
    KINT("metrics.log_every", log_every, "1", 1, INF, "steps between progress lines (metrics.jsonl gets every step)"),
    KBOOL("metrics.tensorboard", tensorboard, "true", "write TensorBoard event files (`events.out.tfevents.*`) in the run directory"),
    KFLT("metrics.peak_gflops", peak_gflops, "0", 0, 1e9,
         "peak FLOP/s of one device for MFU, in GFLOP/s; 0 = the GPU table, or the CPU's sgemm rate measured at start-up"),
    KENUM("metrics.progress", progress, "auto", "auto|bar|lines",
          "stdout of rank 0: `bar` redraws a live bar in place under the progress lines, `lines` writes plain lines "
          "only, `auto` = the bar when stdout is a terminal and no launcher (mpirun, srun, torchrun-style "
          "variables) started the run; launchers hand ranks pseudo-terminals whose output ends up in log files"),
    KSTR("metrics.mlflow", mlflow, "\"\"",
         "where rank 0 tracks the run in MLflow (docs/metrics.md \"MLflow\"): `http://HOST:PORT` or `https://...`, a "
         "tracking server, through its REST API from a background thread (auth from `MLFLOW_TRACKING_TOKEN` or "
         "`MLFLOW_TRACKING_USERNAME`/`_PASSWORD`; unsent points spool to `RUN_DIR/mlflow-spool.jsonl`); a directory "
         "(e.g. `mlruns`), a file store in MLflow's FileStore layout, for offline runs (MLflow 3 reads it with "
         "`MLFLOW_ALLOW_FILE_STORE=true`); left unset, an http(s) `MLFLOW_TRACKING_URI` is used; a resumed run "
         "continues the same MLflow run; `\"\"` = off"),
    KSTR("metrics.mlflow_experiment", mlflow_experiment, "\"kiln\"",
         "MLflow experiment the run is filed under (created when missing)"),
    KFLT("metrics.mlflow_flush_s", mlflow_flush_s, "30", 0, 86400,
         "tracking server: at the end, wait at most this many seconds for unsent points; what is left stays in "
         "`RUN_DIR/mlflow-spool.jsonl` and a resume sends it"),
    KBOOL("metrics.mlflow_required", mlflow_required, "true",
          "tracking server: a server that refuses the run (401, 403, 404) stops it with exit 2; false: the run "
          "goes on untracked after a warning"),
    KBOOL("monitor.heartbeat", heartbeat, "true", "write `heartbeat/rank<R>.json` (step, phase, time, host, pid) every step"),
    /* on by default: a hung rank should end its job, not burn the allocation;
     * 30 minutes is far above any single phase of a sane run */
    KFLT("monitor.stall_timeout_s", stall_timeout_s, "1800", 0, 1e7,
         "watchdog: a rank with no progress for this many seconds logs what each phase was doing and exits 1; 0 = off"),
    KFLT("monitor.spike_factor", spike_factor, "2.0", 0, 1e6,
         "warn when the loss exceeds this multiple of its running mean; 0 = off"),
    KINT("monitor.flight_records", flight_records, "256", 0, 1 << 20,
         "flight recorder: each rank keeps its last this many collectives and point-to-point operations (group, "
         "operation, sequence number, count, step, phase, times) in a fixed ring, written to "
         "`flight/rank<R>.json` on a collective timeout, a watchdog stall, a fatal signal or SIGUSR2 (`./train "
         "doctor RUN_DIR` reads them); 0 = off"),
    KBOOL("monitor.check_collectives", check_collectives, "false",
          "before every collective the group's ranks all-gather what they are about to call (operation, number, "
          "count, dtype, root): a mismatch stops the run at once (exit 1) naming both ranks and both calls instead "
          "of hanging; one small all-gather per collective (docs/parallel.md gives the cost)"),
    KSTR("monitor.prometheus_file", prometheus_file, "\"\"",
         "Prometheus exposition file for node-exporter's textfile collector (a path ending in `.prom` inside "
         "`--collector.textfile.directory`): rank 0 rewrites it atomically every `prometheus_every` steps "
         "(docs/metrics.md); `\"\"` = off"),
    KINT("monitor.prometheus_every", prometheus_every, "10", 1, INF, "steps between rewrites of `prometheus_file`"),
    KFLT("monitor.straggler_factor", straggler_factor, "1.5", 0, 1e6,
         "with several ranks: warn, naming rank and host, when one rank's busy time per step (step time minus "
         "time blocked in communication) exceeds this multiple of the other ranks' median for `straggler_steps` "
         "logged steps in a row; 0 = off, else > 1"),
    KINT("monitor.straggler_steps", straggler_steps, "3", 1, INF,
         "logged steps (`metrics.log_every`) in a row a rank must be slow before the straggler warning"),
    KSTR("init.from", init_from, "\"\"",
         "weights to start from: an llm.c GPT-2 `.bin`, a kiln checkpoint directory (parameters only), or a "
         "HuggingFace directory (`model.safetensors`) or `.safetensors` file (docs/formats.md); `\"\"` = random init"),
};
#define NKEYS ((int)(sizeof(cfg_keys) / sizeof(cfg_keys[0])))

/* Values computed from keys: shown as comments in the YAML and listed in the docs. */
typedef struct {
    const char *key, *doc;
    size_t off;
} CfgDerived;
static const CfgDerived cfg_derived[] = {
    {"model.padded_vocab", "`vocab_size` rounded up to a multiple of 64", offsetof(Config, padded_vocab)},
    {"batch.grad_accum", "`total_tokens / (micro_batch*seq_len)`: micro-batches per step over all ranks (each of dp ranks runs grad_accum / dp)", offsetof(Config, grad_accum)},
};
#define NDERIVED ((int)(sizeof(cfg_derived) / sizeof(cfg_derived[0])))

/* One load in progress: where each key got its value, for errors that involve
 * two keys after parsing ("model.n_embd" vs "model.n_head"). */
typedef struct {
    const char *file;
    char where[NKEYS][CFG_STR + 32];
} CfgLoad;

/* ---------- table helpers ---------- */

static int cfg_find(const char *path) {
    for (int i = 0; i < NKEYS; i++)
        if (strcmp(cfg_keys[i].key, path) == 0) return i;
    return -1;
}

/* A section is any proper prefix of a key path ending at a dot. */
static int cfg_is_section(const char *path) {
    size_t n = strlen(path);
    for (int i = 0; i < NKEYS; i++)
        if (strncmp(cfg_keys[i].key, path, n) == 0 && cfg_keys[i].key[n] == '.') return 1;
    return 0;
}

/* Index of the first key inside section `path` (which must be a section). */
static int cfg_first_in(const char *path) {
    size_t n = strlen(path);
    int i = 0;
    while (strncmp(cfg_keys[i].key, path, n) || cfg_keys[i].key[n] != '.') i++;
    return i;
}

static const char *cfg_last(const char *path) {
    const char *d = strrchr(path, '.');
    return d ? d + 1 : path;
}

/* Section of a key: "optim" for "optim.lr", the key itself for a top-level scalar. */
static size_t cfg_section_len(const char *key) {
    const char *d = strrchr(key, '.');
    return d ? (size_t)(d - key) : strlen(key);
}

static double cfg_int_hi(const CfgKey *k) {
    double tmax = k->type == CT_INT ? (double)INT_MAX : (double)INT64_MAX;
    return isinf(k->hi) || k->hi > tmax ? tmax : k->hi;
}

/* "[1, 1024]", "[0, 1)", ">= 0" (docs) or "[0, 2147483647]" (errors: say the real limit). */
static void cfg_range_text(const CfgKey *k, int for_doc, char *buf, size_t cap) {
    buf[0] = 0;
    if (k->type == CT_INT || k->type == CT_INT64 || k->type == CT_INTS) {
        if (for_doc && isinf(k->hi)) snprintf(buf, cap, ">= %lld", (long long)k->lo);
        else snprintf(buf, cap, "[%lld, %lld]", (long long)k->lo, (long long)cfg_int_hi(k));
    } else if (k->type == CT_FLOAT || k->type == CT_PAIR) {
        if (isinf(k->hi)) snprintf(buf, cap, "%s %g", (k->flags & CF_LO_OPEN) ? ">" : ">=", k->lo);
        else snprintf(buf, cap, "%c%g, %g%c", (k->flags & CF_LO_OPEN) ? '(' : '[', k->lo, k->hi,
                      (k->flags & CF_HI_OPEN) ? ')' : ']');
    } else if (k->type == CT_ENUM) {
        size_t n = 0;
        for (const char *c = k->choices; *c && n + 8 < cap; c++) {
            if (*c == '|') { n += (size_t)snprintf(buf + n, cap - n, ", "); continue; }
            buf[n++] = *c;
            buf[n] = 0;
        }
    }
}

/* What a key expects, in words, for "expected X, got Y". */
static void cfg_expect_text(const CfgKey *k, char *buf, size_t cap) {
    char r[256];
    cfg_range_text(k, 0, r, sizeof r);
    switch (k->type) {
    case CT_INT:
    case CT_INT64:
        snprintf(buf, cap, "an integer in %s%s", r, (k->flags & CF_AUTO) ? " or auto" : "");
        break;
    case CT_U64: snprintf(buf, cap, "an integer in [0, %llu]", (unsigned long long)UINT64_MAX); break;
    case CT_FLOAT: snprintf(buf, cap, "a number in %s", r); break;
    case CT_BOOL: snprintf(buf, cap, "a bool (true/false/yes/no)"); break;
    case CT_STR: snprintf(buf, cap, "a string (write \"\" for an empty one)"); break;
    case CT_ENUM: snprintf(buf, cap, "one of %s", r); break;
    case CT_PAIR: snprintf(buf, cap, "a list of 2 numbers, each in %s", r); break;
    case CT_INTS: snprintf(buf, cap, "a list of at most %d integers, each %s", CFG_MAX_INTS, r); break;
    case CT_SOURCES:
        snprintf(buf, cap, "a glob (a string) or a list of %s", (k->flags & CF_WEIGHTS) ? "sources {path: GLOB, "
                 "weight: W, name: N}" : "named sets {name: N, path: GLOB}");
        break;
    }
}

/* ---------- did you mean ---------- */

/* Optimal-string-alignment distance: Levenshtein plus adjacent transpositions,
 * so "modle" is one edit from "model". Inputs are key names (short). */
static int cfg_edit_distance(const char *a, const char *b) {
    int n = (int)strlen(a), m = (int)strlen(b);
    if (n > 63 || m > 63) return 99;
    int d[64][64];
    for (int i = 0; i <= n; i++) d[i][0] = i;
    for (int j = 0; j <= m; j++) d[0][j] = j;
    for (int i = 1; i <= n; i++)
        for (int j = 1; j <= m; j++) {
            int cost = a[i - 1] != b[j - 1], v = d[i - 1][j - 1] + cost;
            if (d[i - 1][j] + 1 < v) v = d[i - 1][j] + 1;
            if (d[i][j - 1] + 1 < v) v = d[i][j - 1] + 1;
            if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] && d[i - 2][j - 2] + 1 < v)
                v = d[i - 2][j - 2] + 1;
            d[i][j] = v;
        }
    return d[n][m];
}

/* Closest known key or section to `path`, comparing full paths and last
 * components (so "model.lr" finds "optim.lr"); NULL when nothing is close. */
static const char *cfg_suggest(const char *path, char *buf, size_t cap) {
    int best = 99, best_full = 99;
    buf[0] = 0;
    for (int i = 0; i < NKEYS; i++) {
        const char *key = cfg_keys[i].key;
        /* candidates: the key itself and each section above it */
        for (size_t n = strlen(key);; n = cfg_section_len(key)) {
            char cand[128];
            snprintf(cand, sizeof cand, "%.*s", (int)n, key);
            int full = cfg_edit_distance(path, cand);
            int last = cfg_edit_distance(cfg_last(path), cfg_last(cand));
            int d = full < last ? full : last;
            if (d < best || (d == best && full < best_full)) {
                best = d, best_full = full;
                kiln_strlcpy(buf, cand, cap);
            }
            if (n == cfg_section_len(key)) break;
        }
    }
    int len = (int)strlen(cfg_last(path)), limit = 1 + len / 4;
    if (limit > 3) limit = 3;
    return best <= limit && strcmp(buf, path) != 0 ? buf : NULL;
}

static void cfg_fail_unknown(const char *where, const char *path) {
    char s[128];
    if (cfg_suggest(path, s, sizeof s))
        kiln_fail(KILN_EXIT_USAGE, "%s: unknown key '%s'; did you mean '%s'?", where, path, s);
    kiln_fail(KILN_EXIT_USAGE, "%s: unknown key '%s' (docs/config.md lists every key)", where, path);
}

/* ---------- reading values ---------- */

static int cfg_is_null(const yaml_node_t *n) {
    if (n->type != YAML_SCALAR_NODE || n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE) return 0;
    const char *v = (const char *)n->data.scalar.value;
    return !*v || !strcmp(v, "~") || !strcmp(v, "null") || !strcmp(v, "Null") || !strcmp(v, "NULL");
}

/* The "got ..." half of a message. */
static void cfg_got_text(const yaml_node_t *n, char *buf, size_t cap) {
    if (!n || cfg_is_null(n)) snprintf(buf, cap, "an empty value");
    else if (n->type == YAML_SEQUENCE_NODE)
        snprintf(buf, cap, "a list of %d", (int)(n->data.sequence.items.top - n->data.sequence.items.start));
    else if (n->type == YAML_MAPPING_NODE) snprintf(buf, cap, "a mapping");
    else snprintf(buf, cap, "'%.80s%s'", (const char *)n->data.scalar.value, n->data.scalar.length > 80 ? "..." : "");
}

static void cfg_fail_expect(const char *where, const char *key, const CfgKey *k, const yaml_node_t *n) {
    char e[512], g[128];
    cfg_expect_text(k, e, sizeof e);
    cfg_got_text(n, g, sizeof g);
    kiln_fail(KILN_EXIT_USAGE, "%s: key '%s': expected %s, got %s", where, key, e, g);
}

/* Plain (unquoted) scalar text, or NULL: a quoted "1e-3" is a string, never a number. */
static const char *cfg_plain(const yaml_node_t *n) {
    if (!n || n->type != YAML_SCALAR_NODE || n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE || cfg_is_null(n))
        return NULL;
    return (const char *)n->data.scalar.value;
}

static int cfg_parse_float(const CfgKey *k, const yaml_node_t *n, float *out) {
    const char *s = cfg_plain(n);
    char *end;
    if (!s) return -1;
    errno = 0;
    double d = strtod(s, &end);
    if (end == s || *end || isnan(d)) return -1;
    float v = (float)d; /* range applies to the value actually stored */
    if (!(v >= k->lo) || v > k->hi || ((k->flags & CF_HI_OPEN) && v >= k->hi) || ((k->flags & CF_LO_OPEN) && v <= k->lo))
        return -1;
    *out = v;
    return 0;
}

static int cfg_auto_value(const CfgKey *k) { return (k->flags & CF_AUTO_NEG) ? -1 : 0; }

static int cfg_parse_int(const CfgKey *k, const yaml_node_t *n, long long *out) {
    const char *s = cfg_plain(n);
    char *end;
    if ((k->flags & CF_AUTO) && n && n->type == YAML_SCALAR_NODE && !strcmp((const char *)n->data.scalar.value, "auto")) {
        *out = cfg_auto_value(k);
        return 0;
    }
    if (!s) return -1;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end || errno == ERANGE) return -1;
    if (v < (long long)k->lo || v > (long long)cfg_int_hi(k)) return -1;
    *out = v;
    return 0;
}

static int cfg_parse_u64(const yaml_node_t *n, uint64_t *out) {
    const char *s = cfg_plain(n);
    char *end;
    if (!s || *s == '-') return -1;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s || *end || errno == ERANGE) return -1;
    *out = v;
    return 0;
}

static int cfg_parse_bool(const yaml_node_t *n, int *out) {
    const char *s = cfg_plain(n);
    if (!s) return -1;
    if (!strcasecmp(s, "true") || !strcasecmp(s, "yes")) *out = 1;
    else if (!strcasecmp(s, "false") || !strcasecmp(s, "no")) *out = 0;
    else return -1;
    return 0;
}

static int cfg_enum_ok(const CfgKey *k, const char *s) {
    size_t n = strlen(s);
    for (const char *c = k->choices; c; c = strchr(c, '|') ? strchr(c, '|') + 1 : NULL)
        if (!strncmp(c, s, n) && (c[n] == '|' || c[n] == 0)) return 1;
    return 0;
}

/* Strings and enums: any scalar except an empty plain one; must fit the field. */
static void cfg_set_string(const CfgKey *k, const char *where, const yaml_node_t *n, char *dst) {
    if (!n || n->type != YAML_SCALAR_NODE || cfg_is_null(n)) cfg_fail_expect(where, k->key, k, n);
    const char *s = (const char *)n->data.scalar.value;
    if (strlen(s) != n->data.scalar.length)
        kiln_fail(KILN_EXIT_USAGE, "%s: key '%s': expected a string without NUL bytes", where, k->key);
    if (k->type == CT_ENUM && !cfg_enum_ok(k, s)) cfg_fail_expect(where, k->key, k, n);
    if (strlen(s) >= k->size)
        kiln_fail(KILN_EXIT_USAGE, "%s: key '%s': expected at most %zu bytes, got %zu", where, k->key,
                  k->size - 1, strlen(s));
    memset(dst, 0, k->size); /* whole field, so equal configs compare equal byte for byte */
    memcpy(dst, s, strlen(s));
}

/* `file` (NULL for --set and defaults) lets an item error point at the item's own line. */
static void cfg_set_pair(const CfgKey *k, const char *file, const char *where, yaml_document_t *doc,
                         const yaml_node_t *n, char *base) {
    if (!n || n->type != YAML_SEQUENCE_NODE || n->data.sequence.items.top - n->data.sequence.items.start != 2)
        cfg_fail_expect(where, k->key, k, n);
    for (int i = 0; i < 2; i++) {
        yaml_node_t *item = yaml_document_get_node(doc, n->data.sequence.items.start[i]);
        float v;
        if (cfg_parse_float(k, item, &v)) {
            CfgKey one = *k;
            char name[128];
            one.type = CT_FLOAT;
            char at[CFG_STR + 32];
            snprintf(name, sizeof name, "%s[%d]", k->key, i);
            if (file) snprintf(at, sizeof at, "%s:%zu", file, item->start_mark.line + 1);
            cfg_fail_expect(file ? at : where, name, &one, item);
        }
        memcpy(base + (i ? k->off2 : k->off), &v, sizeof v);
    }
}

static void cfg_set_ints(const CfgKey *k, const char *file, const char *where, yaml_document_t *doc,
                         const yaml_node_t *n, char *base) {
    if (!n || n->type != YAML_SEQUENCE_NODE) cfg_fail_expect(where, k->key, k, n);
    int count = (int)(n->data.sequence.items.top - n->data.sequence.items.start);
    if (count > CFG_MAX_INTS) cfg_fail_expect(where, k->key, k, n);
    int *dst = (int *)(base + k->off);
    memset(dst, 0, k->size);
    for (int i = 0; i < count; i++) {
        yaml_node_t *item = yaml_document_get_node(doc, n->data.sequence.items.start[i]);
        CfgKey one = *k;
        one.type = CT_INT;
        long long v;
        if (cfg_parse_int(&one, item, &v)) {
            char name[128], at[CFG_STR + 32];
            snprintf(name, sizeof name, "%s[%d]", k->key, i);
            if (file) snprintf(at, sizeof at, "%s:%zu", file, item->start_mark.line + 1);
            cfg_fail_expect(file ? at : where, name, &one, item);
        }
        dst[i] = (int)v;
    }
    *(int *)(base + k->off2) = count;
}

void cfg_source_name(const char *glob, char *buf, size_t cap) {
    char pre[CFG_STR], dir[CFG_STR] = "", name[2 * CFG_STR];
    size_t w = strcspn(glob, "*?[");
    snprintf(pre, sizeof pre, "%.*s", (int)(w < sizeof pre ? w : sizeof pre - 1), glob);
    char *slash = strrchr(pre, '/'), *file = slash ? slash + 1 : pre;
    if (slash) {
        *slash = 0;
        char *d = strrchr(pre, '/');
        kiln_strlcpy(dir, d ? d + 1 : pre, sizeof dir);
        if (!strcmp(dir, ".") || !strcmp(dir, "..")) dir[0] = 0;
    }
    size_t n = strlen(file);
    if (!glob[w]) { /* no wildcard: a file name, without its extensions */
        if (n > 4 && !strcmp(file + n - 4, ".zst")) file[n -= 4] = 0;
        if (n > 4 && !strcmp(file + n - 4, ".bin")) file[n -= 4] = 0;
    }
    while (n > 0 && !((file[n - 1] >= 'a' && file[n - 1] <= 'z') || (file[n - 1] >= 'A' && file[n - 1] <= 'Z') ||
                      (file[n - 1] >= '0' && file[n - 1] <= '9')))
        file[--n] = 0;
    snprintf(name, sizeof name, "%s%s%s", dir, dir[0] && file[0] ? "_" : "", file);
    if (!name[0]) snprintf(name, sizeof name, "source");
    for (char *q = name; *q; q++)
        if (!((*q >= 'a' && *q <= 'z') || (*q >= 'A' && *q <= 'Z') || (*q >= '0' && *q <= '9') || *q == '_' ||
              *q == '-' || *q == '.'))
            *q = '_';
    kiln_strlcpy(buf, name, cap); /* a long name is cut, never an error */
}

/* A source's name: what metrics keys and TensorBoard tags are made of. */
static int cfg_name_ok(const char *s) {
    if (!*s) return 0;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') || *s == '_' ||
              *s == '-' || *s == '.'))
            return 0;
    return 1;
}

/* One entry of a list-form data.train / data.val: a mapping of path, name
 * (and weight where CF_WEIGHTS). `at` locates it for messages. */
static void cfg_set_source(const CfgKey *k, const char *at, int i, yaml_document_t *doc, const yaml_node_t *n,
                           CfgSource *out) {
    int weights = (k->flags & CF_WEIGHTS) != 0;
    const char *shape = weights ? "{path: GLOB, weight: W, name: N}" : "{name: N, path: GLOB}";
    char got[128];
    if (n->type != YAML_MAPPING_NODE) {
        cfg_got_text(n, got, sizeof got);
        kiln_fail(KILN_EXIT_USAGE, "%s: key '%s[%d]': expected a mapping %s, got %s", at, k->key, i, shape, got);
    }
    out->weight = 1;
    int have_path = 0, have_name = 0, have_weight = 0;
    for (yaml_node_pair_t *p = n->data.mapping.pairs.start; p < n->data.mapping.pairs.top; p++) {
        yaml_node_t *kn = yaml_document_get_node(doc, p->key), *vn = yaml_document_get_node(doc, p->value);
        const char *name = kn->type == YAML_SCALAR_NODE ? (const char *)kn->data.scalar.value : "?";
        int *seen = !strcmp(name, "path") ? &have_path : !strcmp(name, "name") ? &have_name
                  : weights && !strcmp(name, "weight") ? &have_weight : NULL;
        if (!seen)
            kiln_fail(KILN_EXIT_USAGE, "%s: unknown key '%s[%d].%s': an entry has %s", at, k->key, i, name,
                      weights ? "path, weight and name" : "name and path");
        if (*seen) kiln_fail(KILN_EXIT_USAGE, "%s: duplicate key '%s[%d].%s'", at, k->key, i, name);
        *seen = 1;
        int is_str = vn->type == YAML_SCALAR_NODE && !cfg_is_null(vn) &&
                     strlen((const char *)vn->data.scalar.value) == vn->data.scalar.length;
        const char *v = is_str ? (const char *)vn->data.scalar.value : NULL;
        cfg_got_text(vn, got, sizeof got);
        if (seen == &have_weight) {
            const char *pl = cfg_plain(vn);
            char *end;
            double w = pl ? strtod(pl, &end) : NAN;
            if (!pl || end == pl || *end || !isfinite(w) || !(w > 0))
                kiln_fail(KILN_EXIT_USAGE, "%s: key '%s[%d].weight': expected a number > 0, got %s", at, k->key, i, got);
            out->weight = w;
        } else if (seen == &have_path) {
            if (!v || strlen(v) >= CFG_STR)
                kiln_fail(KILN_EXIT_USAGE, "%s: key '%s[%d].path': expected a glob of token shards (a string of at "
                          "most %d bytes), got %s", at, k->key, i, CFG_STR - 1, got);
            kiln_strlcpy(out->path, v, sizeof out->path);
        } else {
            if (!v || strlen(v) >= CFG_NAME || !cfg_name_ok(v))
                kiln_fail(KILN_EXIT_USAGE, "%s: key '%s[%d].name': expected a name of 1-%d letters, digits, '_', '-' or "
                          "'.', got %s", at, k->key, i, CFG_NAME - 1, got);
            kiln_strlcpy(out->name, v, sizeof out->name);
        }
    }
    if (!have_path) kiln_fail(KILN_EXIT_USAGE, "%s: key '%s[%d].path': required (a glob of token shards)", at, k->key, i);
    if (!have_name) cfg_source_name(out->path, out->name, sizeof out->name);
    else if (!weights && !strcmp(out->name, "loss"))
        kiln_fail(KILN_EXIT_USAGE, "%s: key '%s[%d].name': 'loss' is taken (val/loss is the mean over the sets); "
                  "choose another", at, k->key, i);
}

/* data.train / data.val: a plain glob string (kept in the key's string
 * field, one source of weight 1) or a list of entries. */
static void cfg_set_sources(Config *c, const CfgKey *k, const char *file, const char *where, yaml_document_t *doc,
                            const yaml_node_t *n) {
    char *glob = (char *)c + k->off;
    CfgSources *ss = (CfgSources *)((char *)c + k->off2);
    memset(ss, 0, sizeof *ss); /* whole struct, so equal configs compare equal byte for byte */
    memset(glob, 0, k->size);
    if (n && n->type == YAML_SCALAR_NODE && !cfg_is_null(n)) {
        cfg_set_string(k, where, n, glob);
        if (glob[0]) {
            ss->n = 1;
            kiln_strlcpy(ss->s[0].path, glob, sizeof ss->s[0].path);
            cfg_source_name(glob, ss->s[0].name, sizeof ss->s[0].name);
            ss->s[0].weight = 1;
        }
        return;
    }
    if (!n || n->type != YAML_SEQUENCE_NODE) cfg_fail_expect(where, k->key, k, n);
    int count = (int)(n->data.sequence.items.top - n->data.sequence.items.start);
    if (count == 0 || count > CFG_MAX_SOURCES)
        kiln_fail(KILN_EXIT_USAGE, "%s: key '%s': expected 1 to %d entries, got %d", where, k->key, CFG_MAX_SOURCES, count);
    ss->list = 1;
    ss->n = count;
    for (int i = 0; i < count; i++) {
        yaml_node_t *item = yaml_document_get_node(doc, n->data.sequence.items.start[i]);
        char at[CFG_STR + 32];
        if (file) snprintf(at, sizeof at, "%s:%zu", file, item->start_mark.line + 1);
        else snprintf(at, sizeof at, "%s", where);
        cfg_set_source(k, at, i, doc, item, &ss->s[i]);
        for (int j = 0; j < i; j++)
            if (!strcmp(ss->s[j].name, ss->s[i].name))
                kiln_fail(KILN_EXIT_USAGE, "%s: key '%s[%d].name': '%s' is also the name of %s[%d]; give each entry a "
                          "name of its own (name: ...)", at, k->key, i, ss->s[i].name, k->key, j);
    }
}

/* Store node `n` into key `k` of `c`, or exit 2 saying what was expected. */
static void cfg_apply(Config *c, const CfgKey *k, const char *file, const char *where, yaml_document_t *doc,
                      const yaml_node_t *n) {
    char *base = (char *)c, *dst = base + k->off;
    long long i64;
    int ok = 1;
    switch (k->type) {
    case CT_INT:
        if ((ok = !cfg_parse_int(k, n, &i64))) *(int *)dst = (int)i64;
        break;
    case CT_INT64:
        if ((ok = !cfg_parse_int(k, n, &i64))) *(int64_t *)dst = i64;
        break;
    case CT_U64: ok = !cfg_parse_u64(n, (uint64_t *)dst); break;
    case CT_FLOAT: ok = !cfg_parse_float(k, n, (float *)dst); break;
    case CT_BOOL: ok = !cfg_parse_bool(n, (int *)dst); break;
    case CT_STR:
    case CT_ENUM: cfg_set_string(k, where, n, dst); break;
    case CT_PAIR: cfg_set_pair(k, file, where, doc, n, base); break;
    case CT_SOURCES: cfg_set_sources(c, k, file, where, doc, n); break;
    case CT_INTS: cfg_set_ints(k, file, where, doc, n, base); break;
    }
    if (!ok) cfg_fail_expect(where, k->key, k, n);
}

/* ---------- YAML documents ---------- */

/* Exit 2 if text nests deeper than CFG_MAX_DEPTH (see config.h), before the
 * loader spends quadratic time on it. */
static void cfg_check_depth(const char *text, size_t len, const char *where, int add_line) {
    yaml_parser_t p;
    if (!yaml_parser_initialize(&p)) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot initialize libyaml", where);
    yaml_parser_set_input_string(&p, (const unsigned char *)text, len);
    /* the events, nothing built: a syntax error ends the walk and is the
     * loader's to report */
    int depth = 0;
    yaml_event_t ev;
    while (yaml_parser_parse(&p, &ev)) {
        yaml_event_type_t t = ev.type;
        size_t line = ev.start_mark.line + 1;
        yaml_event_delete(&ev);
        if (t == YAML_STREAM_END_EVENT) break;
        if (t == YAML_SEQUENCE_END_EVENT || t == YAML_MAPPING_END_EVENT) depth--;
        if ((t == YAML_SEQUENCE_START_EVENT || t == YAML_MAPPING_START_EVENT) && ++depth > CFG_MAX_DEPTH) {
            yaml_parser_delete(&p);
            char loc[CFG_STR + 32];
            if (add_line) snprintf(loc, sizeof loc, "%s:%zu", where, line);
            else snprintf(loc, sizeof loc, "%s", where);
            kiln_fail(KILN_EXIT_USAGE, "%s: YAML nested deeper than %d levels; no key of a kiln config nests "
                      "more than a few", loc, CFG_MAX_DEPTH);
        }
    }
    yaml_parser_delete(&p);
}

/* Parse `text` into `doc`. On a syntax error exits 2 with libyaml's problem and
 * the line; `where` is the file name (lines are appended) or "--set ...". */
static void cfg_parse_text(const char *text, size_t len, const char *where, int add_line, yaml_document_t *doc) {
    if (len > CFG_MAX_BYTES)
        kiln_fail(KILN_EXIT_USAGE, "%s: %zu bytes of YAML; a config holds at most %zu", where, len, CFG_MAX_BYTES);
    cfg_check_depth(text, len, where, add_line);
    yaml_parser_t p;
    if (!yaml_parser_initialize(&p)) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot initialize libyaml", where);
    yaml_parser_set_input_string(&p, (const unsigned char *)text, len);
    if (!yaml_parser_load(&p, doc)) {
        char loc[CFG_STR + 32];
        if (add_line) snprintf(loc, sizeof loc, "%s:%zu", where, p.problem_mark.line + 1);
        else snprintf(loc, sizeof loc, "%s", where);
        if (p.context) /* libyaml's "while parsing X" points at where X began: say that line too */
            kiln_fail(KILN_EXIT_USAGE, "%s: invalid YAML: %s (%s started on line %zu)", loc,
                      p.problem ? p.problem : "parse error", p.context, p.context_mark.line + 1);
        kiln_fail(KILN_EXIT_USAGE, "%s: invalid YAML: %s", loc, p.problem ? p.problem : "parse error");
    }
    /* a second document ("---") would be silently ignored: refuse it */
    yaml_document_t extra;
    if (!yaml_parser_load(&p, &extra))
        kiln_fail(KILN_EXIT_USAGE, "%s:%zu: invalid YAML: %s", where, p.problem_mark.line + 1,
                  p.problem ? p.problem : "parse error");
    yaml_node_t *r = yaml_document_get_root_node(&extra);
    if (r)
        kiln_fail(KILN_EXIT_USAGE, "%s:%zu: expected one YAML document, found another", where,
                  r->start_mark.line + 1);
    yaml_document_delete(&extra);
    yaml_parser_delete(&p);
}

static void cfg_where(CfgLoad *L, const yaml_node_t *n, char *buf, size_t cap) {
    snprintf(buf, cap, "%s:%zu", L->file, n->start_mark.line + 1);
}

/* Walk a mapping whose keys extend `prefix` ("" at the top), applying leaves and
 * descending into sections; every unknown, duplicate or misshapen key exits 2. */
static void cfg_walk(Config *c, CfgLoad *L, yaml_document_t *doc, yaml_node_t *map, const char *prefix) {
    char where[CFG_STR + 32];
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top; p++) {
        yaml_node_t *kn = yaml_document_get_node(doc, p->key), *vn = yaml_document_get_node(doc, p->value);
        cfg_where(L, kn, where, sizeof where);
        if (kn->type != YAML_SCALAR_NODE)
            kiln_fail(KILN_EXIT_USAGE, "%s: expected a key name in %s, got a %s", where, *prefix ? prefix : "the top level",
                      kn->type == YAML_MAPPING_NODE ? "mapping" : "list");
        const char *name = (const char *)kn->data.scalar.value;
        char path[256];
        snprintf(path, sizeof path, "%s%s%s", prefix, *prefix ? "." : "", name);
        for (yaml_node_pair_t *q = map->data.mapping.pairs.start; q < p; q++) {
            yaml_node_t *qn = yaml_document_get_node(doc, q->key);
            if (qn->type == YAML_SCALAR_NODE && !strcmp((const char *)qn->data.scalar.value, name))
                kiln_fail(KILN_EXIT_USAGE, "%s: duplicate key '%s' (first set on line %zu)", where, path,
                          qn->start_mark.line + 1);
        }
        int i = cfg_find(path);
        if (i >= 0) {
            cfg_where(L, vn, where, sizeof where);
            cfg_apply(c, &cfg_keys[i], L->file, where, doc, vn);
            kiln_strlcpy(L->where[i], where, sizeof L->where[i]);
        } else if (cfg_is_section(path)) {
            if (vn->type == YAML_MAPPING_NODE) cfg_walk(c, L, doc, vn, path);
            else if (!cfg_is_null(vn)) { /* an empty section (all keys commented out) is fine */
                char g[128];
                cfg_got_text(vn, g, sizeof g);
                cfg_where(L, vn, where, sizeof where);
                kiln_fail(KILN_EXIT_USAGE, "%s: key '%s': expected a mapping of %s keys, got %s", where, path, path, g);
            }
        } else {
            cfg_fail_unknown(where, path);
        }
    }
}

static void cfg_load_file(Config *c, CfgLoad *L, const char *path) {
    size_t len;
    char *text = kiln_read_file_max(path, CFG_MAX_BYTES, &len);
    if (!text) {
        int e = errno;
        kiln_fail_hint(KILN_EXIT_USAGE, "pass a YAML config, e.g. ./train configs/tiny.yaml (docs/config.md lists every key)",
                       "%s: cannot read config: %s", path, kiln_strerror(e));
    }
    yaml_document_t doc;
    cfg_parse_text(text, len, path, 1, &doc);
    yaml_node_t *root = yaml_document_get_root_node(&doc);
    if (root && !cfg_is_null(root)) {
        if (root->type != YAML_MAPPING_NODE) {
            char g[128];
            cfg_got_text(root, g, sizeof g);
            kiln_fail(KILN_EXIT_USAGE, "%s:%zu: expected a mapping of sections at the top level (run:, model:, ...), got %s",
                      path, root->start_mark.line + 1, g);
        }
        cfg_walk(c, L, &doc, root, "");
    }
    yaml_document_delete(&doc);
    free(text);
}

/* One "key.path=value" override; the value is YAML, so lists and quoting work. */
static void cfg_apply_set(Config *c, CfgLoad *L, const char *set) {
    const char *eq = strchr(set, '=');
    if (!eq) kiln_fail(KILN_EXIT_USAGE, "--set: '%s' has no '=': write --set key.path=value", set);
    char path[256];
    snprintf(path, sizeof path, "%.*s", (int)(eq - set), set);
    int i = cfg_find(path);
    if (i < 0 && cfg_is_section(path))
        kiln_fail(KILN_EXIT_USAGE, "--set: '%s' is a section; set one key at a time, e.g. --set %s.%s=...", path,
                  path, cfg_last(cfg_keys[cfg_first_in(path)].key));
    if (i < 0) cfg_fail_unknown("--set", path);
    yaml_document_t doc;
    cfg_parse_text(eq + 1, strlen(eq + 1), "--set", 0, &doc);
    cfg_apply(c, &cfg_keys[i], NULL, "--set", &doc, yaml_document_get_root_node(&doc));
    yaml_document_delete(&doc);
    kiln_strlcpy(L->where[i], "--set", sizeof L->where[i]);
}

/* ---------- after parsing: cross-key checks and derived values ---------- */

/* Location for an error about key `a` (or, if `a` kept its default, key `b`). */
static const char *cfg_where_of(CfgLoad *L, const char *a, const char *b) {
    int i = cfg_find(a), j = b ? cfg_find(b) : -1;
    if (strcmp(L->where[i], "default") || j < 0) return L->where[i];
    return L->where[j];
}

/* The balancing bias is moved in the whole parameter arena after the step;
 * ZeRO-2/3 keep the master in per-rank shards that would overwrite it. */
static void cfg_check_moe(const Config *c, const ArchSpec *s, CfgLoad *L) {
    if (s->mlp == MLP_MOE && s->moe.bias_update_rate > 0 && c->zero >= 2)
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'model.moe.bias_update_rate': the balancing bias is updated outside the "
                  "optimizer, which ZeRO-%d's parameter shards do not see yet; use parallel.zero 0 or 1, or "
                  "bias_update_rate: 0", cfg_where_of(L, "model.moe.bias_update_rate", "parallel.zero"), c->zero);
}

/* Expert parallelism (docs/parallel.md "Expert parallelism"): whole experts
 * per rank, so ep divides the experts (and, with an explicit dp, dp x cp:
 * the ep groups are consecutive ranks of that plane; dp auto is checked at launch by
 * mesh_plan); the expert tensors reduce over EDP, a second ZeRO-1 domain,
 * which ZeRO-2/3's per-layer units over dp do not have. Every rank loads the
 * config, so every rank says it, before anything is allocated. */
static void cfg_check_ep(const Config *c, const ArchSpec *s, CfgLoad *L) {
    if (c->ep <= 1) return;
    const char *w = cfg_where_of(L, "parallel.ep", NULL);
    if (s->mlp != MLP_MOE)
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'parallel.ep': %d spreads MoE experts over ranks, but model.mlp is %s; "
                  "use model.mlp: moe or parallel.ep: 1", w, c->ep, arch_mlp_name(s->mlp));
    if (s->moe.n_experts % c->ep)
        kiln_fail(KILN_EXIT_USAGE, "%s: keys 'parallel.ep', 'model.moe.n_experts': ep %d must divide the %d experts "
                  "(each rank holds n_experts / ep whole experts)", w, c->ep, s->moe.n_experts);
    if (c->dp > 0 && (c->dp * c->cp) % c->ep)
        kiln_fail(KILN_EXIT_USAGE, "%s: keys 'parallel.ep', 'parallel.dp': ep %d must divide dp x cp = %d (expert "
                  "groups are ep consecutive ranks of dp x cp)", w, c->ep, c->dp * c->cp);
    if (c->zero >= 2)
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'parallel.zero': expert parallelism runs with ZeRO 0 or 1 (its expert "
                  "tensors shard over the EDP group, ZeRO-%d's layer units over dp), got %d",
                  cfg_where_of(L, "parallel.zero", "parallel.ep"), c->zero, c->zero);
}

/* Lion's and Muon's ops keep fp32 state and update fp32 parameters only. */
static void cfg_check_optim(const Config *c, CfgLoad *L) {
    if (strcmp(c->optim_name, "adamw") == 0) return;
    const char *n = c->optim_name;
    if (strcmp(c->optim_state, "fp32") != 0)
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'precision.optim_state': optim.name %s keeps its momentum in fp32; "
                  "use precision.optim_state: fp32", cfg_where_of(L, "precision.optim_state", "optim.name"), n);
    if (strcmp(c->master, "fp32") != 0)
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'precision.master': optim.name %s updates an fp32 master; use "
                  "precision.master: fp32", cfg_where_of(L, "precision.master", "optim.name"), n);
}

static void cfg_check_parallel(const Config *c, CfgLoad *L) {
    if (c->pp == 1 && (c->pp_virtual > 1 || c->n_pp_layers > 0))
        kiln_fail(KILN_EXIT_USAGE, "%s: key '%s': chunks and stage layers need parallel.pp > 1",
                  cfg_where_of(L, c->pp_virtual > 1 ? "parallel.pp_virtual" : "parallel.pp_layers", "parallel.pp"),
                  c->pp_virtual > 1 ? "parallel.pp_virtual" : "parallel.pp_layers");
    if (c->tp > 1) {
        if (strcmp(c->sequence_parallel, "false") != 0 && c->seq_len % c->tp)
            kiln_fail(KILN_EXIT_USAGE, "%s: keys 'parallel.sequence_parallel', 'model.seq_len': sequence parallelism "
                      "splits the tokens over tp = %d ranks, and seq_len %d does not divide by it; make seq_len a "
                      "multiple of tp, or set parallel.sequence_parallel: false",
                      cfg_where_of(L, "parallel.sequence_parallel", "parallel.tp"), c->tp, c->seq_len);
    }
    if (c->cp > 1) {
        if (c->seq_len % (2 * c->cp))
            kiln_fail(KILN_EXIT_USAGE, "%s: keys 'model.seq_len', 'parallel.cp': a sequence of %d tokens does not split "
                      "into 2 x cp = %d chunks; make seq_len a multiple of %d", cfg_where_of(L, "parallel.cp",
                      "model.seq_len"), c->seq_len, 2 * c->cp, 2 * c->cp);
        if (c->tp > 1 && strcmp(c->sequence_parallel, "false") != 0 && ((long long)c->micro_batch * c->seq_len /
                                                                        c->cp) % c->tp)
            kiln_fail(KILN_EXIT_USAGE, "%s: keys 'parallel.sequence_parallel', 'parallel.cp': a rank's %d x %d tokens "
                      "of a micro-batch do not split over tp = %d ranks; make micro_batch * seq_len / cp a multiple of "
                      "tp, or set parallel.sequence_parallel: false", cfg_where_of(L, "parallel.sequence_parallel",
                      "parallel.cp"), c->micro_batch, c->seq_len / c->cp, c->tp);
    }
    /* the global batch splits evenly over the dp ranks (auto is checked at launch) */
    if (c->dp > 0 && c->grad_accum % c->dp)
        kiln_fail(KILN_EXIT_USAGE,
                  "%s: key 'batch.total_tokens': %lld tokens are %d micro-batches of %d x %d, which do not split "
                  "evenly over parallel.dp = %d ranks; make total_tokens a multiple of micro_batch*seq_len*dp = %lld",
                  cfg_where_of(L, "batch.total_tokens", "parallel.dp"), (long long)c->total_tokens, c->grad_accum,
                  c->micro_batch, c->seq_len, c->dp, (long long)c->micro_batch * c->seq_len * c->dp);
}

/* fp8 combinations not supported (docs/precision.md). Under expert
 * parallelism a routed expert's rows come from every ep rank's micro-batch:
 * a per-row scale is the same whichever rank holds the row, so rowwise runs
 * as one rank does, but a tensorwise amax, and fp8 weight gradients'
 * per-column amaxes, would be over the ep group's rows, which no one-rank
 * run computes. A per-row history means nothing for activations, whose rows
 * are other tokens each step. */
static void cfg_check_fp8(const Config *c, CfgLoad *L) {
    if (!strcmp(c->fp8, "off")) return;
    if (c->ep > 1 && !strcmp(c->fp8, "tensorwise"))
        kiln_fail(KILN_EXIT_USAGE, "%s: keys 'precision.fp8', 'parallel.ep': tensorwise fp8 under expert "
                  "parallelism is not supported (a routed expert's amax would be over the tokens every ep rank "
                  "routed to it, which no one-rank run computes); set precision.fp8: rowwise (each row's own "
                  "scale) or parallel.ep: 1", cfg_where_of(L, "precision.fp8", "parallel.ep"));
    if (c->ep > 1 && !strcmp(c->fp8, "rowwise") && !strcmp(c->fp8_wgrad, "fp8"))
        kiln_fail(KILN_EXIT_USAGE, "%s: keys 'precision.fp8_wgrad', 'parallel.ep': fp8 weight gradients under "
                  "expert parallelism are not supported (their per-column scales run over an expert's rows, which "
                  "come from every ep rank's micro-batch); set precision.fp8_wgrad: bf16 or parallel.ep: 1",
                  cfg_where_of(L, "precision.fp8_wgrad", "parallel.ep"));
    if (c->fp8_amax_history > 0 && strcmp(c->fp8, "tensorwise"))
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'precision.fp8_amax_history': delayed scaling is tensorwise only "
                  "(%s), got %d with precision.fp8: %s; set it to 0 or precision.fp8: tensorwise",
                  cfg_where_of(L, "precision.fp8_amax_history", "precision.fp8"),
                  !strcmp(c->fp8, "rowwise") ? "an activation's rows are other tokens each step" : "bf16 has no scale",
                  c->fp8_amax_history, c->fp8);
}

/* precision.master bf16 makes the bf16 compute copy the parameters: it
 * needs bf16 activations (CUDA; a CPU run found by device: auto is refused
 * at start-up, when the backend is known) and whole parameters on every rank
 * (ZeRO shards and gathers an fp32 master). */
/* precision.attention_deterministic false changes only cuDNN's backward:
 * refused where the config already rules cuDNN out (kiln's kernels, the CPU
 * backend and context parallelism's block kernels sum in a fixed order). */
static void cfg_check_attention(const Config *c, CfgLoad *L) {
    if (c->attention_deterministic) return;
    const char *why = NULL;
    if (!strcmp(c->device, "cpu")) why = "device: cpu (its attention sums in a fixed order)";
    else if (!strcmp(c->compute, "fp32")) why = "precision.compute: fp32 (attention runs the SIMT kernels)";
    else if (!strcmp(c->attention, "simt")) why = "precision.attention: simt (kiln's kernels)";
    else if (!strcmp(c->attention, "tensor_cores")) why = "precision.attention: tensor_cores (kiln's kernels)";
    else if (c->n_kv_head > 0 && c->n_kv_head < c->n_head)
        why = "grouped K/V heads (model.n_kv_head < model.n_head: kiln's kernels)";
    else if (c->doc_masking) why = "data.doc_masking (kiln's kernels)";
    else if (c->cp > 1) why = "parallel.cp > 1 (context parallelism's block kernels)";
    if (why)
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'precision.attention_deterministic': false only changes cuDNN's attention "
                  "backward, and this run's attention never runs on cuDNN: %s; remove the key or set it to true",
                  cfg_where_of(L, "precision.attention_deterministic", NULL), why);
}

/* Pipeline stages with a tied embedding hold two copies that must stay
 * equal; stochastic rounding draws each element's bits by its place in the
 * rank's arena, which differs between the first and the last stage. */
static void cfg_check_pp_precision(const Config *c, const ArchSpec *s, CfgLoad *L) {
    int sr_state = strcmp(c->optim_state, "bf16") == 0, sr_master = !strcmp(c->master, "bf16");
    if (c->pp > 1 && s->tie_embeddings && (sr_state || sr_master))
        kiln_fail(KILN_EXIT_USAGE, "%s: key '%s': bf16 %s are rounded stochastically by arena position, so the first "
                  "and last pipeline stages' copies of the tied embedding would drift apart; use %s: fp32, or "
                  "model.tie_embeddings: false", cfg_where_of(L, sr_state ? "precision.optim_state" :
                  "precision.master", "parallel.pp"), sr_state ? "precision.optim_state" : "precision.master",
                  sr_state ? "moments" : "parameters", sr_state ? "precision.optim_state" : "precision.master");
}

static void cfg_check_precision(const Config *c, CfgLoad *L) {
    cfg_check_fp8(c, L);
    cfg_check_attention(c, L);
    if (strcmp(c->master, "bf16") != 0) return;
    if (!strcmp(c->compute, "fp32") || !strcmp(c->device, "cpu"))
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'precision.master': bf16 needs bf16 activations (device: cuda with "
                  "precision.compute: bf16), got %s; use precision.master: fp32",
                  cfg_where_of(L, "precision.master", NULL),
                  !strcmp(c->device, "cpu") ? "device: cpu (always fp32)" : "precision.compute: fp32");
    if (c->zero != 0)
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'precision.master': bf16 is plain data parallelism only, got "
                  "parallel.zero: %d (ZeRO shards and gathers fp32 master weights); set parallel.zero: 0 or "
                  "precision.master: fp32", cfg_where_of(L, "precision.master", "parallel.zero"), c->zero);
}

/* Monitoring keys whose valid values the table's ranges cannot say. */
/* metrics.mlflow: a directory, or http(s)://HOST[:PORT][/PATH] with no
 * user or password in it (those come from the environment, so that no
 * secret reaches the resolved config). Unset, an http(s) MLFLOW_TRACKING_URI
 * is taken (MLflow's clients read it); any other form of that variable
 * (file:, databricks) is left to Python's tools: a directory store is asked
 * for in the config. "" set explicitly is off. */
static void cfg_check_mlflow(Config *c, CfgLoad *L) {
    const char *env = getenv("MLFLOW_TRACKING_URI");
    int i = cfg_find("metrics.mlflow");
    if (!strcmp(L->where[i], "default") && env && (!strncmp(env, "http://", 7) || !strncmp(env, "https://", 8))) {
        if (kiln_strlcpy(c->mlflow, env, sizeof c->mlflow) != 0)
            kiln_fail(KILN_EXIT_USAGE, "environment MLFLOW_TRACKING_URI: longer than %zu bytes", sizeof c->mlflow - 1);
        kiln_strlcpy(L->where[i], "environment MLFLOW_TRACKING_URI", sizeof L->where[i]);
    }
    const char *u = c->mlflow, *w = cfg_where_of(L, "metrics.mlflow", NULL);
    const char *colon = strstr(u, "://");
    if (!colon && (!strncmp(u, "http:", 5) || !strncmp(u, "https:", 6)))
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'metrics.mlflow': '%s' is not a tracking server URL; expected "
                  "http://HOST:PORT or https://HOST[:PORT][/PATH], or a directory", w, u);
    if (!colon) return; /* a directory: the file store */
    size_t sl = (size_t)(colon - u);
    const char *h = colon + 3;
    size_t hl = strcspn(h, "/?#");
    const char *at = memchr(h, '@', hl);
    if (at)
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'metrics.mlflow': a user or password in the URL would be written to the "
                  "run's config; give the server as %.*s://%.*s and set MLFLOW_TRACKING_USERNAME and "
                  "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)", w, (int)sl, u, (int)(hl - (size_t)(at + 1 - h)), at + 1);
    if (!((sl == 4 && !strncmp(u, "http", 4)) || (sl == 5 && !strncmp(u, "https", 5))))
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'metrics.mlflow': unknown scheme '%.*s://' in '%s'; expected http://HOST:PORT, "
                  "https://HOST[:PORT] or a directory (the file store)", w, (int)sl, u, u);
    const char *port = NULL;
    size_t name = hl;
    if (h[0] == '[') { /* [IPv6]:port */
        const char *rb = memchr(h, ']', hl);
        name = rb ? (size_t)(rb + 1 - h) : 0;
        if (rb && rb + 1 < h + hl && rb[1] == ':') port = rb + 2;
        else if (rb && rb + 1 < h + hl) name = 0;
    } else {
        const char *pc = memchr(h, ':', hl);
        if (pc) name = (size_t)(pc - h), port = pc + 1;
    }
    int bad = name == 0 || h[strcspn(h, " \t\r\n\"\\")] != 0;
    for (size_t k = 0; !bad && h[0] != '[' && k < name; k++)
        bad = !(isalnum((unsigned char)h[k]) || h[k] == '-' || h[k] == '.' || h[k] == '_');
    if (!bad && port) {
        size_t pl = (size_t)(h + hl - port);
        long pv = 0;
        for (size_t k = 0; k < pl && !bad; k++) bad = !isdigit((unsigned char)port[k]) || (pv = pv * 10 + (port[k] - '0')) > 65535;
        bad = bad || pl == 0 || pv == 0;
    }
    if (bad || h[hl] == '?' || h[hl] == '#')
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'metrics.mlflow': '%s' is not a tracking server URL; expected "
                  "http://HOST:PORT or https://HOST[:PORT][/PATH] (port 1-65535, no query), or a directory", w, u);
#ifndef KILN_CURL
    kiln_fail(KILN_EXIT_USAGE, "%s: key 'metrics.mlflow': '%s' is a tracking server, and this ./train was built "
              "without libcurl; install libcurl4-openssl-dev (make deps) and rebuild, or give a directory (the file "
              "store)", w, u);
#endif
}

static void cfg_check_monitor(Config *c, CfgLoad *L) {
    cfg_check_mlflow(c, L);
    if (c->straggler_factor > 0 && c->straggler_factor <= 1)
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'monitor.straggler_factor': expected 0 (off) or a factor > 1, got %g "
                  "(every rank is at least as slow as the median times %g)",
                  cfg_where_of(L, "monitor.straggler_factor", NULL), c->straggler_factor, c->straggler_factor);
    if (c->mlflow[0] && !c->mlflow_experiment[0])
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'metrics.mlflow_experiment': expected an experiment name, got \"\"",
                  cfg_where_of(L, "metrics.mlflow_experiment", "metrics.mlflow"));
}

static void cfg_check_batch(Config *c, CfgLoad *L) {
    int64_t per = (int64_t)c->micro_batch * c->seq_len;
    if (c->total_tokens % per)
        kiln_fail(KILN_EXIT_USAGE,
                  "%s: key 'batch.total_tokens': must be a multiple of micro_batch*seq_len = %lld "
                  "(batch.micro_batch %d x model.seq_len %d), got %lld; nearest: %lld",
                  cfg_where_of(L, "batch.total_tokens", "batch.micro_batch"), (long long)per, c->micro_batch,
                  c->seq_len, (long long)c->total_tokens,
                  (long long)(c->total_tokens < per ? per : c->total_tokens / per * per));
    if (c->total_tokens / per > INT_MAX)
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'batch.total_tokens': %lld steps of gradient accumulation is too many",
                  cfg_where_of(L, "batch.total_tokens", NULL), (long long)(c->total_tokens / per));
    c->grad_accum = (int)(c->total_tokens / per);
}

/* The checks across keys that a layout decides (cfg_finish and
 * cfg_check_layout both run them): the architecture, MoE and ep, the batch's
 * split (deriving grad_accum), the parallel degrees, precision, the optimizer. */
static void cfg_check_cross(Config *c, CfgLoad *L) {
    ArchSpec spec;
    arch_from_config(c, &spec); /* every architecture constraint, naming the key */
    cfg_check_moe(c, &spec, L);
    cfg_check_ep(c, &spec, L);
    if (c->loss_chunk != 0 && c->fp8_head && strcmp(c->fp8, "off"))
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'model.loss_chunk': a chunked head with precision.fp8_head scales each "
                  "chunk's product by itself, not the whole logits; turn one of them off",
                  cfg_where_of(L, "model.loss_chunk", NULL));
    if (c->recompute_every > 1 && strcmp(c->recompute, "block"))
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'model.recompute_every': %d checkpoints every k-th layer, which only "
                  "model.recompute: block does (it is %s)", cfg_where_of(L, "model.recompute_every", NULL),
                  c->recompute_every, c->recompute);
    cfg_check_batch(c, L);
    cfg_check_parallel(c, L);
    cfg_check_precision(c, L);
    cfg_check_pp_precision(c, &spec, L);
    cfg_check_optim(c, L);
}

static void cfg_finish(Config *c, CfgLoad *L) {
    if (!c->head_dim && c->n_embd % c->n_head)
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'model.n_embd': %d must be divisible by model.n_head = %d",
                  cfg_where_of(L, "model.n_embd", "model.n_head"), c->n_embd, c->n_head);
    int64_t padded = ((int64_t)c->vocab_size + 63) / 64 * 64;
    if (padded > INT_MAX)
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'model.vocab_size': %d padded to a multiple of 64 overflows 32 bits",
                  cfg_where_of(L, "model.vocab_size", NULL), c->vocab_size);
    c->padded_vocab = (int)padded;
    if (c->train.n == 0)
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'data.train': expected a glob of token shards or a list of sources, got \"\"",
                  cfg_where_of(L, "data.train", NULL));
    if (!strcmp(c->tokenizer, "gpt2") && !c->tokenizer_file[0])
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'data.tokenizer_file': expected a rank file path when data.tokenizer is gpt2, got \"\"",
                  cfg_where_of(L, "data.tokenizer_file", "data.tokenizer"));
    if (c->eot_id >= c->vocab_size)
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'data.eot_id': %d is not an id of the vocabulary (model.vocab_size = %d)",
                  cfg_where_of(L, "data.eot_id", NULL), c->eot_id, c->vocab_size);
    if ((c->doc_masking || !strcmp(c->doc_positions, "reset")) && c->eot_id < 0 && !strcmp(c->tokenizer, "byte"))
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'data.eot_id': documents (data.doc_masking / data.doc_positions) need an "
                  "end-of-text id and the byte tokenizer has none; set data.eot_id (e.g. 10: one document per line)",
                  cfg_where_of(L, "data.eot_id", c->doc_masking ? "data.doc_masking" : "data.doc_positions"));
    cfg_check_cross(c, L);
    cfg_check_monitor(c, L);
    if (!c->run_dir[0]) {
        char dir[CFG_STR + 8];
        snprintf(dir, sizeof dir, "runs/%s", c->run_name);
        if (strlen(dir) >= sizeof c->run_dir)
            kiln_fail(KILN_EXIT_USAGE, "%s: key 'run.name': too long to make runs/<run.name> (at most %zu bytes)",
                      cfg_where_of(L, "run.name", NULL), sizeof c->run_dir - 6);
        memset(c->run_dir, 0, sizeof c->run_dir);
        memcpy(c->run_dir, dir, strlen(dir));
    }
    size_t len;
    char *text = cfg_yaml_text(c, &len);
    c->hash = kiln_fnv1a(text, len, KILN_FNV_INIT);
    free(text);
}

/* ---------- public ---------- */

int cfg_check_layout(Config *c, char *err, size_t errn) {
    CfgLoad *L = xcalloc(1, sizeof *L);
    L->file = "plan";
    for (int i = 0; i < NKEYS; i++) kiln_strlcpy(L->where[i], "layout", sizeof L->where[i]);
    KilnTrap t;
    int rc = 0;
    kiln_trap_push(&t);
    if (setjmp(t.jb) == 0) {
        cfg_check_cross(c, L);
    } else {
        rc = -1;
        snprintf(err, errn, "%s", t.msg);
    }
    kiln_trap_pop(&t);
    free(L);
    return rc;
}

char *cfg_yaml_text(const Config *c, size_t *len) {
    char *text = NULL;
    size_t n = 0;
    FILE *m = open_memstream(&text, &n);
    if (!m) kiln_fail(KILN_EXIT_RUNTIME, "open_memstream: %s", strerror(errno));
    cfg_write_yaml(c, m);
    fclose(m);
    if (len) *len = n;
    return text;
}

void cfg_defaults(Config *c) {
    /* whole struct zeroed once, so two equal configs are equal byte for byte */
    memset(c, 0, sizeof *c);
    for (int i = 0; i < NKEYS; i++) {
        yaml_document_t doc;
        cfg_parse_text(cfg_keys[i].def, strlen(cfg_keys[i].def), "default", 0, &doc);
        cfg_apply(c, &cfg_keys[i], NULL, "default", &doc, yaml_document_get_root_node(&doc));
        yaml_document_delete(&doc);
    }
    c->padded_vocab = (c->vocab_size + 63) / 64 * 64;
    c->grad_accum = (int)(c->total_tokens / ((int64_t)c->micro_batch * c->seq_len));
}

void cfg_load(Config *c, const char *path, const char *const *sets, int nsets) {
    CfgLoad *L = xcalloc(1, sizeof *L);
    L->file = path;
    for (int i = 0; i < NKEYS; i++) kiln_strlcpy(L->where[i], "default", sizeof L->where[i]);
    cfg_defaults(c);
    if (path) cfg_load_file(c, L, path);
    for (int i = 0; i < nsets; i++) cfg_apply_set(c, L, sets[i]);
    cfg_finish(c, L);
    free(L);
}

/* ---------- writing ---------- */

/* Shortest decimal that reads back (through strtod, as the parser does) as the same float. */
static void cfg_fmt_float(float v, char *buf, size_t cap) {
    for (int p = 1; p <= 9; p++) {
        snprintf(buf, cap, "%.*g", p, (double)v);
        if ((float)strtod(buf, NULL) == v) return;
    }
}

/* YAML double-quoted string: the escapes libyaml reads back exactly. */
static void cfg_write_quoted(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\') fprintf(f, "\\%c", ch);
        else if (ch == '\n') fputs("\\n", f);
        else if (ch == '\t') fputs("\\t", f);
        else if (ch < 0x20 || ch == 0x7f) fprintf(f, "\\x%02x", ch);
        else fputc(ch, f);
    }
    fputc('"', f);
}

/* Shortest decimal that reads back as the same double. */
static void cfg_fmt_double(double v, char *buf, size_t cap) {
    for (int p = 1; p <= 17; p++) {
        snprintf(buf, cap, "%.*g", p, v);
        if (strtod(buf, NULL) == v) return;
    }
}

/* A list-form data.train / data.val on one line (the resume check reads the
 * resolved YAML a line per key), names filled in. */
static void cfg_write_sources(FILE *f, const CfgKey *k, const CfgSources *ss) {
    fputc('[', f);
    for (int i = 0; i < ss->n; i++) {
        fputs(i ? ", {name: " : "{name: ", f);
        cfg_write_quoted(f, ss->s[i].name);
        fputs(", path: ", f);
        cfg_write_quoted(f, ss->s[i].path);
        if (k->flags & CF_WEIGHTS) {
            char w[32];
            cfg_fmt_double(ss->s[i].weight, w, sizeof w);
            fprintf(f, ", weight: %s", w);
        }
        fputc('}', f);
    }
    fputc(']', f);
}

static void cfg_write_value(FILE *f, const CfgKey *k, const Config *c) {
    const char *p = (const char *)c + k->off;
    char a[32], b[32];
    switch (k->type) {
    case CT_INT:
        if ((k->flags & CF_AUTO) && *(const int *)p == cfg_auto_value(k)) fputs("auto", f);
        else fprintf(f, "%d", *(const int *)p);
        break;
    case CT_INT64: fprintf(f, "%lld", (long long)*(const int64_t *)p); break;
    case CT_U64: fprintf(f, "%llu", (unsigned long long)*(const uint64_t *)p); break;
    case CT_FLOAT: cfg_fmt_float(*(const float *)p, a, sizeof a), fputs(a, f); break;
    case CT_BOOL: fputs(*(const int *)p ? "true" : "false", f); break;
    case CT_STR: cfg_write_quoted(f, p); break;
    case CT_ENUM: fputs(p, f); break; /* choices are plain identifiers */
    case CT_PAIR:
        cfg_fmt_float(*(const float *)p, a, sizeof a);
        cfg_fmt_float(*(const float *)((const char *)c + k->off2), b, sizeof b);
        fprintf(f, "[%s, %s]", a, b);
        break;
    case CT_SOURCES: {
        const CfgSources *ss = (const CfgSources *)((const char *)c + k->off2);
        if (ss->list) cfg_write_sources(f, k, ss);
        else cfg_write_quoted(f, p);
        break;
    }
    case CT_INTS: {
        int n = *(const int *)((const char *)c + k->off2);
        fputc('[', f);
        for (int i = 0; i < n; i++) fprintf(f, "%s%d", i ? ", " : "", ((const int *)p)[i]);
        fputc(']', f);
        break;
    }
    }
}

static void cfg_write_derived(FILE *f, const Config *c, const char *section, size_t slen) {
    for (int d = 0; d < NDERIVED; d++)
        if (cfg_section_len(cfg_derived[d].key) == slen && !strncmp(cfg_derived[d].key, section, slen))
            fprintf(f, "  # %s: %d (derived)\n", cfg_last(cfg_derived[d].key),
                    *(const int *)((const char *)c + cfg_derived[d].off));
}

/* Leading whole sections two dotted keys share ("model.moe.top_k" and
 * "model.moe.router": 2; "model.n_head": 1 with either). */
static int cfg_common_sections(const char *a, const char *b) {
    int n = 0;
    for (size_t i = 0; a[i] && a[i] == b[i]; i++)
        if (a[i] == '.') n++;
    return n;
}

void cfg_write_yaml(const Config *c, FILE *f) {
    fputs("# kiln resolved config: every key, defaults filled in; derived values are comments\n", f);
    for (int i = 0; i < NKEYS; i++) {
        const char *key = cfg_keys[i].key;
        size_t slen = cfg_section_len(key);
        /* open the sections this key enters (nested maps for model.moe.*) */
        int depth = 0;
        for (const char *p = key; *p; p++) depth += *p == '.';
        int from = i == 0 ? 0 : cfg_common_sections(cfg_keys[i - 1].key, key);
        const char *part = key;
        for (int d = 0; d < depth; d++) {
            const char *dot = strchr(part, '.');
            if (d >= from) fprintf(f, "%*s%.*s:\n", 2 * d, "", (int)(dot - part), part);
            part = dot + 1;
        }
        fprintf(f, "%*s%s: ", 2 * depth, "", cfg_last(key));
        cfg_write_value(f, &cfg_keys[i], c);
        fputc('\n', f);
        int last = i + 1 == NKEYS || cfg_section_len(cfg_keys[i + 1].key) != slen ||
                   strncmp(cfg_keys[i + 1].key, key, slen);
        if (depth && last) cfg_write_derived(f, c, key, slen);
    }
}

static const char *cfg_type_name(const CfgKey *k) {
    static const char *names[] = {"int", "int64", "uint64", "float", "bool", "string", "enum", "float pair",
                                  "glob or list", "int list"};
    return (k->flags & CF_AUTO) ? "int or `auto`" : names[k->type];
}

static void cfg_doc_row(FILE *f, const CfgKey *k) {
    char r[256] = "";
    if (k->type == CT_ENUM) { /* `a`, `b`, `c` */
        size_t n = 0;
        for (const char *ch = k->choices; *ch && n + 8 < sizeof r; ch++) {
            if (ch == k->choices || ch[-1] == '|') r[n++] = '`';
            if (*ch == '|') { n += (size_t)snprintf(r + n, sizeof r - n, "`, "); continue; }
            r[n++] = *ch;
            if (!ch[1]) r[n++] = '`';
            r[n] = 0;
        }
    } else if (k->type == CT_U64) {
        snprintf(r, sizeof r, "any");
    } else {
        cfg_range_text(k, 1, r, sizeof r);
        if (k->type == CT_PAIR || k->type == CT_INTS) memmove(r + 5, r, strlen(r) + 1), memcpy(r, "each ", 5);
    }
    fprintf(f, "| `%s` | %s | `%s` | %s | %s |\n", k->key, cfg_type_name(k), k->def, r, k->doc);
}

void cfg_write_doc(FILE *f) {
    fputs("# Config reference\n\n"
          "<!-- Generated from the key table in src/config.c by cfg_write_doc(); do not edit by hand.\n"
          "     Regenerate with: ./train config-doc > docs/config.md -->\n\n"
          "`./train CONFIG.yaml` reads a YAML file of the sections below. Every key is optional\n"
          "and falls back to its default; an unknown key, a wrong type or a value out of range\n"
          "stops the run with exit code 2, naming the file, line and key.\n\n"
          "Any key can be overridden on the command line with `--set key.path=value`, repeated as\n"
          "needed; the value is read as YAML, e.g. `--set optim.lr=3e-4`, `--set device=cpu`,\n"
          "`--set optim.betas=[0.9,0.999]`. The resolved config, every default filled in, is saved\n"
          "as `config.yaml` in the run directory, and its FNV-1a hash identifies the run.\n\n"
          "Bools are `true`/`false`/`yes`/`no`. A quoted value is a string, so `lr: \"1e-3\"` is an\n"
          "error. Intervals and limits set to 0 are off.\n",
          f);
    for (int i = 0; i < NKEYS; i++) {
        const char *key = cfg_keys[i].key;
        size_t slen = cfg_section_len(key);
        if (i == 0 || cfg_section_len(cfg_keys[i - 1].key) != slen || strncmp(cfg_keys[i - 1].key, key, slen))
            fprintf(f, "\n## %.*s\n\n| key | type | default | range / choices | meaning |\n"
                       "| --- | --- | --- | --- | --- |\n", (int)slen, key);
        cfg_doc_row(f, &cfg_keys[i]);
    }
    fputs("\n## derived\n\nComputed after loading, written as comments in the resolved `config.yaml`.\n\n"
          "| value | meaning |\n| --- | --- |\n", f);
    for (int d = 0; d < NDERIVED; d++) fprintf(f, "| `%s` | %s |\n", cfg_derived[d].key, cfg_derived[d].doc);
}

/* ---------- reading the resolved YAML back ---------- */

/* A double-quoted scalar as cfg_write_quoted writes it, unescaped into out. */
static void cfg_unquote(const char *s, char *out, size_t cap) {
    size_t n = 0, len = strlen(s);
    if (len < 2 || s[0] != '"' || s[len - 1] != '"') {
        kiln_strlcpy(out, s, cap);
        return;
    }
    for (size_t i = 1; i + 1 < len && n + 1 < cap; i++) {
        char ch = s[i];
        if (ch == '\\' && i + 2 < len) {
            ch = s[++i];
            if (ch == 'n') ch = '\n';
            else if (ch == 't') ch = '\t';
            else if (ch == 'x' && i + 2 < len) {
                unsigned v = 0;
                sscanf(s + i + 1, "%2x", &v);
                ch = (char)v, i += 2;
            }
        }
        out[n++] = ch;
    }
    out[n] = 0;
}

int cfg_flatten_yaml(const char *text, void (*fn)(const char *key, const char *value, void *ctx), void *ctx) {
    char path[8][128]; /* the open sections, by depth (two spaces a level) */
    int count = 0;
    for (const char *l = text; l && *l;) {
        const char *nl = strchr(l, '\n');
        size_t len = nl ? (size_t)(nl - l) : strlen(l);
        char line[CFG_STR * 4 + 256];
        snprintf(line, sizeof line, "%.*s", (int)(len < sizeof line - 1 ? len : sizeof line - 1), l);
        l = nl ? nl + 1 : NULL;
        size_t indent = strspn(line, " ");
        char *s = line + indent, *colon = strstr(s, ":");
        int depth = (int)(indent / 2);
        if (!*s || *s == '#' || !colon || depth >= 8) continue;
        *colon = 0;
        char *val = colon[1] == ' ' ? colon + 2 : colon + 1;
        if (!*val) { /* "section:" opens a level */
            kiln_strlcpy(path[depth], s, sizeof path[depth]);
            for (int d = depth + 1; d < 8; d++) path[d][0] = 0;
            continue;
        }
        char key[1200] = "", value[CFG_STR * 4];
        size_t o = 0;
        for (int d = 0; d < depth; d++) o += (size_t)snprintf(key + o, sizeof key - o, "%s.", path[d]);
        snprintf(key + o, sizeof key - o, "%s", s);
        cfg_unquote(val, value, sizeof value);
        fn(key, value, ctx);
        count++;
    }
    return count;
}
