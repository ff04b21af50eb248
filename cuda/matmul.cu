/* matmul: the backend's matrix products through cuBLASLt. kiln is row-major
 * and cuBLASLt column-major; a row-major (R,K) matrix is the same memory as a
 * column-major (K,R) one, so each product is written for the transposes:
 *   forward  out(N,OC) = inp @ w^T     <=>  out^T(OC,N)  = w^T' (T) * inp^T (N)
 *   dinp(N,C)  = dout @ w              <=>  dinp^T(C,N)  = w^T (N)   * dout^T (N)
 *   dw(OC,C)  (+)= dout^T @ inp        <=>  dw^T(C,OC)   = inp^T (N) * dout (T)
 * where (N)/(T) is the op cuBLASLt applies to the column-major view. Plans
 * (descriptors, layouts and the heuristic's algorithm) are cached per shape,
 * so after the first step a product costs one cublasLtMatmul call. Compute
 * type: strict fp32 (CUBLAS_COMPUTE_32F) or bf16 tensor cores on fp32 data
 * (CUBLAS_COMPUTE_32F_FAST_16BF: inputs rounded to bf16, fp32 accumulate). */
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
    int bias, bf16;
} MmKey;

typedef struct {
    MmKey key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulAlgo_t algo;
} MmPlan;

static cublasLtHandle_t mm_handle;
static void *mm_workspace;
static int mm_bf16;
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

void cuda_matmul_set_compute(int bf16) { mm_bf16 = bf16 != 0; }
int cuda_matmul_get_compute(void) { return mm_bf16; }

static int mm_align(const void *p) {
    uintptr_t a = (uintptr_t)p;
    int al = 256;
    while (al > 4 && a % al) al /= 2;
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
    cublasComputeType_t ct = key->bf16 ? CUBLAS_COMPUTE_32F_FAST_16BF : CUBLAS_COMPUTE_32F;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, ct, CUDA_R_32F));
    cublasOperation_t ta = key->ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = key->tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    cublasLtEpilogue_t epi = key->bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    /* op(A) is m x k, op(B) is k x n, D is m x n, all column-major. */
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->la, CUDA_R_32F, key->ta ? key->k : key->m,
                                            key->ta ? key->m : key->k, key->lda));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lb, CUDA_R_32F, key->tb ? key->n : key->k,
                                            key->tb ? key->k : key->n, key->ldb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->ld, CUDA_R_32F, key->m, key->n, key->ldd));
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

/* D(m,n) = op(A) op(B) (+ bias(m)) + beta D, column-major. Returns 0 if no
 * algorithm takes a bias epilogue for this shape (the caller adds the bias). */
static int mm_gemm(float *D, const float *A, const float *B, const float *bias, int m, int n, int k,
                   int ta, int tb, int lda, int ldb, int ldd, float beta) {
    MmKey key;
    memset(&key, 0, sizeof key); /* padding too: keys are compared with memcmp */
    key.m = m, key.n = n, key.k = k, key.ta = ta, key.tb = tb;
    key.lda = lda, key.ldb = ldb, key.ldd = ldd;
    key.align_a = mm_align(A), key.align_b = mm_align(B), key.align_d = mm_align(D);
    key.bias = bias != NULL;
    key.bf16 = mm_bf16;
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

__global__ void add_bias_kernel(float *out, const float *bias, int N, int OC) {
    size_t total = (size_t)N * OC;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x)
        out[e] += bias[e % OC];
}

void cuda_matmul_forward(float *out, const float *inp, const float *w, const float *bias, int N,
                         int C, int OC) {
    /* out (N,OC), inp (N,C), w (OC,C), bias (OC) or NULL */
    /* The bias epilogue reads the vector with wide loads: give it only 16-byte
     * aligned vectors (every model tensor is 64-byte aligned). */
    const float *epi_bias = bias && mm_align(bias) >= 16 ? bias : NULL;
    int fused = mm_gemm(out, w, inp, epi_bias, OC, N, C, 1, 0, C, C, OC, 0.0f);
    if (!fused) mm_gemm(out, w, inp, NULL, OC, N, C, 1, 0, C, C, OC, 0.0f);
    if (bias && (!fused || !epi_bias)) {
        unsigned blocks = cuda_blocks((size_t)N * OC, 256);
        add_bias_kernel<<<blocks > 65536 ? 65536 : blocks, 256>>>(out, bias, N, OC);
        CUDA_CHECK_LAUNCH();
    }
}

void cuda_matmul_backward(float *dinp, float *dw, float *dbias, const float *dout, const float *inp,
                          const float *w, int N, int C, int OC, int accumulate) {
    /* dinp (N,C) or NULL, dw (OC,C), dbias (OC) or NULL, dout (N,OC), inp (N,C), w (OC,C) */
    if (dinp) mm_gemm(dinp, w, dout, NULL, C, N, OC, 0, 0, C, OC, C, 0.0f);
    /* beta 0 does not read dw (BLAS semantics): garbage, even NaN, is overwritten. */
    mm_gemm(dw, inp, dout, NULL, C, OC, N, 0, 1, C, OC, C, accumulate ? 1.0f : 0.0f);
    if (dbias) cuda_colsum(dbias, dout, N, OC, accumulate);
}
