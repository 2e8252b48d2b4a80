"""The emulation profile format (kvpush/emulate/profile.py), the roofline behind the shipped GPU profiles, and
the published figure qwen3-8b-h100 is held against. Tests of the model, not of this machine's speed."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from kvpush.emulate import published, shipped
from kvpush.emulate.profile import ProfileError, StepClock, load_profile, parse_profile, shipped_names


def _raw(name: str = "qwen3-8b-h100") -> dict:
    return load_profile(name).to_json()


def test_shipped_profiles_load_by_name():
    assert {"qwen3-8b-h100", "qwen3-32b-h200-tp8"} <= set(shipped_names())
    for name in ("qwen3-8b-h100", "qwen3-32b-h200-tp8"):
        assert load_profile(name).name == name


def test_qwen3_32b_tp8_is_seen_per_rank():
    kv = load_profile("qwen3-32b-h200-tp8").kv
    assert (kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.dtype) == (64, 1, 128, "bfloat16")
    assert kv.bytes_per_token == 32 * 1024


def test_qwen3_8b_geometry():
    kv = load_profile("qwen3-8b-h100").kv
    assert (kv.num_layers, kv.num_kv_heads, kv.head_dim) == (36, 8, 128)
    assert kv.bytes_per_token == 144 * 1024


def test_shipped_files_are_what_their_sources_give():
    """The JSON files are regenerated, not edited: `python -m kvpush.emulate.shipped --check`."""
    assert shipped.main(["--check"]) == 0


def test_the_published_vllm_figure_is_reproduced():
    """Qwen3-8B on one H100 under vLLM, ShareGPT at concurrency 4 (GPUStack's performance lab): mean TPOT
    7.38 ms, mean TTFT 64.00 ms. The profile gives the TPOT; its TTFT is the accelerator's part plus the
    front end the profile records, which must be what the published TTFT leaves beyond the accelerator."""
    profile = load_profile("qwen3-8b-h100")
    run = published.GPUSTACK_QWEN3_8B_H100
    got = published.predict(profile.clock, run)
    assert got.tpot_s == pytest.approx(7.38e-3, rel=0.02)
    front_end = profile.derivation["published"]["front_end_s"]
    assert 0 < got.ttft_accelerator_s < run.ttft_s
    assert got.ttft_s(front_end) == pytest.approx(64.0e-3, rel=0.02)
    assert got.prefill_step_s > got.decode_step_s  # the step with a prefill is the longer one


def test_every_clock_constant_names_its_source():
    raw = _raw()
    del raw["sources"]["clock.per_token_s"]
    with pytest.raises(ProfileError, match="clock.per_token_s"):
        parse_profile(raw)


@pytest.mark.parametrize("path, value, message", [
    (("kv", "num_layers"), None, "missing field 'kv.num_layers'"),
    (("kv", "num_layers"), "36", "'kv.num_layers' must be int"),
    (("kv", "num_kv_heads"), 0, "'kv.num_kv_heads' must be at least 1"),
    (("kv", "dtype"), "int4", "kv.dtype must be one of"),
    (("clock", "per_pair_s"), -1.0, "'clock.per_pair_s' must not be negative"),
    (("clock", "combine"), "min", "clock.combine must be one of"),
    (("link", "bandwidth_gbps"), None, "missing field 'link.bandwidth_gbps'"),
    (("format",), "other/1", "format must be"),
])
def test_a_malformed_profile_names_the_field(path, value, message):
    raw = copy.deepcopy(_raw())
    node = raw
    for key in path[:-1]:
        node = node[key]
    if value is None:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    with pytest.raises(ProfileError, match=message.replace("(", r"\(")):
        parse_profile(raw)


def test_unknown_names_and_files(tmp_path):
    with pytest.raises(ProfileError, match="unknown profile 'qwen9'.*qwen3-8b-h100"):
        load_profile("qwen9")
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(str(tmp_path / "none.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="not readable JSON"):
        load_profile(str(bad))


def test_a_profile_file_round_trips(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(_raw("qwen3-32b-h200-tp8")))
    assert load_profile(str(path)) == load_profile("qwen3-32b-h200-tp8")


def test_the_step_clock():
    clock = StepClock(step_overhead_s=1.0, prefill_overhead_s=0.5, per_token_s=0.1, per_pair_s=0.01,
                      per_step_s=2.0, per_context_token_s=0.001, combine="max")
    # prefill of 4 tokens after 6 cached: pairs 4 * 6 + 10 = 34, compute 0.4 + 0.34, memory 2.0 + 0.01
    assert clock.prefill_time(4, context=6) == pytest.approx(1.0 + 0.5 + 2.01)
    # two decodes at contexts 100 and 300: compute 0.2 + 4.0, memory 2.0 + 0.4; no prefill overhead
    assert clock.decode_time([100, 300]) == pytest.approx(1.0 + 4.2)
    summed = StepClock(**{**vars(clock), "combine": "sum"})
    assert summed.decode_time([100, 300]) == pytest.approx(1.0 + 4.2 + 2.4)


def test_serve_refuses_a_bad_profile_before_start_up(tiny_model, tmp_path):
    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvpush.cli", "serve", tiny_model, *args], capture_output=True,
                              text=True, timeout=60)

    out = serve("--emulate", "qwen9")
    assert out.returncode != 0 and "--emulate: unknown profile 'qwen9'" in out.stderr
    raw = _raw()
    del raw["clock"]["per_step_s"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(raw))
    out = serve("--emulate", str(bad))
    assert out.returncode != 0 and "missing field 'clock.per_step_s'" in out.stderr
    out = serve("--emulate", "qwen3-32b-h200-tp8", "--kv-cache-memory-mb", "0")
    assert out.returncode != 0
    out = serve("--emulate", "qwen3-8b-h100", "--kv-cache-memory-mb", "1", "--block-size", "16")
    assert out.returncode != 0 and "does not fit --kv-cache-memory-mb 1" in out.stderr
    out = serve("--emulate", "qwen3-8b-h100", "--time-scale", "0")
    assert out.returncode != 0 and "--time-scale" in out.stderr
