/* llmc: llm.c's GPT-2 checkpoint out (the reverse of model_load_llmc): 256
 * int32 header (magic 20240326, version 3 = fp32, max T, V, L, NH, C, Vp),
 * then every parameter kind stacked over the layers in llm.c's order.
 * Knows the tensor table, not the model's arenas. docs/formats.md. */
#ifndef KILN_LLMC_H
#define KILN_LLMC_H

#include "arch.h"

/* NULL if spec s is a GPT-2 that llm.c can hold, else why not (a sentence). */
const char *llmc_refusal(const ArchSpec *s);

/* Write the table's tensors (host[i]: t[i]'s fp32 values, padded rows
 * included) as an llm.c checkpoint at path (tmp + rename). Exits 2 when
 * llmc_refusal says so, 1 on an I/O error, naming the file. */
void llmc_write(const ArchSpec *s, const ArchTensor *t, int n, float *const *host, const char *path);

#endif
