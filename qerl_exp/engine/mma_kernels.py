"""The NVFP4 tensor-core path for 16-256 rows (`_nvfp4_mma_kernel`), its tile table and launch, and
the dequantize + cuBLAS fallback that `dispatch` picks where neither 4-bit kernel beats it.

`_nvfp4_mma_kernel` is the base product x @ W^T of one fused linear (up to three segments side by
side, as `_splitk_kernel`): each program owns a [BLOCK_N, BLOCK_M] output tile and one K slice,
streams BLOCK_K inputs a step (one or two 64-input NVFP4 chunks) through a `num_stages`-deep software
pipeline (Triton's: the loads of later steps are issued before the current step's dot), decodes the
codes in registers with `triton_kernels._nvfp4_chunk` (E2M1 x E4M3 block scale into exact fp16, inline
PTX on the GPU), and multiplies with `tl.dot` (wgmma on Hopper) with the weight tile as the wide
operand and x' / 16 as the narrow one, accumulating in fp32. The m blocks of one weight tile have
adjacent program ids, so a weight tile read from HBM by one is an L2 hit for the others. K slices go
to the shared fp32 workspace; the same raw `_linear_kernel` epilogue as `_splitk_kernel`'s sums them
and applies the tensor scale, bias, LoRA expand, GLU, residual, next shrink and sums of squares. The
RMSNorm and the LoRA shrink run before it in one `norm_shrink` launch (on load, every program would
renormalise its whole [BLOCK_M, K] activation slice).

The fallback dequantizes each segment with `layout.weight_of` (its tensor scale replaced by 2^-10
so the epilogue's output scale, which undoes the kernels' 2^-6 and 1/16, applies unchanged), has
cuBLAS multiply in the model dtype, and copies the product into the workspace for that epilogue.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from qerl_exp.engine import triton_kernels as tk
from qerl_exp.engine.layout import weight_of

try:  # CPU builds of torch ship without Triton (the engine then runs its torch twins)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

# Tiles by rows (the first row whose bound is >= M): BLOCK_M rows of x a program; BLOCK_N weight rows
# (the wgmma M side: 64 a warpgroup); BLOCK_K inputs a pipeline step (64 or 128). `dispatch.json`
# overrides them per shape with what `bench/kernels.py --sweep` measured fastest.
TILES = (
    (16, dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4)),
    (32, dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4)),
    (64, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)),
    (128, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)),
    (256, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)),
)
WAVES = 2  # split K until the launch has this many programs per SM (tiles of this size fit 1-2 an SM)

if tk.HAS_TRITON:

    @triton.jit
    def _nvfp4_mma_kernel(
        x_ptr, stride_xm, tab_ptr, ws_ptr, stride_wm, stride_ws,
        M, K, N1, N2, STEPS, SPLIT,
        NSEG: tl.constexpr, ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # ws[pid_k][m, n] = x[m, slice] @ W[n, slice]^T in units of 2^-6 / 16 (as `_splitk_kernel`),
        # slice = STEPS steps of BLOCK_K inputs. Program ids: m block fastest, then K slice, then
        # the n tile (the programs sharing a weight tile run side by side).
        p = tl.program_id(0)
        mb = tl.cdiv(M, BLOCK_M)
        pid_m = p % mb
        pid_k = (p // mb) % SPLIT
        n0 = (p // (mb * SPLIT)) * BLOCK_N
        seg, start = tk._segment(n0, N1, N2, NSEG)
        c_ptr, s_ptr, _ = tk._seg_ptrs(tab_ptr, seg, 1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        x_rows = x_ptr + offs_m[:, None] * stride_xm + tl.arange(0, 32)[None, :]
        G = K // 64
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for step in tl.range(pid_k * STEPS, (pid_k + 1) * STEPS):
            for c in tl.static_range(BLOCK_K // 64):
                g = step * (BLOCK_K // 64) + c
                x_lo = tk._f16_div16(tl.load(x_rows + g * 64, mask=m_ok[:, None], other=0.0))
                x_hi = tk._f16_div16(tl.load(x_rows + g * 64 + 32, mask=m_ok[:, None], other=0.0))
                w_lo, w_hi = tk._nvfp4_chunk(c_ptr, s_ptr, G, g, n0 - start, ASM, BLOCK_N)
                acc = tl.dot(w_lo, tl.trans(x_lo), acc)
                acc = tl.dot(w_hi, tl.trans(x_hi), acc)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        tl.store(ws_ptr + pid_k * stride_ws + offs_m[None, :] * stride_wm + offs_n[:, None], acc, mask=m_ok[None, :])


def mma_config(m: int, total_n: int, k: int, seg_gcd: int, sms: int, split_max: int,
               tiles: dict | None = None) -> dict:
    """Tiles and K split of `_nvfp4_mma_kernel` for m rows of a [total_n, k] launch.

    Args:
        m: rows. total_n: output columns of the launch (gate and up together for GLU). k: inputs.
        seg_gcd: gcd of the segment widths (a tile never straddles two).
        sms: multiprocessors; K is split (powers of two, at most `split_max`, whole steps a slice)
            until the launch has `WAVES` programs per SM.
        tiles: BLOCK_M / BLOCK_N / BLOCK_K / num_warps / num_stages instead of `TILES`' row
            (a `dispatch.json` entry); SPLIT too, else it is derived as above.

    Returns:
        The launch's constexprs and options, with SPLIT.
    """
    cfg = dict(next((t for bound, t in TILES if m <= bound), TILES[-1][1]))
    cfg.update(tiles or {})
    cfg["BLOCK_N"] = math.gcd(cfg["BLOCK_N"], seg_gcd)
    if k % cfg["BLOCK_K"]:
        cfg["BLOCK_K"] = 64
    if "SPLIT" not in cfg:
        programs = (total_n // cfg["BLOCK_N"]) * -(-m // cfg["BLOCK_M"])
        steps, split = k // cfg["BLOCK_K"], 1
        while split < split_max and programs * split < WAVES * sms and steps % (2 * split) == 0:
            split *= 2
        cfg["SPLIT"] = split
    return cfg


def launch_mma(plan, x: Tensor, cfg: dict) -> int:
    """`_nvfp4_mma_kernel` over x [M, K] into `plan.workspace`; returns the number of K slices.

    Args:
        plan: an NVFP4 `launch.LinearPlan` with its workspace.
        x: [M, K] activations (already normalised where the linear reads RMSNorm(x)).
        cfg: `mma_config`'s dict.
    """
    m = x.shape[0]
    ws = plan.workspace
    total = plan.n * (2 if plan.glu else 1)
    split, bk = cfg["SPLIT"], cfg["BLOCK_K"]
    if plan.k % bk or (plan.k // bk) % split or total % cfg["BLOCK_N"] or split > ws.shape[0]:
        raise ValueError(f"tiles {cfg} do not fit a {plan.k} x {total} NVFP4 launch")
    consts = {key: v for key, v in cfg.items() if key != "SPLIT"}
    grid = ((total // cfg["BLOCK_N"]) * split * triton.cdiv(m, cfg["BLOCK_M"]),)
    _nvfp4_mma_kernel[grid](
        x, x.stride(0), plan.tab, ws, ws.stride(1), ws.stride(0),
        m, plan.k, plan.n1, plan.n2, plan.k // bk // split, split,
        NSEG=plan.nseg, ASM=not tk.interpreting(), **consts,
    )
    return split


def launch_dequant(plan, x: Tensor) -> int:
    """The fallback: each segment dequantized (x 2^-10), x @ W^T by cuBLAS, into workspace slice 0.

    Returns 1 (one K slice) for the epilogue launch.
    """
    m = x.shape[0]
    ws = plan.workspace
    col = 0
    for w in plan.packed:
        deq = weight_of(dataclasses.replace(w, out_scale=2.0**-10), x.dtype)
        ws[0, :m, col:col + w.n].copy_(torch.mm(x, deq.t()))
        col += w.n
    return 1
