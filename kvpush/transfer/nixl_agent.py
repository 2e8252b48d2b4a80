"""One NIXL agent for one instance's KV buffer: the only module in kvpush that imports nixl.

What it wraps
-------------
Each instance registers one block-major KV buffer (DESIGN.md section 2)::

    kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]   # contiguous

``NixlTransferAgent`` registers it once, prepares descriptor lists once (locally at
``register_kv``, per peer at ``add_peer``), and turns block-id lists into prepared transfers:

* ``write`` / ``read``: whole blocks (one descriptor per block ``kv[b]``, ``block_bytes`` each);
* ``write_layers`` / ``read_layers``: slices ``kv[b, l]`` (``layer_bytes`` each) of chosen layers.

Descriptor merging. Transfers are made with ``make_prepped_xfer`` from per-block (and per
block-and-layer) prepared lists, passing numpy int32 index arrays. nixl 1.5.1 merges adjacent
entries of the index lists whose local *and* remote regions are both contiguous, so a run of
consecutive block ids on both sides becomes one descriptor (a 64-block request in contiguous ids
is 1 descriptor). Measured on this machine (1024 blocks, 4 KiB each, make + release only):
``make_prepped_xfer`` costs 1.5-5 us for 1 to 512 blocks, while building merged lists on the fly
costs 9-143 us with ``initialize_xfer`` and 13-157 us with ``prep_xfer_dlist`` per transfer; not
merging (``skip_desc_merge``) makes a 512-block contiguous post + completion 4.6x slower. So
merging is left to nixl, and ``count_descriptors`` computes the same count in Python (under 1 us
for 32 ids, about 3 us for 512) so that every ``Transfer`` carries ``num_descs`` without nixl
telemetry (the tests check it against nixl's ``descCount``). The wrapper as a whole adds about
7 us per transfer to bare nixl (benchmarks/transfer_bw.py). Slices are
indexed ``b * num_layers + l``, which is exactly their address in units of ``layer_bytes``: the
same run rule applies, and layer lists are sorted so that consecutive layers of a block (and all
layers of consecutive blocks) merge too.

Threads and ownership
---------------------
The project design: one transfer thread per instance owns the agent and makes every call (post,
poll, notifications, peers, close). The progress thread of nixl is off
(``enable_prog_thread=False``), so transfers and notifications only progress while that thread
calls ``poll``, ``get_notifs``, ``write``... It must keep polling while transfers or expected
notifications are outstanding, and back off when idle. A receiver that stops polling stalls its
senders: after a few hundred unread notifications the sender's transfers stay POSTED for good
(seen with two agents in one process where only one was polled).
``write``/``read`` run the whole copy in the calling thread when UCX uses CMA (GIL released):
never call them from the engine step loop.

The nixl agent is created with ``NIXL_THREAD_SYNC_STRICT`` anyway, and the Python bookkeeping
is guarded by one lock, so a stray call from another thread is serialized instead of corrupting
state (it waits while a ``write`` copies: the lock is held for the whole post). With the default
sync mode (NONE), posting from one thread while another polls notifications hung in 2 of 2 runs
here (DESIGN.md also saw segfaults); STRICT and RW each survived 2 s of it, and all three cost
the same single-threaded (about 5 us for a 4 KiB write + notification in one process).

GPU memory: a CUDA tensor is registered as ``VRAM`` with its device id, and the agent adds UCX's
``cuda_copy`` and ``cuda_ipc`` transports (``config.ucx_environment``). Each thread that calls the
agent first makes that GPU's primary CUDA context current (once). The caller must have finished the
kernels that write a block before posting it (the prefill connector synchronizes its stream).

The caller owns the KV tensor's storage; the agent keeps a reference to a registered tensor so it
cannot be freed while registered. A ``Transfer`` owns one nixl transfer handle until
``release``; the agent owns the prepared lists and the registration.

Errors
------
Every exception raised by a nixl call becomes a ``TransferError`` naming the operation and the
peer (the original is chained as ``__cause__``). ``nixlRemoteDisconnectError`` (exported by
``nixl._bindings``; with error handling mode ``none`` it is raised by the first post towards a
killed peer) becomes ``PeerDisconnectedError``, a ``TransferError``; the peer is then marked
disconnected and every later call towards it fails fast until ``remove_peer``. ``poll`` never
raises for a failure of the transfer itself: it returns ``FAILED`` and records ``error``.
Standalone notifications towards a dead peer are dropped silently by nixl.

Bad input (block or layer ids out of range, unequal lengths, non-integer ids) raises
``ValueError`` before any nixl call, so no memory is touched. Unknown peers and use after
``close`` raise ``TransferError``; incompatible peer geometry raises ``HandshakeError``.

Teardown order
--------------
``remove_peer``: the peer's transfer handles, its prepared remote lists, ``remove_remote_agent``.
``close``: every peer as above, then the local prepared lists, then ``deregister_memory``, then
the agent is dropped. ``close`` is idempotent, best-effort (failures are logged, never raised),
and must run on the owning thread or after it stopped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import msgspec
import numpy as np
import torch

from kvpush.config import apply_ucx_environment as config_apply_ucx_environment
from kvpush.errors import HandshakeError, TransferError

logger = logging.getLogger(__name__)

MEMORY_TYPES = ("DRAM", "VRAM")
_LOCAL = "NIXL_INIT_AGENT"  # nixl's name for the local side of a prepared list
_MAX_INDEX = 2**31 - 1  # make_prepped_xfer takes int32 indices
_SMALL = 32  # up to this many ids, plain Python beats numpy's per-call cost

BlockIds = Sequence[int] | np.ndarray | torch.Tensor


class PeerDisconnectedError(TransferError):
    """The peer went away (``nixlRemoteDisconnectError``): fail its transfers and remove it."""

    def __init__(self, message: str, peer: str) -> None:
        super().__init__(message)
        self.peer = peer


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
        if self.num_blocks * self.num_layers > _MAX_INDEX:
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


class TransferState(StrEnum):
    POSTED = "POSTED"  # nixl "PROC": in flight
    DONE = "DONE"  # nixl "DONE": data landed; the notification (if any) is on its way
    FAILED = "FAILED"  # nixl "ERR", a nixl exception while polling, or the peer was removed


@dataclass(eq=False)
class Transfer:
    """One posted transfer. ``handle`` is the opaque nixl handle, owned until ``release``."""

    peer: str
    op: str  # "WRITE" | "READ"
    num_descs: int  # descriptors after merging runs (what nixl posts)
    num_bytes: int
    notif: bytes
    state: TransferState
    posted_at: float  # time.monotonic() just before the post
    post_s: float = 0.0  # seconds spent in make_prepped_xfer + transfer (the copy, with CMA)
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
class _Peer:
    name: str
    geometry: KVGeometry
    blocks: Any  # prepared remote list, one descriptor per block
    slices: Any  # prepared remote list, one descriptor per (block, layer)
    transfers: set[Transfer] = field(default_factory=set)
    disconnected: str | None = None  # why, once nixl reported the peer gone


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


def apply_ucx_environment(gpu: bool = False) -> None:
    """Put the UCX defaults of ``kvpush.config`` into ``os.environ`` where not already set.

    UCX reads its environment when a backend is created, so this runs before every agent.
    """
    config_apply_ucx_environment(gpu=gpu)


def _load_nixl() -> tuple[Any, Any]:
    try:
        import nixl._api as api
        import nixl._bindings as bindings
    except ImportError as exc:
        raise TransferError("nixl is not installed: pip install --no-deps nixl==1.5.1 "
                            "nixl-cu12==1.5.1 (DESIGN.md section 4)") from exc
    return api, bindings


def _indices(ids: BlockIds, limit: int, what: str) -> np.ndarray:
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


def _dlist(geometry: KVGeometry, per_layer: bool) -> np.ndarray:
    """Nx3 uint64 (address, length, device id): one row per block, or per (block, layer)."""
    if per_layer:
        count, step = geometry.num_blocks * geometry.num_layers, geometry.layer_bytes
    else:
        count, step = geometry.num_blocks, geometry.block_bytes
    rows = np.empty((count, 3), dtype=np.uint64)
    rows[:, 0] = np.uint64(geometry.base_addr) + np.arange(count, dtype=np.uint64) * np.uint64(step)
    rows[:, 1] = step
    rows[:, 2] = geometry.device_id
    return rows


class NixlTransferAgent:
    """A nixl agent (UCX backend, no progress thread) that moves blocks of one KV buffer.

    Typical use on one transfer thread::

        agent = NixlTransferAgent("prefill-0")
        geometry = agent.register_kv(kv)                # once
        # ... exchange agent.metadata() and geometry with the peer (handshake) ...
        peer = agent.add_peer(peer_metadata, peer_geometry)
        t = agent.write(peer, [4, 5, 6], [10, 11, 12], b"DONE:tid")   # 1 descriptor
        while agent.poll(t) is TransferState.POSTED: ...
        agent.release(t)
    """

    def __init__(self, name: str, memory_type: str = "DRAM", device_id: int = 0, *,
                 capture_telemetry: bool = False) -> None:
        if memory_type not in MEMORY_TYPES:
            raise ValueError(f"memory_type must be one of {MEMORY_TYPES}, got {memory_type!r}")
        self.name = name
        self.memory_type = memory_type
        self.device_id = device_id
        self.stats = AgentStats()
        self._lock = threading.RLock()
        self._closed = False
        self._peers: dict[str, _Peer] = {}
        self._geometry: KVGeometry | None = None
        self._kv: torch.Tensor | None = None  # keeps a registered tensor's storage alive
        self._reg: Any = None
        self._local_blocks: Any = None
        self._local_slices: Any = None
        self._cuda_bound = threading.local()  # VRAM: threads that made the GPU's context current

        apply_ucx_environment(gpu=memory_type == "VRAM")
        api, bindings = _load_nixl()
        self._disconnect_error: type[BaseException] = bindings.nixlRemoteDisconnectError
        try:
            config = api.nixl_agent_config(
                enable_prog_thread=False, enable_listen_thread=False, backends=[],
                capture_telemetry=capture_telemetry,
                sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
            self._agent: Any = api.nixl_agent(name, config)
            self._agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
        except Exception as exc:
            raise TransferError(f"cannot create nixl agent {name!r} with the UCX backend: "
                                f"{type(exc).__name__}: {exc}") from exc

    # ------------------------------------------------------------------ registration, peers

    @property
    def geometry(self) -> KVGeometry | None:
        return self._geometry

    def register_kv(self, kv: torch.Tensor | int, geometry: KVGeometry | None = None) -> KVGeometry:
        """Register the KV buffer once and prepare the local descriptor lists.

        ``kv`` is the tensor ``kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``
        (contiguous; DRAM on CPU, VRAM on CUDA), or a raw address with ``geometry``.
        """
        with self._lock:
            self._check_open("register_kv")
            if self._geometry is not None:
                raise TransferError(f"agent {self.name!r} already registered its KV buffer")
            if isinstance(kv, torch.Tensor):
                derived = KVGeometry.from_tensor(kv)
                if geometry is not None and geometry != derived:
                    raise ValueError(f"geometry {geometry} does not describe the tensor ({derived})")
                geometry, tensor = derived, kv
            else:
                if geometry is None:
                    raise ValueError("registering a raw address needs its KVGeometry")
                if int(kv) != geometry.base_addr:
                    raise ValueError(f"address {int(kv):#x} != geometry.base_addr {geometry.base_addr:#x}")
                tensor = None
            if geometry.memory_type != self.memory_type:
                raise ValueError(f"agent {self.name!r} handles {self.memory_type}, the buffer is "
                                 f"{geometry.memory_type}")
            if geometry.memory_type == "VRAM" and geometry.device_id != self.device_id:
                raise ValueError(f"agent {self.name!r} handles GPU {self.device_id}, the buffer is "
                                 f"on GPU {geometry.device_id}")
            region = [(geometry.base_addr, geometry.total_bytes, geometry.device_id, "")]
            try:
                reg = self._agent.register_memory(region, geometry.memory_type)
            except Exception as exc:
                raise self._translate(exc, "register_memory", None) from exc
            try:
                local_blocks = self._agent.prep_xfer_dlist(_LOCAL, _dlist(geometry, False),
                                                           geometry.memory_type)
                try:
                    local_slices = self._agent.prep_xfer_dlist(_LOCAL, _dlist(geometry, True),
                                                               geometry.memory_type)
                except Exception:
                    local_blocks.release()
                    raise
            except Exception as exc:
                self._quietly("deregister_memory", None, self._agent.deregister_memory, reg)
                raise self._translate(exc, "prep_xfer_dlist (local)", None) from exc
            self._reg, self._kv, self._geometry = reg, tensor, geometry
            self._local_blocks, self._local_slices = local_blocks, local_slices
            return geometry

    def metadata(self) -> bytes:
        """This agent's nixl metadata (connection info and registered memory) for the peer."""
        with self._lock:
            self._check_open("metadata")
            if self._geometry is None:
                raise TransferError(f"agent {self.name!r}: register_kv before sending metadata")
            try:
                return bytes(self._agent.get_agent_metadata())
            except Exception as exc:
                raise self._translate(exc, "get_agent_metadata", None) from exc

    def add_peer(self, peer_metadata: bytes, peer_geometry: KVGeometry) -> str:
        """Load the peer's metadata, prepare its descriptor lists once; returns its agent name.

        A peer that restarted (same name, new metadata) needs ``remove_peer`` first: adding a
        known name raises HandshakeError.
        """
        with self._lock:
            self._check_open("add_peer")
            local = self._geometry
            if local is None:
                raise TransferError(f"agent {self.name!r}: register_kv before add_peer")
            if (peer_geometry.num_layers, peer_geometry.layer_bytes) != (local.num_layers, local.layer_bytes):
                raise HandshakeError(
                    f"KV geometry mismatch between {self.name!r} (num_layers={local.num_layers}, "
                    f"layer_bytes={local.layer_bytes}) and the peer (num_layers="
                    f"{peer_geometry.num_layers}, layer_bytes={peer_geometry.layer_bytes})")
            try:
                loaded = self._agent.add_remote_agent(bytes(peer_metadata))
                name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)  # 1.5.1: bytes
            except Exception as exc:
                raise self._translate(exc, "add_remote_agent", None) from exc
            if name in self._peers:
                raise HandshakeError(f"peer {name!r} is already added to agent {self.name!r}; "
                                     f"remove_peer it first")
            prepared: list[Any] = []
            try:
                for per_layer in (False, True):
                    prepared.append(self._agent.prep_xfer_dlist(
                        name, _dlist(peer_geometry, per_layer), peer_geometry.memory_type))
            except Exception as exc:
                for handle in prepared:
                    self._quietly("release_dlist_handle", name, handle.release)
                self._quietly("remove_remote_agent", name, self._agent.remove_remote_agent, name)
                raise self._translate(exc, "prep_xfer_dlist (remote)", name) from exc
            self._peers[name] = _Peer(name, peer_geometry, prepared[0], prepared[1])
            return name

    def peers(self) -> list[str]:
        with self._lock:
            return list(self._peers)

    def is_connected(self, peer: str) -> bool:
        """Known and not reported disconnected by nixl."""
        with self._lock:
            p = self._peers.get(peer)
            return p is not None and p.disconnected is None

    def remove_peer(self, peer: str) -> bool:
        """Release the peer's transfers and lists, then forget it; False if it was unknown.

        Its transfers still POSTED become FAILED. Best-effort: failures are logged.
        """
        with self._lock:
            p = self._peers.pop(peer, None)
            if p is None or self._closed:
                return False
            for transfer in list(p.transfers):
                self._finish(transfer, TransferState.FAILED, f"peer {peer!r} was removed")
                if transfer.handle is not None:
                    self._quietly("release_xfer_handle", peer, transfer.handle.release)
                    transfer.handle = None
            p.transfers.clear()
            for handle in (p.blocks, p.slices):
                self._quietly("release_dlist_handle", peer, handle.release)
            self._quietly("remove_remote_agent", peer, self._agent.remove_remote_agent, peer)
            return True

    # ------------------------------------------------------------------ transfers

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

    def _post(self, op: str, peer: str, local_ids: BlockIds, remote_ids: BlockIds,
              layers: Sequence[int] | None, notif: bytes) -> Transfer:
        with self._lock:
            self._check_open(op)
            local_geometry = self._geometry
            if local_geometry is None:
                raise TransferError(f"agent {self.name!r}: register_kv before {op}")
            p = self._peer(peer, op)
            local = _indices(local_ids, local_geometry.num_blocks, "local_block_ids")
            remote = _indices(remote_ids, p.geometry.num_blocks, "remote_block_ids")
            if local.size != remote.size:
                raise ValueError(f"{op}: {local.size} local block ids but {remote.size} remote ones")
            if layers is None:
                local_idx, remote_idx = local, remote
                local_list, remote_list, unit = self._local_blocks, p.blocks, local_geometry.block_bytes
            else:
                num_layers = local_geometry.num_layers
                lay = _indices(layers, num_layers, "layers")
                lay = np.unique(lay)  # sorted: consecutive layers of a block merge
                # block-major order: b0l0, b0l1, ..., b1l0: all layers of a run of blocks merge
                local_idx = (local[:, None] * num_layers + lay[None, :]).ravel()
                remote_idx = (remote[:, None] * num_layers + lay[None, :]).ravel()
                local_list, remote_list, unit = self._local_slices, p.slices, local_geometry.layer_bytes
            notif = bytes(notif)
            now = time.monotonic()
            if local_idx.size == 0:  # nothing to move: the notification alone says "done"
                if notif:
                    self._send_notif_locked(p, notif)
                return Transfer(peer, op, 0, 0, notif, TransferState.DONE, now, finished_at=now)
            transfer = Transfer(peer, op, count_descriptors(local_idx, remote_idx),
                                int(local_idx.size) * unit, notif, TransferState.POSTED, now)
            t0 = time.perf_counter()
            try:
                handle = self._agent.make_prepped_xfer(
                    op, local_list, local_idx.astype(np.int32), remote_list,
                    remote_idx.astype(np.int32), notif)
            except Exception as exc:
                self.stats.transfers_failed += 1
                raise self._translate(exc, f"{op} (make_prepped_xfer)", peer) from exc
            try:
                status = self._agent.transfer(handle)
            except Exception as exc:
                self.stats.transfers_failed += 1
                self._quietly("release_xfer_handle", peer, handle.release)
                raise self._translate(exc, f"{op} (post)", peer) from exc
            transfer.post_s = time.perf_counter() - t0
            self.stats.nixl_seconds += transfer.post_s
            if status == "ERR":
                self.stats.transfers_failed += 1
                self._quietly("release_xfer_handle", peer, handle.release)
                raise TransferError(f"{op} of {transfer.num_bytes} bytes from {self.name!r} to peer "
                                    f"{peer!r}: nixl posted it in state ERR")
            transfer.handle = handle
            p.transfers.add(transfer)
            self.stats.transfers_posted += 1
            self.stats.descs_posted += transfer.num_descs
            self.stats.bytes_posted += transfer.num_bytes
            if status == "DONE":
                self._finish(transfer, TransferState.DONE, None)
            return transfer

    def poll(self, transfer: Transfer) -> TransferState:
        """Progress and check a transfer: POSTED, DONE or FAILED (``transfer.error`` says why).

        Raises only for misuse (a released transfer): nixl failures become FAILED.
        """
        with self._lock:
            if transfer.state is not TransferState.POSTED:
                return transfer.state
            if transfer.handle is None:
                raise TransferError(f"poll of a released transfer towards peer {transfer.peer!r}")
            self._check_open("poll")
            t0 = time.perf_counter()
            try:
                status = self._agent.check_xfer_state(transfer.handle)
            except Exception as exc:
                error = self._translate(exc, f"{transfer.op} (poll)", transfer.peer)
                self._finish(transfer, TransferState.FAILED, str(error))
                return transfer.state
            finally:
                self.stats.nixl_seconds += time.perf_counter() - t0
            if status == "DONE":
                self._finish(transfer, TransferState.DONE, None)
            elif status == "ERR":
                self._finish(transfer, TransferState.FAILED,
                             f"{transfer.op} towards peer {transfer.peer!r}: nixl reported ERR")
            return transfer.state

    def wait(self, transfer: Transfer, timeout_s: float) -> TransferState:
        """Poll until DONE or FAILED; TransferError after ``timeout_s`` (the transfer stays POSTED).

        Spins for the first millisecond, then sleeps 50 us between polls.
        """
        start = time.monotonic()
        deadline = start + timeout_s
        while True:
            state = self.poll(transfer)
            if state is not TransferState.POSTED:
                return state
            now = time.monotonic()
            if now >= deadline:
                raise TransferError(f"{transfer.op} towards peer {transfer.peer!r} still in flight "
                                    f"after {timeout_s} s")
            if now - start > 1e-3:
                time.sleep(5e-5)

    def release(self, transfer: Transfer) -> None:
        """Free the nixl handle (idempotent). Releasing a POSTED transfer asks nixl to cancel it;
        TransferError if it cannot."""
        with self._lock:
            handle = transfer.handle
            if handle is None:
                return
            if not self._closed:
                try:
                    handle.release()
                except Exception as exc:
                    raise self._translate(exc, "release_xfer_handle", transfer.peer) from exc
            transfer.handle = None
            if transfer.state is TransferState.POSTED:
                self._finish(transfer, TransferState.FAILED, "released before completion")
            p = self._peers.get(transfer.peer)
            if p is not None:
                p.transfers.discard(transfer)

    # ------------------------------------------------------------------ notifications

    def send_notif(self, peer: str, msg: bytes) -> None:
        """A standalone notification (not bound to a transfer). Dropped silently by nixl if the
        peer died without nixl noticing yet."""
        with self._lock:
            self._check_open("send_notif")
            self._send_notif_locked(self._peer(peer, "send_notif"), bytes(msg))

    def _send_notif_locked(self, p: _Peer, msg: bytes) -> None:
        try:
            self._agent.send_notif(p.name, msg)
        except Exception as exc:
            raise self._translate(exc, "send_notif", p.name) from exc
        self.stats.notifs_sent += 1

    def get_notifs(self) -> list[tuple[str, bytes]]:
        """New notifications as (peer agent name, message), in arrival order per peer.

        Also progresses the agent: call it regularly while notifications are expected.
        """
        with self._lock:
            self._check_open("get_notifs")
            try:
                new = self._agent.get_new_notifs()
            except Exception as exc:
                raise self._translate(exc, "get_new_notifs", None) from exc
            out = [(str(name), bytes(msg)) for name, msgs in new.items() for msg in msgs]
            self.stats.notifs_received += len(out)
            return out

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Tear down in the safe order (see the module docstring). Idempotent, never raises."""
        with self._lock:
            if self._closed:
                return
            for peer in list(self._peers):
                self.remove_peer(peer)
            for handle in (self._local_blocks, self._local_slices):
                if handle is not None:
                    self._quietly("release_dlist_handle", None, handle.release)
            self._local_blocks = self._local_slices = None
            if self._reg is not None:
                self._quietly("deregister_memory", None, self._agent.deregister_memory, self._reg)
                self._reg = None
            self._closed = True
            self._kv = None
            self._agent = None

    def __enter__(self) -> NixlTransferAgent:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise TransferError(f"{op} on closed agent {self.name!r}")
        if self.memory_type == "VRAM" and not getattr(self._cuda_bound, "done", False):
            self._bind_cuda_context()

    def _bind_cuda_context(self) -> None:
        """UCX's CUDA transports use the calling thread's CUDA context, and the transfer thread is not
        the one that allocated the KV buffer: make the GPU's primary context current here, once per thread."""
        torch.cuda.set_device(self.device_id)
        torch.cuda.current_stream(self.device_id).query()  # a runtime call binds the primary context
        self._cuda_bound.done = True

    def _peer(self, peer: str, op: str) -> _Peer:
        p = self._peers.get(peer)
        if p is None:
            raise TransferError(f"{op} from agent {self.name!r}: unknown peer {peer!r} "
                                f"(known: {sorted(self._peers)})")
        if p.disconnected is not None:
            raise PeerDisconnectedError(f"{op} from agent {self.name!r}: peer {peer!r} is "
                                        f"disconnected ({p.disconnected}); remove_peer it", peer)
        return p

    def _finish(self, transfer: Transfer, state: TransferState, error: str | None) -> None:
        if transfer.state is not TransferState.POSTED:
            return
        transfer.state, transfer.error, transfer.finished_at = state, error, time.monotonic()
        if state is TransferState.DONE:
            self.stats.transfers_done += 1
        else:
            self.stats.transfers_failed += 1

    def _translate(self, exc: BaseException, op: str, peer: str | None) -> TransferError:
        """A nixl exception as a TransferError naming the operation and the peer."""
        if isinstance(exc, TransferError):
            return exc
        detail = f"{type(exc).__name__}: {exc}"
        if peer is not None and isinstance(exc, self._disconnect_error):
            p = self._peers.get(peer)
            if p is not None and p.disconnected is None:
                p.disconnected = detail
            return PeerDisconnectedError(f"{op} from agent {self.name!r} to peer {peer!r}: peer "
                                         f"disconnected ({detail})", peer)
        target = f"peer {peer!r}" if peer is not None else "no peer"
        return TransferError(f"nixl {op} on agent {self.name!r} ({target}) failed: {detail}")

    def _quietly(self, op: str, peer: str | None, fn: Any, *args: Any) -> None:
        """Teardown step: log a failure and carry on."""
        try:
            fn(*args)
        except Exception as exc:
            logger.warning("%s", self._translate(exc, op, peer))


__all__ = [
    "AgentStats",
    "KVGeometry",
    "NixlTransferAgent",
    "PeerDisconnectedError",
    "Transfer",
    "TransferState",
    "apply_ucx_environment",
    "count_descriptors",
]
