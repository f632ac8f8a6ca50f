#!/usr/bin/env bash
# Wheels of the pure-Python packages a GPU machine without internet may lack (hydra-core,
# omegaconf and its parser runtime), into ./.whl for carrying there. Run from the repo root:
#   bash scripts/device_wheels.sh
# There: python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d .whl hydra-core==1.3.8 omegaconf==2.3.1
# antlr4-python3-runtime 4.9.3 (omegaconf 2.3's parser) is published as source only: build its wheel.
ls .whl/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1 \
  || python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls -1 .whl
