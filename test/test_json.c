/* test_json: src/json.c, the reader of HF's config.json and
 * model.safetensors.index.json: values and escapes read right, every
 * malformed text refused with a line number, nesting bounded, and a seeded
 * loop of mutated texts that must never crash (each either parses or says
 * why; run under ASan by the hardening build). One line per check. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"
#include "test.h"
#include "util.h"

static JsonValue *parse(const char *t, char *err) { return json_parse(t, strlen(t), err, 300); }

static void check_values(void) {
    char err[300];
    const char *t = "{\"a\": 1.5e2, \"b\": [true, false, null, -0.25], \"s\": \"x\\u00e9\\ud83d\\ude00\\n\\\"\",\n"
                    " \"o\": {\"k\": \"v\"}, \"big\": 18446744073709551615}";
    JsonValue *v = parse(t, err);
    int ok = v && v->kind == JSON_OBJECT && v->n == 5;
    const JsonValue *a = json_get(v, "a"), *b = json_get(v, "b"), *s = json_get(v, "s"), *o = json_get(v, "o");
    ok = ok && a && a->kind == JSON_NUMBER && a->num == 150.0;
    ok = ok && b && b->kind == JSON_ARRAY && b->n == 4 && b->items[0].kind == JSON_BOOL && b->items[0].num == 1 &&
         b->items[2].kind == JSON_NULL && b->items[3].num == -0.25;
    ok = ok && s && s->kind == JSON_STRING && !strcmp(s->str, "x\xc3\xa9\xf0\x9f\x98\x80\n\"");
    ok = ok && o && json_get(o, "k") && !strcmp(json_get(o, "k")->str, "v") && !json_get(o, "missing");
    ok = ok && json_get(v, "big")->num == 18446744073709551615.0;
    test_report(ok, "json_values", "%s", v ? "a value read wrong" : err);
    json_free(v);
}

static void check_refusals(void) {
    static const struct { const char *name, *text, *want; } bad[] = {
        {"json_refuses_duplicate_key", "{\"a\": 1, \"a\": 2}", "duplicate key"},
        {"json_refuses_trailing_text", "{} x", "text after the value"},
        {"json_refuses_trailing_comma", "[1, 2,]", "expected a value"},
        {"json_refuses_bad_escape", "\"\\q\"", "bad escape"},
        {"json_refuses_lone_surrogate", "\"\\ud800x\"", "surrogate"},
        {"json_refuses_nul_escape", "\"\\u0000\"", "\\u0000"},
        {"json_refuses_control_char", "\"a\tb\"", "control character"},
        {"json_refuses_leading_zero", "[012]", "leading zero"},
        {"json_refuses_unterminated", "{\"a\": \"b", "unterminated"},
        {"json_refuses_missing_colon", "{\"a\" 1}", "expected ':'"},
        {"json_refuses_bare_word", "[nul]", "expected a value"},
        {"json_refuses_empty", "  ", "unexpected end"},
        {"json_refuses_huge_number", "[1e999]", "bad number"},
        {"json_line_numbers", "{\n\n  \"a\": ?}", "line 3"},
    };
    char err[300];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = 0;
        JsonValue *v = parse(bad[i].text, err);
        test_report(!v && strstr(err, bad[i].want), bad[i].name, "%s: got '%s'", v ? "accepted" : "wrong message", err);
        json_free(v);
    }
    /* nesting past the bound is refused, not a stack overflow */
    size_t n = 100000;
    char *deep = xmalloc(n + 1);
    memset(deep, '[', n);
    deep[n] = 0;
    JsonValue *v = json_parse(deep, n, err, sizeof err);
    test_report(!v && strstr(err, "nested more than"), "json_refuses_deep_nesting", "%s", v ? "accepted" : err);
    json_free(v);
    free(deep);
}

/* Mutations of a realistic index file: bytes flipped, inserted, cut. Each
 * parse either succeeds or gives a message; nothing else may happen. */
static void check_mutations(void) {
    const char *base = "{\n  \"metadata\": {\"total_size\": 123456},\n  \"weight_map\": {\n"
                       "    \"model.embed_tokens.weight\": \"model-00001-of-00002.safetensors\",\n"
                       "    \"lm_head.weight\": \"model-00002-of-00002.safetensors\"\n  }\n}\n";
    size_t n0 = strlen(base);
    uint64_t st = 0x9e3779b97f4a7c15ULL;
    int parsed = 0, refused = 0, silent = 0;
    char err[300], buf[512];
    for (int it = 0; it < 20000; it++) {
        memcpy(buf, base, n0);
        size_t n = n0;
        int edits = 1 + (int)(st % 4);
        for (int e = 0; e < edits; e++) {
            st = st * 6364136223846793005ULL + 1442695040888963407ULL;
            size_t at = (size_t)(st >> 33) % n;
            unsigned char c = (unsigned char)(st >> 17);
            switch ((st >> 60) % 3) {
            case 0: buf[at] = (char)c; break;
            case 1: if (n < sizeof buf - 1) memmove(buf + at + 1, buf + at, n - at), buf[at] = (char)c, n++; break;
            default: n = at ? at : 1; break;
            }
        }
        err[0] = 0;
        JsonValue *v = json_parse(buf, n, err, sizeof err);
        if (v) parsed++;
        else if (err[0]) refused++;
        else silent++;
        json_free(v);
    }
    test_report(silent == 0 && refused > 0, "json_mutations_never_silent", "%d parsed, %d refused, %d without a message",
                parsed, refused, silent);
}

int main(void) {
    check_values();
    check_refusals();
    check_mutations();
    return 0;
}
