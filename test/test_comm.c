/* test_comm: comm and mesh. Run directly it is one rank: the mesh and shard
 * arithmetic, placements, and collectives as copies. Run under mpirun or srun
 * (test/t_mpi.sh, test/t_slurm.sh) it checks every collective's values across
 * the ranks, group splitting over a mesh, the consistency check and a dead
 * peer. Only rank 0 prints; a check fails if any rank saw it fail.
 *
 * Hooks for the shell tests (environment):
 *   KILN_TEST_BAD_HASH_RANK=r  rank r passes a different config hash to
 *                              comm_check_consistent: every rank must exit 2.
 *   KILN_TEST_KILL_RANK=r      rank r SIGKILLs itself before an all-reduce:
 *                              the others must end at the deadline naming it.
 *   KILN_TEST_STOP_RANK=r      rank r sleeps instead of joining the all-reduce
 *                              (a hung rank): the others name it at the deadline.
 * Every value summed is an integer below 2^24, so fp32 sums are exact in any
 * order and results are compared with ==. */
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm.h"
#include "mesh.h"
#include "test.h"
#include "util.h"

static int R, W; /* world rank and size */
static char P[16]; /* name prefix: "comm_" or "mpi4_" */

/* One verdict for all ranks: the number of ranks that saw a failure. */
static void check(const char *name, int ok, const char *why) {
    double bad = ok ? 0.0 : 1.0;
    comm_all_reduce_sum_f64(comm_world(), &bad, 1);
    char full[96];
    snprintf(full, sizeof full, "%s%s", P, name);
    if (R == 0) test_report(bad == 0.0, full, "%s (on %g rank(s))", why, bad);
}

/* ------------------------------------------------------------ arithmetic (every rank, no communication) */

/* Every group family partitions the world: each rank is in exactly one group
 * of the family, and every member of that group computes the same list. */
static int mesh_groups_partition(const MeshShape *s) {
    int w = mesh_world(s);
    int *a = xmalloc((size_t)w * sizeof(int)), *b = xmalloc((size_t)w * sizeof(int));
    int ok = 1;
    for (int k = 0; k < MESH_NGROUPS && ok; k++) {
        for (int r = 0; r < w && ok; r++) {
            int n = mesh_members(s, (MeshGroupKind)k, r, a);
            int seen = 0;
            for (int i = 0; i < n; i++) {
                seen += a[i] == r;
                if (a[i] < 0 || a[i] >= w) ok = 0;
                int m = mesh_members(s, (MeshGroupKind)k, a[i], b);
                if (m != n || memcmp(a, b, (size_t)n * sizeof(int)) != 0) ok = 0;
            }
            if (seen != 1) ok = 0;
        }
    }
    free(a);
    free(b);
    return ok;
}

static void test_mesh_math(void) {
    char err[256];
    MeshShape s = {{2, 0, 2, 2}, 2}; /* pp 2, dp auto, cp 2, tp 2, ep 2 over 16 ranks */
    int ok = mesh_plan(&s, 16, err, sizeof err) == 0 && s.size[MESH_DP] == 2;
    check("mesh_plan_auto_dp", ok, "dp auto over 16 ranks with pp 2 cp 2 tp 2 should be 2");

    ok = 1;
    for (int r = 0; r < 16; r++) {
        int c[MESH_NDIMS];
        mesh_coords(&s, r, c);
        if (mesh_rank_of(&s, c) != r) ok = 0;
    }
    int c5[MESH_NDIMS];
    mesh_coords(&s, 5, c5); /* 5 = ((0*2+1)*2+0)*2+1: pp 0, dp 1, cp 0, tp 1 */
    ok = ok && c5[MESH_PP] == 0 && c5[MESH_DP] == 1 && c5[MESH_CP] == 0 && c5[MESH_TP] == 1;
    check("mesh_coords_roundtrip", ok, "rank -> coords -> rank, tp fastest");

    /* Rank 5's groups, worked out by hand from the layout formula. */
    struct {
        MeshGroupKind k;
        int n, m[4];
    } want[] = {{MESH_GROUP_TP, 2, {4, 5}},       {MESH_GROUP_CP, 2, {5, 7}},   {MESH_GROUP_DP, 2, {1, 5}},
                {MESH_GROUP_PP, 2, {5, 13}},      {MESH_GROUP_DPCP, 4, {1, 3, 5, 7}},
                {MESH_GROUP_EP, 2, {5, 7}},       {MESH_GROUP_EDP, 2, {1, 5}}};
    ok = 1;
    int got[16];
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        int n = mesh_members(&s, want[i].k, 5, got);
        if (n != want[i].n || memcmp(got, want[i].m, (size_t)n * sizeof(int)) != 0) ok = 0;
    }
    check("mesh_members_by_hand", ok, "rank 5's tp/cp/dp/pp/dpcp/ep/edp groups differ from the hand-worked ones");

    MeshShape shapes[] = {{{1, 0, 1, 1}, 1}, {{1, 0, 1, 2}, 1}, {{2, 0, 1, 2}, 1}, {{1, 0, 2, 1}, 2},
                          {{2, 0, 2, 2}, 4}, {{3, 0, 1, 1}, 2}};
    int worlds[] = {4, 8, 8, 8, 16, 12};
    ok = 1;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        if (mesh_plan(&shapes[i], worlds[i], err, sizeof err) != 0) ok = 0;
        else if (!mesh_groups_partition(&shapes[i])) ok = 0;
    }
    check("mesh_groups_partition_world", ok, "a group family does not partition the world");

    MeshShape bad1 = {{1, 0, 1, 4}, 1};
    int e1 = mesh_plan(&bad1, 6, err, sizeof err) != 0 && strstr(err, "parallel.dp");
    MeshShape bad2 = {{1, 2, 1, 1}, 3};
    int e2 = mesh_plan(&bad2, 2, err, sizeof err) != 0 && strstr(err, "parallel.ep");
    MeshShape bad3 = {{1, 3, 1, 1}, 1};
    int e3 = mesh_plan(&bad3, 4, err, sizeof err) != 0 && strstr(err, "launch 3 ranks");
    check("mesh_plan_errors_name_key", e1 && e2 && e3, "a bad layout was accepted or its message names no key");
}

static void test_shard_math(void) {
    /* 10 over 4, no alignment: ceil(10/4) = 3 per rank, the last rank short. */
    ShardRange a = mesh_shard_range(10, 4, 3, 1);
    int ok = a.block == 3 && a.padded_n == 12 && a.start == 9 && a.lo == 9 && a.hi == 10;
    /* 10 over 4 aligned to 4: block 4, padded 16, rank 3 starts past the end and owns nothing. */
    ShardRange b = mesh_shard_range(10, 4, 3, 4);
    ShardRange b2 = mesh_shard_range(10, 4, 2, 4);
    ok = ok && b.block == 4 && b.padded_n == 16 && b.start == 12 && b.lo == 10 && b.hi == 10;
    ok = ok && b2.lo == 8 && b2.hi == 10;
    check("shard_range_by_hand", ok, "10 elements over 4 ranks (align 1 and 4) differ from the hand-worked ranges");

    /* Properties over many sizes: the ranges tile [0, n) in rank order,
     * blocks are aligned, and padding is less than one block per rank. */
    Rng rng;
    rng_seed(&rng, 42);
    ok = 1;
    for (int t = 0; t < 2000 && ok; t++) {
        size_t n = (size_t)rng_below(&rng, 200000);
        int k = 1 + (int)rng_below(&rng, 64);
        size_t align = (size_t)1 << rng_below(&rng, 8);
        size_t next = 0;
        for (int r = 0; r < k; r++) {
            ShardRange s = mesh_shard_range(n, k, r, align);
            if (s.lo != next || s.hi < s.lo || s.block % align || s.padded_n != s.block * (size_t)k ||
                s.padded_n < n || s.block * (size_t)k - n >= (size_t)k * align + (size_t)k || s.start != s.block * r)
                ok = 0;
            next = s.hi;
        }
        if (next != n) ok = 0;
    }
    check("shard_range_tiles", ok, "ranges do not tile [0, n) with aligned equal blocks");
}

static void test_placement(void) {
    char err[256], d[64];
    int shape[2] = {768, 2304}, local[2], off;
    Placement col = {PLACEMENT_SHARDED, 1, MESH_GROUP_TP};
    int ok = placement_local_shape(&col, 4, 3, 2, shape, local, &off, err, sizeof err) == 0 && local[0] == 768 &&
             local[1] == 576 && off == 1728;
    Placement rep = {PLACEMENT_REPLICATED, 0, MESH_GROUP_WORLD};
    ok = ok && placement_local_shape(&rep, 4, 3, 2, shape, local, &off, err, sizeof err) == 0 && local[1] == 2304 &&
         off == 0;
    int shape2[1] = {50257};
    Placement row = {PLACEMENT_SHARDED, 0, MESH_GROUP_TP};
    ok = ok && placement_local_shape(&row, 2, 0, 1, shape2, local, &off, err, sizeof err) != 0 &&
         strstr(err, "does not split evenly") && strstr(err, "'tp'");
    placement_describe(&col, d, sizeof d);
    ok = ok && strcmp(d, "sharded(dim 1 over tp)") == 0;
    placement_describe(&rep, d, sizeof d);
    ok = ok && strcmp(d, "replicated") == 0;
    check("placement_local_shape", ok, "local shapes, offsets, uneven-split error or descriptions are wrong");
}

/* ------------------------------------------------------------ collectives */

static void test_collectives(void) {
    CommGroup *g = comm_world();
    int w = W, r = R;

    size_t n = 100003; /* odd, so no size happens to be a round block */
    float *x = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = (float)(r * 1000 + (int)(i % 1000));
    comm_all_reduce_sum(g, x, n);
    int ok = 1;
    for (size_t i = 0; i < n; i++)
        if (x[i] != (float)(1000 * w * (w - 1) / 2 + w * (int)(i % 1000))) ok = 0;
    check("all_reduce_sum", ok, "sum of r*1000 + i%1000 over ranks");

    for (size_t i = 0; i < n; i++) x[i] = (float)(2 * r);
    comm_all_reduce_mean(g, x, n);
    ok = 1;
    for (size_t i = 0; i < n; i++)
        if (x[i] != (float)(w - 1)) ok = 0; /* 1/w is a power of two for w = 1, 2, 4: exact */
    check("all_reduce_mean", ok, "mean of 2r over ranks should be w-1");

    double dd[2] = {r + 0.5, (double)r};
    comm_all_reduce_sum_f64(g, dd, 2);
    double mx = r;
    comm_all_reduce_max_f64(g, &mx, 1);
    check("all_reduce_f64", dd[0] == w * (w - 1) / 2.0 + 0.5 * w && mx == w - 1, "f64 sum and max");

    size_t block = 4099;
    float *send = xmalloc((size_t)w * block * sizeof(float));
    float *recv = xmalloc((size_t)w * block * sizeof(float));
    for (int j = 0; j < w; j++)
        for (size_t i = 0; i < block; i++) send[j * block + i] = (float)((r + 1) * (j + 1) + (int)i);
    comm_reduce_scatter(g, send, recv, block);
    ok = 1;
    for (size_t i = 0; i < block; i++)
        if (recv[i] != (float)((r + 1) * w * (w + 1) / 2 + w * (int)i)) ok = 0;
    check("reduce_scatter", ok, "block r of the sum of every rank's (q+1)(j+1)+i");

    for (size_t i = 0; i < block; i++) send[i] = (float)(r * 100 + (int)(i % 97));
    comm_all_gather(g, send, recv, block);
    ok = 1;
    for (int j = 0; j < w; j++)
        for (size_t i = 0; i < block; i++)
            if (recv[j * block + i] != (float)(j * 100 + (int)(i % 97))) ok = 0;
    /* in place: this rank's block already sits at recv + r*block */
    for (size_t i = 0; i < (size_t)w * block; i++) recv[i] = -1.0f;
    for (size_t i = 0; i < block; i++) recv[(size_t)r * block + i] = (float)(r * 7 + (int)(i % 5));
    comm_all_gather(g, recv + (size_t)r * block, recv, block);
    for (int j = 0; j < w; j++)
        for (size_t i = 0; i < block; i++)
            if (recv[j * block + i] != (float)(j * 7 + (int)(i % 5))) ok = 0;
    check("all_gather", ok, "block j from rank j, separate buffers and in place");

    int root = w - 1;
    for (size_t i = 0; i < n; i++) x[i] = r == root ? (float)(i % 4096) * 3.0f + 7.0f : -1.0f;
    comm_broadcast(g, x, n, root);
    ok = 1;
    for (size_t i = 0; i < n; i++)
        if (x[i] != (float)(i % 4096) * 3.0f + 7.0f) ok = 0;
    check("broadcast", ok, "values of the last rank everywhere");

    if (w > 1) {
        /* A ring: even ranks send first, odd ranks receive first, so that no
         * two ranks wait on each other's send. */
        int next = (r + 1) % w, prev = (r + w - 1) % w;
        for (size_t i = 0; i < block; i++) send[i] = (float)(r * 10000 + (int)i);
        if (r % 2 == 0) {
            comm_send(g, send, block, next, 7);
            comm_recv(g, recv, block, prev, 7);
        } else {
            comm_recv(g, recv, block, prev, 7);
            comm_send(g, send, block, next, 7);
        }
        ok = 1;
        for (size_t i = 0; i < block; i++)
            if (recv[i] != (float)(prev * 10000 + (int)i)) ok = 0;
        check("send_recv_ring", ok, "each rank receives its predecessor's values");
        /* Non-blocking (pipeline stages): every rank posts both receives
         * first, then both sends, two tags apart; the waits finish in any
         * order and each message lands by its tag. */
        CommRequest rq[4];
        float *r2 = recv + block;
        comm_irecv(g, r2, block, next, 9, &rq[0]);
        comm_irecv(g, recv, block, prev, 8, &rq[1]);
        comm_isend(g, send, block, next, 8, &rq[2]);
        comm_isend(g, send, block, prev, 9, &rq[3]);
        for (int k = 3; k >= 0; k--) comm_wait(&rq[k]);
        ok = 1;
        for (size_t i = 0; i < block; i++)
            if (recv[i] != (float)(prev * 10000 + (int)i) || r2[i] != (float)(next * 10000 + (int)i)) ok = 0;
        check("isend_irecv_posted_early", ok, "each rank receives both neighbours' values by tag");
    }

    size_t b2 = 5;
    for (int j = 0; j < w; j++)
        for (size_t i = 0; i < b2; i++) send[j * b2 + i] = (float)(r * 100 + j * 10 + (int)i);
    comm_all_to_all(g, send, recv, b2);
    ok = 1;
    for (int j = 0; j < w; j++)
        for (size_t i = 0; i < b2; i++)
            if (recv[j * b2 + i] != (float)(j * 100 + r * 10 + (int)i)) ok = 0;
    check("all_to_all", ok, "block j came from rank j and is its block r");

    /* The variable-count form: rank r sends (r + 2j) % 3 elements to rank j
     * (some pairs nothing, itself included), as floats and as 2-byte
     * elements (bf16 rows move as such). */
    size_t sc[64], rc[64], so = 0, ro = 0;
    for (int j = 0; j < w && j < 64; j++) sc[j] = (size_t)((r + 2 * j) % 3), rc[j] = (size_t)((j + 2 * r) % 3);
    for (int j = 0; j < w; j++)
        for (size_t i = 0; i < sc[j]; i++) send[so++] = (float)(r * 100 + j * 10 + (int)i);
    comm_all_to_allv(g, send, sc, recv, rc, sizeof(float));
    uint16_t s16[3 * 64], r16[3 * 64];
    for (size_t i = 0; i < so; i++) s16[i] = (uint16_t)send[i];
    comm_all_to_allv(g, s16, sc, r16, rc, 2);
    ok = w <= 64;
    for (int j = 0; j < w && ok; j++)
        for (size_t i = 0; i < rc[j]; i++, ro++)
            if (recv[ro] != (float)(j * 100 + r * 10 + (int)i) || r16[ro] != (uint16_t)(j * 100 + r * 10 + (int)i))
                ok = 0;
    check("all_to_allv", ok, "rank j's elements for rank r, in rank order, 4- and 2-byte");

    comm_barrier(g);
    check("barrier", 1, "");

    /* Two all-reduces in flight at once, progressed by comm_test, as the
     * bucketed gradient sync will do between layers of the backward pass. */
    float *y = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = (float)r, y[i] = (float)(i % 100);
    CommRequest q1, q2;
    comm_iall_reduce_sum(g, x, n, &q1);
    comm_iall_reduce_sum(g, y, n, &q2);
    int polls = 0;
    while (!(comm_test(&q1) & comm_test(&q2))) polls++;
    comm_wait(&q1);
    comm_wait(&q2);
    ok = 1;
    for (size_t i = 0; i < n; i++)
        if (x[i] != (float)(w * (w - 1) / 2) || y[i] != (float)(w * (int)(i % 100))) ok = 0;
    check("nonblocking_all_reduce_overlap", ok, "two requests in flight, tested then waited");

    CommRequest q3;
    for (int j = 0; j < w; j++)
        for (size_t i = 0; i < block; i++) send[j * block + i] = (float)(j + (int)i % 3);
    comm_ireduce_scatter(g, send, recv, block, &q3);
    comm_wait(&q3);
    ok = 1;
    for (size_t i = 0; i < block; i++)
        if (recv[i] != (float)(w * (r + (int)i % 3))) ok = 0;
    CommRequest q4;
    comm_iall_gather(g, recv, send, block, &q4);
    comm_wait(&q4);
    for (int j = 0; j < w; j++)
        for (size_t i = 0; i < block; i++)
            if (send[j * block + i] != (float)(w * (j + (int)i % 3))) ok = 0;
    check("nonblocking_reduce_scatter_all_gather", ok, "reduce-scatter then all-gather = all-reduce");

    free(x);
    free(y);
    free(send);
    free(recv);
}

/* Split by parity, then a mesh: all-reduce inside each group only. */
static void test_groups(void) {
    CommGroup *world = comm_world();
    CommGroup par;
    comm_split(world, R % 2, R, "parity", &par);
    float v = (float)R;
    comm_all_reduce_sum(&par, &v, 1);
    float want = 0;
    for (int i = R % 2; i < W; i += 2) want += (float)i;
    int ok = v == want && par.size == (W - R % 2 + 1) / 2 && par.members[par.rank] == R;
    comm_group_free(&par);
    check("split_parity", ok, "all-reduce of ranks inside the even and the odd group");

    /* 4 ranks: dp 2 x tp 2. 2 ranks: dp 2. Odd: dp = world. */
    MeshShape s = {{1, 0, 1, W % 2 == 0 && W >= 4 ? 2 : 1}, 1};
    char err[256];
    if (mesh_plan(&s, W, err, sizeof err) != 0) {
        check("mesh_groups_all_reduce", 0, err);
        return;
    }
    Mesh m;
    mesh_init(&m, &s);
    ok = 1;
    for (int k = 0; k < MESH_NGROUPS; k++) {
        CommGroup *g = mesh_group(&m, (MeshGroupKind)k);
        int mem[64];
        int n = mesh_members(&s, (MeshGroupKind)k, R, mem);
        if (g->size != n || memcmp(g->members, mem, (size_t)n * sizeof(int)) != 0) ok = 0;
        float x = (float)(R + 1), sum = 0;
        for (int i = 0; i < n; i++) sum += (float)(mem[i] + 1);
        comm_all_reduce_sum(g, &x, 1);
        if (x != sum) ok = 0;
    }
    char d[64];
    mesh_describe(&s, d, sizeof d);
    mesh_free(&m);
    char name[160];
    snprintf(name, sizeof name, "mesh groups (%s): members and all-reduce inside each group only", d);
    check("mesh_groups_all_reduce", ok, name);
}

int main(void) {
    const char *kill_rank = getenv("KILN_TEST_KILL_RANK");
    const char *bad_hash = getenv("KILN_TEST_BAD_HASH_RANK");
    comm_init(0);
    const CommInfo *in = comm_info();
    R = in->rank;
    W = in->world;
    if (W == 1) snprintf(P, sizeof P, "comm_");
    else snprintf(P, sizeof P, "mpi%d_", W);

    if (bad_hash) {
        uint64_t h = 0x1234;
        if (R == atoi(bad_hash)) h += 1;
        comm_check_consistent(h, "test-build");
        if (R == 0) printf("consistent\n");
        comm_finalize();
        return 0;
    }
    const char *stop_rank = getenv("KILN_TEST_STOP_RANK");
    if (kill_rank || stop_rank) {
        float v = 1.0f;
        comm_all_reduce_sum(comm_world(), &v, 1); /* everyone is up */
        if (kill_rank && R == atoi(kill_rank)) raise(SIGKILL);
        if (stop_rank && R == atoi(stop_rank)) sleep(120); /* hung in "compute": alive, never arrives */
        float buf[1024] = {0};
        comm_all_reduce_sum(comm_world(), buf, 1024);
        fprintf(stderr, "rank %d: all-reduce finished without the dead rank\n", R);
        comm_finalize();
        return 0;
    }

    char desc[256];
    comm_describe(desc, sizeof desc);
    char want[32];
    snprintf(want, sizeof want, "rank %d/%d", R, W);
    check("describe", strstr(desc, want) != NULL, desc);
    if (R == 0 && W > 1) fprintf(stderr, "%s\n", desc);

    test_mesh_math();
    test_shard_math();
    test_placement();
    test_collectives();
    test_groups();
    comm_check_consistent(0xfeedULL, "same-build");
    check("consistent_same_hash", 1, "");
    comm_finalize();
    return 0;
}
