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
#
# The manifest (SOURCES.sha256) is every input of the build and of the check:
# main.c, the Makefile, src/ (src/cpu too), cuda/, the test/ sources the
# bundled test binaries are built from (read off the build's own dependency
# files, build/test/*.d, so a header they include is never left out),
# scripts/cuda_check.sh, configs/ and data/austen.txt (the check's runs read
# them). cuda_check.sh refuses a bundle when a listed file differs or is
# missing, or when a file of main.c, Makefile, src/, cuda/, configs/ or the
# script is not listed.
# `scripts/gpu_bundle.sh --manifest ROOT` prints the manifest of a copy of
# this checkout at ROOT, from this checkout's git index and build/test/*.d,
# for test/t_gpu_check.sh, which packs a bundle of this build.
set -euo pipefail
cd "$(dirname "$0")/.."
BINS="train build/test/test_ops build/test/test_backend_cross build/test/test_nccl build/test/bench_attention"
# manifest BUILT ROOT: sha256 lines of every input, hashed in ROOT; the test/
# files are those the dependency files of the build in BUILT name
manifest() {
    local built=$1 root=$2 deps
    deps=$(cd "$built" && for b in $BINS; do [ "${b#build/test/}" = "$b" ] || cat "$b.d"; done |
        tr ' \\' '\n\n' | grep '^test/[^:]*$' | sort -u)
    [ -n "$deps" ] || { echo "gpu_bundle: no build/test/*.d in $built: build the test binaries first" >&2; return 1; }
    { git ls-files main.c Makefile src cuda configs scripts/cuda_check.sh data/austen.txt; echo "$deps"; } |
        sort -u | (cd "$root" && xargs sha256sum)
}
if [ "${1:-}" = --manifest ]; then manifest . "${2:?usage: scripts/gpu_bundle.sh --manifest ROOT}"; exit; fi
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
    echo "gpu_bundle: the tree has uncommitted changes; commit them first (the bundle is built from HEAD)" >&2
    exit 2
fi
# an untracked file here would travel to the GPU machine, be missing from the
# manifest, and make the check refuse the bundle there: say so now
untracked=$(git ls-files --others --exclude-standard main.c Makefile src cuda configs scripts/cuda_check.sh | head -n 3 | tr '\n' ' ')
if [ -n "$untracked" ]; then
    echo "gpu_bundle: untracked ${untracked}would travel and not match the manifest; commit or remove it" >&2
    exit 2
fi
command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ] || {
    echo "gpu_bundle: no nvcc here: the bundle needs the CUDA backend built in" >&2; exit 2; }
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
# What the binaries were built from (the clone is HEAD, as the tree is), so
# cuda_check.sh can tell a stale bundle from a current one on a machine that
# has the tree but not its git history.
manifest "$tmp/src" "$tmp/src" > .gpu/SOURCES.sha256.tmp
mv .gpu/SOURCES.sha256.tmp .gpu/SOURCES.sha256
echo "gpu_bundle: .gpu/kiln-gpu.tar.xz ($(du -h .gpu/kiln-gpu.tar.xz | cut -f1), commit $commit)"
echo "gpu_bundle: manifest .gpu/SOURCES.sha256, $(wc -l < .gpu/SOURCES.sha256) files"
echo "on the GPU machine (docs/gpu.md): carry .gpu and run OUT=\$OUT bash scripts/cuda_check.sh --limit 400 (timeout_s 450)"
