"""The one scorer: teacher-forced log-probs and entropies of completion tokens under a policy,
for the learner, the reference and monitor passes, evaluation and the step-0 decoder guard.

Two paths end in the same chunked LM head (`chunk_scores`), and `score` picks one by the run's
`train` settings:
- padded (`score_completions`): left-padded rows through HF's forward (peft applies LoRA), any
  causal LM;
- packed (`score_packed`, `train.padding_free`): the rows packed without padding
  (`qerl_exp.decoders.packing`) and run through the hand-written decoder pass (`qerl_exp.decoders.padding_free`), for
  the architectures `qerl_exp.decoders.blocks` reads.

Neither materialises [B, T, vocabulary] logits: the LM head is applied to `LOGIT_CHUNK` elements'
worth of scored tokens at a time, each chunk checkpointed (its fp32 logits are recomputed in
backward, not kept). `completion_logits` gives the whole vocabulary, for the monitor's exact KL.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from qerl_exp.config import TrainConfig
from qerl_exp.config.architectures import causal_lm
from qerl_exp.decoders import blocks, padding_free
from qerl_exp.decoders.batch import Sequences
from qerl_exp.decoders.packing import pack

LOGIT_CHUNK = 2**26  # fp32 logits per chunk (256 MB): 441 tokens at Qwen's 152,064-token vocabulary


def _model_inputs(batch: Sequences) -> dict[str, torch.Tensor]:
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
    # Prompts are left-padded: positions count real tokens only.
    position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids}


def _hidden_states(model, batch: Sequences):
    """The teacher-forced HF forward every padded score starts from: `(head, hidden [B, P + T, H])`,
    the HF causal LM's output layer and its backbone's last hidden states (peft's LoRA layers inside
    it apply their adapters). Read through HF's own accessors (`base_model`, `get_output_embeddings`),
    so the padded path scores any causal LM, a family the decoders do not declare included."""
    lm = causal_lm(model)
    return lm.get_output_embeddings(), lm.base_model(**_model_inputs(batch)).last_hidden_state


def completion_logits(model, batch: Sequences, temperature: float) -> torch.Tensor:
    """Tempered logits `[B, T, V]` that predict each completion token, teacher-forced: the whole
    vocabulary at every position, for the monitor's exact KL (small models; the learner and
    evaluation use `score`)."""
    head, hidden = _hidden_states(model, batch)
    prompt_len, new = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    return head(hidden)[:, prompt_len - 1 : prompt_len - 1 + new].float() / temperature


def token_logp(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-prob `[B, T]` of `tokens` under softmax(logits)."""
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _chunk_scores(hidden: torch.Tensor, tokens: torch.Tensor, lm_head, temperature: float, entropy_grad: bool):
    logp_all = torch.log_softmax(lm_head(hidden).float() / temperature, dim=-1)
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    # An entropy with grad saves two [chunk, V] fp32 tensors per chunk that backward frees only
    # if the loss uses the entropy; as a metric it would keep them all until backward ends.
    p = logp_all if entropy_grad else logp_all.detach()
    entropy = -(p.exp() * p).sum(dim=-1)
    return logp, entropy


def score_completions(
    model, batch: Sequences, temperature: float, entropy_grad: bool = False, chunk: int = LOGIT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced log-probs and entropies of the completion tokens through the HF forward, in
    chunks of the vocabulary (the padded path of `score`; evaluation's `eval.solution_logprobs`).

    Equal to `token_logp(completion_logits(...))` and `entropy_from_logits(completion_logits(...))`
    on the completion tokens, without ever holding more than `chunk` fp32 logits (times a few for
    softmax), in forward or in backward.

    Args:
        model: the policy (a peft model or a plain HF causal LM of a declared architecture).
        batch: a `Rollout` or other `Sequences`; only positions with `completion_mask == 1` are scored.
        temperature: logits are divided by it.
        entropy_grad: whether the entropy is differentiable (an entropy bonus in the loss); else it
            is a metric and keeps no activations for backward.
        chunk: most logits (tokens x vocabulary) per chunk.

    Returns:
        `(logp, entropy)`, each `[B, T]` fp32, 0 where the completion mask is 0; `logp` is
        differentiable when grad is enabled, `entropy` only with `entropy_grad`.
    """
    head, hidden = _hidden_states(model, batch)
    prompt_len, (b, t) = batch.prompt_ids.shape[1], batch.completion_ids.shape
    hidden = hidden[:, prompt_len - 1 : prompt_len - 1 + t].reshape(b * t, -1)
    where = batch.completion_mask.reshape(-1).nonzero().squeeze(1)
    logp, entropy = chunk_scores(hidden[where], batch.completion_ids.reshape(-1)[where], head, temperature,
                                 entropy_grad, chunk)
    zeros = hidden.new_zeros(b * t, dtype=torch.float32)
    return zeros.index_put((where,), logp).view(b, t), zeros.index_put((where,), entropy).view(b, t)


def chunk_scores(hidden: torch.Tensor, tokens: torch.Tensor, lm_head, temperature: float, entropy_grad: bool = False,
                 chunk: int = LOGIT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies `[M]` (fp32) of `tokens` `[M]` predicted from `hidden` `[M, H]`,
    `chunk // vocabulary` tokens at a time, each chunk checkpointed under grad (its logits are
    recomputed in backward, not kept): what both the padded and the padding-free scorer end in."""
    step = max(1, chunk // lm_head.out_features)
    logp, entropy = [], []
    for i in range(0, len(tokens), step):
        args = (hidden[i : i + step], tokens[i : i + step], lm_head, temperature, entropy_grad)
        lp, ent = checkpoint(_chunk_scores, *args, use_reentrant=False) if torch.is_grad_enabled() else _chunk_scores(*args)
        logp.append(lp)
        entropy.append(ent)
    if not logp:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logp), torch.cat(entropy)


def score_packed(policy, batch: Sequences, temperature: float, *, shared_prefix: bool, checkpointing: str = "false",
                 fused: bool = False, adapter: bool = True, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced log-probs and entropies `[B, T]` of the completion tokens, packed: equal to
    `score_completions(policy, batch, ...)` (same zeros where the mask is 0), without padding.

    Args:
        policy: the peft model (or a plain causal LM), of an architecture `qerl_exp.decoders.blocks` reads.
        batch: the rows to score (their ids and masks; on the CPU, packing them waits for nothing).
        temperature: logits are divided by it.
        shared_prefix: pack one copy of the prompt of adjacent rows that share it.
        checkpointing: `train.gradient_checkpointing` (`auto`, `true`, `false`).
        fused: use the hand-fused elementwise kernels (CUDA).
        adapter: apply LoRA (False: the reference policy, the base alone).
        entropy_grad: whether the entropy is differentiable.
    """
    dec = blocks.read(policy, adapters=adapter)
    device, dtype = dec.lm_head.weight.device, dec.lm_head.weight.dtype
    p = pack(batch, shared_prefix, device)
    k = padding_free.checkpointed_layers(dec, len(p.input_ids), dtype, device, checkpointing) \
        if torch.is_grad_enabled() else 0
    hidden = padding_free.hidden_states(dec, p, checkpointed=k, fused=fused)
    logp, entropy = chunk_scores(hidden, p.targets, dec.lm_head, temperature, entropy_grad)
    b, t = p.shape
    zeros = hidden.new_zeros(b, t, dtype=torch.float32)
    return zeros.index_put((p.rows, p.cols), logp), zeros.index_put((p.rows, p.cols), entropy)


def score(policy, batch: Sequences, temperature: float, train: TrainConfig, *, adapter: bool = True,
          entropy_grad: bool = False, host: Sequences | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies `[b, t]` of `batch`'s completion tokens under the policy (`adapter`
    False: the base alone, the reference policy), by the path `train` names (`train.padding_free`:
    packed, else padded); `host`: the same rows' ids and masks on the CPU, which the packed path
    packs from."""
    if train.padding_free:
        fused = train.fused_ops and batch.completion_ids.is_cuda
        return score_packed(policy, batch if host is None else host, temperature, shared_prefix=train.shared_prefix,
                            fused=fused, checkpointing=train.gradient_checkpointing, adapter=adapter,
                            entropy_grad=entropy_grad)
    if adapter:
        return score_completions(policy, batch, temperature, entropy_grad=entropy_grad)
    with policy.disable_adapter():
        return score_completions(policy, batch, temperature, entropy_grad=entropy_grad)
