/* hf: HuggingFace interop — kiln's tensor table mapped to the names, shapes
 * and config.json of GPT2LMHeadModel, LlamaForCausalLM and OlmoeForCausalLM;
 * `./train export --format hf` and init.from an HF directory. Knows the
 * mapping and safetensors (src/safetensors.h), never the forward pass;
 * the mapping per architecture: docs/formats.md "HuggingFace". */
#ifndef KILN_HF_H
#define KILN_HF_H

#include "arch.h"
#include "model.h"
#include "safetensors.h"

/* The HF model_type that expresses spec s exactly ("gpt2", "llama",
 * "olmoe"), or NULL with the reason in why (e.g. shared experts). */
const char *hf_model_type(const ArchSpec *s, char *why, size_t cap);

/* HF name of the kiln tensor (layer, role, name) in `out`, and whether HF
 * stores it transposed (GPT-2's Conv1D weights: (in, out)). */
void hf_tensor_name(const ArchSpec *s, const char *kiln_name, int role, char *out, size_t cap, int *transpose);

/* Write model.safetensors, config.json and generation_config.json of spec s
 * into dir (created): host[i] holds table row t[i]'s fp32 values (padded
 * vocabulary rows included; they are cut). Past shard_bytes of tensor data
 * (0: no limit) the weights go into model-0000K-of-0000N.safetensors shards
 * and model.safetensors.index.json. Exits 2 when HF cannot express s, 1 on
 * I/O failure. */
void hf_write_dir(const ArchSpec *s, const ArchTensor *t, int n, float *const *host, const char *dir, StDtype dtype,
                  uint64_t shard_bytes);

/* GPT-2's BPE ranks (a tiktoken file) as HF's tokenizer files in dir:
 * vocab.json, merges.txt, tokenizer_config.json (model_max_length max_len),
 * special_tokens_map.json. Returns the vocabulary size; exits 2 on a rank
 * file that is not GPT-2-style BPE, 1 on I/O failure. */
int hf_write_gpt2_tokenizer(const char *dir, const char *rank_file, int max_len);

/* init.from naming an HF directory (model.safetensors) or a .safetensors
 * file: load it into m's parameters (names mapped back, GPT-2 transposed
 * back, padded rows zero) and say so when `say`. Returns 0 if path is
 * neither (the caller tries llm.c); a missing, extra or mis-shaped tensor
 * exits 2 naming it. */
int hf_init_from(Model *m, const char *path, int say);

/* ./train export CKPT_DIR --format hf --out DIR [--dtype fp32|bf16] */
int hf_export_main(int argc, char **argv);

#endif
