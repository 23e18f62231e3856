"""NVFP4 and MXFP4: E2M1 weights with per-block scales, and a frozen linear layer that stores them.

Layout (GPU kernels are written against it; do not change). For a weight W of shape [out, in]:

- `codes`: uint8 [out, in // 2]. Element 2j sits in the low nibble, element 2j+1 in the high
  nibble. A nibble is `sign << 3 | idx`, idx 0..7 <-> magnitudes `E2M1_VALUES` =
  (0, 0.5, 1, 1.5, 2, 3, 4, 6).
- NVFP4: `block_scales` float8_e4m3fn [out, in // 16]; `tensor_scale` fp32 0-dim,
  `amax(|W|) / (6 * 448)`; a block's scale is `e4m3(amax(|block|) / (6 * tensor_scale))`.
  `W_hat = e2m1(code) * block_scale * tensor_scale`.
- MXFP4 (OCP MX v1.0): `block_scales` uint8 [out, in // 32] holding E8M0 exponents, a block's
  scale is `2 ** (e - 127)` with `e - 127 = floor(log2(amax(|block|))) - 2` (2 is the largest
  exponent of E2M1; torchao's default FLOOR mode), clamped to [-127, 127]; an all-zero block gets
  e = 0. `tensor_scale` is 1.0.

Elements are `q = rne_e2m1(W / scale)`: round to nearest, ties to the even code, saturating at
+-6; a negative value that rounds to zero keeps its sign bit (code 0b1000, -0.0). NVFP4 arithmetic
is fp32 in a fixed order, block scale `(amax / 6) / tensor_scale` and element
`W * ((1 / tensor_scale) / block_scale)`, the order torchao uses: with bf16 weights exact ties
are common (amax ratios of 8-bit mantissas), and this order makes codes and scales equal torchao's
bit for bit. MXFP4 scales are powers of two, so its division is exact. A zero block scale (an
all-zero block, an all-zero tensor, or an NVFP4 block below half the smallest E4M3 subnormal
relative to the tensor scale) gives zero codes and dequantizes to zeros, never NaN. E4M3
subnormals (steps of 2^-9 below 2^-6) are used as such, whereas torchao clamps NVFP4 block scales
up to 2^-6: the two differ only for blocks whose largest value is below ~1/30000 of the tensor's.
A tensor whose largest value is below ~3e-35 has a subnormal fp32 tensor scale and is quantized
more coarsely than the format otherwise allows (still finite).

Memory: `FP4Linear.forward` decodes the weight in forward and again in backward (a custom autograd
function that saves no tensor), so autograd never holds a dense copy. On CUDA the layer converts
itself once to the engine kernels' layout (`runtime_weight`), which both the learner's decode (a
Triton dequant kernel for NVFP4) and the rollout engine read: one 4-bit copy per layer.

LoRA through peft: `FP4Linear` subclasses `nn.Linear` the way bitsandbytes' `Linear4bit` does (its
`weight` is its 4-bit data, here the uint8 codes; it never calls `nn.Linear.__init__`, so no dense
weight exists). peft's default dispatcher therefore wraps it in its standard LoRA `Linear` with any
plain `LoraConfig`: the base output plus `B(A(x)) * scaling`. Nothing needs registering, and a
saved adapter reloads the same way. Merging the adapter into the base, and variants that read the
dense base weight (DoRA, PiSSA, ...), fail loudly (they meet uint8 codes of half the width).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qerl_exp.quant.layout import KernelWeight, relayout_nvfp4, stacked_weight, weight_of

BLOCK_SIZE = {"nvfp4": 16, "mxfp4": 32}
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E4M3_MAX = 448.0
E8M0_BIAS = 127

# Value of each byte of `codes` as (low element, high element): one lookup decodes two weights.
_e2m1 = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
_BYTE_TO_PAIR = torch.stack((_e2m1[torch.arange(256) & 15], _e2m1[torch.arange(256) >> 4]), dim=1)
_BYTE_TABLES: dict[torch.device, torch.Tensor] = {}


@dataclass
class FP4Tensor:
    """A weight matrix in NVFP4 or MXFP4 (see the module docstring for the exact layout).

    Args:
        format: `nvfp4` or `mxfp4`.
        codes: uint8 [out, in // 2], two E2M1 codes per byte, element 2j in the low nibble.
        block_scales: NVFP4: float8_e4m3fn [out, in // 16]; MXFP4: uint8 E8M0 exponents
            [out, in // 32].
        tensor_scale: fp32 0-dim tensor; 1.0 for MXFP4.
    """

    format: str
    codes: torch.Tensor
    block_scales: torch.Tensor
    tensor_scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 2

    @property
    def block_size(self) -> int:
        return BLOCK_SIZE[self.format]

    @property
    def nbytes(self) -> int:
        """Bytes stored: codes, every block scale and the tensor scale."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.block_scales, self.tensor_scale))

    def scales(self) -> torch.Tensor:
        """The fp32 scale of each block, [out, in // block_size] (NVFP4: without the tensor scale)."""
        if self.format == "nvfp4":
            return self.block_scales.float()
        return torch.exp2(self.block_scales.float() - E8M0_BIAS)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decode to a dense matrix.

        Args:
            dtype: dtype of the result; the products are formed in fp32 (exactly, up to the final
                multiplication by the NVFP4 tensor scale) and then cast.

        Returns:
            W_hat of shape [out, in].
        """
        out, inp = self.shape
        w = decode_fp4(self.codes).view(out, inp // self.block_size, self.block_size)
        w.mul_(self.scales().unsqueeze(-1))  # exact: 2-bit by 4-bit mantissas
        if self.format == "nvfp4":
            w.mul_(self.tensor_scale.float())
        return w.view(out, inp).to(dtype)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the E2M1 grid (nearest, ties to even, saturating at +-6) and return 4-bit codes.

    Args:
        x: finite values already divided by their scale, any shape, fp32 or float64.

    Returns:
        uint8 codes `sign << 3 | idx` of the same shape (one code per element, unpacked).
    """
    # idx = number of midpoints below |x|. A tie rounds up only when the upper neighbour has the
    # even index: those midpoints (0.75, 1.75, 3.5) move one ulp down so that a tie counts.
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=x.dtype, device=x.device)
    mids[1::2] = torch.nextafter(mids[1::2], torch.zeros_like(mids[1::2]))
    idx = torch.bucketize(x.abs(), mids).to(torch.uint8)
    return (torch.signbit(x).to(torch.uint8) << 3) | idx


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Values of unpacked 4-bit E2M1 codes (the inverse of `encode_e2m1` on the grid).

    Args:
        codes: uint8 codes 0..15.

    Returns:
        fp32 values of the same shape.
    """
    return _e2m1.to(codes.device)[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes [..., n] (n even) into bytes [..., n // 2], element 2j in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(data: torch.Tensor) -> torch.Tensor:
    """Unpack bytes [..., m] into 4-bit codes [..., 2m] (inverse of `pack_fp4`)."""
    return torch.stack((data & 15, data >> 4), dim=-1).flatten(-2)


def decode_fp4(data: torch.Tensor) -> torch.Tensor:
    """Values of codes two a byte, [out, m] bytes -> fp32 [out, 2m], with one table lookup per byte."""
    table = _BYTE_TABLES.get(data.device)
    if table is None:
        table = _BYTE_TABLES[data.device] = _BYTE_TO_PAIR.to(data.device)
    return F.embedding(data.long(), table).flatten(-2)


def quantize_nvfp4(weight: torch.Tensor) -> FP4Tensor:
    """Quantize a weight matrix to NVFP4: E2M1 codes, E4M3 scales per 16 inputs, one fp32 scale.

    Args:
        weight: [out, in] floating tensor, finite, with in divisible by 16.

    Returns:
        The quantized `FP4Tensor` (format `nvfp4`).

    Raises:
        ValueError: the weight is not 2-D, holds NaN/Inf, or in is not a multiple of 16.
    """
    blocks = _blocks(weight, "nvfp4")
    amax = blocks.abs().amax(dim=-1)
    # Divide by tensors, not Python numbers: CUDA computes x / number as x * (1 / number), which
    # rounds differently from the CPU (and from torchao).
    six, six_448 = (torch.tensor(v, device=blocks.device) for v in (E2M1_MAX, E2M1_MAX * E4M3_MAX))
    tensor_scale = amax.amax() / six_448
    if tensor_scale > 0:
        block_scales = ((amax / six) / tensor_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        inv_t = 1.0 / tensor_scale
        if torch.isinf(inv_t):  # tensor scale below 2**-128: scale in float64 so that nothing overflows
            inv_t = 1.0 / tensor_scale.double()
    else:  # an all-zero tensor: every block scale would be 0 / 0
        block_scales = torch.zeros_like(amax).to(torch.float8_e4m3fn)
        inv_t = tensor_scale
    s_b = block_scales.to(inv_t.dtype)
    factor = torch.where(s_b > 0, inv_t / torch.where(s_b > 0, s_b, 1.0), 0.0)
    codes = pack_fp4(encode_e2m1(blocks * factor.unsqueeze(-1)).flatten(-2))
    return FP4Tensor("nvfp4", codes, block_scales, tensor_scale)


def quantize_mxfp4(weight: torch.Tensor) -> FP4Tensor:
    """Quantize a weight matrix to MXFP4 (OCP MX v1.0): E2M1 codes, E8M0 scales per 32 inputs.

    Args:
        weight: [out, in] floating tensor, finite, with in divisible by 32.

    Returns:
        The quantized `FP4Tensor` (format `mxfp4`, tensor scale 1.0).

    Raises:
        ValueError: the weight is not 2-D, holds NaN/Inf, or in is not a multiple of 32.
    """
    blocks = _blocks(weight, "mxfp4")
    amax = blocks.abs().amax(dim=-1)
    # floor(log2(amax)) exactly, from frexp (amax = m * 2**e with m in [0.5, 1)).
    exponent = torch.frexp(amax).exponent - 1 - 2
    exponent = torch.where(amax > 0, exponent, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)
    # Dividing by a power of two is exact, 2**-127 (an fp32 subnormal) included.
    scale = torch.exp2(exponent.double()).float()
    codes = pack_fp4(encode_e2m1(blocks / scale.unsqueeze(-1)).flatten(-2))
    block_scales = (exponent + E8M0_BIAS).to(torch.uint8)
    return FP4Tensor("mxfp4", codes, block_scales, torch.tensor(1.0, device=weight.device))


QUANTIZERS = {"nvfp4": quantize_nvfp4, "mxfp4": quantize_mxfp4}


def _blocks(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """Check the weight and view it as fp32 blocks [out, in // block, block]."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"{fmt}: expected a 2-D floating weight [out, in], got {tuple(weight.shape)} {weight.dtype}")
    out, inp = weight.shape
    block = BLOCK_SIZE[fmt]
    if inp % block != 0:
        raise ValueError(f"{fmt}: in_features={inp} is not a multiple of the block size {block}")
    bad = (~torch.isfinite(weight)).sum().item()
    if bad:
        raise ValueError(f"{fmt}: the weight has {bad} NaN/Inf entries; refusing to quantize it")
    # The formats are defined on fp32 inputs (a float64 weight is rounded to fp32 once).
    return weight.detach().float().reshape(out, inp // block, block)


_STORAGE = ("codes", "block_scales", "tensor_scale", "kernel_codes", "kernel_scales")
_KERNEL_BLOCK = {"nvfp4": (16, 64), "mxfp4": (1, 32)}  # the kernel layout needs out % a, in % b == 0


class _FrozenLinear(torch.autograd.Function):
    """`x @ W_hat^T + b` for a frozen 4-bit layer: W_hat is decoded in forward and again in backward,
    so autograd keeps only a reference to the layer, never the decoded weight."""

    @staticmethod
    def forward(ctx, x, layer, bias):
        ctx.layer = layer
        return F.linear(x, layer.dequantize(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        grad_x = grad @ ctx.layer.dequantize(grad.dtype) if ctx.needs_input_grad[0] else None
        return grad_x, None, None


class FP4Linear(nn.Linear):
    """A frozen linear layer whose weight is stored only as NVFP4/MXFP4 codes and scales.

    `forward(x)` is `x @ W_hat.T + bias` computed in `x.dtype`, W_hat decoded on the fly in forward
    and again in backward (no dense copy is kept, not even for autograd). Gradients flow to `x`;
    nothing in the layer is trainable. The codes and scales keep their dtypes under `.to(dtype)` /
    `.half()` (they are the format); the bias follows the casts.

    Two layouts hold the same bits: the storage layout of `FP4Tensor` (`codes`, `block_scales`),
    and on CUDA the engine kernels' layout (`kernel_codes`, `kernel_scales`), to which the layer
    converts itself on its first CUDA forward or when the rollout engine asks (`runtime_weight`).

    Args:
        weight: the quantized weight.
        bias: optional bias [out], stored as given (frozen).
    """

    def __init__(self, weight: FP4Tensor, bias: torch.Tensor | None = None):
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a dense weight
        self.format = weight.format
        self.out_features, self.in_features = weight.shape
        self.register_buffer("codes", weight.codes)
        self.register_buffer("block_scales", weight.block_scales)
        self.register_buffer("tensor_scale", weight.tensor_scale)
        self.register_buffer("kernel_codes", None)
        self.register_buffer("kernel_scales", None)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self._out_scale = 1.0  # the tensor scale as a float, read once at conversion
        self.updates = 0  # requantize_ calls: a rollout engine that read the layer checks it

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str, bias_dtype: torch.dtype | None = None) -> FP4Linear:
        """Quantize an `nn.Linear` (round to nearest, no calibration).

        Args:
            linear: the layer to quantize; it is not modified.
            fmt: `nvfp4` or `mxfp4`.
            bias_dtype: dtype to store the bias in; None keeps the linear's.

        Returns:
            The new frozen layer, on the linear's device.
        """
        if fmt not in QUANTIZERS:
            raise ValueError(f"unknown FP4 format {fmt!r}; valid: {', '.join(QUANTIZERS)}")
        bias = linear.bias
        if bias is not None and bias_dtype is not None:
            bias = bias.to(bias_dtype)
        return cls(QUANTIZERS[fmt](linear.weight), bias)

    @property
    def weight(self) -> torch.Tensor:
        """The codes, uint8, two a byte (as `Linear4bit.weight` is its 4-bit data)."""
        return self.codes if self.codes is not None else self.kernel_codes

    @property
    def weight_fp4(self) -> FP4Tensor:
        """The quantized weight as an `FP4Tensor` (shares the buffers); only in the storage layout."""
        if self.codes is None:
            raise RuntimeError("this FP4Linear holds the kernel layout; use dequantize() or runtime_weight()")
        return FP4Tensor(self.format, self.codes, self.block_scales, self.tensor_scale)

    def runtime_weight(self) -> KernelWeight:
        """The weight in the engine kernels' layout (`layout.KernelWeight`).

        On CUDA the layer converts itself (once; its storage-layout buffers are freed), so that the
        engine and the learner read one copy. On the CPU a converted copy is returned and the layer
        keeps its storage layout.
        """
        if self.kernel_codes is not None:
            return KernelWeight(self.format, self.kernel_codes, self.kernel_scales, self._out_scale,
                                self.out_features, self.in_features)
        pw = relayout_nvfp4(self.codes, self.block_scales, self.tensor_scale, self.format)
        if self.codes.is_cuda:
            self.kernel_codes, self.kernel_scales, self._out_scale = pw.codes, pw.scales, pw.out_scale
            self.codes = self.block_scales = None
        return pw

    @torch.no_grad()
    def requantize_(self, weight: torch.Tensor) -> None:
        """Quantize a new dense `weight` [out, in] into this layer's own buffers, in place.

        The buffers keep their addresses, so a rollout engine that reads them (CUDA graphs
        included) sees the new weight; it re-reads the tensor scale when `updates` moves.
        """
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"requantize_ needs a [{self.out_features}, {self.in_features}] weight, "
                             f"got {list(weight.shape)}")
        new = QUANTIZERS[self.format](weight)
        if self.kernel_codes is not None:
            pw = relayout_nvfp4(new.codes, new.block_scales, new.tensor_scale, self.format)
            self.kernel_codes.copy_(pw.codes)
            self.kernel_scales.copy_(pw.scales)
            self._out_scale = pw.out_scale
        else:
            self.codes.copy_(new.codes)
            self.block_scales.copy_(new.block_scales)
        self.tensor_scale.copy_(new.tensor_scale)
        self.updates += 1

    def _kernel_layout_fits(self) -> bool:
        rows, cols = _KERNEL_BLOCK[self.format]
        return self.out_features % rows == 0 and self.in_features % cols == 0

    def dequantize(self, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        """The dense weight W_hat [out, in] in `dtype` (on CUDA: from the kernel layout, through the
        engine's NVFP4 dequant kernel; bit-identical to the storage layout's decode). `out`: a
        contiguous [out, in] tensor the CUDA kernel decodes into (elsewhere the result is returned
        and the caller copies it)."""
        if self.kernel_codes is None and self.codes.is_cuda and self._kernel_layout_fits():
            self.runtime_weight()
        if self.kernel_codes is not None:
            return weight_of(self.runtime_weight(), dtype, out=None if out is None else out.view(-1))
        return self.weight_fp4.dequantize(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return _FrozenLinear.apply(x, self, bias)

    @staticmethod
    def dequantize_stacked(layers: list[FP4Linear], out: torch.Tensor) -> torch.Tensor:
        """`out` [sum of out_features, in] = the layers' weights one after another by rows: in one
        launch for up to three NVFP4 layers on CUDA in the kernel layout, else layer by layer."""
        if 1 <= len(layers) <= 3 and all(m.format == "nvfp4" and m.weight.is_cuda and m._kernel_layout_fits()
                                         for m in layers):
            return stacked_weight([m.runtime_weight() for m in layers], out)
        for m, part in zip(layers, out.split([m.out_features for m in layers])):
            w = m.dequantize(out.dtype, out=part)
            if w.data_ptr() != part.data_ptr():
                part.copy_(w)
        return out

    def quantized_bytes(self) -> int:
        """Bytes this layer stores: codes, every block scale, the tensor scale and the bias."""
        return sum(t.numel() * t.element_size() for t in self.buffers(recurse=False))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}, bias={self.bias is not None}"

    def _apply(self, fn, recurse=True):
        stored = {name: self._buffers[name] for name in _STORAGE if self._buffers[name] is not None}
        super()._apply(fn, recurse)
        for name, before in stored.items():
            after = self._buffers[name]
            if after.dtype != before.dtype:
                self._buffers[name] = before.to(after.device)
        return self


class Handler:
    """The quant handler for `nvfp4` and `mxfp4` (same methods as the other formats' handlers).

    Args:
        format: `nvfp4` or `mxfp4`.
        compute_dtype: dtype the bias is stored in (activations keep their own dtype).
    """

    def __init__(self, format: str, compute_dtype: torch.dtype):
        if format not in QUANTIZERS:
            raise ValueError(f"unknown FP4 format {format!r}; valid: {', '.join(QUANTIZERS)}")
        self.format = format
        self.compute_dtype = compute_dtype

    def quantize_linear(self, linear: nn.Linear) -> FP4Linear:
        """Replace-ready frozen `FP4Linear` for `linear`."""
        return FP4Linear.from_linear(linear, self.format, self.compute_dtype)

    @staticmethod
    def linear_bytes(module: FP4Linear) -> int:
        """Bytes the layer stores (codes, scales, tensor scale, bias)."""
        return module.quantized_bytes()
