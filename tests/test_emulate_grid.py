"""A measured clock's grid (kvpush/emulate/grid.py): the clock follows the measured steps where its
formula misses, between them it reads the nearest, and mixed steps cost what the grid's did beyond their
parts. A model of time, checked on made-up numbers: nothing here times anything."""

from __future__ import annotations

import copy

import pytest

from kvpush.emulate.grid import GridPoint, coordinates, family
from kvpush.emulate.profile import ProfileError, StepClock, load_profile, parse_profile

LINEAR = StepClock(step_overhead_s=1e-3, prefill_overhead_s=2e-3, per_token_s=1e-4, per_pair_s=0.0, per_step_s=0.0,
                   per_context_token_s=1e-5, combine="sum")


def decode(batch: int, context: int) -> tuple[tuple[int, int], ...]:
    return ((1, context),) * batch


def with_grid(*points: tuple[tuple[tuple[int, int], ...], float]) -> StepClock:
    """LINEAR following points given as (step, measured / formula)."""
    import dataclasses

    grid = tuple(GridPoint(seqs, ratio * LINEAR.formula_time(seqs)) for seqs, ratio in points)
    return dataclasses.replace(LINEAR, grid=grid)


def test_families_and_coordinates():
    assert family(((512, 512),)) == "prefill" and family(decode(4, 64)) == "decode"
    assert family(((256, 256), (1, 64))) == "mixed"
    assert coordinates(((256, 1280),)) == (8.0, pytest.approx(10.0007, abs=1e-3))  # 256 tokens after 1,024
    assert coordinates(decode(16, 128)) == (4.0, 7.0)
    assert coordinates(((512, 512), (1, 64), (1, 64))) == (9.0, 1.0)


def test_the_clock_is_what_it_measured_at_every_grid_point():
    steps = [((512, 512),), ((256, 1280),), decode(1, 1024), decode(16, 128), ((512, 512), *decode(4, 512))]
    clock = with_grid(*((s, r) for s, r in zip(steps, (0.9, 1.1, 1.25, 0.8, 1.4), strict=True)))
    for point in clock.grid:
        assert clock.step_time(point.seqs) == pytest.approx(point.measured_s, rel=1e-12)


def test_between_two_points_it_reads_between_their_ratios():
    clock = with_grid((decode(1, 64), 1.0), (decode(1, 1024), 1.2))
    ratio = clock.step_time(decode(1, 256)) / LINEAR.formula_time(decode(1, 256))
    assert 1.0 < ratio < 1.2
    # nearer 1,024 in log2 context reads nearer its ratio
    assert clock.step_time(decode(1, 768)) / LINEAR.formula_time(decode(1, 768)) > ratio


def test_beyond_the_grid_and_without_a_family_it_stays_in_bounds():
    clock = with_grid((decode(1, 64), 0.9), (decode(8, 512), 1.3), (((512, 512),), 0.95))
    far = decode(64, 4096)
    assert 0.9 <= clock.step_time(far) / LINEAR.formula_time(far) <= 1.3
    only_decodes = with_grid((decode(1, 64), 0.9))
    assert only_decodes.step_time(((128, 128),)) == pytest.approx(LINEAR.formula_time(((128, 128),)))  # no prefill point


def test_a_mixed_step_weighs_its_parts_then_adds_what_mixed_steps_cost():
    prefill, decodes = ((512, 512),), decode(4, 512)
    parts_only = with_grid((prefill, 1.0), (decodes, 2.0))
    mixed = prefill + decodes
    fp, fd = LINEAR.formula_time(prefill), LINEAR.formula_time(decodes)
    expected = (fp * 1.0 + fd * 2.0) / (fp + fd)
    assert parts_only.step_time(mixed) == pytest.approx(LINEAR.formula_time(mixed) * expected, rel=1e-12)
    with_mixed = with_grid((prefill, 1.0), (decodes, 2.0), (mixed, 1.5 * expected))
    other = ((512, 512), *decode(4, 256))  # the same coordinates (prefill tokens, sequences decoding)
    parts = parts_only.step_time(other)
    assert with_mixed.step_time(other) == pytest.approx(1.5 * parts, rel=1e-9)


def _measured_raw() -> dict:
    raw = copy.deepcopy(load_profile("qwen3-8b-h100").to_json())
    raw["clock"]["grid"] = [{"seqs": [[512, 512]], "measured_s": 0.05}, {"seqs": [[1, 64], [1, 64]], "measured_s": 0.01}]
    raw["sources"]["clock.grid"] = "made up for a test"
    return raw


def test_a_grid_round_trips_and_changes_the_fingerprint():
    raw = _measured_raw()
    profile = parse_profile(raw)
    assert profile.clock.grid == (GridPoint(((512, 512),), 0.05), GridPoint(((1, 64), (1, 64)), 0.01))
    assert profile.clock.step_time([(512, 512)]) == pytest.approx(0.05)
    again = parse_profile(profile.to_json())
    assert again.clock == profile.clock and again.fingerprint == profile.fingerprint
    assert profile.fingerprint != load_profile("qwen3-8b-h100").fingerprint


@pytest.mark.parametrize("edit, message", [
    (lambda raw: raw["clock"].__setitem__("grid", {"seqs": []}), "'clock.grid' must be a list"),
    (lambda raw: raw["clock"]["grid"][1].__setitem__("measured_s", 0), "'clock.grid[1].measured_s' must be a positive"),
    (lambda raw: raw["clock"]["grid"][0].__setitem__("seqs", [[600, 512]]), "'clock.grid[0].seqs' must be"),
    (lambda raw: raw["clock"]["grid"][0].__setitem__("seqs", []), "'clock.grid[0].seqs' must be"),
    (lambda raw: raw["sources"].pop("clock.grid"), "sources names no source for clock.grid"),
])
def test_a_malformed_grid_names_the_field(edit, message):
    raw = _measured_raw()
    edit(raw)
    with pytest.raises(ProfileError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_profile(raw)
