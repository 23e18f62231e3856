"""Tokenizers behind one small interface: the embedded character-level one, and HF's.

The run loop needs only: `encode`, `decode`, `pad_id`, `eos_id` and `render_prompt` (turning a
task's question into the model's prompt text: plain text for the embedded model, the chat
template with the task's system prompt for instruct checkpoints).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# The reasoning/answer tags are single tokens, so the embedded model spends its capacity on the
# arithmetic rather than on spelling tags.
TAGS = ("<think>", "</think>", "<answer>", "</answer>")
SPECIALS = ("<pad>", "<bos>", "<eos>")
CHARS = "0123456789+-*/=.,()$%:?! \nabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\\{}^_[]|<>'\"#&;~"


class CharTokenizer:
    """Character-level tokenizer with atomic tags; unknown characters raise, never vanish."""

    def __init__(self, chars: str = CHARS):
        self.vocab = list(SPECIALS) + list(TAGS) + list(dict.fromkeys(chars))
        self.index = {tok: i for i, tok in enumerate(self.vocab)}
        self.pad_id, self.bos_id, self.eos_id = (self.index[s] for s in SPECIALS)
        self._split = re.compile("|".join(re.escape(t) for t in TAGS) + r"|.", re.DOTALL)

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.index[piece] for piece in self._split.findall(text)]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the embedded tokenizer's vocabulary") from None

    def decode(self, ids: list[int]) -> str:
        # Ids past the vocabulary come from models built wider than it (shape presets): U+FFFD.
        specials = (self.pad_id, self.bos_id, self.eos_id)
        return "".join(self.vocab[i] if i < len(self.vocab) else "\ufffd" for i in ids if i not in specials)

    def render_prompt(self, question: str, system_prompt: str) -> str:
        # The embedded model has no chat template; it learned the format during warm-up.
        return question

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"vocab": self.vocab}))


class HFTokenizer:
    """Adapter around a `transformers` tokenizer: its own EOS, pad = EOS when it has none,
    completions decoded without special tokens, prompts through its chat template.

    Args:
        name_or_path: a local folder or a hub id.
        local_files_only: never reach the hub (it was found unreachable).
    """

    def __init__(self, name_or_path: str | Path, local_files_only: bool = False):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(name_or_path, local_files_only=local_files_only)
        if not self.encode("0123456789 abc"):  # transformers makes an empty one where there are no files
            raise ValueError(f"the tokenizer of {name_or_path} encodes text to nothing (no tokenizer files?); "
                             "give a checkpoint with its tokenizer")
        self.eos_id = self.tok.eos_token_id
        if self.eos_id is None:
            raise ValueError(f"the tokenizer of {name_or_path} has no EOS token; completions could never end")
        self.bos_id = None  # the chat template adds what the model expects
        # Some transformers versions leave SmolLM2's tokenizer without a pad token.
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id

    def __len__(self) -> int:
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def render_prompt(self, question: str, system_prompt: str) -> str:
        if self.tok.chat_template is None:  # a base model: the plain text
            return f"{system_prompt}\n\n{question}" if system_prompt else question
        # No system message when it is empty: the template's own default (if any) applies.
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": question})
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def save(self, path: Path) -> None:
        self.tok.save_pretrained(path.parent / "tokenizer")
