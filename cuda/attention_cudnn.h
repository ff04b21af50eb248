/* attention_cudnn.h: what test/test_cudnn_graph.c may see of attention_cudnn.cu
 * (plain C, no cuDNN or CUDA header): a description of the forward and
 * backward fused-attention graphs as kiln builds them, so a test without a GPU
 * can check every descriptor finalizes and the graph is wired consistently.
 * The op entry points themselves are declared in common.cuh. */
#ifndef KILN_ATTENTION_CUDNN_H
#define KILN_ATTENTION_CUDNN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CUDNN_GRAPH_MAX_TENSORS 48
#define CUDNN_GRAPH_MAX_OPS 40

/* Data types as kiln names them (cuDNN's enum stays inside the .cu). */
enum { CUDNN_GT_F32, CUDNN_GT_BF16, CUDNN_GT_I32, CUDNN_GT_BOOL };

typedef struct {
    const char *name; /* "Q", "S", "stats", ... */
    int64_t uid;      /* unique within one graph */
    int is_virtual;   /* lives only inside the fused kernel */
    int by_value;     /* a host scalar (scale, -inf, 1) */
    int dtype;        /* CUDNN_GT_* */
    int64_t dims[4], strides[4];
} CudnnGraphTensor;

typedef struct {
    const char *name;     /* "matmul Q.Kt", "exp", ... */
    int n_in;             /* 1..3 */
    int64_t in[3], out;   /* tensor uids */
} CudnnGraphOp;

typedef struct {
    int n_tensors, n_ops;
    CudnnGraphTensor t[CUDNN_GRAPH_MAX_TENSORS];
    CudnnGraphOp op[CUDNN_GRAPH_MAX_OPS];
} CudnnGraphInfo;

/* The graphs: the forward; the backward with dQ straight from its matmul
 * (deterministic); the backward with dQ through an fp32 accumulator that the
 * engine adds to with atomics (precision.attention_deterministic false). */
enum { CUDNN_GRAPH_FORWARD, CUDNN_GRAPH_BACKWARD, CUDNN_GRAPH_BACKWARD_ATOMIC };

/* Builds and finalizes every tensor and operation descriptor of graph
 * (CUDNN_GRAPH_*) of causal attention at shape B, T, NH, hs, stopping short
 * of the operation graph (which needs a handle, so a GPU), describes them in
 * *info and destroys them. Returns 1 on success, 0 when the cuDNN library
 * cannot be loaded or the build has no cuDNN (why says which), -1 when a
 * descriptor failed (why names it and cuDNN's message). */
int cuda_cudnn_graph_probe(int graph, int B, int T, int NH, int hs, CudnnGraphInfo *info, char *why, size_t n);

/* For ./train --version: "cuDNN attention: built against cuDNN 9.19.0 headers
 * (libcudnn_graph.so.9 is opened at run time)" or why it is left out. */
const char *cuda_cudnn_build_info(void);

#ifdef __cplusplus
}
#endif

#endif
