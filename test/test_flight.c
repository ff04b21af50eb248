/* test_flight: the flight recorder's ring (wrap-around, states, the file's
 * JSON read back by Python's json module, what a dump may overwrite, the
 * SIGUSR2 handler, the test hooks) and ./train doctor on hand-written flight
 * files: a straggler, a clean snapshot, a rank that never answered. One rank,
 * no MPI; the multi-rank runs are test/t_flight.sh. Writes only under
 * $KILN_TEST_TMP. */
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "doctor.h"
#include "flight.h"
#include "testhooks.h"
#include "test.h"
#include "util.h"

static char base[1024];

static uint64_t post(const char *group, const char *op, uint64_t seq) {
    FlightOp o = {.group = group, .group_first = 0, .group_size = 2, .op = op, .seq = seq, .coll = seq,
                  .dtype = FLIGHT_F32, .count = 10 * seq, .peer = -1};
    return flight_post(&o);
}

/* Python's json module reads the file, and says how many ops and which ids. */
static int py_check(const char *path, const char *expr) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if (%s) else 1)' %s", expr,
             path);
    return system(cmd) == 0;
}

static void test_ring(void) {
    char dir[1100], path[1200];
    snprintf(dir, sizeof dir, "%s/ring", base);
    snprintf(path, sizeof path, "%s/flight/rank0.json", dir);
    kiln_mkdirs(dir);
    flight_open(&(FlightOptions){.run_dir = dir, .rank = 0, .world = 2, .host = "h\"ost", .records = 4});
    flight_phase("backward", 7);
    uint64_t id[10];
    for (int i = 0; i < 10; i++) id[i] = post(i % 2 ? "dp" : "tp", "all_reduce", (uint64_t)i + 1);
    for (int i = 0; i < 8; i++) flight_done(id[i]);
    flight_wait(id[9]);
    flight_done(id[0]); /* its slot was reused: ignored */
    test_report(id[9] == 10 && flight_records() == 4, "flight_ids_count_up", "ids %llu, ring %d",
                (unsigned long long)id[9], flight_records());
    int w = flight_dump(FLIGHT_TIMEOUT, -1);
    test_report(w == 0 && py_check(path, "d[\"reason\"]==\"timeout\" and d[\"recorded\"]==10 and d[\"capacity\"]==4 and "
                                         "[o[\"id\"] for o in d[\"ops\"]]==[7,8,9,10]"),
                "flight_ring_wraps_keeps_newest_in_order", "dump %d; %s", w, path);
    test_report(py_check(path, "d[\"waiting\"]==10 and [o[\"state\"] for o in d[\"ops\"]]==[\"completed\",\"completed\","
                               "\"posted\",\"waiting\"] and d[\"ops\"][3][\"completed\"] is None and "
                               "d[\"ops\"][3][\"started\"]>=d[\"ops\"][3][\"posted\"] and d[\"ops\"][0][\"step\"]==7 and "
                               "d[\"ops\"][0][\"phase\"]==\"backward\" and d[\"host\"]==\"h_ost\""),
                "flight_states_and_fields", "%s", path);
    /* a peer's "where are you?" does not overwrite the timeout's file; SIGUSR2 snapshots do not count as final */
    flight_dump(FLIGHT_PEER, 1);
    test_report(py_check(path, "d[\"reason\"]==\"timeout\""), "flight_peer_dump_keeps_timeout_file", "%s", path);
    flight_close();

    /* the longest names and numbers still fit a record's line, and the JSON stays whole */
    flight_open(&(FlightOptions){.run_dir = dir, .rank = 0, .world = 1, .host = "h", .records = 3});
    for (int i = 0; i < 5; i++) {
        FlightOp o = {.group = "a_group_name_of_31_characters__", .group_first = INT32_MIN, .group_size = INT32_MAX,
                      .op = "an_operation_name_of_23c", .seq = UINT64_MAX, .coll = UINT64_MAX, .dtype = FLIGHT_BYTES,
                      .count = UINT64_MAX, .peer = INT32_MIN};
        flight_post(&o);
    }
    flight_phase("checkpoint", INT32_MIN);
    flight_dump(FLIGHT_SIGNAL, SIGABRT);
    test_report(py_check(path, "d[\"reason\"]==\"SIGABRT\" and len(d[\"ops\"])==3 and d[\"ops\"][0][\"count\"]==2**64-1"),
                "flight_longest_fields_parse", "%s", path);
    flight_close();

    /* off: nothing recorded, nothing written */
    snprintf(dir, sizeof dir, "%s/off", base);
    snprintf(path, sizeof path, "%s/flight/rank0.json", dir);
    flight_open(&(FlightOptions){.run_dir = dir, .rank = 0, .world = 1, .host = "h", .records = 0});
    uint64_t x = post("dp", "all_reduce", 1);
    int d = flight_dump(FLIGHT_TIMEOUT, -1);
    test_report(x == 0 && d == -1 && access(path, F_OK) != 0, "flight_off_records_nothing", "id %llu, dump %d",
                (unsigned long long)x, d);
    flight_close();
}

static void test_sigusr2(void) {
    char dir[1100], path[1200];
    snprintf(dir, sizeof dir, "%s/usr2", base);
    snprintf(path, sizeof path, "%s/flight/rank3.json", dir);
    flight_open(&(FlightOptions){.run_dir = dir, .rank = 3, .world = 4, .host = "h", .records = 8, .signals = 1});
    post("dp", "broadcast", 1);
    raise(SIGUSR2); /* the handler runs before raise returns; the process goes on */
    test_report(flight_usr2_dumps() == 1 && py_check(path, "d[\"reason\"]==\"SIGUSR2\" and d[\"rank\"]==3 and "
                                                           "d[\"ops\"][0][\"op\"]==\"broadcast\""),
                "flight_sigusr2_dumps_and_goes_on", "%d dumps; %s", flight_usr2_dumps(), path);
    flight_close();
}

static void hooks_bad(void *arg) {
    setenv("KILN_TEST_SKIP_COLLECTIVE", (const char *)arg, 1);
    testhooks_reset();
    flight_open(&(FlightOptions){.run_dir = base, .rank = 0, .world = 1, .host = "h", .records = 1});
}

static void test_hooks(void) {
    setenv("KILN_TEST_SKIP_COLLECTIVE", "2:3:dp", 1);
    setenv("KILN_TEST_WRONG_COLLECTIVE", "2:4:world", 1);
    testhooks_reset();
    flight_open(&(FlightOptions){.run_dir = base, .rank = 2, .world = 4, .host = "h", .records = 1});
    flight_phase("sync", 2);
    int a = flight_test_hook("dp");
    flight_phase("sync", 3);
    int b = flight_test_hook("world"), c = flight_test_hook("dp"), e = flight_test_hook("dp");
    flight_phase("optimizer", 4);
    int f = flight_test_hook("world"), g = flight_test_hook("world");
    flight_close();
    unsetenv("KILN_TEST_SKIP_COLLECTIVE");
    unsetenv("KILN_TEST_WRONG_COLLECTIVE");
    testhooks_reset();
    test_report(a == FLIGHT_HOOK_NONE && b == FLIGHT_HOOK_NONE && c == FLIGHT_HOOK_SKIP && e == FLIGHT_HOOK_NONE &&
                    f == FLIGHT_HOOK_WRONG && g == FLIGHT_HOOK_NONE,
                "flight_test_hooks_fire_once_at_rank_step_group", "%d %d %d %d %d %d", a, b, c, e, f, g);
    char err[512];
    int rc = test_run_child(hooks_bad, "2:x:dp", err, sizeof err);
    test_report(rc == 2 && strstr(err, "KILN_TEST_SKIP_COLLECTIVE='2:x:dp': expected RANK:STEP:GROUP"),
                "flight_test_hook_malformed_exit2", "exit %d: %s", rc, err);
}

/* ---------------------------------------------------------------- doctor on written files */

typedef struct SynOp {
    const char *group, *op, *phase;
    int seq, step;
    double posted, done; /* done < 0: not completed */
} SynOp;

static void write_flight(const char *dir, int rank, int world, const char *reason, double time, int waiting,
                         const SynOp *ops, int n) {
    char path[1200];
    snprintf(path, sizeof path, "%s/flight", dir);
    kiln_mkdirs(path);
    snprintf(path, sizeof path, "%s/flight/rank%d.json", dir, rank);
    FILE *f = fopen(path, "w");
    fprintf(f, "{\"format\":\"kiln-flight\",\"version\":1,\"rank\":%d,\"world\":%d,\"host\":\"n%d\",\"pid\":%d,"
               "\"reason\":\"%s\",\"detail\":-1,\"time\":%.6f,\"step\":%d,\"phase\":\"%s\",\"capacity\":256,"
               "\"recorded\":%d,\"waiting\":%d,\"ops\":[\n",
            rank, world, rank, 100 + rank, reason, time, n ? ops[n - 1].step : 0, n ? ops[n - 1].phase : "init", n,
            waiting);
    for (int i = 0; i < n; i++) {
        const SynOp *o = &ops[i];
        char done[32];
        if (o->done < 0) snprintf(done, sizeof done, "null");
        else snprintf(done, sizeof done, "%.6f", o->done);
        fprintf(f, "%s{\"id\":%d,\"group\":\"%s\",\"group_first\":0,\"group_size\":%d,\"op\":\"%s\",\"seq\":%d,"
                   "\"coll\":%d,\"dtype\":\"f32\",\"count\":64,\"peer\":-1,\"step\":%d,\"phase\":\"%s\",\"posted\":%.6f,"
                   "\"started\":%.6f,\"completed\":%s,\"state\":\"x\"}",
                i ? ",\n" : "", i + 1, o->group, world, o->op, o->seq, o->seq, o->step, o->phase, o->posted, o->posted,
                done);
    }
    fprintf(f, "\n]}\n");
    fclose(f);
}

static void write_heartbeat(const char *dir, int rank, int world, int step, const char *phase, double time) {
    char path[1200];
    snprintf(path, sizeof path, "%s/heartbeat", dir);
    kiln_mkdirs(path);
    snprintf(path, sizeof path, "%s/heartbeat/rank%d.json", dir, rank);
    FILE *f = fopen(path, "w");
    fprintf(f, "{\"rank\":%d,\"world\":%d,\"step\":%d,\"phase\":\"%s\",\"phase_step\":%d,\"phase_s\":1.0,"
               "\"time\":%.3f,\"host\":\"n%d\",\"pid\":%d}\n",
            rank, world, step, phase, step, time, rank, 100 + rank);
    fclose(f);
}

/* doctor's exit status and its report, in out[cap] */
static int doctor(const char *dir, char *out, size_t cap) {
    FILE *f = tmpfile();
    DoctorOptions o = {.stuck_after_s = 10, .slow_ms = 5};
    int rc = doctor_run(dir, &o, f);
    rewind(f);
    size_t n = fread(out, 1, cap - 1, f);
    out[n] = 0;
    fclose(f);
    return rc;
}

static void test_doctor(void) {
    char dir[1100], out[16384];
    /* three ranks, 8 steps of one backward all-reduce and one sync all-reduce;
     * rank 2 posts the backward ones 50 ms after the others, the sync ones on time */
    for (int slow = 0; slow < 2; slow++) {
        snprintf(dir, sizeof dir, "%s/doctor_%s", base, slow ? "slow" : "even");
        for (int r = 0; r < 3; r++) {
            SynOp ops[16];
            double t = 1000.0;
            for (int s = 0; s < 8; s++) {
                double late = r * 0.0001 + (slow && r == 2 ? 0.050 : 0.0);
                ops[2 * s] = (SynOp){"dp", "all_reduce", "backward", 2 * s + 1, s + 1, t + late, t + 0.0512};
                ops[2 * s + 1] = (SynOp){"dp", "all_reduce", "sync", 2 * s + 2, s + 1, t + 0.06 + r * 0.0001,
                                         t + 0.0605};
                t += 0.1;
            }
            write_flight(dir, r, 3, "SIGUSR2", t, 0, ops, 16);
        }
        int rc = doctor(dir, out, sizeof out);
        if (slow)
            test_report(rc == DOCTOR_CULPRIT && strstr(out, "backward   rank 2 on n2 arrives 50.") &&
                            strstr(out, "last at 8 of 8") && strstr(out, "<- straggler") &&
                            strstr(out, "culprit: rank 2 on n2 (pid 102): straggler in phase backward") &&
                            !strstr(out, "culprit: rank 0") && !strstr(out, "culprit: rank 1") && !strstr(out, "hang:"),
                        "doctor_names_straggler_per_phase", "exit %d:\n%s", rc, out);
        else
            test_report(rc == DOCTOR_CLEAN && strstr(out, "no culprit found") && !strstr(out, "straggler"),
                        "doctor_even_snapshot_no_culprit", "exit %d:\n%s", rc, out);
    }

    /* ranks 0 and 1 time out in dp #5; rank 2 never answered: heartbeat only */
    snprintf(dir, sizeof dir, "%s/doctor_absent", base);
    for (int r = 0; r < 2; r++) {
        SynOp ops[5];
        for (int s = 0; s < 4; s++) ops[s] = (SynOp){"dp", "all_reduce", "sync", s + 1, s + 1, 10.0 + s, 10.01 + s};
        ops[4] = (SynOp){"dp", "all_reduce", "sync", 5, 5, 14.0, -1};
        write_flight(dir, r, 3, "timeout", 19.0, 5, ops, 5);
    }
    for (int r = 0; r < 3; r++) write_heartbeat(dir, r, 3, r == 2 ? 5 : 4, r == 2 ? "forward" : "sync", 14.0);
    int rc = doctor(dir, out, sizeof out);
    test_report(rc == DOCTOR_CULPRIT && strstr(out, "hang: ranks 0,1 wait in dp all_reduce #5 (64 f32)") &&
                    strstr(out, "rank 2 on n2 never posted it and wrote no flight file") &&
                    strstr(out, "heartbeat says step 5, phase forward") &&
                    strstr(out, "culprit: rank 2 on n2 (pid 102): never posted dp all_reduce #5"),
                "doctor_names_rank_without_flight_file", "exit %d:\n%s", rc, out);

    /* heartbeats only (a healthy run): nothing to diagnose, exit 0 */
    snprintf(dir, sizeof dir, "%s/doctor_healthy", base);
    write_heartbeat(dir, 0, 1, 3, "done", 1.0);
    rc = doctor(dir, out, sizeof out);
    test_report(rc == DOCTOR_CLEAN && strstr(out, "no flight recorder files"), "doctor_healthy_run_exit0", "exit %d:\n%s",
                rc, out);
    snprintf(dir, sizeof dir, "%s/doctor_nothing", base);
    kiln_mkdirs(dir);
    rc = doctor(dir, out, sizeof out);
    test_report(rc == 2, "doctor_empty_dir_exit2", "exit %d", rc);
}

int main(void) {
    const char *t = getenv("KILN_TEST_TMP");
    char made[] = "/tmp/kiln-test-flight.XXXXXX";
    if (!t && !(t = mkdtemp(made))) return 1;
    snprintf(base, sizeof base, "%s/test_flight", t);
    if (kiln_mkdirs(base) != 0) return 1;
    test_ring();
    test_sigusr2();
    test_hooks();
    test_doctor();
    return 0;
}
