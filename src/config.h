/* config: YAML (libyaml) -> a typed, validated Config. Every key has a type, a
 * default, a valid range and a line of documentation in one table (config.c);
 * the parser, --set overrides, the resolved-config writer and docs/config.md
 * are all driven by that table. Never does I/O other than reading the config. */
#ifndef KILN_CONFIG_H
#define KILN_CONFIG_H

#include <stdint.h>
#include <stdio.h>

#define CFG_STR 512
#define CFG_NAME 64
#define CFG_MAX_SOURCES 16
#define CFG_MAX_INTS 256 /* entries of an int list (parallel.pp_layers: one per virtual stage) */
/* Bounds checked before libyaml sees a config (a file, or one --set value):
 * its scanner is quadratic in nesting (200,000 '[' took a minute), and no key
 * of kiln's nests more than a few levels. */
#define CFG_MAX_BYTES ((size_t)1 << 20)
#define CFG_MAX_DEPTH 32

/* One entry of data.train (a mixture source) or data.val (a named set). */
typedef struct CfgSource {
    char name[CFG_NAME]; /* metrics name, [A-Za-z0-9_.-]; derived from the glob when not given */
    char path[CFG_STR];  /* glob of token shards */
    double weight;       /* data.train: share of samples before normalising (1 when not given); data.val: 1 */
} CfgSource;

typedef struct CfgSources {
    int n;    /* entries; 0 = none (data.val: "") */
    int list; /* 1: written as a list; 0: one plain glob string (the original form) */
    CfgSource s[CFG_MAX_SOURCES];
} CfgSources;

typedef struct Config {
    /* run */
    char run_name[CFG_STR];
    char run_dir[CFG_STR]; /* default: runs/<run.name> */
    uint64_t seed;
    int threads; /* run.threads: CPU threads, 0 = all cores */

    char device[16]; /* auto | cpu | cuda */

    /* model */
    char arch[16]; /* gpt2 | llama: the preset the auto keys follow (arch.h) */
    int n_layer, n_head, n_embd, seq_len, vocab_size;
    int n_kv_head, head_dim, ffn_hidden; /* 0 = auto */
    char norm[16], pos[16], mlp[16], qk_norm[8], bias[8], tie_embeddings[8]; /* auto | ... */
    float norm_eps, rope_theta;
    float rope_factor, rope_low, rope_high; /* model.rope_scaling: factor 0 = off */
    int rope_orig;
    int moe_experts, moe_top_k, moe_shared, moe_hidden; /* model.moe */
    char moe_router[8], moe_norm_topk[8];
    float moe_capacity, moe_aux, moe_z, moe_bias_rate;
    int padded_vocab; /* derived: vocab_size rounded up to a multiple of 64 */
    char recompute[16]; /* none | gelu | norm_gelu | block: what the backward recomputes (model.h) */
    int recompute_every; /* block: every k-th layer is checkpointed */
    int loss_chunk;      /* rows per chunk of the head and its loss; 0: whole, -1: auto (model_loss_rows) */

    /* data */
    char train_glob[CFG_STR]; /* data.train as a plain glob; "" when it is a list */
    char val_glob[CFG_STR];   /* data.val as a plain glob; "" when it is a list or off */
    CfgSources train, val;    /* either form, names and weights resolved */
    int prefetch;             /* data.prefetch: batches read ahead by a thread; 0 = off */
    int max_open_shards;      /* data.max_open_shards: open shards per loader */
    char tokenizer[16];            /* byte | gpt2 */
    char tokenizer_file[CFG_STR];  /* gpt2: tiktoken-format rank file */
    int doc_masking;          /* data.doc_masking: attention stops at document boundaries */
    char doc_positions[16];   /* data.doc_positions: continue | reset (per document) */
    int eot_id;               /* data.eot_id: the id that ends a document; -1 = the tokenizer's */

    /* batch */
    int micro_batch;
    int64_t total_tokens; /* tokens per optimizer step, all ranks */
    int grad_accum;       /* derived: total_tokens / (micro_batch * seq_len) */

    /* train */
    int steps;
    int eval_every, eval_batches;
    int sample_every, sample_tokens, sample_top_k;
    float sample_temperature;
    char on_nonfinite[8]; /* skip | stop: what a non-finite loss or gradient does */
    int max_consecutive_skips; /* skip: stop after this many in a row; 0 = never */

    /* optim */
    char optim_name[16]; /* adamw | lion | muon | adafactor */
    float lr, beta1, beta2, eps, weight_decay, grad_clip;
    float lion_beta1, lion_beta2; /* optim.lion_betas: Lion's interpolation and momentum betas */
    float momentum;       /* optim.momentum: Muon's Nesterov momentum */
    int ns_steps;         /* optim.ns_steps: Muon's Newton-Schulz iterations */
    char muon_scale[16];  /* optim.muon_scale: spectral | match_adamw */
    int muon_split_qkv;   /* optim.muon_split_qkv: a fused q|k|v orthogonalised per third */
    float adafactor_decay, adafactor_clip, adafactor_eps, adafactor_beta1; /* optim.adafactor_* */
    int decay_embeddings; /* bool */

    /* schedule */
    char sched_kind[16]; /* cosine | linear | constant | wsd */
    int warmup_steps;
    float min_lr_ratio;
    float decay_ratio; /* wsd: fraction of steps spent in the final decay */

    /* parallel: dp, ZeRO 0-3, tp, cp, pp and ep are implemented */
    int dp; /* 0 = auto */
    int zero, tp, pp, cp, ep;
    char pp_schedule[24]; /* gpipe | 1f1b | interleaved_1f1b | zb_h1 */
    int pp_virtual;       /* chunks per pipeline rank (interleaved_1f1b) */
    int pp_layers[CFG_MAX_INTS], n_pp_layers; /* layers per virtual stage; 0 entries = balanced */
    char sequence_parallel[8]; /* auto | true | false: auto is on when tp > 1 */
    char cp_attention[12]; /* allgather | ring: how cp > 1 exchanges K and V */
    char layout[8];        /* fixed | auto: who picks the degrees (scripts/train.sbatch with plan --auto-sets) */
    float timeout_s; /* parallel.timeout_s: deadline of every collective */

    /* precision */
    char compute[8]; /* bf16 | fp32: the GPU's activation dtype (the CPU backend is always fp32) */
    char attention[16]; /* auto | cudnn | tensor_cores | simt: attention kernels with bf16 compute on GPU */
    int attention_deterministic; /* bool: false lets cuDNN's attention backward sum dQ with atomics */
    char gelu_fusion[8]; /* auto | off: the fc product and its GeLU as one fused op where the backend has one */
    char master[8];  /* fp32 | bf16: parameters' dtype (bf16: no fp32 master; needs compute bf16, zero 0) */
    char optim_state[8]; /* fp32 | bf16: dtype of AdamW's m and v (bf16: stochastically rounded) */
    char fp8[12];        /* off | tensorwise | rowwise: the block's linear layers in fp8 (docs/precision.md) */
    char fp8_grad[8];    /* e5m2 | e4m3: format of the output gradients in the backward */
    char fp8_wgrad[8];   /* bf16 | fp8: the weight-gradient product's operands */
    int fp8_amax_history; /* 0 = current scaling; N: scale from the max of the last N amaxes */
    int fp8_pow2_scales; /* bool: scales rounded down to a power of two */
    int fp8_head;        /* bool: the output head in fp8 too */

    /* checkpoint */
    int ckpt_every, ckpt_keep_last, ckpt_keep_every; /* 0 = off / keep all / none */
    int ckpt_async, ckpt_final;                      /* bools */
    int ckpt_compress;                               /* zstd level, 0 = off */
    int ckpt_direct_io;                              /* bool: O_DIRECT for checkpoint files */
    float ckpt_before_limit;                         /* seconds before the Slurm end time; 0 = off */
    char ckpt_dir[CFG_STR];                          /* "" = <run.dir>/checkpoints */

    /* metrics */
    int log_every;
    int tensorboard;   /* bool: events.out.tfevents.* in the run directory */
    float peak_gflops; /* peak FLOP/s of one device for MFU, in GFLOP/s; 0 = table or measured */
    char progress[8];  /* auto | bar | lines: the live bar or plain lines on stdout */
    char mlflow[CFG_STR];            /* MLflow file store directory or http(s) tracking server; "" = off */
    char mlflow_experiment[CFG_STR]; /* experiment the run is filed under */
    float mlflow_flush_s;            /* tracking server: seconds the end waits for unsent points */
    int mlflow_required;             /* bool: a server that refuses stops the run (else: no tracking) */

    /* monitor */
    int heartbeat;        /* bool: heartbeat/rank*.json every step */
    float stall_timeout_s; /* watchdog: exit 1 after this long without progress; 0 = off */
    float spike_factor;   /* warn when loss > spike_factor x its running mean; 0 = off */
    int flight_records;   /* flight recorder ring per rank (flight.h); 0 = off */
    int check_collectives; /* bool: agree on every collective before it runs (comm.h) */
    char prometheus_file[CFG_STR]; /* node-exporter textfile written by rank 0; "" = off */
    int prometheus_every;          /* steps between rewrites */
    float straggler_factor; /* warn when a rank is this many times slower than the others' median; 0 = off */
    int straggler_steps;    /* ... for this many logged steps in a row */

    /* init */
    char init_from[CFG_STR]; /* llm.c file, kiln checkpoint or HF directory to start from, "" = random */

    uint64_t hash; /* FNV-1a of the resolved YAML text */
} Config;

/* Fill every key with its default. */
void cfg_defaults(Config *c);

/* Load `path` (NULL: defaults only) then apply `nsets` overrides of the form
 * "key.path=value" (value read as YAML), validate ranges and derive the rest.
 * Every error exits 2 with the file, line, key, what was expected and, for an
 * unknown key, the closest known key. */
void cfg_load(Config *c, const char *path, const char *const *sets, int nsets);

/* The cross-key checks cfg_load runs after parsing (MoE and ep, the batch's
 * split, the parallel degrees, precision, the optimizer), on a loaded config
 * whose layout keys (parallel.*, batch.micro_batch, model.recompute) were
 * changed in the struct; derives batch.grad_accum again. Returns 0, or -1
 * with cfg_load's line in err ("layout: key ..."). Never exits: ./train plan
 * --search asks it of every layout it considers. */
int cfg_check_layout(Config *c, char *err, size_t errn);

/* Write the fully resolved config (every key, defaults filled) as YAML. */
void cfg_write_yaml(const Config *c, FILE *f);
/* The same YAML as a malloc'd, NUL-terminated string (*len its length): the
 * text the hash, the run directory's config.yaml and checkpoints all use. */
char *cfg_yaml_text(const Config *c, size_t *len);

/* Call fn(key, value) for every key of a resolved YAML text (cfg_write_yaml's,
 * from this or an earlier version): dotted key paths ("model.moe.top_k"),
 * strings unquoted, other values as written ("[0.9, 0.95]", "auto").
 * Returns how many keys it found. */
int cfg_flatten_yaml(const char *text, void (*fn)(const char *key, const char *value, void *ctx), void *ctx);
/* The name a data source gets when the config gives none, from its glob:
 * the last directory and the file name's part before the first wildcard
 * (data/web/ + *.bin -> "web", data/austen/ + train_*.bin -> "austen_train"),
 * characters other than [A-Za-z0-9_.-] as '_'. */
void cfg_source_name(const char *glob, char *buf, size_t cap);

/* Write the markdown reference of every key (docs/config.md is this output). */
void cfg_write_doc(FILE *f);

#endif
