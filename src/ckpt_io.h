/* ckpt_io: the byte-moving half of checkpoints — CRC32C (the CPU's crc32
 * instruction where present, a slicing-by-8 table elsewhere, identical
 * results), the sink that writes one file in large aligned chunks from a
 * thread of its own, and the source that reads one back ahead of its caller
 * (O_DIRECT where the file system takes it). Knows nothing of entries,
 * manifests or directories: ckpt.c and ckpt_read.c do. */
#ifndef KILN_CKPT_IO_H
#define KILN_CKPT_IO_H

#include <stddef.h>
#include <stdint.h>

/* O_DIRECT wants buffers, offsets and lengths on the logical block size;
 * 4096 covers 512- and 4096-byte devices. */
#define CKPT_IO_ALIGN ((size_t)4096)
/* One write request: large enough that a request's latency is small next to
 * its transfer (measured: docs/benchmarks.md, "Checkpoints"). */
#define CKPT_IO_CHUNK ((size_t)8 << 20)

/* ---- CRC32C ---- */
/* ckpt_crc32c (ckpt.h) through the slicing-by-8 table, whatever the CPU: for
 * tests, which compare it with the dispatched one. */
uint32_t ckpt_crc32c_table(uint32_t crc, const void *data, size_t n);
/* The implementation ckpt_crc32c dispatches to: "sse4.2", "armv8-crc" or "table". */
const char *ckpt_crc32c_impl(void);

/* Checkpoint files are read and written with O_DIRECT where the file system
 * takes it (1, the default), or always through the page cache (0):
 * checkpoint.direct_io. Applies to sinks and sources made afterwards. */
void ckpt_set_direct_io(int on);
int ckpt_direct_io(void);

/* ---- the sink ---- */
typedef struct CkptSink CkptSink;

/* A sink with `nbuf` aligned buffers of CKPT_IO_CHUNK bytes, touched now (a
 * save never page-faults them in). */
CkptSink *ckpt_sink_new(int nbuf);
void ckpt_sink_free(CkptSink *s);

/* Create `path` (truncated) and start the sink's writer thread. image != NULL:
 * the file is image[0, size) exactly, written from there without a copy
 * (image CKPT_IO_ALIGN-aligned, allocated to a multiple of CKPT_IO_ALIGN past
 * size) as ckpt_sink_image_ready says how far it is final; else bytes arrive
 * through ckpt_sink_space/commit or put. A write that would take the bytes
 * written past fault_left fails with ENOSPC (tests, KILN_FAULT_ENOSPC_AFTER;
 * UINT64_MAX: never). 0, or -1 with errno. */
int ckpt_sink_open(CkptSink *s, const char *path, const unsigned char *image, uint64_t fault_left);
/* Room in the current buffer: a pointer and *avail >= 1 bytes; waits while
 * every buffer is being written. NULL once a write has failed. */
unsigned char *ckpt_sink_space(CkptSink *s, size_t *avail);
/* n bytes of that room are filled (n <= *avail); a full buffer is handed to
 * the thread. -1 once a write has failed. */
int ckpt_sink_commit(CkptSink *s, size_t n);
/* Copy n bytes in (space + commit). */
int ckpt_sink_put(CkptSink *s, const void *data, size_t n);
/* Image mode: bytes [0, upto) of the image are final. */
int ckpt_sink_image_ready(CkptSink *s, uint64_t upto);
/* Bytes of the file so far (the next byte's offset). */
uint64_t ckpt_sink_pos(const CkptSink *s);
/* Write what is left, wait, cut the padding of the last block, fsync, close.
 * 0, or -1 with errno; ckpt_sink_failed_at then says which byte's write
 * failed (UINT64_MAX: the fsync or close). */
int ckpt_sink_close(CkptSink *s);
/* Stop writing and close (after a failure elsewhere); the file stays. */
void ckpt_sink_abort(CkptSink *s);
/* Offset of the first write that failed; UINT64_MAX if none did. */
uint64_t ckpt_sink_failed_at(const CkptSink *s);
/* Bytes written to the file by the last open (padding included), for the
 * fault budget. */
uint64_t ckpt_sink_written(const CkptSink *s);
/* 1 if the last open wrote with O_DIRECT. */
int ckpt_sink_was_direct(const CkptSink *s);


/* ---- the source: one file read front to back ----
 * With O_DIRECT, two threads read aligned CKPT_IO_CHUNK chunks ahead into a
 * ring of buffers while the caller checksums and copies the one before;
 * through the page cache, one read at a time with FADV_SEQUENTIAL (the
 * kernel reads ahead). */
typedef struct CkptSource CkptSource;
CkptSource *ckpt_source_new(void);
void ckpt_source_free(CkptSource *s);
/* Open path (a regular file: kiln_open_read) to read byte ranges [lo[k],
 * hi[k]) (sorted by lo, k < n) in that order. 0, or -1 with errno. */
int ckpt_source_open(CkptSource *s, const char *path, const uint64_t *lo, const uint64_t *hi, int n);
/* File bytes at off (inside a range, and never before an earlier call's):
 * a pointer to *got of them, 1 <= *got <= len, valid until the next call;
 * NULL at the end of the file (*got = its size) or on an error (errno set,
 * *got = 0). */
const unsigned char *ckpt_source_get(CkptSource *s, uint64_t off, uint64_t len, uint64_t *got);
void ckpt_source_close(CkptSource *s);
/* 1 if the open file reads with O_DIRECT. */
int ckpt_source_direct(const CkptSource *s);
/* The open file's size, from its open. */
uint64_t ckpt_source_size(const CkptSource *s);

#endif
