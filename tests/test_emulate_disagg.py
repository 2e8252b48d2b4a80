"""Emulated instances over real servers and real NIXL: a 1P1D deployment (auto instances, each leg's route
named by the client: push, push-layerwise, pull) answers byte for byte as an emulated colocated instance, in
the profile's KV geometry; a corrupted transfer changes the answer; /metrics says the instance is emulated
and names its profile. A tiny time scale keeps the modelled steps short; nothing asserts a duration."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
from kvpush_testing import BS, Cluster, metric, prompt_of

from kvpush.bench.emulation import reset_windows
from kvpush.launcher.launch import ServerProcess, free_port

pytestmark = pytest.mark.integration
PROFILE = "qwen3-32b-h200-tp8"
EMULATE = ("--emulate", PROFILE, "--time-scale", "0.01", "--num-blocks", "256")
ROUTES = ("push", "push-layerwise", "pull")
LENGTHS = (1, BS, 6 * BS, 3 * BS + 5)
MAX_TOKENS = 8


def complete(url: str, prompt: list[int], route: str | None = None) -> tuple[int, dict]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    headers = {"Content-Type": "application/json", **({"X-KVPush-KV-Mode": route} if route else {})}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def text(url: str, prompt: list[int], route: str | None = None) -> str:
    status, out = complete(url, prompt, route)
    assert status == 200, out
    assert out["usage"]["completion_tokens"] == MAX_TOKENS
    return out["choices"][0]["text"]


@pytest.fixture(scope="module")
def world(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("emulated")
    port = free_port()
    colocated = ServerProcess(["serve", tiny_model, "--port", str(port), "--block-size", str(BS), *EMULATE],
                              log_path=str(logs / f"colocated-{port}.log")).start()
    # P prefills in chunks of 16 tokens: layer-wise push writes per chunk and layer
    c = Cluster(tiny_model, "auto", logs, extra_prefill=(*EMULATE, "--max-num-batched-tokens", "16"),
                extra_decode=EMULATE)
    try:
        colocated.wait_healthy(120)
        c.wait()
        yield colocated, c, {ft: c.proxy(ft) for ft in ("recompute", "from-prefill")}
    finally:
        c.stop()
        colocated.stop()


@pytest.mark.parametrize("first_token", ["recompute", "from-prefill"])
@pytest.mark.parametrize("route", ROUTES)
def test_disaggregated_equals_colocated(world, route, first_token):
    colocated, _, proxies = world
    for n in LENGTHS:
        prompt = prompt_of(n, seed=n + len(route))
        assert text(proxies[first_token].url, prompt, route) == text(colocated.url, prompt), (route, n)


def test_the_answers_depend_on_the_prompt(world):
    colocated = world[0]
    answers = {text(colocated.url, prompt_of(3 * BS, seed=s)) for s in range(4)}
    assert len(answers) == 4


def test_the_kv_moved_in_the_profiles_geometry(world):
    _, c, proxies = world
    before = metric(c.decodes[0].url, "kvpush_kv_transfer_bytes_total")
    text(proxies["recompute"].url, prompt_of(4 * BS, seed=77), "push")
    moved = metric(c.decodes[0].url, "kvpush_kv_transfer_bytes_total") - before
    assert moved == 4 * BS * 32 * 1024  # 4 blocks of 8 tokens at 32 KiB a token (one Qwen3-32B TP8 rank)


def test_metrics_say_emulated(world):
    colocated, c, _ = world
    text(colocated.url, prompt_of(5, seed=3))
    for url in (colocated.url, c.prefills[0].url, c.decodes[0].url):
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            page = r.read().decode()
        assert f'kvpush_emulated{{profile="{PROFILE}",time_scale="0.01"}} 1.0' in page, url
        assert f'kvpush_emulated_step_lateness_seconds_count{{profile="{PROFILE}"}}' in page
    assert metric(colocated.url, "kvpush_emulated_steps_total") > 0


def reset_window(url: str) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/emulation/reset_window", data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_run_can_start_its_lateness_window_afresh(world, tiny_model, tmp_path):
    """POST /emulation/reset_window empties the window /metrics' percentiles cover (what `kvpush bench` sends
    before each run), not the life-long counts; `kvpush bench` reports an emulated run's verdict over it.
    A real instance answers 404 not_emulated."""
    colocated, _, _ = world
    text(colocated.url, prompt_of(7, seed=11))
    steps = metric(colocated.url, "kvpush_emulated_steps_total")
    assert metric(colocated.url, "kvpush_emulated_window_steps") > 0
    assert reset_window(colocated.url) == (200, {"reset": True, "profile": PROFILE})
    deadline = time.monotonic() + 30
    while metric(colocated.url, "kvpush_emulated_window_steps") != 0:
        assert time.monotonic() < deadline, "the window was not reset"
        time.sleep(0.05)
    assert metric(colocated.url, "kvpush_emulated_steps_total") == steps
    text(colocated.url, prompt_of(3, seed=12))
    since = metric(colocated.url, "kvpush_emulated_steps_total") - steps
    assert since > 0 and metric(colocated.url, "kvpush_emulated_window_steps") == since
    assert reset_windows(colocated.url) == []
    real = ServerProcess(["serve", tiny_model, "--port", str(free_port()), "--compile", "off"],
                         log_path=str(tmp_path / "real.log")).start()
    try:
        real.wait_healthy(120)
        status, body = reset_window(real.url)
        assert status == 404 and body["error"]["code"] == "not_emulated"
        assert reset_windows(real.url) == []  # not asked: its /metrics says it is real
    finally:
        real.stop()


def test_a_corrupted_transfer_changes_the_output(tiny_model, tmp_path, world):
    """D perturbs the first block it received (--fault-inject corrupt-kv): the emulated tokens, read back
    from D's KV, differ from colocated's."""
    colocated = world[0]
    c = Cluster(tiny_model, "push", tmp_path, extra_prefill=EMULATE, extra_decode=(*EMULATE, "--fault-inject",
                                                                                      "corrupt-kv"))
    try:
        c.wait()
        proxy = c.proxy("from-prefill")
        prompt = prompt_of(5 * BS, seed=11)
        assert text(proxy.url, prompt) != text(colocated.url, prompt)
    finally:
        c.stop()
