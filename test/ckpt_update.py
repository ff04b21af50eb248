#!/usr/bin/env python3
"""One optimizer step's update, compared between two runs from the same start:
   ckpt_update.py START A B [--match REGEX] [--tol X]
START, A and B are checkpoint directories (docs/formats.md) of uncompressed
f32 tensors written with flat ranges (tensor parallelism's boxes are not
read). For every parameter whose name matches REGEX (default: every one), the
update of A (A - START) and of B (B - START) are compared in the Frobenius
norm: |dB - dA| / |dA|. Prints the worst tensor; exits 1 if it exceeds X.
   ckpt_update.py --state A B [--match REGEX] [--tol X]
compares the optimizer state (the optim.* entries) of A and B instead:
|B - A| / |A| per entry, which an absolute tolerance cannot do for moments
of the size of g^2 (test/t_ep.sh). numpy only (test/t_muon.sh, t_adafactor.sh)."""
import re
import sys

import numpy as np


def read(ckpt, state=False):
    out = {}
    for line in open(ckpt + "/manifest"):
        if not line.startswith("entry "):
            continue
        f = dict(kv.split("=", 1) for kv in line.split()[1:])
        if f["kind"] != "tensor" or f["dtype"] != "f32" or f["name"].startswith("optim.") != state:
            continue
        if "box" in f or f["codec"] != "none":
            sys.exit("%s: %s has a box or a codec; not read here" % (ckpt, f["name"]))
        shape = [int(x) for x in f["shape"].strip("[]").split(",") if x]
        n = int(np.prod(shape)) if shape else 1
        lo, hi = (int(x) for x in f["range"].split(":"))
        t = out.setdefault(f["name"], np.full(n, np.nan, dtype=np.float64))
        with open(ckpt + "/" + f["file"], "rb") as fh:
            fh.seek(int(f["offset"]))
            t[lo:hi] = np.frombuffer(fh.read((hi - lo) * 4), dtype="<f4")
    for k, t in out.items():
        if np.isnan(t).any():
            sys.exit("%s: %s is not whole" % (ckpt, k))
    return out


def main():
    args = sys.argv[1:]
    match, tol = ".", None
    if "--match" in args:
        i = args.index("--match")
        match = args[i + 1]
        del args[i:i + 2]
    if "--tol" in args:
        i = args.index("--tol")
        tol = float(args[i + 1])
        del args[i:i + 2]
    worst, name = 0.0, "-"
    if args[0] == "--state":
        a, b = (read(x, True) for x in args[1:])
        if sorted(a) != sorted(b) or not a:
            sys.exit("the entries differ: %d vs %d" % (len(a), len(b)))
        for k in sorted(a):
            if not re.search(match, k):
                continue
            na = np.linalg.norm(a[k])
            rel = np.linalg.norm(b[k] - a[k]) / na if na > 0 else float(np.linalg.norm(b[k]) > 0)
            if rel >= worst:
                worst, name = rel, k
        print("worst relative state difference %.3g (%s)" % (worst, name))
        sys.exit(1 if tol is not None and not worst <= tol else 0)
    s, a, b = (read(x) for x in args)
    for k in sorted(s):
        if not re.search(match, k):
            continue
        da, db = a[k] - s[k], b[k] - s[k]
        na = np.linalg.norm(da)
        rel = np.linalg.norm(db - da) / na if na > 0 else float(np.linalg.norm(db) > 0)
        if rel >= worst:
            worst, name = rel, k
    print("worst relative update difference %.3g (%s)" % (worst, name))
    sys.exit(1 if tol is not None and not worst <= tol else 0)


main()
