"""TRL's names of the settings a GRPOTrainer experiment sets, and the harness's keys for them.

`TRL_NAMES` maps each name of TRL's `GRPOConfig` (its `TrainingArguments` included) and of peft's
`LoraConfig` that has a counterpart here to that counterpart: the key, and where the two differ, how.
docs/trl.md shows the same table (a test holds them equal), and the command line's one line for an
unknown key names the counterpart of a TRL name (`did_you_mean`), e.g. `learning_rate=1e-5` ->
`train.lr`.
"""

from __future__ import annotations

# TRL's (or peft's) name -> (the harness's key, how they differ; empty where they mean the same:
# docs/trl.md writes "the same").
TRL_NAMES: dict[str, tuple[str, str]] = {
    "learning_rate": ("train.lr", ""),
    "lr_scheduler_type": ("train.lr_scheduler", "transformers' names; the default, warmup_cosine, is the harness's"),
    "lr_scheduler_kwargs": ("train.lr_scheduler_kwargs", ""),
    "warmup_steps": ("train.warmup_ratio", "a fraction of train.steps (as TRL reads a value below 1)"),
    "weight_decay": ("train.weight_decay", ""),
    "optim": ("train.optimizer", "adamw_torch or adamw_8bit"),
    "max_grad_norm": ("train.grad_clip", ""),
    "max_steps": ("train.steps", ""),
    "num_train_epochs": ("train.steps", "steps, not epochs; `epoch` is logged"),
    "per_device_train_batch_size": ("train.prompts_per_step", "prompts, each sampled algo.group_size times"),
    "generation_batch_size": ("train.prompts_per_step", "prompts, each sampled algo.group_size times"),
    "steps_per_generation": ("algo.mini_batches", "optimizer steps per rollout batch"),
    "gradient_checkpointing": ("train.gradient_checkpointing", "auto also chooses how many blocks"),
    "seed": ("seed", ""),
    "shuffle_dataset": ("task.sampler", "epoch shuffles the prompts every epoch"),
    "num_generations": ("algo.group_size", ""),
    "max_completion_length": ("algo.max_new_tokens", ""),
    "temperature": ("algo.temperature", ""),
    "top_p": ("algo.top_p", ""),
    "top_k": ("algo.top_k", "0 is off"),
    "min_p": ("algo.min_p", "0 is off"),
    "beta": ("algo.beta", ""),
    "num_iterations": ("algo.num_iterations", ""),
    "epsilon": ("algo.eps_low", ""),
    "epsilon_high": ("algo.eps_high", "null follows algo.eps_low"),
    "importance_sampling_level": ("algo.importance_sampling_level", ""),
    "scale_rewards": ("algo.scale_rewards", ""),
    "loss_type": ("algo.loss_type", "grpo, dr_grpo, dapo, bnpo; the default is grpo (TRL's: dapo)"),
    "mask_truncated_completions": ("algo.mask_truncated_completions", ""),
    "entropy_coef": ("algo.entropy_coef", ""),
    "use_bias_correction_kl": ("algo.kl_estimator", "k3_ratio is TRL's true"),
    "vllm_importance_sampling_cap": ("algo.tis_cap", "0 is off"),
    "reward_weights": ("task.reward_weights", ""),
    "chat_template_kwargs": ("task.chat_template_kwargs", ""),
    "log_completions": ("tracker.completions_every", "every N steps; 0 is off"),
    "report_to": ("tracker.mode", "offline, online or disabled (W&B)"),
    "output_dir": ("run_dir", ""),
    "save_steps": ("checkpoint.every", ""),
    "save_total_limit": ("checkpoint.keep", ""),
    "eval_steps": ("eval.every", ""),
    "r": ("lora.r", "peft's LoraConfig"),
    "lora_alpha": ("lora.alpha", "peft's LoraConfig"),
    "lora_dropout": ("lora.dropout", "peft's LoraConfig"),
    "target_modules": ("lora.targets", "peft's LoraConfig; a list, or [all-linear]"),
}


def did_you_mean(key: str) -> str:
    """' did you mean KEY (TRL's NAME)?' for a key whose last part is a TRL name; empty otherwise."""
    name = key.lstrip("+~").rsplit(".", 1)[-1]
    if name not in TRL_NAMES:
        return ""
    ours, how = TRL_NAMES[name]
    return f"; did you mean {ours} (TRL's {name}{': ' + how if how else ''})?"
