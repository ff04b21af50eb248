#!/usr/bin/env bash
# kiln's GPT-2 encoder against tiktoken (built from the same local rank file by
# test/tiktoken_ref.py) on a 200 KB slice of data/austen.txt, a hand-written
# tricky text, seeded multi-script noise and long pieces: the token ids must be
# identical.
# Prints "skip ..." when the vocabulary or tiktoken cannot be had (no network),
# a skip test/run.sh fails under CI=true.
set -u
cd "$(dirname "$0")/.."
tmp=${KILN_TEST_TMP:-$(mktemp -d)}/tiktoken
mkdir -p "$tmp"
vocab=data/cache/gpt2.tiktoken
bin=build/test/test_tokenizer
if ! bash scripts/fetch_gpt2_vocab.sh >"$tmp/fetch.log" 2>&1; then
    echo "skip tokenizer_tiktoken: no GPT-2 vocabulary ($(tail -n 1 "$tmp/fetch.log"))"
    exit 0
fi
# tiktoken from the tools venv (test/lib.sh tools_python)
T=$tmp
. test/lib.sh
tools_python tokenizer_tiktoken || exit 0
if [ ! -x "$bin" ]; then
    echo "FAIL tokenizer_tiktoken: $bin not built (make $bin)"
    exit 0
fi
# A slice from the middle of the corpus, cut at line boundaries.
tail -c +2000001 data/austen.txt | head -c 200000 | sed '1d;$d' >"$tmp/austen.txt"
"$TOOLS_PY" test/tiktoken_ref.py --tricky "$tmp/tricky.txt"
"$TOOLS_PY" test/tiktoken_ref.py --fuzz "$tmp/fuzz.txt" 1234
"$TOOLS_PY" test/tiktoken_ref.py --long "$tmp/long.txt" 99
for name in austen tricky fuzz long; do
    f="$tmp/$name.txt"
    if ! "$TOOLS_PY" test/tiktoken_ref.py "$vocab" "$f" >"$tmp/$name.ref" 2>"$tmp/$name.err"; then
        echo "FAIL tokenizer_tiktoken_$name: tiktoken failed: $(tail -n 1 "$tmp/$name.err")"
        continue
    fi
    if ! "$bin" --encode "$f" "$vocab" >"$tmp/$name.kiln" 2>"$tmp/$name.err"; then
        echo "FAIL tokenizer_tiktoken_$name: kiln encoder failed: $(tail -n 1 "$tmp/$name.err")"
        continue
    fi
    if cmp -s "$tmp/$name.ref" "$tmp/$name.kiln"; then
        echo "ok tokenizer_tiktoken_$name"
    else
        first=$(diff "$tmp/$name.ref" "$tmp/$name.kiln" | head -n 1)
        echo "FAIL tokenizer_tiktoken_$name: ids differ ($(wc -l <"$tmp/$name.ref") tiktoken vs" \
             "$(wc -l <"$tmp/$name.kiln") kiln; first diff $first)"
    fi
done
