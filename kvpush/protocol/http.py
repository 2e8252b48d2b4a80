"""HTTP plumbing that the instance's API process and the proxy share: OpenAI-style error bodies, JSON and
server-sent-event responses, starting an aiohttp server, and SIGINT/SIGTERM as events.

No engine types: the proxy imports this without loading the instance.
"""

from __future__ import annotations

import asyncio
import signal

import msgspec
from aiohttp import web

_json = msgspec.json.Encoder()

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "overloaded_error",
               503: "service_unavailable",
               502: "upstream_error", 500: "server_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code or status}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> web.Response:
    return json_response(error_body(status, message, param, code), status=status)


def json_response(body: object, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(body), status=status, content_type="application/json")


def sse(body: object) -> bytes:
    return b"data: " + _json.encode(body) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def start_http(app: web.Application, host: str, port: int, shutdown_timeout_s: float = 60.0) -> web.AppRunner:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout_s)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True).start()
    return runner


async def wait_for_signal() -> None:
    await signal_events()[0].wait()


def signal_events() -> tuple[asyncio.Event, asyncio.Event]:
    """Events set by the first and by a second SIGINT/SIGTERM."""
    loop = asyncio.get_running_loop()
    first, second = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (second if first.is_set() else first).set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    return first, second
