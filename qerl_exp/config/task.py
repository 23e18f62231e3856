"""The task group's schema: where a run's problems come from, how its prompts are rendered and
how its completions are scored (`TaskConfig`, a field of `qerl_exp.config.Config`)."""

from __future__ import annotations

import math
import os
import typing
from dataclasses import field
from pathlib import Path

from qerl_exp.config.schema import check as _check
from qerl_exp.config.schema import choice as _choice
from qerl_exp.config.schema import schema

# The paper's instruction, the system prompt of chat-template models unless a task preset sets another.
SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process and then provides the user with the answer. "
    "The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags, "
    "respectively, i.e., <think> reasoning process here </think><answer> answer here </answer>."
)

@schema
class ColumnsConfig:
    """Which columns of a `task=dataset` source hold the prompt and the answer.

    Args:
        prompt: the prompt's column: text, or a list of `{role, content}` messages (TRL's
            conversational format, rendered by the chat template as it is); empty: `prompt`, else
            `question`.
        answer: the reference answer's column (reward functions get it as `answer`, as text, and
            the built-in `correct` judges against it); empty: `answer`, else `solution`.
    """

    prompt: str = ""
    answer: str = ""


# The tasks that read their problems from data (`task.path`); the others generate theirs.
FILE_TASKS = ("gsm8k", "math", "dataset")
# The reward functions the harness has built in; `task.reward_funcs` names them bare.
BUILTIN_REWARDS = ("format", "correct")
# What transformers' `apply_chat_template` takes as its own arguments rather than as template
# variables; the harness sets the first ones itself (every prompt is rendered as text, with the
# generation prompt), and the others would change what a prompt is.
TEMPLATE_ARGUMENTS = ("add_generation_prompt", "tokenize", "conversation", "messages", "continue_final_message",
                      "chat_template", "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding",
                      "truncation", "max_length", "tokenizer_kwargs")


@schema
class TaskConfig:
    """The problems the policy learns to solve and how they are scored.

    Args:
        name: `arith` (synthetic, seeded), `wordprob` (synthetic word problems, seeded), `fork`
            (arith's questions by two routes, one worth more: `tasks.fork`), `gsm8k` or `math`
            (local data or, for GSM8K, the hub), `dataset` (your own data: any source
            of `path` in TRL's standard or conversational format, docs/own_task.md).
        path: the data of a file-backed task (gsm8k, math, dataset), read through Hugging Face
            `datasets`: a JSONL, JSON, CSV or Parquet file, a folder written by `save_to_disk`, or
            a hub dataset id; empty: gsm8k's hub copy. The generated tasks refuse it. A local path
            (as every path of this group: `eval_path`, a reward file, a chat template file) is
            relative to the working directory and recorded resolved, so that the run is resumed,
            evaluated and exported from any folder.
        eval_path: a second source to evaluate on, of the same kinds (e.g. GSM8K's test file): its
            `eval_split`, else its only split. Empty: the held-out problems come from `path`.
        split: the split of `path` to train on (a data file's one split is `train`).
        eval_split: the split to evaluate on (of `eval_path` when set, else of `path`, e.g.
            `test`); empty: a fixed held-out slice of the training split (or eval_path's only
            split).
        columns: task=dataset: the prompt and answer columns (`ColumnsConfig`).
        difficulty: arith: digits of each operand (1-6); wordprob: operations per problem (1-3),
            its numbers growing with it (a start below 20 x difficulty).
        ops: arith and wordprob: operators to draw from (`/` for wordprob only; its quotients are
            whole numbers).
        templates: wordprob: what training draws are phrased from: `base` (three themes) or
            `wide` (those and six more, with their own sentence and question forms, names and
            objects); the evaluation splits are the same for both.
        eval_size: held-out problems used by evaluation (a single file holds out at most a
            quarter of its problems). 0: none; every problem of `path` trains, and evaluation
            scores all of `eval_path` (or `eval_split`), or is off without one.
        drop_duplicates: task=gsm8k, math, dataset: drop a row whose prompt an earlier row has
            (false: keep it, as TRL does; their count is printed and recorded in `summary.json`). A
            held-out prompt never trains either way.
        sampler: task=gsm8k, math, dataset: how training draws its prompts: `epoch` shuffles the
            training prompts once per epoch, seeded by the run's seed, and draws every one of them
            once per epoch (`epoch` is logged); `independent` draws each step's prompts afresh (a
            prompt may come back before the others have been seen). The generated tasks draw
            new problems each step.
        reward_funcs: the reward functions, in TRL's batched signature
            `fn(prompts, completions, **kwargs) -> list[float | None]` (`qerl_exp.tasks.reward_funcs`;
            sync or async): `path/to/file.py:function`, `package.module:function`, or the built-in
            `format` and `correct`. Each is logged as `rewards/<function>/mean` and `/std`; a
            completion's reward is their weighted sum. Empty: `format` (unless format_reward is 0)
            and `correct`.
        reward_weights: one weight per entry of reward_funcs; empty: 1 each.
        reward_kwargs: keyword arguments of your own for a reward function, by its name: e.g.
            `{length: {target: 200}}` calls `length(..., target=200)` on every batch.
        format_reward: the built-in `format`'s reward for a completion in the
            <think>...</think><answer>...</answer> format; 0 leaves it out of the default functions.
        correct_reward: the built-in `correct`'s reward for an exactly correct answer.
        answer_from: where the built-in `correct` takes the judged answer from: `tags`, the last
            <answer>...</answer> (the paper); `text`, also a reply's natural forms when it has no
            tags: the last \\boxed{...}, else what follows the last `####` or "answer is", else its
            last number.
        system_prompt: the system message that chat-template models get with a text prompt under
            `text_prompts=chat` (the embedded model ignores it; a conversational prompt carries its
            own messages); empty sends none, so the template's default applies.
        text_prompts: how a checkpoint gets a text prompt (TRL's standard format): `chat`, as the user
            message after `system_prompt` through the chat template (the built-in tasks' problems);
            `verbatim`, the text itself, as TRL sends it (the `dataset` preset's). A conversational
            prompt always goes through the chat template, and one whose last message is the
            assistant's is continued, as TRL does; the embedded model's prompts are always the text.
        chat_template: the chat template of a checkpoint's tokenizer, for rollouts, the learner and
            evaluation alike: a Jinja template, or the path of a file holding one; empty: the
            checkpoint's own. The embedded model has none (its prompts are plain text).
        chat_template_kwargs: extra variables the chat template is rendered with, e.g.
            `{enable_thinking: false}` for Qwen3; not the arguments the harness passes itself
            (`add_generation_prompt`, `tokenize`, ...: `TEMPLATE_ARGUMENTS`).
        route_b_prior: fork: the embedded base's probability of opening a reply with route B, set
            by its warm-up.
    """

    name: str = "arith"
    path: str = ""
    eval_path: str = ""
    split: str = "train"
    eval_split: str = ""
    columns: ColumnsConfig = field(default_factory=ColumnsConfig)
    difficulty: int = 2
    ops: list[str] = field(default_factory=lambda: ["+", "-"])
    templates: str = "base"
    eval_size: int = 200
    drop_duplicates: bool = False
    sampler: str = "epoch"
    reward_funcs: list[str] = field(default_factory=list)
    reward_weights: list[float] = field(default_factory=list)
    reward_kwargs: dict[str, dict[str, typing.Any]] = field(default_factory=dict)
    format_reward: float = 0.2
    correct_reward: float = 2.0
    answer_from: str = "tags"
    system_prompt: str = SYSTEM_PROMPT
    text_prompts: str = "chat"
    chat_template: str = ""
    chat_template_kwargs: dict[str, typing.Any] = field(default_factory=dict)
    route_b_prior: float = 0.01

    def __post_init__(self) -> None:
        _choice("task.name", self.name, ("arith", "fork", "wordprob", *FILE_TASKS))
        _check(0 < self.route_b_prior <= 0.5, f"task.route_b_prior must be in (0, 0.5], got {self.route_b_prior}")
        _choice("task.answer_from", self.answer_from, ("tags", "text"))
        _choice("task.text_prompts", self.text_prompts, ("chat", "verbatim"))
        _choice("task.templates", self.templates, ("base", "wide"))
        _check(self.templates == "base" or self.name == "wordprob",
               f"task.templates={self.templates} is for task.name=wordprob; leave it at base for task.name={self.name}")
        if self.name not in FILE_TASKS:
            for key, value, default in (("path", self.path, ""), ("eval_path", self.eval_path, ""),
                                        ("split", self.split, "train"), ("eval_split", self.eval_split, "")):
                _check(value == default, f"task.{key} is for the tasks that read data ({', '.join(FILE_TASKS)}); "
                                         f"task={self.name} generates its problems: drop task.{key}, or choose task=dataset")
        _check(self.name == "dataset" or self.columns == ColumnsConfig(),
               f"task.columns is for task=dataset; task={self.name} knows its columns: drop task.columns")
        _check(bool(self.split), "task.split must name a split (a data file's one split is train)")
        top = 3 if self.name == "wordprob" else 6
        _check(1 <= self.difficulty <= top, f"task.difficulty must be in 1..{top} for task.name={self.name}, got {self.difficulty}")
        _check(len(self.ops) > 0, "task.ops must name at least one operator")
        for op in self.ops:
            _choice("task.ops entry", op, ("+", "-", "*", "/") if self.name == "wordprob" else ("+", "-", "*"))
        _check(self.eval_size >= 0, "task.eval_size must be >= 0 (0: hold no problem out)")
        _choice("task.sampler", self.sampler, ("epoch", "independent"))
        own = [k for k in self.chat_template_kwargs if k in TEMPLATE_ARGUMENTS]
        _check(not own, f"task.chat_template_kwargs.{own[0] if own else ''} is an argument of the template's rendering, not "
                        "a variable of the template (the harness renders every prompt as text with "
                        "add_generation_prompt=true); drop it")
        self._check_rewards()
        self._resolve_paths()

    def _resolve_paths(self) -> None:
        """Local paths made absolute (see `path`); one that is not here, or a hub id, stays as typed."""
        def resolved(value: str) -> str:
            return os.path.abspath(os.path.expanduser(value)) if value and Path(value).expanduser().exists() else value

        self.path, self.eval_path = resolved(self.path), resolved(self.eval_path)
        specs = []
        for spec in self.reward_funcs:
            where, _, name = spec.rpartition(":")
            specs.append(f"{resolved(where)}:{name}" if where.endswith(".py") else spec)
        self.reward_funcs = specs
        if self.chat_template_file:
            self.chat_template = resolved(self.chat_template)

    def _check_rewards(self) -> None:
        names = []
        for spec in self.reward_funcs:
            where, _, name = spec.rpartition(":")
            _check(spec in BUILTIN_REWARDS or (bool(where) and name.isidentifier()),
                   f"task.reward_funcs entry {spec!r} is not path/to/file.py:function, package.module:function, "
                   f"or a built-in ({', '.join(BUILTIN_REWARDS)})")
            _check(name not in names, f"task.reward_funcs names two functions {name!r}; each is logged by its name "
                                      "(rewards/<name>/mean): give one another name in its file")
            names.append(name)
        _check(not self.reward_weights or len(self.reward_weights) == len(self.reward_funcs),
               f"task.reward_weights has {len(self.reward_weights)} entries for {len(self.reward_funcs)} task.reward_funcs; "
               "give one weight per function, or none (1 each)")
        _check(all(math.isfinite(w) for w in self.reward_weights), "task.reward_weights must be finite numbers")
        for name, kwargs in self.reward_kwargs.items():
            _check(name in names or (not self.reward_funcs and name in BUILTIN_REWARDS),
                   f"task.reward_kwargs.{name} names no function of task.reward_funcs ({', '.join(names) or 'the built-in ones'}); "
                   "key it by the name after the colon")
            _check(isinstance(kwargs, dict), f"task.reward_kwargs.{name} must map argument names to values, "
                                             f"e.g. {{{name}: {{scale: 2.0}}}}")

    @property
    def holds_out(self) -> bool:
        """Whether evaluation has problems: held out of the data (`eval_size`), or its own (`eval_path`,
        `eval_split`, the hub GSM8K's test split)."""
        return self.eval_size > 0 or bool(self.eval_path or self.eval_split) or (self.name == "gsm8k" and not self.path)

    @property
    def chat_template_file(self) -> str:
        """The file `chat_template` names, or empty when it is a Jinja template itself (it holds
        `{{` or `{%`) or empty."""
        return "" if not self.chat_template or "{{" in self.chat_template or "{%" in self.chat_template else self.chat_template
