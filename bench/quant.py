"""Quantization formats side by side: bytes and CPU forward time, as ratios to bf16.

For the embedded tiny model and a Qwen2.5-0.5B-shaped model (random weights built from a config;
nothing is downloaded), per format (bf16, nf4, nf4_dq, nvfp4, mxfp4):

- bytes of the quantized decoder linears (q, k, v, o, gate, up, down: codes, every scale, nested
  double-quant statistics, bitsandbytes' quant_state, bias) and of the whole model, counted by
  `qerl_exp.quant.memory_bytes` on the real quantized model;
- CPU forward time of the decoder stack (embeddings, decoder layers, final norm; prefill-like
  and decode-like shapes), all formats measured in one process, round-robin so that drift hits
  them alike, warm-up excluded, median of repeats. `lm_head` is left out of the timing: it is
  unquantized and the same in every format, and for the tied 0.5B head transformers copies the
  whole 136M-weight matrix on every call, which would swamp the decoder.

Activations and unquantized weights are bf16. The Qwen2.5-0.5B shape is timed with fewer decoder
layers (`--timing-layers`, default 4, stated in the output) to keep the run short on 2 cores; its
bytes are always measured on all 24 layers. The tiny model is timed with 4x the repeats (it is
fast). Timings are only as quiet as the machine: other processes on the same cores skew them.

    python -m bench.quant [--timing-layers 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from bench import record
from qerl_exp.config import QuantConfig
from qerl_exp.config.architectures import projections
from qerl_exp.config.compose import compose, group_options
from qerl_exp.quant import memory_bytes, quantize_model

DTYPE = torch.bfloat16
# What the issue asks of the Qwen2.5-0.5B shape: quantized-linear bytes / bf16 at most this.
LIMITS = {"nvfp4": 0.29, "mxfp4": 0.27, "nf4_dq": 0.27}
SHAPES = {"prefill 1x64": (1, 64), "decode 8x1": (8, 1)}  # (batch, tokens); no KV cache
MiB = 2**20


def tiny_config():
    """The embedded model's shape (Qwen2, hidden 128, MLP 256, 2 layers) with its char vocab."""
    from qerl_exp.config import ModelConfig
    from qerl_exp.models.synthetic import hf_config
    from qerl_exp.models.tokenizers import CharTokenizer

    return hf_config(ModelConfig(), vocab_size=len(CharTokenizer()))


def qwen05b_config(num_layers: int = 24):
    """Qwen2.5-0.5B's shape: hidden 896, MLP 4864, 14 heads, 2 kv heads, vocab 151936, tied."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=num_layers,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1e6, tie_word_embeddings=True,
    )


def build(config, seed: int = 0):
    """A random-weight bf16 Qwen2ForCausalLM, frozen, in eval mode."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)  # initialize in bf16 directly (no fp32 copy of 0.5B weights)
    try:
        model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)


def presets() -> dict[str, QuantConfig]:
    """Every quant preset (`conf/quant/*.yaml`, bf16 first) as a run composes it."""
    names = sorted(group_options("quant"), key=lambda name: name != "bf16")
    return {name: compose([f"quant={name}"])[0].quant for name in names}


def quantized(base, quant: QuantConfig):
    """A quantized copy of `base` (`base` itself for `format=none`)."""
    if quant.format == "none":
        return base
    return quantize_model(copy.deepcopy(base), quant, DTYPE)


def measure_bytes(config) -> dict[str, tuple[int, int, int]]:
    """format -> (quantized-linear bytes, whole-model bytes, number of linear weights)."""
    base = build(config)
    quants = presets()
    linears = [m for *_, m in projections(base, quants["nvfp4"].targets)]
    n_weights = sum(m.weight.numel() for m in linears)
    dense = sum(p.numel() * p.element_size() for m in linears for p in m.parameters())
    out = {}
    for fmt, quant in quants.items():
        model = quantized(base, quant)
        mem = memory_bytes(model)
        linear_bytes = dense if fmt == "bf16" else mem["mem/quantized_linear_bytes"]
        out[fmt] = (linear_bytes, mem["mem/weights_bytes"], n_weights)
        del model
    return out


@torch.inference_mode()
def measure_time(config, repeats: int) -> tuple[dict, dict]:
    """(format -> shape -> sorted timed seconds, format -> shape -> warm-up seconds)."""
    base = build(config)
    models = {fmt: quantized(base, quant) for fmt, quant in presets().items()}
    gen = torch.Generator().manual_seed(0)
    inputs = {s: torch.randint(0, config.vocab_size, bs, generator=gen) for s, bs in SHAPES.items()}
    warm = {fmt: {} for fmt in models}
    runs = {fmt: {s: [] for s in SHAPES} for fmt in models}
    for r in range(repeats + 1):
        for shape, ids in inputs.items():
            for fmt, model in models.items():
                t0 = time.perf_counter()
                model.model(input_ids=ids)
                dt = time.perf_counter() - t0
                if r == 0:
                    warm[fmt][shape] = dt
                else:
                    runs[fmt][shape].append(dt)
    return {f: {s: sorted(v) for s, v in d.items()} for f, d in runs.items()}, warm


def print_bytes(title: str, sizes: dict) -> list[dict]:
    """Print the bytes table; return its rows."""
    print(f"\n{title}: bytes (quantized linears = q,k,v,o,gate,up,down with all scales, state and bias)")
    print(f"  {'format':<7} {'linear bytes':>14} {'MiB':>9} {'bits/weight':>11} {'ratio':>6}   "
          f"{'model bytes':>14} {'MiB':>9} {'ratio':>6}")
    lin0, mod0, _ = sizes["bf16"]
    rows = []
    for fmt, (lin, mod, n) in sizes.items():
        print(f"  {fmt:<7} {lin:>14,d} {lin / MiB:>9.2f} {8 * lin / n:>11.3f} {lin / lin0:>6.3f}   "
              f"{mod:>14,d} {mod / MiB:>9.2f} {mod / mod0:>6.3f}")
        rows.append(dict(table="bytes", model=title, format=fmt, linear_bytes=lin, bits_per_weight=8 * lin / n,
                         linear_ratio=lin / lin0, model_bytes=mod, model_ratio=mod / mod0))
    return rows


def print_time(title: str, runs: dict, warm: dict, repeats: int) -> list[dict]:
    """Print the time table; return its rows."""
    print(f"\n{title}: CPU forward time of the decoder stack, median (and min) of {repeats} after "
          f"1 warm-up, {torch.get_num_threads()} torch threads; ratio of medians")
    head = "".join(f" {s + ' ms':>22} {'ratio':>6}" for s in SHAPES)
    print(f"  {'format':<7}{head}   {'warm-up ms':>22}")
    med = {f: {s: statistics.median(v) for s, v in d.items()} for f, d in runs.items()}
    rows = []
    for fmt in runs:
        cols = "".join(f" {1e3 * med[fmt][s]:>12.2f} ({1e3 * runs[fmt][s][0]:>7.2f}) "
                       f"{med[fmt][s] / med['bf16'][s]:>6.2f}" for s in SHAPES)
        wcols = " / ".join(f"{1e3 * warm[fmt][s]:.1f}" for s in SHAPES)
        print(f"  {fmt:<7}{cols}   {wcols:>22}")
        rows += [dict(table="time", model=title, format=fmt, shape=s, median_ms=1e3 * med[fmt][s],
                      min_ms=1e3 * runs[fmt][s][0], ratio=med[fmt][s] / med["bf16"][s], warmup_ms=1e3 * warm[fmt][s])
                 for s in SHAPES]
    return rows


def _load() -> str:
    # Other processes on the same cores inflate every timing; print how busy the machine was.
    return "load average %.2f / %.2f / %.2f (1 / 5 / 15 min)" % os.getloadavg()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timing-layers", type=int, default=4, help="decoder layers of the 0.5B shape when timing")
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards per format and shape")
    parser.add_argument("--out", type=Path, default=record.RESULTS, help="where the JSON record goes (bench.record)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    print(f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads, {os.cpu_count()} cores; "
          f"activations bf16; shapes (batch x tokens): {', '.join(SHAPES)}; {_load()}")

    tiny = tiny_config()
    rows = print_bytes("tiny (Qwen2, hidden 128, MLP 256, 2 layers, vocab %d)" % tiny.vocab_size, measure_bytes(tiny))
    rows += print_time("tiny", *measure_time(tiny, 4 * args.repeats), 4 * args.repeats)

    big = measure_bytes(qwen05b_config())
    rows += print_bytes("Qwen2.5-0.5B shape (hidden 896, MLP 4864, 24 layers, 14/2 heads, vocab 151936, tied)", big)
    layers = args.timing_layers
    rows += print_time(f"Qwen2.5-0.5B shape, {layers} of 24 decoder layers",
                       *measure_time(qwen05b_config(layers), args.repeats), args.repeats)

    lin0 = big["bf16"][0]
    checks = [f"{fmt} {big[fmt][0] / lin0:.3f} <= {limit} {'ok' if big[fmt][0] / lin0 <= limit else 'FAIL'}"
              for fmt, limit in LIMITS.items()]
    print("\nQwen2.5-0.5B shape, quantized-linear bytes / bf16: " + "; ".join(checks))
    print(f"total runtime {time.perf_counter() - start:.1f} s; {_load()}")
    record.write("quant", rows, {"threads": torch.get_num_threads(), "torch": torch.__version__}, out=args.out)



if __name__ == "__main__":
    main()
