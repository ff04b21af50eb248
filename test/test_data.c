/* test_data: token shards written by shard_write and read back by data_open
 * (uint16, uint32, zstd), batch contents, seeded order, rank slicing, resume
 * position, epoch wrap, and every bad-shard error (exit 2, file and offset named,
 * checked in a forked child); mixtures (shares, epochs per source, the same order
 * for 1, 2 and 4 ranks, exact resume, a changed mixture refused or forced),
 * prefetch giving the same batches, open files bounded, and shards deleted or
 * truncated under a running loader. Writes only under $KILN_TEST_TMP. */
#include "data.h"
#include "shard.h"
#include "test.h"
#include "util.h"

#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

static char tmpdir[1024];

static const char *tpath(const char *name) {
    static char buf[8][1200];
    static int k = 0;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "%s/%s", tmpdir, name);
    return buf[k];
}

/* A shard whose token at position i is base + i: every sample shows where it came from. */
static void write_ramp(const char *name, uint32_t base, size_t n, int zstd) {
    uint32_t *t = xmalloc(n * sizeof(uint32_t));
    for (size_t i = 0; i < n; i++) t[i] = base + (uint32_t)i;
    shard_write(tpath(name), t, n, zstd);
    free(t);
}

static void write_raw(const char *name, const void *data, size_t len) {
    FILE *f = fopen(tpath(name), "wb");
    if (!f || fwrite(data, 1, len, f) != len || fclose(f) != 0) {
        fprintf(stderr, "test_data: cannot write %s\n", tpath(name));
        exit(1);
    }
}

static unsigned char *read_raw(const char *name, size_t *len) {
    unsigned char *b = (unsigned char *)kiln_read_file(tpath(name), len);
    if (!b) {
        fprintf(stderr, "test_data: cannot read %s\n", tpath(name));
        exit(1);
    }
    return b;
}

/* One plain glob, the loader's original form (and order). */
static DataLoader *open1(const char *pattern, const char *what, int B, int T, int vocab, int shuffle, uint64_t seed,
                         int rank, int world) {
    DataSource src = {NULL, pattern, 1.0};
    DataOptions o = {.what = what, .sources = &src, .n_sources = 1, .B = B, .T = T, .vocab_size = vocab,
                     .shuffle = shuffle, .seed = seed, .rank = rank, .world = world};
    return data_open(&o);
}

typedef struct OpenArgs {
    const char *pattern;
    int T, vocab;
} OpenArgs;

static void open_in_child(void *arg) {
    const OpenArgs *a = arg;
    DataLoader *dl = open1(a->pattern, "data.train", 2, a->T, a->vocab, 1, 1, 0, 1);
    int32_t in[2 * 64], tg[2 * 64];
    data_next_batch(dl, in, tg);
}

/* Run open1(pattern...) + one batch in a child; expect exit 2 and every
 * needle in its stderr. */
static void expect_fail(const char *name, const char *pattern, int T, int vocab,
                        const char *needle1, const char *needle2) {
    char msg[4096];
    OpenArgs args = {pattern, T, vocab};
    int code = test_run_child(open_in_child, &args, msg, sizeof msg);
    int ok = code == 2 && strstr(msg, needle1) && (!needle2 || strstr(msg, needle2)) &&
             strstr(msg, "kiln: error: ");
    char *nl = strchr(msg, '\n');
    if (nl && !ok) *nl = '\0';
    test_report(ok, name, "exit %d, stderr '%s' (want '%s'%s%s)", code, msg, needle1,
                needle2 ? " and " : "", needle2 ? needle2 : "");
}

/* Shard A: 1000 tokens 0..999 (62 samples at T=16); shard B: 500 tokens
 * 1000..1499 (31 samples). Token value = position in the concatenation. */
enum { T = 16, NA = 1000, NB = 500, NSAMP = (NA - 1) / T + (NB - 1) / T };

static int sample_start(int32_t first_token) { return first_token; }

static void test_basic(void) {
    write_ramp("a_000000.bin", 0, NA, 0);
    write_ramp("a_000001.bin", NA, NB, 0);
    size_t len;
    unsigned char *raw = read_raw("a_000000.bin", &len);
    int32_t h[3];
    memcpy(h, raw, sizeof h);
    test_report(h[0] == SHARD_MAGIC && h[1] == 1 && h[2] == NA && len == 1024 + 2 * NA,
                "data_write_v1_header", "magic %d version %d count %d len %zu", h[0], h[1], h[2], len);
    free(raw);

    DataLoader *dl = open1(tpath("a_*.bin"), "data.train", 4, T, 2048, 0, 1, 0, 1);
    test_report(data_num_shards(dl) == 2 && data_num_tokens(dl) == NA + NB &&
                    data_num_samples(dl) == NSAMP,
                "data_open_counts", "shards %d tokens %llu samples %llu", data_num_shards(dl),
                (unsigned long long)data_num_tokens(dl), (unsigned long long)data_num_samples(dl));
    int32_t in[4 * T], tg[4 * T];
    data_next_batch(dl, in, tg);
    int ok = 1;
    for (int b = 0; b < 4; b++)
        for (int t = 0; t < T; t++) ok &= in[b * T + t] == b * T + t && tg[b * T + t] == b * T + t + 1;
    test_report(ok, "data_batch_sequential_shifted", "inputs/targets are not tokens [bT, bT+T] +0/+1");

    /* Sequential order runs through shard A's 62 samples, then B's, then wraps. */
    int32_t firsts[200];
    DataLoader *d1 = open1(tpath("a_*.bin"), "data.train", 1, T, 2048, 0, 1, 0, 1);
    for (int i = 0; i < NSAMP + 2; i++) {
        int32_t i1[T], t1[T];
        data_next_batch(d1, i1, t1);
        firsts[i] = i1[0];
    }
    ok = firsts[61] == 61 * T && firsts[62] == NA && firsts[NSAMP - 1] == NA + 30 * T &&
         firsts[NSAMP] == 0 && firsts[NSAMP + 1] == T;
    DataPos p = data_get_pos(d1);
    test_report(ok && p.epoch == 1 && p.index == 2, "data_sequential_shards_and_wrap",
                "firsts[61]=%d [62]=%d [92]=%d [93]=%d pos {%llu,%llu}", firsts[61], firsts[62],
                firsts[NSAMP - 1], firsts[NSAMP], (unsigned long long)p.epoch,
                (unsigned long long)p.index);
    data_close(d1);
    data_close(dl);
}

/* Every epoch of a shuffled loader visits each sample exactly once. */
static int epoch_is_permutation(DataLoader *dl, int32_t *order) {
    char seen[NA + NB] = {0};
    for (int i = 0; i < NSAMP; i++) {
        int32_t in[T], tg[T];
        data_next_batch(dl, in, tg);
        int s = sample_start(in[0]);
        if (s < 0 || s >= NA + NB || seen[s]) return 0;
        /* Samples start at multiples of T inside their own shard. */
        if (s < NA ? s % T != 0 : (s - NA) % T != 0) return 0;
        seen[s] = 1;
        if (order) order[i] = s;
        for (int t = 0; t < T; t++)
            if (in[t] != s + t || tg[t] != s + t + 1) return 0;
    }
    return 1;
}

static void test_shuffle(void) {
    int32_t e0[NSAMP], e1[NSAMP], f0[NSAMP], g0[NSAMP];
    DataLoader *a = open1(tpath("a_*.bin"), "data.train", 1, T, 2048, 1, 7, 0, 1);
    int ok = epoch_is_permutation(a, e0) && epoch_is_permutation(a, e1);
    DataPos p = data_get_pos(a);
    test_report(ok && p.epoch == 2 && p.index == 0, "data_shuffle_epochs_are_permutations",
                "ok %d pos {%llu,%llu}", ok, (unsigned long long)p.epoch, (unsigned long long)p.index);
    test_report(memcmp(e0, e1, sizeof e0) != 0, "data_shuffle_epochs_differ",
                "epoch 0 and 1 have the same order");
    DataLoader *b = open1(tpath("a_*.bin"), "data.train", 1, T, 2048, 1, 7, 0, 1);
    epoch_is_permutation(b, f0);
    test_report(memcmp(e0, f0, sizeof e0) == 0, "data_shuffle_same_seed_same_order",
                "two loaders with seed 7 disagree");
    DataLoader *c = open1(tpath("a_*.bin"), "data.train", 1, T, 2048, 1, 8, 0, 1);
    epoch_is_permutation(c, g0);
    test_report(memcmp(e0, g0, sizeof e0) != 0, "data_shuffle_other_seed_other_order",
                "seeds 7 and 8 give the same order");
    data_close(a);
    data_close(b);
    data_close(c);
}

/* Two ranks with B each interleave to the one-rank batch of 2B, across an epoch
 * boundary (NSAMP = 93 is not a multiple of 2B = 10). */
static void test_ranks(void) {
    enum { B = 5, STEPS = 40 };
    DataLoader *one = open1(tpath("a_*.bin"), "data.train", 2 * B, T, 2048, 1, 3, 0, 1);
    DataLoader *r0 = open1(tpath("a_*.bin"), "data.train", B, T, 2048, 1, 3, 0, 2);
    DataLoader *r1 = open1(tpath("a_*.bin"), "data.train", B, T, 2048, 1, 3, 1, 2);
    int ok = 1;
    for (int s = 0; s < STEPS && ok; s++) {
        int32_t bi[2 * B * T], bt[2 * B * T], i0[B * T], t0[B * T], i1[B * T], t1[B * T];
        data_next_batch(one, bi, bt);
        data_next_batch(r0, i0, t0);
        data_next_batch(r1, i1, t1);
        for (int b = 0; b < B; b++) {
            ok &= memcmp(i0 + b * T, bi + (2 * b) * T, T * sizeof(int32_t)) == 0;
            ok &= memcmp(i1 + b * T, bi + (2 * b + 1) * T, T * sizeof(int32_t)) == 0;
            ok &= memcmp(t1 + b * T, bt + (2 * b + 1) * T, T * sizeof(int32_t)) == 0;
        }
    }
    DataPos p1 = data_get_pos(one), p0 = data_get_pos(r0);
    test_report(ok && p1.epoch == p0.epoch && p1.index == p0.index && p1.epoch > 0,
                "data_rank_slices_interleave", "2 ranks x B=%d differ from 1 rank x B=%d", B, 2 * B);
    data_close(one);
    data_close(r0);
    data_close(r1);
}

/* Save the position after k batches; a fresh loader set there continues exactly. */
static void test_resume(void) {
    enum { B = 4, K = 30, M = 20 };
    DataLoader *a = open1(tpath("a_*.bin"), "data.train", B, T, 2048, 1, 11, 0, 1);
    int32_t in[B * T], tg[B * T];
    for (int i = 0; i < K; i++) data_next_batch(a, in, tg);
    DataPos p = data_get_pos(a);
    DataLoader *b = open1(tpath("a_*.bin"), "data.train", B, T, 2048, 1, 11, 0, 1);
    data_set_pos(b, p);
    int ok = p.epoch == 1; /* K*B = 120 > 93 samples: the resume point is in epoch 1 */
    for (int i = 0; i < M && ok; i++) {
        int32_t i2[B * T], t2[B * T];
        data_next_batch(a, in, tg);
        data_next_batch(b, i2, t2);
        ok = memcmp(in, i2, sizeof in) == 0 && memcmp(tg, t2, sizeof tg) == 0;
    }
    test_report(ok, "data_pos_resume_exact", "pos {%llu,%llu}", (unsigned long long)p.epoch,
                (unsigned long long)p.index);
    data_set_pos(b, (DataPos){0, 0});
    DataLoader *c = open1(tpath("a_*.bin"), "data.train", B, T, 2048, 1, 11, 0, 1);
    data_next_batch(b, in, tg);
    int32_t i3[B * T], t3[B * T];
    data_next_batch(c, i3, t3);
    test_report(memcmp(in, i3, sizeof in) == 0, "data_pos_reset", "pos {0,0} is not the start");
    data_close(a);
    data_close(b);
    data_close(c);
}

static void test_v2_and_zstd(void) {
    /* Ids past 65535 force version 2 (uint32). */
    write_ramp("w_000000.bin", 70000, 300, 0);
    size_t len;
    unsigned char *raw = read_raw("w_000000.bin", &len);
    int32_t h[3];
    memcpy(h, raw, sizeof h);
    free(raw);
    test_report(h[1] == 2 && len == 1024 + 4 * 300, "data_write_v2_header", "version %d len %zu",
                h[1], len);
    DataLoader *dl = open1(tpath("w_*.bin"), "data.train", 2, T, 100000, 0, 1, 0, 1);
    int32_t in[2 * T], tg[2 * T];
    data_next_batch(dl, in, tg);
    test_report(in[0] == 70000 && tg[T - 1] == 70000 + T && in[T] == 70000 + T,
                "data_read_v2_tokens", "got %d %d %d", in[0], tg[T - 1], in[T]);
    data_close(dl);

    /* zstd: same batches as the uncompressed shard, and really compressed. */
    write_ramp("z_000000.bin.zst", 0, NA, 3);
    raw = read_raw("z_000000.bin.zst", &len);
    int magic_ok = len >= 4 && raw[0] == 0x28 && raw[1] == 0xb5 && raw[2] == 0x2f && raw[3] == 0xfd;
    free(raw);
    test_report(magic_ok && len < 1024 + 2 * NA, "data_write_zstd", "len %zu, zstd magic %d", len,
                magic_ok);
    DataLoader *z = open1(tpath("z_*.bin.zst"), "data.train", 3, T, 2048, 1, 5, 0, 1);
    DataLoader *u = open1(tpath("a_000000.bin"), "data.train", 3, T, 2048, 1, 5, 0, 1);
    int ok = data_num_tokens(z) == NA;
    for (int i = 0; i < 30 && ok; i++) {
        int32_t zi[3 * T], zt[3 * T], ui[3 * T], ut[3 * T];
        data_next_batch(z, zi, zt);
        data_next_batch(u, ui, ut);
        ok = memcmp(zi, ui, sizeof zi) == 0 && memcmp(zt, ut, sizeof zt) == 0;
    }
    test_report(ok, "data_read_zstd_matches_plain", "zstd shard batches differ from the .bin ones");
    data_close(z);
    data_close(u);

    /* Frames without a content size (as the zstd CLI writes from a pipe), and a file
     * of two frames, also read: the loader uses the streaming API. */
    raw = read_raw("a_000000.bin", &len);
    ZSTD_CCtx *cc = ZSTD_createCCtx();
    ZSTD_CCtx_setParameter(cc, ZSTD_c_contentSizeFlag, 0);
    size_t cap = 2 * ZSTD_compressBound(len);
    unsigned char *zz = xmalloc(cap);
    size_t half = len / 2;
    size_t n1 = ZSTD_compress2(cc, zz, cap, raw, half);
    size_t n2 = ZSTD_isError(n1) ? n1 : ZSTD_compress2(cc, zz + n1, cap - n1, raw + half, len - half);
    ZSTD_freeCCtx(cc);
    ok = !ZSTD_isError(n1) && !ZSTD_isError(n2) &&
         ZSTD_getFrameContentSize(zz, n1) == ZSTD_CONTENTSIZE_UNKNOWN;
    if (ok) {
        write_raw("two_000000.bin.zst", zz, n1 + n2);
        DataLoader *t2 = open1(tpath("two_*.bin.zst"), "data.train", 3, T, 2048, 1, 5, 0, 1);
        u = open1(tpath("a_000000.bin"), "data.train", 3, T, 2048, 1, 5, 0, 1);
        for (int i = 0; i < 30 && ok; i++) {
            int32_t zi[3 * T], zt[3 * T], ui[3 * T], ut[3 * T];
            data_next_batch(t2, zi, zt);
            data_next_batch(u, ui, ut);
            ok = memcmp(zi, ui, sizeof zi) == 0 && memcmp(zt, ut, sizeof zt) == 0;
        }
        data_close(t2);
        data_close(u);
    }
    test_report(ok, "data_read_zstd_two_frames_unknown_size", "streamed frames read differently");
    free(zz);
    free(raw);
}

static void test_errors(void) {
    char needle[1200];
    expect_fail("data_error_no_match", tpath("nothing_*.bin"), T, 2048, "data.train",
                "nothing_*.bin");

    int32_t hdr[256] = {0};
    uint16_t body[100] = {0};
    unsigned char file[1024 + sizeof body];
    hdr[0] = 12345;
    hdr[1] = 1;
    hdr[2] = 100;
    memcpy(file, hdr, 1024);
    memcpy(file + 1024, body, sizeof body);
    write_raw("magic_000000.bin", file, sizeof file);
    snprintf(needle, sizeof needle, "%s: bad magic 12345", tpath("magic_000000.bin"));
    expect_fail("data_error_bad_magic", tpath("magic_*.bin"), T, 2048, needle, NULL);

    hdr[0] = SHARD_MAGIC;
    hdr[1] = 3;
    memcpy(file, hdr, 1024);
    write_raw("version_000000.bin", file, sizeof file);
    snprintf(needle, sizeof needle, "%s: unsupported shard version 3", tpath("version_000000.bin"));
    expect_fail("data_error_bad_version", tpath("version_*.bin"), T, 2048, needle, NULL);

    hdr[1] = 1;
    hdr[2] = 150; /* the file holds 100 */
    memcpy(file, hdr, 1024);
    write_raw("trunc_000000.bin", file, sizeof file);
    snprintf(needle, sizeof needle, "%s: truncated: header says 150 tokens, file holds 100",
             tpath("trunc_000000.bin"));
    expect_fail("data_error_truncated", tpath("trunc_*.bin"), T, 2048, needle, NULL);

    write_raw("short_000000.bin", file, 100);
    expect_fail("data_error_short_header", tpath("short_*.bin"), T, 2048, tpath("short_000000.bin"),
                "too short");

    /* Token 300 at offset 77 with a 256-token vocabulary. */
    uint32_t toks[200];
    for (int i = 0; i < 200; i++) toks[i] = (uint32_t)i % 256;
    toks[77] = 300;
    shard_write(tpath("vocab_000000.bin"), toks, 200, 0);
    snprintf(needle, sizeof needle, "%s: token 300 at offset 77 is >= vocab_size 256",
             tpath("vocab_000000.bin"));
    expect_fail("data_error_token_out_of_vocab", tpath("vocab_*.bin"), T, 256, needle, NULL);
    /* The same check inside a compressed shard. */
    shard_write(tpath("vocabz_000000.bin.zst"), toks, 200, 1);
    snprintf(needle, sizeof needle, "%s: token 300 at offset 77", tpath("vocabz_000000.bin.zst"));
    expect_fail("data_error_token_out_of_vocab_zstd", tpath("vocabz_*.bin.zst"), T, 256, needle, NULL);

    shard_write(tpath("small_000000.bin"), toks, T, 0); /* T tokens: one short of a sample */
    expect_fail("data_error_shard_too_small", tpath("small_*.bin"), T, 2048,
                tpath("small_000000.bin"), "too few for one sample");
    /* A short shard beside a full one (the tail of a split) is skipped, not fatal. */
    toks[77] = 77;
    shard_write(tpath("small_000001.bin"), toks, 200, 0);
    {
        DataLoader *dl = open1(tpath("small_*.bin"), "data.train", 2, T, 256, 0, 1, 0, 1);
        int ok = data_num_samples(dl) == (200 - 1) / T && data_num_shards(dl) == 2;
        test_report(ok, "data_short_shard_skipped", "%llu samples in %d shards",
                    (unsigned long long)data_num_samples(dl), data_num_shards(dl));
        data_close(dl);
    }
    /* A FIFO matched by the glob must be refused, not block the run forever. */
    if (mkfifo(tpath("fifo_000000.bin"), 0644) == 0)
        expect_fail("data_error_not_regular_file", tpath("fifo_*.bin"), T, 256, tpath("fifo_000000.bin"),
                    "not a regular file");
    else
        printf("skip data_error_not_regular_file: mkfifo failed\n");

    /* Corrupt zstd: flip bytes inside the compressed payload. */
    uint32_t *ramp = xmalloc(5000 * sizeof(uint32_t));
    for (int i = 0; i < 5000; i++) ramp[i] = (uint32_t)(i * 7919) % 2048;
    shard_write(tpath("badz_000000.bin.zst"), ramp, 5000, 3);
    size_t len;
    unsigned char *z = read_raw("badz_000000.bin.zst", &len);
    for (size_t i = len / 3; i < len / 3 + 16 && i < len; i++) z[i] ^= 0x5a;
    write_raw("badz_000000.bin.zst", z, len);
    snprintf(needle, sizeof needle, "%s: ", tpath("badz_000000.bin.zst"));
    expect_fail("data_error_corrupt_zstd", tpath("badz_*.bin.zst"), T, 2048, needle, "zstd");
    /* Cut-short zstd. */
    shard_write(tpath("cutz_000000.bin.zst"), ramp, 5000, 3);
    free(z);
    z = read_raw("cutz_000000.bin.zst", &len);
    write_raw("cutz_000000.bin.zst", z, len / 2);
    snprintf(needle, sizeof needle, "%s: truncated zstd", tpath("cutz_000000.bin.zst"));
    expect_fail("data_error_truncated_zstd", tpath("cutz_*.bin.zst"), T, 2048, needle, NULL);
    write_raw("emptyz_000000.bin.zst", z, 0);
    expect_fail("data_error_empty_zstd", tpath("emptyz_*.bin.zst"), T, 2048,
                tpath("emptyz_000000.bin.zst"), "zstd");
    free(z);
    free(ramp);
}

/* ---- mixtures, prefetch, state, shards that change under a run ----------- */

#include "config.h"

#include <dirent.h>
#include <math.h>

static void test_names(void) {
    static const char *cases[][2] = {
        {"web/*.bin", "web"},
        {"data/austen/train_*.bin", "austen_train"},
        {"/abs/code/shard_0*.bin.zst", "code_shard_0"},
        {"data/x/train_000000.bin", "x_train_000000"},
        {"*.bin", "source"},
        {"./*.bin", "source"},
        {"d/we b+/f?.bin", "we_b__f"},
    };
    int ok = 1;
    char got[64], why[256] = "";
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cfg_source_name(cases[i][0], got, sizeof got);
        if (strcmp(got, cases[i][1]) && ok) {
            ok = 0;
            snprintf(why, sizeof why, "'%s' -> '%s', want '%s'", cases[i][0], got, cases[i][1]);
        }
    }
    test_report(ok, "data_source_default_names", "%s", why);
}

/* Three sources whose tokens say where they came from: source s's shards hold
 * base_s + position, so a sample's first token / 100000 is its source. */
enum { MT = 16, MV = 300000 };
static const char *mix_globs[3] = {"mix/x_*.bin", "mix/y_*.bin", "mix/z_*.bin.zst"};
static const double mix_w[3] = {0.5, 0.3, 0.2};
static uint64_t mix_n[3]; /* samples per source */

static void mix_setup(void) {
    kiln_mkdirs(tpath("mix"));
    write_ramp("mix/x_000000.bin", 0, 1000, 0);     /* 62 samples */
    write_ramp("mix/x_000001.bin", 1000, 1000, 0);  /* 62 */
    write_ramp("mix/y_000000.bin", 100000, 800, 0); /* 49 */
    write_ramp("mix/z_000000.bin.zst", 200000, 500, 3); /* 31, compressed */
    mix_n[0] = 124, mix_n[1] = 49, mix_n[2] = 31;
}

static DataLoader *open_mix(const double *w, int n, int B, int rank, int world, int prefetch, int max_open) {
    DataSource src[3];
    static const char *names[3] = {"x", "y", "z"};
    for (int i = 0; i < n; i++) src[i] = (DataSource){names[i], tpath(mix_globs[i]), w[i]};
    DataOptions o = {.what = "data.train", .sources = src, .n_sources = n, .mixture = 1, .B = B, .T = MT,
                     .vocab_size = MV, .shuffle = 1, .seed = 5, .rank = rank, .world = world, .prefetch = prefetch,
                     .max_open = max_open};
    return data_open(&o);
}

static int src_of(int32_t first) { return first / 100000; }

/* Shares. The greedy blend picks a source only while it is behind its share
 * (the deficits w_s (n+1) - c_s sum to 1 > 0, so the largest is positive):
 * no source is ever a whole sample ahead, c_s - w_s n < 1; and since the
 * deviations sum to 0, none is more than S - 1 = 2 samples behind. Weights
 * are integers of 2^-30 of the total: over N = 3000 samples that moves a share
 * by at most 3000 x 2^-30 samples, hence the 1e-3 slack. Every source's
 * epochs are permutations of its samples (y's 49 are drawn 18 times).
 * Measured: 1500/900/600 drawn, at most 0.5 sample ahead or behind. */
static void test_mixture_shares(void) {
    enum { N = 3000 };
    DataLoader *dl = open_mix(mix_w, 3, 1, 0, 1, 0, 0);
    uint64_t cnt[3] = {0};
    double ahead = -1e9, behind = 1e9;
    static char seen_y[49 * MT];
    int perm_ok = 1;
    int32_t in[MT], tg[MT];
    for (int n = 1; n <= N; n++) {
        data_next_batch(dl, in, tg);
        int s = src_of(in[0]);
        if (s == 1) {
            int idx = (in[0] - 100000) / MT;
            if (cnt[1] % 49 == 0) memset(seen_y, 0, sizeof seen_y);
            perm_ok &= idx >= 0 && idx < 49 && !seen_y[idx];
            if (idx >= 0 && idx < 49) seen_y[idx] = 1;
        }
        cnt[s]++;
        for (int k = 0; k < 3; k++) {
            double d = (double)cnt[k] - mix_w[k] * n;
            ahead = d > ahead ? d : ahead;
            behind = d < behind ? d : behind;
        }
    }
    test_report(ahead < 1 + 1e-3 && behind > -2 - 1e-3, "data_mixture_shares_bounded",
                "over %d samples a source was %.3f ahead / %.3f behind its share (bounds 1 and 2)", N, ahead, -behind);
    test_report(perm_ok, "data_mixture_epoch_per_source", "an epoch of source y repeated a sample");
    uint64_t tok_ok = data_source_tokens(dl, 1) == cnt[1] * MT && data_source_tokens(dl, 2) == cnt[2] * MT;
    test_report(tok_ok, "data_mixture_tokens_by_source", "y %llu z %llu tokens, want %llu %llu",
                (unsigned long long)data_source_tokens(dl, 1), (unsigned long long)data_source_tokens(dl, 2),
                (unsigned long long)cnt[1] * MT, (unsigned long long)cnt[2] * MT);
    char note[512];
    int notes = 0, named = 1;
    while (data_take_note(dl, note, sizeof note)) notes++, named &= strstr(note, "source '") != NULL;
    /* x: 1500 / 124 -> epoch 12, y: 900 / 49 -> 18, z: 600 / 31 -> 19; one note per source and take */
    test_report(notes == 3 && named, "data_mixture_epoch_notes", "%d notes", notes);
    data_close(dl);
}

/* The global order does not depend on the rank count: 1 x 8, 2 x 4, 4 x 2. */
static void test_mixture_ranks(void) {
    enum { STEPS = 60, G = 8 };
    DataLoader *one = open_mix(mix_w, 3, G, 0, 1, 0, 0);
    DataLoader *r2[2], *r4[4];
    for (int r = 0; r < 2; r++) r2[r] = open_mix(mix_w, 3, G / 2, r, 2, 0, 0);
    for (int r = 0; r < 4; r++) r4[r] = open_mix(mix_w, 3, G / 4, r, 4, 2, 0);
    int ok = 1;
    for (int st = 0; st < STEPS && ok; st++) {
        int32_t bi[G * MT], bt[G * MT], in[G * MT], tg[G * MT];
        data_next_batch(one, bi, bt);
        for (int r = 0; r < 2; r++) {
            data_next_batch(r2[r], in, tg);
            for (int b = 0; b < G / 2; b++)
                ok &= !memcmp(in + b * MT, bi + (2 * b + r) * MT, sizeof(int32_t) * MT) &&
                      !memcmp(tg + b * MT, bt + (2 * b + r) * MT, sizeof(int32_t) * MT);
        }
        for (int r = 0; r < 4; r++) {
            data_next_batch(r4[r], in, tg);
            for (int b = 0; b < G / 4; b++) ok &= !memcmp(in + b * MT, bi + (4 * b + r) * MT, sizeof(int32_t) * MT);
        }
    }
    for (int s = 0; s < 3; s++) ok &= data_source_tokens(one, s) == data_source_tokens(r4[3], s);
    test_report(ok, "data_mixture_same_order_1_2_4_ranks", "a rank's slice differs from the one-rank batch");
    data_close(one);
    for (int r = 0; r < 2; r++) data_close(r2[r]);
    for (int r = 0; r < 4; r++) data_close(r4[r]);
}

static int same_batches(DataLoader *a, DataLoader *b, int n, int B) {
    int32_t ai[8 * MT], at[8 * MT], bi[8 * MT], bt[8 * MT];
    for (int i = 0; i < n; i++) {
        data_next_batch(a, ai, at);
        data_next_batch(b, bi, bt);
        if (memcmp(ai, bi, sizeof(int32_t) * B * MT) || memcmp(at, bt, sizeof(int32_t) * B * MT)) return 0;
    }
    return 1;
}

/* Save after K batches (y, 49 samples, is then mid-epoch), restore into a
 * fresh loader (with prefetch), continue identically; prefetch on and off
 * give the same batches. */
static void test_mixture_resume_prefetch(void) {
    enum { B = 4, K = 60, M = 200 };
    DataLoader *a = open_mix(mix_w, 3, B, 0, 1, 0, 0);
    int32_t in[B * MT], tg[B * MT];
    for (int i = 0; i < K; i++) data_next_batch(a, in, tg);
    size_t n = data_state_words(a);
    uint64_t *w = xmalloc(n * sizeof(uint64_t));
    data_get_state(a, w);
    uint64_t ky = w[4 + 6 * 1 + 3];
    DataLoader *b = open_mix(mix_w, 3, B, 0, 1, 3, 0);
    char note[1024];
    data_set_state(b, w, n, 0, note, sizeof note);
    int ok = ky % 49 != 0 && ky > 49 && note[0] == 0 && same_batches(a, b, M, B);
    test_report(ok, "data_mixture_resume_exact_mid_epoch", "y at sample %llu (epoch %llu), note '%s'",
                (unsigned long long)ky % 49, (unsigned long long)ky / 49, note);
    data_close(a);
    data_close(b);
    DataLoader *p0 = open_mix(mix_w, 3, B, 0, 1, 0, 0), *p3 = open_mix(mix_w, 3, B, 0, 1, 3, 2);
    test_report(same_batches(p0, p3, 500, B), "data_prefetch_same_batches", "prefetch 3 (2 open shards) differs from 0");
    data_rewind(p3);
    data_rewind(p0);
    test_report(same_batches(p0, p3, 50, B) && data_take_wait_s(p3) >= 0, "data_prefetch_rewind",
                "after a rewind prefetch 3 differs from 0");
    data_close(p0);
    data_close(p3);
    free(w);
}

typedef struct StateArgs {
    const double *w;
    int n_src, force;
    const uint64_t *words;
    size_t n;
} StateArgs;

static void set_state_in_child(void *arg) {
    const StateArgs *a = arg;
    DataLoader *dl = open_mix(a->w, a->n_src, 4, 0, 1, 0, 0);
    char note[1024];
    data_set_state(dl, a->words, a->n, a->force, note, sizeof note);
    fprintf(stderr, "note: %s\n", note);
}

/* A changed mixture: refused naming data.train; with force each source
 * continues from its own position (y's next sample is the one the saved run
 * would have drawn next from y). */
static void test_mixture_changed(void) {
    enum { B = 4, K = 23 };
    DataLoader *a = open_mix(mix_w, 3, B, 0, 1, 0, 0);
    int32_t in[B * MT], tg[B * MT];
    for (int i = 0; i < K; i++) data_next_batch(a, in, tg);
    size_t n = data_state_words(a);
    uint64_t *w = xmalloc(n * sizeof(uint64_t));
    data_get_state(a, w);
    static const double w2[3] = {0.2, 0.6, 0.2};
    char msg[4096];
    StateArgs args = {w2, 3, 0, w, n};
    int code = test_run_child(set_state_in_child, &args, msg, sizeof msg);
    test_report(code == 2 && strstr(msg, "key 'data.train'") && strstr(msg, "weight of source 'x'"),
                "data_mixture_changed_weights_refused", "exit %d: %s", code, msg);
    args.n_src = 2; /* z is gone */
    code = test_run_child(set_state_in_child, &args, msg, sizeof msg);
    test_report(code == 2 && strstr(msg, "data.train"), "data_mixture_removed_source_refused", "exit %d: %s", code, msg);
    /* forced: the next y sample of the new mixture is the old run's next y sample */
    DataLoader *b = open_mix(w2, 3, B, 0, 1, 0, 0);
    char note[1024];
    data_set_state(b, w, n, 1, note, sizeof note);
    int32_t want = -1, got = -1;
    for (int i = 0; i < 50 && want < 0; i++) {
        data_next_batch(a, in, tg);
        for (int j = 0; j < B && want < 0; j++)
            if (src_of(in[j * MT]) == 1) want = in[j * MT];
    }
    for (int i = 0; i < 50 && got < 0; i++) {
        data_next_batch(b, in, tg);
        for (int j = 0; j < B && got < 0; j++)
            if (src_of(in[j * MT]) == 1) got = in[j * MT];
    }
    test_report(want >= 0 && got == want && strstr(note, "'y' continues at epoch") && strstr(note, "--force"),
                "data_mixture_force_continues_per_source", "next y sample %d, want %d; note '%s'", got, want, note);
    data_close(a);
    data_close(b);
    free(w);
}

static int count_fds(void) {
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    if (!d) return -1;
    while (readdir(d)) n++;
    closedir(d);
    return n;
}

/* 30 shards through at most 3 open: the process never holds more. */
static void test_open_bound(void) {
    kiln_mkdirs(tpath("many"));
    for (int i = 0; i < 30; i++) {
        char name[64];
        snprintf(name, sizeof name, "many/m_%06d.bin", i);
        write_ramp(name, (uint32_t)(i * 100), 100, 0);
    }
    int base = count_fds(), most = 0;
    DataLoader *dl = open1(tpath("many/m_*.bin"), "data.train", 4, MT, 4096, 1, 3, 0, 1);
    int after_open = count_fds();
    DataSource src = {"m", tpath("many/m_*.bin"), 1};
    DataOptions o = {.what = "data.train", .sources = &src, .n_sources = 1, .B = 4, .T = MT, .vocab_size = 4096,
                     .shuffle = 1, .seed = 3, .world = 1, .max_open = 3};
    DataLoader *lim = data_open(&o);
    int ok = 1;
    for (int i = 0; i < 100; i++) {
        int32_t a[4 * MT], at[4 * MT], b[4 * MT], bt[4 * MT];
        data_next_batch(dl, a, at);
        data_next_batch(lim, b, bt);
        ok &= !memcmp(a, b, sizeof a);
        int n = count_fds() - after_open;
        most = n > most ? n : most;
    }
    /* dl (64 open at most) holds every one of the 30 by now; lim at most 3 */
    test_report(after_open == base && ok && most <= 30 + 3, "data_open_files_bounded",
                "%d descriptors after indexing (%d before), %d open at most for 30 + 3, same batches %d",
                after_open, base, most, ok);
    data_close(dl);
    data_close(lim);
    test_report(count_fds() == base, "data_close_closes_files", "%d descriptors left, %d before", count_fds(), base);
}

typedef struct VanishArgs {
    int prefetch, max_open, truncate, zst;
} VanishArgs;

/* Read a few batches, then delete (or truncate) shard 2 of 4 while reading on. */
static void vanish_in_child(void *arg) {
    const VanishArgs *a = arg;
    alarm(60); /* a hang shows as a signal, not as a stuck suite */
    char pat[160], victim[160];
    const char *ext = a->zst ? ".bin.zst" : ".bin";
    snprintf(pat, sizeof pat, "van%d%d%d%d/v_*%s", a->prefetch, a->max_open, a->truncate, a->zst, ext);
    snprintf(victim, sizeof victim, "van%d%d%d%d/v_000002%s", a->prefetch, a->max_open, a->truncate, a->zst, ext);
    char dir[64];
    snprintf(dir, sizeof dir, "van%d%d%d%d", a->prefetch, a->max_open, a->truncate, a->zst);
    kiln_mkdirs(tpath(dir));
    for (int i = 0; i < 4; i++) {
        char name[160];
        snprintf(name, sizeof name, "%s/v_%06d%s", dir, i, ext);
        write_ramp(name, (uint32_t)(i * 500), 500, a->zst ? 1 : 0);
    }
    DataSource src = {"v", tpath(pat), 1};
    DataOptions o = {.what = "data.train", .sources = &src, .n_sources = 1, .B = 2, .T = MT, .vocab_size = 4096,
                     .shuffle = 1, .seed = 9, .world = 1, .prefetch = a->prefetch, .max_open = a->max_open};
    DataLoader *dl = data_open(&o);
    int32_t in[2 * MT], tg[2 * MT];
    for (int i = 0; i < 5; i++) data_next_batch(dl, in, tg);
    if (a->truncate) {
        if (truncate(tpath(victim), 700) != 0) _exit(3);
    } else if (unlink(tpath(victim)) != 0) _exit(3);
    for (int i = 0; i < 500; i++) data_next_batch(dl, in, tg);
    _exit(0); /* never reached if the shard is read again: 500 batches of 124 samples */
}

static void test_vanish(void) {
    static const VanishArgs cases[] = {
        {0, 64, 0, 0}, {2, 64, 0, 0}, {0, 1, 0, 0}, {3, 1, 0, 0}, {0, 64, 1, 0}, {2, 64, 1, 0}, {2, 1, 1, 0},
        {2, 64, 0, 1}, {0, 1, 1, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const VanishArgs *a = &cases[i];
        char msg[4096], name[128], want[256];
        int code = test_run_child(vanish_in_child, (void *)a, msg, sizeof msg);
        snprintf(want, sizeof want, "/v_000002%s: ", a->zst ? ".bin.zst" : ".bin");
        int errors = 0;
        for (const char *p = msg; (p = strstr(p, "kiln: error: ")); p++) errors++;
        snprintf(name, sizeof name, "data_shard_%s_mid_run%s_prefetch%d_open%d", a->truncate ? "truncated" : "deleted",
                 a->zst ? "_zstd" : "", a->prefetch, a->max_open);
        test_report(code == 2 && errors == 1 && strstr(msg, want) &&
                        (strstr(msg, "while the run goes on") || strstr(msg, "cannot open")),
                    name, "exit %d, %d error lines: %s", code, errors, msg);
    }
}

int main(void) {
    const char *base = getenv("KILN_TEST_TMP");
    char made[] = "/tmp/kiln-test-data.XXXXXX";
    if (!base) {
        base = mkdtemp(made);
        if (!base) return 1;
    }
    snprintf(tmpdir, sizeof tmpdir, "%s/test_data", base);
    if (kiln_mkdirs(tmpdir) != 0) {
        fprintf(stderr, "test_data: cannot create %s\n", tmpdir);
        return 1;
    }
    test_basic();
    test_shuffle();
    test_ranks();
    test_resume();
    test_v2_and_zstd();
    test_errors();
    test_names();
    mix_setup();
    test_mixture_shares();
    test_mixture_ranks();
    test_mixture_resume_prefetch();
    test_mixture_changed();
    test_open_bound();
    test_vanish();
    return 0;
}
