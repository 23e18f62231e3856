"""Weight-only 4-bit kernels and fused decode ops (Triton), each with a torch twin.

The torch twins define what every kernel computes and run anywhere (CPU tests, prefill, machines
without Triton); the Triton kernels are the fast path for decode shapes (M = 1..256 rows).

Kernel weight layouts, built once per linear at engine-build time from the model's own packed
data (`relayout_nvfp4`, `relayout_nf4`). Only the 4-bit codes and their scales are kept:
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

import functools
import math
import os
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

if not torch.cuda.is_available():  # without a GPU, Triton kernels can only run interpreted (tests)
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # CPU builds of torch ship without Triton; everything below has a torch twin.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    HAS_TRITON = False

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FORMATS = ("dense", "nvfp4", "nf4", "mxfp4", "raw")
_FMT_ID = {"dense": 0, "nvfp4": 1, "nf4": 2, "mxfp4": 3, "raw": 4}


# ---------------------------------------------------------------------------------------------
# Layouts (build time) and their torch reference decoders
# ---------------------------------------------------------------------------------------------


@dataclass
class PackedWeight:
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
        return dequantize_packed(self)


def e2m1_to_float(nibbles: Tensor) -> Tensor:
    """Decode E2M1 nibbles (sign << 3 | magnitude index) to float32."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=nibbles.device)
    mag = table[(nibbles & 7).long()]
    return torch.where((nibbles & 8) != 0, -mag, mag)


def nvfp4_dequantize(codes: Tensor, block_scales: Tensor, tensor_scale: Tensor | float) -> Tensor:
    """Dequantize the NVFP4 storage layout of `qerl_exp.quant` to float32 [out, in].

    Args:
        codes: uint8 [out, in // 2]; element 2j in the low nibble, 2j + 1 in the high nibble.
        block_scales: float8_e4m3fn [out, in // 16].
        tensor_scale: fp32 scalar.
    """
    n = codes.shape[0]
    nib = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(n, -1)
    scale = block_scales.float().repeat_interleave(16, dim=1)
    return e2m1_to_float(nib) * scale * float(tensor_scale)


def quantize_nvfp4_reference(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Round-to-nearest NVFP4 packing in the storage layout (DESIGN.md 2.1), for tests and benches.

    The harness' own quantizer is `qerl_exp.quant`; this twin only has to produce valid data.

    Returns:
        (codes uint8 [out, in // 2], block_scales float8_e4m3fn [out, in // 16], tensor_scale fp32 [])
    """
    w = weight.float()
    n, k = w.shape
    if k % 16:
        raise ValueError(f"in_features={k} is not a multiple of 16")
    amax = w.abs().amax()
    s_t = (amax / (6.0 * 448.0)).clamp_min(torch.finfo(torch.float32).tiny)
    blocks = w.reshape(n, k // 16, 16)
    s_b = (blocks.abs().amax(-1) / (6.0 * s_t)).to(torch.float8_e4m3fn)
    denom = (s_b.float() * s_t).unsqueeze(-1)
    v = torch.where(denom > 0, blocks / denom, torch.zeros_like(blocks))
    a = v.abs().clamp(max=6.0)
    grid = torch.tensor(E2M1_VALUES, device=w.device)
    mids = (grid[1:] + grid[:-1]) / 2
    idx = torch.zeros_like(a, dtype=torch.uint8)
    for i, m in enumerate(mids.tolist()):  # ties go to the even index (mantissa bit 0)
        up = (a > m) | ((a == m) & ((i + 1) % 2 == 0))
        idx += up.to(torch.uint8)
    nib = (idx | ((v < 0) & (idx > 0)).to(torch.uint8) << 3).reshape(n, k)
    codes = (nib[:, 0::2] | (nib[:, 1::2] << 4)).contiguous()
    return codes, s_b.contiguous(), s_t.float().reshape(())


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
                   fmt: str = "nvfp4") -> PackedWeight:
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
        return PackedWeight(fmt, codes.contiguous(), scales.contiguous(), float(tensor_scale), n, k)
    return PackedWeight(fmt, _to_chunks(nib, fmt, 32), block_scales.t().contiguous(), float(tensor_scale), n, k)


def relayout_nf4(weight_deq: Tensor, absmax: Tensor, lut: Tensor, blocksize: int = 64) -> PackedWeight:
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
    return PackedWeight(
        fmt="nf4",
        codes=_to_chunks(nib, "nf4", 32),
        scales=am.t().contiguous(),
        out_scale=1.0,
        n=n,
        k=k,
        lut=levels.contiguous(),
    )


def dequantize_packed(pw: PackedWeight) -> Tensor:
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


def e2m1x4_asm(code: int, scale: int, scale_word: bool = False) -> str:
    """Inline PTX: four permuted E2M1 bytes (operand $code) -> eight fp16, low elements $0 $1 and
    high ones $2 $3, each times its block scale: fp16 pairs in $scale .. $scale + 3, or with
    `scale_word` one int32 $scale of four E4M3 scales (the layout's scale entry: the low elements'
    scale for $0 and for $1, then the high ones' for $2 and $3). Bit masks, then Hopper's
    e4m3x2 -> f16x2 conversion."""
    if scale_word:
        scales = f"""
    .reg .b32 slo, shi, s0, s1, s2, s3;
    .reg .b16 w0, w1, u0, u1, v0, v1;
    mov.b32 {{w0, w1}}, ${scale};
    cvt.rn.f16x2.e4m3x2 slo, w0;
    cvt.rn.f16x2.e4m3x2 shi, w1;
    mov.b32 {{u0, u1}}, slo;
    mov.b32 {{v0, v1}}, shi;
    mov.b32 s0, {{u0, u0}};
    mov.b32 s1, {{u1, u1}};
    mov.b32 s2, {{v0, v0}};
    mov.b32 s3, {{v1, v1}};"""
        s = ["s0", "s1", "s2", "s3"]
    else:
        scales = ""
        s = [f"${scale + i}" for i in range(4)]
    return f"""
    {{
    .reg .b32 lo, hi, t;
    .reg .b16 l0, l1, h0, h1;
    and.b32 lo, ${code}, 0x9C9C9C9C;
    shl.b32 t, ${code}, 2;
    and.b32 hi, t, 0x8C8C8C8C;
    shr.b32 t, ${code}, 2;
    and.b32 t, t, 0x10101010;
    or.b32 hi, hi, t;
    mov.b32 {{l0, l1}}, lo;
    mov.b32 {{h0, h1}}, hi;{scales}
    cvt.rn.f16x2.e4m3x2 $0, l0;
    cvt.rn.f16x2.e4m3x2 $1, l1;
    cvt.rn.f16x2.e4m3x2 $2, h0;
    cvt.rn.f16x2.e4m3x2 $3, h1;
    mul.rn.f16x2 $0, $0, {s[0]};
    mul.rn.f16x2 $1, $1, {s[1]};
    mul.rn.f16x2 $2, $2, {s[2]};
    mul.rn.f16x2 $3, $3, {s[3]};
    }}
    """


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _dot(a, b, acc):
        # tl.dot, exact for fp32 operands (Triton's default there is TF32: a 10-bit mantissa)
        if a.dtype == tl.float32:
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _f16_div16(x):
        # x / 16 in fp16 (the fp16 dots' activations): scaled in x's own dtype (exact for bf16),
        # then one conversion. Written as (x.to(fp32) * 0.0625).to(fp16), the compiler emitted
        # "round to fp16, then scale" (seen in the sm_90 PTX): inf from |x| = 65520 on.
        return (x * 0.0625).to(tl.float16)

    @triton.jit
    def _norm_shrink_kernel(
        x_ptr, stride_xm, g_ptr, h_ptr, stride_hm, a_tab_ptr, t_ptr, stride_tm, ss_ptr, stride_ss,
        M, K, r, eps, KCHUNK, T,
        NORM: tl.constexpr, LORA: tl.constexpr, NSEG: tl.constexpr, R: tl.constexpr, RT: tl.constexpr,
        LDT: tl.constexpr, T_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # h = RMSNorm(x) * g (HF rounding), written to h, with the rows' sums of squares given as
        # T partial sums ss[:T, m] (written by the residual epilogue that produced x, so no program
        # has to read whole rows); t[:, s*R + j] += h @ A_s[j]^T over this program's K chunk
        # (split-K with fp32 atomics; t is zeroed once per decode step).
        ACT = x_ptr.dtype.element_ty
        pid_k = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        if NORM:
            rstd = _rstd(ss_ptr, stride_ss, T, offs_m, m_ok, K, eps, T_PAD)
        jj = tl.arange(0, RT)
        seg = jj // R
        j_ok = (seg < NSEG) & ((jj % R) < r)
        a_row = tl.multiple_of(tl.load(a_tab_ptr + seg, mask=seg < NSEG, other=0).to(tl.pointer_type(LDT)), 16)
        a_row = a_row + (jj % R) * K
        acc = tl.zeros((BLOCK_M, RT), tl.float32)
        for k0 in range(pid_k * KCHUNK, pid_k * KCHUNK + KCHUNK, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if NORM:
                hn = (x.to(tl.float32) * rstd[:, None]).to(ACT)
                gam = tl.load(g_ptr + offs_k, mask=k_ok, other=0.0)
                x = (gam[None, :].to(tl.float32) * hn.to(tl.float32)).to(ACT)
                tl.store(h_ptr + offs_m[:, None] * stride_hm + offs_k[None, :], x,
                         mask=m_ok[:, None] & k_ok[None, :])
            if LORA:
                a = tl.load(a_row[None, :] + offs_k[:, None], mask=j_ok[None, :] & k_ok[:, None], other=0.0)
                acc = _dot(x, a.to(ACT), acc)
        if LORA:
            tl.atomic_add(t_ptr + offs_m[:, None] * stride_tm + jj[None, :], acc,
                          mask=m_ok[:, None] & j_ok[None, :])

    @triton.jit
    def _rstd(ss_ptr, stride_ss, T, offs_m, m_ok, K, eps, T_PAD: tl.constexpr):
        # 1 / RMS of rows offs_m from T partial sums of squares ss[:T, m] (written by the residual
        # epilogue that produced the rows, so no program has to read whole rows)
        tt = tl.arange(0, T_PAD)
        ssp = tl.load(ss_ptr + tt[:, None] * stride_ss + offs_m[None, :], mask=(tt[:, None] < T) & m_ok[None, :],
                      other=0.0)
        return tl.rsqrt(tl.sum(ssp, 0) / K + eps)

    @triton.jit
    def _x_tile(x_ptr, stride_xm, offs_m, m_ok, offs_k, g_ptr, rstd, NORM: tl.constexpr):
        # activations [BM, BK] in the model dtype; NORM: RMSNorm(x) * gamma, rounded where HF rounds
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None], other=0.0)
        if NORM:
            ACT = x_ptr.dtype.element_ty
            hn = (x.to(tl.float32) * rstd[:, None]).to(ACT)
            x = (tl.load(g_ptr + offs_k)[None, :].to(tl.float32) * hn.to(tl.float32)).to(ACT)
        return x

    @triton.jit
    def _segment(n0, N1, N2, NSEG: tl.constexpr):
        # (segment, its first column) of output column n0 when up to three segments sit side by
        # side: [0, N1), [N1, N2), [N2, ...). Tiles never straddle a boundary (BLOCK_N | seg_gcd).
        if NSEG == 1:
            seg = n0 * 0
            start = n0 * 0
        elif NSEG == 2:
            seg = (n0 >= N1).to(tl.int32)
            start = tl.where(n0 >= N1, N1, 0)
        else:
            seg = (n0 >= N1).to(tl.int32) + (n0 >= N2).to(tl.int32)
            start = tl.where(n0 >= N2, N2, tl.where(n0 >= N1, N1, 0))
        return seg, start

    @triton.jit
    def _tab(tab_ptr, i):
        # A size or an address from a plan table. `make_plan` checks that both are multiples of 16:
        # with the hint, loads through them become 16-byte vector loads.
        return tl.multiple_of(tl.load(tab_ptr + i), 16)

    @triton.jit
    def _tab_ptr(tab_ptr, i, DT: tl.constexpr):
        return tl.multiple_of(tl.load(tab_ptr + i).to(tl.pointer_type(DT)), 16)

    @triton.jit
    def _seg_ptrs(tab_ptr, seg, FMT: tl.constexpr):
        # (codes, scales, rows) of segment `seg` for a 4-bit format; scales as the layout stores
        # them: NVFP4 int32 (four E4M3 bytes), NF4 float32 absmax, MXFP4 uint8 E8M0
        code_ptr = _tab_ptr(tab_ptr, seg * 8, tl.uint8)
        if FMT == 1:
            sc_ptr = _tab_ptr(tab_ptr, seg * 8 + 1, tl.int32)
        elif FMT == 2:
            sc_ptr = _tab_ptr(tab_ptr, seg * 8 + 1, tl.float32)
        else:
            sc_ptr = _tab_ptr(tab_ptr, seg * 8 + 1, tl.uint8)
        return code_ptr, sc_ptr, _tab(tab_ptr, seg * 8 + 4)

    @triton.jit
    def _e2m1_to(c, DT: tl.constexpr):
        # permuted E2M1 bytes -> (low, high) elements in DT, in units of 2^-6 (module docstring)
        lo = (c & 0x9C).to(tl.float8e4nv, bitcast=True).to(DT)
        hi = (((c << 2) & 0x8C) | ((c >> 2) & 0x10)).to(tl.float8e4nv, bitcast=True).to(DT)
        return lo, hi

    @triton.jit
    def _nf4_tile(code_ptr, sc_ptr, nrows, g, rows, lut_ptr, jj, DT: tl.constexpr):
        # k-group g (32 inputs) of BLOCK_N NF4 weight rows, dequantized: (w_lo, w_hi), [BN, 16] each.
        c = tl.load(code_ptr + g * nrows * 16 + rows[:, None] * 16 + jj[None, :])
        am = tl.load(sc_ptr + (g // 2) * nrows + rows)
        w_lo = (tl.load(lut_ptr + (c & 15).to(tl.int32)) * am[:, None]).to(DT)
        w_hi = (tl.load(lut_ptr + (c >> 4).to(tl.int32)) * am[:, None]).to(DT)
        return w_lo, w_hi

    @triton.jit
    def _mxfp4_tile(code_ptr, sc_ptr, nrows, g, rows, jj, DT: tl.constexpr):
        # k-group g (32 inputs) of BLOCK_N MXFP4 weight rows, dequantized: (w_lo, w_hi), [BN, 16] each.
        c = tl.load(code_ptr + g * nrows * 16 + rows[:, None] * 16 + jj[None, :])
        e = tl.load(sc_ptr + g * nrows + rows).to(tl.float32)
        s = tl.exp2(e - 121.0).to(DT)  # 2^(e - 127) * 64
        lo, hi = _e2m1_to(c, DT)
        return lo * s[:, None], hi * s[:, None]

    @triton.jit
    def _mxfp4_tile3(code_ptr, sc_ptr, nrows, gidx, rows, jj, DT: tl.constexpr):
        # GB k-groups at once: (w_lo, w_hi), each [GB, BN, 16]; many independent loads in flight.
        c = tl.load(code_ptr + gidx[:, None, None] * nrows * 16 + rows[None, :, None] * 16 + jj[None, None, :])
        e = tl.load(sc_ptr + gidx[:, None] * nrows + rows[None, :]).to(tl.float32)
        sc = tl.exp2(e - 121.0).to(DT)[:, :, None]
        lo, hi = _e2m1_to(c, DT)
        return lo * sc, hi * sc

    _E2M1X4_TO_F16 = tl.constexpr(e2m1x4_asm(4, 5))

    @triton.jit
    def _e4m3_byte(word, b: tl.constexpr):
        return ((word >> (8 * b)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)

    @triton.jit
    def _nvfp4_chunk(c_ptr, s_ptr, G, g, row0, ASM: tl.constexpr, BLOCK_N: tl.constexpr):
        # One 64-input chunk g (of G) of BLOCK_N NVFP4 rows from row0 (a multiple of 16) as fp16
        # (w_lo, w_hi), each [BN, 32], in units of 2^-6 (exact: e2m1 * e4m3 needs 6 significant bits
        # and stays inside fp16's range).
        # The rows' 16-row blocks are read whole (contiguous) and their bytes put back in row order
        # in registers (the mma.sync kernel, `nvfp4_mma`, multiplies them in fragment order).
        blk = (row0 // 16 + tl.arange(0, BLOCK_N // 16)) * G + g
        c = tl.load(c_ptr + blk[:, None] * 512 + tl.arange(0, 512)[None, :])
        c = tl.permute(tl.reshape(c, (BLOCK_N // 16, 8, 4, 2, 2, 2, 2)), (0, 5, 1, 3, 4, 2, 6))
        c = tl.reshape(c, (BLOCK_N, 2, 16))  # [row 16 rb + 8 b1 + r, half b3, byte 8 b2 + 2 c + b0]
        word = tl.reshape(tl.load(s_ptr + blk[:, None] * 16 + tl.arange(0, 16)[None, :]), (BLOCK_N // 16, 8, 2))
        # byte 2 h + b1 of entry (r, b3): block 2 h + b3 of row 8 b1 + r -> [row, b3] per half h
        s_lo = tl.reshape(tl.permute(tl.join(_e4m3_byte(word, 0), _e4m3_byte(word, 1)), (0, 3, 1, 2)), (BLOCK_N, 2))
        s_hi = tl.reshape(tl.permute(tl.join(_e4m3_byte(word, 2), _e4m3_byte(word, 3)), (0, 3, 1, 2)), (BLOCK_N, 2))
        s_lo = tl.broadcast_to(s_lo[:, :, None], (BLOCK_N, 2, 16))
        s_hi = tl.broadcast_to(s_hi[:, :, None], (BLOCK_N, 2, 16))
        if ASM:
            w_lo, w_hi = tl.inline_asm_elementwise(
                asm=_E2M1X4_TO_F16, constraints="=r,=r,=r,=r,r,r,r,r,r", args=[c, s_lo, s_hi],
                dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:  # the interpreter cannot run PTX: the same bit tricks with Triton ops
            lo, hi = _e2m1_to(c, tl.float16)
            w_lo = lo * s_lo
            w_hi = hi * s_hi
        return tl.reshape(w_lo, (BLOCK_N, 32)), tl.reshape(w_hi, (BLOCK_N, 32))

    @triton.jit
    def _nvfp4_dequant_kernel(c_ptr, s_ptr, out_ptr, K, out_scale, ASM: tl.constexpr, BLOCK_N: tl.constexpr):
        # out[n, 64g + j] = W[n, 64g + j] in out's dtype, one (BLOCK_N rows, chunk g) tile a program
        # (prefill multiplies whole prompts, where dequantize + cuBLAS beats the decode kernel).
        g = tl.program_id(1)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        j = tl.arange(0, 32)
        w_lo, w_hi = _nvfp4_chunk(c_ptr, s_ptr, K // 64, g, tl.program_id(0) * BLOCK_N, ASM, BLOCK_N)
        dst = out_ptr + rows[:, None] * K + g * 64 + j[None, :]
        tl.store(dst, (w_lo.to(tl.float32) * (out_scale * 64.0)).to(out_ptr.dtype.element_ty))
        tl.store(dst + 32, (w_hi.to(tl.float32) * (out_scale * 64.0)).to(out_ptr.dtype.element_ty))

    @triton.jit
    def _lora_tile(tab_ptr, fsc_ptr, seg, rows, t_ptr, stride_tm, offs_m, m_ok, r,
                   R: tl.constexpr, ACT: tl.constexpr, LDT: tl.constexpr):
        # scaling * (t_seg @ B_seg[rows]^T): [BM, BN] fp32; t is rounded to the model dtype first,
        # as peft's lora_A output is.
        rr = tl.arange(0, R)
        b_ptr = _tab_ptr(tab_ptr, seg * 8 + 2, LDT)
        tt = tl.load(t_ptr + offs_m[:, None] * stride_tm + seg * R + rr[None, :],
                     mask=m_ok[:, None] & (rr[None, :] < r), other=0.0).to(ACT)
        bb = tl.load(b_ptr + rows[None, :] * r + rr[:, None], mask=rr[:, None] < r, other=0.0).to(ACT)
        return _dot(tt, bb, None) * tl.load(fsc_ptr + seg * 2)

    @triton.jit
    def _finish(acc, acc2, tab_ptr, fsc_ptr, seg, n0, rows, offs_m, offs_n, m_ok, t_ptr, stride_tm, r,
                out_ptr, stride_om, res_ptr, stride_rm, an_ptr, tn_ptr, stride_tnm, N, r_next, sso_ptr, stride_sso,
                GLU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, HAS_RES: tl.constexpr,
                SHRINK_NEXT: tl.constexpr, SS_OUT: tl.constexpr, R: tl.constexpr, R_NEXT: tl.constexpr,
                LDT: tl.constexpr, BLOCK_N: tl.constexpr):
        # The epilogue of one [BM, BN] output tile from its fp32 base product(s): output scale, bias,
        # LoRA expand; GLU: silu(gate) * up (acc2 = up, segment seg + 1); residual; store. SS_OUT:
        # row n0 / 16 of ss gets the sums of squares of this tile's part of out's rows and the tile's
        # other rows zero, so the next norm sums the same rows whatever BLOCK_N wrote them.
        # SHRINK_NEXT: t_next += out_tile @ A_next[:, tile]^T (the down projection's LoRA shrink).
        ACT = out_ptr.dtype.element_ty
        y = acc * tl.load(fsc_ptr + seg * 2 + 1)
        if HAS_BIAS:
            bias_ptr = _tab_ptr(tab_ptr, seg * 8 + 3, ACT)
            y += tl.load(bias_ptr + rows).to(tl.float32)[None, :]
        if HAS_LORA:
            y += _lora_tile(tab_ptr, fsc_ptr, seg, rows, t_ptr, stride_tm, offs_m, m_ok, r, R, ACT, LDT)
        if GLU:
            y2 = acc2 * tl.load(fsc_ptr + (seg + 1) * 2 + 1)
            if HAS_LORA:
                y2 += _lora_tile(tab_ptr, fsc_ptr, seg + 1, rows, t_ptr, stride_tm, offs_m, m_ok, r, R, ACT, LDT)
            gt = y.to(ACT).to(tl.float32)
            y = (gt * tl.sigmoid(gt)).to(ACT).to(tl.float32) * y2.to(ACT).to(tl.float32)
        if HAS_RES:
            res = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=m_ok[:, None], other=0.0)
            y = y.to(ACT).to(tl.float32) + res.to(tl.float32)
        out = y.to(ACT)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=m_ok[:, None])
        if SS_OUT:
            of = out.to(tl.float32)
            q = tl.arange(0, BLOCK_N // 16)
            part = tl.where(q[:, None] == 0, tl.sum(of * of, 1)[None, :], 0.0)
            tl.store(sso_ptr + (n0 // 16 + q)[:, None] * stride_sso + offs_m[None, :], part, mask=m_ok[None, :])
        if SHRINK_NEXT:
            rn = tl.arange(0, R_NEXT)
            a = tl.load(an_ptr + rn[None, :] * N + offs_n[:, None], mask=rn[None, :] < r_next, other=0.0).to(ACT)
            tl.atomic_add(tn_ptr + offs_m[:, None] * stride_tnm + rn[None, :], _dot(out, a, None),
                          mask=m_ok[:, None] & (rn[None, :] < r_next))

    @triton.jit
    def _splitk_kernel(
        x_ptr, stride_xm, tab_ptr, lut_ptr, ws_ptr, stride_wm, stride_ws,
        g_ptr, ss_ptr, stride_ss, T, eps, a_tab_ptr, t_ptr, stride_tm,
        M, K, N1, N2, CPS, NT, NSH, r,
        FMT: tl.constexpr, NSEG: tl.constexpr, ASM: tl.constexpr, NORM: tl.constexpr, R: tl.constexpr,
        LDT: tl.constexpr, T_PAD: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F16: tl.constexpr,
    ):
        # The base product of a linear for decode shapes (dense FMT 0, NVFP4 1, NF4 2), K split into
        # SPLIT slices so that enough programs keep HBM busy; a raw `_linear_kernel` launch then sums
        # the slices and applies scale, bias, LoRA, GLU and residual. x' = x, or with NORM
        # RMSNorm(x) * gamma computed on load (HF's rounding; the rows' sums of squares come as T
        # partial sums). Programs, in id order:
        # - [0, NSH * SPLIT * MB): the LoRA shrink, t[:, 16j:16j+16] += x'[:, slice] @ A^T (fp32
        #   atomics; t is zeroed by the caller);
        # - the rest: tile (pid_n, pid_k, pid_m) of up to three segments side by side (q|k|v,
        #   gate|up) writes x'[:, slice] @ W_seg^T in fp32 to ws[pid_k].
        # NVFP4: 64 inputs a step, fp16 dot with the weight tile as the wide operand, x pre-scaled by
        # 1/16 (the epilogue's output scale undoes that and the 2^-6 of the decoded values). NF4:
        # the same 64 inputs as its two k-groups of 32 (table lookup times absmax), in fp16 the
        # same way with F16, else in the model dtype.
        ACT = x_ptr.dtype.element_ty
        p = tl.program_id(0)
        MB = tl.cdiv(M, BLOCK_M)
        n_sh = NSH * SPLIT * MB
        j = 0
        pid_n = 0
        if p < n_sh:
            j = p % NSH
            pid_k = (p // NSH) % SPLIT
            pid_m = p // (NSH * SPLIT)
        else:
            pid_n = (p - n_sh) % NT
            pid_k = ((p - n_sh) // NT) % SPLIT
            pid_m = (p - n_sh) // (NT * SPLIT)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        rstd = tl.zeros((BLOCK_M,), tl.float32)
        if NORM:
            rstd = _rstd(ss_ptr, stride_ss, T, offs_m, m_ok, K, eps, T_PAD)
        c0 = pid_k * CPS
        kk = tl.arange(0, BLOCK_K)
        if p < n_sh:  # LoRA shrink: 16 columns of t (one segment: R is a multiple of 16)
            rr = (j * 16) % R + tl.arange(0, 16)
            a_ptr = tl.multiple_of(tl.load(a_tab_ptr + (j * 16) // R).to(tl.pointer_type(LDT)), 16)
            acc_t = tl.zeros((BLOCK_M, 16), tl.float32)
            for kc in range(c0, c0 + CPS):
                xt = _x_tile(x_ptr, stride_xm, offs_m, m_ok, kc * BLOCK_K + kk, g_ptr, rstd, NORM)
                a = tl.load(a_ptr + rr[None, :] * K + kc * BLOCK_K + kk[:, None], mask=rr[None, :] < r, other=0.0)
                acc_t = _dot(xt, a.to(ACT), acc_t)
            tl.atomic_add(t_ptr + offs_m[:, None] * stride_tm + (j * 16 + tl.arange(0, 16))[None, :], acc_t,
                          mask=m_ok[:, None] & (rr[None, :] < r))
        else:
            n0 = pid_n * BLOCK_N
            seg, start = _segment(n0, N1, N2, NSEG)
            offs_n = n0 + tl.arange(0, BLOCK_N)
            rows = offs_n - start
            if FMT == 0:
                w_ptr = _tab_ptr(tab_ptr, seg * 8, ACT)
                acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                for kc in range(c0, c0 + CPS):
                    x = _x_tile(x_ptr, stride_xm, offs_m, m_ok, kc * BLOCK_K + kk, g_ptr, rstd, NORM)
                    w = tl.load(w_ptr + rows[:, None] * K + kc * BLOCK_K + kk[None, :])
                    acc = _dot(x, tl.trans(w), acc)
                tl.store(ws_ptr + pid_k * stride_ws + offs_m[:, None] * stride_wm + offs_n[None, :], acc,
                         mask=m_ok[:, None])
            else:  # 4-bit: the weight tile is the dot's wide operand
                acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
                c_ptr, s_ptr, nrows = _seg_ptrs(tab_ptr, seg, FMT)
                if FMT == 1:
                    j32 = tl.arange(0, 32)
                    for g in range(c0, c0 + CPS):
                        x_lo = _x_tile(x_ptr, stride_xm, offs_m, m_ok, g * 64 + j32, g_ptr, rstd, NORM)
                        x_hi = _x_tile(x_ptr, stride_xm, offs_m, m_ok, g * 64 + 32 + j32, g_ptr, rstd, NORM)
                        x_lo = _f16_div16(x_lo)
                        x_hi = _f16_div16(x_hi)
                        w_lo, w_hi = _nvfp4_chunk(c_ptr, s_ptr, K // 64, g, n0 - start, ASM, BLOCK_N)
                        acc = tl.dot(w_lo, tl.trans(x_lo), acc)
                        acc = tl.dot(w_hi, tl.trans(x_hi), acc)
                else:
                    j16 = tl.arange(0, 16)
                    DT: tl.constexpr = tl.float16 if F16 else ACT
                    for g in range(c0, c0 + CPS):
                        for h in tl.static_range(2):  # k-groups 2g and 2g + 1
                            k0 = g * 64 + 32 * h
                            x_lo = _x_tile(x_ptr, stride_xm, offs_m, m_ok, k0 + j16, g_ptr, rstd, NORM)
                            x_hi = _x_tile(x_ptr, stride_xm, offs_m, m_ok, k0 + 16 + j16, g_ptr, rstd, NORM)
                            if F16:
                                x_lo = _f16_div16(x_lo)
                                x_hi = _f16_div16(x_hi)
                            w_lo, w_hi = _nf4_tile(c_ptr, s_ptr, nrows, 2 * g + h, rows, lut_ptr, j16, DT)
                            acc = _dot(w_lo, tl.trans(x_lo), acc)
                            acc = _dot(w_hi, tl.trans(x_hi), acc)
                tl.store(ws_ptr + pid_k * stride_ws + offs_m[None, :] * stride_wm + offs_n[:, None], acc,
                         mask=m_ok[None, :])

    @triton.jit
    def _linear_kernel(
        x_ptr, stride_xm, tab_ptr, fsc_ptr,
        out_ptr, stride_om, res_ptr, stride_rm, t_ptr, stride_tm,
        an_ptr, tn_ptr, stride_tnm, ss_ptr, stride_ss, ws_ptr, stride_wm, stride_ws,
        M, N, K, N1, N2, r, r_next,
        FMT: tl.constexpr, NSEG: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_LORA: tl.constexpr, HAS_RES: tl.constexpr, SHRINK_NEXT: tl.constexpr, SS_OUT: tl.constexpr,
        R: tl.constexpr, R_NEXT: tl.constexpr, UNROLL: tl.constexpr, LDT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NSPLIT: tl.constexpr = 0,
    ):
        # out[:, n] = x @ W_seg[n - start_seg]^T, then the epilogue `_finish`, one launch for up to
        # three segments (q, k, v); GLU: gate = segment 0 and up = segment 1 over the same N columns.
        # The base product: NSPLIT > 0: the sum of `_splitk_kernel`'s fp32 K slices in ws (dense,
        # NVFP4, NF4); format raw: cuBLAS output in the plan's buffers; MXFP4: computed here, in the
        # model dtype (E8M0 scales may leave fp16's range).
        ACT = out_ptr.dtype.element_ty
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        n0 = pid_n * BLOCK_N
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        seg, start = _segment(n0, N1, N2, 1 if GLU else NSEG)  # GLU: gate and up share the columns
        rows = offs_n - start
        seg2 = seg + 1  # GLU: the up projection
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        if NSPLIT > 0:
            part = ws_ptr + offs_m[:, None] * stride_wm + offs_n[None, :]
            for sp in tl.static_range(NSPLIT):  # unrolled: the slices' loads are in flight together
                acc += tl.load(part + sp * stride_ws, mask=m_ok[:, None], other=0.0)
                if GLU:
                    acc2 += tl.load(part + sp * stride_ws + N1, mask=m_ok[:, None], other=0.0)
        elif FMT == 4:  # raw
            raw_ptr = _tab_ptr(tab_ptr, seg * 8, ACT)
            acc += tl.load(raw_ptr + offs_m[:, None] * _tab(tab_ptr, seg * 8 + 5) + rows[None, :],
                           mask=m_ok[:, None], other=0.0).to(tl.float32)
            if GLU:
                raw2_ptr = _tab_ptr(tab_ptr, seg2 * 8, ACT)
                acc2 += tl.load(raw2_ptr + offs_m[:, None] * _tab(tab_ptr, seg2 * 8 + 5) + rows[None, :],
                                mask=m_ok[:, None], other=0.0).to(tl.float32)
        elif UNROLL > 1:  # GB = UNROLL k-groups per iteration, batched dot over the groups
            jj = tl.arange(0, 16)
            gg = tl.arange(0, UNROLL)
            c_ptr, s_ptr, nrows = _seg_ptrs(tab_ptr, seg, FMT)
            if GLU:
                c2_ptr, s2_ptr, nrows2 = _seg_ptrs(tab_ptr, seg2, FMT)
            xm = m_ok[None, :, None]
            for g0 in range(0, K // 32, UNROLL):
                gidx = g0 + gg
                xp = x_ptr + offs_m[None, :, None] * stride_xm + gidx[:, None, None] * 32 + jj[None, None, :]
                x_lo = tl.load(xp, mask=xm, other=0.0)
                x_hi = tl.load(xp + 16, mask=xm, other=0.0)
                w_lo, w_hi = _mxfp4_tile3(c_ptr, s_ptr, nrows, gidx, rows, jj, ACT)
                p = _dot(x_lo, tl.permute(w_lo, (0, 2, 1)), None) + _dot(x_hi, tl.permute(w_hi, (0, 2, 1)), None)
                acc += tl.sum(p, 0)
                if GLU:
                    v_lo, v_hi = _mxfp4_tile3(c2_ptr, s2_ptr, nrows2, gidx, rows, jj, ACT)
                    p2 = _dot(x_lo, tl.permute(v_lo, (0, 2, 1)), None) + _dot(x_hi, tl.permute(v_hi, (0, 2, 1)), None)
                    acc2 += tl.sum(p2, 0)
        else:
            jj = tl.arange(0, 16)
            c_ptr, s_ptr, nrows = _seg_ptrs(tab_ptr, seg, FMT)
            if GLU:
                c2_ptr, s2_ptr, nrows2 = _seg_ptrs(tab_ptr, seg2, FMT)
            for g in range(0, K // 32):
                xp = x_ptr + offs_m[:, None] * stride_xm + g * 32 + jj[None, :]
                x_lo = tl.load(xp, mask=m_ok[:, None], other=0.0)
                x_hi = tl.load(xp + 16, mask=m_ok[:, None], other=0.0)
                w_lo, w_hi = _mxfp4_tile(c_ptr, s_ptr, nrows, g, rows, jj, ACT)
                acc = _dot(x_lo, tl.trans(w_lo), acc)
                acc = _dot(x_hi, tl.trans(w_hi), acc)
                if GLU:
                    v_lo, v_hi = _mxfp4_tile(c2_ptr, s2_ptr, nrows2, g, rows, jj, ACT)
                    acc2 = _dot(x_lo, tl.trans(v_lo), acc2)
                    acc2 = _dot(x_hi, tl.trans(v_hi), acc2)
        _finish(acc, acc2, tab_ptr, fsc_ptr, seg, n0, rows, offs_m, offs_n, m_ok, t_ptr, stride_tm, r,
                out_ptr, stride_om, res_ptr, stride_rm, an_ptr, tn_ptr, stride_tnm, N, r_next, ss_ptr, stride_ss,
                GLU, HAS_BIAS, HAS_LORA, HAS_RES, SHRINK_NEXT, SS_OUT, R, R_NEXT, LDT, BLOCK_N)

    @triton.jit
    def _rope_cache_kernel(
        qkv_ptr, stride_qm, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr,
        kc_ptr, vc_ptr, stride_cb, stride_ch, stride_cs,
        HQ, HKV, D: tl.constexpr, HALF: tl.constexpr,
    ):
        # One (sequence, head) per program; heads [0, HQ) are queries (rotated, written to q),
        # [HQ, HQ + HKV) keys (rotated, into the cache at `slot`), the rest values (copied).
        ACT = qkv_ptr.dtype.element_ty
        b = tl.program_id(0)
        h = tl.program_id(1)
        d = tl.arange(0, HALF)
        src = qkv_ptr + b * stride_qm + h * D
        x1 = tl.load(src + d)
        x2 = tl.load(src + HALF + d)
        slot = tl.load(slot_ptr)
        if h < HQ + HKV:
            pos = tl.load(pos_ptr + b)
            c1 = tl.load(cos_ptr + pos * D + d).to(tl.float32)
            c2 = tl.load(cos_ptr + pos * D + HALF + d).to(tl.float32)
            s1 = tl.load(sin_ptr + pos * D + d).to(tl.float32)
            s2 = tl.load(sin_ptr + pos * D + HALF + d).to(tl.float32)
            f1 = x1.to(tl.float32)
            f2 = x2.to(tl.float32)
            # HF: q * cos + rotate_half(q) * sin, each product rounded to the model dtype
            y1 = ((f1 * c1).to(ACT).to(tl.float32) + (-f2 * s1).to(ACT).to(tl.float32)).to(ACT)
            y2 = ((f2 * c2).to(ACT).to(tl.float32) + (f1 * s2).to(ACT).to(tl.float32)).to(ACT)
            if h < HQ:
                dst = q_ptr + (b * HQ + h) * D
            else:
                dst = kc_ptr + b * stride_cb + (h - HQ) * stride_ch + slot * stride_cs
            tl.store(dst + d, y1)
            tl.store(dst + HALF + d, y2)
        else:
            dst = vc_ptr + b * stride_cb + (h - HQ - HKV) * stride_ch + slot * stride_cs
            tl.store(dst + d, x1)
            tl.store(dst + HALF + d, x2)


if HAS_TRITON:

    @triton.jit
    def _decode_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, pad_ptr, slot_ptr, stride_kb, stride_kh, stride_ks, scaling, HQ,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        # One (sequence b, kv head h) per program: its G query heads against cache slots
        # pad[b]..slot (the live ones), online softmax in fp32 over BLOCK_S slots a step.
        ACT = q_ptr.dtype.element_ty
        b = tl.program_id(0)
        h = tl.program_id(1)
        lo = tl.load(pad_ptr + b)
        hi = tl.load(slot_ptr)
        gq = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        rows = (b * HQ + h * G + gq)[:, None] * D + d[None, :]
        q = tl.load(q_ptr + rows, mask=gq[:, None] < G, other=0.0)
        m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((G_PAD,), tl.float32)
        acc = tl.zeros((G_PAD, D), tl.float32)
        base = b * stride_kb + h * stride_kh
        for s0 in range((lo // BLOCK_S) * BLOCK_S, hi + 1, BLOCK_S):
            sl = s0 + tl.arange(0, BLOCK_S)
            kt = tl.load(k_ptr + base + sl[None, :] * stride_ks + d[:, None])
            qk = _dot(q, kt, None) * scaling
            qk = tl.where(((sl >= lo) & (sl <= hi))[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp(qk - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + base + sl[:, None] * stride_ks + d[None, :])
            acc = acc * alpha[:, None] + _dot(p.to(ACT), v, None)
            m_i = m_new
        tl.store(out_ptr + rows, (acc / l_i[:, None]).to(ACT), mask=gq[:, None] < G)

    @triton.jit
    def _lora_fp32(y_ptr, t_ptr, b_ptr, scale, stride, stride_t, offs_m, offs_n, m_ok, n_ok, r, R: tl.constexpr):
        # y + scale * t @ B^T over one tile, in fp32 (peft: the bf16 base output plus the LoRA term
        # in the adapters' dtype, promoted to fp32)
        y = tl.load(y_ptr + offs_m[:, None] * stride + offs_n[None, :], mask=m_ok[:, None] & n_ok[None, :],
                    other=0.0).to(tl.float32)
        if R > 0:
            rr = tl.arange(0, R)
            tt = tl.load(t_ptr + offs_m[:, None] * stride_t + rr[None, :], mask=m_ok[:, None] & (rr[None, :] < r),
                         other=0.0).to(tl.float32)
            bb = tl.load(b_ptr + offs_n[None, :] * r + rr[:, None], mask=n_ok[None, :] & (rr[:, None] < r),
                         other=0.0).to(tl.float32)
            # tf32x3: fp32 accuracy on tensor cores (FMA ieee took 72 us a launch, 7B batch 8 prefill)
            y += tl.dot(tt, bb, input_precision="tf32x3") * scale
        return y

    @triton.jit
    def _prefill_epilogue_kernel(
        y_ptr, y2_ptr, stride_y, t_ptr, t2_ptr, stride_t, b_ptr, b2_ptr, scale, scale2,
        res_ptr, stride_r, out_ptr, stride_o, M, N, r,
        GLU: tl.constexpr, HAS_RES: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        # out = y + scale * t @ B^T (R = 0: no LoRA), rounded once; GLU: silu(out) * (the same of
        # y2, t2, B2), each rounded as HF; HAS_RES: + res after rounding (HF's residual add)
        ACT = out_ptr.dtype.element_ty
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        ok = m_ok[:, None] & n_ok[None, :]
        y = _lora_fp32(y_ptr, t_ptr, b_ptr, scale, stride_y, stride_t, offs_m, offs_n, m_ok, n_ok, r, R)
        if GLU:
            u = _lora_fp32(y2_ptr, t2_ptr, b2_ptr, scale2, stride_y, stride_t, offs_m, offs_n, m_ok, n_ok, r, R)
            g = y.to(ACT).to(tl.float32)
            y = (g * tl.sigmoid(g)).to(ACT).to(tl.float32) * u.to(ACT).to(tl.float32)
        if HAS_RES:
            res = tl.load(res_ptr + offs_m[:, None] * stride_r + offs_n[None, :], mask=ok, other=0.0)
            y = y.to(ACT).to(tl.float32) + res.to(tl.float32)
        tl.store(out_ptr + offs_m[:, None] * stride_o + offs_n[None, :], y.to(ACT), mask=ok)


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


_DUMMIES: dict = {}


def _tl_dtype(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def _dummy(device: torch.device, dtype: torch.dtype) -> Tensor:
    """A small zero tensor for unused kernel arguments (made once, never inside a graph capture)."""
    key = (str(device), dtype)
    if key not in _DUMMIES:
        _DUMMIES[key] = torch.zeros(64, dtype=dtype, device=device)
    return _DUMMIES[key]


# ---------------------------------------------------------------------------------------------
# Launch wrappers
# ---------------------------------------------------------------------------------------------


def norm_shrink(x: Tensor, gamma: Tensor | None, eps: float, h_out: Tensor | None,
                a_tab: Tensor | None, nseg: int, r: int, t_out: Tensor | None,
                lora_dtype: torch.dtype | None = None, ss: Tensor | None = None) -> None:
    """Triton: h_out = RMSNorm(x) * gamma (if gamma given) and t_out += h @ A_s^T per segment.

    Args:
        x: [M, K] activations. gamma: [K] norm scale or None (no norm: the shrink reads x).
        h_out: [M, K] output of the norm (None when gamma is None).
        a_tab: int64 [nseg] addresses of the LoRA A matrices ([r, K] each), or None (no LoRA).
        lora_dtype: dtype of those matrices (peft keeps adapters in fp32 under a bf16 base);
            the dot runs in x's dtype.
        t_out: fp32 [M, >= nseg * R] accumulator, R = padded rank; must be zeroed by the caller.
        ss: fp32 [T, >= M]: partial sums of squares of x's rows (their sum over T is the row's
            sum), as `fused_linear(ss_out=...)` writes them; None computes them here with torch.
    """
    m, k = x.shape
    if gamma is not None and ss is None:
        ss = x.float().pow(2).sum(-1)[None]
    if a_tab is None:  # norm only
        nseg, r = 1, 0
    R = _pow2(r)
    RT = _pow2(nseg * R)
    block_k = 128 if k % 128 == 0 else 64 if k % 64 == 0 else 32
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    m_blocks = triton.cdiv(m, block_m)
    chunks = triton.cdiv(k, block_k)
    split = max(1, min(chunks, 32 // m_blocks))  # 4x more programs measured no faster, and more atomics
    while chunks % split:
        split -= 1
    dummy = _dummy(x.device, x.dtype)
    f32 = _dummy(x.device, torch.float32)
    _norm_shrink_kernel[(split, m_blocks)](
        x, x.stride(0), gamma if gamma is not None else dummy,
        h_out if h_out is not None else dummy, h_out.stride(0) if h_out is not None else 0,
        a_tab if a_tab is not None else _dummy(x.device, torch.int64),
        t_out if t_out is not None else f32, t_out.stride(0) if t_out is not None else 0,
        ss if ss is not None else f32, ss.stride(0) if ss is not None else 0,
        m, k, r, eps, (chunks // split) * block_k, ss.shape[0] if ss is not None else 1,
        NORM=gamma is not None, LORA=a_tab is not None, NSEG=nseg, R=R, RT=RT,
        LDT=_tl_dtype(lora_dtype or x.dtype), T_PAD=_pow2(ss.shape[0] if ss is not None else 1, 1),
        BLOCK_M=block_m, BLOCK_K=block_k, num_warps=4,
    )


SPLIT_MAX = 8  # most K slices of `_splitk_kernel` (the workspace holds this many)
NORM_ON_LOAD_MAX_M = 16  # see `norm_on_load`


def norm_on_load(fmt: str, k: int, m: int) -> bool:
    """Whether `_splitk_kernel` normalises and shrinks on load for m rows of a [.., k] input (else a
    `norm_shrink` launch does first). Decode step on the H200 (docs/engine.md): on load is faster for
    NVFP4 at every batch and for the 0.5B shape (hidden 896) by 4-26 % at 32-64 rows; only dense
    7B-wide linears (hidden 3584) lose above 16 rows (2-5 %), where every program re-normalises a
    32-64-row tile. The k threshold sits between the two measured widths."""
    return fmt == "nvfp4" or k < 2048 or m <= NORM_ON_LOAD_MAX_M


@dataclass
class LinearPlan:
    """Device tables and constants of one fused linear launch (built once per linear group)."""

    fmt: str
    nseg: int
    glu: bool
    n: int
    k: int
    n1: int
    n2: int
    tab: Tensor  # int64 [nseg, 8]: codes-or-weight, scales, lora_B, bias, rows, raw row stride
    fsc: Tensor  # float32 [nseg, 2]: lora scaling, output scale
    fsc_f16: Tensor  # the same with the output scale times 16 (undoes the fp16 dot's prescale)
    lut: Tensor | None
    has_bias: bool
    r: int
    seg_gcd: int
    lora_dtype: torch.dtype | None
    keep: list  # the tensors whose addresses are in `tab` (kept alive with the plan)
    workspace: Tensor | None = None  # dense / nvfp4 / nf4: fp32 [SPLIT_MAX, B_max, >= n], the K slices
    cublas: list | None = None  # raw: (dense weight, its [B_max, n] buffer) per segment


def norm_shrink_args(x: Tensor, norm: tuple | None, shrink: Tensor | None, t: Tensor | None) -> tuple:
    """The split-K kernels' norm and shrink arguments (g, ss, stride_ss, T, eps, a_tab, t,
    stride_tm), dummies where unused, and T_PAD."""
    gamma, eps, ss = norm if norm is not None else (None, 0.0, None)
    f32 = _dummy(x.device, torch.float32)
    args = (gamma if gamma is not None else _dummy(x.device, x.dtype), ss if ss is not None else f32,
            ss.stride(0) if ss is not None else 0, ss.shape[0] if ss is not None else 1, eps,
            shrink if shrink is not None else _dummy(x.device, torch.int64), t if t is not None else f32,
            t.stride(0) if t is not None else 0)
    return args, _pow2(ss.shape[0] if ss is not None else 1, 1)


def linear_config(m: int, n: int, k: int, fmt: str, seg_gcd: int, glu: bool,
                  sms: int = 132) -> dict:
    """Tile sizes for M rows on a GPU with `sms` multiprocessors (heuristics from sweeps on the
    H200, 132 SMs, docs/engine.md; `bench/kernels.py --sweep` searches them again).

    dense / nvfp4 / nf4 (`_splitk_kernel`): enough K slices (SPLIT) that about 4 programs per SM
    (NVFP4 up to 16 rows: 8) are in flight, since one decode-sized tile cannot keep HBM busy by
    itself; 4-bit formats take 64 inputs a step."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    m_blocks = -(-m // block_m)
    if fmt in ("dense", "nvfp4", "nf4"):
        total = n * (2 if glu else 1)
        wide = total >= 8192 or k >= 8192
        bn = 128 if fmt != "dense" and wide else 64
        while seg_gcd % bn:
            bn //= 2
        bk = 64 if fmt != "dense" or not wide else 128
        # NVFP4 up to 16 rows: 8 programs per SM (H200, gate/up at 8 rows split 4: 25.3 us, split 2:
        # 26.9; at 64 rows split 4 was 18 % slower). More pipeline stages were slower, not faster.
        per_sm = 8 if fmt == "nvfp4" and m <= 16 else 4
        split, tiles, chunks = 1, (total // bn) * m_blocks, k // bk
        while split < SPLIT_MAX and tiles * split < per_sm * sms and chunks % (2 * split) == 0:
            split *= 2
        return dict(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, num_warps=4, num_stages=3)
    block_n = 16
    for bn in (128, 64, 32):
        if seg_gcd % bn == 0 and (n // bn) * m_blocks >= 2 * sms:
            block_n = bn
            break
    if fmt == "raw":
        return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=32, UNROLL=1, num_warps=4, num_stages=4)
    groups = k // 32
    gb = 1
    while gb < 8 and groups % (gb * 2) == 0:
        gb *= 2
    if m > 16:  # multi-group tiles only pay (and fit in registers) for small M
        gb = 1
    elif block_n > 64:
        block_n = 64
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=32, UNROLL=gb, num_warps=4,
                num_stages=2 if glu else 3)


def fused_linear(plan: LinearPlan, x: Tensor, out: Tensor, *, t: Tensor | None = None,
                 residual: Tensor | None = None, a_next: Tensor | None = None,
                 t_next: Tensor | None = None, r_next: int = 0, f16: bool = False,
                 ss_out: Tensor | None = None, norm: tuple | None = None, shrink: Tensor | None = None,
                 config: dict | None = None) -> Tensor:
    """Triton: out = x' @ W^T (+ bias, LoRA, residual; GLU; next shrink), x' = x or its RMSNorm.

    Dense, NVFP4 and NF4 weights: `_splitk_kernel` (norm and shrink on load where `norm_on_load`
    says so, fp32 K slices), then a raw `_linear_kernel` launch sums the slices and applies the
    rest. Otherwise a `norm_shrink` launch first when `norm` or `shrink` asks for it, then the
    linear (MXFP4, cuBLAS: one `_linear_kernel` launch).

    Args:
        plan: the group's device tables (`make_plan`).
        x: [M, K] activations (model dtype). out: [M, N] (GLU: N = intermediate size).
        t: fp32 [M, >= nseg * R] LoRA shrink of x', or None when the group has no LoRA. With
            `shrink` this launch computes it (the caller zeroes it first), else it is read.
        residual: [M, N] added after rounding the linear's output (may alias out).
        a_next / t_next / r_next: GLU only: the down projection's LoRA A [r_next, N] and its fp32
            accumulator, fed with this launch's output tiles.
        f16: NF4: fp16 tensor-core dot (activations pre-scaled by 1/16), else in the model dtype.
            NVFP4 always multiplies in fp16 (its weights are exact there), MXFP4 never (E8M0
            scales may leave fp16's range).
        ss_out: fp32 [>= N / 16, >= M]: row n / 16 gets the sum of squares of out's rows over the
            output tile that starts at column n, the tile's other rows 0 (the next `norm`'s ss).
        norm: (gamma [K], eps, ss fp32 [T, >= M] partial sums of squares of x's rows): x is a
            residual row and the linear reads RMSNorm(x) * gamma (HF's rounding) instead.
        shrink: int64 [nseg] addresses of the group's LoRA A matrices ([r, K] each): compute t.
        config: tile sizes (`linear_config`'s keys) instead of the heuristic.
    """
    m = x.shape[0]
    sms = _sm_count(x.device)
    mma = plan.workspace is not None and config is None and x.is_cuda and _mma() is not None and _mma().usable(plan, m)
    cfg = {} if mma else dict(config or linear_config(m, plan.n, plan.k, plan.fmt, plan.seg_gcd, plan.glu, sms))
    on_load = _mma().norm_on_load(plan, sms) if mma else norm_on_load(plan.fmt, plan.k, m)
    if (norm is not None or shrink is not None) and (plan.workspace is None or not on_load):
        gamma, eps, ss = norm if norm is not None else (None, 0.0, None)
        h = torch.empty_like(x) if norm is not None else None
        norm_shrink(x, gamma, eps, h, shrink, plan.nseg, plan.r, t if shrink is not None else None,
                    plan.lora_dtype, ss=ss)
        x = h if h is not None else x
        norm = shrink = None
    if plan.workspace is not None:
        _launch_splitk(plan, x, out, t, residual, a_next, t_next, r_next, ss_out, norm, shrink, f16, cfg, mma, sms)
        return out
    for w, raw in plan.cublas or []:
        torch.mm(x, w.t(), out=raw[:m])
    global _NO_3D
    if _NO_3D and cfg.get("UNROLL", 1) > 1:
        cfg = {**cfg, "UNROLL": 1}
    try:
        _launch_linear(plan, x, out, t, residual, a_next, t_next, r_next, f16, cfg, ss_out)
    except Exception as e:  # triton builds without batched 3-D dots: fall back to one group a step
        if cfg.get("UNROLL", 1) == 1 or "Compilation" not in type(e).__name__:
            raise
        warnings.warn(f"fused_linear: multi-group tiles failed to compile ({str(e)[:200]}); using single groups")
        _NO_3D = True
        _launch_linear(plan, x, out, t, residual, a_next, t_next, r_next, f16, {**cfg, "UNROLL": 1}, ss_out)
    return out


_NO_3D = False


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: any count works; the H200's keeps CPU tests on GPU tile shapes
    return torch.cuda.get_device_properties(device).multi_processor_count


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _mma():
    """`nvfp4_mma` (the mma.sync NVFP4 kernel), or None where this Triton has no Gluon."""
    try:
        from qerl_exp.engine import nvfp4_mma
    except ImportError:  # pragma: no cover - depends on the install
        return None
    return nvfp4_mma


def _launch_splitk(plan, x, out, t, residual, a_next, t_next, r_next, ss_out, norm, shrink, f16, cfg,
                   mma: bool, sms: int) -> None:
    m = x.shape[0]
    ws = plan.workspace
    if m > ws.shape[1]:
        raise ValueError(f"{m} rows do not fit the split-K workspace ({ws.shape[1]} rows)")
    if mma:  # NVFP4 on CUDA: the mma.sync kernel (`nvfp4_mma`), its slices in a view of ws
        split, ws = _mma().launch(plan, x, t, norm, shrink, sms)
    else:
        split = _launch_splitk_triton(plan, x, t, norm, shrink, f16, cfg)
    epi = linear_config(m, plan.n, plan.k, "raw", plan.seg_gcd, plan.glu, sms)
    _launch_linear(plan, x, out, t, residual, a_next, t_next, r_next, f16, {**epi, "NSPLIT": split}, ss_out, ws)


def _launch_splitk_triton(plan, x, t, norm, shrink, f16, cfg) -> int:
    m = x.shape[0]
    ws = plan.workspace
    split, bk = cfg["SPLIT"], cfg["BLOCK_K"]
    total = plan.n * (2 if plan.glu else 1)
    if (plan.k // bk) % split or total % cfg["BLOCK_N"]:
        raise ValueError(f"tiles {cfg} do not fit a {plan.k} x {total} split-K launch")
    R = _pow2(plan.r)
    nt = total // cfg["BLOCK_N"]
    nsh = plan.nseg * R // 16 if shrink is not None else 0
    ns_args, t_pad = norm_shrink_args(x, norm, shrink, t)
    lut = plan.lut if plan.lut is not None else _dummy(x.device, torch.float32)
    _splitk_kernel[((nsh + nt) * split * triton.cdiv(m, cfg["BLOCK_M"]),)](
        x, x.stride(0), plan.tab, lut, ws, ws.stride(1), ws.stride(0), *ns_args,
        m, plan.k, plan.n1, plan.n2, plan.k // bk // split, nt, nsh, max(plan.r, 1),
        FMT=_FMT_ID[plan.fmt], NSEG=plan.nseg, ASM=not _interpreting(), NORM=norm is not None, R=R,
        LDT=_tl_dtype(plan.lora_dtype or x.dtype), T_PAD=t_pad, F16=bool(f16), **cfg,
    )
    return split


def _launch_linear(plan, x, out, t, residual, a_next, t_next, r_next, f16, cfg, ss_out, part=None) -> None:
    m = x.shape[0]
    R = _pow2(plan.r)
    grid = (plan.n // cfg["BLOCK_N"], triton.cdiv(m, cfg["BLOCK_M"]))
    dummy = _dummy(out.device, out.dtype)
    fsc = plan.fsc_f16 if f16 and plan.fmt == "nf4" else plan.fsc  # the NF4 slices' fp16 prescale
    _linear_kernel[grid](
        x, x.stride(0), plan.tab, fsc,
        out, out.stride(0),
        residual if residual is not None else dummy, residual.stride(0) if residual is not None else 0,
        t if t is not None else fsc, t.stride(0) if t is not None else 0,
        a_next if a_next is not None else dummy, t_next if t_next is not None else fsc,
        t_next.stride(0) if t_next is not None else 0,
        ss_out if ss_out is not None else fsc, ss_out.stride(0) if ss_out is not None else 0,
        part if part is not None else fsc, part.stride(1) if part is not None else 0,
        part.stride(0) if part is not None else 0,
        m, plan.n, plan.k, plan.n1, plan.n2, max(plan.r, 1), max(r_next, 1),
        FMT=_FMT_ID[plan.fmt], NSEG=plan.nseg, GLU=plan.glu, HAS_BIAS=plan.has_bias,
        HAS_LORA=t is not None, HAS_RES=residual is not None, SHRINK_NEXT=t_next is not None,
        SS_OUT=ss_out is not None, R=R, R_NEXT=_pow2(r_next), LDT=_tl_dtype(plan.lora_dtype or x.dtype), **cfg,
    )


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, pad: Tensor, slot: Tensor, scaling: float,
                     out: Tensor) -> Tensor:
    """Triton: attention of one new token per sequence over its live cache slots (pad[b]..slot).

    Args:
        q: [B, hq, d]. k_cache / v_cache: [B_max, hkv, S, d], S a multiple of 64.
        pad: int [B] first live slot per sequence. slot: int [1] this token's slot (the last live).
        out: [B, hq * d], returned.
    """
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    _decode_attention_kernel[(b, hkv)](
        q, k_cache, v_cache, out, pad, slot, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), scaling, hq,
        G=g, G_PAD=_pow2(g), D=d, BLOCK_S=64, num_warps=4,
    )
    return out


def rope_cache(qkv: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, slot: Tensor, q_out: Tensor,
               k_cache: Tensor, v_cache: Tensor, hq: int, hkv: int, d: int) -> None:
    """Triton: rotate q and k of one decode token per sequence; write k, v into the cache at `slot`.

    Args:
        qkv: [B, (hq + 2 hkv) * d] fused projection output. cos/sin: [S_max, d] tables.
        pos: int [B] rotary position per sequence. slot: int [1] cache index of this token.
        q_out: [B, hq, d]. k_cache / v_cache: [B_max, hkv, S_max, d] (batch rows 0..B-1 used).
    """
    b = qkv.shape[0]
    _rope_cache_kernel[(b, hq + 2 * hkv)](
        qkv, qkv.stride(0), cos, sin, pos, slot, q_out,
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        hq, hkv, D=d, HALF=d // 2, num_warps=1,
    )


def prefill_epilogue(y: Tensor, out: Tensor, *, t: Tensor | None = None, b: Tensor | None = None,
                     scale: float = 0.0, y2: Tensor | None = None, t2: Tensor | None = None,
                     b2: Tensor | None = None, scale2: float = 0.0, residual: Tensor | None = None) -> Tensor:
    """Triton: what a prefill linear adds to its cuBLAS base output, in one pass over it.

    out = y + scale * t @ b^T, summed in fp32 and rounded once (peft's LoRA under a bf16 base, as
    `decode._linear_torch`'s addmm); with y2 (GLU: y gate, y2 up) out = silu(that) * (y2 + scale2 *
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
    block_n = 128 if n >= 128 else _pow2(n)
    _prefill_epilogue_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, 32))](
        y, y2 if y2 is not None else y, y.stride(0), dummy, t2 if t2 is not None else dummy,
        t.stride(0) if t is not None else 0, b if b is not None else dummy, b2 if b2 is not None else dummy,
        scale, scale2, residual if residual is not None else y, residual.stride(0) if residual is not None else 0,
        out, out.stride(0), m, n, max(r, 1),
        GLU=y2 is not None, HAS_RES=residual is not None, R=_pow2(r) if r else 0, BLOCK_M=32, BLOCK_N=block_n,
        num_warps=4,
    )
    return out


# ---------------------------------------------------------------------------------------------
# Torch twins (semantics; CPU and prefill path)
# ---------------------------------------------------------------------------------------------


def rms_norm_ref(x: Tensor, gamma: Tensor, eps: float) -> Tensor:
    """HF Llama/Qwen2 RMSNorm, rounding exactly where HF rounds."""
    xf = x.float()
    hn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return gamma * hn


def rope_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF rotary embedding: x [..., d] with cos/sin broadcastable to it."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def weight_of(w: Tensor | PackedWeight, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """A usable [n, k] weight: the referenced tensor itself, or the 4-bit one dequantized.

    `out`: a flat buffer of at least n * k elements to dequantize NVFP4 weights into on the GPU
    (prefill reuses one for every linear instead of allocating each weight anew).
    """
    if not isinstance(w, PackedWeight):
        return w
    if w.fmt == "nvfp4" and w.codes.is_cuda and HAS_TRITON:
        dst = torch.empty(w.n, w.k, dtype=dtype, device=w.codes.device) if out is None else \
            out[: w.n * w.k].view(w.n, w.k)
        bn = math.gcd(w.n, 64)
        _nvfp4_dequant_kernel[(w.n // bn, w.k // 64)](w.codes, w.scales, dst, w.k, w.out_scale,
                                                      ASM=not _interpreting(), BLOCK_N=bn)
        return dst
    return dequantize_packed(w).to(dtype)


def linear_ref(x: Tensor, w: Tensor | PackedWeight, bias: Tensor | None, scratch: Tensor | None = None) -> Tensor:
    """x @ W^T + b in the activation dtype (cuBLAS on CUDA); 4-bit weights are dequantized first
    (NVFP4 on the GPU into `scratch` when given, see `weight_of`)."""
    return F.linear(x, weight_of(w, x.dtype, scratch), bias)


def nf4_lut(device: torch.device | str = "cpu") -> Tensor:
    """The 16 NF4 levels (QLoRA), float32."""
    levels = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
              -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
              0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
              0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]
    return torch.tensor(levels, dtype=torch.float32, device=device)


def make_plan(fmt: str, weights: list, biases: list, lora_b: list | None, lora_scale: list,
              r: int, glu: bool, device: torch.device, raw: list | None = None,
              workspace: Tensor | None = None) -> LinearPlan:
    """Build the device tables for one fused linear launch over 1-3 segments (or GLU gate/up).

    The tables hold the addresses of the model's own tensors (bf16 weights, LoRA B, biases) and of
    the packed 4-bit data, so in-place updates of those tensors are seen by every later launch.
    `raw`: per-segment [B_max, n] buffers into which `fused_linear` has cuBLAS write x @ W^T for
    dense weights; its Triton launch then only applies bias, LoRA, residual and GLU (format "raw").
    `workspace`: fp32 [SPLIT_MAX, B_max, >= total n] scratch, shared by all plans; dense plans
    without `raw`, NVFP4 and NF4 plans need it for `_splitk_kernel`'s K slices.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; valid: {', '.join(FORMATS)}")
    nseg = len(weights)
    sizes = [w.n if isinstance(w, PackedWeight) else w.shape[0] for w in weights]
    k = weights[0].k if isinstance(weights[0], PackedWeight) else weights[0].shape[1]
    tab = torch.zeros(nseg, 8, dtype=torch.int64)
    fsc = torch.zeros(nseg, 2, dtype=torch.float32)
    lut = None
    for s, w in enumerate(weights):
        if raw is not None:
            tab[s, 0] = raw[s].data_ptr()
            tab[s, 5] = raw[s].stride(0)
            fsc[s, 1] = 1.0
        elif isinstance(w, PackedWeight):
            tab[s, 0] = w.codes.data_ptr()
            tab[s, 1] = w.scales.data_ptr()
            fsc[s, 1] = w.out_scale
            lut = w.lut
        else:
            tab[s, 0] = w.data_ptr()
            fsc[s, 1] = 1.0
        tab[s, 4] = sizes[s]
        if lora_b is not None:
            tab[s, 2] = lora_b[s].data_ptr()
            fsc[s, 0] = lora_scale[s]
        if biases[s] is not None:
            tab[s, 3] = biases[s].data_ptr()
    tensors = [t_ for t_ in list(weights) + biases + list(lora_b or []) + list(raw or []) if isinstance(t_, Tensor)]
    tensors += [t_ for w in weights if isinstance(w, PackedWeight) for t_ in (w.codes, w.scales)]
    if any(sz % 16 for sz in sizes + [k]) or any(t_.data_ptr() % 16 for t_ in tensors if t_ is not None):
        raise ValueError(f"the engine's kernels need sizes {sizes} x {k} and tensor addresses that are "
                         "multiples of 16")
    n = sizes[0] if glu else sum(sizes)
    gcd = 0
    for sz in sizes:
        gcd = math.gcd(gcd, sz)
    splitk = fmt in ("dense", "nvfp4", "nf4") and raw is None
    if splitk and (workspace is None or workspace.dim() != 3 or workspace.shape[2] < sum(sizes)):
        raise ValueError(f"a {fmt} plan needs a workspace fp32 [SPLIT_MAX, B_max, >= {sum(sizes)}]")
    if fmt == "nvfp4":  # the split-K products are in units of 2^-6 / 16 (see `_splitk_kernel`)
        fsc[:, 1] *= 1024.0
    plan = LinearPlan(
        fmt="raw" if raw is not None else fmt, nseg=nseg, glu=glu, n=n, k=k,
        n1=sizes[0] if nseg > 1 else n, n2=sizes[0] + sizes[1] if nseg > 2 else n,
        tab=tab.to(device), fsc=fsc.to(device), fsc_f16=(fsc * torch.tensor([1.0, 16.0])).to(device), lut=lut.to(device) if lut is not None else None,
        has_bias=any(b is not None for b in biases), r=r if lora_b is not None else 0, seg_gcd=gcd,
        lora_dtype=lora_b[0].dtype if lora_b is not None else None,
        keep=list(weights) + [b for b in biases if b is not None] + list(lora_b or []) + list(raw or []),
    )
    if splitk:
        plan.workspace = workspace
        plan.keep.append(workspace)
    if raw is not None:
        plan.cublas = list(zip(weights, raw))
    return plan
