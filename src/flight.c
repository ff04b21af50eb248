/* flight: the ring of recent operations and its dump (see flight.h). Must stay
 * async-signal-safe on the dump path (no malloc, no stdio, no locks: only
 * open/write/close/rename/mkdir/clock_gettime on buffers made at open), and
 * must never allocate or block on the recording path, which every collective
 * takes. The ring is written by the thread that communicates and read, without
 * locks, by whatever thread a signal lands on: a slot's id is cleared while
 * it is written and re-checked after it is read, so a torn record is skipped. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "flight.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "testhooks.h"
#include "util.h"

#define FLIGHT_NAME 32   /* a group name, as CommGroup's */
#define FLIGHT_LINE 512  /* the longest record line the formatter writes, with room to spare */
#define FLIGHT_ALTSTACK (64 << 10) /* a stack overflow's SIGSEGV still gets a handler */

typedef struct FlightRecord {
    uint64_t id;             /* 1, 2, ...: posting order on this rank; 0 = empty or being written */
    uint64_t seq, coll, count;
    int64_t posted_us, started_us, completed_us; /* unix microseconds; 0 = not yet */
    const char *op, *phase;  /* string literals */
    int32_t peer, step, group_first, group_size;
    uint8_t dtype;
    char group[FLIGHT_NAME];
} FlightRecord;

/* A test hook (testhooks.h): world rank, step (0 = unset), group, fired once. */
typedef struct FlightTestHook {
    int rank, step, fired;
    char group[FLIGHT_NAME];
} FlightTestHook;

static const int flight_fatal[] = {SIGSEGV, SIGABRT, SIGBUS};
#define NFATAL ((int)(sizeof flight_fatal / sizeof flight_fatal[0]))

static struct {
    int open, cap;               /* cap: ring slots; 0 = recording off */
    FlightRecord *ring;          /* [cap] */
    uint64_t next_id;            /* the last id handed out */
    char *buf;                   /* [buf_cap] the dump is formatted here */
    size_t buf_cap;
    char run_dir[1024], dir[1100], path[1200], tmp[1200];
    char usr2_msg[1400];         /* preformatted: the signal handler cannot format freely */
    int usr2_len;
    int rank, world, pid;
    char host[64];
    const char *volatile phase;
    volatile int step;
    volatile uint64_t waiting;   /* id of the operation the rank waits in; 0 = none */
    volatile sig_atomic_t final; /* a dump of a telling reason exists: FLIGHT_PEER leaves it */
    volatile sig_atomic_t usr2_dumps;
    int signals;
    struct sigaction old_usr2, old_fatal[NFATAL];
    stack_t old_stack;
    void *altstack;
    FlightTestHook skip, wrong, segv, pause;
} F;

static atomic_flag flight_busy = ATOMIC_FLAG_INIT;

static int64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* Names go into JSON unquoted-safe: letters, digits and _.:- only. */
static void copy_name(char *dst, const char *src, size_t n) {
    size_t i = 0;
    for (; src && src[i] && i + 1 < n; i++) {
        char c = src[i];
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
                 c == '.' || c == ':' || c == '-';
        dst[i] = ok ? c : '_';
    }
    dst[i] = '\0';
}

/* ---------------------------------------------------------------- recording */

int flight_records(void) { return F.cap; }

static FlightRecord *slot(uint64_t id) { return &F.ring[(id - 1) % (uint64_t)F.cap]; }

uint64_t flight_post(const FlightOp *op) {
    if (!F.cap) return 0;
    uint64_t id = F.next_id + 1;
    FlightRecord *r = slot(id);
    __atomic_store_n(&r->id, 0, __ATOMIC_RELAXED);
    atomic_signal_fence(memory_order_seq_cst);
    r->seq = op->seq;
    r->coll = op->coll;
    r->count = op->count;
    r->posted_us = now_us();
    r->started_us = 0;
    r->completed_us = 0;
    r->op = op->op;
    r->phase = F.phase;
    r->peer = op->peer;
    r->step = F.step;
    r->group_first = op->group_first;
    r->group_size = op->group_size;
    r->dtype = (uint8_t)op->dtype;
    copy_name(r->group, op->group, sizeof r->group);
    __atomic_store_n(&r->id, id, __ATOMIC_RELEASE);
    __atomic_store_n(&F.next_id, id, __ATOMIC_RELEASE);
    return id;
}

void flight_wait(uint64_t id) {
    if (!id || !F.cap) return;
    FlightRecord *r = slot(id);
    if (__atomic_load_n(&r->id, __ATOMIC_ACQUIRE) != id) return;
    __atomic_store_n(&r->started_us, now_us(), __ATOMIC_RELAXED);
    F.waiting = id;
}

void flight_idle(uint64_t id) {
    if (id && F.waiting == id) F.waiting = 0;
}

void flight_done(uint64_t id) {
    if (!id || !F.cap) return;
    FlightRecord *r = slot(id);
    if (F.waiting == id) F.waiting = 0;
    if (__atomic_load_n(&r->id, __ATOMIC_ACQUIRE) != id) return;
    __atomic_store_n(&r->completed_us, now_us(), __ATOMIC_RELAXED);
}

int flight_step(void) { return F.step; }

/* ---------------------------------------------------------------- formatting (async-signal-safe) */

typedef struct Out {
    char *p;
    size_t n, cap;
} Out;

static void put(Out *o, const char *s) {
    while (*s && o->n + 1 < o->cap) o->p[o->n++] = *s++;
}
static void put_u64(Out *o, uint64_t v) {
    char d[24];
    int k = 0;
    do d[k++] = (char)('0' + v % 10), v /= 10;
    while (v);
    while (k && o->n + 1 < o->cap) o->p[o->n++] = d[--k];
}
static void put_i64(Out *o, int64_t v) {
    if (v < 0) put(o, "-"), v = -v;
    put_u64(o, (uint64_t)v);
}
/* Unix microseconds as seconds with six decimals; 0 is null. */
static void put_time(Out *o, int64_t us) {
    if (us <= 0) {
        put(o, "null");
        return;
    }
    put_u64(o, (uint64_t)us / 1000000);
    put(o, ".");
    char d[7];
    uint64_t f = (uint64_t)us % 1000000;
    for (int i = 5; i >= 0; i--) d[i] = (char)('0' + f % 10), f /= 10;
    d[6] = 0;
    put(o, d);
}
static void put_key(Out *o, const char *key) {
    put(o, ",\"");
    put(o, key);
    put(o, "\":");
}
static void put_str(Out *o, const char *key, const char *v) {
    char clean[64];
    copy_name(clean, v ? v : "", sizeof clean);
    put_key(o, key);
    put(o, "\"");
    put(o, clean);
    put(o, "\"");
}

static const char *dtype_name(int d) {
    switch (d) {
    case FLIGHT_F32: return "f32";
    case FLIGHT_F64: return "f64";
    case FLIGHT_BYTES: return "bytes";
    case FLIGHT_BF16: return "bf16";
    default: return "none";
    }
}

static const char *signal_name(int sig) {
    switch (sig) {
    case SIGUSR2: return "SIGUSR2";
    case SIGSEGV: return "SIGSEGV";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    default: return "signal";
    }
}

static const char *reason_name(FlightReason why, int detail) {
    switch (why) {
    case FLIGHT_TIMEOUT: return "timeout";
    case FLIGHT_PEER: return "peer_timeout";
    case FLIGHT_STALL: return "stall";
    case FLIGHT_MISMATCH: return "mismatch";
    case FLIGHT_COMM_ERROR: return "comm_error";
    case FLIGHT_SIGNAL: return signal_name(detail);
    }
    return "?";
}

size_t flight_format(char *buf, size_t cap, FlightReason why, int detail) {
    Out o = {buf, 0, cap};
    uint64_t last = __atomic_load_n(&F.next_id, __ATOMIC_ACQUIRE);
    uint64_t first = last > (uint64_t)F.cap ? last - (uint64_t)F.cap + 1 : 1;
    put(&o, "{\"format\":\"kiln-flight\",\"version\":1");
    put_key(&o, "rank"), put_i64(&o, F.rank);
    put_key(&o, "world"), put_i64(&o, F.world);
    put_str(&o, "host", F.host);
    put_key(&o, "pid"), put_i64(&o, F.pid);
    put_str(&o, "reason", reason_name(why, detail));
    put_key(&o, "detail"), put_i64(&o, detail);
    put_key(&o, "time"), put_time(&o, now_us());
    put_key(&o, "step"), put_i64(&o, F.step);
    put_str(&o, "phase", F.phase);
    put_key(&o, "capacity"), put_i64(&o, F.cap);
    put_key(&o, "recorded"), put_u64(&o, last);
    put_key(&o, "waiting"), put_u64(&o, F.waiting);
    put(&o, ",\"ops\":[\n");
    int any = 0;
    for (uint64_t id = first; F.cap && id <= last; id++) {
        if (o.n + FLIGHT_LINE + 8 > cap) break; /* never without the closing brackets */
        const FlightRecord *r = slot(id);
        if (__atomic_load_n(&r->id, __ATOMIC_ACQUIRE) != id) continue;
        FlightRecord c = *r; /* a copy, then check that nobody rewrote the slot meanwhile */
        atomic_signal_fence(memory_order_seq_cst);
        if (__atomic_load_n(&r->id, __ATOMIC_ACQUIRE) != id) continue;
        size_t mark = o.n;
        put(&o, any ? ",\n{\"id\":" : "{\"id\":");
        put_u64(&o, c.id);
        put_str(&o, "group", c.group);
        put_key(&o, "group_first"), put_i64(&o, c.group_first);
        put_key(&o, "group_size"), put_i64(&o, c.group_size);
        put_str(&o, "op", c.op);
        put_key(&o, "seq"), put_u64(&o, c.seq);
        put_key(&o, "coll"), put_u64(&o, c.coll);
        put_str(&o, "dtype", dtype_name(c.dtype));
        put_key(&o, "count"), put_u64(&o, c.count);
        put_key(&o, "peer"), put_i64(&o, c.peer);
        put_key(&o, "step"), put_i64(&o, c.step);
        put_str(&o, "phase", c.phase);
        put_key(&o, "posted"), put_time(&o, c.posted_us);
        put_key(&o, "started"), put_time(&o, c.started_us);
        put_key(&o, "completed"), put_time(&o, c.completed_us);
        put_str(&o, "state", c.completed_us ? "completed" : c.started_us ? "waiting" : "posted");
        put(&o, "}");
        if (o.n + 1 >= cap) o.n = mark; /* cannot happen with FLIGHT_LINE per record; keep the JSON whole */
        any = 1;
    }
    put(&o, "\n]}\n");
    if (o.n < cap) buf[o.n] = 0;
    return o.n;
}

static int write_all(int fd, const char *p, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        p += w, n -= (size_t)w;
    }
    return 0;
}

int flight_dump(FlightReason why, int detail) {
    if (!F.cap) return -1;
    if (why == FLIGHT_PEER && F.final) return -1; /* the file already says more */
    if (atomic_flag_test_and_set(&flight_busy)) return -1;
    int saved = errno;
    size_t n = flight_format(F.buf, F.buf_cap, why, detail);
    (void)mkdir(F.run_dir, 0755); /* both exist after start-up; not before train made the run directory */
    (void)mkdir(F.dir, 0755);
    int ok = 0;
    int fd = open(F.tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) {
        ok = write_all(fd, F.buf, n) == 0;
        ok &= close(fd) == 0;
        ok = ok && rename(F.tmp, F.path) == 0;
    }
    if (ok && why != FLIGHT_PEER && !(why == FLIGHT_SIGNAL && detail == SIGUSR2)) F.final = 1;
    errno = saved;
    atomic_flag_clear(&flight_busy);
    return ok ? 0 : -1;
}

int flight_usr2_dumps(void) { return F.usr2_dumps; }

/* ---------------------------------------------------------------- signals */

static void say(const char *s) {
    if (write_all(2, s, strlen(s)) != 0) { /* stderr is gone: nothing to do */
    }
}

static void on_signal(int sig, siginfo_t *si, void *ctx) {
    int saved = errno;
    if (sig == SIGUSR2) {
        if (!F.cap) say("kiln: SIGUSR2: the flight recorder is off (monitor.flight_records: 0)\n");
        else if (flight_dump(FLIGHT_SIGNAL, SIGUSR2) == 0) {
            F.usr2_dumps++;
            if (write_all(2, F.usr2_msg, (size_t)F.usr2_len) != 0) { /* as above */
            }
        }
        errno = saved;
        return;
    }
    int wrote = flight_dump(FLIGHT_SIGNAL, sig) == 0;
    char line[1400];
    Out o = {line, 0, sizeof line};
    put(&o, "kiln: error: rank ");
    put_i64(&o, F.rank);
    put(&o, ": ");
    put(&o, signal_name(sig));
    put(&o, " in step ");
    put_i64(&o, F.step);
    put(&o, " (phase ");
    put(&o, F.phase ? F.phase : "?");
    put(&o, wrote ? "); flight recorder written to " : "); no flight recorder file");
    if (wrote) put(&o, F.path);
    put(&o, "\n");
    line[o.n] = 0;
    say(line);
    /* whoever handled the signal before (Open MPI prints a backtrace) */
    const struct sigaction *old = NULL;
    for (int i = 0; i < NFATAL; i++)
        if (flight_fatal[i] == sig) old = &F.old_fatal[i];
    if (old && (old->sa_flags & SA_SIGINFO) && old->sa_sigaction) old->sa_sigaction(sig, si, ctx);
    else if (old && old->sa_handler != SIG_DFL && old->sa_handler != SIG_IGN) old->sa_handler(sig);
    /* then the default action: the exit status and core file say which signal */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    raise(sig); /* pending until the handler returns; a real fault also refaults */
    errno = saved;
}

static void install_signals(void) {
    F.altstack = xmalloc(FLIGHT_ALTSTACK);
    stack_t st = {.ss_sp = F.altstack, .ss_size = FLIGHT_ALTSTACK, .ss_flags = 0};
    if (sigaltstack(&st, &F.old_stack) != 0) kiln_warn("flight: sigaltstack failed: %s", strerror(errno));
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_SIGINFO | SA_RESTART | SA_ONSTACK;
    sigaction(SIGUSR2, &sa, &F.old_usr2);
    for (int i = 0; i < NFATAL; i++) sigaction(flight_fatal[i], &sa, &F.old_fatal[i]);
    F.signals = 1;
}

static void restore_signals(void) {
    if (!F.signals) return;
    sigaction(SIGUSR2, &F.old_usr2, NULL);
    for (int i = 0; i < NFATAL; i++) sigaction(flight_fatal[i], &F.old_fatal[i], NULL);
    sigaltstack(&F.old_stack, NULL); /* usually SS_DISABLE: none */
    free(F.altstack);
    F.signals = 0;
}

/* ---------------------------------------------------------------- test hooks */

/* "R:S" or "R:S:GROUP" from the environment; exits 2 on anything else. */
static void hook_take(FlightTestHook *h, const TestHookAt *at) {
    memset(h, 0, sizeof *h);
    h->rank = at->rank, h->step = at->step;
    kiln_strlcpy(h->group, at->group, sizeof h->group);
}

static int hook_due(FlightTestHook *h, int step) { return h->step && !h->fired && h->rank == F.rank && step == h->step; }

FlightHook flight_test_hook(const char *group) {
    if (hook_due(&F.skip, F.step) && strcmp(group, F.skip.group) == 0) return F.skip.fired = 1, FLIGHT_HOOK_SKIP;
    if (hook_due(&F.wrong, F.step) && strcmp(group, F.wrong.group) == 0) return F.wrong.fired = 1, FLIGHT_HOOK_WRONG;
    return FLIGHT_HOOK_NONE;
}

void flight_phase(const char *phase, int step) {
    F.phase = phase;
    F.step = step;
    if (!F.segv.step && !F.pause.step) return;
    if (strcmp(phase, "forward") != 0) return;
    if (hook_due(&F.segv, step)) {
        F.segv.fired = 1;
        volatile uintptr_t nowhere = 0; /* volatile: the compiler cannot see it is null and trap instead */
        *(volatile int *)nowhere = 1;
    }
    if (hook_due(&F.pause, step)) {
        F.pause.fired = 1;
        struct timespec ts = {0, 10 * 1000 * 1000};
        for (int i = 0; i < 6000 && F.usr2_dumps == 0; i++) nanosleep(&ts, NULL);
    }
}

/* ---------------------------------------------------------------- open / close */

void flight_open(const FlightOptions *o) {
    if (F.open) flight_close();
    memset(&F, 0, sizeof F);
    F.open = 1;
    F.rank = o->rank, F.world = o->world, F.pid = (int)getpid();
    F.phase = "init";
    copy_name(F.host, o->host ? o->host : "unknown", sizeof F.host);
    kiln_strlcpy(F.run_dir, o->run_dir ? o->run_dir : ".", sizeof F.run_dir);
    snprintf(F.dir, sizeof F.dir, "%s/flight", F.run_dir);
    snprintf(F.path, sizeof F.path, "%s/rank%d.json", F.dir, F.rank);
    snprintf(F.tmp, sizeof F.tmp, "%s/.rank%d.json.tmp", F.dir, F.rank);
    F.usr2_len = snprintf(F.usr2_msg, sizeof F.usr2_msg, "kiln: rank %d: SIGUSR2: flight recorder written to %s\n",
                          F.rank, F.path);
    if (F.usr2_len >= (int)sizeof F.usr2_msg) F.usr2_len = (int)sizeof F.usr2_msg - 1;
    const TestHooks *th = testhooks();
    hook_take(&F.skip, &th->skip_collective);
    hook_take(&F.wrong, &th->wrong_collective);
    hook_take(&F.segv, &th->segv);
    hook_take(&F.pause, &th->flight_pause);
    if (o->records > 0) {
        F.ring = xcalloc((size_t)o->records, sizeof(FlightRecord));
        F.buf_cap = (size_t)o->records * FLIGHT_LINE + 2048;
        F.buf = xmalloc(F.buf_cap);
        F.cap = o->records;
    }
    if (o->signals) install_signals();
}

void flight_close(void) {
    if (!F.open) return;
    restore_signals();
    F.cap = 0; /* a signal from here on finds the recorder off */
    atomic_signal_fence(memory_order_seq_cst);
    free(F.ring);
    free(F.buf);
    memset(&F, 0, sizeof F);
}
