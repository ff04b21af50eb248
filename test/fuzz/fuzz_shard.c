/* fuzz_shard: one token shard, plain (.bin) or zstd (.bin.zst: an input that
 * starts with zstd's magic), indexed as data.train with a 4-token context and
 * GPT-2's vocabulary, then every sample read (at most 4096). Runs in a child:
 * the index exits 2 on a bad shard, and a read that fails is reported as the
 * loader does, exit 2 naming the shard (fuzz.h). */
#include "fuzz.h"
#include "shard.h"

#define T 4

static void read_all(const uint8_t *d, size_t n) {
    int zst = n >= 4 && d[0] == 0x28 && d[1] == 0xb5 && d[2] == 0x2f && d[3] == 0xfd;
    const char *path = fuzz_file(zst ? "shard.bin.zst" : "shard.bin", d, n);
    ShardCache *c = shard_cache_new(2);
    ShardSet *s = shard_index(path, "data.train", T, 50257, c);
    int32_t in[T], tg[T];
    uint64_t ns = shard_set_samples(s);
    for (uint64_t i = 0; i < ns && i < 4096; i++) {
        ShardError e;
        if (shard_read_sample(s, i, in, tg, &e) != 0)
            kiln_fail_hint(e.code ? e.code : KILN_EXIT_USAGE, e.hint[0] ? e.hint : NULL, "%s", e.msg);
        for (int t = 0; t < T; t++)
            if (in[t] < 0 || in[t] >= 50257 || tg[t] < 0 || tg[t] >= 50257) abort(); /* ids were checked */
    }
    shard_set_free(s);
    shard_cache_free(c);
}

FUZZ_NOCOV int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {
    fuzz_fork(read_all, d, n);
    return 0;
}
