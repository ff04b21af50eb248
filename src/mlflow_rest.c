/* mlflow_rest: a run on an MLflow tracking server through its REST API
 * (/api/2.0/mlflow/..., artifacts through /api/2.0/mlflow-artifacts/), HTTP
 * and TLS by libcurl. The training thread only queues (a bounded ring of
 * points, a list of params, tags and files); one sender thread talks to the
 * server. Points the server has not confirmed go to RUN_DIR/mlflow-spool.jsonl,
 * in order, and are sent from there when it answers again; a retried batch
 * carries the same timestamps, and MLflow's stores keep one copy of a point
 * (key, timestamp, step, value) logged twice, so a reply lost after the
 * server wrote a batch duplicates nothing. Secrets live in memory only. */
#include "mlflow_rest.h"

#include "config.h"
#include "testhooks.h"
#include "util.h"

#ifdef KILN_CURL
#include <curl/curl.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <pwd.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "json.h"

#define MR_RING (1 << 16) /* points queued in memory: 6,500 steps of ten metrics */
#define MR_KEYS 64
#define MR_BATCH 1000     /* MLflow's limit of metrics (and entities) per log-batch */
#define MR_PARAMS 100     /* ... of params, and of tags, per log-batch */
#define MR_PARAM_MAX 6000 /* ... of a param's value, in characters */
#define MR_TAG_MAX 8000
#define MR_BACKOFF_MAX 10.0 /* seconds between tries while the server is down */

typedef struct {
    long long ts; /* ms since the epoch, fixed when logged: a resend is the same point */
    double value;
    int step, key;
} MrPoint;

enum { OP_PARAM, OP_TAG, OP_ARTIFACT, OP_STATUS };
typedef struct MrOp {
    struct MrOp *next;
    int kind;
    char *key, *value; /* OP_ARTIFACT: name, local path; OP_STATUS: status, end time */
} MrOp;

/* steps of one metric the server already holds (sorted: mr_have) */
typedef struct {
    char key[64];
    int *step, n;
} MrHave;

struct MlRest {
    char base[CFG_STR];      /* the server's URL, no trailing '/' */
    char exp_name[CFG_STR], exp_id[64], run_id[64], art[1024]; /* art: the artifact path under the proxy */
    char run_dir[CFG_STR], run_name[CFG_STR], user[128];
    char spool_path[CFG_STR + 32], json_path[CFG_STR + 32], stage[CFG_STR + 32];
    int start_step, resumed, required;
    double flush_s, timeout_s; /* timeout_s: of one exchange (short for the try at open, which the start waits on) */
    long long start_ms;
    /* auth, from the environment; never printed */
    char *token, *username, *password, *ca_path;
    int insecure;
    CURL *curl;
    struct curl_slist *hdr;
    char cerr[CURL_ERROR_SIZE];
    int resend; /* test hook mlflow_resend (testhooks.h): every batch twice, as after a lost reply */
    int hold;   /* test hook mlflow_hold: points stay in the queue, as when a kill -9 finds it full */
    int backfilled; /* a resume's mr_backfill ran */

    pthread_t thread;
    int thread_on;
    pthread_mutex_t lock;
    pthread_cond_t wake, idle;
    /* under lock */
    MrPoint *ring; /* [MR_RING] */
    size_t head, count;
    MrOp *ops, **ops_tail;
    int ending, stop, kick, busy;
    long dropped; /* queue full: points lost (the run never waits) */
    char keys[MR_KEYS][64];
    int nkeys;
    /* sender thread only (and the caller before it starts / after it ends) */
    atomic_int abort;
    atomic_long pending;
    int ready, status_sent, art_warned, param_warned, refused_warned, down_warned;
    FILE *spool;
    long spool_off, spool_n; /* read offset; points from there on */
    MrHave have[MR_KEYS];
    int nhave;
};

static long long mr_now_ms(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (long long)tv.tv_sec * 1000 + tv.tv_usec / 1000;
}

/* A JSON string: quotes, backslashes and control bytes escaped; at most max bytes of s. */
static void mr_json_str(FILE *f, const char *s, size_t max) {
    fputc('"', f);
    for (size_t i = 0; s[i] && i < max; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') fputc('\\', f), fputc(c, f);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

/* A URL query value, percent-encoded. */
static void mr_query(char *out, size_t cap, const char *s) {
    size_t n = 0;
    for (const unsigned char *p = (const unsigned char *)s; *p && n + 4 < cap; p++) {
        if ((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || strchr("-._~", *p))
            out[n++] = (char)*p;
        else n += (size_t)snprintf(out + n, cap - n, "%%%02X", *p);
    }
    out[n] = 0;
}

/* ---------- HTTP ---------- */

typedef struct {
    char *body;
    size_t len;
    long code;        /* HTTP status; 0: no answer (cerr says why) */
    JsonValue *json;  /* the body parsed, when it is JSON */
    char msg[512];    /* what a refusal or failure says, one line, for the user */
} MrResp;

static size_t mr_write_cb(char *p, size_t size, size_t n, void *ctx) {
    MrResp *r = ctx;
    size_t add = size * n;
    if (r->len + add > ((size_t)64 << 20)) return 0; /* an answer this large is not MLflow's */
    r->body = xrealloc(r->body, r->len + add + 1);
    memcpy(r->body + r->len, p, add);
    r->len += add;
    r->body[r->len] = 0;
    return add;
}

/* mlrest_end's deadline: an exchange in flight is cut short */
static int mr_progress_cb(void *ctx, curl_off_t dt, curl_off_t dn, curl_off_t ut, curl_off_t un) {
    MlRest *r = ctx;
    return atomic_load(&r->abort) ? 1 : 0;
}

static void mr_resp_free(MrResp *a) {
    free(a->body);
    json_free(a->json);
    memset(a, 0, sizeof *a);
}

static const char *mr_jstr(const JsonValue *v, const char *key) {
    const JsonValue *x = json_get(v, key);
    return x && x->kind == JSON_STRING ? x->str : NULL;
}

/* One exchange: method on base + path with a JSON (or, for a PUT, raw) body.
 * Returns the HTTP status, 0 when the server did not answer. */
static long mr_http(MlRest *r, const char *method, const char *path, const char *body, size_t len, double timeout_s,
                    MrResp *out) {
    memset(out, 0, sizeof *out);
    char url[CFG_STR + 2048];
    snprintf(url, sizeof url, "%s%s", r->base, path);
    CURL *c = r->curl;
    curl_easy_reset(c);
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, r->hdr);
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, r->cerr);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, mr_write_cb);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, out);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, 5000L);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)(timeout_s * 1000));
    curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, mr_progress_cb);
    curl_easy_setopt(c, CURLOPT_XFERINFODATA, r);
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
    if (r->username) {
        curl_easy_setopt(c, CURLOPT_HTTPAUTH, (long)CURLAUTH_BASIC);
        curl_easy_setopt(c, CURLOPT_USERNAME, r->username);
        curl_easy_setopt(c, CURLOPT_PASSWORD, r->password ? r->password : "");
    }
    if (r->insecure) {
        curl_easy_setopt(c, CURLOPT_SSL_VERIFYPEER, 0L);
        curl_easy_setopt(c, CURLOPT_SSL_VERIFYHOST, 0L);
    }
    if (r->ca_path) curl_easy_setopt(c, CURLOPT_CAINFO, r->ca_path);
    if (!strcmp(method, "POST") || !strcmp(method, "PUT")) {
        curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body ? body : "");
        curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)len);
    }
    r->cerr[0] = 0;
    CURLcode rc = curl_easy_perform(c);
    if (rc != CURLE_OK) {
        snprintf(out->msg, sizeof out->msg, "%s", r->cerr[0] ? r->cerr : curl_easy_strerror(rc));
        kiln_one_line(out->msg);
        return out->code = 0;
    }
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &out->code);
    char err[128];
    if (out->body) out->json = json_parse(out->body, out->len, err, sizeof err);
    if (out->code != 200) {
        const char *ec = out->json ? mr_jstr(out->json, "error_code") : NULL;
        const char *m = out->json ? mr_jstr(out->json, "message") : NULL;
        if (ec || m) snprintf(out->msg, sizeof out->msg, "HTTP %ld %s%s%.300s", out->code, ec ? ec : "", ec && m ? ": " : "", m ? m : "");
        else snprintf(out->msg, sizeof out->msg, "HTTP %ld%s%.120s", out->code, out->len ? ": " : "", out->body ? out->body : "");
        kiln_one_line(out->msg);
    }
    return out->code;
}

/* A failure worth trying again: no answer, the server's own trouble, or too many requests. */
static int mr_transient(long code) { return code == 0 || code == 429 || code >= 500; }

static long mr_post(MlRest *r, const char *path, const char *body, size_t len, MrResp *out) {
    return mr_http(r, "POST", path, body, len, r->timeout_s, out);
}

/* ---------- the run ---------- */

static void mr_write_json(MlRest *r) {
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    fputs("{\"server\":", f);
    mr_json_str(f, r->base, SIZE_MAX);
    fprintf(f, ",\"experiment_id\":\"%s\",\"run_id\":\"%s\"}\n", r->exp_id, r->run_id);
    fclose(f);
    if (kiln_write_file_atomic(r->json_path, text, len) != 0)
        kiln_warn("metrics.mlflow: %s: cannot write (%s)", r->json_path, strerror(errno));
    free(text);
}

/* The run RUN_DIR/mlflow.json names on this server: 1 with exp and run set. */
static int mr_remembered(MlRest *r, char *exp, char *run) {
    size_t len;
    char *text = kiln_read_file_max(r->json_path, KILN_SMALL_FILE_MAX, &len), err[128];
    if (!text) return 0;
    JsonValue *v = json_parse(text, len, err, sizeof err);
    free(text);
    const char *s = v ? mr_jstr(v, "server") : NULL, *e = v ? mr_jstr(v, "experiment_id") : NULL,
               *u = v ? mr_jstr(v, "run_id") : NULL;
    int ok = s && e && u && !strcmp(s, r->base) && strlen(e) < 64 && strlen(u) < 64 && *u;
    if (ok) strcpy(exp, e), strcpy(run, u);
    json_free(v);
    return ok;
}

/* Where the run's artifacts go: the part of an mlflow-artifacts: URI the
 * proxy takes ("" when the server keeps them elsewhere). */
static void mr_set_artifacts(MlRest *r, const char *uri) {
    r->art[0] = 0;
    if (!uri || strncmp(uri, "mlflow-artifacts:", 17)) return;
    const char *p = uri + 17;
    if (!strncmp(p, "//", 2)) { /* mlflow-artifacts://host:port/path */
        p = strchr(p + 2, '/');
        if (!p) return;
    }
    while (*p == '/') p++;
    snprintf(r->art, sizeof r->art, "%s", p);
}

/* A refusal that trying again will not change: 401, 403, a 404 that is not
 * MLflow's "no such experiment or run" (no MLflow server at this URL), any
 * other 4xx but 429. */
static int mr_refusal(const MrResp *a) {
    if (a->code < 400 || a->code >= 500 || a->code == 429) return 0;
    const char *ec = a->json ? mr_jstr(a->json, "error_code") : NULL;
    return !(a->code == 404 && ec && !strcmp(ec, "RESOURCE_DOES_NOT_EXIST"));
}

/* The steps each metric of a resumed run already has past start_step: the
 * killed process sent them after its last checkpoint, and the resumed one
 * logs those steps again; sent twice, the history would hold them twice. */
static int mr_step_cmp(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

static long mr_fetch_history(MlRest *r, const JsonValue *run) {
    const JsonValue *data = json_get(run, "data"), *ms = data ? json_get(data, "metrics") : NULL;
    for (int i = 0; i < r->nhave; i++) free(r->have[i].step); /* a setup tried again fetches it again */
    memset(r->have, 0, sizeof r->have);
    r->nhave = 0;
    for (int i = 0; ms && ms->kind == JSON_ARRAY && i < ms->n && r->nhave < MR_KEYS; i++) {
        const char *key = mr_jstr(&ms->items[i], "key");
        if (!key || strlen(key) >= 64) continue;
        MrHave *h = &r->have[r->nhave++];
        snprintf(h->key, sizeof h->key, "%s", key);
        char q[256], path[512], tok[1024] = "";
        mr_query(q, sizeof q, key);
        for (;;) {
            char qt[1200] = "";
            if (tok[0]) {
                snprintf(qt, sizeof qt, "&page_token=");
                mr_query(qt + strlen(qt), sizeof qt - strlen(qt), tok);
            }
            snprintf(path, sizeof path, "/api/2.0/mlflow/metrics/get-history?run_id=%s&metric_key=%s&max_results=25000%s",
                     r->run_id, q, qt);
            MrResp a;
            long code = mr_http(r, "GET", path, NULL, 0, r->timeout_s, &a);
            if (code != 200) {
                mr_resp_free(&a);
                return code;
            }
            const JsonValue *hist = a.json ? json_get(a.json, "metrics") : NULL;
            for (int k = 0; hist && hist->kind == JSON_ARRAY && k < hist->n; k++) {
                const JsonValue *st = json_get(&hist->items[k], "step");
                long s = !st ? 0 : st->kind == JSON_NUMBER ? (long)st->num : st->kind == JSON_STRING ? atol(st->str) : 0;
                h->step = xrealloc(h->step, sizeof(int) * (size_t)(h->n + 1));
                h->step[h->n++] = (int)s;
            }
            const char *next = a.json ? mr_jstr(a.json, "next_page_token") : NULL;
            snprintf(tok, sizeof tok, "%s", next ? next : "");
            mr_resp_free(&a);
            if (!tok[0]) break;
        }
        if (h->n) qsort(h->step, (size_t)h->n, sizeof(int), mr_step_cmp);
    }
    return 200;
}

static int mr_have(const MlRest *r, const char *key, int step) {
    for (int i = 0; i < r->nhave; i++)
        if (!strcmp(r->have[i].key, key))
            return r->have[i].n && bsearch(&step, r->have[i].step, (size_t)r->have[i].n, sizeof(int), mr_step_cmp);
    return 0;
}

static void mr_log_at(MlRest *r, const char *key, double value, int step, long long ts);

static int mr_u64_cmp(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* The metrics.jsonl fields metrics.c's mlflow_step logs under the same names. */
static const char *const mr_jsonl_keys[] = {"loss",         "val_loss",     "lr",
                                            "grad_norm",    "tok_per_s",    "mfu",
                                            "step_time_s",  "peak_rss_mib", "peak_device_mib",
                                            "nonfinite_skipped"};
enum { MR_JSONL_KEYS = sizeof mr_jsonl_keys / sizeof *mr_jsonl_keys };

/* A resume, once the server's history is known: the points of the steps up
 * to the checkpoint that metrics.jsonl holds and neither the server nor the
 * spool does (a kill -9 lost the killed process's queue), queued again with
 * their line's time as timestamp (a second resume queues the same points,
 * which MLflow keeps once) and metrics.jsonl's 6 digits. The steps past the
 * checkpoint run again and are logged by this process. */
static void mr_backfill(MlRest *r) {
    r->backfilled = 1;
    uint64_t *spooled = NULL; /* (key index << 32) | step of the spool's points */
    size_t ns = 0, cap = 0;
    char line[512];
    FILE *f = fopen(r->spool_path, "r");
    while (f && fgets(line, sizeof line, f)) {
        char key[128];
        const char *s = strstr(line, "\"step\":");
        if (!s || sscanf(line, "{\"key\":\"%127[^\"]\"", key) != 1) continue;
        for (int k = 0; k < MR_JSONL_KEYS; k++) {
            if (strcmp(key, mr_jsonl_keys[k])) continue;
            if (ns == cap) spooled = xrealloc(spooled, sizeof *spooled * (cap = cap ? 2 * cap : 256));
            spooled[ns++] = (uint64_t)k << 32 | (uint32_t)atoi(s + 7);
        }
    }
    if (f) fclose(f);
    if (ns) qsort(spooled, ns, sizeof *spooled, mr_u64_cmp);
    char path[CFG_STR + 32];
    snprintf(path, sizeof path, "%s/metrics.jsonl", r->run_dir);
    f = fopen(path, "r");
    char *l = NULL;
    size_t lcap = 0;
    ssize_t n;
    long queued = 0;
    while (f && (n = getline(&l, &lcap, f)) > 0) {
        char jerr[64];
        JsonValue *v = json_parse(l, (size_t)n, jerr, sizeof jerr);
        const JsonValue *st = v ? json_get(v, "step") : NULL, *tm = v ? json_get(v, "time") : NULL;
        if (st && st->kind == JSON_NUMBER && st->num >= 0 && st->num <= r->start_step) {
            int step = (int)st->num;
            long long ts = tm && tm->kind == JSON_NUMBER ? llround(tm->num * 1000.0) : r->start_ms;
            for (int k = 0; k < MR_JSONL_KEYS; k++) {
                const JsonValue *x = json_get(v, mr_jsonl_keys[k]);
                uint64_t id = (uint64_t)k << 32 | (uint32_t)step;
                if (!x || x->kind != JSON_NUMBER || mr_have(r, mr_jsonl_keys[k], step)) continue;
                if (ns && bsearch(&id, spooled, ns, sizeof *spooled, mr_u64_cmp)) continue;
                mr_log_at(r, mr_jsonl_keys[k], x->num, step, ts);
                queued++;
            }
        }
        json_free(v);
    }
    if (f) fclose(f);
    free(l), free(spooled);
    if (queued)
        kiln_warn("metrics.mlflow: %ld points of steps up to %d were in metrics.jsonl but not on %s (the last process "
                  "ended before sending them): sent now", queued, r->start_step, r->base);
}

/* Continue the remembered run: 200, or the failing answer (404: it is gone). */
static long mr_continue(MlRest *r, MrResp *a) {
    char path[256];
    snprintf(path, sizeof path, "/api/2.0/mlflow/runs/get?run_id=%s", r->run_id);
    long code = mr_http(r, "GET", path, NULL, 0, r->timeout_s, a);
    if (code != 200) return code;
    const JsonValue *run = json_get(a->json, "run"), *info = run ? json_get(run, "info") : NULL;
    const char *exp = info ? mr_jstr(info, "experiment_id") : NULL;
    if (!exp || strlen(exp) >= sizeof r->exp_id) {
        snprintf(a->msg, sizeof a->msg, "runs/get answered without the run's experiment");
        return a->code = 502;
    }
    snprintf(r->exp_id, sizeof r->exp_id, "%s", exp);
    mr_set_artifacts(r, mr_jstr(info, "artifact_uri"));
    code = mr_fetch_history(r, run);
    if (code != 200) return code;
    if (!r->backfilled) mr_backfill(r);
    char body[256];
    int n = snprintf(body, sizeof body, "{\"run_id\":\"%s\",\"status\":\"RUNNING\"}", r->run_id);
    MrResp b;
    code = mr_post(r, "/api/2.0/mlflow/runs/update", body, (size_t)n, &b);
    if (code != 200) snprintf(a->msg, sizeof a->msg, "%s", b.msg), a->code = code;
    mr_resp_free(&b);
    return code;
}

/* The experiment's id, found by name or created. */
static long mr_experiment(MlRest *r, MrResp *a) {
    char q[3 * CFG_STR], path[3 * CFG_STR + 64];
    mr_query(q, sizeof q, r->exp_name);
    for (int tries = 0; tries < 2; tries++) {
        snprintf(path, sizeof path, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=%s", q);
        long code = mr_http(r, "GET", path, NULL, 0, r->timeout_s, a);
        if (code == 200) {
            const JsonValue *e = a->json ? json_get(a->json, "experiment") : NULL;
            const char *id = e ? mr_jstr(e, "experiment_id") : NULL;
            if (!id || strlen(id) >= sizeof r->exp_id) {
                snprintf(a->msg, sizeof a->msg, "experiments/get-by-name answered without an experiment id");
                return a->code = 502;
            }
            snprintf(r->exp_id, sizeof r->exp_id, "%s", id);
            return 200;
        }
        if (code != 404 || mr_refusal(a)) return code;
        mr_resp_free(a);
        char *body = NULL;
        size_t len = 0;
        FILE *f = open_memstream(&body, &len);
        fputs("{\"name\":", f);
        mr_json_str(f, r->exp_name, SIZE_MAX);
        fputc('}', f);
        fclose(f);
        code = mr_post(r, "/api/2.0/mlflow/experiments/create", body, len, a);
        free(body);
        const char *id = code == 200 && a->json ? mr_jstr(a->json, "experiment_id") : NULL;
        if (id && strlen(id) < sizeof r->exp_id) {
            snprintf(r->exp_id, sizeof r->exp_id, "%s", id);
            return 200;
        }
        const char *ec = a->json ? mr_jstr(a->json, "error_code") : NULL;
        if (!ec || strcmp(ec, "RESOURCE_ALREADY_EXISTS")) return code == 200 ? (a->code = 502) : code;
        mr_resp_free(a); /* made by a job racing this one: read it again */
    }
    return a->code;
}

/* A run of this directory left RUNNING (killed with kill -9) that this start
 * does not continue: KILLED, so the server does not show it running forever. */
static void mr_close_orphan(MlRest *r) {
    char exp[64], run[64], path[256];
    if (!mr_remembered(r, exp, run)) return;
    snprintf(path, sizeof path, "/api/2.0/mlflow/runs/get?run_id=%s", run);
    MrResp a;
    if (mr_http(r, "GET", path, NULL, 0, r->timeout_s, &a) == 200) {
        const JsonValue *run_v = json_get(a.json, "run"), *info = run_v ? json_get(run_v, "info") : NULL;
        const char *st = info ? mr_jstr(info, "status") : NULL;
        if (st && !strcmp(st, "RUNNING")) {
            char body[256];
            int n = snprintf(body, sizeof body, "{\"run_id\":\"%s\",\"status\":\"KILLED\",\"end_time\":%lld}", run, mr_now_ms());
            MrResp b;
            mr_post(r, "/api/2.0/mlflow/runs/update", body, (size_t)n, &b);
            mr_resp_free(&b);
        }
    }
    mr_resp_free(&a);
}

static long mr_create(MlRest *r, MrResp *a) {
    long code = mr_experiment(r, a);
    if (code != 200) return code;
    mr_resp_free(a);
    mr_close_orphan(r);
    char *body = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&body, &len);
    fprintf(f, "{\"experiment_id\":\"%s\",\"start_time\":%lld,\"run_name\":", r->exp_id, r->start_ms);
    mr_json_str(f, r->run_name, SIZE_MAX);
    fputs(",\"user_id\":", f);
    mr_json_str(f, r->user, SIZE_MAX);
    fputc('}', f);
    fclose(f);
    code = mr_post(r, "/api/2.0/mlflow/runs/create", body, len, a);
    free(body);
    if (code != 200) return code;
    const JsonValue *run = json_get(a->json, "run"), *info = run ? json_get(run, "info") : NULL;
    const char *id = info ? mr_jstr(info, "run_id") : NULL;
    if (!id || !*id || strlen(id) >= sizeof r->run_id || strspn(id, "0123456789abcdefABCDEF-_") != strlen(id)) {
        snprintf(a->msg, sizeof a->msg, "runs/create answered without a run id");
        return a->code = 502;
    }
    snprintf(r->run_id, sizeof r->run_id, "%s", id);
    mr_set_artifacts(r, mr_jstr(info, "artifact_uri"));
    return 200;
}

/* Make the run exist on the server (once): 200, or the failing answer in a. */
static long mr_setup(MlRest *r, MrResp *a) {
    memset(a, 0, sizeof *a);
    if (r->ready) return 200;
    long code;
    if (r->resumed) {
        code = mr_continue(r, a);
        if (code == 404 && !mr_refusal(a)) { /* the run was deleted: a new one */
            kiln_warn("metrics.mlflow: run %s is gone from %s (%s): this run continues in a new MLflow run", r->run_id,
                      r->base, a->msg);
            mr_resp_free(a);
            r->resumed = 0;
            code = mr_create(r, a);
        }
    } else code = mr_create(r, a);
    if (code == 200) {
        r->ready = 1;
        mr_write_json(r);
    }
    return code;
}

/* ---------- sending ---------- */

static void mr_op_free(MrOp *o) {
    free(o->key), free(o->value), free(o);
}

static void mr_queue_op(MlRest *r, int kind, const char *key, const char *value) {
    MrOp *o = xcalloc(1, sizeof *o);
    o->kind = kind, o->key = xstrdup(key), o->value = xstrdup(value);
    pthread_mutex_lock(&r->lock);
    *r->ops_tail = o;
    r->ops_tail = &o->next;
    pthread_cond_signal(&r->wake);
    pthread_mutex_unlock(&r->lock);
}

/* A point as its JSON line: the spool's line and the log-batch element, alike. */
static void mr_point_json(FILE *f, const char *key, const MrPoint *p) {
    fputs("{\"key\":", f);
    mr_json_str(f, key, SIZE_MAX);
    fprintf(f, ",\"value\":%.17g,\"timestamp\":%lld,\"step\":%d}", p->value, p->ts, p->step);
}

/* Append points to the spool (sender thread, or the caller once it ended). */
static void mr_spool_points(MlRest *r, const MrPoint *p, size_t n) {
    if (!n) return;
    if (!r->spool) r->spool = fopen(r->spool_path, "a+");
    if (!r->spool) {
        kiln_warn("metrics.mlflow: %s: cannot open (%s): %zu points lost", r->spool_path, strerror(errno), n);
        return;
    }
    fseek(r->spool, 0, SEEK_END);
    for (size_t i = 0; i < n; i++) {
        mr_point_json(r->spool, r->keys[p[i].key], &p[i]);
        fputc('\n', r->spool);
    }
    fflush(r->spool);
    r->spool_n += (long)n;
}

/* Take up to max points from the ring (lock held). */
static size_t mr_take_locked(MlRest *r, MrPoint *out, size_t max) {
    size_t n = r->count < max ? r->count : max;
    for (size_t i = 0; i < n; i++) out[i] = r->ring[(r->head + i) % MR_RING];
    r->head = (r->head + n) % MR_RING, r->count -= n;
    return n;
}

/* Everything in the ring to the spool's end (keeps the order while the spool is not empty). */
static void mr_ring_to_spool(MlRest *r, MrPoint *buf) {
    for (;;) {
        pthread_mutex_lock(&r->lock);
        size_t n = mr_take_locked(r, buf, MR_BATCH);
        pthread_mutex_unlock(&r->lock);
        if (!n) return;
        mr_spool_points(r, buf, n);
    }
}

/* POST log-batch with body; the test hook sends it twice. */
static long mr_log_batch(MlRest *r, const char *body, size_t len, MrResp *a) {
    long code = mr_post(r, "/api/2.0/mlflow/runs/log-batch", body, len, a);
    if (code == 200 && r->resend) {
        mr_resp_free(a);
        code = mr_post(r, "/api/2.0/mlflow/runs/log-batch", body, len, a);
    }
    return code;
}

/* Send up to MR_BATCH points from the spool's read offset: 1 sent (or
 * dropped as refused for good), 0 nothing there, -1 try again later. */
static int mr_send_spool(MlRest *r, MrResp *a) {
    char *body = NULL, line[512];
    size_t len = 0;
    FILE *f = open_memstream(&body, &len);
    fprintf(f, "{\"run_id\":\"%s\",\"metrics\":[", r->run_id);
    fseek(r->spool, r->spool_off, SEEK_SET);
    long off = r->spool_off, got = 0, sent = 0;
    while (got < MR_BATCH && fgets(line, sizeof line, r->spool)) {
        size_t l = strlen(line);
        if (!l || line[l - 1] != '\n') break; /* torn last line (kill -9 mid-write): left for the end */
        off += (long)l, got++;
        line[l - 1] = 0;
        char key[128];
        int step = 0;
        const char *s = strstr(line, "\"step\":");
        if (!s || sscanf(line, "{\"key\":\"%127[^\"]\"", key) != 1) continue;
        step = atoi(s + 7);
        if (r->nhave && mr_have(r, key, step)) continue;
        fprintf(f, "%s%s", sent++ ? "," : "", line);
    }
    fputs("]}", f);
    fclose(f);
    if (!got) {
        free(body);
        return 0;
    }
    long code = sent ? mr_log_batch(r, body, len, a) : 200;
    free(body);
    if (mr_transient(code) || code == 401 || code == 403) return -1;
    if (code != 200) kiln_warn("metrics.mlflow: %s refused %ld points (%s): dropped", r->base, sent, a->msg);
    r->spool_off = off, r->spool_n -= got;
    atomic_fetch_sub(&r->pending, got);
    if (r->spool_n <= 0) { /* all sent: start the file again */
        r->spool_n = 0, r->spool_off = 0;
        if (ftruncate(fileno(r->spool), 0) != 0) kiln_warn("metrics.mlflow: %s: cannot truncate", r->spool_path);
    }
    return 1;
}

/* Send points straight from the ring: 1 sent, 0 none, -1 failed (they went to the spool). */
static int mr_send_ring(MlRest *r, MrPoint *buf, MrResp *a) {
    if (r->hold) return 0;
    pthread_mutex_lock(&r->lock);
    size_t n = mr_take_locked(r, buf, MR_BATCH);
    pthread_mutex_unlock(&r->lock);
    if (!n) return 0;
    char *body = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&body, &len);
    fprintf(f, "{\"run_id\":\"%s\",\"metrics\":[", r->run_id);
    size_t sent = 0;
    for (size_t i = 0; i < n; i++) {
        if (r->nhave && mr_have(r, r->keys[buf[i].key], buf[i].step)) continue;
        if (sent++) fputc(',', f);
        mr_point_json(f, r->keys[buf[i].key], &buf[i]);
    }
    fputs("]}", f);
    fclose(f);
    long code = sent ? mr_log_batch(r, body, len, a) : 200;
    free(body);
    if (mr_transient(code) || code == 401 || code == 403) {
        mr_spool_points(r, buf, n);
        return -1;
    }
    if (code != 200) kiln_warn("metrics.mlflow: %s refused %zu points (%s): dropped", r->base, sent, a->msg);
    atomic_fetch_sub(&r->pending, (long)n);
    return 1;
}

/* Params and tags, up to 100 of each per call, in the order queued. */
static int mr_send_ops(MlRest *r, MrResp *a, int final) {
    pthread_mutex_lock(&r->lock);
    MrOp *o = r->ops;
    pthread_mutex_unlock(&r->lock);
    if (!o) return 0;
    if (o->kind == OP_ARTIFACT || o->kind == OP_STATUS) {
        long code = 200;
        if (o->kind == OP_STATUS && !final) return 0; /* after every point */
        if (o->kind == OP_ARTIFACT && !r->art[0]) {
            if (!r->art_warned++)
                kiln_warn("metrics.mlflow: %s keeps artifacts outside its proxy (no mlflow-artifacts: URI): config.yaml, "
                          "summary.json and report.html stay in %s only", r->base, r->run_dir);
        } else if (o->kind == OP_ARTIFACT) {
            size_t len;
            char *data = kiln_read_file(o->value, &len), path[2048], q[512];
            mr_query(q, sizeof q, o->key);
            snprintf(path, sizeof path, "/api/2.0/mlflow-artifacts/artifacts/%s/%s", r->art, q);
            code = data ? mr_http(r, "PUT", path, data, len, 120.0, a) : 200;
            free(data);
            if (code != 200 && !mr_transient(code))
                kiln_warn("metrics.mlflow: artifact %s not uploaded (%s)", o->key, a->msg);
        } else {
            char body[256];
            int n = snprintf(body, sizeof body, "{\"run_id\":\"%s\",\"status\":\"%s\",\"end_time\":%s}", r->run_id,
                             o->key, o->value);
            code = mr_post(r, "/api/2.0/mlflow/runs/update", body, (size_t)n, a);
            if (code == 200) r->status_sent = 1;
        }
        if (mr_transient(code) || code == 401 || code == 403) return -1;
        pthread_mutex_lock(&r->lock);
        r->ops = o->next;
        if (!r->ops) r->ops_tail = &r->ops;
        pthread_mutex_unlock(&r->lock);
        mr_op_free(o);
        return 1;
    }
    /* the params and tags at the head of the queue, up to 100 of each */
    char *pb = NULL, *tb = NULL, *body = NULL;
    size_t pl = 0, tl = 0, len = 0;
    FILE *pf = open_memstream(&pb, &pl), *tf = open_memstream(&tb, &tl);
    int np = 0, nt = 0;
    MrOp *end = o;
    for (; end && (end->kind == OP_PARAM || end->kind == OP_TAG); end = end->next) {
        int param = end->kind == OP_PARAM;
        if ((param ? np : nt) == MR_PARAMS) break;
        FILE *f = param ? pf : tf;
        fprintf(f, "%s{\"key\":", (param ? np++ : nt++) ? "," : "");
        mr_json_str(f, end->key, SIZE_MAX);
        fputs(",\"value\":", f);
        mr_json_str(f, end->value, param ? MR_PARAM_MAX : MR_TAG_MAX);
        fputc('}', f);
    }
    fclose(pf), fclose(tf);
    FILE *f = open_memstream(&body, &len);
    fprintf(f, "{\"run_id\":\"%s\",\"params\":[%s],\"tags\":[%s]}", r->run_id, pb, tb);
    fclose(f);
    free(pb), free(tb);
    long code = mr_post(r, "/api/2.0/mlflow/runs/log-batch", body, len, a);
    free(body);
    if (mr_transient(code) || code == 401 || code == 403) return -1;
    if (code != 200 && !r->param_warned++) /* a resume that changed a param: MLflow keeps the first value */
        kiln_warn("metrics.mlflow: %s refused params or tags (%s): the server keeps the values it has", r->base, a->msg);
    pthread_mutex_lock(&r->lock);
    while (r->ops != end) {
        MrOp *x = r->ops;
        r->ops = x->next;
        mr_op_free(x);
    }
    if (!r->ops) r->ops_tail = &r->ops;
    pthread_mutex_unlock(&r->lock);
    return 1;
}

/* One unit of work: 1 done something, 0 nothing to do, -1 the server failed (back off). */
static int mr_work(MlRest *r, MrPoint *buf) {
    MrResp a;
    long code = mr_setup(r, &a);
    if (code != 200) {
        if (mr_refusal(&a) && !r->refused_warned++)
            kiln_warn("metrics.mlflow: %s refused the run (%s): points spool to %s", r->base, a.msg, r->spool_path);
        else if (!r->down_warned++)
            kiln_warn("metrics.mlflow: %s does not answer (%s): points spool to %s and are sent when it does", r->base,
                      a.msg, r->spool_path);
        mr_resp_free(&a);
        mr_ring_to_spool(r, buf);
        return -1;
    }
    mr_resp_free(&a);
    int rc = mr_send_ops(r, &a, 0);
    if (rc == 0) {
        if (r->spool_n > 0) {
            mr_ring_to_spool(r, buf);
            rc = mr_send_spool(r, &a);
        } else rc = mr_send_ring(r, buf, &a);
    }
    if (rc == 0) {
        pthread_mutex_lock(&r->lock);
        int drained = r->count == 0;
        pthread_mutex_unlock(&r->lock);
        if (drained) rc = mr_send_ops(r, &a, 1);
    }
    if (rc < 0) {
        if (!r->down_warned++)
            kiln_warn("metrics.mlflow: %s does not take points (%s): they spool to %s and are sent when it does",
                      r->base, a.msg, r->spool_path);
    } else if (rc > 0 && r->down_warned) {
        r->down_warned = 0;
        kiln_warn("metrics.mlflow: %s answers again: sending the spool", r->base);
    }
    mr_resp_free(&a);
    return rc;
}

static int mr_has_work_locked(const MlRest *r) {
    return !r->ready || (r->count && !r->hold) || r->spool_n > 0 || (r->ops && (r->ops->kind != OP_STATUS || r->ending));
}

static void *mr_thread(void *arg) {
    MlRest *r = arg;
    MrPoint *buf = xmalloc(sizeof(MrPoint) * MR_BATCH);
    double backoff = 0.25;
    pthread_mutex_lock(&r->lock);
    for (;;) {
        while (!r->stop && !mr_has_work_locked(r)) {
            r->busy = 0;
            pthread_cond_broadcast(&r->idle);
            pthread_cond_wait(&r->wake, &r->lock);
        }
        if (r->stop) break;
        r->busy = 1;
        pthread_mutex_unlock(&r->lock);
        int rc = mr_work(r, buf);
        pthread_mutex_lock(&r->lock);
        if (rc >= 0) {
            backoff = 0.25;
            continue;
        }
        /* the server failed: wait, moving what arrives to the spool so the ring never fills */
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        double t = until.tv_sec + until.tv_nsec * 1e-9 + backoff;
        until.tv_sec = (time_t)t, until.tv_nsec = (long)((t - (double)(time_t)t) * 1e9);
        backoff = backoff * 2 > MR_BACKOFF_MAX ? MR_BACKOFF_MAX : backoff * 2;
        r->kick = 0;
        while (!r->stop && !r->kick && pthread_cond_timedwait(&r->wake, &r->lock, &until) == 0)
            if (r->count > MR_RING / 2) {
                pthread_mutex_unlock(&r->lock);
                mr_ring_to_spool(r, buf);
                pthread_mutex_lock(&r->lock);
            }
    }
    r->busy = 0;
    pthread_cond_broadcast(&r->idle);
    pthread_mutex_unlock(&r->lock);
    free(buf);
    return NULL;
}

/* ---------- the interface ---------- */

/* The spool a resumed run finds: its points up to the resumed step are
 * sent (to the remembered run, or a new one when the server never answered
 * before); those past it are logged again by this run. A fresh start's
 * spool belongs to another MLflow run and is dropped. */
static void mr_spool_open(MlRest *r) {
    size_t len;
    char *text = kiln_read_file(r->spool_path, &len);
    if (!text) return;
    long kept = 0, all = 0;
    char *out = text, *end = text + len;
    for (char *l = text; l < end;) {
        char *nl = memchr(l, '\n', (size_t)(end - l));
        if (!nl) break;
        all++;
        const char *s = memmem(l, (size_t)(nl - l), "\"step\":", 7);
        if (r->start_step > 0 && s && atol(s + 7) <= r->start_step) {
            memmove(out, l, (size_t)(nl - l + 1));
            out += nl - l + 1;
            kept++;
        }
        l = nl + 1;
    }
    if (r->start_step == 0 && all)
        kiln_warn("metrics.mlflow: %s held %ld unsent points of the run this directory was before (a fresh start, not "
                  "a resume): dropped", r->spool_path, all);
    if (kiln_write_file_atomic(r->spool_path, text, (size_t)(out - text)) != 0)
        kiln_warn("metrics.mlflow: %s: cannot rewrite (%s)", r->spool_path, strerror(errno));
    free(text);
    r->spool_n = kept;
    atomic_store(&r->pending, kept);
    if (kept) r->spool = fopen(r->spool_path, "a+");
}

static void mr_param_cb(const char *key, const char *value, void *ctx) { mr_queue_op(ctx, OP_PARAM, key, value); }

static void mr_curl_init(void) { curl_global_init(CURL_GLOBAL_DEFAULT); }

static char *mr_env(const char *name) {
    const char *v = getenv(name);
    return v && *v ? xstrdup(v) : NULL;
}

MlRest *mlrest_open(const MlflowOptions *o) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, mr_curl_init);
    MlRest *r = xcalloc(1, sizeof *r);
    snprintf(r->base, sizeof r->base, "%s", o->store);
    for (size_t n = strlen(r->base); n > 0 && r->base[n - 1] == '/'; n--) r->base[n - 1] = 0;
    snprintf(r->exp_name, sizeof r->exp_name, "%s", o->experiment);
    snprintf(r->run_dir, sizeof r->run_dir, "%s", o->run_dir);
    snprintf(r->run_name, sizeof r->run_name, "%s", o->run_name);
    snprintf(r->spool_path, sizeof r->spool_path, "%s/mlflow-spool.jsonl", o->run_dir);
    snprintf(r->json_path, sizeof r->json_path, "%s/mlflow.json", o->run_dir);
    snprintf(r->stage, sizeof r->stage, "%s/mlflow-artifacts", o->run_dir);
    const char *u = getenv("USER");
    struct passwd *pw = u ? NULL : getpwuid(getuid());
    snprintf(r->user, sizeof r->user, "%s", u ? u : pw ? pw->pw_name : "unknown");
    r->start_step = o->start_step, r->flush_s = o->flush_s, r->required = o->required;
    r->start_ms = mr_now_ms();
    r->token = mr_env("MLFLOW_TRACKING_TOKEN");
    r->username = mr_env("MLFLOW_TRACKING_USERNAME");
    r->password = mr_env("MLFLOW_TRACKING_PASSWORD");
    r->ca_path = mr_env("MLFLOW_TRACKING_SERVER_CERT_PATH");
    const char *ins = getenv("MLFLOW_TRACKING_INSECURE_TLS");
    r->insecure = ins && (!strcasecmp(ins, "true") || !strcmp(ins, "1"));
    r->resend = testhooks()->mlflow_resend;
    r->hold = testhooks()->mlflow_hold;
    r->hdr = curl_slist_append(NULL, "Content-Type: application/json");
    r->hdr = curl_slist_append(r->hdr, "User-Agent: kiln");
    if (r->token && !r->username) { /* as MLflow's client: a user and password come first */
        size_t n = strlen(r->token) + 32;
        char *h = xmalloc(n);
        snprintf(h, n, "Authorization: Bearer %s", r->token);
        r->hdr = curl_slist_append(r->hdr, h);
        memset(h, 0, n);
        free(h);
    }
    r->curl = curl_easy_init();
    if (!r->curl || !r->hdr) kiln_fail(KILN_EXIT_RUNTIME, "metrics.mlflow: libcurl could not start");
    r->ring = xmalloc(sizeof(MrPoint) * MR_RING);
    r->ops_tail = &r->ops;
    pthread_mutex_init(&r->lock, NULL);
    pthread_cond_init(&r->wake, NULL);
    pthread_cond_init(&r->idle, NULL);
    if (kiln_mkdirs(r->stage) != 0)
        kiln_fail(KILN_EXIT_RUNTIME, "metrics.mlflow: %s: cannot create directory (%s)", r->stage, strerror(errno));

    char exp[64], run[64];
    r->resumed = o->start_step > 0 && mr_remembered(r, exp, run);
    if (r->resumed) snprintf(r->exp_id, sizeof r->exp_id, "%s", exp), snprintf(r->run_id, sizeof r->run_id, "%s", run);
    mr_spool_open(r);

    MrResp a;
    r->timeout_s = 5.0;
    long code = mr_setup(r, &a);
    r->timeout_s = 30.0;
    if (code != 200 && mr_refusal(&a)) {
        if (r->required)
            kiln_fail(KILN_EXIT_USAGE, "metrics.mlflow: %s refused the run: %s (credentials: MLFLOW_TRACKING_TOKEN, or "
                      "MLFLOW_TRACKING_USERNAME and _PASSWORD; metrics.mlflow_required: false goes on without tracking)",
                      r->base, a.msg);
        kiln_warn("metrics.mlflow: %s refused the run: %s; metrics.mlflow_required is false: this run is not tracked",
                  r->base, a.msg);
        mr_resp_free(&a);
        r->ready = 1; /* nothing to send: close frees */
        mlrest_close(r);
        return NULL;
    }
    if (code != 200) {
        kiln_warn("metrics.mlflow: %s does not answer (%s): the run is made when it does; until then points spool "
                  "to %s", r->base, a.msg, r->spool_path);
        r->down_warned = 1;
    }
    mr_resp_free(&a);

    cfg_flatten_yaml(o->config_yaml, mr_param_cb, r);
    mlrest_tag(r, "mlflow.user", r->user);
    mlrest_tag(r, "mlflow.runName", o->run_name);
    mlrest_tag(r, "mlflow.source.name", "kiln ./train");
    mlrest_tag(r, "mlflow.source.type", "LOCAL");
    char abs[PATH_MAX];
    mlrest_tag(r, "kiln.run_dir", realpath(o->run_dir, abs) ? abs : o->run_dir);
    if (o->host) mlrest_tag(r, "kiln.host", o->host);
    if (r->resumed) {
        char s[32];
        snprintf(s, sizeof s, "%d", o->start_step);
        mlrest_tag(r, "kiln.resumed_from_step", s);
    }
    const char *cfg = mlrest_artifact_path(r, "config.yaml");
    if (kiln_write_file_atomic(cfg, o->config_yaml, strlen(o->config_yaml)) != 0)
        kiln_fail(KILN_EXIT_RUNTIME, "metrics.mlflow: %s: cannot write (%s)", cfg, strerror(errno));
    mlrest_artifact_written(r, "config.yaml");
    if (pthread_create(&r->thread, NULL, mr_thread, r) != 0)
        kiln_fail(KILN_EXIT_RUNTIME, "metrics.mlflow: cannot start the sender thread");
    r->thread_on = 1;
    return r;
}

void mlrest_log(MlRest *r, const char *key, double value, int step) {
    if (r) mr_log_at(r, key, value, step, mr_now_ms());
}

static void mr_log_at(MlRest *r, const char *key, double value, int step, long long ts) {
    if (!isfinite(value)) return;
    int k = 0;
    pthread_mutex_lock(&r->lock);
    while (k < r->nkeys && strcmp(r->keys[k], key)) k++;
    if (k == r->nkeys && r->nkeys < MR_KEYS) snprintf(r->keys[r->nkeys++], sizeof r->keys[0], "%s", key);
    if (k < r->nkeys && r->count < MR_RING) {
        r->ring[(r->head + r->count) % MR_RING] = (MrPoint){.ts = ts, .value = value, .step = step, .key = k};
        r->count++;
        atomic_fetch_add(&r->pending, 1);
    } else r->dropped++;
    pthread_mutex_unlock(&r->lock);
}

void mlrest_flush(MlRest *r) {
    if (!r) return;
    pthread_mutex_lock(&r->lock);
    pthread_cond_signal(&r->wake);
    pthread_mutex_unlock(&r->lock);
}

void mlrest_tag(MlRest *r, const char *key, const char *value) {
    if (r) mr_queue_op(r, OP_TAG, key, value);
}

const char *mlrest_artifact_path(MlRest *r, const char *name) {
    static char path[2 * CFG_STR];
    snprintf(path, sizeof path, "%s/%s", r->stage, name);
    return path;
}

void mlrest_artifact_written(MlRest *r, const char *name) {
    if (r) mr_queue_op(r, OP_ARTIFACT, name, mlrest_artifact_path(r, name));
}

int mlrest_artifact(MlRest *r, const char *src, const char *name) {
    if (!r) return -1;
    size_t len;
    char *data = kiln_read_file(src, &len);
    if (!data) return -1;
    int rc = kiln_write_file_atomic(mlrest_artifact_path(r, name), data, len);
    free(data);
    if (rc == 0) mlrest_artifact_written(r, name);
    return rc;
}

/* Stop the sender; what the ring still holds goes to the spool. */
static void mr_stop(MlRest *r) {
    if (r->thread_on) {
        pthread_mutex_lock(&r->lock);
        r->stop = 1;
        pthread_cond_signal(&r->wake);
        pthread_mutex_unlock(&r->lock);
        atomic_store(&r->abort, 1);
        pthread_join(r->thread, NULL);
        r->thread_on = 0;
    }
    MrPoint *buf = xmalloc(sizeof(MrPoint) * MR_BATCH);
    mr_ring_to_spool(r, buf);
    free(buf);
}

void mlrest_end(MlRest *r, int exit_code) {
    if (!r || !r->thread_on) return;
    char t[32];
    snprintf(t, sizeof t, "%lld", mr_now_ms());
    /* RunStatus: FINISHED (exit 0), KILLED (75: stopped, resumable), FAILED */
    mr_queue_op(r, OP_STATUS, exit_code == 0 ? "FINISHED" : exit_code == KILN_EXIT_RESUME ? "KILLED" : "FAILED", t);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    double d = until.tv_sec + until.tv_nsec * 1e-9 + r->flush_s;
    until.tv_sec = (time_t)d, until.tv_nsec = (long)((d - (double)(time_t)d) * 1e9);
    pthread_mutex_lock(&r->lock);
    r->ending = 1, r->kick = 1;
    pthread_cond_signal(&r->wake);
    int rc = 0;
    while (rc == 0 && (r->busy || mr_has_work_locked(r))) rc = pthread_cond_timedwait(&r->idle, &r->lock, &until);
    long dropped = r->dropped;
    pthread_mutex_unlock(&r->lock);
    mr_stop(r);
    long left = r->spool_n;
    if (dropped)
        kiln_warn("metrics.mlflow: %ld points were dropped: the queue of %d was full while %s did not answer", dropped,
                  MR_RING, r->base);
    if (left || !r->status_sent)
        kiln_warn("metrics.mlflow: %s took not everything in metrics.mlflow_flush_s = %g s: %ld points stay in %s%s; "
                  "a resume (--resume auto) sends them", r->base, r->flush_s, left, r->spool_path,
                  r->status_sent ? "" : " and the run's status is not set");
}

void mlrest_close(MlRest *r) {
    if (!r) return;
    mr_stop(r);
    pthread_mutex_lock(&r->lock);
    while (r->ops) {
        MrOp *o = r->ops;
        r->ops = o->next;
        mr_op_free(o);
    }
    pthread_mutex_unlock(&r->lock);
    if (r->spool) fclose(r->spool);
    for (int i = 0; i < r->nhave; i++) free(r->have[i].step);
    curl_easy_cleanup(r->curl);
    curl_slist_free_all(r->hdr);
    pthread_cond_destroy(&r->wake);
    pthread_cond_destroy(&r->idle);
    pthread_mutex_destroy(&r->lock);
    char *secret[4] = {r->token, r->username, r->password, r->ca_path};
    for (int i = 0; i < 4; i++) {
        if (secret[i]) memset(secret[i], 0, strlen(secret[i]));
        free(secret[i]);
    }
    free(r->ring);
    free(r);
}

const char *mlrest_uri(const MlRest *r) { return r->base; }
const char *mlrest_run_id(const MlRest *r) { return r->run_id; }
const char *mlrest_experiment_id(const MlRest *r) { return r->exp_id; }
long mlrest_pending(const MlRest *r) { return r ? atomic_load(&((MlRest *)r)->pending) : 0; }

#else /* built without libcurl: config.c refuses an http(s) metrics.mlflow first */

MlRest *mlrest_open(const MlflowOptions *o) {
    kiln_fail(KILN_EXIT_USAGE, "metrics.mlflow: '%s' is a tracking server, and this ./train was built without libcurl",
              o->store);
}
void mlrest_log(MlRest *r, const char *key, double value, int step) {}
void mlrest_flush(MlRest *r) {}
void mlrest_tag(MlRest *r, const char *key, const char *value) {}
int mlrest_artifact(MlRest *r, const char *src, const char *name) { return -1; }
const char *mlrest_artifact_path(MlRest *r, const char *name) { return ""; }
void mlrest_artifact_written(MlRest *r, const char *name) {}
void mlrest_end(MlRest *r, int exit_code) {}
void mlrest_close(MlRest *r) {}
const char *mlrest_uri(const MlRest *r) { return ""; }
const char *mlrest_run_id(const MlRest *r) { return ""; }
const char *mlrest_experiment_id(const MlRest *r) { return ""; }
long mlrest_pending(const MlRest *r) { return 0; }

#endif
