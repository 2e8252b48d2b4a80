"""Batched completions prompts through the proxy: one P/D dispatch per prompt, answers merged.

A colocated instance answers `"prompt": [p0, p1, ...]` (strings or token-id lists) with one choice
per prompt. One transfer moves one prompt's KV, so the proxy splits such a request into one request
per prompt (the same body with `prompt` = p_i), dispatched concurrently, each with its own
transfer_id `<id>-<i>`, and merges the answers into what a colocated instance would send:
    JSON: choices in prompt order, each with its `index`; usage summed; one id.
    SSE:  every chunk with its choice's `index` and one id; one usage chunk at the end (when
          `stream_options.include_usage`), one `[DONE]`.
Any leg failing before D's answer started fails the whole request with that leg's status and body
(the lowest index among the legs failed by then); the other legs are cancelled and their instances
abort them. A leg failing mid-stream ends the stream with its error event, as an instance does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from kvpush.protocol import http as H
from kvpush.protocol import kv_params as kp
from kvpush.proxy.request import ClientRequest

if TYPE_CHECKING:
    from kvpush.proxy.proxy import Leg, Proxy

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


async def serve_batch(proxy: Proxy, request: web.Request, req: ClientRequest, prompts: list) -> web.StreamResponse:
    base = kp.new_transfer_id()
    tasks = [asyncio.create_task(proxy.open_leg(req.with_prompt(p), f"{base}-{i}",
                                                         forced=proxy.forced_route(request)))
             for i, p in enumerate(prompts)]
    legs = await _open_all(proxy, tasks)
    complete = False
    try:
        out: web.StreamResponse
        if legs[0].response.content_type.startswith("text/event-stream"):
            out, complete = await _stream(proxy, request, legs, f"cmpl-{base}")
        else:
            out, complete = H.json_response(await _merge_json(proxy, legs, f"cmpl-{base}")), True
        proxy.metrics.requests.labels(status="200").inc()
        return out
    finally:
        for leg in legs:
            _finish(proxy, leg, complete)


async def _open_all(proxy: Proxy, tasks: list[asyncio.Task]) -> list[Leg]:
    """Every leg's D answered 200, or the first failure (lowest index among those failed) is raised and
    every other leg cancelled; a leg that had already opened is closed, so that D aborts it."""
    try:
        pending = set(tasks)
        while pending:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
            if failed:
                raise failed[0].exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks:
            if not t.cancelled() and t.exception() is None:
                _finish(proxy, t.result(), complete=False)
        raise


def _finish(proxy: Proxy, leg: Leg, complete: bool) -> None:
    if complete:
        leg.response.release()
    else:
        leg.response.close()  # D sees the disconnect and aborts the request
    proxy.end_leg(leg.dispatch)


def _with_index(proxy: Proxy, obj: dict, index: int, leg: Leg, rid: str) -> dict:
    """One leg's answer or chunk as choice `index` of the batch; the proxy's timestamps in its trace."""
    obj["id"] = rid
    for choice in obj.get("choices") or []:
        choice["index"] = index
        proxy.annotate(leg.dispatch, choice)
    return obj


async def _merge_json(proxy: Proxy, legs: list[Leg], rid: str) -> dict:
    try:
        outs = [_with_index(proxy, json.loads(await leg.response.read()), i, leg, rid) for i, leg in enumerate(legs)]
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, TypeError) as e:
        raise web.HTTPBadGateway(reason=f"decode instance answered with malformed JSON: {e}") from e
    merged = outs[0]
    merged["choices"] = [c for out in outs for c in out.get("choices") or []]
    merged["usage"] = sum_usage([out.get("usage") for out in outs])
    return merged


def sum_usage(usages: list) -> dict | None:
    """Field-wise sum of usage objects (nested details too), as an instance counts a batch."""
    dicts = [u for u in usages if isinstance(u, dict)]
    if not dicts:
        return None
    out: dict = {}
    for key in dicts[0]:
        values = [u.get(key) for u in dicts]
        if all(isinstance(v, dict) for v in values):
            out[key] = sum_usage(values)
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            out[key] = sum(values)
        else:
            out[key] = values[0]
    return out


# ---- streaming -----------------------------------------------------------------------------
async def _stream(proxy: Proxy, request: web.Request, legs: list[Leg], rid: str) -> tuple[web.StreamResponse, bool]:
    """Relay the legs' events as one stream; also says whether every leg's stream ran to its [DONE]."""
    out = web.StreamResponse(headers=SSE_HEADERS)
    await out.prepare(request)
    usage_chunks: list[dict] = []
    async with aclosing(_events(legs)) as events:
        async for i, event in events:
            if event is None:  # a leg's stream broke off without [DONE]: so does the client's
                await out.write_eof()
                return out, False
            if "error" in event:  # a leg failed mid-stream: the batch ends with its error
                await out.write(H.sse(event))
                await out.write(H.SSE_DONE)
                await out.write_eof()
                return out, False
            if event.get("choices") == [] and event.get("usage") is not None:
                usage_chunks.append(event)
                continue
            await out.write(H.sse(_with_index(proxy, event, i, legs[i], rid)))
    if usage_chunks:
        last = dict(usage_chunks[0], id=rid, usage=sum_usage([c["usage"] for c in usage_chunks]))
        await out.write(H.sse(last))
    await out.write(H.SSE_DONE)
    await out.write_eof()
    return out, True


async def _events(legs: list[Leg]) -> AsyncGenerator[tuple[int, dict | None], None]:
    """Every leg's SSE events as they arrive, tagged with the leg's index; (i, None) when leg i's stream
    ended without [DONE]. Ends when every leg sent [DONE]."""
    queue: asyncio.Queue[tuple[int, dict | None, bool]] = asyncio.Queue()

    async def pump(i: int, resp: aiohttp.ClientResponse) -> None:
        done = False
        try:
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                await queue.put((i, json.loads(payload), False))
        except (aiohttp.ClientError, json.JSONDecodeError, UnicodeDecodeError):
            done = False
        await queue.put((i, None, done))

    tasks = [asyncio.create_task(pump(i, leg.response)) for i, leg in enumerate(legs)]
    try:
        remaining = len(legs)
        while remaining:
            i, event, done = await queue.get()
            if event is not None:
                yield i, event
            elif done:
                remaining -= 1
            else:
                yield i, None
                return
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
