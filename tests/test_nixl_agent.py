"""NixlTransferAgent against real nixl: two agents in one process, then two processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import msgspec
import numpy as np
import pytest
import torch

from kvpush.errors import HandshakeError, TransferError
from kvpush.transfer.descriptors import KVGeometry, count_descriptors
from kvpush.transfer.kv_agent import PeerDisconnectedError, Transfer, XferStatus
from kvpush.transfer.nixl_agent import NixlTransferAgent

# kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
SHAPE = (16, 3, 2, 4, 2, 8)  # float32: layer slice 512 B, block 1536 B
TIMEOUT_S = 10.0


def make_kv(fill: str, seed: int = 0) -> torch.Tensor:
    if fill == "zeros":
        return torch.zeros(SHAPE, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=gen, dtype=torch.float32)


# ---------------------------------------------------------------------- no nixl needed


def test_geometry_from_tensor_and_roundtrip() -> None:
    kv = make_kv("zeros")
    g = KVGeometry.from_tensor(kv)
    assert g.base_addr == kv.data_ptr()
    assert (g.num_blocks, g.num_layers) == (16, 3)
    assert g.layer_bytes == kv[0, 0].numel() * 4 == 512
    assert g.block_bytes == kv[0].numel() * 4 == 1536
    assert (g.memory_type, g.device_id) == ("DRAM", 0)
    assert g.total_bytes == kv.numel() * 4
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(g), type=KVGeometry) == g


def test_geometry_rejects_inconsistent_fields() -> None:
    with pytest.raises(ValueError, match="block_bytes 100 != num_layers 2"):
        KVGeometry(base_addr=4096, num_blocks=4, num_layers=2, block_bytes=100, layer_bytes=40)
    with pytest.raises(ValueError, match="memory_type"):
        KVGeometry(base_addr=4096, num_blocks=4, num_layers=2, block_bytes=80, layer_bytes=40,
                   memory_type="HBM")
    with pytest.raises(ValueError, match="kv\\[num_blocks"):
        KVGeometry.from_tensor(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="contiguous"):
        KVGeometry.from_tensor(make_kv("zeros").transpose(0, 1))


def test_count_descriptors_is_number_of_runs() -> None:
    a = np.array
    assert count_descriptors(a([], dtype=np.int64), a([], dtype=np.int64)) == 0
    assert count_descriptors(a([7]), a([3])) == 1
    assert count_descriptors(a(range(64)), a(range(100, 164))) == 1
    assert count_descriptors(a([0, 1, 2, 3]), a([10, 11, 20, 21])) == 2  # remote side breaks
    assert count_descriptors(a([0, 2, 3, 7]), a([1, 5, 6, 9])) == 3
    assert count_descriptors(a([3, 2, 1]), a([3, 2, 1])) == 3  # descending never merges
    rng = np.random.default_rng(0)
    for n in (5, 32, 33, 200):  # both the short-list and the numpy path
        local = np.sort(rng.choice(400, n, replace=False))
        remote = np.sort(rng.choice(400, n, replace=False))
        expected = 1 + sum(1 for i in range(1, n)
                           if local[i] != local[i - 1] + 1 or remote[i] != remote[i - 1] + 1)
        assert count_descriptors(local, remote) == expected
        assert count_descriptors(local, local) == 1 + int(np.count_nonzero(np.diff(local) != 1))


# ---------------------------------------------------------------------- real nixl, one process

def need_nixl() -> None:
    pytest.importorskip("nixl", reason="nixl is not installed (make install)")


class Pair:
    """Agents ``a`` and ``b`` in this process, each with its own buffer, peered both ways."""

    def __init__(self) -> None:
        self.kv_a = make_kv("random", seed=1)
        self.kv_b = make_kv("zeros")
        self.a = NixlTransferAgent("test-a", capture_telemetry=True)
        self.b = NixlTransferAgent("test-b", capture_telemetry=True)
        ga = self.a.register_kv(self.kv_a)
        gb = self.b.register_kv(self.kv_b)
        assert self.a.add_peer(self.b.metadata(), gb) == "test-b"
        assert self.b.add_peer(self.a.metadata(), ga) == "test-a"
        self.notifs: dict[str, list[tuple[str, bytes]]] = {"test-a": [], "test-b": []}

    def agents(self) -> tuple[NixlTransferAgent, NixlTransferAgent]:
        return self.a, self.b

    def pump(self) -> None:
        """Progress both agents: with one process, nobody else drains the receiver."""
        for agent in self.agents():
            self.notifs[agent.name].extend(agent.get_notifs())

    def finish(self, owner: NixlTransferAgent, transfer: Transfer) -> XferStatus:
        deadline = time.monotonic() + TIMEOUT_S
        while owner.poll(transfer) is XferStatus.POSTED:
            assert time.monotonic() < deadline, "transfer did not complete"
            self.pump()
        return transfer.state

    def wait_notif(self, receiver: NixlTransferAgent, msg: bytes) -> str:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            self.pump()
            for sender, got in self.notifs[receiver.name]:
                if got == msg:
                    return sender
            assert time.monotonic() < deadline, f"notification {msg!r} never arrived"
            time.sleep(1e-4)

    def telemetry_descs(self, owner: NixlTransferAgent, transfer: Transfer) -> int:
        return int(owner._agent.get_xfer_telemetry(transfer.handle).descCount)

    def close(self) -> None:
        for agent in self.agents():
            agent.close()


@pytest.fixture
def pair():
    need_nixl()
    p = None
    try:
        p = Pair()
        yield p
    finally:
        if p is not None:
            p.close()


def blocks_equal(dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor, src_ids: list[int]) -> bool:
    return torch.equal(dst[dst_ids], src[src_ids])


def untouched(kv: torch.Tensor, written: list[int]) -> bool:
    rest = [b for b in range(kv.shape[0]) if b not in written]
    return bool((kv[rest] == 0).all())


@pytest.mark.integration
@pytest.mark.parametrize("src_ids,dst_ids,runs", [
    ([2, 3, 4, 5], [8, 9, 10, 11], 1),
    ([0, 2, 3, 7], [1, 5, 6, 9], 3),
    ([9, 8], [0, 1], 2),
    (list(range(16)), list(range(16)), 1),
])
def test_write_blocks(pair: Pair, src_ids: list[int], dst_ids: list[int], runs: int) -> None:
    t = pair.a.write("test-b", src_ids, dst_ids, b"DONE:w1")
    assert (t.num_descs, t.num_bytes, t.op) == (runs, len(src_ids) * 1536, "WRITE")
    assert pair.finish(pair.a, t) is XferStatus.DONE
    assert pair.telemetry_descs(pair.a, t) == runs  # nixl merged exactly the runs we counted
    assert pair.wait_notif(pair.b, b"DONE:w1") == "test-a"
    assert blocks_equal(pair.kv_b, dst_ids, pair.kv_a, src_ids)
    assert untouched(pair.kv_b, dst_ids)
    pair.a.release(t)
    pair.a.release(t)  # idempotent
    assert t.handle is None
    assert pair.a.stats.descs_posted == runs


@pytest.mark.integration
def test_read_blocks_notifies_the_owner(pair: Pair) -> None:
    # b pulls a's blocks 5, 6 and 12 into its 0, 1 and 2: runs (5,6)->(0,1) and 12->2
    t = pair.b.read("test-a", [0, 1, 2], [5, 6, 12], b"DONE:r1")
    assert t.num_descs == 2
    assert pair.finish(pair.b, t) is XferStatus.DONE
    assert pair.telemetry_descs(pair.b, t) == 2
    assert pair.wait_notif(pair.a, b"DONE:r1") == "test-b"
    assert blocks_equal(pair.kv_b, [0, 1, 2], pair.kv_a, [5, 6, 12])
    assert untouched(pair.kv_b, [0, 1, 2])
    pair.b.release(t)


@pytest.mark.integration
def test_write_layers_touches_only_chosen_layers(pair: Pair) -> None:
    t = pair.a.write_layers("test-b", [1, 2], [3, 4], layers=[2, 0], notif=b"L")
    # slices b*3+l: local 3,5,6,8 and remote 9,11,12,14: layer 2 of a block touches layer 0
    # of the next one on both sides, so 5,6 -> 11,12 merge: 3 descriptors
    assert t.num_descs == 3 and t.num_bytes == 4 * 512
    assert pair.finish(pair.a, t) is XferStatus.DONE
    assert pair.telemetry_descs(pair.a, t) == 3
    pair.wait_notif(pair.b, b"L")
    for layer in (0, 2):
        assert torch.equal(pair.kv_b[[3, 4], layer], pair.kv_a[[1, 2], layer])
    assert bool((pair.kv_b[[3, 4], 1] == 0).all())
    assert untouched(pair.kv_b, [3, 4])
    pair.a.release(t)

    # all layers of consecutive blocks are one region; consecutive layers of one block merge
    t = pair.a.write_layers("test-b", [5, 6, 7], [10, 11, 12], layers=[0, 1, 2])
    assert t.num_descs == 1 and pair.finish(pair.a, t) is XferStatus.DONE
    assert pair.telemetry_descs(pair.a, t) == 1
    assert blocks_equal(pair.kv_b, [10, 11, 12], pair.kv_a, [5, 6, 7])
    pair.a.release(t)
    t = pair.a.write_layers("test-b", [13, 14], [13, 14], layers=[1, 2])  # l1,l2 of each block
    assert t.num_descs == 2 and pair.finish(pair.a, t) is XferStatus.DONE
    assert pair.telemetry_descs(pair.a, t) == 2
    assert torch.equal(pair.kv_b[[13, 14], 1:], pair.kv_a[[13, 14], 1:])
    assert bool((pair.kv_b[[13, 14], 0] == 0).all())
    pair.a.release(t)


@pytest.mark.integration
def test_empty_transfer_sends_only_the_notification(pair: Pair) -> None:
    t = pair.a.write("test-b", [], [], b"DONE:empty")
    assert (t.state, t.num_descs, t.num_bytes) == (XferStatus.DONE, 0, 0)
    assert pair.wait_notif(pair.b, b"DONE:empty") == "test-a"
    pair.a.send_notif("test-b", b"hello")
    assert pair.wait_notif(pair.b, b"hello") == "test-a"
    assert untouched(pair.kv_b, [])


@pytest.mark.integration
def test_bad_input_touches_no_memory(pair: Pair) -> None:
    a = pair.a
    bad_calls = [
        lambda: a.write("test-b", [0, 16], [0, 1]),  # local out of range
        lambda: a.write("test-b", [0, 1], [15, 16]),  # remote out of range
        lambda: a.write("test-b", [-1], [0]),
        lambda: a.read("test-b", [0, 1], [2]),  # lengths differ
        lambda: a.write("test-b", [0.5], [1]),  # type: ignore[list-item]  # not integers
        lambda: a.write("test-b", [[0, 1]], [[0, 1]]),  # type: ignore[list-item]  # not 1-D
        lambda: a.write_layers("test-b", [0], [0], layers=[3]),
        lambda: a.write_layers("test-b", [0], [0], layers=[-1]),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
    with pytest.raises(TransferError, match="unknown peer 'nobody'"):
        a.write("nobody", [0], [0])
    with pytest.raises(TransferError, match="unknown peer"):
        a.send_notif("nobody", b"x")
    pair.pump()
    assert pair.notifs["test-b"] == []
    assert untouched(pair.kv_b, [])
    assert a.stats.transfers_posted == 0


@pytest.mark.integration
def test_registration_and_peer_errors() -> None:
    need_nixl()
    kv = make_kv("zeros")
    agent = NixlTransferAgent("test-solo")
    try:
        with pytest.raises(TransferError, match="register_kv"):
            agent.metadata()
        g = agent.register_kv(kv)
        with pytest.raises(TransferError, match="already registered"):
            agent.register_kv(kv)
        other = KVGeometry(base_addr=g.base_addr, num_blocks=4, num_layers=2, block_bytes=1024,
                           layer_bytes=512)
        with pytest.raises(HandshakeError, match="num_layers=3.*num_layers=2"):
            agent.add_peer(b"whatever", other)
        with pytest.raises(TransferError, match="add_remote_agent"):  # nixl refuses itself
            agent.add_peer(agent.metadata(), g)
        with pytest.raises(TransferError, match="add_remote_agent"):
            agent.add_peer(b"not nixl metadata", g)
    finally:
        agent.close()
    agent.close()  # idempotent
    with pytest.raises(TransferError, match="closed"):
        agent.write("x", [0], [0])


@pytest.mark.integration
def test_register_raw_pointer_and_remove_peer(pair: Pair) -> None:
    kv = make_kv("zeros")
    g = KVGeometry.from_tensor(kv)
    with NixlTransferAgent("test-raw") as raw:
        with pytest.raises(ValueError, match="needs its KVGeometry"):
            raw.register_kv(kv.data_ptr())
        assert raw.register_kv(kv.data_ptr(), g) == g
        name = pair.a.add_peer(raw.metadata(), g)
        raw.add_peer(pair.a.metadata(), pair.a.geometry)  # type: ignore[arg-type]
        t = pair.a.write(name, [4], [0], b"raw")
        deadline = time.monotonic() + TIMEOUT_S
        while pair.a.poll(t) is XferStatus.POSTED or not any(m == b"raw" for _, m in raw.get_notifs()):
            assert time.monotonic() < deadline
        assert torch.equal(kv[0], pair.kv_a[4])
        pair.a.release(t)
        assert pair.a.remove_peer(name) and not pair.a.remove_peer(name)
        with pytest.raises(TransferError, match="unknown peer"):
            pair.a.write(name, [0], [0])


# ---------------------------------------------------------------------- two processes


def _child(conn, name: str) -> None:  # runs in a spawned process
    kv = make_kv("random", seed=7)
    agent = NixlTransferAgent(name)
    try:
        geometry = agent.register_kv(kv)
        conn.send((agent.metadata(), msgspec.msgpack.encode(geometry)))
        peer_md, peer_geometry = conn.recv()
        peer = agent.add_peer(peer_md, msgspec.msgpack.decode(peer_geometry, type=KVGeometry))
        t = agent.write(peer, [0, 1, 2, 9], [4, 5, 6, 12], b"DONE:child")
        state = agent.wait(t, TIMEOUT_S)
        conn.send((state.value, t.num_descs))
        agent.release(t)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # stay responsive until the parent kills us
            agent.get_notifs()
            if conn.poll(0.001) and conn.recv() == "exit":
                break
    finally:
        agent.close()


def _recv(conn, timeout_s: float = 60.0):
    if not conn.poll(timeout_s):
        raise AssertionError("child did not answer in time")
    return conn.recv()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_two_processes_write_then_peer_killed() -> None:
    need_nixl()
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_child, args=(child_conn, "test-child"), daemon=True)
    kv = make_kv("zeros")
    expected = make_kv("random", seed=7)
    agent = NixlTransferAgent("test-parent")
    child.start()
    try:
        geometry = agent.register_kv(kv)
        child_md, child_geometry = _recv(parent_conn)
        peer = agent.add_peer(child_md, msgspec.msgpack.decode(child_geometry, type=KVGeometry))
        assert peer == "test-child"
        parent_conn.send((agent.metadata(), msgspec.msgpack.encode(geometry)))
        assert _recv(parent_conn) == ("DONE", 2)

        deadline = time.monotonic() + TIMEOUT_S
        got: list[tuple[str, bytes]] = []
        while ("test-child", b"DONE:child") not in got:
            assert time.monotonic() < deadline, f"no notification from the child, got {got}"
            got.extend(agent.get_notifs())
            time.sleep(1e-4)
        assert torch.equal(kv[[4, 5, 6, 12]], expected[[0, 1, 2, 9]])
        assert untouched(kv, [4, 5, 6, 12])

        t = agent.write(peer, [4], [15], b"back")  # the other direction works too
        assert agent.wait(t, TIMEOUT_S) is XferStatus.DONE
        agent.release(t)

        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join(TIMEOUT_S)
        assert child.exitcode == -signal.SIGKILL

        # nixl 1.5.1 reports a dead peer on the next post; accept a failed poll as well
        try:
            t = agent.write(peer, [4, 5], [0, 1], b"after-death")
        except PeerDisconnectedError as exc:
            assert exc.peer == "test-child" and "test-child" in str(exc)
        else:
            assert agent.wait(t, TIMEOUT_S) is XferStatus.FAILED, "write to a killed peer succeeded"
        assert not agent.is_connected(peer)
        with pytest.raises(TransferError, match="disconnected"):
            agent.write(peer, [0], [0])
        with pytest.raises(TransferError, match="disconnected"):
            agent.send_notif(peer, b"x")
        assert agent.remove_peer(peer)
    finally:
        if child.is_alive():
            child.kill()
        child.join(TIMEOUT_S)
        agent.close()
