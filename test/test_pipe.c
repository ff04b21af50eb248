/* test_pipe: the pipeline schedules as data (src/pipe.c). Every schedule over
 * a grid of (pp, pp_virtual, micro-batches) builds lists the checker
 * accepts, with the activation slots its memory claim says and the bubble
 * its formula says; shapes a schedule cannot run are refused; hand-made
 * broken schedules (a send and a receive out of channel order, a backward
 * before its forward, a deadlock, a compute before its receive is posted, a
 * slot reused while in use, a send with no receive) are rejected naming the
 * rank and the action; the stage cuts balance the cost; the text timeline of
 * a small 1F1B is the textbook one. No MPI, no model. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pipe.h"
#include "test.h"
#include "util.h"

/* The unit-cost simulation adds whole numbers of time units: 1F1B's bubble
 * (p-1)/(m+p-1) comes out exact up to the division's rounding. */
#define TOL_EXACT 1e-12

static int grid_case(PipeKind k, int p, int v, int m, char *why, size_t n) {
    PipeSchedule s;
    pipe_build(&s, k, p, v, m);
    char err[1024];
    int rc = 0;
    if (pipe_check(&s, err, sizeof err) != 0) {
        snprintf(why, n, "%s pp %d v %d m %d: %s", pipe_kind_name(k), p, v, m, err);
        rc = -1;
    }
    double b = pipe_theory_bubble(&s), b1 = (double)(p - 1) / (m + p - 1);
    /* memory: 1F1B holds at most pp - r micro-batches on rank r (pp on the
     * first), zb_h1 at most pp anywhere (1F1B's peak); gpipe all of them */
    for (int r = 0; r < p && rc == 0; r++) {
        int most = s.slots[r * v], want = k == PIPE_1F1B ? (p - r < m ? p - r : m) : k == PIPE_ZB_H1 ? (p < m ? p : m)
                                                                                  : k == PIPE_GPIPE ? m : -1;
        if (want >= 0 && (k == PIPE_1F1B || k == PIPE_GPIPE ? most != want : most > want)) {
            snprintf(why, n, "%s pp %d m %d: rank %d holds %d slots, expected %s%d", pipe_kind_name(k), p, m, r, most,
                     k == PIPE_ZB_H1 ? "at most " : "", want);
            rc = -1;
        }
    }
    if (rc == 0 && (k == PIPE_1F1B || k == PIPE_GPIPE) && fabs(b - b1) > TOL_EXACT) {
        snprintf(why, n, "%s pp %d m %d: bubble %.6f, (p-1)/(m+p-1) = %.6f", pipe_kind_name(k), p, m, b, b1);
        rc = -1;
    }
    /* interleaving shrinks the bubble; zb_h1's is about a third of 1F1B's
     * idle time (exactly (p-1) units of F + B - W against (p-1)(F + B + W)
     * once m >= p; fewer micro-batches leave less to fill) */
    if (rc == 0 && k == PIPE_INTERLEAVED && !(b < b1)) {
        snprintf(why, n, "interleaved pp %d v %d m %d: bubble %.4f, not below 1F1B's %.4f", p, v, m, b, b1);
        rc = -1;
    }
    if (rc == 0 && k == PIPE_ZB_H1) {
        /* idle units per rank: zb's step is 3m + idle, 1F1B's 3m + 3(p-1) */
        double idle = b * 3 * m / (1 - b), want = p - 1;
        if (m >= p && fabs(idle - want) > 1e-9) {
            snprintf(why, n, "zb_h1 pp %d m %d: %.3f idle units per rank, expected p - 1 = %.0f", p, m, idle, want);
            rc = -1;
        } else if (!(idle <= 3.0 * (p - 1) + 1e-9)) {
            snprintf(why, n, "zb_h1 pp %d m %d: %.3f idle units per rank, more than 1F1B's %d", p, m, idle,
                     3 * (p - 1));
            rc = -1;
        }
    }
    pipe_schedule_free(&s);
    return rc;
}

static void test_grid(void) {
    static const int pps[] = {2, 3, 4, 5, 8}, ms[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32};
    static const PipeKind kinds[] = {PIPE_GPIPE, PIPE_1F1B, PIPE_INTERLEAVED, PIPE_ZB_H1};
    for (int ki = 0; ki < 4; ki++) {
        int cases = 0, bad = 0;
        char why[1200] = "";
        for (size_t pi = 0; pi < sizeof pps / sizeof pps[0]; pi++)
            for (int v = 1; v <= 4; v++)
                for (size_t mi = 0; mi < sizeof ms / sizeof ms[0]; mi++) {
                    char err[512];
                    if (pipe_check_shape(kinds[ki], pps[pi], v, ms[mi], err, sizeof err) != 0) continue;
                    cases++;
                    if (grid_case(kinds[ki], pps[pi], v, ms[mi], bad ? err : why, bad ? sizeof err : sizeof why)) bad++;
                }
        char name[64];
        snprintf(name, sizeof name, "pipe_grid_%s", pipe_kind_name(kinds[ki]));
        test_report(bad == 0 && cases >= 20, name, "%d of %d shapes failed; first: %s", bad, cases, why);
    }
}

static void test_shapes(void) {
    char err[512];
    int r1 = pipe_check_shape(PIPE_INTERLEAVED, 4, 2, 6, err, sizeof err);
    test_report(r1 != 0 && strstr(err, "multiple of pp = 4"), "pipe_refuses_interleaved_indivisible", "%s", err);
    int r2 = pipe_check_shape(PIPE_INTERLEAVED, 2, 1, 4, err, sizeof err);
    test_report(r2 != 0 && strstr(err, "parallel.pp_virtual"), "pipe_refuses_interleaved_v1", "%s", err);
    int r3 = pipe_check_shape(PIPE_1F1B, 2, 2, 4, err, sizeof err);
    test_report(r3 != 0 && strstr(err, "interleaved_1f1b"), "pipe_refuses_virtual_without_interleaving", "%s", err);
    int r4 = pipe_check_shape(PIPE_ZB_H1, 1, 1, 4, err, sizeof err);
    test_report(r4 != 0 && strstr(err, "parallel.pp"), "pipe_refuses_one_stage", "%s", err);
    /* 1F1B and zb_h1 take any count, also fewer than pp and not a multiple */
    int ok = pipe_check_shape(PIPE_1F1B, 4, 1, 3, err, sizeof err) == 0 &&
             pipe_check_shape(PIPE_ZB_H1, 4, 1, 7, err, sizeof err) == 0;
    test_report(ok, "pipe_accepts_counts_not_multiple_of_pp", "%s", err);
}

/* A hand-made schedule of chunk 0 on pp ranks from one string per rank:
 * F3 B3 b3 (input part) W3, >a3 >g3 (send act / grad), <a3 <g3 (receive);
 * slots(m) = m % K. Peers follow from the direction. */
static void hand(PipeSchedule *s, PipeKind k, int pp, int m, int K, const char *const *lists) {
    memset(s, 0, sizeof *s);
    s->kind = k, s->pp = pp, s->v = 1, s->micro = m;
    s->n = xcalloc((size_t)pp, sizeof(int));
    s->a = xcalloc((size_t)pp, sizeof(PipeAction *));
    s->slots = xcalloc((size_t)pp, sizeof(int));
    for (int r = 0; r < pp; r++) {
        s->slots[r] = K;
        s->a[r] = xcalloc(256, sizeof(PipeAction));
        const char *p = lists[r];
        while (*p) {
            while (*p == ' ') p++;
            if (!*p) break;
            PipeAction a = {0};
            if (*p == '>' || *p == '<') {
                a.op = *p == '>' ? PIPE_SEND : PIPE_RECV;
                a.data = p[1] == 'a' ? PIPE_ACT : PIPE_GRAD;
                int next = (a.op == PIPE_SEND) == (a.data == PIPE_ACT);
                a.peer = next ? r + 1 : r - 1;
                p += 2;
            } else {
                a.op = *p == 'F' ? PIPE_FWD : *p == 'B' ? PIPE_BWD : *p == 'b' ? PIPE_BWD_IN : PIPE_BWD_W;
                p++;
            }
            a.micro = (int)strtol(p, (char **)&p, 10);
            a.slot = a.micro % K;
            s->a[r][s->n[r]++] = a;
        }
    }
}

static void expect_reject(const char *name, PipeKind k, int pp, int m, int K, const char *const *lists,
                          const char *want1, const char *want2) {
    PipeSchedule s;
    hand(&s, k, pp, m, K, lists);
    char err[1024] = "";
    int rc = pipe_check(&s, err, sizeof err);
    test_report(rc != 0 && strstr(err, want1) && (!want2 || strstr(err, want2)), name, "rc %d: '%s' (wanted '%s'%s%s)",
                rc, err, want1, want2 ? " and '" : "", want2 ? want2 : "");
    pipe_schedule_free(&s);
}

static void test_broken(void) {
    /* the valid 1F1B of 2 ranks and 2 micro-batches, as the hand notation */
    const char *good[] = {"F0 >a0 <g0 F1 >a1 <g1 B0 B1", "<a0 <a1 F0 B0 >g0 F1 B1 >g1"};
    PipeSchedule s;
    hand(&s, PIPE_1F1B, 2, 2, 2, good);
    char err[1024] = "";
    test_report(pipe_check(&s, err, sizeof err) == 0, "pipe_hand_schedule_valid", "%s", err);
    pipe_schedule_free(&s);
    /* rank 0 sends micro-batch 1's activation before 0's; rank 1 receives 0 first */
    const char *swapped[] = {"F0 F1 >a1 >a0 <g0 <g1 B0 B1", "<a0 <a1 F0 B0 >g0 F1 B1 >g1"};
    expect_reject("pipe_rejects_swapped_send_recv", PIPE_1F1B, 2, 2, 2, swapped, "rank 0, action 2 (send act m1",
                  "same order");
    const char *early[] = {"F0 >a0 <g0 F1 >a1 <g1 B0 B1", "<a0 <a1 B0 F0 >g0 F1 B1 >g1"};
    expect_reject("pipe_rejects_backward_before_forward", PIPE_1F1B, 2, 2, 2, early, "rank 1, action 2 (B m0 c0)",
                  "before its forward");
    /* rank 0 waits for micro-batch 0's gradient before sending micro-batch 1,
     * which rank 1 needs before it sends that gradient */
    const char *dead[] = {"F0 >a0 <g0 B0 F1 >a1 <g1 B1", "<a0 <a1 F0 F1 B0 >g0 B1 >g1"};
    expect_reject("pipe_rejects_deadlock", PIPE_1F1B, 2, 2, 2, dead, "deadlocks", "rank 0 at action 3 (B m0 c0)");
    const char *unposted[] = {"F0 >a0 <g0 F1 >a1 <g1 B0 B1", "F0 <a0 <a1 B0 >g0 F1 B1 >g1"};
    expect_reject("pipe_rejects_use_before_receive", PIPE_1F1B, 2, 2, 2, unposted, "rank 1, action 0 (F m0 c0)",
                  "before any receive");
    /* one slot per rank, but rank 0 runs micro-batch 1's forward before 0's backward */
    expect_reject("pipe_rejects_slot_in_use", PIPE_1F1B, 2, 2, 1, good, "rank 0, action 3 (F m1 c0)", "still holds");
    const char *lost[] = {"F0 >a0 <g0 F1 <g1 B0 B1", "<a0 <a1 F0 B0 >g0 F1 B1 >g1"};
    expect_reject("pipe_rejects_missing_send", PIPE_1F1B, 2, 2, 2, lost, "rank 0", "send of its activation");
    const char *nosplit[] = {"F0 >a0 <g0 F1 >a1 <g1 B0 B1", "<a0 <a1 F0 b0 >g0 W0 F1 B1 >g1"};
    expect_reject("pipe_rejects_split_in_whole_schedule", PIPE_1F1B, 2, 2, 2, nosplit, "rank 1, action 3", "one whole");
    const char *wfirst[] = {"F0 >a0 <g0 F1 >a1 <g1 b0 W0 b1 W1", "<a0 <a1 F0 W0 b0 >g0 F1 b1 >g1 W1"};
    expect_reject("pipe_rejects_weight_before_input", PIPE_ZB_H1, 2, 2, 2, wfirst, "rank 1, action 3 (B-weight m0",
                  "before its input");
}

static void test_stages(void) {
    char err[512];
    int cut[PIPE_MAX_STAGES + 1];
    /* GPT-2 124M: the head costs about five layers, so the last stage gets fewer */
    ArchSpec g = {.family = ARCH_GPT2, .n_layer = 12, .n_head = 12, .n_embd = 768, .seq_len = 1024,
                  .vocab_size = 50257, .norm = NORM_LAYERNORM, .pos = POS_LEARNED, .mlp = MLP_GELU, .bias = 1,
                  .tie_embeddings = 1};
    arch_resolve(&g);
    int rc = pipe_plan_stages(&g, 4, 1, NULL, 0, cut, err, sizeof err);
    int ok = rc == 0 && cut[0] == 0 && cut[4] == 12;
    for (int i = 0; ok && i < 4; i++) ok = cut[i + 1] > cut[i];
    ok = ok && cut[4] - cut[3] < 3; /* fewer than an even 3 on the last */
    test_report(ok, "pipe_stages_balanced_by_cost", "rc %d %s: cut %d %d %d %d %d", rc, err, cut[0], cut[1], cut[2],
                cut[3], cut[4]);
    rc = pipe_plan_stages(&g, 2, 2, (int[]){4, 3, 3, 2}, 4, cut, err, sizeof err);
    test_report(rc == 0 && cut[1] == 4 && cut[2] == 7 && cut[3] == 10 && cut[4] == 12, "pipe_stages_by_hand",
                "rc %d %s", rc, err);
    rc = pipe_plan_stages(&g, 2, 1, (int[]){6, 5}, 2, cut, err, sizeof err);
    test_report(rc != 0 && strstr(err, "parallel.pp_layers") && strstr(err, "11"), "pipe_stages_refuses_bad_sum", "%s",
                err);
    rc = pipe_plan_stages(&g, 8, 2, NULL, 0, cut, err, sizeof err);
    test_report(rc != 0 && strstr(err, "at least one layer"), "pipe_stages_refuses_too_few_layers", "%s", err);
}

static void test_timeline(void) {
    PipeSchedule s;
    pipe_build(&s, PIPE_1F1B, 2, 1, 3);
    char *t = pipe_timeline(&s);
    /* forward 1 unit, backward 2: the textbook 1F1B of 2 stages, 3 micro-batches */
    const char *want = "rank 0 | F0 F1 .  .  B0 B0 F2 B1 B1 .  B2 B2 \n"
                       "rank 1 | .  F0 B0 B0 F1 B1 B1 F2 B2 B2 .  .  \n";
    test_report(!strcmp(t, want), "pipe_timeline_1f1b", "got\n%s", t);
    free(t);
    pipe_schedule_free(&s);
    pipe_build(&s, PIPE_ZB_H1, 2, 1, 3);
    t = pipe_timeline(&s);
    /* input part 1, weight part 1: the W's fill the bubbles, 10 units against 1F1B's 12 */
    const char *zb = "rank 0 | F0 F1 .  B0 W0 F2 B1 W1 B2 W2 \n"
                     "rank 1 | .  F0 B0 F1 B1 W0 F2 B2 W1 W2 \n";
    test_report(!strcmp(t, zb), "pipe_timeline_zb_h1", "got\n%s", t);
    free(t);
    pipe_schedule_free(&s);
}

int main(void) {
    test_grid();
    test_shapes();
    test_broken();
    test_stages();
    test_timeline();
    return 0;
}
