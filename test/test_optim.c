/* test_optim: learning-rate schedules (warmup, floor, each kind's shape) and
 * the optimizer step's clipping and non-finite handling, on the CPU backend. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "optim.h"
#include "test.h"

/* Schedules are computed in double and returned as float: 1e-6 relative is a
 * few float ulps, far below any real schedule error (a wrong step shifts the
 * value by a whole 1/steps). */
static int near(float a, double b) { return fabs((double)a - b) <= 1e-6 * fabs(b) + 1e-12; }

static void test_schedules(void) {
    Schedule s = {SCHED_COSINE, 1.0f, 10, 110, 0.1f, 0.2f};
    int ok = near(optim_lr(&s, 0), 0.1) && near(optim_lr(&s, 4), 0.5) && near(optim_lr(&s, 9), 1.0);
    test_report(ok, "optim_warmup_linear", "warmup lr %g %g %g", optim_lr(&s, 0), optim_lr(&s, 4), optim_lr(&s, 9));

    /* cosine: peak right after warmup, halfway at the midpoint, floor at the last step */
    ok = near(optim_lr(&s, 10), 1.0) && near(optim_lr(&s, 59), 0.1 + 0.9 * 0.5 * (1 + cos(M_PI * 49.0 / 99))) &&
         near(optim_lr(&s, 109), 0.1) && near(optim_lr(&s, 500), 0.1);
    test_report(ok, "optim_cosine_shape", "cosine lr at 10, 59, 109: %g %g %g", optim_lr(&s, 10), optim_lr(&s, 59),
                optim_lr(&s, 109));

    s.kind = SCHED_LINEAR;
    ok = near(optim_lr(&s, 10), 1.0) && near(optim_lr(&s, 109), 0.1) &&
         near(optim_lr(&s, 10 + 33), 0.1 + 0.9 * (1.0 - 33.0 / 99));
    test_report(ok, "optim_linear_shape", "linear lr %g %g", optim_lr(&s, 43), optim_lr(&s, 109));

    s.kind = SCHED_CONSTANT;
    ok = near(optim_lr(&s, 10), 1.0) && near(optim_lr(&s, 109), 1.0) && near(optim_lr(&s, 3), 0.4);
    test_report(ok, "optim_constant_shape", "constant lr %g %g", optim_lr(&s, 10), optim_lr(&s, 109));

    /* wsd: 110 steps, decay over the last 22 (steps 88..109) */
    s.kind = SCHED_WSD;
    ok = near(optim_lr(&s, 50), 1.0) && near(optim_lr(&s, 87), 1.0) && near(optim_lr(&s, 88), 1.0) &&
         near(optim_lr(&s, 109), 0.1) && near(optim_lr(&s, 88 + 7), 0.1 + 0.9 * (1.0 - 7.0 / 21));
    test_report(ok, "optim_wsd_shape", "wsd lr at 87, 95, 109: %g %g %g", optim_lr(&s, 87), optim_lr(&s, 95),
                optim_lr(&s, 109));

    /* monotone after warmup for the decaying kinds, never below the floor */
    int mono = 1;
    SchedKind kinds[3] = {SCHED_COSINE, SCHED_LINEAR, SCHED_WSD};
    for (int k = 0; k < 3; k++) {
        s.kind = kinds[k];
        for (int i = 11; i < 130; i++)
            if (optim_lr(&s, i) > optim_lr(&s, i - 1) || optim_lr(&s, i) < 0.1f * (1 - 1e-6f)) mono = 0;
    }
    test_report(mono, "optim_schedules_monotone_above_floor", "a schedule rose or fell below the floor");

    ok = optim_sched_kind("cosine") == SCHED_COSINE && optim_sched_kind("wsd") == SCHED_WSD &&
         optim_sched_kind("step") == -1;
    test_report(ok, "optim_sched_kind_names", "name lookup wrong");
}

static void test_step(void) {
    const Backend *be = &backend_cpu;
    be->init(1);
    enum { N = 40, ND = 24 };
    float *p = be->alloc(N * sizeof(float)), *g = be->alloc(N * sizeof(float));
    float hp[N], hg[N], out[N];
    for (int i = 0; i < N; i++) {
        hp[i] = 0.5f + 0.01f * i;
        hg[i] = (i % 2 ? 1.0f : -1.0f) * (0.1f + 0.02f * i);
    }
    double norm = 0.0;
    for (int i = 0; i < N; i++) norm += (double)hg[i] * hg[i];
    norm = sqrt(norm);
    be->to_device(p, hp, sizeof hp);
    be->to_device(g, hg, sizeof hg);
    AdamW o;
    optim_init(&o, be, N, ND, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f);
    OptimStepInfo info = optim_step(&o, p, g, 0.01f);
    be->to_host(out, p, sizeof out);
    /* the norm is a double sum of 40 floats: 1e-9 relative is generous */
    int ok = fabs(info.grad_norm - norm) < 1e-9 * norm && norm > 1.0 &&
             fabs(info.grad_scale - 1.0 / (norm + 1e-6)) < 1e-6;
    test_report(ok, "optim_clip_scale", "norm %g (want %g) scale %g", info.grad_norm, norm, info.grad_scale);
    /* First AdamW step: mhat/sqrt(vhat) = sign(g) exactly up to eps, so each
     * parameter moves by lr (plus lr*wd*p where decayed). 1e-6: float ulps. */
    int upd = 1;
    for (int i = 0; i < N; i++) {
        double wd = i < ND ? 0.1 : 0.0;
        double want = hp[i] - 0.01 * ((hg[i] > 0 ? 1.0 : -1.0) + wd * hp[i]);
        if (fabs(out[i] - want) > 1e-6) upd = 0;
    }
    test_report(upd, "optim_first_step_and_decay_split", "first-step update or the decay split is wrong");

    hg[3] = NAN;
    be->to_device(g, hg, sizeof hg);
    float before[N];
    be->to_host(before, p, sizeof before);
    info = optim_step(&o, p, g, 0.01f);
    be->to_host(out, p, sizeof out);
    ok = info.nonfinite && memcmp(before, out, sizeof out) == 0 && o.t == 1;
    test_report(ok, "optim_nonfinite_no_update", "nonfinite %d, t %d", info.nonfinite, o.t);
    optim_free(&o);
    be->free(p);
    be->free(g);
}

int main(void) {
    test_schedules();
    test_step();
    return 0;
}
