/* backend: picks a Backend by name at run time. The only file that knows which
 * backends this build holds; a build without nvcc simply has no CUDA entry. */
#include "backend.h"

#include <string.h>

#ifdef KILN_CUDA
/* cuda/backend_cuda.cu defines it when the build has nvcc (-DKILN_CUDA). */
extern const Backend backend_cuda;
/* Nonzero when a usable GPU is present; lets "auto" fall back to the CPU. */
extern int backend_cuda_available(void);
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
