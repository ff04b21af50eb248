/* json: a strict, small JSON reader for the files kiln reads from other
 * tools (HuggingFace's config.json and model.safetensors.index.json): the
 * whole text into a tree of values, RFC 8259 grammar, nesting and size
 * bounded. Never exits: a failure is NULL and one line in err. The
 * safetensors header keeps its own streaming parser (src/safetensors.c). */
#ifndef KILN_JSON_H
#define KILN_JSON_H

#include <stddef.h>

#define JSON_MAX_DEPTH 64

typedef enum { JSON_NULL, JSON_BOOL, JSON_NUMBER, JSON_STRING, JSON_ARRAY, JSON_OBJECT } JsonKind;

typedef struct JsonValue {
    JsonKind kind;
    double num;     /* JSON_NUMBER (and JSON_BOOL: 0 or 1) */
    char *str;      /* JSON_STRING: UTF-8, NUL-terminated (no NUL inside) */
    int n;          /* JSON_ARRAY, JSON_OBJECT: members */
    char **keys;    /* JSON_OBJECT: [n] */
    struct JsonValue *items; /* [n] */
} JsonValue;

/* Parse text[0, len): the root value (malloc'd; json_free), or NULL with
 * "line L: what" in err. Duplicate object keys are refused. */
JsonValue *json_parse(const char *text, size_t len, char *err, size_t cap);
void json_free(JsonValue *v);
/* Member `key` of an object (NULL if absent or v is not an object). */
const JsonValue *json_get(const JsonValue *v, const char *key);

#endif
