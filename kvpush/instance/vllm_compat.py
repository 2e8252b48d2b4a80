"""vLLM's disaggregation parameters on kvpush instances, so routers built for vLLM can drive them.

Routers that speak vLLM's protocol (vllm-router `--vllm-pd-disaggregation`, vLLM's toy proxies,
llm-d) put a ``kv_transfer_params`` object shaped like vLLM's connectors into the request body and
read P's answer from the top level of P's response. Both are sequential: P's leg is answered before
D's leg is sent.

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

This module tells the shapes apart (kvpush's own leg parameters carry a ``type`` tag, vLLM's never
do), validates them with errors that name the field, and maps them onto kvpush's own leg parameters
(``to_leg``: today the JSON dict the KV connector parses). The instance's ``--kv-mode`` decides the
flow. ``remote_request_id`` is kvpush's transfer id; ``kvpush_lease_expiry`` (an extra field that
routers pass through untouched) lets a pull D refuse parameters whose blocks P no longer holds.
"""

from __future__ import annotations

import math
import time
from typing import Any, TypeGuard

import aiohttp
import msgspec

from kvpush.config import FirstToken, KVMode
from kvpush.errors import InvalidRequestError, ProtocolError
from kvpush.instance.generation import EngineRequestError
from kvpush.protocol import kv_params as kp
from kvpush.protocol.kv_params import KVInfo

FLAGS = ("do_remote_decode", "do_remote_prefill")
PARAM = "kv_transfer_params"


def is_vllm_shaped(kv: object) -> TypeGuard[dict]:
    """vLLM's NixlConnector shape: either flag present and no kvpush ``type`` tag."""
    return isinstance(kv, dict) and "type" not in kv and any(f in kv for f in FLAGS)


def _bad(field: str | None, message: str) -> InvalidRequestError:
    name = f"{PARAM}.{field}" if field else PARAM
    return InvalidRequestError(f"{name}: {message}", param=name)


def _flag(kv: dict, field: str) -> bool:
    value = kv.get(field)
    if value is not None and not isinstance(value, bool):
        raise _bad(field, f"must be a boolean, got {value!r:.40}")
    return bool(value)


def _field(kv: dict, field: str, kind: type | tuple[type, ...], what: str) -> Any:
    if kv.get(field) is None:
        raise _bad(field, f"missing: a decode leg needs {what} (from the prefill instance's response)")
    value = kv[field]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise _bad(field, f"must be {what}, got {value!r:.60}")
    return value


def _block_ids(kv: dict) -> list[int]:
    """vLLM sends a flat list, or (hybrid KV cache versions) one list per KV cache group: kvpush has one."""
    ids = _field(kv, "remote_block_ids", list, "a non-empty list of block ids")
    if len(ids) == 1 and isinstance(ids[0], list):
        ids = ids[0]
    if not ids or not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 2**32 for b in ids):
        raise _bad("remote_block_ids", "must be a non-empty list of block ids in [0, 2**32) (one KV cache group)")
    return ids


def translate_request(kv: dict, role: str, mode: str | None, num_prompts: int,
                      stream: bool) -> kp.RequestLegParams | None:
    """kvpush's own leg parameters for a vLLM-shaped ``kv_transfer_params``; InvalidRequestError (400)
    naming the field for anything kvpush cannot honour. None: the request asks for no transfer."""
    decode_leg, prefill_leg = _flag(kv, "do_remote_decode"), _flag(kv, "do_remote_prefill")
    if decode_leg and prefill_leg:
        raise _bad(None, "do_remote_decode and do_remote_prefill are both true; a leg is one or the other")
    if not decode_leg and not prefill_leg:
        if role == "prefill":
            raise _bad("do_remote_decode", "a prefill instance serves only prefill legs (do_remote_decode: true)")
        return None  # explicitly local: computed here, as vLLM does
    if role == "colocated" or mode is None:
        raise _bad(None, "this instance is colocated (no --role prefill|decode); it cannot take part in a "
                         "disaggregated request")
    if num_prompts != 1:
        raise InvalidRequestError("a disaggregated leg carries exactly one prompt", param="prompt")
    kv_mode = KVMode(mode)
    if kv_mode is KVMode.AUTO:  # an auto instance takes either: the router's parameters say which
        kv_mode = _auto_leg_mode(kv, decode_leg)
    if decode_leg:
        if role != "prefill":
            raise _bad("do_remote_decode", "true means a prefill leg, but this is a decode instance")
        if stream:
            raise InvalidRequestError("a prefill leg (do_remote_decode: true) must not stream", param="stream")
        tid = kv.get("transfer_id")  # vllm-router's mooncake mode names the transfer; NIXL routers do not
        leg = _checked("transfer_id", lambda: kp.PrefillLegParams(transfer_id=kp.new_transfer_id() if tid is None
                                                                  else tid, mode=kv_mode))
        return leg
    if role != "decode":
        raise _bad("do_remote_prefill", "true means a decode leg, but this is a prefill instance")
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
        raise _bad(field, str(e)) from e


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
        raise _bad("kvpush_lease_expiry", "missing: these parameters were not made by a kvpush prefill instance "
                                          "(a kvpush decode instance pulls only from kvpush prefill instances)")
    lease = _field(kv, "kvpush_lease_expiry", (int, float), "a unix time")
    now = time.time()
    if not math.isfinite(lease) or lease <= now:
        raise _bad("kvpush_lease_expiry", f"stale: the prefill instance's hold on these blocks ended "
                                          f"{now - lease:.1f} s ago; send the request through its prefill leg again")
    return _checked(None, lambda: kp.DecodeLegParams(**common, block_ids=blocks, num_tokens=num_tokens,
                                                     lease_expiry=float(lease)))


async def resolve_bootstrap(kv: dict) -> dict:
    """vllm-router's mooncake mode names P by a bootstrap address (``--prefill URL PORT``: give P's own
    HTTP port) and the engine id it read there at start-up; D looks up where P's KV side channel
    listens (P's /v1/kv_info) and refuses an engine id that is no longer P's (P restarted)."""
    addr = kv.get("remote_bootstrap_addr")
    if addr is None or kv.get("remote_host") is not None or not _flag(kv, "do_remote_prefill"):
        return kv
    if not isinstance(addr, str) or not addr.startswith(("http://", "https://")):
        raise _bad("remote_bootstrap_addr", f"must be an http(s) URL, got {addr!r:.60}")
    info = _bootstrap_cache.get(addr)
    if info is None or info.engine_id != kv.get("remote_engine_id"):
        info = _bootstrap_cache[addr] = await _fetch_kv_info(addr)
    if info.engine_id != kv.get("remote_engine_id"):
        raise _bad("remote_engine_id", f"stale: {addr} runs prefill engine {info.engine_id!r} now, not "
                                       f"{kv.get('remote_engine_id')!r} (it restarted; restart the router)")
    return {**kv, "remote_host": info.kv_host, "remote_port": info.kv_port}


_bootstrap_cache: dict[str, KVInfo] = {}


async def _fetch_kv_info(addr: str) -> KVInfo:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session, \
                session.get(addr.rstrip("/") + "/v1/kv_info") as r:
            if r.status != 200:
                raise EngineRequestError(f"prefill bootstrap {addr} answered {r.status}", 502)
            return msgspec.json.decode(await r.read(), type=KVInfo)
    except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as e:
        raise EngineRequestError(f"cannot read the prefill instance's KV address from {addr}: {e}", 502) from e


def prefill_result(r: kp.PrefillResult | None) -> dict | None:
    """P's own PrefillResult in vLLM's shape, for the top level of P's response."""
    if r is None:
        return None
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": r.prefill_engine_id,
            "remote_block_ids": list(r.block_ids), "remote_request_id": r.transfer_id,
            "remote_host": r.prefill_kv_host, "remote_port": r.prefill_kv_port, "tp_size": 1,
            "remote_num_tokens": r.num_tokens, "kvpush_lease_expiry": r.lease_expiry}


def vllm_response(out: dict, role: str) -> dict:
    """A response to a vLLM-shaped request: P's parameters move from the first choice (kvpush's place)
    to the top level (vLLM's place), translated; D's response carries ``kv_transfer_params: null``.
    A prefill leg that ended without parameters (aborted, stopped early) is an error, never a 200 that
    would send D off to compute the prompt locally."""
    choices = out.get("choices") or [{}]
    out["kv_transfer_params"] = prefill_result(choices[0].pop("kv_transfer_params", None))
    if role == "prefill" and out["kv_transfer_params"] is None:
        raise EngineRequestError("the prefill leg finished without KV parameters "
                                 f"(finish_reason {choices[0].get('finish_reason')!r}); nothing for D to pull", 502)
    return out
