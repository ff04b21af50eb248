/* shard: token shards on disk. The llm.c .bin layout (256 x int32 header, magic
 * 20240520, version 1 = uint16 tokens, 2 = uint32), optionally whole-file zstd
 * (.bin.zst); an index of a glob from the headers alone, samples read on demand
 * through a bounded cache of open shards, and the writer. Never knows sample
 * order, mixtures, ranks or the model. */
#ifndef KILN_SHARD_H
#define KILN_SHARD_H

#include <stddef.h>
#include <stdint.h>

#define SHARD_MAGIC 20240520
#define SHARD_HEADER_INTS 256

/* A failure found while reading: one line naming the shard, and what to do.
 * Reads return it instead of exiting because they may run on the prefetch
 * thread; the loader reports it from the main thread (exit 2). */
typedef struct ShardError {
    int code; /* exit code: 2 (bad or changed data), 1 (an I/O error) */
    char msg[1400];
    char hint[320];
} ShardError;

/* Open shards shared by every ShardSet of one loader: at most `max_open` at
 * once (file descriptors; an open .bin.zst also holds its decompressed
 * tokens), the least recently used closed first. Used by one thread at a time. */
typedef struct ShardCache ShardCache;
ShardCache *shard_cache_new(int max_open);
void shard_cache_free(ShardCache *c);

typedef struct ShardSet ShardSet;

/* Index every file matching `pattern` (strcmp order) from its size and header:
 * a few dozen bytes per shard, nothing mapped or kept open. A sample is T+1
 * tokens starting at a multiple of T inside one shard. Exits 2, naming `what`
 * (the config key) or the shard, on: no match, not a regular file, bad magic or
 * version, a size that disagrees with the header (.bin), no sample in any
 * shard. Shards too short for a sample are skipped with a warning. */
ShardSet *shard_index(const char *pattern, const char *what, int T, int vocab_size, ShardCache *cache);
void shard_set_free(ShardSet *s);

uint64_t shard_set_samples(const ShardSet *s);
uint64_t shard_set_tokens(const ShardSet *s);
int shard_set_count(const ShardSet *s);

/* Sample i (< shard_set_samples) into in[T] (its first T tokens) and tg[T]
 * (its last T). The first read of a shard checks every id < vocab_size; every
 * read checks that the file is still the one indexed (not deleted, replaced or
 * truncated). Returns 0, or -1 with *e filled. Never exits. */
int shard_read_sample(ShardSet *s, uint64_t i, int32_t *in, int32_t *tg, ShardError *e);

/* Write one shard: header + tokens, uint16 if every id < 65536 else uint32,
 * zstd-compressed (with a frame checksum) if zstd_level > 0 (the name should
 * then end in .zst). Through a temp file and a rename; exits 1 on I/O error. */
void shard_write(const char *path, const uint32_t *tokens, size_t n, int zstd_level);

#endif
