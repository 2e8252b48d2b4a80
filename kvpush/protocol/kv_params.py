"""Leg parameters: what the proxy tells a prefill (P) or decode (D) instance about one request's
KV transfer, and what P answers. They travel over HTTP as the request's ``kv_transfer_params``
(JSON objects tagged with ``type``) and, typed, through the server, the engine and the connectors::

    PrefillLegParams   proxy -> P   "prefill this, the KV goes to a remote decoder"
    PrefillResult      P -> proxy   where the KV is (pull: P's blocks, held under a lease)
    DecodeLegParams    proxy -> D   "decode this, the KV comes from that prefill instance"
    KVInfo             instance -> proxy (GET /v1/kv_info): its engine id, role, KV address, draining

The checks below (also used by the KV-channel messages, transfer/protocol.py) raise
``ProtocolError``.
"""

from __future__ import annotations

import math
import re
import uuid
from typing import Any, TypeVar

import msgspec

from kvpush.config import FirstToken, KVMode
from kvpush.errors import ProtocolError

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change of a message or of the handshake."""

MAX_ID_CHARS = 128
_ID_RE = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_ID_CHARS}}}")


def new_transfer_id() -> str:
    """A fresh transfer id: 128 random bits, hex. Never reused."""
    return uuid.uuid4().hex


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ProtocolError(message)


def _check_version(version: int) -> None:
    require(version == PROTOCOL_VERSION, f"kv_transfer_params protocol version mismatch: got {version!r}, "
                                         f"this instance speaks {PROTOCOL_VERSION}")


def check_transfer_id(value: str) -> None:
    require(isinstance(value, str) and _ID_RE.fullmatch(value) is not None,
            f"transfer_id must be 1-{MAX_ID_CHARS} characters of [A-Za-z0-9._-], got {value!r:.80}")


def check_engine_id(value: str, name: str) -> None:
    require(isinstance(value, str) and 0 < len(value) <= 256, f"{name} must be 1-256 characters")


def check_time(value: float, name: str) -> None:
    require(math.isfinite(value) and value >= 0, f"{name} must be a finite unix time, got {value!r}")


def check_blocks(block_ids: list[int], name: str) -> None:
    require(all(0 <= b < 2**32 for b in block_ids), f"{name} must be block ids in [0, 2**32)")


def _check_leg_mode(mode: KVMode) -> None:
    require(mode is not KVMode.AUTO, "a leg's mode is pull, push or push-layerwise (auto is a deployment's)")


def _check_port(port: int) -> None:
    require(0 < port < 65536, f"kv port must be in [1, 65535], got {port}")


class PrefillLegParams(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """proxy -> P. Push: ``decode_engine_id`` names the D whose PushReg P must accept; None (legs from
    routers built for vLLM, which do not know D's engine id) accepts the first D that registers."""

    transfer_id: str
    mode: KVMode
    do_remote_decode: bool = True
    decode_engine_id: str | None = None
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        _check_version(self.protocol_version)
        check_transfer_id(self.transfer_id)
        _check_leg_mode(self.mode)
        if self.decode_engine_id is not None:
            check_engine_id(self.decode_engine_id, "decode_engine_id")


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
        _check_version(self.protocol_version)
        check_transfer_id(self.transfer_id)
        _check_leg_mode(self.mode)
        check_engine_id(self.prefill_engine_id, "prefill_engine_id")
        _check_port(self.prefill_kv_port)
        require(self.num_tokens >= 1, "num_tokens must be at least 1")
        check_blocks(self.block_ids, "block_ids")
        if self.mode is KVMode.PULL:
            require(len(self.block_ids) > 0, "pull mode needs block_ids")
            require(self.lease_expiry is not None, "pull mode needs lease_expiry")
        if self.lease_expiry is not None:
            check_time(self.lease_expiry, "lease_expiry")

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
        _check_version(self.protocol_version)
        check_transfer_id(self.transfer_id)
        _check_leg_mode(self.mode)
        check_engine_id(self.prefill_engine_id, "prefill_engine_id")
        _check_port(self.prefill_kv_port)
        if self.block_ids is not None:
            check_blocks(self.block_ids, "block_ids")
        if self.lease_expiry is not None:
            check_time(self.lease_expiry, "lease_expiry")
        if self.mode is KVMode.PULL:
            require(bool(self.block_ids) and self.num_tokens is not None and self.lease_expiry is not None,
                    "pull mode needs P's block_ids, num_tokens and lease_expiry")
            if self.first_token is FirstToken.FROM_PREFILL:
                require(self.first_token_id is not None, "first_token from-prefill needs first_token_id")
        if self.num_tokens is not None:
            require(self.num_tokens >= 1, "num_tokens must be at least 1")


LegParams = PrefillLegParams | PrefillResult | DecodeLegParams
RequestLegParams = PrefillLegParams | DecodeLegParams  # what a request to P or D may carry
_ParamsT = TypeVar("_ParamsT", bound=LegParams)


def params_to_dict(params: LegParams) -> dict[str, Any]:
    """JSON-ready dict for ``kv_transfer_params`` (carries its ``type`` tag and the version)."""
    out: dict[str, Any] = msgspec.to_builtins(params)
    return out


def params_from_dict(data: Any, cls: type[_ParamsT]) -> _ParamsT:
    """Parse ``kv_transfer_params`` (a JSON object) as ``cls``; any problem is a ProtocolError."""
    try:
        return msgspec.convert(data, cls)
    except (msgspec.ValidationError, ValueError, TypeError) as e:
        raise ProtocolError(f"invalid kv_transfer_params for {cls.__name__}: {e}") from e


class KVInfo(msgspec.Struct):
    """GET /v1/kv_info: what the proxy needs to pair an instance with its peers."""

    engine_id: str
    role: str
    kv_mode: str | None
    kv_host: str | None
    kv_port: int | None
    block_size: int
    max_model_len: int
    draining: bool = False  # SIGTERM received: finishing its requests, takes no new ones
