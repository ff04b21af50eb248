/* fuzz_manifest: a checkpoint directory: the manifest (this input up to the
 * first "\n@@NAME\n" line) and the files after each such line (rank00000.bin,
 * ...). The manifest's "end crc32c=" line is resealed here, as someone who
 * edits a manifest would, so that what follows it is parsed rather than
 * refused as damage. Then: verify every piece, read the config.yaml blob, load
 * a whole table and a tensor-parallel box of it, list the folder. ckpt never
 * exits on bad input: each refusal is one line in err, checked here. */
#include <dirent.h>

#include "ckpt.h"
#include "fuzz.h"

FUZZ_NOCOV int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n);

/* dir emptied (it holds plain files only), or made with its parent. */
static void clear_dir(const char *dir) {
    DIR *dd = opendir(dir);
    if (!dd) {
        char parent[600];
        snprintf(parent, sizeof parent, "%s", dir);
        *strrchr(parent, '/') = 0;
        if ((mkdir(parent, 0700) != 0 && errno != EEXIST) || mkdir(dir, 0700) != 0) abort();
        return;
    }
    struct dirent *e;
    char path[700];
    while ((e = readdir(dd)))
        if (e->d_name[0] != '.') snprintf(path, sizeof path, "%s/%s", dir, e->d_name), unlink(path);
    closedir(dd);
}

/* The input's manifest and files into dir. */
static void write_dir(const char *dir, const uint8_t *d, size_t n) {
    clear_dir(dir);
    const uint8_t *at = n >= 3 && !memcmp(d, "@@", 2) ? d - 1 : memmem(d, n, "\n@@", 3);
    size_t mlen = at ? (size_t)(at + 1 - d) : n;
    /* reseal: drop a last line that starts with "end ", append the right one */
    size_t body = mlen;
    while (body > 0 && d[body - 1] != '\n') body--;
    if (body < mlen && mlen - body >= 4 && !memcmp(d + body, "end ", 4)) mlen = body;
    char *man = xmalloc(mlen + 32);
    memcpy(man, d, mlen);
    if (mlen && man[mlen - 1] != '\n') man[mlen++] = '\n';
    mlen += (size_t)sprintf(man + mlen, "end crc32c=%08x\n", ckpt_crc32c(0, man, mlen));
    char path[700];
    snprintf(path, sizeof path, "%s/manifest", dir);
    FILE *f = fopen(path, "wb");
    fwrite(man, 1, mlen, f);
    fclose(f);
    free(man);
    while (at) { /* "\n@@NAME\n" then the file's bytes up to the next such line */
        const uint8_t *name = at + 3, *end = d + n;
        const uint8_t *nl = memchr(name, '\n', (size_t)(end - name));
        if (!nl) break;
        size_t nn = (size_t)(nl - name);
        const uint8_t *next = memmem(nl + 1, (size_t)(end - nl - 1), "\n@@", 3);
        const uint8_t *stop = next ? next : end;
        char fname[40];
        int good = nn > 0 && nn < sizeof fname;
        for (size_t i = 0; good && i < nn; i++) good = (name[i] >= 'a' && name[i] <= 'z') || (name[i] >= '0' && name[i] <= '9') || name[i] == '.';
        if (good) {
            memcpy(fname, name, nn), fname[nn] = 0;
            snprintf(path, sizeof path, "%s/%s", dir, fname);
            f = fopen(path, "wb");
            fwrite(nl + 1, 1, (size_t)(stop - nl - 1), f);
            fclose(f);
        }
        at = next;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {
    char root[400], dir[500], err[2048];
    snprintf(root, sizeof root, "%s/checkpoints", fuzz_tmp());
    snprintf(dir, sizeof dir, "%s/step_00000005", root);
    write_dir(dir, d, n);
    CkptInfo info;
    if (ckpt_verify(dir, &info, err, sizeof err) != 0) fuzz_check_err("ckpt_verify", err);
    size_t len = 0;
    void *blob = ckpt_read_blob(dir, "config.yaml", &len, err, sizeof err);
    if (!blob) fuzz_check_err("ckpt_read_blob", err);
    else if (((char *)blob)[len] != 0) abort(); /* text blobs end in a NUL */
    free(blob);
    /* the entries of the seed checkpoints (test/fuzz/seeds.c) */
    static float w[96], part[48], m[96];
    static int64_t step;
    static uint64_t rng[4];
    int64_t shape[2] = {8, 12};
    CkptTable t;
    ckpt_table_init(&t);
    ckpt_add_tensor(&t, "w", CKPT_F32, 2, shape, 0, 96, w, NULL, NULL);
    ckpt_add_tensor(&t, "optim.m/w", CKPT_F32, 2, shape, 10, 90, m, NULL, NULL);
    ckpt_add_blob(&t, "train.step", CKPT_I64, 1, 1, &step);
    ckpt_add_blob(&t, "rng.train", CKPT_U64, 4, 0, rng);
    if (ckpt_load(dir, &t, &info, err, sizeof err) != 0) fuzz_check_err("ckpt_load", err);
    ckpt_table_free(&t);
    ckpt_table_init(&t); /* tp rank 1 of 2 over columns: columns 6..12 of every row, from any layout */
    CkptEntry *e = ckpt_add_tensor(&t, "w", CKPT_F32, 2, shape, 0, 48, part, NULL, NULL);
    ckpt_entry_set_box(e, 0, 8, 6, 12);
    if (ckpt_load(dir, &t, &info, err, sizeof err) != 0) fuzz_check_err("ckpt_load (box)", err);
    ckpt_table_free(&t);
    char **paths;
    int64_t *steps;
    int k = ckpt_list_current(root, &paths, &steps);
    ckpt_list_free(paths, steps, k);
    return 0;
}
