/* test_config: the config loader's contract — defaults, every type, every error
 * class (exit 2 with file, line, key and a did-you-mean), --set, the YAML round
 * trip, and docs/config.md matching cfg_write_doc(). Never touches a real run.
 * `test_config --write-doc` regenerates docs/config.md from the key table. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* open_memstream */
#endif
#include "config.h"
#include "test.h"
#include "util.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static char tmp_dir[512];

static const char *tmp_path(const char *name) {
    static char buf[8][1024];
    static int slot;
    char *p = buf[slot++ % 8];
    snprintf(p, 1024, "%s/%s", tmp_dir, name);
    return p;
}

static const char *write_yaml(const char *name, const char *text) {
    const char *p = tmp_path(name);
    FILE *f = fopen(p, "w");
    if (!f) { perror(p); exit(1); }
    fputs(text, f);
    fclose(f);
    return p;
}

typedef struct LoadArgs {
    const char *path;
    const char *const *sets;
    int nsets;
} LoadArgs;

static void load_in_child(void *arg) {
    const LoadArgs *a = arg;
    Config c;
    cfg_load(&c, a->path, a->sets, a->nsets);
}

/* Run cfg_load in a child (it exits on error); return its exit status and its stderr. */
static int load_child(const char *path, const char *const *sets, int nsets, char *err, size_t cap) {
    LoadArgs a = {path, sets, nsets};
    return test_run_child(load_in_child, &a, err, cap);
}

/* Expect loading to exit 2 with every NULL-terminated substring in its stderr. */
static void expect_fail(const char *name, const char *path, const char *const *sets, int nsets, ...) {
    char err[4096];
    int rc = load_child(path, sets, nsets, err, sizeof err);
    va_list ap;
    va_start(ap, nsets);
    const char *missing = NULL;
    for (const char *s; (s = va_arg(ap, const char *));)
        if (!missing && !strstr(err, s)) missing = s;
    va_end(ap);
    test_report(rc == 2 && !missing, name, "exit %d (want 2), missing '%s' in: %s", rc, missing ? missing : "",
                err);
}

static void expect_yaml_fail(const char *name, const char *text, const char *want1, const char *want2,
                             const char *want3) {
    const char *p = write_yaml("bad.yaml", text);
    expect_fail(name, p, NULL, 0, want1, want2, want3, (const char *)NULL);
}

static void test_defaults(void) {
    Config c;
    cfg_load(&c, NULL, NULL, 0);
    int ok = c.n_layer == 4 && c.n_head == 4 && c.n_embd == 128 && c.seq_len == 256 && c.vocab_size == 256 &&
             c.padded_vocab == 256 && c.micro_batch == 8 && c.total_tokens == 16384 && c.grad_accum == 8 &&
             c.lr == 6.0e-4f && c.beta1 == 0.9f && c.beta2 == 0.95f && c.eps == 1e-8f && c.decay_embeddings == 1 &&
             c.seed == 1337 && c.dp == 0 && c.tp == 1 && c.steps == 2000 && c.sample_temperature == 1.0f &&
             !strcmp(c.device, "auto") && !strcmp(c.run_dir, "runs/tiny") && !strcmp(c.sched_kind, "cosine") &&
             !strcmp(c.train_glob, "data/austen/train_*.bin") && !strcmp(c.compute, "bf16") && c.hash != 0;
    test_report(ok, "config_defaults", "defaults differ: n_layer %d lr %g run_dir %s grad_accum %d", c.n_layer,
                (double)c.lr, c.run_dir, c.grad_accum);

    /* an empty file is the defaults, hash included */
    Config e;
    cfg_load(&e, write_yaml("empty.yaml", "# nothing\n"), NULL, 0);
    test_report(!memcmp(&c, &e, sizeof c), "config_empty_file", "empty file differs from defaults");
}

static const char *full_yaml =
    "run:\n  name: \"q\\\"uo\\\\te\\tx \\u00e9\"\n  dir: out/here\n  seed: 18446744073709551615\n  threads: 3\n"
    "device: cpu\n"
    "model: {arch: gpt2, n_layer: 2, n_head: 2, n_embd: 64, seq_len: 32, vocab_size: 50257}\n"
    "data:\n  train: 'a/*.bin'\n  val: \"\"\n  tokenizer: gpt2\n  tokenizer_file: tok/gpt2.tiktoken\n"
    "batch:\n  micro_batch: 4\n  total_tokens: 256\n"
    "train:\n  steps: 10\n  eval_every: 0\n  eval_batches: 3\n  sample_every: 0\n  sample_tokens: 7\n"
    "  sample_temperature: 0\n  sample_top_k: 40\n"
    "optim:\n  name: adamw\n  lr: 1e-3\n  betas: [0.8, 0.999]\n  eps: 1.0e-6\n  weight_decay: 0\n"
    "  grad_clip: 0.5\n  decay_embeddings: no\n"
    "schedule: {kind: wsd, warmup_steps: 0, min_lr_ratio: 0, decay_ratio: 0.3}\n"
    "parallel: {dp: 1, zero: 0, tp: 1, pp: 1, cp: 1, ep: 1}\n"
    "precision: {compute: fp32, master: fp32}\n"
    "metrics:\n  log_every: 5\n"
    "init:\n  from: \"gpt2_124M.bin\"\n";

static void test_full_file(void) {
    Config c;
    cfg_load(&c, write_yaml("full.yaml", full_yaml), NULL, 0);
    int ok = !strcmp(c.run_name, "q\"uo\\te\tx \xc3\xa9") && !strcmp(c.run_dir, "out/here") &&
             c.seed == UINT64_MAX && c.threads == 3 && !strcmp(c.device, "cpu") && c.n_layer == 2 &&
             c.n_embd == 64 && c.vocab_size == 50257 && c.padded_vocab == 50304 && !strcmp(c.train_glob, "a/*.bin") &&
             c.val_glob[0] == 0 && !strcmp(c.tokenizer, "gpt2") && c.micro_batch == 4 && c.total_tokens == 256 &&
             c.grad_accum == 2 && c.steps == 10 && c.eval_every == 0 && c.sample_temperature == 0.0f &&
             c.sample_top_k == 40 && c.lr == 1e-3f && c.beta1 == 0.8f && c.beta2 == 0.999f && c.eps == 1e-6f &&
             c.weight_decay == 0 && c.grad_clip == 0.5f && c.decay_embeddings == 0 && !strcmp(c.sched_kind, "wsd") &&
             c.decay_ratio == 0.3f && c.dp == 1 && !strcmp(c.compute, "fp32") && c.log_every == 5 &&
             !strcmp(c.init_from, "gpt2_124M.bin");
    test_report(ok, "config_full_file", "a value of full.yaml was not loaded as written (name '%s', lr %g)",
                c.run_name, (double)c.lr);

    Config d;
    cfg_load(&d, write_yaml("strnum.yaml", "run: {name: 123}\ndata: {train: \"456\"}\nparallel: {dp: auto}\n"),
             NULL, 0);
    test_report(!strcmp(d.run_name, "123") && !strcmp(d.train_glob, "456") && d.dp == 0 &&
                    !strcmp(d.run_dir, "runs/123"),
                "config_string_from_number", "name '%s' train '%s' dp %d", d.run_name, d.train_glob, d.dp);
}

static void test_file_errors(void) {
    const char *missing = tmp_path("no_such_config.yaml");
    expect_fail("config_missing_file", missing, NULL, 0, missing, "cannot read", "hint:", (const char *)NULL);
    expect_yaml_fail("config_malformed", "model:\n  n_layer: 4\n  n_head: [1, 2\n", "invalid YAML", "bad.yaml:", NULL);
    expect_yaml_fail("config_top_not_mapping", "- a\n- b\n", "bad.yaml:1:", "top level", "got a list of 2");
    expect_yaml_fail("config_section_not_mapping", "run: {seed: 1}\nmodel: 5\n", "bad.yaml:2:", "key 'model'",
                     "got '5'");
    expect_yaml_fail("config_unknown_key", "optim:\n  lr: 0.001\n  lrr: 1\n", "bad.yaml:3:",
                     "unknown key 'optim.lrr'", "did you mean 'optim.lr'?");
    expect_yaml_fail("config_unknown_section", "optm:\n  lr: 1\n", "bad.yaml:1:", "unknown key 'optm'",
                     "did you mean 'optim'?");
    expect_yaml_fail("config_key_in_wrong_section", "model:\n  lr: 1\n", "bad.yaml:2:", "unknown key 'model.lr'",
                     "did you mean 'optim.lr'?");
    expect_yaml_fail("config_unknown_transposed", "modle:\n  n_layer: 2\n", "unknown key 'modle'",
                     "did you mean 'model'?", NULL);
    char err[4096];
    int rc = load_child(write_yaml("bad.yaml", "zzqqxxyy: 1\n"), NULL, 0, err, sizeof err);
    test_report(rc == 2 && strstr(err, "unknown key 'zzqqxxyy'") && !strstr(err, "did you mean"),
                "config_unknown_no_suggestion", "exit %d, a far-off key got a suggestion or no error: %s", rc, err);
}

static void test_type_errors(void) {
    expect_yaml_fail("config_string_for_number", "optim:\n  lr: fast\n", "bad.yaml:2: key 'optim.lr'",
                     "expected a number in [0, 10]", "got 'fast'");
    expect_yaml_fail("config_quoted_number", "optim:\n  lr: \"0.001\"\n", "bad.yaml:2:", "key 'optim.lr'",
                     "expected a number");
    expect_yaml_fail("config_number_for_bool", "optim:\n  decay_embeddings: 1\n", "bad.yaml:2:",
                     "key 'optim.decay_embeddings'", "expected a bool (true/false/yes/no), got '1'");
    expect_yaml_fail("config_betas_not_list", "optim:\n  betas: 0.9\n", "bad.yaml:2:", "key 'optim.betas'",
                     "expected a list of 2 numbers");
    expect_yaml_fail("config_betas_length", "optim:\n  betas: [0.9, 0.95, 0.99]\n", "bad.yaml:2:",
                     "key 'optim.betas'", "got a list of 3");
    expect_yaml_fail("config_betas_item_range", "optim:\n  betas:\n    - 0.9\n    - 1.0\n", "bad.yaml:4:",
                     "key 'optim.betas[1]'", "[0, 1)");
    expect_yaml_fail("config_int_range", "model:\n  n_layer: 0\n", "bad.yaml:2: key 'model.n_layer'",
                     "expected an integer in [1, 1024]", "got '0'");
    expect_yaml_fail("config_float_range", "\noptim: {lr: 20}\n", "bad.yaml:2:", "key 'optim.lr'", "[0, 10]");
    expect_yaml_fail("config_bad_enum", "device: gpu\n", "bad.yaml:1: key 'device'", "one of auto, cpu, cuda",
                     "got 'gpu'");
    expect_yaml_fail("config_int_overflow", "train:\n  steps: 99999999999999999999\n", "bad.yaml:2:",
                     "key 'train.steps'", "expected an integer");
    expect_yaml_fail("config_int_too_big_for_int32", "train:\n  eval_every: 3000000000\n", "bad.yaml:2:",
                     "key 'train.eval_every'", "2147483647");
    expect_yaml_fail("config_int_fraction", "train:\n  steps: 2.5\n", "bad.yaml:2:", "key 'train.steps'",
                     "got '2.5'");
    expect_yaml_fail("config_empty_value", "optim:\n  lr:\n", "key 'optim.lr'", "got an empty value",
                     "bad.yaml:");
    expect_yaml_fail("config_duplicate_key", "model:\n  n_layer: 2\n  n_layer: 3\n", "bad.yaml:3:",
                     "duplicate key 'model.n_layer'", "line 2");
    expect_yaml_fail("config_duplicate_section", "model: {n_layer: 2}\nrun: {seed: 1}\nmodel: {n_head: 2}\n",
                     "bad.yaml:3:", "duplicate key 'model'", NULL);
    expect_yaml_fail("config_two_documents", "run: {seed: 1}\n---\nrun: {seed: 2}\n", "bad.yaml:", "document",
                     NULL);
    char longname[700];
    memset(longname, 'a', sizeof longname);
    memcpy(longname, "run: {name: ", 12);
    strcpy(longname + 650, "}\n");
    expect_yaml_fail("config_string_too_long", longname, "bad.yaml:1:", "key 'run.name'", "at most 511 bytes");
}

static void test_cross_errors(void) {
    expect_yaml_fail("config_embd_head", "model:\n  n_embd: 130\n  n_head: 4\n", "bad.yaml:2:", "model.n_embd",
                     "model.n_head");
    expect_yaml_fail("config_total_tokens_multiple", "batch:\n  total_tokens: 5000\n", "bad.yaml:2:",
                     "key 'batch.total_tokens'", "multiple of micro_batch*seq_len = 2048");
    expect_yaml_fail("config_gpt2_needs_tokenizer_file", "data:\n  tokenizer: gpt2\n", "data.tokenizer_file",
                     "gpt2", NULL);
    {
        /* ZeRO 2/3 run inside each pipeline stage, and pp composes with cp (t_pp.sh) */
        Config c;
        cfg_load(&c, write_yaml("ppz.yaml", "parallel:\n  pp: 2\n  zero: 3\n  cp: 2\n"), NULL, 0);
        test_report(c.pp == 2 && c.zero == 3 && c.cp == 2, "config_parallel_pp_zero3_cp_accepted",
                    "pp %d zero %d cp %d", c.pp, c.zero, c.cp);
    }
    expect_yaml_fail("config_parallel_pp_virtual_needs_pp", "parallel:\n  pp_virtual: 2\n", "bad.yaml:2:",
                     "key 'parallel.pp_virtual'", "parallel.pp > 1");
    expect_yaml_fail("config_parallel_pp_layers_entry", "parallel:\n  pp: 2\n  pp_layers: [2, x]\n", "bad.yaml:3:",
                     "key 'parallel.pp_layers[1]'", "an integer");
    expect_yaml_fail("config_parallel_pp_schedule", "parallel:\n  pp: 2\n  pp_schedule: 2f2b\n", "bad.yaml:3:",
                     "key 'parallel.pp_schedule'", "zb_h1");
    expect_yaml_fail("config_parallel_cp_chunks", "parallel:\n  cp: 3\n", "bad.yaml:2:", "'model.seq_len', 'parallel.cp'",
                     "does not split into 2 x cp = 6 chunks");
    expect_yaml_fail("config_parallel_cp_mode", "parallel:\n  cp: 2\n  cp_attention: tree\n", "bad.yaml:3:",
                     "key 'parallel.cp_attention'", NULL);
    expect_yaml_fail("config_parallel_sp_value", "parallel:\n  tp: 2\n  sequence_parallel: sometimes\n",
                     "bad.yaml:3:", "key 'parallel.sequence_parallel'", NULL);
    /* Muon composes with every ZeRO stage and tensor parallelism (src/muon.c): no refusal */
    char err[4096];
    int rc = load_child(write_yaml("muon.yaml", "parallel:\n  tp: 2\n  zero: 3\noptim:\n  name: muon\n"), NULL, 0,
                        err, sizeof err);
    test_report(rc == 0, "config_parallel_tp_zero3_muon", "exit %d: %s", rc, err);
    expect_yaml_fail("config_parallel_dp_batch", "parallel:\n  dp: 3\n", "key 'batch.total_tokens'",
                     "parallel.dp = 3", NULL);
    expect_yaml_fail("config_parallel_zero4", "parallel:\n  zero: 4\n", "key 'parallel.zero'",
                     "[0, 3]", NULL);
    /* expert parallelism: an MoE model whose experts and dp it divides, ZeRO 0 or 1 */
#define MOE4 "model:\n  arch: llama\n  mlp: moe\n  moe:\n    n_experts: 4\n    top_k: 2\n"
    expect_yaml_fail("config_parallel_ep_dense", "parallel:\n  ep: 2\n", "bad.yaml:2:", "key 'parallel.ep'",
                     "model.mlp is gelu");
    expect_yaml_fail("config_parallel_ep_experts", MOE4 "parallel:\n  ep: 3\n", "bad.yaml:8:",
                     "ep 3 must divide the 4 experts", NULL);
    expect_yaml_fail("config_parallel_ep_dp", MOE4 "parallel:\n  ep: 2\n  dp: 3\n", "'parallel.dp'",
                     "ep 2 must divide dp x cp = 3", NULL);
    /* the ep groups lie in dp x cp: ep 2 over dp 1 x cp 2 */
    rc = load_child(write_yaml("ep_cp.yaml", MOE4 "parallel:\n  ep: 2\n  dp: 1\n  cp: 2\n"), NULL, 0, err, sizeof err);
    test_report(rc == 0, "config_parallel_ep_cp_accepted", "exit %d: %s", rc, err);
    /* MoE under cp, with a capacity too (model.c: a chunk keeps what the earlier chunks leave) */
    rc = load_child(write_yaml("cp_moe.yaml", MOE4 "    capacity_factor: 1.25\nparallel:\n  cp: 2\n"), NULL, 0, err,
                    sizeof err);
    test_report(rc == 0, "config_parallel_cp_moe_accepted", "exit %d: %s", rc, err);
    expect_yaml_fail("config_parallel_ep_zero2", MOE4 "parallel:\n  ep: 2\n  zero: 2\n", "bad.yaml:9:",
                     "key 'parallel.zero'", "ZeRO 0 or 1");
    /* with a pipeline: each micro-batch in flight keeps its own dispatch (ep.c) */
    rc = load_child(write_yaml("ep_pp.yaml", MOE4 "parallel:\n  ep: 2\n  pp: 2\n"), NULL, 0, err, sizeof err);
    test_report(rc == 0, "config_parallel_ep_pp_accepted", "exit %d: %s", rc, err);
    /* Muon and Adafactor run under ep (their experts' owners and statistics over EDP): no refusal */
    const char *ep_optims[] = {"muon", "adafactor"};
    for (int i = 0; i < 2; i++) {
        char yaml[512], name[64];
        snprintf(yaml, sizeof yaml, MOE4 "parallel:\n  ep: 2\n  zero: 1\noptim:\n  name: %s\n", ep_optims[i]);
        snprintf(name, sizeof name, "config_parallel_ep_%s", ep_optims[i]);
        rc = load_child(write_yaml("ep_optim.yaml", yaml), NULL, 0, err, sizeof err);
        test_report(rc == 0, name, "exit %d: %s", rc, err);
    }
#undef MOE4
}

static void test_sets(void) {
    const char *sets[] = {"optim.betas=[0.9,0.999]", "device=cpu", "optim.lr=3e-4", "run.name=foo",
                          "optim.decay_embeddings=no", "batch.total_tokens=4096", "data.val=\"\"",
                          "parallel.dp=auto"};
    Config c;
    cfg_load(&c, write_yaml("base.yaml", "optim: {lr: 0.01}\ndata: {val: v.bin}\n"), sets, 8);
    int ok = c.beta1 == 0.9f && c.beta2 == 0.999f && !strcmp(c.device, "cpu") && c.lr == 3e-4f &&
             !strcmp(c.run_name, "foo") && !strcmp(c.run_dir, "runs/foo") && c.decay_embeddings == 0 &&
             c.total_tokens == 4096 && c.grad_accum == 2 && c.val_glob[0] == 0 && c.dp == 0;
    test_report(ok, "config_set_overrides", "--set values not applied over the file (lr %g, device %s)",
                (double)c.lr, c.device);

    const char *bad[] = {"optim.lr=fast"};
    expect_fail("config_set_bad_type", NULL, bad, 1, "--set: key 'optim.lr'", "expected a number", "got 'fast'",
                (const char *)NULL);
    const char *noeq[] = {"optim.lr"};
    expect_fail("config_set_no_equals", NULL, noeq, 1, "--set", "'optim.lr'", "'='", (const char *)NULL);
    const char *typo[] = {"optim.lrr=1"};
    expect_fail("config_set_unknown", NULL, typo, 1, "--set", "unknown key 'optim.lrr'", "did you mean 'optim.lr'?",
                (const char *)NULL);
    const char *section[] = {"optim=0.1"};
    expect_fail("config_set_section", NULL, section, 1, "--set", "'optim' is a section", "optim.name",
                (const char *)NULL);
    const char *empty[] = {"optim.lr="};
    expect_fail("config_set_empty", NULL, empty, 1, "--set: key 'optim.lr'", "got an empty value",
                (const char *)NULL);
    const char *range[] = {"model.n_layer=2000"};
    expect_fail("config_set_range", NULL, range, 1, "--set: key 'model.n_layer'", "[1, 1024]", (const char *)NULL);
    const char *cross[] = {"batch.micro_batch=3"};
    expect_fail("config_set_cross_check", NULL, cross, 1, "--set: key 'batch.total_tokens'", "= 768",
                (const char *)NULL);
}

/* precision.attention_deterministic false changes only cuDNN's backward: one
 * line, exit 2, naming why, wherever the config rules cuDNN out; loads with
 * attention auto on CUDA, where cuDNN may run. */
static void test_attention_deterministic(void) {
    static const struct {
        const char *name, *set, *set2, *why;
    } no[] = {
        {"cpu", "device=cpu", "device=cpu", "device: cpu"},
        {"fp32", "precision.compute=fp32", "device=cuda", "precision.compute: fp32"},
        {"simt", "precision.attention=simt", "device=cuda", "precision.attention: simt"},
        {"tensor_cores", "precision.attention=tensor_cores", "device=cuda", "precision.attention: tensor_cores"},
        {"grouped_kv", "model.n_kv_head=2", "model.arch=llama", "grouped K/V heads"},
        {"doc_masking", "data.doc_masking=true", "data.eot_id=10", "data.doc_masking"},
        {"cp", "parallel.cp=2", "device=cuda", "parallel.cp > 1"},
    };
    char name[96];
    for (size_t i = 0; i < sizeof no / sizeof no[0]; i++) {
        const char *sets[] = {"precision.attention_deterministic=false", no[i].set, no[i].set2};
        snprintf(name, sizeof name, "config_attention_deterministic_refused_%s", no[i].name);
        expect_fail(name, NULL, sets, 3, "key 'precision.attention_deterministic'", no[i].why, "set it to true",
                    (const char *)NULL);
    }
    const char *ok[] = {"precision.attention_deterministic=false", "device=cuda"};
    Config c;
    cfg_load(&c, NULL, ok, 2);
    test_report(c.attention_deterministic == 0, "config_attention_deterministic_false_cuda_auto", "not taken");
}

static void write_config(const Config *c, const char *path) {
    FILE *f = fopen(path, "w");
    if (!f) { perror(path); exit(1); }
    cfg_write_yaml(c, f);
    fclose(f);
}

static void test_round_trip(void) {
    Config a, b, d;
    cfg_load(&a, write_yaml("full.yaml", full_yaml), NULL, 0);
    write_config(&a, tmp_path("resolved.yaml"));
    cfg_load(&b, tmp_path("resolved.yaml"), NULL, 0);
    test_report(!memcmp(&a, &b, sizeof a), "config_round_trip", "reloading cfg_write_yaml output changed the config");

    /* awkward floats: the shortest form must still read back to the same bits */
    const char *sets[] = {"optim.lr=0.1", "optim.eps=1.17549435e-38", "optim.betas=[0.33333334, 0.99999994]",
                          "train.sample_temperature=0.7", "run.name=\"a\\nb\\x01c\""};
    cfg_load(&a, NULL, sets, 5);
    write_config(&a, tmp_path("resolved2.yaml"));
    cfg_load(&b, tmp_path("resolved2.yaml"), NULL, 0);
    test_report(!memcmp(&a, &b, sizeof a), "config_round_trip_floats", "lr %.9g vs %.9g, eps %.9g vs %.9g",
                (double)a.lr, (double)b.lr, (double)a.eps, (double)b.eps);

    const char *other[] = {"optim.lr=0.0007"};
    cfg_load(&d, NULL, other, 1);
    cfg_load(&b, NULL, NULL, 0);
    test_report(d.hash != b.hash && b.hash != 0, "config_hash_tracks_values", "hash %llx vs %llx",
                (unsigned long long)d.hash, (unsigned long long)b.hash);

    char *text = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&text, &len);
    cfg_write_yaml(&b, m);
    fclose(m);
    test_report(text && strstr(text, "# padded_vocab: 256") && strstr(text, "# grad_accum: 8") &&
                    strstr(text, "\ndevice: auto\n") && strstr(text, "  betas: [0.9, 0.95]\n") &&
                    b.hash == kiln_fnv1a(text, len, KILN_FNV_INIT),
                "config_yaml_shape", "resolved YAML lacks derived comments/keys or hash mismatch:\n%s", text);
    free(text);
}

static char *doc_text(size_t *len) {
    char *text = NULL;
    FILE *m = open_memstream(&text, len);
    cfg_write_doc(m);
    fclose(m);
    return text;
}

static void test_doc(void) {
    size_t want_len, have_len = 0;
    char *want = doc_text(&want_len), *have = kiln_read_file("docs/config.md", &have_len);
    test_report(have && have_len == want_len && !memcmp(have, want, want_len), "config_doc_current",
                "docs/config.md differs from cfg_write_doc(); regenerate: ./train config-doc > docs/config.md");
    test_report(strstr(want, "`optim.lr`") && strstr(want, "`--set") && strstr(want, "| key | type | default"),
                "config_doc_content", "doc lacks keys, --set or table header");
    free(want);
    free(have);
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--write-doc")) {
        size_t len;
        char *text = doc_text(&len);
        if (kiln_write_file_atomic("docs/config.md", text, len)) { perror("docs/config.md"); return 1; }
        printf("wrote docs/config.md (%zu bytes)\n", len);
        free(text);
        return 0;
    }
    const char *t = getenv("KILN_TEST_TMP");
    snprintf(tmp_dir, sizeof tmp_dir, "%s/config.%d", t && *t ? t : "/tmp", (int)getpid());
    kiln_mkdirs(tmp_dir);
    test_defaults();
    test_full_file();
    test_file_errors();
    test_type_errors();
    test_cross_errors();
    test_sets();
    test_attention_deterministic();
    test_round_trip();
    test_doc();
    return 0;
}
