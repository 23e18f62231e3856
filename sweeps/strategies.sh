#!/usr/bin/env bash
# The strategy comparison: every strategy preset (conf/strategy/) over several seeds,
# plus the one-factor ablations the figures need, then `python -m analysis` on the lot.
#
# Every run evaluates greedy pass@1 on the task's held-out problems after its last step (eval.every
# set to the run's length, eval.k=0: the table's held-out pass@1 column; EVAL=0 skips it).
#
# Each run is its own process, so that a run's peak memory (mem/peak_bytes: the process's peak
# RSS on CPU, CUDA's max allocated on GPU) is its own; a Hydra multirun (-m) runs every job in
# one process. A run whose directory already holds summary.json is not run again, so the script
# can be re-run to fill in runs that failed.
#
# Usage: sweeps/strategies.sh OUT [OVERRIDE...]
#   OUT         parent directory of the runs; the analysis goes to OUT/report
#   OVERRIDE    Hydra overrides given to every run (e.g. train.steps=20)
# Environment:
#   SEEDS       seeds of every configuration (default "0 1")
#   STRATEGIES  the presets to run (default: all eight)
#   ABLATIONS   1 (default) also runs the ablations of Figs. 9/15, 10 and 16-17; 0 skips them
#   EVAL        1 (default) evaluates held-out pass@1 after each run's last step; 0 skips it
#   PYTHON      the interpreter (default python3: machines without a venv may have no `python`)
#   OMP_NUM_THREADS  torch CPU threads per run (default 1: on a shared CPU, more threads than
#               free cores make OpenMP spin and steps 10-50x slower, which swamps the timings)
#
# Example (the CPU results page, results/results.md):
#   SEEDS="0 1 2" sweeps/strategies.sh runs/strategies train.steps=40 train.prompts_per_step=4 algo.group_size=4
set -uo pipefail

if [ $# -lt 1 ]; then
  sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
out=$1
shift
seeds=${SEEDS:-0 1}
py=${PYTHON:-python3}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
strategies=${STRATEGIES:-full_precision nvfp4_rollout nvfp4_lora nf4_dq nf4_lora mxfp4_lora nvfp4_lora_noaqn bf16_aqn}
failed=0

# run NAME OVERRIDE...: one run per seed into OUT/NAME/s<seed>
run() {
  local name=$1
  shift
  for seed in $seeds; do
    local dir="$out/$name/s$seed"
    if [ -f "$dir/summary.json" ]; then
      echo "done already: $dir"
      continue
    fi
    echo "run: $dir"
    if ! "$py" -m qerl_exp "$@" seed="$seed" hydra.run.dir="$dir" "${overrides[@]}"; then
      echo "FAILED: $dir (see $dir/error.txt)" >&2
      failed=$((failed + 1))
    fi
  done
}
overrides=("$@")
if [ "${EVAL:-1}" = 1 ]; then
  # the run length the overrides set (the last train.steps=N wins, as in Hydra), else the default's
  steps=$(printf '%s\n' "$@" | sed -n 's/^train\.steps=//p' | tail -n 1)
  overrides=("eval.every=${steps:-60}" "eval.k=0" "${overrides[@]}")  # the command line's own eval.* still win
fi

for s in $strategies; do
  run "$s" strategy="$s"
done

if [ "${ABLATIONS:-1}" = 1 ]; then
  # Figs. 9 and 15: the other noise schedules around QeRL (exp is nvfp4_lora itself).
  for schedule in linear cosine log; do
    run "ablation/nvfp4_lora_noise-$schedule" strategy=nvfp4_lora noise="$schedule"
  done
  # Fig. 10: LoRA rank 32 beside the presets' 16.
  run ablation/nvfp4_lora_lora-r32 strategy=nvfp4_lora lora=r32
  # Figs. 16-17: a second learning rate, around QeRL and around full precision.
  run ablation/nvfp4_lora_lr-1e-3 strategy=nvfp4_lora train.lr=1e-3
  run ablation/full_precision_lr-1e-3 strategy=full_precision train.lr=1e-3
fi

"$py" -m analysis "$out" --out "$out/report"
echo "failed runs: $failed"
