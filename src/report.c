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

#include "util.h"

/* ---------- reading a run ---------- */

enum { F_STEP, F_TOKENS, F_LOSS, F_VAL, F_LR, F_GN, F_TPS, F_MFU, F_STEPT, F_ELAPSED, F_ETA, F_TIME, F_RSS, F_SKIP,
       F_WAIT, NF };
static const char *field_names[NF] = {"step",      "tokens",      "loss",     "val_loss", "lr",
                                      "grad_norm", "tok_per_s",   "mfu",      "step_time_s",
                                      "elapsed_s", "eta_s",       "time",     "peak_rss_mib", "nonfinite_skipped",
                                      "data_wait_s"};
/* Fields named by the run's config, found while reading: "val/<set>" of each
 * named validation set and "tokens/<source>" of each "tokens_by_source"
 * entry; field NF + k of every run is extra_names[k] (NAN where absent). */
#define MAX_EXTRA 48
static char extra_names[MAX_EXTRA][96];
static int n_extra;
#define NFX (NF + MAX_EXTRA)

typedef struct {
    char dir[1024];
    char name[256];
    int steps_total;   /* train.steps from config.yaml; 0 if unknown */
    char *config;      /* config.yaml text, or NULL */
    int n, cap;
    double *v[NFX];    /* v[field][row]; NAN where absent or null */
} Run;

/* Value of "key": in a one-line flat JSON object; NAN if absent or null. The
 * leading quote keeps "loss" from matching inside "val_loss". */
static double json_field(const char *line, const char *end, const char *key) {
    char pat[64];
    int n = snprintf(pat, sizeof pat, "\"%s\":", key);
    for (const char *p = line; p < end && (p = strstr(p, pat)) != NULL && p < end; p++) {
        const char *v = p + n;
        if (*v == 'n') return NAN;
        if (*v == 't') return 1.0; /* true */
        if (*v == 'f') return 0.0;
        char *e;
        double x = strtod(v, &e);
        return e == v ? NAN : x;
    }
    return NAN;
}

/* Index of extra field `name`, added if new; -1 when the table is full. */
static int extra_field(const char *name, size_t len) {
    for (int k = 0; k < n_extra; k++)
        if (strlen(extra_names[k]) == len && !strncmp(extra_names[k], name, len)) return NF + k;
    if (n_extra == MAX_EXTRA || len >= sizeof extra_names[0]) return -1;
    snprintf(extra_names[n_extra], sizeof extra_names[0], "%.*s", (int)len, name);
    return NF + n_extra++;
}

/* The extra fields of one metrics.jsonl line into row i: every "val/NAME":x,
 * and "tokens_by_source":{"NAME":n,...} as tokens/NAME. */
static void json_extras(Run *r, int i, const char *line, const char *end) {
    for (const char *p = line; p < end && (p = strstr(p, "\"val/")) && p < end; p++) {
        const char *q = memchr(p + 1, '"', (size_t)(end - p - 1));
        if (!q || q[1] != ':') continue;
        int f = extra_field(p + 1, (size_t)(q - p - 1));
        if (f >= 0) r->v[f][i] = strtod(q + 2, NULL);
    }
    const char *t = strstr(line, "\"tokens_by_source\":{");
    if (!t || t >= end) return;
    for (const char *p = t + 20; p < end && *p == '"';) {
        const char *q = memchr(p + 1, '"', (size_t)(end - p - 1));
        if (!q || q[1] != ':') return;
        char name[96];
        snprintf(name, sizeof name, "tokens/%.*s", (int)(q - p - 1), p + 1);
        int f = extra_field(name, strlen(name));
        char *e;
        double v = strtod(q + 2, &e);
        if (f >= 0) r->v[f][i] = v;
        p = *e == ',' ? e + 1 : e;
    }
}

/* train.steps and run.name from the resolved config (written by
 * cfg_write_yaml: sections at column 0, keys indented by two). */
static void scan_config(Run *r) {
    if (!r->config) return;
    char section[64] = "";
    for (const char *l = r->config; *l;) {
        const char *nl = strchr(l, '\n');
        size_t len = nl ? (size_t)(nl - l) : strlen(l);
        char line[512];
        snprintf(line, sizeof line, "%.*s", (int)(len < 511 ? len : 511), l);
        if (line[0] != ' ' && line[0] != '#' && strchr(line, ':')) sscanf(line, "%63[^:]", section);
        if (strcmp(section, "train") == 0 && strncmp(line, "  steps:", 8) == 0) r->steps_total = atoi(line + 8);
        if (strcmp(section, "run") == 0 && strncmp(line, "  name:", 7) == 0) {
            char *s = line + 7;
            while (*s == ' ' || *s == '"') s++;
            char *e = s + strlen(s);
            while (e > s && (e[-1] == '"' || e[-1] == ' ')) *--e = 0;
            if (*s) kiln_strlcpy(r->name, s, sizeof r->name);
        }
        l = nl ? nl + 1 : l + len;
    }
}

/* Load RUN_DIR; exits 2 naming the directory when it holds no run. */
static void run_load(Run *r, const char *dir) {
    memset(r, 0, sizeof *r);
    kiln_strlcpy(r->dir, dir, sizeof r->dir);
    const char *base = strrchr(dir, '/');
    kiln_strlcpy(r->name, base && base[1] ? base + 1 : dir, sizeof r->name);
    char path[1200];
    size_t len = 0;
    snprintf(path, sizeof path, "%s/config.yaml", dir);
    r->config = kiln_read_file(path, &len);
    scan_config(r);
    snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
    char *text = kiln_read_file(path, &len);
    if (!text && !r->config) {
        kiln_fail_hint(KILN_EXIT_USAGE, "a run directory holds config.yaml and metrics.jsonl (run.dir of the config)",
                       "%s: not a run directory (no metrics.jsonl or config.yaml)", dir);
    }
    if (!text) return;
    for (char *l = text, *end = text + len; l < end;) {
        char *nl = memchr(l, '\n', (size_t)(end - l));
        if (!nl) break; /* a line being written: skip it */
        if (l[0] == '{') {
            if (r->n == r->cap) {
                r->cap = r->cap ? 2 * r->cap : 1024;
                for (int f = 0; f < NFX; f++) r->v[f] = xrealloc(r->v[f], (size_t)r->cap * sizeof(double));
            }
            for (int f = 0; f < NF; f++) r->v[f][r->n] = json_field(l, nl, field_names[f]);
            for (int f = NF; f < NFX; f++) r->v[f][r->n] = NAN;
            json_extras(r, r->n, l, nl);
            if (!isnan(r->v[F_STEP][r->n])) r->n++;
        }
        l = nl + 1;
    }
    free(text);
}

/* Runs that share a run.name (a rerun, a sweep without names) would share a
 * legend label: such runs are labelled "name (dir)", the directory being the
 * shortest trailing part of the path that tells them apart. */
static void label_runs(Run *runs, int n) {
    int *clash = xcalloc((size_t)n, sizeof(int)); /* decided on the names as loaded */
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) clash[i] |= j != i && strcmp(runs[i].name, runs[j].name) == 0;
    for (int i = 0; i < n; i++) {
        if (!clash[i]) continue;
        /* grow the suffix of the directory path one component at a time */
        const char *d = runs[i].dir, *suffix = d + strlen(d);
        while (suffix > d && suffix[-1] == '/') suffix--;
        size_t end = (size_t)(suffix - d);
        for (;;) {
            const char *p = suffix;
            while (p > d && p[-1] == '/') p--;
            while (p > d && p[-1] != '/') p--;
            suffix = p;
            int unique = 1;
            for (int j = 0; j < n; j++) {
                if (j == i) continue;
                const char *o = runs[j].dir;
                size_t ol = strlen(o), sl = end - (size_t)(suffix - d);
                while (ol && o[ol - 1] == '/') ol--;
                if (ol >= sl && strncmp(o + ol - sl, suffix, sl) == 0 && (ol == sl || o[ol - sl - 1] == '/')) unique = 0;
            }
            if (unique || suffix == d) break;
        }
        char label[sizeof runs[i].name];
        snprintf(label, sizeof label, "%s (%.*s)", runs[i].name, (int)(end - (size_t)(suffix - d)), suffix);
        kiln_strlcpy(runs[i].name, label, sizeof runs[i].name);
    }
    free(clash);
}

static void run_free(Run *r) {
    for (int f = 0; f < NFX; f++) free(r->v[f]);
    free(r->config);
}

/* Last finite value of a field, and the row it is in (-1: none). */
static int last_row(const Run *r, int f) {
    for (int i = r->n - 1; i >= 0; i--)
        if (isfinite(r->v[f][i])) return i;
    return -1;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of a field over its last half (past warm-up and start-up); NAN if none. */
static double recent_median(const Run *r, int f) {
    double *t = xmalloc((size_t)(r->n + 1) * sizeof(double));
    int k = 0;
    for (int i = r->n / 2; i < r->n; i++)
        if (isfinite(r->v[f][i])) t[k++] = r->v[f][i];
    double m = NAN;
    if (k) {
        qsort(t, (size_t)k, sizeof(double), cmp_double);
        m = k % 2 ? t[k / 2] : 0.5 * (t[k / 2 - 1] + t[k / 2]);
    }
    free(t);
    return m;
}

static void fmt_duration(double s, char *buf, size_t cap) {
    if (!isfinite(s) || s < 0) {
        snprintf(buf, cap, "-");
        return;
    }
    long t = (long)(s + 0.5);
    if (t >= 86400) snprintf(buf, cap, "%ldd %ldh %02ldm", t / 86400, t / 3600 % 24, t / 60 % 60);
    else if (t >= 3600) snprintf(buf, cap, "%ldh %02ldm %02lds", t / 3600, t / 60 % 60, t % 60);
    else if (t >= 60) snprintf(buf, cap, "%ldm %02lds", t / 60, t % 60);
    else snprintf(buf, cap, "%lds", t);
}

static double wall_now(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return tv.tv_sec + tv.tv_usec * 1e-6;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* ---------- ./train status ---------- */

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
    run_load(&r, dir);
    double now = wall_now();
    printf("run %s (%s)\n", r.name, r.dir);
    int li = r.n - 1;
    if (li < 0) printf("  no steps recorded yet\n");
    else {
        int step = (int)r.v[F_STEP][li];
        char ago[32], el[32], eta[32];
        fmt_duration(now - r.v[F_TIME][li], ago, sizeof ago);
        fmt_duration(r.v[F_ELAPSED][li], el, sizeof el);
        fmt_duration(r.v[F_ETA][li], eta, sizeof eta);
        if (r.steps_total > 0)
            printf("  last step    %d of %d (%.1f%%), %s ago\n", step, r.steps_total, 100.0 * step / r.steps_total, ago);
        else printf("  last step    %d, %s ago\n", step, ago);
        int lv = last_row(&r, F_VAL);
        printf("  loss         %.4f", r.v[F_LOSS][li]);
        if (lv >= 0) printf(" | val %.4f at step %d", r.v[F_VAL][lv], (int)r.v[F_STEP][lv]);
        printf("\n");
        printf("  tokens       %.4g seen | %.0f tokens/s", r.v[F_TOKENS][li], recent_median(&r, F_TPS));
        double mfu = recent_median(&r, F_MFU);
        if (isfinite(mfu)) printf(" | MFU %.1f%%", 100 * mfu);
        printf(" (medians of the last half)\n");
        int done = r.steps_total > 0 && step >= r.steps_total;
        printf("  elapsed      %s | ETA %s\n", el, done ? "done" : eta);
        double sk = r.v[F_SKIP][li];
        if (isfinite(sk) && sk > 0) printf("  skipped      %.0f step(s) with non-finite values\n", sk);
        if (stale_after <= 0) {
            /* a heartbeat is rewritten at least every step: three steps' silence is a stall */
            double st = recent_median(&r, F_STEPT);
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
    char *latest = kiln_read_file(path, &len);
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
            char *hb = kiln_read_file(hp, &len);
            if (!hb) continue;
            char *end = hb + len;
            int rank = (int)json_field(hb, end, "rank"), step = (int)json_field(hb, end, "step");
            double t = json_field(hb, end, "time");
            char phase[32] = "?", host[128] = "?";
            const char *p = strstr(hb, "\"phase\":\"");
            if (p) sscanf(p + 9, "%31[^\"]", phase);
            p = strstr(hb, "\"host\":\"");
            if (p) sscanf(p + 8, "%127[^\"]", host);
            int is_stale = strcmp(phase, "done") != 0 && now - t > stale_after;
            char ago[32];
            fmt_duration(now - t, ago, sizeof ago);
            printf("  rank %-7d step %d, phase %s, %s ago, host %s pid %.0f%s%s\n", rank, step, phase, ago, host,
                   json_field(hb, end, "pid"), is_stale ? "  STALE" : "",
                   json_field(hb, end, "stalled") == 1.0 ? " (watchdog fired)" : "");
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
    run_free(&r);
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
        double smax = R->n ? R->v[F_STEP][R->n - 1] : 0, smin = R->n ? R->v[F_STEP][0] : 0;
        for (int i = 0; i < R->n; i++) {
            for (int k = 0; k < 2; k++) {
                int fld = k ? ch->dashed_field : ch->field;
                if (fld < 0) continue;
                double v = R->v[fld][i] * ch->scale, s = R->v[F_STEP][i];
                if (!isfinite(v)) continue;
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
    if (x1 <= x0) x1 = x0 + 1;
    if (y1 <= y0) {
        double pad = fabs(y0) > 0 ? fabs(y0) * 0.05 : 1;
        y0 -= pad, y1 += pad;
    }
    double ys = nice_step(y1 - y0, 5);
    y0 = floor(y0 / ys) * ys;
    y1 = ceil(y1 / ys) * ys;
    if (ch->field != F_LOSS && y0 < 0 && y0 + ys > 0) y0 = 0;
    double pw = CW - ML - MR, ph = CH - MT - MB;
#define PX(s) (ML + ((s) - x0) / (x1 - x0) * pw)
#define PY(v) (MT + (y1 - (v)) / (y1 - y0) * ph)
    fprintf(f, "<defs><clipPath id=\"c%d\"><rect x=\"%d\" y=\"%d\" width=\"%.0f\" height=\"%.0f\"/></clipPath></defs>\n",
            id, ML, MT, pw, ph);
    fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%.0f\" height=\"%.0f\" class=\"frame\"/>\n", ML, MT, pw, ph);
    for (double y = y0; y <= y1 + ys * 1e-6; y += ys) {
        double py = PY(y);
        fprintf(f, "<line x1=\"%d\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" class=\"grid\"/>", ML, ML + pw, py, py);
        double yv = fabs(y) < ys * 1e-6 ? 0.0 : y;
        if (fabs(yv) >= 1e4) fprintf(f, "<text x=\"%d\" y=\"%.1f\" class=\"yt\">%.4gk</text>\n", ML - 6, py + 4, yv / 1e3);
        else fprintf(f, "<text x=\"%d\" y=\"%.1f\" class=\"yt\">%.4g</text>\n", ML - 6, py + 4, yv);
    }
    double xs = nice_step(x1 - x0, 6);
    for (double x = ceil(x0 / xs) * xs; x <= x1 + xs * 1e-6; x += xs) {
        double px = PX(x);
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
                sx += R->v[F_STEP][i], sy += v, in++;
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
                        fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>", PX(R->v[F_STEP][i]),
                                PY(R->v[fld][i] * ch->scale), col);
        }
    }
    fprintf(f, "</g>\n");
    /* legend, top right: one entry per run (and "val" when a dashed series shows) */
    int has_dashed = 0;
    if (ch->dashed_field >= 0)
        for (int r = 0; r < nr; r++) has_dashed |= last_row(&runs[r], ch->dashed_field) >= 0;
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

/* More than one source of data.train among the runs: the tokens per source
 * say something (one source's are the run's tokens). */
static int report_mixed(void) {
    int n = 0;
    for (int k = 0; k < n_extra; k++) n += !strncmp(extra_names[k], "tokens/", 7);
    return n > 1;
}

/* Each run's last tokens per source, as counts and shares, and its last loss
 * on each named validation set. */
static void report_data_table(FILE *f, Run *runs, int nd) {
    int vals = 0;
    for (int k = 0; k < n_extra; k++) vals += !strncmp(extra_names[k], "val/", 4);
    if (!vals && !report_mixed()) return;
    fprintf(f, "<h2>Data</h2>\n<table><tr><th>run</th><th>step</th>");
    for (int k = 0; k < n_extra; k++) {
        fputs("<th>", f);
        html_escape(f, extra_names[k]);
        fputs("</th>", f);
    }
    fputs("</tr>\n", f);
    for (int i = 0; i < nd; i++) {
        Run *R = &runs[i];
        double total = 0;
        for (int k = 0; k < n_extra; k++) {
            int l = last_row(R, NF + k);
            if (l >= 0 && strncmp(extra_names[k], "val/", 4)) total += R->v[NF + k][l];
        }
        fprintf(f, "<tr><td><span class=\"sw\" style=\"background:%s\"></span>", palette[i % NPAL]);
        html_escape(f, R->name);
        fprintf(f, "</td><td>%d</td>", R->n ? (int)R->v[F_STEP][R->n - 1] : 0);
        for (int k = 0; k < n_extra; k++) {
            int l = last_row(R, NF + k);
            double v = l >= 0 ? R->v[NF + k][l] : NAN;
            if (l < 0) fputs("<td>-</td>", f);
            else if (!strncmp(extra_names[k], "val/", 4)) fprintf(f, "<td>%.4f</td>", v);
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
    Run *runs = xcalloc((size_t)nd, sizeof(Run));
    for (int i = 0; i < nd; i++) run_load(&runs[i], dirs[i]);
    label_runs(runs, nd);
    char def[1200];
    if (!out) {
        snprintf(def, sizeof def, "%s/report.html", dirs[0]);
        out = def;
    }
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
        int li = R->n - 1, lv = last_row(R, F_VAL), lo = last_row(R, F_LOSS);
        double best = INFINITY;
        for (int k = 0; k < R->n; k++)
            if (isfinite(R->v[F_VAL][k]) && R->v[F_VAL][k] < best) best = R->v[F_VAL][k];
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
        fmt_duration(R->v[F_ELAPSED][li], el, sizeof el);
        double mfu = recent_median(R, F_MFU);
        fprintf(f, "<td>%d", (int)R->v[F_STEP][li]);
        if (R->steps_total) fprintf(f, " / %d", R->steps_total);
        fprintf(f, "</td><td>%.4g</td><td>%.4f</td>", R->v[F_TOKENS][li], lo >= 0 ? R->v[F_LOSS][lo] : NAN);
        if (lv >= 0) fprintf(f, "<td>%.4f (step %d)</td><td>%.4f</td>", R->v[F_VAL][lv], (int)R->v[F_STEP][lv], best);
        else fprintf(f, "<td>-</td><td>-</td>");
        fprintf(f, "<td>%.0f</td>", recent_median(R, F_TPS));
        if (isfinite(mfu)) fprintf(f, "<td>%.1f%%</td>", 100 * mfu);
        else fprintf(f, "<td>-</td>");
        fprintf(f, "<td>%.0f ms</td><td>%s</td><td>%.0f MiB</td><td>%.0f</td></tr>\n", 1e3 * recent_median(R, F_STEPT),
                el, R->v[F_RSS][li], isfinite(R->v[F_SKIP][li]) ? R->v[F_SKIP][li] : 0.0);
    }
    fprintf(f, "</table>\n<div class=\"sub\">tokens/s, MFU and step time: medians over the last half of each "
               "run. Loss charts: solid = training, dashed with dots = validation.</div>\n");

    static const Chart charts[] = {
        {"Loss", "loss (nats/token)", F_LOSS, F_VAL, 1, 1},
        {"Learning rate", "learning rate", F_LR, -1, 1, 0},
        {"Gradient norm (before clipping)", "global L2 norm", F_GN, -1, 1, 1},
        {"Throughput", "tokens/s", F_TPS, -1, 1, 1},
        {"Model FLOPs utilisation", "MFU (%)", F_MFU, -1, 100, 1},
        {"Step time", "seconds", F_STEPT, -1, 1, 1},
    };
    fprintf(f, "<h2>Charts</h2>\n<div class=\"charts\">\n");
    int nc = (int)(sizeof charts / sizeof charts[0]);
    for (int c = 0; c < nc; c++) svg_chart(f, &charts[c], runs, nd, c);
    /* data: the wait per step, then each named validation set and each source's tokens */
    int any_wait = 0;
    for (int i = 0; i < nd; i++) any_wait |= last_row(&runs[i], F_WAIT) >= 0;
    if (any_wait) {
        Chart w = {"Data wait per step", "milliseconds", F_WAIT, -1, 1000, 1};
        svg_chart(f, &w, runs, nd, nc++);
    }
    for (int pass = 0; pass < 2; pass++)
        for (int k = 0; k < n_extra; k++) {
            const char *x = extra_names[k];
            int is_val = !strncmp(x, "val/", 4);
            if (is_val != (pass == 0) || (!is_val && !report_mixed())) continue;
            char title[160];
            snprintf(title, sizeof title, is_val ? "Validation loss: %s" : "Tokens seen: %s", strchr(x, '/') + 1);
            Chart ch = {title, is_val ? "loss (nats/token)" : "tokens", NF + k, -1, 1, is_val};
            svg_chart(f, &ch, runs, nd, nc++);
        }
    fprintf(f, "</div>\n");
    report_data_table(f, runs, nd);
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
    if (kiln_write_file_atomic(out, html, hlen) != 0) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot write the report", out);
    printf("report: %s (%d run%s)\n", out, nd, nd > 1 ? "s" : "");
    free(html);
    for (int i = 0; i < nd; i++) run_free(&runs[i]);
    free(runs);
    free(dirs);
    return KILN_EXIT_OK;
}
