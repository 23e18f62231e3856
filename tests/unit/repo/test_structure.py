"""The code's shape: no import cycle between the modules of qerl_exp/ and analysis/ (function-level
imports counted), qerl_exp/'s folders in floors that import only downwards and at most 10 modules
beside them, the learner side and the weight formats apart from the engine and the tasks, one
concept a module (named in its docstring; its code, documentation aside, within 500 lines), no
function over 80 lines outside GPU kernels, an RL step on one screen, a design document of the
engine that stays short, and a repository that speaks of its software, not of how it was
developed."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

PACKAGES = ("qerl_exp", "analysis")
MAX_CODE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_STEP_LINES = 40
MAX_ENGINE_DOC_LINES = 500
# what a user reads: the product, its output, docs, the results pages, benches, presets, sweeps and tests
PRODUCT = ("README.md", "docs", "results/README.md", "results/results.md", "results/protocols", "qerl_exp", "analysis",
           "bench", "conf", "sweeps", "tests")
# development history in the product's own words; upstream references (pytorch/pytorch#196678),
# pytest's scope="session" and POSIX sessions do not match
HISTORY = {
    "a work session": re.compile(r"\bsessions? \d|\(sessions?$|\b(this|that|each|every|next|last|later|earlier|"
                                 r"previous|work) sessions?\b", re.IGNORECASE),
    "an issue number": re.compile(r"\bissues? #?\d|(?<![\w/.-])#\d+\b", re.IGNORECASE),
    "notes the repository does not hold": re.compile(r"\b(DESIGN|STYLE)\.md\b"),
}

def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of PACKAGES (a package by its __init__.py)."""
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _imported(node: ast.Import | ast.ImportFrom, name: str, is_pkg: bool, mods: dict) -> list[str]:
    """The modules of `mods` that one import statement in module `name` executes."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the importer's package, one level up per extra dot
            pkg = name.split(".") if is_pkg else name.split(".")[:-1]
            pkg = pkg[: len(pkg) - node.level + 1]
            base = ".".join(pkg + ([base] if base else []))
        targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base for alias in node.names]
    found = set()
    for target in targets:
        parts = target.split(".")
        # the module itself and the packages above it (their __init__ runs first), except the
        # importer's own packages, which are being imported already
        for i in range(1, len(parts) + 1):
            mod = ".".join(parts[:i])
            if mod in mods and mod != name and not name.startswith(mod + "."):
                found.add(mod)
    return sorted(found)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports, at any depth of its code (function-level imports too)."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = {t for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                       for t in _imported(node, name, path.name == "__init__.py", mods)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_sees_function_level_relative_and_package_imports():
    # the finder itself: a function-level relative import closes a cycle; importing p.a from outside p
    # runs p/__init__.py first, from inside it does not
    src = {"p": "", "p.a": "from p import b\n", "p.b": "def f():\n    from .c import g\n", "p.c": "import p.a\n",
           "q": "from p.a import x\n"}
    graph = {n: {t for node in ast.walk(ast.parse(code)) if isinstance(node, (ast.Import, ast.ImportFrom))
                 for t in _imported(node, n, n == "p", src)} for n, code in src.items()}
    assert graph == {"p": set(), "p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "q": {"p", "p.a"}}
    assert cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_no_import_cycles():
    assert cycles(import_graph()) == [], "import cycles (function-level imports count; break them, do not hide them)"


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_the_learner_side_and_the_formats_import_neither_the_engine_nor_the_tasks():
    # the learner reads rollout batches (`qerl_exp.decoders.batch`), not the sampler that made them; a weight
    # format owns its layouts, which the engine reads; metrics name eval splits (`tasks.base`) only
    graph = import_graph()
    tasks = {m for m in graph if m.startswith("qerl_exp.tasks.")} - {"qerl_exp.tasks.base"}
    for mod in ("qerl_exp.rl.loss", "qerl_exp.rl.learner", "qerl_exp.decoders.padding_free", "qerl_exp.rl.metrics", "qerl_exp.decoders.blocks",
                "qerl_exp.quant", "qerl_exp.quant.fp4", "qerl_exp.quant.nf4", "qerl_exp.quant.layout"):
        reached = _reaches(graph, mod)
        assert not {m for m in reached if m.startswith("qerl_exp.engine")}, f"{mod} reaches the engine"
        assert not reached & tasks, f"{mod} reaches the task modules: {sorted(reached & tasks)}"
    out = subprocess.run([sys.executable, "-c", "import sys, qerl_exp.rl.loss, qerl_exp.rl.learner\n"
                          "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'hydra') "
                          "or m.startswith('qerl_exp.engine')))"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# the package's folders, bottom to top: a module imports its own folder or a lower floor, never a
# higher one nor another folder of its own floor. A command (a module with a __main__ guard, a
# package's __main__.py) and the top-level modules (cli, train, export, probe, ...) are the top floor
# wherever they sit; the package's own __init__ (its version) is below every floor.
FLOORS = ("config", "run", ("quant", "tasks"), "decoders", "engine", "models", "rl", "eval")
MAX_TOP_LEVEL_MODULES = 10
# the arrows that go up today, (importer, the folder or command it imports) -> why
UP_ARROWS = {
    # build_models warms the embedded base up on first use; the warm-up is a command (python -m
    # qerl_exp.models.warmup) that trains and evaluates it with rl/: calling the warm-up from above
    # build_models (train, probe, eval, the tests' fixtures) would remove this arrow
    ("qerl_exp.models", "qerl_exp.models.warmup"): "build_models warms the embedded base up",
    # the digests of a run's files are computed by the modules that read those files: the base's by
    # models/, the data's and the reward code's by tasks/; only the commands import run_files
    ("qerl_exp.run.run_files", "models"): "the base's digest is models.pretrained's",
    ("qerl_exp.run.run_files", "tasks"): "the data's and the reward files' digests are the task's",
}


def _floor(module: str, path: Path) -> int:
    """A module's floor: its folder's index in FLOORS; the top floor for a command and the top-level
    modules; -1 for the package's own __init__."""
    parts = module.split(".")
    if len(parts) == 1:
        return -1
    if path.name == "__main__.py" or re.search(r'^if __name__ == "__main__":', path.read_text(), re.MULTILINE):
        return len(FLOORS)
    return next((i for i, f in enumerate(FLOORS) if parts[1] in ((f,) if isinstance(f, str) else f)), len(FLOORS))


def arrows_up(graph: dict[str, set[str]], mods: dict[str, Path]) -> list[tuple[str, str]]:
    """(importer, what it imports: a folder, or a command by its module name) for every import of a
    qerl_exp module that reaches a higher floor or another folder of its own floor."""
    top, found = len(FLOORS), set()
    for name, deps in graph.items():
        if not name.startswith("qerl_exp."):
            continue
        floor = _floor(name, mods[name])
        for dep in deps:
            if not dep.startswith("qerl_exp.") or floor == top:
                continue
            up = _floor(dep, mods[dep])
            same_folder = name.split(".")[1] == dep.split(".")[1]
            if up == top:
                found.add((name, dep))
            elif up > floor or (up == floor and not same_folder):
                found.add((name, dep.split(".")[1]))
    return sorted(found)


def test_the_floor_check_sees_an_arrow_up_and_a_command_below():
    # the checker itself, on a made-up graph: a decoder reading the learner goes up; a model reading
    # a command of its own folder goes up; a command reads anything
    mods = _modules()
    graph = {"qerl_exp.decoders.blocks": {"qerl_exp.rl.learner", "qerl_exp.config"},
             "qerl_exp.models": {"qerl_exp.models.warmup", "qerl_exp.models.synthetic"},
             "qerl_exp.models.warmup": {"qerl_exp.eval"}, "qerl_exp.train": {"qerl_exp.eval"}}
    assert arrows_up(graph, mods) == [("qerl_exp.decoders.blocks", "rl"), ("qerl_exp.models", "qerl_exp.models.warmup")]


def test_no_folder_imports_a_higher_one():
    found = arrows_up(import_graph(), _modules())
    assert [a for a in found if a not in UP_ARROWS] == [], \
        f"these imports go up a floor ({FLOORS}, then the commands): move the code down, or the caller up"
    assert [a for a in UP_ARROWS if a not in found] == [], "these arrows are gone: take them off UP_ARROWS"


def test_qerl_exp_holds_at_most_10_top_level_modules():
    top = sorted(p.name for p in (ROOT / "qerl_exp").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"put these in the folder of their concept: {top}"


def test_every_weight_format_of_the_schema_has_a_module_whose_layer_every_reader_reads():
    import importlib

    import torch

    from qerl_exp import quant
    from qerl_exp.config import QUANT_FORMATS

    # the formats are listed once, in the schema, beside the module that implements each
    for fmt, module in QUANT_FORMATS.items():
        if module is None:
            continue
        layer = importlib.import_module(module).Handler(fmt, torch.float32).quantize_linear(torch.nn.Linear(64, 32))
        assert quant.is_quantized(layer), f"{fmt}: {type(layer).__name__} is not a quant.QuantizedLinear"


def test_one_list_of_formats_and_one_of_families():
    # no module keeps its own list of weight formats or of decoder families: each derives from the
    # schema's QUANT_FORMATS or the registry's ARCHITECTURES
    own = re.compile(r"^(FORMATS|QUANT_FORMATS|FAMILIES)\s*=", re.MULTILINE)
    found = [str(p.relative_to(ROOT)) for pkg in (*PACKAGES, "bench", "tests") for p in sorted((ROOT / pkg).rglob("*.py"))
             if own.search(p.read_text()) and p != ROOT / "qerl_exp" / "config" / "__init__.py"]
    assert found == [], "derive these lists from config.QUANT_FORMATS / architectures.ARCHITECTURES"


def _code_lines(path: Path) -> int:
    """Lines of a module that hold code: blank lines, comments and docstrings are not counted, so that
    documenting a module never counts against it."""
    tree = ast.parse(path.read_text(), str(path))
    docs = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for i, line in enumerate(path.read_text().splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and i not in docs)


def test_every_module_says_its_concept_and_holds_one():
    # one concept a module, named in its docstring; a module whose code (documentation aside) runs
    # past MAX_CODE_LINES holds more than one concept and is split by concept
    mods = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    undocumented = [str(p.relative_to(ROOT)) for p in mods if ast.get_docstring(ast.parse(p.read_text())) is None
                    and p.read_text().strip()]
    assert undocumented == [], "say in a module docstring what concept each of these holds"
    long = {str(p.relative_to(ROOT)): n for p in mods if (n := _code_lines(p)) > MAX_CODE_LINES}
    assert long == {}, f"split these modules by concept (at most {MAX_CODE_LINES} lines of code each)"


def _functions(path: Path):
    """(qualified name, lines) of every function and method in a module, nested ones included."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{child.name}" if prefix else child.name
                if not isinstance(child, ast.ClassDef):
                    yield name, child.end_lineno - child.lineno + 1
            yield from walk(child, name)

    yield from walk(ast.parse(path.read_text(), str(path)), "")


def _kernels(path: Path) -> set[str]:
    """The names of a module's GPU kernels (`triton.jit`, `gluon.jit`): a kernel is one launch, read
    as a whole; its helpers are inlined by the compiler, not called."""
    return {n.name for n in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(n, ast.FunctionDef)
            and any("jit" in ast.unparse(d) for d in n.decorator_list)}


def test_no_function_in_qerl_exp_or_analysis_is_over_80_lines_outside_kernels():
    long = {f"{p.relative_to(ROOT)}:{name}": n for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
            for name, n in _functions(p) if n > MAX_FUNCTION_LINES and name.split(".")[-1] not in _kernels(p)}
    assert long == {}, f"split these functions into phases (at most {MAX_FUNCTION_LINES} lines each)"


def test_one_rl_step_reads_on_one_screen():
    # the step (rollout, then learning or a skip, checkpoints, the hook, a stop request) and the
    # learning after the rollout (rewards, reference, monitor, update, sync, evaluation, metrics)
    # call named phases
    lines = dict(_functions(ROOT / "qerl_exp" / "train.py"))
    assert {name: lines[name] for name in ("_step", "_learn") if lines[name] > MAX_STEP_LINES} == {}


def test_the_engine_design_document_stays_short():
    assert len((ROOT / "docs" / "engine.md").read_text().splitlines()) <= MAX_ENGINE_DOC_LINES


def _product_files() -> list[Path]:
    """The tracked text files of PRODUCT (every file below it outside a git checkout)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", *PRODUCT], cwd=ROOT, capture_output=True, check=True)
        paths = [ROOT / p for p in out.stdout.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for name in PRODUCT
                 for p in ([ROOT / name] if (ROOT / name).is_file() else (ROOT / name).rglob("*"))]
    return [p for p in paths if p.is_file() and b"\0" not in p.read_bytes()[:8192]]


def test_history_patterns_catch_our_phrasing_only():
    # history phrasings, written with placeholders so that this file states none itself
    said = [line.format(s="session", i="issue", c="Issue", d="DESIGN", y="STYLE") for line in (
        "docs/engine.md, {s} 27", "one GEMM ({s}", "({s}s 25-27)", "what this {s} measured",
        "{i} 25 of this repository", "{c} 21's next runs", "see #22", "{d}.md 2.4", "({y}.md)")]
    fine = ["pytorch/pytorch#196678", "pytorch#196678", '@pytest.fixture(scope="session")', "A session of their own",
            "start_new_session=True", "open an issue", "# 4 rows", "color #fff"]
    assert all(any(r.search(line) for r in HISTORY.values()) for line in said)
    assert not [line for line in fine if any(r.search(line) for r in HISTORY.values())]


def test_no_line_speaks_of_work_sessions_issue_numbers_or_notes_the_repository_lacks():
    found = []
    for path in _product_files():
        if path == Path(__file__).resolve():  # it states the patterns
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{i}: {what}: {line.strip()[:120]}"
                      for what, r in HISTORY.items() if r.search(line)]
    assert found == [], "say what the software does and cite docs/method.md; git log keeps the history:\n" + \
        "\n".join(found[:40])
