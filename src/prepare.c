/* prepare: `./train prepare` reads text files, encodes them with the byte or GPT-2
 * tokenizer, splits off the last val-fraction of tokens as validation data and
 * writes DIR/train_NNNNNN.bin and DIR/val_NNNNNN.bin (.bin.zst with --zstd).
 * Owns that command line only; must never train or touch the model. */
#include "prepare.h"
#include "shard.h"
#include "tokenizer.h"
#include "util.h"

#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zstd.h>

#define PREPARE_DEFAULT_VOCAB "data/cache/gpt2.tiktoken"

static const char *prepare_usage =
    "usage: ./train prepare --tokenizer byte|gpt2 [--vocab FILE] --out DIR\n"
    "                       [--val-fraction F] [--shard-tokens N] [--zstd LEVEL] FILE...\n"
    "\n"
    "Encode text FILEs into token shards for data.train / data.val:\n"
    "  DIR/train_000000.bin, train_000001.bin, ...   (the first 1-F of all tokens)\n"
    "  DIR/val_000000.bin, ...                       (the last F of all tokens)\n"
    "\n"
    "  --tokenizer byte|gpt2  byte: 256 ids, one per byte (model.vocab_size: 256);\n"
    "                         gpt2: GPT-2 BPE, vocab 50257 (model.vocab_size: 50257);\n"
    "                         each FILE is one document and starts with <|endoftext|>\n"
    "  --vocab FILE           gpt2 ranks in tiktoken format (default " PREPARE_DEFAULT_VOCAB ";\n"
    "                         scripts/fetch_gpt2_vocab.sh puts it there)\n"
    "  --out DIR              output directory (created); stale shards of an earlier,\n"
    "                         longer run in DIR are removed\n"
    "  --val-fraction F       share of tokens for validation, 0 <= F < 1 (default 0.05)\n"
    "  --shard-tokens N       tokens per shard (default 100000000)\n"
    "  --zstd LEVEL           compress shards with zstd LEVEL 1..22 (.bin.zst; default off)\n"
    "\n"
    "Example: ./train prepare --tokenizer byte --out data/austen --val-fraction 0.05 "
    "data/austen.txt\n";

#define prepare_fail(fmt, ...) \
    kiln_fail_hint(KILN_EXIT_USAGE, "./train prepare --help", "prepare: " fmt, ##__VA_ARGS__)

typedef struct PrepareArgs {
    const char *tokenizer, *vocab, *out;
    double val_fraction;
    long long shard_tokens;
    int zstd;
    char **files;
    int n_files;
} PrepareArgs;

/* "--name VALUE" or "--name=VALUE"; returns the value or NULL if argv[*i] is not --name. */
static const char *prepare_opt(int argc, char **argv, int *i, const char *name) {
    size_t n = strlen(name);
    const char *a = argv[*i];
    if (strncmp(a, name, n) != 0) return NULL;
    if (a[n] == '=') return a + n + 1;
    if (a[n] != '\0') return NULL;
    if (*i + 1 >= argc) prepare_fail("%s needs a value", name);
    return argv[++*i];
}

static long long prepare_int(const char *name, const char *v, long long lo, long long hi) {
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (end == v || *end || errno || x < lo || x > hi)
        prepare_fail("%s: expected an integer in [%lld, %lld], got '%s'", name, lo, hi, v);
    return x;
}

static void prepare_parse(int argc, char **argv, PrepareArgs *a) {
    memset(a, 0, sizeof *a);
    a->val_fraction = 0.05;
    a->shard_tokens = 100000000;
    a->files = xcalloc((size_t)argc, sizeof(char *));
    for (int i = 1; i < argc; i++) {
        const char *v;
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            fputs(prepare_usage, stdout);
            exit(KILN_EXIT_OK);
        } else if ((v = prepare_opt(argc, argv, &i, "--tokenizer"))) {
            if (strcmp(v, "byte") != 0 && strcmp(v, "gpt2") != 0)
                prepare_fail("--tokenizer: expected byte or gpt2, got '%s'", v);
            a->tokenizer = v;
        } else if ((v = prepare_opt(argc, argv, &i, "--vocab"))) {
            a->vocab = v;
        } else if ((v = prepare_opt(argc, argv, &i, "--out"))) {
            a->out = v;
        } else if ((v = prepare_opt(argc, argv, &i, "--val-fraction"))) {
            char *end;
            errno = 0;
            a->val_fraction = strtod(v, &end);
            if (end == v || *end || errno || !(a->val_fraction >= 0.0 && a->val_fraction < 1.0))
                prepare_fail("--val-fraction: expected a number in [0, 1), got '%s'", v);
        } else if ((v = prepare_opt(argc, argv, &i, "--shard-tokens"))) {
            a->shard_tokens = prepare_int("--shard-tokens", v, 1, INT32_MAX);
        } else if ((v = prepare_opt(argc, argv, &i, "--zstd"))) {
            a->zstd = (int)prepare_int("--zstd", v, 0, ZSTD_maxCLevel());
        } else if (strcmp(argv[i], "--") == 0) {
            while (++i < argc) a->files[a->n_files++] = argv[i];
        } else if (argv[i][0] == '-' && argv[i][1] != '\0') {
            prepare_fail("unknown option '%s'", argv[i]);
        } else {
            a->files[a->n_files++] = argv[i];
        }
    }
    if (!a->tokenizer) prepare_fail("--tokenizer byte|gpt2 is required");
    if (!a->out) prepare_fail("--out DIR is required");
    if (a->n_files == 0) prepare_fail("no input FILE given");
    if (a->vocab && strcmp(a->tokenizer, "byte") == 0)
        prepare_fail("--vocab is for --tokenizer gpt2; the byte tokenizer needs no file");
    if (!a->vocab && strcmp(a->tokenizer, "gpt2") == 0) a->vocab = PREPARE_DEFAULT_VOCAB;
}

static void prepare_shard_path(char *buf, size_t n, const char *dir, const char *split, long k,
                               int zstd) {
    if (snprintf(buf, n, "%s/%s_%06ld.bin%s", dir, split, k, zstd ? ".zst" : "") >= (int)n)
        prepare_fail("--out: path too long: '%s'", dir);
}

/* Write tokens[0..n) as split_000000.bin, ... and remove what an earlier run left
 * under the same names (higher indices, or the other compression), so that a glob
 * like DIR/train_* never mixes two preparations. Returns the shard count. */
static long prepare_write_split(const PrepareArgs *a, const char *split, const uint32_t *tokens,
                                size_t n) {
    char path[4096];
    long k = 0;
    for (size_t at = 0; at < n; at += (size_t)a->shard_tokens, k++) {
        size_t m = n - at < (size_t)a->shard_tokens ? n - at : (size_t)a->shard_tokens;
        prepare_shard_path(path, sizeof path, a->out, split, k, a->zstd);
        shard_write(path, tokens + at, m, a->zstd);
        printf("wrote %s: %zu tokens\n", path, m);
    }
    for (long j = 0;; j++) {
        int any = 0;
        for (int z = 0; z <= 1; z++) {
            if (j < k && z == (a->zstd > 0)) continue; /* just written */
            prepare_shard_path(path, sizeof path, a->out, split, j, z);
            if (access(path, F_OK) == 0) {
                if (unlink(path) != 0)
                    kiln_fail(KILN_EXIT_RUNTIME, "cannot remove stale shard %s: %s", path,
                              strerror(errno));
                printf("removed stale %s\n", path);
                any = 1;
            }
        }
        if (j >= k && !any) break;
    }
    return k;
}

int prepare_main(int argc, char **argv) {
    PrepareArgs a;
    prepare_parse(argc, argv, &a);
    Tokenizer *tok = tok_open(a.tokenizer, a.vocab);
    int eot = tok_eot(tok);

    /* (n) every token of every file, in argument order. */
    uint32_t *ids = NULL;
    size_t n = 0, cap = 0, bytes = 0;
    double t0 = kiln_now();
    for (int f = 0; f < a.n_files; f++) {
        size_t len;
        char *text = kiln_read_file(a.files[f], &len);
        if (!text) {
            fflush(stdout);
            fprintf(stderr, "kiln: error: prepare: %s: cannot read: %s\n", a.files[f], strerror(errno));
            exit(KILN_EXIT_USAGE);
        }
        size_t before = n;
        /* llm.c's convention: every document starts with <|endoftext|>, so the model
         * learns where documents begin and the first one looks like the others. */
        if (eot >= 0) {
            if (n == cap) {
                cap = cap ? cap * 2 : 1 << 16;
                ids = xrealloc(ids, cap * sizeof(uint32_t));
            }
            ids[n++] = (uint32_t)eot;
        }
        tok_encode(tok, text, len, &ids, &n, &cap);
        printf("%s: %zu bytes -> %zu tokens\n", a.files[f], len, n - before);
        bytes += len;
        free(text);
    }
    double dt = kiln_now() - t0;

    size_t n_val = (size_t)((double)n * a.val_fraction + 0.5);
    if (a.val_fraction > 0 && n_val == 0) n_val = n > 1 ? 1 : 0;
    size_t n_train = n - n_val;
    if (n_train == 0) prepare_fail("no training tokens: the input is empty or --val-fraction too large");
    if (kiln_mkdirs(a.out) != 0)
        kiln_fail(KILN_EXIT_RUNTIME, "prepare: cannot create --out %s: %s", a.out, strerror(errno));
    long k_train = prepare_write_split(&a, "train", ids, n_train);
    long k_val = prepare_write_split(&a, "val", ids + n_train, n_val);
    printf("prepare: %s tokenizer (vocab %d), %zu bytes -> %zu tokens in %.2f s\n", a.tokenizer,
           tok_vocab_size(tok), bytes, n, dt);
    printf("prepare: train %zu tokens in %ld shard(s), val %zu tokens in %ld shard(s) "
           "(the last %.1f%%)\n", n_train, k_train, n_val, k_val, 100.0 * a.val_fraction);
    free(ids);
    free(a.files);
    tok_free(tok);
    return KILN_EXIT_OK;
}
