/* test_metrics: the metrics module's pieces without a training run — CRC32C
 * against its published check value, the Event encoding decoded field by
 * field, the GPU peak table's name matching, and a Metrics object fed made-up
 * steps: metrics.jsonl, the heartbeat, the rank log and its warnings. The
 * files are read back by TensorBoard's own reader in test/t_metrics.sh. */
#include "metrics.h"
#include "test.h"
#include "util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static uint64_t get_varint(const uint8_t *p, size_t *o) {
    uint64_t v = 0;
    for (int s = 0;; s += 7) {
        uint8_t b = p[(*o)++];
        v |= (uint64_t)(b & 0x7f) << s;
        if (!(b & 0x80)) return v;
    }
}

static void test_crc(void) {
    /* the CRC-32C check value of "123456789" (RFC 3720 appendix B.4 lists the algorithm) */
    uint32_t c = metrics_crc32c("123456789", 9);
    test_report(c == 0xe3069283u, "metrics_crc32c_check_value", "got %08x", c);
    uint32_t m = metrics_crc32c_masked("123456789", 9);
    uint32_t want = ((c >> 15) | (c << 17)) + 0xa282ead8u;
    test_report(m == want, "metrics_crc32c_masked", "got %08x want %08x", m, want);
}

static void test_event_encoding(void) {
    uint8_t buf[512];
    const char *tags[2] = {"train/loss", "perf/tok_per_s"};
    float vals[2] = {2.5f, 12345.0f};
    size_t n = metrics_tb_encode(buf, sizeof buf, 1700000000.25, 300, NULL, 2, tags, vals);
    int ok = n > 0;
    size_t o = 0;
    double wt = 0;
    int64_t step = -1;
    int nvals = 0;
    char tag[2][64] = {"", ""};
    float got[2] = {0, 0};
    while (ok && o < n) {
        uint8_t key = buf[o++];
        if (key == 0x09) memcpy(&wt, buf + o, 8), o += 8;
        else if (key == 0x10) step = (int64_t)get_varint(buf, &o);
        else if (key == 0x2a) {
            size_t len = get_varint(buf, &o), end = o + len;
            while (o < end && nvals < 2) {
                if (buf[o++] != 0x0a) { ok = 0; break; }
                size_t vl = get_varint(buf, &o), vend = o + vl;
                while (o < vend) {
                    uint8_t k = buf[o++];
                    if (k == 0x0a) {
                        size_t tl = get_varint(buf, &o);
                        snprintf(tag[nvals], 64, "%.*s", (int)tl, (const char *)buf + o);
                        o += tl;
                    } else if (k == 0x15) memcpy(&got[nvals], buf + o, 4), o += 4;
                    else { ok = 0; break; }
                }
                nvals++;
            }
        } else ok = 0;
    }
    ok = ok && wt == 1700000000.25 && step == 300 && nvals == 2 && !strcmp(tag[0], tags[0]) &&
         !strcmp(tag[1], tags[1]) && got[0] == vals[0] && got[1] == vals[1];
    test_report(ok, "metrics_tb_event_fields", "n=%zu wt=%f step=%lld nvals=%d tags %s %s", n, wt, (long long)step,
                nvals, tag[0], tag[1]);
    size_t small = metrics_tb_encode(buf, 16, 0, 0, NULL, 2, tags, vals);
    test_report(small == 0, "metrics_tb_event_refuses_small_buffer", "wrote %zu bytes into 16", small);
}

static void test_peak_table(void) {
    struct {
        const char *desc, *dtype;
        double tflops;
    } cases[] = {
        {"cuda: NVIDIA H100 80GB HBM3, CUDA 12.4", "bf16", 989.4},
        {"cuda: NVIDIA H100 PCIe", "bf16", 756},
        {"NVIDIA A100-SXM4-80GB", "bf16", 312},
        {"NVIDIA A100-SXM4-80GB", "fp32", 19.5},
        {"NVIDIA A10G", "bf16", 125},  /* not "A10" by accident, and A10 not "A100" */
        {"NVIDIA L40S", "bf16", 362.05}, /* not "L4" */
        {"NVIDIA H200", "bf16", 989.4},
        {"NVIDIA B200", "bf16", 2250},
        {"cpu: 2 threads, OpenBLAS 0.3.21 (OpenMP) Zen MAX_THREADS=64", "bf16", 0},
    };
    int bad = -1;
    for (int i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++) {
        double p = metrics_peak_lookup(cases[i].desc, cases[i].dtype, NULL);
        if (fabs(p - cases[i].tflops * 1e12) > 1e6) bad = i;
    }
    test_report(bad < 0, "metrics_peak_table_matching", "case %d ('%s')", bad, bad >= 0 ? cases[bad].desc : "");
}

static char *slurp(const char *dir, const char *name) {
    char p[1024];
    size_t len;
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return kiln_read_file(p, &len);
}

static int count_char(const char *s, char c) {
    int n = 0;
    for (; s && *s; s++) n += *s == c;
    return n;
}

static void test_metrics_object(void) {
    char dir[] = "/tmp/kiln-test-metrics.XXXXXX";
    if (!mkdtemp(dir)) {
        test_report(0, "metrics_object_files", "mkdtemp failed");
        return;
    }
    Config c;
    cfg_defaults(&c);
    kiln_strlcpy(c.run_dir, dir, sizeof c.run_dir);
    c.steps = 40;
    c.log_every = 10;
    c.total_tokens = 1000;
    c.spike_factor = 2.0f;
    c.tensorboard = 1;
    c.heartbeat = 1;
    /* redirect stdout and stderr: the progress lines and warnings are checked in the log */
    fflush(stdout);
    int saved_out = dup(1), saved_err = dup(2);
    FILE *sink = fopen("/dev/null", "w");
    dup2(fileno(sink), 1);
    dup2(fileno(sink), 2);
    Metrics *m = metrics_open(&c, 0, 1, 1e6, 1e12, "test", 0);
    for (int s = 1; s <= 40; s++) {
        metrics_phase(m, PHASE_FORWARD, s);
        MetricsStep st = {s, 1000LL * s, 3.0f, s % 20 == 0 ? 2.9f : NAN, 1e-3f, 0.5, 1.0f, 0.01, 0, 0, 0, NULL, NULL};
        if (s == 25) st.loss = 7.0f;                    /* 2.3x the mean: a spike */
        if (s == 30) st.step_time_s = 0.2;              /* 20x the median and 190 ms over: slow */
        if (s == 35) st.grad_norm = NAN, st.skipped = 1; /* non-finite, skipped */
        if (s == 40) st.device_mib = 1536.5;            /* a GPU backend's peak memory */
        metrics_step(m, &st);
    }
    char *hb_mid = slurp(dir, "heartbeat/rank0.json");
    metrics_close(m);
    fflush(stdout);
    fflush(stderr);
    dup2(saved_out, 1);
    dup2(saved_err, 2);
    close(saved_out);
    close(saved_err);
    fclose(sink);

    char *jsonl = slurp(dir, "metrics.jsonl"), *log = slurp(dir, "log/rank0.txt");
    char *hb = slurp(dir, "heartbeat/rank0.json");
    test_report(jsonl && count_char(jsonl, '\n') == 40 && strstr(jsonl, "\"mfu\":") && strstr(jsonl, "\"val_loss\":2.9") &&
                    strstr(jsonl, "\"peak_rss_mib\":") && strstr(jsonl, "\"grad_norm\":null") &&
                    strstr(jsonl, "\"nonfinite_skipped\":1,\"skipped\":true"),
                "metrics_jsonl_fields", "%.300s", jsonl ? jsonl : "(missing)");
    /* device memory: on the one step that had it (the last line), nowhere else,
     * as a CPU run never writes the field */
    const char *dev = jsonl ? strstr(jsonl, "\"peak_device_mib\":1536.5") : NULL;
    test_report(dev && dev > strrchr(jsonl, '{') && dev == strstr(jsonl, "peak_device_mib") - 1,
                "metrics_device_memory_field", "%.300s", jsonl ? strrchr(jsonl, '{') : "(missing)");
    /* tok/s = 1000 tokens / 0.01 s = 1e5; MFU = 1e6 FLOPs/token * 1e5 / 1e12 = 0.1 */
    test_report(jsonl && strstr(jsonl, "\"tok_per_s\":100000") && strstr(jsonl, "\"mfu\":0.1,"), "metrics_mfu_formula",
                "%.200s", jsonl ? jsonl : "");
    test_report(log && strstr(log, "warning: step 25: loss spike") && strstr(log, "warning: step 30: slow step") &&
                    strstr(log, "warning: step 35: non-finite gradient norm"),
                "metrics_warnings_logged_with_step", "%.600s", log ? log : "(missing)");
    test_report(log && strstr(log, "step 10/40 | loss 3.0000") && strstr(log, "step 40/40") &&
                    !strstr(log, "step 11/40"),
                "metrics_progress_lines_every_log_every", "%.300s", log ? log : "");
    test_report(hb_mid && strstr(hb_mid, "\"step\":40") && strstr(hb_mid, "\"phase\":\"forward\"") &&
                    strstr(hb_mid, "\"pid\":") && strstr(hb_mid, "\"host\":") && hb && strstr(hb, "\"phase\":\"done\""),
                "metrics_heartbeat_fields", "%s / %s", hb_mid ? hb_mid : "(missing)", hb ? hb : "(missing)");
    free(jsonl), free(log), free(hb), free(hb_mid);

    /* resume: lines past the resume step are dropped, later ones appended */
    m = metrics_open(&c, 0, 1, 1e6, 0, NULL, 20);
    fflush(stdout);
    saved_out = dup(1);
    sink = fopen("/dev/null", "w");
    dup2(fileno(sink), 1);
    MetricsStep st = {21, 21000, 3.0f, NAN, 1e-3f, 0.5, 1.0f, 0.01, 0, 0, 0, NULL, NULL};
    metrics_step(m, &st);
    metrics_close(m);
    fflush(stdout);
    dup2(saved_out, 1);
    close(saved_out);
    fclose(sink);
    jsonl = slurp(dir, "metrics.jsonl");
    test_report(jsonl && count_char(jsonl, '\n') == 21 && strstr(jsonl, "{\"step\":21,") && !strstr(jsonl, "{\"step\":22,"),
                "metrics_resume_truncates_jsonl", "%d lines", count_char(jsonl, '\n'));
    free(jsonl);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

int main(void) {
    test_crc();
    test_event_encoding();
    test_peak_table();
    test_metrics_object();
    return 0;
}
