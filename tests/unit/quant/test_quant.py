"""Quantization formats: NVFP4/MXFP4 against torchao and a scalar reference, exact round trips,
the frozen FP4 layer under peft LoRA, the bitsandbytes after-generate trap, and byte accounting."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from conftest import tiny_qwen2, with_lora
from qerl_exp.config import QuantConfig
from qerl_exp.quant import dense_weight, memory_bytes, quantize_linear, quantize_model
from qerl_exp.quant.fp4 import (
    E2M1_VALUES,
    FP4Linear,
    Handler,
    decode_e2m1,
    encode_e2m1,
    pack_fp4,
    quantize_mxfp4,
    quantize_nvfp4,
    unpack_fp4,
)

GRID = torch.tensor(E2M1_VALUES)
# Every finite non-negative E4M3 value, from torch's own decoding of the 256 bit patterns.
E4M3_BYTES = torch.arange(256, dtype=torch.uint8)
E4M3_VALUES = E4M3_BYTES.view(torch.float8_e4m3fn).float()
E4M3_POSITIVE = sorted({v for v in E4M3_VALUES.tolist() if math.isfinite(v) and v > 0})


def _weights(kind: str, shape=(64, 256), seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    if kind == "outliers":
        # heavy tails: 1% of entries x100, a few x1000, some rows scaled up
        w = torch.where(torch.rand(shape, generator=g) < 0.01, w * 100, w)
        w[torch.randint(0, shape[0], (4,), generator=g), torch.randint(0, shape[1], (4,), generator=g)] = 3000.0
        w[::7] *= 20
    elif kind == "ties":
        # amax 4.375 = 35/8: in bf16, amax(block) * 448 / amax often lands exactly between two E4M3
        # values, and the fp32-rounded tensor scale decides the tie unless the order of operations
        # is the reference's.
        w = w.clamp(-4, 4)
        w[0, 0] = 4.375
    elif kind == "zero_blocks":
        w[:, 32:96] = 0.0  # whole NVFP4 and MXFP4 blocks
        w[5] = 0.0
    elif kind == "zeros":
        w = torch.zeros(shape)
    return w


def _ao_nvfp4(w: torch.Tensor):
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

    tensor_scale = per_tensor_amax_to_scale(w.abs().amax())
    scales, codes = nvfp4_quantize(w.contiguous(), 16, tensor_scale)
    return codes, scales, tensor_scale


def _ao_mxfp4(w: torch.Tensor):
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    scales, codes = to_mx(w.contiguous(), torch.float4_e2m1fn_x2, 32)
    return codes, scales.view(torch.uint8)


# ---------------------------------------------------------------- E2M1 elements and packing


def test_every_e2m1_code_round_trips():
    codes = torch.arange(16, dtype=torch.uint8)
    values = decode_e2m1(codes)
    assert values[:8].tolist() == list(E2M1_VALUES)
    assert values[8:].tolist() == [-v for v in E2M1_VALUES]
    assert torch.equal(encode_e2m1(values), codes)  # -0.0 -> 0b1000 as well


def test_e2m1_rounds_to_nearest_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.0001, 6.5, 7.0, 1e30, 0.2499, 0.7501])
    expect = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 6.0, 0.0, 1.0]
    assert decode_e2m1(encode_e2m1(x)).tolist() == expect
    assert decode_e2m1(encode_e2m1(-x)).tolist() == [-v for v in expect]
    assert encode_e2m1(torch.tensor([-1e-30, -0.0, 0.0])).tolist() == [8, 8, 0]


def test_e2m1_rounding_equals_brute_force_nearest():
    g = torch.Generator().manual_seed(0)
    mids = (GRID[1:] + GRID[:-1]) / 2
    x = torch.cat([torch.rand(4000, generator=g) * 7, mids, torch.nextafter(mids, torch.zeros(7)),
                   torch.nextafter(mids, torch.full((7,), 9.0)), GRID])
    dist = (x[:, None] - GRID[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    # Among equally near grid points take the even index.
    candidates = torch.where(dist == best, torch.arange(8), 99)
    even = torch.where(candidates % 2 == 0, candidates, 99).min(dim=1).values
    expect = torch.where(even < 99, even, candidates.min(dim=1).values)
    assert torch.equal(encode_e2m1(x).long(), expect)


def test_pack_puts_even_elements_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert torch.equal(unpack_fp4(packed), codes)


# ---------------------------------------------------------------- against torchao


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["random", "outliers", "ties", "zero_blocks"])
def test_nvfp4_equals_torchao(kind, dtype):
    w = _weights(kind).to(dtype)
    q = quantize_nvfp4(w)
    codes, scales, tensor_scale = _ao_nvfp4(w)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (64, 128)
    assert q.block_scales.dtype == torch.float8_e4m3fn and q.block_scales.shape == (64, 16)
    assert q.tensor_scale.dtype == torch.float32 and q.tensor_scale.dim() == 0
    assert torch.equal(q.codes, codes)
    assert torch.equal(q.tensor_scale, tensor_scale)
    ours, theirs = q.block_scales.view(torch.uint8), scales.view(torch.uint8)
    zero = w.float().view(64, 16, 16).abs().amax(-1) == 0
    assert torch.equal(ours[~zero], theirs[~zero])
    # torchao clamps a zero block's scale up to 2**-6; ours is exactly 0 (codes are 0 in both).
    assert (q.block_scales.float()[zero] == 0).all()
    assert (scales.float()[zero] == 2.0**-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["random", "outliers", "ties", "zero_blocks", "zeros"])
def test_mxfp4_equals_torchao(kind, dtype):
    w = _weights(kind).to(dtype)
    q = quantize_mxfp4(w)
    codes, scales = _ao_mxfp4(w)
    assert q.block_scales.dtype == torch.uint8 and q.block_scales.shape == (64, 8)
    assert q.tensor_scale.item() == 1.0
    assert torch.equal(q.codes, codes)
    assert torch.equal(q.block_scales, scales)


def test_all_zero_tensor():
    w = torch.zeros(32, 64)
    q = quantize_nvfp4(w)
    assert q.tensor_scale.item() == 0.0
    assert (q.block_scales.float() == 0).all() and (q.codes == 0).all()
    assert torch.equal(q.dequantize(), w)
    # torchao's two-level NVFP4 gives NaN scales here; its single-level codes are zero too.
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize

    assert torch.equal(q.codes, nvfp4_quantize(w, 16)[1])
    m = quantize_mxfp4(w)
    assert (m.codes == 0).all() and (m.block_scales == 0).all() and torch.equal(m.dequantize(), w)


# ---------------------------------------------------------------- exact round trips


def _all_codes_block(g: torch.Generator, block: int) -> torch.Tensor:
    """A block holding each of the 16 codes (at least once), shuffled."""
    codes = torch.arange(block) % 16
    return codes[torch.randperm(block, generator=g)].to(torch.uint8)


def test_nvfp4_every_representable_value_round_trips():
    g = torch.Generator().manual_seed(0)
    tensor_scale = 2.0**-3
    # One block per nonzero E4M3 scale (the 448 block makes amax = 6 * 448 * tensor_scale), plus a
    # zero-scale block; each block holds all 16 codes, so all 126 * 16 values appear.
    scales = torch.tensor(E4M3_POSITIVE + [0.0])
    codes = torch.stack([_all_codes_block(g, 16) for _ in scales])  # [n_blocks, 16]
    codes[-1] = codes[-1] & 8  # the zero block holds +-0
    w = (decode_e2m1(codes) * scales[:, None] * tensor_scale).view(1, -1)
    q = quantize_nvfp4(w)
    assert q.tensor_scale.item() == tensor_scale
    assert torch.equal(q.block_scales.float().view(-1), scales)
    assert torch.equal(q.codes, pack_fp4(codes.view(1, -1)))
    assert torch.equal(q.dequantize(), w)


def test_mxfp4_every_representable_value_round_trips():
    g = torch.Generator().manual_seed(0)
    # Exponents 253 and 254 would need values above the fp32 maximum.
    exponents = torch.arange(0, 253)
    codes = torch.stack([_all_codes_block(g, 32) for _ in exponents])
    scale = torch.exp2(exponents.double() - 127)
    w = (decode_e2m1(codes).double() * scale[:, None]).float().view(1, -1)
    assert torch.isfinite(w).all()
    q = quantize_mxfp4(w)
    assert torch.equal(q.block_scales.view(-1), exponents.to(torch.uint8))
    assert torch.equal(q.codes, pack_fp4(codes.view(1, -1)))
    assert torch.equal(q.dequantize(), w)


# ---------------------------------------------------------------- small, tiny, huge


def _nearest(value: float, grid: list[float], codes: list[int]) -> int:
    """Code of the grid point nearest to value; ties to the even code; saturate at the top."""
    value = min(value, grid[-1])
    dists = [abs(value - v) for v in grid]
    best = min(dists)
    return min((c for c, d in zip(codes, dists) if d == best), key=lambda c: (c % 2, c))


def _reference_nvfp4(w: torch.Tensor):
    """A scalar NVFP4 quantizer in numpy fp32 (same operation order), with brute-force rounding."""
    e4m3_values = [0.0] + E4M3_POSITIVE
    e4m3_codes = [int(b) for b in E4M3_BYTES[[E4M3_VALUES.tolist().index(v) for v in e4m3_values]]]
    a = w.numpy().astype(np.float32)
    s_t = np.float32(np.abs(a).max()) / np.float32(6 * 448)
    out, n = a.shape
    scales = np.zeros((out, n // 16), dtype=np.uint8)
    codes = np.zeros((out, n), dtype=np.uint8)
    for r in range(out):
        for b in range(n // 16):
            blk = a[r, 16 * b:16 * (b + 1)]
            x = (np.float32(np.abs(blk).max()) / np.float32(6)) / s_t
            byte = _nearest(float(x), e4m3_values, e4m3_codes)
            scales[r, b] = byte
            s_b = np.float32(torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item())
            for i, v in enumerate(blk):
                y = v * ((np.float32(1) / s_t) / s_b) if s_b > 0 else np.float32(0)
                idx = _nearest(abs(float(y)), list(E2M1_VALUES), list(range(8)))
                codes[r, 16 * b + i] = (int(np.signbit(v)) << 3) | idx
    return torch.from_numpy(codes), torch.from_numpy(scales)


def test_nvfp4_small_blocks_use_e4m3_subnormals_and_zero_scales():
    g = torch.Generator().manual_seed(1)
    # Block b of each row is scaled by 10**-b: scales from normal E4M3 down through subnormals
    # (below 2**-6) to blocks that round to a zero scale.
    factors = torch.tensor([10.0 ** -b for b in range(8)]).repeat_interleave(16)
    w = torch.randn(3, 128, generator=g) * factors
    w[0, 0] = 8.0
    q = quantize_nvfp4(w)
    codes, scales = _reference_nvfp4(w)
    assert torch.equal(unpack_fp4(q.codes), codes)
    assert torch.equal(q.block_scales.view(torch.uint8), scales)
    s = q.block_scales.float()
    assert ((s > 0) & (s < 2.0**-6)).any() and (s == 0).any()
    assert torch.isfinite(q.dequantize()).all()


@pytest.mark.parametrize("k", [-100, 100])
def test_tiny_and_huge_weights_scale_exactly(k):
    w = _weights("outliers")
    scaled = w * 2.0**k
    assert torch.isfinite(scaled).all() and (scaled.abs().amax() > 0)
    a, b = quantize_nvfp4(w), quantize_nvfp4(scaled)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.block_scales.float(), b.block_scales.float())
    assert b.tensor_scale.item() == a.tensor_scale.item() * 2.0**k
    assert torch.equal(b.dequantize(), a.dequantize() * 2.0**k)
    a, b = quantize_mxfp4(w), quantize_mxfp4(scaled)
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(b.block_scales.int(), a.block_scales.int() + k)


def test_quantization_error_is_bounded_by_half_a_grid_step():
    w = _weights("random")
    for q, block in ((quantize_nvfp4(w), 16), (quantize_mxfp4(w), 32)):
        scale = q.scales() * (q.tensor_scale if q.format == "nvfp4" else 1.0)
        err = (q.dequantize() - w).abs().view(64, -1, block)
        # Half the largest E2M1 step (2) times the block scale, plus saturation for MXFP4's blocks
        # whose amax lands in (6, 8) times the scale.
        bound = scale.unsqueeze(-1) * (1.0 if q.format == "nvfp4" else 2.0)
        assert (err <= bound + 1e-6).all()


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("quantize", [quantize_nvfp4, quantize_mxfp4])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_are_refused(quantize, bad):
    w = torch.randn(8, 64)
    w[3, 5] = bad
    with pytest.raises(ValueError, match="NaN/Inf"):
        quantize(w)


def test_shapes_that_do_not_block_are_refused():
    with pytest.raises(ValueError, match="in_features=40 is not a multiple of the block size 16"):
        quantize_nvfp4(torch.randn(8, 40))
    with pytest.raises(ValueError, match="in_features=48 is not a multiple of the block size 32"):
        quantize_mxfp4(torch.randn(8, 48))
    with pytest.raises(ValueError, match="2-D"):
        quantize_nvfp4(torch.randn(64))
    with pytest.raises(ValueError, match="valid: nvfp4, mxfp4"):
        Handler("fp4", torch.float32)


# ---------------------------------------------------------------- the frozen layer


def _independent_dequant(layer: FP4Linear) -> torch.Tensor:
    """Decode the buffers with plain bit operations (not the module's own decoder)."""
    lo, hi = layer.codes & 0xF, layer.codes >> 4
    nib = torch.stack((lo, hi), -1).view(layer.out_features, layer.in_features).long()
    vals = GRID[nib & 7] * (1 - 2 * (nib >> 3)).float()
    if layer.format == "nvfp4":
        scale = layer.block_scales.double() * layer.tensor_scale.double()  # exact, rounded once below
    else:
        scale = 2.0 ** (layer.block_scales.double() - 127)
    return (vals.double() * scale.double().repeat_interleave(layer.in_features // scale.shape[1], 1)).float()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_linear_output_equals_dense_matmul(fmt):
    torch.manual_seed(0)
    linear = nn.Linear(256, 96)
    layer = Handler(fmt, torch.float32).quantize_linear(linear)
    assert isinstance(layer, FP4Linear) and not list(layer.parameters())
    w_hat = _independent_dequant(layer)
    assert torch.equal(layer.dequantize(), w_hat)
    x = torch.randn(3, 5, 256)
    expect = (x.double() @ w_hat.double().T + linear.bias.double()).float()
    torch.testing.assert_close(layer(x), expect, rtol=1e-5, atol=1e-5)
    # F.linear and `x @ W.T + b` may take different BLAS paths (they do on AMD EPYC): equal to
    # rounding, not bit for bit.
    torch.testing.assert_close(layer(x), x @ layer.dequantize().T + layer.bias, rtol=1e-6, atol=1e-6)
    y = layer(x.bfloat16())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expect, rtol=0.05, atol=0.05)


def test_fp4_linear_keeps_its_format_under_dtype_casts():
    layer = FP4Linear.from_linear(nn.Linear(64, 32), "nvfp4")
    before = layer.dequantize()
    layer.to(torch.bfloat16)
    layer.half()
    assert layer.codes.dtype == torch.uint8 and layer.block_scales.dtype == torch.float8_e4m3fn
    assert layer.tensor_scale.dtype == torch.float32 and layer.bias.dtype == torch.float16
    assert torch.equal(layer.dequantize(), before)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_requantize_in_place_equals_a_fresh_layer_at_the_same_addresses(fmt):
    torch.manual_seed(0)
    layer = FP4Linear.from_linear(nn.Linear(128, 48), fmt)
    addresses = [t.data_ptr() for t in (layer.codes, layer.block_scales, layer.tensor_scale)]
    new = nn.Linear(128, 48)
    with torch.no_grad():
        new.weight.mul_(7.0)  # another tensor scale
    layer.requantize_(new.weight)
    assert torch.equal(layer.dequantize(), _independent_dequant(FP4Linear.from_linear(new, fmt)))
    assert [t.data_ptr() for t in (layer.codes, layer.block_scales, layer.tensor_scale)] == addresses
    assert layer.updates == 1
    with pytest.raises(ValueError, match=r"\[48, 128\] weight"):
        layer.requantize_(new.weight.t())


# ---------------------------------------------------------------- LoRA through peft




def _lora_grads(model, ids):
    model.train()
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


IDS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_lora_on_fp4_linear_gets_the_gradients_of_the_dense_equivalent(fmt):
    from peft.tuners.lora import Linear as LoraLinear

    quantized = quantize_model(tiny_qwen2(), QuantConfig(format=fmt), torch.float32)
    # The same model with each FP4Linear replaced by a dense nn.Linear holding W_hat.
    dense = tiny_qwen2()
    for name, module in quantized.named_modules():
        if isinstance(module, FP4Linear):
            ref = dense.get_submodule(name)
            with torch.no_grad():
                ref.weight.copy_(module.dequantize())
    codes_before = quantized.model.layers[0].mlp.down_proj.codes.clone()
    quantized, dense = with_lora(quantized), with_lora(dense)

    wrapped = quantized.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(wrapped, LoraLinear) and isinstance(wrapped.get_base_layer(), FP4Linear)
    embeds = quantized.get_input_embeddings()(IDS).detach().requires_grad_(True)
    quantized.train()
    quantized(inputs_embeds=embeds, labels=IDS).loss.backward()
    grads = {n: p.grad for n, p in quantized.named_parameters() if p.requires_grad}
    assert len(grads) == 2 * 2 * 7 and all("lora_" in n for n in grads)
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())
    assert embeds.grad is not None and embeds.grad.abs().sum() > 0

    ref_grads = _lora_grads(dense, IDS)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6)
    assert torch.equal(quantized.base_model.model.model.layers[0].mlp.down_proj.base_layer.codes, codes_before)


# ---------------------------------------------------------------- bitsandbytes NF4 on CPU


def _nf4_policy(double_quant: bool, avx512_repack: bool = False):
    import bitsandbytes as bnb

    model = quantize_model(tiny_qwen2(), QuantConfig(format="nf4", double_quant=double_quant), torch.float32)
    if avx512_repack:  # undo the guard, to show what it guards against
        for m in model.modules():
            if isinstance(m, bnb.nn.Linear4bit):
                m.support_avx512bf16_for_cpu = True
    return with_lora(model)


def _generate(model):
    model.eval()
    with torch.no_grad():
        model.generate(input_ids=IDS[:, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_lora_gradients_after_generate_equal_a_fresh_model(double_quant):
    fresh = _lora_grads(_nf4_policy(double_quant), IDS)
    model = _nf4_policy(double_quant)
    _generate(model)
    after = _lora_grads(model, IDS)
    assert fresh.keys() == after.keys() and len(fresh) == 28
    assert all(g.abs().sum() > 0 for g in fresh.values())
    for n in fresh:
        assert torch.equal(fresh[n], after[n]), n


def test_the_avx512_repack_breaks_backward_without_the_guard():
    from bitsandbytes.functional import has_avx512bf16

    if not has_avx512bf16():
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes never repacks here")
    fresh = _lora_grads(_nf4_policy(False, avx512_repack=True), IDS)
    model = _nf4_policy(False, avx512_repack=True)
    _generate(model)
    try:
        after = _lora_grads(model, IDS)
    except RuntimeError:
        return  # Qwen2's q/k/v have a bias: backward crashes
    assert any(not torch.equal(fresh[n], after[n]) for n in fresh)


# ---------------------------------------------------------------- memory accounting

LINEARS = {  # name: (out, in, bias) of the tiny Qwen2 (kv dim 2 heads * 32)
    "q_proj": (128, 128, True), "k_proj": (64, 128, True), "v_proj": (64, 128, True),
    "o_proj": (128, 128, False), "gate_proj": (256, 128, False), "up_proj": (256, 128, False),
    "down_proj": (128, 256, False),
}


def _hand_bytes(fmt: str, out: int, inp: int, bias: bool) -> int:
    """Bytes of one quantized linear, from the format definitions (fp32 compute dtype)."""
    n = out * inp
    b = 4 * out if bias else 0
    if fmt == "nvfp4":  # codes + E4M3 per 16 + fp32 tensor scale
        return n // 2 + n // 16 + 4 + b
    if fmt == "mxfp4":  # codes + E8M0 per 32 + the (unit) fp32 tensor scale
        return n // 2 + n // 32 + 4 + b
    if fmt == "nf4":  # codes + fp32 absmax per 64 + the 16-entry fp32 code book
        return n // 2 + 4 * (n // 64) + 16 * 4 + b
    if fmt == "nf4_dq":  # codes + uint8 absmax per 64 + fp32 offset + fp32 absmax per 256 absmax
        #                  + the two code books (16 and 256 fp32 entries)
        return n // 2 + n // 64 + 4 + 4 * math.ceil(n / 64 / 256) + 16 * 4 + 256 * 4 + b
    raise AssertionError(fmt)


def _quant_cfg(fmt: str) -> QuantConfig:
    return QuantConfig(format="nf4", double_quant=True) if fmt == "nf4_dq" else QuantConfig(format=fmt)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4", "nf4_dq"])
def test_memory_bytes_match_hand_counts(fmt):
    model = quantize_model(tiny_qwen2(), _quant_cfg(fmt), torch.float32)
    hidden, vocab, layers = 128, 96, 2
    linear = layers * sum(_hand_bytes(fmt, *shape) for shape in LINEARS.values())
    # embeddings + untied lm_head + 2 norms per layer + final norm, fp32; rotary inv_freq x2 (16 each)
    rest = 4 * (2 * vocab * hidden + (2 * layers + 1) * hidden) + 2 * 16 * 4
    mem = memory_bytes(model)
    assert mem["mem/quantized_linear_bytes"] == linear
    assert mem["mem/weights_bytes"] == linear + rest
    # LoRA adds exactly its own fp32 parameters (nothing counted twice through peft's wrappers).
    lora_bytes = layers * sum(8 * (i + o) * 4 for o, i, _ in LINEARS.values())
    mem_lora = memory_bytes(with_lora(model))
    assert mem_lora["mem/quantized_linear_bytes"] == linear
    assert mem_lora["mem/weights_bytes"] == linear + rest + lora_bytes


def test_memory_bytes_of_the_unquantized_model():
    model = tiny_qwen2()
    n_params = sum(p.numel() for p in model.parameters())
    assert memory_bytes(model) == {"mem/weights_bytes": 4 * n_params + 2 * 16 * 4, "mem/quantized_linear_bytes": 0}


@pytest.mark.parametrize("fmt", ["none", "nvfp4", "mxfp4", "nf4", "nf4_dq"])
def test_dense_weight_is_what_the_layer_multiplies_by(fmt):
    torch.manual_seed(0)
    linear = nn.Linear(128, 64)
    layer = linear if fmt == "none" else quantize_linear(linear, _quant_cfg(fmt), torch.float32)
    w = dense_weight(layer)
    assert w.shape == (64, 128) and w.dtype == torch.float32
    x = torch.randn(4, 128)
    torch.testing.assert_close(layer(x), x @ w.T + linear.bias, rtol=1e-5, atol=1e-5)
    if fmt != "none":  # a real quantization: close to the original, not equal
        err = (w - linear.weight).abs().max().item()
        assert 0 < err < 0.2 * linear.weight.abs().max().item()


# ---------------------------------------------------------------- quant.fake: the damage without the 4-bit layer


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_fake_round_keeps_plain_linears_holding_what_the_format_multiplies_by(fmt):
    real = quantize_model(tiny_qwen2(), QuantConfig(format=fmt), torch.float32)
    fake = quantize_model(tiny_qwen2(), QuantConfig(format=fmt, fake="round"), torch.float32)
    for name, module in fake.named_modules():
        if name.endswith("_proj") and ".layers." in name:
            assert type(module) is torch.nn.Linear
            assert torch.equal(module.weight, dense_weight(real.get_submodule(name)))


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4"])
def test_fake_noise_has_the_rounding_errors_size_in_every_row_and_not_its_values(fmt):
    dense = tiny_qwen2()
    real = quantize_model(tiny_qwen2(), QuantConfig(format=fmt), torch.float32)
    noisy = quantize_model(tiny_qwen2(), QuantConfig(format=fmt, fake="noise"), torch.float32)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        w = dense.get_submodule(name).weight
        error = dense_weight(real.get_submodule(name)) - w
        noise = noisy.get_submodule(name).weight - w
        ratio = noise.pow(2).mean(1).sqrt() / error.pow(2).mean(1).sqrt()
        assert ratio.mean().item() == pytest.approx(1.0, abs=0.05) and ratio.min() > 0.6
        assert abs(torch.corrcoef(torch.stack((noise.flatten(), error.flatten())))[0, 1]) < 0.1


def test_fake_quant_needs_a_format():
    with pytest.raises(ValueError, match="quant.fake=round needs a format"):
        QuantConfig(format="none", fake="round")
