/* main: the command line — flags, subcommands and wiring to the modules.
 * No numerics live here. */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <yaml.h>
#include <zstd.h>

#include "backend.h"
#include "bench.h"
#include "ckpt.h"
#include "ckpt_bench.h"
#include "comm.h"
#include "compare.h"
#include "config.h"
#include "doctor.h"
#include "hf.h"
#include "plan.h"
#include "prepare.h"
#include "report.h"
#include "train.h"
#include "util.h"

static const char *usage =
    "kiln: pre-train transformer language models\n"
    "\n"
    "usage:\n"
    "  ./train CONFIG.yaml [--set key.path=value]... [--dry-run] [--resume auto|DIR [--force]]\n"
    "  ./train prepare --tokenizer byte|gpt2 [--vocab FILE] --out DIR [--format text|jsonl]\n"
    "                  [--doc file|line] [--eot|--no-eot] [--threads N] [options] FILE...\n"
    "                              text or JSON lines -> token shards (./train prepare --help)\n"
    "  ./train bench CONFIG.yaml [--steps N] [--set ...]\n"
    "                              time whole training steps on random tokens next to\n"
    "                              the backend's matmul rate at the model's shapes\n"
    "  ./train bench CONFIG.yaml --checkpoint [--dir DIR] [--reps N] [--keep] [--set ...]\n"
    "                              write, verify and load the model's fp32 state (random,\n"
    "                              no training) next to a raw write and read of the same\n"
    "                              size in DIR (default RUN_DIR/bench_checkpoint), as ratios;\n"
    "                              under mpirun each rank takes its share (aggregate rates)\n"
    "  ./train plan CONFIG.yaml --gpus N [--nodes K] [--hardware NAME|FILE] [--gpu-mem GB]\n"
    "               [--search [--top K]] [--json] [--show-schedule] [--auto-sets] [--set ...]\n"
    "                              check the parallel layout on N GPUs (ranks and batch divide,\n"
    "                              memory per rank fits, predicted step time and MFU) and say\n"
    "                              what to change; exit 2 if it does not fit. --search ranks\n"
    "                              every layout kiln runs that fits (dp/tp/pp/cp/ep, ZeRO,\n"
    "                              micro-batch, recompute); --json for scripts (docs/planner.md);\n"
    "                              --auto-sets: the best layout's --set flags when\n"
    "                              parallel.layout is auto (scripts/train.sbatch)\n"
    "  ./train status RUN_DIR [--stale-after S]\n"
    "                              where a run stands: last step, loss, tokens/s, ETA,\n"
    "                              checkpoints, stale ranks, ranks by slowness\n"
    "  ./train report RUN_DIR [RUN_DIR...] [-o FILE]\n"
    "                              one self-contained HTML page of charts (loss, lr, grad\n"
    "                              norm, tokens/s, MFU), runs overlaid; default RUN_DIR/report.html\n"
    "  ./train doctor RUN_DIR [--stuck-after S] [--slow-ms MS]\n"
    "                              after a hang, crash or SIGUSR2 snapshot: read every rank's\n"
    "                              flight recorder (RUN_DIR/flight/) and heartbeat; name the\n"
    "                              collective the ranks disagree on and who never posted it,\n"
    "                              crashed ranks, the slowest rank per phase; exit 3 when it\n"
    "                              names a culprit, 0 when not, 2 on bad input\n"
    "                              norm, tokens/s, MFU, per-rank timings), runs overlaid, the\n"
    "                              config keys that differ; default RUN_DIR/report.html\n"
    "  ./train compare RUN_A RUN_B [RUN...]\n"
    "                              runs side by side: config keys that differ, loss at equal\n"
    "                              tokens, tokens/s and MFU, and a verdict line\n"
    "  ./train ckpt-info CKPT_DIR  print a checkpoint's manifest, verify every checksum,\n"
    "                              and print a checksum of the parameters and of all state\n"
    "  ./train ckpt-diff A B [--tol X] [--quiet]\n"
    "                              largest absolute difference of every tensor of two\n"
    "                              checkpoints, whatever ranks or ZeRO stage wrote them;\n"
    "                              exit 1 if a parameter differs by more than X\n"
    "  ./train export CKPT_DIR --format hf --out DIR [--dtype fp32|bf16] [--max-shard-size 5GB]\n"
    "                              write a checkpoint (or a run directory's newest) as a\n"
    "                              HuggingFace model: model.safetensors (or shards and\n"
    "                              model.safetensors.index.json past the size), config.json,\n"
    "                              generation_config.json (GPT-2, Llama, OLMoE-style MoE);\n"
    "                              init.from: DIR loads such a directory back\n"
    "  ./train export CKPT_DIR --format llmc --out FILE.bin\n"
    "                              the same as llm.c's GPT-2 checkpoint (version 3, fp32)\n"
    "  ./train config-doc          print the reference of every config key (docs/config.md)\n"
    "  ./train --version           version, commit, backends and libraries\n"
    "  ./train --help              this text\n"
    "\n"
    "flags:\n"
    "  --set key.path=value   override one config key; the value is read as YAML\n"
    "                         (e.g. --set optim.lr=3e-4 --set optim.betas=[0.9,0.999]);\n"
    "                         repeatable\n"
    "  --resume auto|DIR      continue from the newest valid checkpoint under the run's\n"
    "                         checkpoints/ (skipping corrupt ones; fresh start if none), or\n"
    "                         from checkpoint directory DIR (any problem exits 2)\n"
    "  --force                with --resume: accept config changes that are refused by\n"
    "                         default but well defined: data.train (sources, weights or\n"
    "                         their shards; each source continues from its saved\n"
    "                         position) and batch.total_tokens\n"
    "  --dry-run              print parameters, FLOPs per token, memory per buffer group\n"
    "                         (activations as model.recompute says), tokens per step and\n"
    "                         in total, then exit without training\n"
    "\n"
    "tracking: metrics.mlflow DIR files the run in an MLflow file store; monitor.prometheus_file\n"
    "PATH keeps a node-exporter textfile; RUN_DIR/summary.json says how the run ended\n"
    "(docs/metrics.md)\n"
    "\n"
    "several ranks (data parallelism, parallel.dp / parallel.zero; tensor parallelism,\n"
    "parallel.tp / parallel.sequence_parallel; context parallelism, parallel.cp /\n"
    "parallel.cp_attention; expert parallelism, parallel.ep): scripts/launch.sh NP\n"
    "CONFIG.yaml [flags], or srun --mpi=pmix / sbatch scripts/train.sbatch (docs/parallel.md)\n"
    "\n"
    "exit codes: 0 done, 1 runtime failure, 2 bad usage or input, 75 stopped on a signal\n"
    "(resume me); ./train doctor: 3 culprit found. A hung job: kill -USR2 (or scancel\n"
    "--signal=USR2) writes each rank's flight recorder without stopping it, then\n"
    "./train doctor RUN_DIR (docs/parallel.md, \"Debugging hangs\"). See README.md and docs/.\n";

static void print_version(void) {
    printf("kiln %s (commit %s)\n", KILN_VERSION, KILN_COMMIT);
    printf("backends: %s\n", backend_list());
    if (backend_build_info()[0]) printf("%s\n", backend_build_info());
    printf("%s\n", comm_nccl_build_info());
    printf("libraries: OpenBLAS %s | libyaml %s | zstd %s\n", openblas_get_config(), yaml_get_version_string(),
           ZSTD_versionString());
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fputs(usage, stderr);
        return KILN_EXIT_USAGE;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 || strcmp(cmd, "help") == 0) {
        fputs(usage, stdout);
        return KILN_EXIT_OK;
    }
    if (strcmp(cmd, "--version") == 0 || strcmp(cmd, "version") == 0) {
        print_version();
        return KILN_EXIT_OK;
    }
    if (strcmp(cmd, "prepare") == 0) return prepare_main(argc - 1, argv + 1);
    if (strcmp(cmd, "ckpt-info") == 0) return ckpt_info_main(argc - 1, argv + 1);
    if (strcmp(cmd, "export") == 0) return hf_export_main(argc - 1, argv + 1);
    if (strcmp(cmd, "ckpt-diff") == 0) return ckpt_diff_main(argc - 1, argv + 1);
    if (strcmp(cmd, "plan") == 0) return plan_main(argc - 1, argv + 1);
    if (strcmp(cmd, "status") == 0) return report_status_main(argc - 1, argv + 1);
    if (strcmp(cmd, "report") == 0) return report_html_main(argc - 1, argv + 1);
    if (strcmp(cmd, "doctor") == 0) return doctor_main(argc - 1, argv + 1);
    if (strcmp(cmd, "compare") == 0) return compare_main(argc - 1, argv + 1);
    if (strcmp(cmd, "config-doc") == 0) {
        cfg_write_doc(stdout);
        return KILN_EXIT_OK;
    }

    int bench = strcmp(cmd, "bench") == 0, bench_steps = 5, bench_ckpt = 0;
    CkptBenchOptions cbo = {NULL, 3, 0};
    const char *config_path = NULL;
    const char **sets = xcalloc((size_t)argc, sizeof(char *));
    int nsets = 0, dry_run = 0, force = 0;
    const char *resume = NULL;
    for (int i = 1 + bench; i < argc; i++) {
        const char *a = argv[i];
        if (bench && strcmp(a, "--steps") == 0 && i + 1 < argc) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 1 || v > 100000) kiln_fail(KILN_EXIT_USAGE, "--steps: expected a count in [1, 100000], got '%s'", argv[i]);
            bench_steps = (int)v;
        } else if (bench && strcmp(a, "--checkpoint") == 0) {
            bench_ckpt = 1;
        } else if (bench && strcmp(a, "--dir") == 0 && i + 1 < argc) {
            cbo.dir = argv[++i];
        } else if (bench && strcmp(a, "--keep") == 0) {
            cbo.keep = 1;
        } else if (bench && strcmp(a, "--reps") == 0 && i + 1 < argc) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 1 || v > 64) kiln_fail(KILN_EXIT_USAGE, "--reps: expected a count in [1, 64], got '%s'", argv[i]);
            cbo.reps = (int)v;
        } else if (strcmp(a, "--set") == 0) {
            if (i + 1 >= argc) kiln_fail(KILN_EXIT_USAGE, "--set needs key.path=value");
            sets[nsets++] = argv[++i];
        } else if (strncmp(a, "--set=", 6) == 0) {
            sets[nsets++] = a + 6;
        } else if (strcmp(a, "--dry-run") == 0) {
            dry_run = 1;
        } else if (!bench && strcmp(a, "--resume") == 0) {
            if (i + 1 >= argc) kiln_fail(KILN_EXIT_USAGE, "--resume needs `auto` or a checkpoint directory");
            resume = argv[++i];
        } else if (!bench && strncmp(a, "--resume=", 9) == 0) {
            resume = a + 9;
        } else if (!bench && strcmp(a, "--force") == 0) {
            force = 1;
        } else if (a[0] == '-') {
            kiln_fail_hint(KILN_EXIT_USAGE, "./train --help lists the flags", "unknown flag '%s'", a);
        } else if (!config_path) {
            config_path = a;
        } else {
            kiln_fail(KILN_EXIT_USAGE, "more than one config file given ('%s' and '%s')", config_path, a);
        }
    }
    if (!config_path) kiln_fail(KILN_EXIT_USAGE, "no config file given (./train --help)");
    Config cfg;
    cfg_load(&cfg, config_path, sets, nsets);
    free(sets);
    if (bench && bench_ckpt) return ckpt_bench_run(&cfg, &cbo);
    if (bench) return bench_run(&cfg, bench_steps);
    if (force && !resume) kiln_fail(KILN_EXIT_USAGE, "--force only applies with --resume");
    TrainOptions topt = {dry_run, resume, force, KILN_COMMIT};
    return train_run_with(&cfg, &topt);
}
