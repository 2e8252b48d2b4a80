"""vLLM's disaggregation parameters (``kv_transfer_params`` shaped like vLLM's NixlConnector's), parsed
into kvpush's own leg parameters: one parser for both engines, kvpush's instances (instance/vllm_compat.py)
and kvpush's connector inside vLLM (kvpush/vllm/). Shapes:

    P leg  (router -> P):  {"do_remote_decode": true, "do_remote_prefill": false, ...}, max_tokens=1
                           (vllm-router --kv-connector mooncake adds "transfer_id")
    P's answer (top level of P's response body):
                           {"do_remote_prefill": true, "do_remote_decode": false,
                            "remote_engine_id", "remote_block_ids", "remote_request_id",
                            "remote_host", "remote_port", "tp_size", "remote_num_tokens",
                            "kvpush_lease_expiry"}
    D leg  (router -> D):  NIXL routers: P's answer verbatim (pull: D READs remote_block_ids;
                           push: D registers with P, block ids ignored)
                           mooncake mode: {"transfer_id", "remote_bootstrap_addr", "remote_engine_id"}

kvpush's own leg parameters carry a ``type`` tag, vLLM's never do (``is_vllm_shaped``). Errors are
InvalidRequestError naming the field. ``remote_request_id`` is kvpush's transfer id;
``kvpush_lease_expiry`` (an extra field that routers pass through untouched) lets a pull D refuse
parameters whose blocks P no longer holds.

A vLLM instance running kvpush's connector has no /v1/kv_info: kvpush's proxy sends it a one-token
completion whose ``kv_transfer_params`` are ``INFO_QUERY``, and the connector answers ``ConnectorInfo``
(at the top level of the response, as P's answer).
"""

from __future__ import annotations

import math
import time
from typing import Any, TypeGuard

import msgspec

from kvpush.config import FirstToken, KVMode
from kvpush.errors import InvalidRequestError, ProtocolError
from kvpush.protocol import kv_params as kp

FLAGS = ("do_remote_decode", "do_remote_prefill")
PARAM = "kv_transfer_params"
INFO_QUERY = {"kvpush": "kv_info"}


class KVAddress(msgspec.Struct, frozen=True):
    """Where one role's transfer runtime of a vLLM instance listens."""

    engine_id: str
    kv_host: str
    kv_port: int


class ConnectorInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The connector's answer to INFO_QUERY: its mode, block size and each role's address."""

    kv_mode: str
    block_size: int
    roles: dict[str, KVAddress]
    kvpush: str = "kv_info"


def is_vllm_shaped(kv: object) -> TypeGuard[dict]:
    """vLLM's NixlConnector shape: either flag present and no kvpush ``type`` tag."""
    return isinstance(kv, dict) and "type" not in kv and any(f in kv for f in FLAGS)


def bad_field(field: str | None, message: str) -> InvalidRequestError:
    name = f"{PARAM}.{field}" if field else PARAM
    return InvalidRequestError(f"{name}: {message}", param=name)


def flag(kv: dict, field: str) -> bool:
    value = kv.get(field)
    if value is not None and not isinstance(value, bool):
        raise bad_field(field, f"must be a boolean, got {value!r:.40}")
    return bool(value)


def _field(kv: dict, field: str, kind: type | tuple[type, ...], what: str) -> Any:
    if kv.get(field) is None:
        raise bad_field(field, f"missing: a decode leg needs {what} (from the prefill instance's response)")
    value = kv[field]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise bad_field(field, f"must be {what}, got {value!r:.60}")
    return value


def _block_ids(kv: dict) -> list[int]:
    """vLLM sends a flat list, or (hybrid KV cache versions) one list per KV cache group: kvpush has one."""
    ids = _field(kv, "remote_block_ids", list, "a non-empty list of block ids")
    if len(ids) == 1 and isinstance(ids[0], list):
        ids = ids[0]
    if not ids or not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 2**32 for b in ids):
        raise bad_field("remote_block_ids", "must be a non-empty list of block ids in [0, 2**32) (one KV cache group)")
    return ids


def translate_request(kv: dict, role: str, mode: str | None, num_prompts: int,
                      stream: bool) -> kp.RequestLegParams | None:
    """kvpush's own leg parameters for a vLLM-shaped ``kv_transfer_params``; InvalidRequestError (400)
    naming the field for anything kvpush cannot honour. None: the request asks for no transfer."""
    decode_leg, prefill_leg = flag(kv, "do_remote_decode"), flag(kv, "do_remote_prefill")
    if decode_leg and prefill_leg:
        raise bad_field(None, "do_remote_decode and do_remote_prefill are both true; a leg is one or the other")
    if not decode_leg and not prefill_leg:
        if role == "prefill":
            raise bad_field("do_remote_decode", "a prefill instance serves only prefill legs (do_remote_decode: true)")
        return None  # explicitly local: computed here, as vLLM does
    if role == "colocated" or mode is None:
        raise bad_field(None, "this instance is colocated (no --role prefill|decode); it cannot take part in a "
                         "disaggregated request")
    if num_prompts != 1:
        raise InvalidRequestError("a disaggregated leg carries exactly one prompt", param="prompt")
    kv_mode = KVMode(mode)
    if kv_mode is KVMode.AUTO:  # an auto instance takes either: the router's parameters say which
        kv_mode = _auto_leg_mode(kv, decode_leg)
    if decode_leg:
        if role != "prefill":
            raise bad_field("do_remote_decode", "true means a prefill leg, but this is a decode instance")
        if stream:
            raise InvalidRequestError("a prefill leg (do_remote_decode: true) must not stream", param="stream")
        tid = kv.get("transfer_id")  # vllm-router's mooncake mode names the transfer; NIXL routers do not
        leg = _checked("transfer_id", lambda: kp.PrefillLegParams(transfer_id=kp.new_transfer_id() if tid is None
                                                                  else tid, mode=kv_mode))
        return leg
    if role != "decode":
        raise bad_field("do_remote_prefill", "true means a decode leg, but this is a prefill instance")
    return _decode_leg(kv, kv_mode)


def _auto_leg_mode(kv: dict, decode_leg: bool) -> KVMode:
    """The mode of a vLLM-shaped leg sent to an auto instance: Mooncake-style routers name the transfer
    on P's leg and send D no block ids (push); NIXL-style ones do neither (pull)."""
    if decode_leg:
        return KVMode.PUSH if kv.get("transfer_id") is not None else KVMode.PULL
    return KVMode.PULL if kv.get("remote_block_ids") else KVMode.PUSH


def _checked(field: str | None, make):
    try:
        return make()
    except ProtocolError as e:
        raise bad_field(field, str(e)) from e


def _decode_leg(kv: dict, mode: KVMode) -> kp.DecodeLegParams:
    engine_id = _field(kv, "remote_engine_id", str, "the prefill engine id")
    host = _field(kv, "remote_host", str, "the prefill instance's KV host")
    port = _field(kv, "remote_port", int, "the prefill instance's KV port")
    if kv.get("remote_request_id") is None and kv.get("transfer_id") is not None:
        kv = {**kv, "remote_request_id": kv["transfer_id"]}  # mooncake mode's name for it
    transfer_id = _field(kv, "remote_request_id", str, "the transfer id")
    common = dict(transfer_id=transfer_id, mode=mode, prefill_engine_id=engine_id, prefill_kv_host=host,
                  prefill_kv_port=port, first_token=FirstToken.RECOMPUTE)
    if mode.is_push:  # P writes once D registers: D needs no block ids (P's, if sent, are ignored)
        return _checked(None, lambda: kp.DecodeLegParams(**common))
    blocks = _block_ids(kv)
    num_tokens = _field(kv, "remote_num_tokens", int, "the number of prompt tokens P computed")
    if kv.get("kvpush_lease_expiry") is None:
        raise bad_field("kvpush_lease_expiry", "missing: these parameters were not made by a kvpush prefill instance "
                                          "(a kvpush decode instance pulls only from kvpush prefill instances)")
    lease = _field(kv, "kvpush_lease_expiry", (int, float), "a unix time")
    now = time.time()
    if not math.isfinite(lease) or lease <= now:
        raise bad_field("kvpush_lease_expiry", f"stale: the prefill instance's hold on these blocks ended "
                                          f"{now - lease:.1f} s ago; send the request through its prefill leg again")
    return _checked(None, lambda: kp.DecodeLegParams(**common, block_ids=blocks, num_tokens=num_tokens,
                                                     lease_expiry=float(lease)))


def prefill_result(r: kp.PrefillResult | None) -> dict | None:
    """P's own PrefillResult in vLLM's shape, for the top level of P's response."""
    if r is None:
        return None
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": r.prefill_engine_id,
            "remote_block_ids": list(r.block_ids), "remote_request_id": r.transfer_id,
            "remote_host": r.prefill_kv_host, "remote_port": r.prefill_kv_port, "tp_size": 1,
            "remote_num_tokens": r.num_tokens, "kvpush_lease_expiry": r.lease_expiry}
