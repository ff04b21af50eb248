/* hf: kiln <-> HuggingFace (GPT2LMHeadModel, LlamaForCausalLM,
 * OlmoeForCausalLM): one name table, one writer, one loader. Refuses
 * what HF cannot compute exactly (shared experts, sigmoid routers, capacity)
 * rather than export a model that would mean something else. */
#include "hf.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt.h"
#include "config.h"
#include "json.h"
#include "llmc.h"
#include "util.h"

#define HF_WHY(...) (snprintf(why, cap, __VA_ARGS__), (const char *)NULL)

const char *hf_model_type(const ArchSpec *s, char *why, size_t cap) {
    if (s->family == ARCH_GPT2) {
        if (s->norm != NORM_LAYERNORM || s->pos != POS_LEARNED || s->mlp != MLP_GELU || !s->bias ||
            s->qk_norm != QKNORM_NONE || s->n_kv_head != s->n_head || s->n_head * s->head_dim != s->n_embd)
            return HF_WHY("GPT2LMHeadModel needs layernorm, learned positions, the GeLU MLP, biases, no QK-norm, "
                          "n_kv_head = n_head and head_dim = n_embd / n_head");
        return "gpt2";
    }
    if (s->norm != NORM_RMSNORM || s->pos != POS_ROPE)
        return HF_WHY("Llama and OLMoE need model.norm rmsnorm and model.pos rope");
    if (s->mlp == MLP_SWIGLU) {
        if (s->qk_norm != QKNORM_NONE) return HF_WHY("LlamaForCausalLM has no QK-norm (model.qk_norm must be none)");
        return "llama";
    }
    if (s->mlp != MLP_MOE) return HF_WHY("the llama family's GeLU MLP has no HF counterpart");
    const ArchMoe *m = &s->moe;
    if (m->n_shared > 0)
        return HF_WHY("model.moe.n_shared %d: OLMoE has no shared experts, and Qwen2-MoE's gated shared expert "
                      "computes something else", m->n_shared);
    if (m->sigmoid || m->capacity_factor > 0 || m->bias_update_rate > 0)
        return HF_WHY("OLMoE routes by softmax, dropless, without a balancing bias (model.moe.router softmax, "
                      "capacity_factor 0, bias_update_rate 0)");
    if (s->qk_norm != QKNORM_FULL || s->n_head * s->head_dim != s->n_embd)
        return HF_WHY("OLMoE needs model.qk_norm full and head_dim = n_embd / n_head");
    return "olmoe";
}

void hf_tensor_name(const ArchSpec *s, const char *kiln_name, int role, char *out, size_t cap, int *transpose) {
    *transpose = 0;
    if (role == ROLE_HEAD_W) {
        snprintf(out, cap, "lm_head.weight");
    } else if (s->family == ARCH_GPT2) {
        if (role == ROLE_TOK_EMB) snprintf(out, cap, "transformer.wte.weight");
        else if (role == ROLE_POS_EMB) snprintf(out, cap, "transformer.wpe.weight");
        else snprintf(out, cap, "transformer.%s", kiln_name);
        /* Conv1D stores (in, out): kiln's (out, in) nn.Linear layout transposed */
        *transpose = role == ROLE_QKV_W || role == ROLE_O_W || role == ROLE_FC_W || role == ROLE_DOWN_W;
    } else {
        snprintf(out, cap, "model.%s", kiln_name);
    }
}

/* HF's shape of a kiln tensor: the real vocabulary's rows, transposed where HF is. */
static void hf_shape(const ArchSpec *s, int role, int ndim, const int *shape, int transpose, int64_t *out) {
    out[0] = shape[0], out[1] = ndim == 2 ? shape[1] : 0;
    if (role == ROLE_TOK_EMB || role == ROLE_HEAD_W) out[0] = s->vocab_size;
    if (transpose) {
        int64_t x = out[0];
        out[0] = out[1], out[1] = x;
    }
}

/* ---------------------------------------------------------------- config.json */

static void json_bool(FILE *f, const char *k, int v) { fprintf(f, "  \"%s\": %s,\n", k, v ? "true" : "false"); }
static void json_int(FILE *f, const char *k, long long v) { fprintf(f, "  \"%s\": %lld,\n", k, v); }
/* The shortest decimal that reads back as the same float (1e-05, not 9.99999975e-06). */
static void json_num(FILE *f, const char *k, double v) {
    char buf[32];
    for (int p = 1; p <= 9; p++) {
        snprintf(buf, sizeof buf, "%.*g", p, v);
        if ((float)strtod(buf, NULL) == (float)v) break;
    }
    fprintf(f, "  \"%s\": %s,\n", k, buf);
}

static void write_rope(FILE *f, const ArchSpec *s) {
    const ArchRopeScaling *r = &s->rope_scaling;
    json_num(f, "rope_theta", s->rope_theta);
    if (r->on)
        fprintf(f, "  \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": %.9g, \"low_freq_factor\": %.9g, "
                   "\"high_freq_factor\": %.9g, \"original_max_position_embeddings\": %d},\n",
                r->factor, r->low_freq_factor, r->high_freq_factor, r->original_context);
    else fprintf(f, "  \"rope_scaling\": null,\n");
    /* the newer transformers key (rope_theta moved under it); 4.46 keeps it as an unused attribute */
    fprintf(f, "  \"rope_parameters\": {\"rope_type\": \"%s\", \"rope_theta\": %.9g},\n", r->on ? "llama3" : "default",
            s->rope_theta);
}

/* End-of-text token where kiln's tokenizer defines one: GPT-2's BPE (50257 ids). */
static int hf_eos(const ArchSpec *s) { return s->vocab_size == 50257 ? 50256 : -1; }

static void write_config(FILE *f, const ArchSpec *s, const char *type, StDtype dtype) {
    int gpt2 = !strcmp(type, "gpt2"), olmoe = !strcmp(type, "olmoe");
    fprintf(f, "{\n  \"architectures\": [\"%s\"],\n  \"model_type\": \"%s\",\n",
            gpt2 ? "GPT2LMHeadModel" : olmoe ? "OlmoeForCausalLM" : "LlamaForCausalLM", type);
    json_int(f, "vocab_size", s->vocab_size);
    if (gpt2) {
        json_int(f, "n_embd", s->n_embd), json_int(f, "n_layer", s->n_layer), json_int(f, "n_head", s->n_head);
        json_int(f, "n_inner", s->ffn_hidden), json_int(f, "n_positions", s->seq_len), json_int(f, "n_ctx", s->seq_len);
        fprintf(f, "  \"activation_function\": \"gelu_new\",\n");
        json_num(f, "layer_norm_epsilon", s->norm_eps);
        json_num(f, "resid_pdrop", 0), json_num(f, "embd_pdrop", 0), json_num(f, "attn_pdrop", 0);
        json_bool(f, "scale_attn_weights", 1);
    } else {
        json_int(f, "hidden_size", s->n_embd);
        json_int(f, "intermediate_size", olmoe ? s->moe.expert_hidden : s->ffn_hidden);
        json_int(f, "num_hidden_layers", s->n_layer), json_int(f, "num_attention_heads", s->n_head);
        json_int(f, "num_key_value_heads", s->n_kv_head);
        if (!olmoe) json_int(f, "head_dim", s->head_dim);
        fprintf(f, "  \"hidden_act\": \"silu\",\n");
        json_int(f, "max_position_embeddings", s->seq_len);
        json_num(f, "rms_norm_eps", s->norm_eps);
        write_rope(f, s);
        json_bool(f, "attention_bias", s->bias);
        json_num(f, "attention_dropout", 0);
        if (!olmoe) json_bool(f, "mlp_bias", s->bias), json_int(f, "pretraining_tp", 1);
        if (olmoe) {
            json_int(f, "num_experts", s->moe.n_experts), json_int(f, "num_experts_per_tok", s->moe.top_k);
            json_bool(f, "norm_topk_prob", s->moe.norm_topk);
            json_num(f, "router_aux_loss_coef", s->moe.aux_loss_coef);
            json_bool(f, "output_router_logits", 0);
            fprintf(f, "  \"clip_qkv\": null,\n");
        }
    }
    int eos = hf_eos(s);
    if (eos >= 0) json_int(f, "bos_token_id", eos), json_int(f, "eos_token_id", eos);
    json_num(f, "initializer_range", 0.02);
    json_bool(f, "use_cache", 1);
    json_bool(f, "tie_word_embeddings", s->tie_embeddings);
    fprintf(f, "  \"torch_dtype\": \"%s\",\n  \"transformers_version\": \"4.46.3\"\n}\n",
            dtype == ST_BF16 ? "bfloat16" : "float32");
}

static void write_text(const char *dir, const char *name, const ArchSpec *s, const char *type, StDtype dtype) {
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    if (!f) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot create: %s", path, strerror(errno));
    if (!strcmp(name, "config.json")) write_config(f, s, type, dtype);
    else {
        int eos = hf_eos(s);
        fprintf(f, "{\n  \"_from_model_config\": true,\n");
        if (eos >= 0) fprintf(f, "  \"bos_token_id\": %d,\n  \"eos_token_id\": %d,\n", eos, eos);
        fprintf(f, "  \"transformers_version\": \"4.46.3\"\n}\n");
    }
    if (fclose(f) != 0) kiln_fail(KILN_EXIT_RUNTIME, "%s: write failed: %s", path, strerror(errno));
}

/* ---------------------------------------------------------------- export */

/* The tensors into model.safetensors, or, past shard_bytes of data (0: no
 * limit), into model-0000K-of-0000N.safetensors shards (whole tensors, in
 * order; one larger than the limit gets a shard of its own) with
 * model.safetensors.index.json mapping every name to its file, as
 * save_pretrained(max_shard_size=...) writes them. */
static void write_weights(const char *dir, const StWrite *w, int n, uint64_t shard_bytes) {
    uint64_t *size = xmalloc((size_t)(n ? n : 1) * sizeof *size), total = 0;
    for (int i = 0; i < n; i++) {
        uint64_t e = 1;
        for (int d = 0; d < w[i].ndim; d++) e *= (uint64_t)w[i].shape[d];
        size[i] = e * st_dtype_size(w[i].dtype);
        total += size[i];
    }
    int *shard = xmalloc((size_t)(n ? n : 1) * sizeof *shard), ns = 0;
    uint64_t in = 0;
    for (int i = 0; i < n; i++) {
        if (ns == 0 || (shard_bytes && in > 0 && in + size[i] > shard_bytes)) ns++, in = 0;
        shard[i] = ns - 1;
        in += size[i];
    }
    char path[1200], err[1400];
    if (ns <= 1) {
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        if (st_write(path, w, n, err, sizeof err) != 0) kiln_fail(KILN_EXIT_RUNTIME, "%s", err);
    } else {
        for (int k = 0, i = 0; k < ns; k++) {
            int j = i;
            while (j < n && shard[j] == k) j++;
            snprintf(path, sizeof path, "%s/model-%05d-of-%05d.safetensors", dir, k + 1, ns);
            if (st_write(path, w + i, j - i, err, sizeof err) != 0) kiln_fail(KILN_EXIT_RUNTIME, "%s", err);
            i = j;
        }
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
        FILE *f = fopen(path, "w");
        if (!f) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot create: %s", path, strerror(errno));
        fprintf(f, "{\n  \"metadata\": {\n    \"total_size\": %llu\n  },\n  \"weight_map\": {\n",
                (unsigned long long)total);
        for (int i = 0; i < n; i++)
            fprintf(f, "    \"%s\": \"model-%05d-of-%05d.safetensors\"%s\n", w[i].name, shard[i] + 1, ns,
                    i + 1 < n ? "," : "");
        fprintf(f, "  }\n}\n");
        if (fclose(f) != 0) kiln_fail(KILN_EXIT_RUNTIME, "%s: write failed: %s", path, strerror(errno));
    }
    free(size), free(shard);
}

void hf_write_dir(const ArchSpec *s, const ArchTensor *t, int n, float *const *host, const char *dir, StDtype dtype,
                  uint64_t shard_bytes) {
    char why[400];
    const char *type = hf_model_type(s, why, sizeof why);
    if (!type) kiln_fail(KILN_EXIT_USAGE, "export --format hf: %s", why);
    if (kiln_mkdirs(dir) != 0) kiln_fail(KILN_EXIT_USAGE, "%s: cannot create directory: %s", dir, strerror(errno));
    StWrite *w = xcalloc((size_t)n, sizeof *w);
    char (*names)[128] = xcalloc((size_t)n, sizeof *names);
    float **own = xcalloc((size_t)n, sizeof *own);
    for (int i = 0; i < n; i++) {
        int tr;
        hf_tensor_name(s, t[i].name, t[i].role, names[i], sizeof names[i], &tr);
        w[i] = (StWrite){.name = names[i], .dtype = dtype, .ndim = t[i].ndim, .data = host[i]};
        hf_shape(s, t[i].role, t[i].ndim, t[i].shape, tr, w[i].shape);
        if (tr) { /* kiln (R, K) -> HF (K, R) */
            int R = t[i].shape[0], K = t[i].shape[1];
            own[i] = xmalloc(t[i].numel * sizeof(float));
            for (int r = 0; r < R; r++)
                for (int k = 0; k < K; k++) own[i][(size_t)k * R + r] = host[i][(size_t)r * K + k];
            w[i].data = own[i];
        }
        /* the padded vocabulary rows are the last ones: the vocab_size-row shape leaves them out */
    }
    write_weights(dir, w, n, shard_bytes);
    write_text(dir, "config.json", s, type, dtype);
    write_text(dir, "generation_config.json", s, type, dtype);
    for (int i = 0; i < n; i++) free(own[i]);
    free(own), free(names), free(w);
}

/* The checkpoint directory to export: DIR itself, or a run directory's newest. */
static void resolve_ckpt(const char *arg, char *dir, size_t cap) {
    if (ckpt_is_checkpoint(arg)) {
        kiln_strlcpy(dir, arg, cap);
        return;
    }
    char root[1100];
    snprintf(root, sizeof root, "%s/checkpoints", arg);
    char **paths = NULL;
    int64_t *steps = NULL;
    int k = ckpt_list_current(root, &paths, &steps);
    if (k <= 0)
        kiln_fail_hint(KILN_EXIT_USAGE, "name a checkpoint such as runs/NAME/checkpoints/step_00001000, or a run directory",
                       "export: %s: not a checkpoint directory (no manifest) and no checkpoints under it", arg);
    kiln_strlcpy(dir, paths[0], cap);
    ckpt_list_free(paths, steps, k);
}

/* The run's resolved config, from the checkpoint's "config.yaml" blob. */
static void load_ckpt_config(const char *dir, Config *c) {
    char err[2048];
    size_t len;
    char *text = ckpt_read_blob(dir, "config.yaml", &len, err, sizeof err);
    if (!text) kiln_fail(KILN_EXIT_USAGE, "export: %s", err);
    char tmp[] = "/tmp/kiln-export-config.XXXXXX";
    int fd = mkstemp(tmp);
    if (fd < 0 || write(fd, text, len) != (ssize_t)len || close(fd) != 0)
        kiln_fail(KILN_EXIT_RUNTIME, "export: cannot write a temporary copy of %s's config: %s", dir, strerror(errno));
    free(text);
    cfg_load(c, tmp, NULL, 0);
    unlink(tmp);
}

/* "5GB", "500MB", "2GiB", "123456": bytes (decimal units as HF's
 * max_shard_size, binary with an i); 0 on anything else. */
static uint64_t parse_size(const char *v) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (end == v || errno || !(x > 0) || x > 1e18) return 0;
    static const struct { const char *u; double f; } units[] = {
        {"", 1}, {"B", 1}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"KiB", 1024.0}, {"MiB", 1048576.0},
        {"GiB", 1073741824.0}};
    for (size_t k = 0; k < sizeof units / sizeof units[0]; k++)
        if (!strcmp(end, units[k].u)) return (uint64_t)(x * units[k].f);
    return 0;
}

int hf_export_main(int argc, char **argv) {
    const char *src = NULL, *out = NULL, *format = NULL, *dt = "fp32", *shard = "5GB";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--format") && i + 1 < argc) format = argv[++i];
        else if (!strcmp(argv[i], "--out") && i + 1 < argc) out = argv[++i];
        else if (!strcmp(argv[i], "--dtype") && i + 1 < argc) dt = argv[++i];
        else if (!strcmp(argv[i], "--max-shard-size") && i + 1 < argc) shard = argv[++i];
        else if (argv[i][0] == '-' || src) kiln_fail(KILN_EXIT_USAGE, "export: unexpected argument '%s' (./train --help)", argv[i]);
        else src = argv[i];
    }
    if (!src || !out || !format)
        kiln_fail(KILN_EXIT_USAGE, "usage: ./train export CKPT_DIR --format hf --out DIR [--dtype fp32|bf16] "
                  "[--max-shard-size 5GB] | --format llmc --out FILE.bin");
    int llmc = !strcmp(format, "llmc");
    if (!llmc && strcmp(format, "hf")) kiln_fail(KILN_EXIT_USAGE, "export: --format '%s': expected hf or llmc", format);
    if (strcmp(dt, "fp32") && strcmp(dt, "bf16")) kiln_fail(KILN_EXIT_USAGE, "export: --dtype '%s': expected fp32 or bf16", dt);
    if (llmc && strcmp(dt, "fp32"))
        kiln_fail(KILN_EXIT_USAGE, "export --format llmc: --dtype %s: llm.c's version 3 checkpoint is fp32", dt);
    uint64_t shard_bytes = parse_size(shard);
    if (!shard_bytes)
        kiln_fail(KILN_EXIT_USAGE, "export: --max-shard-size '%s': expected a size such as 5GB, 500MB or 2GiB", shard);
    char dir[1200];
    resolve_ckpt(src, dir, sizeof dir);
    Config c;
    load_ckpt_config(dir, &c);
    ArchSpec s;
    arch_from_config(&c, &s);
    char why[400];
    if (llmc && llmc_refusal(&s)) kiln_fail(KILN_EXIT_USAGE, "export --format llmc: %s", llmc_refusal(&s));
    if (!llmc && !hf_model_type(&s, why, sizeof why)) kiln_fail(KILN_EXIT_USAGE, "export --format hf: %s", why);
    int n;
    ArchTensor *t = arch_tensors(&s, c.decay_embeddings, &n);
    float **host = xcalloc((size_t)n, sizeof *host);
    CkptTable tab;
    ckpt_table_init(&tab);
    for (int i = 0; i < n; i++) {
        host[i] = xmalloc(t[i].numel * sizeof(float));
        int64_t shape[2] = {t[i].shape[0], t[i].shape[1]};
        ckpt_add_tensor(&tab, t[i].name, CKPT_F32, t[i].ndim, shape, 0, t[i].numel, host[i], NULL, NULL);
    }
    char err[2048];
    CkptInfo info;
    if (ckpt_load(dir, &tab, &info, err, sizeof err) != 0) kiln_fail(KILN_EXIT_USAGE, "export: %s", err);
    ckpt_table_free(&tab);
    if (llmc) {
        llmc_write(&s, t, n, host, out);
        printf("export: %s (step %lld) -> %s (llm.c GPT-2 checkpoint, version 3, fp32, %d tensors)\n", dir,
               (long long)info.step, out, n);
    } else {
        hf_write_dir(&s, t, n, host, out, !strcmp(dt, "bf16") ? ST_BF16 : ST_F32, shard_bytes);
        printf("export: %s (step %lld) -> %s: model safetensors, config.json (%s, %d tensors, %s)\n", dir,
               (long long)info.step, out, hf_model_type(&s, why, sizeof why), n, dt);
        /* the run's tokenizer, where HF has it: GPT-2's BPE (the byte tokenizer has no HF class) */
        struct stat sb;
        if (!strcmp(c.tokenizer, "gpt2") && stat(c.tokenizer_file, &sb) == 0) {
            hf_write_gpt2_tokenizer(out, c.tokenizer_file, s.seq_len);
            printf("export: GPT-2 tokenizer from %s -> vocab.json, merges.txt, tokenizer_config.json\n",
                   c.tokenizer_file);
        } else if (!strcmp(c.tokenizer, "gpt2")) {
            printf("export: no tokenizer files: the run's data.tokenizer_file %s is not here\n", c.tokenizer_file);
        } else {
            printf("export: no tokenizer files: data.tokenizer %s has no HuggingFace counterpart\n", c.tokenizer);
        }
    }
    for (int i = 0; i < n; i++) free(host[i]);
    free(host), free(t);
    return KILN_EXIT_OK;
}

/* ---------------------------------------------------------------- import */

/* HF buffers that are not parameters (older GPT-2 files carry them). */
static int hf_ignorable(const char *name) {
    size_t n = strlen(name);
    const char *tails[] = {".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq"};
    for (int i = 0; i < 3; i++) {
        size_t k = strlen(tails[i]);
        if (n >= k && !strcmp(name + n - k, tails[i])) return 1;
    }
    return 0;
}

/* The safetensors files of an HF checkpoint: one file, or the shards an
 * index names. */
typedef struct HfSet {
    int n;
    StFile *f;      /* [n] */
    char (*path)[1200];
    char dir[1200]; /* the checkpoint's directory ("" for a lone file): config.json's */
} HfSet;

static void hf_set_free(HfSet *h) {
    for (int i = 0; i < h->n; i++) st_free(&h->f[i]);
    free(h->f), free(h->path);
    memset(h, 0, sizeof *h);
}

/* A whole small text file (an index or a config: at most 64 MiB), or exit 2. */
static char *hf_read_text(const char *path, size_t *len) {
    struct stat sb;
    if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size > (64 << 20))
        kiln_fail(KILN_EXIT_USAGE, "init.from %s: not a regular file of at most 64 MiB", path);
    char *text = kiln_read_file(path, len);
    if (!text) kiln_fail(KILN_EXIT_USAGE, "init.from %s: cannot read: %s", path, strerror(errno));
    return text;
}

/* The shards model.safetensors.index.json maps the tensors to: each file
 * once, opened; every tensor the map names must be in its file and every
 * tensor of a file in the map. */
static void hf_open_index(HfSet *h, const char *idx) {
    size_t len;
    char *text = hf_read_text(idx, &len), err[300];
    JsonValue *root = json_parse(text, len, err, sizeof err);
    free(text);
    if (!root) kiln_fail(KILN_EXIT_USAGE, "init.from %s: %s", idx, err);
    const JsonValue *map = json_get(root, "weight_map");
    if (!map || map->kind != JSON_OBJECT || map->n == 0)
        kiln_fail(KILN_EXIT_USAGE, "init.from %s: no \"weight_map\" object of tensor names and files", idx);
    h->f = xcalloc((size_t)map->n, sizeof *h->f);
    h->path = xcalloc((size_t)map->n, sizeof *h->path);
    for (int i = 0; i < map->n; i++) {
        const JsonValue *v = &map->items[i];
        if (v->kind != JSON_STRING || !*v->str || strchr(v->str, '/') || strlen(v->str) > 256)
            kiln_fail(KILN_EXIT_USAGE, "init.from %s: tensor '%s' maps to no plain file name in the directory", idx,
                      map->keys[i]);
        char p[1200];
        if (snprintf(p, sizeof p, "%s/%s", h->dir, v->str) >= (int)sizeof p)
            kiln_fail(KILN_EXIT_USAGE, "init.from %s: path of '%s' too long", idx, v->str);
        int k = 0;
        while (k < h->n && strcmp(h->path[k], p)) k++;
        if (k == h->n) {
            kiln_strlcpy(h->path[k], p, sizeof h->path[k]);
            st_open(&h->f[k], p);
            h->n++;
        }
        if (!st_find(&h->f[k], map->keys[i]))
            kiln_fail(KILN_EXIT_USAGE, "init.from %s: tensor '%s' is not in %s, where the index puts it", idx,
                      map->keys[i], p);
    }
    for (int k = 0; k < h->n; k++)
        for (int t = 0; t < h->f[k].n; t++) {
            const JsonValue *v = json_get(map, h->f[k].t[t].name);
            if (!v || strcmp(strrchr(h->path[k], '/') + 1, v->str))
                kiln_fail(KILN_EXIT_USAGE, "init.from %s: %s holds tensor '%s', which the index %s", idx, h->path[k],
                          h->f[k].t[t].name, v ? "puts in another file" : "does not name");
        }
    json_free(root);
}

/* A set of one file. */
static int hf_open_one(HfSet *h, const char *file) {
    h->f = xcalloc(1, sizeof *h->f);
    h->path = xcalloc(1, sizeof *h->path);
    kiln_strlcpy(h->path[0], file, sizeof h->path[0]);
    st_open(&h->f[0], file);
    h->n = 1;
    return 1;
}

/* The HF checkpoint init.from names, opened; 0 if it is not one. */
static int hf_open_set(const char *path, HfSet *h) {
    memset(h, 0, sizeof *h);
    struct stat sb;
    size_t n = strlen(path);
    if (stat(path, &sb) != 0) return 0;
    if (S_ISREG(sb.st_mode) && n > 12 && !strcmp(path + n - 12, ".safetensors")) return hf_open_one(h, path);
    if (!S_ISDIR(sb.st_mode)) return 0;
    kiln_strlcpy(h->dir, path, sizeof h->dir);
    char file[1200];
    snprintf(file, sizeof file, "%s/model.safetensors", path);
    if (stat(file, &sb) == 0) return hf_open_one(h, file);
    snprintf(file, sizeof file, "%s/model.safetensors.index.json", path);
    if (stat(file, &sb) != 0) return 0;
    hf_open_index(h, file);
    return 1;
}

/* Tensor `name` in the set: its file index in *k. */
static const StTensor *hf_find(const HfSet *h, const char *name, int *k) {
    for (int i = 0; i < h->n; i++) {
        const StTensor *t = st_find(&h->f[i], name);
        if (t) {
            *k = i;
            return t;
        }
    }
    return NULL;
}

/* config.json beside the weights, against the config's model: every field
 * that changes what the weights compute and that the tensor shapes cannot
 * show (heads, kv heads, eps, RoPE, tying, MoE routing) must agree. */
static double hf_num(const JsonValue *c, const char *key, double dflt, int *have) {
    const JsonValue *v = json_get(c, key);
    *have = v && (v->kind == JSON_NUMBER || v->kind == JSON_BOOL);
    return *have ? v->num : dflt;
}

/* One field of config.json: its key, the kiln key it must agree with, the
 * value kiln has, HF's default when the key is absent, 1: compare relatively. */
typedef struct HfKey {
    const char *key, *kiln;
    double want, dflt;
    int rel;
} HfKey;

static void hf_check_config(const HfSet *h, const ArchSpec *s, const char *type) {
    if (!h->dir[0]) return;
    char path[1300];
    snprintf(path, sizeof path, "%s/config.json", h->dir);
    struct stat sb;
    if (stat(path, &sb) != 0) return; /* weights alone: the shapes are all there is to check */
    size_t len;
    char *text = hf_read_text(path, &len), err[300];
    JsonValue *c = json_parse(text, len, err, sizeof err);
    free(text);
    if (!c || c->kind != JSON_OBJECT) kiln_fail(KILN_EXIT_USAGE, "init.from %s: %s", path, c ? "not an object" : err);
    const JsonValue *mt = json_get(c, "model_type");
    if (!mt || mt->kind != JSON_STRING || strcmp(mt->str, type))
        kiln_fail(KILN_EXIT_USAGE, "init.from %s: key 'model_type' is %s%s%s, the config's model is an HF '%s' "
                  "(model.arch and its pieces)", path, mt && mt->kind == JSON_STRING ? "'" : "",
                  mt && mt->kind == JSON_STRING ? mt->str : "missing", mt && mt->kind == JSON_STRING ? "'" : "", type);
    int gpt2 = !strcmp(type, "gpt2"), olmoe = !strcmp(type, "olmoe"), have;
    HfKey k[16];
    int nk = 0;
#define HF_KEY(K, KILN, W, D, R) (k[nk++] = (HfKey){K, KILN, (double)(W), (double)(D), R})
    HF_KEY("vocab_size", "model.vocab_size", s->vocab_size, NAN, 0);
    if (gpt2) {
        HF_KEY("n_embd", "model.n_embd", s->n_embd, NAN, 0);
        HF_KEY("n_layer", "model.n_layer", s->n_layer, NAN, 0);
        HF_KEY("n_head", "model.n_head", s->n_head, NAN, 0);
        HF_KEY("layer_norm_epsilon", "model.norm_eps", s->norm_eps, 1e-5, 1);
        HF_KEY("tie_word_embeddings", "model.tie_embeddings", s->tie_embeddings, 1, 0);
    } else {
        HF_KEY("hidden_size", "model.n_embd", s->n_embd, NAN, 0);
        HF_KEY("num_hidden_layers", "model.n_layer", s->n_layer, NAN, 0);
        HF_KEY("num_attention_heads", "model.n_head", s->n_head, NAN, 0);
        HF_KEY("num_key_value_heads", "model.n_kv_head", s->n_kv_head, hf_num(c, "num_attention_heads", NAN, &have), 0);
        HF_KEY("rms_norm_eps", "model.norm_eps", s->norm_eps, 1e-6, 1);
        HF_KEY("rope_theta", "model.rope_theta", s->rope_theta, 10000, 1);
        HF_KEY("tie_word_embeddings", "model.tie_embeddings", s->tie_embeddings, 0, 0);
        HF_KEY("head_dim", "model.head_dim", s->head_dim, (double)s->n_embd / s->n_head, 0);
        if (olmoe) {
            HF_KEY("num_experts", "model.moe.n_experts", s->moe.n_experts, NAN, 0);
            HF_KEY("num_experts_per_tok", "model.moe.top_k", s->moe.top_k, NAN, 0);
            HF_KEY("norm_topk_prob", "model.moe.norm_topk", s->moe.norm_topk, 0, 0);
        }
    }
#undef HF_KEY
    for (int i = 0; i < nk; i++) {
        double v = hf_num(c, k[i].key, k[i].dflt, &have);
        int same = k[i].rel ? fabs(v - k[i].want) <= 1e-6 * fabs(k[i].want) : v == k[i].want;
        if (!isnan(v) && same) continue;
        kiln_fail(KILN_EXIT_USAGE, "init.from %s: key '%s' is %s%.9g, the config's %s is %.9g", path, k[i].key,
                  have ? "" : "missing, so its default ", v, k[i].kiln, k[i].want);
    }
    /* RoPE scaling (Llama 3.1) changes every rotation: on in both or in neither */
    const JsonValue *rs = json_get(c, "rope_scaling");
    int hf_scaled = rs && rs->kind == JSON_OBJECT;
    if (!gpt2 && hf_scaled != s->rope_scaling.on)
        kiln_fail(KILN_EXIT_USAGE, "init.from %s: key 'rope_scaling' is %s, the config's model.rope_scaling is %s", path,
                  hf_scaled ? "set" : "null", s->rope_scaling.on ? "set" : "off");
    if (!gpt2 && hf_scaled) {
        int h1;
        double f = hf_num(rs, "factor", NAN, &h1);
        if (fabs(f - s->rope_scaling.factor) > 1e-6 * s->rope_scaling.factor)
            kiln_fail(KILN_EXIT_USAGE, "init.from %s: key 'rope_scaling.factor' is %.9g, the config's "
                      "model.rope_scaling.factor is %.9g", path, f, s->rope_scaling.factor);
    }
    json_free(c);
}

/* An lm_head.weight beside a tied model's embedding (some savers write the
 * tie out): accepted when it is the embedding, bit for bit. */
static int hf_tied_copy(const HfSet *h, int hk, const StTensor *head, const ArchSpec *s) {
    int ek;
    const StTensor *e = hf_find(h, s->family == ARCH_GPT2 ? "transformer.wte.weight" : "model.embed_tokens.weight", &ek);
    return e && e->dtype == head->dtype && e->end - e->begin == head->end - head->begin &&
           !memcmp(h->f[ek].data + e->begin, h->f[hk].data + head->begin, e->end - e->begin);
}

int hf_init_from(Model *m, const char *path, int say) {
    HfSet h;
    if (!hf_open_set(path, &h)) return 0;
    const char *file = h.n == 1 ? h.path[0] : path;
    const ArchSpec *s = &m->gshape; /* the whole model's: tensor parallelism keeps each rank's part below */
    char why[400];
    const char *type = hf_model_type(s, why, sizeof why);
    if (!type) kiln_fail(KILN_EXIT_USAGE, "init.from %s: %s", file, why);
    hf_check_config(&h, s, type);
    char **used = xcalloc((size_t)h.n, sizeof *used);
    for (int k = 0; k < h.n; k++) used[k] = xcalloc((size_t)h.f[k].n + 1, 1);
    size_t maxn = 0;
    for (int i = 0; i < m->num_tensors; i++) {
        const ParamInfo *p = &m->params[i];
        size_t g = (size_t)p->gshape[0] * (p->ndim == 2 ? (size_t)p->gshape[1] : 1);
        maxn = g > maxn ? g : maxn;
    }
    float *a = xmalloc(maxn * sizeof(float)), *b = xmalloc(maxn * sizeof(float));
    float *part = m->tp > 1 ? xmalloc(maxn * sizeof(float)) : NULL; /* a tp rank's boxes of the whole tensor */
    float *all = m->master_bf16 ? xmalloc(m->num_params * sizeof(float)) : NULL;
    if (all) model_params_to_host(m, all);
    for (int i = 0; i < m->num_tensors; i++) {
        const ParamInfo *p = &m->params[i];
        char name[128];
        int tr;
        int64_t want[2];
        hf_tensor_name(s, p->name, p->role, name, sizeof name, &tr);
        hf_shape(s, p->role, p->ndim, p->gshape, tr, want);
        size_t gnumel = (size_t)p->gshape[0] * (p->ndim == 2 ? (size_t)p->gshape[1] : 1);
        int k;
        const StTensor *t = hf_find(&h, name, &k);
        if (!t) kiln_fail(KILN_EXIT_USAGE, "init.from %s: tensor '%s' (kiln '%s') is missing", file, name, p->name);
        used[k][t - h.f[k].t] = 1;
        if (t->ndim != p->ndim || t->shape[0] != want[0] || (p->ndim == 2 && t->shape[1] != want[1]))
            kiln_fail(KILN_EXIT_USAGE, "init.from %s: tensor '%s' has shape [%lld%s%lld], the config's model needs [%lld%s%lld]",
                      file, name, (long long)(t->ndim ? t->shape[0] : 0), t->ndim > 1 ? ", " : "",
                      (long long)(t->ndim > 1 ? t->shape[1] : 0), (long long)want[0], p->ndim > 1 ? ", " : "",
                      (long long)(p->ndim > 1 ? want[1] : 0));
        st_to_f32(&h.f[k], t, a);
        float *v = a;
        if (tr) { /* HF (K, R) -> kiln (R, K) */
            int R = p->gshape[0], K = p->gshape[1];
            for (int r = 0; r < R; r++)
                for (int c = 0; c < K; c++) b[(size_t)r * K + c] = a[(size_t)c * R + r];
            v = b;
        }
        if (t->numel < gnumel) memset(v + t->numel, 0, (gnumel - t->numel) * sizeof(float)); /* padded rows */
        if (part) { /* this tp rank's boxes, local padding rows zero */
            ModelBox bx[MODEL_MAX_BOXES];
            int nb = model_tp_boxes(m, i, bx);
            size_t g1 = p->ndim == 2 ? (size_t)p->gshape[1] : 1;
            memset(part, 0, p->numel * sizeof(float));
            for (int q = 0; q < nb; q++)
                for (size_t r = bx[q].r0; r < bx[q].r1; r++)
                    memcpy(part + bx[q].at + (r - bx[q].r0) * (bx[q].c1 - bx[q].c0), v + r * g1 + bx[q].c0,
                           (bx[q].c1 - bx[q].c0) * sizeof(float));
            v = part;
        }
        if (all) memcpy(all + p->offset, v, p->numel * sizeof(float));
        else m->be->to_device(m->pview[i], v, p->numel * sizeof(float));
    }
    /* a pipeline stage takes its layers (and the embeddings or the head it
     * holds), an expert-parallel rank its experts: the rest of a whole
     * model's tensors belong to other stages or ranks */
    int stage = m->layer_lo > 0 || m->layer_hi < s->n_layer || m->ep > 1;
    int nall = 0;
    ArchTensor *whole = stage ? arch_tensors(&m->gshape, 0, &nall) : NULL;
    for (int k = 0; k < h.n; k++)
        for (int j = 0; j < h.f[k].n; j++) {
            const StTensor *t = &h.f[k].t[j];
            if (used[k][j] || hf_ignorable(t->name)) continue;
            int other_stage = 0;
            for (int w = 0; w < nall && !other_stage; w++) {
                char hn[128];
                int tr;
                hf_tensor_name(s, whole[w].name, whole[w].role, hn, sizeof hn, &tr);
                other_stage = !strcmp(hn, t->name);
            }
            if (other_stage) continue;
            if (!strcmp(t->name, "lm_head.weight") && s->tie_embeddings && hf_tied_copy(&h, k, t, s)) continue;
            kiln_fail(KILN_EXIT_USAGE, "init.from %s: tensor '%s' has no place in the config's model (%s, %d layers%s)",
                      h.path[k], t->name, arch_family_name(s->family), s->n_layer,
                      s->tie_embeddings ? ", tied head" : "");
        }
    if (all) model_params_from_host(m, all);
    model_params_changed(m);
    if (say)
        printf("init.from: HuggingFace weights of %s (%d tensors%s); optimizer, data position and step start fresh\n",
               file, m->num_tensors, h.n > 1 ? ", sharded" : "");
    for (int k = 0; k < h.n; k++) free(used[k]);
    free(whole), free(part);
    free(all), free(a), free(b), free(used);
    hf_set_free(&h);
    return 1;
}
