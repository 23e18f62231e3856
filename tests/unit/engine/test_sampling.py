"""Sampling one token per row (`engine.sampling`): the torch definition against HF's warpers (top-k,
top-p, min-p) and the softmax it draws from, and `fused_sample` (Triton: the interpreter on CPU,
natively on the GPU) against float64 log-softmax, the same softmax draws, its Philox keys and the
engine that calls it; top-k and min-p as a threshold per row, several EOS ids; and the HF rollout
path's filtered log-probs, stop strings and EOS ids."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from qerl_exp.config import AlgoConfig
from qerl_exp.engine import sampling
from qerl_exp.engine.fast_engine import FastEngine
from qerl_exp.engine.sampling import fused_sample, keep_threshold, sample
from qerl_exp.rl.rollout import completion_mask, warpers
from conftest import patch_interpreter, run_interpreted
from test_engine import gpu, needs_cuda, prompts, tiny_model


def _hf_filtered(logits, temperature, top_p=1.0, top_k=0, min_p=0.0):
    """The scores HF's `generate` samples from: its warpers (`rollout.warpers`) over the logits."""
    scores = logits.clone()
    for warp in warpers(temperature, top_p, top_k, min_p):
        scores = warp(None, scores)
    return scores


@pytest.mark.parametrize("top_k, top_p, min_p", [(0, 0.8, 0.0), (3, 1.0, 0.0), (0, 1.0, 0.2), (4, 0.9, 0.1)])
def test_sample_filters_temperature_and_logprobs_are_hfs(top_k, top_p, min_p):
    torch.manual_seed(0)
    logits = torch.randn(4, 10) * 3
    temp = torch.tensor([0.7])
    gen = torch.Generator().manual_seed(0)
    filtered = _hf_filtered(logits, 0.7, top_p, top_k, min_p)
    allowed = torch.isfinite(filtered)
    assert not allowed.all()  # each case cuts something
    counts = torch.zeros(4, 10)
    for _ in range(3000):
        tok, lp, ent = sample(logits, temp, torch.tensor([top_p]), greedy=False, use_top_p=top_p < 1,
                              generator=gen, top_k=top_k, min_p=torch.tensor([min_p]) if min_p else None)
        assert allowed.gather(1, tok[:, None]).all()
        counts[torch.arange(4), tok] += 1
    # the log-prob of the distribution drawn from; the entropy of the uncut softmax
    torch.testing.assert_close(lp, torch.log_softmax(filtered, -1).gather(1, tok[:, None])[:, 0])
    full = torch.log_softmax(logits / 0.7, -1)
    torch.testing.assert_close(ent, -(full.exp() * full).sum(-1))
    assert (counts / 3000 - torch.softmax(filtered, -1)).abs().max() < 0.04


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


def _check_filters(dev, cases) -> None:
    # top-k and min-p through keep_threshold: tokens only from HF's filtered set, log-probs under its
    # renormalised softmax (float64), entropy of the uncut one, in fp32 and bf16 (ties kept)
    g = torch.Generator().manual_seed(2)
    temp = torch.tensor([0.7], device=dev)
    for dtype, b, v in cases:
        x = (torch.randn(b, v, generator=g) * 4).to(dtype).to(dev)
        full = torch.log_softmax(x.double() / 0.7, -1)
        for top_k, min_p in ((5, 0.0), (0, 0.2), (40, 0.05)):
            keep = keep_threshold(x, temp, top_k, torch.tensor([min_p], device=dev) if min_p else None)
            tok, lp, ent = fused_sample(x, temp, *_key(5, 0, dev), False, keep=keep)
            filtered = _hf_filtered(x.float(), 0.7, 1.0, top_k, min_p).double()
            assert filtered.gather(1, tok[:, None]).isfinite().all(), (dtype, top_k, min_p)
            ref = torch.log_softmax(filtered, -1).gather(1, tok[:, None])[:, 0]
            torch.testing.assert_close(lp.double(), ref, rtol=1e-5, atol=2e-5)
            torch.testing.assert_close(ent.double(), -(full.exp() * full).sum(-1), rtol=1e-5, atol=2e-5)


def _check_filtered_draws(dev, rows: int, tol: float) -> None:
    # the pattern [2, 1, 0, -inf] over 4 x Q logits at T = 2: min-p 0.5 keeps the 2s and the 1s
    # (1 + log 0.5 = 0.31 on the tempered logits), so does top-k Q + 1 (the k-th largest is a 1, ties
    # kept), top-k Q keeps the 2s alone; draws follow the kept softmax, whose log-probs they carry
    pattern = torch.tensor([2.0, 1.0, 0.0, float("-inf")], device=dev)
    x = pattern.repeat(rows, sampling.Q)
    temp = torch.tensor([2.0], device=dev)
    two = torch.tensor([1.0, 0.5], dtype=torch.float64).exp()
    for top_k, min_p, want in ((0, 0.5, two / two.sum()), (sampling.Q + 1, 0.0, two / two.sum()),
                               (sampling.Q, 0.0, torch.tensor([1.0, 0.0], dtype=torch.float64))):
        keep = keep_threshold(x, temp, top_k, torch.tensor([min_p], device=dev) if min_p else None)
        tok, lp, _ = fused_sample(x, temp, *_key(13, 0, dev), False, keep=keep)
        tok = tok.cpu()
        by_token = torch.bincount(tok % 4, minlength=4).double() / rows
        assert by_token[2:].sum() == 0 and (by_token[:2] - want).abs().max() < tol, (top_k, min_p, by_token)
        torch.testing.assert_close(lp.double().cpu(), (want / sampling.Q).log()[tok % 4], rtol=1e-5, atol=1e-5)


def _check_engine_filters_and_eos(dev) -> None:
    # the engine with top-k and min-p draws its tokens from HF's filtered set of the teacher-forced
    # logits and reports their log-probs under it; with two EOS ids every row ends at the first of
    # either, with the tokens it drew before
    model = tiny_model(device=dev)
    ids, mask = prompts(device=dev)
    eng = FastEngine(model, 4, 32)
    kw = dict(temperature=0.9, top_k=3, min_p=0.1, pad_id=0)
    free = eng.generate(ids, mask, 6, eos_id=-1, generator=torch.Generator().manual_seed(3), **kw)
    comp = free.completion_ids
    full = torch.cat([ids, comp], 1)
    fmask = torch.cat([mask, torch.ones_like(comp)], 1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=fmask,
                       position_ids=(fmask.cumsum(1) - 1).clamp_min(0)).logits[:, ids.shape[1] - 1:-1].float()
    filtered = _hf_filtered(logits.reshape(-1, logits.shape[-1]), 0.9, 1.0, 3, 0.1).view_as(logits)
    assert filtered.gather(2, comp[..., None]).isfinite().all()
    want = torch.log_softmax(filtered, -1).gather(2, comp[..., None])[..., 0]
    torch.testing.assert_close(free.logprobs, want, rtol=1e-4, atol=1e-4)
    eos = [int(comp[0, 2]), int(comp[1, 3])]
    ended = eng.generate(ids, mask, 6, eos_id=eos, generator=torch.Generator().manual_seed(3), **kw)
    t = ended.completion_ids.shape[1]
    cmask, terminated = completion_mask(comp, eos)
    assert terminated[:2].all() and torch.equal(ended.completion_mask.long(), cmask[:, :t])
    assert torch.equal(ended.completion_ids[ended.completion_mask], comp[:, :t][ended.completion_mask])


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
    _check_filters("cpu", [(torch.float32, 3, 5000), (torch.bfloat16, 2, 9000)])
    _check_filtered_draws("cpu", 400, 0.1)  # 5 standard errors at 400 rows: 0.12
    _check_engine_filters_and_eos("cpu")
    print("SAMPLING INTERPRETER CHECKS OK")


@pytest.mark.slow
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
    _check_filters("cuda", [(torch.bfloat16, b, 152064) for b in (1, 17, 64)])
    _check_filtered_draws("cuda", 65536, 0.006)
    _check_engine_filters_and_eos("cuda")


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


# ---------------------------------------------------------------------------------------------
# the HF rollout path: filtered log-probs, stop strings, EOS ids
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def char_policy():
    """A random model over the embedded model's character vocabulary, and that tokenizer."""
    from qerl_exp.config import ModelConfig
    from qerl_exp.models.synthetic import build
    from qerl_exp.models.tokenizers import CharTokenizer

    tok = CharTokenizer()
    return build(ModelConfig(), len(tok)).eval(), tok


ALGO = AlgoConfig(group_size=3, max_new_tokens=12, temperature=0.8, top_k=5, min_p=0.05)
SEEDS = list(range(6))


def _rollout(model, tok, algo=ALGO):
    from qerl_exp.rl.rollout import HFGenerator, sample

    return sample(HFGenerator(model, tok), tok, ["12+34=", "7-5="], algo, torch.device("cpu"), seeds=SEEDS)


def test_hf_rollouts_carry_the_log_probs_of_the_filtered_distribution(char_policy):
    from qerl_exp.decoders.scoring import completion_logits

    model, tok = char_policy
    free = _rollout(model, tok)
    with torch.no_grad():
        raw = completion_logits(model, free, 1.0)  # teacher-forced, untempered
    filtered = _hf_filtered(raw.reshape(-1, raw.shape[-1]), 0.8, 1.0, 5, 0.05).view_as(raw)
    on = free.completion_mask.bool()
    picked = free.completion_ids[..., None]
    assert filtered.gather(2, picked)[on].isfinite().all() and (~filtered.isfinite()).any()
    want = torch.log_softmax(filtered, -1).gather(2, picked)[..., 0]
    torch.testing.assert_close(free.sampler_logp, torch.where(on, want, 0.0), rtol=1e-5, atol=1e-5)
    full = torch.log_softmax(raw / 0.8, -1)
    torch.testing.assert_close(free.sampler_entropy, torch.where(on, -(full.exp() * full).sum(-1), 0.0),
                               rtol=1e-5, atol=1e-5)


def test_a_stop_string_ends_a_completion_after_it(char_policy):
    import dataclasses

    model, tok = char_policy
    free = _rollout(model, tok)
    row = free.completion_ids[0].tolist()
    start = next(i for i in range(2, 10) if all(len(tok.vocab[t]) == 1 for t in row[i:i + 2]))
    stop = tok.decode(row[start:start + 2])  # two characters of the first completion
    stopped = _rollout(model, tok, dataclasses.replace(ALGO, stop=[stop]))
    for i, (a, b) in enumerate(zip(free.texts, stopped.texts)):
        assert a.startswith(b)  # the same draws (seeds per row) up to the stop
        if stop in a:
            assert b.endswith(stop) and stop not in b[:-1] and stopped.terminated[i]
        else:
            assert b == a and bool(stopped.terminated[i]) == bool(free.terminated[i])
    n = stopped.completion_mask.sum(1)
    assert n[0] == start + 2 and stopped.texts[0] == tok.decode(row[:start + 2])
    on = stopped.completion_mask.bool()
    assert torch.equal(stopped.sampler_logp[on], free.sampler_logp[:, :on.shape[1]][on])
    assert (stopped.sampler_logp[~on] == 0).all() and (stopped.completion_ids[~on] == tok.pad_id).all()


def test_any_of_several_eos_ids_ends_a_completion(char_policy):
    from qerl_exp.models.tokenizers import CharTokenizer

    model, tok = char_policy
    free = _rollout(model, tok)
    second = CharTokenizer()
    second.eos_ids = [second.eos_id, int(free.completion_ids[0, 3])]  # as a generation config can add
    ended = _rollout(model, second)
    want, terminated = completion_mask(free.completion_ids, second.eos_ids)
    t = ended.completion_mask.shape[1]
    assert terminated[0] and torch.equal(ended.completion_mask, want[:, :t])
    assert torch.equal(ended.terminated, terminated)
    row, kept = free.completion_ids[0].tolist(), want[0].tolist()
    assert ended.texts[0] == tok.decode([t for t, m in zip(row, kept) if m][:-1])  # without its EOS


def test_a_checkpoints_generation_config_adds_its_eos_ids(tmp_path):
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from qerl_exp.models.tokenizers import CharTokenizer, HFTokenizer

    char = CharTokenizer()
    char.save_pretrained(tmp_path)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(char), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    model.generation_config = GenerationConfig(eos_token_id=[9, char.eos_id, 11])
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == [9, char.eos_id, 11]
    tok = HFTokenizer(tmp_path, local_files_only=True)
    assert tok.eos_id == char.eos_id and tok.eos_ids == [char.eos_id, 9, 11]
    (tmp_path / "generation_config.json").unlink()
    assert HFTokenizer(tmp_path, local_files_only=True).eos_ids == [char.eos_id]


if __name__ == "__main__" and "--interp" in sys.argv:
    _interp_main()
