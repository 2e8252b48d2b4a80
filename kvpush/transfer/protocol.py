"""Control messages between prefill (P) and decode (D) instances, and their wire format.

Every request that crosses P and D carries a ``transfer_id`` the proxy mints per dispatch
(``new_transfer_id``; never reused, not even for a retry). Two kinds of messages exist:

*Leg parameters* travel over HTTP as the request's ``kv_transfer_params`` (JSON objects, see
``params_to_dict`` / ``params_from_dict``):

    PrefillLegParams   proxy -> P   "prefill this, the KV goes to a remote decoder"
    PrefillResult      P -> proxy   where the KV is (pull: P's blocks, held under a lease)
    DecodeLegParams    proxy -> D   "decode this, the KV comes from that prefill instance"

*KV-channel messages* travel between P and D as NIXL notifications or over the side channel
(msgpack, one version byte first, at most ``MAX_MESSAGE_BYTES``; see ``encode`` / ``decode``).
The lifecycle of one transfer, as the messages drive it (DESIGN.md section 3):

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

Layer-wise push (later): ``Commit`` tells D that a prefix of layers is complete.

The sender of ``Fail`` or ``Abort`` guarantees that it has no operation of its own in flight on the
transfer when it sends it; that is what lets the receiver release memory without waiting for a
timeout.
"""

from __future__ import annotations

import math
import re
import uuid
from typing import Any, TypeVar

import msgspec

from kvpush.config import FirstToken, KVMode
from kvpush.errors import TransferError

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change of a message or of the handshake."""

MAX_MESSAGE_BYTES = 256 * 1024
"""Largest encoded KV-channel message (a PushReg of ~40k blocks fits)."""

MAX_REASON_CHARS = 1024
MAX_ID_CHARS = 128
_ID_RE = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_ID_CHARS}}}")


class ProtocolError(TransferError):
    """A control message is malformed, oversized, or from another protocol version."""


def new_transfer_id() -> str:
    """A fresh transfer id: 128 random bits, hex. Never reused."""
    return uuid.uuid4().hex


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ProtocolError(message)


def _check_transfer_id(value: str) -> None:
    _require(isinstance(value, str) and _ID_RE.fullmatch(value) is not None,
             f"transfer_id must be 1-{MAX_ID_CHARS} characters of [A-Za-z0-9._-], got {value!r:.80}")


def _check_engine_id(value: str, name: str) -> None:
    _require(isinstance(value, str) and 0 < len(value) <= 256, f"{name} must be 1-256 characters")


def _check_time(value: float, name: str) -> None:
    _require(math.isfinite(value) and value >= 0, f"{name} must be a finite unix time, got {value!r}")


def _check_blocks(block_ids: list[int], name: str) -> None:
    _require(all(0 <= b < 2**32 for b in block_ids), f"{name} must be block ids in [0, 2**32)")


def _check_port(port: int) -> None:
    _require(0 < port < 65536, f"kv port must be in [1, 65535], got {port}")


# --- leg parameters (HTTP, JSON) ------------------------------------------------------------


class PrefillLegParams(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """proxy -> P. Push: ``decode_engine_id`` names the D whose PushReg P must accept; None (legs from
    routers built for vLLM, which do not know D's engine id) accepts the first D that registers."""

    transfer_id: str
    mode: KVMode
    do_remote_decode: bool = True
    decode_engine_id: str | None = None
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        _check_transfer_id(self.transfer_id)
        if self.decode_engine_id is not None:
            _check_engine_id(self.decode_engine_id, "decode_engine_id")


class PrefillResult(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """P -> proxy after prefill. Pull: P's blocks to READ, held until ``lease_expiry``.

    ``first_token_id`` is the token P sampled from its prefill logits (first-token from-prefill).
    In push mode ``block_ids`` is empty and ``lease_expiry`` None: the KV is on its way to D.
    """

    transfer_id: str
    mode: KVMode
    prefill_engine_id: str
    prefill_kv_host: str
    prefill_kv_port: int
    num_tokens: int
    block_ids: list[int] = []
    lease_expiry: float | None = None
    first_token_id: int | None = None
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        _check_transfer_id(self.transfer_id)
        _check_engine_id(self.prefill_engine_id, "prefill_engine_id")
        _check_port(self.prefill_kv_port)
        _require(self.num_tokens >= 1, "num_tokens must be at least 1")
        _check_blocks(self.block_ids, "block_ids")
        if self.mode is KVMode.PULL:
            _require(len(self.block_ids) > 0, "pull mode needs block_ids")
            _require(self.lease_expiry is not None, "pull mode needs lease_expiry")
        if self.lease_expiry is not None:
            _check_time(self.lease_expiry, "lease_expiry")

    def to_decode_leg(self, first_token: FirstToken = FirstToken.RECOMPUTE) -> DecodeLegParams:
        """What the proxy forwards to D in pull mode."""
        return DecodeLegParams(
            transfer_id=self.transfer_id, mode=self.mode, prefill_engine_id=self.prefill_engine_id,
            prefill_kv_host=self.prefill_kv_host, prefill_kv_port=self.prefill_kv_port,
            first_token=first_token, block_ids=list(self.block_ids) if self.mode is KVMode.PULL else None,
            num_tokens=self.num_tokens, lease_expiry=self.lease_expiry, first_token_id=self.first_token_id,
        )


class DecodeLegParams(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """proxy -> D. Push: sent together with P's leg, D registers its blocks with P.

    Pull: carries P's ``PrefillResult`` (``block_ids``, ``num_tokens``, ``lease_expiry``).
    ``first_token`` says whether D recomputes the last prompt position or uses P's token.
    """

    transfer_id: str
    mode: KVMode
    prefill_engine_id: str
    prefill_kv_host: str
    prefill_kv_port: int
    do_remote_prefill: bool = True
    first_token: FirstToken = FirstToken.RECOMPUTE
    block_ids: list[int] | None = None
    num_tokens: int | None = None
    lease_expiry: float | None = None
    first_token_id: int | None = None
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        _check_transfer_id(self.transfer_id)
        _check_engine_id(self.prefill_engine_id, "prefill_engine_id")
        _check_port(self.prefill_kv_port)
        if self.block_ids is not None:
            _check_blocks(self.block_ids, "block_ids")
        if self.lease_expiry is not None:
            _check_time(self.lease_expiry, "lease_expiry")
        if self.mode is KVMode.PULL:
            _require(bool(self.block_ids) and self.num_tokens is not None and self.lease_expiry is not None,
                     "pull mode needs P's block_ids, num_tokens and lease_expiry")
            if self.first_token is FirstToken.FROM_PREFILL:
                _require(self.first_token_id is not None, "first_token from-prefill needs first_token_id")
        if self.num_tokens is not None:
            _require(self.num_tokens >= 1, "num_tokens must be at least 1")


LegParams = PrefillLegParams | PrefillResult | DecodeLegParams
_ParamsT = TypeVar("_ParamsT", bound=LegParams)


def params_to_dict(params: LegParams) -> dict[str, Any]:
    """JSON-ready dict for ``kv_transfer_params`` (carries its ``type`` tag and the version)."""
    out: dict[str, Any] = msgspec.to_builtins(params)
    return out


def params_from_dict(data: Any, cls: type[_ParamsT]) -> _ParamsT:
    """Parse ``kv_transfer_params`` as ``cls``; any problem is a ProtocolError."""
    if isinstance(data, dict):
        version = data.get("protocol_version", PROTOCOL_VERSION)
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"kv_transfer_params protocol version mismatch: got {version!r}, "
                f"this instance speaks {PROTOCOL_VERSION}")
    try:
        return msgspec.convert(data, cls)
    except (msgspec.ValidationError, ValueError, TypeError) as e:
        raise ProtocolError(f"invalid kv_transfer_params for {cls.__name__}: {e}") from e


# --- KV-channel messages (msgpack, version byte) ----------------------------------------------


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
        _check_transfer_id(self.transfer_id)
        _check_engine_id(self.decode_engine_id, "decode_engine_id")
        _check_blocks(self.block_ids, "block_ids")
        _require(len(self.block_ids) > 0, "PushReg needs at least one block")
        _require(self.num_tokens >= 1, "num_tokens must be at least 1")
        _require(0 <= self.num_prefix_tokens <= self.num_tokens,
                 "num_prefix_tokens must be in [0, num_tokens]")
        _check_time(self.deadline, "deadline")


class Done(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """P -> D (push): the WRITE completed; the notification of the WRITE itself."""

    transfer_id: str
    first_token_id: int | None = None
    # P's wall-clock timestamps (unix seconds) for the handover breakdown; informational only.
    reg_received: float | None = None
    write_posted: float | None = None

    def __post_init__(self) -> None:
        _check_transfer_id(self.transfer_id)
        _require(self.first_token_id is None or 0 <= self.first_token_id < 2**32,
                 "first_token_id must be in [0, 2**32)")


class Fail(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """Either way: the transfer failed; the sender has nothing in flight on it."""

    transfer_id: str
    reason: str

    def __post_init__(self) -> None:
        _check_transfer_id(self.transfer_id)
        _require(len(self.reason) <= MAX_REASON_CHARS, f"reason longer than {MAX_REASON_CHARS} characters")

    @classmethod
    def create(cls, transfer_id: str, reason: str) -> Fail:
        """A Fail whose reason is cut to ``MAX_REASON_CHARS``."""
        return cls(transfer_id, reason[:MAX_REASON_CHARS])


class Abort(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """Either way: the sender gave up on the transfer (cancelled, deadline); nothing of its own in flight."""

    transfer_id: str

    def __post_init__(self) -> None:
        _check_transfer_id(self.transfer_id)


class Release(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """D -> P (push): D had a full prefix hit and needs no KV; P may free its blocks."""

    transfer_id: str

    def __post_init__(self) -> None:
        _check_transfer_id(self.transfer_id)


class LeaseRenew(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """D -> P (pull): keep the blocks until ``until`` (unix time); P may cap it."""

    transfer_id: str
    until: float

    def __post_init__(self) -> None:
        _check_transfer_id(self.transfer_id)
        _check_time(self.until, "until")


class ReadDone(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """D -> P (pull): D's READ of P's blocks completed; P frees them."""

    transfer_id: str

    def __post_init__(self) -> None:
        _check_transfer_id(self.transfer_id)


class Commit(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """P -> D (layer-wise push): every layer of every block D registered has landed; like Done."""

    transfer_id: str
    first_token_id: int | None = None
    reg_received: float | None = None
    write_posted: float | None = None

    def __post_init__(self) -> None:
        _check_transfer_id(self.transfer_id)


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
