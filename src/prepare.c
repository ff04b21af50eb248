/* prepare: `./train prepare` reads text or JSON-lines files, splits them into
 * documents, encodes them with the byte or GPT-2 tokenizer (on several threads:
 * the same ids as one), puts the end-of-text token before every document,
 * splits off the last val-fraction of tokens and writes DIR/train_NNNNNN.bin and
 * DIR/val_NNNNNN.bin (.bin.zst with --zstd). Owns that command line only; must
 * never train or touch the model. */
#include "prepare.h"
#include "shard.h"
#include "testhooks.h"
#include "tokenizer.h"
#include "util.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zstd.h>

#define PREPARE_DEFAULT_VOCAB "data/cache/gpt2.tiktoken"
#define PREPARE_CHUNK ((size_t)1 << 20) /* bytes a thread encodes at a time */

static const char *prepare_usage =
    "usage: ./train prepare --tokenizer byte|gpt2 [--vocab FILE] --out DIR\n"
    "                       [--format text|jsonl] [--doc file|line] [--eot | --no-eot]\n"
    "                       [--threads N] [--val-fraction F] [--shard-tokens N] [--zstd LEVEL] FILE...\n"
    "\n"
    "Encode text FILEs into token shards for data.train / data.val:\n"
    "  DIR/train_000000.bin, train_000001.bin, ...   (the first 1-F of all tokens)\n"
    "  DIR/val_000000.bin, ...                       (the last F of all tokens)\n"
    "\n"
    "  --tokenizer byte|gpt2  byte: 256 ids, one per byte (model.vocab_size: 256);\n"
    "                         gpt2: GPT-2 BPE, vocab 50257 (model.vocab_size: 50257)\n"
    "  --vocab FILE           gpt2 ranks in tiktoken format (default " PREPARE_DEFAULT_VOCAB ";\n"
    "                         scripts/fetch_gpt2_vocab.sh puts it there)\n"
    "  --out DIR              output directory (created); stale shards of an earlier,\n"
    "                         longer run in DIR are removed\n"
    "  --format text|jsonl    text: FILEs as they are (default); jsonl: one JSON object per\n"
    "                         line, its \"text\" string is one document\n"
    "  --doc file|line        text: a document is a whole FILE (default) or each non-empty\n"
    "                         line (without its newline)\n"
    "  --eot, --no-eot        the tokenizer's end-of-text token before every document\n"
    "                         (gpt2: <|endoftext|> = 50256, on by default; the byte\n"
    "                         tokenizer has none: its documents are joined, lines and\n"
    "                         records each followed by a newline)\n"
    "  --threads N            encode on N threads, 1..256 (default 1); the ids are the\n"
    "                         same as with one\n"
    "  --val-fraction F       share of tokens for validation, 0 <= F < 1 (default 0.05)\n"
    "  --shard-tokens N       tokens per shard (default 100000000)\n"
    "  --zstd LEVEL           compress shards with zstd LEVEL 1..22 (.bin.zst; default off)\n"
    "\n"
    "Progress is shown on stderr when it is a terminal.\n"
    "Example: ./train prepare --tokenizer byte --out data/austen --val-fraction 0.05 "
    "data/austen.txt\n";

#define prepare_fail(fmt, ...) \
    kiln_fail_hint(KILN_EXIT_USAGE, "./train prepare --help", "prepare: " fmt, ##__VA_ARGS__)

enum { PREPARE_TEXT, PREPARE_JSONL };

typedef struct PrepareArgs {
    const char *tokenizer, *vocab, *out;
    double val_fraction;
    long long shard_tokens;
    int zstd, format, doc_line, threads;
    int eot; /* -1: the tokenizer's default (on where it has the token) */
    char **files;
    int n_files;
} PrepareArgs;

/* "--name VALUE" or "--name=VALUE"; returns the value or NULL if argv[*i] is not --name. */
static const char *prepare_opt(int argc, char **argv, int *i, const char *name) {
    size_t n = strlen(name);
    const char *a = argv[*i];
    if (strncmp(a, name, n) != 0) return NULL;
    if (a[n] == '=') return a + n + 1;
    if (a[n] != '\0') return NULL;
    if (*i + 1 >= argc) prepare_fail("%s needs a value", name);
    return argv[++*i];
}

static long long prepare_int(const char *name, const char *v, long long lo, long long hi) {
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (end == v || *end || errno || x < lo || x > hi)
        prepare_fail("%s: expected an integer in [%lld, %lld], got '%s'", name, lo, hi, v);
    return x;
}

static void prepare_parse(int argc, char **argv, PrepareArgs *a) {
    memset(a, 0, sizeof *a);
    a->val_fraction = 0.05;
    a->shard_tokens = 100000000;
    a->threads = 1;
    a->eot = -1;
    a->files = xcalloc((size_t)argc, sizeof(char *));
    const char *doc = NULL;
    for (int i = 1; i < argc; i++) {
        const char *v;
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            fputs(prepare_usage, stdout);
            exit(KILN_EXIT_OK);
        } else if ((v = prepare_opt(argc, argv, &i, "--tokenizer"))) {
            if (strcmp(v, "byte") != 0 && strcmp(v, "gpt2") != 0)
                prepare_fail("--tokenizer: expected byte or gpt2, got '%s'", v);
            a->tokenizer = v;
        } else if ((v = prepare_opt(argc, argv, &i, "--vocab"))) {
            a->vocab = v;
        } else if ((v = prepare_opt(argc, argv, &i, "--out"))) {
            a->out = v;
        } else if ((v = prepare_opt(argc, argv, &i, "--format"))) {
            if (strcmp(v, "text") && strcmp(v, "jsonl")) prepare_fail("--format: expected text or jsonl, got '%s'", v);
            a->format = strcmp(v, "text") ? PREPARE_JSONL : PREPARE_TEXT;
        } else if ((v = prepare_opt(argc, argv, &i, "--doc"))) {
            if (strcmp(v, "file") && strcmp(v, "line")) prepare_fail("--doc: expected file or line, got '%s'", v);
            doc = v;
        } else if (strcmp(argv[i], "--eot") == 0 || strcmp(argv[i], "--no-eot") == 0) {
            a->eot = strcmp(argv[i], "--eot") == 0;
        } else if ((v = prepare_opt(argc, argv, &i, "--threads"))) {
            a->threads = (int)prepare_int("--threads", v, 1, 256);
        } else if ((v = prepare_opt(argc, argv, &i, "--val-fraction"))) {
            char *end;
            errno = 0;
            a->val_fraction = strtod(v, &end);
            if (end == v || *end || errno || !(a->val_fraction >= 0.0 && a->val_fraction < 1.0))
                prepare_fail("--val-fraction: expected a number in [0, 1), got '%s'", v);
        } else if ((v = prepare_opt(argc, argv, &i, "--shard-tokens"))) {
            a->shard_tokens = prepare_int("--shard-tokens", v, 1, INT32_MAX);
        } else if ((v = prepare_opt(argc, argv, &i, "--zstd"))) {
            a->zstd = (int)prepare_int("--zstd", v, 0, ZSTD_maxCLevel());
        } else if (strcmp(argv[i], "--") == 0) {
            while (++i < argc) a->files[a->n_files++] = argv[i];
        } else if (argv[i][0] == '-' && argv[i][1] != '\0') {
            prepare_fail("unknown option '%s'", argv[i]);
        } else {
            a->files[a->n_files++] = argv[i];
        }
    }
    if (!a->tokenizer) prepare_fail("--tokenizer byte|gpt2 is required");
    if (!a->out) prepare_fail("--out DIR is required");
    if (a->n_files == 0) prepare_fail("no input FILE given");
    if (a->vocab && strcmp(a->tokenizer, "byte") == 0)
        prepare_fail("--vocab is for --tokenizer gpt2; the byte tokenizer needs no file");
    if (!a->vocab && strcmp(a->tokenizer, "gpt2") == 0) a->vocab = PREPARE_DEFAULT_VOCAB;
    if (a->eot == 1 && strcmp(a->tokenizer, "byte") == 0)
        prepare_fail("--eot: the byte tokenizer has no end-of-text id (its 256 ids are the bytes); use --tokenizer "
                     "gpt2, or leave --eot out");
    if (doc && a->format == PREPARE_JSONL) prepare_fail("--doc is for --format text; in jsonl every record is a document");
    a->doc_line = doc && !strcmp(doc, "line");
}

/* ---- documents ------------------------------------------------------------ */

/* A document: bytes of one input buffer, from file `file`. sep: a newline
 * follows it (lines and records when there is no end-of-text token). */
typedef struct PrepDoc {
    size_t off, len;
    int file, sep;
} PrepDoc;

typedef struct PrepInput {
    char **bufs;   /* (n_files) each file's text, or (jsonl) its records' decoded texts */
    size_t *sizes; /* (n_files) bytes read from each file */
    PrepDoc *docs;
    size_t n_docs, cap_docs;
} PrepInput;

static void prep_add_doc(PrepInput *in, int file, size_t off, size_t len, int sep) {
    if (in->n_docs == in->cap_docs) {
        in->cap_docs = in->cap_docs ? 2 * in->cap_docs : 1024;
        in->docs = xrealloc(in->docs, in->cap_docs * sizeof(PrepDoc));
    }
    in->docs[in->n_docs++] = (PrepDoc){off, len, file, sep};
}

/* A growing byte buffer. */
typedef struct PrepBuf {
    char *p;
    size_t n, cap;
} PrepBuf;

static void buf_put(PrepBuf *b, const void *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        b->cap = (b->n + n + 1) * 2;
        b->p = xrealloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
}

/* A one-line JSON record, read just far enough to take the string of its
 * top-level "text" key (the last one, as Python's json does) into out;
 * anything else is skipped, checked for shape. -1 with err on bad JSON. */
typedef struct JsonIn {
    const char *s;
    size_t n, i;
    char *err;
    size_t cap;
} JsonIn;

__attribute__((format(printf, 2, 3))) static int json_err(JsonIn *j, const char *fmt, ...) {
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    snprintf(j->err, j->cap, "%s at column %zu", what, j->i + 1);
    return -1;
}

static void json_ws(JsonIn *j) {
    while (j->i < j->n && (j->s[j->i] == ' ' || j->s[j->i] == '\t' || j->s[j->i] == '\r' || j->s[j->i] == '\n')) j->i++;
}

static void utf8_put(PrepBuf *b, uint32_t cp) {
    unsigned char u[4];
    size_t n;
    if (cp < 0x80) u[0] = (unsigned char)cp, n = 1;
    else if (cp < 0x800) u[0] = (unsigned char)(0xc0 | cp >> 6), u[1] = (unsigned char)(0x80 | (cp & 0x3f)), n = 2;
    else if (cp < 0x10000)
        u[0] = (unsigned char)(0xe0 | cp >> 12), u[1] = (unsigned char)(0x80 | (cp >> 6 & 0x3f)),
        u[2] = (unsigned char)(0x80 | (cp & 0x3f)), n = 3;
    else
        u[0] = (unsigned char)(0xf0 | cp >> 18), u[1] = (unsigned char)(0x80 | (cp >> 12 & 0x3f)),
        u[2] = (unsigned char)(0x80 | (cp >> 6 & 0x3f)), u[3] = (unsigned char)(0x80 | (cp & 0x3f)), n = 4;
    if (b) buf_put(b, u, n);
}

static int json_hex4(JsonIn *j, uint32_t *v) {
    if (j->i + 4 > j->n) return json_err(j, "\\u needs 4 hex digits");
    *v = 0;
    for (int k = 0; k < 4; k++) {
        char c = j->s[j->i++];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return json_err(j, "bad hex digit '%c' in \\u", c);
        *v = *v << 4 | (uint32_t)d;
    }
    return 0;
}

/* A string at j->i (its opening quote), decoded into out (NULL: skipped). */
static int json_string(JsonIn *j, PrepBuf *out) {
    if (j->i >= j->n || j->s[j->i] != '"') return json_err(j, "expected a string");
    j->i++;
    for (;;) {
        if (j->i >= j->n) return json_err(j, "unterminated string");
        unsigned char c = (unsigned char)j->s[j->i++];
        if (c == '"') return 0;
        if (c < 0x20) return json_err(j, "control character 0x%02x inside a string", c);
        if (c != '\\') {
            if (out) buf_put(out, &c, 1);
            continue;
        }
        if (j->i >= j->n) return json_err(j, "unterminated escape");
        char e = j->s[j->i++], ch;
        switch (e) {
        case '"': case '\\': case '/': ch = e; break;
        case 'b': ch = '\b'; break;
        case 'f': ch = '\f'; break;
        case 'n': ch = '\n'; break;
        case 'r': ch = '\r'; break;
        case 't': ch = '\t'; break;
        case 'u': ch = 0; break;
        default: return json_err(j, "bad escape '\\%c'", e);
        }
        if (e != 'u') {
            if (out) buf_put(out, &ch, 1);
            continue;
        }
        uint32_t cp;
        if (json_hex4(j, &cp)) return -1;
        if (cp >= 0xd800 && cp <= 0xdbff && j->i + 1 < j->n && j->s[j->i] == '\\' && j->s[j->i + 1] == 'u') {
            size_t back = j->i;
            uint32_t lo;
            j->i += 2;
            if (json_hex4(j, &lo)) return -1;
            if (lo >= 0xdc00 && lo <= 0xdfff) cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            else j->i = back, cp = 0xfffd;
        } else if (cp >= 0xd800 && cp <= 0xdfff) {
            cp = 0xfffd; /* a lone surrogate has no UTF-8 */
        }
        utf8_put(out, cp);
    }
}

static int json_value(JsonIn *j, int depth, PrepBuf *text, int *found);

static int json_container(JsonIn *j, int depth, PrepBuf *text, int *found) {
    char open = j->s[j->i++], close = open == '{' ? '}' : ']';
    if (depth > 64) return json_err(j, "nested deeper than 64");
    json_ws(j);
    if (j->i < j->n && j->s[j->i] == close) return j->i++, 0;
    for (;;) {
        json_ws(j);
        int is_text = 0;
        if (open == '{') {
            PrepBuf key = {0};
            int rc = json_string(j, &key);
            is_text = rc == 0 && depth == 0 && key.n == 4 && !memcmp(key.p, "text", 4);
            free(key.p);
            if (rc) return -1;
            json_ws(j);
            if (j->i >= j->n || j->s[j->i] != ':') return json_err(j, "expected ':'");
            j->i++;
            json_ws(j);
        }
        if (is_text) {
            if (j->i >= j->n || j->s[j->i] != '"') return json_err(j, "\"text\" is not a string");
            text->n = 0; /* a later "text" replaces an earlier one */
            if (json_string(j, text)) return -1;
            *found = 1;
        } else if (json_value(j, depth + 1, NULL, NULL)) {
            return -1;
        }
        json_ws(j);
        if (j->i < j->n && j->s[j->i] == ',') {
            j->i++;
            continue;
        }
        if (j->i < j->n && j->s[j->i] == close) return j->i++, 0;
        return json_err(j, "expected ',' or '%c'", close);
    }
}

static int json_value(JsonIn *j, int depth, PrepBuf *text, int *found) {
    json_ws(j);
    if (j->i >= j->n) return json_err(j, "expected a value");
    char c = j->s[j->i];
    if (c == '{' || c == '[') return json_container(j, depth, text, found);
    if (c == '"') return json_string(j, NULL);
    static const char *const words[] = {"true", "false", "null"};
    for (int w = 0; w < 3; w++) {
        size_t l = strlen(words[w]);
        if (j->i + l <= j->n && !memcmp(j->s + j->i, words[w], l)) return j->i += l, 0;
    }
    size_t start = j->i;
    if (c == '-') j->i++;
    while (j->i < j->n && strchr("0123456789.eE+-", j->s[j->i])) j->i++;
    if (j->i == start || (j->i == start + 1 && c == '-')) return json_err(j, "unexpected '%c'", c);
    return 0;
}

/* One record: its "text" appended to out. */
static int json_record(const char *s, size_t n, PrepBuf *out, char *err, size_t cap) {
    JsonIn j = {s, n, 0, err, cap};
    json_ws(&j);
    if (j.i >= n || s[j.i] != '{') return json_err(&j, "expected a JSON object '{'");
    PrepBuf text = {0};
    int found = 0, rc = json_container(&j, 0, &text, &found);
    if (!rc) {
        json_ws(&j);
        if (j.i < n) rc = json_err(&j, "text after the object");
        else if (!found) rc = json_err(&j, "no \"text\" key in the record");
    }
    if (!rc) buf_put(out, text.p ? text.p : "", text.n);
    free(text.p);
    return rc;
}

/* Read every FILE and cut it into documents. */
static void prep_read(const PrepareArgs *a, int eot, PrepInput *in) {
    memset(in, 0, sizeof *in);
    in->bufs = xcalloc((size_t)a->n_files, sizeof(char *));
    in->sizes = xcalloc((size_t)a->n_files, sizeof(size_t));
    for (int f = 0; f < a->n_files; f++) {
        size_t len;
        char *text = kiln_read_file(a->files[f], &len);
        if (!text) prepare_fail("%s: cannot read: %s", a->files[f], kiln_strerror(errno));
        in->sizes[f] = len;
        if (a->format == PREPARE_TEXT && !a->doc_line) {
            in->bufs[f] = text;
            prep_add_doc(in, f, 0, len, 0);
            continue;
        }
        if (a->format == PREPARE_TEXT) {
            in->bufs[f] = text;
            for (size_t at = 0, line = 0; at < len; line++) {
                const char *nl = memchr(text + at, '\n', len - at);
                size_t end = nl ? (size_t)(nl - text) : len, l = end - at;
                if (l && text[at + l - 1] == '\r') l--;
                if (l) prep_add_doc(in, f, at, l, eot < 0);
                at = end + 1;
            }
            continue;
        }
        /* jsonl: the records' texts, decoded, back to back in one buffer */
        PrepBuf out = {0};
        size_t lineno = 1;
        for (size_t at = 0; at < len; lineno++) {
            const char *nl = memchr(text + at, '\n', len - at);
            size_t end = nl ? (size_t)(nl - text) : len, blank = 1;
            for (size_t i = at; i < end && blank; i++) blank = text[i] == ' ' || text[i] == '\t' || text[i] == '\r';
            if (!blank) {
                char err[320];
                size_t before = out.n;
                if (json_record(text + at, end - at, &out, err, sizeof err) != 0)
                    prepare_fail("%s:%zu: not a JSON record with a \"text\" string: %s", a->files[f], lineno, err);
                prep_add_doc(in, f, before, out.n - before, eot < 0);
            }
            at = end + 1;
        }
        free(text);
        in->bufs[f] = out.p ? out.p : xcalloc(1, 1);
    }
}

/* ---- encoding on threads --------------------------------------------------- */

/* A piece of a document that one thread encodes. Pieces are cut only where
 * GPT-2's pre-tokenisation cuts anyway, so the ids are those of the whole. */
typedef struct PrepChunk {
    const char *text;
    size_t len;
    size_t doc;      /* index into docs */
    uint32_t *ids;   /* (n) its tokens once encoded */
    size_t n, cap;
} PrepChunk;

typedef struct PrepWork {
    const Tokenizer *tok;
    PrepChunk *chunks;
    size_t n_chunks;
    atomic_size_t next, bytes_done;
} PrepWork;

/* Where a piece may end: after a '\n' that follows a printable non-space ASCII
 * byte and comes before an ASCII letter or digit. At such a point the regex
 * ``...|\s+(?!\S)|\s+`` has matched that lone '\n' as a piece of its own
 * whether or not the text goes on (at the end of a text \s+ takes all of a
 * whitespace run, so a run of several would end differently), and no
 * alternative joins '\n' to what follows. */
static int prep_cut_ok(const unsigned char *s, size_t p) {
    unsigned c = s[p], b = s[p - 2];
    return s[p - 1] == '\n' && b >= 0x21 && b <= 0x7e &&
           ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'));
}

static PrepChunk *prep_chunks(const PrepInput *in, size_t target, size_t *n_out) {
    size_t n = 0, cap = in->n_docs + 16;
    PrepChunk *ch = xmalloc(cap * sizeof *ch);
    for (size_t d = 0; d < in->n_docs; d++) {
        const PrepDoc *doc = &in->docs[d];
        const unsigned char *s = (const unsigned char *)in->bufs[doc->file] + doc->off;
        size_t at = 0;
        do {
            size_t end = doc->len;
            if (target && doc->len - at > target) {
                size_t p = at + target;
                while (p < doc->len && (p < at + 2 || !prep_cut_ok(s, p))) p++;
                end = p;
            }
            if (n == cap) cap *= 2, ch = xrealloc(ch, cap * sizeof *ch);
            ch[n++] = (PrepChunk){(const char *)s + at, end - at, d, NULL, 0, 0};
            at = end;
        } while (at < doc->len);
    }
    *n_out = n;
    return ch;
}

static void *prep_worker(void *arg) {
    PrepWork *w = arg;
    for (;;) {
        size_t i = atomic_fetch_add(&w->next, 1);
        if (i >= w->n_chunks) return NULL;
        PrepChunk *c = &w->chunks[i];
        tok_encode(w->tok, c->text, c->len, &c->ids, &c->n, &c->cap);
        atomic_fetch_add(&w->bytes_done, c->len);
    }
}

/* Encode every chunk, on `threads` threads; a progress line on stderr while
 * it runs when stderr is a terminal. */
static void prep_encode(const Tokenizer *tok, PrepChunk *chunks, size_t n, int threads, size_t total) {
    PrepWork w = {.tok = tok, .chunks = chunks, .n_chunks = n};
    atomic_init(&w.next, 0);
    atomic_init(&w.bytes_done, 0);
    pthread_t *th = xmalloc((size_t)threads * sizeof(pthread_t));
    for (int t = 0; t < threads; t++)
        if (pthread_create(&th[t], NULL, prep_worker, &w) != 0)
            kiln_fail(KILN_EXIT_RUNTIME, "prepare: cannot start encoder thread %d", t);
    if (isatty(2)) {
        double t0 = kiln_now();
        struct timespec ts = {0, 200 * 1000 * 1000};
        for (size_t done; (done = atomic_load(&w.bytes_done)) < total;) {
            double dt = kiln_now() - t0;
            fprintf(stderr, "\r\033[Kprepare: encoding %5.1f%% | %.1f of %.1f MB | %.1f MB/s", 100.0 * done / total,
                    done / 1e6, total / 1e6, dt > 0 ? done / 1e6 / dt : 0.0);
            nanosleep(&ts, NULL);
        }
        fputs("\r\033[K", stderr);
    }
    for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
    free(th);
}

/* ---- writing ---------------------------------------------------------------- */

static void prepare_shard_path(char *buf, size_t n, const char *dir, const char *split, long k,
                               int zstd) {
    if (snprintf(buf, n, "%s/%s_%06ld.bin%s", dir, split, k, zstd ? ".zst" : "") >= (int)n)
        prepare_fail("--out: path too long: '%s'", dir);
}

/* Write tokens[0..n) as split_000000.bin, ... and remove what an earlier run left
 * under the same names (higher indices, or the other compression), so that a glob
 * like DIR/train_* never mixes two preparations. Returns the shard count. */
static long prepare_write_split(const PrepareArgs *a, const char *split, const uint32_t *tokens,
                                size_t n) {
    char path[4096];
    long k = 0;
    for (size_t at = 0; at < n; at += (size_t)a->shard_tokens, k++) {
        size_t m = n - at < (size_t)a->shard_tokens ? n - at : (size_t)a->shard_tokens;
        prepare_shard_path(path, sizeof path, a->out, split, k, a->zstd);
        shard_write(path, tokens + at, m, a->zstd);
        printf("wrote %s: %zu tokens\n", path, m);
    }
    for (long j = 0;; j++) {
        int any = 0;
        for (int z = 0; z <= 1; z++) {
            if (j < k && z == (a->zstd > 0)) continue; /* just written */
            prepare_shard_path(path, sizeof path, a->out, split, j, z);
            if (access(path, F_OK) == 0) {
                if (unlink(path) != 0)
                    kiln_fail(KILN_EXIT_RUNTIME, "cannot remove stale shard %s: %s", path,
                              strerror(errno));
                printf("removed stale %s\n", path);
                any = 1;
            }
        }
        if (j >= k && !any) break;
    }
    return k;
}

static void ids_push(uint32_t **ids, size_t *n, size_t *cap, const uint32_t *src, size_t m) {
    if (*n + m > *cap) {
        *cap = (*n + m) * 2 > (1 << 16) ? (*n + m) * 2 : 1 << 16;
        *ids = xrealloc(*ids, *cap * sizeof(uint32_t));
    }
    memcpy(*ids + *n, src, m * sizeof(uint32_t));
    *n += m;
}

int prepare_main(int argc, char **argv) {
    PrepareArgs a;
    prepare_parse(argc, argv, &a);
    Tokenizer *tok = tok_open(a.tokenizer, a.vocab);
    /* llm.c's convention: every document starts with <|endoftext|>, so the model
     * learns where documents begin and the first one looks like the others */
    int eot = a.eot == 0 ? -1 : tok_eot(tok);
    PrepInput in;
    prep_read(&a, eot, &in);
    size_t bytes = 0;
    for (int f = 0; f < a.n_files; f++) bytes += in.sizes[f];
    /* one thread encodes whole documents; several encode pieces of them (the
     * same ids); the test hook prepare_chunk makes pieces small enough to test */
    size_t target = a.threads > 1 ? PREPARE_CHUNK : 0;
    if (testhooks()->prepare_chunk && a.threads > 1) target = testhooks()->prepare_chunk;
    size_t n_chunks, total = 0;
    PrepChunk *chunks = prep_chunks(&in, target, &n_chunks);
    for (size_t i = 0; i < n_chunks; i++) total += chunks[i].len;
    double t0 = kiln_now();
    prep_encode(tok, chunks, n_chunks, a.threads, total);
    double dt = kiln_now() - t0;

    /* (n) every token in argument order: end-of-text before each document */
    uint32_t *ids = NULL, nl_ids[8], eot_id = (uint32_t)eot;
    size_t n = 0, cap = 0, n_nl = 0, nl_cap = 0;
    uint32_t *nl = NULL;
    tok_encode(tok, "\n", 1, &nl, &n_nl, &nl_cap);
    memcpy(nl_ids, nl, n_nl * sizeof(uint32_t));
    free(nl);
    size_t *file_tokens = xcalloc((size_t)a.n_files, sizeof(size_t));
    for (size_t i = 0; i < n_chunks; i++) {
        const PrepChunk *c = &chunks[i];
        const PrepDoc *doc = &in.docs[c->doc];
        size_t before = n;
        if (eot >= 0 && (i == 0 || chunks[i - 1].doc != c->doc)) ids_push(&ids, &n, &cap, &eot_id, 1);
        ids_push(&ids, &n, &cap, c->ids, c->n);
        if (doc->sep && (i + 1 == n_chunks || chunks[i + 1].doc != c->doc)) ids_push(&ids, &n, &cap, nl_ids, n_nl);
        file_tokens[doc->file] += n - before;
        free(chunks[i].ids);
    }
    for (int f = 0; f < a.n_files; f++)
        printf("%s: %zu bytes -> %zu tokens\n", a.files[f], in.sizes[f], file_tokens[f]);

    size_t n_val = (size_t)((double)n * a.val_fraction + 0.5);
    if (a.val_fraction > 0 && n_val == 0) n_val = n > 1 ? 1 : 0;
    size_t n_train = n - n_val;
    if (n_train == 0) prepare_fail("no training tokens: the input is empty or --val-fraction too large");
    if (kiln_mkdirs(a.out) != 0)
        kiln_fail(KILN_EXIT_RUNTIME, "prepare: cannot create --out %s: %s", a.out, strerror(errno));
    long k_train = prepare_write_split(&a, "train", ids, n_train);
    long k_val = prepare_write_split(&a, "val", ids + n_train, n_val);
    printf("prepare: %s tokenizer (vocab %d), %zu bytes -> %zu tokens in %.2f s on %d thread(s) (%zu piece(s)); "
           "%zu document(s)%s\n", a.tokenizer, tok_vocab_size(tok), bytes, n, dt, a.threads, n_chunks, in.n_docs,
           eot >= 0 ? ", each after an end-of-text token" : "");
    printf("prepare: train %zu tokens in %ld shard(s), val %zu tokens in %ld shard(s) "
           "(the last %.1f%%)\n", n_train, k_train, n_val, k_val, 100.0 * a.val_fraction);
    free(file_tokens);
    free(chunks);
    for (int f = 0; f < a.n_files; f++) free(in.bufs[f]);
    free(in.bufs);
    free(in.sizes);
    free(in.docs);
    free(ids);
    free(a.files);
    tok_free(tok);
    return KILN_EXIT_OK;
}
