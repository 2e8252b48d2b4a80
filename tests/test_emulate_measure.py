"""`kvpush profile` (kvpush/emulate/measure.py): the fit recovers a clock it was given, and a measured
profile of the tiny model is a profile `--emulate` serves with. Nothing here asserts a speed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvpush.cli import main
from kvpush.emulate.measure import FEATURES, Point, fit, grid, nnls
from kvpush.emulate.profile import StepClock, load_profile
from kvpush.engine.llm import LLM
from kvpush.engine.sampling_params import SamplingParams
from kvpush.models.arch import load_arch_config


def test_nnls_keeps_every_coefficient_at_or_above_zero():
    rng = np.random.default_rng(0)
    a = rng.random((30, 4))
    truth = np.array([0.5, 0.0, 2.0, 1.0])
    assert np.allclose(nnls(a, a @ truth), truth, atol=1e-9)
    b = a @ np.array([1.0, -3.0, 0.5, 0.0])  # the unconstrained answer has a negative coefficient
    x = nnls(a, b)
    assert (x >= 0).all()
    unconstrained = np.linalg.lstsq(a, b, rcond=None)[0]
    assert np.linalg.norm(a @ x - b) >= np.linalg.norm(a @ unconstrained - b) - 1e-12


def test_the_fit_recovers_the_clock_behind_the_points():
    truth = StepClock(step_overhead_s=4e-4, prefill_overhead_s=1e-3, per_token_s=2e-4, per_pair_s=3e-8,
                      per_step_s=0.0, per_context_token_s=5e-6, combine="sum")
    points = [Point(step, truth.step_time(step)) for step in grid(4096)]
    got = fit(points)
    assert got.combine == "sum" and got.per_step_s == 0.0
    for name in FEATURES:
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-12), name


def test_profile_of_the_tiny_model_serves_with_emulate(tiny_model, tmp_path, capsys):
    out = tmp_path / "tiny-cpu.json"
    assert main(["profile", tiny_model, "-o", str(out), "--quick", "--repeats", "1", "--compile", "off",
                 "--torch-threads", "1", "--link-gbps", "25"]) == 0
    printed = capsys.readouterr().out
    assert "prefill 64 after 64" in printed and f"wrote {out}" in printed
    profile = load_profile(str(out))
    arch = load_arch_config(tiny_model)
    assert (profile.kv.num_layers, profile.kv.num_kv_heads, profile.kv.head_dim, profile.kv.dtype) == (
        arch.num_layers, arch.num_kv_heads, arch.head_dim, "float32")
    assert profile.name == "tiny-cpu" and profile.device == "cpu" and profile.link.bandwidth_gbps == 25.0
    assert profile.clock.combine == "sum" and all(getattr(profile.clock, f) >= 0 for f in FEATURES)
    raw = json.loads(out.read_text())
    assert len(raw["derivation"]["grid"]) == len(grid(profile.max_model_len, quick=True))
    assert all(row["measured_s"] > 0 for row in raw["derivation"]["grid"])
    assert "kvpush profile" in raw["sources"]["clock.per_token_s"] and "kvpush profile" in raw["sources"]["clock.grid"]
    steps = grid(profile.max_model_len, quick=True)
    assert [tuple(map(tuple, p["seqs"])) for p in raw["clock"]["grid"]] == steps  # mixed steps included
    assert any(n > 1 for n, _ in steps[-1]) and any(n == 1 for n, _ in steps[-1])
    for point in profile.clock.grid:  # the clock follows what it measured
        assert profile.clock.step_time(point.seqs) == pytest.approx(point.measured_s, rel=1e-9)
    llm = LLM(tiny_model, emulate=str(out), num_blocks=64)
    [answer] = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=3, temperature=0))
    assert len(answer.token_ids) == 3


def test_profile_refuses_emulate(tiny_model, tmp_path):
    with pytest.raises(SystemExit, match="does not take --emulate"):
        main(["profile", tiny_model, "-o", str(tmp_path / "x.json"), "--emulate", "qwen3-8b-h100"])
