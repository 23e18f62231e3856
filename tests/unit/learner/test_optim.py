"""The optimizer and the learning-rate schedule by TRL's names: each schedule against its formula
written out here, its state carried across a resume, and bitsandbytes' 8-bit AdamW against torch's."""

from __future__ import annotations

import math

import pytest
import torch

from qerl_exp.config import TrainConfig
from qerl_exp.rl.optim import make_optimizer, make_scheduler


def _lrs(cfg: TrainConfig, steps: int | None = None) -> list[float]:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr)
    sched = make_scheduler(opt, cfg)
    out = []
    for _ in range(steps or cfg.steps):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def test_the_default_warms_up_to_the_peak_then_follows_a_cosine():
    cfg = TrainConfig(steps=10, lr=1.0, warmup_ratio=0.2)
    want = [(k + 1) / 2 if k < 2 else 0.5 * (1 + math.cos(math.pi * (k - 2) / 8)) for k in range(10)]
    assert _lrs(cfg) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("name, formula", [
    # transformers' definitions (w warm-up steps of T): linear decay to 0, its cosine, a constant after warm-up
    ("linear", lambda k, w, T: k / w if k < w else (T - k) / (T - w)),
    ("cosine", lambda k, w, T: k / w if k < w else 0.5 * (1 + math.cos(math.pi * (k - w) / (T - w)))),
    ("constant_with_warmup", lambda k, w, T: k / w if k < w else 1.0),
    ("constant", lambda k, w, T: 1.0),
])
def test_transformers_schedules_by_their_names(name, formula):
    cfg = TrainConfig(steps=10, lr=2.0, warmup_ratio=0.3, lr_scheduler=name)
    assert _lrs(cfg) == pytest.approx([2.0 * formula(k, 3, 10) for k in range(10)], rel=1e-12)


def test_schedule_arguments_reach_the_schedule():
    cfg = TrainConfig(steps=10, lr=1.0, warmup_ratio=0.0, lr_scheduler="cosine_with_min_lr",
                      lr_scheduler_kwargs={"min_lr_rate": 0.1})
    assert _lrs(cfg, 11)[-1] == pytest.approx(0.1)  # transformers' floor: min_lr_rate of the peak


def test_a_resumed_schedule_continues_where_it_stopped():
    cfg = TrainConfig(steps=8, lr=1.0, warmup_ratio=0.25, lr_scheduler="polynomial", lr_scheduler_kwargs={"power": 2.0})
    whole = _lrs(cfg)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr)
    first = make_scheduler(opt, cfg)
    for _ in range(3):
        opt.step()
        first.step()
    state = {"optimizer": opt.state_dict(), "lr_scheduler": first.state_dict()}
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr)  # a new process: built, then restored
    again = make_scheduler(opt, cfg)
    opt.load_state_dict(state["optimizer"])
    again.load_state_dict(state["lr_scheduler"])
    rest = []
    for _ in range(5):
        rest.append(again.get_last_lr()[0])
        opt.step()
        again.step()
    assert rest == pytest.approx(whole[3:], rel=1e-12)


def test_adamw_8bit_is_bitsandbytes_and_steps_as_adamw_does():
    import bitsandbytes as bnb

    torch.manual_seed(0)
    start = torch.randn(64, 128)  # 8192 elements: above bitsandbytes' 4096, so its moments are 8-bit
    grads = [torch.randn(64, 128) for _ in range(5)]
    params = {}
    for name in ("adamw_torch", "adamw_8bit"):
        p = torch.nn.Parameter(start.clone())
        opt = make_optimizer([p], TrainConfig(lr=1e-2, weight_decay=0.01, optimizer=name), torch.device("cpu"))
        for g in grads:
            p.grad = g.clone()
            opt.step()
        params[name] = (opt, p.detach())
    assert isinstance(params["adamw_8bit"][0], bnb.optim.AdamW8bit)
    assert isinstance(params["adamw_torch"][0], torch.optim.AdamW)
    moved = (params["adamw_torch"][1] - start).abs().mean()
    # the same steps up to the 8-bit moments' rounding: a few percent of how far AdamW moved
    assert (params["adamw_8bit"][1] - params["adamw_torch"][1]).abs().mean() < 0.05 * moved
    opt, p = params["adamw_8bit"]
    assert opt.state[opt.param_groups[0]["params"][0]]["state1"].dtype == torch.uint8  # moments stored in 8 bits
