# temporary (deleted after use): where the NVFP4 decode kernel's time goes (TMA Gluon variant, diagnostic modes)
import sys, torch
sys.path.insert(0, "."); sys.path.insert(0, "bench")
from kernels import _packed, copies_for, time_graph, SHAPES_7B
from qerl_exp.engine import kernels as K
from scratch_tma_kernel import nvfp4_tma_kernel, descriptors
dev = torch.device("cuda")
for name, k, n in (SHAPES_7B[2], SHAPES_7B[3]):
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    pw = _packed("nvfp4", w)
    pws = [pw] + [K.PackedWeight(pw.fmt, pw.codes.clone(), pw.scales.clone(), pw.out_scale, pw.n, pw.k, pw.lut)
                  for _ in range(copies_for(pw.nbytes) - 1)]
    ws = torch.zeros(K.SPLIT_MAX, 256, n, device=dev)
    x = torch.randn(8, k, device=dev, dtype=torch.bfloat16)
    xh = (x * 0.0625).to(torch.float16)
    for bn in (128, 256):
        descs = [descriptors(p.codes, p.scales, xh, 8, bn) for p in pws]
        for split in (2, 4, 8):
            res = []
            for mode in (0, 3):
                def run(i):
                    cd, sd, xd = descs[i]
                    nvfp4_tma_kernel[(n // bn * split,)](cd, sd, xd, ws, ws.stride(1), ws.stride(0), 8, n, n // bn, SPLIT=split,
                                                         CPS=k // 64 // split, BLOCK_M=8, BLOCK_N=bn, STAGES=4, MODE=mode, num_warps=4)
                try:
                    res.append(time_graph([lambda i=i: run(i) for i in range(len(pws))]) * 1e6)
                except Exception as e:
                    print("  failed", bn, split, mode, type(e).__name__, str(e)[:300], flush=True); res.append(float("nan"))
            gbs = pw.nbytes / (res[1] * 1e-6) / 1e9
            print(f"{name} M=8 BN {bn} split {split}: full {res[0]:.1f} us | loads only {res[1]:.1f} us = {gbs:.0f} GB/s", flush=True)
