/* doctor: `./train doctor RUN_DIR`. Reads the flight recorder's files
 * (RUN_DIR/flight/rank*.json, flight.h) and the heartbeats after a hang, a
 * crash or a SIGUSR2 snapshot and says where each rank waits, which collective
 * the ranks disagree on and who is missing, and which rank is slowest per
 * phase. Reads only: never writes into the run directory. */
#ifndef KILN_DOCTOR_H
#define KILN_DOCTOR_H

#include <stdio.h>

/* Exit status of `./train doctor` (beside 2: bad usage, unreadable files). */
enum {
    DOCTOR_CLEAN = 0,  /* no culprit found */
    DOCTOR_CULPRIT = 3 /* a rank was named: crashed, mismatched, missing from a collective, or a straggler */
};

typedef struct DoctorOptions {
    double stuck_after_s; /* an operation waited on this long is a hang even without a timeout; default 10 */
    double slow_ms;       /* a straggler arrives at least this much later on average; default 5 */
} DoctorOptions;

/* Diagnose run_dir, writing the report to out: DOCTOR_CLEAN, DOCTOR_CULPRIT,
 * or 2 (with a "kiln: error:" line on stderr) when run_dir holds no run or a
 * flight file cannot be read. */
int doctor_run(const char *run_dir, const DoctorOptions *o, FILE *out);
/* argv[0] is "doctor". */
int doctor_main(int argc, char **argv);

#endif
