/* bench: `./train bench CONFIG` — the throughput of whole optimizer steps next
 * to the backend's own matrix-product rate at the model's shapes, measured in
 * the same process so the ratio survives a noisy, shared machine. Random
 * tokens: no data files needed. Never asserts anything about speed. */
#include "bench.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "fp8.h"
#include "model.h"
#include "optim.h"
#include "plan.h"
#include "util.h"

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* FLOP/s of the backend's matmul forward + backward over every product of one
 * micro-batch (per layer: qkv, attention proj, fc, fc proj; plus the head),
 * each timed `reps` times; total FLOPs over total median times. */
static double matmul_rate(const Backend *be, const ArchSpec *s, int N, int reps) {
    int C = s->n_embd;
    int shapes[5][2] = {{C, 3 * C}, {C, C}, {C, 4 * C}, {4 * C, C}, {C, s->padded_vocab}};
    int count[5] = {s->n_layer, s->n_layer, s->n_layer, s->n_layer, 1};
    size_t max_in = (size_t)N * 4 * C, max_out = (size_t)N * (s->padded_vocab > 4 * C ? s->padded_vocab : 4 * C);
    size_t max_w = (size_t)C * (s->padded_vocab > 4 * C ? s->padded_vocab : 4 * C);
    size_t ab = be->act_bytes(); /* operands in the activation dtype, dw fp32, as in training */
    void *inp = be->alloc(max_in * ab), *dinp = be->alloc(max_in * ab), *out = be->alloc(max_out * ab);
    void *w = be->alloc(max_w * ab);
    float *dw = be->alloc(max_w * sizeof(float));
    /* non-zero operands: some BLAS paths shortcut on zeros; one host buffer
     * (most elements) fills all three, as the weights outgrow the activations
     * when B T < C (which read past a max_out-sized buffer before) */
    size_t most = max_out > max_w ? max_out : max_w;
    most = most > max_in ? most : max_in;
    float *host = xmalloc(most * sizeof(float));
    Rng rng;
    rng_seed(&rng, 7);
    for (size_t i = 0; i < most; i++) host[i] = rng_uniform(&rng) - 0.5f;
    backend_f32_to_act(host, host, most, ab); /* in place */
    be->to_device(inp, host, max_in * ab);
    be->to_device(w, host, max_w * ab);
    be->to_device(out, host, max_out * ab);
    double flops = 0.0, seconds = 0.0;
    double *times = xmalloc((size_t)reps * sizeof(double));
    for (int k = 0; k < 5; k++) {
        int IC = shapes[k][0], OC = shapes[k][1];
        /* no bias: the rate is that of the products alone, the honest ceiling */
        be->matmul_forward(out, inp, w, NULL, N, IC, OC); /* warm-up */
        for (int r = 0; r < reps; r++) {
            be->sync();
            double t0 = kiln_now();
            be->matmul_forward(out, inp, w, NULL, N, IC, OC);
            be->matmul_backward(dinp, dw, NULL, out, inp, w, N, IC, OC, 0);
            be->sync();
            times[r] = kiln_now() - t0;
        }
        seconds += count[k] * median(times, reps);
        flops += count[k] * 6.0 * N * IC * OC;
    }
    free(times);
    free(host);
    be->free(inp), be->free(dinp), be->free(out), be->free(w), be->free(dw);
    return flops / seconds;
}

int bench_run(const Config *c, int steps) {
    ArchSpec s;
    arch_from_config(c, &s);
    const Backend *be = backend_get(c->device);
    if (!be) kiln_fail(KILN_EXIT_USAGE, "key 'device': '%s' is not available in this build", c->device);
    const char *desc = be->init(c->threads);
    backend_set_precision(be, c->compute, c->attention, c->attention_deterministic); /* precision.* */
    int B = c->micro_batch, T = c->seq_len, N = B * T;

    Model m;
    int master16 = strcmp(c->master, "bf16") == 0; /* precision.master: bf16 parameters, no fp32 arena */
    /* precision.fp8 as train.c passes it */
    ModelFp8 fp8 = plan_fp8_options(c);
    model_init(&m, be, &s, &(ModelOptions){.decay_embeddings = c->decay_embeddings, .master_bf16 = master16, .fp8 = fp8,
                                         .recompute_every = c->recompute_every, .loss_chunk = c->loss_chunk});
    m.gelu_fusion = strcmp(c->gelu_fusion, "off") != 0; /* precision.gelu_fusion */
    double init_t0 = kiln_now();
    /* training's initial values, timed: the host's draw (all threads) plus the copy to the device */
    model_init_weights(&m, c->seed);
    double init_s = kiln_now() - init_t0;
    model_plan_activations(&m, B, T, model_recompute_parse(c->recompute));
    AdamW opt;
    /* precision.optim_state and precision.master as a run has them (train.c) */
    optim_init_shard_dtype(&opt, be, m.num_params, m.num_decay, 0, m.num_params, c->beta1, c->beta2, c->eps,
                           c->weight_decay, c->grad_clip, optim_state_bytes(c->optim_state) == 2,
                           optim_round_seed(c->seed));
    if (master16) optim_set_params_bf16(&opt);
    if (optim_kind(c->optim_name) == OPTIM_LION) optim_set_lion(&opt, c->lion_beta1, c->lion_beta2);
    /* a one-rank run's step (train.c): the losses, norm, clipping factor and
     * skip flag stay on the device (one host wait per step, its read), and
     * the update writes the compute copy where there is one to cast */
    int fused = optim_set_copy(&opt, model_compute_copy(&m));
    model_set_loss_sink(&m, &optim_scalars(&opt)->loss);

    int32_t *inp = xmalloc((size_t)N * sizeof(int32_t)), *tgt = xmalloc((size_t)N * sizeof(int32_t));
    Rng rng;
    rng_seed(&rng, c->seed);
    double *times = xmalloc((size_t)(steps + 1) * sizeof(double));
    float dloss = 1.0f / (float)((size_t)N * c->grad_accum);
    float loss = 0.0f;
    /* The ceiling is measured before and after the steps and the faster
     * reading kept: on a shared machine a slow reading would flatter the
     * ratio. */
    double mm_before = matmul_rate(be, &s, N, 5);
    /* step 0 is a warm-up (page faults, BLAS buffers) and is not counted */
    unsigned long syncs = 0; /* the steps' own host waits, not the two that time them */
    int64_t moe_reads = 0;   /* of which MoE routing's reads (ModelMoeStats.host_reads) */
    for (int step = 0; step <= steps; step++) {
        be->sync();
        double t0 = kiln_now();
        unsigned long s0 = be->host_syncs ? be->host_syncs() : 0;
        int64_t r0 = m.moe.host_reads;
        for (int micro = 0; micro < c->grad_accum; micro++) {
            for (int i = 0; i < N; i++) {
                inp[i] = (int32_t)rng_below(&rng, (uint64_t)s.vocab_size);
                tgt[i] = (int32_t)rng_below(&rng, (uint64_t)s.vocab_size);
            }
            model_forward(&m, inp, tgt, B, T, dloss);
            model_backward(&m, micro > 0);
        }
        optim_step_device(&opt, model_param_arena(&m), m.grad_mem, c->lr, c->grad_accum, &loss);
        if (!fused) model_params_changed(&m);
        if (step > 0 && be->host_syncs) syncs += be->host_syncs() - s0;
        if (step > 0) moe_reads += m.moe.host_reads - r0;
        be->sync();
        times[step] = kiln_now() - t0;
    }
    double step_s = median(times + 1, steps);
    double tokens = (double)c->total_tokens;
    double fpt = arch_flops_per_token(&s, T);
    double step_gflops = fpt * tokens / step_s / 1e9;
    double mm_after = matmul_rate(be, &s, N, 5);
    double mm_gflops = (mm_before > mm_after ? mm_before : mm_after) / 1e9;
    printf("bench %s: %s | %s %s, %d layers, %d wide, B=%d T=%d, %d micro-batch(es)/step, loss %.3f\n", c->run_name,
           desc, arch_family_name(s.family), arch_mlp_name(s.mlp), s.n_layer, s.n_embd, B, T, c->grad_accum, loss);
    if (s.mlp == MLP_MOE)
        printf("bench: moe %d experts top %d, %zu of %zu parameters active per token\n", s.moe.n_experts,
               s.moe.top_k, arch_num_active_params(&s), arch_num_params(&s));
    printf("bench: step %.3f s (median of %d) | matmul %.1f GFLOP/s at the model's shapes\n", step_s, steps,
           mm_gflops);
    printf("bench: tok_per_s=%.1f step_gflops=%.1f sgemm_gflops=%.1f ratio=%.3f\n", tokens / step_s, step_gflops,
           mm_gflops, step_gflops / mm_gflops);
    if (be->host_syncs) printf("bench: host_syncs_per_step=%.1f\n", (double)syncs / steps);
    if (be->host_syncs && s.mlp == MLP_MOE) /* dropless routing sizes its products on the host */
        printf("bench: moe_host_reads_per_step=%.1f (of the host syncs)\n", (double)moe_reads / steps);
    printf("bench: fused_copy=%s\n", fused ? "on" : m.act_bytes == 4 || master16 ? "not_needed" : "off");
    printf("bench: init_s=%.2f (%zu parameters)\n", init_s, m.num_params);
    if (be->memory_peak) printf("bench: peak_mem_gib=%.2f\n", be->memory_peak() / 1073741824.0);
    printf("bench: master=%s optim_state=%s fp8=%s%s\n", master16 ? "bf16" : "fp32", c->optim_state, c->fp8,
           model_fp8_tensor_cores(&m) ? " (fp8 tensor cores)" : "");
    int timed = optim_kind(c->optim_name) == OPTIM_LION ? OPTIM_LION : OPTIM_ADAMW;
    printf("bench: optim=%s%s\n", timed == OPTIM_LION ? "lion" : "adamw",
           optim_kind(c->optim_name) == timed ? ""
                                              : " (optim.name muon and adafactor run through muon.c and adafactor.c: "
                                                "their step times come from training runs, docs/optimizers.md)");
    printf("bench: gelu_fusion=%s\n", model_gelu_fused(&m, 0) || model_gelu_fused(&m, 1) ? "on"
                                       : m.gelu_fusion ? "not_offered" : "off");
    /* the residual add done by the norm after it (docs/gpu.md); no switch: same bits */
    printf("bench: residual_norm_fusion=%s\n", be->residual_norm_forward ? "on" : "not_offered");
    free(inp), free(tgt), free(times);
    optim_free(&opt);
    model_free(&m);
    return KILN_EXIT_OK;
}
