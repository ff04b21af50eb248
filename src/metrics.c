/* metrics: the progress line and bar, metrics.jsonl, TensorBoard events, the
 * per-rank log and warnings, the heartbeat file and the watchdog thread, and
 * the run's other outlets (ranks.jsonl, summary.json, MLflow, Prometheus).
 * Sees only the numbers the step loop hands it; must never touch the model,
 * the data or device memory (the peak-rate measurement uses its own buffers).
 * Talks to other ranks only through straggler.c, at logged steps. */
#include "metrics.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "flight.h"
#include "comm.h"
#include "mlflow.h"
#include "prom.h"
#include "report.h"
#include "straggler.h"
#include "testhooks.h"
#include "util.h"

_Static_assert(METRICS_COMM_GROUPS == STRAGGLER_GROUPS, "a step's groups are the straggler sample's");
_Static_assert(PHASE_COUNT <= PROM_PHASES, "every phase fits a Prometheus snapshot");

static const char *phase_names[PHASE_COUNT] = {"init",      "data", "forward", "backward",   "sync",
                                               "optimizer", "eval", "sample",  "checkpoint", "done"};

const char *metrics_phase_name(MetricsPhase p) { return p >= 0 && p < PHASE_COUNT ? phase_names[p] : "?"; }

static double wall_now(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return tv.tv_sec + tv.tv_usec * 1e-6;
}

double metrics_peak_rss_mib(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return 0.0;
    return ru.ru_maxrss / 1024.0; /* Linux: KiB */
}

static double rss_base_mib; /* metrics_mark_rss_base's; 0: not marked */

void metrics_mark_rss_base(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kib = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmRSS: %ld kB", &kib) == 1) break;
    if (f) fclose(f);
    rss_base_mib = kib >= 0 ? kib / 1024.0 : 0.0; /* no /proc (not Linux): no baseline */
}

double metrics_rss_base_mib(void) { return rss_base_mib; }

/* ---------- CRC32C and TFRecord ---------- */

static uint32_t crc_table[256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82f63b78u : c >> 1; /* Castagnoli, reflected */
        crc_table[i] = c;
    }
}

uint32_t metrics_crc32c(const void *data, size_t n) {
    pthread_once(&crc_once, crc_init);
    const uint8_t *p = data;
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) c = crc_table[(c ^ p[i]) & 0xff] ^ (c >> 8);
    return c ^ 0xffffffffu;
}

/* TensorFlow masks stored CRCs so a CRC of data holding CRCs stays strong. */
uint32_t metrics_crc32c_masked(const void *data, size_t n) {
    uint32_t c = metrics_crc32c(data, n);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

static size_t pb_varint(uint8_t *p, uint64_t v) {
    size_t n = 0;
    do {
        p[n++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
        v >>= 7;
    } while (v);
    return n;
}

/* Event { double wall_time = 1; int64 step = 2; string file_version = 3;
 *         Summary summary = 5; }
 * Summary { repeated Value value = 1; }  Value { string tag = 1; float simple_value = 2; } */
size_t metrics_tb_encode(uint8_t *buf, size_t cap, double wall_time, int64_t step, const char *file_version,
                         int n, const char *const *tags, const float *values) {
    size_t need = 32 + (file_version ? strlen(file_version) + 12 : 0);
    size_t summary_len = 0;
    for (int i = 0; i < n; i++) {
        size_t tl = strlen(tags[i]);
        size_t vl = 1 + 10 + tl + 5; /* tag key + len + tag + simple_value */
        summary_len += 1 + 10 + vl;
    }
    need += summary_len + 12;
    if (need > cap) return 0;
    size_t o = 0;
    buf[o++] = 0x09; /* field 1, fixed64 */
    memcpy(buf + o, &wall_time, 8);
    o += 8;
    buf[o++] = 0x10; /* field 2, varint */
    o += pb_varint(buf + o, (uint64_t)step);
    if (file_version) {
        size_t l = strlen(file_version);
        buf[o++] = 0x1a; /* field 3, bytes */
        o += pb_varint(buf + o, l);
        memcpy(buf + o, file_version, l);
        o += l;
    }
    if (n > 0) {
        size_t sl = 0;
        for (int i = 0; i < n; i++) {
            size_t tl = strlen(tags[i]);
            uint8_t tmp[10];
            size_t vl = 1 + pb_varint(tmp, tl) + tl + 5;
            sl += 1 + pb_varint(tmp, vl) + vl;
        }
        buf[o++] = 0x2a; /* field 5, bytes: Summary */
        o += pb_varint(buf + o, sl);
        for (int i = 0; i < n; i++) {
            size_t tl = strlen(tags[i]);
            uint8_t tmp[10];
            size_t vl = 1 + pb_varint(tmp, tl) + tl + 5;
            buf[o++] = 0x0a; /* Summary.value, bytes */
            o += pb_varint(buf + o, vl);
            buf[o++] = 0x0a; /* Value.tag */
            o += pb_varint(buf + o, tl);
            memcpy(buf + o, tags[i], tl);
            o += tl;
            buf[o++] = 0x15; /* Value.simple_value, fixed32 */
            memcpy(buf + o, &values[i], 4);
            o += 4;
        }
    }
    return o;
}

void metrics_tb_write_record(FILE *f, const uint8_t *data, size_t n) {
    uint64_t len = n;
    uint32_t len_crc = metrics_crc32c_masked(&len, 8), data_crc = metrics_crc32c_masked(data, n);
    fwrite(&len, 8, 1, f); /* little-endian hosts only, as everywhere in kiln */
    fwrite(&len_crc, 4, 1, f);
    fwrite(data, 1, n, f);
    fwrite(&data_crc, 4, 1, f);
}

/* ---------- peak FLOP/s ---------- */

/* Dense (no sparsity) tensor-core bf16 and plain fp32 FLOP/s from the vendors'
 * datasheets; sources and caveats in docs/metrics.md. Rows are matched as whole
 * words in the backend's device description, most specific first. */
static const struct {
    const char *name;
    double bf16, fp32; /* TFLOP/s */
} peak_table[] = {
    {"GB200", 2500, 80},  {"B200", 2250, 80},     {"B100", 1750, 60},    {"GH200", 989.4, 67},
    {"H200", 989.4, 67},  {"H100 PCIe", 756, 51}, {"H100 NVL", 835, 60}, {"H800", 989.4, 67},
    {"H100", 989.4, 67},  {"H20", 148, 44},       {"A100", 312, 19.5},   {"A800", 312, 19.5},
    {"A10G", 125, 31.2},  {"A10", 125, 31.2},     {"A30", 165, 10.3},    {"L40S", 362.05, 91.6},
    {"L40", 181, 90.5},   {"L4", 121, 30.3},      {"V100", 125, 15.7},   {"T4", 65, 8.1},
};

static int is_word_char(char ch) { return (ch >= '0' && ch <= '9') || (ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z'); }

/* Is `word` in `text` with no letter or digit on either side? */
static int contains_word(const char *text, const char *word) {
    size_t n = strlen(word);
    for (const char *p = text; (p = strstr(p, word)) != NULL; p++) {
        int before = p > text && is_word_char(p[-1]);
        int after = is_word_char(p[n]);
        if (!before && !after) return 1;
    }
    return 0;
}

double metrics_peak_lookup(const char *device_desc, const char *dtype, const char **name) {
    if (name) *name = NULL;
    if (!device_desc) return 0.0;
    for (size_t i = 0; i < sizeof peak_table / sizeof peak_table[0]; i++)
        if (contains_word(device_desc, peak_table[i].name)) {
            if (name) *name = peak_table[i].name;
            return 1e12 * (strcmp(dtype, "fp32") == 0 ? peak_table[i].fp32 : peak_table[i].bf16);
        }
    return 0.0;
}

/* The best of several timed products (1024 x 768 by 768 x 768, GPT-2 small's
 * width): the machine's fp32 ceiling for shapes a real model has, not the
 * rate a tiny model happens to reach, so MFU stays comparable across models. */
double metrics_measure_matmul(const Backend *be, double budget_s) {
    const int N = 1024, C = 768, OC = 768;
    size_t ni = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC;
    float *host = xmalloc(ni * sizeof(float));
    Rng rng;
    rng_seed(&rng, 11);
    for (size_t i = 0; i < ni; i++) host[i] = rng_uniform(&rng) - 0.5f; /* non-zero: no BLAS shortcuts */
    size_t ab = be->act_bytes(); /* the activation dtype, as training's products */
    backend_f32_to_act(host, host, ni, ab); /* in place */
    void *inp = be->alloc(ni * ab), *w = be->alloc(nw * ab), *out = be->alloc(no * ab);
    be->to_device(inp, host, ni * ab);
    be->to_device(w, host, nw * ab);
    be->matmul_forward(out, inp, w, NULL, N, C, OC); /* warm-up: thread pool, caches */
    be->sync();
    double best = 0.0, start = kiln_now();
    for (int r = 0; r < 50 && (r < 3 || kiln_now() - start < budget_s); r++) {
        double t0 = kiln_now();
        be->matmul_forward(out, inp, w, NULL, N, C, OC);
        be->sync();
        double dt = kiln_now() - t0;
        if (dt > 0 && 2.0 * N * C * OC / dt > best) best = 2.0 * N * C * OC / dt;
    }
    be->free(inp), be->free(w), be->free(out);
    free(host);
    return best;
}

/* ---------- the Metrics object ---------- */

#define SLOW_WINDOW 64

struct Metrics {
    int rank, world;
    int steps, log_every, tty, start_step;
    int64_t tokens_per_step;
    double fpt, peak;
    double hw_fpt; /* metrics_set_hw_flops; 0: the model FLOPs */
    char peak_source[160]; /* printed at the first step */
    float spike_factor;
    char run_dir[CFG_STR];
    char host[256];
    int pid;

    FILE *jsonl, *tb, *log;
    double t_open;        /* monotonic, at open */
    double elapsed_base;  /* elapsed_s carried over from before a resume */
    double last_bar;      /* monotonic time of the last bar redraw */
    int bar_shown;

    double loss_mean;     /* running mean (EMA) of finite, non-spike losses */
    int loss_count;
    double times[SLOW_WINDOW];
    int ntimes;
    int skipped;
    float last_val;

    /* heartbeat and watchdog; the lock guards everything below */
    int heartbeat;
    char hb_path[CFG_STR + 64], hb_tmp[CFG_STR + 80];
    double hb_last_write;
    pthread_mutex_t lock;
    MetricsPhase phase;
    int phase_step, last_step;
    double phase_since;               /* monotonic */
    double phase_enter[PHASE_COUNT];  /* monotonic, 0 = never */
    double phase_total[PHASE_COUNT];  /* seconds spent, closed intervals */
    int phase_last_step[PHASE_COUNT];
    long phase_count[PHASE_COUNT];
    atomic_int stop;
    pthread_cond_t wake;  /* signalled by metrics_close to end the watchdog's wait */
    double stall_timeout;
    pthread_t watchdog;
    int watchdog_running;

    /* the run so far, for summary.json (carried over a resume from metrics.jsonl) */
    char run_name[CFG_STR], ckpt_dir[CFG_STR + 16], commit[64];
    MetricsLayout layout; /* summary.json "layout" (world 0: not set) */
    MetricsResumed resumed; /* summary.json "resumed" (checkpoint "": a fresh start) */
    double wall_open;             /* Unix time at open */
    double final_loss, best_loss, best_val;
    int best_loss_step, best_val_step, last_val_step, steps_seen;
    int64_t tokens;               /* tokens seen, all ranks, at the last step */
    double run_step_s, run_tokens; /* sums over this process's steps (throughput, MFU) */
    int exit_code, ended;
    char exit_reason[1024];

    /* stragglers (world > 1): this rank's sums since the last logged step */
    Straggler *strag;
    FILE *ranks;                  /* rank 0: ranks.jsonl */
    double acc_step, acc_data, acc_comm[METRICS_COMM_GROUPS], data_mark;
    int acc_n, ngroups;
    char groups[METRICS_COMM_GROUPS][16];
    int slowest_rank;             /* at the last gather (-1 none) */
    double slowest_factor;
    int slow_rank, slow_ms, slow_step; /* test hook slow_rank / slow_ms (testhooks.h) */
    float straggler_factor;

    Mlflow *mlflow;               /* rank 0, metrics.mlflow */
    char mlflow_store[CFG_STR];

    /* Prometheus (rank 0, monitor.prometheus_file): the last step's figures;
     * the watchdog thread refreshes the file between steps (under lock) */
    char prom_path[CFG_STR];
    int prom_every;
    double prom_last;             /* monotonic time of the last write */
    double last_loss, last_tok_s, last_mfu, last_step_s;
};

static void fmt_duration(double s, char *buf, size_t cap) {
    if (!isfinite(s) || s < 0 || s > 1e15) { /* past 30 million years: (long) would overflow not far above */
        snprintf(buf, cap, "?");
        return;
    }
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(buf, cap, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
    else snprintf(buf, cap, "%ld:%02ld", t / 60, t % 60);
}

static void fmt_count(double v, char *buf, size_t cap) {
    if (v >= 1e9) snprintf(buf, cap, "%.2fG", v / 1e9);
    else if (v >= 1e6) snprintf(buf, cap, "%.2fM", v / 1e6);
    else if (v >= 1e4) snprintf(buf, cap, "%.1fk", v / 1e3);
    else snprintf(buf, cap, "%.0f", v);
}

/* JSON has no NaN or Infinity: those are written as null. */
static void json_num(FILE *f, const char *key, double v) {
    if (isfinite(v)) fprintf(f, ",\"%s\":%.6g", key, v);
    else fprintf(f, ",\"%s\":null", key);
}

static void log_line(Metrics *m, const char *line) {
    if (!m->log) return;
    fputs(line, m->log);
    fputc('\n', m->log);
    fflush(m->log);
}

void metrics_bar_clear(Metrics *m) {
    if (m && m->bar_shown) {
        fputs("\r\033[K", stdout);
        fflush(stdout);
        m->bar_shown = 0;
    }
}

static void vprint(Metrics *m, const char *fmt, va_list ap) {
    char line[2048];
    vsnprintf(line, sizeof line, fmt, ap);
    if (m->rank == 0) {
        metrics_bar_clear(m);
        fputs(line, stdout);
        fputc('\n', stdout);
        fflush(stdout);
    }
    log_line(m, line);
}

void metrics_print(Metrics *m, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vprint(m, fmt, ap);
    va_end(ap);
}

void metrics_warn(Metrics *m, int step, const char *fmt, ...) {
    char msg[1536], line[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (m->world > 1) snprintf(line, sizeof line, "warning: rank %d: step %d: %s", m->rank, step, msg);
    else snprintf(line, sizeof line, "warning: step %d: %s", step, msg);
    metrics_bar_clear(m);
    fflush(stdout);
    fprintf(stderr, "kiln: %s\n", line);
    fflush(stderr);
    log_line(m, line);
}

void metrics_fail(Metrics *m, int code, const char *fmt, ...) {
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    metrics_bar_clear(m);
    if (m->log) {
        fprintf(m->log, "error: %s\n", msg);
        fflush(m->log);
    }
    kiln_fail(code, "%s", msg);
}

int metrics_skipped(const Metrics *m) { return m->skipped; }

/* ---------- heartbeat ---------- */

/* Written through a temporary file and rename, so a reader sees the old file
 * or the new one, never half of one; not fsynced: it is a liveness signal,
 * and an fsync per step would cost more than the step on small models. */
static void heartbeat_write_locked(Metrics *m, int stalled) {
    if (!m->heartbeat) return;
    double now = kiln_now(), wall = wall_now();
    char buf[1024], mlpend[48] = "";
    /* points the tracking server has not confirmed yet (./train status) */
    if (mlflow_is_server(m->mlflow_store)) snprintf(mlpend, sizeof mlpend, ",\"mlflow_pending\":%ld", mlflow_pending(m->mlflow));
    int n = snprintf(buf, sizeof buf,
                     "{\"rank\":%d,\"world\":%d,\"step\":%d,\"phase\":\"%s\",\"phase_step\":%d,\"phase_s\":%.3f,"
                     "\"time\":%.3f,\"host\":\"%s\",\"pid\":%d%s%s}\n",
                     m->rank, m->world, m->last_step, phase_names[m->phase], m->phase_step, now - m->phase_since,
                     wall, m->host, m->pid, stalled ? ",\"stalled\":true" : "", mlpend);
    int fd = open(m->hb_tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return; /* a heartbeat that cannot be written must not stop training */
    ssize_t w = write(fd, buf, (size_t)n);
    close(fd);
    if (w == n) rename(m->hb_tmp, m->hb_path);
    m->hb_last_write = now;
}

void metrics_phase(Metrics *m, MetricsPhase phase, int step) {
    if (!m) return;
    double now = kiln_now();
    pthread_mutex_lock(&m->lock);
    if (m->phase_enter[m->phase] > 0) m->phase_total[m->phase] += now - m->phase_since;
    m->phase = phase;
    m->phase_step = step;
    m->phase_since = now;
    m->phase_enter[phase] = now;
    m->phase_last_step[phase] = step;
    m->phase_count[phase]++;
    /* the hot phases (several per step) rewrite the file at most once a second */
    int rare = phase == PHASE_EVAL || phase == PHASE_SAMPLE || phase == PHASE_CHECKPOINT || phase == PHASE_DONE ||
               phase == PHASE_INIT;
    if (rare || now - m->hb_last_write >= 1.0) heartbeat_write_locked(m, 0);
    pthread_mutex_unlock(&m->lock);
    flight_phase(phase_names[phase], step); /* the step and phase each flight record carries */

    /* Test hook (docs/metrics.md): hang in the forward phase of one step,
     * as a rank stuck in a collective would, for the watchdog test. */
    int stall_at = testhooks()->stall_at_step;
    if (stall_at > 0 && step == stall_at && phase == PHASE_FORWARD)
        for (;;) sleep(1);
    /* Test hook (docs/metrics.md, testhooks.h): rank slow_rank waits
     * slow_ms on entering the forward phase of each step (once a
     * step), a straggler for test/t_straggler.sh. */
    if (m->slow_ms > 0 && m->rank == m->slow_rank && phase == PHASE_FORWARD && step != m->slow_step) {
        m->slow_step = step;
        struct timespec ts = {m->slow_ms / 1000, (long)(m->slow_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
}

/* What a resumed run carries over from the lines of metrics.jsonl it keeps. */
typedef struct JsonlCarry {
    double elapsed;     /* elapsed_s of the last line */
    int skipped;        /* nonfinite_skipped of the last line */
    double final_loss, best_loss, best_val, last_val;
    int best_loss_step, best_val_step, last_val_step;
} JsonlCarry;

/* A number after "key": on a line (which ends at nl); NAN if absent or null. */
static double line_num(const char *line, const char *nl, const char *key) {
    char pat[48];
    int n = snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(line, pat);
    if (!p || p > nl || p[n] == 'n') return NAN;
    return atof(p + n);
}

/* Resume: keep the lines of a jsonl file up to start_step (a run killed
 * after its last checkpoint wrote lines the resumed run will write again)
 * and, into *carry (may be NULL), what the summary needs of the lines kept. */
static void jsonl_truncate(const char *path, int start_step, JsonlCarry *carry) {
    size_t len = 0;
    char *text = kiln_read_file(path, &len);
    if (!text) return;
    /* kept lines are compacted in place, then written through a temp file
     * and renamed: a kill -9 here must not lose the file (test/t_ckpt_kill.sh) */
    char *line = text, *end = text + len, *out = text;
    while (line < end) {
        char *nl = memchr(line, '\n', (size_t)(end - line));
        if (!nl) break; /* a torn last line: drop it */
        const char *s = strstr(line, "\"step\":");
        int step = s && s < nl ? atoi(s + 7) : INT_MAX;
        if (step <= start_step) {
            if (carry) {
                double e = line_num(line, nl, "elapsed_s"), k = line_num(line, nl, "nonfinite_skipped");
                double loss = line_num(line, nl, "loss"), val = line_num(line, nl, "val_loss");
                const char *sk = strstr(line, "\"skipped\":true");
                if (isfinite(e)) carry->elapsed = e;
                if (isfinite(k)) carry->skipped = (int)k;
                if (isfinite(loss) && !(sk && sk < nl)) { /* as metrics_step: skipped steps left out */
                    carry->final_loss = loss;
                    if (!(loss >= carry->best_loss)) carry->best_loss = loss, carry->best_loss_step = step;
                }
                if (isfinite(val)) {
                    carry->last_val = val, carry->last_val_step = step;
                    if (!(val >= carry->best_val)) carry->best_val = val, carry->best_val_step = step;
                }
            }
            memmove(out, line, (size_t)(nl - line + 1));
            out += nl - line + 1;
        }
        line = nl + 1;
    }
    if (kiln_write_file_atomic(path, text, (size_t)(out - text)) != 0)
        kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot rewrite for the resumed run", path);
    free(text);
}

/* ---------- the run's other outlets: stragglers, summary, MLflow, Prometheus ---------- */

/* A straggler must be this much slower per step too, beyond the factor:
 * timer noise and scheduling jitter of tiny models on shared cores are
 * milliseconds, and no news (test/t_straggler.sh slows a rank by 300 ms). */
#define STRAGGLER_MIN_EXCESS_S 0.020
/* How often the watchdog thread rewrites the Prometheus file when no step
 * has (evaluation, checkpoint, a hang): its progress age keeps growing. */
#define PROM_REFRESH_S 10.0

static Metrics *fail_metrics; /* rank 0's, for the kiln_fail hook */

/* metrics.progress: the bar on a terminal, unless a launcher started the
 * run: Open MPI hands ranks a pseudo-terminal and srun --pty does the same,
 * and what is written there ends up in log files. */
static int progress_bar(const char *mode) {
    if (!strcmp(mode, "bar")) return 1;
    if (!strcmp(mode, "lines")) return 0;
    static const char *const launcher_env[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "SLURM_JOB_ID", "SLURM_PROCID"};
    for (size_t i = 0; i < sizeof launcher_env / sizeof launcher_env[0]; i++)
        if (getenv(launcher_env[i])) return 0;
    return isatty(1) && comm_info()->source == COMM_SOURCE_SINGLE;
}

static void json_strval(FILE *f, const char *v) {
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)v; *p; p++) {
        if (*p == '"' || *p == '\\') fprintf(f, "\\%c", *p);
        else if (*p < 0x20) fprintf(f, "\\u%04x", *p);
        else fputc(*p, f);
    }
    fputc('"', f);
}

static void json_str(FILE *f, const char *key, const char *v) {
    fprintf(f, ",\"%s\":", key);
    json_strval(f, v);
}

/* The newest complete checkpoint: its step (-1: none) and when `latest`
 * was written to name it (Unix seconds). */
static int latest_checkpoint(const Metrics *m, char *name, size_t cap, double *when) {
    char path[CFG_STR + 64];
    snprintf(path, sizeof path, "%s/latest", m->ckpt_dir);
    size_t len;
    char *t = kiln_read_file_max(path, KILN_SMALL_FILE_MAX, &len);
    if (!t) return -1;
    t[strcspn(t, "\r\n")] = 0;
    kiln_strlcpy(name, t, cap);
    free(t);
    struct stat st;
    if (stat(path, &st) != 0 || strncmp(name, "step_", 5) != 0) return -1;
    *when = (double)st.st_mtim.tv_sec + st.st_mtim.tv_nsec * 1e-9;
    return atoi(name + 5);
}

/* Caller holds m->lock (the watchdog thread writes it too). */
static void prom_write_locked(Metrics *m, int running) {
    if (!m->prom_path[0]) return;
    double now = kiln_now(), wall = wall_now();
    PromSnapshot ps = {.run = m->run_name, .running = running, .exit_code = m->exit_code, .step = m->last_step,
                       .steps = m->steps, .tokens = (double)m->tokens, .loss = m->last_loss, .val_loss = m->last_val,
                       .tok_per_s = m->last_tok_s, .mfu = m->last_mfu, .step_s = m->last_step_s,
                       .start_unix = m->wall_open, .progress_unix = wall - (now - m->phase_since),
                       .since_progress_s = now - m->phase_since, .nphase = PHASE_COUNT, .ckpt_age_s = NAN,
                       .ckpt_step = -1, .world = m->world, .slowest_rank = m->slowest_rank,
                       .slowest_factor = m->slowest_factor, .nonfinite_skipped = m->skipped};
    for (int p = 0; p < PHASE_COUNT; p++) {
        ps.phase_name[p] = phase_names[p];
        ps.phase_s[p] = m->phase_total[p] + (p == (int)m->phase ? now - m->phase_since : 0.0);
    }
    char name[256];
    double when;
    ps.ckpt_step = latest_checkpoint(m, name, sizeof name, &when);
    if (ps.ckpt_step >= 0) ps.ckpt_age_s = wall - when;
    /* a monitoring file that cannot be written must not stop training: say it once */
    if (prom_write(m->prom_path, &ps) != 0) {
        kiln_warn("monitor.prometheus_file: %s: cannot write (%s); no more attempts", m->prom_path, strerror(errno));
        m->prom_path[0] = 0;
    }
    m->prom_last = now;
}

/* RUN_DIR/summary.json, through a temporary file and a rename. */
static void summary_write(Metrics *m) {
    char *text = NULL, path[CFG_STR + 32];
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) return;
    double now = wall_now();
    char started[32], ended[32];
    time_t t0 = (time_t)m->wall_open, t1 = (time_t)now;
    strftime(started, sizeof started, "%Y-%m-%dT%H:%M:%SZ", gmtime(&t0));
    strftime(ended, sizeof ended, "%Y-%m-%dT%H:%M:%SZ", gmtime(&t1));
    const char *status = m->exit_code == 0 ? "completed" : m->exit_code == KILN_EXIT_RESUME ? "stopped" : "failed";
    fputs("{\"run\":", f);
    json_strval(f, m->run_name);
    json_str(f, "run_dir", m->run_dir);
    json_str(f, "status", status);
    fprintf(f, ",\"exit_code\":%d", m->exit_code);
    json_str(f, "exit_reason", m->exit_reason);
    fprintf(f, ",\"steps\":%d,\"steps_planned\":%d,\"start_step\":%d,\"tokens\":%lld", m->last_step, m->steps,
            m->start_step, (long long)m->tokens);
    json_num(f, "elapsed_s", m->elapsed_base + (kiln_now() - m->t_open));
    json_num(f, "process_s", kiln_now() - m->t_open);
    json_num(f, "final_loss", m->final_loss);
    json_num(f, "best_loss", m->best_loss);
    if (isfinite(m->best_loss)) fprintf(f, ",\"best_loss_step\":%d", m->best_loss_step);
    json_num(f, "final_val_loss", m->last_val);
    if (isfinite(m->last_val)) fprintf(f, ",\"final_val_step\":%d", m->last_val_step);
    json_num(f, "best_val_loss", m->best_val);
    if (isfinite(m->best_val)) fprintf(f, ",\"best_val_step\":%d", m->best_val_step);
    double tok_s = m->run_step_s > 0 ? m->run_tokens / m->run_step_s : NAN;
    json_num(f, "tok_per_s", tok_s);
    if (m->peak > 0) json_num(f, "mfu", m->fpt * tok_s / (m->peak * m->world));
    json_num(f, "step_time_s", m->steps_seen ? m->run_step_s / m->steps_seen : NAN);
    fprintf(f, ",\"nonfinite_skipped\":%d", m->skipped);
    char name[256] = "";
    double when = 0;
    int ck = latest_checkpoint(m, name, sizeof name, &when);
    fprintf(f, ",\"checkpoints\":{\"written\":%ld", m->phase_count[PHASE_CHECKPOINT]);
    if (ck >= 0) {
        json_str(f, "latest", name);
        fprintf(f, ",\"latest_step\":%d", ck);
    }
    json_str(f, "dir", m->ckpt_dir);
    fputc('}', f);
    fprintf(f, ",\"world\":%d", m->world);
    if (m->layout.world > 0) {
        const MetricsLayout *l = &m->layout;
        fprintf(f, ",\"layout\":{\"world\":%d,\"pp\":%d,\"dp\":%d,\"cp\":%d,\"tp\":%d,\"ep\":%d,\"zero\":%d,"
                "\"param_floats\":%zu,\"grad_floats\":%zu,\"optim_floats\":%zu}", l->world, l->pp, l->dp, l->cp,
                l->tp, l->ep, l->zero, l->param_floats, l->grad_floats, l->optim_floats);
    }
    if (m->resumed.checkpoint[0]) {
        const MetricsResumed *r = &m->resumed;
        fputs(",\"resumed\":{\"checkpoint\":", f);
        json_strval(f, r->checkpoint);
        fprintf(f, ",\"step\":%lld,\"tokens\":%lld,\"from\":{\"world\":%d,\"pp\":%d,\"dp\":%d,\"tp\":%d,"
                "\"ep\":%d},\"resharded\":%s}", r->step, r->tokens, r->world, r->pp, r->dp, r->tp, r->ep,
                r->resharded ? "true" : "false");
    }
    json_str(f, "host", m->host);
    json_str(f, "commit", m->commit[0] ? m->commit : "unknown");
    json_num(f, "peak_rss_mib", metrics_peak_rss_mib());
    if (m->strag) {
        const int *w;
        int n = straggler_warned(m->strag, &w);
        fputs(",\"stragglers\":[", f);
        for (int i = 0; i < n; i++) {
            fprintf(f, "%s{\"rank\":%d", i ? "," : "", w[i]);
            json_str(f, "host", straggler_host(m->strag, w[i]));
            fputc('}', f);
        }
        fputc(']', f);
    }
    if (m->mlflow) {
        fputs(",\"mlflow\":{\"store\":", f);
        json_strval(f, m->mlflow_store);
        json_str(f, "experiment_id", mlflow_experiment_id(m->mlflow));
        json_str(f, "run_id", mlflow_run_id(m->mlflow));
        if (mlflow_is_server(m->mlflow_store)) fprintf(f, ",\"unsent\":%ld", mlflow_pending(m->mlflow));
        fputc('}', f);
    }
    json_str(f, "started", started);
    json_str(f, "ended", ended);
    fprintf(f, ",\"time\":%.3f}\n", now);
    fclose(f);
    snprintf(path, sizeof path, "%s/summary.json", m->run_dir);
    if (kiln_write_file_atomic(path, text, len) != 0) kiln_warn("%s: cannot write (%s)", path, strerror(errno));
    free(text);
}

/* The end of the run, once, on rank 0: summary.json, the last Prometheus
 * snapshot (kiln_running 0), the MLflow run's artifacts and status. Called
 * from metrics_close, the kiln_fail hook and the watchdog; caller holds
 * m->lock. Writes that fail here warn: the run is ending anyway. */
static void outlets_end_locked(Metrics *m, int code, const char *reason) {
    if (m->rank != 0 || m->ended == 2) return;
    m->ended = 2;
    m->exit_code = code;
    kiln_strlcpy(m->exit_reason, reason, sizeof m->exit_reason);
    if (m->jsonl) fflush(m->jsonl);
    summary_write(m);
    prom_write_locked(m, 0);
    if (m->mlflow) {
        char path[CFG_STR + 32], s[16];
        snprintf(s, sizeof s, "%d", code);
        mlflow_tag(m->mlflow, "kiln.exit_code", s);
        mlflow_tag(m->mlflow, "kiln.exit_reason", reason);
        if (m->commit[0]) mlflow_tag(m->mlflow, "mlflow.source.git.commit", m->commit);
        snprintf(path, sizeof path, "%s/summary.json", m->run_dir);
        mlflow_artifact(m->mlflow, path, "summary.json");
        const char *dir = m->run_dir;
        if (report_write_html(&dir, 1, mlflow_artifact_path(m->mlflow, "report.html")) != 0)
            kiln_warn("metrics.mlflow: the report artifact could not be written");
        else mlflow_artifact_written(m->mlflow, "report.html");
        mlflow_end(m->mlflow, code);
        if (mlflow_is_server(m->mlflow_store)) summary_write(m); /* with the count the flush left unsent */
    }
}

static void on_fail(int code, const char *message) {
    Metrics *m = fail_metrics;
    /* ended == 2: the end is being written (a failure inside it, with the
     * lock held by this very thread, must not wait for the lock) */
    if (!m || m->ended == 2) return;
    pthread_mutex_lock(&m->lock);
    outlets_end_locked(m, code, message);
    pthread_mutex_unlock(&m->lock);
}

/* Before the files open: the fields every outlet reads. */
static void outlets_init(Metrics *m, const Config *c) {
    kiln_strlcpy(m->run_name, c->run_name, sizeof m->run_name);
    if (c->ckpt_dir[0]) kiln_strlcpy(m->ckpt_dir, c->ckpt_dir, sizeof m->ckpt_dir);
    else snprintf(m->ckpt_dir, sizeof m->ckpt_dir, "%s/checkpoints", c->run_dir);
    m->wall_open = wall_now();
    m->final_loss = m->best_loss = m->best_val = NAN;
    m->last_loss = m->last_tok_s = m->last_mfu = m->last_step_s = m->slowest_factor = NAN;
    m->slowest_rank = -1;
    if (__builtin_mul_overflow(m->tokens_per_step, (int64_t)m->start_step, &m->tokens)) m->tokens = INT64_MAX;
    kiln_strlcpy(m->exit_reason, "completed", sizeof m->exit_reason);
    m->slow_rank = testhooks()->slow_rank, m->slow_ms = testhooks()->slow_ms, m->slow_step = -1;
    m->straggler_factor = c->straggler_factor;
    if (m->rank == 0 && c->prometheus_file[0]) {
        kiln_strlcpy(m->prom_path, c->prometheus_file, sizeof m->prom_path);
        m->prom_every = c->prometheus_every;
    }
}

/* After metrics.jsonl: ranks.json[l] (collective), MLflow, Prometheus, the fail hook. */
static void outlets_open(Metrics *m, const Config *c, int start_step) {
    char path[CFG_STR + 32];
    if (m->world > 1 && comm_world()->size == m->world) {
        m->strag = straggler_open(comm_world(), m->host, c->straggler_factor, STRAGGLER_MIN_EXCESS_S,
                                  c->straggler_steps);
        if (m->rank == 0) {
            char *text = NULL;
            size_t len = 0;
            FILE *f = open_memstream(&text, &len);
            fprintf(f, "{\"world\":%d,\"hosts\":[", m->world);
            for (int r = 0; r < m->world; r++) {
                if (r) fputc(',', f);
                json_strval(f, straggler_host(m->strag, r));
            }
            fputs("]}\n", f);
            fclose(f);
            snprintf(path, sizeof path, "%s/ranks.json", c->run_dir);
            if (kiln_write_file_atomic(path, text, len) != 0) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot write", path);
            free(text);
            snprintf(path, sizeof path, "%s/ranks.jsonl", c->run_dir);
            if (start_step > 0) jsonl_truncate(path, start_step, NULL);
            m->ranks = fopen(path, start_step > 0 ? "a" : "w");
            if (!m->ranks) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot open for writing", path);
        }
    }
    if (m->rank == 0 && c->mlflow[0]) {
        char *yaml = cfg_yaml_text(c, NULL);
        MlflowOptions o = {.store = c->mlflow, .experiment = c->mlflow_experiment, .run_dir = c->run_dir,
                           .run_name = c->run_name, .config_yaml = yaml, .host = m->host, .start_step = start_step,
                           .flush_s = c->mlflow_flush_s, .required = c->mlflow_required};
        m->mlflow = mlflow_open(&o);
        if (m->mlflow) kiln_strlcpy(m->mlflow_store, mlflow_store(m->mlflow), sizeof m->mlflow_store);
        free(yaml);
    }
    if (m->rank == 0) {
        fail_metrics = m;
        kiln_set_fail_hook(on_fail);
    }
    pthread_mutex_lock(&m->lock);
    prom_write_locked(m, 1);
    pthread_mutex_unlock(&m->lock);
}

/* This rank's timings of the step into the sums since the last gather; at
 * steps that are multiples of log_every (and the last) every rank's means
 * go to rank 0 (collective). Returns rank 0's view at such steps, else NULL. */
static const StragglerStats *ranks_gather(Metrics *m, const MetricsStep *s) {
    if (!m->strag) return NULL;
    pthread_mutex_lock(&m->lock);
    double data = m->phase_total[PHASE_DATA] + (m->phase == PHASE_DATA ? kiln_now() - m->phase_since : 0.0);
    pthread_mutex_unlock(&m->lock);
    m->acc_data += data - m->data_mark;
    m->data_mark = data;
    m->acc_step += s->step_time_s;
    for (int g = 0; g < METRICS_COMM_GROUPS && s->comm_group[g]; g++) {
        m->acc_comm[g] += s->comm_s[g];
        if (g >= m->ngroups) kiln_strlcpy(m->groups[g], s->comm_group[g], sizeof m->groups[g]), m->ngroups = g + 1;
    }
    m->acc_n++;
    if (s->step % m->log_every != 0 && s->step < m->steps) return NULL;
    StragglerSample mine = {m->acc_step / m->acc_n, m->acc_data / m->acc_n, {0}, .device_mib = s->device_mib,
                            .rss_mib = metrics_peak_rss_mib(), .rss_base_mib = rss_base_mib};
    for (int g = 0; g < METRICS_COMM_GROUPS; g++) mine.comm_s[g] = m->acc_comm[g] / m->acc_n;
    m->acc_step = m->acc_data = 0, m->acc_n = 0;
    memset(m->acc_comm, 0, sizeof m->acc_comm);
    const StragglerStats *st = straggler_gather(m->strag, &mine);
    if (st) m->slowest_rank = st->slowest, m->slowest_factor = st->factor;
    return st;
}

static void json_spread(FILE *f, const char *key, const StragglerSpread *x) {
    fprintf(f, ",\"%s\":{\"min\":%.6g,\"median\":%.6g,\"max\":%.6g}", key, x->min, x->median, x->max);
}

/* "ranks" of a metrics.jsonl line: the spread of each timing over the ranks
 * and the slowest rank. */
static void json_ranks(FILE *f, const Metrics *m, const StragglerStats *st) {
    fprintf(f, ",\"ranks\":{\"world\":%d", st->world);
    json_spread(f, "step_s", &st->step);
    json_spread(f, "data_s", &st->data);
    json_spread(f, "compute_s", &st->compute_s);
    for (int g = 0; g < m->ngroups; g++) {
        char key[48];
        snprintf(key, sizeof key, "comm_%s_s", m->groups[g]);
        json_spread(f, key, &st->comm[g]);
    }
    json_spread(f, "busy_s", &st->busy_s);
    fprintf(f, ",\"slowest_rank\":%d", st->slowest);
    json_str(f, "slowest_host", straggler_host(m->strag, st->slowest));
    json_num(f, "slowest_factor", st->factor);
    fputc('}', f);
}

/* digits: significant digits (4 for timings; 6 for memory, as metrics.jsonl's) */
static void json_array_digits(FILE *f, const char *key, const double *v, size_t stride, int n, int digits) {
    fprintf(f, ",\"%s\":[", key);
    for (int r = 0; r < n; r++)
        fprintf(f, "%s%.*g", r ? "," : "", digits, *(const double *)((const char *)v + r * stride));
    fputc(']', f);
}

static void json_array(FILE *f, const char *key, const double *v, size_t stride, int n) {
    json_array_digits(f, key, v, stride, n, 4);
}

/* ranks.jsonl: every rank's timings at a logged step. */
static void ranks_line(Metrics *m, int step, const StragglerStats *st) {
    FILE *f = m->ranks;
    fprintf(f, "{\"step\":%d,\"time\":%.3f", step, wall_now());
    size_t sz = sizeof(StragglerSample);
    json_array(f, "step_s", &st->rank[0].step_s, sz, st->world);
    json_array(f, "data_s", &st->rank[0].data_s, sz, st->world);
    json_array(f, "compute_s", st->compute, sizeof(double), st->world);
    for (int g = 0; g < m->ngroups; g++) {
        char key[48];
        snprintf(key, sizeof key, "comm_%s_s", m->groups[g]);
        json_array(f, key, &st->rank[0].comm_s[g], sz, st->world);
    }
    json_array(f, "busy_s", st->busy, sizeof(double), st->world);
    if (st->rank[0].device_mib > 0) /* each rank's own: pipeline stages and expert ranks differ */
        json_array_digits(f, "peak_device_mib", &st->rank[0].device_mib, sz, st->world, 6);
    json_array_digits(f, "peak_rss_mib", &st->rank[0].rss_mib, sz, st->world, 6);
    if (st->rank[0].rss_base_mib > 0) json_array_digits(f, "rss_base_mib", &st->rank[0].rss_base_mib, sz, st->world, 6);
    fprintf(f, ",\"slowest_rank\":%d", st->slowest);
    json_num(f, "slowest_factor", st->factor);
    fputs("}\n", f);
    fflush(f);
}

/* TensorBoard ranks/...: each spread, the slowest rank, and (up to 64 ranks)
 * every rank's busy time. */
static void tb_ranks(Metrics *m, int step, const StragglerStats *st) {
    int per_rank = st->world <= 64 ? st->world : 0, cap = 3 * (4 + m->ngroups) + 2 + per_rank;
    const char **tags = xmalloc((size_t)cap * sizeof(char *));
    char *names = xmalloc((size_t)cap * 48);
    float *vals = xmalloc((size_t)cap * sizeof(float));
    int n = 0;
#define TBR(v, ...) \
    snprintf(names + (size_t)n * 48, 48, __VA_ARGS__), tags[n] = names + (size_t)n * 48, vals[n++] = (float)(v)
    const StragglerSpread *sp[4 + METRICS_COMM_GROUPS] = {&st->step, &st->data, &st->compute_s, &st->busy_s};
    char what[4 + METRICS_COMM_GROUPS][24] = {"step_s", "data_s", "compute_s", "busy_s"};
    for (int g = 0; g < m->ngroups; g++) sp[4 + g] = &st->comm[g], snprintf(what[4 + g], 24, "comm_%s_s", m->groups[g]);
    for (int k = 0; k < 4 + m->ngroups; k++) {
        TBR(sp[k]->min, "ranks/%.23s/min", what[k]);
        TBR(sp[k]->median, "ranks/%.23s/median", what[k]);
        TBR(sp[k]->max, "ranks/%.23s/max", what[k]);
    }
    TBR(st->slowest, "ranks/slowest_rank");
    if (isfinite(st->factor)) TBR(st->factor, "ranks/slowest_factor");
    for (int r = 0; r < per_rank; r++) TBR(st->busy[r], "ranks/busy_s/rank_%d", r);
#undef TBR
    size_t bcap = 64 + (size_t)n * 80;
    uint8_t *buf = xmalloc(bcap);
    size_t len = metrics_tb_encode(buf, bcap, wall_now(), step, NULL, n, tags, vals);
    if (len) metrics_tb_write_record(m->tb, buf, len);
    free(buf), free(vals), free(names), free(tags);
}

/* The straggler warning names the slow rank and its host; it is rank 0's
 * judgement of every rank, so it carries no "rank 0:" of its own. */
static void warn_straggler(Metrics *m, int step, const StragglerStats *st) {
    int r = st->slowest;
    double others = st->busy[r] / st->factor;
    char line[1024];
    snprintf(line, sizeof line,
             "warning: step %d: straggler: rank %d (host %s) is %.1fx slower than the median of the other %d "
             "ranks for %d logged steps in a row: busy %.0f ms per step against %.0f ms (data %.0f ms, compute "
             "%.0f ms; monitor.straggler_factor %g); ./train status %s ranks them",
             step, r, straggler_host(m->strag, r), st->factor, st->world - 1, st->streak, 1e3 * st->busy[r],
             1e3 * others, 1e3 * st->rank[r].data_s, 1e3 * st->compute[r], (double)m->straggler_factor, m->run_dir);
    metrics_bar_clear(m);
    fflush(stdout);
    fprintf(stderr, "kiln: %s\n", line);
    fflush(stderr);
    log_line(m, line);
}

/* One step into the MLflow run: the metrics.jsonl fields, under their names. */
static void mlflow_step(Metrics *m, const MetricsStep *s, double tok_s, double mfu, double rss,
                        const StragglerStats *st) {
    Mlflow *ml = m->mlflow;
    mlflow_log(ml, "loss", s->loss, s->step);
    if (!isnan(s->val_loss)) mlflow_log(ml, "val_loss", s->val_loss, s->step);
    mlflow_log(ml, "lr", s->lr, s->step);
    mlflow_log(ml, "grad_norm", s->grad_norm, s->step);
    mlflow_log(ml, "tok_per_s", tok_s, s->step);
    if (m->peak > 0) mlflow_log(ml, "mfu", mfu, s->step);
    mlflow_log(ml, "step_time_s", s->step_time_s, s->step);
    mlflow_log(ml, "peak_rss_mib", rss, s->step);
    if (s->device_mib > 0) mlflow_log(ml, "peak_device_mib", s->device_mib, s->step);
    mlflow_log(ml, "nonfinite_skipped", m->skipped, s->step);
    if (st) {
        mlflow_log(ml, "ranks_busy_s_max", st->busy_s.max, s->step);
        mlflow_log(ml, "ranks_busy_s_median", st->busy_s.median, s->step);
        mlflow_log(ml, "ranks_slowest_factor", st->factor, s->step);
    }
    mlflow_flush(ml);
}

/* ---------- watchdog ---------- */

static void watchdog_fire(Metrics *m, double now) {
    char text[4096];
    size_t o = 0;
    o += (size_t)snprintf(text + o, sizeof text - o,
                          "kiln: error: watchdog: rank %d made no progress for %.1f s (monitor.stall_timeout_s = %g): "
                          "phase '%s' of step %d since %.1f s\n",
                          m->rank, now - m->phase_since, m->stall_timeout, phase_names[m->phase], m->phase_step,
                          now - m->phase_since);
    o += (size_t)snprintf(text + o, sizeof text - o, "  %-11s %10s %16s %12s %9s\n", "phase", "last step",
                          "entered (s ago)", "total s", "entries");
    for (int p = 0; p < PHASE_COUNT && o < sizeof text - 128; p++) {
        if (m->phase_count[p] == 0) continue;
        double total = m->phase_total[p] + (p == (int)m->phase ? now - m->phase_since : 0.0);
        o += (size_t)snprintf(text + o, sizeof text - o, "  %-11s %10d %16.2f %12.2f %9ld%s\n", phase_names[p],
                              m->phase_last_step[p], now - m->phase_enter[p], total, m->phase_count[p],
                              p == (int)m->phase ? "  <- stuck here" : "");
    }
    /* stderr through write(2): the main thread may hold stdio's locks */
    if (write(2, text, o) < 0) { /* nothing better to do */
    }
    if (m->log) {
        int fd = fileno(m->log);
        if (write(fd, text + 13, o - 13) < 0) { /* the log line without "kiln: error: " */
        }
    }
    heartbeat_write_locked(m, 1);
    flight_dump(FLIGHT_STALL, -1);
    char reason[512];
    snprintf(reason, sizeof reason, "watchdog: rank %d made no progress for %.1f s in phase '%s' of step %d", m->rank,
             now - m->phase_since, phase_names[m->phase], m->phase_step);
    outlets_end_locked(m, KILN_EXIT_RUNTIME, reason);
    _exit(KILN_EXIT_RUNTIME); /* exit() would run atexit handlers against a live main thread */
}

static void *watchdog_main(void *arg) {
    Metrics *m = arg;
    /* poll often enough to fire within a tenth of the timeout, at most 1 s late */
    double period = m->stall_timeout / 10.0;
    if (period > 1.0) period = 1.0;
    if (period < 0.05) period = 0.05;
    pthread_mutex_lock(&m->lock);
    while (!atomic_load(&m->stop)) {
        /* a timed wait that metrics_close can cut short, so closing a run
         * never waits out a poll period */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        long ns = ts.tv_nsec + (long)(period * 1e9);
        ts.tv_sec += ns / 1000000000L;
        ts.tv_nsec = ns % 1000000000L;
        pthread_cond_timedwait(&m->wake, &m->lock, &ts);
        if (atomic_load(&m->stop)) break;
        double now = kiln_now();
        if (m->phase != PHASE_DONE && now - m->phase_since > m->stall_timeout) watchdog_fire(m, now);
        /* between steps (a long evaluation, a checkpoint, a hang): the
         * Prometheus file's progress age must still grow */
        if (m->prom_path[0] && m->phase != PHASE_DONE && now - m->prom_last >= PROM_REFRESH_S) prom_write_locked(m, 1);
    }
    pthread_mutex_unlock(&m->lock);
    return NULL;
}

/* ---------- open / step / close ---------- */

void metrics_set_hw_flops(Metrics *m, double flops_per_token) { m->hw_fpt = flops_per_token; }

Metrics *metrics_open(const Config *c, int rank, int world, double flops_per_token, double peak_flops,
                      const char *peak_source, int start_step) {
    Metrics *m = xcalloc(1, sizeof *m);
    m->rank = rank;
    m->world = world;
    m->steps = c->steps;
    m->log_every = c->log_every;
    m->tokens_per_step = c->total_tokens;
    m->start_step = start_step;
    m->fpt = flops_per_token;
    m->peak = peak_flops;
    m->spike_factor = c->spike_factor;
    m->tty = rank == 0 && progress_bar(c->progress);
    m->last_val = NAN;
    kiln_strlcpy(m->run_dir, c->run_dir, sizeof m->run_dir);
    if (gethostname(m->host, sizeof m->host - 1) != 0) kiln_strlcpy(m->host, "unknown", sizeof m->host);
    for (char *p = m->host; *p; p++)
        if (*p == '"' || *p == '\\') *p = '_';
    m->pid = (int)getpid();
    pthread_mutex_init(&m->lock, NULL);
    pthread_cond_init(&m->wake, NULL);
    m->t_open = kiln_now();
    m->phase_since = m->t_open;

    char path[CFG_STR + 512];
    snprintf(path, sizeof path, "%s/log", c->run_dir);
    if (kiln_mkdirs(path) != 0) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot create directory", path);
    snprintf(path, sizeof path, "%s/log/rank%d.txt", c->run_dir, rank);
    m->log = fopen(path, "a");
    if (!m->log) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot open for writing", path);
    time_t t = time(NULL);
    char date[64];
    strftime(date, sizeof date, "%Y-%m-%d %H:%M:%S %z", localtime(&t));
    fprintf(m->log, "=== %s | rank %d of %d | host %s | pid %d%s\n", date, rank, world, m->host, m->pid,
            start_step > 0 ? " | resumed" : "");
    fflush(m->log);

    outlets_init(m, c);
    if (rank == 0) {
        snprintf(path, sizeof path, "%s/metrics.jsonl", c->run_dir);
        if (start_step > 0) {
            JsonlCarry carry = {0, 0, NAN, NAN, NAN, NAN, 0, 0, 0};
            jsonl_truncate(path, start_step, &carry);
            m->elapsed_base = carry.elapsed, m->skipped = carry.skipped;
            m->final_loss = carry.final_loss, m->best_loss = carry.best_loss, m->best_loss_step = carry.best_loss_step;
            m->best_val = carry.best_val, m->best_val_step = carry.best_val_step;
            m->last_val = carry.last_val, m->last_val_step = carry.last_val_step;
        }
        m->jsonl = fopen(path, start_step > 0 ? "a" : "w");
        if (!m->jsonl) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot open for writing", path);
        if (c->tensorboard) {
            snprintf(path, sizeof path, "%s/events.out.tfevents.%lld.%s", c->run_dir, (long long)t, m->host);
            m->tb = fopen(path, "wb");
            if (!m->tb) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot open for writing", path);
            uint8_t buf[128];
            size_t n = metrics_tb_encode(buf, sizeof buf, wall_now(), 0, "brain.Event:2", 0, NULL, NULL);
            metrics_tb_write_record(m->tb, buf, n);
            fflush(m->tb);
        }
    }

    m->heartbeat = c->heartbeat;
    if (m->heartbeat) {
        snprintf(path, sizeof path, "%s/heartbeat", c->run_dir);
        if (kiln_mkdirs(path) != 0) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot create directory", path);
        snprintf(m->hb_path, sizeof m->hb_path, "%s/heartbeat/rank%d.json", c->run_dir, rank);
        snprintf(m->hb_tmp, sizeof m->hb_tmp, "%s/heartbeat/.rank%d.json.tmp", c->run_dir, rank);
    }
    m->last_step = start_step;
    metrics_phase(m, PHASE_INIT, start_step);

    kiln_strlcpy(m->peak_source, peak_source ? peak_source : "?", sizeof m->peak_source);

    outlets_open(m, c, start_step);

    m->stall_timeout = c->stall_timeout_s;
    if (m->stall_timeout > 0) {
        if (pthread_create(&m->watchdog, NULL, watchdog_main, m) != 0)
            kiln_fail(KILN_EXIT_RUNTIME, "cannot start the watchdog thread");
        m->watchdog_running = 1;
    }
    return m;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void check_warnings(Metrics *m, const MetricsStep *s) {
    if (!isfinite(s->grad_norm)) metrics_warn(m, s->step, "non-finite gradient norm (%g); no update made", s->grad_norm);
    else if (!isfinite(s->loss)) metrics_warn(m, s->step, "non-finite loss (%g); no update made", s->loss);
    if (isfinite(s->loss)) {
        /* a spike is judged against the mean of the last ~20 steps, once there are 10 */
        if (m->spike_factor > 0 && m->loss_count >= 10 && s->loss > m->spike_factor * m->loss_mean)
            metrics_warn(m, s->step, "loss spike: %.4f is %.2fx the running mean %.4f (monitor.spike_factor %g)",
                         s->loss, s->loss / m->loss_mean, m->loss_mean, m->spike_factor);
        else {
            m->loss_mean = m->loss_count == 0 ? s->loss : 0.9 * m->loss_mean + 0.1 * s->loss;
            m->loss_count++;
        }
    }
    /* slow step: over 3x the median of the last SLOW_WINDOW steps, once there are 10, */
    if (m->ntimes >= 10) {
        double sorted[SLOW_WINDOW];
        int n = m->ntimes < SLOW_WINDOW ? m->ntimes : SLOW_WINDOW;
        memcpy(sorted, m->times, (size_t)n * sizeof(double));
        qsort(sorted, (size_t)n, sizeof(double), cmp_double);
        double med = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
        /* and 50 ms over it: millisecond jitter of tiny models on a shared machine is no news */
        if (s->step_time_s > 3.0 * med && s->step_time_s - med > 0.05)
            metrics_warn(m, s->step, "slow step: %.0f ms, %.1fx the median %.0f ms of the last %d steps",
                         s->step_time_s * 1e3, s->step_time_s / med, med * 1e3, n);
    }
    m->times[m->ntimes % SLOW_WINDOW] = s->step_time_s;
    m->ntimes++;
}

/* MoE fields of a metrics.jsonl record: the scalars, then "moe_load" as
 * one array of n_experts loads per layer. */
static void json_moe(FILE *f, const MetricsMoe *e) {
    json_num(f, "moe_aux", e->aux);
    json_num(f, "moe_z", e->z);
    json_num(f, "moe_dropped", e->dropped);
    json_num(f, "moe_load_cv", e->load_cv);
    fputs(",\"moe_load\":[", f);
    for (int l = 0; l < e->n_layer; l++) {
        fputs(l ? ",[" : "[", f);
        for (int x = 0; x < e->n_experts; x++)
            fprintf(f, "%s%lld", x ? "," : "", (long long)e->load[(size_t)l * e->n_experts + x]);
        fputc(']', f);
    }
    fputc(']', f);
}

/* Expert-parallel fields of a metrics.jsonl record: per-rank row counts
 * (whole numbers) and the imbalance. */
static void json_ep(FILE *f, const MetricsEp *e) {
    const char *keys[3] = {"ep_sent", "ep_recv", "ep_rows"};
    const double *v[3] = {e->sent, e->recv, e->rows};
    for (int k = 0; k < 3; k++) {
        fprintf(f, ",\"%s\":[", keys[k]);
        for (int r = 0; r < e->world; r++) fprintf(f, "%s%.0f", r ? "," : "", v[k][r]);
        fputc(']', f);
    }
    json_num(f, "ep_imbalance", e->imbalance);
}

/* TensorBoard: moe/{aux,z,dropped,load_cv} and moe/load/layer_L/expert_E,
 * one record (the tags of a big MoE do not fit the step's fixed buffer). */
static void tb_moe(Metrics *m, int step, const MetricsMoe *e) {
    int n = 4 + e->n_layer * e->n_experts;
    const char **tags = xmalloc((size_t)n * sizeof(char *));
    char *names = xmalloc((size_t)n * 64);
    float *vals = xmalloc((size_t)n * sizeof(float));
    static const char *const fixed[4] = {"moe/aux", "moe/z", "moe/dropped", "moe/load_cv"};
    double fv[4] = {e->aux, e->z, e->dropped, e->load_cv};
    for (int i = 0; i < 4; i++) tags[i] = fixed[i], vals[i] = (float)fv[i];
    for (int i = 4; i < n; i++) {
        int l = (i - 4) / e->n_experts, x = (i - 4) % e->n_experts;
        snprintf(names + (size_t)i * 64, 64, "moe/load/layer_%d/expert_%d", l, x);
        tags[i] = names + (size_t)i * 64;
        vals[i] = (float)e->load[i - 4];
    }
    size_t cap = 64 + (size_t)n * 64;
    uint8_t *buf = xmalloc(cap);
    size_t len = metrics_tb_encode(buf, cap, wall_now(), step, NULL, n, tags, vals);
    if (len) metrics_tb_write_record(m->tb, buf, len);
    free(buf), free(vals), free(names), free(tags);
}

/* Data fields of a metrics.jsonl record: the wait, "tokens_by_source", and
 * "val/<name>" of each named set evaluated at this step. */
static void json_data(FILE *f, const MetricsData *d) {
    json_num(f, "data_wait_s", d->wait_s);
    fputs(",\"tokens_by_source\":{", f);
    for (int i = 0; i < d->n_sources; i++)
        fprintf(f, "%s\"%s\":%llu", i ? "," : "", d->source_names[i], (unsigned long long)d->source_tokens[i]);
    fputc('}', f);
    for (int i = 0; i < d->n_val; i++) {
        char key[96];
        snprintf(key, sizeof key, "val/%s", d->val_names[i]);
        if (!isnan(d->val_losses[i])) json_num(f, key, d->val_losses[i]);
    }
}

/* TensorBoard: perf/data_wait_s, data/tokens/<source>, val/<set>; one record
 * (names are the config's: they do not fit the step's fixed buffer). */
static void tb_data(Metrics *m, int step, const MetricsData *d) {
    int n = 1 + d->n_sources + d->n_val, k = 0;
    const char **tags = xmalloc((size_t)n * sizeof(char *));
    char *names = xmalloc((size_t)n * 96);
    float *vals = xmalloc((size_t)n * sizeof(float));
    tags[k] = "perf/data_wait_s", vals[k++] = (float)d->wait_s;
    for (int i = 0; i < d->n_sources; i++, k++) {
        snprintf(names + (size_t)k * 96, 96, "data/tokens/%s", d->source_names[i]);
        tags[k] = names + (size_t)k * 96, vals[k] = (float)d->source_tokens[i];
    }
    for (int i = 0; i < d->n_val; i++) {
        if (isnan(d->val_losses[i])) continue;
        snprintf(names + (size_t)k * 96, 96, "val/%s", d->val_names[i]);
        tags[k] = names + (size_t)k * 96, vals[k++] = d->val_losses[i];
    }
    size_t cap = 64 + (size_t)k * (96 + 16);
    uint8_t *buf = xmalloc(cap);
    size_t len = metrics_tb_encode(buf, cap, wall_now(), step, NULL, k, tags, vals);
    if (len) metrics_tb_write_record(m->tb, buf, len);
    free(buf), free(vals), free(names), free(tags);
}

void metrics_step(Metrics *m, const MetricsStep *s) {
    double now = kiln_now();
    double elapsed = m->elapsed_base + (now - m->t_open);
    double tok_s = s->step_time_s > 0 ? (double)m->tokens_per_step / s->step_time_s : 0.0;
    /* tok_s is all ranks' throughput, so the peak is all ranks' devices
     * (one a rank): each rank's share against one device's peak */
    double mfu = m->peak > 0 ? m->fpt * tok_s / (m->peak * m->world) : NAN;
    double done_here = (double)s->step - m->start_step; /* in double: a step near INT_MAX less a start */
    double eta = done_here > 0 ? (now - m->t_open) / done_here * ((double)m->steps - s->step) : NAN;
    double rss = metrics_peak_rss_mib();
    if (s->skipped) m->skipped++;
    if (!isnan(s->val_loss)) {
        m->last_val = s->val_loss, m->last_val_step = s->step;
        if (!(s->val_loss >= m->best_val)) m->best_val = s->val_loss, m->best_val_step = s->step;
    }
    if (isfinite(s->loss) && !s->skipped) {
        m->final_loss = s->loss;
        if (!(s->loss >= m->best_loss)) m->best_loss = s->loss, m->best_loss_step = s->step;
    }
    m->tokens = s->tokens, m->steps_seen++;
    m->run_step_s += s->step_time_s, m->run_tokens += (double)m->tokens_per_step;
    check_warnings(m, s);
    const StragglerStats *st = ranks_gather(m, s); /* collective at logged steps */
    if (st && st->warn) warn_straggler(m, s->step, st);

    if (m->jsonl) {
        FILE *f = m->jsonl;
        fprintf(f, "{\"step\":%d,\"tokens\":%lld", s->step, (long long)s->tokens);
        json_num(f, "loss", s->loss);
        if (!isnan(s->val_loss)) json_num(f, "val_loss", s->val_loss);
        json_num(f, "lr", s->lr);
        json_num(f, "grad_norm", s->grad_norm);
        json_num(f, "grad_scale", s->grad_scale);
        json_num(f, "tok_per_s", tok_s);
        if (m->peak > 0) json_num(f, "mfu", mfu);
        if (m->peak > 0 && m->hw_fpt > m->fpt) json_num(f, "hfu", m->hw_fpt * tok_s / (m->peak * m->world));
        json_num(f, "step_time_s", s->step_time_s);
        json_num(f, "elapsed_s", elapsed);
        json_num(f, "eta_s", eta);
        fprintf(f, ",\"time\":%.3f", wall_now());
        json_num(f, "peak_rss_mib", rss);
        if (rss_base_mib > 0) json_num(f, "rss_base_mib", rss_base_mib);
        if (s->device_mib > 0) json_num(f, "peak_device_mib", s->device_mib);
        fprintf(f, ",\"nonfinite_skipped\":%d", m->skipped);
        if (s->skipped) fputs(",\"skipped\":true", f);
        if (s->param_hash) fprintf(f, ",\"param_hash\":\"%016llx\"", (unsigned long long)s->param_hash);
        if (s->pp_bubble_theory > 0) {
            json_num(f, "pp_bubble", s->pp_bubble);
            json_num(f, "pp_bubble_theory", s->pp_bubble_theory);
        }
        if (s->moe) json_moe(f, s->moe);
        if (s->ep) json_ep(f, s->ep);
        if (st) json_ranks(f, m, st);
        if (s->data) json_data(f, s->data);
        if (s->ckpt) {
            fprintf(f, ",\"ckpt_step\":%lld", (long long)s->ckpt->step);
            json_num(f, "ckpt_pause_s", s->ckpt->pause_s);
            json_num(f, "ckpt_write_s", s->ckpt->write_s);
            json_num(f, "ckpt_gb", s->ckpt->gb);
        }
        if (s->resume_s > 0) json_num(f, "resume_s", s->resume_s);
        fputs("}\n", f);
        fflush(f);
    }
    if (st && m->ranks) ranks_line(m, s->step, st);
    if (m->mlflow) mlflow_step(m, s, tok_s, mfu, rss, st);
    if (m->tb) {
        const char *tags[16];
        float vals[16];
        int n = 0;
#define TB(t, v) \
    if (isfinite(v)) tags[n] = t, vals[n++] = (float)(v)
        TB("train/loss", s->loss);
        if (!isnan(s->val_loss)) TB("val/loss", s->val_loss);
        TB("train/lr", s->lr);
        TB("train/grad_norm", s->grad_norm);
        TB("perf/tok_per_s", tok_s);
        if (m->peak > 0) TB("perf/mfu", mfu);
        TB("perf/step_time_s", s->step_time_s);
        TB("perf/peak_rss_mib", rss);
        if (s->device_mib > 0) TB("perf/peak_device_mib", s->device_mib);
        TB("train/nonfinite_skipped", (double)m->skipped);
        if (s->ep) TB("ep/imbalance", s->ep->imbalance);
        if (s->pp_bubble_theory > 0) TB("perf/pp_bubble", s->pp_bubble);
        if (s->ckpt) TB("perf/ckpt_pause_s", s->ckpt->pause_s);
        if (s->ckpt) TB("perf/ckpt_write_s", s->ckpt->write_s);
        if (s->resume_s > 0) TB("perf/resume_s", s->resume_s);
#undef TB
        uint8_t buf[1024];
        size_t len = metrics_tb_encode(buf, sizeof buf, wall_now(), s->step, NULL, n, tags, vals);
        metrics_tb_write_record(m->tb, buf, len);
        if (s->moe) tb_moe(m, s->step, s->moe);
        if (st) tb_ranks(m, s->step, st);
        if (s->data) tb_data(m, s->step, s->data);
        fflush(m->tb);
    }

    if (s->step == m->start_step + 1) {
        if (m->peak > 0)
            metrics_print(m, "MFU against %.4g TFLOP/s peak per device (%s)", m->peak / 1e12, m->peak_source);
        else metrics_print(m, "MFU not reported: no peak FLOP/s for this device (metrics.peak_gflops)");
    }
    int evaluated = !isnan(s->val_loss);
    int last = s->step >= m->steps;
    char tok[32], el[32], et[32];
    fmt_count(tok_s, tok, sizeof tok);
    fmt_duration(elapsed, el, sizeof el);
    fmt_duration(last ? 0.0 : eta, et, sizeof et);
    if (s->step % m->log_every == 0 || last || evaluated || s->skipped) {
        char line[1024], mf[32] = "", val[320] = "", moe[128] = "", pp[64] = "";
        if (m->peak > 0) snprintf(mf, sizeof mf, " | MFU %4.1f%%", 100.0 * mfu);
        if (s->pp_bubble_theory > 0)
            snprintf(pp, sizeof pp, " | bubble %.1f%% (schedule %.1f%%)", 100.0 * s->pp_bubble,
                     100.0 * s->pp_bubble_theory);
        if (evaluated) {
            size_t o = (size_t)snprintf(val, sizeof val, " | val %.4f", s->val_loss);
            for (int i = 0; s->data && i < s->data->n_val && o < sizeof val; i++)
                o += (size_t)snprintf(val + o, sizeof val - o, "%s%s %.4f", i ? ", " : " (", s->data->val_names[i],
                                      s->data->val_losses[i]);
            if (s->data && s->data->n_val && o < sizeof val) snprintf(val + o, sizeof val - o, ")");
        }
        if (s->moe)
            snprintf(moe, sizeof moe, " | moe aux %.3f z %.3f load %.0f..%.0f cv %.3f drop %.2f%%", s->moe->aux,
                     s->moe->z, s->moe->load_min, s->moe->load_max, s->moe->load_cv, 100.0 * s->moe->dropped);
        long behind = mlflow_pending(m->mlflow);
        char ml[48] = "";
        if (behind > 0) snprintf(ml, sizeof ml, " | mlflow %ld behind", behind);
        snprintf(line, sizeof line, "step %*d/%d | loss %.4f | lr %.3e | norm %.3f | %s tok/s%s | %.0f ms%s | %s elapsed | ETA %s%s%s%s%s",
                 (int)snprintf(NULL, 0, "%d", m->steps), s->step, m->steps, s->loss, s->lr, s->grad_norm, tok, mf,
                 s->step_time_s * 1e3, pp, el, et, moe, val, s->skipped ? " | skipped" : "", ml);
        metrics_print(m, "%s", line);
    }
    if (m->tty && !last && (now - m->last_bar >= 0.1)) {
        /* the live bar: redrawn in place, at most ten times a second */
        int width = 24, fill = (int)((double)s->step / m->steps * width);
        char bar[64];
        for (int i = 0; i < width; i++) bar[i] = i < fill ? '#' : '.';
        bar[width] = 0;
        char mf[32] = "";
        if (m->peak > 0) snprintf(mf, sizeof mf, " | MFU %.1f%%", 100.0 * mfu);
        printf("\r\033[K[%s] %d/%d %3.0f%% | loss %.4f | %s tok/s%s | ETA %s", bar, s->step, m->steps,
               100.0 * s->step / m->steps, s->loss, tok, mf, et);
        fflush(stdout);
        m->bar_shown = 1;
        m->last_bar = now;
    }

    pthread_mutex_lock(&m->lock);
    m->last_step = s->step;
    m->last_loss = s->loss, m->last_tok_s = tok_s, m->last_mfu = mfu, m->last_step_s = s->step_time_s;
    heartbeat_write_locked(m, 0);
    if (m->prom_path[0] && (s->step % m->prom_every == 0 || last)) prom_write_locked(m, 1);
    pthread_mutex_unlock(&m->lock);
}

void metrics_end(Metrics *m, int exit_code, const char *reason) {
    if (!m) return;
    m->exit_code = exit_code;
    kiln_strlcpy(m->exit_reason, reason, sizeof m->exit_reason);
    m->ended = 1;
}

void metrics_set_commit(Metrics *m, const char *commit) {
    if (m && commit) kiln_strlcpy(m->commit, commit, sizeof m->commit);
}

void metrics_set_layout(Metrics *m, const MetricsLayout *l) {
    if (m) m->layout = *l;
}

void metrics_set_resumed(Metrics *m, const MetricsResumed *r) {
    if (m) m->resumed = *r;
}

void metrics_close(Metrics *m) {
    if (!m) return;
    metrics_phase(m, PHASE_DONE, m->last_step);
    if (m->watchdog_running) {
        pthread_mutex_lock(&m->lock);
        atomic_store(&m->stop, 1);
        pthread_cond_signal(&m->wake);
        pthread_mutex_unlock(&m->lock);
        pthread_join(m->watchdog, NULL);
    }
    pthread_cond_destroy(&m->wake);
    metrics_bar_clear(m);
    pthread_mutex_lock(&m->lock);
    outlets_end_locked(m, m->exit_code, m->exit_reason);
    pthread_mutex_unlock(&m->lock);
    if (fail_metrics == m) {
        kiln_set_fail_hook(NULL);
        fail_metrics = NULL;
    }
    mlflow_close(m->mlflow);
    straggler_close(m->strag);
    if (m->ranks) fclose(m->ranks);
    if (m->jsonl) fclose(m->jsonl);
    if (m->tb) fclose(m->tb);
    if (m->log) fclose(m->log);
    pthread_mutex_destroy(&m->lock);
    free(m);
}
