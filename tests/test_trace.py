"""The critical-path arithmetic of kvpush.bench.trace: which events form the path, and that its
segments add up to TTFT with overlapped work kept apart."""

from __future__ import annotations

import pytest

from kvpush.bench.metrics import RequestRecord, compute_metrics
from kvpush.bench.trace import analyze, critical_path, format_critical_path, request_segments

MS = 1e-3


def stamps(**offsets_ms: float) -> dict[str, float]:
    """Events at T0 + offset ms."""
    return {k: 1000.0 + v * MS for k, v in offsets_ms.items()}


COLOCATED = stamps(client_sent=0, api_received=1, arrived=2, first_token=202, api_first_chunk=203,
                   client_first_chunk=204)
PUSH_COMMON = dict(client_sent=0, proxy_received=1, dispatched=1.2, p_leg_sent=1.3, d_leg_sent=1.5,
                   p_api_received=2, p_admitted=3, p_prefill_done=203, p_answered=205, p_response=206,
                   api_received=3, arrived=4, d_registered=4.2, write_posted=204, kv_landed=206,
                   d_ready=206.5, first_token=206.6, api_first_chunk=207, proxy_first_chunk=208,
                   client_first_chunk=209)
PULL = stamps(client_sent=0, proxy_received=1, dispatched=1.2, p_leg_sent=1.3, p_api_received=2, p_admitted=3,
              p_prefill_done=203, p_answered=205, p_response=206, d_leg_sent=206.2, api_received=207, arrived=208,
              d_admitted=208.2, read_posted=208.5, kv_landed=211, d_ready=212, first_token=212.1,
              api_first_chunk=213, proxy_first_chunk=214, client_first_chunk=215)


def test_colocated_path_and_sum():
    path = critical_path(COLOCATED)
    assert path == ["client_sent", "api_received", "arrived", "first_token", "api_first_chunk", "client_first_chunk"]
    crit, over, unacc = request_segments(COLOCATED, 0.2041)
    assert crit["arrived->first_token"] == pytest.approx(200.0)
    assert sum(crit.values()) == pytest.approx(204.0)
    assert unacc == pytest.approx(0.1, abs=1e-6)  # the client's clock saw 0.1 ms more than the stamps
    assert over == {}


def test_push_registration_during_prefill_is_overlapped():
    events = stamps(**PUSH_COMMON, reg_received=5)
    path = critical_path(events)
    assert path[:8] == ["client_sent", "proxy_received", "dispatched", "p_leg_sent", "p_api_received", "p_admitted",
                        "p_prefill_done", "write_posted"]
    assert "reg_received" not in path and "p_response" not in path
    crit, over, _ = request_segments(events, 0.209)
    assert sum(crit.values()) == pytest.approx(209.0)
    # D's leg and registration, and P's answer to the proxy, ran beside the path
    assert {"d_registered->reg_received", "dispatched->d_leg_sent", "p_answered->p_response"} <= set(over)
    assert over["d_registered->reg_received"] == pytest.approx(0.8)


def test_push_late_registration_is_on_the_path():
    events = stamps(**PUSH_COMMON, reg_received=203.5)  # D registered after P's prefill ended
    path = critical_path(events)
    i = path.index("write_posted")
    assert path[i - 1] == "reg_received" and path[i - 2] == "d_registered"
    assert "d_leg_sent" in path and "p_prefill_done" not in path
    crit, over, _ = request_segments(events, 0.209)
    assert sum(crit.values()) == pytest.approx(209.0)
    assert "p_admitted->p_prefill_done" in over


def test_push_decode_leg_does_not_wait_for_p_answer():
    # p_response is a predecessor of d_leg_sent only in pull: stamped later, it is not on the path
    events = stamps(**PUSH_COMMON, reg_received=5)
    assert "p_response" not in critical_path(events)


def test_pull_path_goes_through_p_answer_and_read():
    path = critical_path(PULL)
    for a, b in [("p_answered", "p_response"), ("p_response", "d_leg_sent"), ("d_admitted", "read_posted"),
                 ("read_posted", "kv_landed")]:
        assert path.index(b) == path.index(a) + 1
    crit, over, unacc = request_segments(PULL, 0.215)
    assert sum(crit.values()) == pytest.approx(215.0)
    assert over == {} and unacc == pytest.approx(0.0, abs=1e-6)


def test_missing_event_is_looked_through():
    events = dict(COLOCATED)
    del events["api_first_chunk"]
    assert critical_path(events)[-2:] == ["first_token", "client_first_chunk"]
    crit, _, _ = request_segments(events, 0.204)
    assert crit["first_token->client_first_chunk"] == pytest.approx(2.0)


def test_incomplete_trace_has_no_path():
    events = dict(COLOCATED)
    del events["client_first_chunk"]
    assert critical_path(events) == []


def record(events: dict[str, float], ttft_ms: float, index: int = 0) -> RequestRecord:
    trace = {k: v for k, v in events.items() if not k.startswith("client_")}
    trace["unknown_key"] = 5.0  # ignored
    return RequestRecord(index=index, prompt_len=8, output_len=4, success=True, ttft_s=ttft_ms * MS,
                         e2el_s=ttft_ms * MS + 0.05, output_tokens=4, kvpush_trace=trace,
                         sent_unix=events["client_sent"], first_chunk_unix=events["client_first_chunk"])


def test_analyze_shares_add_up_to_mean_ttft():
    early = stamps(**PUSH_COMMON, reg_received=5)
    late = stamps(**PUSH_COMMON, reg_received=203.5)
    records = [record(early, 209.0, 0), record(late, 209.3, 1)]
    records.append(RequestRecord(index=2, prompt_len=8, output_len=4, success=False))  # no trace: skipped
    cp = analyze(records)
    assert cp is not None and cp.requests == 2
    total = sum(s.share_ms for s in cp.segments)
    assert total + cp.mean_unaccounted_ms == pytest.approx(cp.mean_ttft_ms)
    assert cp.mean_unaccounted_ms == pytest.approx(0.15, abs=1e-6)
    reg = next(s for s in cp.segments if s.name == "reg_received->write_posted")
    assert reg.count == 1  # on the path of the late request only
    assert any(s.name == "d_registered->reg_received" for s in cp.overlapped)
    table = format_critical_path(cp, "push")
    assert "unaccounted" in table and "overlapped" in table


def test_compute_metrics_carries_the_critical_path():
    m = compute_metrics([record(COLOCATED, 204.0)], duration_s=1.0)
    assert m.critical_path is not None and m.critical_path.requests == 1
    assert compute_metrics([RequestRecord(index=0, prompt_len=1, output_len=1)], 1.0).critical_path is None
