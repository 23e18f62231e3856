"""Sampling one token per row (`engine.sampling`): the torch definition against HF's top-p filter
and the softmax it draws from, and `fused_sample` (Triton: the interpreter on CPU, natively on the
GPU) against float64 log-softmax, the same softmax draws, its Philox keys and the engine that
calls it."""

from __future__ import annotations

import sys

import torch

from qerl_exp.engine import sampling
from qerl_exp.engine.fast_engine import FastEngine
from qerl_exp.engine.sampling import fused_sample, sample
from test_engine import gpu, needs_cuda, patch_interpreter, prompts, run_interpreted, tiny_model


def _top_p_hf(logits, top_p):
    from transformers.generation.logits_process import TopPLogitsWarper

    return TopPLogitsWarper(top_p)(None, logits.clone())


def test_sample_top_p_temperature_and_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(4, 10) * 3
    temp, top_p = torch.tensor([0.7]), torch.tensor([0.8])
    gen = torch.Generator().manual_seed(0)
    allowed = torch.isfinite(_top_p_hf(logits / 0.7, 0.8))
    counts = torch.zeros(4, 10)
    for _ in range(3000):
        tok, lp, ent = sample(logits, temp, top_p, greedy=False, use_top_p=True, generator=gen)
        assert allowed.gather(1, tok[:, None]).all()
        counts[torch.arange(4), tok] += 1
    ref_lp = torch.log_softmax(logits / 0.7, -1)
    torch.testing.assert_close(lp, ref_lp.gather(1, tok[:, None])[:, 0])  # before top-p
    torch.testing.assert_close(ent, -(ref_lp.exp() * ref_lp).sum(-1))
    want = torch.softmax(_top_p_hf(logits / 0.7, 0.8), -1)
    assert (counts / 3000 - want).abs().max() < 0.04


def test_sample_greedy_and_full_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5]])
    tok, lp, _ = sample(logits, torch.tensor([1.0]), torch.tensor([1.0]), greedy=True, use_top_p=False)
    assert tok.item() == 2 and torch.allclose(lp, torch.log_softmax(logits, -1)[:, 2])
    gen = torch.Generator().manual_seed(1)
    big = logits.expand(20000, 4)
    tok, _, _ = sample(big, torch.tensor([2.0]), torch.tensor([1.0]), greedy=False, use_top_p=False, generator=gen)
    freq = torch.bincount(tok, minlength=4) / 20000
    assert (freq - torch.softmax(logits[0] / 2.0, -1)).abs().max() < 0.015


# ---------------------------------------------------------------------------------------------
# fused_sample: the same checks on CPU (interpreter) and GPU
# ---------------------------------------------------------------------------------------------


def _key(seed: int, step: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([seed], device=dev), torch.tensor([step], device=dev)


def _check_against_float64(dev, cases) -> None:
    # token, log-prob and entropy against log_softmax in float64, greedy and sampled, fp32 and bf16
    # logits with -inf entries; greedy is torch's argmax; a sampled token is never a -inf one
    g = torch.Generator().manual_seed(0)
    for dtype, b, v in cases:
        x = (torch.randn(b, v, generator=g) * 4).to(dtype)
        x[0, ::7] = float("-inf")
        x = x.to(dev)
        for temp, greedy in ((1.0, True), (1.0, False), (0.7, False)):
            ref = torch.log_softmax(x.double() / temp, -1)
            ent_ref = -torch.where(ref.isfinite(), ref.exp() * ref, 0).sum(-1)
            tok, lp, ent = fused_sample(x, torch.tensor([temp], device=dev), *_key(5, 0, dev), greedy)
            if greedy:
                assert torch.equal(tok, x.float().argmax(-1)), (dtype, b, v)
            assert x.gather(1, tok[:, None]).isfinite().all()
            torch.testing.assert_close(lp.double(), ref.gather(1, tok[:, None])[:, 0], rtol=1e-5, atol=2e-5)
            torch.testing.assert_close(ent.double(), ent_ref, rtol=1e-5, atol=2e-5)


def _check_draws(dev, rows: int, tol: float, per_call: int = 65536) -> None:
    # sampled tokens follow softmax(logits / T): a row of 4 x Q logits, the pattern [2, 1, 0, -inf]
    # repeated, so each of the four tokens of a pattern, and each of the four blocks of Q that share
    # one Philox call, must come up at its share; the same (seed, step) draws the same tokens,
    # another step others, and the draw does not depend on how many slices a row is cut into.
    # Up to `per_call` rows a call (fused_sample's limit), each call one step further
    pattern = torch.tensor([2.0, 1.0, 0.0, float("-inf")], device=dev)
    temp = torch.tensor([2.0], device=dev)
    parts = [fused_sample(pattern.repeat(min(per_call, rows - r0), sampling.Q), temp, *_key(11, 3 + i, dev), False)
             for i, r0 in enumerate(range(0, rows, per_call))]
    tok, lp = torch.cat([p[0] for p in parts]).cpu(), torch.cat([p[1] for p in parts])
    want = torch.softmax(pattern.double().cpu() / 2.0, 0)
    by_token = torch.bincount(tok % 4, minlength=4).double() / rows
    by_block = torch.bincount(tok // sampling.Q, minlength=4).double() / rows
    assert (by_token - want).abs().max() < tol and (by_block - 0.25).abs().max() < tol, (by_token, by_block)
    torch.testing.assert_close(lp.double().cpu(), (want / sampling.Q).log()[tok % 4], rtol=1e-5, atol=1e-5)
    wide = torch.zeros(3, 9000, device=dev)  # uniform over 9000 tokens: draws do not collide by chance
    one = torch.tensor([1.0], device=dev)
    first = fused_sample(wide, one, *_key(7, 0, dev), False)[0]
    assert torch.equal(first, fused_sample(wide, one, *_key(7, 0, dev), False)[0])
    assert not torch.equal(first, fused_sample(wide, one, *_key(7, 1, dev), False)[0])
    assert not torch.equal(first, fused_sample(wide, one, *_key(8, 0, dev), False)[0])
    assert torch.equal(first, fused_sample(wide, one, *_key(7, 0, dev), False, slices=2)[0])  # default: 5


def _check_non_finite(dev) -> None:
    # a NaN logit makes its row's log-prob NaN (the rollout then stops: NonFiniteLogitsError)
    x = torch.randn(3, 300, device=dev)
    x[1, 17] = float("nan")
    _, lp, _ = fused_sample(x, torch.tensor([1.0], device=dev), *_key(1, 0, dev), False)
    assert lp[[0, 2]].isfinite().all() and lp[1].isnan()


def _check_engine(dev) -> None:
    # the triton engine samples through fused_sample: a generator reproduces it, and its log-probs and
    # entropies are the teacher-forced softmax's
    model = tiny_model(device=dev)
    ids, mask = prompts(device=dev)
    eng = FastEngine(model, 4, 32)
    runs = [eng.generate(ids, mask, 6, temperature=0.9, eos_id=-1, pad_id=0, generator=torch.Generator().manual_seed(s))
            for s in (3, 3, 4)]
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
    assert not torch.equal(runs[0].completion_ids, runs[2].completion_ids)
    a = runs[0]
    full = torch.cat([ids, a.completion_ids], 1)
    fmask = torch.cat([mask, torch.ones_like(a.completion_ids)], 1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=fmask,
                       position_ids=(fmask.cumsum(1) - 1).clamp_min(0)).logits[:, ids.shape[1] - 1:-1].float()
    lp = torch.log_softmax(logits / 0.9, -1)
    torch.testing.assert_close(a.logprobs, lp.gather(2, a.completion_ids[..., None])[..., 0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(a.entropy, -(lp.exp() * lp).sum(-1), rtol=1e-4, atol=1e-4)


def _interp_main() -> None:
    patch_interpreter()
    _check_against_float64("cpu", [(torch.float32, 3, 5000), (torch.bfloat16, 2, 9000)])
    _check_draws("cpu", 1000, 0.075, per_call=400)  # 5 standard errors at 1000 rows: 0.079
    _check_non_finite("cpu")
    _check_engine("cpu")
    print("SAMPLING INTERPRETER CHECKS OK")


def test_fused_sample_in_the_interpreter():
    run_interpreted(__file__, "SAMPLING INTERPRETER CHECKS OK", 600)


@gpu
@needs_cuda
def test_gpu_fused_sample_matches_float64_and_draws_from_the_softmax():
    # Qwen2.5's vocabulary at 1-256 rows (75 to 8 slices a row); 200000 rows: 5 standard errors 0.006
    _check_against_float64("cuda", [(torch.bfloat16, b, 152064) for b in (1, 17, 64, 256)])
    _check_draws("cuda", 200000, 0.006)
    _check_non_finite("cuda")
    _check_engine("cuda")


@gpu
@needs_cuda
def test_gpu_fused_sample_replays_in_a_cuda_graph_with_a_new_step():
    x = torch.randn(64, 152064, device="cuda", dtype=torch.bfloat16)
    temp = torch.tensor([1.0], device="cuda")
    seed, step = _key(9, 0, "cuda")
    fused_sample(x, temp, seed, step, False)  # compiled outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tok, _, _ = fused_sample(x, temp, seed, step, False)
    drawn = []
    for s in (0, 1, 0):
        step.fill_(s)
        g.replay()
        drawn.append(tok.clone())
    assert torch.equal(drawn[0], fused_sample(x, temp, *_key(9, 0, "cuda"), False)[0])
    assert torch.equal(drawn[0], drawn[2]) and not torch.equal(drawn[0], drawn[1])


if __name__ == "__main__" and "--interp" in sys.argv:
    _interp_main()
