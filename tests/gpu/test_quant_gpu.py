"""NVFP4/MXFP4 on CUDA: the same bits as on CPU, and the frozen layer with LoRA on the GPU."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_qwen2, with_lora
from qerl_exp.config import QuantConfig
from qerl_exp.quant import quantize_model
from qerl_exp.quant.fp4 import FP4Linear, quantize_mxfp4, quantize_nvfp4

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
QUANTIZE = {"nvfp4": quantize_nvfp4, "mxfp4": quantize_mxfp4}


def _hard_weights() -> torch.Tensor:
    """Outliers, exact ties in bf16 (amax 4.375), zero blocks and blocks with subnormal scales."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 1024, generator=g).clamp(-4, 4)
    w[0, 0] = 4.375
    w[torch.rand(w.shape, generator=g) < 0.002] *= 50
    w[:, 64:128] = 0.0
    w[7, 256:512] *= 1e-7
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_cuda_quantization_equals_cpu(fmt, dtype):
    w = _hard_weights().to(dtype)
    cpu, gpu = QUANTIZE[fmt](w), QUANTIZE[fmt](w.cuda())
    assert gpu.codes.is_cuda and gpu.block_scales.is_cuda and gpu.tensor_scale.is_cuda
    assert torch.equal(gpu.codes.cpu(), cpu.codes)
    assert torch.equal(gpu.block_scales.cpu().view(torch.uint8), cpu.block_scales.view(torch.uint8))
    assert torch.equal(gpu.tensor_scale.cpu(), cpu.tensor_scale)
    assert torch.equal(gpu.dequantize().cpu(), cpu.dequantize())


def _tiny_model():
    return tiny_qwen2().cuda()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_lora_on_cuda_fp4_linear_matches_the_dense_equivalent(fmt):
    quantized = quantize_model(_tiny_model(), QuantConfig(format=fmt), torch.float32)
    dense = _tiny_model()
    for name, module in quantized.named_modules():
        if isinstance(module, FP4Linear):
            assert module.codes.is_cuda
            with torch.no_grad():
                dense.get_submodule(name).weight.copy_(module.dequantize())
    quantized, dense = with_lora(quantized), with_lora(dense)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2)).cuda()
    grads = []
    for model in (quantized, dense):
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert len(grads[0]) == 28 and all(p.is_cuda for p in grads[0].values())
    for n, g in grads[0].items():
        assert g.abs().sum() > 0
        torch.testing.assert_close(g, grads[1][n], rtol=1e-4, atol=1e-6)


def test_bf16_forward_and_backward_on_cuda():
    model = with_lora(quantize_model(_tiny_model().to(torch.bfloat16), QuantConfig(format="nvfp4"), torch.bfloat16))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert layer.bias.dtype == torch.bfloat16 and layer.block_scales.dtype == torch.float8_e4m3fn
    ids = torch.randint(0, 96, (2, 12), device="cuda")
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert len(grads) == 28 and all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_cuda_fp4_linear_converts_to_one_kernel_layout_and_keeps_no_dense_weight(fmt):
    torch.manual_seed(3)
    layer = FP4Linear.from_linear(torch.nn.Linear(1024, 512).cuda(), fmt, torch.bfloat16)
    w = layer.weight_fp4.dequantize(torch.float64)  # the storage layout's decode, before conversion
    stored = layer.quantized_bytes()
    x = torch.randn(4, 33, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
        y = layer(x)
    assert layer.codes is None and layer.kernel_codes is not None and layer.quantized_bytes() == stored
    assert sum(saved) <= 0.3 * 512 * 1024 * 2
    assert torch.equal(layer.dequantize(torch.float32).double(), w)  # the kernel's decode: same bits
    want = x.detach().double() @ w.T + layer.bias.double()
    assert ((y.double() - want).norm() / want.norm()).item() < 1e-2
    g = torch.randn_like(y)
    y.backward(g)
    want_grad = g.double() @ w
    assert ((x.grad.double() - want_grad).norm() / want_grad.norm()).item() < 1e-2


def test_engine_reads_the_policy_s_own_nvfp4_layout():
    from qerl_exp.engine import FastEngine

    model = with_lora(quantize_model(_tiny_model().to(torch.bfloat16), QuantConfig(format="nvfp4"), torch.bfloat16))
    layers = [m for m in model.modules() if isinstance(m, FP4Linear)]
    before = sum(m.quantized_bytes() for m in layers)
    allocated = torch.cuda.memory_allocated()
    engine = FastEngine(model, max_batch_size=2, max_seq_len=64)
    assert all(m.kernel_codes is not None for m in layers) and sum(m.quantized_bytes() for m in layers) == before
    # the engine's own memory is the KV cache and buffers, no copy of the 4-bit weights
    assert torch.cuda.memory_allocated() - allocated <= engine.nbytes + 2**20
