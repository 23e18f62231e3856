"""Quiet by default: the known notices of third-party libraries, silenced where they are emitted.

Loading a model prints notes that ask nothing of the user: transformers' tensor-parallel note and
its "Loading weights" bar, bitsandbytes' hint to install an optional CPU kernel, torchao's
GPU-only extensions that a CPU build lacks, the `kernels` package skipping its hub check offline, and a deprecation that peft triggers inside
transformers. `quiet(verbose)` silences exactly these, by logger name and warning message, for the
calls it wraps (building the models, importing bitsandbytes), and restores every level and filter
afterwards; anything else a library says still shows. `verbose=true` on the command line shows
them all.

| source | what it says | why it is harmless |
| --- | --- | --- |
| `transformers.distributed.tensor_parallel` | The following layers were not sharded: ... | a tensor-parallel plan note; runs use one device |
| transformers' progress bars | Loading weights, Writing model shards | the embedded model loads in milliseconds |
| `bitsandbytes.backends.cpu.ops` | Failed to load CPU gemm_4bit_forward ... pip install kernels | an optional faster CPU kernel from the hub |
| `kernels._internals.hf_hub` | Skipping publisher trust check for 'kernels-community/...' because Hugging Face Hub is in offline mode | that optional kernel's lookup, with the hub offline |
| `torchao` | Failed to load .../_C_mxfp8...so | CUDA-only extensions, absent here |
| `torch.utils._pytree` | register_constant() on Enum subclasses is deprecated | torchao's import-time registration |
| `FutureWarning` from transformers | `is_gradient_checkpointing` is deprecated | peft reads the old alias when wrapping the model |
"""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from typing import Iterator

# Loggers whose warnings are the notices above; their errors still show.
NOTICE_LOGGERS = (
    "transformers.distributed.tensor_parallel",
    "bitsandbytes.backends.cpu.ops",
    "kernels._internals.hf_hub",
    "torchao",
    "torch.utils._pytree",
)
# (category, message regex) of the warnings above.
NOTICE_WARNINGS = ((FutureWarning, r"`is_gradient_checkpointing` is deprecated"),)


@contextmanager
def quiet(verbose: bool = False) -> Iterator[None]:
    """Silence the known third-party notices inside the block, then restore every setting.

    Args:
        verbose: show everything (the block runs untouched), as `verbose=true` asks.

    Example:
        >>> with quiet(cfg.verbose):  # doctest: +SKIP
        ...     models = build_models(cfg, task, device)
    """
    if verbose:
        yield
        return
    from transformers.utils import logging as hf_logging

    loggers = [logging.getLogger(name) for name in NOTICE_LOGGERS]
    levels = [lg.level for lg in loggers]
    bars = hf_logging.is_progress_bar_enabled()
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        hf_logging.disable_progress_bar()
        with warnings.catch_warnings():
            for category, message in NOTICE_WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=category)
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if bars:
            hf_logging.enable_progress_bar()
