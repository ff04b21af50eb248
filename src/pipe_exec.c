/* pipe_exec: runs one rank's pipeline schedule (pipe.h) on its model: the
 * channels between stages, the step's actions in list order, the tied
 * embedding's gradient sum, and the forward-only pass of evaluation and
 * generation. Knows the model and comm; never the optimizer, the data
 * loader, ddp or metrics (the step loop reaches those through PipeHooks). */
#include <stdlib.h>
#include <string.h>

#include "pipe.h"
#include "util.h"

/* ---------------------------------------------------------------- channels */

/* Link i joins stage i and stage i + 1 mod p: activations go up it, gradients
 * down. A rank is in at most two links (below and above it), which a split
 * can not give in one call: links are split in rounds of one class each
 * (i mod 2; the wrap-around link of an odd pipeline its own), every rank in
 * at most one link of a round. */
static int link_class(int i, int p) { return p % 2 && i == p - 1 ? 2 : i % 2; }

static void split_channels(Pipe *p, PipeData d, const char *run_dir) {
    int P = p->p, r = p->stage, links = p->v > 1 ? P : P - 1;
    CommGroup *up = d == PIPE_ACT ? &p->act_out : &p->grad_in;   /* link r: to / from stage r + 1 */
    CommGroup *down = d == PIPE_ACT ? &p->act_in : &p->grad_out; /* link r - 1: from / to stage r - 1 */
    const Backend *be = p->m->be;
    for (int k = 0; k < 3; k++) {
        int below = (r + P - 1) % P, color = P + r, key = 0;
        CommGroup *into = NULL;
        if (r < links && link_class(r, P) == k) color = r, key = 0, into = up;
        else if (below < links && (r > 0 || p->v > 1) && link_class(below, P) == k) color = below, key = 1, into = down;
        char name[COMM_GROUP_NAME];
        snprintf(name, sizeof name, "pp_%s%d", d == PIPE_ACT ? "act" : "grad", into ? color : -1);
        CommGroup g;
        comm_split(p->pp, color, key, name, &g);
        if (!into) {
            comm_group_free(&g);
            continue;
        }
        *into = g;
        if (be->stream) { /* device buffers: NCCL, one communicator and stream per channel */
            comm_nccl_init(into, run_dir);
            comm_nccl_device_mode(into, be->stream());
        }
    }
}

/* The other member of a channel. */
static int peer(const CommGroup *g) { return 1 - g->rank; }

/* MPI tags: a channel's messages also match in order (pipe_check), the tag
 * only tells the kinds apart. */
static int tag_of(PipeData d, int chunk) { return (int)d * MODEL_MAX_CHUNKS + chunk; }

/* Floats of a stage's message for a B x T batch: its rows of the residual stream. */
static size_t msg_floats(const Pipe *p, int B, int T) {
    size_t bytes = (size_t)model_stage_rows(p->m, B, T) * p->m->shape.n_embd * p->m->act_bytes;
    if (bytes % sizeof(float))
        kiln_fail(KILN_EXIT_USAGE, "key 'model.n_embd': a stage's activations of %zu bytes do not travel as floats; "
                  "use an even n_embd", bytes);
    return bytes / sizeof(float);
}

/* ---------------------------------------------------------------- set-up */

void pipe_model_options(int stage, int p, int v, const int *cut, ModelOptions *o) {
    if (v > MODEL_MAX_CHUNKS)
        kiln_fail(KILN_EXIT_USAGE, "key 'parallel.pp_virtual': %d chunks per rank, at most %d", v, MODEL_MAX_CHUNKS);
    o->chunks = v > 1 ? v : 0;
    for (int c = 0; c < v; c++) o->chunk_lo[c] = cut[c * p + stage], o->chunk_hi[c] = cut[c * p + stage + 1];
    o->layer_lo = o->chunk_lo[0], o->layer_hi = o->chunk_hi[0];
}

void pipe_init(Pipe *p, Model *m, CommGroup *pp, PipeKind k, int v, int micro, const int *cut, int B, int T,
               ModelRecompute r, const char *run_dir) {
    memset(p, 0, sizeof *p);
    p->m = m, p->pp = pp, p->stage = pp->rank, p->p = pp->size, p->v = v, p->micro = micro, p->B = B, p->T = T;
    memcpy(p->cut, cut, (size_t)(p->p * v + 1) * sizeof(int));
    pipe_build(&p->sched, k, p->p, v, micro);
    char err[2048];
    if (pipe_check(&p->sched, err, sizeof err) != 0)
        kiln_fail(KILN_EXIT_RUNTIME, "rank %d: the %s schedule built for pp %d, %d chunk(s), %d micro-batches is "
                  "invalid (a bug): %s", comm_info()->rank, pipe_kind_name(k), p->p, v, micro, err);
    p->theory = pipe_theory_bubble(&p->sched);
    const PipeAction *a = p->sched.a[p->stage];
    p->last_backward = -1;
    for (int i = 0; i < p->sched.n[p->stage]; i++)
        if (a[i].op == PIPE_BWD || a[i].op == PIPE_BWD_W) p->last_backward = i;
    split_channels(p, PIPE_ACT, run_dir);
    split_channels(p, PIPE_GRAD, run_dir);
    /* Megatron's embedding group: the two copies of a tied embedding */
    p->tie = m->shape.tie_embeddings && p->p > 1;
    if (p->tie) {
        int end = p->stage == 0 || p->stage == p->p - 1;
        CommGroup g;
        comm_split(pp, end ? 0 : 1 + p->stage, p->stage, "pp_embed", &g);
        if (end) {
            p->embed = g;
            if (m->be->stream) {
                comm_nccl_init(&p->embed, run_dir);
                comm_nccl_device_mode(&p->embed, m->be->stream());
            }
        } else {
            comm_group_free(&g);
        }
    }
    int slots[MODEL_MAX_CHUNKS];
    for (int c = 0; c < v; c++) slots[c] = p->sched.slots[p->stage * v + c];
    model_plan_slots(m, B, T, r, slots, k == PIPE_ZB_H1);
    int n = m->n_slots;
    p->act_in_req = xcalloc((size_t)n, sizeof(CommRequest));
    p->grad_in_req = xcalloc((size_t)n, sizeof(CommRequest));
    p->act_out_req = xcalloc((size_t)n, sizeof(CommRequest));
    p->grad_out_req = xcalloc((size_t)n, sizeof(CommRequest));
    p->act_in_micro = xcalloc((size_t)n, sizeof(int));
    p->grad_in_micro = xcalloc((size_t)n, sizeof(int));
    p->tok = xcalloc((size_t)micro * B * T, sizeof(int32_t));
    p->tgt = xcalloc((size_t)micro * B * T, sizeof(int32_t));
}

void pipe_free(Pipe *p) {
    CommGroup *gs[] = {&p->act_out, &p->act_in, &p->grad_out, &p->grad_in, &p->embed};
    for (size_t i = 0; i < sizeof gs / sizeof gs[0]; i++)
        if (gs[i]->size) comm_group_free(gs[i]);
    pipe_schedule_free(&p->sched);
    free(p->act_in_req), free(p->grad_in_req), free(p->act_out_req), free(p->grad_out_req);
    free(p->act_in_micro), free(p->grad_in_micro);
    free(p->tok), free(p->tgt);
    memset(p, 0, sizeof *p);
}

int32_t *pipe_batch_tokens(Pipe *p, int micro) { return p->tok + (size_t)micro * p->B * p->T; }
int32_t *pipe_batch_targets(Pipe *p, int micro) { return p->tgt + (size_t)micro * p->B * p->T; }

/* ---------------------------------------------------------------- the step */

/* Wait for a request, counted as time idle for a neighbour. */
static void idle_wait(Pipe *p, CommRequest *q) {
    if (!q->active) return;
    double t0 = kiln_now();
    comm_wait(q);
    p->idle_s += kiln_now() - t0;
}

/* The receive into slot s for action a's micro-batch; the checker ran on
 * these lists, so one that was not posted is a bug. */
static CommRequest *posted(Pipe *p, CommRequest *q, const int *micro, int s, const PipeAction *a, const char *what) {
    if (micro[s] != a->micro)
        kiln_fail(KILN_EXIT_RUNTIME, "rank %d: pipeline micro-batch %d chunk %d: its %s was never received",
                  comm_info()->rank, a->micro, a->chunk, what);
    return q;
}

double pipe_step(Pipe *p, float dloss, const PipeHooks *h) {
    Model *m = p->m;
    const PipeAction *list = p->sched.a[p->stage];
    int n = p->sched.n[p->stage], V = p->p * p->v, M = p->micro;
    size_t count = msg_floats(p, p->B, p->T);
    int seen_b[MODEL_MAX_CHUNKS] = {0}, seen_w[MODEL_MAX_CHUNKS] = {0}, first = 1;
    double loss = 0;
    p->idle_s = 0;
    for (int i = 0; i < m->n_slots; i++) p->act_in_micro[i] = p->grad_in_micro[i] = -1;
    for (int i = 0; i < n; i++) {
        const PipeAction *a = &list[i];
        int vs = a->chunk * p->p + p->stage, s = m->chunk_slot0[a->chunk] + a->slot;
        int32_t *tok = pipe_batch_tokens(p, a->micro), *tgt = pipe_batch_targets(p, a->micro);
        switch (a->op) {
        case PIPE_RECV:
            if (a->data == PIPE_ACT)
                comm_irecv(&p->act_in, model_slot_input(m, a->chunk, a->slot), count, peer(&p->act_in),
                           tag_of(PIPE_ACT, a->chunk), &p->act_in_req[s]), p->act_in_micro[s] = a->micro;
            else
                comm_irecv(&p->grad_in, model_slot_output_grad(m, a->chunk, a->slot), count, peer(&p->grad_in),
                           tag_of(PIPE_GRAD, a->chunk), &p->grad_in_req[s]), p->grad_in_micro[s] = a->micro;
            break;
        case PIPE_SEND:
            /* the chunk the data goes to on the peer names the tag */
            if (a->data == PIPE_ACT)
                comm_isend(&p->act_out, model_slot_output(m, a->chunk, a->slot), count, peer(&p->act_out),
                           tag_of(PIPE_ACT, (vs + 1) / p->p), &p->act_out_req[s]);
            else
                comm_isend(&p->grad_out, model_slot_input_grad(m, a->chunk, a->slot), count, peer(&p->grad_out),
                           tag_of(PIPE_GRAD, (vs - 1) / p->p), &p->grad_out_req[s]);
            break;
        case PIPE_FWD:
            if (vs > 0) idle_wait(p, posted(p, &p->act_in_req[s], p->act_in_micro, s, a, "input activation"));
            idle_wait(p, &p->act_out_req[s]); /* the slot's last output, sent from the buffer this overwrites */
            model_use_slot(m, a->chunk, a->slot);
            if (h && h->compute_begin) h->compute_begin(h->ctx, 0, first, 0, 0);
            loss += model_forward(m, tok, vs == V - 1 ? tgt : NULL, p->B, p->T, dloss);
            break;
        case PIPE_BWD:
        case PIPE_BWD_IN:
            if (vs < V - 1) idle_wait(p, posted(p, &p->grad_in_req[s], p->grad_in_micro, s, a, "output gradient"));
            idle_wait(p, &p->grad_out_req[s]);
            idle_wait(p, &p->act_out_req[s]); /* received by now; the input part writes into its buffer */
            model_use_slot(m, a->chunk, a->slot);
            if (a->op == PIPE_BWD) {
                if (h && h->compute_begin)
                    h->compute_begin(h->ctx, 1, first, a->micro == M - 1, i == p->last_backward);
                model_backward(m, seen_b[a->chunk]++ > 0);
            } else {
                if (h && h->compute_begin) h->compute_begin(h->ctx, 1, first, 0, 0);
                model_backward_input(m, seen_b[a->chunk]++ > 0);
            }
            break;
        case PIPE_BWD_W:
            model_use_slot(m, a->chunk, a->slot);
            if (h && h->compute_begin)
                h->compute_begin(h->ctx, 1, first, a->micro == M - 1, i == p->last_backward);
            model_backward_weight(m, seen_w[a->chunk]++ > 0);
            break;
        }
        if (a->op != PIPE_SEND && a->op != PIPE_RECV) first = 0;
    }
    for (int i = 0; i < m->n_slots; i++) idle_wait(p, &p->act_out_req[i]), idle_wait(p, &p->grad_out_req[i]);
    /* the drain: this stage waits here for the slowest to finish its list */
    double t0 = kiln_now();
    comm_all_reduce_sum_f64(p->pp, &loss, 1);
    p->idle_s += kiln_now() - t0;
    return loss;
}

void pipe_tie_grads(Pipe *p) {
    if (!p->tie || !p->embed.size) return;
    Model *m = p->m;
    int i = model_tensor_index(m, -1, ROLE_TOK_EMB, -1);
    /* a + b and b + a are the same float: both copies stay equal to the bit */
    comm_all_reduce_sum(&p->embed, m->gview[i], m->params[i].numel);
}

/* ---------------------------------------------------------------- forward only */

float pipe_forward(Pipe *p, const int32_t *tokens, const int32_t *targets, int B, int T) {
    Model *m = p->m;
    int V = p->p * p->v;
    size_t count = msg_floats(p, B, T);
    float loss = 0;
    /* one virtual stage after the other; slot 0 of each chunk (no step is in flight) */
    for (int vs = 0; vs < V; vs++) {
        if (vs % p->p != p->stage) continue;
        int c = vs / p->p;
        model_use_slot(m, c, 0);
        if (vs > 0) comm_recv(&p->act_in, model_stage_input(m), count, peer(&p->act_in), tag_of(PIPE_ACT, c));
        float l = model_forward(m, tokens, vs == V - 1 ? targets : NULL, B, T, 0.0f);
        if (vs == V - 1) loss = l;
        else comm_send(&p->act_out, model_stage_output(m), count, peer(&p->act_out), tag_of(PIPE_ACT, (vs + 1) / p->p));
    }
    return loss;
}

int pipe_share_from_last(Pipe *p, int x) {
    int32_t v = x;
    comm_broadcast_bytes(p->pp, &v, sizeof v, p->p - 1);
    return v;
}

void pipe_sum(Pipe *p, double *x, size_t n) { comm_all_reduce_sum_f64(p->pp, x, n); }
