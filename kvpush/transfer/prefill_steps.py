"""P's side of the transfer thread: hold finished prefills, match registrations, post WRITEs
(whole-request or layer by layer), commit, and free P's blocks when a transfer ends.

A base of TransferWorker (worker.py); every method runs on the transfer thread.
"""

from __future__ import annotations

import time

from kvpush.errors import TransferError
from kvpush.transfer import protocol as pr
from kvpush.transfer.commands import FreeBlocks, Hold, LayersDone
from kvpush.transfer.kv_agent import Transfer
from kvpush.transfer.layerwise import LayerwiseTransfer
from kvpush.transfer.ledger import LedgerError, TransferRecord
from kvpush.transfer.ledger import TransferState as S
from kvpush.transfer.peer_channel import PeerChannel


class PrefillSteps(PeerChannel):
    # ---- P side --------------------------------------------------------------------------
    def _hold(self, cmd: Hold) -> None:
        self.expected.discard(cmd.transfer_id)
        self.first_tokens[cmd.transfer_id] = cmd.first_token_id
        rec = self.ledger.on_prefill_done(cmd.transfer_id, cmd.request_id, cmd.block_ids, cmd.lease_deadline,
                                          peer_engine_id=cmd.decode_engine_id, num_tokens=cmd.num_tokens)
        try:
            self._after_p_update(rec)
        except (TransferError, ValueError) as e:
            self._fail(rec, str(e), tell_peer=True)

    def _after_p_update(self, rec: TransferRecord | None) -> None:
        if rec is None:
            return
        if self.layerwise is not None and not rec.is_terminal:
            self._layerwise_update(rec)
        elif rec.state is S.MATCHED:
            self._post_write(rec)
        elif rec.is_terminal and rec.has_local and not self._posting(rec.transfer_id):
            self._free_p(rec)

    def _posting(self, tid: str) -> bool:
        """Some WRITE or READ of ours for this transfer is still in flight."""
        return tid in self.posted or (self.layerwise is not None and self.layerwise.in_flight(tid))

    # ---- P side, layer-wise --------------------------------------------------------------
    def _layers_done(self, cmd: LayersDone) -> None:
        assert self.layerwise is not None
        for tid, indices, block_ids in cmd.items:
            self.layerwise.layers_done(tid, cmd.layer, indices, block_ids)
            self.layerwise.post_ready(tid)

    def _layerwise_update(self, rec: TransferRecord) -> None:
        """Registration known: post what is finished; prefill done too (MATCHED): mark POSTED."""
        assert self.layerwise is not None
        t = self.layerwise.get(rec.transfer_id)
        if rec.has_remote and t.remote is None:
            peer = self.peers.get(rec.peer_engine_id or "")
            if peer is None:
                raise TransferError(f"registration from {rec.peer_engine_id}, which never completed a handshake")
            self.layerwise.registered(rec.transfer_id, peer, list(rec.remote_block_ids),
                                      rec.num_prefix_tokens // self.block_size)
            self.reg_times.setdefault(rec.transfer_id, time.time())
        if rec.state is S.MATCHED:
            t.prefill_done = True
            self._check_post_fault("WRITE")
            self.ledger.mark_posted(rec.transfer_id)
        self.layerwise.post_ready(rec.transfer_id)
        self._layerwise_settled(rec.transfer_id)

    def _layerwise_settled(self, tid: str) -> None:
        """All posted layer writes ended: fail, or commit once everything D needs has landed."""
        assert self.layerwise is not None
        t, rec = self.layerwise.transfers.get(tid), self.ledger.get(tid)
        if t is None or rec is None or t.in_flight:
            return
        if rec.is_terminal:
            if rec.has_local:
                self._free_p(rec)
                if rec.peer_engine_id:  # the failure was held back while layer writes were in flight
                    self._send(rec.peer_engine_id, pr.Fail.create(tid, rec.error or "layer writes ended"))
            else:
                self.layerwise.drop(tid)
            return
        if t.failed:
            self._fail(rec, t.failed, tell_peer=True)
        elif t.complete() and rec.state is S.POSTED:
            self._commit(rec, t)

    def _commit(self, rec: TransferRecord, t: LayerwiseTransfer) -> None:
        assert rec.peer_engine_id is not None and self.layerwise is not None
        self._send(rec.peer_engine_id, pr.Commit(rec.transfer_id, self.first_tokens.get(rec.transfer_id),
                                                 reg_received=self.reg_times.get(rec.transfer_id),
                                                 write_posted=time.time()))
        self.metrics.received(t.num_bytes)  # counted when the whole transfer landed
        self.metrics.descs.observe(float(t.num_descs))
        rec = self.ledger.mark_done(rec.transfer_id)
        self.layerwise.drop(rec.transfer_id)
        self._free_p(rec)

    def _post_write(self, rec: TransferRecord) -> None:
        skip = rec.num_prefix_tokens // self.block_size
        remote = list(rec.remote_block_ids)
        local = list(rec.local_block_ids[skip : skip + len(remote)])
        done = pr.encode(pr.Done(rec.transfer_id, self.first_tokens.get(rec.transfer_id),
                                 reg_received=self.reg_times.pop(rec.transfer_id, None), write_posted=time.time()))
        assert rec.peer_engine_id is not None
        peer = self.peers.get(rec.peer_engine_id)
        if peer is None:
            raise TransferError(f"registration from {rec.peer_engine_id}, which never completed a handshake")
        if len(local) < len(remote):
            raise TransferError(f"D registered {len(remote)} blocks but P holds {len(local)} after the prefix")
        self._check_post_fault("WRITE")
        if self._fault(self.faults.drop_notif):
            self.metrics.faults_injected += 1
            done = b""  # the WRITE lands but D never hears of it: D's deadline must handle it
        self._track(rec, self.agent.write(peer, local, remote, done))

    def _track(self, rec: TransferRecord, transfer: Transfer) -> None:
        """A posted transfer is polled to its end whatever happens to its record meanwhile."""
        self.posted[rec.transfer_id] = transfer
        try:
            self.ledger.mark_posted(rec.transfer_id, num_descs=transfer.num_descs, num_bytes=transfer.num_bytes)
        except LedgerError as e:  # e.g. the deadline passed during a slow synchronous post
            self._fail(rec, f"posted too late: {e}", tell_peer=True)

    def _free_p(self, rec: TransferRecord) -> None:
        if self.layerwise is not None:
            self.layerwise.drop(rec.transfer_id)
        self.first_tokens.pop(rec.transfer_id, None)
        self.reg_times.pop(rec.transfer_id, None)
        if rec.local_block_ids:
            self.emit(FreeBlocks(list(rec.local_block_ids)))
