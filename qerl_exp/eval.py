"""Held-out evaluation with the trained LoRA applied: greedy pass@1 and sampled pass@k.

Two ways in:
- `evaluate(policy, tokenizer, task, k=...)` scores a live policy on the task's held-out problems
  and returns `eval/...` metrics; the run loop calls it every `eval.every` steps.
- `python -m qerl_exp.eval run_dir=RUN [k=8] [adapter=false] ...` rebuilds a finished run's
  policy from `RUN/config.json` (the same base, for the embedded model its cached warm-up, and the
  same quantization), loads the trained adapter from `RUN/final/adapter`, scores the run's
  held-out split and writes `RUN/eval.json` (and a W&B run of job type `eval`); a later
  evaluation of the same run writes `RUN/eval-2.json`, and so on: none replaces another.

The paper's released evaluation compared only the first character of the answer and never applied
the trained LoRA (DESIGN.md 2.3). Here an answer is judged by the task's own correctness reward
(`answers_equal`: whole answers, exactly), and `load_adapter` refuses an adapter file that does not
cover every LoRA weight of the rebuilt policy.

Metrics (all over the held-out problems):

| name                  | meaning                                                                   |
|-----------------------|---------------------------------------------------------------------------|
| `eval/pass@1`         | fraction answered correctly by the greedy completion                      |
| `eval/pass@{k}`       | unbiased pass@k (Chen et al. 2021) from `n >= k` samples per problem      |
| `eval/mean@{n}`       | fraction of all sampled completions that are correct (sampled pass@1)    |
| `eval/format`         | fraction of greedy completions in the `<think>..</think><answer>..</answer>` format |
| `eval/reward`         | mean total reward (all of the task's reward functions) of greedy completions |
| `eval/clipped_ratio`  | fraction of greedy completions cut at `max_new_tokens` without EOS        |
| `eval/solution_logp`  | mean per-token log-prob of each problem's reference completion (teacher-forced) |
| `eval/problems`       | number of problems scored                                                  |
| `eval/seconds`        | wall time of the evaluation                                               |
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
from omegaconf import OmegaConf

from qerl_exp import logs, progress
from qerl_exp.checkpoint import load_adapter
from qerl_exp import metrics as M
from qerl_exp.cli import UsageError, fail
from qerl_exp.config import Config, EvalConfig, as_dict, to_config
from qerl_exp.model import build_models, resolve_device
from qerl_exp.rollout import complete, encode_prompts
from qerl_exp.rundir import write_atomic
from qerl_exp.tasks import SYSTEM_PROMPT, Problem, build_task, reference_completion
from qerl_exp.tracking import run_tags


def _device(policy) -> torch.device:
    return next(policy.parameters()).device


@torch.no_grad()
def solution_logprobs(policy, tokenizer, problems: list[Problem], *, system_prompt: str = SYSTEM_PROMPT,
                      batch_size: int = 64) -> torch.Tensor:
    """Mean per-token log-prob `[N]` of each problem's reference completion under `policy`.

    The reference completion is the warm-up's target, `<think>{solution}</think><answer>{answer}</answer>`,
    teacher-forced after the rendered prompt. A smooth, sampling-free score: any change of the
    adapter moves it, which makes it the sharpest check that an adapter is applied.

    Args:
        policy: the model to score (eval mode is the caller's business).
        tokenizer: the policy's tokenizer.
        problems: the problems to score.
        system_prompt: passed to `tokenizer.render_prompt`.
        batch_size: problems per forward pass.

    Returns:
        A float32 CPU tensor, one value per problem.
    """
    out = []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start:start + batch_size]
        ids, mask = encode_prompts([tokenizer.render_prompt(p.question, system_prompt) for p in chunk], tokenizer, _device(policy))
        targets = [tokenizer.encode(reference_completion(p)) for p in chunk]
        width = max(map(len, targets))
        tgt = torch.full((len(chunk), width), tokenizer.pad_id, dtype=torch.long, device=ids.device)
        tmask = torch.zeros_like(tgt)
        for i, t in enumerate(targets):
            tgt[i, : len(t)] = torch.tensor(t)
            tmask[i, : len(t)] = 1
        full_mask = torch.cat([mask, tmask], dim=1)
        # Prompts are left-padded: positions count real tokens only, as in the learner's forward.
        position_ids = (full_mask.cumsum(dim=1) - 1).clamp(min=0)
        logits = policy(input_ids=torch.cat([ids, tgt], dim=1), attention_mask=full_mask, position_ids=position_ids).logits
        logits = logits[:, ids.shape[1] - 1 : ids.shape[1] - 1 + width].float()  # [B, T] predicts the targets
        logp = torch.log_softmax(logits, dim=-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
        out.append(((logp * tmask).sum(dim=1) / tmask.sum(dim=1).clamp(min=1)).cpu())
    return torch.cat(out)


def _score(policy, tokenizer, task, *, problems: list[Problem] | None, k: int, n: int, temperature: float,
           top_p: float, max_new_tokens: int, batch_size: int, seed: int, system_prompt: str,
           on_batch=None) -> tuple[dict[str, float], list[dict]]:
    if k < 0:
        raise ValueError(f"k={k}: use k >= 2 for sampled pass@k, or k=0 or 1 for the greedy pass@1 alone")
    k = 0 if k == 1 else k  # pass@1 is the greedy one, always reported
    n = n or k
    if k and n < k:
        raise ValueError(f"n={n} samples per problem cannot estimate pass@{k}; use n >= k")
    problems = list(task.eval_problems() if problems is None else problems)
    prompts = [tokenizer.render_prompt(p.question, system_prompt) for p in problems]
    start, was_training = time.perf_counter(), policy.training
    device = _device(policy)
    policy.eval()
    try:
        # A private RNG stream: evaluating mid-run must not change the run's later random draws,
        # and the same seed gives the same samples.
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            greedy, terminated = complete(policy, tokenizer, prompts, samples=1, temperature=0.0, top_p=1.0,
                                          max_new_tokens=max_new_tokens, batch_size=batch_size, on_batch=on_batch)
            sampled = complete(policy, tokenizer, prompts, samples=n, temperature=temperature, top_p=top_p,
                               max_new_tokens=max_new_tokens, batch_size=batch_size, on_batch=on_batch)[0] if k else []
            logp = solution_logprobs(policy, tokenizer, problems, system_prompt=system_prompt, batch_size=batch_size)
    finally:
        policy.train(was_training)

    correct = task.rewards["correct"]
    is_correct = [correct(t, p) > 0 for t, p in zip(greedy, problems)]
    in_format = [task.rewards["format"](t, p) > 0 for t, p in zip(greedy, problems)] if "format" in task.rewards else []
    rewards = [sum(fn(t, p) for fn in task.rewards.values()) for t, p in zip(greedy, problems)]
    rows = [{"question": p.question, "answer": p.answer, "greedy": t, "correct": ok, "solution_logp": float(lp)}
            for p, t, ok, lp in zip(problems, greedy, is_correct, logp)]
    counts = [sum(correct(t, p) > 0 for t in sampled[i * n:(i + 1) * n]) for i, p in enumerate(problems)] if k else []
    for row, c in zip(rows, counts):
        row["samples_correct"] = f"{c}/{n}"
    metrics = M.eval_metrics(is_correct, in_format, rewards, terminated, logp, counts, n, k, time.perf_counter() - start)
    return metrics, rows


def evaluate(policy, tokenizer, task, *, k: int = 8, n: int = 0, temperature: float = 1.0, top_p: float = 1.0,
             max_new_tokens: int = 32, batch_size: int = 64, seed: int = 0, system_prompt: str = SYSTEM_PROMPT,
             problems: list[Problem] | None = None) -> dict[str, float]:
    """Score `policy` on held-out problems: greedy pass@1, and pass@k from sampling.

    Call it with the policy as it samples in deployment: adapters enabled and AQN off (outside
    `aqn.applied(...)`). The policy's train/eval mode is restored afterwards, and the global RNG
    state is left untouched (sampling uses its own stream, seeded by `seed`).

    Args:
        policy: the (peft-wrapped) model; its adapters are used as they are.
        tokenizer: the policy's tokenizer (`CharTokenizer` or `HFTokenizer`).
        task: the task; its `eval_problems()` are scored and its `correct` reward judges answers.
        k: the k of the sampled pass@k; 0 or 1 skips sampling (greedy metrics only).
        n: samples per problem for the pass@k estimate; 0 means `k`.
        temperature: sampling temperature of the pass@k samples (greedy ignores it).
        top_p: nucleus threshold of the pass@k samples.
        max_new_tokens: completion length cap.
        batch_size: sequences per `generate` call.
        seed: seed of the sampling stream.
        system_prompt: the system prompt for chat-template tokenizers.
        problems: score these instead of `task.eval_problems()`.

    Returns:
        The `eval/...` metrics listed in this module's docstring.

    Example:
        >>> metrics = evaluate(models.policy, models.tokenizer, task, k=8)  # doctest: +SKIP
        >>> metrics["eval/pass@1"], metrics["eval/pass@8"]  # doctest: +SKIP
    """
    return _score(policy, tokenizer, task, problems=problems, k=k, n=n, temperature=temperature, top_p=top_p,
                  max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed, system_prompt=system_prompt)[0]


# ---------------------------------------------------------------------------------------------
# A finished run: rebuild its policy, load its adapter, score, write eval.json.


def run_config(run_dir: str | Path):
    """The validated `Config` a run was started with, read from `run_dir/config.json`."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run_dir must be a run directory made by `python -m qerl_exp`")
    saved = json.loads(path.read_text())
    saved.pop("choices", None)
    return to_config(OmegaConf.merge(OmegaConf.structured(Config), saved))


def load_run(run_dir: str | Path, *, device: str = "auto", adapter: bool = True):
    """Rebuild a run's policy: its base model and quantization, and (by default) its trained adapter.

    Args:
        run_dir: the run directory (`config.json`, `final/adapter`).
        device: `auto`, `cpu` or `cuda`.
        adapter: load `final/adapter`; False leaves the freshly initialized LoRA, which is the
            identity (peft initializes B to zero), so the policy is the quantized base.

    Returns:
        `(cfg, task, models)`; `models.policy` is in eval mode.
    """
    cfg = run_config(run_dir)
    # Evaluation needs only the policy: no full-precision reference, no separate sampler copy.
    cfg = replace(cfg, monitor=replace(cfg.monitor, every=0), rollout=replace(cfg.rollout, quant="none"))
    task = build_task(cfg.task)
    models = build_models(cfg, task, resolve_device(device))
    if adapter:
        load_adapter(models.policy, Path(run_dir) / "final" / "adapter")
    models.policy.eval()
    return cfg, task, models


@dataclass
class EvalArgs:
    """`python -m qerl_exp.eval key=value ...`: what to evaluate and how.

    Args:
        run_dir: the finished run's directory (holds `config.json` and `final/adapter`).
        k: the k of the sampled pass@k; 0 or 1 skips sampling (pass@1 is the greedy one).
        n: samples per problem for the pass@k estimate (>= k); 0 means k.
        adapter: load the trained LoRA; false scores the quantized base alone (the baseline).
        limit: score only the first `limit` held-out problems; 0 scores all. The split itself is
            always the run's (`task.eval_size` from its config), so training problems never leak in.
        max_new_tokens: completion length cap; 0 uses the run's `algo.max_new_tokens`.
        temperature: temperature of the pass@k samples; 0 uses the run's `algo.temperature`.
        top_p: nucleus threshold of the pass@k samples; 0 uses the run's `algo.top_p`.
        batch_size: sequences per generate call.
        device: `auto` (CUDA when present), `cpu` or `cuda`.
        seed: seed of the sampling stream.
        tracker: W&B mode for the results: `run` follows the run's `tracker.mode`; or `offline`,
            `online`, `disabled`.
        out: output file name inside run_dir, refused when it exists; empty means the first free
            one of `eval.json`, `eval-2.json`, ... (`eval_base*.json` when adapter=false).
        verbose: show the third-party notices hidden by default (`qerl_exp.logs`).
    """

    # The settings shared with in-training evaluation take its defaults. Their checks below stay
    # separate from EvalConfig's: the messages name the command-line keys, not `eval.*`.
    run_dir: str = ""
    k: int = EvalConfig.k
    n: int = EvalConfig.n
    adapter: bool = True
    limit: int = 0
    max_new_tokens: int = EvalConfig.max_new_tokens
    temperature: float = 0.0
    top_p: float = 0.0
    batch_size: int = EvalConfig.batch_size
    device: str = "auto"
    seed: int = 0
    tracker: str = "run"
    out: str = ""
    verbose: bool = False

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise UsageError(message)

        check(bool(self.run_dir), "run_dir=<a run directory> is required")
        check(self.k >= 0, f"k={self.k}: use k >= 2 for sampled pass@k, or k=0 or 1 for the greedy pass@1 alone")
        check(self.n == 0 or self.n >= self.k, f"n={self.n} must be >= k={self.k} (or 0 for n=k)")
        for name in ("limit", "max_new_tokens", "temperature", "top_p"):
            check(getattr(self, name) >= 0, f"{name} must be >= 0")
        check(self.top_p <= 1, "top_p must be <= 1")
        check(self.batch_size >= 1, "batch_size must be >= 1")
        check(self.device in ("auto", "cpu", "cuda"), f"device={self.device!r} is not valid; choose one of: auto, cpu, cuda")
        check(self.tracker in ("run", "offline", "online", "disabled"),
              f"tracker={self.tracker!r} is not valid; choose one of: run, offline, online, disabled")


def parse_args(argv: list[str]) -> EvalArgs:
    """`key=value` arguments into `EvalArgs`; raises `UsageError` naming the bad argument."""
    types = {f.name: f.type for f in fields(EvalArgs)}
    values = {}
    for arg in argv:
        key, sep, raw = arg.partition("=")
        if not sep:
            raise UsageError(f"argument {arg!r} is not key=value; keys: {', '.join(types)}")
        if key not in types:
            raise UsageError(f"unknown argument {key!r}; keys: {', '.join(types)}")
        kind = types[key]
        try:
            if kind == "bool":
                if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                values[key] = raw.lower() in ("true", "1", "yes")
            else:
                values[key] = {"int": int, "float": float, "str": str}[kind](raw)
        except ValueError:
            raise UsageError(f"bad value for {key!r}: {raw!r} is not a {kind}") from None
    return EvalArgs(**values)


def _new_output(run_dir: Path, out: str, adapter: bool) -> Path:
    """Create the empty output file of this evaluation (never one another evaluation wrote)."""
    stem = "eval" if adapter else "eval_base"
    names = [out] if out else (f"{stem}.json" if i == 1 else f"{stem}-{i}.json" for i in itertools.count(1))
    for name in names:
        try:
            (run_dir / name).open("x").close()
            return run_dir / name
        except FileExistsError:
            continue
    raise ValueError(f"out={out}: {run_dir / out} holds another evaluation's results; choose another name")


def evaluate_run(args: EvalArgs) -> dict[str, float]:
    """Evaluate a finished run and write its results to a new file in `args.run_dir`.

    Args:
        args: the run directory and the evaluation settings (`EvalArgs`); `args.out` is set to
            the name of the file written.

    Returns:
        The `eval/...` metrics, also written to the output file together with the settings and
        one row per problem (question, reference, greedy completion, verdicts).

    Example:
        >>> evaluate_run(EvalArgs(run_dir="runs/my-run", k=8))["eval/pass@8"]  # doctest: +SKIP
    """
    run_dir = Path(args.run_dir)
    if args.out and (run_dir / args.out).exists():
        raise ValueError(f"out={args.out}: {run_dir / args.out} holds another evaluation's results; choose another name")
    cfg, task, models = load_run(run_dir, device=args.device, adapter=args.adapter)
    algo = cfg.algo
    problems = task.eval_problems()[: args.limit or None]
    bar = progress.Progress(len(problems) * (1 + ((args.n or args.k) if args.k else 0)), "eval", unit="seq", fields=())
    metrics, rows = _score(
        models.policy, models.tokenizer, task, problems=problems, k=args.k, n=args.n,
        temperature=args.temperature or algo.temperature, top_p=args.top_p or algo.top_p,
        max_new_tokens=args.max_new_tokens or algo.max_new_tokens, batch_size=args.batch_size,
        seed=args.seed, system_prompt=cfg.task.system_prompt, on_batch=bar.advance,
    )
    adapter = str(run_dir / "final" / "adapter") if args.adapter else None
    record = {"run_dir": str(run_dir), "adapter": adapter, "base": models.base_info, "task": cfg.task.name,
              "args": asdict(args), "metrics": metrics, "problems": rows}
    out = _new_output(run_dir, args.out, args.adapter)
    write_atomic(out, json.dumps(record, indent=2))
    args.out = out.name
    mode = cfg.tracker.mode if args.tracker == "run" else args.tracker
    if mode != "disabled":
        _log_wandb(run_dir, cfg, metrics, mode, adapter)
    return metrics


def _log_wandb(run_dir: Path, cfg, metrics: dict[str, float], mode: str, adapter: str | None) -> None:
    """A W&B run of job type `eval` beside the training run (same project and task group)."""
    import wandb  # only when the results go to W&B: importing it takes seconds

    os.environ.setdefault("WANDB_SILENT", "true")
    saved = json.loads((run_dir / "config.json").read_text())
    run = wandb.init(
        dir=str(run_dir), mode=mode, project=cfg.tracker.project, entity=cfg.tracker.entity or None,
        name=f"{run_dir.name}-eval", group=cfg.task.name, job_type="eval",
        tags=run_tags(saved.get("choices", {})) + (["adapter:none"] if adapter is None else []),
        config={**as_dict(cfg), "eval": {"run_dir": str(run_dir), "adapter": adapter}},
        settings=wandb.Settings(console="off", x_disable_stats=True),
    )
    run.log({"step": cfg.train.steps, **metrics})
    run.summary.update(metrics)
    run.finish()


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m qerl_exp.eval`."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(f"usage: python -m qerl_exp.eval run_dir=RUN [key=value ...]\n\n{EvalArgs.__doc__}")
        return
    try:
        args = parse_args(argv)
    except UsageError as e:
        fail(str(e))
    try:
        with logs.quiet(args.verbose):
            metrics = evaluate_run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        fail(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}", code=1)
    shown = "  ".join(f"{k}={v:.4g}" for k, v in metrics.items() if not k.endswith("seconds"))
    print(f"{shown}\nwritten: {Path(args.run_dir) / args.out}")


if __name__ == "__main__":
    main()
