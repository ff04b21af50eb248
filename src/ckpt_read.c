/* ckpt_read: reading checkpoint directories — the manifest, loads that
 * assemble any layout's entries from any other's pieces while streaming each
 * rank file once, verification, blobs, and the ckpt-info and ckpt-diff
 * tools. Never writes a checkpoint (ckpt.c does) and never sees the model,
 * the optimizer or the backend (copies go through the entries' own
 * to_device). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include "ckpt.h"
#include "ckpt_io.h"
#include "util.h"

/* A manifest line is about 250 bytes: this is millions of pieces. */
#define CKPT_MANIFEST_MAX ((size_t)1 << 30)
/* zstd's densest block is an RLE block: 4 bytes (its 3-byte header and the
 * byte) for at most 128 KiB, so no piece decompresses to more than this many
 * times its stored bytes. */
#define CKPT_ZSTD_MAX_RATIO 32768
/* Blobs are small state (the resolved config, RNG and data positions). */
#define CKPT_BLOB_MAX ((uint64_t)64 << 20)

static int dtype_parse(const char *s) {
    for (int i = 0; i < 5; i++)
        if (!strcmp(s, ckpt_dtype_name((CkptDtype)i))) return i;
    return -1;
}

/* ---------- reading ---------- */

typedef struct {
    char name[CKPT_NAME];
    CkptKind kind;
    int dtype, ndim, rank, zstd;
    int64_t shape[CKPT_MAX_DIM];
    uint64_t lo, hi, offset, bytes, stored;
    uint64_t r0, r1, c0, c1; /* its box, always filled in (the whole tensor when the line has none) */
    char file[64];
    uint32_t crc;
} MEntry;

typedef struct {
    CkptInfo info;
    MEntry *e;
    int n;
    char dir[1200];
} Manifest;

static int rerr(char *err, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int rerr(char *err, size_t cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, cap, fmt, ap);
    va_end(ap);
    return -1;
}

/* One "key=value" field of an entry line; NULL if absent. */
static const char *field(const char *line, const char *key, char *buf, size_t cap) {
    size_t k = strlen(key);
    for (const char *p = line; (p = strstr(p, key)); p++) {
        if ((p == line || p[-1] == ' ') && p[k] == '=') {
            const char *v = p + k + 1;
            size_t n = strcspn(v, " \n");
            if (n >= cap) return NULL;
            memcpy(buf, v, n);
            buf[n] = 0;
            return buf;
        }
    }
    return NULL;
}

static int parse_u64(const char *s, uint64_t *out) {
    if (!s || !*s) return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end || errno || s[0] < '0' || s[0] > '9') return -1; /* strtoull takes "-1" and " 1"; ERANGE saturates */
    *out = v;
    return 0;
}

/* A decimal in [0, max] from s[0, n), whole: the manifest's integers. */
static int parse_u64_n(const char *s, size_t n, uint64_t max, uint64_t *out) {
    char b[32];
    if (n == 0 || n >= sizeof b) return -1;
    memcpy(b, s, n);
    b[n] = 0;
    return parse_u64(b, out) || *out > max ? -1 : 0;
}

/* "a:b" as two decimals in [0, max], a < b unless ordered is 0 (a <= b). */
static int parse_span(const char *s, size_t n, uint64_t max, int strict, uint64_t *a, uint64_t *b) {
    const char *colon = memchr(s, ':', n);
    if (!colon || parse_u64_n(s, (size_t)(colon - s), max, a) ||
        parse_u64_n(colon + 1, n - (size_t)(colon + 1 - s), max, b))
        return -1;
    return strict ? (*a < *b ? 0 : -1) : (*a <= *b ? 0 : -1);
}

/* Elements of a shape, overflow-checked: -1 unless numel x es fits in an
 * int64 (a file offset), which bounds every product of its extents below. */
static int shape_numel(int ndim, const int64_t *shape, size_t es, uint64_t *numel) {
    uint64_t n = 1;
    for (int d = 0; d < ndim; d++)
        if (shape[d] < 0 || __builtin_mul_overflow(n, (uint64_t)shape[d], &n)) return -1;
    uint64_t bytes;
    if (__builtin_mul_overflow(n, (uint64_t)es, &bytes) || bytes > INT64_MAX) return -1;
    *numel = n;
    return 0;
}

/* Every number of an entry line is range-checked here, the sizes with
 * overflow checks, so that what a manifest says can be allocated and indexed
 * once the files have shown they hold it (piece_check). */
static int parse_entry(const char *line, MEntry *e) {
    char b[256];
    memset(e, 0, sizeof *e);
    if (!field(line, "name", e->name, sizeof e->name)) return -1;
    if (!field(line, "kind", b, sizeof b)) return -1;
    if (!strcmp(b, "tensor")) e->kind = CKPT_TENSOR;
    else if (!strcmp(b, "blob")) e->kind = CKPT_BLOB;
    else return -1;
    if (!field(line, "dtype", b, sizeof b) || (e->dtype = dtype_parse(b)) < 0) return -1;
    if (!field(line, "shape", b, sizeof b) || b[0] != '[') return -1;
    size_t blen = strlen(b);
    if (b[blen - 1] != ']') return -1;
    for (size_t at = 1; at + 1 < blen;) {
        size_t n = strcspn(b + at, ",]");
        uint64_t v;
        if (e->ndim == CKPT_MAX_DIM || parse_u64_n(b + at, n, INT64_MAX, &v)) return -1;
        e->shape[e->ndim++] = (int64_t)v;
        at += n;
        if (b[at] == ',') {
            if (++at + 1 >= blen) return -1; /* "[3,]" */
        } else if (at + 1 != blen) {
            return -1; /* "[3]]" */
        }
    }
    uint64_t numel, size = ckpt_dtype_size(e->dtype);
    if (shape_numel(e->ndim, e->shape, size, &numel)) return -1;
    if (!field(line, "range", b, sizeof b) || parse_span(b, strlen(b), numel, 0, &e->lo, &e->hi)) return -1;
    uint64_t rank;
    if (parse_u64(field(line, "rank", b, sizeof b), &rank) || rank > INT32_MAX) return -1;
    e->rank = (int)rank;
    if (!field(line, "file", e->file, sizeof e->file) || strchr(e->file, '/') || !e->file[0]) return -1;
    if (parse_u64(field(line, "offset", b, sizeof b), &e->offset)) return -1;
    if (parse_u64(field(line, "bytes", b, sizeof b), &e->bytes)) return -1;
    if (parse_u64(field(line, "stored", b, sizeof b), &e->stored)) return -1;
    if (e->offset > INT64_MAX || e->stored > INT64_MAX - e->offset) return -1; /* offset + stored is an off_t */
    if (!field(line, "codec", b, sizeof b)) return -1;
    if (!strcmp(b, "zstd")) e->zstd = 1;
    else if (strcmp(b, "none")) return -1;
    uint64_t crc;
    if (!field(line, "crc32c", b, sizeof b)) return -1;
    char *end;
    crc = strtoull(b, &end, 16);
    if (*end || strlen(b) != 8 || !isxdigit((unsigned char)b[0])) return -1;
    e->crc = (uint32_t)crc;
    uint64_t rows, cols; /* each at most numel: no product below overflows */
    ckpt_tensor_rc(e->ndim, e->shape, &rows, &cols);
    e->r0 = 0, e->r1 = rows, e->c0 = 0, e->c1 = cols;
    if (field(line, "box", b, sizeof b)) {
        char *comma = strchr(b, ',');
        if (!comma || parse_span(b, (size_t)(comma - b), rows, 1, &e->r0, &e->r1) ||
            parse_span(comma + 1, strlen(comma + 1), cols, 1, &e->c0, &e->c1))
            return -1;
    }
    uint64_t box = (e->r1 - e->r0) * (e->c1 - e->c0); /* <= rows x cols = numel */
    if (e->hi > box || e->bytes != (e->hi - e->lo) * size) return -1;
    if (!e->zstd && e->stored != e->bytes) return -1;
    return 0;
}

static void man_free(Manifest *m) {
    free(m->e);
    memset(m, 0, sizeof *m);
}


static int cmp_u64(uint64_t a, uint64_t b) { return a < b ? -1 : a > b; }

static int mentry_by_name_lo(const void *a, const void *b) {
    const MEntry *x = *(const MEntry *const *)a, *y = *(const MEntry *const *)b;
    int c = strcmp(x->name, y->name);
    if (!c) c = cmp_u64(x->r0, y->r0);
    if (!c) c = cmp_u64(x->c0, y->c0);
    if (!c) c = cmp_u64(x->r1, y->r1);
    if (!c) c = cmp_u64(x->c1, y->c1);
    return c ? c : cmp_u64(x->lo, y->lo);
}

static int same_box(const MEntry *x, const MEntry *y) {
    return x->r0 == y->r0 && x->r1 == y->r1 && x->c0 == y->c0 && x->c1 == y->c1;
}

static int boxes_meet(const MEntry *x, const MEntry *y) {
    return x->r0 < y->r1 && y->r0 < x->r1 && x->c0 < y->c1 && y->c0 < x->c1;
}

/* Pieces of one tensor must not overlap: the loader counts covered elements,
 * and two copies of one range would hide a missing one. Pieces of one box
 * are disjoint ranges of it; pieces of different boxes lie in disjoint boxes. */
static int manifest_check_overlap(const Manifest *m, const char *path, char *err, size_t cap) {
    const MEntry **v = xmalloc((size_t)(m->n ? m->n : 1) * sizeof *v);
    int k = 0;
    for (int i = 0; i < m->n; i++)
        if (m->e[i].kind == CKPT_TENSOR) v[k++] = &m->e[i];
    qsort(v, (size_t)k, sizeof *v, mentry_by_name_lo);
    int rc = 0;
    for (int i = 1; i < k && rc == 0; i++) {
        if (strcmp(v[i]->name, v[i - 1]->name)) continue;
        if (same_box(v[i], v[i - 1]) && v[i]->lo < v[i - 1]->hi)
            rc = rerr(err, cap, "%s: pieces of '%s' overlap ([%llu,%llu) and [%llu,%llu))", path, v[i]->name,
                      (unsigned long long)v[i - 1]->lo, (unsigned long long)v[i - 1]->hi,
                      (unsigned long long)v[i]->lo, (unsigned long long)v[i]->hi);
    }
    /* distinct boxes of one name must not meet (a few per tensor: every pair) */
    for (int i = 0; i < k && rc == 0; i++)
        for (int j = i + 1; j < k && !strcmp(v[i]->name, v[j]->name) && rc == 0; j++)
            if (!same_box(v[i], v[j]) && boxes_meet(v[i], v[j]) && v[i]->lo < v[i]->hi && v[j]->lo < v[j]->hi)
                rc = rerr(err, cap, "%s: pieces of '%s' overlap (boxes rows %llu:%llu cols %llu:%llu and rows "
                          "%llu:%llu cols %llu:%llu)", path, v[i]->name, (unsigned long long)v[i]->r0,
                          (unsigned long long)v[i]->r1, (unsigned long long)v[i]->c0, (unsigned long long)v[i]->c1,
                          (unsigned long long)v[j]->r0, (unsigned long long)v[j]->r1, (unsigned long long)v[j]->c0,
                          (unsigned long long)v[j]->c1);
    free(v);
    return rc;
}

static int header_int(const char *line, const char *key) {
    char b[32];
    uint64_t v;
    return parse_u64(field(line, key, b, sizeof b), &v) || v > INT32_MAX ? 0 : (int)v;
}

/* "WORD N" with N a decimal in [0, INT64_MAX]; -1 if line is not that. */
static int header_num(const char *line, const char *word, int64_t *out) {
    size_t k = strlen(word);
    uint64_t v;
    if (strncmp(line, word, k) || line[k] != ' ' || parse_u64(line + k + 1, &v) || v > INT64_MAX) return -1;
    *out = (int64_t)v;
    return 0;
}

static int man_read(const char *dir, Manifest *m, char *err, size_t cap) {
    memset(m, 0, sizeof *m);
    kiln_strlcpy(m->dir, dir, sizeof m->dir);
    char path[1400];
    snprintf(path, sizeof path, "%s/%s", dir, CKPT_MANIFEST_NAME);
    size_t len;
    char *text = kiln_read_file_max(path, CKPT_MANIFEST_MAX, &len);
    if (!text) return rerr(err, cap, "%s: cannot read the manifest: %s", path, kiln_strerror(errno));
    int rc = -1;
    /* the version first, so a newer format is named as such, not as damage */
    int64_t format = 0;
    size_t l1 = strcspn(text, "\n");
    char first[64];
    snprintf(first, sizeof first, "%.*s", (int)(l1 < sizeof first - 1 ? l1 : sizeof first - 1), text);
    if (l1 >= sizeof first || header_num(first, "kiln-checkpoint", &format) != 0) {
        rerr(err, cap, "%s:1: not a kiln checkpoint manifest", path);
        goto out;
    }
    if (format != CKPT_FORMAT_VERSION) {
        rerr(err, cap, "%s:1: checkpoint format version %lld; this kiln reads version %d", path, (long long)format,
             CKPT_FORMAT_VERSION);
        goto out;
    }
    m->info.format = (int)format;
    /* the last line is "end crc32c=X" over every byte before it */
    char *endl = len >= 2 ? memrchr(text, '\n', len - 1) : NULL;
    size_t body = endl ? (size_t)(endl + 1 - text) : 0;
    unsigned crc_want;
    if (len == 0 || text[len - 1] != '\n' || sscanf(text + body, "end crc32c=%8x", &crc_want) != 1) {
        rerr(err, cap, "%s: incomplete manifest (no end line)", path);
        goto out;
    }
    if (ckpt_crc32c(0, text, body) != crc_want) {
        rerr(err, cap, "%s: manifest checksum mismatch (the file was changed or damaged)", path);
        goto out;
    }
    text[body] = 0;
    int lineno = 0, cap_e = 0, have_step = 0;
    char *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        lineno++;
        if (lineno == 1) continue; /* the version, read above */
        if (!strncmp(line, "entry ", 6)) {
            if (m->n == cap_e) cap_e = cap_e ? 2 * cap_e : 64, m->e = xrealloc(m->e, (size_t)cap_e * sizeof *m->e);
            if (parse_entry(line + 6, &m->e[m->n]) != 0) {
                rerr(err, cap, "%s:%d: malformed entry line", path, lineno);
                goto out;
            }
            m->n++;
        } else if (!strncmp(line, "step ", 5)) {
            if (header_num(line, "step", &m->info.step) != 0) {
                rerr(err, cap, "%s:%d: malformed step line (a step is a whole number from 0 to 2^63 - 1)", path, lineno);
                goto out;
            }
            have_step = 1;
        } else if (sscanf(line, "config_hash %" SCNx64, &m->info.config_hash) == 1) {
        } else if (sscanf(line, "kiln_version %63s", m->info.version) == 1) {
        } else if (sscanf(line, "kiln_commit %63s", m->info.commit) == 1) {
        } else if (!strncmp(line, "mesh ", 5)) {
            CkptMesh *g = &m->info.mesh;
            g->world = header_int(line, "world"), g->dp = header_int(line, "dp"), g->tp = header_int(line, "tp");
            g->pp = header_int(line, "pp"), g->cp = header_int(line, "cp"), g->ep = header_int(line, "ep");
        } /* other lines (file, created_unix, future keys) are informational */
    }
    if (!have_step) {
        rerr(err, cap, "%s: manifest has no step line", path);
        goto out;
    }
    rc = manifest_check_overlap(m, path, err, cap);
out:
    free(text);
    if (rc) man_free(m); /* --resume auto reads every damaged checkpoint it skips */
    return rc;
}

/* Piece e against the size of its file at path: the file holds it, and its
 * stored bytes can hold e->bytes (zstd's densest ratio). 0, or -1 with err. */
static int piece_fits(const MEntry *e, uint64_t size, const char *path, char *err, size_t cap) {
    if (e->offset + e->stored > size) /* no overflow: parse_entry bounds both */
        return rerr(err, cap, "%s: truncated: entry '%s' needs bytes %" PRIu64 "..%" PRIu64 ", file ends at %" PRIu64,
                    path, e->name, e->offset, e->offset + e->stored, size);
    if (e->zstd && e->bytes / CKPT_ZSTD_MAX_RATIO > e->stored)
        return rerr(err, cap, "%s: entry '%s': %" PRIu64 " bytes cannot decompress from %" PRIu64 " stored (the manifest "
                    "is wrong)", path, e->name, e->bytes, e->stored);
    return 0;
}

/* Open piece e's file and check that it holds the piece and that the piece
 * can hold e->bytes (zstd's densest ratio): what the manifest says is then
 * safe to allocate. Returns the descriptor, or -1 with err. */
static int piece_open(const Manifest *m, const MEntry *e, char *err, size_t cap) {
    char path[1400];
    snprintf(path, sizeof path, "%s/%s", m->dir, e->file);
    uint64_t size;
    int fd = kiln_open_read(path, 0, &size);
    if (fd < 0) return rerr(err, cap, "%s: cannot open: %s", path, kiln_strerror(errno));
    if (piece_fits(e, size, path, err, cap) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* The sizes of piece e, checked against its file (piece_open): before
 * allocating e->bytes. 0, or -1 with err. */
static int piece_check(const Manifest *m, const MEntry *e, char *err, size_t cap) {
    int fd = piece_open(m, e, err, cap);
    if (fd < 0) return -1;
    close(fd);
    return 0;
}

/* Read piece e into out (e->bytes), verifying its checksum. */
static int piece_read(const Manifest *m, const MEntry *e, void *out, char *err, size_t cap) {
    char path[1400];
    snprintf(path, sizeof path, "%s/%s", m->dir, e->file);
    int fd = piece_open(m, e, err, cap);
    if (fd < 0) return -1;
    unsigned char *buf = e->zstd ? xmalloc(e->stored ? e->stored : 1) : out;
    uint64_t got = 0;
    while (got < e->stored) {
        ssize_t r = pread(fd, buf + got, e->stored - got, (off_t)(e->offset + got));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (uint64_t)r;
    }
    close(fd);
    if (got < e->stored) {
        if (e->zstd) free(buf);
        return rerr(err, cap, "%s: truncated: entry '%s' needs bytes %" PRIu64 "..%" PRIu64 ", file ends at %" PRIu64,
                    path, e->name, e->offset, e->offset + e->stored, e->offset + got);
    }
    if (e->zstd) {
        size_t n = ZSTD_decompress(out, e->bytes, buf, e->stored);
        free(buf);
        if (ZSTD_isError(n) || n != e->bytes)
            return rerr(err, cap, "%s: entry '%s': corrupt zstd data (%s)", path, e->name,
                        ZSTD_isError(n) ? ZSTD_getErrorName(n) : "wrong size");
    }
    uint32_t crc = ckpt_crc32c(0, out, e->bytes);
    if (crc != e->crc)
        return rerr(err, cap, "%s: entry '%s': checksum mismatch (crc32c %08x in the manifest, %08x read)", path,
                    e->name, e->crc, crc);
    return 0;
}

static void shape_text(int ndim, const int64_t *shape, char *buf, size_t cap) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < ndim && n < cap; d++) n += (size_t)snprintf(buf + n, cap - n, "%s%" PRId64, d ? "," : "", shape[d]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

/* A range [lo, hi) of a box of a rows x cols tensor (see CkptEntry). */
typedef struct BoxRange {
    uint64_t r0, r1, c0, c1, lo, hi;
} BoxRange;

static BoxRange entry_range(const CkptEntry *e) {
    uint64_t rows, cols;
    ckpt_tensor_rc(e->ndim, e->shape, &rows, &cols);
    if (!e->r1) return (BoxRange){0, rows, 0, cols, e->lo, e->hi};
    return (BoxRange){e->r0, e->r1, e->c0, e->c1, e->lo, e->hi};
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* The elements that range e (to fill, at dst) and saved range p (at src)
 * share, of a tensor with `cols` columns: counted, and copied when dst is
 * set (es bytes each). Full-width boxes are flat ranges of the tensor: one
 * copy; others meet row by row. */
static uint64_t range_meet(const BoxRange *e, const BoxRange *p, uint64_t cols, unsigned char *dst,
                           const unsigned char *src, size_t es) {
    if (e->c0 == 0 && e->c1 == cols && p->c0 == 0 && p->c1 == cols) {
        uint64_t e0 = e->r0 * cols + e->lo, e1 = e->r0 * cols + e->hi, p0 = p->r0 * cols + p->lo,
                 p1 = p->r0 * cols + p->hi;
        uint64_t a = e0 > p0 ? e0 : p0, b = e1 < p1 ? e1 : p1;
        if (a >= b) return 0;
        if (dst) memcpy(dst + (a - e0) * es, src + (a - p0) * es, (size_t)(b - a) * es);
        return b - a;
    }
    int64_t ew = (int64_t)(e->c1 - e->c0), pw = (int64_t)(p->c1 - p->c0), n = 0;
    int64_t r0 = max64((int64_t)e->r0, (int64_t)p->r0), r1 = min64((int64_t)e->r1, (int64_t)p->r1);
    for (int64_t r = r0; r < r1; r++) {
        int64_t eb = (r - (int64_t)e->r0) * ew - (int64_t)e->c0, pb = (r - (int64_t)p->r0) * pw - (int64_t)p->c0;
        /* column c is element eb + c of e's range and pb + c of p's */
        int64_t c0 = max64(max64((int64_t)e->c0, (int64_t)p->c0), max64((int64_t)e->lo - eb, (int64_t)p->lo - pb));
        int64_t c1 = min64(min64((int64_t)e->c1, (int64_t)p->c1), min64((int64_t)e->hi - eb, (int64_t)p->hi - pb));
        if (c0 >= c1) continue;
        if (dst)
            memcpy(dst + (size_t)(eb + c0 - (int64_t)e->lo) * es, src + (size_t)(pb + c0 - (int64_t)p->lo) * es,
                   (size_t)(c1 - c0) * es);
        n += c1 - c0;
    }
    return (uint64_t)n;
}

/* The bytes of saved range p at piece bytes [s0, s0 + n) (at src) that range
 * e holds, copied to dst (e's elements from e->lo, es bytes each): the
 * streaming form of range_meet. Byte offsets, since a read may end inside an
 * element. */
static void copy_run(unsigned char *dst, uint64_t pb, uint64_t len, const unsigned char *src, uint64_t s0,
                     uint64_t s1) {
    /* the run is piece bytes [pb, pb + len), going to dst[0, len) */
    uint64_t a = pb > s0 ? pb : s0, b = pb + len < s1 ? pb + len : s1;
    if (a < b) memcpy(dst + (a - pb), src + (a - s0), (size_t)(b - a));
}

static void range_copy_span(const BoxRange *e, const BoxRange *p, uint64_t cols, size_t es, unsigned char *dst,
                            const unsigned char *src, uint64_t s0, uint64_t n) {
    uint64_t s1 = s0 + n;
    if (n == 0) return;
    if (e->c0 == 0 && e->c1 == cols && p->c0 == 0 && p->c1 == cols) {
        uint64_t e0 = e->r0 * cols + e->lo, e1 = e->r0 * cols + e->hi, p0 = p->r0 * cols + p->lo,
                 p1 = p->r0 * cols + p->hi;
        uint64_t a = e0 > p0 ? e0 : p0, b = e1 < p1 ? e1 : p1;
        if (a < b) copy_run(dst + (a - e0) * es, (a - p0) * es, (b - a) * es, src, s0, s1);
        return;
    }
    /* the box rows of p whose elements the span touches (piece element k is
     * element p->lo + k of p's box), within e's rows */
    int64_t ew = (int64_t)(e->c1 - e->c0), pw = (int64_t)(p->c1 - p->c0);
    uint64_t k0 = s0 / es, k1 = (s1 + es - 1) / es;
    int64_t r0 = max64((int64_t)e->r0, (int64_t)(p->r0 + (p->lo + k0) / (uint64_t)pw));
    int64_t r1 = min64((int64_t)e->r1, (int64_t)(p->r0 + (p->lo + k1 - 1) / (uint64_t)pw + 1));
    for (int64_t r = r0; r < r1; r++) {
        int64_t eb = (r - (int64_t)e->r0) * ew - (int64_t)e->c0, pb = (r - (int64_t)p->r0) * pw - (int64_t)p->c0;
        int64_t c0 = max64(max64((int64_t)e->c0, (int64_t)p->c0), max64((int64_t)e->lo - eb, (int64_t)p->lo - pb));
        int64_t c1 = min64(min64((int64_t)e->c1, (int64_t)p->c1), min64((int64_t)e->hi - eb, (int64_t)p->hi - pb));
        if (c0 >= c1) continue;
        copy_run(dst + (size_t)(eb + c0 - (int64_t)e->lo) * es, (uint64_t)(pb + c0 - (int64_t)p->lo) * es,
                 (uint64_t)(c1 - c0) * es, src, s0, s1);
    }
}

/* ---------- streaming reads ----------
 * A load or a verify reads each rank file it needs once, front to back
 * (ckpt_io's source: O_DIRECT chunks read ahead by two threads, or the page
 * cache's read-ahead; adjacent pieces share a read, pieces no entry needs
 * are skipped), and every piece's bytes pass once through CRC32C and on to
 * whatever entries need them. */

typedef struct {
    int j;     /* manifest piece */
    int entry; /* table entry it fills, -1: only verified */
} RdNeed;

typedef struct {
    const Manifest *m;
    const CkptTable *t; /* NULL: verify only */
    CkptSource *src;
    const char *file;   /* the open file's name */
    char path[1400];
    uint64_t *lo, *hi;  /* (pieces) the open file's ranges */
    ZSTD_DCtx *dz;
    unsigned char *zout; /* (CKPT_IO_CHUNK) decompressed bytes */
    unsigned char **host; /* (t->n) where each entry's bytes are assembled: its memory, or a
                             scratch buffer (to_device) taken when first needed */
    size_t *host_cap;   /* (t->n) the scratch buffers' sizes */
    BoxRange *er;       /* (t->n) */
    uint64_t bytes;     /* read, for the caller's figures */
    /* scratch buffers of entries sent when complete, kept for the next
     * (fresh pages cost a fault each; one or two buffers serve a whole load) */
    unsigned char *spare[4];
    size_t spare_cap[4];
} Rd;

/* A scratch buffer of at least n bytes: a spare one if it fits or can grow. */
static unsigned char *rd_scratch(Rd *r, size_t n, size_t *cap) {
    int fit = -1, big = -1; /* the smallest spare that fits, else the largest, grown */
    for (int k = 0; k < 4; k++) {
        if (!r->spare[k]) continue;
        if (r->spare_cap[k] >= n && (fit < 0 || r->spare_cap[k] < r->spare_cap[fit])) fit = k;
        if (big < 0 || r->spare_cap[k] > r->spare_cap[big]) big = k;
    }
    int best = fit >= 0 ? fit : big;
    if (best < 0) {
        *cap = n;
        return xmalloc(n ? n : 1);
    }
    unsigned char *p = r->spare[best];
    *cap = r->spare_cap[best];
    r->spare[best] = NULL;
    if (*cap < n) p = xrealloc(p, n), *cap = n;
    return p;
}

static void rd_spare(Rd *r, unsigned char *p, size_t cap) {
    for (int k = 0; k < 4; k++)
        if (!r->spare[k]) {
            r->spare[k] = p, r->spare_cap[k] = cap;
            return;
        }
    free(p);
}

static int need_by_place(const void *a, const void *b, void *m_) {
    const Manifest *m = m_;
    const RdNeed *x = a, *y = b;
    const MEntry *p = &m->e[x->j], *q = &m->e[y->j];
    int c = strcmp(p->file, q->file);
    if (!c) c = cmp_u64(p->offset, q->offset);
    if (!c) c = x->j - y->j;
    return c ? c : x->entry - y->entry;
}

/* File bytes [off, off + len): a pointer and *got of them; NULL at the end
 * of the file (*got = where it ends) or on an error (*got = 0, errno). */
static const unsigned char *rd_get(Rd *r, uint64_t off, uint64_t len, uint64_t *got) {
    return ckpt_source_get(r->src, off, len, got);
}

/* Uncompressed piece bytes [s0, s0 + n) at q: to every entry of needs[0, nn). */
static void rd_scatter(Rd *r, const MEntry *p, const RdNeed *needs, int nn, const unsigned char *q, uint64_t s0,
                       uint64_t n) {
    BoxRange pr = {p->r0, p->r1, p->c0, p->c1, p->lo, p->hi};
    for (int k = 0; k < nn; k++) {
        int i = needs[k].entry;
        if (i < 0) continue;
        const CkptEntry *e = &r->t->e[i];
        uint64_t rows, cols;
        ckpt_tensor_rc(e->ndim, e->shape, &rows, &cols);
        range_copy_span(&r->er[i], &pr, cols, ckpt_dtype_size(e->dtype), r->host[i], q, s0, n);
    }
}

/* Bytes [s0, s0 + n) of the piece at q: checksummed and scattered block by
 * block, each copied out while the checksum has it in the cache. */
static uint32_t rd_consume(Rd *r, const MEntry *p, const RdNeed *needs, int nn, const unsigned char *q, uint64_t s0,
                           uint64_t n, uint32_t crc) {
    const uint64_t block = 256 << 10;
    for (uint64_t k = 0; k < n; k += block) {
        uint64_t len = n - k < block ? n - k : block;
        crc = ckpt_crc32c(crc, q + k, (size_t)len);
        rd_scatter(r, p, needs, nn, q + k, s0 + k, len);
    }
    return crc;
}

/* Piece needs[0].j, every byte in order: checksummed and scattered. */
static int rd_piece(Rd *r, const RdNeed *needs, int nn, char *err, size_t cap) {
    const MEntry *p = &r->m->e[needs[0].j];
    uint32_t crc = 0;
    uint64_t got, produced = 0;
    if (!p->zstd) {
        for (uint64_t off = 0; off < p->bytes; off += got) {
            const unsigned char *q = rd_get(r, p->offset + off, p->bytes - off, &got);
            if (!q && !got) return rerr(err, cap, "%s: read: %s", r->path, kiln_strerror(errno));
            if (!q)
                return rerr(err, cap, "%s: truncated: entry '%s' needs bytes %" PRIu64 "..%" PRIu64
                            ", file ends at %" PRIu64, r->path, p->name, p->offset, p->offset + p->stored, got);
            crc = rd_consume(r, p, needs, nn, q, off, got, crc);
        }
        produced = p->bytes;
    } else {
        if (!r->dz) r->dz = ZSTD_createDCtx(), r->zout = xmalloc(CKPT_IO_CHUNK);
        if (!r->dz) kiln_fail(KILN_EXIT_RUNTIME, "ZSTD_createDCtx failed");
        ZSTD_DCtx_reset(r->dz, ZSTD_reset_session_only);
        ZSTD_inBuffer in = {NULL, 0, 0};
        uint64_t in_off = 0;
        size_t ret = 1;
        while (ret != 0) {
            if (in.pos == in.size) {
                if (in_off == p->stored) break; /* the frame is not complete */
                const unsigned char *q = rd_get(r, p->offset + in_off, p->stored - in_off, &got);
                if (!q && !got) return rerr(err, cap, "%s: read: %s", r->path, kiln_strerror(errno));
                if (!q)
                    return rerr(err, cap, "%s: truncated: entry '%s' needs bytes %" PRIu64 "..%" PRIu64
                                ", file ends at %" PRIu64, r->path, p->name, p->offset, p->offset + p->stored, got);
                in = (ZSTD_inBuffer){q, (size_t)got, 0};
                in_off += got;
            }
            ZSTD_outBuffer out = {r->zout, CKPT_IO_CHUNK, 0};
            ret = ZSTD_decompressStream(r->dz, &out, &in);
            if (ZSTD_isError(ret))
                return rerr(err, cap, "%s: entry '%s': corrupt zstd data (%s)", r->path, p->name,
                            ZSTD_getErrorName(ret));
            if (produced + out.pos > p->bytes) break;
            if (!out.pos) continue;
            crc = rd_consume(r, p, needs, nn, r->zout, produced, out.pos, crc);
            produced += out.pos;
        }
        if (ret != 0 || produced != p->bytes || in_off != p->stored || in.pos != in.size)
            return rerr(err, cap, "%s: entry '%s': corrupt zstd data (wrong size)", r->path, p->name);
    }
    r->bytes += p->stored;
    if (crc != p->crc)
        return rerr(err, cap, "%s: entry '%s': checksum mismatch (crc32c %08x in the manifest, %08x read)", r->path,
                    p->name, p->crc, crc);
    return 0;
}

/* Read every piece of needs[0, n) (sorted in place by file and offset),
 * each once, whatever number of entries it fills. left[i]: needs of entry i
 * not yet read; an entry with a to_device copy is sent once its last
 * piece is in. */
static int rd_run(Rd *r, RdNeed *needs, int n, uint64_t *left, char *err, size_t cap) {
    if (n > 1) qsort_r(needs, (size_t)n, sizeof *needs, need_by_place, (void *)r->m); /* needs is NULL for none */
    r->lo = xmalloc((size_t)(n ? n : 1) * sizeof *r->lo);
    r->hi = xmalloc((size_t)(n ? n : 1) * sizeof *r->hi);
    int rc = 0;
    for (int k = 0; k < n && rc == 0;) {
        const MEntry *p = &r->m->e[needs[k].j];
        int nn = 1;
        while (k + nn < n && needs[k + nn].j == needs[k].j) nn++;
        if (!r->file || strcmp(r->file, p->file)) {
            /* the next file: the ranges of its pieces, in order */
            int nr = 0;
            for (int l = k; l < n && !strcmp(r->m->e[needs[l].j].file, p->file); l++) {
                const MEntry *q = &r->m->e[needs[l].j];
                if (l > k && needs[l].j == needs[l - 1].j) continue;
                r->lo[nr] = q->offset, r->hi[nr++] = q->offset + q->stored;
            }
            r->file = p->file;
            snprintf(r->path, sizeof r->path, "%s/%s", r->m->dir, p->file);
            if (ckpt_source_open(r->src, r->path, r->lo, r->hi, nr) != 0) {
                rc = rerr(err, cap, "%s: cannot open: %s", r->path, kiln_strerror(errno));
                break;
            }
            /* the file's pieces against its real size, before any is read */
            for (int l = k; l < n && rc == 0 && !strcmp(r->m->e[needs[l].j].file, p->file); l++)
                rc = piece_fits(&r->m->e[needs[l].j], ckpt_source_size(r->src), r->path, err, cap);
            if (rc) break;
        }
        for (int l = k; l < k + nn; l++) {
            int i = needs[l].entry;
            if (i >= 0 && r->t->e[i].to_device && !r->host[i])
                r->host[i] = rd_scratch(r, ckpt_entry_bytes(&r->t->e[i]), &r->host_cap[i]);
        }
        rc = rd_piece(r, needs + k, nn, err, cap);
        for (int l = k; l < k + nn && rc == 0; l++) {
            int i = needs[l].entry;
            if (i < 0 || --left[i] > 0) continue;
            const CkptEntry *e = &r->t->e[i];
            if (e->to_device) {
                e->to_device(e->ptr, r->host[i], ckpt_entry_bytes(e));
                rd_spare(r, r->host[i], r->host_cap[i]);
                r->host[i] = NULL;
            }
        }
        k += nn;
    }
    ckpt_source_close(r->src);
    return rc;
}

static void rd_free(Rd *r) {
    ckpt_source_free(r->src);
    free(r->lo);
    free(r->hi);
    if (r->host)
        for (int i = 0; i < r->t->n; i++)
            if (r->t->e[i].to_device) free(r->host[i]);
    for (int k = 0; k < 4; k++) free(r->spare[k]);
    free(r->host);
    free(r->host_cap);
    free(r->er);
    free(r->zout);
    if (r->dz) ZSTD_freeDCtx(r->dz);
}

static int mentry_by_name_index(const void *a, const void *b, void *m_) {
    const Manifest *m = m_;
    int x = *(const int *)a, y = *(const int *)b;
    int c = strcmp(m->e[x].name, m->e[y].name);
    return c ? c : x - y;
}

int ckpt_load(const char *dir, const CkptTable *t, CkptInfo *info, char *err, size_t cap) {
    Manifest m;
    if (man_read(dir, &m, err, cap) != 0) return -1;
    if (info) *info = m.info;
    int rc = -1, nneed = 0, need_cap = 0;
    RdNeed *needs = NULL;
    uint64_t *left = xcalloc((size_t)(t->n ? t->n : 1), sizeof *left);
    Rd r = {.m = &m, .t = t};
    r.host = xcalloc((size_t)(t->n ? t->n : 1), sizeof *r.host);
    r.host_cap = xcalloc((size_t)(t->n ? t->n : 1), sizeof *r.host_cap);
    r.er = xmalloc((size_t)(t->n ? t->n : 1) * sizeof *r.er);
    /* the pieces of each name, in manifest order */
    int *byname = xmalloc((size_t)(m.n ? m.n : 1) * sizeof *byname);
    for (int j = 0; j < m.n; j++) byname[j] = j;
    qsort_r(byname, (size_t)m.n, sizeof *byname, mentry_by_name_index, &m);
    /* plan: which pieces fill which entries; every refusal comes before any read */
    for (int i = 0; i < t->n; i++) {
        const CkptEntry *e = &t->e[i];
        int lo = 0, hi = m.n;
        while (lo < hi) {
            int mid = (lo + hi) / 2;
            if (strcmp(m.e[byname[mid]].name, e->name) < 0) lo = mid + 1;
            else hi = mid;
        }
        if (lo == m.n || strcmp(m.e[byname[lo]].name, e->name)) {
            rerr(err, cap, "%s: no entry '%s' in the checkpoint", dir, e->name);
            goto out;
        }
        r.er[i] = entry_range(e);
        if (!e->to_device) r.host[i] = e->ptr;
        uint64_t rows, cols, covered = 0;
        ckpt_tensor_rc(e->ndim, e->shape, &rows, &cols);
        for (int k = lo; k < m.n && !strcmp(m.e[byname[k]].name, e->name); k++) {
            const MEntry *p = &m.e[byname[k]];
            char a[128], b[128];
            shape_text(p->ndim, p->shape, a, sizeof a);
            shape_text(e->ndim, e->shape, b, sizeof b);
            if (p->dtype != (int)e->dtype || strcmp(a, b)) {
                rerr(err, cap, "%s: entry '%s' is %s %s in the checkpoint but %s %s in this run", dir, e->name,
                     ckpt_dtype_name(p->dtype), a, ckpt_dtype_name(e->dtype), b);
                goto out;
            }
            /* a blob is written once (per-rank state has per-rank names): the
             * first piece of the name is it */
            if (e->kind == CKPT_BLOB && covered > 0) continue;
            BoxRange pr = {p->r0, p->r1, p->c0, p->c1, p->lo, p->hi};
            uint64_t n = range_meet(&r.er[i], &pr, cols, NULL, NULL, ckpt_dtype_size(e->dtype));
            if (n == 0 && !(e->lo == e->hi && p->lo == p->hi)) continue;
            if (nneed == need_cap) need_cap = need_cap ? 2 * need_cap : 256, needs = xrealloc(needs, (size_t)need_cap * sizeof *needs);
            needs[nneed++] = (RdNeed){.j = byname[k], .entry = i};
            left[i]++;
            covered += n;
        }
        if (covered != e->hi - e->lo) {
            rerr(err, cap, "%s: entry '%s': the saved pieces cover %" PRIu64 " of the %" PRIu64 " elements needed", dir,
                 e->name, covered, e->hi - e->lo);
            goto out;
        }
    }
    r.src = ckpt_source_new();
    rc = rd_run(&r, needs, nneed, left, err, cap);
out:
    free(byname);
    free(needs);
    free(left);
    rd_free(&r);
    man_free(&m);
    return rc;
}

int ckpt_verify(const char *dir, CkptInfo *info, char *err, size_t cap) {
    Manifest m;
    if (man_read(dir, &m, err, cap) != 0) return -1;
    if (info) *info = m.info;
    RdNeed *needs = xmalloc((size_t)(m.n ? m.n : 1) * sizeof *needs);
    for (int j = 0; j < m.n; j++) needs[j] = (RdNeed){.j = j, .entry = -1};
    Rd r = {.m = &m, .src = ckpt_source_new()};
    int rc = rd_run(&r, needs, m.n, NULL, err, cap);
    free(needs);
    rd_free(&r);
    man_free(&m);
    return rc;
}

void *ckpt_read_blob(const char *dir, const char *name, size_t *len, char *err, size_t cap) {
    Manifest m;
    err[0] = 0;
    if (man_read(dir, &m, err, cap) != 0) return NULL;
    void *out = NULL;
    for (int j = 0; j < m.n; j++) {
        if (strcmp(m.e[j].name, name)) continue;
        if (m.e[j].kind != CKPT_BLOB || m.e[j].bytes > CKPT_BLOB_MAX) {
            rerr(err, cap, "%s: entry '%s' is not a blob of at most %" PRIu64 " bytes (the manifest says %s of %" PRIu64
                 ")", dir, name, CKPT_BLOB_MAX, m.e[j].kind == CKPT_BLOB ? "a blob" : "a tensor", m.e[j].bytes);
            break;
        }
        if (piece_check(&m, &m.e[j], err, cap) != 0) break;
        out = xmalloc(m.e[j].bytes + 1);
        if (piece_read(&m, &m.e[j], out, err, cap) != 0) {
            free(out);
            out = NULL;
        } else {
            ((char *)out)[m.e[j].bytes] = 0; /* text blobs read as strings */
            if (len) *len = m.e[j].bytes;
        }
        break;
    }
    if (!out && !err[0]) rerr(err, cap, "%s: no entry '%s' in the checkpoint", dir, name);
    man_free(&m);
    return out;
}

int ckpt_is_checkpoint(const char *dir) {
    char path[1400];
    snprintf(path, sizeof path, "%s/%s", dir, CKPT_MANIFEST_NAME);
    return access(path, F_OK) == 0;
}

/* ---------- ./train ckpt-info ---------- */

int ckpt_info_main(int argc, char **argv) {
    if (argc != 2) kiln_fail(KILN_EXIT_USAGE, "usage: ./train ckpt-info CHECKPOINT_DIR");
    const char *dir = argv[1];
    char err[2048] = "";
    Manifest m;
    if (man_read(dir, &m, err, sizeof err) != 0) kiln_fail(KILN_EXIT_USAGE, "%s", err);
    printf("checkpoint %s\n", dir);
    printf("format %d | step %" PRId64 " | config_hash %016" PRIx64 " | kiln %s (commit %s)\n", m.info.format,
           m.info.step, m.info.config_hash, m.info.version, m.info.commit);
    printf("mesh world=%d dp=%d tp=%d pp=%d cp=%d ep=%d\n", m.info.mesh.world, m.info.mesh.dp, m.info.mesh.tp,
           m.info.mesh.pp, m.info.mesh.cp, m.info.mesh.ep);
    uint64_t raw = 0, stored = 0;
    uint32_t state = 0, params = 0;
    int bad = 0;
    char first[1024] = ""; /* the first failure, for the one error line */
    for (int j = 0; j < m.n; j++) {
        const MEntry *e = &m.e[j];
        char s[128];
        shape_text(e->ndim, e->shape, s, sizeof s);
        char perr[1024] = "";
        int ok = piece_check(&m, e, perr, sizeof perr) == 0;
        if (ok) {
            unsigned char *buf = xmalloc(e->bytes ? e->bytes : 1);
            ok = piece_read(&m, e, buf, perr, sizeof perr) == 0;
            free(buf);
        }
        printf("  %-6s %-40s %-4s %-14s range %" PRIu64 ":%" PRIu64 " rank %d %10" PRIu64 " B  crc32c %08x %s%s\n",
               e->kind == CKPT_TENSOR ? "tensor" : "blob", e->name, ckpt_dtype_name(e->dtype), s, e->lo, e->hi, e->rank,
               e->bytes, e->crc, ok ? "ok" : "BAD: ", ok ? "" : perr);
        if (!ok && !bad++) kiln_strlcpy(first, perr, sizeof first);
        raw += e->bytes, stored += e->stored;
        if (e->kind == CKPT_TENSOR) {
            state = ckpt_crc32c(state, &e->crc, 4);
            if (strncmp(e->name, "optim.", 6)) params = ckpt_crc32c(params, &e->crc, 4);
        }
    }
    printf("entries %d | %" PRIu64 " bytes, %" PRIu64 " stored\n", m.n, raw, stored);
    printf("params checksum %08x | state checksum %08x\n", params, state);
    man_free(&m);
    if (bad)
        kiln_fail(KILN_EXIT_USAGE, "%s: %d entr%s failed verification, the first: %s", dir, bad, bad == 1 ? "y" : "ies",
                  first);
    printf("verified\n");
    return KILN_EXIT_OK;
}

/* ---------- ./train ckpt-diff ---------- */

/* Every f32 tensor of checkpoint A, whole, from A and from B (each assembled
 * from whatever pieces and ranks wrote it): the largest absolute difference
 * per tensor, then over the parameters and over the optimizer state. Exit 0
 * when both load; with --tol X, exit 1 if a parameter differs by more. */
int ckpt_diff_main(int argc, char **argv) {
    const char *a = NULL, *b = NULL;
    double tol = -1;
    int quiet = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tol") && i + 1 < argc) tol = atof(argv[++i]);
        else if (!strcmp(argv[i], "--quiet")) quiet = 1;
        else if (!a) a = argv[i];
        else if (!b) b = argv[i];
        else a = NULL, i = argc;
    }
    if (!a || !b) kiln_fail(KILN_EXIT_USAGE, "usage: ./train ckpt-diff CKPT_A CKPT_B [--tol X] [--quiet]");
    char err[2048] = "";
    Manifest m;
    if (man_read(a, &m, err, sizeof err) != 0) kiln_fail(KILN_EXIT_USAGE, "%s", err);
    CkptTable ta, tb;
    ckpt_table_init(&ta);
    ckpt_table_init(&tb);
    for (int j = 0; j < m.n; j++) {
        const MEntry *e = &m.e[j];
        if (e->kind != CKPT_TENSOR || e->dtype != CKPT_F32) continue;
        int seen = 0;
        for (int k = 0; k < ta.n && !seen; k++) seen = !strcmp(ta.e[k].name, e->name);
        if (seen) continue;
        /* whole tensors of A's shapes: the pieces A holds of each must add
         * up to it (their sizes checked against A's files) before the
         * shape is believed and allocated, twice */
        uint64_t numel = 0, have = 0;
        shape_numel(e->ndim, e->shape, 4, &numel); /* checked by parse_entry */
        for (int k = 0; k < m.n; k++) {
            const MEntry *q = &m.e[k];
            if (strcmp(q->name, e->name)) continue;
            if (piece_check(&m, q, err, sizeof err) != 0) kiln_fail(KILN_EXIT_USAGE, "%s", err);
            if (__builtin_add_overflow(have, q->hi - q->lo, &have)) have = UINT64_MAX;
        }
        if (have < numel)
            kiln_fail(KILN_EXIT_USAGE, "%s: entry '%s': its pieces hold %" PRIu64 " of the %" PRIu64 " elements of its "
                      "shape", a, e->name, have, numel);
        ckpt_add_tensor(&ta, e->name, CKPT_F32, e->ndim, e->shape, 0, numel, xcalloc(numel + 1, 4), NULL, NULL);
        ckpt_add_tensor(&tb, e->name, CKPT_F32, e->ndim, e->shape, 0, numel, xcalloc(numel + 1, 4), NULL, NULL);
    }
    man_free(&m);
    if (ckpt_load(a, &ta, NULL, err, sizeof err) != 0) kiln_fail(KILN_EXIT_USAGE, "%s", err);
    if (ckpt_load(b, &tb, NULL, err, sizeof err) != 0) kiln_fail(KILN_EXIT_USAGE, "%s", err);
    double pmax = 0, omax = 0;
    const char *pworst = "-";
    for (int k = 0; k < ta.n; k++) {
        const float *x = ta.e[k].ptr, *y = tb.e[k].ptr;
        double mx = 0;
        for (uint64_t i = 0; i < ta.e[k].hi; i++) {
            double dd = fabs((double)x[i] - (double)y[i]);
            if (!(dd <= mx)) mx = dd; /* NaN wins */
        }
        if (!quiet) printf("  %-40s max abs diff %.3g\n", ta.e[k].name, mx);
        int opt = !strncmp(ta.e[k].name, "optim.", 6);
        if (opt && !(mx <= omax)) omax = mx;
        if (!opt && !(mx <= pmax)) pmax = mx, pworst = ta.e[k].name;
    }
    printf("params max abs diff %.3g (%s) | optimizer state max abs diff %.3g\n", pmax, pworst, omax);
    int bad = tol >= 0 && !(pmax <= tol);
    for (int k = 0; k < ta.n; k++) free(ta.e[k].ptr), free(tb.e[k].ptr);
    ckpt_table_free(&ta);
    ckpt_table_free(&tb);
    return bad ? KILN_EXIT_RUNTIME : KILN_EXIT_OK;
}
