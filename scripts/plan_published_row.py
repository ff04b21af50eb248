#!/usr/bin/env python3
"""plan_published_row.py: one row of docs/planner.md's "Published layouts" from the
planner's JSON (scripts/plan_published.sh calls it); --table TSV prints the table."""
import json
import sys

RC = {"none": "", "gelu": " rc=g", "norm_gelu": " rc=ng", "block": " rc=b", "selective": " rc=s"}
SCHED = {"none": "", "1f1b": "", "gpipe": " gpipe", "zb_h1": " zb", "interleaved_1f1b": " i"}


def compact(l):
    """dp32·tp2·pp4 i2 Z1 mb2 rc=ng sp: the mesh, then what the search chose inside it."""
    dims = ["dp%d" % l["dp"]]
    for k in ("tp", "pp", "cp", "ep"):
        if l[k] > 1:
            dims.append("%s%d" % (k, l[k]))
    s = "·".join(dims)
    if l["pp"] > 1:
        s += SCHED.get(l["pp_schedule"], " " + l["pp_schedule"])
        if l["pp_schedule"] == "interleaved_1f1b":
            s += str(l["pp_virtual"])
    if l["cp"] > 1:
        s += " " + ("ring" if l["cp_attention"] == "ring" else "ag")
    s += " Z%d mb%d%s" % (l["zero"], l["micro_batch"], RC.get(l["recompute"], " rc=" + l["recompute"]))
    if l["tp"] > 1 and not l["sequence_parallel"]:
        s += " no-sp"
    return s


def mesh(l):
    return (l["dp"], l["tp"], l["pp"], l["cp"], l["ep"])


def shape_of(shape):
    d = {}
    for kv in shape.split():
        k, v = kv.split("=", 1)
        d[k] = v
    return d


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def row(name, pubmesh, kind, value, label, shape, search_path, pub_path, pub_err):
    pm = tuple(int(x) for x in pubmesh.split(","))
    s, p = load(search_path), load(pub_path)
    r = {"name": name, "label": label, "mesh": pm}
    seen, order = set(), []
    for l in (s or {}).get("layouts", []):
        if mesh(l) not in seen:
            seen.add(mesh(l))
            order.append(l)
    r["searched"] = s is not None
    r["meshes"] = len(order)
    r["top5"] = ["%s %.1f%%" % (compact(l), 100 * l["mfu"]) for l in order[:5]]
    r["rank"] = next((i + 1 for i, l in enumerate(order) if mesh(l) == pm), None)
    best_pub = next((l for l in order if mesh(l) == pm), None)
    r["best_at_pub"] = (compact(best_pub), best_pub["mfu"]) if best_pub else None
    r["top1_mfu"] = order[0]["mfu"] if order else None
    peak = (p or s or {}).get("hardware", {}).get("bf16_flops")
    pl = (p or {}).get("layouts") or [None]
    pl = pl[0]
    r["pub_fits"] = bool(p and p.get("fits"))
    errs = pub_err.strip().splitlines()
    r["pub_error"] = (p or {}).get("error") or (errs[-1] if errs else None)
    if pl:
        r["pub_layout"] = compact(pl)
        r["pub_pred_mfu"] = pl["mfu"]
        r["pub_mem_gib"] = pl["memory_bytes"] / 2**30
        r["pub_time"] = pl["time"]
        r["pub_step"] = pl["step_s"]
        flops_tok = pl["mfu"] * peak / pl["tokens_per_s_per_gpu"]  # kiln's model FLOPs a token
    else:
        flops_tok = None
    v = float(value)
    if kind == "mfu":
        r["pub_mfu"] = v
    elif kind == "tps" and flops_tok:
        r["pub_mfu"] = v * flops_tok / peak
    elif kind == "meg_tf" and flops_tok:
        # Megatron's eq. 3 counts 96 B s l h^2 (1 + s/6h + V/16lh) a step: the recompute's
        # extra forward and non-causal attention included; convert to kiln's count.
        d = shape_of(shape)
        l_, h = int(d["model.n_layer"]), int(d["model.n_embd"])
        sq, V = 2048, 51200
        meg_tok = 96 * l_ * h * h * (1 + sq / (6 * h) + V / (16 * l_ * h))  # per token (B s cancels)
        tps = v * 1e12 / meg_tok
        r["pub_mfu"] = tps * flops_tok / peak
        r["pub_hfu"] = v * 1e12 / peak
    else:
        r["pub_mfu"] = None
    print(json.dumps(r))


def pct(x):
    return "–" if x is None else "%.1f%%" % (100 * x)


def table(path):
    rows = [json.loads(x) for x in open(path)]
    print("| case | published layout | planner's top 5 (distinct meshes, predicted MFU) | rank of the published mesh | published layout, predicted | published MFU (kiln's count) | predicted / published |")
    print("|---|---|---|---|---|---|---|")
    in5 = ranked = within = compared = 0
    for r in rows:
        top = "<br>".join("%d. %s" % (i + 1, t) for i, t in enumerate(r["top5"])) or "search gave no layout"
        if r["rank"]:
            rank = "%d of %d" % (r["rank"], r["meshes"])
        elif not r["searched"]:
            rank = "search did not finish"
        else:
            rank = "not in the %d meshes%s" % (r["meshes"], ": no layout of it fits" if not r["pub_fits"] else "")
        ranked += 1
        in5 += bool(r["rank"] and r["rank"] <= 5)
        if r.get("pub_layout"):
            pred = "%s: %s, %.1f GiB%s" % (r["pub_layout"], pct(r["pub_pred_mfu"]), r["pub_mem_gib"],
                                           "" if r["pub_fits"] else " (does not fit)")
        else:
            pred = "refused: %s" % (r["pub_error"] or "?")
        if r["best_at_pub"] and r["best_at_pub"][0] != r.get("pub_layout"):
            pred += "<br>best in this mesh: %s, %s" % (r["best_at_pub"][0], pct(r["best_at_pub"][1]))
        pub = pct(r["pub_mfu"])
        if r.get("pub_hfu"):
            pub += " (%s as published, recompute counted)" % pct(r["pub_hfu"])
        ratio = "–"
        # the published layout as run; where it does not fit kiln (no full recompute),
        # the search's best layout in the same mesh, marked †
        pred_mfu, mark = (r.get("pub_pred_mfu"), "") if r["pub_fits"] else \
            ((r["best_at_pub"][1], "†") if r["best_at_pub"] else (None, ""))
        if r["pub_mfu"] and pred_mfu:
            q = pred_mfu / r["pub_mfu"]
            compared += 1
            within += abs(q - 1) <= 0.25
            ratio = "%.2f%s%s" % (q, mark, "" if abs(q - 1) <= 0.25 else " ✗")
        print("| %s | %s | %s | %s | %s | %s | %s |" % (r["name"], r["label"], top, rank, pred, pub, ratio))
    print()
    print("Published mesh in the top 5: %d of %d rows (%.0f%%). Predicted MFU within ±25%% of the "
          "published: %d of %d rows with a published figure." % (in5, ranked, 100.0 * in5 / max(ranked, 1),
                                                                    within, compared))


if __name__ == "__main__":
    if sys.argv[1] == "--table":
        table(sys.argv[2])
    else:
        row(*sys.argv[1:10])
