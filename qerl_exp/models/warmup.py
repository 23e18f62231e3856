"""The embedded tiny model's warm-up: trained on the task, cached on disk.

Nothing is downloaded: the synthetic model (`models.synthetic`) is trained by supervised learning
on the task's worked solutions until its greedy accuracy reaches `model.warmup.target_accuracy`
(so RL starts with clearly non-zero reward and room to improve). The default base ships with the
package (`models.shipped`): the warm-up's float sums round by the CPU's vector kernels, so another
kind of CPU would warm up another model. A two-route task (`task=fork`)
learns both routes instead, until each answers at that accuracy, with its route prior set to
`task.route_b_prior` (`rl.routes`). `model.warmup.seed` picks the base: its initialization and
warm-up data. The result is cached under `model.cache_dir`, keyed by a hash of everything that
determines it; a file lock keeps parallel runs from warming up the same model twice.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from qerl_exp.config import ModelConfig, TaskConfig
from qerl_exp.models import shipped
from qerl_exp.models.synthetic import base_seed, build
from qerl_exp.models.tokenizers import CharTokenizer
from qerl_exp.rl import routes
from qerl_exp.rl.rollout import greedy_pass_at_1
from qerl_exp.run.files import temp_dir
from qerl_exp.tasks import Problem, reference_completion
from qerl_exp.tasks.fork import reply
from qerl_exp.tasks.rewards import is_correct

# Bump when the embedded model, its tokenizer or its warm-up recipe change meaning, so that
# cached warm-ups made by older code are not reused. 2: the warm-up runs on one thread (version 1's
# cache held whatever the machine's thread count made).
TINY_RECIPE_VERSION = 2


def tiny_cache_spec(cfg: ModelConfig, task_fields: dict, vocab: list[str]) -> dict:
    """Everything that determines the warmed-up embedded model: what its cache key hashes.

    Args:
        cfg: the model config (its fields that do not shape the weights are left out).
        task_fields: the task settings that shape its problems (and a file-backed task's data).
        vocab: the tokenizer's vocabulary.
    """
    return {
        "version": TINY_RECIPE_VERSION,
        # `source` is synthetic for every model warmed up, and `name` only labels it
        "model": {k: v for k, v in asdict(cfg).items()
                  if k not in ("name", "source", "dtype", "cache_dir", "gguf_file", "package", "parts")},
        "task": task_fields,
        "vocab": vocab,
    }


def spec_key(spec: dict) -> str:
    """16 hex digits of the SHA-256 of a warm-up's spec (`tiny_cache_spec`): its cache key."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def tiny_cache_key(cfg: ModelConfig, task_fields: dict, vocab: list[str]) -> str:
    """The cache key of the warmed-up embedded model: `spec_key(tiny_cache_spec(...))`."""
    return spec_key(tiny_cache_spec(cfg, task_fields, vocab))


def base_spec(cfg: ModelConfig, task_cfg: TaskConfig, task, tokenizer: CharTokenizer) -> dict:
    """The warm-up spec of a run's embedded base, from its model and task configs."""
    task_fields = {"name": task_cfg.name, "difficulty": task_cfg.difficulty, "ops": list(task_cfg.ops), "path": task_cfg.path}
    if hasattr(task, "routes"):  # the warm-up sets the route prior
        task_fields["route_b_prior"] = task_cfg.route_b_prior
    if hasattr(task, "fingerprint"):  # file-backed tasks: the data itself, not only its path
        task_fields["data"] = task.fingerprint
    return tiny_cache_spec(cfg, task_fields, tokenizer.vocab)


def load_or_warm_up(cfg: ModelConfig, task_cfg: TaskConfig, task, tokenizer: CharTokenizer, use_shipped: bool = True):
    """The warmed-up embedded model (float32, CPU) and facts about its warm-up: the base the package
    ships for this spec when there is one (`models.shipped`), else the cached warm-up, else a new one.

    Args:
        cfg: the model config (`source=synthetic`).
        task_cfg: the task config; its fields that shape the problems are part of the cache key.
        task: the built task whose problems the model learns from.
        tokenizer: the embedded tokenizer.
        use_shipped: take the package's base for this spec when it ships one; False: the cache or
            a new warm-up (what `ship=true` copies into the package).

    Returns:
        `(model, info)`, info holding the cache key, path, warm-up steps and accuracy.
    """
    key = spec_key(base_spec(cfg, task_cfg, task, tokenizer))
    packaged = shipped.find(key) if use_shipped else None
    loaded = _cached(packaged) if packaged is not None else None
    if loaded is not None:
        return loaded[0], {**loaded[1], "cache_key": key, "path": str(packaged), "weights": weights_digest(packaged)}
    root = Path(os.path.expanduser(cfg.cache_dir))
    path = root / f"tiny-{key}"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"tiny-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = _cached(path)
        if cached is None:
            # A cache miss must not move the run's RNG; and one thread, since the model is cached by
            # config alone: other thread counts split float sums differently, and the warm-up's
            # trajectory (its stopping step, 1000 or over 3000) with them.
            threads = torch.get_num_threads()
            try:
                torch.set_num_threads(1)
                with torch.random.fork_rng(devices=[]):
                    model = build(cfg, len(tokenizer))
                    info = _warm_up(model, cfg, task, tokenizer, task_cfg)
            finally:
                torch.set_num_threads(threads)
            tmp = temp_dir(root, prefix=f".tiny-{key}-")
            model.save_pretrained(tmp)
            (tmp / "warmup.json").write_text(json.dumps(info, indent=2))
            shutil.rmtree(path, ignore_errors=True)  # a half-written or corrupt one
            os.replace(tmp, path)
            cached = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), info
    model, info = cached
    return model, {**info, "cache_key": key, "path": str(path), "weights": weights_digest(path)}


def weights_digest(path: Path) -> str:
    """16 hex digits of the SHA-256 of a cached warm-up's weights file: runs that show the same
    digest started from the same model. The warm-up is deterministic on one kind of CPU, but its
    float sums round by the CPU's vector kernels (AVX-512, AVX2) and the warm-up amplifies that:
    another kind of CPU can stop it at another step, with another model; copying the cache folder
    along gives that machine the same one."""
    digest = hashlib.sha256()
    with open(path / "model.safetensors", "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def _cached(path: Path):
    """`(model, info)` of the cached warm-up in `path`; None when there is none, or when it does not
    load (a warning names it, and the caller warms up again in its place)."""
    if not (path / "warmup.json").exists():
        return None
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), json.loads((path / "warmup.json").read_text())
    except Exception as e:  # noqa: BLE001 - truncated, overwritten, half-copied: any fault means "make it again"
        text = str(e).strip()
        warnings.warn(f"the cached warm-up model {path} is unreadable ({type(e).__name__}: "
                      f"{text.splitlines()[0] if text else ''}); warming it up again in its place")
        return None


def _batch(problems: list[Problem], completions: list[str], tokenizer: CharTokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `[B, L]` inputs and labels (-100 outside the completion)."""
    seqs, labels = [], []
    for p, text in zip(problems, completions):
        prompt = [tokenizer.bos_id] + tokenizer.encode(p.question)
        completion = tokenizer.encode(text) + [tokenizer.eos_id]
        seqs.append(prompt + completion)
        labels.append([-100] * len(prompt) + completion)
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_id)
    lab = torch.full((len(seqs), width), -100)
    for i, (s, l) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(l)] = torch.tensor(l)
    return ids, lab


def _loss(model, problems: list[Problem], tokenizer: CharTokenizer, rng: np.random.Generator, task,
          prior: float) -> torch.Tensor:
    """One warm-up batch's loss: the reference replies' cross-entropy; for a two-route task, each
    problem by a route drawn at random, its route token taught the prior (`routes.route_loss`)."""
    if not hasattr(task, "routes"):
        ids, labels = _batch(problems, [reference_completion(p) for p in problems], tokenizer)
        return model(input_ids=ids, attention_mask=(ids != tokenizer.pad_id).long(), labels=labels).loss
    drawn = routes.draw_routes(len(problems), rng)
    ids, labels = _batch(problems, [reply(p, r) for p, r in zip(problems, drawn)], tokenizer)
    starts = [1 + len(tokenizer.encode(p.question)) for p in problems]  # bos + the question
    labels[torch.arange(len(starts)), torch.tensor(starts)] = -100  # the route token learns the prior instead
    logits = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_id).long()).logits
    return routes.route_loss(logits, labels, starts, tuple(tokenizer.encode(r)[0] for r in task.routes), prior)


def _progress(model, task, tokenizer: CharTokenizer, probe: list[Problem], target: float, prior: float,
              judge) -> tuple[dict, bool]:
    """What the warm-up has reached on the probe problems (`judge`: which greedy replies are right),
    and whether it is done."""
    if hasattr(task, "routes"):
        facts = routes.route_facts(model, tokenizer, task, probe)
        return facts, routes.competent(facts, prior, target)
    model.eval()
    # One batch of all problems, as always: other batches pad differently, which could move
    # the greedy tokens and so the stopping step (the model is cached by config hash alone).
    correct = greedy_pass_at_1(model, tokenizer, judge, probe, system_prompt="", max_new_tokens=32,
                               batch_size=len(probe))[2]
    accuracy = float(np.mean(correct))
    return {"greedy_accuracy": accuracy}, accuracy >= target


def _warm_up(model, cfg: ModelConfig, task, tokenizer: CharTokenizer, task_cfg: TaskConfig) -> dict:
    w, prior = cfg.warmup, task_cfg.route_b_prior

    # The built-in judgement, whatever reward functions the run has: they are not part of the cache key.
    def judge(problems: list[Problem], texts: list[str]) -> list[bool]:
        return [is_correct(t, p.answer, task_cfg.answer_from) for p, t in zip(problems, texts)]

    rng = np.random.default_rng(base_seed(cfg))
    probe = task.sample(128, np.random.default_rng(base_seed(cfg) + 1))
    opt = torch.optim.AdamW(model.parameters(), lr=w.lr, weight_decay=0.01)
    start, facts, step = time.time(), {"greedy_accuracy": 0.0}, 0
    # A terminal gets a live bar; a log file gets a line every 10 s rather than thousands.
    bar = tqdm(range(1, w.max_steps + 1), desc="warm-up (embedded model, cached after)", unit="step",
               mininterval=0.1 if sys.stderr.isatty() else 10.0)
    for step in bar:
        model.train()
        loss = _loss(model, task.sample(w.batch_size, rng), tokenizer, rng, task, prior)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % w.eval_every == 0:
            facts, done = _progress(model, task, tokenizer, probe, w.target_accuracy, prior, judge)
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{facts['greedy_accuracy']:.2f}")
            if done:
                break
    bar.close()
    if hasattr(task, "routes") and "pi0_b" not in facts:  # stopped before its first measurement
        facts = _progress(model, task, tokenizer, probe, w.target_accuracy, prior, judge)[0]
    model.eval()
    return {"steps": step, **facts, "loss": float(loss.item()), "seconds": time.time() - start}


def main(argv: list[str] | None = None) -> None:
    """`python -m qerl_exp.models.warmup [run overrides] [ship=true]`: the embedded base of a run config.

    Warms it up (or takes the shipped or cached one) and prints its key, folder and warm-up facts;
    `ship=true` takes the cache or a new warm-up, never the shipped copy, and copies it into the
    package (`models.shipped`) with its record: what made the default base, `ship=true` alone.
    """
    from qerl_exp.run import logs
    from qerl_exp.config.compose import compose
    from qerl_exp.run.console import fail, tolerate_closed_pipes
    from qerl_exp.run.record import source_commit
    from qerl_exp.tasks import build_task

    tolerate_closed_pipes()
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(main.__doc__)
        return
    ship = "ship=true" in argv
    overrides = [a for a in argv if a not in ("ship=true", "ship=false")]
    try:
        cfg, _ = compose(overrides)
    except ValueError as e:
        fail(str(e).splitlines()[0])
    if cfg.model.source != "synthetic" or cfg.model.warmup.max_steps == 0:
        fail("the warm-up command is for the embedded model (model=tiny) with model.warmup.max_steps > 0")
    task, tokenizer = build_task(cfg.task), CharTokenizer()
    with logs.quiet(cfg.verbose):
        _, info = load_or_warm_up(cfg.model, cfg.task, task, tokenizer, use_shipped=not ship)
    if ship:
        command = " ".join(["python -m qerl_exp.models.warmup", *argv])
        path = shipped.ship(Path(info["path"]), base_spec(cfg.model, cfg.task, task, tokenizer), info["cache_key"],
                            source_commit(), command)
        info = {**info, "path": str(path)}
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
