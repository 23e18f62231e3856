"""Weight-only 4-bit GEMM kernels against bf16 cuBLAS at decode shapes (one process, one GPU).

    python -m bench.engine_kernels                 # Qwen2.5-7B layer shapes, M in 1, 8, 64, 256
    python -m bench.engine_kernels --tiles         # also try `_splitk_kernel` tile configs (NVFP4 and dense)
    python -m bench.engine_kernels --attention --m 8,64   # decode attention: one program a sequence-head vs split

Each timing is the median over graph replays of 20 launches that cycle through enough weight copies
to exceed the L2 cache (so weights come from HBM, as in decode); warm-up and compilation are
excluded. Errors are ||out - ref|| / ||ref|| against dequantize + matmul in fp32. Each NVFP4 path is
timed with the launches it makes in the engine: down's wgmma path from the fp16 operand that the GLU
epilogue writes (`FED_BY_GLU`), the others from bf16 x with their `norm_shrink` launch.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench import record
from qerl_exp.engine import attention, dispatch, linear
from qerl_exp.quant import layout
from qerl_exp.quant.fp4 import quantize_nvfp4

# (name, in_features K, out_features N) of Qwen2.5-7B decoder linears
SHAPES_7B = [("qkv 3584x4608", 3584, 4608), ("o 3584x3584", 3584, 3584),
             ("up/gate 3584x18944", 3584, 18944), ("down 18944x3584", 18944, 3584)]
SHAPES_05B = [("qkv 896x1152", 896, 1152), ("o 896x896", 896, 896),
              ("up/gate 896x4864", 896, 4864), ("down 4864x896", 4864, 896)]
# the engine's NVFP4 launches (gate and up side by side: N = 2 x 18944), as `dispatch.json` keys them
LAUNCHES_7B = [("qkv", 3584, 4608), ("o", 3584, 3584), ("gate|up", 3584, 37888), ("down", 18944, 3584)]
SWEEP_M = [1, 2, 4, 8, 16, 32, 64, 128, 256]
# launches whose input the GLU epilogue writes: where they take nvfp4_wgmma it writes that kernel's fp16
# operand itself (`LinearPlan.takes_x16`), so the engine runs them with no conversion launch, and so they are timed
FED_BY_GLU = ("down",)


def wgmma_tiles(m: int) -> list[dict]:
    """`nvfp4_wgmma` variants tried beside its `TILES` row for m rows: two programs an SM (80
    registers a thread fit tiles of up to 64 rows) with its ring or a shallower one, deeper rings,
    and above 128 rows one m block of 256 (wgmma's widest N)."""
    bm = min(64, 1 << (m - 1).bit_length())
    if m <= 64:
        return [dict(BLOCK_M=bm, maxnreg=80), dict(BLOCK_M=bm, maxnreg=80, STAGES=4), dict(STAGES=10)]
    wide = [dict(BLOCK_M=256), dict(BLOCK_M=256, STAGES=3)] if m > 128 else []
    return [dict(BLOCK_M=64, maxnreg=80), dict(STAGES=6)] + wide


L2_BYTES = 60 * 2**20


def time_graph(fns: list, reps: int = 20, trials: int = 7) -> float:
    """Median seconds per call of `fns` (cycled) replayed from one CUDA graph."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / reps)
    return statistics.median(times)


def time_eager(fn, reps: int = 50) -> float:
    """Median seconds per call of `fn` launched eagerly (for code that cannot be graph-captured)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / reps)
    return statistics.median(times)


def _packed(fmt: str, w: torch.Tensor) -> layout.KernelWeight:
    if fmt == "nvfp4":
        q = quantize_nvfp4(w)
        return layout.relayout_nvfp4(q.codes, q.block_scales, q.tensor_scale)
    lut = layout.nf4_lut(w.device)
    n, k = w.shape
    am = w.float().reshape(n, -1, 64).abs().amax(-1)
    levels, _ = lut.sort()
    nib = torch.bucketize(w.float().reshape(n, -1, 64) / am[..., None], (levels[1:] + levels[:-1]) / 2)
    return layout.relayout_nf4((lut[nib] * am[..., None]).reshape(n, k), am.flatten(), lut)


def operand(name: str, plan, x: torch.Tensor, kind: str | None = None) -> tuple[torch.Tensor, dict]:
    """(input, fused_linear keywords) of a launch as the engine runs it: x, or for a launch fed by the
    GLU epilogue that takes nvfp4_wgmma (by `kind` or by the table), x / 16 in fp16 with `x16=True`."""
    wgmma = kind == "wgmma" or kind is None and plan.takes_x16(x.shape[0], x.device)
    if name.split()[0] in FED_BY_GLU and wgmma:
        return (x / 16).half(), dict(x16=True)
    return x, {}


def copies_for(nbytes: int) -> int:
    return max(2, -(-3 * L2_BYTES // max(nbytes, 1)))


def _plans(fmt: str, w: torch.Tensor, packs: dict, dense_copies: list) -> tuple[list, int]:
    dev = w.device
    if fmt == "dense":
        ws, nbytes = dense_copies, w.numel() * 2
    else:
        pw = packs[fmt]
        ws = [pw] + [layout.KernelWeight(pw.fmt, pw.codes.clone(), pw.scales.clone(), pw.out_scale, pw.n, pw.k, pw.lut)
                     for _ in range(copies_for(pw.nbytes) - 1)]
        nbytes = pw.nbytes
    scratch = torch.zeros(linear.SPLIT_MAX, 256, w.shape[0], device=dev)  # split-K slices (as the engine has)
    return [linear.make_plan(fmt, [wi], [None], None, [0.0], 0, False, dev, workspace=scratch) for wi in ws], nbytes


def bench_shape(name: str, k: int, n: int, ms: list[int], variants: list[str]) -> list[tuple]:
    """Rows of (variant, M, seconds, weight GB/s, speed-up over cuBLAS bf16, rel. error)."""
    dev = torch.device("cuda")
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    dense_copies = [w] + [w.clone() for _ in range(copies_for(w.numel() * 2) - 1)]
    packs = {fmt: _packed(fmt, w) for fmt in ("nvfp4", "nf4") if any(v.startswith(fmt) for v in variants)}
    bnb_w = None
    if "bnb_nf4" in variants:
        import bitsandbytes as bnb

        bnb_w = bnb.nn.Params4bit(w.clone(), requires_grad=False, quant_type="nf4", compress_statistics=True).to(dev)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        t_cublas = time_graph([lambda wc=wc: torch.mm(x, wc.t(), out=out) for wc in dense_copies])
        rows.append(("cublas_bf16", m, t_cublas, w.numel() * 2 / t_cublas / 1e9, 1.0, 0.0))
        for v in variants:
            fmt = v.partition("_")[0]
            try:
                if v == "bnb_nf4":
                    import bitsandbytes as bnb

                    fns = [lambda: bnb.matmul_4bit(x, bnb_w.t(), quant_state=bnb_w.quant_state)]
                    ref = x.float() @ bnb.functional.dequantize_4bit(bnb_w.data, bnb_w.quant_state).float().t()
                    nbytes = k * n // 2
                    t = time_eager(fns[0])
                    got = fns[0]()
                else:
                    plans, nbytes = _plans(fmt, w, packs, dense_copies)
                    deq = w.float() if fmt == "dense" else packs[fmt].dequantize()
                    ref = x.float() @ deq.t()
                    xin, kw = operand(name, plans[0], x) if fmt == "nvfp4" else (x, {})
                    fns = [lambda p=p: linear.fused_linear(p, xin, out, **kw) for p in plans]
                    t = time_graph(fns)
                    out.fill_(float("nan"))
                    fns[0]()
                    got = out
                err = ((got.float() - ref).norm() / ref.norm()).item()
            except Exception as e:  # keep the table going; the failure is printed
                print(f"  {name} {v} M={m} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                t, err = float("nan"), float("nan")
            rows.append((v, m, t, nbytes / t / 1e9, t_cublas / t, err))
    return rows


def sweep_shape(name: str, k: int, n: int, m: int, fmt: str = "nvfp4") -> dict | None:
    """Time every tile config of `sweep_configs()` for one shape and M; print and return the best."""
    dev = torch.device("cuda")
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    packs = {fmt: _packed(fmt, w)} if fmt != "dense" else {}
    plans, _ = _plans(fmt, w, packs, [w] + [w.clone() for _ in range(copies_for(w.numel() * 2) - 1)])
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    base = linear.linear_config(m, n, k, fmt, n, False)
    results = []
    for c in sweep_configs():
        cfg = {**base, **c}
        if n % cfg["BLOCK_N"] or (k // cfg["BLOCK_K"]) % cfg["SPLIT"]:
            continue
        try:
            t = time_graph([lambda p=p: linear.fused_linear(p, x, out, choice=dispatch.Choice("small", cfg))
                            for p in plans])
        except Exception as e:
            print(f"  sweep {name} {fmt} M={m} {c}: {type(e).__name__}", flush=True)
            continue
        results.append((t, cfg))
    results.sort(key=lambda r: r[0])
    t0 = time_graph([lambda p=p: linear.fused_linear(p, x, out) for p in plans])
    for t, cfg in results[:3]:
        print(f"  sweep {name} {fmt} M={m}: {t * 1e6:7.1f} us  {cfg}   (heuristic: {t0 * 1e6:.1f} us)", flush=True)
    return results[0][1] if results else None


def sweep_configs() -> list[dict]:
    """`_splitk_kernel` configs (dense and NVFP4)."""
    return [dict(BLOCK_N=bn, num_stages=st, SPLIT=sp, num_warps=nw)
            for bn in (64, 128, 256) for st in (3, 4) for sp in (1, 2, 4, 8) for nw in (4, 8) if bn < 256 or nw == 8]


def bench_attention(ms: list[int], contexts: list[int], hq: int = 28, hkv: int = 4, d: int = 128) -> None:
    """Decode attention of the 7B shape (28 query and 4 kv heads of 128) at `ms` sequences and each
    live context length: one program a sequence-head against the split runs the engine launches
    (`attention.attention_splits`), over 28 layers' caches (so keys and values come from HBM)."""
    print(f"# decode attention: {torch.cuda.get_device_name()}, bf16, {hq}/{hkv} heads of {d}, 28 layers' caches")
    print(f"{'M':>4} {'context':>8} {'splits':>6} {'one us':>8} {'split us':>9} {'speed-up':>9} {'KV GB/s':>8} {'max diff':>9}")
    dev = torch.device("cuda")
    for m in ms:
        s = max(contexts)
        s += -s % 64
        caches = [(torch.randn(m, hkv, s, d, device=dev, dtype=torch.bfloat16),
                   torch.randn(m, hkv, s, d, device=dev, dtype=torch.bfloat16)) for _ in range(28)]
        q = torch.randn(m, hq, d, device=dev, dtype=torch.bfloat16)
        pad = torch.zeros(m, dtype=torch.long, device=dev)
        work = attention.attention_workspace(m, hq, hkv, d, dev)
        outs = [torch.empty(m, hq * d, device=dev, dtype=torch.bfloat16) for _ in range(2)]
        for ctx in contexts:
            slot = torch.tensor([ctx - 1], device=dev)
            times = [time_graph([lambda kc=kc, vc=vc, w=w, o=o: attention.decode_attention(q, kc, vc, pad, slot, d ** -0.5, o, w)
                                 for kc, vc in caches]) for w, o in ((None, outs[0]), (work, outs[1]))]
            diff = (outs[0].float() - outs[1].float()).abs().max().item()
            gbs = 2 * m * hkv * ctx * d * 2 / times[1] / 1e9
            splits = 1 if work is None else work[0].shape[2]
            print(f"{m:>4} {ctx:>8} {splits:>6} {times[0] * 1e6:>8.1f} {times[1] * 1e6:>9.1f} "
                  f"{times[0] / times[1]:>8.2f}x {gbs:>8.0f} {diff:>9.1e}", flush=True)
        del caches


def main(argv: list[str] | None = None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="7b", help="7b or 0.5b")
    ap.add_argument("--m", default="1,8,64,256", help="rows (batch) to time")
    ap.add_argument("--variants", default="dense,nvfp4,nf4,bnb_nf4",
                    help="dense = the Triton bf16 kernel; nvfp4; nf4; bnb_nf4 = bitsandbytes")
    ap.add_argument("--tiles", action="store_true", help="search NVFP4 and dense tile configs (M=8 and 64)")
    ap.add_argument("--attention", action="store_true", help="time decode attention (one program vs split) instead")
    ap.add_argument("--contexts", default="128,256,512,1024,2048,2304", help="live slots for --attention")
    a = ap.parse_args(argv)
    shapes = SHAPES_7B if a.shapes == "7b" else SHAPES_05B
    ms = [int(v) for v in a.m.split(",")]
    variants = a.variants.split(",")
    if a.attention:
        bench_attention(ms, [int(v) for v in a.contexts.split(",")])
        return []
    print(f"# kernel table: {torch.cuda.get_device_name()}, bf16 activations, weights from HBM")
    print(f"{'shape (in x out)':22} {'kernel':12} {'M':>4} {'time us':>9} {'weight GB/s':>12} {'x cuBLAS':>9} {'rel err':>9}")
    all_rows = []
    for name, k, n in shapes:
        if a.tiles:
            for m in (8, 64):
                for fmt in ("nvfp4", "dense"):
                    sweep_shape(name, k, n, m, fmt)
        rows = bench_shape(name, k, n, ms, variants)
        for v, m, t, gbs, sp, err in rows:
            print(f"{name:22} {v:12} {m:>4} {t * 1e6:>9.1f} {gbs:>12.0f} {sp:>8.2f}x {err:>9.1e}", flush=True)
            all_rows.append(dict(shape=name, kernel=v, m=m, us=t * 1e6, gbs=gbs, speedup=sp, err=err))
    print_summary(all_rows, ms)
    record.write("engine_kernels", all_rows, {"variants": variants})
    return all_rows


def print_summary(rows: list[dict], ms: list[int]) -> None:
    """One line a (shape, kernel): its speed-up over cuBLAS bf16 at each M (the table above, compact)."""
    print("\n# x cuBLAS bf16 (higher is faster)")
    print(f"{'shape (in x out)':22} {'kernel':12} " + " ".join(f"{'M=' + str(m):>7}" for m in ms))
    for shape, kernel in dict.fromkeys((r["shape"], r["kernel"]) for r in rows if r["kernel"] != "cublas_bf16"):
        sp = {r["m"]: r["speedup"] for r in rows if r["shape"] == shape and r["kernel"] == kernel}
        print(f"{shape:22} {kernel:12} " + " ".join(f"{sp[m]:>6.2f}x" for m in ms))


if __name__ == "__main__":
    main()
