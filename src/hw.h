/* hw: the machines ./train plan costs a layout on. A profile is one GPU's
 * memory, compute and HBM, and the links it reaches its peers by: inside a
 * node (NVLink) and between nodes (its share of the node's NICs). The
 * built-in table holds the GPUs people train on (sources: docs/planner.md);
 * `--hardware FILE.yaml` reads the user's own; `cpu` measures this machine
 * (sgemm per thread count, memory bandwidth) once and caches the result.
 * Pure data and measurement: knows no model, config or layout. */
#ifndef KILN_HW_H
#define KILN_HW_H

#include <stddef.h>
#include <stdio.h>

typedef struct HwProfile {
    char name[64];
    double mem_bytes;      /* one device's memory a run can use */
    double flops_bf16;     /* dense peak FLOP/s, bf16 tensor cores (cpu: the measured sgemm, fp32) */
    double flops_fp8;      /* dense peak FLOP/s, fp8 (0: none) */
    double flops_fp32;     /* dense peak FLOP/s, fp32 (the CUDA fp32 path runs SIMT/TF32-free) */
    double gemm_eff;       /* fraction of the peak a large, square-ish product reaches */
    double hbm_bw;         /* bytes/s one device reads or writes its memory at */
    int gpus_per_node;     /* devices behind one intra-node link (GB200 NVL72: the NVLink domain, 72) */
    double intra_bw;       /* bytes/s one device sends to its node's peers, one direction */
    double inter_bw;       /* bytes/s one device sends off the node: its share of the NICs, one direction */
    int nics_per_node;
    double intra_lat;      /* seconds per message hop inside a node */
    double inter_lat;      /* seconds per message hop between nodes */
    int threads;           /* cpu: the thread count the rates are for (0: a GPU) */
    double node_flops;     /* cpu: FLOP/s of the whole machine with every core busy, which its ranks share
                            * (2 vCPUs of one physical core give far less than twice one); 0: no such limit */
    char source[160];      /* where the figures come from: "builtin", the file, "measured ..." */
} HwProfile;

/* The built-in profiles' names, "h100, h200, ..." (for usage and errors). */
const char *hw_builtin_names(void);
/* Fill *out with the built-in profile `name` (case-insensitive: "h100",
 * "H100-SXM", ...). Returns 0, or -1 if there is none. */
int hw_builtin(const char *name, HwProfile *out);
/* A YAML profile: every key of HwProfile in the units docs/planner.md gives
 * (memory_gib, bf16_tflops, hbm_gbps, intra_gbps, intra_latency_us, ...),
 * optionally `base: h100` to start from a built-in. An unknown key, a
 * missing one without a base, or a value out of range exits 2 naming the
 * file and the key. */
void hw_load(const char *path, HwProfile *out);
/* This machine as a profile: the CPU backend's fp32 product rate at 1 .. n
 * threads (the best), memory bandwidth from a copy past the caches, the
 * core count as "GPUs per node" (one rank a core) with the copy's bandwidth
 * and a measured round trip of a pipe between two processes as the intra-node
 * link. Cached as YAML under $KILN_CACHE, else $XDG_CACHE_HOME/kiln, else
 * ~/.cache/kiln (cpu-<cores>-<hash of the CPU's model name>.yaml); a cached file is
 * read instead of measuring again. `fresh` measures anyway. */
void hw_cpu(HwProfile *out, int fresh);
/* name = "cpu", a built-in name, or a YAML file's path. */
void hw_resolve(const char *name, HwProfile *out);
/* The profile as YAML (the format hw_load reads). */
void hw_write_yaml(const HwProfile *p, FILE *f);

#endif
