/* compare: `./train compare RUN_A RUN_B [RUN...]` -- runs side by side in
 * plain text: the config keys that differ, the loss at equal tokens,
 * throughput and MFU, and one verdict line. Reads run directories through
 * runs.c; writes nothing. */
#include "compare.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runs.h"
#include "util.h"

/* Differences under these are called no difference: a loss within 1% is
 * inside the step-to-step noise of a training loss, and tokens/s within 5%
 * inside the run-to-run noise of a shared machine. */
#define LOSS_SAME 0.01
#define SPEED_SAME 0.05
/* The training loss "at" a token count is the mean over the steps in the
 * last 10% of the common token range before it: single steps are noisy. */
#define WINDOW 0.10

static const char *compare_usage = "usage: ./train compare RUN_A RUN_B [RUN...]\n";

/* Mean training loss over the rows with tokens in (at - window, at]; the
 * last row at or before `at` when the window holds none; NAN if none. */
static double train_loss_at(const Run *r, double at, double window) {
    double sum = 0;
    int n = 0, last = -1;
    for (int i = 0; i < r->n; i++) {
        double t = r->v[RUN_TOKENS][i], l = r->v[RUN_LOSS][i];
        if (t > at || !isfinite(l)) continue;
        last = i;
        if (t > at - window) sum += l, n++;
    }
    return n ? sum / n : last >= 0 ? r->v[RUN_LOSS][last] : NAN;
}

/* Validation loss of the last evaluation with tokens in (at - window, at]. */
static double val_at(const Run *r, double at, double window) {
    double v = NAN;
    for (int i = 0; i < r->n; i++) {
        double t = r->v[RUN_TOKENS][i];
        if (t <= at && t > at - window && isfinite(r->v[RUN_VAL][i])) v = r->v[RUN_VAL][i];
    }
    return v;
}

/* Validation loss at exactly `tokens`, NAN if the run did not evaluate there. */
static double val_exact(const Run *r, double tokens) {
    for (int i = 0; i < r->n; i++)
        if (r->v[RUN_TOKENS][i] == tokens && isfinite(r->v[RUN_VAL][i])) return r->v[RUN_VAL][i];
    return NAN;
}

static void fmt_rate(double v, char *buf, size_t cap) {
    if (!isfinite(v)) snprintf(buf, cap, "-");
    else if (v >= 1e6) snprintf(buf, cap, "%.2fM", v / 1e6);
    else if (v >= 1e4) snprintf(buf, cap, "%.1fk", v / 1e3);
    else snprintf(buf, cap, "%.0f", v);
}

static int label_w = 22; /* the first column: as wide as the longest config key shown */

/* One row: a label and one cell per run, right-aligned in columns of w. */
static void row(int w, const char *label, int n, char cells[][64]) {
    printf("  %-*s", label_w, label);
    for (int i = 0; i < n; i++) printf("  %*s", w, cells[i]);
    printf("\n");
}

int compare_main(int argc, char **argv) {
    const char **dirs = xcalloc((size_t)argc, sizeof(char *));
    int n = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(compare_usage, stdout);
            free(dirs);
            return KILN_EXIT_OK;
        }
        if (argv[i][0] == '-') {
            fputs(compare_usage, stderr);
            kiln_fail(KILN_EXIT_USAGE, "compare: unknown flag '%s'", argv[i]);
        }
        dirs[n++] = argv[i];
    }
    if (n < 2) {
        fputs(compare_usage, stderr);
        kiln_fail(KILN_EXIT_USAGE, "compare: needs at least two run directories, got %d", n);
    }
    Run *runs = xcalloc((size_t)n, sizeof(Run));
    for (int i = 0; i < n; i++) runs_load(&runs[i], dirs[i]);
    runs_label(runs, n);
    RunsConfigDiff d;
    runs_config_diff(runs, n, &d);
    /* columns as wide as a run's name, a differing value or "5.1234 (val 5.1234)" */
    int w = 19;
    for (int i = 0; i < n; i++)
        if ((int)strlen(runs[i].name) > w) w = (int)strlen(runs[i].name);
    for (int k = 0; k < d.nkeys; k++) {
        if ((int)strlen(d.key[k]) > label_w) label_w = (int)strlen(d.key[k]);
        for (int i = 0; i < n; i++)
            if (d.val[(size_t)k * n + i] && (int)strlen(d.val[(size_t)k * n + i]) > w) w = (int)strlen(d.val[(size_t)k * n + i]);
    }
    if (w > 40) w = 40;
    char (*cell)[64] = xcalloc((size_t)n, sizeof *cell);

    printf("compare %d runs\n", n);
    for (int i = 0; i < n; i++) {
        const Run *r = &runs[i];
        int li = r->n - 1;
        printf("  %s (%s): ", r->name, r->dir);
        if (li < 0) printf("no steps recorded\n");
        else if (r->steps_total) printf("step %d of %d, %.4g tokens\n", (int)r->v[RUN_STEP][li], r->steps_total, r->v[RUN_TOKENS][li]);
        else printf("step %d, %.4g tokens\n", (int)r->v[RUN_STEP][li], r->v[RUN_TOKENS][li]);
    }

    printf("\nconfig: %d key%s differ%s (run.name and run.dir left out)\n", d.nkeys, d.nkeys == 1 ? "" : "s",
           d.nkeys == 1 ? "s" : "");
    if (d.nkeys) {
        for (int i = 0; i < n; i++) snprintf(cell[i], sizeof cell[i], "%.63s", runs[i].name);
        row(w, "key", n, cell);
        for (int k = 0; k < d.nkeys; k++) {
            for (int i = 0; i < n; i++) {
                const char *v = d.val[(size_t)k * n + i];
                snprintf(cell[i], sizeof cell[i], "%.63s", !v ? "(absent)" : !*v ? "\"\"" : v);
            }
            row(w, d.key[k], n, cell);
        }
    }
    runs_config_diff_free(&d);

    /* the token range every run covers */
    double common = INFINITY;
    int with_steps = 0;
    for (int i = 0; i < n; i++)
        if (runs[i].n > 0) {
            with_steps++;
            double t = runs[i].v[RUN_TOKENS][runs[i].n - 1];
            if (t < common) common = t;
        }
    if (with_steps < 2) {
        printf("\nverdict: nothing to compare: fewer than two of the runs recorded a step\n");
        goto done;
    }
    double window = WINDOW * common;
    printf("\nloss at equal tokens (train: mean over the steps in the last %.0f%% of the common %.4g tokens before "
           "the mark; val: the last evaluation in that window)\n", 100 * WINDOW, common);
    for (int i = 0; i < n; i++) snprintf(cell[i], sizeof cell[i], "%.63s", runs[i].name);
    row(w, "tokens", n, cell);
    for (int q = 1; q <= 4; q++) {
        double at = common * q / 4;
        char label[32];
        snprintf(label, sizeof label, "%.4g", at);
        for (int i = 0; i < n; i++) {
            double tl = runs[i].n ? train_loss_at(&runs[i], at, window) : NAN, vl = runs[i].n ? val_at(&runs[i], at, window) : NAN;
            if (!isfinite(tl)) snprintf(cell[i], sizeof cell[i], "-");
            else if (isfinite(vl)) snprintf(cell[i], sizeof cell[i], "%.4f (val %.4f)", tl, vl);
            else snprintf(cell[i], sizeof cell[i], "%.4f", tl);
        }
        row(w, label, n, cell);
    }

    printf("\nthroughput (medians over the last half of each run)\n");
    double *tps = xcalloc((size_t)n, sizeof(double));
    for (int i = 0; i < n; i++) {
        tps[i] = runs[i].n ? runs_recent_median(&runs[i], RUN_TPS) : NAN;
        fmt_rate(tps[i], cell[i], sizeof cell[i]);
    }
    row(w, "tokens/s", n, cell);
    for (int i = 0; i < n; i++) {
        double m = runs[i].n ? runs_recent_median(&runs[i], RUN_MFU) : NAN;
        if (isfinite(m)) snprintf(cell[i], sizeof cell[i], "%.1f%%", 100 * m);
        else snprintf(cell[i], sizeof cell[i], "-");
    }
    row(w, "MFU", n, cell);
    for (int i = 0; i < n; i++) {
        double s = runs[i].n ? runs_recent_median(&runs[i], RUN_STEPT) : NAN;
        if (isfinite(s)) snprintf(cell[i], sizeof cell[i], "%.0f ms", 1e3 * s);
        else snprintf(cell[i], sizeof cell[i], "-");
    }
    row(w, "step time", n, cell);
    for (int i = 0; i < n; i++) runs_fmt_duration(runs[i].n ? runs[i].v[RUN_ELAPSED][runs[i].n - 1] : NAN, cell[i], sizeof cell[i]);
    row(w, "elapsed", n, cell);

    /* the verdict: validation loss at the last token count where every run
     * evaluated, else the training loss at the end of the common range */
    double at = common, best_tokens = -1;
    for (int k = runs[0].n - 1; k >= 0 && best_tokens < 0; k--) {
        double t = runs[0].v[RUN_TOKENS][k];
        if (t > common || !isfinite(runs[0].v[RUN_VAL][k])) continue;
        int all = 1;
        for (int i = 1; i < n && all; i++) all = isfinite(val_exact(&runs[i], t));
        if (all) best_tokens = t;
    }
    const char *what = best_tokens >= 0 ? "validation loss" : "training loss";
    if (best_tokens >= 0) at = best_tokens;
    double *score = xcalloc((size_t)n, sizeof(double));
    int best = -1, second = -1;
    for (int i = 0; i < n; i++) {
        score[i] = runs[i].n == 0 ? NAN : best_tokens >= 0 ? val_exact(&runs[i], at) : train_loss_at(&runs[i], at, window);
        if (!isfinite(score[i])) continue;
        if (best < 0 || score[i] < score[best]) second = best, best = i;
        else if (second < 0 || score[i] < score[second]) second = i;
    }
    printf("\nverdict: ");
    if (best < 0 || second < 0) printf("nothing to compare: fewer than two runs have a %s at %.4g tokens", what, at);
    else {
        double gap = (score[second] - score[best]) / score[second];
        if (gap < LOSS_SAME)
            printf("no clear difference in %s at %.4g tokens: %s %.4f and %s %.4f are within %.0f%%", what, at,
                   runs[best].name, score[best], runs[second].name, score[second], 100 * LOSS_SAME);
        else
            printf("%s has the lowest %s at %.4g tokens: %.4f, %.1f%% below %s (%.4f)", runs[best].name, what, at,
                   score[best], 100 * gap, runs[second].name, score[second]);
    }
    int fast = -1, slow = -1;
    for (int i = 0; i < n; i++) {
        if (!isfinite(tps[i])) continue;
        if (fast < 0 || tps[i] > tps[fast]) fast = i;
        if (slow < 0 || tps[i] < tps[slow]) slow = i;
    }
    if (fast >= 0 && slow >= 0 && fast != slow) {
        if (tps[fast] > (1 + SPEED_SAME) * tps[slow])
            printf("; %s is %.2fx as fast as %s in tokens/s", runs[fast].name, tps[fast] / tps[slow], runs[slow].name);
        else printf("; tokens/s within %.0f%%", 100 * SPEED_SAME);
    }
    printf("\n");
    free(score);
    free(tps);
done:
    free(cell);
    for (int i = 0; i < n; i++) runs_free(&runs[i]);
    free(runs);
    free(dirs);
    return KILN_EXIT_OK;
}
