/* hw: hardware profiles for ./train plan (hw.h). The table's figures and
 * their sources are in docs/planner.md "Hardware profiles"; a figure changed
 * here is changed there. */
#include "hw.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/wait.h>
#include <unistd.h>
#include <yaml.h>

#include "backend.h"
#include "metrics.h"
#include "util.h"

#define GIB (1024.0 * 1024.0 * 1024.0)

/* Achieved, not datasheet, where the two differ (docs/planner.md): HBM at
 * 90% of the spec (a device-to-device copy on this workplace's H100 and
 * H200 reached 3.0 and 4.3 TB/s), NVLink at 80% of one direction's spec
 * (NCCL's all-reduce bus bandwidth on 8 GPUs), a NIC at 90% of its line
 * rate; a large bf16 product at 80% of the dense peak (790 of 989 TFLOP/s
 * measured on the H100 and H200). */
static const struct {
    const char *name, *aliases;
    double mem_gib, bf16, fp8, fp32, eff, hbm; /* GiB, TFLOP/s, -, TB/s achieved */
    int per_node;
    double intra, inter; /* GB/s per GPU per direction, achieved */
    int nics;
    double intra_us, inter_us;
} builtin[] = {
    {"h100", "h100-sxm h100-80gb h100_sxm", 79.6, 989.4, 1978.9, 66.9, 0.80, 3.0, 8, 360, 45, 8, 3, 8},
    {"h200", "h200-141gb h200_sxm", 139.8, 989.4, 1978.9, 66.9, 0.80, 4.3, 8, 360, 45, 8, 3, 8},
    {"h800", "h800-sxm", 79.6, 989.4, 1978.9, 66.9, 0.80, 3.0, 8, 160, 45, 8, 3, 8},
    {"a100-80", "a100 a100-80gb a100_80gb", 79.2, 312, 0, 19.5, 0.80, 1.84, 8, 240, 22.5, 8, 3, 8},
    {"a100-40", "a100-40gb a100_40gb", 39.4, 312, 0, 19.5, 0.80, 1.40, 8, 240, 22.5, 8, 3, 8},
    {"b200", "b200-180gb hgx-b200", 167.6, 2250, 4500, 80, 0.80, 7.2, 8, 720, 45, 8, 3, 8},
    {"gb200-nvl72", "gb200 nvl72", 173.2, 2500, 5000, 80, 0.80, 7.2, 72, 720, 45, 72, 3, 8},
};
#define NBUILTIN ((int)(sizeof builtin / sizeof builtin[0]))

const char *hw_builtin_names(void) {
    static char names[256];
    if (!names[0]) {
        size_t o = 0;
        for (int i = 0; i < NBUILTIN && o < sizeof names; i++)
            o += (size_t)snprintf(names + o, sizeof names - o, "%s%s", i ? ", " : "", builtin[i].name);
        if (o < sizeof names) snprintf(names + o, sizeof names - o, ", cpu");
    }
    return names;
}

/* Is `name` one of the space-separated words of `list`? */
static int hw_word_in(const char *name, const char *list) {
    size_t n = strlen(name);
    for (const char *p = list; *p;) {
        while (*p == ' ') p++;
        size_t k = strcspn(p, " ");
        if (k == n && strncasecmp(p, name, n) == 0) return 1;
        p += k;
    }
    return 0;
}

int hw_builtin(const char *name, HwProfile *out) {
    for (int i = 0; i < NBUILTIN; i++) {
        if (strcasecmp(name, builtin[i].name) && !hw_word_in(name, builtin[i].aliases)) continue;
        memset(out, 0, sizeof *out);
        snprintf(out->name, sizeof out->name, "%s", builtin[i].name);
        out->mem_bytes = builtin[i].mem_gib * GIB;
        out->flops_bf16 = builtin[i].bf16 * 1e12;
        out->flops_fp8 = builtin[i].fp8 * 1e12;
        out->flops_fp32 = builtin[i].fp32 * 1e12;
        out->gemm_eff = builtin[i].eff;
        out->hbm_bw = builtin[i].hbm * 1e12;
        out->gpus_per_node = builtin[i].per_node;
        out->intra_bw = builtin[i].intra * 1e9;
        out->inter_bw = builtin[i].inter * 1e9;
        out->nics_per_node = builtin[i].nics;
        out->intra_lat = builtin[i].intra_us * 1e-6;
        out->inter_lat = builtin[i].inter_us * 1e-6;
        snprintf(out->source, sizeof out->source, "built-in (docs/planner.md)");
        return 0;
    }
    return -1;
}

/* ---------------------------------------------------------------- YAML */

typedef struct {
    const char *key;
    double scale, lo, hi; /* value x scale is stored; the value must lie in [lo, hi] */
    size_t off;           /* offsetof HwProfile, a double; (size_t)-1 for the ints below */
} HwKey;

#define HW_D(k, field, scale, lo, hi) {k, scale, lo, hi, offsetof(HwProfile, field)}
static const HwKey hw_keys[] = {
    HW_D("memory_gib", mem_bytes, GIB, 0.001, 1e6),
    HW_D("bf16_tflops", flops_bf16, 1e12, 1e-6, 1e6),
    HW_D("fp8_tflops", flops_fp8, 1e12, 0, 1e6),
    HW_D("fp32_tflops", flops_fp32, 1e12, 1e-6, 1e6),
    HW_D("gemm_efficiency", gemm_eff, 1, 0.01, 1),
    HW_D("hbm_gbps", hbm_bw, 1e9, 1e-3, 1e6),
    HW_D("intra_gbps", intra_bw, 1e9, 1e-3, 1e6),
    HW_D("inter_gbps", inter_bw, 1e9, 1e-3, 1e6),
    HW_D("intra_latency_us", intra_lat, 1e-6, 0, 1e6),
    HW_D("inter_latency_us", inter_lat, 1e-6, 0, 1e6),
    HW_D("node_tflops", node_flops, 1e12, 0, 1e9),
};
#define NHWKEYS ((int)(sizeof hw_keys / sizeof hw_keys[0]))

void hw_write_yaml(const HwProfile *p, FILE *f) {
    fprintf(f, "name: %s\n", p->name);
    for (int i = 0; i < NHWKEYS; i++)
        fprintf(f, "%s: %.6g\n", hw_keys[i].key, *(const double *)((const char *)p + hw_keys[i].off) / hw_keys[i].scale);
    fprintf(f, "gpus_per_node: %d\nnics_per_node: %d\nthreads: %d\n", p->gpus_per_node, p->nics_per_node, p->threads);
}

static double hw_number(const char *path, const char *key, const char *v, double lo, double hi) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (!*v || *end || errno || !isfinite(x) || x < lo || x > hi)
        kiln_fail(KILN_EXIT_USAGE, "%s: key '%s': expected a number in [%g, %g], got '%s'", path, key, lo, hi, v);
    return x;
}

void hw_load(const char *path, HwProfile *out) {
    size_t len;
    char *text = kiln_read_file_max(path, KILN_SMALL_FILE_MAX, &len);
    if (!text) kiln_fail(KILN_EXIT_USAGE, "%s: cannot read the hardware profile: %s", path, kiln_strerror(errno));
    yaml_parser_t p;
    yaml_document_t doc;
    if (!yaml_parser_initialize(&p)) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot initialize libyaml", path);
    yaml_parser_set_input_string(&p, (const unsigned char *)text, len);
    if (!yaml_parser_load(&p, &doc))
        kiln_fail(KILN_EXIT_USAGE, "%s:%zu: invalid YAML: %s", path, p.problem_mark.line + 1,
                  p.problem ? p.problem : "parse error");
    yaml_node_t *root = yaml_document_get_root_node(&doc);
    if (!root || root->type != YAML_MAPPING_NODE)
        kiln_fail(KILN_EXIT_USAGE, "%s: expected a mapping of profile keys (docs/planner.md \"Hardware profiles\")",
                  path);
    /* first the base, then every other key over it */
    int seen[NHWKEYS + 4] = {0}, have_base = 0;
    memset(out, 0, sizeof *out);
    for (int pass = 0; pass < 2; pass++)
        for (yaml_node_pair_t *q = root->data.mapping.pairs.start; q < root->data.mapping.pairs.top; q++) {
            yaml_node_t *kn = yaml_document_get_node(&doc, q->key), *vn = yaml_document_get_node(&doc, q->value);
            if (!kn || kn->type != YAML_SCALAR_NODE || !vn || vn->type != YAML_SCALAR_NODE)
                kiln_fail(KILN_EXIT_USAGE, "%s: every entry is 'key: value' (a scalar), line %zu", path,
                          (kn ? kn->start_mark.line : 0) + 1);
            const char *k = (const char *)kn->data.scalar.value, *v = (const char *)vn->data.scalar.value;
            if (!strcmp(k, "base")) {
                if (pass == 0) {
                    if (hw_builtin(v, out) != 0)
                        kiln_fail(KILN_EXIT_USAGE, "%s: key 'base': '%s' is not a built-in profile (%s)", path, v,
                                  hw_builtin_names());
                    have_base = 1;
                }
                continue;
            }
            if (pass == 0) continue;
            int i = 0;
            while (i < NHWKEYS && strcmp(hw_keys[i].key, k)) i++;
            if (i < NHWKEYS) {
                *(double *)((char *)out + hw_keys[i].off) =
                    hw_number(path, k, v, hw_keys[i].lo, hw_keys[i].hi) * hw_keys[i].scale;
            } else if (!strcmp(k, "name")) {
                if (!*v || strlen(v) >= sizeof out->name)
                    kiln_fail(KILN_EXIT_USAGE, "%s: key 'name': expected 1 to %zu characters", path,
                              sizeof out->name - 1);
                snprintf(out->name, sizeof out->name, "%s", v);
                kiln_one_line(out->name);
                i = NHWKEYS;
            } else if (!strcmp(k, "gpus_per_node")) {
                out->gpus_per_node = (int)hw_number(path, k, v, 1, 1e5), i = NHWKEYS + 1;
            } else if (!strcmp(k, "nics_per_node")) {
                out->nics_per_node = (int)hw_number(path, k, v, 0, 1e5), i = NHWKEYS + 2;
            } else if (!strcmp(k, "threads")) {
                out->threads = (int)hw_number(path, k, v, 0, 1e5), i = NHWKEYS + 3;
            } else {
                kiln_fail(KILN_EXIT_USAGE, "%s: unknown key '%s' (docs/planner.md \"Hardware profiles\" lists them: "
                          "base, name, memory_gib, bf16_tflops, fp8_tflops, fp32_tflops, gemm_efficiency, hbm_gbps, "
                          "gpus_per_node, intra_gbps, inter_gbps, nics_per_node, intra_latency_us, inter_latency_us, node_tflops, "
                          "threads)",
                          path, k);
            }
            seen[i] = 1;
        }
    if (!have_base) /* without a base every figure must be given but fp8's (0: none) */
        for (int i = 0; i < NHWKEYS + 2; i++)
            if (!seen[i] && (i >= NHWKEYS || (hw_keys[i].off != offsetof(HwProfile, flops_fp8) &&
                                              hw_keys[i].off != offsetof(HwProfile, node_flops))))
                kiln_fail(KILN_EXIT_USAGE, "%s: key '%s': required (or start from a built-in with 'base: h100')",
                          path, i < NHWKEYS ? hw_keys[i].key : i == NHWKEYS ? "name" : "gpus_per_node");
    if (!out->name[0]) snprintf(out->name, sizeof out->name, "custom");
    snprintf(out->source, sizeof out->source, "%.150s", path);
    kiln_one_line(out->source);
    yaml_document_delete(&doc);
    yaml_parser_delete(&p);
    free(text);
}

/* ---------------------------------------------------------------- this machine */

/* Bytes/s of a memcpy of 256 MiB (read + write counted, as HBM's figures
 * are), the best of a few. */
static double hw_measure_copy(void) {
    size_t n = (size_t)256 << 20;
    char *a = xmalloc(n), *b = xmalloc(n);
    memset(a, 1, n), memset(b, 2, n);
    double best = 0;
    for (int r = 0; r < 4; r++) {
        double t0 = kiln_now();
        memcpy(b, a, n);
        double dt = kiln_now() - t0;
        if (dt > 0 && 2.0 * n / dt > best) best = 2.0 * n / dt;
        a[r] = b[n - 1 - r]; /* keep the copies */
    }
    free(a), free(b);
    return best;
}

/* Seconds of one message hop between two processes (half a round trip of
 * one byte through a pair of pipes), the median-ish best of a few hundred. */
static double hw_measure_hop(void) {
    int ab[2], ba[2];
    if (pipe(ab) || pipe(ba)) return 5e-6;
    pid_t pid = fork();
    if (pid < 0) return 5e-6;
    char c = 0;
    if (pid == 0) {
        close(ab[1]), close(ba[0]);
        while (read(ab[0], &c, 1) == 1)
            if (write(ba[1], &c, 1) != 1) break;
        _exit(0);
    }
    close(ab[0]), close(ba[1]);
    const int n = 400;
    double t0 = kiln_now();
    for (int i = 0; i < n; i++)
        if (write(ab[1], &c, 1) != 1 || read(ba[0], &c, 1) != 1) break;
    double dt = kiln_now() - t0;
    close(ab[1]), close(ba[0]);
    waitpid(pid, NULL, 0);
    return dt / (2.0 * n);
}

static void hw_cache_path(char *buf, size_t n, int cores) {
    const char *d = getenv("KILN_CACHE"), *x = getenv("XDG_CACHE_HOME"), *h = getenv("HOME");
    char dir[512];
    if (d && *d) snprintf(dir, sizeof dir, "%s", d);
    else if (x && *x) snprintf(dir, sizeof dir, "%s/kiln", x);
    else snprintf(dir, sizeof dir, "%s/.cache/kiln", h && *h ? h : "/tmp");
    char model[256] = "unknown";
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (f) {
        char line[512];
        while (fgets(line, sizeof line, f))
            if (!strncmp(line, "model name", 10) && strchr(line, ':')) {
                snprintf(model, sizeof model, "%s", strchr(line, ':') + 1);
                break;
            }
        fclose(f);
    }
    uint64_t h64 = kiln_fnv1a(model, strlen(model), KILN_FNV_INIT);
    /* v2: with node_tflops */
    snprintf(buf, n, "%s/cpu2-%d-%016llx.yaml", dir, cores, (unsigned long long)h64);
}

void hw_cpu(HwProfile *out, int fresh) {
    int cores = (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (cores < 1) cores = 1;
    char path[700];
    hw_cache_path(path, sizeof path, cores);
    if (!fresh && access(path, R_OK) == 0) {
        hw_load(path, out);
        snprintf(out->source, sizeof out->source, "measured earlier (%.140s)", path);
        return;
    }
    /* the CPU backend's product rate at each thread count; one rank of the
     * planned run gets threads / ranks, so the per-core rate is what a
     * rank of a one-rank-per-core run reaches */
    const Backend *be = &backend_cpu;
    double best = 0, one = 0, all = 0;
    int best_t = 1;
    for (int t = 1; t <= cores; t++) {
        be->init(t);
        double r = metrics_measure_matmul(be, 0.4);
        if (t == 1) one = r;
        if (t == cores) all = r;
        if (r > best) best = r, best_t = t;
    }
    be->shutdown();
    double copy = hw_measure_copy(), hop = hw_measure_hop();
    memset(out, 0, sizeof *out);
    snprintf(out->name, sizeof out->name, "cpu");
    /* one rank a core, sharing the machine's memory */
    out->mem_bytes = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE) / cores;
    /* one rank a core: the rate one core reaches (the planner's unit is a
     * rank); best_t's rate is written in the source */
    out->flops_bf16 = out->flops_fp32 = one;
    out->gemm_eff = 1.0; /* the rate is what a product reached, not a datasheet's */
    out->hbm_bw = copy / cores;
    out->gpus_per_node = cores;
    out->intra_bw = copy / 2 / cores; /* shared memory: copied in and out */
    out->inter_bw = out->intra_bw;
    out->intra_lat = out->inter_lat = hop;
    out->threads = 1;
    /* every core busy: what the ranks of a full machine share (one rank per
     * core each gets node_flops / cores, not one's rate, where cores are
     * SMT siblings or share a memory bus) */
    out->node_flops = all > one ? all : one;
    snprintf(out->source, sizeof out->source, "measured: sgemm %.3g GFLOP/s on 1 thread, %.3g on %d; copy %.3g GB/s; "
             "hop %.2g us", one / 1e9, best / 1e9, best_t, copy / 1e9, hop * 1e6);
    /* cache it (a failure to write only costs a measurement next time) */
    char dir[700];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = '\0';
    if (kiln_mkdirs(dir) == 0) {
        char *text = NULL;
        size_t n = 0;
        FILE *m = open_memstream(&text, &n);
        if (m) {
            fprintf(m, "# ./train plan --hardware cpu: %s\n", out->source);
            hw_write_yaml(out, m);
            fclose(m);
            if (kiln_write_file_atomic(path, text, n) != 0) kiln_warn("%s: cannot write the cpu profile", path);
            free(text);
        }
    }
}

void hw_resolve(const char *name, HwProfile *out) {
    if (!strcasecmp(name, "cpu")) {
        hw_cpu(out, 0);
    } else if (hw_builtin(name, out) == 0) {
        /* filled */
    } else if (strchr(name, '/') || strstr(name, ".yaml") || strstr(name, ".yml") || access(name, F_OK) == 0) {
        hw_load(name, out);
    } else {
        kiln_fail(KILN_EXIT_USAGE, "--hardware: '%s' is neither a built-in profile (%s) nor a YAML file", name,
                  hw_builtin_names());
    }
}
