"""kvpush pull pools behind the real `vllm-router` (PyPI 0.1.17, `--vllm-pd-disaggregation`, NIXL mode).

One 2P2D pull deployment and one colocated instance per module; two routers in front of the pools
(1P1D: the first P and D; 2P2D: all). Greedy output through the router must equal the colocated
instance byte for byte, D must really have pulled (its trace shows the KV arriving), and a killed
instance must give errors or a retried correct answer, never a wrong 200.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from kvpush_testing import SERVE, Cluster, post, wait_for

from kvpush.launcher.launch import ServerProcess, free_port

pytestmark = pytest.mark.integration
ROUTER = "vllm-router==0.1.17"
PROMPTS = ["Hello there, how are you doing today my friend",
           "The quick brown fox jumps over the lazy dog " * 5,
           "one two three four five six seven eight nine ten eleven twelve " * 3]


def router_binary() -> str:
    """The vllm-router of this venv; installed from PyPI into it when missing (skip if unreachable)."""
    here = Path(sys.executable).parent / "vllm-router"
    if here.exists():
        return str(here)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", ROUTER], capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0:
        out = r.stdout + r.stderr
        if any(s in out for s in ("Could not find a version", "NewConnectionError", "Temporary failure",
                                  "No matching distribution", "Network is unreachable")):
            pytest.skip(f"cannot install {ROUTER}: the package registry is unreachable ({out.strip()[-200:]})")
        raise RuntimeError(f"pip install {ROUTER} failed: {out[-2000:]}")
    return str(here)


class Router:
    """One vllm-router process in its own session (killed with its group on stop)."""

    def __init__(self, exe: str, prefills: list[str], decodes: list[str], log: Path, extra: tuple | list = (),
                 bootstrap: dict[str, str] | None = None) -> None:
        self.port = free_port()
        argv = [exe, "--vllm-pd-disaggregation", "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-port", str(free_port()), "--policy", "round_robin", "--log-level", "warning", *extra]
        for u in prefills:
            argv += ["--prefill", u, *([bootstrap[u]] if bootstrap else [])]
        for u in decodes:
            argv += ["--decode", u]
        self.log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "OPENAI_API_KEY": ""})
        self.url = f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        assert self.proc.poll() is None, f"vllm-router exited with {self.proc.returncode}"
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    from kvpush.models.make_model import make_model

    exe = router_binary()
    logs = tmp_path_factory.mktemp("vllm-router")
    model = make_model(str(tmp_path_factory.mktemp("models") / "tiny"), preset="tiny", seed=0)
    cluster = Cluster(model, "pull", logs, prefill=2, decode=2)
    port = free_port()
    colocated = ServerProcess(["serve", model, "--port", str(port), *SERVE], log_path=str(logs / "colocated.log"))
    cluster.procs.append(colocated.start())
    routers: list[Router] = []
    try:
        cluster.wait()
        p, d = [x.url for x in cluster.prefills], [x.url for x in cluster.decodes]
        routers = [Router(exe, p[:1], d[:1], logs / "router-1p1d.log"), Router(exe, p, d, logs / "router-2p2d.log")]
        for r in routers:
            wait_for(r.healthy, 60, "vllm-router /health")
        yield cluster, colocated, routers
    finally:
        for r in routers:
            r.stop()
        cluster.stop()


def stream(url: str, path: str, body: dict) -> tuple[str, bool, list[dict]]:
    """(text, saw [DONE], events) of an SSE answer; the text of completions or chat deltas."""
    req = urllib.request.Request(url + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    text, done, events = "", False, []
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        for raw in r:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                ev = json.loads(line[6:])
                events.append(ev)
                for c in ev.get("choices") or []:
                    text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return text, done, events


def completion_body(prompt: str, max_tokens: int = 12) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 0}


def chat_body(prompt: str) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}


def answer(url: str, path: str, body: dict) -> tuple[int, dict]:
    """Status and JSON body; the router's own errors may be plain text (kept under "raw")."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {"raw": e.read().decode(errors="replace")}


def text_of(out: dict) -> str:
    c = out["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


@pytest.mark.parametrize("which", [0, 1], ids=["1P1D", "2P2D"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_output_equals_colocated(deployment, which, path):
    cluster, colocated, routers = deployment
    make = completion_body if path == "/v1/completions" else chat_body
    for prompt in PROMPTS:
        status, want = answer(colocated.url, path, make(prompt))
        assert status == 200, want
        status, got = answer(routers[which].url, path, make(prompt))
        assert status == 200, got
        assert text_of(got) == text_of(want)
        assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"] == 12
        if path == "/v1/completions":  # the router's logprobs merge must leave D's tokens alone
            assert got["choices"][0]["logprobs"]["tokens"] == want["choices"][0]["logprobs"]["tokens"]
        trace = got["choices"][0]["kvpush_trace"]
        assert "d_ready" in trace and "d_admitted" in trace, trace  # D pulled P's KV, no local prefill
        text, done, _ = stream(routers[which].url, path, make(prompt))
        assert done and text == text_of(want)


def test_both_instances_of_each_pool_served(deployment):
    cluster, _, routers = deployment
    for _ in range(4):
        assert answer(routers[1].url, "/v1/completions", completion_body(PROMPTS[0], 2))[0] == 200
    for proc in cluster.prefills + cluster.decodes:
        with urllib.request.urlopen(proc.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        line = next(x for x in text.splitlines() if x.startswith("vllm:request_success_total{")
                    and 'finished_reason="length"' in x)
        assert float(line.rsplit(" ", 1)[1]) >= 1, (proc.url, line)
        assert "vllm:kv_cache_usage_perc{" in text and "vllm:num_requests_waiting{" in text


def test_router_shaped_legs_with_bad_params_get_400(deployment):
    cluster, _, _ = deployment
    p, d = cluster.prefills[0].url, cluster.decodes[0].url
    status, out = post(p + "/v1/completions", {**completion_body(PROMPTS[0], 1), "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False}})
    assert status == 200, out
    kv = out["kv_transfer_params"]  # what vllm-router forwards to D verbatim
    for field, value in (("remote_block_ids", None), ("kvpush_lease_expiry", time.time() - 1),
                         ("remote_port", "x")):
        status, err = post(d + "/v1/completions", {**completion_body(PROMPTS[0]), "kv_transfer_params":
                                                   {**kv, field: value}})
        assert status == 400 and err["error"]["param"] == f"kv_transfer_params.{field}", err
    status, got = post(d + "/v1/completions", {**completion_body(PROMPTS[0]), "kv_transfer_params": kv})
    assert status == 200 and "d_ready" in got["choices"][0]["kvpush_trace"], got


@pytest.fixture(scope="module")
def push_deployment(deployment, tmp_path_factory):
    """1P1D push behind vllm-router's mooncake mode: `--prefill URL PORT` with P's own HTTP port as the
    bootstrap port (P answers GET /query; D reads P's KV address from P's /v1/kv_info)."""
    cluster, _, _ = deployment
    logs = tmp_path_factory.mktemp("vllm-router-push")
    push = Cluster(cluster.model, "push", logs)
    router = None
    try:
        push.wait()
        p = push.prefills[0]
        router = Router(router_binary(), [p.url], [push.decodes[0].url], logs / "router.log",
                        ["--kv-connector", "mooncake"], {p.url: str(p.port)})
        wait_for(router.healthy, 60, "vllm-router /health")
        yield push, router
    finally:
        if router is not None:
            router.stop()
        push.stop()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_push_behind_vllm_router_mooncake_mode(deployment, push_deployment, path):
    _, colocated, _ = deployment
    _, router = push_deployment
    make = completion_body if path == "/v1/completions" else chat_body
    for prompt in PROMPTS:
        want = text_of(answer(colocated.url, path, make(prompt))[1])
        status, got = answer(router.url, path, make(prompt))
        assert status == 200 and text_of(got) == want, got
        trace = got["choices"][0]["kvpush_trace"]
        assert "write_posted" in trace and "d_ready" in trace, trace  # P wrote the KV into D's blocks
        text, done, _ = stream(router.url, path, make(prompt))
        assert done and text == want


def test_push_with_vllm_push_proxy_shape(deployment, push_deployment):
    """vLLM's push demo proxy: P's leg, then D gets P's coordinates and transfer id but no block ids."""
    _, colocated, _ = deployment
    push, _ = push_deployment
    # a prompt D has not served: D holding all but a partial block of one computes the tail itself (no WRITE)
    body = completion_body(PROMPTS[2] + "thirteen fourteen")
    status, out = post(push.prefills[0].url + "/v1/completions", {**body, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None}})
    assert status == 200, out
    kv = out["kv_transfer_params"]
    assert kv["remote_block_ids"] == [] and kv["remote_engine_id"].startswith("prefill-")
    d_kv = {k: kv[k] for k in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")}
    status, got = post(push.decodes[0].url + "/v1/completions", {**body, "kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False, **d_kv}})
    assert status == 200 and text_of(got) == text_of(answer(colocated.url, "/v1/completions", body)[1]), got
    assert "write_posted" in got["choices"][0]["kvpush_trace"]


def test_killed_instances_give_errors_or_retries_never_a_wrong_200(deployment):
    """Last in the module: it kills the first D mid-stream, then the first P."""
    cluster, colocated, routers = deployment
    body = completion_body(PROMPTS[1], 600)
    status, want = answer(colocated.url, "/v1/completions", body)
    assert status == 200
    req = urllib.request.Request(routers[0].url + "/v1/completions",
                                 data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    text, done, events = "", False, 0
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: {") and '"text"' in line:
                    events += 1
                    text += json.loads(line[6:])["choices"][0]["text"]
                    if events == 1:
                        cluster.decodes[0].kill()  # D dies with the stream under way
                done = done or line == "data: [DONE]"
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        done = False  # the stream broke: an error the client sees
    assert events >= 1 and not done, "a stream that lost its decode instance ended as if complete"
    assert text_of(want).startswith(text)
    status, out = answer(routers[0].url, "/v1/completions", completion_body(PROMPTS[0]))
    assert status != 200, out  # its only D is gone
    cluster.prefills[0].kill()
    for prompt in PROMPTS:
        status, want = answer(colocated.url, "/v1/completions", completion_body(prompt))
        status_r, got = answer(routers[1].url, "/v1/completions", completion_body(prompt))
        assert status_r != 200 or text_of(got) == text_of(want), got
