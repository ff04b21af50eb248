/* test_tokenizer: byte and GPT-2 tokenizers (round trips, known ids, speed), and
 * an --encode mode that prints the ids of a file, one per line, for
 * test/t_tokenizer_tiktoken.sh to compare against tiktoken. Reads only. */
#include "test.h"
#include "tokenizer.h"
#include "util.h"

#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define GPT2_VOCAB "data/cache/gpt2.tiktoken"

/* ./test_tokenizer --encode FILE VOCAB: ids of FILE (gpt2 with VOCAB, or byte if
 * VOCAB is "byte") on stdout, one per line; the encode time on stderr. */
static int encode_file(const char *path, const char *vocab) {
    size_t len;
    char *text = kiln_read_file(path, &len);
    if (!text) kiln_fail(KILN_EXIT_USAGE, "%s: cannot read", path);
    Tokenizer *t = strcmp(vocab, "byte") == 0 ? tok_open("byte", NULL) : tok_open("gpt2", vocab);
    uint32_t *ids = NULL;
    size_t n = 0, cap = 0;
    double t0 = kiln_now();
    tok_encode(t, text, len, &ids, &n, &cap);
    double dt = kiln_now() - t0;
    for (size_t i = 0; i < n; i++) printf("%u\n", ids[i]);
    fprintf(stderr, "encoded %zu bytes -> %zu tokens in %.3f s (%.1f MB/s)\n", len, n, dt,
            dt > 0 ? len / dt / 1e6 : 0.0);
    free(ids);
    free(text);
    tok_free(t);
    return 0;
}

/* Encode, then decode every id and compare with the input bytes. */
static int round_trip(const Tokenizer *t, const char *text, size_t len, char *why, size_t why_n) {
    uint32_t *ids = NULL;
    size_t n = 0, cap = 0;
    tok_encode(t, text, len, &ids, &n, &cap);
    char *out = xmalloc(len + 64);
    size_t m = 0;
    int ok = 1;
    for (size_t i = 0; i < n && ok; i++) {
        char buf[256];
        size_t k = tok_decode(t, ids[i], buf, sizeof buf);
        if (k == 0 || k > sizeof buf || m + k > len) {
            snprintf(why, why_n, "id %u at %zu decodes to %zu bytes", ids[i], i, k);
            ok = 0;
            break;
        }
        memcpy(out + m, buf, k);
        m += k;
    }
    if (ok && (m != len || memcmp(out, text, len) != 0)) {
        snprintf(why, why_n, "decoded %zu bytes differ from the %zu input bytes", m, len);
        ok = 0;
    }
    free(out);
    free(ids);
    return ok;
}

static void test_byte(void) {
    Tokenizer *t = tok_open("byte", NULL);
    test_report(tok_vocab_size(t) == 256 && tok_eot(t) == -1, "tokenizer_byte_vocab",
                "vocab %d eot %d", tok_vocab_size(t), tok_eot(t));
    char all[256];
    for (int i = 0; i < 256; i++) all[i] = (char)i;
    uint32_t *ids = NULL;
    size_t n = 0, cap = 0;
    tok_encode(t, all, 256, &ids, &n, &cap);
    int ok = n == 256;
    for (size_t i = 0; ok && i < n; i++) ok = ids[i] == i;
    test_report(ok, "tokenizer_byte_ids", "byte b must encode to id b");
    char why[256] = "";
    test_report(round_trip(t, all, 256, why, sizeof why), "tokenizer_byte_round_trip", "%s", why);
    free(ids);
    tok_free(t);
}

static int ids_equal(const uint32_t *a, size_t na, const uint32_t *b, size_t nb) {
    return na == nb && memcmp(a, b, na * sizeof(uint32_t)) == 0;
}

static void test_gpt2(void) {
    if (access(GPT2_VOCAB, R_OK) != 0) {
        printf("skip tokenizer_gpt2: %s missing (scripts/fetch_gpt2_vocab.sh)\n", GPT2_VOCAB);
        return;
    }
    Tokenizer *t = tok_open("gpt2", GPT2_VOCAB);
    test_report(tok_vocab_size(t) == 50257 && tok_eot(t) == 50256, "tokenizer_gpt2_vocab",
                "vocab %d eot %d", tok_vocab_size(t), tok_eot(t));

    /* Known ids from tiktoken's gpt2 encoding. */
    static const struct {
        const char *text;
        uint32_t ids[8];
        size_t n;
    } known[] = {
        {"Hello world", {15496, 995}, 2},
        {"Hello, world!", {15496, 11, 995, 0}, 4},
        {" don't", {836, 470}, 2},
        {"  \n\n", {220, 220, 628}, 3},
    };
    for (size_t k = 0; k < sizeof known / sizeof known[0]; k++) {
        uint32_t *ids = NULL;
        size_t n = 0, cap = 0;
        tok_encode(t, known[k].text, strlen(known[k].text), &ids, &n, &cap);
        char name[64];
        snprintf(name, sizeof name, "tokenizer_gpt2_known_%zu", k);
        test_report(ids_equal(ids, n, known[k].ids, known[k].n), name, "'%s': got %zu ids, first %u",
                    known[k].text, n, n ? ids[0] : 0);
        free(ids);
    }

    char buf[64];
    size_t k = tok_decode(t, 50256, buf, sizeof buf);
    test_report(k == 13 && memcmp(buf, "<|endoftext|>", 13) == 0, "tokenizer_gpt2_decode_eot",
                "got %zu bytes", k);
    test_report(tok_decode(t, 50257, buf, sizeof buf) == 0, "tokenizer_gpt2_decode_unknown",
                "id 50257 must decode to nothing");

    static const char tricky[] =
        "I'm sure they'll say we've done it; she'd won't. 'Tis THEY'RE 12345 3.14\n\n"
        "   multiple   spaces   \t\ttabs\r\nCRLF  trailing   \n"
        "caf\xc3\xa9 Stra\xc3\x9f" "e \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x98\x80!!! ...?! "
        "invalid \xff\xfe bytes \xc3 end";
    char why[256] = "";
    test_report(round_trip(t, tricky, sizeof tricky - 1, why, sizeof why),
                "tokenizer_gpt2_round_trip_tricky", "%s", why);

    size_t len;
    char *austen = kiln_read_file("data/austen.txt", &len);
    if (austen) {
        /* Round trip on the whole corpus; its speed is printed, never
         * asserted (a loaded machine or a sanitizer build may take any time). */
        uint32_t *ids = NULL;
        size_t n = 0, cap = 0;
        double t0 = kiln_now();
        tok_encode(t, austen, len, &ids, &n, &cap);
        double dt = kiln_now() - t0;
        free(ids);
        test_report(round_trip(t, austen, len, why, sizeof why), "tokenizer_gpt2_round_trip_austen",
                    "%s", why);
        printf("# gpt2 encode: %zu bytes -> %zu tokens in %.2f s (%.1f MB/s)\n", len, n, dt,
               len / dt / 1e6);
        free(austen);
    } else {
        printf("skip tokenizer_gpt2_round_trip_austen: data/austen.txt missing\n");
    }
    tok_free(t);
}

static void open_vocab_in_child(void *file) { tok_open("gpt2", file); }

/* tok_open("gpt2", file) in a child: expect exit 2 and `needle` in its stderr. */
static void expect_vocab_fail(const char *name, const char *file, const char *needle) {
    char msg[2048];
    int code = test_run_child(open_vocab_in_child, (void *)file, msg, sizeof msg);
    char *nl = strchr(msg, '\n');
    if (nl) *nl = '\0';
    test_report(code == 2 && strstr(msg, needle), name, "exit %d, stderr '%s' (want '%s')", code,
                msg, needle);
}

static void test_bad_vocab(void) {
    const char *base = getenv("KILN_TEST_TMP");
    if (!base) base = "/tmp";
    char path[1024], needle[1200];
    snprintf(path, sizeof path, "%s/missing.tiktoken", base);
    snprintf(needle, sizeof needle, "'%s': No such file", path);
    expect_vocab_fail("tokenizer_vocab_missing", path, needle);

    snprintf(path, sizeof path, "%s/bad.tiktoken", base);
    FILE *f = fopen(path, "w");
    fputs("IQ== 0\nIg== 1\nnot-base64! 2\n", f);
    fclose(f);
    snprintf(needle, sizeof needle, "%s:3: expected 'base64(token) rank'", path);
    expect_vocab_fail("tokenizer_vocab_bad_line", path, needle);

    /* Every byte, but far fewer ranks than GPT-2's 50256. */
    f = fopen(path, "w");
    for (int b = 0; b < 256; b++) {
        static const char *a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        fprintf(f, "%c%c== %d\n", a[b >> 2], a[(b & 3) << 4], b);
    }
    fclose(f);
    snprintf(needle, sizeof needle, "%s: 256 ranks, but GPT-2 has 50256", path);
    expect_vocab_fail("tokenizer_vocab_too_short", path, needle);
}

int main(int argc, char **argv) {
    if (argc == 4 && strcmp(argv[1], "--encode") == 0) return encode_file(argv[2], argv[3]);
    if (argc != 1) {
        fprintf(stderr, "usage: %s [--encode FILE VOCAB|byte]\n", argv[0]);
        return 2;
    }
    test_byte();
    test_bad_vocab();
    test_gpt2();
    return 0;
}
