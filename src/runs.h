/* runs: reading the run directories metrics.c writes -- metrics.jsonl,
 * config.yaml, ranks.json and ranks.jsonl -- into plain arrays, for
 * `./train status`, `report` and `compare`. Reads only; never writes. */
#ifndef KILN_RUNS_H
#define KILN_RUNS_H

#include <stddef.h>

/* The metrics.jsonl fields a Run holds, one array each. */
enum { RUN_STEP, RUN_TOKENS, RUN_LOSS, RUN_VAL, RUN_LR, RUN_GN, RUN_TPS, RUN_MFU, RUN_STEPT, RUN_ELAPSED, RUN_ETA,
       RUN_TIME, RUN_RSS, RUN_SKIP, RUN_WAIT, RUN_NF };
/* Fields named by the runs' data, found while reading: "val/<set>" of each
 * named validation set and "tokens/<source>" of each "tokens_by_source"
 * entry; field RUN_NF + k of every run loaded so far is runs_extra_name(k)
 * (NAN where a run lacks it). */
#define RUNS_MAX_EXTRA 48
#define RUNS_MAX_WORLD (1 << 22) /* ranks.jsonl's arrays (doctor reads ranks up to the same) */
#define RUN_NFX (RUN_NF + RUNS_MAX_EXTRA)
int runs_n_extra(void);
const char *runs_extra_name(int k);

typedef struct Run {
    char dir[1024];
    char name[256];
    int steps_total;      /* train.steps from config.yaml; 0 if unknown */
    char *config;         /* config.yaml text, or NULL */
    int n, cap;
    double *v[RUN_NFX];   /* v[field][row]; NAN where absent or null */
} Run;

/* Load RUN_DIR; exits 2 naming the directory when it holds no run. */
void runs_load(Run *r, const char *dir);
void runs_free(Run *r);
/* Runs that share a run.name get "name (shortest distinct tail of the dir)". */
void runs_label(Run *runs, int n);
/* Last row with a finite value of field f (-1: none). */
int runs_last_row(const Run *r, int f);
/* Median of field f over the last half of the rows (past start-up); NAN if none. */
double runs_recent_median(const Run *r, int f);
/* Value of "key": in one line [line, end) of flat JSON; NAN if absent or null. */
double runs_json_field(const char *line, const char *end, const char *key);
/* The same as a whole int: dflt where absent, null, not finite or outside int's range. */
int runs_json_int(const char *line, const char *end, const char *key, int dflt);
/* "5m 02s", "1h 04m 00s", "-" for a non-finite or negative s. */
void runs_fmt_duration(double s, char *buf, size_t cap);

/* The keys whose values differ between the runs' config.yaml files, in the
 * order of the first run's file (then keys only later runs have); run.name
 * and run.dir are left out. val[k * n + i] is run i's value of key k, NULL
 * where its config lacks the key. */
typedef struct RunsConfigDiff {
    int nkeys, nruns;
    char **key;
    char **val;
} RunsConfigDiff;
void runs_config_diff(const Run *runs, int n, RunsConfigDiff *d);
void runs_config_diff_free(RunsConfigDiff *d);

/* ranks.jsonl (with several ranks): every logged step's timings per rank. */
#define RUNS_GROUPS 4
typedef struct RunRanks {
    int world, nlines;
    char (*host)[64];            /* [world], from ranks.json ("?" if absent) */
    int ngroups;
    char group[RUNS_GROUPS][16]; /* "dp", ... from the comm_<g>_s keys */
    int *step;                   /* [nlines] */
    double *busy, *data, *compute, *stept; /* [nlines][world] */
    double *comm[RUNS_GROUPS];   /* [nlines][world] */
} RunRanks;
/* 1 if dir has a ranks.jsonl with at least one line, else 0 (t zeroed).
 * Lines of another number of ranks than the last line's (a resume onto
 * another layout) are left out. */
int runs_ranks_load(RunRanks *t, const char *dir);
void runs_ranks_free(RunRanks *t);
/* Means per rank of lines [from, nlines) into out[world] for one series
 * (t->busy, t->data, ...). */
void runs_ranks_mean(const RunRanks *t, const double *series, int from, double *out);

#endif
