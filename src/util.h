/* util: errors with exit codes, checked allocation and I/O, the deterministic RNG,
 * hashing, timing. Everything else in kiln builds on this; it knows no model,
 * config or backend. */
#ifndef KILN_UTIL_H
#define KILN_UTIL_H

#include <setjmp.h>
#include <stdint.h>
#include <stddef.h>
#include <stdio.h>

/* Exit codes of record (DESIGN.md "Errors and exit codes"). */
enum {
    KILN_EXIT_OK = 0,
    KILN_EXIT_RUNTIME = 1, /* NaN storm, I/O error, collective timeout */
    KILN_EXIT_USAGE = 2,   /* bad usage or input: config, data, checkpoint */
    KILN_EXIT_RESUME = 75  /* stopped on a signal after saving: resume me */
};

/* Print "kiln: error: <message>" on stderr and exit with `code`. */
void kiln_fail(int code, const char *fmt, ...) __attribute__((noreturn, format(printf, 2, 3)));
/* Run `hook` (once) after the error line of kiln_fail and before it exits, so
 * the run's summary can say why it ended (metrics.c); NULL removes it. */
void kiln_set_fail_hook(void (*hook)(int code, const char *message));
/* A trap turns kiln_fail into a jump back to the caller, for a check that
 * must be asked without ending the process (./train plan --search asks the
 * config's own validation of thousands of layouts). Only for code that holds
 * nothing a jump would leak (checks over a filled struct, not parsers):
 *   KilnTrap t;
 *   kiln_trap_push(&t);
 *   if (setjmp(t.jb) == 0) { ...checks... } else { t.msg says why, t.code }
 *   kiln_trap_pop(&t);
 * Traps nest; the innermost one catches. Not thread-safe (one per process). */
typedef struct KilnTrap {
    jmp_buf jb;
    int code;
    char msg[1024];
    struct KilnTrap *prev;
} KilnTrap;
void kiln_trap_push(KilnTrap *t);
void kiln_trap_pop(KilnTrap *t);
/* kiln_fail, with a "kiln: hint: <hint>" line after the error (hint may be NULL). */
void kiln_fail_hint(int code, const char *hint, const char *fmt, ...) __attribute__((noreturn, format(printf, 3, 4)));
/* Replace every control byte of s (a newline, a terminal escape) with '?':
 * an error line that quotes a file stays one line. kiln_fail does it. */
void kiln_one_line(char *s);
/* Print "kiln: warning: <message>" on stderr. */
void kiln_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Print "kiln: hint: <message>" on stderr (what the user should do next). */
void kiln_hint(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Checked allocation: failure is a runtime error naming the call site. */
#define xmalloc(n) kiln_xmalloc((n), __FILE__, __LINE__)
#define xcalloc(n, s) kiln_xcalloc((n), (s), __FILE__, __LINE__)
#define xrealloc(p, n) kiln_xrealloc((p), (n), __FILE__, __LINE__)
void *kiln_xmalloc(size_t n, const char *file, int line);
void *kiln_xcalloc(size_t n, size_t s, const char *file, int line);
void *kiln_xrealloc(void *p, size_t n, const char *file, int line);
char *xstrdup(const char *s);

/* Copy src into dst of size n, always NUL-terminated; returns 0, or -1 if truncated. */
int kiln_strlcpy(char *dst, const char *src, size_t n);

/* Open a file to read: a regular file only (a FIFO would block the open and a
 * device read forever: errno EISDIR for a directory, KILN_ENOTREG for the
 * rest) of at most `max` bytes (0 = no limit; past it errno KILN_ETOOBIG).
 * Every reader of a file named by a user or a run directory goes through
 * here. Returns the descriptor (O_CLOEXEC) and *size, or -1 with errno. */
#define KILN_ENOTREG 0x4b01
#define KILN_ETOOBIG 0x4b02
int kiln_open_read(const char *path, uint64_t max, uint64_t *size);
/* strerror, knowing kiln_open_read's two codes (the limit of the last refusal
 * in this thread is named). */
const char *kiln_strerror(int err);
/* Read a whole file, NUL-terminated, through kiln_open_read with no size
 * limit; NULL on failure (errno set; say it with kiln_strerror). *len
 * receives the size. */
char *kiln_read_file(const char *path, size_t *len);
/* kiln_read_file of a file whose kind has a natural bound: at most max bytes. */
char *kiln_read_file_max(const char *path, size_t max, size_t *len);
/* The bound of kiln's own small files: checkpoints/latest, heartbeats,
 * ranks.json, MLflow's meta.yaml and mlflow.json, the NCCL id file. */
#define KILN_SMALL_FILE_MAX ((size_t)64 << 10)
/* Write a whole file through path.tmp + fsync + rename; 0 on success, -1 on failure. */
int kiln_write_file_atomic(const char *path, const void *data, size_t len);
/* mkdir -p; 0 on success. */
int kiln_mkdirs(const char *path);

/* Deterministic random numbers: a counter-free xoshiro256** seeded by splitmix64.
 * Every random decision in kiln (init, sample order, sampling) draws from one of
 * these, so a run is reproducible from its seed. */
typedef struct {
    uint64_t s[4];
} Rng;
void rng_seed(Rng *r, uint64_t seed);
/* the stream (seed, a, b): independent streams for counter-based fills */
void rng_seed_stream(Rng *r, uint64_t seed, uint64_t a, uint64_t b);
uint64_t rng_u64(Rng *r);
float rng_uniform(Rng *r);          /* [0, 1) with 24 bits */
double rng_uniform_double(Rng *r);  /* [0, 1) with 53 bits */
float rng_normal(Rng *r);           /* N(0, 1), Box-Muller in double */
uint64_t rng_below(Rng *r, uint64_t n); /* uniform in [0, n), unbiased */
/* Jump ahead: the state n rng_u64 calls later, in O(log n) polynomial
 * squarings and 256 steps (rng_normal takes two calls). A jump made once is
 * applied to any state; rng_jump makes and applies one. */
typedef struct {
    uint64_t poly[4]; /* x^n mod the generator's characteristic polynomial */
} RngJump;
void rng_jump_make(RngJump *j, uint64_t n);
void rng_jump_apply(Rng *r, const RngJump *j);
void rng_jump(Rng *r, uint64_t n);

/* FNV-1a 64-bit, for config hashes and cheap fingerprints. */
uint64_t kiln_fnv1a(const void *data, size_t len, uint64_t h);
#define KILN_FNV_INIT 0xcbf29ce484222325ULL

/* "1.49 GB", "418.6 kB": decimal units, for log lines. Returns buf. */
const char *kiln_fmt_bytes(double bytes, char *buf, size_t cap);

/* Monotonic seconds. */
double kiln_now(void);
/* Seconds since this process started (the kernel's start time, 10 ms steps;
 * where /proc is missing, since the program was loaded). */
double kiln_process_age(void);

#endif
