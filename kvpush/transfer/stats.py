"""Transfer metrics of one instance, kept by the transfer thread, shipped with the engine stats."""

from __future__ import annotations

import bisect

import msgspec

from kvpush.transfer.ledger import TransferLedger

TIME_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
DESC_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Histogram(msgspec.Struct):
    bounds: list[float]
    counts: list[int]  # per bucket (not cumulative); the last one is +Inf
    total: float = 0.0
    count: int = 0

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> Histogram:
        return cls(list(bounds), [0] * (len(bounds) + 1))

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1


class TransferStats(msgspec.Struct):
    """What /metrics shows about KV transfers. `by_state` counts ledger records (tombstones included).
    Bytes and transfers count completed transfers this instance took part in (written, read or
    received); the time and descriptor histograms cover the transfers this instance posted."""

    by_state: dict[str, int] = {}
    bytes_total: int = 0
    transfers_total: int = 0
    time_s: Histogram | None = None
    descs: Histogram | None = None
    post_s_total: float = 0.0  # seconds spent in the posting calls of the transfers in `descs`
    layer_writes_total: int = 0  # P: WRITEs of layer-wise transfers that committed (one or more layers each)
    ignored_unknown: int = 0
    ignored_stale: int = 0
    ignored_foreign: int = 0
    ignored_unexpected: int = 0
    duplicates: int = 0
    bad_messages: int = 0
    handshakes: int = 0
    handshake_failures: int = 0
    quarantined_blocks: int = 0
    thread_cpu_s: float = 0.0
    thread_rounds: int = 0  # loop rounds of the transfer thread (each wake-up is one)
    faults_injected: int = 0
    local_fallbacks: int = 0  # D: requests computed locally after their KV failed (--on-kv-failure recompute)
    failures: dict[str, int] = {}  # transfers that ended FAILED or EXPIRED, by FailureKind (every kind listed)


class TransferMetrics:
    """Mutable counters owned by the transfer thread; `snapshot` copies them for shipping."""

    def __init__(self) -> None:
        self.time_s = Histogram.empty(TIME_BUCKETS_S)
        self.descs = Histogram.empty(tuple(float(b) for b in DESC_BUCKETS))
        self.bytes_total = 0
        self.transfers_total = 0
        self.post_s_total = 0.0
        self.layer_writes_total = 0
        self.bad_messages = 0
        self.handshakes = 0
        self.handshake_failures = 0
        self.thread_cpu_s = 0.0
        self.thread_rounds = 0
        self.faults_injected = 0

    def observe(self, transfer) -> None:
        finished = transfer.finished_at or transfer.posted_at
        self.time_s.observe(max(finished - transfer.posted_at, 0.0))
        self.descs.observe(float(transfer.num_descs))
        self.post_s_total += transfer.post_s
        self.bytes_total += transfer.num_bytes
        self.transfers_total += 1

    def received(self, num_bytes: int) -> None:
        """D (push): P's WRITE into our blocks completed (P timed it; we count the bytes)."""
        self.bytes_total += num_bytes
        self.transfers_total += 1

    def snapshot(self, ledger: TransferLedger) -> TransferStats:
        c = ledger.counters
        return TransferStats(
            by_state={s.value: n for s, n in ledger.count_by_state().items()},
            bytes_total=self.bytes_total, transfers_total=self.transfers_total,
            time_s=msgspec.structs.replace(self.time_s, counts=list(self.time_s.counts)),
            descs=msgspec.structs.replace(self.descs, counts=list(self.descs.counts)), post_s_total=self.post_s_total,
            layer_writes_total=self.layer_writes_total,
            ignored_unknown=c.ignored_unknown, ignored_stale=c.ignored_stale, ignored_foreign=c.ignored_foreign,
            ignored_unexpected=c.ignored_unexpected, duplicates=c.duplicates, bad_messages=self.bad_messages,
            handshakes=self.handshakes, handshake_failures=self.handshake_failures,
            quarantined_blocks=len(ledger.quarantined_blocks()), thread_cpu_s=self.thread_cpu_s,
            thread_rounds=self.thread_rounds,
            faults_injected=self.faults_injected, failures={k.value: n for k, n in c.failures.items()})
