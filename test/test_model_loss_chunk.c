/* test_model_loss_chunk: model.loss_chunk, the output head and its
 * cross-entropy in chunks of rows, against the whole head on the same
 * weights and batches, on the CPU backend and the bf16 emulation (the GPU's
 * default dtype), with tied (GPT-2) and untied (Llama) heads, with document
 * masking (vocabulary-parallel tp is test/t_loss_chunk.sh's, under MPI), and
 * two accumulated micro-batches a step, chunks of 20 rows of 48 (20, 20, 8:
 * a short last chunk).
 *
 * Tolerances. Each row's logits and loss depend on that row alone, and so
 * does the head's input gradient, but not to the bit: OpenBLAS hands the
 * rows of one product to its threads and micro-kernels by the product's
 * height, and a row in a tail tile is summed in another order (measured on
 * this AMD EPYC: chunks of 16, 24 and 32 rows keep the bits under the
 * SkylakeX kernels, 16 and 32 lose them under Haswell's and Zen's). So two
 * partitions of the same fp32 products part by a few ulps (a C-term dot
 * product's orders differ by at most 2 gamma_C sum |x w|, ~4e-6 of its
 * magnitudes at C = 32), and the suite's equivalence tolerance for another
 * partition of the same products (docs/testing.md: tp, cp against one
 * rank) holds: losses within relative 1e-5, and every gradient tensor within
 * 1e-5 of its largest magnitude. The head weight's gradient is the sum over
 * the rows, which chunking also groups another way. A wrong chunk (an
 * offset, a stale dlogits chunk, a missed accumulation) moves these by
 * whole percents.
 *
 * Also exact: the arena holds one chunk's (rows,Vp) logits instead of the
 * whole (N,Vp), as model_activation_bytes_rank counts; a forward without
 * targets then model_logits_row (generation) computes the row's chunk on
 * demand; an evaluation forward (targets, dloss 0) gives the mean loss. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "emu_bf16.h"
#include "model.h"
#include "test.h"
#include "util.h"

enum { B = 2, T = 24, ACCUM = 2, STEPS = 1, V = 70, ROWS = 20 }; /* 48 rows: chunks 20, 20, 8 */
#include "model_trace.h"

typedef struct {
    float loss[ACCUM], rows[ACCUM][B * T], eval;
    float *grads, *logits; /* (num_params); (B*T, gshape Vp) from model_logits_row, 0 where not read */
    size_t logits_len, ab, Vp, counted; /* counted: model_activation_bytes_rank */
    size_t n, arena;
    int n_tensors;
    size_t off[64], numel[64]; /* each tensor's range of the gradient arena */
} Run;

static void run_model(const Backend *be, ArchSpec s, int tp, int docs, int loss_chunk, Run *r) {
    Model m;
    arch_resolve(&s);
    model_init(&m, be, &s, &(ModelOptions){.tp = tp, .tp_rank = tp > 1 ? 1 : 0, .doc_masking = docs,
                                           .doc_reset = docs, .doc_eot = TRACE_EOT, .loss_chunk = loss_chunk});
    ModelTp loop = {&m, trace_tp_sum, trace_tp_gather, trace_tp_scatter, trace_tp_gather_f32, NULL, NULL};
    if (tp > 1) model_set_tp(&m, &loop);
    model_init_weights(&m, 11);
    model_plan_activations(&m, B, T, MODEL_RECOMPUTE_NONE);
    r->arena = m.act_size;
    r->ab = m.act_bytes, r->Vp = (size_t)m.shape.padded_vocab;
    r->counted = model_activation_bytes_rank(&m.gshape, tp, 1, 1, 0, B, T, m.act_bytes, MODEL_RECOMPUTE_NONE, 1,
                                             loss_chunk);
    r->n = m.arena_len;
    r->n_tensors = m.num_tensors < 64 ? m.num_tensors : 64;
    for (int i = 0; i < r->n_tensors; i++) r->off[i] = m.params[i].offset, r->numel[i] = m.params[i].numel;
    size_t N = (size_t)B * T;
    int32_t inp[B * T], tgt[B * T];
    for (int k = 0; k < ACCUM; k++) {
        trace_batch(inp, tgt, 100 + (uint64_t)k);
        r->loss[k] = model_forward(&m, inp, tgt, B, T, 1.0f / (B * T * ACCUM));
        memcpy(r->rows[k], m.losses_host, N * sizeof(float));
        model_backward(&m, k > 0);
    }
    r->grads = xmalloc(r->n * sizeof(float));
    be->to_host(r->grads, m.grad_mem, r->n * sizeof(float));
    /* evaluation, then generation's rows */
    trace_batch(inp, tgt, 200);
    r->eval = model_forward(&m, inp, tgt, B, T, 0.0f);
    model_forward(&m, inp, NULL, B, T, 0.0f);
    size_t gV = (size_t)m.gshape.padded_vocab;
    r->logits_len = N * gV;
    r->logits = xcalloc(N * gV, sizeof(float));
    for (int b = B - 1; b >= 0; b--) /* from the end: each row's chunk again after another's */
        for (int t = T - 1; t >= 0; t -= 5) model_logits_row(&m, b, t, r->logits + ((size_t)b * T + t) * gV);
    model_free(&m);
}

static void run_free(Run *r) { free(r->grads), free(r->logits); }

static int near(double a, double b, double scale) { return fabs(a - b) <= 1e-5 * scale; }

static void check(const Backend *be, const char *name, ArchSpec s, int tp, int docs) {
    Run whole, chunked;
    run_model(be, s, tp, docs, 0, &whole);
    run_model(be, s, tp, docs, ROWS, &chunked);
    char n[128];
    int losses = 1;
    for (int k = 0; k < ACCUM; k++) {
        losses = losses && near(whole.loss[k], chunked.loss[k], fabs(whole.loss[k]));
        for (int i = 0; i < B * T; i++) losses = losses && near(whole.rows[k][i], chunked.rows[k][i], fabs(whole.rows[k][i]));
    }
    snprintf(n, sizeof n, "loss_chunk_losses_%s", name);
    test_report(losses, n, "losses %.9g %.9g vs %.9g %.9g", whole.loss[0], whole.loss[1], chunked.loss[0], chunked.loss[1]);
    int grads = 1;
    char worst[96] = "";
    for (int t = 0; t < whole.n_tensors; t++) {
        const float *a = whole.grads + whole.off[t], *b = chunked.grads + whole.off[t];
        double big = 0, d = 0;
        for (size_t i = 0; i < whole.numel[t]; i++) big = fmax(big, fabs(a[i])), d = fmax(d, fabs((double)a[i] - b[i]));
        if (!(d <= 1e-5 * big)) grads = 0, snprintf(worst, sizeof worst, "tensor %d: %.3g of max %.3g", t, d, big);
    }
    snprintf(n, sizeof n, "loss_chunk_grads_%s", name);
    test_report(grads, n, "%s", worst);
    double zmax = 0, zd = 0;
    for (size_t i = 0; i < whole.logits_len; i++)
        zmax = fmax(zmax, fabs(whole.logits[i])), zd = fmax(zd, fabs((double)whole.logits[i] - chunked.logits[i]));
    snprintf(n, sizeof n, "loss_chunk_eval_and_sampled_logits_%s", name);
    test_report(near(whole.eval, chunked.eval, fabs(whole.eval)) && zd <= 1e-5 * zmax && zmax > 0, n,
                "eval %.9g vs %.9g, sampled logits max diff %.3g of %.3g", whole.eval, chunked.eval, zd, zmax);
    /* the arena: (N,Vp) logits per set become one (ROWS,Vp) */
    size_t up = 64, ab = whole.ab, Vp = whole.Vp;
    size_t want = ((size_t)B * T * Vp * ab + up - 1) / up * up - ((size_t)ROWS * Vp * ab + up - 1) / up * up;
    snprintf(n, sizeof n, "loss_chunk_arena_%s", name);
    test_report(whole.arena - chunked.arena == want && chunked.arena == chunked.counted && whole.arena == whole.counted,
                n, "arena %zu -> %zu (want %zu less; counted %zu, %zu)", whole.arena, chunked.arena, want, whole.counted,
                chunked.counted);
    run_free(&whole), run_free(&chunked);
}

int main(void) {
    Backend emu = emu_bf16_backend();
    emu.init(2);
    ArchSpec gpt2 = ARCH_GPT2_SHAPE(2, 2, 32, T, V);
    ArchSpec llama = {.family = ARCH_LLAMA, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 32, .seq_len = T,
                      .vocab_size = V, .norm = NORM_RMSNORM, .pos = POS_ROPE, .rope_theta = 10000,
                      .mlp = MLP_SWIGLU, .ffn_hidden = 40};
    check(&backend_cpu, "gpt2_tied_cpu", gpt2, 1, 0);
    check(&backend_cpu, "llama_cpu", llama, 1, 0);
    check(&backend_cpu, "llama_docmask_cpu", llama, 1, 1);
    check(&emu, "gpt2_tied_bf16_emu", gpt2, 1, 0);
    check(&emu, "llama_docmask_bf16_emu", llama, 1, 1);
    emu.shutdown();
    return 0;
}
