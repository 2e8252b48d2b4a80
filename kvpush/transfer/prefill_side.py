"""P's side of the transfer thread: hold finished prefills, match registrations, post WRITEs
(whole-request or layer by layer), commit, and free P's blocks when a transfer ends.

    Hold (prefill done) -+-> [PushReg matched] (behind the WRITE in flight to that D) WRITE posted
                         |       -> WRITE done -> FreeBlocks
                         +-> [pull] ReadDone / Release -> FreeBlocks
    lease expiry / Abort / Fail -> FreeBlocks (+ Fail to D)

Every method runs on the transfer thread (thread.py), which owns this object.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvpush.errors import TransferError
from kvpush.transfer import protocol as pr
from kvpush.transfer.commands import Cancel, Hold, LayersDone
from kvpush.transfer.events import FreeBlocks
from kvpush.transfer.kv_agent import Transfer, XferStatus
from kvpush.transfer.layerwise import LayerwiseTransfer, LayerwiseWriter
from kvpush.transfer.ledger import LedgerError, TransferRecord
from kvpush.transfer.ledger import TransferState as S
from kvpush.transfer.peers import Peers
from kvpush.transfer.posted import Posted
from kvpush.transfer.records import FailureKind

CANCELLED_TTL_S = 300.0


class PrefillSide:
    def __init__(self, posted: Posted, peers: Peers, layerwise: bool | None, writes_per_peer: int = 1) -> None:
        """layerwise: every transfer is written layer by layer (True), none is (False), or those whose
        leg says so (None, --kv-mode auto: the engine's first LayersDone for a transfer tells).
        writes_per_peer: whole-request WRITEs in flight to one D at a time (0: no limit); the rest wait
        in arrival order (MATCHED) and are posted as earlier ones end."""
        self.writes_per_peer = writes_per_peer
        self.waiting_writes: dict[str, dict[str, None]] = {}  # D's agent name -> transfer ids, in order
        self.posted = posted
        self.ledger = posted.ledger
        self.peers = peers
        geometry = posted.agent.geometry
        self.layerwise = (LayerwiseWriter(posted.agent, geometry.num_layers)
                          if layerwise is not False and geometry else None)
        self.per_transfer = layerwise is None
        self.first_tokens: dict[str, int | None] = {}
        self.cancelled: dict[str, tuple[str, float]] = {}  # id -> (reason, when): cancelled before any record
        self.reg_times: dict[str, float] = {}  # when each PushReg arrived (for the breakdown)

    def handlers(self) -> dict[type, Callable[[Any], None]]:
        return {Hold: self._hold, LayersDone: self._layers_done, Cancel: self._cancel}

    # ---- commands --------------------------------------------------------------------------
    def _hold(self, cmd: Hold) -> None:
        self.first_tokens[cmd.transfer_id] = cmd.first_token_id
        try:
            rec = self.ledger.on_prefill_done(cmd.transfer_id, cmd.request_id, cmd.block_ids, cmd.lease_deadline,
                                              peer_engine_id=cmd.decode_engine_id, num_tokens=cmd.num_tokens)
        except LedgerError:  # the ledger refused the Hold and took none of its blocks: give them back
            self.posted.emit(FreeBlocks(list(cmd.block_ids), cmd.transfer_id))
            raise
        self._update(rec)

    def _layers_done(self, cmd: LayersDone) -> None:
        assert self.layerwise is not None
        for tid, indices, block_ids in cmd.items:
            rec = self.ledger.get(tid)
            if rec is not None and rec.is_terminal:
                continue  # ended (aborted, expired, D had it all): nothing more is written for it
            known = tid in self.layerwise.transfers
            self.layerwise.layers_done(tid, cmd.layer, indices, block_ids)
            if not known and self.per_transfer and rec is not None:
                self._update(rec)  # D registered before P knew this transfer goes layer by layer
            else:
                self.layerwise.post_ready(tid)

    def _cancel(self, cmd: Cancel) -> None:
        if self.layerwise is not None and not self.layerwise.in_flight(cmd.transfer_id):
            self.layerwise.drop(cmd.transfer_id)  # the prefill stopped: no more layers come for it
        rec = self.ledger.get(cmd.transfer_id)
        if rec is None:  # aborted before D registered: answer its PushReg with Fail
            self.cancelled[cmd.transfer_id] = (cmd.reason, time.monotonic())
            if cmd.peer_engine_id is not None:
                self.peers.send(cmd.peer_engine_id, pr.Fail.create(cmd.transfer_id, cmd.reason))
        elif not rec.is_terminal:
            self.fail(rec, cmd.reason, kind=FailureKind.CANCELLED)

    def lost(self, cmd: object, reason: str) -> None:
        """A command failed before its transfer had a record: nothing is held for it."""

    # ---- messages from D -------------------------------------------------------------------
    def on_message(self, msg: pr.Message, engine_id: str) -> None:
        tid = msg.transfer_id
        if isinstance(msg, pr.PushReg) and tid in self.cancelled:
            self.peers.send(engine_id, pr.Fail.create(tid, self.cancelled.pop(tid)[0]))
            return
        before = self.ledger.get(tid)
        rec = self.ledger.on_notification(msg, engine_id)
        if rec is None:
            if isinstance(msg, pr.PushReg) and before is not None and before.state in (S.FAILED, S.EXPIRED):
                self.peers.send(engine_id, pr.Fail.create(tid, before.error or "transfer already ended"))
            return
        if isinstance(msg, pr.PushReg):
            self.reg_times[tid] = time.time()
        if isinstance(msg, pr.Abort) and not self._posting(tid):
            self.peers.send(engine_id, pr.Fail.create(tid, "aborted by decode"))  # ack: nothing in flight
        self._update(rec)

    def _update(self, rec: TransferRecord) -> None:
        """The record changed: post what can be posted, or free what is no longer needed."""
        try:
            if self._is_layerwise(rec.transfer_id) and not rec.is_terminal:
                self._layerwise_update(rec)
            elif rec.state is S.MATCHED:
                self._post_write(rec)
            elif rec.is_terminal and rec.has_local and not self._posting(rec.transfer_id):
                self._free(rec)
        except (TransferError, ValueError) as e:
            self.fail(rec, str(e))

    def _is_layerwise(self, tid: str) -> bool:
        if self.layerwise is None:
            return False
        return not self.per_transfer or tid in self.layerwise.transfers

    def _posting(self, tid: str) -> bool:
        """Some WRITE of ours for this transfer is still in flight."""
        return tid in self.posted or (self.layerwise is not None and self.layerwise.in_flight(tid))

    # ---- whole-request push ----------------------------------------------------------------
    def _post_write(self, rec: TransferRecord, queued: bool = False) -> None:
        """Post the WRITE, or queue it behind the WRITEs to the same D (`queued`: it was at the head of
        that queue). A queued record whose deadline passed meanwhile fails instead of being posted."""
        skip = rec.num_prefix_tokens // self.posted.block_size
        remote = list(rec.remote_block_ids)
        local = list(rec.local_block_ids[skip : skip + len(remote)])
        if len(local) < len(remote):
            raise TransferError(f"D registered {len(remote)} blocks but P holds {len(local)} after the prefix")
        peer = self.peers.agent_name(rec.peer_engine_id or "")
        full = self._full(peer)
        if full or (not queued and self.waiting_writes.get(peer)):
            self.waiting_writes.setdefault(peer, {})[rec.transfer_id] = None  # stays MATCHED
            if not full:  # queued only to keep the order: the oldest waiting goes now
                self._post_waiting(peer)
            return
        if queued and time.time() >= rec.deadline:
            self.fail(rec, "deadline passed while queued behind WRITEs to the same decode instance",
                      kind=FailureKind.DEADLINE)
            return
        done = pr.encode(pr.Done(rec.transfer_id, self.first_tokens.get(rec.transfer_id),
                                 reg_received=self.reg_times.pop(rec.transfer_id, None), write_posted=time.time()))
        self.peers.check_post_fault("WRITE")
        if self.peers.drop_fault():
            done = b""  # the WRITE lands but D never hears of it: D's deadline must handle it
        error = self.posted.track(rec, self.posted.agent.write(peer, local, remote, done))
        if error is not None:
            self.fail(rec, error, kind=FailureKind.POSTED_LATE)

    def _full(self, peer: str) -> bool:
        """`writes_per_peer` WRITEs of live records are in flight to `peer` (one whose record already
        failed or expired does not count: a WRITE that never ends must not hold up the rest)."""
        return bool(self.writes_per_peer) and self.posted.live_peers()[peer] >= self.writes_per_peer

    def _post_waiting(self, peer: str) -> None:
        """Post the WRITEs waiting for `peer`, oldest first, while the limit allows (a waiting record
        that failed or expired meanwhile is skipped: it is no longer MATCHED). Called when a WRITE
        ends, and from housekeeping (whatever else freed a slot)."""
        waiting = self.waiting_writes.get(peer, {})
        while waiting and not self._full(peer):
            tid = next(iter(waiting))
            del waiting[tid]
            rec = self.ledger.get(tid)
            if rec is not None and rec.state is S.MATCHED:
                try:
                    self._post_write(rec, queued=True)
                except (TransferError, ValueError) as e:
                    self.fail(rec, str(e))
        if not waiting:
            self.waiting_writes.pop(peer, None)

    def transfer_ended(self, tid: str, transfer: Transfer, state: XferStatus) -> None:
        try:
            self._transfer_ended(tid, transfer, state)
        finally:
            self._post_waiting(transfer.peer)

    def _transfer_ended(self, tid: str, transfer: Transfer, state: XferStatus) -> None:
        rec = self.ledger.get(tid)
        if rec is None:
            return
        if rec.is_terminal:  # aborted while in flight: now nothing is
            self._free(rec)
            if rec.peer_engine_id:
                self.peers.send(rec.peer_engine_id, pr.Fail.create(tid, "aborted; write ended"))
        elif state is XferStatus.DONE:
            self.posted.metrics.observe(transfer)
            self._free(self.ledger.mark_done(tid))
        else:
            self.fail(rec, transfer.error or "transfer failed", confirmed=True)

    # ---- layer-wise push -------------------------------------------------------------------
    def _layerwise_update(self, rec: TransferRecord) -> None:
        """Registration known: post what is finished; prefill done too (MATCHED): mark POSTED."""
        assert self.layerwise is not None
        t = self.layerwise.get(rec.transfer_id)
        if rec.has_remote and t.remote is None:
            peer = self.peers.agent_name(rec.peer_engine_id or "")
            self.layerwise.registered(rec.transfer_id, peer, list(rec.remote_block_ids),
                                      rec.num_prefix_tokens // self.posted.block_size)
            self.reg_times.setdefault(rec.transfer_id, time.time())
        if rec.state is S.MATCHED:
            t.prefill_done = True
            self.peers.check_post_fault("WRITE")
            self.ledger.mark_posted(rec.transfer_id)
        self.layerwise.post_ready(rec.transfer_id)
        self._layerwise_settled(rec.transfer_id)

    def in_flight_peers(self) -> set[str]:
        """Peers (agent names) that layer writes of ours are in flight to."""
        if self.layerwise is None:
            return set()
        return {t.peer for t in self.layerwise.transfers.values() if t.in_flight and t.peer}

    def poll(self) -> bool:
        """Poll the layer writes in flight; settle the transfers whose writes all ended."""
        settled = self.layerwise.poll() if self.layerwise is not None else []
        for tid in settled:
            self._layerwise_settled(tid)
        return bool(settled)

    def _layerwise_settled(self, tid: str) -> None:
        """All posted layer writes ended: fail, or commit once everything D needs has landed."""
        assert self.layerwise is not None
        t, rec = self.layerwise.transfers.get(tid), self.ledger.get(tid)
        if t is None or rec is None or t.in_flight:
            return
        if rec.is_terminal:
            if rec.has_local:
                self._free(rec)
            else:
                self.layerwise.drop(tid)
            if rec.peer_engine_id and rec.state is not S.DONE:  # held back while layer writes were in flight
                self.peers.send(rec.peer_engine_id, pr.Fail.create(tid, rec.error or "layer writes ended"))
        elif t.failed:
            self.fail(rec, t.failed)
        elif t.complete() and rec.state is S.POSTED:
            self._commit(rec, t)

    def _commit(self, rec: TransferRecord, t: LayerwiseTransfer) -> None:
        assert rec.peer_engine_id is not None
        self.peers.send(rec.peer_engine_id, pr.Commit(rec.transfer_id, self.first_tokens.get(rec.transfer_id),
                                                      reg_received=self.reg_times.get(rec.transfer_id),
                                                      write_posted=time.time()))
        self.posted.metrics.received(t.num_bytes)  # counted when the whole transfer landed
        self.posted.metrics.descs.observe(float(t.num_descs))
        self.posted.metrics.layer_writes_total += t.num_writes
        self._free(self.ledger.mark_done(rec.transfer_id))

    # ---- ends ------------------------------------------------------------------------------
    def fail(self, rec: TransferRecord, reason: str, confirmed: bool = False,
             kind: FailureKind = FailureKind.ERROR) -> None:
        """FAILED; D hears of it (Fail) once no WRITE of ours is in flight; blocks freed then."""
        self.expired(self.posted.mark_failed(rec, reason, confirmed, kind), reason)

    def expired(self, rec: TransferRecord, reason: str = "lease expired") -> None:
        """A record just became FAILED or EXPIRED. Fail promises D that nothing of ours is in
        flight: while a WRITE is, the message waits for it to end (transfer_ended / settled)."""
        self.reg_times.pop(rec.transfer_id, None)
        if self._posting(rec.transfer_id):
            return
        if self.layerwise is not None:
            self.layerwise.drop(rec.transfer_id)  # nothing in flight: no later layer is written either
        if rec.peer_engine_id:
            self.peers.send(rec.peer_engine_id, pr.Fail.create(rec.transfer_id, reason))
        if rec.has_local:
            self._free(rec)

    def _free(self, rec: TransferRecord) -> None:
        if self.layerwise is not None:
            self.layerwise.drop(rec.transfer_id)
        self.first_tokens.pop(rec.transfer_id, None)
        self.reg_times.pop(rec.transfer_id, None)
        if rec.local_block_ids:
            self.posted.emit(FreeBlocks(list(rec.local_block_ids), rec.transfer_id))

    # ---- timers and polling ----------------------------------------------------------------
    def housekeeping(self, now: float) -> bool:
        for tid in [t for t, (_, when) in self.cancelled.items() if now - when > CANCELLED_TTL_S]:
            del self.cancelled[tid]
        for peer in list(self.waiting_writes):
            self._post_waiting(peer)
        return False

    def relaxed(self) -> bool:
        """Layer writes in flight progress only while polled, but the forward pass that feeds them
        needs the GIL: poll them, not tightly. Everything else P waits for wakes the thread (the
        engine's commands through its queue, D's registrations and READ ends by a doorbell ring)."""
        return self.layerwise is not None and any(t.in_flight for t in self.layerwise.transfers.values())
