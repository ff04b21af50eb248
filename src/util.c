/* util: errors, checked allocation and file I/O, RNG, hashing, time.
 * Must never know about models, configs or backends. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static void (*fail_hook)(int code, const char *message);

void kiln_set_fail_hook(void (*hook)(int code, const char *message)) { fail_hook = hook; }

/* The one place errors are printed: the error line, an optional hint, the
 * hook (once: a failure inside it exits without it), exit. */
__attribute__((noreturn)) static void vfail(int code, const char *hint, const char *fmt, va_list ap) {
    char msg[4096];
    vsnprintf(msg, sizeof msg, fmt, ap);
    fflush(stdout);
    fprintf(stderr, "kiln: error: %s\n", msg);
    if (hint) fprintf(stderr, "kiln: hint: %s\n", hint);
    void (*hook)(int, const char *) = fail_hook;
    fail_hook = NULL;
    if (hook) hook(code, msg);
    exit(code);
}

void kiln_fail(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfail(code, NULL, fmt, ap);
}

void kiln_fail_hint(int code, const char *hint, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfail(code, hint, fmt, ap);
}

void kiln_warn(const char *fmt, ...) {
    va_list ap;
    fflush(stdout);
    fputs("kiln: warning: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

void kiln_hint(const char *fmt, ...) {
    va_list ap;
    fputs("kiln: hint: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

void *kiln_xmalloc(size_t n, const char *file, int line) {
    void *p = malloc(n ? n : 1);
    if (!p) kiln_fail(KILN_EXIT_RUNTIME, "%s:%d: out of memory allocating %zu bytes", file, line, n);
    return p;
}

void *kiln_xcalloc(size_t n, size_t s, const char *file, int line) {
    void *p = calloc(n ? n : 1, s ? s : 1);
    if (!p) kiln_fail(KILN_EXIT_RUNTIME, "%s:%d: out of memory allocating %zu x %zu bytes", file, line, n, s);
    return p;
}

void *kiln_xrealloc(void *p, size_t n, const char *file, int line) {
    void *q = realloc(p, n ? n : 1);
    if (!q) kiln_fail(KILN_EXIT_RUNTIME, "%s:%d: out of memory reallocating %zu bytes", file, line, n);
    return q;
}

char *xstrdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = xmalloc(n);
    memcpy(d, s, n);
    return d;
}

int kiln_strlcpy(char *dst, const char *src, size_t n) {
    size_t len = strlen(src);
    if (n == 0) return -1;
    if (len >= n) {
        memcpy(dst, src, n - 1);
        dst[n - 1] = '\0';
        return -1;
    }
    memcpy(dst, src, len + 1);
    return 0;
}

char *kiln_read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = xmalloc(cap + 1);
    size_t got;
    while ((got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            cap *= 2;
            buf = xrealloc(buf, cap + 1);
        }
    }
    int err = ferror(f);
    fclose(f);
    if (err) {
        free(buf);
        errno = EIO;
        return NULL;
    }
    buf[n] = '\0';
    if (len) *len = n;
    return buf;
}

int kiln_write_file_atomic(const char *path, const void *data, size_t len) {
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp) return -1;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return -1;
    const char *p = data;
    size_t left = len;
    while (left > 0) {
        ssize_t w = write(fd, p, left);
        if (w < 0) {
            if (errno == EINTR) continue;
            goto err;
        }
        p += w;
        left -= (size_t)w;
    }
    /* fsync before rename: a file with the final name must hold all its bytes. */
    if (fsync(fd) != 0) goto err;
    if (close(fd) != 0) {
        fd = -1;
        goto err;
    }
    if (rename(tmp, path) != 0) {
        unlink(tmp);
        return -1;
    }
    return 0;
err:
    if (fd >= 0) close(fd);
    unlink(tmp);
    return -1;
}

int kiln_mkdirs(const char *path) {
    char buf[4096];
    if (kiln_strlcpy(buf, path, sizeof buf) != 0) return -1;
    for (char *p = buf + 1; *p; p++) {
        if (*p == '/') {
            *p = '\0';
            if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
            *p = '/';
        }
    }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
    struct stat st;
    if (stat(buf, &st) != 0 || !S_ISDIR(st.st_mode)) return -1;
    return 0;
}

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

void rng_seed(Rng *r, uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&x);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t rng_u64(Rng *r) {
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

float rng_uniform(Rng *r) { return (float)(rng_u64(r) >> 40) * (1.0f / 16777216.0f); }

double rng_uniform_double(Rng *r) { return (double)(rng_u64(r) >> 11) * (1.0 / 9007199254740992.0); }

float rng_normal(Rng *r) {
    /* One normal per call (the second Box-Muller value is dropped) so that the
     * stream position depends only on the number of draws, never on parity. */
    double u1 = rng_uniform_double(r);
    double u2 = rng_uniform_double(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

uint64_t rng_below(Rng *r, uint64_t n) {
    if (n <= 1) return 0;
    uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t x;
    do x = rng_u64(r);
    while (x >= limit);
    return x % n;
}

uint64_t kiln_fnv1a(const void *data, size_t len, uint64_t h) {
    const unsigned char *p = data;
    for (size_t i = 0; i < len; i++) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

double kiln_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

const char *kiln_fmt_bytes(double bytes, char *buf, size_t cap) {
    if (bytes >= 1e9) snprintf(buf, cap, "%.2f GB", bytes / 1e9);
    else if (bytes >= 1e6) snprintf(buf, cap, "%.1f MB", bytes / 1e6);
    else snprintf(buf, cap, "%.1f kB", bytes / 1e3);
    return buf;
}

static double util_loaded_at;
__attribute__((constructor)) static void util_note_load(void) { util_loaded_at = kiln_now(); }

double kiln_process_age(void) {
    /* field 22 of /proc/self/stat, counted after the ')' that ends the
     * command name: clock ticks from boot to the start of this process */
    char buf[1024];
    FILE *f = fopen("/proc/self/stat", "r");
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f) fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    for (int field = 2; p && field < 22; field++) p = strchr(p + 1, ' ');
    struct timespec ts;
    long hz = sysconf(_SC_CLK_TCK);
    if (!p || hz <= 0 || clock_gettime(CLOCK_BOOTTIME, &ts) != 0) return kiln_now() - util_loaded_at;
    double age = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec - (double)strtoull(p + 1, NULL, 10) / (double)hz;
    return age >= 0 ? age : kiln_now() - util_loaded_at;
}
