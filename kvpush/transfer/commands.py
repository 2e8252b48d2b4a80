"""Commands to the transfer thread of one process (a queue, not a wire).

From the engine thread: Hold, LayersDone (prefill side); Register, Read (decode side); SendNotif
and Cancel (either). From the side-channel thread: AddPeer. The thread answers with events
(events.py). Block ids are always this instance's own; remote ids travel inside the ledger and PushReg.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from kvpush.transfer import protocol as pr
from kvpush.transfer.handshake import HandshakeInfo


@dataclass(frozen=True)
class PeerAddr:
    engine_id: str
    host: str
    port: int


@dataclass(frozen=True)
class LayersDone:
    """P (layer-wise): the forward pass finished `layer` for these (transfer, block indices, block ids)."""

    layer: int
    items: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]


@dataclass(frozen=True)
class Hold:
    """P: prefill finished; the transfer thread owns these blocks until it emits FreeBlocks for them."""

    transfer_id: str
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token_id: int | None
    lease_deadline: float
    decode_engine_id: str | None


@dataclass(frozen=True)
class Register:
    """D (push): handshake with P if needed, record the transfer, send PushReg."""

    transfer_id: str
    request_id: str
    peer: PeerAddr
    block_ids: tuple[int, ...]
    num_prefix_tokens: int
    num_tokens: int
    deadline: float


@dataclass(frozen=True)
class Read:
    """D (pull): handshake with P if needed, READ P's blocks into ours, notify P when done."""

    transfer_id: str
    request_id: str
    peer: PeerAddr
    block_ids: tuple[int, ...]  # ours
    remote_ids: tuple[int, ...]
    num_tokens: int
    deadline: float
    lease_expiry: float | None = None  # P frees its blocks then: never READ after it


@dataclass(frozen=True)
class SendNotif:
    """Send a control message to a peer (handshaking first if needed)."""

    peer: PeerAddr
    message: pr.Message


@dataclass(frozen=True)
class Cancel:
    """Either side: the request of this transfer is gone (abort, error); tell the peer."""

    transfer_id: str
    reason: str
    peer_engine_id: str | None = None


@dataclass(frozen=True)
class AddPeer:
    """A peer's verified handshake (side-channel thread): add it; `done` gets its agent name."""

    info: HandshakeInfo
    done: Future


Command = LayersDone | Hold | Register | Read | SendNotif | Cancel | AddPeer
