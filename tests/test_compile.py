"""torch.compile of the model: byte-exact greedy outputs vs eager, no recompiles after warm-up, and
the fallback when inductor cannot build (no C++ compiler)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from test_engine import ATOL, generate, ours_logits, prompts

from kvpush.config import CacheConfig, CompileMode, EngineConfig, ModelConfig, SchedulerConfig
from kvpush.engine.engine import LLMEngine
from kvpush.engine.sampling_params import SamplingParams
from kvpush.layers.cpu_kernels import paged_decode_kernel

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
LONG = 138  # prompts long enough to be prefilled in several chunks next to decode rows


class CountingLayers:
    """Counts forwards that ran compiled (decoder_logits), by token count (so a test knows what it exercised)."""

    def __init__(self, eng: LLMEngine) -> None:
        inner = eng.model.compiled_forward
        assert inner is not None
        self.tokens: list[int] = []

        def counted(model, input_ids, positions, logit_rows):
            self.tokens.append(input_ids.shape[0])
            return inner(model, input_ids, positions, logit_rows)

        eng.model.compiled_forward = counted


def compiled_engine(model: str) -> LLMEngine:
    eng = LLMEngine(EngineConfig(ModelConfig(model), CacheConfig(block_size=4, num_blocks=512),
                                 SchedulerConfig(16, LONG + 40, True), compile=CompileMode.ON))
    assert eng.runner.compiled
    return eng


@pytest.fixture(scope="module")
def compiled(tiny_model) -> LLMEngine:
    return compiled_engine(tiny_model)


def test_compiled_greedy_equals_eager_and_logits_match(compiled, tiny_model):
    eager = LLMEngine(dataclasses.replace(compiled.config, compile=CompileMode.OFF))
    assert not eager.runner.compiled
    counter = CountingLayers(compiled)
    # chunked prefills of LONG + 40 tokens next to decode rows of the requests already prefilled
    ps = prompts(compiled.arch.vocab_size, (1, 7, 30, LONG, 2 * LONG, 45))
    assert generate(compiled, ps, GREEDY) == generate(eager, ps, GREEDY)
    assert max(counter.tokens) > LONG  # chunks next to decode rows ran compiled
    assert [generate(compiled, [p], GREEDY)[0] for p in ps[2:4]] == [generate(eager, [p], GREEDY)[0] for p in ps[2:4]]
    assert 1 in counter.tokens  # and so did one decoding sequence
    tokens = ps[4][: LONG + 20]
    diff = (ours_logits(compiled, tokens) - ours_logits(eager, tokens)).abs().max().item()
    assert diff < ATOL["cpu"], diff


def test_greedy_tokens_of_the_graph_are_argmax_of_its_logits(compiled):
    """The compiled forward's greedy tokens (what plain greedy sampling uses) are torch.argmax of its logits,
    first maximum on ties: rows whose logits tie are made by giving two vocabulary rows the same LM-head weights."""
    vocab = compiled.arch.vocab_size
    tokens = prompts(vocab, (40,))[0]
    req = compiled.make_request("argmax", tokens, SamplingParams(max_tokens=1))
    assert compiled.block_manager.allocate(req, len(tokens))
    batch = compiled.runner.prepare([(req, len(tokens))])
    head = compiled.model.lm_head.weight
    saved = head.detach().clone()
    try:
        with torch.inference_mode():
            logits, _ = compiled.model(batch.input_ids, batch.positions, batch.meta, compiled.cache,
                                       torch.arange(len(tokens)))
            top = logits.argmax(-1)  # make each row's maximum tie with a later twin of its top token
            twins = (top + 1) % vocab
            head[twins] = head[top]
            logits, greedy = compiled.model(batch.input_ids, batch.positions, batch.meta, compiled.cache,
                                            torch.arange(len(tokens)))
        rows = range(len(tokens))
        assert any(logits[i, int(top[i])] == logits[i, int(twins[i])] for i in rows)  # ties exist
        assert greedy.tolist() == [int(torch.argmax(logits[i])) for i in rows]
    finally:
        with torch.no_grad():
            head.copy_(saved)
        compiled.block_manager.free(req)


def test_a_prompt_longer_than_the_budget_alone_samples_nothing_until_its_last_chunk(compiled, tiny_model):
    """Chunks of one long prompt with nothing else running: steps whose forward samples no row at all (an empty
    logit_rows), compiled as eager, without a recompile."""
    eager = LLMEngine(dataclasses.replace(compiled.config, compile=CompileMode.OFF))
    before = compiled.runner.num_compiled_graphs
    counter = CountingLayers(compiled)
    [long] = prompts(compiled.arch.vocab_size, (3 * LONG,))
    assert generate(compiled, [long], GREEDY) == generate(eager, [long], GREEDY)
    assert counter.tokens.count(LONG + 40) >= 2  # whole budget-sized chunks ran, sampling nothing
    assert compiled.runner.num_compiled_graphs == before


def test_no_recompile_after_warm_up(tiny_model):
    compiled = compiled_engine(tiny_model)  # a fresh engine: nothing ran on it since its warm-up
    before = compiled.runner.num_compiled_graphs
    assert before > 0
    counter = CountingLayers(compiled)
    vocab = compiled.arch.vocab_size
    generate(compiled, prompts(vocab, (1,)))  # a one-token prompt, then one decoding sequence
    generate(compiled, prompts(vocab, (5, LONG, 17, 2, LONG + 33, 3 * LONG)))  # mixed, chunked prefills
    base = prompts(vocab, (LONG + 4,))[0]
    generate(compiled, [base, base + list(range(3, 3 + LONG))])  # prefix-cache hit, then context
    generate(compiled, [p[:3] for p in prompts(vocab, (8,) * 12)])  # a wide decode batch
    generate(compiled, prompts(vocab, (4, 4)))  # a two-sequence decode batch
    assert 1 in counter.tokens and 2 in counter.tokens and max(counter.tokens) > LONG
    assert compiled.runner.num_compiled_graphs == before


def test_layer_hook_runs_between_compiled_layers(compiled):
    seen: list[int] = []
    compiled.runner.layer_hook = seen.append
    try:
        generate(compiled, prompts(compiled.arch.vocab_size, (LONG,)), SamplingParams(max_tokens=1))
    finally:
        compiled.runner.layer_hook = None
    assert seen == list(range(compiled.arch.num_layers))


SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
from kvpush.config import CacheConfig, CompileMode, EngineConfig, ModelConfig
from kvpush.engine.engine import LLMEngine
from kvpush.engine.sampling_params import SamplingParams
from kvpush.errors import CompileError
try:
    eng = LLMEngine(EngineConfig(ModelConfig(sys.argv[1]), CacheConfig(num_blocks=32), compile=CompileMode(sys.argv[2])))
except CompileError as e:
    print("COMPILE-ERROR", e)
    sys.exit(3)
eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0))
while eng.has_unfinished():
    eng.step()
print("SERVED compiled=%s" % eng.runner.compiled)
"""


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_without_a_cxx_compiler(mode, tiny_model, tmp_path):
    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"),
           "KVPUSH_COMPILE": "off"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, tiny_model, mode], env=env, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    if mode == "auto":
        assert proc.returncode == 0, out
        assert "SERVED compiled=False" in out
        lines = [line for line in out.splitlines() if "serving eagerly" in line]
        assert len(lines) == 1, out
    else:
        assert proc.returncode == 3, out
        assert "COMPILE-ERROR --compile on" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_on_cuda_equals_eager(tiny_model):
    def run(mode: CompileMode) -> list[list[int]]:
        eng = LLMEngine(EngineConfig(ModelConfig(tiny_model, device="cuda"), CacheConfig(block_size=4, num_blocks=64),
                                     compile=mode))
        return generate(eng, prompts(eng.arch.vocab_size))
    assert run(CompileMode.ON) == run(CompileMode.OFF)


def test_compiled_server_does_not_recompile(server_factory, tiny_model):
    """`serve --compile on`: the kvpush_compiled_graphs metric is set at start and stays flat."""
    from kvpush_testing import post
    from test_server import metrics

    server = server_factory(tiny_model, "--compile", "on", "--block-size", "4", "--num-blocks", "512",
                            timeout_s=300)
    before = metrics(server.url)["kvpush_compiled_graphs"]
    assert before == 1  # one graph serves every batch, one decoding sequence included
    vocab = 1000
    for lengths in ((LONG,), (3, LONG + 57), (2 * LONG + 5, 9, 1)):
        for p in prompts(vocab, lengths):
            status, body = post(server.url + "/v1/completions",
                                {"model": tiny_model, "prompt": p, "max_tokens": 4, "temperature": 0})
            assert status == 200, body
    assert metrics(server.url)["kvpush_compiled_graphs"] == before


@pytest.mark.skipif(paged_decode_kernel() is None, reason="no C compiler built the decode kernel here")
@pytest.mark.parametrize("mode", ["compiled", "eager"])
def test_decode_only_steps_take_the_one_call_path(compiled, mode, monkeypatch):
    """A forward whose every row decodes writes K/V and attends in one C call a layer (cpu_kernels.DecodeStep),
    compiled and eager: the graph hands the op what the call takes, so it never falls back."""
    from kvpush.layers import cpu_kernels

    eng = compiled if mode == "compiled" else LLMEngine(dataclasses.replace(compiled.config, compile=CompileMode.OFF))
    calls: list[bool] = []
    inner = cpu_kernels.DecodeStep.__call__

    def counted(self, *args):
        out = inner(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cpu_kernels.DecodeStep, "__call__", counted)
    generate(eng, prompts(eng.arch.vocab_size, (3, 9)), GREEDY)
    assert calls and all(calls), f"{calls.count(False)} of {len(calls)} layer calls fell back"


def test_a_compile_that_fails_without_the_instruction_set_checks_retries_with_them(monkeypatch):
    """Where kvpush's own kernels built with -march=native, inductor's per-instruction-set test builds are
    skipped; should the compile then fail (a compiler that lacks a set the CPU has), it is retried once with
    the checks before giving up."""
    from kvpush.engine import compiler

    calls: list[bool] = []

    def attempt(model, cpp_wrapper, skip_isa_checks, warm_up):
        calls.append(skip_isa_checks)
        if skip_isa_checks:
            raise RuntimeError("no such instruction set")

    monkeypatch.setattr(compiler, "_compile_and_warm_up", attempt)
    monkeypatch.setattr(compiler, "_toolchain_builds_native", lambda: True)
    monkeypatch.setattr(torch._dynamo, "reset", lambda: None)  # other tests' compiled engines keep their graphs
    model = torch.nn.Linear(2, 2)
    assert compiler.compile_model(model, CompileMode.ON, lambda tokens: None)  # type: ignore[arg-type]
    assert calls == [True, False]
    calls.clear()
    monkeypatch.setattr(compiler, "_toolchain_builds_native", lambda: False)
    assert compiler.compile_model(model, CompileMode.ON, lambda tokens: None)  # type: ignore[arg-type]
    assert calls == [False]
