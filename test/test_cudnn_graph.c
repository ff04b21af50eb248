/* test_cudnn_graph: cuDNN's fused-attention graphs as cuda/attention_cudnn.cu
 * builds them, checked without a GPU. Tensor and operation descriptors
 * finalize on the CPU (cuDNN validates dims, strides, types and wiring
 * there); the operation graph, the engines and execution need a handle, so
 * a GPU, and are left to scripts/cuda_check.sh. For the forward and backward
 * graphs at several shapes: every descriptor finalizes; uids are unique; the
 * non-virtual tensors are exactly the variant pack's (the I/O of the op);
 * every virtual tensor is written by exactly one operation and read by at
 * least one; every operand exists; the I/O have the qkv-view dims and
 * strides. Prints skip lines where the build has no cuDNN or libcudnn_graph.so.9
 * cannot be opened. */
#include "test.h"
#include "../cuda/attention_cudnn.h"

#include <stdint.h>
#include <string.h>

#ifdef KILN_CUDNN

static const CudnnGraphTensor *find(const CudnnGraphInfo *g, int64_t uid) {
    for (int i = 0; i < g->n_tensors; i++)
        if (g->t[i].uid == uid) return &g->t[i];
    return NULL;
}

/* The I/O names each graph (CUDNN_GRAPH_*) must have as non-virtual
 * tensors, in no order; the atomic backward's dQ_acc lives in the workspace. */
static const char *const fwd_io[] = {"Q", "Kt", "V", "O", "stats", "scale", "-FLT_MAX"};
static const char *const bwd_io[] = {"Q", "Kt", "Vt", "O", "dO", "stats", "dQ", "dK", "dV", "scale", "-FLT_MAX", "1",
                                     "dQ_acc"};

static int wiring(const CudnnGraphInfo *g, int graph, char *why, size_t n) {
    const char *const *io = graph != CUDNN_GRAPH_FORWARD ? bwd_io : fwd_io;
    int nio = graph == CUDNN_GRAPH_FORWARD ? (int)(sizeof fwd_io / sizeof *fwd_io)
                                           : (int)(sizeof bwd_io / sizeof *bwd_io) - (graph == CUDNN_GRAPH_BACKWARD);
    int n_nonvirtual = 0;
    for (int i = 0; i < g->n_tensors; i++) {
        const CudnnGraphTensor *t = &g->t[i];
        for (int j = i + 1; j < g->n_tensors; j++)
            if (g->t[j].uid == t->uid) return snprintf(why, n, "uid %lld used twice (%s, %s)", (long long)t->uid, t->name, g->t[j].name), 0;
        if (t->by_value && t->is_virtual) return snprintf(why, n, "%s is virtual and by value", t->name), 0;
        int writers = 0, readers = 0;
        for (int k = 0; k < g->n_ops; k++) {
            writers += g->op[k].out == t->uid;
            for (int a = 0; a < g->op[k].n_in; a++) readers += g->op[k].in[a] == t->uid;
        }
        if (t->is_virtual) {
            if (writers != 1 || readers < 1)
                return snprintf(why, n, "virtual %s: %d writers, %d readers (want 1, >= 1)", t->name, writers, readers), 0;
            continue;
        }
        n_nonvirtual++;
        int is_io = 0;
        for (int j = 0; j < nio; j++) is_io |= strcmp(io[j], t->name) == 0;
        if (!is_io) return snprintf(why, n, "%s is not virtual but is no input or output of the op", t->name), 0;
        if (writers > 1) return snprintf(why, n, "output %s written by %d operations", t->name, writers), 0;
        if (writers + readers == 0) return snprintf(why, n, "%s is in no operation", t->name), 0;
    }
    if (n_nonvirtual != nio) return snprintf(why, n, "%d non-virtual tensors, want %d", n_nonvirtual, nio), 0;
    for (int k = 0; k < g->n_ops; k++) {
        for (int a = 0; a < g->op[k].n_in; a++)
            if (!find(g, g->op[k].in[a])) return snprintf(why, n, "%s reads unknown uid %lld", g->op[k].name, (long long)g->op[k].in[a]), 0;
        const CudnnGraphTensor *o = find(g, g->op[k].out);
        if (!o) return snprintf(why, n, "%s writes unknown uid", g->op[k].name), 0;
        if (o->by_value) return snprintf(why, n, "%s writes by-value %s", g->op[k].name, o->name), 0;
    }
    return 1;
}

/* The I/O views of the interleaved qkv (B,T,3,NH,hs) and out (B,T,NH,hs);
 * dQ_acc (B,NH,T,hs) fp32, contiguous. */
static int views(const CudnnGraphInfo *g, int B, int T, int NH, int hs, char *why, size_t n) {
    int64_t C = (int64_t)NH * hs;
    for (int i = 0; i < g->n_tensors; i++) {
        const CudnnGraphTensor *t = &g->t[i];
        if (t->is_virtual || t->by_value) continue;
        int64_t d[4], s[4];
        int kt = strcmp(t->name, "Kt") == 0 || strcmp(t->name, "Vt") == 0;
        int stats = strcmp(t->name, "stats") == 0;
        int oview = strcmp(t->name, "O") == 0 || strcmp(t->name, "dO") == 0;
        int acc = strcmp(t->name, "dQ_acc") == 0;
        d[0] = B, d[1] = NH, d[2] = kt ? hs : T, d[3] = stats ? 1 : kt ? T : hs;
        s[0] = stats ? (int64_t)NH * T : (int64_t)T * (oview ? C : 3 * C), s[1] = stats ? T : hs;
        s[2] = stats ? 1 : kt ? 1 : oview ? C : 3 * C, s[3] = stats ? 1 : kt ? 3 * C : 1;
        if (acc) s[0] = (int64_t)NH * T * hs, s[1] = (int64_t)T * hs, s[2] = hs, s[3] = 1;
        if (memcmp(d, t->dims, sizeof d) || memcmp(s, t->strides, sizeof s))
            return snprintf(why, n, "%s: dims %lld,%lld,%lld,%lld strides %lld,%lld,%lld,%lld", t->name,
                            (long long)t->dims[0], (long long)t->dims[1], (long long)t->dims[2], (long long)t->dims[3],
                            (long long)t->strides[0], (long long)t->strides[1], (long long)t->strides[2],
                            (long long)t->strides[3]), 0;
        int want = stats || acc ? CUDNN_GT_F32 : CUDNN_GT_BF16;
        if (t->dtype != want) return snprintf(why, n, "%s has dtype %d, want %d", t->name, t->dtype, want), 0;
    }
    return 1;
}

/* Every tensor's strides describe a layout: no two elements at one address.
 * Dims of size > 1 sorted by stride, each stride at least the span of the
 * ones below it (gaps allowed: the qkv views skip the other two thirds). */
static int layouts(const CudnnGraphInfo *g, char *why, size_t n) {
    for (int i = 0; i < g->n_tensors; i++) {
        const CudnnGraphTensor *t = &g->t[i];
        int64_t d[4], s[4];
        int k = 0;
        for (int j = 0; j < 4; j++)
            if (t->dims[j] > 1) d[k] = t->dims[j], s[k] = t->strides[j], k++;
        for (int a = 1; a < k; a++) /* insertion sort by stride */
            for (int b = a; b > 0 && s[b] < s[b - 1]; b--) {
                int64_t x = s[b]; s[b] = s[b - 1], s[b - 1] = x;
                x = d[b]; d[b] = d[b - 1], d[b - 1] = x;
            }
        for (int a = 0; a + 1 < k; a++)
            if (s[a] < 1 || s[a + 1] < s[a] * d[a])
                return snprintf(why, n, "%s: strides %lld,%lld,%lld,%lld overlap for dims %lld,%lld,%lld,%lld", t->name,
                                (long long)t->strides[0], (long long)t->strides[1], (long long)t->strides[2],
                                (long long)t->strides[3], (long long)t->dims[0], (long long)t->dims[1],
                                (long long)t->dims[2], (long long)t->dims[3]), 0;
    }
    return 1;
}

int main(void) {
    static const struct { const char *name; int B, T, NH, hs; } shapes[] = {
        {"gpt2_124m", 4, 1024, 12, 64}, /* GPT-2 124M's training shape */
        {"odd", 2, 200, 3, 32},         /* T no multiple of any tile, few heads */
        {"selfcheck", 1, 200, 2, 64},   /* attention.cu's self-check */
        {"hs128", 1, 64, 4, 128},       /* the largest head size the backward takes */
    };
    static CudnnGraphInfo info;
    char why[800], name[96];
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        for (int graph = CUDNN_GRAPH_FORWARD; graph <= CUDNN_GRAPH_BACKWARD_ATOMIC; graph++) {
            static const char *const gname[] = {"forward", "backward", "backward_atomic"};
            snprintf(name, sizeof name, "cudnn_graph_%s_%s", gname[graph], shapes[s].name);
            int rc = cuda_cudnn_graph_probe(graph, shapes[s].B, shapes[s].T, shapes[s].NH, shapes[s].hs, &info, why,
                                            sizeof why);
            if (rc == 0) {
                printf("skip %s: %s\n", name, why);
                continue;
            }
            /* forward: 14 ops (matmul, scale, 2 index, compare, select, max, sub, exp, sum, log, add, div,
             * matmul); backward: 22 (D: 3; masked scores: 6; P: 2; dV: 2; dS: 5; dK: 2; dQ: 2); the atomic
             * backward one more (dQ's identity out of the accumulator) */
            int want_ops = graph == CUDNN_GRAPH_FORWARD ? 14 : graph == CUDNN_GRAPH_BACKWARD ? 22 : 23;
            test_report(rc == 1 && info.n_ops == want_ops, name, "%s", rc == 1 ? "wrong operation count" : why);
            if (rc != 1) continue;
            char sub[128];
            snprintf(sub, sizeof sub, "%s_wiring", name);
            test_report(wiring(&info, graph, why, sizeof why), sub, "%s", why);
            snprintf(sub, sizeof sub, "%s_layouts", name);
            test_report(layouts(&info, why, sizeof why), sub, "%s", why);
            snprintf(sub, sizeof sub, "%s_views", name);
            test_report(views(&info, shapes[s].B, shapes[s].T, shapes[s].NH, shapes[s].hs, why, sizeof why), sub, "%s",
                        why);
        }
    }
    const char *bi = cuda_cudnn_build_info();
    test_report(strstr(bi, "built against cuDNN 9.") != NULL, "cudnn_graph_build_info", "%s", bi);
    return 0;
}

#else

int main(void) {
    printf("skip cudnn_graph: this build has no cuDNN attention (no CUDA backend or no cudnn_graph.h)\n");
    return 0;
}

#endif
