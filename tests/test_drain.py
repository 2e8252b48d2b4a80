"""Graceful drain (SIGTERM, --shutdown-timeout) against real servers and real NIXL: running streams
complete, new requests are refused with a 503 naming the drain, /health says so, the proxy moves on
to the other instance, and a drain cut short by its timeout ends requests with a clear error and
tells the peer, which frees its blocks at once (no lease or deadline runs out)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import urllib.error
import urllib.request

import pytest
from kvpush_testing import BS, Cluster, metric, post, prompt_of, wait_for

pytestmark = pytest.mark.integration
LIVE = ("prefilled", "registered", "matched", "posted")


def metric_or(url: str, name: str, default: float = 0.0) -> float:
    try:
        return metric(url, name)
    except KeyError:
        return default


def health(url: str) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream(url: str, prompt: list[int], max_tokens: int, out: dict) -> None:
    """Stream a greedy completion; `out` gets the status, the text, the finish reason, any error event."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    out.update(text="", finish=None, error=None, done=False, chunks=0)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            out["status"] = r.status
            for raw in r:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        out["error"] = event["error"]
                        continue
                    out["chunks"] += 1
                    choice = event["choices"][0]
                    out["text"] += choice["text"]
                    out["finish"] = choice["finish_reason"] or out["finish"]
    except urllib.error.HTTPError as e:
        out["status"], out["error"] = e.code, json.loads(e.read())["error"]


def start_streams(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[list[threading.Thread], list[dict]]:
    results: list[dict] = [{} for _ in prompts]
    threads = [threading.Thread(target=stream, args=(url, p, max_tokens, r), daemon=True)
               for p, r in zip(prompts, results, strict=True)]
    for t in threads:
        t.start()
    return threads, results


def sigterm(proc) -> None:
    """What an orchestrator does: SIGTERM to the instance's process group (its engine core ignores it)."""
    os.killpg(proc.proc.pid, signal.SIGTERM)


def exit_code(proc, timeout: float) -> int:
    code = proc.proc.wait(timeout)
    proc.proc = None  # exited by itself: nothing left for stop()
    return code


@pytest.fixture
def deployment(tiny_model, tmp_path):
    """1P2D push and a proxy: D1 drains gracefully (60 s), D2 runs one request at a time and drains
    for 1 s only; P's lease is long, so only a peer's message frees its blocks during the test."""
    c = Cluster(tiny_model, "push", tmp_path, extra_prefill=("--kv-lease-s", "120"),
                extra_decode=("--shutdown-timeout", "60"))
    try:
        c.decodes.append(c._serve(tiny_model, "decode", "push", tmp_path,
                                  ("--max-num-seqs", "1", "--shutdown-timeout", "1")))
        c.wait()
        # D1's drain lasts ~1-2 s: the proxy probes often enough to see it before D1 exits
        yield c, c.proxy(extra=("--probe-interval-s", "0.1"))
    finally:
        c.stop()


def test_drain_on_sigterm(deployment, reference):
    c, proxy = deployment
    p, d1, d2 = c.prefills[0], c.decodes[0], c.decodes[1]
    # ---- D1 drains: its running streams complete, new requests go to D2 --------------------------
    prompts = [prompt_of(2 * BS + i, 40 + i) for i in range(4)]
    max_tokens = 1200  # D1 drains for as long as these streams last: long enough for the proxy's 0.1-s probes
    threads, results = start_streams(proxy.url, prompts, max_tokens)  # round-robin: two on each D
    wait_for(lambda: metric(d1.url, "kvpush_num_requests_running") >= 1, 30, "streams decoding on D1")
    sigterm(d1)
    status, body = wait_for(lambda: (lambda h: h if h[0] == 503 else None)(health(d1.url)), 10, "D1 unhealthy")
    assert isinstance(body, dict) and body["error"]["code"] == "draining", body
    status, out = post(d1.url + "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 503 and out["error"]["code"] == "draining" and "draining" in out["error"]["message"], out
    wait_for(lambda: metric_or(proxy.url, f'kvpush_proxy_instance_draining{{role="decode",url="{d1.url}"}}') == 1,
             10, "the proxy knows D1 drains")
    retries = metric_or(proxy.url, 'kvpush_proxy_rerouted_total{role="decode",reason="draining"}')
    for i in range(3):  # every new request goes to D2 (a leg D1 refused would count as a retry)
        prompt = prompt_of(BS + i, 60 + i)
        status, out = post(proxy.url + "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                          "ignore_eos": True})
        assert status == 200 and out["choices"][0]["text"] == reference(prompt)[1], out
    assert metric_or(proxy.url, 'kvpush_proxy_rerouted_total{role="decode",reason="draining"}') == retries
    for t in threads:
        t.join(120)
    for prompt, r in zip(prompts, results, strict=True):  # all streams completed, byte for byte
        assert r["error"] is None and r["finish"] == "length" and r["done"], r
        assert r["text"] == reference(prompt, max_tokens)[1]
    assert exit_code(d1, 30) == 0
    log = open(d1.log_path).read()
    assert re.search(r"draining: [1-9]\d* requests in flight", log) and "drained in" in log, log[-2000:]

    # ---- D2's drain outlasts --shutdown-timeout 1 -------------------------------------------------
    # The running stream ends with an error event, the request still waiting for D2's only slot gets a
    # 503, and P frees the KV it held for that request at once: D2 told it (Abort).
    (hog,), (hog_out,) = start_streams(proxy.url, [prompt_of(BS, 70)], 3500)
    wait_for(lambda: metric(d2.url, "kvpush_num_requests_running") == 1, 30, "the hog decodes on D2")
    (waiter,), (waiter_out,) = start_streams(proxy.url, [prompt_of(3 * BS, 71)], 8)
    wait_for(lambda: metric(d2.url, "kvpush_num_requests_waiting") == 1, 30, "the waiter queues on D2")
    wait_for(lambda: metric(p.url, 'kvpush_kv_transfers{state="prefilled"}') == 1, 10, "P holds the waiter's KV")
    assert metric(d2.url, "kvpush_kv_local_fallbacks_total") == 0
    sigterm(d2)
    hog.join(60)
    waiter.join(60)
    assert hog_out["chunks"] > 0 and hog_out["finish"] is None and hog_out["done"], hog_out
    assert "shut down" in hog_out["error"]["message"], hog_out  # an error event, not a stream that looks complete
    assert waiter_out["status"] == 503 and "shut down" in waiter_out["error"]["message"], waiter_out
    assert exit_code(d2, 30) == 0
    wait_for(lambda: metric(p.url, "kvpush_kv_blocks_used") == 0, 10, "P frees the waiter's blocks")
    assert all(metric_or(p.url, f'kvpush_kv_transfers{{state="{s}"}}') == 0 for s in LIVE)
    assert metric(p.url, 'kvpush_kv_transfer_failures_total{reason="peer_abort"}') == 1
    assert metric(p.url, 'kvpush_kv_transfer_failures_total{reason="deadline"}') == 0
