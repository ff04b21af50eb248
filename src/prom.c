/* prom: formatting and the atomic rewrite of the textfile. Not fsynced: the
 * file is a live view, replaced every few steps; a crash loses nothing the
 * run needs. */
#include "prom.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Label values escape backslash, double quote and newline. */
static void label(FILE *f, const char *name, const char *v) {
    fprintf(f, "%s=\"", name);
    for (; *v; v++) {
        if (*v == '\\' || *v == '"') fputc('\\', f), fputc(*v, f);
        else if (*v == '\n') fputs("\\n", f);
        else fputc(*v, f);
    }
    fputc('"', f);
}

static void head(FILE *f, const char *name, const char *type, const char *help) {
    fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void sample(FILE *f, const PromSnapshot *s, const char *name, const char *extra_key, const char *extra_val,
                   double v) {
    fprintf(f, "%s{", name);
    label(f, "run", s->run);
    if (extra_key) fputc(',', f), label(f, extra_key, extra_val);
    fprintf(f, "} %.10g\n", v);
}

static void gauge(FILE *f, const PromSnapshot *s, const char *name, const char *help, double v) {
    if (!isfinite(v)) return;
    head(f, name, "gauge", help);
    sample(f, s, name, NULL, NULL, v);
}

char *prom_text(const PromSnapshot *s, size_t *len) {
    char *text = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&text, &n);
    if (!f) return NULL;
    gauge(f, s, "kiln_running", "1 while the run trains, 0 once it has ended.", s->running);
    if (!s->running) gauge(f, s, "kiln_exit_code", "Exit code of the ended run (0 done, 1 failure, 2 bad input, 75 stopped: resume).", s->exit_code);
    gauge(f, s, "kiln_step", "Optimizer steps completed.", s->step);
    gauge(f, s, "kiln_steps_planned", "Optimizer steps the run trains for (train.steps).", s->steps);
    gauge(f, s, "kiln_tokens", "Tokens trained on so far, all ranks.", s->tokens);
    gauge(f, s, "kiln_loss", "Training loss of the last step (nats per token).", s->loss);
    gauge(f, s, "kiln_val_loss", "Validation loss of the last evaluation (nats per token).", s->val_loss);
    gauge(f, s, "kiln_tokens_per_second", "Training throughput of the last step, all ranks.", s->tok_per_s);
    gauge(f, s, "kiln_mfu_ratio", "Model FLOPs utilisation of the last step, a fraction of the peak.", s->mfu);
    gauge(f, s, "kiln_step_seconds", "Wall time of the last step (forward, backward, optimizer).", s->step_s);
    gauge(f, s, "kiln_start_timestamp_seconds", "Unix time this process started the run.", s->start_unix);
    gauge(f, s, "kiln_last_progress_timestamp_seconds",
          "Unix time of the last progress (any phase change of rank 0); alert on time() minus this.", s->progress_unix);
    gauge(f, s, "kiln_seconds_since_progress", "Seconds from the last progress to this snapshot.", s->since_progress_s);
    if (s->nphase > 0) {
        head(f, "kiln_phase_seconds_total", "counter", "Seconds rank 0 spent in each phase since this process started.");
        for (int p = 0; p < s->nphase && p < PROM_PHASES; p++)
            sample(f, s, "kiln_phase_seconds_total", "phase", s->phase_name[p], s->phase_s[p]);
    }
    if (s->ckpt_step >= 0) {
        gauge(f, s, "kiln_checkpoint_age_seconds", "Seconds since the newest complete checkpoint was written.", s->ckpt_age_s);
        gauge(f, s, "kiln_checkpoint_step", "Step of the newest complete checkpoint.", s->ckpt_step);
    }
    gauge(f, s, "kiln_world_size", "Ranks (processes) of the run.", s->world);
    if (s->slowest_rank >= 0) {
        gauge(f, s, "kiln_slowest_rank", "Rank with the most busy time per step at the last logged step.", s->slowest_rank);
        gauge(f, s, "kiln_straggler_factor", "Busy time of the slowest rank over the median of the others.", s->slowest_factor);
    }
    head(f, "kiln_nonfinite_skipped_total", "counter", "Steps skipped for a non-finite loss or gradient.");
    sample(f, s, "kiln_nonfinite_skipped_total", NULL, NULL, s->nonfinite_skipped);
    fclose(f);
    if (len) *len = n;
    return text;
}

int prom_write(const char *path, const PromSnapshot *s) {
    size_t n;
    char *text = prom_text(s, &n);
    if (!text) return -1;
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    int rc = -1;
    if (f) {
        size_t w = fwrite(text, 1, n, f);
        rc = fclose(f) == 0 && w == n && rename(tmp, path) == 0 ? 0 : -1;
        if (rc) unlink(tmp);
    }
    free(text);
    return rc;
}
