"""The optimizer of the LoRA parameters and its learning-rate schedule, by TRL's names.

`make_optimizer` builds `train.optimizer`: `adamw_torch` (torch's AdamW, fused into one kernel on
CUDA) or `adamw_8bit` (bitsandbytes' 8-bit AdamW, as transformers' `optim="adamw_8bit"`: its moments
stored in 8 bits blockwise; tensors under 4096 elements keep 32-bit moments). `make_scheduler` builds
`train.lr_scheduler` over `train.steps` with `train.warmup_ratio` of them warming up:

- `warmup_cosine` (the default): linear warm-up that reaches the peak at the last warm-up step
  (step k of w runs at (k + 1) / w of it), then a cosine decay to 0 over the remaining steps;
- every other name is transformers' (`transformers.get_scheduler`, as TRL's `lr_scheduler_type`),
  with `train.lr_scheduler_kwargs` as its `lr_scheduler_kwargs`. Its `cosine` differs from
  `warmup_cosine` in the warm-up only: step k of w runs at k / w of the peak (the first at 0).

The schedule steps once per RL step (skipped steps included), so a resumed run continues it exactly
from its checkpoint (`LRScheduler.state_dict`).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from qerl_exp.config import TrainConfig

DEFAULT_SCHEDULE = "warmup_cosine"


def warmup_cosine(total_steps: int, warmup_ratio: float) -> Callable[[int], float]:
    """The default schedule's multiplier of the peak lr at each step (0-based)."""
    warmup = int(total_steps * warmup_ratio)

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        done = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * done))

    return f


def make_optimizer(params: list[torch.Tensor], cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """`cfg.optimizer` over `params` at `cfg.lr` and `cfg.weight_decay`."""
    if cfg.optimizer == "adamw_8bit":
        import bitsandbytes as bnb  # only where asked for: importing it prints notices (`logs.quiet`)

        return bnb.optim.AdamW8bit(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    # fused on CUDA: one kernel, no temporary copies of every parameter list (foreach makes several)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=device.type == "cuda")


def make_scheduler(opt: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LRScheduler:
    """`cfg.lr_scheduler` over `cfg.steps`, `int(steps * warmup_ratio)` of them warming up.

    Raises:
        ConfigError: transformers refuses that schedule with `cfg.lr_scheduler_kwargs` (one line).
    """
    if cfg.lr_scheduler == DEFAULT_SCHEDULE:
        return torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(cfg.steps, cfg.warmup_ratio))
    from transformers import get_scheduler

    from qerl_exp.config.schema import ConfigError

    try:
        return get_scheduler(cfg.lr_scheduler, opt, num_warmup_steps=int(cfg.steps * cfg.warmup_ratio),
                             num_training_steps=cfg.steps, scheduler_specific_kwargs=dict(cfg.lr_scheduler_kwargs))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"train.lr_scheduler={cfg.lr_scheduler} with train.lr_scheduler_kwargs="
                          f"{dict(cfg.lr_scheduler_kwargs)}: {str(e).strip().splitlines()[0]}; give the schedule's "
                          "arguments in train.lr_scheduler_kwargs (transformers.get_scheduler names them)") from None


def check(cfg: TrainConfig, verbose: bool = False) -> None:
    """Refuse, before a run starts, what `make_optimizer` and `make_scheduler` would: `adamw_8bit`
    without bitsandbytes, schedule arguments its schedule does not take.

    Raises:
        ConfigError: one line naming the setting.
    """
    from qerl_exp.run.logs import quiet
    from qerl_exp.config.schema import ConfigError

    with quiet(verbose):  # transformers' and bitsandbytes' imports print notices
        if cfg.optimizer == "adamw_8bit":
            try:
                import bitsandbytes  # noqa: F401
            except Exception as e:  # noqa: BLE001 - a broken install raises more than ImportError
                raise ConfigError(f"train.optimizer=adamw_8bit needs bitsandbytes, which does not import here "
                                  f"({type(e).__name__}); pip install bitsandbytes, or choose "
                                  "train.optimizer=adamw_torch") from None
        make_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr), cfg)
