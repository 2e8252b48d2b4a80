"""Prometheus metrics of one instance, in its own registry (several servers may share a process).

Besides kvpush's own names, the gauges, counters and histograms dashboards and routers read from
vLLM are exported again under vLLM's names (``vllm:...``, labelled ``model_name`` and ``engine``
as vLLM v1 does), so Grafana boards and load-aware routing built for vLLM work unchanged.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpush.emulate.lateness import EmulationStats
from kvpush.instance.messages import EngineStats
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
        yield CounterMetricFamily("kvpush_kv_transfer_post_seconds", "Time spent in the posting calls of the "
                                  "transfers in kvpush_kv_transfer_descriptors", value=t.post_s_total)
        yield CounterMetricFamily("kvpush_kv_layer_writes", "P: WRITEs of layer-wise transfers that committed",
                                  value=t.layer_writes_total)
        yield CounterMetricFamily("kvpush_kv_transfer_thread_rounds", "Loop rounds (wake-ups) of the transfer thread",
                                  value=t.thread_rounds)
        yield CounterMetricFamily("kvpush_kv_faults_injected", "Faults injected (testing only)",
                                  value=t.faults_injected)
        yield CounterMetricFamily("kvpush_kv_local_fallbacks", "Decode requests computed locally after their KV "
                                  "transfer failed (--on-kv-failure recompute)", value=t.local_fallbacks)
        failures = CounterMetricFamily("kvpush_kv_transfer_failures", "Transfers that ended failed or expired, "
                                       "by reason", labels=["reason"])
        for reason, n in sorted(t.failures.items()):
            failures.add_metric([reason], n)
        yield failures
        if t.time_s is not None:
            yield _histogram("kvpush_kv_transfer_seconds", "Post to completion of posted transfers", t.time_s)
        if t.descs is not None:
            yield _histogram("kvpush_kv_transfer_descriptors", "Descriptors per posted transfer", t.descs)


class EmulationCollector(Collector):
    """--emulate: the profile and how late the emulated steps ended (kvpush/emulate/lateness.py), labelled with
    the profile, so that no scrape of an emulated instance can be taken for a measurement of hardware."""

    def __init__(self) -> None:
        self.stats: EmulationStats | None = None

    def collect(self):
        e = self.stats
        if e is None:
            return
        label = [e.profile]
        info = GaugeMetricFamily("kvpush_emulated", "1: this instance emulates its accelerator (--emulate); "
                                 "time_scale stretches every modelled step", labels=["profile", "time_scale"])
        info.add_metric([e.profile, repr(e.time_scale)], 1)
        yield info
        for name, doc, value, kind in (
                ("kvpush_emulated_steps", "Emulated engine steps", e.steps, CounterMetricFamily),
                ("kvpush_emulated_modelled_seconds", "Modelled (scaled) time of the emulated steps", e.modelled_s,
                 CounterMetricFamily),
                ("kvpush_emulated_step_lateness_p50_seconds", "Median lateness of the recent emulated steps",
                 e.lateness_p50_s, GaugeMetricFamily),
                ("kvpush_emulated_step_lateness_p99_seconds", "p99 lateness of the recent emulated steps",
                 e.lateness_p99_s, GaugeMetricFamily),
                ("kvpush_emulated_step_p50_seconds", "Median modelled duration of the recent emulated steps",
                 e.step_p50_s, GaugeMetricFamily),
                ("kvpush_emulated_window_steps", "Emulated steps in the window the percentiles cover (the last "
                 "4096, or fewer since POST /emulation/reset_window)", e.window_steps, GaugeMetricFamily)):
            family = kind(name, doc, labels=["profile"])
            family.add_metric(label, value)
            yield family
        lateness = HistogramMetricFamily("kvpush_emulated_step_lateness_seconds", "How far past its modelled end "
                                         "each emulated step ended", labels=["profile"])
        lateness.add_metric(label, _buckets(e.lateness_bounds, e.lateness_counts), sum_value=e.lateness_sum_s)
        yield lateness


def _buckets(bounds: list[float], counts: list[int]) -> list[tuple[str, float]]:
    """Cumulative Prometheus buckets from per-bucket counts (the last one +Inf)."""
    out: list[tuple[str, float]] = []
    running = 0
    for bound, count in zip([*bounds, float("inf")], counts, strict=True):
        running += count
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
    return out


def _histogram(name: str, doc: str, h: StatsHistogram) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, buckets=_buckets(h.bounds, h.counts), sum_value=h.total)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class VllmNames(Collector):
    """kvpush's request metrics again under vLLM's names, with vLLM's labels (one source of truth:
    the histograms and counters are copied from kvpush's own at scrape time)."""

    RENAMED = {"prompt_tokens": "vllm:prompt_tokens", "generation_tokens": "vllm:generation_tokens",
               "ttft": "vllm:time_to_first_token_seconds", "tpot": "vllm:time_per_output_token_seconds",
               "e2e": "vllm:e2e_request_latency_seconds", "requests": "vllm:request_success"}

    def __init__(self, metrics: ServerMetrics, model_name: str) -> None:
        self.metrics = metrics
        self.labels = {"model_name": model_name, "engine": "0"}

    def collect(self):
        st, labels = self.metrics.stats, self.labels
        names, values = list(labels), list(labels.values())
        used = st.num_total_blocks - st.num_free_blocks
        usage = used / st.num_total_blocks if st.num_total_blocks else 0.0
        for name, doc, value in (
                ("vllm:num_requests_running", "Requests in the running batch", st.num_running),
                ("vllm:num_requests_waiting", "Requests waiting (for blocks or for remote KV)",
                 st.num_waiting + st.num_waiting_for_kv),
                ("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full", usage),
                ("vllm:gpu_cache_usage_perc", "KV-cache usage, 1 = full (older vLLM name)", usage)):
            gauge = GaugeMetricFamily(name, doc, labels=names)
            gauge.add_metric(values, value)
            yield gauge
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Preemptions", labels=names)
        preemptions.add_metric(values, st.num_preemptions)
        yield preemptions
        for attr, name in self.RENAMED.items():
            for family in getattr(self.metrics, attr).collect():
                yield _renamed(family, name, labels)
        for family in self.metrics.tpot.collect():  # vLLM >= 0.10 calls the per-request mean this
            yield _renamed(family, "vllm:request_time_per_output_token_seconds", labels)


def _renamed(family: Metric, name: str, labels: dict[str, str]) -> Metric:
    out = Metric(name, family.documentation, family.type)
    for s in family.samples:
        own = {("finished_reason" if k == "finish_reason" else k): v for k, v in s.labels.items()}  # vLLM's label
        out.add_sample(name + s.name[len(family.name):], {**own, **labels}, s.value, s.timestamp)
    return out


class ServerMetrics:
    def __init__(self, model_name: str = "") -> None:
        r = self.registry = CollectorRegistry()
        self.stats = EngineStats()
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
        self.shed = Counter("kvpush_requests_shed", "Requests refused by admission control (429 / 503)",
                            ["reason"], registry=r)
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
        self.emulation = EmulationCollector()
        r.register(self.emulation)
        r.register(VllmNames(self, model_name))

    def update_engine(self, stats: EngineStats, in_flight: int) -> None:
        self.stats = stats
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
        self.emulation.stats = stats.emulation

    def observe_request(self, ttft: float | None, e2e: float, num_output: int, finish_reason: str) -> None:
        self.requests.labels(finish_reason=finish_reason).inc()
        self.e2e.observe(e2e)
        if ttft is not None:
            self.ttft.observe(ttft)
            if num_output > 1:
                self.tpot.observe((e2e - ttft) / (num_output - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
