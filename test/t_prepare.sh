#!/usr/bin/env bash
# ./train prepare: several encoder threads give shards identical byte for byte
# to one thread (byte and GPT-2 tokenizers, the Austen text and seeded noise
# built to stress the places a piece may be cut); --doc line and --format jsonl
# give the tokens of each document encoded on its own, end-of-text before each;
# without an end-of-text token lines and records are joined by newlines; bad
# JSON and bad flags exit 2 naming the file and line; no progress on a
# non-terminal. One line per check.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_prepare
rm -rf "$T"
mkdir -p "$T"
. test/lib.sh
VOCAB=data/cache/gpt2.tiktoken
TOKS="byte"
if [ -f $VOCAB ]; then TOKS="byte gpt2"; else skip prepare_gpt2 "no $VOCAB (scripts/fetch_gpt2_vocab.sh)"; fi
# tokens FILE...: every shard's tokens as one line of ids (header checked)
tokens() {
    python3 - "$@" <<'PY'
import struct, sys
out = []
for p in sys.argv[1:]:
    b = open(p, "rb").read()
    h = struct.unpack("<256i", b[:1024])
    assert h[0] == 20240520 and h[1] in (1, 2), p
    w = 2 if h[1] == 1 else 4
    out += struct.unpack("<%d%s" % (h[2], "H" if w == 2 else "I"), b[1024:1024 + w * h[2]])
print(" ".join(map(str, out)))
PY
}
# Seeded noise around newlines: runs of spaces, tabs and CR before and after
# them, non-breaking and ideographic spaces, accents, CJK, emoji, digits,
# contractions, punctuation; and invalid UTF-8.
python3 - "$T/noise.txt" <<'PY'
import random, sys
r = random.Random(19)
atoms = ["word", "Word", " the", "é", "中文", "😀", "123", "4", "'s", "'ll", "!!", ".", ",", "--", " ", "  ", "\t",
         "\n", "\n\n", "\r\n", " \n", "\n ", "\u00a0", "\u3000", "\u2028", "x\ny", ".\nA", "a\n1", "\n\nB", "?\n\u00e9"]
s = "".join(r.choice(atoms) for _ in range(60000)).encode("utf-8") + b"\xff\xfe tail\n" + bytes(r.randrange(256) for _ in range(3000))
open(sys.argv[1], "wb").write(s)
PY
head -c 400000 data/austen.txt > "$T/austen.txt"
for tk in $TOKS; do
    v=""; [ $tk = gpt2 ] && v="--vocab $VOCAB"
    ./train prepare --tokenizer $tk $v --out "$T/one_$tk" --shard-tokens 40000 "$T/austen.txt" "$T/noise.txt" >"$T/one_$tk.txt" 2>&1 \
        || fail prepare_one_thread_$tk "$(tail -n 2 "$T/one_$tk.txt")"
    for th in 2 4; do
        # 300-byte pieces: thousands of cuts, each at a newline between words
        KILN_TEST_PREPARE_CHUNK=300 ./train prepare --tokenizer $tk $v --threads $th --out "$T/th${th}_$tk" \
            --shard-tokens 40000 "$T/austen.txt" "$T/noise.txt" >"$T/th${th}_$tk.txt" 2>&1
        pieces=$(sed -n 's/.*(\([0-9]*\) piece(s)).*/\1/p' "$T/th${th}_$tk.txt")
        if diff -r "$T/one_$tk" "$T/th${th}_$tk" >/dev/null && [ "${pieces:-0}" -gt 500 ]; then
            ok prepare_threads${th}_identical_$tk
        else fail prepare_threads${th}_identical_$tk "$pieces pieces; $(diff -rq "$T/one_$tk" "$T/th${th}_$tk" | head -2)"; fi
    done
done
[ -f $VOCAB ] && {
    # the default pieces (1 MB) on 8 threads, the whole Austen text
    ./train prepare --tokenizer gpt2 --out "$T/a1" data/austen.txt >/dev/null 2>&1
    ./train prepare --tokenizer gpt2 --threads 8 --out "$T/a8" data/austen.txt >"$T/a8.txt" 2>&1
    diff -r "$T/a1" "$T/a8" >/dev/null && ok prepare_threads8_austen_gpt2 || fail prepare_threads8_austen_gpt2 "$(tail -n 1 "$T/a8.txt")"
    grep -q $'\r\|encoding' "$T/a8.txt" && fail prepare_no_progress_off_terminal "$(head -c 200 "$T/a8.txt")" \
        || ok prepare_no_progress_off_terminal
}

# Documents: --doc line and jsonl against each document prepared as a file of
# its own (gpt2: end-of-text, then the document's ids); byte: joined by newlines.
python3 - "$T" <<'PY'
import json, random, sys, os
d = sys.argv[1]
r = random.Random(7)
texts = ["First line of a story.", "Second, with 'quotes' and \"double quotes\".", "Tabs\tand unicode é 中文 😀",
         "numbers 12345 and a trailing space ", "x" * 3000, "Line with a \\ backslash and / slash", "A\u2028B"]
texts += [" ".join(r.choice(["alpha", "beta", "gamma", "'s", "!", "42"]) for _ in range(r.randrange(1, 60))) for _ in range(40)]
with open(os.path.join(d, "docs.jsonl"), "w", encoding="utf-8") as f:
    for i, t in enumerate(texts):
        rec = {"id": i, "meta": {"text": "not this one", "tags": ["a", {"b": [1, 2.5e3, None, True]}]}, "text": t}
        if i % 3 == 0: rec = {"text": t, "n": -1.5}
        f.write(json.dumps(rec, ensure_ascii=(i % 2 == 0)) + ("\r\n" if i % 5 == 0 else "\n"))
        if i % 7 == 0: f.write("   \n")
lines = [t for t in texts if "\n" not in t and "\u2028" not in t]
open(os.path.join(d, "lines.txt"), "w", encoding="utf-8").write("\n".join(lines) + "\n\n\n")
for i, t in enumerate(texts):
    open(os.path.join(d, "rec_%03d.txt" % i), "w", encoding="utf-8").write(t)
for i, t in enumerate(lines):
    open(os.path.join(d, "line_%03d.txt" % i), "w", encoding="utf-8").write(t)
open(os.path.join(d, "expect_byte_jsonl.txt"), "w").write(" ".join(" ".join(map(str, (t + "\n").encode("utf-8"))) for t in texts))
open(os.path.join(d, "expect_byte_lines.txt"), "w").write(" ".join(" ".join(map(str, (t + "\n").encode("utf-8"))) for t in lines))
PY
P="--val-fraction 0"
if [ -f $VOCAB ]; then
    ./train prepare --tokenizer gpt2 $P --out "$T/recs" $(ls "$T"/rec_*.txt) >/dev/null 2>&1
    ./train prepare --tokenizer gpt2 $P --format jsonl --out "$T/jl" "$T/docs.jsonl" >"$T/jl.txt" 2>&1
    [ "$(tokens "$T"/jl/train_*.bin)" = "$(tokens "$T"/recs/train_*.bin)" ] && grep -q '47 document(s), each after an end-of-text' "$T/jl.txt" \
        && ok prepare_jsonl_gpt2_eot_per_record || fail prepare_jsonl_gpt2_eot_per_record "$(tail -n 2 "$T/jl.txt")"
    KILN_TEST_PREPARE_CHUNK=64 ./train prepare --tokenizer gpt2 $P --format jsonl --threads 3 --out "$T/jl3" "$T/docs.jsonl" >/dev/null 2>&1
    diff -r "$T/jl" "$T/jl3" >/dev/null && ok prepare_jsonl_threads_identical || fail prepare_jsonl_threads_identical "shards differ"
    ./train prepare --tokenizer gpt2 $P --out "$T/lf" $(ls "$T"/line_*.txt) >/dev/null 2>&1
    ./train prepare --tokenizer gpt2 $P --doc line --out "$T/ll" "$T/lines.txt" >/dev/null 2>&1
    [ "$(tokens "$T"/ll/train_*.bin)" = "$(tokens "$T"/lf/train_*.bin)" ] && ok prepare_doc_line_gpt2_eot_per_line \
        || fail prepare_doc_line_gpt2_eot_per_line "tokens differ"
    # --no-eot: no 50256 at all
    ./train prepare --tokenizer gpt2 $P --no-eot --out "$T/ne" "$T/austen.txt" >/dev/null 2>&1
    tokens "$T"/ne/train_*.bin | tr ' ' '\n' | grep -qx 50256 && fail prepare_no_eot "found 50256" || ok prepare_no_eot
fi
./train prepare --tokenizer byte $P --format jsonl --out "$T/jb" "$T/docs.jsonl" >/dev/null 2>&1
[ "$(tokens "$T"/jb/train_*.bin)" = "$(cat "$T/expect_byte_jsonl.txt")" ] && ok prepare_jsonl_byte_records_by_newline \
    || fail prepare_jsonl_byte_records_by_newline "tokens differ from the records' UTF-8 bytes"
./train prepare --tokenizer byte $P --doc line --out "$T/lb" "$T/lines.txt" >/dev/null 2>&1
[ "$(tokens "$T"/lb/train_*.bin)" = "$(cat "$T/expect_byte_lines.txt")" ] && ok prepare_doc_line_byte_skips_blank \
    || fail prepare_doc_line_byte_skips_blank "tokens differ"

# Bad input: one line naming the file and line, exit 2.
printf '{"text": "fine"}\n{"text": "cut\n' > "$T/bad1.jsonl"
printf '{"text": "fine"}\n\n{"title": "no text"}\n' > "$T/bad2.jsonl"
printf '{"text": 42}\n' > "$T/bad3.jsonl"
printf '["text", "x"]\n' > "$T/bad4.jsonl"
printf '{"text": "bad \\q escape"}\n' > "$T/bad5.jsonl"
expect prepare_bad_jsonl_unterminated 2 "bad1.jsonl:2: .*unterminated string" -- ./train prepare --tokenizer byte --format jsonl --out "$T/x" "$T/bad1.jsonl"
expect prepare_bad_jsonl_no_text 2 "bad2.jsonl:3: .*no \"text\" key" -- ./train prepare --tokenizer byte --format jsonl --out "$T/x" "$T/bad2.jsonl"
expect prepare_bad_jsonl_text_not_string 2 "bad3.jsonl:1: .*\"text\" is not a string" -- ./train prepare --tokenizer byte --format jsonl --out "$T/x" "$T/bad3.jsonl"
expect prepare_bad_jsonl_not_object 2 "bad4.jsonl:1: .*expected a JSON object" -- ./train prepare --tokenizer byte --format jsonl --out "$T/x" "$T/bad4.jsonl"
expect prepare_bad_jsonl_escape 2 "bad5.jsonl:1: .*bad escape" -- ./train prepare --tokenizer byte --format jsonl --out "$T/x" "$T/bad5.jsonl"
[ "$(grep -c 'kiln: error' "$T/err.txt")" = 1 ] && ok prepare_bad_jsonl_one_line || fail prepare_bad_jsonl_one_line "$(cat "$T/err.txt")"
expect prepare_eot_byte_refused 2 "byte tokenizer has no end-of-text" -- ./train prepare --tokenizer byte --eot --out "$T/x" "$T/lines.txt"
expect prepare_doc_with_jsonl_refused 2 "--doc is for --format text" -- ./train prepare --tokenizer byte --format jsonl --doc line --out "$T/x" "$T/docs.jsonl"
expect prepare_bad_threads 2 "--threads: expected an integer in \[1, 256\]" -- ./train prepare --tokenizer byte --threads 0 --out "$T/x" "$T/lines.txt"
expect prepare_bad_format 2 "--format: expected text or jsonl" -- ./train prepare --tokenizer byte --format csv --out "$T/x" "$T/lines.txt"
expect prepare_help_lists_flags 0 "--threads N" -- ./train prepare --help
