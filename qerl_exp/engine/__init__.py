"""Fast rollouts on the GPU: a gpt-fast style decode engine and weight-only 4-bit Triton kernels.

`FastEngine(model, max_batch_size, max_seq_len).generate(prompt_ids, prompt_mask, max_new_tokens,
temperature=..., top_p=..., top_k=..., min_p=..., eos_id=..., pad_id=...)` returns a `GenerateOutput` with the same
semantics as the HF path of `qerl_exp.rl.rollout`. See `docs/engine.md`.
"""

from qerl_exp.engine.decode import GenerateOutput
from qerl_exp.engine.fast_engine import FastEngine

__all__ = ["FastEngine", "GenerateOutput"]
