"""The rollout batch: prompts with their completions, as the sampler hands them to the learner.

The learner side (`loss`, `learner`, `padding_free`, `metrics`) reads these types and nothing of the
sampler that made them, so it imports neither the rollout engine nor the tasks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sequences:
    """Prompts with completions: what the teacher-forced scorer (`qerl_exp.decoders.scoring`) reads."""

    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P] 1 on prompt tokens
    completion_ids: torch.Tensor  # [B, T] right-padded
    completion_mask: torch.Tensor  # [B, T] 1 on the completion's tokens


@dataclass
class Rollout(Sequences):
    """A batch of sampled completions. B = prompts * group_size, rows of a group adjacent; the
    completion mask is 1 up to and including EOS, or the last token of a stop string."""

    sampler_logp: torch.Tensor  # [B, T] log-prob of each sampled token under the distribution it was drawn from
    sampler_entropy: torch.Tensor  # [B, T] entropy of the sampler's softmax(logits / temperature) at each position
    terminated: torch.Tensor  # [B] bool: ended with EOS or a stop string (else clipped at max_new_tokens)
    texts: list[str]  # decoded completions
