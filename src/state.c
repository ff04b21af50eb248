/* state: the training run's checkpoint table and its save/resume policy.
 * Names in the table: parameters by their model names ("wte", "h.0.ln_1.weight"),
 * AdamW moments as "optim.m/<name>" and "optim.v/<name>" (Lion: its m alone), and blobs
 * "optim.step", "train.step", "train.tokens", "train.elapsed_s",
 * "data.train.pos", "data.train.state", "rng.train" (rank 0; rank r > 0: "rng.train/rank<r>"),
 * with fp8 delayed scaling "fp8.amax_history" and "fp8.amax_count" (per rank
 * the same way: see state_fp8_resume), "config.yaml". docs/formats.md.
 *
 * Several ranks: each dp rank writes its own share of the parameters and
 * the optimizer state, cut at tensor boundaries into per-tensor ranges: the
 * arena range its ZeRO-1 optimizer owns, one dp-th of it without ZeRO, its
 * block of every unit under ZeRO-2/3 (expert parallelism: see state_open);
 * the blobs come from rank 0. On resume every rank asks for the ranges it
 * needs, so the checkpoint loads on any number of ranks and any ZeRO stage. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "state.h"

#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "adafactor.h"
#include "ckpt_io.h"
#include "ddp.h"
#include "hf.h"
#include "metrics.h"
#include "resume.h"
#include "sround.h"
#include "stop.h"

/* Elements [a, b) of tensor i's local part, stored at ptr (esz bytes each),
 * as entries of the logical (global) tensor: one whole-tensor range, or
 * under tensor parallelism one per box of the part that [a, b) meets. */
static void add_piece(CkptTable *t, const Model *m, int i, const char *name, void *ptr, size_t esz, size_t a,
                      size_t b, CkptCopyFn to_host, CkptCopyFn to_device) {
    const ParamInfo *p = &m->params[i];
    int64_t shape[2] = {p->gshape[0], p->gshape[1]};
    if (p->split.dim < 0) {
        CkptEntry *e = ckpt_add_tensor(t, name, CKPT_F32, p->ndim, shape, a, b, ptr, to_host, to_device);
        e->mem_size = esz == 2 ? 2 : 0;
        return;
    }
    ModelBox bx[MODEL_MAX_BOXES];
    int nb = model_tp_boxes(m, i, bx);
    for (int k = 0; k < nb; k++) {
        size_t n = (bx[k].r1 - bx[k].r0) * (bx[k].c1 - bx[k].c0), x = a > bx[k].at ? a : bx[k].at;
        size_t y = b < bx[k].at + n ? b : bx[k].at + n;
        if (x >= y) continue;
        CkptEntry *e = ckpt_add_tensor(t, name, CKPT_F32, p->ndim, shape, x - bx[k].at, y - bx[k].at,
                                       (char *)ptr + (x - a) * esz, to_host, to_device);
        e->mem_size = esz == 2 ? 2 : 0;
        ckpt_entry_set_box(e, bx[k].r0, bx[k].r1, bx[k].c0, bx[k].c1);
    }
}

/* The copies of fp32 entries: none where the backend's memory is the host's
 * (the CPU backend), so ckpt reads and fills it in place. */
static CkptCopyFn copy_to_host(const Backend *be) { return be->host_mem ? NULL : be->to_host; }
static CkptCopyFn copy_to_device(const Backend *be) { return be->host_mem ? NULL : be->to_device; }

static void add_params(CkptTable *t, Model *m, float *base, const char *prefix) {
    const Backend *be = m->be;
    for (int i = 0; i < m->num_tensors; i++) {
        const ParamInfo *p = &m->params[i];
        char name[CKPT_NAME];
        snprintf(name, sizeof name, "%s%s", prefix, p->name);
        add_piece(t, m, i, name, base + p->offset, 4, 0, p->numel, copy_to_host(be), copy_to_device(be));
    }
}

/* bf16 AdamW moments (precision.optim_state: bf16) and bf16 parameters
 * (precision.master: bf16) travel as fp32: the checkpoint is the same
 * whatever the run's setting, so a run resumes with either. A bf16 run's
 * values widen exactly and round back to themselves, so its own resume is
 * bit-identical; an fp32 checkpoint loads into bf16 rounded to nearest even.
 * These copies convert (CkptCopyFn has no context: the run's one
 * backend is kept here by state_open). to_host widens in place from the back
 * (element i's 4 bytes overwrite bf16 elements >= i, already read); to_device
 * narrows ckpt's scratch buffer in place, rounding to nearest even. */
static const Backend *state_be;
static void bf16_to_host(void *dst, const void *src, size_t bytes) {
    size_t n = bytes / 4;
    unsigned char *d = dst;
    state_be->to_host(dst, src, n * 2);
    for (size_t i = n; i-- > 0;) {
        uint16_t h;
        memcpy(&h, d + 2 * i, 2);
        float f = sround_f32(h);
        memcpy(d + 4 * i, &f, 4);
    }
}
static void bf16_to_device(void *dst, const void *src, size_t bytes) {
    size_t n = bytes / 4;
    backend_f32_to_act((void *)src, src, n, 2);
    state_be->to_device(dst, src, n * 2);
}

/* The part of every tensor inside arena range [lo, hi), stored at base
 * (which holds arena elements from lo on, esz bytes each: 4 fp32, 2 bf16
 * moments): one fp32 entry per tensor that overlaps, with its tensor-local
 * flat range. skip: leave out the tensors Muon updates (their AdamW moments
 * are unused; the momentum is the owner's: add_muon). */
static void add_range(CkptTable *t, Model *m, void *base, size_t esz, size_t lo, size_t hi, const char *prefix,
                      const AdamW *skip) {
    const Backend *be = m->be;
    CkptCopyFn to_host = esz == 2 ? bf16_to_host : copy_to_host(be);
    CkptCopyFn to_device = esz == 2 ? bf16_to_device : copy_to_device(be);
    for (int i = 0; i < m->num_tensors; i++) {
        const ParamInfo *p = &m->params[i];
        if (skip && skip->kind == OPTIM_MUON && optim_muon_covers(skip, p->offset)) continue;
        size_t a = p->offset > lo ? p->offset : lo, b = p->offset + p->numel < hi ? p->offset + p->numel : hi;
        if (a >= b) continue;
        char name[CKPT_NAME];
        snprintf(name, sizeof name, "%s%s", prefix, p->name);
        add_piece(t, m, i, name, (char *)base + (a - lo) * esz, esz, a - p->offset, b - p->offset, to_host,
                  to_device);
    }
}

/* The parameters of arena range [lo, hi): the fp32 master, or with
 * precision.master bf16 the bf16 parameters as fp32 entries (the same names,
 * shapes and format). */
static void add_model_params(CkptTable *t, Model *m, size_t lo, size_t hi) {
    if (m->master_bf16) add_range(t, m, (char *)m->param16 + lo * 2, 2, lo, hi, "", NULL);
    else add_range(t, m, m->param_mem + lo, 4, lo, hi, "", NULL);
}

/* Rank r's share of k of arena range [a, b): what each of k ranks holding
 * the range alike writes of it. */
static void state_share(size_t a, size_t b, int k, int r, size_t *lo, size_t *hi) {
    size_t n = b - a;
    *lo = a + n * (size_t)r / (size_t)k, *hi = a + n * (size_t)(r + 1) / (size_t)k;
}

/* Muon: the momentum of the matrices this rank owns (every layout: the
 * owner's alone), each its tensor's range (a third of GPT-2's c_attn). */
static void add_muon(CkptTable *t, Model *m, const AdamW *o) {
    if (o->kind != OPTIM_MUON) return;
    for (int i = 0; i < o->nmat; i++) {
        const OptimMatrix *x = &o->mats[i];
        if (!optim_muon_owned(o, i)) continue;
        const ParamInfo *p = &m->params[x->tensor];
        size_t n = (size_t)x->rows * x->cols;
        char name[CKPT_NAME];
        snprintf(name, sizeof name, "optim.m/%s", p->name);
        if (p->split.dim >= 0 || n == p->numel) {
            add_piece(t, m, x->tensor, name, o->mm + x->mom, 4, x->toff, x->toff + n, copy_to_host(m->be),
                      copy_to_device(m->be));
            continue;
        }
        /* a third of a replicated fused q|k|v: its rows, a box (one flat range per name and rank) */
        int64_t shape[2] = {p->gshape[0], p->gshape[1]};
        CkptEntry *e = ckpt_add_tensor(t, name, CKPT_F32, 2, shape, 0, n, o->mm + x->mom, copy_to_host(m->be),
                                       copy_to_device(m->be));
        size_t r0 = x->toff / (size_t)x->cols;
        ckpt_entry_set_box(e, r0, r0 + (size_t)x->rows, 0, (size_t)x->cols);
    }
}

/* The optimizer state over arena range [lo, hi) at o's buffers, and Muon's. */
static void add_optim(CkptTable *t, Model *m, const AdamW *o) {
    if (o->m) add_range(t, m, o->m, o->state_bytes, o->lo, o->hi, "optim.m/", o);
    if (o->v) add_range(t, m, o->v, o->state_bytes, o->lo, o->hi, "optim.v/", o);
    add_muon(t, m, o);
}

/* Adafactor's second moments: each factored tensor's row and column
 * averages, 1-D tensors of its global rows and columns (this tp rank's
 * blocks of a split dimension as boxes), and the elementwise moments of this
 * rank's runs of the other tensors, as the AdamW moments. save: what this
 * rank writes (the averages are the same on every dp rank: dp rank 0's;
 * ZeRO 0's runs too; an expert's: EDP rank 0's), else what it loads
 * (everything it holds). */
static void add_adafactor(CkptTable *t, Model *m, const Adafactor *a, int save, const StateMesh *mesh) {
    if (!a) return;
    AdafactorState s;
    for (int k = 0; adafactor_state(a, k, &s); k++) {
        /* an expert-parallel rank's experts: the same on every rank of its EDP group */
        int rank = m->params[s.tensor].offset < m->expert_len ? mesh->edp_rank : mesh->dp_rank;
        if (save && rank > 0 && (s.vector || mesh->zero == 0)) continue;
        char name[CKPT_NAME];
        snprintf(name, sizeof name, "%s%s", s.prefix, m->params[s.tensor].name);
        if (!s.vector) {
            add_piece(t, m, s.tensor, name, s.ptr, 4, s.toff, s.toff + s.len, copy_to_host(m->be),
                      copy_to_device(m->be));
            continue;
        }
        int64_t shape[1] = {(int64_t)s.glen};
        for (int j = 0; j < s.nbox; j++) {
            CkptEntry *e = ckpt_add_tensor(t, name, CKPT_F32, 1, shape, 0, s.n[j], s.ptr + s.at[j],
                                           copy_to_host(m->be), copy_to_device(m->be));
            if (s.part) ckpt_entry_set_box(e, s.g0[j], s.g0[j] + s.n[j], 0, 1);
        }
    }
}

void state_table_add(CkptTable *t, Model *m, AdamW *o) {
    state_be = m->be;
    add_model_params(t, m, 0, m->num_params);
    if (!o) return;
    add_optim(t, m, o);
}

/* ZeRO-2/3: this rank's block of every unit, stored back to back at base
 * (ddp_shard_piece): the fp32 parameter shard or an optimizer moment. */
static void add_unit_blocks(CkptTable *t, Model *m, const Ddp *d, void *base, size_t esz, const char *prefix,
                            const AdamW *skip) {
    DdpPiece p;
    for (int i = 0; ddp_shard_piece(d, i, &p); i++)
        add_range(t, m, (char *)base + p.at * esz, esz, p.lo, p.hi, prefix, skip);
}

int state_init_from(Model *m, const char *dir, int say) {
    if (!ckpt_is_checkpoint(dir)) return 0;
    CkptTable t;
    ckpt_table_init(&t);
    state_table_add(&t, m, NULL);
    char err[2048];
    CkptInfo info;
    if (ckpt_load(dir, &t, &info, err, sizeof err) != 0) kiln_fail(KILN_EXIT_USAGE, "key 'init.from': %s", err);
    ckpt_table_free(&t);
    if (say)
        printf("init.from: parameters of %s (step %lld); optimizer, data position and step start fresh\n", dir,
               (long long)info.step);
    return 1;
}

void state_load_init_from(Model *m, const char *path, int say) {
    if (state_init_from(m, path, say)) return;
    if (hf_init_from(m, path, say)) return; /* under tp each rank takes its part */
    if (m->tp > 1)
        kiln_fail(KILN_EXIT_USAGE, "key 'init.from': %s: llm.c weights load with parallel.tp: 1 (import there, save a "
                  "checkpoint, and start this run from it)", path);
    model_load_llmc(m, path);
}

/* Start-up state when nothing is resumed, or after a corrupt checkpoint was
 * partly loaded and skipped: the same as a fresh run's. */
static void state_fresh(RunState *s, int dirty) {
    const Config *c = s->c;
    if (dirty) {
        Ddp *u = s->mesh.units;
        if (u && !ddp_whole_params(u))
            kiln_fail(KILN_EXIT_RUNTIME, "a checkpoint failed after part of it was loaded into ZeRO-3 shards; "
                                         "start fresh or resume another checkpoint (--resume PATH)");
        if (!c->init_from[0]) model_init_weights(s->m, c->seed);
        else state_load_init_from(s->m, c->init_from, s->mesh.rank == 0);
        if (u) ddp_params_loaded(u);
        optim_zero_state(s->o);
        if (s->mesh.adafactor) adafactor_zero(s->mesh.adafactor);
        data_rewind(s->train);
    }
    /* nothing draws from this stream yet; it is saved and restored so that
     * stochastic ops (dropout, ...) inherit exact resumption for free */
    rng_seed(&s->rng, c->seed ^ 0x7261696e2e726e67ULL ^ (0x9e3779b97f4a7c15ULL * (uint64_t)s->mesh.rank));
    s->step = s->tokens = s->optim_t = 0;
    s->elapsed_base = 0;
}

/* Tensor parallelism, tp ranks > 0: every tp rank holds the same replicated
 * tensors (the entries without a box); tp rank 0 writes them. */
static void drop_replicated(CkptTable *w) {
    int k = 0;
    for (int i = 0; i < w->n; i++)
        if (w->e[i].kind != CKPT_TENSOR || w->e[i].r1) w->e[k++] = w->e[i];
    w->n = k;
}

/* Pipeline parallelism, the last stage of a tied model: its token embedding
 * (parameters and moments) is a copy of the first stage's, which writes it. */
static void drop_tensor(CkptTable *w, const char *name) {
    int k = 0;
    for (int i = 0; i < w->n; i++) {
        const char *n = w->e[i].name, *slash = strrchr(n, '/');
        int match = w->e[i].kind == CKPT_TENSOR && !strcmp(slash ? slash + 1 : n, name);
        if (!match) w->e[k++] = w->e[i];
    }
    w->n = k;
}

/* The loader's position: "data.train.state" (written since mixtures), or the
 * one glob's "data.train.pos" of an older checkpoint. Not in the loaded table:
 * its size follows the checkpoint's sources, and older checkpoints lack it. */
static void state_restore_data(RunState *s, const char *path, int flags, int force) {
    char err[1400];
    size_t len = 0;
    uint64_t *blob = ckpt_read_blob(path, "data.train.state", &len, err, sizeof err);
    if (blob) {
        data_set_state(s->train, blob, len / sizeof(uint64_t), force, s->data_note, sizeof s->data_note);
        free(blob);
        return;
    }
    if (!strstr(err, "no entry")) kiln_fail(KILN_EXIT_USAGE, "--resume %s: %s", path, err);
    DataPos pos = {s->data_pos[0], s->data_pos[1]};
    if (!(flags & RESUME_DATA_CHANGED)) {
        data_set_pos(s->train, pos);
        return;
    }
    /* --force with another data.train: the old position continues a single
     * new glob (the next epoch if past its samples); a mixture starts over */
    if (data_num_sources(s->train) == 1) {
        if (pos.index >= data_num_samples(s->train)) pos = (DataPos){pos.epoch + 1, 0};
        data_set_pos(s->train, pos);
        snprintf(s->data_note, sizeof s->data_note, "data: --force: data.train continues at epoch %llu, sample %llu",
                 (unsigned long long)pos.epoch, (unsigned long long)pos.index);
    } else {
        data_rewind(s->train);
        snprintf(s->data_note, sizeof s->data_note, "data: --force: the checkpoint holds one position in one glob (it "
                 "predates mixtures): the mixture starts at its beginning");
    }
}

/* The loaded numbers (a ResumeCheck): a checksum proves them the ones written,
 * not that they are a state; a checkpoint whose step does not fit the loop's
 * int, or whose counts no run reaches, is refused like damage. */
static int state_check_loaded(void *ctx, const char *dir, const uint64_t *data_state, size_t words, char *err,
                              size_t cap) {
    const RunState *s = ctx;
    char why[512] = "";
    const char *entry = NULL;
    if (s->step < 0 || s->step > INT_MAX)
        entry = "train.step", snprintf(why, sizeof why, "holds %lld; a step is 0 to 2^31 - 1", (long long)s->step);
    else if (s->optim_t < 0 || s->optim_t > s->step)
        entry = "optim.step", snprintf(why, sizeof why, "holds %lld, but the optimizer steps at most once a step (%lld)",
                                       (long long)s->optim_t, (long long)s->step);
    else if (s->tokens < 0 || s->tokens > (int64_t)1 << 62)
        entry = "train.tokens", snprintf(why, sizeof why, "holds %lld; a token count is 0 to 2^62", (long long)s->tokens);
    else if (!(s->elapsed_s >= 0 && s->elapsed_s < 1e12))
        entry = "train.elapsed_s", snprintf(why, sizeof why, "holds %g; seconds of training are 0 or more", s->elapsed_s);
    else if (data_pos_check((DataPos){s->data_pos[0], s->data_pos[1]}, why, sizeof why) != 0)
        entry = "data.train.pos";
    else if (data_state && data_state_check(data_state, words, why, sizeof why) != 0)
        entry = "data.train.state";
    if (!entry) return 0;
    snprintf(err, cap, "%s: entry '%s' %s", dir, entry, why);
    return -1;
}

/* Collectives for ckpt and resume (ctx = the world group). */
static int state_agree(void *ctx, int failed) {
    double f = failed ? 1 : 0;
    comm_all_reduce_max_f64(ctx, &f, 1);
    return f > 0;
}
static void state_bcast(void *ctx, void *buf, size_t n) { comm_broadcast_bytes(ctx, buf, n, 0); }

/* fp8 delayed scaling's histories and cast counts: each rank writes its own
 * (rank 0 "fp8.amax_history", rank r "fp8.amax_history/rank<r>", as the
 * RNG): the weights' are the same on every rank but the activations' differ
 * over dp (and a routed expert's over cp), and all of them are a few floats
 * per product, in the model's layout-free form (model_fp8_history_get). */
static void fp8_blob_names(int rank, char names[2][CKPT_NAME]) {
    snprintf(names[0], CKPT_NAME, rank == 0 ? "fp8.amax_history" : "fp8.amax_history/rank%d", rank);
    snprintf(names[1], CKPT_NAME, rank == 0 ? "fp8.amax_count" : "fp8.amax_count/rank%d", rank);
}

/* One rank's histories from checkpoint `path`, of lengths n and k; 0 and a
 * reason in why if it has none or others. */
static int fp8_read(const char *path, int rank, size_t n, size_t k, float **h, int64_t **cnt, char *why, size_t wn) {
    char names[2][CKPT_NAME], err[1400] = "";
    size_t hl = 0, cl = 0;
    fp8_blob_names(rank, names);
    *h = ckpt_read_blob(path, names[0], &hl, err, sizeof err);
    *cnt = *h ? ckpt_read_blob(path, names[1], &cl, err, sizeof err) : NULL;
    if (!*h || !*cnt) snprintf(why, wn, "the checkpoint has none: %s", err);
    else if (hl != n * sizeof(float) || cl != k * sizeof(int64_t))
        snprintf(why, wn, "the checkpoint's are of another length (%zu floats, this run's %zu: another "
                 "precision.fp8_amax_history or model)", hl / sizeof(float), n);
    else return 1;
    free(*h), free(*cnt);
    *h = NULL, *cnt = NULL;
    return 0;
}

/* A resume in the same layout loads this rank's own histories: the run
 * continues bit-identically. In another layout each rank takes, from the
 * old ranks of its dp index (modulo the old dp; those of its cp index
 * first), what model_fp8_history_merge says means the same here: the
 * weights' always, the activations' and output gradients' when dp is
 * unchanged (a routed expert's when cp is too); the rest start fresh, and
 * rank 0 says how many of each in one line. */
static void state_fp8_resume(RunState *s, const char *path, size_t n, size_t k) {
    char why[1600] = "";
    float *h = NULL;
    int64_t *cnt = NULL;
    /* the layouts' shapes; a manifest's and StateMesh's dp count dp x cp (a manifest
     * from before cp was recorded says cp 1: dp x cp is then one dp dimension, in the
     * same rank order, so a cp run's activations' histories start fresh, once) */
    const CkptMesh *om = &s->resumed_mesh;
    int opp = om->pp > 0 ? om->pp : 1, ocp = om->cp > 0 ? om->cp : 1, otp = om->tp > 0 ? om->tp : 1;
    int npp = s->mesh.pp > 0 ? s->mesh.pp : 1, ncp = s->mesh.cp > 0 ? s->mesh.cp : 1;
    int ntp = s->mesh.tp > 0 ? s->mesh.tp : 1;
    int odp = (om->dp > 0 ? om->dp : 1) / ocp, ndp = (s->mesh.dp > 0 ? s->mesh.dp : 1) / ncp;
    MeshShape os = {{opp, odp, ocp, otp}, 1}, ns = {{npp, ndp, ncp, ntp}, 1};
    /* the same layout: resharded (which compares dp x cp) says no and cp is the same */
    if (!s->resharded && ocp == ncp) {
        if (fp8_read(path, s->mesh.rank, n, k, &h, &cnt, why, sizeof why)) model_fp8_history_set(s->m, h, cnt);
        else if (s->mesh.rank == 0)
            kiln_warn("%s: key 'precision.fp8_amax_history': the fp8 delayed-scaling histories start fresh (%s); the "
                      "resumed run is not bit-identical to an uninterrupted one", path, why);
        free(h), free(cnt);
        return;
    }
    int mine[MESH_NDIMS], oc[MESH_NDIMS];
    mesh_coords(&ns, s->mesh.rank, mine);
    int same_dp = os.size[MESH_DP] == ns.size[MESH_DP], same_cp = os.size[MESH_CP] == ns.size[MESH_CP];
    float *out = xcalloc(n, sizeof(float));
    int64_t *out_count = xcalloc(k, sizeof(int64_t)), *seen = xcalloc(k, sizeof(int64_t));
    int carried = 0, ok = 1;
    for (int pass = 0; pass < 2 && ok; pass++) /* the old ranks of this cp index first */
        for (int r = 0; r < om->world && ok; r++) {
            mesh_coords(&os, r, oc);
            int cp_match = same_cp && oc[MESH_CP] == mine[MESH_CP];
            if (oc[MESH_DP] != mine[MESH_DP] % odp || (pass == 0) != cp_match) continue;
            if (!(ok = fp8_read(path, r, n, k, &h, &cnt, why, sizeof why))) break;
            for (size_t j = 0; j < k; j++) seen[j] |= cnt[j] > 0;
            carried += model_fp8_history_merge(s->m, h, cnt, same_dp, cp_match, out, out_count);
            free(h), free(cnt);
        }
    int fresh = 0;
    for (size_t j = 0; j < k; j++) fresh += seen[j] && !out_count[j];
    if (ok) model_fp8_history_set(s->m, out, out_count);
    if (s->mesh.rank == 0) {
        if (!ok)
            kiln_warn("%s: key 'precision.fp8_amax_history': the fp8 delayed-scaling histories start fresh (%s)", path,
                      why);
        else {
            char from[120], to[120];
            mesh_describe(&os, from, sizeof from);
            mesh_describe(&ns, to, sizeof to);
            kiln_warn("%s: key 'precision.fp8_amax_history': the layout changed across the resume (%s -> %s): %d fp8 "
                      "delayed-scaling histories carried over (weights'%s), %d start fresh%s (rank 0)",
                      path, from, to, carried,
                      same_dp ? ", activations' and output gradients'" : "", fresh,
                      !fresh ? "" : !same_dp ? " (activations' and output gradients': another dp puts other sequences "
                                               "in a rank's micro-batches)"
                                  : " (routed experts' activations and output gradients: their amaxes were each cp "
                                    "rank's own rows)");
        }
    }
    free(out), free(out_count), free(seen);
}

int state_open(RunState *s, const Config *c, const StateMesh *mesh, const char *resume, int force, const char *commit,
               Model *m, AdamW *o, DataLoader *train) {
    memset(s, 0, sizeof *s);
    s->c = c, s->m = m, s->o = o, s->train = train, s->commit = commit;
    s->save_step = s->done_step = -1;
    state_be = o->be;
    s->mesh = *mesh;
    if (s->mesh.world <= 1) s->mesh.g = NULL;
    int rank = s->mesh.rank, multi = s->mesh.g != NULL;
    s->last_saved = -1;
    s->config_text = cfg_yaml_text(c, NULL);
    s->data_words = data_state_words(train);
    s->data_state = xcalloc(s->data_words, sizeof(uint64_t));
    char rng_name[CKPT_NAME];
    snprintf(rng_name, sizeof rng_name, rank == 0 ? "rng.train" : "rng.train/rank%d", rank);
    /* what this rank loads: the whole parameters, its optimizer range, the
     * run's blobs (rank 0's) and rank 0's RNG (other ranks read theirs below) */
    CkptTable *t = &s->table;
    ckpt_table_init(t);
    const Ddp *us = s->mesh.units;
    if (us) {
        /* ZeRO-2 loads the whole parameters (then takes its blocks:
         * ddp_params_loaded); ZeRO-3 only its blocks */
        if (ddp_whole_params(us)) add_params(t, m, m->param_mem, "");
        else add_unit_blocks(t, m, us, ddp_param_shard(us, NULL), 4, "", NULL);
        if (o->m) add_unit_blocks(t, m, us, o->m, o->state_bytes, "optim.m/", o);
        if (o->v) add_unit_blocks(t, m, us, o->v, o->state_bytes, "optim.v/", o);
        add_muon(t, m, o);
    } else if (s->mesh.pieces) {
        /* ZeRO-1 under expert parallelism: the moments by piece */
        add_model_params(t, m, 0, m->num_params);
        if (o->m) add_unit_blocks(t, m, s->mesh.pieces, o->m, o->state_bytes, "optim.m/", o);
        if (o->v) add_unit_blocks(t, m, s->mesh.pieces, o->v, o->state_bytes, "optim.v/", o);
        add_muon(t, m, o);
    } else {
        state_table_add(t, m, o);
    }
    add_adafactor(t, m, s->mesh.adafactor, 0, &s->mesh);
    ckpt_add_blob(t, "optim.step", CKPT_I64, 1, 1, &s->optim_t);
    ckpt_add_blob(t, "train.step", CKPT_I64, 1, 1, &s->step);
    ckpt_add_blob(t, "train.tokens", CKPT_I64, 1, 1, &s->tokens);
    ckpt_add_blob(t, "train.elapsed_s", CKPT_F64, 1, 1, &s->elapsed_s);
    ckpt_add_blob(t, "data.train.pos", CKPT_U64, 2, 0, s->data_pos);
    if (rank == 0) ckpt_add_blob(t, "rng.train", CKPT_U64, 4, 0, s->rng.s);
    /* what this rank writes */
    CkptTable *w = &s->save_table;
    ckpt_table_init(w);
    int opt_sharded = o->lo != 0 || o->hi != m->num_params;
    if (us) {
        /* every rank writes its blocks of the (fp32) parameters and moments:
         * no rank writes the whole, and the whole arena of ZeRO-2 may be in
         * the middle of its refresh */
        add_unit_blocks(w, m, us, ddp_param_shard(us, NULL), 4, "", NULL);
        if (o->m) add_unit_blocks(w, m, us, o->m, o->state_bytes, "optim.m/", o);
        if (o->v) add_unit_blocks(w, m, us, o->v, o->state_bytes, "optim.v/", o);
    } else {
        /* ZeRO 0 and 1: what the dp group holds alike is written a share
         * by each of its ranks, in parallel: the arena range its ZeRO-1
         * optimizer owns, or one dp-th. Under expert parallelism the arena's
         * [0, expert_len) are this rank's experts, alike only over its EDP
         * group (dp / ep ranks): those are shared among that group. */
        size_t n = m->num_params, x = m->expert_len, lo, hi, elo, ehi;
        int dp = s->mesh.dp > 0 ? s->mesh.dp : 1, ep = s->mesh.ep > 0 ? s->mesh.ep : 1;
        if (opt_sharded && !s->mesh.pieces) lo = o->lo, hi = o->hi; /* x is 0: ep has pieces */
        else state_share(x, n, dp, s->mesh.dp_rank, &lo, &hi);
        state_share(0, x, dp / ep, s->mesh.edp_rank, &elo, &ehi);
        size_t pes = m->master_bf16 ? 2 : 4, es = o->state_bytes;
        char *params = m->master_bf16 ? (char *)m->param16 : (char *)m->param_mem;
        if (ehi > elo) add_range(w, m, params + elo * pes, pes, elo, ehi, "", NULL);
        add_range(w, m, params + lo * pes, pes, lo, hi, "", NULL);
        if (s->mesh.pieces) {
            /* ZeRO-1 under expert parallelism: each rank's moments by piece */
            if (o->m) add_unit_blocks(w, m, s->mesh.pieces, o->m, o->state_bytes, "optim.m/", o);
            if (o->v) add_unit_blocks(w, m, s->mesh.pieces, o->v, o->state_bytes, "optim.v/", o);
        } else {
            /* ZeRO-1's own range, or ZeRO 0's whole moments (o->lo 0) in the parameters' shares */
            if (ehi > elo && o->m) add_range(w, m, (char *)o->m + (elo - o->lo) * es, es, elo, ehi, "optim.m/", o);
            if (ehi > elo && o->v) add_range(w, m, (char *)o->v + (elo - o->lo) * es, es, elo, ehi, "optim.v/", o);
            if (o->m) add_range(w, m, (char *)o->m + (lo - o->lo) * es, es, lo, hi, "optim.m/", o);
            if (o->v) add_range(w, m, (char *)o->v + (lo - o->lo) * es, es, lo, hi, "optim.v/", o);
        }
    }
    add_muon(w, m, o); /* every owner its own, in every layout */
    add_adafactor(w, m, s->mesh.adafactor, 1, &s->mesh);
    if (rank == 0) {
        ckpt_add_blob(w, "optim.step", CKPT_I64, 1, 1, &s->optim_t);
        ckpt_add_blob(w, "train.step", CKPT_I64, 1, 1, &s->step);
        ckpt_add_blob(w, "train.tokens", CKPT_I64, 1, 1, &s->tokens);
        ckpt_add_blob(w, "train.elapsed_s", CKPT_F64, 1, 1, &s->elapsed_s);
        ckpt_add_blob(w, "data.train.pos", CKPT_U64, 2, 0, s->data_pos);
        ckpt_add_blob(w, "data.train.state", CKPT_U64, s->data_words, 0, s->data_state);
    }
    ckpt_add_blob(w, rng_name, CKPT_U64, 4, 0, s->rng.s);
    char fp8_names[2][CKPT_NAME];
    size_t fp8_n = model_fp8_history_len(m), fp8_k = model_fp8_count_len(m);
    if (fp8_n) {
        fp8_blob_names(rank, fp8_names);
        s->fp8_hist = xcalloc(fp8_n, sizeof(float));
        s->fp8_count = xcalloc(fp8_k, sizeof(int64_t));
        ckpt_add_blob(w, fp8_names[0], CKPT_F32, fp8_n, 0, s->fp8_hist);
        ckpt_add_blob(w, fp8_names[1], CKPT_I64, fp8_k, 0, s->fp8_count);
    }
    if (s->mesh.tp_rank > 0) drop_replicated(w);
    int wte = model_tensor_index(m, -1, ROLE_TOK_EMB, -1);
    if (s->mesh.pp > 1 && s->mesh.pp_rank == s->mesh.pp - 1 && m->shape.tie_embeddings && wte >= 0)
        drop_tensor(w, m->params[wte].name);

    CkptOptions *op = &s->opts;
    memset(op, 0, sizeof *op);
    if (c->ckpt_dir[0]) kiln_strlcpy(op->root, c->ckpt_dir, sizeof op->root);
    else snprintf(op->root, sizeof op->root, "%s/checkpoints", c->run_dir);
    op->keep_last = c->ckpt_keep_last;
    op->keep_every = c->ckpt_keep_every;
    op->async = c->ckpt_async;
    ckpt_set_direct_io(c->ckpt_direct_io); /* before the loads and the writer */
    op->compress = c->ckpt_compress;
    op->threads = c->threads > 0 ? c->threads : (int)sysconf(_SC_NPROCESSORS_ONLN); /* zstd workers */
    op->agree = multi ? state_agree : NULL;
    op->agree_ctx = s->mesh.g;

    state_fresh(s, 0);
    if (!resume && rank == 0) {
        char **paths;
        int64_t *steps;
        int n = ckpt_list(op->root, &paths, &steps);
        if (n > 0)
            kiln_warn("%s holds %d checkpoint(s) up to step %lld; this run starts fresh and replaces them as it "
                      "passes their steps (--resume auto would continue instead)",
                      op->root, n, (long long)steps[0]);
        ckpt_list_free(paths, steps, n);
    }
    if (resume) {
        CkptInfo info;
        char path[1200];
        int flags = 0;
        ResumeSync sync = {rank, state_agree, state_bcast, s->mesh.g};
        ResumeCheck check = {state_check_loaded, s};
        double t_load = kiln_now();
        /* the saved config is not part of the loaded table: it is compared, never restored */
        if (resume_load(resume, op->root, t, s->config_text, force, &info, path, sizeof path, &flags,
                        multi ? &sync : NULL, &check)) {
            s->resume_load_s = kiln_now() - t_load;
            for (int i = 0; i < t->n; i++) s->resume_gb += ckpt_entry_bytes(&t->e[i]) / 1e9;
            o->t = (int)s->optim_t;
            if (s->mesh.units) ddp_params_loaded(s->mesh.units);
            state_restore_data(s, path, flags, force);
            s->elapsed_base = s->elapsed_s;
            s->last_saved = info.step;
            if (rank > 0) {
                /* this rank's own stream, if the checkpoint had this rank;
                 * else (more ranks than saved) the fresh one from the seed */
                char err[1024];
                size_t len = 0;
                void *blob = ckpt_read_blob(path, rng_name, &len, err, sizeof err);
                if (blob && len == sizeof s->rng.s) memcpy(s->rng.s, blob, len);
                free(blob);
            }
            char **paths;
            int64_t *steps;
            int n = rank == 0 ? ckpt_list(op->root, &paths, &steps) : 0;
            if (n > 0 && steps[0] > info.step)
                kiln_warn("%s holds newer checkpoints (up to step %lld) than the one resumed; they are replaced as "
                          "this run passes their steps (--resume auto and keep_last follow 'latest' and ignore them)",
                          op->root, (long long)steps[0]);
            if (rank == 0) ckpt_list_free(paths, steps, n);
            char mesh_note[200] = "";
            int saved_tp = info.mesh.tp > 0 ? info.mesh.tp : 1, saved_pp = info.mesh.pp > 0 ? info.mesh.pp : 1;
            int saved_ep = info.mesh.ep > 0 ? info.mesh.ep : 1;
            int pp = s->mesh.pp > 0 ? s->mesh.pp : 1, ep = s->mesh.ep > 0 ? s->mesh.ep : 1;
            s->resharded = info.mesh.world > 0 && (info.mesh.world != s->mesh.world || info.mesh.dp != s->mesh.dp ||
                                                   saved_tp != s->mesh.tp || saved_pp != pp || saved_ep != ep);
            s->resumed_mesh = info.mesh;
            if (fp8_n) state_fp8_resume(s, path, fp8_n, fp8_k);
            kiln_strlcpy(s->resumed_path, path, sizeof s->resumed_path);
            if (s->resharded)
                snprintf(mesh_note, sizeof mesh_note, "; resharded from %d rank(s) (pp %d x dp %d x tp %d, ep %d) to "
                         "%d (pp %d x dp %d x tp %d, ep %d, ZeRO %d)", info.mesh.world, saved_pp, info.mesh.dp, saved_tp,
                         saved_ep, s->mesh.world, pp, s->mesh.dp, s->mesh.tp, ep, s->mesh.zero);
            snprintf(s->resumed_msg, sizeof s->resumed_msg,
                     "resumed from %s at step %lld (%lld tokens, %.1f s of training before)%s", path,
                     (long long)s->step, (long long)s->tokens, s->elapsed_s, mesh_note);
            if (s->step != info.step)
                kiln_fail(KILN_EXIT_USAGE, "%s: manifest says step %lld but train.step holds %lld", path,
                          (long long)info.step, (long long)s->step);
        } else {
            state_fresh(s, (flags & RESUME_DIRTY) || s->mesh.weights_unset);
        }
    }
    /* the config blob is written but never loaded into the table */
    if (rank == 0) ckpt_add_blob(w, "config.yaml", CKPT_U8, strlen(s->config_text), 0, s->config_text);
    s->writer = ckpt_writer_new(w, op);
    s->t_start = kiln_now();
    stop_install();
    stop_deadline_init(c->ckpt_before_limit);
    if (s->step > c->steps && rank == 0)
        kiln_warn("the checkpoint is at step %lld, past train.steps = %d: nothing to train", (long long)s->step, c->steps);
    return (int)s->step;
}

static void state_fail_write(RunState *s) {
    kiln_fail(KILN_EXIT_RUNTIME, "checkpoint at step %lld failed: %s; earlier checkpoints are untouched",
              (long long)s->last_saved, ckpt_writer_error(s->writer));
}

/* A save whose write has completed since the last look: one line, and its
 * figures kept for the next metrics.jsonl line. */
static void state_checkpoint_done(RunState *s) {
    CkptStats st = ckpt_writer_stats(s->writer);
    if (st.step < 0 || st.step == s->done_step) return;
    s->done_step = st.step;
    double pause = st.step == s->save_step ? s->save_pause_s : NAN;
    s->report = (MetricsCkpt){st.step, pause, st.write_s, st.stored / 1e9};
    s->report_ready = 1;
    char size[32];
    if (s->mx && s->opts.async) /* a sync save's line says it all */
        metrics_print(s->mx, "checkpoint: step %lld written in %.2f s (%s here, %.2f GB/s%s) behind the step "
                      "loop's %.3f s pause", (long long)st.step, st.write_s, kiln_fmt_bytes((double)st.stored, size,
                      sizeof size), st.write_s > 0 ? st.stored / 1e9 / st.write_s : 0, st.direct ? ", O_DIRECT" : "",
                      pause);
}

const MetricsCkpt *state_checkpoint_report(RunState *s) {
    if (!s->report_ready) return NULL;
    s->report_ready = 0;
    return &s->report;
}

static void state_save(RunState *s) {
    if (s->mx) metrics_phase(s->mx, PHASE_CHECKPOINT, (int)s->step);
    /* the step loop's pause counts from here: a write still in flight is
     * waited for first (every rank saves at the same step: a collective) */
    double t0 = kiln_now();
    if (ckpt_in_flight(s->writer) && ckpt_wait(s->writer) != 0) state_fail_write(s);
    state_checkpoint_done(s);
    /* ZeRO-2's parameter refreshes are bounded by parallel.timeout_s from when
     * they were posted: finish them before a save that may take longer */
    if (s->mesh.units) ddp_params_ready(s->mesh.units);
    s->optim_t = s->o->t;
    DataPos pos = data_get_pos(s->train);
    s->data_pos[0] = pos.epoch, s->data_pos[1] = pos.index;
    data_get_state(s->train, s->data_state);
    s->elapsed_s = s->elapsed_base + (kiln_now() - s->t_start);
    if (s->fp8_hist) model_fp8_history_get(s->m, s->fp8_hist, s->fp8_count);
    CkptMeta meta = {s->step, s->c->hash, KILN_VERSION, s->commit,
                     {s->mesh.world > 0 ? s->mesh.world : 1, s->mesh.rank, s->mesh.dp > 0 ? s->mesh.dp : 1,
                      s->mesh.tp > 0 ? s->mesh.tp : 1, s->mesh.pp > 0 ? s->mesh.pp : 1, s->mesh.cp > 0 ? s->mesh.cp : 1,
                      s->mesh.ep > 0 ? s->mesh.ep : 1}};
    if (ckpt_save(s->writer, &meta) != 0)
        kiln_fail(KILN_EXIT_RUNTIME, "checkpoint at step %lld failed: %s; earlier checkpoints are untouched",
                  (long long)s->step, ckpt_writer_error(s->writer));
    s->last_saved = s->step;
    s->save_step = s->step, s->save_pause_s = kiln_now() - t0;
    if (!s->opts.async) state_checkpoint_done(s);
    CkptStats st = ckpt_writer_stats(s->writer);
    char size[32];
    if (s->mx && s->opts.async)
        metrics_print(s->mx, "checkpoint: step %lld staged for %s in %.3f s", (long long)s->step, s->opts.root,
                      s->save_pause_s);
    else if (s->mx)
        metrics_print(s->mx, "checkpoint: step %lld written to %s in %.3f s (%s here, %.2f GB/s%s)",
                      (long long)s->step, s->opts.root, s->save_pause_s, kiln_fmt_bytes((double)st.stored, size,
                      sizeof size),
                      st.write_s > 0 ? st.stored / 1e9 / st.write_s : 0, st.direct ? ", O_DIRECT" : "");
}

int state_after_step(RunState *s, int done, int last) {
    s->step = done;
    if (__builtin_add_overflow(s->tokens, s->c->total_tokens, &s->tokens)) s->tokens = INT64_MAX; /* 2^62 a step */
    int sig = stop_signal(), deadline = stop_deadline_reached();
    if (s->mesh.g) {
        /* every rank stops at the same step: the first signal or deadline
         * anywhere; and an async checkpoint is completed (manifest merged,
         * renamed, `latest`) at the first step after every rank's writer
         * thread is done, riding on the same all-reduce */
        double f[3] = {sig, deadline, ckpt_pending(s->writer)};
        comm_all_reduce_max_f64(s->mesh.g, f, 3);
        sig = (int)f[0], deadline = (int)f[1];
        if (f[2] == 0 && ckpt_in_flight(s->writer) && ckpt_wait(s->writer) != 0) state_fail_write(s);
    } else if (ckpt_in_flight(s->writer) && !ckpt_pending(s->writer) && ckpt_wait(s->writer) != 0) {
        state_fail_write(s); /* one rank: the thread has finished the whole checkpoint */
    }
    state_checkpoint_done(s);
    int every = s->c->ckpt_every > 0 && done % s->c->ckpt_every == 0;
    if (every || (last && s->c->ckpt_final) || sig || deadline) state_save(s);
    if ((sig || deadline) && !last) {
        s->stop_reason = sig ? sig : -1;
        return 1;
    }
    return 0;
}

void state_close(RunState *s) {
    double t0 = kiln_now();
    if (ckpt_wait(s->writer) != 0) state_fail_write(s);
    if (s->opts.async && s->last_saved >= 0 && kiln_now() - t0 > 0.01 && s->mx)
        metrics_print(s->mx, "checkpoint: waited %.2f s for the last write", kiln_now() - t0);
    state_checkpoint_done(s);
    ckpt_writer_free(s->writer);
    ckpt_table_free(&s->table);
    ckpt_table_free(&s->save_table);
    free(s->config_text);
    free(s->data_state);
    free(s->fp8_hist);
    free(s->fp8_count);
    memset(s, 0, sizeof *s);
}
