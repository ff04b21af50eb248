/* attention_cudnn: causal attention forward and backward through cuDNN's
 * fused-attention engines, reached by the C backend API (cudnn_graph.h) alone:
 * no cudnn-frontend, no C++ library. libcudnn is never linked: the first use
 * opens libcudnn_graph.so.9 (else libcudnn.so.9) with dlopen, as comm.c does
 * for NCCL, so ./train starts and runs the other attention paths where cuDNN
 * is missing. bf16 activations only; attention.cu decides when this runs.
 *
 * cuDNN 9.19's SDPA operation descriptors have no causal attribute, so the
 * graphs are built from primitive operations in the pattern the runtime-fusion
 * engines recognise (the one cudnn-frontend's SDPA nodes emit for cuDNN < 9.21):
 *
 *  forward                                   (v) virtual, fp32 unless noted
 *    Q (B,NH,T,hs) ─┐
 *    Kt(B,NH,hs,T) ─┴─ matmul ─ S(v) ─ ×scale ─ Ss(v) ─┬─ GEN_INDEX axis 2 ─ row(v,i32) ─┐
 *                                                       ├─ GEN_INDEX axis 3 ─ col(v,i32) ─┴ CMP_GE ─ mask(v,bool)
 *                     BINARY_SELECT(Ss, -FLT_MAX, mask) ─ Sm(v)
 *    Sm ─ max over keys ─ M(v,(B,NH,T,1));  Sm − M ─ Z(v) ─ exp ─ E(v) ─ sum ─ Σ(v)
 *    M + log Σ ─ stats (B,NH,T,1) fp32 = kiln's lse;  E / Σ ─ P(v, bf16) ─ matmul with V ─ O (B,NH,T,hs)
 *
 *  backward
 *    dO ⊙ O ─ sum over hs ─ ×1 ─ Dsum(v,(B,NH,T,1))
 *    Q·Kt ─ ×scale ─ causal select as above ─ − stats ─ exp ─ P(v)
 *    P ─ reshape ─ Pt(v, bf16, keys x queries) ─ matmul with dO ─ dV
 *    dO·Vt ─ dP(v) ─ ×1 ─ − Dsum ─ × P ─ ×scale ─ dS(v)
 *    dS ─ reshape ─ dSt(v, bf16) ─ matmul with Q ─ dK;   Kt ─ reshape ─ K(v) ;  dS·K ─ dQ
 *    non-deterministic (precision.attention_deterministic false):
 *    dS·K ─ dQ_acc (B,NH,T,hs) fp32, zeroed before each execute ─ identity ─ dQ
 *
 * Q, K, V, dQ, dK and dV are strided views of the interleaved qkv / dqkv
 * (B,T,3,NH,hs): dims (B,NH,T,hs), strides (T*3C, hs, 3C, 1), K and V
 * transposed by swapping the last two; O and dO (B,T,NH,hs) likewise with C.
 * No copies. The "×1" multiplies stand where dropout would be: the fusion
 * engines match the graph with them. dQ comes straight from its matmul (no
 * fp32 dQ accumulator tensor), the form cudnn-frontend uses for a
 * deterministic backward (its engine keeps dP in a workspace, B NH T^2
 * bytes x 2, and computes dQ in a pass of its own). With
 * precision.attention_deterministic false the dQ product goes into an fp32
 * accumulator in the workspace, which the engine adds to with atomics in
 * whatever order its blocks run, then an identity rounds it into dQ:
 * cudnn-frontend's default backward for cuDNN 9 (the accumulator zeroed by
 * the caller before 9.6; kiln always zeroes it). cuDNN's stats are max + log(sum exp), natural log,
 * of the scaled, masked scores, (B,NH,T,1) packed: exactly kiln's lse
 * (B,NH,T), so the paths can share it without conversion.
 *
 * Plans are made once per shape (B,T,NH,hs) and kept; the workspace is the
 * SCRATCH_CUDNN slot, grown when a plan is made, never in a step that runs a
 * planned shape. Per call only a variant pack (a small host descriptor, as
 * cudnn-frontend also makes per execute) is created and destroyed. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "attention_cudnn.h"
#include "common.cuh"

#ifdef KILN_CUDNN
#include <cudnn_graph.h>
#include <dlfcn.h>

/* ---------------------------------------------------------------------------
 * The library, opened on first use. Pointer types are cudnn_graph.h's own, so
 * a changed signature fails to compile here rather than misbehave. */
#define CUDNN_FN(name) decltype(&cudnn##name) name
static struct {
    void *lib;
    size_t version; /* cudnnGetVersion: 91900 for 9.19.0 */
    char path[512];
    CUDNN_FN(GetVersion);
    CUDNN_FN(GetErrorString);
    CUDNN_FN(GetLastErrorString);
    CUDNN_FN(Create);
    CUDNN_FN(Destroy);
    CUDNN_FN(SetStream);
    CUDNN_FN(BackendCreateDescriptor);
    CUDNN_FN(BackendDestroyDescriptor);
    CUDNN_FN(BackendSetAttribute);
    CUDNN_FN(BackendGetAttribute);
    CUDNN_FN(BackendFinalize);
    CUDNN_FN(BackendExecute);
} D;
#undef CUDNN_FN
static char cudnn_load_why[600];
static int cudnn_load_tried;

#define CUDNN_SONAME "libcudnn_graph.so.9"
#define CUDNN_SONAME_ALT "libcudnn.so.9"

static int cudnn_load(char *why, size_t n) {
    if (D.lib) return 1;
    if (cudnn_load_tried) { /* a failed dlopen is not retried: the answer would be the same */
        snprintf(why, n, "%s", cudnn_load_why);
        return 0;
    }
    cudnn_load_tried = 1;
    void *lib = dlopen(CUDNN_SONAME, RTLD_NOW | RTLD_LOCAL);
    if (!lib) lib = dlopen(CUDNN_SONAME_ALT, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *e = dlerror();
        snprintf(cudnn_load_why, sizeof cudnn_load_why,
                 "cannot load %s (%s): install cuDNN 9 (the toolkit's, or pip nvidia-cudnn-cu12/cu13) and set "
                 "LD_LIBRARY_PATH to the folder that holds %s",
                 CUDNN_SONAME, e ? e : "not found", CUDNN_SONAME);
        snprintf(why, n, "%s", cudnn_load_why);
        return 0;
    }
    const char *missing = NULL;
#define CUDNN_SYM(name) \
    if (!missing && !(*(void **)(&D.name) = dlsym(lib, "cudnn" #name))) missing = "cudnn" #name
    CUDNN_SYM(GetVersion);
    CUDNN_SYM(GetErrorString);
    CUDNN_SYM(GetLastErrorString);
    CUDNN_SYM(Create);
    CUDNN_SYM(Destroy);
    CUDNN_SYM(SetStream);
    CUDNN_SYM(BackendCreateDescriptor);
    CUDNN_SYM(BackendDestroyDescriptor);
    CUDNN_SYM(BackendSetAttribute);
    CUDNN_SYM(BackendGetAttribute);
    CUDNN_SYM(BackendFinalize);
    CUDNN_SYM(BackendExecute);
#undef CUDNN_SYM
    Dl_info di;
    const char *path =
        D.GetVersion && dladdr(*(void **)&D.GetVersion, &di) && di.dli_fname ? di.dli_fname : CUDNN_SONAME;
    kiln_strlcpy(D.path, path, sizeof D.path);
    size_t v = missing ? 0 : D.GetVersion();
    /* GEN_INDEX, BINARY_SELECT and the fused-attention engines for this
     * pattern are all in every 9.x; 8.x has another library layout. */
    if (missing || v < 90000) {
        if (missing) snprintf(cudnn_load_why, sizeof cudnn_load_why, "%s lacks %s: kiln needs cuDNN 9", D.path, missing);
        else snprintf(cudnn_load_why, sizeof cudnn_load_why, "%s is cuDNN %zu.%zu.%zu: kiln needs 9.0 or later", D.path,
                      v / 10000, v / 100 % 100, v % 100);
        snprintf(why, n, "%s", cudnn_load_why);
        dlclose(lib);
        memset(&D, 0, sizeof D);
        return 0;
    }
    D.version = v;
    D.lib = lib;
    return 1;
}

/* ---------------------------------------------------------------------------
 * Checked calls. CUDNN_CHECK(err, call) runs `call` unless err already holds
 * a failure, and on a failure records the call, file:line, cudnnGetErrorString
 * and cuDNN's own last message: graph building goes on harmlessly and reports
 * the first failure once. CUDNN_MUST(call) is the same for calls whose
 * failure ends the run (exit 1). */
typedef struct {
    int failed;
    char msg[640];
} CudnnErr;

static void cudnn_record(CudnnErr *e, cudnnStatus_t st, const char *call, const char *file, int line) {
    char last[256] = "";
    if (D.GetLastErrorString) D.GetLastErrorString(last, sizeof last);
    e->failed = 1;
    snprintf(e->msg, sizeof e->msg, "cudnn: %s:%d: %s failed: %s%s%s", file, line, call, D.GetErrorString(st),
             last[0] ? ": " : "", last);
}
#define CUDNN_CHECK(err, call)                                                               \
    do {                                                                                     \
        if (!(err)->failed) {                                                                \
            cudnnStatus_t kiln_st_ = (call);                                                 \
            if (kiln_st_ != CUDNN_STATUS_SUCCESS) cudnn_record((err), kiln_st_, #call, __FILE__, __LINE__); \
        }                                                                                    \
    } while (0)
#define CUDNN_MUST(call)                                                 \
    do {                                                                 \
        CudnnErr kiln_e_ = {0, ""};                                      \
        CUDNN_CHECK(&kiln_e_, call);                                     \
        if (kiln_e_.failed) kiln_fail(KILN_EXIT_RUNTIME, "%s", kiln_e_.msg); \
    } while (0)

/* ---------------------------------------------------------------------------
 * Graph building: every tensor and operation descriptor, no handle needed. */

/* Tensor uids of the graphs' inputs and outputs (the variant pack's keys);
 * virtual tensors count up from SDPA_UID_VIRTUAL. */
enum {
    SDPA_Q = 1, SDPA_KT, SDPA_V, SDPA_O, SDPA_STATS, SDPA_DO, SDPA_DQ, SDPA_DK, SDPA_DV,
    SDPA_SCALE, SDPA_NEG, SDPA_ONE, SDPA_DQ_ACC, SDPA_UID_VIRTUAL = 100
};
#define SDPA_MAX_DESC 160 /* every descriptor of one graph: tensors, op descriptors and their settings */

typedef struct {
    CudnnErr err;
    CudnnGraphInfo info;
    cudnnBackendDescriptor_t tdesc[CUDNN_GRAPH_MAX_TENSORS]; /* by info.t index */
    cudnnBackendDescriptor_t ops[CUDNN_GRAPH_MAX_OPS];
    cudnnBackendDescriptor_t all[SDPA_MAX_DESC]; /* destroyed with the graph */
    int n_all;
    int64_t next_uid;
} SdpaGraph;

static cudnnBackendDescriptor_t sg_new(SdpaGraph *g, cudnnBackendDescriptorType_t type) {
    cudnnBackendDescriptor_t d = NULL;
    if (g->n_all >= SDPA_MAX_DESC) {
        if (!g->err.failed) snprintf(g->err.msg, sizeof g->err.msg, "cudnn: more than %d descriptors", SDPA_MAX_DESC);
        g->err.failed = 1;
        return NULL;
    }
    CUDNN_CHECK(&g->err, D.BackendCreateDescriptor(type, &d));
    if (!g->err.failed) g->all[g->n_all++] = d;
    return d;
}

static void sg_destroy(SdpaGraph *g) {
    for (int i = g->n_all - 1; i >= 0; i--) D.BackendDestroyDescriptor(g->all[i]); /* teardown: status ignored */
    g->n_all = 0;
}

static cudnnDataType_t sg_dtype(int t) {
    switch (t) {
    case CUDNN_GT_BF16: return CUDNN_DATA_BFLOAT16;
    case CUDNN_GT_I32: return CUDNN_DATA_INT32;
    case CUDNN_GT_BOOL: return CUDNN_DATA_BOOLEAN;
    default: return CUDNN_DATA_FLOAT;
    }
}

/* A finalized tensor descriptor; uid 0 takes the next virtual uid. Returns the uid. */
static int64_t sg_tensor(SdpaGraph *g, const char *name, int64_t uid, int dtype, const int64_t dims[4],
                         const int64_t strides[4], int is_virtual, int by_value) {
    if (g->err.failed) return 0;
    if (g->info.n_tensors >= CUDNN_GRAPH_MAX_TENSORS) {
        snprintf(g->err.msg, sizeof g->err.msg, "cudnn: more than %d tensors", CUDNN_GRAPH_MAX_TENSORS);
        g->err.failed = 1;
        return 0;
    }
    if (!uid) uid = g->next_uid++;
    CudnnGraphTensor *t = &g->info.t[g->info.n_tensors];
    t->name = name, t->uid = uid, t->is_virtual = is_virtual, t->by_value = by_value, t->dtype = dtype;
    memcpy(t->dims, dims, sizeof t->dims);
    memcpy(t->strides, strides, sizeof t->strides);
    cudnnBackendDescriptor_t d = sg_new(g, CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    cudnnDataType_t dt = sg_dtype(dtype);
    int64_t align = 16; /* every device tensor starts 16-byte aligned (attention.cu checks the pointers) */
    bool virt = is_virtual != 0, byval = by_value != 0;
    CUDNN_CHECK(&g->err, D.BackendSetAttribute(d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt));
    CUDNN_CHECK(&g->err, D.BackendSetAttribute(d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims));
    CUDNN_CHECK(&g->err, D.BackendSetAttribute(d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides));
    CUDNN_CHECK(&g->err, D.BackendSetAttribute(d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid));
    CUDNN_CHECK(&g->err, D.BackendSetAttribute(d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align));
    CUDNN_CHECK(&g->err, D.BackendSetAttribute(d, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &virt));
    if (byval) CUDNN_CHECK(&g->err, D.BackendSetAttribute(d, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &byval));
    CUDNN_CHECK(&g->err, D.BackendFinalize(d));
    if (g->err.failed) {
        char m[sizeof g->err.msg];
        snprintf(m, sizeof m, "tensor %s: %.560s", name, g->err.msg);
        snprintf(g->err.msg, sizeof g->err.msg, "%s", m);
        return 0;
    }
    g->tdesc[g->info.n_tensors++] = d;
    return uid;
}

/* A virtual fp32/bf16/... tensor with these dims and strides. */
static int64_t sg_virt(SdpaGraph *g, const char *name, int dtype, const int64_t dims[4], const int64_t strides[4]) {
    return sg_tensor(g, name, 0, dtype, dims, strides, 1, 0);
}

static cudnnBackendDescriptor_t sg_t(SdpaGraph *g, int64_t uid) {
    for (int i = 0; i < g->info.n_tensors; i++)
        if (g->info.t[i].uid == uid) return g->tdesc[i];
    return NULL;
}

/* Records the finalized operation `op` with its tensors. */
static void sg_op(SdpaGraph *g, const char *name, cudnnBackendDescriptor_t op, int n_in, int64_t a, int64_t b,
                  int64_t c, int64_t out) {
    CUDNN_CHECK(&g->err, D.BackendFinalize(op));
    if (g->err.failed) {
        char m[sizeof g->err.msg];
        snprintf(m, sizeof m, "operation %s: %.560s", name, g->err.msg);
        snprintf(g->err.msg, sizeof g->err.msg, "%s", m);
        return;
    }
    if (g->info.n_ops >= CUDNN_GRAPH_MAX_OPS) {
        snprintf(g->err.msg, sizeof g->err.msg, "cudnn: more than %d operations", CUDNN_GRAPH_MAX_OPS);
        g->err.failed = 1;
        return;
    }
    CudnnGraphOp *o = &g->info.op[g->info.n_ops];
    o->name = name, o->n_in = n_in, o->in[0] = a, o->in[1] = b, o->in[2] = c, o->out = out;
    g->ops[g->info.n_ops++] = op;
}

#define SG_SET(d, attr, type, n, ptr) CUDNN_CHECK(&g->err, D.BackendSetAttribute((d), (attr), (type), (n), (ptr)))

/* out = mode(x [, b [, t]]): y = x op b, or BINARY_SELECT's y = t ? x : b.
 * Compute type: int32 for index generation, boolean for comparisons, else fp32. */
static void sg_pw(SdpaGraph *g, const char *name, cudnnPointwiseMode_t mode, int64_t x, int64_t b, int64_t t,
                  int64_t out, int64_t axis) {
    if (g->err.failed) return;
    cudnnDataType_t prec = mode == CUDNN_POINTWISE_GEN_INDEX ? CUDNN_DATA_INT32
                           : mode == CUDNN_POINTWISE_CMP_GE  ? CUDNN_DATA_BOOLEAN
                                                             : CUDNN_DATA_FLOAT;
    cudnnBackendDescriptor_t pw = sg_new(g, CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    SG_SET(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    SG_SET(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec);
    if (mode == CUDNN_POINTWISE_GEN_INDEX) SG_SET(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    CUDNN_CHECK(&g->err, D.BackendFinalize(pw));
    cudnnBackendDescriptor_t op = sg_new(g, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    cudnnBackendDescriptor_t dx = sg_t(g, x), db = b ? sg_t(g, b) : NULL, dt = t ? sg_t(g, t) : NULL, dy = sg_t(g, out);
    SG_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw);
    SG_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &dx);
    if (db) SG_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &db);
    if (dt) SG_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &dt);
    SG_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &dy);
    sg_op(g, name, op, t ? 3 : b ? 2 : 1, x, b, t, out);
}

/* c = a · b, batched over (B, NH), fp32 accumulation. */
static void sg_matmul(SdpaGraph *g, const char *name, int64_t a, int64_t b, int64_t c) {
    if (g->err.failed) return;
    cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    cudnnBackendDescriptor_t mm = sg_new(g, CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    SG_SET(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    CUDNN_CHECK(&g->err, D.BackendFinalize(mm));
    cudnnBackendDescriptor_t op = sg_new(g, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    cudnnBackendDescriptor_t da = sg_t(g, a), dbb = sg_t(g, b), dc = sg_t(g, c);
    SG_SET(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &da);
    SG_SET(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &dbb);
    SG_SET(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &dc);
    SG_SET(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm);
    sg_op(g, name, op, 2, a, b, 0, c);
}

/* y = reduce(x) over the dimensions where y has extent 1, in fp32. */
static void sg_reduce(SdpaGraph *g, const char *name, cudnnReduceTensorOp_t how, int64_t x, int64_t y) {
    if (g->err.failed) return;
    cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    cudnnBackendDescriptor_t r = sg_new(g, CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    SG_SET(r, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &how);
    SG_SET(r, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    CUDNN_CHECK(&g->err, D.BackendFinalize(r));
    cudnnBackendDescriptor_t op = sg_new(g, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    cudnnBackendDescriptor_t dx = sg_t(g, x), dy = sg_t(g, y);
    SG_SET(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &dx);
    SG_SET(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &dy);
    SG_SET(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &r);
    sg_op(g, name, op, 1, x, 0, 0, y);
}

/* y = x seen with y's dims and strides (a transposed view). */
static void sg_reshape(SdpaGraph *g, const char *name, int64_t x, int64_t y) {
    if (g->err.failed) return;
    cudnnBackendDescriptor_t op = sg_new(g, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    cudnnBackendDescriptor_t dx = sg_t(g, x), dy = sg_t(g, y);
    SG_SET(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &dx);
    SG_SET(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &dy);
    sg_op(g, name, op, 1, x, 0, 0, y);
}

/* The scores, their causal mask and the scaled, masked scores Sm, shared by
 * both graphs; returns Sm's uid. */
static int64_t sg_masked_scores(SdpaGraph *g, const int64_t *dS, const int64_t *sS) {
    int64_t s = sg_virt(g, "S", CUDNN_GT_F32, dS, sS);
    sg_matmul(g, "matmul Q.Kt", SDPA_Q, SDPA_KT, s);
    int64_t ss = sg_virt(g, "S*scale", CUDNN_GT_F32, dS, sS);
    sg_pw(g, "mul scale", CUDNN_POINTWISE_MUL, s, SDPA_SCALE, 0, ss, 0);
    int64_t row = sg_virt(g, "row", CUDNN_GT_I32, dS, sS), col = sg_virt(g, "col", CUDNN_GT_I32, dS, sS);
    sg_pw(g, "gen_index row", CUDNN_POINTWISE_GEN_INDEX, ss, 0, 0, row, 2);
    sg_pw(g, "gen_index col", CUDNN_POINTWISE_GEN_INDEX, ss, 0, 0, col, 3);
    int64_t mask = sg_virt(g, "row>=col", CUDNN_GT_BOOL, dS, sS);
    sg_pw(g, "cmp_ge row col", CUDNN_POINTWISE_CMP_GE, row, col, 0, mask, 0);
    int64_t sm = sg_virt(g, "S masked", CUDNN_GT_F32, dS, sS);
    sg_pw(g, "binary_select causal", CUDNN_POINTWISE_BINARY_SELECT, ss, SDPA_NEG, mask, sm, 0);
    return sm;
}

/* Every tensor and operation of a graph (attention_cudnn.h's CUDNN_GRAPH_*:
 * forward, backward, or the backward with dQ through an fp32 accumulator).
 * Returns 0, or -1 with g->err set. */
static int sdpa_build(SdpaGraph *g, int graph, int B, int T, int NH, int hs) {
    int backward = graph != CUDNN_GRAPH_FORWARD;
    memset(g, 0, sizeof *g);
    g->next_uid = SDPA_UID_VIRTUAL;
    int64_t b = B, t = T, h = NH, d = hs, C = (int64_t)NH * hs;
    const int64_t dQ[4] = {b, h, t, d}, sQ[4] = {t * 3 * C, d, 3 * C, 1};  /* Q, V, dQ, dK, dV in (d)qkv */
    const int64_t dKt[4] = {b, h, d, t}, sKt[4] = {t * 3 * C, d, 1, 3 * C}; /* Kt, Vt */
    const int64_t sO[4] = {t * C, d, C, 1};                                 /* O, dO in (B,T,C) */
    const int64_t dS[4] = {b, h, t, t}, sS[4] = {h * t * t, t * t, t, 1};   /* scores, queries x keys */
    const int64_t sSt[4] = {h * t * t, t * t, 1, t};                         /* their transpose */
    const int64_t dR[4] = {b, h, t, 1}, sR[4] = {h * t, t, 1, 1};          /* per query row: stats */
    const int64_t one4[4] = {1, 1, 1, 1};                                   /* by-value scalars */
    sg_tensor(g, "Q", SDPA_Q, CUDNN_GT_BF16, dQ, sQ, 0, 0);
    sg_tensor(g, "Kt", SDPA_KT, CUDNN_GT_BF16, dKt, sKt, 0, 0);
    sg_tensor(g, "scale", SDPA_SCALE, CUDNN_GT_F32, one4, one4, 0, 1);
    sg_tensor(g, "-FLT_MAX", SDPA_NEG, CUDNN_GT_F32, one4, one4, 0, 1);
    sg_tensor(g, "O", SDPA_O, CUDNN_GT_BF16, dQ, sO, 0, 0);
    sg_tensor(g, "stats", SDPA_STATS, CUDNN_GT_F32, dR, sR, 0, 0);
    if (!backward) {
        sg_tensor(g, "V", SDPA_V, CUDNN_GT_BF16, dQ, sQ, 0, 0);
        int64_t sm = sg_masked_scores(g, dS, sS);
        int64_t mx = sg_virt(g, "max", CUDNN_GT_F32, dR, sR);
        sg_reduce(g, "reduce max", CUDNN_REDUCE_TENSOR_MAX, sm, mx);
        int64_t z = sg_virt(g, "S-max", CUDNN_GT_F32, dS, sS);
        sg_pw(g, "sub max", CUDNN_POINTWISE_SUB, sm, mx, 0, z, 0);
        int64_t e = sg_virt(g, "exp", CUDNN_GT_F32, dS, sS);
        sg_pw(g, "exp", CUDNN_POINTWISE_EXP, z, 0, 0, e, 0);
        int64_t sum = sg_virt(g, "sum", CUDNN_GT_F32, dR, sR);
        sg_reduce(g, "reduce sum", CUDNN_REDUCE_TENSOR_ADD, e, sum);
        int64_t lg = sg_virt(g, "log sum", CUDNN_GT_F32, dR, sR);
        sg_pw(g, "log", CUDNN_POINTWISE_LOG, sum, 0, 0, lg, 0);
        sg_pw(g, "add max log", CUDNN_POINTWISE_ADD, mx, lg, 0, SDPA_STATS, 0);
        int64_t p = sg_virt(g, "P", CUDNN_GT_BF16, dS, sS); /* bf16: the P.V matmul takes its A in the I/O type */
        sg_pw(g, "div sum", CUDNN_POINTWISE_DIV, e, sum, 0, p, 0);
        sg_matmul(g, "matmul P.V", p, SDPA_V, SDPA_O);
    } else {
        sg_tensor(g, "Vt", SDPA_V, CUDNN_GT_BF16, dKt, sKt, 0, 0);
        sg_tensor(g, "dO", SDPA_DO, CUDNN_GT_BF16, dQ, sO, 0, 0);
        sg_tensor(g, "dQ", SDPA_DQ, CUDNN_GT_BF16, dQ, sQ, 0, 0);
        sg_tensor(g, "dK", SDPA_DK, CUDNN_GT_BF16, dQ, sQ, 0, 0);
        sg_tensor(g, "dV", SDPA_DV, CUDNN_GT_BF16, dQ, sQ, 0, 0);
        sg_tensor(g, "1", SDPA_ONE, CUDNN_GT_F32, one4, one4, 0, 1);
        /* D = rowsum(dO ⊙ O); the product laid out as O and dO are, (B,T,NH,hs)
         * in memory (a virtual tensor's strides must still be a layout) */
        const int64_t sDO[4] = {h * t * d, d, h * d, 1};
        int64_t doo = sg_virt(g, "dO*O", CUDNN_GT_F32, dQ, sDO);
        sg_pw(g, "mul dO O", CUDNN_POINTWISE_MUL, SDPA_DO, SDPA_O, 0, doo, 0);
        int64_t dsum0 = sg_virt(g, "rowsum dO*O", CUDNN_GT_F32, dR, sR);
        sg_reduce(g, "reduce dO*O", CUDNN_REDUCE_TENSOR_ADD, doo, dsum0);
        int64_t dsum = sg_virt(g, "D", CUDNN_GT_F32, dR, sR);
        sg_pw(g, "mul D 1", CUDNN_POINTWISE_MUL, dsum0, SDPA_ONE, 0, dsum, 0);
        /* P = exp(masked scaled scores - lse) */
        int64_t sm = sg_masked_scores(g, dS, sS);
        int64_t z = sg_virt(g, "S-stats", CUDNN_GT_F32, dS, sS);
        sg_pw(g, "sub stats", CUDNN_POINTWISE_SUB, sm, SDPA_STATS, 0, z, 0);
        int64_t p = sg_virt(g, "P", CUDNN_GT_F32, dS, sS);
        sg_pw(g, "exp", CUDNN_POINTWISE_EXP, z, 0, 0, p, 0);
        /* dV = Pt . dO */
        int64_t pt = sg_virt(g, "Pt", CUDNN_GT_BF16, dS, sSt);
        sg_reshape(g, "reshape P", p, pt);
        sg_matmul(g, "matmul Pt.dO", pt, SDPA_DO, SDPA_DV);
        /* dS = P * (dO.Vt - D) * scale */
        int64_t dp = sg_virt(g, "dP", CUDNN_GT_F32, dS, sS);
        sg_matmul(g, "matmul dO.Vt", SDPA_DO, SDPA_V, dp);
        int64_t dp1 = sg_virt(g, "dP*1", CUDNN_GT_F32, dS, sS);
        sg_pw(g, "mul dP 1", CUDNN_POINTWISE_MUL, dp, SDPA_ONE, 0, dp1, 0);
        int64_t dp2 = sg_virt(g, "dP-D", CUDNN_GT_F32, dS, sS);
        sg_pw(g, "sub D", CUDNN_POINTWISE_SUB, dp1, dsum, 0, dp2, 0);
        int64_t ds0 = sg_virt(g, "(dP-D)*P", CUDNN_GT_F32, dS, sS);
        sg_pw(g, "mul P", CUDNN_POINTWISE_MUL, dp2, p, 0, ds0, 0);
        int64_t ds = sg_virt(g, "dS", CUDNN_GT_F32, dS, sS);
        sg_pw(g, "mul scale dS", CUDNN_POINTWISE_MUL, ds0, SDPA_SCALE, 0, ds, 0);
        /* dK = dSt . Q */
        int64_t dst = sg_virt(g, "dSt", CUDNN_GT_BF16, dS, sSt);
        sg_reshape(g, "reshape dS", ds, dst);
        sg_matmul(g, "matmul dSt.Q", dst, SDPA_Q, SDPA_DK);
        /* dQ = dS . K, K the untransposed view of Kt */
        int64_t k = sg_virt(g, "K", CUDNN_GT_BF16, dQ, sQ);
        sg_reshape(g, "reshape Kt", SDPA_KT, k);
        if (graph == CUDNN_GRAPH_BACKWARD) {
            sg_matmul(g, "matmul dS.K", ds, k, SDPA_DQ);
        } else { /* the accumulator (B,NH,T,hs), contiguous in the workspace */
            const int64_t sA[4] = {h * t * d, t * d, d, 1};
            sg_tensor(g, "dQ_acc", SDPA_DQ_ACC, CUDNN_GT_F32, dQ, sA, 0, 0);
            sg_matmul(g, "matmul dS.K", ds, k, SDPA_DQ_ACC);
            sg_pw(g, "identity dQ", CUDNN_POINTWISE_IDENTITY, SDPA_DQ_ACC, 0, 0, SDPA_DQ, 0);
        }
    }
    return g->err.failed ? -1 : 0;
}

/* ---------------------------------------------------------------------------
 * Plans, per shape, made on first use and kept until shutdown. */
typedef struct {
    SdpaGraph g;
    cudnnBackendDescriptor_t opgraph, plan;
    cudnnBackendDescriptor_t cfg; /* the plan's engine config, kept as long as the plan (as cudnn-frontend does) */
    int64_t workspace;            /* bytes: the engine's, then dQ_acc's if any */
    int64_t acc_offset, acc_bytes; /* dQ_acc in the workspace (non-deterministic backward), else 0, 0 */
} SdpaPlan;

#define CUDNN_SHAPES 8 /* the training shape, eval's, the self-check's, ... (attention.cu keeps fewer), per backward form */
static struct {
    int B, T, NH, hs;
    int det;         /* the backward form (cudnn_deterministic when planned) */
    int ok;          /* 1: both plans made; 0: why holds the reason */
    char why[640];
    SdpaPlan fwd, bwd;
} cudnn_shapes[CUDNN_SHAPES];
static int cudnn_n_shapes;
static cudnnHandle_t cudnn_handle;
static int cudnn_deterministic = 1; /* precision.attention_deterministic: which backward graph the plans have */

static void plan_free(SdpaPlan *p) {
    if (p->plan) D.BackendDestroyDescriptor(p->plan);
    if (p->cfg) D.BackendDestroyDescriptor(p->cfg);
    if (p->opgraph) D.BackendDestroyDescriptor(p->opgraph);
    p->plan = p->cfg = p->opgraph = NULL;
    sg_destroy(&p->g);
}

/* The operation graph, then the engine configs of heuristics mode A and then
 * FALLBACK, tried in order until one finalizes as an execution plan. */
static int plan_make(SdpaPlan *p, int graph, int B, int T, int NH, int hs, char *why, size_t n) {
    int backward = graph != CUDNN_GRAPH_FORWARD;
    memset(p, 0, sizeof *p);
    if (sdpa_build(&p->g, graph, B, T, NH, hs) != 0) {
        snprintf(why, n, "%s graph: %.560s", backward ? "backward" : "forward", p->g.err.msg);
        sg_destroy(&p->g);
        return 0;
    }
    CudnnErr e = {0, ""};
    CUDNN_CHECK(&e, D.BackendCreateDescriptor(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, &p->opgraph));
    CUDNN_CHECK(&e, D.BackendSetAttribute(p->opgraph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                          p->g.info.n_ops, p->g.ops));
    CUDNN_CHECK(&e, D.BackendSetAttribute(p->opgraph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1,
                                          &cudnn_handle));
    CUDNN_CHECK(&e, D.BackendFinalize(p->opgraph));
    const cudnnBackendHeurMode_t modes[2] = {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK};
    int tried = 0;
    CudnnErr last = {0, ""}; /* the last refusal (heuristics or plan), if no mode yields a plan */
    for (int m = 0; m < 2 && !e.failed && !p->plan; m++) { /* e: the operation graph itself failed */
        cudnnBackendDescriptor_t heur = NULL;
        CudnnErr he = {0, ""};
        CUDNN_CHECK(&he, D.BackendCreateDescriptor(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, &heur));
        CUDNN_CHECK(&he, D.BackendSetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH,
                                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &p->opgraph));
        CUDNN_CHECK(&he, D.BackendSetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &modes[m]));
        CUDNN_CHECK(&he, D.BackendFinalize(heur));
        int64_t count = 0;
        CUDNN_CHECK(&he, D.BackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0,
                                               &count, NULL));
        if (count > 32) count = 32;
        cudnnBackendDescriptor_t cfgs[32];
        int64_t made = 0, got = 0;
        while (made < count && !he.failed) { /* made counts only descriptors that exist */
            CUDNN_CHECK(&he, D.BackendCreateDescriptor(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, &cfgs[made]));
            if (!he.failed) made++;
        }
        if (made > 0)
            CUDNN_CHECK(&he, D.BackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                                   made, &got, cfgs));
        for (int64_t i = 0; i < got && !he.failed && !p->plan; i++) {
            cudnnBackendDescriptor_t plan = NULL;
            CudnnErr pe = {0, ""};
            tried++;
            CUDNN_CHECK(&pe, D.BackendCreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &plan));
            CUDNN_CHECK(&pe, D.BackendSetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1,
                                                   &cudnn_handle));
            CUDNN_CHECK(&pe, D.BackendSetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfgs[i]));
            CUDNN_CHECK(&pe, D.BackendFinalize(plan)); /* an engine that cannot run this graph fails here */
            if (!pe.failed) {
                int64_t nws = 0;
                CUDNN_CHECK(&pe, D.BackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                                       CUDNN_TYPE_INT64, 1, &nws, &p->workspace));
            }
            if (pe.failed) {
                if (plan) D.BackendDestroyDescriptor(plan);
                last = pe;
            } else {
                p->plan = plan;
                p->cfg = cfgs[i];
                cfgs[i] = NULL;
            }
        }
        for (int64_t i = 0; i < made; i++)
            if (cfgs[i]) D.BackendDestroyDescriptor(cfgs[i]);
        if (heur) D.BackendDestroyDescriptor(heur);
        if (he.failed) last = he; /* and go on to the next mode */
    }
    if (e.failed || !p->plan) {
        snprintf(why, n, "%s graph: %.560s", backward ? "backward" : "forward",
                 e.failed ? e.msg : last.failed || tried ? last.msg : "cuDNN's heuristics offer no engine for it");
        plan_free(p);
        return 0;
    }
    if (graph == CUDNN_GRAPH_BACKWARD_ATOMIC) { /* dQ_acc behind the engine's workspace, 256-byte aligned */
        p->acc_offset = (p->workspace + 255) / 256 * 256;
        p->acc_bytes = (int64_t)B * NH * T * hs * (int64_t)sizeof(float);
        p->workspace = p->acc_offset + p->acc_bytes;
    }
    return 1;
}

/* The shape's plans for the current backward form (cudnn_deterministic). */
static int cudnn_find(int B, int T, int NH, int hs) {
    for (int i = 0; i < cudnn_n_shapes; i++)
        if (cudnn_shapes[i].B == B && cudnn_shapes[i].T == T && cudnn_shapes[i].NH == NH && cudnn_shapes[i].hs == hs &&
            cudnn_shapes[i].det == cudnn_deterministic)
            return i;
    return -1;
}

/* ---------------------------------------------------------------------------
 * Entry points (common.cuh). */

int cuda_attention_cudnn_load(char *why, size_t n) { return cudnn_load(why, n); }

const char *cuda_attention_cudnn_library(void) {
    static char s[600];
    if (!D.lib) return "cuDNN not loaded";
    snprintf(s, sizeof s, "cuDNN %zu.%zu.%zu from %s", D.version / 10000, D.version / 100 % 100, D.version % 100,
             D.path);
    return s;
}

int cuda_attention_cudnn_plan(int B, int T, int C, int NH, char *why, size_t n) {
    int hs = C / NH;
    if (!cuda_attention_cudnn_fits(C, NH)) {
        snprintf(why, n, "head size %d is not a multiple of 8 up to 128", hs);
        return 0;
    }
    if (!cudnn_load(why, n)) return 0;
    int i = cudnn_find(B, T, NH, hs);
    if (i >= 0) {
        if (!cudnn_shapes[i].ok) snprintf(why, n, "%s", cudnn_shapes[i].why);
        return cudnn_shapes[i].ok;
    }
    if (cudnn_n_shapes == CUDNN_SHAPES) {
        snprintf(why, n, "already %d attention shapes planned", CUDNN_SHAPES);
        return 0;
    }
    if (!cudnn_handle) {
        CUDNN_MUST(D.Create(&cudnn_handle));
        CUDNN_MUST(D.SetStream(cudnn_handle, cudaStreamLegacy)); /* the backend's one stream (backend_cuda.cu) */
    }
    i = cudnn_n_shapes++;
    cudnn_shapes[i].B = B, cudnn_shapes[i].T = T, cudnn_shapes[i].NH = NH, cudnn_shapes[i].hs = hs;
    cudnn_shapes[i].det = cudnn_deterministic;
    char w[640];
    int ok = plan_make(&cudnn_shapes[i].fwd, CUDNN_GRAPH_FORWARD, B, T, NH, hs, w, sizeof w);
    int bwd = cudnn_deterministic ? CUDNN_GRAPH_BACKWARD : CUDNN_GRAPH_BACKWARD_ATOMIC;
    if (ok && !plan_make(&cudnn_shapes[i].bwd, bwd, B, T, NH, hs, w, sizeof w)) {
        plan_free(&cudnn_shapes[i].fwd);
        ok = 0;
    }
    cudnn_shapes[i].ok = ok;
    if (!ok) {
        snprintf(cudnn_shapes[i].why, sizeof cudnn_shapes[i].why, "%s", w);
        snprintf(why, n, "%s", w);
        return 0;
    }
    /* the workspace grows here, at plan time, never in a step of a planned shape */
    int64_t ws = cudnn_shapes[i].fwd.workspace > cudnn_shapes[i].bwd.workspace ? cudnn_shapes[i].fwd.workspace
                                                                                : cudnn_shapes[i].bwd.workspace;
    cuda_scratch(SCRATCH_CUDNN, (size_t)(ws > 0 ? ws : 1));
    return 1;
}

/* 1, or 0 with why: a variant pack or an execute that fails at run time is
 * the caller's to fall back from (an engine can accept a plan it then cannot
 * run, e.g. out of its workspace or resources at this shape). */
static int cudnn_execute(SdpaPlan *p, int B, int n, const int64_t *uids, void **ptrs, char *why, size_t wn) {
    const char *hook = getenv("KILN_TEST_CUDNN_FAIL_B"); /* test hook: every execute at this batch size fails */
    if (hook && atoi(hook) == B) {
        snprintf(why, wn, "execute failed (test hook KILN_TEST_CUDNN_FAIL_B=%d)", B);
        return 0;
    }
    void *ws = cuda_scratch(SCRATCH_CUDNN, (size_t)(p->workspace > 0 ? p->workspace : 1));
    if (p->acc_bytes) /* the engine adds into dQ_acc: zero it (cuDNN before 9.6 needs it; it is cheap after) */
        CUDA_CHECK(cudaMemsetAsync((char *)ws + p->acc_offset, 0, (size_t)p->acc_bytes, cudaStreamLegacy));
    cudnnBackendDescriptor_t vp = NULL;
    CudnnErr e = {0, ""};
    CUDNN_CHECK(&e, D.BackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &vp));
    CUDNN_CHECK(&e, D.BackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids));
    CUDNN_CHECK(&e, D.BackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, ptrs));
    CUDNN_CHECK(&e, D.BackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws));
    CUDNN_CHECK(&e, D.BackendFinalize(vp));
    CUDNN_CHECK(&e, D.BackendExecute(cudnn_handle, p->plan, vp));
    if (vp) D.BackendDestroyDescriptor(vp); /* status ignored: the pack is ours alone */
    if (e.failed) snprintf(why, wn, "%s", e.msg);
    return !e.failed;
}

static int cudnn_planned(int B, int T, int C, int NH) {
    char why[640];
    if (!cuda_attention_cudnn_plan(B, T, C, NH, why, sizeof why))
        kiln_fail(KILN_EXIT_RUNTIME, "cuDNN attention at B=%d T=%d NH=%d hs=%d: %s", B, T, NH, C / NH, why);
    return cudnn_find(B, T, NH, C / NH);
}

int cuda_attention_cudnn_forward(void *out, float *lse, const void *qkv, int B, int T, int C, int NH, char *why,
                                 size_t n) {
    int i = cudnn_planned(B, T, C, NH);
    float scale = 1.0f / sqrtf((float)(C / NH)), neg = -FLT_MAX; /* by value: read during Execute */
    bf16 *x = (bf16 *)qkv;
    const int64_t uids[] = {SDPA_Q, SDPA_KT, SDPA_V, SDPA_O, SDPA_STATS, SDPA_SCALE, SDPA_NEG};
    void *ptrs[] = {x, x + C, x + 2 * C, out, lse, &scale, &neg};
    return cudnn_execute(&cudnn_shapes[i].fwd, B, 7, uids, ptrs, why, n);
}

int cuda_attention_cudnn_backward(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                                  int B, int T, int C, int NH, char *why, size_t n) {
    int i = cudnn_planned(B, T, C, NH);
    float scale = 1.0f / sqrtf((float)(C / NH)), neg = -FLT_MAX, one = 1.0f;
    bf16 *x = (bf16 *)qkv, *dx = (bf16 *)dqkv;
    SdpaPlan *p = &cudnn_shapes[i].bwd;
    char *ws = (char *)cuda_scratch(SCRATCH_CUDNN, (size_t)(p->workspace > 0 ? p->workspace : 1)); /* as cudnn_execute's */
    const int64_t uids[] = {SDPA_Q, SDPA_KT, SDPA_V, SDPA_O, SDPA_DO, SDPA_STATS, SDPA_DQ,
                            SDPA_DK, SDPA_DV, SDPA_SCALE, SDPA_NEG, SDPA_ONE, SDPA_DQ_ACC};
    void *ptrs[] = {x, x + C, x + 2 * C, (void *)out, (void *)dout, (void *)lse, dx,
                    dx + C, dx + 2 * C, &scale, &neg, &one, ws + p->acc_offset};
    return cudnn_execute(p, B, p->acc_bytes ? 13 : 12, uids, ptrs, why, n);
}

/* Which backward form the next plans and executes use: plans are kept per
 * form, so switching back (bench_attention times both) plans nothing again. */
void cuda_attention_cudnn_set_deterministic(int deterministic) { cudnn_deterministic = deterministic != 0; }

void cuda_attention_cudnn_reset(void) {
    for (int i = 0; i < cudnn_n_shapes; i++) {
        plan_free(&cudnn_shapes[i].fwd);
        plan_free(&cudnn_shapes[i].bwd);
    }
    cudnn_n_shapes = 0;
    cudnn_deterministic = 1;
    if (cudnn_handle) D.Destroy(cudnn_handle); /* shutdown: status ignored */
    cudnn_handle = NULL;
}

extern "C" int cuda_cudnn_graph_probe(int graph, int B, int T, int NH, int hs, CudnnGraphInfo *info, char *why,
                                      size_t n) {
    if (!cudnn_load(why, n)) return 0;
    SdpaGraph *g = (SdpaGraph *)xcalloc(1, sizeof *g);
    int rc = sdpa_build(g, graph, B, T, NH, hs);
    *info = g->info;
    if (rc != 0) snprintf(why, n, "%s", g->err.msg);
    sg_destroy(g);
    free(g);
    return rc == 0 ? 1 : -1;
}

extern "C" const char *cuda_cudnn_build_info(void) {
    static char s[200];
    snprintf(s, sizeof s, "cuDNN attention: built against cuDNN %d.%d.%d headers (%s is opened at run time)",
             CUDNN_MAJOR, CUDNN_MINOR, CUDNN_PATCHLEVEL, CUDNN_SONAME);
    return s;
}

#else /* built without cudnn_graph.h (make CUDNN=0, or the header was not found) */

#define CUDNN_NOT_BUILT "this ./train was built without cuDNN (no cudnn_graph.h at build time, or make CUDNN=0)"

int cuda_attention_cudnn_load(char *why, size_t n) {
    snprintf(why, n, "%s", CUDNN_NOT_BUILT);
    return 0;
}
const char *cuda_attention_cudnn_library(void) { return "cuDNN not built in"; }
int cuda_attention_cudnn_plan(int B, int T, int C, int NH, char *why, size_t n) { return cuda_attention_cudnn_load(why, n); }
int cuda_attention_cudnn_forward(void *out, float *lse, const void *qkv, int B, int T, int C, int NH, char *why,
                                 size_t n) {
    kiln_fail(KILN_EXIT_RUNTIME, "cuDNN attention: %s", CUDNN_NOT_BUILT);
}
int cuda_attention_cudnn_backward(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                                  int B, int T, int C, int NH, char *why, size_t n) {
    kiln_fail(KILN_EXIT_RUNTIME, "cuDNN attention: %s", CUDNN_NOT_BUILT);
}
void cuda_attention_cudnn_reset(void) {}
void cuda_attention_cudnn_set_deterministic(int deterministic) {}
extern "C" int cuda_cudnn_graph_probe(int graph, int B, int T, int NH, int hs, CudnnGraphInfo *info, char *why,
                                      size_t n) {
    memset(info, 0, sizeof *info);
    return cuda_attention_cudnn_load(why, n);
}
extern "C" const char *cuda_cudnn_build_info(void) { return "cuDNN attention: not built in (" CUDNN_NOT_BUILT ")"; }

#endif

/* Head sizes the graphs support: cuDNN's fused attention needs hs a multiple
 * of 8 (16-byte rows of bf16) and, for the backward, at most 128. */
int cuda_attention_cudnn_fits(int C, int NH) {
    int hs = C / NH;
    return hs % 8 == 0 && hs >= 8 && hs <= 128;
}
