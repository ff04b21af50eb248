/* main: the command line — flags, subcommands and wiring to the modules.
 * No numerics live here. */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <yaml.h>
#include <zstd.h>

#include "bench.h"
#include "config.h"
#include "prepare.h"
#include "train.h"
#include "util.h"

static const char *usage =
    "kiln: pre-train transformer language models\n"
    "\n"
    "usage:\n"
    "  ./train CONFIG.yaml [--set key.path=value]... [--dry-run]\n"
    "  ./train prepare --tokenizer byte|gpt2 [--vocab FILE] --out DIR [options] FILE...\n"
    "  ./train bench CONFIG.yaml [--steps N] [--set ...]\n"
    "                              time whole training steps on random tokens next to\n"
    "                              the backend's matmul rate at the model's shapes\n"
    "  ./train config-doc          print the reference of every config key (docs/config.md)\n"
    "  ./train --version           version, commit, backends and libraries\n"
    "  ./train --help              this text\n"
    "\n"
    "flags:\n"
    "  --set key.path=value   override one config key; the value is read as YAML\n"
    "                         (e.g. --set optim.lr=3e-4 --set optim.betas=[0.9,0.999]);\n"
    "                         repeatable\n"
    "  --dry-run              print parameters, FLOPs per token, memory per buffer group,\n"
    "                         tokens per step and in total, then exit without training\n"
    "\n"
    "exit codes: 0 done, 1 runtime failure, 2 bad usage or input, 75 stopped on a signal\n"
    "(resume me). See README.md and docs/.\n";

static void print_version(void) {
    printf("kiln %s (commit %s)\n", KILN_VERSION, KILN_COMMIT);
    printf("backends: cpu\n");
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
    if (strcmp(cmd, "config-doc") == 0) {
        cfg_write_doc(stdout);
        return KILN_EXIT_OK;
    }

    int bench = strcmp(cmd, "bench") == 0, bench_steps = 5;
    const char *config_path = NULL;
    const char **sets = xcalloc((size_t)argc, sizeof(char *));
    int nsets = 0, dry_run = 0;
    for (int i = 1 + bench; i < argc; i++) {
        const char *a = argv[i];
        if (bench && strcmp(a, "--steps") == 0 && i + 1 < argc) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 1 || v > 100000) kiln_fail(KILN_EXIT_USAGE, "--steps: expected a count in [1, 100000], got '%s'", argv[i]);
            bench_steps = (int)v;
        } else if (strcmp(a, "--set") == 0) {
            if (i + 1 >= argc) kiln_fail(KILN_EXIT_USAGE, "--set needs key.path=value");
            sets[nsets++] = argv[++i];
        } else if (strncmp(a, "--set=", 6) == 0) {
            sets[nsets++] = a + 6;
        } else if (strcmp(a, "--dry-run") == 0) {
            dry_run = 1;
        } else if (a[0] == '-') {
            kiln_hint("./train --help lists the flags");
            kiln_fail(KILN_EXIT_USAGE, "unknown flag '%s'", a);
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
    if (bench) return bench_run(&cfg, bench_steps);
    return train_run(&cfg, dry_run);
}
