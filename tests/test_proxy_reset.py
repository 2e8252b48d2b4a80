"""POST /reset_prefix_cache on the proxy, against fake instances in this process: every instance is
asked, and one that fails makes it a 502 that names it (a benchmark must not run "cold" on a warm
instance). The real servers are in test_disagg.py and test_auto.py."""

from __future__ import annotations

import asyncio

from aiohttp import ClientSession
from test_proxy_drain import Fake, deploy, teardown


async def reset(url: str, headers: dict | None = None) -> tuple[int, dict]:
    async with ClientSession() as s, s.post(url + "/reset_prefix_cache", headers=headers) as r:
        return r.status, await r.json()


def test_every_instance_is_reset_and_a_failure_is_a_502_naming_it():
    async def main():
        d1, d2 = Fake("decode", "auto"), Fake("decode", "auto")
        proxy, runner, url, prefills = await deploy("auto", [d1, d2])
        try:
            status, out = await reset(url)
            assert status == 200 and sorted(out["reset"]) == sorted(f.url for f in (*prefills, d1, d2))
            assert (prefills[0].resets, d1.resets, d2.resets) == (1, 1, 1)
            d2.reset_status = 500
            status, out = await reset(url)
            assert status == 502 and out["error"]["code"] == "reset_failed" and d2.url in out["error"]["message"]
            assert d1.url not in out["error"]["message"] and d1.resets == 2
        finally:
            await teardown(proxy, runner, [*prefills, d1, d2])

    asyncio.run(main())


def test_the_reset_needs_the_proxys_api_key_and_skips_a_draining_instance():
    async def main():
        d1, d2 = Fake("decode", "push"), Fake("decode", "push", draining=True)
        proxy, runner, url, prefills = await deploy("push", [d1, d2], api_key="k")
        try:
            status, out = await reset(url)
            assert status == 401 and out["error"]["message"] == "invalid or missing API key"
            assert d1.resets == 0
            status, out = await reset(url, {"Authorization": "Bearer k"})
            assert status == 200 and d2.url not in out["reset"] and (d1.resets, d2.resets) == (1, 0)
        finally:
            await teardown(proxy, runner, [*prefills, d1, d2])

    asyncio.run(main())
