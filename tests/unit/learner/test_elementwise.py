"""The learner's hand-fused elementwise kernels (`qerl_exp.decoders.elementwise`) against the torch
definitions they replace (`qerl_exp.decoders.padding_free`), run in float64 as the independent computation:
values and input gradients, at odd widths (masked lanes) and on strided views, in the Triton
interpreter on the CPU and natively on CUDA."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import patch_interpreter, run_interpreted
from qerl_exp.decoders import blocks, padding_free

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}  # of the reference's largest magnitude; bf16: two ulps


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    err, scale = (got.double() - want).abs().max().item(), want.abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.3g} against a scale of {scale:.3g}"


def _compare(fused, reference, inputs: list[torch.Tensor], dtype: torch.dtype, name: str) -> None:
    """`fused` on `inputs` in `dtype` against `reference` on float64 copies: outputs and the gradients
    of every floating input that requires grad, under one random upstream gradient per output."""
    low = [t.detach().to(dtype).requires_grad_(t.requires_grad) for t in inputs]
    high = [t.detach().to(dtype).double().requires_grad_(t.requires_grad) for t in inputs]
    outs, refs = fused(*low), reference(*high)
    outs, refs = (outs, refs) if isinstance(outs, tuple) else ((outs,), (refs,))
    grads = [torch.randn_like(r) for r in refs]
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.dtype == dtype and o.shape == r.shape
        _close(o, r, TOL[dtype], f"{name} output {i}")
    wrt_low = [t for t in low if t.requires_grad]
    wrt_high = [t for t in high if t.requires_grad]
    got = torch.autograd.grad(outs, wrt_low, [g.to(dtype) for g in grads])
    want = torch.autograd.grad(refs, wrt_high, grads)
    for i, (g, w) in enumerate(zip(got, want)):
        _close(g, w, 2 * TOL[dtype], f"{name} gradient {i}")


def _check(device: str, dtypes: list[torch.dtype], n: int, hidden: int, inter: int, hq: int, hk: int, d: int) -> None:
    from qerl_exp.decoders import elementwise

    torch.manual_seed(0)
    eps = 1e-6
    x, delta = torch.randn(n, hidden, device=device, requires_grad=True), torch.randn(n, hidden, device=device, requires_grad=True)
    weight = 1 + 0.1 * torch.randn(hidden, device=device)
    gate_up = 2 * torch.randn(n, 2 * inter, device=device, requires_grad=True)
    qkv = torch.randn(n, (hq + 2 * hk) * d, device=device, requires_grad=True)
    angle = torch.rand(n, d // 2, device=device) * 6
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)

    def heads(rope):  # q and k as the packed block takes them: strided views of one q|k|v output
        def run(qkv, cos, sin):
            q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
            return rope(q.view(n, hq, d), k.view(n, hk, d), cos, sin)
        return run

    for dtype in dtypes:
        _compare(lambda x, w: elementwise.rms_norm(x, w, eps), lambda x, w: blocks.rms_norm(x, w, eps),
                 [x, weight], dtype, "rms_norm")
        _compare(lambda x, dl, w: elementwise.add_rms_norm(x, dl, w, eps),
                 lambda x, dl, w: padding_free._add_rms_norm(x, dl, w, eps), [x, delta, weight], dtype, "add_rms_norm")
        _compare(elementwise.swiglu, padding_free._swiglu, [gate_up], dtype, "swiglu")
        _compare(heads(elementwise.rope), heads(padding_free._rope), [qkv, cos, sin], dtype, "rope")


def _interp_main() -> None:
    patch_interpreter()
    _check("cpu", [torch.float32, torch.bfloat16], n=5, hidden=96, inter=80, hq=3, hk=1, d=16)
    print("ELEMENTWISE INTERPRETER CHECKS OK")


def test_the_fused_elementwise_ops_in_the_interpreter():
    run_interpreted(__file__, "ELEMENTWISE INTERPRETER CHECKS OK", 600)


@gpu
@needs_cuda
@pytest.mark.parametrize("shape", [dict(hidden=3584, inter=18944, hq=28, hk=4, d=128),  # Qwen2.5-7B
                                   dict(hidden=576, inter=1536, hq=9, hk=3, d=64)])  # SmolLM2-135M
def test_gpu_fused_elementwise_ops_equal_the_torch_definitions(shape):
    _check("cuda", [torch.float32, torch.bfloat16], n=300, **shape)


if __name__ == "__main__" and "--interp" in sys.argv:
    _interp_main()
