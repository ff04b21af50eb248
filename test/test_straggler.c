/* test_straggler: rank 0's judgement of who is slow (src/straggler.c) on
 * made-up timings, no MPI: busy time = step minus blocked time; the slowest
 * against the median of the others; the factor, the minimum excess and the
 * streak that makes a warning, once per streak. One line per check. */
#include <math.h>
#include <string.h>

#include "straggler.h"
#include "test.h"

/* Four ranks of a synchronous job: every step takes `step` s; rank r computes
 * busy[r] s and waits the rest in the dp group. */
static const StragglerStats *feed(Straggler *s, const double *busy, int n, double step) {
    StragglerSample x[8];
    memset(x, 0, sizeof x);
    for (int r = 0; r < n; r++) x[r].step_s = step, x[r].data_s = 0.1 * busy[r], x[r].comm_s[0] = step - busy[r];
    return straggler_feed(s, x);
}

int main(void) {
    /* factor 1.5, 20 ms excess, 3 logged steps in a row */
    Straggler *s = straggler_new(4, 1.5, 0.020, 3);
    double even[4] = {0.100, 0.104, 0.098, 0.101}, slow[4] = {0.100, 0.104, 0.400, 0.101};
    const StragglerStats *st = feed(s, even, 4, 0.40);
    test_report(!st->slow && !st->warn && st->slowest == 1, "straggler_even_ranks_not_slow", "slow %d slowest %d", st->slow,
                st->slowest);
    /* the slowest against the median of the others: 0.400 / 0.101 */
    st = feed(s, slow, 4, 0.40);
    test_report(st->slow && st->slowest == 2 && fabs(st->factor - 0.400 / 0.101) < 1e-12 && st->streak == 1 && !st->warn,
                "straggler_factor_over_median_of_others", "factor %g streak %d", st->factor, st->streak);
    /* exact sums of a few doubles: 1e-12 is rounding */
    test_report(fabs(st->busy_s.max - 0.400) < 1e-12 && fabs(st->busy_s.min - 0.100) < 1e-12 &&
                    fabs(st->busy_s.median - 0.1025) < 1e-12 && st->busy_s.argmax == 2 &&
                    fabs(st->compute[2] - 0.360) < 1e-12 && fabs(st->comm[0].min) < 1e-12,
                "straggler_spreads", "median %g compute %g", st->busy_s.median, st->compute[2]);
    st = feed(s, slow, 4, 0.40);
    int w2 = st->warn;
    st = feed(s, slow, 4, 0.40);
    int w3 = st->warn, streak3 = st->streak;
    st = feed(s, slow, 4, 0.40);
    test_report(!w2 && w3 && streak3 == 3 && !st->warn && st->streak == 4, "straggler_warns_once_at_the_streak",
                "warn at 2/3/4: %d %d %d", w2, w3, st->warn);
    /* another rank slow breaks the streak; an even step ends it */
    double other[4] = {0.400, 0.104, 0.098, 0.101};
    st = feed(s, other, 4, 0.40);
    int moved = st->slowest == 0 && st->streak == 1;
    st = feed(s, even, 4, 0.40);
    test_report(moved && st->streak == 0 && !st->slow, "straggler_streak_resets", "streak %d", st->streak);
    const int *w;
    int nw = straggler_warned(s, &w);
    test_report(nw == 1 && w[0] == 2, "straggler_warned_list", "%d warned", nw);
    straggler_close(s);

    /* 1.6x, but only 15 ms more: timer noise, not a straggler */
    s = straggler_new(4, 1.5, 0.020, 1);
    double tiny[4] = {0.025, 0.025, 0.040, 0.025};
    st = feed(s, tiny, 4, 0.05);
    test_report(!st->slow && st->slowest == 2 && st->factor > 1.5, "straggler_minimum_excess", "slow %d", st->slow);
    straggler_close(s);

    /* factor 0: never slow; two ranks: judged against the other one */
    s = straggler_new(2, 0, 0.020, 1);
    double two[2] = {0.1, 0.9};
    st = feed(s, two, 2, 1.0);
    test_report(!st->slow && st->slowest == 1 && fabs(st->factor - 9.0) < 1e-12, "straggler_factor_zero_is_off",
                "slow %d factor %g", st->slow, st->factor);
    straggler_close(s);
    s = straggler_new(2, 1.5, 0.020, 1);
    st = feed(s, two, 2, 1.0);
    test_report(st->slow && st->warn && st->slowest == 1, "straggler_two_ranks", "slow %d", st->slow);
    straggler_close(s);
    return 0;
}
