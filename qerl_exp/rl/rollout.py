"""Rollouts: sample G completions per prompt from the sampling policy (`sample`); and completions
of prompt texts (`complete`) for evaluation and the embedded model's warm-up, through the same
generators.

The sampler is the policy as it stands (quantized base + LoRA), with AQN applied by the caller
around `sample`. Two generators share one contract (`generate(ids, mask, Sampling, ...)`):
`HFGenerator`, through HF `generate` (`hf_generate`, any device), and `EngineGenerator`, through our
static-cache CUDA-graph engine (`qerl_exp.engine`, CUDA only), the one place a `FastEngine` is built
and sized; `make_generator` picks one (`rollout.engine=auto`: the engine on CUDA).

What a token is drawn from, in both engines: softmax of the logits / temperature, cut by HF's
top-k, top-p and min-p filters in that order (`warpers`; the engine's `engine.sampling` keeps the
same tokens). A completion ends at the first of the tokenizer's EOS ids (the checkpoint's
generation config may name several) or after the token that completes a stop string
(`algo.stop`, `cut_at_stop`). `Rollout.sampler_logp` holds each sampled token's log-prob under
that filtered, renormalised distribution, the one it was drawn from, as vLLM reports it with
`logprobs_mode=processed_logprobs`: the behaviour policy that importance weights (`algo.tis_cap`)
divide by. `Rollout.sampler_entropy` is the entropy of the unfiltered softmax(logits /
temperature), the model's own, comparable with the learner's and the reference's. A checkpoint's
other generation defaults (its temperature, top-k/p, repetition penalty) are not applied: the
learner scores the plain softmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch
from transformers import (LogitsProcessor, LogitsProcessorList, MinPLogitsWarper, StoppingCriteria, StoppingCriteriaList,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from qerl_exp.config import AlgoConfig
from qerl_exp.decoders.batch import Rollout
from qerl_exp.engine import FastEngine
from qerl_exp.rl.metrics import entropy_from_logits

if TYPE_CHECKING:
    from qerl_exp.tasks import Problem


@dataclass(frozen=True)
class Sampling:
    """How one generator call draws its completions.

    Args:
        max_new_tokens: completion length cap.
        temperature: sampling temperature; 0 decodes greedily.
        top_p, top_k, min_p: HF's filters (1, 0, 0: off).
        stop: strings after which a row stops (the caller cuts the completion there: `cut_at_stop`).
        group: the rows come in groups of this many adjacent rows with one prompt (prefilled once
            by the engine).
    """

    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    group: int = 1

    @classmethod
    def of(cls, algo: AlgoConfig) -> Sampling:
        """A run's rollouts: `algo`'s sampling settings, its groups of `group_size` completions."""
        return cls(algo.max_new_tokens, algo.temperature, algo.top_p, algo.top_k, algo.min_p, tuple(algo.stop),
                   algo.group_size)


class NonFiniteLogitsError(FloatingPointError):
    """The sampler's logits hold NaN or no finite value in a row (blown-up weights or noise)."""


class _FiniteLogits(LogitsProcessor):
    """Raise `NonFiniteLogitsError` before sampling from logits no distribution can be made of."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.isnan().any() or not torch.isfinite(scores.amax(dim=-1)).all():
            raise NonFiniteLogitsError("the sampler's logits are not finite")
        return scores


class RowSampling(LogitsProcessor):
    """Turn greedy decoding into sampling, each row from its own random stream.

    Placed after the warpers (`warpers`): argmax(scores + Gumbel noise) is an exact draw
    from softmax(scores) (the Gumbel-max trick). Row i's noise comes from a generator seeded with
    `seeds[i]`, so its tokens depend on its seed and its logits only, not on the other rows of the
    batch: a prompt samples the same completions on whichever rank of a data-parallel run draws it.
    """

    def __init__(self, seeds: list[int], device: torch.device):
        self.generators = [torch.Generator(device).manual_seed(s) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        u = torch.stack([torch.rand(scores.shape[1], generator=g, device=scores.device) for g in self.generators])
        tiny = torch.finfo(u.dtype).tiny
        return scores + -torch.log(-torch.log(u.clamp(tiny, 1 - 1e-7)))


def row_seeds(seed: int, step: int, prompts: range, group_size: int) -> list[int]:
    """One sampling seed per completion, from (run seed, step, global prompt index, row in the group)."""
    return [int(np.random.SeedSequence([seed, step, p, j]).generate_state(1, np.uint64)[0] >> np.uint64(1))
            for p in prompts for j in range(group_size)]


def encode_prompts(prompts: list[str], tokenizer, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded `[B, P]` ids and mask for prompt texts."""
    bos = getattr(tokenizer, "bos_id", None)
    rows = [([bos] if bos is not None else []) + tokenizer.encode(p) for p in prompts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)


def warpers(temperature: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> list[LogitsProcessor]:
    """HF's processors that make the distribution a token is drawn from, in `generate`'s order:
    logits / temperature, then top-k, top-p and min-p (each only where it cuts anything)."""
    return [TemperatureLogitsWarper(temperature), *([TopKLogitsWarper(top_k)] if top_k else []),
            *([TopPLogitsWarper(top_p)] if top_p < 1 else []), *([MinPLogitsWarper(min_p)] if min_p else [])]


def completion_mask(completion_ids: torch.Tensor, eos_id: int | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask `[B, T]` that is 1 up to and including the first EOS (any of `eos_id`'s ids; -1 or none:
    no token ends a completion), and `[B]` whether EOS came."""
    ids = [eos_id] if isinstance(eos_id, int) else list(eos_id)
    is_eos = torch.isin(completion_ids, torch.tensor(ids or [-1], device=completion_ids.device))
    terminated = is_eos.any(dim=1)
    # Positions strictly after the first EOS are masked out.
    after = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
    return (~after).long(), terminated


def cut_at_stop(tokenizer, completion_ids: torch.Tensor, mask: torch.Tensor,
                stop: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """End each completion after the token that completes the first of the `stop` strings in its text.

    Args:
        tokenizer: decodes the completion's tokens.
        completion_ids: `[B, T]` sampled tokens.
        mask: `[B, T]` the completion's tokens (`completion_mask`).
        stop: the stop strings; a completion keeps the one it ends with.

    Returns:
        `(mask, stopped)`: the mask without the tokens after the stop string, and `[B]` which
        completions a stop string ended.
    """
    stopped = torch.zeros(mask.shape[0], dtype=torch.bool)
    if not stop:
        return mask, stopped.to(mask.device)
    out = mask.clone()

    def has_stop(tokens: list[int]) -> bool:
        text = tokenizer.decode(tokens)
        return any(s in text for s in stop)

    for i, (row, n) in enumerate(zip(completion_ids.tolist(), mask.sum(dim=1).tolist())):
        if not has_stop(row[:n]):
            continue
        lo, hi = 1, n  # the shortest prefix whose text holds a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if has_stop(row[:mid]) else (mid + 1, hi)
        out[i, lo:] = 0
        stopped[i] = True
    return out, stopped.to(mask.device)


class _StopStrings(StoppingCriteria):
    """Ends a row of `generate` once the text of its last tokens holds a stop string (`cut_at_stop`
    then finds where); it only saves compute: rows that never stop run to EOS or the cap."""

    def __init__(self, tokenizer, stop: Sequence[str], prompt_len: int):
        self.tokenizer, self.stop, self.prompt_len = tokenizer, list(stop), prompt_len
        self.window = max(map(len, self.stop)) + 1  # tokens: each decodes to at least one character

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        tails = input_ids[:, self.prompt_len:][:, -self.window:].tolist()
        return torch.tensor([any(s in self.tokenizer.decode(t) for s in self.stop) for t in tails], device=input_ids.device)


def hf_generate(model, ids: torch.Tensor, mask: torch.Tensor, *, max_new_tokens: int, eos_id: int | Sequence[int],
                pad_id: int, temperature: float, top_p: float, top_k: int = 0, min_p: float = 0.0,
                stop: Sequence[str] = (), tokenizer=None, processors: list[LogitsProcessor] | None = None,
                output_logits: bool = False, seeds: list[int] | None = None):
    """The project's one call of `transformers` `generate`: the sampler's, evaluation's and the
    warm-up's completions all come from here.

    Args:
        model: an HF causal LM (peft-wrapped or not).
        ids: `[B, P]` left-padded prompt ids.
        mask: `[B, P]` their attention mask.
        max_new_tokens: completion length cap.
        eos_id: the token, or tokens, that end a completion (-1 or none: none does).
        pad_id: the padding token.
        temperature: sampling temperature; 0 decodes greedily.
        top_p: nucleus threshold of sampling (1: off).
        top_k: sample among the k most likely tokens (0: off).
        min_p: drop tokens less likely than min_p times the most likely (0: off).
        stop: strings after which a row stops (with `tokenizer`, which decodes them); the caller cuts
            the completion there (`cut_at_stop`).
        tokenizer: the project tokenizer, for `stop`.
        processors: logits processors run before sampling.
        output_logits: also return the raw logits of every generated position.
        seeds: one per row: each row samples from its own generator (`RowSampling`), so its
            completion does not depend on the batch it is in; None samples with torch's generator.

    Returns:
        `generate`'s output dict: `sequences` `[B, P + T]` and, when asked, `logits` (T of `[B, V]`).
    """
    processors = list(processors or [])
    if temperature > 0 and seeds is not None:
        # greedy decoding over tempered, filtered, Gumbel-perturbed scores: sampling, row by row
        processors += [*warpers(temperature, top_p, top_k, min_p), RowSampling(seeds, ids.device)]
        how = dict(do_sample=False)
    elif temperature > 0:
        how = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p or None)
    else:
        how = dict(do_sample=False)
    ids_list = [eos_id] if isinstance(eos_id, int) else list(eos_id)
    stopping = StoppingCriteriaList([_StopStrings(tokenizer, stop, ids.shape[1])] if stop else [])
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=ids_list or [-1],
        pad_token_id=pad_id, logits_processor=LogitsProcessorList(processors), stopping_criteria=stopping,
        output_logits=output_logits, return_dict_in_generate=True,
        repetition_penalty=1.0,  # not a checkpoint's own (Qwen2.5-Instruct's is 1.05): the learner has none
        **how,
    )


def decode_completions(tokenizer, completion_ids: torch.Tensor, mask: torch.Tensor, eos_ids: Sequence[int]) -> list[str]:
    """The text of each completion's tokens (`mask`), without its EOS."""
    eos = set(eos_ids)
    return [tokenizer.decode([t for t, m in zip(row, on) if m and t not in eos])
            for row, on in zip(completion_ids.tolist(), mask.tolist())]


@torch.no_grad()
def complete(model, tokenizer, prompts: list[str], *, samples: int, temperature: float, top_p: float,
             max_new_tokens: int, batch_size: int, on_batch: Callable[[int], None] | None = None,
             engine: str = "hf", top_k: int = 0, min_p: float = 0.0,
             stop: Sequence[str] = ()) -> tuple[list[str], list[bool], list[list[int]]]:
    """Completion texts of prompt texts, in batches.

    Args:
        model: an HF causal LM (its train/eval mode is the caller's business).
        tokenizer: the model's tokenizer.
        prompts: rendered prompt texts.
        samples: completions per prompt; the rows of a prompt are adjacent.
        temperature: sampling temperature; 0 decodes greedily.
        top_p: nucleus threshold of sampling.
        max_new_tokens: completion length cap.
        batch_size: sequences per `generate` call.
        on_batch: called with the number of rows after each generated batch.
        engine: `hf` or `fast` (`make_generator`: a `FastEngine` over `model` for this call, released
            at its end; on CUDA it decodes from 4-bit weights directly, where `generate`
            dequantizes every weight at every token).
        top_k: sample among the k most likely tokens (0: off).
        min_p: drop tokens less likely than min_p times the most likely (0: off).
        stop: strings that end a completion (kept in its text).

    Returns:
        `(texts, terminated, ids)`: each completion up to (without) its EOS or through its stop
        string, whether EOS or a stop string came, and its token ids (through its EOS). Sampling
        draws from torch's global generator.
    """
    rows = [p for p in prompts for _ in range(samples)]
    device = next(model.parameters()).device
    generator = make_generator(engine, model, tokenizer, device, min(batch_size, len(rows)), max_new_tokens)
    how = Sampling(max_new_tokens, temperature, top_p, top_k, min_p, tuple(stop))
    texts, terminated, token_ids = [], [], []
    try:
        for start in range(0, len(rows), batch_size):
            ids, mask = encode_prompts(rows[start:start + batch_size], tokenizer, device)
            out, _, _ = generator.generate(ids, mask, how, tokenizer.eos_ids, scores=False)
            cmask, ended = completion_mask(out, tokenizer.eos_ids)
            cmask, stopped = cut_at_stop(tokenizer, out, cmask, stop)
            texts += decode_completions(tokenizer, out, cmask, tokenizer.eos_ids)
            terminated += (ended | stopped).tolist()
            token_ids += [row[m].tolist() for row, m in zip(out.cpu(), cmask.bool().cpu())]
            if on_batch is not None:
                on_batch(len(out))
    finally:
        generator.release()
    return texts, terminated, token_ids


def policy_device(policy) -> torch.device:
    """The device of the policy's weights."""
    return next(policy.parameters()).device


@torch.no_grad()
def greedy_completions(policy, tokenizer, problems: list[Problem], *, system_prompt: str, max_new_tokens: int,
                       batch_size: int, on_batch=None, engine: str = "hf",
                       stop: Sequence[str] = ()) -> tuple[list[str], list[bool], list[list[int]]]:
    """Greedy completions of `problems`: `(texts, terminated, token ids)`, one entry per problem.

    Args:
        policy: the model (eval mode is the caller's business).
        tokenizer: the policy's tokenizer.
        problems: the problems to answer.
        system_prompt: passed to `tokenizer.render_prompt`.
        max_new_tokens: completion length cap.
        batch_size: sequences per `generate` call.
        on_batch: called with the number of rows after each generated batch.
        engine: `hf` or `fast`, as `rollout.complete` takes it.
        stop: strings that end a completion (`algo.stop`).
    """
    prompts = [tokenizer.render_prompt(p.prompt, system_prompt) for p in problems]
    return complete(policy, tokenizer, prompts, samples=1, temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens,
                    batch_size=batch_size, on_batch=on_batch, engine=engine, stop=stop)


def greedy_pass_at_1(policy, tokenizer, judge: Callable[[list[Problem], list[str]], list[bool]],
                     problems: list[Problem], **settings) -> tuple[list[str], list[bool], list[bool]]:
    """Greedy completions of `problems` and `judge`'s verdicts on them (the embedded model's warm-up
    measures its progress so); `settings` are `greedy_completions`'.

    Returns:
        `(texts, terminated, correct)`, one entry per problem.
    """
    texts, terminated, _ = greedy_completions(policy, tokenizer, problems, **settings)
    return texts, terminated, judge(problems, texts)


class HFGenerator:
    """Generating through `transformers` `generate` (the reference engine; works on CPU).

    `generate(ids, mask, how, eos_ids, seeds=None, scores=True)` -> `(completion [B, T], logp, entropy)`:
    with `scores`, each sampled token's log-prob under the distribution it was drawn from and the
    entropy of the unfiltered softmax (`[B, T]` each; non-finite logits raise
    `NonFiniteLogitsError`), else None for both. `seeds`: one per row, each row sampled from its own
    stream (`RowSampling`); None samples with torch's global generator.
    """

    nbytes = 0  # HF's generate holds no cache between calls

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    @torch.no_grad()
    def generate(self, ids, mask, how: Sampling, eos_ids: Sequence[int], seeds: list[int] | None = None,
                 scores: bool = True):
        out = hf_generate(self.model, ids, mask, max_new_tokens=how.max_new_tokens, eos_id=eos_ids,
                          pad_id=self.tokenizer.pad_id, temperature=how.temperature, top_p=how.top_p,
                          top_k=how.top_k, min_p=how.min_p, stop=how.stop, tokenizer=self.tokenizer,
                          processors=[_FiniteLogits()] if scores else None, output_logits=scores, seeds=seeds)
        completion = out.sequences[:, ids.shape[1]:]
        if not scores:
            return completion, None, None
        # the generated positions' raw logits through the same warpers again: the distribution drawn from
        chain = warpers(how.temperature, how.top_p, how.top_k, how.min_p)
        logp, entropy = [], []
        for t, raw in enumerate(out.logits):
            raw = raw.float()
            entropy.append(entropy_from_logits(raw / how.temperature))
            for warp in chain:
                raw = warp(None, raw)
            logp.append(torch.log_softmax(raw, dim=-1).gather(1, completion[:, t, None])[:, 0])
        return completion, torch.stack(logp, dim=1), torch.stack(entropy, dim=1)

    def release(self) -> None:
        """Nothing to give back."""


class EngineGenerator:
    """Generating through our CUDA-graph engine (`qerl_exp.engine.FastEngine`): the one place one is
    built, on the first call, for `max_batch_size` rows (at least that call's) and its prompts +
    `max_new_tokens`; a later, larger call grows it.

    `generate` as `HFGenerator`'s; the engine's log-probs and entropies come whatever `scores` says,
    and the batch samples from one stream, seeded by its first row's seed (None: drawn from torch's
    global generator).
    """

    def __init__(self, model, tokenizer, max_batch_size: int = 0, max_new_tokens: int = 0):
        self.model, self.tokenizer = model, tokenizer
        self.max_batch_size, self.max_new_tokens = max_batch_size, max_new_tokens
        self.engine: FastEngine | None = None

    def generate(self, ids, mask, how: Sampling, eos_ids: Sequence[int], seeds: list[int] | None = None,
                 scores: bool = True):
        if self.engine is None:  # room for prompts somewhat longer than the first batch's
            self.engine = FastEngine(self.model, max_batch_size=max(ids.shape[0], self.max_batch_size),
                                     max_seq_len=ids.shape[1] + 64 + max(how.max_new_tokens, self.max_new_tokens))
        seed = seeds[0] if seeds is not None else int(torch.randint(0, 2**62, (1,)))
        out = self.engine.generate(  # stop strings end rows only afterwards (`cut_at_stop`)
            ids, mask, how.max_new_tokens, temperature=how.temperature, top_p=how.top_p, top_k=how.top_k,
            min_p=how.min_p, eos_id=eos_ids, pad_id=self.tokenizer.pad_id, generator=torch.Generator().manual_seed(seed),
            group=how.group,  # a group's rows repeat one prompt: prefilled once
        )
        return out.completion_ids, out.logprobs, out.entropy

    @property
    def nbytes(self) -> int:
        """Device bytes of the engine beyond the model's tensors (KV cache, buffers, NF4 copies)."""
        return 0 if self.engine is None else self.engine.nbytes

    def release(self) -> None:
        """Give the KV cache and graph memory back between rollouts (the learner reuses it)."""
        if self.engine is not None:
            self.engine.release()


def engine_for(engine: str, device: torch.device) -> str:
    """`rollout.engine` resolved for `device`: `fast` or `hf` (`auto`: fast on CUDA, HF elsewhere)."""
    if engine == "auto":
        return "fast" if device.type == "cuda" else "hf"
    if engine == "fast" and device.type != "cuda":
        raise ValueError("rollout.engine=fast needs a CUDA device; use rollout.engine=hf (or auto) on CPU")
    return engine


def make_generator(engine: str, model, tokenizer, device: torch.device, max_batch_size: int = 0,
                 max_new_tokens: int = 0):
    """The generator named by `rollout.engine` (`auto`: fast on CUDA, HF elsewhere); the fast one is
    sized for `max_batch_size` rows of up to `max_new_tokens` new tokens (the run's rollouts)."""
    if engine_for(engine, device) == "fast":
        return EngineGenerator(model, tokenizer, max_batch_size, max_new_tokens)
    return HFGenerator(model, tokenizer)


def sample(generator, tokenizer, prompts: list[str], algo: AlgoConfig, device: torch.device,
           ignore_eos: bool = False, seeds: list[int] | None = None, lengths: list[int] | None = None) -> Rollout:
    """Draw `algo.group_size` completions for each prompt text.

    Args:
        generator: from `make_generator` (`HFGenerator` or `EngineGenerator`).
        tokenizer: the policy's tokenizer.
        prompts: rendered prompt texts, one per problem.
        algo: sampling settings (group size, temperature, top-p, top-k, min-p, stop strings, length cap).
        device: where the batch lives.
        ignore_eos: EOS does not end a completion: every one is `algo.max_new_tokens` long.
        seeds: one per completion (`row_seeds`); the HF engine samples each row from its own
            stream, the fast engine the whole batch from one stream seeded by `seeds[0]`. None:
            drawn from torch's global generator.
        lengths: benchmarks, with `ignore_eos`: row i ends after `lengths[i % len(lengths)]` tokens,
            as if it had sampled EOS there (`rollout.lengths`).

    Returns:
        A `Rollout` with `len(prompts) * group_size` rows, each group's rows adjacent.

    Raises:
        NonFiniteLogitsError: the sampler's logits are NaN or infinite (the run's non-finite
            guard skips the step).
    """
    repeated = [p for p in prompts for _ in range(algo.group_size)]
    ids, mask = encode_prompts(repeated, tokenizer, device)
    eos_ids = [] if ignore_eos else tokenizer.eos_ids  # none: no token ends a completion
    if seeds is None:
        seeds = torch.randint(0, 2**62, (len(repeated),)).tolist()
    completion, logp, entropy = generator.generate(ids, mask, Sampling.of(algo), eos_ids, seeds)
    cmask, terminated = completion_mask(completion, eos_ids)
    cmask, stopped = cut_at_stop(tokenizer, completion, cmask, algo.stop)
    terminated = terminated | stopped
    if lengths:
        cut = torch.tensor([lengths[i % len(lengths)] for i in range(len(repeated))], device=cmask.device)
        cmask = cmask * (torch.arange(cmask.shape[1], device=cmask.device) < cut.unsqueeze(1))
        terminated = cut < cmask.shape[1]
    if not torch.isfinite(logp[cmask.bool()]).all():  # the fast engine samples on without complaint
        raise NonFiniteLogitsError("the sampler's log-probabilities are not finite")
    on = cmask.bool()
    completion = torch.where(on, completion, torch.full_like(completion, tokenizer.pad_id))
    texts = decode_completions(tokenizer, completion, cmask, eos_ids)
    return Rollout(  # where, not a product: a padding token after the end may lie outside the filters (-inf)
        prompt_ids=ids, prompt_mask=mask, completion_ids=completion, completion_mask=cmask,
        sampler_logp=torch.where(on, logp, 0.0), sampler_entropy=torch.where(on, entropy, 0.0), terminated=terminated,
        texts=texts,
    )
