/* fuzz_runs: the readers of a run directory after (or during) a run --
 * `./train status`, `report`, `compare` (src/runs.c, report.c, compare.c)
 * and `./train doctor` (doctor.c): metrics.jsonl, config.yaml, ranks.json,
 * ranks.jsonl, heartbeat/rank*.json, flight/rank*.json and
 * checkpoints/latest, as the run left them or torn, truncated, NaN-filled.
 * The input is the directory (fuzz.h, fuzz_unpack) after one byte naming the
 * command: 's' status, 'r' report (the HTML goes to scratch), 'c' compare
 * (against the run's subdirectory b/ when there is one, else itself), 'd'
 * doctor (else by value mod 4). Runs in a child through each command's own
 * main: its exit must be 0 (doctor: 0 or 3, a culprit named) or 2 with one
 * error line. KILN_FUZZ_RUNS_SHOW=1 with one input runs it here and prints
 * what the command prints. */
#include "compare.h"
#include "doctor.h"
#include "fuzz.h"
#include "report.h"

static void load(const uint8_t *d, size_t n) {
    char dir[400], b[500], out[500];
    snprintf(dir, sizeof dir, "%s/run", fuzz_tmp());
    snprintf(b, sizeof b, "%s/b", dir);
    snprintf(out, sizeof out, "%s/report.html", fuzz_tmp());
    fuzz_unpack(dir, d, n);
    int which = n ? (d[0] == 's' ? 0 : d[0] == 'r' ? 1 : d[0] == 'c' ? 2 : d[0] == 'd' ? 3 : d[0] % 4) : 0;
    struct stat sb;
    int rc;
    if (which == 0) rc = report_status_main(2, (char *[]){"status", dir, NULL});
    else if (which == 1) rc = report_html_main(4, (char *[]){"report", dir, "-o", out, NULL});
    else if (which == 2) rc = compare_main(3, (char *[]){"compare", dir, stat(b, &sb) == 0 ? b : dir, NULL});
    else {
        rc = doctor_main(2, (char *[]){"doctor", dir, NULL});
        if (rc == DOCTOR_CULPRIT) rc = 0;
    }
    fflush(stdout);
    if (rc != 0 && fuzz_shm) fuzz_child_fail(rc, NULL); /* its code, its own error line: fuzz_fork checks both */
    if (rc != 0) exit(rc);
}

FUZZ_NOCOV int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {
    fuzz_run(load, d, n, "KILN_FUZZ_RUNS_SHOW");
    return 0;
}
