"""Shared test helpers: tests never reach W&B servers, and runs are kept tiny."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from glob import glob
from pathlib import Path

import pytest

from qerl_exp.config import DECODER_LINEARS
from qerl_exp.config.architectures import ARCHITECTURES
from qerl_exp.rl.metrics import MACHINE_METRICS

os.environ["WANDB_MODE"] = "disabled"
ROOT = Path(__file__).resolve().parent.parent

# A run small enough for CI: 2 prompts x 4 completions per step, tracker off.
TINY_RUN = ["tracker.mode=disabled", "train.prompts_per_step=2", "algo.group_size=4"]
# Every subprocess a test starts runs with these settings. One thread: OpenMP threads of concurrent
# runs spin against each other on 2 cores, and float sums over 1 and 2 threads differ in the last
# bits on some CPUs, so runs compared bit for bit must use the same count.
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# A suite started in the background of a non-interactive shell inherits SIGINT ignored, and so would
# every run it starts (a Ctrl-C test would then see its run finish): give its processes the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if os.environ.get("PYTEST_XDIST_WORKER"):  # parallel workers: one thread each, as the subprocesses
    import torch

    torch.set_num_threads(1)


def on_ci() -> bool:
    """CI=true: a test whose prerequisite is missing fails there instead of skipping."""
    return os.environ.get("CI", "").lower() in ("true", "1")


def import_or_skip(name: str):
    """`pytest.importorskip(name)`, except under CI, where a missing optional package fails the test
    (the dev extra promises it)."""
    if on_ci():
        try:
            return importlib.import_module(name)
        except ImportError as e:
            pytest.fail(f"{name} cannot be imported under CI=true ({e}); install the dev extra: pip install -e .[dev]")
    return pytest.importorskip(name)


def qerl(*args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m qerl_exp ARGS` from the repository root and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "qerl_exp", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
        env={**SUBPROCESS_ENV, **(env or {})},
    )


# Metrics that differ between two processes running the same steps: wall times and memory peaks.
VOLATILE = MACHINE_METRICS


def metrics_rows(run_dir: Path) -> list[dict]:
    """The run's `metrics.jsonl`, one dict a step."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def stable(rows: list[dict]) -> list[dict]:
    """The rows without the `VOLATILE` metrics: what an interrupted and resumed run must reproduce."""
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def kill_after(args: list[str], run_dir: Path, logged_steps: int) -> None:
    """Start `python -m qerl_exp ARGS run_dir=RUN_DIR`, SIGKILL it once `logged_steps` steps are in
    its metrics.jsonl, and check that it had not finished."""
    proc = subprocess.Popen([sys.executable, "-m", "qerl_exp", *args, f"run_dir={run_dir}"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=SUBPROCESS_ENV)
    wait_for_steps(proc, run_dir, logged_steps)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert not (run_dir / "summary.json").exists(), "the run finished before it could be killed"


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, logged_steps: int) -> None:
    """Return once the run `proc` has logged `logged_steps` steps; fail if it ends or stalls first."""
    deadline = time.time() + 300
    metrics = run_dir / "metrics.jsonl"
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= logged_steps:
            return
        time.sleep(0.02)
    raise AssertionError(f"the run ended or stalled before step {logged_steps}: {proc.communicate()[1][-2000:]}")


def tiny_qwen2(seed: int = 0, *, vocab: int = 96, hidden: int = 128, inter: int = 256, layers: int = 2, heads: int = 4,
               kv: int = 2, max_positions: int = 64):
    """A Qwen2 causal LM at HF's random initialisation after `torch.manual_seed(seed)`: float32, CPU,
    eval mode, untied head; widths multiples of 64 as bitsandbytes' packing wants."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=max_positions,
                      tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).eval()


def tiny_decoder(family: str, seed: int = 0, *, vocab: int = 96, hidden: int = 128, inter: int = 256, layers: int = 2,
                 heads: int = 4, kv: int = 2, head_dim: int | None = None, max_positions: int = 256, **extra):
    """A causal LM of a declared `family`, built from its registered config class at HF's random
    initialisation after `torch.manual_seed(seed)`, with every norm scale (Qwen3's q/k norms included)
    drawn from U(0.5, 1.5): float32, CPU, eval mode, untied head. `extra`: more config fields."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    config = getattr(transformers, ARCHITECTURES[family].config_class)(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=head_dim or hidden // heads, max_position_embeddings=max_positions,
        tie_word_embeddings=False, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.eval()


def with_lora(model, seed: int | None = 1, random_b: bool = True, targets: list[str] | None = None,
              rank_pattern: dict | None = None):
    """`model` wrapped by peft with LoRA r=8, alpha 16 on the seven decoder projections (or `targets`;
    `rank_pattern`: peft's other ranks by module name). `random_b`: B is random as well as A (peft's
    init_lora_weights=False), so both get a gradient and the adapter changes the output; `seed`:
    torch's seed for that initialisation (None: the stream as it is)."""
    import torch
    from peft import LoraConfig, get_peft_model

    if seed is not None:
        torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=list(targets or DECODER_LINEARS),
                                            rank_pattern=rank_pattern or {}, init_lora_weights=not random_b))


def tiny_models(*overrides: str):
    """`(cfg, task, models)`: the run config of `overrides` (Hydra syntax), its task, and its models
    built on the CPU by `models.build_models`, as a run would."""
    import torch

    from qerl_exp.config.compose import compose
    from qerl_exp.models import build_models
    from qerl_exp.tasks import build_task

    cfg = compose(list(overrides))[0]
    task = build_task(cfg.task)
    return cfg, task, build_models(cfg, task, torch.device("cpu"))


def run_in_process(run_dir: Path, *overrides: str, on_step=None, keep: dict | None = None) -> list[dict]:
    """Run `train.run` in this process with the config of `overrides` (Hydra syntax) and return its
    metrics rows; `keep["models"]` receives the run's models (for checks inside `on_step`)."""
    from qerl_exp import train
    from qerl_exp.config.compose import compose

    cfg, choices = compose(list(overrides))
    with pytest.MonkeyPatch.context() as mp:
        if keep is not None:
            def build_and_keep(*args, **kwargs):  # the real builder; the test only holds on to its result
                keep["models"] = real(*args, **kwargs)
                return keep["models"]

            real = train.build_models
            mp.setattr(train, "build_models", build_and_keep)
        train.run(cfg, run_dir, choices=choices, on_step=on_step)
    return metrics_rows(run_dir)


@pytest.fixture(scope="session")
def tiny_policy():
    """The embedded model (warmed up once, cached) as a bf16-config policy with LoRA, on CPU."""
    return tiny_models("monitor.every=1")


def char_tokenizer():
    """A `transformers` fast tokenizer built here (nothing downloaded): one token per printable
    character, ChatML-style special tokens and chat template, EOS `<|im_end|>`."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + list(dict.fromkeys(string.printable)))}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


def save_checkpoint(folder: Path, family: str = "qwen2", seed: int = 0, head_scale: float = 1.0) -> Path:
    """A small random checkpoint of a declared `family` (`tiny_decoder`), or of `gpt2` (undeclared),
    saved with `save_pretrained`, with `char_tokenizer()` beside it. `head_scale` multiplies the LM
    head: HF's initialisation gives nearly uniform next-token distributions (about log V nats a
    token), 30 makes them as peaked as a trained model's (about 1 nat)."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    tok = char_tokenizer()
    ids = dict(bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if family == "gpt2":
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=len(tok), n_embd=128, n_layer=2, n_head=4,
                                                            n_positions=512, **ids))
    else:
        model = tiny_decoder(family, seed, vocab=len(tok), max_positions=512, **ids)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(head_scale)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def tiny_checkpoint(folder: Path, seed: int = 0) -> Path:
    """A local Hugging Face checkpoint folder (`save_pretrained`): `tiny_qwen2(seed)` and a character
    tokenizer over the embedded model's characters, with an EOS token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from qerl_exp.models.tokenizers import CHARS

    vocab = {c: i for i, c in enumerate(["<eos>", *dict.fromkeys(CHARS)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    tiny_qwen2(seed, vocab=len(vocab) + 32, max_positions=512).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def patch_interpreter() -> None:
    """Let Triton's interpreter index with 1-element arrays (numpy >= 2.4 refuses their int()), and
    patch `triton.language` once a kernel launch instead of again at every device-function call of
    every program (the launch's patch already covers a function that sees no language module the
    kernel does not; patching again took up to a third of the interpreter's time)."""
    import inspect

    import triton.language as tl
    import triton.runtime.interpreter as ti

    orig_tensor, orig_lang = ti._patch_lang_tensor, ti._patch_lang
    live: list[set] = []  # the language modules the running launch patched
    seen: dict = {}  # a function's language modules

    def patched_tensor(tensor, scope):
        orig_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def patched_lang(fn):
        if fn not in seen:
            seen[fn] = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        langs = seen[fn]
        if live and langs <= live[-1]:
            return ti._LangPatchScope()  # a device function inside a launch: nothing left to patch
        scope = orig_lang(fn)
        if live:  # a device function seeing another language module: patched now (and never restored)
            live[-1] |= langs
        else:  # a launch (kernels launch no kernels): its scope is restored when it ends
            live.append(set(langs))
            restore = scope.restore
            scope.restore = lambda: (live.pop(), restore())
        return scope

    ti._patch_lang_tensor, ti._patch_lang = patched_tensor, patched_lang


def run_interpreted(script: str, marker: str, timeout: int, *args: str) -> None:
    """Run the test file `script` as `python script --interp ARGS` with TRITON_INTERPRET=1 (it must
    be set before triton is first imported) and check that it printed `marker`."""
    import torch

    import_or_skip("triton")
    if torch.cuda.is_available():
        pytest.skip("the GPU tests run the kernels natively")
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))  # conftest's helpers
    env = {**SUBPROCESS_ENV, "TRITON_INTERPRET": "1", "PYTHONPATH": path}  # one thread, as every subprocess
    proc = subprocess.run([sys.executable, script, "--interp", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)
    assert marker in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="session")
def postgres():
    """`(url, None)` for a reachable PostgreSQL server, or `(None, reason)`: `QERL_TEST_PG_URL` when
    set (`.ci/run` sources `.ci/postgres.sh`, which starts one); otherwise, where Debian's PostgreSQL
    is installed, a throwaway one started with the same script."""
    url, started = os.environ.get("QERL_TEST_PG_URL"), None
    if not url and glob("/usr/lib/postgresql/*/bin/pg_ctl"):
        out = subprocess.run(["bash", str(ROOT / ".ci" / "postgres.sh"), "start", "--no-install"],
                             capture_output=True, text=True, timeout=180)
        env = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
        url, started = env.get("QERL_TEST_PG_URL"), env.get("QERL_TEST_PG_DIR")
        if not url:
            yield None, f"could not start PostgreSQL with .ci/postgres.sh: {out.stderr.strip()[-500:]}"
            return
    if not url:
        yield None, "no PostgreSQL server: source .ci/postgres.sh (sets QERL_TEST_PG_URL) or apt-get install postgresql"
        return
    try:
        import psycopg

        psycopg.connect(url, connect_timeout=10).close()
    except Exception as e:  # noqa: BLE001
        yield None, f"PostgreSQL at {url} is unreachable: {str(e).splitlines()[0]}"
    else:
        yield url, None
    finally:
        if started:
            subprocess.run(["bash", str(ROOT / ".ci" / "postgres.sh"), "stop", started], timeout=120)


def require_server(postgres) -> str:
    """The `postgres` fixture's URL; without a server the test fails under CI and is skipped elsewhere."""
    url, reason = postgres
    if url is None:
        if on_ci():
            pytest.fail(reason)  # CI promised a server: its absence is a failure, not a skip
        pytest.skip(reason)
    return url
