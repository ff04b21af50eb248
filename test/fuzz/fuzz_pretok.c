/* fuzz_pretok: GPT-2's pre-tokeniser and BPE on any bytes (invalid UTF-8
 * included), through a vocabulary of GPT-2's size made here (every byte, then
 * byte pairs): decode(encode(x)) must give x back, byte for byte.
 * Never exits: a vocabulary the loader accepts and any text encode. */
#include "fuzz.h"
#include "tokenizer.h"

FUZZ_NOCOV int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n);
int LLVMFuzzerInitialize(int *argc, char ***argv);

static Tokenizer *tok;

static size_t b64(const unsigned char *s, size_t n, char *out) {
    static const char A[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)s[i] << 16 | (i + 1 < n ? (uint32_t)s[i + 1] << 8 : 0) | (i + 2 < n ? s[i + 2] : 0);
        out[o++] = A[v >> 18 & 63], out[o++] = A[v >> 12 & 63];
        out[o++] = i + 1 < n ? A[v >> 6 & 63] : '=', out[o++] = i + 2 < n ? A[v & 63] : '=';
    }
    return o;
}

/* 50,256 ranks: the 256 bytes, then byte pairs, those of letters, digits and
 * spaces first (so that merges happen in text as in GPT-2's) */
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    size_t cap = 50256 * 16, o = 0;
    char *text = xmalloc(cap);
    int r = 0;
    unsigned char tokb[3];
    for (int b = 0; b < 256; b++) tokb[0] = (unsigned char)b, o += b64(tokb, 1, text + o), o += (size_t)sprintf(text + o, " %d\n", r++);
    static const char pri[] = " etaoinshrdlucmfwypvbgkjqxzETAOINSHRDLUCMFWYPVBGKJQXZ0123456789.,'\n";
    for (int i = 0; pri[i] && r < 50256; i++)
        for (int j = 0; pri[j] && r < 50256; j++) tokb[0] = (unsigned char)pri[i], tokb[1] = (unsigned char)pri[j], o += b64(tokb, 2, text + o), o += (size_t)sprintf(text + o, " %d\n", r++);
    for (int i = 0; i < 256 && r < 50256; i++)
        for (int j = 0; j < 256 && r < 50256; j++) {
            if (strchr(pri, i) && strchr(pri, j) && i && j) continue; /* written above */
            tokb[0] = (unsigned char)i, tokb[1] = (unsigned char)j, o += b64(tokb, 2, text + o), o += (size_t)sprintf(text + o, " %d\n", r++);
        }
    tok = tok_open("gpt2", fuzz_file("synthetic.tiktoken", text, o));
    free(text);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {
    uint32_t *ids = NULL;
    size_t k = 0, cap = 0, o = 0;
    tok_encode(tok, (const char *)d, n, &ids, &k, &cap);
    char *back = xmalloc(n + 1);
    for (size_t i = 0; i < k; i++) {
        char b[64];
        size_t m = tok_decode(tok, ids[i], b, sizeof b);
        if (m == 0 || m > sizeof b || o + m > n) abort(); /* an unknown id, or more text than went in */
        memcpy(back + o, b, m), o += m;
    }
    if (o != n || (n && memcmp(back, d, n))) abort(); /* decode(encode(x)) != x */
    free(back);
    free(ids);
    return 0;
}
