"""The transfer thread (kvpush.transfer.thread) over fake agents: no nixl, no sockets, no servers.

Two ``TransferThread``s (P and D) run over two ``FakeAgent``s on one ``FakeFabric`` and are
wired with ``AddPeer`` commands, so ``_ensure_peer`` never opens a side channel. Every wait polls
with a deadline; every thread started here is stopped by the fixture.

Engine ids and agent names differ on purpose ("prefill-e0" / "prefill-a0"): the worker must map
notification senders (agent names) back to engine ids.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from kvpush.config import Role
from kvpush.errors import HandshakeError, TransferError
from kvpush.transfer import peers as peers_module
from kvpush.transfer import protocol as pr
from kvpush.transfer.commands import (
    AddPeer,
    Cancel,
    Hold,
    PeerAddr,
    Read,
    Register,
    SendNotif,
)
from kvpush.transfer.descriptors import KVGeometry
from kvpush.transfer.events import FreeBlocks, KVFailed, KVReady
from kvpush.transfer.fake import FakeAgent, FakeFabric
from kvpush.transfer.handshake import HandshakeInfo
from kvpush.transfer.kv_agent import PeerDisconnectedError, XferStatus
from kvpush.transfer.ledger import TransferLedger
from kvpush.transfer.ledger import TransferState as S
from kvpush.transfer.thread import (
    GRACE_S,
    IDLE_WAIT_S,
    MAX_BACKOFF_S,
    RELAXED_POLL_S,
    WAITING_POLL_S,
    Pacer,
    TransferThread,
)

NB, NL, BS, KVH, HD = 16, 2, 4, 2, 8  # kv[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
P_ENGINE, D_ENGINE = "prefill-e0", "decode-e0"
P_AGENT, D_AGENT = "prefill-a0", "decode-a0"
P_ADDR = PeerAddr(P_ENGINE, "127.0.0.1", 1)  # never dialled: the peers are wired with AddPeer
TIMEOUT = 5.0


# ---- helpers -----------------------------------------------------------------------------------


def wait_until(cond: Callable[[], Any], timeout: float = TIMEOUT, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.002)


def geometry(agent: FakeAgent) -> KVGeometry:
    assert agent.geometry is not None, "register_kv first"
    return agent.geometry


def quiesce(*nodes: Node) -> None:
    """Wait until every node's transfer thread ran two full rounds after the call, all of them
    woken (not a fixed sleep): whatever was queued or in an inbox before has been handled, and
    what that sent to the other threads too."""
    for _ in range(2):
        marks = [(n.worker, n.worker.rounds) for n in nodes if n.worker is not None]
        wait_until(lambda marks=marks: _woken(marks) and all(w.rounds > r + 1 for w, r in marks),
                   what="a full round of each thread")


def _woken(marks: list[tuple[TransferThread, int]]) -> bool:
    for w, _ in marks:
        w.wake()
    return True


class Recorder:
    """The worker's ``emit``: events with their wall time, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[tuple[float, Any]] = []

    def __call__(self, event: Any) -> None:
        with self._lock:
            self._events.append((time.time(), event))

    def timed(self, cls: type | None = None, tid: str | None = None) -> list[tuple[float, Any]]:
        with self._lock:
            return [(t, e) for t, e in self._events if (cls is None or isinstance(e, cls))
                    and (tid is None or getattr(e, "transfer_id", tid) == tid)]

    def of(self, cls: type | None = None, tid: str | None = None) -> list[Any]:
        return [e for _, e in self.timed(cls, tid)]

    def wait(self, cls: type, tid: str | None = None, n: int = 1, timeout: float = TIMEOUT) -> list[Any]:
        return wait_until(lambda: (lambda ev: ev if len(ev) >= n else None)(self.of(cls, tid)), timeout,
                          f"{n} x {cls.__name__}({tid})")

    def freed(self) -> list[list[int]]:
        return [sorted(e.block_ids) for e in self.of(FreeBlocks)]


@dataclass
class Node:
    agent: FakeAgent
    kv: torch.Tensor
    info: HandshakeInfo
    events: Recorder
    worker: TransferThread | None


class Cluster:
    def __init__(self) -> None:
        self.fabric = FakeFabric(seed=1234)
        self.nodes: list[Node] = []

    def node(self, side: Role, engine_id: str, agent_name: str, *, worker: bool = True,
             quarantine_s: float | None = None, seed: int = 0, layerwise: bool = False,
             writes_per_peer: int = 1) -> Node:
        gen = torch.Generator().manual_seed(seed)
        kv = torch.randn(NB, NL, 2, BS, KVH, HD, generator=gen)
        agent = self.fabric.agent(agent_name)
        agent.register_kv(kv)
        info = agent.handshake_info(engine_id, side)
        events = Recorder()
        w = None
        if worker:
            w = TransferThread(side, agent, info, None, events, BS, handshake_timeout_s=2.0,
                               quarantine_s=quarantine_s, layerwise=layerwise, writes_per_peer=writes_per_peer)
        node = Node(agent, kv, info if w is None else w.info, events, w)  # the thread's has its doorbell
        self.nodes.append(node)
        if w is not None:
            w.start()
        return node

    def close(self) -> None:
        for n in self.nodes:
            if n.worker is not None:
                n.worker.stop()
        stuck = [n.worker.name for n in self.nodes if n.worker is not None and not join(n.worker, 3.0)]
        for n in self.nodes:
            n.agent.close()
        assert not stuck, f"transfer threads did not stop: {stuck}"


def alive(w: threading.Thread) -> bool:
    """True while the thread runs (test_join_after_stop checks Thread.join/is_alive themselves)."""
    return any(t is w for t in threading.enumerate())


def join(w: threading.Thread, timeout: float) -> bool:
    """Wait until the thread ended; True if it did."""
    deadline = time.monotonic() + timeout
    while alive(w) and time.monotonic() < deadline:
        time.sleep(0.005)
    return not alive(w)


def add_peer(node: Node, other: Node) -> str:
    assert node.worker is not None
    done: Future = Future()
    node.worker.submit(AddPeer(other.info, done))
    return done.result(timeout=TIMEOUT)


def make_pair(cluster: Cluster, d_quarantine_s: float | None = None, layerwise: bool = False,
              writes_per_peer: int = 1) -> tuple[Node, Node]:
    p = cluster.node(Role.PREFILL, P_ENGINE, P_AGENT, seed=1, layerwise=layerwise, writes_per_peer=writes_per_peer)
    d = cluster.node(Role.DECODE, D_ENGINE, D_AGENT, seed=2, quarantine_s=d_quarantine_s)
    assert add_peer(p, d) == D_AGENT
    assert add_peer(d, p) == P_AGENT
    return p, d


def register(tid: str, blocks, *, prefix: int = 0, num_tokens: int = 11, deadline_s: float = TIMEOUT,
             rid: str = "req-d") -> Register:
    return Register(tid, rid, P_ADDR, tuple(blocks), prefix, num_tokens, time.time() + deadline_s)


def hold(tid: str, blocks, *, first: int | None = 7, lease_s: float = TIMEOUT, decode: str | None = D_ENGINE,
         num_tokens: int = 11, rid: str = "req-p") -> Hold:
    return Hold(tid, rid, tuple(blocks), num_tokens, first, time.time() + lease_s, decode)


def rec_state(node: Node, tid: str) -> S | None:
    assert node.worker is not None
    rec = node.worker.ledger.get(tid)
    return rec.state if rec is not None else None


def counters(node: Node):
    assert node.worker is not None
    return node.worker.ledger.counters


P_BLOCKS = (3, 4, 5)
D_BLOCKS = (9, 1, 12)


def start_push(p: Node, d: Node, tid: str, order: str, *, first: int | None = 7,
               d_blocks=D_BLOCKS, p_blocks=P_BLOCKS, prefix: int = 0, d_deadline_s: float = TIMEOUT,
               lease_s: float = TIMEOUT) -> None:
    """Register on D and Hold on P in the given order, each seen by P before the other is sent."""
    assert p.worker is not None and d.worker is not None
    if order == "register_first":
        d.worker.submit(register(tid, d_blocks, prefix=prefix, deadline_s=d_deadline_s))
        wait_until(lambda: rec_state(p, tid) is S.REGISTERED, what="P sees the PushReg")
        p.worker.submit(hold(tid, p_blocks, first=first, lease_s=lease_s))
    else:
        p.worker.submit(hold(tid, p_blocks, first=first, lease_s=lease_s))
        wait_until(lambda: rec_state(p, tid) is S.PREFILLED, what="P holds the blocks")
        d.worker.submit(register(tid, d_blocks, prefix=prefix, deadline_s=d_deadline_s))


ORDERS = ["register_first", "hold_first"]


# ---- the fake agent itself ---------------------------------------------------------------------


def test_fake_agent_copies_blocks_and_layers_then_notifies():
    fabric = FakeFabric(seed=3)
    a, b = fabric.agent("a"), fabric.agent("b")
    ka = torch.randn(NB, NL, 2, BS, KVH, HD)
    kb = torch.zeros_like(ka)
    a.register_kv(ka)
    b.register_kv(kb)
    with pytest.raises(TransferError, match="unknown peer"):
        a.write("b", [0], [0])
    a.connect(b)
    assert a.peers() == ["b"] and b.is_connected("a")
    t = a.write("b", [1, 2, 7], [4, 5, 0], b"hello")
    assert t.state is XferStatus.DONE and t.num_descs == 2 and t.num_bytes == 3 * ka[0].numel() * 4
    assert torch.equal(kb[[4, 5, 0]], ka[[1, 2, 7]])
    assert b.get_notifs() == [("a", b"hello")] and b.get_notifs() == []
    t = a.write_layers("b", [3], [3], [1])
    assert torch.equal(kb[3, 1], ka[3, 1]) and not kb[3, 0].any()
    # READ, delayed: the data and the notification arrive together, at the third poll
    b.delay_completion_polls = 2
    kb[8].fill_(1.5)
    t = b.read("a", [9], [8], b"rd")
    assert t.state is XferStatus.POSTED and b.in_flight() == [t]
    assert b.poll(t) is XferStatus.POSTED and b.poll(t) is XferStatus.POSTED
    assert not torch.equal(kb[9], ka[8]) and a.get_notifs() == []
    assert b.poll(t) is XferStatus.DONE
    assert torch.equal(kb[9], ka[8]) and a.get_notifs() == [("b", b"rd")]
    b.release(t)
    with pytest.raises(ValueError, match="out of range"):
        a.write("b", [NB], [0])
    with pytest.raises(ValueError, match="out of range"):
        a.write("b", [0], [-1])
    with pytest.raises(ValueError):
        a.write("b", [0, 1], [0])
    with pytest.raises(HandshakeError, match="already added"):
        a.add_peer(b.metadata(), geometry(b))
    a.close()
    b.close()


def test_fake_agent_fault_injection():
    fabric = FakeFabric(seed=3)
    a, b = fabric.agent("a"), fabric.agent("b")
    ka = torch.randn(NB, NL, 2, BS, KVH, HD)
    kb = torch.zeros_like(ka)
    a.register_kv(ka)
    b.register_kv(kb)
    a.connect(b)
    a.fail_next_post = 1
    with pytest.raises(TransferError, match="injected"):
        a.write("b", [0], [0], b"x")
    assert not kb.any() and b.get_notifs() == []
    a.fail_next_completion = 1
    t = a.write("b", [0], [0], b"x")
    assert a.poll(t) is XferStatus.FAILED and t.error and not kb.any() and b.get_notifs() == []
    a.drop_notifs = 2
    for i in range(3):
        a.send_notif("b", bytes([i]))
    assert b.get_notifs() == [("a", b"\x02")] and a.dropped_notifs == 2
    # probability: reproducible with the fabric's seed
    runs = []
    for _ in range(2):
        f = FakeFabric(seed=7)
        x, y = f.agent("x"), f.agent("y")
        x.register_kv(torch.zeros(2, 1, 1, 1, 1, 4))
        y.register_kv(torch.zeros(2, 1, 1, 1, 1, 4))
        x.connect(y)
        x.drop_notifs = 0.5
        for i in range(64):
            x.send_notif("y", bytes([i]))
        runs.append([m for _, m in y.get_notifs()])
    assert runs[0] == runs[1] and 10 < len(runs[0]) < 54
    a.delay_completion_polls = 10**9
    t = a.write("b", [1], [1])
    a.disconnect("b")
    assert not a.is_connected("b")
    with pytest.raises(PeerDisconnectedError):
        a.write("b", [2], [2])
    with pytest.raises(TransferError):
        a.send_notif("b", b"x")
    assert a.poll(t) is XferStatus.FAILED and not kb[1].any()
    assert a.remove_peer("b") and a.peers() == []
    b.close()
    assert "b" not in fabric
    a.close()
    with pytest.raises(TransferError, match="closed"):
        a.get_notifs()


# ---- push ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
def test_push_delivers_once_in_either_order(cluster, order):
    p, d = make_pair(cluster)
    tid = pr.new_transfer_id()
    start_push(p, d, tid, order)
    (ready,) = d.events.wait(KVReady, tid)
    assert (ready.transfer_id, ready.request_id, ready.first_token_id) == (tid, "req-d", 7)
    p.events.wait(FreeBlocks)
    quiesce(p, d)
    assert len(d.events.of(KVReady)) == 1
    assert p.events.freed() == [sorted(P_BLOCKS)]
    assert d.events.of(FreeBlocks) == [] and d.events.of(KVFailed) == [] and p.events.of(KVFailed) == []
    assert torch.equal(d.kv[list(D_BLOCKS)], p.kv[list(P_BLOCKS)])
    assert rec_state(p, tid) is S.DONE and rec_state(d, tid) is S.DONE
    assert p.worker is not None and p.worker.metrics.transfers_total == 1


def test_push_with_prefix_writes_only_the_blocks_after_it(pd):
    p, d = pd
    tid = pr.new_transfer_id()
    before = d.kv.clone()
    # D's block table is (9, 1, 12); block 9 came from D's prefix cache, so D registers (1, 12)
    start_push(p, d, tid, "hold_first", d_blocks=(1, 12), prefix=BS)
    d.events.wait(KVReady, tid)
    assert p.events.wait(FreeBlocks)[0].block_ids == list(P_BLOCKS)  # P frees all it held
    expected = before.clone()
    expected[1], expected[12] = p.kv[4], p.kv[5]
    assert torch.equal(d.kv, expected)  # block 9 (and every other block) untouched
    assert torch.equal(d.kv[9], before[9])


def test_two_transfers_share_a_prefix_cached_block_of_p(pd):
    """Two requests with a common prefix hold the same prefix-cached block on P (one reference each):
    both transfers deliver, and P frees each transfer's blocks once."""
    p, d = pd
    a, b = pr.new_transfer_id(), pr.new_transfer_id()
    p.worker.submit(hold(a, (3, 4, 5)))
    p.worker.submit(hold(b, (3, 4, 6), rid="req-p2"))
    wait_until(lambda: rec_state(p, a) is S.PREFILLED and rec_state(p, b) is S.PREFILLED, what="both held")
    d.worker.submit(register(a, (9, 1, 12)))
    d.worker.submit(register(b, (2, 7, 8), rid="req-d2"))
    d.events.wait(KVReady, a)
    d.events.wait(KVReady, b)
    p.events.wait(FreeBlocks, n=2)
    assert sorted(p.events.freed()) == [[3, 4, 5], [3, 4, 6]]
    assert torch.equal(d.kv[[9, 1, 12]], p.kv[[3, 4, 5]]) and torch.equal(d.kv[[2, 7, 8]], p.kv[[3, 4, 6]])


def test_a_hold_the_ledger_refuses_gives_its_blocks_back(pd):
    p, _ = pd
    tid = pr.new_transfer_id()
    p.worker.submit(hold(tid, P_BLOCKS))
    wait_until(lambda: rec_state(p, tid) is S.PREFILLED, what="P holds the blocks")
    p.worker.submit(hold(tid, (7, 8)))  # "prefill reported done twice": an internal error fails the transfer
    p.events.wait(FreeBlocks, n=2)
    assert sorted(p.events.freed()) == [[3, 4, 5], [7, 8]]  # nothing of either Hold is left held
    assert rec_state(p, tid) is S.FAILED


def test_d_cancel_after_the_kv_landed_frees_d_blocks(pd):
    """D's request ends between the transfer's DONE and the engine applying KVReady: the engine
    detached the blocks and sent Cancel, so D's transfer thread gives them back."""
    p, d = pd
    tid = pr.new_transfer_id()
    start_push(p, d, tid, "hold_first")
    d.events.wait(KVReady, tid)
    assert rec_state(d, tid) is S.DONE and d.events.of(FreeBlocks) == []
    d.worker.submit(Cancel(tid, "decode finished_aborted", P_ENGINE))
    assert d.events.wait(FreeBlocks)[0].block_ids == list(D_BLOCKS)
    quiesce(p, d)
    assert len(d.events.of(FreeBlocks)) == 1 and rec_state(d, tid) is S.DONE


def test_first_token_travels_with_done(pd):
    p, d = pd
    tid = pr.new_transfer_id()
    start_push(p, d, tid, "register_first", first=42)
    (ready,) = d.events.wait(KVReady, tid)
    assert ready.first_token_id == 42


def test_release_frees_p_blocks_in_either_order(pd):
    p, d = pd
    assert p.worker is not None and d.worker is not None
    early, late = pr.new_transfer_id(), pr.new_transfer_id()
    # Release before P finished prefill (tombstone), then the Hold: freed at once
    d.worker.submit(SendNotif(P_ADDR, pr.Release(early)))
    wait_until(lambda: rec_state(p, early) is S.DONE, what="tombstone")
    p.worker.submit(hold(early, (1, 2)))
    # Hold first, then Release (D had a full prefix hit)
    p.worker.submit(hold(late, (6, 7)))
    wait_until(lambda: rec_state(p, late) is S.PREFILLED)
    d.worker.submit(SendNotif(P_ADDR, pr.Release(late)))
    p.events.wait(FreeBlocks, n=2)
    quiesce(p, d)
    assert sorted(p.events.freed()) == [[1, 2], [6, 7]]
    assert p.agent.stats.transfers_posted == 0 and counters(p).early == 1


# ---- pull ----------------------------------------------------------------------------------------


def test_pull_reads_then_p_frees_after_read_done(pd):
    p, d = pd
    assert p.worker is not None and d.worker is not None
    tid = pr.new_transfer_id()
    p.worker.submit(hold(tid, P_BLOCKS, decode=None))
    wait_until(lambda: rec_state(p, tid) is S.PREFILLED)
    d.agent.delay_completion_polls = 10**9  # the READ stays in flight until finish_delayed
    d.worker.submit(Read(tid, "req-d", P_ADDR, D_BLOCKS, P_BLOCKS, 11, time.time() + TIMEOUT))
    wait_until(d.agent.in_flight, what="READ posted")
    quiesce(p, d)
    assert p.events.of(FreeBlocks) == [] and rec_state(p, tid) is S.PREFILLED  # still being read
    d.agent.finish_delayed()
    (ready,) = d.events.wait(KVReady, tid)
    assert (ready.transfer_id, ready.request_id, ready.first_token_id) == (tid, "req-d", None)
    p.events.wait(FreeBlocks)
    quiesce(p, d)
    assert p.events.freed() == [sorted(P_BLOCKS)] and len(d.events.of(KVReady)) == 1
    assert d.events.of(FreeBlocks) == [] and d.events.of(KVFailed) == []
    assert torch.equal(d.kv[list(D_BLOCKS)], p.kv[list(P_BLOCKS)])
    assert rec_state(p, tid) is S.DONE and rec_state(d, tid) is S.DONE


@pytest.mark.parametrize("fault", ["post", "completion"])
def test_pull_read_failure(pd, fault):
    p, d = pd
    assert p.worker is not None and d.worker is not None
    tid = pr.new_transfer_id()
    p.worker.submit(hold(tid, P_BLOCKS, decode=None))
    wait_until(lambda: rec_state(p, tid) is S.PREFILLED)
    if fault == "post":
        d.agent.fail_next_post = 1
    else:
        d.agent.fail_next_completion = 1
    d.worker.submit(Read(tid, "req-d", P_ADDR, D_BLOCKS, P_BLOCKS, 11, time.time() + TIMEOUT))
    d.events.wait(KVFailed, tid)
    d.events.wait(FreeBlocks)  # quarantine_s is 60 s: only a confirmation releases them this fast
    p.events.wait(FreeBlocks)
    quiesce(p, d)
    assert d.events.freed() == [sorted(D_BLOCKS)] and p.events.freed() == [sorted(P_BLOCKS)]
    assert d.events.of(KVReady) == [] and len(d.events.of(KVFailed)) == 1


# ---- notifications that must be ignored ----------------------------------------------------------


def test_unknown_stale_duplicate_foreign_and_malformed_notifications(cluster):
    p, d = make_pair(cluster)
    assert p.worker is not None and d.worker is not None
    intruder = cluster.node(Role.PREFILL, "intruder-e0", "intruder-a0", worker=False, seed=3)
    intruder.agent.add_peer(d.agent.metadata(), geometry(d.agent))

    done_tid = pr.new_transfer_id()
    start_push(p, d, done_tid, "hold_first")
    d.events.wait(KVReady, done_tid)

    c0 = counters(d)
    p.agent.send_notif(D_AGENT, pr.encode(pr.Done(pr.new_transfer_id(), 1)))  # unknown
    wait_until(lambda: counters(d).ignored_unknown == c0.ignored_unknown + 1, what="unknown counted")
    p.agent.send_notif(D_AGENT, pr.encode(pr.Done(done_tid, 7)))  # duplicate Done
    wait_until(lambda: counters(d).duplicates == c0.duplicates + 1, what="duplicate counted")
    p.agent.send_notif(D_AGENT, pr.encode(pr.Fail.create(done_tid, "late")))  # stale
    wait_until(lambda: counters(d).ignored_stale == c0.ignored_stale + 1, what="stale counted")

    live = pr.new_transfer_id()
    d.worker.submit(register(live, (2, 6)))
    wait_until(lambda: rec_state(p, live) is S.REGISTERED)
    intruder.agent.send_notif(D_AGENT, pr.encode(pr.Done(live, 5)))  # foreign
    intruder.agent.send_notif(D_AGENT, pr.encode(pr.Fail.create(live, "forged")))  # foreign
    wait_until(lambda: counters(d).ignored_foreign == c0.ignored_foreign + 2, what="foreign counted")
    assert rec_state(d, live) is S.REGISTERED

    bad = [b"", b"\x01", b"garbage", bytes([pr.PROTOCOL_VERSION + 1]) + pr.encode(pr.Abort(live))[1:],
           b"\x01\xc1\xc1", pr.encode(pr.Abort(live))[:-3]]
    for data in bad:
        intruder.agent.send_notif(D_AGENT, data)
    wait_until(lambda: d.worker.metrics.bad_messages == len(bad), what="bad messages counted")  # type: ignore[union-attr]
    assert alive(d.worker) and rec_state(d, live) is S.REGISTERED

    p.worker.submit(hold(live, (10, 11)))  # the real transfer still completes, once
    d.events.wait(KVReady, live)
    quiesce(p, d)
    assert [e.transfer_id for e in d.events.of(KVReady)] == [done_tid, live]
    assert d.events.of(KVFailed) == [] and d.events.of(FreeBlocks) == []
    assert torch.equal(d.kv[[2, 6]], p.kv[[10, 11]])
    c = counters(d)
    assert (c.ignored_unknown, c.duplicates, c.ignored_stale, c.ignored_foreign) == (
        c0.ignored_unknown + 1, c0.duplicates + 1, c0.ignored_stale + 1, c0.ignored_foreign + 2)


# ---- failures ------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
def test_write_post_failure_fails_d_and_frees_both_sides(cluster, order):
    p, d = make_pair(cluster)  # D's quarantine_s is 60 s: a fast release needs P's confirmation
    tid = pr.new_transfer_id()
    p.agent.fail_next_post = 1
    start_push(p, d, tid, order)
    (failed,) = d.events.wait(KVFailed, tid)
    assert failed.request_id == "req-d" and "injected" in failed.reason
    p.events.wait(FreeBlocks)
    d.events.wait(FreeBlocks)
    quiesce(p, d)
    assert p.events.freed() == [sorted(P_BLOCKS)] and d.events.freed() == [sorted(D_BLOCKS)]
    (t_failed, _), (t_freed, _) = d.events.timed(KVFailed)[0], d.events.timed(FreeBlocks)[0]
    assert t_freed >= t_failed
    assert d.events.of(KVReady) == [] and len(d.events.of(KVFailed)) == 1
    assert rec_state(p, tid) is S.FAILED and rec_state(d, tid) is S.FAILED
    assert counters(d).confirmations == 0  # the Fail came while D's record was live: applied, confirmed


def test_lost_done_releases_d_blocks_only_at_quarantine_deadline(cluster):
    p, d = make_pair(cluster, d_quarantine_s=0.3)
    tid = pr.new_transfer_id()
    p.agent.drop_notifs = 1  # P's first notification is the Done of the WRITE
    deadline_s = 0.4
    t0 = time.time()
    start_push(p, d, tid, "register_first", d_deadline_s=deadline_s)
    p.events.wait(FreeBlocks)  # P's WRITE completed: P is done
    d.events.wait(KVFailed, tid)
    d.events.wait(FreeBlocks)
    (t_failed, _), (t_freed, _) = d.events.timed(KVFailed)[0], d.events.timed(FreeBlocks)[0]
    assert t_failed >= t0 + deadline_s
    assert t_freed >= t0 + deadline_s + 0.3 - 0.01  # nobody confirmed: the quarantine deadline did
    assert d.events.freed() == [sorted(D_BLOCKS)] and d.events.of(KVReady) == []
    assert rec_state(d, tid) is S.EXPIRED and p.agent.dropped_notifs == 1


def test_d_cancel_before_p_prefill(pd):
    p, d = pd
    assert p.worker is not None and d.worker is not None
    tid = pr.new_transfer_id()
    d.worker.submit(register(tid, D_BLOCKS))
    wait_until(lambda: rec_state(p, tid) is S.REGISTERED)
    d.worker.submit(Cancel(tid, "decode aborted", P_ENGINE))
    d.events.wait(KVFailed, tid)
    d.events.wait(FreeBlocks)  # P acked the Abort with a Fail: nothing in flight
    wait_until(lambda: rec_state(p, tid) is S.FAILED)
    p.worker.submit(hold(tid, P_BLOCKS))  # prefill finishes later: freed at once, nothing written
    p.events.wait(FreeBlocks)
    quiesce(p, d)
    assert p.events.freed() == [sorted(P_BLOCKS)] and d.events.freed() == [sorted(D_BLOCKS)]
    assert p.agent.stats.transfers_posted == 0 and d.events.of(KVReady) == []
    assert counters(d).confirmations == 1


def test_d_cancel_while_write_in_flight(pd):
    p, d = pd
    assert d.worker is not None
    tid = pr.new_transfer_id()
    p.agent.delay_completion_polls = 10**9
    start_push(p, d, tid, "register_first")
    wait_until(p.agent.in_flight, what="WRITE posted")
    d.worker.submit(Cancel(tid, "decode aborted", P_ENGINE))
    d.events.wait(KVFailed, tid)
    wait_until(lambda: rec_state(p, tid) is S.FAILED, what="P applies the Abort")
    quiesce(p, d)
    assert d.events.of(FreeBlocks) == [] and p.events.of(FreeBlocks) == []  # the WRITE may still land
    p.agent.finish_delayed()
    p.events.wait(FreeBlocks)
    d.events.wait(FreeBlocks)
    quiesce(p, d)
    assert p.events.freed() == [sorted(P_BLOCKS)] and d.events.freed() == [sorted(D_BLOCKS)]
    assert d.events.of(KVReady) == [] and len(d.events.of(KVFailed)) == 1


def test_p_cancel_before_registration_answers_the_push_reg(pd):
    p, d = pd
    assert p.worker is not None and d.worker is not None
    tid = pr.new_transfer_id()
    p.worker.submit(Cancel(tid, "prefill aborted", D_ENGINE))  # before any record: remembered
    wait_until(lambda: counters(d).ignored_unknown == 1, what="D ignores the early Fail")
    d.worker.submit(register(tid, D_BLOCKS))
    (failed,) = d.events.wait(KVFailed, tid)
    assert "prefill aborted" in failed.reason
    d.events.wait(FreeBlocks)
    assert d.events.freed() == [sorted(D_BLOCKS)] and p.events.of(FreeBlocks) == []


# ---- lease expiry --------------------------------------------------------------------------------


def test_lease_expiry_frees_p_blocks_and_tells_d(cluster):
    p = cluster.node(Role.PREFILL, P_ENGINE, P_AGENT, seed=1)
    d = cluster.node(Role.DECODE, D_ENGINE, D_AGENT, worker=False, seed=2)  # a bare agent: read its inbox
    add_peer(p, d)
    assert p.worker is not None
    tid = pr.new_transfer_id()
    lease = time.time() + 0.2
    p.worker.submit(Hold(tid, "req-p", P_BLOCKS, 11, 7, lease, D_ENGINE))
    p.events.wait(FreeBlocks)
    ((t_freed, ev),) = p.events.timed(FreeBlocks)
    assert t_freed >= lease and sorted(ev.block_ids) == sorted(P_BLOCKS)
    notifs = wait_until(d.agent.get_notifs, what="Fail at D")
    assert [(name, pr.decode(m)) for name, m in notifs] == [(P_AGENT, pr.Fail(tid, "lease expired"))]
    assert rec_state(p, tid) is S.EXPIRED


# ---- pacing: busy while something is outstanding, idle (blocking on the queue) otherwise ----------


def test_pacer_policy():
    pacer = Pacer()
    now = time.monotonic()
    assert pacer.cap(in_flight=False, relaxed=False, now=now) == IDLE_WAIT_S
    assert pacer.cap(in_flight=True, relaxed=False, now=now) == MAX_BACKOFF_S
    assert pacer.cap(in_flight=False, relaxed=True, now=now) == RELAXED_POLL_S
    ledger = TransferLedger(Role.PREFILL)
    ledger.on_prefill_done("t", "r", [1], lease_deadline=time.time() + 30)
    pacer.refresh(ledger)  # a finished prefill waits for D's PushReg, which rings: sleep on the doorbell
    assert pacer.live and not pacer.urgent
    assert pacer.cap(in_flight=False, relaxed=False, now=now) == WAITING_POLL_S
    # A ring whose notification was not there yet: poll closely for a while, then sleep again.
    pacer.after_round(now, sent=False, received=False, rang=True)
    assert pacer.cap(in_flight=False, relaxed=False, now=now + GRACE_S / 2) == MAX_BACKOFF_S
    assert pacer.cap(in_flight=False, relaxed=False, now=now + GRACE_S * 2) == WAITING_POLL_S
    pacer.after_round(now, sent=False, received=True, rang=False)  # it came: no need to poll closely
    assert pacer.cap(in_flight=False, relaxed=False, now=now) == WAITING_POLL_S
    pacer.after_round(now, sent=True, received=True, rang=False)  # ours may need our progress to leave
    assert pacer.cap(in_flight=False, relaxed=False, now=now) == MAX_BACKOFF_S
    assert pacer.sleep_s(progressed=True, cap=MAX_BACKOFF_S) == 0.0
    sleeps = [pacer.sleep_s(progressed=False, cap=MAX_BACKOFF_S) for _ in range(20)]
    assert sleeps == sorted(sleeps) and sleeps[-1] == MAX_BACKOFF_S  # grows, capped
    assert pacer.sleep_s(progressed=False, cap=WAITING_POLL_S) == WAITING_POLL_S


def test_idle_workers_block_on_their_queue(pd):
    quiesce(*pd)
    wait_until(lambda: all(n.worker is not None and n.worker.poll_cap() == IDLE_WAIT_S for n in pd), what="idle")


def test_idle_after_a_completed_transfer(pd):
    p, d = pd
    tid = pr.new_transfer_id()
    start_push(p, d, tid, "register_first")
    d.events.wait(KVReady, tid)
    p.events.wait(FreeBlocks)
    quiesce(p, d)
    assert p.worker is not None and d.worker is not None
    wait_until(lambda: p.worker.poll_cap() == d.worker.poll_cap() == IDLE_WAIT_S, what="both idle after grace")


# ---- regressions: bugs found in the worker, each fixed -------------------------------------------


def test_join_after_stop(cluster):
    p = cluster.node(Role.PREFILL, P_ENGINE, P_AGENT, seed=1)
    assert p.worker is not None
    p.worker.stop()
    assert join(p.worker, 3.0)
    p.worker.join(timeout=1.0)
    assert not p.worker.is_alive()


def test_lease_expiry_during_write_must_not_release_d_blocks_early(pd):
    p, d = pd
    tid = pr.new_transfer_id()
    p.agent.delay_completion_polls = 10**9
    start_push(p, d, tid, "register_first", lease_s=0.3)
    wait_until(p.agent.in_flight, what="WRITE posted")
    wait_until(lambda: rec_state(p, tid) is S.EXPIRED, what="lease expiry on P")
    quiesce(p, d)
    freed_while_in_flight = bool(d.events.of(FreeBlocks)) and bool(p.agent.in_flight())
    p.agent.finish_delayed()
    assert not freed_while_in_flight, "D released blocks that P's WRITE can still write into"


def test_post_that_crosses_the_deadline_is_still_tracked(pd):
    p, d = pd
    tid = pr.new_transfer_id()
    p.agent.post_delay_s = 0.3  # a slow synchronous post (CMA copy) that ends after the lease
    p.agent.delay_completion_polls = 3
    start_push(p, d, tid, "register_first", lease_s=0.15)
    # The WRITE itself completed and carried Done, so D may use the data (KVReady) or, had the
    # Done been lost, learn of the failure (KVFailed): exactly one outcome, never both.
    wait_until(lambda: d.events.of(KVReady, tid) or d.events.of(KVFailed, tid), what="D's outcome")
    p.events.wait(FreeBlocks)
    quiesce(p, d)
    assert len(d.events.of(KVReady, tid)) + len(d.events.of(KVFailed, tid)) == 1
    assert not p.agent.in_flight(), "a posted WRITE was abandoned: never polled nor released"
    assert p.events.freed() == [sorted(P_BLOCKS)]  # freed once, after the WRITE ended


def test_push_reg_after_lease_expiry_is_answered_with_fail(pd):
    p, d = pd
    assert p.worker is not None and d.worker is not None
    tid = pr.new_transfer_id()
    p.worker.submit(hold(tid, P_BLOCKS, lease_s=0.1))
    p.events.wait(FreeBlocks)  # expired; its Fail reached D before D knew the transfer
    wait_until(lambda: counters(d).ignored_unknown == 1, what="D drops the early Fail")
    d.worker.submit(register(tid, D_BLOCKS, deadline_s=2.0))
    d.events.wait(KVFailed, tid)


def test_push_reg_with_out_of_range_blocks_does_not_kill_p(pd):
    p, d = pd
    assert p.worker is not None
    tid = pr.new_transfer_id()
    start_push(p, d, tid, "hold_first", d_blocks=(NB + 100,))
    d.events.wait(KVFailed, tid)
    p.events.wait(FreeBlocks)
    assert alive(p.worker) and p.events.freed() == [sorted(P_BLOCKS)]


def test_idle_after_lease_expiry(cluster):
    p = cluster.node(Role.PREFILL, P_ENGINE, P_AGENT, seed=1)
    assert p.worker is not None
    p.worker.submit(hold(pr.new_transfer_id(), P_BLOCKS, lease_s=0.1, decode=None))
    p.events.wait(FreeBlocks)
    quiesce(p)
    wait_until(lambda: p.worker.poll_cap() == IDLE_WAIT_S, what="idle after grace")


def test_reconnect_after_disconnect(pd, monkeypatch):
    p, d = pd
    assert p.worker is not None and d.worker is not None
    # an in-process side channel: D's handshake request goes straight to P's handle_handshake
    monkeypatch.setattr(peers_module, "side_request", lambda host, port, payload, timeout: (
        p.worker.handle_handshake(payload)))  # type: ignore[union-attr]
    d.agent.disconnect(P_AGENT)
    tid = pr.new_transfer_id()
    p.worker.submit(hold(tid, P_BLOCKS))
    d.worker.submit(register(tid, D_BLOCKS))  # _ensure_peer: P not connected -> handshake again
    wait_until(lambda: d.events.of(KVReady) or d.events.of(KVFailed), what="an outcome")
    assert d.events.of(KVReady) and not d.events.of(KVFailed), d.events.of(KVFailed)


# ---- handshake through the worker, with an in-process side channel -------------------------------


def test_in_process_handshake_then_push(cluster, monkeypatch):
    """No AddPeer on D: _ensure_peer handshakes (in process) and P learns D from handle_handshake."""
    p = cluster.node(Role.PREFILL, P_ENGINE, P_AGENT, seed=1)
    d = cluster.node(Role.DECODE, D_ENGINE, D_AGENT, seed=2)
    assert p.worker is not None and d.worker is not None
    calls = []

    def fake_request(host: str, port: int, payload: bytes, timeout: float) -> bytes:
        calls.append((host, port))
        return p.worker.handle_handshake(payload)  # type: ignore[union-attr]

    monkeypatch.setattr(peers_module, "side_request", fake_request)
    tid = pr.new_transfer_id()
    start_push(p, d, tid, "register_first")
    d.events.wait(KVReady, tid)
    assert calls == [(P_ADDR.host, P_ADDR.port)]
    assert p.worker.peers.names == {D_ENGINE: D_AGENT} and d.worker.peers.names == {P_ENGINE: P_AGENT}
    assert np.array_equal(d.kv[list(D_BLOCKS)].numpy(), p.kv[list(P_BLOCKS)].numpy())


def test_kv_tombstone_s_reaches_the_ledger_from_the_command_line(tmp_path):
    """--kv-tombstone-s sets how long a finished transfer's record stays (the emulated instances stretch it by
    their time scale); a negative value is a CLI error naming the flag."""
    from kvpush.cli import build_parser
    from kvpush.flags import transfer_config_from_args

    args = build_parser().parse_args(["serve", str(tmp_path), "--kv-tombstone-s", "7.5"])
    config = transfer_config_from_args(args)
    assert config.kv_tombstone_s == 7.5
    from kvpush.engine.kv_cache import KVLayout
    from kvpush.transfer.runtime import TransferRuntime

    layout = KVLayout(num_blocks=NB, num_layers=NL, block_size=BS, num_kv_heads=KVH, head_dim=HD, dtype=torch.float32)
    runtime = TransferRuntime(Role.DECODE, config, torch.zeros(NB, NL, 2, BS, KVH, HD), layout, "m", "float32",
                              lambda: None)  # over the real nixl agent, as an instance builds it
    try:
        assert runtime.thread.ledger.tombstone_s == 7.5
    finally:
        runtime.shutdown()  # never started: returns at once (it used to wait forever on the side channel)
    with pytest.raises(SystemExit, match="--kv-tombstone-s must be >= 0"):
        transfer_config_from_args(build_parser().parse_args(["serve", str(tmp_path), "--kv-tombstone-s", "-1"]))
