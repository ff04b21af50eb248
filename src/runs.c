/* runs: metrics.jsonl, config.yaml and ranks.json[l] of a run directory read
 * into arrays. Lines being written (no newline yet) are skipped, so a live
 * run can be read at any moment. */
#include "runs.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "util.h"

static const char *field_names[RUN_NF] = {"step",      "tokens",      "loss",     "val_loss", "lr",
                                      "grad_norm", "tok_per_s",   "mfu",      "step_time_s",
                                      "elapsed_s", "eta_s",       "time",     "peak_rss_mib", "nonfinite_skipped",
                                      "data_wait_s"};

static char extra_names[RUNS_MAX_EXTRA][96];
static size_t extra_len[RUNS_MAX_EXTRA];
static int n_extra;

int runs_n_extra(void) { return n_extra; }
const char *runs_extra_name(int k) { return k >= 0 && k < n_extra ? extra_names[k] : ""; }

/* Index of extra field `name`, added if new; -1 when the table is full. The
 * lengths are kept so that a line of millions of val/ keys costs an integer
 * compare per key and entry, not a strlen (9 million keys against a full
 * table took over 60 s under the sanitizers' string checks). */
static int extra_field(const char *name, size_t len) {
    for (int k = 0; k < n_extra; k++)
        if (extra_len[k] == len && !memcmp(extra_names[k], name, len)) return RUN_NF + k;
    if (n_extra == RUNS_MAX_EXTRA || len >= sizeof extra_names[0]) return -1;
    snprintf(extra_names[n_extra], sizeof extra_names[0], "%.*s", (int)len, name);
    extra_len[n_extra] = len;
    return RUN_NF + n_extra++;
}

/* pat inside [p, end) only: strstr would run on through every later line of
 * the file, each line's search for an absent key a pass over the rest of it
 * (20,000 lines took 7 s in ./train status). NULL if absent. */
static const char *line_find(const char *p, const char *end, const char *pat) {
    /* memchr and memcmp, not memmem: AddressSanitizer's memmem checks the whole
     * rest of the line on every call, so json_extras' walk over a line of 9
     * million val/ keys was quadratic under `make sanitize` (past its 60 s). */
    size_t m = strlen(pat);
    while (p < end && (size_t)(end - p) >= m) {
        const char *c = memchr(p, pat[0], (size_t)(end - p) - m + 1);
        if (!c) return NULL;
        if (!memcmp(c, pat, m)) return c;
        p = c + 1;
    }
    return NULL;
}

/* The extra fields of one metrics.jsonl line into row i: every "val/NAME":x,
 * and "tokens_by_source":{"NAME":n,...} as tokens/NAME. */
static void json_extras(Run *r, int i, const char *line, const char *end) {
    for (const char *p = line; (p = line_find(p, end, "\"val/")); p++) {
        const char *q = memchr(p + 1, '"', (size_t)(end - p - 1));
        if (!q || q[1] != ':') continue;
        int f = extra_field(p + 1, (size_t)(q - p - 1));
        char *e;
        double v = strtod(q + 2, &e);
        if (f >= 0 && e != q + 2) r->v[f][i] = v;
    }
    const char *t = line_find(line, end, "\"tokens_by_source\":{");
    if (!t) return;
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



/* Value of "key": in a one-line flat JSON object; NAN if absent or null. The
 * leading quote keeps "loss" from matching inside "val_loss". */
double runs_json_field(const char *line, const char *end, const char *key) {
    char pat[64];
    int n = snprintf(pat, sizeof pat, "\"%s\":", key);
    for (const char *p = line; (p = line_find(p, end, pat)); p++) {
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
void runs_load(Run *r, const char *dir) {
    memset(r, 0, sizeof *r);
    kiln_strlcpy(r->dir, dir, sizeof r->dir);
    const char *base = strrchr(dir, '/');
    kiln_strlcpy(r->name, base && base[1] ? base + 1 : dir, sizeof r->name);
    char path[1200];
    size_t len = 0;
    snprintf(path, sizeof path, "%s/config.yaml", dir);
    r->config = kiln_read_file_max(path, CFG_MAX_BYTES, &len);
    scan_config(r);
    snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
    char *text = kiln_read_file(path, &len);
    if (!text && !r->config) {
        kiln_fail_hint(KILN_EXIT_USAGE, "a run directory holds config.yaml and metrics.jsonl (run.dir of the config)",
                       "%s: not a run directory (no metrics.jsonl or config.yaml)", dir);
    }
    if (!text) return;
    int line = 0;
    for (char *l = text, *end = text + len; l < end;) {
        char *nl = memchr(l, '\n', (size_t)(end - l));
        line++;
        if (!nl) break; /* a line being written: skip it */
        if (l[0] == '{') {
            if (r->n == r->cap) {
                r->cap = r->cap ? 2 * r->cap : 1024;
                for (int f = 0; f < RUN_NFX; f++) r->v[f] = xrealloc(r->v[f], (size_t)r->cap * sizeof(double));
            }
            for (int f = 0; f < RUN_NF; f++) r->v[f][r->n] = runs_json_field(l, nl, field_names[f]);
            for (int f = RUN_NF; f < RUN_NFX; f++) r->v[f][r->n] = NAN;
            json_extras(r, r->n, l, nl);
            double step = r->v[RUN_STEP][r->n];
            if (!isnan(step) && !(step >= 0 && step <= INT_MAX && step == floor(step)))
                kiln_fail(KILN_EXIT_USAGE, "%s:%d: key 'step': expected a whole number from 0 to %d, got %.17g", path,
                          line, INT_MAX, step);
            if (!isnan(step)) r->n++;
        }
        l = nl + 1;
    }
    free(text);
}

/* Runs that share a run.name (a rerun, a sweep without names) would share a
 * legend label: such runs are labelled "name (dir)", the directory being the
 * shortest trailing part of the path that tells them apart. */
void runs_label(Run *runs, int n) {
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

void runs_free(Run *r) {
    for (int f = 0; f < RUN_NFX; f++) free(r->v[f]);
    free(r->config);
}

/* Last finite value of a field, and the row it is in (-1: none). */
int runs_last_row(const Run *r, int f) {
    for (int i = r->n - 1; i >= 0; i--)
        if (isfinite(r->v[f][i])) return i;
    return -1;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of a field over its last half (past warm-up and start-up); NAN if none. */
double runs_recent_median(const Run *r, int f) {
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

int runs_json_int(const char *line, const char *end, const char *key, int dflt) {
    double v = runs_json_field(line, end, key);
    return v >= INT_MIN && v <= INT_MAX ? (int)v : dflt; /* NaN and +-inf fail both */
}

void runs_fmt_duration(double s, char *buf, size_t cap) {
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


/* ---------- config differences ---------- */

typedef struct {
    RunsConfigDiff *d;
    int run, cap;
} DiffCtx;

static void diff_cb(const char *key, const char *value, void *ctx) {
    DiffCtx *c = ctx;
    RunsConfigDiff *d = c->d;
    if (!strcmp(key, "run.name") || !strcmp(key, "run.dir")) return;
    int k = 0;
    while (k < d->nkeys && strcmp(d->key[k], key)) k++;
    if (k == d->nkeys) {
        if (d->nkeys == c->cap) {
            c->cap = c->cap ? 2 * c->cap : 128;
            d->key = xrealloc(d->key, (size_t)c->cap * sizeof(char *));
            d->val = xrealloc(d->val, (size_t)c->cap * d->nruns * sizeof(char *));
        }
        d->key[k] = xstrdup(key);
        for (int i = 0; i < d->nruns; i++) d->val[(size_t)k * d->nruns + i] = NULL;
        d->nkeys++;
    }
    char **slot = &d->val[(size_t)k * d->nruns + c->run];
    free(*slot);
    *slot = xstrdup(value);
}

void runs_config_diff(const Run *runs, int n, RunsConfigDiff *d) {
    memset(d, 0, sizeof *d);
    d->nruns = n;
    DiffCtx c = {d, 0, 0};
    for (int i = 0; i < n; i++)
        if (runs[i].config) c.run = i, cfg_flatten_yaml(runs[i].config, diff_cb, &c);
    /* keep the keys whose values are not all the same */
    int out = 0;
    for (int k = 0; k < d->nkeys; k++) {
        char **v = d->val + (size_t)k * n;
        int same = 1;
        for (int i = 1; i < n && same; i++)
            same = (!v[0] && !v[i]) || (v[0] && v[i] && !strcmp(v[0], v[i]));
        if (same) {
            for (int i = 0; i < n; i++) free(v[i]);
            free(d->key[k]);
            continue;
        }
        d->key[out] = d->key[k];
        memmove(d->val + (size_t)out * n, v, (size_t)n * sizeof(char *));
        out++;
    }
    d->nkeys = out;
}

void runs_config_diff_free(RunsConfigDiff *d) {
    for (int k = 0; k < d->nkeys; k++) {
        free(d->key[k]);
        for (int i = 0; i < d->nruns; i++) free(d->val[(size_t)k * d->nruns + i]);
    }
    free(d->key), free(d->val);
    memset(d, 0, sizeof *d);
}

/* ---------- ranks.jsonl ---------- */

/* The numbers of array "key":[...] on a line into out[0..n); 0 if absent. */
static int json_array(const char *line, const char *end, const char *key, double *out, int n) {
    char pat[64];
    int len = snprintf(pat, sizeof pat, "\"%s\":[", key);
    const char *p = line_find(line, end, pat);
    if (!p) return 0;
    p += len;
    for (int i = 0; i < n; i++) {
        char *e = (char *)p;
        double v = p < end && *p != ']' ? strtod(p, &e) : NAN; /* a short array does not read the next line */
        out[i] = e == p ? NAN : v;
        p = e;
        while (p < end && (*p == ',' || *p == ' ')) p++;
    }
    return 1;
}

/* Array length of "key":[...] (counting commas). */
static int json_array_len(const char *line, const char *end, const char *key) {
    char pat[64];
    int len = snprintf(pat, sizeof pat, "\"%s\":[", key);
    const char *p = line_find(line, end, pat);
    if (!p) return 0;
    int n = 1;
    for (p += len; p < end && *p != ']' && n <= RUNS_MAX_WORLD; p++) n += *p == ','; /* no int overflow */
    return n;
}

int runs_ranks_load(RunRanks *t, const char *dir) {
    memset(t, 0, sizeof *t);
    char path[1200];
    size_t len;
    snprintf(path, sizeof path, "%s/ranks.jsonl", dir);
    char *text = kiln_read_file(path, &len);
    if (!text) return 0;
    /* the layout of the last complete line: a run resumed on another number
     * of ranks has older lines of the old layout, which ranks.json no longer
     * describes; they are left out */
    char *end = text + len, *last = NULL, *last_nl = NULL;
    for (char *l = text; l < end;) {
        char *nl = memchr(l, '\n', (size_t)(end - l));
        if (!nl) break;
        last = l, last_nl = nl;
        l = nl + 1;
    }
    if (!last) {
        free(text);
        return 0;
    }
    t->world = json_array_len(last, last_nl, "busy_s");
    if (t->world > RUNS_MAX_WORLD) /* rows of [world] doubles would ask for terabytes: exit 1 "out of memory" */
        kiln_fail(KILN_EXIT_USAGE, "%s: key 'busy_s': more than %d ranks on the last line (the most a run can have)",
                  path, RUNS_MAX_WORLD);
    for (const char *p = last; t->ngroups < RUNS_GROUPS && (p = line_find(p, last_nl, "\"comm_")); p++) {
        char g[16];
        if (sscanf(p + 6, "%15[^\"]", g) == 1 && strlen(g) > 2 && !strcmp(g + strlen(g) - 2, "_s")) {
            g[strlen(g) - 2] = 0;
            kiln_strlcpy(t->group[t->ngroups++], g, sizeof t->group[0]);
        }
    }
    int cap = 0;
    for (char *l = text; l < end && t->world > 0;) {
        char *nl = memchr(l, '\n', (size_t)(end - l));
        if (!nl) break;
        if (json_array_len(l, nl, "busy_s") == t->world) {
            if (t->nlines == cap) {
                cap = cap ? 2 * cap : 16;
                size_t row = (size_t)cap * t->world * sizeof(double);
                t->step = xrealloc(t->step, (size_t)cap * sizeof(int));
                t->busy = xrealloc(t->busy, row), t->data = xrealloc(t->data, row);
                t->compute = xrealloc(t->compute, row), t->stept = xrealloc(t->stept, row);
                for (int g = 0; g < t->ngroups; g++) t->comm[g] = xrealloc(t->comm[g], row);
            }
            size_t o = (size_t)t->nlines * t->world;
            t->step[t->nlines] = runs_json_int(l, nl, "step", -1);
            json_array(l, nl, "busy_s", t->busy + o, t->world);
            json_array(l, nl, "data_s", t->data + o, t->world);
            json_array(l, nl, "compute_s", t->compute + o, t->world);
            json_array(l, nl, "step_s", t->stept + o, t->world);
            for (int g = 0; g < t->ngroups; g++) {
                char key[32];
                snprintf(key, sizeof key, "comm_%s_s", t->group[g]);
                if (!json_array(l, nl, key, t->comm[g] + o, t->world))
                    for (int r = 0; r < t->world; r++) t->comm[g][o + r] = 0;
            }
            t->nlines++;
        }
        l = nl + 1;
    }
    free(text);
    t->host = xcalloc((size_t)(t->world > 0 ? t->world : 1), sizeof *t->host);
    for (int r = 0; r < t->world; r++) kiln_strlcpy(t->host[r], "?", sizeof t->host[r]);
    snprintf(path, sizeof path, "%s/ranks.json", dir);
    char *hj = kiln_read_file_max(path, KILN_SMALL_FILE_MAX, &len);
    const char *p = hj ? strstr(hj, "\"hosts\":[") : NULL;
    for (int r = 0; p && r < t->world; r++) {
        p = strchr(p + (r ? 0 : 9), '"');
        if (!p) break;
        sscanf(p + 1, "%63[^\"]", t->host[r]);
        p = strchr(p + 1, '"');
        if (p) p++;
    }
    free(hj);
    if (t->nlines == 0) runs_ranks_free(t);
    return t->nlines > 0;
}

void runs_ranks_free(RunRanks *t) {
    free(t->host), free(t->step), free(t->busy), free(t->data), free(t->compute), free(t->stept);
    for (int g = 0; g < RUNS_GROUPS; g++) free(t->comm[g]);
    memset(t, 0, sizeof *t);
}

void runs_ranks_mean(const RunRanks *t, const double *series, int from, double *out) {
    if (from < 0) from = 0;
    for (int r = 0; r < t->world; r++) {
        double sum = 0;
        int n = 0;
        for (int i = from; i < t->nlines; i++) {
            double v = series[(size_t)i * t->world + r];
            if (isfinite(v)) sum += v, n++;
        }
        out[r] = n ? sum / n : NAN;
    }
}
