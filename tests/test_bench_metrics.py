"""kvpush.bench.metrics against hand-computed values (numpy's linear percentiles, ddof=0 std)."""

from __future__ import annotations

import math

import pytest

from kvpush.bench.metrics import (
    RequestRecord,
    compute_metrics,
    handover_breakdown,
    meets_slo,
    parse_slo,
    saturation,
    summarize,
    tpot_s,
)

approx = pytest.approx


def ok(index: int, ttft: float, itl: list[float], e2el: float, out: int, prompt: int, at: float = 0.0):
    """A successful record sent at its scheduled time ``at``."""
    return RequestRecord(
        index=index, prompt_len=prompt, output_len=out, scheduled_s=at, start_s=at, success=True,
        status=200, ttft_s=ttft, itl_s=itl, e2el_s=e2el, output_tokens=out, prompt_tokens=prompt,
    )


def failed(index: int, at: float = 0.0, trace: dict | None = None) -> RequestRecord:
    """A failed record (HTTP 500)."""
    return RequestRecord(
        index=index, prompt_len=5, output_len=4, scheduled_s=at, start_s=at, status=500,
        error="HTTP 500: boom", kvpush_trace=trace,
    )


@pytest.fixture
def records() -> list[RequestRecord]:
    # A: TTFT 100 ms, 4 tokens, e2el 190 ms -> TPOT (190-100)/3 = 30 ms
    # B: TTFT 200 ms, 2 tokens, e2el 250 ms -> TPOT 50 ms
    # C: TTFT 300 ms, 1 token -> no TPOT
    # D: failed
    return [
        ok(0, 0.100, [0.020, 0.030, 0.040], 0.190, out=4, prompt=10, at=0.0),
        ok(1, 0.200, [0.050], 0.250, out=2, prompt=20, at=1.0),
        ok(2, 0.300, [], 0.300, out=1, prompt=30, at=2.0),
        failed(3, at=3.0),
    ]


def test_counts_and_throughputs(records):
    m = compute_metrics(records, duration_s=4.0)
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (60, 7)
    assert m.duration_s == 4.0
    assert m.request_throughput == approx(0.75)
    assert m.output_throughput == approx(1.75)
    assert m.total_token_throughput == approx(16.75)
    assert m.request_goodput is None and m.slo_ms == {}


def test_ttft_stats(records):
    m = compute_metrics(records, duration_s=4.0)
    # [100, 200, 300]: std = sqrt(20000/3); p90 at index 1.8 -> 280; p99 at 1.98 -> 298
    assert m.mean_ttft_ms == approx(200.0)
    assert m.median_ttft_ms == approx(200.0)
    assert m.std_ttft_ms == approx(81.64966, abs=1e-4)
    assert m.p90_ttft_ms == approx(280.0)
    assert m.p99_ttft_ms == approx(298.0)


def test_tpot_excludes_single_token_requests(records):
    assert tpot_s(records[0]) == approx(0.030)
    assert tpot_s(records[1]) == approx(0.050)
    assert tpot_s(records[2]) is None
    assert tpot_s(records[3]) is None
    m = compute_metrics(records, duration_s=4.0)
    # [30, 50]: p90 at index 0.9 -> 48; p99 at 0.99 -> 49.8
    assert (m.mean_tpot_ms, m.median_tpot_ms, m.std_tpot_ms) == (approx(40.0), approx(40.0), approx(10.0))
    assert (m.p90_tpot_ms, m.p99_tpot_ms) == (approx(48.0), approx(49.8))


def test_itl_is_pooled_over_successful_requests(records):
    m = compute_metrics(records, duration_s=4.0)
    # [20, 30, 40, 50]: std = sqrt(125); p90 at index 2.7 -> 47; p99 at 2.97 -> 49.7
    assert (m.mean_itl_ms, m.median_itl_ms) == (approx(35.0), approx(35.0))
    assert m.std_itl_ms == approx(11.18034, abs=1e-4)
    assert (m.p90_itl_ms, m.p99_itl_ms) == (approx(47.0), approx(49.7))


def test_e2el_stats(records):
    m = compute_metrics(records, duration_s=4.0)
    # [190, 250, 300]: mean 740/3, std sqrt(54600/27); p90 at 1.8 -> 290; p99 at 1.98 -> 299
    assert m.mean_e2el_ms == approx(246.66667, abs=1e-4)
    assert m.median_e2el_ms == approx(250.0)
    assert m.std_e2el_ms == approx(44.96912, abs=1e-4)
    assert (m.p90_e2el_ms, m.p99_e2el_ms) == (approx(290.0), approx(299.0))


def test_summarize_empty_and_single():
    assert summarize([]) == dict.fromkeys(("mean", "median", "std", "p90", "p99"))
    assert summarize([7.0]) == {"mean": 7.0, "median": 7.0, "std": 0.0, "p90": 7.0, "p99": 7.0}


def test_all_failed_gives_no_latency_stats():
    m = compute_metrics([failed(0), failed(1, at=1.0)], duration_s=2.0, request_rate=1.0)
    assert (m.completed, m.failed, m.request_throughput) == (0, 2, 0.0)
    assert m.median_ttft_ms is None and m.p99_tpot_ms is None and m.mean_itl_ms is None
    assert m.saturated  # finite rate, nothing delivered


@pytest.mark.parametrize(
    ("slo", "goodput"),
    [
        ({"ttft": 250.0}, 0.5),  # A, B
        ({"tpot": 40.0}, 0.5),  # A (30 ms), C (no TPOT: met); B is 50 ms
        ({"ttft": 250.0, "tpot": 40.0}, 0.25),  # A only
        ({"e2el": 200.0}, 0.25),  # A only
        ({"ttft": 300.0}, 0.75),  # the limit itself is met
    ],
)
def test_goodput(records, slo, goodput):
    m = compute_metrics(records, duration_s=4.0, slo_ms=slo)
    assert m.request_goodput == approx(goodput)
    assert m.slo_ms == slo


def test_failed_request_never_meets_slo(records):
    assert not meets_slo(records[3], {"ttft": 1e9})


def test_parse_slo():
    assert parse_slo("ttft:500,tpot:50") == {"ttft": 500.0, "tpot": 50.0}
    assert parse_slo(" E2EL:2000 ") == {"e2el": 2000.0}
    assert parse_slo("") == {} and parse_slo(None) == {}
    for bad in ("ttft", "itl:5", "ttft:abc", "ttft:-1", "tpot:0", "ttft:inf"):
        with pytest.raises(ValueError, match="bad SLO"):
            parse_slo(bad)


def _stream(scheduled: list[float], e2el: list[float]) -> list[RequestRecord]:
    return [ok(i, 0.01, [], e, out=1, prompt=1, at=t) for i, (t, e) in enumerate(zip(scheduled, e2el, strict=True))]


def test_not_saturated_despite_ramp_down_tail():
    # arrivals 0..4 s (1 req/s), every request takes 2 s: ends 2..6 s, departure 4/4 = 1 req/s.
    recs = _stream([0, 1, 2, 3, 4], [2.0] * 5)
    m = compute_metrics(recs, duration_s=6.0, request_rate=1.0)
    assert m.request_throughput == approx(5 / 6)  # below 0.9 x offered, yet the server kept up
    assert (m.arrival_rate, m.departure_rate, m.saturated) == (approx(1.0), approx(1.0), False)
    assert m.offered_rate == 1.0


def test_saturated_when_departures_lag():
    # arrivals every 0.5 s (2 req/s); ends at 1, 2, 3, 4, 5 s -> 1 req/s < 0.9 x 2
    recs = _stream([0, 0.5, 1, 1.5, 2], [1.0, 1.5, 2.0, 2.5, 3.0])
    assert saturation(recs, 2.0) == (approx(2.0), approx(1.0), True)


def test_saturation_tolerance_edge():
    # arrivals span 4 s (1 req/s); ends span 4.4 s -> 0.909 >= 0.9: not saturated; 5 s -> 0.8: saturated
    assert saturation(_stream([0, 1, 2, 3, 4], [1, 1, 1, 1, 1.4]), 1.0)[2] is False
    assert saturation(_stream([0, 1, 2, 3, 4], [1, 1, 1, 1, 2.0]), 1.0)[2] is True
    assert saturation(_stream([0, 1, 2, 3, 4], [1, 1, 1, 1, 2.0]), 1.0, tolerance=0.25)[2] is False


def test_inf_rate_never_saturated():
    recs = _stream([0, 0, 0, 0], [1.0, 2.0, 3.0, 10.0])
    arrival, departure, sat = saturation(recs, math.inf)
    assert (arrival, sat) == (None, False)
    assert departure == approx(3 / 9)
    assert compute_metrics(recs, duration_s=10.0).offered_rate is None


def _trace_records() -> list[RequestRecord]:
    t1 = {
        "dispatched": 10.000, "p_admitted": 10.002, "p_prefill_done": 10.050, "reg_received": 10.010,
        "write_posted": 10.055, "write_done": 10.060, "d_ready": 10.061, "first_token": 10.070,
        "unknown_event": 1.0,
    }
    t2 = {  # no reg_received, no d_ready
        "dispatched": 20.000, "p_admitted": 20.004, "p_prefill_done": 20.060,
        "write_posted": 20.062, "write_done": 20.072, "first_token": 20.080,
    }
    r1 = ok(0, 0.07, [], 0.1, out=1, prompt=1)
    r1.kvpush_trace = t1
    r2 = ok(1, 0.08, [], 0.1, out=1, prompt=1)
    r2.kvpush_trace = t2
    return [r1, r2, failed(2, trace={"dispatched": 0.0, "p_admitted": 5.0}), ok(3, 0.1, [], 0.1, 1, 1)]


def test_handover_breakdown():
    segs = {s.name: s for s in handover_breakdown(_trace_records())}
    assert list(segs) == [
        "dispatched->p_admitted",
        "p_admitted->p_prefill_done",
        "p_prefill_done->reg_received",
        "p_prefill_done->write_posted",
        "reg_received->write_posted",
        "write_posted->write_done",
        "write_done->d_ready",
        "write_done->first_token",
        "d_ready->first_token",
    ]
    # [2, 4] ms: median 3, p99 2 + 0.99 x 2 = 3.98
    first = segs["dispatched->p_admitted"]
    assert (first.count, first.start, first.end) == (2, "dispatched", "p_admitted")
    assert (first.mean_ms, first.median_ms, first.p99_ms) == (approx(3.0), approx(3.0), approx(3.98))
    # [48, 56]: median 52, p99 48 + 0.99 x 8 = 55.92
    assert (segs["p_admitted->p_prefill_done"].median_ms, segs["p_admitted->p_prefill_done"].p99_ms) == (
        approx(52.0), approx(55.92)
    )
    # registration arrived before prefill ended: a negative segment, kept as is
    assert segs["p_prefill_done->reg_received"].median_ms == approx(-40.0)
    assert segs["reg_received->write_posted"].median_ms == approx(45.0)
    assert segs["p_prefill_done->write_posted"].median_ms == approx(2.0)
    # [5, 10]: median 7.5, p99 5 + 0.99 x 5 = 9.95
    assert (segs["write_posted->write_done"].median_ms, segs["write_posted->write_done"].p99_ms) == (
        approx(7.5), approx(9.95)
    )
    assert segs["write_done->d_ready"].count == 1
    assert segs["write_done->first_token"].median_ms == approx(8.0)
    assert segs["d_ready->first_token"].p99_ms == approx(9.0)


def test_handover_in_metrics_and_absent_without_traces(records):
    assert compute_metrics(records, duration_s=4.0).handover == []
    m = compute_metrics(_trace_records(), duration_s=1.0)
    assert m.handover[0].name == "dispatched->p_admitted"
