/* test_ckpt: the checkpoint format below train.c — CRC32C against its
 * published check value and, on random buffers, lengths and alignments,
 * against a bit-at-a-time reference (the instruction and the table alike); a
 * table round trip (tensors and blobs, compressed and not, async and not,
 * O_DIRECT and through the page cache) with entries larger than the write
 * chunks and at odd offsets, a converting copy split at a chunk's end;
 * loading a tensor assembled from pieces written by two ranks and from 2-D
 * boxes (the resharding path, streamed); write failures (a file-size limit
 * in a child: the kernel's own error; an injected ENOSPC mid-file, named by
 * its entry); and refusals (shape, missing entry). */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include "ckpt.h"
#include "ckpt_io.h"
#include "test.h"
#include "util.h"

static char root[256];

static void run(const char *cmd) {
    if (system(cmd) != 0) printf("FAIL ckpt_setup: %s\n", cmd);
}

/* Write a checkpoint of `t` at `step` under root/sub; returns its dir. */
static const char *save(CkptTable *t, const char *sub, int64_t step, int rank, int async, int compress) {
    static char dir[2048];
    CkptOptions o = {0};
    snprintf(o.root, sizeof o.root, "%s/%s", root, sub);
    o.async = async, o.compress = compress;
    CkptWriter *w = ckpt_writer_new(t, &o);
    CkptMeta meta = {step, 0x1234, "test", "none", {2, rank, 2, 1, 1, 1, 1}};
    if (ckpt_save(w, &meta) != 0 || ckpt_wait(w) != 0) printf("FAIL ckpt_save: %s\n", ckpt_writer_error(w));
    ckpt_writer_free(w);
    snprintf(dir, sizeof dir, "%s/step_%08lld", o.root, (long long)step);
    return dir;
}

/* CRC-32C one bit at a time: the definition, sharing no code with ckpt_io.c. */
static uint32_t crc_bitwise(uint32_t crc, const unsigned char *p, size_t n) {
    crc = ~crc;
    while (n--) {
        crc ^= *p++;
        for (int k = 0; k < 8; k++) crc = crc & 1 ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
    }
    return ~crc;
}

/* Every length up to 1100 and random ones past the three-stream blocks
 * (3 x 256 and 3 x 8192 bytes), at every alignment 0..15, and each split in
 * two streamed parts: the dispatched CRC and the table equal the reference. */
static void test_crc(void) {
    size_t cap = 100000 + 64;
    unsigned char *buf = xmalloc(cap);
    Rng rng;
    rng_seed(&rng, 22);
    for (size_t i = 0; i < cap; i++) buf[i] = (unsigned char)rng_u64(&rng);
    int bad = 0;
    char why[160] = "";
    for (int trial = 0; trial < 1600 && bad < 3; trial++) {
        size_t n = trial < 1100 ? (size_t)trial : 700 + rng_below(&rng, 100000 - 700);
        if (trial >= 1100 && trial < 1140) n = (size_t)(trial - 1100) + 3 * 8192 - 20; /* at the long block's edge */
        size_t align = (size_t)trial % 16, cut = n ? rng_below(&rng, n + 1) : 0;
        const unsigned char *p = buf + align;
        uint32_t want = crc_bitwise(0, p, n), hw = ckpt_crc32c(0, p, n), tab = ckpt_crc32c_table(0, p, n);
        uint32_t split = ckpt_crc32c(ckpt_crc32c(0, p, cut), p + cut, n - cut);
        uint32_t tsplit = ckpt_crc32c_table(ckpt_crc32c_table(0, p, cut), p + cut, n - cut);
        if (hw != want || tab != want || split != want || tsplit != want) {
            bad++;
            snprintf(why, sizeof why, "length %zu alignment %zu cut %zu: reference %08x, %s %08x, table %08x, split %08x/%08x",
                     n, align, cut, want, ckpt_crc32c_impl(), hw, tab, split, tsplit);
        }
    }
    test_report(!bad, "ckpt_crc32c_matches_bitwise_reference", "%s", why);
    free(buf);
}

/* "half" values: to_host widens each uint16 to a float, to_device narrows;
 * state.c's bf16 moments work this way (CkptEntry.mem_size = 2). The
 * writer's destination is the file's bytes, aligned as the entries before
 * left it (an odd blob: not at all), so elements go through memcpy as
 * state.c's do (UBSan refuses a misaligned float store). */
static void half_to_host(void *dst, const void *src, size_t bytes) {
    const uint16_t *s = src;
    unsigned char *d = dst;
    for (size_t i = bytes / 4; i-- > 0;) {
        float f = (float)s[i];
        memcpy(d + 4 * i, &f, 4);
    }
}
static void half_to_device(void *dst, const void *src, size_t bytes) {
    const unsigned char *s = src;
    uint16_t *d = dst;
    for (size_t i = 0; i < bytes / 4; i++) {
        float f;
        memcpy(&f, s + 4 * i, 4);
        d[i] = (uint16_t)f;
    }
}

/* Entries past the 8 MiB write chunk at odd offsets: a 3-byte blob first,
 * a 20 MiB tensor, a blob that leaves 2 bytes of a chunk for a converted
 * (half -> f32) tensor whose first element straddles the chunk's end, an
 * empty range. Every mode loads back exactly; O_DIRECT and the page cache
 * write the same bytes. */
static void test_big_entries(void) {
    size_t big = (size_t)5 << 20, pad = 0, nhalf = 300001;
    float *a = xmalloc(big * 4), *a2 = xmalloc(big * 4);
    uint16_t *h = xmalloc(nhalf * 2), *h2 = xmalloc(nhalf * 2);
    for (size_t i = 0; i < big; i++) a[i] = (float)i * 0.25f - 7.0f;
    for (size_t i = 0; i < nhalf; i++) h[i] = (uint16_t)(i * 31);
    unsigned char tiny[3] = {1, 2, 3}, tiny2[3];
    /* bytes before the half tensor: 3 + 20 MiB + pad = 3 x 8 MiB - 2 */
    pad = 3 * CKPT_IO_CHUNK - 2 - 3 - big * 4;
    unsigned char *fill = xmalloc(pad), *fill2 = xmalloc(pad);
    for (size_t i = 0; i < pad; i++) fill[i] = (unsigned char)(i * 13);
    int64_t sa[1] = {(int64_t)big}, sh[2] = {(int64_t)nhalf, 1}, se[1] = {10};
    char first[2048] = "";
    int same = 1;
    for (int mode = 0; mode < 8; mode++) {
        int async = mode & 1, zstd = mode & 2, buffered = mode & 4;
        CkptTable t, u;
        ckpt_table_init(&t), ckpt_table_init(&u);
        ckpt_add_blob(&t, "tiny", CKPT_U8, 3, 0, tiny);
        ckpt_add_tensor(&t, "a", CKPT_F32, 1, sa, 0, big, a, NULL, NULL);
        ckpt_add_blob(&t, "fill", CKPT_U8, pad, 0, fill);
        CkptEntry *e = ckpt_add_tensor(&t, "half", CKPT_F32, 2, sh, 0, nhalf, h, half_to_host, half_to_device);
        e->mem_size = 2;
        ckpt_add_tensor(&t, "empty", CKPT_F32, 1, se, 5, 5, NULL, NULL, NULL);
        memset(a2, 0, big * 4), memset(h2, 0, nhalf * 2), memset(fill2, 0, pad), memset(tiny2, 0, 3);
        ckpt_add_blob(&u, "tiny", CKPT_U8, 3, 0, tiny2);
        ckpt_add_tensor(&u, "a", CKPT_F32, 1, sa, 0, big, a2, NULL, NULL);
        ckpt_add_blob(&u, "fill", CKPT_U8, pad, 0, fill2);
        e = ckpt_add_tensor(&u, "half", CKPT_F32, 2, sh, 0, nhalf, h2, half_to_host, half_to_device);
        e->mem_size = 2;
        ckpt_add_tensor(&u, "empty", CKPT_F32, 1, se, 5, 5, NULL, NULL, NULL);
        CkptOptions o = {0};
        snprintf(o.root, sizeof o.root, "%s/big%d", root, mode);
        o.async = async, o.compress = zstd ? 1 : 0, o.threads = zstd ? 2 : 0;
        ckpt_set_direct_io(!buffered); /* reads and writes */
        CkptWriter *w = ckpt_writer_new(&t, &o);
        CkptMeta meta = {9, 1, "test", "none", {1, 0, 1, 1, 1, 1, 1}};
        int rc = ckpt_save(w, &meta) != 0 || ckpt_wait(w) != 0;
        CkptStats st = ckpt_writer_stats(w);
        char err[1024] = "";
        if (rc) snprintf(err, sizeof err, "save: %s", ckpt_writer_error(w));
        ckpt_writer_free(w);
        char dir[1200];
        snprintf(dir, sizeof dir, "%s/step_00000009", o.root);
        if (!rc) rc = ckpt_load(dir, &u, NULL, err, sizeof err) != 0;
        if (!rc) rc = ckpt_verify(dir, NULL, err, sizeof err) != 0;
        if (!rc) {
            /* only the first and the last pieces: the 24 MiB between are skipped */
            CkptTable v;
            ckpt_table_init(&v);
            memset(h2, 0, nhalf * 2), memset(tiny2, 0, 3);
            ckpt_add_blob(&v, "tiny", CKPT_U8, 3, 0, tiny2);
            CkptEntry *ve = ckpt_add_tensor(&v, "half", CKPT_F32, 2, sh, 0, nhalf, h2, half_to_host, half_to_device);
            ve->mem_size = 2;
            rc = ckpt_load(dir, &v, NULL, err, sizeof err) != 0 || memcmp(h, h2, nhalf * 2) || memcmp(tiny, tiny2, 3);
            ckpt_table_free(&v);
        }
        ckpt_set_direct_io(1);
        char name[96];
        snprintf(name, sizeof name, "ckpt_big_entries_%s%s%s", async ? "async" : "sync", zstd ? "_zstd" : "",
                 buffered ? "_buffered" : "_direct");
        test_report(!rc && !memcmp(a, a2, big * 4) && !memcmp(h, h2, nhalf * 2) && !memcmp(fill, fill2, pad) &&
                        !memcmp(tiny, tiny2, 3) && st.step == 9 && st.bytes == 3 + big * 4 + pad + nhalf * 4,
                    name, "rc %d: %s (stats step %lld, %llu bytes)", rc, err, (long long)st.step,
                    (unsigned long long)st.bytes);
        if (!zstd) {
            /* the uncompressed rank files are byte for byte the same whichever way they were written */
            char cmd[4096];
            if (!first[0]) snprintf(first, sizeof first, "%s/rank00000.bin", dir);
            else {
                snprintf(cmd, sizeof cmd, "cmp -s '%s' '%s/rank00000.bin'", first, dir);
                same &= system(cmd) == 0;
            }
        }
        ckpt_table_free(&t), ckpt_table_free(&u);
    }
    test_report(same, "ckpt_direct_and_page_cache_files_identical", "rank files differ");
    free(a), free(a2), free(h), free(h2), free(fill), free(fill2);
}

/* A 1100 x 2100 tensor (9.2 MB, past one read chunk) saved as a 2 x 2 grid of
 * tensor-parallel boxes, each box in two flat pieces, after an odd blob;
 * loaded whole, as three column boxes, and as a flat range across boxes. */
static void test_box_stream(void) {
    enum { R = 1100, C = 2100 };
    float *w = xmalloc((size_t)R * C * 4);
    for (size_t i = 0; i < (size_t)R * C; i++) w[i] = (float)i;
    int64_t shape[2] = {R, C};
    uint64_t rc[2][3] = {{0, 700, R}, {0, 1300, C}}; /* row and column cuts */
    CkptTable t;
    ckpt_table_init(&t);
    unsigned char odd[5] = {9, 8, 7, 6, 5};
    ckpt_add_blob(&t, "odd", CKPT_U8, 5, 0, odd);
    float *parts[4];
    for (int b = 0; b < 4; b++) {
        uint64_t r0 = rc[0][b / 2], r1 = rc[0][b / 2 + 1], c0 = rc[1][b % 2], c1 = rc[1][b % 2 + 1];
        uint64_t n = (r1 - r0) * (c1 - c0), cut = n / 3 + 1;
        parts[b] = xmalloc(n * 4);
        for (uint64_t r = r0; r < r1; r++)
            for (uint64_t c = c0; c < c1; c++) parts[b][(r - r0) * (c1 - c0) + (c - c0)] = w[r * C + c];
        CkptEntry *e = ckpt_add_tensor(&t, "w", CKPT_F32, 2, shape, 0, cut, parts[b], NULL, NULL);
        ckpt_entry_set_box(e, r0, r1, c0, c1);
        e = ckpt_add_tensor(&t, "w", CKPT_F32, 2, shape, cut, n, parts[b] + cut, NULL, NULL);
        ckpt_entry_set_box(e, r0, r1, c0, c1);
    }
    const char *dir = save(&t, "boxes", 4, 0, 0, 0);
    char err[1024] = "";
    /* whole */
    float *got = xcalloc((size_t)R * C, 4);
    CkptTable u;
    ckpt_table_init(&u);
    ckpt_add_tensor(&u, "w", CKPT_F32, 2, shape, 0, (uint64_t)R * C, got, NULL, NULL);
    int rc0 = ckpt_load(dir, &u, NULL, err, sizeof err);
    test_report(rc0 == 0 && !memcmp(got, w, (size_t)R * C * 4), "ckpt_boxes_stream_to_whole", "rc %d: %s", rc0, err);
    ckpt_table_free(&u);
    /* three column boxes of the whole height, the middle one in a partial range */
    uint64_t cc[4] = {0, 500, 1700, C};
    int ok = 1;
    ckpt_table_init(&u);
    float *col[3];
    for (int b = 0; b < 3; b++) {
        uint64_t n = (uint64_t)R * (cc[b + 1] - cc[b]), lo = b == 1 ? 12345 : 0;
        col[b] = xcalloc(n, 4);
        CkptEntry *e = ckpt_add_tensor(&u, "w", CKPT_F32, 2, shape, lo, n, col[b], NULL, NULL);
        ckpt_entry_set_box(e, 0, R, cc[b], cc[b + 1]);
    }
    rc0 = ckpt_load(dir, &u, NULL, err, sizeof err);
    for (int b = 0; b < 3 && rc0 == 0; b++) {
        uint64_t wd = cc[b + 1] - cc[b], lo = b == 1 ? 12345 : 0;
        for (uint64_t k = lo; k < (uint64_t)R * wd && ok; k++)
            ok = col[b][k - lo] == w[(k / wd) * C + cc[b] + k % wd];
    }
    test_report(rc0 == 0 && ok, "ckpt_boxes_stream_to_other_boxes", "rc %d: %s", rc0, err);
    for (int b = 0; b < 3; b++) free(col[b]);
    ckpt_table_free(&u);
    /* the same boxes (this layout resuming itself): pieces read into place */
    ckpt_table_init(&u);
    float *same[4];
    for (int b = 0; b < 4; b++) {
        uint64_t r0 = rc[0][b / 2], r1 = rc[0][b / 2 + 1], c0 = rc[1][b % 2], c1 = rc[1][b % 2 + 1];
        same[b] = xcalloc((r1 - r0) * (c1 - c0), 4);
        CkptEntry *e = ckpt_add_tensor(&u, "w", CKPT_F32, 2, shape, 0, (r1 - r0) * (c1 - c0), same[b], NULL, NULL);
        ckpt_entry_set_box(e, r0, r1, c0, c1);
    }
    rc0 = ckpt_load(dir, &u, NULL, err, sizeof err);
    ok = rc0 == 0;
    for (int b = 0; b < 4 && ok; b++) {
        uint64_t r0 = rc[0][b / 2], r1 = rc[0][b / 2 + 1], c0 = rc[1][b % 2], c1 = rc[1][b % 2 + 1];
        ok = !memcmp(same[b], parts[b], (r1 - r0) * (c1 - c0) * 4);
    }
    test_report(ok, "ckpt_boxes_stream_to_same_boxes", "rc %d: %s", rc0, err);
    for (int b = 0; b < 4; b++) free(same[b]);
    ckpt_table_free(&u);
    /* a flat range crossing the row cut and every column box */
    ckpt_table_init(&u);
    uint64_t lo = 699 * (uint64_t)C + 17, hi = 702 * (uint64_t)C + 3;
    memset(got, 0, (size_t)R * C * 4);
    ckpt_add_tensor(&u, "w", CKPT_F32, 2, shape, lo, hi, got, NULL, NULL);
    rc0 = ckpt_load(dir, &u, NULL, err, sizeof err);
    test_report(rc0 == 0 && !memcmp(got, w + lo, (hi - lo) * 4), "ckpt_boxes_stream_to_flat_range", "rc %d: %s", rc0,
                err);
    ckpt_table_free(&u);
    /* cut short inside box 1's second piece (bytes 4.39 to 5.88 MB), read with
     * O_DIRECT, and inside box 3's first (from 7.96 MB), read through the page
     * cache: each named, with where the file ends */
    const char *cut[2] = {"5000000", "8000000"};
    for (int k = 0; k < 2; k++) {
        char cmd[2400], name[64];
        snprintf(cmd, sizeof cmd, "truncate -s %s '%s/rank00000.bin'", cut[k], dir);
        if (k == 0) {
            /* a copy first: the second cut is of the whole file */
            snprintf(cmd, sizeof cmd, "cp '%s/rank00000.bin' '%s/whole.bin' && truncate -s %s '%s/rank00000.bin'", dir,
                     root, cut[k], dir);
        } else {
            snprintf(cmd, sizeof cmd, "cp '%s/whole.bin' '%s/rank00000.bin' && truncate -s %s '%s/rank00000.bin'",
                     root, dir, cut[k], dir);
        }
        run(cmd);
        ckpt_table_init(&u);
        for (int b = 0; b < 4; b++) {
            uint64_t r0 = rc[0][b / 2], r1 = rc[0][b / 2 + 1], c0 = rc[1][b % 2], c1 = rc[1][b % 2 + 1];
            CkptEntry *e = ckpt_add_tensor(&u, "w", CKPT_F32, 2, shape, 0, (r1 - r0) * (c1 - c0), got, NULL, NULL);
            ckpt_entry_set_box(e, r0, r1, c0, c1);
        }
        ckpt_set_direct_io(k == 0);
        rc0 = ckpt_load(dir, &u, NULL, err, sizeof err);
        ckpt_set_direct_io(1);
        char end[64];
        snprintf(end, sizeof end, "file ends at %s", cut[k]);
        snprintf(name, sizeof name, "ckpt_truncated_piece_named_%s", k ? "page_cache" : "direct");
        test_report(rc0 != 0 && strstr(err, "truncated: entry 'w' needs bytes") && strstr(err, end), name,
                    "rc %d: %s", rc0, err);
        ckpt_table_free(&u);
    }
    ckpt_table_free(&t);
    for (int b = 0; b < 4; b++) free(parts[b]);
    free(got), free(w);
}

/* A write failure: the checkpoint before stays, no step directory or .tmp is
 * left, and the error names the file, the entry and the cause. */
typedef struct {
    int async, zstd;
    rlim_t limit;       /* RLIMIT_FSIZE in the child; 0 = none */
    const char *fault;  /* KILN_FAULT_ENOSPC_AFTER; NULL = none */
    char sub[32];
} FailCase;

static void fail_child(void *arg) {
    FailCase *fc = arg;
    size_t n = (size_t)3 << 20; /* 12 MiB each: the file spans four write chunks */
    float *a = xmalloc(n * 4), *b = xmalloc(n * 4);
    for (size_t i = 0; i < n; i++) a[i] = (float)i, b[i] = -(float)i;
    int64_t sh[1] = {(int64_t)n};
    CkptTable t;
    ckpt_table_init(&t);
    unsigned char k[1000] = {0};
    ckpt_add_blob(&t, "k", CKPT_U8, sizeof k, 0, k);
    ckpt_add_tensor(&t, "a", CKPT_F32, 1, sh, 0, n, a, NULL, NULL);
    ckpt_add_tensor(&t, "b", CKPT_F32, 1, sh, 0, n, b, NULL, NULL);
    CkptOptions o = {0};
    snprintf(o.root, sizeof o.root, "%s/%s", root, fc->sub);
    o.async = fc->async, o.compress = fc->zstd;
    CkptWriter *w = ckpt_writer_new(&t, &o);
    CkptMeta meta = {1, 1, "test", "none", {1, 0, 1, 1, 1, 1, 1}};
    if (ckpt_save(w, &meta) != 0 || ckpt_wait(w) != 0) _exit(3); /* the first one fits */
    if (fc->limit) {
        /* the kernel refuses writes past the limit with EFBIG (and SIGXFSZ, ignored here) */
        signal(SIGXFSZ, SIG_IGN);
        struct rlimit rl = {fc->limit, fc->limit};
        setrlimit(RLIMIT_FSIZE, &rl);
    }
    if (fc->fault) setenv("KILN_FAULT_ENOSPC_AFTER", fc->fault, 1);
    ckpt_writer_free(w);
    w = ckpt_writer_new(&t, &o);
    meta.step = 2;
    int rc = ckpt_save(w, &meta);
    if (rc == 0) rc = ckpt_wait(w);
    fprintf(stderr, "%s\n", ckpt_writer_error(w));
    ckpt_writer_free(w);
    _exit(rc != 0 ? 7 : 0);
}

static void test_write_failures(void) {
    FailCase cases[] = {{0, 0, 18 << 20, NULL, "fsize_sync"}, {1, 0, 18 << 20, NULL, "fsize_async"},
                        {0, 3, 4 << 20, NULL, "fsize_zstd"}, {0, 0, 0, "18000000", "enospc_sync"},
                        {1, 0, 0, "18000000", "enospc_async"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        FailCase *fc = &cases[i];
        char err[4096], path[1400], name[96];
        int st = test_run_child(fail_child, fc, err, sizeof err);
        snprintf(path, sizeof path, "%s/%s", root, fc->sub);
        char **paths;
        int64_t *steps;
        int n = ckpt_list(path, &paths, &steps);
        struct stat sb;
        char tmp[1500], latest[1500];
        snprintf(tmp, sizeof tmp, "%s/step_00000002.tmp", path);
        snprintf(latest, sizeof latest, "%s/latest", path);
        char *l = kiln_read_file(latest, NULL);
        /* 18 MiB (or 18e6 bytes) fails the write of bytes [16, 24) MiB, inside
         * entry 'b' (bytes 12 MiB + 1000 on); zstd's frames lie elsewhere */
        const char *want_entry = fc->zstd ? "rank00000.bin: writing entry '" : "rank00000.bin: writing entry 'b'";
        const char *want_cause = fc->limit ? strerror(EFBIG) : strerror(ENOSPC);
        snprintf(name, sizeof name, "ckpt_write_failure_%s", fc->sub);
        test_report(st == 7 && strstr(err, want_entry) && strstr(err, want_cause) && n == 1 && steps[0] == 1 &&
                        stat(tmp, &sb) != 0 && l && !strncmp(l, "step_00000001", 13),
                    name, "exit %d, %d checkpoint(s), latest %s: %s", st, n, l ? l : "-", err);
        free(l);
        ckpt_list_free(paths, steps, n);
    }
}

int main(void) {
    /* the CRC-32C check value (RFC 3720 B.4 / the "123456789" convention) */
    test_report(ckpt_crc32c(0, "123456789", 9) == 0xE3069283u, "ckpt_crc32c_check_value", "got %08x",
                ckpt_crc32c(0, "123456789", 9));
    unsigned char big[1000];
    for (int i = 0; i < 1000; i++) big[i] = (unsigned char)(i * 7);
    uint32_t whole = ckpt_crc32c(0, big, 1000), split = ckpt_crc32c(ckpt_crc32c(0, big, 333), big + 333, 667);
    test_report(whole == split, "ckpt_crc32c_streams", "%08x vs %08x", whole, split);
    test_crc();

    snprintf(root, sizeof root, "%s/test_ckpt", getenv("KILN_TEST_TMP") ? getenv("KILN_TEST_TMP") : "/tmp");
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir -p '%s'", root, root);
    run(cmd);

    /* round trip: a (6,4) tensor and two blobs, in each write mode */
    float w[24], w2[24];
    for (int i = 0; i < 24; i++) w[i] = (float)i * 0.5f - 3.0f;
    int64_t shape[2] = {6, 4}, step = 42, step2 = 0;
    uint64_t rng[4] = {1, 2, 3, 0xffffffffffffffffULL}, rng2[4];
    for (int mode = 0; mode < 4; mode++) {
        CkptTable t, u;
        ckpt_table_init(&t);
        ckpt_add_tensor(&t, "w", CKPT_F32, 2, shape, 0, 24, w, NULL, NULL);
        ckpt_add_blob(&t, "train.step", CKPT_I64, 1, 1, &step);
        ckpt_add_blob(&t, "rng", CKPT_U64, 4, 0, rng);
        char sub[32];
        snprintf(sub, sizeof sub, "rt%d", mode);
        const char *dir = save(&t, sub, 7, 0, mode & 1, mode & 2 ? 3 : 0);
        ckpt_table_init(&u);
        memset(w2, 0, sizeof w2), memset(rng2, 0, sizeof rng2), step2 = 0;
        ckpt_add_tensor(&u, "w", CKPT_F32, 2, shape, 0, 24, w2, NULL, NULL);
        ckpt_add_blob(&u, "train.step", CKPT_I64, 1, 1, &step2);
        ckpt_add_blob(&u, "rng", CKPT_U64, 4, 0, rng2);
        char err[1024] = "";
        CkptInfo info;
        int rc = ckpt_load(dir, &u, &info, err, sizeof err);
        char name[64];
        snprintf(name, sizeof name, "ckpt_round_trip_%s%s", mode & 1 ? "async" : "sync", mode & 2 ? "_zstd" : "");
        test_report(rc == 0 && !memcmp(w, w2, sizeof w) && step2 == 42 && !memcmp(rng, rng2, sizeof rng) &&
                        info.step == 7 && info.config_hash == 0x1234,
                    name, "rc %d: %s", rc, err);
        ckpt_table_free(&t);
        ckpt_table_free(&u);
    }
    /* a table of nothing loads from any checkpoint, reading nothing (the
     * loader's plan is empty: under make sanitize a NULL plan reaching
     * qsort_r is a UBSan report) */
    {
        CkptTable none;
        ckpt_table_init(&none);
        char dir[1200], err[1024] = "";
        snprintf(dir, sizeof dir, "%s/rt0/step_00000007", root);
        int rc = ckpt_load(dir, &none, NULL, err, sizeof err);
        test_report(rc == 0, "ckpt_load_empty_table", "rc %d: %s", rc, err);
        ckpt_table_free(&none);
    }

    /* two ranks each wrote half of w (rows 0-2, rows 3-5); join the pieces
     * into one checkpoint, as a two-rank run would, and load (a) the whole
     * tensor on one rank and (b) a range straddling both pieces */
    CkptTable r0, r1;
    ckpt_table_init(&r0), ckpt_table_init(&r1);
    ckpt_add_tensor(&r0, "w", CKPT_F32, 2, shape, 0, 12, w, NULL, NULL);
    ckpt_add_tensor(&r1, "w", CKPT_F32, 2, shape, 12, 24, w + 12, NULL, NULL);
    char d0[2048];
    snprintf(d0, sizeof d0, "%s", save(&r0, "shard0", 3, 0, 0, 0));
    const char *d1 = save(&r1, "shard1", 3, 1, 0, 0);
    /* merge: rank 1's file beside rank 0's, its entry line into the manifest */
    snprintf(cmd, sizeof cmd,
             "cp '%s/rank00001.bin' '%s/' && grep '^entry' '%s/manifest' > '%s/e1' && "
             "grep -v '^end' '%s/manifest' > '%s/m' && cat '%s/e1' >> '%s/m'",
             d1, d0, d1, root, d0, root, root, root);
    run(cmd);
    size_t mlen;
    char path[4096];
    snprintf(path, sizeof path, "%s/m", root);
    char *m = kiln_read_file(path, &mlen);
    char endl[64];
    snprintf(endl, sizeof endl, "end crc32c=%08x\n", ckpt_crc32c(0, m, mlen));
    snprintf(path, sizeof path, "%s/manifest", d0);
    FILE *f = fopen(path, "w");
    fwrite(m, 1, mlen, f), fputs(endl, f), fclose(f);
    free(m);
    CkptTable u;
    ckpt_table_init(&u);
    memset(w2, 0, sizeof w2);
    ckpt_add_tensor(&u, "w", CKPT_F32, 2, shape, 0, 24, w2, NULL, NULL);
    char err[1024] = "";
    int rc = ckpt_load(d0, &u, NULL, err, sizeof err);
    test_report(rc == 0 && !memcmp(w, w2, sizeof w), "ckpt_reshard_two_pieces_to_one", "rc %d: %s", rc, err);
    ckpt_table_free(&u);
    ckpt_table_init(&u);
    float part[10] = {0};
    ckpt_add_tensor(&u, "w", CKPT_F32, 2, shape, 7, 17, part, NULL, NULL);
    rc = ckpt_load(d0, &u, NULL, err, sizeof err);
    test_report(rc == 0 && !memcmp(part, w + 7, sizeof part), "ckpt_reshard_straddling_range", "rc %d: %s", rc, err);
    ckpt_table_free(&u);
    /* only rank 0's piece present: the load names the gap */
    ckpt_table_init(&u);
    ckpt_add_tensor(&u, "w", CKPT_F32, 2, shape, 0, 24, w2, NULL, NULL);
    err[0] = 0;
    char dir0[2048];
    snprintf(dir0, sizeof dir0, "%s/shard0/step_00000003", root);
    snprintf(cmd, sizeof cmd, "rm -f '%s/rank00001.bin'", dir0);
    run(cmd);
    rc = ckpt_load(dir0, &u, NULL, err, sizeof err);
    test_report(rc != 0 && strstr(err, "rank00001.bin"), "ckpt_missing_piece_named", "rc %d: %s", rc, err);
    ckpt_table_free(&u);

    /* a manifest (with a valid checksum) listing rank 1's half twice: the
     * doubled piece must not pass for the missing first half */
    char dup[2048];
    snprintf(dup, sizeof dup, "%s/dup", root);
    snprintf(cmd, sizeof cmd,
             "cp -r '%s' '%s' && grep -v '^end' '%s/manifest' > '%s/m2' && grep '^entry' '%s/manifest' >> '%s/m2'",
             d1, dup, d1, root, d1, root);
    run(cmd);
    snprintf(path, sizeof path, "%s/m2", root);
    m = kiln_read_file(path, &mlen);
    snprintf(endl, sizeof endl, "end crc32c=%08x\n", ckpt_crc32c(0, m, mlen));
    snprintf(path, sizeof path, "%s/manifest", dup);
    f = fopen(path, "w");
    fwrite(m, 1, mlen, f), fputs(endl, f), fclose(f);
    free(m);
    ckpt_table_init(&u);
    ckpt_add_tensor(&u, "w", CKPT_F32, 2, shape, 0, 24, w2, NULL, NULL);
    err[0] = 0;
    rc = ckpt_load(dup, &u, NULL, err, sizeof err);
    test_report(rc != 0 && strstr(err, "overlap"), "ckpt_refuses_overlapping_pieces", "rc %d: %s", rc, err);
    ckpt_table_free(&u);

    /* refusals: another shape, an entry the checkpoint lacks */
    ckpt_table_init(&u);
    int64_t other[2] = {4, 6};
    ckpt_add_tensor(&u, "w", CKPT_F32, 2, other, 0, 24, w2, NULL, NULL);
    rc = ckpt_load(d1, &u, NULL, err, sizeof err);
    test_report(rc != 0 && strstr(err, "[6,4] in the checkpoint but f32 [4,6]"), "ckpt_refuses_other_shape", "%s", err);
    ckpt_table_free(&u);
    ckpt_table_init(&u);
    ckpt_add_blob(&u, "nope", CKPT_U8, 3, 0, w2);
    rc = ckpt_load(d1, &u, NULL, err, sizeof err);
    test_report(rc != 0 && strstr(err, "no entry 'nope'"), "ckpt_refuses_missing_entry", "%s", err);
    ckpt_table_free(&u);
    ckpt_table_free(&r0);
    ckpt_table_free(&r1);

    test_big_entries();
    test_box_stream();
    test_write_failures();
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    run(cmd);
    return 0;
}
