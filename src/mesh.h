/* mesh: the device mesh (pp x dp x cp x tp, expert parallelism folded into
 * dp x cp), its process groups, parameter placements and the flat-range shard
 * math that ZeRO uses. The arithmetic (mesh_plan, mesh_coords, mesh_members,
 * mesh_shard_range, placement_local_shape) is pure and needs no MPI; only
 * mesh_init / mesh_free talk to comm. Never knows the model or the optimizer.
 *
 * Rank layout: tp varies fastest, then cp, then dp, then pp:
 *   rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i
 * so a tp group is tp consecutive ranks (one node when tp <= GPUs per node),
 * and pipeline stages are the slowest-varying (stage boundaries cross nodes). */
#ifndef KILN_MESH_H
#define KILN_MESH_H

#include <stddef.h>

#include "comm.h"

typedef enum { MESH_PP = 0, MESH_DP, MESH_CP, MESH_TP, MESH_NDIMS } MeshDim;

/* Process groups a rank belongs to. DPCP is dp x cp together: gradients of
 * replicated parameters reduce over it when cp > 1. EP splits the dp x cp
 * plane into groups of ep consecutive ranks (the experts are spread over
 * them); EDP joins the ranks holding the same experts (their gradients reduce
 * over it). WORLD is every rank. */
typedef enum {
    MESH_GROUP_PP = 0,
    MESH_GROUP_DP,
    MESH_GROUP_CP,
    MESH_GROUP_TP,
    MESH_GROUP_DPCP,
    MESH_GROUP_EP,
    MESH_GROUP_EDP,
    MESH_GROUP_WORLD,
    MESH_NGROUPS
} MeshGroupKind;

typedef struct MeshShape {
    int size[MESH_NDIMS]; /* pp, dp, cp, tp; dp 0 = auto (world / (pp*cp*tp)) before mesh_plan */
    int ep;               /* expert-parallel ranks, divides dp*cp */
} MeshShape;

typedef struct Mesh {
    MeshShape shape;
    int world, rank;
    int coord[MESH_NDIMS];           /* this rank's position */
    int ep_rank, edp_rank;           /* position inside its EP and EDP groups */
    CommGroup group[MESH_NGROUPS];   /* this rank's groups; WORLD is a view, not owned */
} Mesh;

/* Resolve dp = 0 (auto) and check every divisibility rule for `world` ranks.
 * Returns 0, or -1 with one line in err naming the keys (parallel.dp, ...). */
int mesh_plan(MeshShape *s, int world, char *err, size_t errn);

/* Pure arithmetic over a planned shape. */
int mesh_world(const MeshShape *s);
void mesh_coords(const MeshShape *s, int rank, int coord[MESH_NDIMS]);
int mesh_rank_of(const MeshShape *s, const int coord[MESH_NDIMS]);
/* The world ranks of the `kind` group that contains `rank`, in group-rank
 * order; returns the group's size. out must hold mesh_world(s) ints. */
int mesh_members(const MeshShape *s, MeshGroupKind kind, int rank, int *out);
const char *mesh_group_name(MeshGroupKind kind);
/* "pp 1 x dp 2 x cp 1 x tp 2 (ep 1)" */
void mesh_describe(const MeshShape *s, char *buf, size_t n);

/* Build this rank's groups from the world (collective over every rank: each
 * group is one comm_split). The shape must be planned for comm_world()'s size. */
void mesh_init(Mesh *m, const MeshShape *s);
void mesh_free(Mesh *m);
static inline CommGroup *mesh_group(Mesh *m, MeshGroupKind k) { return &m->group[k]; }

/* ---------------------------------------------------------------- placements */

typedef enum { PLACEMENT_REPLICATED = 0, PLACEMENT_SHARDED } PlacementKind;

/* Where a tensor lives: every rank of the mesh holds all of it, or tensor
 * dimension `dim` is split evenly over the ranks of one mesh group. */
typedef struct Placement {
    PlacementKind kind;
    int dim;             /* sharded: which tensor dimension */
    MeshGroupKind group; /* sharded: over which group */
} Placement;

/* Local shape of a tensor with global `shape` (ndim dims) on a rank with the
 * given group size, and the offset of this rank's slice along the sharded
 * dimension. Returns 0, or -1 with a message in err when the dimension does
 * not divide evenly (tensor sharding needs even splits). */
int placement_local_shape(const Placement *p, int group_size, int group_rank, int ndim, const int *shape,
                          int *local, int *offset, char *err, size_t errn);
/* "replicated" | "sharded(dim 0 over tp)", for manifests and messages. */
void placement_describe(const Placement *p, char *buf, size_t n);

/* ---------------------------------------------------------------- flat shards (ZeRO) */

/* A flat arena of n elements split over k ranks for reduce-scatter /
 * all-gather: every rank gets the same `block` (ceil(n/k) rounded up to
 * `align` elements), the arena is padded to padded_n = k * block with zeros,
 * and rank r owns [r*block, (r+1)*block) of the padded arena, of which the
 * real elements are [lo, hi) (hi - lo may be short, or 0, for the last ranks).
 * align >= 1; 64 keeps blocks 256-byte aligned for vector loads and NCCL. */
typedef struct ShardRange {
    size_t lo, hi;     /* real elements this rank owns: [lo, hi) of [0, n) */
    size_t start;      /* r * block: where this rank's block starts in the padded arena */
    size_t block;      /* elements per rank, padding included */
    size_t padded_n;   /* k * block >= n */
} ShardRange;

ShardRange mesh_shard_range(size_t n, int k, int r, size_t align);

#endif
