/* report: `./train status` and `./train report`. Reads metrics.jsonl,
 * config.yaml, heartbeat/ and checkpoints/ of run directories; writes only the
 * HTML report. The page has no scripts and loads nothing: charts are inline
 * SVG drawn here, so it opens offline and in a mail attachment. */
#include "report.h"

#include <dirent.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>

#include "runs.h"
#include "util.h"

static double wall_now(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return tv.tv_sec + tv.tv_usec * 1e-6;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* ---------- ./train status ---------- */

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static const double *sort_key; /* for cmp_rank_desc */
static int cmp_rank_desc(const void *a, const void *b) {
    double x = sort_key[*(const int *)a], y = sort_key[*(const int *)b];
    return (x < y) - (x > y);
}

/* Ranks by busy time per step, slowest first, from the last logged steps of
 * ranks.jsonl: the rank the others wait for comes first. */
static void status_ranks(const char *dir) {
    RunRanks t;
    if (!runs_ranks_load(&t, dir)) return;
    enum { LAST = 10 };
    int from = t.nlines - LAST, W = t.world;
    double *busy = xmalloc((size_t)W * sizeof(double)), *data = xmalloc((size_t)W * sizeof(double));
    double *comp = xmalloc((size_t)W * sizeof(double)), *comm = xcalloc((size_t)W * RUNS_GROUPS, sizeof(double));
    int *order = xmalloc((size_t)W * sizeof(int));
    runs_ranks_mean(&t, t.busy, from, busy);
    runs_ranks_mean(&t, t.data, from, data);
    runs_ranks_mean(&t, t.compute, from, comp);
    for (int g = 0; g < t.ngroups; g++) runs_ranks_mean(&t, t.comm[g], from, comm + (size_t)g * W);
    for (int i = 0; i < W; i++) order[i] = i;
    sort_key = busy;
    qsort(order, (size_t)W, sizeof(int), cmp_rank_desc);
    double med = W % 2 ? busy[order[W / 2]] : 0.5 * (busy[order[W / 2 - 1]] + busy[order[W / 2]]);
    printf("  ranks by busy time per step, slowest first (busy = step time minus time blocked in communication;\n"
           "  mean of the last %d logged steps, to step %d):\n", t.nlines < LAST ? t.nlines : LAST,
           t.step[t.nlines - 1]);
    int show = W <= 16 ? W : 10;
    for (int k = 0; k < show; k++) {
        int r = order[k];
        printf("    rank %-5d host %-16s busy %8.1f ms %6.2fx median | data %.1f ms, compute %.1f ms", r, t.host[r],
               1e3 * busy[r], med > 0 ? busy[r] / med : NAN, 1e3 * data[r], 1e3 * comp[r]);
        for (int g = 0; g < t.ngroups; g++) printf(", blocked in %s %.1f ms", t.group[g], 1e3 * comm[(size_t)g * W + r]);
        printf("\n");
    }
    if (show < W) printf("    ... %d faster ranks (ranks.jsonl has them all)\n", W - show);
    free(busy), free(data), free(comp), free(comm), free(order);
    runs_ranks_free(&t);
}

/* How far behind the MLflow tracking server is: the end's count
 * (summary.json) once the run ended, else rank 0's heartbeat. */
static void status_tracker(const char *dir) {
    char path[1200];
    size_t len;
    double pend = NAN;
    const char *when = "now";
    snprintf(path, sizeof path, "%s/summary.json", dir);
    char *t = kiln_read_file_max(path, KILN_SMALL_FILE_MAX, &len);
    if (t) pend = runs_json_field(t, t + len, "unsent"), when = "at the end";
    free(t);
    if (!isfinite(pend)) {
        snprintf(path, sizeof path, "%s/heartbeat/rank0.json", dir);
        t = kiln_read_file_max(path, KILN_SMALL_FILE_MAX, &len);
        if (t) pend = runs_json_field(t, t + len, "mlflow_pending"), when = "now";
        free(t);
    }
    if (!isfinite(pend)) return;
    if (pend > 0)
        printf("  mlflow       %.0f points not on the tracking server %s (%s/mlflow-spool.jsonl; a resume sends them)\n",
               pend, when, dir);
    else printf("  mlflow       every point on the tracking server %s\n", when);
}

static const char *status_usage = "usage: ./train status RUN_DIR [--stale-after SECONDS]\n";

int report_status_main(int argc, char **argv) {
    const char *dir = NULL;
    double stale_after = 0.0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--stale-after") == 0 && i + 1 < argc) {
            char *e;
            stale_after = strtod(argv[++i], &e);
            if (*e || stale_after <= 0)
                kiln_fail(KILN_EXIT_USAGE, "--stale-after: expected seconds > 0, got '%s'", argv[i]);
        } else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            fputs(status_usage, stdout);
            return KILN_EXIT_OK;
        } else if (argv[i][0] == '-') {
            fputs(status_usage, stderr);
            kiln_fail(KILN_EXIT_USAGE, "status: unknown flag '%s'", argv[i]);
        } else if (!dir) dir = argv[i];
        else kiln_fail(KILN_EXIT_USAGE, "status: one run directory at a time ('%s' and '%s')", dir, argv[i]);
    }
    if (!dir) {
        fputs(status_usage, stderr);
        kiln_fail(KILN_EXIT_USAGE, "status: no run directory given");
    }
    Run r;
    runs_load(&r, dir);
    double now = wall_now();
    printf("run %s (%s)\n", r.name, r.dir);
    int li = r.n - 1;
    if (li < 0) printf("  no steps recorded yet\n");
    else {
        int step = (int)r.v[RUN_STEP][li];
        char ago[32], el[32], eta[32];
        runs_fmt_duration(now - r.v[RUN_TIME][li], ago, sizeof ago);
        runs_fmt_duration(r.v[RUN_ELAPSED][li], el, sizeof el);
        runs_fmt_duration(r.v[RUN_ETA][li], eta, sizeof eta);
        if (r.steps_total > 0)
            printf("  last step    %d of %d (%.1f%%), %s ago\n", step, r.steps_total, 100.0 * step / r.steps_total, ago);
        else printf("  last step    %d, %s ago\n", step, ago);
        int lv = runs_last_row(&r, RUN_VAL);
        printf("  loss         %.4f", r.v[RUN_LOSS][li]);
        if (lv >= 0) printf(" | val %.4f at step %d", r.v[RUN_VAL][lv], (int)r.v[RUN_STEP][lv]);
        printf("\n");
        printf("  tokens       %.4g seen | %.0f tokens/s", r.v[RUN_TOKENS][li], runs_recent_median(&r, RUN_TPS));
        double mfu = runs_recent_median(&r, RUN_MFU);
        if (isfinite(mfu)) printf(" | MFU %.1f%%", 100 * mfu);
        printf(" (medians of the last half)\n");
        int done = r.steps_total > 0 && step >= r.steps_total;
        printf("  elapsed      %s | ETA %s\n", el, done ? "done" : eta);
        double sk = r.v[RUN_SKIP][li];
        if (isfinite(sk) && sk > 0) printf("  skipped      %.0f step(s) with non-finite values\n", sk);
        if (stale_after <= 0) {
            /* a heartbeat is rewritten at least every step: three steps' silence is a stall */
            double st = runs_recent_median(&r, RUN_STEPT);
            stale_after = isfinite(st) && 3 * st > 60.0 ? 3 * st : 60.0;
        }
    }
    if (stale_after <= 0) stale_after = 60.0;

    /* checkpoints: complete directories only (no .tmp suffix) */
    char path[1200];
    snprintf(path, sizeof path, "%s/checkpoints", dir);
    DIR *d = opendir(path);
    char *names[4096];
    int nc = 0;
    if (d) {
        struct dirent *e;
        while ((e = readdir(d)) && nc < 4096) {
            size_t l = strlen(e->d_name);
            if (strncmp(e->d_name, "step_", 5) == 0 && !(l > 4 && strcmp(e->d_name + l - 4, ".tmp") == 0))
                names[nc++] = xstrdup(e->d_name);
        }
        closedir(d);
    }
    qsort(names, (size_t)nc, sizeof(char *), cmp_str);
    printf("  checkpoints  ");
    if (!nc) printf("none");
    for (int i = 0; i < nc; i++) {
        if (nc > 6 && i == 2) {
            printf(" ... (%d more)", nc - 5);
            i = nc - 3;
            continue;
        }
        printf("%s%s", i ? " " : "", names[i]);
    }
    for (int i = 0; i < nc; i++) free(names[i]);
    snprintf(path, sizeof path, "%s/checkpoints/latest", dir);
    size_t len;
    char *latest = kiln_read_file_max(path, KILN_SMALL_FILE_MAX, &len);
    if (latest) {
        latest[strcspn(latest, "\r\n")] = 0;
        printf(" | latest: %s", latest);
        free(latest);
    }
    printf("\n");

    /* ranks: one heartbeat each */
    snprintf(path, sizeof path, "%s/heartbeat", dir);
    d = opendir(path);
    int nr = 0, nstale = 0;
    char stale[1024] = "";
    if (d) {
        struct dirent *e;
        while ((e = readdir(d))) {
            if (strncmp(e->d_name, "rank", 4) != 0) continue;
            char hp[1600];
            snprintf(hp, sizeof hp, "%s/%s", path, e->d_name);
            char *hb = kiln_read_file_max(hp, KILN_SMALL_FILE_MAX, &len);
            if (!hb) continue;
            char *end = hb + len;
            int rank = runs_json_int(hb, end, "rank", -1), step = runs_json_int(hb, end, "step", -1);
            double t = runs_json_field(hb, end, "time");
            char phase[32] = "?", host[128] = "?";
            const char *p = strstr(hb, "\"phase\":\"");
            if (p) sscanf(p + 9, "%31[^\"]", phase);
            p = strstr(hb, "\"host\":\"");
            if (p) sscanf(p + 8, "%127[^\"]", host);
            int is_stale = strcmp(phase, "done") != 0 && now - t > stale_after;
            char ago[32];
            runs_fmt_duration(now - t, ago, sizeof ago);
            printf("  rank %-7d step %d, phase %s, %s ago, host %s pid %.0f%s%s\n", rank, step, phase, ago, host,
                   runs_json_field(hb, end, "pid"), is_stale ? "  STALE" : "",
                   runs_json_field(hb, end, "stalled") == 1.0 ? " (watchdog fired)" : "");
            if (is_stale) {
                size_t o = strlen(stale);
                snprintf(stale + o, sizeof stale - o, "%s%d", nstale ? ", " : "", rank);
                nstale++;
            }
            nr++;
            free(hb);
        }
        closedir(d);
    }
    if (!nr) printf("  ranks        no heartbeat files\n");
    else if (nstale) printf("  stale ranks  %s (no heartbeat for over %.0f s)\n", stale, stale_after);
    else printf("  stale ranks  none (threshold %.0f s)\n", stale_after);
    status_tracker(dir);
    status_ranks(dir);
    runs_free(&r);
    return KILN_EXIT_OK;
}

/* ---------- ./train report ---------- */

static const char *palette[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"};
#define NPAL 8

static void html_escape(FILE *f, const char *s) {
    for (; *s; s++) {
        if (*s == '<') fputs("&lt;", f);
        else if (*s == '>') fputs("&gt;", f);
        else if (*s == '&') fputs("&amp;", f);
        else if (*s == '"') fputs("&quot;", f);
        else fputc(*s, f);
    }
}

/* A "nice" tick step (1, 2 or 5 times a power of ten) for about n ticks. */
static double nice_step(double range, int n) {
    double raw = range / n, p = pow(10, floor(log10(raw))), m = raw / p;
    return (m < 1.5 ? 1 : m < 3.5 ? 2 : m < 7.5 ? 5 : 10) * p;
}

enum { CW = 560, CH = 300, ML = 64, MR = 14, MT = 30, MB = 40 };

typedef struct {
    const char *title, *ylabel;
    int field, dashed_field; /* dashed_field: -1 = none (val loss drawn dashed over loss) */
    double scale;            /* 100 for percentages */
    int robust;              /* y range ignores the first 5% of steps (initial loss, start-up) */
} Chart;

static void svg_chart(FILE *f, const Chart *ch, Run *runs, int nr, int id) {
    double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
    int any = 0;
    for (int r = 0; r < nr; r++) {
        const Run *R = &runs[r];
        double smax = R->n ? R->v[RUN_STEP][R->n - 1] : 0, smin = R->n ? R->v[RUN_STEP][0] : 0;
        for (int i = 0; i < R->n; i++) {
            for (int k = 0; k < 2; k++) {
                int fld = k ? ch->dashed_field : ch->field;
                if (fld < 0) continue;
                double v = R->v[fld][i] * ch->scale, s = R->v[RUN_STEP][i];
                if (!isfinite(v) || !isfinite(s)) continue;
                any = 1;
                if (s < x0) x0 = s;
                if (s > x1) x1 = s;
                if (ch->robust && s < smin + 0.05 * (smax - smin) && R->n >= 20) continue;
                if (v < y0) y0 = v;
                if (v > y1) y1 = v;
            }
        }
    }
    fprintf(f, "<div class=\"chart\"><svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
               "viewBox=\"0 0 %d %d\">\n", CW, CH, CW, CH);
    fprintf(f, "<text x=\"%d\" y=\"18\" class=\"title\">", ML);
    html_escape(f, ch->title);
    fprintf(f, "</text>\n");
    if (!any || !isfinite(y0)) {
        fprintf(f, "<text x=\"%d\" y=\"%d\" class=\"empty\">no data</text></svg></div>\n", CW / 2 - 30, CH / 2);
        return;
    }
    /* a span of a few ulps (lr 0.1 and 0.10000000000000002, steps near 1e17)
     * would give a tick step that adding to a value does not change: widen
     * every axis to a millionth of its magnitude at least */
    if (!(x1 - x0 >= fabs(x0) * 1e-6) || x1 - x0 < 1) x1 = x0 + fmax(1, fabs(x0) * 1e-6);
    if (!(y1 - y0 >= fabs(y0) * 1e-6) || y1 <= y0) {
        double pad = fabs(y0) > 0 ? fabs(y0) * 0.05 : 1;
        y0 -= pad, y1 += pad;
    }
    if (!isfinite(x1 - x0) || !isfinite(y1 - y0) || !(nice_step(y1 - y0, 5) > 0)) { /* near DBL_MAX or 0 */
        fprintf(f, "<text x=\"%d\" y=\"%d\" class=\"empty\">values out of range</text></svg></div>\n", CW / 2 - 60,
                CH / 2);
        return;
    }
    double ys = nice_step(y1 - y0, 5);
    y0 = floor(y0 / ys) * ys;
    y1 = ceil(y1 / ys) * ys;
    if (ch->field != RUN_LOSS && y0 < 0 && y0 + ys > 0) y0 = 0;
    double pw = CW - ML - MR, ph = CH - MT - MB;
#define PX(s) (ML + ((s) - x0) / (x1 - x0) * pw)
#define PY(v) (MT + (y1 - (v)) / (y1 - y0) * ph)
    fprintf(f, "<defs><clipPath id=\"c%d\"><rect x=\"%d\" y=\"%d\" width=\"%.0f\" height=\"%.0f\"/></clipPath></defs>\n",
            id, ML, MT, pw, ph);
    fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%.0f\" height=\"%.0f\" class=\"frame\"/>\n", ML, MT, pw, ph);
    /* ticks counted, not stepped to: the loops end whatever the rounding */
    int ny = (int)fmin(20, floor((y1 - y0) / ys + 1e-6));
    for (int k = 0; k <= ny; k++) {
        double y = y0 + k * ys, py = PY(y);
        fprintf(f, "<line x1=\"%d\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" class=\"grid\"/>", ML, ML + pw, py, py);
        double yv = fabs(y) < ys * 1e-6 ? 0.0 : y;
        if (fabs(yv) >= 1e4) fprintf(f, "<text x=\"%d\" y=\"%.1f\" class=\"yt\">%.4gk</text>\n", ML - 6, py + 4, yv / 1e3);
        else fprintf(f, "<text x=\"%d\" y=\"%.1f\" class=\"yt\">%.4g</text>\n", ML - 6, py + 4, yv);
    }
    double xs = nice_step(x1 - x0, 6), xt = ceil(x0 / xs) * xs;
    int nx = (int)fmin(20, floor((x1 - xt) / xs + 1e-6));
    for (int k = 0; k <= nx; k++) {
        double x = xt + k * xs, px = PX(x);
        fprintf(f, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%d\" y2=\"%.1f\" class=\"grid\"/>", px, px, MT, MT + ph);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" class=\"xt\">%.6g</text>\n", px, MT + ph + 16, x);
    }
    fprintf(f, "<text x=\"%.1f\" y=\"%d\" class=\"xl\">step</text>", ML + pw / 2, CH - 4);
    fprintf(f, "<text x=\"14\" y=\"%.1f\" class=\"yl\" transform=\"rotate(-90 14 %.1f)\">", MT + ph / 2, MT + ph / 2);
    html_escape(f, ch->ylabel);
    fprintf(f, "</text>\n<g clip-path=\"url(#c%d)\">\n", id);
    for (int r = 0; r < nr; r++) {
        const Run *R = &runs[r];
        const char *col = palette[r % NPAL];
        for (int k = 0; k < 2; k++) {
            int fld = k ? ch->dashed_field : ch->field;
            if (fld < 0) continue;
            int cnt = 0;
            for (int i = 0; i < R->n; i++) cnt += isfinite(R->v[fld][i]);
            /* long runs: at most ~1200 points per line, each the mean of its bucket */
            int bucket = cnt > 1200 ? (cnt + 1199) / 1200 : 1;
            fprintf(f, "<polyline class=\"%s\" stroke=\"%s\" points=\"", k ? "val" : "ln", col);
            double sx = 0, sy = 0;
            int in = 0;
            for (int i = 0; i < R->n; i++) {
                double v = R->v[fld][i] * ch->scale;
                if (!isfinite(v)) continue;
                sx += R->v[RUN_STEP][i], sy += v, in++;
                if (in == bucket) {
                    fprintf(f, "%.1f,%.1f ", PX(sx / in), PY(sy / in));
                    sx = sy = 0, in = 0;
                }
            }
            if (in) fprintf(f, "%.1f,%.1f ", PX(sx / in), PY(sy / in));
            fprintf(f, "\"/>\n");
            if (k && cnt <= 200) /* sparse evaluations: mark each one */
                for (int i = 0; i < R->n; i++)
                    if (isfinite(R->v[fld][i]))
                        fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>", PX(R->v[RUN_STEP][i]),
                                PY(R->v[fld][i] * ch->scale), col);
        }
    }
    fprintf(f, "</g>\n");
    /* legend, top right: one entry per run (and "val" when a dashed series shows) */
    int has_dashed = 0;
    if (ch->dashed_field >= 0)
        for (int r = 0; r < nr; r++) has_dashed |= runs_last_row(&runs[r], ch->dashed_field) >= 0;
    int entries = nr * (has_dashed ? 2 : 1), row = 0;
    if (entries > 1)
        for (int r = 0; r < nr; r++)
            for (int k = 0; k < (has_dashed ? 2 : 1); k++, row++) {
                double ly = MT + 14 + 15 * row, lx = ML + pw - 150;
                fprintf(f, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" class=\"%s\" stroke=\"%s\"/>", lx,
                        lx + 22, ly - 4, ly - 4, k ? "val" : "ln", palette[r % NPAL]);
                fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" class=\"lg\">", lx + 28, ly);
                html_escape(f, runs[r].name);
                fprintf(f, "%s</text>\n", k ? " (val)" : has_dashed ? " (train)" : "");
            }
#undef PX
#undef PY
    fprintf(f, "</svg></div>\n");
}

/* ---------- per-rank charts (ranks.jsonl) ---------- */

static const char *part_colors[] = {"#ff7f0e", "#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2"};

/* Axis frame, y grid and labels for [0, y1] (y1 rounded up to a nice step);
 * returns the rounded y1. */
static double svg_frame(FILE *f, const char *title, const char *ylabel, const char *xlabel, double y1, int id) {
    fprintf(f, "<div class=\"chart\"><svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
               "viewBox=\"0 0 %d %d\">\n<text x=\"%d\" y=\"18\" class=\"title\">", CW, CH, CW, CH, ML);
    html_escape(f, title);
    fprintf(f, "</text>\n");
    if (!(y1 > 0) || !isfinite(y1)) y1 = 1;
    double ys = nice_step(y1, 5);
    y1 = ceil(y1 / ys) * ys;
    double pw = CW - ML - MR, ph = CH - MT - MB;
    fprintf(f, "<defs><clipPath id=\"c%d\"><rect x=\"%d\" y=\"%d\" width=\"%.0f\" height=\"%.0f\"/></clipPath></defs>\n",
            id, ML, MT, pw, ph);
    fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%.0f\" height=\"%.0f\" class=\"frame\"/>\n", ML, MT, pw, ph);
    for (double y = 0; y <= y1 + ys * 1e-6; y += ys) {
        double py = MT + (y1 - y) / y1 * ph;
        fprintf(f, "<line x1=\"%d\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" class=\"grid\"/>", ML, ML + pw, py, py);
        fprintf(f, "<text x=\"%d\" y=\"%.1f\" class=\"yt\">%.4g</text>\n", ML - 6, py + 4, y);
    }
    fprintf(f, "<text x=\"%.1f\" y=\"%d\" class=\"xl\">", ML + pw / 2, CH - 4);
    html_escape(f, xlabel);
    fprintf(f, "</text><text x=\"14\" y=\"%.1f\" class=\"yl\" transform=\"rotate(-90 14 %.1f)\">", MT + ph / 2,
            MT + ph / 2);
    html_escape(f, ylabel);
    fprintf(f, "</text>\n");
    return y1;
}

static void svg_legend(FILE *f, int n, const char *const *names, const char *const *colors) {
    for (int k = 0; k < n; k++) {
        double ly = MT + 14 + 15 * k, lx = CW - MR - 150;
        fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"12\" height=\"10\" fill=\"%s\"/>", lx, ly - 9, colors[k]);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" class=\"lg\">", lx + 18, ly);
        html_escape(f, names[k]);
        fprintf(f, "</text>\n");
    }
}

/* One stacked bar per rank: mean data wait, compute and time blocked in each
 * group over the last half of the logged steps. In a synchronous job every
 * bar is about one step long; who computes while the others wait shows. */
static void svg_rank_bars(FILE *f, const RunRanks *t, int id) {
    int W = t->world, from = t->nlines / 2, np = 2 + t->ngroups;
    double *part = xcalloc((size_t)np * W, sizeof(double));
    runs_ranks_mean(t, t->data, from, part);
    runs_ranks_mean(t, t->compute, from, part + W);
    for (int g = 0; g < t->ngroups; g++) runs_ranks_mean(t, t->comm[g], from, part + (size_t)(2 + g) * W);
    double top = 0, worst = -1;
    int slow = 0;
    for (int r = 0; r < W; r++) {
        double sum = 0;
        for (int k = 0; k < np; k++) sum += isfinite(part[(size_t)k * W + r]) ? 1e3 * part[(size_t)k * W + r] : 0;
        if (sum > top) top = sum;
        double busy = part[r] + part[W + r];
        if (busy > worst) worst = busy, slow = r;
    }
    char title[160];
    snprintf(title, sizeof title, "Per rank: where a step goes (slowest: rank %d, %s)", slow, t->host[slow]);
    /* headroom above the bars for the legend */
    double y1 = svg_frame(f, title, "ms per step", W <= 32 ? "rank" : "rank (every rank a bar)", 1.35 * top, id);
    double pw = CW - ML - MR, ph = CH - MT - MB, bw = pw / W;
    fprintf(f, "<g clip-path=\"url(#c%d)\">\n", id);
    for (int r = 0; r < W; r++) {
        double y = 0;
        for (int k = 0; k < np; k++) {
            double v = 1e3 * part[(size_t)k * W + r];
            if (!isfinite(v) || v <= 0) continue;
            double py = MT + (y1 - y - v) / y1 * ph, h = v / y1 * ph;
            fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"%s\">", ML + r * bw + bw * 0.1,
                    py, bw * 0.8 > 1 ? bw * 0.8 : 1, h, part_colors[k % 6]);
            fprintf(f, "<title>rank %d (%s): %s %.2f ms</title></rect>\n", r, t->host[r],
                    k == 0 ? "data" : k == 1 ? "compute" : t->group[k - 2], v);
            y += v;
        }
    }
    fprintf(f, "</g>\n");
    int every = W <= 32 ? 1 : (W + 15) / 16;
    for (int r = 0; r < W; r += every)
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" class=\"xt\">%d</text>\n", ML + (r + 0.5) * bw, MT + ph + 16, r);
    const char *names[2 + RUNS_GROUPS], *cols[2 + RUNS_GROUPS];
    char gname[RUNS_GROUPS][40];
    names[0] = "data wait", names[1] = "compute";
    for (int g = 0; g < t->ngroups; g++) snprintf(gname[g], sizeof gname[g], "blocked in %s", t->group[g]), names[2 + g] = gname[g];
    for (int k = 0; k < np; k++) cols[k] = part_colors[k % 6];
    svg_legend(f, np, names, cols);
    fprintf(f, "</svg></div>\n");
    free(part);
}

/* Busy time per rank over the logged steps: one line a rank up to 8 ranks,
 * else the min, median and max over the ranks. */
static void svg_rank_lines(FILE *f, const RunRanks *t, int id) {
    int W = t->world, N = t->nlines, nl = W <= 8 ? W : 3;
    double *y = xmalloc((size_t)nl * N * sizeof(double)), *tmp = xmalloc((size_t)W * sizeof(double));
    double top = 0;
    for (int i = 0; i < N; i++) {
        const double *b = t->busy + (size_t)i * W;
        if (W <= 8)
            for (int r = 0; r < W; r++) y[(size_t)r * N + i] = 1e3 * b[r];
        else {
            memcpy(tmp, b, (size_t)W * sizeof(double));
            qsort(tmp, (size_t)W, sizeof(double), cmp_double);
            y[i] = 1e3 * tmp[0], y[N + i] = 1e3 * tmp[W / 2], y[2 * N + i] = 1e3 * tmp[W - 1];
        }
    }
    for (size_t k = 0; k < (size_t)nl * N; k++)
        if (isfinite(y[k]) && y[k] > top) top = y[k];
    double y1 = svg_frame(f, "Per rank: busy time per step (step minus time blocked)", "ms per step", "step",
                          (1.0 + 0.1 * nl) * top, id);
    double x0 = t->step[0], x1 = t->step[N - 1] > x0 ? t->step[N - 1] : x0 + 1;
    double pw = CW - ML - MR, ph = CH - MT - MB, xs = nice_step(x1 - x0, 6);
    for (double x = ceil(x0 / xs) * xs; x <= x1 + xs * 1e-6; x += xs)
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" class=\"xt\">%.6g</text>\n", ML + (x - x0) / (x1 - x0) * pw,
                MT + ph + 16, x);
    fprintf(f, "<g clip-path=\"url(#c%d)\">\n", id);
    int bucket = N > 600 ? (N + 599) / 600 : 1; /* at most ~600 points a line, each a bucket's mean */
    for (int k = 0; k < nl; k++) {
        fprintf(f, "<polyline class=\"ln\" stroke=\"%s\" points=\"", palette[k % NPAL]);
        for (int i = 0; i < N; i += bucket) {
            double sx = 0, sy = 0;
            int c = 0;
            for (int j = i; j < i + bucket && j < N; j++)
                if (isfinite(y[(size_t)k * N + j])) sx += t->step[j], sy += y[(size_t)k * N + j], c++;
            if (c) fprintf(f, "%.1f,%.1f ", ML + (sx / c - x0) / (x1 - x0) * pw, MT + (y1 - sy / c) / y1 * ph);
        }
        fprintf(f, "\"/>\n");
    }
    fprintf(f, "</g>\n");
    const char *names[8], *cols[8];
    char nm[8][96];
    for (int k = 0; k < nl; k++) {
        if (W <= 8) snprintf(nm[k], sizeof nm[k], "rank %d (%s)", k, t->host[k]);
        else snprintf(nm[k], sizeof nm[k], "%s of %d ranks", k == 0 ? "min" : k == 1 ? "median" : "max", W);
        names[k] = nm[k], cols[k] = palette[k % NPAL];
    }
    svg_legend(f, nl, names, cols);
    fprintf(f, "</svg></div>\n");
    free(y), free(tmp);
}

/* Config differences of several runs, one row per key that differs. */
static void html_config_diff(FILE *f, Run *runs, int nd) {
    RunsConfigDiff d;
    runs_config_diff(runs, nd, &d);
    fprintf(f, "<h2>Config differences</h2>\n");
    if (d.nkeys == 0) fprintf(f, "<div class=\"sub\">The configs are the same (run.name and run.dir aside).</div>\n");
    else {
        fprintf(f, "<table><tr><th>key</th>");
        for (int i = 0; i < nd; i++) {
            fprintf(f, "<th><span class=\"sw\" style=\"background:%s\"></span>", palette[i % NPAL]);
            html_escape(f, runs[i].name);
            fprintf(f, "</th>");
        }
        fprintf(f, "</tr>\n");
        for (int k = 0; k < d.nkeys; k++) {
            fprintf(f, "<tr><td>");
            html_escape(f, d.key[k]);
            fprintf(f, "</td>");
            for (int i = 0; i < nd; i++) {
                const char *v = d.val[(size_t)k * nd + i];
                fprintf(f, "<td>");
                html_escape(f, !v ? "(absent)" : !*v ? "\"\"" : v);
                fprintf(f, "</td>");
            }
            fprintf(f, "</tr>\n");
        }
        fprintf(f, "</table>\n<div class=\"sub\">run.name and run.dir are left out; (absent): a config.yaml "
                   "written before the key existed.</div>\n");
    }
    runs_config_diff_free(&d);
}

/* More than one source of data.train among the runs: the tokens per source
 * say something (one source's are the run's tokens). */
static int report_mixed(void) {
    int n = 0;
    for (int k = 0; k < runs_n_extra(); k++) n += !strncmp(runs_extra_name(k), "tokens/", 7);
    return n > 1;
}

/* Each run's last tokens per source, as counts and shares, and its last loss
 * on each named validation set. */
static void report_data_table(FILE *f, Run *runs, int nd) {
    int vals = 0;
    for (int k = 0; k < runs_n_extra(); k++) vals += !strncmp(runs_extra_name(k), "val/", 4);
    if (!vals && !report_mixed()) return;
    fprintf(f, "<h2>Data</h2>\n<table><tr><th>run</th><th>step</th>");
    for (int k = 0; k < runs_n_extra(); k++) {
        fputs("<th>", f);
        html_escape(f, runs_extra_name(k));
        fputs("</th>", f);
    }
    fputs("</tr>\n", f);
    for (int i = 0; i < nd; i++) {
        Run *R = &runs[i];
        double total = 0;
        for (int k = 0; k < runs_n_extra(); k++) {
            int l = runs_last_row(R, RUN_NF + k);
            if (l >= 0 && strncmp(runs_extra_name(k), "val/", 4)) total += R->v[RUN_NF + k][l];
        }
        fprintf(f, "<tr><td><span class=\"sw\" style=\"background:%s\"></span>", palette[i % NPAL]);
        html_escape(f, R->name);
        fprintf(f, "</td><td>%d</td>", R->n ? (int)R->v[RUN_STEP][R->n - 1] : 0);
        for (int k = 0; k < runs_n_extra(); k++) {
            int l = runs_last_row(R, RUN_NF + k);
            double v = l >= 0 ? R->v[RUN_NF + k][l] : NAN;
            if (l < 0) fputs("<td>-</td>", f);
            else if (!strncmp(runs_extra_name(k), "val/", 4)) fprintf(f, "<td>%.4f</td>", v);
            else fprintf(f, "<td>%.4g (%.1f%%)</td>", v, total > 0 ? 100 * v / total : 0.0);
        }
        fputs("</tr>\n", f);
    }
    fprintf(f, "</table>\n<div class=\"sub\">tokens/NAME: tokens drawn from each source of data.train so far (share of "
               "all drawn); val/NAME: the last loss on each named validation set.</div>\n");
}

static const char *report_usage = "usage: ./train report RUN_DIR [RUN_DIR...] [-o FILE]\n";

static const char *css =
    "body{font:14px/1.4 -apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:24px;color:#222;background:#fff}"
    "h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:24px 0 8px}"
    ".sub{color:#666;margin-bottom:16px}"
    "table{border-collapse:collapse}td,th{padding:4px 10px;border-bottom:1px solid #ddd;text-align:right}"
    "th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}"
    ".sw{display:inline-block;width:12px;height:12px;margin-right:6px;vertical-align:-1px}"
    ".charts{display:flex;flex-wrap:wrap;gap:12px}.chart{border:1px solid #e4e4e4}"
    "svg text{font:11px Helvetica,Arial,sans-serif;fill:#444}svg .title{font-size:14px;font-weight:bold;fill:#222}"
    "svg .yt{text-anchor:end}svg .xt,svg .xl,svg .yl{text-anchor:middle}svg .lg{fill:#222}"
    "svg .frame{fill:none;stroke:#bbb}svg .grid{stroke:#eee}"
    "svg .ln{fill:none;stroke-width:2;stroke-linejoin:round}"
    "svg .val{fill:none;stroke-width:2;stroke-dasharray:6 4}"
    "pre{background:#f7f7f7;border:1px solid #e4e4e4;padding:8px;font-size:12px;max-height:420px;overflow:auto}"
    "details{margin:6px 0}summary{cursor:pointer;font-weight:bold}";

int report_html_main(int argc, char **argv) {
    const char *out = NULL;
    const char **dirs = xcalloc((size_t)argc, sizeof(char *));
    int nd = 0;
    for (int i = 1; i < argc; i++) {
        if ((strcmp(argv[i], "-o") == 0 || strcmp(argv[i], "--out") == 0) && i + 1 < argc) out = argv[++i];
        else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            fputs(report_usage, stdout);
            free(dirs);
            return KILN_EXIT_OK;
        } else if (argv[i][0] == '-') {
            fputs(report_usage, stderr);
            kiln_fail(KILN_EXIT_USAGE, "report: unknown flag '%s'", argv[i]);
        } else dirs[nd++] = argv[i];
    }
    if (!nd) {
        fputs(report_usage, stderr);
        kiln_fail(KILN_EXIT_USAGE, "report: no run directory given");
    }
    char def[1200];
    if (!out) {
        snprintf(def, sizeof def, "%s/report.html", dirs[0]);
        out = def;
    }
    if (report_write_html(dirs, nd, out) != 0) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot write the report", out);
    printf("report: %s (%d run%s)\n", out, nd, nd > 1 ? "s" : "");
    free(dirs);
    return KILN_EXIT_OK;
}

int report_write_html(const char *const *dirs, int nd, const char *out) {
    Run *runs = xcalloc((size_t)nd, sizeof(Run));
    for (int i = 0; i < nd; i++) runs_load(&runs[i], dirs[i]);
    runs_label(runs, nd);
    char *html = NULL;
    size_t hlen = 0;
    FILE *f = open_memstream(&html, &hlen);
    if (!f) kiln_fail(KILN_EXIT_RUNTIME, "open_memstream failed");

    time_t t = time(NULL);
    char date[64];
    strftime(date, sizeof date, "%Y-%m-%d %H:%M %Z", localtime(&t));
    fprintf(f, "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>kiln report: ");
    for (int i = 0; i < nd; i++) {
        if (i) fputs(", ", f);
        html_escape(f, runs[i].name);
    }
    fprintf(f, "</title>\n<style>%s</style></head><body>\n", css);
    fprintf(f, "<h1>kiln report</h1><div class=\"sub\">%d run%s &middot; generated %s by kiln %s</div>\n", nd,
            nd > 1 ? "s" : "", date, KILN_VERSION);

    fprintf(f, "<h2>Summary</h2>\n<table><tr><th>run</th><th>steps</th><th>tokens</th><th>final loss</th>"
               "<th>last val loss</th><th>best val loss</th><th>tokens/s</th><th>MFU</th><th>step time</th>"
               "<th>elapsed</th><th>peak RSS</th><th>skipped</th></tr>\n");
    for (int i = 0; i < nd; i++) {
        Run *R = &runs[i];
        int li = R->n - 1, lv = runs_last_row(R, RUN_VAL), lo = runs_last_row(R, RUN_LOSS);
        double best = INFINITY;
        for (int k = 0; k < R->n; k++)
            if (isfinite(R->v[RUN_VAL][k]) && R->v[RUN_VAL][k] < best) best = R->v[RUN_VAL][k];
        fprintf(f, "<tr><td><span class=\"sw\" style=\"background:%s\"></span>", palette[i % NPAL]);
        html_escape(f, R->name);
        fprintf(f, " <small>(");
        html_escape(f, R->dir);
        fprintf(f, ")</small></td>");
        if (li < 0) {
            fprintf(f, "<td colspan=\"11\">no steps recorded</td></tr>\n");
            continue;
        }
        char el[32];
        runs_fmt_duration(R->v[RUN_ELAPSED][li], el, sizeof el);
        double mfu = runs_recent_median(R, RUN_MFU);
        fprintf(f, "<td>%d", (int)R->v[RUN_STEP][li]);
        if (R->steps_total) fprintf(f, " / %d", R->steps_total);
        fprintf(f, "</td><td>%.4g</td><td>%.4f</td>", R->v[RUN_TOKENS][li], lo >= 0 ? R->v[RUN_LOSS][lo] : NAN);
        if (lv >= 0) fprintf(f, "<td>%.4f (step %d)</td><td>%.4f</td>", R->v[RUN_VAL][lv], (int)R->v[RUN_STEP][lv], best);
        else fprintf(f, "<td>-</td><td>-</td>");
        fprintf(f, "<td>%.0f</td>", runs_recent_median(R, RUN_TPS));
        if (isfinite(mfu)) fprintf(f, "<td>%.1f%%</td>", 100 * mfu);
        else fprintf(f, "<td>-</td>");
        fprintf(f, "<td>%.0f ms</td><td>%s</td><td>%.0f MiB</td><td>%.0f</td></tr>\n", 1e3 * runs_recent_median(R, RUN_STEPT),
                el, R->v[RUN_RSS][li], isfinite(R->v[RUN_SKIP][li]) ? R->v[RUN_SKIP][li] : 0.0);
    }
    fprintf(f, "</table>\n<div class=\"sub\">tokens/s, MFU and step time: medians over the last half of each "
               "run. Loss charts: solid = training, dashed with dots = validation.</div>\n");

    static const Chart charts[] = {
        {"Loss", "loss (nats/token)", RUN_LOSS, RUN_VAL, 1, 1},
        {"Learning rate", "learning rate", RUN_LR, -1, 1, 0},
        {"Gradient norm (before clipping)", "global L2 norm", RUN_GN, -1, 1, 1},
        {"Throughput", "tokens/s", RUN_TPS, -1, 1, 1},
        {"Model FLOPs utilisation", "MFU (%)", RUN_MFU, -1, 100, 1},
        {"Step time", "seconds", RUN_STEPT, -1, 1, 1},
    };
    fprintf(f, "<h2>Charts</h2>\n<div class=\"charts\">\n");
    int nc = (int)(sizeof charts / sizeof charts[0]);
    for (int c = 0; c < nc; c++) svg_chart(f, &charts[c], runs, nd, c);
    /* data: the wait per step, then each named validation set and each source's tokens */
    int any_wait = 0;
    for (int i = 0; i < nd; i++) any_wait |= runs_last_row(&runs[i], RUN_WAIT) >= 0;
    if (any_wait) {
        Chart w = {"Data wait per step", "milliseconds", RUN_WAIT, -1, 1000, 1};
        svg_chart(f, &w, runs, nd, nc++);
    }
    for (int pass = 0; pass < 2; pass++)
        for (int k = 0; k < runs_n_extra(); k++) {
            const char *x = runs_extra_name(k);
            int is_val = !strncmp(x, "val/", 4);
            if (is_val != (pass == 0) || (!is_val && !report_mixed())) continue;
            char title[160];
            snprintf(title, sizeof title, is_val ? "Validation loss: %s" : "Tokens seen: %s", strchr(x, '/') + 1);
            Chart ch = {title, is_val ? "loss (nats/token)" : "tokens", RUN_NF + k, -1, 1, is_val};
            svg_chart(f, &ch, runs, nd, nc++);
        }
    fprintf(f, "</div>\n");
    report_data_table(f, runs, nd);
    if (nd > 1) html_config_diff(f, runs, nd);
    int id = nc;
    for (int i = 0; i < nd; i++) {
        RunRanks rk;
        if (!runs_ranks_load(&rk, runs[i].dir)) continue;
        fprintf(f, "<h2>Ranks: ");
        html_escape(f, runs[i].name);
        fprintf(f, " (%d ranks)</h2>\n<div class=\"charts\">\n", rk.world);
        svg_rank_bars(f, &rk, id++);
        svg_rank_lines(f, &rk, id++);
        fprintf(f, "</div>\n<div class=\"sub\">From ranks.jsonl: every rank's timings at each logged step. Bars: "
                   "means over the last half of the logged steps; busy = data wait + compute, the time a rank "
                   "does not wait for the others.</div>\n");
        runs_ranks_free(&rk);
    }
    fprintf(f, "<h2>Configs</h2>\n");
    for (int i = 0; i < nd; i++) {
        fprintf(f, "<details%s><summary><span class=\"sw\" style=\"background:%s\"></span>", nd == 1 ? " open" : "",
                palette[i % NPAL]);
        html_escape(f, runs[i].name);
        fprintf(f, " &mdash; config.yaml</summary><pre>");
        html_escape(f, runs[i].config ? runs[i].config : "(no config.yaml)");
        fprintf(f, "</pre></details>\n");
    }
    fprintf(f, "</body></html>\n");
    fclose(f);
    int rc = kiln_write_file_atomic(out, html, hlen);
    free(html);
    for (int i = 0; i < nd; i++) runs_free(&runs[i]);
    free(runs);
    return rc;
}
