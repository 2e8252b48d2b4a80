"""Benchmark metrics: pure functions from request records to a ``BenchmarkMetrics``.

Field names follow vLLM's serving benchmark. Conventions:

- Latency statistics (``*_ttft_ms``, ``*_tpot_ms``, ``*_itl_ms``, ``*_e2el_ms``) use successful
  requests only. Percentiles are ``numpy.percentile`` with its default ``linear`` method; ``std`` is
  the population standard deviation (``ddof=0``). A statistic with no data is ``None``.
- TPOT per request is ``(e2el - ttft) / (output_tokens - 1)``; requests with fewer than two output
  tokens have no TPOT and are left out of it. ITL entries of all successful requests are pooled.
- Token totals and throughputs count successful requests only, over the whole run's ``duration_s``.
- Goodput (``request_goodput``): successful requests meeting *every* given SLO (ms; keys ``ttft``,
  ``tpot``, ``e2el``), per second of ``duration_s``. A request without a TPOT meets a TPOT SLO.
  ``None`` when no SLO is given.
- Saturation: ``request_throughput`` (completed / duration) includes the ramp-down tail of the last
  requests, so it falls short of the offered rate even on an idle server. The flag compares rates
  over each stream instead: ``arrival_rate = (n - 1) / span of planned send times`` (all requests)
  and ``departure_rate = (completed - 1) / span of completion times``. A run is ``saturated`` when
  ``departure_rate < (1 - tolerance) * arrival_rate`` (default tolerance 10%), or when fewer than two
  requests completed. A run at ``request_rate = inf`` offers no rate and is never saturated; nor is a
  run of fewer than two requests.
- Handover breakdown: for successful requests with a ``kvpush_trace``, the known timestamps
  (``TRACE_EVENTS`` order) that are present are taken in that order, missing ones skipped, and each
  consecutive pair is one segment ``"a->b"`` (ms). A segment can be negative when events overlap
  (in push mode the registration may arrive before prefill ends). Unknown keys are ignored.
- Critical path (``critical_path``): the additive breakdown of TTFT from the client's send to its
  first chunk, with overlapped work apart; see ``kvpush.bench.trace``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import numpy as np

from kvpush.bench.trace import CriticalPath, analyze

TRACE_EVENTS = (
    "dispatched",
    "p_admitted",
    "p_prefill_done",
    "reg_received",
    "write_posted",
    "write_done",
    "d_ready",
    "first_token",
)
SLO_KEYS = ("ttft", "tpot", "e2el")
STAT_NAMES = ("mean", "median", "std", "p90", "p99")
DEFAULT_SATURATION_TOLERANCE = 0.10


class RequestRecord(msgspec.Struct, kw_only=True):
    """Outcome of one request. Times are seconds; ``*_s`` offsets are from the run's start."""

    index: int
    prompt_len: int
    output_len: int
    scheduled_s: float = 0.0
    start_s: float = 0.0
    success: bool = False
    status: int | None = None
    status_s: float | None = None  # send -> the response's status line (a 429's or 503's answer time)
    error: str = ""
    ttft_s: float | None = None
    itl_s: list[float] = []
    e2el_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    kvpush_trace: dict[str, Any] | None = None
    kvpush_route: dict[str, Any] | None = None  # --kv-mode auto: the route taken and its estimates
    sent_unix: float | None = None  # wall clock (time.time()) at send, for the critical path
    first_chunk_unix: float | None = None  # wall clock at the first token-carrying chunk


class HandoverSegment(msgspec.Struct, kw_only=True):
    """Duration statistics of one segment between two consecutive trace timestamps."""

    name: str
    start: str
    end: str
    count: int
    mean_ms: float
    median_ms: float
    p99_ms: float


class BenchmarkMetrics(msgspec.Struct, kw_only=True):
    """Summary of one run (vLLM serving-benchmark names; see the module docstring)."""

    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None = None
    slo_ms: dict[str, float] = {}
    offered_rate: float | None = None  # None: all requests at once (inf)
    arrival_rate: float | None = None
    departure_rate: float | None = None
    saturated: bool = False
    saturation_tolerance: float = DEFAULT_SATURATION_TOLERANCE
    mean_ttft_ms: float | None = None
    median_ttft_ms: float | None = None
    std_ttft_ms: float | None = None
    p90_ttft_ms: float | None = None
    p99_ttft_ms: float | None = None
    mean_tpot_ms: float | None = None
    median_tpot_ms: float | None = None
    std_tpot_ms: float | None = None
    p90_tpot_ms: float | None = None
    p99_tpot_ms: float | None = None
    mean_itl_ms: float | None = None
    median_itl_ms: float | None = None
    std_itl_ms: float | None = None
    p90_itl_ms: float | None = None
    p99_itl_ms: float | None = None
    mean_e2el_ms: float | None = None
    median_e2el_ms: float | None = None
    std_e2el_ms: float | None = None
    p90_e2el_ms: float | None = None
    p99_e2el_ms: float | None = None
    handover: list[HandoverSegment] = []
    critical_path: CriticalPath | None = None


def summarize(values_ms: Sequence[float]) -> dict[str, float | None]:
    """mean, median, std (ddof=0), p90, p99 (numpy linear percentiles); all None if empty."""
    if len(values_ms) == 0:
        return dict.fromkeys(STAT_NAMES)
    arr = np.asarray(values_ms, dtype=float)
    return {
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "std": float(arr.std()),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
    }


def tpot_s(record: RequestRecord) -> float | None:
    """Time per output token after the first, or None for < 2 tokens or a failed request."""
    if not record.success or record.output_tokens < 2:
        return None
    if record.e2el_s is None or record.ttft_s is None:
        return None
    return (record.e2el_s - record.ttft_s) / (record.output_tokens - 1)


def parse_slo(text: str | None) -> dict[str, float]:
    """Parse ``"ttft:500,tpot:50,e2el:2000"`` (milliseconds) into a dict; raise ValueError if bad."""
    slo: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad SLO {part.strip()!r}: expected KEY:MS with KEY in {', '.join(SLO_KEYS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"bad SLO {part.strip()!r}: {value.strip()!r} is not a number") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"bad SLO {part.strip()!r}: the limit must be a positive number of ms")
        slo[key] = ms
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """Whether a successful request meets every SLO in ``slo`` (ms)."""
    if not record.success:
        return False
    values = {
        "ttft": record.ttft_s,
        "tpot": tpot_s(record),
        "e2el": record.e2el_s,
    }
    for key, limit_ms in slo.items():
        value = values.get(key)
        if value is None:
            if key == "tpot":
                continue
            return False
        if value * 1000.0 > limit_ms:
            return False
    return True


def _rate(count: int, span_s: float) -> float | None:
    """``(count - 1) / span_s``, or None when undefined."""
    if count < 2 or span_s <= 0:
        return None
    return (count - 1) / span_s


def saturation(
    records: Sequence[RequestRecord],
    offered_rate: float,
    tolerance: float = DEFAULT_SATURATION_TOLERANCE,
) -> tuple[float | None, float | None, bool]:
    """``(arrival_rate, departure_rate, saturated)`` as defined in the module docstring."""
    scheduled = [r.scheduled_s for r in records]
    ends = [r.start_s + r.e2el_s for r in records if r.success and r.e2el_s is not None]
    arrival = _rate(len(scheduled), max(scheduled) - min(scheduled)) if scheduled else None
    departure = _rate(len(ends), max(ends) - min(ends)) if ends else None
    if math.isinf(offered_rate) or len(records) < 2:
        return arrival, departure, False
    if len(ends) < 2:
        return arrival, departure, True
    if arrival is None or departure is None:
        return arrival, departure, False
    return arrival, departure, departure < (1.0 - tolerance) * arrival


def _trace_events(trace: dict[str, Any]) -> list[tuple[str, float]]:
    """Known numeric timestamps of one trace, in ``TRACE_EVENTS`` order."""
    return [
        (name, float(trace[name]))
        for name in TRACE_EVENTS
        if isinstance(trace.get(name), int | float) and not isinstance(trace.get(name), bool)
    ]


def handover_breakdown(records: Iterable[RequestRecord]) -> list[HandoverSegment]:
    """Per-segment statistics of the ``kvpush_trace`` timestamps of successful requests."""
    durations: dict[tuple[str, str], list[float]] = {}
    for rec in records:
        if not rec.success or not rec.kvpush_trace:
            continue
        events = _trace_events(rec.kvpush_trace)
        for (a, ta), (b, tb) in zip(events, events[1:], strict=False):
            durations.setdefault((a, b), []).append((tb - ta) * 1000.0)
    order = {name: i for i, name in enumerate(TRACE_EVENTS)}
    segments = []
    for a, b in sorted(durations, key=lambda ab: (order[ab[0]], order[ab[1]])):
        stats = summarize(durations[(a, b)])
        segments.append(
            HandoverSegment(
                name=f"{a}->{b}",
                start=a,
                end=b,
                count=len(durations[(a, b)]),
                mean_ms=stats["mean"] or 0.0,
                median_ms=stats["median"] or 0.0,
                p99_ms=stats["p99"] or 0.0,
            )
        )
    return segments


def _latency_fields(ok: Sequence[RequestRecord]) -> dict[str, float | None]:
    """The ``{stat}_{metric}_ms`` fields for TTFT, TPOT, ITL and E2E latency."""
    series = {
        "ttft": [r.ttft_s * 1000.0 for r in ok if r.ttft_s is not None],
        "tpot": [t * 1000.0 for t in (tpot_s(r) for r in ok) if t is not None],
        "itl": [x * 1000.0 for r in ok for x in r.itl_s],
        "e2el": [r.e2el_s * 1000.0 for r in ok if r.e2el_s is not None],
    }
    fields: dict[str, float | None] = {}
    for metric, values in series.items():
        for stat, value in summarize(values).items():
            fields[f"{stat}_{metric}_ms"] = value
    return fields


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    request_rate: float = math.inf,
    slo_ms: dict[str, float] | None = None,
    tolerance: float = DEFAULT_SATURATION_TOLERANCE,
) -> BenchmarkMetrics:
    """Summarise one run's records; ``duration_s`` is the run's wall time (first send to last end)."""
    ok = [r for r in records if r.success]
    slo = dict(slo_ms or {})
    in_tokens = sum(r.prompt_tokens for r in ok)
    out_tokens = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    arrival, departure, saturated = saturation(records, request_rate, tolerance)
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        duration_s=duration_s,
        request_throughput=len(ok) * per_s,
        output_throughput=out_tokens * per_s,
        total_token_throughput=(in_tokens + out_tokens) * per_s,
        request_goodput=sum(meets_slo(r, slo) for r in ok) * per_s if slo else None,
        slo_ms=slo,
        offered_rate=None if math.isinf(request_rate) else request_rate,
        arrival_rate=arrival,
        departure_rate=departure,
        saturated=saturated,
        saturation_tolerance=tolerance,
        handover=handover_breakdown(ok),
        critical_path=analyze(ok),
        **_latency_fields(ok),
    )
