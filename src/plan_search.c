/* plan_search: ./train plan --search (plan.h "search"). Enumerates every
 * layout of N GPUs, asks the config's own checks (cfg_check_layout, the
 * mesh's mesh_plan, tp's arch_tp_check, the pipeline's pipe_check_shape and
 * stage cut) whether kiln would run it, counts its memory with the same
 * functions ./train plan and --dry-run print, and ranks what fits by
 * plan_time. Never exits on a refused layout: it is one of many. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "cp.h"
#include "hw.h"
#include "mesh.h"
#include "model.h"
#include "pipe.h"
#include "plan.h"
#include "util.h"

static int plan_divides(int64_t n, int64_t d) { return d > 0 && n % d == 0; }

/* The --set flags of a layout, and how many keys differ from the config's. */
static int plan_set_flags(const Config *base, const Config *c, char *buf, size_t n) {
    int changes = 0;
    size_t o = 0;
    /* parallel.dp always (else the rank count decides it), a change only
     * where the config fixed another */
    o += (size_t)snprintf(buf, n, "--set parallel.dp=%d", c->dp);
    changes += base->dp != 0 && c->dp != base->dp;
#define PLAN_SET_INT(key, field)                                                                                      \
    if (c->field != base->field) {                                                                                    \
        changes++;                                                                                                    \
        o += (size_t)snprintf(buf + o, o < n ? n - o : 0, " --set %s=%d", key, c->field);                            \
    }
#define PLAN_SET_STR(key, field)                                                                                      \
    if (strcmp(c->field, base->field)) {                                                                              \
        changes++;                                                                                                    \
        o += (size_t)snprintf(buf + o, o < n ? n - o : 0, " --set %s=%s", key, c->field);                            \
    }
    PLAN_SET_INT("parallel.tp", tp);
    PLAN_SET_INT("parallel.pp", pp);
    PLAN_SET_INT("parallel.cp", cp);
    PLAN_SET_INT("parallel.ep", ep);
    PLAN_SET_INT("parallel.zero", zero);
    PLAN_SET_INT("batch.micro_batch", micro_batch);
    PLAN_SET_STR("model.recompute", recompute);
    PLAN_SET_INT("model.recompute_every", recompute_every);
    if (c->loss_chunk != base->loss_chunk) {
        changes++;
        if (c->loss_chunk < 0) o += (size_t)snprintf(buf + o, o < n ? n - o : 0, " --set model.loss_chunk=auto");
        else o += (size_t)snprintf(buf + o, o < n ? n - o : 0, " --set model.loss_chunk=%d", c->loss_chunk);
    }
    PLAN_SET_STR("parallel.sequence_parallel", sequence_parallel);
    PLAN_SET_STR("parallel.cp_attention", cp_attention);
    PLAN_SET_STR("parallel.pp_schedule", pp_schedule);
    PLAN_SET_INT("parallel.pp_virtual", pp_virtual);
    if (c->n_pp_layers != base->n_pp_layers) {
        changes++;
        o += (size_t)snprintf(buf + o, o < n ? n - o : 0, " --set parallel.pp_layers=[]");
    }
#undef PLAN_SET_INT
#undef PLAN_SET_STR
    return changes;
}

typedef struct {
    const Config *base;
    const ArchSpec *s;
    const HwProfile *hw;
    int gpus, nodes;
    PlanCand *out;
    int n, cap, considered, rejected, too_big;
} PlanSearch;

int plan_evaluate(const Config *base, Config *c, const ArchSpec *s, const HwProfile *hw, int gpus, int nodes,
                  PlanCand *k, char *err, size_t errn) {
    if (cfg_check_layout(c, err, errn) != 0) return -1;
    MeshShape ms = {{c->pp, c->dp, c->cp, c->tp}, c->ep};
    if (mesh_plan(&ms, gpus, err, errn) != 0 || arch_tp_check(s, c->tp, err, errn) != 0) return -1;
    int dp = ms.size[MESH_DP];
    if (c->grad_accum % dp) {
        snprintf(err, errn, "key 'batch.total_tokens': %d micro-batches do not split over %d data-parallel ranks",
                 c->grad_accum, dp);
        return -1;
    }
    PlanRun run = {.lay = plan_layout(c, dp), .pp = c->pp, .pp_virtual = c->pp_virtual,
                   .pp_schedule = pipe_kind_parse(c->pp_schedule), .micro = c->grad_accum / dp, .gpus = gpus,
                   .nodes = nodes, .optim = c->optim_name, .ns_steps = c->ns_steps, .pp_layers = c->pp_layers,
                   .n_pp_layers = c->n_pp_layers};
    if (hw->threads > 0) run.lay.act_bytes = 4; /* the CPU backend: fp32 */
    PlanMemory mem;
    if (c->pp > 1) {
        if (plan_memory_pp(s, &run.lay, run.pp_schedule, c->pp, c->pp_virtual, c->pp_layers, c->n_pp_layers,
                           run.micro, &mem, NULL, NULL, err, errn) != 0)
            return -1;
    } else {
        mem = plan_memory_per_rank(s, &run.lay);
    }
    memset(k, 0, sizeof *k);
    k->run = run;
    k->mem = mem;
    k->time = plan_time(s, &run, hw, c->total_tokens);
    k->changes = plan_set_flags(base, c, k->set, sizeof k->set);
    return mem.total > hw->mem_bytes ? 1 : 0;
}

/* One layout of the search: kept if valid and it fits. */
static void plan_consider(PlanSearch *S, Config *c) {
    S->considered++;
    char err[1024];
    PlanCand k;
    int rc = plan_evaluate(S->base, c, S->s, S->hw, S->gpus, S->nodes, &k, err, sizeof err);
    if (rc < 0) {
        S->rejected++;
        return;
    }
    if (rc > 0) {
        S->too_big++;
        return;
    }
    if (S->n == S->cap) {
        S->cap = S->cap ? 2 * S->cap : 256;
        S->out = xrealloc(S->out, (size_t)S->cap * sizeof *S->out);
    }
    S->out[S->n++] = k;
}

static int plan_cand_cmp(const void *a, const void *b) {
    const PlanCand *x = a, *y = b;
    if (x->time.step != y->time.step) return x->time.step < y->time.step ? -1 : 1;
    if (x->mem.total != y->mem.total) return x->mem.total < y->mem.total ? -1 : 1;
    return x->changes - y->changes;
}

int plan_search(const Config *base, const ArchSpec *s, const HwProfile *hw, int gpus, int nodes, PlanCand **out,
                int *n, int *rejected, int *too_big) {
    PlanSearch S = {.base = base, .s = s, .hw = hw, .gpus = gpus, .nodes = nodes};
    Config *c = xmalloc(sizeof *c);
    /* block: every layer (recompute_every 1); selective differs from
     * norm_gelu in MoE layers only */
    static const char *recs[MODEL_RECOMPUTE_MODES] = {"none", "gelu", "norm_gelu", "block", "selective"};
    static const char *scheds[] = {"1f1b", "gpipe", "interleaved_1f1b", "zb_h1"};
    static const char *cpm[] = {"allgather", "ring"};
    int moe = s->mlp == MLP_MOE;
    int max_tp = hw->gpus_per_node; /* a tp group past a node: every collective on the NIC, never chosen */
    for (int tp = 1; tp <= gpus && tp <= max_tp; tp++) {
        if (!plan_divides(gpus, tp)) continue;
        for (int pp = 1; pp <= gpus / tp && pp <= s->n_layer; pp++) {
            if (!plan_divides(gpus / tp, pp)) continue;
            for (int cp = 1; cp <= gpus / tp / pp; cp++) {
                if (!plan_divides(gpus / tp / pp, cp) || !plan_divides(s->seq_len, 2 * cp)) continue;
                int dp = gpus / tp / pp / cp;
                /* samples per dp rank per step: micro-batches divide it */
                int64_t per = (int64_t)s->seq_len * dp;
                if (base->total_tokens % per) continue;
                int64_t samples = base->total_tokens / per;
                for (int ep = 1; ep <= (moe ? dp * cp : 1); ep++) {
                    if (moe && (!plan_divides((int64_t)dp * cp, ep) || !plan_divides(s->moe.n_experts, ep))) continue;
                    for (int zero = 0; zero <= 3; zero++)
                        for (int sp = 0; sp <= (tp > 1); sp++)
                            for (int cm = 0; cm < (cp > 1 ? 2 : 1); cm++)
                                for (int sk = 0; sk < (pp > 1 ? 4 : 1); sk++)
                                    for (int v = 1; v <= (sk == 2 ? 4 : 1); v++) { /* virtual 2, 3, 4 */
                                        if (sk == 2 && v == 1) continue;
                                        for (int r = 0; r < MODEL_RECOMPUTE_MODES; r++) {
                                            if (r == MODEL_RECOMPUTE_SELECTIVE && !moe) continue;
                                            /* micro-batches ascending: memory grows with it, so
                                             * the first that does not fit ends the row; with the
                                             * whole logits, it goes on from there with the loss in
                                             * chunks (model.loss_chunk auto: memory for one more
                                             * head product), which a smaller one needs no more */
                                            int lc = base->loss_chunk;
                                            for (int64_t mb = 1; mb <= samples && mb <= 65536; mb++) {
                                                if (samples % mb) continue;
                                                *c = *base;
                                                c->dp = dp, c->tp = tp, c->pp = pp, c->cp = cp, c->ep = ep;
                                                c->zero = zero, c->micro_batch = (int)mb;
                                                snprintf(c->recompute, sizeof c->recompute, "%s", recs[r]);
                                                c->recompute_every = 1;
                                                snprintf(c->sequence_parallel, sizeof c->sequence_parallel, "%s",
                                                         tp > 1 ? (sp ? "true" : "false") : base->sequence_parallel);
                                                if (cp > 1)
                                                    snprintf(c->cp_attention, sizeof c->cp_attention, "%s", cpm[cm]);
                                                if (pp > 1) {
                                                    snprintf(c->pp_schedule, sizeof c->pp_schedule, "%s", scheds[sk]);
                                                    c->pp_virtual = v;
                                                } else {
                                                    c->pp_virtual = 1;
                                                }
                                                if (pp != base->pp || c->pp_virtual != base->pp_virtual)
                                                    c->n_pp_layers = 0;
                                                c->loss_chunk = lc;
                                                int before = S.too_big;
                                                plan_consider(&S, c);
                                                if (S.too_big > before && lc == 0) {
                                                    c->loss_chunk = lc = -1;
                                                    before = S.too_big;
                                                    plan_consider(&S, c);
                                                }
                                                if (S.too_big > before) break;
                                            }
                                        }
                                    }
                }
            }
        }
    }
    free(c);
    if (S.n) qsort(S.out, (size_t)S.n, sizeof *S.out, plan_cand_cmp);
    *out = S.out;
    *n = S.n;
    if (rejected) *rejected = S.rejected;
    if (too_big) *too_big = S.too_big;
    return S.considered;
}

/* ---------------------------------------------------------------- output */

#define GIB (1024.0 * 1024.0 * 1024.0)

static const char *plan_rec_name(ModelRecompute r) { return model_recompute_name(r); }

void plan_cand_layout_text(const PlanCand *k, char *buf, size_t n) {
    const PlanRun *r = &k->run;
    const PlanLayout *l = &r->lay;
    snprintf(buf, n, "dp %d x tp %d%s x pp %d%s%s x cp %d%s (ep %d), ZeRO %d, micro-batch %d x %d, recompute %s", l->dp,
             l->tp, l->tp > 1 ? (l->sp ? " (sp)" : " (no sp)") : "", r->pp,
             r->pp > 1 ? " " : "", r->pp > 1 ? pipe_kind_name((PipeKind)r->pp_schedule) : "", l->cp,
             l->cp > 1 ? (l->cp_mode == CP_RING ? " ring" : " allgather") : "", l->ep, l->zero, l->micro_batch, r->micro,
             plan_rec_name(l->recompute));
    if (l->loss_chunk) {
        size_t o = strlen(buf);
        snprintf(buf + o, n > o ? n - o : 0, ", loss in chunks");
    }
    if (r->pp > 1 && r->pp_virtual > 1) {
        size_t o = strlen(buf);
        snprintf(buf + o, n > o ? n - o : 0, ", %d virtual stages", r->pp_virtual);
    }
}

/* The largest time term by which a beats b (for "why it wins"). */
static void plan_why(const PlanCand *a, const PlanCand *b, char *buf, size_t n) {
    const PlanTime *x = &a->time, *y = &b->time;
    const char *names[] = {"compute", "tp collectives", "cp exchanges", "ep all-to-alls", "pipeline bubble",
                           "pipeline messages", "exposed dp/ZeRO communication", "optimizer step"};
    double d[] = {y->compute - x->compute, y->tp - x->tp, y->cp - x->cp, y->ep - x->ep, y->bubble - x->bubble,
                  y->pp_p2p - x->pp_p2p, y->dp - x->dp, y->optim - x->optim};
    int best = 0;
    for (int i = 1; i < 8; i++)
        if (d[i] > d[best]) best = i;
    if (y->step - x->step < 1e-3 * x->step)
        snprintf(buf, n, "ties with #2 (within 0.1%% of the step); it comes first by less memory or fewer changed keys");
    else
        snprintf(buf, n, "%.1f ms faster per step than #2 (%s), mostly in %s (%.1f ms less)",
                 (y->step - x->step) * 1e3, b->set, names[best], d[best] * 1e3);
}

void plan_print_cand(const PlanCand *k, int rank, const char *config, int nodes, int per_node, const PlanCand *next) {
    char lay[256];
    plan_cand_layout_text(k, lay, sizeof lay);
    const PlanMemory *m = &k->mem;
    const PlanTime *t = &k->time;
    printf("#%d  %s\n", rank, lay);
    printf("    step %.3f s, %.0f tokens/s per GPU, MFU %.1f%%; memory %.2f GiB per rank\n", t->step,
           t->tokens_per_s_per_gpu, 100 * t->mfu, m->total / GIB);
    printf("    memory   params %.2f + grads %.2f + optim %.2f + gathered/unreduced %.2f + compute copy %.2f + "
           "activations (%s) %.2f + fp8 %.2f + overhead %.2f GiB\n", (m->params + m->params_shard) / GIB,
           m->grads / GIB, m->optim / GIB, (m->params_gathered + m->grads_unreduced) / GIB, m->compute_copy / GIB,
           m->act_bytes == 2 ? "bf16" : "fp32", m->activations / GIB,
           (double)(m->fp8.operands + m->fp8.scales + m->fp8.histories) / GIB, m->overhead / GIB);
    printf("    time     compute %.1f (recompute %.1f) + tp %.1f%s + cp %.1f + ep %.1f + bubble %.1f + pp p2p %.1f + "
           "dp %.1f of %.1f%s + optimizer %.1f ms\n", t->compute * 1e3, t->recompute * 1e3, t->tp * 1e3,
           k->run.lay.tp > 1 ? (t->tp_intra ? " (NVLink)" : " (NIC)") : "", t->cp * 1e3, t->ep * 1e3,
           t->bubble * 1e3, t->pp_p2p * 1e3, t->dp * 1e3, t->dp_total * 1e3,
           t->dp_total > 0 ? (t->dp_intra ? " (NVLink)" : " (NIC)") : "", t->optim * 1e3);
    printf("    run      ./train %s %s\n", config, k->set);
    printf("    slurm    srun --nodes=%d --ntasks-per-node=%d --gpus-per-node=%d ./train %s %s\n", nodes, per_node,
           per_node, config, k->set);
    if (next) {
        char why[1024];
        plan_why(k, next, why, sizeof why);
        printf("    why      %s\n", why);
    }
}

static void plan_json_str(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\') fprintf(f, "\\%c", ch);
        else if (ch < 0x20) fprintf(f, "\\u%04x", ch);
        else fputc(ch, f);
    }
    fputc('"', f);
}

void plan_json_cand(FILE *f, const PlanCand *k) {
    const PlanRun *r = &k->run;
    const PlanLayout *l = &r->lay;
    const PlanMemory *m = &k->mem;
    const PlanTime *t = &k->time;
    fprintf(f, "{\"dp\": %d, \"tp\": %d, \"pp\": %d, \"cp\": %d, \"ep\": %d, \"zero\": %d, \"micro_batch\": %d, "
            "\"grad_accum\": %d, \"recompute\": \"%s\", \"sequence_parallel\": %s, \"cp_attention\": \"%s\", "
            "\"pp_schedule\": \"%s\", \"pp_virtual\": %d, \"loss_chunk\": %d, \"memory_bytes\": %.0f, ",
            l->dp, l->tp, r->pp, l->cp, l->ep, l->zero, l->micro_batch, r->micro, plan_rec_name(l->recompute),
            l->sp && l->tp > 1 ? "true" : "false", l->cp_mode == CP_RING ? "ring" : "allgather",
            r->pp > 1 ? pipe_kind_name((PipeKind)r->pp_schedule) : "none", r->pp > 1 ? r->pp_virtual : 1, l->loss_chunk,
            m->total);
    fprintf(f, "\"memory\": {\"params\": %.0f, \"params_shard\": %.0f, \"params_gathered\": %.0f, \"grads\": %.0f, "
            "\"grads_unreduced\": %.0f, \"optim\": %.0f, \"compute_copy\": %.0f, \"activations\": %.0f, "
            "\"activation_bytes\": %zu, \"cp_buffers\": %.0f, \"fp8\": %.0f, \"overhead\": %.0f}, ",
            m->params, m->params_shard, m->params_gathered, m->grads, m->grads_unreduced, m->optim, m->compute_copy,
            m->activations, m->act_bytes, m->cp_buffers, (double)(m->fp8.operands + m->fp8.scales + m->fp8.histories),
            m->overhead);
    fprintf(f, "\"step_s\": %.9g, \"time\": {\"compute\": %.9g, \"recompute\": %.9g, \"tp\": %.9g, \"cp\": %.9g, "
            "\"cp_hidden\": %.9g, \"ep\": %.9g, \"bubble\": %.9g, \"pp_p2p\": %.9g, \"dp\": %.9g, \"dp_total\": %.9g, "
            "\"dp_hidden\": %.9g, \"optim\": %.9g}, \"tokens_per_s_per_gpu\": %.9g, \"mfu\": %.9g, \"set\": [",
            t->step, t->compute, t->recompute, t->tp, t->cp, t->cp_hidden, t->ep, t->bubble, t->pp_p2p, t->dp,
            t->dp_total, t->dp_hidden, t->optim, t->tokens_per_s_per_gpu, t->mfu);
    /* the flags as a list: each "key=value" after a --set */
    const char *p = k->set;
    int first = 1;
    while ((p = strstr(p, "--set "))) {
        p += 6;
        size_t len = strcspn(p, " ");
        char one[160];
        snprintf(one, sizeof one, "%.*s", (int)(len < sizeof one ? len : sizeof one - 1), p);
        if (!first) fputs(", ", f);
        plan_json_str(f, one);
        first = 0;
        p += len;
    }
    fputs("]}", f);
}

void plan_json(FILE *f, int fits, int gpus, int nodes, const HwProfile *hw, const PlanCand *k, int n,
               const char *error) {
    fprintf(f, "{\"fits\": %s, \"gpus\": %d, \"nodes\": %d, \"hardware\": {\"name\": ", fits ? "true" : "false", gpus,
            nodes);
    plan_json_str(f, hw->name);
    fprintf(f, ", \"memory_bytes\": %.0f, \"bf16_flops\": %.6g, \"gpus_per_node\": %d, \"source\": ", hw->mem_bytes,
            hw->flops_bf16, hw->gpus_per_node);
    plan_json_str(f, hw->source);
    fputs("}, ", f);
    if (error) {
        fputs("\"error\": ", f);
        plan_json_str(f, error);
        fputs(", ", f);
    }
    fputs("\"layouts\": [", f);
    for (int i = 0; i < n; i++) {
        if (i) fputs(", ", f);
        plan_json_cand(f, &k[i]);
    }
    fputs("]}\n", f);
}

/* Keep the best of each (dp, tp, pp, cp, ep, ZeRO) in place (k sorted best
 * first); returns how many remain. The rest differ only in micro-batch,
 * recompute or schedule, which the kept one already chose. */
static int plan_distinct(PlanCand *k, int n) {
    int m = 0;
    for (int i = 0; i < n; i++) {
        const PlanLayout *a = &k[i].run.lay;
        int dup = 0;
        for (int j = 0; j < m && !dup; j++) {
            const PlanLayout *b = &k[j].run.lay;
            dup = a->dp == b->dp && a->tp == b->tp && k[i].run.pp == k[j].run.pp && a->cp == b->cp &&
                  a->ep == b->ep && a->zero == b->zero;
        }
        if (!dup) k[m++] = k[i];
    }
    return m;
}

int plan_search_main(const Config *c, const ArchSpec *s, const HwProfile *hw, const char *config, int gpus,
                     int nodes, int search, int json, int top, int sets_only) {
    char err[1024];
    if (!search) { /* --json of the config's own layout */
        Config *cc = xmalloc(sizeof *cc);
        *cc = *c;
        PlanCand k;
        int rc = plan_evaluate(c, cc, s, hw, gpus, nodes, &k, err, sizeof err);
        free(cc);
        plan_json(stdout, rc == 0, gpus, nodes, hw, &k, rc < 0 ? 0 : 1, rc < 0 ? err : NULL);
        return rc == 0 ? KILN_EXIT_OK : KILN_EXIT_USAGE;
    }
    PlanCand *all = NULL;
    int n = 0, rejected = 0, too_big = 0;
    int considered = plan_search(c, s, hw, gpus, nodes, &all, &n, &rejected, &too_big);
    int fitting = n;
    n = plan_distinct(all, n);
    int shown = n < top ? n : top;
    if (sets_only) {
        if (n) /* "--set" and "key=value" alternately: the values hold no blanks */
            for (char *save = NULL, *w = strtok_r(all[0].set, " ", &save); w; w = strtok_r(NULL, " ", &save)) puts(w);
    } else if (json) {
        plan_json(stdout, n > 0, gpus, nodes, hw, all, shown, n ? NULL : "no layout fits");
    } else {
        printf("search for %s on %d GPUs (%d node%s x %d %s, %.2f GiB, %.4g TFLOP/s %s each): %d layouts, %d "
               "refused by kiln's checks, %d too big, %d fit (%d distinct dp x tp x pp x cp x ep x ZeRO)\n",
               config, gpus, nodes, nodes > 1 ? "s" : "", gpus / nodes, hw->name, hw->mem_bytes / GIB,
               hw->flops_bf16 / 1e12, hw->threads > 0 ? "fp32" : "bf16", considered, rejected, too_big, fitting, n);
        for (int i = 0; i < shown; i++) plan_print_cand(&all[i], i + 1, config, nodes, gpus / nodes, i == 0 && n > 1 ?
                                                        &all[1] : NULL);
    }
    free(all);
    if (!n) {
        fflush(stdout);
        fprintf(stderr, "kiln: error: no layout of %d GPUs fits in %.2f GiB per GPU (%d refused by kiln's checks, "
                "%d too big): use more GPUs or GPUs with more memory\n", gpus, hw->mem_bytes / GIB, rejected, too_big);
        return KILN_EXIT_USAGE;
    }
    return KILN_EXIT_OK;
}

int plan_cheapest_change(const Config *c, const ArchSpec *s, const HwProfile *hw, int gpus, int nodes, PlanCand *out) {
    PlanCand *all = NULL;
    int n = 0;
    plan_search(c, s, hw, gpus, nodes, &all, &n, NULL, NULL);
    int best = -1;
    for (int i = 0; i < n; i++) /* sorted by time: the first with the fewest changes */
        if (best < 0 || all[i].changes < all[best].changes) best = i;
    if (best >= 0) *out = all[best];
    free(all);
    return best >= 0 ? 0 : -1;
}
