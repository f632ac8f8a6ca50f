#!/usr/bin/env bash
# For a GPU host without internet: on a machine with it, download every wheel dflash and its GPU
# extra need except torch and triton (the host's image brings those, built for its CUDA), for
# the host's Python version and platform, into WHEEL_DIR. Copy WHEEL_DIR and this checkout to
# the host, then there: bash scripts/gpu_install.sh WHEEL_DIR
#   bash scripts/offline_wheels.sh WHEEL_DIR [PYTHON_VERSION (3.12)] [PLATFORM (manylinux_2_28_x86_64)]
# Run from the repository root.
set -euo pipefail
DIR=$(realpath -m "$1")
PY_VERSION=${2:-3.12}
PLATFORM=${3:-manylinux_2_28_x86_64}
mkdir -p "$DIR"
# The project's requirements, read from pyproject.toml, less torch (the host's own build).
mapfile -t REQS < <(python3 - <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for req in project["dependencies"] + ["setuptools>=68", "wheel"]:
    if not req.replace(" ", "").startswith("torch"):
        print(req)
PY
)
# The gpu extra, without its dependencies (torch and triton, which the host has; einops beside).
mapfile -t GPU_REQS < <(python3 - <<'PY'
import tomllib
for req in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["gpu"]:
    if not req.replace(" ", "").startswith("triton"):
        print(req)
PY
)
PLATFORMS=(--python-version "$PY_VERSION" --implementation cp --platform "$PLATFORM" --platform manylinux2014_x86_64)
# omegaconf's parser runtime is published as a source archive only: a wheel is built here
# (pure Python, so it installs anywhere), and the resolver below finds it in WHEEL_DIR.
python3 -m pip wheel -q --no-deps -w "$DIR" "antlr4-python3-runtime==4.9.3"
python3 -m pip download -q --only-binary=:all: "${PLATFORMS[@]}" --find-links "$DIR" -d "$DIR" "${REQS[@]}"
python3 -m pip download -q --only-binary=:all: "${PLATFORMS[@]}" --no-deps -d "$DIR" \
  "${GPU_REQS[@]}" fla-core einops
echo "$(ls "$DIR" | wc -l) wheels in $DIR"
