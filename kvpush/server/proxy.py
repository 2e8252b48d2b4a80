"""`kvpush proxy`: the front door of an xPyD deployment.

Per request:  pick a P and a D (round-robin or least-loaded among healthy instances), mint a
transfer_id, then
    push: dispatch both legs at once (P: the request + PrefillLegParams, which P caps to one
          token; D: the request + DecodeLegParams naming P); stream D's answer back.
    pull: send P's leg, wait for its PrefillResult, forward it to D (DecodeLegParams with P's
          block ids); stream D's answer back.
A completions request with several prompts is one such dispatch per prompt (proxy_batch.py).
If a leg fails, the client gets that leg's error (OpenAI error JSON) and the other leg is
cancelled; a client that disconnects cancels both legs (their instances abort the requests).
Instances are re-probed (GET /v1/kv_info) every second: a restarted instance rejoins with its
new engine id; an unreachable one is skipped until it answers again. A draining instance (SIGTERM;
its kv_info says so, or it refused a leg with code "draining") is not chosen again until it says
otherwise; a leg it refused, or a D leg that could not even connect, goes to another instance (D: pull
keeps P's prefill, push dispatches both legs anew).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from dataclasses import dataclass, field

import aiohttp
import msgspec
from aiohttp import web

from kvpush import kv_params as kp
from kvpush.config import FirstToken, KVMode, ProxyConfig
from kvpush.server import proxy_batch
from kvpush.server import responses as R
from kvpush.server.messages import KVInfo
from kvpush.server.proxy_metrics import ProxyMetrics

log = logging.getLogger("kvpush.proxy")
ROUTES = ("/v1/completions", "/v1/chat/completions")
_kv_info_decoder = msgspec.json.Decoder(KVInfo)
TRACE_WAIT_S = 1.0  # push: how long D's final chunk may wait for P's answer to merge P's stamps
NO_INSTANCE_RETRY_AFTER_S = 1  # Retry-After of the proxy's own 503 (no healthy instance of a role)


@dataclass
class Instance:
    url: str
    role: str
    engine_id: str = ""
    kv_host: str | None = None
    kv_port: int | None = None
    kv_mode: str | None = None
    healthy: bool = False
    draining: bool = False  # shutting down: finishes its requests, takes no new ones
    in_flight: int = 0
    served: int = 0
    shed_until: float = 0.0  # monotonic time until which it said it sheds (its 429/503's Retry-After)

    @property
    def usable(self) -> bool:
        return self.healthy and not self.draining

    def refused(self, status: int, body: bytes) -> bool:
        """The instance answered that it is draining (marked at once: it is not chosen again)."""
        if status == 503 and _error_code(body) == "draining":
            if not self.draining:
                log.info("%s is draining: no new requests go there", self.url)
            self.draining = True
            return True
        return False


class LegError(Exception):
    """One leg answered with an error; carries the status, body and Retry-After to give the client,
    and which instance answered it."""

    def __init__(self, status: int, body: bytes, instance: Instance | None = None,
                 retry_after: str | None = None) -> None:
        super().__init__(f"leg failed with {status}")
        self.status = status
        self.body = body
        self.instance = instance
        self.retry_after = retry_after

    @property
    def shed(self) -> bool:
        """The instance refused the request for lack of capacity (or is unavailable): another may not."""
        return self.status in (429, 503) and self.instance is not None


class DecodeUnavailable(Exception):
    """The decode instance refused the leg because it drains, or could not be connected to: nothing
    was sent to it, so another decode instance may serve the request."""

    def __init__(self, error: LegError, reason: str) -> None:
        super().__init__(str(error))
        self.error = error
        self.reason = reason


class PrefillFailed(Exception):
    """The prefill leg failed on the instance's side (unreachable, 5xx): worth another instance."""

    def __init__(self, error: LegError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class Dispatch:
    prefill: Instance
    decode: Instance
    transfer_id: str
    first_token: FirstToken
    trace: dict[str, float] = field(default_factory=dict)
    p_task: asyncio.Task | None = None  # push: P's leg, possibly still running after D answered


@dataclass
class Leg:
    """One prompt's dispatch whose D answered 200: its answer is still to be read."""

    dispatch: Dispatch
    response: aiohttp.ClientResponse


class Proxy:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefills = [Instance(u.rstrip("/"), "prefill") for u in config.prefill_urls]
        self.decodes = [Instance(u.rstrip("/"), "decode") for u in config.decode_urls]
        self._rr = {"prefill": itertools.count(), "decode": itertools.count()}
        self.metrics = ProxyMetrics()
        self.session: aiohttp.ClientSession | None = None
        self._prober: asyncio.Task | None = None

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self, wait_s: float = 120.0) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=self.config.request_timeout_s)
        key = self.config.instance_api_key
        headers = {"Authorization": f"Bearer {key}"} if key else None
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0),
                                             headers=headers)
        deadline = time.monotonic() + wait_s
        while not self._ready() and time.monotonic() < deadline:
            await self.probe_all()
            if not self._ready():
                await asyncio.sleep(0.5)
        self._prober = asyncio.create_task(self._probe_loop())

    def _ready(self) -> bool:
        return any(i.usable for i in self.prefills) and any(i.usable for i in self.decodes)

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
        if self.session is not None:
            await self.session.close()

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
            async with self.session.get(inst.url + "/v1/kv_info", timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    info = _kv_info_decoder.decode(await r.read())
        except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError):
            info = None
        if info is None or info.role != inst.role or info.kv_mode != self.config.kv_mode.value:
            if info is not None and inst.healthy:
                log.warning("%s is %s/%s, expected %s/%s", inst.url, info.role, info.kv_mode, inst.role,
                            self.config.kv_mode.value)
            inst.healthy = False
            return
        if inst.engine_id and info.engine_id != inst.engine_id:
            log.info("%s restarted: engine %s -> %s", inst.url, inst.engine_id, info.engine_id)
        if info.draining != inst.draining:
            log.info("%s %s", inst.url, "is draining: no new requests go there" if info.draining else "serves again")
        inst.healthy, inst.draining = True, info.draining
        inst.engine_id, inst.kv_host, inst.kv_port, inst.kv_mode = (info.engine_id, info.kv_host, info.kv_port,
                                                                    info.kv_mode)

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

    # ---- HTTP ----------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self.error_middleware], client_max_size=8 << 20)
        for route in ROUTES:
            app.router.add_post(route, self.handle)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_endpoint)
        return app

    @web.middleware
    async def error_middleware(self, request: web.Request, handler) -> web.StreamResponse:
        key = self.config.api_key
        if key and request.path.startswith("/v1/") and request.headers.get("Authorization") != f"Bearer {key}":
            return R.error_response(401, "invalid or missing API key")
        try:
            return await handler(request)
        except LegError as e:
            self.metrics.requests.labels(status=str(e.status)).inc()
            headers = {"Retry-After": e.retry_after} if e.retry_after is not None else None
            return web.Response(body=e.body, status=e.status, content_type="application/json", headers=headers)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            self.metrics.requests.labels(status=str(e.status)).inc()
            resp = R.error_response(e.status, e.reason or "error")
            if e.status == 503:
                resp.headers["Retry-After"] = str(NO_INSTANCE_RETRY_AFTER_S)
            return resp

    async def health(self, request: web.Request) -> web.Response:
        if not self._ready():
            return R.error_response(503, "no healthy prefill or decode instance")
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        inst = self.pick(self.decodes, "decode")
        assert self.session is not None
        async with self.session.get(inst.url + "/v1/models") as r:
            return web.Response(body=await r.read(), status=r.status, content_type="application/json")

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        self.metrics.update_instances(self.prefills + self.decodes)
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        received = time.time()
        body = _parse_body(await request.read())
        prompts = proxy_batch.batched_prompts(request.path, body)
        if prompts is not None:
            return await proxy_batch.serve_batch(self, request, body, prompts)
        leg = await self.open_leg(request.path, body, kp.new_transfer_id(), received)
        try:
            return await self._relay(request, leg.response, leg.dispatch)
        finally:
            self.end_leg(leg.dispatch)

    async def open_leg(self, path: str, body: dict, transfer_id: str, received: float | None = None) -> Leg:
        """Dispatch one prompt's P and D legs; return once D answered 200 (its first token exists).
        A prefill leg that fails before that (P unreachable or answering 5xx) is retried on another
        prefill instance, as transfer `<transfer_id>.<attempt>`; a leg an instance sheds (429 / 503) is
        retried on another instance of that role not tried yet and not shedding, if there is one (else
        the client gets the 429 / 503 and its Retry-After). The caller must `end_leg` the result."""
        tried: set[str] = set()
        tried_d: set[str] = set()
        for attempt in itertools.count():
            d = Dispatch(self.pick(self.prefills, "prefill", exclude=tried),
                         self.pick(self.decodes, "decode", exclude=tried_d),
                         f"{transfer_id}.{attempt}" if attempt else transfer_id,
                         first_token_for(body, self.config.first_token), {"proxy_received": received or time.time()})
            d.trace["dispatched"] = time.time()
            d.prefill.in_flight += 1
            d.decode.in_flight += 1
            try:
                if self.config.kv_mode.is_push:
                    return Leg(d, await self._push(path, body, d))
                return Leg(d, await self._pull(path, body, d))
            except PrefillFailed as e:
                self.end_leg(d)
                tried.add(d.prefill.url)
                self.metrics.retries.inc()
                log.warning("prefill %s failed (%s); retrying elsewhere", d.prefill.url, e.error)
                if not any(i.usable and i.url not in tried for i in self.prefills):
                    raise e.error from None
            except DecodeUnavailable as e:  # push: P's leg was cancelled with it; dispatch both anew
                self.end_leg(d)
                tried_d.add(d.decode.url)
                self.metrics.rerouted.labels(role="decode", reason=e.reason).inc()
                if not any(i.usable and i.url not in tried_d for i in self.decodes):
                    raise e.error from None
            except LegError as e:
                self.end_leg(d)
                if not self._shed_elsewhere(e, tried if e.instance is d.prefill else tried_d):
                    raise
            except BaseException:
                self.end_leg(d)
                raise
        raise AssertionError("unreachable")

    def _shed_elsewhere(self, e: LegError, tried: set[str]) -> bool:
        """An instance shed the leg: remember it for its Retry-After; True if another instance of its
        role can be tried (healthy, not tried for this request, not shedding)."""
        inst = e.instance
        if not e.shed or inst is None:
            return False
        inst.shed_until = time.monotonic() + _seconds(e.retry_after)
        tried.add(inst.url)
        self.metrics.shed.labels(role=inst.role, status=str(e.status)).inc()
        pool = self.prefills if inst.role == "prefill" else self.decodes
        now = time.monotonic()
        if not any(i.healthy and i.url not in tried and i.shed_until <= now for i in pool):
            return False
        self.metrics.shed_retries.inc()
        log.info("%s shed a request (%d); trying another %s instance", inst.url, e.status, inst.role)
        return True

    def end_leg(self, d: Dispatch) -> None:
        d.prefill.in_flight -= 1
        d.decode.in_flight -= 1
        d.prefill.served += 1
        d.decode.served += 1

    # ---- the two flows -------------------------------------------------------------------
    async def _push(self, path: str, body: dict, d: Dispatch) -> aiohttp.ClientResponse:
        p_params = kp.PrefillLegParams(transfer_id=d.transfer_id, mode=self.config.kv_mode,
                                       decode_engine_id=d.decode.engine_id)
        d_params = self._decode_params(d, None)
        p_task = asyncio.create_task(self._prefill_leg(path, body, p_params, d))
        d_task = asyncio.create_task(self._open_decode(path, body, d_params, d))
        try:
            # D answers once its first token exists. A P leg failing before that cancels D (and may
            # be retried elsewhere); after it, P's answer only adds its timestamps to the trace.
            while not d_task.done():
                await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
                if p_task.done() and not d_task.done():
                    p_task.result()
            d_resp = d_task.result()
        except BaseException:
            await _cancel(p_task, d_task)
            raise
        p_task.add_done_callback(_retrieve)
        d.p_task = p_task  # its answer only adds P's stamps to the trace (_relay waits a little for it)
        return d_resp

    async def _pull(self, path: str, body: dict, d: Dispatch) -> aiohttp.ClientResponse:
        p_params = kp.PrefillLegParams(transfer_id=d.transfer_id, mode=KVMode.PULL)
        result = await self._prefill_leg(path, body, p_params, d)
        tried: set[str] = set()
        while True:
            try:
                return await self._open_decode(path, body, self._decode_params(d, result), d)
            except DecodeUnavailable as e:  # P holds the KV under its lease: another D can READ it
                tried.add(d.decode.url)
                self.metrics.rerouted.labels(role="decode", reason=e.reason).inc()
                try:
                    other = self.pick(self.decodes, "decode", tried)
                except web.HTTPServiceUnavailable:
                    raise e.error from None
                d.decode.in_flight -= 1
                other.in_flight += 1
                d.decode = other

    def _decode_params(self, d: Dispatch, result: kp.PrefillResult | None) -> kp.DecodeLegParams:
        first = d.first_token
        if result is not None:
            return result.to_decode_leg(first)
        p = d.prefill
        assert p.kv_host is not None and p.kv_port is not None
        return kp.DecodeLegParams(transfer_id=d.transfer_id, mode=self.config.kv_mode, prefill_engine_id=p.engine_id,
                                  prefill_kv_host=p.kv_host, prefill_kv_port=p.kv_port, first_token=first)

    async def _prefill_leg(self, path: str, body: dict, params: kp.PrefillLegParams, d: Dispatch) -> kp.PrefillResult:
        assert self.session is not None
        leg = prefill_body(body, kp.params_to_dict(params))
        d.trace["p_leg_sent"] = time.time()
        try:
            async with self.session.post(d.prefill.url + path, json=leg) as r:
                data = await r.read()
                error = LegError(r.status, data, d.prefill, r.headers.get("Retry-After"))
                if r.status >= 500:
                    if d.prefill.refused(r.status, data):
                        self.metrics.rerouted.labels(role="prefill", reason="draining").inc()
                    raise PrefillFailed(error)
                if r.status != 200:
                    raise error
        except aiohttp.ClientError as e:
            d.prefill.healthy = False  # the prober brings it back when it answers again
            message = f"prefill instance {d.prefill.url} unreachable: {e}"
            raise PrefillFailed(LegError(502, json.dumps(R.error_body(502, message)).encode())) from e
        d.trace["p_response"] = time.time()
        try:
            choice = json.loads(data)["choices"][0]
            d.trace.update(_prefill_trace(choice.get("kvpush_trace")))
            kv = choice["kv_transfer_params"]
            return kp.params_from_dict(kv, kp.PrefillResult)
        except (KeyError, IndexError, TypeError, ValueError, kp.ProtocolError) as e:
            raise LegError(502, json.dumps(R.error_body(502, f"prefill answered without KV params: {e}")).encode()) from e

    async def _open_decode(self, path: str, body: dict, params: kp.DecodeLegParams,
                           d: Dispatch) -> aiohttp.ClientResponse:
        assert self.session is not None
        leg = dict(body, kv_transfer_params=kp.params_to_dict(params))
        d.trace["d_leg_sent"] = time.time()
        try:
            resp = await self.session.post(d.decode.url + path, json=leg)
        except aiohttp.ClientError as e:
            d.decode.healthy = False
            message = f"decode instance {d.decode.url} unreachable: {e}"
            error = LegError(502, json.dumps(R.error_body(502, message)).encode())
            if isinstance(e, aiohttp.ClientConnectorError):  # not even connected (e.g. it just shut down)
                raise DecodeUnavailable(error, "unreachable") from e
            raise error from e
        if resp.status != 200:
            data = await resp.read()
            resp.release()
            error = LegError(resp.status, data, d.decode, resp.headers.get("Retry-After"))
            if d.decode.refused(resp.status, data):
                raise DecodeUnavailable(error, "draining")
            raise error
        return resp

    async def _relay(self, request: web.Request, d_resp: aiohttp.ClientResponse, d: Dispatch) -> web.StreamResponse:
        """Copy D's answer to the client; merge the proxy's timestamps into kvpush_trace."""
        complete = False
        try:
            if not d_resp.content_type.startswith("text/event-stream"):
                data = await d_resp.read()
                await _wait_prefill(d.p_task)
                data = _merge_trace_json(data, d.trace)
                complete = True
                self.metrics.requests.labels(status="200").inc()
                return web.Response(body=data, status=200, content_type="application/json")
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await out.prepare(request)
            async for line in d_resp.content:
                if b'"kvpush_trace"' in line:
                    await _wait_prefill(d.p_task)
                    line = _merge_trace_line(line, d.trace)
                if line.startswith(b"data: {"):  # stamped before the write: after it the client may have it
                    d.trace.setdefault("proxy_first_chunk", time.time())
                await out.write(line)
            complete = True
            await out.write_eof()
            self.metrics.requests.labels(status="200").inc()
            return out
        finally:
            if complete:
                d_resp.release()
            else:
                d_resp.close()  # the client left or the stream broke: D sees the disconnect and aborts


def _seconds(retry_after: str | None) -> float:
    """A Retry-After in seconds (an HTTP date or garbage counts as 1 s)."""
    try:
        return max(0.0, float(retry_after)) if retry_after is not None else 1.0
    except ValueError:
        return 1.0


def prefill_body(body: dict, kv_params: dict) -> dict:
    """P's leg: the client's request unchanged, so that P validates it as D does (same 4xx). P's connector
    caps it to one token, and a prefill instance answers with one JSON body whatever `stream` says."""
    return dict(body, kv_transfer_params=kv_params)


def first_token_for(body: dict, configured: FirstToken) -> FirstToken:
    """`from-prefill` only where P's first token is exactly what D would sample: not when the client
    asks for logprobs (P's are not transferred) or samples with a seed (P's generator is not D's)."""
    logprobs = body.get("logprobs")
    wants_logprobs = logprobs is not None and logprobs is not False
    temperature = body.get("temperature")
    seeded = body.get("seed") is not None and (temperature is None or temperature != 0)
    return FirstToken.RECOMPUTE if wants_logprobs or seeded else configured


def _prefill_trace(trace: object) -> dict[str, float]:
    """P's timestamps under the names the handover breakdown uses."""
    if not isinstance(trace, dict):
        return {}
    names = {"arrived": "p_admitted", "prefill_done": "p_prefill_done", "api_received": "p_api_received",
             "api_answered": "p_answered"}
    return {names[k]: float(v) for k, v in trace.items() if k in names and isinstance(v, (int, float))}


def _error_code(body: bytes) -> object:
    """The `code` of an OpenAI-style error body, or None."""
    try:
        error = json.loads(body).get("error")
        return error.get("code") if isinstance(error, dict) else None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return None


def _parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise web.HTTPBadRequest(reason=f"malformed JSON body: {e}") from e
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(reason="the request body must be a JSON object")
    if "kv_transfer_params" in body:
        raise web.HTTPBadRequest(reason="kv_transfer_params is set by the proxy, not by clients")
    return body


def _merge_trace_json(data: bytes, trace: dict[str, float]) -> bytes:
    try:
        obj = json.loads(data)
        for choice in obj.get("choices", []):
            if isinstance(choice.get("kvpush_trace"), dict):
                choice["kvpush_trace"].update(trace)
        return json.dumps(obj).encode()
    except (json.JSONDecodeError, AttributeError):
        return data


def _merge_trace_line(line: bytes, trace: dict[str, float]) -> bytes:
    if not line.startswith(b"data: "):
        return line
    return b"data: " + _merge_trace_json(line[6:].strip(), trace) + b"\n"


async def _wait_prefill(p_task: asyncio.Task | None) -> None:
    """Push: D may end before P's answer (with P's stamps) arrived; its final chunk, which carries
    the trace, waits for it at most TRACE_WAIT_S (the first token never waits)."""
    if p_task is not None and not p_task.done():
        await asyncio.wait({p_task}, timeout=TRACE_WAIT_S)


def _retrieve(task: asyncio.Task) -> None:
    """A P leg that ends after D already answered: its outcome no longer matters to the client."""
    if not task.cancelled() and task.exception() is not None:
        log.info("prefill leg ended after decode answered: %s", task.exception())


async def _cancel(*tasks: asyncio.Task) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        try:
            resp = await t
            if isinstance(resp, aiohttp.ClientResponse):
                resp.close()
        except (TimeoutError, asyncio.CancelledError, LegError, PrefillFailed, DecodeUnavailable, aiohttp.ClientError):
            pass  # the failure that made us cancel is reported by the caller


async def serve_proxy(config: ProxyConfig) -> None:
    from kvpush.server.serve import start_http, wait_for_signal

    proxy = Proxy(config)
    await proxy.start()
    runner = await start_http(proxy.build_app(), config.host, config.port)
    print(f"kvpush: proxy ({config.kv_mode.value}) on http://{config.host}:{config.port} -> "
          f"{len(proxy.prefills)} prefill, {len(proxy.decodes)} decode", flush=True)
    try:
        await wait_for_signal()
    finally:
        await runner.cleanup()
        await proxy.close()
