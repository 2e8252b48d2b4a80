"""KV layouts other than kvpush's block-major buffer: one tensor per layer (vLLM's KV caches), moved by
the fake agent and by real nixl, byte for byte per (block, layer) slice, with the descriptors merged
wherever memory is contiguous."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvpush.errors import HandshakeError
from kvpush.transfer.descriptors import KVGeometry
from kvpush.transfer.fake import FakeAgent, FakeFabric
from kvpush.transfer.handshake import HandshakeInfo, pack, verify_and_decode
from kvpush.transfer.kv_agent import KVAgent, Transfer, XferStatus

NUM_BLOCKS, NUM_LAYERS = 16, 3
BLOCK_MAJOR = (NUM_BLOCKS, NUM_LAYERS, 2, 4, 2, 8)  # kvpush: float32, a slice of 512 B
PER_LAYER = (NUM_BLOCKS, 2, 4, 16)  # vLLM's CPU layout [num_blocks, heads, block_size, 2 * head]: 512 B a block
TIMEOUT_S = 10.0


def block_major(fill: bool, seed: int = 0) -> torch.Tensor:
    if not fill:
        return torch.zeros(BLOCK_MAJOR)
    return torch.randn(BLOCK_MAJOR, generator=torch.Generator().manual_seed(seed))


def per_layer(fill: bool, seed: int = 0, one_buffer: bool = False) -> list[torch.Tensor]:
    """One tensor per layer: separate allocations, or the layers of one buffer (vLLM shares one)."""
    gen = torch.Generator().manual_seed(seed)
    if one_buffer:
        buf = torch.randn((NUM_LAYERS, *PER_LAYER), generator=gen) if fill else torch.zeros((NUM_LAYERS, *PER_LAYER))
        return list(buf)
    return [torch.randn(PER_LAYER, generator=gen) if fill else torch.zeros(PER_LAYER) for _ in range(NUM_LAYERS)]


def slice_bytes(kv: torch.Tensor | list[torch.Tensor], block: int, layer: int) -> torch.Tensor:
    t = kv[layer][block] if isinstance(kv, list) else kv[block, layer]
    return t.contiguous().view(-1).view(torch.uint8)


def slices_equal(dst, dst_ids, src, src_ids, layers=range(NUM_LAYERS)) -> bool:
    return all(torch.equal(slice_bytes(dst, d, layer), slice_bytes(src, s, layer))
               for d, s in zip(dst_ids, src_ids, strict=True) for layer in layers)


def zero_except(kv, written: list[int], layers=range(NUM_LAYERS)) -> bool:
    return all(bool((slice_bytes(kv, b, layer) == 0).all()) for b in range(NUM_BLOCKS) for layer in range(NUM_LAYERS)
               if not (b in written and layer in layers))


# ---------------------------------------------------------------------- the geometry alone


def test_per_layer_geometry_regions_and_indices():
    layers = per_layer(False)
    g = KVGeometry.from_layers(layers)
    assert not g.block_major and g.stride == g.layer_bytes == 512 and g.num_layers == NUM_LAYERS
    assert g.bases == tuple(t.data_ptr() for t in layers) and g.base_addr == min(g.bases)
    assert g.block_rows() is None  # whole blocks are not contiguous: no per-block list
    rows = g.slice_rows()  # layer-major index order: l * num_blocks + b
    assert rows.shape == (NUM_BLOCKS * NUM_LAYERS, 2) and int(rows[NUM_BLOCKS + 5, 0]) == layers[1][5].data_ptr()
    blocks, which = np.array([5, 0, 15]), np.array([1, 2, 0])
    idx = g.slice_index(blocks, which)
    assert idx.tolist() == [NUM_BLOCKS + 5, 2 * NUM_BLOCKS, 15]
    back = g.slice_of(idx)
    assert back[0].tolist() == blocks.tolist() and back[1].tolist() == which.tolist()
    # the layers of one buffer are one region to register; separate allocations one each
    assert len(KVGeometry.from_layers(per_layer(False, one_buffer=True)).regions()) == 1
    assert sorted(g.regions()) == sorted((t.data_ptr(), NUM_BLOCKS * 512) for t in layers)


def test_block_major_geometry_is_unchanged_and_layers_of_a_block_major_buffer_stay_block_major():
    kv = block_major(False)
    g = KVGeometry.from_tensor(kv)
    assert g.block_major and g.regions() == [(kv.data_ptr(), kv.numel() * 4)]
    assert g.slice_index(np.array([2]), np.array([1])).tolist() == [2 * NUM_LAYERS + 1]
    rows = g.block_rows()
    assert rows is not None and int(rows[3, 0]) == kv[3].data_ptr() and int(rows[3, 1]) == g.block_bytes


def test_layouts_that_cannot_be_addressed_are_refused():
    with pytest.raises(ValueError, match="one shape"):
        KVGeometry.from_layers([torch.zeros(PER_LAYER), torch.zeros(NUM_BLOCKS, 2, 4, 8)])
    with pytest.raises(ValueError, match="contiguous"):
        KVGeometry.from_layers([torch.zeros(PER_LAYER).transpose(1, 2)])
    with pytest.raises(ValueError, match="overlap"):  # two layers whose extents overlap
        KVGeometry(base_addr=4096, num_blocks=4, num_layers=2, block_bytes=80, layer_bytes=40,
                   layer_bases=(4096, 4096 + 40), block_stride=40)
    with pytest.raises(ValueError, match="layer bases"):
        KVGeometry(base_addr=4096, num_blocks=4, num_layers=2, block_bytes=80, layer_bytes=40,
                   layer_bases=(4096,), block_stride=40)


def _info(g: KVGeometry, **over) -> HandshakeInfo:
    fields = dict(engine_id="decode-x", role="decode", agent_name="decode-x", agent_metadata=b"m",
                  base_address=g.base_addr, num_blocks=g.num_blocks, num_layers=g.num_layers,
                  block_bytes=g.block_bytes, layer_bytes=g.layer_bytes, compat_hash="h",
                  layer_bases=list(g.layer_bases), block_stride=g.block_stride)
    return HandshakeInfo(**{**fields, **over})


def test_a_per_layer_layout_travels_in_the_handshake_and_a_bad_one_is_refused():
    g = KVGeometry.from_layers(per_layer(False))
    info = verify_and_decode(pack(_info(g), None), None, "h")
    assert KVGeometry.from_info(info) == g
    bad = _info(g, layer_bases=[g.base_addr, g.base_addr + 8, g.base_addr + 16])  # overlapping layers
    with pytest.raises(HandshakeError, match="KV layout"):
        verify_and_decode(pack(bad, None), None, "h")


# ---------------------------------------------------------------------- moving bytes


class Fake:
    def __init__(self, a_kv, b_kv) -> None:
        fabric = FakeFabric()
        self.a, self.b = FakeAgent("a", fabric), FakeAgent("b", fabric)
        self.a.register_kv(a_kv)
        self.b.register_kv(b_kv)
        self.a.connect(self.b)

    def finish(self, owner: KVAgent, t: Transfer) -> XferStatus:
        return owner.wait(t, TIMEOUT_S)

    def close(self) -> None:
        self.a.close()
        self.b.close()


class Nixl:
    def __init__(self, a_kv, b_kv) -> None:
        pytest.importorskip("nixl", reason="nixl is not installed (make install)")
        from kvpush.transfer.nixl_agent import NixlTransferAgent

        self.a, self.b = NixlTransferAgent("lay-a", capture_telemetry=True), NixlTransferAgent("lay-b")
        ga, gb = self.a.register_kv(a_kv), self.b.register_kv(b_kv)
        self.a.add_peer(self.b.metadata(), gb)
        self.b.add_peer(self.a.metadata(), ga)

    def finish(self, owner, t: Transfer) -> XferStatus:
        deadline = time.monotonic() + TIMEOUT_S
        while owner.poll(t) is XferStatus.POSTED:
            assert time.monotonic() < deadline, "transfer did not complete"
            for agent in (self.a, self.b):
                agent.get_notifs()
        return t.state

    def close(self) -> None:
        self.a.close()
        self.b.close()


# (source layout, destination layout, descriptors of a WRITE of 3 consecutive blocks, all layers)
CASES = [
    ("per-layer", "per-layer", NUM_LAYERS),  # a run of blocks merges within each layer
    ("block-major", "per-layer", 3 * NUM_LAYERS),  # nothing is contiguous on both sides at once
    ("per-layer", "one-buffer", NUM_LAYERS),
    ("block-major", "block-major", 1),  # kvpush's own fast path: one descriptor per run of blocks
]


def _make(kind: str, fill: bool):
    if kind == "block-major":
        return block_major(fill, seed=1)
    return per_layer(fill, seed=1, one_buffer=kind == "one-buffer")


@pytest.mark.parametrize("agents", [Fake, pytest.param(Nixl, marks=pytest.mark.integration)])
@pytest.mark.parametrize("src,dst,descs", CASES)
def test_write_moves_every_slice_to_its_place(agents, src: str, dst: str, descs: int):
    a_kv, b_kv = _make(src, True), _make(dst, False)
    pair = agents(a_kv, b_kv)
    try:
        t = pair.a.write(pair.b.name, [4, 5, 6], [9, 10, 11], b"w")
        assert (t.num_descs, t.num_bytes) == (descs, 3 * NUM_LAYERS * 512)
        assert pair.finish(pair.a, t) is XferStatus.DONE
        if isinstance(pair, Nixl):
            assert int(pair.a._agent.get_xfer_telemetry(t.handle).descCount) == descs  # nixl merged as counted
        assert slices_equal(b_kv, [9, 10, 11], a_kv, [4, 5, 6])
        assert zero_except(b_kv, [9, 10, 11])
        pair.a.release(t)
        t = pair.a.write_layers(pair.b.name, [0, 15], [0, 1], layers=[2], notif=b"l")  # one layer only
        assert pair.finish(pair.a, t) is XferStatus.DONE
        assert slices_equal(b_kv, [0, 1], a_kv, [0, 15], layers=[2])
        assert all(bool((slice_bytes(b_kv, b, layer) == 0).all()) for b in (0, 1) for layer in (0, 1))
        pair.a.release(t)
    finally:
        pair.close()


@pytest.mark.parametrize("agents", [Fake, pytest.param(Nixl, marks=pytest.mark.integration)])
def test_read_into_a_per_layer_layout(agents):
    a_kv, b_kv = per_layer(False), block_major(True, seed=3)
    pair = agents(a_kv, b_kv)
    try:
        t = pair.a.read(pair.b.name, [1, 2], [7, 8])
        assert pair.finish(pair.a, t) is XferStatus.DONE
        assert slices_equal(a_kv, [1, 2], b_kv, [7, 8]) and zero_except(a_kv, [1, 2])
        pair.a.release(t)
    finally:
        pair.close()


def test_peers_whose_slices_differ_are_refused():
    fabric = FakeFabric()
    a, b = FakeAgent("a", fabric), FakeAgent("b", fabric)
    try:
        a.register_kv(per_layer(False))
        b.register_kv([torch.zeros(NUM_BLOCKS, 2, 4, 8) for _ in range(NUM_LAYERS)])  # 256 B slices
        with pytest.raises(HandshakeError, match="layer_bytes"):
            a.connect(b)
    finally:
        a.close()
        b.close()
