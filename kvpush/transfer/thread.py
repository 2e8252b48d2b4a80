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

from kvpush.config import Faults, Role
from kvpush.errors import HandshakeError, TransferError
from kvpush.transfer import protocol as pr
from kvpush.transfer.commands import AddPeer, Command, SendNotif
from kvpush.transfer.decode_side import DecodeSide
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
IDLE_WAIT_S = 0.2  # nothing outstanding: block on the command queue this long per round
MAX_BACKOFF_S = 0.0005  # something latency-critical is outstanding: poll at least this often
RELAXED_POLL_S = 0.001  # the role waits for its peer (D: a Done may come any time)
HOUSEKEEPING_S = 0.01
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
    def relaxed(self, live: bool) -> bool: ...


class Pacer:
    """How long the loop waits between rounds: blocks on the command queue when idle, polls with
    a short, growing sleep (capped) while something is outstanding."""

    def __init__(self) -> None:
        self.backoff = 0.0
        self.live = False  # some ledger record is not terminal (refreshed when anything changed)
        self.urgent = False  # some live record is latency-critical

    def refresh(self, ledger: TransferLedger) -> None:
        live = {state for state, n in ledger.count_by_state().items() if n and not state.is_terminal}
        self.live = bool(live)
        # A REGISTERED record waits for a prefill to finish (P: its own; D: its peer's).
        self.urgent = bool(live - {S.REGISTERED})

    def cap(self, in_flight: bool, relaxed: bool) -> float | None:
        """Longest sleep between polls; None when idle (block on the command queue instead)."""
        if in_flight or self.urgent:
            return MAX_BACKOFF_S
        return RELAXED_POLL_S if relaxed else None

    def queue_timeout(self, cap: float | None) -> float | None:
        """How long the round's first command read may block (None: do not block)."""
        return IDLE_WAIT_S if cap is None else None

    def after_round(self, progressed: bool, cap: float | None) -> None:
        if progressed or cap is None:
            self.backoff = 0.0
            return
        self.backoff = min(cap, self.backoff * 2 or 0.00002)
        time.sleep(self.backoff)


class TransferThread(threading.Thread):
    def __init__(self, role: Role, agent: KVAgent, info: HandshakeInfo, secret: str | None,
                 emit: Callable[[Event], None], block_size: int, *, handshake_timeout_s: float = 5.0,
                 faults: Faults | None = None, layerwise: bool = False, quarantine_s: float | None = None) -> None:
        super().__init__(name=f"kvpush-transfer-{role.value}", daemon=True)
        self.agent = agent
        self.info = info
        self.secret = secret
        self.handshake_timeout_s = handshake_timeout_s
        self.ledger = TransferLedger(role)
        if quarantine_s is not None:
            self.ledger.quarantine_s = quarantine_s
        self.metrics = TransferMetrics()
        self.peers = Peers(agent, info, secret, self.metrics, faults or Faults(), handshake_timeout_s)
        self.posted = Posted(agent, self.ledger, self.metrics, emit, block_size)
        self.side: RoleSide = (PrefillSide(self.posted, self.peers, layerwise) if role is Role.PREFILL
                               else DecodeSide(self.posted, self.peers))
        self._handlers: dict[type, Callable[[Any], None]] = {
            AddPeer: self.peers.add, SendNotif: self.peers.send_notif, **self.side.handlers()}
        self.commands: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self.pacer = Pacer()
        self._stopping = threading.Event()  # not `_stop`: that name is Thread's own
        self._last_housekeeping = 0.0
        self.rounds = 0  # loop rounds run (what a test waits on to know the thread caught up)

    # ---- thread API (any thread) -----------------------------------------------------------
    def submit(self, command: Command) -> None:
        self.commands.put(command)

    def stop(self) -> None:
        self._stopping.set()
        self.commands.put(None)

    def wake(self) -> None:
        """Start a loop round now if the thread is waiting idle."""
        self.commands.put(None)

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
        cpu0 = time.thread_time()
        while not self._stopping.is_set():
            cap = self.poll_cap()
            try:
                progressed = self._round(self.pacer.queue_timeout(cap))
            except (TransferError, ValueError) as e:  # never let one bad transfer stop the thread
                log.error("transfer thread: %s", e)
                progressed = True
            if progressed:
                self.pacer.refresh(self.ledger)
            self.metrics.thread_cpu_s = time.thread_time() - cpu0
            self.pacer.after_round(progressed, cap)
            self.rounds += 1
        self._wind_down()
        self.agent.close()

    def _wind_down(self) -> None:
        """Stopping (the instance shuts down): apply the commands still queued (Cancel of the requests
        just aborted), fail every live transfer so that its peer hears of it now (D sends Abort; P sends
        Fail once no WRITE of its own is in flight), and run rounds until posted transfers and delayed
        notifications are done, at most WIND_DOWN_S."""
        deadline = time.monotonic() + WIND_DOWN_S
        try:
            self._drain(None)
            for rec in self.ledger.records():
                if not rec.is_terminal:
                    self.side.fail(rec, "the peer instance shut down", kind=FailureKind.SHUTDOWN)
            self.pacer.refresh(self.ledger)
            while (cap := self.poll_cap()) is not None and time.monotonic() < deadline:
                progressed = self._round(None)
                self.pacer.refresh(self.ledger)
                self.pacer.after_round(progressed, cap)
            self.agent.get_notifs()  # one more progress call: what was just sent goes out
        except (TransferError, ValueError) as e:
            log.error("transfer thread, stopping: %s", e)

    def poll_cap(self) -> float | None:
        """The longest sleep between rounds now; None: idle, the thread blocks on its queue."""
        return self.pacer.cap(bool(self.posted) or bool(self.peers.delayed), self.side.relaxed(self.pacer.live))

    def _round(self, wait_s: float | None) -> bool:
        progressed = self._drain(wait_s)
        for tid, transfer, state in self.posted.poll():
            self.side.transfer_ended(tid, transfer, state)
            progressed = True
        progressed |= self.side.poll()
        progressed |= self._poll_notifs()
        progressed |= self._housekeeping()
        progressed |= self.peers.send_delayed()
        return progressed

    def _drain(self, wait_s: float | None) -> bool:
        progressed = False
        try:
            cmd = self.commands.get(timeout=wait_s) if wait_s else self.commands.get_nowait()
            while True:
                if cmd is not None:
                    self._handle(cmd)
                    progressed = True
                cmd = self.commands.get_nowait()
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
