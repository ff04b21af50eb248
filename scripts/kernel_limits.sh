#!/usr/bin/env bash
# kernel_limits: every kernel of cuda/ against sm_90's per-block limits, with
# no GPU: ptxas's own count of each kernel's registers and shared memory
# (nvcc -cubin -arch=sm_90 -Xptxas -v, device code only), against the block
# size and dynamic shared memory of every launch of it in the sources.
# Why: a launch over a limit fails only on the GPU ("too many resources
# requested"), and GPU time comes in windows too short to find it there.
# Usage: scripts/kernel_limits.sh [--table] [FILE.cu...]   (default cuda/*.cu)
#   --table: print every kernel as a markdown table (docs/gpu.md's)
# Limits checked (sm_90, CUDA 13): 1024 threads a block; 65,536 32-bit
# registers an SM, so registers x block threads <= 65,536 (at 1024 threads,
# 64 a thread; ptxas allocates per warp in units of 256 registers, counted
# here); 48 KiB static shared memory; dynamic shared memory over 48 KiB only
# after cudaFuncSetAttribute(MaxDynamicSharedMemorySize), at most 227 KiB; a
# launch no larger than the kernel's __launch_bounds__.
# Block sizes and dynamic shared memory come from each KLAUNCH's arguments:
# numeric #defines of cuda/, template arguments of the instantiation ptxas
# compiled, dim3 declarations near the launch; a size computed from the
# head size is taken at the largest the kernels accept (hs 128). What it
# cannot evaluate is listed as unresolved (exit 1, so the table stays whole).
# Exit: 0 no kernel over a limit, 1 a violation or an unresolved launch, 2 usage.
set -euo pipefail
cd "$(dirname "$0")/.."
TABLE=0
files=()
for a in "$@"; do
    case $a in
    --table) TABLE=1 ;;
    -*) echo "kernel_limits: unknown option '$a' (usage: scripts/kernel_limits.sh [--table] [FILE.cu...])"; exit 2 ;;
    *) files+=("$a") ;;
    esac
done
[ ${#files[@]} -gt 0 ] || files=(cuda/*.cu)
NVCC=${NVCC:-nvcc}
command -v "$NVCC" >/dev/null || { echo "kernel_limits: no nvcc here (set NVCC=/path/to/nvcc)"; exit 2; }
# KL_KEEP=DIR keeps ptxas's reports there and reuses them (a second look at
# the same sources, e.g. --table after the check, compiles nothing)
if [ -n "${KL_KEEP:-}" ]; then tmp=$KL_KEEP; mkdir -p "$tmp"
else tmp=$(mktemp -d /tmp/kiln-kernel-limits.XXXXXX); trap 'rm -rf "$tmp"' EXIT; fi
for f in "${files[@]}"; do
    [ -n "${KL_KEEP:-}" ] && [ -s "$tmp/$(basename "$f").ptxas" ] && [ "$tmp/$(basename "$f").ptxas" -nt "$f" ] && continue
    # -cubin: device code only, one target, so no host compile and no second arch
    "$NVCC" -cubin -arch=sm_90 -O3 -std=c++17 -Isrc -DKILN_CUDNN -Xptxas -v -o "$tmp/k.cubin" "$f" \
        > "$tmp/$(basename "$f").ptxas" 2>&1 || { cat "$tmp/$(basename "$f").ptxas"; echo "kernel_limits: $f does not compile"; exit 1; }
done
python3 - "$TABLE" "$tmp" "${files[@]}" <<'EOF'
import glob, os, re, subprocess, sys
table, tmp, files = sys.argv[1] == "1", sys.argv[2], sys.argv[3:]
MAX_THREADS, REGS_SM, STATIC_SMEM, OPTIN_SMEM = 1024, 65536, 48 * 1024, 227 * 1024
HS_MAX = 128  # the largest head size any attention kernel accepts

# numeric #defines of cuda/, resolved into each other
defs = {}
for f in glob.glob("cuda/*.cu") + glob.glob("cuda/*.cuh"):
    for m in re.finditer(r"^#define\s+(\w+)\s+([^\n/]+)", open(f).read(), re.M):
        defs.setdefault(m.group(1), m.group(2).strip())

def ev(expr, env):
    """the value of a C expression over defines and env, or None"""
    e = expr
    for _ in range(10):
        e = re.sub(r"sizeof\(\s*(float|int|unsigned|int32_t)\s*\)", "4", e)
        e = re.sub(r"sizeof\(\s*(double|size_t)\s*\)", "8", e)
        e = re.sub(r"sizeof\(\s*(bf16|__nv_bfloat16|half)\s*\)", "2", e)
        e = re.sub(r"\(\s*(size_t|int|unsigned)\s*\)", "", e)
        e = re.sub(r"dim3\(([^()]*)\)", lambda m: "*".join(f"({p})" for p in m.group(1).split(",")), e)
        names = set(re.findall(r"[A-Za-z_]\w*", e)) - {"dim3", "sizeof"}
        if not names: break
        for n in names:
            if n in env: e = re.sub(rf"\b{n}\b", f"({env[n]})", e)
            elif n in defs: e = re.sub(rf"\b{n}\b", f"({defs[n]})", e)
            else: return None
    if re.search(r"[A-Za-z_]", e): return None
    try: return int(eval(e.replace("/", "//")))
    except Exception: return None

def split_args(s, angle=True):
    """top-level comma-separated parts; angle: <> nest too (template lists,
    not call arguments, where '>' may be a comparison)"""
    out, d, cur = [], 0, ""
    for c in s:
        if c in "([{" or (angle and c == "<"): d += 1
        elif c in ")]}" or (angle and c == ">"): d -= 1
        if c == "," and d == 0: out.append(cur.strip()); cur = ""
        else: cur += c
    out.append(cur.strip())
    return out

def call_args(s, i):
    """the top-level arguments of the call whose '(' ends at i"""
    d, j = 1, i
    while d:
        d += {"(": 1, ")": -1}.get(s[j], 0); j += 1
    return split_args(s[i:j - 1], angle=False), j

# kernels: template parameters and __launch_bounds__, from their definitions
kernels = {}
for f in files:
    s = open(f).read()
    for m in re.finditer(r"(template\s*<([^>]*)>\s*)?__global__\s+void\s+(__launch_bounds__\(([^)]*(?:\([^)]*\))?[^)]*)\)\s*)?(\w+)\s*\(", s):
        tparams = [p.split()[-1] for p in split_args(m.group(2))] if m.group(2) else []
        kernels[m.group(5)] = dict(file=f, tparams=tparams, bounds=m.group(4))

# launches: KLAUNCH(kernel, grid, block, smem, ...)
launches = []
for f in files:
    s = open(f).read()
    for m in re.finditer(r"KLAUNCH\(", s):
        if s[max(0, m.start() - 8):m.start()].strip().endswith("define"): continue
        args, _ = call_args(s, m.end())
        name = re.sub(r"[()\s]", "", args[0])
        base, targs = re.match(r"(\w+)(?:<(.*)>)?", name).groups()
        line = s.count("\n", 0, m.start()) + 1
        before = s[max(0, m.start() - 3000):m.start()]
        local = {}
        # dim3 NAME(a, b) and size_t NAME = expr; declared before the launch
        for d in re.finditer(r"dim3\s+([^;]*);", before):
            for part in re.finditer(r"(\w+)\(([^()]*(?:\([^()]*\)[^()]*)*)\)", d.group(1)):
                local[part.group(1)] = f"dim3({part.group(2)})"
        for d in re.finditer(r"size_t\s+(\w+)\s*=\s*([^;]*);", before):
            local[d.group(1)] = d.group(2)
        local.update(hs=HS_MAX)
        launches.append(dict(file=f, line=line, kernel=base, targs=split_args(targs) if targs else [],
                             block=" ".join(args[2].split()), smem=" ".join(args[3].split()), local=local,
                             optin="cudaFuncAttributeMaxDynamicSharedMemorySize" in s))

# resources: ptxas -v, per compiled (mangled) kernel
res = []
for f in files:
    cur = None
    for l in open(os.path.join(tmp, os.path.basename(f) + ".ptxas")):
        m = re.search(r"Compiling entry function '(\w+)' for 'sm_90'", l)
        if m: cur = dict(file=f, mangled=m.group(1)); res.append(cur); continue
        m = re.search(r"(\d+) bytes spill stores", l)
        if m and cur: cur["spill"] = int(m.group(1))
        m = re.search(r"Used (\d+) registers.*?(?:(\d+) bytes smem)?,", l)
        if m and cur:
            cur["regs"] = int(m.group(1))
            sm = re.search(r"(\d+) bytes smem", l)
            cur["smem"] = int(sm.group(1)) if sm else 0
names = subprocess.run(["c++filt"], input="\n".join(r["mangled"] for r in res), capture_output=True, text=True).stdout.split("\n")
for r, n in zip(res, names):
    r["name"] = n
    r["short"] = re.sub(r"^void\s+", "", n.split("(")[0])
    m = re.match(r"(?:void\s+)?(\w+)(?:<(.*)>)?\(", n)
    r["base"], r["targs"] = (m.group(1), split_args(m.group(2)) if m.group(2) else []) if m else (n, [])

def norm(t):  # template arguments as the demangler and the source spell them
    return {"__nv_bfloat16": "bf16", "(int)8": "8"}.get(t, re.sub(r"^\((?:int|unsigned)\)", "", t))

rows, bad, unresolved = [], [], []
for r in res:
    k = kernels.get(r["base"], {})
    env = dict(zip(k.get("tparams", []), [norm(t) for t in r["targs"]]))
    mine = [L for L in launches if L["kernel"] == r["base"]]
    if not mine:
        rows.append((r, "-", "-", "no launch in cuda/ (called by cuBLASLt/cuDNN glue or unused)")); continue
    for L in mine:
        # a launch names template arguments itself (kernel<2, T_>) or through the enclosing template's
        lenv = dict(env); lenv.update(L["local"])
        if any(re.fullmatch(r"\d+", a) and p in env and str(env[p]) != a for p, a in zip(k.get("tparams", []), L["targs"])):
            continue  # this launch is of another instantiation
        threads = ev(L["block"], lenv)
        dyn = 0 if L["smem"] == "0" else ev(L["smem"], lenv)
        bounds = ev(k["bounds"], env) if k.get("bounds") else None
        where = f"{L['file']}:{L['line']}"
        why = []
        if threads is None:
            unresolved.append(f"{where} {r['short']}: block '{L['block']}'"); threads = "?"
        else:
            regs_block = ((r["regs"] * 32 + 255) // 256 * 256) * ((threads + 31) // 32)  # per-warp units of 256
            if threads > MAX_THREADS: why.append(f"{threads} threads > {MAX_THREADS}")
            if regs_block > REGS_SM: why.append(f"{r['regs']} regs x {threads} threads = {regs_block} > {REGS_SM}")
            if bounds is not None and threads > bounds: why.append(f"launch {threads} > __launch_bounds__({bounds})")
        if r["smem"] > STATIC_SMEM: why.append(f"static smem {r['smem']} > {STATIC_SMEM}")
        if dyn is None:
            if L["optin"]: dyn = "opt-in, checked at run time"
            else: unresolved.append(f"{where} {r['short']}: dynamic smem '{L['smem']}'"); dyn = "?"
        elif dyn + r["smem"] > STATIC_SMEM and not L["optin"]:
            why.append(f"dynamic smem {dyn} B over 48 KiB without cudaFuncSetAttribute")
        elif dyn + r["smem"] > OPTIN_SMEM: why.append(f"smem {dyn + r['smem']} > {OPTIN_SMEM}")
        if r.get("spill"): why.append(f"{r['spill']} bytes spilled (slow, not a launch failure)")
        verdict = "; ".join(why) or "ok"
        if any("spilled" not in w for w in why): bad.append(f"{where} {r['short']}: {verdict}")
        rows.append((r, threads, dyn, verdict if not bounds else f"{verdict} (bounds {bounds})", where))

if table:
    # one line per kernel and launch site, its instantiations (types, tile
    # widths) merged: the largest figures of them, and every verdict
    groups = {}
    for row in rows:
        r, th, dyn, v = row[:4]
        key = (r["base"], row[4] if len(row) > 4 else "-", th)
        g = groups.setdefault(key, dict(n=0, regs=0, rb=0, smem=0, dyn=[], v=set()))
        g["n"] += 1; g["regs"] = max(g["regs"], r["regs"]); g["smem"] = max(g["smem"], r["smem"])
        if isinstance(th, int): g["rb"] = max(g["rb"], r["regs"] * th)
        if dyn not in g["dyn"]: g["dyn"].append(dyn)
        g["v"].add(re.sub(r" \(bounds \d+\)", "", v))
    print("| kernel (sm_90; instantiations) | launched at | block threads | max regs/thread | max regs x block | static smem B | dynamic smem B (hs 128) | bounds | verdict |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (base, where, th), g in groups.items():
        k = kernels.get(base, {})
        bnd = ev(k["bounds"], {}) if k.get("bounds") else None
        bnd = bnd if bnd is not None else (k.get("bounds") or "-")
        dyn = max([d for d in g["dyn"] if isinstance(d, int)], default=None)
        dyn = dyn if dyn is not None else ", ".join(str(d) for d in g["dyn"])
        print(f"| `{base}` ({g['n']}) | {where} | {th} | {g['regs']} | {g['rb'] or '-'} | {g['smem']} | {dyn} | {bnd} | {'; '.join(sorted(g['v']))} |")
for b in bad: print(f"kernel_limits: OVER: {b}")
for u in unresolved: print(f"kernel_limits: unresolved (check by hand): {u}")
n = len({r['mangled'] for r in res})
print(f"kernel_limits: {n} kernels, {len([x for x in rows if len(x) > 4])} launches: {len(bad)} over a limit, {len(unresolved)} unresolved")
sys.exit(1 if bad or unresolved else 0)
EOF
