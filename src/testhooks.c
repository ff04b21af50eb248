/* testhooks: the KILN_TEST_* variables, read once (see testhooks.h). */
#include "testhooks.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "optim.h"
#include "util.h"

static TestHooks H;
static int H_read;

static const char *hook_str(const char *name) {
    char var[64];
    snprintf(var, sizeof var, "KILN_TEST_%s", name);
    const char *s = getenv(var);
    return s && *s ? s : NULL;
}

static int hook_int(const char *name, int unset) {
    const char *s = hook_str(name);
    return s ? atoi(s) : unset;
}

static void hook_at(TestHookAt *h, const char *name, int with_group) {
    memset(h, 0, sizeof *h);
    const char *s = hook_str(name);
    if (!s) return;
    int r = -1, st = 0, k = 0;
    int n = with_group ? sscanf(s, "%d:%d:%31[A-Za-z0-9_.-]%n", &r, &st, h->group, &k)
                       : sscanf(s, "%d:%d%n", &r, &st, &k);
    if (n != 2 + with_group || s[k] || r < 0 || st < 1)
        kiln_fail(KILN_EXIT_USAGE, "environment variable KILN_TEST_%s='%s': expected RANK:STEP%s", name, s,
                  with_group ? ":GROUP (e.g. 2:3:dp)" : " (e.g. 1:2)");
    h->rank = r, h->step = st;
}

void testhooks_reset(void) {
    memset(&H, 0, sizeof H);
    H_read = 0;
}

const TestHooks *testhooks(void) {
    if (H_read) return &H;
    H_read = 1;
    const char *wb = hook_str("DATA_WAIT_AT_BATCH"), *wf = hook_str("DATA_WAIT_FILE");
    if (wb && wf) H.data_wait_batch = atol(wb), H.data_wait_file = wf;
    hook_at(&H.skip_collective, "SKIP_COLLECTIVE", 1);
    hook_at(&H.wrong_collective, "WRONG_COLLECTIVE", 1);
    hook_at(&H.segv, "SEGV", 0);
    hook_at(&H.flight_pause, "FLIGHT_PAUSE", 0);
    H.stall_at_step = hook_int("STALL_AT_STEP", 0);
    H.slow_rank = hook_int("SLOW_RANK", -1);
    H.slow_ms = H.slow_rank >= 0 ? hook_int("SLOW_MS", 0) : 0;
    H.mlflow_resend = hook_str("MLFLOW_RESEND") != NULL;
    H.mlflow_hold = hook_str("MLFLOW_HOLD") != NULL;
    H.fp8_local_amax = hook_str("FP8_LOCAL_AMAX") != NULL;
    const char *pc = hook_str("PREPARE_CHUNK");
    H.prepare_chunk = pc ? (size_t)strtoull(pc, NULL, 10) : 0;
    H.gate = hook_str("GATE");
    H.pause_at_step = hook_int("PAUSE_AT_STEP", 0);
    const char *nan = hook_str("INJECT_NAN_STEP");
    H.inject_nan_step = nan ? atoi(nan) : 0;
    H.inject_nan_after = nan && strchr(nan, '+') != NULL;
    H.tp_grads = hook_str("TP_GRADS");
    H.optim_dump = hook_str("OPTIM_DUMP");
    return &H;
}

/* KILN_TEST_TP_GRADS=FILE: one line per replicated tensor, its name and the
 * FNV-1a hash of its gradient's bytes. */
void testhooks_replicated_grads(const Model *m, const char *path, int rank) {
    char name[1200];
    snprintf(name, sizeof name, "%s.rank%d", path, rank);
    FILE *f = fopen(name, "w");
    if (!f) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot write (KILN_TEST_TP_GRADS)", name);
    for (int i = 0; i < m->num_tensors; i++) {
        const ParamInfo *p = &m->params[i];
        if (p->split.dim >= 0) continue;
        float *g = xmalloc(p->numel * sizeof(float));
        m->be->to_host(g, m->gview[i], p->numel * sizeof(float));
        fprintf(f, "%s %016llx\n", p->name, (unsigned long long)kiln_fnv1a(g, p->numel * sizeof(float), KILN_FNV_INIT));
        free(g);
    }
    fclose(f);
}

/* KILN_TEST_OPTIM_DUMP=DIR (one rank, ZeRO 0, no tp; docs/optimizers.md):
 * what an optimizer reference needs to replay the run's steps. At start,
 * DIR/tensors.txt (a line "tensor NAME OFFSET NUMEL NDIM ROWS COLS DECAY"
 * per tensor, "muon OFF ROWS COLS SCALE DECAY" per Muon matrix) and
 * DIR/params_0.f32; per step k, DIR/grads_<k>.f32 (the summed gradients,
 * before clipping), DIR/params_<k>.f32 (after the update) and a line
 * "step K LR" in DIR/steps.txt. Raw fp32, the arena's num_params elements. */
static void dump_arena(const char *dir, const char *what, int step, const float *dev, size_t n, const Backend *be) {
    char path[1200];
    snprintf(path, sizeof path, "%s/%s_%d.f32", dir, what, step);
    float *h = xmalloc(n * sizeof(float));
    be->to_host(h, dev, n * sizeof(float));
    if (kiln_write_file_atomic(path, h, n * sizeof(float)) != 0)
        kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot write (KILN_TEST_OPTIM_DUMP)", path);
    free(h);
}

void testhooks_optim_start(const char *dir, const Model *m, const AdamW *o, int ranks) {
    if (ranks != 1 || !m->param_mem || m->n_units)
        kiln_fail(KILN_EXIT_USAGE, "KILN_TEST_OPTIM_DUMP needs one rank, parallel.zero 0 and precision.master fp32");
    if (kiln_mkdirs(dir) != 0) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot create (KILN_TEST_OPTIM_DUMP)", dir);
    char path[1200];
    snprintf(path, sizeof path, "%s/tensors.txt", dir);
    FILE *f = fopen(path, "w");
    if (!f) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot write (KILN_TEST_OPTIM_DUMP)", path);
    for (int i = 0; i < m->num_tensors; i++) {
        const ParamInfo *p = &m->params[i];
        fprintf(f, "tensor %s %zu %zu %d %d %d %d\n", p->name, p->offset, p->numel, p->ndim, p->shape[0],
                p->ndim == 2 ? p->shape[1] : 1, p->decay);
    }
    for (int i = 0; i < (o->kind == OPTIM_MUON ? o->nmat : 0); i++)
        fprintf(f, "muon %zu %d %d %.9g %d\n", o->mats[i].off, o->mats[i].rows, o->mats[i].cols, o->mats[i].scale,
                o->mats[i].decay);
    if (fclose(f) != 0) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot write (KILN_TEST_OPTIM_DUMP)", path);
    snprintf(path, sizeof path, "%s/steps.txt", dir);
    if (kiln_write_file_atomic(path, "", 0) != 0) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot write", path);
    dump_arena(dir, "params", 0, m->param_mem, m->num_params, m->be);
}

void testhooks_optim_grads(const char *dir, const Model *m, int step) {
    dump_arena(dir, "grads", step, m->grad_mem, m->num_params, m->be);
}

void testhooks_optim_step(const char *dir, const Model *m, int step, float lr) {
    char path[1200];
    snprintf(path, sizeof path, "%s/steps.txt", dir);
    FILE *f = fopen(path, "a");
    if (!f || fprintf(f, "step %d %.9g\n", step, lr) < 0 || fclose(f) != 0)
        kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot write (KILN_TEST_OPTIM_DUMP)", path);
    dump_arena(dir, "params", step, m->param_mem, m->num_params, m->be);
}
