"""A front door for vLLM's own NixlPushConnector (benchmarks/vllm_connector.py): the protocol of vLLM's
toy push proxy, which vllm-router does not speak.

    python benchmarks/vllm_push_proxy.py --port PORT --prefill URL --decode URL

Per request: P gets the request for one token, not streamed, with ``do_remote_decode``; its answer's
``kv_transfer_params`` name P (engine, request, host, port); D then gets the client's request with
``do_remote_prefill`` and those coordinates (no block ids: D registers its blocks with P, P WRITEs).
D's answer goes back to the client as it comes. P and D run one after the other, as in vLLM's proxy.
"""

from __future__ import annotations

import argparse
import uuid

import aiohttp
from aiohttp import web

P_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")


def prefill_body(body: dict) -> dict:
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "min_completion_tokens")}
    out.update(stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_params(p_answer: dict) -> dict:
    kv = p_answer.get("kv_transfer_params") or {}
    return {"do_remote_prefill": True, "do_remote_decode": False, **{k: kv.get(k) for k in P_FIELDS}}


def app(prefill: str, decode: str) -> web.Application:
    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        headers = {"X-Request-Id": uuid.uuid4().hex}
        session: aiohttp.ClientSession = request.app["session"]
        async with session.post(prefill + request.path, json=prefill_body(body), headers=headers) as r:
            if r.status != 200:
                return web.json_response({"error": {"message": await r.text(), "type": "prefill_error"}},
                                         status=r.status)
            p_answer = await r.json()
        body["kv_transfer_params"] = decode_params(p_answer)
        out = web.StreamResponse()
        async with session.post(decode + request.path, json=body, headers=headers) as r:
            out.set_status(r.status)
            out.content_type = r.content_type
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
        await out.write_eof()
        return out

    async def models(request: web.Request) -> web.Response:
        async with request.app["session"].get(decode + "/v1/models") as r:
            return web.json_response(await r.json(), status=r.status)

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def session_ctx(a: web.Application):
        a["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        yield
        await a["session"].close()

    a = web.Application()
    a.cleanup_ctx.append(session_ctx)
    a.add_routes([web.post("/v1/completions", relay), web.post("/v1/chat/completions", relay),
                  web.get("/v1/models", models), web.get("/health", health)])
    return a


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    ap.add_argument("--port", type=int, required=True, help="port to bind (required)")
    ap.add_argument("--prefill", required=True, help="the prefill instance's URL (required)")
    ap.add_argument("--decode", required=True, help="the decode instance's URL (required)")
    args = ap.parse_args()
    web.run_app(app(args.prefill, args.decode), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
