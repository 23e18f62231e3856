# scratch: where the split-K launch's time goes (kernel alone, epilogue alone), M = 8 and 64
import sys, torch
sys.path.insert(0, "."); sys.path.insert(0, "bench"); sys.path.insert(0, "scratch_s9")
from kernels import _packed, _plans, copies_for, time_graph, SHAPES_7B
from qerl_exp.engine import kernels as K
from qerl_exp.engine import nvfp4_mma as NM
import wg

dev = torch.device("cuda")
sms = torch.cuda.get_device_properties(0).multi_processor_count


def epi(plan, x, out, split, ws):
    e = K.linear_config(x.shape[0], plan.n, plan.k, "raw", plan.seg_gcd, plan.glu, sms)
    K._launch_linear(plan, x, out, None, None, None, None, 0, False, {**e, "NSPLIT": split}, None, ws)


for name, k, n in (SHAPES_7B[2], SHAPES_7B[3]):
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    dense = [w] + [w.clone() for _ in range(copies_for(w.numel() * 2) - 1)]
    plans, nbytes = _plans("nvfp4", w, {"nvfp4": _packed("nvfp4", w)}, dense)
    for m in (1, 8, 64):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        tc = time_graph([lambda wc=wc: torch.mm(x, wc.t(), out=out) for wc in dense])
        tf = time_graph([lambda p=p: K.fused_linear(p, x, out) for p in plans])
        line = f"{name} M={m}: cuBLAS {tc*1e6:.1f} | current total {tf*1e6:.1f} ({tc/tf:.2f}x)"
        if m <= 8:
            split, ws = NM.launch(plans[0], x, None, None, None, sms)
            tk = time_graph([lambda p=p: NM.launch(p, x, None, None, None, sms) for p in plans])
            te = time_graph([lambda: epi(plans[0], x, out, split, ws)])
            line += f" | mma kernel alone {tk*1e6:.1f} (split {split}) | its epilogue alone {te*1e6:.1f}"
        else:
            W, split = 8, (3 if n > k else 9)
            s2, ws = wg.launch(plans[0], x, sms, W=W, split=split)
            te = time_graph([lambda: epi(plans[0], x, out, s2, ws)])
            r = []
            for mode in (0, 3, 4):
                r.append(time_graph([lambda p=p: wg.launch(p, x, sms, W=W, split=split, MODE=mode) for p in plans]) * 1e6)
            line += (f" | wg kernel alone: full {r[0]:.1f}, loads+staging {r[2-1]:.1f}, weight loads only {r[2]:.1f}"
                     f" (split {s2}) | epilogue alone {te*1e6:.1f}")
        print(line, flush=True)
