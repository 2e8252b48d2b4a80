"""The soak's periodic load: one period's schedule replayed every period, same prompt kinds and lengths at
each position, fresh contents; the drift figure pairs the last period's requests with the second's."""

from __future__ import annotations

from kvpush.bench.soak import SoakConfig, paired_drift, period_plan, period_samples


def test_plan_is_poisson_within_the_period_and_reproducible():
    plan = period_plan(rate=4.0, period_s=50.0, disconnect_share=0.1, seed=3)
    offsets = [t for t, _ in plan]
    assert offsets == sorted(offsets) and 0 < offsets[0] and offsets[-1] < 50.0
    assert 120 < len(plan) < 280  # ~200 arrivals
    assert 0 < sum(d for _, d in plan) < len(plan)
    assert plan == period_plan(rate=4.0, period_s=50.0, disconnect_share=0.1, seed=3)
    assert plan != period_plan(rate=4.0, period_s=50.0, disconnect_share=0.1, seed=4)


def test_every_period_has_the_same_lengths_and_fresh_contents():
    cfg = SoakConfig(model="m", input_len=32, output_len=4)
    a, b = period_samples(cfg, 40, 1), period_samples(cfg, 40, 5)
    assert [s.prompt_len for s in a] == [s.prompt_len for s in b]
    assert len({s.prompt_len for s in a}) > 2  # short, long and growing session turns
    assert all(x.prompt != y.prompt for x, y in zip(a, b, strict=True))


def test_drift_pairs_the_last_period_with_the_second():
    by_slot = {(k, j): 0.1 * (1 + j % 3) * (1.5 if k == 5 else 1.0) for k in range(6) for j in range(30)}
    del by_slot[(5, 7)]  # answered in one period only: not paired
    d = paired_drift(by_slot, periods=6)
    assert d["paired"] == 29
    assert abs(d["paired_ratio"] - 1.5) < 1e-9
    low, high = d["paired_ratio_ci95"]
    assert low <= 1.5 <= high
    assert paired_drift(by_slot, periods=2) == {"paired": 0}
