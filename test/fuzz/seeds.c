/* seeds: the fuzz targets' seed corpora (test/fuzz/corpus/TARGET/), made from
 * the repo's own files and kiln's own writers, so that each starts from valid
 * input: the ready configs and a --set list, shards of both widths plain and
 * zstd, checkpoints (one rank, zstd, two ranks' flat pieces, two
 * tensor-parallel boxes) packed as fuzz_manifest reads them, an llm.c file of
 * the fuzz model's shape, a safetensors file of each dtype, rank-file lines,
 * and texts for the pre-tokeniser. `make fuzz-seeds` rewrites them; with
 * --big DIR it also writes a whole 50,256-rank file there (560 KB: for
 * campaigns, not committed). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ckpt.h"
#include "safetensors.h"
#include "shard.h"
#include "util.h"

static char out[1024];

static void put(const char *target, const char *name, const void *data, size_t n) {
    char path[1400];
    snprintf(path, sizeof path, "%s/%s", out, target);
    if (kiln_mkdirs(path) != 0) kiln_fail(1, "%s: cannot create", path);
    snprintf(path, sizeof path, "%s/%s/%s", out, target, name);
    if (kiln_write_file_atomic(path, data, n) != 0) kiln_fail(1, "%s: cannot write", path);
}

static void put_file(const char *target, const char *name, const char *src, size_t max) {
    size_t n;
    char *t = kiln_read_file(src, &n);
    if (!t) kiln_fail(1, "%s: %s", src, kiln_strerror(errno));
    put(target, name, t, n < max ? n : max);
    free(t);
}

/* ---- checkpoints: the table fuzz_manifest loads ---- */
static float w[96], m[96];
static int64_t step = 5;
static uint64_t rng[4] = {1, 2, 3, 4};
static char config[] = "run:\n  name: seed\nmodel:\n  n_layer: 1\n";

/* rank r's part of a checkpoint under dir/ (flat rows, or with box a column box) */
static void ckpt_part(const char *dir, int rank, int world, int compress, int box) {
    CkptTable t;
    ckpt_table_init(&t);
    int64_t shape[2] = {8, 12};
    if (box) {
        CkptEntry *e = ckpt_add_tensor(&t, "w", CKPT_F32, 2, shape, 0, 48, w + 48 * rank, NULL, NULL);
        ckpt_entry_set_box(e, 0, 8, 6 * (uint64_t)rank, 6 * (uint64_t)rank + 6);
    } else {
        uint64_t lo = world == 1 ? 0 : 48 * (uint64_t)rank, hi = world == 1 ? 96 : lo + 48;
        ckpt_add_tensor(&t, "w", CKPT_F32, 2, shape, lo, hi, w + lo, NULL, NULL);
        ckpt_add_tensor(&t, "optim.m/w", CKPT_F32, 2, shape, lo, hi, m + lo, NULL, NULL);
    }
    if (rank == 0) {
        ckpt_add_blob(&t, "train.step", CKPT_I64, 1, 1, &step);
        ckpt_add_blob(&t, "rng.train", CKPT_U64, 4, 0, rng);
        ckpt_add_blob(&t, "config.yaml", CKPT_U8, strlen(config), 0, config);
    }
    CkptOptions o = {0};
    kiln_strlcpy(o.root, dir, sizeof o.root);
    o.compress = compress;
    CkptWriter *wr = ckpt_writer_new(&t, &o);
    CkptMeta meta = {5, 0x5eed, "seed", "none", {world, rank, box ? 1 : world, box ? 2 : 1, 1, 1, 1}};
    if (ckpt_save(wr, &meta) != 0) kiln_fail(1, "%s", ckpt_writer_error(wr));
    ckpt_writer_free(wr);
    ckpt_table_free(&t);
}

/* pack dir/step_00000005 (rank 0's manifest, the other ranks' entry lines
 * appended, no end line) and its rank files as one fuzz_manifest input */
static void ckpt_seed(const char *name, const char *tmp, int world, int compress, int box) {
    char dir[1400], path[1600];
    char *pack = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&pack, &n);
    for (int r = 0; r < world; r++) {
        snprintf(dir, sizeof dir, "%s/%s%d", tmp, name, r);
        ckpt_part(dir, r, world, compress, box);
        snprintf(path, sizeof path, "%s/step_00000005/manifest", dir);
        size_t len;
        char *text = kiln_read_file(path, &len);
        for (char *l = text; *l;) {
            char *nl = strchr(l, '\n');
            if (strncmp(l, "end ", 4) && strncmp(l, "created_unix ", 13) && (r == 0 || !strncmp(l, "entry ", 6) || !strncmp(l, "file ", 5)))
                fwrite(l, 1, (size_t)(nl + 1 - l), f);
            l = nl + 1;
        }
        free(text);
    }
    for (int r = 0; r < world; r++) {
        snprintf(path, sizeof path, "%s/%s%d/step_00000005/rank%05d.bin", tmp, name, r, r);
        size_t len;
        char *bin = kiln_read_file(path, &len);
        fprintf(f, "%s@@rank%05d.bin\n", r ? "\n" : "", r);
        fwrite(bin, 1, len, f);
        free(bin);
    }
    fclose(f);
    put("manifest", name, pack, n);
    free(pack);
}

/* ---- an llm.c file of fuzz_llmc's model: GPT-2, 1 layer, 8 wide, context 8, vocabulary 16 (64 padded) ---- */
static void llmc_seeds(void) {
    const int maxT = 8, V = 16, L = 1, NH = 2, C = 8, Vp = 64;
    size_t total = (size_t)Vp * C + (size_t)maxT * C + 2 * C + (size_t)L * (C + C + 3 * C * C + 3 * C + C * C + C + C + C + 4 * C * C + 4 * C + 4 * C * C + C);
    size_t n = 1024 + total * 4;
    unsigned char *b = xcalloc(n, 1);
    int32_t h[256] = {20240326, 3, maxT, V, L, NH, C, Vp};
    memcpy(b, h, sizeof h);
    for (size_t i = 0; i < total; i++) {
        float v = (float)((int)(i % 17) - 8) * 0.01f;
        memcpy(b + 1024 + 4 * i, &v, 4);
    }
    put("llmc", "gpt2_tiny.bin", b, n);
    put("llmc", "header_only.bin", b, 1024);
    h[1] = 1; /* version 1: the bf16 files llm.c also writes */
    memcpy(b, h, sizeof h);
    put("llmc", "version_1.bin", b, n);
    free(b);
}

int main(int argc, char **argv) {
    if (argc < 2) kiln_fail(2, "usage: seeds OUT_DIR [--big DIR]");
    snprintf(out, sizeof out, "%s", argv[1]);
    char tmp[1200];
    snprintf(tmp, sizeof tmp, "%s/.seeds-tmp", out);
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    if (system(cmd) != 0) return 1;

    /* config: the ready configs, and overrides */
    put_file("config", "tiny.yaml", "configs/tiny.yaml", 1 << 20);
    put_file("config", "llama-tiny.yaml", "configs/llama-tiny.yaml", 1 << 20);
    put_file("config", "moe-tiny.yaml", "configs/moe-tiny.yaml", 1 << 20);
    static const char sets[] = "--set\nmodel.n_layer=2\noptim.betas=[0.9, 0.99]\ndata.train=[{path: \"a/*.bin\", "
                               "weight: 2, name: a}, \"b/*.bin\"]\nschedule.kind=wsd\nparallel.tp=2\n";
    put("config", "sets.txt", sets, sizeof sets - 1);

    /* shards: byte ids, ids up to 50,000 (uint16), one id past 65,535 (uint32), zstd */
    uint32_t tok[40];
    for (int i = 0; i < 40; i++) tok[i] = (uint32_t)(i * 7 % 256);
    char path[1400];
    snprintf(path, sizeof path, "%s/shard", out);
    kiln_mkdirs(path);
    snprintf(path, sizeof path, "%s/shard/bytes.bin", out);
    shard_write(path, tok, 40, 0);
    snprintf(path, sizeof path, "%s/shard/bytes.bin.zst", out);
    shard_write(path, tok, 40, 3);
    for (int i = 0; i < 40; i++) tok[i] = (uint32_t)(i * 1237 % 50000);
    snprintf(path, sizeof path, "%s/shard/gpt2.bin", out);
    shard_write(path, tok, 40, 0);
    tok[7] = 70000;
    snprintf(path, sizeof path, "%s/shard/wide.bin", out);
    shard_write(path, tok, 40, 0);

    /* checkpoints */
    for (int i = 0; i < 96; i++) w[i] = (float)i * 0.25f - 4, m[i] = (float)i * 1e-3f;
    ckpt_seed("one_rank", tmp, 1, 0, 0);
    ckpt_seed("zstd", tmp, 1, 3, 0);
    ckpt_seed("two_ranks", tmp, 2, 0, 0);
    ckpt_seed("tp_boxes", tmp, 2, 0, 1);

    llmc_seeds();

    /* safetensors: one tensor of each dtype */
    float v[6] = {1, -2, 0.5f, 3e-3f, -7, 1e4f};
    StWrite st[3] = {{"w", ST_F32, 2, {2, 3}, v}, {"b", ST_BF16, 1, {4}, v}, {"h", ST_F16, 2, {2, 2}, v}};
    char err[512];
    snprintf(path, sizeof path, "%s/safetensors", out);
    kiln_mkdirs(path);
    snprintf(path, sizeof path, "%s/safetensors/three.safetensors", out);
    if (st_write(path, st, 3, err, sizeof err) != 0) kiln_fail(1, "%s", err);

    /* rank files: the format, a few lines (the loader wants GPT-2's 50,256) */
    static const char ranks[] = "IQ== 0\nIg== 1\nIw== 2\nIHRoZQ== 3\naGVsbG8= 4\n";
    put("tiktoken", "five.tiktoken", ranks, sizeof ranks - 1);

    /* texts */
    put_file("pretok", "austen.txt", "data/austen.txt", 2048);
    static const char uni[] = "caf\xc3\xa9 na\xc3\xafve \xe2\x80\x94 \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x98\x80 "
                              "e\xcc\x81 \xd9\xa3\xd9\xa4 \xe2\x85\xa7 \xc2\xa0x\xe2\x80\x83y\n";
    put("pretok", "unicode.txt", uni, sizeof uni - 1);
    static const char mix[] = "don't I'll we've they're she'd   \t\n\n  x 123 4567 12345678 $100.00 'quoted' "
                              "\xff\xfe\xc3 \xe2\x82 \xed\xa0\x80 end  ";
    put("pretok", "mixed.txt", mix, sizeof mix - 1);

    if (argc == 4 && !strcmp(argv[2], "--big")) {
        /* every byte and then byte pairs: 50,256 ranks that load */
        static const char A[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        char *big = xmalloc(50256 * 16);
        size_t o = 0;
        for (int r = 0; r < 50256; r++) {
            unsigned char t[2] = {(unsigned char)(r < 256 ? r : (r - 256) / 256), (unsigned char)((r - 256) % 256)};
            int nb = r < 256 ? 1 : 2;
            uint32_t x = (uint32_t)t[0] << 16 | (nb > 1 ? (uint32_t)t[1] << 8 : 0);
            o += (size_t)sprintf(big + o, "%c%c%c%c %d\n", A[x >> 18 & 63], A[x >> 12 & 63],
                                 nb > 1 ? A[x >> 6 & 63] : '=', '=', r);
        }
        snprintf(out, sizeof out, "%s", argv[3]);
        put(".", "gpt2_sized.tiktoken", big, o);
        free(big);
    }
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    return system(cmd) != 0;
}
