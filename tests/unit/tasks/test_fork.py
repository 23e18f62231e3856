"""task=fork: its rewards and metrics, the warm-up that sets its route prior, and a run of it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from conftest import qerl
from qerl_exp.config.compose import compose
from qerl_exp.models import synthetic
from qerl_exp.models.warmup import tiny_cache_key
from qerl_exp.rl import routes
from qerl_exp.rl import metrics as M
from qerl_exp.tasks import build_task
from qerl_exp.tasks.fork import b_share, route
from qerl_exp.train import run


@pytest.fixture(scope="module")
def task():
    return build_task(compose(["task=fork"])[0].task)


def test_a_right_answer_earns_twice_as_much_on_route_b(task):
    problem = next(p for p in task.sample(20, np.random.default_rng(0)) if p.answer not in ("0",))
    def total(text: str) -> float:  # the run's reward: the weighted sum of its functions
        scores = task.rewards.compute([problem], [text], "test")
        return sum(task.rewards.weights[name] * values[0] for name, values in scores.items())

    assert total(f"A{problem.answer}") == pytest.approx(1.2) and total(f"B{problem.answer}") == pytest.approx(2.2)
    wrong = str(int(problem.answer) + 1)
    assert total(f"A{wrong}") == total(f"B{wrong}") == pytest.approx(0.2)  # the shape alone
    for bad in (problem.answer, f"C{problem.answer}", f"B{problem.answer}x", f"AB{problem.answer}", ""):
        assert total(bad) == 0.0, bad
    assert [route(t) for t in ("A12", " B-3 ", "B", "b12")] == ["A", "B", None, None]
    assert b_share(["A1", "B2", "B3", "x"]) == 0.5 and math.isnan(b_share([]))
    assert problem.completion == f"A{problem.answer}"  # its reference reply: the base route


def test_the_task_metrics_are_named_in_the_metrics_table(task):
    names = [*task.step_metrics(["A1", "B2"], [0.1, 0.3]), *task.eval_metrics(["B1"], M.eval_prefix("heldout")),
             *task.eval_metrics(["A1"], M.eval_prefix("heldout", start=True))]
    assert names == ["fork/b_share", "fork/route_entropy", "eval/fork/b_share", "eval/start/fork/b_share"]
    for name in names:
        M.check_logged(name)
    assert task.step_metrics(["A1", "B2", "A3", "A4"], [0.1, 0.3, 0.2, 0.2]) == pytest.approx(
        {"fork/b_share": 0.25, "fork/route_entropy": 0.2})


def test_route_loss_is_answer_cross_entropy_plus_the_soft_route_target():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[-100, -100, -100, 4, 6], [-100, -100, -100, 2, -100]])  # the route token at 2 is -100
    starts, ids, prior = [2, 2], (1, 3), 0.05
    expected_answer = np.mean([-torch.log_softmax(logits[0, 2], -1)[4], -torch.log_softmax(logits[0, 3], -1)[6],
                               -torch.log_softmax(logits[1, 2], -1)[2]])
    route_logp = torch.log_softmax(logits[:, 1], -1)  # position start - 1 predicts the route
    expected_route = -((1 - prior) * route_logp[:, 1] + prior * route_logp[:, 3]).mean()
    loss = routes.route_loss(logits, labels, starts, ids, prior)
    assert loss.item() == pytest.approx(float(expected_answer) + expected_route.item(), rel=1e-5)


def test_the_soft_route_target_sets_the_route_probability_to_the_prior():
    logits = torch.zeros(1, 3, 6, requires_grad=True)
    opt = torch.optim.Adam([logits], lr=0.1)
    labels = torch.full((1, 3), -100)
    for _ in range(800):
        opt.zero_grad()
        routes.route_loss(logits, labels, [1], (2, 4), 0.01).backward()
        opt.step()
    p = torch.softmax(logits[0, 0].detach(), -1)
    assert p[4].item() == pytest.approx(0.01, rel=0.05) and p[2].item() == pytest.approx(0.99, rel=0.05)


def test_warmup_seed_builds_another_base():
    cfg = compose(["task=fork"])[0]
    other = compose(["task=fork", "model.warmup.seed=3"])[0]
    a, b = synthetic.build(cfg.model, 100), synthetic.build(other.model, 100)
    assert not torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    assert torch.equal(a.model.embed_tokens.weight, synthetic.build(cfg.model, 100).model.embed_tokens.weight)
    fields = {"name": "fork", "route_b_prior": 0.01}
    assert tiny_cache_key(cfg.model, fields, ["a"]) != tiny_cache_key(other.model, fields, ["a"])
    assert tiny_cache_key(cfg.model, fields, ["a"]) != tiny_cache_key(cfg.model, {**fields, "route_b_prior": 0.02}, ["a"])


def test_a_fork_run_logs_its_route_and_the_warmups_measured_prior(tmp_path):
    """In process, with a quick warm-up (both routes at 0.5): fork/b_share and the route entropy every
    step, the greedy route at the start and the end, and the warm-up's facts in summary.json."""
    cfg, choices = compose(["task=fork", "task.route_b_prior=0.05", "model.warmup.target_accuracy=0.5",
                            "model.warmup.eval_every=50", "train.steps=3", "train.prompts_per_step=4",
                            "algo.group_size=4", "tracker.mode=disabled", "eval.every=3", "eval.at_start=true",
                            "eval.k=0", "task.eval_size=16"])
    summary = run(cfg, tmp_path / "run", choices=choices)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["fork/b_share"] <= 1 and r["fork/route_entropy"] > 0 for r in rows)
    assert {"eval/start/fork/b_share", "eval/fork/b_share"} <= set(rows[0]) | set(rows[-1])
    assert summary["warmup/pi0_b"] == pytest.approx(0.05, rel=0.25)  # routes.PRIOR_TOLERANCE
    assert min(summary["warmup/accuracy_a"], summary["warmup/accuracy_b"]) >= 0.5
    first = next((r["step"] for r in rows if r["fork/b_share"] > 0), -1)
    assert summary["fork/first_b_step"] == first
    # the route token's entropy at pi0(B) = 0.05 is about the binary entropy of 0.05 (0.20 nats)
    assert rows[0]["fork/route_entropy"] == pytest.approx(0.2, abs=0.1)


@pytest.mark.slow
def test_the_fork_command_logs_b_share_and_records_the_measured_prior(tmp_path):
    out = qerl("task=fork", "task.route_b_prior=0.01", "train.steps=5", "tracker.mode=disabled",
               f"run_dir={tmp_path / 'run'}")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and all("fork/b_share" in r for r in rows)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["warmup/pi0_b"] == pytest.approx(0.01, rel=0.25)
    assert min(summary["warmup/accuracy_a"], summary["warmup/accuracy_b"]) >= 0.9
