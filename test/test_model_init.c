/* test_model_init: model_init_weights (threads jumping to their pieces of
 * the stream; ranks drawing only what they keep) gives the bits of the
 * sequential draw it replaced (init_ref.h): every local tensor compared
 * exactly (memcmp). The values must not move: every reference, tolerance
 * and resume test was set against them. */
#include <omp.h>

#include "backend.h"
#include "init_ref.h"
#include "model.h"
#include "test.h"

/* model_init_weights of spec s under options o on `threads` threads against
 * the reference */
static void check(const char *name, ArchSpec s, ModelOptions o, int threads) {
    arch_resolve(&s);
    Model m;
    model_init(&m, &backend_cpu, &s, &o);
    omp_set_num_threads(threads);
    model_init_weights(&m, 1337);
    omp_set_num_threads(2);
    char bad[64] = "", what[96];
    snprintf(what, sizeof what, "init_%s", name);
    int all;
    float **ref = init_ref_draw(&m, 1337, &all);
    int ok = init_ref_same(&m, ref, bad, sizeof bad);
    init_ref_free(ref, all);
    test_report(ok, what, "tensor %s differs from the sequential draw", bad[0] ? bad : "(none: no tensors)");
    model_free(&m);
}

int main(void) {
    backend_cpu.init(0);
    /* c_fc 384 x 1536: 9 pieces of 2^16 values, the last short, split
     * unevenly over 3 threads; vocabulary 500 padded to 512 */
    ArchSpec gpt2 = ARCH_GPT2_SHAPE(3, 4, 384, 16, 500);
    check("gpt2_1_thread", gpt2, (ModelOptions){0}, 1);
    check("gpt2_3_threads", gpt2, (ModelOptions){0}, 3);
    /* a pipeline stage jumps over the tensors it does not hold: a middle
     * stage, the last (with the tied embedding's copy), interleaved chunks */
    check("gpt2_stage_middle", gpt2, (ModelOptions){.layer_lo = 1, .layer_hi = 2}, 2);
    check("gpt2_stage_last", gpt2, (ModelOptions){.layer_lo = 2, .layer_hi = 3}, 3);
    check("gpt2_chunks", gpt2, (ModelOptions){.chunks = 2, .chunk_lo = {0, 2}, .chunk_hi = {1, 3}}, 2);
    /* tp draws only its boxes: q, k, v row thirds, column halves (a run per
     * row) of the output projections, vocabulary rows with the padding
     * (rank 1 of 500 tokens over tp 2 keeps rows 256..499 and 12 zero rows),
     * biases; rank 2 of tp 4 alone holds rows past the vocabulary */
    for (int r = 0; r < 2; r++) {
        char name[64];
        snprintf(name, sizeof name, "gpt2_tp2_rank%d", r);
        check(name, gpt2, (ModelOptions){.tp = 2, .tp_rank = r}, 2);
    }
    check("gpt2_tp4_rank3", gpt2, (ModelOptions){.tp = 4, .tp_rank = 3}, 3);
    check("gpt2_tp2_stage", gpt2, (ModelOptions){.tp = 2, .tp_rank = 1, .layer_lo = 1, .layer_hi = 3}, 2);
    /* Llama: GQA's k and v, SwiGLU, QK-norm gains, an untied head */
    ArchSpec llama = {.family = ARCH_LLAMA, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 64, .seq_len = 16,
                      .vocab_size = 200, .norm = NORM_RMSNORM, .pos = POS_ROPE, .rope_theta = 10000,
                      .qk_norm = QKNORM_HEAD, .mlp = MLP_SWIGLU, .ffn_hidden = 96};
    check("llama", llama, (ModelOptions){0}, 3);
    check("llama_tp2_rank1", llama, (ModelOptions){.tp = 2, .tp_rank = 1}, 2);
    /* MoE: an ep rank jumps over the other ranks' experts */
    ArchSpec moe = llama;
    moe.qk_norm = QKNORM_NONE, moe.mlp = MLP_MOE;
    moe.moe = (ArchMoe){.n_experts = 4, .top_k = 2, .n_shared = 1, .expert_hidden = 32, .norm_topk = 1,
                        .capacity_factor = 1.0f, .aux_loss_coef = 0.01f, .z_loss_coef = 0.001f};
    check("moe", moe, (ModelOptions){0}, 2);
    check("moe_ep2_rank1", moe, (ModelOptions){.ep = 2, .ep_rank = 1}, 2);
    check("moe_ep2_tp2_rank0", moe, (ModelOptions){.ep = 2, .ep_rank = 0, .tp = 2, .tp_rank = 1}, 3);
    backend_cpu.shutdown();
    return 0;
}
