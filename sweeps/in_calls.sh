#!/usr/bin/env bash
# A sweep study run in calls of limited time and size, on a machine that keeps its files from one
# call to the next but reaches no package registry (a lent GPU machine, a batch job's node): the
# model file arrives in pieces over several calls, the Python packages the machine lacks as wheels,
# and each call runs the study until its time is up; the next call resumes it (trials continue from
# their last checkpoint, checkpoint.every in the spec).
#
# Usage (from the repository root):
#   sweeps/in_calls.sh stash [DIR]            move the pieces that arrived in DIR (default .model_parts)
#                                             to $PIECES and check each against DIR/SHA256SUMS
#   sweeps/in_calls.sh place OVERRIDE...      join the pieces in $PIECES into the model file the preset
#                                             reads (python -m qerl_exp.models.fetch ... pieces=...),
#                                             checked against its model.parts.sha256
#   sweeps/in_calls.sh sweep SPEC N_JOBS OUT [KEY=VALUE...]
#                                             run the study for at most $LIMIT seconds with N_JOBS
#                                             workers (KEY=VALUE: more sweep settings or overrides),
#                                             then archive its sweep_dir without weights as
#                                             OUT/<study>.tgz (run again until every trial finished)
# Environment:
#   PIECES   where pieces wait between calls (default /tmp/qerl_pieces)
#   LIMIT    seconds the study may run in this call (default 540), then SIGTERM: every run
#            checkpoints and the study stops, to be resumed by the next call
#   WHEELS   a folder of wheels to install once into SITE (default .whl, if present)
#   SITE     where they go (default /tmp/site; added to PYTHONPATH)
#   PYTHON   the interpreter (default python3)
#
# Example: a model cut with `split -b 55M FILE FILE.` and `sha256sum FILE.* > SHA256SUMS` into
# .model_parts/, one piece brought a call (with SHA256SUMS), then in the last call:
#   sweeps/in_calls.sh stash && sweeps/in_calls.sh place model=qwen2.5-coder-0.5b &&
#   sweeps/in_calls.sh sweep sweeps/qwen_coder_check.yaml 8 "$OUT"
set -euo pipefail

pieces=${PIECES:-/tmp/qerl_pieces}
py=${PYTHON:-python3}

site() {  # the wheels, installed once (the folder persists between calls), on the path of this call
  local wheels=${WHEELS:-.whl} dest=${SITE:-/tmp/site}
  if [ -d "$wheels" ] && [ ! -e "$dest/.installed" ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$dest" "$wheels"/*.whl
    touch "$dest/.installed"
  fi
  export PYTHONPATH="$dest${PYTHONPATH:+:$PYTHONPATH}"
}

listed() {  # the pieces SHA256SUMS lists; with a test (-f, ! -f), those in $pieces that pass it
  local f
  awk '{print $2}' "$pieces/SHA256SUMS" | while read -r f; do
    if [ $# -eq 0 ] || [ "$@" "$pieces/$f" ]; then echo "$f"; fi
  done
}

case "${1:-}" in
  stash)
    dir=${2:-.model_parts}
    mkdir -p "$pieces"
    if [ -f "$dir/SHA256SUMS" ]; then cp "$dir/SHA256SUMS" "$pieces/"; fi
    find "$dir" -maxdepth 1 -type f ! -name SHA256SUMS -exec mv -t "$pieces" {} + 2>/dev/null || true
    if [ -f "$pieces/SHA256SUMS" ]; then
      (cd "$pieces" && sha256sum --check --ignore-missing --quiet SHA256SUMS) || { echo "a piece is damaged: send it again" >&2; exit 1; }
      echo "pieces: $(listed -f | wc -l) of $(listed | wc -l) in $pieces, each checked"
    else
      echo "pieces in $pieces: $(find "$pieces" -maxdepth 1 -type f | wc -l) (no SHA256SUMS yet)"
    fi
    ;;
  place)
    shift
    site
    if [ -f "$pieces/SHA256SUMS" ]; then
      missing=$(listed ! -f)
      [ -z "$missing" ] || { echo "pieces missing:" $missing >&2; exit 1; }
      glob="$pieces/$(awk 'NR == 1 {print $2}' "$pieces/SHA256SUMS" | sed 's/\.[^.]*$//').*"
    else
      glob="$pieces/*"
    fi
    "$py" -m qerl_exp.models.fetch "$@" "pieces=$glob"
    ;;
  sweep)
    [ $# -ge 4 ] || { sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
    spec=$2 jobs=$3 out=$4
    shift 4
    site
    study=$(basename "$spec" .yaml) dir=
    for arg in "$@"; do
      case $arg in study_name=*) study=${arg#study_name=};; sweep_dir=*) dir=${arg#sweep_dir=};; esac
    done
    dir=${dir:-sweeps/runs/$study}
    status=0
    PYTHONUNBUFFERED=1 timeout -k 30 "${LIMIT:-540}" "$py" -m qerl_exp.sweep "$spec" "n_jobs=$jobs" "$@" || status=$?
    if [ -d "$dir" ]; then
      mkdir -p "$out"
      tar -czf "$out/$study.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' "$dir"
      echo "archived $dir as $out/$study.tgz ($(du -h "$out/$study.tgz" | cut -f1))"
    fi
    case $status in
      0) echo "the sweep ended" ;;
      124|137) echo "the sweep was stopped at ${LIMIT:-540} s: run this again to resume it" ;;
      *) echo "the sweep failed (exit status $status)" ;;
    esac
    exit "$status"
    ;;
  *)
    sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
