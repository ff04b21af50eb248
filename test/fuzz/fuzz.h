/* fuzz.h: the harness of kiln's libFuzzer targets (test/fuzz/fuzz_*.c; make
 * fuzz; docs/testing.md, "Fuzzing"). A target never crashes, hangs or reads
 * out of bounds (AddressSanitizer and UBSan are built in), and every input is
 * either accepted or refused through kiln's normal error path.
 *
 * Code that refuses by returning (ckpt, safetensors) runs in this process and
 * its error text is checked to be one line. Code that refuses by exiting
 * (kiln_fail: config, shards, tokenizer files, llm.c files) runs in a forked
 * child, through the real exit: the child's exit status must be 0 or 2 and its
 * stderr warnings, then one "kiln: error:" line and at most one hint. Anything
 * else (a signal, a sanitizer's report, exit 1 "out of memory", two error
 * lines, a hang, which libFuzzer's -timeout catches in the parent) is a
 * finding: the parent prints the child's stderr and aborts, and libFuzzer keeps
 * the input. The child's coverage counters are copied back to the parent so
 * that libFuzzer sees what the input reached. */
#ifndef KILN_FUZZ_H
#define KILN_FUZZ_H

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <signal.h>
#include <fcntl.h>
#include <unistd.h>

#include "util.h"

/* The inline 8-bit counters of this binary (fuzz_sec.c, built without
 * coverage: referencing the section from instrumented code unhooks it). */
char *fuzz_cntrs_start(void);
char *fuzz_cntrs_stop(void);

#define FUZZ_NOCOV __attribute__((no_sanitize("coverage"), unused))

static char fuzz_dir[256];
static unsigned char *fuzz_shm; /* the child's counters on their way back */

FUZZ_NOCOV static void fuzz_copy(char *dst, const char *src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = src[i];
}

FUZZ_NOCOV static void fuzz_rmdir(void) {
    char cmd[300];
    if (!fuzz_dir[0] || getpid() != atoi(strrchr(fuzz_dir, '-') + 1)) return;
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", fuzz_dir);
    if (system(cmd) != 0) fprintf(stderr, "fuzz: cannot remove %s\n", fuzz_dir);
}

/* A scratch directory of this process (tmpfs when there is one), removed at exit. */
FUZZ_NOCOV static const char *fuzz_tmp(void) {
    if (fuzz_dir[0]) return fuzz_dir;
    struct stat st;
    const char *base = stat("/dev/shm", &st) == 0 ? "/dev/shm" : getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(fuzz_dir, sizeof fuzz_dir, "%s/kiln-fuzz-%d", base, (int)getpid());
    if (mkdir(fuzz_dir, 0700) != 0 && errno != EEXIST) {
        perror(fuzz_dir);
        abort();
    }
    atexit(fuzz_rmdir);
    return fuzz_dir;
}

/* Write data to fuzz_tmp()/name; returns the path (static). */
FUZZ_NOCOV static const char *fuzz_file(const char *name, const void *data, size_t n) {
    static char path[512];
    snprintf(path, sizeof path, "%s/%s", fuzz_tmp(), name);
    FILE *f = fopen(path, "wb");
    if (!f || (n && fwrite(data, 1, n, f) != n) || fclose(f) != 0) {
        perror(path);
        abort();
    }
    return path;
}

/* An error text a returning reader filled: one line, something in it. */
FUZZ_NOCOV static void fuzz_check_err(const char *what, const char *err) {
    if (err[0] && !strchr(err, '\n')) return;
    fprintf(stderr, "fuzz: %s refused with %s: '%s'\n", what, err[0] ? "more than one line" : "no message", err);
    abort();
}

FUZZ_NOCOV static void fuzz_child_fail(int code, const char *message) {
    (void)message;
    size_t n = (size_t)(fuzz_cntrs_stop() - fuzz_cntrs_start());
    fuzz_copy((char *)fuzz_shm, fuzz_cntrs_start(), n);
    _exit(code); /* kiln_fail printed its line; libFuzzer's exit hooks must not run in the child */
}

/* stderr of a refusal: "kiln: warning: ..." lines, one "kiln: error: ...", at most one "kiln: hint: ...". */
FUZZ_NOCOV static int fuzz_one_error(const char *s) {
    int errors = 0, hints = 0;
    for (const char *l = s; *l;) {
        const char *nl = strchr(l, '\n');
        if (!nl) return 0; /* every line ends */
        if (!strncmp(l, "kiln: error: ", 13) && !errors && !hints) errors++;
        else if (!strncmp(l, "kiln: hint: ", 12) && errors && !hints) hints++;
        else if (strncmp(l, "kiln: warning: ", 15) || errors) return 0;
        l = nl + 1;
    }
    return errors == 1;
}

/* Run fn(data, n) in a child; see the top of this file. */
FUZZ_NOCOV static void fuzz_fork(void (*fn)(const uint8_t *, size_t), const uint8_t *data, size_t n) {
    size_t nc = (size_t)(fuzz_cntrs_stop() - fuzz_cntrs_start());
    if (!fuzz_shm) {
        fuzz_shm = mmap(NULL, nc ? nc : 1, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (fuzz_shm == MAP_FAILED) abort();
        fuzz_tmp();
    }
    int fd[2];
    if (pipe(fd) != 0) abort();
    fflush(stdout), fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) abort();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* a hang outlives no parent libFuzzer's timeout ended */
        close(fd[0]);
        dup2(fd[1], 2);
        int null = open("/dev/null", O_WRONLY);
        if (null >= 0) dup2(null, 1);
        kiln_set_fail_hook(fuzz_child_fail);
        fn(data, n);
        fflush(stdout);
        fuzz_copy((char *)fuzz_shm, fuzz_cntrs_start(), nc);
        _exit(0);
    }
    close(fd[1]);
    static char err[1 << 16];
    size_t got = 0;
    for (;;) {
        char sink[4096];
        ssize_t r = read(fd[0], got + 1 < sizeof err ? err + got : sink,
                         got + 1 < sizeof err ? sizeof err - 1 - got : sizeof sink);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        if (got + 1 < sizeof err) got += (size_t)r;
    }
    err[got] = 0;
    close(fd[0]);
    int st;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
    }
    fuzz_copy(fuzz_cntrs_start(), (const char *)fuzz_shm, nc);
    memset(fuzz_shm, 0, nc);
    int code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    if (code == 0 || (code == KILN_EXIT_USAGE && fuzz_one_error(err))) return;
    if (WIFSIGNALED(st)) fprintf(stderr, "fuzz: the child died of signal %d; its stderr:\n%s", WTERMSIG(st), err);
    else fprintf(stderr, "fuzz: the child exited %d, not 0 or 2 with one error line; its stderr:\n%s", code, err);
    abort();
}

/* fuzz_fork, or with the environment variable `show` set (one input given on
 * the command line) fn in this process: what kiln says of it, and its exit. */
FUZZ_NOCOV static void fuzz_run(void (*fn)(const uint8_t *, size_t), const uint8_t *data, size_t n, const char *show) {
    if (getenv(show)) fn(data, n);
    else fuzz_fork(fn, data, n);
}

/* The text of `path` when it is a regular file (not a link, FIFO or folder an
 * input made in its place), else NULL; *len its bytes. */
FUZZ_NOCOV static char *fuzz_read_regular(const char *path, size_t *len) {
    struct stat st;
    if (lstat(path, &st) != 0 || !S_ISREG(st.st_mode)) return NULL;
    return kiln_read_file(path, len);
}

/* ---- a directory from one input (fuzz_hfdir, fuzz_runs) ----
 * After the caller's header, the input is files: "\n@@@NAME\nBYTES", BYTES up
 * to the next "\n@@@"; NAME ending in '/' is a directory, in '|' a FIFO
 * (a reader must not wait on one forever). NAME keeps
 * [A-Za-z0-9._-/] (at most 96 characters, 32 entries), its parent
 * directories are made, and a "." or ".." part or a leading '/' drops it: the
 * input builds inside dir only. fuzz_unpack empties dir first (files and
 * directories in it, depth first). */
#include <dirent.h>

FUZZ_NOCOV static void fuzz_clear(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char p[1024];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        if (unlink(p) != 0) {
            fuzz_clear(p);
            rmdir(p);
        }
    }
    closedir(d);
}

FUZZ_NOCOV static const uint8_t *fuzz_mark(const uint8_t *p, const uint8_t *end) {
    for (; p + 4 <= end; p++)
        if (p[0] == '\n' && p[1] == '@' && p[2] == '@' && p[3] == '@') return p;
    return end;
}

FUZZ_NOCOV static void fuzz_unpack(const char *dir, const uint8_t *d, size_t n) {
    fuzz_clear(dir);
    mkdir(dir, 0700);
    const uint8_t *end = d + n, *p = fuzz_mark(d, end);
    for (int files = 0; p < end && files < 32; files++) {
        const uint8_t *s = p + 4, *nl = memchr(s, '\n', (size_t)(end - s));
        const uint8_t *body = nl ? nl + 1 : end, *next = fuzz_mark(body, end);
        char name[97];
        size_t k = 0;
        for (const uint8_t *c = s; c < (nl ? nl : end) && k < 96; c++)
            if ((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') || *c == '.' ||
                *c == '_' || *c == '-' || *c == '/')
                name[k++] = (char)*c;
        name[k] = 0;
        p = next;
        int fifo = nl && nl > s && nl[-1] == '|';
        int is_dir = k && name[k - 1] == '/', bad = !k || name[0] == '/';
        if (is_dir) name[--k] = 0;
        for (char *q = name; !bad && q && *q; q = strchr(q, '/') ? strchr(q, '/') + 1 : NULL) {
            size_t l = strcspn(q, "/");
            bad = l == 0 || (l == 1 && q[0] == '.') || (l == 2 && q[0] == '.' && q[1] == '.');
        }
        if (bad || !k) continue;
        char path[1200];
        snprintf(path, sizeof path, "%s/%s", dir, name);
        for (char *q = path + strlen(dir) + 1; (q = strchr(q, '/')); q++) { /* parents */
            *q = 0;
            mkdir(path, 0700);
            *q = '/';
        }
        if (is_dir || fifo) {
            if (is_dir) mkdir(path, 0700);
            else mkfifo(path, 0600);
            continue;
        }
        /* a later entry of an earlier FIFO's name must not block the
         * harness on opening it for writing: the name keeps its first kind */
        struct stat st;
        if (lstat(path, &st) == 0 && !S_ISREG(st.st_mode)) continue;
        FILE *f = fopen(path, "wb");
        if (!f) continue;
        if (next > body) fwrite(body, 1, (size_t)(next - body), f);
        fclose(f);
    }
}

#endif
