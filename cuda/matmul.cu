/* matmul: the backend's matrix products through cuBLASLt. kiln is row-major
 * and cuBLASLt column-major; a row-major (R,K) matrix is the same memory as a
 * column-major (K,R) one, so each product is written for the transposes:
 *   forward  out(N,OC) = inp @ w^T     <=>  out^T(OC,N)  = w^T' (T) * inp^T (N)
 *   dinp(N,C)  = dout @ w              <=>  dinp^T(C,N)  = w^T (N)   * dout^T (N)
 *   dw(OC,C)  (+)= dout^T @ inp        <=>  dw^T(C,OC)   = inp^T (N) * dout (T)
 * where (N)/(T) is the op cuBLASLt applies to the column-major view. Plans
 * (descriptors, layouts and the heuristic's algorithm) are cached per shape,
 * so after the first step a product costs one cublasLtMatmul call.
 * Types follow the activation dtype (common.cuh), compute type always
 * CUBLAS_COMPUTE_32F (fp32 accumulation; strict fp32 products when A and B
 * are fp32, bf16 tensor cores when they are bf16):
 *   forward, dinp: A, B, D (and the bias) act
 *   dw:            A, B act; C = D fp32, so beta = 1 accumulates the fp32
 *                  parameter gradient in place (a supported cuBLASLt
 *                  combination: bf16 A/B with fp32 C/D).
 * The bias epilogue reads a vector of D's type (cublasLt.h,
 * CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE): the bf16 compute copy of the bias.
 * dbias is not the BGRADB epilogue: that writes the gradient in D's type and
 * overwrites it, where kiln accumulates micro-batches into fp32; the
 * deterministic column sum (embed_norm.cu) reads bf16 dout and adds in fp32. */
#include <cublasLt.h>
#include <string.h>

#include "common.cuh"

#define CUBLAS_CHECK(call)                                                                    \
    do {                                                                                      \
        cublasStatus_t kiln_st_ = (call);                                                     \
        if (kiln_st_ != CUBLAS_STATUS_SUCCESS)                                                \
            kiln_fail(KILN_EXIT_RUNTIME, "cublasLt: %s:%d: %s failed: status %d", __FILE__,   \
                      __LINE__, #call, (int)kiln_st_);                                        \
    } while (0)

#define MM_WORKSPACE_BYTES ((size_t)32 << 20) /* cuBLASLt's recommendation for Hopper */
#define MM_MAX_PLANS 256

typedef struct {
    int m, n, k, ta, tb, lda, ldb, ldd;
    int align_a, align_b, align_d; /* bytes, power of two <= 256 */
    int bias;
    int ab_bf16, d_bf16; /* A/B, C/D element types: bf16 (1) or fp32 (0) */
} MmKey;

typedef struct {
    MmKey key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulAlgo_t algo;
} MmPlan;

static cublasLtHandle_t mm_handle;
static void *mm_workspace;
static MmPlan mm_plans[MM_MAX_PLANS];
static int mm_nplans;

void cuda_matmul_init(void) {
    if (mm_handle) return;
    CUBLAS_CHECK(cublasLtCreate(&mm_handle));
    CUDA_CHECK(cudaMalloc(&mm_workspace, MM_WORKSPACE_BYTES));
}

void cuda_matmul_shutdown(void) {
    for (int i = 0; i < mm_nplans; i++) {
        cublasLtMatmulDescDestroy(mm_plans[i].desc);
        cublasLtMatrixLayoutDestroy(mm_plans[i].la);
        cublasLtMatrixLayoutDestroy(mm_plans[i].lb);
        cublasLtMatrixLayoutDestroy(mm_plans[i].ld);
    }
    mm_nplans = 0;
    if (mm_workspace) cudaFree(mm_workspace);
    mm_workspace = NULL;
    if (mm_handle) cublasLtDestroy(mm_handle);
    mm_handle = NULL;
}

static int mm_align(const void *p) {
    uintptr_t a = (uintptr_t)p;
    int al = 256;
    while (al > 2 && a % al) al /= 2;
    return al;
}

/* Build (or find) the plan for a key; NULL if the heuristic has no algorithm. */
static MmPlan *mm_plan(const MmKey *key) {
    for (int i = 0; i < mm_nplans; i++)
        if (memcmp(&mm_plans[i].key, key, sizeof *key) == 0) return &mm_plans[i];
    if (mm_nplans == MM_MAX_PLANS)
        kiln_fail(KILN_EXIT_RUNTIME, "cublasLt: more than %d distinct matrix-product shapes", MM_MAX_PLANS);
    MmPlan *p = &mm_plans[mm_nplans];
    memset(p, 0, sizeof *p);
    p->key = *key;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cudaDataType_t tab = key->ab_bf16 ? CUDA_R_16BF : CUDA_R_32F, td = key->d_bf16 ? CUDA_R_16BF : CUDA_R_32F;
    cublasOperation_t ta = key->ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = key->tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    cublasLtEpilogue_t epi = key->bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    /* op(A) is m x k, op(B) is k x n, D is m x n, all column-major. */
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->la, tab, key->ta ? key->k : key->m,
                                            key->ta ? key->m : key->k, key->lda));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lb, tab, key->tb ? key->n : key->k,
                                            key->tb ? key->k : key->n, key->ldb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->ld, td, key->m, key->n, key->ldd));
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    size_t ws = MM_WORKSPACE_BYTES;
    uint32_t aa = (uint32_t)key->align_a, ab = (uint32_t)key->align_b, ad = (uint32_t)key->align_d;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof aa));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof ab));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ad, sizeof ad));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ad, sizeof ad));
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(mm_handle, p->desc, p->la, p->lb, p->ld, p->ld,
                                                       pref, 1, &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
        cublasLtMatmulDescDestroy(p->desc);
        cublasLtMatrixLayoutDestroy(p->la);
        cublasLtMatrixLayoutDestroy(p->lb);
        cublasLtMatrixLayoutDestroy(p->ld);
        return NULL;
    }
    p->algo = res.algo;
    mm_nplans++;
    return p;
}

/* D(m,n) = op(A) op(B) (+ bias(m)) + beta D, column-major; A, B of the
 * activation dtype, D too or fp32 (d_f32). Returns 0 if no algorithm takes a
 * bias epilogue for this shape (the caller adds the bias). */
static int mm_gemm(void *D, const void *A, const void *B, const void *bias, int m, int n, int k, int ta,
                   int tb, int lda, int ldb, int ldd, float beta, int d_f32) {
    MmKey key;
    memset(&key, 0, sizeof key); /* padding too: keys are compared with memcmp */
    key.m = m, key.n = n, key.k = k, key.ta = ta, key.tb = tb;
    key.lda = lda, key.ldb = ldb, key.ldd = ldd;
    key.align_a = mm_align(A), key.align_b = mm_align(B), key.align_d = mm_align(D);
    key.bias = bias != NULL;
    key.ab_bf16 = cuda_act_bf16;
    key.d_bf16 = cuda_act_bf16 && !d_f32;
    MmPlan *p = mm_plan(&key);
    if (!p) {
        if (bias) return 0;
        kiln_fail(KILN_EXIT_RUNTIME, "cublasLt: no algorithm for a %dx%dx%d product (ta=%d tb=%d, alignments %d/%d/%d)",
                  m, n, k, ta, tb, key.align_a, key.align_b, key.align_d);
    }
    if (bias)
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
    const float alpha = 1.0f;
    CUBLAS_CHECK(cublasLtMatmul(mm_handle, p->desc, &alpha, A, p->la, B, p->lb, &beta, D, p->ld, D, p->ld,
                                &p->algo, mm_workspace, MM_WORKSPACE_BYTES, 0));
    return 1;
}

template <typename T_>
__global__ void add_bias_kernel(T_ *out, const T_ *bias, int N, int OC) {
    size_t total = (size_t)N * OC;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x)
        out[e] = act_from<T_>(act_f(out[e]) + act_f(bias[e % OC]));
}

template <typename T_>
static void add_bias_run(void *out, const void *bias, int N, int OC) {
    unsigned blocks = cuda_blocks((size_t)N * OC, 256);
    add_bias_kernel<T_><<<blocks > 65536 ? 65536 : blocks, 256>>>((T_ *)out, (const T_ *)bias, N, OC);
    CUDA_CHECK_LAUNCH();
}

void cuda_matmul_forward(void *out, const void *inp, const void *w, const void *bias, int N, int C,
                         int OC) {
    /* out (N,OC), inp (N,C), w (OC,C), bias (OC) or NULL; all act */
    /* The bias epilogue reads the vector with wide loads: give it only 16-byte
     * aligned vectors (every model tensor is: offsets are multiples of 16
     * elements, 32 bytes in the bf16 compute copy). */
    const void *epi_bias = bias && mm_align(bias) >= 16 ? bias : NULL;
    int fused = mm_gemm(out, w, inp, epi_bias, OC, N, C, 1, 0, C, C, OC, 0.0f, 0);
    if (!fused) mm_gemm(out, w, inp, NULL, OC, N, C, 1, 0, C, C, OC, 0.0f, 0);
    if (bias && (!fused || !epi_bias)) ACT_DISPATCH(add_bias_run, out, bias, N, OC);
}

void cuda_matmul_backward(void *dinp, float *dw, float *dbias, const void *dout, const void *inp,
                          const void *w, int N, int C, int OC, int accumulate) {
    /* dinp (N,C) act or NULL, dw (OC,C) fp32, dbias (OC) fp32 or NULL, dout (N,OC), inp (N,C),
     * w (OC,C) act */
    if (dinp) mm_gemm(dinp, w, dout, NULL, C, N, OC, 0, 0, C, OC, C, 0.0f, 0);
    /* beta 0 does not read dw (BLAS semantics): garbage, even NaN, is overwritten. */
    mm_gemm(dw, inp, dout, NULL, C, OC, N, 0, 1, C, OC, C, accumulate ? 1.0f : 0.0f, 1);
    if (dbias) cuda_colsum(dbias, dout, N, OC, accumulate);
}
