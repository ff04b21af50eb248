/* test_nccl: comm's device mode (comm_nccl_device_mode) on one GPU, world size
 * 1 (no launcher variables: one rank, no MPI, the NCCL id needs no exchange):
 * every float collective through NCCL on device buffers, out of place and in
 * place, blocking and non-blocking while kernels run on the compute stream,
 * more requests in flight than the event pool starts with, and the deadline
 * (a stalled compute stream: the wait must abort and exit 1 with the timeout
 * line). Values are small integers, so results are compared exactly.
 *
 * One rank cannot show that NCCL sums across ranks (that needs two GPUs); it
 * shows the plumbing: the library loads, the communicator works without MPI,
 * and the stream ordering holds (a collective reads what the kernel before it
 * wrote; a kernel after comm_wait reads the collective's result). Buffers are
 * 64 Mi floats so that a missing order would be seen, not hidden by speed.
 *
 * Where there is no NCCL build, no libnccl.so.2 or no GPU it prints one
 * "skip nccl..." line and exits 0. scripts/cuda_check.sh runs it on a GPU. */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "comm.h"
#include "test.h"
#include "util.h"

#ifdef KILN_NCCL
#include <cuda_runtime.h>
#endif

static const Backend *be;

/* The big buffers: 64 Mi floats (256 MiB) each, so an add over them takes a
 * fraction of a millisecond on an H200, long next to launching a collective. */
#define BIG ((size_t)64 << 20)
/* Small integers: i % 61 + 1 and friends stay below 2^24, exact in fp32. */
static float val(size_t i, int salt) { return (float)((i * 7 + (size_t)salt) % 61 + 1); }

static float *host_pattern(size_t n, int salt) {
    float *h = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) h[i] = val(i, salt);
    return h;
}
static float *dev_pattern(size_t n, int salt) {
    float *h = host_pattern(n, salt);
    float *d = be->alloc(n * sizeof(float));
    be->to_device(d, h, n * sizeof(float));
    free(h);
    return d;
}
/* Compare device x(n) with want(i) = a * val(i, salt_a) + b * val(i, salt_b);
 * to_host runs on the compute stream, so it also checks that results are
 * ordered before later work there. Returns the first bad index or -1. */
static long dev_check(const float *d, size_t n, float a, int salt_a, float b, int salt_b) {
    float *h = xmalloc(n * sizeof(float));
    be->to_host(h, d, n * sizeof(float));
    long bad = -1;
    for (size_t i = 0; i < n && bad < 0; i++)
        if (h[i] != a * val(i, salt_a) + b * val(i, salt_b)) bad = (long)i;
    free(h);
    return bad;
}
static void report_bad(const char *name, long bad, const char *what) {
    test_report(bad < 0, name, "%s: first wrong element %ld", what, bad);
}

/* ------------------------------------------------------------ checks */

static void check_blocking(CommGroup *g) {
    size_t n = 1 << 20;
    /* all-reduce, sum and mean, in place: one rank holds the sum */
    float *x = dev_pattern(n, 1);
    comm_all_reduce_sum(g, x, n);
    report_bad("nccl_all_reduce_sum", dev_check(x, n, 1, 1, 0, 0), "sum over one rank is the input");
    comm_all_reduce_mean(g, x, n);
    report_bad("nccl_all_reduce_mean", dev_check(x, n, 1, 1, 0, 0), "mean over one rank is the input");
    comm_broadcast(g, x, n, 0);
    report_bad("nccl_broadcast", dev_check(x, n, 1, 1, 0, 0), "root 0's data");

    /* reduce-scatter and all-gather, out of place and in place (NCCL's
     * definition: recv == send + rank * block, send == recv + rank * block) */
    float *send = dev_pattern(n, 2), *recv = be->alloc(n * sizeof(float));
    comm_reduce_scatter(g, send, recv, n);
    report_bad("nccl_reduce_scatter", dev_check(recv, n, 1, 2, 0, 0), "block 0 of the sum");
    comm_reduce_scatter(g, send, send + (size_t)g->rank * n, n);
    report_bad("nccl_reduce_scatter_in_place", dev_check(send, n, 1, 2, 0, 0), "in place");
    float *src = dev_pattern(n, 3);
    comm_all_gather(g, src, recv, n);
    report_bad("nccl_all_gather", dev_check(recv, n, 1, 3, 0, 0), "rank 0's block");
    comm_all_gather(g, recv + (size_t)g->rank * n, recv, n);
    report_bad("nccl_all_gather_in_place", dev_check(recv, n, 1, 3, 0, 0), "in place");
    /* the variable-count all-to-all (expert parallelism's rows): to itself,
     * as floats and as 2-byte elements (the bf16 path); then nothing at all */
    size_t cnt = n - 3, none = 0;
    be->zero(recv, n * sizeof(float));
    comm_all_to_allv(g, src, &cnt, recv, &cnt, sizeof(float));
    report_bad("nccl_all_to_allv", dev_check(recv, n - 3, 1, 3, 0, 0), "its own elements back");
    be->zero(recv, n * sizeof(float));
    size_t c2 = 2 * (n - 3); /* the same bytes as 2-byte elements */
    comm_all_to_allv(g, src, &c2, recv, &c2, 2);
    report_bad("nccl_all_to_allv_2byte", dev_check(recv, n - 3, 1, 3, 0, 0), "the same bytes in 2-byte elements");
    uint64_t seq0 = g->seq;
    comm_all_to_allv(g, src, &none, recv, &none, sizeof(float));
    test_report(g->seq == seq0 + 1, "nccl_all_to_allv_empty", "an exchange of nothing still counts: seq %llu -> %llu",
                (unsigned long long)seq0, (unsigned long long)g->seq);
    be->free(x);
    be->free(send);
    be->free(recv);
    be->free(src);
}

/* The order on both sides of a collective: out = a + b is enqueued just
 * before the collective that reads `out`, and out2 = recv + b just after the
 * wait. Out of place, so NCCL really copies: without the ready event it would
 * copy `out` while the add still writes it; without the stream wait after
 * completion the second add could read `recv` before NCCL wrote it. */
static void check_ordering(CommGroup *g) {
    float *a = dev_pattern(BIG, 4), *b = dev_pattern(BIG, 5);
    float *out = be->alloc(BIG * sizeof(float)), *recv = be->alloc(BIG * sizeof(float));
    float *out2 = be->alloc(BIG * sizeof(float));
    be->add(out, a, b, BIG);
    comm_reduce_scatter(g, out, recv, BIG);
    be->add(out2, recv, b, BIG);
    report_bad("nccl_order_reduce_scatter", dev_check(out2, BIG, 1, 4, 2, 5),
               "a + 2b: the collective must see the add before it, the add after it its result");

    be->add(out, a, a, BIG);
    comm_all_gather(g, out, recv, BIG);
    be->add(out2, recv, b, BIG);
    report_bad("nccl_order_all_gather", dev_check(out2, BIG, 2, 4, 1, 5), "2a + b");

    /* non-blocking: post, then a kernel and a memset on the compute stream
     * while it runs, then wait; the compute work must not disturb it and must
     * itself be right */
    be->add(out, b, b, BIG);
    CommRequest r;
    comm_ireduce_scatter(g, out, recv, BIG, &r);
    be->add(out2, a, a, BIG); /* independent of the collective */
    be->zero(a, BIG * sizeof(float));
    int polls = 0;
    while (!comm_test(&r)) polls++;
    comm_wait(&r); /* a no-op after comm_test said 1 */
    report_bad("nccl_overlap_ireduce_scatter", dev_check(recv, BIG, 2, 5, 0, 0), "2b while compute ran");
    report_bad("nccl_overlap_kernel", dev_check(out2, BIG, 2, 4, 0, 0), "the overlapped add: 2a");
    report_bad("nccl_overlap_memset", dev_check(a, BIG, 0, 0, 0, 0), "the overlapped memset");
    printf("# comm_test polled %d times before the reduce-scatter was done\n", polls);

    /* all three non-blocking forms in flight together, in place where the
     * API allows, a kernel between */
    float *x = dev_pattern(BIG, 6), *y = dev_pattern(BIG, 7), *z = dev_pattern(BIG, 8);
    CommRequest q[3];
    comm_iall_reduce_sum(g, x, BIG, &q[0]);
    comm_ireduce_scatter(g, y, y + (size_t)g->rank * BIG, BIG, &q[1]);
    be->add(out2, b, b, BIG);
    comm_iall_gather(g, z + (size_t)g->rank * BIG, z, BIG, &q[2]);
    for (int i = 2; i >= 0; i--) comm_wait(&q[i]); /* any order */
    long bad = dev_check(x, BIG, 1, 6, 0, 0);
    if (bad < 0) bad = dev_check(y, BIG, 1, 7, 0, 0);
    if (bad < 0) bad = dev_check(z, BIG, 1, 8, 0, 0);
    if (bad < 0) bad = dev_check(out2, BIG, 2, 5, 0, 0);
    report_bad("nccl_nonblocking_three", bad, "iall_reduce, ireduce_scatter, iall_gather in place, with an add");
    be->free(x);
    be->free(y);
    be->free(z);
    be->free(a);
    be->free(b);
    be->free(out);
    be->free(out2);
    be->free(recv);
}

/* More requests in flight than the 16 events the pool starts with: it must
 * grow, and every request still completes with its own values. */
static void check_many(CommGroup *g) {
    enum { K = 40 };
    size_t n = 4096;
    float *buf[K];
    CommRequest r[K];
    for (int k = 0; k < K; k++) buf[k] = dev_pattern(n, 10 + k);
    uint64_t seq0 = g->seq;
    for (int k = 0; k < K; k++) comm_iall_reduce_sum(g, buf[k], n, &r[k]);
    for (int k = 0; k < K; k++) comm_wait(&r[k]);
    long bad = -1;
    for (int k = 0; k < K && bad < 0; k++) bad = dev_check(buf[k], n, 1, 10 + k, 0, 0);
    report_bad("nccl_many_in_flight", bad, "40 all-reduces in flight at once");
    test_report(g->seq == seq0 + K, "nccl_sequence_numbers", "seq advanced by %llu, wanted %d",
                (unsigned long long)(g->seq - seq0), K);
    for (int k = 0; k < K; k++) be->free(buf[k]);
}

/* ------------------------------------------------------------ the deadline */

#ifdef KILN_NCCL
static void CUDART_CB stall(void *arg) { sleep(*(int *)arg); }
#endif

/* Child mode (argv[1] == "timeout"): the compute stream stalls for 4 s in a
 * host function before an all-reduce that must wait for it; with a 1 s
 * deadline comm_wait must abort the communicator and exit 1 with one line. */
static int run_timeout_child(CommGroup *g) {
#ifdef KILN_NCCL
    static int secs = 4;
    float *x = dev_pattern(1024, 1);
    comm_set_timeout(1.0);
    cudaError_t e = cudaLaunchHostFunc((cudaStream_t)be->stream(), stall, &secs);
    if (e != cudaSuccess) {
        fprintf(stderr, "cudaLaunchHostFunc: %s\n", cudaGetErrorString(e));
        return 3;
    }
    comm_all_reduce_sum(g, x, 1024);
    fprintf(stderr, "comm_all_reduce_sum returned past its deadline\n");
#endif
    return 4;
}

/* Run this binary again as the timeout child, stderr captured, bounded by
 * 60 s (a wait that never ends is the failure being tested for). */
static void check_timeout(void) {
    int fd[2];
    if (pipe(fd) != 0) {
        test_report(0, "nccl_timeout_aborts", "pipe: %s", strerror(errno));
        return;
    }
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        close(fd[0]);
        dup2(fd[1], 2);
        dup2(fd[1], 1);
        execl("/proc/self/exe", "test_nccl", "timeout", (char *)NULL);
        _exit(127);
    }
    close(fd[1]);
    char err[4096];
    size_t n = 0;
    double t0 = kiln_now();
    int killed = 0;
    for (;;) {
        struct pollfd p = {fd[0], POLLIN, 0};
        int left = (int)(60000 - (kiln_now() - t0) * 1000);
        if (left <= 0) {
            kill(pid, SIGKILL);
            killed = 1;
            break;
        }
        if (poll(&p, 1, left) <= 0) continue;
        ssize_t r = read(fd[0], err + n, sizeof err - 1 - n);
        if (r <= 0) break;
        n += (size_t)r;
        if (n == sizeof err - 1) break;
    }
    err[n] = '\0';
    close(fd[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    double dt = kiln_now() - t0;
    int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    /* the MPI timeout's own words (comm_timeout), here with nobody to ask */
    const char *want = "all_reduce #1 on group 'world' (1 ranks) did not complete within 1 s";
    test_report(!killed && code == 1 && strstr(err, "kiln: error: rank 0: ") && strstr(err, want), "nccl_timeout_aborts",
                "exit %d after %.1f s%s, wanted exit 1 and '%s'; output: %.600s", code, dt,
                killed ? " (killed at 60 s)" : "", want, err);
}

/* Stream-ordered mode (tensor parallelism's collectives): a blocking
 * collective returns once enqueued and the compute stream waits for it, so a
 * kernel after it reads its result with no host wait; more than the 64
 * pending requests drain by themselves; comm_drain leaves none. Then the bf16
 * sums (one rank: the values, small integers, exact in bf16, unchanged). */
static void check_stream_ordered(CommGroup *g) {
    comm_nccl_stream_ordered(g);
    float *a = dev_pattern(BIG, 9), *b = dev_pattern(BIG, 10);
    float *out = be->alloc(BIG * sizeof(float)), *recv = be->alloc(BIG * sizeof(float));
    float *out2 = be->alloc(BIG * sizeof(float));
    be->add(out, a, b, BIG);
    comm_reduce_scatter(g, out, recv, BIG);
    be->add(out2, recv, b, BIG);
    report_bad("nccl_ordered_reduce_scatter", dev_check(out2, BIG, 1, 9, 2, 10),
               "a + 2b with no host wait between the collective and the add after it");
    enum { K = 70 };
    for (int k = 0; k < K; k++) comm_all_reduce_sum(g, a, 4096);
    comm_drain(g);
    report_bad("nccl_ordered_many", dev_check(a, BIG, 1, 9, 0, 0), "70 ordered all-reduces (one rank: unchanged)");
    size_t n = 4096;
    uint16_t *h16 = malloc(n * sizeof(uint16_t));
    float *hf = host_pattern(n, 11), *back = malloc(n * sizeof(float));
    backend_f32_to_act(h16, hf, n, 2);
    void *d16 = be->alloc(n * sizeof(uint16_t)), *r16 = be->alloc(n * sizeof(uint16_t));
    be->to_device(d16, h16, n * sizeof(uint16_t));
    comm_all_reduce_sum_bf16(g, d16, n);
    comm_reduce_scatter_bf16(g, d16, r16, n);
    comm_drain(g);
    be->to_host(h16, r16, n * sizeof(uint16_t));
    backend_act_to_f32(back, h16, n, 2);
    long bad = -1;
    for (size_t i = 0; i < n && bad < 0; i++)
        if (back[i] != hf[i]) bad = (long)i;
    report_bad("nccl_bf16_sums", bad, "bf16 all-reduce and reduce-scatter of one rank");
    free(h16), free(hf), free(back);
    be->free(d16), be->free(r16);
    be->free(a), be->free(b), be->free(out), be->free(out2), be->free(recv);
}

int main(int argc, char **argv) {
    int child = argc > 1 && strcmp(argv[1], "timeout") == 0;
    if (strcmp(comm_nccl_build_info(), "nccl: not built in") == 0) {
        printf("skip nccl: this build has no NCCL (no CUDA backend, or no nccl.h at build time)\n");
        return 0;
    }
    char why[1024];
    if (!comm_nccl_available(why, sizeof why)) {
        printf("skip nccl: %s\n", why);
        return 0;
    }
    if (!child) test_report(1, "nccl_load", "");
    printf("# %s\n", comm_nccl_build_info());
    be = backend_get("cuda");
    if (!be || !backend_available("cuda")) {
        printf("skip nccl_device: no GPU\n");
        return 0;
    }
    be->init(0);
    comm_init(0);
    CommGroup *g = comm_world();
    if (g->size != 1) {
        printf("skip nccl_device: run it as one process, not under a launcher (world size %d)\n", g->size);
        return 0;
    }
    char dir[] = "/tmp/kiln-nccl.XXXXXX";
    if (!mkdtemp(dir)) kiln_fail(KILN_EXIT_RUNTIME, "mkdtemp: %s", strerror(errno));
    comm_nccl_init(g, dir);
    if (!be->stream) kiln_fail(KILN_EXIT_RUNTIME, "the cuda backend has no stream hook");
    comm_nccl_device_mode(g, be->stream());
    if (child) return run_timeout_child(g);
    char desc[256];
    comm_describe(desc, sizeof desc);
    test_report(strstr(desc, ", NCCL ") != NULL, "nccl_describe", "comm_describe does not name NCCL: %s", desc);

    check_blocking(g);
    check_ordering(g);
    check_many(g);
    check_timeout();
    check_stream_ordered(g);

    comm_nccl_free(g);
    test_report(g->nccl == NULL && g->dev == NULL, "nccl_free", "comm_nccl_free left the communicator or its streams");
    comm_finalize();
    be->shutdown();
    rmdir(dir);
    return 0;
}
