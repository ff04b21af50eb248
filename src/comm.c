/* comm: rank discovery and collectives with deadlines (see comm.h). Host
 * buffers go through MPI's non-blocking collectives polled against a deadline;
 * device buffers through NCCL (the KILN_NCCL section at the end). Must never
 * block without a deadline, and never know the model. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "comm.h"

#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "flight.h"
#include "util.h"

#ifdef KILN_MPI
#include <mpi.h>
_Static_assert(sizeof(MPI_Comm) <= sizeof(uint64_t), "MPI_Comm must fit CommGroup.mpi");
_Static_assert(sizeof(MPI_Request) <= sizeof(uint64_t), "MPI_Request must fit CommRequest.mpi");
#endif

/* What each rank tells the others at start: enough to name a dead peer. */
typedef struct PeerInfo {
    char host[64];
    int32_t pid;
    int32_t local_rank;
} PeerInfo;

static struct {
    int initialised;
    CommInfo info;
    CommGroup world;
    PeerInfo *peers; /* [world] */
    const char *rank_var, *size_var; /* the variables the rank came from */
    /* The watch: a second communicator on which a rank that timed out asks
     * the others where they are, and on which every rank waiting in a
     * collective answers (see watch_serve). */
    int watch_on;
    uint64_t watch;             /* MPI_Comm */
    const char *cur_op;         /* the collective this rank waits in, or NULL */
    const CommGroup *cur_group;
    uint64_t cur_seq;
    struct WatchMsg *answers;   /* [world]: one answer buffer per asker */
    uint64_t *answer_req;       /* [world]: MPI_Request of each answer */
    int check;                  /* monitor.check_collectives */
    struct CheckCall *check_all; /* [world]: every member's call, gathered before each collective */
    int *v_ints;                /* [4 v_cap]: all_to_allv's int counts and displacements (MPI), grown
                                   to the largest group once */
    size_t v_cap;
} C;

/* A rank's answer to "where are you?". */
typedef struct WatchMsg {
    int32_t rank;
    int32_t waiting;            /* 1 if inside a collective's wait */
    uint64_t seq;
    char op[24];
    char group[COMM_GROUP_NAME];
} WatchMsg;
enum { WATCH_ASK = 7301, WATCH_ANSWER = 7302 };

/* ---------------------------------------------------------------- env */

/* Read a non-negative integer variable; -1 if unset; exits 2 if malformed. */
static int env_int(const char *name) {
    const char *s = getenv(name);
    if (!s || !*s) return -1;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < 0 || v > INT_MAX)
        kiln_fail(KILN_EXIT_USAGE, "environment variable %s='%s': expected a non-negative integer", name, s);
    return (int)v;
}

static const char *source_name(CommSource s) {
    switch (s) {
    case COMM_SOURCE_SLURM: return "Slurm";
    case COMM_SOURCE_OPENMPI: return "Open MPI";
    case COMM_SOURCE_ENV: return "RANK/WORLD_SIZE";
    default: return "no launcher";
    }
}

/* Open MPI's variables win over Slurm's when both are set: mpirun inside an
 * allocation starts the ranks itself, and its children inherit the batch
 * shell's SLURM_PROCID=0. Slurm counts only inside an srun step, which sets
 * SLURM_STEP_NUM_TASKS: the batch shell also has SLURM_PROCID=0 and
 * SLURM_NTASKS=<allocation> (measured, Slurm 22.05), and ./train started there
 * without srun is one rank, not rank 0 of a job that never started. */
static void discover(CommInfo *in) {
    in->rank = 0;
    in->world = 1;
    in->local_rank = 0;
    in->source = COMM_SOURCE_SINGLE;
    C.rank_var = C.size_var = "";
    int r, w;
    if ((w = env_int("OMPI_COMM_WORLD_SIZE")) >= 0 && (r = env_int("OMPI_COMM_WORLD_RANK")) >= 0) {
        in->source = COMM_SOURCE_OPENMPI;
        C.rank_var = "OMPI_COMM_WORLD_RANK", C.size_var = "OMPI_COMM_WORLD_SIZE";
        in->local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK");
    } else if ((r = env_int("SLURM_PROCID")) >= 0 && (w = env_int("SLURM_STEP_NUM_TASKS")) >= 0) {
        in->source = COMM_SOURCE_SLURM;
        C.rank_var = "SLURM_PROCID", C.size_var = "SLURM_STEP_NUM_TASKS";
        in->local_rank = env_int("SLURM_LOCALID");
    } else if ((w = env_int("WORLD_SIZE")) >= 0 && (r = env_int("RANK")) >= 0) {
        in->source = COMM_SOURCE_ENV;
        C.rank_var = "RANK", C.size_var = "WORLD_SIZE";
        in->local_rank = env_int("LOCAL_RANK");
    } else {
        return;
    }
    if (w < 1 || r >= w)
        kiln_fail(KILN_EXIT_USAGE, "environment: %s=%d is not a rank of %s=%d", C.rank_var, r, C.size_var, w);
    in->rank = r;
    in->world = w;
    if (in->local_rank < 0) in->local_rank = 0;
}

/* ---------------------------------------------------------------- MPI plumbing */

#ifdef KILN_MPI
static MPI_Comm mcomm(const CommGroup *g) {
    MPI_Comm c;
    memcpy(&c, &g->mpi, sizeof c);
    return c;
}
static void set_mcomm(CommGroup *g, MPI_Comm c) {
    g->mpi = 0;
    memcpy(&g->mpi, &c, sizeof c);
}
static MPI_Request *mreq(CommRequest *r) { return (MPI_Request *)(void *)&r->mpi; }

/* Every MPI call goes through this: errors return (MPI_ERRORS_RETURN) and
 * end the run with the call, the group and MPI's own words. */
#define MPI_CHECK(g, call)                                                                                          \
    do {                                                                                                            \
        int mpi_rc_ = (call);                                                                                       \
        if (mpi_rc_ != MPI_SUCCESS) mpi_fail(__FILE__, __LINE__, #call, (g), mpi_rc_);                              \
    } while (0)

static void mpi_fail(const char *file, int line, const char *call, const CommGroup *g, int rc) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) snprintf(msg, sizeof msg, "MPI error %d", rc);
    flight_dump(FLIGHT_COMM_ERROR, rc);
    kiln_fail(KILN_EXIT_RUNTIME, "rank %d: %s:%d: %s on group '%s' failed: %s", C.info.rank, file, line, call,
              g ? g->name : "world", msg);
}
#endif

static int group_uses_mpi(const CommGroup *g) { return g->size > 1; }

/* Device mode (comm_nccl_device_mode; the NCCL section at the end): what a
 * float collective becomes when g->dev is set. */
typedef enum {
    NCCL_OP_SUM,
    NCCL_OP_AVG,
    NCCL_OP_REDUCE_SCATTER,
    NCCL_OP_ALL_GATHER,
    NCCL_OP_BROADCAST,
    NCCL_OP_SEND,
    NCCL_OP_RECV,
    NCCL_OP_ALL_TO_ALL,
    NCCL_OP_SUM_BF16,           /* bf16 activations (tensor parallelism) */
    NCCL_OP_REDUCE_SCATTER_BF16,
    NCCL_OP_SENDRECV            /* a ring step (context parallelism): send to one peer, receive from another */
} NcclOp;
/* n: elements per rank's block where the operation has blocks; peer: the
 * root of a broadcast or the other side of a send/recv; for SENDRECV the
 * rank sent to plus (the rank received from) << 16 (NCCL_PAIR). */
#define NCCL_PAIR(to, from) ((to) | (from) << 16)
static void nccl_post(CommRequest *req, NcclOp k, const void *send, void *recv, size_t n, int peer);
/* comm_all_to_allv in device mode: one group of ncclSend/ncclRecv, counts in elements of esz bytes. */
static void nccl_post_alltoallv(CommRequest *req, const void *send, const size_t *send_counts, void *recv,
                                const size_t *recv_counts, size_t esz);
static int nccl_test(CommRequest *req);
static void nccl_wait(CommRequest *req);
static void nccl_describe(char *buf, size_t n);
static void req_start(CommRequest *req, CommGroup *g, const char *op);
static int nccl_run_ordered(CommGroup *g, const char *op, NcclOp k, const void *send, void *recv, size_t n, int peer);

/* A blocking collective in device mode: post, then wait (or, on a
 * stream-ordered group, post and let the compute stream wait). */
static void dev_run(CommGroup *g, const char *op, NcclOp k, const void *send, void *recv, size_t n, int peer) {
    if (nccl_run_ordered(g, op, k, send, recv, n, peer)) return;
    CommRequest r;
    req_start(&r, g, op);
    nccl_post(&r, k, send, recv, n, peer);
    if (r.active) nccl_wait(&r);
}

/* ---------------------------------------------------------------- dead peers and deadlines */

int comm_dead_peers(const CommGroup *g, int *out, int max) {
    int n = 0;
    if (!C.peers) return 0;
    for (int i = 0; i < g->size && n < max; i++) {
        int w = g->members[i];
        if (w == C.info.rank) continue;
        const PeerInfo *p = &C.peers[w];
        if (strcmp(p->host, C.info.host) != 0 || p->pid <= 0) continue;
        if (kill(p->pid, 0) != 0 && errno == ESRCH) out[n++] = w;
    }
    return n;
}

#ifdef KILN_MPI
static MPI_Comm watch_comm(void) {
    MPI_Comm c;
    memcpy(&c, &C.watch, sizeof c);
    return c;
}

/* Answer every pending "where are you?" with this rank's current wait.
 * Called from every wait loop, so a rank blocked in a collective answers
 * within a millisecond; a rank stuck outside comm (or dead) never does. */
static void watch_serve(void) {
    if (!C.watch_on) return;
    MPI_Comm w = watch_comm();
    for (;;) {
        int flag = 0;
        MPI_Status st;
        if (MPI_Iprobe(MPI_ANY_SOURCE, WATCH_ASK, w, &flag, &st) != MPI_SUCCESS || !flag) return;
        int32_t who;
        if (MPI_Recv(&who, 1, MPI_INT32_T, st.MPI_SOURCE, WATCH_ASK, w, MPI_STATUS_IGNORE) != MPI_SUCCESS) return;
        /* a peer timed out: write the ring before answering, so that every
         * rank still waiting has its file before the asker exits (and mpirun
         * ends the job) */
        flight_dump(FLIGHT_PEER, who);
        int src = st.MPI_SOURCE;
        MPI_Request *r = (MPI_Request *)(void *)&C.answer_req[src];
        if (*r != MPI_REQUEST_NULL) {
            int done = 0;
            MPI_Test(r, &done, MPI_STATUS_IGNORE);
            if (!done) continue; /* still sending the previous answer to this asker */
        }
        WatchMsg *m = &C.answers[src];
        memset(m, 0, sizeof *m);
        m->rank = C.info.rank;
        m->waiting = C.cur_op != NULL;
        m->seq = C.cur_seq;
        if (C.cur_op) kiln_strlcpy(m->op, C.cur_op, sizeof m->op);
        if (C.cur_group) kiln_strlcpy(m->group, C.cur_group->name, sizeof m->group);
        MPI_Isend(m, (int)sizeof *m, MPI_BYTE, src, WATCH_ANSWER, w, r);
    }
}

/* Ask every other member of g where it is; collect answers for up to `grace`
 * seconds. ans[i] (group rank i) gets the answer; got[i] = 1 if one came. */
static void watch_ask(const CommGroup *g, WatchMsg *ans, int *got, double grace) {
    MPI_Comm w = watch_comm();
    int32_t me = C.info.rank;
    int pending = 0;
    for (int i = 0; i < g->size; i++) {
        got[i] = 0;
        if (i == g->rank) continue;
        MPI_Request r;
        /* never waited on: a dead peer must not hold us; eager sends of 4 bytes complete locally */
        if (MPI_Isend(&me, 1, MPI_INT32_T, g->members[i], WATCH_ASK, w, &r) == MPI_SUCCESS) MPI_Request_free(&r);
        pending++;
    }
    double t0 = kiln_now();
    while (pending > 0 && kiln_now() - t0 < grace) {
        watch_serve();
        int flag = 0;
        MPI_Status st;
        if (MPI_Iprobe(MPI_ANY_SOURCE, WATCH_ANSWER, w, &flag, &st) == MPI_SUCCESS && flag) {
            WatchMsg m;
            if (MPI_Recv(&m, (int)sizeof m, MPI_BYTE, st.MPI_SOURCE, WATCH_ANSWER, w, MPI_STATUS_IGNORE) != MPI_SUCCESS)
                continue;
            for (int i = 0; i < g->size; i++)
                if (g->members[i] == st.MPI_SOURCE && !got[i]) {
                    got[i] = 1;
                    ans[i] = m;
                    pending--;
                }
        } else {
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
        }
    }
}
#endif

/* A wait ran past its deadline: one line naming the group, the collective,
 * the peers that are waiting in it too, and the ones that never came (dead:
 * the pid is gone; alive but silent: stuck outside comm; on another host: no
 * answer); then exit 1. _exit, not exit: MPI's exit handlers may wait on the
 * very peer that died. */
__attribute__((unused)) static void comm_timeout(const CommGroup *g, const char *op, uint64_t seq, double waited) {
    char line[2048];
    int cap = (int)sizeof line - 160;
    flight_dump(FLIGHT_TIMEOUT, -1); /* first: the ring as it was when the wait gave up */
    int k = snprintf(line, sizeof line, "rank %d: %s #%llu on group '%s' (%d ranks) did not complete within %.0f s",
                     C.info.rank, op, (unsigned long long)seq, g->name, g->size, waited);
    int *got = xcalloc((size_t)g->size, sizeof(int));
    WatchMsg *ans = xcalloc((size_t)g->size, sizeof(WatchMsg));
#ifdef KILN_MPI
    if (C.watch_on) {
        C.cur_op = op; /* answer the others while asking */
        watch_ask(g, ans, got, 2.0);
    }
#endif
    int dead[64];
    int nd = comm_dead_peers(g, dead, 64);
    /* a peer that answered was alive and waiting; it may have timed out and
     * exited since, which is not the failure to report */
    for (int j = 0; j < nd; j++)
        for (int i = 0; i < g->size; i++)
            if (got[i] && g->members[i] == dead[j]) dead[j--] = dead[--nd], i = g->size;
    const char *sep = ": ";
    for (int i = 0; i < nd && k < cap; i++) {
        k += snprintf(line + k, sizeof line - k, "%srank %d (pid %d on %s) is dead", sep, dead[i],
                      (int)C.peers[dead[i]].pid, C.peers[dead[i]].host);
        sep = "; ";
    }
    for (int i = 0; i < g->size && k < cap; i++) {
        int w = g->members[i], is_dead = 0;
        if (i == g->rank) continue;
        for (int j = 0; j < nd; j++) is_dead |= dead[j] == w;
        if (is_dead) continue;
        if (!C.watch_on) continue;
        if (got[i] && ans[i].waiting && strcmp(ans[i].op, op) == 0 && strcmp(ans[i].group, g->name) == 0 &&
            ans[i].seq == seq)
            continue; /* waiting in this very collective: not the culprit; listed below */
        if (got[i] && ans[i].waiting)
            k += snprintf(line + k, sizeof line - k, "%srank %d waits in %s #%llu on group '%s' instead", sep, w,
                          ans[i].op, (unsigned long long)ans[i].seq, ans[i].group);
        else if (got[i])
            k += snprintf(line + k, sizeof line - k, "%srank %d answered but is not in a collective", sep, w);
        else if (C.peers && strcmp(C.peers[w].host, C.info.host) == 0)
            k += snprintf(line + k, sizeof line - k,
                          "%srank %d (pid %d on %s) is alive but never arrived (stuck in compute or I/O?)", sep, w,
                          (int)C.peers[w].pid, C.peers[w].host);
        else
            k += snprintf(line + k, sizeof line - k, "%srank %d (on %s) never arrived and does not answer", sep, w,
                          C.peers ? C.peers[w].host : "?");
        sep = "; ";
    }
    int same = 0;
    for (int i = 0; i < g->size; i++)
        if (got[i] && ans[i].waiting && strcmp(ans[i].op, op) == 0 && ans[i].seq == seq &&
            strcmp(ans[i].group, g->name) == 0)
            same++;
    if (same && k < cap) k += snprintf(line + k, sizeof line - k, "%s%d other rank(s) wait in it too", sep, same);
    else if (!C.watch_on && nd == 0 && k < cap)
        k += snprintf(line + k, sizeof line - k, ": which peer is missing is unknown in this launch");
    fflush(stdout);
    fprintf(stderr, "kiln: error: %s\n", line);
    fprintf(stderr, "kiln: hint: parallel.timeout_s sets the deadline; each rank's last step is in RUN_DIR/heartbeat/, "
                    "and docs/parallel.md lists what to check\n");
    fflush(stderr);
    _exit(KILN_EXIT_RUNTIME);
}

/* Poll a request until done or the deadline, answering the watch meanwhile.
 * Yield first (latency), then sleep briefly so that oversubscribed ranks
 * leave the cores to the ones working. */
#ifdef KILN_MPI
static void wait_mpi(CommGroup *g, MPI_Request *req, const char *op, uint64_t seq, double t0) {
    double deadline = t0 + C.info.timeout_s;
    int done = 0;
    C.cur_op = op;
    C.cur_group = g;
    C.cur_seq = seq;
    for (long spins = 0;; spins++) {
        MPI_CHECK(g, MPI_Test(req, &done, MPI_STATUS_IGNORE));
        if (done) break;
        if ((spins & 63) == 0) watch_serve();
        double now = kiln_now();
        if (now > deadline) comm_timeout(g, op, seq, now - t0);
        if (spins < 2000) {
            sched_yield();
        } else {
            struct timespec ts = {0, 200000}; /* 0.2 ms: small next to a step, large next to a syscall */
            nanosleep(&ts, NULL);
        }
    }
    C.cur_op = NULL;
}

/* MPI counts are int. Reductions need a predefined type, so they go in
 * chunks; everything else uses a contiguous type when a count is too big. */
#define COMM_CHUNK (1u << 30)

static MPI_Datatype big_type(MPI_Datatype base, size_t n, int *count, const CommGroup *g) {
    if (n <= INT_MAX) {
        *count = (int)n;
        return base;
    }
    size_t unit = 1;
    while (unit < (1u << 20) && n % (unit * 2) == 0) unit *= 2;
    if (n / unit > INT_MAX)
        kiln_fail(KILN_EXIT_RUNTIME, "rank %d: a transfer of %zu elements on group '%s' is too large for MPI counts "
                                     "(use a shard size that is a multiple of 1024)", C.info.rank, n, g->name);
    MPI_Datatype t;
    MPI_CHECK(g, MPI_Type_contiguous((int)unit, base, &t));
    MPI_CHECK(g, MPI_Type_commit(&t));
    *count = (int)(n / unit);
    return t;
}
static void big_type_free(MPI_Datatype t, MPI_Datatype base, const CommGroup *g) {
    if (t != base) MPI_CHECK(g, MPI_Type_free(&t));
}
#endif

static void need_mpi(const CommGroup *g, const char *op) {
#ifdef KILN_MPI
    if (C.info.mpi) return;
#endif
    kiln_fail(KILN_EXIT_USAGE,
              "rank %d: %s on group '%s' (%d ranks) needs MPI, but %s", C.info.rank, op, g->name, g->size,
#ifdef KILN_MPI
              "this launch has none (RANK/WORLD_SIZE start no MPI runtime): launch with mpirun or srun --mpi=pmix"
#else
              "this build has none: install libopenmpi-dev (make deps) and rebuild"
#endif
    );
}

/* ---------------------------------------------------------------- flight recorder, agreement */

/* What a rank is about to call, all-gathered by monitor.check_collectives. */
typedef struct CheckCall {
    char op[24];
    uint64_t seq, coll, count;
    int32_t dtype, root, rank, step; /* root: group rank, -1 none; rank: world */
} CheckCall;

void comm_check_collectives(int on) {
    C.check = 0;
    if (!on) return;
#ifdef KILN_MPI
    if (C.info.mpi) {
        if (!C.check_all) C.check_all = xcalloc((size_t)C.info.world, sizeof(CheckCall));
        C.check = 1;
        return;
    }
#endif
    if (C.info.world > 1)
        kiln_warn("monitor.check_collectives: this launch has no MPI to compare calls over (RANK/WORLD_SIZE); "
                  "nothing is checked");
}

#ifdef KILN_MPI
static const char *check_dtype(int d) {
    static const char *names[] = {"", "f32", "f64", "bytes", "bf16"};
    return d >= 0 && d < 5 ? names[d] : "?";
}

/* "all_reduce #42 (1 f64)", "broadcast #7 (8 bytes, root rank 0)" */
static void check_describe(const CommGroup *g, const CheckCall *c, char *buf, size_t n) {
    char root[32] = "";
    if (c->dtype == FLIGHT_NONE) {
        snprintf(buf, n, "%s #%llu", c->op, (unsigned long long)c->seq);
        return;
    }
    if (c->root >= 0) snprintf(root, sizeof root, ", root rank %d", c->root < g->size ? g->members[c->root] : -1);
    snprintf(buf, n, "%s #%llu (%llu %s%s)", c->op, (unsigned long long)c->seq, (unsigned long long)c->count,
             check_dtype(c->dtype), root);
}

static int check_same(const CheckCall *a, const CheckCall *b) {
    return strcmp(a->op, b->op) == 0 && a->coll == b->coll && a->count == b->count && a->dtype == b->dtype &&
           a->root == b->root;
}

/* Members disagree: group rank 0 names every rank whose call differs from
 * its own; every member writes its ring, waits for the others (so that the
 * line is out before a launcher kills the job) and exits 1. */
__attribute__((noreturn)) static void check_fail(CommGroup *g, const CheckCall *all) {
    int other = -1;
    for (int i = 1; i < g->size && other < 0; i++)
        if (!check_same(&all[i], &all[0])) other = g->members[i];
    flight_dump(FLIGHT_MISMATCH, g->rank == 0 ? other : g->members[0]);
    if (g->rank == 0) {
        char line[2048], d[160];
        int k = snprintf(line, sizeof line, "rank %d: collective mismatch on group '%s' (%d ranks) at step %d: ",
                         C.info.rank, g->name, g->size, all[0].step);
        const char *sep = "";
        for (int i = 1; i < g->size && k < (int)sizeof line - 400; i++) {
            if (check_same(&all[i], &all[0])) continue;
            check_describe(g, &all[i], d, sizeof d);
            k += snprintf(line + k, sizeof line - k, "%srank %d calls %s", sep, g->members[i], d);
            sep = "; ";
        }
        check_describe(g, &all[0], d, sizeof d);
        k += snprintf(line + k, sizeof line - k, " where rank %d calls %s", g->members[0], d);
        sep = " (as do ranks ";
        for (int i = 1; i < g->size && k < (int)sizeof line - 16; i++)
            if (check_same(&all[i], &all[0])) k += snprintf(line + k, sizeof line - k, "%s%d", sep, g->members[i]), sep = ",";
        if (*sep == ',' && k < (int)sizeof line - 2) snprintf(line + k, sizeof line - k, ")");
        fflush(stdout);
        fprintf(stderr, "kiln: error: %s\n", line);
        fprintf(stderr, "kiln: hint: monitor.check_collectives stopped this before it could hang: every rank must "
                        "issue the same collectives in the same order; RUN_DIR/flight/ holds each rank's recent "
                        "operations (./train doctor RUN_DIR)\n");
        fflush(stderr);
    }
    MPI_Request r;
    double t0 = kiln_now();
    if (MPI_Ibarrier(mcomm(g), &r) == MPI_SUCCESS) wait_mpi(g, &r, "barrier", g->seq, t0);
    fflush(stdout);
    _exit(KILN_EXIT_RUNTIME);
}

static void check_agree(CommGroup *g, const char *op, FlightDtype dt, size_t count, int root) {
    CheckCall me;
    memset(&me, 0, sizeof me);
    kiln_strlcpy(me.op, op, sizeof me.op);
    me.seq = g->seq, me.coll = g->coll, me.count = count;
    me.dtype = (int32_t)dt, me.root = root, me.rank = C.info.rank, me.step = flight_step();
    MPI_Request r;
    double t0 = kiln_now();
    MPI_CHECK(g, MPI_Iallgather(&me, (int)sizeof me, MPI_BYTE, C.check_all, (int)sizeof me, MPI_BYTE, mcomm(g), &r));
    wait_mpi(g, &r, op, g->seq, t0);
    for (int i = 0; i < g->size; i++)
        if (!check_same(&C.check_all[i], &C.check_all[0])) check_fail(g, C.check_all);
}
#endif

/* Every operation that moves data on a group of two or more ranks starts
 * here: its flight record (flight.h) and, for a collective with
 * monitor.check_collectives, the agreement. root: the group rank of a
 * broadcast's root or a send/recv's peer, -1 none. blocking: the caller waits
 * right away, so its wait starts now. Returns the record's id, for
 * flight_wait / flight_done. */
__attribute__((unused)) static uint64_t op_begin(CommGroup *g, const char *op, FlightDtype dt, size_t count,
                                                int root, int p2p, int blocking) {
    if (g->size < 2) return 0; /* a one-rank group in device mode: nothing to record or agree on */
    if (!p2p) g->coll++;
    FlightOp fo = {.group = g->name, .group_first = g->members[0], .group_size = g->size, .op = op,
                   .seq = g->seq, .coll = g->coll, .dtype = dt, .count = count,
                   .peer = root >= 0 && root < g->size ? g->members[root] : -1};
    uint64_t id = flight_post(&fo);
    if (blocking) flight_wait(id);
#ifdef KILN_MPI
    if (C.check && !p2p) {
        if (!blocking) flight_wait(id); /* the agreement waits for the others too */
        check_agree(g, op, dt, count, root);
        if (!blocking) flight_idle(id); /* back to compute while the operation runs */
    }
#endif
    return id;
}

/* ---------------------------------------------------------------- init */

void comm_set_timeout(double timeout_s) {
    if (timeout_s > 0) C.info.timeout_s = timeout_s;
}

static void world_group_single(void) {
    CommGroup *g = &C.world;
    memset(g, 0, sizeof *g);
    kiln_strlcpy(g->name, "world", sizeof g->name);
    g->rank = 0;
    g->size = 1;
    g->members = xmalloc(sizeof(int));
    g->members[0] = 0;
}

void comm_init(double timeout_s) {
    if (C.initialised) return;
    memset(&C.info, 0, sizeof C.info);
    C.info.timeout_s = timeout_s > 0 ? timeout_s : 300.0;
    const char *t = getenv("KILN_COMM_TIMEOUT_S");
    if (t && *t) {
        char *end;
        double v = strtod(t, &end);
        if (*end || !(v > 0))
            kiln_fail(KILN_EXIT_USAGE, "environment variable KILN_COMM_TIMEOUT_S='%s': expected seconds > 0", t);
        C.info.timeout_s = v;
    }
    if (gethostname(C.info.host, sizeof C.info.host) != 0) kiln_strlcpy(C.info.host, "unknown", sizeof C.info.host);
    C.info.host[sizeof C.info.host - 1] = '\0';
    discover(&C.info);
    C.info.local_world = 1;
    C.info.nodes = 1;
    C.initialised = 1;

    if (C.info.world == 1) {
        world_group_single();
        return;
    }
#ifndef KILN_MPI
    kiln_fail(KILN_EXIT_USAGE,
              "launched as rank %d of %d (%s=%d, %s=%d) but this build has no MPI: install libopenmpi-dev (make deps) "
              "and rebuild, or run one rank", C.info.rank, C.info.world, C.rank_var, C.info.rank, C.size_var,
              C.info.world);
#else
    if (C.info.source == COMM_SOURCE_ENV) {
        /* torchrun-style: no MPI runtime behind us (MPI_Init would make a
         * singleton). Host collectives are unavailable; NCCL bootstraps by file. */
        CommGroup *g = &C.world;
        memset(g, 0, sizeof *g);
        kiln_strlcpy(g->name, "world", sizeof g->name);
        g->rank = C.info.rank;
        g->size = C.info.world;
        g->members = xmalloc((size_t)g->size * sizeof(int));
        for (int i = 0; i < g->size; i++) g->members[i] = i;
        return;
    }
    int provided = 0;
    if (MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
        kiln_fail(KILN_EXIT_RUNTIME, "rank %d: MPI_Init_thread failed", C.info.rank);
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    int mr = -1, mw = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &mr);
    MPI_Comm_size(MPI_COMM_WORLD, &mw);
    if (mr != C.info.rank || mw != C.info.world)
        kiln_fail(KILN_EXIT_USAGE,
                  "rank mismatch: the environment says rank %d of %d (%s, %s) but MPI says rank %d of %d; "
                  "start every rank with one launcher (srun --mpi=pmix or mpirun)", C.info.rank, C.info.world,
                  C.rank_var, C.size_var, mr, mw);
    if (provided < MPI_THREAD_FUNNELED)
        kiln_warn("MPI provides thread level %d, below MPI_THREAD_FUNNELED", provided);
    C.info.mpi = 1;
    CommGroup *g = &C.world;
    memset(g, 0, sizeof *g);
    kiln_strlcpy(g->name, "world", sizeof g->name);
    MPI_Comm dup;
    MPI_CHECK(g, MPI_Comm_dup(MPI_COMM_WORLD, &dup));
    MPI_CHECK(g, MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN));
    set_mcomm(g, dup);
    g->rank = mr;
    g->size = mw;
    g->members = xmalloc((size_t)mw * sizeof(int));
    for (int i = 0; i < mw; i++) g->members[i] = i;

    /* Who runs where, so that a timeout can name a dead peer and local_world
     * is counted rather than trusted. */
    C.peers = xcalloc((size_t)mw, sizeof(PeerInfo));
    PeerInfo me;
    memset(&me, 0, sizeof me);
    kiln_strlcpy(me.host, C.info.host, sizeof me.host);
    me.pid = (int32_t)getpid();
    me.local_rank = C.info.local_rank;
    comm_all_gather_bytes(g, &me, C.peers, sizeof me);
    MPI_Comm wc;
    MPI_CHECK(g, MPI_Comm_dup(MPI_COMM_WORLD, &wc));
    MPI_CHECK(g, MPI_Comm_set_errhandler(wc, MPI_ERRORS_RETURN));
    memcpy(&C.watch, &wc, sizeof wc);
    C.answers = xcalloc((size_t)mw, sizeof(WatchMsg));
    C.answer_req = xcalloc((size_t)mw, sizeof(uint64_t));
    for (int i = 0; i < mw; i++) {
        MPI_Request nul = MPI_REQUEST_NULL;
        memcpy(&C.answer_req[i], &nul, sizeof nul);
    }
    C.watch_on = 1;
    C.info.local_world = 0;
    C.info.nodes = 0;
    for (int i = 0; i < mw; i++) {
        if (strcmp(C.peers[i].host, C.info.host) == 0) C.info.local_world++;
        int first = 1;
        for (int j = 0; j < i; j++)
            if (strcmp(C.peers[j].host, C.peers[i].host) == 0) first = 0;
        C.info.nodes += first;
    }
#endif
}

void comm_finalize(void) {
    if (!C.initialised) return;
    comm_nccl_free(&C.world);
#ifdef KILN_MPI
    if (C.info.mpi) {
        /* Outstanding watch answers must finish before the communicator goes. */
        comm_barrier(&C.world);
        watch_serve();
        C.watch_on = 0;
        for (int i = 0; i < C.info.world; i++) {
            MPI_Request *r = (MPI_Request *)(void *)&C.answer_req[i];
            if (*r != MPI_REQUEST_NULL) MPI_Cancel(r), MPI_Request_free(r);
        }
        MPI_Comm c = mcomm(&C.world);
        MPI_Comm_free(&c);
        c = watch_comm();
        MPI_Comm_free(&c);
        MPI_Finalize();
    }
#endif
    free(C.world.members);
    free(C.peers);
    free(C.answers);
    free(C.answer_req);
    free(C.check_all);
    free(C.v_ints);
    memset(&C, 0, sizeof C);
}

const CommInfo *comm_info(void) {
    if (!C.initialised) comm_init(0);
    return &C.info;
}

CommGroup *comm_world(void) {
    if (!C.initialised) comm_init(0);
    return &C.world;
}

void comm_describe(char *buf, size_t n) {
    const CommInfo *in = comm_info();
    if (in->source == COMM_SOURCE_SINGLE) {
        char nv[48];
        nccl_describe(nv, sizeof nv);
        snprintf(buf, n, "rank 0/1 (host %s, no launcher%s)", in->host, nv);
        return;
    }
    char nv[48];
    nccl_describe(nv, sizeof nv);
    snprintf(buf, n, "rank %d/%d (local %d/%d, %d node%s, host %s, from %s %s, %s%s, timeout %.0f s)", in->rank,
             in->world, in->local_rank, in->local_world, in->nodes, in->nodes == 1 ? "" : "s", in->host,
             source_name(in->source), C.rank_var, in->mpi ? "MPI" : "no MPI", nv, in->timeout_s);
}

/* ---------------------------------------------------------------- groups */

void comm_split(CommGroup *parent, int color, int key, const char *name, CommGroup *out) {
    memset(out, 0, sizeof *out);
    kiln_strlcpy(out->name, name, sizeof out->name);
    if (parent->size == 1) {
        out->rank = 0;
        out->size = 1;
        out->members = xmalloc(sizeof(int));
        out->members[0] = parent->members[0];
        return;
    }
    need_mpi(parent, "comm_split");
#ifdef KILN_MPI
    MPI_Comm c;
    MPI_CHECK(parent, MPI_Comm_split(mcomm(parent), color, key, &c));
    MPI_CHECK(parent, MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN));
    set_mcomm(out, c);
    MPI_CHECK(out, MPI_Comm_rank(c, &out->rank));
    MPI_CHECK(out, MPI_Comm_size(c, &out->size));
    out->members = xmalloc((size_t)out->size * sizeof(int));
    for (int i = 0; i < out->size; i++) out->members[i] = -1; /* unknown until the all-gather below fills them */
    int me = C.info.rank;
    if (out->size == 1) out->members[0] = me;
    else comm_all_gather_bytes(out, &me, out->members, sizeof(int));
#endif
}

void comm_group_free(CommGroup *g) {
    if (g != &C.world) comm_nccl_free(g); /* the world's goes in comm_finalize */
#ifdef KILN_MPI
    if (g->mpi && g != &C.world && C.info.mpi) {
        MPI_Comm c = mcomm(g);
        MPI_Comm_free(&c);
    }
#endif
    if (g != &C.world) {
        free(g->members);
        memset(g, 0, sizeof *g);
    }
}

/* ---------------------------------------------------------------- collectives */

void comm_all_reduce_sum(CommGroup *g, float *buf, size_t n) {
    if (g->dev) {
        dev_run(g, "all_reduce", NCCL_OP_SUM, buf, buf, n, 0);
        return;
    }
    g->seq++;
    if (!group_uses_mpi(g) || n == 0) return;
    need_mpi(g, "all_reduce");
#ifdef KILN_MPI
    uint64_t fr = op_begin(g, "all_reduce", FLIGHT_F32, n, -1, 0, 1);
    for (size_t off = 0; off < n; off += COMM_CHUNK) {
        int cnt = (int)(n - off < COMM_CHUNK ? n - off : COMM_CHUNK);
        MPI_Request r;
        double t0 = kiln_now();
        MPI_CHECK(g, MPI_Iallreduce(MPI_IN_PLACE, buf + off, cnt, MPI_FLOAT, MPI_SUM, mcomm(g), &r));
        wait_mpi(g, &r, "all_reduce", g->seq, t0);
    }
    flight_done(fr);
#endif
}

void comm_all_reduce_mean(CommGroup *g, float *buf, size_t n) {
    if (g->dev) {
        dev_run(g, "all_reduce", NCCL_OP_AVG, buf, buf, n, 0);
        return;
    }
    comm_all_reduce_sum(g, buf, n);
    if (g->size > 1) {
        float s = 1.0f / (float)g->size;
        for (size_t i = 0; i < n; i++) buf[i] *= s;
    }
}

#ifdef KILN_MPI
static void all_reduce_f64(CommGroup *g, double *buf, size_t n, MPI_Op op, const char *name) {
    uint64_t fr = op_begin(g, name, FLIGHT_F64, n, -1, 0, 1);
    for (size_t off = 0; off < n; off += COMM_CHUNK) {
        int cnt = (int)(n - off < COMM_CHUNK ? n - off : COMM_CHUNK);
        MPI_Request r;
        double t0 = kiln_now();
        MPI_CHECK(g, MPI_Iallreduce(MPI_IN_PLACE, buf + off, cnt, MPI_DOUBLE, op, mcomm(g), &r));
        wait_mpi(g, &r, name, g->seq, t0);
    }
    flight_done(fr);
}
#endif

/* Test hooks skip_collective / wrong_collective (testhooks.h, flight.h):
 * 1 when this all-reduce of doubles is not to run, having been skipped or
 * replaced by a broadcast of the same bytes from group rank 0. */
static int f64_test_hook(CommGroup *g, double *buf, size_t n) {
    FlightHook h = flight_test_hook(g->name);
    if (h == FLIGHT_HOOK_WRONG) comm_broadcast_bytes(g, buf, n * sizeof(double), 0);
    return h != FLIGHT_HOOK_NONE;
}

void comm_all_reduce_sum_f64(CommGroup *g, double *buf, size_t n) {
    if (f64_test_hook(g, buf, n)) return;
    g->seq++;
    if (!group_uses_mpi(g) || n == 0) return;
    need_mpi(g, "all_reduce");
#ifdef KILN_MPI
    all_reduce_f64(g, buf, n, MPI_SUM, "all_reduce");
#endif
}

void comm_all_reduce_max_f64(CommGroup *g, double *buf, size_t n) {
    if (f64_test_hook(g, buf, n)) return;
    g->seq++;
    if (!group_uses_mpi(g) || n == 0) return;
    need_mpi(g, "all_reduce_max");
#ifdef KILN_MPI
    all_reduce_f64(g, buf, n, MPI_MAX, "all_reduce_max");
#endif
}

/* bf16 sums have no MPI type: device mode (NCCL) only; one rank copies. */
static int bf16_host(CommGroup *g, const char *op) {
    if (g->dev) return 0;
    g->seq++;
    if (g->size > 1)
        kiln_fail(KILN_EXIT_USAGE, "rank %d: %s of bf16 on group '%s' needs NCCL device buffers (bf16 "
                  "activations come from the CUDA backend, whose groups run on NCCL)", C.info.rank, op, g->name);
    return 1;
}

void comm_all_reduce_sum_bf16(CommGroup *g, void *buf, size_t n) {
    if (bf16_host(g, "all_reduce")) return;
    dev_run(g, "all_reduce", NCCL_OP_SUM_BF16, buf, buf, n, 0);
}

void comm_reduce_scatter_bf16(CommGroup *g, const void *send, void *recv, size_t block) {
    if (bf16_host(g, "reduce_scatter")) {
        if (send != recv && block) memmove(recv, send, block * 2);
        return;
    }
    dev_run(g, "reduce_scatter", NCCL_OP_REDUCE_SCATTER_BF16, send, recv, block, 0);
}

void comm_reduce_scatter(CommGroup *g, const float *send, float *recv, size_t block) {
    CommRequest r;
    comm_ireduce_scatter(g, send, recv, block, &r);
    comm_wait(&r);
}

void comm_all_gather(CommGroup *g, const float *send, float *recv, size_t block) {
    if (g->dev) {
        dev_run(g, "all_gather", NCCL_OP_ALL_GATHER, send, recv, block, 0);
        return;
    }
    g->seq++;
    if (!group_uses_mpi(g)) {
        if (send != recv && block) memmove(recv, send, block * sizeof(float));
        return;
    }
    need_mpi(g, "all_gather");
#ifdef KILN_MPI
    uint64_t fr = op_begin(g, "all_gather", FLIGHT_F32, block, -1, 0, 1);
    int cnt;
    MPI_Datatype t = big_type(MPI_FLOAT, block, &cnt, g);
    const void *sb = send == recv + (size_t)g->rank * block ? MPI_IN_PLACE : send;
    MPI_Request r;
    double t0 = kiln_now();
    MPI_CHECK(g, MPI_Iallgather(sb, cnt, t, recv, cnt, t, mcomm(g), &r));
    wait_mpi(g, &r, "all_gather", g->seq, t0);
    big_type_free(t, MPI_FLOAT, g);
    flight_done(fr);
#endif
}

void comm_all_gather_bytes(CommGroup *g, const void *send, void *recv, size_t block) {
    g->seq++;
    if (!group_uses_mpi(g)) {
        if (send != recv && block) memmove(recv, send, block);
        return;
    }
    need_mpi(g, "all_gather");
#ifdef KILN_MPI
    uint64_t fr = op_begin(g, "all_gather", FLIGHT_BYTES, block, -1, 0, 1);
    int cnt;
    MPI_Datatype t = big_type(MPI_BYTE, block, &cnt, g);
    const void *sb = (const char *)send == (char *)recv + (size_t)g->rank * block ? MPI_IN_PLACE : send;
    MPI_Request r;
    double t0 = kiln_now();
    MPI_CHECK(g, MPI_Iallgather(sb, cnt, t, recv, cnt, t, mcomm(g), &r));
    wait_mpi(g, &r, "all_gather", g->seq, t0);
    big_type_free(t, MPI_BYTE, g);
    flight_done(fr);
#endif
}

static void check_root(const CommGroup *g, int root) {
    if (root < 0 || root >= g->size)
        kiln_fail(KILN_EXIT_RUNTIME, "rank %d: broadcast on group '%s': root %d is not a rank of %d", C.info.rank,
                  g->name, root, g->size);
}

static void broadcast_typed(CommGroup *g, void *buf, size_t n, int root, int bytes) {
    g->seq++;
    check_root(g, root);
    if (!group_uses_mpi(g) || n == 0) return;
    need_mpi(g, "broadcast");
#ifdef KILN_MPI
    uint64_t fr = op_begin(g, "broadcast", bytes ? FLIGHT_BYTES : FLIGHT_F32, n, root, 0, 1);
    MPI_Datatype base = bytes ? MPI_BYTE : MPI_FLOAT;
    int cnt;
    MPI_Datatype t = big_type(base, n, &cnt, g);
    MPI_Request r;
    double t0 = kiln_now();
    MPI_CHECK(g, MPI_Ibcast(buf, cnt, t, root, mcomm(g), &r));
    wait_mpi(g, &r, "broadcast", g->seq, t0);
    big_type_free(t, base, g);
    flight_done(fr);
#endif
}

void comm_broadcast(CommGroup *g, float *buf, size_t n, int root) {
    if (g->dev) {
        check_root(g, root);
        dev_run(g, "broadcast", NCCL_OP_BROADCAST, buf, buf, n, root);
        return;
    }
    broadcast_typed(g, buf, n, root, 0);
}
void comm_broadcast_bytes(CommGroup *g, void *buf, size_t n, int root) { broadcast_typed(g, buf, n, root, 1); }

static void check_peer(const CommGroup *g, int peer, const char *op) {
    if (peer < 0 || peer >= g->size || peer == g->rank)
        kiln_fail(KILN_EXIT_RUNTIME, "rank %d: %s on group '%s': peer %d is not another rank of %d", C.info.rank, op,
                  g->name, peer, g->size);
}

void comm_send(CommGroup *g, const float *buf, size_t n, int peer, int tag) {
    if (g->dev) { /* NCCL has no tags: messages between two ranks match in order */
        check_peer(g, peer, "send");
        dev_run(g, "send", NCCL_OP_SEND, buf, NULL, n, peer);
        return;
    }
    g->seq++;
    check_peer(g, peer, "send");
    need_mpi(g, "send");
#ifdef KILN_MPI
    uint64_t fr = op_begin(g, "send", FLIGHT_F32, n, peer, 1, 1);
    int cnt;
    MPI_Datatype t = big_type(MPI_FLOAT, n, &cnt, g);
    MPI_Request r;
    double t0 = kiln_now();
    MPI_CHECK(g, MPI_Isend(buf, cnt, t, peer, tag, mcomm(g), &r));
    wait_mpi(g, &r, "send", g->seq, t0);
    big_type_free(t, MPI_FLOAT, g);
    flight_done(fr);
#endif
}

void comm_recv(CommGroup *g, float *buf, size_t n, int peer, int tag) {
    if (g->dev) {
        check_peer(g, peer, "recv");
        dev_run(g, "recv", NCCL_OP_RECV, NULL, buf, n, peer);
        return;
    }
    g->seq++;
    check_peer(g, peer, "recv");
    need_mpi(g, "recv");
#ifdef KILN_MPI
    uint64_t fr = op_begin(g, "recv", FLIGHT_F32, n, peer, 1, 1);
    int cnt;
    MPI_Datatype t = big_type(MPI_FLOAT, n, &cnt, g);
    MPI_Request r;
    double t0 = kiln_now();
    MPI_CHECK(g, MPI_Irecv(buf, cnt, t, peer, tag, mcomm(g), &r));
    wait_mpi(g, &r, "recv", g->seq, t0);
    big_type_free(t, MPI_FLOAT, g);
    flight_done(fr);
#endif
}

void comm_all_to_all(CommGroup *g, const float *send, float *recv, size_t block) {
    if (g->dev) {
        dev_run(g, "all_to_all", NCCL_OP_ALL_TO_ALL, send, recv, block, 0);
        return;
    }
    g->seq++;
    if (!group_uses_mpi(g)) {
        if (send != recv && block) memmove(recv, send, block * sizeof(float));
        return;
    }
    need_mpi(g, "all_to_all");
#ifdef KILN_MPI
    uint64_t fr = op_begin(g, "all_to_all", FLIGHT_F32, block, -1, 0, 1);
    int cnt;
    MPI_Datatype t = big_type(MPI_FLOAT, block, &cnt, g);
    MPI_Request r;
    double t0 = kiln_now();
    MPI_CHECK(g, MPI_Ialltoall(send, cnt, t, recv, cnt, t, mcomm(g), &r));
    wait_mpi(g, &r, "all_to_all", g->seq, t0);
    big_type_free(t, MPI_FLOAT, g);
    flight_done(fr);
#endif
}

/* all_to_allv's flight record and agreement carry count 0: each rank sends
 * its own counts, so the only thing the members agree on is the call. */
void comm_all_to_allv(CommGroup *g, const void *send, const size_t *send_counts, void *recv,
                      const size_t *recv_counts, size_t elem_bytes) {
    if (elem_bytes != 1 && elem_bytes != 2 && elem_bytes != 4)
        kiln_fail(KILN_EXIT_RUNTIME, "rank %d: all_to_allv on group '%s': elements of %zu bytes (1, 2 or 4 only)",
                  C.info.rank, g->name, elem_bytes);
    if (g->dev) {
        CommRequest r;
        req_start(&r, g, "all_to_allv");
        nccl_post_alltoallv(&r, send, send_counts, recv, recv_counts, elem_bytes);
        if (r.active) nccl_wait(&r);
        return;
    }
    g->seq++;
    if (!group_uses_mpi(g)) {
        if (send_counts[0] != recv_counts[0])
            kiln_fail(KILN_EXIT_RUNTIME, "all_to_allv on group '%s' (1 rank): sends %zu elements to itself but "
                      "receives %zu", g->name, send_counts[0], recv_counts[0]);
        if (send != recv && send_counts[0]) memmove(recv, send, send_counts[0] * elem_bytes);
        return;
    }
    need_mpi(g, "all_to_allv");
#ifdef KILN_MPI
    if ((size_t)g->size > C.v_cap) {
        C.v_cap = (size_t)g->size;
        C.v_ints = xrealloc(C.v_ints, 4 * C.v_cap * sizeof(int));
    }
    int *sc = C.v_ints, *sd = sc + g->size, *rc = sd + g->size, *rd = rc + g->size;
    size_t so = 0, ro = 0;
    for (int i = 0; i < g->size; i++) {
        if (so + send_counts[i] > INT_MAX || ro + recv_counts[i] > INT_MAX)
            kiln_fail(KILN_EXIT_RUNTIME, "rank %d: all_to_allv on group '%s': more than %d elements in all (MPI "
                      "counts and displacements are int)", C.info.rank, g->name, INT_MAX);
        sc[i] = (int)send_counts[i], sd[i] = (int)so, rc[i] = (int)recv_counts[i], rd[i] = (int)ro;
        so += send_counts[i], ro += recv_counts[i];
    }
    MPI_Datatype t = elem_bytes == 4 ? MPI_FLOAT : elem_bytes == 2 ? MPI_UINT16_T : MPI_BYTE;
    FlightDtype fd = elem_bytes == 4 ? FLIGHT_F32 : elem_bytes == 2 ? FLIGHT_BF16 : FLIGHT_BYTES;
    uint64_t fr = op_begin(g, "all_to_allv", fd, 0, -1, 0, 1);
    MPI_Request r;
    double t0 = kiln_now();
    MPI_CHECK(g, MPI_Ialltoallv(send, sc, sd, t, recv, rc, rd, t, mcomm(g), &r));
    wait_mpi(g, &r, "all_to_allv", g->seq, t0);
    flight_done(fr);
#endif
}

void comm_barrier(CommGroup *g) {
    g->seq++;
    if (!group_uses_mpi(g)) return;
    need_mpi(g, "barrier");
#ifdef KILN_MPI
    uint64_t fr = op_begin(g, "barrier", FLIGHT_NONE, 0, -1, 0, 1);
    MPI_Request r;
    double t0 = kiln_now();
    MPI_CHECK(g, MPI_Ibarrier(mcomm(g), &r));
    wait_mpi(g, &r, "barrier", g->seq, t0);
    flight_done(fr);
#endif
}

/* ---------------------------------------------------------------- non-blocking */

static void req_start(CommRequest *req, CommGroup *g, const char *op) {
    memset(req, 0, sizeof *req);
    req->g = g;
    req->op = op;
    req->seq = ++g->seq;
    req->t_start = kiln_now();
}

static void check_int_count(const CommGroup *g, size_t n, const char *op) {
    if (n > INT_MAX)
        kiln_fail(KILN_EXIT_RUNTIME, "rank %d: non-blocking %s of %zu elements on group '%s': split it into buckets "
                                     "of at most %d", C.info.rank, op, n, g->name, INT_MAX);
}

void comm_iall_reduce_sum(CommGroup *g, float *buf, size_t n, CommRequest *req) {
    req_start(req, g, "all_reduce");
    if (g->dev) {
        nccl_post(req, NCCL_OP_SUM, buf, buf, n, 0);
        return;
    }
    if (!group_uses_mpi(g) || n == 0) return;
    need_mpi(g, "all_reduce");
    check_int_count(g, n, "all_reduce");
#ifdef KILN_MPI
    req->flight = op_begin(g, "all_reduce", FLIGHT_F32, n, -1, 0, 0);
    MPI_CHECK(g, MPI_Iallreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, mcomm(g), mreq(req)));
    req->active = 1;
#endif
}

void comm_ireduce_scatter(CommGroup *g, const float *send, float *recv, size_t block, CommRequest *req) {
    req_start(req, g, "reduce_scatter");
    if (g->dev) {
        nccl_post(req, NCCL_OP_REDUCE_SCATTER, send, recv, block, 0);
        return;
    }
    if (!group_uses_mpi(g)) {
        if (send != recv && block) memmove(recv, send, block * sizeof(float));
        return;
    }
    need_mpi(g, "reduce_scatter");
    check_int_count(g, block, "reduce_scatter");
#ifdef KILN_MPI
    req->flight = op_begin(g, "reduce_scatter", FLIGHT_F32, block, -1, 0, 0);
    MPI_CHECK(g, MPI_Ireduce_scatter_block(send, recv, (int)block, MPI_FLOAT, MPI_SUM, mcomm(g), mreq(req)));
    req->active = 1;
#endif
}

void comm_iall_gather(CommGroup *g, const float *send, float *recv, size_t block, CommRequest *req) {
    req_start(req, g, "all_gather");
    if (g->dev) {
        nccl_post(req, NCCL_OP_ALL_GATHER, send, recv, block, 0);
        return;
    }
    if (!group_uses_mpi(g)) {
        if (send != recv && block) memmove(recv, send, block * sizeof(float));
        return;
    }
    need_mpi(g, "all_gather");
    check_int_count(g, block, "all_gather");
#ifdef KILN_MPI
    req->flight = op_begin(g, "all_gather", FLIGHT_F32, block, -1, 0, 0);
    const void *sb = send == recv + (size_t)g->rank * block ? MPI_IN_PLACE : send;
    MPI_CHECK(g, MPI_Iallgather(sb, (int)block, MPI_FLOAT, recv, (int)block, MPI_FLOAT, mcomm(g), mreq(req)));
    req->active = 1;
#endif
}

/* A point-to-point post; MPI for host buffers, NCCL in device mode. */
static void p2p_post(CommGroup *g, int send, const float *sbuf, float *rbuf, size_t n, int peer, int tag,
                     CommRequest *req) {
    const char *op = send ? "send" : "recv";
    req_start(req, g, op);
    req->p2p = 1;
    check_peer(g, peer, op);
    if (tag < 0)
        kiln_fail(KILN_EXIT_RUNTIME, "rank %d: %s on group '%s': tag %d is negative", C.info.rank, op, g->name, tag);
    if (g->dev) {
        nccl_post(req, send ? NCCL_OP_SEND : NCCL_OP_RECV, sbuf, rbuf, n, peer);
        return;
    }
    if (n == 0) return;
    need_mpi(g, op);
    check_int_count(g, n, op);
#ifdef KILN_MPI
    req->flight = op_begin(g, op, FLIGHT_F32, n, peer, 1, 0);
    if (send) MPI_CHECK(g, MPI_Isend(sbuf, (int)n, MPI_FLOAT, peer, tag, mcomm(g), mreq(req)));
    else MPI_CHECK(g, MPI_Irecv(rbuf, (int)n, MPI_FLOAT, peer, tag, mcomm(g), mreq(req)));
    req->active = 1;
#endif
}

void comm_isendrecv(CommGroup *g, const float *send, float *recv, size_t n, int to, int from, int tag,
                    CommRequest *req) {
    req_start(req, g, "sendrecv");
    check_peer(g, to, "sendrecv");
    check_peer(g, from, "sendrecv");
    if (g->dev) { /* NCCL has no tags: messages between two ranks match in order */
        nccl_post(req, NCCL_OP_SENDRECV, send, recv, n, NCCL_PAIR(to, from));
        return;
    }
    if (n == 0) return;
    need_mpi(g, "sendrecv");
    check_int_count(g, n, "sendrecv");
#ifdef KILN_MPI
    req->flight = op_begin(g, "sendrecv", FLIGHT_F32, n, to, 1, 0);
    MPI_CHECK(g, MPI_Irecv(recv, (int)n, MPI_FLOAT, from, tag, mcomm(g), (MPI_Request *)(void *)&req->mpi_recv));
    MPI_CHECK(g, MPI_Isend(send, (int)n, MPI_FLOAT, to, tag, mcomm(g), mreq(req)));
    req->pair = 1;
    req->active = 1;
#endif
}

void comm_isend(CommGroup *g, const float *buf, size_t n, int peer, int tag, CommRequest *req) {
    p2p_post(g, 1, buf, NULL, n, peer, tag, req);
}

void comm_irecv(CommGroup *g, float *buf, size_t n, int peer, int tag, CommRequest *req) {
    p2p_post(g, 0, NULL, buf, n, peer, tag, req);
}

int comm_test(CommRequest *req) {
    if (!req->active) return 1;
    if (req->device) return nccl_test(req);
#ifdef KILN_MPI
    int done = 0, got = 1;
    /* a finished request becomes MPI_REQUEST_NULL, which tests as done */
    if (req->pair) MPI_CHECK(req->g, MPI_Test((MPI_Request *)(void *)&req->mpi_recv, &got, MPI_STATUS_IGNORE));
    MPI_CHECK(req->g, MPI_Test(mreq(req), &done, MPI_STATUS_IGNORE));
    done = done && got;
    if (done) req->active = 0, flight_done(req->flight);
    else if (!req->p2p && kiln_now() - req->t_start > C.info.timeout_s)
        comm_timeout(req->g, req->op, req->seq, kiln_now() - req->t_start);
    return done;
#else
    return 1;
#endif
}

void comm_wait(CommRequest *req) {
    if (!req->active) return;
    if (req->p2p && !req->waiting) req->waiting = 1, req->t_start = kiln_now(); /* the deadline starts now */
    if (req->device) {
        nccl_wait(req);
        return;
    }
#ifdef KILN_MPI
    flight_wait(req->flight);
    wait_mpi(req->g, mreq(req), req->op, req->seq, req->t_start);
    if (req->pair) wait_mpi(req->g, (MPI_Request *)(void *)&req->mpi_recv, req->op, req->seq, req->t_start);
    req->active = 0;
    flight_done(req->flight);
#endif
}

/* ---------------------------------------------------------------- consistency */

typedef struct BuildId {
    uint64_t config_hash;
    char commit[56];
} BuildId;

void comm_check_consistent(uint64_t config_hash, const char *commit) {
    CommGroup *g = comm_world();
    if (g->size == 1) return;
    if (!C.info.mpi) return; /* torchrun-style launch: no host collectives to compare with */
    BuildId me;
    memset(&me, 0, sizeof me);
    me.config_hash = config_hash;
    kiln_strlcpy(me.commit, commit ? commit : "", sizeof me.commit);
    BuildId *all = xmalloc((size_t)g->size * sizeof(BuildId));
    comm_all_gather_bytes(g, &me, all, sizeof me);
    int bad_cfg = 0, bad_build = 0;
    for (int i = 1; i < g->size; i++) {
        bad_cfg += all[i].config_hash != all[0].config_hash;
        bad_build += strcmp(all[i].commit, all[0].commit) != 0;
    }
    if (bad_cfg || bad_build) {
        if (g->rank == 0) {
            char line[2048];
            int k = 0;
            for (int i = 1; i < g->size && k < (int)sizeof line - 200; i++) {
                if (all[i].config_hash != all[0].config_hash)
                    k += snprintf(line + k, sizeof line - k, "%srank %d has config hash %016llx", k ? "; " : "", i,
                                  (unsigned long long)all[i].config_hash);
                if (strcmp(all[i].commit, all[0].commit) != 0)
                    k += snprintf(line + k, sizeof line - k, "%srank %d runs build %s", k ? "; " : "", i,
                                  all[i].commit);
            }
            fflush(stdout);
            fprintf(stderr, "kiln: error: ranks disagree with rank 0 (config hash %016llx, build %s): %s\n",
                    (unsigned long long)all[0].config_hash, all[0].commit, line);
            fprintf(stderr, "kiln: hint: every rank must run the same ./train with the same config and --set "
                            "overrides\n");
            fflush(stderr);
        }
        /* Let rank 0 print before anyone exits: a launcher kills the rest of
         * the job at the first non-zero exit. */
        comm_barrier(g);
        free(all);
        fflush(stdout);
        _exit(KILN_EXIT_USAGE);
    }
    free(all);
}

/* ---------------------------------------------------------------- NCCL */

#ifdef KILN_NCCL
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

/* libnccl.so.2, opened on the first comm_nccl_init and never linked: a binary
 * with NCCL support must start where NCCL is absent (CPU runs, one GPU). The
 * pointer types are nccl.h's own, so a changed signature fails to compile
 * here instead of misbehaving at run time. */
#define NCCL_FN(name) __typeof__(&nccl##name) name
static struct {
    void *lib;
    int version;     /* ncclGetVersion: 22809 for 2.28.9 */
    char path[512];  /* the file dlopen found */
    NCCL_FN(GetVersion);
    NCCL_FN(GetErrorString);
    NCCL_FN(GetLastError);
    NCCL_FN(GetUniqueId);
    NCCL_FN(CommInitRankConfig);
    NCCL_FN(CommFinalize);
    NCCL_FN(CommDestroy);
    NCCL_FN(CommAbort);
    NCCL_FN(CommGetAsyncError);
    NCCL_FN(AllReduce);
    NCCL_FN(ReduceScatter);
    NCCL_FN(AllGather);
    NCCL_FN(Broadcast);
    NCCL_FN(Send);
    NCCL_FN(Recv);
    NCCL_FN(GroupStart);
    NCCL_FN(GroupEnd);
} N;
#undef NCCL_FN

/* The library's name. A test (test/t_nccl.sh) compiles another, missing one
 * in to see the message; nothing else should change it. */
#ifndef KILN_NCCL_SONAME
#define KILN_NCCL_SONAME "libnccl.so.2"
#endif

/* ncclCommInitRankConfig and ncclCommFinalize (non-blocking communicators,
 * which let init and every call be bounded by the deadline) appeared in 2.14. */
#define NCCL_MIN_VERSION 21400

int comm_nccl_available(char *why, size_t n) {
    if (N.lib) return 1;
    void *lib = dlopen(KILN_NCCL_SONAME, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *e = dlerror();
        snprintf(why, n, "cannot load %s (%s): install NCCL (the CUDA toolkit's, or pip nvidia-nccl-cu12/cu13) and "
                         "set LD_LIBRARY_PATH to the folder that holds %s",
                 KILN_NCCL_SONAME, e ? e : "not found", KILN_NCCL_SONAME);
        return 0;
    }
    const char *missing = NULL;
#define NCCL_SYM(name)                                                                                              \
    if (!missing && !(*(void **)(&N.name) = dlsym(lib, "nccl" #name))) missing = "nccl" #name
    NCCL_SYM(GetVersion);
    NCCL_SYM(GetErrorString);
    NCCL_SYM(GetLastError);
    NCCL_SYM(GetUniqueId);
    NCCL_SYM(CommInitRankConfig);
    NCCL_SYM(CommFinalize);
    NCCL_SYM(CommDestroy);
    NCCL_SYM(CommAbort);
    NCCL_SYM(CommGetAsyncError);
    NCCL_SYM(AllReduce);
    NCCL_SYM(ReduceScatter);
    NCCL_SYM(AllGather);
    NCCL_SYM(Broadcast);
    NCCL_SYM(Send);
    NCCL_SYM(Recv);
    NCCL_SYM(GroupStart);
    NCCL_SYM(GroupEnd);
#undef NCCL_SYM
    Dl_info di;
    const char *path = N.GetVersion && dladdr(*(void **)&N.GetVersion, &di) && di.dli_fname ? di.dli_fname
                                                                                              : KILN_NCCL_SONAME;
    kiln_strlcpy(N.path, path, sizeof N.path);
    int v = 0;
    if (!missing && N.GetVersion(&v) != ncclSuccess) missing = "a working ncclGetVersion";
    if (missing || v < NCCL_MIN_VERSION) {
        if (missing) snprintf(why, n, "%s lacks %s: kiln needs NCCL 2.14 or later", N.path, missing);
        else snprintf(why, n, "%s is NCCL %d.%d.%d: kiln needs 2.14 or later", N.path, v / 10000, v / 100 % 100,
                      v % 100);
        dlclose(lib);
        memset(&N, 0, sizeof N);
        return 0;
    }
    N.version = v;
    N.lib = lib;
    return 1;
}

const char *comm_nccl_build_info(void) {
    static char info[640];
    if (N.lib)
        snprintf(info, sizeof info, "nccl: built in (headers %d.%d.%d); loaded NCCL %d.%d.%d from %s", NCCL_MAJOR,
                 NCCL_MINOR, NCCL_PATCH, N.version / 10000, N.version / 100 % 100, N.version % 100, N.path);
    else
        snprintf(info, sizeof info, "nccl: built in (headers %d.%d.%d), libnccl.so.2 loaded at run time by "
                                    "multi-GPU runs", NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
    return info;
}

/* ", NCCL 2.28.9" for comm_describe once the library is loaded, else "". */
static void nccl_describe(char *buf, size_t n) {
    if (N.lib) snprintf(buf, n, ", NCCL %d.%d.%d", N.version / 10000, N.version / 100 % 100, N.version % 100);
    else if (n) buf[0] = '\0';
}

static void nccl_load_or_fail(void) {
    char why[768];
    if (!comm_nccl_available(why, sizeof why)) kiln_fail(KILN_EXIT_RUNTIME, "rank %d: %s", C.info.rank, why);
    static int said;
    if (!said && C.info.rank == 0) {
        /* one line in the start-up output: which NCCL this run really uses */
        printf("nccl: NCCL %d.%d.%d from %s\n", N.version / 10000, N.version / 100 % 100, N.version % 100, N.path);
        fflush(stdout);
    }
    said = 1;
}

static ncclComm_t ncomm(const CommGroup *g) { return (ncclComm_t)g->nccl; }

/* NCCL's own last message (which peer, which transport) when it has one. */
static const char *nccl_detail(const CommGroup *g) {
    const char *d = g && g->nccl ? N.GetLastError(ncomm(g)) : NULL;
    return d && *d ? d : "no further detail";
}

/* ncclInProgress is how a non-blocking communicator says "started": callers
 * settle it (nccl_settle) before relying on the operation being enqueued. */
#define NCCL_CHECK(g, call)                                                                                         \
    do {                                                                                                            \
        ncclResult_t nccl_rc_ = (call);                                                                             \
        if (nccl_rc_ != ncclSuccess && nccl_rc_ != ncclInProgress)                                                  \
            kiln_fail(KILN_EXIT_RUNTIME, "rank %d: %s:%d: %s on group '%s' failed: %s (%s)", C.info.rank, __FILE__, \
                      __LINE__, #call, (g)->name, N.GetErrorString(nccl_rc_), nccl_detail(g));                     \
    } while (0)

#define CUDA_CHECK_G(g, call)                                                                                       \
    do {                                                                                                            \
        cudaError_t cuda_rc_ = (call);                                                                              \
        if (cuda_rc_ != cudaSuccess)                                                                                \
            kiln_fail(KILN_EXIT_RUNTIME, "rank %d: %s:%d: %s on group '%s' failed: %s", C.info.rank, __FILE__,      \
                      __LINE__, #call, (g)->name, cudaGetErrorString(cuda_rc_));                                    \
    } while (0)

/* The job's name for the id file: a rerun of the same job must not read the
 * id of a previous attempt, so the restart count is part of it. */
static void nccl_id_path(const CommGroup *g, const char *run_dir, char *out, size_t n) {
    const char *job = getenv("SLURM_JOB_ID");
    const char *restart = getenv("SLURM_RESTART_COUNT");
    if (!job) job = getenv("TORCHELASTIC_RUN_ID");
    if (!restart) restart = getenv("TORCHELASTIC_RESTART_COUNT");
    if (!job) job = getenv("MASTER_PORT");
    snprintf(out, n, "%s/nccl_id.%s.%s.%s.%d", run_dir, job ? job : "local", restart ? restart : "0", g->name,
             g->members[0]);
}

static void nccl_id_by_file(CommGroup *g, const char *run_dir, ncclUniqueId *id) {
    char path[1024];
    nccl_id_path(g, run_dir, path, sizeof path);
    if (g->rank == 0) {
        if (kiln_write_file_atomic(path, id, sizeof *id) != 0)
            kiln_fail(KILN_EXIT_RUNTIME, "rank %d: %s: cannot write the NCCL id", C.info.rank, path);
        return;
    }
    double t0 = kiln_now();
    for (;;) {
        size_t len = 0;
        char *buf = kiln_read_file_max(path, KILN_SMALL_FILE_MAX, &len);
        if (buf && len == sizeof *id) {
            memcpy(id, buf, sizeof *id);
            free(buf);
            return;
        }
        free(buf);
        if (kiln_now() - t0 > C.info.timeout_s)
            kiln_fail(KILN_EXIT_RUNTIME, "rank %d: group '%s': rank %d (world) did not write %s within %.0f s",
                      C.info.rank, g->name, g->members[0], path, C.info.timeout_s);
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

/* Wait for a call on a non-blocking communicator to leave ncclInProgress
 * (init, finalize, or the enqueueing of an operation), within the deadline. */
static void nccl_settle(CommGroup *g, const char *what) {
    double t0 = kiln_now();
    for (;;) {
        ncclResult_t st = ncclInProgress;
        NCCL_CHECK(g, N.CommGetAsyncError(ncomm(g), &st));
        if (st == ncclSuccess) return;
        if (st != ncclInProgress)
            kiln_fail(KILN_EXIT_RUNTIME, "rank %d: NCCL %s #%llu on group '%s' failed: %s (%s)", C.info.rank, what,
                      (unsigned long long)g->seq, g->name, N.GetErrorString(st), nccl_detail(g));
        if (kiln_now() - t0 > C.info.timeout_s) {
            N.CommAbort(ncomm(g)); /* the process ends next: nothing to check */
            g->nccl = NULL;
            comm_timeout(g, what, g->seq, kiln_now() - t0);
        }
        sched_yield();
    }
}

void comm_nccl_init(CommGroup *g, const char *run_dir) {
    if (g->nccl) return;
    nccl_load_or_fail();
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (g->rank == 0) NCCL_CHECK(g, N.GetUniqueId(&id));
    if (g->size > 1) {
        if (C.info.mpi) comm_broadcast_bytes(g, &id, sizeof id, 0);
        else nccl_id_by_file(g, run_dir, &id);
    }
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0; /* so that init, too, is bounded by the deadline */
    ncclComm_t c = NULL;
    NCCL_CHECK(g, N.CommInitRankConfig(&c, g->size, id, g->rank, &cfg));
    g->nccl = c;
    nccl_settle(g, "nccl_init");
    if (g->rank == 0 && g->size > 1 && !C.info.mpi) {
        /* every rank has joined: the id file has done its work */
        char path[1024];
        nccl_id_path(g, run_dir, path, sizeof path);
        unlink(path);
    }
}

/* ---- device mode */

/* A group's device-mode state. The comm stream is the group's own and
 * non-blocking (it must not serialise with the legacy default stream, or
 * nothing would overlap); NCCL operations on one communicator must run in
 * issue order anyway, so one stream per group is all the concurrency there is.
 * Completion events come from a pool that grows when more requests are in
 * flight than ever before: after the first step it never allocates again. */
#define COMM_PENDING 64
typedef struct NcclDev {
    cudaStream_t compute; /* the caller's stream: inputs are written and results read there */
    cudaStream_t stream;  /* this group's comm stream */
    cudaEvent_t ready;    /* recorded on `compute` at each post; `stream` waits on it */
    cudaEvent_t *events;  /* [cap] completion events */
    unsigned char *busy;  /* [cap] 1 while a request holds the event */
    int cap, next;        /* pool size; where the search for a free event starts */
    /* comm_nccl_stream_ordered: blocking collectives whose completion the
     * compute stream waits for on the device; checked (with the deadline)
     * by comm_drain, or when the list is full */
    int ordered;
    CommRequest pend[COMM_PENDING];
    int npend;
} NcclDev;

/* Add events to the pool: 16 at first, then double. */
static void dev_pool_grow(CommGroup *g) {
    NcclDev *d = g->dev;
    int old = d->cap, cap = old ? 2 * old : 16;
    d->events = xrealloc(d->events, (size_t)cap * sizeof(cudaEvent_t));
    d->busy = xrealloc(d->busy, (size_t)cap);
    for (int e = old; e < cap; e++) {
        /* no timing: cheaper to record, and all we ask is "done yet?" */
        CUDA_CHECK_G(g, cudaEventCreateWithFlags(&d->events[e], cudaEventDisableTiming));
        d->busy[e] = 0;
    }
    d->cap = cap;
}

/* A free completion event (its slot), marked busy. */
static int dev_event_take(CommGroup *g) {
    NcclDev *d = g->dev;
    for (;;) {
        for (int k = 0; k < d->cap; k++) {
            int e = (d->next + k) % d->cap;
            if (!d->busy[e]) {
                d->busy[e] = 1;
                d->next = (e + 1) % d->cap;
                return e;
            }
        }
        dev_pool_grow(g);
    }
}

void comm_nccl_device_mode(CommGroup *g, void *compute_stream) {
    if (!g->nccl)
        kiln_fail(KILN_EXIT_RUNTIME, "rank %d: comm_nccl_device_mode on group '%s' before comm_nccl_init",
                  C.info.rank, g->name);
    if (g->dev) return;
    NcclDev *d = xcalloc(1, sizeof *d);
    g->dev = d;
    d->compute = (cudaStream_t)compute_stream;
    CUDA_CHECK_G(g, cudaStreamCreateWithFlags(&d->stream, cudaStreamNonBlocking));
    CUDA_CHECK_G(g, cudaEventCreateWithFlags(&d->ready, cudaEventDisableTiming));
    dev_pool_grow(g); /* now, not at the first collective */
}

/* Before an NCCL operation: the group's comm stream waits for everything
 * already on the compute stream (an event), so the operation reads what
 * earlier ops wrote. Returns the comm stream. */
static cudaStream_t nccl_enter(CommGroup *g) {
    NcclDev *d = g->dev;
    CUDA_CHECK_G(g, cudaEventRecord(d->ready, d->compute));
    CUDA_CHECK_G(g, cudaStreamWaitEvent(d->stream, d->ready, 0));
    return d->stream;
}

/* After it is enqueued: its completion event goes into req. */
static void nccl_leave(CommRequest *req) {
    CommGroup *g = req->g;
    NcclDev *d = g->dev;
    /* the operation must be on the stream before its completion event is */
    nccl_settle(g, req->op);
    req->event = dev_event_take(g);
    CUDA_CHECK_G(g, cudaEventRecord(d->events[req->event], d->stream));
    req->device = 1;
    req->active = 1;
}

/* Enqueue one NCCL operation after everything already on the compute stream,
 * and give its completion event to req (req_start has filled it). */
static void nccl_post(CommRequest *req, NcclOp k, const void *send, void *recv, size_t n, int peer) {
    CommGroup *g = req->g;
    if (n == 0) return; /* nothing to move; the sequence number still counts it */
    int p2p = k == NCCL_OP_SEND || k == NCCL_OP_RECV || k == NCCL_OP_SENDRECV;
    FlightDtype dt = k == NCCL_OP_SUM_BF16 || k == NCCL_OP_REDUCE_SCATTER_BF16 ? FLIGHT_BF16 : FLIGHT_F32;
    int to = k == NCCL_OP_SENDRECV ? peer & 0xffff : peer;
    req->flight = op_begin(g, req->op, dt, n, p2p || k == NCCL_OP_BROADCAST ? to : -1, p2p, 0);
    ncclComm_t c = ncomm(g);
    cudaStream_t s = nccl_enter(g);
    switch (k) {
    case NCCL_OP_SUM:
    case NCCL_OP_AVG:
        NCCL_CHECK(g, N.AllReduce(send, recv, n, ncclFloat32, k == NCCL_OP_AVG ? ncclAvg : ncclSum, c, s));
        break;
    case NCCL_OP_REDUCE_SCATTER:
        NCCL_CHECK(g, N.ReduceScatter(send, recv, n, ncclFloat32, ncclSum, c, s));
        break;
    case NCCL_OP_SUM_BF16:
        NCCL_CHECK(g, N.AllReduce(send, recv, n, ncclBfloat16, ncclSum, c, s));
        break;
    case NCCL_OP_REDUCE_SCATTER_BF16:
        NCCL_CHECK(g, N.ReduceScatter(send, recv, n, ncclBfloat16, ncclSum, c, s));
        break;
    case NCCL_OP_ALL_GATHER:
        NCCL_CHECK(g, N.AllGather(send, recv, n, ncclFloat32, c, s));
        break;
    case NCCL_OP_BROADCAST:
        NCCL_CHECK(g, N.Broadcast(send, recv, n, ncclFloat32, peer, c, s));
        break;
    case NCCL_OP_SEND:
        NCCL_CHECK(g, N.Send(send, n, ncclFloat32, peer, c, s));
        break;
    case NCCL_OP_RECV:
        NCCL_CHECK(g, N.Recv(recv, n, ncclFloat32, peer, c, s));
        break;
    case NCCL_OP_SENDRECV:
        /* one group: every rank of a ring sends and receives at once, so no
         * send waits behind its own receive */
        NCCL_CHECK(g, N.GroupStart());
        NCCL_CHECK(g, N.Send(send, n, ncclFloat32, to, c, s));
        NCCL_CHECK(g, N.Recv(recv, n, ncclFloat32, peer >> 16, c, s));
        NCCL_CHECK(g, N.GroupEnd());
        break;
    case NCCL_OP_ALL_TO_ALL:
        /* NCCL before 2.28 has no all-to-all: a group of sends and receives
         * is the documented way */
        NCCL_CHECK(g, N.GroupStart());
        for (int p = 0; p < g->size; p++) {
            NCCL_CHECK(g, N.Send((const float *)send + (size_t)p * n, n, ncclFloat32, p, c, s));
            NCCL_CHECK(g, N.Recv((float *)recv + (size_t)p * n, n, ncclFloat32, p, c, s));
        }
        NCCL_CHECK(g, N.GroupEnd());
        break;
    }
    nccl_leave(req);
}

/* comm_all_to_allv on the device: NCCL has no v-form, so (as for the
 * fixed-size all-to-all) one group of a send and a receive per peer with a
 * count, peers with nothing to move skipped. Every member records the call,
 * even one that moves nothing: the collective counters stay in step. */
static void nccl_post_alltoallv(CommRequest *req, const void *send, const size_t *send_counts, void *recv,
                                const size_t *recv_counts, size_t esz) {
    CommGroup *g = req->g;
    FlightDtype fd = esz == 4 ? FLIGHT_F32 : esz == 2 ? FLIGHT_BF16 : FLIGHT_BYTES;
    ncclDataType_t t = esz == 4 ? ncclFloat32 : esz == 2 ? ncclBfloat16 : ncclUint8;
    req->flight = op_begin(g, req->op, fd, 0, -1, 0, 0);
    ncclComm_t c = ncomm(g);
    cudaStream_t s = nccl_enter(g);
    size_t so = 0, ro = 0;
    NCCL_CHECK(g, N.GroupStart());
    for (int p = 0; p < g->size; p++) {
        if (send_counts[p]) NCCL_CHECK(g, N.Send((const char *)send + so * esz, send_counts[p], t, p, c, s));
        if (recv_counts[p]) NCCL_CHECK(g, N.Recv((char *)recv + ro * esz, recv_counts[p], t, p, c, s));
        so += send_counts[p], ro += recv_counts[p];
    }
    NCCL_CHECK(g, N.GroupEnd());
    nccl_leave(req);
}

/* One look at a device request: 1 when done. A failure NCCL noticed (a peer's
 * network error) ends the run; so does the deadline, after aborting the
 * communicator so that its kernels stop spinning. */
static int nccl_poll(CommRequest *req) {
    CommGroup *g = req->g;
    NcclDev *d = g->dev;
    cudaError_t e = cudaEventQuery(d->events[req->event]);
    if (e == cudaSuccess) return 1;
    if (e != cudaErrorNotReady)
        kiln_fail(KILN_EXIT_RUNTIME, "rank %d: NCCL %s #%llu on group '%s': CUDA error %s", C.info.rank, req->op,
                  (unsigned long long)req->seq, g->name, cudaGetErrorString(e));
    (void)cudaGetLastError(); /* "not ready" may be recorded as the last error: the backend's launch checks read it */
    ncclResult_t st = ncclSuccess;
    NCCL_CHECK(g, N.CommGetAsyncError(ncomm(g), &st));
    if (st != ncclSuccess && st != ncclInProgress) {
        /* usually a peer that died mid-operation: name it when we can */
        char dead[512] = "";
        int w[16], nd = comm_dead_peers(g, w, 16), k = 0;
        for (int i = 0; i < nd && k < (int)sizeof dead - 80; i++)
            k += snprintf(dead + k, sizeof dead - k, "; rank %d (pid %d on %s) is dead", w[i], (int)C.peers[w[i]].pid,
                          C.peers[w[i]].host);
        flight_dump(FLIGHT_COMM_ERROR, (int)st);
        kiln_fail(KILN_EXIT_RUNTIME, "rank %d: NCCL %s #%llu on group '%s' failed: %s (%s)%s", C.info.rank, req->op,
                  (unsigned long long)req->seq, g->name, N.GetErrorString(st), nccl_detail(g), dead);
    }
    double waited = kiln_now() - req->t_start;
    if (waited > C.info.timeout_s && (!req->p2p || req->waiting)) { /* a p2p post times out only in comm_wait */
        N.CommAbort(ncomm(g)); /* the process ends next: nothing to check */
        g->nccl = NULL;
        comm_timeout(g, req->op, req->seq, waited);
    }
    return 0;
}

/* Done: later work on the compute stream is ordered after the operation, and
 * the event goes back to the pool (a later record re-arms it; the wait just
 * enqueued has already captured this completion). */
static void nccl_finish(CommRequest *req) {
    NcclDev *d = req->g->dev;
    CUDA_CHECK_G(req->g, cudaStreamWaitEvent(d->compute, d->events[req->event], 0));
    d->busy[req->event] = 0;
    req->active = 0;
    flight_done(req->flight);
}

static int nccl_test(CommRequest *req) {
    if (!nccl_poll(req)) return 0;
    nccl_finish(req);
    return 1;
}

/* Like wait_mpi: yield first (latency), then short sleeps; answer the watch
 * meanwhile, so a peer that timed out learns this rank waits here. */
static void nccl_wait(CommRequest *req) {
    flight_wait(req->flight);
    C.cur_op = req->op;
    C.cur_group = req->g;
    C.cur_seq = req->seq;
    for (long spins = 0; !nccl_poll(req); spins++) {
#ifdef KILN_MPI
        if ((spins & 63) == 0) watch_serve();
#endif
        if (spins < 2000) {
            sched_yield();
        } else {
            struct timespec ts = {0, 200000};
            nanosleep(&ts, NULL);
        }
    }
    C.cur_op = NULL;
    nccl_finish(req);
}

void comm_nccl_stream_ordered(CommGroup *g) {
    if (!g->dev) kiln_fail(KILN_EXIT_RUNTIME, "comm_nccl_stream_ordered: group '%s' is not in device mode", g->name);
    ((NcclDev *)g->dev)->ordered = 1;
}

/* Stream-ordered: enqueue, make the compute stream wait for the result, and
 * keep the request (its event) until comm_drain looks at it. */
static int nccl_run_ordered(CommGroup *g, const char *op, NcclOp k, const void *send, void *recv, size_t n, int peer) {
    NcclDev *d = g->dev;
    if (!d || !d->ordered) return 0;
    if (d->npend == COMM_PENDING) comm_drain(g);
    CommRequest *r = &d->pend[d->npend];
    req_start(r, g, op);
    nccl_post(r, k, send, recv, n, peer);
    if (!r->active) return 1;
    CUDA_CHECK_G(g, cudaStreamWaitEvent(d->compute, d->events[r->event], 0));
    d->npend++;
    return 1;
}

void comm_drain(CommGroup *g) {
    NcclDev *d = g->dev;
    if (!d) return;
    for (int i = 0; i < d->npend; i++) nccl_wait(&d->pend[i]); /* bounded; frees the event */
    d->npend = 0;
}

static void dev_free(CommGroup *g) {
    NcclDev *d = g->dev;
    if (!d) return;
    comm_drain(g);
    /* bounded: a stream stuck in a collective with a dead peer never drains */
    double t0 = kiln_now();
    for (;;) {
        cudaError_t e = cudaStreamQuery(d->stream);
        if (e == cudaSuccess) break;
        if (e != cudaErrorNotReady)
            kiln_fail(KILN_EXIT_RUNTIME, "rank %d: draining the NCCL stream of group '%s': CUDA error %s",
                      C.info.rank, g->name, cudaGetErrorString(e));
        (void)cudaGetLastError();
        if (kiln_now() - t0 > C.info.timeout_s) {
            N.CommAbort(ncomm(g));
            g->nccl = NULL;
            comm_timeout(g, "nccl_free", g->seq, kiln_now() - t0);
        }
        sched_yield();
    }
    for (int e = 0; e < d->cap; e++) CUDA_CHECK_G(g, cudaEventDestroy(d->events[e]));
    CUDA_CHECK_G(g, cudaEventDestroy(d->ready));
    CUDA_CHECK_G(g, cudaStreamDestroy(d->stream));
    free(d->events);
    free(d->busy);
    free(d);
    g->dev = NULL;
}

void comm_nccl_free(CommGroup *g) {
    if (!g->nccl) return;
    dev_free(g);
    NCCL_CHECK(g, N.CommFinalize(ncomm(g)));
    nccl_settle(g, "nccl_finalize");
    NCCL_CHECK(g, N.CommDestroy(ncomm(g)));
    g->nccl = NULL;
}

#else /* no KILN_NCCL: the same API, refusing device buffers */

int comm_nccl_available(char *why, size_t n) {
    snprintf(why, n, "this build has no NCCL (built without CUDA, or without nccl.h)");
    return 0;
}
const char *comm_nccl_build_info(void) { return "nccl: not built in"; }
static void nccl_describe(char *buf, size_t n) {
    if (n) buf[0] = '\0';
}
__attribute__((noreturn)) static void no_nccl(const CommGroup *g, const char *what) {
    kiln_fail(KILN_EXIT_USAGE, "rank %d: %s on group '%s' needs NCCL, but this build has none: rebuild with CUDA=1 "
                               "where nccl.h is installed (make prints what it found)", C.info.rank, what, g->name);
}
void comm_nccl_init(CommGroup *g, const char *run_dir) { no_nccl(g, "comm_nccl_init"); }
void comm_nccl_device_mode(CommGroup *g, void *compute_stream) { no_nccl(g, "comm_nccl_device_mode"); }
void comm_nccl_free(CommGroup *g) {}
void comm_nccl_stream_ordered(CommGroup *g) { no_nccl(g, "comm_nccl_stream_ordered"); }
void comm_drain(CommGroup *g) {}
/* g->dev is never set in this build: these are never reached. */
static int nccl_run_ordered(CommGroup *g, const char *op, NcclOp k, const void *send, void *recv, size_t n, int peer) {
    return 0;
}
static void nccl_post(CommRequest *req, NcclOp k, const void *send, void *recv, size_t n, int peer) {
    no_nccl(req->g, req->op);
}
static void nccl_post_alltoallv(CommRequest *req, const void *send, const size_t *send_counts, void *recv,
                                const size_t *recv_counts, size_t esz) {
    no_nccl(req->g, req->op);
}
static int nccl_test(CommRequest *req) { no_nccl(req->g, req->op); }
static void nccl_wait(CommRequest *req) { no_nccl(req->g, req->op); }
#endif
