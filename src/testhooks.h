/* testhooks: every fault-injection and dump point the tests use, behind
 * one door. Each is an environment variable KILN_TEST_<NAME>, read once, the
 * first time testhooks() is called, and never again: the main path reads
 * the named fields below and never calls getenv for a test. Unset, every
 * field is off (0, -1 for a rank, NULL), and a run behaves as if this file
 * did not exist. docs/testing.md, "Test hooks", says which test uses which.
 * A malformed value ends with one line naming the variable (exit 2). */
#ifndef KILN_TESTHOOKS_H
#define KILN_TESTHOOKS_H

#include <stddef.h>

/* RANK:STEP[:GROUP]: on world rank `rank`, at step `step` (0: unset), in the
 * collectives of `group` (flight.c's hooks). */
typedef struct TestHookAt {
    int rank, step;
    char group[32];
} TestHookAt;

typedef struct TestHooks {
    /* data.c: before batch data_wait_batch of data.train, create
     * data_wait_file and wait until a test removes it (DATA_WAIT_AT_BATCH,
     * DATA_WAIT_FILE; 0 / NULL: off) */
    long data_wait_batch;
    const char *data_wait_file;
    /* flight.c (docs/parallel.md, "Debugging hangs"): skip one collective, or
     * post one with the wrong size (SKIP_COLLECTIVE, WRONG_COLLECTIVE:
     * RANK:STEP:GROUP); SIGSEGV, or pause for a stack dump, at a step (SEGV,
     * FLIGHT_PAUSE: RANK:STEP) */
    TestHookAt skip_collective, wrong_collective, segv, flight_pause;
    /* metrics.c (docs/metrics.md): hang in the forward phase of this step
     * (STALL_AT_STEP); rank slow_rank sleeps slow_ms entering each forward
     * (SLOW_RANK, SLOW_MS; -1 / 0: off) */
    int stall_at_step;
    int slow_rank, slow_ms;
    /* mlflow_rest.c (docs/metrics.md): send every batch twice, as after a
     * lost reply (MLFLOW_RESEND); keep every point in the queue, as a kill -9
     * finds it (MLFLOW_HOLD) */
    int mlflow_resend, mlflow_hold;
    /* model_fp8.c: each tp/cp rank scales by its own amax, the known bug
     * its test must catch (FP8_LOCAL_AMAX) */
    int fp8_local_amax;
    /* prepare.c: bytes of a piece of a document when several threads
     * encode (PREPARE_CHUNK; 0: the default) */
    size_t prepare_chunk;
    /* stop.c: "STEP:FILE[,STEP:FILE]...": after step STEP wait for FILE
     * (GATE); train.c: after step N wait for a stop signal (PAUSE_AT_STEP) */
    const char *gate;
    int pause_at_step;
    /* train.c (docs/metrics.md): poison one gradient at step N, or every step
     * from N on ("N+") (INJECT_NAN_STEP); dump the replicated tensors'
     * gradients under tp to FILE.rank<R> (TP_GRADS); dump the optimizer's
     * inputs and outputs to DIR (OPTIM_DUMP, docs/optimizers.md) */
    int inject_nan_step, inject_nan_after;
    const char *tp_grads, *optim_dump;
} TestHooks;

/* The hooks, read from the environment at the first call. */
const TestHooks *testhooks(void);
/* Forget them, so the next testhooks() reads the environment again: for a
 * unit test that sets a variable in its own process (test_flight). */
void testhooks_reset(void);

/* The dump points (train.c calls them where the hooks are set). tp_grads:
 * after the first step's gradient sync, a line per replicated tensor, its
 * name and the FNV-1a hash of its gradient, into FILE.rank<R>. optim_dump
 * (one rank, ZeRO 0; docs/optimizers.md): the tensor table and the first
 * parameters at start, then each step's learning rate and parameters. */
struct Model;
struct AdamW;
void testhooks_replicated_grads(const struct Model *m, const char *path, int rank);
void testhooks_optim_start(const char *dir, const struct Model *m, const struct AdamW *o, int ranks);
void testhooks_optim_grads(const char *dir, const struct Model *m, int step); /* the summed gradients, before clipping */
void testhooks_optim_step(const char *dir, const struct Model *m, int step, float lr);

#endif
