"""The transfer thread's peers: handshakes, control notifications, injected faults.

Owned by the transfer thread (thread.py); every method runs on it. Maps engine ids (what the
ledger and the messages name) to agent names (what the agent and its notifications name).
"""

from __future__ import annotations

import heapq
import logging
import random
import time

from kvpush.config import Faults
from kvpush.errors import HandshakeError, TransferError
from kvpush.transfer import protocol as pr
from kvpush.transfer.commands import AddPeer, PeerAddr, SendNotif
from kvpush.transfer.descriptors import KVGeometry
from kvpush.transfer.doorbell import Doorbell
from kvpush.transfer.handshake import HandshakeInfo, pack, verify_and_decode
from kvpush.transfer.kv_agent import KVAgent
from kvpush.transfer.side_channel import request as side_request
from kvpush.transfer.stats import TransferMetrics

log = logging.getLogger("kvpush.transfer")


class Peers:
    def __init__(self, agent: KVAgent, info: HandshakeInfo, secret: str | None, metrics: TransferMetrics,
                 faults: Faults, handshake_timeout_s: float, doorbell: Doorbell) -> None:
        self.agent = agent
        self.doorbell = doorbell
        self.info = info
        self.secret = secret
        self.metrics = metrics
        self.faults = faults
        self.handshake_timeout_s = handshake_timeout_s
        self.names: dict[str, str] = {}  # engine id -> agent name
        self.bells: dict[str, tuple[int, tuple] | None] = {}  # agent name -> where to ring it
        self.sent = False  # a notification left since the thread last looked (it may need our progress)
        self.delayed: list[tuple[float, int, str, pr.Message]] = []  # heap of notifications to send later
        self._delay_seq = 0
        self._rng = random.Random(f"{faults.seed}-{info.engine_id}")

    # ---- handshakes ------------------------------------------------------------------------
    def add(self, cmd: AddPeer) -> None:
        """A peer that handshook with us (its side of `ensure`)."""
        cmd.done.set_result(self._connect(cmd.info))

    def ensure(self, peer: PeerAddr) -> str:
        """The peer's agent name; handshakes over its side channel first if not connected."""
        name = self.names.get(peer.engine_id)
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
        return self._connect(info)

    def _connect(self, info: HandshakeInfo) -> str:
        self._forget(info.engine_id, info.agent_name)
        name = self.agent.add_peer(info.agent_metadata, KVGeometry.from_info(info))
        self.names[info.engine_id] = name
        self.bells[name] = Doorbell.resolve(info.doorbell) if info.doorbell else None
        self.metrics.handshakes += 1
        return name

    def _forget(self, engine_id: str, agent_name: str) -> None:
        """Drop a previous connection to the same peer (it disconnected and is handshaking anew)."""
        for name in {self.names.pop(engine_id, None), agent_name} - {None}:
            self.bells.pop(name, None)  # type: ignore[arg-type]
            if name in self.agent.peers():
                self.agent.remove_peer(name)

    def agent_name(self, engine_id: str) -> str:
        """The connected peer's agent name; TransferError if it never completed a handshake."""
        name = self.names.get(engine_id)
        if name is None:
            raise TransferError(f"registration from {engine_id}, which never completed a handshake")
        return name

    def engine_of(self, agent_name: str) -> str:
        for engine_id, name in self.names.items():
            if name == agent_name:
                return engine_id
        return agent_name

    def ring(self, agent_name: str) -> None:
        """Tell the peer to look at its notifications now (we just sent or posted it something)."""
        self.doorbell.ring(self.bells.get(agent_name))

    # ---- notifications ---------------------------------------------------------------------
    def send_notif(self, cmd: SendNotif) -> None:
        self.ensure(cmd.peer)
        self.send(cmd.peer.engine_id, cmd.message)

    def send(self, engine_id: str, msg: pr.Message) -> None:
        """Send now, later (delay-notif fault) or never (drop-notif fault)."""
        if self.drop_fault():
            return
        if self.faults.delay_notif_s > 0:
            self._delay_seq += 1
            heapq.heappush(self.delayed, (time.monotonic() + self.faults.delay_notif_s, self._delay_seq,
                                          engine_id, msg))
            return
        self._send_now(engine_id, msg)

    def send_delayed(self) -> bool:
        now, sent = time.monotonic(), False
        while self.delayed and self.delayed[0][0] <= now:
            _, _, engine_id, msg = heapq.heappop(self.delayed)
            self._send_now(engine_id, msg)
            sent = True
        return sent

    def _send_now(self, engine_id: str, msg: pr.Message) -> None:
        name = self.names.get(engine_id)
        if name is None:
            log.info("no connection to %s; %s not sent", engine_id, type(msg).__name__)
            return
        try:
            self.agent.send_notif(name, pr.encode(msg))
            self.sent = True
            self.ring(name)
        except TransferError as e:
            log.warning("notification to %s failed: %s", engine_id, e)

    # ---- injected faults (config.Faults) ---------------------------------------------------
    def drop_fault(self) -> bool:
        """drop-notif: True if this notification (standalone, or a transfer's own) is lost."""
        if self._fault(self.faults.drop_notif):
            self.metrics.faults_injected += 1
            return True
        return False

    def check_post_fault(self, op: str) -> None:
        """Called just before posting. delay-post: stall first; fail-post: TransferError instead of posting."""
        if self.faults.delay_post_s > 0:
            self.metrics.faults_injected += 1
            time.sleep(self.faults.delay_post_s)
        if self._fault(self.faults.fail_post):
            self.metrics.faults_injected += 1
            raise TransferError(f"injected fault: {op} post failed")

    def _fault(self, probability: float) -> bool:
        return probability > 0 and self._rng.random() < probability
