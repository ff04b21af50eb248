/* safetensors: read and write HuggingFace's .safetensors files (8-byte LE
 * header length, a JSON header, then the tensors back to back). Knows no
 * model and no names; it never exits: every failure is an error code and one
 * line in err (st_open is the command line's failing wrapper). docs/formats.md. */
#ifndef KILN_SAFETENSORS_H
#define KILN_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#define ST_MAX_DIM 8
#define ST_NAME 256
#define ST_MAX_HEADER (100u << 20) /* the Rust reader's limit: larger headers are refused */

typedef enum { ST_F32, ST_BF16, ST_F16 } StDtype;

typedef struct StTensor {
    char name[ST_NAME];
    StDtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIM];
    uint64_t numel;
    uint64_t begin, end; /* byte range in the data section */
} StTensor;

typedef struct StFile {
    int n;
    StTensor *t;               /* [n] in offset order */
    const unsigned char *data; /* the data section */
    uint64_t data_len;
    void *map;                 /* st_read's mapping (NULL for st_parse's caller-owned buffer) */
    size_t map_len;
} StFile;

/* Parse a whole file held in buf[0, len): 0, or -1 with one line in err
 * (what is wrong; the caller names the file). f->data points into buf. */
int st_parse(const unsigned char *buf, size_t len, StFile *f, char *err, size_t cap);
/* Map and parse `path`: 0, or -1 with "PATH: what is wrong" in err. */
int st_read(const char *path, StFile *f, char *err, size_t cap);
/* st_read, exiting 2 with that line on failure. */
void st_open(StFile *f, const char *path);
void st_free(StFile *f);
const StTensor *st_find(const StFile *f, const char *name);
/* Tensor t's values widened (exactly) to fp32: out holds t->numel floats. */
void st_to_f32(const StFile *f, const StTensor *t, float *out);

/* One tensor to write: fp32 values, stored as dtype (bf16 and f16 rounded to
 * nearest even). */
typedef struct StWrite {
    const char *name;
    StDtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIM];
    const float *data; /* numel floats */
} StWrite;

/* Write the tensors in the given order (offsets ascending), header with
 * __metadata__ {"format":"pt"}, padded with spaces to 8 bytes, through
 * path.tmp + rename. 0, or -1 with one line in err. */
int st_write(const char *path, const StWrite *t, int n, char *err, size_t cap);

size_t st_dtype_size(StDtype d);
const char *st_dtype_name(StDtype d);
uint16_t st_f32_to_bf16(float x);
uint16_t st_f32_to_f16(float x);
float st_f16_to_f32(uint16_t h);

#endif
