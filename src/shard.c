/* shard: token shards on disk -> an index of a glob (headers only) -> samples read
 * on demand through a bounded cache of open shards; and the shard writer.
 * Reads report failures in a ShardError (they may run on the prefetch thread);
 * only indexing, always on the main thread, exits. Never knows sample order. */
#include "shard.h"
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#define SHARD_HEADER_BYTES (SHARD_HEADER_INTS * 4)
#define SHARD_SCRATCH (1u << 20) /* bytes read at a time when checking a .bin's ids */
#define SHARD_HINT_PREPARE "make token shards with: ./train prepare --tokenizer byte|gpt2 --out DIR FILE..."
#define SHARD_HINT_MOVED "shards must stay in place, unchanged, until the run ends; restore it and continue with --resume auto"

typedef struct Shard {
    char *path;
    uint64_t first;     /* index of its sample 0 within the set */
    int64_t size;       /* file bytes when indexed: every read checks it is still so */
    uint32_t n_tokens;  /* header[2] */
    uint32_t n_samples; /* (n_tokens - 1) / T, 0 if too short */
    uint8_t width;      /* bytes per token: 2 (version 1) or 4 (version 2) */
    uint8_t zst;        /* whole file zstd-compressed */
    uint8_t checked;    /* every id seen < vocab_size (once per process) */
    int32_t slot;       /* its slot in the cache, -1 when closed */
} Shard;

struct ShardSet {
    char *pattern, *what;
    int T, vocab_size;
    ShardCache *cache;
    Shard *shards; /* (n) in strcmp order of path */
    int n;
    uint64_t n_samples, n_tokens;
};

typedef struct ShardSlot {
    ShardSet *set; /* NULL: free */
    int shard;
    int fd;
    unsigned char *buf; /* .zst: the whole decompressed file; capacity kept for the next one */
    size_t cap;
    uint64_t used;      /* LRU clock at the last read */
} ShardSlot;

struct ShardCache {
    int max_open, n_open;
    ShardSlot *slots;        /* (max_open) */
    uint64_t clock;
    unsigned char *scratch;  /* (scratch_cap) bytes: a sample's raw tokens, or a chunk of ids being checked */
    size_t scratch_cap;
    ZSTD_DStream *ds;        /* one decompressor and its input buffer (zin_cap bytes), reused */
    unsigned char *zin;
    size_t zin_cap;
};

static int shard_ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

__attribute__((format(printf, 3, 4))) static int shard_err(ShardError *e, const char *hint, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    kiln_strlcpy(e->hint, hint ? hint : "", sizeof e->hint);
    e->code = KILN_EXIT_USAGE;
    return -1;
}

/* An I/O failure, not bad data: exit 1 (DESIGN.md). */
static int shard_io_err(ShardError *e, const char *path, const char *what) {
    const char *why = strerror(errno);
    shard_err(e, NULL, "%s: %s: %s", path, what, why);
    e->code = KILN_EXIT_RUNTIME;
    return -1;
}

/* Index-time failures: the main thread, so exit 2 at once. */
static void shard_die(const ShardError *e) {
    kiln_fail_hint(e->code, e->hint[0] ? e->hint : NULL, "%s", e->msg);
}

static ssize_t shard_read_full(int fd, void *buf, size_t n, off_t at) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = at >= 0 ? pread(fd, (char *)buf + got, n - got, at + (off_t)got) : read(fd, (char *)buf + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -1;
        if (r == 0) break;
        got += (size_t)r;
    }
    return (ssize_t)got;
}

/* ---- zstd ------------------------------------------------------------------ */

/* Decompress a .zst from fd with the streaming API (frames written from a pipe
 * may not record their content size; a file may hold several frames) into
 * *out (grown, capacity *cap), through the cache's decompressor. want > 0:
 * stop once want bytes are out (the header at index time). limit > 0: more
 * bytes than that is an error (the size the header implies: a small file
 * must not inflate until memory runs out). Returns the bytes out, or -1 with e. */
static ssize_t shard_unzstd(ShardCache *c, int fd, const char *path, size_t want, size_t limit, unsigned char **out,
                            size_t *cap, ShardError *e) {
    ZSTD_DStream *ds = c->ds;
    ZSTD_DCtx_reset(ds, ZSTD_reset_session_only);
    size_t in_cap = c->zin_cap, chunk = ZSTD_DStreamOutSize();
    unsigned char *in_buf = c->zin;
    ZSTD_inBuffer in = {in_buf, 0, 0};
    size_t n = 0, last = 1; /* last: 0 once a frame is complete; an empty file is not a frame */
    int eof = 0, out_full = 0, rc = 0;
    for (;;) {
        if (want && n >= want) break;
        if (in.pos == in.size && !eof) {
            ssize_t got = shard_read_full(fd, in_buf, in_cap, -1);
            if (got < 0) {
                rc = shard_io_err(e, path, "read error");
                break;
            }
            eof = got == 0;
            in.src = in_buf, in.size = (size_t)got, in.pos = 0;
        }
        /* once the input is gone, keep calling only while the last call filled
         * the output: zstd may still hold decompressed bytes */
        if (in.pos == in.size && eof && !out_full) break;
        if (*cap - n < chunk) {
            *cap = *cap * 2 > n + chunk ? *cap * 2 : n + chunk;
            *out = xrealloc(*out, *cap);
        }
        ZSTD_outBuffer o = {*out + n, *cap - n, 0};
        size_t ret = ZSTD_decompressStream(ds, &o, &in);
        if (ZSTD_isError(ret)) {
            rc = shard_err(e, "the file is damaged; re-create it (./train prepare ... --zstd LEVEL)",
                           "%s: corrupt zstd data: %s", path, ZSTD_getErrorName(ret));
            break;
        }
        n += o.pos;
        out_full = o.pos == o.size;
        last = ret;
        if (limit && n > limit) {
            rc = shard_err(e, SHARD_HINT_PREPARE, "%s: decompresses to more than the %zu bytes its header implies",
                           path, limit);
            break;
        }
    }
    if (rc) return -1;
    if ((!want || n < want) && last != 0)
        return shard_err(e, "the file is damaged or was cut short; re-create it",
                         "%s: truncated zstd data (stream ends inside a frame)", path);
    return (ssize_t)n;
}

/* ---- the header ------------------------------------------------------------ */

/* Check a shard's 12 header bytes; len = the (decompressed) file's length, or
 * SIZE_MAX when only the header is known yet (.zst at index time). */
static int shard_check_header(Shard *s, const unsigned char *file, size_t len, ShardError *e) {
    if (len < SHARD_HEADER_BYTES)
        return shard_err(e, SHARD_HINT_PREPARE, "%s: %zu bytes, too short for the %d-byte shard header", s->path, len,
                         SHARD_HEADER_BYTES);
    int32_t h[3];
    memcpy(h, file, sizeof h);
    if (h[0] != SHARD_MAGIC)
        return shard_err(e, SHARD_HINT_PREPARE, "%s: bad magic %d (expected %d): not a token shard", s->path, h[0],
                         SHARD_MAGIC);
    if (h[1] != 1 && h[1] != 2)
        return shard_err(e, SHARD_HINT_PREPARE, "%s: unsupported shard version %d (1 = uint16 tokens, 2 = uint32)",
                         s->path, h[1]);
    if (h[2] < 0) return shard_err(e, SHARD_HINT_PREPARE, "%s: negative token count %d in header", s->path, h[2]);
    s->width = h[1] == 1 ? 2 : 4;
    s->n_tokens = (uint32_t)h[2];
    if (len == SIZE_MAX) return 0;
    uint64_t holds = (len - SHARD_HEADER_BYTES) / s->width, need = SHARD_HEADER_BYTES + (uint64_t)s->n_tokens * s->width;
    if (holds < s->n_tokens)
        return shard_err(e, "the file was cut short (interrupted copy or write?); re-create it",
                         "%s: truncated: header says %u tokens, file holds %llu", s->path, s->n_tokens,
                         (unsigned long long)holds);
    if (len != need)
        return shard_err(e, SHARD_HINT_PREPARE, "%s: header says %u tokens, but the file has %llu extra bytes", s->path,
                         s->n_tokens, (unsigned long long)(len - need));
    return 0;
}

/* Index one shard from its size and header; nothing stays open. */
static int shard_probe(Shard *s, ShardCache *c, ShardError *e) {
    /* a regular file only: opening a FIFO or a device would block or read forever */
    uint64_t size;
    int fd = kiln_open_read(s->path, 0, &size);
    if (fd < 0 && (errno == KILN_ENOTREG || errno == EISDIR))
        return shard_err(e, SHARD_HINT_PREPARE, "%s: not a regular file", s->path);
    if (fd < 0) return shard_err(e, SHARD_HINT_PREPARE, "%s: cannot open: %s", s->path, strerror(errno));
    s->size = (int64_t)size;
    s->zst = (uint8_t)shard_ends_with(s->path, ".zst");
    s->slot = -1;
    int rc;
    if (s->zst) {
        ssize_t n = shard_unzstd(c, fd, s->path, 12, 0, &c->scratch, &c->scratch_cap, e);
        rc = n < 0 ? -1 : (size_t)n < 12 ? shard_err(e, SHARD_HINT_PREPARE, "%s: %zd bytes, too short for the %d-byte "
                                                     "shard header", s->path, n, SHARD_HEADER_BYTES)
                                         : shard_check_header(s, c->scratch, SIZE_MAX, e);
    } else {
        unsigned char h[12];
        ssize_t n = shard_read_full(fd, h, sizeof h, 0);
        rc = n < 0 ? shard_io_err(e, s->path, "read error") : shard_check_header(s, h, (size_t)size, e);
    }
    close(fd);
    return rc;
}

/* ---- the cache of open shards ------------------------------------------------ */

ShardCache *shard_cache_new(int max_open) {
    if (max_open < 1) max_open = 1;
    ShardCache *c = xcalloc(1, sizeof *c);
    c->max_open = max_open;
    c->slots = xcalloc((size_t)max_open, sizeof(ShardSlot));
    for (int i = 0; i < max_open; i++) c->slots[i].fd = -1;
    c->scratch_cap = SHARD_SCRATCH;
    c->scratch = xmalloc(c->scratch_cap);
    c->ds = ZSTD_createDStream();
    if (!c->ds) kiln_fail(KILN_EXIT_RUNTIME, "ZSTD_createDStream failed");
    c->zin_cap = ZSTD_DStreamInSize();
    c->zin = xmalloc(c->zin_cap);
    return c;
}

static void shard_slot_close(ShardCache *c, ShardSlot *sl) {
    if (!sl->set) return;
    sl->set->shards[sl->shard].slot = -1;
    if (sl->fd >= 0) close(sl->fd);
    sl->fd = -1;
    sl->set = NULL;
    c->n_open--;
}

void shard_cache_free(ShardCache *c) {
    if (!c) return;
    for (int i = 0; i < c->max_open; i++) {
        shard_slot_close(c, &c->slots[i]);
        free(c->slots[i].buf);
    }
    free(c->slots);
    free(c->scratch);
    ZSTD_freeDStream(c->ds);
    free(c->zin);
    free(c);
}

/* The file behind an open shard is still the one indexed: a deleted or
 * replaced file has no links left (its old inode still reads, so nothing else
 * would notice), a truncated or rewritten one another size. */
static int shard_check_unchanged(const Shard *s, int fd, ShardError *e) {
    struct stat st;
    if (fstat(fd, &st) != 0) return shard_io_err(e, s->path, "cannot stat");
    if (st.st_nlink == 0)
        return shard_err(e, SHARD_HINT_MOVED, "%s: disappeared while the run goes on (deleted or replaced since it was "
                         "indexed at start-up)", s->path);
    if ((int64_t)st.st_size != s->size)
        return shard_err(e, SHARD_HINT_MOVED, "%s: changed while the run goes on: %lld bytes now, %lld when indexed "
                         "(truncated or rewritten)", s->path, (long long)st.st_size, (long long)s->size);
    return 0;
}

static inline uint32_t shard_token(const unsigned char *p, int width, uint64_t i) {
    if (width == 2) {
        uint16_t v;
        memcpy(&v, p + 2 * i, 2);
        return v;
    }
    uint32_t v;
    memcpy(&v, p + 4 * i, 4);
    return v;
}

/* Ids of tokens [from, from + n) of s held at p (token `from` first). */
static int shard_check_ids(const ShardSet *set, const Shard *s, const unsigned char *p, uint64_t from, uint64_t n,
                           ShardError *e) {
    for (uint64_t i = 0; i < n; i++) {
        uint32_t id = shard_token(p, s->width, i);
        if (id >= (uint32_t)set->vocab_size) {
            char hint[256];
            snprintf(hint, sizeof hint, "the shards of %s were made with a larger vocabulary: raise model.vocab_size "
                     "or re-prepare them", set->what);
            return shard_err(e, hint, "%s: token %u at offset %llu is >= vocab_size %d", s->path, id,
                             (unsigned long long)(from + i), set->vocab_size);
        }
    }
    return 0;
}

/* Open shard k of set into a slot (closing the least recently used one if all
 * are taken), decompress it if .zst, and check its ids the first time. */
static int shard_load(ShardSet *set, int k, ShardError *e) {
    ShardCache *c = set->cache;
    Shard *s = &set->shards[k];
    ShardSlot *sl = NULL;
    for (int i = 0; i < c->max_open && !sl; i++)
        if (!c->slots[i].set) sl = &c->slots[i];
    if (!sl) {
        sl = &c->slots[0];
        for (int i = 1; i < c->max_open; i++)
            if (c->slots[i].used < sl->used) sl = &c->slots[i];
        shard_slot_close(c, sl);
    }
    int fd = kiln_open_read(s->path, 0, NULL);
    if (fd < 0)
        return shard_err(e, SHARD_HINT_MOVED, "%s: cannot open: %s (it was indexed at start-up: deleted or moved while "
                         "the run goes on?)", s->path, kiln_strerror(errno));
    if (shard_check_unchanged(s, fd, e) != 0) {
        close(fd);
        return -1;
    }
    if (s->zst) {
        ssize_t n = shard_unzstd(c, fd, s->path, 0, SHARD_HEADER_BYTES + (size_t)s->n_tokens * s->width, &sl->buf,
                                 &sl->cap, e);
        Shard seen = *s;
        if (n < 0 || shard_check_header(&seen, sl->buf, (size_t)n, e) != 0) {
            close(fd);
            return -1;
        }
        if (seen.n_tokens != s->n_tokens || seen.width != s->width) {
            close(fd);
            return shard_err(e, SHARD_HINT_MOVED, "%s: changed while the run goes on: its header now says %u tokens, "
                             "%u when indexed", s->path, seen.n_tokens, s->n_tokens);
        }
        if (!s->checked && shard_check_ids(set, s, sl->buf + SHARD_HEADER_BYTES, 0, s->n_tokens, e) != 0) {
            close(fd);
            return -1;
        }
    } else if (!s->checked) {
        /* one pass over the file, a chunk at a time: an id past the vocabulary
         * stops here, not as an out-of-range embedding row deep inside a step */
        uint64_t per = c->scratch_cap / s->width;
        for (uint64_t at = 0; at < s->n_tokens; at += per) {
            uint64_t m = s->n_tokens - at < per ? s->n_tokens - at : per;
            ssize_t got = shard_read_full(fd, c->scratch, m * s->width, (off_t)(SHARD_HEADER_BYTES + at * s->width));
            if (got != (ssize_t)(m * s->width)) {
                close(fd);
                return got < 0 ? shard_io_err(e, s->path, "read error")
                               : shard_err(e, SHARD_HINT_MOVED, "%s: truncated while the run goes on (a read at token "
                                           "%llu came up short)", s->path, (unsigned long long)at);
            }
            if (shard_check_ids(set, s, c->scratch, at, m, e) != 0) {
                close(fd);
                return -1;
            }
        }
    }
    s->checked = 1;
    sl->set = set, sl->shard = k, sl->fd = fd;
    s->slot = (int32_t)(sl - c->slots);
    c->n_open++;
    return 0;
}

/* ---- the set ------------------------------------------------------------------ */

static int shard_cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

ShardSet *shard_index(const char *pattern, const char *what, int T, int vocab_size, ShardCache *cache) {
    glob_t g;
    int rc = glob(pattern, 0, NULL, &g);
    if (rc != 0 || g.gl_pathc == 0) {
        if (rc == 0) globfree(&g);
        char hint[512];
        snprintf(hint, sizeof hint, "check %s, or make shards first: ./train prepare ... --out DIR", what);
        kiln_fail_hint(KILN_EXIT_USAGE, hint, "%s: no files match '%s'", what, pattern);
    }
    ShardSet *set = xcalloc(1, sizeof *set);
    set->pattern = xstrdup(pattern);
    set->what = xstrdup(what);
    set->T = T, set->vocab_size = vocab_size, set->cache = cache;
    set->n = (int)g.gl_pathc;
    /* strcmp order: glob's own follows the locale, the sample order must not */
    char **paths = xmalloc(g.gl_pathc * sizeof(char *));
    for (size_t i = 0; i < g.gl_pathc; i++) paths[i] = xstrdup(g.gl_pathv[i]);
    globfree(&g);
    qsort(paths, (size_t)set->n, sizeof(char *), shard_cmp_str);
    set->shards = xcalloc((size_t)set->n, sizeof(Shard));
    size_t need = (size_t)(T + 1) * 4;
    if (cache->scratch_cap < need) cache->scratch = xrealloc(cache->scratch, cache->scratch_cap = need);
    int skipped = 0;
    for (int i = 0; i < set->n; i++) {
        Shard *s = &set->shards[i];
        s->path = paths[i];
        ShardError e;
        if (shard_probe(s, cache, &e) != 0) shard_die(&e);
        /* a short shard (the tail of a split) holds no sample: skipped; only a
         * glob with no sample at all is an error */
        s->n_samples = s->n_tokens > (uint32_t)T ? (s->n_tokens - 1) / (uint32_t)T : 0;
        if (s->n_samples == 0 && ++skipped <= 3)
            kiln_warn("%s: %u tokens, too few for one sample of seq_len + 1 = %d tokens: skipped", s->path,
                      s->n_tokens, T + 1);
        s->first = set->n_samples;
        set->n_samples += s->n_samples;
        set->n_tokens += s->n_tokens;
    }
    free(paths);
    if (skipped > 3) kiln_warn("%s: %d more shards of '%s' too short for one sample: skipped", what, skipped - 3, pattern);
    if (set->n_samples == 0)
        kiln_fail_hint(KILN_EXIT_USAGE, "use more text per shard or a shorter model.seq_len",
                       "%s: no shard matching '%s' holds one sample of seq_len + 1 = %d tokens (%s: %u tokens, too "
                       "few for one sample)", what, pattern, T + 1, set->shards[0].path, set->shards[0].n_tokens);
    return set;
}

void shard_set_free(ShardSet *s) {
    if (!s) return;
    for (int i = 0; i < s->n; i++) {
        if (s->shards[i].slot >= 0) shard_slot_close(s->cache, &s->cache->slots[s->shards[i].slot]);
        free(s->shards[i].path);
    }
    free(s->shards);
    free(s->pattern);
    free(s->what);
    free(s);
}

uint64_t shard_set_samples(const ShardSet *s) { return s->n_samples; }
uint64_t shard_set_tokens(const ShardSet *s) { return s->n_tokens; }
int shard_set_count(const ShardSet *s) { return s->n; }

/* The shard holding sample i: the last with first <= i (short shards, which
 * hold none, share their first with the next one and lose the tie). */
static int shard_find(const ShardSet *s, uint64_t i) {
    int lo = 0, hi = s->n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (s->shards[mid].first <= i) lo = mid;
        else hi = mid - 1;
    }
    while (s->shards[lo].n_samples == 0 || i >= s->shards[lo].first + s->shards[lo].n_samples) lo--;
    return lo;
}

int shard_read_sample(ShardSet *set, uint64_t i, int32_t *in, int32_t *tg, ShardError *e) {
    ShardCache *c = set->cache;
    int k = shard_find(set, i);
    Shard *s = &set->shards[k];
    if (s->slot < 0 && shard_load(set, k, e) != 0) return -1;
    ShardSlot *sl = &c->slots[s->slot];
    sl->used = ++c->clock;
    const int T = set->T;
    uint64_t start = (i - s->first) * (uint64_t)T;
    const unsigned char *p;
    if (shard_check_unchanged(s, sl->fd, e) != 0) return -1;
    if (s->zst) {
        p = sl->buf + SHARD_HEADER_BYTES + start * s->width;
    } else {
        size_t n = (size_t)(T + 1) * s->width;
        ssize_t got = shard_read_full(sl->fd, c->scratch, n, (off_t)(SHARD_HEADER_BYTES + start * s->width));
        if (got < 0) return shard_io_err(e, s->path, "read error");
        if ((size_t)got != n)
            return shard_err(e, SHARD_HINT_MOVED, "%s: truncated while the run goes on: %zd of %zu bytes at token %llu",
                             s->path, got, n, (unsigned long long)start);
        p = c->scratch;
    }
    for (int t = 0; t < T; t++) {
        in[t] = (int32_t)shard_token(p, s->width, (uint64_t)t);
        tg[t] = (int32_t)shard_token(p, s->width, (uint64_t)t + 1);
    }
    return 0;
}

/* ---- writing ------------------------------------------------------------------ */

void shard_write(const char *path, const uint32_t *tokens, size_t n, int zstd_level) {
    if (n > (size_t)INT32_MAX)
        kiln_fail(KILN_EXIT_USAGE, "%s: %zu tokens; the int32 header holds at most %d per shard", path, n, INT32_MAX);
    int wide = 0;
    for (size_t i = 0; i < n && !wide; i++) wide = tokens[i] > 0xffff;
    int width = wide ? 4 : 2;
    size_t len = SHARD_HEADER_BYTES + n * (size_t)width;
    unsigned char *file = xcalloc(1, len);
    int32_t h[3] = {SHARD_MAGIC, wide ? 2 : 1, (int32_t)n};
    memcpy(file, h, sizeof h);
    if (wide) {
        memcpy(file + SHARD_HEADER_BYTES, tokens, n * sizeof(uint32_t));
    } else {
        uint16_t *t16 = (uint16_t *)(file + SHARD_HEADER_BYTES);
        for (size_t i = 0; i < n; i++) t16[i] = (uint16_t)tokens[i];
    }
    const void *out = file;
    size_t out_len = len;
    unsigned char *z = NULL;
    if (zstd_level > 0) {
        size_t cap = ZSTD_compressBound(len);
        z = xmalloc(cap);
        ZSTD_CCtx *cc = ZSTD_createCCtx();
        if (!cc) kiln_fail(KILN_EXIT_RUNTIME, "%s: ZSTD_createCCtx failed", path);
        /* a frame checksum tells a damaged shard from a valid one; without it a
         * flipped bit decodes to plausible garbage */
        ZSTD_CCtx_setParameter(cc, ZSTD_c_compressionLevel, zstd_level);
        ZSTD_CCtx_setParameter(cc, ZSTD_c_checksumFlag, 1);
        size_t zn = ZSTD_compress2(cc, z, cap, file, len);
        ZSTD_freeCCtx(cc);
        if (ZSTD_isError(zn)) kiln_fail(KILN_EXIT_RUNTIME, "%s: zstd compression failed: %s", path, ZSTD_getErrorName(zn));
        out = z;
        out_len = zn;
    }
    if (kiln_write_file_atomic(path, out, out_len) != 0)
        kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot write shard: %s", path, strerror(errno));
    free(z);
    free(file);
}
