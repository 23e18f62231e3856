"""The whole RL step at 7B-32B shapes: weights, peak memory and step time per strategy, side by side.

    python -m bench.step                                   # 7B, the paper's workload, 3 strategies
    python -m bench.step --shapes 7b,14b --workload wide   # 64 sequences x 512 new tokens
    python -m bench.step --workload real --strategies nvfp4_lora --learners padded,packed
    python -m bench.step --shapes 32b --strategies nvfp4_lora,full_precision
    python -m bench.step --workload wide --strategies nvfp4_lora --nproc 2   # one run on 2 GPUs (torchrun)

Each (shape, strategy, learner) is its own process, `python -m qerl_exp` with the shape preset
(`model=qwen2.5-<shape>-shape`: Qwen2.5's decoder, vocabulary and untied lm_head, random weights),
the strategy preset, LoRA r32 (alpha 32) on all seven projections, and the same learner settings
for every strategy. Completions are forced to the full length (`rollout.ignore_eos=true`); prompts
are `--prompt` tokens (a generated task file whose questions are that many characters of the
character tokenizer). Workloads:
- `paper`: Table 3's speed test, 8 completions (1 prompt x group 8), prompt 256, completion 2048;
  gradient checkpointing on every block and micro-batches of one completion (2,304 tokens), as
  the paper's memory comparison wants.
- `wide`: 64 completions (8 x 8), prompt 256, completion 512; checkpointing `auto`, micro-batches
  of `train.micro_batch_tokens` (16,384 by default).
- `real`: as `wide`, but completion i ends after `rollout.lengths[i]` tokens: lengths drawn from a
  real run's (`REAL_RUN`: SmolLM2-135M's full-precision run at step 30, mean 78 of 128 tokens, 30 %
  cut at the cap; each row at the cap with that share, the rest uniform with that mean, scaled to
  512 tokens). Checkpointing off, for both learners.
`--learners packed,padded` runs each strategy with the padding-free learner (`train.padding_free`)
and with the padded one (HF forward through peft, `--micro` rows a micro-batch).

Step 0 (Triton compilation, CUDA-graph capture, torch.compile) is printed as warm-up and left out;
the table shows the mean of the later steps: the rollout, the reference forward (0 at beta 0 but on
`monitor.kl_every` steps: the bench sets it to 0), the learner's forward + backward passes, the
optimizer; the learner's rate in row tokens (each row's prompt + completion, no padding) per
second, and in model TFLOPS at 4 x (decoder matmul parameters) FLOP a row token plus 4 x lm_head
a completion token (forward and input-gradient passes; recompute, attention and the savings of
shared prompts not counted) with its share of the H200's 989 TFLOPS dense bf16. Memory is
`mem/weights_bytes` (the policy's parameters and buffers, quantized layers with their scales),
`mem/load_peak_bytes` (while the model was built) and CUDA's max allocated in the rollout and in
the learner phases over all steps (`mem/rollout_peak_bytes`, `mem/learner_peak_bytes`); "peak / fp"
is the larger of the two over full_precision's at the same shape and learner, as are the other
ratios. `--nproc N` runs each one under `torchrun --standalone --nproc-per-node N` (data parallel,
`qerl_exp/run/distributed.py`): the same global batch split over N GPUs; times are the slowest rank's,
memory the largest rank's. Compare `seq/s` (completions per second of the whole step) with a
`--nproc 1` run of the same workload.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import record

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {
    "paper": dict(prompts=1, group=8, prompt=256, new=2048, checkpointing="true", micro_tokens=2304),
    "wide": dict(prompts=8, group=8, prompt=256, new=512, checkpointing="auto", micro_tokens=16384),
    "real": dict(prompts=8, group=8, prompt=256, new=512, checkpointing="false", micro_tokens=16384),
}
REAL_RUN = ROOT / "results/smollm2_100steps/full_precision_s0/metrics.jsonl"
GIB = 2**30
PEAK_TFLOPS = 989.0  # H200 SXM dense bf16, datasheet


def real_lengths(rows: int, cap: int, step: int = 30, run_cap: int = 128, seed: int = 0) -> list[int]:
    """Completion lengths of `rows` rows shaped like `REAL_RUN`'s batch at `step`: its share cut at
    the cap, the others uniform around its remaining mean, scaled from `run_cap` to `cap` tokens."""
    import numpy as np

    stats = next(json.loads(line) for line in REAL_RUN.read_text().splitlines() if json.loads(line)["step"] == step)
    clipped = round(stats["completions/clipped_ratio"] * rows)
    rest_mean = (stats["completions/mean_length"] * rows - run_cap * clipped) / max(1, rows - clipped) * cap / run_cap
    rest = np.random.default_rng(seed).uniform(1, min(cap - 1, 2 * rest_mean - 1), rows - clipped).round().astype(int)
    lengths = [cap] * clipped + rest.tolist()
    np.random.default_rng(seed + 1).shuffle(lengths)
    return lengths


def model_flops(shape: str, row_tokens: int, completion_tokens: int) -> float:
    """4 x (decoder matmul parameters) a row token + 4 x lm_head a completion token (see the docstring)."""
    import yaml

    m = yaml.safe_load((ROOT / f"conf/model/qwen2.5-{shape}-shape.yaml").read_text())["model"]
    h, inter, kv = m["hidden_size"], m["intermediate_size"], m["num_kv_heads"] * m["hidden_size"] // m["num_heads"]
    decoder = m["num_layers"] * (h * (h + 2 * kv) + h * h + 3 * h * inter)
    return 4.0 * decoder * row_tokens + 4.0 * h * m["vocab_size"] * completion_tokens


def task_file(path: Path, prompt_tokens: int, n: int = 64) -> None:
    """GSM8K-format problems whose questions are `prompt_tokens - 1` characters (BOS makes the rest)."""
    rows = []
    for i in range(n):
        stem = f"Problem {i}: a farmer has {i + 3} rows of {i + 5} plants. How many plants are there? "
        question = (stem * (prompt_tokens // len(stem) + 1))[: prompt_tokens - 1]
        rows.append(json.dumps({"question": question, "answer": f"{(i + 3) * (i + 5)}\n#### {(i + 3) * (i + 5)}"}))
    path.write_text("\n".join(rows) + "\n")


def run_one(shape: str, strategy: str, learner: str, workload: dict, steps: int, micro: int, data: Path, out: Path,
            nproc: int = 1) -> dict:
    """Run one (shape, strategy, learner) in its own process (`nproc` > 1: torchrun's processes);
    return its per-step metrics, or the error."""
    run_dir = out / f"{shape}_{strategy}_{learner}"
    shutil.rmtree(run_dir, ignore_errors=True)  # the bench owns its folder: a rerun measures anew
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    lengths = [f"rollout.lengths=[{','.join(map(str, workload['lengths']))}]"] if workload.get("lengths") else []
    args = [
        sys.executable, *launcher, "-m", "qerl_exp", f"model=qwen2.5-{shape}-shape", f"strategy={strategy}", "lora=r32",
        "task=gsm8k", f"task.path={data}", f"train.steps={steps}", f"train.prompts_per_step={workload['prompts']}",
        f"algo.group_size={workload['group']}", f"algo.max_new_tokens={workload['new']}", "rollout.ignore_eos=true",
        *lengths, f"train.padding_free={learner == 'packed'}", f"train.micro_batch_size={micro}",
        f"train.micro_batch_tokens={workload['micro_tokens']}", f"train.gradient_checkpointing={workload['checkpointing']}",
        "monitor.kl_every=0", "checkpoint.every=0", "tracker=disabled", "tracker.completions_every=0", f"run_dir={run_dir}",
    ]
    print(f"--- {shape} {strategy} {learner}: {' '.join(args[3 + len(launcher):])[:400]}", flush=True)
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
    metrics = run_dir / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.exists():
        lines = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()
        return {"error": lines[-1][:160]}
    return {"rows": [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]}


def summarize(rows: list[dict], completions: int, row_tokens: int, flops: float) -> dict:
    timed = rows[1:] or rows
    mean = lambda key: sum(r[key] for r in timed) / len(timed)  # noqa: E731
    learner = mean("timing_s/learner")
    return {
        "seq_s": completions / mean("perf/step_s"),
        "weights": rows[-1]["mem/weights_bytes"] / GIB, "load_peak": rows[-1]["mem/load_peak_bytes"] / GIB,
        "peak": max(r["mem/peak_bytes"] for r in rows) / GIB, "rollout_mem": rows[-1]["mem/rollout_bytes"] / GIB,
        "rollout_peak": max(r["mem/rollout_peak_bytes"] for r in rows) / GIB,
        "learner_peak": max(r["mem/learner_peak_bytes"] for r in rows) / GIB,
        "step": mean("perf/step_s"), "rollout": mean("timing_s/rollout"), "reference": mean("timing_s/reference"),
        "learner": learner, "optimizer": mean("timing_s/optimizer"), "tok_s": mean("perf/rollout_tok_s"),
        "learner_tok_s": row_tokens / learner, "learner_tflops": flops / learner / 1e12,
        "warmup": rows[0]["perf/step_s"],
    }


def table(results: dict, shapes: list[str], strategies: list[str], learners: list[str]) -> str:
    head = ("| shape | strategy | learner | weights GiB | load peak GiB | rollout peak GiB | learner peak GiB | peak / fp "
            "| step s | step / fp | rollout s | reference s | learner s | optimizer s | learner tok/s | learner TFLOPS (% peak) "
            "| rollout tok/s | tok/s / fp | seq/s | step 0 s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for shape in shapes:
        for learner in learners:
            base = results.get((shape, "full_precision", learner), {})
            for strategy in strategies:
                r = results.get((shape, strategy, learner))
                if r is None:
                    continue
                if "error" in r:
                    lines.append(f"| {shape} | {strategy} | {learner} | failed: {r['error']} |")
                    continue

                def ratio(key):
                    return f"{r[key] / base[key]:.2f}x" if "step" in base else "-"

                lines.append(
                    f"| {shape} | {strategy} | {learner} | {r['weights']:.1f} | {r['load_peak']:.1f} | {r['rollout_peak']:.1f} "
                    f"| {r['learner_peak']:.1f} | {ratio('peak')} "
                    f"| {r['step']:.2f} | {ratio('step')} | {r['rollout']:.2f} | {r['reference']:.2f} | {r['learner']:.2f} "
                    f"| {r['optimizer']:.3f} | {r['learner_tok_s']:.0f} | {r['learner_tflops']:.0f} "
                    f"({100 * r['learner_tflops'] / PEAK_TFLOPS:.0f} %) | {r['tok_s']:.0f} | {ratio('tok_s')} "
                    f"| {r['seq_s']:.2f} | {r['warmup']:.1f} |"
                )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="7b", help="comma-separated: 7b, 14b, 32b")
    ap.add_argument("--strategies", default="full_precision,nvfp4_lora,nf4_dq")
    ap.add_argument("--learners", default="packed", help="comma-separated: packed (train.padding_free), padded")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="paper")
    ap.add_argument("--steps", type=int, default=3, help="RL steps per run (step 0 is warm-up)")
    ap.add_argument("--micro", type=int, default=4, help="the padded learner's train.micro_batch_size: completions per backward")
    ap.add_argument("--nproc", type=int, default=1, help="processes (GPUs) of one data-parallel run, through torchrun")
    ap.add_argument("--out", default="", help="where runs and results.json go (default: a temporary folder)")
    args = ap.parse_args()
    shapes, strategies, learners = args.shapes.split(","), args.strategies.split(","), args.learners.split(",")
    workload = dict(WORKLOADS[args.workload])
    rows = workload["prompts"] * workload["group"]
    if args.workload == "real":
        workload["lengths"] = real_lengths(rows, workload["new"])
    completion_tokens = sum(workload.get("lengths") or [workload["new"]] * rows)
    row_tokens = rows * workload["prompt"] + completion_tokens
    out = Path(args.out or tempfile.mkdtemp(prefix="qerl_step_"))
    out.mkdir(parents=True, exist_ok=True)
    data = out / f"prompts_{workload['prompt']}.jsonl"
    task_file(data, workload["prompt"])
    results = {}
    for shape in shapes:
        flops = model_flops(shape, row_tokens, completion_tokens)
        for learner in learners:
            for strategy in strategies:
                got = run_one(shape, strategy, learner, workload, args.steps, args.micro, data, out, args.nproc)
                key = (shape, strategy, learner)
                results[key] = got if "error" in got else summarize(got["rows"], rows, row_tokens, flops)
                print(json.dumps({"shape": shape, "strategy": strategy, "learner": learner, **results[key]}), flush=True)
    (out / "results.json").write_text(json.dumps([{"shape": s, "strategy": t, "learner": lr, **r}
                                                  for (s, t, lr), r in results.items()], indent=1))
    w = workload
    lengths = f"completion lengths {min(w['lengths'])}-{max(w['lengths'])} (mean {completion_tokens / rows:.0f})" \
        if w.get("lengths") else f"{w['new']} new"
    print(f"\nworkload {args.workload}: {rows} completions x ({w['prompt']} prompt + {lengths}) tokens = {row_tokens} "
          f"row tokens, LoRA r32 on 7 projections, gradient checkpointing {w['checkpointing']}, packed micro-batches of "
          f"{w['micro_tokens']} tokens, padded micro-batches of {args.micro} rows, {args.steps} steps (step 0 left "
          f"out), {args.nproc} process(es)\n")
    print(table(results, shapes, strategies, learners))
    label = (args.workload, args.shapes, args.strategies, args.learners) + ((f"nproc{args.nproc}",) if args.nproc > 1 else ())
    record.write("step", [{"shape": s, "strategy": t, "learner": lr, **r} for (s, t, lr), r in results.items()],
                 {"workload": args.workload, **{k: v for k, v in workload.items() if k != "lengths"},
                  "steps": args.steps, "nproc": args.nproc}, workload=label)


if __name__ == "__main__":
    main()
