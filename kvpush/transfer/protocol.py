"""Control messages between prefill (P) and decode (D) instances, and their wire format.

Every request that crosses P and D carries a ``transfer_id`` the proxy mints per dispatch
(``new_transfer_id``; never reused, not even for a retry). Two kinds of messages exist:

*Leg parameters* travel over HTTP as the request's ``kv_transfer_params`` (kvpush/protocol/kv_params.py).
*KV-channel messages* (this module) travel between P and D as NIXL notifications (msgpack, one version byte first, at most ``MAX_MESSAGE_BYTES``; see ``encode`` / ``decode``).
The lifecycle of one transfer, as the messages drive it (docs/design.md section 3):

Push::

    D: admit, allocate blocks ----- PushReg ----------------> P: REGISTERED (or MATCHED if prefilled)
    P: prefill done, match, post WRITE(notif=Done) ---------> D: REGISTERED -> DONE, decode
    D: full prefix hit, no KV needed --- Release -----------> P: DONE, free blocks
    D: deadline missed / cancelled ----- Abort -------------> P: FAILED, free blocks
    P: WRITE failed / lease expired ---- Fail(reason) ------> D: FAILED, recompute or error

Pull::

    P: prefill done, hold blocks under a lease, PrefillResult -> proxy -> D (DecodeLegParams)
    D: READ P's blocks (LeaseRenew if the lease runs short) ---- ReadDone --> P: DONE, free blocks
    D: READ failed --------------------------------------------- Fail -----> P: FAILED, free blocks

Layer-wise push: P writes each layer as the forward pass finishes it, then ``Commit`` (like
Done) tells D that every layer of every block it registered has landed.

The sender of ``Fail`` or ``Abort`` guarantees that it has no operation of its own in flight on the
transfer when it sends it; that is what lets the receiver release memory without waiting for a
timeout.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvpush.errors import ProtocolError
from kvpush.protocol.kv_params import (
    PROTOCOL_VERSION,
    check_blocks,
    check_engine_id,
    check_time,
    check_transfer_id,
    new_transfer_id,
    require,
)

MAX_MESSAGE_BYTES = 256 * 1024
"""Largest encoded KV-channel message (a PushReg of ~40k blocks fits)."""
MAX_REASON_CHARS = 1024

__all__ = ["PROTOCOL_VERSION", "ProtocolError", "new_transfer_id"]  # for users of the messages


class _TransferMessage(msgspec.Struct, frozen=True, array_like=True):
    """A message about one transfer and nothing else (its subclasses are tagged by their name)."""

    transfer_id: str

    def __post_init__(self) -> None:
        check_transfer_id(self.transfer_id)


class PushReg(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """D -> P (push): D's blocks for the request. P writes only the blocks after
    ``num_prefix_tokens`` (tokens D already holds from its prefix cache)."""

    transfer_id: str
    decode_engine_id: str
    block_ids: list[int]
    num_prefix_tokens: int
    num_tokens: int
    deadline: float

    def __post_init__(self) -> None:
        check_transfer_id(self.transfer_id)
        check_engine_id(self.decode_engine_id, "decode_engine_id")
        check_blocks(self.block_ids, "block_ids")
        require(len(self.block_ids) > 0, "PushReg needs at least one block")
        require(self.num_tokens >= 1, "num_tokens must be at least 1")
        require(0 <= self.num_prefix_tokens <= self.num_tokens,
                "num_prefix_tokens must be in [0, num_tokens]")
        check_time(self.deadline, "deadline")


class _Landed(msgspec.Struct, frozen=True, array_like=True):
    """P -> D: all of D's KV has landed; P's first token rides along (first-token from-prefill)."""

    transfer_id: str
    first_token_id: int | None = None
    # P's wall-clock timestamps (unix seconds) for the handover breakdown; informational only.
    reg_received: float | None = None
    write_posted: float | None = None

    def __post_init__(self) -> None:
        check_transfer_id(self.transfer_id)
        require(self.first_token_id is None or 0 <= self.first_token_id < 2**32,
                "first_token_id must be in [0, 2**32)")


class Done(_Landed, tag=True, frozen=True, array_like=True):
    """P -> D (push): the WRITE completed; the notification of the WRITE itself."""


class Fail(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """Either way: the transfer failed; the sender has nothing in flight on it."""

    transfer_id: str
    reason: str

    def __post_init__(self) -> None:
        check_transfer_id(self.transfer_id)
        require(len(self.reason) <= MAX_REASON_CHARS, f"reason longer than {MAX_REASON_CHARS} characters")

    @classmethod
    def create(cls, transfer_id: str, reason: str) -> Fail:
        """A Fail whose reason is cut to ``MAX_REASON_CHARS``."""
        return cls(transfer_id, reason[:MAX_REASON_CHARS])


class Abort(_TransferMessage, tag=True, frozen=True, array_like=True):
    """Either way: the sender gave up on the transfer (cancelled, deadline); nothing of its own in flight."""


class Release(_TransferMessage, tag=True, frozen=True, array_like=True):
    """D -> P (push): D had a full prefix hit and needs no KV; P may free its blocks."""


class LeaseRenew(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """D -> P: keep the blocks of a finished prefill until ``until`` (unix time); P may cap it."""

    transfer_id: str
    until: float

    def __post_init__(self) -> None:
        check_transfer_id(self.transfer_id)
        check_time(self.until, "until")


class ReadDone(_TransferMessage, tag=True, frozen=True, array_like=True):
    """D -> P (pull): D's READ of P's blocks completed; P frees them."""


class Commit(_Landed, tag=True, frozen=True, array_like=True):
    """P -> D (layer-wise push): every layer of every block D registered has landed; like Done."""


Message = PushReg | Done | Fail | Abort | Release | LeaseRenew | ReadDone | Commit
MESSAGE_TYPES: tuple[type[Any], ...] = (PushReg, Done, Fail, Abort, Release, LeaseRenew, ReadDone, Commit)

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)  # type: ignore[arg-type]


def encode(msg: Message) -> bytes:
    """One version byte, then the msgpack-encoded tagged message."""
    if not isinstance(msg, MESSAGE_TYPES):
        raise ProtocolError(f"not a KV-channel message: {type(msg).__name__}")
    buf = bytearray([PROTOCOL_VERSION])
    _encoder.encode_into(msg, buf, 1)
    if len(buf) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{type(msg).__name__} is {len(buf)} bytes, more than {MAX_MESSAGE_BYTES}")
    return bytes(buf)


def decode(data: bytes) -> Message:
    """Parse ``encode``'s output. Anything wrong is a ProtocolError, never another exception."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"message must be bytes, got {type(data).__name__}")
    size = len(data)
    if size > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message is {size} bytes, more than {MAX_MESSAGE_BYTES}")
    if size < 2:
        raise ProtocolError(f"message is {size} bytes, too short")
    version = data[0]
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version mismatch: message is version {version}, "
            f"this instance speaks version {PROTOCOL_VERSION}")
    try:
        return _decoder.decode(memoryview(data)[1:])
    except ProtocolError:
        raise
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, OverflowError,
            RecursionError) as e:
        raise ProtocolError(f"malformed message: {e}") from e
