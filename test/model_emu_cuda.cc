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
#include "../cuda/attention_cudnn.cu" /* without KILN_CUDNN: its "not built in" side */
#include "../cuda/matmul.cu"
#include "../cuda/backend_cuda.cu"

/* cudaMalloc buffers not yet freed, and cuBLASLt objects not yet destroyed:
 * both 0 after model_free, optim_free and shutdown. */
extern "C" size_t model_emu_live_buffers(void) { return emu_allocs.size(); }
extern "C" int model_emu_live_cublaslt(void) { return emu_lt_live; }
