"""Where one packed learner micro-batch goes: forward + backward wall time and the kernels inside it.

    python -m bench.profile.learner                          # 7B shape, 16,384 tokens, bf16 and nvfp4
    python -m bench.profile.learner --tokens 2304 --checkpointing true

Builds the 7B-shape model (random weights, block by block on the GPU), quantizes it per format,
adds LoRA r32 on all seven projections, and scores a packed micro-batch of `--tokens` tokens
(groups of 8 rows: a 256-token prompt and 512-token completions, the prompt shared) with
`qerl_exp.decoders.scoring.score_packed`, then backward of its log-probs. It prints the mean time of `--iters`
timed iterations after a warm-up (compilation), the model TFLOPS at 4 x (matmul parameters) FLOP a
row token, and the GPU kernels of one iteration summed by kind (torch.profiler), with the time the
host took to issue them (the call's return before the GPU is done).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from qerl_exp.config import LoraConfig, ModelConfig, QuantConfig
from qerl_exp.decoders import packing
from qerl_exp.decoders.batch import Sequences
from qerl_exp.decoders.scoring import score_packed
from qerl_exp.models import add_lora
from qerl_exp.models.synthetic import build
from qerl_exp.quant import quantize_model

SHAPE_7B = dict(hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4,
                vocab_size=152064, max_positions=32768, tie_embeddings=False)
KINDS = [("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "ampere", "wgmma")), ("attention", ("flash",)),
         ("decode", ("dequant", "nvfp4")), ("elementwise", ("_norm_", "_swiglu_", "_rope_", "elementwise"))]


def micro_batch(tokens: int, prompt: int = 256, new: int = 512, group: int = 8) -> Sequences:
    """Groups of `group` rows sharing a prompt, as many rows as fit `tokens` packed tokens."""
    rows, used = 0, 0
    while True:
        cost = new + (prompt if rows % group == 0 else 0)
        if used + cost > tokens and rows:
            break
        rows, used = rows + 1, used + cost
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 150000, (rows // group + 1, prompt), generator=g).repeat_interleave(group, 0)[:rows]
    return Sequences(prompts.cuda(), torch.ones(rows, prompt, dtype=torch.long).cuda(),
                     torch.randint(0, 150000, (rows, new), generator=g).cuda(), torch.ones(rows, new, dtype=torch.long).cuda())


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(key in low for key in keys)), "other")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bf16,nvfp4")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--checkpointing", default="false", choices=["auto", "true", "false"])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="torch's eager elementwise ops instead of the fused kernels")
    args = ap.parse_args()
    cfg = ModelConfig(**SHAPE_7B)
    batch = micro_batch(args.tokens)
    rows = batch.prompt_ids.shape[0]
    row_tokens = rows * (batch.prompt_ids.shape[1] + batch.completion_ids.shape[1])
    h, inter, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.hidden_size // cfg.num_heads
    matmul = cfg.num_layers * (h * (h + 2 * kv) + h * h + 3 * h * inter)
    flops = 4.0 * (matmul * row_tokens + h * cfg.vocab_size * rows * batch.completion_ids.shape[1])
    for fmt in args.formats.split(","):
        quant = QuantConfig(format="none" if fmt == "bf16" else fmt)
        on_block = None if quant.format == "none" else (lambda block: quantize_model(block, quant, torch.bfloat16))
        model = build(cfg, 0, "cuda", torch.bfloat16, on_block=on_block)
        model.requires_grad_(False)
        policy = add_lora(model, LoraConfig(r=32, alpha=32))

        def step():
            logp, _ = score_packed(policy, batch, 1.0, shared_prefix=True, checkpointing=args.checkpointing,
                                   fused=not args.eager)
            logp.sum().backward()

        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            step()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / args.iters
        t0 = time.perf_counter()
        step()  # the host's part: until the last launch is queued
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        by_kind, by_name = defaultdict(float), defaultdict(float)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                by_kind[kind(ev.name)] += ev.device_time / 1e3
                by_name[ev.name[:90]] += ev.device_time / 1e3
        busy = sum(by_kind.values())
        print(f"\n{fmt}: {rows} rows, {row_tokens} row tokens, {len(packing.pack(batch, True, 'cpu').input_ids)} packed, "
              f"checkpointing {args.checkpointing}: {seconds * 1e3:.0f} ms fwd+bwd, {row_tokens / seconds:.0f} row tok/s, "
              f"{flops / seconds / 1e12:.0f} model TFLOPS; GPU busy {busy:.0f} ms; host {host * 1e3:.0f} ms; peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
        print(" | ".join(f"{k} {v:.0f} ms" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])))
        for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:12]:
            print(f"  {ms:8.1f} ms  {name}")
        del policy, model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
