"""Launching the engine's Triton kernels: linear plans (`make_plan`), tiling rules
(`linear_config`, `norm_on_load`) and the launch wrappers the decode step calls (`fused_linear`,
`norm_shrink`, `rope_cache`, `decode_attention`, `prefill_epilogue`).

The kernels themselves are in `triton_kernels` (NVFP4 up to `nvfp4_mma.MAX_M` rows: `nvfp4_mma`;
16-256 rows: `mma_kernels` or dequantize + cuBLAS, as `dispatch` picks),
the weight layouts they read in `layout`, and their torch twins in `reference`.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from qerl_exp.engine import dispatch, mma_kernels
from qerl_exp.engine import triton_kernels as tk
from qerl_exp.engine.layout import PackedWeight
from qerl_exp.engine.triton_kernels import FORMATS, dummy_tensor, norm_shrink_args, pow2, tl_dtype

try:  # CPU builds of torch ship without Triton (the engine then runs its torch twins)
    import triton
except ImportError:  # pragma: no cover - depends on the install
    triton = None
try:  # the NVFP4 Gluon kernels (mma.sync for decode shapes, wgmma for 16-256 rows), where Triton has Gluon
    from qerl_exp.engine import nvfp4_mma, nvfp4_wgmma
except ImportError:  # pragma: no cover - depends on the install
    nvfp4_mma = nvfp4_wgmma = None


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
            sum), as `fused_linear(ss_out=...)` writes them; None: each program sums its rows.
    """
    m, k = x.shape
    if a_tab is None:  # norm only
        nseg, r = 1, 0
    R = pow2(r)
    RT = pow2(nseg * R)
    # Up to 16 rows ~32 programs (4x more measured no faster, and more atomics); from 17 rows 16-row
    # blocks of 64 inputs, ~128 programs: 64-row blocks of 128 made 28 programs, and a 64-row NVFP4
    # decode step spent 1063 us in this kernel against 629 now (H200, `bench/step_profile.py --batch
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
    cublas: tuple | None = None  # raw: (the segments' dense weights stacked [sum n, k], its [B_max, sum n] buffer)
    packed: list | None = None  # nvfp4: the segments' PackedWeight (dequantize + cuBLAS fallback)


def linear_config(m: int, n: int, k: int, fmt: str, seg_gcd: int, glu: bool,
                  sms: int = 132) -> dict:
    """Tile sizes for M rows on a GPU with `sms` multiprocessors (heuristics from sweeps on the
    H200, 132 SMs, docs/engine.md; `bench/kernels.py --tiles` searches them again).

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
    # GLU tiles hold two accumulators and two LoRA terms: 128 columns spill (NVFP4 at 128 rows: 1092
    # bytes; 64 columns made its decode step 1.8 % faster, bf16's the same, H200 session 23)
    for bn in (64, 32) if glu else (128, 64, 32):
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
                 config: dict | None = None, kernel: str | None = None, out16: bool = False,
                 x16: bool = False) -> Tensor:
    """Triton: out = x' @ W^T (+ bias, LoRA, residual; GLU; next shrink), x' = x or its RMSNorm.

    Dense, NVFP4 and NF4 weights: `_splitk_kernel` (norm and shrink on load where `norm_on_load`
    says so, fp32 K slices), then a raw `_linear_kernel` launch sums the slices and applies the
    rest. NVFP4 on CUDA: the base product as `dispatch.choose` says for the shape and M ("mma":
    `mma_kernels`, "wgmma": `nvfp4_wgmma`, "dequant": dequantize + cuBLAS, all after a `norm_shrink`
    launch; wgmma's writes x' / 16 in fp16). Otherwise a `norm_shrink` launch first when `norm` or
    `shrink` asks for it, then the linear (MXFP4, cuBLAS: one `_linear_kernel` launch).

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
        config: tile sizes (`linear_config`'s keys; "mma": `mma_kernels.mma_config`'s; "wgmma":
            `nvfp4_wgmma.config`'s) instead of the heuristic.
        kernel: NVFP4: "small", "mma", "wgmma" or "dequant" instead of the dispatch table's choice (on CPU,
            where there is no table to follow, "small" unless given).
        out16: GLU only: out is fp16 and gets out / 16, where out would be rounded to the model
            dtype: the operand of a down projection that `takes_x16`, written here instead of by a
            conversion launch of its own.
        x16: x is x' / 16 in fp16 already (a GLU launch's `out16`): the "wgmma" path reads it as it
            is. Only where `takes_x16` says so, and with neither `norm` nor `shrink`.
    """
    m = x.shape[0]
    sms = sm_count(x.device)
    kind, cfg = _dispatch(plan, m, x.device, config, kernel, sms)
    if out16 and not plan.glu:
        raise ValueError("out16 writes a GLU launch's output for the down projection; this launch is not GLU")
    if x16 and (kind != "wgmma" or norm is not None or shrink is not None):
        raise ValueError(f"x16=True needs the 'wgmma' path without norm or shrink (takes_x16); this launch of {m} "
                         f"rows takes {kind!r}")
    if not x.is_cuda and not tk.interpreting():
        raise RuntimeError("Triton kernels take CPU tensors only in the Triton interpreter: set TRITON_INTERPRET=1 "
                           "before triton is imported, or use FastEngine(backend='torch')")
    mma = (kind == "small" and plan.workspace is not None and config is None and x.is_cuda and nvfp4_mma is not None
           and nvfp4_mma.usable(plan, m))
    if kind == "small":
        cfg = {} if mma else dict(config or linear_config(m, plan.n, plan.k, plan.fmt, plan.seg_gcd, plan.glu, sms))
    on_load = kind == "small" and (nvfp4_mma.norm_on_load(plan, sms) if mma else norm_on_load(plan.fmt, plan.k, m))
    h16 = kind == "wgmma"  # its activations are x' / 16 in fp16, written with the norm and the shrink
    xh = x if x16 else None
    if not x16 and (h16 or (norm is not None or shrink is not None) and (plan.workspace is None or not on_load)):
        gamma, eps, ss = norm if norm is not None else (None, 0.0, None)
        h = torch.empty(x.shape, dtype=torch.float16 if h16 else x.dtype, device=x.device) \
            if norm is not None or h16 else None
        norm_shrink(x, gamma, eps, h, shrink, plan.nseg, plan.r, t if shrink is not None else None,
                    plan.lora_dtype, ss=ss, h16=h16)
        if h16:
            xh = h
        elif h is not None:
            x = h
        norm = shrink = None
    if plan.workspace is not None:
        _launch_splitk(plan, x, out, t, residual, a_next, t_next, r_next, ss_out, norm, shrink, f16, cfg,
                       "nvfp4_mma" if mma else kind, sms, xh, out16)
        return out
    if plan.cublas is not None:
        w, buf = plan.cublas
        torch.mm(x, w.t(), out=buf[:m])
    global _NO_3D
    if _NO_3D and cfg.get("UNROLL", 1) > 1:
        cfg = {**cfg, "UNROLL": 1}
    try:
        _launch_linear(plan, x, out, t, residual, a_next, t_next, r_next, f16, cfg, ss_out, out16=out16)
    except Exception as e:  # triton builds without batched 3-D dots: fall back to one group a step
        if cfg.get("UNROLL", 1) == 1 or "Compilation" not in type(e).__name__:
            raise
        warnings.warn(f"fused_linear: multi-group tiles failed to compile ({str(e)[:200]}); using single groups")
        _NO_3D = True
        _launch_linear(plan, x, out, t, residual, a_next, t_next, r_next, f16, {**cfg, "UNROLL": 1}, ss_out,
                       out16=out16)
    return out


def takes_x16(plan: LinearPlan, m: int, device: torch.device) -> bool:
    """Whether `fused_linear` multiplies m rows of this plan on `device` with `nvfp4_wgmma`, whose
    operand is x' / 16 in fp16. For the down projection the GLU launch before it then writes that
    operand (`out16`), so no launch converts it (one launch fewer a layer)."""
    return _dispatch(plan, m, device, None, None, sm_count(device))[0] == "wgmma"


_NO_3D = False


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: any count works; the H200's keeps CPU tests on GPU tile shapes
    return torch.cuda.get_device_properties(device).multi_processor_count


def _dispatch(plan: LinearPlan, m: int, device: torch.device, config: dict | None, kernel: str | None,
              sms: int) -> tuple:
    """(kind, config) of an NVFP4 launch's base product for m rows: `kernel`, else the dispatch table's
    choice on CUDA, else "small"; "mma" and "wgmma" with their tiles (`config` overrides the table's)."""
    cuda = device.type == "cuda"
    if kernel is not None and (kernel not in dispatch.KINDS or (kernel != "small" and plan.fmt != "nvfp4")):
        raise ValueError(f"kernel={kernel!r} is not one of {dispatch.KINDS} for a {plan.fmt} linear "
                         "(mma, wgmma and dequant take NVFP4 only)")
    if plan.fmt != "nvfp4" or plan.workspace is None:
        return "small", config
    total = plan.n * (2 if plan.glu else 1)
    choice = dispatch.Choice(kernel or "small")
    if kernel is None and cuda and config is None:
        choice = dispatch.choose(total, plan.k, m)
    if choice.kind == "wgmma" and not (cuda and nvfp4_wgmma is not None and nvfp4_wgmma.usable(plan, m)):
        if kernel is not None:
            raise ValueError(f"kernel='wgmma' takes NVFP4 launches of 16 rows or more in whole 128-row tiles on "
                             f"CUDA, not {m} rows of {total} columns on {device}")
        choice = dispatch.Choice("small")
    tiles = config if config is not None else choice.tiles
    if choice.kind == "wgmma":
        return "wgmma", tiles
    if choice.kind != "mma":
        return choice.kind, config
    return "mma", mma_kernels.mma_config(m, total, plan.k, plan.seg_gcd, sms, SPLIT_MAX, tiles)


def _launch_splitk(plan, x, out, t, residual, a_next, t_next, r_next, ss_out, norm, shrink, f16, cfg,
                   kind: str, sms: int, x16: Tensor | None = None, out16: bool = False) -> None:
    m = x.shape[0]
    ws = plan.workspace
    if m > ws.shape[1]:
        raise ValueError(f"{m} rows do not fit the split-K workspace ({ws.shape[1]} rows)")
    sk_from = 0  # the first output column with more than one slice
    if kind == "nvfp4_mma":  # NVFP4 on CUDA: the mma.sync kernel (`nvfp4_mma`), its slices in a view of ws
        split, ws = nvfp4_mma.launch(plan, x, t, norm, shrink, sms)
    elif kind == "wgmma":
        split, sk_from, ws = nvfp4_wgmma.launch(plan, x16, sms, cfg)
    elif kind == "mma":
        split = mma_kernels.launch_mma(plan, x, cfg)
    elif kind == "dequant":
        split = mma_kernels.launch_dequant(plan, x)
    else:
        split = _launch_splitk_triton(plan, x, t, norm, shrink, f16, cfg)
    epi = linear_config(m, plan.n, plan.k, "raw", plan.seg_gcd, plan.glu, sms)
    _launch_linear(plan, x, out, t, residual, a_next, t_next, r_next, f16,
                   {**epi, "NSPLIT": split, "SK": sk_from > 0 and split > 1}, ss_out, ws, sk_from, out16)


def _launch_splitk_triton(plan, x, t, norm, shrink, f16, cfg) -> int:
    m = x.shape[0]
    ws = plan.workspace
    split, bk = cfg["SPLIT"], cfg["BLOCK_K"]
    total = plan.n * (2 if plan.glu else 1)
    if (plan.k // bk) % split or total % cfg["BLOCK_N"]:
        raise ValueError(f"tiles {cfg} do not fit a {plan.k} x {total} split-K launch")
    R = pow2(plan.r)
    nt = total // cfg["BLOCK_N"]
    nsh = plan.nseg * R // 16 if shrink is not None else 0
    ns_args, t_pad = norm_shrink_args(x, norm, shrink, t)
    lut = plan.lut if plan.lut is not None else dummy_tensor(x.device, torch.float32)
    tk._splitk_kernel[((nsh + nt) * split * triton.cdiv(m, cfg["BLOCK_M"]),)](
        x, x.stride(0), plan.tab, lut, ws, ws.stride(1), ws.stride(0), *ns_args,
        m, plan.k, plan.n1, plan.n2, plan.k // bk // split, nt, nsh, max(plan.r, 1),
        FMT=tk.FMT_ID[plan.fmt], NSEG=plan.nseg, ASM=not tk.interpreting(), NORM=norm is not None, R=R,
        LDT=tl_dtype(plan.lora_dtype or x.dtype), T_PAD=t_pad, F16=bool(f16), **cfg,
    )
    return split


def _launch_linear(plan, x, out, t, residual, a_next, t_next, r_next, f16, cfg, ss_out, part=None,
                   sk_from: int = 0, out16: bool = False) -> None:
    m = x.shape[0]
    R = pow2(plan.r)
    grid = (plan.n // cfg["BLOCK_N"], triton.cdiv(m, cfg["BLOCK_M"]))
    dummy = dummy_tensor(out.device, out.dtype)
    fsc = plan.fsc_f16 if f16 and plan.fmt == "nf4" else plan.fsc  # the NF4 slices' fp16 prescale
    tk._linear_kernel[grid](
        x, x.stride(0), plan.tab, fsc,
        out, out.stride(0),
        residual if residual is not None else dummy, residual.stride(0) if residual is not None else 0,
        t if t is not None else fsc, t.stride(0) if t is not None else 0,
        a_next if a_next is not None else dummy, t_next if t_next is not None else fsc,
        t_next.stride(0) if t_next is not None else 0,
        ss_out if ss_out is not None else fsc, ss_out.stride(0) if ss_out is not None else 0,
        part if part is not None else fsc, part.stride(1) if part is not None else 0,
        part.stride(0) if part is not None else 0, sk_from,
        m, plan.n, plan.k, plan.n1, plan.n2, max(plan.r, 1), max(r_next, 1),
        FMT=tk.FMT_ID[plan.fmt], NSEG=plan.nseg, GLU=plan.glu, HAS_BIAS=plan.has_bias,
        HAS_LORA=t is not None, HAS_RES=residual is not None, SHRINK_NEXT=t_next is not None,
        SS_OUT=ss_out is not None, R=R, R_NEXT=pow2(r_next), LDT=tl_dtype(plan.lora_dtype or x.dtype),
        OUT16=out16, **cfg,
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
    tk._decode_attention_kernel[(b, hkv)](
        q, k_cache, v_cache, out, pad, slot, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), scaling, hq,
        G=g, G_PAD=pow2(g), D=d, BLOCK_S=64, num_warps=4,
    )
    return out


def rope_cache(qkv: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, slot: Tensor, q_out: Tensor,
               k_cache: Tensor, v_cache: Tensor, hq: int, hkv: int, d: int, p: int = 1) -> None:
    """Triton: rotate q and k of p tokens per sequence; write k, v into the cache from `slot` on.

    Args:
        qkv: [B * p, (hq + 2 hkv) * d] fused projection output, each sequence's p rows together.
            cos/sin: [S_max, d] tables.
        pos: int [B * p] rotary position per row. slot: int [1] cache index of each sequence's first
            row (decode: its one token; the prefill: 0, with p its prompt length).
        q_out: [B, hq, p, d]. k_cache / v_cache: [B_max, hkv, S_max, d] (batch rows 0..B-1 used).
    """
    rows = qkv.shape[0]
    tk._rope_cache_kernel[(rows, hq + 2 * hkv)](
        qkv, qkv.stride(0), cos, sin, pos, slot, q_out,
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        hq, hkv, p, D=d, HALF=d // 2, num_warps=1,
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


def _output_scale(fmt: str, out_scale: float) -> float:
    """A packed segment's entry in `LinearPlan.fsc`: NVFP4 split-K products are in units of
    2^-6 / 16 (see `_splitk_kernel`), so its tensor scale is stored times 1024."""
    return out_scale * 1024.0 if fmt == "nvfp4" else out_scale


def set_out_scale(plan: LinearPlan, s: int, out_scale: float) -> None:
    """Write segment `s`'s new output scale (an NVFP4 tensor scale after an in-place
    re-quantization) into the plan's device tables in place: captured graphs read them by address."""
    value = _output_scale(plan.fmt, out_scale)
    plan.fsc[s, 1] = value
    plan.fsc_f16[s, 1] = value * 16.0


def make_plan(fmt: str, weights: list, biases: list, lora_b: list | None, lora_scale: list,
              r: int, glu: bool, device: torch.device, cublas: tuple | None = None,
              workspace: Tensor | None = None) -> LinearPlan:
    """Build the device tables for one fused linear launch over 1-3 segments (or GLU gate/up).

    The tables hold the addresses of the model's own tensors (bf16 weights, LoRA B, biases) and of
    the packed 4-bit data, so in-place updates of those tensors are seen by every later launch.
    `cublas`: (the dense segments stacked [sum n, k] (`decode.stack_dense`), a [B_max, sum n] buffer):
    `fused_linear` has cuBLAS write x @ W^T into the buffer in one GEMM, and its Triton launch then
    only applies bias, LoRA, residual and GLU to each segment's columns (format "raw").
    `workspace`: fp32 [SPLIT_MAX, B_max, >= total n] scratch, shared by all plans; dense plans
    without `cublas`, NVFP4 and NF4 plans need it for `_splitk_kernel`'s K slices.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; valid: {', '.join(FORMATS)}")
    nseg = len(weights)
    sizes = [w.n if isinstance(w, PackedWeight) else w.shape[0] for w in weights]
    k = weights[0].k if isinstance(weights[0], PackedWeight) else weights[0].shape[1]
    tab = torch.zeros(nseg, 8, dtype=torch.int64)
    fsc = torch.zeros(nseg, 2, dtype=torch.float32)
    lut = None
    raw = None
    if cublas is not None:  # each segment's columns of the one buffer
        starts = [sum(sizes[:s]) for s in range(nseg)]
        raw = [cublas[1][:, a: a + n] for a, n in zip(starts, sizes)]
    for s, w in enumerate(weights):
        if raw is not None:
            tab[s, 0] = raw[s].data_ptr()
            tab[s, 5] = raw[s].stride(0)
            fsc[s, 1] = 1.0
        elif isinstance(w, PackedWeight):
            tab[s, 0] = w.codes.data_ptr()
            tab[s, 1] = w.scales.data_ptr()
            fsc[s, 1] = _output_scale(fmt, w.out_scale)
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
    if fmt == "nvfp4" and raw is None:
        plan.packed = list(weights)
    if cublas is not None:
        plan.cublas = cublas
        plan.keep += list(cublas)
    return plan
