/* data: token shards on disk -> batches of (inputs, targets) in a deterministic
 * global order. Reads the llm.c .bin layout (256 x int32 header, magic 20240520,
 * version 1 = uint16 tokens, version 2 = uint32 tokens), optionally
 * zstd-compressed (.bin.zst). Never touches the model or the backend. */
#ifndef KILN_DATA_H
#define KILN_DATA_H

#include <stdint.h>
#include <stddef.h>

#define DATA_MAGIC 20240520
#define DATA_HEADER_INTS 256

/* Where the loader is in its global order: enough to resume exactly. */
typedef struct DataPos {
    uint64_t epoch;
    uint64_t index; /* next sample of this epoch's global order */
} DataPos;

typedef struct DataLoader DataLoader;

/* Open every shard matching `glob` (sorted by name). Each sample is T+1
 * consecutive tokens of one shard (inputs = first T, targets = last T); samples
 * start at multiples of T. If `shuffle`, each epoch visits the samples in a
 * permutation drawn from (seed, epoch); otherwise in file order. This process
 * takes samples rank, rank+world, ... of each global batch of B*world samples,
 * so the tokens seen do not depend on the number of ranks.
 * Every error (no match, unreadable, bad magic/version, truncated, token id >=
 * vocab_size with shard name and offset) exits 2. `what` names the config key
 * for messages ("data.train"). */
DataLoader *data_open(const char *glob, const char *what, int B, int T, int vocab_size,
                      int shuffle, uint64_t seed, int rank, int world);
void data_close(DataLoader *dl);

/* Fill inputs (B,T) and targets (B,T). Wraps to the next epoch at the end. */
void data_next_batch(DataLoader *dl, int32_t *inputs, int32_t *targets);

/* Position for checkpoints; set restores it exactly. reset = {0, 0}. */
DataPos data_get_pos(const DataLoader *dl);
void data_set_pos(DataLoader *dl, DataPos pos);

/* Totals over all shards. */
uint64_t data_num_tokens(const DataLoader *dl);
uint64_t data_num_samples(const DataLoader *dl);
int data_num_shards(const DataLoader *dl);

/* Write one shard: header + tokens, uint16 if every id < 65536 else uint32,
 * zstd-compressed if `zstd_level` > 0 (file name should then end in .zst).
 * Written through a temp file and renamed. Returns 0 or exits 1 on I/O error. */
int data_write_shard(const char *path, const uint32_t *tokens, size_t n, int zstd_level);

#endif
