"""qerl-exp: an experiment harness for quantization-enhanced RL of language models (QeRL)."""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# `python -m qerl_exp...` puts the working directory first on sys.path (this package is imported
# while its command is being found, when argv[0] is "-m"), so a file there named like a library the
# harness imports (a data-prep `datasets.py`) would be run in its place: a command looks there last.
if _sys.argv[:1] == ["-m"] and _sys.path and _os.path.abspath(_sys.path[0] or _os.curdir) == _os.getcwd():
    _sys.path.append(_sys.path.pop(0))
