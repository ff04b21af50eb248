/* fuzz_tiktoken: a tiktoken rank file ("base64(token) rank" lines) loaded as
 * GPT-2's vocabulary; one that loads must encode and decode a text back to
 * itself. Runs in a child: the loader exits 2 on a bad file (fuzz.h). */
#include "fuzz.h"
#include "tokenizer.h"

static void load(const uint8_t *d, size_t n) {
    Tokenizer *t = tok_open("gpt2", fuzz_file("ranks.tiktoken", d, n));
    static const char text[] = "It is a truth universally acknowledged, that 1,000 single men... \xe2\x80\x94 \xc3\xa9t\xc3\xa9!";
    uint32_t *ids = NULL;
    size_t k = 0, cap = 0, o = 0;
    tok_encode(t, text, sizeof text - 1, &ids, &k, &cap);
    char back[sizeof text + 64];
    for (size_t i = 0; i < k; i++) {
        size_t m = tok_decode(t, ids[i], back + o, sizeof back - o);
        if (m == 0 || m > sizeof back - o) abort(); /* an id the vocabulary does not hold, or text longer than in */
        o += m;
    }
    if (o != sizeof text - 1 || memcmp(back, text, o)) abort(); /* decode(encode(x)) != x */
    free(ids);
    tok_free(t);
}

FUZZ_NOCOV int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {
    fuzz_fork(load, d, n);
    return 0;
}
