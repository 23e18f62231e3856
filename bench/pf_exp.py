"""Experiment: decode step with L2 prefetch budgets (QERL_L2_PREFETCH_MB), side by side."""
import os, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import rollout as rb
from step_profile import replay_ms, print_kernels
from qerl_exp.engine import FastEngine
from qerl_exp.engine.decode import decode_one_token

budgets = [float(b) for b in os.environ.get("BUDGETS", "0,8,16,32").split(",")]
shape = os.environ.get("SHAPE", "7b"); batch = int(os.environ.get("BATCH", "8"))
with torch.no_grad():
    model = rb.build(shape, 32)
    variants = {"bf16": [lay.base_layer for lay in rb.lora_layers(model)]}
    ids = torch.randint(100, 1000, (batch, 128), device="cuda"); mask = torch.ones_like(ids)
    for fmt in os.environ.get("FORMATS", "bf16,nvfp4").split(","):
        if fmt not in variants:
            variants[fmt] = rb.quantized_bases(model, fmt)
        rb.swap(model, variants[fmt])
        eng = FastEngine(model, batch, 384)
        st = eng._state(batch)
        graphs = {}
        ref = None
        for b in budgets:
            os.environ["QERL_L2_PREFETCH_MB"] = str(b)
            eng._graphs.clear()
            torch.manual_seed(0)
            out = eng.generate(ids, mask, 16, temperature=0.0, eos_id=-1, pad_id=0)
            if ref is None:
                ref = out.completion_ids
            print(f"{fmt} budget {b}: greedy tokens equal to the first run's: {(out.completion_ids == ref).float().mean().item():.3f}")
            graphs[b] = eng._graph(st, False, False)
        res = {b: [] for b in budgets}
        for rep in range(3):
            for b in budgets:
                st.slot.fill_(130)
                st.step.zero_()
                res[b].append(replay_ms(graphs[b], 100))
        for b in budgets:
            print(f"{shape} b{batch} {fmt} prefetch {b:5.1f} MB: step {min(res[b]):.3f} ms  (all {['%.3f' % v for v in res[b]]})", flush=True)
        if os.environ.get("PROFILE"):
            for b in (budgets[0], budgets[-1]):
                os.environ["QERL_L2_PREFETCH_MB"] = str(b)
                def fn():
                    st.slot.fill_(130)
                    st.step.zero_()
                    decode_one_token(eng.m, eng.cache, st, eng.backend, False, False, eng.f16_dot)
                print(f"-- kernels, budget {b}")
                print_kernels(fn, "one eager step", 3, 12)
        del eng, graphs
        torch.cuda.empty_cache()
