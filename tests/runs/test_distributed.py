"""Data-parallel runs under torchrun (gloo on the CPU): one run on two processes equals the
one-process run, bad process counts are refused in one line, and a hung rank ends the run."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, SUBPROCESS_ENV, metrics_rows, qerl, stable
from qerl_exp.config import ConfigError
from qerl_exp.config.compose import compose
from qerl_exp.rl.rollout import HFGenerator, RowSampling, row_seeds, sample
from qerl_exp.run import distributed

# The command: 4 steps of 4 prompts x 4 completions, seed 5.
RUN = ["train.steps=4", "train.prompts_per_step=4", "algo.group_size=4", "seed=5"]


def torchrun(*args: str, cwd: Path, nproc: int = 2) -> subprocess.Popen:
    """`torchrun --standalone --nproc-per-node NPROC -m qerl_exp ARGS`, output captured (stderr in stdout)."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "qerl_exp",
         *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**SUBPROCESS_ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )


def close(a: float, b: float) -> bool:
    """Relative difference <= 1e-4 (the issue's target), with an absolute floor for values that
    are 0 up to rounding (GRPO's loss at ratio 1 is exactly 0 in exact arithmetic)."""
    return abs(a - b) <= 1e-4 * max(abs(a), abs(b)) + 1e-6


def test_row_sampling_draws_from_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf")]).repeat(20000, 1)  # -inf: cut by top-p
    tokens = RowSampling(list(range(20000)), torch.device("cpu"))(None, logits).argmax(dim=-1)
    freq = torch.bincount(tokens, minlength=5).double() / len(tokens)
    assert (freq - torch.softmax(logits[0].double(), dim=0)).abs().max() < 0.015  # 5 standard errors at most
    again = RowSampling(list(range(20000)), torch.device("cpu"))(None, logits).argmax(dim=-1)
    assert torch.equal(tokens, again)


def test_a_prompt_samples_the_same_completions_in_any_batch(tiny_policy):
    """What a rank draws for a prompt equals what one process draws for it in the whole batch."""
    cfg, task, models = tiny_policy
    tok, algo, cpu = models.tokenizer, cfg.algo, torch.device("cpu")
    prompts = [tok.render_prompt(p.question, cfg.task.system_prompt) for p in task.sample(4, np.random.default_rng(0))]
    generator = HFGenerator(models.sampler.module, tok)
    G = algo.group_size
    whole = sample(generator, tok, prompts, algo, cpu, seeds=row_seeds(5, 3, range(4), G))
    share = sample(generator, tok, prompts[2:], algo, cpu, seeds=row_seeds(5, 3, range(2, 4), G))
    assert whole.texts[2 * G:] == share.texts
    assert torch.allclose(whole.sampler_logp[2 * G:, : share.sampler_logp.shape[1]], share.sampler_logp, atol=1e-5)
    assert len(set(whole.texts)) > len(prompts)  # the rows of a group differ: sampled, not greedy
    assert sample(generator, tok, prompts, algo, cpu, seeds=row_seeds(5, 4, range(4), G)).texts != whole.texts


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The issue's command run by one process."""
    one = tmp_path_factory.mktemp("one") / "run"
    single = qerl(*RUN, "tracker.mode=disabled", f"run_dir={one}")
    assert single.returncode == 0, single.stderr[-2000:]
    return one


def assert_same_steps(one: Path, two: Path) -> None:
    a, b = stable(metrics_rows(one)), stable(metrics_rows(two))
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        # rewards are sums of 0.2s and 2s over 16 rows: within 1e-4 only if every completion is the same
        bad = {k: (ra[k], rb[k]) for k in ra if isinstance(ra[k], float) and not close(ra[k], rb[k])}
        assert not bad, f"step {ra['step']}: {bad}"
    assert any(abs(r["grad_norm"]) > 1e-3 for r in a)  # the gradients compared are not all ~0


@pytest.mark.slow
def test_two_processes_log_what_one_process_logs(tmp_path, one_process):
    one = one_process
    work = tmp_path / "cwd"  # the launch folder: only the run dir may appear in it
    work.mkdir()
    proc = torchrun(*RUN, "tracker.mode=offline", "run_dir=two", cwd=work)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out[-3000:]
    assert [p.name for p in work.iterdir()] == ["two"]
    two = work / "two"
    assert_same_steps(one, two)

    # rank 0 alone logged and printed; both records say how many processes ran
    assert out.count("run dir: ") == 1 and "error" not in out.lower()
    assert len(list((two / "wandb").glob("offline-run-*"))) == 1
    assert json.loads((two / "config.json").read_text())["world_size"] == 2
    assert json.loads((one / "config.json").read_text())["world_size"] == 1
    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert math.isclose(summary["reward/final"], json.loads((one / "summary.json").read_text())["reward/final"])


@pytest.mark.slow
def test_two_processes_share_the_batch_reward_std_and_the_loss_count(tmp_path):
    # `scale_rewards=batch` takes the std over every rank's rewards, `dr_grpo` counts every rank's
    # completions, and GSPO's ratios (off-policy in the second iteration) are each a whole completion's
    loss = ["algo.scale_rewards=batch", "algo.loss_type=dr_grpo", "algo.importance_sampling_level=sequence",
            "algo.num_iterations=2", "tracker.mode=disabled"]
    single = qerl(*RUN, *loss, f"run_dir={tmp_path / 'one'}")
    assert single.returncode == 0, single.stderr[-2000:]
    proc = torchrun(*RUN, *loss, "run_dir=two", cwd=tmp_path)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out[-3000:]
    assert_same_steps(tmp_path / "one", tmp_path / "two")


@pytest.mark.slow
def test_every_rank_resumes_from_rank_0s_checkpoint(tmp_path, one_process):
    proc = torchrun(*RUN, "tracker.mode=disabled", "checkpoint.every=1", "run_dir=run", cwd=tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)  # torchrun passes it on: every rank ends the step, rank 0 checkpoints
    out = proc.communicate(timeout=120)[0]
    assert "interrupted by SIGTERM (step " in out and not (tmp_path / "run" / "summary.json").exists(), out[-3000:]
    again = torchrun(*RUN, "tracker.mode=disabled", "checkpoint.every=1", "run_dir=run", cwd=tmp_path)
    out = again.communicate(timeout=600)[0]
    assert again.returncode == 0 and out.count("resuming ") == 1, out[-3000:]
    assert_same_steps(one_process, tmp_path / "run")


def test_process_counts_that_do_not_split_the_prompts_are_refused():
    cfg = compose(["train.prompts_per_step=4"])[0]
    distributed.check(cfg, 1, multirun=True)  # one process: anything goes
    distributed.check(cfg, 4, multirun=False)
    for world in (3, 8):  # not dividing 4; more processes than prompts
        with pytest.raises(ConfigError, match=f"train.prompts_per_step=4 cannot be split evenly over {world} processes"):
            distributed.check(cfg, world, multirun=False)
    with pytest.raises(ConfigError, match="drop -m"):
        distributed.check(cfg, 2, multirun=True)


@pytest.mark.slow
def test_torchrun_refuses_in_one_line_before_any_work(tmp_path):
    proc = torchrun("train.prompts_per_step=3", "tracker.mode=disabled", "run_dir=run", cwd=tmp_path)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode != 0
    ours = [line for line in out.splitlines() if line.startswith("error: ")]
    assert ours == [("error: train.prompts_per_step=3 cannot be split evenly over 2 processes; use a multiple of 2 "
                     "(e.g. 2) or --nproc-per-node dividing 3")]
    assert "exitcode  : 2" in out  # every rank exited with the usage-error code (torchrun's report)
    assert list(tmp_path.iterdir()) == []


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of torchrun's worker `rank` (from the RANK variable torchrun gives each worker)."""
    for task in Path(f"/proc/{launcher}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return int(child)
    raise AssertionError(f"no worker of rank {rank} under pid {launcher}")


def _alive(pid: int) -> bool:
    """The process runs (it is neither gone nor a zombie waiting for torchrun to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _pending(pid: int, sig: int) -> bool:
    """`sig` is queued for the process (its thread's or the process's pending mask)."""
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    except OSError:
        return True  # gone: nothing is left to wait for
    return any(int(status[k], 16) >> (sig - 1) & 1 for k in ("SigPnd", "ShdPnd"))


@pytest.mark.slow
def test_a_hung_rank_ends_the_run_after_the_timeout(tmp_path):
    proc = torchrun("train.steps=40", "train.prompts_per_step=2", "algo.group_size=4", "tracker.mode=disabled",
                    "train.dist_timeout_s=10", "run_dir=run", cwd=tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.02)
    rank0, rank1 = _rank_pid(proc.pid, 0), _rank_pid(proc.pid, 1)
    os.kill(rank1, signal.SIGSTOP)  # rank 1 hangs mid-run; rank 0 waits in its next collective
    stopped = time.time()
    while _alive(rank0):
        assert time.time() - stopped < 60, "rank 0 still waits for the hung rank"
        time.sleep(0.1)
    while not _pending(rank1, signal.SIGTERM):  # torchrun's teardown, queued while rank 1 is stopped
        assert time.time() - stopped < 60, "torchrun sent the hung rank no SIGTERM"
        time.sleep(0.02)
    os.kill(rank1, signal.SIGCONT)  # the SIGTERM reaches it now; it must end too, silently
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode != 0
    ours = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and ours[0].startswith("error: rank 0: no answer from the other ranks within "
                                                  "train.dist_timeout_s=10 s"), out[-3000:]
    assert not (tmp_path / "run" / "summary.json").exists()
