/* model_emu_cuda: the whole CUDA backend table (every file of cuda/, with
 * matmul.cu over test/cublaslt_emu.h's cuBLASLt; attention_cudnn.cu built
 * without KILN_CUDNN, its "not built in" side, as in cuda_emu.cc) compiled
 * for the CPU against test/cuda_emu.h, as one C++ object that a plain C test
 * (test/model_emu.c) links beside src/model.c and src/optim.c. It exports
 * backend_cuda (backend_cuda.cu's own definition) and what the emulation can
 * say about leaks; it adds no op of its own. Never part of ./train. */
#include "cuda_emu.h"
#include "cublaslt_emu.h"

#include "../cuda/embed_norm.cu"
#include "../cuda/pointwise.cu"
#include "../cuda/llama.cu"
#include "../cuda/moe.cu"
#include "../cuda/attention.cu"
#include "../cuda/attention_tc.cu"
#include "../cuda/attention_block.cu"
#include "../cuda/fp8.cu"
#include "../cuda/attention_cudnn.cu" /* without KILN_CUDNN: its "not built in" side */
#include "../cuda/matmul.cu"
#include "../cuda/backend_cuda.cu"

/* cudaMalloc buffers not yet freed, and cuBLASLt objects not yet destroyed:
 * both 0 after model_free, optim_free and shutdown. */
extern "C" size_t model_emu_live_buffers(void) { return emu_allocs.size(); }
extern "C" int model_emu_live_cublaslt(void) { return emu_lt_live; }
/* The compute capability the emulated GPU reports from now on, and what
 * kiln has cached about it (fp8's device check, rowwise fp8 products). */
extern "C" void model_emu_set_sm(int major, int minor) {
    emu_sm_major = major, emu_sm_minor = minor;
    fp8_device_checked = 0, mm_fp8_rowwise = -1;
}
/* cuBLASLt's fp8 products run since matmul.cu's clock read `since`, with
 * outer-vector scales or scalar ones (the number of such plans used): which
 * path a run's fp8 products took. model_emu_mm_clock() reads the clock. */
extern "C" unsigned long long model_emu_mm_clock(void) { return mm_clock; }
extern "C" int model_emu_fp8_plans(unsigned long long since, int outer_vec) {
    int n = 0;
    for (int i = 0; i < mm_nplans; i++)
        n += mm_plans[i].usable && mm_plans[i].used > since && mm_plans[i].key.fp8_a &&
             mm_plans[i].key.fp8_vec == outer_vec;
    return n;
}
