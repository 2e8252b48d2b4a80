"""`kvpush proxy`: the front door of an xPyD deployment.

Per request:  pick a P and a D (round-robin or least-loaded among healthy instances), mint a
transfer_id, then
    push: dispatch both legs at once (P: the request + PrefillLegParams, which P caps to one
          token; D: the request + DecodeLegParams naming P); stream D's answer back.
    pull: send P's leg, wait for its PrefillResult, forward it to D (DecodeLegParams with P's
          block ids); stream D's answer back.
    auto: per request one of push, push-layerwise, pull, or local (D alone prefills the plain
          request), chosen by auto/router.py's AutoRouter (auto/choice.py's cost model); with no usable P, local. A client
          may name the route (header X-KVPush-KV-Mode). The answer says which (kvpush_route).
A completions request with several prompts is one such dispatch per prompt (batch.py); D's answer
goes back to the client through relay.py, or, for a vLLM D under --first-token from-prefill, through
first_token.py (P's token first, then D's stream checked against it).
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

import aiohttp
from aiohttp import web

from kvpush.config import FirstToken, KVMode, ProxyConfig
from kvpush.protocol import http as H
from kvpush.protocol import kv_params as kp
from kvpush.protocol.trace import Trace
from kvpush.proxy import batch
from kvpush.proxy.app import build_app
from kvpush.proxy.auto.records import Route
from kvpush.proxy.auto.router import AutoRouter
from kvpush.proxy.first_token import PrefillAnswer, eligible, relay_first_from_prefill
from kvpush.proxy.legs import (
    DecodeUnavailable,
    Dispatch,
    Leg,
    LegError,
    PrefillFailed,
    cancel,
    retrieve,
    seconds,
)
from kvpush.proxy.metrics import ProxyMetrics
from kvpush.proxy.pool import Instance, InstancePool
from kvpush.proxy.relay import relay
from kvpush.proxy.request import ClientRequest

log = logging.getLogger("kvpush.proxy")
ROUTE_HEADER = "X-KVPush-KV-Mode"  # a client may name the route of its request (auto proxies)
__all__ = ["Proxy", "serve_proxy"]



class Proxy(InstancePool):
    def __init__(self, config: ProxyConfig) -> None:
        super().__init__(config)
        self.config = config
        self.metrics = ProxyMetrics()
        self.auto = (AutoRouter(config.auto_stall_weight, config.auto_local_max_ms / 1e3, config.auto_local_share,
                                config.auto_local_window_s, near_tie=config.auto_near_tie,
                                residual_alpha=config.auto_residual_alpha, switch_margin=config.auto_switch_margin,
                                busy_period=config.auto_busy_period)
                     if config.kv_mode is KVMode.AUTO else None)
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
        while not self.ready() and time.monotonic() < deadline:
            await self.probe_all()
            if not self.ready():
                await asyncio.sleep(0.5)
        self._prober = asyncio.create_task(self._probe_loop())

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
        if self.session is not None:
            await self.session.close()
    def ready(self) -> bool:
        """Auto serves from D alone when no P is usable (local route): a usable D is enough."""
        if self.auto is not None:
            return any(i.usable for i in self.decodes)
        return super().ready()

    def restarted(self, inst: Instance) -> None:
        if self.auto is not None:
            self.auto.forget(inst.url)  # its prefix cache is empty

    # ---- HTTP ----------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        """The proxy's routes (app.py); `handle` serves the OpenAI endpoints."""
        return build_app(self)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        received = time.time()
        req = ClientRequest.parse(request.path, await request.read())
        prompts = req.batch()
        if prompts is not None:
            return await batch.serve_batch(self, request, req, prompts)
        forced = self.forced_route(request)
        leg = await self.open_leg(req, kp.new_transfer_id(), received, forced, single=True)
        try:
            if leg.dispatch.first_from_prefill and leg.response.content_type.startswith("text/event-stream"):
                return await relay_first_from_prefill(self, request, leg.response, leg.dispatch)
            return await relay(self, request, leg.response, leg.dispatch)
        finally:
            self.end_leg(leg.dispatch)

    def forced_route(self, request: web.Request) -> Route | None:
        """The route the client named (header X-KVPush-KV-Mode: push|push-layerwise|pull|local); a
        fixed-mode proxy takes only its own mode there (400 otherwise)."""
        name = request.headers.get(ROUTE_HEADER)
        if name is None:
            return None
        try:
            route = Route(name.strip().lower())
        except ValueError:
            raise web.HTTPBadRequest(reason=f"{ROUTE_HEADER}: {name!r} is not one of "
                                            f"{', '.join(r.value for r in Route)}") from None
        if self.auto is None and route.value != self.config.kv_mode.value:
            raise web.HTTPBadRequest(reason=f"{ROUTE_HEADER}: this proxy runs --kv-mode {self.config.kv_mode.value}; "
                                            f"only --kv-mode auto takes other routes")
        return route

    async def open_leg(self, req: ClientRequest, transfer_id: str, received: float | None = None,
                       forced: Route | None = None, single: bool = False) -> Leg:
        """Dispatch one prompt's P and D legs; return once D answered 200 (its first token exists).
        A prefill leg that fails before that (P unreachable or answering 5xx) is retried on another
        prefill instance, as transfer `<transfer_id>.<attempt>`; a leg an instance sheds (429 / 503) is
        retried on another instance of that role not tried yet and not shedding, if there is one (else
        the client gets the 429 / 503 and its Retry-After). `single`: the client's request is this one
        prompt, so its stream may start with P's token (first_token.py). The caller must `end_leg` the result."""
        tried: set[str] = set()
        tried_d: set[str] = set()
        for attempt in itertools.count():
            d = self._dispatch(req, f"{transfer_id}.{attempt}" if attempt else transfer_id, tried, tried_d, forced)
            d.trace.proxy_received = received or time.time()
            d.trace.dispatched = time.time()
            d.first_from_prefill = (single and d.prefill is not None and d.decode.vllm
                                    and self.config.first_token is FirstToken.FROM_PREFILL
                                    and eligible(req.body, req.stream))
            if d.prefill is not None:
                d.prefill.in_flight += 1
            d.decode.in_flight += 1
            try:
                if d.prefill is None:
                    return Leg(d, await self._local(req, d))
                if d.mode.is_push:
                    return Leg(d, await self._push(req, d))
                return Leg(d, await self._pull(req, d))
            except PrefillFailed as e:
                self.end_leg(d)
                assert d.prefill is not None
                tried.add(d.prefill.url)
                self.metrics.retries.inc()
                log.warning("prefill %s failed (%s); retrying elsewhere", d.prefill.url, e.error)
                if not any(i.usable and i.url not in tried for i in self.prefills) and (
                        self.auto is None or forced is not None):  # auto: D can still prefill it
                    raise e.error from None
            except DecodeUnavailable as e:  # push: P's leg was cancelled with it; dispatch both anew
                self.end_leg(d)
                tried_d.add(d.decode.url)
                self.metrics.rerouted.labels(role="decode", reason=e.reason).inc()
                if not any(i.usable and i.url not in tried_d for i in self.decodes):
                    raise e.error from None
            except LegError as e:
                self.end_leg(d)
                if self._shed_elsewhere(e, tried if e.instance is d.prefill else tried_d):
                    continue
                if self.auto is None or forced is not None or d.prefill is None or e.instance is not d.prefill \
                        or not e.shed:
                    raise
                tried.add(d.prefill.url)  # auto: the last P sheds; D can still prefill it (local)
            except BaseException:
                self.end_leg(d)
                raise
        raise AssertionError("unreachable")

    def _dispatch(self, req: ClientRequest, transfer_id: str, tried: set[str], tried_d: set[str],
                  forced: Route | None) -> Dispatch:
        """Pick D, P and (auto) the route. An auto proxy with no usable P serves from D alone."""
        decode = self.pick(self.decodes, "decode", exclude=tried_d)
        # vLLM computes the last prompt position again on D: P's first token is never D's first output there
        # (the proxy may send it to the client first: open_leg's first_from_prefill, first_token.py)
        first = FirstToken.RECOMPUTE if decode.vllm else req.first_token(self.config.first_token)
        if self.auto is None:
            return Dispatch(self.pick(self.prefills, "prefill", exclude=tried), decode, transfer_id, first,
                            self.config.kv_mode)
        usable = forced is not Route.LOCAL and any(i.usable and i.url not in tried for i in self.prefills)
        if forced is not None and forced.remote and not usable:
            raise web.HTTPServiceUnavailable(reason="no healthy prefill instance")
        prefill = self.pick(self.prefills, "prefill", exclude=tried) if usable else None
        decision = self.auto.decide(req, prefill.url if prefill else None, decode.url, decode.in_flight,
                                    decode.block_size, forced)
        log.debug("route %s for %s: %s", decision.route.value, transfer_id, decision.to_json())
        self.metrics.routes.labels(route=decision.route.value).inc()
        self.auto.dispatched(decision)
        if decision.route is Route.LOCAL:
            return Dispatch(None, decode, transfer_id, first, KVMode.PUSH, decision=decision)
        return Dispatch(prefill, decode, transfer_id, first, KVMode(decision.route.value), decision=decision)

    def _shed_elsewhere(self, e: LegError, tried: set[str]) -> bool:
        """An instance shed the leg: remember it for its Retry-After; True if another instance of its
        role can be tried (healthy, not tried for this request, not shedding)."""
        inst = e.instance
        if not e.shed or inst is None:
            return False
        inst.shed_until = time.monotonic() + seconds(e.retry_after)
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
        if d.prefill is not None:
            d.prefill.in_flight -= 1
            d.prefill.served += 1
        d.decode.in_flight -= 1
        d.decode.served += 1
        if self.auto is not None and d.decision is not None:
            self.auto.prefilled(d.decision)  # a no-op unless not released yet (it failed, or push: D's
            # answer ended before P's HTTP answer came; D's first token means P's prefill was done)

    # ---- the two flows -------------------------------------------------------------------
    async def _local(self, req: ClientRequest, d: Dispatch) -> aiohttp.ClientResponse:
        """Auto's local route: the request goes to D as it is; D prefills it (no P leg, no transfer)."""
        assert self.auto is not None and d.decision is not None
        auto, decision = self.auto, d.decision
        # D answers a non-streamed request when the whole answer exists: its prefill counts as done once
        # it should be (its estimate), not when the answer arrives
        timer = None if req.stream else asyncio.get_running_loop().call_later(
            decision.estimates_s.get("local", 0.0), auto.prefilled, decision)
        try:
            resp = await self._open_decode(req, None, d)
        finally:
            if timer is not None:
                timer.cancel()
        d.trace.local_prefilled = time.time()
        auto.prefilled(decision)
        return resp

    async def _push(self, req: ClientRequest, d: Dispatch) -> aiohttp.ClientResponse:
        assert d.prefill is not None
        p_params = kp.PrefillLegParams(transfer_id=d.transfer_id, mode=d.mode, decode_engine_id=d.decode.engine_id)
        d_params = self._decode_params(d, None)
        p_task = asyncio.create_task(self._prefill_leg(req, p_params, d))
        d_task = asyncio.create_task(self._open_decode(req, d_params, d))
        try:
            # D answers once its first token exists. A P leg failing before that cancels D (and may
            # be retried elsewhere); after it, P's answer only adds its timestamps to the trace.
            while not d_task.done():
                await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
                if p_task.done() and not d_task.done():
                    p_task.result()
            d_resp = d_task.result()
        except BaseException:
            await cancel(p_task, d_task)
            raise
        p_task.add_done_callback(retrieve)
        d.p_task = p_task  # its answer only adds P's stamps to the trace (relay.py waits a little for it)
        return d_resp

    async def _pull(self, req: ClientRequest, d: Dispatch) -> aiohttp.ClientResponse:
        p_params = kp.PrefillLegParams(transfer_id=d.transfer_id, mode=KVMode.PULL)
        result = await self._prefill_leg(req, p_params, d)
        tried: set[str] = set()
        while True:
            try:
                return await self._open_decode(req, self._decode_params(d, result), d)
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
                if self.auto is not None and d.decision is not None:
                    self.auto.rerouted(d.decision, other.url)

    def _decode_params(self, d: Dispatch, result: kp.PrefillResult | None) -> kp.DecodeLegParams:
        first = d.first_token
        if result is not None:
            return result.to_decode_leg(first)
        p = d.prefill
        assert p is not None and p.kv_host is not None and p.kv_port is not None
        return kp.DecodeLegParams(transfer_id=d.transfer_id, mode=d.mode, prefill_engine_id=p.engine_id,
                                  prefill_kv_host=p.kv_host, prefill_kv_port=p.kv_port, first_token=first)

    async def _prefill_leg(self, req: ClientRequest, params: kp.PrefillLegParams, d: Dispatch) -> kp.PrefillResult:
        try:
            return await self._send_prefill(req, params, d)
        finally:
            if d.decision is not None and self.auto is not None:
                self.auto.prefilled(d.decision)  # answered, failed or cancelled: no longer queued on P

    async def _send_prefill(self, req: ClientRequest, params: kp.PrefillLegParams,
                            d: Dispatch) -> kp.PrefillResult:
        assert self.session is not None and d.prefill is not None
        leg = req.leg(params, vllm=d.prefill.vllm)
        d.trace.p_leg_sent = time.time()
        try:
            async with self.session.post(d.prefill.url + req.path, json=leg, headers=d.headers()) as r:
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
            raise PrefillFailed(LegError(502, json.dumps(H.error_body(502, message)).encode())) from e
        d.trace.p_response = time.time()
        try:
            body = json.loads(data)
            choice = body["choices"][0]
            d.trace.update(Trace.from_json(choice.get("kvpush_trace")).as_prefill())
            kv = choice.get("kv_transfer_params") or body["kv_transfer_params"]  # kvpush's place, or vLLM's
            result = kp.params_from_dict(kv, kp.PrefillResult)
            if d.first_from_prefill:
                d.prefill_answer = PrefillAnswer.parse(body, chat=req.messages is not None)
            return result
        except (KeyError, IndexError, TypeError, ValueError, kp.ProtocolError) as e:
            raise LegError(502, json.dumps(H.error_body(502, f"prefill answered without KV params: {e}")).encode()) from e

    async def _open_decode(self, req: ClientRequest, params: kp.DecodeLegParams | None,
                           d: Dispatch) -> aiohttp.ClientResponse:
        """D's leg (params None: a plain request D computes itself); returns once D answered 200."""
        assert self.session is not None
        leg = req.leg(params)
        d.trace.d_leg_sent = time.time()
        try:
            resp = await self.session.post(d.decode.url + req.path, json=leg, headers=d.headers())
        except aiohttp.ClientError as e:
            d.decode.healthy = False
            message = f"decode instance {d.decode.url} unreachable: {e}"
            error = LegError(502, json.dumps(H.error_body(502, message)).encode())
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

    def annotate(self, d: Dispatch, choice: dict) -> None:
        """D's final choice (it carries kvpush_trace): the proxy's and P's stamps merged into its trace;
        auto: the route taken and why (kvpush_route), and the cost model learns from the answer."""
        trace = choice.get("kvpush_trace")
        if not isinstance(trace, dict):
            return
        trace.update(d.trace.stamps())
        if d.decision is None or self.auto is None:
            return
        choice["kvpush_route"] = d.decision.to_json()
        ratio = self.auto.finished(d.decision, Trace.from_json(trace), choice.get("kvpush_prompt"))
        if ratio is not None:
            self.metrics.estimate_ratio.labels(route=d.decision.route.value).observe(ratio)


async def serve_proxy(config: ProxyConfig) -> None:
    proxy = Proxy(config)
    await proxy.start()
    runner = await H.start_http(proxy.build_app(), config.host, config.port)
    print(f"kvpush: proxy ({config.kv_mode.value}) on http://{config.host}:{config.port} -> "
          f"{len(proxy.prefills)} prefill, {len(proxy.decodes)} decode", flush=True)
    try:
        await H.wait_for_signal()
    finally:
        await runner.cleanup()
        await proxy.close()
