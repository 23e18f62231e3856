"""`python -m qerl_exp.probe [run overrides] quant=bf16,nvfp4,... [sigma=0,1e-2] [limit=32] ...`: the
forward-only entropy probe.

How much does a weight format, and AQN on top of it, change the policy's next-token distribution,
before any training? The probe builds the run's base as full precision (the `bf16` preset:
`model.dtype`, fp32 on the CPU) and samples `samples` completions for each of the first `limit`
prompts of the task's held-out split from it, at the run's temperature (`qerl_exp.rl.rollout`, seeded).
Then every format of `quant` (presets of the quant group, each built by `models.build_models` from
the same base) scores exactly those tokens, teacher-forced (`scoring.completion_logits`, the noise
monitor's scorer), with AQN off and at each `sigma` (one fixed draw per sigma, the same for every
format: `noise.AQN`, absolute or `noise.relative=true` as the run config says). Per token:

| column | definition |
| --- | --- |
| entropy | the format's entropy of softmax(logits / T) on full precision's tokens (`metrics.entropy_from_logits`) |
| same-token entropy gain | the format's entropy minus full precision's, both on full precision's tokens (`qerl_exp.rl.metrics` names the measures; a run's `entropy_gain` is the same on its sampler's tokens, and the on-policy entropy gain compares each sampler on its own rollouts, which the probe does not sample) |
| first-token entropy | the entropy at each completion's first token (`task=fork`: the route token) |
| KL to full precision | KL(full precision \\|\\| format) over the vocabulary (`metrics.kl_full`) |
| top-1 agreement | whether the format's most likely next token is full precision's |

`layers=true` also checks each format's layers, in fp32: its policy, with random LoRA matrices
(B too, so that every adapter acts), against the same model whose targeted linears are plain layers holding
the dequantized weights (`quant.fake=round`), on the first `batch` completions, AQN as in the row:
the largest logit difference, the loss difference and the largest relative error of a LoRA gradient
(the 4-bit layers' forward and backward, and LoRA and AQN on them, against an independent path).

And per prompt, from each format's own greedy reply (`greedy=true`, the default; `eval.grade` with
the run's reward functions, `algo.max_new_tokens` and stop strings, AQN applied as in the row):

| column | definition |
| --- | --- |
| greedy pass@1 | whether the greedy reply is correct (the task's `correct` function) |
| greedy replies ended | whether the greedy reply ended (EOS or a stop string) within `algo.max_new_tokens` |

Token means per prompt (over its completions' tokens), then the mean over prompts with a 95 %
t-interval: the prompts are the replication (`bases=1,2,3` pools the prompts of several embedded
bases). `match=FORMAT` also finds T*, the temperature at
which full precision's first-token (or, with `match_on=all`, token-mean) entropy equals FORMAT's at
the run's temperature, by bisection on [0.5, 2]. `out=FILE` writes every number as JSON.

Example:
    python -m qerl_exp.probe model=smollm2-135m task=wordprob quant=bf16,nvfp4,nf4_dq limit=16
    python -m qerl_exp.probe task=fork quant=bf16,nvfp4 sigma=0,1e-2 limit=128 match=nvfp4
"""

from __future__ import annotations

import json
import math
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from analysis.stats import t_interval
from qerl_exp.cli import parse_command_line
from qerl_exp.config import ConfigError
from qerl_exp.config.compose import compose, group_options
from qerl_exp.decoders.scoring import completion_logits, token_logp
from qerl_exp.eval import grade
from qerl_exp.models import build_models, resolve_device
from qerl_exp.rl.learner import chunks, rows
from qerl_exp.rl.metrics import entropy_from_logits, kl_full
from qerl_exp.rl.noise import AQN
from qerl_exp.rl.rollout import engine_for, make_generator, row_seeds, sample
from qerl_exp.run import logs
from qerl_exp.run.console import UsageError, fail, tolerate_closed_pipes
from qerl_exp.run.files import check_writable, os_error_line
from qerl_exp.run.record import source_commit
from qerl_exp.tasks import build_task
from qerl_exp.tasks.base import HELD_OUT, check_split

REFERENCE = "bf16"  # the quant preset that keeps the base in model.dtype
COLUMNS = {"entropy": "entropy", "gain": "same-token entropy gain", "first": "first-token entropy",
           "kl": "KL to full precision", "top1": "top-1 agreement", "pass1": "greedy pass@1",
           "ended": "greedy replies ended"}


def quant_presets() -> list[str]:
    """The quant presets (`conf/quant/*.yaml`), the full-precision reference first."""
    return sorted(group_options("quant"), key=lambda name: name != REFERENCE)


@dataclass
class ProbeArgs:
    """The probe's own `key=value` arguments (every other one is a run override).

    Args:
        quant: quant presets to score, comma-separated (the full-precision `bf16` is always built:
            it samples the completions and is what the others are compared with).
        sigma: AQN sigmas, comma-separated; 0 is the format without noise.
        limit: prompts, the first of the task's `split`.
        samples: completions sampled per prompt (at least 2: they are drawn as one of the run's groups).
        seed: seed of the sampling and of the noise draws.
        split: the task's evaluation split the prompts come from.
        batch: completions scored per forward pass.
        bases: embedded bases (`model.warmup.seed`) to probe, comma-separated, their prompts pooled
            (empty: the run config's own).
        match: a format of `quant` whose entropy full precision is matched to by temperature (empty: none).
        match_on: `first` (the first completion token's entropy) or `all` (the token mean).
        greedy: also decode each format's greedy reply to every prompt: its pass@1 and whether it
            ended within `algo.max_new_tokens`.
        layers: also check each format's layers against plain linears holding its dequantized weights.
        out: a JSON file for every number (empty: none).
        verbose: show the third-party notices hidden by default.
    """

    quant: list[str] = field(default_factory=lambda: quant_presets())
    sigma: list[float] = field(default_factory=lambda: [0.0])
    limit: int = 32
    samples: int = 4
    seed: int = 0
    split: str = HELD_OUT
    batch: int = 16
    bases: list[int] = field(default_factory=list)
    match: str = ""
    match_on: str = "first"
    greedy: bool = True
    layers: bool = False
    out: str = ""
    verbose: bool = False


def parse(argv: list[str]) -> tuple[ProbeArgs, list[str]]:
    """Split the command line into the probe's arguments and the run's overrides; `UsageError` for a
    bad value of the probe's own."""
    own, overrides = {}, []
    names = ProbeArgs.__dataclass_fields__
    for arg in argv:
        key, sep, raw = arg.partition("=")
        if not sep or key not in names:
            overrides.append(arg)
            continue
        try:
            if key == "quant":
                own[key] = [q for q in raw.split(",") if q]
            elif key == "sigma":
                own[key] = [float(s) for s in raw.split(",") if s]
            elif key == "bases":
                own[key] = [int(b) for b in raw.split(",") if b]
            elif key in ("limit", "samples", "seed", "batch"):
                own[key] = int(raw)
            elif key in ("verbose", "greedy", "layers"):
                own[key] = raw.lower() in ("true", "1", "yes")
            else:
                own[key] = raw
        except ValueError:
            raise UsageError(f"bad value for {key}: {raw!r}") from None
    args = ProbeArgs(**own)
    presets = quant_presets()
    bad = [q for q in args.quant if q not in presets]
    if bad or not args.quant:
        raise UsageError(f"quant={','.join(args.quant)}: {bad[0] if bad else 'empty'} is not a quant preset; choose from {','.join(presets)}")
    if any(not (s >= 0 and math.isfinite(s)) for s in args.sigma):
        raise UsageError("sigma takes finite values >= 0, e.g. sigma=0,1e-2")
    if min(args.limit, args.batch) < 1 or args.samples < 2:
        raise UsageError("limit and batch must be >= 1, samples >= 2")
    if args.match and args.match not in args.quant:
        raise UsageError(f"match={args.match} must be one of quant={','.join(args.quant)}")
    if args.match_on not in ("first", "all"):
        raise UsageError(f"match_on={args.match_on!r} is not valid; choose one of: first, all")
    twice = next((b for b in args.bases if args.bases.count(b) > 1), None)
    if twice is not None:
        raise UsageError(f"bases={','.join(map(str, args.bases))} names base {twice} twice: its prompts would count as "
                         "another base's, and the intervals would be too narrow; name each base once")
    return args, overrides


def check(args: ProbeArgs, overrides: list[str]) -> None:
    """What the probe needs before it builds a model: the run overrides compose, the task has the
    split, and `out` can be written (the table is not lost after the study).

    Raises:
        UsageError: one line saying what to change.
        ConfigError: an override the run's config refuses.
    """
    if args.out:
        out = Path(args.out).expanduser().absolute()
        if out.is_dir():
            raise UsageError(f"out={args.out} is a folder; give the JSON file to write")
        if not out.parent.is_dir():
            raise UsageError(f"out={args.out}: {out.parent} is not a folder; create it or choose another out=")
        try:
            check_writable(out.parent)
        except OSError as e:
            raise UsageError(os_error_line(e, "out") or str(e)) from None
    cfg, _ = compose(overrides)
    try:
        check_split(build_task(cfg.task), args.split)
    except ValueError as e:
        raise UsageError(str(e).splitlines()[0]) from None


def _policy(overrides: list[str], preset: str, task, device):
    """The run's policy with the base stored as `preset`: LoRA at its start (the identity), no
    reference copy or separate sampler."""
    cfg, _ = compose([*overrides, f"quant={preset}", "monitor.every=0", "rollout.quant=none", "noise=none"])
    models = build_models(cfg, task, device)
    models.policy.eval()
    return cfg, models


def _per_prompt(values: torch.Tensor, mask: torch.Tensor, samples: int) -> list[float]:
    """Token means `[B, T]` -> one mean per prompt over its `samples` completions' tokens."""
    groups = values.view(-1, samples, values.shape[-1])
    weights = mask.view(-1, samples, mask.shape[-1]).float()
    return (groups * weights).sum(dim=(1, 2)).div(weights.sum(dim=(1, 2)).clamp(min=1)).tolist()


@torch.no_grad()
def _score(model, batch, reference_logits: list[torch.Tensor], temperature: float, size: int, aqn: AQN | None,
           keep: bool) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Per-token entropy, KL and top-1 agreement `[B, T]` of `model` on the batch's completions
    against the reference's raw logits (`keep`: this model is the reference; its raw logits are
    returned instead), `size` rows at a time."""
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("entropy", "kl", "top1")}
    raw = []
    width = batch.completion_ids.shape[1]
    for i, idx in enumerate(chunks(torch.arange(len(batch.completion_ids)), size)):
        sub = rows(batch, idx, cut=(0, width))
        with aqn.applied() if aqn is not None else nullcontext():
            logits = completion_logits(model, sub, 1.0)
        ref = logits if keep else reference_logits[i]
        if keep:
            raw.append(logits)
        parts["entropy"].append(entropy_from_logits(logits / temperature))
        parts["kl"].append(kl_full(ref / temperature, logits / temperature))
        parts["top1"].append((logits.argmax(-1) == ref.argmax(-1)).float())
    return {k: torch.cat(v) for k, v in parts.items()}, raw


def _greedy(policy, tokenizer, task, problems, cfg, args: ProbeArgs, aqn: AQN | None) -> dict[str, list[float]]:
    """Per prompt: whether the policy's greedy reply is correct, and whether it ended within
    `algo.max_new_tokens` (AQN applied as `aqn` draws it)."""
    device = next(policy.parameters()).device
    with aqn.applied() if aqn is not None else nullcontext():
        _, graded = grade(policy, tokenizer, task, problems=problems, k=0, n=0, temperature=cfg.algo.temperature,
                          top_p=1.0, max_new_tokens=cfg.algo.max_new_tokens, batch_size=args.batch, seed=args.seed,
                          system_prompt=cfg.task.system_prompt, engine=engine_for(cfg.rollout.engine, device),
                          split=args.split, stop=cfg.algo.stop)
    return {"pass1": [float(bool(r["correct"])) for r in graded], "ended": [float(r["terminated"]) for r in graded]}


def _random_lora(model, seed: int) -> None:
    """Every LoRA matrix drawn from `seed` in parameter order, B at a small scale too (peft starts it
    at 0, where an adapter does nothing and A gets no gradient), so two builds hold one adapter."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                scale = 0.02 if "lora_B" in name else p.shape[1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=generator) * scale)


def _loss_and_grads(model, batch, aqn: AQN | None) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with aqn.applied() if aqn is not None else nullcontext():  # (the noisy scales are needed in backward too)
        logits = completion_logits(model, batch, 1.0)
        logp = token_logp(logits, batch.completion_ids)
        loss = -(logp * batch.completion_mask).sum() / batch.completion_mask.sum()
        loss.backward()
    return logits.detach(), loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                          if p.grad is not None}


def layer_check(overrides: list[str], preset: str, task, device, batch, args: ProbeArgs, sigma: float | None,
                noise_cfg) -> dict[str, float]:
    """`layers=true`: the format's policy (its 4-bit layers) against the same model built with
    `quant.fake=round` (plain layers holding the dequantized weights), both in fp32 with the same
    random LoRA and the same AQN draw, on the batch's first `args.batch` completions.

    Returns:
        `logits` (largest absolute logit difference), `loss` (absolute loss difference), `grads` (the
        largest relative error |g - g_ref| / |g_ref| over the LoRA matrices), `params` (how many).
    """
    sub = rows(batch, torch.arange(min(args.batch, len(batch.completion_ids))), cut=(0, batch.completion_ids.shape[1]))
    results = []
    for fake in ("none", "round"):
        _, models = _policy([*overrides, "model.dtype=float32", f"quant.fake={fake}"], preset, task, device)
        _random_lora(models.policy, args.seed)
        aqn = None
        if sigma is not None:
            aqn = AQN(models.policy, replace(noise_cfg, schedule="fixed", sigma=sigma), seed=args.seed + 1)
            aqn.draw(sigma)
        with torch.enable_grad():
            results.append(_loss_and_grads(models.policy, sub, aqn))
        del models
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = results
    errors = [float((grads[n] - g).norm() / g.norm().clamp(min=1e-30)) for n, g in ref_grads.items()]
    return {"logits": float((logits - ref_logits).abs().max()), "loss": abs(loss - ref_loss),
            "grads": max(errors), "params": len(errors)}


def match_temperature(raw: list[tuple[torch.Tensor, torch.Tensor]], target: float, first: bool) -> float:
    """The temperature in [0.5, 2] at which the reference's mean entropy (first token, or token mean)
    equals `target`, by bisection to 1e-3 (an end of the range when the target lies beyond it).

    Args:
        raw: the reference's untempered logits `[b, T, V]` with their completion masks `[b, T]`, in parts.
        target: the entropy to match, in nats.
        first: match the mean first-token entropy; else the mean over all completion tokens.
    """
    def entropy(t: float) -> float:
        total = count = 0.0
        for logits, mask in raw:
            ent = entropy_from_logits((logits[:, :1] if first else logits) / t)
            weight = torch.ones_like(ent) if first else mask.float()
            total, count = total + float((ent * weight).sum()), count + float(weight.sum())
        return total / count

    lo, hi = 0.5, 2.0
    if target <= entropy(lo):
        return lo
    if target >= entropy(hi):
        return hi
    while hi - lo > 1e-3:  # entropy rises with the temperature
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if entropy(mid) < target else (lo, mid)
    return round((lo + hi) / 2, 3)


def _probe_base(args: ProbeArgs, overrides: list[str]) -> tuple[dict, list, torch.Tensor | None, dict]:
    """One base: sample from full precision, score every format and sigma on those tokens.

    Returns:
        `({(preset, sigma): per-prompt values by column}, the reference's raw logits with their masks,
        the matched format's per-token entropies (or None), facts about the batch)`.
    """
    cfg, _ = compose([*overrides, f"quant={REFERENCE}"])
    device = resolve_device(cfg.train.device)
    task = build_task(cfg.task)
    problems = task.eval_problems(args.split)[: args.limit]
    cfg, models = _policy(overrides, REFERENCE, task, device)
    prompts = [models.tokenizer.render_prompt(p.prompt, cfg.task.system_prompt) for p in problems]
    algo = replace(cfg.algo, group_size=args.samples)
    batch = sample(make_generator(cfg.rollout.engine, models.policy, models.tokenizer, device), models.tokenizer, prompts,
                   algo, device, seeds=row_seeds(args.seed, 0, range(len(prompts)), args.samples))
    mask, T = batch.completion_mask, algo.temperature
    reference, raw = _score(models.policy, batch, [], T, args.batch, None, keep=True)
    facts = {"temperature": T, "prompts": len(prompts), "tokens": int(mask.sum()),
             "dtype": str(next(models.policy.parameters()).dtype)}
    rows, checks, matched = {}, {}, None
    for preset in args.quant:
        if preset != REFERENCE:
            del models
            _, models = _policy(overrides, preset, task, device)
        for sigma in args.sigma:
            aqn = None
            if sigma > 0:
                aqn = AQN(models.policy, replace(cfg.noise, schedule="fixed", sigma=sigma), seed=args.seed + 1)
                aqn.draw(sigma)
            scores = _score(models.policy, batch, raw, T, args.batch, aqn, keep=False)[0]
            per = {"entropy": scores["entropy"], "gain": scores["entropy"] - reference["entropy"], "kl": scores["kl"],
                   "top1": scores["top1"]}
            rows[(preset, sigma)] = {name: _per_prompt(v * mask, mask, args.samples) for name, v in per.items()}
            rows[(preset, sigma)]["first"] = scores["entropy"][:, 0].view(-1, args.samples).mean(1).tolist()
            if args.greedy:
                rows[(preset, sigma)].update(_greedy(models.policy, models.tokenizer, task, problems, cfg, args, aqn))
            if args.layers and preset != REFERENCE:
                checks[f"{preset} sigma={sigma:g}"] = layer_check(overrides, preset, task, device, batch, args,
                                                                  None if aqn is None else sigma, cfg.noise)
            if preset == args.match and sigma == args.sigma[0]:
                matched = scores["entropy"]
    parts = [(logits, mask[idx]) for logits, idx in zip(raw, chunks(torch.arange(len(mask)), args.batch))]
    if matched is not None:
        first = args.match_on == "first"
        facts["matched"] = (float(matched[:, 0].sum()), len(matched)) if first else \
            (float((matched * mask).sum()), float(mask.sum()))
    if checks:
        facts["layers"] = checks
    return rows, parts, matched, facts


def probe(args: ProbeArgs, overrides: list[str]) -> dict:
    """Every base of `args.bases` (or the run's own): the results by format and sigma, the prompts of
    all bases pooled, and the matched temperature over all of them."""
    commit = source_commit()  # the code that runs: read before a long probe, not after it
    bases = [[f"model.warmup.seed={b}"] for b in args.bases] or [[]]
    pooled: dict = {}
    raw, facts = [], []
    for extra in bases:
        rows, parts, _, fact = _probe_base(args, [*overrides, *extra])
        for key, row in rows.items():
            for name, values in row.items():
                pooled.setdefault(key, {}).setdefault(name, []).extend(values)
        raw += parts
        facts.append(fact)
    results = {"config": {"overrides": overrides, "bases": args.bases, "commit": commit,
                          "temperature": facts[0]["temperature"],
                          "prompts": sum(f["prompts"] for f in facts), "samples": args.samples,
                          "tokens": sum(f["tokens"] for f in facts), "dtype": facts[0]["dtype"]},
               "rows": [{"quant": q, "sigma": s, "per_prompt": row} for (q, s), row in pooled.items()]}
    checks = [{"base": b, "row": row, **check} for b, f in zip(args.bases or [None], facts)
              for row, check in f.get("layers", {}).items()]
    if checks:
        results["layers"] = checks
    if args.match:
        value = sum(f["matched"][0] for f in facts) / sum(f["matched"][1] for f in facts)
        results["match"] = {"format": args.match, "sigma": args.sigma[0], "on": args.match_on, "target": value,
                            "temperature": match_temperature(raw, value, args.match_on == "first")}
    return results


def table(results: dict) -> str:
    """The per-format table: each column's mean over prompts [95 % t-interval]."""
    columns = [name for name in COLUMNS if name in results["rows"][0]["per_prompt"]]  # greedy=false: no greedy ones
    head = ["format", "sigma", *(COLUMNS[name] for name in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results["rows"]:
        cells = [r["quant"], f"{r['sigma']:g}"]
        for name in columns:
            cells.append(t_interval(r["per_prompt"][name]).text(4))
        lines.append("| " + " | ".join(cells) + " |")
    c = results["config"]
    bases = f" on bases {','.join(map(str, c['bases']))}" if c.get("bases") else ""
    lines += ["", f"{c['prompts']} prompts{bases} x {c['samples']} completions sampled from full precision ({c['dtype']}) "
              f"at temperature {c['temperature']:g}, {c['tokens']} tokens; mean over prompts [95 % t-interval]"
              + (f"; commit `{c['commit'][:7]}`" if c.get("commit") else "")]
    for check in results.get("layers", []):
        base = "" if check["base"] is None else f" (base {check['base']})"
        lines.append(f"layers, {check['row']}{base}: 4-bit layers against plain linears holding the dequantized "
                     f"weights (fp32): largest logit difference {check['logits']:.2e}, loss difference "
                     f"{check['loss']:.2e}, largest relative LoRA-gradient error {check['grads']:.2e} "
                     f"over {check['params']} matrices")
    if "match" in results:
        m = results["match"]
        lines.append(f"full precision at temperature {m['temperature']:g} matches {m['format']}'s "
                     f"{'first-token' if m['on'] == 'first' else 'token-mean'} entropy ({m['target']:.4f} nats)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    tolerate_closed_pipes()
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(f"{__doc__}\n{ProbeArgs.__doc__}")
        return
    try:
        args, overrides = parse(parse_command_line(argv)[0])  # --config-dir DIR: the preset folder it adds
        with logs.quiet(args.verbose):
            check(args, overrides)
            results = probe(args, overrides)
    except (UsageError, ConfigError) as e:
        fail(str(e).splitlines()[0])
    print(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
