"""The proxy and draining instances, against fake instances in this process (aiohttp, loopback): a
leg refused with code "draining" goes to another instance and the draining one is never chosen again;
a decode instance that cannot be connected to is skipped the same way; an instance whose kv_info says
it drains is not chosen; a client closing once it read [DONE] is no error. The real servers are in
test_drain.py."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import ClientSession, web

from kvpush.config import KVMode, ProxyConfig
from kvpush.launcher.launch import free_port
from kvpush.protocol import http as H
from kvpush.protocol import kv_params as kp
from kvpush.proxy.proxy import Proxy


class Fake:
    """One fake instance: answers kv_info, and completions as P (a PrefillResult) or D (some text)."""

    def __init__(self, role: str, mode: str, draining: bool = False) -> None:
        self.role, self.mode, self.draining = role, mode, draining
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.hits = 0  # completions received
        self.shed = False  # answer 429 with Retry-After (no capacity)
        self.plain = 0  # completions received without kv_transfer_params (an auto proxy's local route)
        self.leg_delay_s = 0.0  # D: how long a leg with kv_transfer_params takes to answer
        self.resets = 0  # POST /reset_prefix_cache received
        self.slow_s = 0.0  # how long GET /v1/kv_info takes to answer (a busy instance)
        self.reset_status = 200
        self.runner: web.AppRunner | None = None

    async def start(self) -> Fake:
        app = web.Application()
        app.router.add_get("/v1/kv_info", self.kv_info)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/reset_prefix_cache", self.reset)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def kv_info(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.slow_s)
        return web.json_response({"engine_id": f"{self.role}-{self.port}", "role": self.role, "kv_mode": self.mode,
                                  "kv_host": "127.0.0.1", "kv_port": 1, "block_size": 16, "max_model_len": 512,
                                  "draining": self.draining})

    async def reset(self, request: web.Request) -> web.Response:
        self.resets += 1
        return web.json_response({"reset": True}, status=self.reset_status)

    async def completions(self, request: web.Request) -> web.Response:
        self.hits += 1
        body = await request.json()
        if self.draining:
            return H.error_response(503, "this instance is draining", code="draining")
        if self.shed:
            resp = H.error_response(429, "no capacity")
            resp.headers["Retry-After"] = "1"
            return resp
        self.plain += "kv_transfer_params" not in body
        if self.role == "decode" and "kv_transfer_params" in body:
            await asyncio.sleep(self.leg_delay_s)
        if self.role == "decode" and body.get("stream"):
            return await self.stream(request)
        if self.role == "decode":
            return web.json_response({"choices": [{"index": 0, "text": f"from {self.port}", "finish_reason": "length"}]})
        leg = body["kv_transfer_params"]
        result = kp.PrefillResult(transfer_id=leg["transfer_id"], mode=KVMode(self.mode), prefill_engine_id=
                                  f"prefill-{self.port}", prefill_kv_host="127.0.0.1", prefill_kv_port=1, num_tokens=3,
                                  block_ids=[1] if self.mode == "pull" else [], first_token_id=5,
                                  lease_expiry=time.time() + 30 if self.mode == "pull" else None)
        return web.json_response({"choices": [{"text": "x", "kv_transfer_params": kp.params_to_dict(result)}]})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for text in ("a", "b"):
            await out.write(b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}).encode() + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


async def deploy(mode: str, decodes: list[Fake], prefills: list[Fake] | None = None, api_key: str | None = None,
                 **config):
    prefills = prefills or [Fake("prefill", mode)]
    for f in [*prefills, *decodes]:
        await f.start()
    config = ProxyConfig(prefill_urls=tuple(f.url for f in prefills), decode_urls=tuple(f.url for f in decodes),
                         kv_mode=KVMode(mode), probe_interval_s=3600, api_key=api_key, **config)  # no re-probe in the test
    proxy = Proxy(config)
    await proxy.start(wait_s=10)
    runner = web.AppRunner(proxy.build_app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return proxy, runner, f"http://127.0.0.1:{port}", prefills


async def ask(url: str, n: int) -> list[tuple[int, str]]:
    out = []
    async with ClientSession() as s:
        for _ in range(n):
            async with s.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
                out.append((r.status, json.loads(await r.read())["choices"][0]["text"] if r.status == 200 else ""))
    return out


async def teardown(proxy: Proxy, runner: web.AppRunner, fakes: list[Fake]) -> None:
    await runner.cleanup()
    await proxy.close()
    for f in fakes:
        await f.stop()


def rerouted(proxy: Proxy, role: str, reason: str) -> float:
    return proxy.metrics.rerouted.labels(role=role, reason=reason)._value.get()


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_draining_decode_is_skipped_at_once(mode):
    async def main():
        d1, d2 = Fake("decode", mode), Fake("decode", mode)
        proxy, runner, url, prefills = await deploy(mode, [d1, d2])
        try:
            d1.draining = True  # SIGTERM after the last probe: the proxy learns it from D1's refusal
            answers = await ask(url, 6)
            assert answers == [(200, f"from {d2.port}")] * 6
            assert d1.hits == 1 and d2.hits == 6  # refused once, then never chosen again
            assert proxy.decodes[0].draining and rerouted(proxy, "decode", "draining") == 1
            assert prefills[0].hits == (7 if mode == "push" else 6)  # push re-dispatches both legs
        finally:
            await teardown(proxy, runner, [*prefills, d1, d2])

    asyncio.run(main())


def test_an_unreachable_decode_is_skipped():
    async def main():
        d1, d2 = Fake("decode", "push"), Fake("decode", "push")
        proxy, runner, url, prefills = await deploy("push", [d1, d2])
        try:
            await d1.stop()  # gone between two probes: connections are refused
            assert await ask(url, 4) == [(200, f"from {d2.port}")] * 4
            assert rerouted(proxy, "decode", "unreachable") == 1 and not proxy.decodes[0].healthy
        finally:
            await teardown(proxy, runner, [*prefills, d2])

    asyncio.run(main())


def test_draining_instances_are_not_chosen_after_a_probe():
    async def main():
        d1, d2 = Fake("decode", "pull"), Fake("decode", "pull")
        p1, p2 = Fake("prefill", "pull", draining=True), Fake("prefill", "pull")
        proxy, runner, url, prefills = await deploy("pull", [d1, d2], [p1, p2])
        try:
            d2.draining = True
            await proxy.probe_all()
            assert await ask(url, 4) == [(200, f"from {d1.port}")] * 4
            assert (p1.hits, d2.hits, p2.hits) == (0, 0, 4)
            d1.draining = True  # every decode instance drains: 503, no instance to choose
            await proxy.probe_all()
            assert [status for status, _ in await ask(url, 1)] == [503]
        finally:
            await teardown(proxy, runner, [p1, p2, d1, d2])

    asyncio.run(main())


@pytest.mark.parametrize("value", ["0", "-1", "abc", "inf"])
def test_probe_interval_must_be_a_positive_number(value, capsys):
    from kvpush.cli import main

    with pytest.raises(SystemExit):
        main(["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--probe-interval-s", value])
    assert "--probe-interval-s: must be a number above 0" in capsys.readouterr().err


def test_auto_serves_locally_when_the_only_prefill_sheds_or_is_gone():
    """--kv-mode auto: the last P answering 429 is not the client's problem while D can prefill; a
    proxy with no P at all is still ready and serves every request from D."""

    async def main():
        p, d = Fake("prefill", "auto"), Fake("decode", "auto")
        proxy, runner, url, prefills = await deploy("auto", [d], [p])
        try:
            p.shed, d.leg_delay_s = True, 1.0  # push: P's 429 comes before D's answer
            async with ClientSession() as s:
                body = {"prompt": list(range(2000)), "max_tokens": 2}  # too long for local by choice
                async with s.post(url + "/v1/completions", json=body) as r:
                    out = json.loads(await r.read())
                    assert r.status == 200, out
            assert out["choices"][0]["text"] == f"from {d.port}" and p.hits == 1 and d.plain == 1
            assert proxy.metrics.routes.labels(route="local")._value.get() == 1
            async with ClientSession() as s:  # a route the client names is not replaced
                async with s.post(url + "/v1/completions", json=body, headers={"X-KVPush-KV-Mode": "push"}) as r:
                    assert r.status == 429 and r.headers["Retry-After"] == "1"
            # every decision (the shed remote one, its local retry, the forced one) left the queues
            assert proxy.auto is not None and set(proxy.auto.pending.values()) <= {0}
            assert set(proxy.auto.queued.values()) <= {0.0}
        finally:
            await teardown(proxy, runner, [*prefills, d])
        gone, d2 = Fake("prefill", "auto"), Fake("decode", "auto")
        proxy, runner, url, _ = await deploy("auto", [d2], [gone])
        try:
            await gone.stop()  # P is gone: the next probe marks it unhealthy
            await proxy.probe_all()
            assert not proxy.prefills[0].healthy
            async with ClientSession() as s:
                async with s.get(url + "/health") as r:
                    assert r.status == 200
            assert await ask(url, 2) == [(200, f"from {d2.port}")] * 2 and d2.plain == 2
        finally:
            await teardown(proxy, runner, [d2])

    asyncio.run(main())


def test_a_client_closing_after_done_is_no_error(monkeypatch, caplog):
    """The client read [DONE] and closed before the proxy wrote the stream's end: the answer was complete,
    so it counts as a 200 and nothing is logged as an error (it was aiohttp's 'Error handling request')."""
    real_write_eof = web.StreamResponse.write_eof

    async def closed(self, data=b""):
        if self.headers.get("Content-Type") == "text/event-stream" and self.status == 200 and "Cache-Control" in self.headers:
            raise ConnectionResetError("Cannot write to closing transport")  # the proxy's relay, not the fake's
        return await real_write_eof(self, data)

    async def main():
        d = Fake("decode", "push")
        proxy, runner, url, prefills = await deploy("push", [d])
        try:
            monkeypatch.setattr(web.StreamResponse, "write_eof", closed)
            async with ClientSession() as s:
                body = {"prompt": "hi", "max_tokens": 2, "stream": True}
                async with s.post(url + "/v1/completions", json=body) as r:
                    lines = []
                    async for line in r.content:
                        lines.append(line)
                        if line.startswith(b"data: [DONE]"):
                            break
            assert r.status == 200 and lines[-1].startswith(b"data: [DONE]")
            assert proxy.metrics.requests.labels(status="200")._value.get() == 1
        finally:
            monkeypatch.setattr(web.StreamResponse, "write_eof", real_write_eof)
            await teardown(proxy, runner, [*prefills, d])

    with caplog.at_level("INFO"):
        asyncio.run(main())
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_a_slow_probe_is_a_miss_and_only_misses_in_a_row_skip_an_instance():
    """A busy instance that answers a probe late is kept until it missed --probe-misses in a row; one that
    refuses the connection is skipped at once."""
    async def main():
        d = Fake("decode", "push")
        proxy, runner, url, prefills = await deploy("push", [d], probe_timeout_s=0.2, probe_misses=3)
        try:
            d.slow_s = 1.0
            for _ in range(2):
                await proxy.probe_all()
            assert proxy.decodes[0].healthy and proxy.decodes[0].misses == 2
            assert (await ask(url, 1))[0][0] == 200  # still served
            await proxy.probe_all()
            assert not proxy.decodes[0].healthy
            assert (await ask(url, 1))[0][0] == 503  # no healthy decode instance
            d.slow_s = 0.0
            await proxy.probe_all()
            assert proxy.decodes[0].healthy and proxy.decodes[0].misses == 0
            await prefills[0].stop()  # refuses connections from now on
            await proxy.probe_all()
            assert not proxy.prefills[0].healthy
        finally:
            await teardown(proxy, runner, [*prefills, d])

    asyncio.run(main())
