"""TRL's GRPOTrainer beside the harness on the same model, task and settings: step time, peak memory
and the reward curve, each in its own process.

    pip install -e '.[peer]'
    python -m bench.peer --steps 10                                   # model=smollm2-135m task=wordprob
    python -m bench.peer --steps 10 model.package='' model.gguf_file=/path/SmolLM2-135M-Instruct.Q4_1.gguf

Both take their settings from one harness config (`model=smollm2-135m task=wordprob` and the
overrides given): the model and tokenizer as the harness loads them (bf16), LoRA with the config's
rank, alpha and targets, `train.prompts_per_step` prompts x `algo.group_size` completions a step
drawn from the task with the run's seed, rendered through the chat template with the task's system
prompt, `algo.max_new_tokens`, temperature, top-p, top-k, min-p, the clip range, the loss (TRL's names:
`loss_type`, `importance_sampling_level`, `scale_rewards`, `mask_truncated_completions`), beta 0, the task's reward functions,
AdamW at `train.lr` with the same warm-up and cosine decay, grad clip. TRL samples with HF
`generate` and scores with its own learner; the harness runs as `python -m qerl_exp` (its CUDA
engine and padding-free learner), with the full-precision monitor and the `kl` passes off, as TRL
has neither at beta 0. Step time is the mean over the steps after the first (warm-up); peak memory
is CUDA's max allocated.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import record

ROOT = Path(__file__).resolve().parent.parent
BASE = ["model=smollm2-135m", "task=wordprob"]
GIB = 2**30


def run_harness(overrides: list[str], steps: int, out: Path) -> dict:
    run_dir = out / "harness"
    args = [sys.executable, "-m", "qerl_exp", *BASE, *overrides, f"train.steps={steps}", "monitor.every=0",
            "monitor.kl_every=0", "eval.every=0", "checkpoint.every=0", "tracker=disabled", f"run_dir={run_dir}"]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip() or "no output").splitlines()[-1][:200]}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"step_s": [r["perf/step_s"] for r in rows], "reward": [r["reward"] for r in rows],
            "peak": max(r["mem/peak_bytes"] for r in rows) / GIB}


def run_trl(overrides: list[str], steps: int, out: Path) -> dict:
    """TRL's GRPOTrainer on the harness config's model, task and settings (this process)."""
    import numpy as np
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from qerl_exp.config.compose import compose
    from qerl_exp.models.pretrained import load_pretrained
    from qerl_exp.tasks import build_task

    cfg = compose([*BASE, *overrides])[0]
    task = build_task(cfg.task)
    model, tok, _ = load_pretrained(cfg.model, torch.bfloat16, "cuda")
    tok.tok.pad_token_id = tok.pad_id
    rng = np.random.default_rng(cfg.seed)
    problems = [p for _ in range(steps) for p in task.sample(cfg.train.prompts_per_step, rng)]
    by_prompt = {tok.render_prompt(p.prompt, cfg.task.system_prompt): p for p in problems}
    kept = list(by_prompt.values())
    # the task's rows as TRL's dataset columns: the (rendered) prompt, `answer` and the others
    columns = {k: [p.columns.get(k) for p in kept] for k in dict.fromkeys(k for p in kept for k in p.columns)}
    data = Dataset.from_dict({"prompt": list(by_prompt), "answer": [p.answer for p in kept], **columns})

    def reward_fn(func):  # the run's own function, in TRL's signature already; TRL logs it by __name__
        def score(prompts, completions, **kwargs):
            return func.fn(prompts=prompts, completions=completions, **kwargs)

        score.__name__ = func.name
        return score

    times, rewards = [], []

    class Record(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])

    a = cfg.algo
    batch = cfg.train.prompts_per_step * a.group_size
    config = GRPOConfig(
        output_dir=str(out / "trl"), max_steps=steps, per_device_train_batch_size=batch, generation_batch_size=batch,
        num_generations=a.group_size, max_completion_length=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
        top_k=a.top_k or None, min_p=a.min_p or None, beta=0.0, epsilon=a.eps_low, epsilon_high=a.eps_high,
        loss_type=a.loss_type, importance_sampling_level=a.importance_sampling_level, scale_rewards=a.scale_rewards,
        mask_truncated_completions=a.mask_truncated_completions,
        learning_rate=cfg.train.lr, lr_scheduler_type="cosine", warmup_steps=cfg.train.warmup_ratio,
        max_grad_norm=cfg.train.grad_clip, weight_decay=cfg.train.weight_decay, bf16=True, logging_steps=1,
        save_strategy="no", report_to="none", seed=cfg.seed, shuffle_dataset=False,
        reward_weights=[f.weight for f in task.rewards.funcs],
    )
    lora = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                      target_modules=list(cfg.lora.targets), task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=[reward_fn(f) for f in task.rewards.funcs], args=config,
                          train_dataset=data, processing_class=tok.tok, peft_config=lora, callbacks=[Record()])
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    return {"step_s": times, "reward": rewards, "peak": torch.cuda.max_memory_allocated() / GIB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default="")
    ap.add_argument("--trl-only", action="store_true", help=argparse.SUPPRESS)  # the TRL child process
    args, overrides = ap.parse_known_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="qerl_peer_"))
    out.mkdir(parents=True, exist_ok=True)
    if args.trl_only:
        (out / "trl.json").write_text(json.dumps(run_trl(overrides, args.steps, out)))
        return
    results = {"qerl-exp": run_harness(overrides, args.steps, out)}
    proc = subprocess.run([sys.executable, "-m", "bench.peer", "--trl-only", f"--steps={args.steps}", f"--out={out}",
                           *overrides], cwd=ROOT, capture_output=True, text=True)
    results["TRL GRPOTrainer"] = json.loads((out / "trl.json").read_text()) if proc.returncode == 0 else \
        {"error": (proc.stderr.strip() or "no output").splitlines()[-1][:200]}
    (out / "peer.json").write_text(json.dumps(results, indent=1))
    print(f"\n{' '.join(BASE + overrides)}, {args.steps} steps (step 0 left out of the mean)\n")
    print("| tool | step s | peak GiB | reward by step |\n|---|---|---|---|")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | failed: {r['error']} | | |")
            continue
        timed = r["step_s"][1:] or r["step_s"]
        print(f"| {name} | {sum(timed) / len(timed):.2f} | {r['peak']:.2f} | {' '.join(f'{x:.2f}' for x in r['reward'])} |")
    record.write("peer", [{"tool": name, **r} for name, r in results.items()], {"steps": args.steps,
                                                                                "overrides": BASE + overrides})


if __name__ == "__main__":
    main()
