"""How a registered KV buffer is cut into blocks and per-layer slices, and the descriptor indices
every KV agent computes alike.

A layout (KVGeometry) says where slice ``(b, l)`` (block ``b`` of layer ``l``, K and V) lives:
``layer_bases[l] + b * block_stride``, ``layer_bytes`` long. Two layouts are described:

    block-major    kvpush's engine: one buffer kv[num_blocks, num_layers, ...]; layer l of block b
                   at base + b * block_bytes + l * layer_bytes, so a whole block (all layers) is one
                   contiguous run and so is a run of consecutive blocks
    layer-major    one tensor per layer, [num_blocks, ...] each (vLLM's CPU and GPU backends): a run
                   of consecutive blocks is contiguous within each layer

Descriptors are prepared once per agent: one per block where whole blocks are contiguous (the
block-major fast path), and one per slice, indexed in address order (block-major: ``b * num_layers
+ l``; layer-major: ``l * num_blocks + b``). Runs of indices that step by one on both sides merge
into one descriptor (nixl 1.5.1 merges them so; ``count_descriptors`` computes the same count).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch

MEMORY_TYPES = ("DRAM", "VRAM")
MAX_INDEX = 2**31 - 1  # nixl takes int32 indices
_SMALL = 32  # up to this many ids, plain Python beats numpy's per-call cost

BlockIds = Sequence[int] | np.ndarray | torch.Tensor


class KVGeometry(msgspec.Struct, frozen=True, kw_only=True):
    """Where a registered KV buffer lives and how it is cut (module docstring).

    ``base_addr`` is the lowest slice's address (the least of ``layer_bases``) and ``block_bytes`` the bytes of
    one block over all layers (``num_layers * layer_bytes``), whatever the layout. ``layer_bases``
    empty and ``block_stride`` 0 mean block-major: layer ``l`` at ``base_addr + l * layer_bytes``,
    blocks ``block_bytes`` apart.
    """

    base_addr: int
    num_blocks: int
    num_layers: int
    block_bytes: int
    layer_bytes: int
    device_id: int = 0
    memory_type: str = "DRAM"
    layer_bases: tuple[int, ...] = ()  # slice (b, l) at layer_bases[l] + b * block_stride; () = block-major
    block_stride: int = 0  # 0 = block_bytes (block-major)

    def __post_init__(self) -> None:
        if self.base_addr <= 0:
            raise ValueError(f"base_addr must be a positive address, got {self.base_addr}")
        if self.num_blocks <= 0 or self.num_layers <= 0 or self.layer_bytes <= 0:
            raise ValueError(f"num_blocks ({self.num_blocks}), num_layers ({self.num_layers}) and "
                             f"layer_bytes ({self.layer_bytes}) must be positive")
        if self.block_bytes != self.num_layers * self.layer_bytes:
            raise ValueError(f"block_bytes {self.block_bytes} != num_layers {self.num_layers} * "
                             f"layer_bytes {self.layer_bytes} (the bytes of one block over all layers)")
        if self.memory_type not in MEMORY_TYPES:
            raise ValueError(f"memory_type must be one of {MEMORY_TYPES}, got {self.memory_type!r}")
        if self.device_id < 0:
            raise ValueError(f"device_id must be >= 0, got {self.device_id}")
        if self.num_blocks * self.num_layers > MAX_INDEX:
            raise ValueError(f"{self.num_blocks} blocks x {self.num_layers} layers is more slices "
                             f"than nixl's int32 indices address")
        self._check_layers()

    def _check_layers(self) -> None:
        if not self.layer_bases and not self.block_stride:
            return
        if len(self.layer_bases) != self.num_layers:
            raise ValueError(f"{len(self.layer_bases)} layer bases for {self.num_layers} layers")
        if self.block_stride < self.layer_bytes:
            raise ValueError(f"block_stride {self.block_stride} < layer_bytes {self.layer_bytes}: slices overlap")
        if min(self.layer_bases) != self.base_addr:
            raise ValueError(f"base_addr {self.base_addr:#x} is not the lowest layer base")
        extents = sorted((base, base + self.span) for base in self.layer_bases)
        if any(end > start for (_, end), (start, _) in zip(extents, extents[1:], strict=False)):
            raise ValueError("the layers' extents overlap (a layer-major layout needs one region per layer)")

    @property
    def bases(self) -> tuple[int, ...]:
        """Each layer's address of block 0."""
        if self.layer_bases:
            return self.layer_bases
        return tuple(self.base_addr + layer * self.layer_bytes for layer in range(self.num_layers))

    @property
    def stride(self) -> int:
        """Bytes from a block to the next within one layer."""
        return self.block_stride or self.block_bytes

    @property
    def span(self) -> int:
        """Bytes from a layer's first slice to the end of its last."""
        return (self.num_blocks - 1) * self.stride + self.layer_bytes

    @property
    def block_major(self) -> bool:
        """Whole blocks are contiguous: one descriptor per block (and per run of blocks). A layout with
        layer_bases is layer-major: its layers' extents may not overlap (checked), which block-major
        layers of more than one block always do."""
        return not self.layer_bases

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def regions(self) -> list[tuple[int, int]]:
        """(address, length) of the memory to register: each layer's extent, adjacent ones merged."""
        if self.block_major:
            return [(self.base_addr, self.total_bytes)]
        out: list[tuple[int, int]] = []
        for base in sorted(self.bases):
            if out and out[-1][0] + out[-1][1] == base:
                out[-1] = (out[-1][0], out[-1][1] + self.span)
            else:
                out.append((base, self.span))
        return out

    def slice_index(self, blocks: np.ndarray, layers: np.ndarray) -> np.ndarray:
        """Indices in this layout's slice list of the slices (blocks[i], layers[i])."""
        if self.block_major:
            return blocks * self.num_layers + layers
        return layers * self.num_blocks + blocks

    def slice_of(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(blocks, layers) of slice indices: the inverse of ``slice_index``."""
        if self.block_major:
            return idx // self.num_layers, idx % self.num_layers
        return idx % self.num_blocks, idx // self.num_blocks

    def slice_rows(self) -> np.ndarray:
        """[num_blocks * num_layers, 2] uint64 (address, length) of every slice, in index order."""
        blocks = np.arange(self.num_blocks, dtype=np.uint64)
        bases = np.asarray(self.bases, dtype=np.uint64)
        if self.block_major:
            addrs = (blocks[:, None] * np.uint64(self.stride) + bases[None, :]).ravel()
        else:
            addrs = (bases[:, None] + blocks[None, :] * np.uint64(self.stride)).ravel()
        return np.stack([addrs, np.full_like(addrs, self.layer_bytes)], axis=1)

    def block_rows(self) -> np.ndarray | None:
        """[num_blocks, 2] uint64 (address, length) of every whole block; None unless block-major."""
        if not self.block_major:
            return None
        addrs = np.uint64(self.base_addr) + np.arange(self.num_blocks, dtype=np.uint64) * np.uint64(self.block_bytes)
        return np.stack([addrs, np.full_like(addrs, self.block_bytes)], axis=1)

    @classmethod
    def from_tensor(cls, kv: torch.Tensor) -> KVGeometry:
        """Geometry of ``kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``."""
        if kv.dim() != 6:
            raise ValueError("the KV buffer must be kv[num_blocks, num_layers, 2, block_size, "
                             f"num_kv_heads, head_dim], got shape {tuple(kv.shape)}")
        if not kv.is_contiguous():
            raise ValueError("the KV buffer must be contiguous")
        memory_type, device_id = _memory_of(kv)
        num_blocks, num_layers = int(kv.shape[0]), int(kv.shape[1])
        layer_bytes = int(kv[0, 0].numel()) * kv.element_size()
        return cls(base_addr=int(kv.data_ptr()), num_blocks=num_blocks, num_layers=num_layers,
                   block_bytes=num_layers * layer_bytes, layer_bytes=layer_bytes,
                   device_id=device_id, memory_type=memory_type)

    @classmethod
    def from_layers(cls, layers: Sequence[torch.Tensor]) -> KVGeometry:
        """Geometry of one tensor per layer, each ``[num_blocks, ...]`` and contiguous, all of one shape,
        dtype and device (vLLM's per-layer KV caches): a layer-major layout. Layers of one buffer that
        follow each other (vLLM's) are one region to register."""
        if not layers:
            raise ValueError("no layer tensors")
        first = layers[0]
        for t in layers:
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError("every layer's KV tensor must have one shape, dtype and device: "
                                 f"{tuple(first.shape)} {first.dtype} {first.device} vs "
                                 f"{tuple(t.shape)} {t.dtype} {t.device}")
            if not t.is_contiguous() or t.dim() < 2:
                raise ValueError(f"a layer's KV tensor must be contiguous [num_blocks, ...], got {tuple(t.shape)}")
        memory_type, device_id = _memory_of(first)
        num_blocks, layer_bytes = int(first.shape[0]), int(first[0].numel()) * first.element_size()
        bases = tuple(int(t.data_ptr()) for t in layers)
        return cls(base_addr=min(bases), num_blocks=num_blocks, num_layers=len(layers),
                   block_bytes=len(layers) * layer_bytes, layer_bytes=layer_bytes, device_id=device_id,
                   memory_type=memory_type, layer_bases=bases, block_stride=layer_bytes)

    @classmethod
    def from_info(cls, info: Any) -> KVGeometry:
        """From any object with the same fields, e.g. a handshake's ``HandshakeInfo``
        (which spells the address ``base_address``)."""
        base = getattr(info, "base_addr", None)
        if base is None:
            base = info.base_address
        return cls(base_addr=int(base), num_blocks=int(info.num_blocks),
                   num_layers=int(info.num_layers), block_bytes=int(info.block_bytes),
                   layer_bytes=int(info.layer_bytes), device_id=int(info.device_id),
                   memory_type=str(info.memory_type),
                   layer_bases=tuple(int(x) for x in getattr(info, "layer_bases", ()) or ()),
                   block_stride=int(getattr(info, "block_stride", 0) or 0))


def _memory_of(t: torch.Tensor) -> tuple[str, int]:
    if t.device.type == "cpu":
        return "DRAM", 0
    if t.device.type == "cuda":
        return "VRAM", t.device.index or 0
    raise ValueError(f"cannot register a KV buffer on device {t.device}")


@dataclass(frozen=True)
class XferPlan:
    """A checked post: descriptor indices on both sides (blocks, or slices when ``per_layer``)."""

    op: str
    local_idx: np.ndarray  # [n] int64
    remote_idx: np.ndarray  # [n] int64
    per_layer: bool
    num_bytes: int

    @property
    def num_descs(self) -> int:
        return count_descriptors(self.local_idx, self.remote_idx)


def count_descriptors(local_idx: np.ndarray, remote_idx: np.ndarray) -> int:
    """Descriptors left after merging: adjacent entries merge when both indices step by one.

    Indices are in units of one prepared descriptor (a block, or a slice ``b * num_layers + l``).
    """
    n = int(local_idx.size)
    if n <= 1:
        return n
    if n <= _SMALL:  # numpy's fixed cost per call dominates short lists
        lv, rv = local_idx.tolist(), remote_idx.tolist()
        return 1 + sum(1 for i in range(1, n) if lv[i] != lv[i - 1] + 1 or rv[i] != rv[i - 1] + 1)
    breaks = (local_idx[1:] - local_idx[:-1] != 1) | (remote_idx[1:] - remote_idx[:-1] != 1)
    return 1 + int(np.count_nonzero(breaks))


def block_indices(ids: BlockIds, limit: int, what: str) -> np.ndarray:
    """ids as a 1-D int64 array, all in [0, limit); ValueError otherwise (before any nixl call)."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a 1-D list of ints, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size <= _SMALL:
        vals = arr.tolist()
        out_of_range = min(vals) < 0 or max(vals) >= limit
    else:  # one reduction: negatives wrap to huge values
        out_of_range = int(arr.view(np.uint64).max()) >= limit
    if out_of_range:
        bad = arr[(arr < 0) | (arr >= limit)]
        raise ValueError(f"{what} out of range [0, {limit}): {bad[:8].tolist()}")
    return arr


