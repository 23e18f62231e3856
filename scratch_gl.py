# temporary: Gluon NVFP4 kernel check + sweep (deleted after use)
import sys, torch, json, os
sys.path.insert(0, ".")
from bench.kernels import _packed, copies_for, time_graph, SHAPES_7B
from qerl_exp.engine import kernels as K
dev = torch.device("cuda")
out_rows = []
def run(name, k, n, ms, cfgs):
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    pw = _packed("nvfp4", w)
    ws = [pw] + [K.PackedWeight(pw.fmt, pw.codes.clone(), pw.scales.clone(), pw.out_scale, pw.n, pw.k, pw.lut)
                 for _ in range(copies_for(pw.nbytes) - 1)]
    dense = [w] + [w.clone() for _ in range(copies_for(w.numel() * 2) - 1)]
    scratch = torch.zeros(K.SPLIT_MAX, 256, n, device=dev)
    plans = [K.make_plan("nvfp4", [wi], [None], None, [0.0], 0, False, dev, workspace=scratch) for wi in ws]
    deq = pw.dequantize()
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        ref = x.float() @ deq.t()
        tc = time_graph([lambda wc=wc: torch.mm(x, wc.t(), out=out) for wc in dense])
        base = K.linear_config(m, n, k, "nvfp4", n, False)
        t_old = time_graph([lambda p=p: K.fused_linear(p, x, out) for p in plans])
        K.fused_linear(plans[0], x, out); old = out.clone()
        print(f"{name} M={m} cublas {tc*1e6:.1f} old {t_old*1e6:.1f} ({tc/t_old:.2f}x) base={base}", flush=True)
        for c in cfgs(m):
            cfg = {**base, "GLUON": True, **c}
            if (k // 64) % cfg["SPLIT"]:
                continue
            try:
                out.fill_(float("nan"))
                K.fused_linear(plans[0], x, out, config=cfg)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                same = (out == old).float().mean().item()
                t = time_graph([lambda p=p: K.fused_linear(p, x, out, config=cfg) for p in plans])
                print(f"   {tuple(c.values())}: {t*1e6:.1f} us ({tc/t:.2f}x cuBLAS, {t_old/t:.2f}x old) err {err:.2e} same-as-old {same:.4f}", flush=True)
                out_rows.append(dict(shape=name, m=m, cfg=c, us=t*1e6, cublas=tc*1e6, old=t_old*1e6, err=err))
            except Exception as e:
                print(f"   {c}: FAILED {type(e).__name__}: {str(e)[:1500]}", flush=True)
def cfgs(m):
    bm = 8 if m <= 8 else 16 if m <= 16 else 64
    bms = [bm] + ([32] if m == 64 else [])
    return [dict(GLUON_BM=b, SPLIT=sp, STAGES=st) for b in bms for sp in (2, 4, 8) for st in (4, 8)]
for name, k, n in SHAPES_7B[2:] + SHAPES_7B[:2]:
    run(name, k, n, [1, 8, 16, 64], cfgs)
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out_rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "gl.json"), "w"))
