/* stop: when the run should save and stop early — SIGUSR1/SIGTERM, and the
 * Slurm job's end time (checkpoint.before_time_limit). The step loop polls;
 * nothing here touches training state. */
#ifndef KILN_STOP_H
#define KILN_STOP_H

/* Install the handlers: SIGUSR1 or SIGTERM sets a flag the loop reads after
 * each step; a second SIGTERM exits at once with code 1 (a checkpoint being
 * written is left as a .tmp directory, which is never loaded). */
void stop_install(void);
/* The signal that asked for a stop (SIGUSR1, SIGTERM), 0 if none. */
int stop_signal(void);
/* Test hook (testhooks.h pause_at_step, docs/metrics.md): wait, in 10 ms
 * sleeps and at most about 60 s, until a stop signal has been received. */
void stop_test_wait_signal(void);
/* Test hook gate (testhooks.h), "STEP:FILE[,STEP:FILE]...": after step STEP, wait
 * (10 ms sleeps, at most about 120 s, or until a stop signal) for FILE to
 * exist, so a test can change the world (stop a server) at a known step. */
void stop_test_gate(int step);

/* Under Slurm (SLURM_JOB_ID set) with before_s > 0: find the job's end time
 * (SLURM_JOB_END_TIME, else `squeue -h -j ID -o %e`) and arm the deadline.
 * Prints what it found; a job without a limit disarms it. */
void stop_deadline_init(double before_s);
/* 1 once the wall clock is within before_s of the job's end. */
int stop_deadline_reached(void);

#endif
