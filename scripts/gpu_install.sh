#!/usr/bin/env bash
# Install dflash with its GPU extra (flash-linear-attention) into the current Python on a GPU
# host whose image already has torch, then print the GPUs and library versions.
#   bash scripts/gpu_install.sh               # from PyPI
#   bash scripts/gpu_install.sh WHEEL_DIR     # offline: only wheels from WHEEL_DIR (made by
#                                             # scripts/offline_wheels.sh on a connected machine)
# Run from the repository root; torch (a CUDA build) must already be installed.
set -euo pipefail
PY=${PYTHON:-python3}
if [[ $# -ge 1 ]]; then
  WHEELS=$(realpath "$1")
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-build-isolation -e ".[gpu]"
else
  "$PY" -m pip install -q -e ".[gpu]"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch, transformers, dflash; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
