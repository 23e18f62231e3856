"""The whole RL step at 7B-32B shapes: weights, peak memory and step time per strategy, side by side.

    python3 bench/step.py                                   # 7B, the paper's workload, 3 strategies
    python3 bench/step.py --shapes 7b,14b --workload wide   # 64 sequences x 512 new tokens
    python3 bench/step.py --shapes 32b --strategies nvfp4_lora,full_precision
    python3 bench/step.py --workload wide --strategies nvfp4_lora --nproc 2   # one run on 2 GPUs (torchrun)

Each (shape, strategy) is its own process, `python -m qerl_exp` with the shape preset
(`model=qwen2.5-<shape>-shape`: Qwen2.5's decoder, vocabulary and untied lm_head, random weights),
the strategy preset, LoRA r32 (alpha 32) on all seven projections, and the same learner settings
for every strategy (`--micro`, gradient checkpointing on). Completions are forced to the full
length (`rollout.ignore_eos=true`); prompts are `--prompt` tokens (a generated task file whose
questions are that many characters of the character tokenizer). Workloads: `paper` = Table 3's
speed test, 8 completions (1 prompt x group 8), prompt 256, completion 2048; `wide` = 64
completions (8 x 8), prompt 256, completion 512.

Step 0 (Triton compilation, CUDA-graph capture) is printed as warm-up and left out; the table shows
the mean of the later steps: the rollout, the reference forward (base without LoRA, for `kl`), the
learner's forward + backward passes, the optimizer; memory is `mem/weights_bytes` (the policy's
parameters and buffers, quantized layers with their scales), `mem/load_peak_bytes` (while the
model was built) and CUDA's max allocated in the rollout and in the learner phases over all steps
(`mem/rollout_peak_bytes`, `mem/learner_peak_bytes`); "peak / fp" is the larger of the two over
full_precision's at the same shape, as are the other ratios. `--nproc N` runs each one under
`torchrun --standalone --nproc-per-node N` (data parallel, `qerl_exp/distributed.py`): the same
global batch split over N GPUs; times are the slowest rank's, memory the largest rank's. Compare
`seq/s` (completions per second of the whole step) with a `--nproc 1` run of the same workload.
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

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {"paper": dict(prompts=1, group=8, prompt=256, new=2048), "wide": dict(prompts=8, group=8, prompt=256, new=512)}
GIB = 2**30


def task_file(path: Path, prompt_tokens: int, n: int = 64) -> None:
    """GSM8K-format problems whose questions are `prompt_tokens - 1` characters (BOS makes the rest)."""
    rows = []
    for i in range(n):
        stem = f"Problem {i}: a farmer has {i + 3} rows of {i + 5} plants. How many plants are there? "
        question = (stem * (prompt_tokens // len(stem) + 1))[: prompt_tokens - 1]
        rows.append(json.dumps({"question": question, "answer": f"{(i + 3) * (i + 5)}\n#### {(i + 3) * (i + 5)}"}))
    path.write_text("\n".join(rows) + "\n")


def run_one(shape: str, strategy: str, workload: dict, steps: int, micro: int, data: Path, out: Path,
            nproc: int = 1) -> dict:
    """Run one (shape, strategy) in its own process (`nproc` > 1: torchrun's processes); return its
    per-step metrics, or the error."""
    run_dir = out / f"{shape}_{strategy}"
    shutil.rmtree(run_dir, ignore_errors=True)  # the bench owns its folder: a rerun measures anew
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    args = [
        sys.executable, *launcher, "-m", "qerl_exp", f"model=qwen2.5-{shape}-shape", f"strategy={strategy}", "lora=r32",
        "task=gsm8k", f"task.path={data}", f"train.steps={steps}", f"train.prompts_per_step={workload['prompts']}",
        f"algo.group_size={workload['group']}", f"algo.max_new_tokens={workload['new']}", "rollout.ignore_eos=true",
        f"train.micro_batch_size={micro}", "train.gradient_checkpointing=true", "checkpoint.every=0",
        "tracker=disabled", "tracker.completions_every=0", f"run_dir={run_dir}",
    ]
    print(f"--- {shape} {strategy}: {' '.join(args[3 + len(launcher):])}", flush=True)
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
    metrics = run_dir / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.exists():
        lines = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()
        return {"error": lines[-1][:160]}
    return {"rows": [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]}


def summarize(rows: list[dict], completions: int) -> dict:
    timed = rows[1:] or rows
    mean = lambda key: sum(r[key] for r in timed) / len(timed)  # noqa: E731
    return {
        "seq_s": completions / mean("perf/step_s"),
        "weights": rows[-1]["mem/weights_bytes"] / GIB, "load_peak": rows[-1]["mem/load_peak_bytes"] / GIB,
        "peak": max(r["mem/peak_bytes"] for r in rows) / GIB, "rollout_mem": rows[-1]["mem/rollout_bytes"] / GIB,
        "rollout_peak": max(r["mem/rollout_peak_bytes"] for r in rows) / GIB,
        "learner_peak": max(r["mem/learner_peak_bytes"] for r in rows) / GIB,
        "step": mean("perf/step_s"), "rollout": mean("timing_s/rollout"), "reference": mean("timing_s/reference"),
        "learner": mean("timing_s/learner"), "optimizer": mean("timing_s/optimizer"), "tok_s": mean("perf/rollout_tok_s"),
        "warmup": rows[0]["perf/step_s"],
    }


def table(results: dict, shapes: list[str], strategies: list[str]) -> str:
    head = ("| shape | strategy | weights GiB | load peak GiB | rollout peak GiB | learner peak GiB | peak / fp "
            "| step s | step / fp | rollout s "
            "| reference s | learner s | optimizer s | rollout tok/s | tok/s / fp | seq/s | step 0 s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for shape in shapes:
        base = results.get((shape, "full_precision"), {})
        for strategy in strategies:
            r = results.get((shape, strategy))
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {shape} | {strategy} | failed: {r['error']} |")
                continue

            def ratio(key):
                return f"{r[key] / base[key]:.2f}x" if "step" in base else "-"

            lines.append(
                f"| {shape} | {strategy} | {r['weights']:.1f} | {r['load_peak']:.1f} | {r['rollout_peak']:.1f} "
                f"| {r['learner_peak']:.1f} | {ratio('peak')} "
                f"| {r['step']:.2f} | {ratio('step')} | {r['rollout']:.2f} | {r['reference']:.2f} | {r['learner']:.2f} "
                f"| {r['optimizer']:.3f} | {r['tok_s']:.0f} | {ratio('tok_s')} | {r['seq_s']:.2f} | {r['warmup']:.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="7b", help="comma-separated: 7b, 14b, 32b")
    ap.add_argument("--strategies", default="full_precision,nvfp4_lora,nf4_dq")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="paper")
    ap.add_argument("--steps", type=int, default=3, help="RL steps per run (step 0 is warm-up)")
    ap.add_argument("--micro", type=int, default=1, help="train.micro_batch_size: completions per backward")
    ap.add_argument("--nproc", type=int, default=1, help="processes (GPUs) of one data-parallel run, through torchrun")
    ap.add_argument("--out", default="", help="where runs and results.json go (default: a temporary folder)")
    args = ap.parse_args()
    shapes, strategies = args.shapes.split(","), args.strategies.split(",")
    workload = WORKLOADS[args.workload]
    out = Path(args.out or tempfile.mkdtemp(prefix="qerl_step_"))
    out.mkdir(parents=True, exist_ok=True)
    data = out / f"prompts_{workload['prompt']}.jsonl"
    task_file(data, workload["prompt"])
    results = {}
    for shape in shapes:
        for strategy in strategies:
            got = run_one(shape, strategy, workload, args.steps, args.micro, data, out, args.nproc)
            results[(shape, strategy)] = got if "error" in got else summarize(got["rows"], workload["prompts"] * workload["group"])
            print(json.dumps({"shape": shape, "strategy": strategy, **results[(shape, strategy)]}), flush=True)
    (out / "results.json").write_text(json.dumps([{"shape": s, "strategy": t, **r} for (s, t), r in results.items()], indent=1))
    w = workload
    print(f"\nworkload {args.workload}: {w['prompts'] * w['group']} completions x ({w['prompt']} prompt + {w['new']} new) "
          f"tokens, LoRA r32 on 7 projections, micro-batch {args.micro}, gradient checkpointing, {args.steps} steps "
          f"(step 0 left out), {args.nproc} process(es)\n")
    print(table(results, shapes, strategies))


if __name__ == "__main__":
    main()
