"""The KV agent interface and the core every agent shares: geometry, block indices, descriptors.

``KVAgent`` is what the transfer thread calls; ``NixlTransferAgent`` (nixl_agent.py, over the real
nixl package) and ``FakeAgent`` (fake.py, in-process, for unit tests) implement it. Both derive
from ``AgentCore``, which holds what does not depend on how bytes move: the peer table, the
checks before a post (``plan``), the index arithmetic (``block_indices``, ``count_descriptors``),
``wait`` and the end of a transfer (``finish``). A subclass moves bytes (``_post``, ``poll``,
``release``, notifications) and holds the lock that serializes its calls (``_lock``).

Indices and descriptor counts: descriptors.py.

Errors every agent raises: bad input (block or layer ids out of range, unequal lengths,
non-integer ids) is a ``ValueError`` before anything moves, so no memory is touched; an unknown
peer or use after ``close`` is a ``TransferError``; a peer reported gone is a
``PeerDisconnectedError`` (a ``TransferError``) until ``remove_peer``; incompatible peer geometry
or a peer added twice is a ``HandshakeError``. ``poll`` never raises for a failure of the
transfer itself: it returns FAILED and sets ``Transfer.error``.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, Self

import numpy as np
import torch

from kvpush.errors import HandshakeError, TransferError
from kvpush.transfer.descriptors import MEMORY_TYPES, BlockIds, KVGeometry, XferPlan, block_indices

# What register_kv takes: kvpush's block-major tensor, one tensor per layer, or a raw address (with a geometry).
KVBuffer = torch.Tensor | Sequence[torch.Tensor] | int


class PeerDisconnectedError(TransferError):
    """The peer went away (nixl's ``nixlRemoteDisconnectError``): fail its transfers, remove it."""

    def __init__(self, message: str, peer: str) -> None:
        super().__init__(message)
        self.peer = peer


class XferStatus(StrEnum):
    """Where one posted agent transfer is (not the ledger's per-request TransferState)."""

    POSTED = "POSTED"  # nixl "PROC": in flight
    DONE = "DONE"  # nixl "DONE": data landed; the notification (if any) is on its way
    FAILED = "FAILED"  # nixl "ERR", a nixl exception while polling, or the peer was removed


@dataclass(eq=False)
class Transfer:
    """One posted transfer. ``handle`` is the agent's opaque handle, owned until ``release``."""

    peer: str
    op: str  # "WRITE" | "READ"
    num_descs: int  # descriptors after merging runs (what nixl posts)
    num_bytes: int
    notif: bytes
    state: XferStatus
    posted_at: float  # time.monotonic() just before the post
    post_s: float = 0.0  # seconds spent posting (with CMA: the copy too)
    finished_at: float | None = None
    error: str | None = None
    handle: Any = field(default=None, repr=False)


@dataclass
class AgentStats:
    """Counters of one agent; ``nixl_seconds`` is time spent inside nixl posting calls."""

    transfers_posted: int = 0
    transfers_done: int = 0
    transfers_failed: int = 0
    descs_posted: int = 0
    bytes_posted: int = 0
    notifs_sent: int = 0
    notifs_received: int = 0
    nixl_seconds: float = 0.0


@dataclass(eq=False)
class PeerEntry:
    """A peer agent as one agent knows it."""

    name: str
    geometry: KVGeometry
    disconnected: str | None = None  # why, once the peer was reported gone


class KVAgent(Protocol):
    """What the transfer thread needs from an agent (see nixl_agent.py for the contract)."""

    name: str
    stats: AgentStats

    @property
    def geometry(self) -> KVGeometry | None: ...
    def register_kv(self, kv: KVBuffer, geometry: KVGeometry | None = None) -> KVGeometry: ...
    def metadata(self) -> bytes: ...
    def add_peer(self, peer_metadata: bytes, peer_geometry: KVGeometry) -> str: ...
    def peers(self) -> list[str]: ...
    def is_connected(self, peer: str) -> bool: ...
    def remove_peer(self, peer: str) -> bool: ...
    def write(self, peer: str, local_block_ids: BlockIds, remote_block_ids: BlockIds,
              notif: bytes = b"") -> Transfer: ...
    def read(self, peer: str, local_block_ids: BlockIds, remote_block_ids: BlockIds,
             notif: bytes = b"") -> Transfer: ...
    def write_layers(self, peer: str, local_block_ids: BlockIds, remote_block_ids: BlockIds,
                     layers: Sequence[int], notif: bytes = b"") -> Transfer: ...
    def read_layers(self, peer: str, local_block_ids: BlockIds, remote_block_ids: BlockIds,
                    layers: Sequence[int], notif: bytes = b"") -> Transfer: ...
    def poll(self, transfer: Transfer) -> XferStatus: ...
    def wait(self, transfer: Transfer, timeout_s: float) -> XferStatus: ...
    def release(self, transfer: Transfer) -> None: ...
    def send_notif(self, peer: str, msg: bytes) -> None: ...
    def get_notifs(self) -> list[tuple[str, bytes]]: ...
    def close(self) -> None: ...


class AgentCore(ABC):
    """The part of an agent that does not move bytes (see the module docstring)."""

    _peers: dict[str, Any]  # name -> PeerEntry (or a subclass of it)

    def __init__(self, name: str, memory_type: str, device_id: int, lock: threading.RLock) -> None:
        if memory_type not in MEMORY_TYPES:
            raise ValueError(f"memory_type must be one of {MEMORY_TYPES}, got {memory_type!r}")
        self.name = name
        self.memory_type = memory_type
        self.device_id = device_id
        self.stats = AgentStats()
        self._lock = lock
        self._closed = False
        self._peers = {}
        self._geometry: KVGeometry | None = None

    def _post(self, op: str, peer: str, local_ids: BlockIds, remote_ids: BlockIds,
              layers: Sequence[int] | None, notif: bytes) -> Transfer:
        """Check (``plan``), then post; with nothing to move, DONE at once (the notif alone says so)."""
        with self._lock:
            p, plan = self.plan(op, peer, local_ids, remote_ids, layers)
            notif = bytes(notif)
            now = time.monotonic()
            if plan.local_idx.size == 0:
                if notif:
                    self._deliver(p, notif)
                return Transfer(peer, op, 0, 0, notif, XferStatus.DONE, now, finished_at=now)
            return self._start(p, plan, notif, now)

    @abstractmethod
    def _start(self, p: Any, plan: XferPlan, notif: bytes, now: float) -> Transfer:
        """Post a checked, non-empty transfer towards peer ``p``; lock held."""

    @abstractmethod
    def poll(self, transfer: Transfer) -> XferStatus:
        """Progress and check a transfer: POSTED, DONE or FAILED (``transfer.error`` says why)."""

    @abstractmethod
    def _deliver(self, p: Any, msg: bytes) -> None:
        """Send ``msg`` to peer ``p`` (a PeerEntry); lock held."""

    @abstractmethod
    def _take_notifs(self) -> list[tuple[str, bytes]]:
        """The notifications received since the last call; lock held."""

    @abstractmethod
    def remove_peer(self, peer: str) -> bool:
        """Release the peer's transfers, then forget it; False if it was unknown."""

    @abstractmethod
    def _teardown(self) -> None:
        """``close`` after every peer was removed: release the registration; lock held."""

    def get_notifs(self) -> list[tuple[str, bytes]]:
        """New notifications as (peer agent name, message), in arrival order per peer.

        Also progresses the agent: call it regularly while notifications are expected.
        """
        with self._lock:
            self._check_open("get_notifs")
            out = self._take_notifs()
            self.stats.notifs_received += len(out)
            return out

    def close(self) -> None:
        """Every peer removed, then ``_teardown``. Idempotent, never raises."""
        with self._lock:
            if self._closed:
                return
            for peer in list(self._peers):
                self.remove_peer(peer)
            self._teardown()
            self._closed = True

    @property
    def geometry(self) -> KVGeometry | None:
        return self._geometry

    @property
    def closed(self) -> bool:
        return self._closed

    def peers(self) -> list[str]:
        with self._lock:
            return list(self._peers)

    def is_connected(self, peer: str) -> bool:
        """Known and not reported disconnected."""
        with self._lock:
            p = self._peers.get(peer)
            return p is not None and p.disconnected is None

    # ---- transfers ------------------------------------------------------------------------
    def write(self, peer: str, local_block_ids: BlockIds, remote_block_ids: BlockIds,
              notif: bytes = b"") -> Transfer:
        """WRITE local blocks into the peer's blocks; the peer gets ``notif`` once they landed."""
        return self._post("WRITE", peer, local_block_ids, remote_block_ids, None, notif)

    def read(self, peer: str, local_block_ids: BlockIds, remote_block_ids: BlockIds,
             notif: bytes = b"") -> Transfer:
        """READ the peer's blocks into local blocks; the peer gets ``notif`` when done."""
        return self._post("READ", peer, local_block_ids, remote_block_ids, None, notif)

    def write_layers(self, peer: str, local_block_ids: BlockIds, remote_block_ids: BlockIds,
                     layers: Sequence[int], notif: bytes = b"") -> Transfer:
        """WRITE only the slices ``kv[b, l]`` of the given layers (other layers are untouched)."""
        return self._post("WRITE", peer, local_block_ids, remote_block_ids, layers, notif)

    def read_layers(self, peer: str, local_block_ids: BlockIds, remote_block_ids: BlockIds,
                    layers: Sequence[int], notif: bytes = b"") -> Transfer:
        return self._post("READ", peer, local_block_ids, remote_block_ids, layers, notif)

    def send_notif(self, peer: str, msg: bytes) -> None:
        """A standalone notification (not bound to a transfer)."""
        with self._lock:
            self._check_open("send_notif")
            self._deliver(self._peer(peer, "send_notif"), bytes(msg))

    def wait(self, transfer: Transfer, timeout_s: float) -> XferStatus:
        """Poll until DONE or FAILED; TransferError after ``timeout_s`` (the transfer stays POSTED).

        Spins for the first millisecond, then sleeps 50 us between polls.
        """
        start = time.monotonic()
        while True:
            state = self.poll(transfer)
            if state is not XferStatus.POSTED:
                return state
            now = time.monotonic()
            if now >= start + timeout_s:
                raise TransferError(f"{transfer.op} towards peer {transfer.peer!r} still in flight "
                                    f"after {timeout_s} s")
            if now - start > 1e-3:
                time.sleep(5e-5)

    # ---- helpers for subclasses (lock held) ------------------------------------------------
    def _buffer(self, kv: KVBuffer, geometry: KVGeometry | None) -> tuple[KVGeometry, list[torch.Tensor]]:
        """The geometry of a buffer to register (a block-major tensor, one tensor per layer, or a raw
        address with its geometry) and the tensors to keep alive while it is registered."""
        self._check_open("register_kv")
        if self._geometry is not None:
            raise TransferError(f"agent {self.name!r} already registered its KV buffer")
        tensors = [kv] if isinstance(kv, torch.Tensor) else [] if isinstance(kv, int) else list(kv)
        if tensors:
            derived = KVGeometry.from_tensor(tensors[0]) if isinstance(kv, torch.Tensor) else KVGeometry.from_layers(tensors)
            if geometry is not None and geometry != derived:
                raise ValueError(f"geometry {geometry} does not describe the tensor ({derived})")
            geometry = derived
        elif geometry is None:
            raise ValueError("registering a raw address needs its KVGeometry")
        elif isinstance(kv, int) and kv != geometry.base_addr:
            raise ValueError(f"address {kv:#x} != geometry.base_addr {geometry.base_addr:#x}")
        if geometry.memory_type != self.memory_type:
            raise ValueError(f"agent {self.name!r} handles {self.memory_type}, the buffer is "
                             f"{geometry.memory_type}")
        if geometry.memory_type == "VRAM" and geometry.device_id != self.device_id:
            raise ValueError(f"agent {self.name!r} handles GPU {self.device_id}, the buffer is "
                             f"on GPU {geometry.device_id}")
        return geometry, tensors

    def _registered(self, op: str) -> KVGeometry:
        self._check_open(op)
        if self._geometry is None:
            raise TransferError(f"agent {self.name!r}: register_kv before {op}")
        return self._geometry

    def _check_compatible(self, peer_geometry: KVGeometry) -> None:
        local = self._registered("add_peer")
        if (peer_geometry.num_layers, peer_geometry.layer_bytes) != (local.num_layers, local.layer_bytes):
            raise HandshakeError(
                f"KV geometry mismatch between {self.name!r} (num_layers={local.num_layers}, "
                f"layer_bytes={local.layer_bytes}) and the peer (num_layers="
                f"{peer_geometry.num_layers}, layer_bytes={peer_geometry.layer_bytes})")

    def _check_new_peer(self, name: str) -> None:
        if name in self._peers:
            raise HandshakeError(f"peer {name!r} is already added to agent {self.name!r}; "
                                 f"remove_peer it first")

    def plan(self, op: str, peer: str, local_ids: BlockIds, remote_ids: BlockIds,
             layers: Sequence[int] | None) -> tuple[Any, XferPlan]:
        """Check a post (open, registered, known and connected peer, ids in range) and index it: whole
        blocks where both sides are block-major and every layer moves (the fast path), else slices."""
        local_geometry = self._registered(op)
        p = self._peer(peer, op)
        local = block_indices(local_ids, local_geometry.num_blocks, "local_block_ids")
        remote = block_indices(remote_ids, p.geometry.num_blocks, "remote_block_ids")
        if local.size != remote.size:
            raise ValueError(f"{op}: {local.size} local block ids but {remote.size} remote ones")
        if layers is None and local_geometry.block_major and p.geometry.block_major:
            return p, XferPlan(op, local, remote, False, int(local.size) * local_geometry.block_bytes)
        num_layers = local_geometry.num_layers
        lay = (np.arange(num_layers, dtype=np.int64) if layers is None
               else np.unique(block_indices(layers, num_layers, "layers")))  # sorted: consecutive layers merge
        if local_geometry.block_major:  # b0l0, b0l1, ..., b1l0: all layers of a run of blocks merge
            blocks, slices = np.repeat(local, lay.size), np.tile(lay, local.size)
            peer_blocks = np.repeat(remote, lay.size)
        else:  # l0b0, l0b1, ..., l1b0: a run of blocks merges within each layer
            blocks, slices = np.tile(local, lay.size), np.repeat(lay, local.size)
            peer_blocks = np.tile(remote, lay.size)
        local_idx = local_geometry.slice_index(blocks, slices)
        remote_idx = p.geometry.slice_index(peer_blocks, slices)
        return p, XferPlan(op, local_idx, remote_idx, True, int(local_idx.size) * local_geometry.layer_bytes)

    def _new_transfer(self, peer: str, plan: XferPlan, notif: bytes, now: float, handle: Any = None) -> Transfer:
        transfer = Transfer(peer, plan.op, plan.num_descs, plan.num_bytes, notif, XferStatus.POSTED, now,
                            handle=handle)
        self.stats.transfers_posted += 1
        self.stats.descs_posted += transfer.num_descs
        self.stats.bytes_posted += transfer.num_bytes
        return transfer

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise TransferError(f"{op} on closed agent {self.name!r}")

    def _peer(self, peer: str, op: str) -> Any:
        p = self._peers.get(peer)
        if p is None:
            raise TransferError(f"{op} from agent {self.name!r}: unknown peer {peer!r} "
                                f"(known: {sorted(self._peers)})")
        if p.disconnected is not None:
            raise PeerDisconnectedError(f"{op} from agent {self.name!r}: peer {peer!r} is "
                                        f"disconnected ({p.disconnected}); remove_peer it", peer)
        return p

    def _finish(self, transfer: Transfer, state: XferStatus, error: str | None) -> None:
        if transfer.state is not XferStatus.POSTED:
            return
        transfer.state, transfer.error, transfer.finished_at = state, error, time.monotonic()
        if state is XferStatus.DONE:
            self.stats.transfers_done += 1
        else:
            self.stats.transfers_failed += 1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
