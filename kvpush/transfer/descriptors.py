"""Block indices and descriptors of a block-major KV buffer: what every KV agent computes alike.

Blocks are indexed by block id; a slice ``kv[b, l]`` of layer ``l`` is indexed
``b * num_layers + l``, which is its address in units of ``layer_bytes``. Runs of indices that
step by one on both sides merge into one descriptor (nixl 1.5.1 merges them so;
``count_descriptors`` computes the same count in Python).
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
    """Where a registered block-major KV buffer lives and how it is cut.

    Block ``b`` is ``[base_addr + b * block_bytes, + block_bytes)``; its layer-``l`` slice
    ``kv[b, l]`` (K and V) starts at ``base_addr + b * block_bytes + l * layer_bytes``.
    """

    base_addr: int
    num_blocks: int
    num_layers: int
    block_bytes: int
    layer_bytes: int
    device_id: int = 0
    memory_type: str = "DRAM"

    def __post_init__(self) -> None:
        if self.base_addr <= 0:
            raise ValueError(f"base_addr must be a positive address, got {self.base_addr}")
        if self.num_blocks <= 0 or self.num_layers <= 0 or self.layer_bytes <= 0:
            raise ValueError(f"num_blocks ({self.num_blocks}), num_layers ({self.num_layers}) and "
                             f"layer_bytes ({self.layer_bytes}) must be positive")
        if self.block_bytes != self.num_layers * self.layer_bytes:
            raise ValueError(f"block_bytes {self.block_bytes} != num_layers {self.num_layers} * "
                             f"layer_bytes {self.layer_bytes} (the KV buffer is block-major)")
        if self.memory_type not in MEMORY_TYPES:
            raise ValueError(f"memory_type must be one of {MEMORY_TYPES}, got {self.memory_type!r}")
        if self.device_id < 0:
            raise ValueError(f"device_id must be >= 0, got {self.device_id}")
        if self.num_blocks * self.num_layers > MAX_INDEX:
            raise ValueError(f"{self.num_blocks} blocks x {self.num_layers} layers is more slices "
                             f"than nixl's int32 indices address")

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @classmethod
    def from_tensor(cls, kv: torch.Tensor) -> KVGeometry:
        """Geometry of ``kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``."""
        if kv.dim() != 6:
            raise ValueError("the KV buffer must be kv[num_blocks, num_layers, 2, block_size, "
                             f"num_kv_heads, head_dim], got shape {tuple(kv.shape)}")
        if not kv.is_contiguous():
            raise ValueError("the KV buffer must be contiguous")
        if kv.device.type == "cpu":
            memory_type, device_id = "DRAM", 0
        elif kv.device.type == "cuda":
            memory_type, device_id = "VRAM", kv.device.index or 0
        else:
            raise ValueError(f"cannot register a KV buffer on device {kv.device}")
        num_blocks, num_layers = int(kv.shape[0]), int(kv.shape[1])
        layer_bytes = int(kv[0, 0].numel()) * kv.element_size()
        return cls(base_addr=int(kv.data_ptr()), num_blocks=num_blocks, num_layers=num_layers,
                   block_bytes=num_layers * layer_bytes, layer_bytes=layer_bytes,
                   device_id=device_id, memory_type=memory_type)

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
                   memory_type=str(info.memory_type))


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


