/* mlflow: a run filed in MLflow: on a tracking server through its REST API
 * (metrics.mlflow http(s)://..., src/mlflow_rest.c), or in a file store
 * written from C as MLflow's own FileStore lays it out (a directory: `mlflow
 * ui --backend-store-uri DIR` and MLflow's client read it). Rank 0 only;
 * never talks to other ranks or touches training state. */
#ifndef KILN_MLFLOW_H
#define KILN_MLFLOW_H

typedef struct Mlflow Mlflow;

typedef struct MlflowOptions {
    const char *store;       /* metrics.mlflow: the store's root directory, or an http(s) server */
    const char *experiment;  /* metrics.mlflow_experiment, created when missing */
    const char *run_dir;     /* kiln's run directory: RUN_DIR/mlflow.json remembers the run */
    const char *run_name;
    const char *config_yaml; /* resolved config: the params (flattened keys) and an artifact */
    const char *host;
    int start_step;          /* > 0: resumed; continue the run RUN_DIR/mlflow.json names */
    double flush_s;          /* server: metrics.mlflow_flush_s */
    int required;            /* server: metrics.mlflow_required */
} MlflowOptions;

/* 1 when metrics.mlflow names a tracking server (http:// or https://). */
int mlflow_is_server(const char *store);

/* Find or create the experiment, create the run (or reopen it on a resume,
 * keeping its metrics up to start_step), write params, tags and the config
 * artifact. Exits 1 naming the path when the store cannot be written; a
 * server that refuses exits 2, or returns NULL (no tracking) when
 * o->required is 0. */
Mlflow *mlflow_open(const MlflowOptions *o);
/* One metric value at a step; non-finite values are left out (as in
 * TensorBoard). Lines reach the file at mlflow_flush. */
void mlflow_log(Mlflow *m, const char *key, double value, int step);
void mlflow_flush(Mlflow *m);
void mlflow_tag(Mlflow *m, const char *key, const char *value);
/* Copy file src into the run's artifacts as `name` (0, or -1 if unreadable). */
int mlflow_artifact(Mlflow *m, const char *src, const char *name);
/* Where artifact `name` goes, for writers that make it in place; then
 * mlflow_artifact_written(name). */
const char *mlflow_artifact_path(Mlflow *m, const char *name);
void mlflow_artifact_written(Mlflow *m, const char *name);
/* End the run: flush, status FINISHED (exit 0), KILLED (75: stopped,
 * resumable) or FAILED (anything else), end time. Once; from here on writes
 * that fail warn instead of exiting, and metrics are no longer taken. */
void mlflow_end(Mlflow *m, int exit_code);
/* Close the files and free (after mlflow_end, or for a run left RUNNING). */
void mlflow_close(Mlflow *m);
const char *mlflow_store(const Mlflow *m); /* absolute directory, or the server's URL */
/* Points not yet on the server (0 for a file store). */
long mlflow_pending(const Mlflow *m);
const char *mlflow_run_id(const Mlflow *m);
const char *mlflow_experiment_id(const Mlflow *m);

#endif
