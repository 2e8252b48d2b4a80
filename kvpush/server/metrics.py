"""Prometheus metrics of one instance, in its own registry (several servers may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvpush.server.messages import EngineStats
from kvpush.transfer.stats import Histogram as StatsHistogram
from kvpush.transfer.stats import TransferStats


class TransferCollector(Collector):
    """Renders the engine core's latest TransferStats (prefill and decode roles only)."""

    def __init__(self) -> None:
        self.stats: TransferStats | None = None

    def collect(self):
        t = self.stats
        if t is None:
            return
        states = GaugeMetricFamily("kvpush_kv_transfers", "Transfer ledger records by state", labels=["state"])
        for state, n in sorted(t.by_state.items()):
            states.add_metric([state], n)
        yield states
        yield CounterMetricFamily("kvpush_kv_transfer_bytes", "Bytes of completed KV transfers", value=t.bytes_total)
        yield CounterMetricFamily("kvpush_kv_transfers_completed", "Completed KV transfers", value=t.transfers_total)
        ignored = CounterMetricFamily("kvpush_kv_ignored_notifications", "Control messages ignored",
                                      labels=["reason"])
        for reason in ("unknown", "stale", "foreign", "unexpected"):
            ignored.add_metric([reason], getattr(t, f"ignored_{reason}"))
        ignored.add_metric(["duplicate"], t.duplicates)
        ignored.add_metric(["malformed"], t.bad_messages)
        yield ignored
        yield CounterMetricFamily("kvpush_kv_handshakes", "Completed handshakes", value=t.handshakes)
        yield CounterMetricFamily("kvpush_kv_handshake_failures", "Failed handshakes", value=t.handshake_failures)
        yield GaugeMetricFamily("kvpush_kv_quarantined_blocks", "Blocks quarantined after failed transfers",
                                value=t.quarantined_blocks)
        yield CounterMetricFamily("kvpush_kv_transfer_thread_cpu_seconds", "CPU time of the transfer thread",
                                  value=t.thread_cpu_s)
        yield CounterMetricFamily("kvpush_kv_faults_injected", "Faults injected (testing only)",
                                  value=t.faults_injected)
        if t.time_s is not None:
            yield _histogram("kvpush_kv_transfer_seconds", "Post to completion of posted transfers", t.time_s)
        if t.descs is not None:
            yield _histogram("kvpush_kv_transfer_descriptors", "Descriptors per posted transfer", t.descs)


def _histogram(name: str, doc: str, h: StatsHistogram) -> HistogramMetricFamily:
    buckets, running = [], 0
    for bound, count in zip([*h.bounds, float("inf")], h.counts, strict=True):
        running += count
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=h.total)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("kvpush_num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("kvpush_num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.waiting_kv = Gauge("kvpush_num_requests_waiting_for_kv", "Requests waiting for remote KV",
                                registry=r)
        self.blocks_free = Gauge("kvpush_kv_blocks_free", "Free KV cache blocks", registry=r)
        self.blocks_used = Gauge("kvpush_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.blocks_total = Gauge("kvpush_kv_blocks_total", "KV cache blocks in all", registry=r)
        self.in_flight = Gauge("kvpush_num_requests_in_flight", "Requests the API process is serving",
                               registry=r)
        self.prompt_tokens = Counter("kvpush_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("kvpush_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("kvpush_requests_finished", "Finished requests", ["finish_reason"],
                                registry=r)
        self.http_errors = Counter("kvpush_http_errors", "Error responses", ["status"], registry=r)
        self.prefix_hits = Gauge("kvpush_prefix_cache_hits", "Prefix cache lookups with a hit", registry=r)
        self.prefix_queries = Gauge("kvpush_prefix_cache_queries", "Prefix cache lookups", registry=r)
        self.ttft = Histogram("kvpush_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvpush_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvpush_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.compiled_graphs = Gauge("kvpush_compiled_graphs", "Graphs torch.compile built in the engine process "
                                     "(flat after start-up: a rise is a recompile)", registry=r)
        self.transfer = TransferCollector()
        r.register(self.transfer)

    def update_engine(self, stats: EngineStats, in_flight: int) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.waiting_kv.set(stats.num_waiting_for_kv)
        self.blocks_free.set(stats.num_free_blocks)
        self.blocks_used.set(stats.num_total_blocks - stats.num_free_blocks)
        self.blocks_total.set(stats.num_total_blocks)
        self.prefix_hits.set(stats.prefix_cache_hits)
        self.prefix_queries.set(stats.prefix_cache_queries)
        self.in_flight.set(in_flight)
        self.compiled_graphs.set(stats.compiled_graphs)
        self.transfer.stats = stats.transfer

    def observe_request(self, ttft: float | None, e2e: float, num_output: int, finish_reason: str) -> None:
        self.requests.labels(finish_reason=finish_reason).inc()
        self.e2e.observe(e2e)
        if ttft is not None:
            self.ttft.observe(ttft)
            if num_output > 1:
                self.tpot.observe((e2e - ttft) / (num_output - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
