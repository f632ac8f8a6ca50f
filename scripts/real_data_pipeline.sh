#!/usr/bin/env bash
# The real-data path end to end, with the commands a user runs, on locally built files:
#   dflash demo (tiny tokenizer + random Qwen3 target saved to disk, ShareGPT conversations) ->
#   dflash regen (the target writes every reply) -> dflash prep -> dflash train -> dflash eval.
# Usage: bash scripts/real_data_pipeline.sh WORKDIR [dflash-train overrides ...]
# Env: PYTHON (python3), GPU (cpu | single), ARCH (Qwen3 fields, e.g. "hidden_size=1024 ..."),
#      CONVERSATIONS (600), MAX_NEW (64), MAX_LENGTH (128), EPOCHS (8), EVAL_NEW (64), EVAL_PROMPTS (16),
#      REGEN_BATCH (64), EVAL_TEMPS ([0,1])
# Eval benchmarks: `heldout` (new prompts) and `seen` (the prompts of the training conversations:
# tau there should match training's tau_sim, a check that training and decoding agree).
set -euo pipefail
W=$(realpath -m "$1"); shift
PY=${PYTHON:-python3}
GPU=${GPU:-cpu}
export PYTHONUNBUFFERED=1
quiet() { grep -v "Loading weights\|Writing model shards\|it/s\]\|Map" || true; }

$PY -m dflash demo "$W" --conversations "${CONVERSATIONS:-600}" --heldout "${EVAL_PROMPTS:-16}" \
  ${ARCH:+--arch $ARCH}
$PY -m dflash regen target.path="$W/target" "input=[$W/chat.jsonl]" output="$W/regen.jsonl" \
  sampling.temperature=0 sampling.max_new_tokens="${MAX_NEW:-64}" batch_size="${REGEN_BATCH:-64}" \
  paths.output_dir="$W/regen_run" 2>&1 | quiet
DATA=(data=conversations "data.files=[$W/regen.jsonl]" data.max_length="${MAX_LENGTH:-128}"
  data.min_supervised_tokens=4 target.path="$W/target" drafter.mask_token_id=500 paths.cache_dir="$W/cache")
$PY -m dflash prep "${DATA[@]}" paths.output_dir="$W/prep" 2>&1 | quiet
$PY -m dflash train "${DATA[@]}" gpu="$GPU" train.epochs="${EPOCHS:-8}" paths.output_dir="$W/train" \
  "eval.benchmarks={heldout:$W/heldout.jsonl}" eval.max_new_tokens="${EVAL_NEW:-64}" "$@" \
  2>&1 | { grep -v "INFO\|Loading weights\|it/s\]" || true; }
$PY -m dflash eval gpu="$GPU" ckpt="$W/train/checkpoints/last" \
  "eval.benchmarks={heldout:$W/heldout.jsonl,seen:$W/regen.jsonl}" eval.num_prompts="${EVAL_PROMPTS:-16}" \
  eval.max_new_tokens="${EVAL_NEW:-64}" "eval.temperatures=${EVAL_TEMPS:-[0,1]}" paths.output_dir="$W/eval" \
  2>&1 | quiet
