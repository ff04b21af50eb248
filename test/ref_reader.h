/* ref_reader: a cursor over a reference fixture read whole (test/ref/
 * README.md) that hands out aligned copies of its arrays, all freed by
 * rr_free. Shared by test_model_ref.c (GPT-2) and test_model_arch_ref.c. */
#ifndef KILN_TEST_REF_READER_H
#define KILN_TEST_REF_READER_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

typedef struct RefReader {
    char *blob;
    size_t len, pos;
    void **copies; /* owned aligned copies of what rr_take_array returned */
    int num_copies, cap_copies;
} RefReader;

/* Next `n` bytes, or NULL past the end. */
static const void *rr_take(RefReader *r, size_t n) {
    if (r->pos + n > r->len) return NULL;
    const void *p = r->blob + r->pos;
    r->pos += n;
    return p;
}

static int rr_take_i32(RefReader *r, int *out) {
    const void *p = rr_take(r, 4);
    if (!p) return -1;
    int32_t v;
    memcpy(&v, p, 4);
    *out = v;
    return 0;
}

/* Arrays sit at unaligned offsets after the names: copy them out so the
 * pointers are aligned. */
static const void *rr_take_array(RefReader *r, size_t bytes) {
    const void *p = rr_take(r, bytes);
    if (!p) return NULL;
    if (r->num_copies == r->cap_copies) {
        r->cap_copies = r->cap_copies ? 2 * r->cap_copies : 64;
        r->copies = xrealloc(r->copies, (size_t)r->cap_copies * sizeof(void *));
    }
    void *c = xmalloc(bytes ? bytes : 1);
    memcpy(c, p, bytes);
    r->copies[r->num_copies++] = c;
    return c;
}

static void rr_free(RefReader *r) {
    for (int i = 0; i < r->num_copies; i++) free(r->copies[i]);
    free(r->copies);
    free(r->blob);
    memset(r, 0, sizeof *r);
}

#endif
