/* test.h: the suite's tiny harness. Each check prints one line, "ok NAME" or
 * "FAIL NAME: why"; test/run.sh counts them. A test binary exits 0 even when a
 * check fails (the count is the verdict), non-zero only if it crashes. */
#ifndef KILN_TEST_H
#define KILN_TEST_H

#include <stdio.h>
#include <stdarg.h>

static int test_failures = 0;

static void test_report(int ok, const char *name, const char *fmt, ...) {
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

#endif
