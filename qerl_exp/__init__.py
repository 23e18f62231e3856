"""qerl-exp: an experiment harness for quantization-enhanced RL of language models (QeRL).

The package by concept, bottom to top (a folder imports only its own modules and those below it):
`config/` what a run is; `run/` a run on disk and across processes; `quant/` the weight formats and
`tasks/` the problems and rewards; `decoders/` the model computed by hand, and scoring; `engine/`
the CUDA rollout engine; `models/` the base, quantized, with LoRA; `rl/` the algorithm; `eval/`
evaluation. On top, the commands: `python -m qerl_exp` (`__main__`, `cli`, `train`), `export`,
`probe`, `flat_config`, `sweep/`.
"""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# `python -m qerl_exp...` puts the working directory first on sys.path (this package is imported
# while its command is being found, when argv[0] is "-m"), so a file there named like a library the
# harness imports (a data-prep `datasets.py`) would be run in its place: a command looks there last.
if _sys.argv[:1] == ["-m"] and _sys.path and _os.path.abspath(_sys.path[0] or _os.curdir) == _os.getcwd():
    _sys.path.append(_sys.path.pop(0))
