/* bench_flight: what one operation costs the flight recorder (a ring record
 * posted, waited on and completed, in one process), and, under mpirun, what
 * monitor.check_collectives adds to one collective: back-to-back 1-element
 * all-reduces of doubles over the world with the check off and on, in
 * alternating rounds, the median round reported. Run by scripts/bench_flight.sh;
 * prints lines, asserts nothing. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "flight.h"
#include "util.h"

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp);
    return v[n / 2];
}

int main(int argc, char **argv) {
    int ops = argc > 1 ? atoi(argv[1]) : 2000, rounds = argc > 2 ? atoi(argv[2]) : 7;
    comm_init(60);
    const CommInfo *ci = comm_info();
    char dir[] = "/tmp/kiln-bench-flight.XXXXXX";
    if (!mkdtemp(dir)) return 1;
    /* the recorder alone: post, wait, done per operation, 1e6 times */
    flight_open(&(FlightOptions){.run_dir = dir, .rank = ci->rank, .world = ci->world, .host = ci->host,
                                 .records = 256});
    FlightOp op = {.group = "dp", .group_first = 0, .group_size = 2, .op = "all_reduce", .dtype = FLIGHT_F32,
                   .count = 1, .peer = -1};
    double t0 = kiln_now();
    int n = 1000000;
    for (int i = 0; i < n; i++) {
        op.seq = op.coll = (uint64_t)i;
        uint64_t id = flight_post(&op);
        flight_wait(id);
        flight_done(id);
    }
    double rec_ns = (kiln_now() - t0) / n * 1e9;
    CommGroup *w = comm_world();
    double off[64], on[64], x = 1;
    if (rounds > 64) rounds = 64;
    for (int r = 0; r < rounds && w->size > 1; r++) {
        for (int check = 0; check < 2; check++) {
            comm_check_collectives(check);
            comm_barrier(w);
            double t = kiln_now();
            for (int i = 0; i < ops; i++) x = 1, comm_all_reduce_sum_f64(w, &x, 1);
            double us = (kiln_now() - t) / ops * 1e6;
            (check ? on : off)[r] = us;
        }
    }
    comm_check_collectives(0);
    if (ci->rank == 0) {
        printf("flight recorder: %.0f ns per operation recorded (post + wait + done, one process)\n", rec_ns);
        if (w->size > 1) {
            double a = median(off, rounds), b = median(on, rounds);
            printf("all_reduce of 1 double over %d ranks: %.1f us, with check_collectives %.1f us (+%.1f us per "
                   "collective; median of %d rounds of %d)\n",
                   w->size, a, b, b - a, rounds, ops);
        }
    }
    flight_close();
    char cmd[64];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) fprintf(stderr, "bench_flight: could not remove %s\n", dir);
    comm_finalize();
    return 0;
}
