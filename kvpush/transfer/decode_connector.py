"""The decode side (D) of a disaggregated deployment: its KV connector.

Request lifecycle on D:
    admitted with DecodeLegParams -> WAITING (until a sequence slot is free)
    -> no free blocks: refused (429, shed kv_cache_full), P is told to Abort
    -> blocks allocated; D's prefix cache covers the first blocks, the rest is received:
         nothing to receive (push with --first-token recompute: also when under a block is missing,
         which D computes itself): P is told to Release; the request runs at once
         push: PushReg sent to P (Register)     pull: READ of P's blocks posted (Read)
       -> WAITING_FOR_REMOTE_KV
    -> KVReady: num_computed_tokens = tokens received (prompt, or prompt - 1 when D recomputes
       the last position); with first-token from-prefill P's token is D's first output
       -> WAITING (front of the queue) -> RUNNING: decodes as any request.
    -> KVFailed (P's Fail, deadline, post error): the transfer's blocks are detached and stay
       quarantined until nothing can land in them; the request fails with an error or is
       recomputed locally (--on-kv-failure). It never decodes from KV that did not fully arrive.
A request aborted while its KV is arriving cancels the transfer the same way (P is told to Abort).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvpush.config import FirstToken, KVMode, OnKVFailure, TransferConfig
from kvpush.engine.admission import ShedReason
from kvpush.engine.kv_connector import Admission
from kvpush.engine.request import Request, RequestStatus
from kvpush.errors import InvalidRequestError
from kvpush.protocol.kv_params import DecodeLegParams, RequestLegParams
from kvpush.transfer import protocol as pr
from kvpush.transfer.commands import Cancel, PeerAddr, Read, Register, SendNotif
from kvpush.transfer.events import FreeBlocks, KVFailed, KVReady
from kvpush.transfer.runtime import RuntimeConnector, TransferRuntime
from kvpush.transfer.stats import TransferStats

log = logging.getLogger("kvpush.decode")


@dataclass
class DecodeState:
    params: DecodeLegParams
    deadline: float
    admitted: bool = False
    pending: bool = False  # the transfer is under way (registered or read posted, no outcome yet)
    lease_until: float | None = None  # pull: P's lease on its blocks, as renewed by us
    lease_s: float = 0.0  # how long each renewal extends P's lease
    renewed_at: float = 0.0
    need_len: int = 0  # prompt tokens whose KV D must hold before decoding
    transfer_blocks: tuple[int, ...] = ()

    @property
    def peer(self) -> PeerAddr:
        p = self.params
        return PeerAddr(p.prefill_engine_id, p.prefill_kv_host, p.prefill_kv_port)


class DecodeConnector(RuntimeConnector):
    decodes = True

    def __init__(self, runtime: TransferRuntime, config: TransferConfig) -> None:
        super().__init__(runtime, config)
        self.fallbacks = 0
        self.requests: dict[str, Request] = {}  # transfer id -> request (from on_add to on_finished)

    def on_add(self, request: Request, kv_transfer_params: RequestLegParams | None) -> None:
        if kv_transfer_params is None:
            return  # a plain request: computed locally
        params = self.leg(kv_transfer_params, DecodeLegParams)
        if params.num_tokens is not None and params.num_tokens != request.num_prompt_tokens:
            raise InvalidRequestError(f"prefill computed {params.num_tokens} tokens but this request has "
                                      f"{request.num_prompt_tokens}", param="kv_transfer_params")
        now = time.time()
        # Pull: P said how long it holds the blocks; push: P's lease starts when its prefill ends, so
        # D assumes the deployment's --kv-lease-s (set it alike on P and D).
        lease_s = params.lease_expiry - now if params.lease_expiry is not None else self.config.kv_lease_s
        request.remote_prefill = True
        request.kv_state = DecodeState(params, deadline=now + self.config.kv_timeout_s,
                                       lease_until=params.lease_expiry, lease_s=max(lease_s, 0.1), renewed_at=now)
        self.requests[params.transfer_id] = request

    # ---- admission -----------------------------------------------------------------------
    def admit(self, request: Request) -> Admission:
        st = request.kv_state
        if not isinstance(st, DecodeState) or st.admitted:
            return Admission.RUN
        if time.time() >= st.deadline:
            return self._late(request, st)
        hooks, bs, n = self.hooks, self.hooks.block_size, request.num_prompt_tokens
        st.need_len = n if self._from_prefill(st) else n - 1
        hits = hooks.cached_prefix(request.prompt_token_ids[: st.need_len])
        if st.params.mode.is_push and st.need_len == n:
            hits = hits[: (n - 1) // bs]  # P's first token rides on Done: leave at least one block to push
        if self._tail_is_local(st, len(hits) * bs):
            st.need_len = len(hits) * bs  # D computes the few tokens after its prefix itself: P not awaited
        if not hooks.allocate(request, n - len(hits) * bs, hits):
            return self._no_blocks(request, st, n - len(hits) * bs)
        st.admitted = True
        request.num_cached_tokens = len(hits) * bs
        st.transfer_blocks = tuple(request.block_table[len(hits) : -(-st.need_len // bs)])
        request.trace.set("d_admitted" if st.params.mode is KVMode.PULL else "d_registered", time.time())
        if st.transfer_blocks:
            self._start_transfer(request, st, len(hits))
        else:
            self._nothing_to_receive(request, st)
        return Admission.PARK

    def _tail_is_local(self, st: DecodeState, held: int) -> bool:
        """Push with D recomputing the last position, and D's prefix cache holding all but a partial
        block (fewer than block_size tokens) of what it would receive: D computes that tail itself, as it
        computes the last position anyway, rather than wait for P's whole prefill to push one block (the
        full-hit case; P is told to Release). Pull keeps reading: P has finished when D hears of it."""
        tail = st.need_len - held
        return st.params.mode.is_push and not self._from_prefill(st) and held > 0 and tail < self.hooks.block_size

    def _late(self, request: Request, st: DecodeState) -> Admission:
        """The KV deadline passed while the request waited for blocks: give P its blocks back and
        compute locally or fail, as --on-kv-failure says."""
        self.runtime.thread.submit(SendNotif(st.peer, pr.Abort(st.params.transfer_id)))
        if self.config.on_kv_failure is OnKVFailure.RECOMPUTE:
            self._compute_locally(request, st, "deadline passed before decode capacity was free")
            return Admission.RUN
        request.error = "KV transfer from prefill failed: deadline passed before decode capacity was free"
        return Admission.REJECT

    def _no_blocks(self, request: Request, st: DecodeState, num_tokens: int) -> Admission:
        """No free blocks to register: refuse rather than wait (P's KV would stay pinned meanwhile).
        P is told (Abort) and frees its copy; the client gets 429 with Retry-After."""
        self.refuse(st.params)
        request.error = (f"KV cache full: decode has no free blocks for the {num_tokens} tokens this "
                         "transfer needs")
        request.shed = ShedReason.KV_CACHE_FULL.value
        return Admission.REJECT

    def refuse(self, params: RequestLegParams) -> None:
        if isinstance(params, DecodeLegParams) and self.runtime.mode.accepts(params.mode):
            peer = PeerAddr(params.prefill_engine_id, params.prefill_kv_host, params.prefill_kv_port)
            self.runtime.thread.submit(SendNotif(peer, pr.Abort(params.transfer_id)))

    def _renew_leases(self) -> None:
        """Requests still waiting for blocks keep P's copy of their KV alive (LeaseRenew)."""
        now = time.time()
        for request in self.requests.values():
            st = request.kv_state
            if isinstance(st, DecodeState) and not st.admitted and now - st.renewed_at > st.lease_s / 3:
                st.renewed_at, st.lease_until = now, now + st.lease_s
                self.runtime.thread.submit(SendNotif(st.peer, pr.LeaseRenew(st.params.transfer_id, now + st.lease_s)))

    def _from_prefill(self, st: DecodeState) -> bool:
        return st.params.first_token is FirstToken.FROM_PREFILL

    def _start_transfer(self, request: Request, st: DecodeState, first: int) -> None:
        p, bs = st.params, self.hooks.block_size
        st.pending = True
        if p.mode.is_push:
            cmd: Register | Read = Register(p.transfer_id, request.request_id, st.peer, st.transfer_blocks,
                                            first * bs, request.num_prompt_tokens, st.deadline)
        else:
            remote = tuple((p.block_ids or [])[first : first + len(st.transfer_blocks)])
            deadline = min(st.deadline, st.lease_until or st.deadline)
            cmd = Read(p.transfer_id, request.request_id, st.peer, st.transfer_blocks, remote,
                       request.num_prompt_tokens, deadline, st.lease_until)
        self.runtime.thread.submit(cmd)

    def _nothing_to_receive(self, request: Request, st: DecodeState) -> None:
        """D's prefix cache holds every block it needs: P may free its copy. The request becomes ready
        through the same event as a finished transfer (so a first token from P is emitted as output)."""
        self.runtime.thread.submit(SendNotif(st.peer, pr.Release(st.params.transfer_id)))
        self.runtime.post(KVReady(st.params.transfer_id, request.request_id, st.params.first_token_id))

    # ---- events --------------------------------------------------------------------------
    def poll(self) -> list[Request]:
        self._renew_leases()
        out: list[Request] = []
        for event in self.runtime.drain_events():
            if isinstance(event, FreeBlocks):
                self.hooks.free_blocks(event.block_ids)
            elif isinstance(event, KVReady):
                self._ready(event, out)
            elif isinstance(event, KVFailed):
                self._failed(event, out)
        return out

    def _request_of(self, transfer_id: str, request_id: str) -> tuple[Request, DecodeState] | None:
        request = self.requests.get(transfer_id)
        st = request.kv_state if request is not None else None
        if (request is None or request.request_id != request_id or not isinstance(st, DecodeState)
                or request.status is not RequestStatus.WAITING_FOR_REMOTE_KV):
            return None  # aborted meanwhile, or not ours: the ledger already made it harmless
        return request, st

    def _ready(self, event: KVReady, out: list[Request]) -> None:
        found = self._request_of(event.transfer_id, event.request_id)
        if found is None:
            return
        request, st = found
        st.pending = False
        for name, t in event.trace:
            request.trace.set(name, t)
        request.trace.d_ready = time.time()
        if self.config.faults.corrupt_kv:
            self.hooks.corrupt_block(st.transfer_blocks[0])
        request.num_computed_tokens = st.need_len
        if st.need_len == request.num_prompt_tokens:
            token = event.first_token_id if event.first_token_id is not None else st.params.first_token_id
            if token is None:
                self._failed(KVFailed(event.transfer_id, event.request_id, "P sent no first token"), out)
                return
            self.hooks.append_token(request, token)
            out.append(request)
            if request.is_finished:
                return
        self.hooks.resume(request)

    def _failed(self, event: KVFailed, out: list[Request]) -> None:
        found = self._request_of(event.transfer_id, event.request_id)
        if found is None:
            return
        request, st = found
        self._detach(request, st)
        if self.config.on_kv_failure is OnKVFailure.RECOMPUTE:
            self._compute_locally(request, st, event.reason)
            self.hooks.free(request)
            request.num_computed_tokens = request.num_cached_tokens = 0
            self.hooks.resume(request)  # front of the queue, computed locally from scratch
            return
        request.error = f"KV transfer from prefill failed: {event.reason}"
        self.hooks.finish(request, RequestStatus.FINISHED_ERROR)
        out.append(request)

    def _compute_locally(self, request: Request, st: DecodeState, reason: str) -> None:
        """--on-kv-failure recompute: the request becomes a plain one (counted, logged, stamped)."""
        self.fallbacks += 1
        log.warning("transfer %s: KV from prefill %s did not arrive (%s); request %s is computed locally "
                    "(--on-kv-failure recompute)", st.params.transfer_id, st.params.prefill_engine_id, reason,
                    request.request_id)
        request.trace.kv_fallback_local = time.time()  # stamped in the response: never a silent re-prefill
        self.requests.pop(st.params.transfer_id, None)
        request.kv_state = None
        request.remote_prefill = False

    def stats(self) -> TransferStats:
        stats = super().stats()
        stats.local_fallbacks = self.fallbacks
        return stats

    def _detach(self, request: Request, st: DecodeState) -> None:
        """Take the transfer's blocks out of the request: they come back via FreeBlocks when safe."""
        st.pending = False
        held = set(st.transfer_blocks)
        request.block_table = [b for b in request.block_table if b not in held]
        self.hooks.uncache(list(held))

    def on_finished(self, request: Request) -> bool:
        st = request.kv_state
        if isinstance(st, DecodeState):
            self.requests.pop(st.params.transfer_id, None)
        if isinstance(st, DecodeState) and st.pending:
            self._detach(request, st)
            self.runtime.thread.submit(Cancel(st.params.transfer_id, f"decode {request.status.value}",
                                              st.params.prefill_engine_id))
        elif isinstance(st, DecodeState) and not st.admitted and request.status is RequestStatus.FINISHED_ABORTED:
            # Aborted while waiting for blocks (client gone, shutdown): P holds the KV for us, tell it now.
            self.runtime.thread.submit(SendNotif(st.peer, pr.Abort(st.params.transfer_id)))
        return False

