"""The critical path of one request, from the client's send to the client's first token.

Every process on the path stamps wall-clock times (``time.time()``, one host, one clock) into the
request's ``kvpush_trace``; the load generator adds ``client_sent`` and ``client_first_chunk``.
Names, in path order (P's stamps get a ``p_`` prefix from the proxy; D's and a colocated
instance's keep their own names):

    client_sent -> proxy_received -> dispatched -> p_leg_sent -> p_api_received -> p_admitted
    -> p_prefill_done -> p_answered -> p_response                          (P's leg, P's answer)
    proxy (push: at dispatch; pull: after p_response) -> d_leg_sent -> api_received -> arrived
    push: -> d_registered -> reg_received (P) -> write_posted (P, after p_prefill_done too) -> kv_landed
    pull: -> d_admitted -> read_posted -> kv_landed
    -> d_ready -> first_token -> core_sent -> api_got -> api_dequeued -> api_first_chunk
    -> proxy_first_chunk -> client_first_chunk
    colocated: client_sent -> api_received -> arrived -> first_token -> core_sent -> ... -> client_first_chunk
(core_sent: the engine core sends the token; api_got: the API process's reader thread has it;
api_dequeued: the request's handler has it on the event loop.)

``PREDECESSORS`` is that graph. The critical path is found backwards from ``client_first_chunk``:
at every event the predecessor taken is the *latest* one present in the trace (an event waits for
all of its predecessors, so the last to happen is the one it waited for); an event missing from
the trace is looked through to its own predecessors, and a predecessor stamped after the event is
not one it waited for (in push, D's leg does not wait for P's answer). Consecutive events of the path are its
segments ("a->b", ms). They telescope: their sum is ``client_first_chunk - client_sent`` on the
wall clock, and ``unaccounted = TTFT - sum`` is what the client's own (monotonic) TTFT clock saw
beyond that - near zero when every hop is stamped. Events present but off the path (D's
registration during P's prefill, P's answer in push) are *overlapped* work: each is reported as
the segment from its latest present predecessor, apart from the critical path.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import numpy as np

PREDECESSORS: dict[str, tuple[str, ...]] = {
    "client_sent": (),
    "proxy_received": ("client_sent",),
    "dispatched": ("proxy_received",),
    "p_leg_sent": ("dispatched",),
    "p_api_received": ("p_leg_sent",),
    "p_admitted": ("p_api_received",),
    "p_prefill_done": ("p_admitted",),
    "p_answered": ("p_prefill_done",),
    "p_response": ("p_answered",),
    "d_leg_sent": ("dispatched", "p_response"),
    "api_received": ("d_leg_sent", "client_sent"),
    "arrived": ("api_received",),
    "d_registered": ("arrived",),
    "reg_received": ("d_registered",),
    "write_posted": ("p_prefill_done", "reg_received"),
    "d_admitted": ("arrived",),
    "read_posted": ("d_admitted",),
    "kv_landed": ("write_posted", "read_posted"),
    "d_ready": ("kv_landed",),
    "first_token": ("d_ready", "arrived"),
    "core_sent": ("first_token",),
    "api_got": ("core_sent",),
    "api_dequeued": ("api_got",),
    "api_first_chunk": ("api_dequeued",),
    "proxy_first_chunk": ("api_first_chunk",),
    "client_first_chunk": ("proxy_first_chunk",),
}
START, END = "client_sent", "client_first_chunk"
# The same four phases for every mode, cut at fixed events (whatever the path): they add up to TTFT.
PHASES = ("to prefill", "prefill", "handover", "to client")
PREFILL_START = ("p_admitted", "arrived")  # the first present: P's admission, or a colocated instance's
PREFILL_END = ("p_prefill_done", "first_token")
KV_READY = ("d_ready", "first_token")
REGISTRATION = ("d_leg_sent", "reg_received")  # push: D's leg until P holds its registration
EVENT_ORDER = {name: i for i, name in enumerate(PREDECESSORS)}


class Segment(msgspec.Struct, kw_only=True):
    """Statistics of one segment over the requests whose path (or overlapped work) contains it."""

    name: str
    count: int  # requests with this segment
    mean_ms: float  # over those requests
    median_ms: float
    p99_ms: float
    share_ms: float  # sum over requests / all traced requests: these add up to the mean TTFT


class CriticalPath(msgspec.Struct, kw_only=True):
    """The critical path of a run (see the module docstring); ms."""

    requests: int  # successful requests with a complete trace
    mean_ttft_ms: float
    median_ttft_ms: float
    segments: list[Segment]  # on the critical path, in path order
    overlapped: list[Segment]  # off the path: ran alongside it
    mean_unaccounted_ms: float
    max_abs_unaccounted_ms: float
    phases: dict[str, float] = {}  # PHASES -> mean ms; they add up to the mean TTFT minus unaccounted
    registration_ms: float | None = None  # push: mean of D's leg -> registration at P (overlapped)


def events_of(trace: dict[str, Any]) -> dict[str, float]:
    """The known numeric timestamps of one trace."""
    return {k: float(v) for k, v in trace.items()
            if k in PREDECESSORS and isinstance(v, int | float) and not isinstance(v, bool)}


def _latest_pred(name: str, events: dict[str, float], limit: float) -> str | None:
    """The latest predecessor of `name` present in `events` at or before `limit`, looking through
    missing events (a predecessor stamped after the event is not what the event waited for: in
    push, D's leg does not wait for P's answer)."""
    best: str | None = None
    for pred in PREDECESSORS[name]:
        if pred in events:
            found: str | None = pred if events[pred] <= limit else None
        else:
            found = _latest_pred(pred, events, limit)
        if found is not None and (best is None or events[found] > events[best]):
            best = found
    return best


def critical_path(events: dict[str, float]) -> list[str]:
    """The events of the critical path, START to END; [] if either end is missing."""
    if START not in events or END not in events:
        return []
    path = [END]
    while path[-1] != START:
        pred = _latest_pred(path[-1], events, events[path[-1]])
        path.append(pred if pred is not None else START)
    return path[::-1]


def request_segments(events: dict[str, float], ttft_s: float) -> tuple[dict[str, float], dict[str, float], float]:
    """(critical segments, overlapped segments, unaccounted) of one request, all in ms."""
    path = critical_path(events)
    on_path = set(path)
    critical = {f"{a}->{b}": (events[b] - events[a]) * 1000.0 for a, b in zip(path, path[1:], strict=False)}
    overlapped: dict[str, float] = {}
    for name in sorted(set(events) - on_path, key=EVENT_ORDER.__getitem__):
        pred = _latest_pred(name, events, events[name])
        if pred is not None:
            overlapped[f"{pred}->{name}"] = (events[name] - events[pred]) * 1000.0
    unaccounted = ttft_s * 1000.0 - sum(critical.values())
    return critical, overlapped, unaccounted


def phases_of(events: dict[str, float]) -> dict[str, float] | None:
    """The four PHASES (ms) of one request, or None if a boundary event is missing. Each phase is
    the time between two boundaries, clipped at 0 so that they still tile [START, END]."""
    def first(names: tuple[str, ...]) -> float | None:
        return next((events[n] for n in names if n in events), None)

    marks = [events.get(START), first(PREFILL_START), first(PREFILL_END), first(KV_READY), events.get(END)]
    if any(m is None for m in marks):
        return None
    t = [float(m) for m in marks if m is not None]
    for i in range(1, len(t)):
        t[i] = min(max(t[i], t[i - 1]), t[-1])
    return {name: (t[i + 1] - t[i]) * 1000.0 for i, name in enumerate(PHASES)}


def _segment_stats(per_request: Sequence[dict[str, float]], total: int) -> list[Segment]:
    values: dict[str, list[float]] = {}
    for segs in per_request:
        for name, ms in segs.items():
            values.setdefault(name, []).append(ms)

    def order(name: str) -> tuple[int, int]:
        a, _, b = name.partition("->")
        return EVENT_ORDER[b], EVENT_ORDER[a]

    out = []
    for name in sorted(values, key=order):
        arr = np.asarray(values[name])
        out.append(Segment(name=name, count=len(arr), mean_ms=float(arr.mean()), median_ms=float(np.median(arr)),
                           p99_ms=float(np.percentile(arr, 99)), share_ms=float(arr.sum()) / total))
    return out


def analyze(records: Iterable[Any]) -> CriticalPath | None:
    """The critical path over successful records that carry a trace and the client's stamps."""
    crit, over, unacc, ttfts, phases, regs = [], [], [], [], [], []
    for rec in records:
        if not rec.success or rec.ttft_s is None or not rec.kvpush_trace or rec.sent_unix is None:
            continue
        events = events_of(rec.kvpush_trace)
        events[START] = rec.sent_unix
        if rec.first_chunk_unix is not None:
            events[END] = rec.first_chunk_unix
        if END not in events:
            continue
        c, o, u = request_segments(events, rec.ttft_s)
        p = phases_of(events)
        if p is not None:
            phases.append(p)
        if all(n in events for n in REGISTRATION):
            regs.append((events[REGISTRATION[1]] - events[REGISTRATION[0]]) * 1000.0)
        crit.append(c)
        over.append(o)
        unacc.append(u)
        ttfts.append(rec.ttft_s * 1000.0)
    if not crit:
        return None
    return CriticalPath(requests=len(crit), mean_ttft_ms=float(np.mean(ttfts)), median_ttft_ms=float(np.median(ttfts)),
                        segments=_segment_stats(crit, len(crit)), overlapped=_segment_stats(over, len(over)),
                        mean_unaccounted_ms=float(np.mean(unacc)),
                        max_abs_unaccounted_ms=float(np.max(np.abs(unacc))),
                        phases={n: float(np.mean([p[n] for p in phases])) for n in PHASES} if phases else {},
                        registration_ms=float(np.mean(regs)) if regs else None)


def format_critical_path(cp: CriticalPath, title: str = "") -> str:
    """A per-segment table: the critical path (its shares add up to the mean TTFT), then overlapped work."""
    lines = [f"critical path{' of ' + title if title else ''}: {cp.requests} requests, TTFT mean "
             f"{cp.mean_ttft_ms:.1f} ms, p50 {cp.median_ttft_ms:.1f} ms",
             f"  {'segment':<40} {'on path':>8} {'share':>8} {'p50':>8} {'p99':>8}"]
    for s in cp.segments:
        lines.append(f"  {s.name:<40} {s.count:>8} {s.share_ms:>8.2f} {s.median_ms:>8.2f} {s.p99_ms:>8.2f}")
    total = sum(s.share_ms for s in cp.segments)
    lines.append(f"  {'sum of shares':<40} {'':>8} {total:>8.2f}")
    lines.append(f"  {'unaccounted (TTFT - sum)':<40} {'':>8} {cp.mean_unaccounted_ms:>8.2f}   "
                 f"(max |.| {cp.max_abs_unaccounted_ms:.2f})")
    if cp.overlapped:
        lines.append("  overlapped with the critical path (not part of TTFT):")
        for s in cp.overlapped:
            lines.append(f"  {s.name:<40} {s.count:>8} {'':>8} {s.median_ms:>8.2f} {s.p99_ms:>8.2f}")
    return "\n".join(lines)
