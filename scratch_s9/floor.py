# scratch: what cuBLAS bf16 itself reaches at M = 64 when memory is not the limit, and big-GEMM peak
import sys, torch
sys.path.insert(0, "bench")
from kernels import time_graph, copies_for
dev = torch.device("cuda")
M = 64
for (k, n) in ((3584, 18944), (18944, 3584)):
    flops = 2 * M * k * n
    # same N and output tiles, K / 4 so the weight (17-34 MB) stays in the 60 MB L2: time x 4 = the M=64 GEMM's
    # tensor-core time when its weights cost nothing to read
    for kk, nn in ((k // 4, n), (k, n // 4)):
        w = torch.randn(nn, kk, device=dev, dtype=torch.bfloat16)
        x = torch.randn(M, kk, device=dev, dtype=torch.bfloat16)
        out = torch.empty(M, nn, device=dev, dtype=torch.bfloat16)
        t = time_graph([lambda: torch.mm(x, w.t(), out=out)])
        print(f"M=64 {k}x{n} with {kk}x{nn} L2-resident: {t*1e6:.2f} us -> x4 = {4*t*1e6:.1f} us "
              f"({flops / (4*t) / 1e12:.0f} TFLOPS)", flush=True)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    copies = [w] + [w.clone() for _ in range(copies_for(w.numel() * 2) - 1)]
    x = torch.randn(M, k, device=dev, dtype=torch.bfloat16)
    out = torch.empty(M, n, device=dev, dtype=torch.bfloat16)
    t = time_graph([lambda c=c: torch.mm(x, c.t(), out=out) for c in copies])
    print(f"M=64 {k}x{n} from HBM: {t*1e6:.1f} us ({flops/t/1e12:.0f} TFLOPS, {w.numel()*2/t/1e12:.2f} TB/s); 2.5x = {t*1e6/2.5:.1f} us", flush=True)
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
t = time_graph([lambda: a @ b], reps=5)
print(f"8192^3 bf16: {2*8192**3/t/1e12:.0f} TFLOPS", flush=True)
# streaming read floor: M=1 over a 38.2 MB bf16 weight (the 4-bit gate/up's bytes)
w = torch.randn(5328, 3584, device=dev, dtype=torch.bfloat16)
copies = [w] + [w.clone() for _ in range(copies_for(w.numel() * 2) - 1)]
x = torch.randn(1, 3584, device=dev, dtype=torch.bfloat16)
out = torch.empty(1, 5328, device=dev, dtype=torch.bfloat16)
t = time_graph([lambda c=c: torch.mm(x, c.t(), out=out) for c in copies])
print(f"cuBLAS M=1 over {w.numel()*2/1e6:.1f} MB: {t*1e6:.1f} us ({w.numel()*2/t/1e12:.2f} TB/s)", flush=True)
