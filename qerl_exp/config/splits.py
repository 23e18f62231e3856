"""Evaluation splits, by the names their problems and metrics carry.

Every task holds problems out of training (`heldout`, phrased as training's are); a task whose
problems come from templates may also have an out-of-template split (`ood`). Tasks say which they
have (`tasks.base.Task.splits`); evaluation logs each under its own prefix (`metrics.eval_prefix`).
"""

HELD_OUT, OOD = "heldout", "ood"
SPLITS = (HELD_OUT, OOD)
