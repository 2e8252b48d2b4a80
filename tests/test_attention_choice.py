"""Decode and prefill attention's two paths each (layers/attention.py: the C kernels, SDPA) and the start-up
choices between them (engine/attention_choice.py): greedy parity with each one forced, eager and compiled;
calibration's decision, cache and key on fake timings; a real calibration on tiny shapes; the flag and
`kvpush env`. No test asserts a speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_engine import ATOL, generate, ours_logits, prompts

from kvpush.bench import machine
from kvpush.cli import build_parser
from kvpush.config import (
    CacheConfig,
    CompileMode,
    DecodeAttention,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from kvpush.engine import attention_choice as ac
from kvpush.engine.engine import LLMEngine
from kvpush.engine.llm import build_engine_config
from kvpush.errors import ModelLoadError
from kvpush.flags import engine_config_from_args
from kvpush.layers.cpu_kernels import paged_decode_kernel

pytestmark = pytest.mark.skipif(paged_decode_kernel() is None, reason="no C compiler: no kernel to choose")
CPU = {"model": "Test CPU", "vendor": "X", "family": "6", "model_number": "1", "stepping": "0", "arch": "x86_64",
       "vector_flags": ["avx2"]}
SHAPES = ac.Shapes(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4)


def attention_engine(model: str, path: str, compile_mode: str = "off", prefill: str | None = None) -> LLMEngine:
    """Decode rows on `path`, prefill chunks on `prefill` (default: `path` too)."""
    return LLMEngine(EngineConfig(ModelConfig(model), CacheConfig(block_size=4, num_blocks=256),
                                  SchedulerConfig(16, 200, True), compile=CompileMode(compile_mode),
                                  decode_attention=DecodeAttention(path),
                                  prefill_attention=DecodeAttention(prefill or path)))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("path", ["kernel", "sdpa"])
def test_each_path_matches_transformers(arch, path, tiny_model, llama_model):
    from transformers import AutoModelForCausalLM

    model = tiny_model if arch == "qwen3" else llama_model
    eng = attention_engine(model, path)
    assert eng.attention_choice.path is DecodeAttention(path) and eng.attention_choice.source == "flag"
    assert (eng.runner.decode_kernel is not None) == (path == "kernel")
    assert (eng.runner.prefill_kernel is not None) == (path == "kernel") and eng.prefill_choice.source == "flag"
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    prompt = prompts(eng.arch.vocab_size, (21,))[0]
    [ours] = generate(eng, [prompt])
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        hf_logits = hf(torch.tensor([prompt + ours])).logits[0]
    assert ours == ref
    assert (ours_logits(eng, prompt + ours) - hf_logits).abs().max().item() < ATOL["cpu"]


@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_both_paths_give_the_same_greedy_batches(tiny_model, compile_mode):
    """Continuous batches of decodes beside prefill chunks, contexts over several blocks, a prompt longer than
    a step's token budget (chunks after earlier context); each prefill path beside each decode path."""
    ps = prompts(attention_engine(tiny_model, "sdpa").arch.vocab_size, (1, 4, 7, 13, 30, 90, 600))
    expected = generate(attention_engine(tiny_model, "sdpa", compile_mode), ps)
    for decode, prefill in (("kernel", "kernel"), ("kernel", "sdpa"), ("sdpa", "kernel")):
        assert generate(attention_engine(tiny_model, decode, compile_mode, prefill), ps) == expected


@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_the_prefill_kernel_serves_every_chunk(tiny_model, compile_mode):
    """With the kernel chosen, every prefill chunk goes through it (none declines back to SDPA), eager and
    compiled: a fresh prompt and a 600-token one in 200-token chunks, its last chunks after 400 tokens of
    context, across the kernel's 512-key chunks."""
    eng = attention_engine(tiny_model, "kernel", compile_mode)
    kernel, served = eng.runner.prefill_kernel, []
    assert kernel is not None

    def spy(q, k, v, scale):
        out = kernel(q, k, v, scale)
        served.append((q.shape[0], k.shape[0], out is not None))
        return out

    eng.runner.prefill_kernel = spy
    generate(eng, prompts(eng.arch.vocab_size, (5, 600)))
    assert served and all(ok for *_, ok in served)
    assert (5, 5, True) in served and any(ctx > 512 and ctx > rows for rows, ctx, _ in served)


def test_a_head_size_the_prefill_kernel_cannot_take(tmp_path):
    """head_dim not a multiple of the kernel's vector width: auto says why and takes SDPA, kernel forced
    refuses to start (instead of falling back on every chunk while claiming the kernel)."""
    from kvpush.layers.cpu_kernels import prefill_attention

    width = prefill_attention().width
    odd = ac.Shapes(4, 2, width + 4, 4)
    auto = choose(tmp_path, FakeMeasure(0.5, 1.0), shapes=odd, op="prefill")
    assert auto.path is DecodeAttention.SDPA and auto.source == "unavailable" and "multiple of" in auto.line()
    with pytest.raises(ModelLoadError, match=f"--prefill-attention kernel: the C prefill kernel needs head_dim a "
                                             f"multiple of {width}"):
        choose(tmp_path, None, DecodeAttention.KERNEL, shapes=odd, op="prefill")
    assert choose(tmp_path, FakeMeasure(0.5, 1.0), shapes=odd).path is DecodeAttention.KERNEL  # decode takes it


class FakeMeasure:
    def __init__(self, kernel_ms: float, sdpa_ms: float) -> None:
        self.kernel, self.sdpa, self.calls = kernel_ms, sdpa_ms, 0

    def __call__(self, shapes, dtype, kernel) -> ac.Timings:
        assert kernel is not None
        self.calls += 1
        return {w.name: (self.kernel, self.sdpa) for w in ac.WORKLOADS}


def choose(cache: Path, measure, requested=DecodeAttention.AUTO, shapes=SHAPES, dtype=torch.float32, device="cpu",
           cpu=CPU, op="decode") -> ac.AttentionChoice:
    return ac.choose(requested, shapes, dtype, torch.device(device), cpu=cpu, cache_dir=str(cache), measure=measure,
                     op=ac._decode_op() if op == "decode" else ac._prefill_op())


@pytest.mark.parametrize(("kernel", "sdpa", "expected"), [(1.0, 0.5, "sdpa"), (0.5, 1.0, "kernel"),
                                                          (1.0, 0.99, "kernel")])  # within MARGIN: the kernel
def test_calibration_picks_the_faster(tmp_path, kernel, sdpa, expected):
    choice = choose(tmp_path, FakeMeasure(kernel, sdpa))
    assert choice.path.value == expected and choice.source == "measured"
    assert (choice.kernel is not None) == (expected == "kernel")
    assert f"decode attention: {expected} (measured in" in choice.line()


def test_calibration_is_cached_and_keyed(tmp_path):
    first = choose(tmp_path, FakeMeasure(1.0, 0.5))
    entry = json.loads(Path(first.file or "").read_text())
    assert entry["path"] == "sdpa" and entry["key"]["cpu"]["model"] == "Test CPU"
    assert entry["key"]["shapes"] == [4, 2, 16, 4] and entry["key"]["torch"] == str(torch.__version__)
    never = FakeMeasure(0.5, 1.0)
    again = choose(tmp_path, never)
    assert (again.path, again.source, again.timings, never.calls) == (DecodeAttention.SDPA, "cached", first.timings, 0)
    assert "cached from" in again.line()
    others = ({"shapes": ac.Shapes(8, 2, 16, 4)}, {"shapes": ac.Shapes(4, 2, 16, 16)},
              {"cpu": {**CPU, "model_number": "2"}})
    for change in others:
        slow = FakeMeasure(0.5, 1.0)
        assert choose(tmp_path, slow, **change).path is DecodeAttention.KERNEL and slow.calls == 1
    Path(first.file or "").write_text("{not json")  # a broken file is measured again
    assert choose(tmp_path, FakeMeasure(0.5, 1.0)).source == "measured"
    entry = json.loads(Path(first.file or "").read_text())
    Path(first.file or "").write_text(json.dumps({**entry, "timings": {}}))  # one this module would not write
    assert choose(tmp_path, FakeMeasure(0.5, 1.0)).source == "measured"
    assert len(list(tmp_path.glob("decode-attention-*.json"))) == 4


def test_forced_paths_dtypes_and_devices(tmp_path):
    never = FakeMeasure(1.0, 1.0)
    assert choose(tmp_path, never, DecodeAttention.SDPA).path is DecodeAttention.SDPA
    forced = choose(tmp_path, never, DecodeAttention.KERNEL)
    assert forced.path is DecodeAttention.KERNEL and forced.kernel is not None and "forced" in forced.line()
    for requested in DecodeAttention:  # a GPU attends with SDPA whatever the flag says
        cuda = choose(tmp_path, never, requested, device="cuda")
        assert cuda.path is DecodeAttention.SDPA and "SDPA on cuda" in cuda.line()
    bf16 = choose(tmp_path, never, dtype=torch.bfloat16)
    assert bf16.path is DecodeAttention.SDPA and bf16.source == "unavailable" and "fp32" in bf16.line()
    with pytest.raises(ModelLoadError, match="--decode-attention kernel: the C kernel reads fp32 caches; this one is "
                                             "bfloat16"):
        choose(tmp_path, never, DecodeAttention.KERNEL, dtype=torch.bfloat16)
    assert never.calls == 0 and not list(tmp_path.iterdir())


def test_a_failed_calibration_keeps_the_kernel(tmp_path):
    def broken(*args) -> ac.Timings:
        raise RuntimeError("no SDPA for this shape\nmore")

    choice = choose(tmp_path, broken)
    assert choice.path is DecodeAttention.KERNEL and choice.kernel is not None
    assert choice.line() == "decode attention: kernel (kernel; calibration failed: no SDPA for this shape)"
    assert not list(tmp_path.glob("*.json"))  # nothing cached: the next start measures again


def test_real_calibration_on_tiny_shapes(tmp_path):
    """Both paths run on every workload over a scattered scratch cache; no speed asserted."""
    choice = choose(tmp_path, None)
    assert choice.source == "measured" and set(choice.timings) == {w.name for w in ac.WORKLOADS}
    assert all(k > 0 and s > 0 for k, s in choice.timings.values())


def test_an_engine_calibrates_once_then_reads_the_cache(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first, second = (attention_engine(tiny_model, "auto").attention_choice for _ in range(2))
    assert (first.source, second.source) == ("measured", "cached") and first.path is second.path
    assert first.file == second.file and Path(first.file or "").is_relative_to(tmp_path)


def test_env_reports_the_cached_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPUSH_DECODE_ATTENTION", "auto")
    assert "not calibrated" in machine.decode_attention(str(tmp_path))
    choose(tmp_path, FakeMeasure(1.0, 0.5), cpu=machine.cpu())
    text = machine.decode_attention(str(tmp_path))
    assert text.startswith("auto, cached: sdpa for heads/kv heads/head_dim/block 4/2/16/4 (float32; sdpa/kernel 0.50")
    monkeypatch.setenv("KVPUSH_DECODE_ATTENTION", "sdpa")
    assert machine.decode_attention(str(tmp_path)).startswith("sdpa (forced by $KVPUSH_DECODE_ATTENTION)")


def test_the_flag(monkeypatch, capsys):
    def config(*flags: str) -> EngineConfig:
        return engine_config_from_args(build_parser().parse_args(["serve", "m", *flags]))

    assert config("--decode-attention", "sdpa").decode_attention is DecodeAttention.SDPA
    monkeypatch.setenv("KVPUSH_DECODE_ATTENTION", "auto")
    assert config().decode_attention is DecodeAttention.AUTO
    with pytest.raises(SystemExit):
        config("--decode-attention", "flash")
    assert "invalid choice: 'flash'" in capsys.readouterr().err
    monkeypatch.setenv("KVPUSH_DECODE_ATTENTION", "flash")
    with pytest.raises(SystemExit, match="decode attention 'flash': expected one of auto, kernel, sdpa"):
        config()
    assert build_engine_config("m", decode_attention="sdpa").decode_attention is DecodeAttention.SDPA
    with pytest.raises(ValueError, match="decode attention 'flash': expected one of auto, kernel, sdpa"):
        build_engine_config("m", decode_attention="flash")


def test_a_changed_kernel_is_measured_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The cached choice is keyed by the kernel's source: after the kernel changes, start-up measures again."""
    from kvpush.layers import cpu_kernels

    shapes = ac.Shapes(6, 3, 64, 16)
    before = ac.cache_key({"model name": "x"}, shapes, torch.float32, 1)
    changed = tmp_path / "paged_decode.c"
    changed.write_text(cpu_kernels.SOURCE.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", changed)
    after = ac.cache_key({"model name": "x"}, shapes, torch.float32, 1)
    assert before["kernel"] != after["kernel"] and {k: v for k, v in before.items() if k != "kernel"} == \
        {k: v for k, v in after.items() if k != "kernel"}


def test_the_prefill_choice_is_its_own(tmp_path):
    """--prefill-attention: calibrated on its own workloads into its own cache files, forced by its own flag;
    a real calibration runs both paths on every prefill workload (no speed asserted)."""
    choice = choose(tmp_path, None, op="prefill")
    assert choice.source == "measured" and set(choice.timings) == {w.name for w in ac.PREFILL_WORKLOADS}
    assert all(k > 0 and s > 0 for k, s in choice.timings.values())
    assert choice.line().startswith(f"prefill attention: {choice.path.value} (measured in")
    assert len(list(tmp_path.glob("prefill-attention-*.json"))) == 1 and not list(tmp_path.glob("decode-*"))
    assert choose(tmp_path, FakeMeasure(0.5, 1.0), op="prefill").source == "cached"
    assert choose(tmp_path, FakeMeasure(0.5, 1.0)).source == "measured"  # decode: another file
    forced = choose(tmp_path, None, DecodeAttention.KERNEL, op="prefill")
    assert forced.kernel is not None and forced.line() == "prefill attention: kernel (forced by --prefill-attention)"
    with pytest.raises(ModelLoadError, match="--prefill-attention kernel: the C kernel reads fp32"):
        choose(tmp_path, None, DecodeAttention.KERNEL, dtype=torch.bfloat16, op="prefill")
    prefill_key = ac.cache_key(CPU, SHAPES, torch.float32, 1, ac._prefill_op())
    assert prefill_key["kernel"] != ac.cache_key(CPU, SHAPES, torch.float32, 1)["kernel"]  # each kernel's source


def test_the_prefill_flag_and_env(tmp_path, monkeypatch):
    def config(*flags: str) -> EngineConfig:
        return engine_config_from_args(build_parser().parse_args(["serve", "m", *flags]))

    assert config("--prefill-attention", "sdpa").prefill_attention is DecodeAttention.SDPA
    monkeypatch.setenv("KVPUSH_PREFILL_ATTENTION", "flash")
    with pytest.raises(SystemExit, match=r"\$KVPUSH_PREFILL_ATTENTION: prefill attention 'flash': expected one of"):
        config()
    assert build_engine_config("m", prefill_attention="sdpa").prefill_attention is DecodeAttention.SDPA
    monkeypatch.setenv("KVPUSH_PREFILL_ATTENTION", "auto")
    monkeypatch.setenv("KVPUSH_DECODE_ATTENTION", "auto")
    assert "not calibrated" in machine.decode_attention(str(tmp_path), op="prefill")
    choose(tmp_path, FakeMeasure(1.0, 0.5), cpu=machine.cpu(), op="prefill")
    assert machine.decode_attention(str(tmp_path), op="prefill").startswith("auto, cached: sdpa for heads/kv heads")
    assert "not calibrated" in machine.decode_attention(str(tmp_path))  # the decode choice is apart
    monkeypatch.setenv("KVPUSH_PREFILL_ATTENTION", "sdpa")
    assert machine.decode_attention(op="prefill").startswith("sdpa (forced by $KVPUSH_PREFILL_ATTENTION)")
