/* cublaslt_emu.h: enough of cuBLASLt, on the CPU, to run cuda/matmul.cu under
 * test/cuda_emu.h (test/matmul_emu.cc). Not a model of the library's speed
 * or algorithms: a reference product that holds matmul.cu to what
 * cublasLt.h (CUDA 13.0) documents, so the first GPU run cannot be the
 * first to find out. It refuses, as the library does, with
 * CUBLAS_STATUS_INVALID_VALUE: an attribute whose size is not the header's
 * type (TRANSA/B int32, EPILOGUE uint32, pointers, AUX_LD int64, workspace
 * uint64, alignments uint32, BIAS_DATA_TYPE int32); a type combination
 * outside the documented table (compute 32F, scale 32F: A/B fp32 with C/D
 * fp32, A/B bf16 with C/D bf16 or fp32); layouts that do not make op(A) m x
 * k, op(B) k x n, D m x n, or a leading dimension below the rows; a GELU aux
 * ld not a multiple of 8 or below D's rows. BGRADB (the bias gradient, the
 * sum of op(B) over k, n values in C's type: cublasLt.h, BIAS_POINTER and
 * BGRADB) is refused with no bias pointer to store into (INVALID_VALUE) and
 * with a BIAS_DATA_TYPE other than C's (NOT_SUPPORTED); only the layout of
 * kiln's dw product is emulated (A not transposed, B transposed: others are
 * NOT_SUPPORTED, as are BGRADA and the other epilogues kiln does not use).
 * cublasLt.h does not say whether alpha scales the bias gradient, so BGRADB
 * with alpha other than 1 fails the test. emu_lt_no_algo_epi makes the
 * heuristic find no algorithm for one epilogue (what a library without one
 * for a shape answers), and emu_lt_heuristic_calls counts the queries. It
 * fails the test (a GPU would misbehave) when a pointer
 * is less aligned at cublasLtMatmul than what the heuristic was told or saw
 * (the preference's minimum alignments; the bias and aux pointers' values,
 * which the heuristic reads: cublasLt.h, BIAS_POINTER and AUX_POINTER), or
 * when a product runs on another stream than the kernels' (0). GELU is the
 * tanh approximation, which cuBLASLt's epilogue is (PyTorch applies
 * gelu(approximate='tanh') where the epilogue is unavailable for this
 * reason); beta 0 never reads C (BLAS semantics), so cudaMalloc's garbage
 * in D shows if it does. Never part of ./train. */
#ifndef KILN_CUBLASLT_EMU_H
#define KILN_CUBLASLT_EMU_H
#include "cuda_emu.h"
#include "fp8.h"

typedef enum {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_NOT_SUPPORTED = 15
} cublasStatus_t;
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum { CUBLAS_COMPUTE_32F = 68 } cublasComputeType_t;
typedef enum { CUDA_R_32F = 0, CUDA_R_16BF = 14, CUDA_R_8F_E4M3 = 28, CUDA_R_8F_E5M2 = 29 } cudaDataType_t;
/* cublasLt.h's values */
typedef enum {
    CUBLASLT_EPILOGUE_DEFAULT = 1,
    CUBLASLT_EPILOGUE_BIAS = 4,
    CUBLASLT_EPILOGUE_GELU = 32,
    CUBLASLT_EPILOGUE_GELU_AUX = 32 | 128,
    CUBLASLT_EPILOGUE_GELU_BIAS = 32 | 4,
    CUBLASLT_EPILOGUE_GELU_AUX_BIAS = 32 | 128 | 4,
    CUBLASLT_EPILOGUE_DGELU = 64 | 128,
    CUBLASLT_EPILOGUE_DGELU_BGRAD = 64 | 128 | 16,
    CUBLASLT_EPILOGUE_BGRADA = 256,
    CUBLASLT_EPILOGUE_BGRADB = 512
} cublasLtEpilogue_t;
typedef enum {
    CUBLASLT_MATMUL_DESC_TRANSA = 3,
    CUBLASLT_MATMUL_DESC_TRANSB = 4,
    CUBLASLT_MATMUL_DESC_EPILOGUE = 7,
    CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8,
    CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER = 11,
    CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD = 12,
    CUBLASLT_MATMUL_DESC_A_SCALE_POINTER = 17,
    CUBLASLT_MATMUL_DESC_B_SCALE_POINTER = 18,
    CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE = 26,
    CUBLASLT_MATMUL_DESC_D_SCALE_POINTER = 20,
    CUBLASLT_MATMUL_DESC_A_SCALE_MODE = 31,
    CUBLASLT_MATMUL_DESC_B_SCALE_MODE = 32,
    CUBLASLT_MATMUL_DESC_C_SCALE_MODE = 33,
    CUBLASLT_MATMUL_DESC_D_SCALE_MODE = 34,
    CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_SCALE_MODE = 35,
    CUBLASLT_MATMUL_DESC_D_OUT_SCALE_MODE = 37
} cublasLtMatmulDescAttributes_t;
/* cublasLt.h's scaling modes (cuBLAS 12.9 added OUTER_VEC_32F and the two
 * 128-element ones; the stand-in runs SCALAR_32F and OUTER_VEC_32F) */
typedef enum {
    CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F = 0,
    CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3 = 1,
    CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0 = 2,
    CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F = 3,
    CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F = 4,
    CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F = 5
} cublasLtMatmulMatrixScale_t;
typedef enum {
    CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8
} cublasLtMatmulPreferenceAttributes_t;

struct EmuLtHandle { int live; };
struct EmuLtDesc {
    int compute, scale;
    int32_t ta, tb;
    uint32_t epi;
    const void *bias, *aux;
    int64_t ldaux;
    const float *scale_a, *scale_b; /* fp8: device floats multiplying op(A), op(B) */
    int32_t bias_type;              /* BIAS_DATA_TYPE: -1 (the default) is the documented type */
    /* the scaling modes of A, B, C, D, the aux matrix and D's output scale
     * (attributes 31-35, 37; 0 = SCALAR_32F, the default), and D's scale */
    int32_t mode[7];
    const float *scale_d;
};
struct EmuLtLayout { int type; uint64_t rows, cols; int64_t ld; };
struct EmuLtPref { uint64_t ws; uint32_t align[4]; /* A, B, C, D; the header's default 256 */ };
typedef EmuLtHandle *cublasLtHandle_t;
typedef EmuLtDesc *cublasLtMatmulDesc_t;
typedef EmuLtLayout *cublasLtMatrixLayout_t;
typedef EmuLtPref *cublasLtMatmulPreference_t;
/* What the heuristic promised: the alignments it was told or saw. */
struct cublasLtMatmulAlgo_t { uint32_t align[4], align_bias, align_aux; int valid; };
struct cublasLtMatmulHeuristicResult_t { cublasLtMatmulAlgo_t algo; size_t workspaceSize; cublasStatus_t state; };

inline int emu_lt_live; /* handles, descriptors, layouts and preferences not yet destroyed */
inline int emu_lt_heuristic_calls; /* cublasLtMatmulAlgoGetHeuristic queries so far */
inline uint32_t emu_lt_no_algo_epi; /* non-zero: the heuristic finds no algorithm with this epilogue */

static inline uint32_t emu_lt_align(const void *p) {
    uintptr_t a = (uintptr_t)p;
    uint32_t al = 256;
    while (al > 1 && a % al) al /= 2;
    return al;
}
static inline int emu_lt_aux_epi(uint32_t e) { return e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || e == CUBLASLT_EPILOGUE_DGELU || e == CUBLASLT_EPILOGUE_DGELU_BGRAD; }
static inline int emu_lt_bias_epi(uint32_t e) { return e == CUBLASLT_EPILOGUE_BIAS || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || e == CUBLASLT_EPILOGUE_GELU_BIAS; }
/* epilogues that read or write the vector at BIAS_POINTER */
static inline int emu_lt_vec_epi(uint32_t e) { return emu_lt_bias_epi(e) || e == CUBLASLT_EPILOGUE_BGRADB; }

static inline cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) {
    *h = new EmuLtHandle{1};
    emu_lt_live++;
    return CUBLAS_STATUS_SUCCESS;
}
static inline cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    delete h;
    emu_lt_live--;
    return CUBLAS_STATUS_SUCCESS;
}
static inline cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t c, cudaDataType_t s) {
    *d = new EmuLtDesc{(int)c, (int)s, CUBLAS_OP_N, CUBLAS_OP_N, CUBLASLT_EPILOGUE_DEFAULT, NULL, NULL, 0, NULL, NULL, -1, {0},
                       NULL};
    emu_lt_live++;
    return CUBLAS_STATUS_SUCCESS;
}
static inline cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
    delete d;
    emu_lt_live--;
    return CUBLAS_STATUS_SUCCESS;
}
/* Sizes as cublasLt.h types each attribute; anything else is INVALID_VALUE. */
static inline cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a,
                                                            const void *buf, size_t n) {
    switch (a) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
    case CUBLASLT_MATMUL_DESC_TRANSB: {
        if (n != sizeof(int32_t)) return CUBLAS_STATUS_INVALID_VALUE;
        int32_t v;
        memcpy(&v, buf, n);
        if (v != CUBLAS_OP_N && v != CUBLAS_OP_T) return CUBLAS_STATUS_INVALID_VALUE;
        (a == CUBLASLT_MATMUL_DESC_TRANSA ? d->ta : d->tb) = v;
        return CUBLAS_STATUS_SUCCESS;
    }
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
        if (n != sizeof(uint32_t)) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&d->epi, buf, n);
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER:
        if (n != sizeof(void *)) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(a == CUBLASLT_MATMUL_DESC_BIAS_POINTER ? (void *)&d->bias : (void *)&d->aux, buf, n);
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD:
        if (n != sizeof(int64_t)) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&d->ldaux, buf, n);
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_A_SCALE_POINTER:
    case CUBLASLT_MATMUL_DESC_B_SCALE_POINTER:
    case CUBLASLT_MATMUL_DESC_D_SCALE_POINTER:
        if (n != sizeof(void *)) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(a == CUBLASLT_MATMUL_DESC_A_SCALE_POINTER   ? (void *)&d->scale_a
               : a == CUBLASLT_MATMUL_DESC_B_SCALE_POINTER ? (void *)&d->scale_b
                                                           : (void *)&d->scale_d,
               buf, n);
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
        if (n != sizeof(int32_t)) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&d->bias_type, buf, n);
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_A_SCALE_MODE:
    case CUBLASLT_MATMUL_DESC_B_SCALE_MODE:
    case CUBLASLT_MATMUL_DESC_C_SCALE_MODE:
    case CUBLASLT_MATMUL_DESC_D_SCALE_MODE:
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_SCALE_MODE:
    case CUBLASLT_MATMUL_DESC_D_OUT_SCALE_MODE: {
        /* int32_t; a value the library's version does not know is invalid
         * (OUTER_VEC_32F is cuBLAS 12.9's) */
        int32_t v;
        if (n != sizeof v) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&v, buf, n);
        if (v < 0 || v > CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F) return CUBLAS_STATUS_INVALID_VALUE;
        if (v >= CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F && emu_lt_version < 120900)
            return CUBLAS_STATUS_INVALID_VALUE;
        d->mode[a - CUBLASLT_MATMUL_DESC_A_SCALE_MODE] = v;
        return CUBLAS_STATUS_SUCCESS;
    }
    }
    return CUBLAS_STATUS_INVALID_VALUE;
}
static inline cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType_t t, uint64_t rows,
                                                        uint64_t cols, int64_t ld) {
    *l = new EmuLtLayout{(int)t, rows, cols, ld};
    emu_lt_live++;
    return CUBLAS_STATUS_SUCCESS;
}
static inline cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
    delete l;
    emu_lt_live--;
    return CUBLAS_STATUS_SUCCESS;
}
static inline cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p) {
    *p = new EmuLtPref{0, {256, 256, 256, 256}};
    emu_lt_live++;
    return CUBLAS_STATUS_SUCCESS;
}
static inline cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
    delete p;
    emu_lt_live--;
    return CUBLAS_STATUS_SUCCESS;
}
static inline cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                                  cublasLtMatmulPreferenceAttributes_t a, const void *buf,
                                                                  size_t n) {
    if (a == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) {
        if (n != sizeof(uint64_t)) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&p->ws, buf, n);
        return CUBLAS_STATUS_SUCCESS;
    }
    if (a >= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES && a <= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES) {
        if (n != sizeof(uint32_t)) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&p->align[a - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES], buf, n);
        return CUBLAS_STATUS_SUCCESS;
    }
    return CUBLAS_STATUS_INVALID_VALUE;
}

/* fp8 operands (cublasLtMatmul's documented requirements for fp8 kernels):
 * both A and B fp8, not both E5M2; "TN" (A transposed, B not); C and D
 * bf16 or fp32, the same; compute and scale 32F; m, n, k and the leading
 * dimensions of A and B multiples of 16; no GeLU epilogue (kiln uses
 * DEFAULT and BIAS); at cublasLtMatmul, A, B and D 16-byte aligned (n too
 * a multiple of 16 is stricter than the library asks, which needs only the
 * leading dimensions so). Missing scale pointers are refused at cublasLtMatmul,
 * which is stricter than the library (it reads a NULL scale as 1.0): kiln's
 * fp8 codes mean nothing unscaled, so a forgotten scale must not pass. */
static inline int emu_lt_fp8(int t) { return t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2; }
/* Outer-vector scales (cuBLAS's "outer vector scaling for FP8 data types",
 * cuBLAS 12.9): D_ij = alpha sA_i sB_j sum_l op(A)_il op(B)_lj + beta C_ij,
 * sA of length m and sB of n, fp32. Refused as documented: unless both A's
 * and B's modes are OUTER_VEC_32F and every other matrix's mode is left as
 * it was (SCALAR_32F), on a GPU whose compute capability is not 9.0 (the
 * documentation's table lists 9.0 alone for this mode), and (at
 * cublasLtMatmul) with a D scale, which the mode has none of since D is
 * never fp8 here. Modes the stand-in does not run (block scaling) are
 * NOT_SUPPORTED. */
static inline int emu_lt_outer_vec(cublasLtMatmulDesc_t d) {
    return d->mode[0] == CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
}
static inline cublasStatus_t emu_lt_validate_modes(cublasLtMatmulDesc_t d) {
    const int32_t scalar = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, outer = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    for (int i = 0; i < 7; i++)
        if (d->mode[i] != scalar && d->mode[i] != outer) return CUBLAS_STATUS_NOT_SUPPORTED; /* not emulated */
    int va = d->mode[0] == outer, vb = d->mode[1] == outer;
    if (!va && !vb) return CUBLAS_STATUS_SUCCESS;
    if (!va || !vb) return CUBLAS_STATUS_NOT_SUPPORTED;
    for (int i = 2; i < 7; i++)
        if (d->mode[i]) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (emu_sm_major != 9 || emu_sm_minor != 0) return CUBLAS_STATUS_NOT_SUPPORTED;
    return CUBLAS_STATUS_SUCCESS;
}
static inline cublasStatus_t emu_lt_validate_fp8(cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t A,
                                                 cublasLtMatrixLayout_t B, cublasLtMatrixLayout_t C,
                                                 cublasLtMatrixLayout_t D) {
    if (!emu_lt_fp8(A->type) || !emu_lt_fp8(B->type)) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (A->type == CUDA_R_8F_E5M2 && B->type == CUDA_R_8F_E5M2) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (d->ta != CUBLAS_OP_T || d->tb != CUBLAS_OP_N) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (C->type != D->type || (D->type != CUDA_R_16BF && D->type != CUDA_R_32F)) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (d->epi != CUBLASLT_EPILOGUE_DEFAULT && d->epi != CUBLASLT_EPILOGUE_BIAS) return CUBLAS_STATUS_NOT_SUPPORTED;
    cublasStatus_t st = emu_lt_validate_modes(d);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    uint64_t m = D->rows, n = D->cols, k = A->rows;
    if (A->cols != m || B->rows != k || B->cols != n || C->rows != m || C->cols != n || C->ld != D->ld)
        return CUBLAS_STATUS_INVALID_VALUE;
    if (A->ld < (int64_t)A->rows || B->ld < (int64_t)B->rows || D->ld < (int64_t)D->rows) return CUBLAS_STATUS_INVALID_VALUE;
    if (m % 16 || n % 16 || k % 16 || A->ld % 16 || B->ld % 16) return CUBLAS_STATUS_NOT_SUPPORTED;
    return CUBLAS_STATUS_SUCCESS;
}

/* The checks the library makes before choosing (or running) an algorithm. */
static inline cublasStatus_t emu_lt_validate(cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t A, cublasLtMatrixLayout_t B,
                                             cublasLtMatrixLayout_t C, cublasLtMatrixLayout_t D) {
    if (d->compute != CUBLAS_COMPUTE_32F || d->scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (emu_lt_fp8(A->type) || emu_lt_fp8(B->type)) return emu_lt_validate_fp8(d, A, B, C, D);
    /* scales (and their modes) belong to narrow-precision products only */
    for (int i = 0; i < 7; i++)
        if (d->mode[i]) return CUBLAS_STATUS_INVALID_VALUE;
    if (A->type != B->type || C->type != D->type) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (A->type == CUDA_R_32F && D->type != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (A->type != CUDA_R_32F && A->type != CUDA_R_16BF) return CUBLAS_STATUS_NOT_SUPPORTED;
    uint64_t m = D->rows, n = D->cols, k = d->ta ? A->rows : A->cols;
    if ((d->ta ? A->cols : A->rows) != m || (d->tb ? B->rows : B->cols) != n || (d->tb ? B->cols : B->rows) != k)
        return CUBLAS_STATUS_INVALID_VALUE;
    if (C->rows != m || C->cols != n || C->ld != D->ld) return CUBLAS_STATUS_INVALID_VALUE;
    if (A->ld < (int64_t)A->rows || B->ld < (int64_t)B->rows || D->ld < (int64_t)D->rows) return CUBLAS_STATUS_INVALID_VALUE;
    uint32_t e = d->epi;
    if (e != CUBLASLT_EPILOGUE_DEFAULT && e != CUBLASLT_EPILOGUE_BIAS && e != CUBLASLT_EPILOGUE_GELU_AUX &&
        e != CUBLASLT_EPILOGUE_GELU_AUX_BIAS && e != CUBLASLT_EPILOGUE_DGELU && e != CUBLASLT_EPILOGUE_BGRADB)
        return CUBLAS_STATUS_NOT_SUPPORTED; /* not emulated */
    if (emu_lt_aux_epi(e) && (d->ldaux % 8 != 0 || d->ldaux < (int64_t)m)) return CUBLAS_STATUS_INVALID_VALUE;
    /* the vector's type: D's for a bias, C's for a bias gradient (cublasLt.h) */
    if (emu_lt_bias_epi(e) && d->bias_type != -1 && d->bias_type != D->type) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (e == CUBLASLT_EPILOGUE_BGRADB) {
        if (!d->bias) return CUBLAS_STATUS_INVALID_VALUE; /* nowhere to store the gradient */
        if (d->bias_type != -1 && d->bias_type != C->type) return CUBLAS_STATUS_NOT_SUPPORTED;
        if (d->ta != CUBLAS_OP_N || d->tb != CUBLAS_OP_T) return CUBLAS_STATUS_NOT_SUPPORTED; /* not emulated */
    }
    return CUBLAS_STATUS_SUCCESS;
}

static inline cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t d,
                                                            cublasLtMatrixLayout_t A, cublasLtMatrixLayout_t B,
                                                            cublasLtMatrixLayout_t C, cublasLtMatrixLayout_t D,
                                                            cublasLtMatmulPreference_t p, int requested,
                                                            cublasLtMatmulHeuristicResult_t *res, int *found) {
    *found = 0;
    emu_lt_heuristic_calls++;
    if (!h || requested < 1) return CUBLAS_STATUS_INVALID_VALUE;
    cublasStatus_t st = emu_lt_validate(d, A, B, C, D);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    if (emu_lt_no_algo_epi && d->epi == emu_lt_no_algo_epi) return CUBLAS_STATUS_SUCCESS; /* none found */
    memset(res, 0, sizeof *res);
    memcpy(res->algo.align, p->align, sizeof p->align);
    /* the pointers' values, which the heuristic reads for their alignment */
    res->algo.align_bias = emu_lt_align(d->bias);
    res->algo.align_aux = emu_lt_align(d->aux);
    res->algo.valid = 1;
    res->workspaceSize = p->ws < ((size_t)1 << 20) ? p->ws : ((size_t)1 << 20);
    res->state = CUBLAS_STATUS_SUCCESS;
    *found = 1;
    return CUBLAS_STATUS_SUCCESS;
}

static inline float emu_lt_load(const void *p, int type, size_t i) {
    if (emu_lt_fp8(type)) return fp8_to_f32(((const uint8_t *)p)[i], type == CUDA_R_8F_E4M3 ? FP8_E4M3 : FP8_E5M2);
    return type == CUDA_R_16BF ? __bfloat162float(((const bf16 *)p)[i]) : ((const float *)p)[i];
}
static inline void emu_lt_store(void *p, int type, size_t i, float x) {
    if (type == CUDA_R_16BF) ((bf16 *)p)[i] = __float2bfloat16_rn(x);
    else ((float *)p)[i] = x;
}
static inline float emu_lt_gelu(float x) {
    float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.0f + tanhf(u));
}
static inline float emu_lt_dgelu(float x) {
    float u = 0.7978845608028654f * (x + 0.044715f * x * x * x), th = tanhf(u);
    return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * x * x);
}

/* D = epilogue(alpha op(A) op(B) (+ bias)) + beta C, column-major, fp32 sums. */
static inline cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t d, const void *alpha, const void *a,
                                            cublasLtMatrixLayout_t A, const void *b, cublasLtMatrixLayout_t B,
                                            const void *beta, const void *c, cublasLtMatrixLayout_t C, void *dd,
                                            cublasLtMatrixLayout_t D, const cublasLtMatmulAlgo_t *algo, void *ws,
                                            size_t ws_bytes, cudaStream_t stream) {
    if (!h || !algo || !algo->valid) return CUBLAS_STATUS_INVALID_VALUE;
    cublasStatus_t st = emu_lt_validate(d, A, B, C, D);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    if (stream != 0 && stream != cudaStreamLegacy) emu_fail("cublasLtMatmul on another stream than the kernels'");
    const void *ptr[4] = {a, b, c, dd};
    for (int i = 0; i < 4; i++)
        if (emu_lt_align(ptr[i]) < algo->align[i])
            emu_fail("cublasLtMatmul: A, B, C or D less aligned than the preference told the heuristic");
    uint32_t e = d->epi;
    if (emu_lt_vec_epi(e) && (!d->bias || emu_lt_align(d->bias) < algo->align_bias))
        emu_fail("cublasLtMatmul: the bias pointer is less aligned than the one the heuristic saw");
    if (emu_lt_aux_epi(e) && (!d->aux || emu_lt_align(d->aux) < algo->align_aux))
        emu_fail("cublasLtMatmul: the aux pointer is less aligned than the one the heuristic saw");
    if (ws_bytes && !emu_is_device(ws, ws_bytes)) emu_fail("cublasLtMatmul: the workspace is not device memory");
    float al, be;
    memcpy(&al, alpha, 4), memcpy(&be, beta, 4);
    if (emu_lt_fp8(A->type) && (emu_lt_align(a) < 16 || emu_lt_align(b) < 16 || emu_lt_align(dd) < 16))
        return CUBLAS_STATUS_NOT_SUPPORTED; /* fp8: every matrix pointer 16-byte aligned */
    uint64_t m = D->rows, n = D->cols, k = d->ta ? A->rows : A->cols;
    int vec = emu_lt_fp8(A->type) && emu_lt_outer_vec(d);
    if (emu_lt_fp8(A->type)) { /* fp8: alpha times both operands' scales (vec: sA_i sB_j per element, below) */
        if (!d->scale_a || !d->scale_b) return CUBLAS_STATUS_INVALID_VALUE;
        if (vec && d->scale_d) return CUBLAS_STATUS_INVALID_VALUE;
        if (!emu_is_device(d->scale_a, (vec ? m : 1) * 4) || !emu_is_device(d->scale_b, (vec ? n : 1) * 4)) {
            if (!vec) return CUBLAS_STATUS_INVALID_VALUE;
            emu_fail("cublasLtMatmul: an outer-vector scale is not m (A) or n (B) floats of device memory");
        }
        if (!vec) al *= *d->scale_a * *d->scale_b;
    }
    if (!emu_is_device(dd, ((n - 1) * D->ld + m) * (D->type == CUDA_R_16BF ? 2 : 4)))
        emu_fail("cublasLtMatmul: D is not (all) device memory");
    if (e == CUBLASLT_EPILOGUE_BGRADB) { /* the sum of op(B) over k, one per column of D, in C's type */
        if (al != 1.0f) emu_fail("cublasLtMatmul: BGRADB with alpha != 1 (cublasLt.h does not say whether it scales)");
        if (!emu_is_device(d->bias, n * (C->type == CUDA_R_16BF ? 2 : 4)))
            emu_fail("cublasLtMatmul: the bias gradient is not (all) device memory");
        for (uint64_t j = 0; j < n; j++) {
            float g = 0.0f;
            for (uint64_t l = 0; l < k; l++) g += emu_lt_load(b, B->type, d->tb ? l * B->ld + j : j * B->ld + l);
            emu_lt_store((void *)d->bias, C->type, j, g);
        }
    }
    std::vector<float> out(m * n);
    for (uint64_t j = 0; j < n; j++)
        for (uint64_t i = 0; i < m; i++) {
            float s = 0.0f;
            for (uint64_t l = 0; l < k; l++) {
                float x = emu_lt_load(a, A->type, d->ta ? i * A->ld + l : l * A->ld + i);
                float y = emu_lt_load(b, B->type, d->tb ? l * B->ld + j : j * B->ld + l);
                s += x * y;
            }
            s *= vec ? al * d->scale_a[i] * d->scale_b[j] : al;
            if (emu_lt_bias_epi(e)) s += emu_lt_load(d->bias, D->type, i);
            if (e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS) {
                emu_lt_store((void *)d->aux, D->type, j * d->ldaux + i, s);
                s = emu_lt_gelu(s);
            } else if (e == CUBLASLT_EPILOGUE_DGELU) {
                s *= emu_lt_dgelu(emu_lt_load(d->aux, D->type, j * d->ldaux + i));
            }
            if (be != 0.0f) s += be * emu_lt_load(c, C->type, j * C->ld + i); /* beta 0: C is not read */
            out[j * m + i] = s;
        }
    for (uint64_t j = 0; j < n; j++)
        for (uint64_t i = 0; i < m; i++) emu_lt_store(dd, D->type, j * D->ld + i, out[j * m + i]);
    emu_check_canaries();
    return CUBLAS_STATUS_SUCCESS;
}

#endif
