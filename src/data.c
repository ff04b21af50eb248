/* data: token shards (llm.c .bin layout, optionally zstd) -> validated in-memory
 * token arrays -> (inputs, targets) batches in a seeded global order sliced by rank.
 * Owns shard reading/writing and the sample order; must never know the model,
 * the backend or how many ranks share a step beyond (rank, world). */
#include "data.h"
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#define DATA_HEADER_BYTES (DATA_HEADER_INTS * 4)

typedef struct DataShard {
    char *path;
    void *map;              /* mmap of an uncompressed file, or NULL */
    size_t map_len;
    unsigned char *buf;     /* whole decompressed .zst file, or NULL */
    const void *tokens;     /* (n_tokens) uint16 (version 1) or uint32 (version 2) */
    int width;              /* bytes per token: 2 or 4 */
    uint64_t n_tokens;
    uint64_t n_samples;     /* (n_tokens - 1) / T */
    uint64_t first_sample;  /* global index of this shard's sample 0 */
} DataShard;

struct DataLoader {
    char *what;             /* config key for messages, e.g. "data.train" */
    char *pattern;
    int B, T, vocab_size, shuffle, rank, world;
    uint64_t seed;
    DataShard *shards;      /* (n_shards) sorted by path */
    int n_shards;
    uint64_t n_tokens, n_samples;
    uint32_t *perm;         /* (n_samples) this epoch's order when shuffling */
    uint64_t perm_epoch;
    int perm_valid;
    DataPos pos;            /* next global batch starts at sample pos.index of pos.epoch */
};

#define data_fail(hint, ...) kiln_fail_hint(KILN_EXIT_USAGE, (hint), __VA_ARGS__)

#define DATA_HINT_PREPARE "make token shards with: ./train prepare --tokenizer byte|gpt2 --out DIR FILE..."

static int data_ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* ---- reading one shard ---------------------------------------------------- */

/* Decompress a whole .zst file with the streaming API: shards written by other
 * tools (zstd CLI from a pipe) may not record the content size in the frame. */
static unsigned char *data_read_zstd(const char *path, size_t *out_len) {
    FILE *f = fopen(path, "rb");
    if (!f) data_fail(DATA_HINT_PREPARE, "%s: cannot open: %s", path, strerror(errno));
    ZSTD_DStream *ds = ZSTD_createDStream();
    if (!ds) kiln_fail(KILN_EXIT_RUNTIME, "%s: ZSTD_createDStream failed", path);
    ZSTD_initDStream(ds);
    size_t in_cap = ZSTD_DStreamInSize(), chunk = ZSTD_DStreamOutSize();
    unsigned char *in_buf = xmalloc(in_cap);
    size_t cap = 4 * chunk, n = 0;
    unsigned char *out = xmalloc(cap);
    ZSTD_inBuffer in = {in_buf, 0, 0};
    size_t last = 1; /* 0 once a frame is complete; an empty file is not a frame */
    int eof = 0, out_full = 0;
    for (;;) {
        if (in.pos == in.size && !eof) {
            size_t got = fread(in_buf, 1, in_cap, f);
            if (got == 0) {
                if (ferror(f)) data_fail(NULL, "%s: read error: %s", path, strerror(errno));
                eof = 1;
            }
            in.src = in_buf;
            in.size = got;
            in.pos = 0;
        }
        /* Once the input is gone, keep calling only while the last call filled the
         * output: zstd may still hold decompressed bytes. */
        if (in.pos == in.size && eof && !out_full) break;
        if (cap - n < chunk) {
            cap = cap * 2 > n + chunk ? cap * 2 : n + chunk;
            out = xrealloc(out, cap);
        }
        ZSTD_outBuffer o = {out + n, cap - n, 0};
        size_t ret = ZSTD_decompressStream(ds, &o, &in);
        if (ZSTD_isError(ret))
            data_fail("the file is damaged; re-create it (./train prepare ... --zstd LEVEL)",
                      "%s: corrupt zstd data: %s", path, ZSTD_getErrorName(ret));
        n += o.pos;
        out_full = o.pos == o.size;
        last = ret;
    }
    fclose(f);
    ZSTD_freeDStream(ds);
    free(in_buf);
    if (last != 0)
        data_fail("the file is damaged or was cut short; re-create it",
                  "%s: truncated zstd data (stream ends inside a frame)", path);
    *out_len = n;
    return out;
}

/* Map or decompress one shard and check its header against its size. */
static void data_load_shard(DataShard *s) {
    const unsigned char *file;
    size_t len;
    /* stat before open: opening a FIFO or a device would block or read forever */
    struct stat pre;
    if (stat(s->path, &pre) != 0) data_fail(DATA_HINT_PREPARE, "%s: cannot open: %s", s->path, strerror(errno));
    if (!S_ISREG(pre.st_mode)) data_fail(DATA_HINT_PREPARE, "%s: not a regular file", s->path);
    if (data_ends_with(s->path, ".zst")) {
        s->buf = data_read_zstd(s->path, &len);
        file = s->buf;
    } else {
        int fd = open(s->path, O_RDONLY);
        if (fd < 0) data_fail(DATA_HINT_PREPARE, "%s: cannot open: %s", s->path, strerror(errno));
        struct stat st;
        if (fstat(fd, &st) != 0) data_fail(NULL, "%s: cannot stat: %s", s->path, strerror(errno));
        if (!S_ISREG(st.st_mode)) data_fail(DATA_HINT_PREPARE, "%s: not a regular file", s->path);
        len = (size_t)st.st_size;
        if (len >= DATA_HEADER_BYTES) {
            /* mmap keeps big datasets out of the heap; pages load on first touch. */
            s->map = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
            if (s->map == MAP_FAILED) data_fail(NULL, "%s: mmap failed: %s", s->path, strerror(errno));
            s->map_len = len;
        }
        close(fd);
        file = s->map;
    }
    if (len < DATA_HEADER_BYTES)
        data_fail(DATA_HINT_PREPARE, "%s: %zu bytes, too short for the %d-byte shard header",
                  s->path, len, DATA_HEADER_BYTES);
    int32_t h[3];
    memcpy(h, file, sizeof h);
    if (h[0] != DATA_MAGIC)
        data_fail(DATA_HINT_PREPARE, "%s: bad magic %d (expected %d): not a token shard", s->path,
                  h[0], DATA_MAGIC);
    if (h[1] != 1 && h[1] != 2)
        data_fail(DATA_HINT_PREPARE, "%s: unsupported shard version %d (1 = uint16 tokens, 2 = uint32)",
                  s->path, h[1]);
    if (h[2] < 0) data_fail(DATA_HINT_PREPARE, "%s: negative token count %d in header", s->path, h[2]);
    s->width = h[1] == 1 ? 2 : 4;
    s->n_tokens = (uint64_t)h[2];
    uint64_t holds = (len - DATA_HEADER_BYTES) / (uint64_t)s->width;
    if (holds < s->n_tokens)
        data_fail("the file was cut short (interrupted copy or write?); re-create it",
                  "%s: truncated: header says %llu tokens, file holds %llu", s->path,
                  (unsigned long long)s->n_tokens, (unsigned long long)holds);
    if (len != DATA_HEADER_BYTES + s->n_tokens * (uint64_t)s->width)
        data_fail(DATA_HINT_PREPARE, "%s: header says %llu tokens, but the file has %zu extra bytes",
                  s->path, (unsigned long long)s->n_tokens,
                  len - (size_t)(DATA_HEADER_BYTES + s->n_tokens * (uint64_t)s->width));
    s->tokens = file + DATA_HEADER_BYTES;
}

static inline uint32_t data_token(const DataShard *s, uint64_t i) {
    return s->width == 2 ? ((const uint16_t *)s->tokens)[i] : ((const uint32_t *)s->tokens)[i];
}

/* Every id < vocab_size, so a bad shard stops here and not as an out-of-range
 * embedding row deep inside a step. */
static void data_check_ids(const DataShard *s, int vocab_size, const char *what) {
    uint32_t v = (uint32_t)vocab_size;
    for (uint64_t i = 0; i < s->n_tokens; i++) {
        uint32_t id = data_token(s, i);
        if (id >= v) {
            char hint[256];
            snprintf(hint, sizeof hint,
                     "the shards of %s were made with a larger vocabulary: raise model.vocab_size "
                     "or re-prepare them", what);
            data_fail(hint, "%s: token %u at offset %llu is >= vocab_size %d", s->path, id,
                      (unsigned long long)i, vocab_size);
        }
    }
}

static void data_free_shard(DataShard *s) {
    if (s->map) munmap(s->map, s->map_len);
    free(s->buf);
    free(s->path);
}

/* ---- the loader ----------------------------------------------------------- */

static int data_cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

DataLoader *data_open(const char *pattern, const char *what, int B, int T, int vocab_size,
                      int shuffle, uint64_t seed, int rank, int world) {
    if (B <= 0 || T <= 0 || vocab_size <= 0 || world <= 0 || rank < 0 || rank >= world)
        kiln_fail(KILN_EXIT_USAGE, "%s: bad loader arguments B=%d T=%d vocab_size=%d rank=%d world=%d",
                  what, B, T, vocab_size, rank, world);
    glob_t g;
    int rc = glob(pattern, 0, NULL, &g);
    if (rc != 0 || g.gl_pathc == 0) {
        if (rc == 0) globfree(&g);
        char hint[512];
        snprintf(hint, sizeof hint, "check %s, or make shards first: ./train prepare ... --out DIR",
                 what);
        data_fail(hint, "%s: no files match '%s'", what, pattern);
    }
    DataLoader *dl = xcalloc(1, sizeof *dl);
    dl->what = xstrdup(what);
    dl->pattern = xstrdup(pattern);
    dl->B = B;
    dl->T = T;
    dl->vocab_size = vocab_size;
    dl->shuffle = shuffle;
    dl->seed = seed;
    dl->rank = rank;
    dl->world = world;
    dl->n_shards = (int)g.gl_pathc;
    /* Sort with strcmp: glob's own order follows the locale, the sample order must not. */
    char **paths = xmalloc(g.gl_pathc * sizeof(char *));
    for (size_t i = 0; i < g.gl_pathc; i++) paths[i] = xstrdup(g.gl_pathv[i]);
    globfree(&g);
    qsort(paths, (size_t)dl->n_shards, sizeof(char *), data_cmp_str);
    dl->shards = xcalloc((size_t)dl->n_shards, sizeof(DataShard));
    for (int i = 0; i < dl->n_shards; i++) {
        DataShard *s = &dl->shards[i];
        s->path = paths[i];
        data_load_shard(s);
        data_check_ids(s, vocab_size, what);
        /* A short shard (the tail of a split, say) holds no sample; it is
         * skipped, and only a glob with no sample at all is an error. */
        s->n_samples = s->n_tokens > (uint64_t)T ? (s->n_tokens - 1) / (uint64_t)T : 0;
        if (s->n_samples == 0)
            kiln_warn("%s: %llu tokens, too few for one sample of seq_len + 1 = %d tokens: skipped", s->path,
                      (unsigned long long)s->n_tokens, T + 1);
        s->first_sample = dl->n_samples;
        dl->n_samples += s->n_samples;
        dl->n_tokens += s->n_tokens;
    }
    if (dl->n_samples == 0)
        data_fail("use more text per shard or a shorter model.seq_len",
                  "%s: no shard matching '%s' holds one sample of seq_len + 1 = %d tokens (%s: %llu tokens, too "
                  "few for one sample)", what, pattern, T + 1, dl->shards[0].path,
                  (unsigned long long)dl->shards[0].n_tokens);
    free(paths);
    if (shuffle) {
        if (dl->n_samples > UINT32_MAX)
            kiln_fail(KILN_EXIT_USAGE, "%s: %llu samples; the shuffled order holds at most 2^32",
                      what, (unsigned long long)dl->n_samples);
        dl->perm = xmalloc(dl->n_samples * sizeof(uint32_t));
    }
    return dl;
}

void data_close(DataLoader *dl) {
    if (!dl) return;
    for (int i = 0; i < dl->n_shards; i++) data_free_shard(&dl->shards[i]);
    free(dl->shards);
    free(dl->perm);
    free(dl->pattern);
    free(dl->what);
    free(dl);
}

/* This epoch's order: Fisher-Yates over an Rng seeded from (seed, epoch) alone,
 * so every rank computes the same permutation without talking to the others. */
static const uint32_t *data_perm(DataLoader *dl, uint64_t epoch) {
    if (dl->perm_valid && dl->perm_epoch == epoch) return dl->perm;
    uint64_t key[2] = {dl->seed, epoch};
    Rng r;
    rng_seed(&r, kiln_fnv1a(key, sizeof key, KILN_FNV_INIT));
    uint64_t n = dl->n_samples;
    for (uint64_t i = 0; i < n; i++) dl->perm[i] = (uint32_t)i;
    for (uint64_t i = n - 1; i > 0; i--) {
        uint64_t j = rng_below(&r, i + 1);
        uint32_t tmp = dl->perm[i];
        dl->perm[i] = dl->perm[j];
        dl->perm[j] = tmp;
    }
    dl->perm_epoch = epoch;
    dl->perm_valid = 1;
    return dl->perm;
}

static const DataShard *data_find_shard(const DataLoader *dl, uint64_t sample) {
    int lo = 0, hi = dl->n_shards - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (dl->shards[mid].first_sample <= sample) lo = mid;
        else hi = mid - 1;
    }
    return &dl->shards[lo];
}

void data_next_batch(DataLoader *dl, int32_t *inputs, int32_t *targets) {
    const uint64_t N = dl->n_samples, T = (uint64_t)dl->T;
    /* The global batch is samples pos.index .. pos.index + B*world - 1 of an endless
     * stream of epochs; this rank takes rank, rank + world, ... of it. */
    for (int b = 0; b < dl->B; b++) {
        uint64_t at = dl->pos.index + (uint64_t)dl->rank + (uint64_t)dl->world * (uint64_t)b;
        uint64_t epoch = dl->pos.epoch + at / N, idx = at % N;
        uint64_t sample = dl->shuffle ? data_perm(dl, epoch)[idx] : idx;
        const DataShard *s = data_find_shard(dl, sample);
        uint64_t start = (sample - s->first_sample) * T;
        int32_t *in = inputs + (size_t)b * T, *tg = targets + (size_t)b * T;
        for (uint64_t t = 0; t < T; t++) {
            in[t] = (int32_t)data_token(s, start + t);
            tg[t] = (int32_t)data_token(s, start + t + 1);
        }
    }
    uint64_t next = dl->pos.index + (uint64_t)dl->B * (uint64_t)dl->world;
    dl->pos.epoch += next / N;
    dl->pos.index = next % N;
}

DataPos data_get_pos(const DataLoader *dl) { return dl->pos; }

void data_set_pos(DataLoader *dl, DataPos pos) {
    if (pos.index >= dl->n_samples)
        data_fail("the data changed since the checkpoint was written; resume with the same shards",
                  "%s: saved data position %llu is past the %llu samples of '%s'", dl->what,
                  (unsigned long long)pos.index, (unsigned long long)dl->n_samples, dl->pattern);
    dl->pos = pos;
}

uint64_t data_num_tokens(const DataLoader *dl) { return dl->n_tokens; }
uint64_t data_num_samples(const DataLoader *dl) { return dl->n_samples; }
int data_num_shards(const DataLoader *dl) { return dl->n_shards; }

/* ---- writing -------------------------------------------------------------- */

int data_write_shard(const char *path, const uint32_t *tokens, size_t n, int zstd_level) {
    if (n > (size_t)INT32_MAX)
        kiln_fail(KILN_EXIT_USAGE, "%s: %zu tokens; the int32 header holds at most %d per shard",
                  path, n, INT32_MAX);
    int wide = 0;
    for (size_t i = 0; i < n && !wide; i++) wide = tokens[i] > 0xffff;
    int width = wide ? 4 : 2;
    size_t len = DATA_HEADER_BYTES + n * (size_t)width;
    unsigned char *file = xcalloc(1, len);
    int32_t h[3] = {DATA_MAGIC, wide ? 2 : 1, (int32_t)n};
    memcpy(file, h, sizeof h);
    if (wide) {
        memcpy(file + DATA_HEADER_BYTES, tokens, n * sizeof(uint32_t));
    } else {
        uint16_t *t16 = (uint16_t *)(file + DATA_HEADER_BYTES);
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
        /* A frame checksum lets the reader tell a damaged shard from a valid one;
         * without it a flipped bit decodes to plausible garbage. */
        ZSTD_CCtx_setParameter(cc, ZSTD_c_compressionLevel, zstd_level);
        ZSTD_CCtx_setParameter(cc, ZSTD_c_checksumFlag, 1);
        size_t zn = ZSTD_compress2(cc, z, cap, file, len);
        ZSTD_freeCCtx(cc);
        if (ZSTD_isError(zn))
            kiln_fail(KILN_EXIT_RUNTIME, "%s: zstd compression failed: %s", path, ZSTD_getErrorName(zn));
        out = z;
        out_len = zn;
    }
    if (kiln_write_file_atomic(path, out, out_len) != 0)
        kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot write shard: %s", path, strerror(errno));
    free(z);
    free(file);
    return 0;
}
