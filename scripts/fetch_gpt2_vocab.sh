#!/usr/bin/env bash
# Put GPT-2's BPE ranks (tiktoken format) at data/cache/gpt2.tiktoken. The file
# ships in the PyPI source distribution of openai-whisper==20250625
# (whisper/assets/gpt2.tiktoken, MIT); we check its sha256 (tiktoken's own
# r50k_base/gpt2 hash). No-op when the file is already there and checks out.
# Exit 0 on success, 1 on failure (message on stderr).
set -eu
cd "$(dirname "$0")/.."
dest=data/cache/gpt2.tiktoken
want=306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930
check() { [ "$(sha256sum "$1" | cut -c1-64)" = "$want" ]; }
if [ -f "$dest" ] && check "$dest"; then
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp" openai-whisper==20250625 \
        >"$tmp/pip.log" 2>&1; then
    echo "fetch_gpt2_vocab: pip download of openai-whisper==20250625 failed:" >&2
    tail -n 3 "$tmp/pip.log" >&2
    exit 1
fi
sdist=$(ls "$tmp"/openai[-_]whisper-20250625.tar.gz 2>/dev/null | head -n 1)
if [ -z "$sdist" ]; then
    echo "fetch_gpt2_vocab: no openai-whisper sdist in $tmp" >&2
    exit 1
fi
member=$(tar -tzf "$sdist" | grep '/whisper/assets/gpt2.tiktoken$' | head -n 1)
if [ -z "$member" ]; then
    echo "fetch_gpt2_vocab: $sdist has no whisper/assets/gpt2.tiktoken" >&2
    exit 1
fi
tar -xzf "$sdist" -C "$tmp" "$member"
if ! check "$tmp/$member"; then
    echo "fetch_gpt2_vocab: $member: sha256 $(sha256sum "$tmp/$member" | cut -c1-16)..., want ${want:0:16}..." >&2
    exit 1
fi
mkdir -p data/cache
cp "$tmp/$member" "$dest.tmp"
mv "$dest.tmp" "$dest"
echo "fetch_gpt2_vocab: wrote $dest"
