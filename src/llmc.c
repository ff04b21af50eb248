/* llmc: write llm.c's GPT-2 checkpoint from the tensor table (see llmc.h). */
#include "llmc.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "util.h"

const char *llmc_refusal(const ArchSpec *s) {
    if (s->family != ARCH_GPT2 || s->norm != NORM_LAYERNORM || s->pos != POS_LEARNED || s->mlp != MLP_GELU ||
        !s->bias || !s->tie_embeddings || s->qk_norm != QKNORM_NONE || s->ffn_hidden != 4 * s->n_embd ||
        s->head_dim * s->n_head != s->n_embd || s->n_kv_head != s->n_head)
        return "an llm.c checkpoint is a GPT-2 with its defaults (layernorm, learned positions, GeLU MLP of 4 "
               "n_embd, biases, a tied head, n_embd / n_head per head)";
    return NULL;
}

/* The table row of (layer, role). */
static int find(const ArchTensor *t, int n, int layer, int role) {
    for (int i = 0; i < n; i++)
        if (t[i].layer == layer && t[i].role == role) return i;
    kiln_fail(KILN_EXIT_RUNTIME, "llmc: no tensor of role %d in layer %d", role, layer);
}

void llmc_write(const ArchSpec *s, const ArchTensor *t, int n, float *const *host, const char *path) {
    const char *why = llmc_refusal(s);
    if (why) kiln_fail(KILN_EXIT_USAGE, "export --format llmc: %s", why);
    char tmp[1200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (!f) kiln_fail(KILN_EXIT_RUNTIME, "%s: cannot create: %s", tmp, strerror(errno));
    int32_t h[256] = {20240326, 3, s->seq_len, s->vocab_size, s->n_layer, s->n_head, s->n_embd, s->padded_vocab};
    int ok = fwrite(h, sizeof h, 1, f) == 1;
    /* wte (Vp, C) with its zero padding rows, wpe (T, C), then each kind over
     * the layers, then ln_f: llm.c's order */
    ok = ok && fwrite(host[find(t, n, -1, ROLE_TOK_EMB)], sizeof(float), t[find(t, n, -1, ROLE_TOK_EMB)].numel, f) ==
                   t[find(t, n, -1, ROLE_TOK_EMB)].numel;
    int pe = find(t, n, -1, ROLE_POS_EMB);
    ok = ok && fwrite(host[pe], sizeof(float), t[pe].numel, f) == t[pe].numel;
    static const int roles[12] = {ROLE_ATTN_NORM_W, ROLE_ATTN_NORM_B, ROLE_QKV_W,      ROLE_QKV_B,
                                  ROLE_O_W,         ROLE_O_B,         ROLE_MLP_NORM_W, ROLE_MLP_NORM_B,
                                  ROLE_FC_W,        ROLE_FC_B,        ROLE_DOWN_W,     ROLE_DOWN_B};
    for (int k = 0; k < 12 && ok; k++)
        for (int l = 0; l < s->n_layer && ok; l++) {
            int i = find(t, n, l, roles[k]);
            ok = fwrite(host[i], sizeof(float), t[i].numel, f) == t[i].numel;
        }
    for (int r = ROLE_FINAL_NORM_W; r <= ROLE_FINAL_NORM_B && ok; r++) {
        int i = find(t, n, -1, r);
        ok = fwrite(host[i], sizeof(float), t[i].numel, f) == t[i].numel;
    }
    ok = ok && fflush(f) == 0 && fsync(fileno(f)) == 0;
    if (fclose(f) != 0) ok = 0;
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        kiln_fail(KILN_EXIT_RUNTIME, "%s: write failed: %s", path, strerror(errno));
    }
}
