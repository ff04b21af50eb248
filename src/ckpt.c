/* ckpt: the table of entries, listing checkpoint directories, and writing
 * them: a table to root/step_N.tmp/ (this rank's file streamed through
 * ckpt_io's sink, CRC32C per entry), every file and the directory fsynced,
 * renamed to root/step_N/, root/latest replaced atomically, then pruned.
 * Reading is ckpt_read.c's. Knows the table and the mesh, never the model,
 * the optimizer or the backend (copies go through the entries' own to_host). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "ckpt.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zstd.h>

#include "ckpt_io.h"
#include "util.h"

#define CKPT_CRC_BLOCK ((size_t)512 << 10) /* copied, then checksummed while it is in the cache */

/* ---------- the table ---------- */

static const char *dtype_names[] = {"f32", "f64", "i64", "u64", "u8"};
static const size_t dtype_sizes[] = {4, 8, 8, 8, 1};

size_t ckpt_dtype_size(CkptDtype d) { return dtype_sizes[d]; }
const char *ckpt_dtype_name(CkptDtype d) { return dtype_names[d]; }

void ckpt_table_init(CkptTable *t) { memset(t, 0, sizeof *t); }
void ckpt_table_free(CkptTable *t) {
    free(t->e);
    memset(t, 0, sizeof *t);
}

size_t ckpt_entry_bytes(const CkptEntry *e) { return (size_t)(e->hi - e->lo) * dtype_sizes[e->dtype]; }

static CkptEntry *table_push(CkptTable *t, const char *name) {
    if (strlen(name) >= CKPT_NAME || strpbrk(name, " \t\n=") || !*name)
        kiln_fail(KILN_EXIT_RUNTIME, "checkpoint entry name '%s' is empty, too long or has a space or '='", name);
    /* one entry per name, except the boxes of one tensor's tensor-parallel parts */
    for (int i = 0; i < t->n; i++)
        if (!strcmp(t->e[i].name, name) && !t->e[i].r1)
            kiln_fail(KILN_EXIT_RUNTIME, "checkpoint entry '%s' added twice", name);
    if (t->n == t->cap) {
        t->cap = t->cap ? 2 * t->cap : 64;
        t->e = xrealloc(t->e, (size_t)t->cap * sizeof *t->e);
    }
    CkptEntry *e = &t->e[t->n++];
    memset(e, 0, sizeof *e);
    memcpy(e->name, name, strlen(name) + 1);
    return e;
}

CkptEntry *ckpt_add_tensor(CkptTable *t, const char *name, CkptDtype dtype, int ndim, const int64_t *shape,
                           uint64_t lo, uint64_t hi, void *ptr, CkptCopyFn to_host, CkptCopyFn to_device) {
    CkptEntry *e = table_push(t, name);
    e->kind = CKPT_TENSOR;
    e->dtype = dtype;
    e->ndim = ndim;
    uint64_t numel = 1;
    for (int i = 0; i < ndim; i++) e->shape[i] = shape[i], numel *= (uint64_t)shape[i];
    if (lo > hi || hi > numel) kiln_fail(KILN_EXIT_RUNTIME, "checkpoint entry '%s': range [%llu, %llu) outside %llu elements",
                                         name, (unsigned long long)lo, (unsigned long long)hi, (unsigned long long)numel);
    e->lo = lo, e->hi = hi;
    e->ptr = ptr;
    e->to_host = to_host, e->to_device = to_device;
    return e;
}

void ckpt_tensor_rc(int ndim, const int64_t *shape, uint64_t *rows, uint64_t *cols) {
    *rows = ndim ? (uint64_t)shape[0] : 1;
    *cols = 1;
    for (int d = 1; d < ndim; d++) *cols *= (uint64_t)shape[d];
}

void ckpt_entry_set_box(CkptEntry *e, uint64_t r0, uint64_t r1, uint64_t c0, uint64_t c1) {
    uint64_t rows, cols;
    ckpt_tensor_rc(e->ndim, e->shape, &rows, &cols);
    if (r0 >= r1 || c0 >= c1 || r1 > rows || c1 > cols || e->hi > (r1 - r0) * (c1 - c0))
        kiln_fail(KILN_EXIT_RUNTIME, "checkpoint entry '%s': box rows [%llu, %llu) x columns [%llu, %llu) with range "
                  "[%llu, %llu) does not fit its %llu x %llu tensor", e->name, (unsigned long long)r0,
                  (unsigned long long)r1, (unsigned long long)c0, (unsigned long long)c1, (unsigned long long)e->lo,
                  (unsigned long long)e->hi, (unsigned long long)rows, (unsigned long long)cols);
    if (r0 == 0 && r1 == rows && c0 == 0 && c1 == cols) r1 = c1 = 0; /* the whole tensor */
    e->r0 = r0, e->r1 = r1, e->c0 = c0, e->c1 = c1;
}

CkptEntry *ckpt_add_blob(CkptTable *t, const char *name, CkptDtype dtype, size_t count, int scalar, void *ptr) {
    CkptEntry *e = table_push(t, name);
    e->kind = CKPT_BLOB;
    e->dtype = dtype;
    e->ndim = scalar ? 0 : 1;
    e->shape[0] = scalar ? 1 : (int64_t)count;
    e->lo = 0, e->hi = scalar ? 1 : count;
    e->ptr = ptr;
    return e;
}

/* ---------- small file-system helpers ---------- */

static int fsync_dir(const char *path) {
    int fd = open(path, O_RDONLY | O_DIRECTORY);
    if (fd < 0) return -1;
    int rc = fsync(fd);
    close(fd);
    return rc;
}

static int rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}
static int rm_rf(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return errno == ENOENT ? 0 : -1;
    return nftw(path, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

/* "step_00001000" -> 1000; -1 unless the name is exactly that form. */
static int64_t parse_step_name(const char *name) {
    if (strncmp(name, "step_", 5)) return -1;
    const char *p = name + 5;
    if (!*p) return -1;
    int64_t v = 0;
    for (; *p; p++) {
        if (*p < '0' || *p > '9' || v > INT64_MAX / 10 - 10) return -1;
        v = v * 10 + (*p - '0');
    }
    return v;
}

typedef struct {
    char *path;
    int64_t step;
} StepDir;
static int stepdir_desc(const void *a, const void *b) {
    int64_t x = ((const StepDir *)a)->step, y = ((const StepDir *)b)->step;
    return x < y ? 1 : x > y ? -1 : 0;
}

int ckpt_list(const char *root, char ***paths, int64_t **steps) {
    *paths = NULL, *steps = NULL;
    DIR *d = opendir(root);
    if (!d) return 0;
    StepDir *v = NULL;
    int n = 0, cap = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        int64_t s = parse_step_name(de->d_name);
        if (s < 0) continue;
        char p[2048];
        snprintf(p, sizeof p, "%s/%s", root, de->d_name);
        struct stat st;
        if (stat(p, &st) != 0 || !S_ISDIR(st.st_mode)) continue;
        if (n == cap) cap = cap ? 2 * cap : 16, v = xrealloc(v, (size_t)cap * sizeof *v);
        v[n].path = xstrdup(p);
        v[n++].step = s;
    }
    closedir(d);
    if (n > 1) qsort(v, (size_t)n, sizeof *v, stepdir_desc); /* qsort(NULL, 0, ...) is undefined */
    *paths = xmalloc((size_t)(n ? n : 1) * sizeof(char *));
    *steps = xmalloc((size_t)(n ? n : 1) * sizeof(int64_t));
    for (int i = 0; i < n; i++) (*paths)[i] = v[i].path, (*steps)[i] = v[i].step;
    free(v);
    return n;
}

int ckpt_list_current(const char *root, char ***paths, int64_t **steps) {
    int n = ckpt_list(root, paths, steps);
    char path[2048];
    snprintf(path, sizeof path, "%s/latest", root);
    char *text = kiln_read_file_max(path, KILN_SMALL_FILE_MAX, NULL);
    if (!text) return n;
    text[strcspn(text, "\r\n")] = '\0';
    int64_t last = parse_step_name(text);
    free(text);
    if (last < 0) return n;
    /* Directories above `latest` belong to another timeline (an earlier run
     * in this directory, or steps past an older checkpoint resumed with
     * --resume DIR): drop them, keeping the newest-first order of the rest. */
    int k = 0;
    for (int i = 0; i < n; i++) {
        if ((*steps)[i] > last) {
            free((*paths)[i]);
            continue;
        }
        (*paths)[k] = (*paths)[i];
        (*steps)[k++] = (*steps)[i];
    }
    return k;
}

void ckpt_list_free(char **paths, int64_t *steps, int n) {
    for (int i = 0; i < n; i++) free(paths[i]);
    free(paths);
    free(steps);
}

/* ---------- writing ---------- */

typedef struct {
    uint64_t offset, stored; /* where the piece lies in the rank file, bytes there */
    uint32_t crc;            /* CRC32C of the uncompressed bytes */
} PieceRec;

struct CkptWriter {
    CkptTable t;          /* copy of the entries (pointers into live state) */
    CkptOptions o;
    unsigned char *stage; /* async: every entry's bytes, back to back in table order: uncompressed,
                             the rank file's image (CKPT_IO_ALIGN-aligned, padded to a block) */
    size_t *stage_off;    /* (t.n) */
    size_t stage_cap;
    pthread_t toucher;    /* faults the stage's pages in after ckpt_writer_new */
    int touching;
    unsigned char *bounce;/* zstd: CKPT_IO_CHUNK of device -> host copies; else one element */
    ZSTD_CCtx *zc;
    CkptSink *sink;       /* the rank file's writer: aligned chunks from a thread */
    PieceRec *rec;        /* (t.n) */
    CkptMeta meta;
    char version[64], commit[64];
    pthread_t thread;
    int in_flight, status, swept;
    atomic_int thread_done; /* set by the writer thread as it ends */
    int no_thread;        /* the write in flight ran on the main thread (no thread could start) */
    char *mtext;          /* this rank's manifest text, between write and complete */
    size_t mlen;
    char err[1536];
    /* small files (manifests) */
    int fd;
    uint64_t pos;         /* bytes of the rank file */
    uint64_t fault_after; /* KILN_FAULT_ENOSPC_AFTER: fail a write past this many bytes (tests) */
    uint64_t fault_total;
    CkptStats cur, last;  /* the save in progress, the last one completed */
    double t_write;       /* kiln_now() when this rank's write began */
};

static void werr(CkptWriter *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void werr(CkptWriter *w, const char *fmt, ...) {
    if (w->status) return; /* keep the first cause */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->err, sizeof w->err, fmt, ap);
    va_end(ap);
    w->status = -1;
}

static void *w_touch(void *arg) {
    CkptWriter *w = arg;
    memset(w->stage, 0, w->stage_cap);
    return NULL;
}

static void w_touched(CkptWriter *w) {
    if (w->touching) pthread_join(w->toucher, NULL);
    w->touching = 0;
}

CkptWriter *ckpt_writer_new(const CkptTable *t, const CkptOptions *o) {
    CkptWriter *w = xcalloc(1, sizeof *w);
    w->t.n = w->t.cap = t->n;
    w->t.e = xmalloc((size_t)(t->n ? t->n : 1) * sizeof *t->e);
    memcpy(w->t.e, t->e, (size_t)t->n * sizeof *t->e);
    w->o = *o;
    w->rec = xcalloc((size_t)(t->n ? t->n : 1), sizeof *w->rec);
    if (o->async) {
        size_t total = 0;
        w->stage_off = xmalloc((size_t)(t->n ? t->n : 1) * sizeof(size_t));
        for (int i = 0; i < t->n; i++) w->stage_off[i] = total, total += ckpt_entry_bytes(&t->e[i]);
        /* aligned and padded: the sink writes the file straight from it */
        size_t cap = (total + CKPT_IO_ALIGN) / CKPT_IO_ALIGN * CKPT_IO_ALIGN;
        void *p = NULL;
        if (posix_memalign(&p, CKPT_IO_ALIGN, cap) != 0)
            kiln_fail(KILN_EXIT_RUNTIME, "out of memory for the checkpoint staging buffer (%zu MiB)", cap >> 20);
        w->stage = p, w->stage_cap = cap;
        /* touched before the first save, so that save does not pay for the
         * page faults; on a thread of its own, so that start-up does not either */
        sigset_t all, prev;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &prev);
        w->touching = pthread_create(&w->toucher, NULL, w_touch, w) == 0;
        pthread_sigmask(SIG_SETMASK, &prev, NULL);
        if (!w->touching) memset(w->stage, 0, cap);
    }
    w->bounce = xmalloc(o->compress > 0 ? CKPT_IO_CHUNK : 16);
    if (o->compress > 0) {
        w->zc = ZSTD_createCCtx();
        if (!w->zc) kiln_fail(KILN_EXIT_RUNTIME, "ZSTD_createCCtx failed");
        ZSTD_CCtx_setParameter(w->zc, ZSTD_c_compressionLevel, o->compress);
        /* several workers compress each large entry's frame in parallel;
         * a libzstd built without threads refuses and compresses on this one */
        if (o->threads > 1 && ZSTD_isError(ZSTD_CCtx_setParameter(w->zc, ZSTD_c_nbWorkers, o->threads)))
            ZSTD_CCtx_setParameter(w->zc, ZSTD_c_nbWorkers, 0);
    }
    w->sink = ckpt_sink_new(4);
    const char *f = getenv("KILN_FAULT_ENOSPC_AFTER");
    if (f && *f) w->fault_after = strtoull(f, NULL, 10) + 1;
    w->fd = -1;
    w->last.step = -1;
    return w;
}

const char *ckpt_writer_error(const CkptWriter *w) { return w->err; }
CkptStats ckpt_writer_stats(const CkptWriter *w) { return w->last; }

/* Small files: plain writes, counted against the fault budget. */
static int w_write(CkptWriter *w, const void *buf, size_t n) {
    const char *p = buf;
    while (n > 0) {
        size_t k = n;
        if (w->fault_after && w->fault_total + k >= w->fault_after) {
            errno = ENOSPC;
            return -1;
        }
        ssize_t r = write(w->fd, p, k);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += r, n -= (size_t)r, w->fault_total += (uint64_t)r;
    }
    return 0;
}

/* Bytes [off, off + len) of entry i's checkpoint side into dst: through
 * to_host (which may convert: off and len are then whole elements), or
 * from host memory. */
static void w_copy(const CkptEntry *e, unsigned char *dst, size_t off, size_t len) {
    size_t mem_off = e->mem_size ? off / dtype_sizes[e->dtype] * e->mem_size : off;
    const unsigned char *src = (const unsigned char *)e->ptr + mem_off;
    if (e->to_host) e->to_host(dst, src, len);
    else memcpy(dst, src, len);
}

/* w_copy, checksummed block by block while each block is in the cache. */
static uint32_t w_copy_crc(const CkptEntry *e, unsigned char *dst, size_t off, size_t len, uint32_t crc) {
    size_t block = CKPT_CRC_BLOCK - CKPT_CRC_BLOCK % dtype_sizes[e->dtype];
    for (size_t k = 0; k < len; k += block) {
        size_t n = len - k < block ? len - k : block;
        w_copy(e, dst + k, off + k, n);
        crc = ckpt_crc32c(crc, dst + k, n);
    }
    return crc;
}

/* An entry's frame: its bytes (staged, or copied through the bounce
 * buffer) compressed straight into the sink's buffers. */
static int w_entry_zstd(CkptWriter *w, int i) {
    const CkptEntry *e = &w->t.e[i];
    PieceRec *r = &w->rec[i];
    size_t bytes = ckpt_entry_bytes(e), off = 0;
    ZSTD_CCtx_reset(w->zc, ZSTD_reset_session_only);
    ZSTD_CCtx_setPledgedSrcSize(w->zc, bytes);
    do {
        size_t len = bytes - off < CKPT_IO_CHUNK ? bytes - off : CKPT_IO_CHUNK; /* whole elements */
        const unsigned char *src;
        if (w->stage) src = w->stage + w->stage_off[i] + off;
        else if (!e->to_host) src = (const unsigned char *)e->ptr + off;
        else w_copy(e, w->bounce, off, len), src = w->bounce;
        r->crc = ckpt_crc32c(r->crc, src, len);
        off += len;
        ZSTD_inBuffer in = {src, len, 0};
        ZSTD_EndDirective mode = off == bytes ? ZSTD_e_end : ZSTD_e_continue;
        for (;;) {
            size_t avail;
            unsigned char *dst = ckpt_sink_space(w->sink, &avail);
            if (!dst) return -1;
            ZSTD_outBuffer out = {dst, avail, 0};
            size_t left = ZSTD_compressStream2(w->zc, &out, &in, mode);
            if (ZSTD_isError(left)) {
                errno = EIO;
                return -1;
            }
            if (ckpt_sink_commit(w->sink, out.pos) != 0) return -1;
            if (mode == ZSTD_e_end ? left == 0 : in.pos == in.size) break;
        }
    } while (off < bytes);
    return 0;
}

/* Entry i into the rank file, its CRC32C and place recorded. Uncompressed
 * and staged, the stage is the file: checksum it and let the sink write it
 * in place; else the bytes are copied into the sink's buffers. */
static int w_entry(CkptWriter *w, int i) {
    const CkptEntry *e = &w->t.e[i];
    size_t bytes = ckpt_entry_bytes(e), es = dtype_sizes[e->dtype];
    PieceRec *r = &w->rec[i];
    r->offset = ckpt_sink_pos(w->sink);
    r->crc = 0;
    if (w->zc) {
        if (w_entry_zstd(w, i) != 0) return -1;
    } else if (w->stage) {
        const unsigned char *p = w->stage + w->stage_off[i];
        for (size_t off = 0; off < bytes;) {
            size_t len = bytes - off < CKPT_IO_CHUNK ? bytes - off : CKPT_IO_CHUNK;
            r->crc = ckpt_crc32c(r->crc, p + off, len);
            off += len;
            if (ckpt_sink_image_ready(w->sink, r->offset + off) != 0) return -1;
        }
    } else {
        for (size_t off = 0; off < bytes;) {
            size_t avail;
            unsigned char *dst = ckpt_sink_space(w->sink, &avail);
            if (!dst) return -1;
            size_t len = bytes - off < avail ? bytes - off : avail;
            if (e->mem_size) len -= len % es; /* a converting copy takes whole elements */
            if (len == 0) {
                /* one element across the buffer's end */
                w_copy(e, w->bounce, off, es);
                r->crc = ckpt_crc32c(r->crc, w->bounce, es);
                if (ckpt_sink_put(w->sink, w->bounce, es) != 0) return -1;
                off += es;
                continue;
            }
            r->crc = w_copy_crc(e, dst, off, len, r->crc);
            if (ckpt_sink_commit(w->sink, len) != 0) return -1;
            off += len;
        }
    }
    r->stored = ckpt_sink_pos(w->sink) - r->offset;
    return 0;
}

static void w_manifest_head(CkptWriter *w, FILE *f) {
    const CkptMeta *m = &w->meta;
    fprintf(f, "kiln-checkpoint %d\n", CKPT_FORMAT_VERSION);
    fprintf(f, "step %" PRId64 "\n", m->step);
    fprintf(f, "config_hash %016" PRIx64 "\n", m->config_hash);
    fprintf(f, "kiln_version %s\n", w->version);
    fprintf(f, "kiln_commit %s\n", w->commit);
    fprintf(f, "created_unix %lld\n", (long long)time(NULL));
    fprintf(f, "mesh world=%d dp=%d tp=%d pp=%d cp=%d ep=%d\n", m->mesh.world, m->mesh.dp, m->mesh.tp, m->mesh.pp,
            m->mesh.cp, m->mesh.ep);
}

/* This rank's file line and one line per piece it wrote. */
static void w_manifest_entries(CkptWriter *w, FILE *f, const char *file, uint64_t file_bytes) {
    const CkptMeta *m = &w->meta;
    fprintf(f, "file %s rank=%d bytes=%" PRIu64 "\n", file, m->mesh.rank, file_bytes);
    for (int i = 0; i < w->t.n; i++) {
        const CkptEntry *e = &w->t.e[i];
        const PieceRec *r = &w->rec[i];
        fprintf(f, "entry name=%s kind=%s dtype=%s shape=[", e->name, e->kind == CKPT_TENSOR ? "tensor" : "blob",
                dtype_names[e->dtype]);
        for (int d = 0; d < e->ndim; d++) fprintf(f, "%s%" PRId64, d ? "," : "", e->shape[d]);
        fprintf(f, "] range=%" PRIu64 ":%" PRIu64, e->lo, e->hi);
        if (e->r1) fprintf(f, " box=%" PRIu64 ":%" PRIu64 ",%" PRIu64 ":%" PRIu64, e->r0, e->r1, e->c0, e->c1);
        fprintf(f, " rank=%d file=%s offset=%" PRIu64 " bytes=%zu stored=%" PRIu64 " codec=%s crc32c=%08x\n",
                m->mesh.rank, file, r->offset, ckpt_entry_bytes(e), r->stored, w->zc ? "zstd" : "none", r->crc);
    }
}

/* Keep the newest keep_last and every milestone; delete the rest. Runs only
 * after the new checkpoint is complete and `latest` names it, so only this
 * timeline's checkpoints (at or below `latest`) count and can be deleted. */
static void w_prune(CkptWriter *w) {
    if (w->o.keep_last <= 0) return;
    char **paths;
    int64_t *steps;
    int n = ckpt_list_current(w->o.root, &paths, &steps);
    for (int i = w->o.keep_last; i < n; i++) {
        if (w->o.keep_every > 0 && steps[i] % w->o.keep_every == 0) continue;
        if (steps[i] == w->meta.step) continue;
        if (rm_rf(paths[i]) != 0) kiln_warn("cannot delete old checkpoint %s: %s", paths[i], strerror(errno));
    }
    ckpt_list_free(paths, steps, n);
}

/* Leftovers of interrupted saves (*.tmp) are never loaded; clear them once. */
static void w_sweep(CkptWriter *w) {
    DIR *d = opendir(w->o.root);
    if (!d) return;
    struct dirent *de;
    while ((de = readdir(d))) {
        size_t l = strlen(de->d_name);
        if (strncmp(de->d_name, "step_", 5) || l < 9 || strcmp(de->d_name + l - 4, ".tmp")) continue;
        char p[2048], fin[2048];
        snprintf(p, sizeof p, "%s/%s", w->o.root, de->d_name);
        /* step_N.old.tmp is a complete checkpoint moved aside for its
         * replacement; if that never landed (killed between the renames),
         * it goes back rather than away */
        struct stat st;
        if (l > 8 && strcmp(de->d_name + l - 8, ".old.tmp") == 0) {
            snprintf(fin, sizeof fin, "%s/%.*s", w->o.root, (int)(l - 8), de->d_name);
            if (stat(fin, &st) != 0 && rename(p, fin) == 0) continue;
        }
        rm_rf(p);
    }
    closedir(d);
}

/* Write `len` bytes to path (created), fsynced. 0 or -1 with werr. */
static int w_small_file(CkptWriter *w, const char *path, const char *text, size_t len, const char *endline) {
    w->fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (w->fd < 0) {
        werr(w, "%s: cannot create: %s", path, strerror(errno));
        return -1;
    }
    int bad = w_write(w, text, len) != 0 || (endline && w_write(w, endline, strlen(endline)) != 0) ||
              fsync(w->fd) != 0;
    int e = errno;
    /* close in every case: an fsync failure must not leak the descriptor */
    if (close(w->fd) != 0 && !bad) bad = 1, e = errno;
    w->fd = -1;
    if (bad) {
        werr(w, "%s: %s", path, strerror(e));
        return -1;
    }
    return 0;
}

/* Several ranks: nonzero if any rank failed (every rank must call it the
 * same number of times). One rank: its own status. */
static int w_agree(CkptWriter *w, int failed) {
    if (w->meta.mesh.world <= 1 || !w->o.agree) return failed;
    return w->o.agree(w->o.agree_ctx, failed);
}

/* A save in three phases. With several ranks each phase ends in an
 * agreement (a collective), so every rank learns of any rank's failure.
 *   begin:    rank 0 makes step_N.tmp/                        (main thread)
 *   write:    every rank writes and fsyncs its rankNNNNN.bin and its part
 *             of the manifest; no communication        (writer thread if async)
 *   complete: rank 0 merges the manifest, renames step_N.tmp -> step_N,
 *             then points `latest` at it and prunes            (main thread)
 * One rank runs all three in the writer thread when async. Several ranks run
 * `write` in the thread and `complete` on the main thread once every rank's
 * write is done (ckpt_pending, ckpt_wait): MPI is initialised FUNNELED, so
 * only the main thread may take part in a collective. */
static void w_names(const CkptWriter *w, char *name, char *tmp, char *fin, char *old) {
    snprintf(name, 64, "step_%08" PRId64, w->meta.step);
    snprintf(tmp, 1200, "%s/%s.tmp", w->o.root, name);
    snprintf(fin, 1200, "%s/%s", w->o.root, name);
    snprintf(old, 1200, "%s/%s.old.tmp", w->o.root, name);
}

/* several ranks write one checkpoint only with an agree callback; without
 * one each writer makes a complete checkpoint of its own pieces (tests) */
static int w_rank(const CkptWriter *w) { return w->o.agree ? w->meta.mesh.rank : 0; }
static int w_multi(const CkptWriter *w) { return w->meta.mesh.world > 1 && w->o.agree; }

static void w_abort(CkptWriter *w, const char *tmp) {
    ckpt_sink_abort(w->sink);
    if (w->fd >= 0) close(w->fd);
    w->fd = -1;
    if (w_rank(w) == 0) rm_rf(tmp);
}

static int w_begin(CkptWriter *w) {
    char name[64], tmp[1200], fin[1200], old[1200];
    w_names(w, name, tmp, fin, old);
    w->fd = -1;
    int failed = 0;
    if (w_rank(w) == 0) {
        if (kiln_mkdirs(w->o.root) != 0) {
            werr(w, "%s: cannot create the checkpoint directory: %s", w->o.root, strerror(errno));
            failed = 1;
        } else {
            if (!w->swept) w_sweep(w), w->swept = 1; /* leftovers of interrupted saves */
            if (rm_rf(tmp) != 0 || mkdir(tmp, 0755) != 0) {
                werr(w, "%s: cannot create: %s", tmp, strerror(errno));
                failed = 1;
            }
        }
    }
    if (w_agree(w, failed)) {
        if (!failed) werr(w, "another rank failed to prepare %s", tmp);
        w_abort(w, tmp);
        return -1;
    }
    return 0;
}

/* A failed write of the rank file, named by the entry whose bytes it held:
 * entries [0, n) were written or being written; in_close: the failure came
 * from ckpt_sink_close (the last writes, the fsync or the close). */
static void w_write_failed(CkptWriter *w, const char *path, int n, int in_close, int e) {
    uint64_t at = ckpt_sink_failed_at(w->sink);
    if (at == UINT64_MAX && in_close) {
        werr(w, "%s: fsync/close: %s", path, strerror(e));
        return;
    }
    int k = n - 1;
    if (at != UINT64_MAX)
        for (int j = 0; j < n; j++)
            if (w->rec[j].offset <= at) k = j;
    werr(w, "%s: writing entry '%s': %s", path, k >= 0 ? w->t.e[k].name : "-", strerror(e));
}

/* This rank's data file, fsynced before any manifest names it, and its part
 * of the manifest (the whole manifest text for one rank, in w->mtext). No
 * collectives: runs in the writer thread. Failure is left in w->status. */
static void w_write_rank(CkptWriter *w) {
    char name[64], tmp[1200], fin[1200], old[1200], path[1400], file[32];
    w_names(w, name, tmp, fin, old);
    snprintf(file, sizeof file, "rank%05d.bin", w->meta.mesh.rank);
    snprintf(path, sizeof path, "%s/%s", tmp, file);
    w->t_write = kiln_now();
    w->pos = 0;
    /* the fault budget left (w_write's: a write past fault_after - 1 bytes in all fails) */
    uint64_t limit = w->fault_after - 1, left = !w->fault_after ? UINT64_MAX
                                                : limit > w->fault_total ? limit - w->fault_total : 0;
    const unsigned char *image = w->stage && !w->zc ? w->stage : NULL;
    if (ckpt_sink_open(w->sink, path, image, left) != 0) {
        werr(w, "%s: cannot create: %s", path, strerror(errno));
        return;
    }
    uint64_t bytes = 0;
    for (int i = 0; i < w->t.n; i++) {
        if (w_entry(w, i) != 0) {
            int e = errno;
            ckpt_sink_abort(w->sink);
            w_write_failed(w, path, i + 1, 0, e);
            return;
        }
        bytes += ckpt_entry_bytes(&w->t.e[i]);
    }
    int rc = ckpt_sink_close(w->sink);
    w->fault_total += ckpt_sink_written(w->sink);
    if (rc != 0) {
        w_write_failed(w, path, w->t.n, 1, errno);
        return;
    }
    w->pos = ckpt_sink_pos(w->sink);
    w->cur.bytes = bytes, w->cur.stored = w->pos, w->cur.direct = ckpt_sink_was_direct(w->sink);
    free(w->mtext);
    w->mtext = NULL, w->mlen = 0;
    FILE *mf = open_memstream(&w->mtext, &w->mlen);
    if (!mf) {
        werr(w, "%s: out of memory for the manifest", tmp);
        return;
    }
    if (!w_multi(w)) w_manifest_head(w, mf);
    w_manifest_entries(w, mf, file, w->pos);
    fclose(mf);
    if (w_multi(w)) {
        /* this rank's part of the manifest, for rank 0 to merge */
        snprintf(path, sizeof path, "%s/manifest.rank%05d", tmp, w_rank(w));
        w_small_file(w, path, w->mtext, w->mlen, NULL);
    }
    w->cur.write_s = kiln_now() - w->t_write;
}

static int w_complete(CkptWriter *w) {
    char name[64], tmp[1200], fin[1200], old[1200], path[1400];
    w_names(w, name, tmp, fin, old);
    int failed = w->status != 0;
    if (w_agree(w, failed)) {
        if (!failed) werr(w, "another rank failed to write its part of %s", tmp);
        w_abort(w, tmp);
        return -1;
    }
    char *text = w->mtext;
    size_t len = w->mlen;
    w->mtext = NULL, w->mlen = 0;
    if (w_rank(w) == 0) {
        if (w_multi(w)) {
            free(text);
            text = NULL, len = 0;
            FILE *mf = open_memstream(&text, &len);
            if (!mf) kiln_fail(KILN_EXIT_RUNTIME, "%s: out of memory for the manifest", tmp);
            w_manifest_head(w, mf);
            for (int r = 0; r < w->meta.mesh.world && !failed; r++) {
                snprintf(path, sizeof path, "%s/manifest.rank%05d", tmp, r);
                size_t plen;
                char *part = kiln_read_file(path, &plen);
                if (!part) {
                    werr(w, "%s: cannot read: %s", path, strerror(errno));
                    failed = 1;
                    break;
                }
                fwrite(part, 1, plen, mf);
                free(part);
                unlink(path);
            }
            fclose(mf);
        }
        char endline[64];
        snprintf(endline, sizeof endline, "end crc32c=%08x\n", ckpt_crc32c(0, text, len));
        snprintf(path, sizeof path, "%s/%s", tmp, CKPT_MANIFEST_NAME);
        if (!failed && w_small_file(w, path, text, len, endline) != 0) failed = 1;
        if (!failed && fsync_dir(tmp) != 0) {
            werr(w, "%s: fsync: %s", tmp, strerror(errno));
            failed = 1;
        }
        /* A checkpoint of this step may exist already (a resumed run passing a
         * step it saved before): move it aside under a .tmp name, never loaded,
         * and delete it once the new one is in place. */
        struct stat st;
        int replaced = !failed && stat(fin, &st) == 0;
        if (replaced && (rm_rf(old) != 0 || rename(fin, old) != 0)) {
            werr(w, "%s: cannot move the old checkpoint aside: %s", fin, strerror(errno));
            failed = 1;
        }
        if (!failed && (rename(tmp, fin) != 0 || fsync_dir(w->o.root) != 0)) {
            werr(w, "%s: rename into place: %s", fin, strerror(errno));
            failed = 1;
            /* put the old checkpoint back: earlier checkpoints stay untouched */
            if (replaced && stat(fin, &st) != 0) rename(old, fin);
        }
        if (!failed && replaced) rm_rf(old);
    }
    free(text);
    if (w_agree(w, failed)) {
        if (!failed) werr(w, "rank 0 failed to complete %s", fin);
        w_abort(w, tmp);
        return -1;
    }
    if (w_rank(w) == 0) {
        /* latest: written to latest.tmp, fsynced, renamed, directory fsynced */
        snprintf(path, sizeof path, "%s/latest", w->o.root);
        char line[80];
        snprintf(line, sizeof line, "%s\n", name);
        if (kiln_write_file_atomic(path, line, strlen(line)) != 0 || fsync_dir(w->o.root) != 0) {
            werr(w, "%s: %s (the checkpoint %s itself is complete)", path, strerror(errno), fin);
            return -1;
        }
        w_prune(w);
    }
    return 0;
}

/* The figures of a save that completed (status 0). */
static void w_done(CkptWriter *w, double t_complete) {
    if (w->status) return;
    w->cur.write_s += kiln_now() - t_complete;
    w->cur.step = w->meta.step;
    w->last = w->cur;
}

static int w_job(CkptWriter *w) {
    if (w_begin(w) != 0) return -1;
    w_write_rank(w);
    double t = kiln_now();
    int rc = w_complete(w);
    if (rc == 0) w_done(w, t);
    return rc;
}

/* The writer thread: the whole save for one rank; several ranks: the write
 * only (w_complete follows on the main thread). */
static void *w_thread(void *arg) {
    CkptWriter *w = arg;
    if (w_multi(w)) w_write_rank(w);
    else w_job(w);
    atomic_store(&w->thread_done, 1);
    return NULL;
}

int ckpt_pending(const CkptWriter *w) { return w->in_flight && !atomic_load(&((CkptWriter *)w)->thread_done); }
int ckpt_in_flight(const CkptWriter *w) { return w->in_flight; }

int ckpt_wait(CkptWriter *w) {
    if (w->in_flight) {
        if (!w->no_thread) pthread_join(w->thread, NULL);
        w->in_flight = 0;
        if (w_multi(w)) {
            /* collective: every rank waits at the same point */
            double t = kiln_now();
            int rc = w_complete(w);
            if (rc == 0) w_done(w, t);
            return rc;
        }
    }
    return w->status;
}

int ckpt_save(CkptWriter *w, const CkptMeta *meta) {
    if (ckpt_wait(w) != 0) return -1;
    w->meta = *meta;
    kiln_strlcpy(w->version, meta->version ? meta->version : "unknown", sizeof w->version);
    kiln_strlcpy(w->commit, meta->commit ? meta->commit : "unknown", sizeof w->commit);
    memset(&w->cur, 0, sizeof w->cur);
    if (!w->o.async) return w_job(w);
    if (w_multi(w) && w_begin(w) != 0) return -1;
    w_touched(w);
    /* the step loop's pause: this copy (every entry is this rank's own) */
    for (int i = 0; i < w->t.n; i++) {
        const CkptEntry *e = &w->t.e[i];
        size_t n = ckpt_entry_bytes(e);
        if (e->to_host) e->to_host(w->stage + w->stage_off[i], e->ptr, n);
        else if (n) memcpy(w->stage + w->stage_off[i], e->ptr, n); /* an empty range may have no pointer */
    }
    /* the writer takes no signals: they belong to the step loop's handler */
    sigset_t all, prev;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &prev);
    atomic_store(&w->thread_done, 0);
    int rc = pthread_create(&w->thread, NULL, w_thread, w);
    pthread_sigmask(SIG_SETMASK, &prev, NULL);
    if (rc != 0 && w_multi(w)) {
        /* several ranks: the others' threads run and every rank completes
         * at the same later point (ckpt_wait, a collective), so write here
         * on this thread (no communication) and join that point as usual */
        w_write_rank(w);
        atomic_store(&w->thread_done, 1);
        w->in_flight = 1, w->no_thread = 1;
        return 0;
    }
    if (rc != 0) {
        werr(w, "cannot start the checkpoint writer thread: %s", strerror(rc));
        return -1;
    }
    w->in_flight = 1, w->no_thread = 0;
    return 0;
}

void ckpt_writer_free(CkptWriter *w) {
    if (!w) return;
    ckpt_wait(w);
    w_touched(w);
    ckpt_sink_free(w->sink);
    free(w->t.e);
    free(w->stage);
    free(w->stage_off);
    free(w->bounce);
    if (w->zc) ZSTD_freeCCtx(w->zc);
    free(w->rec);
    free(w->mtext);
    free(w);
}
