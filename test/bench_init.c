/* bench_init: the initial weights' draw at GPT-2 124M and 1.5B shapes,
 * printed, never asserted (timings on a shared machine are no test): the
 * sequential draw it replaced (init_ref.h: one thread, every value of the
 * whole model on every rank) against model_init_weights on 1 and 2 threads,
 * for one rank and for a pipeline stage and tp rank of a larger layout, each
 * result checked bit for bit against the sequential one.
 *
 * usage: bench_init [CASE...]  (default all: 124m, 124m_tp2, 1558m_pp8, 1558m_pp8_tp5) */
#include <omp.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "init_ref.h"
#include "model.h"
#include "util.h"

static double cpu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct {
    const char *name;
    int n_layer, n_head, n_embd;
    ModelOptions o;
} InitCase;

static void run(const InitCase *c) {
    ArchSpec s = ARCH_GPT2_SHAPE(c->n_layer, c->n_head, c->n_embd, 1024, 50257);
    arch_resolve(&s);
    Model m;
    model_init(&m, &backend_cpu, &s, &c->o);
    size_t whole = arch_num_params(&s);
    omp_set_num_threads(1);
    double w0 = kiln_now(), c0 = cpu_now();
    int all;
    float **ref = init_ref_draw(&m, 1337, &all);
    printf("%-14s whole %.1fM, this rank %.1fM | sequential: %6.2f s wall, %6.2f s cpu (%.1f ns per parameter)\n",
           c->name, whole / 1e6, m.num_params / 1e6, kiln_now() - w0, cpu_now() - c0,
           (cpu_now() - c0) / (double)whole * 1e9);
    for (int threads = 1; threads <= 2; threads++) {
        omp_set_num_threads(threads);
        memset(m.param_mem, 0xff, m.num_params * sizeof(float)); /* NaNs: a value not written fails the check */
        w0 = kiln_now(), c0 = cpu_now();
        model_init_weights(&m, 1337);
        double wall = kiln_now() - w0, cpu = cpu_now() - c0;
        char bad[64] = "";
        int same = init_ref_same(&m, ref, bad, sizeof bad);
        printf("%-14s model_init_weights, %d thread%s: %6.2f s wall, %6.2f s cpu, %s%s\n", c->name, threads,
               threads > 1 ? "s" : " ", wall, cpu, same ? "same bits" : "DIFFERENT at ", bad);
    }
    init_ref_free(ref, all);
    model_free(&m);
    fflush(stdout);
}

int main(int argc, char **argv) {
    const InitCase cases[] = {
        {"124m", 12, 12, 768, {0}},
        {"124m_tp2", 12, 12, 768, {.tp = 2, .tp_rank = 1}},
        /* GPT-2 1.5B does not fit a 24 GiB machine whole (with its gradients):
         * the stage of pp 8 that holds layers 18..23, alone and as tp rank 2 of 5 */
        {"1558m_pp8", 48, 25, 1600, {.layer_lo = 18, .layer_hi = 24}},
        {"1558m_pp8_tp5", 48, 25, 1600, {.layer_lo = 18, .layer_hi = 24, .tp = 5, .tp_rank = 2}},
    };
    backend_cpu.init(0);
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        int want = argc < 2;
        for (int a = 1; a < argc; a++) want = want || !strcmp(argv[a], cases[k].name);
        if (want) run(&cases[k]);
    }
    backend_cpu.shutdown();
    return 0;
}
