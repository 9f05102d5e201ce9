# The two set-up commands the README promises: `make serve` and `make test`.
# Both build .venv/ on a fresh machine first (CPU torch from the local wheel, never a CUDA build).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# Set-up installs the native CPU kernels prebuilt (kernels/cpu/prebuilt/), so any later start maps
# them and compiles nothing. A rebuild after the sources change goes into this checkout's venv,
# not the shared ~/.cache: two checkouts on one machine (a CI clone beside a working tree) would
# otherwise rebuild and relink the same .so over each other, under processes that have it loaded.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(VENV)/torch_extensions

.PHONY: serve test lint setup services

serve: $(VENV)/.ready
	$(BIN)/deepserve serve

# One pytest process per test file: engines a file's fixtures load are freed when its process
# ends. In one process for the whole suite they accumulated until the OOM killer ended the run
# on a 24 GB machine. Exit status 5 is a file whose tests were all deselected.
test: $(VENV)/.ready services
	@failed=""; for f in tests/test_*.py; do \
	  $(BIN)/python -m pytest -q -ra $$f || [ $$? -eq 5 ] || failed="$$failed $$f"; \
	done; \
	if [ -n "$$failed" ]; then echo "FAILED:$$failed"; exit 1; fi; echo "all test files passed"

lint: $(VENV)/.ready
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

setup: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml setup.py $(wildcard kernels/cpu/csrc/*.cpp kernels/cpu/csrc/*.h)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/deepserve fetch-model smollm2-135m
	$(BIN)/python -m deepserve.kernels.cpu.native --prebuild
	touch $@

# Services the tests start themselves on free loopback ports; installed here when missing.
services:
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	@command -v prometheus >/dev/null || (apt-get update -qq && apt-get install -y -qq prometheus)
	@command -v kubectl >/dev/null || (apt-get update -qq && apt-get install -y -qq kubernetes-client)
