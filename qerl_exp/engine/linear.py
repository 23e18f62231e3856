"""The fused linear: one plan class per weight format, each owning its device tables and its base
product, and `fused_linear`, which runs a plan's launch for M rows.

A launch computes out = x' @ W^T (+ bias, LoRA, residual; GLU; the next LoRA shrink) over 1-3
segments that share an input (q|k|v, gate|up as GLU, o, down), x' being x or RMSNorm(x) * gamma.
Every format finishes in the same epilogue (`linear_kernels._linear_kernel`); before it, the base
product:

- `DensePlan`: `_splitk_kernel` (fp32 K slices, norm and shrink on load where `norm_on_load` says
  so), or cuBLAS over the stacked segments into a buffer (`cublas`, from `DENSE_CUBLAS_MIN_BATCH`
  rows of the engine's batch);
- `NVFP4Plan`: what `dispatch` measured fastest for the shape and M: `nvfp4_mma` (CUDA, up to 8
  rows, segments in whole 64-row tiles), `_splitk_kernel`, or `nvfp4_wgmma` (sm_90, 16 rows and
  more, whole 128-row tiles), which reads x' / 16 in fp16;
- `NF4Plan`: `_splitk_kernel` (fp16 dot on x / 16);
- `MXFP4Plan`: none: the epilogue kernel multiplies too (k-groups of 32, in the model dtype, since
  E8M0 scales may leave fp16's range).

Where the base product does not normalise and shrink on load, one `norm.norm_shrink` launch does
first. The tables hold the addresses of the model's own tensors (dense weights, LoRA B, biases) and
of the 4-bit codes and scales, so in-place updates of those tensors are seen by every later launch and by
captured graphs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from qerl_exp.engine import dispatch
from qerl_exp.engine import linear_kernels as lk
from qerl_exp.engine.norm import norm_shrink, norm_shrink_args
from qerl_exp.engine.triton_util import (capability, dummy_tensor, interpreting, pow2, require_device, sm_count,
                                         tl_dtype, triton)
from qerl_exp.quant.layout import KernelWeight

try:  # the NVFP4 Gluon kernels (mma.sync for decode rows, wgmma for 16-256), where Triton has Gluon
    from qerl_exp.engine import nvfp4_mma, nvfp4_wgmma
except ImportError:  # pragma: no cover - depends on the install
    nvfp4_mma = nvfp4_wgmma = None

SPLIT_MAX = 8  # most K slices of `_splitk_kernel` (the workspace holds this many)
NORM_ON_LOAD_MAX_M = 16  # see `norm_on_load`


def norm_on_load(fmt: str, k: int, m: int) -> bool:
    """Whether `_splitk_kernel` normalises and shrinks on load for m rows of a [.., k] input (else a
    `norm_shrink` launch does first). In the decode step on load was faster for NVFP4 at every batch
    and for narrow models at every batch; only dense 7B-wide linears lost above 16 rows, where every
    program re-normalises a 32-64-row tile (docs/engine.md). The k threshold sits between the two
    measured widths."""
    return fmt == "nvfp4" or k < 2048 or m <= NORM_ON_LOAD_MAX_M


def linear_config(m: int, n: int, k: int, fmt: str, seg_gcd: int, glu: bool,
                  sms: int = 132) -> dict:
    """Tile sizes for M rows on a GPU with `sms` multiprocessors (heuristics from sweeps,
    docs/engine.md; `python -m bench.engine_kernels --tiles` searches them again).

    dense / nvfp4 / nf4 (`_splitk_kernel`): enough K slices (SPLIT) that about 4 programs per SM
    (NVFP4 up to 16 rows: 8) are in flight, since one decode-sized tile cannot keep HBM busy by
    itself; 4-bit formats take 64 inputs a step. "raw": the epilogue over split-K slices or a cuBLAS
    product; "mxfp4": its one launch, multi-group tiles (UNROLL k-groups a step) up to 16 rows."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    m_blocks = -(-m // block_m)
    if fmt in ("dense", "nvfp4", "nf4"):
        total = n * (2 if glu else 1)
        wide = total >= 8192 or k >= 8192
        bn = 128 if fmt != "dense" and wide else 64
        while seg_gcd % bn:
            bn //= 2
        bk = 64 if fmt != "dense" or not wide else 128
        # NVFP4 up to 16 rows: 8 programs per SM (a deeper split won at 8 rows and lost at 64). More
        # pipeline stages were slower, not faster.
        per_sm = 8 if fmt == "nvfp4" and m <= 16 else 4
        split, tiles, chunks = 1, (total // bn) * m_blocks, k // bk
        while split < SPLIT_MAX and tiles * split < per_sm * sms and chunks % (2 * split) == 0:
            split *= 2
        return dict(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, num_warps=4, num_stages=3)
    block_n = 16
    # GLU tiles hold two accumulators and two LoRA terms: 128 columns spill registers (docs/engine.md)
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


@dataclass(frozen=True)
class Route:
    """The kernel that computes a launch's base product ("splitk", "cublas", "nvfp4_mma",
    "nvfp4_wgmma", or "linear": the epilogue kernel itself) and its tiles."""

    kernel: str
    tiles: dict | None = None


@dataclass
class LinearPlan:
    """Device tables and constants of one fused linear launch (built once per linear group by
    `make_plan`); a subclass per weight format chooses and launches its base product."""

    nseg: int
    glu: bool
    n: int  # output columns (GLU: the intermediate size; gate and up each have n)
    k: int
    n1: int  # where segment 1 starts (n with one segment)
    n2: int  # where segment 2 starts
    tab: Tensor  # int64 [nseg, 8]: codes-or-weight, scales, lora_B, bias, rows, raw row stride
    fsc: Tensor  # float32 [nseg, 2]: lora scaling, output scale (in `OUT_UNIT`s)
    has_bias: bool
    r: int
    seg_gcd: int
    lora_dtype: torch.dtype | None
    keep: list  # the tensors whose addresses are in `tab` (kept alive with the plan)

    fmt: ClassVar[str]
    OUT_UNIT: ClassVar[float] = 1.0  # what the base product's units ask of the output scale

    @property
    def total(self) -> int:
        """Output columns of the base product (gate and up together for GLU)."""
        return self.n * (2 if self.glu else 1)

    @property
    def kernel_fmt(self) -> str:
        """The epilogue kernel's FMT (`linear_kernels.FMT_ID`)."""
        return self.fmt

    def route(self, m: int, device: torch.device, sms: int, choice: dispatch.Choice | None = None) -> Route:
        """The base product's kernel and tiles for m rows (`choice`: a bench's or test's instead)."""
        raise NotImplementedError

    def loads_norm(self, route: Route, m: int, sms: int) -> bool:
        """Whether `route`'s kernel normalises and shrinks on load (else `norm_shrink` launches first)."""
        return False

    def product(self, route: Route, x: Tensor, x16: Tensor | None, t, norm, shrink, sms: int) -> tuple:
        """Launch the base product of x (x16: x' / 16 in fp16); returns (epilogue tiles, the fp32 K
        slices [slices, >= m, >= total] or None, the first column with more than slice 0)."""
        raise NotImplementedError

    def takes_x16(self, m: int, device: torch.device) -> bool:
        """Whether m rows on `device` take `nvfp4_wgmma`, whose operand is x' / 16 in fp16: the GLU
        launch before a down projection then writes it (`out16`), one launch fewer a layer."""
        return self.route(m, device, sm_count(device)).kernel == "nvfp4_wgmma"

    def set_out_scale(self, s: int, out_scale: float) -> None:
        """Write segment `s`'s new output scale (an NVFP4 tensor scale after an in-place
        re-quantization) into the device table in place: captured graphs read it by address."""
        self.fsc[s, 1] = out_scale * self.OUT_UNIT

    def _small_only(self, choice: dispatch.Choice | None) -> dict | None:
        if choice is not None and choice.kind != "small":
            raise ValueError(f"choice {choice.kind!r} takes NVFP4 only; a {self.fmt} launch takes 'small'")
        return choice.tiles if choice is not None else None


@dataclass
class _SplitKPlan(LinearPlan):
    """Formats whose base product `_splitk_kernel` can compute into the fp32 workspace."""

    workspace: Tensor | None = None  # fp32 [SPLIT_MAX, B_max, >= total], shared by all plans
    lut: Tensor | None = None  # NF4's 16 levels

    def _splitk_route(self, m: int, sms: int, tiles: dict | None) -> Route:
        return Route("splitk", dict(tiles or linear_config(m, self.n, self.k, self.fmt, self.seg_gcd, self.glu, sms)))

    def loads_norm(self, route: Route, m: int, sms: int) -> bool:
        return route.kernel == "splitk" and norm_on_load(self.fmt, self.k, m)

    def product(self, route, x, x16, t, norm, shrink, sms):
        split = self._splitk(x, t, norm, shrink, route.tiles)
        return self._slices(x.shape[0], sms, split), self.workspace, 0

    def _fits(self, m: int) -> None:
        if m > self.workspace.shape[1]:
            raise ValueError(f"{m} rows do not fit the split-K workspace ({self.workspace.shape[1]} rows)")

    def _slices(self, m: int, sms: int, split: int, sk_from: int = 0) -> dict:
        # the epilogue's tiles over `split` K slices (past slice 0 only from column sk_from when > 0)
        return {**linear_config(m, self.n, self.k, "raw", self.seg_gcd, self.glu, sms), "NSPLIT": split,
                "SK": sk_from > 0 and split > 1}

    def _splitk(self, x: Tensor, t, norm, shrink, cfg: dict) -> int:
        m = x.shape[0]
        self._fits(m)
        ws = self.workspace
        split, bk = cfg["SPLIT"], cfg["BLOCK_K"]
        if (self.k // bk) % split or self.total % cfg["BLOCK_N"]:
            raise ValueError(f"tiles {cfg} do not fit a {self.k} x {self.total} split-K launch")
        R = pow2(self.r)
        nt = self.total // cfg["BLOCK_N"]
        nsh = self.nseg * R // 16 if shrink is not None else 0
        ns_args, t_pad = norm_shrink_args(x, norm, shrink, t)
        lut = self.lut if self.lut is not None else dummy_tensor(x.device, torch.float32)
        lk._splitk_kernel[((nsh + nt) * split * triton.cdiv(m, cfg["BLOCK_M"]),)](
            x, x.stride(0), self.tab, lut, ws, ws.stride(1), ws.stride(0), *ns_args,
            m, self.k, self.n1, self.n2, self.k // bk // split, nt, nsh, max(self.r, 1),
            FMT=lk.FMT_ID[self.fmt], NSEG=self.nseg, ASM=not interpreting(), NORM=norm is not None, R=R,
            LDT=tl_dtype(self.lora_dtype or x.dtype), T_PAD=t_pad, **cfg,
        )
        return split


@dataclass
class DensePlan(_SplitKPlan):
    """Dense (bf16) weights: `_splitk_kernel`, or with `cublas` cuBLAS over the segments stacked."""

    cublas: tuple | None = None  # (the segments' weights stacked [sum n, k], a [B_max, sum n] buffer)
    fmt: ClassVar[str] = "dense"

    @property
    def kernel_fmt(self) -> str:
        return "raw" if self.cublas is not None else "dense"  # raw: the epilogue reads the buffer

    def route(self, m, device, sms, choice=None):
        tiles = self._small_only(choice)
        if self.cublas is not None:
            return Route("cublas", dict(tiles or linear_config(m, self.n, self.k, "raw", self.seg_gcd, self.glu, sms)))
        return self._splitk_route(m, sms, tiles)

    def product(self, route, x, x16, t, norm, shrink, sms):
        if route.kernel == "splitk":
            return super().product(route, x, x16, t, norm, shrink, sms)
        w, buf = self.cublas
        torch.mm(x, w.t(), out=buf[: x.shape[0]])
        return route.tiles, None, 0


@dataclass
class NVFP4Plan(_SplitKPlan):
    """NVFP4 weights (`layout.relayout_nvfp4`): the dispatch table's kernel for the shape and M."""

    kernel_weights: list | None = None  # the segments' KernelWeight (nvfp4_wgmma's TMA descriptors)
    fmt: ClassVar[str] = "nvfp4"
    OUT_UNIT: ClassVar[float] = 1024.0  # the products are in units of 2^-6 / 16 (`_splitk_kernel`)

    def route(self, m, device, sms, choice=None):
        cuda = device.type == "cuda"
        forced = choice is not None
        if choice is None:
            choice = dispatch.choose(self.total, self.k, m, capability(device)) if cuda else dispatch.Choice("small")
        if choice.kind not in dispatch.KINDS:
            raise ValueError(f"choice {choice.kind!r} is not one of {dispatch.KINDS}")
        if choice.kind == "wgmma":
            if cuda and nvfp4_wgmma is not None and nvfp4_wgmma.usable(self, m):
                return Route("nvfp4_wgmma", choice.tiles)
            if forced:
                raise ValueError(f"'wgmma' takes NVFP4 launches of 16 rows or more in whole 128-row tiles on CUDA, "
                                 f"not {m} rows of {self.total} columns on {device}")
            choice = dispatch.Choice("small")
        if choice.tiles is None and cuda and nvfp4_mma is not None and nvfp4_mma.usable(self, m):
            return Route("nvfp4_mma")
        return self._splitk_route(m, sms, choice.tiles)

    def loads_norm(self, route, m, sms):
        if route.kernel == "nvfp4_mma":
            return nvfp4_mma.norm_on_load(self, sms)
        return super().loads_norm(route, m, sms)

    def product(self, route, x, x16, t, norm, shrink, sms):
        m = x.shape[0]
        if route.kernel == "nvfp4_mma":  # its slices in a view of the workspace
            self._fits(m)
            split, ws = nvfp4_mma.launch(self, x, t, norm, shrink, sms)
            return self._slices(m, sms, split), ws, 0
        if route.kernel == "nvfp4_wgmma":
            self._fits(m)
            split, sk_from, ws = nvfp4_wgmma.launch(self, x16, sms, route.tiles)
            return self._slices(m, sms, split, sk_from), ws, sk_from
        return super().product(route, x, x16, t, norm, shrink, sms)


@dataclass
class NF4Plan(_SplitKPlan):
    """bitsandbytes NF4 weights laid out again (`layout.relayout_nf4`): `_splitk_kernel`, fp16 dot."""

    fmt: ClassVar[str] = "nf4"
    OUT_UNIT: ClassVar[float] = 16.0  # the fp16 dot multiplies x / 16

    def route(self, m, device, sms, choice=None):
        return self._splitk_route(m, sms, self._small_only(choice))


@dataclass
class MXFP4Plan(LinearPlan):
    """MXFP4 weights: the epilogue kernel multiplies too, one launch (no split)."""

    fmt: ClassVar[str] = "mxfp4"

    def route(self, m, device, sms, choice=None):
        tiles = self._small_only(choice)
        return Route("linear", dict(tiles or linear_config(m, self.n, self.k, "mxfp4", self.seg_gcd, self.glu, sms)))

    def product(self, route, x, x16, t, norm, shrink, sms):
        return route.tiles, None, 0


PLANS = {cls.fmt: cls for cls in (DensePlan, NVFP4Plan, NF4Plan, MXFP4Plan)}


def fused_linear(plan: LinearPlan, x: Tensor, out: Tensor, *, t: Tensor | None = None,
                 residual: Tensor | None = None, a_next: Tensor | None = None, t_next: Tensor | None = None,
                 r_next: int = 0, ss_out: Tensor | None = None, norm: tuple | None = None,
                 shrink: Tensor | None = None, out16: bool = False, x16: bool = False,
                 choice: dispatch.Choice | None = None) -> Tensor:
    """out = x' @ W^T (+ bias, LoRA, residual; GLU; next shrink), x' = x or its RMSNorm, for M rows.

    Args:
        plan: the group's device tables (`make_plan`).
        x: [M, K] activations (model dtype). out: [M, N] (GLU: N = intermediate size), returned.
        t: fp32 [M, >= nseg * R] LoRA shrink of x', or None when the group has no LoRA. With
            `shrink` this launch computes it (the caller zeroes it first), else it is read.
        residual: [M, N] added after rounding the linear's output (may alias out).
        a_next / t_next / r_next: GLU only: the down projection's LoRA A [r_next, N] and its fp32
            accumulator, fed with this launch's output tiles.
        ss_out: fp32 [>= N / 16, >= M]: row n / 16 gets the sum of squares of out's rows over the
            output tile that starts at column n, the tile's other rows 0 (the next `norm`'s ss).
        norm: (gamma [K], eps, ss fp32 [T, >= M] partial sums of squares of x's rows): x is a
            residual row and the linear reads RMSNorm(x) * gamma (HF's rounding) instead.
        shrink: int64 [nseg] addresses of the group's LoRA A matrices ([r, K] each): compute t.
        out16: GLU only: out is fp16 and gets out / 16, where out would be rounded to the model
            dtype: the operand of a down projection that `takes_x16`, written here instead of by a
            conversion launch of its own.
        x16: x is x' / 16 in fp16 already (a GLU launch's `out16`), for a launch that `takes_x16`,
            with neither `norm` nor `shrink`.
        choice: the kind and tiles to take instead of the plan's own (benches time each candidate;
            tests cover each kernel); "small" with tiles is `_splitk_kernel` with those tiles.
    """
    m = x.shape[0]
    sms = sm_count(x.device)
    route = plan.route(m, x.device, sms, choice)
    if out16 and not plan.glu:
        raise ValueError("out16 writes a GLU launch's output for the down projection; this launch is not GLU")
    if x16 and (route.kernel != "nvfp4_wgmma" or norm is not None or shrink is not None):
        raise ValueError(f"x16=True needs the nvfp4_wgmma kernel without norm or shrink (takes_x16); this launch "
                         f"of {m} rows takes {route.kernel}")
    if not x.is_cuda:
        require_device(x.device)
    wgmma = route.kernel == "nvfp4_wgmma"  # its operand is x' / 16 in fp16, written with the norm and the shrink
    xh = x if x16 else None
    if not x16 and (wgmma or (norm is not None or shrink is not None) and not plan.loads_norm(route, m, sms)):
        gamma, eps, ss = norm if norm is not None else (None, 0.0, None)
        h = torch.empty(x.shape, dtype=torch.float16 if wgmma else x.dtype, device=x.device) \
            if norm is not None or wgmma else None
        norm_shrink(x, gamma, eps, h, shrink, plan.nseg, plan.r, t if shrink is not None else None,
                    plan.lora_dtype, ss=ss, h16=wgmma)
        if wgmma:
            xh = h
        elif h is not None:
            x = h
        norm = shrink = None
    cfg, part, sk_from = plan.product(route, x, xh, t, norm, shrink, sms)
    _epilogue(plan, x, out, t, residual, a_next, t_next, r_next, cfg, ss_out, part, sk_from, out16)
    return out


def _epilogue(plan, x, out, t, residual, a_next, t_next, r_next, cfg, ss_out, part=None, sk_from: int = 0,
              out16: bool = False) -> None:
    """`_linear_kernel`: sums the K slices in `part` (or reads the cuBLAS buffer, or multiplies MXFP4),
    then output scale, bias, LoRA expand, GLU, residual, next shrink, sums of squares."""
    m = x.shape[0]
    R = pow2(plan.r)
    grid = (plan.n // cfg["BLOCK_N"], triton.cdiv(m, cfg["BLOCK_M"]))
    dummy = dummy_tensor(out.device, out.dtype)
    fsc = plan.fsc
    lk._linear_kernel[grid](
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
        FMT=lk.FMT_ID[plan.kernel_fmt], NSEG=plan.nseg, GLU=plan.glu, HAS_BIAS=plan.has_bias,
        HAS_LORA=t is not None, HAS_RES=residual is not None, SHRINK_NEXT=t_next is not None,
        SS_OUT=ss_out is not None, R=R, R_NEXT=pow2(r_next), LDT=tl_dtype(plan.lora_dtype or x.dtype),
        OUT16=out16, **cfg,
    )


def make_plan(fmt: str, weights: list, biases: list, lora_b: list | None, lora_scale: list,
              r: int, glu: bool, device: torch.device, cublas: tuple | None = None,
              workspace: Tensor | None = None) -> LinearPlan:
    """Build the device tables for one fused linear launch over 1-3 segments (or GLU gate/up).

    Args:
        fmt: "dense", "nvfp4", "nf4" or "mxfp4".
        weights: per segment the model's own dense weight, or a `layout.KernelWeight`.
        biases, lora_b, lora_scale, r: per segment its bias (or None), LoRA B [n, r] and scaling
            (lora_b None: no LoRA), and the rank.
        glu: two segments, gate and up, over the same output columns.
        cublas: dense only: (the segments stacked [sum n, k] (`decode.stack_dense`), a [B_max, sum n]
            buffer): cuBLAS writes x @ W^T into the buffer in one GEMM, and the epilogue applies
            bias, LoRA, residual and GLU to each segment's columns.
        workspace: fp32 [SPLIT_MAX, B_max, >= total n] scratch, shared by all plans; every plan
            but MXFP4 and cuBLAS ones needs it for the K slices.
    """
    if fmt not in PLANS:
        raise ValueError(f"unknown weight format {fmt!r}; valid: {', '.join(PLANS)}")
    cls = PLANS[fmt]
    nseg = len(weights)
    sizes = [w.n if isinstance(w, KernelWeight) else w.shape[0] for w in weights]
    k = weights[0].k if isinstance(weights[0], KernelWeight) else weights[0].shape[1]
    tab = torch.zeros(nseg, 8, dtype=torch.int64)
    fsc = torch.zeros(nseg, 2, dtype=torch.float32)
    raw = None
    if cublas is not None:  # each segment's columns of the one buffer
        starts = [sum(sizes[:s]) for s in range(nseg)]
        raw = [cublas[1][:, a: a + n] for a, n in zip(starts, sizes)]
    for s, w in enumerate(weights):
        if raw is not None:
            tab[s, 0] = raw[s].data_ptr()
            tab[s, 5] = raw[s].stride(0)
            fsc[s, 1] = 1.0
        elif isinstance(w, KernelWeight):
            tab[s, 0] = w.codes.data_ptr()
            tab[s, 1] = w.scales.data_ptr()
            fsc[s, 1] = w.out_scale * cls.OUT_UNIT
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
    tensors += [t_ for w in weights if isinstance(w, KernelWeight) for t_ in (w.codes, w.scales)]
    if any(sz % 16 for sz in sizes + [k]) or any(t_.data_ptr() % 16 for t_ in tensors if t_ is not None):
        raise ValueError(f"the engine's kernels need sizes {sizes} x {k} and tensor addresses that are "
                         "multiples of 16")
    n = sizes[0] if glu else sum(sizes)
    gcd = 0
    for sz in sizes:
        gcd = math.gcd(gcd, sz)
    splitk = issubclass(cls, _SplitKPlan) and raw is None
    if splitk and (workspace is None or workspace.dim() != 3 or workspace.shape[2] < sum(sizes)):
        raise ValueError(f"a {fmt} plan needs a workspace fp32 [SPLIT_MAX, B_max, >= {sum(sizes)}]")
    lut = next((w.lut for w in weights if isinstance(w, KernelWeight) and w.lut is not None), None)
    plan = cls(
        nseg=nseg, glu=glu, n=n, k=k, n1=sizes[0] if nseg > 1 else n, n2=sizes[0] + sizes[1] if nseg > 2 else n,
        tab=tab.to(device), fsc=fsc.to(device), has_bias=any(b is not None for b in biases),
        r=r if lora_b is not None else 0, seg_gcd=gcd, lora_dtype=lora_b[0].dtype if lora_b is not None else None,
        keep=list(weights) + [b for b in biases if b is not None] + list(lora_b or []) + list(raw or []),
    )
    if splitk:
        plan.workspace = workspace
        plan.keep.append(workspace)
    if lut is not None:
        plan.lut = lut.to(device)
    if fmt == "nvfp4":
        plan.kernel_weights = list(weights)
    if cublas is not None:
        if fmt != "dense":
            raise ValueError(f"cublas takes dense weights, not {fmt}")
        plan.cublas = cublas
        plan.keep += list(cublas)
    return plan
