/* test_rng: xoshiro256**'s jump ahead (util.c rng_jump) against the
 * generator itself: n steps taken one by one where that is feasible, and,
 * for n up to 2^64 - 1, the 256 x 256 transition matrix over GF(2) built
 * from single steps and raised to the n-th power by squaring (a method
 * independent of the jump's polynomial arithmetic). The characteristic
 * polynomial is derived here again, by Berlekamp-Massey. All comparisons
 * are of exact state bits. */
#include <stdint.h>
#include <string.h>

#include "test.h"
#include "util.h"

/* ---- the transition as a matrix: col[i] = T e_i, each column 4 words */
typedef struct {
    uint64_t col[256][4];
} Mat;

static void mat_apply(const Mat *a, const uint64_t v[4], uint64_t out[4]) {
    uint64_t acc[4] = {0, 0, 0, 0};
    for (int i = 0; i < 256; i++)
        if (v[i / 64] >> (i % 64) & 1)
            for (int w = 0; w < 4; w++) acc[w] ^= a->col[i][w];
    memcpy(out, acc, sizeof acc);
}

/* a = a a */
static void mat_square(Mat *a) {
    static Mat t;
    for (int i = 0; i < 256; i++) mat_apply(a, a->col[i], t.col[i]);
    *a = t;
}

static void mat_step(Mat *t) {
    for (int i = 0; i < 256; i++) {
        Rng r = {{0, 0, 0, 0}};
        r.s[i / 64] = 1ULL << (i % 64);
        rng_u64(&r);
        memcpy(t->col[i], r.s, sizeof r.s);
    }
}

/* the state n steps after s, by the matrix powers T^(2^k) for n's bits */
static void mat_jump(uint64_t s[4], uint64_t n) {
    static Mat p;
    mat_step(&p);
    for (int b = 0; b < 64; b++) {
        if (n >> b & 1) mat_apply(&p, s, s);
        if (b < 63) mat_square(&p);
    }
}

static int same(const Rng *a, const Rng *b) { return !memcmp(a->s, b->s, sizeof a->s); }

/* jump(n) against n single steps, from a seeded state */
static int jump_equals_steps(uint64_t seed, uint64_t n) {
    Rng a, b;
    rng_seed(&a, seed);
    b = a;
    for (uint64_t i = 0; i < n; i++) rng_u64(&a);
    rng_jump(&b, n);
    return same(&a, &b);
}

static void steps_case(void) {
    int ok = 1;
    uint64_t bad = 0;
    for (uint64_t n = 0; n <= 600 && ok; n++) /* every n across the polynomial's degree, 256, and twice it */
        if (!jump_equals_steps(n + 1, n)) ok = 0, bad = n;
    test_report(ok, "jump_0_to_600_steps", "jump(%llu) differs from %llu steps", (unsigned long long)bad,
                (unsigned long long)bad);
    Rng pick;
    rng_seed(&pick, 99);
    ok = 1;
    for (int k = 0; k < 20 && ok; k++) {
        uint64_t n = rng_below(&pick, 1u << 20);
        if (!jump_equals_steps(1000 + (uint64_t)k, n)) ok = 0, bad = n;
    }
    uint64_t big = (1ULL << 24) + 12345; /* 2^24 + odd: still steppable in a fraction of a second */
    test_report(ok && jump_equals_steps(7, big), "jump_random_n_steps", "jump(%llu) or jump(2^24 + 12345) differs",
                (unsigned long long)bad);
}

static void matrix_case(void) {
    const uint64_t ns[] = {(1ULL << 40) + 3,  (1ULL << 40) + 0x123457, (1ULL << 52) + 99, 3ULL * 1559000000ULL,
                           (1ULL << 63) + 1, UINT64_MAX};
    int ok = 1, bad = -1;
    for (int k = 0; k < (int)(sizeof ns / sizeof ns[0]); k++) {
        Rng a, b;
        rng_seed(&a, 1337 + (uint64_t)k);
        b = a;
        mat_jump(a.s, ns[k]);
        rng_jump(&b, ns[k]);
        if (!same(&a, &b)) ok = 0, bad = k;
    }
    test_report(ok, "jump_large_n_matrix", "jump(n) differs from T^n for n #%d (2^40 + odd and larger)", bad);

    /* the reference matrix itself against the generator's published jump:
     * Vigna's JUMP constants are x^(2^128) mod the polynomial, so applied
     * they equal T^(2^128) */
    static Mat p;
    mat_step(&p);
    for (int k = 0; k < 128; k++) mat_square(&p);
    const RngJump published = {{0x180ec6d33cfd0abaULL, 0xd5a61266f0c9392cULL, 0xa9582618e03fc9aaULL,
                                0x39abdc4529b1661cULL}};
    Rng a, b;
    rng_seed(&a, 5);
    b = a;
    mat_apply(&p, a.s, a.s);
    rng_jump_apply(&b, &published);
    test_report(same(&a, &b), "jump_published_2_128", "T^(2^128) and the published jump polynomial disagree");
}

/* jumps compose: jump(a) then jump(b) is jump(a + b), and a jump made once
 * applies to any state */
static void compose_case(void) {
    Rng pick;
    rng_seed(&pick, 3);
    int ok = 1;
    for (int k = 0; k < 50 && ok; k++) {
        uint64_t a = rng_u64(&pick) >> 2, b = rng_u64(&pick) >> 2;
        Rng x, y, z;
        rng_seed(&x, (uint64_t)k);
        y = x;
        rng_jump(&x, a);
        rng_jump(&x, b);
        RngJump j;
        rng_jump_make(&j, a + b);
        rng_jump_apply(&y, &j);
        rng_seed(&z, (uint64_t)k + 100);
        Rng w = z;
        rng_jump_apply(&z, &j);
        rng_jump(&w, a + b);
        ok = same(&x, &y) && same(&z, &w);
    }
    test_report(ok, "jump_composes", "jump(a) jump(b) differs from jump(a + b)");
}

/* Berlekamp-Massey on bit 0 of s[0] over 512 steps: the minimal polynomial
 * of that sequence, which for a primitive characteristic polynomial (the
 * period is 2^256 - 1) is the characteristic polynomial itself. x^256 mod
 * it is its lower 256 bits, what rng_jump_make(256) must give. */
static void charpoly_case(void) {
    enum { N = 512 };
    int seq[N], c[N + 1] = {1}, b[N + 1] = {1}, t[N + 1], L = 0, m = 1;
    Rng r;
    rng_seed(&r, 42);
    for (int i = 0; i < N; i++) seq[i] = (int)(r.s[0] & 1), rng_u64(&r);
    for (int n = 0; n < N; n++) {
        int d = seq[n];
        for (int i = 1; i <= L; i++) d ^= c[i] & seq[n - i];
        if (!d) {
            m++;
            continue;
        }
        memcpy(t, c, sizeof c);
        for (int i = 0; i + m <= N; i++) c[i + m] ^= b[i];
        if (2 * L <= n) L = n + 1 - L, memcpy(b, t, sizeof t), m = 1;
        else m++;
    }
    uint64_t low[4] = {0, 0, 0, 0}; /* the connection polynomial reversed: coefficient of x^(L - i) is c[i] */
    for (int i = 1; i <= L; i++)
        if (c[i] && L - i < 256) low[(L - i) / 64] |= 1ULL << ((L - i) % 64);
    RngJump j;
    rng_jump_make(&j, 256);
    test_report(L == 256 && !memcmp(low, j.poly, sizeof low), "jump_charpoly_berlekamp_massey",
                "linear complexity %d (want 256) or x^256 mod the polynomial differs", L);
}

int main(void) {
    charpoly_case();
    steps_case();
    matrix_case();
    compose_case();
    return 0;
}
