"""qerl-exp: an experiment harness for quantization-enhanced RL of language models (QeRL)."""

__version__ = "0.1.0"
