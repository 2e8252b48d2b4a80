"""vLLM's disaggregation parameters on kvpush instances, so routers built for vLLM can drive them.

Routers that speak vLLM's protocol (vllm-router `--vllm-pd-disaggregation`, vLLM's toy proxies,
llm-d) put a ``kv_transfer_params`` object shaped like vLLM's connectors into the request body and
read P's answer from the top level of P's response. Both are sequential: P's leg is answered before
D's leg is sent. The shapes and their parsing are protocol/vllm_params.py's (shared with kvpush's
connector inside vLLM); this module adds what an instance's HTTP side does with them: D resolving
vllm-router's mooncake bootstrap address (``resolve_bootstrap``) and P's answer moved to the top level
of its response (``vllm_response``). The instance's ``--kv-mode`` decides the flow.
"""

from __future__ import annotations

import aiohttp
import msgspec

from kvpush.instance.generation import EngineRequestError
from kvpush.protocol.kv_params import KVInfo
from kvpush.protocol.vllm_params import bad_field, flag, is_vllm_shaped, prefill_result, translate_request

__all__ = ["is_vllm_shaped", "prefill_result", "resolve_bootstrap", "translate_request", "vllm_response"]


async def resolve_bootstrap(kv: dict) -> dict:
    """vllm-router's mooncake mode names P by a bootstrap address (``--prefill URL PORT``: give P's own
    HTTP port) and the engine id it read there at start-up; D looks up where P's KV side channel
    listens (P's /v1/kv_info) and refuses an engine id that is no longer P's (P restarted)."""
    addr = kv.get("remote_bootstrap_addr")
    if addr is None or kv.get("remote_host") is not None or not flag(kv, "do_remote_prefill"):
        return kv
    if not isinstance(addr, str) or not addr.startswith(("http://", "https://")):
        raise bad_field("remote_bootstrap_addr", f"must be an http(s) URL, got {addr!r:.60}")
    info = _bootstrap_cache.get(addr)
    if info is None or info.engine_id != kv.get("remote_engine_id"):
        info = _bootstrap_cache[addr] = await _fetch_kv_info(addr)
    if info.engine_id != kv.get("remote_engine_id"):
        raise bad_field("remote_engine_id", f"stale: {addr} runs prefill engine {info.engine_id!r} now, not "
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
