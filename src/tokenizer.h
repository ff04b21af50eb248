/* tokenizer: text <-> token ids. "byte" is the 256-id byte-level vocabulary (no
 * file); "gpt2" is GPT-2's byte-level BPE read from a tiktoken-format rank file
 * (one "base64(token) rank" per line), with GPT-2's pre-tokenisation regex and
 * <|endoftext|> = 50256. Never touches shards or the model. */
#ifndef KILN_TOKENIZER_H
#define KILN_TOKENIZER_H

#include <stdint.h>
#include <stddef.h>

typedef struct Tokenizer Tokenizer;

/* kind "byte" (file ignored) or "gpt2" (file required). Errors exit 2 naming the file. */
Tokenizer *tok_open(const char *kind, const char *file);
void tok_free(Tokenizer *t);

int tok_vocab_size(const Tokenizer *t); /* 256 or 50257 */
int tok_eot(const Tokenizer *t);        /* end-of-text id, -1 if none (byte) */

/* Append the ids of text[0..len) to *ids (grown with realloc; *n and *cap track it). */
void tok_encode(const Tokenizer *t, const char *text, size_t len, uint32_t **ids, size_t *n,
                size_t *cap);

/* The bytes of one token; returns their count (0 for an unknown id). */
size_t tok_decode(const Tokenizer *t, uint32_t id, char *buf, size_t cap);

#endif
