"""The transfer thread's channel to its peers: handshakes, control notifications, injected faults.

A base of TransferWorker (worker.py); every method runs on the transfer thread. The attributes
below are created by TransferWorker.__init__.
"""

from __future__ import annotations

import heapq
import logging
import random
import threading
import time
from collections.abc import Callable

from kvpush.config import Faults
from kvpush.errors import HandshakeError, TransferError
from kvpush.transfer import protocol as pr
from kvpush.transfer.commands import AddPeer, Event, PeerAddr
from kvpush.transfer.descriptors import KVGeometry
from kvpush.transfer.handshake import HandshakeInfo, pack, verify_and_decode
from kvpush.transfer.kv_agent import KVAgent, Transfer
from kvpush.transfer.layerwise import LayerwiseWriter
from kvpush.transfer.ledger import Side, TransferLedger, TransferRecord
from kvpush.transfer.side_channel import request as side_request
from kvpush.transfer.stats import TransferMetrics

log = logging.getLogger("kvpush.transfer")


class PeerChannel(threading.Thread):
    side: Side
    agent: KVAgent
    info: HandshakeInfo
    secret: str | None
    emit: Callable[[Event], None]
    block_size: int
    handshake_timeout_s: float
    ledger: TransferLedger
    metrics: TransferMetrics
    posted: dict[str, Transfer]
    expected: set[str]
    peers: dict[str, str]
    first_tokens: dict[str, int | None]
    cancelled: dict[str, tuple[str, float]]
    reg_times: dict[str, float]
    faults: Faults
    _rng: random.Random
    delayed: list[tuple[float, int, str, pr.Message]]
    _delay_seq: int
    layerwise: LayerwiseWriter | None

    def _fail(self, rec: TransferRecord, reason: str, tell_peer: bool, confirmed: bool = False) -> None:
        raise NotImplementedError  # TransferWorker

    # ---- peers ---------------------------------------------------------------------------
    def _add_peer(self, cmd: AddPeer) -> None:
        self._forget_peer(cmd.info.engine_id, cmd.info.agent_name)
        name = self.agent.add_peer(cmd.info.agent_metadata, KVGeometry.from_info(cmd.info))
        self.peers[cmd.info.engine_id] = name
        self.metrics.handshakes += 1
        cmd.done.set_result(name)

    def _ensure_peer(self, peer: PeerAddr) -> str:
        name = self.peers.get(peer.engine_id)
        if name is not None and self.agent.is_connected(name):
            return name
        try:
            answer = side_request(peer.host, peer.port, pack(self.info, self.secret), self.handshake_timeout_s)
            info = verify_and_decode(answer, self.secret, self.info.compat_hash,
                                     expected_compat_summary=self.info.compat_summary,
                                     expected_engine_id=peer.engine_id)
        except HandshakeError:
            self.metrics.handshake_failures += 1
            raise
        self._forget_peer(peer.engine_id, info.agent_name)
        name = self.agent.add_peer(info.agent_metadata, KVGeometry.from_info(info))
        self.peers[peer.engine_id] = name
        self.metrics.handshakes += 1
        return name

    def _forget_peer(self, engine_id: str, agent_name: str) -> None:
        """Drop a previous connection to the same peer (it disconnected and is handshaking anew)."""
        for name in {self.peers.pop(engine_id, None), agent_name} - {None}:
            if name in self.agent.peers():
                self.agent.remove_peer(name)

    def _send(self, engine_id: str, msg: pr.Message) -> None:
        if self._fault(self.faults.drop_notif):
            self.metrics.faults_injected += 1
            return
        if self.faults.delay_notif_s > 0:
            self._delay_seq += 1
            heapq.heappush(self.delayed, (time.monotonic() + self.faults.delay_notif_s, self._delay_seq,
                                          engine_id, msg))
            return
        self._send_now(engine_id, msg)

    def _send_delayed(self) -> bool:
        now, sent = time.monotonic(), False
        while self.delayed and self.delayed[0][0] <= now:
            _, _, engine_id, msg = heapq.heappop(self.delayed)
            self._send_now(engine_id, msg)
            sent = True
        return sent

    def _fault(self, probability: float) -> bool:
        return probability > 0 and self._rng.random() < probability

    def _check_post_fault(self, op: str) -> None:
        if self._fault(self.faults.fail_post):
            self.metrics.faults_injected += 1
            raise TransferError(f"injected fault: {op} post failed")

    def _send_now(self, engine_id: str, msg: pr.Message) -> None:
        name = self.peers.get(engine_id)
        if name is None:
            log.info("no connection to %s; %s not sent", engine_id, type(msg).__name__)
            return
        try:
            self.agent.send_notif(name, pr.encode(msg))
        except TransferError as e:
            log.warning("notification to %s failed: %s", engine_id, e)
