"""Benchmarks and profilers, run from the repository root as modules (`python -m bench.step`).

Benchmarks measure the workload a user runs, each alternative beside its baseline in one process,
and print ratios; each writes its table also as JSON under `results/bench/` (`bench.record`):
- `bench.quant`: bytes and CPU forward time per weight format (CPU is enough);
- `bench.step`: the whole RL step per strategy at 7B-32B shapes (GPU);
- `bench.rollout`: rollout tokens/s, the engine against HF generate, per format (GPU);
- `bench.engine_kernels`: the engine's 4-bit linears against cuBLAS, decode attention (GPU);
- `bench.sustained`: each 7B launch held at the GPU's power limit (GPU);
- `bench.peer`: TRL's GRPOTrainer beside the harness (`pip install -e '.[peer]'`).

Profilers say where the time or memory of one piece goes (no baseline, nothing recorded):
`bench.profile.decode_step`, `bench.profile.learner`, `bench.profile.memory`.

Tools: `bench.dispatch_sweep` measures the NVFP4 kernels and writes the dispatch table the engine
reads (`qerl_exp/engine/dispatch.json`) where `--out` says. `bench.gpu_power` is the power meter
the GPU benchmarks print beside their timings.
"""
