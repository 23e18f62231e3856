# scratch: wgmma NVFP4 tile vs the current path vs cuBLAS, weights from HBM (bench/kernels.py's timing)
import sys, itertools, torch
sys.path.insert(0, "."); sys.path.insert(0, "bench"); sys.path.insert(0, "scratch_s9")
from kernels import _packed, _plans, copies_for, time_graph, SHAPES_7B
from qerl_exp.engine import kernels as K
import wg

dev = torch.device("cuda")
sms = torch.cuda.get_device_properties(0).multi_processor_count
MS = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "16,32,64").split(",")]


def wg_linear(plan, x, out, **kw):
    split, ws = wg.launch(plan, x, sms, **kw)
    epi = K.linear_config(x.shape[0], plan.n, plan.k, "raw", plan.seg_gcd, plan.glu, sms)
    K._launch_linear(plan, x, out, None, None, None, None, 0, False, {**epi, "NSPLIT": split}, None, ws)
    return out


for name, k, n in (SHAPES_7B[2], SHAPES_7B[3]):
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    dense = [w] + [w.clone() for _ in range(copies_for(w.numel() * 2) - 1)]
    packs = {"nvfp4": _packed("nvfp4", w)}
    plans, nbytes = _plans("nvfp4", w, packs, dense)
    deq = packs["nvfp4"].dequantize()
    chunks = k // 64
    for m in MS:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        ref = x.float() @ deq.t()
        tc = time_graph([lambda wc=wc: torch.mm(x, wc.t(), out=out) for wc in dense])
        tf = time_graph([lambda p=p: K.fused_linear(p, x, out) for p in plans])
        print(f"{name} M={m}: cuBLAS {tc*1e6:.1f} us | current {tf*1e6:.1f} us ({tc/tf:.2f}x)", flush=True)
        SPL = {18944: {16: (4, 8, 16), 64: (2, 3, 4)}, 3584: {16: (9, 16), 64: (8, 9)}}[n][m]
        for W in (4, 8):
            for split in SPL:
                res = []
                for mode in (0, 1, 2, 3):
                    kw = dict(W=W, split=split, MODE=mode)
                    try:
                        t = time_graph([lambda p=p: wg_linear(p, x, out, **kw) for p in plans])
                    except Exception as e:
                        print(f"   W={W} split={split} mode={mode}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                        t = float("nan")
                    res.append(t * 1e6)
                print(f"   W={W} split={split:2d}: full {res[0]:5.1f} | no wgmma {res[1]:5.1f} | no decode {res[2]:5.1f} | loads+staging {res[3]:5.1f} us  ({tc*1e6/res[0]:.2f}x cuBLAS)", flush=True)
