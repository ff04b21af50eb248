/* comm: who this process is (rank discovery from Slurm, Open MPI or a
 * torchrun-style environment) and the collectives between ranks: MPI on host
 * buffers, NCCL on device buffers (KILN_NCCL builds only). Every blocking wait
 * has a deadline, so a dead peer ends the run with one line naming it instead
 * of a hang. Never knows the model, the optimizer or the config; the mesh
 * (mesh.h) builds its process groups from comm_split.
 *
 * Builds without MPI (no KILN_MPI) keep the whole API: one rank, collectives
 * are copies or no-ops, and a launch with more than one rank exits 2. */
#ifndef KILN_COMM_H
#define KILN_COMM_H

#include <stddef.h>
#include <stdint.h>

/* Where the rank came from. */
typedef enum {
    COMM_SOURCE_SINGLE = 0, /* no launcher variables: one rank */
    COMM_SOURCE_SLURM,      /* srun step: SLURM_PROCID / SLURM_STEP_NUM_TASKS / SLURM_LOCALID */
    COMM_SOURCE_OPENMPI,    /* mpirun: OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK */
    COMM_SOURCE_ENV         /* torchrun-style: RANK / WORLD_SIZE / LOCAL_RANK */
} CommSource;

/* A process group: an MPI communicator (and optionally an NCCL communicator)
 * over some of the world's ranks. Members are listed by world rank, in group
 * rank order. Filled by comm_init (the world) or comm_split; freed by
 * comm_group_free. */
#define COMM_GROUP_NAME 32
typedef struct CommGroup {
    char name[COMM_GROUP_NAME]; /* "world", "dp", "tp", ...: used in every message */
    int rank;                   /* this process's rank in the group */
    int size;                   /* members */
    int *members;               /* [size]: world rank of each group rank */
    uint64_t mpi;               /* MPI_Comm, stored opaquely; 0 = none (single rank) */
    void *nccl;                 /* ncclComm_t after comm_nccl_init, else NULL */
    uint64_t seq;               /* collectives issued on this group, for messages */
} CommGroup;

/* A non-blocking collective in flight (comm_i*); finish it with comm_wait. */
typedef struct CommRequest {
    uint64_t mpi;      /* MPI_Request, stored opaquely */
    CommGroup *g;
    const char *op;    /* "all_reduce", ... for messages */
    uint64_t seq;
    double t_start;    /* when it was posted: the deadline counts from here */
    int active;
} CommRequest;

/* Process-wide facts, valid after comm_init. */
typedef struct CommInfo {
    int rank, world;        /* in the world */
    int local_rank;         /* among the ranks of this host (from the launcher) */
    int local_world;        /* ranks on this host (counted from hostnames) */
    int nodes;              /* distinct hosts */
    CommSource source;
    int mpi;                /* 1 if MPI is initialised and carries host collectives */
    double timeout_s;       /* deadline of every blocking wait */
    char host[64];
} CommInfo;

/* Discover the rank from the environment (Open MPI's mpirun, then a Slurm
 * srun step, then RANK/WORLD_SIZE; none = one rank; docs/parallel.md says why) and, when world > 1 and the launcher runs
 * an MPI runtime (srun --mpi=pmix or mpirun), initialise MPI
 * (MPI_THREAD_FUNNELED) and check that its rank and size agree with the
 * environment. Errors return through MPI_ERRORS_RETURN and are reported by
 * comm. `timeout_s` > 0 bounds every wait (parallel.timeout_s); the
 * environment variable KILN_COMM_TIMEOUT_S overrides it. Exits 2 on a bad
 * environment (mismatch, world > 1 in a build without MPI), naming both sides. */
void comm_init(double timeout_s);
/* MPI_Finalize when MPI was initialised; frees the world group. */
void comm_finalize(void);
const CommInfo *comm_info(void);
CommGroup *comm_world(void);
/* "rank 0/4 (local 0/2, 2 nodes, host vm, from SLURM_PROCID, MPI, timeout 300 s)" */
void comm_describe(char *buf, size_t n);
/* Change the deadline of later waits (seconds, > 0). */
void comm_set_timeout(double timeout_s);

/* Split `parent` like MPI_Comm_split: ranks with the same color form a group,
 * ordered by key. Collective over `parent`. */
void comm_split(CommGroup *parent, int color, int key, const char *name, CommGroup *out);
void comm_group_free(CommGroup *g);

/* Collectives on host float buffers, over one group, each with the deadline.
 * Every member must call the same collectives in the same order with the same
 * sizes. In-place where noted. Values reduce in rank order only as far as MPI
 * promises: sums are exact when the values are (tests use integers). */
void comm_all_reduce_sum(CommGroup *g, float *buf, size_t n);   /* in place */
void comm_all_reduce_mean(CommGroup *g, float *buf, size_t n);  /* sum / size, in place */
void comm_all_reduce_sum_f64(CommGroup *g, double *buf, size_t n);
void comm_all_reduce_max_f64(CommGroup *g, double *buf, size_t n);
/* send: (size * block) floats; recv: block floats, the sum of every rank's
 * block number `rank`. */
void comm_reduce_scatter(CommGroup *g, const float *send, float *recv, size_t block);
/* send: block floats; recv: (size * block) floats, rank i's block at i*block.
 * In place when send == recv + rank * block. */
void comm_all_gather(CommGroup *g, const float *send, float *recv, size_t block);
void comm_all_gather_bytes(CommGroup *g, const void *send, void *recv, size_t block);
void comm_broadcast(CommGroup *g, float *buf, size_t n, int root);       /* root: group rank */
void comm_broadcast_bytes(CommGroup *g, void *buf, size_t n, int root);
/* Point to point; peer is a group rank, tag >= 0 tells messages apart. */
void comm_send(CommGroup *g, const float *buf, size_t n, int peer, int tag);
void comm_recv(CommGroup *g, float *buf, size_t n, int peer, int tag);
/* send: (size * block) floats, block i goes to rank i; recv: (size * block),
 * block i came from rank i. */
void comm_all_to_all(CommGroup *g, const float *send, float *recv, size_t block);
void comm_barrier(CommGroup *g);

/* Non-blocking forms, for overlapping gradient sync with the backward pass.
 * MPI progresses them only inside MPI calls: call comm_test on outstanding
 * requests now and then (e.g. after each layer's backward). Buffers must stay
 * untouched until comm_wait returns. n and block are at most INT_MAX. */
void comm_iall_reduce_sum(CommGroup *g, float *buf, size_t n, CommRequest *req);
void comm_ireduce_scatter(CommGroup *g, const float *send, float *recv, size_t block, CommRequest *req);
void comm_iall_gather(CommGroup *g, const float *send, float *recv, size_t block, CommRequest *req);
int comm_test(CommRequest *req); /* 1 when done (the request is then finished) */
void comm_wait(CommRequest *req);

/* Start-of-run check that every rank runs the same build with the same
 * resolved config: all-gather (config hash, commit) over the world. On a
 * mismatch rank 0 prints one line naming the ranks that differ from it, and
 * every rank exits 2. */
void comm_check_consistent(uint64_t config_hash, const char *commit);

/* The world ranks of `g` that are known to be dead: same host and the pid
 * is gone. Returns how many were written to out[0..max). Used in timeout
 * messages; exposed for tests and for the caller's own error paths. */
int comm_dead_peers(const CommGroup *g, int *out, int max);

#ifdef KILN_NCCL
/* NCCL on device buffers. The caller has selected its device (cudaSetDevice)
 * first. The unique id travels over the group's MPI communicator when there is
 * one, else through the file RUN_DIR/nccl_id.<job>.<group>.<first member>
 * (rank 0 writes tmp + rename; the others poll until the deadline). Data types
 * are NCCL's (ncclFloat, ncclBfloat16, ...), passed as int; stream is a
 * cudaStream_t. Every call is checked; comm_nccl_wait bounds a stream's
 * completion by the deadline and aborts the communicator on expiry. */
void comm_nccl_init(CommGroup *g, const char *run_dir);
void comm_nccl_free(CommGroup *g);
void comm_nccl_all_reduce(CommGroup *g, void *buf, size_t n, int dtype, int avg, void *stream);
void comm_nccl_reduce_scatter(CommGroup *g, const void *send, void *recv, size_t block, int dtype, int avg,
                              void *stream);
void comm_nccl_all_gather(CommGroup *g, const void *send, void *recv, size_t block, int dtype, void *stream);
void comm_nccl_broadcast(CommGroup *g, void *buf, size_t n, int dtype, int root, void *stream);
void comm_nccl_send(CommGroup *g, const void *buf, size_t n, int dtype, int peer, void *stream);
void comm_nccl_recv(CommGroup *g, void *buf, size_t n, int dtype, int peer, void *stream);
void comm_nccl_all_to_all(CommGroup *g, const void *send, void *recv, size_t block, int dtype, void *stream);
void comm_nccl_wait(CommGroup *g, void *stream, const char *what);
#endif

#endif
