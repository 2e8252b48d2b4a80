"""D's answer back to the client: copied as it comes (JSON or server-sent events), with the proxy's and
P's timestamps merged into the final choice's kvpush_trace (and, auto, the route's record).

    OPEN (D answered 200) -> COPYING -> COMPLETE (released to the pool) | BROKEN or LEFT (closed: D sees
    the disconnect and aborts the request)
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from kvpush.proxy.legs import Dispatch, merge_trace_json, merge_trace_line, wait_prefill

if TYPE_CHECKING:
    from kvpush.proxy.proxy import Proxy

log = logging.getLogger("kvpush.proxy")


async def relay(proxy: Proxy, request: web.Request, d_resp: aiohttp.ClientResponse, d: Dispatch) -> web.StreamResponse:
    """Copy D's answer to the client; merge the proxy's timestamps into kvpush_trace."""
    complete = False
    try:
        if not d_resp.content_type.startswith("text/event-stream"):
            data = await d_resp.read()
            await wait_prefill(d.p_task)
            data = merge_trace_json(data, lambda c: proxy.annotate(d, c))
            complete = True
            proxy.metrics.requests.labels(status="200").inc()
            return web.Response(body=data, status=200, content_type="application/json")
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)
        try:
            async for line in d_resp.content:
                if b'"kvpush_trace"' in line:
                    await wait_prefill(d.p_task)
                    line = merge_trace_line(line, lambda c: proxy.annotate(d, c))
                if line.startswith(b"data: {"):  # stamped before the write: after it the client may have it
                    d.trace.set_once("proxy_first_chunk", time.time())
                await out.write(line)
            complete = True
            await out.write_eof()
        except ConnectionResetError:  # the client closed its end: once it had [DONE], that is no error
            if not complete:
                log.info("client left during the stream of %s", d.transfer_id)
                return out
        proxy.metrics.requests.labels(status="200").inc()
        return out
    finally:
        if complete:
            d_resp.release()
        else:
            d_resp.close()  # the client left or the stream broke: D sees the disconnect and aborts
