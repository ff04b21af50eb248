/* ckpt_io: CRC32C, the checkpoint file sink and source. The sink turns a
 * stream of bytes into CKPT_IO_CHUNK-sized writes at aligned offsets, issued
 * by a thread of its own so that the producer (copying, checksumming,
 * compressing) runs while the disk writes; the source reads a file's ranges
 * ahead on two threads while the caller checksums the chunk before. O_DIRECT
 * keeps checkpoints out of the page cache; on this project's machines the
 * page-cache path also writes a new file at a fifth of the disk's rate and
 * reads at a quarter of it at times (docs/benchmarks.md). Never decides what
 * a file holds: ckpt.c and ckpt_read.c do. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "ckpt_io.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt.h"
#include "util.h"

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#endif

/* ---------- CRC32C ---------- */

/* The functions below take and return the register (the CRC before its final
 * inversion); ckpt_crc32c inverts on the way in and out. */
typedef uint32_t (*CrcFn)(uint32_t crc, const unsigned char *p, size_t n);

static uint32_t crc_tab[8][256]; /* crc_tab[k][b]: byte b followed by k zero bytes */

static uint32_t crc_slice8(uint32_t crc, const unsigned char *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) crc = crc_tab[0][(crc ^ *p++) & 0xff] ^ (crc >> 8), n--;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    /* eight bytes at a time: the register's four and the next four, each
     * looked up at its distance from the end of the word */
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        v ^= crc;
        crc = crc_tab[7][v & 0xff] ^ crc_tab[6][(v >> 8) & 0xff] ^ crc_tab[5][(v >> 16) & 0xff] ^
              crc_tab[4][(v >> 24) & 0xff] ^ crc_tab[3][(v >> 32) & 0xff] ^ crc_tab[2][(v >> 40) & 0xff] ^
              crc_tab[1][(v >> 48) & 0xff] ^ crc_tab[0][v >> 56];
    }
#endif
    while (n--) crc = crc_tab[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return crc;
}

/* Shifting a register past n zero bytes is linear over GF(2): a 32 x 32 bit
 * matrix, built by squaring the one-bit operator, then tabulated by byte.
 * It lets three independent streams of the crc32 instruction (its latency is
 * three times its throughput) be joined: crc(A B) = shift(crc(A), |B|) ^ crc(B)
 * for B's register started at 0. */
#define CRC_LONG 8192 /* bytes per stream in the long loop, and in the short one */
#define CRC_SHORT 256
static uint32_t crc_long[4][256], crc_short[4][256];

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    for (; vec; vec >>= 1, mat++)
        if (vec & 1) sum ^= *mat;
    return sum;
}

static void gf2_square(uint32_t *sq, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) sq[n] = gf2_times(mat, mat[n]);
}

/* The operator that appends `len` zero bytes (a power of two). */
static void crc_zeros_op(uint32_t *op, size_t len) {
    uint32_t odd[32], even[32];
    odd[0] = 0x82F63B78u; /* one zero bit: the reflected polynomial, then shifts */
    for (int n = 1; n < 32; n++) odd[n] = 1u << (n - 1);
    gf2_square(even, odd); /* two bits */
    gf2_square(odd, even); /* four bits */
    for (;;) {
        gf2_square(even, odd); /* 8, 32, 128, ... bits */
        len >>= 1;
        if (!len) {
            memcpy(op, even, sizeof even);
            return;
        }
        gf2_square(odd, even);
        len >>= 1;
        if (!len) {
            memcpy(op, odd, sizeof odd);
            return;
        }
    }
}

static void crc_zeros_table(uint32_t t[4][256], size_t len) {
    uint32_t op[32];
    crc_zeros_op(op, len);
    for (uint32_t b = 0; b < 256; b++)
        for (int k = 0; k < 4; k++) t[k][b] = gf2_times(op, b << (8 * k));
}

static uint32_t crc_shift(uint32_t t[4][256], uint32_t crc) {
    return t[0][crc & 0xff] ^ t[1][(crc >> 8) & 0xff] ^ t[2][(crc >> 16) & 0xff] ^ t[3][crc >> 24];
}

#if defined(__x86_64__)
/* SSE4.2's crc32 computes this polynomial (Castagnoli) itself; compiled for
 * that target whatever -march says, and used only where cpuid has it. */
__attribute__((target("sse4.2"))) static uint32_t crc_sse42(uint32_t crc, const unsigned char *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) crc = _mm_crc32_u8(crc, *p++), n--;
    uint64_t c0 = crc;
    for (int pass = 0; pass < 2; pass++) {
        size_t blk = pass == 0 ? CRC_LONG : CRC_SHORT;
        while (n >= 3 * blk) {
            uint64_t c1 = 0, c2 = 0;
            for (const unsigned char *end = p + blk; p < end; p += 8) {
                uint64_t a, b, c;
                memcpy(&a, p, 8), memcpy(&b, p + blk, 8), memcpy(&c, p + 2 * blk, 8);
                c0 = _mm_crc32_u64(c0, a), c1 = _mm_crc32_u64(c1, b), c2 = _mm_crc32_u64(c2, c);
            }
            uint32_t (*t)[256] = pass == 0 ? crc_long : crc_short;
            c0 = crc_shift(t, (uint32_t)c0) ^ (uint32_t)c1;
            c0 = crc_shift(t, (uint32_t)c0) ^ (uint32_t)c2;
            p += 2 * blk, n -= 3 * blk;
        }
    }
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c0 = _mm_crc32_u64(c0, v);
    }
    crc = (uint32_t)c0;
    while (n--) crc = _mm_crc32_u8(crc, *p++);
    return crc;
}
#endif

#if defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
static uint32_t crc_armv8(uint32_t crc, const unsigned char *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) crc = __crc32cb(crc, *p++), n--;
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        crc = __crc32cd(crc, v);
    }
    while (n--) crc = __crc32cb(crc, *p++);
    return crc;
}
#endif

static CrcFn crc_fn;
static const char *crc_name;
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc_tab[0][i] = c;
    }
    for (int k = 1; k < 8; k++)
        for (int i = 0; i < 256; i++) crc_tab[k][i] = crc_tab[0][crc_tab[k - 1][i] & 0xff] ^ (crc_tab[k - 1][i] >> 8);
    crc_zeros_table(crc_long, CRC_LONG);
    crc_zeros_table(crc_short, CRC_SHORT);
    crc_fn = crc_slice8, crc_name = "table";
#if defined(__x86_64__)
    if (__builtin_cpu_supports("sse4.2")) crc_fn = crc_sse42, crc_name = "sse4.2";
#endif
#if defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
    crc_fn = crc_armv8, crc_name = "armv8-crc";
#endif
}

uint32_t ckpt_crc32c(uint32_t crc, const void *data, size_t n) {
    pthread_once(&crc_once, crc_init);
    return ~crc_fn(~crc, data, n);
}

uint32_t ckpt_crc32c_table(uint32_t crc, const void *data, size_t n) {
    pthread_once(&crc_once, crc_init);
    return ~crc_slice8(~crc, data, n);
}

const char *ckpt_crc32c_impl(void) {
    pthread_once(&crc_once, crc_init);
    return crc_name;
}

static int io_direct = 1;
void ckpt_set_direct_io(int on) { io_direct = on != 0; }
int ckpt_direct_io(void) { return io_direct; }

/* Threads of this file take no signals: they belong to the step loop's handler. */
static int start_thread(pthread_t *t, void *(*fn)(void *), void *arg) {
    sigset_t all, prev;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &prev);
    int rc = pthread_create(t, NULL, fn, arg);
    pthread_sigmask(SIG_SETMASK, &prev, NULL);
    return rc;
}

/* touch: fault the pages in now (a writer's buffers, used for every save);
 * a load's are faulted in by its reader threads as they first fill them */
static unsigned char *aligned_buffer(size_t n, const char *what, int touch) {
    void *p = NULL;
    if (posix_memalign(&p, CKPT_IO_ALIGN, n) != 0)
        kiln_fail(KILN_EXIT_RUNTIME, "out of memory for the checkpoint %s buffers (%zu MiB)", what, n >> 20);
    if (touch) memset(p, 0, n);
    return p;
}

/* ---------- the sink ---------- */

#define SINK_QUEUE 64 /* write requests in flight at most (image mode hands over many) */

typedef struct {
    const unsigned char *p;
    size_t len;
    uint64_t off;
} SinkReq;

struct CkptSink {
    int nbuf, want_direct;
    unsigned char **buf;  /* (nbuf) CKPT_IO_CHUNK bytes each, CKPT_IO_ALIGN-aligned */
    uint64_t *buf_req;    /* (nbuf) number of the request that last took each buffer, 0 = none */
    int cur;              /* the buffer being filled */
    size_t fill;          /* its bytes */
    const unsigned char *image; /* image mode: the whole file, in memory */
    uint64_t image_sent;  /* image bytes handed to the thread */
    uint64_t pos;         /* bytes of the file so far */
    int fd, threaded;
    int opened_direct;    /* the file was opened with O_DIRECT: the tail is padded */
    int direct;           /* still writing with it (the thread may fall back) */
    uint64_t fault_left, written;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv_req, cv_done;
    SinkReq q[SINK_QUEUE];
    uint64_t q_head, q_done; /* requests submitted, completed (numbered from 1) */
    int stop, err;
    uint64_t failed_at;
};

CkptSink *ckpt_sink_new(int nbuf) {
    CkptSink *s = xcalloc(1, sizeof *s);
    s->nbuf = nbuf < 2 ? 2 : nbuf;
    s->want_direct = io_direct;
    s->buf = xcalloc((size_t)s->nbuf, sizeof *s->buf);
    s->buf_req = xcalloc((size_t)s->nbuf, sizeof *s->buf_req);
    for (int i = 0; i < s->nbuf; i++) s->buf[i] = aligned_buffer(CKPT_IO_CHUNK, "write", 1);
    s->fd = -1;
    s->failed_at = UINT64_MAX;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv_req, NULL);
    pthread_cond_init(&s->cv_done, NULL);
    return s;
}

void ckpt_sink_free(CkptSink *s) {
    if (!s) return;
    ckpt_sink_abort(s);
    for (int i = 0; i < s->nbuf; i++) free(s->buf[i]);
    free(s->buf);
    free(s->buf_req);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv_req);
    pthread_cond_destroy(&s->cv_done);
    free(s);
}

/* One request, whole: short writes continue; O_DIRECT refused for this
 * request's shape (EINVAL) or cut short (a full disk) goes on through the
 * page cache, so the error that ends it is the real one. 0 or an errno. */
static int sink_pwrite(CkptSink *s, const SinkReq *r) {
    const unsigned char *p = r->p;
    size_t left = r->len;
    uint64_t off = r->off;
    if (s->fault_left != UINT64_MAX && s->written + left > s->fault_left) return ENOSPC;
    while (left > 0) {
        ssize_t k = pwrite(s->fd, p, left, (off_t)off);
        if (k < 0 && errno == EINTR) continue;
        if ((k < 0 && errno == EINVAL && s->direct) || (k > 0 && (size_t)k < left && s->direct)) {
            int fl = fcntl(s->fd, F_GETFL);
            if (fl < 0 || fcntl(s->fd, F_SETFL, fl & ~O_DIRECT) != 0) return errno;
            s->direct = 0;
            if (k < 0) continue;
        }
        if (k < 0) return errno;
        if (k == 0) return EIO;
        p += k, left -= (size_t)k, off += (uint64_t)k, s->written += (uint64_t)k;
    }
    return 0;
}

static void *sink_thread(void *arg) {
    CkptSink *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (s->q_done == s->q_head && !s->stop) pthread_cond_wait(&s->cv_req, &s->mu);
        if (s->q_done == s->q_head) break;
        SinkReq r = s->q[s->q_done % SINK_QUEUE];
        int skip = s->err != 0; /* after a failure the rest are dropped */
        pthread_mutex_unlock(&s->mu);
        int e = skip ? 0 : sink_pwrite(s, &r);
        pthread_mutex_lock(&s->mu);
        if (e && !s->err) s->err = e, s->failed_at = r.off;
        s->q_done++;
        pthread_cond_broadcast(&s->cv_done);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* Hand a request to the thread (or, without one, write it here); returns its number. */
static uint64_t sink_submit(CkptSink *s, const unsigned char *p, size_t len, uint64_t off) {
    SinkReq r = {p, len, off};
    if (!s->threaded) {
        int e = s->err ? 0 : sink_pwrite(s, &r);
        if (e && !s->err) s->err = e, s->failed_at = off;
        s->q_done = ++s->q_head;
        return s->q_head;
    }
    pthread_mutex_lock(&s->mu);
    while (s->q_head - s->q_done >= SINK_QUEUE) pthread_cond_wait(&s->cv_done, &s->mu);
    s->q[s->q_head % SINK_QUEUE] = r;
    uint64_t n = ++s->q_head;
    pthread_cond_signal(&s->cv_req);
    pthread_mutex_unlock(&s->mu);
    return n;
}

/* Wait until request n is done; the sink's error (0 = none). */
static int sink_wait(CkptSink *s, uint64_t n) {
    if (!s->threaded) return s->err;
    pthread_mutex_lock(&s->mu);
    while (s->q_done < n) pthread_cond_wait(&s->cv_done, &s->mu);
    int e = s->err;
    pthread_mutex_unlock(&s->mu);
    return e;
}

static int sink_error(CkptSink *s) {
    if (!s->threaded) return s->err;
    pthread_mutex_lock(&s->mu);
    int e = s->err;
    pthread_mutex_unlock(&s->mu);
    return e;
}

/* -1 with errno once a write has failed, else 0. */
static int sink_failed(CkptSink *s) {
    int e = sink_error(s);
    if (e) errno = e;
    return e ? -1 : 0;
}

int ckpt_sink_open(CkptSink *s, const char *path, const unsigned char *image, uint64_t fault_left) {
    ckpt_sink_abort(s);
    s->direct = s->opened_direct = 0;
    s->fd = -1;
    if (s->want_direct) {
        s->fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT, 0644);
        s->direct = s->opened_direct = s->fd >= 0;
        if (s->fd < 0 && errno != EINVAL) return -1; /* EINVAL: this file system has no O_DIRECT */
    }
    if (s->fd < 0) s->fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (s->fd < 0) return -1;
    s->image = image, s->image_sent = 0;
    s->cur = 0, s->fill = 0, s->pos = 0;
    memset(s->buf_req, 0, (size_t)s->nbuf * sizeof *s->buf_req);
    s->q_head = s->q_done = 0;
    s->stop = 0, s->err = 0, s->failed_at = UINT64_MAX;
    s->fault_left = fault_left, s->written = 0;
    s->threaded = start_thread(&s->thread, sink_thread, s) == 0; /* else writes run inline */
    return 0;
}

unsigned char *ckpt_sink_space(CkptSink *s, size_t *avail) {
    int e = s->fill == 0 ? sink_wait(s, s->buf_req[s->cur]) : 0; /* its last write must be done */
    if (e) {
        errno = e;
        return NULL;
    }
    *avail = CKPT_IO_CHUNK - s->fill;
    return s->buf[s->cur] + s->fill;
}

int ckpt_sink_commit(CkptSink *s, size_t n) {
    s->fill += n, s->pos += n;
    if (s->fill == CKPT_IO_CHUNK) {
        s->buf_req[s->cur] = sink_submit(s, s->buf[s->cur], CKPT_IO_CHUNK, s->pos - CKPT_IO_CHUNK);
        s->cur = (s->cur + 1) % s->nbuf;
        s->fill = 0;
    }
    return sink_failed(s);
}

int ckpt_sink_put(CkptSink *s, const void *data, size_t n) {
    const unsigned char *p = data;
    while (n > 0) {
        size_t avail;
        unsigned char *dst = ckpt_sink_space(s, &avail);
        if (!dst) return -1;
        size_t k = n < avail ? n : avail;
        memcpy(dst, p, k);
        if (ckpt_sink_commit(s, k) != 0) return -1;
        p += k, n -= k;
    }
    return 0;
}

int ckpt_sink_image_ready(CkptSink *s, uint64_t upto) {
    s->pos = upto;
    while (s->pos - s->image_sent >= CKPT_IO_CHUNK) {
        sink_submit(s, s->image + s->image_sent, CKPT_IO_CHUNK, s->image_sent);
        s->image_sent += CKPT_IO_CHUNK;
    }
    return sink_failed(s);
}

uint64_t ckpt_sink_pos(const CkptSink *s) { return s->pos; }
uint64_t ckpt_sink_failed_at(const CkptSink *s) { return s->failed_at; }
uint64_t ckpt_sink_written(const CkptSink *s) { return s->written; }
int ckpt_sink_was_direct(const CkptSink *s) { return s->direct; }

/* Stop the thread once the requests handed over are done (or dropped). */
static void sink_stop(CkptSink *s) {
    if (!s->threaded) return;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_signal(&s->cv_req);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    s->threaded = 0;
}

int ckpt_sink_close(CkptSink *s) {
    /* the tail: O_DIRECT writes whole blocks, the padding is cut below */
    const unsigned char *tail = s->image ? s->image + s->image_sent : s->buf[s->cur];
    size_t tail_len = s->image ? (size_t)(s->pos - s->image_sent) : s->fill;
    uint64_t tail_off = s->pos - tail_len;
    if (tail_len > 0) {
        size_t padded = s->opened_direct ? (tail_len + CKPT_IO_ALIGN - 1) / CKPT_IO_ALIGN * CKPT_IO_ALIGN : tail_len;
        if (!s->image) memset(s->buf[s->cur] + tail_len, 0, padded - tail_len);
        sink_submit(s, tail, padded, tail_off);
    }
    sink_stop(s);
    int e = s->err;
    if (!e && s->written > s->pos && ftruncate(s->fd, (off_t)s->pos) != 0) e = errno, s->failed_at = UINT64_MAX;
    /* O_DIRECT moves the data to the device; fsync flushes its cache and
     * records the file's size and blocks */
    if (!e && fsync(s->fd) != 0) e = errno, s->failed_at = UINT64_MAX;
    if (close(s->fd) != 0 && !e) e = errno, s->failed_at = UINT64_MAX;
    s->fd = -1;
    if (e) {
        s->err = e;
        errno = e;
        return -1;
    }
    return 0;
}

void ckpt_sink_abort(CkptSink *s) {
    if (s->threaded) {
        pthread_mutex_lock(&s->mu);
        if (!s->err) s->err = ECANCELED; /* drop what is queued */
        pthread_mutex_unlock(&s->mu);
        sink_stop(s);
    }
    if (s->fd >= 0) close(s->fd);
    s->fd = -1;
}

/* ---------- the source ---------- */

#define SOURCE_RING 6                  /* chunks in memory: the one being read from, and ahead */
#define SOURCE_THREADS 2               /* O_DIRECT reads in flight (docs/benchmarks.md, "Checkpoints") */
#define SOURCE_GAP ((uint64_t)1 << 20) /* ranges closer than this are read as one */

typedef struct {
    uint64_t off, len, got; /* aligned file range; bytes read (short at the end of the file) */
    int done, err;
} SrcChunk;

struct CkptSource {
    unsigned char *ring[SOURCE_RING]; /* CKPT_IO_CHUNK each, aligned; chunk k reads into ring[k % SOURCE_RING] */
    int fd, direct;
    uint64_t size;                    /* the file's, at open */
    /* O_DIRECT: the file's chunks, handed to the threads in order */
    SrcChunk *ch;
    int nch, cap_ch, next, cur;       /* next: the next chunk a thread takes; cur: the caller's */
    pthread_t th[SOURCE_THREADS];
    int nth, stop;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* the page cache: the ranges, and file bytes [wlo, whi) in ring[0] */
    uint64_t *rlo, *rhi;
    int nr, cap_r, rcur;
    uint64_t wlo, whi;
};

CkptSource *ckpt_source_new(void) {
    CkptSource *s = xcalloc(1, sizeof *s);
    for (int i = 0; i < SOURCE_RING; i++) s->ring[i] = aligned_buffer(CKPT_IO_CHUNK, "read", 0);
    s->fd = -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    return s;
}

void ckpt_source_free(CkptSource *s) {
    if (!s) return;
    ckpt_source_close(s);
    for (int i = 0; i < SOURCE_RING; i++) free(s->ring[i]);
    free(s->ch);
    free(s->rlo);
    free(s->rhi);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}

/* Read chunk after chunk, at most SOURCE_RING ahead of the caller's. */
static void *source_thread(void *arg) {
    CkptSource *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->stop && s->next < s->nch && s->next >= s->cur + SOURCE_RING) pthread_cond_wait(&s->cv, &s->mu);
        if (s->stop || s->next >= s->nch) break;
        int k = s->next++;
        SrcChunk c = s->ch[k];
        unsigned char *buf = s->ring[k % SOURCE_RING];
        pthread_mutex_unlock(&s->mu);
        uint64_t got = 0;
        int e = 0;
        while (got < c.len) {
            ssize_t n = pread(s->fd, buf + got, (size_t)(c.len - got), (off_t)(c.off + got));
            if (n < 0 && errno == EINTR) continue;
            if (n < 0) e = errno;
            if (n <= 0) break;
            got += (uint64_t)n;
        }
        pthread_mutex_lock(&s->mu);
        s->ch[k].got = got, s->ch[k].err = e, s->ch[k].done = 1;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

static void source_chunk(CkptSource *s, uint64_t off, uint64_t len) {
    if (s->nch == s->cap_ch) s->cap_ch = s->cap_ch ? 2 * s->cap_ch : 64, s->ch = xrealloc(s->ch, (size_t)s->cap_ch * sizeof *s->ch);
    s->ch[s->nch++] = (SrcChunk){off, len, 0, 0, 0};
}

int ckpt_source_open(CkptSource *s, const char *path, const uint64_t *lo, const uint64_t *hi, int n) {
    ckpt_source_close(s);
    s->direct = 0;
    /* a regular file only (a FIFO would block the open or the reads
     * forever); O_DIRECT is set on that same descriptor where the file
     * system takes it (EINVAL where it has none: the page cache then) */
    s->fd = kiln_open_read(path, 0, &s->size);
    if (s->fd < 0) return -1;
    if (io_direct && fcntl(s->fd, F_SETFL, O_DIRECT) == 0) s->direct = 1;
    /* the ranges, near ones merged: what is read */
    s->nr = s->rcur = 0;
    for (int k = 0; k < n; k++) {
        if (s->nr && lo[k] <= s->rhi[s->nr - 1] + SOURCE_GAP) {
            if (hi[k] > s->rhi[s->nr - 1]) s->rhi[s->nr - 1] = hi[k];
            continue;
        }
        if (s->nr == s->cap_r) {
            s->cap_r = s->cap_r ? 2 * s->cap_r : 64;
            s->rlo = xrealloc(s->rlo, (size_t)s->cap_r * sizeof *s->rlo);
            s->rhi = xrealloc(s->rhi, (size_t)s->cap_r * sizeof *s->rhi);
        }
        s->rlo[s->nr] = lo[k], s->rhi[s->nr++] = hi[k];
    }
    s->wlo = s->whi = 0;
    s->nch = s->next = s->cur = 0;
    s->stop = 0;
    if (!s->direct) {
        posix_fadvise(s->fd, 0, 0, POSIX_FADV_SEQUENTIAL);
        return 0;
    }
    /* O_DIRECT: the ranges as aligned chunks, none read twice */
    uint64_t end = 0, fend = (s->size + CKPT_IO_ALIGN - 1) / CKPT_IO_ALIGN * CKPT_IO_ALIGN;
    for (int k = 0; k < s->nr; k++) {
        uint64_t a = s->rlo[k] / CKPT_IO_ALIGN * CKPT_IO_ALIGN, b = (s->rhi[k] + CKPT_IO_ALIGN - 1) / CKPT_IO_ALIGN * CKPT_IO_ALIGN;
        if (a < end) a = end;
        if (b > fend) b = fend;
        for (; a < b; a += CKPT_IO_CHUNK) source_chunk(s, a, b - a < CKPT_IO_CHUNK ? b - a : CKPT_IO_CHUNK);
        if (b > end) end = b;
    }
    s->nth = 0;
    for (int t = 0; t < SOURCE_THREADS && t < s->nch; t++)
        if (start_thread(&s->th[s->nth], source_thread, s) == 0) s->nth++;
    return 0;
}

/* O_DIRECT: the chunk holding off, once read. */
static const unsigned char *source_get_direct(CkptSource *s, uint64_t off, uint64_t len, uint64_t *got) {
    pthread_mutex_lock(&s->mu);
    while (s->cur < s->nch && s->ch[s->cur].off + s->ch[s->cur].len <= off) s->cur++, pthread_cond_broadcast(&s->cv);
    if (s->cur == s->nch || s->ch[s->cur].off > off) {
        pthread_mutex_unlock(&s->mu);
        *got = off >= s->size ? s->size : 0;
        errno = off >= s->size ? 0 : EINVAL; /* past the file, or bytes no range asked for */
        return NULL;
    }
    if (!s->nth && !s->ch[s->cur].done) {
        /* no thread could start: read here */
        pthread_mutex_unlock(&s->mu);
        SrcChunk *c = &s->ch[s->cur];
        while (c->got < c->len) {
            ssize_t n = pread(s->fd, s->ring[s->cur % SOURCE_RING] + c->got, (size_t)(c->len - c->got),
                              (off_t)(c->off + c->got));
            if (n < 0 && errno == EINTR) continue;
            if (n < 0) c->err = errno;
            if (n <= 0) break;
            c->got += (uint64_t)n;
        }
        c->done = 1;
        pthread_mutex_lock(&s->mu);
    }
    while (!s->ch[s->cur].done) pthread_cond_wait(&s->cv, &s->mu);
    SrcChunk c = s->ch[s->cur];
    const unsigned char *buf = s->ring[s->cur % SOURCE_RING];
    pthread_mutex_unlock(&s->mu);
    if (c.err) {
        errno = c.err;
        *got = 0;
        return NULL;
    }
    if (off >= c.off + c.got) { /* the file ends before */
        *got = c.off + c.got;
        errno = 0;
        return NULL;
    }
    uint64_t have = c.off + c.got - off;
    *got = have < len ? have : len;
    return buf + (off - c.off);
}

const unsigned char *ckpt_source_get(CkptSource *s, uint64_t off, uint64_t len, uint64_t *got) {
    if (s->direct) return source_get_direct(s, off, len, got);
    if (off < s->wlo || off >= s->whi) {
        /* one read up to the end of the range (or the buffer) */
        while (s->rcur < s->nr && s->rhi[s->rcur] <= off) s->rcur++;
        uint64_t want = s->rcur < s->nr && s->rhi[s->rcur] > off ? s->rhi[s->rcur] - off : len;
        if (want < len) want = len;
        if (want > CKPT_IO_CHUNK) want = CKPT_IO_CHUNK;
        uint64_t n = 0;
        while (n < want) {
            ssize_t k = pread(s->fd, s->ring[0] + n, (size_t)(want - n), (off_t)(off + n));
            if (k < 0 && errno == EINTR) continue;
            if (k < 0) {
                *got = 0;
                return NULL;
            }
            if (k == 0) break;
            n += (uint64_t)k;
        }
        s->wlo = off, s->whi = off + n;
        if (n == 0) {
            *got = s->size < off ? s->size : off;
            errno = 0;
            return NULL;
        }
    }
    uint64_t have = s->whi - off;
    *got = have < len ? have : len;
    return s->ring[0] + (off - s->wlo);
}

void ckpt_source_close(CkptSource *s) {
    if (s->nth) {
        pthread_mutex_lock(&s->mu);
        s->stop = 1;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        for (int t = 0; t < s->nth; t++) pthread_join(s->th[t], NULL);
        s->nth = 0;
    }
    if (s->fd >= 0) close(s->fd);
    s->fd = -1;
}

int ckpt_source_direct(const CkptSource *s) { return s->direct; }

uint64_t ckpt_source_size(const CkptSource *s) { return s->size; }
