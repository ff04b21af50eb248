/* test_ckpt: the checkpoint format below train.c — CRC32C against its
 * published check value, a table round trip (tensors and blobs, compressed
 * and not, async and not), loading a tensor assembled from pieces written by
 * two ranks (the resharding path), and refusals (shape, missing entry). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
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

int main(void) {
    /* the CRC-32C check value (RFC 3720 B.4 / the "123456789" convention) */
    test_report(ckpt_crc32c(0, "123456789", 9) == 0xE3069283u, "ckpt_crc32c_check_value", "got %08x",
                ckpt_crc32c(0, "123456789", 9));
    unsigned char big[1000];
    for (int i = 0; i < 1000; i++) big[i] = (unsigned char)(i * 7);
    uint32_t whole = ckpt_crc32c(0, big, 1000), split = ckpt_crc32c(ckpt_crc32c(0, big, 333), big + 333, 667);
    test_report(whole == split, "ckpt_crc32c_streams", "%08x vs %08x", whole, split);

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
    return 0;
}
