# kiln — one binary, ./train. `make` builds it, `make run` trains the default,
# `make test` runs the suite, `make bench` measures. `make deps` installs what is
# missing (Debian packages) and is quiet when everything is present.

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

DEB_PKGS := libyaml-dev libzstd-dev libopenblas-openmp-dev zstd python3-numpy
BUILD := build

SRC  := $(wildcard src/*.c src/cpu/*.c)
OBJ  := $(SRC:%.c=$(BUILD)/%.o)
TEST_SRC := $(wildcard test/test_*.c)
TEST_BIN := $(TEST_SRC:test/%.c=$(BUILD)/test/%)

.PHONY: all deps run test bench clean found FORCE
all: found train

found:
	@if [ -f $(BLAS_INC)/cblas.h ]; then echo "✓ OpenBLAS (OpenMP) $(BLAS_DIR)"; else echo "✗ OpenBLAS (OpenMP) not found: make deps"; fi
	@if [ -f /usr/include/yaml.h ]; then echo "✓ libyaml"; else echo "✗ libyaml not found: make deps"; fi
	@if [ -f /usr/include/zstd.h ]; then echo "✓ zstd"; else echo "✗ zstd not found: make deps"; fi
	@if command -v nvcc >/dev/null 2>&1; then echo "✓ nvcc $$(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p') (CUDA backend: not in this build yet)"; else echo "✗ nvcc not found: CPU backend only"; fi

train: $(OBJ) $(BUILD)/main.o
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

test: deps
	@$(MAKE) --no-print-directory all $(TEST_BIN)
	@bash test/run.sh

bench: deps
	@$(MAKE) --no-print-directory all
	@bash scripts/bench.sh

clean:
	rm -rf $(BUILD) train

-include $(OBJ:.o=.d) $(BUILD)/main.d
