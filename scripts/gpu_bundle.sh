#!/usr/bin/env bash
# gpu_bundle: the binaries `make cuda-check` needs on a GPU machine, built here
# and packed into one file that travels with the tree (`make gpu-bundle`).
# Why: a GPU host often lacks libyaml, zstd, OpenBLAS and MPI, so the binaries
# are built with STATIC=1; each is then ~29 MB, almost all of it the same
# static libraries, and five of them (~147 MB) overflow a 64 MiB transfer.
# Packed with xz they are ~13 MB. cuda_check.sh unpacks .gpu/kiln-gpu.tar.xz
# into a scratch folder (tar -xJf, else python3's tarfile); it never builds.
#
# The build runs in a temporary clone of HEAD (a STATIC build would otherwise
# replace every object of the working tree's own build/), so the bundle is
# exactly the committed code: uncommitted changes are refused, not silently
# left out. Output: .gpu/kiln-gpu.tar.xz, .gpu/COMMIT and .gpu/SOURCES.sha256
# (ignored by git).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
    echo "gpu_bundle: the tree has uncommitted changes; commit them first (the bundle is built from HEAD)" >&2
    exit 2
fi
command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ] || {
    echo "gpu_bundle: no nvcc here: the bundle needs the CUDA backend built in" >&2; exit 2; }
BINS="train build/test/test_ops build/test/test_backend_cross build/test/test_nccl build/test/bench_attention"
tmp=$(mktemp -d /tmp/kiln-gpu-bundle.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
git clone -q . "$tmp/src"
commit=$(git rev-parse --short HEAD)
echo "gpu_bundle: building $commit with STATIC=1 in $tmp/src"
make -C "$tmp/src" -j"$(nproc)" STATIC=1 CUDA=1 $BINS > "$tmp/build.log" 2>&1 || {
    tail -n 30 "$tmp/build.log" >&2; echo "gpu_bundle: build failed (log above)" >&2; exit 1; }
"$tmp/src/train" --version | grep -q 'backends: .*cuda' || {
    echo "gpu_bundle: the built ./train has no CUDA backend" >&2; exit 1; }
mkdir -p .gpu
(cd "$tmp/src" && tar -cf - $BINS) | xz -6 -T"$(nproc)" > .gpu/kiln-gpu.tar.xz.tmp
mv .gpu/kiln-gpu.tar.xz.tmp .gpu/kiln-gpu.tar.xz
echo "$commit" > .gpu/COMMIT
# What the binaries were built from, so cuda_check.sh can tell a stale bundle
# from a current one on a machine that has the tree but not its git history.
git ls-files -z src cuda test Makefile | xargs -0 sha256sum > .gpu/SOURCES.sha256
echo "gpu_bundle: .gpu/kiln-gpu.tar.xz ($(du -h .gpu/kiln-gpu.tar.xz | cut -f1), commit $commit)"
echo "on the GPU machine: carry .gpu and run OUT=\$OUT bash scripts/cuda_check.sh --limit 480 (timeout_s ~540)"
