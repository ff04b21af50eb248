/* hf: kiln <-> HuggingFace (GPT2LMHeadModel, LlamaForCausalLM,
 * OlmoeForCausalLM): one name table, one writer, one loader. Refuses
 * what HF cannot compute exactly (shared experts, sigmoid routers, capacity)
 * rather than export a model that would mean something else. */
#include "hf.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt.h"
#include "config.h"
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

void hf_write_dir(const ArchSpec *s, const ArchTensor *t, int n, float *const *host, const char *dir, StDtype dtype) {
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
    char path[1200], err[1400];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (st_write(path, w, n, err, sizeof err) != 0) kiln_fail(KILN_EXIT_RUNTIME, "%s", err);
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

int hf_export_main(int argc, char **argv) {
    const char *src = NULL, *out = NULL, *format = NULL, *dt = "fp32";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--format") && i + 1 < argc) format = argv[++i];
        else if (!strcmp(argv[i], "--out") && i + 1 < argc) out = argv[++i];
        else if (!strcmp(argv[i], "--dtype") && i + 1 < argc) dt = argv[++i];
        else if (argv[i][0] == '-' || src) kiln_fail(KILN_EXIT_USAGE, "export: unexpected argument '%s' (./train --help)", argv[i]);
        else src = argv[i];
    }
    if (!src || !out || !format)
        kiln_fail(KILN_EXIT_USAGE, "usage: ./train export CKPT_DIR --format hf --out DIR [--dtype fp32|bf16]");
    if (strcmp(format, "hf")) kiln_fail(KILN_EXIT_USAGE, "export: --format '%s': expected hf (llmc is not written yet)", format);
    if (strcmp(dt, "fp32") && strcmp(dt, "bf16")) kiln_fail(KILN_EXIT_USAGE, "export: --dtype '%s': expected fp32 or bf16", dt);
    char dir[1200];
    resolve_ckpt(src, dir, sizeof dir);
    Config c;
    load_ckpt_config(dir, &c);
    ArchSpec s;
    arch_from_config(&c, &s);
    char why[400];
    if (!hf_model_type(&s, why, sizeof why)) kiln_fail(KILN_EXIT_USAGE, "export --format hf: %s", why);
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
    hf_write_dir(&s, t, n, host, out, !strcmp(dt, "bf16") ? ST_BF16 : ST_F32);
    printf("export: %s (step %lld) -> %s/model.safetensors, config.json (%s, %d tensors, %s)\n", dir,
           (long long)info.step, out, hf_model_type(&s, why, sizeof why), n, dt);
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

/* The safetensors file init.from names, or "" if it is not an HF checkpoint. */
static void hf_file_of(const char *path, char *file, size_t cap) {
    struct stat sb;
    size_t n = strlen(path);
    file[0] = 0;
    if (stat(path, &sb) != 0) return;
    if (S_ISREG(sb.st_mode) && n > 12 && !strcmp(path + n - 12, ".safetensors")) {
        kiln_strlcpy(file, path, cap);
        return;
    }
    if (!S_ISDIR(sb.st_mode)) return;
    snprintf(file, cap, "%s/model.safetensors", path);
    if (stat(file, &sb) == 0) return;
    char idx[1200];
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", path);
    if (stat(idx, &sb) == 0)
        kiln_fail(KILN_EXIT_USAGE, "init.from %s: sharded safetensors (model.safetensors.index.json) are not read yet; "
                                   "save with a larger max_shard_size", path);
    file[0] = 0;
}

/* An lm_head.weight beside a tied model's embedding (some savers write the
 * tie out): accepted when it is the embedding, bit for bit. */
static int hf_tied_copy(const StFile *f, const StTensor *head, const ArchSpec *s) {
    const StTensor *e = st_find(f, s->family == ARCH_GPT2 ? "transformer.wte.weight" : "model.embed_tokens.weight");
    return e && e->dtype == head->dtype && e->end - e->begin == head->end - head->begin &&
           !memcmp(f->data + e->begin, f->data + head->begin, e->end - e->begin);
}

int hf_init_from(Model *m, const char *path, int say) {
    char file[1200];
    hf_file_of(path, file, sizeof file);
    if (!file[0]) return 0;
    const ArchSpec *s = &m->shape;
    char why[400];
    if (!hf_model_type(s, why, sizeof why)) kiln_fail(KILN_EXIT_USAGE, "init.from %s: %s", file, why);
    StFile f;
    st_open(&f, file);
    char *used = xcalloc((size_t)f.n + 1, 1);
    size_t maxn = 0;
    for (int i = 0; i < m->num_tensors; i++) maxn = m->params[i].numel > maxn ? m->params[i].numel : maxn;
    float *a = xmalloc(maxn * sizeof(float)), *b = xmalloc(maxn * sizeof(float));
    float *all = m->master_bf16 ? xmalloc(m->num_params * sizeof(float)) : NULL;
    if (all) model_params_to_host(m, all);
    for (int i = 0; i < m->num_tensors; i++) {
        const ParamInfo *p = &m->params[i];
        char name[128];
        int tr;
        int64_t want[2];
        hf_tensor_name(s, p->name, p->role, name, sizeof name, &tr);
        hf_shape(s, p->role, p->ndim, p->shape, tr, want);
        const StTensor *t = st_find(&f, name);
        if (!t) kiln_fail(KILN_EXIT_USAGE, "init.from %s: tensor '%s' (kiln '%s') is missing", file, name, p->name);
        used[t - f.t] = 1;
        if (t->ndim != p->ndim || t->shape[0] != want[0] || (p->ndim == 2 && t->shape[1] != want[1]))
            kiln_fail(KILN_EXIT_USAGE, "init.from %s: tensor '%s' has shape [%lld%s%lld], the config's model needs [%lld%s%lld]",
                      file, name, (long long)(t->ndim ? t->shape[0] : 0), t->ndim > 1 ? ", " : "",
                      (long long)(t->ndim > 1 ? t->shape[1] : 0), (long long)want[0], p->ndim > 1 ? ", " : "",
                      (long long)(p->ndim > 1 ? want[1] : 0));
        st_to_f32(&f, t, a);
        float *v = a;
        if (tr) { /* HF (K, R) -> kiln (R, K) */
            int R = p->shape[0], K = p->shape[1];
            for (int r = 0; r < R; r++)
                for (int k = 0; k < K; k++) b[(size_t)r * K + k] = a[(size_t)k * R + r];
            v = b;
        }
        if (t->numel < p->numel) memset(v + t->numel, 0, (p->numel - t->numel) * sizeof(float)); /* padded rows */
        if (all) memcpy(all + p->offset, v, p->numel * sizeof(float));
        else m->be->to_device(m->pview[i], v, p->numel * sizeof(float));
    }
    for (int j = 0; j < f.n; j++) {
        if (used[j] || hf_ignorable(f.t[j].name)) continue;
        if (!strcmp(f.t[j].name, "lm_head.weight") && s->tie_embeddings && hf_tied_copy(&f, &f.t[j], s)) continue;
        kiln_fail(KILN_EXIT_USAGE, "init.from %s: tensor '%s' has no place in the config's model (%s, %d layers%s)", file,
                  f.t[j].name, arch_family_name(s->family), s->n_layer,
                  s->tie_embeddings ? ", tied head" : "");
    }
    if (all) model_params_from_host(m, all);
    model_params_changed(m);
    if (say) printf("init.from: HuggingFace weights of %s (%d tensors); optimizer, data position and step start fresh\n",
                    file, m->num_tensors);
    free(all), free(a), free(b), free(used);
    st_free(&f);
    return 1;
}
