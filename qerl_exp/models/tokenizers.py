"""Tokenizers behind one small interface: the embedded character-level one, and HF's.

The run loop needs only: `encode`, `decode`, `pad_id`, `eos_ids` (every token that ends a
completion; `eos_id`, the first, is the tokenizer's own) and `render_prompt` (turning a task's
question into the model's prompt text: plain text for the embedded model, the chat template with
the task's system prompt for instruct checkpoints). `save_pretrained` writes a tokenizer that
`transformers.AutoTokenizer` loads (`python -m qerl_exp.export`).
"""

from __future__ import annotations

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
        self.eos_ids = [self.eos_id]
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

    def render_prompt(self, prompt: str | list[dict], system_prompt: str) -> str:
        # The embedded model has no chat template; it learned the format during warm-up.
        if not isinstance(prompt, str):
            raise ValueError("the embedded model has no chat template, so it cannot take conversational prompts "
                             "(lists of messages); use model.name=<a checkpoint with a chat template>, or text prompts")
        return prompt

    def to_hf(self):
        """The same tokenizer as a `transformers` fast tokenizer: one token per character, the tags
        atomic, `<bos>` prepended as the run loop does (`rollout.encode_prompts`), the same ids, and
        decoding that skips the special tokens as `decode` does. Its characters are spelled
        byte-level (a space is `Ġ`), so `AutoTokenizer` rebuilds it the same where a model's type
        brings its own byte-level class (Qwen2's); a character outside the vocabulary is dropped."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import AddedToken, PreTrainedTokenizerFast

        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        vocab = {tok if tok in SPECIALS or tok in TAGS else byte_level.pre_tokenize_str(tok)[0][0]: i
                 for i, tok in enumerate(self.vocab)}
        core = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))  # no merges: one token a character
        core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
        core.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])  # in the vocabulary: same ids
        core.pre_tokenizer, core.decoder = byte_level, decoders.ByteLevel()
        return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                       padding_side="left", add_bos_token=True)

    def save_pretrained(self, path: Path) -> None:
        """Write `to_hf()` into `path` (tokenizer.json and its config)."""
        self.to_hf().save_pretrained(path)


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
        # instruct checkpoints often end a turn with a token the tokenizer does not call EOS
        # (<|im_end|> beside <|endoftext|>): their generation config names every one
        self.eos_ids = list(dict.fromkeys([self.eos_id, *generation_eos_ids(name_or_path, local_files_only)]))
        self.bos_id = None  # the chat template adds what the model expects
        # Some transformers versions leave SmolLM2's tokenizer without a pad token.
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id
        self.name, self.template_kwargs, self.text_prompts = str(name_or_path), {}, "chat"

    def use_chat(self, template: str, kwargs: dict, text_prompts: str = "chat") -> None:
        """Render prompts with `template` (a Jinja chat template; empty keeps the checkpoint's own)
        and the extra template variables `kwargs` (e.g. `{"enable_thinking": False}`); text prompts
        as `text_prompts` says (`task.text_prompts`: `chat` or `verbatim`)."""
        if template:
            self.tok.chat_template = template
        self.template_kwargs, self.text_prompts = dict(kwargs), text_prompts

    def __len__(self) -> int:
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def render_prompt(self, prompt: str | list[dict], system_prompt: str) -> str:
        """The text the model continues, as TRL renders a prompt: a conversation's messages (which keep
        their own system message) through the chat template with the generation prompt, or, when the
        last message is the assistant's (a prefill such as `<think>`), continuing that message
        (`continue_final_message`); a text prompt as `text_prompts` says: `verbatim` as TRL sends a
        standard-format prompt (the tokenizer's own special tokens, e.g. a BOS, before it), `chat` as
        the user message after `system_prompt`."""
        if isinstance(prompt, str) and self.text_prompts == "verbatim":
            return self._specials_before() + prompt
        if self.tok.chat_template is None:  # a base model: the plain text
            if not isinstance(prompt, str):
                raise ValueError(f"the tokenizer of {self.name} has no chat template to render conversational prompts "
                                 "(lists of messages); set task.chat_template=<a Jinja template or its file>")
            return f"{system_prompt}\n\n{prompt}" if system_prompt else prompt
        if isinstance(prompt, str):
            # No system message when it is empty: the template's own default (if any) applies.
            messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
            messages.append({"role": "user", "content": prompt})
        else:
            messages = prompt
        prefill = messages[-1]["role"] == "assistant"
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=not prefill,
                                            continue_final_message=prefill, **self.template_kwargs)

    def _specials_before(self) -> str:
        """The special tokens the tokenizer puts before a text it encodes (a BOS, or nothing), spelled
        as text: `encode` leaves them out, and parses them back from their spelling."""
        ids = self.tok("x")["input_ids"]
        plain = self.tok("x", add_special_tokens=False)["input_ids"]
        lead = ids[: len(ids) - len(plain)] if ids[len(ids) - len(plain):] == plain else []
        return "".join(self.tok.convert_ids_to_tokens(lead))

    def save_pretrained(self, path: Path) -> None:
        """The tokenizer and its chat template, as `transformers` saves them."""
        self.tok.save_pretrained(path)


def generation_eos_ids(name_or_path: str | Path, local_files_only: bool = False) -> list[int]:
    """The EOS ids a checkpoint's `generation_config.json` names (an id or a list); none without one."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(name_or_path, local_files_only=local_files_only).eos_token_id
    except OSError:  # no generation_config.json
        return []
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
