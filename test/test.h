/* test.h: the suite's tiny harness. Each check prints one line, "ok NAME" or
 * "FAIL NAME: why"; test/run.sh counts them. A test binary exits 0 even when a
 * check fails (the count is the verdict), non-zero only if it crashes. */
#ifndef KILN_TEST_H
#define KILN_TEST_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static int test_failures = 0;

__attribute__((unused)) static void test_report(int ok, const char *name, const char *fmt, ...) {
    if (ok) {
        printf("ok %s\n", name);
    } else {
        va_list ap;
        test_failures++;
        printf("FAIL %s: ", name);
        va_start(ap, fmt);
        vprintf(fmt, ap);
        va_end(ap);
        printf("\n");
    }
    fflush(stdout);
}

/* Run fn(arg) in a child process (for code that exits on bad input), its
 * output on descriptor `out_fd` (2: stderr; 1: stdout, where the CUDA
 * emulation reports) captured into err (NUL-terminated). Returns the child's
 * exit status, or 128 + signal if it was killed. */
__attribute__((unused)) static int test_run_child_fd(void (*fn)(void *), void *arg, int out_fd, char *err, size_t cap) {
    int fd[2];
    if (pipe(fd) != 0) {
        perror("pipe");
        exit(1);
    }
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        close(fd[0]);
        dup2(fd[1], out_fd);
        fn(arg);
        _exit(0);
    }
    close(fd[1]);
    size_t n = 0;
    ssize_t r;
    while (n + 1 < cap && (r = read(fd[0], err + n, cap - 1 - n)) > 0) n += (size_t)r;
    err[n] = '\0';
    close(fd[0]);
    int st;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}
/* The same with stderr captured. */
__attribute__((unused)) static int test_run_child(void (*fn)(void *), void *arg, char *err, size_t cap) {
    return test_run_child_fd(fn, arg, 2, err, cap);
}

#endif
