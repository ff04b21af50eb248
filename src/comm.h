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
    void *dev;                  /* device mode (comm_nccl_device_mode): comm.c's streams and
                                   events; NULL = float collectives take host buffers */
    uint64_t seq;               /* collectives issued on this group, for messages */
    uint64_t coll;              /* collectives only (seq without send/recv) that moved data: what the
                                   members agree on (monitor.check_collectives, flight.h) */
} CommGroup;

/* A non-blocking collective in flight (comm_i*); finish it with comm_wait (or
 * comm_test until it says 1). Plain data: no allocation per request. */
typedef struct CommRequest {
    uint64_t mpi;      /* MPI_Request, stored opaquely */
    uint64_t mpi_recv; /* comm_isendrecv: the receive's MPI_Request (mpi is the send's) */
    int pair;          /* comm_isendrecv on MPI: both requests must finish */
    CommGroup *g;
    const char *op;    /* "all_reduce", ... for messages */
    uint64_t seq;
    double t_start;    /* when it was posted: the deadline counts from here */
    int active;
    int device;        /* 1: an NCCL operation in device mode, tracked by an event */
    int event;         /* device mode: slot of its completion event in the group's pool */
    uint64_t flight;   /* its flight recorder id (flight.h); 0 = not recorded */
    int p2p;           /* comm_isend / comm_irecv: the deadline counts from comm_wait */
    int waiting;       /* p2p: comm_wait has begun (t_start is then when it began) */
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

/* Collectives on host float buffers (device buffers after
 * comm_nccl_device_mode: see the NCCL section below), over one group, each
 * with the deadline. Every member must call the same collectives in the same order with the same
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
/* bf16 (the activation dtype on CUDA; tensor parallelism): sums in device
 * mode only (NCCL), a copy on one rank; exit 2 on host buffers of several
 * ranks (MPI has no bf16 sum). */
void comm_all_reduce_sum_bf16(CommGroup *g, void *buf, size_t n);
void comm_reduce_scatter_bf16(CommGroup *g, const void *send, void *recv, size_t block);
void comm_broadcast(CommGroup *g, float *buf, size_t n, int root);       /* root: group rank */
void comm_broadcast_bytes(CommGroup *g, void *buf, size_t n, int root);
/* Point to point; peer is a group rank, tag >= 0 tells messages apart. */
void comm_send(CommGroup *g, const float *buf, size_t n, int peer, int tag);
void comm_recv(CommGroup *g, float *buf, size_t n, int peer, int tag);
/* send: (size * block) floats, block i goes to rank i; recv: (size * block),
 * block i came from rank i. */
void comm_all_to_all(CommGroup *g, const float *send, float *recv, size_t block);
/* The variable-count form (expert parallelism's token rows): send holds, in
 * rank order and back to back, send_counts[i] elements for rank i; recv gets
 * recv_counts[i] elements from rank i, back to back in rank order. Elements
 * are elem_bytes each (4, 2 or 1: moved, never added). Rank j's
 * send_counts[i] must be rank i's recv_counts[j]: exchange the counts first
 * (comm_all_to_all). MPI: MPI_Ialltoallv, at most INT_MAX elements sent and
 * received in all. Device mode: grouped ncclSend/ncclRecv, peers with
 * nothing to move skipped. Blocking, with the deadline. */
void comm_all_to_allv(CommGroup *g, const void *send, const size_t *send_counts, void *recv,
                      const size_t *recv_counts, size_t elem_bytes);
void comm_barrier(CommGroup *g);

/* Non-blocking forms, for overlapping gradient sync with the backward pass.
 * MPI progresses them only inside MPI calls: call comm_test on outstanding
 * requests now and then (e.g. after each layer's backward; harmless and cheap
 * in device mode, where NCCL progresses on its own). Buffers must stay
 * untouched until comm_wait returns. On MPI, n and block are at most INT_MAX. */
void comm_iall_reduce_sum(CommGroup *g, float *buf, size_t n, CommRequest *req);
void comm_ireduce_scatter(CommGroup *g, const float *send, float *recv, size_t block, CommRequest *req);
void comm_iall_gather(CommGroup *g, const float *send, float *recv, size_t block, CommRequest *req);
/* Non-blocking point to point (pipeline stages): n floats to / from group
 * rank `peer`, tag >= 0 (MPI matches by tag; NCCL has none and matches each
 * pair's messages in order, so both sides must post them in the same order).
 * Device pointers in device mode. The deadline counts from comm_wait, not
 * from the post: a receive posted early may wait as long as its schedule
 * says; comm_test never times them out. n is at most INT_MAX on MPI. */
void comm_isend(CommGroup *g, const float *buf, size_t n, int peer, int tag, CommRequest *req);
void comm_irecv(CommGroup *g, float *buf, size_t n, int peer, int tag, CommRequest *req);
/* A ring step (context parallelism): send (n) floats to group rank `to` and
 * receive (n) floats from group rank `from` into recv, both in flight under
 * one request (in device mode one NCCL group, so a ring of these cannot
 * deadlock). to and from may be the same rank; tag as comm_send's. */
void comm_isendrecv(CommGroup *g, const float *send, float *recv, size_t n, int to, int from, int tag,
                    CommRequest *req);
int comm_test(CommRequest *req); /* 1 when done (the request is then finished) */
void comm_wait(CommRequest *req);

/* Start-of-run check that every rank runs the same build with the same
 * resolved config: all-gather (config hash, commit) over the world. On a
 * mismatch rank 0 prints one line naming the ranks that differ from it, and
 * every rank exits 2. */
void comm_check_consistent(uint64_t config_hash, const char *commit);

/* monitor.check_collectives: before every collective on a group of two or
 * more ranks, its members all-gather (operation, collective number, count,
 * dtype, root) over the group's MPI communicator; a disagreement ends the run
 * at once (exit 1) with one line from the group's rank 0 naming both ranks and
 * both calls, instead of a hang. Point-to-point operations are not checked.
 * Needs MPI: a launch without it (RANK/WORLD_SIZE) warns and checks nothing.
 * Every operation is also recorded by the flight recorder (flight.h) once
 * flight_open has run; a timeout, MPI error or mismatch writes its file. */
void comm_check_collectives(int on);

/* The world ranks of `g` that are known to be dead: same host and the pid
 * is gone. Returns how many were written to out[0..max). Used in timeout
 * messages; exposed for tests and for the caller's own error paths. */
int comm_dead_peers(const CommGroup *g, int *out, int max);

/* ---- NCCL: device buffers (docs/parallel.md "NCCL")
 *
 * Declared in every build so that callers need no #ifdef: a build without
 * NCCL (no CUDA, or no nccl.h at build time) refuses comm_nccl_init and
 * comm_nccl_device_mode with exit 2, and comm_nccl_available says why.
 * ./train does not link NCCL: libnccl.so.2 is opened (dlopen) on the first
 * comm_nccl_init, so a binary with NCCL support starts and runs where there is
 * none (CPU runs, one-GPU runs). A missing library ends the run (exit 1) with
 * one line naming libnccl.so.2 and LD_LIBRARY_PATH.
 *
 * How a caller (ddp.c) puts a group's collectives on the GPU:
 *
 *     if (be->stream) {                         // a backend with device memory
 *         comm_nccl_init(g, run_dir);           // collective over g; the device is selected
 *         comm_nccl_device_mode(g, be->stream());
 *     }
 *
 * From then on comm_all_reduce_sum, comm_all_reduce_mean, comm_reduce_scatter,
 * comm_all_gather, comm_broadcast, comm_send, comm_recv, comm_all_to_all,
 * comm_all_to_allv and the non-blocking comm_iall_reduce_sum, comm_ireduce_scatter,
 * comm_iall_gather and comm_isendrecv on g take DEVICE pointers (from be->alloc) and run as NCCL
 * operations. Everything else stays on MPI and host memory: the double
 * collectives (comm_all_reduce_sum_f64 / _max_f64), the byte collectives,
 * comm_barrier and comm_check_consistent. The same group carries both.
 *
 * Ordering, so the caller never synchronises by hand: a post records an event
 * on the compute stream (the backend's) and the group's own comm stream waits
 * for it, so the collective reads what every earlier op wrote; the NCCL
 * operation runs on the comm stream, concurrently with later compute; its
 * completion is an event in the request. comm_test is a cudaEventQuery;
 * comm_wait polls the event against the deadline and then makes the compute
 * stream wait for it, so every later op (and every to_host) sees the result.
 * What the caller must still do: not write a buffer that a posted operation
 * reads (send), and not touch one it writes (recv), until comm_wait (or
 * comm_test returning 1) -- the same rule as for MPI; finish every request
 * it posts (an unfinished one holds its event for good); and not call
 * cudaDeviceSynchronize (or anything that implies it, such as cudaFree),
 * which also waits for the comm streams, with no deadline, while requests are
 * in flight -- the CUDA backend's sync waits for its own stream only. A
 * blocking call is
 * post + wait: it returns when the result is on the device.
 *
 * In place: all-reduce and broadcast always; comm_all_gather when send ==
 * recv + rank * block; in device mode also comm_reduce_scatter when recv ==
 * send + rank * block (NCCL's definition). comm_all_reduce_mean uses NCCL's
 * ncclAvg (it may round differently from the host path's sum * (1/size)).
 * Counts are size_t (no INT_MAX limit). Errors: every CUDA and NCCL call is
 * checked (exit 1 naming the call, group and NCCL's words); at the deadline
 * (comm_info()->timeout_s, counted from the post) the communicator is aborted
 * and the run ends with the same line as an MPI timeout: group, operation,
 * sequence number and the peers known dead or absent. */

/* Open libnccl.so.2 if not yet done. 1 if this build has NCCL and the library
 * loads here; else 0 with the reason in why[n]. Never exits. */
int comm_nccl_available(char *why, size_t n);
/* For ./train --version: whether NCCL support is built in and, once loaded,
 * the library's version and path. */
const char *comm_nccl_build_info(void);
/* Create g's NCCL communicator; collective over g. The caller has selected
 * its device (cudaSetDevice) first. The unique id travels over g's MPI
 * communicator when there is one, else (torchrun-style launch, no MPI)
 * through the file RUN_DIR/nccl_id.<job>.<restart>.<group>.<first member>
 * (rank 0 writes tmp + rename; the others poll until the deadline). The
 * communicator is non-blocking (config.blocking = 0), so init too is bounded
 * by the deadline. A one-rank group needs no exchange. */
void comm_nccl_init(CommGroup *g, const char *run_dir);
/* Float collectives on g take device pointers from now on (see above).
 * compute_stream: the cudaStream_t the caller's kernels run on (the
 * backend's stream hook). Needs comm_nccl_init(g) first; call it once. */
void comm_nccl_device_mode(CommGroup *g, void *compute_stream);
/* Stream-ordered device mode (tensor parallelism's collectives, inside a
 * layer): from now on a blocking float collective on g returns once it is
 * enqueued; the compute stream waits for its completion on the device, the
 * host does not. Its completion (and the deadline) is checked by comm_drain,
 * or when 64 are pending. Needs comm_nccl_device_mode(g) first. */
void comm_nccl_stream_ordered(CommGroup *g);
/* Wait, bounded by the deadline, for every stream-ordered collective of g
 * still pending; call it before the host waits on the compute stream (a
 * device-to-host copy), so a dead peer ends the run instead of a hang.
 * Nothing for other groups. */
void comm_drain(CommGroup *g);

/* Wait (bounded) for g's comm stream, free the device-mode streams and
 * events, finalise and destroy the communicator. No-op without one;
 * comm_group_free and comm_finalize call it. */
void comm_nccl_free(CommGroup *g);

#endif
