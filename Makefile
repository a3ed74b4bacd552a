# Two entry points for a fresh machine: `make demo` and `make test`. Both create .venv with
# Python 3.12 when it is missing and reuse it afterwards.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
# Re-install when the package metadata changes (not on every run).
STAMP := $(VENV)/.installed-$(shell cat setup.py megatron_paging/version.py | cksum | cut -d' ' -f1)
# `make test`: ruff, then the CPU suite (GPU/multigpu/build tests skip without their hardware).
# PYTEST_WORKERS=N (or auto) spreads it over N pytest-xdist processes, each test file whole on one
# worker (tests/conftest.py says why), the files marked long_cpu first and the rest in
# collection order (xdist's default reorder by test count started the longest file last: 386 s
# cold on the 2-core machine, against 318 s with it first); 0 runs one process.
# pyproject.toml's -rfE lists failures and errors only, so the run ends on pytest's count line.
PYTEST_WORKERS ?= 2
XDIST_ARGS = $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder)
PYTEST_ARGS ?=

.PHONY: venv demo test lint build-ext gpu-check clean

venv: $(STAMP)

$(STAMP): setup.py megatron_paging/version.py
	@set -e; \
	if [ ! -x $(PY) ] || ! $(PY) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then \
	  py312=$$(scripts/find_python312.sh) || exit 1; \
	  echo "creating $(VENV) with $$py312"; \
	  rm -rf $(VENV); $$py312 -m venv $(VENV); \
	fi; \
	$(PY) -m pip install -q --upgrade pip; \
	$(PY) -m pip install -q -e '.[test]'; \
	rm -f $(VENV)/.installed-*; touch $@

demo: venv
	$(VENV)/bin/megatron-paging demo

test: venv
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(XDIST_ARGS) $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .

# Compile the CUDA extension with nvcc for sm_90 (no GPU needed).
build-ext: venv
	$(PY) -m megatron_paging.kernels.build --arch 9.0 --verbose

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
