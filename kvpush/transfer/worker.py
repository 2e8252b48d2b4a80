"""The transfer thread of one prefill or decode instance: it owns every NIXL call.

The engine thread hands it commands (a thread-safe queue) and gets events back (another queue,
plus a wake-up of the step loop). The side-channel thread hands it handshakes to apply.

P (prefill) per transfer:  Expect -> Hold (prefill done) -+-> [PushReg matched] WRITE posted
                                                          |      -> WRITE done -> FreeBlocks
                                                          +-> [pull] ReadDone / Release -> FreeBlocks
                           lease expiry / Abort / Fail -> FreeBlocks (+ Fail to D on expiry)
D (decode) per transfer:   Register (push: PushReg sent)  -> Done notification -> KVReady
                           Read (pull: READ posted)       -> READ done (ReadDone to P) -> KVReady
                           Fail / deadline / Cancel -> KVFailed; blocks quarantined until
                           nothing can be in flight, then FreeBlocks

Polling: tight (with a short, growing sleep) while any transfer or expected notification is
outstanding; when idle it blocks on its command queue and checks notifications a few times a second.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from kvpush.config import Faults
from kvpush.errors import HandshakeError, TransferError
from kvpush.transfer import protocol as pr
from kvpush.transfer.commands import (
    AddPeer,
    Cancel,
    Event,
    Expect,
    FreeBlocks,
    Hold,
    KVFailed,
    KVReady,
    LayersDone,
    Read,
    Register,
    SendNotif,
)
from kvpush.transfer.handshake import HandshakeInfo, pack, verify_and_decode
from kvpush.transfer.layerwise import LayerwiseWriter
from kvpush.transfer.ledger import Side, TransferLedger, TransferRecord
from kvpush.transfer.ledger import TransferState as S
from kvpush.transfer.nixl_agent import NixlTransferAgent, Transfer, TransferState
from kvpush.transfer.prefill_steps import PrefillSteps
from kvpush.transfer.stats import TransferMetrics

log = logging.getLogger("kvpush.transfer")
IDLE_WAIT_S = 0.2
MAX_BACKOFF_S = 0.0005  # something latency-critical is outstanding: poll at least this often
RELAXED_POLL_S = 0.001  # D waits for its peer's prefill: the Done may come any time
HOUSEKEEPING_S = 0.01
LEASE_MARGIN_S = 0.5  # D does not start a READ this close to the end of P's lease
CANCELLED_TTL_S = 300.0


class TransferWorker(PrefillSteps):
    def __init__(self, side: Side, agent: NixlTransferAgent, info: HandshakeInfo, secret: str | None,
                 emit: Callable[[Event], None], block_size: int, handshake_timeout_s: float = 5.0,
                 faults: Faults | None = None, layerwise: bool = False) -> None:
        super().__init__(name=f"kvpush-transfer-{side.value}", daemon=True)
        self.side = side
        self.block_size = block_size
        self.agent = agent
        self.info = info
        self.secret = secret
        self.emit = emit
        self.handshake_timeout_s = handshake_timeout_s
        self.ledger = TransferLedger(side)
        self.metrics = TransferMetrics()
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.posted: dict[str, Transfer] = {}
        self.expected: set[str] = set()  # P: transfers announced by the engine, prefill not done yet
        self.peers: dict[str, str] = {}  # engine id -> nixl peer name
        self.first_tokens: dict[str, int | None] = {}
        self.cancelled: dict[str, tuple[str, float]] = {}  # P: id -> (reason, when), cancelled before any record
        self.reg_times: dict[str, float] = {}  # P: when each PushReg arrived (for the breakdown)
        self._live = False  # some ledger record is not terminal (refreshed on every change)
        self._urgent = False  # some live record is latency-critical
        self.faults = faults or Faults()
        self._rng = random.Random(f"{self.faults.seed}-{info.engine_id}")
        self.delayed: list[tuple[float, int, str, pr.Message]] = []  # heap of notifications to send later
        self._delay_seq = 0
        geometry = agent.geometry
        self.layerwise = LayerwiseWriter(agent, geometry.num_layers) if layerwise and geometry else None
        self._stopping = threading.Event()  # not `_stop`: that name is Thread's own
        self._last_housekeeping = 0.0

    # ---- thread API (any thread) ---------------------------------------------------------
    def submit(self, command: object) -> None:
        self.commands.put(command)

    def stop(self) -> None:
        self._stopping.set()
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

    # ---- loop ----------------------------------------------------------------------------
    def run(self) -> None:
        backoff = 0.0
        cpu0 = time.thread_time()
        while not self._stopping.is_set():
            cap = self._poll_cap()
            busy = cap is not None
            try:
                progressed = self._drain(None if busy else IDLE_WAIT_S)
                progressed |= self._poll_posted()
                progressed |= self._poll_notifs()
                progressed |= self._housekeeping()
                progressed |= self._send_delayed()
            except (TransferError, ValueError) as e:  # never let one bad transfer stop the thread
                log.error("transfer thread: %s", e)
                progressed = True
            if progressed:
                self._refresh_live()
            self.metrics.thread_cpu_s = time.thread_time() - cpu0
            if progressed or cap is None:
                backoff = 0.0
            else:
                backoff = min(cap, backoff * 2 or 0.00002)
                time.sleep(backoff)
        self.agent.close()

    def _poll_cap(self) -> float | None:
        """Longest sleep between polls: None when idle (block on the command queue instead).

        Tight while a transfer is posted or a finished prefill waits for its registration. While
        P's own prefill runs there is nothing P must react to at once (a PushReg is matched when
        the prefill ends, which wakes this thread through its command queue), so P stays idle and
        leaves the CPU and the GIL to the forward pass; D polls every millisecond for its Done."""
        if self.posted or self.delayed or self._urgent:
            return MAX_BACKOFF_S
        if self._live and self.side is Side.DECODE:
            return RELAXED_POLL_S
        if self.layerwise is not None and self.layerwise.transfers:
            return RELAXED_POLL_S  # layer writes follow the forward pass; registrations may arrive
        return None

    def _refresh_live(self) -> None:
        counts = self.ledger.count_by_state()
        live = {state for state, n in counts.items() if n and not state.is_terminal}
        self._live = bool(live)
        # A REGISTERED record waits for a prefill to finish (P: its own; D: its peer's).
        self._urgent = bool(live - {S.REGISTERED})

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

    def _handle(self, cmd: object) -> None:
        try:
            self._dispatch(cmd)
        except (TransferError, HandshakeError, ValueError) as e:
            self._command_failed(cmd, str(e))

    def _dispatch(self, cmd: object) -> None:
        if isinstance(cmd, Expect):
            self.expected.add(cmd.transfer_id)
        elif isinstance(cmd, LayersDone):
            self._layers_done(cmd)
        elif isinstance(cmd, Hold):
            self._hold(cmd)
        elif isinstance(cmd, Register):
            self._register(cmd)
        elif isinstance(cmd, Read):
            self._read(cmd)
        elif isinstance(cmd, SendNotif):
            self._ensure_peer(cmd.peer)
            self._send(cmd.peer.engine_id, cmd.message)
        elif isinstance(cmd, Cancel):
            self._cancel(cmd)
        elif isinstance(cmd, AddPeer):
            self._add_peer(cmd)

    def _command_failed(self, cmd: object, reason: str) -> None:
        log.warning("transfer command %s failed: %s", type(cmd).__name__, reason)
        tid = getattr(cmd, "transfer_id", None)
        if isinstance(cmd, AddPeer):
            cmd.done.set_exception(TransferError(reason))
        elif tid is not None:
            rec = self.ledger.get(tid)
            if rec is not None and not rec.is_terminal:
                self._fail(rec, reason, tell_peer=True)
            elif rec is None and isinstance(cmd, (Register, Read)):
                self.emit(KVFailed(tid, cmd.request_id, reason))
                self.emit(FreeBlocks(list(cmd.block_ids if isinstance(cmd, Register) else cmd.local_ids)))

    # ---- D side --------------------------------------------------------------------------
    def _register(self, cmd: Register) -> None:
        self._ensure_peer(cmd.peer)
        self.ledger.register(cmd.transfer_id, cmd.request_id, cmd.block_ids, cmd.deadline,
                             peer_engine_id=cmd.peer.engine_id, num_tokens=cmd.num_tokens,
                             num_prefix_tokens=cmd.num_prefix_tokens)
        reg = pr.PushReg(cmd.transfer_id, self.info.engine_id, list(cmd.block_ids), cmd.num_prefix_tokens,
                         cmd.num_tokens, cmd.deadline)
        self._send(cmd.peer.engine_id, reg)

    def _read(self, cmd: Read) -> None:
        if cmd.lease_expiry is not None and time.time() > cmd.lease_expiry - LEASE_MARGIN_S:
            raise TransferError("P's lease on the blocks expired before D could read them")
        peer = self._ensure_peer(cmd.peer)
        self._check_post_fault("READ")
        self.ledger.register(cmd.transfer_id, cmd.request_id, cmd.local_ids, cmd.deadline,
                             peer_engine_id=cmd.peer.engine_id, remote_block_ids=cmd.remote_ids,
                             num_tokens=cmd.num_tokens)
        rec = self.ledger.get(cmd.transfer_id)
        assert rec is not None
        notif = pr.encode(pr.ReadDone(cmd.transfer_id))
        if self._fault(self.faults.drop_notif):
            self.metrics.faults_injected += 1
            notif = b""  # P never hears that the READ ended: its lease must free the blocks
        self._track(rec, self.agent.read(peer, cmd.local_ids, cmd.remote_ids, notif))

    def _cancel(self, cmd: Cancel) -> None:
        self.expected.discard(cmd.transfer_id)
        rec = self.ledger.get(cmd.transfer_id)
        if rec is None:
            if self.side is Side.PREFILL:  # aborted before D registered: answer its PushReg with Fail
                self.cancelled[cmd.transfer_id] = (cmd.reason, time.monotonic())
                if cmd.peer_engine_id is not None:
                    self._send(cmd.peer_engine_id, pr.Fail.create(cmd.transfer_id, cmd.reason))
            return
        if not rec.is_terminal:
            self._fail(rec, cmd.reason, tell_peer=True)

    # ---- completion ----------------------------------------------------------------------
    def _poll_posted(self) -> bool:
        progressed = False
        for tid, transfer in list(self.posted.items()):
            state = self.agent.poll(transfer)
            if state is TransferState.POSTED:
                continue
            progressed = True
            del self.posted[tid]
            self.agent.release(transfer)
            self._finished(tid, transfer, state)
        for tid in self.layerwise.poll() if self.layerwise is not None else []:
            progressed = True
            self._layerwise_settled(tid)
        return progressed

    def _finished(self, tid: str, transfer: Transfer, state: TransferState) -> None:
        rec = self.ledger.get(tid)
        if rec is None:
            return
        if rec.is_terminal:  # aborted while in flight: now nothing is
            if self.side is Side.PREFILL:
                self._free_p(rec)
                if rec.peer_engine_id:
                    self._send(rec.peer_engine_id, pr.Fail.create(tid, "aborted; write ended"))
            elif rec.is_quarantined:
                self.ledger.confirm_nothing_in_flight(tid)
            return
        if state is TransferState.DONE:
            self.metrics.observe(transfer)
            rec = self.ledger.mark_done(tid)
            if self.side is Side.PREFILL:
                self._free_p(rec)
            else:
                landed = (("read_posted", time.time() - time.monotonic() + transfer.posted_at), ("kv_landed", time.time()))
                self.emit(KVReady(tid, rec.request_id or "", None, landed))
        else:
            self._fail(rec, transfer.error or "transfer failed", tell_peer=True, confirmed=True)

    def _fail(self, rec: TransferRecord, reason: str, tell_peer: bool, confirmed: bool = False) -> None:
        in_flight = rec.transfer_id in self.posted
        rec = self.ledger.mark_failed(rec.transfer_id, reason, confirmed=confirmed and not in_flight)
        if tell_peer:
            self._tell_peer_failed(rec, reason)
        self._terminal(rec)

    def _tell_peer_failed(self, rec: TransferRecord, reason: str) -> None:
        """Fail (P) / Abort (D) promise the peer that nothing of ours is in flight: while our WRITE is,
        P's message waits for the WRITE to end (`_finished` sends it)."""
        if not rec.peer_engine_id or (self.side is Side.PREFILL and self._posting(rec.transfer_id)):
            return
        msg = pr.Fail.create(rec.transfer_id, reason) if self.side is Side.PREFILL else pr.Abort(rec.transfer_id)
        self._send(rec.peer_engine_id, msg)

    def _terminal(self, rec: TransferRecord) -> None:
        """A record just became FAILED or EXPIRED (not DONE)."""
        self.reg_times.pop(rec.transfer_id, None)
        if self.side is Side.PREFILL:
            if rec.has_local and not self._posting(rec.transfer_id):
                self._free_p(rec)
        else:
            self.emit(KVFailed(rec.transfer_id, rec.request_id or "", rec.error or "transfer failed"))

    # ---- notifications -------------------------------------------------------------------
    def _poll_notifs(self) -> bool:
        notifs = self.agent.get_notifs()
        for peer_name, data in notifs:
            self._on_notif(peer_name, data)
        return bool(notifs)

    def _on_notif(self, peer_name: str, data: bytes) -> None:
        try:
            msg = pr.decode(data)
        except pr.ProtocolError as e:
            self.metrics.bad_messages += 1
            if self.metrics.bad_messages == 1:
                log.warning("bad control message from %s: %s", peer_name, e)
            return
        engine_id = self._engine_of(peer_name)
        if isinstance(msg, pr.Commit) and self.side is Side.DECODE:  # layer-wise: the last layer landed
            msg = pr.Done(msg.transfer_id, msg.first_token_id, reg_received=msg.reg_received,
                          write_posted=msg.write_posted)
        if isinstance(msg, pr.PushReg) and msg.transfer_id in self.cancelled:
            self._send(engine_id, pr.Fail.create(msg.transfer_id, self.cancelled.pop(msg.transfer_id)[0]))
            return
        before = self.ledger.get(msg.transfer_id)
        rec = self.ledger.on_notification(msg, engine_id)
        if rec is None:
            if isinstance(msg, pr.PushReg) and before is not None and before.is_terminal and before.state is not S.DONE:
                self._send(engine_id, pr.Fail.create(msg.transfer_id, before.error or "transfer already ended"))
            return
        if isinstance(msg, pr.PushReg):
            self.reg_times[rec.transfer_id] = time.time()
        if self.side is Side.PREFILL:
            if isinstance(msg, pr.Abort) and rec.transfer_id not in self.posted:
                self._send(engine_id, pr.Fail.create(rec.transfer_id, "aborted by decode"))  # ack: nothing in flight
            try:
                self._after_p_update(rec)
            except (TransferError, ValueError) as e:
                self._fail(rec, str(e), tell_peer=True)
        elif rec.state is S.DONE:
            geometry = self.agent.geometry
            self.metrics.received(len(rec.local_block_ids) * (geometry.block_bytes if geometry else 0))
            trace = (*((k, v) for k in ("reg_received", "write_posted") if (v := getattr(msg, k, None))),
                     ("kv_landed", time.time()))
            self.emit(KVReady(rec.transfer_id, rec.request_id or "", getattr(msg, "first_token_id", None), trace))
        elif rec.is_terminal and (before is None or not before.is_terminal):
            self._terminal(rec)

    def _engine_of(self, peer_name: str) -> str:
        for engine_id, name in self.peers.items():
            if name == peer_name:
                return engine_id
        return peer_name

    # ---- timers --------------------------------------------------------------------------
    def _housekeeping(self) -> bool:
        """Expiry, quarantine release, tombstone collection. Returns True if any record changed."""
        now = time.monotonic()
        if now - self._last_housekeeping < HOUSEKEEPING_S:
            return False
        self._last_housekeeping = now
        expired = self.ledger.expire()
        for rec in expired:
            self._expired(rec)
        freed = self.ledger.release_quarantine() if self.side is Side.DECODE else []
        if freed:
            self.emit(FreeBlocks(freed))
        self.ledger.gc()
        for tid in [t for t, (_, when) in self.cancelled.items() if now - when > CANCELLED_TTL_S]:
            del self.cancelled[tid]
        return bool(expired or freed)

    def _expired(self, rec: TransferRecord) -> None:
        self._tell_peer_failed(rec, "lease expired" if self.side is Side.PREFILL else "deadline passed")
        self._terminal(rec)

    def stats(self):
        return self.metrics.snapshot(self.ledger)
