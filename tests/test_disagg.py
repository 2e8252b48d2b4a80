"""1P1D and 2P2D over real servers and real NIXL: outputs equal the colocated engine's, token for token.

One prefill and one decode instance per KV mode, with two proxies each (first token recomputed by
D, or taken from P), so every mode x first-token combination runs against the same instances.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from kvpush_testing import BS, MAX_TOKENS, Cluster, completion, metric, post, prompt_of, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["push", "pull", "push-layerwise"])
def cluster(request, tiny_model, tmp_path_factory):
    # P prefills in chunks of 16 tokens: multi-chunk prompts (layer-wise push writes per chunk and layer)
    c = Cluster(tiny_model, request.param, tmp_path_factory.mktemp(f"logs-{request.param}"),
                extra_prefill=("--max-num-batched-tokens", "16"))
    try:
        c.wait()
        c.proxies = {ft: c.proxy(ft) for ft in ("recompute", "from-prefill")}  # type: ignore[attr-defined]
        yield c
    finally:
        c.stop()


PROMPT_LENGTHS = {"one-token": 1, "one-block": BS, "many-blocks": 6 * BS, "partial-last-block": 3 * BS + 5}


@pytest.mark.parametrize("first_token", ["recompute", "from-prefill"])
@pytest.mark.parametrize("shape", list(PROMPT_LENGTHS))
def test_outputs_equal_colocated(cluster, reference, first_token, shape):
    prompt = prompt_of(PROMPT_LENGTHS[shape], seed=len(shape))
    tokens, text, _ = completion(cluster.proxies[first_token].url, prompt)
    assert (tokens, text) == reference(prompt)
    # without logprobs the proxy keeps --first-token from-prefill (with them D recomputes: P's logprob stays on P)
    assert completion(cluster.proxies[first_token].url, prompt, logprobs=False)[1] == reference(prompt)[1]


@pytest.mark.parametrize("first_token", ["recompute", "from-prefill"])
def test_prefix_cache_hits_on_decode(cluster, reference, first_token):
    url = cluster.proxies[first_token].url
    base = prompt_of(4 * BS, seed=99 + len(first_token) + len(cluster.mode))
    # no logprobs asked: the proxy keeps its --first-token (it recomputes on D for a request with logprobs)
    assert completion(url, base, logprobs=False)[1] == reference(base)[1]  # D now caches base's full blocks
    longer = base + prompt_of(2 * BS + 3, seed=5)
    _, text, usage = completion(url, longer, logprobs=False)
    assert text == reference(longer)[1]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 4 * BS  # partial hit: the rest was transferred
    # A full hit: D holds every block it needs (recompute: the first n-1 tokens; pull from-prefill: all n,
    # P's first token came with its PrefillResult). Push from-prefill always receives the last block,
    # since P's first token travels with the WRITE's notification.
    push_from_prefill = first_token == "from-prefill" and cluster.mode != "pull"
    full = base + [7] if first_token == "recompute" else base
    bytes_before = metric(cluster.decodes[0].url, "kvpush_kv_transfer_bytes_total")
    _, text, usage = completion(url, full, logprobs=False)
    assert text == reference(full)[1]
    moved = metric(cluster.decodes[0].url, "kvpush_kv_transfer_bytes_total") - bytes_before
    if push_from_prefill:
        assert usage["prompt_tokens_details"]["cached_tokens"] == 3 * BS and moved > 0
    else:
        assert usage["prompt_tokens_details"]["cached_tokens"] == 4 * BS and moved == 0


def test_push_recompute_computes_a_partial_tail_on_decode_without_waiting_for_p(cluster, reference):
    """D holds all but under a block of the prompt (before its last position): in push with D recomputing,
    D computes the tail itself and receives nothing; pull reads the partial block from P."""
    url = cluster.proxies["recompute"].url
    base = prompt_of(3 * BS, seed=71 + len(cluster.mode))
    assert completion(url, base, logprobs=False)[1] == reference(base)[1]  # D caches base's full blocks
    tail = base + prompt_of(BS // 2, seed=72)  # BS // 2 - 1 tokens after base before the last position
    bytes_before = metric(cluster.decodes[0].url, "kvpush_kv_transfer_bytes_total")
    _, text, usage = completion(url, tail, logprobs=False)
    assert text == reference(tail)[1]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 3 * BS
    moved = metric(cluster.decodes[0].url, "kvpush_kv_transfer_bytes_total") - bytes_before
    assert (moved == 0) if cluster.mode != "pull" else (moved > 0)


def test_a_prefix_cache_reset_through_the_proxy_makes_the_next_request_cold(cluster, reference):
    """POST /reset_prefix_cache on the proxy: P and D forget what they cached; the same prompt then
    moves its whole KV again (as a benchmark's next run would)."""
    url = cluster.proxies["recompute"].url
    base = prompt_of(4 * BS, seed=77 + len(cluster.mode))
    completion(url, base, logprobs=False)
    assert completion(url, base + [7], logprobs=False)[2]["prompt_tokens_details"]["cached_tokens"] == 4 * BS
    status, out = post(url + "/reset_prefix_cache", {})
    assert status == 200 and len(out["reset"]) == 2, out
    bytes_before = metric(cluster.decodes[0].url, "kvpush_kv_transfer_bytes_total")
    _, text, usage = completion(url, base + [7], logprobs=False)
    assert text == reference(base + [7])[1]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert metric(cluster.decodes[0].url, "kvpush_kv_transfer_bytes_total") > bytes_before


def test_streaming_through_proxy(cluster, reference):
    prompt = prompt_of(2 * BS + 1, seed=3)
    body = json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(cluster.proxies["recompute"].url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    text, trace = "", None
    with urllib.request.urlopen(req, timeout=60) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for c in chunk["choices"]:
                    text += c["text"]
                    trace = c.get("kvpush_trace", trace)
    assert text == reference(prompt)[1]
    assert trace is not None
    expected = {"dispatched", "p_admitted", "p_prefill_done", "d_ready", "first_token"}
    if cluster.mode == "push":
        expected |= {"reg_received", "write_posted"}
    assert expected <= set(trace), trace
    assert trace["dispatched"] <= trace["p_admitted"] <= trace["p_prefill_done"] <= trace["d_ready"] <= trace["first_token"]


def test_trace_is_complete_and_additive(cluster):
    """A streamed request through the proxy: every hop of its critical path is stamped, in causal
    order, and the segments add up to the client's TTFT."""
    import time

    from kvpush.bench.trace import critical_path, events_of, request_segments

    body = json.dumps({"prompt": prompt_of(3 * BS + 2, seed=11), "max_tokens": 4, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(cluster.proxies["from-prefill"].url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    trace, ttft, first = None, None, None
    sent, t0 = time.time(), time.perf_counter()
    with urllib.request.urlopen(req, timeout=60) as r:
        for raw in r:
            if raw.startswith(b"data: {"):
                for c in json.loads(raw[6:])["choices"]:
                    if ttft is None and c["text"]:
                        ttft, first = time.perf_counter() - t0, time.time()
                    trace = c.get("kvpush_trace", trace)
    assert trace is not None and ttft is not None and first is not None
    events = {**events_of(trace), "client_sent": sent, "client_first_chunk": first}
    hops = {"proxy_received", "dispatched", "p_leg_sent", "p_api_received", "p_admitted", "p_prefill_done",
            "p_answered", "p_response", "d_leg_sent", "api_received", "arrived", "kv_landed", "d_ready",
            "first_token", "core_sent", "api_got", "api_dequeued", "api_first_chunk", "proxy_first_chunk"}
    hops |= {"d_registered", "reg_received", "write_posted"} if cluster.mode != "pull" else {"d_admitted", "read_posted"}
    assert hops <= set(events), hops - set(events)
    path = critical_path(events)
    assert path[:3] == ["client_sent", "proxy_received", "dispatched"]
    assert path[-9:] == ["kv_landed", "d_ready", "first_token", "core_sent", "api_got", "api_dequeued",
                         "api_first_chunk", "proxy_first_chunk", "client_first_chunk"]
    if cluster.mode == "pull":
        assert {"p_prefill_done", "p_response", "d_leg_sent", "read_posted"} <= set(path)
    else:
        assert "write_posted" in path and "p_response" not in path
    crit, over, unaccounted = request_segments(events, ttft)
    assert all(ms >= 0 for ms in crit.values()), crit  # causal order along the path
    assert abs(unaccounted) < 1.0, (unaccounted, crit)
    assert "p_answered->p_response" in over or cluster.mode == "pull"


def test_blocks_all_free_afterwards(cluster):
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        used = [metric(p.url, "kvpush_kv_blocks_used") for p in cluster.prefills + cluster.decodes]
        if sum(used[: len(cluster.prefills)]) == 0:
            break
        time.sleep(0.2)
    assert used[: len(cluster.prefills)] == [0.0] * len(cluster.prefills)  # P holds nothing after transfers
    # D keeps only prefix-cache blocks of finished requests, which are free (reusable) blocks
    assert all(u == 0.0 for u in used)


def test_corrupted_block_changes_output(tiny_model, reference, tmp_path):
    """The equality tests can fail: perturbing one received block on D changes the greedy output."""
    c = Cluster(tiny_model, "push", tmp_path, extra_decode=("--fault-inject", "corrupt-kv"))
    try:
        c.wait()
        proxy = c.proxy()
        prompt = prompt_of(5 * BS, seed=11)
        tokens, text, _ = completion(proxy.url, prompt, max_tokens=16)
        assert (tokens, text) != reference(prompt, 16)
    finally:
        c.stop()


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_2p2d_spreads_requests(tiny_model, reference, tmp_path, mode):
    c = Cluster(tiny_model, mode, tmp_path, prefill=2, decode=2)
    try:
        c.wait()
        proxy = c.proxy(policy="round-robin")
        for i in range(8):
            prompt = prompt_of(BS * (i % 3 + 1) + i, seed=200 + i)
            assert completion(proxy.url, prompt)[:2] == reference(prompt)
        for inst in c.prefills + c.decodes:
            assert metric(inst.url, "kvpush_generation_tokens_total") > 0, inst.url
        for p in c.prefills:  # P frees after its WRITE ended / D's ReadDone: asynchronously to the answer
            wait_for(lambda p=p: metric(p.url, "kvpush_kv_blocks_used") == 0, 10, f"{p.url} frees its blocks")
    finally:
        c.stop()


@pytest.mark.parametrize("first_token", ["recompute", "from-prefill"])
def test_layerwise_registration_after_prefill_started(tiny_model, reference, tmp_path, first_token):
    """D's PushReg is held back 300 ms while P prefills in 8-token chunks: P's writer must catch up
    from the layers already finished, and D must see the exact KV (outputs equal colocated)."""
    c = Cluster(tiny_model, "push-layerwise", tmp_path, extra_prefill=("--max-num-batched-tokens", "8"),
                extra_decode=("--fault-inject", "delay-notif:0.3"))
    try:
        c.wait()
        proxy = c.proxy(first_token)
        for n in (BS - 3, 5 * BS, 7 * BS + 2):
            prompt = prompt_of(n, 300 + n)
            assert completion(proxy.url, prompt)[:2] == reference(prompt)
            assert completion(proxy.url, prompt, logprobs=False)[1] == reference(prompt)[1]  # keeps first_token
        wait_for(lambda: metric(c.prefills[0].url, "kvpush_kv_blocks_used") == 0, 10, "P frees its blocks")
    finally:
        c.stop()
