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
 * dbias comes out of the dw product by its BGRADB epilogue: B is dout, so
 * the bias gradient is the sum of op(B) over k = N, one per column of D, in
 * C's type (cublasLt.h, BIAS_POINTER), which for dw is fp32 (the default of
 * BIAS_DATA_TYPE, so kiln leaves it unset); it overwrites, so accumulate
 * goes through a scratch vector and an add. Where cuBLASLt has no such
 * algorithm for a shape (asked once per shape, the answer kept in its plan),
 * the deterministic column sum (embed_norm.cu) reads dout again instead. */
#ifndef KILN_CUDA_EMU /* test/matmul_emu.cc runs this file on the CPU against test/cublaslt_emu.h */
#include <cublasLt.h>
#endif
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
    int align_a, align_b, align_d, align_aux, align_bias; /* bytes, power of two <= 256 */
    int epi;                                  /* cublasLtEpilogue_t */
    int ldaux;                                /* GELU_AUX*, DGELU: the aux matrix's leading dimension */
    int ab_bf16, d_bf16; /* A/B, C/D element types: bf16 (1) or fp32 (0) */
    int fp8_a, fp8_b;    /* fp8 operands (cuda_fp8_matmul): 1 + Fp8Format; 0: ab_bf16 says */
    int fp8_vec;         /* fp8 with outer-vector (per-row) scales for A and B */
} MmKey;
static void mm_fp8_scale_modes(cublasLtMatmulDesc_t desc, const MmKey *key); /* the fp8 section below */

/* A plan is kept whether or not cuBLASLt has an algorithm for it (usable 0),
 * so a shape it refuses costs one heuristic query per run, not one per step. */
typedef struct {
    MmKey key;
    int usable;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulAlgo_t algo;
    unsigned long long used; /* mm_clock at the last use: the least recent is replaced when the table is full */
} MmPlan;

static cublasLtHandle_t mm_handle;
static void *mm_workspace;
static MmPlan mm_plans[MM_MAX_PLANS];
static int mm_nplans;
static unsigned long long mm_clock;

void cuda_matmul_init(void) {
    if (mm_handle) return;
    CUBLAS_CHECK(cublasLtCreate(&mm_handle));
    CUDA_CHECK(cudaMalloc(&mm_workspace, MM_WORKSPACE_BYTES));
}

static void mm_plan_release(MmPlan *p) {
    if (p->desc) cublasLtMatmulDescDestroy(p->desc);
    if (p->la) cublasLtMatrixLayoutDestroy(p->la);
    if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
    if (p->ld) cublasLtMatrixLayoutDestroy(p->ld);
    p->desc = NULL, p->la = p->lb = p->ld = NULL;
    p->usable = 0;
}

void cuda_matmul_shutdown(void) {
    for (int i = 0; i < mm_nplans; i++) mm_plan_release(&mm_plans[i]);
    mm_nplans = 0;
    if (mm_workspace) cudaFree(mm_workspace);
    mm_workspace = NULL;
    if (mm_handle) cublasLtDestroy(mm_handle);
    mm_handle = NULL;
}

static const char *fp8_fmt_name(int f) { return f ? "e5m2" : "e4m3"; }

static int mm_align(const void *p) {
    uintptr_t a = (uintptr_t)p;
    int al = 256;
    while (al > 2 && a % al) al /= 2;
    return al;
}

static int mm_epi_has_aux(int epi) {
    return epi == CUBLASLT_EPILOGUE_GELU_AUX || epi == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || epi == CUBLASLT_EPILOGUE_DGELU;
}
static const char *mm_epi_name(int epi) {
    return epi == CUBLASLT_EPILOGUE_BGRADB ? "BGRADB"
           : epi == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ? "GELU_AUX_BIAS"
           : epi == CUBLASLT_EPILOGUE_GELU_AUX    ? "GELU_AUX"
           : epi == CUBLASLT_EPILOGUE_DGELU       ? "DGELU"
           : epi == CUBLASLT_EPILOGUE_BIAS        ? "BIAS"
                                                  : "DEFAULT";
}

/* Say once per plan why a GeLU or bias-gradient epilogue is not used (the
 * bias epilogue's fallback, a separate add, is silent as it always was). */
static void mm_refused(const MmKey *key, const char *why) {
    if (key->epi == CUBLASLT_EPILOGUE_BGRADB)
        kiln_warn("cublasLt: BGRADB epilogue: %s for a %dx%dx%d %s product (bias gradient alignment %d): the bias "
                  "gradient is a column sum for this shape", why, key->m, key->n, key->k, key->ab_bf16 ? "bf16" : "fp32",
                  key->align_bias);
    if (!mm_epi_has_aux(key->epi)) return;
    kiln_warn("cublasLt: %s epilogue: %s for a %dx%dx%d %s product (aux ld %d, aux alignment %d): the GeLU runs "
              "as its own kernel for this shape (precision.gelu_fusion)", mm_epi_name(key->epi), why, key->m, key->n, key->k,
              key->ab_bf16 ? "bf16" : "fp32", key->ldaux, key->align_aux);
}

/* Build (or find) the plan for a key. The aux and bias pointers go into
 * the descriptor before the heuristic runs: cublasLt.h says it reads their
 * values (not the memory) to know their alignment (EPILOGUE_AUX_POINTER,
 * BIAS_POINTER), which the key therefore holds; a NULL bias there would
 * promise any alignment, and a later, less aligned bias break the promise. */
/* The table is bounded but the shapes are not: an MoE layer's expert
 * products take as many rows (and row offsets, so alignments) as the router
 * gave each expert, new shapes every micro-batch. When it is full the least
 * recently used plan makes room (the model's fixed shapes stay, being used
 * every step); a replaced plan costs one heuristic query if it comes back. */
static MmPlan *mm_plan(const MmKey *key, const void *aux, const void *bias) {
    mm_clock++;
    for (int i = 0; i < mm_nplans; i++)
        if (memcmp(&mm_plans[i].key, key, sizeof *key) == 0) {
            mm_plans[i].used = mm_clock;
            return &mm_plans[i];
        }
    MmPlan *p;
    if (mm_nplans < MM_MAX_PLANS) {
        p = &mm_plans[mm_nplans++];
    } else { /* full: replace the least recently used */
        p = &mm_plans[0];
        for (int i = 1; i < MM_MAX_PLANS; i++)
            if (mm_plans[i].used < p->used) p = &mm_plans[i];
        mm_plan_release(p);
    }
    memset(p, 0, sizeof *p);
    p->key = *key;
    p->used = mm_clock;
    /* cublasLt.h: the GELU aux leading dimension must be a multiple of 8 (and
     * at least D's rows, which ld = m is); 16-byte aux pointers as for the bias. */
    if (mm_epi_has_aux(key->epi) && (key->ldaux % 8 != 0 || key->align_aux < 16)) {
        mm_refused(key, key->ldaux % 8 ? "aux leading dimension not a multiple of 8" : "aux not 16-byte aligned");
        return p;
    }
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cudaDataType_t tab = key->ab_bf16 ? CUDA_R_16BF : CUDA_R_32F, td = key->d_bf16 ? CUDA_R_16BF : CUDA_R_32F;
    cudaDataType_t fp8t[3] = {tab, CUDA_R_8F_E4M3, CUDA_R_8F_E5M2};
    cudaDataType_t ta_t = fp8t[key->fp8_a], tb_t = fp8t[key->fp8_b];
    cublasOperation_t ta = key->ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = key->tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    cublasLtEpilogue_t epi = (cublasLtEpilogue_t)key->epi;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    if (mm_epi_has_aux(key->epi)) {
        /* The aux element type is left at its default, D's type: the act
         * dtype, which is what the pre-activation buffer holds. */
        int64_t ldaux = key->ldaux;
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux));
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ldaux, sizeof ldaux));
    }
    if (bias)
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
    if (key->fp8_a) mm_fp8_scale_modes(p->desc, key);
    /* op(A) is m x k, op(B) is k x n, D is m x n, all column-major. */
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->la, ta_t, key->ta ? key->k : key->m,
                                            key->ta ? key->m : key->k, key->lda));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lb, tb_t, key->tb ? key->n : key->k,
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
    CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
        mm_refused(key, "the heuristic has no algorithm");
        mm_plan_release(p);
        return p;
    }
    p->algo = res.algo;
    p->usable = 1;
    return p;
}

/* D(m,n) = epilogue(alpha op(A) op(B) (+ bias(m))) + beta D, column-major; A, B of
 * the activation dtype, D too or fp32 (d_f32). epi is a cublasLtEpilogue_t;
 * aux (ld ldaux) is the GELU epilogues' pre-activation, written by GELU_AUX*
 * and read by DGELU; with BGRADB, bias is where the bias gradient (n) goes.
 * Returns 0, having done nothing, if cuBLASLt takes no such epilogue for
 * this shape (the caller does the product and its part separately); the
 * plain product (DEFAULT) has no fallback and fails the run instead. */
static int mm_gemm_scaled(void *D, const void *A, const void *B, int m, int n, int k, int ta, int tb, int lda,
                          int ldb, int ldd, float alpha, float beta, int d_f32, int epi, const void *bias,
                          const void *aux, int ldaux) {
    MmKey key;
    memset(&key, 0, sizeof key); /* padding too: keys are compared with memcmp */
    key.m = m, key.n = n, key.k = k, key.ta = ta, key.tb = tb;
    key.lda = lda, key.ldb = ldb, key.ldd = ldd;
    key.align_a = mm_align(A), key.align_b = mm_align(B), key.align_d = mm_align(D);
    key.epi = epi;
    if (mm_epi_has_aux(epi)) key.align_aux = mm_align(aux), key.ldaux = ldaux;
    if (bias) key.align_bias = mm_align(bias);
    key.ab_bf16 = cuda_act_bf16;
    key.d_bf16 = cuda_act_bf16 && !d_f32;
    MmPlan *p = mm_plan(&key, aux, bias);
    if (!p->usable) {
        if (epi != CUBLASLT_EPILOGUE_DEFAULT) return 0;
        kiln_fail(KILN_EXIT_RUNTIME, "cublasLt: no algorithm for a %dx%dx%d product (ta=%d tb=%d, alignments %d/%d/%d)",
                  m, n, k, ta, tb, key.align_a, key.align_b, key.align_d);
    }
    if (bias)
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
    if (mm_epi_has_aux(epi))
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux));
    cublasStatus_t st = cublasLtMatmul(mm_handle, p->desc, &alpha, A, p->la, B, p->lb, &beta, D, p->ld, D, p->ld,
                                       &p->algo, mm_workspace, MM_WORKSPACE_BYTES, 0);
    /* An epilogue the heuristic offered but the call refuses (checked on the
     * host, before any work is queued): drop it for this shape and let the
     * caller do its part; anything else, and any plain product, is an error. */
    if (st != CUBLAS_STATUS_SUCCESS && epi != CUBLASLT_EPILOGUE_DEFAULT &&
        (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE)) {
        mm_refused(&key, "cublasLtMatmul refused the epilogue");
        mm_plan_release(p);
        return 0;
    }
    CUBLAS_CHECK(st);
    return 1;
}

/* alpha 1: every product but Newton-Schulz's */
static int mm_gemm(void *D, const void *A, const void *B, int m, int n, int k, int ta, int tb, int lda, int ldb,
                   int ldd, float beta, int d_f32, int epi, const void *bias, const void *aux, int ldaux) {
    return mm_gemm_scaled(D, A, B, m, n, k, ta, tb, lda, ldb, ldd, 1.0f, beta, d_f32, epi, bias, aux, ldaux);
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
    KLAUNCH(add_bias_kernel<T_>, blocks > 65536 ? 65536 : blocks, 256, 0, (T_ *)out, (const T_ *)bias, N, OC);
    CUDA_CHECK_LAUNCH();
}

void cuda_matmul_forward(void *out, const void *inp, const void *w, const void *bias, int N, int C,
                         int OC) {
    /* out (N,OC), inp (N,C), w (OC,C), bias (OC) or NULL; all act */
    /* The bias epilogue reads the vector with wide loads: give it only 16-byte
     * aligned vectors (every model tensor is: offsets are multiples of 16
     * elements, 32 bytes in the bf16 compute copy). */
    if (N == 0) return; /* no rows (an expert given no tokens): nothing to write; cuBLASLt takes no empty matrix */
    const void *epi_bias = bias && mm_align(bias) >= 16 ? bias : NULL;
    int fused = epi_bias && mm_gemm(out, w, inp, OC, N, C, 1, 0, C, C, OC, 0.0f, 0, CUBLASLT_EPILOGUE_BIAS,
                                    epi_bias, NULL, 0);
    if (!fused) mm_gemm(out, w, inp, OC, N, C, 1, 0, C, C, OC, 0.0f, 0, CUBLASLT_EPILOGUE_DEFAULT, NULL, NULL, 0);
    if (bias && !fused) ACT_DISPATCH(add_bias_run, out, bias, N, OC);
}

/* dw (+)= dout^T inp with dbias from the same product (BGRADB) where
 * cuBLASLt takes it: straight into dbias when it overwrites (and is 16-byte
 * aligned, as the bias epilogue's vectors are given), else into a scratch
 * vector then added (accumulate) or copied. Returns 0 if dbias is left to
 * do: no dbias asked, or no such algorithm (dw is done either way). */
static int mm_dw_bgradb(float *dw, float *dbias, const void *dout, const void *inp, int N, int C, int OC,
                        int accumulate) {
    /* beta 0 does not read dw (BLAS semantics): garbage, even NaN, is overwritten. */
    float beta = accumulate ? 1.0f : 0.0f;
    float *bgrad = NULL;
    if (dbias)
        bgrad = accumulate || mm_align(dbias) < 16 ? (float *)cuda_scratch(SCRATCH_COLSUM, (size_t)OC * sizeof(float))
                                                   : dbias;
    if (bgrad && mm_gemm(dw, inp, dout, C, OC, N, 0, 1, C, OC, C, beta, 1, CUBLASLT_EPILOGUE_BGRADB, bgrad, NULL, 0)) {
        if (bgrad == dbias) return 1;
        if (accumulate) cuda_add(dbias, dbias, bgrad, (size_t)OC);
        else CUDA_CHECK(cudaMemcpyAsync(dbias, bgrad, (size_t)OC * sizeof(float), cudaMemcpyDeviceToDevice, 0));
        return 1;
    }
    mm_gemm(dw, inp, dout, C, OC, N, 0, 1, C, OC, C, beta, 1, CUBLASLT_EPILOGUE_DEFAULT, NULL, NULL, 0);
    return 0;
}

void cuda_matmul_backward(void *dinp, float *dw, float *dbias, const void *dout, const void *inp,
                          const void *w, int N, int C, int OC, int accumulate) {
    /* dinp (N,C) act or NULL, dw (OC,C) fp32 or NULL, dbias (OC) fp32 or NULL, dout (N,OC), inp (N,C),
     * w (OC,C) act */
    if (N == 0) { /* a sum over no rows: dw and dbias are 0 or kept, per accumulate; no dinp rows */
        if (!accumulate && dw) CUDA_CHECK(cudaMemsetAsync(dw, 0, (size_t)OC * C * sizeof(float), 0));
        if (dbias) cuda_colsum(dbias, dout, N, OC, accumulate);
        return;
    }
    if (dinp) mm_gemm(dinp, w, dout, C, N, OC, 0, 0, C, OC, C, 0.0f, 0, CUBLASLT_EPILOGUE_DEFAULT, NULL, NULL, 0);
    int bias_done = dw && mm_dw_bgradb(dw, dbias, dout, inp, N, C, OC, accumulate);
    if (dbias && !bias_done) cuda_colsum(dbias, dout, N, OC, accumulate);
}

/* ---------------------------------------------------------------------------
 * fp8 products (backend.h fp8_matmul, Fp8Matmul): out(N,M) = (b codes * sb)
 * @ (a codes * sa)^T (+ bias(M)) (+ out), a (M,K) and b (N,K) fp8 codes
 * (cuda_fp8_cast). In cuBLASLt's view D^T(M,N) = op(A) op(B) with A = a,
 * transposed, and B = b, not: the "TN" layout that Hopper's fp8 kernels take
 * (and the only one), which is why the casts write transposed copies; fp32
 * accumulation, the scales applied to the accumulator, D bf16 (act) or fp32
 * (a weight gradient, beta 1 to accumulate). Scales: A_SCALE_POINTER and
 * B_SCALE_POINTER, one float each (SCALAR_32F, the default mode), or with
 * rowwise one per row of op(A) (M) and per column of op(B) (N): the
 * OUTER_VEC_32F mode of both A and B, D_ij = alpha sa_i sb_j sum_l a_il b_lj
 * (+ beta C), which cuBLAS documents for compute capability 9.0 (its table
 * of scaling modes), since cuBLAS 12.9, with no D scale and the other
 * matrices' modes unchanged (cuda_fp8_rowwise says whether this GPU and
 * library have it; model_fp8.c falls back to quantised operands if not). */
static void mm_fp8_scale_modes(cublasLtMatmulDesc_t desc, const MmKey *key) {
    if (!key->fp8_vec) return; /* SCALAR_32F: the default */
    int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof mode));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof mode));
}

/* -1 until asked: whether outer-vector scales exist here (a test resets it
 * after changing the emulated device) */
static int mm_fp8_rowwise = -1;
int cuda_fp8_rowwise(void) {
    if (mm_fp8_rowwise < 0) {
        int dev;
        cudaDeviceProp prop;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
        mm_fp8_rowwise = prop.major == 9 && prop.minor == 0 && cublasLtGetVersion() >= 120900;
    }
    return mm_fp8_rowwise;
}

/* The plan of one fp8 product with epilogue epi; NULL if cuBLASLt has none. */
static MmPlan *mm_fp8_plan(const Fp8Matmul *p, int epi) {
    MmKey key;
    memset(&key, 0, sizeof key);
    key.m = p->M, key.n = p->N, key.k = p->K, key.ta = 1, key.tb = 0, key.lda = p->K, key.ldb = p->K, key.ldd = p->M;
    key.align_a = mm_align(p->a), key.align_b = mm_align(p->b), key.align_d = mm_align(p->out);
    key.epi = epi;
    if (epi == CUBLASLT_EPILOGUE_BIAS) key.align_bias = mm_align(p->bias);
    key.ab_bf16 = 1, key.d_bf16 = cuda_act_bf16 && !p->out_f32;
    key.fp8_a = 1 + p->fmt_a, key.fp8_b = 1 + p->fmt_b, key.fp8_vec = p->rowwise;
    MmPlan *plan = mm_plan(&key, NULL, epi == CUBLASLT_EPILOGUE_BIAS ? p->bias : NULL);
    return plan->usable ? plan : NULL;
}

/* One cublasLtMatmul with plan q; its status. */
static cublasStatus_t mm_fp8_run(MmPlan *q, const Fp8Matmul *p, int epi) {
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(q->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &p->sa, sizeof p->sa));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(q->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &p->sb, sizeof p->sb));
    if (epi == CUBLASLT_EPILOGUE_BIAS)
        CUBLAS_CHECK(
            cublasLtMatmulDescSetAttribute(q->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p->bias, sizeof p->bias));
    float alpha = 1.0f, beta = p->accumulate ? 1.0f : 0.0f;
    return cublasLtMatmul(mm_handle, q->desc, &alpha, p->a, q->la, p->b, q->lb, &beta, p->out, q->ld, p->out, q->ld,
                          &q->algo, mm_workspace, MM_WORKSPACE_BYTES, 0);
}

/* The bias goes into the epilogue where cuBLASLt takes it for this product
 * (a 16-byte aligned vector, an algorithm with BIAS and these scales), else
 * the product runs plain and the add-bias kernel follows, as matmul_forward. */
void cuda_fp8_matmul(const Fp8Matmul *p) {
    /* out (N,M) act or fp32; a (M,K), b (N,K) fp8 codes; sa, sb fp32 (1 or M, N); bias (M) act or NULL */
    if (p->N == 0) return;
    if (p->K == 0) { /* a sum over no rows (an expert given no tokens): 0, or kept */
        if (!p->out_f32 || p->bias) kiln_fail(KILN_EXIT_RUNTIME, "cuda_fp8_matmul: K = 0 with an act output");
        if (!p->accumulate) CUDA_CHECK(cudaMemsetAsync(p->out, 0, (size_t)p->N * p->M * sizeof(float), 0));
        return;
    }
    int epi = p->bias && !p->out_f32 && mm_align(p->bias) >= 16 ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    MmPlan *q = epi == CUBLASLT_EPILOGUE_BIAS ? mm_fp8_plan(p, epi) : NULL;
    cublasStatus_t st = q ? mm_fp8_run(q, p, epi) : CUBLAS_STATUS_NOT_SUPPORTED;
    if (st == CUBLAS_STATUS_SUCCESS) return;
    if (q && st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_INVALID_VALUE) CUBLAS_CHECK(st);
    if (q) mm_plan_release(q); /* the epilogue refused at the call: plain from now on for this shape */
    q = mm_fp8_plan(p, CUBLASLT_EPILOGUE_DEFAULT);
    if (!q)
        kiln_fail(KILN_EXIT_RUNTIME, "cublasLt: no fp8 algorithm for a %dx%dx%d product (%s x %s, %s scales, %s out, "
                  "alignments %d/%d/%d)", p->M, p->N, p->K, fp8_fmt_name(p->fmt_a), fp8_fmt_name(p->fmt_b),
                  p->rowwise ? "outer-vector" : "scalar", p->out_f32 ? "fp32" : "act", mm_align(p->a), mm_align(p->b),
                  mm_align(p->out));
    CUBLAS_CHECK(mm_fp8_run(q, p, CUBLASLT_EPILOGUE_DEFAULT));
    if (p->bias && !p->out_f32) ACT_DISPATCH(add_bias_run, p->out, p->bias, p->N, p->M);
}

/* ---------------------------------------------------------------------------
 * GeLU fused into the fc products (backend.h: matmul_gelu_forward,
 * matmul_backward_dgelu). In cuBLASLt's column-major view:
 *   forward  out^T(OC,N) = GELU(w^T' inp^T + bias), aux = pre^T(OC,N), ld OC:
 *            GELU_AUX_BIAS (GELU_AUX without a bias);
 *   backward dinp^T(C,N) = (w^T dout^T) * GELU'(aux), aux = pre^T(C,N), ld C:
 *            DGELU; dw and dbias as in matmul_backward (dw reads inp = gelu(pre)).
 * The GeLU is cuBLASLt's: applied to the fp32 accumulator (plus bias) before
 * the act store, so with bf16 out = bf16(gelu(x)) where the separate kernel
 * computes bf16(gelu(bf16(x))); and its formula is the library's (cublasLt.h
 * says only "GELU"; test_backend_cross measures which variant it is). Not
 * DGELU_BGRAD: the bias gradient would come in the dinp product's C type
 * (bf16), where the dw product's BGRADB gives it in fp32. Where cuBLASLt
 * takes no such epilogue for a shape (an aux ld not a multiple of 8, no
 * algorithm) the separate ops run instead, after one warning naming the
 * shape. */
void cuda_matmul_gelu_forward(void *out_gelu, void *pre, const void *inp, const void *w, const void *bias, int N,
                              int C, int OC) {
    /* out_gelu, pre (N,OC), inp (N,C), w (OC,C), bias (OC) or NULL; all act */
    if (N == 0) return;
    int epi = bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    if ((!bias || mm_align(bias) >= 16) && mm_gemm(out_gelu, w, inp, OC, N, C, 1, 0, C, C, OC, 0.0f, 0, epi, bias,
                                                   pre, OC))
        return;
    cuda_matmul_forward(pre, inp, w, bias, N, C, OC);
    cuda_gelu_forward(out_gelu, pre, (size_t)N * OC);
}

void cuda_matmul_backward_dgelu(void *dinp, float *dw, float *dbias, const void *dout, const void *inp,
                                const void *w, const void *pre, int N, int C, int OC, int accumulate) {
    /* dinp, pre, inp (N,C) act; dw (OC,C), dbias (OC) fp32 (dbias may be NULL); dout (N,OC), w (OC,C) act */
    if (N == 0) {
        cuda_matmul_backward(NULL, dw, dbias, dout, inp, w, N, C, OC, accumulate);
        return;
    }
    if (mm_gemm(dinp, w, dout, C, N, OC, 0, 0, C, OC, C, 0.0f, 0, CUBLASLT_EPILOGUE_DGELU, NULL, pre, C)) {
        cuda_matmul_backward(NULL, dw, dbias, dout, inp, w, N, C, OC, accumulate);
        return;
    }
    /* the separate ops, in place: gelu_backward reads each element of its
     * dout before writing the same element of dinp */
    cuda_matmul_backward(dinp, dw, dbias, dout, inp, w, N, C, OC, accumulate);
    cuda_gelu_backward(dinp, pre, dinp, (size_t)N * C);
}

/* ---------------------------------------------------------------------------
 * Newton-Schulz (backend.h newton_schulz): the quintic iteration with its
 * products through cuBLASLt in the activation dtype (bf16 tensor cores with
 * fp32 accumulation, each product stored in bf16, as Keller Jordan's
 * reference runs it; fp32 under precision.compute fp32). X (a, b) row-major
 * is column-major X^T (b, a), ld b, so in cuBLASLt's view:
 *   A = X X^T          (a, a): op(X^T)^T X^T, ta = 1, k = b (A is symmetric, either layout)
 *   B = c A A + b A    (a, a): B holds A first, beta = b, alpha = c
 *   Y = B X + a X      Y^T (b, a) = X^T B (B symmetric), Y holds X first, beta = a
 * work holds X, Y, A, B, each from a 256-byte boundary. */
void cuda_newton_schulz(float *x, int rows, int cols, int steps, float *work) {
    /* x (rows, cols) fp32; work >= 2 rows cols + 2 min(rows, cols)^2 + 256 floats */
    const float ca = 3.4445f, cb = -4.7750f, cc = 2.0315f;
    int a = rows < cols ? rows : cols, b = rows < cols ? cols : rows;
    size_t es = cuda_act_bf16 ? 2 : 4, ab = (size_t)a * b * es, aa = (size_t)a * a * es;
    ab = (ab + 255) / 256 * 256, aa = (aa + 255) / 256 * 256;
    char *w = (char *)work;
    void *X = w, *Y = w + ab, *A = w + 2 * ab, *B = w + 2 * ab + aa;
    cuda_ns_prepare(X, x, rows, cols);
    for (int k = 0; k < steps; k++) {
        mm_gemm(A, X, X, a, a, b, 1, 0, b, b, a, 0.0f, 0, CUBLASLT_EPILOGUE_DEFAULT, NULL, NULL, 0);
        CUDA_CHECK(cudaMemcpyAsync(B, A, (size_t)a * a * es, cudaMemcpyDeviceToDevice, 0));
        mm_gemm_scaled(B, A, A, a, a, a, 0, 0, a, a, a, cc, cb, 0, CUBLASLT_EPILOGUE_DEFAULT, NULL, NULL, 0);
        CUDA_CHECK(cudaMemcpyAsync(Y, X, (size_t)a * b * es, cudaMemcpyDeviceToDevice, 0));
        mm_gemm_scaled(Y, X, B, b, a, a, 0, 0, b, a, b, 1.0f, ca, 0, CUBLASLT_EPILOGUE_DEFAULT, NULL, NULL, 0);
        void *t = X;
        X = Y, Y = t;
    }
    cuda_ns_finish(x, X, rows, cols);
}
