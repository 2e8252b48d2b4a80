"""`kvpush up --emulate` (issue 37). With 4 prefill and 4 decode instances the deployment starts, every
instance serves through the proxy over real NIXL in the emulated model's KV geometry, identical prompts get
identical answers whichever P and D served them (the emulated tokens are a function of the KV read back),
and a SIGTERM stops every process. With the profile's link (root), P and D sit in two network namespaces
joined by the profile's per-rank bandwidth divided by the time scale, which `up` measures and reports.
The link's arithmetic and the flags are unit-tested. Nothing asserts a duration."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_up import descendants, gone, kill_all

from kvpush.launcher.launch import free_port

pytestmark = pytest.mark.integration
PROFILE = "qwen3-32b-h200-tp8"
N = 4  # prefill and decode instances each


def complete(port: int, prompt: list[int]) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def served_per_instance(proxy: str) -> dict[str, float]:
    """The proxy's kvpush_proxy_instance_served samples, by role and URL."""
    with urllib.request.urlopen(proxy + "/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {line.split("{", 1)[1].split("}", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in lines if line.startswith("kvpush_proxy_instance_served{")}


def test_4p4d_emulated_starts_serves_and_stops(tiny_model):
    port = free_port()
    up = subprocess.Popen([sys.executable, "-m", "kvpush.cli", "up", tiny_model, "--prefill", str(N), "--decode", str(N),
                           "--kv-mode", "push", "--port", str(port), "--emulate", PROFILE, "--time-scale", "0.01",
                           "--num-blocks", "128", "--block-size", "16", "--emulated-link", "off"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    children: set[int] = set()
    try:
        lines = []
        deadline = time.monotonic() + 400  # 16 processes importing torch on two cores
        while time.monotonic() < deadline:
            line = up.stdout.readline()  # type: ignore[union-attr]
            lines.append(line)
            if "ready:" in line or not line:
                break
        assert any("ready:" in ln for ln in lines), "".join(lines[-30:])
        children = descendants(up.pid)
        assert len(children) >= 4 * N + 1  # each instance: API server and engine core; the proxy
        prompts = [[(7 * i + j) % 500 + 3 for j in range(40 + i)] for i in range(4)]
        with ThreadPoolExecutor(8) as pool:  # each prompt four times: round-robin puts it on several pairs
            answers = list(pool.map(lambda k: complete(port, prompts[k % 4]), range(4 * N)))
        for k, out in enumerate(answers):
            assert out["usage"]["completion_tokens"] == 6
            assert out["choices"][0]["text"] == answers[k % 4]["choices"][0]["text"]
        served = served_per_instance(f"http://127.0.0.1:{port}")
        assert len(served) == 2 * N and all(n >= 1 for n in served.values()), served  # every P and every D
        up.send_signal(signal.SIGTERM)
        assert up.wait(90) == 0
        assert gone(children, 30) == set()
    finally:
        kill_all(up, children)


def test_the_emulated_link_is_the_profiles_in_emulated_time():
    from kvpush.cli import emulated_link
    from kvpush.emulate.profile import load_profile

    link = load_profile(PROFILE).link  # 400 Gbit/s per rank, 20 us one way
    gbps, delay_ms, what = emulated_link(["--emulate", PROFILE, "--time-scale", "40", "--num-blocks", "9"]) or (0, 0, "")
    assert (gbps, delay_ms) == pytest.approx((link.bandwidth_gbps / 40, link.latency_s * 40e3))
    assert PROFILE in what and "time scale 40" in what
    assert emulated_link(["--emulate", PROFILE])[:2] == pytest.approx((link.bandwidth_gbps, link.latency_s * 1e3))
    assert emulated_link(["--num-blocks", "9"]) is None
    with pytest.raises(SystemExit, match="kvpush up: --emulate: unknown profile 'h900'"):
        emulated_link(["--emulate", "h900"])
    # four pairs share the one shaped link: the aggregate of four ranks' NICs
    gbps, _, what = emulated_link(["--emulate", PROFILE, "--time-scale", "40"], pairs=4) or (0, 0, "")
    assert gbps == pytest.approx(4 * link.bandwidth_gbps / 40) and "x 4 pairs" in what
    with pytest.raises(SystemExit):
        emulated_link(["--emulate", PROFILE, "--time-scale", "0"])


def test_without_root_up_emulate_says_how_to_go_on(monkeypatch, tiny_model):
    from kvpush.cli import cmd_up
    from kvpush.flags import up_parser

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    args, serve_args = up_parser().parse_known_args([tiny_model, "--emulate", PROFILE])
    with pytest.raises(SystemExit, match="needs root .* or add --emulated-link off"):
        cmd_up(args, serve_args)


def test_up_takes_no_abbreviation_so_emulate_reaches_serve():
    from kvpush.flags import up_parser

    args, serve_args = up_parser().parse_known_args(["m", "--emulate", PROFILE, "--emulated-link", "off"])
    assert args.emulated_link == "off" and serve_args == ["--emulate", PROFILE]
    assert up_parser().parse_known_args(["m"])[0].emulated_link == "profile"


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and tc need root (CI runs as root)")
@pytest.mark.skipif(shutil.which("ip") is None or shutil.which("tc") is None, reason="iproute2 (ip, tc) is not installed")
def test_1p1d_emulated_over_the_profiles_link(tiny_model):
    port = free_port()
    up = subprocess.Popen([sys.executable, "-m", "kvpush.cli", "up", tiny_model, "--kv-mode", "push", "--port", str(port),
                           "--emulate", PROFILE, "--time-scale", "40", "--num-blocks", "128", "--block-size", "16"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    children: set[int] = set()
    try:
        lines = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = up.stdout.readline()  # type: ignore[union-attr]
            lines.append(line)
            if "ready:" in line or not line:
                break
        text = "".join(lines)
        assert "ready:" in text, text
        assert "emulated link (qwen3-32b-h200-tp8's 400 Gbit/s and 20 us, time scale 40): 10 Gbit/s each way" in text
        assert "link measured at" in text and "P in kvp-p-" in text  # P and D in two namespaces
        url = text.split("ready: ", 1)[1].split()[0]  # the proxy, inside D's namespace
        children = descendants(up.pid)
        body = json.dumps({"prompt": list(range(3, 70)), "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        req = urllib.request.Request(url + "/v1/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 4
        up.send_signal(signal.SIGTERM)
        assert up.wait(90) == 0
        assert gone(children, 30) == set()
    finally:
        kill_all(up, children)
