/* data: token shards (shard.h) -> batches of (inputs, targets) in one
 * deterministic global order: a weighted mixture of sources blended sample by
 * sample, each source in its own seeded order, epoch after epoch; this rank
 * takes its slice of every global batch; a thread may read ahead. Never
 * touches the model or the backend. */
#ifndef KILN_DATA_H
#define KILN_DATA_H

#include <stddef.h>
#include <stdint.h>

/* One glob of shards in a mixture. */
typedef struct DataSource {
    const char *name;  /* for metrics and messages ("web") */
    const char *path;  /* glob */
    double weight;     /* > 0: its share of the samples is weight / sum of weights */
} DataSource;

typedef struct DataOptions {
    const char *what;          /* config key for messages: "data.train", "data.val" */
    const DataSource *sources; /* (n_sources) */
    int n_sources;
    int mixture;               /* 0: one plain glob (the order of earlier kiln versions), 1: a list */
    int B, T, vocab_size;      /* B samples of T + 1 tokens per batch of this rank */
    int shuffle;               /* 1: a fresh seeded permutation per source and epoch; 0: file order */
    uint64_t seed;
    int rank, world;           /* this rank takes samples rank, rank + world, ... of each global batch */
    int prefetch;              /* batches a background thread reads ahead; 0 = read in data_next_batch */
    int max_open;              /* shards open at once (file handles); 0 = 64 */
} DataOptions;

typedef struct DataLoader DataLoader;

/* Index every source (shard_index: exits 2 naming the key or the shard on bad
 * input); nothing is read until the first batch. */
DataLoader *data_open(const DataOptions *o);
void data_close(DataLoader *dl);

/* Fill inputs (B,T) and targets (B,T) with the next batch. A shard found
 * broken, deleted or truncated (even by the prefetch thread) exits 2 here,
 * naming it. */
void data_next_batch(DataLoader *dl, int32_t *inputs, int32_t *targets);

/* Back to the very start of the order (evaluation, a fresh start). */
void data_rewind(DataLoader *dl);

/* The position of a one-source loader as kiln versions before mixtures saved
 * it ("data.train.pos"): the next sample of the global order. */
typedef struct DataPos {
    uint64_t epoch;
    uint64_t index; /* next sample of this epoch */
} DataPos;
DataPos data_get_pos(const DataLoader *dl);       /* a mixture: {0, global samples drawn} */
void data_set_pos(DataLoader *dl, DataPos pos);   /* one source only; index past the data exits 2 */

/* The whole position ("data.train.state" in checkpoints, docs/formats.md):
 * data_state_words() uint64 words, valid for this loader's sources. */
size_t data_state_words(const DataLoader *dl);
void data_get_state(const DataLoader *dl, uint64_t *words);
/* Restore a saved state. The same sources, weights and sample counts resume
 * exactly; anything else exits 2 naming data.train unless `force`, which
 * continues every source still present from its own saved position (new ones
 * from their start) and restarts the blend there; *note then says so (else ""). */
void data_set_state(DataLoader *dl, const uint64_t *words, size_t n, int force, char *note, size_t cap);
/* Whether n words can be a state data_get_state wrote, for any sources: the
 * version and counts, and the counters' invariants (no counter past 2^62,
 * the blend's counts summing to the samples drawn since it began). 0, or -1
 * with one line in err. data_set_state checks it too. */
int data_state_check(const uint64_t *words, size_t n, char *err, size_t cap);
/* Whether a saved one-source position lies past what any run draws. */
int data_pos_check(DataPos pos, char *err, size_t cap);

/* Totals over all sources. */
uint64_t data_num_tokens(const DataLoader *dl);
uint64_t data_num_samples(const DataLoader *dl);
int data_num_shards(const DataLoader *dl);

/* Per source, in config order. tokens: T per sample drawn so far, all ranks
 * together (every rank walks the whole global batch). */
int data_num_sources(const DataLoader *dl);
const char *data_source_name(const DataLoader *dl, int i);
uint64_t data_source_tokens(const DataLoader *dl, int i);

/* Seconds spent waiting inside data_next_batch since the last call. */
double data_take_wait_s(DataLoader *dl);
/* Something for the log (a source starting a new epoch): 1 and the line in
 * buf, until there is nothing left; then 0. */
int data_take_note(DataLoader *dl, char *buf, size_t cap);
/* One line: the sources, their shards, tokens and weights. */
void data_describe(const DataLoader *dl, char *buf, size_t cap);

#endif
