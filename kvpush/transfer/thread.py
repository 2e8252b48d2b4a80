"""The transfer thread of one prefill or decode instance: it owns every agent call.

The engine thread hands it commands (commands.py, a thread-safe queue) and gets events back
(events.py: another queue, plus a wake-up of the step loop). The side-channel thread hands it
handshakes to apply. The thread is a loop and a dispatch; the work is done by

    Peers         peers.py         handshakes, control notifications, injected faults
    PrefillSide   prefill_side.py  P: hold prefills, match registrations, WRITE, free  } one of them,
    DecodeSide    decode_side.py   D: register / READ, report KVReady / KVFailed       } by role
    Posted        posted.py        what both sides share: agent, ledger, metrics, posted transfers

Each loop round: apply queued commands, poll posted transfers, poll the role's own work
(layer-wise writes), poll notifications, run timers, send delayed notifications; then `Pacer`
decides how long to wait before the next round (the only place the thread waits).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import msgspec

from kvpush.config import Faults, Role
from kvpush.errors import HandshakeError, TransferError
from kvpush.transfer import protocol as pr
from kvpush.transfer.commands import AddPeer, Command, SendNotif
from kvpush.transfer.decode_side import DecodeSide
from kvpush.transfer.doorbell import Doorbell
from kvpush.transfer.events import Event
from kvpush.transfer.handshake import HandshakeInfo, pack, verify_and_decode
from kvpush.transfer.kv_agent import KVAgent, Transfer, XferStatus
from kvpush.transfer.ledger import TransferLedger, TransferRecord
from kvpush.transfer.ledger import TransferState as S
from kvpush.transfer.peers import Peers
from kvpush.transfer.posted import Posted
from kvpush.transfer.prefill_side import PrefillSide
from kvpush.transfer.records import FailureKind
from kvpush.transfer.stats import TransferMetrics, TransferStats

log = logging.getLogger("kvpush.transfer")
IDLE_WAIT_S = 0.2  # nothing live: sleep on the doorbell this long per round
WAITING_POLL_S = 0.05  # live records wait for a peer: sleep on the doorbell, look anyway this often
MAX_BACKOFF_S = 0.0005  # something latency-critical is outstanding: poll at least this often
RELAXED_POLL_S = 0.001  # P's layer-wise writes follow the forward pass
GRACE_S = 0.02  # after a ring or any progress, poll tightly this long (a notification may trail its ring)
RING_REFRESH_S = 0.01  # while a transfer of ours is in flight, ring its peer this often (over tcp it moves
# only while the peer calls into NIXL too: each ring keeps the peer in its grace)
HOUSEKEEPING_S = 0.01
# Records in these states wait for something a doorbell announces (P: its prefill, a registration or
# a READ's end; D: its peer's Done); any other live record is latency-critical work of this thread.
PEER_WAIT_STATES = frozenset({S.REGISTERED, S.PREFILLED})
WIND_DOWN_S = 2.0  # stopping: how long posted transfers get to end before the agent closes


class RoleSide(Protocol):
    """What the thread asks of PrefillSide / DecodeSide."""

    def handlers(self) -> dict[type, Callable[[Any], None]]: ...
    def lost(self, cmd: object, reason: str) -> None: ...
    def on_message(self, msg: pr.Message, engine_id: str) -> None: ...
    def transfer_ended(self, tid: str, transfer: Transfer, state: XferStatus) -> None: ...
    def poll(self) -> bool: ...
    def fail(self, rec: TransferRecord, reason: str, confirmed: bool = False,
             kind: FailureKind = FailureKind.ERROR) -> None: ...
    def expired(self, rec: TransferRecord) -> None: ...
    def housekeeping(self, now: float) -> bool: ...
    def relaxed(self) -> bool: ...
    def in_flight_peers(self) -> set[str]: ...


class Pacer:
    """How long the loop sleeps on its doorbell between rounds.

        idle      no live record                      IDLE_WAIT_S (a command or a ring ends it)
        waiting   live records all wait for a peer    WAITING_POLL_S (a safety net for a lost ring)
        relaxed   P's layer-wise writes in flight     RELAXED_POLL_S
        urgent    in flight, to post, or in grace     a short sleep growing to MAX_BACKOFF_S

    Grace (GRACE_S of urgent polling) follows what may need this thread to call into NIXL soon:
    a notification it sent, and a ring whose notification was not there yet. A notification read
    ends the grace of a ring, so a PushReg read during P's own prefill costs one round. Why a sent
    notification needs it (nixl 1.5, measured by a one-off probe, docs/protocol.md section 5): UCX hands most notifications
    over within `send_notif`, but not the first on a new endpoint, not the first of a new size class
    between two agents of one process, and, over tcp, not a WRITE's own notification (5-8 ms, a few
    not within 20 ms if the sender stops calling at DONE); such a message waits for the sender's next
    NIXL call, and the sender cannot tell which kind it sent (docs/protocol.md section 5).
    """

    def __init__(self) -> None:
        self.backoff = 0.0
        self.live = False  # some ledger record is not terminal (refreshed when anything changed)
        self.urgent = False  # some live record is latency-critical
        self.grace_until = 0.0

    def refresh(self, ledger: TransferLedger) -> None:
        live = {state for state, n in ledger.count_by_state().items() if n and not state.is_terminal}  # O(states)
        self.live = bool(live)
        self.urgent = bool(live - PEER_WAIT_STATES)

    def after_round(self, now: float, *, sent: bool, received: bool, rang: bool) -> None:
        if sent or (rang and not received):
            self.grace_until = now + GRACE_S
        elif received:
            self.grace_until = 0.0

    def cap(self, in_flight: bool, relaxed: bool, now: float) -> float:
        """Longest sleep before the next round."""
        if in_flight or self.urgent or now < self.grace_until:
            return MAX_BACKOFF_S
        if relaxed:
            return RELAXED_POLL_S
        return WAITING_POLL_S if self.live else IDLE_WAIT_S

    def sleep_s(self, progressed: bool, cap: float) -> float:
        """The next wait: none right after progress; growing up to a tight cap; else the whole cap."""
        if progressed:
            self.backoff = 0.0
            return 0.0
        if cap > RELAXED_POLL_S:
            return cap
        self.backoff = min(cap, self.backoff * 2 or 0.00002)
        return self.backoff


class TransferThread(threading.Thread):
    def __init__(self, role: Role, agent: KVAgent, info: HandshakeInfo, secret: str | None,
                 emit: Callable[[Event], None], block_size: int, *, handshake_timeout_s: float = 5.0,
                 faults: Faults | None = None, layerwise: bool | None = False, quarantine_s: float | None = None,
                 tombstone_s: float | None = None, doorbell: Doorbell | None = None, writes_per_peer: int = 1) -> None:
        super().__init__(name=f"kvpush-transfer-{role.value}", daemon=True)
        self.agent = agent
        self.doorbell = doorbell or Doorbell()
        if not info.doorbell:  # the caller let the thread make its own: publish it
            info = msgspec.structs.replace(info, doorbell=f"127.0.0.1:{self.doorbell.port}")
        self.info = info
        self.secret = secret
        self.handshake_timeout_s = handshake_timeout_s
        self.ledger = TransferLedger(role)
        if quarantine_s is not None:
            self.ledger.quarantine_s = quarantine_s
        if tombstone_s is not None:
            self.ledger.tombstone_s = tombstone_s
        self.metrics = TransferMetrics()
        self.peers = Peers(agent, info, secret, self.metrics, faults or Faults(), handshake_timeout_s,
                           self.doorbell)
        self.posted = Posted(agent, self.ledger, self.metrics, emit, block_size)
        self.side: RoleSide = (PrefillSide(self.posted, self.peers, layerwise, writes_per_peer) if role is Role.PREFILL
                               else DecodeSide(self.posted, self.peers))
        self._handlers: dict[type, Callable[[Any], None]] = {
            AddPeer: self.peers.add, SendNotif: self.peers.send_notif, **self.side.handlers()}
        self.commands: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self.pacer = Pacer()
        self._stopping = threading.Event()  # not `_stop`: that name is Thread's own
        self._last_housekeeping = 0.0
        self._received = False  # this round read a notification
        self._rung: dict[str, float] = {}  # peer agent name -> when we last rang it for a transfer in flight

    # ---- thread API (any thread) -----------------------------------------------------------
    @property
    def rounds(self) -> int:
        """Loop rounds run (what a test waits on to know the thread caught up; also a metric)."""
        return self.metrics.thread_rounds

    def submit(self, command: Command) -> None:
        self.commands.put(command)
        self.doorbell.wake()

    def stop(self) -> None:
        self._stopping.set()
        self.doorbell.wake()

    def wake(self) -> None:
        """Start a loop round now if the thread is waiting."""
        self.doorbell.wake()

    def handle_handshake(self, frame: bytes) -> bytes:
        """Side-channel thread: verify a peer's handshake, have this thread add it, answer ours."""
        peer = verify_and_decode(frame, self.secret, self.info.compat_hash,
                                 expected_compat_summary=self.info.compat_summary)
        done: Future[str] = Future()
        self.submit(AddPeer(peer, done))
        try:
            done.result(timeout=self.handshake_timeout_s)
        except (TimeoutError, TransferError) as e:
            raise HandshakeError(f"cannot add peer {peer.engine_id}: {e}") from e
        return pack(self.info, self.secret)

    def stats(self) -> TransferStats:
        return self.metrics.snapshot(self.ledger)

    # ---- loop ------------------------------------------------------------------------------
    def run(self) -> None:
        cpu0, rang = time.thread_time(), False
        while not self._stopping.is_set():
            self._received = False
            try:
                progressed = self._round()
            except (TransferError, ValueError) as e:  # never let one bad transfer stop the thread
                log.error("transfer thread: %s", e)
                progressed = True
            now = time.monotonic()
            if progressed:
                self.pacer.refresh(self.ledger)
            self.pacer.after_round(now, sent=self.peers.sent, received=self._received, rang=rang)
            self.peers.sent = False
            self.metrics.thread_cpu_s = time.thread_time() - cpu0
            wait_s = self.pacer.sleep_s(progressed, self.poll_cap(now))
            rang = wait_s > 0 and self.doorbell.wait(wait_s)
            self.metrics.thread_rounds += 1
        self._wind_down()
        self.agent.close()
        self.doorbell.close()

    def _wind_down(self) -> None:
        """Stopping (the instance shuts down): apply the commands still queued (Cancel of the requests
        just aborted), fail every live transfer so that its peer hears of it now (D sends Abort; P sends
        Fail once no WRITE of its own is in flight), and run rounds while anything is outstanding
        (posted transfers, delayed notifications, the grace after a send), at most WIND_DOWN_S."""
        deadline = time.monotonic() + WIND_DOWN_S
        try:
            self._drain()
            for rec in self.ledger.records():
                if not rec.is_terminal:
                    self.side.fail(rec, "the peer instance shut down", kind=FailureKind.SHUTDOWN)
            self.pacer.refresh(self.ledger)
            self.pacer.after_round(time.monotonic(), sent=self.peers.sent, received=False, rang=False)
            while (cap := self.poll_cap()) <= RELAXED_POLL_S and time.monotonic() < deadline:
                progressed = self._round()
                self.pacer.refresh(self.ledger)
                self.pacer.after_round(time.monotonic(), sent=self.peers.sent, received=False, rang=False)
                self.peers.sent = False
                self.doorbell.wait(self.pacer.sleep_s(progressed, cap))
            self.agent.get_notifs()  # one more progress call: what was just sent goes out
        except (TransferError, ValueError) as e:
            log.error("transfer thread, stopping: %s", e)

    def poll_cap(self, now: float | None = None) -> float:
        """The longest sleep between rounds now."""
        in_flight = bool(self.posted) or bool(self.peers.delayed)
        return self.pacer.cap(in_flight, self.side.relaxed(), time.monotonic() if now is None else now)

    def _round(self) -> bool:
        progressed = self._drain()
        for tid, transfer, state in self.posted.poll():
            self.side.transfer_ended(tid, transfer, state)
            if transfer.notif:  # its notification left with it: have the peer look, help it leave
                self.peers.ring(transfer.peer)
                self.peers.sent = True
            progressed = True
        progressed |= self.side.poll()
        self._ring_targets()
        progressed |= self._poll_notifs()
        progressed |= self._housekeeping()
        progressed |= self.peers.send_delayed()
        return progressed

    def _ring_targets(self) -> None:
        """Ring the peer of every transfer of ours in flight once it has been in flight RING_REFRESH_S,
        then every RING_REFRESH_S (not for one that outlived its record: Posted.live_peers). Over tcp UCX
        emulates a WRITE (READ) with messages that the target's worker must receive, and with its
        progress thread off (nixl_agent.py) a worker only receives inside a NIXL call: a D waiting for
        its KV sleeps WAITING_POLL_S between calls, the link stalls when its socket buffer is full, and
        a 200-ms WRITE over a 0.25 Gbit/s link took 25% longer than the same READ. A ring puts the
        peer in its grace (tight polling) until the next one; over shared memory and cma the data
        moves without the target and the transfer ends before the first ring is due."""
        now = time.monotonic()
        targets = self.side.in_flight_peers() | set(self.posted.live_peers())
        for peer in targets:
            if peer not in self._rung:
                self._rung[peer] = now  # the first ring once it has been in flight that long
            elif now - self._rung[peer] >= RING_REFRESH_S:
                self.peers.ring(peer)
                self._rung[peer] = now
        for peer in [p for p in self._rung if p not in targets]:
            del self._rung[peer]

    def _drain(self) -> bool:
        progressed = False
        try:
            while True:
                cmd = self.commands.get_nowait()
                if cmd is not None:
                    self._handle(cmd)
                    progressed = True
        except queue.Empty:
            return progressed

    def _handle(self, cmd: Command) -> None:
        handler = self._handlers.get(type(cmd))
        try:
            if handler is None:
                raise TransferError(f"{type(cmd).__name__} is not a command of this side")
            handler(cmd)
        except (TransferError, HandshakeError, ValueError) as e:
            self._command_failed(cmd, str(e))

    def _command_failed(self, cmd: Command, reason: str) -> None:
        log.warning("transfer command %s failed: %s", type(cmd).__name__, reason)
        if isinstance(cmd, AddPeer):
            cmd.done.set_exception(TransferError(reason))
            return
        tid = getattr(cmd, "transfer_id", None)
        rec = self.ledger.get(tid) if tid is not None else None
        if rec is None:
            self.side.lost(cmd, reason)
        elif not rec.is_terminal:
            self.side.fail(rec, reason)

    def _poll_notifs(self) -> bool:
        notifs = self.agent.get_notifs()
        for agent_name, data in notifs:
            try:
                msg = pr.decode(data)
            except pr.ProtocolError as e:
                self.metrics.bad_messages += 1
                if self.metrics.bad_messages == 1:
                    log.warning("bad control message from %s: %s", agent_name, e)
                continue
            self.side.on_message(msg, self.peers.engine_of(agent_name))
        self._received |= bool(notifs)
        return bool(notifs)

    def _housekeeping(self) -> bool:
        """Expiry, the role's timers, tombstone collection. Returns True if any record changed."""
        now = time.monotonic()
        if now - self._last_housekeeping < HOUSEKEEPING_S:
            return False
        self._last_housekeeping = now
        expired = self.ledger.expire()
        for rec in expired:
            self.side.expired(rec)
        changed = self.side.housekeeping(now)
        self.ledger.gc()
        return bool(expired) or changed
