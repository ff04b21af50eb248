#!/usr/bin/env bash
# The whole model on the CUDA backend, on the CPU: builds test/model_emu_cuda.cc
# (every file of cuda/, matmul.cu over test/cublaslt_emu.h's cuBLASLt, under
# test/cuda_emu.h) with the host C++ compiler, links it with src/model.c,
# src/optim.c and the CPU backend (the reference), and runs test/model_emu.c:
# a few AdamW steps of a small GPT-2, two Llamas and two MoE models in fp32
# and bf16 compared with the CPU (one line per check). Then test/bench_attention
# on the same emulated backend at its small shape, so the bench that
# scripts/cuda_check.sh runs on a GPU keeps working: every path runs and
# agrees with SIMT, and auto takes the tensor cores (the emulation has no
# cuDNN). Needs no GPU and no nvcc; skips without g++.
set -u
cd "$(dirname "$0")/.."
. test/emu_lib.sh
emu_setup model_emu
emu_host_objs src/model.c src/model_plan.c src/model_init.c src/model_fp8.c src/testhooks.c src/fp8.c src/arch.c src/optim.c src/cpu/backend_cpu.c src/backend.c src/util.c
# shellcheck disable=SC2086
{ "$CXX" $EMU_CXXFLAGS -c -o "$tmp/cuda.o" test/model_emu_cuda.cc &&
  "$CC" -std=c11 -O2 -fopenmp -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter -Isrc -Itest \
      -c -o "$tmp/model_emu.o" test/model_emu.c &&
  "$CXX" $UBSAN -o "$tmp/emu" "$tmp/model_emu.o" "$tmp/cuda.o" "$tmp"/model.o "$tmp"/model_plan.o "$tmp"/model_init.o "$tmp"/model_fp8.o "$tmp"/testhooks.o "$tmp"/fp8.o "$tmp"/arch.o "$tmp"/optim.o "$tmp"/backend_cpu.o \
      "$tmp"/backend.o "$tmp"/util.o $EMU_LIBS; } >"$tmp/build.log" 2>&1 || emu_build_failed
emu_run

# bench_attention: backend.c with the CUDA entry (-DKILN_CUDA), the rest as above
# shellcheck disable=SC2086
{ "$CC" -std=c11 -O2 -D_GNU_SOURCE -DKILN_CUDA -Isrc -c -o "$tmp/backend_reg.o" src/backend.c &&
  "$CC" -std=c11 -O2 -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter -Isrc -Itest -c -o "$tmp/bench_attention.o" \
      test/bench_attention.c &&
  "$CXX" $UBSAN -o "$tmp/bench" "$tmp/bench_attention.o" "$tmp/cuda.o" "$tmp"/backend_cpu.o "$tmp"/fp8.o \
      "$tmp"/backend_reg.o "$tmp"/util.o $EMU_LIBS; } >"$tmp/bench_build.log" 2>&1 ||
    { echo "FAIL bench_attention_emu_build: $(grep -m3 -E 'error|undefined' "$tmp/bench_build.log" | head -c 600)"; exit 0; }
"$tmp/bench" cuda bf16 0 small > "$tmp/bench.txt" 2>&1
# simt, tensor_cores, auto; errors vs SIMT within the self-check's 2e-2 (cuda/attention.cu ATT_CHECK_TOL)
python3 - "$tmp/bench.txt" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
rows = {m.group(1): m.group(0) for m in re.finditer(r"^bench_attention shape=small impl=(\S+) .*$", text, re.M)}
errs = [float(x) for r in rows.values() for x in re.findall(r"err_\w+=(\S+)", r)]
auto = re.search(r"^bench_attention_auto shape=small path=(\S+) .*fwd_target=\w+ bwd_target=\w+$", text, re.M)
ok = set(rows) == {"simt", "tensor_cores", "auto"} and errs and max(errs) <= 2e-2 and auto and auto.group(1) == "tensor_cores"
tail = text.strip().splitlines()[-1][:300] if text.strip() else "no output"
print(("ok bench_attention_emu # paths %s, max err vs simt %.1e, auto took %s" % (sorted(rows), max(errs), auto.group(1)))
      if ok else "FAIL bench_attention_emu: paths %s, errors %s, auto %s; last line: %s" %
      (sorted(rows), errs, auto.group(1) if auto else None, tail))
EOF
