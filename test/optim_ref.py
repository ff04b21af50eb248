#!/usr/bin/env python3
"""Every optimizer of kiln from its math, in float64, replayed on a real run:
   optim_ref.py RUN_DIR DUMP_DIR [--tol X]
DUMP_DIR holds what KILN_TEST_OPTIM_DUMP wrote (src/train.c): the tensor
table, the initial parameters, and each step's summed gradients, learning
rate and parameters after the step. RUN_DIR's config.yaml gives the
optimizer and its settings. Starting from the initial parameters, this
script applies each step's update with kiln's own gradients (so the model's
rounding stays out: what is compared is the optimizer's map from parameters,
state and gradient to new parameters) and compares the parameters after
every step with kiln's. Prints the worst absolute difference over all
parameters and steps next to the largest total update; exits 1 if the
difference exceeds X. numpy only.

The math (docs/optimizers.md), with g = grad * clip, clip = min(1,
grad_clip / (|grad| + 1e-6)) rounded to float32 as kiln applies it:
  adamw      m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
             p -= lr (m/(1-b1^t) / (sqrt(v/(1-b2^t)) + eps) + wd p)
  lion       c = b1 m + (1-b1) g; p -= lr (sign(c) + wd p); m = b2 m + (1-b2) g
  muon       per matrix: m = mu m + (1-mu) g; u = (1-mu) g + mu m;
             p -= lr (scale NS5(u) + wd p); AdamW on every other tensor
  adafactor  S = g^2 + eps1, beta2 = 1 - t^-decay; a 2-D tensor: r = beta2 r
             + (1-beta2) rowmean(S), c = beta2 c + (1-beta2) colmean(S),
             u = g / sqrt(r / mean(r)) / sqrt(c); else v = beta2 v +
             (1-beta2) S, u = g / sqrt(v); u /= max(1, rms(u) / d);
             with beta1: m = beta1 m + (1-beta1) u, u = m; p -= lr (u + wd p)
wd is optim.weight_decay on the decayed tensors (kiln's split), 0 elsewhere.
"""
import sys

import numpy as np
import yaml


def newton_schulz(x, steps):
    a, b, c = 3.4445, -4.7750, 2.0315
    tr = x.shape[0] > x.shape[1]
    X = x.T if tr else x
    X = X / (np.linalg.norm(X) + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tr else X


def main():
    args = sys.argv[1:]
    tol = None
    if "--tol" in args:
        i = args.index("--tol")
        tol = float(args[i + 1])
        del args[i:i + 2]
    run, dump = args
    cfg = yaml.safe_load(open(run + "/config.yaml"))
    # PyYAML reads "1e-08" (no dot) as a string: numbers are taken as float()
    o = {k: (v if k in ("name", "muon_scale") else [float(x) for x in v] if isinstance(v, list)
             else float(v) if not isinstance(v, bool) else v) for k, v in cfg["optim"].items()}
    name = o["name"]
    tensors, mats = [], []
    for line in open(dump + "/tensors.txt"):
        f = line.split()
        if f[0] == "tensor":
            tensors.append(dict(name=f[1], off=int(f[2]), n=int(f[3]), ndim=int(f[4]), rows=int(f[5]),
                                cols=int(f[6]), decay=int(f[7])))
        else:
            mats.append(dict(off=int(f[1]), rows=int(f[2]), cols=int(f[3]), scale=float(f[4]), decay=int(f[5])))
    if name == "muon":
        # the split of the docs, from the names: the blocks' 2-D weights (not the embeddings, the head or
        # the router), GPT-2's fused c_attn as thirds unless muon_split_qkv is false; the scale from the shape
        want = []
        for t in tensors:
            if t["ndim"] != 2 or any(k in t["name"] for k in ("wte", "wpe", "lm_head", "embed_tokens", "router")):
                continue
            parts = 3 if t["name"].endswith("attn.c_attn.weight") and o["muon_split_qkv"] else 1
            r = t["rows"] // parts
            for k in range(parts):
                want.append((t["off"] + k * r * t["cols"], r, t["cols"], t["decay"]))
        got = [(x["off"], x["rows"], x["cols"], x["decay"]) for x in mats]
        if sorted(want) != sorted(got):
            sys.exit("muon's matrices are not the documented split: kiln %s, docs %s" % (got, want))
        for x in mats:
            r, c = x["rows"], x["cols"]
            x["scale"] = np.sqrt(max(1.0, r / c)) if o["muon_scale"] == "spectral" else 0.2 * np.sqrt(max(r, c))
    steps = [(int(l.split()[1]), float(l.split()[2])) for l in open(dump + "/steps.txt")]
    n = sum(t["n"] for t in tensors)
    load = lambda what, k: np.fromfile("%s/%s_%d.f32" % (dump, what, k), dtype="<f4").astype(np.float64)
    p = load("params", 0)
    p0 = p.copy()
    wd = np.zeros(n)
    for t in tensors:
        if t["decay"]:
            wd[t["off"]:t["off"] + t["n"]] = o["weight_decay"]
    in_muon = np.zeros(n, dtype=bool)
    for x in mats:
        in_muon[x["off"]:x["off"] + x["rows"] * x["cols"]] = True
    m, v = np.zeros(n), np.zeros(n)
    fac = {}  # adafactor: tensor name -> (r, c)
    worst, where, most = 0.0, "", 0.0
    for t_step, lr in steps:
        grad = load("grads", t_step)
        norm = np.sqrt(np.sum(grad * grad))
        clip = 1.0
        if o["grad_clip"] > 0:
            clip = min(1.0, float(np.float32(o["grad_clip"] / (norm + 1e-6))))
        g = grad * clip
        if name in ("adamw", "muon"):
            b1, b2 = o["betas"]
            sel = ~in_muon
            m[sel] = b1 * m[sel] + (1 - b1) * g[sel]
            v[sel] = b2 * v[sel] + (1 - b2) * g[sel] ** 2
            mh, vh = m[sel] / (1 - b1 ** t_step), v[sel] / (1 - b2 ** t_step)
            p[sel] -= lr * (mh / (np.sqrt(vh) + o["eps"]) + wd[sel] * p[sel])
            mu = o["momentum"]
            for x in mats:
                s = slice(x["off"], x["off"] + x["rows"] * x["cols"])
                m[s] = mu * m[s] + (1 - mu) * g[s]
                u = (1 - mu) * g[s] + mu * m[s]
                O = newton_schulz(u.reshape(x["rows"], x["cols"]), int(o["ns_steps"])).reshape(-1)
                p[s] -= lr * (x["scale"] * O + (o["weight_decay"] if x["decay"] else 0.0) * p[s])
        elif name == "lion":
            b1, b2 = o["lion_betas"]
            c = b1 * m + (1 - b1) * g
            p -= lr * (np.sign(c) + wd * p)
            m = b2 * m + (1 - b2) * g
        elif name == "adafactor":
            beta2 = 1.0 - t_step ** (-o["adafactor_decay"])
            eps1, d, b1 = o["adafactor_eps"], o["adafactor_clip"], o["adafactor_beta1"]
            for t in tensors:
                s = slice(t["off"], t["off"] + t["n"])
                gs = g[s]
                S = gs * gs + eps1
                if t["ndim"] == 2:
                    S2 = S.reshape(t["rows"], t["cols"])
                    r, c = fac.get(t["name"], (np.zeros(t["rows"]), np.zeros(t["cols"])))
                    r = beta2 * r + (1 - beta2) * S2.mean(axis=1)
                    c = beta2 * c + (1 - beta2) * S2.mean(axis=0)
                    fac[t["name"]] = (r, c)
                    u = (gs.reshape(t["rows"], t["cols"]) / np.sqrt(r / r.mean())[:, None] / np.sqrt(c)[None, :])
                    u = u.reshape(-1)
                else:
                    v[s] = beta2 * v[s] + (1 - beta2) * S
                    u = gs / np.sqrt(v[s])
                if d > 0:
                    u = u / max(1.0, np.sqrt(np.mean(u * u)) / d)
                if b1 > 0:
                    m[s] = b1 * m[s] + (1 - b1) * u
                    u = m[s]
                p[s] -= lr * (u + wd[s] * p[s])
        else:
            sys.exit("optim_ref.py: no reference for optim.name %s" % name)
        k = load("params", t_step)
        err = np.abs(k - p)
        i = int(np.argmax(err))
        if err[i] > worst:
            owner = next(t["name"] for t in tensors if t["off"] <= i < t["off"] + t["n"])
            worst, where = float(err[i]), "%s at step %d" % (owner, t_step)
        most = max(most, float(np.max(np.abs(p - p0))))
    print("%s: %d steps, params max abs err %.3g (%s), largest update %.3g" % (name, len(steps), worst, where, most))
    sys.exit(1 if tol is not None and not worst <= tol else 0)


main()
