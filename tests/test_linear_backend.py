"""The linear layers' two backends (layers/linear.py) and the start-up choice between them
(engine/linear_choice.py): greedy parity with each one forced, eager and compiled; one copy of the
weights; calibration's decision, cache and key on fake timings; the flag. No test asserts a speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from test_engine import ATOL, engine, generate, ours_logits, prompts
from torch import nn

from kvpush.bench import machine
from kvpush.cli import build_parser
from kvpush.config import CacheConfig, CompileMode, EngineConfig, LinearBackend, ModelConfig, SchedulerConfig
from kvpush.engine import linear_choice as lc
from kvpush.engine.engine import LLMEngine
from kvpush.engine.llm import build_engine_config
from kvpush.errors import DeviceError
from kvpush.flags import engine_config_from_args
from kvpush.layers.linear import PackedLinear, linear_modules, residual_linear
from kvpush.models.arch import load_arch_config
from kvpush.models.decoder import CausalLM

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


def backend_engine(model: str, backend: str, compile_mode: str = "off") -> LLMEngine:
    return LLMEngine(EngineConfig(ModelConfig(model), CacheConfig(block_size=4, num_blocks=256),
                                  SchedulerConfig(16, 200, True), compile=CompileMode(compile_mode),
                                  linear_backend=LinearBackend(backend)))


@pytest.fixture(scope="module")
def reference(tiny_model) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and the greedy tokens of plain linears, eager."""
    eng = engine(tiny_model)
    ps = prompts(eng.arch.vocab_size, (1, 4, 7, 13, 30, 90))
    return ps, generate(eng, ps)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("backend", ["mkl", "onednn"])
def test_each_backend_matches_transformers(arch, backend, tiny_model, llama_model):
    from transformers import AutoModelForCausalLM

    path = tiny_model if arch == "qwen3" else llama_model
    eng = backend_engine(path, backend)
    assert eng.linear_choice.backend is LinearBackend(backend) and eng.linear_choice.source == "flag"
    packed = [m for m in linear_modules(eng.model) if isinstance(m, PackedLinear)]
    assert (len(packed) > 0) == (backend == "onednn")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = prompts(eng.arch.vocab_size, (21,))[0]
    [ours] = generate(eng, [prompt])
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        hf_logits = hf(torch.tensor([prompt + ours])).logits[0]
    assert ours == ref
    assert (ours_logits(eng, prompt + ours) - hf_logits).abs().max().item() < ATOL["cpu"]


def test_onednn_greedy_equals_plain_batched_and_chunked(tiny_model, reference):
    ps, expected = reference
    eng = backend_engine(tiny_model, "onednn")
    assert generate(eng, ps) == expected  # one continuous batch, 90 tokens in chunks beside decodes
    assert [generate(eng, [p])[0] for p in ps[3:5]] == expected[3:5]  # one at a time


def test_onednn_compiled_equals_eager_and_plain(tiny_model, reference):
    ps, expected = reference
    eng = backend_engine(tiny_model, "onednn", "on")
    assert eng.runner.compiled
    graphs = eng.runner.num_compiled_graphs
    assert generate(eng, ps) == expected
    assert generate(eng, [ps[0]]) == expected[:1]  # a one-token batch: the other graph
    assert eng.runner.num_compiled_graphs == graphs  # the opaque op compiled into the warm-up's graphs
    tokens = ps[5] + expected[5]
    eager = backend_engine(tiny_model, "onednn")
    # the same oneDNN products; inductor fuses the elementwise ops around them in its own order
    assert (ours_logits(eng, tokens) - ours_logits(eager, tokens)).abs().max().item() < ATOL["cpu"]


def test_handles_do_not_depend_on_calibration(tiny_model):
    """Compiled graphs hold the op's handles as constants (inductor's cache key): a model packed after a
    calibration gets the handles it would get without one."""
    def handles() -> list[int]:
        return [m.handle for m in linear_modules(backend_engine(tiny_model, "onednn").model)
                if isinstance(m, PackedLinear)]

    before = handles()
    lc.measure_backends(lc.model_shapes(meta_model(tiny_model)), torch.float32, True, False)
    assert handles() == before


def test_packing_keeps_one_copy_of_the_weights(tiny_model):
    plain, packed = backend_engine(tiny_model, "mkl"), backend_engine(tiny_model, "onednn")
    linears = [m for m in linear_modules(plain.model) if isinstance(m, nn.Linear)]
    tied = plain.arch.tie_word_embeddings  # a tied LM head stays plain: the embedding reads its weight
    weights = sum(m.weight.numel() for m in linears if not (tied and m is plain.model.lm_head))
    n_params = sum(p.numel() for p in plain.model.parameters())
    assert sum(p.numel() for p in packed.model.parameters()) == n_params - weights
    assert all(isinstance(m, PackedLinear) for m in linear_modules(packed.model)
               if not (tied and m is packed.model.lm_head))


def test_packed_linear_with_bias_and_batch_dims():
    torch.manual_seed(0)
    linear = nn.Linear(48, 80)
    x = torch.randn(2, 5, 48)
    residual = torch.randn(2, 5, 80)
    with torch.no_grad():
        expected = linear(x)
        packed = PackedLinear(linear)
        assert (packed(x) - expected).abs().max().item() < 1e-5
        assert (residual_linear(packed, x, residual) - (residual + expected)).abs().max().item() < 1e-5
        assert torch.equal(residual_linear(linear, x, residual), residual + expected)


# ---- the choice ------------------------------------------------------------------------------------

CPU = {"model": "Test CPU", "vendor": "V", "family": "25", "model_number": "17", "stepping": "1", "arch": "x86_64",
       "vector_flags": ["avx2"]}


class FakeMeasure:
    """Timings given per workload as (mkl ms, onednn ms); counts its calls."""

    def __init__(self, mkl: float, onednn: float) -> None:
        self.mkl, self.onednn, self.calls = mkl, onednn, 0

    def __call__(self, shapes, dtype, through_op, huge_pages) -> lc.Timings:
        self.calls += 1
        return {w.name: (self.mkl, self.onednn) for w in lc.WORKLOADS}


def meta_model(path: str) -> CausalLM:
    with torch.device("meta"):
        return CausalLM(load_arch_config(path), 1)


def choose(model: nn.Module, cache: Path, measure, cpu=CPU, requested=LinearBackend.AUTO, **kw) -> lc.Choice:
    args = {"through_op": False, "huge_pages": True, **kw}
    return lc.choose(requested, model, torch.float32, torch.device("cpu"), cpu=cpu, cache_dir=str(cache),
                     measure=measure, label="m", **args)


@pytest.mark.parametrize(("mkl", "onednn", "expected"), [(10.0, 6.0, "onednn"), (6.0, 10.0, "mkl"),
                                                         (10.0, 9.9, "mkl")])  # within MARGIN: a tie, mkl
def test_calibration_picks_the_faster(tiny_model, tmp_path, mkl, onednn, expected):
    choice = choose(meta_model(tiny_model), tmp_path, FakeMeasure(mkl, onednn))
    assert choice.backend.value == expected and choice.source == "measured"
    assert f"linear backend: {expected} (measured in" in choice.line()


def test_calibration_is_cached_and_reused(tiny_model, tmp_path):
    model, fast = meta_model(tiny_model), FakeMeasure(10.0, 5.0)
    first = choose(model, tmp_path, fast)
    assert first.source == "measured" and first.path is not None and Path(first.path).exists()
    entry = json.loads(Path(first.path).read_text())
    assert entry["backend"] == "onednn" and entry["key"]["cpu"]["model"] == "Test CPU"
    assert entry["key"]["torch"] == str(torch.__version__)
    again = choose(model, tmp_path, FakeMeasure(5.0, 10.0))  # would choose mkl if it measured
    assert (again.backend, again.source, again.timings) == (LinearBackend.ONEDNN, "cached", first.timings)
    assert "cached from" in again.line() and fast.calls == 1


def test_calibration_measures_again_when_the_key_differs(tiny_model, llama_model, tmp_path):
    model = meta_model(tiny_model)
    choose(model, tmp_path, FakeMeasure(10.0, 5.0))
    for change in ({"cpu": {**CPU, "model_number": "97"}}, {"through_op": True}, {"huge_pages": False}):
        slow = FakeMeasure(5.0, 10.0)
        assert choose(model, tmp_path, slow, **change).source == "measured" and slow.calls == 1
    slow = FakeMeasure(5.0, 10.0)
    assert choose(meta_model(llama_model), tmp_path, slow).backend is LinearBackend.MKL  # other shapes
    torch.set_num_threads(2)
    try:
        assert choose(model, tmp_path, FakeMeasure(5.0, 10.0)).source == "measured"  # other thread count
    finally:
        torch.set_num_threads(1)
    assert len(list(tmp_path.glob("linear-*.json"))) == 6


def test_engines_starting_together_measure_once(tiny_model, tmp_path):
    model = meta_model(tiny_model)

    class Slow(FakeMeasure):
        def __call__(self, *args) -> lc.Timings:
            time.sleep(0.3)
            return super().__call__(*args)

    slow = Slow(10.0, 5.0)
    with ThreadPoolExecutor(3) as pool:
        choices = list(pool.map(lambda _: choose(model, tmp_path, slow), range(3)))
    assert slow.calls == 1 and sorted(c.source for c in choices) == ["cached", "cached", "measured"]


def test_a_broken_cache_file_is_measured_again(tiny_model, tmp_path):
    model = meta_model(tiny_model)
    path = Path(choose(model, tmp_path, FakeMeasure(10.0, 5.0)).path or "")
    path.write_text("{not json")
    assert choose(model, tmp_path, FakeMeasure(5.0, 10.0)).backend is LinearBackend.MKL


def test_forced_backends_and_other_devices_do_not_measure(tiny_model, tmp_path):
    model, never = meta_model(tiny_model), FakeMeasure(1.0, 1.0)
    for backend in (LinearBackend.MKL, LinearBackend.ONEDNN):
        assert choose(model, tmp_path, never, requested=backend).backend is backend
    cuda = lc.choose(LinearBackend.AUTO, model, torch.float32, torch.device("cuda"), cpu=CPU, cache_dir=str(tmp_path),
                     through_op=False, huge_pages=False, measure=never)
    assert cuda.backend is LinearBackend.MKL and "cuda" in cuda.line()
    with pytest.raises(DeviceError, match="--linear-backend onednn"):
        lc.choose(LinearBackend.ONEDNN, model, torch.float32, torch.device("cuda"), cpu=CPU,
                  cache_dir=str(tmp_path), through_op=False, huge_pages=False)
    assert never.calls == 0 and not list(tmp_path.iterdir())


def test_real_calibration_on_tiny_shapes(tiny_model, tmp_path):
    """measure_backends runs both backends (plain and through the op) on every workload; no speed asserted."""
    shapes = lc.timed_shapes(lc.model_shapes(meta_model(tiny_model)), torch.float32)
    for through_op in (False, True):
        timings = lc.measure_backends(shapes, torch.float32, through_op, True)
        assert set(timings) == {w.name for w in lc.WORKLOADS}
        assert all(m > 0 and o > 0 for m, o in timings.values())


def test_calibration_is_bounded_and_a_large_head_stays_plain():
    shapes = [lc.Shape(1024, 1024, False, False)] * 10 + [lc.Shape(1024, 4096, False, True)]
    timed = lc.timed_shapes(shapes, torch.float32, budget=3 * 4 << 20)  # three 4 MiB layers' worth
    assert timed == shapes[:3] + shapes[-1:]
    assert lc.timed_shapes(shapes[:1], torch.float32, budget=1) == shapes[:1]  # at least one
    big = nn.Module()
    big.proj, big.lm_head = nn.Linear(8, 8, device="meta"), nn.Linear(1024, 40_000, device="meta")  # 164 MB head
    assert [s.logits for s in lc.model_shapes(big)] == [False]


def test_calibration_leaves_inductor_its_cache_directory(tiny_model, tmp_path):
    """Building the meta-device model for calibration imports inductor's config, which fixes its cache
    directory at import: the engine must have named it first (config.apply_compile_environment)."""
    code = ("import os, sys; from kvpush.config import *; from kvpush.engine.engine import LLMEngine; "
            "e = LLMEngine(EngineConfig(ModelConfig(sys.argv[1]), CacheConfig(num_blocks=16), compile=CompileMode.OFF, "
            "linear_backend=LinearBackend.AUTO)); print(e.linear_choice.source, os.environ['TORCHINDUCTOR_CACHE_DIR'])")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", code, tiny_model], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    assert out == ["measured", str(tmp_path / "kvpush" / "inductor")]


def test_env_reports_the_cached_choice(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("KVPUSH_LINEAR_BACKEND", "auto")
    assert "not calibrated" in machine.linear_backend(str(tmp_path))
    choose(meta_model(tiny_model), tmp_path, FakeMeasure(10.0, 5.0), cpu=machine.cpu())
    text = machine.linear_backend(str(tmp_path))
    assert text.startswith("auto, cached: onednn for m (float32, 1 thread;") and "onednn/mkl 0.50" in text
    monkeypatch.setenv("KVPUSH_LINEAR_BACKEND", "mkl")
    assert machine.linear_backend(str(tmp_path)) == "mkl (forced by $KVPUSH_LINEAR_BACKEND)"


# ---- the flag --------------------------------------------------------------------------------------

def test_the_flag(monkeypatch, capsys):
    def config(*flags: str) -> EngineConfig:
        return engine_config_from_args(build_parser().parse_args(["serve", "m", *flags]))

    assert config("--linear-backend", "onednn").linear_backend is LinearBackend.ONEDNN
    monkeypatch.setenv("KVPUSH_LINEAR_BACKEND", "auto")
    assert config().linear_backend is LinearBackend.AUTO
    with pytest.raises(SystemExit):
        config("--linear-backend", "blas")
    assert "invalid choice: 'blas'" in capsys.readouterr().err
    monkeypatch.setenv("KVPUSH_LINEAR_BACKEND", "blas")
    with pytest.raises(SystemExit, match="KVPUSH_LINEAR_BACKEND: linear backend 'blas': expected one of auto, mkl"):
        config()
    assert build_engine_config("m", linear_backend="onednn").linear_backend is LinearBackend.ONEDNN
    with pytest.raises(ValueError, match="linear backend 'blas': expected one of auto, mkl, onednn"):
        build_engine_config("m", linear_backend="blas")
