"""What each 7B launch sustains at the GPU's power limit: rate, clock, power and energy per FLOP.

    python -m bench.sustained                 # M = 64, 128, 256; about two minutes on an H200
    python -m bench.sustained --m 128 --seconds 1

At RL batch sizes both engines run against the board's power limit (docs/engine.md, "Known limits"),
so a launch timed for a few replays on a cool GPU runs faster than it does inside a rollout. Here
each case is replayed from one CUDA graph for `--seconds` (weights cycled beyond L2, as in
bench/engine_kernels.py) while `gpu_power.PowerMeter` reads the energy counter and samples the SM clock:

- `cublas`: cuBLAS bf16 `x @ W^T`, the bf16 engine's product;
- `nvfp4 kernel`: the 4-bit product alone (`nvfp4_wgmma.launch`, the dispatch table's tiles);
- `nvfp4 path`: what `bench/engine_kernels.py` times for NVFP4, the product with its norm_shrink and
  epilogue launches (`linear.fused_linear`);
- a cuBLAS bf16 8192^3 product first: the best dense rate and energy per FLOP the board sustains.

"% peak" is the rate over Hopper's dense fp16/bf16 tensor rate at the mean clock measured (4096
FLOP a clock an SM: 989 TFLOPS at 1830 MHz on 132 SMs), so it separates the clock the power limit
allowed from how well the launch used it. pJ/FLOP is board power over rate, static power included.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from bench import engine_kernels as kb
from bench import record
from bench.gpu_power import PowerMeter


FLOP_PER_CLOCK_SM = 4096  # Hopper (sm_90) dense fp16/bf16 tensor rate


def sustain(fns: list, seconds: float) -> tuple[float, dict]:
    """Seconds per call of `fns` (cycled, one CUDA graph) replayed for about `seconds`, and the
    PowerMeter reading over those replays."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.2:  # the rate on a warm GPU, to size the timed run
        g.replay()
        n += 1
    torch.cuda.synchronize()
    reps = max(1, round(n * seconds / (time.perf_counter() - t0)))
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with PowerMeter() as pm:
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
    return a.elapsed_time(b) / 1e3 / reps / len(fns), pm.reading


def row(launch_name: str, m: int, path: str, flops: float, sms: int, secs: float, reading: dict) -> dict:
    """One printed line and its record: time, rate and, with a PowerMeter reading, % peak and pJ/FLOP."""
    r = dict(launch=launch_name, m=m, path=path, us=secs * 1e6, tflops=flops / secs / 1e12, **reading)
    if reading:
        r["peak_pct"] = 100 * r["tflops"] * 1e12 / (FLOP_PER_CLOCK_SM * sms * reading["sm_mhz"] * 1e6)
        r["pj_per_flop"] = reading["watts"] / r["tflops"]
    cells = f"{r['launch']:8} {m:>5} {path:13} {r['us']:9.1f} us {r['tflops']:7.1f} TFLOPS"
    if reading:
        cells += (f" {r['peak_pct']:5.1f} % peak  {r['watts']:4.0f} W {r['sm_mhz']:5.0f} MHz"
                  f" capped {100 * r['capped']:3.0f} %  {r['pj_per_flop']:.2f} pJ/FLOP")
    print(cells, flush=True)
    return r


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="64,128,256", help="rows (batch) to time")
    ap.add_argument("--seconds", type=float, default=2.0, help="replay time a case")
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(dev) != (9, 0):
        sys.exit("bench.sustained needs a Hopper GPU ('% peak' is sm_90's tensor rate): run it on an H100 or H200")
    # Triton and Gluon, which a CPU install may lack, only where the kernels run
    from qerl_exp.engine import dispatch, linear, nvfp4_wgmma
    from qerl_exp.engine.triton_util import capability

    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"# {torch.cuda.get_device_name(dev)}, {sms} SMs; each case replayed for {a.seconds} s")
    rows = []
    big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(big)
    rows.append(row("square", 8192, "cublas", 2 * 8192 ** 3, sms,
                    *sustain([lambda: torch.mm(big, big, out=out)], a.seconds)))
    del big, out
    for name, k, n in kb.LAUNCHES_7B:
        torch.manual_seed(0)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        dense = [w] + [w.clone() for _ in range(kb.copies_for(w.numel() * 2) - 1)]
        plans, _ = kb._plans("nvfp4", w, {"nvfp4": kb._packed("nvfp4", w)}, [w])
        for m in [int(v) for v in a.m.split(",")]:
            flops = 2 * m * n * k
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            rows.append(row(name, m, "cublas", flops, sms,
                            *sustain([lambda d=d: torch.mm(x, d.t(), out=y) for d in dense], a.seconds)))
            choice = dispatch.choose(n, k, m, capability(dev))
            if choice.kind == "wgmma":
                x16 = (x / 16).half()
                rows.append(row(name, m, "nvfp4 kernel", flops, sms, *sustain(
                    [lambda p=p: nvfp4_wgmma.launch(p, x16, sms, choice.tiles) for p in plans], a.seconds)))
            xin, kw = kb.operand(name, plans[0], x)
            rows.append(row(name, m, "nvfp4 path", flops, sms, *sustain(
                [lambda p=p: linear.fused_linear(p, xin, y, **kw) for p in plans], a.seconds)))
        del w, dense, plans
        torch.cuda.empty_cache()
    record.write("sustained", rows, {"seconds": a.seconds})
    return rows


if __name__ == "__main__":
    main()
