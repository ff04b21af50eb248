/* init_ref.h: the sequential draw model_init_weights must reproduce, kept as
 * it was before the draw was threaded and made to jump (test_model_init
 * compares against it, bench_init times it): one xoshiro256** stream, every
 * tensor of the whole table in listing order, one rng_normal per value, a
 * rank keeping its tp boxes of the tensors it holds. */
#ifndef KILN_TEST_INIT_REF_H
#define KILN_TEST_INIT_REF_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "util.h"

/* The index of m's tensor `name`, or -1 if m does not hold it. */
static int init_ref_held(const Model *m, const char *name) {
    for (int k = 0; k < m->num_tensors; k++)
        if (!strcmp(m->params[k].name, name)) return k;
    return -1;
}

/* Every value of the whole table drawn in order; ref[i] the global tensor
 * of table row i where m holds it (padded vocabulary rows zero), else NULL
 * (drawn and dropped, as every rank did). */
static float **init_ref_draw(const Model *m, uint64_t seed, int *all) {
    ArchTensor *t = arch_tensors(&m->gshape, 0, all);
    float **ref = (float **)xcalloc((size_t)*all, sizeof(float *));
    Rng rng;
    rng_seed(&rng, seed);
    float resid_scale = 1.0f / sqrtf(2.0f * (float)m->gshape.n_layer);
    for (int i = 0; i < *all; i++) {
        const ArchTensor *p = &t[i];
        float *w = init_ref_held(m, p->name) >= 0 ? (float *)xcalloc(p->numel, sizeof(float)) : NULL;
        ref[i] = w;
        for (size_t j = 0; w && p->init == INIT_ONES && j < p->numel; j++) w[j] = 1.0f;
        if (p->init != INIT_NORMAL && p->init != INIT_NORMAL_RESID) continue;
        float std = p->init == INIT_NORMAL_RESID ? 0.02f * resid_scale : 0.02f;
        size_t rows = p->role == ROLE_TOK_EMB || p->role == ROLE_HEAD_W ? (size_t)m->gshape.vocab_size
                                                                         : (size_t)p->shape[0];
        size_t n = rows * (p->ndim == 2 ? (size_t)p->shape[1] : 1);
        for (size_t j = 0; j < n; j++) {
            float x = std * rng_normal(&rng);
            if (w) w[j] = x;
        }
    }
    free(t);
    return ref;
}

static void init_ref_free(float **ref, int all) {
    for (int i = 0; i < all; i++) free(ref[i]);
    free(ref);
}

/* Every local tensor of m against its tp boxes of ref (the rest of a local
 * tensor, a rank's padded vocabulary rows, zero): 1 if all are equal, else 0
 * with the first differing tensor's name in bad. */
static int init_ref_same(const Model *m, float **ref, char *bad, size_t cap) {
    int all;
    ArchTensor *t = arch_tensors(&m->gshape, 0, &all);
    float *host = (float *)xmalloc(m->num_params * sizeof(float));
    model_params_to_host(m, host);
    int ok = m->num_tensors > 0;
    for (int i = 0; i < all && ok; i++) {
        int k = init_ref_held(m, t[i].name);
        if (k < 0) continue;
        const ParamInfo *p = &m->params[k];
        float *want = (float *)xcalloc(p->numel, sizeof(float));
        ModelBox bx[MODEL_MAX_BOXES];
        int nb = model_tp_boxes(m, k, bx);
        size_t g1 = t[i].ndim == 2 ? (size_t)t[i].shape[1] : 1;
        for (int b = 0; b < nb; b++)
            for (size_t r = bx[b].r0; r < bx[b].r1; r++)
                for (size_t c = bx[b].c0; c < bx[b].c1; c++)
                    want[bx[b].at + (r - bx[b].r0) * (bx[b].c1 - bx[b].c0) + (c - bx[b].c0)] = ref[i][r * g1 + c];
        if (memcmp(want, host + p->offset, p->numel * sizeof(float))) {
            ok = 0;
            snprintf(bad, cap, "%s", p->name);
        }
        free(want);
    }
    free(t);
    free(host);
    return ok;
}

#endif
