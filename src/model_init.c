/* model_init: a model's initial weights (model_init_weights), the values of
 * one xoshiro256** stream drawn in the whole table's listing order, on all
 * threads and only where this rank keeps them. Never allocates arenas or
 * touches anything but the parameter values. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "util.h"

/* Normal k of the whole table (listing order, every stage's, tp rank's and
 * expert's tensors counted) is rng_normal's draw after 2k rng_u64 calls of
 * the seed's stream, as one sequential pass draws them. A rank jumps to each
 * run of values it keeps, cut into pieces of at most INIT_PIECE values that
 * threads draw from their own copies of the stream: the sequential pass's
 * bits on any thread count, without drawing what other ranks keep. */
#define INIT_PIECE 65536
#define INIT_JUMPS 4

typedef struct {
    Rng at;     /* the stream at the piece's first value */
    float *dst; /* (n) */
    size_t n;
    float std;
} InitPiece;

typedef struct {
    Rng start, at; /* the stream at normal 0 and at normal pos */
    uint64_t pos;
    RngJump jump[INIT_JUMPS]; /* recent distances, round robin: a tensor's pieces and rows repeat theirs */
    uint64_t jump_n[INIT_JUMPS];
    int next;
    InitPiece *piece;
    size_t n, cap;
} InitPlan;

/* the plan's stream to normal q */
static void plan_seek(InitPlan *p, uint64_t q) {
    if (q < p->pos) p->at = p->start, p->pos = 0; /* behind: from the start (listing order never goes back) */
    uint64_t d = 2 * (q - p->pos);
    if (!d) return;
    int k = 0;
    while (k < INIT_JUMPS && p->jump_n[k] != d) k++;
    if (k == INIT_JUMPS) {
        k = p->next, p->next = (k + 1) % INIT_JUMPS;
        rng_jump_make(&p->jump[k], d);
        p->jump_n[k] = d;
    }
    rng_jump_apply(&p->at, &p->jump[k]);
    p->pos = q;
}

/* normals [q, q + n) of the stream, times std, into dst[0..n) */
static void plan_add(InitPlan *p, uint64_t q, size_t n, float std, float *dst) {
    for (size_t j = 0; j < n; j += INIT_PIECE) {
        plan_seek(p, q + j);
        if (p->n == p->cap) {
            p->cap = p->cap ? 2 * p->cap : 256;
            p->piece = xrealloc(p->piece, p->cap * sizeof(InitPiece));
        }
        p->piece[p->n++] = (InitPiece){p->at, dst + j, n - j < INIT_PIECE ? n - j : INIT_PIECE, std};
    }
}

/* Table tensor p (model tensor idx, host values dst), whose first drawn
 * value is normal `base` and whose leading n elements are drawn: this rank's
 * tp boxes (the whole tensor without tp) as runs contiguous in the stream, a
 * box of whole rows one run, else one per row. Past n (the padded
 * vocabulary rows) nothing is drawn and the values stay zero. */
static void plan_tensor(InitPlan *plan, const Model *m, int idx, const ArchTensor *p, uint64_t base, size_t n,
                        float std, float *dst) {
    ModelBox bx[MODEL_MAX_BOXES];
    int nb = model_tp_boxes(m, idx, bx);
    size_t g1 = p->ndim == 2 ? (size_t)p->shape[1] : 1;
    for (int k = 0; k < nb; k++) {
        size_t w = bx[k].c1 - bx[k].c0, rows = bx[k].c0 == 0 && w == g1 ? bx[k].r1 - bx[k].r0 : 1;
        for (size_t r = bx[k].r0; r < bx[k].r1; r += rows) {
            size_t g = r * g1 + bx[k].c0, len = rows * w;
            if (g >= n) break;
            plan_add(plan, base + g, len < n - g ? len : n - g, std, dst + bx[k].at + (r - bx[k].r0) * w);
        }
    }
}

/* A normally drawn tensor's std (0.02, scaled by resid_scale for the
 * residual projections) and how many of its leading elements are drawn:
 * the padded vocabulary rows stay zero, since no token maps to them. */
static size_t normal_extent(const Model *m, const ArchTensor *p, float resid_scale, float *std) {
    *std = p->init == INIT_NORMAL_RESID ? 0.02f * resid_scale : 0.02f;
    size_t rows = (size_t)p->shape[0];
    if (p->role == ROLE_TOK_EMB || p->role == ROLE_HEAD_W) rows = (size_t)m->gshape.vocab_size;
    return rows * (p->ndim == 2 ? (size_t)p->shape[1] : 1);
}

void model_init_weights(Model *m, uint64_t seed) {
    float *host = xcalloc(m->num_params, sizeof(float));
    InitPlan plan = {0};
    rng_seed(&plan.start, seed);
    plan.at = plan.start;
    float resid_scale = 1.0f / sqrtf(2.0f * (float)m->shape.n_layer);
    int all, mine = 0;
    ArchTensor *t = arch_tensors(&m->gshape, 0, &all); /* global shapes: the stream counts whole tensors */
    uint64_t base = 0; /* the stream's normal at table tensor i's first value */
    for (int i = 0; i < all; i++) {
        const ArchTensor *p = &t[i];
        int own = mine < m->num_tensors && !strcmp(m->params[mine].name, p->name), idx = own ? mine++ : -1;
        float *w = own ? host + m->params[idx].offset : NULL, std = 0.0f;
        size_t n = p->init == INIT_NORMAL || p->init == INIT_NORMAL_RESID ? normal_extent(m, p, resid_scale, &std) : 0;
        if (own && n) plan_tensor(&plan, m, idx, p, base, n, std, w);
        /* norm gains, which tp never splits (arch_tp_split): every local value is 1 */
        for (size_t j = 0; own && p->init == INIT_ONES && j < m->params[idx].numel; j++) w[j] = 1.0f;
        /* INIT_ZEROS: biases stay zero */
        base += n;
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (long k = 0; k < (long)plan.n; k++) {
        const InitPiece *q = &plan.piece[k];
        Rng r = q->at;
        for (size_t j = 0; j < q->n; j++) q->dst[j] = q->std * rng_normal(&r);
    }
    free(plan.piece);
    free(t);
    model_params_from_host(m, host);
    free(host);
}
