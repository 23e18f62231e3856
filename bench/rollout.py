"""Rollout throughput: HF generate vs FastEngine, bf16 / NVFP4 / NF4, measured side by side.

    python -m bench.rollout                          # 7B and 0.5B shapes, batch 8 and 64
    python -m bench.rollout --shapes 0.5b --quick    # a smoke run
    python -m bench.rollout --kernels                # also print the kernel table (bench/engine_kernels.py)

Qwen2.5-shaped models with random weights (built from a Qwen2Config, nothing downloaded), LoRA
r=32 (alpha 32) on all seven projections with non-zero B in every row, prompts of `--prompt`
tokens, `--new` new tokens (EOS disabled, so every row decodes the same count), sampling at
temperature 1. Tokens/s = batch * new tokens / wall time of the whole `generate` call (prefill
included). HF rows decode `--hf-new` tokens (HF's per-step cost is flat; 256 HF steps on 7B take
minutes). Engine rows: the first call captures the CUDA graph (and compiles the Triton kernels);
that time is printed as warm-up and left out. Peak memory is the process' peak allocated during the
row, which includes every model variant still resident (printed separately as "weights").
Over the engine rows' timed calls the board's mean power, SM clock, the share of samples at its power
cap and the energy per token are recorded (`gpu_power`): at 64+ sequences an H200 runs both engines
at its 700 W limit, where the tokens/s ratio is one of energy per token.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from bench import record
from bench.gpu_power import PowerMeter
from qerl_exp.engine import FastEngine

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPES = {
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}
# engine_bf16: dense products as the harness runs them (dense_gemm="auto"); _triton and _cublas force one
ROWS = ("hf_bf16", "hf_nf4", "engine_bf16", "engine_bf16_triton", "engine_bf16_cublas", "engine_nvfp4", "engine_nf4")


def build(shape: str, rank: int):
    """A random-weight Qwen2.5-shaped bf16 model on the GPU, wrapped with LoRA on all projections."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**SHAPES[shape], rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768)
    torch.manual_seed(0)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        model = Qwen2ForCausalLM(cfg).eval()
        torch.set_default_dtype(torch.float32)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=rank, target_modules=LINEARS, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    return model.eval()


def lora_layers(model):
    return [m for m in model.modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")]


def quantized_bases(model, fmt: str) -> list:
    """New base layers in `fmt` for every LoRA-wrapped projection (the bf16 ones are kept)."""
    out = []
    for lay in lora_layers(model):
        lin = lay.base_layer
        if fmt == "nvfp4":
            from qerl_exp.quant.fp4 import FP4Linear

            out.append(FP4Linear.from_linear(lin, "nvfp4"))
        else:
            from qerl_exp.quant.nf4 import NF4Linear

            out.append(NF4Linear.from_linear(lin, double_quant=True, compute_dtype=torch.bfloat16).to("cuda"))
    return out


def swap(model, bases: list) -> None:
    for lay, b in zip(lora_layers(model), bases):
        lay.base_layer = b


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def run_hf(model, ids, mask, new: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=True,
                   temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0, eos_token_id=None)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def run_engine(engine, ids, mask, new: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = engine.generate(ids, mask, new, temperature=1.0, eos_id=-1, pad_id=0)
    torch.cuda.synchronize()
    assert out.completion_ids.shape[1] == new
    return time.perf_counter() - t0


def bench_shape(shape: str, a) -> list[dict]:
    results = []
    t0 = time.perf_counter()
    model = build(shape, a.rank)
    print(f"\n## {shape}: built in {time.perf_counter() - t0:.1f} s, weights {weight_bytes(model) / 2**30:.2f} GiB "
          f"(bf16 + LoRA r{a.rank})", flush=True)
    bf16 = [lay.base_layer for lay in lora_layers(model)]
    variants = {"bf16": bf16}
    rows = [r for r in ROWS if r in a.rows]
    vocab = SHAPES[shape]["vocab_size"]
    for fmt in ("nvfp4", "nf4"):
        if any(r.endswith(fmt) for r in rows):
            t0 = time.perf_counter()
            variants[fmt] = quantized_bases(model, fmt)
            print(f"   quantized to {fmt} in {time.perf_counter() - t0:.1f} s", flush=True)
    base_tps = {}
    for b in a.batch:
        g = torch.Generator().manual_seed(b)
        ids = torch.randint(100, vocab - 100, (b, a.prompt), generator=g).cuda()
        mask = torch.ones_like(ids)
        for row in rows:
            kind, fmt = row.split("_", 1)
            fmt_key, _, variant = fmt.partition("_")
            swap(model, variants[fmt_key])
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            try:
                if kind == "hf":
                    warm = run_hf(model, ids, mask, 2)
                    secs = run_hf(model, ids, mask, a.hf_new)
                    new, build_s, power = a.hf_new, 0.0, {}
                else:
                    engine = FastEngine(model, b, a.prompt + a.new,
                                        dense_gemm=variant if variant in ("triton", "cublas") else "auto")
                    build_s = engine.build_s
                    warm = run_engine(engine, ids, mask, 4)
                    with PowerMeter() as pm:
                        secs = min(run_engine(engine, ids, mask, a.new) for _ in range(a.repeats))
                    new = a.new
                    power = pm.reading
                    del engine
            except Exception as e:  # keep the table going; the failure is printed
                print(f"   {row} batch {b}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
                continue
            tps = b * new / secs
            base_tps.setdefault(b, tps)
            wbytes = weight_bytes(model)
            res = dict(shape=shape, row=row, batch=b, new_tokens=new, tok_s=tps, ms_step=secs / new * 1e3,
                       warmup_s=warm, build_s=build_s, peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                       weights_gib=wbytes / 2**30, ratio=tps / base_tps[b])
            if power:  # energy over all `repeats` timed calls
                res.update(watts=power["watts"], sm_mhz=power["sm_mhz"], capped=power["capped"],
                           mj_token=power["joules"] * 1e3 / (a.repeats * b * new))
            results.append(res)
            print(f"   {row:18} batch {b:3}: {tps:9.1f} tokens/s  {res['ms_step']:7.2f} ms/step  "
                  f"x{res['ratio']:6.2f} vs {rows[0]}  warm-up+capture {warm:6.1f} s  build {build_s:5.1f} s  "
                  f"peak {res['peak_gib']:6.2f} GiB{_power_text(res)}", flush=True)
    del model, variants, bf16
    gc.collect()
    torch.cuda.empty_cache()
    return results


def _power_text(r: dict) -> str:
    """The power columns of a row ('' where they were not recorded)."""
    if "watts" not in r:
        return ""
    return f"  {r['watts']:4.0f} W  SM {r['sm_mhz']:4.0f} MHz  capped {r['capped']:4.0%}  {r['mj_token']:6.2f} mJ/token"


def print_table(results: list[dict], a) -> None:
    print(f"\n# rollout tokens/s on {torch.cuda.get_device_name()}: prompt {a.prompt}, new tokens {a.new} "
          f"(HF rows: {a.hf_new}), LoRA r{a.rank} on 7 projections, temperature 1; engine rows: mean board "
          f"power, SM clock, share of samples at the power cap, energy per token")
    print(f"{'shape':6} {'row':18} {'batch':>5} {'tokens/s':>10} {'ms/step':>8} {'ratio':>7} {'warm-up s':>9} "
          f"{'peak GiB':>9}")
    for r in results:
        print(f"{r['shape']:6} {r['row']:18} {r['batch']:>5} {r['tok_s']:>10.1f} {r['ms_step']:>8.2f} "
              f"{r['ratio']:>6.2f}x {r['warmup_s']:>9.1f} {r['peak_gib']:>9.2f}{_power_text(r)}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="7b,0.5b", help="comma list of 7b, 0.5b")
    ap.add_argument("--batch", default="8,64", help="comma list of batch sizes")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--new", type=int, default=256, help="new tokens per engine row")
    ap.add_argument("--hf-new", type=int, default=32, help="new tokens per HF generate row")
    ap.add_argument("--rank", type=int, default=32, help="LoRA rank (alpha = rank)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}")
    ap.add_argument("--repeats", type=int, default=2, help="timed engine calls per row (best kept)")
    ap.add_argument("--quick", action="store_true", help="batch 8 only, 64 new tokens, 8 HF tokens")
    ap.add_argument("--kernels", action="store_true", help="also print the kernel table")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    a.batch = [int(b) for b in a.batch.split(",")]
    a.rows = a.rows.split(",")
    if a.quick:
        a.batch, a.new, a.hf_new = [8], 64, 8
    results = []
    for shape in a.shapes.split(","):
        results += bench_shape(shape, a)
    print_table(results, a)
    if a.kernels:
        from bench import engine_kernels as kb

        kb.main(["--shapes", "7b"])
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    rows = "all" if tuple(a.rows) == ROWS else ",".join(a.rows)
    record.write("rollout", results, {"prompt": a.prompt, "new": a.new, "hf_new": a.hf_new, "rank": a.rank},
                 workload=(a.shapes, "b" + ",".join(map(str, a.batch)), rows, f"p{a.prompt}", f"n{a.new}"))


if __name__ == "__main__":
    main()
