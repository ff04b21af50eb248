/* metrics: the progress line and bar, metrics.jsonl, TensorBoard events, the
 * per-rank log and warnings, the heartbeat file and the watchdog thread. Sees
 * only the numbers the step loop hands it; must never touch the model, the data
 * or device memory (the peak-rate measurement uses its own buffers). */
#include "metrics.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "util.h"

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
};

static void fmt_duration(double s, char *buf, size_t cap) {
    if (!isfinite(s) || s < 0) {
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
    char buf[1024];
    int n = snprintf(buf, sizeof buf,
                     "{\"rank\":%d,\"world\":%d,\"step\":%d,\"phase\":\"%s\",\"phase_step\":%d,\"phase_s\":%.3f,"
                     "\"time\":%.3f,\"host\":\"%s\",\"pid\":%d%s}\n",
                     m->rank, m->world, m->last_step, phase_names[m->phase], m->phase_step, now - m->phase_since,
                     wall, m->host, m->pid, stalled ? ",\"stalled\":true" : "");
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

    /* Test hook (docs/metrics.md): hang in the forward phase of one step,
     * as a rank stuck in a collective would, for the watchdog test. */
    static int stall_at = -1;
    if (stall_at < 0) {
        const char *e = getenv("KILN_TEST_STALL_AT_STEP");
        stall_at = e ? atoi(e) : 0;
    }
    if (stall_at > 0 && step == stall_at && phase == PHASE_FORWARD)
        for (;;) sleep(1);
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
    }
    pthread_mutex_unlock(&m->lock);
    return NULL;
}

/* ---------- open / step / close ---------- */

/* Resume: keep the lines of metrics.jsonl up to start_step (a run killed
 * after its last checkpoint wrote lines the resumed run will write again) and
 * return the elapsed_s and nonfinite_skipped of the last line kept. */
static double jsonl_truncate(const char *path, int start_step, int *skipped) {
    size_t len = 0;
    char *text = kiln_read_file(path, &len);
    if (!text) return 0.0;
    /* kept lines are compacted in place, then written through a temp file
     * and renamed: a kill -9 here must not lose the file (test/t_ckpt_kill.sh) */
    double elapsed = 0.0;
    char *line = text, *end = text + len, *out = text;
    while (line < end) {
        char *nl = memchr(line, '\n', (size_t)(end - line));
        if (!nl) break; /* a torn last line: drop it */
        const char *s = strstr(line, "\"step\":");
        if (s && s < nl && atoi(s + 7) <= start_step) {
            const char *e = strstr(line, "\"elapsed_s\":");
            if (e && e < nl) elapsed = atof(e + 12);
            const char *k = strstr(line, "\"nonfinite_skipped\":");
            if (k && k < nl) *skipped = atoi(k + 20);
            memmove(out, line, (size_t)(nl - line + 1));
            out += nl - line + 1;
        }
        line = nl + 1;
    }
    if (kiln_write_file_atomic(path, text, (size_t)(out - text)) != 0)
        kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot rewrite for the resumed run", path);
    free(text);
    return elapsed;
}

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
    m->tty = rank == 0 && isatty(1);
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

    if (rank == 0) {
        snprintf(path, sizeof path, "%s/metrics.jsonl", c->run_dir);
        if (start_step > 0) m->elapsed_base = jsonl_truncate(path, start_step, &m->skipped);
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
    double mfu = m->peak > 0 ? m->fpt * tok_s / m->peak : NAN;
    int done_here = s->step - m->start_step;
    double eta = done_here > 0 ? (now - m->t_open) / done_here * (m->steps - s->step) : NAN;
    double rss = metrics_peak_rss_mib();
    if (s->skipped) m->skipped++;
    if (!isnan(s->val_loss)) m->last_val = s->val_loss;
    check_warnings(m, s);

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
        json_num(f, "step_time_s", s->step_time_s);
        json_num(f, "elapsed_s", elapsed);
        json_num(f, "eta_s", eta);
        fprintf(f, ",\"time\":%.3f", wall_now());
        json_num(f, "peak_rss_mib", rss);
        if (s->device_mib > 0) json_num(f, "peak_device_mib", s->device_mib);
        fprintf(f, ",\"nonfinite_skipped\":%d", m->skipped);
        if (s->skipped) fputs(",\"skipped\":true", f);
        if (s->param_hash) fprintf(f, ",\"param_hash\":\"%016llx\"", (unsigned long long)s->param_hash);
        if (s->moe) json_moe(f, s->moe);
        if (s->data) json_data(f, s->data);
        fputs("}\n", f);
        fflush(f);
    }
    if (m->tb) {
        const char *tags[10];
        float vals[10];
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
#undef TB
        uint8_t buf[1024];
        size_t len = metrics_tb_encode(buf, sizeof buf, wall_now(), s->step, NULL, n, tags, vals);
        metrics_tb_write_record(m->tb, buf, len);
        if (s->moe) tb_moe(m, s->step, s->moe);
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
        char line[1024], mf[32] = "", val[320] = "", moe[128] = "";
        if (m->peak > 0) snprintf(mf, sizeof mf, " | MFU %4.1f%%", 100.0 * mfu);
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
        snprintf(line, sizeof line, "step %*d/%d | loss %.4f | lr %.3e | norm %.3f | %s tok/s%s | %.0f ms | %s elapsed | ETA %s%s%s%s",
                 (int)snprintf(NULL, 0, "%d", m->steps), s->step, m->steps, s->loss, s->lr, s->grad_norm, tok, mf,
                 s->step_time_s * 1e3, el, et, moe, val, s->skipped ? " | skipped" : "");
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
    heartbeat_write_locked(m, 0);
    pthread_mutex_unlock(&m->lock);
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
    if (m->jsonl) fclose(m->jsonl);
    if (m->tb) fclose(m->tb);
    if (m->log) fclose(m->log);
    pthread_mutex_destroy(&m->lock);
    free(m);
}
