"""Data-parallel runs under `torchrun`: N processes (ranks), one device each, one run.

`torchrun --standalone --nproc-per-node N -m qerl_exp ...` starts N copies of the command; they
join one `torch.distributed` process group (gloo on the CPU, NCCL on CUDA, each rank on the GPU
`LOCAL_RANK`) from the environment torchrun sets.

What is global and what is per rank:
- global: the step's `train.prompts_per_step` prompts (every rank draws them from the same data
  stream and keeps its contiguous share), the loss normaliser (all ranks' tokens or completions),
  the LoRA gradients (summed before clipping), the optimizer step (identical on every rank), every
  logged metric (computed from all ranks' rows), the checkpoints (written by rank 0, read by all).
- per rank: `prompts_per_step / N` prompts with their whole groups (advantages never cross
  ranks), their rollouts, the reference, monitor and learner passes over them. With
  `algo.mini_batches > 1` each mini-batch is every rank's share of it, so its rows are not the
  ones a one-process run puts together (the same size and semantics, other members).

Every rank seeds torch, numpy and random alike, so LoRA initialisation, AQN draws and evaluations
agree; completions come from per-row streams seeded by (seed, step, prompt, row) (`rollout.row_seeds`),
so a prompt samples the same completions on any rank (the HF engine; the CUDA fast engine seeds one
stream per rank's batch).

Rank 0 alone owns the run directory (lock, `config.json`, `metrics.jsonl`, W&B, checkpoints,
`summary.json`) and prints; the other ranks create no files. Every collective waits at most
`train.dist_timeout_s` seconds for the other ranks, so a rank that hangs ends the run instead
of blocking it forever (torchrun itself stops the others when one exits with an error).

Without torchrun (no `WORLD_SIZE` in the environment) every function here acts as in a world of
one process, so the run loop has no branches for the distributed case.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TextIO

from qerl_exp.config import Config, ConfigError
from qerl_exp.run import rundir

if TYPE_CHECKING:
    import torch

# How long ranks wait for each other while they agree to refuse a bad command line (the config's
# own timeout may be what is bad).
REFUSAL_TIMEOUT_S = 60.0
_timeout_s = 0.0  # the process group's, for the timeout message
_devnull: TextIO | None = None


class PeerRefused(rundir.RunDirError):
    """Rank 0 refused the run directory; the other ranks stop with it (rank 0 prints why)."""


class CollectiveError(RuntimeError):
    """A collective failed: another rank ended (it, or torchrun, says why) or did not answer within
    `train.dist_timeout_s` (`timed_out`)."""

    def __init__(self, cause: BaseException):
        self.timed_out = "timed out" in str(cause).lower() or "timeout" in str(cause).lower()
        super().__init__(str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__)

    def line(self) -> str | None:
        """The one line to print: only a timeout is news (a rank that ended reports itself)."""
        if not self.timed_out:
            return None
        return (f"rank {rank()}: no answer from the other ranks within train.dist_timeout_s={_timeout_s:g} s (a rank "
                "hung or was stopped); raise train.dist_timeout_s if its steps are that slow, then rerun the same "
                "command to continue from the last checkpoint")


@contextmanager
def _collective() -> Iterator[None]:
    try:
        yield
    except RuntimeError as e:  # gloo and NCCL raise RuntimeError or its DistError subclasses
        raise CollectiveError(e) from e


def launched_world_size() -> int:
    """The process count torchrun started (its `WORLD_SIZE`), before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _group():
    """`torch.distributed` once this process has joined a group, else None. It is imported where a
    group is joined or used, so a command refused before any run never imports torch."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_initialized() else None


def world_size() -> int:
    dist = _group()
    return dist.get_world_size() if dist is not None else 1


def rank() -> int:
    dist = _group()
    return dist.get_rank() if dist is not None else 0


def is_main() -> bool:
    """Rank 0: the process that writes the run directory and prints."""
    return rank() == 0


def check(cfg: Config, world: int, multirun: bool) -> None:
    """Refuse a data-parallel command that cannot split its steps evenly.

    Args:
        cfg: the run's validated config.
        world: the processes torchrun started.
        multirun: the command is a Hydra multirun (`-m`).

    Raises:
        ConfigError: one line naming what to change.
    """
    if world == 1:
        return
    if multirun:
        raise ConfigError(f"torchrun starts one run on {world} processes; drop -m, or run the multirun without torchrun")
    prompts = cfg.train.prompts_per_step
    if prompts < world or prompts % world:
        raise ConfigError(f"train.prompts_per_step={prompts} cannot be split evenly over {world} processes; "
                          f"use a multiple of {world} (e.g. {world * max(1, prompts // world)}) or --nproc-per-node "
                          f"dividing {prompts}")


def init(timeout_s: float, device: str) -> None:
    """Join torchrun's process group (nothing without torchrun, or when already joined).

    Args:
        timeout_s: how long a collective waits for the other ranks before it raises.
        device: the run's `train.device`; CUDA runs use NCCL and the GPU `LOCAL_RANK`, others gloo.
    """
    if launched_world_size() == 1 or _group() is not None:
        return
    import torch
    import torch.distributed as dist

    global _timeout_s
    _timeout_s = timeout_s
    cuda = device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    if not is_main():  # rank 0 reports for everyone
        warnings.simplefilter("ignore")


def refuse(message: str, code: int = 2) -> NoReturn:
    """End every rank on an input they all refuse: rank 0 prints the one line, the others wait
    until it is printed (torchrun would stop rank 0 as soon as another rank exits), all exit `code`."""
    if launched_world_size() > 1:
        init(REFUSAL_TIMEOUT_S, "cpu")
        if is_main():
            print(f"error: {message}", file=sys.stderr, flush=True)
        _group().barrier()
        _group().destroy_process_group()
    else:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def shard(n: int) -> range:
    """This rank's contiguous share of `n` items (the step's prompts); `check` made it even."""
    share = n // world_size()
    return range(rank() * share, (rank() + 1) * share)


def console() -> TextIO:
    """Where progress lines go: stderr on rank 0, nowhere on the other ranks."""
    global _devnull
    if is_main():
        return sys.stderr
    if _devnull is None:
        _devnull = open(os.devnull, "w")
    return _devnull


def _device() -> torch.device:
    """Where collective buffers live: the rank's GPU for NCCL, the CPU for gloo."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if _group().get_backend() == "nccl" else torch.device("cpu")


def all_reduce_grads(params: list[torch.Tensor]) -> None:
    """Sum the gradients of `params` over the ranks, in place (each rank's loss is already divided
    by the global normaliser). One flat buffer: one collective per optimizer step."""
    if world_size() == 1:
        return
    import torch

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    with _collective():
        _group().all_reduce(flat)
    for p, part in zip(params, flat.split([g.numel() for g in grads])):
        p.grad = part.view_as(p)


def _reduce(values: list[float], op: str) -> list[float]:
    """`values` reduced over the ranks by `torch.distributed.ReduceOp` `op` (its name)."""
    if world_size() == 1:
        return values
    import torch

    buf = torch.tensor(values, dtype=torch.float64, device=_device())
    with _collective():
        _group().all_reduce(buf, op=getattr(_group().ReduceOp, op))
    return buf.tolist()


def total(x: float) -> float:
    """`x` summed over the ranks."""
    return _reduce([x], "SUM")[0]


def maximum(values: dict[str, float]) -> dict[str, float]:
    """Each value's maximum over the ranks (wall times: the step waits for the slowest; peaks)."""
    return dict(zip(values, _reduce(list(values.values()), "MAX")))


def any_rank(flag: float) -> float:
    """The largest `flag` of any rank (e.g. a stop signal's number, a failed rollout)."""
    return _reduce([flag], "MAX")[0]


def weighted_mean(values: dict[str, float], weight: float) -> dict[str, float]:
    """Means over all ranks' items from each rank's means over its own `weight` items (e.g. token
    means with weight = the rank's completion tokens): what one process over every item gives."""
    if world_size() == 1:
        return values
    sums = _reduce([v * weight for v in values.values()] + [weight], "SUM")
    return {k: s / sums[-1] if sums[-1] else v for (k, v), s in zip(values.items(), sums)}


def gather(t: torch.Tensor) -> torch.Tensor:
    """Every rank's rows of `t`, in rank order, as one tensor: the batch one process would hold.

    Rows may differ in count between ranks; other dims (e.g. completion length) are padded with
    zeros to the longest rank's, as a one-process batch pads its rows.
    """
    if world_size() == 1:
        return t
    import torch

    dist = _group()
    shape = torch.tensor(t.shape, dtype=torch.long, device=_device())
    shapes = [torch.zeros_like(shape) for _ in range(world_size())]
    with _collective():
        dist.all_gather(shapes, shape)
    widest = torch.stack(shapes).amax(dim=0).tolist()
    widest[0] = max(widest[0], 1)  # no empty buffers in collectives
    dtype = torch.uint8 if t.dtype == torch.bool else t.dtype  # gloo has no bool collectives
    padded = torch.zeros(widest, dtype=dtype, device=_device())
    padded[tuple(slice(0, n) for n in t.shape)] = t.to(dtype)
    parts = [torch.empty_like(padded) for _ in range(world_size())]
    with _collective():
        dist.all_gather(parts, padded)
    out = torch.cat([part[: int(s[0])] for part, s in zip(parts, shapes)])
    return out.to(device=t.device, dtype=t.dtype)


def gather_objects(items: list) -> list:
    """Every rank's `items` (picklable), concatenated in rank order."""
    if world_size() == 1:
        return items
    out: list = [None] * world_size()
    with _collective():
        _group().all_gather_object(out, items)
    return [x for part in out for x in part]


def broadcast(obj):
    """Rank 0's `obj` on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    with _collective():
        _group().broadcast_object_list(box, src=0)
    return box[0]


@contextmanager
def claim(run_dir, config: dict, fresh: bool = False) -> Iterator[rundir.RunDir]:
    """`rundir.claim` on rank 0, which alone writes the run directory; the other ranks wait for its
    answer and raise `PeerRefused` when it was refused.

    Args:
        run_dir: the run directory.
        config: the run's record (`rundir.claim`).
        fresh: a default run directory (`rundir.claim`).

    Yields:
        The directory taken: rank 0's `RunDir`; on the other ranks one without a lock, at the path
        rank 0 took.

    Raises:
        rundir.RunDirError: as `rundir.claim` (rank 0) or `PeerRefused` (the other ranks).
    """
    held, error = None, None
    if is_main():
        try:
            held = rundir.claim(run_dir, config, fresh=fresh)
        except Exception as e:  # noqa: BLE001 - raised below, once the other ranks know
            error = e
    path, refused = broadcast((str(held.path), None) if held is not None else (None, str(error)))
    if error is not None:
        raise error
    if refused is not None:
        raise PeerRefused(refused)
    owned = held if held is not None else rundir.RunDir(Path(path), config)
    try:
        yield owned
    finally:
        owned.release()


def done() -> None:
    """Leave the process group at the end of a run."""
    if _group() is not None:
        _group().destroy_process_group()

