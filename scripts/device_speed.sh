#!/usr/bin/env bash
# Paper-scale training speed on one H200 with no internet, carrying .whl (bash
# scripts/device_wheels.sh). Usage there:  PARTS="bench tests train" bash scripts/device_speed.sh
# tests: tests/test_gpu_speed.py (fast paths vs reference) + tests/test_gpu.py.
# bench: scripts/bench_step.py at the paper shape (1 x 3072, 512 anchors); bench4: at 4 x 1024.
# flex: scripts/bench_flex.py (the drafter's flex_attention alone, per kernel configuration).
#   BENCH_ARGS="--target-variants eager,compiled,compiled_static" adds the static-shape target.
# train: dflash-train on a random Qwen3-8B-shaped target and random 3072-token samples, one GPU
#   for both roles: the reference path for 50 steps against the default (fast) path, then the
#   experiment=qwen3_8b preset at its own batch budget (peak memory).
set -uo pipefail
source scripts/device_setup.sh
for part in ${PARTS:-bench}; do
case "$part" in
tests)
  timeout ${TESTS_TIMEOUT:-500} python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_speed.py tests/test_gpu.py -k "${TESTS:-.}" \
    > "$OUT/gpu_tests.log" 2>&1
  grep -v "INFO\|Loading weights\|it/s\]" "$OUT/gpu_tests.log" | tail -40 ;;
bench)
  timeout ${BENCH_TIMEOUT:-330} python3 scripts/bench_step.py --profile "$OUT/profile" ${BENCH_ARGS:-} \
    > "$OUT/bench_step.log" 2>&1
  grep "^|\|^NVIDIA\|Error" "$OUT/bench_step.log" | tail -12
  ;;
flex)
  # The drafter's training attention alone under several flex_attention kernel configurations.
  timeout ${FLEX_TIMEOUT:-200} python3 scripts/bench_flex.py ${FLEX_ARGS:-} > "$OUT/bench_flex.log" 2>&1
  grep "^|\|^NVIDIA\|Error\|AUTOTUNE\|BLOCK" "$OUT/bench_flex.log" | head -40 ;;
bench4)
  timeout 200 python3 scripts/bench_step.py --samples 4 --seq-len 1024 --target-variants eager \
    --drafter-variants fused,compiled > "$OUT/bench_step_4x1024.log" 2>&1
  grep "^|\|Error" "$OUT/bench_step_4x1024.log" | tail -5 ;;
train)
  # Run directories stay on the machine (a b16 drafter checkpoint is 4 GB); their metrics and
  # summaries are copied to $OUT.
  PAPER=(experiment=qwen3_8b target=qwen3_8b_random data=random_3072 gpu=single pipeline=async debug=fast
    logger=jsonl monitor.cuda_stats=true monitor.interval_s=5 paths.cache_dir=/tmp/dflash-cache)
  ONE=(scheduler.block_tokens_per_batch=8192 train.total_steps=${STEPS:-200} logger.every_steps=1
    checkpoint.every_steps=100000)
  timeout ${REFERENCE_TIMEOUT:-120} python3 -m dflash.train "${PAPER[@]}" "${ONE[@]}" debug.max_steps=50 drafter.attention=sdpa \
    target.compile=false drafter.compile=false loss.logits_chunk=0 paths.output_dir=/tmp/runs/reference \
    > "$OUT/train_reference.log" 2>&1
  # FAST_ARGS: overrides of the fast and preset runs (e.g. the compiled target and exact-shape
  # graphs: target.compile=true target.compile_dynamic=null drafter.compile_dynamic=null).
  timeout ${FAST_TIMEOUT:-170} python3 -m dflash.train "${PAPER[@]}" "${ONE[@]}" debug.max_steps=null ${FAST_ARGS:-} \
    paths.output_dir=/tmp/runs/fast > "$OUT/train_fast.log" 2>&1
  timeout ${PRESET_TIMEOUT:-150} python3 -m dflash.train "${PAPER[@]}" train.total_steps=40 debug.max_steps=null \
    checkpoint.every_steps=100000 ${FAST_ARGS:-} paths.output_dir=/tmp/runs/preset > "$OUT/train_preset.log" 2>&1
  for run in reference fast preset; do
    mkdir -p "$OUT/runs/$run" && cp /tmp/runs/$run/{metrics.jsonl,summary.json} "$OUT/runs/$run/" 2>/dev/null
  done
  python3 scripts/compare_runs.py /tmp/runs/reference /tmp/runs/fast /tmp/runs/preset | tee "$OUT/compare.txt" ;;
esac
done
