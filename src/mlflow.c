/* mlflow: the FileStore layout, as MLflow 1.x-3.x read it:
 *   STORE/<experiment id>/meta.yaml          name, id, artifact location, times
 *   STORE/<experiment id>/<run id>/meta.yaml status, start and end time, run name
 *   .../<run id>/params/<key>                 the value, no newline
 *   .../<run id>/metrics/<key>                lines "<ms since epoch> <value> <step>"
 *   .../<run id>/tags/<key>, artifacts/...
 * Whole files are replaced through a temporary file beside them and a rename,
 * never inside params/, metrics/ or tags/, where MLflow would read it as a key;
 * metric files are appended to and flushed once per logged step. Nothing is
 * written outside the store and RUN_DIR/mlflow.json: ids read back are plain
 * names, and a link where the run's directories or metric files belong is
 * refused rather than followed. */
#include "mlflow.h"
#include "mlflow_rest.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <fcntl.h>
#include <unistd.h>

#include "config.h"
#include "util.h"

#define ML_PATH 2048
#define ML_MAX_METRICS 96

struct Mlflow {
    MlRest *rest;          /* a tracking server: every call goes there; the rest is the file store */
    char store[ML_PATH];   /* absolute */
    char exp_id[32];
    char run_id[40];
    char run_path[ML_PATH + 80]; /* STORE/<exp>/<run> */
    char meta_path[ML_PATH + 96];
    char art_path[ML_PATH + 96];
    char run_name[CFG_STR];
    char user[128];
    long long start_ms;
    int ending, ended;
    struct {
        char key[64];
        FILE *f;
    } metric[ML_MAX_METRICS];
    int nmetric;
};

static long long now_ms(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (long long)tv.tv_sec * 1000 + tv.tv_usec / 1000;
}

/* Write `len` bytes to path through DIR/.NAME.tmp.PID (tmp_dir: where the
 * temporary file may live; NULL = beside path). Not fsynced: the store is a
 * view of the run, and metrics.jsonl is the record. */
static int write_file(const char *path, const char *tmp_dir, const void *data, size_t len) {
    char tmp[2 * ML_PATH];
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    if (tmp_dir) snprintf(tmp, sizeof tmp, "%s/.%s.tmp.%d", tmp_dir, base, (int)getpid());
    else snprintf(tmp, sizeof tmp, "%.*s.%s.tmp.%d", (int)(base - path), path, base, (int)getpid());
    FILE *f = fopen(tmp, "wb");
    if (!f) return -1;
    size_t w = fwrite(data, 1, len, f);
    if (fclose(f) != 0 || w != len || rename(tmp, path) != 0) {
        unlink(tmp);
        return -1;
    }
    return 0;
}

/* At open a store that cannot be written stops the run (exit 1); once it
 * is ending (mlflow_end) it only warns. */
static void write_or_fail(const Mlflow *m, const char *path, const char *tmp_dir, const char *text) {
    if (write_file(path, tmp_dir, text, strlen(text)) == 0) return;
    if (m && m->ending) kiln_warn("metrics.mlflow: %s: cannot write (%s)", path, strerror(errno));
    else kiln_fail(KILN_EXIT_RUNTIME, "metrics.mlflow: %s: cannot write (%s)", path, strerror(errno));
}

static void mkdir_or_fail(const char *path) {
    if (kiln_mkdirs(path) != 0)
        kiln_fail(KILN_EXIT_RUNTIME, "metrics.mlflow: %s: cannot create directory (%s)", path, strerror(errno));
}

/* An experiment or run id read back (mlflow.json, a directory of the store):
 * letters, digits, '-' and '_' only, so that it names one directory of the
 * store and quotes nowhere in a meta.yaml. MLflow's own are digits and hex. */
static int id_ok(const char *s, size_t cap) {
    size_t n = strspn(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_");
    return n > 0 && n < cap && !s[n];
}

/* A directory of the store that kiln writes in: made if missing, and then a
 * directory itself, not a link that would take the run's files elsewhere. */
static void store_dir(const char *path) {
    struct stat st = {0};
    if (mkdir(path, 0755) != 0 && errno != EEXIST)
        kiln_fail(KILN_EXIT_RUNTIME, "metrics.mlflow: %s: cannot create directory (%s)", path, strerror(errno));
    if (lstat(path, &st) != 0 || !S_ISDIR(st.st_mode))
        kiln_fail(KILN_EXIT_USAGE, "metrics.mlflow: %s: expected a directory of the store, found %s", path,
                  S_ISLNK(st.st_mode) ? "a symbolic link (kiln writes only inside the store)" : "a file");
}

/* A YAML single-quoted scalar: quotes doubled, nothing else escaped. */
static void yaml_quoted(FILE *f, const char *s) {
    fputc('\'', f);
    for (; *s; s++) {
        if (*s == '\'') fputc('\'', f);
        if (*s != '\n') fputc(*s, f);
    }
    fputc('\'', f);
}

/* file:// URI of an absolute path, percent-encoding what a URI path may not hold. */
static void file_uri(char *out, size_t cap, const char *path) {
    size_t n = (size_t)snprintf(out, cap, "file://");
    for (const unsigned char *p = (const unsigned char *)path; *p && n + 4 < cap; p++) {
        if ((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || strchr("/-._~", *p))
            out[n++] = (char)*p;
        else n += (size_t)snprintf(out + n, cap - n, "%%%02X", *p);
    }
    out[n] = 0;
}

/* The value of a top-level `key:` line of a meta.yaml, quotes removed. */
static int yaml_get(const char *text, const char *key, char *out, size_t cap) {
    size_t kl = strlen(key);
    for (const char *l = text; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL) {
        if (strncmp(l, key, kl) || l[kl] != ':') continue;
        const char *v = l + kl + 1;
        while (*v == ' ') v++;
        size_t len = strcspn(v, "\n");
        char q = (*v == '\'' || *v == '"') ? *v : 0;
        if (q) v++, len = len >= 2 ? len - 2 : 0;
        size_t n = 0;
        for (size_t i = 0; i < len && n + 1 < cap; i++) {
            out[n++] = v[i];
            if (q == '\'' && v[i] == '\'' && i + 1 < len && v[i + 1] == '\'') i++;
        }
        out[n] = 0;
        return 1;
    }
    return 0;
}

static void experiment_meta(const char *dir, const char *id, const char *name) {
    char uri[ML_PATH * 3], path[ML_PATH + 16];
    file_uri(uri, sizeof uri, dir);
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    long long t = now_ms();
    fprintf(f, "artifact_location: %s\ncreation_time: %lld\nexperiment_id: '%s'\nlast_update_time: %lld\n"
               "lifecycle_stage: active\nname: ", uri, t, id, t);
    yaml_quoted(f, name);
    fputc('\n', f);
    fclose(f);
    snprintf(path, sizeof path, "%s/meta.yaml", dir);
    write_or_fail(NULL, path, NULL, text);
    free(text);
}

/* The id of the experiment called `name`: an existing one (any directory of
 * the store whose meta.yaml has that name), else a new one whose id is a
 * hash of the name, so that two jobs creating it at once make the same one. */
static void find_experiment(Mlflow *m, const char *name) {
    DIR *d = opendir(m->store);
    if (!d) kiln_fail(KILN_EXIT_RUNTIME, "metrics.mlflow: %s: cannot read (%s)", m->store, strerror(errno));
    struct dirent *e;
    char path[2 * ML_PATH], got[CFG_STR];
    while ((e = readdir(d))) {
        if (!id_ok(e->d_name, sizeof m->exp_id)) continue;
        snprintf(path, sizeof path, "%s/%s/meta.yaml", m->store, e->d_name);
        size_t len;
        char *text = kiln_read_file_max(path, KILN_SMALL_FILE_MAX, &len);
        if (!text) continue;
        int match = yaml_get(text, "name", got, sizeof got) && !strcmp(got, name);
        free(text);
        if (match) {
            kiln_strlcpy(m->exp_id, e->d_name, sizeof m->exp_id);
            closedir(d);
            return;
        }
    }
    closedir(d);
    /* 18 decimal digits, like MLflow's own ids; a clash with another
     * experiment's directory moves to the next number */
    uint64_t h = kiln_fnv1a(name, strlen(name), KILN_FNV_INIT) % 900000000000000000ULL + 100000000000000000ULL;
    for (;; h++) {
        snprintf(m->exp_id, sizeof m->exp_id, "%llu", (unsigned long long)h);
        snprintf(path, sizeof path, "%s/%s", m->store, m->exp_id);
        if (mkdir(path, 0755) == 0) break;
        if (errno != EEXIST) kiln_fail(KILN_EXIT_RUNTIME, "metrics.mlflow: %s: cannot create (%s)", path, strerror(errno));
        store_dir(path); /* a link or a file of this name is not an experiment to write in */
        snprintf(path, sizeof path, "%s/%s/meta.yaml", m->store, m->exp_id);
        size_t len;
        char *text = kiln_read_file_max(path, KILN_SMALL_FILE_MAX, &len);
        int mine = !text || (yaml_get(text, "name", got, sizeof got) && !strcmp(got, name));
        free(text);
        if (mine) break; /* made by a job racing this one, or left half-made */
    }
    snprintf(path, sizeof path, "%s/%s", m->store, m->exp_id);
    store_dir(path);
    experiment_meta(path, m->exp_id, name);
}

static void new_run_id(char *out) {
    unsigned char b[16];
    FILE *f = fopen("/dev/urandom", "rb");
    size_t got = f ? fread(b, 1, sizeof b, f) : 0;
    if (f) fclose(f);
    if (got != sizeof b) { /* no /dev/urandom: time, pid and address */
        struct timeval tv;
        gettimeofday(&tv, NULL);
        uint64_t x[3] = {(uint64_t)tv.tv_sec, (uint64_t)tv.tv_usec << 20 ^ (uint64_t)getpid(), (uint64_t)(uintptr_t)out};
        uint64_t h1 = kiln_fnv1a(x, sizeof x, KILN_FNV_INIT), h2 = kiln_fnv1a(x, sizeof x, h1);
        memcpy(b, &h1, 8), memcpy(b + 8, &h2, 8);
    }
    for (int i = 0; i < 16; i++) sprintf(out + 2 * i, "%02x", b[i]);
}

static void run_meta(Mlflow *m, int status, long long end_ms) {
    char uri[ML_PATH * 3], *text = NULL;
    size_t len = 0;
    file_uri(uri, sizeof uri, m->art_path);
    FILE *f = open_memstream(&text, &len);
    fprintf(f, "artifact_uri: %s\n", uri);
    if (end_ms > 0) fprintf(f, "end_time: %lld\n", end_ms);
    else fputs("end_time: null\n", f);
    fprintf(f, "entry_point_name: ''\nexperiment_id: '%s'\nlifecycle_stage: active\nrun_id: %s\nrun_name: ", m->exp_id,
            m->run_id);
    yaml_quoted(f, m->run_name);
    fprintf(f, "\nrun_uuid: %s\nsource_name: ''\nsource_type: 4\nsource_version: ''\nstart_time: %lld\nstatus: %d\n"
               "tags: []\nuser_id: ", m->run_id, m->start_ms, status);
    yaml_quoted(f, m->user);
    fputc('\n', f);
    fclose(f);
    write_or_fail(m, m->meta_path, NULL, text);
    free(text);
}

/* The string value of "key": in text (as mlflow_open writes it: no escapes),
 * cut at cap; NULL when missing. */
static const char *json_get(const char *text, const char *key, char *out, size_t cap) {
    const char *v = strstr(text, key);
    if (!v) return NULL;
    v += strlen(key);
    size_t n = strcspn(v, "\"");
    snprintf(out, cap, "%.*s", (int)(n < cap ? n : cap - 1), v);
    return v[n] == '"' ? out : NULL;
}

/* RUN_DIR/mlflow.json: which run this run directory is, for a resume. Its ids
 * become paths in the store, so one that is not a plain name (../x, /etc/x,
 * a newline) is refused, naming the file and key. */
static int remembered(const char *run_dir, const char *store, char *exp, char *run) {
    char path[ML_PATH], buf[ML_PATH], id[ML_PATH];
    snprintf(path, sizeof path, "%s/mlflow.json", run_dir);
    size_t len;
    char *text = kiln_read_file_max(path, KILN_SMALL_FILE_MAX, &len);
    if (!text) return 0;
    int ok = json_get(text, "\"store\":\"", buf, sizeof buf) && !strcmp(buf, store);
    static const char *const key[2] = {"experiment_id", "run_id"};
    char *const dst[2] = {exp, run};
    const size_t cap[2] = {32, 40}; /* Mlflow's exp_id and run_id */
    for (int i = 0; ok && i < 2; i++) {
        char k[32];
        snprintf(k, sizeof k, "\"%s\":\"", key[i]);
        ok = json_get(text, k, id, sizeof id) != NULL;
        if (ok && !id_ok(id, cap[i]))
            kiln_fail(KILN_EXIT_USAGE, "%s: key '%s': expected an MLflow id (at most %zu letters, digits, '-' or '_'), got '%s'",
                      path, key[i], cap[i] - 1, id);
        if (ok) kiln_strlcpy(dst[i], id, cap[i]);
    }
    free(text);
    return ok;
}

static void param_cb(const char *key, const char *value, void *ctx) {
    Mlflow *m = ctx;
    char path[2 * ML_PATH];
    snprintf(path, sizeof path, "%s/params/%s", m->run_path, key);
    write_or_fail(m, path, m->run_path, value);
}

/* A resumed run drops the metric lines past the step it resumed from: the
 * killed run wrote them after its last checkpoint, and they are written again. */
static void truncate_metrics(Mlflow *m, int start_step) {
    char dir[2 * ML_PATH];
    snprintf(dir, sizeof dir, "%s/metrics", m->run_path);
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char path[3 * ML_PATH];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        size_t len;
        char *text = kiln_read_file(path, &len);
        if (!text) continue;
        char *out = text, *end = text + len;
        for (char *l = text; l < end;) {
            char *nl = memchr(l, '\n', (size_t)(end - l));
            if (!nl) break; /* torn last line */
            long long ts;
            double v;
            int step;
            if (sscanf(l, "%lld %lf %d", &ts, &v, &step) == 3 && step <= start_step) {
                memmove(out, l, (size_t)(nl - l + 1));
                out += nl - l + 1;
            }
            l = nl + 1;
        }
        if (write_file(path, m->run_path, text, (size_t)(out - text)) != 0)
            kiln_fail(KILN_EXIT_RUNTIME, "metrics.mlflow: %s: cannot rewrite for the resumed run", path);
        free(text);
    }
    closedir(d);
}

int mlflow_is_server(const char *store) { return !strncmp(store, "http://", 7) || !strncmp(store, "https://", 8); }

Mlflow *mlflow_open(const MlflowOptions *o) {
    if (mlflow_is_server(o->store)) {
        MlRest *r = mlrest_open(o);
        if (!r) return NULL;
        Mlflow *m = xcalloc(1, sizeof *m);
        m->rest = r;
        return m;
    }
    Mlflow *m = xcalloc(1, sizeof *m);
    struct stat st;
    int fresh_store = stat(o->store, &st) != 0;
    mkdir_or_fail(o->store);
    if (!realpath(o->store, m->store))
        kiln_fail(KILN_EXIT_RUNTIME, "metrics.mlflow: %s: cannot resolve (%s)", o->store, strerror(errno));
    kiln_strlcpy(m->run_name, o->run_name, sizeof m->run_name);
    const char *u = getenv("USER");
    struct passwd *pw = u ? NULL : getpwuid(getuid());
    kiln_strlcpy(m->user, u ? u : pw ? pw->pw_name : "unknown", sizeof m->user);

    char path[2 * ML_PATH];
    /* what MLflow makes with a new store: the Default experiment and the trash */
    snprintf(path, sizeof path, "%s/.trash", m->store);
    mkdir_or_fail(path);
    snprintf(path, sizeof path, "%s/0", m->store);
    if (fresh_store && mkdir(path, 0755) == 0) experiment_meta(path, "0", "Default");

    char exp[32], run[40];
    int resumed = o->start_step > 0 && remembered(o->run_dir, m->store, exp, run);
    if (resumed) {
        snprintf(path, sizeof path, "%s/%s/%s/meta.yaml", m->store, exp, run);
        size_t len;
        char *text = kiln_read_file_max(path, KILN_SMALL_FILE_MAX, &len), start[32];
        resumed = text && yaml_get(text, "start_time", start, sizeof start);
        if (resumed) {
            kiln_strlcpy(m->exp_id, exp, sizeof m->exp_id);
            kiln_strlcpy(m->run_id, run, sizeof m->run_id);
            m->start_ms = atoll(start);
        }
        free(text);
    }
    if (!resumed) {
        find_experiment(m, o->experiment);
        new_run_id(m->run_id);
        m->start_ms = now_ms();
    }
    snprintf(m->run_path, sizeof m->run_path, "%s/%s/%s", m->store, m->exp_id, m->run_id);
    snprintf(m->meta_path, sizeof m->meta_path, "%s/meta.yaml", m->run_path);
    snprintf(m->art_path, sizeof m->art_path, "%s/artifacts", m->run_path);
    snprintf(path, sizeof path, "%s/%s", m->store, m->exp_id);
    store_dir(path);
    store_dir(m->run_path);
    static const char *const sub[] = {"params", "metrics", "tags", "artifacts"};
    for (int i = 0; i < 4; i++) {
        snprintf(path, sizeof path, "%s/%s", m->run_path, sub[i]);
        store_dir(path);
    }
    run_meta(m, 1, 0); /* RUNNING */
    if (resumed) truncate_metrics(m, o->start_step);

    cfg_flatten_yaml(o->config_yaml, param_cb, m); /* a resume writes the values it continues with */
    mlflow_tag(m, "mlflow.runName", o->run_name);
    mlflow_tag(m, "mlflow.user", m->user);
    mlflow_tag(m, "mlflow.source.name", "kiln ./train");
    mlflow_tag(m, "mlflow.source.type", "LOCAL");
    char abs[PATH_MAX];
    mlflow_tag(m, "kiln.run_dir", realpath(o->run_dir, abs) ? abs : o->run_dir);
    if (o->host) mlflow_tag(m, "kiln.host", o->host);
    if (resumed) {
        char s[32];
        snprintf(s, sizeof s, "%d", o->start_step);
        mlflow_tag(m, "kiln.resumed_from_step", s);
    }
    snprintf(path, sizeof path, "%s/config.yaml", m->art_path);
    write_or_fail(m, path, NULL, o->config_yaml);

    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    fprintf(f, "{\"store\":\"%s\",\"experiment_id\":\"%s\",\"run_id\":\"%s\"}\n", m->store, m->exp_id, m->run_id);
    fclose(f);
    snprintf(path, sizeof path, "%s/mlflow.json", o->run_dir);
    write_or_fail(m, path, NULL, text);
    free(text);
    return m;
}

void mlflow_log(Mlflow *m, const char *key, double value, int step) {
    if (!m || m->ended || !isfinite(value)) return;
    if (m->rest) {
        mlrest_log(m->rest, key, value, step);
        return;
    }
    int i = 0;
    while (i < m->nmetric && strcmp(m->metric[i].key, key)) i++;
    if (i == m->nmetric) {
        if (m->nmetric == ML_MAX_METRICS) return;
        char path[2 * ML_PATH];
        snprintf(path, sizeof path, "%s/metrics/%s", m->run_path, key);
        /* a link is not followed out of the store, and a FIFO (no reader:
         * ENXIO) is refused rather than waited on */
        int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
        int err = fd < 0 ? (errno == ENXIO ? KILN_ENOTREG : errno) : 0;
        struct stat st;
        if (fd >= 0 && (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))) err = KILN_ENOTREG;
        else if (fd >= 0 && fcntl(fd, F_SETFL, O_APPEND) != 0) err = errno;
        if (fd >= 0 && err) close(fd), fd = -1;
        FILE *f = fd >= 0 ? fdopen(fd, "a") : NULL;
        if (fd >= 0 && !f) err = errno, close(fd);
        if (!f)
            kiln_fail(KILN_EXIT_RUNTIME, "metrics.mlflow: %s: cannot open for appending (%s)", path,
                      err == ELOOP ? "a symbolic link: kiln writes only inside the store" : kiln_strerror(err));
        kiln_strlcpy(m->metric[i].key, key, sizeof m->metric[i].key);
        m->metric[i].f = f;
        m->nmetric++;
    }
    fprintf(m->metric[i].f, "%lld %.17g %d\n", now_ms(), value, step);
}

void mlflow_flush(Mlflow *m) {
    if (!m) return;
    if (m->rest) {
        mlrest_flush(m->rest);
        return;
    }
    for (int i = 0; i < m->nmetric; i++) fflush(m->metric[i].f);
}

void mlflow_tag(Mlflow *m, const char *key, const char *value) {
    if (!m) return;
    if (m->rest) {
        mlrest_tag(m->rest, key, value);
        return;
    }
    char path[2 * ML_PATH];
    snprintf(path, sizeof path, "%s/tags/%s", m->run_path, key);
    write_or_fail(m, path, m->run_path, value);
}

const char *mlflow_artifact_path(Mlflow *m, const char *name) {
    if (m->rest) return mlrest_artifact_path(m->rest, name);
    static char path[2 * ML_PATH];
    snprintf(path, sizeof path, "%s/%s", m->art_path, name);
    return path;
}

void mlflow_artifact_written(Mlflow *m, const char *name) {
    if (m && m->rest) mlrest_artifact_written(m->rest, name);
}

int mlflow_artifact(Mlflow *m, const char *src, const char *name) {
    if (!m) return -1;
    if (m->rest) return mlrest_artifact(m->rest, src, name);
    size_t len;
    char *data = kiln_read_file(src, &len);
    if (!data) return -1;
    int rc = write_file(mlflow_artifact_path(m, name), NULL, data, len);
    free(data);
    return rc;
}

void mlflow_end(Mlflow *m, int exit_code) {
    if (!m || m->ended) return;
    m->ending = m->ended = 1;
    if (m->rest) {
        mlrest_end(m->rest, exit_code);
        return;
    }
    mlflow_flush(m);
    /* RunStatus: 3 FINISHED, 4 FAILED, 5 KILLED */
    run_meta(m, exit_code == 0 ? 3 : exit_code == KILN_EXIT_RESUME ? 5 : 4, now_ms());
}

void mlflow_close(Mlflow *m) {
    if (!m) return;
    mlrest_close(m->rest);
    for (int i = 0; i < m->nmetric; i++) fclose(m->metric[i].f);
    free(m);
}

const char *mlflow_store(const Mlflow *m) { return m->rest ? mlrest_uri(m->rest) : m->store; }

const char *mlflow_run_id(const Mlflow *m) { return m->rest ? mlrest_run_id(m->rest) : m->run_id; }
const char *mlflow_experiment_id(const Mlflow *m) { return m->rest ? mlrest_experiment_id(m->rest) : m->exp_id; }
long mlflow_pending(const Mlflow *m) { return m && m->rest ? mlrest_pending(m->rest) : 0; }
