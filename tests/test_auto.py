"""--kv-mode auto against real servers and real NIXL: every route (push, push-layerwise, pull, local)
on the same auto instances answers byte for byte as the colocated engine, streamed or not; the
proxy's own choices too, over multi-turn prompts whose prefixes D already holds; the answer says which
route was taken and why, the proxy counts the choices and how far its estimates were off, and no
block or transfer is left over. D prefills local prompts in chunks of 5 tokens (parity holds chunked). With no prefill instance left, auto serves from D alone."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from kvpush_testing import BS, Cluster, metric, prompt_of, wait_for

pytestmark = pytest.mark.integration
ROUTES = ("push", "push-layerwise", "pull", "local")
MAX_TOKENS = 6
LIVE = ("prefilled", "registered", "matched", "posted")


def call(url: str, body: dict, route: str | None = None) -> tuple[int, dict]:
    """POST /v1/completions (greedy); a streamed answer is folded into text + its final choice."""
    headers = {"Content-Type": "application/json", **({"X-KVPush-KV-Mode": route} if route else {})}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            if not body.get("stream"):
                return r.status, json.loads(r.read())
            text, last = "", {}
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        text += choice["text"]
                        last = choice
            return r.status, {"choices": [{**last, "text": text}]}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def greedy(prompt: list[int], stream: bool = False) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}


@pytest.fixture(scope="module")
def auto(tiny_model, tmp_path_factory):
    limits = ("--kv-lease-s", "15", "--kv-timeout-s", "15", "--kv-quarantine-s", "2")
    chunks = ("--long-prefill-token-threshold", "5")  # D prefills local prompts in chunks between its decodes
    c = Cluster(tiny_model, "auto", tmp_path_factory.mktemp("auto"), extra_prefill=limits,
                extra_decode=limits + chunks)
    try:
        c.wait()
        yield c, c.proxy()
    finally:
        c.stop()


def chosen(url: str, route: str) -> float:
    try:
        return metric(url, f'kvpush_proxy_kv_mode_chosen_total{{route="{route}"}}')
    except KeyError:
        return 0.0


def metric_sum(url: str, name: str) -> float:
    """A metric summed over its labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))


def assert_idle(c: Cluster) -> None:
    """Nothing held: no live transfer anywhere, every block of P and D free again."""
    for inst in (*c.prefills, *c.decodes):
        for state in LIVE:
            wait_for(lambda i=inst, s=state: metric(i.url, f'kvpush_kv_transfers{{state="{s}"}}') == 0, 20,
                     f"no {state} transfer on {inst.url}")
        wait_for(lambda i=inst: metric(i.url, "kvpush_kv_blocks_used") == 0, 20, f"{inst.url} frees its blocks")


@pytest.mark.parametrize("route", ROUTES)
def test_every_route_equals_colocated(auto, reference, route):
    c, proxy = auto
    before = chosen(proxy.url, route)
    shapes = [prompt_of(1, 1), prompt_of(BS, 2), prompt_of(3 * BS + 5, 3), prompt_of(6 * BS, 4)]
    for i, prompt in enumerate(shapes):
        status, out = call(proxy.url, greedy(prompt, stream=i % 2 == 1), route)
        assert status == 200, out
        choice = out["choices"][0]
        assert choice["text"] == reference(prompt, MAX_TOKENS)[1], (route, len(prompt))
        assert choice["kvpush_route"]["route"] == route and choice["kvpush_route"]["forced"]
    assert chosen(proxy.url, route) == before + len(shapes)
    assert_idle(c)


def test_auto_choices_over_multi_turn_prompts_equal_colocated(auto, reference):
    c, proxy = auto
    before = {r: chosen(proxy.url, r) for r in ROUTES}
    routes, sent = [], 0
    for conversation in range(3):
        prompt = prompt_of(2 * BS + 3, 100 + conversation)
        for _turn in range(4):  # each turn: the previous prompt, its answer's length, a new question
            status, out = call(proxy.url, greedy(prompt, stream=conversation == 1))
            sent += 1
            assert status == 200, out
            choice = out["choices"][0]
            assert choice["text"] == reference(prompt, MAX_TOKENS)[1]
            info = choice["kvpush_route"]
            assert info["route"] in ROUTES and not info["forced"] and set(info["estimates_ms"]) == set(ROUTES)
            assert info["tokens"] == len(prompt)  # token-id prompts are counted exactly
            routes.append(info["route"])
            if _turn:  # D was sent every earlier turn of this conversation
                assert info["d_prefix_tokens"] >= (len(prompt) - MAX_TOKENS - BS) // BS * BS, info
            prompt = prompt + prompt_of(MAX_TOKENS + BS, 200 + conversation * 10 + _turn)
    print("routes chosen:", routes)
    assert sum(chosen(proxy.url, r) - before[r] for r in ROUTES) == sent
    assert metric_sum(proxy.url, "kvpush_proxy_ttft_estimate_ratio_count") >= sent  # every answer measured
    assert_idle(c)


def test_a_prefix_cache_reset_empties_the_instances_and_the_proxys_trackers(auto, reference):
    """After POST /reset_prefix_cache the proxy no longer believes D holds the conversation (its
    tracker forgot it) and D computes or receives the whole prompt again."""
    _, proxy = auto
    prompt = prompt_of(4 * BS, 321)
    assert call(proxy.url, greedy(prompt), "push")[0] == 200
    status, out = call(proxy.url, greedy(prompt + [9]))
    assert status == 200 and out["choices"][0]["kvpush_route"]["d_prefix_tokens"] >= 3 * BS, out
    req = urllib.request.Request(proxy.url + "/reset_prefix_cache", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
    status, out = call(proxy.url, greedy(prompt + [9]))
    assert status == 200 and out["choices"][0]["kvpush_route"]["d_prefix_tokens"] == 0, out
    assert out["choices"][0]["text"] == reference(prompt + [9], MAX_TOKENS)[1]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_bad_route_header_is_a_400(auto):
    _, proxy = auto
    status, out = call(proxy.url, greedy(prompt_of(4, 1)), "sideways")
    assert status == 400 and "X-KVPush-KV-Mode" in out["error"]["message"], out


def test_without_prefill_auto_serves_from_decode_alone(auto, reference):
    """Last in this module: P is stopped. Auto's route is local; a request that insists on a P is a 503."""
    c, proxy = auto
    c.prefills[0].stop()
    wait_for(lambda: metric(proxy.url, 'kvpush_proxy_instance_healthy{role="prefill",url="'
                            + c.prefills[0].url + '"}') == 0, 20, "the proxy sees P gone")
    prompt = prompt_of(2 * BS + 1, 300)
    status, out = call(proxy.url, greedy(prompt))
    assert status == 200 and out["choices"][0]["kvpush_route"]["route"] == "local", out
    assert out["choices"][0]["text"] == reference(prompt, MAX_TOKENS)[1]
    status, out = call(proxy.url, greedy(prompt), "push")
    assert status == 503, out
