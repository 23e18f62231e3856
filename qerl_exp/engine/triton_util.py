"""What every launch of the engine shares: Triton itself (`HAS_TRITON`; the interpreter on CPU,
`interpreting`), the device (`sm_count`, `capability`, `require_device`), tile and dtype helpers
(`pow2`, `tl_dtype`, `dummy_tensor`) and the dot products of its kernels (`_dot`, `_dot_as_peft`,
`_f16_div16`).

Each kernel lives with its launcher, by concept: the fused linear (`linear`, `linear_kernels`),
RMSNorm with the LoRA shrink (`norm`), rope with the KV-cache write (`rope_cache`), the prefill's
epilogue (`prefill`), decode attention (`attention`), sampling (`sampling`); FP4 decoding is the
format's (`qerl_exp.quant.fp4_decode`). Kernel names keep their leading underscore: the profiles in
docs/engine.md name them so. The tests hold each kernel to a torch oracle (tests/engine_oracle.py)
or to float64, on CPU under the Triton interpreter (TRITON_INTERPRET=1 set before triton is first
imported; tests/unit/engine/test_engine.py does, in a subprocess).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from qerl_exp.quant.fp4_decode import HAS_TRITON, interpreting, tl, triton  # noqa: F401 - the engine's too


@triton.jit
def _dot(a, b, acc):
    # tl.dot, exact for fp32 operands (Triton's default there is TF32: a 10-bit mantissa)
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _dot_as_peft(x, a, acc):
    # x @ a in a's dtype, as peft's lora_A(x.to(A.dtype)). An fp32 a under 16-bit x is taken as
    # three terms in x's dtype (with bf16 24 significant bits, all of fp32's), each product exact
    # in the fp32 accumulator: the tensor cores do what an ieee fp32 dot does on the FMA units,
    # which took most of the 7B prefill's norm + shrink time (docs/engine.md)
    if a.dtype == tl.float32:
        if x.dtype != tl.float32:
            hi = a.to(x.dtype)
            rest = a - hi.to(tl.float32)
            mid = rest.to(x.dtype)
            acc = tl.dot(x, hi, acc)
            acc = tl.dot(x, mid, acc)
            return tl.dot(x, (rest - mid.to(tl.float32)).to(x.dtype), acc)
    return _dot(x.to(a.dtype), a, acc)


@triton.jit
def _f16_div16(x):
    # x / 16 in fp16 (the fp16 dots' activations): scaled in x's own dtype (exact for bf16),
    # then one conversion. Written as (x.to(fp32) * 0.0625).to(fp16), the compiler emitted
    # "round to fp16, then scale" (seen in the sm_90 PTX): inf from |x| = 65520 on.
    return (x * 0.0625).to(tl.float16)


def pow2(n: int, lo: int = 16) -> int:
    """The smallest power of two >= n, at least `lo` (a padded tile size: LoRA ranks, head groups)."""
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


_DUMMIES: dict = {}


def tl_dtype(dtype: torch.dtype):
    """Triton's dtype for a torch float dtype (the kernels' LDT constexpr)."""
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def dummy_tensor(device: torch.device, dtype: torch.dtype) -> Tensor:
    """A small zero tensor for unused kernel arguments (made once, never inside a graph capture)."""
    key = (str(device), dtype)
    if key not in _DUMMIES:
        _DUMMIES[key] = torch.zeros(64, dtype=dtype, device=device)
    return _DUMMIES[key]


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 132 (the H200's) in the interpreter, so CPU tests see GPU tile shapes."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) compute capability of a CUDA device; None elsewhere (no measured dispatch applies)."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def require_device(device: torch.device) -> None:
    """Raise, in one line, unless the engine's kernels can run on `device`: CUDA, or CPU tensors under
    the Triton interpreter (TRITON_INTERPRET=1 set before triton is imported; the CPU tests do)."""
    if not HAS_TRITON:
        raise RuntimeError("the rollout engine needs the triton package")
    if device.type != "cuda" and not interpreting():
        raise RuntimeError("Triton kernels take CPU tensors only in the Triton interpreter: set TRITON_INTERPRET=1 "
                           "before triton is imported (the rollout engine runs on CUDA)")
