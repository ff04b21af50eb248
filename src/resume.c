/* resume: which checkpoint to continue from, and whether this config may
 * continue it. The policy table below is the one place that says which keys
 * may change across a resume. */
#include "resume.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

typedef enum {
    KEY_ALLOW,    /* changes are reported; the continuation is what the new value says */
    KEY_NOTE,     /* allowed, but the CPU run is then no longer bit-identical to an uninterrupted one */
    KEY_FORCE,    /* refused unless --force; forcing is well defined (see why) */
    KEY_NEVER     /* refused: the saved state cannot mean anything under the new value */
} KeyPolicy;

/* First match wins; a trailing '*' matches any rest. Keys not listed are
 * KEY_FORCE: a new key is refused until someone decides, never silently taken. */
static const struct {
    const char *pat;
    KeyPolicy p;
    const char *why;
} resume_rules[] = {
    {"model.recompute", KEY_ALLOW,
     "memory only: the backward recomputes what it no longer keeps, to the bit (without GeLU fusion)"},
    {"model.recompute_every", KEY_ALLOW, "memory only: which layers block checkpoints, to the bit"},
    {"model.loss_chunk", KEY_NOTE,
     "memory: the head in chunks; the losses are the same, its weight gradient sums the rows in another grouping"},
    {"model.*", KEY_NEVER, "the parameter shapes and the function they compute"},
    {"data.tokenizer*", KEY_NEVER, "token ids would mean different text"},
    {"run.seed", KEY_NEVER, "the data order of the current epoch is drawn from it"},
    {"optim.name", KEY_NEVER, "the optimizer state belongs to the saved optimizer"},
    {"data.train", KEY_FORCE,
     "with --force each source still in data.train continues from its saved position (matched by name), a new one "
     "starts at its beginning, and the blend restarts there with the new weights"},
    {"data.doc_*", KEY_FORCE,
     "the same batches, but another function of them (attention across documents, positions); with --force the "
     "run continues under the new setting"},
    {"data.eot_id", KEY_FORCE, "documents end at another id; with --force the run continues with it"},
    {"data.prefetch", KEY_ALLOW, "the same batches, read ahead or not"},
    {"data.max_open_shards", KEY_ALLOW, "the same batches, with more or fewer shards open"},
    {"batch.total_tokens", KEY_FORCE,
     "with --force the sample stream continues from the saved position in steps of the new size"},
    {"batch.micro_batch", KEY_NOTE, "the same samples per step, summed in a different grouping"},
    {"run.threads", KEY_NOTE, "floating-point sums are split differently"},
    {"device", KEY_NOTE, "another backend rounds differently"},
    {"precision.attention", KEY_ALLOW, "GPU attention kernels only: the CPU backend ignores it"},
    {"precision.attention_deterministic", KEY_ALLOW,
     "cuDNN's attention backward only: the sums of dQ in a fixed order or not (not bit-identical either way)"},
    {"precision.gelu_fusion", KEY_ALLOW, "GPU products only (GeLU fused or not): the CPU backend ignores it"},
    {"precision.optim_state", KEY_ALLOW,
     "checkpoints hold the moments in fp32: they load into either dtype (bf16 rounds them to nearest)"},
    {"precision.master", KEY_ALLOW,
     "checkpoints hold the parameters in fp32: they load into either dtype (bf16 rounds them to nearest; a bf16 "
     "run's own values load to the bit)"},
    {"precision.*", KEY_NOTE, "another precision rounds differently"},
    {"parallel.timeout_s", KEY_ALLOW, NULL},
    {"parallel.*", KEY_NOTE, "the state is resharded onto the new mesh"},
    {"run.name", KEY_ALLOW, NULL},
    {"run.dir", KEY_ALLOW, NULL},
    {"data.val", KEY_ALLOW, NULL},
    {"train.*", KEY_ALLOW, NULL},
    {"optim.*", KEY_ALLOW, NULL},
    {"schedule.*", KEY_ALLOW, NULL},
    {"checkpoint.*", KEY_ALLOW, NULL},
    {"metrics.*", KEY_ALLOW, NULL},
    {"monitor.*", KEY_ALLOW, NULL},
    {"init.from", KEY_ALLOW, "ignored on resume: the checkpoint's weights are loaded"},
};

/* Keys added after checkpoints were written, with the value that gives
 * those checkpoints' runs: a checkpoint without the key resumes under that
 * value as if unchanged. */
static const struct {
    const char *key, *before;
} resume_absent[] = {
    {"data.doc_masking", "false"},
    {"data.doc_positions", "continue"},
    {"data.eot_id", "-1"},
    {"precision.attention_deterministic", "true"},
};
static int absent_as(const char *key, const char *now) {
    for (size_t i = 0; i < sizeof resume_absent / sizeof resume_absent[0]; i++)
        if (!strcmp(resume_absent[i].key, key)) return now && !strcmp(resume_absent[i].before, now);
    return 0;
}

static int rule_of(const char *key) {
    int n = (int)(sizeof resume_rules / sizeof resume_rules[0]);
    for (int i = 0; i < n; i++) {
        const char *p = resume_rules[i].pat;
        size_t l = strlen(p);
        if (p[l - 1] == '*' ? !strncmp(key, p, l - 1) : !strcmp(key, p)) return i;
    }
    return -1;
}

/* The resolved YAML (cfg_write_yaml) as "section.key" (or, for a block
 * indented under a section such as model.moe, "section.block.key") -> value
 * text. cfg_write_yaml indents by two spaces per level. */
typedef struct {
    char key[128];
    char *val;
} KV;

static int parse_resolved(char *text, KV **out) {
    int n = 0, cap = 0;
    KV *v = NULL;
    char section[64] = "", block[64] = "";
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        size_t indent = strspn(line, " ");
        char *s = line + indent;
        if (*s == '#' || !*s) continue;
        char *colon = strstr(s, ":");
        if (!colon) continue;
        *colon = 0;
        char *val = colon[1] == ' ' ? colon + 2 : colon + 1;
        if (!*val && indent < 4) { /* "section:" or "  block:" */
            kiln_strlcpy(indent ? block : section, s, indent ? sizeof block : sizeof section);
            if (!indent) block[0] = 0;
            continue;
        }
        if (indent < 4) block[0] = 0; /* a key after a block ends it */
        if (n == cap) cap = cap ? 2 * cap : 64, v = xrealloc(v, (size_t)cap * sizeof *v);
        if (indent >= 4) snprintf(v[n].key, sizeof v[n].key, "%s.%s.%s", section, block, s);
        else if (indent) snprintf(v[n].key, sizeof v[n].key, "%s.%s", section, s);
        else snprintf(v[n].key, sizeof v[n].key, "%s", s);
        v[n++].val = val;
    }
    *out = v;
    return n;
}

static const char *kv_get(KV *v, int n, const char *key) {
    for (int i = 0; i < n; i++)
        if (!strcmp(v[i].key, key)) return v[i].val;
    return NULL;
}

int resume_check_config(const char *ckpt_dir, const char *saved_yaml, const char *new_yaml, int force, int quiet) {
    char *a = xstrdup(saved_yaml), *b = xstrdup(new_yaml);
    KV *va, *vb;
    int na = parse_resolved(a, &va), nb = parse_resolved(b, &vb), flags = 0;
    for (int pass = 0; pass < 2; pass++) {
        /* pass 0: keys of this run (changed or new); pass 1: keys only the checkpoint has */
        KV *v = pass ? va : vb;
        int n = pass ? na : nb;
        for (int i = 0; i < n; i++) {
            const char *key = v[i].key;
            const char *old = pass ? v[i].val : kv_get(va, na, key), *now = pass ? kv_get(vb, nb, key) : v[i].val;
            if (pass && now) continue;
            if (old && now && !strcmp(old, now)) continue;
            if (!old && absent_as(key, now)) continue; /* the key is newer than the checkpoint */
            int r = rule_of(key);
            KeyPolicy p = r >= 0 ? resume_rules[r].p : KEY_FORCE;
            const char *why = r >= 0 ? resume_rules[r].why : "no resume rule for this key";
            char change[1200];
            snprintf(change, sizeof change, "'%s': %s -> %s", key, old ? old : "(absent)", now ? now : "(absent)");
            if (p == KEY_NEVER) {
                char hint[1200];
                snprintf(hint, sizeof hint,
                         "resume with the checkpoint's value, or start a new run (init.from=%s loads its weights only)",
                         ckpt_dir);
                kiln_fail_hint(KILN_EXIT_USAGE, hint, "%s: cannot resume with a changed key %s (%s)", ckpt_dir, change, why);
            }
            if (p == KEY_FORCE && !force) {
                char hint[512];
                snprintf(hint, sizeof hint, "--force accepts this change (%s)", why);
                kiln_fail_hint(KILN_EXIT_USAGE, hint, "%s: cannot resume with a changed key %s", ckpt_dir, change);
            }
            if (p == KEY_FORCE && !strcmp(key, "data.train")) flags |= RESUME_DATA_CHANGED;
            if (quiet) continue;
            if (p == KEY_FORCE) {
                kiln_warn("resume: --force: key %s (%s)", change, why);
            } else if (p == KEY_NOTE) {
                kiln_warn("resume: key %s changed: allowed, but no longer bit-identical to an uninterrupted run (%s)",
                          change, why);
            } else {
                printf("resume: key %s changed%s%s\n", change, why ? ": " : "", why ? why : "");
            }
        }
    }
    free(va), free(vb), free(a), free(b);
    return flags;
}

/* Check the config of `dir`, then load it. -1 with err if the checkpoint is
 * unreadable or corrupt; exits 2 if the config may not continue it. */
static int try_one(const char *dir, const CkptTable *t, const char *new_yaml, int force, CkptInfo *info, int *flags,
                   char *err, size_t cap, int rank, const ResumeCheck *check) {
    size_t len;
    char *saved = ckpt_read_blob(dir, "config.yaml", &len, err, cap);
    if (!saved) return -1;
    /* every rank checks (a refusal must stop every rank); rank 0 reports */
    *flags = resume_check_config(dir, saved, new_yaml, force, rank != 0);
    free(saved);
    if (ckpt_load(dir, t, info, err, cap) != 0) return -1;
    /* read after loading, outside the table (its size follows the saved
     * mixture; older checkpoints lack it): it must verify too, so that a
     * damaged one is skipped like any other damage */
    len = 0;
    void *data_state = ckpt_read_blob(dir, "data.train.state", &len, err, cap);
    int damaged = !data_state && !strstr(err, "no entry");
    if (!damaged) err[0] = 0;
    if (data_state && len % sizeof(uint64_t))
        damaged = 1, snprintf(err, cap, "%s: entry 'data.train.state' holds %zu bytes, not 64-bit words", dir, len);
    if (!damaged && check && check->check(check->ctx, dir, data_state, len / sizeof(uint64_t), err, cap) != 0)
        damaged = 1;
    free(data_state);
    return damaged ? -1 : 0;
}

static int agree(const ResumeSync *sync, int failed) { return sync ? sync->agree(sync->ctx, failed) : failed; }

int resume_load(const char *mode, const char *root, const CkptTable *t, const char *new_yaml, int force,
                CkptInfo *info, char *path, size_t cap, int *flags, const ResumeSync *sync, const ResumeCheck *check) {
    char err[2048] = "";
    *flags = 0;
    int rank = sync ? sync->rank : 0;
    if (strcmp(mode, "auto") != 0) {
        if (!ckpt_is_checkpoint(mode)) {
            kiln_fail_hint(KILN_EXIT_USAGE,
                           "--resume takes `auto` or a checkpoint directory such as runs/NAME/checkpoints/step_00001000",
                           "--resume %s: not a checkpoint directory (no manifest)", mode);
        }
        int failed = try_one(mode, t, new_yaml, force, info, flags, err, sizeof err, rank, check) != 0;
        if (agree(sync, failed))
            kiln_fail(KILN_EXIT_USAGE, "--resume %s: %s", mode, failed ? err : "loading failed on another rank");
        kiln_strlcpy(path, mode, cap);
        return 1;
    }
    char **paths = NULL;
    int64_t *steps = NULL;
    int n = rank == 0 ? ckpt_list_current(root, &paths, &steps) : 0, loaded = 0, dirty = 0;
    /* rank 0 names each candidate in turn ("" = no more), newest first,
     * starting from the one `latest` names */
    char cand[1200];
    for (int i = 0; !loaded; i++) {
        memset(cand, 0, sizeof cand);
        if (rank == 0 && i < n) kiln_strlcpy(cand, paths[i], sizeof cand);
        if (sync) sync->bcast(sync->ctx, cand, sizeof cand);
        if (!cand[0]) break;
        err[0] = 0;
        int failed = try_one(cand, t, new_yaml, force, info, flags, err, sizeof err, rank, check) != 0;
        if (!agree(sync, failed)) {
            kiln_strlcpy(path, cand, cap);
            loaded = 1;
        } else {
            dirty = 1;
            if (failed) kiln_warn("--resume auto: skipping %s: %s", cand, err);
            else if (rank == 0) kiln_warn("--resume auto: skipping %s: another rank could not load its part", cand);
        }
    }
    if (rank == 0) ckpt_list_free(paths, steps, n);
    if (dirty) *flags |= RESUME_DIRTY;
    if (!loaded && rank == 0) printf("resume: no complete checkpoint under %s; starting fresh\n", root);
    return loaded;
}
