#!/usr/bin/env bash
# The multi-GPU checks, run on a 2-GPU machine with no internet, carrying .whl
# (bash scripts/device_wheels.sh). Usage there:
#   PART=tests|bench bash scripts/device_gpu_layouts.sh
# tests: tests/test_gpu_layouts.py (every layout against its reference) and tests/test_gpu.py.
# bench: scripts/bench_pipeline.py --compare layout on a random Qwen3-4B-shaped target built on
#   the GPU (36 layers, hidden 2560, tied embeddings) and the b16 drafter.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source scripts/device_setup.sh
if [ "${PART:-tests}" = tests ]; then
  python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_layouts.py tests/test_gpu.py -k "${TESTS:-.}" \
    2>&1 | grep -v "INFO\|Loading weights\|it/s\]" | tee "$OUT/gpu_tests${LOG_SUFFIX:-}.log" | tail -60
  exit 0
fi
QWEN3_4B=(target.arch.vocab_size=151936 target.arch.hidden_size=2560 target.arch.intermediate_size=9728
  target.arch.num_hidden_layers=36 target.arch.num_attention_heads=32 target.arch.num_key_value_heads=8
  target.arch.head_dim=128 target.arch.max_position_embeddings=4096 target.arch.tie_word_embeddings=true
  drafter=b16 drafter.mask_token_id=151669 drafter.num_anchors=${ANCHORS:-128}
  data.num_samples=${SAMPLES:-256} data.prompt_len_min=1024 data.prompt_len_max=1760 data.gen_len_min=256
  data.gen_len_max=288 data.max_length=2048 'scheduler.bucket_edges=[2048]' scheduler.tokens_per_batch=8192
  logger=jsonl paths.cache_dir=/tmp/dflash-cache)
python3 scripts/bench_pipeline.py --compare layout --steps ${STEPS:-30} --warmup-steps 4 "${QWEN3_4B[@]}" \
  > "$OUT/bench_layout.log" 2>&1  # straight to the file: a killed run keeps what it printed
grep "^|\|^overrides\|Error" "$OUT/bench_layout.log"
