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

/* Append the ids of text[0..len) to *ids (grown with realloc; *n and *cap track it).
 * All text is ordinary text, as tiktoken's encode_ordinary: "<|endoftext|>" in the
 * input is not the special token; callers add tok_eot() themselves. */
void tok_encode(const Tokenizer *t, const char *text, size_t len, uint32_t **ids, size_t *n,
                size_t *cap);

/* The bytes of one token; returns their count (0 for an unknown id). Copies at most
 * cap bytes: a return value > cap means buf was too small. */
size_t tok_decode(const Tokenizer *t, uint32_t id, char *buf, size_t cap);

/* Code-point classes of GPT-2's pre-tokenisation regex: \p{L}, \p{N}, \s (Unicode
 * White_Space), everything else. Tables generated into src/unicode_ranges.c by
 * scripts/gen_unicode_ranges.py. */
enum { TOK_CLASS_OTHER = 0, TOK_CLASS_LETTER, TOK_CLASS_NUMBER, TOK_CLASS_SPACE };
int tok_unicode_class(uint32_t cp);

#endif
