"""Event wake-ups of the transfer thread (kvpush/transfer/doorbell.py): a thread whose records all
wait for a peer sleeps on its doorbell, a peer's ring wakes it, and a lost ring costs latency only
(the safety poll still finds the notification)."""

from __future__ import annotations

import pytest
from test_transfer_worker import (
    D_BLOCKS,
    P_BLOCKS,
    make_pair,
    quiesce,
    rec_state,
    register,
    start_push,
    wait_until,
)

from kvpush.transfer import protocol as pr
from kvpush.transfer.doorbell import Doorbell
from kvpush.transfer.events import FreeBlocks, KVReady
from kvpush.transfer.ledger import TransferState as S
from kvpush.transfer.thread import GRACE_S, WAITING_POLL_S


def test_ring_and_wake_end_a_wait():
    a, b = Doorbell(), Doorbell()
    try:
        assert not a.wait(0)  # nothing pending
        b.ring(Doorbell.resolve(f"127.0.0.1:{a.port}"))
        assert a.wait(5.0) and a.rings == 1  # a peer rang
        a.wake()
        assert not a.wait(5.0)  # woken by this process, not rung
        assert not a.wait(0)  # both drained
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("address", ["", "nohost", "127.0.0.1:x", "no.such.host.invalid:5"])
def test_unusable_addresses_are_not_rung(address):
    assert Doorbell.resolve(address) is None
    bell = Doorbell()
    try:
        bell.ring(None)  # a peer without a doorbell: nothing to do, nothing raised
        assert bell.ring_errors == 0
    finally:
        bell.close()


def test_decode_waiting_for_many_prefills_sleeps_on_its_doorbell(cluster):
    p, d = make_pair(cluster)
    assert d.worker is not None
    tids = [pr.new_transfer_id() for _ in range(32)]
    for i, tid in enumerate(tids):
        d.worker.submit(register(tid, [D_BLOCKS[0] + i]))
    wait_until(lambda: all(rec_state(p, t) is S.REGISTERED for t in tids), what="P sees every PushReg")
    quiesce(p, d)
    # After the grace period of its last progress, D neither spins nor polls every millisecond.
    wait_until(lambda: d.worker.poll_cap() == WAITING_POLL_S, timeout=GRACE_S * 50, what="D sleeps")


@pytest.mark.parametrize("rings", [True, False])
def test_done_reaches_a_sleeping_decode(cluster, rings):
    """With rings the Done wakes D; with every ring lost (the peer published no doorbell) D still
    finds it on its safety poll."""
    p, d = make_pair(cluster)
    assert p.worker is not None and d.worker is not None
    if not rings:
        p.worker.peers.bells.clear()
    tid = pr.new_transfer_id()
    start_push(p, d, tid, "register_first")
    d.events.wait(KVReady, tid)
    p.events.wait(FreeBlocks)
    assert sorted(p.events.freed()[0]) == sorted(P_BLOCKS)
    if rings:  # the datagram is read at D's next wait (D may have found the Done polling first)
        wait_until(lambda: d.worker.doorbell.rings > 0, what="P's ring reaches D")
    else:
        quiesce(p, d)
        assert d.worker.doorbell.rings == 0


def test_the_target_of_a_write_in_flight_is_rung_until_it_ends(cluster):
    """Over tcp a WRITE moves only while D's worker is called too: P rings D every RING_REFRESH_S while
    its WRITE is in flight (each ring keeps D polling), and stops once the WRITE ended."""
    p, d = make_pair(cluster)
    assert p.worker is not None and d.worker is not None
    p.agent.delay_completion_polls = 10**9  # the WRITE stays in flight until finish_delayed
    tid = pr.new_transfer_id()
    start_push(p, d, tid, "register_first")
    wait_until(p.agent.in_flight, what="the WRITE is posted")
    before = d.worker.doorbell.rings
    wait_until(lambda: d.worker.doorbell.rings >= before + 3, what="P keeps ringing D")
    assert d.events.of(KVReady, tid) == []
    p.agent.finish_delayed()
    d.events.wait(KVReady, tid)
    quiesce(p, d)
    after = d.worker.doorbell.rings
    quiesce(p, d)
    assert d.worker.doorbell.rings == after and not p.worker._rung  # nothing in flight: no more rings
