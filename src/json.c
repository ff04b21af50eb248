/* json: recursive descent over the whole text into a JsonValue tree (see
 * json.h). Depth is bounded so hostile nesting cannot exhaust the stack. */
#include "json.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

typedef struct {
    const char *s, *end;
    int line;
    char *err;
    size_t cap;
} Parser;

static int perr(Parser *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int perr(Parser *p, const char *fmt, ...) {
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    snprintf(p->err, p->cap, "line %d: %s", p->line, what);
    return -1;
}

static void ws(Parser *p) {
    while (p->s < p->end && (*p->s == ' ' || *p->s == '\t' || *p->s == '\n' || *p->s == '\r')) {
        if (*p->s == '\n') p->line++;
        p->s++;
    }
}

static int hex4(Parser *p, unsigned *v) {
    *v = 0;
    for (int i = 0; i < 4; i++, p->s++) {
        if (p->s >= p->end) return perr(p, "truncated \\u escape");
        char c = *p->s;
        unsigned d = c >= '0' && c <= '9' ? (unsigned)(c - '0') : c >= 'a' && c <= 'f' ? (unsigned)(c - 'a' + 10)
                   : c >= 'A' && c <= 'F' ? (unsigned)(c - 'A' + 10) : 16;
        if (d == 16) return perr(p, "bad hex digit in \\u escape");
        *v = *v * 16 + d;
    }
    return 0;
}

/* UTF-8 of code point cp appended to out (room checked by the caller: 4). */
static size_t utf8(char *out, unsigned cp) {
    if (cp < 0x80) return out[0] = (char)cp, 1;
    if (cp < 0x800) return out[0] = (char)(0xC0 | cp >> 6), out[1] = (char)(0x80 | (cp & 63)), 2;
    if (cp < 0x10000)
        return out[0] = (char)(0xE0 | cp >> 12), out[1] = (char)(0x80 | (cp >> 6 & 63)), out[2] = (char)(0x80 | (cp & 63)), 3;
    out[0] = (char)(0xF0 | cp >> 18), out[1] = (char)(0x80 | (cp >> 12 & 63));
    out[2] = (char)(0x80 | (cp >> 6 & 63)), out[3] = (char)(0x80 | (cp & 63));
    return 4;
}

static int string(Parser *p, char **out) {
    p->s++; /* the opening quote */
    const char *q = p->s;
    while (q < p->end && *q != '"') q += *q == '\\' ? 2 : 1;
    if (q >= p->end) return perr(p, "unterminated string");
    char *buf = xmalloc((size_t)(q - p->s) + 1); /* an escape never grows the text */
    size_t n = 0;
    while (*p->s != '"') {
        unsigned char c = (unsigned char)*p->s;
        if (c < 0x20) {
            free(buf);
            return perr(p, "control character in a string");
        }
        if (c != '\\') {
            buf[n++] = (char)c, p->s++;
            continue;
        }
        p->s++;
        char e = *p->s++;
        switch (e) {
        case '"': buf[n++] = '"'; break;
        case '\\': buf[n++] = '\\'; break;
        case '/': buf[n++] = '/'; break;
        case 'b': buf[n++] = '\b'; break;
        case 'f': buf[n++] = '\f'; break;
        case 'n': buf[n++] = '\n'; break;
        case 'r': buf[n++] = '\r'; break;
        case 't': buf[n++] = '\t'; break;
        case 'u': {
            unsigned cp;
            if (hex4(p, &cp)) return free(buf), -1;
            if (cp >= 0xD800 && cp < 0xDC00) { /* a surrogate pair */
                unsigned lo;
                if (p->end - p->s < 6 || p->s[0] != '\\' || p->s[1] != 'u') return free(buf), perr(p, "lone surrogate");
                p->s += 2;
                if (hex4(p, &lo)) return free(buf), -1;
                if (lo < 0xDC00 || lo > 0xDFFF) return free(buf), perr(p, "bad surrogate pair");
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                return free(buf), perr(p, "lone surrogate");
            }
            if (cp == 0) return free(buf), perr(p, "\\u0000 in a string");
            n += utf8(buf + n, cp); /* \uXXXX is 6 bytes, its UTF-8 at most 4 */
            break;
        }
        default: free(buf); return perr(p, "bad escape '\\%c'", e);
        }
    }
    p->s++;
    buf[n] = 0;
    *out = buf;
    return 0;
}

static int number(Parser *p, double *v) {
    const char *q = p->s;
    if (q < p->end && *q == '-') q++;
    if (q >= p->end || *q < '0' || *q > '9') return perr(p, "expected a value");
    if (*q == '0' && q + 1 < p->end && q[1] >= '0' && q[1] <= '9') return perr(p, "a number with a leading zero");
    while (q < p->end && ((*q >= '0' && *q <= '9') || *q == '.' || *q == 'e' || *q == 'E' || *q == '+' || *q == '-'))
        q++;
    char buf[64];
    if (q - p->s >= (long)sizeof buf) return perr(p, "number too long");
    memcpy(buf, p->s, (size_t)(q - p->s));
    buf[q - p->s] = 0;
    char *e;
    errno = 0;
    *v = strtod(buf, &e);
    if (*e || !isfinite(*v)) return perr(p, "bad number '%s'", buf);
    p->s = q;
    return 0;
}

static int value(Parser *p, JsonValue *v, int depth);

static int members(Parser *p, JsonValue *v, int depth, int object) {
    char close = object ? '}' : ']';
    p->s++;
    ws(p);
    if (p->s < p->end && *p->s == close) return p->s++, 0;
    int cap = 0;
    for (;;) {
        ws(p);
        if (v->n == cap) {
            cap = cap ? 2 * cap : 8;
            v->items = xrealloc(v->items, (size_t)cap * sizeof *v->items);
            if (object) v->keys = xrealloc(v->keys, (size_t)cap * sizeof *v->keys);
        }
        /* the member counts from here, so an error below frees what it holds */
        memset(&v->items[v->n], 0, sizeof *v->items);
        if (object) v->keys[v->n] = NULL;
        v->n++;
        if (object) {
            if (p->s >= p->end || *p->s != '"') return perr(p, "expected a key string");
            char *k;
            if (string(p, &k)) return -1;
            v->keys[v->n - 1] = k;
            for (int i = 0; i < v->n - 1; i++)
                if (!strcmp(v->keys[i], k)) return perr(p, "duplicate key \"%s\"", k);
            ws(p);
            if (p->s >= p->end || *p->s != ':') return perr(p, "expected ':'");
            p->s++;
        }
        if (value(p, &v->items[v->n - 1], depth + 1)) return -1;
        ws(p);
        if (p->s < p->end && *p->s == ',') {
            p->s++;
            continue;
        }
        if (p->s < p->end && *p->s == close) return p->s++, 0;
        return perr(p, "expected ',' or '%c'", close);
    }
}

static int literal(Parser *p, const char *word) {
    size_t k = strlen(word);
    if ((size_t)(p->end - p->s) < k || strncmp(p->s, word, k)) return perr(p, "expected a value");
    p->s += k;
    return 0;
}

static int value(Parser *p, JsonValue *v, int depth) {
    if (depth > JSON_MAX_DEPTH) return perr(p, "nested more than %d deep", JSON_MAX_DEPTH);
    ws(p);
    if (p->s >= p->end) return perr(p, "unexpected end of text");
    switch (*p->s) {
    case '{': v->kind = JSON_OBJECT; return members(p, v, depth, 1);
    case '[': v->kind = JSON_ARRAY; return members(p, v, depth, 0);
    case '"': v->kind = JSON_STRING; return string(p, &v->str);
    case 't': v->kind = JSON_BOOL, v->num = 1; return literal(p, "true");
    case 'f': v->kind = JSON_BOOL, v->num = 0; return literal(p, "false");
    case 'n': v->kind = JSON_NULL; return literal(p, "null");
    default: v->kind = JSON_NUMBER; return number(p, &v->num);
    }
}

static void free_inner(JsonValue *v) {
    for (int i = 0; i < v->n; i++) {
        free_inner(&v->items[i]);
        if (v->keys) free(v->keys[i]);
    }
    free(v->items);
    free(v->keys);
    free(v->str);
}

void json_free(JsonValue *v) {
    if (!v) return;
    free_inner(v);
    free(v);
}

JsonValue *json_parse(const char *text, size_t len, char *err, size_t cap) {
    Parser p = {text, text + len, 1, err, cap};
    JsonValue *v = xcalloc(1, sizeof *v);
    if (value(&p, v, 0) == 0) {
        ws(&p);
        if (p.s == p.end) return v;
        perr(&p, "text after the value");
    }
    json_free(v);
    return NULL;
}

const JsonValue *json_get(const JsonValue *v, const char *key) {
    if (!v || v->kind != JSON_OBJECT) return NULL;
    for (int i = 0; i < v->n; i++)
        if (!strcmp(v->keys[i], key)) return &v->items[i];
    return NULL;
}
