/* test_ckpt_hostile: checkpoints written by someone else. Each finding of the
 * sanitizer and fuzz probe of issue 21 as a manifest edited by hand, its
 * checksum resealed so that only the numbers are wrong: sizes whose products
 * wrap in 64 bits, sizes past the file, blobs and shapes no file holds,
 * integers that saturate, a box outside its tensor, FIFOs where files belong.
 * Every one is refused with one line naming the manifest or file and the
 * entry (ckpt-info and ckpt-diff: exit 2), never a crash, a huge allocation
 * or a hang. Also: the manifest reader frees what it read on every refusal
 * (--resume auto reads each damaged checkpoint it skips) and an empty
 * checkpoints folder lists nothing. The sanitizer build (make sanitize) runs
 * this file too, where a leak or an overflow is itself a failure. */
#include <errno.h>
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt.h"
#include "test.h"
#include "util.h"

static char root[512];

static void run(const char *cmd) {
    if (system(cmd) != 0) printf("FAIL ckpt_hostile_setup: %s\n", cmd);
}

/* A checkpoint of a (6,4) tensor "w" and a text blob "config.yaml" under root/sub. */
static void save(const char *sub, int compress) {
    static float w[24];
    static char text[] = "run: {name: hostile}\n";
    for (int i = 0; i < 24; i++) w[i] = (float)i;
    CkptTable t;
    ckpt_table_init(&t);
    int64_t shape[2] = {6, 4};
    ckpt_add_tensor(&t, "w", CKPT_F32, 2, shape, 0, 24, w, NULL, NULL);
    ckpt_add_blob(&t, "config.yaml", CKPT_U8, strlen(text), 0, text);
    CkptOptions o = {0};
    snprintf(o.root, sizeof o.root, "%s/%s", root, sub);
    o.compress = compress;
    CkptWriter *wr = ckpt_writer_new(&t, &o);
    CkptMeta meta = {5, 0x1234, "test", "none", {1, 0, 1, 1, 1, 1, 1}};
    if (ckpt_save(wr, &meta) != 0) printf("FAIL ckpt_hostile_save: %s\n", ckpt_writer_error(wr));
    ckpt_writer_free(wr);
    ckpt_table_free(&t);
}

/* Field `key` of `line` set to `value`; 0 if it has no such field. */
static int set_field(char *line, const char *key, const char *value) {
    char k[64], rest[4096];
    snprintf(k, sizeof k, " %s=", key);
    char *at = strstr(line, k);
    if (!at) return 0;
    char *vend = at + strlen(k) + strcspn(at + strlen(k), " ");
    snprintf(rest, sizeof rest, "%s", vend);
    sprintf(at + strlen(k), "%s%s", value, rest);
    return 1;
}

/* A copy of root/src's checkpoint as root/name/ with the manifest line that
 * starts with `prefix` edited: the fields named in `keys` (space-separated)
 * set to the matching words of `values`, or (keys NULL) the whole line
 * replaced by values; the end line resealed. Returns its path. */
static const char *edited(const char *src, const char *name, const char *prefix, const char *keys, const char *values) {
    static char dir[1024];
    char cmd[4096];
    snprintf(dir, sizeof dir, "%s/%s", root, name);
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s/%s/step_00000005' '%s'", dir, root, src, dir);
    run(cmd);
    char path[1200];
    snprintf(path, sizeof path, "%s/manifest", dir);
    size_t len;
    char *m = kiln_read_file(path, &len);
    char *out = xmalloc(len + 4096);
    size_t o = 0;
    int found = 0;
    for (char *line = m; *line && strncmp(line, "end crc32c=", 11);) {
        char *nl = strchr(line, '\n'), l[4096];
        snprintf(l, sizeof l, "%.*s", (int)(nl - line), line);
        line = nl + 1;
        if (!strncmp(l, prefix, strlen(prefix))) {
            if (!keys) {
                snprintf(l, sizeof l, "%s", values);
                found = 1;
            } else {
                char kb[256], vb[1024], *ks, *vs;
                snprintf(kb, sizeof kb, "%s", keys), snprintf(vb, sizeof vb, "%s", values);
                found = 1;
                for (char *k = strtok_r(kb, " ", &ks), *v = strtok_r(vb, " ", &vs); k && v;
                     k = strtok_r(NULL, " ", &ks), v = strtok_r(NULL, " ", &vs))
                    found &= set_field(l, k, v);
            }
        }
        o += (size_t)sprintf(out + o, "%s\n", l);
    }
    if (!found) printf("FAIL ckpt_hostile_edit: no line '%s' with fields '%s' in %s\n", prefix, keys ? keys : "", path);
    o += (size_t)sprintf(out + o, "end crc32c=%08x\n", ckpt_crc32c(0, out, o));
    FILE *f = fopen(path, "w");
    fwrite(out, 1, o, f);
    fclose(f);
    free(out), free(m);
    return dir;
}

#define W "entry name=w "
#define CFG "entry name=config.yaml "
/* w's line as the writer made it, with a box field added at %s */
#define WBOX W "kind=tensor dtype=f32 shape=[6,4] range=0:24 box=%s rank=0 file=rank00000.bin offset=0 bytes=96 " \
        "stored=96 codec=none crc32c=00000000"

/* One line of stderr, "kiln: error: ..." (a hint line may follow), naming needle. */
static int one_error_line(const char *err, const char *needle) {
    if (strncmp(err, "kiln: error: ", 13) != 0 || !strstr(err, needle)) return 0;
    const char *nl = strchr(err, '\n');
    return nl && (!nl[1] || !strncmp(nl + 1, "kiln: hint: ", 12)) && (!nl[1] || !strchr(strchr(nl + 1, '\n') + 1, '\n'));
}

static void check_load(const char *name, const char *dir, const char *needle) {
    float w[24];
    CkptTable t;
    ckpt_table_init(&t);
    int64_t shape[2] = {6, 4};
    ckpt_add_tensor(&t, "w", CKPT_F32, 2, shape, 0, 24, w, NULL, NULL);
    char err[2048] = "";
    int rc = ckpt_load(dir, &t, NULL, err, sizeof err);
    test_report(rc != 0 && strstr(err, needle), name, "rc %d: %s", rc, err);
    ckpt_table_free(&t);
}

static void check_blob(const char *name, const char *dir, const char *needle) {
    char err[2048] = "";
    size_t len = 0;
    void *b = ckpt_read_blob(dir, "config.yaml", &len, err, sizeof err);
    test_report(!b && strstr(err, needle), name, "%s: %s", b ? "read" : "refused", err);
    free(b);
}

static void check_verify(const char *name, const char *dir, const char *needle) {
    char err[2048] = "";
    int rc = ckpt_verify(dir, NULL, err, sizeof err);
    test_report(rc != 0 && strstr(err, needle), name, "rc %d: %s", rc, err);
}

typedef struct {
    int argc;
    char *argv[4];
} Args;
/* In a child (they exit): a hang becomes a failure, not a stuck suite; the listing is not checked. */
static void info_child(void *a) {
    alarm(60), freopen("/dev/null", "w", stdout);
    ckpt_info_main(((Args *)a)->argc, ((Args *)a)->argv);
}
static void diff_child(void *a) {
    alarm(60), freopen("/dev/null", "w", stdout);
    ckpt_diff_main(((Args *)a)->argc, ((Args *)a)->argv);
}

static void check_tool(const char *name, void (*fn)(void *), Args *a, const char *needle) {
    char err[4096];
    int rc = test_run_child(fn, a, err, sizeof err);
    test_report(rc == 2 && one_error_line(err, needle), name, "exit %d: %s", rc, err);
}

static void verify_child(void *dir) {
    alarm(60); /* a hang turns into a failure, not a stuck suite */
    char err[2048] = "";
    int rc = ckpt_verify(dir, NULL, err, sizeof err);
    fprintf(stderr, "%d %s", rc, err);
    exit(rc ? 2 : 0);
}

int main(void) {
    snprintf(root, sizeof root, "%s/test_ckpt_hostile", getenv("KILN_TEST_TMP") ? getenv("KILN_TEST_TMP") : "/tmp");
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir -p '%s'", root, root);
    run(cmd);
    save("plain", 0);
    save("zstd", 3);
    char plain[1024];
    snprintf(plain, sizeof plain, "%s/plain/step_00000005", root);
    {
        float w[24];
        CkptTable t;
        ckpt_table_init(&t);
        int64_t shape[2] = {6, 4};
        ckpt_add_tensor(&t, "w", CKPT_F32, 2, shape, 0, 24, w, NULL, NULL);
        char err[2048] = "";
        /* the editor itself: a field set to its own value loads */
        int rc = ckpt_load(edited("zstd", "control", W, "rank", "0"), &t, NULL, err, sizeof err);
        test_report(rc == 0 && w[23] == 23.0f, "ckpt_hostile_control_loads", "rc %d: %s", rc, err);
        ckpt_table_free(&t);
    }

    /* the heap overflow: 3 x 6148914691236517205 = 2^64 - 1 elements of u8,
     * every check passing in wrapping arithmetic, bytes + 1 wrapping to 0 */
    const char *d = edited("zstd", "wrap", CFG, "shape range bytes",
                           "[3,6148914691236517205] 0:18446744073709551615 18446744073709551615");
    check_blob("ckpt_hostile_wrapping_product_blob", d, "manifest:10: malformed entry line");
    check_verify("ckpt_hostile_wrapping_product_verify", d, "manifest:10: malformed entry line");
    d = edited("plain", "wrap2", W, "shape", "[4294967296,4294967296]");
    check_load("ckpt_hostile_shape_overflows_64_bits", d, "malformed entry line");

    /* sizes past the file: stored of 2^63 - 1, a blob of 2^63 - 1 bytes */
    d = edited("zstd", "stored", CFG, "stored", "9223372036854775807");
    check_verify("ckpt_hostile_offset_plus_stored_past_int64", d, "malformed entry line");
    d = edited("zstd", "stored2", W, "stored", "9223372036854775807");
    check_verify("ckpt_hostile_stored_past_the_file", d, "entry 'w' needs bytes 0..9223372036854775807, file ends at");
    d = edited("plain", "bigblob", CFG, NULL,
               CFG "kind=blob dtype=u8 shape=[9223372036854775807] range=0:9223372036854775807 rank=0 "
               "file=rank00000.bin offset=0 bytes=9223372036854775807 stored=9223372036854775807 codec=none "
               "crc32c=00000000");
    check_blob("ckpt_hostile_blob_larger_than_blobs", d, "entry 'config.yaml' is not a blob of at most");
    check_verify("ckpt_hostile_blob_past_the_file", d, "entry 'config.yaml' needs bytes 0..9223372036854775807");
    /* a zstd piece claiming 2^40 bytes from its 30 */
    d = edited("plain", "ratio", CFG, NULL,
               CFG "kind=blob dtype=u8 shape=[1099511627776] range=0:1099511627776 rank=0 file=rank00000.bin "
               "offset=0 bytes=1099511627776 stored=30 codec=zstd crc32c=00000000");
    check_verify("ckpt_hostile_zstd_ratio", d, "entry 'config.yaml': 1099511627776 bytes cannot decompress from 30");
    Args info = {2, {"ckpt-info", (char *)d}};
    check_tool("ckpt_hostile_info_exit_2_one_line", info_child, &info, "entry 'config.yaml'");

    /* integers that saturate or go negative, a box outside its tensor */
    d = edited("plain", "sat", W, "shape", "[99999999999999999999,4]");
    check_load("ckpt_hostile_shape_saturates", d, "malformed entry line");
    d = edited("plain", "neg", W, "range", "0:-1");
    check_load("ckpt_hostile_negative_range", d, "malformed entry line");
    char wbox[512];
    snprintf(wbox, sizeof wbox, WBOX, "0:18446744073709551615,0:4");
    check_load("ckpt_hostile_box_outside_tensor", edited("plain", "box", W, NULL, wbox), "malformed entry line");
    snprintf(wbox, sizeof wbox, WBOX, "1:0,0:4");
    check_load("ckpt_hostile_box_empty", edited("plain", "box2", W, NULL, wbox), "malformed entry line");
    snprintf(wbox, sizeof wbox, WBOX, "0:6,-1:4");
    check_load("ckpt_hostile_box_negative", edited("plain", "box3", W, NULL, wbox), "malformed entry line");
    snprintf(wbox, sizeof wbox, WBOX, "0:6,0:4");
    check_load("ckpt_hostile_box_whole_control", edited("plain", "box4", W, NULL, wbox), "checksum mismatch");
    d = edited("plain", "step", "step 5", NULL, "step 99999999999999999999");
    check_load("ckpt_hostile_step_saturates", d, "malformed step line");
    d = edited("plain", "rank", W, "rank", "4294967296");
    check_load("ckpt_hostile_rank_past_int", d, "malformed entry line");

    /* ckpt-diff allocates whole tensors of A's shapes: a shape its pieces do
     * not hold is named before anything is allocated */
    d = edited("plain", "diffshape", W, "shape", "[1000000000000]");
    Args diff = {3, {"ckpt-diff", (char *)d, plain}};
    check_tool("ckpt_hostile_diff_shape_past_pieces", diff_child, &diff,
               "entry 'w': its pieces hold 24 of the 1000000000000 elements");

    /* every refusal frees the manifest it read: 300 refusals leaked 4.8 MB
     * (16 KB each) before; a leak-free reader grows the heap by nothing */
    const char *leak = edited("plain", "leak", CFG, "dtype", "f99");
    char err[2048];
    struct mallinfo2 m0 = mallinfo2();
    for (int i = 0; i < 300; i++) ckpt_verify(leak, NULL, err, sizeof err);
    /* two copies of w: refused by the overlap check, after every line parsed */
    char wline[512];
    snprintf(wline, sizeof wline, "%s", W "kind=tensor dtype=f32 shape=[6,4] range=0:24 rank=0 file=rank00000.bin "
             "offset=0 bytes=96 stored=96 codec=none crc32c=00000000");
    leak = edited("plain", "leak2", CFG, NULL, wline);
    for (int i = 0; i < 300; i++) ckpt_verify(leak, NULL, err, sizeof err);
    test_report(strstr(err, "pieces of 'w' overlap") != NULL, "ckpt_hostile_overlap_refused", "%s", err);
    struct mallinfo2 m1 = mallinfo2();
    long grew = (long)m1.uordblks - (long)m0.uordblks;
    test_report(grew < 256 << 10, "ckpt_hostile_refusals_free_the_manifest", "heap grew %ld bytes over 600 refusals", grew);

    /* an empty checkpoints folder, and one with other files only */
    snprintf(cmd, sizeof cmd, "mkdir -p '%s/empty' '%s/others/x' && touch '%s/others/step_x' '%s/others/latest'", root,
             root, root, root);
    run(cmd);
    char **paths, line[600];
    int64_t *steps;
    snprintf(line, sizeof line, "%s/empty", root);
    int n = ckpt_list(line, &paths, &steps);
    ckpt_list_free(paths, steps, n);
    snprintf(line, sizeof line, "%s/others", root);
    int n2 = ckpt_list_current(line, &paths, &steps);
    ckpt_list_free(paths, steps, n2);
    test_report(n == 0 && n2 == 0, "ckpt_hostile_empty_folder_lists_nothing", "%d and %d", n, n2);

    /* FIFOs where the manifest, a rank file or `latest` belong: refused at
     * once (opening one for reading would wait for a writer forever) */
    snprintf(line, sizeof line, "%s/fifo", root);
    snprintf(cmd, sizeof cmd, "cp -r '%s' '%s' && rm '%s/manifest' && mkfifo '%s/manifest'", plain, line, line, line);
    run(cmd);
    int rc = test_run_child(verify_child, line, err, sizeof err);
    test_report(rc == 2 && strstr(err, "manifest: cannot read the manifest: not a regular file"),
                "ckpt_hostile_fifo_manifest", "exit %d: %s", rc, err);
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s' '%s' && rm '%s/rank00000.bin' && mkfifo '%s/rank00000.bin'",
             line, plain, line, line, line);
    run(cmd);
    rc = test_run_child(verify_child, line, err, sizeof err);
    test_report(rc == 2 && strstr(err, "rank00000.bin: cannot open: not a regular file"), "ckpt_hostile_fifo_rank_file",
                "exit %d: %s", rc, err);
    snprintf(cmd, sizeof cmd, "mkdir -p '%s/fl' && cp -r '%s' '%s/fl/' && mkfifo '%s/fl/latest'", root, plain, root, root);
    run(cmd);
    snprintf(line, sizeof line, "%s/fl", root);
    n = ckpt_list_current(line, &paths, &steps);
    ckpt_list_free(paths, steps, n);
    test_report(n == 1, "ckpt_hostile_fifo_latest", "%d checkpoints listed", n);
    return 0;
}
