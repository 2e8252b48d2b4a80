"""`kvpush up --emulate` with 4 prefill and 4 decode instances (issue 37): the deployment starts, every
instance serves through the proxy over real NIXL in the emulated model's KV geometry, identical prompts get
identical answers whichever P and D served them (the emulated tokens are a function of the KV read back),
and a SIGTERM stops every process. A tiny time scale keeps the modelled steps short; nothing asserts a
duration."""

from __future__ import annotations

import json
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
                           "--num-blocks", "128", "--block-size", "16"],
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
