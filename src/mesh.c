/* mesh: device mesh arithmetic, process groups, placements and ZeRO's flat
 * shard ranges (see mesh.h). Only mesh_init/mesh_free communicate; the rest is
 * arithmetic that tests check without MPI. Never knows the model. */
#include "mesh.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

static const char *dim_key[MESH_NDIMS] = {"parallel.pp", "parallel.dp", "parallel.cp", "parallel.tp"};

int mesh_plan(MeshShape *s, int world, char *err, size_t errn) {
    for (int d = 0; d < MESH_NDIMS; d++) {
        if (s->size[d] < 0 || (d != MESH_DP && s->size[d] < 1)) {
            snprintf(err, errn, "key '%s': %d is not a number of ranks (at least 1)", dim_key[d], s->size[d]);
            return -1;
        }
    }
    if (s->ep < 1) s->ep = 1;
    int other = s->size[MESH_PP] * s->size[MESH_CP] * s->size[MESH_TP];
    if (s->size[MESH_DP] == 0) {
        if (world % other != 0) {
            snprintf(err, errn, "key 'parallel.dp': auto needs %d ranks to be a multiple of pp x cp x tp = %d", world,
                     other);
            return -1;
        }
        s->size[MESH_DP] = world / other;
    }
    if (other * s->size[MESH_DP] != world) {
        snprintf(err, errn,
                 "keys 'parallel.*': pp %d x dp %d x cp %d x tp %d = %d ranks, but the job has %d (set parallel.dp: "
                 "auto, or launch %d ranks)", s->size[MESH_PP], s->size[MESH_DP], s->size[MESH_CP], s->size[MESH_TP],
                 other * s->size[MESH_DP], world, other * s->size[MESH_DP]);
        return -1;
    }
    int dpcp = s->size[MESH_DP] * s->size[MESH_CP];
    if (dpcp % s->ep != 0) {
        snprintf(err, errn, "key 'parallel.ep': %d must divide dp x cp = %d (experts are spread inside dp x cp)",
                 s->ep, dpcp);
        return -1;
    }
    return 0;
}

int mesh_world(const MeshShape *s) {
    return s->size[MESH_PP] * s->size[MESH_DP] * s->size[MESH_CP] * s->size[MESH_TP];
}

void mesh_coords(const MeshShape *s, int rank, int coord[MESH_NDIMS]) {
    for (int d = MESH_NDIMS - 1; d >= 0; d--) {
        coord[d] = rank % s->size[d];
        rank /= s->size[d];
    }
}

int mesh_rank_of(const MeshShape *s, const int coord[MESH_NDIMS]) {
    int r = 0;
    for (int d = 0; d < MESH_NDIMS; d++) r = r * s->size[d] + coord[d];
    return r;
}

/* Members that vary along one dimension, the others fixed at `rank`'s. */
static int members_along(const MeshShape *s, int dim, int rank, int *out) {
    int c[MESH_NDIMS];
    mesh_coords(s, rank, c);
    for (int i = 0; i < s->size[dim]; i++) {
        c[dim] = i;
        out[i] = mesh_rank_of(s, c);
    }
    return s->size[dim];
}

/* Members of the dp x cp plane through `rank` with plane index j (dp major)
 * satisfying j in [j0, j0 + count * stride) step stride. */
static int members_plane(const MeshShape *s, int rank, int j0, int stride, int count, int *out) {
    int c[MESH_NDIMS];
    mesh_coords(s, rank, c);
    int cp = s->size[MESH_CP];
    for (int i = 0; i < count; i++) {
        int j = j0 + i * stride;
        c[MESH_DP] = j / cp;
        c[MESH_CP] = j % cp;
        out[i] = mesh_rank_of(s, c);
    }
    return count;
}

int mesh_members(const MeshShape *s, MeshGroupKind kind, int rank, int *out) {
    int c[MESH_NDIMS];
    mesh_coords(s, rank, c);
    int dpcp = s->size[MESH_DP] * s->size[MESH_CP];
    int j = c[MESH_DP] * s->size[MESH_CP] + c[MESH_CP];
    int ep = s->ep > 0 ? s->ep : 1;
    switch (kind) {
    case MESH_GROUP_PP: return members_along(s, MESH_PP, rank, out);
    case MESH_GROUP_DP: return members_along(s, MESH_DP, rank, out);
    case MESH_GROUP_CP: return members_along(s, MESH_CP, rank, out);
    case MESH_GROUP_TP: return members_along(s, MESH_TP, rank, out);
    case MESH_GROUP_DPCP: return members_plane(s, rank, 0, 1, dpcp, out);
    case MESH_GROUP_EP: return members_plane(s, rank, (j / ep) * ep, 1, ep, out);
    case MESH_GROUP_EDP: return members_plane(s, rank, j % ep, ep, dpcp / ep, out);
    case MESH_GROUP_WORLD:
    default: {
        int w = mesh_world(s);
        for (int i = 0; i < w; i++) out[i] = i;
        return w;
    }
    }
}

const char *mesh_group_name(MeshGroupKind kind) {
    static const char *names[MESH_NGROUPS] = {"pp", "dp", "cp", "tp", "dpcp", "ep", "edp", "world"};
    return kind >= 0 && kind < MESH_NGROUPS ? names[kind] : "?";
}

void mesh_describe(const MeshShape *s, char *buf, size_t n) {
    snprintf(buf, n, "pp %d x dp %d x cp %d x tp %d (ep %d)", s->size[MESH_PP], s->size[MESH_DP], s->size[MESH_CP],
             s->size[MESH_TP], s->ep);
}

void mesh_init(Mesh *m, const MeshShape *s) {
    memset(m, 0, sizeof *m);
    CommGroup *world = comm_world();
    m->shape = *s;
    m->world = world->size;
    m->rank = world->rank;
    if (mesh_world(s) != m->world)
        kiln_fail(KILN_EXIT_USAGE, "mesh %d ranks, world %d: plan the mesh with mesh_plan first", mesh_world(s),
                  m->world);
    mesh_coords(s, m->rank, m->coord);
    int ep = s->ep > 0 ? s->ep : 1;
    int j = m->coord[MESH_DP] * s->size[MESH_CP] + m->coord[MESH_CP];
    m->ep_rank = j % ep;
    m->edp_rank = j / ep;
    int *mem = xmalloc((size_t)m->world * sizeof(int));
    for (int k = 0; k < MESH_NGROUPS; k++) {
        if (k == MESH_GROUP_WORLD) {
            m->group[k] = *world; /* a view: members and communicator stay comm's */
            continue;
        }
        int n = mesh_members(s, (MeshGroupKind)k, m->rank, mem);
        int key = 0;
        for (int i = 0; i < n; i++)
            if (mem[i] == m->rank) key = i;
        /* Every rank of a group computes the same first member: a color that
         * needs no agreement beyond the shape. */
        comm_split(world, mem[0], key, mesh_group_name((MeshGroupKind)k), &m->group[k]);
        if (m->group[k].size != n || m->group[k].rank != key)
            kiln_fail(KILN_EXIT_RUNTIME, "rank %d: group '%s' came out as rank %d of %d, expected %d of %d", m->rank,
                      mesh_group_name((MeshGroupKind)k), m->group[k].rank, m->group[k].size, key, n);
    }
    free(mem);
}

void mesh_free(Mesh *m) {
    for (int k = 0; k < MESH_NGROUPS; k++)
        if (k != MESH_GROUP_WORLD) comm_group_free(&m->group[k]);
    memset(m, 0, sizeof *m);
}

/* ---------------------------------------------------------------- placements */

int placement_local_shape(const Placement *p, int group_size, int group_rank, int ndim, const int *shape,
                          int *local, int *offset, char *err, size_t errn) {
    for (int i = 0; i < ndim; i++) local[i] = shape[i];
    *offset = 0;
    if (p->kind == PLACEMENT_REPLICATED) return 0;
    if (p->dim < 0 || p->dim >= ndim) {
        snprintf(err, errn, "placement shards dimension %d of a %d-dimensional tensor", p->dim, ndim);
        return -1;
    }
    if (group_size < 1 || shape[p->dim] % group_size != 0) {
        snprintf(err, errn, "dimension %d of size %d does not split evenly over the %d ranks of group '%s'", p->dim,
                 shape[p->dim], group_size, mesh_group_name(p->group));
        return -1;
    }
    local[p->dim] = shape[p->dim] / group_size;
    *offset = group_rank * local[p->dim];
    return 0;
}

void placement_describe(const Placement *p, char *buf, size_t n) {
    if (p->kind == PLACEMENT_REPLICATED) snprintf(buf, n, "replicated");
    else snprintf(buf, n, "sharded(dim %d over %s)", p->dim, mesh_group_name(p->group));
}

/* ---------------------------------------------------------------- flat shards */

ShardRange mesh_shard_range(size_t n, int k, int r, size_t align) {
    ShardRange s;
    if (align < 1) align = 1;
    if (k < 1) k = 1;
    size_t block = (n + (size_t)k - 1) / (size_t)k;
    block = (block + align - 1) / align * align;
    s.block = block;
    s.padded_n = block * (size_t)k;
    s.start = block * (size_t)r;
    s.lo = s.start < n ? s.start : n;
    s.hi = s.start + block < n ? s.start + block : n;
    return s;
}
