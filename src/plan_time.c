/* plan_time: the time model of ./train plan (plan.h "time"). Every term is
 * arithmetic over the shape, the layout and a hardware profile; the
 * pipeline's bubble comes from kiln's own schedule lists (pipe.c), the
 * stage cut from pipe_plan_stages, the communication volumes from
 * plan_comm_per_step, so the planner and the runner cannot disagree on
 * them. The assumptions are written at each term and in docs/planner.md. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cp.h"
#include "hw.h"
#include "model.h"
#include "muon.h"
#include "pipe.h"
#include "plan.h"

double plan_collective_s(int kind, double bytes, int k, double bw, double lat) {
    if (k <= 1 || bytes <= 0) return 0;
    double f = (k - 1.0) / k;
    if (kind == 3) return lat + bytes / bw;
    if (kind == 0) {
        double ring = 2.0 * (k - 1) * lat, tree = 2.0 * ceil(log2((double)k)) * lat;
        return (ring < tree ? ring : tree) + 2 * f * bytes / bw;
    }
    return (k - 1.0) * lat + f * bytes / bw; /* NCCL's all-gather, reduce-scatter and all-to-all are rings */
}

/* A product's efficiency against the profile's large-product rate: a tile
 * of d0 along every dimension is the GPU's (CUTLASS/cuBLAS tiles of 64-256;
 * a dimension of d runs at d / (d + d0) of the rate: a tp shard's narrow
 * products and small micro-batches run slower). The CPU's OpenBLAS kernels
 * are narrower (16). */
static double plan_shape_eff(double M, double N, double K, int cpu) {
    double d0 = cpu ? 16 : 64, e = 1;
    double d[3] = {M, N, K};
    for (int i = 0; i < 3; i++) e *= d[i] / (d[i] + d0);
    return e;
}

typedef struct {
    double peak, bw, launch; /* FLOP/s (x gemm_eff), bytes/s, seconds per kernel */
    size_t ab;
    int cpu;
} PlanRate;

/* Seconds of an M x K by K x N product: the greater of its FLOPs at the
 * shape's rate and its operands' bytes at HBM speed, plus a launch. */
static double plan_mm_s(const PlanRate *r, double M, double N, double K, double peak) {
    if (M <= 0 || N <= 0 || K <= 0) return 0;
    double fl = 2 * M * N * K / (peak * plan_shape_eff(M, N, K, r->cpu));
    double by = (M * K + K * N + M * N) * (double)r->ab / r->bw;
    return (fl > by ? fl : by) + r->launch;
}

/* One layer's forward on a rank: its products, attention, and the
 * pointwise work as a pass over the layer's activation arena (written once,
 * read once); rows N of this rank (B T / cp), context T. fl: the layer's
 * forward FLOPs (model, not recomputed). */
static double plan_layer_fwd_s(const ArchSpec *l, const PlanRate *r, double peak_mm, double N, double T, int ep,
                               double act_layer_bytes, double *fl) {
    double C = l->n_embd, qw = arch_q_width(l), qkvw = arch_qkv_width(l);
    double t = 0, f = 0;
    t += plan_mm_s(r, N, qkvw, C, peak_mm) + plan_mm_s(r, N, C, qw, peak_mm);
    f += 2 * N * qkvw * C + 2 * N * C * qw;
    if (l->mlp == MLP_MOE) {
        /* the router, then E / ep local experts of N top_k ep / E rows each
         * on average (an even load: ep_buffer_bytes' worst case is memory's,
         * not time's), and the shared experts on all N rows */
        double E = l->moe.n_experts, H = l->moe.expert_hidden, rows = N * l->moe.top_k * ep / E;
        t += plan_mm_s(r, N, E, C, peak_mm);
        for (int e = 0; e < (int)(E / ep); e++)
            t += plan_mm_s(r, rows, 2 * H, C, peak_mm) + plan_mm_s(r, rows, C, H, peak_mm);
        f += 2 * N * E * C + (E / ep) * rows * 6 * H * C;
        if (l->moe.n_shared > 0) {
            double S = l->moe.n_shared * H;
            t += plan_mm_s(r, N, 2 * S, C, peak_mm) + plan_mm_s(r, N, C, S, peak_mm);
            f += 6 * N * S * C;
        }
    } else {
        double fc = arch_fc_width(l), F = l->ffn_hidden;
        t += plan_mm_s(r, N, fc, C, peak_mm) + plan_mm_s(r, N, C, F, peak_mm);
        f += 2 * N * fc * C + 2 * N * C * F;
    }
    /* causal attention: 4 N T d FLOPs halved by the mask, at 3/4 of the
     * product rate (flash attention's softmax between its two products) */
    double att = 2 * N * T * qw;
    t += att / (0.75 * peak_mm) + r->launch;
    f += att;
    t += 2 * act_layer_bytes / r->bw + 8 * r->launch; /* norms, RoPE, activations, residuals */
    *fl = f;
    return t;
}

/* Which group of the mesh stays inside a node (mesh.h: tp fastest, then cp,
 * then dp, then pp): a group of k ranks `stride` apart spans stride x k
 * consecutive ranks. */
static int plan_intra(int stride, int k, int per_node) { return k <= 1 || (long)stride * k <= per_node; }

PlanTime plan_time(const ArchSpec *g, const PlanRun *run, const HwProfile *hw, int64_t total_tokens) {
    PlanTime o = {0};
    const PlanLayout *L = &run->lay;
    int tp = L->tp, cp = L->cp, dp = L->dp, ep = g->mlp == MLP_MOE && L->ep > 1 ? L->ep : 1, pp = run->pp;
    int v = pp > 1 ? run->pp_virtual : 1, m = run->micro, G = hw->gpus_per_node;
    PlanRate rate = {.bw = hw->hbm_bw, .ab = L->act_bytes == 2 ? 2 : 4, .cpu = hw->threads > 0};
    rate.launch = rate.cpu ? 0 : 4e-6; /* a kernel's launch and tail on a GPU */
    double peak = rate.ab == 2 ? hw->flops_bf16 : hw->flops_fp32;
    double peak_mm = peak * hw->gemm_eff;
    if (L->fp8.mode != 0 && hw->flops_fp8 > 0) peak_mm = hw->flops_fp8 * hw->gemm_eff;
    o.peak = peak;
    ArchSpec l;
    arch_tp_local(g, tp, 0, &l);
    double T = g->seq_len, N = (double)L->micro_batch * T / cp, C = g->n_embd;

    /* the stage cut and the schedule's bubble (kiln's own lists) */
    int cut[PIPE_MAX_STAGES + 1];
    char err[256];
    int layers_max = g->n_layer;
    double bubble = 0;
    if (pp > 1) {
        if (pipe_plan_stages(g, pp, v, run->pp_layers, run->n_pp_layers, cut, err, sizeof err) == 0) {
            layers_max = 0;
            for (int r = 0; r < pp; r++) {
                int n = 0;
                for (int c = 0; c < v; c++) n += cut[c * pp + r + 1] - cut[c * pp + r];
                if (n > layers_max) layers_max = n;
            }
        } else {
            layers_max = (g->n_layer + pp - 1) / pp;
        }
        if (!plan_pipe_info(run->pp_schedule, pp, v, m, &bubble, err, sizeof err)) bubble = 0;
    }

    /* one layer: forward, backward (twice the products, attention's 2.5x as
     * flash attention recomputes its scores), recompute's extra pointwise */
    double act_all = (double)model_activation_bytes_rank(g, tp, cp, ep, L->sp, L->micro_batch, g->seq_len, rate.ab,
                                                         L->recompute, L->recompute_every, L->loss_chunk);
    double act_layer = act_all / g->n_layer, fl;
    double fwd = plan_layer_fwd_s(&l, &rate, peak_mm, N, T, ep, act_layer, &fl);
    double att = 2 * N * T * arch_q_width(&l) / (0.75 * peak_mm);
    double bwd = 2 * (fwd - att) + 2.5 * att;
    double rec = 0;
    if (L->recompute == MODEL_RECOMPUTE_GELU) rec = 2 * N * arch_fc_width(&l) * rate.ab / rate.bw + rate.launch;
    if (L->recompute == MODEL_RECOMPUTE_NORM_GELU || L->recompute == MODEL_RECOMPUTE_SELECTIVE)
        rec = 2 * N * (arch_fc_width(&l) + 2 * C) * rate.ab / rate.bw + 3 * rate.launch;
    /* selective, MoE: the experts' SwiGLU (read 2Fe, write Fe a routed row),
     * the shared experts' (3S a row) and, without ep, the permuted rows'
     * copy (read and write C a routed row) again */
    if (L->recompute == MODEL_RECOMPUTE_SELECTIVE && g->mlp == MLP_MOE) {
        double R = N * g->moe.top_k, Fe = g->moe.expert_hidden, S = (double)g->moe.n_shared * Fe;
        rec += (R * (3 * Fe + (ep > 1 ? 0 : 2 * C)) + N * 3 * S) * rate.ab / rate.bw + 3 * rate.launch;
    }
    /* the head and loss (last stage), the embedding (first): folded into the
     * costliest stage when pp is 1, else on the last stage beside its layers */
    double V = l.padded_vocab;
    double head = 3 * plan_mm_s(&rate, N, V, C, peak_mm) + 4 * N * V * 4 / rate.bw;
    /* block: one more forward of each checkpointed layer (every k-th), two
     * under a split backward (its weight part recomputes again; an MoE
     * layer's second is attention only, counted whole here) */
    double block = 0; /* forwards recomputed per layer, on average */
    if (L->recompute == MODEL_RECOMPUTE_BLOCK) {
        int ck = 0;
        for (int i = 0; i < g->n_layer; i++) ck += model_recompute_layer(L->recompute, L->recompute_every, i);
        block = (double)ck / g->n_layer * (pp > 1 && run->pp_schedule == PIPE_ZB_H1 ? 2 : 1);
        rec = block * fwd;
    }
    /* chunked loss: the backward makes each chunk's logits and dlogits
     * again, one more head product and its softmax pass (two under a split
     * backward, whose weight part makes them once more) */
    int split = pp > 1 && run->pp_schedule == PIPE_ZB_H1;
    double remakes = model_loss_rows(&l, (size_t)N, L->loss_chunk) ? (split ? 2 : 1) : 0;
    double head_again = remakes * (plan_mm_s(&rate, N, V, C, peak_mm) + 2 * N * V * 4 / rate.bw);
    head += head_again;
    double per_micro = layers_max * (fwd + bwd + rec) + head;
    o.compute = per_micro * m;
    o.recompute = (layers_max * rec + head_again) * m;
    o.model_flops = arch_flops_per_token(g, g->seq_len) * (double)total_tokens / run->gpus;
    /* gelu/norm_gelu recompute pointwise work only: no products repeated;
     * block its layers' forward products and attention (fl: one layer's
     * forward of this rank's N rows and tp part) */
    o.hw_flops = o.model_flops + block * fl * tp * g->n_layer / N * (double)total_tokens / run->gpus +
                 remakes * 2 * C * g->padded_vocab * (double)total_tokens / run->gpus;

    /* tensor parallelism: its collectives sit on the critical path (tp.c
     * waits for each before the next op), per micro-batch */
    o.tp_intra = plan_intra(1, tp, G);
    double tbw = o.tp_intra ? hw->intra_bw : hw->inter_bw, tlat = o.tp_intra ? hw->intra_lat : hw->inter_lat;
    if (tp > 1) {
        ArchSpec st = *g;
        st.n_layer = layers_max;
        st.seq_len = g->seq_len / cp; /* a tp group moves its cp rank's tokens only */
        PlanComm c = plan_comm_per_step(&st, tp, L->sp, 1, 1, 0, L->micro_batch, 1, rate.ab);
        double hops = L->sp ? tp - 1.0 : 2.0 * (tp - 1);
        o.tp = (c.tp / tbw + c.tp_collectives * hops * tlat) * m;
        o.tp *= 1 + block / 2; /* half a layer's collectives are its forward's */
    }
    /* context parallelism: K and V of every other rank's chunks reach each
     * rank once per layer forward, and K, V, dK, dV backward (ring: cp - 1
     * passes overlapped with the attention of the chunk in hand; all-gather:
     * one gather, not overlapped) */
    o.cp_intra = plan_intra(tp, cp, G);
    if (cp > 1) {
        double bw = o.cp_intra ? hw->intra_bw : hw->inter_bw, lat = o.cp_intra ? hw->intra_lat : hw->inter_lat;
        double kv = 2 * N * l.n_kv_head * l.head_dim * rate.ab; /* this rank's K and V */
        double pass = plan_collective_s(3, kv, 2, bw, lat);
        double layer = (cp - 1) * pass * (3 + block); /* forward 1, backward 2, block's recomputed forwards */
        double total = layer * layers_max * m;
        if (L->cp_mode == CP_RING) {
            double attn = att * 3.5 * layers_max * m; /* forward + backward attention */
            o.cp_hidden = total < attn ? total : attn;
            o.cp = total - o.cp_hidden;
        } else {
            o.cp = (3 + block) * plan_collective_s(1, kv * cp, cp, bw, lat) * layers_max * m;
        }
    }
    /* expert parallelism: four all-to-alls per MoE layer and micro-batch at
     * the routed volume, on the path */
    o.ep_intra = plan_intra(tp, ep, G);
    if (ep > 1) {
        double bw = o.ep_intra ? hw->intra_bw : hw->inter_bw, lat = o.ep_intra ? hw->intra_lat : hw->inter_lat;
        double rows = N * g->moe.top_k * rate.ab * C;
        /* block: the recomputed forward's dispatch and combine again */
        o.ep = (4.0 + 2 * (block > 1 ? 1 : block)) * layers_max * m * plan_collective_s(2, rows, ep, bw, lat);
    }
    /* the pipeline: the bubble over the busy time, and the fill and drain's
     * messages (steady-state sends overlap compute: non-blocking) */
    double busy = o.compute + o.tp + o.cp + o.ep;
    o.pp_intra = plan_intra(tp * cp * dp, pp, G);
    if (pp > 1) {
        o.bubble = busy * bubble / (1 - bubble);
        double bw = o.pp_intra ? hw->intra_bw : hw->inter_bw, lat = o.pp_intra ? hw->intra_lat : hw->inter_lat;
        double rows = L->sp && tp > 1 ? N / tp : N;
        o.pp_p2p = 2.0 * (pp * v - 1) * plan_collective_s(3, rows * C * rate.ab, 2, bw, lat);
    }
    /* data parallelism over dp x cp ranks. ZeRO 0/1: 25 MB buckets posted
     * from the last micro-batch's backward as layers finish (ddp.c), so all
     * but the embeddings' bucket hide behind that backward; ZeRO 2/3: each
     * layer's reduce-scatter (and ZeRO-3's gathers, prefetched a layer
     * ahead) overlap the next layer's compute in every micro-batch, the
     * last layer's not; ZeRO-2's all-gather after the step is exposed. */
    int k = dp * cp;
    o.dp_intra = plan_intra(tp, k, G);
    if (k > 1) {
        double bw = o.dp_intra ? hw->intra_bw : hw->inter_bw, lat = o.dp_intra ? hw->intra_lat : hw->inter_lat;
        double X = plan_expert_params(&l), P = (double)arch_num_params(&l) - X, layer_p = plan_layer_params(&l);
        if (pp > 1) P = P * layers_max / g->n_layer, X = X * layers_max / g->n_layer;
        X /= ep;
        double grads = P * 4, xg = X * 4; /* fp32 gradients */
        int edp = k / ep;
        double last_bwd = layers_max * bwd + head * 2 / 3;
        if (L->zero <= 1 || pp > 1) {
            double all = plan_collective_s(0, grads, k, bw, lat) + plan_collective_s(0, xg, edp, bw, lat);
            double emb = plan_collective_s(0, (P - layer_p * layers_max) * 4, k, bw, lat);
            if (L->zero >= 2) all += plan_collective_s(1, P * 4, k, bw, lat); /* the parameters' gather */
            o.dp_total = all;
            double hideable = all - emb;
            o.dp_hidden = hideable < last_bwd ? hideable : last_bwd;
            if (o.dp_hidden < 0) o.dp_hidden = 0;
        } else {
            double rs = plan_collective_s(1, grads, k, bw, lat) * m;
            double gather = L->zero == 3 ? 2 * plan_collective_s(1, P * 4, k, bw, lat) * m
                                         : plan_collective_s(1, P * 4, k, bw, lat);
            o.dp_total = rs + gather;
            double overlap = (L->zero == 3 ? rs + gather : rs) * (layers_max - 1.0) / layers_max;
            double cover = per_micro * m;
            o.dp_hidden = overlap < cover ? overlap : cover;
        }
        o.dp = o.dp_total - o.dp_hidden;
    }
    /* the optimizer: a memory-bound pass over the rank's state. AdamW reads
     * p, g, m, v and writes p, m, v (m and v at moment_bytes); Lion one
     * moment; Adafactor factored moments (~ p, g read, p written); plus the
     * bf16 compute copy's cast; Muon's Newton-Schulz products at the product
     * rate, spread over the dp ranks that own the matrices */
    {
        double elems = L->zero >= 1 && k > 1 ? 1.0 / k : 1;
        double all = (double)arch_num_params(&l), ns = 0;
        if (run->optim && !strcmp(run->optim, "muon")) {
            int n;
            ArchTensor *t = arch_tensors(&l, 0, &n);
            for (int i = 0; i < n; i++)
                if (t[i].layer >= 0 && t[i].ndim == 2)
                    ns += muon_ns_flops(t[i].shape[0], t[i].shape[1], run->ns_steps > 0 ? run->ns_steps : 5);
            free(t);
        }
        if (pp > 1) all = all * layers_max / g->n_layer, ns = ns * layers_max / g->n_layer;
        double mb = (double)L->moment_bytes, per;
        if (run->optim && !strcmp(run->optim, "lion")) per = 4 + 4 + 4 + 2 * mb;
        else if (run->optim && !strcmp(run->optim, "adafactor")) per = 4 + 4 + 4;
        else per = 4 + 4 + 4 + 4 * mb;
        o.optim = all * elems * per / rate.bw + (rate.ab == 2 ? all * 6 / rate.bw : 0);
        if (ns > 0) o.optim += ns / (k > 1 ? k : 1) / peak_mm;
    }
    o.step = busy + o.bubble + o.pp_p2p + o.dp + o.optim;
    o.tokens_per_s_per_gpu = (double)total_tokens / o.step / run->gpus;
    o.mfu = o.model_flops / (o.step * peak);
    return o;
}
