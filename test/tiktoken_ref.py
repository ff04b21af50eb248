#!/usr/bin/env python3
"""Reference GPT-2 encoder for test/t_tokenizer_tiktoken.sh: tiktoken built from a
local rank file (no network). Prints the ids of each FILE, one per line.

    python3 test/tiktoken_ref.py VOCAB FILE          ids of FILE (encode_ordinary)
    python3 test/tiktoken_ref.py --tricky OUT        write the hand-written tricky text
    python3 test/tiktoken_ref.py --fuzz OUT SEED     write seeded random multi-script text
    python3 test/tiktoken_ref.py --long OUT SEED     write long pieces (kiln's heap merge path)
"""
import random
import sys

GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

TRICKY = (
    "I'm sure they'll say we've done it; she'd won't. 'Tis THEY'RE ''s '' 're 'S\n"
    "Numbers: 12345 3.14159 1,000,000 ２０２４ ٣٤٥ ½ Ⅻ x²\n"
    "   multiple   spaces   and trailing spaces   \n"
    "\ttabs\t\tand\t \tmixed \t\n\n\n"
    "CRLF line\r\nnext\r\n\r\n"
    "café naïve façade Straße ÆØÅ İstanbul\n"
    "日本語のテキスト、中文字符。한국어 Ελληνικά Кириллица العربية हिन्दी\n"
    "emoji 😀👍🏽 👨‍👩‍👧 🇫🇷 ✨\n"
    "combining e\u0301 a\u0308 n\u0303\n"
    "punctuation!!! ...?! --- ((( ))) \"quoted\" «guillemets» — en–dash ‘curly’ “quotes”\n"
    "odd spaces:\u00a0nbsp\u2003em\u3000ideographic\u0085nel\u001cfs\u200bzwsp\u2028ls\n"
    "mixed123abc abc123 _under_score_ @handle #tag https://example.com/a?b=c&d=e\n"
    "<|endoftext|> is plain text here\n"
    "    \n   "
)

SCRIPTS = [
    (0x41, 0x5A), (0x61, 0x7A), (0x30, 0x39), (0x21, 0x2F), (0xC0, 0xFF), (0x391, 0x3C9),
    (0x410, 0x44F), (0x5D0, 0x5EA), (0x627, 0x64A), (0x660, 0x669), (0x905, 0x939),
    (0x966, 0x96F), (0x3041, 0x3096), (0x4E00, 0x4FFF), (0xAC00, 0xAD00), (0x2010, 0x2027),
    (0x1F600, 0x1F64F), (0xFF10, 0xFF19), (0x2160, 0x2188),
]
SPACES = [" ", " ", " ", "  ", "\n", "\n\n", "\t", "\r\n", "\u00a0", "\u3000", "\u2003", " \n "]


def fuzz(seed, n_words=20000):
    rng = random.Random(seed)
    out = []
    for _ in range(n_words):
        lo, hi = rng.choice(SCRIPTS)
        out.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 8))))
        if rng.random() < 0.1:
            out.append(rng.choice(["'s", "'ll", "'t", "'re", "'d", "'ve", "'m", "'"]))
        out.append(rng.choice(SPACES))
    return "".join(out)


def long_pieces(seed):
    """Pieces of 128+ bytes take kiln's heap-based merge; compare them too."""
    rng = random.Random(seed)
    out = []
    for _ in range(60):
        n = rng.randint(100, 3000)
        kind = rng.randrange(5)
        if kind == 0:
            out.append("".join(rng.choice("etaoinshrdlu") for _ in range(n)))
        elif kind == 1:
            out.append(rng.choice("abz") * n)
        elif kind == 2:
            out.append("".join(rng.choice("0123456789") for _ in range(n)))
        elif kind == 3:
            out.append("".join(rng.choice("=-_*#.!?") for _ in range(n)))
        else:
            out.append("".join(rng.choice("éßñ日本語") for _ in range(n // 3)))
        out.append(rng.choice([" ", "\n", " " * rng.randint(2, 300)]))
    return "".join(out)


def main():
    if sys.argv[1] == "--tricky":
        open(sys.argv[2], "w", encoding="utf-8", newline="").write(TRICKY)
        return
    if sys.argv[1] == "--fuzz":
        open(sys.argv[2], "w", encoding="utf-8", newline="").write(fuzz(int(sys.argv[3])))
        return
    if sys.argv[1] == "--long":
        open(sys.argv[2], "w", encoding="utf-8", newline="").write(long_pieces(int(sys.argv[3])))
        return
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    enc = tiktoken.Encoding(name="gpt2_local", pat_str=GPT2_PAT,
                            mergeable_ranks=load_tiktoken_bpe(sys.argv[1]),
                            special_tokens={"<|endoftext|>": 50256})
    text = open(sys.argv[2], "rb").read().decode("utf-8")
    sys.stdout.write("".join("%d\n" % i for i in enc.encode_ordinary(text)))


if __name__ == "__main__":
    main()
