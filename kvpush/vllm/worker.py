"""The worker half of KVPushConnector: runs in vLLM's worker, owns kvpush's transfer runtimes.

One TransferRuntime per role this instance takes (kv_both: a prefill and a decode runtime, each with
its own NIXL agent, side channel and transfer thread) over vLLM's KV caches as they are: one tensor per
layer, ``[num_blocks, ...]`` each (transfer/descriptors.py: KVGeometry.from_layers). Each step:

    begin_step(StepMeta)  (vLLM binds the step's metadata, before the forward pass) LayerJobs kept
    layer_saved(l)   P, push-layerwise: vLLM's attention finished layer l of this step: its LayerJobs'
                     blocks of that layer go to the transfer thread (LayersDone), which writes them
    apply(StepMeta)  (vLLM 0.32 calls start_load_kv after the forward pass when no load is synchronous)
                     RecvJob -> Register (push) / Read (pull); HoldJob -> Hold; NotifyJob -> Release /
                     Abort to P; CancelJob -> Cancel. Nothing here blocks on the network.
    end_step()       (vLLM clears the metadata) LayerJobs dropped
    results(...)     the runtimes' events -> vLLM's sets:
                       P: FreeBlocks(transfer)  -> finished_sending (vLLM frees the request's blocks)
                       D: KVReady               -> finished_recving, blocks released
                          KVFailed              -> finished_recving + failed_recving; the transfer's
                                                   blocks stay quarantined
                          FreeBlocks(blocks)    -> once all of a failed transfer's blocks are back:
                                                   released (the scheduler drops its reference)
An idle step (nothing scheduled) with a transfer outcome awaited waits for the runtimes' wake-up, at
most ``idle_wait_ms``: vLLM's engine loop keeps stepping while transfers are pending, and would
otherwise spin a core.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpush.config import Role, apply_ucx_environment
from kvpush.errors import TransferError
from kvpush.protocol.vllm_params import KVAddress
from kvpush.transfer import protocol as pr
from kvpush.transfer.commands import Cancel, Hold, LayersDone, PeerAddr, Read, Register, SendNotif
from kvpush.transfer.events import FreeBlocks, KVFailed, KVReady
from kvpush.transfer.runtime import TransferRuntime
from kvpush.transfer.stats import TransferStats
from kvpush.vllm.config import ConnectorOptions
from kvpush.vllm.meta import CancelJob, HoldJob, NotifyJob, RecvJob, StepMeta, WorkerReport

log = logging.getLogger("kvpush.vllm")


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int


@dataclass
class Results:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    report: WorkerReport = field(default_factory=WorkerReport)


class WorkerSide:
    def __init__(self, options: ConnectorOptions, roles: tuple[Role, ...]) -> None:
        self.options = options
        self.roles = roles
        self.runtimes: dict[Role, TransferRuntime] = {}
        self._wake = threading.Event()
        self._receiving: dict[str, tuple[str, tuple[int, ...]]] = {}  # D request -> (transfer, blocks): awaited
        self._quarantined: dict[int, tuple[str, str]] = {}  # D block -> (request, transfer) failed, not all back
        self._unreleased: dict[str, set[int]] = {}
        self._holds: dict[str, str] = {}  # P transfer -> request
        self._layer_of: dict[str, int] = {}  # vLLM's layer name -> layer index in the registered layout
        self._layer_items: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()  # this step's LayerJobs
        self._device: torch.device | None = None
        self._unknown_layers: set[str] = set()
        self.fallbacks = 0  # D: requests computed locally (or failed) instead of receiving their KV
        self.block_size = 0
        self.changed = False  # a transfer event since the counters were last shipped

    def start(self, layers: Sequence[torch.Tensor], shape: KVShape, model_id: str, kv_format: str,
              names: Sequence[str] = ()) -> None:
        """Register vLLM's KV caches (one tensor per layer, named ``names`` in vLLM, in that order) and
        start a runtime per role."""
        apply_ucx_environment(gpu=layers[0].is_cuda)  # before the first NIXL agent of this process
        self._layer_of = {name: i for i, name in enumerate(names)}
        self._device = layers[0].device
        config = self.options.transfer()
        self.block_size = shape.block_size
        for i, role in enumerate(self.roles):
            if config.kv_port and i:  # a fixed port: the second role's side channel takes the next one
                config = type(config)(**{**config.__dict__, "kv_port": config.kv_port + 1})
            runtime = TransferRuntime(role, config, list(layers), shape, model_id, kv_format, self._wake.set)
            self.runtimes[role] = runtime.start()
            log.info("kvpush %s runtime %s: KV side channel at %s", role.value, runtime.engine_id,
                     runtime.kv_address)

    def addresses(self) -> dict[Role, KVAddress]:
        return {role: KVAddress(rt.engine_id, rt.kv_host, rt.kv_port) for role, rt in self.runtimes.items()}

    # ---- scheduler -> transfer threads -------------------------------------------------------
    def apply(self, meta: StepMeta) -> None:
        if meta:
            log.debug("step jobs: %s", meta)
        for job in meta.recv:
            self._recv(job)
        for hold in meta.hold:
            self._hold(hold)
        for notify in meta.notify:
            self._notify(notify)
        for cancel in meta.cancel:
            self._cancel(cancel)

    def begin_step(self, meta: StepMeta) -> None:
        """The step's metadata is bound, before its forward pass: its LayerJobs go out layer by layer."""
        self._layer_items = tuple((j.transfer_id, j.indices, j.block_ids) for j in meta.layers)

    def end_step(self) -> None:
        """The step is over: a later forward pass (without metadata of its own) hands nothing again."""
        self._layer_items = ()

    def layer_saved(self, layer_name: str) -> None:
        """vLLM finished ``layer_name`` of this step's forward pass (its save_kv_layer hook)."""
        if not self._layer_items:
            return
        layer = self._layer_of.get(layer_name)
        if layer is None:  # not a KV cache layer of ours: never stop vLLM's forward pass over it
            if layer_name not in self._unknown_layers:
                self._unknown_layers.add(layer_name)
                log.warning("save_kv_layer for %r, a layer vLLM did not register KV for: ignored", layer_name)
            return
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()  # the layer's KV writes are only queued
        self.runtimes[Role.PREFILL].thread.submit(LayersDone(layer, self._layer_items))

    def _recv(self, job: RecvJob) -> None:
        p, rt = job.leg, self.runtimes[Role.DECODE]
        peer = PeerAddr(p.prefill_engine_id, p.prefill_kv_host, p.prefill_kv_port)
        self._receiving[job.request_id] = (p.transfer_id, job.block_ids)
        if p.mode.is_push:
            rt.thread.submit(Register(p.transfer_id, job.request_id, peer, job.block_ids, job.num_prefix_tokens,
                                      job.num_tokens, job.deadline))
            return
        first = job.num_prefix_tokens // self.block_size
        remote = tuple((p.block_ids or [])[first: first + len(job.block_ids)])
        deadline = min(job.deadline, p.lease_expiry or job.deadline)
        rt.thread.submit(Read(p.transfer_id, job.request_id, peer, job.block_ids, remote, job.num_tokens,
                              deadline, p.lease_expiry))

    def _hold(self, job: HoldJob) -> None:
        self._holds[job.leg.transfer_id] = job.request_id
        self.runtimes[Role.PREFILL].thread.submit(Hold(job.leg.transfer_id, job.request_id, job.block_ids,
                                                       job.num_tokens, job.first_token_id, job.lease_expiry,
                                                       job.leg.decode_engine_id))

    def _notify(self, job: NotifyJob) -> None:
        p = job.leg
        peer = PeerAddr(p.prefill_engine_id, p.prefill_kv_host, p.prefill_kv_port)
        msg = pr.Release(p.transfer_id) if job.release else pr.Abort(p.transfer_id)
        self.fallbacks += job.fallback
        self.runtimes[Role.DECODE].thread.submit(SendNotif(peer, msg))

    def _cancel(self, job: CancelJob) -> None:
        self.runtimes[Role(job.role)].thread.submit(Cancel(job.transfer_id, job.reason, job.peer_engine_id))

    # ---- transfer threads -> vLLM ------------------------------------------------------------
    def results(self, meta: StepMeta | None) -> Results:
        for role, rt in self.runtimes.items():
            if not rt.thread.is_alive():  # its transfers would wait forever: stop vLLM with the reason
                raise TransferError(f"kvpush's {role.value} transfer thread died; see the log above")
        out = Results()
        if meta is not None and meta.idle and meta.waiting and not self._has_events():
            self._wake.wait(self.options.idle_wait_ms / 1000)
        self._wake.clear()
        for role, rt in self.runtimes.items():
            for event in rt.drain_events():
                log.debug("%s event %s", role.value, event)
                self.changed = True  # the counters moved: ship them with this step
                if role is Role.PREFILL:
                    self._prefill_event(event, out)
                else:
                    self._decode_event(event, out)
        return out

    def _has_events(self) -> bool:
        return any(not rt.events.empty() for rt in self.runtimes.values())

    def _prefill_event(self, event: Any, out: Results) -> None:
        if isinstance(event, FreeBlocks) and event.transfer_id is not None:
            request_id = self._holds.pop(event.transfer_id, None)
            if request_id is not None:
                out.finished_sending.add(request_id)

    def _decode_event(self, event: Any, out: Results) -> None:
        if isinstance(event, KVReady) and event.request_id in self._receiving:
            del self._receiving[event.request_id]
            out.finished_recving.add(event.request_id)
            out.report.released.add(event.request_id)
        elif isinstance(event, KVFailed) and event.request_id in self._receiving:
            transfer_id, blocks = self._receiving.pop(event.request_id)
            log.warning("request %s: KV from prefill did not arrive (%s); %s", event.request_id, event.reason,
                        "recomputed here" if self.options.on_kv_failure.value == "recompute" else "failed")
            self.fallbacks += 1
            out.finished_recving.add(event.request_id)
            out.failed_recving.add(event.request_id)
            self._unreleased[event.request_id] = set(blocks)
            self._quarantined.update(dict.fromkeys(blocks, (event.request_id, transfer_id)))
        elif isinstance(event, FreeBlocks):
            for block in event.block_ids:
                owner = self._quarantined.get(block)
                if owner is None or event.transfer_id not in (None, owner[1]):
                    continue  # not a failed transfer's block, or another transfer's word on it
                del self._quarantined[block]
                left = self._unreleased[owner[0]]
                left.discard(block)
                if not left:
                    del self._unreleased[owner[0]]
                    out.report.released.add(owner[0])

    # ---- the rest ----------------------------------------------------------------------------
    def stats(self) -> dict[str, TransferStats]:
        out = {}
        for role, rt in self.runtimes.items():
            stats = rt.thread.stats()
            if role is Role.DECODE:
                stats.local_fallbacks = self.fallbacks
            out[role.value] = stats
        return out

    def shutdown(self) -> None:
        for rt in self.runtimes.values():
            rt.shutdown()
        self.runtimes.clear()
