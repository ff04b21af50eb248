/* test_ep: expert parallelism's dispatch and combine (src/ep.c) on the CPU
 * backend, Megatron's dispatcher test: route every token, dispatch its rows
 * to the ranks of its experts, run an identity expert, combine: each token
 * comes back multiplied by the sum of its kept gates; the backward returns
 * the output gradient times the same sum. A second expert that scales its
 * rows by (global expert + 1) proves each row reached its own expert. Run
 * directly it is one rank (the layer's own rows, no exchange: the harness
 * itself); test/t_ep.sh runs it under mpirun -np 2 and -np 4, where the
 * world is the ep group. Routings: random (dropless), a capacity that drops
 * slots, every slot on rank 0's experts (the other ranks receive no rows),
 * and experts that get no slot at all. Only rank 0 prints; a check fails if
 * any rank saw it fail.
 *
 * Tolerance: the combine adds K gate-scaled copies of a row in k order, in
 * fp32, exactly as the reference below does, and the exchange moves bytes;
 * so the results are equal to the reference's bits. Compared within 1e-6
 * relative all the same, should a backend's sum order ever differ. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "ep.h"
#include "model.h"
#include "test.h"
#include "util.h"

static int R, W;

static void check(const char *name, int ok, const char *why) {
    double bad = ok ? 0.0 : 1.0;
    comm_all_reduce_sum_f64(comm_world(), &bad, 1);
    char full[96];
    snprintf(full, sizeof full, "ep%d_%s", W, name);
    if (R == 0) test_report(bad == 0.0, full, "%s (on %g rank(s))", why, bad);
}

/* How slots choose experts. */
typedef enum { ROUTE_RANDOM, ROUTE_RANK0, ROUTE_SKIP } Route;

#define B 2
#define T 8
#define C 16
#define E 8
#define K 2
#define FE 8

/* The model: one MoE layer, E experts of width FE, top K; only its tables
 * and activation buffers are used. cf 0 dropless, else per-sequence capacity. */
static void build(Model *m, float cf) {
    ArchSpec s = {.family = ARCH_LLAMA, .n_layer = 1, .n_head = 2, .n_embd = C, .seq_len = T, .vocab_size = 64,
                  .norm = NORM_RMSNORM, .pos = POS_ROPE, .rope_theta = 10000, .mlp = MLP_MOE,
                  .moe = {.n_experts = E, .top_k = K, .expert_hidden = FE, .capacity_factor = cf}};
    arch_resolve(&s);
    model_init(m, &backend_cpu, &s, &(ModelOptions){.ep = W, .ep_rank = R});
    model_plan_activations(m, B, T, MODEL_RECOMPUTE_NONE);
}

/* Slot (t, k)'s expert: distinct experts per token. */
static void route(Route how, Rng *rng, int32_t *topk, float *gates) {
    int El = E / W;
    for (int t = 0; t < B * T; t++) {
        int a, b;
        do {
            switch (how) {
            case ROUTE_RANK0: /* rank 0's experts only (two of them: El >= 2) */
                a = (int)rng_below(rng, (uint64_t)El), b = (int)rng_below(rng, (uint64_t)El);
                break;
            case ROUTE_SKIP: /* never the last expert of any rank's block */
                a = (int)rng_below(rng, E), b = (int)rng_below(rng, E);
                if (a % El == El - 1 || b % El == El - 1) a = b;
                break;
            default:
                a = (int)rng_below(rng, E), b = (int)rng_below(rng, E);
            }
        } while (a == b);
        topk[t * K] = a, topk[t * K + 1] = b;
        gates[t * K] = 0.25f + 0.5f * (float)rng_uniform_double(rng);
        gates[t * K + 1] = 0.1f + 0.3f * (float)rng_uniform_double(rng);
    }
}

/* The expert applied to rows [lo, hi) of expert e: identity (tagged 0) or
 * times (e + 1). */
static void expert_apply(float *dst, const float *src, int lo, int hi, int e, int tagged) {
    float f = tagged ? (float)(e + 1) : 1.0f;
    for (size_t i = (size_t)lo * C; i < (size_t)hi * C; i++) dst[i] = f * src[i];
}

static double rel(double a, double b) { return fabs(a - b) / (fabs(b) > 1e-30 ? fabs(b) : 1e-30); }

/* One routing through forward and backward; returns the worst relative
 * error of the outputs and the input gradients, and this rank's rows. */
static void run(Model *m, Route how, int tagged, uint64_t seed, double *err_fwd, double *err_bwd, int64_t *rows_here,
                int64_t *kept) {
    const Backend *be = m->be;
    LayerActs *a = &m->acts[0];
    int N = B * T, cap = arch_moe_capacity(&m->shape, T);
    Rng rng;
    rng_seed(&rng, seed * 1000 + (uint64_t)R);
    int32_t topk[B * T * K];
    float gates[B * T * K], x[B * T * C], dout[B * T * C], out[B * T * C], dx[B * T * C];
    route(how, &rng, topk, gates);
    for (int i = 0; i < N * C; i++) x[i] = (float)rng_normal(&rng), dout[i] = (float)rng_normal(&rng);
    be->to_device(a->topk, topk, sizeof topk);
    be->to_device(a->gates, gates, sizeof gates);
    be->to_device(a->ln2, x, sizeof x);
    be->moe_dispatch(a->offsets, a->row_of, a->src, a->counts, a->topk, N, T, E, K, cap);
    be->to_host(a->offsets_host, a->offsets, (E + 1) * sizeof(int32_t));
    int32_t row_of[B * T * K];
    be->to_host(row_of, a->row_of, sizeof row_of);
    be->moe_gather(a->xp, a->ln2, a->src, a->offsets_host[E], C);
    /* forward: dispatch, the expert, combine */
    ModelExpertRows r;
    if (m->epc.dispatch) m->epc.dispatch(m->epc.ctx, 0, a->xp, a->offsets_host, &r);
    else r = (ModelExpertRows){.n = E, .off = a->offsets_host, .x = a->xp, .y = a->yp};
    for (int j = 0; j < r.n; j++) expert_apply(r.y, r.x, r.off[j], r.off[j + 1], r.e0 + j, tagged);
    *rows_here = r.off[r.n];
    if (m->epc.combine) m->epc.combine(m->epc.ctx, 0, a->yp);
    void *outd = m->scratch;
    be->moe_combine(outd, a->yp, a->gates, a->row_of, N, K, C);
    be->to_host(out, outd, sizeof out);
    /* backward: the combine's, dispatch, the expert's, combine, the gather's */
    void *dyp = be->alloc((size_t)N * K * C * sizeof(float)), *dxp = be->alloc((size_t)N * K * C * sizeof(float));
    float *dgates = be->alloc((size_t)N * K * sizeof(float));
    void *doutd = be->alloc(sizeof dout), *dxd = be->alloc(sizeof dx);
    be->to_device(doutd, dout, sizeof dout);
    be->moe_combine_backward(dyp, dgates, doutd, a->yp, a->gates, a->row_of, N, K, C);
    if (m->epc.dispatch_grad) m->epc.dispatch_grad(m->epc.ctx, 0, dyp, &r);
    else r = (ModelExpertRows){.n = E, .off = a->offsets_host, .dy = dyp, .dx = dxp};
    for (int j = 0; j < r.n; j++) expert_apply(r.dx, r.dy, r.off[j], r.off[j + 1], r.e0 + j, tagged);
    if (m->epc.combine_grad) m->epc.combine_grad(m->epc.ctx, 0, dxp);
    be->zero(dxd, sizeof dx);
    be->moe_gather_backward(dxd, dxp, a->row_of, N, K, C);
    be->to_host(dx, dxd, sizeof dx);
    /* the reference: token t times the sum of its kept gates (times e + 1) */
    *err_fwd = *err_bwd = 0;
    *kept = 0;
    for (int t = 0; t < N; t++) {
        float g = 0.0f;
        for (int k = 0; k < K; k++) {
            if (row_of[t * K + k] < 0) continue;
            g += gates[t * K + k] * (tagged ? (float)(topk[t * K + k] + 1) : 1.0f);
            ++*kept;
        }
        for (int c = 0; c < C; c++) {
            double f = rel(out[t * C + c], (double)g * x[t * C + c]), b = rel(dx[t * C + c], (double)g * dout[t * C + c]);
            if (g == 0.0f) f = fabs(out[t * C + c]), b = fabs(dx[t * C + c]); /* every slot dropped: zero */
            *err_fwd = f > *err_fwd ? f : *err_fwd, *err_bwd = b > *err_bwd ? b : *err_bwd;
        }
    }
    be->free(dyp), be->free(dxp), be->free(dgates), be->free(doutd), be->free(dxd);
}

static void scenario(const char *name, float cf, Route how) {
    Model m;
    build(&m, cf);
    Ep e;
    ep_init(&e, &m, comm_world());
    for (int tagged = 0; tagged < 2; tagged++) {
        double ef, eb;
        int64_t here, kept;
        ep_step_begin(&e);
        run(&m, how, tagged, 17 + (uint64_t)tagged, &ef, &eb, &here, &kept);
        char n[80], why[160];
        snprintf(n, sizeof n, "%s_%s", name, tagged ? "expert_scale" : "identity");
        snprintf(why, sizeof why, "rank %d: outputs off by %.3g, input gradients by %.3g (relative)", R, ef, eb);
        check(n, ef <= 1e-6 && eb <= 1e-6, why);
        /* every kept slot was run by exactly one rank's experts */
        double tot[2] = {(double)here, (double)kept};
        comm_all_reduce_sum_f64(comm_world(), tot, 2);
        snprintf(n, sizeof n, "%s_%s_rows", name, tagged ? "expert_scale" : "identity");
        snprintf(why, sizeof why, "%g rows run by the experts, %g slots kept", tot[0], tot[1]);
        check(n, tot[0] == tot[1], why);
        if (how == ROUTE_RANK0 && !tagged) {
            snprintf(why, sizeof why, "rank %d ran %lld rows; only rank 0's experts were chosen", R, (long long)here);
            snprintf(n, sizeof n, "%s_other_ranks_receive_nothing", name);
            check(n, R == 0 ? here > 0 : here == 0, why);
        }
        if (how == ROUTE_RANK0 && !tagged && e.dropless && W == 4) {
            /* rank 0 receives every rank's rows, 4 N K: past the 2 N K a
             * dropless rank starts with, so its buffers grew (and say so) */
            snprintf(why, sizeof why, "rank %d ran %lld rows, grew to %zu", R, (long long)here, e.grown_to);
            snprintf(n, sizeof n, "%s_buffers_grew", name);
            check(n, R == 0 ? e.grown_to >= (size_t)here && here == 4 * B * T * K : e.grown_to == 0, why);
        }
        if (how == ROUTE_SKIP && !tagged) {
            int El = E / W;
            const int32_t *off = W > 1 ? e.layer[0].off : m.acts[0].offsets_host;
            int j = El - 1; /* local index of the skipped expert */
            snprintf(why, sizeof why, "rank %d's last expert got %d rows", R, off[j + 1] - off[j]);
            snprintf(n, sizeof n, "%s_expert_without_rows", name);
            check(n, off[j + 1] == off[j], why);
        }
        if (W > 1) {
            EpFigures f;
            double s[64], rv[64], rw[64];
            f.sent = s, f.recv = rv, f.rows = rw;
            ep_step_figures(&e, comm_world(), &f);
            double ss = 0, rr = 0;
            for (int i = 0; i < W; i++) ss += s[i], rr += rv[i];
            snprintf(why, sizeof why, "%g rows sent to other ranks, %g received from them", ss, rr);
            snprintf(n, sizeof n, "%s_%s_sent_equals_received", name, tagged ? "expert_scale" : "identity");
            check(n, ss == rr && rw[R] == (double)here, why);
        }
    }
    ep_free(&e);
    model_free(&m);
}

int main(void) {
    comm_init(60);
    R = comm_info()->rank, W = comm_info()->world;
    if (E % W || W > 4) {
        if (R == 0) printf("skip ep%d: the %d experts need 1, 2 or 4 ranks\n", W, E);
        comm_finalize();
        return 0;
    }
    backend_cpu.init(1);
    scenario("dropless_random", 0.0f, ROUTE_RANDOM);
    /* cap = ceil(0.5 T K / E) = 1 per sequence: most slots dropped */
    scenario("capacity_random", 0.5f, ROUTE_RANDOM);
    scenario("dropless_rank0_only", 0.0f, ROUTE_RANK0);
    scenario("capacity_rank0_only", 1.0f, ROUTE_RANK0);
    scenario("dropless_skipped_experts", 0.0f, ROUTE_SKIP);
    scenario("capacity_skipped_experts", 1.0f, ROUTE_SKIP);
    comm_finalize();
    return 0;
}
