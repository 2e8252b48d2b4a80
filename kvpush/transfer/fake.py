"""An in-process ``KVAgent`` (kv_agent.py): unit tests of the transfer thread without nixl.

``FakeFabric`` is the "network": a dict of agent name -> ``FakeAgent``. A ``FakeAgent`` implements
the ``KVAgent`` interface on the same ``AgentCore`` as ``NixlTransferAgent``, returns the same
``Transfer`` objects with ``XferStatus`` values and raises the same exceptions:

* ``ValueError`` for bad block / layer ids (out of range, unequal lengths), before anything moves;
* ``TransferError`` for an unknown peer, use after ``close``, or an injected post failure;
* ``PeerDisconnectedError`` (a ``TransferError``) towards a peer marked ``disconnect``-ed or one
  whose agent is closed (that peer is then marked disconnected, as nixl does);
* ``HandshakeError`` for a peer whose geometry does not match, or a peer added twice.

Bytes really move: each agent registers a block-major torch tensor
``kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` and a transfer copies whole
blocks ``kv[b]`` (``write`` / ``read``) or layer slices ``kv[b, l]`` (``*_layers``) between the two
agents' tensors. The notification of a transfer reaches the peer's inbox only after its copy.

When a transfer completes:
    ``delay_completion_polls == 0`` (default): inside the posting call (the copy runs in the
    caller's thread, as nixl does with UCX's CMA); the ``Transfer`` comes back DONE.
    ``delay_completion_polls == n``: the transfer stays POSTED for n ``poll`` calls; the next
    ``poll`` copies, notifies and returns DONE (an in-flight WRITE / READ for n polls).

Fault injection (attributes of an agent, change them any time; each applies to what that agent
initiates):
    ``fail_next_post``        the next n posts raise ``TransferError`` (nothing copied or sent)
    ``fail_next_completion``  the next n posted transfers end FAILED instead of DONE (no copy,
                              no notification)
    ``delay_completion_polls`` see above (captured per transfer when it is posted)
    ``post_delay_s``          each post sleeps that long first (a slow synchronous copy)
    ``drop_notifs``           an ``int`` n: drop this agent's next n outgoing notifications
                              (standalone or bound to a transfer); a ``float`` p in [0, 1]: drop
                              each with probability p (the agent's RNG is seeded from the
                              fabric's seed and the agent's name: reproducible)
    ``disconnect(peer)``      the peer is reported gone: posts and notifications towards it raise
                              ``PeerDisconnectedError``, its in-flight transfers end FAILED at
                              their next poll, ``is_connected`` is False until ``remove_peer``.
    ``finish_delayed()``      every delayed transfer completes at its next poll
    ``in_flight()``           this agent's transfers still POSTED (not released)
    ``notif_polls``           how many times ``get_notifs`` was called (how busily it is polled)

Peers can be added the nixl way (``add_peer(other.metadata(), other.geometry)``, ``metadata`` is
msgpack naming the agent), with ``connect`` (both directions, no handshake), and
``handshake_info`` builds the ``HandshakeInfo`` a transfer thread needs. This module never
imports nixl. One lock per fabric serializes every agent's calls.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from kvpush.config import Role
from kvpush.errors import HandshakeError, TransferError
from kvpush.transfer.descriptors import BlockIds, KVGeometry, XferPlan
from kvpush.transfer.handshake import HandshakeInfo
from kvpush.transfer.kv_agent import (
    AgentCore,
    KVBuffer,
    PeerDisconnectedError,
    PeerEntry,
    Transfer,
    XferStatus,
)

_METADATA_KEY = "kvpush-fake-agent"


class FakeFabric:
    """The in-process network: live agents by name, one lock for all of them."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.agents: dict[str, FakeAgent] = {}
        self.lock = threading.RLock()

    def agent(self, name: str, memory_type: str = "DRAM", device_id: int = 0) -> FakeAgent:
        """A new agent on this fabric (``FakeAgent(name, self, ...)``)."""
        return FakeAgent(name, self, memory_type, device_id)

    def __getitem__(self, name: str) -> FakeAgent:
        with self.lock:
            return self.agents[name]

    def __contains__(self, name: object) -> bool:
        with self.lock:
            return name in self.agents


@dataclass(eq=False)
class _Op:
    """The fake's "nixl handle" of one posted transfer (``Transfer.handle``)."""

    peer: str
    plan: XferPlan
    remaining_polls: int
    fail: bool


class FakeAgent(AgentCore):
    """A drop-in for ``NixlTransferAgent`` on a ``FakeFabric`` (see the module docstring)."""

    def __init__(self, name: str, fabric: FakeFabric, memory_type: str = "DRAM", device_id: int = 0, *,
                 capture_telemetry: bool = False) -> None:
        super().__init__(name, memory_type, device_id, fabric.lock)
        self.fabric = fabric
        # fault injection
        self.fail_next_post = 0
        self.fail_next_completion = 0
        self.delay_completion_polls = 0
        self.post_delay_s = 0.0
        self.drop_notifs: int | float = 0
        self.dropped_notifs = 0
        self.notif_polls = 0  # get_notifs calls: how busily the owner polls
        self.rng = random.Random(f"{fabric.seed}:{name}")
        self._kv: torch.Tensor | None = None  # the block-major buffer, when one was registered
        self._tensors: list[torch.Tensor] = []  # what was registered: that buffer, or one tensor per layer
        self._inbox: list[tuple[str, bytes]] = []
        self._posted: set[Transfer] = set()
        with fabric.lock:
            if name in fabric.agents:
                raise TransferError(f"fake fabric already has a live agent named {name!r}")
            fabric.agents[name] = self

    # ------------------------------------------------------------------ registration, peers

    @property
    def kv(self) -> torch.Tensor | None:
        return self._kv

    def register_kv(self, kv: KVBuffer, geometry: KVGeometry | None = None) -> KVGeometry:
        with self._lock:
            derived, tensors = self._buffer(kv, geometry)
            if not tensors:
                raise ValueError("the fake agent copies bytes between tensors: register the KV tensor(s), "
                                 "not a raw address")
            self._geometry, self._tensors = derived, tensors
            self._kv = kv if isinstance(kv, torch.Tensor) else None
            return derived

    def metadata(self) -> bytes:
        with self._lock:
            self._registered("metadata")
            return msgspec.msgpack.encode({_METADATA_KEY: self.name})

    def add_peer(self, peer_metadata: bytes, peer_geometry: KVGeometry) -> str:
        with self._lock:
            self._check_compatible(peer_geometry)
            try:
                decoded = msgspec.msgpack.decode(bytes(peer_metadata))
                name = decoded[_METADATA_KEY]
                if not isinstance(name, str):
                    raise TypeError(f"agent name is a {type(name).__name__}")
            except (msgspec.DecodeError, KeyError, TypeError) as exc:
                raise TransferError(f"fake add_remote_agent on agent {self.name!r} failed: "
                                    f"bad metadata ({type(exc).__name__}: {exc})") from exc
            self._check_new_peer(name)
            other = self.fabric.agents.get(name)
            actual = other.geometry if other is not None else None
            if actual is not None and (actual.num_blocks, actual.block_bytes) != (
                    peer_geometry.num_blocks, peer_geometry.block_bytes):
                raise HandshakeError(f"geometry given for peer {name!r} ({peer_geometry}) is not the "
                                     f"one it registered ({actual})")
            self._peers[name] = PeerEntry(name, peer_geometry)
            return name

    def connect(self, other: FakeAgent) -> None:
        """Add each agent as the other's peer (no handshake; both must have registered their KV)."""
        assert other.geometry is not None and self.geometry is not None, "register_kv on both first"
        self.add_peer(other.metadata(), other.geometry)
        if other is not self:
            other.add_peer(self.metadata(), self.geometry)

    def handshake_info(self, engine_id: str | None = None, role: Role = Role.PREFILL, *,
                       compat_hash: str = "fake-compat", compat_summary: str = "fake") -> HandshakeInfo:
        """The ``HandshakeInfo`` of this agent's registration (for a ``TransferThread`` or ``AddPeer``)."""
        g = self._geometry
        if g is None:
            raise TransferError(f"agent {self.name!r}: register_kv before handshake_info")
        return HandshakeInfo(
            engine_id=engine_id or self.name, role=role, agent_name=self.name, agent_metadata=self.metadata(),
            base_address=g.base_addr, num_blocks=g.num_blocks, num_layers=g.num_layers,
            block_bytes=g.block_bytes, layer_bytes=g.layer_bytes, memory_type=g.memory_type,
            device_id=g.device_id, compat_hash=compat_hash, compat_summary=compat_summary,
            layer_bases=list(g.layer_bases), block_stride=g.block_stride)

    def disconnect(self, peer: str, reason: str = "injected disconnect") -> None:
        """Fault injection: nixl reported ``peer`` gone (see the module docstring)."""
        with self._lock:
            p = self._peers.get(peer)
            if p is None:
                raise TransferError(f"disconnect: agent {self.name!r} has no peer {peer!r}")
            p.disconnected = reason

    def remove_peer(self, peer: str) -> bool:
        with self._lock:
            p = self._peers.pop(peer, None)
            if p is None or self._closed:
                return False
            for transfer in [t for t in self._posted if t.peer == peer]:
                self._finish(transfer, XferStatus.FAILED, f"peer {peer!r} was removed")
                transfer.handle = None
                self._posted.discard(transfer)
            return True

    # ------------------------------------------------------------------ transfers

    def _post(self, op: str, peer: str, local_ids: BlockIds, remote_ids: BlockIds,
              layers: Sequence[int] | None, notif: bytes) -> Transfer:
        if self.post_delay_s > 0:
            time.sleep(self.post_delay_s)  # outside the lock: the other agents keep running
        return super()._post(op, peer, local_ids, remote_ids, layers, notif)

    def _start(self, p: PeerEntry, plan: XferPlan, notif: bytes, now: float) -> Transfer:
        op, peer = plan.op, p.name
        target = self.fabric.agents.get(peer)
        if target is None or target._closed:
            p.disconnected = f"agent {peer!r} is gone"
            self.stats.transfers_failed += 1
            raise PeerDisconnectedError(f"{op} from agent {self.name!r} to peer {peer!r}: peer "
                                        f"disconnected ({p.disconnected})", peer)
        if self.fail_next_post > 0:
            self.fail_next_post -= 1
            self.stats.transfers_failed += 1
            raise TransferError(f"fake {op} (post) on agent {self.name!r} (peer {peer!r}) failed: "
                                f"injected failure")
        fail = self.fail_next_completion > 0
        if fail:
            self.fail_next_completion -= 1
        handle = _Op(peer, plan, max(0, int(self.delay_completion_polls)), fail)
        transfer = self._new_transfer(peer, plan, notif, now, handle)
        self._posted.add(transfer)
        if handle.remaining_polls == 0 and not fail:
            self._complete(transfer, handle)
        transfer.post_s = time.monotonic() - now
        return transfer

    def poll(self, transfer: Transfer) -> XferStatus:
        with self._lock:
            if transfer.state is not XferStatus.POSTED:
                return transfer.state
            handle = transfer.handle
            if not isinstance(handle, _Op):
                raise TransferError(f"poll of a released transfer towards peer {transfer.peer!r}")
            self._check_open("poll")
            p = self._peers.get(handle.peer)
            if handle.remaining_polls > 0 and p is not None and p.disconnected is None:
                handle.remaining_polls -= 1
                return transfer.state
            self._complete(transfer, handle)
            return transfer.state

    def release(self, transfer: Transfer) -> None:
        with self._lock:
            if transfer.handle is None:
                return
            transfer.handle = None
            if transfer.state is XferStatus.POSTED:
                self._finish(transfer, XferStatus.FAILED, "released before completion")
            self._posted.discard(transfer)

    def in_flight(self) -> list[Transfer]:
        """This agent's transfers still POSTED and not released."""
        with self._lock:
            return [t for t in self._posted if t.state is XferStatus.POSTED]

    def finish_delayed(self) -> None:
        """Every delayed transfer of this agent completes at its next ``poll``."""
        with self._lock:
            for t in self._posted:
                if isinstance(t.handle, _Op):
                    t.handle.remaining_polls = 0

    def _complete(self, transfer: Transfer, handle: _Op) -> None:
        """Lock held. Copy, then notify the peer; or fail without touching anything."""
        p = self._peers.get(handle.peer)
        target = self.fabric.agents.get(handle.peer)
        if handle.fail:
            self._finish(transfer, XferStatus.FAILED, f"{transfer.op} towards peer {handle.peer!r}: "
                                                         f"injected completion failure")
            return
        if p is None or p.disconnected is not None or target is None or target._closed or not target._tensors:
            why = p.disconnected if p is not None and p.disconnected else "peer gone"
            if p is not None and p.disconnected is None:
                p.disconnected = why
            self._finish(transfer, XferStatus.FAILED, f"{transfer.op} towards peer {handle.peer!r}: {why}")
            return
        plan = handle.plan
        if plan.per_layer:
            self._copy_slices(target, plan)
        else:  # whole blocks: both sides block-major
            assert self._kv is not None and target._kv is not None
            self._copy(plan.op, self._units(self._kv), self._units(target._kv), plan.local_idx, plan.remote_idx)
        self._finish(transfer, XferStatus.DONE, None)
        if transfer.notif:
            self._deliver(p, transfer.notif)

    def _copy_slices(self, target: FakeAgent, plan: XferPlan) -> None:
        """Copy (block, layer) slices between two layouts, one layer at a time."""
        assert self._geometry is not None and target._geometry is not None
        local_blocks, layers = self._geometry.slice_of(plan.local_idx)
        remote_blocks, _ = target._geometry.slice_of(plan.remote_idx)
        mine, theirs = self._layer_rows(), target._layer_rows()
        for layer in np.unique(layers).tolist():
            sel = layers == layer
            self._copy(plan.op, mine[layer], theirs[layer], local_blocks[sel], remote_blocks[sel])

    def _layer_rows(self) -> list[torch.Tensor]:
        """Per layer, its slices as bytes: [num_blocks, layer_bytes] (views into the registered memory)."""
        g = self._geometry
        assert g is not None
        if self._kv is not None:
            rows = self._kv.view(-1).view(torch.uint8).view(g.num_blocks, g.num_layers, g.layer_bytes)
            return [rows[:, layer] for layer in range(g.num_layers)]
        return [t.view(-1).view(torch.uint8).view(g.num_blocks, g.layer_bytes) for t in self._tensors]

    @staticmethod
    def _copy(op: str, mine: torch.Tensor, theirs: torch.Tensor, local: np.ndarray, remote: np.ndarray) -> None:
        lidx = torch.from_numpy(local.astype(np.int64)).to(mine.device)
        ridx = torch.from_numpy(remote.astype(np.int64)).to(theirs.device)
        if op == "WRITE":
            theirs[ridx] = mine[lidx].to(theirs.device)
        else:
            mine[lidx] = theirs[ridx].to(mine.device)

    @staticmethod
    def _units(kv: torch.Tensor) -> torch.Tensor:
        """A block-major buffer as bytes, one row per block."""
        return kv.view(-1).view(torch.uint8).view(kv.shape[0], -1)

    # ------------------------------------------------------------------ notifications

    def _deliver(self, p: PeerEntry, msg: bytes) -> None:
        """Lock held. Into the peer's inbox, unless dropped (injected) or the peer is gone (silently)."""
        self.stats.notifs_sent += 1
        if self._drop():
            self.dropped_notifs += 1
            return
        target = self.fabric.agents.get(p.name)
        if target is not None and not target._closed:
            target._inbox.append((self.name, msg))

    def _drop(self) -> bool:
        d = self.drop_notifs
        if isinstance(d, float):
            return d > 0 and self.rng.random() < d
        if d > 0:
            self.drop_notifs = d - 1
            return True
        return False

    def _take_notifs(self) -> list[tuple[str, bytes]]:
        self.notif_polls += 1
        out, self._inbox = self._inbox, []
        return out

    # ------------------------------------------------------------------ teardown

    def _teardown(self) -> None:
        for transfer in list(self._posted):
            self._finish(transfer, XferStatus.FAILED, "agent closed")
            transfer.handle = None
        self._posted.clear()
        self._kv = None
        self._tensors = []
        self._inbox = []
        if self.fabric.agents.get(self.name) is self:
            del self.fabric.agents[self.name]


__all__ = ["FakeAgent", "FakeFabric"]
