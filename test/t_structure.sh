#!/usr/bin/env bash
# The source tree's structure (issue 35, docs/design.md): checks that fail
# when a change adds what the structure forbids.
#   - test hooks behind one door: KILN_TEST_ appears in src/ only in
#     testhooks.c and testhooks.h;
#   - no include loop among src/ modules (a module: X.c with X.h; X -> Y
#     when X.c or X.h includes Y.h), beyond the loops listed in KNOWN below,
#     which are still to be broken: a new loop fails, and so does a known one
#     that is gone but still listed (take it off, so it cannot come back);
#   - no src/ file over 1,500 lines, beyond the files listed in BIG (the
#     same rule: none added, none left listed once it is under).
# One line a check.
set -u
cd "$(dirname "$0")/.."
. test/lib.sh

hooks=$(grep -rln "KILN_TEST_" src/ | grep -v '^src/testhooks\.[ch]$' | tr '\n' ' ')
if [ -z "$hooks" ]; then ok structure_test_hooks_one_door
else fail structure_test_hooks_one_door "KILN_TEST_ read outside src/testhooks.c: $hooks"; fi

KNOWN="adafactor ddp muon
arch config
ckpt ckpt_io
mlflow mlflow_rest"
loops=$(python3 - <<'PY'
import glob, os, re, sys
sys.setrecursionlimit(10000)
deps = {}
for f in glob.glob("src/*.c") + glob.glob("src/*.h"):
    m = os.path.splitext(os.path.basename(f))[0]
    inc = set(re.findall(r'^#include "([a-z0-9_]+)\.h"', open(f).read(), re.M))
    deps.setdefault(m, set()).update(inc - {m})
deps = {m: {d for d in ds if d in deps} for m, ds in deps.items()}
index, low, stack, on, out, n = {}, {}, [], set(), [], [0]
def visit(v):  # Tarjan's strongly connected components: each loop's modules together
    index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)
    for w in sorted(deps[v]):
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        c = []
        while True:
            w = stack.pop(); on.discard(w); c.append(w)
            if w == v: break
        if len(c) > 1: out.append(" ".join(sorted(c)))
for v in sorted(deps):
    if v not in index: visit(v)
print("\n".join(sorted(out)))
PY
)
new=$(comm -23 <(echo "$loops" | sort) <(echo "$KNOWN" | sort) | tr '\n' ';')
gone=$(comm -13 <(echo "$loops" | sort) <(echo "$KNOWN" | sort) | tr '\n' ';')
if [ -z "$new" ] && [ -z "$gone" ]; then ok structure_no_new_include_loop
else fail structure_no_new_include_loop "new loops: ${new:-none}; listed but gone (take them off KNOWN): ${gone:-none}"; fi

BIG="src/comm.c
src/config.c
src/cpu/backend_cpu.c
src/model.c"
big=$(wc -l src/*.c src/*.h src/cpu/*.c 2>/dev/null | awk '$2 != "total" && $1 > 1500 {print $2}' | sort)
new=$(comm -23 <(echo "$big") <(echo "$BIG" | sort) | tr '\n' ' ')
gone=$(comm -13 <(echo "$big") <(echo "$BIG" | sort) | tr '\n' ' ')
if [ -z "$new" ] && [ -z "$gone" ]; then ok structure_no_new_file_over_1500_lines
else fail structure_no_new_file_over_1500_lines "over 1,500 lines: ${new:-none}; listed but under now (take them off BIG): ${gone:-none}"; fi
