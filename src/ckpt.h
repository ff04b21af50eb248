/* ckpt: checkpoint directories — write, verify, load, reshard. State arrives as
 * one table of named entries (tensors with logical shape, dtype and this rank's
 * shard range; small blobs such as RNG state and data position) that train.c
 * collects from the model, optimizer and loader. ckpt knows that table and the
 * mesh, never the model or the optimizer. Format: docs/formats.md. */
#ifndef KILN_CKPT_H
#define KILN_CKPT_H

#include <stddef.h>
#include <stdint.h>

#define CKPT_FORMAT_VERSION 1
#define CKPT_MAX_DIM 4
#define CKPT_NAME 96
#define CKPT_MANIFEST_NAME "manifest" /* in every checkpoint directory */

typedef enum { CKPT_TENSOR, CKPT_BLOB } CkptKind;
typedef enum { CKPT_F32, CKPT_F64, CKPT_I64, CKPT_U64, CKPT_U8 } CkptDtype;

/* Copies between the entry's memory and the host (backend to_host/to_device);
 * NULL = the pointer is host memory. bytes counts the checkpoint's side (the
 * dtype's size per element). A copy may convert (mem_size below): to_device's
 * src is then ckpt's own scratch buffer, which it may overwrite. to_host's
 * dst lies in the file's bytes and need not be aligned to an element. */
typedef void (*CkptCopyFn)(void *dst, const void *src, size_t bytes);

typedef struct CkptEntry {
    char name[CKPT_NAME];   /* "wte", "optim.m/wte", "rng.train", ... no spaces */
    CkptKind kind;
    CkptDtype dtype;
    int ndim;                   /* 0 = scalar */
    int64_t shape[CKPT_MAX_DIM];/* logical (whole, unsharded) shape */
    uint64_t lo, hi;            /* this rank holds flat elements [lo, hi) of it, or of its box */
    /* A box (ckpt_entry_set_box; all 0: the whole tensor): rows [r0, r1) x
     * columns [c0, c1) of the tensor viewed as (shape[0], the rest), whose
     * elements, row-major, [lo, hi) indexes. A tensor-parallel part. */
    uint64_t r0, r1, c0, c1;
    void *ptr;                  /* (hi-lo) elements, on the device if to_host is set */
    CkptCopyFn to_host, to_device;
    size_t mem_size;            /* bytes per element at ptr when the copies convert (bf16 AdamW
                                   moments saved as fp32); 0 = the dtype's size */
} CkptEntry;

typedef struct CkptTable {
    CkptEntry *e;
    int n, cap;
} CkptTable;

/* Mesh the state is laid out over (one rank, one piece per tensor, today). */
typedef struct CkptMesh {
    int world, rank, dp, tp, pp, cp, ep;
} CkptMesh;

/* What a save records besides the table. */
typedef struct CkptMeta {
    int64_t step;
    uint64_t config_hash;
    const char *version, *commit;
    CkptMesh mesh;
} CkptMeta;

typedef struct CkptOptions {
    char root[1024];  /* the checkpoints directory: root/step_00001000/, root/latest */
    int keep_last;    /* 0 = keep all */
    int keep_every;   /* milestones: step % keep_every == 0 never deleted; 0 = none */
    int async;        /* stage into a host buffer, write from a thread */
    int compress;     /* zstd level, 0 = none */
    int threads;      /* zstd workers per entry's frame; 0 or 1 = the writer's own thread
                         (O_DIRECT or not: ckpt_set_direct_io, ckpt_io.h) */
    /* Several ranks writing one checkpoint (meta->mesh.world > 1):
     * agree(ctx, failed) is a collective over every rank that returns nonzero
     * if any rank passed failed != 0. ckpt stays free of comm; state.c passes
     * an all-reduce. Rank 0 owns the directory: it creates step_N.tmp/,
     * merges every rank's part of the manifest, renames and updates `latest`;
     * each rank writes its own rankNNNNN.bin. With async, each rank's file is
     * written by its thread and the merge runs in the first ckpt_wait after
     * every rank's thread is done (ckpt_pending tells when), on the main
     * thread: agree is only ever called from the thread that calls ckpt_*. */
    int (*agree)(void *ctx, int failed);
    void *agree_ctx;
} CkptOptions;

/* ---- the table ---- */
void ckpt_table_init(CkptTable *t);
void ckpt_table_free(CkptTable *t);
/* Add a whole (unsharded) tensor or a slice [lo, hi) of its flat elements. */
CkptEntry *ckpt_add_tensor(CkptTable *t, const char *name, CkptDtype dtype, int ndim, const int64_t *shape,
                           uint64_t lo, uint64_t hi, void *ptr, CkptCopyFn to_host, CkptCopyFn to_device);
/* Make e's range index a box of its tensor (see CkptEntry) instead of the
 * whole; [lo, hi) must lie inside the box's elements. */
void ckpt_entry_set_box(CkptEntry *e, uint64_t r0, uint64_t r1, uint64_t c0, uint64_t c1);
/* A host blob of `count` elements (count 0 with ndim 0 = scalar). */
CkptEntry *ckpt_add_blob(CkptTable *t, const char *name, CkptDtype dtype, size_t count, int scalar, void *ptr);
size_t ckpt_entry_bytes(const CkptEntry *e);
size_t ckpt_dtype_size(CkptDtype d);
const char *ckpt_dtype_name(CkptDtype d); /* "f32", ... as the manifest writes it */
/* Rows and columns of a tensor viewed as (shape[0], the rest), the frame of
 * boxes; a scalar is 1 x 1. */
void ckpt_tensor_rc(int ndim, const int64_t *shape, uint64_t *rows, uint64_t *cols);

/* ---- writing ---- */
typedef struct CkptWriter CkptWriter;
/* Plan a writer for this table: with o->async, the host staging buffer for
 * every entry is allocated here, once. Never allocates per save afterwards
 * except the thread itself. */
CkptWriter *ckpt_writer_new(const CkptTable *t, const CkptOptions *o);
/* Save the table's current contents as checkpoint `meta->step`: waits for a
 * write in flight, then writes (or, async, stages and starts the thread).
 * Returns 0, or -1 with the reason in ckpt_writer_error() (the previous
 * checkpoints are untouched and the .tmp directory is removed). */
int ckpt_save(CkptWriter *w, const CkptMeta *meta);
/* Wait for the write in flight, if any. 0 or -1 as ckpt_save. With several
 * ranks and async it completes the checkpoint (a collective: every rank calls
 * it at the same point). */
int ckpt_wait(CkptWriter *w);
/* 1 while this rank's async write is still running (never blocks). */
int ckpt_pending(const CkptWriter *w);
/* 1 from an async save until the ckpt_wait that ends it. */
int ckpt_in_flight(const CkptWriter *w);
const char *ckpt_writer_error(const CkptWriter *w);
/* The last save that completed on this rank: what it wrote and how long
 * that took. Read it after ckpt_save (sync) or ckpt_wait (async). */
typedef struct CkptStats {
    int64_t step;     /* -1: none yet */
    double write_s;   /* this rank's file, written and fsynced, and the checkpoint completed
                         (merge, rename, `latest`: rank 0); the staging copy is not in it */
    uint64_t bytes;   /* this rank's entries, uncompressed */
    uint64_t stored;  /* the rank file's size */
    int direct;       /* written with O_DIRECT */
} CkptStats;
CkptStats ckpt_writer_stats(const CkptWriter *w);
/* Wait, then free. */
void ckpt_writer_free(CkptWriter *w);

/* ---- reading ---- */
typedef struct CkptInfo {
    int format;
    int64_t step;
    uint64_t config_hash;
    char version[64], commit[64];
    CkptMesh mesh;
} CkptInfo;

/* Load every entry of `t` from checkpoint directory `dir`, assembling each
 * from whichever pieces of the saved tensor overlap its range, and verifying
 * the checksum of every piece it reads. Blobs must match in size. Returns 0,
 * or -1 with one line in err naming the file or entry (the table's memory may
 * then be partly overwritten). */
int ckpt_load(const char *dir, const CkptTable *t, CkptInfo *info, char *err, size_t errcap);
/* Read and verify every piece in the manifest, without a table. */
int ckpt_verify(const char *dir, CkptInfo *info, char *err, size_t errcap);
/* A blob by name (malloc'd, verified); NULL with err on failure. */
void *ckpt_read_blob(const char *dir, const char *name, size_t *len, char *err, size_t errcap);
/* 1 if dir holds a manifest (looks like a kiln checkpoint). */
int ckpt_is_checkpoint(const char *dir);

/* Complete checkpoint directories under root (step_N without .tmp), newest
 * first. Returns the count; *names (malloc'd array of malloc'd full paths). */
int ckpt_list(const char *root, char ***paths, int64_t **steps);
/* ckpt_list, less the directories above the step `latest` names (another
 * timeline's); all of them when there is no readable `latest`. */
int ckpt_list_current(const char *root, char ***paths, int64_t **steps);
void ckpt_list_free(char **paths, int64_t *steps, int n);

/* ./train ckpt-info DIR: the manifest, every entry verified, its checksum. */
int ckpt_info_main(int argc, char **argv);
/* ./train ckpt-diff A B [--tol X]: largest absolute difference of every f32
 * tensor, each assembled whole from any layout; exit 1 past --tol. */
int ckpt_diff_main(int argc, char **argv);

/* CRC32C (Castagnoli) of data, continuing from crc (start with 0). */
uint32_t ckpt_crc32c(uint32_t crc, const void *data, size_t n);

#endif
