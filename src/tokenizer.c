/* tokenizer: the byte-level vocabulary and GPT-2's byte-level BPE (tiktoken rank
 * file, GPT-2 pre-tokenisation regex written out by hand, merges by rank).
 * Owns text -> ids -> bytes; must never touch shards, the model or the network. */
#include "tokenizer.h"
#include "util.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

enum { TOK_BYTE = 1, TOK_GPT2 = 2 };

#define TOK_EOT_TEXT "<|endoftext|>"
#define TOK_GPT2_RANKS 50256
/* Ranks above this cannot be a real vocabulary; it also bounds the tables. */
#define TOK_MAX_RANKS (1 << 22)
/* A rank file is about 16 bytes a rank (GPT-2's: 835 KB): far below this. */
#define TOK_MAX_FILE ((size_t)64 << 20)

struct Tokenizer {
    int kind;            /* TOK_BYTE or TOK_GPT2 */
    int n_ranks;         /* gpt2: 50256 mergeable tokens, ids 0..n_ranks-1 */
    int vocab_size;      /* 256, or n_ranks + 1 (<|endoftext|> = n_ranks) */
    int eot;             /* -1 for byte */
    char *pool;          /* (total bytes) every token's bytes, back to back */
    uint32_t *off;       /* (n_ranks + 1) token id's bytes are pool[off[id] .. off[id+1]) */
    uint32_t *slots;     /* (mask + 1) open-addressing hash: id + 1, 0 = empty */
    uint32_t mask;
    int byte_rank[256];  /* id of each single byte */
};

#define tok_fail(hint, ...) kiln_fail_hint(KILN_EXIT_USAGE, (hint), __VA_ARGS__)

/* ---- hash table: token bytes -> rank ------------------------------------- */

static uint32_t tok_hash(const unsigned char *s, size_t n) {
    uint64_t h = kiln_fnv1a(s, n, KILN_FNV_INIT);
    return (uint32_t)(h ^ (h >> 32));
}

/* Rank of the byte string s[0..n), or -1 if it is not a token. */
static int tok_lookup(const Tokenizer *t, const unsigned char *s, size_t n) {
    if (n == 1) return t->byte_rank[s[0]];
    uint32_t i = tok_hash(s, n) & t->mask;
    for (;;) {
        uint32_t v = t->slots[i];
        if (v == 0) return -1;
        uint32_t id = v - 1;
        if (t->off[id + 1] - t->off[id] == n && memcmp(t->pool + t->off[id], s, n) == 0)
            return (int)id;
        i = (i + 1) & t->mask;
    }
}

/* ---- loading a tiktoken rank file ---------------------------------------- */

static int tok_b64_value(int c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

/* Decode standard base64 (with '=' padding) into out; returns the byte count or -1. */
static long tok_b64_decode(const char *s, size_t n, unsigned char *out) {
    if (n == 0 || n % 4 != 0) return -1;
    long m = 0;
    for (size_t i = 0; i < n; i += 4) {
        int v[4], pad = 0;
        for (int k = 0; k < 4; k++) {
            if (s[i + k] == '=' && i + 4 == n && k >= 2) {
                v[k] = 0;
                pad++;
            } else {
                if (pad) return -1; /* data after padding */
                v[k] = tok_b64_value((unsigned char)s[i + k]);
                if (v[k] < 0) return -1;
            }
        }
        uint32_t w = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        out[m++] = (unsigned char)(w >> 16);
        if (pad < 2) out[m++] = (unsigned char)(w >> 8);
        if (pad < 1) out[m++] = (unsigned char)w;
    }
    return m;
}

static void tok_load_ranks(Tokenizer *t, const char *file) {
    static const char *hint = "scripts/fetch_gpt2_vocab.sh puts GPT-2's ranks at "
                              "data/cache/gpt2.tiktoken (lines of 'base64(token) rank')";
    size_t len;
    char *text = kiln_read_file_max(file, TOK_MAX_FILE, &len);
    if (!text) tok_fail(hint, "gpt2 vocabulary '%s': %s", file, kiln_strerror(errno));

    /* Pass 1: parse every line into (rank -> bytes) in a staging pool. */
    size_t n_lines = 0;
    for (size_t i = 0; i < len; i++) n_lines += text[i] == '\n';
    n_lines++;
    uint32_t *rank_of_line = xmalloc(n_lines * sizeof(uint32_t));
    uint32_t *line_off = xmalloc((n_lines + 1) * sizeof(uint32_t));
    unsigned char *stage = xmalloc(len + 1); /* decoded bytes are shorter than the text */
    size_t n_tok = 0, stage_n = 0, max_rank = 0;
    size_t line_no = 0;
    for (size_t p = 0; p < len;) {
        size_t e = p;
        while (e < len && text[e] != '\n') e++;
        line_no++;
        size_t le = e;
        if (le > p && text[le - 1] == '\r') le--;
        if (le > p) {
            const char *sp = memchr(text + p, ' ', le - p);
            long nb = sp ? tok_b64_decode(text + p, (size_t)(sp - (text + p)), stage + stage_n) : -1;
            char *end = NULL;
            errno = 0;
            long r = sp ? strtol(sp + 1, &end, 10) : -1;
            if (nb <= 0 || !sp || end == sp + 1 || end != text + le || errno || r < 0 ||
                r >= TOK_MAX_RANKS)
                tok_fail(hint, "%s:%zu: expected 'base64(token) rank', got '%.*s'", file,
                         line_no, (int)(le - p > 60 ? 60 : le - p), text + p);
            line_off[n_tok] = (uint32_t)stage_n;
            rank_of_line[n_tok] = (uint32_t)r;
            stage_n += (size_t)nb;
            if ((size_t)r > max_rank) max_rank = (size_t)r;
            n_tok++;
        }
        p = e + 1;
    }
    line_off[n_tok] = (uint32_t)stage_n;
    /* The pre-tokeniser is GPT-2's, so the ranks must be GPT-2's too: a short file
     * (cut-off download) would otherwise encode silently differently. */
    if (n_tok != TOK_GPT2_RANKS)
        tok_fail(hint, "%s: %zu ranks, but GPT-2 has %d (truncated or a different vocabulary?)",
                 file, n_tok, TOK_GPT2_RANKS);
    if (max_rank + 1 != n_tok)
        tok_fail(hint, "%s: ranks must be 0..%zu without gaps, but the largest is %zu", file,
                 n_tok - 1, max_rank);

    /* Pass 2: place tokens in rank order; every rank exactly once. */
    t->n_ranks = (int)n_tok;
    t->vocab_size = (int)n_tok + 1;
    t->eot = (int)n_tok;
    size_t *line_of_rank = xmalloc(n_tok * sizeof(size_t));
    for (size_t r = 0; r < n_tok; r++) line_of_rank[r] = SIZE_MAX;
    for (size_t k = 0; k < n_tok; k++) {
        uint32_t r = rank_of_line[k];
        if (line_of_rank[r] != SIZE_MAX)
            tok_fail(hint, "%s: rank %u appears twice (entries %zu and %zu)", file, r,
                     line_of_rank[r] + 1, k + 1);
        line_of_rank[r] = k;
    }
    t->pool = xmalloc(stage_n ? stage_n : 1);
    t->off = xmalloc((n_tok + 1) * sizeof(uint32_t));
    size_t pn = 0;
    for (size_t r = 0; r < n_tok; r++) {
        size_t k = line_of_rank[r];
        size_t nb = line_off[k + 1] - line_off[k];
        t->off[r] = (uint32_t)pn;
        memcpy(t->pool + pn, stage + line_off[k], nb);
        pn += nb;
    }
    t->off[n_tok] = (uint32_t)pn;

    /* Hash table at load factor <= 0.5 keeps probe chains short. */
    uint32_t cap = 1;
    while (cap < 2 * n_tok) cap <<= 1;
    t->mask = cap - 1;
    t->slots = xcalloc(cap, sizeof(uint32_t));
    for (int b = 0; b < 256; b++) t->byte_rank[b] = -1;
    for (size_t r = 0; r < n_tok; r++) {
        const unsigned char *s = (const unsigned char *)t->pool + t->off[r];
        size_t n = t->off[r + 1] - t->off[r];
        if (n == 1) {
            if (t->byte_rank[s[0]] >= 0)
                tok_fail(hint, "%s: byte 0x%02x has two ranks (%d and %zu)", file, s[0],
                         t->byte_rank[s[0]], r);
            t->byte_rank[s[0]] = (int)r;
            continue;
        }
        uint32_t i = tok_hash(s, n) & t->mask;
        while (t->slots[i]) {
            uint32_t o = t->slots[i] - 1;
            if (t->off[o + 1] - t->off[o] == n && memcmp(t->pool + t->off[o], s, n) == 0)
                tok_fail(hint, "%s: token of rank %zu duplicates rank %u", file, r, o);
            i = (i + 1) & t->mask;
        }
        t->slots[i] = (uint32_t)r + 1;
    }
    for (int b = 0; b < 256; b++)
        if (t->byte_rank[b] < 0)
            tok_fail(hint, "%s: byte 0x%02x has no rank; not a byte-level BPE vocabulary", file, b);

    free(line_of_rank);
    free(stage);
    free(line_off);
    free(rank_of_line);
    free(text);
}

Tokenizer *tok_open(const char *kind, const char *file) {
    Tokenizer *t = xcalloc(1, sizeof *t);
    if (strcmp(kind, "byte") == 0) {
        t->kind = TOK_BYTE;
        t->vocab_size = 256;
        t->eot = -1;
        for (int b = 0; b < 256; b++) t->byte_rank[b] = b;
        return t;
    }
    if (strcmp(kind, "gpt2") == 0) {
        if (!file || !*file)
            tok_fail("pass --vocab data/cache/gpt2.tiktoken (scripts/fetch_gpt2_vocab.sh fetches it)",
                     "tokenizer 'gpt2' needs a vocabulary file");
        t->kind = TOK_GPT2;
        tok_load_ranks(t, file);
        return t;
    }
    tok_fail("tokenizers: byte, gpt2", "unknown tokenizer '%s'", kind);
}

void tok_free(Tokenizer *t) {
    if (!t) return;
    free(t->slots);
    free(t->off);
    free(t->pool);
    free(t);
}

int tok_vocab_size(const Tokenizer *t) { return t->vocab_size; }
int tok_eot(const Tokenizer *t) { return t->eot; }

/* ---- pre-tokenisation: GPT-2's regex by hand ------------------------------ */
/* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * Alternatives are tried in order at each position, as the backtracking regex
 * engines of GPT-2 and tiktoken do; tok_next_piece returns where the match ends. */

/* Decode one UTF-8 code point at s[i] (i < n): its class, and its length in *len.
 * Invalid bytes count as one-byte "other" characters, so any input splits. */
static int tok_class_at(const unsigned char *s, size_t n, size_t i, size_t *len) {
    unsigned c = s[i];
    if (c < 0x80) {
        *len = 1;
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return TOK_CLASS_LETTER;
        if (c >= '0' && c <= '9') return TOK_CLASS_NUMBER;
        if (c == ' ' || (c >= 0x09 && c <= 0x0d)) return TOK_CLASS_SPACE;
        return TOK_CLASS_OTHER;
    }
    size_t k;
    uint32_t cp, min;
    if (c >= 0xc2 && c <= 0xdf) k = 2, cp = c & 0x1f, min = 0x80;
    else if (c >= 0xe0 && c <= 0xef) k = 3, cp = c & 0x0f, min = 0x800;
    else if (c >= 0xf0 && c <= 0xf4) k = 4, cp = c & 0x07, min = 0x10000;
    else goto invalid;
    if (i + k > n) goto invalid;
    for (size_t j = 1; j < k; j++) {
        if ((s[i + j] & 0xc0) != 0x80) goto invalid;
        cp = cp << 6 | (s[i + j] & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) goto invalid;
    *len = k;
    return tok_unicode_class(cp);
invalid:
    *len = 1;
    return TOK_CLASS_OTHER;
}

static size_t tok_next_piece(const unsigned char *s, size_t n, size_t i) {
    if (s[i] == '\'' && i + 1 < n) {
        unsigned c1 = s[i + 1];
        if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return i + 2;
        if (i + 2 < n) {
            unsigned c2 = s[i + 2];
            if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l'))
                return i + 3;
        }
    }
    size_t len, j = i;
    int cls = tok_class_at(s, n, i, &len);
    if (s[i] == ' ' && i + 1 < n) {
        /* " ?X+": a single space joins a following run of letters, digits or other. */
        size_t len1;
        int cls1 = tok_class_at(s, n, i + 1, &len1);
        if (cls1 != TOK_CLASS_SPACE) {
            cls = cls1;
            j = i + 1;
            len = len1;
        }
    }
    if (cls != TOK_CLASS_SPACE) {
        j += len;
        while (j < n) {
            if (tok_class_at(s, n, j, &len) != cls) break;
            j += len;
        }
        return j;
    }
    /* Whitespace run [i, j). "\s+(?!\S)" takes it all at the end of the text, else
     * gives back its last character (which then leads the next word as " word");
     * a single whitespace character before a non-space falls to plain "\s+". */
    size_t last = i;
    j = i + len;
    while (j < n) {
        size_t l;
        if (tok_class_at(s, n, j, &l) != TOK_CLASS_SPACE) break;
        last = j;
        j += l;
    }
    if (j == n || last == i) return j;
    return last;
}

/* ---- byte-pair merges within one piece ------------------------------------ */

static void tok_push(uint32_t **ids, size_t *n, size_t *cap, uint32_t id) {
    if (*n == *cap) {
        *cap = *cap ? *cap * 2 : 1024;
        *ids = xrealloc(*ids, *cap * sizeof(uint32_t));
    }
    (*ids)[(*n)++] = id;
}

/* Long pieces (a 1 MB run of one letter is one piece) would make the O(len^2) scan
 * below take hours, so they merge through a min-heap of (rank, position) with a
 * linked list of segments: the same merges in the same order, O(len log len). */
typedef struct {
    int rank;
    uint32_t pos;
} TokHeapItem;

static int tok_heap_less(TokHeapItem a, TokHeapItem b) {
    return a.rank < b.rank || (a.rank == b.rank && a.pos < b.pos);
}

static void tok_heap_push(TokHeapItem *h, size_t *n, TokHeapItem x) {
    size_t i = (*n)++;
    while (i > 0 && tok_heap_less(x, h[(i - 1) / 2])) {
        h[i] = h[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h[i] = x;
}

static TokHeapItem tok_heap_pop(TokHeapItem *h, size_t *n) {
    TokHeapItem top = h[0], x = h[--*n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && tok_heap_less(h[c + 1], h[c])) c++;
        if (!tok_heap_less(h[c], x)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = x;
    return top;
}

static void tok_bpe_long(const Tokenizer *t, const unsigned char *s, size_t n, uint32_t **ids,
                         size_t *nids, size_t *cap) {
    /* Segment starting at byte i (alive) ends at next[i]; rank[i] = rank of it joined
     * with the following segment (INT_MAX if none or not a token). */
    uint32_t *next = xmalloc(n * sizeof(uint32_t));
    int32_t *prev = xmalloc(n * sizeof(int32_t));
    int *rank = xmalloc(n * sizeof(int));
    TokHeapItem *heap = xmalloc(3 * n * sizeof(TokHeapItem)); /* n initial + 2 per merge */
    size_t hn = 0;
    for (size_t i = 0; i < n; i++) {
        next[i] = (uint32_t)i + 1;
        prev[i] = (int32_t)i - 1;
        int r = i + 1 < n ? tok_lookup(t, s + i, 2) : -1;
        rank[i] = r < 0 ? INT_MAX : r;
        if (r >= 0) tok_heap_push(heap, &hn, (TokHeapItem){r, (uint32_t)i});
    }
    while (hn > 0) {
        TokHeapItem it = tok_heap_pop(heap, &hn);
        uint32_t i = it.pos;
        /* Stale entry: the segment was absorbed (rank reset) or has grown since. Ranks
         * are unique per byte string, so a matching rank means the same pair. */
        if (rank[i] != it.rank) continue;
        uint32_t j = next[i];
        next[i] = next[j];
        rank[j] = INT_MAX;
        if (next[i] < n) prev[next[i]] = (int32_t)i;
        int r = next[i] < n ? tok_lookup(t, s + i, next[next[i]] - i) : -1;
        rank[i] = r < 0 ? INT_MAX : r;
        if (r >= 0) tok_heap_push(heap, &hn, (TokHeapItem){r, i});
        if (prev[i] >= 0) {
            uint32_t p = (uint32_t)prev[i];
            r = tok_lookup(t, s + p, next[i] - p);
            rank[p] = r < 0 ? INT_MAX : r;
            if (r >= 0) tok_heap_push(heap, &hn, (TokHeapItem){r, p});
        }
    }
    for (uint32_t i = 0; i < n; i = next[i])
        tok_push(ids, nids, cap, (uint32_t)tok_lookup(t, s + i, next[i] - i));
    free(heap);
    free(rank);
    free(prev);
    free(next);
}

/* Repeatedly merge the adjacent pair whose concatenation has the lowest rank
 * (leftmost on ties), like tiktoken's byte_pair_merge; O(len^2) for short pieces. */
static void tok_bpe_piece(const Tokenizer *t, const unsigned char *s, size_t n, uint32_t **ids,
                          size_t *nids, size_t *cap) {
    int whole = tok_lookup(t, s, n);
    if (whole >= 0) {
        tok_push(ids, nids, cap, (uint32_t)whole);
        return;
    }
    enum { SHORT = 128 };
    if (n >= SHORT) {
        tok_bpe_long(t, s, n, ids, nids, cap);
        return;
    }
    size_t start[SHORT + 1];
    int rank[SHORT];
    /* Segment k is s[start[k] .. start[k+1]); rank[k] = rank of segments k and k+1 joined. */
    size_t m = n;
    for (size_t k = 0; k <= n; k++) start[k] = k;
    for (size_t k = 0; k + 1 < m; k++) {
        int r = tok_lookup(t, s + k, 2);
        rank[k] = r < 0 ? INT_MAX : r;
    }
    while (m > 1) {
        int best = INT_MAX;
        size_t bk = 0;
        for (size_t k = 0; k + 1 < m; k++)
            if (rank[k] < best) best = rank[k], bk = k;
        if (best == INT_MAX) break;
        /* Drop the boundary start[bk+1]: segments bk and bk+1 become one. */
        memmove(start + bk + 1, start + bk + 2, (m - bk - 1) * sizeof(size_t));
        memmove(rank + bk, rank + bk + 1, (m - bk - 2) * sizeof(int));
        m--;
        if (bk + 1 < m) {
            int r = tok_lookup(t, s + start[bk], start[bk + 2] - start[bk]);
            rank[bk] = r < 0 ? INT_MAX : r;
        }
        if (bk > 0) {
            int r = tok_lookup(t, s + start[bk - 1], start[bk + 1] - start[bk - 1]);
            rank[bk - 1] = r < 0 ? INT_MAX : r;
        }
    }
    for (size_t k = 0; k < m; k++) {
        int r = tok_lookup(t, s + start[k], start[k + 1] - start[k]);
        /* Every segment is a byte or the result of a merge, so it has a rank. */
        tok_push(ids, nids, cap, (uint32_t)r);
    }
}

void tok_encode(const Tokenizer *t, const char *text, size_t len, uint32_t **ids, size_t *n,
                size_t *cap) {
    const unsigned char *s = (const unsigned char *)text;
    if (t->kind == TOK_BYTE) {
        if (*n + len > *cap) {
            *cap = *n + len;
            *ids = xrealloc(*ids, *cap * sizeof(uint32_t));
        }
        for (size_t i = 0; i < len; i++) (*ids)[(*n)++] = s[i];
        return;
    }
    for (size_t i = 0; i < len;) {
        size_t e = tok_next_piece(s, len, i);
        tok_bpe_piece(t, s + i, e - i, ids, n, cap);
        i = e;
    }
}

size_t tok_decode(const Tokenizer *t, uint32_t id, char *buf, size_t cap) {
    const char *src;
    size_t n;
    char b;
    if (t->kind == TOK_BYTE) {
        if (id > 255) return 0;
        b = (char)id;
        src = &b;
        n = 1;
    } else if (id < (uint32_t)t->n_ranks) {
        src = t->pool + t->off[id];
        n = t->off[id + 1] - t->off[id];
    } else if ((int)id == t->eot) {
        src = TOK_EOT_TEXT;
        n = strlen(TOK_EOT_TEXT);
    } else {
        return 0;
    }
    memcpy(buf, src, n < cap ? n : cap);
    return n;
}
