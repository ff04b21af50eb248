/* bench_data: the loader at scale, printed, never asserted (scripts/bench.sh
 * runs it; timings on a shared machine are no test). (1) Start-up and memory
 * of a glob of many small shards, .bin and .bin.zst: the time to index them
 * (glob, sort, one header each) and to the first batch, resident memory and
 * open files after 200 batches. (2) What prefetch does to the wait for data:
 * a step that computes for a fixed time, with .bin.zst shards that must be
 * decompressed on the way (more shards than may stay open), prefetch 0 and 4.
 *
 * usage: bench_data [N_SHARDS (10000)] [TOKENS_PER_SHARD (2048)]
 * Files go under $KILN_BENCH_DIR (default a new /tmp/kiln-bench-data.*),
 * removed at the end. The page cache is warm (the files were just written). */
#include "data.h"
#include "shard.h"
#include "util.h"

#include <dirent.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zstd.h>

static double status_mib(const char *key) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    double v = 0;
    size_t n = strlen(key);
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, key, n)) v = atof(line + n + 1) / 1024.0;
    if (f) fclose(f);
    return v;
}

static int open_fds(void) {
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    while (d && readdir(d)) n++;
    if (d) closedir(d);
    return n - 3; /* ".", "..", and the one opendir holds */
}

/* n_shards shards of `tokens` byte-level ids each, written plainly (no fsync:
 * the set is scratch), .bin or whole-file zstd level 1 as shard_write does. */
static void make_set(const char *dir, int n_shards, int tokens, int zst) {
    size_t len = 1024 + 2 * (size_t)tokens;
    unsigned char *file = xcalloc(1, len), *z = xmalloc(ZSTD_compressBound(len));
    int32_t h[3] = {SHARD_MAGIC, 1, tokens};
    memcpy(file, h, sizeof h);
    Rng r;
    rng_seed(&r, 1);
    for (int i = 0; i < n_shards; i++) {
        uint16_t *t = (uint16_t *)(file + 1024);
        for (int k = 0; k < tokens; k++) t[k] = (uint16_t)(rng_u64(&r) % 64 + 32); /* text-like: compressible */
        char path[1200];
        snprintf(path, sizeof path, "%s/s_%06d.bin%s", dir, i, zst ? ".zst" : "");
        const void *out = file;
        size_t out_len = len;
        if (zst) {
            out_len = ZSTD_compress(z, ZSTD_compressBound(len), file, len, 1);
            out = z;
        }
        FILE *f = fopen(path, "wb");
        if (!f || fwrite(out, 1, out_len, f) != out_len || fclose(f) != 0) kiln_fail(1, "%s: cannot write", path);
    }
    free(file);
    free(z);
}

static DataLoader *open_set(const char *dir, const char *ext, int B, int T, int prefetch, int max_open) {
    char pat[1200];
    snprintf(pat, sizeof pat, "%s/s_*%s", dir, ext);
    DataSource src = {"bench", pat, 1.0};
    DataOptions o = {.what = "data.train", .sources = &src, .n_sources = 1, .B = B, .T = T, .vocab_size = 256,
                     .shuffle = 1, .seed = 1, .world = 1, .prefetch = prefetch, .max_open = max_open};
    return data_open(&o);
}

static void startup(const char *dir, const char *ext, int n_shards, int tokens) {
    enum { B = 8, T = 64 };
    int32_t in[B * T], tg[B * T];
    double rss0 = status_mib("VmRSS:");
    int fd0 = open_fds();
    double t0 = kiln_now();
    DataLoader *dl = open_set(dir, ext, B, T, 0, 0);
    double t1 = kiln_now();
    data_next_batch(dl, in, tg);
    double t2 = kiln_now();
    int fd_open = open_fds() - fd0;
    double rss_open = status_mib("VmRSS:") - rss0;
    for (int i = 0; i < 200; i++) data_next_batch(dl, in, tg);
    double t3 = kiln_now();
    printf("%d %s shards x %d tokens (%llu samples): index %.3f s, first batch %.4f s, start-up %.3f s | "
           "RSS +%.1f MiB after indexing, +%.1f MiB after 200 batches | open files %d after the first batch, %d after "
           "200 batches (data.max_open_shards 64) | %.2f ms a batch of %d x %d\n",
           n_shards, ext, tokens, (unsigned long long)data_num_samples(dl), t1 - t0, t2 - t1, t2 - t0, rss_open,
           status_mib("VmRSS:") - rss0, fd_open, open_fds() - fd0, 1e3 * (t3 - t2) / 200, B, T);
    data_close(dl);
}

/* A step that computes for `step_s`, then asks for the next batch: the wait
 * is what the step would lose to data. */
static void prefetch_effect(const char *dir, int prefetch, double step_s) {
    enum { B = 16, T = 256, STEPS = 40 };
    int32_t *in = xmalloc(B * T * sizeof(int32_t)), *tg = xmalloc(B * T * sizeof(int32_t));
    DataLoader *dl = open_set(dir, ".bin.zst", B, T, prefetch, 4);
    data_next_batch(dl, in, tg); /* start-up and the thread's first batches */
    double spin = kiln_now();
    while (kiln_now() - spin < 4 * step_s) {}
    data_take_wait_s(dl);
    double worst = 0, sum = 0;
    for (int i = 0; i < STEPS; i++) {
        double t = kiln_now();
        while (kiln_now() - t < step_s) {} /* the step's compute */
        data_next_batch(dl, in, tg);
        double w = data_take_wait_s(dl);
        worst = w > worst ? w : worst, sum += w;
    }
    printf("prefetch %d: a %.0f ms step of %d x %d tokens from 16 .bin.zst shards of 1M tokens (4 open): data wait "
           "%.2f ms a step on average, %.2f ms at most, over %d steps\n", prefetch, 1e3 * step_s, B, T,
           1e3 * sum / STEPS, 1e3 * worst, STEPS);
    data_close(dl);
    free(in);
    free(tg);
}

int main(int argc, char **argv) {
    int n_shards = argc > 1 ? atoi(argv[1]) : 10000, tokens = argc > 2 ? atoi(argv[2]) : 2048;
    char made[] = "/tmp/kiln-bench-data.XXXXXX";
    const char *env = getenv("KILN_BENCH_DIR");
    const char *base = env ? env : mkdtemp(made);
    if (!base) kiln_fail(1, "cannot make a scratch directory");
    char bin[1100], zst[1100], big[1100];
    snprintf(bin, sizeof bin, "%s/bin", base);
    snprintf(zst, sizeof zst, "%s/zst", base);
    snprintf(big, sizeof big, "%s/big", base);
    kiln_mkdirs(bin), kiln_mkdirs(zst), kiln_mkdirs(big);
    double t = kiln_now();
    make_set(bin, n_shards, tokens, 0);
    make_set(zst, n_shards, tokens, 1);
    printf("bench_data: wrote %d .bin and %d .bin.zst shards in %.1f s under %s\n", n_shards, n_shards,
           kiln_now() - t, base);
    startup(bin, ".bin", n_shards, tokens);
    startup(zst, ".bin.zst", n_shards, tokens);
    /* 16 shards of 1M tokens, 4 open at most: a shuffled order reopens and
     * decompresses a 2 MiB shard for most samples */
    make_set(big, 16, 1 << 20, 1);
    for (int pf = 0; pf <= 4; pf += 4) prefetch_effect(big, pf, 0.05);
    char cmd[1300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s/bin' '%s/zst' '%s/big'", base, base, base);
    if (system(cmd) != 0 || (!env && rmdir(base) != 0)) fprintf(stderr, "bench_data: left %s behind\n", base);
    return 0;
}
