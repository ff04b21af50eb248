/* hf_tool: what test/t_hf_interop.sh asks of kiln's side. Builds the model of
 * CONFIG.yaml on the CPU backend, loads INIT_FROM through init.from's chain
 * (kiln checkpoint, HF directory, llm.c file), then:
 *   --logits OUT.bin TOK...  forward one sequence, write (T, vocab_size) fp32 logits
 *   --dump OUT.safetensors   every parameter under its kiln name, padded rows included
 *   --export DIR             the model as an HF directory (hf_write_dir)
 *   --greedy OUT N TOK...    N tokens of greedy decoding after TOK... (each step the whole
 *                            sequence again, as HF's generate without a cache computes it):
 *                            one line per token, "id gap" with gap the distance from the
 *                            best logit to the second (a near tie may go either way)
 * With --stage LO HI first (before the mode) the model is the pipeline stage
 * of layers [LO, HI) (--dump then writes that stage's tensors).
 * usage: hf_tool CONFIG.yaml INIT_FROM [--stage LO HI] (--logits OUT TOK... | --dump OUT | --export DIR | --greedy ...) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arch.h"
#include "backend.h"
#include "config.h"
#include "hf.h"
#include "model.h"
#include "safetensors.h"
#include "state.h"
#include "util.h"

int main(int argc, char **argv) {
    if (argc < 5) kiln_fail(KILN_EXIT_USAGE, "usage: hf_tool CONFIG.yaml INIT_FROM --logits OUT TOK... | --dump OUT | --export DIR");
    Config c;
    cfg_load(&c, argv[1], NULL, 0);
    ArchSpec s;
    arch_from_config(&c, &s);
    ModelOptions o = {0};
    if (argc > 6 && !strcmp(argv[3], "--stage")) {
        o.layer_lo = atoi(argv[4]), o.layer_hi = atoi(argv[5]);
        memmove(argv + 3, argv + 6, (size_t)(argc - 6 + 1) * sizeof *argv); /* the mode's arguments move up */
        argc -= 3;
    }
    Model m;
    model_init(&m, backend_get("cpu"), &s, &o);
    state_load_init_from(&m, argv[2], 0);
    const char *mode = argv[3], *out = argv[4];
    float *all = xmalloc(m.num_params * sizeof(float));
    model_params_to_host(&m, all);
    if (!strcmp(mode, "--logits")) {
        int T = argc - 5;
        if (T < 1 || T > s.seq_len) kiln_fail(KILN_EXIT_USAGE, "--logits: 1 to %d tokens", s.seq_len);
        int32_t *tok = xmalloc((size_t)T * sizeof *tok);
        for (int t = 0; t < T; t++) tok[t] = atoi(argv[5 + t]);
        model_plan_activations(&m, 1, T, MODEL_RECOMPUTE_NONE);
        model_forward(&m, tok, NULL, 1, T, 0);
        float *row = xmalloc((size_t)s.padded_vocab * sizeof *row);
        FILE *f = fopen(out, "wb");
        if (!f) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot create", out);
        for (int t = 0; t < T; t++) {
            model_logits_row(&m, 0, t, row);
            fwrite(row, sizeof *row, (size_t)s.vocab_size, f);
        }
        fclose(f);
        free(row), free(tok);
    } else if (!strcmp(mode, "--greedy")) {
        int N = argc > 5 ? atoi(argv[5]) : 0, T0 = argc - 6;
        if (N < 1 || T0 < 1 || T0 + N > s.seq_len)
            kiln_fail(KILN_EXIT_USAGE, "--greedy OUT N TOK...: N >= 1, at least one token, at most %d in all", s.seq_len);
        int32_t *tok = xmalloc((size_t)(T0 + N) * sizeof *tok);
        for (int t = 0; t < T0; t++) tok[t] = atoi(argv[6 + t]);
        model_plan_activations(&m, 1, T0 + N, MODEL_RECOMPUTE_NONE);
        float *row = xmalloc((size_t)s.padded_vocab * sizeof *row);
        FILE *f = fopen(out, "w");
        if (!f) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot create", out);
        for (int i = 0; i < N; i++) {
            int T = T0 + i;
            model_forward(&m, tok, NULL, 1, T, 0);
            model_logits_row(&m, 0, T - 1, row);
            int best = 0;
            for (int v = 1; v < s.vocab_size; v++)
                if (row[v] > row[best]) best = v;
            float second = -INFINITY;
            for (int v = 0; v < s.vocab_size; v++)
                if (v != best && row[v] > second) second = row[v];
            fprintf(f, "%d %.9g\n", best, row[best] - second);
            tok[T] = best;
        }
        fclose(f);
        free(row), free(tok);
    } else if (!strcmp(mode, "--dump")) {
        StWrite *w = xcalloc((size_t)m.num_tensors, sizeof *w);
        for (int i = 0; i < m.num_tensors; i++) {
            const ParamInfo *p = &m.params[i];
            w[i] = (StWrite){.name = p->name, .dtype = ST_F32, .ndim = p->ndim, .shape = {p->shape[0], p->shape[1]},
                             .data = all + p->offset};
        }
        char err[1400];
        if (st_write(out, w, m.num_tensors, err, sizeof err) != 0) kiln_fail(KILN_EXIT_RUNTIME, "%s", err);
        free(w);
    } else if (!strcmp(mode, "--export")) {
        int n;
        ArchTensor *t = arch_tensors(&s, 0, &n);
        float **host = xcalloc((size_t)n, sizeof *host);
        for (int i = 0; i < n; i++) host[i] = all + model_find_param(&m, t[i].name)->offset;
        hf_write_dir(&s, t, n, host, out, ST_F32, 0);
        free(host), free(t);
    } else kiln_fail(KILN_EXIT_USAGE, "hf_tool: unknown mode '%s'", mode);
    free(all);
    model_free(&m);
    return 0;
}
