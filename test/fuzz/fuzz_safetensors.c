/* fuzz_safetensors: a .safetensors file held in memory (st_parse: header
 * length, the JSON header, the data section); every tensor it accepts is
 * widened to fp32, which reads each byte range it promised lies inside the
 * data. st_parse never exits: a refusal is one line in err, checked here. */
#include "fuzz.h"
#include "safetensors.h"

FUZZ_NOCOV int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n);

int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {
    StFile f;
    char err[1024] = "";
    if (st_parse(d, n, &f, err, sizeof err) != 0) {
        fuzz_check_err("st_parse", err);
        return 0;
    }
    for (int i = 0; i < f.n; i++) {
        const StTensor *t = &f.t[i];
        if (t->end < t->begin || t->end > f.data_len) abort(); /* st_parse promised the range */
        float *out = xmalloc((size_t)t->numel * sizeof(float));
        st_to_f32(&f, t, out);
        free(out);
    }
    st_free(&f);
    return 0;
}
