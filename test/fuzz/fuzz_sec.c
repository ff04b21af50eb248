/* fuzz_sec.c: where the fuzz targets' coverage counters lie (test/fuzz/fuzz.h).
 * Built without -fsanitize=fuzzer: a reference to the section from
 * instrumented code detaches it from libFuzzer (measured with clang 14). */
extern char __start___sancov_cntrs[] __attribute__((weak)), __stop___sancov_cntrs[] __attribute__((weak));
char *fuzz_cntrs_start(void);
char *fuzz_cntrs_stop(void);
char *fuzz_cntrs_start(void) { return __start___sancov_cntrs; }
char *fuzz_cntrs_stop(void) { return __stop___sancov_cntrs; }
