"""The proxy's HTTP routes: the OpenAI endpoints (Proxy.handle), /v1/models (a decode instance's),
/health (503 until a P and a D are usable), /metrics and POST /reset_prefix_cache, behind one middleware
that checks the API key and turns a leg's error into the client's answer (with its Retry-After)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from aiohttp import web

from kvpush.protocol import http as H
from kvpush.proxy.legs import LegError

if TYPE_CHECKING:
    from kvpush.proxy.proxy import Proxy

ROUTES = ("/v1/completions", "/v1/chat/completions")
NO_INSTANCE_RETRY_AFTER_S = 1  # Retry-After of the proxy's own 503 (no healthy instance of a role)


def build_app(proxy: Proxy) -> web.Application:
    app = web.Application(middlewares=[_errors(proxy)], client_max_size=8 << 20)
    for route in ROUTES:
        app.router.add_post(route, proxy.handle)
    app.router.add_get("/v1/models", partial(_models, proxy))
    app.router.add_get("/health", partial(_health, proxy))
    app.router.add_get("/metrics", partial(_metrics, proxy))
    app.router.add_post("/reset_prefix_cache", proxy.reset_prefix_caches)
    return app


def _errors(proxy: Proxy):
    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        return await _guarded(proxy, request, handler)

    return middleware


async def _guarded(proxy: Proxy, request: web.Request, handler) -> web.StreamResponse:
    """The API key check, and a leg's error (or the proxy's own HTTP error) as the client's answer."""
    key = proxy.config.api_key
    guarded = request.path.startswith("/v1/") or request.path == "/reset_prefix_cache"
    if key and guarded and request.headers.get("Authorization") != f"Bearer {key}":
        return H.error_response(401, "invalid or missing API key")
    try:
        return await handler(request)
    except LegError as e:
        proxy.metrics.requests.labels(status=str(e.status)).inc()
        headers = {"Retry-After": e.retry_after} if e.retry_after is not None else None
        return web.Response(body=e.body, status=e.status, content_type="application/json", headers=headers)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        proxy.metrics.requests.labels(status=str(e.status)).inc()
        resp = H.error_response(e.status, e.reason or "error")
        if e.status == 503:
            resp.headers["Retry-After"] = str(NO_INSTANCE_RETRY_AFTER_S)
        return resp


async def _health(proxy: Proxy, request: web.Request) -> web.Response:
    if not proxy.ready():
        return H.error_response(503, "no healthy prefill or decode instance")
    return web.Response(text="ok")


async def _models(proxy: Proxy, request: web.Request) -> web.Response:
    inst = proxy.pick(proxy.decodes, "decode")
    assert proxy.session is not None
    async with proxy.session.get(inst.url + "/v1/models") as r:
        return web.Response(body=await r.read(), status=r.status, content_type="application/json")


async def _metrics(proxy: Proxy, request: web.Request) -> web.Response:
    proxy.metrics.update_instances(proxy.prefills + proxy.decodes)
    return web.Response(body=proxy.metrics.render(), content_type="text/plain", charset="utf-8")
