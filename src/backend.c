/* backend: picks a Backend by name at run time, and converts host buffers
 * between fp32 and the activation dtype. The only file that knows which
 * backends this build holds; a build without nvcc simply has no CUDA entry. */
#include "backend.h"
#include "sround.h"
#include "util.h"

#include <string.h>

#ifdef KILN_CUDA
/* cuda/backend_cuda.cu defines it when the build has nvcc (-DKILN_CUDA). */
extern const Backend backend_cuda;
/* Nonzero when a usable GPU is present; lets "auto" fall back to the CPU. */
extern int backend_cuda_available(void);
/* The CUDA runtime and cuBLASLt versions the backend was compiled against. */
extern const char *backend_cuda_build_info(void);
#endif

const Backend *backend_get(const char *name) {
    if (!name) return NULL;
    if (strcmp(name, "cpu") == 0) return &backend_cpu;
    if (strcmp(name, "cuda") == 0) {
#ifdef KILN_CUDA
        return &backend_cuda;
#else
        return NULL;
#endif
    }
    if (strcmp(name, "auto") == 0) {
#ifdef KILN_CUDA
        if (backend_cuda_available()) return &backend_cuda;
#endif
        return &backend_cpu;
    }
    return NULL;
}

const char *backend_list(void) {
#ifdef KILN_CUDA
    return "cpu, cuda";
#else
    return "cpu";
#endif
}

const char *backend_build_info(void) {
#ifdef KILN_CUDA
    return backend_cuda_build_info();
#else
    return "";
#endif
}

int backend_available(const char *name) {
    const Backend *be = backend_get(name);
    if (!be) return 0;
#ifdef KILN_CUDA
    if (be == &backend_cuda) return backend_cuda_available();
#endif
    return 1;
}

void backend_set_precision(const Backend *be, const char *compute, const char *attention, int deterministic) {
    if (be->set_attention) be->set_attention(attention);
    if (be->set_attention_deterministic) be->set_attention_deterministic(deterministic);
    else if (!deterministic)
        kiln_warn("key 'precision.attention_deterministic': false has no effect on the %s backend: its attention "
                  "sums in a fixed order", be->name);
    if (be->set_precision) be->set_precision(compute);
}

/* bf16 is the top half of an fp32. Round to nearest even: add 0x7fff plus
 * the lowest kept bit, then truncate; a NaN is kept a (quiet) NaN rather
 * than rounded, which could carry it into Inf. */
static uint16_t f32_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

void backend_f32_to_act(void *dst, const float *src, size_t n, size_t act_bytes) {
    if (act_bytes == sizeof(float)) {
        if (n) memmove(dst, src, n * sizeof(float));
        return;
    }
    uint16_t *d = dst;
    for (size_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
}

void backend_act_to_f32(float *dst, const void *src, size_t n, size_t act_bytes) {
    if (act_bytes == sizeof(float)) {
        if (n) memmove(dst, src, n * sizeof(float));
        return;
    }
    const uint16_t *s = src;
    for (size_t i = 0; i < n; i++) dst[i] = sround_f32(s[i]);
}

float backend_act_round(float x, size_t act_bytes) {
    return act_bytes == sizeof(float) ? x : sround_f32(f32_to_bf16(x));
}
