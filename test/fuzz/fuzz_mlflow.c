/* fuzz_mlflow: kiln's MLflow file-store writer (src/mlflow.c) on a store and
 * a run directory someone else may have left or damaged: mlflow_open (find
 * the experiment, or on a resume reopen the run RUN_DIR/mlflow.json names and
 * cut its metric files past the resumed step), then what a run does with it
 * (metrics, a flush, tags, an artifact copied and one made in place,
 * mlflow_end, mlflow_close). The input:
 *   HOW   first byte: 'f' a fresh run (start_step 0), 'r' a resume from step 4,
 *         else its value mod 8 is start_step (0: fresh)
 *   \n@@@NAME\nBYTES  files (fuzz.h, fuzz_unpack) of U = fuzz_tmp()/a/b:
 *         store/ the MLflow store (metrics.mlflow), run/ kiln's run directory
 *         (run/mlflow.json; "@STORE@" in it becomes the store's absolute path,
 *         which a resume compares), out/ files beside them. A file NAME.lnk
 *         becomes a symbolic link NAME to U/out (its first byte 'd') or to
 *         U/out/f: a store whose files or directories lead outside it.
 * Must hold: no crash, hang or sanitizer report; a refusal is one error line
 * with exit 2, or exit 1 for the store's own write failures ("metrics.mlflow:
 * PATH: ...", KILN_EXIT_RUNTIME, mlflow.h); and nothing outside U/store and
 * U/run/mlflow.json is created, changed or removed (the parent compares a
 * listing of fuzz_tmp() from before and after each input and aborts). Runs in
 * a child. KILN_FUZZ_MLFLOW_SHOW=1 with one input runs it here. The seeds
 * come from real runs: test/fuzz/mlflow_seeds.sh. */
#include "fuzz.h"
#include "mlflow.h"

#define EXPERIMENT "kiln-fuzz" /* mlflow_seeds.sh's metrics.mlflow_experiment */

static char U[400], store[450], run_dir[450], out_dir[450], src[450];
static int start_step;

/* The store's write failures are exit 1 by design (mlflow.h); fuzz_fork
 * takes 0 or 2, so they come back as 2. Any other exit 1 (out of memory)
 * stays a finding. */
FUZZ_NOCOV static void child_fail(int code, const char *message) {
    if (code == KILN_EXIT_RUNTIME && message && !strncmp(message, "metrics.mlflow: ", 16)) code = KILN_EXIT_USAGE;
    fuzz_child_fail(code, message);
}

static void run(const uint8_t *d, size_t n) {
    (void)d, (void)n;
    if (fuzz_shm) kiln_set_fail_hook(child_fail);
    MlflowOptions o = {.store = store, .experiment = EXPERIMENT, .run_dir = run_dir, .run_name = "fuzz",
                       .config_yaml = "model:\n  n_layer: 2\noptim:\n  lr: 0.001\n", .host = "fuzzhost",
                       .start_step = start_step};
    Mlflow *m = mlflow_open(&o);
    for (int s = start_step + 1; s <= start_step + 3; s++) {
        mlflow_log(m, "loss", 5.5 - s, s);
        mlflow_log(m, "val_loss", s == start_step + 2 ? 1.0 / 0.0 : 0.5, s); /* non-finite: left out */
        mlflow_log(m, "lr", 1e-3, s);
        mlflow_flush(m);
    }
    mlflow_tag(m, "kiln.exit_code", "0");
    mlflow_artifact(m, src, "summary.json");
    /* made in place, as report_write_html makes report.html */
    kiln_write_file_atomic(mlflow_artifact_path(m, "report.html"), "<html></html>\n", 14);
    mlflow_end(m, 0);
    mlflow_close(m);
}

/* "@STORE@" in run/mlflow.json becomes the store's absolute path. */
FUZZ_NOCOV static void put_store(void) {
    char path[600];
    snprintf(path, sizeof path, "%s/mlflow.json", run_dir);
    size_t len;
    char *t = fuzz_read_regular(path, &len);
    if (!t) return;
    FILE *f = fopen(path, "wb");
    for (char *p = t; f && *p;) {
        char *at = strstr(p, "@STORE@");
        if (!at) {
            fputs(p, f);
            break;
        }
        fwrite(p, 1, (size_t)(at - p), f), fputs(store, f);
        p = at + 7;
    }
    if (f) fclose(f);
    free(t);
}

/* Every NAME.lnk under dir becomes a link NAME to out_dir or out_dir/f (only
 * there: the fuzzer runs as whoever runs it, and a link it chose could lead
 * a bug to any file). The store's root is left alone: a store that is a link
 * is the user's own choice, resolved by realpath. */
FUZZ_NOCOV static void make_links(const char *dir) {
    DIR *dd = opendir(dir);
    if (!dd) return;
    struct dirent *e;
    while ((e = readdir(dd))) {
        if (e->d_name[0] == '.' && (!e->d_name[1] || !strcmp(e->d_name, ".."))) continue;
        char p[1200];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        struct stat st;
        if (lstat(p, &st) != 0) continue;
        if (S_ISDIR(st.st_mode)) {
            make_links(p);
            continue;
        }
        size_t l = strlen(p);
        if (!S_ISREG(st.st_mode) || l < 5 || strcmp(p + l - 4, ".lnk")) continue;
        FILE *f = fopen(p, "rb");
        int c = f ? fgetc(f) : EOF;
        if (f) fclose(f);
        unlink(p);
        p[l - 4] = 0;
        if (!strcmp(p, store)) continue;
        char to[600];
        snprintf(to, sizeof to, c == 'd' ? "%s" : "%s/f", out_dir);
        if (lstat(p, &st) == 0) continue; /* NAME is there already */
        if (symlink(to, p) != 0) continue;
    }
    closedir(dd);
}

/* A listing of dir's tree (no link followed): each path, its kind, and for
 * files and links their size and mtime, for directories their mtime but for
 * U and run/, which gain mlflow.json's temporary file and the store. The
 * store's tree and run/mlflow.json are kiln's to write. */
static char *listing;
static size_t listing_len;

FUZZ_NOCOV static void list_tree(FILE *o, const char *dir) {
    DIR *dd = opendir(dir);
    if (!dd) return;
    struct dirent *e;
    char names[64][256];
    int k = 0;
    while ((e = readdir(dd)) && k < 64) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        kiln_strlcpy(names[k++], e->d_name, sizeof names[0]);
    }
    closedir(dd);
    qsort(names, (size_t)k, sizeof names[0], (int (*)(const void *, const void *))strcmp);
    for (int i = 0; i < k; i++) {
        char p[1200];
        snprintf(p, sizeof p, "%s/%s", dir, names[i]);
        if (!strcmp(p, store)) continue;
        if (!strncmp(p, run_dir, strlen(run_dir)) && !strcmp(p + strlen(run_dir), "/mlflow.json")) continue;
        struct stat st;
        if (lstat(p, &st) != 0) continue;
        int dirish = S_ISDIR(st.st_mode);
        int quiet = dirish && (!strcmp(p, U) || !strcmp(p, run_dir));
        fprintf(o, "%s %o %lld %lld.%09ld\n", p, (unsigned)st.st_mode, dirish ? 0LL : (long long)st.st_size,
                quiet ? 0LL : (long long)st.st_mtim.tv_sec, quiet ? 0L : st.st_mtim.tv_nsec);
        if (dirish) list_tree(o, p);
    }
}

FUZZ_NOCOV static char *snapshot(size_t *len) {
    char *t = NULL;
    FILE *o = open_memstream(&t, len);
    list_tree(o, fuzz_tmp());
    fclose(o);
    return t;
}

FUZZ_NOCOV static void prepare(const uint8_t *d, size_t n) {
    char ab[450];
    snprintf(ab, sizeof ab, "%s/a", fuzz_tmp());
    snprintf(U, sizeof U, "%s/a/b", fuzz_tmp());
    snprintf(store, sizeof store, "%s/store", U);
    snprintf(run_dir, sizeof run_dir, "%s/run", U);
    snprintf(out_dir, sizeof out_dir, "%s/out", U);
    snprintf(src, sizeof src, "%s/summary.json", fuzz_tmp());
    mkdir(ab, 0700);
    fuzz_unpack(U, n ? d + 1 : d, n ? n - 1 : 0);
    mkdir(run_dir, 0700); /* metrics.c makes the run directory before mlflow_open */
    put_store();
    make_links(U);
    struct stat st;
    if (stat(src, &st) != 0) fuzz_file("summary.json", "{\"status\": \"completed\"}\n", 24);
    int how = n ? d[0] : 'f';
    start_step = how == 'f' ? 0 : how == 'r' ? 4 : how % 8;
}

FUZZ_NOCOV static void check_outside(void) {
    size_t len;
    char *after = snapshot(&len);
    if (len == listing_len && !memcmp(after, listing, len)) {
        free(after);
        return;
    }
    fprintf(stderr, "fuzz: the MLflow writer changed files outside %s and %s/mlflow.json\nbefore:\n%s\nafter:\n%s",
            store, run_dir, listing, after);
    abort();
}

FUZZ_NOCOV int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {
    prepare(d, n);
    free(listing);
    listing = snapshot(&listing_len);
    fuzz_run(run, d, n, "KILN_FUZZ_MLFLOW_SHOW");
    check_outside();
    return 0;
}
