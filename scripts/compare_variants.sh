#!/usr/bin/env bash
# The matched comparison of drafter variants on SmolLM2-135M-Instruct: the same conversations,
# steps, seed and evaluation for each `variant=`, then one table (scripts/variant_table.py) and
# dflash-diff of the runs.
#   bash scripts/compare_variants.sh WORKDIR [dflash-train overrides for every variant ...]
# WORKDIR holds a prepared chain (smollm2_chain.sh's prompts, regen and prep stages); with
# REGEN_FILE and HELDOUT_FILE set (e.g. benchmarks/data/smollm2_10k/regen.jsonl.gz and
# heldout_prompts.jsonl: the conversations of benchmarks/RESULTS.md's matched rows) this script
# prepares it first. Each variant trains into WORKDIR/train_VARIANT (`smollm2_chain.sh` STAGES=train,
# seed 0 and 800 steps unless overridden), then is evaluated in fp32 greedy on HumanEval, MT-Bench
# and the held-out prompts (80 each, 256 new tokens; lossless checked) into WORKDIR/train_VARIANT/
# eval_fp32.
# Env: VARIANTS ("dflash dspark dflash2"; the first is the table's baseline), SIDE_BY_SIDE (1: the
#      variants run at once on the one GPU, each evaluating as soon as it has trained; they share
#      the GPU, so no run's samples/s or timing is its own; 0: one after another), STAGES ("prep train eval table"), PYTHON, and smollm2_chain.sh's
#      (TARGET, GPU, EVAL_PROMPTS, EVAL_NEW ...).
# Time limits: SIGTERM/SIGINT reach every running chain (a training writes its checkpoint, an
# evaluation keeps its journal) and the same command again continues where each stopped.
set -euo pipefail
W=$(realpath -m "$1"); shift
PY=${PYTHON:-python3}
HERE=$(dirname "$(realpath "$0")")
VARIANTS=${VARIANTS:-dflash dspark dflash2}
STAGES=" ${STAGES:-prep train eval table} "
mkdir -p "$W"

PIDS=()
forward() {
  for pid in "${PIDS[@]}"; do kill -s "$1" "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  exit 143
}
trap 'forward TERM' TERM
trap 'forward INT' INT

if [[ $STAGES == *" prep "* ]]; then
  if [[ -n ${REGEN_FILE:-} ]]; then
    STAGES="prompts regen prep" bash "$HERE/smollm2_chain.sh" "$W"
  elif [[ ! -f $W/regen.jsonl ]]; then
    echo "compare_variants: $W holds no regen.jsonl: run smollm2_chain.sh's prompts, regen and prep stages there, or set REGEN_FILE and HELDOUT_FILE" >&2
    exit 2
  fi
fi

# One variant: train (resuming from its last checkpoint; Hydra's record goes into the run dir too,
# where dflash-diff reads it), then its fp32 evaluation (resuming from its journal); summary.json
# marks a finished training (dflash-train writes it once the last step is done, a stop then
# included), which a second run skips. It runs as a subshell of its own, which
# passes a signal on to the chain in hand and waits for it to stop.
variant() {
  local v=$1 child=; shift
  local run=$W/train_$v
  trap '[[ -n $child ]] && kill -s TERM "$child" 2>/dev/null; [[ -n $child ]] && wait "$child"; exit 143' TERM INT
  if [[ $STAGES == *" train "* && ! -f $run/summary.json ]]; then
    STAGES=train TRAIN_DIR="$run" bash "$HERE/smollm2_chain.sh" "$W" seed=0 train.total_steps=800 \
      logger=jsonl "variant=$v" "hydra.run.dir=$run" "$@" &
    child=$!
    wait "$child"
    child=
  fi
  if [[ $STAGES == *" eval "* && -f $run/summary.json ]]; then
    STAGES=eval EVAL_DTYPES=float32 TRAIN_DIR="$run" bash "$HERE/smollm2_chain.sh" "$W" &
    child=$!
    wait "$child"
    child=
  fi
}

for v in $VARIANTS; do
  if [[ ${SIDE_BY_SIDE:-1} == 1 ]]; then
    variant "$v" "$@" > >(trap '' TERM INT; sed -u "s/^/[$v] /") 2>&1 &
    PIDS+=($!)
  else
    variant "$v" "$@" &
    PIDS=($!)
    wait "${PIDS[0]}" || exit $?
  fi
done
status=0
for pid in "${PIDS[@]}"; do wait "$pid" || status=$?; done
((status == 0)) || { echo "compare_variants: a variant failed (exit $status): see its lines above" >&2; exit "$status"; }

if [[ $STAGES == *" table "* ]]; then
  RUNS=()
  for v in $VARIANTS; do RUNS+=("$W/train_$v"); done
  $PY "$HERE/variant_table.py" --positions 4 "${RUNS[@]}"
  $PY -m dflash.tools.diff "${RUNS[@]}" --format markdown
fi
