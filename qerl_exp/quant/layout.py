"""Kernel weight layouts: 4-bit weights as the engine's kernels read them (`KernelWeight`), decoded
back by a torch reference (`dequantize_layout`) and, into a dense weight, by `weight_of` (on the GPU
through the NVFP4 dequantize kernel).

The layouts are built once per linear at engine-build time from the model's own 4-bit
codes (`relayout_nvfp4`, `relayout_nf4`). Only the 4-bit codes and their scales are kept:
- E2M1 bytes (NVFP4, MXFP4): the two nibbles of a byte are bit-permuted so that each becomes an
  FP8 E4M3 number with one mask (low: `c & 0x9C`; high: `(c << 2) & 0x8C | (c >> 2) & 0x10`) whose
  value is e2m1 * 2^-6 (E2M1's one subnormal, 0.5, lands on an E4M3 subnormal: exact). On the GPU
  four bytes at a time become eight fp16 with `cvt.rn.f16x2.e4m3x2` (inline PTX).
- NVFP4 ("mma fragments"): a chunk of 64 inputs of row n holds 32 bytes; byte j has W[n, 64g + j]
  low and W[n, 64g + 32 + j] high. `codes` uint8 [N/16, K/64, 512]: the 16 rows x 32 bytes of
  (row block, chunk) in the order of mma.sync's A fragments, so that each of a warp's 32 threads
  reads the 16 bytes it multiplies with one 16-byte load: byte 16 * lane + reg, lane = 4 r + c,
  reg = 8 b3 + 4 b2 + 2 b1 + b0, is row 8 b1 + r, j = 16 b3 + 8 b2 + 2 c + b0. `scales` int32
  [N/16, K/64, 16]: entry 2 r + b3 = four E4M3 block scales, byte 2 h + b1 = block 2 h + b3 of row
  8 b1 + r (the low nibbles' block b3, then the high ones' block 2 + b3, for the thread's two rows:
  each 16-bit half converts straight into the fp16 pair the decode multiplies with). A warp streams
  its rows' K slice from one contiguous run. `out_scale` = tensor scale.
- MXFP4 ("k32"): `codes` uint8 [K/32, N, 16] (low = W[n, 32g + j], high = W[n, 32g + 16 + j]),
  `scales` uint8 E8M0 [K/32, N], `out_scale` 1.
- NF4 ("k32"): plain nibbles (low = first), `scales` float32 [K/64, N] (absmax, double quant undone
  at build time), `lut` the 16 NF4 levels.
Storage: 4.5 bits per weight for both (bitsandbytes' own NF4 with double quant: 4.127).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from qerl_exp.quant import fp4_decode


@dataclass
class KernelWeight:
    """A 4-bit weight [n, k] in the kernel layout (see the module docstring).

    Args:
        fmt: "nvfp4", "mxfp4" or "nf4".
        codes: nvfp4: uint8 [n // 16, k // 64, 512] (mma fragment order); mxfp4, nf4: uint8
            [k // 32, n, 16].
        scales: nvfp4: int32 [n // 16, k // 64, 16] (four E4M3 bytes); mxfp4: uint8 E8M0
            [k // 32, n]; nf4: float32 [k // 64, n].
        out_scale: multiplies every output (the NVFP4 tensor scale; 1.0 for NF4).
        n: output features.
        k: input features.
        lut: NF4 levels, float32 [16]; None for NVFP4.
    """

    fmt: str
    codes: Tensor
    scales: Tensor
    out_scale: float
    n: int
    k: int
    lut: Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * self.scales.element_size()

    def dequantize(self) -> Tensor:
        """The weight as float32 [n, k], decoded exactly as the kernel decodes it."""
        return dequantize_layout(self)


def _to_chunks(nib: Tensor, fmt: str, chunk: int) -> Tensor:
    """nibbles uint8 [n, k] -> kernel codes uint8 [k // chunk, n, chunk // 2] (low half, high half)."""
    n, k = nib.shape
    if k % chunk:
        raise ValueError(f"in_features={k} must be a multiple of {chunk} for the {fmt} kernels")
    g = nib.reshape(n, k // chunk, 2, chunk // 2)
    lo, hi = g[:, :, 0, :], g[:, :, 1, :]
    if fmt in ("nvfp4", "mxfp4"):
        byte = ((lo >> 3) << 7) | ((lo & 7) << 2) | ((hi >> 3) << 5) | (((hi >> 2) & 1) << 6) | (hi & 3)
    else:
        byte = lo | (hi << 4)
    return byte.permute(1, 0, 2).contiguous()


def _e2m1_halves(c: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel's bit tricks on permuted E2M1 bytes: (low, high) elements as float32 * 2^-6."""
    lo = (c & 0x9C).view(torch.float8_e4m3fn).float()
    hi = (((c << 2) & 0x8C) | ((c >> 2) & 0x10)).view(torch.float8_e4m3fn).float()
    return lo, hi


def relayout_nvfp4(codes: Tensor, block_scales: Tensor, tensor_scale: Tensor | float,
                   fmt: str = "nvfp4") -> KernelWeight:
    """Convert the FP4 storage layout of `qerl_exp.quant.fp4` to the kernel layout.

    Args:
        codes: uint8 [out, in // 2]. block_scales: NVFP4 float8_e4m3fn [out, in // 16], or MXFP4
            uint8 E8M0 [out, in // 32]. tensor_scale: fp32 scalar (1 for MXFP4).
        fmt: "nvfp4" or "mxfp4".
    """
    n = codes.shape[0]
    nib = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(n, -1)
    k = nib.shape[1]
    if fmt == "nvfp4":
        sc = block_scales.view(torch.uint8).reshape(n, -1, 4)
        if sc.shape[1] * 64 != k:
            raise ValueError(f"in_features={k} must be a multiple of 64 for the nvfp4 kernels")
        if n % 16:
            raise ValueError(f"out_features={n} must be a multiple of 16 for the nvfp4 kernels")
        g = k // 64
        byte = _to_chunks(nib, fmt, 64).view(g, n // 16, 2, 8, 2, 2, 4, 2)  # (chunk, rb, b1, r, b3, b2, c, b0)
        codes = byte.permute(1, 0, 3, 6, 4, 5, 2, 7).reshape(n // 16, g, 512)
        sb = sc.view(n // 16, 2, 8, g, 2, 2)  # (rb, b1, r, chunk, h, b3): block 2 h + b3
        scales = sb.permute(0, 3, 2, 5, 4, 1).reshape(n // 16, g, 16, 4).contiguous().view(torch.int32).squeeze(-1)
        return KernelWeight(fmt, codes.contiguous(), scales.contiguous(), float(tensor_scale), n, k)
    return KernelWeight(fmt, _to_chunks(nib, fmt, 32), block_scales.t().contiguous(), float(tensor_scale), n, k)


def relayout_nf4(weight_deq: Tensor, absmax: Tensor, lut: Tensor, blocksize: int = 64) -> KernelWeight:
    """Kernel layout of a bitsandbytes NF4 weight, recovered from its own dequantization.

    Reading the codes back from `dequantize_4bit`'s output (nearest NF4 level of W / absmax) makes
    this independent of bitsandbytes' byte order and of its CPU repacking.

    Args:
        weight_deq: bitsandbytes' dequantized weight [n, k].
        absmax: float32 absmax per block of `blocksize` consecutive elements (double quant undone).
        lut: the 16 NF4 levels (quant_state.code).
        blocksize: elements per absmax; must be 64 (the kernel reads one absmax per two k-groups).
    """
    if blocksize != 64:
        raise ValueError(f"NF4 blocksize {blocksize} is not supported by the kernel (needs 64)")
    n, k = weight_deq.shape
    am = absmax.float().reshape(n, k // 64)
    ratio = weight_deq.float().reshape(n, k // 64, 64) / am.unsqueeze(-1).clamp_min(1e-30)
    levels, order = lut.float().to(weight_deq.device).sort()
    nib = order[torch.bucketize(ratio, (levels[1:] + levels[:-1]) / 2)].to(torch.uint8)
    zero_idx = int(lut.float().abs().argmin())
    nib = torch.where((am == 0).unsqueeze(-1), torch.full_like(nib, zero_idx), nib).reshape(n, k)
    levels = lut.float().to(weight_deq.device)
    return KernelWeight(
        fmt="nf4",
        codes=_to_chunks(nib, "nf4", 32),
        scales=am.t().contiguous(),
        out_scale=1.0,
        n=n,
        k=k,
        lut=levels.contiguous(),
    )


def dequantize_layout(pw: KernelWeight) -> Tensor:
    """Float32 [n, k] from the kernel layout, with the kernel's own bit tricks (reference twin)."""
    c = pw.codes  # [G, n, chunk / 2]
    if pw.fmt == "nvfp4":  # back from fragment order (see the module docstring)
        nb, g = pw.n // 16, pw.k // 64
        c = pw.codes.view(nb, g, 8, 4, 2, 2, 2, 2).permute(1, 0, 6, 2, 4, 5, 3, 7).reshape(g, pw.n, 32)
        vals = torch.stack(_e2m1_halves(c), dim=2) * 64.0  # [G, n, 2, 32] e2m1 values
        sb = pw.scales.contiguous().view(torch.uint8).view(nb, g, 8, 2, 2, 2)  # (rb, chunk, r, b3, h, b1)
        sc = sb.permute(0, 5, 2, 1, 4, 3).reshape(pw.n, g, 4)  # block 2 h + b3 of row 16 rb + 8 b1 + r
        scale = sc.view(torch.float8_e4m3fn).float().reshape(pw.n, -1, 2, 2, 1)  # [n, G, half, block, 1]
        w = vals.permute(1, 0, 2, 3).reshape(pw.n, -1, 2, 2, 16) * scale
        return w.reshape(pw.n, pw.k) * pw.out_scale
    if pw.fmt == "mxfp4":
        vals = torch.stack(_e2m1_halves(c), dim=2) * 64.0  # [G, n, 2, 16]
        scale = torch.exp2(pw.scales.float().t() - 127.0).reshape(pw.n, -1, 1, 1)
        w = vals.permute(1, 0, 2, 3) * scale
        return w.reshape(pw.n, pw.k) * pw.out_scale
    lut = pw.lut.to(c.device)
    vals = torch.stack([lut[(c & 15).long()], lut[(c >> 4).long()]], dim=2)  # [G, n, 2, 16]
    w = vals.permute(1, 0, 2, 3).reshape(pw.n, pw.k // 64, 64)
    return (w * pw.scales.t().unsqueeze(-1)).reshape(pw.n, pw.k) * pw.out_scale


def weight_of(w: Tensor | KernelWeight, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """A usable [n, k] weight: the referenced tensor itself, or the 4-bit one dequantized.

    `out`: a flat buffer of at least n * k elements to dequantize NVFP4 weights into on the GPU
    (prefill reuses one for every linear instead of allocating each weight anew).
    """
    if not isinstance(w, KernelWeight):
        return w
    if w.fmt == "nvfp4" and w.codes.is_cuda and fp4_decode.HAS_TRITON:
        dst = torch.empty(w.n, w.k, dtype=dtype, device=w.codes.device) if out is None else \
            out[: w.n * w.k].view(w.n, w.k)
        return stacked_weight([w], dst)
    return dequantize_layout(w).to(dtype)


def stacked_weight(ws: list[KernelWeight], out: Tensor) -> Tensor:
    """NVFP4 weights of one input width (kernel layout, on CUDA), at most three, dequantized into
    `out` [sum of n, k] one after another by rows, in one launch."""
    if not 1 <= len(ws) <= 3 or any(w.fmt != "nvfp4" or w.k != ws[0].k for w in ws):
        raise ValueError("stacked_weight takes one to three NVFP4 weights of one input width")
    bn = math.gcd(64, *(w.n for w in ws))
    bounds = list(itertools.accumulate(w.n // bn for w in ws))
    b1, b2 = (bounds + [bounds[-1]] * 2)[:2]
    a, b, c = (ws + [ws[-1]] * 2)[:3]
    fp4_decode._nvfp4_dequant_kernel[(bounds[-1], ws[0].k // 64)](
        a.codes, a.scales, b.codes, b.scales, c.codes, c.scales, out, ws[0].k, a.out_scale, b.out_scale,
        c.out_scale, b1, b2, ASM=not fp4_decode.interpreting(), BLOCK_N=bn)
    return out


def nf4_lut(device: torch.device | str = "cpu") -> Tensor:
    """The 16 NF4 levels (QLoRA), float32."""
    levels = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
              -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
              0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
              0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]
    return torch.tensor(levels, dtype=torch.float32, device=device)
