"""The proxy's instances: what it knows of each, how it probes them and how it picks one.

Each instance is probed (GET /v1/kv_info) every --probe-interval-s: one that answers with the expected
role and --kv-mode is healthy; a new engine id means it restarted (it rejoins, with an empty cache); a
`draining` one is not chosen until it says otherwise; one that does not answer within --probe-timeout-s
--probe-misses times in a row, refuses the connection or answers wrongly is skipped until it answers again.

A vLLM instance with kvpush's connector (kvpush.vllm_connector) has no /v1/kv_info (404): the proxy asks
its connector instead, with a one-token completion whose kv_transfer_params are INFO_QUERY
(protocol/vllm_params.py); the answer (ConnectorInfo) names each role's engine id and KV side channel. That is asked when
the instance is first seen and whenever it answers again after it did not (a restart); in between, GET
/health is its probe.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from dataclasses import dataclass

import aiohttp
import msgspec
from aiohttp import web

from kvpush.config import ProxyConfig
from kvpush.protocol.kv_params import KVInfo
from kvpush.protocol.vllm_params import INFO_QUERY, ConnectorInfo

log = logging.getLogger("kvpush.proxy")
_kv_info_decoder = msgspec.json.Decoder(KVInfo)


@dataclass
class Instance:
    url: str
    role: str
    engine_id: str = ""
    kv_host: str | None = None
    kv_port: int | None = None
    kv_mode: str | None = None
    block_size: int = 16
    healthy: bool = False
    draining: bool = False  # shutting down: finishes its requests, takes no new ones
    in_flight: int = 0
    served: int = 0
    shed_until: float = 0.0  # monotonic time until which it said it sheds (its 429/503's Retry-After)
    vllm: bool = False  # a vLLM instance with kvpush's connector (no /v1/kv_info; it recomputes P's token)
    misses: int = 0  # probes in a row not answered in time

    @property
    def usable(self) -> bool:
        return self.healthy and not self.draining

    def refused(self, status: int, body: bytes) -> bool:
        """The instance answered that it is draining (marked at once: it is not chosen again)."""
        if status == 503 and error_code(body) == "draining":
            if not self.draining:
                log.info("%s is draining: no new requests go there", self.url)
            self.draining = True
            return True
        return False


class InstancePool:
    """The prefill and decode instances of a proxy (a base of Proxy: it owns `session`)."""

    config: ProxyConfig
    session: aiohttp.ClientSession | None

    def __init__(self, config: ProxyConfig) -> None:
        self.prefills = [Instance(u.rstrip("/"), "prefill") for u in config.prefill_urls]
        self.decodes = [Instance(u.rstrip("/"), "decode") for u in config.decode_urls]
        self._rr = {"prefill": itertools.count(), "decode": itertools.count()}

    def ready(self) -> bool:
        return any(i.usable for i in self.prefills) and any(i.usable for i in self.decodes)

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.probe_interval_s)
            await self.probe_all()

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(i) for i in self.prefills + self.decodes))

    async def _probe(self, inst: Instance) -> None:
        assert self.session is not None
        info: KVInfo | None = None
        try:
            if inst.vllm and inst.healthy:
                info = await self._vllm_alive(inst)
            else:
                timeout = aiohttp.ClientTimeout(total=self.config.probe_timeout_s)
                async with self.session.get(inst.url + "/v1/kv_info", timeout=timeout) as r:
                    if r.status == 200:
                        info = _kv_info_decoder.decode(await r.read())
                    elif r.status == 404:
                        info = await self._vllm_info(inst)
        except TimeoutError:
            inst.misses += 1
            if inst.healthy and inst.misses < self.config.probe_misses:
                log.info("%s did not answer its probe in %g s (%d in a row)", inst.url, self.config.probe_timeout_s,
                         inst.misses)
                return  # slow, not gone (yet)
            info = None
        except (aiohttp.ClientError, msgspec.DecodeError, KeyError, TypeError, ValueError):
            info = None
        # A vLLM instance whose connector runs mode auto takes legs of either mode (the pair must both be auto)
        modes = (self.config.kv_mode.value, "auto") if inst.vllm else (self.config.kv_mode.value,)
        if info is None or info.role != inst.role or info.kv_mode not in modes:
            if info is not None and inst.healthy:
                log.warning("%s is %s/%s, expected %s/%s", inst.url, info.role, info.kv_mode, inst.role,
                            self.config.kv_mode.value)
            inst.healthy = False
            return
        if inst.engine_id and info.engine_id != inst.engine_id:
            log.info("%s restarted: engine %s -> %s", inst.url, inst.engine_id, info.engine_id)
            self.restarted(inst)
        if info.draining != inst.draining:
            log.info("%s %s", inst.url, "is draining: no new requests go there" if info.draining else "serves again")
        inst.healthy, inst.draining, inst.misses = True, info.draining, 0
        inst.engine_id, inst.kv_host, inst.kv_port, inst.kv_mode = (info.engine_id, info.kv_host, info.kv_port,
                                                                    info.kv_mode)
        inst.block_size = info.block_size

    async def _vllm_alive(self, inst: Instance) -> KVInfo | None:
        """A known vLLM instance: alive (GET /health) keeps what its connector said."""
        assert self.session is not None
        async with self.session.get(inst.url + "/health",
                                    timeout=aiohttp.ClientTimeout(total=self.config.probe_timeout_s)) as r:
            if r.status != 200:
                return None
        return KVInfo(engine_id=inst.engine_id, role=inst.role, kv_mode=inst.kv_mode, kv_host=inst.kv_host,
                      kv_port=inst.kv_port, block_size=inst.block_size, max_model_len=0)

    async def _vllm_info(self, inst: Instance) -> KVInfo | None:
        """Ask a vLLM instance's kvpush connector where its side channel is (None: it has none for this role)."""
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=10)
        async with self.session.get(inst.url + "/v1/models", timeout=timeout) as r:
            model = (await r.json())["data"][0]["id"]
        body = {"model": model, "prompt": [0], "max_tokens": 1, "kv_transfer_params": INFO_QUERY}
        async with self.session.post(inst.url + "/v1/completions", json=body, timeout=timeout) as r:
            answer = (await r.json()).get("kv_transfer_params")
        try:
            info = msgspec.convert(answer, ConnectorInfo)
        except msgspec.ValidationError:
            info = None
        role = info.roles.get(inst.role) if info is not None and info.kvpush == "kv_info" else None
        if info is None or role is None:
            if not inst.vllm:
                log.warning("%s has no /v1/kv_info and no kvpush connector taking %s legs", inst.url, inst.role)
            return None
        inst.vllm = True
        return KVInfo(engine_id=role.engine_id, role=inst.role, kv_mode=info.kv_mode, kv_host=role.kv_host,
                      kv_port=role.kv_port, block_size=info.block_size, max_model_len=0)

    def restarted(self, inst: Instance) -> None:
        """The instance came back with a new engine id (a hook for the proxy)."""

    async def reset_prefix_caches(self, request: web.Request) -> web.Response:
        """POST /reset_prefix_cache: every instance forgets its cached prefix blocks (each one's own
        POST /reset_prefix_cache), and the proxy what it tracked of those that did (`restarted`). A
        draining instance is left out (it takes no new request). 502 with the instances that failed, if
        any did: a benchmark must not start "cold" on a warm one."""
        assert self.session is not None
        every = [i for i in self.prefills + self.decodes if not i.draining]
        done = await asyncio.gather(*(self._reset(i) for i in every))
        failed = [i.url for i, ok in zip(every, done, strict=True) if not ok]
        for inst, ok in zip(every, done, strict=True):
            if ok:
                self.restarted(inst)
        if failed:
            body = {"error": {"message": f"prefix cache reset failed on {', '.join(failed)}",
                              "type": "server_error", "param": None, "code": "reset_failed"}}
            return web.json_response(body, status=502)
        return web.json_response({"reset": [i.url for i in every]})

    async def _reset(self, inst: Instance) -> bool:
        assert self.session is not None
        try:
            async with self.session.post(inst.url + "/reset_prefix_cache", timeout=aiohttp.ClientTimeout(total=10)) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    # ---- choosing ------------------------------------------------------------------------
    def pick(self, pool: list[Instance], role: str, exclude: set[str] | None = None) -> Instance:
        healthy = [i for i in pool if i.usable and i.url not in (exclude or ())]
        if not healthy:
            raise web.HTTPServiceUnavailable(reason=f"no healthy {role} instance")
        now = time.monotonic()
        healthy = [i for i in healthy if i.shed_until <= now] or healthy  # those shedding only if all are
        if self.config.policy == "least-loaded":
            return min(healthy, key=lambda i: (i.in_flight, i.served))
        return healthy[next(self._rr[role]) % len(healthy)]


def error_code(body: bytes) -> object:
    """The `code` of an OpenAI-style error body, or None."""
    try:
        error = json.loads(body).get("error")
        return error.get("code") if isinstance(error, dict) else None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return None
