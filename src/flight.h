/* flight: the collective flight recorder. A fixed ring of this rank's latest
 * collectives and point-to-point operations (comm.c records every one), written
 * to RUN_DIR/flight/rank<R>.json on a timeout, a watchdog stall, a fatal signal
 * or SIGUSR2; `./train doctor` (doctor.h) reads the files. Knows no MPI, NCCL,
 * config or model; the dump is async-signal-safe and never allocates. */
#ifndef KILN_FLIGHT_H
#define KILN_FLIGHT_H

#include <stddef.h>
#include <stdint.h>

typedef enum { FLIGHT_NONE, FLIGHT_F32, FLIGHT_F64, FLIGHT_BYTES, FLIGHT_BF16 } FlightDtype;

/* Why a ring is written: the file's "reason". FLIGHT_PEER (a peer that timed
 * out asked this rank where it is) never overwrites a file of another reason. */
typedef enum {
    FLIGHT_TIMEOUT,  /* this rank's collective ran past parallel.timeout_s */
    FLIGHT_PEER,     /* detail: the world rank that timed out and asked */
    FLIGHT_STALL,    /* the watchdog (monitor.stall_timeout_s) fired */
    FLIGHT_MISMATCH, /* monitor.check_collectives: detail = a rank that disagrees */
    FLIGHT_COMM_ERROR, /* MPI or NCCL reported an error */
    FLIGHT_SIGNAL    /* detail: the signal (SIGUSR2, SIGSEGV, SIGABRT, SIGBUS) */
} FlightReason;

typedef struct FlightOptions {
    const char *run_dir; /* files go to run_dir/flight/ */
    int rank, world;     /* in the world */
    const char *host;
    int records;         /* ring size (monitor.flight_records); 0 = off */
    int signals;         /* 1: handle SIGUSR2 (dump, go on) and SIGSEGV/SIGABRT/SIGBUS (dump, die) */
} FlightOptions;

/* One operation as comm.c posts it. */
typedef struct FlightOp {
    const char *group;       /* CommGroup.name */
    int group_first, group_size; /* world rank of the group's rank 0, members: which group of that name */
    const char *op;          /* "all_reduce", "send", ...: a string literal (read by the signal handler) */
    uint64_t seq;            /* CommGroup.seq: the number timeout messages print */
    uint64_t coll;           /* CommGroup.coll: collectives only, what every member must agree on */
    FlightDtype dtype;
    uint64_t count;          /* elements (per rank's block where the operation has blocks) */
    int peer;                /* world rank: a broadcast's root, a send's or recv's other side; -1 none */
} FlightOp;

/* Allocate the ring and the dump buffer (nothing is allocated after this),
 * parse the test hooks, install the signal handlers. Call once per run, after
 * comm_init; flight_close undoes it. With records = 0 nothing is recorded,
 * and SIGUSR2 prints a line saying the recorder is off. */
void flight_open(const FlightOptions *o);
void flight_close(void);
int flight_records(void); /* the ring's size; 0 = off */

/* Record: flight_post returns the operation's id (0 when off), flight_wait
 * marks when the rank began to wait for it (the latest such time is kept) and
 * makes it the one the file's "waiting" names, flight_done its completion.
 * Ids whose slot the ring has since reused are ignored. */
uint64_t flight_post(const FlightOp *op);
void flight_wait(uint64_t id);
void flight_idle(uint64_t id); /* no longer waiting: a non-blocking post goes back to compute */
void flight_done(uint64_t id);
/* The rank's phase and step (metrics_phase calls this): a string literal. */
void flight_phase(const char *phase, int step);
int flight_step(void);

/* Write the ring to RUN_DIR/flight/rank<R>.json (tmp + rename). Async-signal-
 * safe; a dump already in progress (another thread, a signal) wins and this
 * one returns -1. 0 when written; -1 when off or failed. */
int flight_dump(FlightReason why, int detail);
/* How many dumps SIGUSR2 has caused (test hook flight_pause, testhooks.h). */
int flight_usr2_dumps(void);
/* Format the ring as the file's JSON into buf[0, cap): bytes written (the
 * dump's own formatter, for tests). */
size_t flight_format(char *buf, size_t cap, FlightReason why, int detail);

/* Test hooks (docs/parallel.md "Test hooks"; testhooks.h): skip_collective R:S:GROUP
 * and wrong_collective R:S:GROUP act once, on world rank R's first
 * all-reduce of doubles on GROUP during step S; comm.c asks here. */
typedef enum { FLIGHT_HOOK_NONE, FLIGHT_HOOK_SKIP, FLIGHT_HOOK_WRONG } FlightHook;
FlightHook flight_test_hook(const char *group);

#endif
