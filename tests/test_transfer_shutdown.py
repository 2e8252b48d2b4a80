"""Transfer failures counted by reason, a late post kept in quarantine, and a stopping transfer thread
that tells its peers (fake agents; the real servers are in test_drain.py and test_stale_transfer.py)."""

from __future__ import annotations

import time

from test_transfer_worker import (
    D_AGENT,
    D_BLOCKS,
    D_ENGINE,
    P_ADDR,
    P_AGENT,
    P_BLOCKS,
    P_ENGINE,
    Cluster,
    add_peer,
    counters,
    hold,
    join,
    rec_state,
    register,
    wait_until,
)

from kvpush.config import Role
from kvpush.transfer import protocol as pr
from kvpush.transfer.commands import Read
from kvpush.transfer.events import FreeBlocks, KVFailed
from kvpush.transfer.ledger import TransferLedger
from kvpush.transfer.ledger import TransferState as S
from kvpush.transfer.records import FailureKind as K

T0 = 1000.0


def test_failures_are_counted_by_reason() -> None:
    p = TransferLedger(Role.PREFILL, clock=lambda: T0)
    p.on_prefill_done("lease", "r1", [1], T0 - 1)
    p.expire()
    p.on_prefill_done("failed", "r2", [2], T0 + 30, peer_engine_id="d")
    p.on_notification(pr.Fail("failed", "boom"), "d")
    p.on_notification(pr.Abort("early"), "d")  # a tombstone: the transfer failed before P knew it
    p.on_notification(pr.Release("released"), "d")  # not a failure
    p.on_prefill_done("cancelled", "r3", [3], T0 + 30)
    p.mark_failed("cancelled", "prefill aborted", kind=K.CANCELLED)
    assert {k: n for k, n in p.counters.failures.items() if n} == {
        K.DEADLINE: 1, K.PEER_FAIL: 1, K.PEER_ABORT: 1, K.CANCELLED: 1}
    d = TransferLedger(Role.DECODE, clock=lambda: T0)
    d.register("late", "r", [5], T0 + 30, peer_engine_id="p", remote_block_ids=[6])
    d.mark_failed("late", "posted too late", kind=K.POSTED_LATE, posted=True)
    d.on_notification(pr.Fail("late", "aborted by decode"), "p")  # P's ack: D's own READ still runs
    assert d.release_quarantine() == []
    assert d.confirm_nothing_in_flight("late") and d.release_quarantine() == [5]
    assert d.counters.failures[K.POSTED_LATE] == 1


def test_read_posted_too_late_keeps_d_blocks_until_it_ends(pd) -> None:
    """Pull: D's READ is posted after its deadline (a slow post). D fails the transfer and P answers
    D's Abort with Fail, but D's own READ is still in flight: no block may come back before it ends."""
    p, d = pd
    tid = pr.new_transfer_id()
    p.worker.submit(hold(tid, P_BLOCKS, decode=None))
    wait_until(lambda: rec_state(p, tid) is S.PREFILLED)
    d.agent.post_delay_s = 0.3  # the post returns after the deadline below
    d.agent.delay_completion_polls = 10**9  # and the READ stays in flight until finish_delayed
    d.worker.submit(Read(tid, "req-d", P_ADDR, D_BLOCKS, P_BLOCKS, 11, time.time() + 0.1))
    d.events.wait(KVFailed, tid)
    wait_until(lambda: rec_state(p, tid) is S.FAILED, what="P applies D's Abort (and acks it)")
    wait_until(lambda: counters(d).duplicates + counters(d).confirmations, what="D applies P's ack")
    acked = time.monotonic()
    wait_until(lambda: d.worker._last_housekeeping > acked, what="D's housekeeping after the ack")
    released_early = d.events.of(FreeBlocks)
    d.agent.finish_delayed()
    assert released_early == [], "D released blocks its own late READ still writes into"
    d.events.wait(FreeBlocks)
    assert d.events.freed() == [sorted(D_BLOCKS)]
    assert counters(d).failures[K.POSTED_LATE] == 1


def test_stopping_decode_aborts_its_live_transfers(cluster: Cluster) -> None:
    p = cluster.node(Role.PREFILL, P_ENGINE, P_AGENT, worker=False, seed=1)  # a bare agent: read its inbox
    d = cluster.node(Role.DECODE, D_ENGINE, D_AGENT, seed=2)
    add_peer(d, p)
    tid = pr.new_transfer_id()
    d.worker.submit(register(tid, D_BLOCKS, deadline_s=60))
    wait_until(lambda: rec_state(d, tid) is S.REGISTERED)
    d.worker.stop()
    assert join(d.worker, 5.0)
    got = [pr.decode(m) for _, m in wait_until(p.agent.get_notifs, what="PushReg, then Abort at P")]
    got += [pr.decode(m) for _, m in p.agent.get_notifs()]
    assert [type(m) for m in got] == [pr.PushReg, pr.Abort] and got[1].transfer_id == tid
    assert counters(d).failures[K.SHUTDOWN] == 1


def test_stopping_prefill_fails_held_transfers_after_its_write_ended(cluster: Cluster) -> None:
    p = cluster.node(Role.PREFILL, P_ENGINE, P_AGENT, seed=1)
    d = cluster.node(Role.DECODE, D_ENGINE, D_AGENT, worker=False, seed=2)
    add_peer(p, d)
    d.agent.add_peer(p.agent.metadata(), p.agent.geometry)  # D's side only: P's thread added D above
    held, writing = pr.new_transfer_id(), pr.new_transfer_id()
    p.worker.submit(hold(held, (1, 2), lease_s=60))  # no registration yet: P holds its blocks for D
    p.agent.delay_completion_polls = 20  # the WRITE ends while the thread winds down
    d.agent.send_notif(P_AGENT, pr.encode(pr.PushReg(writing, D_ENGINE, [9, 10], 0, 11, time.time() + 60)))
    wait_until(lambda: rec_state(p, writing) is S.REGISTERED)
    p.worker.submit(hold(writing, P_BLOCKS[:2], lease_s=60))
    wait_until(p.agent.in_flight, what="WRITE posted")
    p.worker.stop()
    assert join(p.worker, 5.0) and not p.agent.in_flight()
    got = [pr.decode(m) for _, m in wait_until(d.agent.get_notifs, what="messages at D")]
    assert pr.Fail(held, "the peer instance shut down") in got
    kinds = [(type(m), m.transfer_id) for m in got if m.transfer_id == writing]
    assert kinds == [(pr.Done, writing), (pr.Fail, writing)]  # Fail only once the WRITE ended
    assert sorted(map(sorted, p.events.freed())) == [[1, 2], sorted(P_BLOCKS[:2])]
