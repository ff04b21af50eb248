# budget_gpu: the analytic time budget of one GPT-2 training step on one
# H100 SXM or H200 (docs/benchmarks.md, "Expected time budget"), at the two
# shapes of the MFU targets: 124M (B 16, T 1024; 45%) and 1.5B (B 8, T 1024;
# 50%). FLOPs and HBM bytes per op, counted from src/model.c and the kernels,
# over the GPU's achieved ceilings (below). Estimates, not measurements.
# `python3 scripts/budget_gpu.py [--gpu h100|h200] [124m|1.5b]...` (default:
# h200, both shapes). MFU is always against the 989 TFLOP/s dense bf16
# datasheet peak, the same on both (the same Hopper chip and clocks).
#
# The ceilings, achieved (what a step can reach) next to the datasheet's:
# - H200 (141 GB HBM3e, 4.8 TB/s spec): 4.3 TB/s device-to-device copy
#   (bytes read + written) and 790 TFLOP/s bf16 GEMM (8192^3, random data:
#   769-798 measured), both measured on this workplace's H200s, 2026-10-28 and
#   2026-11-04 (the device tool's KINDS.md; docs/benchmarks.md): 90% of the
#   bandwidth spec, 80% of the matrix spec.
# - H100 SXM (80 GB HBM3, 3.35 TB/s spec): 3.0 TB/s copy and 798 TFLOP/s
#   GEMM (8192^3, random data), measured on this workplace's H100 80GB HBM3
#   once, 2026-11-13 (KINDS.md, /work/shared/notes/gpu-checks.md): the same
#   90% of its bandwidth spec as the H200 gives, and the H200's matrix rate
#   (same SMs and clocks), so 790 is used for both and the H100 budget differs
#   only in bandwidth: every memory-bound op ~1.43x longer.
import sys
GPUS = {"h200": dict(name="H200 (141 GB HBM3e)", BW=4.3e12, BW_SPEC=4.8e12, MM=790e12),
        "h100": dict(name="H100 SXM (80 GB HBM3)", BW=3.0e12, BW_SPEC=3.35e12, MM=790e12)}
SHAPES={"124m":dict(B=16,C=768,L=12,NH=12,target=0.45),
        "1.5b":dict(B=8,C=1600,L=48,NH=25,target=0.50)}
PEAK=989e12
BW=MM=None
def budget(name,B,C,L,NH,target,T=1024,V=50257,Vp=50304):
    N=B*T; hs=C//NH; a=2
    P=Vp*C+T*C+L*(12*C*C+13*C)+2*C
    print(f"## GPT-2 {name} on one {GPU['name']}: B {B}, T {T}, C {C}, L {L}, NH {NH}, {P:,} parameters")
    print(f"(ceilings: {BW/1e12:.1f} TB/s achieved of {GPU['BW_SPEC']/1e12:.2f} spec, {MM/1e12:.0f} TFLOP/s bf16 GEMM achieved of {PEAK/1e12:.0f} spec)\n")
    rows=[]
    def op(name, calls, flops, mn, aswr=None, note=""):
        rows.append((name, calls, flops, mn, aswr if aswr is not None else mn, note))
    NC=N*C
    # GEMMs (flops per call; bytes: operands once)
    op("qkv fwd (bias epi)", L, 2*N*C*3*C, NC*a+3*C*C*a+3*NC*a)
    op("attproj fwd", L, 2*N*C*C, NC*a+C*C*a+NC*a)
    op("fc fwd + GELU_AUX", L, 2*N*C*4*C, NC*a+4*C*C*a+2*4*NC*a)
    op("fcproj fwd", L, 2*N*4*C*C, 4*NC*a+4*C*C*a+NC*a)
    op("head fwd (logits)", 1, 2*N*C*Vp, NC*a+Vp*C*a+N*Vp*a)
    op("fcproj bwd dinp+DGELU, dw", L, 4*N*4*C*C, NC*a+4*C*C*a+4*NC*a*2 + 4*NC*a+NC*a+4*C*C*4)
    op("fc bwd dinp, dw", L, 4*N*C*4*C, 4*NC*a*2+C*4*C*a+NC*a+NC*a+4*C*C*4)
    op("attproj bwd dinp, dw", L, 4*N*C*C, NC*a*3+NC*a+C*C*(a+4))
    op("qkv bwd dinp, dw", L, 4*N*C*3*C, 3*NC*a*2+NC*a*2+3*C*C*(a+4))
    op("head bwd dinp, dw(wte)", 1, 4*N*C*Vp, 2*N*Vp*a+NC*a*2+Vp*C*(a+4))
    gemm=list(rows); rows.clear()
    # attention (executed FLOPs: 64x64 tiles incl. diagonal; fwd 2 products, bwd 5:
    # FlashAttention-2's S, dP, dV, dK, dQ; before the attn merge 7, two kernels
    # recomputing S and dP each). Backward bytes: min Q K V O dO lse D read, dqkv
    # written, the D pass; as written + dQ's fp32 partial sums (attention_tc.cu's
    # turn order) written by the first key block of each query tile and read by
    # the last, the turns between counted as L2 hits (the ~16 heads in flight
    # hold a few MB of partials)
    tiles=sum(range(1,T//64+1))
    fwd=B*NH*tiles*2*64*64*hs*2
    op("attention fwd (TC)", L, fwd, 3*NC*a+NC*a+N*NH*4)
    bmin=3*NC*a+2*NC*a+2*N*NH*4+3*NC*a+2*NC*a+N*NH*4
    op("attention bwd (TC: D, then S dP dV dK dQ in one kernel)", L, fwd*2.5, bmin, bmin+2*NC*4)
    att=list(rows); rows.clear()
    lnb_min=4*NC*a+2*N*4+2*C*4
    chunks=min((N+31)//32, 1024)  # the backward's row chunks: dw, db partials written and read back
    lnb_wr=lnb_min+2*2*chunks*C*4
    op("embed fwd", 1, 0, N*4+NC*a+T*C*a+NC*a)
    op("layernorm fwd (layer 1's ln1)", 1, 0, 2*NC*a+2*N*4)
    op("residual add + layernorm fwd, fused (ln2, ln1, lnf)", 2*L, 0, 4*NC*a+2*N*4)
    op("cross-entropy fwd+bwd in place", 1, 0, 2*N*Vp*a+N*8, 4*N*Vp*a+N*8, "as written: 3 reads+1 write if rows miss L2")
    op("zero dresidual", 1, 0, NC*a)
    op("layernorm bwd, one kernel (dinp + dw/db partials) + finish", 2*L+1, 0, lnb_min, lnb_wr, "as written: the partials")
    op("dbias: BGRADB epilogue of the dw products", 4*L, 0, 0)
    distinct=V*(1-(1-1/V)**N)
    op("embed bwd (dwte runs, dwpe)", 1, 0, NC*a+distinct*C*8+NC*a+T*C*4)
    op("grad norm (sumsq fp32)", 1, 0, P*4)
    op("AdamW fp32 master+m+v, bf16 compute copy in the same pass", 1, 0, P*30)
    mem=list(rows)
    def tab(rs, flopbound):
        tot=0; totw=0
        print("| op | calls | GFLOP/step | MB/step (min) | MB/step (as written) | ideal µs/step |")
        print("|---|---|---|---|---|---|")
        for n,c,f,mn,w,note in rs:
            tf=c*f/MM; tm=c*mn/BW; tw=c*w/BW
            t=max(tf,tm)
            tot+=t; totw+=max(tf,tw)
            print(f"| {n} | {c} | {c*f/1e9:,.1f} | {c*mn/1e6:,.0f} | {c*w/1e6:,.0f} | {t*1e6:,.0f} |" )
        print(f"| **sum** | | | | | **{tot*1e6:,.0f}** (as written {totw*1e6:,.0f}) |")
        return tot,totw
    g,_=tab(gemm,1); print()
    at,_=tab(att,1); print()
    m,mw=tab(mem,0); print()
    modelflops=(6*(L*12*C*C+C*V)+6*L*T*C)*N
    print("model FLOP/step %.4g T, 100%% MFU step %.2f ms, 45%% -> %.2f ms, 50%% -> %.2f ms"%(modelflops/1e12, modelflops/PEAK*1e3, modelflops/PEAK/0.45*1e3, modelflops/PEAK/0.5*1e3))
    gf=sum(c*f for n,c,f,*_ in gemm); af=sum(c*f for n,c,f,*_ in att)
    print("gemm flops %.4g T, attn executed %.4g T (model-counted %.4g)"%(gf/1e12, af/1e12, 6*L*T*C*N/1e12))
    ideal=g+at+m
    print("ideal step %.2f ms (gemm %.2f, attn %.2f, mem %.2f; mem as written %.2f) MFU %.1f%%"%(ideal*1e3,g*1e3,at*1e3,m*1e3,mw*1e3, modelflops/ideal/PEAK*100))
    for ar in (400e12, 300e12, 250e12):
        t2=g+af/ar+mw
        print("attn at %d TF/s: step %.2f ms, MFU %.1f%%"%(ar/1e12, t2*1e3, modelflops/t2/PEAK*100))
    print("distinct tokens %.0f"%distinct)

    print("budget for non-GEMM at %d%%: %.2f ms"%(target*100, (modelflops/PEAK/target-g)*1e3))
    print()
args = sys.argv[1:]
gpu = "h200"
if "--gpu" in args:
    i = args.index("--gpu")
    gpu = args[i + 1] if i + 1 < len(args) else ""
    del args[i:i + 2]
if gpu not in GPUS:
    sys.exit(f"budget_gpu: --gpu wants one of {', '.join(GPUS)}, not '{gpu}'")
bad = [a for a in args if a not in SHAPES]
if bad:
    sys.exit(f"budget_gpu: no shape '{bad[0]}' (shapes: {', '.join(SHAPES)})")
GPU = GPUS[gpu]
BW, MM = GPU["BW"], GPU["MM"]
for k in (args or SHAPES):
    budget(k, **SHAPES[k])
