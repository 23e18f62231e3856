"""LoRA targets as peft takes them: part of a projection group trains with the harness's own learner,
free module names train any causal LM through HF's forward (GPT-2's `c_attn`), `[all-linear]` is
peft's; and what a run cannot train is refused before its run directory is written, in one line."""

from __future__ import annotations

import json

import pytest

from conftest import TINY_RUN, metrics_rows, run_in_process, save_checkpoint
from qerl_exp.cli import validate
from qerl_exp.run.console import UsageError

SMALL = [*TINY_RUN, "train.steps=2", "algo.max_new_tokens=8"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    # a reward that tells a random model's completions apart (the built-in ones give them all 0)
    (root / "rewards.py").write_text("def variety(completions, **kwargs):\n"
                                     "    return [float(len(set(c))) for c in completions]\n")
    return {"rewards": f"task.reward_funcs=[{root / 'rewards.py'}:variety]",
            **{family: save_checkpoint(root / family, family) for family in ("qwen3", "gpt2")}}


def _adapted(run_dir) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(run_dir / "final" / "adapter" / "adapter_model.safetensors"), framework="pt") as f:
        return {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in f.keys()}


def test_part_of_a_group_trains_a_qwen3_checkpoint_with_the_default_learner(folders, tmp_path):
    run = tmp_path / "run"
    rows = run_in_process(run, f"model.name={folders['qwen3']}", "lora.targets=[q_proj,v_proj]", folders["rewards"],
                          *SMALL)
    assert [r["step"] for r in rows] == [0, 1] and all(r["grad_norm"] > 0 for r in rows)
    assert json.loads((run / "config.json").read_text())["train"]["padding_free"] is True
    assert _adapted(run) == {"q_proj", "v_proj"}


def test_gpt2_trains_through_hfs_forward_with_its_own_module_names(folders, tmp_path):
    run = tmp_path / "run"
    rows = run_in_process(run, f"model.name={folders['gpt2']}", "train.padding_free=false", "rollout.engine=hf",
                          "lora.targets=[c_attn]", folders["rewards"], *SMALL)
    assert [r["step"] for r in rows] == [0, 1] and all(r["grad_norm"] > 0 for r in rows)
    assert _adapted(run) == {"c_attn"}


@pytest.mark.parametrize("args, message", [
    # the decoders read no GPT-2: refused with the fallback named, before any run directory
    ([], "model type 'gpt2' is not one the harness's decoders read (llama, qwen2, qwen3); set "
         "train.padding_free=false rollout.engine=hf"),
    (["train.padding_free=false", "rollout.engine=hf", "lora.targets=[q_proj]"],
     "lora.targets entry 'q_proj' names no module of this gpt2 model (its linear layers: c_attn, c_fc, c_proj, lm_head"),
    (["train.padding_free=false", "rollout.engine=hf", "lora.targets=[ln_f]"], "lora.targets=['ln_f']: peft refuses them"),
])
def test_what_a_run_cannot_train_is_refused_before_its_directory(folders, tmp_path, args, message):
    run = tmp_path / "run"
    with pytest.raises(UsageError) as e:
        validate([f"model.name={folders['gpt2']}", *SMALL, f"run_dir={run}", *args], multirun=False)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not run.exists()


def test_decoder_targets_outside_the_blocks_are_refused_and_all_linear_is_peft_s(folders, tmp_path):
    with pytest.raises(UsageError, match="lora.targets entry 'lm_head' names lm_head, outside the decoder blocks' "
                                         "projections .* or set train.padding_free=false rollout.engine=hf"):
        validate([f"model.name={folders['qwen3']}", "lora.targets=[lm_head]", *SMALL], multirun=False)
    run = tmp_path / "run"
    run_in_process(run, "lora.targets=[all-linear]", *SMALL, "train.steps=1")  # the embedded model, every projection
    assert _adapted(run) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert [r["step"] for r in metrics_rows(run)] == [0]
