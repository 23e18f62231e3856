"""A two-route task's embedded base (`task=fork`): how it chooses its route, how well each route
answers, and the warm-up loss that teaches both routes and sets the route prior.

The warm-up (`models.warmup`) trains on every problem by one route drawn at random, half A and
half B, so both routes learn to answer; the route token itself is trained toward the soft target
`(1 - prior, prior)` over (A, B) instead of the drawn route, whose optimum is
`pi0(B | prompt) = prior` for every prompt. `route_facts` measures what the warm-up reached:
`pi0_b`, the mean over the probe's prompts of the base's probability of opening with B (at
temperature 1), and each route's greedy accuracy with the route token given.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from qerl_exp.decoders.batch import Sequences
from qerl_exp.decoders.scoring import score_completions
from qerl_exp.rl.rollout import complete, encode_prompts, greedy_pass_at_1
from qerl_exp.tasks import Problem
from qerl_exp.tasks.fork import is_correct

# The warm-up stops once the measured prior is within this factor of the asked one (and both
# routes are competent); else it runs to model.warmup.max_steps and records what it reached.
PRIOR_TOLERANCE = 1.25


@torch.no_grad()
def route_probability(model, tokenizer, problems: list[Problem], route: str) -> torch.Tensor:
    """`[N]` probability that the model opens its reply to each problem with `route`, at
    temperature 1, from the learner's scorer."""
    ids, mask = encode_prompts([tokenizer.render_prompt(p.question, "") for p in problems], tokenizer,
                               next(model.parameters()).device)
    token = torch.full((len(problems), 1), tokenizer.encode(route)[0], device=ids.device)
    logp, _ = score_completions(model, Sequences(ids, mask, token, torch.ones_like(token)), temperature=1.0)
    return logp[:, 0].exp().cpu()


@torch.no_grad()
def route_accuracy(model, tokenizer, problems: list[Problem], route: str, max_new_tokens: int = 16) -> float:
    """Greedy accuracy of the replies that follow `route` when the route token is given."""
    prompts = [tokenizer.render_prompt(p.question, "") + route for p in problems]
    texts, _, _ = complete(model, tokenizer, prompts, samples=1, temperature=0.0, top_p=1.0,
                        max_new_tokens=max_new_tokens, batch_size=len(prompts))
    return float(np.mean([is_correct(route + t, p.answer) for t, p in zip(texts, problems)]))


def _judge(problems: list[Problem], texts: list[str]) -> list[bool]:
    # the task's own judgement, whatever reward functions a run names: they are not the base's
    return [is_correct(t, p.answer) for p, t in zip(problems, texts)]


def route_facts(model, tokenizer, task, probe: list[Problem]) -> dict[str, float]:
    """What a two-route base does on the probe problems: `pi0_b` (mean probability of opening with
    B) and `pi0_b_max` (its largest over the prompts), each route's accuracy with the route given
    (`accuracy_a`, `accuracy_b`), and the greedy replies' accuracy (`greedy_accuracy`)."""
    was_training = model.training
    model.eval()
    try:
        p_b = route_probability(model, tokenizer, probe, "B")
        facts = {"pi0_b": float(p_b.mean()), "pi0_b_max": float(p_b.max())}
        facts.update({f"accuracy_{r.lower()}": route_accuracy(model, tokenizer, probe, r) for r in task.routes})
        facts["greedy_accuracy"] = float(np.mean(greedy_pass_at_1(model, tokenizer, _judge, probe, system_prompt="",
                                                                  max_new_tokens=16, batch_size=len(probe))[2]))
    finally:
        model.train(was_training)
    return facts


def competent(facts: dict[str, float], prior: float, target_accuracy: float) -> bool:
    """Both routes answer at `target_accuracy` or better and the measured prior is within
    `PRIOR_TOLERANCE` of the asked one."""
    return (min(facts["accuracy_a"], facts["accuracy_b"]) >= target_accuracy
            and abs(math.log(facts["pi0_b"] / prior)) <= math.log(PRIOR_TOLERANCE))


def draw_routes(n: int, rng: np.random.Generator) -> list[str]:
    """The route each of `n` warm-up problems is taught by: A or B, half and half."""
    return ["A" if x else "B" for x in rng.integers(0, 2, size=n)]


def route_loss(logits: torch.Tensor, labels: torch.Tensor, starts: list[int], route_ids: tuple[int, int],
               prior: float) -> torch.Tensor:
    """The warm-up loss of a two-route batch: cross-entropy on the answer tokens (`labels`, -100
    elsewhere, the route token included) plus, at each route token, the cross-entropy against
    `(1 - prior, prior)` over the two routes' tokens.

    Args:
        logits: `[B, L, V]` the model's logits on the right-padded sequences.
        labels: `[B, L]` token ids to predict, -100 on the prompt, the route token and padding.
        starts: each row's position of its route token (its prompt's length).
        route_ids: the token ids of routes A and B.
        prior: the probability of route B to teach.
    """
    answer = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    rows = torch.arange(len(starts), device=logits.device)
    logp = torch.log_softmax(logits[rows, torch.tensor(starts, device=logits.device) - 1].float(), dim=-1)
    soft = -((1 - prior) * logp[:, route_ids[0]] + prior * logp[:, route_ids[1]]).mean()
    return answer + soft
