"""`python -m qerl_exp.export run_dir=RUN out=DIR [merge=bf16]`: a finished run's policy to take away.

Writes a new folder `DIR` (an existing one is refused; nothing in `RUN` changes):
- the trained LoRA adapter in peft format (`adapter_config.json`, `adapter_model.safetensors`, as the
  run saved it: its `base_model_name_or_path` names the base as the run loaded it, a checkpoint
  folder or hub id, a converted GGUF's folder, or the embedded model's warm-up folder in
  `model.cache_dir`);
- the tokenizer as `transformers` saves it, chat template included; the embedded model's character
  tokenizer is written as an equivalent fast tokenizer (`CharTokenizer.to_hf`: the same ids, `<bos>`
  prepended as the run loop does; a character outside its vocabulary is dropped where the run
  loop refused it);
- `export.json`: the run, its base and quantization, and with `merge` the measured difference.

With `merge=bf16` the adapter moves to `DIR/adapter/` and `DIR` holds the unquantized base (in the
run's `model.dtype`) with the adapter merged into it, saved in bfloat16, with the tokenizer and the
EOS ids in `generation_config.json`: `AutoModelForCausalLM.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)` load it alone. A run trained on a quantized base (NVFP4, NF4,
MXFP4) learned its adapter on that base, not on the unquantized one it is merged into: the command
says so in one line, and in every case it prints how far the merged model, loaded back from `DIR`,
is from the run's policy (its base as trained + the adapter) on the first `prompts` held-out
prompts: how many greedy completions of `tokens` tokens are identical, how often the argmax agrees
and the mean KL(policy || merged) per token, both along the policy's greedy completions.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from qerl_exp import logs
from qerl_exp.console import UsageError, fail, first_line, key_values, one_line_errors, require, tolerate_closed_pipes
from qerl_exp.eval.__main__ import load_run, run_config
from qerl_exp.loss import completion_logits
from qerl_exp.metrics import kl_full
from qerl_exp.batch import Sequences
from qerl_exp.rollout import completion_mask, encode_prompts, hf_generate
from qerl_exp.files import check_writable, os_error_line

MERGES = ("none", "bf16")


@dataclass
class ExportCommand:
    """`python -m qerl_exp.export run_dir=RUN out=DIR [key=value ...]`.

    Args:
        run_dir: the finished run's directory (holds `config.json`, `summary.json`, `final/adapter`).
        out: the folder to create; it must not exist.
        merge: `none` (the adapter and the tokenizer) or `bf16` (also the base with the adapter
            merged, in bfloat16, loadable by transformers alone).
        prompts: held-out prompts on which merge compares the merged model with the run's policy.
        tokens: greedy tokens a prompt in that comparison.
        device: `auto` (CUDA when present), `cpu` or `cuda`.
        verbose: show the third-party notices hidden by default (`qerl_exp.logs`).
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


def check(args: ExportCommand) -> None:
    """Refuse, before anything is built or written, a run that is not finished and an `out` that
    exists or cannot be made.

    Raises:
        ValueError: one line saying what to change.
    """
    run_dir, out = Path(args.run_dir), Path(args.out)
    if not (run_dir / "config.json").is_file():
        raise ValueError(f"run_dir={args.run_dir} is not a run directory (no config.json)")
    if not (run_dir / "summary.json").is_file():
        raise ValueError(f"run_dir={args.run_dir} holds an unfinished run (no summary.json); finish it with "
                         f"python -m qerl_exp resume={args.run_dir}, then export it")
    if out.exists():
        raise ValueError(f"out={args.out} exists; give a new folder (export never writes into an existing one)")
    if not out.absolute().parent.is_dir():
        raise ValueError(f"out={args.out}: {out.absolute().parent} is not a folder; create it or choose another out=")
    check_writable(out.absolute().parent)


def export(args: ExportCommand) -> dict:
    """Write the export folder `args.out` of the finished run `args.run_dir` (see the module docstring).

    Returns:
        What `export.json` records: the run, its base, and with merge the measured difference.

    Raises:
        ValueError: the run is not finished or `out` exists (`check`); the run cannot be rebuilt
            (`eval.__main__.run_config`).
    """
    check(args)
    run_dir, out = Path(args.run_dir), Path(args.out).absolute()
    cfg = run_config(run_dir)  # its data files unchanged: the held-out prompts are the run's
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    try:  # written aside, then renamed: a failed export leaves nothing under out
        _, task, models = load_run(run_dir, device=args.device)
        tok = models.tokenizer
        adapter = tmp / "adapter" if args.merge != "none" else tmp
        shutil.copytree(run_dir / "final" / "adapter", adapter, dirs_exist_ok=True)
        tok.save_pretrained(tmp)
        record = {"run_dir": str(run_dir), "base": models.base_info, "model": cfg.model.name,
                  "quant": cfg.quant.format, "merge": args.merge, "args": asdict(args)}
        if args.merge != "none":
            prompts = [tok.render_prompt(p.prompt, cfg.task.system_prompt) for p in task.eval_problems()[: args.prompts]]
            trained, logits = _policy_side(models.policy, tok, prompts, args.tokens)
            del models  # the merged model is built next: one model in memory at a time
            gc.collect()
            record["difference"] = _merge(args, tmp, tok, trained, logits)
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


def _merge(args: ExportCommand, tmp: Path, tok, trained: Sequences, trained_logits: torch.Tensor) -> dict[str, float]:
    """Merge the adapter into the unquantized base, save it in bf16 into `tmp`, load it back as a user
    would, and measure it against the run's policy's greedy completions `trained` and logits."""
    from transformers import AutoModelForCausalLM

    _, _, dense = load_run(args.run_dir, device=args.device, quantized=False)
    device = next(dense.policy.parameters()).device
    merged = dense.policy.merge_and_unload().to(torch.bfloat16)
    merged.generation_config.eos_token_id = list(tok.eos_ids)
    merged.generation_config.pad_token_id = tok.pad_id
    merged.save_pretrained(tmp)
    del dense, merged
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
        if record["quant"] != "none":
            lines.append(f"warning: the run trained its adapter on a {record['quant']} base; the merged model adds it to "
                         "the unquantized base, which is not the model it learned on")
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
    try:
        args = parse_args(argv)
        check(args)
    except (UsageError, ValueError) as e:
        fail(str(e))
    except OSError as e:
        fail(os_error_line(e, "out") or f"{type(e).__name__}: {first_line(e)}")
    with one_line_errors("out", "interrupted; nothing was written"):
        with logs.quiet(args.verbose):
            record = export(args)
    print("\n".join(report(record)))


if __name__ == "__main__":
    main()
