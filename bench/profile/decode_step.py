"""Where one decode step of the engine goes: graph-replayed step time and the kernels inside it.

    python -m bench.profile.decode_step                       # 7B shape, batch 8, bf16 and nvfp4
    python -m bench.profile.decode_step --shape 0.5b --formats bf16

Builds the same random-weight, LoRA-r32 models as bench/rollout.py. For each format it prints the
CUDA-graph replay time of one decode step, the prefill time, and the GPU kernels of one eager step
and of one prefill (torch.profiler; kernel durations do not depend on the graph) summed by name, so
the gap between the kernels' own time and the replayed step (or the prefill's wall time) is visible;
for the prefill also the torch ops behind them (its glue is torch ops).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from bench import rollout as rb

from qerl_exp.engine import FastEngine
from qerl_exp.engine.decode import decode_one_token
from qerl_exp.engine.prefill import prefill
from qerl_exp.engine.sampling import Filters


def replay_ms(graph, n: int = 50) -> float:
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def kernel_table(engine: FastEngine, st, slot: int, steps: int = 3, top: int = 25) -> None:
    def fn():
        st.slot.fill_(slot)
        decode_one_token(engine.m, engine.cache, st, False, Filters())

    print_kernels(fn, "one eager step", steps, top)
    print_layer_launches(fn, len(engine.m.layers))


def print_layer_launches(fn, layers: int) -> None:
    """The launches of one decoder layer in order, each averaged over the layers of one step: which
    projection's kernel or epilogue takes the time (kernels of the same name are told apart)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda ev: ev.time_range.start)
    names = [ev.name[:60] for ev in evs]
    # the layer's launches repeat: the shortest period that every launch follows but those next to the
    # step's own few (embedding, final norm, lm_head, sampling)
    per = next((p for p in range(1, len(names) // layers + 1)
                if sum(names[i] != names[i + p] for i in range(len(names) - p)) <= p + 16), 0)
    if not per:
        print("   (no per-layer period found)")
        return
    first = next(i for i in range(len(names)) if names[i:i + per] == names[i + per:i + 2 * per])
    print(f"   launches of one layer ({per}), mean over {layers} layers:")
    for j in range(per):
        us = [evs[first + li * per + j].device_time for li in range(layers) if first + li * per + j < len(evs)]
        print(f"   {j:3d} {sum(us) / len(us):8.1f} us  {names[first + j]}")


def print_kernels(fn, what: str, steps: int = 3, top: int = 25, ops: bool = False) -> None:
    """The GPU kernels of `fn()` (averaged over `steps` calls) summed by name, busiest first; with
    `ops`, also the outermost torch ops that launched them, to tell which call a copy or an
    elementwise kernel comes from."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if ops else [])) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    total, count = defaultdict(float), defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name[:70]
            total[name] += ev.device_time / steps
            count[name] += 1 / steps
    busy = sum(total.values())
    print(f"   kernels of {what}: {busy / 1e3:.2f} ms busy, {sum(count.values()):.0f} launches")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        print(f"   {us:9.1f} us {count[name]:6.0f}x  {us / max(count[name], 1):7.1f} us/launch  {name}")
    if ops:  # outermost torch ops (aten::to, not the aten::copy_ inside it) with their kernels' time
        op_us, op_n = defaultdict(float), defaultdict(int)
        for ev in prof.events():
            parent = ev.cpu_parent
            if ev.name.startswith("aten::") and (parent is None or not parent.name.startswith("aten::")):
                op_us[ev.name] += ev.device_time_total / steps
                op_n[ev.name] += 1 / steps
        print(f"   torch ops of {what}, outermost, by the GPU time of their kernels:")
        for name, us in sorted(op_us.items(), key=lambda kv: -kv[1])[:top]:
            if us > 0:
                print(f"   {us:9.1f} us {op_n[name]:6.0f}x  {name}")


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="7b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--formats", default="bf16_triton,bf16_cublas,nvfp4",
                    help="bf16 (dense products as the harness runs them), bf16_triton (Triton split-K), "
                         "bf16_cublas (cuBLAS + Triton epilogues), nvfp4, nf4")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    a = ap.parse_args(argv)
    model = rb.build(a.shape, 32)
    variants = {"bf16": [lay.base_layer for lay in rb.lora_layers(model)]}
    ids = torch.randint(100, 1000, (a.batch, a.prompt), device="cuda")
    mask = torch.ones_like(ids)
    for row in a.formats.split(","):
        fmt, _, variant = row.partition("_")
        if fmt not in variants:
            variants[fmt] = rb.quantized_bases(model, fmt)
        rb.swap(model, variants[fmt])
        engine = FastEngine(model, a.batch, a.prompt + a.new, dense_gemm=variant or "auto")
        engine.generate(ids, mask, 4, temperature=1.0, eos_id=-1, pad_id=0)
        st = engine._state(a.batch)
        graph = engine._graph(st, False, Filters())
        pre = 1e9
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            prefill(engine.m, engine.cache, ids, mask, engine.scratch)
            torch.cuda.synchronize()
            pre = min(pre, (time.perf_counter() - t0) * 1e3)
        st.slot.fill_(a.prompt + 2)
        ms = replay_ms(graph)
        print(f"\n## {a.shape} {row} batch {a.batch}: decode step {ms:.3f} ms (graph replay, "
              f"{a.batch / ms * 1e3:.0f} tokens/s), prefill {pre:.1f} ms")
        kernel_table(engine, st, a.prompt + 2)
        print_kernels(lambda: prefill(engine.m, engine.cache, ids, mask, engine.scratch), "one prefill",
                      top=12, ops=True)
        del engine, graph
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
