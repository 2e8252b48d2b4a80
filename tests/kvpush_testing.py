"""Helpers for tests that run real deployments: HTTP calls, metrics, a P/D cluster of servers."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvpush.bench.stale import post  # noqa: F401 - the tests' JSON POST helper
from kvpush.launcher.launch import ServerProcess, free_port

BS = 8
NO_CUDA = "no CUDA device"
ON_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)


def devices(cpu_twin: bool = False) -> list:
    """Parameters [cpu, cuda]: cuda skips with "no CUDA device" where torch sees no GPU. With cpu_twin the
    cpu case repeats coverage that exists elsewhere and runs only under `pytest --cpu-twins`."""
    cpu_marks = [pytest.mark.cpu_twin] if cpu_twin else []
    return [pytest.param("cpu", marks=cpu_marks), pytest.param("cuda", marks=ON_CUDA)]

SERVE = ["--block-size", str(BS), "--num-blocks", "512", "--torch-threads", "1"]
MAX_TOKENS = 8


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def completion(url: str, prompt: list[int], max_tokens: int = MAX_TOKENS,
               logprobs: bool = True) -> tuple[list[str] | None, str, dict]:
    """Greedy tokens (as strings; None without logprobs), text and usage. A proxy recomputes the first
    token on D for a request that asks for logprobs, whatever its --first-token says."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    status, out = post(url + "/v1/completions", {**body, "logprobs": 0} if logprobs else body)
    assert status == 200, out
    choice = out["choices"][0]
    return choice["logprobs"]["tokens"] if logprobs else None, choice["text"], out["usage"]


class Cluster:
    def __init__(self, model: str, mode: str, log_dir, prefill: int = 1, decode: int = 1,
                 extra_decode: tuple[str, ...] = (), extra_prefill: tuple[str, ...] = ()) -> None:
        self.model = model
        self.procs: list[ServerProcess] = []
        self.prefills = [self._serve(model, "prefill", mode, log_dir, extra_prefill) for _ in range(prefill)]
        self.decodes = [self._serve(model, "decode", mode, log_dir, extra_decode) for _ in range(decode)]
        self.mode = mode
        self.log_dir = log_dir

    def _serve(self, model: str, role: str, mode: str, log_dir, extra: tuple[str, ...],
               port: int | None = None) -> ServerProcess:
        port = port or free_port()
        proc = ServerProcess(["serve", model, "--port", str(port), "--role", role, "--kv-mode", mode, *SERVE, *extra],
                             log_path=str(log_dir / f"{role}-{port}.log"))
        self.procs.append(proc.start())
        return proc

    def restart(self, proc: ServerProcess, extra: tuple[str, ...] = ()) -> ServerProcess:
        """Start a fresh instance of the same role on the same port (it gets a new engine id)."""
        role = proc.argv[proc.argv.index("--role") + 1]
        new = self._serve(self.model, role, self.mode, self.log_dir, extra, port=proc.port)
        pool = self.prefills if role == "prefill" else self.decodes
        pool[pool.index(proc)] = new
        return new

    def proxy(self, first_token: str = "recompute", policy: str = "round-robin",
              extra: tuple[str, ...] = ()) -> ServerProcess:
        port = free_port()
        argv = ["proxy", "--port", str(port), "--kv-mode", self.mode, "--first-token", first_token, "--policy", policy,
                "--prefill", *[p.url for p in self.prefills], "--decode", *[d.url for d in self.decodes], *extra]
        proc = ServerProcess(argv, log_path=str(self.log_dir / f"proxy-{port}.log"))
        self.procs.append(proc.start())
        proc.wait_healthy(120)
        return proc

    def wait(self) -> Cluster:
        for p in self.procs:
            p.wait_healthy(120)
        return self

    def stop(self) -> None:
        """Proxies first (nothing new reaches the instances), then every instance at once."""
        proxies = [p for p in self.procs if p.argv and p.argv[0] == "proxy"]
        for group in (proxies, [p for p in self.procs if p not in proxies]):
            with ThreadPoolExecutor(max(len(group), 1)) as pool:
                list(pool.map(ServerProcess.stop, group))


def prompt_of(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1000 + 3 for i in range(n)]



def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
