/* fuzz_llmc: an llm.c GPT-2 checkpoint (256 int32 header, then the fp32
 * parameters in llm.c's order) loaded as init.from into a 1-layer, 8-wide
 * GPT-2 of context 8 and vocabulary 16. Runs in a child: the loader exits 2
 * naming the file and what differs (fuzz.h). */
#include "arch.h"
#include "backend.h"
#include "fuzz.h"
#include "model.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
FUZZ_NOCOV int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n);

static Model model;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    backend_cpu.init(1);
    ArchSpec s = ARCH_GPT2_SHAPE(1, 2, 8, 8, 16);
    arch_resolve(&s);
    model_init(&model, &backend_cpu, &s, NULL);
    return 0;
}

static void load(const uint8_t *d, size_t n) { model_load_llmc(&model, fuzz_file("model.bin", d, n)); }

int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {
    fuzz_fork(load, d, n);
    return 0;
}
