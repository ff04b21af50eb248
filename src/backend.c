/* backend: picks a Backend by name at run time. The only file that knows which
 * backends this build holds; a build without nvcc simply has no CUDA entry. */
#include "backend.h"

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
