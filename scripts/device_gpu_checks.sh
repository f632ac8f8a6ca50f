#!/usr/bin/env bash
# What we run on the GPU machine (device tool): GPU tests, then the benchmarks on a small
# random-init Qwen3 target. Usage there: bash scripts/device_gpu_checks.sh
#   TESTS=<pytest -k expression> to select GPU tests, BENCH=pipeline|monitor|both|none.
set -uo pipefail
source scripts/device_setup.sh  # carry .whl (bash scripts/device_wheels.sh)
python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu.py -k "${TESTS:-.}" 2>&1 | tail -40
SMALL_TARGET=(gpu=single drafter=b16 drafter.mask_token_id=31999 drafter.num_anchors=64
  target.arch.vocab_size=32000 target.arch.hidden_size=1024 target.arch.intermediate_size=3072
  target.arch.num_hidden_layers=16 target.arch.num_attention_heads=16 target.arch.num_key_value_heads=8
  target.arch.head_dim=64 data.num_samples=512 data.gen_len_max=300 data.max_length=384
  'scheduler.bucket_edges=[128,256,384]' scheduler.tokens_per_batch=8192 paths.cache_dir=/tmp/dflash-cache)
for compare in pipeline monitor; do
  case "${BENCH:-both}" in both|$compare) ;; *) continue ;; esac
  python3 scripts/bench_pipeline.py --compare $compare --steps ${STEPS:-150} --warmup-steps 20 "${SMALL_TARGET[@]}" \
    2>&1 | grep -v "INFO\|Loading weights\|it/s\]"
done
