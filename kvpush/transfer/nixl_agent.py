"""One NIXL agent for one instance's KV buffer: the only module in kvpush that imports nixl.

What it wraps
-------------
Each instance registers one KV buffer: kvpush's engine a block-major one (docs/design.md section 2)::

    kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]   # contiguous

or one tensor per layer, ``[num_blocks, ...]`` each (vLLM's layout; descriptors.py describes both).
``NixlTransferAgent`` registers its regions once, prepares descriptor lists once (locally at
``register_kv``, per peer at ``add_peer``), and turns block-id lists into prepared transfers:

* ``write`` / ``read``: whole blocks (one descriptor per block ``kv[b]``, ``block_bytes`` each) where
  both sides are block-major, else every layer's slice of each block;
* ``write_layers`` / ``read_layers``: slices ``kv[b, l]`` (``layer_bytes`` each) of chosen layers.

Descriptor merging. Transfers are made with ``make_prepped_xfer`` from the per-block and
per-slice prepared lists, with numpy int32 index arrays (kv_agent.py: ``plan``); nixl merges runs
of consecutive indices on both sides into one descriptor. Measured here (1024 blocks of 4 KiB):
``make_prepped_xfer`` costs 1.5-5 us for 1 to 512 blocks, building merged lists per transfer 9-157
us, and not merging makes a 512-block post 4.6x slower; so merging is left to nixl and
``count_descriptors`` recomputes the count (the tests check it against nixl's ``descCount``).
The wrapper adds about 7 us per transfer to bare nixl (benchmarks/transfer_bw.py).

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

The nixl agent is created with ``NIXL_THREAD_SYNC_STRICT`` anyway and the bookkeeping is guarded
by one lock (held for a whole post), so a stray call from another thread is serialized. With the
default sync mode (NONE), posting from one thread while another polled notifications hung in 2
of 2 runs here; STRICT cost the same single-threaded (about 5 us for a 4 KiB write + notif).

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

Bad input raises before any nixl call, as kv_agent.py says for every agent.

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
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvpush.config import apply_ucx_environment
from kvpush.errors import TransferError
from kvpush.transfer.descriptors import KVGeometry, XferPlan
from kvpush.transfer.kv_agent import (
    AgentCore,
    KVBuffer,
    PeerDisconnectedError,
    PeerEntry,
    Transfer,
    XferStatus,
)

logger = logging.getLogger(__name__)

_LOCAL = "NIXL_INIT_AGENT"  # nixl's name for the local side of a prepared list


@dataclass(eq=False)
class _NixlPeer(PeerEntry):
    blocks: Any = None  # prepared remote list, one descriptor per block (None: blocks not contiguous)
    slices: Any = None  # prepared remote list, one descriptor per (block, layer)
    transfers: set[Transfer] = field(default_factory=set)


def _load_nixl() -> tuple[Any, Any]:
    try:
        import nixl._api as api
        import nixl._bindings as bindings
    except ImportError as exc:
        raise TransferError("nixl is not installed: pip install --no-deps nixl==1.5.1 "
                            "nixl-cu12==1.5.1 (docs/design.md section 4)") from exc
    return api, bindings


def _dlist(geometry: KVGeometry, per_layer: bool) -> np.ndarray | None:
    """Nx3 uint64 (address, length, device id): one row per slice (block, layer) in the layout's index
    order, or one per block; None for blocks of a layout whose blocks are not contiguous."""
    rows2 = geometry.slice_rows() if per_layer else geometry.block_rows()
    if rows2 is None:
        return None
    rows = np.empty((rows2.shape[0], 3), dtype=np.uint64)
    rows[:, :2] = rows2
    rows[:, 2] = geometry.device_id
    return rows


def _prep(agent: Any, name: str, geometry: KVGeometry, per_layer: bool) -> Any:
    """A prepared descriptor list (None where the layout has no whole-block list)."""
    rows = _dlist(geometry, per_layer)
    return None if rows is None else agent.prep_xfer_dlist(name, rows, geometry.memory_type)


class NixlTransferAgent(AgentCore):
    """A nixl agent (UCX backend, no progress thread) that moves blocks of one KV buffer.

    Typical use on one transfer thread: ``register_kv(kv)`` once; exchange ``metadata()`` and the
    geometry with the peer (handshake); ``peer = add_peer(...)``; ``t = write(peer, [4, 5, 6],
    [10, 11, 12], notif)`` (1 descriptor); ``poll(t)`` until not POSTED; ``release(t)``.
    """

    def __init__(self, name: str, memory_type: str = "DRAM", device_id: int = 0, *,
                 capture_telemetry: bool = False) -> None:
        super().__init__(name, memory_type, device_id, threading.RLock())
        self._kv: list[torch.Tensor] = []  # keeps the registered tensors' storage alive
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

    def register_kv(self, kv: KVBuffer, geometry: KVGeometry | None = None) -> KVGeometry:
        """Register the KV buffer once and prepare the local descriptor lists.

        ``kv`` is the tensor ``kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``
        (contiguous; DRAM on CPU, VRAM on CUDA), one tensor per layer (each ``[num_blocks, ...]``),
        or a raw address with ``geometry``. Each of the layout's regions is registered.
        """
        with self._lock:
            geometry, tensors = self._buffer(kv, geometry)
            regions = [(addr, length, geometry.device_id, "") for addr, length in geometry.regions()]
            try:
                reg = self._agent.register_memory(regions, geometry.memory_type)
            except Exception as exc:
                raise self._translate(exc, "register_memory", None) from exc
            try:
                local_blocks = _prep(self._agent, _LOCAL, geometry, False)
                try:
                    local_slices = _prep(self._agent, _LOCAL, geometry, True)
                except Exception:
                    if local_blocks is not None:
                        local_blocks.release()
                    raise
            except Exception as exc:
                self._quietly("deregister_memory", None, self._agent.deregister_memory, reg)
                raise self._translate(exc, "prep_xfer_dlist (local)", None) from exc
            self._reg, self._kv, self._geometry = reg, tensors, geometry
            self._local_blocks, self._local_slices = local_blocks, local_slices
            return geometry

    def metadata(self) -> bytes:
        """This agent's nixl metadata (connection info and registered memory) for the peer."""
        with self._lock:
            self._registered("metadata")
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
            self._check_compatible(peer_geometry)
            try:
                loaded = self._agent.add_remote_agent(bytes(peer_metadata))
                name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)  # 1.5.1: bytes
            except Exception as exc:
                raise self._translate(exc, "add_remote_agent", None) from exc
            self._check_new_peer(name)
            prepared: list[Any] = []
            try:
                for per_layer in (False, True):
                    prepared.append(_prep(self._agent, name, peer_geometry, per_layer))
            except Exception as exc:
                for handle in prepared:
                    if handle is not None:
                        self._quietly("release_dlist_handle", name, handle.release)
                self._quietly("remove_remote_agent", name, self._agent.remove_remote_agent, name)
                raise self._translate(exc, "prep_xfer_dlist (remote)", name) from exc
            self._peers[name] = _NixlPeer(name, peer_geometry, blocks=prepared[0], slices=prepared[1])
            return name

    def remove_peer(self, peer: str) -> bool:
        """Release the peer's transfers and lists, then forget it; False if it was unknown.

        Its transfers still POSTED become FAILED. Best-effort: failures are logged.
        """
        with self._lock:
            p = self._peers.pop(peer, None)
            if p is None or self._closed:
                return False
            for transfer in list(p.transfers):
                self._finish(transfer, XferStatus.FAILED, f"peer {peer!r} was removed")
                if transfer.handle is not None:
                    self._quietly("release_xfer_handle", peer, transfer.handle.release)
                    transfer.handle = None
            p.transfers.clear()
            for handle in (p.blocks, p.slices):
                if handle is not None:
                    self._quietly("release_dlist_handle", peer, handle.release)
            self._quietly("remove_remote_agent", peer, self._agent.remove_remote_agent, peer)
            return True

    # ------------------------------------------------------------------ transfers

    def _start(self, p: _NixlPeer, plan: XferPlan, notif: bytes, now: float) -> Transfer:
        op, peer = plan.op, p.name
        local_list = self._local_slices if plan.per_layer else self._local_blocks
        remote_list = p.slices if plan.per_layer else p.blocks
        t0 = time.perf_counter()
        try:
            handle = self._agent.make_prepped_xfer(
                op, local_list, plan.local_idx.astype(np.int32), remote_list,
                plan.remote_idx.astype(np.int32), notif)
        except Exception as exc:
            self.stats.transfers_failed += 1
            raise self._translate(exc, f"{op} (make_prepped_xfer)", peer) from exc
        try:
            status = self._agent.transfer(handle)
        except Exception as exc:
            self.stats.transfers_failed += 1
            self._quietly("release_xfer_handle", peer, handle.release)
            raise self._translate(exc, f"{op} (post)", peer) from exc
        post_s = time.perf_counter() - t0
        self.stats.nixl_seconds += post_s
        if status == "ERR":
            self.stats.transfers_failed += 1
            self._quietly("release_xfer_handle", peer, handle.release)
            raise TransferError(f"{op} of {plan.num_bytes} bytes from {self.name!r} to peer "
                                f"{peer!r}: nixl posted it in state ERR")
        transfer = self._new_transfer(peer, plan, notif, now, handle)
        transfer.post_s = post_s
        p.transfers.add(transfer)
        if status == "DONE":
            self._finish(transfer, XferStatus.DONE, None)
        return transfer

    def poll(self, transfer: Transfer) -> XferStatus:
        """Progress and check a transfer: POSTED, DONE or FAILED (``transfer.error`` says why).

        Raises only for misuse (a released transfer): nixl failures become FAILED.
        """
        with self._lock:
            if transfer.state is not XferStatus.POSTED:
                return transfer.state
            if transfer.handle is None:
                raise TransferError(f"poll of a released transfer towards peer {transfer.peer!r}")
            self._check_open("poll")
            t0 = time.perf_counter()
            try:
                status = self._agent.check_xfer_state(transfer.handle)
            except Exception as exc:
                error = self._translate(exc, f"{transfer.op} (poll)", transfer.peer)
                self._finish(transfer, XferStatus.FAILED, str(error))
                return transfer.state
            finally:
                self.stats.nixl_seconds += time.perf_counter() - t0
            if status == "DONE":
                self._finish(transfer, XferStatus.DONE, None)
            elif status == "ERR":
                self._finish(transfer, XferStatus.FAILED,
                             f"{transfer.op} towards peer {transfer.peer!r}: nixl reported ERR")
            return transfer.state

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
            if transfer.state is XferStatus.POSTED:
                self._finish(transfer, XferStatus.FAILED, "released before completion")
            p = self._peers.get(transfer.peer)
            if p is not None:
                p.transfers.discard(transfer)

    # ------------------------------------------------------------------ notifications

    def _deliver(self, p: _NixlPeer, msg: bytes) -> None:
        """Dropped silently by nixl if the peer died without nixl noticing yet."""
        try:
            self._agent.send_notif(p.name, msg)
        except Exception as exc:
            raise self._translate(exc, "send_notif", p.name) from exc
        self.stats.notifs_sent += 1

    def _take_notifs(self) -> list[tuple[str, bytes]]:
        try:
            new = self._agent.get_new_notifs()
        except Exception as exc:
            raise self._translate(exc, "get_new_notifs", None) from exc
        return [(str(name), bytes(msg)) for name, msgs in new.items() for msg in msgs]

    # ------------------------------------------------------------------ teardown

    def _teardown(self) -> None:
        """The local prepared lists, then ``deregister_memory``; the agent is dropped last."""
        for handle in (self._local_blocks, self._local_slices):
            if handle is not None:
                self._quietly("release_dlist_handle", None, handle.release)
        self._local_blocks = self._local_slices = None
        if self._reg is not None:
            self._quietly("deregister_memory", None, self._agent.deregister_memory, self._reg)
            self._reg = None
        self._kv = []
        self._agent = None

    # ------------------------------------------------------------------ helpers

    def _check_open(self, op: str) -> None:
        super()._check_open(op)
        if self.memory_type == "VRAM" and not getattr(self._cuda_bound, "done", False):
            self._bind_cuda_context()

    def _bind_cuda_context(self) -> None:
        """UCX's CUDA transports use the calling thread's CUDA context, and the transfer thread is not
        the one that allocated the KV buffer: make the GPU's primary context current here, once per thread."""
        torch.cuda.set_device(self.device_id)
        torch.cuda.current_stream(self.device_id).query()  # a runtime call binds the primary context
        self._cuda_bound.done = True

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

