/* mlflow_rest: the run on an MLflow tracking server, through its REST API
 * (docs/metrics.md "MLflow"), for src/mlflow.c only. One background thread
 * talks to the server; the caller never waits on the network, and no secret
 * (token, password) is ever written to a file or a log line. */
#ifndef KILN_MLFLOW_REST_H
#define KILN_MLFLOW_REST_H

#include "mlflow.h"

typedef struct MlRest MlRest;

/* Create or continue the run, queue params, tags and the config artifact,
 * start the sender. A server that refuses (401, 403, 404) exits 2, or with
 * o->required == 0 warns and returns NULL; one that does not answer is
 * tried again in the background while points spool. */
MlRest *mlrest_open(const MlflowOptions *o);
void mlrest_log(MlRest *r, const char *key, double value, int step);
void mlrest_flush(MlRest *r);
void mlrest_tag(MlRest *r, const char *key, const char *value);
/* Queue a copy of file src as artifact `name` (0, or -1 if unreadable). */
int mlrest_artifact(MlRest *r, const char *src, const char *name);
/* A file under RUN_DIR/mlflow-artifacts/ for writers that make it in place;
 * mlrest_artifact_written queues it. */
const char *mlrest_artifact_path(MlRest *r, const char *name);
void mlrest_artifact_written(MlRest *r, const char *name);
/* Queue the final status, wait at most metrics.mlflow_flush_s for all of it
 * to reach the server, say how many points stay in the spool. */
void mlrest_end(MlRest *r, int exit_code);
void mlrest_close(MlRest *r);
const char *mlrest_uri(const MlRest *r);
const char *mlrest_run_id(const MlRest *r);
const char *mlrest_experiment_id(const MlRest *r);
/* Points logged and not yet confirmed by the server (queue and spool). */
long mlrest_pending(const MlRest *r);

#endif
