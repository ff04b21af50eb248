/* safetensors: reader and writer (format: docs/formats.md "safetensors").
 * The JSON header is read by the small strict parser below, not libyaml: the
 * header has one fixed shape (an object of tensor objects with a string, an
 * integer array and a pair of integers, plus __metadata__'s string map), and a
 * hand parser checks exactly that — integers as uint64 with overflow refused,
 * no floats, no YAML-only syntax, errors that say which tensor — with every
 * read bounded by the buffer, so mutated headers (the fuzz loop in
 * test/test_safetensors.c) end in an error, never a crash. */
#include "safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "util.h"

static const char *dtype_names[] = {"F32", "BF16", "F16"};
size_t st_dtype_size(StDtype d) { return d == ST_F32 ? 4 : 2; }
const char *st_dtype_name(StDtype d) { return dtype_names[d]; }

/* ---------------------------------------------------------------- JSON header */

typedef struct Json {
    const char *p, *end;
    char *err;
    size_t cap;
    int failed;
} Json;

static int jfail(Json *j, const char *fmt, ...) {
    if (!j->failed) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(j->err, j->cap, fmt, ap);
        va_end(ap);
    }
    j->failed = 1;
    return -1;
}

static void jws(Json *j) {
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')) j->p++;
}

static int jexpect(Json *j, char c, const char *where) {
    jws(j);
    if (j->p >= j->end) return jfail(j, "header: JSON ends where '%c' was expected (%s)", c, where);
    if (*j->p != c) return jfail(j, "header: expected '%c' %s, found '%c'", c, where, *j->p);
    j->p++;
    return 0;
}

static int utf8_put(char *out, size_t cap, size_t *n, uint32_t cp) {
    unsigned char b[4];
    int k;
    if (cp < 0x80) b[0] = (unsigned char)cp, k = 1;
    else if (cp < 0x800) b[0] = 0xc0 | (cp >> 6), b[1] = 0x80 | (cp & 0x3f), k = 2;
    else if (cp < 0x10000) b[0] = 0xe0 | (cp >> 12), b[1] = 0x80 | ((cp >> 6) & 0x3f), b[2] = 0x80 | (cp & 0x3f), k = 3;
    else b[0] = 0xf0 | (cp >> 18), b[1] = 0x80 | ((cp >> 12) & 0x3f), b[2] = 0x80 | ((cp >> 6) & 0x3f),
         b[3] = 0x80 | (cp & 0x3f), k = 4;
    if (*n + (size_t)k >= cap) return -1;
    for (int i = 0; i < k; i++) out[(*n)++] = (char)b[i];
    return 0;
}

static int jhex4(Json *j, uint32_t *v) {
    if (j->end - j->p < 4) return jfail(j, "header: truncated \\u escape");
    *v = 0;
    for (int i = 0; i < 4; i++) {
        char c = *j->p++;
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return jfail(j, "header: bad \\u escape");
        *v = *v << 4 | (uint32_t)d;
    }
    return 0;
}

/* A JSON string into out (NUL-terminated; longer than cap-1 bytes is an error). */
static int jstring(Json *j, char *out, size_t cap) {
    if (jexpect(j, '"', "to open a string")) return -1;
    size_t n = 0;
    for (;;) {
        if (j->p >= j->end) return jfail(j, "header: unterminated string");
        unsigned char c = (unsigned char)*j->p++;
        if (c == '"') break;
        if (c < 0x20) return jfail(j, "header: control character in a string");
        if (c == '\\') {
            if (j->p >= j->end) return jfail(j, "header: unterminated string");
            char e = *j->p++;
            uint32_t cp;
            switch (e) {
            case '"': case '\\': case '/': cp = (uint32_t)e; break;
            case 'b': cp = '\b'; break;
            case 'f': cp = '\f'; break;
            case 'n': cp = '\n'; break;
            case 'r': cp = '\r'; break;
            case 't': cp = '\t'; break;
            case 'u':
                if (jhex4(j, &cp)) return -1;
                if (cp >= 0xd800 && cp < 0xdc00) { /* a surrogate pair */
                    uint32_t lo;
                    if (j->end - j->p < 2 || j->p[0] != '\\' || j->p[1] != 'u')
                        return jfail(j, "header: lone surrogate in \\u escape");
                    j->p += 2;
                    if (jhex4(j, &lo)) return -1;
                    if (lo < 0xdc00 || lo >= 0xe000) return jfail(j, "header: bad surrogate pair");
                    cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                } else if (cp >= 0xdc00 && cp < 0xe000) return jfail(j, "header: lone surrogate in \\u escape");
                if (cp == 0) return jfail(j, "header: NUL in a string");
                break;
            default: return jfail(j, "header: bad escape '\\%c'", e);
            }
            if (utf8_put(out, cap, &n, cp)) return jfail(j, "header: string longer than %zu bytes", cap - 1);
        } else if (n + 1 < cap) out[n++] = (char)c; /* raw bytes as they are (UTF-8 is not re-checked) */
        else return jfail(j, "header: string longer than %zu bytes", cap - 1);
    }
    out[n] = 0;
    return 0;
}

/* An unsigned integer (no sign, fraction or exponent), overflow refused. */
static int juint(Json *j, uint64_t *v) {
    jws(j);
    if (j->p >= j->end || *j->p < '0' || *j->p > '9') return jfail(j, "header: expected a non-negative integer");
    if (*j->p == '0' && j->end - j->p > 1 && j->p[1] >= '0' && j->p[1] <= '9')
        return jfail(j, "header: integer with a leading zero");
    *v = 0;
    while (j->p < j->end && *j->p >= '0' && *j->p <= '9') {
        uint64_t d = (uint64_t)(*j->p++ - '0');
        if (*v > (UINT64_MAX - d) / 10) return jfail(j, "header: integer beyond 2^64");
        *v = *v * 10 + d;
    }
    if (j->p < j->end && (*j->p == '.' || *j->p == 'e' || *j->p == 'E'))
        return jfail(j, "header: expected an integer, found a fraction or exponent");
    return 0;
}

/* [u, u, ...] into v (at most max; *n the count). */
static int juint_array(Json *j, uint64_t *v, int max, int *n, const char *what) {
    if (jexpect(j, '[', what)) return -1;
    *n = 0;
    jws(j);
    if (j->p < j->end && *j->p == ']') return j->p++, 0;
    for (;;) {
        if (*n == max) return jfail(j, "header: %s has more than %d entries", what, max);
        if (juint(j, &v[(*n)++])) return -1;
        jws(j);
        if (j->p < j->end && *j->p == ',') { j->p++; continue; }
        return jexpect(j, ']', what);
    }
}

/* __metadata__: an object of string values (kept nowhere: kiln reads none). */
static int jmetadata(Json *j) {
    char s[ST_NAME * 4];
    if (jexpect(j, '{', "to open __metadata__")) return -1;
    jws(j);
    if (j->p < j->end && *j->p == '}') return j->p++, 0;
    for (;;) {
        if (jstring(j, s, sizeof s) || jexpect(j, ':', "in __metadata__") || jstring(j, s, sizeof s)) return -1;
        jws(j);
        if (j->p < j->end && *j->p == ',') { j->p++; continue; }
        return jexpect(j, '}', "to close __metadata__");
    }
}

/* {"dtype": ..., "shape": [...], "data_offsets": [b, e]}, keys in any order. */
static int jtensor(Json *j, StTensor *t) {
    int seen[3] = {0, 0, 0};
    uint64_t dims[ST_MAX_DIM], off[2];
    char key[32], dt[16];
    if (jexpect(j, '{', "to open a tensor")) return -1;
    for (;;) {
        if (jstring(j, key, sizeof key) || jexpect(j, ':', "after a tensor key")) return -1;
        int k = !strcmp(key, "dtype") ? 0 : !strcmp(key, "shape") ? 1 : !strcmp(key, "data_offsets") ? 2 : -1;
        if (k < 0) return jfail(j, "tensor '%s': unknown key '%s'", t->name, key);
        if (seen[k]++) return jfail(j, "tensor '%s': key '%s' twice", t->name, key);
        if (k == 0) {
            if (jstring(j, dt, sizeof dt)) return -1;
            int d = -1;
            for (int i = 0; i < 3; i++)
                if (!strcmp(dt, dtype_names[i])) d = i;
            if (d < 0) return jfail(j, "tensor '%s': unknown dtype '%s' (kiln reads F32, BF16, F16)", t->name, dt);
            t->dtype = (StDtype)d;
        } else if (k == 1) {
            if (juint_array(j, dims, ST_MAX_DIM, &t->ndim, "shape")) return -1;
            for (int i = 0; i < t->ndim; i++) {
                if (dims[i] > INT64_MAX) return jfail(j, "tensor '%s': shape entry beyond 2^63", t->name);
                t->shape[i] = (int64_t)dims[i];
            }
        } else {
            int n;
            if (juint_array(j, off, 2, &n, "data_offsets")) return -1;
            if (n != 2) return jfail(j, "tensor '%s': data_offsets needs 2 entries, has %d", t->name, n);
            t->begin = off[0], t->end = off[1];
        }
        jws(j);
        if (j->p < j->end && *j->p == ',') { j->p++; continue; }
        if (jexpect(j, '}', "to close a tensor")) return -1;
        break;
    }
    if (!seen[0] || !seen[1] || !seen[2])
        return jfail(j, "tensor '%s': missing '%s'", t->name, !seen[0] ? "dtype" : !seen[1] ? "shape" : "data_offsets");
    return 0;
}

static int cmp_begin(const void *a, const void *b) {
    const StTensor *x = a, *y = b;
    return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : x->end < y->end ? -1 : x->end > y->end;
}
static int cmp_name(const void *a, const void *b) { return strcmp(((const StTensor *)a)->name, ((const StTensor *)b)->name); }

static int jheader(Json *j, StFile *f) {
    int cap = 0, meta = 0;
    if (jexpect(j, '{', "to open the header")) return -1;
    jws(j);
    if (j->p < j->end && *j->p == '}') j->p++;
    else for (;;) {
        char name[ST_NAME];
        if (jstring(j, name, sizeof name) || jexpect(j, ':', "after a tensor name")) return -1;
        if (!strcmp(name, "__metadata__")) {
            if (meta++) return jfail(j, "header: __metadata__ twice");
            if (jmetadata(j)) return -1;
        } else {
            if (f->n == cap) {
                cap = cap ? 2 * cap : 64;
                f->t = xrealloc(f->t, (size_t)cap * sizeof *f->t);
            }
            StTensor *t = &f->t[f->n++];
            memset(t, 0, sizeof *t);
            memcpy(t->name, name, sizeof name);
            if (jtensor(j, t)) return -1;
        }
        jws(j);
        if (j->p < j->end && *j->p == ',') { j->p++; continue; }
        if (jexpect(j, '}', "to close the header")) return -1;
        break;
    }
    jws(j);
    if (j->p != j->end) return jfail(j, "header: bytes after the JSON object");
    return 0;
}

/* Sizes, ranges, overlaps and duplicates, after the header parsed. */
static int st_check(StFile *f, char *err, size_t cap) {
    for (int i = 0; i < f->n; i++) {
        StTensor *t = &f->t[i];
        uint64_t numel = 1;
        for (int d = 0; d < t->ndim; d++) {
            uint64_t s = (uint64_t)t->shape[d];
            if (s && numel > UINT64_MAX / s / 4) return snprintf(err, cap, "tensor '%s': shape too large", t->name), -1;
            numel *= s;
        }
        t->numel = numel;
        if (t->end < t->begin)
            return snprintf(err, cap, "tensor '%s': data_offsets [%llu, %llu] run backwards", t->name,
                            (unsigned long long)t->begin, (unsigned long long)t->end), -1;
        if (t->end > f->data_len)
            return snprintf(err, cap, "tensor '%s': data_offsets end %llu past the data section's %llu bytes (truncated?)",
                            t->name, (unsigned long long)t->end, (unsigned long long)f->data_len), -1;
        if (t->end - t->begin != numel * st_dtype_size(t->dtype))
            return snprintf(err, cap, "tensor '%s': shape and %s need %llu bytes, data_offsets give %llu", t->name,
                            dtype_names[t->dtype], (unsigned long long)(numel * st_dtype_size(t->dtype)),
                            (unsigned long long)(t->end - t->begin)), -1;
    }
    if (f->n > 1) {
        qsort(f->t, (size_t)f->n, sizeof *f->t, cmp_name);
        for (int i = 1; i < f->n; i++)
            if (!strcmp(f->t[i].name, f->t[i - 1].name))
                return snprintf(err, cap, "tensor '%s' appears twice", f->t[i].name), -1;
    }
    if (f->n > 1) qsort(f->t, (size_t)f->n, sizeof *f->t, cmp_begin); /* no tensors: f->t may be NULL */
    uint64_t at = 0;
    for (int i = 0; i < f->n; i++) {
        const StTensor *t = &f->t[i];
        if (t->begin < at)
            return snprintf(err, cap, "tensor '%s': data_offsets overlap tensor '%s'", t->name, f->t[i - 1].name), -1;
        if (t->begin > at)
            return snprintf(err, cap, "tensor '%s': a gap of %llu bytes before it (tensors must be contiguous)", t->name,
                            (unsigned long long)(t->begin - at)), -1;
        at = t->end;
    }
    if (at != f->data_len)
        return snprintf(err, cap, "%llu bytes after the last tensor", (unsigned long long)(f->data_len - at)), -1;
    return 0;
}

int st_parse(const unsigned char *buf, size_t len, StFile *f, char *err, size_t cap) {
    memset(f, 0, sizeof *f);
    if (len < 8) return snprintf(err, cap, "truncated: %zu bytes, shorter than the 8-byte header length", len), -1;
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--) hl = hl << 8 | buf[i];
    if (hl > ST_MAX_HEADER)
        return snprintf(err, cap, "header of %llu bytes is larger than the %u MB limit", (unsigned long long)hl,
                        ST_MAX_HEADER >> 20), -1;
    if (hl > len - 8)
        return snprintf(err, cap, "truncated: header of %llu bytes, only %zu follow", (unsigned long long)hl, len - 8), -1;
    Json j = {(const char *)buf + 8, (const char *)buf + 8 + hl, err, cap, 0};
    f->data = buf + 8 + hl;
    f->data_len = len - 8 - hl;
    if (jheader(&j, f) || st_check(f, err, cap)) {
        st_free(f);
        kiln_one_line(err); /* names and characters quoted from the header */
        return -1;
    }
    return 0;
}

int st_read(const char *path, StFile *f, char *err, size_t cap) {
    memset(f, 0, sizeof *f);
    uint64_t size;
    int fd = kiln_open_read(path, 0, &size);
    if (fd < 0) return snprintf(err, cap, "%s: cannot open: %s", path, kiln_strerror(errno)), -1;
    size_t len = (size_t)size;
    void *map = len ? mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0) : NULL;
    close(fd);
    if (len && map == MAP_FAILED) return snprintf(err, cap, "%s: cannot map: %s", path, strerror(errno)), -1;
    char why[1024];
    if (st_parse(map ? map : (const void *)"", len, f, why, sizeof why) != 0) {
        if (map) munmap(map, len);
        return snprintf(err, cap, "%s: %s", path, why), -1;
    }
    f->map = map, f->map_len = len;
    return 0;
}

void st_open(StFile *f, const char *path) {
    char err[1400];
    if (st_read(path, f, err, sizeof err) != 0) kiln_fail(KILN_EXIT_USAGE, "%s", err);
}

void st_free(StFile *f) {
    free(f->t);
    if (f->map) munmap(f->map, f->map_len);
    memset(f, 0, sizeof *f);
}

const StTensor *st_find(const StFile *f, const char *name) {
    for (int i = 0; i < f->n; i++)
        if (!strcmp(f->t[i].name, name)) return &f->t[i];
    return NULL;
}

/* ---------------------------------------------------------------- conversions */

uint16_t st_f32_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

float st_f16_to_f32(uint16_t h) {
    uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0x1f) u = s | 0x7f800000u | (m << 13);
    else if (e) u = s | ((e + 112) << 23) | (m << 13);
    else if (!m) u = s;
    else { /* subnormal: normalise */
        e = 113;
        while (!(m & 0x400)) m <<= 1, e--;
        u = s | (e << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t st_f32_to_f16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    uint16_t s = (uint16_t)((u >> 16) & 0x8000);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return s | 0x7e00;              /* NaN */
    if (a >= 0x477ff000u) return s | 0x7c00;             /* rounds to beyond 65504: inf */
    if (a < 0x38800000u) {                               /* f16 subnormal or zero */
        if (a < 0x33000000u) return s;                   /* below half the smallest subnormal */
        uint32_t m = (a & 0x7fffff) | 0x800000, sh = 126 - (a >> 23);
        uint32_t r = m >> sh, rem = m & ((1u << sh) - 1), half = 1u << (sh - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return s | (uint16_t)r;
    }
    uint32_t r = a - 0x38000000u; /* rebias 127 -> 15 */
    r += 0xfffu + ((r >> 13) & 1);
    return s | (uint16_t)(r >> 13);
}

void st_to_f32(const StFile *f, const StTensor *t, float *out) {
    const unsigned char *p = f->data + t->begin;
    for (uint64_t i = 0; i < t->numel; i++) {
        if (t->dtype == ST_F32) memcpy(&out[i], p + 4 * i, 4);
        else {
            uint16_t h = (uint16_t)(p[2 * i] | p[2 * i + 1] << 8);
            if (t->dtype == ST_F16) out[i] = st_f16_to_f32(h);
            else {
                uint32_t u = (uint32_t)h << 16;
                memcpy(&out[i], &u, 4);
            }
        }
    }
}

/* ---------------------------------------------------------------- writer */

static void json_string(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

int st_write(const char *path, const StWrite *t, int n, char *err, size_t cap) {
    char *hdr = NULL;
    size_t hlen = 0;
    FILE *h = open_memstream(&hdr, &hlen);
    if (!h) return snprintf(err, cap, "%s: open_memstream failed", path), -1;
    fputs("{\"__metadata__\":{\"format\":\"pt\"}", h);
    uint64_t at = 0;
    for (int i = 0; i < n; i++) {
        uint64_t numel = 1;
        for (int d = 0; d < t[i].ndim; d++) numel *= (uint64_t)t[i].shape[d];
        fputc(',', h);
        json_string(h, t[i].name);
        fprintf(h, ":{\"dtype\":\"%s\",\"shape\":[", dtype_names[t[i].dtype]);
        for (int d = 0; d < t[i].ndim; d++) fprintf(h, "%s%lld", d ? "," : "", (long long)t[i].shape[d]);
        uint64_t bytes = numel * st_dtype_size(t[i].dtype);
        fprintf(h, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)at, (unsigned long long)(at + bytes));
        at += bytes;
    }
    fputc('}', h);
    while ((ftell(h) & 7) != 0) fputc(' ', h); /* the data section starts 8-byte aligned */
    fclose(h);

    char tmp[1100];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (!f) {
        free(hdr);
        return snprintf(err, cap, "%s: cannot create: %s", tmp, strerror(errno)), -1;
    }
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    int bad = fwrite(len8, 1, 8, f) != 8 || fwrite(hdr, 1, hlen, f) != hlen;
    free(hdr);
    unsigned char buf[8192];
    for (int i = 0; i < n && !bad; i++) {
        uint64_t numel = 1;
        for (int d = 0; d < t[i].ndim; d++) numel *= (uint64_t)t[i].shape[d];
        size_t es = st_dtype_size(t[i].dtype), k = 0;
        for (uint64_t e = 0; e < numel && !bad; e++) {
            float x = t[i].data[e];
            if (es == 4) memcpy(buf + k, &x, 4);
            else {
                uint16_t v = t[i].dtype == ST_BF16 ? st_f32_to_bf16(x) : st_f32_to_f16(x);
                buf[k] = (unsigned char)v, buf[k + 1] = (unsigned char)(v >> 8);
            }
            k += es;
            if (k == sizeof buf || e + 1 == numel) bad = fwrite(buf, 1, k, f) != k, k = 0;
        }
    }
    bad |= fflush(f) != 0 || fsync(fileno(f)) != 0;
    bad |= fclose(f) != 0;
    if (bad || rename(tmp, path) != 0) {
        unlink(tmp);
        return snprintf(err, cap, "%s: write failed: %s", path, strerror(errno)), -1;
    }
    return 0;
}
