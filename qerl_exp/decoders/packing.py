"""Packing (`train.padding_free`): a micro-batch's rows laid end to end as one sequence, no padding,
and the index of what is scored; pure functions of the batch's ids and masks.

With `train.shared_prefix`, the G completions of one prompt share one copy of it: the prompt is one
attention sequence, and each completion is another whose keys are the prompt's tokens then its
own (causal, aligned to the end). `plan` fills micro-batches up to `train.micro_batch_tokens`;
`pack` lays one out (`Pack`); `block_mask` writes its attention pattern densely (the padding-free
pass's mask where FlashAttention does not run).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qerl_exp.decoders.batch import Sequences


class PackingError(ValueError):
    """A batch the padding-free learner cannot score; the message names the setting to change."""


@dataclass
class Pack:
    """One micro-batch as a single packed sequence (N tokens) and its attention sequences (S).

    Args:
        input_ids: `[N]` token ids. position_ids: `[N]` each token's position in its own row.
        cu_q: `[S + 1]` int32 offsets of each attention sequence's queries (contiguous in packed order).
        cu_k: `[S + 1]` int32 offsets of each sequence's keys in `kv_index`.
        kv_index: `[Nk]` the packed token behind each key, sequence after sequence.
        gather: whether keys differ from the queries' own tokens (shared prompts); else
            `kv_index` is `arange(N)` and `cu_k == cu_q`.
        max_q, max_k: the longest query and key sequence.
        predict: `[M]` the packed token whose hidden state predicts each scored token.
        targets: `[M]` the scored tokens. rows, cols: `[M]` where each goes in the `[b, t]` result.
        shape: `(b, t)` of the result.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    kv_index: torch.Tensor
    gather: bool
    max_q: int
    max_k: int
    predict: torch.Tensor
    targets: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    shape: tuple[int, int]


def _row_tokens(batch: Sequences) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each row's prompt tokens and completion tokens (CPU), without padding."""
    pm, cm = batch.prompt_mask.cpu().bool(), batch.completion_mask.cpu().bool()
    prompt_ids, completion_ids = batch.prompt_ids.cpu(), batch.completion_ids.cpu()
    lengths = cm.sum(1)
    if not bool((cm == (torch.arange(cm.shape[1]) < lengths.unsqueeze(1))).all()):
        raise PackingError("the completion mask is not a prefix of each row; set train.padding_free=false")
    prompts = [prompt_ids[i][pm[i]] for i in range(len(pm))]
    if any(len(p) == 0 for p in prompts):
        raise PackingError("a row has an empty prompt; set train.padding_free=false")
    return prompts, [completion_ids[i, : lengths[i]] for i in range(len(cm))]


def _shares_prompt(prompts: list[torch.Tensor]) -> list[bool]:
    """Row i has the same prompt as row i - 1 (a group's rows are adjacent)."""
    return [False] + [torch.equal(a, b) for a, b in zip(prompts, prompts[1:])]


def plan(batch: Sequences, index: torch.Tensor, budget: int, shared_prefix: bool) -> list[torch.Tensor]:
    """Split the rows `index` of `batch` into micro-batches of at most `budget` packed tokens.

    Rows keep their order; a row longer than the budget is a micro-batch alone. With
    `shared_prefix`, a prompt is counted once per micro-batch for the rows that share it.

    Args:
        batch: the rollout.
        index: `[n]` row indices (a mini-batch).
        budget: most tokens per micro-batch; 0 puts every row in one.

    Returns:
        The micro-batches' row indices, each a tensor on `index`'s device.
    """
    sub = Sequences(batch.prompt_ids[index], batch.prompt_mask[index], batch.completion_ids[index],
                    batch.completion_mask[index])
    prompts, completions = _row_tokens(sub)
    shares = _shares_prompt(prompts)
    parts, current, used = [], [], 0
    for i, (p, c) in enumerate(zip(prompts, completions)):
        cost = len(c) + (0 if shared_prefix and shares[i] and current else len(p))
        if budget and current and used + cost > budget:
            parts.append(current)
            current, used = [], 0
            cost = len(c) + len(p)
        current.append(i)
        used += cost
    parts.append(current)
    return [index[torch.tensor(part, device=index.device)] for part in parts if part]


def pack(batch: Sequences, shared_prefix: bool, device: torch.device) -> Pack:
    """Lay the rows of `batch` end to end (see the module docstring) and index what is scored."""
    prompts, completions = _row_tokens(batch)
    shares = _shares_prompt(prompts) if shared_prefix else [False] * len(prompts)
    ids, pos, cu_q, cu_k, kv, predict, targets, rows, cols = [], [], [0], [0], [], [], [], [], []
    n = 0
    prompt_at = 0  # packed index of the current prompt's first token

    def sequence(queries: range, keys: list[range]) -> None:
        cu_q.append(cu_q[-1] + len(queries))
        cu_k.append(cu_k[-1] + sum(len(k) for k in keys))
        kv.extend(torch.arange(k.start, k.stop) for k in keys)

    for i, (p, c) in enumerate(zip(prompts, completions)):
        lp, lc = len(p), len(c)
        if not shares[i]:
            prompt_at = n
            ids.append(p)
            pos.append(torch.arange(lp))
            n += lp
            if shared_prefix:
                sequence(range(prompt_at, n), [range(prompt_at, n)])
        start = n
        ids.append(c)
        pos.append(torch.arange(lp, lp + lc))
        n += lc
        if shared_prefix:
            sequence(range(start, n), [range(prompt_at, prompt_at + lp), range(start, n)])
        else:
            sequence(range(prompt_at, n), [range(prompt_at, n)])
        if lc:  # completion token 0 is predicted by the prompt's last token, token j by completion token j - 1
            predict.append(torch.cat([torch.tensor([prompt_at + lp - 1]), torch.arange(start, start + lc - 1)]))
            targets.append(c)
            rows.append(torch.full((lc,), i))
            cols.append(torch.arange(lc))

    def put(parts, dtype=torch.long):
        return torch.cat(parts).to(device=device, dtype=dtype) if parts else torch.zeros(0, dtype=dtype, device=device)

    q_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
    k_lens = [b - a for a, b in zip(cu_k, cu_k[1:])]
    width = max([len(c) for c in completions] + [1])
    return Pack(
        input_ids=put(ids), position_ids=put(pos),
        cu_q=torch.tensor(cu_q, dtype=torch.int32, device=device), cu_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
        kv_index=put(kv), gather=shared_prefix, max_q=max(q_lens), max_k=max(k_lens),
        predict=put(predict), targets=put(targets), rows=put(rows), cols=put(cols), shape=(len(prompts), width),
    )


def block_mask(p: Pack) -> torch.Tensor:
    """`[N, N]` bool: query i may attend key j (the same masking as the flash path, written densely)."""
    n = len(p.input_ids)
    mask = torch.zeros(n, n, dtype=torch.bool)
    cu_q, cu_k, kv = p.cu_q.tolist(), p.cu_k.tolist(), p.kv_index.cpu()
    for s in range(len(cu_q) - 1):
        tq, keys = cu_q[s + 1] - cu_q[s], kv[cu_k[s] : cu_k[s + 1]]
        mask[cu_q[s] : cu_q[s + 1], keys] = torch.ones(tq, len(keys), dtype=torch.bool).tril(len(keys) - tq)
    return mask.to(p.input_ids.device)
