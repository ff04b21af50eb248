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

#if defined(__SANITIZE_ADDRESS__)
#define KILN_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KILN_ASAN 1
#endif
#endif
#ifdef KILN_ASAN
/* make sanitize: LeakSanitizer asks this before its check at exit. An exit
 * on an error leaves whatever the failing call held, by design (one line and
 * out); a clean exit is checked. */
static volatile int exiting_on_error;
int __lsan_is_turned_off(void);
int __lsan_is_turned_off(void) { return exiting_on_error; }
#endif

void kiln_set_fail_hook(void (*hook)(int code, const char *message)) { fail_hook = hook; }

static KilnTrap *trap_top;
void kiln_trap_push(KilnTrap *t) {
    t->code = 0, t->msg[0] = '\0', t->prev = trap_top;
    trap_top = t;
}
void kiln_trap_pop(KilnTrap *t) {
    if (trap_top == t) trap_top = t->prev;
}

/* The one place errors are printed: the error line, an optional hint, the
 * hook (once: a failure inside it exits without it), exit. */
void kiln_one_line(char *s) {
    for (; *s; s++)
        if ((unsigned char)*s < 0x20 || *s == 0x7f) *s = '?';
}

__attribute__((noreturn)) static void vfail(int code, const char *hint, const char *fmt, va_list ap) {
    char msg[4096];
    vsnprintf(msg, sizeof msg, fmt, ap);
    kiln_one_line(msg); /* names quoted from a file may hold a newline or a terminal escape */
    if (trap_top) { /* asked, not fatal: back to the checker with the line */
        KilnTrap *t = trap_top;
        t->code = code;
        size_t n = strlen(msg) < sizeof t->msg - 1 ? strlen(msg) : sizeof t->msg - 1;
        memcpy(t->msg, msg, n);
        t->msg[n] = '\0';
        longjmp(t->jb, 1);
    }
    fflush(stdout);
    fprintf(stderr, "kiln: error: %s\n", msg);
    if (hint) kiln_hint("%s", hint);
    void (*hook)(int, const char *) = fail_hook;
    fail_hook = NULL;
    if (hook) hook(code, msg);
#ifdef KILN_ASAN
    exiting_on_error = 1;
#endif
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
    char msg[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    kiln_one_line(msg);
    fflush(stdout);
    fprintf(stderr, "kiln: warning: %s\n", msg);
}

void kiln_hint(const char *fmt, ...) {
    char msg[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    kiln_one_line(msg);
    fprintf(stderr, "kiln: hint: %s\n", msg);
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

static _Thread_local uint64_t open_refused_max; /* the limit kiln_open_read last refused a file for */

int kiln_open_read(const char *path, uint64_t max, uint64_t *size) {
    /* O_NONBLOCK: opening a FIFO with no writer would wait forever; it is
     * refused below, and a regular file reads the same either way */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return -1;
    struct stat st;
    int err = 0;
    if (fstat(fd, &st) != 0) err = errno;
    else if (S_ISDIR(st.st_mode)) err = EISDIR;
    else if (!S_ISREG(st.st_mode)) err = KILN_ENOTREG;
    else if (max && (uint64_t)st.st_size > max) err = KILN_ETOOBIG, open_refused_max = max;
    else if (fcntl(fd, F_SETFL, 0) != 0) err = errno;
    if (err) {
        close(fd);
        errno = err;
        return -1;
    }
    if (size) *size = (uint64_t)st.st_size;
    return fd;
}

const char *kiln_strerror(int err) {
    static _Thread_local char buf[96];
    if (err == KILN_ENOTREG) return "not a regular file (a FIFO, device or socket)";
    if (err == KILN_ETOOBIG) {
        snprintf(buf, sizeof buf, "larger than the %llu bytes such a file can hold", (unsigned long long)open_refused_max);
        return buf;
    }
    return strerror(err);
}

char *kiln_read_file_max(const char *path, size_t max, size_t *len) {
    uint64_t size;
    int fd = kiln_open_read(path, max, &size);
    if (fd < 0) return NULL;
    /* the size is a hint (a file may grow while it is read, /proc says 0):
     * read to the end, but never past max */
    size_t cap = size < ((size_t)1 << 16) ? (size_t)1 << 16 : (size_t)size + 1, n = 0;
    if (max && cap > max + 1) cap = max + 1;
    char *buf = xmalloc(cap + 1);
    for (;;) {
        if (n == cap) {
            if (max && cap > max) break;
            cap = max && 2 * cap > max + 1 ? max + 1 : 2 * cap;
            buf = xrealloc(buf, cap + 1);
        }
        ssize_t got = read(fd, buf + n, cap - n);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) {
            int e = errno;
            close(fd);
            free(buf);
            errno = e;
            return NULL;
        }
        if (got == 0) break;
        n += (size_t)got;
    }
    close(fd);
    if (max && n > max) {
        free(buf);
        open_refused_max = max;
        errno = KILN_ETOOBIG;
        return NULL;
    }
    buf[n] = '\0';
    if (len) *len = n;
    return buf;
}

char *kiln_read_file(const char *path, size_t *len) { return kiln_read_file_max(path, 0, len); }

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

void rng_seed_stream(Rng *r, uint64_t seed, uint64_t a, uint64_t b) {
    uint64_t x = seed;
    uint64_t k = splitmix64(&x) ^ (a * 0xd1b54a32d192ed03ULL); /* odd multipliers: distinct a, b mix apart */
    k = splitmix64(&k) ^ (b * 0x8cb92ba72f3d8dd7ULL);
    rng_seed(r, splitmix64(&k));
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

/* xoshiro256's state transition: linear over GF(2), the output aside */
static inline void rng_step(uint64_t s[4]) {
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
}

uint64_t rng_u64(Rng *r) {
    uint64_t result = rotl(r->s[1] * 5, 7) * 9;
    rng_step(r->s);
    return result;
}

/* The transition's characteristic polynomial is x^256 + rng_charpoly (bit b
 * of word w: the coefficient of x^(64 w + b)): the minimal polynomial of one
 * state bit's sequence, by Berlekamp-Massey over 512 steps (test_rng derives
 * it again). The state after n steps is (x^n mod it) evaluated at the
 * transition, applied to the state (Haramoto et al., "Efficient jump ahead
 * for F2-linear random number generators", 2008). */
static const uint64_t rng_charpoly[4] = {0x9d116f2bb0f0f001ULL, 0x0280002bcefd1a5eULL, 0x04b4edcf26259f85ULL,
                                         0x0003c03c3f3ecb19ULL};

/* a x mod the characteristic polynomial */
static void rng_poly_mulx(uint64_t a[4]) {
    uint64_t top = a[3] >> 63;
    for (int w = 3; w > 0; w--) a[w] = a[w] << 1 | a[w - 1] >> 63;
    a[0] <<= 1;
    if (top)
        for (int w = 0; w < 4; w++) a[w] ^= rng_charpoly[w];
}

/* the 32 bits of x at the even bit positions of the result */
static uint64_t rng_spread32(uint64_t x) {
    x = (x | x << 16) & 0x0000ffff0000ffffULL;
    x = (x | x << 8) & 0x00ff00ff00ff00ffULL;
    x = (x | x << 4) & 0x0f0f0f0f0f0f0f0fULL;
    x = (x | x << 2) & 0x3333333333333333ULL;
    return (x | x << 1) & 0x5555555555555555ULL;
}

/* a^2 mod the characteristic polynomial: over GF(2) squaring moves the
 * coefficient of x^i to x^2i; the upper half hi x^256 comes back as hi
 * multiplied by x 256 times */
static void rng_poly_square(uint64_t a[4]) {
    uint64_t lo[4], hi[4];
    for (int w = 0; w < 2; w++) {
        lo[2 * w] = rng_spread32(a[w] & 0xffffffffu), lo[2 * w + 1] = rng_spread32(a[w] >> 32);
        hi[2 * w] = rng_spread32(a[w + 2] & 0xffffffffu), hi[2 * w + 1] = rng_spread32(a[w + 2] >> 32);
    }
    for (int k = 0; k < 256; k++) rng_poly_mulx(hi);
    for (int w = 0; w < 4; w++) a[w] = lo[w] ^ hi[w];
}

void rng_jump_make(RngJump *j, uint64_t n) {
    uint64_t *a = j->poly;
    a[0] = 1, a[1] = a[2] = a[3] = 0; /* x^0 */
    int b = 63;
    while (b >= 0 && !(n >> b & 1)) b--;
    for (; b >= 0; b--) { /* left to right from n's leading 1: x^n from the bits of n */
        rng_poly_square(a);
        if (n >> b & 1) rng_poly_mulx(a);
    }
}

void rng_jump_apply(Rng *r, const RngJump *j) {
    uint64_t acc[4] = {0, 0, 0, 0}, s[4] = {r->s[0], r->s[1], r->s[2], r->s[3]};
    for (int i = 0; i < 256; i++) {
        if (j->poly[i / 64] >> (i % 64) & 1)
            for (int w = 0; w < 4; w++) acc[w] ^= s[w];
        rng_step(s);
    }
    for (int w = 0; w < 4; w++) r->s[w] = acc[w];
}

void rng_jump(Rng *r, uint64_t n) {
    RngJump j;
    rng_jump_make(&j, n);
    rng_jump_apply(r, &j);
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
