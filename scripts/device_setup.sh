# Sourced by the scripts run on a GPU machine with no internet (device_*.sh): installs the
# carried wheels (.whl, from bash scripts/device_wheels.sh) outside the image, points Python at
# them and at this checkout, makes $OUT, and prints the machine and library versions.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
