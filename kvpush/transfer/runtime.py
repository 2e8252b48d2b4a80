"""Everything a prefill or decode instance needs to move KV: the NIXL agent with the KV buffer
registered, this instance's handshake info, the transfer thread and the side channel.

Lifecycle: start() (agent created, buffer registered, threads started) -> running -> shutdown()
(side channel closed, transfer thread stopped, agent torn down by that thread).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import socket
import uuid
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import torch

from kvpush.config import KVMode, Role, TransferConfig
from kvpush.engine.kv_connector import KVConnector
from kvpush.errors import InvalidRequestError
from kvpush.protocol.kv_params import DecodeLegParams, PrefillLegParams, RequestLegParams
from kvpush.transfer.doorbell import Doorbell
from kvpush.transfer.events import Event
from kvpush.transfer.handshake import HandshakeInfo, compat_hash, compat_summary
from kvpush.transfer.nixl_agent import NixlTransferAgent
from kvpush.transfer.side_channel import SideChannelServer
from kvpush.transfer.stats import TransferStats
from kvpush.transfer.thread import TransferThread


def model_identity(model_dir: str) -> str:
    """The model as far as KV compatibility goes: its config.json (not its path), hashed."""
    try:
        with open(os.path.join(model_dir, "config.json"), "rb") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return model_dir
    canonical = json.dumps({k: v for k, v in config.items() if not k.startswith("_")}, sort_keys=True)
    return f"{config.get('architectures', ['?'])[0]}:{hashlib.sha256(canonical.encode()).hexdigest()[:16]}"


def new_engine_id(role: Role) -> str:
    return f"{role.value}-{uuid.uuid4().hex[:12]}"


class KVShape(Protocol):
    """What the compat hash needs of a KV cache (kvpush's KVLayout has it; the vLLM connector builds one)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def block_size(self) -> int: ...


class TransferRuntime:
    """``kv``: kvpush's block-major buffer or one tensor per layer (vLLM's), as ``register_kv`` takes it."""

    def __init__(self, role: Role, config: TransferConfig, kv: torch.Tensor | Sequence[torch.Tensor],
                 layout: KVShape, model_id: str, dtype: str, wake: Callable[[], None], kv_origin: str = "") -> None:
        self.role = role
        self.config = config
        self.engine_id = new_engine_id(role)
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._wake = wake
        first = kv if isinstance(kv, torch.Tensor) else kv[0]
        self.agent = NixlTransferAgent(self.engine_id, memory_type="VRAM" if first.is_cuda else "DRAM",
                                       device_id=first.device.index or 0)
        geometry = self.agent.register_kv(kv if isinstance(kv, torch.Tensor) else list(kv))
        # The compat hash covers the transfer mode, so push and pull instances never pair up.
        # kv_origin: "" for a model's own KV, else what emulated it (an emulated instance never pairs with a real one)
        model = " ".join(filter(None, (model_identity(model_id), kv_origin)))
        fields = (model, dtype, layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size,
                  config.kv_mode.value)
        self.side_channel = SideChannelServer(config.kv_host, config.kv_port, self._on_handshake,
                                              on_reject=self._count_rejected)
        self.doorbell = Doorbell(self.side_channel.host)
        self.info = HandshakeInfo(
            engine_id=self.engine_id, role=role, agent_name=self.engine_id, agent_metadata=self.agent.metadata(),
            base_address=geometry.base_addr, num_blocks=geometry.num_blocks, num_layers=geometry.num_layers,
            block_bytes=geometry.block_bytes, layer_bytes=geometry.layer_bytes,
            memory_type=geometry.memory_type, device_id=geometry.device_id,
            layer_bases=list(geometry.layer_bases), block_stride=geometry.block_stride,
            compat_hash=compat_hash(*fields), compat_summary=compat_summary(*fields),
            doorbell=f"{self._advertised_host()}:{self.doorbell.port}")
        self.thread = TransferThread(role, self.agent, self.info, config.kv_secret, self._emit, layout.block_size,
                                     faults=config.faults, layerwise=_layerwise(config.kv_mode),
                                     quarantine_s=config.kv_quarantine_s, tombstone_s=config.kv_tombstone_s,
                                     doorbell=self.doorbell,
                                     writes_per_peer=config.kv_writes_per_peer)

    @property
    def kv_address(self) -> str:
        """host:port that peers connect to (published by /v1/kv_info)."""
        return f"{self.kv_host}:{self.kv_port}"

    @property
    def kv_host(self) -> str:
        return self._advertised_host()

    @property
    def kv_port(self) -> int:
        return self.side_channel.port

    def _advertised_host(self) -> str:
        """Where peers reach this instance's side channel and doorbell."""
        host = self.config.kv_advertise_host or self.side_channel.host
        return socket.getfqdn() if host in ("0.0.0.0", "::", "") else host

    @property
    def mode(self) -> KVMode:
        return self.config.kv_mode

    def start(self) -> TransferRuntime:
        self.thread.start()
        self.side_channel.start()
        return self

    def _count_rejected(self) -> None:
        self.thread.metrics.handshake_failures += 1

    def _on_handshake(self, frame: bytes) -> bytes:
        return self.thread.handle_handshake(frame)

    def _emit(self, event: Event) -> None:
        self.events.put(event)
        self._wake()

    def post(self, event: Event) -> None:
        """The engine thread queues an event for its own next poll."""
        self.events.put(event)

    def drain_events(self) -> list[Event]:
        out: list[Event] = []
        try:
            while True:
                out.append(self.events.get_nowait())
        except queue.Empty:
            return out

    def shutdown(self) -> None:
        """Stop the side channel and the transfer thread; also for a runtime never started."""
        self.side_channel.close()
        self.thread.stop()
        if self.thread.ident is not None:
            self.thread.join(timeout=10)  # the thread closes its agent and doorbell as it ends
        else:
            self.thread.agent.close()
            self.thread.doorbell.close()


def _layerwise(mode: KVMode) -> bool | None:
    """P's writer: every transfer layer by layer (True), none (False), or as each leg says (None: auto)."""
    return None if mode is KVMode.AUTO else mode is KVMode.PUSH_LAYERWISE


_LegT = TypeVar("_LegT", PrefillLegParams, DecodeLegParams)


class RuntimeConnector(KVConnector):
    """What the prefill and decode connectors share: a TransferRuntime and its events, and what
    the engine-core process asks of a connector besides the engine's interface (address, id,
    stats, shutdown)."""

    def __init__(self, runtime: TransferRuntime, config: TransferConfig) -> None:
        self.runtime = runtime
        self.config = config

    def leg(self, params: RequestLegParams | None, cls: type[_LegT]) -> _LegT:
        """The leg's parameters, checked to be for this role and mode; InvalidRequestError if not."""
        role = self.runtime.role.value
        if params is None:
            raise InvalidRequestError(f"a {role} instance needs kv_transfer_params from the proxy",
                                      param="kv_transfer_params")
        if not isinstance(params, cls):
            raise InvalidRequestError(f"a {role} instance takes {cls.__name__}, got {type(params).__name__}",
                                      param="kv_transfer_params")
        if not self.runtime.mode.accepts(params.mode):
            raise InvalidRequestError(f"kv_transfer_params mode {params.mode.value!r} but this instance runs "
                                      f"--kv-mode {self.runtime.mode.value}", param="kv_transfer_params")
        return params

    @property
    def kv_address(self) -> str:
        return self.runtime.kv_address

    @property
    def engine_id(self) -> str:
        return self.runtime.engine_id

    def has_events(self) -> bool:
        return not self.runtime.events.empty()

    def stats(self) -> TransferStats:
        return self.runtime.thread.stats()

    def shutdown(self) -> None:
        self.runtime.shutdown()
