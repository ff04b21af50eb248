/* state: the training run's checkpoint table and its save/resume policy.
 * Names in the table: parameters by their model names ("wte", "h.0.ln_1.weight"),
 * AdamW moments as "optim.m/<name>" and "optim.v/<name>", and blobs
 * "optim.step", "train.step", "train.tokens", "train.elapsed_s",
 * "data.train.pos", "rng.train", "config.yaml". docs/formats.md. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "state.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "resume.h"
#include "stop.h"

static void add_params(CkptTable *t, Model *m, float *base, const char *prefix) {
    const Backend *be = m->be;
    for (int i = 0; i < m->num_tensors; i++) {
        const ParamInfo *p = &m->params[i];
        char name[CKPT_NAME];
        snprintf(name, sizeof name, "%s%s", prefix, p->name);
        int64_t shape[2] = {p->shape[0], p->shape[1]};
        ckpt_add_tensor(t, name, CKPT_F32, p->ndim, shape, 0, p->numel, base + p->offset, be->to_host,
                        be->to_device);
    }
}

static char *resolved_text(const Config *c) {
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) kiln_fail(KILN_EXIT_RUNTIME, "open_memstream failed");
    cfg_write_yaml(c, f);
    fclose(f);
    return text;
}

int state_init_from(Model *m, const char *dir) {
    if (!ckpt_is_checkpoint(dir)) return 0;
    CkptTable t;
    ckpt_table_init(&t);
    add_params(&t, m, m->param_mem, "");
    char err[2048];
    CkptInfo info;
    if (ckpt_load(dir, &t, &info, err, sizeof err) != 0) kiln_fail(KILN_EXIT_USAGE, "key 'init.from': %s", err);
    ckpt_table_free(&t);
    printf("init.from: parameters of %s (step %lld); optimizer, data position and step start fresh\n", dir,
           (long long)info.step);
    return 1;
}

/* Start-up state when nothing is resumed, or after a corrupt checkpoint was
 * partly loaded and skipped: the same as a fresh run's. */
static void state_fresh(RunState *s, int dirty) {
    const Config *c = s->c;
    if (dirty) {
        if (!c->init_from[0]) model_init_weights(s->m, c->seed);
        else if (!state_init_from(s->m, c->init_from)) model_load_llmc(s->m, c->init_from);
        s->o->be->zero(s->o->m, s->o->n * sizeof(float));
        s->o->be->zero(s->o->v, s->o->n * sizeof(float));
        s->o->t = 0;
        DataPos zero = {0, 0};
        data_set_pos(s->train, zero);
    }
    /* nothing draws from this stream yet; it is saved and restored so that
     * stochastic ops (dropout, ...) inherit exact resumption for free */
    rng_seed(&s->rng, c->seed ^ 0x7261696e2e726e67ULL);
    s->step = s->tokens = s->optim_t = 0;
    s->elapsed_base = 0;
}

int state_open(RunState *s, const Config *c, const char *resume, int force, const char *commit, Model *m, AdamW *o,
               DataLoader *train) {
    memset(s, 0, sizeof *s);
    s->c = c, s->m = m, s->o = o, s->train = train, s->commit = commit;
    s->last_saved = -1;
    s->config_text = resolved_text(c);
    CkptTable *t = &s->table;
    ckpt_table_init(t);
    add_params(t, m, m->param_mem, "");
    add_params(t, m, o->m, "optim.m/");
    add_params(t, m, o->v, "optim.v/");
    ckpt_add_blob(t, "optim.step", CKPT_I64, 1, 1, &s->optim_t);
    ckpt_add_blob(t, "train.step", CKPT_I64, 1, 1, &s->step);
    ckpt_add_blob(t, "train.tokens", CKPT_I64, 1, 1, &s->tokens);
    ckpt_add_blob(t, "train.elapsed_s", CKPT_F64, 1, 1, &s->elapsed_s);
    ckpt_add_blob(t, "data.train.pos", CKPT_U64, 2, 0, s->data_pos);
    ckpt_add_blob(t, "rng.train", CKPT_U64, 4, 0, s->rng.s);

    CkptOptions *op = &s->opts;
    memset(op, 0, sizeof *op);
    if (c->ckpt_dir[0]) kiln_strlcpy(op->root, c->ckpt_dir, sizeof op->root);
    else snprintf(op->root, sizeof op->root, "%s/checkpoints", c->run_dir);
    op->keep_last = c->ckpt_keep_last;
    op->keep_every = c->ckpt_keep_every;
    op->async = c->ckpt_async;
    op->compress = c->ckpt_compress;

    state_fresh(s, 0);
    if (!resume) {
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
        /* the saved config is not part of the loaded table: it is compared, never restored */
        if (resume_load(resume, op->root, t, s->config_text, force, &info, path, sizeof path, &flags)) {
            o->t = (int)s->optim_t;
            DataPos pos = {s->data_pos[0], s->data_pos[1]};
            if (flags & RESUME_RESET_DATA) pos.epoch = pos.index = 0;
            data_set_pos(train, pos);
            s->elapsed_base = s->elapsed_s;
            s->last_saved = info.step;
            char **paths;
            int64_t *steps;
            int n = ckpt_list(op->root, &paths, &steps);
            if (n > 0 && steps[0] > info.step)
                kiln_warn("%s holds newer checkpoints (up to step %lld) than the one resumed; they are replaced as "
                          "this run passes their steps, and until then --resume auto would pick them",
                          op->root, (long long)steps[0]);
            ckpt_list_free(paths, steps, n);
            printf("resumed from %s at step %lld (%lld tokens, %.1f s of training before)\n", path,
                   (long long)s->step, (long long)s->tokens, s->elapsed_s);
            if (s->step != info.step)
                kiln_fail(KILN_EXIT_USAGE, "%s: manifest says step %lld but train.step holds %lld", path,
                          (long long)info.step, (long long)s->step);
        } else {
            state_fresh(s, flags & RESUME_DIRTY);
        }
    }
    /* the config blob is written but never loaded into the table */
    ckpt_add_blob(t, "config.yaml", CKPT_U8, strlen(s->config_text), 0, s->config_text);
    s->writer = ckpt_writer_new(t, op);
    s->t_start = kiln_now();
    stop_install();
    stop_deadline_init(c->ckpt_before_limit);
    if (s->step > c->steps)
        kiln_warn("the checkpoint is at step %lld, past train.steps = %d: nothing to train", (long long)s->step, c->steps);
    return (int)s->step;
}

static void state_save(RunState *s) {
    s->optim_t = s->o->t;
    DataPos pos = data_get_pos(s->train);
    s->data_pos[0] = pos.epoch, s->data_pos[1] = pos.index;
    s->elapsed_s = s->elapsed_base + (kiln_now() - s->t_start);
    CkptMeta meta = {s->step, s->c->hash, KILN_VERSION, s->commit, {1, 0, 1, 1, 1, 1, 1}};
    double t0 = kiln_now();
    if (ckpt_save(s->writer, &meta) != 0)
        kiln_fail(KILN_EXIT_RUNTIME, "checkpoint at step %lld failed: %s; earlier checkpoints are untouched",
                  (long long)s->step, ckpt_writer_error(s->writer));
    s->last_saved = s->step;
    printf("checkpoint: step %lld %s %s in %.3f s\n", (long long)s->step, s->opts.async ? "staged for" : "written to",
           s->opts.root, kiln_now() - t0);
    fflush(stdout);
}

int state_after_step(RunState *s, int done, int last) {
    s->step = done;
    s->tokens += s->c->total_tokens;
    int sig = stop_signal(), deadline = stop_deadline_reached();
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
    if (ckpt_wait(s->writer) != 0)
        kiln_fail(KILN_EXIT_RUNTIME, "checkpoint at step %lld failed: %s; earlier checkpoints are untouched",
                  (long long)s->last_saved, ckpt_writer_error(s->writer));
    if (s->opts.async && s->last_saved >= 0 && kiln_now() - t0 > 0.01)
        printf("checkpoint: waited %.2f s for the last write\n", kiln_now() - t0);
    ckpt_writer_free(s->writer);
    ckpt_table_free(&s->table);
    free(s->config_text);
    memset(s, 0, sizeof *s);
}
