#!/usr/bin/env bash
# Every GPU test (the pytest `gpu` marker: CUDA graphs and compiled decoding against the eager
# path, the fast training paths against their references, hybrid targets, and with 2 or more
# GPUs every device layout against its one-GPU reference), on a GPU host after
# scripts/gpu_install.sh. The log goes to OUT_DIR/gpu_tests.log; the exit status is pytest's.
#   bash scripts/gpu_checks.sh OUT_DIR [pytest -k expression]
set -uo pipefail
OUT_DIR=$(realpath -m "$1")
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
# NVLink multicast (NVLS) off: some hosts expose it without the fabric manager it needs.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
${PYTHON:-python3} -m pytest -q -m gpu -p no:cacheprovider ${2:+-k "$2"} tests/ 2>&1 | tee "$OUT_DIR/gpu_tests.log" | tail -40
exit "${PIPESTATUS[0]}"
