/* ckpt_bench: `./train bench CONFIG --checkpoint` — the checkpoint of the
 * config's model state (fp32 parameters and AdamW's m and v, the names and
 * shapes a run writes, random values, no training) written, verified and
 * loaded next to a raw sequential write and read of the same bytes in the
 * same folder, interleaved in the same run so that the ratios survive a
 * shared disk. Under mpirun every rank writes and loads its share (a
 * ZeRO-3-like cut of every tensor), and the rates are aggregates. Never
 * asserts anything about speed. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "ckpt_bench.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "arch.h"
#include "ckpt.h"
#include "ckpt_io.h"
#include "comm.h"
#include "util.h"

#define BENCH_SPAN_MAX ((size_t)1 << 30) /* the random source: past any cache, bounded in memory */

typedef struct {
    CkptTable save, load; /* the same entries, read from src / loaded into dst */
    unsigned char *src;   /* (span) random bytes every entry is read from, each at its own offset */
    unsigned char *dst;   /* (span) where loads land */
    size_t span;
    uint64_t bytes;       /* this rank's share */
    uint64_t total;       /* every rank's */
    size_t params;
} BenchState;

/* Entries of the model's state, this rank's share of each: the flat
 * concatenation of parameters, m and v cut evenly over the ranks. */
static void bench_state(const ArchSpec *s, int rank, int world, BenchState *b) {
    memset(b, 0, sizeof *b);
    int n;
    ArchTensor *at = arch_tensors(s, 0, &n);
    for (int i = 0; i < n; i++) b->params += at[i].numel;
    uint64_t all = 3 * (uint64_t)b->params, lo = all * rank / world, hi = all * (rank + 1) / world;
    b->bytes = (hi - lo) * 4, b->total = all * 4;
    size_t span = (b->bytes + CKPT_IO_CHUNK - 1) / CKPT_IO_CHUNK * CKPT_IO_CHUNK;
    b->span = span < BENCH_SPAN_MAX ? span : BENCH_SPAN_MAX;
    void *p = NULL, *q = NULL;
    if (posix_memalign(&p, CKPT_IO_ALIGN, b->span) || posix_memalign(&q, CKPT_IO_ALIGN, b->span))
        kiln_fail(KILN_EXIT_RUNTIME, "out of memory for the benchmark's %zu MiB buffers", b->span >> 19);
    b->src = p, b->dst = q;
    uint64_t x = 0x9e3779b97f4a7c15ULL ^ (uint64_t)rank; /* xorshift64: fast, and incompressible enough */
    for (size_t k = 0; k + 8 <= b->span; k += 8) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        memcpy(b->src + k, &x, 8);
    }
    memset(b->dst, 0, b->span);
    ckpt_table_init(&b->save);
    ckpt_table_init(&b->load);
    const char *prefix[3] = {"", "optim.m/", "optim.v/"};
    uint64_t base = 0, cum = 0;
    for (int g = 0; g < 3; g++)
        for (int i = 0; i < n; i++) {
            uint64_t t0 = base;
            base += at[i].numel;
            uint64_t a = t0 > lo ? t0 : lo, z = base < hi ? base : hi;
            if (a >= z) continue;
            char name[CKPT_NAME];
            snprintf(name, sizeof name, "%s%s", prefix[g], at[i].name);
            int64_t shape[2] = {at[i].shape[0], at[i].shape[1]};
            size_t bytes = (size_t)(z - a) * 4, at_off = (size_t)(cum % (b->span - bytes + 1)) / 64 * 64;
            ckpt_add_tensor(&b->save, name, CKPT_F32, at[i].ndim, shape, a - t0, z - t0, b->src + at_off, NULL, NULL);
            ckpt_add_tensor(&b->load, name, CKPT_F32, at[i].ndim, shape, a - t0, z - t0, b->dst + at_off, NULL, NULL);
            cum += bytes;
        }
    free(at);
}

static void bench_state_free(BenchState *b) {
    ckpt_table_free(&b->save);
    ckpt_table_free(&b->load);
    free(b->src);
    free(b->dst);
}

/* Page-cache pages of a file, dropped (they are clean: everything was
 * fsynced), so the next read comes from the disk. Unprivileged, and touches
 * no one else's cache, unlike /proc/sys/vm/drop_caches. */
static void drop_file(const char *path) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return;
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
}

static void drop_dir(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *de;
    while ((de = readdir(d))) {
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        struct stat st;
        if (stat(p, &st) == 0 && S_ISREG(st.st_mode)) drop_file(p);
    }
    closedir(d);
}

static void write_all(int fd, const unsigned char *p, size_t n, const char *path) {
    while (n > 0) {
        ssize_t k = write(fd, p, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) kiln_fail(KILN_EXIT_RUNTIME, "%s: write: %s", path, strerror(errno));
        p += k, n -= (size_t)k;
    }
}

/* The raw write: this rank's bytes into a new file, CKPT_IO_CHUNK at a time
 * (with O_DIRECT where the file system takes it, else through the page
 * cache), fsynced and closed. Seconds. */
static double raw_write(const char *path, const BenchState *b, int direct) {
    double t0 = kiln_now();
    int fd = direct ? open(path, O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT, 0644) : -1;
    if (fd < 0) direct = 0, fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot create: %s", path, strerror(errno));
    for (uint64_t off = 0; off < b->bytes; off += CKPT_IO_CHUNK) {
        size_t len = b->bytes - off < CKPT_IO_CHUNK ? (size_t)(b->bytes - off) : CKPT_IO_CHUNK;
        if (direct) len = (len + CKPT_IO_ALIGN - 1) / CKPT_IO_ALIGN * CKPT_IO_ALIGN;
        write_all(fd, b->src + off % b->span, len, path);
    }
    if ((direct && ftruncate(fd, (off_t)b->bytes) != 0) || fsync(fd) != 0 || close(fd) != 0)
        kiln_fail(KILN_EXIT_RUNTIME, "%s: fsync/close: %s", path, strerror(errno));
    return kiln_now() - t0;
}

/* The raw read, cold: through the page cache with FADV_SEQUENTIAL (the
 * loader's way) or with O_DIRECT. Seconds; NAN if O_DIRECT is refused. */
static double raw_read(const char *path, unsigned char *buf, int direct) {
    drop_file(path);
    double t0 = kiln_now();
    int fd = open(path, O_RDONLY | (direct ? O_DIRECT : 0));
    if (fd < 0 && direct) return NAN;
    if (fd < 0) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot open: %s", path, strerror(errno));
    if (!direct) posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    ssize_t k;
    while ((k = read(fd, buf, CKPT_IO_CHUNK)) > 0) {
    }
    if (k < 0) kiln_fail(KILN_EXIT_RUNTIME, "%s: read: %s", path, strerror(errno));
    close(fd);
    return kiln_now() - t0;
}

/* Commit the file system (freed blocks, metadata) and give the disk a
 * second to finish what that started, so that no timing inherits it. */
static void settle(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd >= 0) syncfs(fd), close(fd);
    usleep(1000 * 1000);
}

static int rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

static int bench_agree(void *ctx, int failed) {
    double f = failed ? 1 : 0;
    comm_all_reduce_max_f64(ctx, &f, 1);
    return f > 0;
}

/* The slowest rank's seconds: the aggregate's time. */
static double slowest(CommGroup *g, double t) {
    if (g) comm_all_reduce_max_f64(g, &t, 1);
    return t;
}

static void sync_ranks(CommGroup *g) {
    if (g) comm_barrier(g);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

enum { RAW_W, CK_W, RAW_RB, RAW_RD, CK_V, CK_L, NT };

int ckpt_bench_run(const Config *c, const CkptBenchOptions *o) {
    comm_init(c->timeout_s);
    ckpt_set_direct_io(c->ckpt_direct_io);
    const CommInfo *ci = comm_info();
    int rank = ci->rank, world = ci->world, reps = o->reps > 0 ? o->reps : 3;
    CommGroup *g = world > 1 ? comm_world() : NULL;
    ArchSpec s;
    arch_from_config(c, &s);
    char dir[2048], root[2100], raw[2200];
    if (o->dir) kiln_strlcpy(dir, o->dir, sizeof dir);
    else snprintf(dir, sizeof dir, "%s/bench_checkpoint", c->run_dir);
    snprintf(root, sizeof root, "%s/checkpoints", dir);
    snprintf(raw, sizeof raw, "%s/raw.rank%05d.bin", dir, rank);
    if (rank == 0 && kiln_mkdirs(dir) != 0) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot create: %s", dir, strerror(errno));
    if (rank == 0) nftw(root, rm_one, 16, FTW_DEPTH | FTW_PHYS); /* an earlier bench's */
    sync_ranks(g);

    BenchState b;
    bench_state(&s, rank, world, &b);
    CkptOptions co = {.keep_last = 0, .compress = c->ckpt_compress,
                      .threads = c->threads > 0 ? c->threads : (int)sysconf(_SC_NPROCESSORS_ONLN),
                      .agree = g ? bench_agree : NULL, .agree_ctx = g};
    kiln_strlcpy(co.root, root, sizeof co.root);
    CkptWriter *w = ckpt_writer_new(&b.save, &co);
    void *rbuf = NULL;
    if (posix_memalign(&rbuf, CKPT_IO_ALIGN, CKPT_IO_CHUNK) != 0) kiln_fail(KILN_EXIT_RUNTIME, "out of memory");
    if (rank == 0)
        printf("bench checkpoint: %s, %d layers x %d wide, %.2fM parameters: fp32 parameters + AdamW m, v = "
               "%.2f GB in %d entries (rank 0), %d rank(s) | %s | crc32c %s | zstd %d\n",
               arch_family_name(s.family), s.n_layer, s.n_embd, b.params / 1e6, b.total / 1e9, b.save.n, world, dir,
               ckpt_crc32c_impl(), c->ckpt_compress);

    double t[NT][64];
    if (reps > 64) reps = 64;
    char step_dir[2300], err[2048];
    for (int r = 0; r < reps; r++) {
        /* the files of the rep before go first, outside every timing: freeing
         * blocks costs the disk time (discards, journal) that would land on
         * whatever ran next */
        if (r > 0) {
            snprintf(step_dir, sizeof step_dir, "%s/step_%08d", root, r);
            if (rank == 0) nftw(step_dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
        }
        settle(dir);
        sync_ranks(g);
        /* raw and checkpoint back to back, in the same folder, the first of
         * the two alternating from rep to rep (on a shared disk, and a VM's,
         * the file written last may read back differently) */
        double t0 = 0;
        for (int k = 0; k < 2; k++) {
            sync_ranks(g);
            if ((k + r) % 2 == 0) {
                t[RAW_W][r] = slowest(g, raw_write(raw, &b, ckpt_direct_io()));
                continue;
            }
            t0 = kiln_now();
            CkptMeta meta = {r + 1, 0, KILN_VERSION, "bench", {world, rank, world, 1, 1, 1, 1}};
            if (ckpt_save(w, &meta) != 0) kiln_fail(KILN_EXIT_RUNTIME, "checkpoint: %s", ckpt_writer_error(w));
            t[CK_W][r] = slowest(g, kiln_now() - t0);
        }
        settle(dir);
        /* the reads, cold, in an order that alternates from rep to rep (the
         * first read after the writes tends to differ on a shared disk) */
        snprintf(step_dir, sizeof step_dir, "%s/step_%08d", root, r + 1);
        t[CK_V][r] = NAN;
        for (int k = 0; k < 4; k++) {
            int what = r % 2 ? 3 - k : k;
            sync_ranks(g);
            if (what == 0) t[RAW_RB][r] = slowest(g, raw_read(raw, rbuf, 0));
            if (what == 1) t[RAW_RD][r] = slowest(g, raw_read(raw, rbuf, 1));
            if (what == 2 && world == 1) {
                /* every piece of every rank: one rank's figure only */
                drop_dir(step_dir);
                t0 = kiln_now();
                if (ckpt_verify(step_dir, NULL, err, sizeof err) != 0) kiln_fail(KILN_EXIT_RUNTIME, "verify: %s", err);
                t[CK_V][r] = kiln_now() - t0;
            }
            if (what == 3) {
                drop_dir(step_dir);
                sync_ranks(g);
                t0 = kiln_now();
                if (ckpt_load(step_dir, &b.load, NULL, err, sizeof err) != 0)
                    kiln_fail(KILN_EXIT_RUNTIME, "load: %s", err);
                t[CK_L][r] = slowest(g, kiln_now() - t0);
            }
        }
        unlink(raw);
        double gb = b.total / 1e9, rr = fmin(t[RAW_RB][r], isnan(t[RAW_RD][r]) ? INFINITY : t[RAW_RD][r]);
        if (rank == 0)
            printf("bench checkpoint rep %d/%d: raw write %.2f GB/s, checkpoint write %.2f GB/s (%.2f) | raw read "
                   "%.2f GB/s (page cache %.2f, O_DIRECT %.2f), verify %.2f GB/s (%.2f), load %.2f GB/s (%.2f)\n",
                   r + 1, reps, gb / t[RAW_W][r], gb / t[CK_W][r], t[RAW_W][r] / t[CK_W][r], gb / rr,
                   gb / t[RAW_RB][r], gb / t[RAW_RD][r], gb / t[CK_V][r], rr / t[CK_V][r], gb / t[CK_L][r],
                   rr / t[CK_L][r]);
    }
    CkptStats st = ckpt_writer_stats(w);
    ckpt_writer_free(w);

    /* async saves: the step loop's pause (the staging copy) and the write
     * behind it, the second of two (the first may wait for the staging
     * buffer's first touch); skipped where that buffer would crowd the machine */
    double pause = NAN, async_w = NAN;
    double phys = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
    int do_async = b.bytes * (double)ci->local_world < phys / 4;
    if (do_async) {
        if (rank == 0) nftw(root, rm_one, 16, FTW_DEPTH | FTW_PHYS);
        co.async = 1, co.keep_last = 1;
        CkptWriter *wa = ckpt_writer_new(&b.save, &co);
        for (int k = 1; k <= 2; k++) {
            sync_ranks(g);
            double t0 = kiln_now();
            CkptMeta meta = {reps + k, 0, KILN_VERSION, "bench", {world, rank, world, 1, 1, 1, 1}};
            if (ckpt_save(wa, &meta) != 0) kiln_fail(KILN_EXIT_RUNTIME, "checkpoint: %s", ckpt_writer_error(wa));
            pause = slowest(g, kiln_now() - t0);
            if (ckpt_wait(wa) != 0) kiln_fail(KILN_EXIT_RUNTIME, "checkpoint: %s", ckpt_writer_error(wa));
            async_w = slowest(g, ckpt_writer_stats(wa).write_s);
        }
        ckpt_writer_free(wa);
    }

    if (rank == 0) {
        double gb = b.total / 1e9, ratio[NT][64], rr[64];
        for (int r = 0; r < reps; r++) {
            rr[r] = fmin(t[RAW_RB][r], isnan(t[RAW_RD][r]) ? INFINITY : t[RAW_RD][r]);
            ratio[CK_W][r] = t[RAW_W][r] / t[CK_W][r];
            ratio[CK_V][r] = rr[r] / t[CK_V][r];
            ratio[CK_L][r] = rr[r] / t[CK_L][r];
        }
        if (do_async)
            printf("bench checkpoint async: the step loop's pause %.3f s (the staging copy, %.2f GB/s), then the "
                   "write %.2f s on its thread\n", pause, gb / pause, async_w);
        else
            printf("bench checkpoint async: skipped (a staging buffer of %.1f GB per rank would crowd this machine's "
                   "%.0f GB)\n", b.bytes / 1e9, phys / 1e9);
        printf("bench checkpoint: gb=%.3f ranks=%d direct=%d raw_write_gbps=%.2f write_gbps=%.2f write_ratio=%.2f "
               "raw_read_gbps=%.2f verify_gbps=%.2f verify_ratio=%.2f load_gbps=%.2f load_ratio=%.2f "
               "async_pause_s=%.3f async_write_s=%.2f (medians of %d)\n",
               gb, world, st.direct, gb / median(t[RAW_W], reps), gb / median(t[CK_W], reps),
               median(ratio[CK_W], reps), gb / median(rr, reps), world == 1 ? gb / median(t[CK_V], reps) : NAN,
               world == 1 ? median(ratio[CK_V], reps) : NAN, gb / median(t[CK_L], reps), median(ratio[CK_L], reps),
               pause, async_w, reps);
    }
    sync_ranks(g);
    if (rank == 0 && !o->keep) nftw(root, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    free(rbuf);
    bench_state_free(&b);
    comm_finalize();
    return KILN_EXIT_OK;
}
