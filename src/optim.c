/* optim: schedules, clipping, AdamW, Lion and Muon's per-matrix steps. The update arithmetic is the
 * backend's (adamw_update, lion_update, sumsq); this file decides what to
 * call with which numbers. */
#include "optim.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "arch.h"
#include "clip.h"
#include "util.h"

int optim_sched_kind(const char *name) {
    if (strcmp(name, "constant") == 0) return SCHED_CONSTANT;
    if (strcmp(name, "linear") == 0) return SCHED_LINEAR;
    if (strcmp(name, "cosine") == 0) return SCHED_COSINE;
    if (strcmp(name, "wsd") == 0) return SCHED_WSD;
    return -1;
}

float optim_lr(const Schedule *s, int step) {
    double lr = s->lr, floor = s->lr * (double)s->min_lr_ratio;
    if (step < s->warmup_steps) return (float)(lr * (step + 1) / s->warmup_steps);
    if (s->kind == SCHED_CONSTANT) return (float)lr;
    int start = s->warmup_steps;
    if (s->kind == SCHED_WSD) {
        /* stable at the peak, then a linear decay over the last decay_ratio of
         * all steps (never into the warmup) */
        int decay_steps = (int)lround((double)s->decay_ratio * s->steps);
        int decay_start = s->steps - decay_steps;
        if (decay_start < s->warmup_steps) decay_start = s->warmup_steps;
        if (step < decay_start) return (float)lr;
        start = decay_start;
    }
    /* progress runs 0 -> 1 from the first post-warmup step to the last step,
     * so the final step trains at exactly the floor */
    int span = s->steps - 1 - start;
    double p = span > 0 ? (double)(step - start) / span : 1.0;
    if (p > 1.0) p = 1.0;
    if (p < 0.0) p = 0.0;
    double frac = s->kind == SCHED_COSINE ? 0.5 * (1.0 + cos(M_PI * p)) : 1.0 - p;
    return (float)(floor + (lr - floor) * frac);
}

void optim_init(AdamW *o, const Backend *be, size_t n, size_t n_decay, float beta1, float beta2, float eps,
                float weight_decay, float grad_clip) {
    optim_init_shard(o, be, n, n_decay, 0, n, beta1, beta2, eps, weight_decay, grad_clip);
}

size_t optim_state_bytes(const char *name) {
    if (strcmp(name, "fp32") == 0) return 4;
    if (strcmp(name, "bf16") == 0) return 2;
    return 0;
}

void optim_init_shard(AdamW *o, const Backend *be, size_t n, size_t n_decay, size_t lo, size_t hi, float beta1,
                      float beta2, float eps, float weight_decay, float grad_clip) {
    optim_init_shard_dtype(o, be, n, n_decay, lo, hi, beta1, beta2, eps, weight_decay, grad_clip, 0, 0);
}

void optim_init_shard_dtype(AdamW *o, const Backend *be, size_t n, size_t n_decay, size_t lo, size_t hi,
                            float beta1, float beta2, float eps, float weight_decay, float grad_clip,
                            int state_bf16, uint64_t seed) {
    memset(o, 0, sizeof *o);
    o->state_bytes = state_bf16 ? 2 : 4;
    o->param_bytes = 4;
    o->seed = seed;
    o->lo = lo;
    o->hi = hi;
    o->be = be;
    o->n = n;
    o->n_decay = n_decay;
    o->beta1 = beta1;
    o->beta2 = beta2;
    o->eps = eps;
    o->weight_decay = weight_decay;
    o->grad_clip = grad_clip;
    /* at least one element: a rank whose shard is empty still has valid pointers */
    o->m = be->alloc((hi - lo + 1) * o->state_bytes);
    o->v = be->alloc((hi - lo + 1) * o->state_bytes);
}

void optim_set_params_bf16(AdamW *o) {
    if (!o->be->adamw_update_p16)
        kiln_fail(KILN_EXIT_USAGE, "key 'precision.master': bf16: the %s backend has no bf16 parameter update; use "
                  "precision.master: fp32", o->be->name);
    o->param_bytes = 2;
    o->copy = NULL; /* the parameters are the compute copy */
}

int optim_kind(const char *name) {
    if (strcmp(name, "adamw") == 0) return OPTIM_ADAMW;
    if (strcmp(name, "lion") == 0) return OPTIM_LION;
    if (strcmp(name, "muon") == 0) return OPTIM_MUON;
    if (strcmp(name, "adafactor") == 0) return OPTIM_ADAFACTOR;
    return -1;
}

float optim_muon_scale(const char *kind, int rows, int cols) {
    if (strcmp(kind, "spectral") == 0) return (float)sqrt(fmax(1.0, (double)rows / cols));
    if (strcmp(kind, "match_adamw") == 0) return (float)(0.2 * sqrt((double)(rows > cols ? rows : cols)));
    return -1.0f;
}

int optim_muon_role(int r) {
    return r == ROLE_QKV_W || r == ROLE_K_W || r == ROLE_V_W || r == ROLE_O_W || r == ROLE_FC_W || r == ROLE_UP_W ||
           r == ROLE_DOWN_W || r == ROLE_SHARED_GATE_W || r == ROLE_SHARED_UP_W || r == ROLE_SHARED_DOWN_W ||
           r == ROLE_EXPERT_GATE_W || r == ROLE_EXPERT_UP_W || r == ROLE_EXPERT_DOWN_W;
}

size_t optim_muon_work_floats(int rows, int cols) {
    size_t r = (size_t)rows, c = (size_t)cols, a = r < c ? r : c;
    return 2 * r * c + 2 * a * a + 256;
}

static int mat_cmp(const void *a, const void *b) {
    size_t x = ((const OptimMatrix *)a)->off, y = ((const OptimMatrix *)b)->off;
    return x < y ? -1 : x > y;
}

/* Each owner's matrices back to back in optim's order: mom is where a
 * matrix's momentum starts in its owner's mm; this rank's mm (mm_len) zero. */
static void muon_place_momentum(AdamW *o, int rank) {
    int owners = 1;
    for (int i = 0; i < o->nmat; i++) owners = o->mats[i].owner >= owners ? o->mats[i].owner + 1 : owners;
    size_t *len = xcalloc((size_t)owners, sizeof(size_t));
    for (int i = 0; i < o->nmat; i++) {
        OptimMatrix *x = &o->mats[i];
        x->mom = len[x->owner];
        len[x->owner] += (size_t)x->rows * x->cols;
    }
    o->mm_len = rank < owners ? len[rank] : 0;
    free(len);
    if (o->mm) o->be->free(o->mm);
    o->mm = o->be->alloc((o->mm_len + 1) * sizeof(float)); /* one at least: a rank may own none */
}

void optim_set_muon(AdamW *o, const OptimMatrix *mats, int nmat, float momentum, int ns_steps) {
    const Backend *be = o->be;
    if (!be->newton_schulz || !be->muon_momentum || !be->muon_apply)
        kiln_fail(KILN_EXIT_USAGE, "key 'optim.name': muon: the %s backend has no Newton-Schulz op; use "
                  "device: cpu, or optim.name adamw or lion", be->name);
    if (o->state_bytes != 4 || o->param_bytes != 4)
        kiln_fail(KILN_EXIT_USAGE, "key 'optim.name': muon keeps fp32 state and parameters; use "
                  "precision.optim_state: fp32 and precision.master: fp32");
    o->kind = OPTIM_MUON;
    o->copy = NULL; /* its matrices' updates write no compute copy */
    o->momentum = momentum;
    o->ns_steps = ns_steps;
    o->nmat = nmat;
    o->mats = xmalloc((size_t)(nmat > 0 ? nmat : 1) * sizeof *mats);
    if (nmat > 0) memcpy(o->mats, mats, (size_t)nmat * sizeof *mats);
    qsort(o->mats, (size_t)nmat, sizeof *mats, mat_cmp);
    size_t most = 1, work = 1;
    for (int i = 0; i < nmat; i++) {
        OptimMatrix *x = &o->mats[i];
        if (!x->grows) x->grows = x->rows, x->gcols = x->cols, x->tp_dim = -1; /* no tp: the part is all */
        x->owner = 0;
        size_t r = (size_t)x->grows, c = (size_t)x->gcols, w = optim_muon_work_floats(x->grows, x->gcols);
        if (r * c > most) most = r * c;
        if (w > work) work = w;
    }
    muon_place_momentum(o, 0);
    o->u = be->alloc(most * sizeof(float));
    o->ns_work = be->alloc(work * sizeof(float));
}

void optim_muon_own(AdamW *o, const int *owner, int rank) {
    for (int i = 0; i < o->nmat; i++) o->mats[i].owner = owner[i];
    muon_place_momentum(o, rank);
    o->muon_dist = 1;
    o->muon_rank = rank;
}

int optim_muon_owned(const AdamW *o, int k) { return o->mats[k].owner == o->muon_rank; }

void optim_muon_momentum(AdamW *o, int k, const float *g, float grad_scale, float *out) {
    const OptimMatrix *x = &o->mats[k];
    o->be->muon_momentum(out, o->mm + x->mom, g, (size_t)x->rows * x->cols, o->momentum, grad_scale);
}

void optim_muon_orthogonalise(AdamW *o, float *x, int rows, int cols) {
    o->be->newton_schulz(x, rows, cols, o->ns_steps, o->ns_work);
}

void optim_muon_apply(const AdamW *o, int k, float *params, const float *O, size_t n, float lr) {
    const OptimMatrix *x = &o->mats[k];
    o->be->muon_apply(params, O, n, lr, x->scale, x->decay ? o->weight_decay : 0.0f);
}

int optim_muon_covers(const AdamW *o, size_t off) {
    int lo = 0, hi = o->nmat; /* the last matrix starting at or before off */
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (o->mats[mid].off <= off) lo = mid;
        else hi = mid;
    }
    if (o->nmat == 0 || o->mats[lo].off > off) return 0;
    return off < o->mats[lo].off + (size_t)o->mats[lo].rows * o->mats[lo].cols;
}

void optim_zero_state(AdamW *o) {
    if (o->m) o->be->zero(o->m, (o->hi - o->lo) * o->state_bytes);
    if (o->v) o->be->zero(o->v, (o->hi - o->lo) * o->state_bytes);
    if (o->mm) o->be->zero(o->mm, o->mm_len * sizeof(float));
    o->t = 0;
}

void optim_set_adafactor(AdamW *o, float beta1) {
    const Backend *be = o->be;
    if (!be->adafactor_stats || !be->adafactor_ema || !be->adafactor_second || !be->adafactor_usq ||
        !be->adafactor_apply)
        kiln_fail(KILN_EXIT_USAGE, "key 'optim.name': adafactor: the %s backend has no Adafactor ops", be->name);
    if (o->state_bytes != 4 || o->param_bytes != 4)
        kiln_fail(KILN_EXIT_USAGE, "key 'optim.name': adafactor keeps fp32 state and parameters; use "
                  "precision.optim_state: fp32 and precision.master: fp32");
    o->kind = OPTIM_ADAFACTOR;
    o->copy = NULL; /* adafactor.c's updates write no compute copy */
    o->beta1 = beta1;
    be->free(o->v);
    o->v = NULL;
    if (beta1 <= 0.0f) be->free(o->m), o->m = NULL;
}

void optim_set_lion(AdamW *o, float beta1, float beta2) {
    if (o->state_bytes != 4 || o->param_bytes != 4)
        kiln_fail(KILN_EXIT_USAGE, "key 'optim.name': lion keeps fp32 state and parameters; use "
                  "precision.optim_state: fp32 and precision.master: fp32");
    o->kind = OPTIM_LION;
    o->beta1 = beta1;
    o->beta2 = beta2;
    o->be->free(o->v);
    o->v = NULL;
}

void optim_free(AdamW *o) {
    if (o->be) {
        if (o->m) o->be->free(o->m);
        if (o->v) o->be->free(o->v);
        if (o->u) o->be->free(o->u), o->be->free(o->ns_work);
        if (o->mm) o->be->free(o->mm);
        if (o->st) o->be->free(o->st);
    }
    free(o->mats);
    memset(o, 0, sizeof *o);
}

OptimStepInfo optim_step(AdamW *o, void *params, const float *grads, float lr) {
    return optim_step_norm(o, (char *)params + o->lo * o->param_bytes, grads + o->lo, lr,
                           sqrt(o->be->sumsq(grads, o->n)));
}

/* The norm check and clipping factor shared by the step functions. */
OptimStepInfo optim_step_begin(AdamW *o, double grad_norm) {
    OptimStepInfo info = {0};
    info.grad_norm = grad_norm;
    info.grad_scale = 1.0f;
    if (!isfinite(info.grad_norm)) {
        info.nonfinite = 1;
        return info;
    }
    info.grad_scale = clip_scale(info.grad_norm, o->grad_clip); /* the device's rule too (clip.h) */
    o->t++;
    return info;
}

/* adamw_update on state elements [k, k + n), in the state's and the
 * parameters' dtypes; params and grads point at element k. The bf16 rounding
 * is keyed by element lo + k: the arena element without ZeRO and with ZeRO-1
 * (the same bits on any number of ranks), the offset in the rank's shard
 * with ZeRO-2/3 (unbiased all the same; the bits then follow the layout). */
static void update_range(AdamW *o, void *params, const float *grads, size_t k, size_t n, float lr, float wd,
                         float grad_scale) {
    const StepScalars *st = o->st_now;
    /* the compute copy at the same arena element (set only with lo 0: optim_set_copy) */
    void *copy = o->copy ? (char *)o->copy + (o->lo + k) * o->be->act_bytes() : NULL;
    if (o->kind == OPTIM_LION)
        o->be->lion_update(params, grads, (float *)o->m + k, n, lr, o->beta1, o->beta2, wd, grad_scale, st, copy);
    else if (o->param_bytes == 2)
        o->be->adamw_update_p16(params, grads, (char *)o->m + k * o->state_bytes, (char *)o->v + k * o->state_bytes,
                                o->state_bytes, n, lr, o->beta1, o->beta2, o->eps, wd, grad_scale, o->t, o->seed,
                                o->lo + k, st);
    else if (o->state_bytes == 2)
        o->be->adamw_update_bf16(params, grads, (uint16_t *)o->m + k, (uint16_t *)o->v + k, n, lr, o->beta1,
                                 o->beta2, o->eps, wd, grad_scale, o->t, o->seed, o->lo + k, st, copy);
    else
        o->be->adamw_update(params, grads, (float *)o->m + k, (float *)o->v + k, n, lr, o->beta1, o->beta2,
                            o->eps, wd, grad_scale, o->t, st, copy);
}

/* The update of the whole range [lo, hi), split at n_decay; params and
 * grads point at element lo. */
static void update_all(AdamW *o, void *params, const float *grads, float lr, float grad_scale) {
    size_t n = o->hi - o->lo;
    /* decayed elements of the range: [lo, min(hi, n_decay)) */
    size_t d = o->n_decay > o->lo ? o->n_decay - o->lo : 0;
    if (d > n) d = n;
    if (d > 0) update_range(o, params, grads, 0, d, lr, o->weight_decay, grad_scale);
    if (n > d) update_range(o, (char *)params + d * o->param_bytes, grads + d, d, n - d, lr, 0.0f, grad_scale);
}

int optim_set_copy(AdamW *o, void *copy) {
    int ok = copy && (o->kind == OPTIM_ADAMW || o->kind == OPTIM_LION) && o->param_bytes == 4 && o->lo == 0 &&
             o->hi == o->n;
    o->copy = ok ? copy : NULL;
    return ok;
}

StepScalars *optim_scalars(AdamW *o) {
    if (!o->st) o->st = o->be->alloc(sizeof *o->st); /* zeroed */
    return o->st;
}

OptimStepInfo optim_step_device(AdamW *o, void *params, const float *grads, float lr, int micro, float *loss) {
    if ((o->kind != OPTIM_ADAMW && o->kind != OPTIM_LION) || o->lo != 0 || o->hi != o->n)
        kiln_fail(KILN_EXIT_RUNTIME, "optim: the device step takes AdamW or Lion over the whole arena");
    const Backend *be = o->be;
    StepScalars *st = optim_scalars(o), h;
    be->sumsq_acc(&st->sumsq, grads, o->n);
    be->step_scalars(st, micro, o->grad_clip);
    o->t++; /* taken back below if the device skipped the step */
    o->st_now = st;
    update_all(o, params, grads, lr, 1.0f);
    o->st_now = NULL;
    be->to_host(&h, st, sizeof h); /* the step's one wait: after the update, so it also times it */
    be->zero(st, sizeof *st);
    if (h.skip) o->t--;
    if (loss) *loss = h.loss_mean;
    return (OptimStepInfo){h.norm, h.scale, h.skip};
}

OptimStepInfo optim_step_segments(AdamW *o, void *params, const float *grads, const OptimSegment *seg, int nseg,
                                  float lr, double grad_norm) {
    if ((o->kind == OPTIM_MUON && !o->muon_dist) || o->kind == OPTIM_ADAFACTOR)
        kiln_fail(KILN_EXIT_RUNTIME, "optim: %s over sharded segments needs its own module (muon.c, adafactor.c)",
                  o->kind == OPTIM_MUON ? "muon" : "adafactor");
    if (o->copy) kiln_fail(KILN_EXIT_RUNTIME, "optim: the fused compute copy is for whole-arena steps, not segments");
    OptimStepInfo info = optim_step_begin(o, grad_norm);
    if (info.nonfinite) return info;
    for (int i = 0; i < nseg; i++) {
        /* Muon: the runs of the segment between its matrices (muon.c's); a
         * segment may hold several tensors (ZeRO-1's blocks under ep) */
        size_t a = seg[i].arena, end = a + seg[i].n;
        while (a < end) {
            size_t b = end, d = a - seg[i].arena, at = seg[i].at + d;
            int skip = 0;
            for (int j = 0; o->kind == OPTIM_MUON && j < o->nmat; j++) {
                size_t lo = o->mats[j].off, hi = lo + (size_t)o->mats[j].rows * o->mats[j].cols;
                if (hi <= a) continue;
                skip = lo <= a;
                b = skip ? (hi < end ? hi : end) : (lo < end ? lo : end);
                break;
            }
            if (!skip)
                update_range(o, (char *)params + at * o->param_bytes, grads + at, seg[i].off + d, b - a, lr,
                             seg[i].decay ? o->weight_decay : 0.0f, info.grad_scale);
            a = b;
        }
    }
    return info;
}

/* AdamW on arena elements [a, b) inside [lo, hi), split at n_decay;
 * params and grads point at arena element lo. */
static void adamw_span(AdamW *o, float *params, const float *grads, size_t a, size_t b, float lr, float grad_scale) {
    size_t d = o->n_decay < a ? a : o->n_decay > b ? b : o->n_decay, lo = o->lo;
    if (d > a) update_range(o, params + (a - lo), grads + (a - lo), a - lo, d - a, lr, o->weight_decay, grad_scale);
    if (b > d) update_range(o, params + (d - lo), grads + (d - lo), d - lo, b - d, lr, 0.0f, grad_scale);
}

/* Muon's step on [lo, hi): AdamW on the elements between the matrices; and,
 * while every matrix is local (no muon.c: lo 0, hi n), per matrix the
 * Nesterov momentum, Newton-Schulz of the look-ahead and the scaled step
 * with decoupled decay. */
static void muon_step(AdamW *o, float *params, const float *grads, float lr, float grad_scale) {
    if (!o->muon_dist && (o->lo != 0 || o->hi != o->n))
        kiln_fail(KILN_EXIT_RUNTIME, "optim: muon on a shard of the arena needs muon.c (muon_dist_init)");
    size_t at = o->lo;
    for (int i = 0; i < o->nmat; i++) {
        const OptimMatrix *x = &o->mats[i];
        size_t n = (size_t)x->rows * x->cols, end = x->off + n;
        if (end <= o->lo || x->off >= o->hi) continue;
        if (x->off > at) adamw_span(o, params, grads, at, x->off, lr, grad_scale);
        at = end < o->hi ? end : o->hi;
        if (o->muon_dist) continue;
        optim_muon_momentum(o, i, grads + x->off, grad_scale, o->u);
        optim_muon_orthogonalise(o, o->u, x->rows, x->cols);
        optim_muon_apply(o, i, params + x->off, o->u, n, lr);
    }
    if (o->hi > at) adamw_span(o, params, grads, at, o->hi, lr, grad_scale);
}

OptimStepInfo optim_step_norm(AdamW *o, void *params, const float *grads, float lr, double grad_norm) {
    if (o->kind == OPTIM_ADAFACTOR)
        kiln_fail(KILN_EXIT_RUNTIME, "optim: adafactor's step is adafactor.c's (adafactor_step)");
    OptimStepInfo info = optim_step_begin(o, grad_norm);
    if (info.nonfinite) return info;
    if (o->kind == OPTIM_MUON) {
        muon_step(o, params, grads, lr, info.grad_scale);
        return info;
    }
    update_all(o, params, grads, lr, info.grad_scale);
    return info;
}
