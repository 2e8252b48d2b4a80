"""D's side of the transfer thread: register blocks with P (push) or READ P's blocks (pull), and
report each transfer's outcome to the engine.

    Register (push: PushReg sent) -> Done / Commit from P   -> KVReady
    Read (pull: READ posted)      -> READ done (ReadDone to P) -> KVReady
    Fail / deadline / Cancel -> KVFailed; blocks quarantined until nothing can be in flight,
                                then FreeBlocks

Every method runs on the transfer thread (thread.py), which owns this object.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvpush.errors import TransferError
from kvpush.transfer import protocol as pr
from kvpush.transfer.commands import Cancel, Read, Register
from kvpush.transfer.events import FreeBlocks, KVFailed, KVReady
from kvpush.transfer.kv_agent import Transfer, XferStatus
from kvpush.transfer.ledger import TransferRecord
from kvpush.transfer.ledger import TransferState as S
from kvpush.transfer.peers import Peers
from kvpush.transfer.posted import Posted
from kvpush.transfer.records import FailureKind, TransferState

LEASE_MARGIN_S = 0.5  # D does not start a READ this close to the end of P's lease


class DecodeSide:
    def __init__(self, posted: Posted, peers: Peers) -> None:
        self.posted = posted
        self.ledger = posted.ledger
        self.peers = peers

    def handlers(self) -> dict[type, Callable[[Any], None]]:
        return {Register: self._register, Read: self._read, Cancel: self._cancel}

    # ---- commands --------------------------------------------------------------------------
    def _register(self, cmd: Register) -> None:
        self.peers.ensure(cmd.peer)
        self.ledger.register(cmd.transfer_id, cmd.request_id, cmd.block_ids, cmd.deadline,
                             peer_engine_id=cmd.peer.engine_id, num_tokens=cmd.num_tokens,
                             num_prefix_tokens=cmd.num_prefix_tokens)
        reg = pr.PushReg(cmd.transfer_id, self.peers.info.engine_id, list(cmd.block_ids), cmd.num_prefix_tokens,
                         cmd.num_tokens, cmd.deadline)
        self.peers.send(cmd.peer.engine_id, reg)

    def _read(self, cmd: Read) -> None:
        if cmd.lease_expiry is not None and time.time() > cmd.lease_expiry - LEASE_MARGIN_S:
            raise TransferError("P's lease on the blocks expired before D could read them")
        peer = self.peers.ensure(cmd.peer)
        self.peers.check_post_fault("READ")
        rec = self.ledger.register(cmd.transfer_id, cmd.request_id, cmd.block_ids, cmd.deadline,
                                   peer_engine_id=cmd.peer.engine_id, remote_block_ids=cmd.remote_ids,
                                   num_tokens=cmd.num_tokens)
        notif = pr.encode(pr.ReadDone(cmd.transfer_id))
        if self.peers.drop_fault():
            notif = b""  # P never hears that the READ ended: its lease must free the blocks
        error = self.posted.track(rec, self.posted.agent.read(peer, cmd.block_ids, cmd.remote_ids, notif))
        if error is not None:
            self.fail(rec, error, kind=FailureKind.POSTED_LATE)

    def _cancel(self, cmd: Cancel) -> None:
        rec = self.ledger.get(cmd.transfer_id)
        if rec is not None and not rec.is_terminal:
            self.fail(rec, cmd.reason, kind=FailureKind.CANCELLED)
        elif rec is not None and rec.state is TransferState.DONE:
            # The KV landed, but D's request ended before the engine applied KVReady: the engine took
            # these blocks out of the request when it sent Cancel, so they come back from here.
            self.posted.emit(FreeBlocks(list(rec.local_block_ids), rec.transfer_id))

    def lost(self, cmd: object, reason: str) -> None:
        """A Register / Read failed before its record existed: the request fails, its blocks are free."""
        if isinstance(cmd, Register | Read):
            self.posted.emit(KVFailed(cmd.transfer_id, cmd.request_id, reason))
            self.posted.emit(FreeBlocks(list(cmd.block_ids), cmd.transfer_id))

    # ---- messages from P -------------------------------------------------------------------
    def on_message(self, msg: pr.Message, engine_id: str) -> None:
        before = self.ledger.get(msg.transfer_id)
        rec = self.ledger.on_notification(msg, engine_id)
        if rec is None:
            return
        if rec.state is S.DONE and isinstance(msg, pr.Done | pr.Commit):  # Commit: layer-wise, all landed
            geometry = self.posted.agent.geometry
            self.posted.metrics.received(len(rec.local_block_ids) * (geometry.block_bytes if geometry else 0))
            trace = (*((k, v) for k, v in (("reg_received", msg.reg_received),
                                           ("write_posted", msg.write_posted)) if v), ("kv_landed", time.time()))
            self.posted.emit(KVReady(rec.transfer_id, rec.request_id or "", msg.first_token_id, trace))
        elif rec.is_terminal and (before is None or not before.is_terminal):
            self._failed(rec)

    def transfer_ended(self, tid: str, transfer: Transfer, state: XferStatus) -> None:
        """D's own READ ended."""
        rec = self.ledger.get(tid)
        if rec is None:
            return
        if rec.is_terminal:  # failed while in flight: now nothing is
            if rec.is_quarantined:
                self.ledger.confirm_nothing_in_flight(tid)
        elif state is XferStatus.DONE:
            self.posted.metrics.observe(transfer)
            rec = self.ledger.mark_done(tid)
            landed = (("read_posted", time.time() - time.monotonic() + transfer.posted_at), ("kv_landed", time.time()))
            self.posted.emit(KVReady(tid, rec.request_id or "", None, landed))
        else:
            self.fail(rec, transfer.error or "transfer failed", confirmed=True)

    def poll(self) -> bool:
        return False

    # ---- ends ------------------------------------------------------------------------------
    def fail(self, rec: TransferRecord, reason: str, confirmed: bool = False,
             kind: FailureKind = FailureKind.ERROR) -> None:
        """FAILED; P is told (Abort: nothing of ours in flight is promised by the ledger's quarantine)."""
        self.expired(self.posted.mark_failed(rec, reason, confirmed, kind))

    def expired(self, rec: TransferRecord) -> None:
        """A record just became FAILED or EXPIRED: tell P, fail the request."""
        if rec.peer_engine_id:
            self.peers.send(rec.peer_engine_id, pr.Abort(rec.transfer_id))
        self._failed(rec)

    def _failed(self, rec: TransferRecord) -> None:
        self.posted.emit(KVFailed(rec.transfer_id, rec.request_id or "", rec.error or "transfer failed"))

    # ---- timers and polling ----------------------------------------------------------------
    def housekeeping(self, now: float) -> bool:
        """Quarantined blocks that nothing can land in any more go back to the engine."""
        freed = self.ledger.release_quarantine()
        if freed:
            self.posted.emit(FreeBlocks(freed))
        return bool(freed)

    def relaxed(self) -> bool:
        """Never: D waiting for its peers' Done sleeps on its doorbell (thread.py's Pacer)."""
        return False

    def in_flight_peers(self) -> set[str]:
        """None beyond the posted READs (thread.py rings those peers itself)."""
        return set()
