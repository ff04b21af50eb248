/* backend_cuda: the CUDA backend's start-up, memory and the Backend table; the
 * ops live in embed_norm.cu, matmul.cu, attention.cu (+ attention_tc.cu,
 * attention_cudnn.cu; attention_block.cu for context parallelism), llama.cu, moe.cu
 * and pointwise.cu. The
 * activation dtype (backend.h) is precision.compute: bf16 (activations, their
 * gradients and the parameters' compute copy stored in bf16, matrix products
 * on bf16 tensor cores, fp32 math and accumulation) or fp32 (everything fp32,
 * strict fp32 products). Parameter gradients, master weights and optimizer
 * state are fp32 either way. Nothing here runs before the host
 * calls a function: the CUDA runtime is linked statically and loads the driver
 * lazily, so a binary with this backend starts, and runs the CPU backend, on a
 * machine with no GPU driver at all. All work goes to the legacy default
 * stream, in order; to_host and sumsq therefore see every earlier op. */
#ifndef KILN_CUDA_EMU /* test/cuda_emu.cc runs this file on the CPU; cuBLASLt is left out there */
#include <cublasLt.h>
#endif
#include <stdio.h>
#include <string.h>

#include "attention_cudnn.h"
#include "common.cuh"

static char cuda_desc[1280];
static char cuda_device_part[384];
static int cuda_started;
static size_t cuda_peak_used; /* bytes in use on the device, highest seen */
int cuda_act_bf16;            /* common.cuh: the activation dtype is bf16 */
unsigned long cuda_host_syncs; /* common.cuh: host waits on the device since init */

/* ---------------------------------------------------------------------------
 * Availability and build information (no driver needed for either) */

extern "C" int backend_cuda_available(void) {
    static int cached = -1;
    if (cached < 0) {
        int n = 0;
        cudaError_t err = cudaGetDeviceCount(&n);
        if (err != cudaSuccess) {
            (void)cudaGetLastError(); /* clear the sticky "no driver" error */
            n = 0;
        }
        cached = n > 0;
    }
    return cached;
}

/* What this build was compiled against, for ./train --version. */
extern "C" const char *backend_cuda_build_info(void) {
    static char info[512];
    if (!info[0])
        snprintf(info, sizeof info, "cuda: built against CUDA runtime %d.%d, cuBLASLt %d.%d.%d; %s", CUDART_VERSION / 1000,
                 CUDART_VERSION % 1000 / 10, CUBLAS_VER_MAJOR, CUBLAS_VER_MINOR, CUBLAS_VER_PATCH,
                 cuda_cudnn_build_info());
    return info;
}

/* ---------------------------------------------------------------------------
 * Memory */

static void cuda_note_usage(void) {
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess && total_b - free_b > cuda_peak_used)
        cuda_peak_used = total_b - free_b;
}

static void *cuda_alloc_bytes(size_t bytes) {
    void *p = NULL;
    if (bytes == 0) bytes = 256;
    cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        kiln_hint("a smaller batch.micro_batch (more accumulation steps) needs less memory");
        kiln_fail(KILN_EXIT_RUNTIME, "cuda backend: cannot allocate %.3f GiB (%.3f GiB free of %.3f): %s",
                  bytes / 1073741824.0, free_b / 1073741824.0, total_b / 1073741824.0, cudaGetErrorString(err));
    }
    CUDA_CHECK(cudaMemset(p, 0, bytes));
    cuda_note_usage();
    return p;
}

static void *cuda_alloc(size_t bytes) { return cuda_alloc_bytes(bytes); }
static void cuda_free(void *p) {
    if (p) CUDA_CHECK(cudaFree(p));
}
/* Small host-to-device copies (each micro-batch's tokens and targets) go
 * through a pinned staging ring and cudaMemcpyAsync on the stream: a
 * cudaMemcpy from pageable memory would first wait for every op queued before
 * it, so the host could not queue the next micro-batch while the GPU works.
 * The source may be reused on return (it was copied into the ring), as
 * backend.h promises; a slot is written again only after the event recorded
 * behind its copy has passed. Large copies (weights at load) stay plain. */
#define STAGE_SLOTS 8
#define STAGE_BYTES ((size_t)1 << 20)
static unsigned char *stage_mem; /* pinned host, STAGE_SLOTS * STAGE_BYTES */
static cudaEvent_t stage_done[STAGE_SLOTS];
static int stage_next;

static void stage_init(void) {
    CUDA_CHECK(cudaMallocHost((void **)&stage_mem, STAGE_SLOTS * STAGE_BYTES));
    for (int s = 0; s < STAGE_SLOTS; s++) CUDA_CHECK(cudaEventCreateWithFlags(&stage_done[s], cudaEventDisableTiming));
    stage_next = 0;
}

static void stage_free(void) {
    if (!stage_mem) return;
    for (int s = 0; s < STAGE_SLOTS; s++) CUDA_CHECK(cudaEventDestroy(stage_done[s]));
    CUDA_CHECK(cudaFreeHost(stage_mem));
    stage_mem = NULL;
}

void cuda_stage_to_device(void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    if (bytes > STAGE_BYTES || !stage_mem) {
        CUDA_HOST_WAIT(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice)); /* pageable: waits for the stream */
        return;
    }
    int s = stage_next;
    stage_next = (s + 1) % STAGE_SLOTS;
    /* the slot's last copy must have been read: a host wait (counted) only
     * when it has not yet, i.e. when the host runs STAGE_SLOTS copies ahead */
    cudaError_t q = cudaEventQuery(stage_done[s]);
    if (q == cudaErrorNotReady) CUDA_HOST_WAIT(cudaEventSynchronize(stage_done[s]));
    else CUDA_CHECK(q);
    unsigned char *slot = stage_mem + (size_t)s * STAGE_BYTES;
    memcpy(slot, src, bytes);
    CUDA_CHECK(cudaMemcpyAsync(dst, slot, bytes, cudaMemcpyHostToDevice, cudaStreamLegacy));
    CUDA_CHECK(cudaEventRecord(stage_done[s], cudaStreamLegacy));
}
static void cuda_to_host(void *dst, const void *src, size_t bytes) {
    if (bytes) CUDA_HOST_WAIT(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}
static void cuda_copy(void *dst, const void *src, size_t bytes) {
    if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, 0));
}
static void cuda_copy_2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t rows) {
    if (width && rows)
        CUDA_CHECK(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows, cudaMemcpyDeviceToDevice, 0));
}
static void cuda_zero(void *dst, size_t bytes) {
    if (bytes) CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, 0));
}
/* Every op of the backend's stream done. Not cudaDeviceSynchronize: that
 * would also wait, with no deadline, for NCCL work on comm's own streams
 * (comm.h); what the compute stream took from them (a waited request) is
 * behind its events already. */
static void cuda_sync(void) { CUDA_HOST_WAIT(cudaStreamSynchronize(cudaStreamLegacy)); }
static unsigned long cuda_host_syncs_get(void) { return cuda_host_syncs; }

static void *scratch_ptr[SCRATCH_COUNT];
static size_t scratch_size[SCRATCH_COUNT];

void *cuda_scratch(int slot, size_t bytes) {
    if (bytes > scratch_size[slot]) {
        /* cudaFree waits for the kernels that may still read the old buffer. */
        if (scratch_ptr[slot]) CUDA_CHECK(cudaFree(scratch_ptr[slot]));
        scratch_ptr[slot] = cuda_alloc_bytes(bytes);
        scratch_size[slot] = bytes;
    }
    return scratch_ptr[slot];
}

void cuda_scratch_free_all(void) {
    for (int i = 0; i < SCRATCH_COUNT; i++) {
        if (scratch_ptr[i]) cudaFree(scratch_ptr[i]);
        scratch_ptr[i] = NULL;
        scratch_size[i] = 0;
    }
}

/* ---------------------------------------------------------------------------
 * Start-up */

static void cuda_update_desc(void) {
    snprintf(cuda_desc, sizeof cuda_desc, "%s, %s, %s", cuda_device_part,
             cuda_act_bf16 ? "bf16 activations (tensor cores, fp32 accumulate)" : "fp32 activations and products",
             cuda_attention_describe());
}

/* Which of the visible GPUs this process uses (select_device, before init):
 * one process per GPU, so the rank's index among the ranks of its host. */
static int cuda_local_rank, cuda_local_world = 1;

static void cuda_select_device(int local_rank, int local_world) {
    cuda_local_rank = local_rank > 0 ? local_rank : 0;
    cuda_local_world = local_world > 0 ? local_world : 1;
}

static const char *cuda_init(int threads) {
    (void)threads;
    if (cuda_started) return cuda_desc;
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess || n == 0) {
        (void)cudaGetLastError();
        kiln_hint("device: cpu runs on the CPU backend; device: auto picks the GPU only when one is present");
        kiln_fail(KILN_EXIT_USAGE, "cuda backend: no usable GPU (%s)",
                  err != cudaSuccess ? cudaGetErrorString(err) : "no CUDA devices");
    }
    /* One visible GPU (Slurm's --gpus-per-task, or CUDA_VISIBLE_DEVICES set
     * per rank by the launcher): use it. Several: the one of this local rank;
     * more ranks on the host than GPUs would put two ranks on one GPU, which
     * NCCL refuses later with a less clear message. */
    int dev = 0;
    if (n > 1) {
        if (cuda_local_rank >= n) {
            const char *vis = getenv("CUDA_VISIBLE_DEVICES");
            kiln_hint("start one rank per GPU (srun --ntasks-per-node=GPUS, mpirun -np GPUS per host)");
            kiln_fail(KILN_EXIT_USAGE, "cuda backend: local rank %d of %d on this host but only %d GPUs are visible%s%s%s",
                      cuda_local_rank, cuda_local_world, n, vis ? " (CUDA_VISIBLE_DEVICES=" : "", vis ? vis : "",
                      vis ? ")" : "");
        }
        dev = cuda_local_rank;
    }
    CUDA_CHECK(cudaSetDevice(dev));
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    int rt = 0, drv = 0;
    CUDA_CHECK(cudaRuntimeGetVersion(&rt));
    CUDA_CHECK(cudaDriverGetVersion(&drv));
    cuda_matmul_init();
    stage_init();
    cuda_note_usage();
    size_t lt = cublasLtGetVersion();
    snprintf(cuda_device_part, sizeof cuda_device_part,
             "cuda: GPU %d of %d: %s (sm_%d%d, %d SMs, %.1f GiB), runtime %d.%d, driver %d.%d, cuBLASLt %zu.%zu.%zu",
             dev, n, prop.name, prop.major, prop.minor, prop.multiProcessorCount, prop.totalGlobalMem / 1073741824.0,
             rt / 1000, rt % 1000 / 10, drv / 1000, drv % 1000 / 10, lt / 10000, lt / 100 % 100, lt % 100);
    cuda_update_desc();
    cuda_started = 1;
    return cuda_desc;
}

static void cuda_shutdown(void) {
    if (!cuda_started) return;
    cudaDeviceSynchronize();
    stage_free();
    cuda_scratch_free_all();
    cuda_embed_free_host();
    cuda_matmul_shutdown();
    cuda_act_bf16 = 0; /* the next init starts from fp32 again */
    cuda_attention_reset(); /* and from precision.attention auto */
    cuda_started = 0;
}

/* precision.compute: "bf16" or "fp32", the activation dtype. Called before
 * any act buffer exists (backend.h); switching later would reinterpret them. */
static void cuda_set_precision(const char *compute) {
    if (strcmp(compute, "bf16") == 0) cuda_act_bf16 = 1;
    else if (strcmp(compute, "fp32") == 0) cuda_act_bf16 = 0;
    else kiln_fail(KILN_EXIT_USAGE, "key 'precision.compute': '%s' is not one of bf16|fp32", compute);
    cuda_attention_precision_changed(); /* bf16: tensor-core attention, after its self-check */
    cuda_update_desc();
}

/* precision.attention: "auto", "cudnn", "tensor_cores" or "simt" (attention.cu). */
static void cuda_set_attention(const char *impl) {
    cuda_attention_set_mode(impl);
    cuda_update_desc();
}

/* precision.attention_deterministic (attention.cu). */
static void cuda_set_attention_deterministic(int deterministic) {
    cuda_attention_set_deterministic(deterministic);
    cuda_update_desc();
}

static size_t cuda_act_bytes(void) { return cuda_act_bf16 ? sizeof(bf16) : sizeof(float); }

static size_t cuda_memory_peak(void) {
    cuda_note_usage();
    return cuda_peak_used;
}

/* Every op goes to the legacy default stream (stream 0 in this backend's
 * launches and copies). Named as cudaStreamLegacy, not 0: the handle means the
 * same stream in code built with --default-stream per-thread, and in the CUDA
 * runtime that NCCL carries. */
static void *cuda_stream(void) { return (void *)cudaStreamLegacy; }

/* Designated initializers in declaration order (C++20; nvcc and g++ accept
 * them in C++17 mode): a field added to backend.h without a CUDA entry stays
 * NULL and the op test names it, rather than shifting every pointer. */
extern "C" const Backend backend_cuda = {
    .name = "cuda",
    .host_mem = 0,
    .init = cuda_init,
    .shutdown = cuda_shutdown,
    .alloc = cuda_alloc,
    .free = cuda_free,
    .to_device = cuda_stage_to_device,
    .to_host = cuda_to_host,
    .copy = cuda_copy,
    .copy_2d = cuda_copy_2d,
    .zero = cuda_zero,
    .sync = cuda_sync,
    .act_bytes = cuda_act_bytes,
    .cast_to_act = cuda_cast_to_act,
    .embed_forward = cuda_embed_forward,
    .embed_backward = cuda_embed_backward,
    .layernorm_forward = cuda_layernorm_forward,
    .layernorm_backward = cuda_layernorm_backward,
    .rmsnorm_forward = cuda_rmsnorm_forward,
    .rmsnorm_backward = cuda_rmsnorm_backward,
    .matmul_forward = cuda_matmul_forward,
    .matmul_backward = cuda_matmul_backward,
    .attention_forward = cuda_attention_forward,
    .attention_backward = cuda_attention_backward,
    .attention_block_forward = cuda_attention_block_forward,
    .attention_block_backward = cuda_attention_block_backward,
    .rope_forward = cuda_rope_forward,
    .rope_backward = cuda_rope_backward,
    .qknorm_forward = cuda_qknorm_forward,
    .qknorm_backward = cuda_qknorm_backward,
    .gelu_forward = cuda_gelu_forward,
    .gelu_backward = cuda_gelu_backward,
    .swiglu_forward = cuda_swiglu_forward,
    .swiglu_backward = cuda_swiglu_backward,
    .moe_route = cuda_moe_route,
    .moe_dispatch = cuda_moe_dispatch,
    .moe_dispatch_capped = cuda_moe_dispatch_capped,
    .moe_gather = cuda_moe_gather,
    .moe_gather_backward = cuda_moe_gather_backward,
    .moe_combine = cuda_moe_combine,
    .moe_combine_backward = cuda_moe_combine_backward,
    .moe_route_backward = cuda_moe_route_backward,
    .matmul_gelu_forward = cuda_matmul_gelu_forward,
    .matmul_backward_dgelu = cuda_matmul_backward_dgelu,
    .residual_forward = cuda_residual_forward,
    .residual_norm_forward = cuda_residual_norm_forward,
    .add = cuda_add,
    .crossentropy_forward = cuda_crossentropy_forward,
    .xent_partial = cuda_xent_partial,
    .xent_finish = cuda_xent_finish,
    .adamw_update = cuda_adamw_update,
    .adamw_update_bf16 = cuda_adamw_update_bf16,
    .adamw_update_p16 = cuda_adamw_update_p16,
    .lion_update = cuda_lion_update,
    .muon_momentum = cuda_muon_momentum,
    .newton_schulz = cuda_newton_schulz,
    .muon_apply = cuda_muon_apply,
    .adafactor_stats = cuda_adafactor_stats,
    .adafactor_ema = cuda_adafactor_ema,
    .adafactor_second = cuda_adafactor_second,
    .adafactor_usq = cuda_adafactor_usq,
    .adafactor_apply = cuda_adafactor_apply,
    .fp8_amax = cuda_fp8_amax,
    .fp8_qdq = cuda_fp8_qdq,
    .fp8_cast = cuda_fp8_cast,
    .fp8_matmul = cuda_fp8_matmul,
    .fp8_rowwise = cuda_fp8_rowwise,
    .sumsq = cuda_sumsq,
    .sumsq_acc = cuda_sumsq_acc,
    .loss_acc = cuda_loss_acc,
    .step_scalars = cuda_step_scalars,
    .set_precision = cuda_set_precision,
    .set_attention = cuda_set_attention,
    .set_attention_deterministic = cuda_set_attention_deterministic,
    .memory_peak = cuda_memory_peak,
    .host_syncs = cuda_host_syncs_get,
    .stream = cuda_stream,
    .select_device = cuda_select_device,
};
