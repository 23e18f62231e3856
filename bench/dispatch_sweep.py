"""The NVFP4 dispatch table the rollout engine reads: every candidate kernel timed for each 7B
launch shape at M 1-256, the fastest per (shape, M) written to `--out`.

    python -m bench.dispatch_sweep --out qerl_exp/engine/dispatch.json   # the table the package ships
    python -m bench.dispatch_sweep --out /tmp/dispatch.json --m 8,64      # look before replacing it

cuBLAS bf16, the decode kernels ("small") and `nvfp4_wgmma` (its tile table and the `wgmma_tiles`
variants) are timed side by side as `bench.engine_kernels` times them (graph replays, weights from
HBM); `qerl_exp.engine.dispatch` says how the engine reads the table. Nothing is written but `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from bench.engine_kernels import (LAUNCHES_7B, SWEEP_M, _packed, _plans, copies_for, operand, time_graph,
                                  wgmma_tiles)
from qerl_exp.engine import dispatch, linear


def dispatch_sweep(launches: list, ms: list[int], out_path: Path, command: str) -> dict:
    """Time cuBLAS bf16, the decode kernels ("small") and `nvfp4_wgmma` (its tile table and the
    `wgmma_tiles` variants) for every launch shape and M; print them side by side and write the
    fastest per (shape, M) as the dispatch table."""
    dev = torch.device("cuda")
    rows = []
    print(f"{'launch (N x K)':22} {'M':>4} {'cuBLAS us':>10} {'small':>7} {'wgmma':>7}  best "
          "(x cuBLAS bf16: higher is faster)")
    for name, k, n in launches:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        dense = [w] + [w.clone() for _ in range(copies_for(w.numel() * 2) - 1)]
        plans, _ = _plans("nvfp4", w, {"nvfp4": _packed("nvfp4", w)}, dense)
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            t_ref = time_graph([lambda wc=wc: torch.mm(x, wc.t(), out=out) for wc in dense])
            cands = {"small": dispatch.Choice("small")}
            if m >= 16:
                cands["wgmma"] = dispatch.Choice("wgmma")
                for tiles in wgmma_tiles(m):
                    cands["wgmma " + json.dumps(tiles)] = dispatch.Choice("wgmma", tiles)
            us = {}
            for cand, choice in cands.items():
                xin, x16 = operand(name, plans[0], x, choice.kind)
                try:
                    us[cand] = time_graph([lambda p=p: linear.fused_linear(p, xin, out, choice=choice, **x16)
                                           for p in plans]) * 1e6
                except Exception as e:  # keep the sweep going; the failure is printed and never chosen
                    print(f"  {name} M={m} {cand} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    us[cand] = float("nan")
            rows.append(dict(shape=f"{n}x{k}", m=m, us=us))
            best = min((c for c in us if us[c] == us[c]), key=us.get)
            wg_best = min([us[c] for c in us if c.startswith("wgmma") and us[c] == us[c]], default=float("nan"))
            ref = t_ref * 1e6
            print(f"{name + f' {n}x{k}':22} {m:>4} {ref:>10.1f} {ref / us['small']:>6.2f}x {ref / wg_best:>6.2f}x  "
                  f"{best} ({ref / us[best]:.2f}x)", flush=True)
        del plans, dense, w
        torch.cuda.empty_cache()
    header = dict(device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                  command=command)
    return dispatch.write_table(out_path, rows, header)



def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="where to write the table (the package's: qerl_exp/engine/dispatch.json)")
    ap.add_argument("--m", default=",".join(map(str, SWEEP_M)), help="rows to time")
    a = ap.parse_args(argv)
    print(f"# dispatch sweep: {torch.cuda.get_device_name()}, bf16 activations, weights from HBM")
    dispatch_sweep(LAUNCHES_7B, [int(v) for v in a.m.split(",")], Path(a.out),
                   "python -m bench.dispatch_sweep " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"# wrote {a.out}")


if __name__ == "__main__":
    main()
