"""The code's shape (STYLE.md): no import cycle between the modules of qerl_exp/ and analysis/,
function-level imports counted, and no source file in qerl_exp/ over 700 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("qerl_exp", "analysis")
MAX_LINES = 700

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


def test_no_source_file_in_qerl_exp_is_over_700_lines():
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "qerl_exp").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these modules by concept (at most {MAX_LINES} lines each)"
