/* ckpt: checkpoint directories. Writes a table of named entries to
 * root/step_N.tmp/, fsyncs every file and the directory, renames it to
 * root/step_N/, replaces root/latest atomically, then prunes. Reads them back
 * piece by piece, verifying a CRC32C per piece. Knows the table and the mesh,
 * never the model, the optimizer or the backend (copies go through the
 * entries' own to_host/to_device). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "ckpt.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <math.h>
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

#define CKPT_MANIFEST "manifest"
#define CKPT_CRC_BLOCK ((size_t)512 << 10) /* copied, then checksummed while it is in the cache */

/* ---------- the table ---------- */

static const char *dtype_names[] = {"f32", "f64", "i64", "u64", "u8"};
static const size_t dtype_sizes[] = {4, 8, 8, 8, 1};

size_t ckpt_dtype_size(CkptDtype d) { return dtype_sizes[d]; }

static int dtype_parse(const char *s) {
    for (int i = 0; i < 5; i++)
        if (!strcmp(s, dtype_names[i])) return i;
    return -1;
}

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

/* Rows and columns of a tensor viewed as (shape[0], the rest); a scalar is 1 x 1. */
static void tensor_rc(int ndim, const int64_t *shape, uint64_t *rows, uint64_t *cols) {
    *rows = ndim ? (uint64_t)shape[0] : 1;
    *cols = 1;
    for (int d = 1; d < ndim; d++) *cols *= (uint64_t)shape[d];
}

void ckpt_entry_set_box(CkptEntry *e, uint64_t r0, uint64_t r1, uint64_t c0, uint64_t c1) {
    uint64_t rows, cols;
    tensor_rc(e->ndim, e->shape, &rows, &cols);
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
    qsort(v, (size_t)n, sizeof *v, stepdir_desc);
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
    char *text = kiln_read_file(path, NULL);
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
        w->stage = p;
        /* touched now, so the first save does not pay for page faults */
        memset(w->stage, 0, cap);
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
    w->sink = ckpt_sink_new(4, !o->buffered);
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
        snprintf(path, sizeof path, "%s/%s", tmp, CKPT_MANIFEST);
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
    /* the step loop's pause: this copy (every entry is this rank's own) */
    for (int i = 0; i < w->t.n; i++) {
        const CkptEntry *e = &w->t.e[i];
        size_t n = ckpt_entry_bytes(e);
        if (e->to_host) e->to_host(w->stage + w->stage_off[i], e->ptr, n);
        else memcpy(w->stage + w->stage_off[i], e->ptr, n);
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

/* ---------- reading ---------- */

typedef struct {
    char name[CKPT_NAME];
    CkptKind kind;
    int dtype, ndim, rank, zstd;
    int64_t shape[CKPT_MAX_DIM];
    uint64_t lo, hi, offset, bytes, stored;
    uint64_t r0, r1, c0, c1; /* its box, always filled in (the whole tensor when the line has none) */
    char file[64];
    uint32_t crc;
} MEntry;

typedef struct {
    CkptInfo info;
    MEntry *e;
    int n;
    char dir[1200];
} Manifest;

static int rerr(char *err, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int rerr(char *err, size_t cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, cap, fmt, ap);
    va_end(ap);
    return -1;
}

/* One "key=value" field of an entry line; NULL if absent. */
static const char *field(const char *line, const char *key, char *buf, size_t cap) {
    size_t k = strlen(key);
    for (const char *p = line; (p = strstr(p, key)); p++) {
        if ((p == line || p[-1] == ' ') && p[k] == '=') {
            const char *v = p + k + 1;
            size_t n = strcspn(v, " \n");
            if (n >= cap) return NULL;
            memcpy(buf, v, n);
            buf[n] = 0;
            return buf;
        }
    }
    return NULL;
}

static int parse_u64(const char *s, uint64_t *out) {
    if (!s || !*s) return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end || errno || s[0] == '-') return -1;
    *out = v;
    return 0;
}

static int parse_entry(const char *line, MEntry *e) {
    char b[256];
    memset(e, 0, sizeof *e);
    if (!field(line, "name", e->name, sizeof e->name)) return -1;
    if (!field(line, "kind", b, sizeof b)) return -1;
    if (!strcmp(b, "tensor")) e->kind = CKPT_TENSOR;
    else if (!strcmp(b, "blob")) e->kind = CKPT_BLOB;
    else return -1;
    if (!field(line, "dtype", b, sizeof b) || (e->dtype = dtype_parse(b)) < 0) return -1;
    if (!field(line, "shape", b, sizeof b) || b[0] != '[') return -1;
    char *p = b + 1;
    while (*p && *p != ']') {
        if (e->ndim == CKPT_MAX_DIM) return -1;
        char *end;
        long long v = strtoll(p, &end, 10);
        if (end == p || v < 0) return -1;
        e->shape[e->ndim++] = v;
        p = end;
        if (*p == ',') p++;
    }
    if (*p != ']') return -1;
    if (!field(line, "range", b, sizeof b)) return -1;
    char *colon = strchr(b, ':');
    if (!colon) return -1;
    *colon = 0;
    uint64_t rank;
    if (parse_u64(b, &e->lo) || parse_u64(colon + 1, &e->hi) || e->lo > e->hi) return -1;
    if (parse_u64(field(line, "rank", b, sizeof b), &rank)) return -1;
    e->rank = (int)rank;
    if (!field(line, "file", e->file, sizeof e->file) || strchr(e->file, '/')) return -1;
    if (parse_u64(field(line, "offset", b, sizeof b), &e->offset)) return -1;
    if (parse_u64(field(line, "bytes", b, sizeof b), &e->bytes)) return -1;
    if (parse_u64(field(line, "stored", b, sizeof b), &e->stored)) return -1;
    if (!field(line, "codec", b, sizeof b)) return -1;
    if (!strcmp(b, "zstd")) e->zstd = 1;
    else if (strcmp(b, "none")) return -1;
    uint64_t crc;
    if (!field(line, "crc32c", b, sizeof b)) return -1;
    char *end;
    crc = strtoull(b, &end, 16);
    if (*end || strlen(b) != 8) return -1;
    e->crc = (uint32_t)crc;
    uint64_t rows, cols;
    tensor_rc(e->ndim, e->shape, &rows, &cols);
    e->r0 = 0, e->r1 = rows, e->c0 = 0, e->c1 = cols;
    if (field(line, "box", b, sizeof b)) {
        unsigned long long r0, r1, c0, c1;
        int used = 0;
        if (sscanf(b, "%llu:%llu,%llu:%llu%n", &r0, &r1, &c0, &c1, &used) != 4 || b[used] || r0 >= r1 || c0 >= c1 ||
            r1 > rows || c1 > cols)
            return -1;
        e->r0 = r0, e->r1 = r1, e->c0 = c0, e->c1 = c1;
    }
    uint64_t numel = (e->r1 - e->r0) * (e->c1 - e->c0);
    if (e->hi > numel || e->bytes != (e->hi - e->lo) * dtype_sizes[e->dtype]) return -1;
    if (!e->zstd && e->stored != e->bytes) return -1;
    return 0;
}

static void man_free(Manifest *m) {
    free(m->e);
    memset(m, 0, sizeof *m);
}


static int cmp_u64(uint64_t a, uint64_t b) { return a < b ? -1 : a > b; }

static int mentry_by_name_lo(const void *a, const void *b) {
    const MEntry *x = *(const MEntry *const *)a, *y = *(const MEntry *const *)b;
    int c = strcmp(x->name, y->name);
    if (!c) c = cmp_u64(x->r0, y->r0);
    if (!c) c = cmp_u64(x->c0, y->c0);
    if (!c) c = cmp_u64(x->r1, y->r1);
    if (!c) c = cmp_u64(x->c1, y->c1);
    return c ? c : cmp_u64(x->lo, y->lo);
}

static int same_box(const MEntry *x, const MEntry *y) {
    return x->r0 == y->r0 && x->r1 == y->r1 && x->c0 == y->c0 && x->c1 == y->c1;
}

static int boxes_meet(const MEntry *x, const MEntry *y) {
    return x->r0 < y->r1 && y->r0 < x->r1 && x->c0 < y->c1 && y->c0 < x->c1;
}

/* Pieces of one tensor must not overlap: the loader counts covered elements,
 * and two copies of one range would hide a missing one. Pieces of one box
 * are disjoint ranges of it; pieces of different boxes lie in disjoint boxes. */
static int manifest_check_overlap(const Manifest *m, const char *path, char *err, size_t cap) {
    const MEntry **v = xmalloc((size_t)(m->n ? m->n : 1) * sizeof *v);
    int k = 0;
    for (int i = 0; i < m->n; i++)
        if (m->e[i].kind == CKPT_TENSOR) v[k++] = &m->e[i];
    qsort(v, (size_t)k, sizeof *v, mentry_by_name_lo);
    int rc = 0;
    for (int i = 1; i < k && rc == 0; i++) {
        if (strcmp(v[i]->name, v[i - 1]->name)) continue;
        if (same_box(v[i], v[i - 1]) && v[i]->lo < v[i - 1]->hi)
            rc = rerr(err, cap, "%s: pieces of '%s' overlap ([%llu,%llu) and [%llu,%llu))", path, v[i]->name,
                      (unsigned long long)v[i - 1]->lo, (unsigned long long)v[i - 1]->hi,
                      (unsigned long long)v[i]->lo, (unsigned long long)v[i]->hi);
    }
    /* distinct boxes of one name must not meet (a few per tensor: every pair) */
    for (int i = 0; i < k && rc == 0; i++)
        for (int j = i + 1; j < k && !strcmp(v[i]->name, v[j]->name) && rc == 0; j++)
            if (!same_box(v[i], v[j]) && boxes_meet(v[i], v[j]) && v[i]->lo < v[i]->hi && v[j]->lo < v[j]->hi)
                rc = rerr(err, cap, "%s: pieces of '%s' overlap (boxes rows %llu:%llu cols %llu:%llu and rows "
                          "%llu:%llu cols %llu:%llu)", path, v[i]->name, (unsigned long long)v[i]->r0,
                          (unsigned long long)v[i]->r1, (unsigned long long)v[i]->c0, (unsigned long long)v[i]->c1,
                          (unsigned long long)v[j]->r0, (unsigned long long)v[j]->r1, (unsigned long long)v[j]->c0,
                          (unsigned long long)v[j]->c1);
    free(v);
    return rc;
}

static int man_read(const char *dir, Manifest *m, char *err, size_t cap) {
    memset(m, 0, sizeof *m);
    kiln_strlcpy(m->dir, dir, sizeof m->dir);
    char path[1400];
    snprintf(path, sizeof path, "%s/%s", dir, CKPT_MANIFEST);
    size_t len;
    char *text = kiln_read_file(path, &len);
    if (!text) return rerr(err, cap, "%s: cannot read the manifest: %s", path, strerror(errno));
    /* the version first, so a newer format is named as such, not as damage */
    int format = 0;
    if (sscanf(text, "kiln-checkpoint %d", &format) != 1) {
        free(text);
        return rerr(err, cap, "%s:1: not a kiln checkpoint manifest", path);
    }
    if (format != CKPT_FORMAT_VERSION) {
        free(text);
        return rerr(err, cap, "%s:1: checkpoint format version %d; this kiln reads version %d", path, format,
                    CKPT_FORMAT_VERSION);
    }
    /* the last line is "end crc32c=X" over every byte before it */
    char *endl = len >= 2 ? memrchr(text, '\n', len - 1) : NULL;
    size_t body = endl ? (size_t)(endl + 1 - text) : 0;
    unsigned crc_want;
    if (len == 0 || text[len - 1] != '\n' || sscanf(text + body, "end crc32c=%8x", &crc_want) != 1) {
        free(text);
        return rerr(err, cap, "%s: incomplete manifest (no end line)", path);
    }
    if (ckpt_crc32c(0, text, body) != crc_want) {
        free(text);
        return rerr(err, cap, "%s: manifest checksum mismatch (the file was changed or damaged)", path);
    }
    text[body] = 0;
    int lineno = 0, cap_e = 0, have_step = 0;
    char *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        lineno++;
        if (lineno == 1) {
            if (sscanf(line, "kiln-checkpoint %d", &m->info.format) != 1) {
                free(text);
                return rerr(err, cap, "%s:1: not a kiln checkpoint manifest", path);
            }
            if (m->info.format != CKPT_FORMAT_VERSION) {
                free(text);
                return rerr(err, cap, "%s:1: checkpoint format version %d; this kiln reads version %d", path,
                            m->info.format, CKPT_FORMAT_VERSION);
            }
            continue;
        }
        if (!strncmp(line, "entry ", 6)) {
            if (m->n == cap_e) cap_e = cap_e ? 2 * cap_e : 64, m->e = xrealloc(m->e, (size_t)cap_e * sizeof *m->e);
            if (parse_entry(line + 6, &m->e[m->n]) != 0) {
                free(text);
                return rerr(err, cap, "%s:%d: malformed entry line", path, lineno);
            }
            m->n++;
        } else if (sscanf(line, "step %" SCNd64, &m->info.step) == 1) {
            have_step = 1;
        } else if (sscanf(line, "config_hash %" SCNx64, &m->info.config_hash) == 1) {
        } else if (sscanf(line, "kiln_version %63s", m->info.version) == 1) {
        } else if (sscanf(line, "kiln_commit %63s", m->info.commit) == 1) {
        } else if (!strncmp(line, "mesh ", 5)) {
            CkptMesh *g = &m->info.mesh;
            sscanf(line, "mesh world=%d dp=%d tp=%d pp=%d cp=%d ep=%d", &g->world, &g->dp, &g->tp, &g->pp, &g->cp, &g->ep);
        } /* other lines (file, created_unix, future keys) are informational */
    }
    free(text);
    if (m->info.format == 0) return rerr(err, cap, "%s: empty manifest", path);
    if (!have_step) return rerr(err, cap, "%s: manifest has no step line", path);
    return manifest_check_overlap(m, path, err, cap);
}

/* Read piece e into out (e->bytes), verifying its checksum. */
static int piece_read(const Manifest *m, const MEntry *e, void *out, char *err, size_t cap) {
    char path[1400];
    snprintf(path, sizeof path, "%s/%s", m->dir, e->file);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return rerr(err, cap, "%s: cannot open: %s", path, strerror(errno));
    unsigned char *buf = e->zstd ? xmalloc(e->stored ? e->stored : 1) : out;
    uint64_t got = 0;
    while (got < e->stored) {
        ssize_t r = pread(fd, buf + got, e->stored - got, (off_t)(e->offset + got));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (uint64_t)r;
    }
    close(fd);
    if (got < e->stored) {
        if (e->zstd) free(buf);
        return rerr(err, cap, "%s: truncated: entry '%s' needs bytes %" PRIu64 "..%" PRIu64 ", file ends at %" PRIu64,
                    path, e->name, e->offset, e->offset + e->stored, e->offset + got);
    }
    if (e->zstd) {
        size_t n = ZSTD_decompress(out, e->bytes, buf, e->stored);
        free(buf);
        if (ZSTD_isError(n) || n != e->bytes)
            return rerr(err, cap, "%s: entry '%s': corrupt zstd data (%s)", path, e->name,
                        ZSTD_isError(n) ? ZSTD_getErrorName(n) : "wrong size");
    }
    uint32_t crc = ckpt_crc32c(0, out, e->bytes);
    if (crc != e->crc)
        return rerr(err, cap, "%s: entry '%s': checksum mismatch (crc32c %08x in the manifest, %08x read)", path,
                    e->name, e->crc, crc);
    return 0;
}

static void shape_text(int ndim, const int64_t *shape, char *buf, size_t cap) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < ndim && n < cap; d++) n += (size_t)snprintf(buf + n, cap - n, "%s%" PRId64, d ? "," : "", shape[d]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

/* A range [lo, hi) of a box of a rows x cols tensor (see CkptEntry). */
typedef struct BoxRange {
    uint64_t r0, r1, c0, c1, lo, hi;
} BoxRange;

static BoxRange entry_range(const CkptEntry *e) {
    uint64_t rows, cols;
    tensor_rc(e->ndim, e->shape, &rows, &cols);
    if (!e->r1) return (BoxRange){0, rows, 0, cols, e->lo, e->hi};
    return (BoxRange){e->r0, e->r1, e->c0, e->c1, e->lo, e->hi};
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* The elements that range e (to fill, at dst) and saved range p (at src)
 * share, of a tensor with `cols` columns: counted, and copied when dst is
 * set (es bytes each). Full-width boxes are flat ranges of the tensor: one
 * copy; others meet row by row. */
static uint64_t range_meet(const BoxRange *e, const BoxRange *p, uint64_t cols, unsigned char *dst,
                           const unsigned char *src, size_t es) {
    if (e->c0 == 0 && e->c1 == cols && p->c0 == 0 && p->c1 == cols) {
        uint64_t e0 = e->r0 * cols + e->lo, e1 = e->r0 * cols + e->hi, p0 = p->r0 * cols + p->lo,
                 p1 = p->r0 * cols + p->hi;
        uint64_t a = e0 > p0 ? e0 : p0, b = e1 < p1 ? e1 : p1;
        if (a >= b) return 0;
        if (dst) memcpy(dst + (a - e0) * es, src + (a - p0) * es, (size_t)(b - a) * es);
        return b - a;
    }
    int64_t ew = (int64_t)(e->c1 - e->c0), pw = (int64_t)(p->c1 - p->c0), n = 0;
    int64_t r0 = max64((int64_t)e->r0, (int64_t)p->r0), r1 = min64((int64_t)e->r1, (int64_t)p->r1);
    for (int64_t r = r0; r < r1; r++) {
        int64_t eb = (r - (int64_t)e->r0) * ew - (int64_t)e->c0, pb = (r - (int64_t)p->r0) * pw - (int64_t)p->c0;
        /* column c is element eb + c of e's range and pb + c of p's */
        int64_t c0 = max64(max64((int64_t)e->c0, (int64_t)p->c0), max64((int64_t)e->lo - eb, (int64_t)p->lo - pb));
        int64_t c1 = min64(min64((int64_t)e->c1, (int64_t)p->c1), min64((int64_t)e->hi - eb, (int64_t)p->hi - pb));
        if (c0 >= c1) continue;
        if (dst)
            memcpy(dst + (size_t)(eb + c0 - (int64_t)e->lo) * es, src + (size_t)(pb + c0 - (int64_t)p->lo) * es,
                   (size_t)(c1 - c0) * es);
        n += c1 - c0;
    }
    return (uint64_t)n;
}

/* The bytes of saved range p at piece bytes [s0, s0 + n) (at src) that range
 * e holds, copied to dst (e's elements from e->lo, es bytes each): the
 * streaming form of range_meet. Byte offsets, since a read may end inside an
 * element. */
static void copy_run(unsigned char *dst, uint64_t pb, uint64_t len, const unsigned char *src, uint64_t s0,
                     uint64_t s1) {
    /* the run is piece bytes [pb, pb + len), going to dst[0, len) */
    uint64_t a = pb > s0 ? pb : s0, b = pb + len < s1 ? pb + len : s1;
    if (a < b) memcpy(dst + (a - pb), src + (a - s0), (size_t)(b - a));
}

static void range_copy_span(const BoxRange *e, const BoxRange *p, uint64_t cols, size_t es, unsigned char *dst,
                            const unsigned char *src, uint64_t s0, uint64_t n) {
    uint64_t s1 = s0 + n;
    if (e->c0 == 0 && e->c1 == cols && p->c0 == 0 && p->c1 == cols) {
        uint64_t e0 = e->r0 * cols + e->lo, e1 = e->r0 * cols + e->hi, p0 = p->r0 * cols + p->lo,
                 p1 = p->r0 * cols + p->hi;
        uint64_t a = e0 > p0 ? e0 : p0, b = e1 < p1 ? e1 : p1;
        if (a < b) copy_run(dst + (a - e0) * es, (a - p0) * es, (b - a) * es, src, s0, s1);
        return;
    }
    /* the box rows of p whose elements the span touches (piece element k is
     * element p->lo + k of p's box), within e's rows */
    int64_t ew = (int64_t)(e->c1 - e->c0), pw = (int64_t)(p->c1 - p->c0);
    uint64_t k0 = s0 / es, k1 = (s1 + es - 1) / es;
    int64_t r0 = max64((int64_t)e->r0, (int64_t)(p->r0 + (p->lo + k0) / (uint64_t)pw));
    int64_t r1 = min64((int64_t)e->r1, (int64_t)(p->r0 + (p->lo + k1 - 1) / (uint64_t)pw + 1));
    for (int64_t r = r0; r < r1; r++) {
        int64_t eb = (r - (int64_t)e->r0) * ew - (int64_t)e->c0, pb = (r - (int64_t)p->r0) * pw - (int64_t)p->c0;
        int64_t c0 = max64(max64((int64_t)e->c0, (int64_t)p->c0), max64((int64_t)e->lo - eb, (int64_t)p->lo - pb));
        int64_t c1 = min64(min64((int64_t)e->c1, (int64_t)p->c1), min64((int64_t)e->hi - eb, (int64_t)p->hi - pb));
        if (c0 >= c1) continue;
        copy_run(dst + (size_t)(eb + c0 - (int64_t)e->lo) * es, (uint64_t)(pb + c0 - (int64_t)p->lo) * es,
                 (uint64_t)(c1 - c0) * es, src, s0, s1);
    }
}

/* ---------- streaming reads ----------
 * A load or a verify reads each rank file once, front to back, in
 * CKPT_IO_CHUNK reads (adjacent pieces share a read; the kernel's read-ahead,
 * asked for with FADV_SEQUENTIAL, keeps the disk busy while the bytes are
 * checksummed and copied), and every piece's bytes pass once through
 * CRC32C and on to whatever entries need them. */

typedef struct {
    int j;     /* manifest piece */
    int entry; /* table entry it fills, -1: only verified */
} RdNeed;

typedef struct {
    const Manifest *m;
    const CkptTable *t; /* NULL: verify only */
    int fd;
    const char *file;   /* the open file's name */
    char path[1400];
    unsigned char *buf; /* (CKPT_IO_CHUNK) file bytes [wlo, whi) */
    uint64_t wlo, whi;
    ZSTD_DCtx *dz;
    unsigned char *zout; /* (CKPT_IO_CHUNK) decompressed bytes */
    unsigned char **host; /* (t->n) where each entry's bytes are assembled: its memory, or a
                             scratch buffer (to_device) allocated when first needed */
    BoxRange *er;       /* (t->n) */
    uint64_t bytes;     /* read, for the caller's figures */
} Rd;

static int need_by_place(const void *a, const void *b, void *m_) {
    const Manifest *m = m_;
    const RdNeed *x = a, *y = b;
    const MEntry *p = &m->e[x->j], *q = &m->e[y->j];
    int c = strcmp(p->file, q->file);
    if (!c) c = cmp_u64(p->offset, q->offset);
    if (!c) c = x->j - y->j;
    return c ? c : x->entry - y->entry;
}

/* File bytes [off, off + len) through the window: a pointer and *got (1..len)
 * of them; refills with one read up to `ahead` (the end of the adjacent
 * pieces being read). NULL at the end of the file (*got = where it ends) or
 * on an error (errno set, *got = 0). */
static const unsigned char *rd_get(Rd *r, uint64_t off, uint64_t len, uint64_t ahead, uint64_t *got) {
    if (off < r->wlo || off >= r->whi) {
        uint64_t want = ahead > off ? ahead - off : len;
        if (want < len) want = len;
        if (want > CKPT_IO_CHUNK) want = CKPT_IO_CHUNK;
        uint64_t n = 0;
        while (n < want) {
            ssize_t k = pread(r->fd, r->buf + n, (size_t)(want - n), (off_t)(off + n));
            if (k < 0 && errno == EINTR) continue;
            if (k < 0) {
                *got = 0;
                return NULL;
            }
            if (k == 0) break;
            n += (uint64_t)k;
        }
        r->wlo = off, r->whi = off + n;
        if (n == 0) {
            *got = off;
            errno = 0;
            return NULL;
        }
    }
    uint64_t have = r->whi - off;
    *got = have < len ? have : len;
    return r->buf + (off - r->wlo);
}

/* Uncompressed piece bytes [s0, s0 + n) at q: to every entry of needs[0, nn). */
static void rd_scatter(Rd *r, const MEntry *p, const RdNeed *needs, int nn, const unsigned char *q, uint64_t s0,
                       uint64_t n) {
    BoxRange pr = {p->r0, p->r1, p->c0, p->c1, p->lo, p->hi};
    for (int k = 0; k < nn; k++) {
        int i = needs[k].entry;
        if (i < 0) continue;
        const CkptEntry *e = &r->t->e[i];
        uint64_t rows, cols;
        tensor_rc(e->ndim, e->shape, &rows, &cols);
        range_copy_span(&r->er[i], &pr, cols, dtype_sizes[e->dtype], r->host[i], q, s0, n);
    }
}

/* Piece needs[0].j, every byte in order: checksummed and scattered. */
static int rd_piece(Rd *r, const RdNeed *needs, int nn, uint64_t ahead, char *err, size_t cap) {
    const MEntry *p = &r->m->e[needs[0].j];
    uint32_t crc = 0;
    uint64_t got, produced = 0;
    if (!p->zstd) {
        for (uint64_t off = 0; off < p->bytes; off += got) {
            const unsigned char *q = rd_get(r, p->offset + off, p->bytes - off, ahead, &got);
            if (!q && !got) return rerr(err, cap, "%s: read: %s", r->path, strerror(errno));
            if (!q)
                return rerr(err, cap, "%s: truncated: entry '%s' needs bytes %" PRIu64 "..%" PRIu64
                            ", file ends at %" PRIu64, r->path, p->name, p->offset, p->offset + p->stored, got);
            crc = ckpt_crc32c(crc, q, (size_t)got);
            rd_scatter(r, p, needs, nn, q, off, got);
        }
        produced = p->bytes;
    } else {
        if (!r->dz) r->dz = ZSTD_createDCtx(), r->zout = xmalloc(CKPT_IO_CHUNK);
        if (!r->dz) kiln_fail(KILN_EXIT_RUNTIME, "ZSTD_createDCtx failed");
        ZSTD_DCtx_reset(r->dz, ZSTD_reset_session_only);
        ZSTD_inBuffer in = {NULL, 0, 0};
        uint64_t in_off = 0;
        size_t ret = 1;
        while (ret != 0) {
            if (in.pos == in.size) {
                if (in_off == p->stored) break; /* the frame is not complete */
                const unsigned char *q = rd_get(r, p->offset + in_off, p->stored - in_off, ahead, &got);
                if (!q && !got) return rerr(err, cap, "%s: read: %s", r->path, strerror(errno));
                if (!q)
                    return rerr(err, cap, "%s: truncated: entry '%s' needs bytes %" PRIu64 "..%" PRIu64
                                ", file ends at %" PRIu64, r->path, p->name, p->offset, p->offset + p->stored, got);
                in = (ZSTD_inBuffer){q, (size_t)got, 0};
                in_off += got;
            }
            ZSTD_outBuffer out = {r->zout, CKPT_IO_CHUNK, 0};
            ret = ZSTD_decompressStream(r->dz, &out, &in);
            if (ZSTD_isError(ret))
                return rerr(err, cap, "%s: entry '%s': corrupt zstd data (%s)", r->path, p->name,
                            ZSTD_getErrorName(ret));
            if (produced + out.pos > p->bytes) break;
            crc = ckpt_crc32c(crc, r->zout, out.pos);
            rd_scatter(r, p, needs, nn, r->zout, produced, out.pos);
            produced += out.pos;
        }
        if (ret != 0 || produced != p->bytes || in_off != p->stored || in.pos != in.size)
            return rerr(err, cap, "%s: entry '%s': corrupt zstd data (wrong size)", r->path, p->name);
    }
    r->bytes += p->stored;
    if (crc != p->crc)
        return rerr(err, cap, "%s: entry '%s': checksum mismatch (crc32c %08x in the manifest, %08x read)", r->path,
                    p->name, p->crc, crc);
    return 0;
}

/* Read every piece of needs[0, n) (sorted in place by file and offset),
 * each once, whatever number of entries it fills. left[i]: needs of entry i
 * not yet read; an entry with a to_device copy is sent once its last
 * piece is in. */
static int rd_run(Rd *r, RdNeed *needs, int n, uint64_t *left, char *err, size_t cap) {
    qsort_r(needs, (size_t)n, sizeof *needs, need_by_place, (void *)r->m);
    /* ahead[k]: the end of the run of adjacent pieces from needs[k]'s on */
    uint64_t *ahead = xmalloc((size_t)(n ? n : 1) * sizeof *ahead);
    for (int k = n - 1; k >= 0; k--) {
        const MEntry *p = &r->m->e[needs[k].j];
        ahead[k] = p->offset + p->stored;
        for (int l = k + 1; l < n; l++) {
            const MEntry *q = &r->m->e[needs[l].j];
            if (strcmp(q->file, p->file) || (needs[l].j != needs[k].j && q->offset != ahead[k])) break;
            if (needs[l].j != needs[k].j) {
                ahead[k] = ahead[l];
                break;
            }
        }
    }
    int rc = 0;
    r->fd = -1;
    for (int k = 0; k < n && rc == 0;) {
        const MEntry *p = &r->m->e[needs[k].j];
        int nn = 1;
        while (k + nn < n && needs[k + nn].j == needs[k].j) nn++;
        if (!r->file || strcmp(r->file, p->file)) {
            if (r->fd >= 0) close(r->fd);
            r->file = p->file;
            snprintf(r->path, sizeof r->path, "%s/%s", r->m->dir, p->file);
            r->fd = open(r->path, O_RDONLY);
            r->wlo = r->whi = 0;
            if (r->fd < 0) {
                rc = rerr(err, cap, "%s: cannot open: %s", r->path, strerror(errno));
                break;
            }
            posix_fadvise(r->fd, 0, 0, POSIX_FADV_SEQUENTIAL);
        }
        for (int l = k; l < k + nn; l++) {
            int i = needs[l].entry;
            if (i >= 0 && r->t->e[i].to_device && !r->host[i]) r->host[i] = xmalloc(ckpt_entry_bytes(&r->t->e[i]) + 1);
        }
        rc = rd_piece(r, needs + k, nn, ahead[k], err, cap);
        for (int l = k; l < k + nn && rc == 0; l++) {
            int i = needs[l].entry;
            if (i < 0 || --left[i] > 0) continue;
            const CkptEntry *e = &r->t->e[i];
            if (e->to_device) {
                e->to_device(e->ptr, r->host[i], ckpt_entry_bytes(e));
                free(r->host[i]);
                r->host[i] = NULL;
            }
        }
        k += nn;
    }
    if (r->fd >= 0) close(r->fd);
    r->fd = -1;
    free(ahead);
    return rc;
}

static void rd_free(Rd *r) {
    if (r->host)
        for (int i = 0; i < r->t->n; i++)
            if (r->t->e[i].to_device) free(r->host[i]);
    free(r->host);
    free(r->er);
    free(r->buf);
    free(r->zout);
    if (r->dz) ZSTD_freeDCtx(r->dz);
}

static int mentry_by_name_index(const void *a, const void *b, void *m_) {
    const Manifest *m = m_;
    int x = *(const int *)a, y = *(const int *)b;
    int c = strcmp(m->e[x].name, m->e[y].name);
    return c ? c : x - y;
}

int ckpt_load(const char *dir, const CkptTable *t, CkptInfo *info, char *err, size_t cap) {
    Manifest m;
    if (man_read(dir, &m, err, cap) != 0) return -1;
    if (info) *info = m.info;
    int rc = -1, nneed = 0, need_cap = 0;
    RdNeed *needs = NULL;
    uint64_t *left = xcalloc((size_t)(t->n ? t->n : 1), sizeof *left);
    Rd r = {.m = &m, .t = t, .fd = -1};
    r.host = xcalloc((size_t)(t->n ? t->n : 1), sizeof *r.host);
    r.er = xmalloc((size_t)(t->n ? t->n : 1) * sizeof *r.er);
    /* the pieces of each name, in manifest order */
    int *byname = xmalloc((size_t)(m.n ? m.n : 1) * sizeof *byname);
    for (int j = 0; j < m.n; j++) byname[j] = j;
    qsort_r(byname, (size_t)m.n, sizeof *byname, mentry_by_name_index, &m);
    /* plan: which pieces fill which entries; every refusal comes before any read */
    for (int i = 0; i < t->n; i++) {
        const CkptEntry *e = &t->e[i];
        int lo = 0, hi = m.n;
        while (lo < hi) {
            int mid = (lo + hi) / 2;
            if (strcmp(m.e[byname[mid]].name, e->name) < 0) lo = mid + 1;
            else hi = mid;
        }
        if (lo == m.n || strcmp(m.e[byname[lo]].name, e->name)) {
            rerr(err, cap, "%s: no entry '%s' in the checkpoint", dir, e->name);
            goto out;
        }
        r.er[i] = entry_range(e);
        if (!e->to_device) r.host[i] = e->ptr;
        uint64_t rows, cols, covered = 0;
        tensor_rc(e->ndim, e->shape, &rows, &cols);
        for (int k = lo; k < m.n && !strcmp(m.e[byname[k]].name, e->name); k++) {
            const MEntry *p = &m.e[byname[k]];
            char a[128], b[128];
            shape_text(p->ndim, p->shape, a, sizeof a);
            shape_text(e->ndim, e->shape, b, sizeof b);
            if (p->dtype != (int)e->dtype || strcmp(a, b)) {
                rerr(err, cap, "%s: entry '%s' is %s %s in the checkpoint but %s %s in this run", dir, e->name,
                     dtype_names[p->dtype], a, dtype_names[e->dtype], b);
                goto out;
            }
            /* a blob is written once (per-rank state has per-rank names): the
             * first piece of the name is it */
            if (e->kind == CKPT_BLOB && covered > 0) continue;
            BoxRange pr = {p->r0, p->r1, p->c0, p->c1, p->lo, p->hi};
            uint64_t n = range_meet(&r.er[i], &pr, cols, NULL, NULL, dtype_sizes[e->dtype]);
            if (n == 0 && !(e->lo == e->hi && p->lo == p->hi)) continue;
            if (nneed == need_cap) need_cap = need_cap ? 2 * need_cap : 256, needs = xrealloc(needs, (size_t)need_cap * sizeof *needs);
            needs[nneed++] = (RdNeed){byname[k], i};
            left[i]++;
            covered += n;
        }
        if (covered != e->hi - e->lo) {
            rerr(err, cap, "%s: entry '%s': the saved pieces cover %" PRIu64 " of the %" PRIu64 " elements needed", dir,
                 e->name, covered, e->hi - e->lo);
            goto out;
        }
    }
    r.buf = xmalloc(CKPT_IO_CHUNK);
    rc = rd_run(&r, needs, nneed, left, err, cap);
out:
    free(byname);
    free(needs);
    free(left);
    rd_free(&r);
    man_free(&m);
    return rc;
}

int ckpt_verify(const char *dir, CkptInfo *info, char *err, size_t cap) {
    Manifest m;
    if (man_read(dir, &m, err, cap) != 0) return -1;
    if (info) *info = m.info;
    RdNeed *needs = xmalloc((size_t)(m.n ? m.n : 1) * sizeof *needs);
    for (int j = 0; j < m.n; j++) needs[j] = (RdNeed){j, -1};
    Rd r = {.m = &m, .fd = -1, .buf = xmalloc(CKPT_IO_CHUNK)};
    int rc = rd_run(&r, needs, m.n, NULL, err, cap);
    free(needs);
    rd_free(&r);
    man_free(&m);
    return rc;
}

void *ckpt_read_blob(const char *dir, const char *name, size_t *len, char *err, size_t cap) {
    Manifest m;
    err[0] = 0;
    if (man_read(dir, &m, err, cap) != 0) return NULL;
    void *out = NULL;
    for (int j = 0; j < m.n; j++) {
        if (strcmp(m.e[j].name, name)) continue;
        out = xmalloc(m.e[j].bytes + 1);
        if (piece_read(&m, &m.e[j], out, err, cap) != 0) {
            free(out);
            out = NULL;
        } else {
            ((char *)out)[m.e[j].bytes] = 0; /* text blobs read as strings */
            if (len) *len = m.e[j].bytes;
        }
        break;
    }
    if (!out && !err[0]) rerr(err, cap, "%s: no entry '%s' in the checkpoint", dir, name);
    man_free(&m);
    return out;
}

int ckpt_is_checkpoint(const char *dir) {
    char path[1400];
    snprintf(path, sizeof path, "%s/%s", dir, CKPT_MANIFEST);
    return access(path, F_OK) == 0;
}

/* ---------- ./train ckpt-info ---------- */

int ckpt_info_main(int argc, char **argv) {
    if (argc != 2) kiln_fail(KILN_EXIT_USAGE, "usage: ./train ckpt-info CHECKPOINT_DIR");
    const char *dir = argv[1];
    char err[2048] = "";
    Manifest m;
    if (man_read(dir, &m, err, sizeof err) != 0) kiln_fail(KILN_EXIT_USAGE, "%s", err);
    printf("checkpoint %s\n", dir);
    printf("format %d | step %" PRId64 " | config_hash %016" PRIx64 " | kiln %s (commit %s)\n", m.info.format,
           m.info.step, m.info.config_hash, m.info.version, m.info.commit);
    printf("mesh world=%d dp=%d tp=%d pp=%d cp=%d ep=%d\n", m.info.mesh.world, m.info.mesh.dp, m.info.mesh.tp,
           m.info.mesh.pp, m.info.mesh.cp, m.info.mesh.ep);
    uint64_t raw = 0, stored = 0;
    uint32_t state = 0, params = 0;
    int bad = 0;
    for (int j = 0; j < m.n; j++) {
        const MEntry *e = &m.e[j];
        char s[128];
        shape_text(e->ndim, e->shape, s, sizeof s);
        unsigned char *buf = xmalloc(e->bytes ? e->bytes : 1);
        char perr[1024] = "";
        int ok = piece_read(&m, e, buf, perr, sizeof perr) == 0;
        free(buf);
        printf("  %-6s %-40s %-4s %-14s range %" PRIu64 ":%" PRIu64 " rank %d %10" PRIu64 " B  crc32c %08x %s\n",
               e->kind == CKPT_TENSOR ? "tensor" : "blob", e->name, dtype_names[e->dtype], s, e->lo, e->hi, e->rank,
               e->bytes, e->crc, ok ? "ok" : "BAD");
        if (!ok) fprintf(stderr, "kiln: error: %s\n", perr), bad++;
        raw += e->bytes, stored += e->stored;
        if (e->kind == CKPT_TENSOR) {
            state = ckpt_crc32c(state, &e->crc, 4);
            if (strncmp(e->name, "optim.", 6)) params = ckpt_crc32c(params, &e->crc, 4);
        }
    }
    printf("entries %d | %" PRIu64 " bytes, %" PRIu64 " stored\n", m.n, raw, stored);
    printf("params checksum %08x | state checksum %08x\n", params, state);
    man_free(&m);
    if (bad) kiln_fail(KILN_EXIT_USAGE, "%s: %d entr%s failed verification", dir, bad, bad == 1 ? "y" : "ies");
    printf("verified\n");
    return KILN_EXIT_OK;
}

/* ---------- ./train ckpt-diff ---------- */

/* Every f32 tensor of checkpoint A, whole, from A and from B (each assembled
 * from whatever pieces and ranks wrote it): the largest absolute difference
 * per tensor, then over the parameters and over the optimizer state. Exit 0
 * when both load; with --tol X, exit 1 if a parameter differs by more. */
int ckpt_diff_main(int argc, char **argv) {
    const char *a = NULL, *b = NULL;
    double tol = -1;
    int quiet = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tol") && i + 1 < argc) tol = atof(argv[++i]);
        else if (!strcmp(argv[i], "--quiet")) quiet = 1;
        else if (!a) a = argv[i];
        else if (!b) b = argv[i];
        else a = NULL, i = argc;
    }
    if (!a || !b) kiln_fail(KILN_EXIT_USAGE, "usage: ./train ckpt-diff CKPT_A CKPT_B [--tol X] [--quiet]");
    char err[2048] = "";
    Manifest m;
    if (man_read(a, &m, err, sizeof err) != 0) kiln_fail(KILN_EXIT_USAGE, "%s", err);
    CkptTable ta, tb;
    ckpt_table_init(&ta);
    ckpt_table_init(&tb);
    for (int j = 0; j < m.n; j++) {
        const MEntry *e = &m.e[j];
        if (e->kind != CKPT_TENSOR || e->dtype != CKPT_F32) continue;
        int seen = 0;
        for (int k = 0; k < ta.n && !seen; k++) seen = !strcmp(ta.e[k].name, e->name);
        if (seen) continue;
        uint64_t numel = 1;
        for (int d = 0; d < e->ndim; d++) numel *= (uint64_t)e->shape[d];
        ckpt_add_tensor(&ta, e->name, CKPT_F32, e->ndim, e->shape, 0, numel, xcalloc(numel + 1, 4), NULL, NULL);
        ckpt_add_tensor(&tb, e->name, CKPT_F32, e->ndim, e->shape, 0, numel, xcalloc(numel + 1, 4), NULL, NULL);
    }
    man_free(&m);
    if (ckpt_load(a, &ta, NULL, err, sizeof err) != 0) kiln_fail(KILN_EXIT_USAGE, "%s", err);
    if (ckpt_load(b, &tb, NULL, err, sizeof err) != 0) kiln_fail(KILN_EXIT_USAGE, "%s", err);
    double pmax = 0, omax = 0;
    const char *pworst = "-";
    for (int k = 0; k < ta.n; k++) {
        const float *x = ta.e[k].ptr, *y = tb.e[k].ptr;
        double mx = 0;
        for (uint64_t i = 0; i < ta.e[k].hi; i++) {
            double dd = fabs((double)x[i] - (double)y[i]);
            if (!(dd <= mx)) mx = dd; /* NaN wins */
        }
        if (!quiet) printf("  %-40s max abs diff %.3g\n", ta.e[k].name, mx);
        int opt = !strncmp(ta.e[k].name, "optim.", 6);
        if (opt && !(mx <= omax)) omax = mx;
        if (!opt && !(mx <= pmax)) pmax = mx, pworst = ta.e[k].name;
    }
    printf("params max abs diff %.3g (%s) | optimizer state max abs diff %.3g\n", pmax, pworst, omax);
    int bad = tol >= 0 && !(pmax <= tol);
    for (int k = 0; k < ta.n; k++) free(ta.e[k].ptr), free(tb.e[k].ptr);
    ckpt_table_free(&ta);
    ckpt_table_free(&tb);
    return bad ? KILN_EXIT_RUNTIME : KILN_EXIT_OK;
}
