"""The scheduler half of KVPushConnector: runs in vLLM's scheduler (engine-core process), does no I/O.

Decode leg (D), a request's states as this half sees them:
    on_new_request: leg parsed, deadline = now + kv_timeout_s
    -> get_num_new_matched_tokens: every prompt token D's prefix cache lacks, loaded asynchronously
       (past the deadline: none; the request is computed locally and P is told to Abort)
    -> update_state_after_alloc: the blocks for those tokens get one more reference (ours: vLLM cannot
       reuse them while a WRITE or READ may land, whatever happens to the request), RecvJob to the worker
       (nothing to receive: P is told to Release) -> vLLM's WAITING_FOR_REMOTE_KVS
    -> the worker reports the request in finished_recving (and failed_recving on failure: vLLM
       recomputes it, or fails it with kv_load_failure_policy "fail")
    -> WorkerReport.released: our reference goes (at once when the KV landed; after the quarantine
       when the transfer failed or was cancelled)
    request_finished while the KV is arriving: CancelJob (vLLM keeps the request until the worker
    reports it in finished_recving, which it does once the transfer has ended).
Prefill leg (P):
    push-layerwise only: each step that schedules its prompt tokens hands the worker a LayerJob (the
    blocks those tokens complete), written layer by layer during that step's forward pass; a
    preemption cancels the leg (its handed blocks go back to vLLM at once: D recomputes)
    request_finished, stopped normally with its blocks: HoldJob, (True, P's answer): vLLM keeps the
    blocks until the worker reports the request in finished_sending (transfer done, D released or
    aborted, or the lease expired); ended otherwise: CancelJob (D is told), blocks freed at once.
InfoQuery: request_finished answers with this instance's engine ids and side-channel addresses.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvpush.config import KVMode, Role
from kvpush.errors import InvalidRequestError
from kvpush.protocol import kv_params as kp
from kvpush.protocol.vllm_params import ConnectorInfo, KVAddress, prefill_result
from kvpush.transfer.layerwise import blocks_complete
from kvpush.vllm import legs
from kvpush.vllm.config import ConnectorOptions
from kvpush.vllm.meta import CancelJob, HoldJob, LayerJob, NotifyJob, RecvJob, StepMeta, WorkerReport

log = logging.getLogger("kvpush.vllm")
STOPPED = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")  # vLLM's RequestStatus names of a normal end


@dataclass
class _Decode:
    leg: legs.Leg
    deadline: float
    started: bool = False  # update_state_after_alloc ran: RecvJob, Release or Abort sent
    receiving: bool = False  # a RecvJob's outcome is not reported yet

    @property
    def params(self) -> kp.DecodeLegParams:
        assert isinstance(self.leg.params, kp.DecodeLegParams)
        return self.leg.params


@dataclass
class _Layerwise:
    """A push-layerwise prefill leg: its block table as vLLM's steps announce it, how much was handed."""

    leg: legs.Leg
    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    handed: int = 0  # blocks handed to the worker so far (never again)
    cancelled: bool = False  # preempted after handing blocks: no Hold at the end


@dataclass(frozen=True)
class LegStep:
    """What one vLLM step schedules for a push-layerwise prefill leg (from vLLM's SchedulerOutput)."""

    request_id: str
    num_computed_tokens: int  # before this step
    num_scheduled_tokens: int
    new_block_ids: tuple[int, ...]  # blocks allocated for it this step (all of them when resumed)
    resumed: bool = False


@dataclass
class Counters:
    invalid_params: int = 0
    late: int = 0  # D: the deadline passed before blocks were allocated (computed locally)
    released: int = 0  # D: nothing to receive (prefix cache)
    held_prefills: int = 0


@dataclass
class SchedulerSide:
    options: ConnectorOptions
    roles: tuple[Role, ...]
    block_size: int
    pool: Any = None  # vLLM's BlockPool (touch / free_blocks), bound after construction
    addresses: dict[Role, KVAddress] = field(default_factory=dict)  # the worker's handshake metadata
    states: dict[str, legs.Leg | _Decode | legs.InfoQuery] = field(default_factory=dict)
    held: dict[str, list[Any]] = field(default_factory=dict)  # D request -> blocks we hold a reference on
    sending: dict[str, str] = field(default_factory=dict)  # P request whose blocks vLLM keeps -> its transfer
    prefill_ids: set[str] = field(default_factory=set)  # transfer ids of P's live legs (one request each)
    layerwise: dict[str, _Layerwise] = field(default_factory=dict)  # P request -> its push-layerwise leg
    layerwise_ok: bool = True  # False: vLLM's configuration forbids it; push-layerwise legs are written whole
    counters: Counters = field(default_factory=Counters)
    _meta: StepMeta = field(default_factory=StepMeta)

    # ---- requests ----------------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        try:
            parsed = legs.parse(request.kv_transfer_params, self.roles, self.options.mode)
        except InvalidRequestError as e:
            self.counters.invalid_params += 1
            log.error("request %s: %s; it is computed here without a transfer", request.request_id, e)
            return
        if isinstance(parsed, legs.Leg) and parsed.role is Role.DECODE:
            self.states[request.request_id] = _Decode(parsed, time.time() + self.options.kv_timeout_s)
        elif isinstance(parsed, legs.Leg) and parsed.params.transfer_id in self.prefill_ids:
            self.counters.invalid_params += 1
            log.error("request %s: transfer %s belongs to another live prefill leg; it is computed here without "
                      "a transfer", request.request_id, parsed.params.transfer_id)
        elif parsed is not None:
            self.states[request.request_id] = parsed
            if isinstance(parsed, legs.Leg):
                self.prefill_ids.add(parsed.params.transfer_id)
                if parsed.params.mode is KVMode.PUSH_LAYERWISE and self.layerwise_ok:
                    self.layerwise[request.request_id] = _Layerwise(parsed, request.num_prompt_tokens)

    def matched(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        st = self.states.get(request.request_id)
        if not isinstance(st, _Decode) or st.started or time.time() >= st.deadline:
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self.states.get(request.request_id)
        if not isinstance(st, _Decode) or st.started:
            return
        st.started = True
        if num_external_tokens == 0:
            late = time.time() >= st.deadline
            self.counters.late += late
            self.counters.released += not late
            if late:
                log.warning("request %s: its KV deadline passed before decode capacity was free; computed "
                            "locally", request.request_id)
            self._meta.notify.append(NotifyJob(st.params, release=not late, fallback=late))
            return
        group = list(blocks.blocks[0])
        n = request.num_prompt_tokens
        local, partial = divmod(n - num_external_tokens, self.block_size)  # D's prefix-cache blocks come first
        transfer = group[local: -(-n // self.block_size)]
        if partial or any(b.block_hash is not None or b.is_null for b in transfer):
            log.error("request %s: vLLM loads %d of %d tokens into blocks that are not all fresh; the transfer "
                      "goes on, but report this", request.request_id, num_external_tokens, n)
        self.pool.touch(transfer)
        self.held[request.request_id] = transfer
        st.receiving = True
        self._meta.recv.append(RecvJob(request.request_id, st.params, tuple(b.block_id for b in transfer),
                                       local * self.block_size, n, st.deadline))

    def finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        st = self.states.pop(request.request_id, None)
        if isinstance(st, legs.InfoQuery):
            return False, self.info()
        if isinstance(st, _Decode):
            if not st.started:  # ended before blocks were allocated: P holds the KV for nothing
                self._meta.notify.append(NotifyJob(st.params, release=False))
            elif st.receiving:
                self._meta.cancel.append(CancelJob(Role.DECODE.value, st.params.transfer_id,
                                                   f"decode {request.status.name.lower()}", st.params.prefill_engine_id))
            return False, None
        layerwise = self.layerwise.pop(request.request_id, None)
        if isinstance(st, legs.Leg):
            return self._prefill_done(request, st, block_ids, hold=layerwise is None or not layerwise.cancelled)
        return False, None

    def _prefill_done(self, request: Any, leg: legs.Leg, block_ids: list[int],
                      hold: bool = True) -> tuple[bool, dict[str, Any] | None]:
        """P's answer. ``hold`` False: the transfer was cancelled at a preemption (D was told and
        recomputes): the blocks are freed at once, and P still answers as usual (the proxy waits for D)."""
        params = leg.params
        assert isinstance(params, kp.PrefillLegParams)
        n = request.num_prompt_tokens
        blocks = tuple(block_ids[: -(-n // self.block_size)])
        if request.status.name not in STOPPED or not request.output_token_ids or not blocks:
            self.prefill_ids.discard(params.transfer_id)
            self._meta.cancel.append(CancelJob(Role.PREFILL.value, params.transfer_id,
                                               f"prefill {request.status.name.lower()}", params.decode_engine_id))
            return False, None
        address = self.addresses[Role.PREFILL]
        lease = time.time() + self.options.kv_lease_s
        first = int(request.output_token_ids[0])
        if hold:
            self._meta.hold.append(HoldJob(request.request_id, params, blocks, n, first, lease))
            self.sending[request.request_id] = params.transfer_id
            self.counters.held_prefills += 1
        else:
            self.prefill_ids.discard(params.transfer_id)
        pull = params.mode is KVMode.PULL
        result = kp.PrefillResult(transfer_id=params.transfer_id, mode=params.mode,
                                  prefill_engine_id=address.engine_id, prefill_kv_host=address.kv_host,
                                  prefill_kv_port=address.kv_port, num_tokens=n,
                                  block_ids=list(blocks) if pull else [], lease_expiry=lease if pull else None,
                                  first_token_id=first)
        return hold, prefill_result(result) if leg.vllm_shaped else kp.params_to_dict(result)

    def info(self) -> dict[str, Any]:
        """The answer to an InfoQuery (the proxy's discovery of a vLLM instance)."""
        info = ConnectorInfo(kv_mode=self.options.mode.value, block_size=self.block_size,
                             roles={role.value: a for role, a in self.addresses.items()})
        out: dict[str, Any] = msgspec.to_builtins(info)
        return out

    # ---- steps -------------------------------------------------------------------------------
    def build_meta(self, num_scheduled_tokens: int, steps: tuple[LegStep, ...] = (),
                   preempted: frozenset[str] = frozenset()) -> StepMeta:
        """This step's jobs. ``steps``: what it schedules for push-layerwise legs; ``preempted``: the
        requests vLLM preempted in it (their blocks are freed)."""
        for request_id in preempted & self.layerwise.keys():
            self._preempted(self.layerwise[request_id])
        for step in steps:
            self._layer_job(step)
        meta, self._meta = self._meta, StepMeta()
        meta.idle = num_scheduled_tokens == 0
        meta.waiting = bool(self.sending or self.held)
        return meta

    def _layer_job(self, step: LegStep) -> None:
        """The blocks this step's tokens complete (the last chunk: also its partial last block)."""
        lw = self.layerwise.get(step.request_id)
        if lw is None:
            return
        if step.resumed and lw.handed:
            self._preempted(lw)  # resumed with new blocks, its preemption unseen: what was handed is stale
        if lw.cancelled:
            return
        if step.resumed:
            lw.block_ids = []
        lw.block_ids += step.new_block_ids
        end = step.num_computed_tokens + step.num_scheduled_tokens  # past the prompt (decode): nothing more
        last = min(blocks_complete(end, lw.num_prompt_tokens, self.block_size), len(lw.block_ids))
        if last > lw.handed:
            indices = tuple(range(lw.handed, last))
            self._meta.layers.append(LayerJob(lw.leg.params.transfer_id, indices,
                                              tuple(lw.block_ids[i] for i in indices)))
            lw.handed = last

    def _preempted(self, lw: _Layerwise) -> None:
        """vLLM freed a push-layerwise leg's blocks: what was handed may be rewritten under a WRITE, so the
        transfer is cancelled (D recomputes; its blocks stay quarantined) and nothing more is handed."""
        if lw.cancelled:
            return
        if lw.handed == 0:
            lw.block_ids = []  # nothing handed yet: it starts over when resumed
            return
        params = lw.leg.params
        assert isinstance(params, kp.PrefillLegParams)
        lw.cancelled = True
        self._meta.cancel.append(CancelJob(Role.PREFILL.value, params.transfer_id, "prefill preempted",
                                           params.decode_engine_id))

    def on_output(self, finished_sending: set[str] | None, finished_recving: set[str] | None,
                  report: WorkerReport | None) -> None:
        for request_id in finished_sending or ():
            self.prefill_ids.discard(self.sending.pop(request_id, ""))
        for request_id in finished_recving or ():
            st = self.states.get(request_id)
            if isinstance(st, _Decode):
                st.receiving = False
        for request_id in report.released if report is not None else ():
            blocks = self.held.pop(request_id, None)
            if blocks:
                self.pool.free_blocks(blocks)

    def has_pending_work(self) -> bool:
        """Keeps vLLM stepping while P holds blocks or D holds references (their ends come via steps)."""
        return bool(self.sending or self.held or self._meta)
