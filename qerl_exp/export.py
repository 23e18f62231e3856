"""`python -m qerl_exp.export run_dir=RUN out=DIR [merge=bf16|dequantized]`: a finished run's policy to take away.

Writes a new folder `DIR` (an existing one is refused, and so is one inside a run directory; nothing
in `RUN` changes; an export cut short, by an error, Ctrl-C or SIGTERM, leaves nothing behind):
- the trained LoRA adapter in peft format (`adapter_config.json`, `adapter_model.safetensors`, as the
  run saved it, with `task_type` `CAUSAL_LM` and a `base_model_name_or_path` that loads from anywhere:
  a hub id, or the absolute path of the checkpoint folder, converted GGUF's folder or embedded
  model's warm-up folder in `model.cache_dir` the run loaded);
- the tokenizer as `transformers` saves it, chat template included; the embedded model's character
  tokenizer is written as an equivalent fast tokenizer (`CharTokenizer.to_hf`: the same ids, `<bos>`
  prepended as the run loop does; a character outside its vocabulary is dropped where the run
  loop refused it);
- `export.json`: the run, its base and quantization, and with `merge` the measured difference.

With a merge the adapter moves to `DIR/adapter/` and `DIR` holds a plain transformers checkpoint,
with the tokenizer and the EOS ids in `generation_config.json`:
`AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` load it alone.
- `merge=dequantized` (a run on a 4-bit base: NVFP4, MXFP4, NF4): the policy as trained, every 4-bit
  layer decoded to the weights it multiplies by (`quant.dense_weight`) with its adapter added
  (`models.merged_weight`), saved in the dtype the run computes in (`model.dtype`: bfloat16 on a
  GPU, float32 for the embedded model on the CPU), so it differs from the run's policy by the
  rounding of the adapter's sum alone.
- `merge=bf16`: the adapter merged into the unquantized base (in the run's `model.dtype`), saved in
  bfloat16. A run trained on a quantized base learned its adapter on that base, not on this one: the
  command says so in one line.
Either way it prints how far the merged model, loaded back from `DIR`, is from the run's policy (its
base as trained + the adapter) on the first `prompts` held-out prompts: how many greedy completions
of `tokens` tokens are identical, how often the argmax agrees and the mean KL(policy || merged) per
token, both along the policy's greedy completions.

The run's base is checked against the digest its `config.json` records, as for a resume: an adapter
is never exported for (or merged into) another base than its own; a merge also checks the run's
data (its held-out prompts are the ones measured on). No reward is computed, so the reward code may
have changed since.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from qerl_exp.cli import check_task
from qerl_exp.decoders.batch import Sequences
from qerl_exp.decoders.scoring import completion_logits
from qerl_exp.eval.__main__ import load_run, run_config
from qerl_exp.models import merged_weight
from qerl_exp.rl.metrics import kl_full
from qerl_exp.rl.rollout import completion_mask, encode_prompts, hf_generate
from qerl_exp.run import logs
from qerl_exp.run.console import (UsageError, fail, first_line, key_values, one_line_errors, require,
                                  tolerate_closed_pipes)
from qerl_exp.run.files import check_writable, os_error_line, temp_dir
from qerl_exp.run.record import BASE_KEY, DATA_KEY, run_holding
from qerl_exp.run.signals import StopSignals

MERGES = ("none", "bf16", "dequantized")


@dataclass
class ExportCommand:
    """`python -m qerl_exp.export run_dir=RUN out=DIR [key=value ...]`.

    Args:
        run_dir: the finished run's directory (holds `config.json`, `summary.json`, `final/adapter`).
        out: the folder to create; it must not exist.
        merge: `none` (the adapter and the tokenizer), `dequantized` (also the policy as trained: a
            4-bit base decoded, the adapter merged into it, in the run's compute dtype, loadable by
            transformers alone) or `bf16` (the adapter merged into the unquantized base, in bfloat16).
        prompts: held-out prompts on which merge compares the merged model with the run's policy.
        tokens: greedy tokens a prompt in that comparison.
        device: `auto` (CUDA when present), `cpu` or `cuda`.
        verbose: show the third-party notices hidden by default (`qerl_exp.run.logs`).
    """

    run_dir: str = ""
    out: str = ""
    merge: str = "none"
    prompts: int = 8
    tokens: int = 64
    device: str = "auto"
    verbose: bool = False

    def __post_init__(self) -> None:
        require(bool(self.run_dir), "run_dir=<a finished run's directory> is required")
        require(bool(self.out), "out=<a new folder> is required")
        require(self.merge in MERGES, f"merge={self.merge!r} is not valid; choose one of: {', '.join(MERGES)}")
        require(self.prompts >= 1 and self.tokens >= 1, "prompts and tokens must be >= 1")
        require(self.device in ("auto", "cpu", "cuda"), f"device={self.device!r} is not valid; choose one of: auto, cpu, cuda")


def parse_args(argv: list[str]) -> ExportCommand:
    """`key=value` arguments into an `ExportCommand`; raises `UsageError` naming the bad one."""
    return ExportCommand(**key_values(argv, {f.name: f.type for f in fields(ExportCommand)}))


def _checked(args: ExportCommand) -> tuple[str, ...]:
    """The digests of the run's record an export checks: its base's always, its data's when it
    merges (the measured prompts are its held-out ones); never its reward code's (nothing is scored)."""
    return (BASE_KEY, DATA_KEY) if args.merge != "none" else (BASE_KEY,)


def check(args: ExportCommand):
    """Refuse, before anything is built or written, a run that is not finished, whose base (or, for
    a merge, data) changed since it trained, or whose prompts plus `tokens` exceed its model's
    positions, and an `out` that exists, lies in a run directory or cannot be made.

    Returns:
        The run's config (`eval.__main__.run_config`).

    Raises:
        ValueError: one line saying what to change.
    """
    run_dir, out = Path(args.run_dir), Path(args.out)
    if not (run_dir / "config.json").is_file():
        raise ValueError(f"run_dir={args.run_dir} is not a run directory (no config.json)")
    if not (run_dir / "summary.json").is_file():
        raise ValueError(f"run_dir={args.run_dir} holds an unfinished run (no summary.json); finish it with "
                         f"python -m qerl_exp resume={args.run_dir}, then export it")
    if args.merge == "dequantized" and json.loads((run_dir / "config.json").read_text()).get("quant", {}).get("format") == "none":
        raise ValueError("merge=dequantized merges the adapter into a 4-bit base's decoded weights, and this run's base "
                         "is unquantized (quant.format=none); use merge=bf16")
    if out.exists():
        raise ValueError(f"out={args.out} exists; give a new folder (export never writes into an existing one)")
    held = run_holding(out)
    if held is not None:
        raise ValueError(f"out={args.out} lies in the run directory {held}; export writes its folder outside every run "
                         "(nothing in a run changes): choose another out=")
    if not out.absolute().parent.is_dir():
        raise ValueError(f"out={args.out}: {out.absolute().parent} is not a folder; create it or choose another out=")
    check_writable(out.absolute().parent)
    cfg = run_config(run_dir, _checked(args))
    if args.merge != "none":  # its greedy completions must fit the model's positions
        check_task(cfg, ("tokens", args.tokens), model_fixed=True)
    return cfg


def export(args: ExportCommand) -> dict:
    """Write the export folder `args.out` of the finished run `args.run_dir` (see the module docstring).

    Returns:
        What `export.json` records: the run, its base, and with merge the measured difference.

    Raises:
        ValueError: the run is not finished or `out` exists (`check`); the run cannot be rebuilt
            (`eval.__main__.run_config`).
    """
    cfg = check(args)
    run_dir, out = Path(args.run_dir), Path(args.out).absolute()
    tmp = temp_dir(out.parent, prefix=f".{out.name}.partial-")
    try:  # written aside, then renamed: a failed or interrupted export leaves nothing under out
        _, task, models = load_run(run_dir, device=args.device, checked=_checked(args))
        tok = models.tokenizer
        adapter = tmp / "adapter" if args.merge != "none" else tmp
        adapter.mkdir(exist_ok=True)
        for file in (run_dir / "final" / "adapter").iterdir():  # the files alone: the folders keep the umask's mode
            shutil.copyfile(file, adapter / file.name)
        _portable(adapter / "adapter_config.json")
        tok.save_pretrained(tmp)
        record = {"run_dir": str(run_dir), "base": models.base_info, "model": cfg.model.name,
                  "quant": cfg.quant.format, "merge": args.merge, "args": asdict(args)}
        if args.merge != "none":
            prompts = [tok.render_prompt(p.prompt, cfg.task.system_prompt) for p in task.eval_problems()[: args.prompts]]
            trained, logits = _policy_side(models.policy, tok, prompts, args.tokens)
            merged = _dequantized(models.policy) if args.merge == "dequantized" else None
            del models  # a bf16 merge builds its model next: one model in memory at a time
            gc.collect()
            record["difference"] = _merge(args, tmp, tok, trained, logits, merged)
        (tmp / "export.json").write_text(json.dumps(record, indent=2))
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return record


def _policy_side(policy, tok, prompts: list[str], tokens: int) -> tuple[Sequences, torch.Tensor]:
    """The run's policy's greedy completions of `prompts`, and its logits `[N, T, V]` (CPU) along them."""
    device = next(policy.parameters()).device
    ids, mask = encode_prompts(prompts, tok, device)
    trained = _greedy(policy, ids, mask, tok, tokens)
    with torch.no_grad():
        return trained, completion_logits(policy, trained, 1.0).cpu()


def _portable(config: Path) -> None:
    """The exported adapter's `adapter_config.json` as it loads on any machine and in any folder: its
    base an absolute path (a folder the run named relative to where it ran) or a hub id, and peft's
    `task_type` for a causal LM (`AutoPeftModelForCausalLM` reads it)."""
    data = json.loads(config.read_text())
    base = data.get("base_model_name_or_path")
    if base and Path(base).expanduser().is_dir():
        data["base_model_name_or_path"] = str(Path(base).expanduser().resolve())
    data["task_type"] = "CAUSAL_LM"
    config.write_text(json.dumps(data, indent=2))


@torch.no_grad()
def _dequantized(policy) -> torch.nn.Module:
    """The run's policy as a plain transformers model, in place: every layer that carries an adapter
    or a 4-bit base becomes an `nn.Linear` of the weight it computes with (`merged_weight`: the
    decoded base plus the adapter), in fp32.

    Raises:
        ValueError: an adapter on a layer that is not linear (an embedding on HF's forward path).
    """
    from peft.tuners.lora import LoraLayer

    lm = policy.get_base_model()
    for parent in list(lm.modules()):
        for name, child in list(parent.named_children()):
            four_bit = isinstance(child, torch.nn.Linear) and type(child) is not torch.nn.Linear  # a format's layer
            if not isinstance(child, LoraLayer) and not four_bit:
                continue
            base = child.get_base_layer() if isinstance(child, LoraLayer) else child
            if not isinstance(base, torch.nn.Linear):
                raise ValueError(f"merge=dequantized merges linear layers, and {name} is a {type(base).__name__}; "
                                 "use merge=none (the adapter) or merge=bf16")
            weight = merged_weight(child)
            dense = torch.nn.utils.skip_init(torch.nn.Linear, weight.shape[1], weight.shape[0],
                                             bias=base.bias is not None, device=weight.device, dtype=torch.float32)
            dense.weight.copy_(weight)
            if base.bias is not None:
                dense.bias.copy_(base.bias)
            setattr(parent, name, dense)
    return lm


def _merge(args: ExportCommand, tmp: Path, tok, trained: Sequences, trained_logits: torch.Tensor,
           merged: torch.nn.Module | None = None) -> dict[str, float]:
    """Save the merged model in bf16 into `tmp` (`merged`, the dequantized policy; None: the adapter
    merged into the unquantized base), load it back as a user would, and measure it against the run's
    policy's greedy completions `trained` and logits."""
    from transformers import AutoModelForCausalLM

    if merged is None:
        _, _, dense = load_run(args.run_dir, device=args.device, quantized=False, checked=_checked(args))
        merged, dtype = dense.policy.merge_and_unload(), torch.bfloat16
        del dense
    else:
        dtype = merged.get_input_embeddings().weight.dtype  # the run's compute dtype
    device = next(merged.parameters()).device
    merged = merged.to(dtype)
    merged.generation_config.eos_token_id = list(tok.eos_ids)
    merged.generation_config.pad_token_id = tok.pad_id
    merged.save_pretrained(tmp)
    del merged
    gc.collect()
    loaded = AutoModelForCausalLM.from_pretrained(tmp).to(device).eval()
    ours = _greedy(loaded, trained.prompt_ids, trained.prompt_mask, tok, args.tokens)
    with torch.no_grad():
        logits = completion_logits(loaded, trained, 1.0).float().cpu()
    on = trained.completion_mask.bool().cpu()
    same = [torch.equal(a[m.bool()], b[n.bool()]) for a, m, b, n in
            zip(trained.completion_ids.cpu(), trained.completion_mask.cpu(), ours.completion_ids.cpu(), ours.completion_mask.cpu())]
    return {"prompts": len(same), "greedy_identical": sum(same), "tokens": int(on.sum()),
            "argmax_agreement": float((logits.argmax(-1) == trained.completion_ids.cpu())[on].float().mean()),
            "mean_kl": float(kl_full(trained_logits, logits).clamp(min=0)[on].mean())}  # KL >= 0: below is rounding


def _greedy(model, ids: torch.Tensor, mask: torch.Tensor, tok, tokens: int) -> Sequences:
    """`model`'s greedy completions of the prompts, up to and including the first EOS."""
    with torch.no_grad():
        out = hf_generate(model, ids, mask, max_new_tokens=tokens, eos_id=tok.eos_ids, pad_id=tok.pad_id,
                          temperature=0.0, top_p=1.0).sequences[:, ids.shape[1]:]
    cmask, _ = completion_mask(out, tok.eos_ids)
    return Sequences(ids, mask, torch.where(cmask.bool(), out, tok.pad_id), cmask)


def report(record: dict) -> list[str]:
    """The lines the command prints: the quantized-base warning, the measured difference, where."""
    lines = []
    diff = record.get("difference")
    if diff is not None:
        if record["quant"] != "none" and record["merge"] == "bf16":
            lines.append(f"warning: the run trained its adapter on a {record['quant']} base; the merged model adds it to "
                         "the unquantized base, which is not the model it learned on (merge=dequantized merges it into "
                         "the decoded 4-bit weights it learned on)")
        lines.append(f"merged vs the run's policy on {diff['prompts']} held-out prompts: greedy completions identical "
                     f"on {diff['greedy_identical']}/{diff['prompts']}, argmax agrees on {diff['argmax_agreement']:.1%} of "
                     f"{diff['tokens']} tokens, mean KL {diff['mean_kl']:.3g} nats/token")
    lines.append(f"written: {record['args']['out']}")
    return lines


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m qerl_exp.export`."""
    tolerate_closed_pipes()
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(f"usage: python -m qerl_exp.export run_dir=RUN out=DIR [key=value ...]\n\n{ExportCommand.__doc__}")
        return
    stop = StopSignals(take_all=True)  # SIGTERM too ends it as Ctrl-C does, its partial folder removed
    try:
        args = parse_args(argv)
        with stop.interruptible():
            check(args)
    except (UsageError, ValueError) as e:
        fail(str(e))
    except OSError as e:
        fail(os_error_line(e, "out") or f"{type(e).__name__}: {first_line(e)}")
    except KeyboardInterrupt as e:
        fail("interrupted; nothing was written", code=getattr(e, "exit_code", 130))
    with one_line_errors("out", "interrupted; nothing was written"):
        with logs.quiet(args.verbose), stop.interruptible():
            record = export(args)
    print("\n".join(report(record)))


if __name__ == "__main__":
    main()
