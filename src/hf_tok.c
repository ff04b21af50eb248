/* hf_tok: GPT-2's BPE as HuggingFace's tokenizer files (vocab.json,
 * merges.txt, tokenizer_config.json, special_tokens_map.json) from kiln's
 * tiktoken rank file: the same ids, so HF's GPT2Tokenizer encodes as kiln
 * does. Reads the rank file through tokenizer.c; writes files, nothing else. */
#include "hf.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer.h"
#include "util.h"

/* GPT-2's byte-to-unicode table: printable bytes stand for themselves, the
 * others for code points 256 and up, so every token is a printable string. */
static void byte_chars(uint32_t cp_of[256]) {
    int is_print[256] = {0};
    for (int b = '!'; b <= '~'; b++) is_print[b] = 1;
    for (int b = 0xA1; b <= 0xAC; b++) is_print[b] = 1;
    for (int b = 0xAE; b <= 0xFF; b++) is_print[b] = 1;
    int n = 0;
    for (int b = 0; b < 256; b++) cp_of[b] = is_print[b] ? (uint32_t)b : (uint32_t)(256 + n++);
}

/* A token's bytes as GPT-2's unicode string, JSON-escaped (quote, backslash). */
static void put_token(FILE *f, const uint32_t cp_of[256], const unsigned char *s, size_t n, int json) {
    for (size_t i = 0; i < n; i++) {
        uint32_t cp = cp_of[s[i]];
        if (json && (cp == '"' || cp == '\\')) fputc('\\', f);
        if (cp < 0x80) fputc((int)cp, f);
        else fputc((int)(0xC0 | cp >> 6), f), fputc((int)(0x80 | (cp & 63)), f); /* cp < 0x800 */
    }
}

/* bytes -> rank: open addressing over the token strings. */
typedef struct {
    const unsigned char **key;
    uint32_t *len, *rank;
    size_t cap;
} RankMap;

static uint64_t hash(const unsigned char *s, size_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 1099511628211ULL;
    return h;
}

static void map_put(RankMap *m, const unsigned char *s, uint32_t n, uint32_t rank) {
    for (size_t i = hash(s, n) % m->cap;; i = (i + 1) % m->cap)
        if (!m->key[i]) {
            m->key[i] = s, m->len[i] = n, m->rank[i] = rank;
            return;
        }
}

static int64_t map_get(const RankMap *m, const unsigned char *s, size_t n) {
    for (size_t i = hash(s, n) % m->cap; m->key[i]; i = (i + 1) % m->cap)
        if (m->len[i] == n && !memcmp(m->key[i], s, n)) return m->rank[i];
    return -1;
}

/* dir/name = text; nonzero on failure. */
static int write_small(const char *dir, const char *name, const char *text) {
    char path[1300];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    if (!f) return 1;
    int bad = fputs(text, f) < 0;
    return fclose(f) != 0 || bad;
}

int hf_write_gpt2_tokenizer(const char *dir, const char *rank_file, int max_len) {
    Tokenizer *t = tok_open("gpt2", rank_file);
    int V = tok_vocab_size(t), eot = tok_eot(t), n = eot; /* mergeable tokens: ids 0 .. eot-1 */
    unsigned char **bytes = xcalloc((size_t)n, sizeof *bytes);
    uint32_t *len = xcalloc((size_t)n, sizeof *len);
    char buf[256];
    RankMap m = {NULL, NULL, NULL, (size_t)n * 2 + 1};
    m.key = xcalloc(m.cap, sizeof *m.key), m.len = xcalloc(m.cap, sizeof *m.len), m.rank = xcalloc(m.cap, sizeof *m.rank);
    for (int id = 0; id < n; id++) {
        size_t k = tok_decode(t, (uint32_t)id, buf, sizeof buf);
        if (k == 0 || k > sizeof buf) kiln_fail(KILN_EXIT_USAGE, "%s: token %d is empty or too long", rank_file, id);
        bytes[id] = xmalloc(k), memcpy(bytes[id], buf, k), len[id] = (uint32_t)k;
        map_put(&m, bytes[id], (uint32_t)k, (uint32_t)id);
    }
    uint32_t cp_of[256];
    byte_chars(cp_of);
    char path[1300];
    snprintf(path, sizeof path, "%s/vocab.json", dir);
    FILE *fv = fopen(path, "w");
    snprintf(path, sizeof path, "%s/merges.txt", dir);
    FILE *fm = fopen(path, "w");
    if (!fv || !fm) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot create the tokenizer files: %s", dir, strerror(errno));
    fputc('{', fv);
    fprintf(fm, "#version: 0.2\n");
    /* A token of rank r > 255 is the merge of the two parts that BPE with the
     * ranks below r leaves of its bytes (tiktoken's merge order). */
    size_t *part = xmalloc(sizeof(buf) * sizeof(size_t) + sizeof(size_t));
    for (int id = 0; id < n; id++) {
        fputc(id ? ',' : '"', fv);
        if (id) fputc('"', fv);
        put_token(fv, cp_of, bytes[id], len[id], 1);
        fprintf(fv, "\":%d", id);
        if (len[id] == 1) continue;
        int np = (int)len[id]; /* parts as start offsets; part[np] = the end */
        for (int i = 0; i <= np; i++) part[i] = (size_t)i;
        for (;;) {
            int64_t best = -1;
            int at = -1;
            for (int i = 0; i + 1 < np; i++) {
                int64_t r = map_get(&m, bytes[id] + part[i], part[i + 2] - part[i]);
                if (r >= 0 && r < id && (best < 0 || r < best)) best = r, at = i;
            }
            if (at < 0) break;
            memmove(part + at + 1, part + at + 2, (size_t)(np - at - 1) * sizeof *part);
            np--;
        }
        if (np != 2)
            kiln_fail(KILN_EXIT_USAGE, "%s: token %d is not the merge of two lower-ranked tokens (%d parts): not a "
                      "GPT-2-style BPE rank file", rank_file, id, np);
        put_token(fm, cp_of, bytes[id], part[1], 0);
        fputc(' ', fm);
        put_token(fm, cp_of, bytes[id] + part[1], part[2] - part[1], 0);
        fputc('\n', fm);
    }
    fprintf(fv, ",\"<|endoftext|>\":%d}", eot);
    int bad = fclose(fv) != 0;
    bad |= fclose(fm) != 0;
    const char *special = "\"bos_token\": \"<|endoftext|>\",\n  \"eos_token\": \"<|endoftext|>\",\n"
                          "  \"unk_token\": \"<|endoftext|>\"";
    char text[512];
    snprintf(text, sizeof text, "{\n  \"tokenizer_class\": \"GPT2Tokenizer\",\n  \"model_max_length\": %d,\n"
             "  \"add_prefix_space\": false,\n  %s\n}\n", max_len, special);
    bad |= write_small(dir, "tokenizer_config.json", text);
    snprintf(text, sizeof text, "{\n  %s\n}\n", special);
    bad |= write_small(dir, "special_tokens_map.json", text);
    if (bad) kiln_fail(KILN_EXIT_RUNTIME, "%s: writing the tokenizer files failed: %s", dir, strerror(errno));
    for (int id = 0; id < n; id++) free(bytes[id]);
    free(bytes), free(len), free(part), free(m.key), free(m.len), free(m.rank);
    tok_free(t);
    return V;
}
