"""Layer-wise push over fake agents: LayerwiseWriter on its own, then P's and D's transfer threads.

No nixl, no sockets: the helpers and the thread cluster come from test_transfer_worker.py.
"""

from __future__ import annotations

import pytest
import torch
from test_transfer_worker import (
    BS,
    D_BLOCKS,
    D_ENGINE,
    NB,
    NL,
    P_BLOCKS,
    P_ENGINE,
    hold,
    make_pair,
    quiesce,
    rec_state,
    register,
    wait_until,
)

from kvpush.transfer import protocol as pr
from kvpush.transfer.commands import Cancel, LayersDone
from kvpush.transfer.events import FreeBlocks, KVFailed, KVReady
from kvpush.transfer.fake import FakeAgent, FakeFabric
from kvpush.transfer.layerwise import LayerwiseWriter
from kvpush.transfer.ledger import TransferState as S

SHAPE = (NB, NL, 2, BS, 2, 8)  # kv[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]


@pytest.fixture
def agents():
    fabric = FakeFabric(seed=7)
    p, d = fabric.agent("p"), fabric.agent("d")
    p.register_kv(torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)))
    d.register_kv(torch.zeros(SHAPE))
    p.connect(d)
    yield p, d
    p.close()
    d.close()


def _kv(agent: FakeAgent) -> torch.Tensor:
    assert agent.kv is not None
    return agent.kv


def test_writer_posts_finished_slices_in_d_range_once_coalesced(agents):
    p, d = agents
    w = LayerwiseWriter(p, NL)
    w.layers_done("t", 0, (0, 1, 2), (3, 4, 5))
    assert w.post_ready("t") == 0  # D's registration unknown: nothing to post yet
    w.registered("t", "d", [9, 10], skip=1)  # D holds block 0 from its prefix cache
    w.layers_done("t", 1, (0, 1, 2), (3, 4, 5))
    assert w.post_ready("t") == 1  # both layers, same block set: one WRITE
    t = w.get("t")
    assert t.num_writes == 1 and t.num_descs == 1  # blocks 4,5 -> 9,10, all layers: one run
    assert w.post_ready("t") == 0  # never posted twice
    assert not t.complete()  # P's prefill not done yet
    assert w.poll() == ["t"] and not w.in_flight("t")
    assert torch.equal(_kv(d)[[9, 10]], _kv(p)[[4, 5]]) and not _kv(d)[[0, 1, 2, 3]].any()
    t.prefill_done = True
    assert t.complete()


def test_writer_layers_land_separately(agents):
    p, d = agents
    w = LayerwiseWriter(p, NL)
    w.registered("t", "d", [9], skip=0)
    w.layers_done("t", 0, (0,), (3,))
    assert w.post_ready("t") == 1 and w.poll() == ["t"]
    assert torch.equal(_kv(d)[9, 0], _kv(p)[3, 0]) and not _kv(d)[9, 1].any()  # layer 1 untouched
    w.layers_done("t", 1, (0,), (3,))
    assert w.post_ready("t") == 1 and w.poll() == ["t"]
    assert torch.equal(_kv(d)[9], _kv(p)[3])


def test_writer_records_a_failed_write(agents):
    p, _ = agents
    w = LayerwiseWriter(p, NL)
    p.fail_next_completion = 1
    w.registered("t", "d", [9], skip=0)
    w.layers_done("t", 0, (0,), (3,))
    w.post_ready("t")
    assert w.poll() == ["t"] and w.get("t").failed
    w.layers_done("t", 1, (0,), (3,))
    assert w.post_ready("t") == 0  # a failed transfer posts nothing more


# ---- through the transfer threads --------------------------------------------------------------


def layers_done(tid: str, blocks=P_BLOCKS) -> list[LayersDone]:
    return [LayersDone(layer, ((tid, tuple(range(len(blocks))), tuple(blocks)),)) for layer in range(NL)]


@pytest.mark.parametrize("order", ["register_first", "layers_first"])
def test_layerwise_push_commits_once_every_layer_landed(cluster, order):
    p, d = make_pair(cluster, layerwise=True)
    assert p.worker is not None and d.worker is not None
    tid = pr.new_transfer_id()
    if order == "register_first":
        d.worker.submit(register(tid, D_BLOCKS))
        wait_until(lambda: rec_state(p, tid) is S.REGISTERED, what="P sees the PushReg")
    for cmd in layers_done(tid):
        p.worker.submit(cmd)
    if order == "layers_first":
        d.worker.submit(register(tid, D_BLOCKS))
    quiesce(p, d)
    assert d.events.of(KVReady, tid) == []  # P's prefill has not ended: no Commit yet
    p.worker.submit(hold(tid, P_BLOCKS, first=9))
    (ready,) = d.events.wait(KVReady, tid)
    assert ready.first_token_id == 9 and dict(ready.trace).keys() == {"reg_received", "write_posted", "kv_landed"}
    assert torch.equal(d.kv[list(D_BLOCKS)], p.kv[list(P_BLOCKS)])
    p.events.wait(FreeBlocks)
    quiesce(p, d)
    assert p.events.freed() == [sorted(P_BLOCKS)] and d.events.of(KVFailed) == []
    assert rec_state(p, tid) is S.DONE and rec_state(d, tid) is S.DONE
    assert d.worker.ledger.counters.ignored_unexpected == 0  # the Commit was applied, not ignored


def test_layerwise_write_failure_fails_d_after_the_writes_ended(cluster):
    p, d = make_pair(cluster, layerwise=True)
    assert p.worker is not None and d.worker is not None
    tid = pr.new_transfer_id()
    p.agent.fail_next_completion = 1
    d.worker.submit(register(tid, D_BLOCKS))
    wait_until(lambda: rec_state(p, tid) is S.REGISTERED, what="P sees the PushReg")
    for cmd in layers_done(tid):
        p.worker.submit(cmd)
    p.worker.submit(hold(tid, P_BLOCKS))
    d.events.wait(KVFailed, tid)
    p.events.wait(FreeBlocks)
    quiesce(p, d)
    assert d.events.of(KVReady, tid) == [] and not p.agent.in_flight()
    assert p.events.freed() == [sorted(P_BLOCKS)]


def test_abort_while_layer_writes_are_in_flight_is_acked_after_they_end(cluster):
    """D's Abort must not be answered "nothing in flight" while a layer write can still land in D's
    blocks: D would hand them to another request."""
    p, d = make_pair(cluster, layerwise=True)
    assert p.worker is not None and d.worker is not None
    tid = pr.new_transfer_id()
    p.agent.delay_completion_polls = 10**9
    d.worker.submit(register(tid, D_BLOCKS))
    wait_until(lambda: rec_state(p, tid) is S.REGISTERED, what="P sees the PushReg")
    p.worker.submit(layers_done(tid)[0])
    wait_until(p.agent.in_flight, what="layer 0 written")
    d.worker.submit(Cancel(tid, "decode aborted", P_ENGINE))
    d.events.wait(KVFailed, tid)
    wait_until(lambda: rec_state(p, tid) is S.FAILED, what="P applies the Abort")
    for cmd in layers_done(tid)[1:]:  # the prefill goes on: nothing more is written for it
        p.worker.submit(cmd)
    quiesce(p, d)
    assert d.events.of(FreeBlocks) == []  # quarantined: the write in flight may still land
    assert len(p.agent.in_flight()) == 1
    p.agent.finish_delayed()
    d.events.wait(FreeBlocks)  # P's Fail came once the write ended
    p.worker.submit(hold(tid, P_BLOCKS))
    p.events.wait(FreeBlocks)
    quiesce(p, d)
    assert d.events.freed() == [sorted(D_BLOCKS)] and p.events.freed() == [sorted(P_BLOCKS)]
    assert p.agent.stats.transfers_posted == 1 and not p.worker.side.layerwise.transfers


def test_layers_of_an_ended_transfer_are_never_written(cluster):
    p, d = make_pair(cluster, layerwise=True)
    assert p.worker is not None and d.worker is not None
    tid = pr.new_transfer_id()
    d.worker.submit(register(tid, D_BLOCKS))
    wait_until(lambda: rec_state(p, tid) is S.REGISTERED, what="P sees the PushReg")
    d.worker.submit(Cancel(tid, "decode aborted", P_ENGINE))
    d.events.wait(FreeBlocks)  # acked at once: nothing was in flight
    for cmd in layers_done(tid):
        p.worker.submit(cmd)
    p.worker.submit(Cancel(tid, "prefill finished_aborted", D_ENGINE))
    quiesce(p, d)
    assert p.agent.stats.transfers_posted == 0 and not p.worker.side.layerwise.transfers
