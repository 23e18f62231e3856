"""A run's task checked before the run starts, so that no step fails on a problem, a reward function
or a chat template it could have refused: the sources and the chat template file exist, the chat
template is Jinja that parses, the reward functions import and take the columns of the training and
the held-out rows alike, the data is read whole (every bad line named by file and line; a hub data
set too, so that a hub id that is not there is named before the run), each problem is written in
characters the embedded model's tokenizer has, and the longest prompt, rendered as the run renders
it (the chat template with its variables and the system prompt), plus the completion cap fits the
model's positions. Where the tokenizer and the positions are known without loading the model: the
embedded model, a local checkpoint folder (itself checked whole: `pretrained.check_folder`), whose
template must render every prompt to text.
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

    from qerl_exp.tasks import build_task, reader, reference_completion

    spec = cfg.task
    if spec.name == "dataset" and not spec.path:
        raise ConfigError(f"task=dataset needs task.path=<{reader.SOURCES}>")
    if spec.chat_template_file and not Path(spec.chat_template_file).expanduser().is_file():
        raise ConfigError(f"task.chat_template={spec.chat_template} is neither a Jinja template (it holds no "
                          "{{ or {%) nor an existing file; give one of them")
    _check_template_syntax(spec)
    try:
        for key, value in (("path", spec.path), ("eval_path", spec.eval_path)):
            if value:
                reader.kind(value, f"task.{key}")
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
            prompt = tokenizer.render_prompt(p.prompt, cfg.task.system_prompt)
        except ValueError as e:
            raise ConfigError(f"{where}: {e}; remove or rewrite that problem, or use a pretrained model "
                              "(model.name=...)") from None
        except Exception as e:  # noqa: BLE001 - a chat template's own faults (Jinja's, raise_exception's)
            raise ConfigError(f"the chat template ({_template_key(cfg)}) cannot render the prompt of {where} "
                              f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}); "
                              "fix the template, or task.chat_template_kwargs") from None
        if not prompt.strip():
            raise ConfigError(f"the chat template ({_template_key(cfg)}) renders the prompt of {where} as empty text: the "
                              "model would see none of it; fix the template")
        try:
            n = 1 + len(tokenizer.encode(prompt))
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
        raise ConfigError(f"the task's longest prompt ({longest[0]} tokens{'' if synthetic else ' as the chat template renders it with task.system_prompt'}, "
                          f"{longest[1]}) leaves no room in the model's {positions} positions; "
                          + ("raise model.max_positions" if synthetic else
                             f"shorten task.system_prompt (task.system_prompt='' sends none)"
                             f"{' or task.chat_template' if cfg.task.chat_template else ''}{more}"))
    if positions and longest[0] + cap > positions:
        raise ConfigError(f"{key}={cap} and the task's longest prompt ({longest[0]} tokens, {longest[1]}) exceed the "
                          f"model's {positions} positions; lower {key} to at most {positions - longest[0]}{more}")


def _template_key(cfg: Config) -> str:
    return f"task.chat_template={cfg.task.chat_template[:60]!r}" if cfg.task.chat_template else \
        f"the checkpoint's own, with task.chat_template_kwargs={dict(cfg.task.chat_template_kwargs)}"


def _check_template_syntax(spec) -> None:
    """Refuse a `task.chat_template` that Jinja cannot parse, naming its line (whatever the model:
    a hub checkpoint's tokenizer is not here before the run)."""
    if not spec.chat_template:
        return
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from qerl_exp.models import chat_template_text

    try:  # as transformers compiles a chat template
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=["jinja2.ext.loopcontrols"]).from_string(chat_template_text(spec))
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"task.chat_template={spec.chat_template[:60]!r} is not a Jinja template Jinja can read "
                          f"(line {e.lineno}: {e.message}); fix it") from None


def _tokenizer(cfg: Config):
    """The run's tokenizer, with the task's chat settings, and its model's positions, where they are
    known before the model loads: the embedded model's; a local checkpoint folder's (checked whole:
    `pretrained.check_folder`). `(None, None)` otherwise (a hub id, a GGUF file)."""
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
    from qerl_exp.models import chat_template_text
    from qerl_exp.models.pretrained import check_folder
    from qerl_exp.models.tokenizers import HFTokenizer

    try:
        positions = check_folder(folder)
        with quiet(cfg.verbose):
            tokenizer = HFTokenizer(folder, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(str(e).strip().splitlines()[0]) from None
    tokenizer.use_chat(chat_template_text(cfg.task), cfg.task.chat_template_kwargs)
    return tokenizer, positions
