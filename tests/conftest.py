"""Shared fixtures: tiny checkpoints made once per session, servers on free loopback ports."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("KVPUSH_TORCH_THREADS", "1")
os.environ.setdefault("KVPUSH_COMPILE", "off")  # compiled only where a test asks for it
# plain linears unless a test forces oneDNN: no calibration at every engine start, no writes to the user's cache
os.environ.setdefault("KVPUSH_LINEAR_BACKEND", "mkl")
# the C kernel where a compiler builds it, else gather + SDPA, as before: no calibration per test engine
_KERNELS = "kernel" if shutil.which(os.environ.get("CC") or "cc") else "sdpa"
os.environ.setdefault("KVPUSH_DECODE_ATTENTION", _KERNELS)
os.environ.setdefault("KVPUSH_PREFILL_ATTENTION", _KERNELS)


def pytest_addoption(parser) -> None:
    parser.addoption("--cpu-twins", action="store_true",
                     help="also run the cpu cases of device-parametrised tests that repeat existing CPU coverage "
                          "(scripts/gpu_check.sh --dry-run uses it to check those tests without a GPU)")


def pytest_collection_modifyitems(config, items) -> None:
    if config.getoption("--cpu-twins"):
        return
    skip = pytest.mark.skip(reason="cpu twin of existing coverage (run with --cpu-twins)")
    for item in items:
        if item.get_closest_marker("cpu_twin") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from kvpush.models.make_model import make_model

    return make_model(str(tmp_path_factory.mktemp("models") / "tiny"), preset="tiny", seed=0)


@pytest.fixture(scope="session")
def llama_model(tmp_path_factory) -> str:
    """A random Llama checkpoint written by transformers itself (untied, llama3 rope scaling)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # spread the logits so greedy decoding has no near-ties
        model.lm_head.weight.normal_(0, 0.5)
    path = str(tmp_path_factory.mktemp("models") / "llama")
    model.save_pretrained(path)
    return path


@pytest.fixture
def server_factory(tmp_path):
    """Start `kvpush serve` processes on free loopback ports; all are stopped after the test."""
    from kvpush.launcher.launch import ServerProcess, free_port

    started: list[ServerProcess] = []

    def start(model: str, *args: str, timeout_s: float = 120.0) -> ServerProcess:
        port = free_port()
        log = str(tmp_path / f"server-{port}.log")
        proc = ServerProcess(["serve", model, "--port", str(port), "--torch-threads", "1", *args], log_path=log)
        started.append(proc)
        proc.start()
        proc.wait_healthy(timeout_s)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture(scope="module")
def module_server(request, tmp_path_factory):
    """One colocated server on the tiny model for a whole test module (started lazily)."""
    from kvpush.launcher.launch import ServerProcess, free_port
    from kvpush.models.make_model import make_model

    model = make_model(str(tmp_path_factory.mktemp("srvmodel") / "tiny"), preset="tiny", seed=0)
    port = free_port()
    log = str(tmp_path_factory.mktemp("logs") / "server.log")
    extra = getattr(request.module, "SERVER_ARGS", [])
    proc = ServerProcess(["serve", model, "--port", str(port), "--torch-threads", "1",
                          "--served-model-name", "tiny", *extra], log_path=log)
    proc.start()
    try:
        proc.wait_healthy(120)
        proc.model_path = model  # type: ignore[attr-defined]
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def reference(tiny_model):
    """Greedy outputs of the colocated offline engine (token strings and text) for a prompt."""
    from kvpush_testing import BS, MAX_TOKENS

    from kvpush import LLM, SamplingParams
    from kvpush.models.tokenizer import Tokenizer

    llm = LLM(tiny_model, block_size=BS, num_blocks=512)
    tok = Tokenizer.from_pretrained(tiny_model)
    cache: dict[tuple[int, ...], tuple[list[str], str]] = {}

    def ref(prompt: list[int], max_tokens: int = MAX_TOKENS) -> tuple[list[str], str]:
        key = (*prompt, -max_tokens)
        if key not in cache:
            out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0]
            cache[key] = ([tok.decode([t], skip_special_tokens=False) for t in out.token_ids], out.text)
        return cache[key]

    return ref


@pytest.fixture
def cluster():
    """Transfer threads over fake agents (test_transfer_worker.Cluster), closed even when a test fails.
    Modules that start real servers define their own `cluster`."""
    from test_transfer_worker import Cluster

    c = Cluster()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def pd(cluster):
    """A prefill and a decode transfer thread over fake agents, wired to each other."""
    from test_transfer_worker import make_pair

    return make_pair(cluster)
