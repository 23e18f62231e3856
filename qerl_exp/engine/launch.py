"""Launch wrappers of the engine's Triton kernels other than the linears' (those are `linear`'s)
and decode attention's (`attention`'s): RMSNorm + LoRA shrink (`norm_shrink`), rope + KV-cache
write (`rope_cache`), the prefill's epilogue (`prefill_epilogue`), and what the launches ask of the
device (`sm_count`, `capability`, `require_device`).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from qerl_exp.engine import triton_kernels as tk
from qerl_exp.engine.triton_kernels import dummy_tensor, pow2, tl_dtype

try:  # CPU builds of torch ship without Triton; the engine then cannot be built (`require_device`)
    import triton
except ImportError:  # pragma: no cover - depends on the install
    triton = None


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
    if triton is None:
        raise RuntimeError("the rollout engine needs the triton package")
    if device.type != "cuda" and not tk.interpreting():
        raise RuntimeError("Triton kernels take CPU tensors only in the Triton interpreter: set TRITON_INTERPRET=1 "
                           "before triton is imported (the rollout engine runs on CUDA)")


def norm_shrink(x: Tensor, gamma: Tensor | None, eps: float, h_out: Tensor | None,
                a_tab: Tensor | None, nseg: int, r: int, t_out: Tensor | None,
                lora_dtype: torch.dtype | None = None, ss: Tensor | None = None, h16: bool = False,
                exact: bool = False) -> None:
    """Triton: h_out = RMSNorm(x) * gamma (if gamma given) and t_out += h @ A_s^T per segment.

    Args:
        x: [M, K] activations. gamma: [K] norm scale or None (no norm: the shrink reads x).
        h_out: [M, K] output of the norm (None when gamma is None and not h16).
        h16: h_out is fp16 and gets h / 16 (x / 16 without gamma): `nvfp4_wgmma`'s activations.
        a_tab: int64 [nseg] addresses of the LoRA A matrices ([r, K] each), or None (no LoRA).
        lora_dtype: dtype of those matrices (peft keeps adapters in fp32 under a bf16 base).
        exact: the dot runs in lora_dtype, as peft's (the prefill); else in x's dtype (decode).
        t_out: fp32 [M, >= nseg * R] accumulator, R = padded rank; must be zeroed by the caller.
        ss: fp32 [T, >= M]: partial sums of squares of x's rows (their sum over T is the row's
            sum), as `linear.fused_linear(ss_out=...)` writes them; None: each program sums its rows.
    """
    m, k = x.shape
    if a_tab is None:  # norm only
        nseg, r = 1, 0
    R = pow2(r)
    RT = pow2(nseg * R)
    # Up to 16 rows ~32 programs (4x more measured no faster, and more atomics); from 17 rows 16-row
    # blocks of 64 inputs, ~128 programs: 64-row blocks of 128 made 28 programs, and a 64-row NVFP4
    # decode step spent 1063 us in this kernel against 629 now (H200, `bench/profile/decode_step.py --batch
    # 64`, docs/engine.md). K slices need not divide K (the last is masked): dividing it cut 7B
    # down's 148 chunks into 4 slices, 28 us for its x / 16 at 64 rows
    wide = m > 16
    block_k = next((b for b in ((64,) if wide else (128, 64)) if k % b == 0), 32)
    # the prefill's thousands of rows: 64-row blocks, each program reading the A slices for 4x more
    block_m = 64 if m >= 2048 else 16
    m_blocks = triton.cdiv(m, block_m)
    chunks = triton.cdiv(k, block_k)
    per = triton.cdiv(chunks, max(1, min(chunks, (128 if wide else 32) // m_blocks)))
    split = triton.cdiv(chunks, per)
    dummy = dummy_tensor(x.device, x.dtype)
    f32 = dummy_tensor(x.device, torch.float32)
    tk._norm_shrink_kernel[(split, m_blocks)](
        x, x.stride(0), gamma if gamma is not None else dummy,
        h_out if h_out is not None else dummy, h_out.stride(0) if h_out is not None else 0,
        a_tab if a_tab is not None else dummy_tensor(x.device, torch.int64),
        t_out if t_out is not None else f32, t_out.stride(0) if t_out is not None else 0,
        ss if ss is not None else f32, ss.stride(0) if ss is not None else 0,
        m, k, r, eps, per * block_k, ss.shape[0] if ss is not None else 1,
        NORM=gamma is not None, LORA=a_tab is not None, NSEG=nseg, R=R, RT=RT,
        LDT=tl_dtype(lora_dtype or x.dtype), T_PAD=pow2(ss.shape[0] if ss is not None else 1, 1),
        BLOCK_M=block_m, BLOCK_K=block_k, H16=h16, SS_HERE=gamma is not None and ss is None, EXACT=exact,
        num_warps=4,
    )


def rope_cache(qkv: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, slot: Tensor, q_out: Tensor,
               k_cache: Tensor, v_cache: Tensor, hq: int, hkv: int, d: int, p: int = 1,
               qk_norm: tuple[Tensor, Tensor, float] | None = None) -> None:
    """Triton: rotate q and k of p tokens per sequence; write k, v into the cache from `slot` on.

    Args:
        qkv: [B * p, (hq + 2 hkv) * d] fused projection output, each sequence's p rows together.
            cos/sin: [S_max, d] tables.
        pos: int [B * p] rotary position per row. slot: int [1] cache index of each sequence's first
            row (decode: its one token; the prefill: 0, with p its prompt length).
        q_out: [B, hq, p, d]. k_cache / v_cache: [B_max, hkv, S_max, d] (batch rows 0..B-1 used).
        qk_norm: (q scale [d], k scale [d], eps): each head's q and k RMS-normalised before the
            rotation (Qwen3); None: none.
    """
    rows = qkv.shape[0]
    qn, kn, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)
    tk._rope_cache_kernel[(rows, hq + 2 * hkv)](
        qkv, qkv.stride(0), cos, sin, pos, slot, q_out,
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), qn, kn, eps,
        hq, hkv, p, D=d, HALF=d // 2, QK_NORM=qk_norm is not None, num_warps=1,
    )


def prefill_epilogue(y: Tensor, out: Tensor, *, t: Tensor | None = None, b: Tensor | None = None,
                     scale: float = 0.0, y2: Tensor | None = None, t2: Tensor | None = None,
                     b2: Tensor | None = None, scale2: float = 0.0, residual: Tensor | None = None) -> Tensor:
    """Triton: what a prefill linear adds to its cuBLAS base output, in one pass over it.

    out = y + scale * t @ b^T, summed in fp32 and rounded once (peft's LoRA under a bf16 base, as
    peft's addmm); with y2 (GLU: y gate, y2 up) out = silu(that) * (y2 + scale2 *
    t2 @ b2^T), each rounded where HF rounds; with residual, + residual after rounding.

    Args:
        y, y2: [M, N] base outputs (model dtype, rows contiguous, the same stride).
        t, t2: [M, r] LoRA shrinks (adapter dtype, the same stride); b, b2: [N, r] LoRA B,
            contiguous. None: no LoRA.
        residual: [M, N], may alias out. out: [M, N] (a column slice of a wider buffer is fine).
    """
    m, n = y.shape
    r = b.shape[1] if b is not None else 0
    dummy = y if t is None else t
    block_n = 128 if n >= 128 else pow2(n)
    tk._prefill_epilogue_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, 32))](
        y, y2 if y2 is not None else y, y.stride(0), dummy, t2 if t2 is not None else dummy,
        t.stride(0) if t is not None else 0, b if b is not None else dummy, b2 if b2 is not None else dummy,
        scale, scale2, residual if residual is not None else y, residual.stride(0) if residual is not None else 0,
        out, out.stride(0), m, n, max(r, 1),
        GLU=y2 is not None, HAS_RES=residual is not None, R=pow2(r) if r else 0, BLOCK_M=32, BLOCK_N=block_n,
        num_warps=4,
    )
    return out
