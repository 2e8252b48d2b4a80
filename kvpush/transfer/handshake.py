"""The P-D handshake: who the peer is, where its KV buffer lives, and whether the two can talk.

Once per P-D pair (lazily, or at start-up) each side sends a ``HandshakeInfo``: its engine id and
role, its NIXL agent name and metadata, the geometry of its registered KV buffer, its
``PROTOCOL_VERSION`` and the compatibility hash of (model, dtype, num_layers, num_kv_heads,
head_dim, block_size, transfer mode). The receiving side runs, in this order:

    envelope    malformed or oversized bytes                 -> HandshakeError
    version     envelope version != PROTOCOL_VERSION         -> HandshakeError naming both versions
    secret      signature presence must match configuration  -> HandshakeError "secrets differ"
    signature   HMAC-SHA256 compared in constant time        -> HandshakeError
    payload     HandshakeInfo decodes and is self-consistent -> HandshakeError
    compat      compat_hash == expected                      -> HandshakeError naming both hashes

Wire format: a msgpack array ``[protocol_version, payload, mac]``; ``payload`` is the msgpack
``HandshakeInfo``; ``mac`` is HMAC-SHA256(secret, DOMAIN || version (4 bytes BE) || payload) or nil.

Secrets: a peer configured with ``--kv-secret`` rejects an unsigned handshake; a peer without a
secret accepts only unsigned handshakes and rejects a signed one, with a message saying the two
instances' secrets differ (silently accepting would let a misconfigured deployment run
unauthenticated on one side). The handshake carries no nonce: replay protection is out of scope;
the HMAC proves the payload was produced by a holder of the secret.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

from kvpush.config import KVMode, Role
from kvpush.errors import HandshakeError
from kvpush.transfer.descriptors import KVGeometry
from kvpush.transfer.protocol import PROTOCOL_VERSION

MAX_HANDSHAKE_BYTES = 4 * 1024 * 1024
MEMORY_TYPES = ("DRAM", "VRAM")
_DOMAIN = b"kvpush-handshake\x00"
_COMPAT_DOMAIN = b"kvpush-compat\x00"


class HandshakeInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What one instance tells its peer about itself.

    The KV layout (transfer/descriptors.py): kvpush's is block-major (docs/design.md section 2), block
    ``b`` at ``base_address + b * block_bytes``, its layer ``l`` at ``... + l * layer_bytes``, and
    ``layer_bases`` is empty; a layer-major one (one tensor per layer) gives each layer's address of
    block 0 in ``layer_bases`` and the bytes between blocks in ``block_stride``.
    """

    engine_id: str
    role: Role
    agent_name: str
    agent_metadata: bytes
    base_address: int
    num_blocks: int
    num_layers: int
    block_bytes: int
    layer_bytes: int
    memory_type: str = "DRAM"
    device_id: int = 0
    protocol_version: int = PROTOCOL_VERSION
    compat_hash: str
    compat_summary: str = ""  # human-readable compat fields, for error messages only
    doorbell: str = ""  # "host:port" (UDP) the peer rings after sending us anything; "" = poll (doorbell.py)
    layer_bases: list[int] = []  # layer-major layouts: layer l's block 0; [] = block-major
    block_stride: int = 0  # layer-major layouts: bytes from a block to the next in a layer; 0 = block_bytes


class _Envelope(msgspec.Struct, array_like=True):
    protocol_version: int
    payload: bytes
    mac: bytes | None


_info_decoder = msgspec.msgpack.Decoder(HandshakeInfo)
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)


def compat_hash(model_id: str, dtype: str, num_layers: int, num_kv_heads: int, head_dim: int,
                block_size: int, kv_mode: KVMode | str) -> str:
    """sha256 (hex) over a canonical msgpack array of the fields that must match across P and D."""
    mode = kv_mode.value if isinstance(kv_mode, KVMode) else str(kv_mode)
    canonical = msgspec.msgpack.encode(
        [str(model_id), str(dtype), int(num_layers), int(num_kv_heads), int(head_dim), int(block_size), mode])
    return hashlib.sha256(_COMPAT_DOMAIN + canonical).hexdigest()


def compat_summary(model_id: str, dtype: str, num_layers: int, num_kv_heads: int, head_dim: int,
                   block_size: int, kv_mode: KVMode | str) -> str:
    """The same fields as ``compat_hash``, readable; goes into ``HandshakeInfo.compat_summary``."""
    mode = kv_mode.value if isinstance(kv_mode, KVMode) else str(kv_mode)
    return (f"model={model_id} dtype={dtype} num_layers={num_layers} num_kv_heads={num_kv_heads} "
            f"head_dim={head_dim} block_size={block_size} kv_mode={mode}")


def encode_info(info: HandshakeInfo) -> bytes:
    """The payload to pass to ``sign``."""
    return msgspec.msgpack.encode(info)


def _mac(secret: str, version: int, payload: bytes) -> bytes:
    message = _DOMAIN + version.to_bytes(4, "big", signed=False) + payload
    return hmac.new(secret.encode("utf-8"), message, hashlib.sha256).digest()


def sign(payload: bytes, secret: str | None) -> bytes:
    """Wrap ``payload`` in the handshake envelope, with an HMAC when ``secret`` is set."""
    mac = _mac(secret, PROTOCOL_VERSION, payload) if secret else None
    data = msgspec.msgpack.encode(_Envelope(PROTOCOL_VERSION, bytes(payload), mac))
    if len(data) > MAX_HANDSHAKE_BYTES:
        raise HandshakeError(f"handshake is {len(data)} bytes, more than {MAX_HANDSHAKE_BYTES}")
    return data


def pack(info: HandshakeInfo, secret: str | None) -> bytes:
    """``sign(encode_info(info), secret)``."""
    return sign(encode_info(info), secret)


def verify_and_decode(data: bytes, secret: str | None, expected_compat_hash: str, *,
                      expected_compat_summary: str = "",
                      expected_engine_id: str | None = None) -> HandshakeInfo:
    """Check a peer's handshake (see the module docstring for the order) and return its info."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise HandshakeError(f"handshake must be bytes, got {type(data).__name__}")
    if len(data) > MAX_HANDSHAKE_BYTES:
        raise HandshakeError(f"handshake is {len(data)} bytes, more than {MAX_HANDSHAKE_BYTES}")
    try:
        envelope = _envelope_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, OverflowError) as e:
        raise HandshakeError(f"malformed handshake: {e}") from e
    if envelope.protocol_version != PROTOCOL_VERSION:
        raise HandshakeError(
            f"protocol version mismatch: peer speaks version {envelope.protocol_version}, "
            f"this instance speaks version {PROTOCOL_VERSION}")
    if secret:
        if envelope.mac is None:
            raise HandshakeError("peer's handshake is unsigned but this instance has a --kv-secret: "
                                 "the two instances' secrets differ")
        expected = _mac(secret, envelope.protocol_version, envelope.payload)
        if not hmac.compare_digest(expected, envelope.mac):
            raise HandshakeError("handshake signature is invalid: wrong --kv-secret or a tampered payload")
    elif envelope.mac is not None:
        raise HandshakeError("peer's handshake is signed but this instance has no --kv-secret: "
                             "the two instances' secrets differ")
    try:
        info = _info_decoder.decode(envelope.payload)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, OverflowError) as e:
        raise HandshakeError(f"malformed handshake payload: {e}") from e
    _check_info(info, envelope.protocol_version)
    if info.compat_hash != expected_compat_hash:
        detail = ""
        if info.compat_summary or expected_compat_summary:
            detail = f" (peer: {info.compat_summary or '?'}; this instance: {expected_compat_summary or '?'})"
        raise HandshakeError(
            f"compatibility hash mismatch: peer {info.engine_id!r} has {info.compat_hash}, "
            f"this instance expects {expected_compat_hash}{detail}")
    if expected_engine_id is not None and info.engine_id != expected_engine_id:
        raise HandshakeError(f"handshake from engine {info.engine_id!r}, expected {expected_engine_id!r}")
    return info


def _check_info(info: HandshakeInfo, envelope_version: int) -> None:
    def bad(message: str) -> HandshakeError:
        return HandshakeError(f"malformed handshake payload: {message}")

    if info.protocol_version != envelope_version:
        raise HandshakeError(
            f"protocol version mismatch: peer's payload says version {info.protocol_version}, "
            f"its envelope {envelope_version}; this instance speaks version {PROTOCOL_VERSION}")
    if not info.engine_id or not info.agent_name:
        raise bad("engine_id and agent_name must be non-empty")
    if info.memory_type not in MEMORY_TYPES:
        raise bad(f"memory_type must be one of {MEMORY_TYPES}, got {info.memory_type!r}")
    if min(info.base_address, info.num_blocks, info.num_layers, info.layer_bytes, info.device_id) < 0:
        raise bad("addresses, counts and sizes must be non-negative")
    if info.num_blocks == 0 or info.num_layers == 0 or info.layer_bytes == 0:
        raise bad("num_blocks, num_layers and layer_bytes must be positive")
    if info.block_bytes != info.num_layers * info.layer_bytes:
        raise bad(f"block_bytes {info.block_bytes} != num_layers {info.num_layers} * "
                  f"layer_bytes {info.layer_bytes} (the bytes of one block over all layers)")
    try:
        KVGeometry.from_info(info)
    except ValueError as exc:
        raise bad(f"KV layout: {exc}") from None
