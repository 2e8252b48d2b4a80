"""Prometheus metrics of the proxy."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class ProxyMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvpush_proxy_requests", "Requests answered, by HTTP status", ["status"], registry=r)
        self.retries = Counter("kvpush_proxy_prefill_retries", "Requests re-dispatched after a prefill failure",
                               registry=r)
        self.shed = Counter("kvpush_proxy_shed", "Legs an instance shed (429 / 503 with Retry-After)",
                            ["role", "status"], registry=r)
        self.shed_retries = Counter("kvpush_proxy_shed_retries", "Requests re-dispatched to another instance "
                                    "after one shed them", registry=r)
        self.healthy = Gauge("kvpush_proxy_instance_healthy", "1 if the instance answers its probes",
                             ["role", "url"], registry=r)
        self.draining = Gauge("kvpush_proxy_instance_draining", "1 while the instance drains (not chosen)",
                              ["role", "url"], registry=r)
        self.rerouted = Counter("kvpush_proxy_rerouted", "Legs sent to another instance before the first one got "
                                "anything: it answered that it drains, or (decode) could not be connected to",
                                ["role", "reason"], registry=r)
        self.in_flight = Gauge("kvpush_proxy_instance_in_flight", "Requests in flight per instance",
                               ["role", "url"], registry=r)
        self.routes = Counter("kvpush_proxy_kv_mode_chosen", "Requests per route chosen (--kv-mode auto): push, "
                              "push-layerwise, pull, local", ["route"], registry=r)
        self.estimate_ratio = Histogram("kvpush_proxy_ttft_estimate_ratio", "--kv-mode auto: measured TTFT / the "
                                        "cost model's estimate, per route", ["route"], registry=r,
                                        buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.1, 1.25, 1.5, 2.0, 4.0))
        self.first_from_prefill = Counter("kvpush_proxy_first_token_from_prefill", "Streams to a vLLM decode "
                                          "instance whose first token could come from P (--first-token from-prefill), "
                                          "by outcome: relayed (P's token went first; D's, the same, was dropped), "
                                          "late (D's came first), unusable (P's answer was no plain piece of text, or "
                                          "P failed), mismatch (D's differed: the stream ended with an error)", ["outcome"], registry=r)
        self.served = Gauge("kvpush_proxy_instance_served", "Requests dispatched per instance",
                            ["role", "url"], registry=r)

    def update_instances(self, instances) -> None:
        for i in instances:
            self.healthy.labels(role=i.role, url=i.url).set(1 if i.healthy else 0)
            self.draining.labels(role=i.role, url=i.url).set(1 if i.draining else 0)
            self.in_flight.labels(role=i.role, url=i.url).set(i.in_flight)
            self.served.labels(role=i.role, url=i.url).set(i.served)

    def render(self) -> bytes:
        return generate_latest(self.registry)
