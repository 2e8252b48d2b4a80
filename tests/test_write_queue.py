"""P's WRITEs to one D go one at a time (--kv-writes-per-peer, default 1): the rest wait in arrival
order, MATCHED, and are posted as earlier ones end; a waiting transfer that fails meanwhile is
skipped and frees its blocks; with no limit every matched WRITE is posted at once."""

from __future__ import annotations

import torch
from test_transfer_worker import make_pair, quiesce, rec_state, start_push, wait_until

from kvpush.transfer import protocol as pr
from kvpush.transfer.events import FreeBlocks, KVFailed, KVReady
from kvpush.transfer.ledger import TransferState as S

# (P blocks, D blocks) of three transfers
BLOCKS = [((3, 4, 5), (9, 1, 12)), ((6, 7), (13, 14)), ((8,), (15,))]


def push_all(p, d, tids, **kw) -> None:
    for tid, (pb, db) in zip(tids, BLOCKS, strict=True):
        start_push(p, d, tid, "register_first", p_blocks=pb, d_blocks=db, **kw)


def landed(p, d, pb, db) -> bool:
    return all(torch.equal(d.kv[b2], p.kv[b1]) for b1, b2 in zip(pb, db, strict=True))


def test_writes_to_one_decode_go_one_at_a_time_in_order(cluster):
    p, d = make_pair(cluster)
    p.agent.delay_completion_polls = 10**9  # each WRITE stays in flight until finish_delayed
    tids = [pr.new_transfer_id() for _ in BLOCKS]
    push_all(p, d, tids)
    wait_until(lambda: rec_state(p, tids[2]) is S.MATCHED, what="all three matched")
    for i, tid in enumerate(tids):
        wait_until(lambda tid=tid: len(p.agent.in_flight()) == 1 and rec_state(p, tid) is S.POSTED,
                   what=f"WRITE {i} posted")
        assert all(rec_state(p, t) is S.MATCHED for t in tids[i + 1 :])  # the later ones wait
        p.agent.finish_delayed()
        d.events.wait(KVReady, tid)
    quiesce(p, d)
    assert all(landed(p, d, pb, db) for pb, db in BLOCKS)
    assert sorted(map(tuple, p.events.freed())) == sorted(tuple(sorted(pb)) for pb, _ in BLOCKS)
    assert not p.worker.side.waiting_writes


def test_a_waiting_write_whose_lease_expires_is_skipped(cluster):
    p, d = make_pair(cluster)
    p.agent.delay_completion_polls = 10**9
    tids = [pr.new_transfer_id() for _ in BLOCKS]
    start_push(p, d, tids[0], "register_first", p_blocks=BLOCKS[0][0], d_blocks=BLOCKS[0][1])
    start_push(p, d, tids[1], "register_first", p_blocks=BLOCKS[1][0], d_blocks=BLOCKS[1][1], lease_s=0.3)
    start_push(p, d, tids[2], "register_first", p_blocks=BLOCKS[2][0], d_blocks=BLOCKS[2][1])
    wait_until(lambda: rec_state(p, tids[1]) is S.EXPIRED, what="the waiting WRITE's lease runs out")
    wait_until(lambda: sorted(BLOCKS[1][0]) in p.events.freed(), what="its blocks freed")
    d.events.wait(KVFailed, tids[1])
    assert rec_state(p, tids[2]) is S.MATCHED and len(p.agent.in_flight()) == 1
    p.agent.finish_delayed()
    wait_until(lambda: rec_state(p, tids[2]) is S.POSTED, what="the next one posted, the expired one skipped")
    p.agent.finish_delayed()
    d.events.wait(KVReady, tids[2])
    assert d.events.of(KVReady, tids[0]) and landed(p, d, *BLOCKS[2])
    assert p.agent.stats.transfers_posted == 2


def test_no_limit_posts_every_matched_write(cluster):
    p, d = make_pair(cluster, writes_per_peer=0)
    p.agent.delay_completion_polls = 10**9
    tids = [pr.new_transfer_id() for _ in BLOCKS]
    push_all(p, d, tids)
    wait_until(lambda: len(p.agent.in_flight()) == 3, what="three WRITEs in flight at once")
    p.agent.finish_delayed()
    for tid in tids:
        d.events.wait(KVReady, tid)
    p.events.wait(FreeBlocks, n=3)
    assert all(landed(p, d, pb, db) for pb, db in BLOCKS)


def test_a_write_that_outlives_its_record_does_not_hold_up_the_queue(cluster):
    """A WRITE stuck in flight (a frozen D) whose record expired no longer counts: the next WRITE to
    that D is posted, and P stops ringing D for the stuck one."""
    p, d = make_pair(cluster)
    p.agent.delay_completion_polls = 10**9
    tids = [pr.new_transfer_id() for _ in BLOCKS[:2]]
    start_push(p, d, tids[0], "register_first", p_blocks=BLOCKS[0][0], d_blocks=BLOCKS[0][1], lease_s=1.0)
    start_push(p, d, tids[1], "register_first", p_blocks=BLOCKS[1][0], d_blocks=BLOCKS[1][1])
    wait_until(lambda: rec_state(p, tids[1]) is S.MATCHED, what="the second one matched")
    assert len(p.agent.in_flight()) == 1  # and waits
    wait_until(lambda: rec_state(p, tids[0]) is S.EXPIRED, what="the stuck WRITE's record expires")
    wait_until(lambda: len(p.agent.in_flight()) == 2 and rec_state(p, tids[1]) is S.POSTED,
               what="the next WRITE posted beside the stuck one")
    assert p.events.freed() == []  # the stuck WRITE may still read P's blocks: nothing freed yet
    p.agent.finish_delayed()
    d.events.wait(KVReady, tids[1])
    p.events.wait(FreeBlocks, n=2)  # both freed once their WRITEs ended
    assert landed(p, d, *BLOCKS[1])
