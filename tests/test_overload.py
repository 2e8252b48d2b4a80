"""Overload against real servers: a burst past the bound is shed at once (429 + Retry-After) while the
admitted requests complete as without it; a decode instance without free blocks refuses a push leg,
the proxy relays the 429 (or tries another decode instance), and nothing stays held on P or D."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp
import pytest
from kvpush_testing import BS, Cluster, completion, metric, post, prompt_of, wait_for
from test_faults import all_free, metrics_all, no_live_transfers

from kvpush.launcher.launch import ServerProcess, free_port

pytestmark = pytest.mark.integration


def shed_count(url: str, reason: str) -> float:
    return metrics_all(url).get(f"kvpush_requests_shed_total{{reason={reason}}}", 0.0)


def test_burst_past_the_bound_is_shed_while_admitted_requests_complete(server_factory, tiny_model, reference):
    server = server_factory(tiny_model, "--block-size", str(BS), "--num-blocks", "512", "--max-num-seqs", "1",
                            "--max-waiting", "2")
    prompts = [prompt_of(9 + i, 60 + i) for i in range(16)]

    async def burst() -> list[tuple[int, str | None, dict]]:
        async with aiohttp.ClientSession() as s:
            async def one(prompt: list[int]) -> tuple[int, str | None, dict]:
                body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 0}
                async with s.post(server.url + "/v1/completions", json=body) as r:
                    return r.status, r.headers.get("Retry-After"), await r.json()

            return await asyncio.gather(*(one(p) for p in prompts))

    answers = asyncio.run(burst())
    statuses = [status for status, _, _ in answers]
    assert set(statuses) <= {200, 429} and statuses.count(429) >= 1 and statuses.count(200) >= 2, statuses
    for prompt, (status, retry_after, out) in zip(prompts, answers, strict=True):
        if status == 429:
            err = out["error"]
            assert retry_after == "1" and err["code"] == "queue_full" and err["type"] == "overloaded_error", out
            assert "--max-waiting 2" in err["message"]
        else:
            choice = out["choices"][0]
            assert (choice["logprobs"]["tokens"], choice["text"]) == reference(prompt, 16)
    assert shed_count(server.url, "queue_full") == statuses.count(429)
    wait_for(lambda: metric(server.url, "kvpush_kv_blocks_used") == 0, 10, "every block free after the burst")


def kv_info(url: str) -> dict:
    with urllib.request.urlopen(url + "/v1/kv_info", timeout=10) as r:
        return json.loads(r.read())


def proxy(c: Cluster, decodes: list[ServerProcess]) -> ServerProcess:
    """A push proxy over the cluster's prefill instance and these decode instances (started, not waited for)."""
    port = free_port()
    argv = ["proxy", "--port", str(port), "--kv-mode", "push", "--prefill", *[p.url for p in c.prefills],
            "--decode", *[d.url for d in decodes]]
    proc = ServerProcess(argv, log_path=str(c.log_dir / f"proxy-{port}.log"))
    c.procs.append(proc.start())
    return proc


def sees_healthy(proxy: ServerProcess, *instances: ServerProcess) -> bool:
    found = metrics_all(proxy.url)
    return all(found.get(f"kvpush_proxy_instance_healthy{{role=decode,url={i.url}}}") == 1 for i in instances)


def test_decode_without_free_blocks_refuses_the_push_leg(tiny_model, tmp_path, reference):
    c = Cluster(tiny_model, "push", tmp_path, extra_decode=("--num-blocks", "16"))  # D1: 16 blocks of 8 tokens
    try:
        d1 = c.decodes[0]
        d2 = c._serve(tiny_model, "decode", "push", tmp_path, ())  # D2: room to spare
        only_d1, both = proxy(c, [d1]), proxy(c, [d1, d2])  # both: round-robin, its first request goes to D1
        c.wait()
        p = c.prefills[0]
        wait_for(lambda: sees_healthy(both, d1, d2), 10, "the proxy sees both decode instances healthy")

        async def scenario() -> tuple[tuple[int, str | None, dict], list[str] | None]:
            info = kv_info(p.url)
            hog_leg = {"type": "DecodeLegParams", "transfer_id": "hog", "mode": "push",
                       "prefill_engine_id": info["engine_id"], "prefill_kv_host": info["kv_host"],
                       "prefill_kv_port": info["kv_port"], "first_token": "recompute"}
            hog = {"prompt": prompt_of(100, 1), "max_tokens": 4, "kv_transfer_params": hog_leg}
            async with aiohttp.ClientSession() as s:
                # A push leg whose prefill never comes: D1 parks it with 13 of its 16 blocks
                hog_task = asyncio.create_task(s.post(d1.url + "/v1/completions", json=hog))
                await asyncio.to_thread(wait_for, lambda: metric(d1.url, "kvpush_num_requests_waiting_for_kv") == 1,
                                        30, "D1 holds the hog's blocks")
                body = {"prompt": prompt_of(3 * BS, 2), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                async with s.post(only_d1.url + "/v1/completions", json=body) as r:
                    shed = r.status, r.headers.get("Retry-After"), await r.json()
                tokens, _, _ = await asyncio.to_thread(completion, both.url, prompt_of(3 * BS, 3))
                hog_task.cancel()  # the client leaves: D1 aborts the hog and tells P
                await asyncio.gather(hog_task, return_exceptions=True)
            return shed, tokens

        (status, retry_after, out), tokens = asyncio.run(scenario())
        assert status == 429 and retry_after == "1", out
        assert out["error"]["code"] == "kv_cache_full" and "KV cache full" in out["error"]["message"]
        assert tokens == reference(prompt_of(3 * BS, 3))[0]  # shed by D1, served by D2
        assert metric(both.url, "kvpush_proxy_shed_retries_total") == 1
        assert shed_count(d1.url, "kv_cache_full") == 2
        # Nothing held anywhere, well before P's 30 s lease could have freed it: D1 told P (Abort)
        wait_for(lambda: all_free(p, d1, d2), 10, "all blocks free on P and both D")
        wait_for(lambda: no_live_transfers(p, d1, d2), 10, "no live transfer")
        assert metrics_all(p.url).get("kvpush_kv_transfers{state=expired}", 0) == 0
        assert post(only_d1.url + "/v1/completions", {"prompt": prompt_of(3 * BS, 2), "max_tokens": 2})[0] == 200
    finally:
        c.stop()
