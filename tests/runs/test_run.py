"""End-to-end: the command line runs the QeRL loop and leaves a complete run directory."""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from pathlib import Path

import pytest

from conftest import TINY_RUN, qerl, stable
from qerl_exp.rl.metrics import check_logged

pytestmark = pytest.mark.slow


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


REQUIRED = [
    "reward", "reward_std", "rewards/format/mean", "rewards/correct/mean", "frac_reward_zero_std",
    "completions/mean_length", "completions/clipped_ratio", "clip_ratio/low_mean", "clip_ratio/high_mean",
    "entropy", "sampler/entropy", "entropy_gain", "quant/kl", "sampling/logp_gap", "noise/sigma",
    "noise/stage", "perf/rollout_tok_s", "perf/step_s", "mem/weights_bytes", "mem/quantized_linear_bytes",
    "mem/peak_bytes", "loss", "grad_norm", "lr",
]


def test_single_run_writes_metrics_summary_wandb_and_adapter(tmp_path):
    run_dir = tmp_path / "run"
    out = qerl(*TINY_RUN, "tracker.mode=offline", "train.steps=3", f"run_dir={run_dir}", "noise=fixed",
               "noise.sigma=0.3")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "warning: AQN's sigma (0.3) is " in out.stderr  # about a third of the tiny model's norm scales
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for name in REQUIRED:
        assert all(name in r for r in rows), name
    # at beta 0 the reference pass behind `kl` runs every monitor.kl_every (10) steps: step 0 only
    assert ["kl" in r for r in rows] == [True, False, False]
    for name in set().union(*rows) - {"step"}:  # metrics.py's table names everything logged
        check_logged(name)
    assert all(r["noise/sigma"] == pytest.approx(0.3) for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["reward/final"] == pytest.approx(rows[-1]["reward"])
    # the base it started from: its warm-up's steps and a digest of the weights (the same on
    # another machine only where that machine warms up the same model)
    assert summary["warmup/steps"] >= 1 and re.fullmatch("[0-9a-f]{16}", summary["warmup/weights"])
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb")), "no offline W&B run file"
    assert (run_dir / "final" / "adapter" / "adapter_model.safetensors").exists()
    config = json.loads((run_dir / "config.json").read_text())
    assert config["choices"]["noise"] == "fixed" and config["seed"] == 0


def test_finished_run_is_never_overwritten(tmp_path):
    run_dir = tmp_path / "run"
    assert qerl(*TINY_RUN, "train.steps=1", f"run_dir={run_dir}").returncode == 0
    before = (run_dir / "metrics.jsonl").read_text()
    out = qerl(*TINY_RUN, "train.steps=1", f"run_dir={run_dir}")
    assert out.returncode != 0
    assert "holds a finished run" in out.stderr.strip().splitlines()[-1]
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_multirun_makes_one_run_dir_per_job(tmp_path):
    out = qerl("-m", "noise=adaptive,fixed", *TINY_RUN, "tracker.mode=offline", "train.steps=2",
               f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    jobs = sorted(p for p in tmp_path.iterdir() if p.is_dir() and (p / "metrics.jsonl").exists())
    assert [p.name for p in jobs] == ["0_bf16_adaptive_s0", "1_bf16_fixed_s0"]
    for job in jobs:
        assert len(_rows(job)) == 2
        assert len(list((job / "wandb").glob("offline-run-*"))) == 1


def test_same_seed_reproduces_metrics(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        assert qerl(*TINY_RUN, "train.steps=2", "monitor.every=0", f"run_dir={d}").returncode == 0
    assert stable(_rows(a)) == stable(_rows(b))


def test_zero_warmup_steps_run_on_random_weights_and_cache_nothing(tmp_path):
    # the large-shape measurement mode: no CPU warm-up, the seeded random init built in place
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    out = qerl(*TINY_RUN, "train.steps=1", "monitor.every=0", f"run_dir={run_dir}", f"model.cache_dir={cache}",
               "model.warmup.max_steps=0", "model.hidden_size=192")
    assert out.returncode == 0, out.stderr[-3000:]
    assert not cache.exists() or not any(cache.iterdir()), "a random-weight model was cached"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["warmup/greedy_accuracy"] is None  # NaN: no warm-up
    assert "warm-up" not in out.stderr


def test_building_the_embedded_model_leaves_the_run_rng_alone(tmp_path):
    # The run seeds torch before building its models; a cache miss (build + warm-up) or a random
    # build must not reseed it, or the LoRA init and sampling would not depend on the run's seed.
    import torch

    from qerl_exp.config import ModelConfig, TaskConfig, WarmupConfig
    from qerl_exp.models.synthetic import build
    from qerl_exp.models.tokenizers import CharTokenizer
    from qerl_exp.models.warmup import load_or_warm_up
    from qerl_exp.tasks import build_task

    torch.manual_seed(7)
    state = torch.get_rng_state()
    tok = CharTokenizer()
    a = build(ModelConfig(), len(tok))
    assert torch.equal(torch.get_rng_state(), state)
    b = build(ModelConfig(), len(tok))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))  # seeded all the same
    cfg = ModelConfig(cache_dir=str(tmp_path), warmup=WarmupConfig(max_steps=2, eval_every=1))
    load_or_warm_up(cfg, TaskConfig(), build_task(TaskConfig()), tok)
    assert torch.equal(torch.get_rng_state(), state)


def test_the_warm_up_gives_the_same_model_whatever_the_thread_count(tmp_path):
    # The warmed-up model is cached by config alone, so it must not depend on torch's thread count:
    # with two threads, float sums split differently, and the default model's warm-up once ran all
    # 3000 steps (0.19 accuracy at step 2600, 0.41 at 3000) where one thread reaches the 0.3 target
    # at step 1000.
    import torch

    from qerl_exp.config import ModelConfig, TaskConfig, WarmupConfig
    from qerl_exp.models.tokenizers import CharTokenizer
    from qerl_exp.models.warmup import load_or_warm_up
    from qerl_exp.tasks import build_task

    tok, task, before = CharTokenizer(), build_task(TaskConfig()), torch.get_num_threads()
    models, digests = [], []
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            cfg = ModelConfig(cache_dir=str(tmp_path / f"t{threads}"), warmup=WarmupConfig(max_steps=20, eval_every=100))
            model, info = load_or_warm_up(cfg, TaskConfig(), task, tok)
            models.append(model)
            # the run's summary names the model by a digest of its weights file
            digests.append(info["weights"])
            assert info["weights"] == hashlib.sha256((Path(info["path"]) / "model.safetensors").read_bytes()).hexdigest()[:16]
            assert torch.get_num_threads() == threads  # the run's own setting is left as it was
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(p, q) for p, q in zip(models[0].parameters(), models[1].parameters()))
    assert digests[0] == digests[1]
    cfg = ModelConfig(cache_dir=str(tmp_path / "other"), warmup=WarmupConfig(max_steps=21, eval_every=100))
    assert load_or_warm_up(cfg, TaskConfig(), task, tok)[1]["weights"] != digests[0]  # one more step: another model


def test_a_corrupt_cached_warm_up_is_named_and_made_again(tmp_path):
    import torch

    from qerl_exp.config import ModelConfig, TaskConfig, WarmupConfig
    from qerl_exp.models.tokenizers import CharTokenizer
    from qerl_exp.models.warmup import load_or_warm_up
    from qerl_exp.tasks import build_task

    cfg, task, tok = ModelConfig(cache_dir=str(tmp_path), warmup=WarmupConfig(max_steps=3)), build_task(TaskConfig()), CharTokenizer()
    model, info = load_or_warm_up(cfg, TaskConfig(), task, tok)
    made = {k: v.clone() for k, v in model.state_dict().items()}  # the file is mapped: copy before it changes
    weights = Path(info["path"]) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a copy cut short
    with pytest.warns(UserWarning, match=f"the cached warm-up model {info['path']} is unreadable .*warming it up again"):
        again, _ = load_or_warm_up(cfg, TaskConfig(), task, tok)
    assert all(torch.equal(made[k], v) for k, v in again.state_dict().items())
    with warnings.catch_warnings(record=True) as caught:  # and the cache holds it whole again
        warnings.simplefilter("always")
        load_or_warm_up(cfg, TaskConfig(), task, tok)
    assert not [w for w in caught if "unreadable" in str(w.message)]
