"""A checkpoint's `state.pt` holds tensors, numbers and dicts only: no object of a qerl_exp class, so
that moving a module never breaks the loading of a checkpoint an older version wrote."""

from __future__ import annotations

import pickletools
import zipfile
from pathlib import Path

from conftest import TINY_RUN, run_in_process


def _globals(state_pt: Path) -> set[str]:
    """The `module.name` of every global a torch checkpoint's pickle refers to."""
    with zipfile.ZipFile(state_pt) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
        elif op.name == "STACK_GLOBAL":
            found.add(".".join(strings[-2:]))
        elif isinstance(arg, str):
            strings.append(arg)
    return found


def test_a_checkpoint_pickles_no_qerl_exp_object(tmp_path):
    run_dir = tmp_path / "run"
    run_in_process(run_dir, *TINY_RUN, "train.steps=2", "checkpoint.every=1", f"run_dir={run_dir}")
    saved = sorted(run_dir.rglob("state.pt"))
    assert saved, "the run saved no checkpoint"
    found = {str(p.relative_to(run_dir)): sorted(g for g in _globals(p) if g.startswith("qerl_exp")) for p in saved}
    assert found == {str(p.relative_to(run_dir)): [] for p in saved}
