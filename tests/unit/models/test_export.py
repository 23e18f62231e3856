"""`python -m qerl_exp.export`, and a pretrained checkpoint's defaults: a small random checkpoint
saved with `save_pretrained` trains by `model.name=DIR` with the schema's defaults, and its export
loads with `transformers` alone, greedy outputs equal to the run's policy's; the embedded model's
export loads with `AutoTokenizer` with its own ids; a 4-bit run's merge warns and reports the
difference; refusals come in one line and leave the run as it was."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, SUBPROCESS_ENV, qerl, run_in_process
from qerl_exp.eval.__main__ import load_run
from qerl_exp.export import ExportCommand, export, main, report
from qerl_exp.models.tokenizers import CharTokenizer
from qerl_exp.rl.rollout import completion_mask, encode_prompts, hf_generate

SMALL = ["tracker.mode=disabled", "train.steps=2", "train.prompts_per_step=2", "algo.group_size=2", "task.eval_size=8"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random Qwen2 over the character vocabulary, saved in bf16 with its tokenizer. Its tied
    embeddings are scaled up until they rule the residual stream: it repeats its last token, with a
    greedy margin (~70 % of the top logit) that no bf16 rounding moves (HF's initialisation alone
    flips greedy tokens between fp32 and bf16)."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    folder = tmp_path_factory.mktemp("checkpoint")
    tok = CharTokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                         tie_word_embeddings=True))
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(10)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, bos_token_id=tok.bos_id)
    model.to(torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def pretrained_run(checkpoint, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("pretrained") / "run"
    out = qerl(f"model.name={checkpoint}", *SMALL, f"run_dir={run_dir}")
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_checkpoint_by_name_runs_with_the_papers_defaults(pretrained_run, checkpoint):
    config = json.loads((pretrained_run / "config.json").read_text())
    assert config["model"]["name"] == str(checkpoint) and config["model"]["source"] == "pretrained"
    assert (config["train"]["lr"], config["algo"]["max_new_tokens"], config["monitor"]["every"]) == (1e-5, 1024, 0)
    assert json.loads((pretrained_run / "summary.json").read_text())["steps"] == 2


@pytest.mark.slow
def test_the_merged_export_loads_with_transformers_alone_and_answers_as_the_run(pretrained_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    before = _digest(pretrained_run)
    out = tmp_path / "export"
    proc = subprocess.run([sys.executable, "-m", "qerl_exp.export", f"run_dir={pretrained_run}", f"out={out}", "merge=bf16"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=SUBPROCESS_ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("merged vs the run's policy on 8 held-out prompts: greedy completions identical on 8/8, "
                               "argmax agrees on 100.0% of ") and lines[-1] == f"written: {out}"
    assert _digest(pretrained_run) == before  # the run is read, never written
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "export.json",
            "adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= set(_digest(out))
    # what a user does: transformers alone, the greedy completions of the run's policy
    model = AutoModelForCausalLM.from_pretrained(out)
    hf_tok = AutoTokenizer.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    cfg, task, models = load_run(pretrained_run, device="cpu")
    prompts = [models.tokenizer.render_prompt(p.question, cfg.task.system_prompt) for p in task.eval_problems()[:8]]
    ids, mask = encode_prompts(prompts, models.tokenizer)
    batch = hf_tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert torch.equal(batch["input_ids"], ids) and torch.equal(batch["attention_mask"], mask)
    theirs = model.generate(**batch, max_new_tokens=24, do_sample=False)[:, ids.shape[1]:]
    ours = hf_generate(models.policy, ids, mask, max_new_tokens=24, eos_id=models.tokenizer.eos_ids,
                       pad_id=models.tokenizer.pad_id, temperature=0.0, top_p=1.0).sequences[:, ids.shape[1]:]
    m_theirs, m_ours = completion_mask(theirs, hf_tok.eos_token_id)[0].bool(), completion_mask(ours, models.tokenizer.eos_ids)[0].bool()
    assert all(torch.equal(a[x], b[y]) for a, x, b, y in zip(theirs, m_theirs, ours, m_ours))
    record = json.loads((out / "export.json").read_text())
    assert record["difference"]["greedy_identical"] == 8 and record["quant"] == "none"


@pytest.mark.slow
def test_the_adapter_export_is_peft_on_the_base(pretrained_run, checkpoint, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "adapter"
    export(ExportCommand(run_dir=str(pretrained_run), out=str(out), device="cpu"))
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(checkpoint)
    assert not (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert _digest(out)["adapter_model.safetensors"] == _digest(pretrained_run / "final" / "adapter")["adapter_model.safetensors"]
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32), out).eval()
    _, _, models = load_run(pretrained_run, device="cpu")
    ids = torch.tensor([[20, 21, 22, 23, 24]])
    with torch.no_grad():
        torch.testing.assert_close(peft(input_ids=ids).logits, models.policy(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_the_embedded_models_export_merges_its_adapter_and_a_4bit_base_warns(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = tmp_path / "run"
    run_in_process(run_dir, *SMALL, "quant=nvfp4", "monitor.every=0", "checkpoint.every=0")
    out = tmp_path / "export"
    record = export(ExportCommand(run_dir=str(run_dir), out=str(out), merge="bf16", prompts=4, tokens=16, device="cpu"))
    lines = report(record)
    assert lines[0] == ("warning: the run trained its adapter on a nvfp4 base; the merged model adds it to the unquantized "
                        "base, which is not the model it learned on (merge=dequantized merges it into the decoded 4-bit "
                        "weights it learned on)")
    diff = record["difference"]
    assert lines[1].startswith("merged vs the run's policy on 4 held-out prompts:") and diff["mean_kl"] > 0
    # each merged linear is the unquantized base plus alpha / r * B A of the run's adapter, in bf16
    cfg = json.loads((run_dir / "config.json").read_text())
    base = load_file(str(Path(record["base"]["path"]) / "model.safetensors"))
    lora = load_file(str(run_dir / "final" / "adapter" / "adapter_model.safetensors"))
    merged = load_file(str(out / "model.safetensors"))
    scale = cfg["lora"]["alpha"] / cfg["lora"]["r"]
    moved = 0
    for key, b in lora.items():
        if ".lora_B." not in key:
            continue
        a = lora[key.replace(".lora_B.", ".lora_A.")]
        name = key.removeprefix("base_model.model.").replace(".lora_B.weight", ".weight")
        want = base[name] + scale * (b @ a)
        torch.testing.assert_close(merged[name].float(), want.to(torch.bfloat16).float(), rtol=0, atol=1e-6)
        moved += int((want.to(torch.bfloat16) != base[name].to(torch.bfloat16)).sum())
    assert moved > 0  # the trained adapter changed the weights, in bf16 too
    hf_tok, char = AutoTokenizer.from_pretrained(out), CharTokenizer()
    text = "12+34=? <think> 12+34=46 </think><answer> 46 </answer>"
    assert hf_tok(text)["input_ids"] == [char.bos_id, *char.encode(text)]
    assert hf_tok.decode([char.bos_id, *char.encode(text), char.eos_id], skip_special_tokens=True) == text
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size >= len(char)


@pytest.mark.parametrize("quant", ["nvfp4", "nf4"])
def test_the_dequantized_merge_is_the_policy_as_trained(tmp_path, quant, capsys):
    """merge=dequantized: each 4-bit layer decoded to what it multiplies by, plus its adapter; loaded
    back by transformers alone it answers as the run's policy does, and the command says how closely."""
    from transformers import AutoModelForCausalLM

    from qerl_exp.quant import dense_weight

    run_dir = tmp_path / "run"
    run_in_process(run_dir, *SMALL, f"quant={quant}", "monitor.every=0", "checkpoint.every=0")
    out = tmp_path / "export"
    main([f"run_dir={run_dir}", f"out={out}", "merge=dequantized", "prompts=8", "tokens=24", "device=cpu"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("merged vs the run's policy on 8 held-out prompts: greedy completions identical on 8/8, "
                               "argmax agrees on 100.0% of "), lines  # no warning: it is the model the run trained
    record = json.loads((out / "export.json").read_text())
    assert record["difference"]["mean_kl"] < 1e-3 and record["merge"] == "dequantized"
    # every decoder linear is its decoded 4-bit weight plus alpha / r * B A, independently of the export's code
    _, _, models = load_run(run_dir, device="cpu")
    merged = AutoModelForCausalLM.from_pretrained(out)
    cfg = json.loads((run_dir / "config.json").read_text())
    scale = cfg["lora"]["alpha"] / cfg["lora"]["r"]
    theirs = dict(merged.named_modules())
    checked = 0
    for name, module in models.policy.get_base_model().named_modules():
        if hasattr(module, "lora_A"):
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            want = dense_weight(module.get_base_layer()) + scale * (b @ a)
            torch.testing.assert_close(theirs[name].weight, want.to(theirs[name].weight.dtype), rtol=1e-6, atol=1e-6)
            checked += 1
    assert checked == 2 * 7
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM" and Path(config["base_model_name_or_path"]).is_absolute()


def test_an_adapter_exported_from_a_run_on_a_relative_folder_loads_from_anywhere(checkpoint, tmp_path, monkeypatch):
    from peft import AutoPeftModelForCausalLM

    monkeypatch.chdir(checkpoint.parent)
    run_dir = tmp_path / "run"
    run_in_process(run_dir, f"model.name={checkpoint.name}", *SMALL, "train.steps=1")  # as typed: relative
    out = tmp_path / "adapter"
    export(ExportCommand(run_dir=str(run_dir), out=str(out), device="cpu"))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(checkpoint.resolve()) and config["task_type"] == "CAUSAL_LM"
    monkeypatch.chdir(tmp_path)  # another folder: the adapter finds its base
    model = AutoPeftModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "PeftModelForCausalLM"


@pytest.mark.parametrize("case, message", [
    ("unfinished", "error: run_dir=RUN holds an unfinished run (no summary.json); finish it with python -m qerl_exp "
                   "resume=RUN, then export it"),
    ("exists", "error: out=OUT exists; give a new folder (export never writes into an existing one)"),
    ("merge", "error: merge='fp16' is not valid; choose one of: none, bf16, dequantized"),
    ("dequantized", "error: merge=dequantized merges the adapter into a 4-bit base's decoded weights, and this run's "
                    "base is unquantized (quant.format=none); use merge=bf16"),
    ("no run", "error: run_dir=RUN is not a run directory (no config.json)"),
])
@pytest.mark.slow
def test_export_refuses_in_one_line_and_writes_nothing(pretrained_run, tmp_path, capsys, case, message):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    shutil.copytree(pretrained_run, run_dir)
    argv = [f"run_dir={run_dir}", f"out={out}"]
    if case == "unfinished":
        (run_dir / "summary.json").unlink()
    elif case == "exists":
        out.mkdir()
    elif case == "merge":
        argv.append("merge=fp16")
    elif case == "dequantized":
        argv.append("merge=dequantized")
    else:
        (run_dir / "config.json").unlink()
    before = _digest(run_dir)
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code != 0
    assert capsys.readouterr().err.strip().splitlines() == [message.replace("RUN", str(run_dir)).replace("OUT", str(out))]
    assert _digest(run_dir) == before and (case == "exists" or not out.exists())
    assert not list(tmp_path.glob(".out.partial-*"))


@pytest.mark.slow
@pytest.mark.parametrize("inside", ["export", "final/adapter/merged", "checkpoints/x/y"])
def test_export_refuses_an_out_inside_the_run(pretrained_run, capsys, inside):
    before = _digest(pretrained_run)
    with pytest.raises(SystemExit) as stop:
        main([f"run_dir={pretrained_run}", f"out={pretrained_run / inside}", "merge=bf16"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: out={pretrained_run / inside} lies in the run directory {pretrained_run}; export writes its folder outside "
        "every run (nothing in a run changes): choose another out="]
    assert _digest(pretrained_run) == before


@pytest.mark.slow
def test_tokens_beyond_the_models_positions_are_refused_before_decoding(pretrained_run, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main([f"run_dir={pretrained_run}", f"out={tmp_path / 'out'}", "merge=bf16", "prompts=1", "tokens=3000"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: tokens=3000 and the task's longest prompt (") and \
        "exceed the model's 2048 positions; lower tokens to at most " in err[0], err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


@pytest.mark.slow
def test_the_exported_and_final_folders_get_the_umasks_mode(pretrained_run, tmp_path):
    import os

    mask = os.umask(0o027)
    try:
        export(ExportCommand(run_dir=str(pretrained_run), out=str(tmp_path / "out"), device="cpu"))
    finally:
        os.umask(mask)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o750  # tempfile makes 0700, which a rename keeps
    assert (pretrained_run / "final").stat().st_mode & 0o777 == 0o777 & ~mask  # the run's, under the suite's umask


@pytest.mark.slow
def test_an_adapter_exports_whatever_reward_code_changed_and_never_onto_a_changed_base(pretrained_run, checkpoint, tmp_path,
                                                                                       capsys):
    from qerl_exp.run import record

    run_dir, base = tmp_path / "run", tmp_path / "base"
    shutil.copytree(pretrained_run, run_dir)
    shutil.copytree(checkpoint, base)  # same names and bytes: the digest the run recorded
    (tmp_path / "rw.py").write_text("def fmt(prompts, completions, **kwargs):\n    return [1.0] * len(completions)\n")
    config = json.loads((run_dir / "config.json").read_text())
    config["model"]["name"] = str(base)
    config["task"]["reward_funcs"] = [f"{tmp_path}/rw.py:fmt"]
    config[record.REWARDS_KEY] = {"fmt": {"file": f"{tmp_path}/rw.py", "sha256": _sha16(tmp_path / "rw.py")}}
    (run_dir / "config.json").write_text(json.dumps(config))
    (tmp_path / "rw.py").write_text("def fmt(prompts, completions, **kwargs):\n    return [2.0] * len(completions)\n")
    main([f"run_dir={run_dir}", f"out={tmp_path / 'adapter'}"])  # it scores nothing: the reward code is not its business
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    capsys.readouterr()
    torch.manual_seed(1)  # the checkpoint's folder gets other weights (a re-download, a "latest" link moved on)
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01 * torch.randn_like(p))
    other.save_pretrained(base)
    capsys.readouterr()
    for merge in ("none", "bf16"):
        with pytest.raises(SystemExit) as stop:
            main([f"run_dir={run_dir}", f"out={tmp_path / merge}", f"merge={merge}"])
        assert stop.value.code == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"error: the base model's files (model.name={base}) changed since the run was trained (their sha256 differs "
            "from the one in config.json): its adapter would be applied to another base; restore them"]
        assert not (tmp_path / merge).exists()


def _sha16(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


@pytest.mark.slow
def test_sigterm_during_a_merge_ends_it_in_one_line_and_leaves_nothing(pretrained_run, tmp_path):
    import signal
    import time

    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "qerl_exp.export", f"run_dir={pretrained_run}", f"out={out}",
                             "merge=bf16", "tokens=1700"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=SUBPROCESS_ENV)
    deadline = time.monotonic() + 300
    while not list(tmp_path.glob(".out.partial-*/adapter")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(1.0)  # into the comparison's decoding
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and err.strip().splitlines() == ["error: interrupted; nothing was written"], err[-2000:]
    assert list(tmp_path.iterdir()) == []
