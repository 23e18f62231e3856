"""A run's task checked before the run starts, so that no step fails on a problem, a reward function
or a chat template it could have refused: the sources and the chat template file exist, the reward
functions import and take the rows' columns, the data is read whole (every bad line named by file
and line), each problem is written in characters the embedded model's tokenizer has, and the
longest prompt plus the completion cap fits the model's positions. Where the tokenizer and the
positions are known without loading the model: the embedded model, a local checkpoint folder
(itself checked whole: `pretrained.check_folder`). A hub data set is read when the run starts.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from qerl_exp.config import Config, ConfigError
from qerl_exp.logs import quiet


def check_task(cfg: Config, new_tokens: tuple[str, int] | None = None, model_fixed: bool = False) -> None:
    """Check the task's problems against the model (see the module docstring).

    Args:
        cfg: the run's config.
        new_tokens: the completion cap and the key that sets it; default the larger of
            `algo.max_new_tokens` and `eval.max_new_tokens`.
        model_fixed: the model is a finished run's (an evaluation): no advice to change it.

    Raises:
        ConfigError: one line naming the file and line, or the keys, and what to change.
    """
    import numpy as np

    from qerl_exp.tasks import build_task, reader, reference_completion, reward_funcs

    spec = cfg.task
    if spec.name == "dataset" and not spec.path:
        raise ConfigError(f"task=dataset needs task.path=<{reader.SOURCES}>")
    if spec.chat_template_file and not Path(spec.chat_template_file).expanduser().is_file():
        raise ConfigError(f"task.chat_template={spec.chat_template} is neither a Jinja template (it holds no "
                          "{{ or {%) nor an existing file; give one of them")
    try:
        kinds = [reader.kind(value, f"task.{key}") for key, value in (("path", spec.path), ("eval_path", spec.eval_path))
                 if value]
        if reader.HUB in kinds or spec.name == "gsm8k" and not spec.path:
            reward_funcs.load(spec)  # the data is read when the run starts; its columns are checked then
            return
        with warnings.catch_warnings():  # the run says them; a refusal is one line
            warnings.simplefilter("ignore")
            task = build_task(spec)
    except (OSError, ValueError) as e:  # ConfigError, a missing file, and the data's own one-line faults
        raise ConfigError(str(e).strip().splitlines()[0]) from None
    if getattr(task, "conversational", False) and cfg.model.source == "synthetic":
        raise ConfigError(f"task.path={spec.path} holds conversational prompts (lists of messages), which need a chat "
                          "template, and the embedded model has none: use model.name=<a checkpoint with one>, or text "
                          "prompts")
    tokenizer, positions = _tokenizer(cfg)
    if tokenizer is None:
        return
    if new_tokens is None:
        new_tokens = max(("algo.max_new_tokens", cfg.algo.max_new_tokens), ("eval.max_new_tokens", cfg.eval.max_new_tokens),
                         key=lambda kv: kv[1])
    # a file's problems are all there; a generated task's: its evaluation splits and a fixed sample of its draws
    problems = list(getattr(task, "train", [])) or task.sample(256, np.random.default_rng(0))
    problems += [p for split in task.splits for p in task.eval_problems(split)]
    longest = (0, "")
    for p in problems:
        where = p.source or f"task={cfg.task.name} ({p.question[:40]!r})"
        try:
            n = 1 + len(tokenizer.encode(tokenizer.render_prompt(p.prompt, cfg.task.system_prompt)))
            if cfg.model.source == "synthetic":  # its warm-up learns the worked answer too
                tokenizer.encode(reference_completion(p))
        except ValueError as e:
            raise ConfigError(f"{where}: {e}; remove or rewrite that problem, or use a pretrained model "
                              "(model.name=...)") from None
        longest = max(longest, (n, where))
    key, cap = new_tokens
    synthetic = cfg.model.source == "synthetic"  # its prompts are the questions alone
    more = "" if model_fixed else " or raise model.max_positions" if synthetic else " or use a model with more positions"
    if positions and longest[0] >= positions:
        raise ConfigError(f"the task's longest prompt ({longest[0]} tokens{'' if synthetic else ' with task.system_prompt'}, "
                          f"{longest[1]}) leaves no room in the model's {positions} positions; "
                          + ("raise model.max_positions" if synthetic else
                             f"shorten task.system_prompt (task.system_prompt='' sends none){more}"))
    if positions and longest[0] + cap > positions:
        raise ConfigError(f"{key}={cap} and the task's longest prompt ({longest[0]} tokens, {longest[1]}) exceed the "
                          f"model's {positions} positions; lower {key} to at most {positions - longest[0]}{more}")


def _tokenizer(cfg: Config):
    """The run's tokenizer and its model's positions, where they are known before the model loads:
    the embedded model's; a local checkpoint folder's (checked whole: `pretrained.check_folder`).
    `(None, None)` otherwise (a hub id, a GGUF file)."""
    if cfg.model.source == "synthetic":
        from qerl_exp.models.tokenizers import CharTokenizer

        tokenizer = CharTokenizer()
        if 0 < cfg.model.vocab_size < len(tokenizer):
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is below the embedded tokenizer's {len(tokenizer)} "
                              "tokens; give at least that many, or 0 (the tokenizer's)")
        return tokenizer, cfg.model.max_positions
    folder = Path(cfg.model.name).expanduser()
    if cfg.model.gguf_file or not folder.is_dir():
        return None, None
    from qerl_exp.models.pretrained import check_folder
    from qerl_exp.models.tokenizers import HFTokenizer

    try:
        positions = check_folder(folder)
        with quiet(cfg.verbose):
            return HFTokenizer(folder, local_files_only=True), positions
    except (OSError, ValueError) as e:
        raise ConfigError(str(e).strip().splitlines()[0]) from None
