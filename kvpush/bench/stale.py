"""Stale transfers: force P's WRITE (push) or D's READ (pull) to start after D's deadline or P's lease,
while other requests want the blocks, and check that every HTTP 200 equals a colocated run.

    push: P runs with `--fault-inject delay-post:W`, W above D's `--kv-timeout-s`: P matches D's
          registration in time, stalls, then WRITEs into D's blocks after D expired the transfer (the
          race of vLLM issue 55470). D computes the request locally (`--on-kv-failure recompute`); the
          expired transfer's blocks stay quarantined until P's Done / Fail says its WRITE ended. Plain
          requests sent straight to D keep its few blocks busy, so a block released early is reused
          at once and the stale WRITE would corrupt another request's KV.
    pull: D runs with `delay-post:W`, W above P's `--kv-lease-s`: D READs P's blocks after P's lease
          expired and P gave them to other prefills (P legs sent straight to P keep its blocks busy).
          The READ is refused as too late, D computes locally, and its blocks stay quarantined until
          the READ ended.

One forced-late transfer at a time (the stalled thread is the posting side's only transfer thread);
the count is the posting side's `kvpush_kv_transfer_failures_total{reason="posted_late"}`. Used by
tests/test_stale_transfer.py (a few per mode) and benchmarks/stale_transfer.py (200 per mode).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvpush.launcher.launch import ServerProcess, free_port

BS = 8
Reference = Callable[[list[int], int], str]  # (prompt token ids, max_tokens) -> colocated greedy text
LIVE = ("prefilled", "registered", "matched", "posted")
SETTINGS = {  # mode -> (flags of the posting side's peer, stall of the posting side); W > deadline / lease
    "push": (("--kv-timeout-s", "0.3"), 0.45),
    "pull": (("--kv-lease-s", "0.8"), 0.9),
}


@dataclass
class StaleResult:
    mode: str
    forced_late: int = 0  # posts that started after the deadline / lease
    attempts: int = 0
    ok: int = 0  # HTTP 200s, every one compared with the colocated text
    wrong: list[str] = field(default_factory=list)  # 200s whose text differs (must stay empty)
    errors: list[str] = field(default_factory=list)  # non-200 answers
    fallbacks: float = 0.0  # D's local recomputes
    leftovers: dict[str, float] = field(default_factory=dict)  # blocks / live transfers left at the end
    elapsed_s: float = 0.0

    def summary(self) -> str:
        return (f"{self.mode}: {self.forced_late} forced-late transfers in {self.attempts} attempts, "
                f"{self.ok} HTTP 200 ({len(self.wrong)} wrong), {len(self.errors)} errors, "
                f"{self.fallbacks:g} local fallbacks on D, leftovers {self.leftovers or 'none'}, "
                f"{self.elapsed_s:.1f} s")


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1000 + 3 for i in range(n)]


def post(url: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metric(url: str, name: str) -> float:
    """A sample of the instance's /metrics, 0 if absent."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def live_transfers(url: str) -> float:
    return sum(metric(url, f'kvpush_kv_transfers{{state="{s}"}}') for s in LIVE)


def wait_until(cond: Callable[[], object], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


class Deployment:
    """1P1D and a proxy; the posting side stalls every post (push: P's WRITE, pull: D's READ)."""

    def __init__(self, model: str, mode: str, log_dir: Path, quarantine_s: float | None) -> None:
        peer_flags, stall = SETTINGS[mode]
        common = ["--kv-mode", mode, "--block-size", str(BS), "--torch-threads", "1"]
        late = ("--fault-inject", f"delay-post:{stall}")
        quarantine = ("--kv-quarantine-s", str(quarantine_s)) if quarantine_s is not None else ()
        push = mode == "push"
        self.procs: list[ServerProcess] = []
        self.p = self._serve(model, log_dir, "prefill", *common, "--num-blocks", "256" if push else "24",
                             *(late if push else peer_flags))
        self.d = self._serve(model, log_dir, "decode", *common, "--num-blocks", "20" if push else "256",
                             "--on-kv-failure", "recompute", *quarantine, *(peer_flags if push else late))
        for proc in self.procs:
            proc.wait_healthy(120)
        port = free_port()
        self.proxy = ServerProcess(["proxy", "--port", str(port), "--kv-mode", mode, "--prefill", self.p.url,
                                    "--decode", self.d.url], log_path=str(log_dir / f"proxy-{port}.log"))
        self.procs.append(self.proxy.start())
        self.proxy.wait_healthy(120)
        self.poster = self.p if push else self.d

    def _serve(self, model: str, log_dir: Path, role: str, *flags: str) -> ServerProcess:
        port = free_port()
        proc = ServerProcess(["serve", model, "--port", str(port), "--role", role, *flags],
                             log_path=str(log_dir / f"{role}-{port}.log"))
        self.procs.append(proc.start())
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


class Background:
    """Requests that want the blocks the stale transfer aims at. push: plain completions straight to
    D; pull: prefill legs straight to P (P holds each one's blocks until its lease ends)."""

    def __init__(self, dep: Deployment, mode: str, reference: Reference, result: StaleResult) -> None:
        self.dep, self.mode, self.reference, self.result = dep, mode, reference, result
        self.stop = threading.Event()
        self.lock = threading.Lock()
        n = 2 if mode == "push" else 1
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(n)]

    def __enter__(self) -> Background:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _loop(self, worker: int) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            p = prompt(4 * BS, 100_000 + 1000 * worker + i)
            if self.mode == "push":
                self._check(p, 16, *post(self.dep.d.url + "/v1/completions", _body(p, 16)))
            else:
                leg = {"type": "PrefillLegParams", "transfer_id": f"bg-{worker}-{i}-{time.monotonic_ns()}",
                       "mode": "pull"}
                self._check(p, 1, *post(self.dep.p.url + "/v1/completions", {**_body(p, 1),
                                                                             "kv_transfer_params": leg}))
                self.stop.wait(0.2)  # paced: about four leases held at a time (16 of P's 24 blocks)

    def _check(self, p: list[int], max_tokens: int, status: int, out: dict) -> None:
        with self.lock:
            record(self.result, f"background {p[:3]}", max_tokens, self.reference(p, max_tokens), status, out)


def _body(p: list[int], max_tokens: int) -> dict:
    return {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def record(result: StaleResult, what: str, max_tokens: int, expected: str, status: int, out: dict) -> None:
    if status != 200:
        result.errors.append(f"{what}: {status} {out}")
        return
    result.ok += 1
    text = out["choices"][0]["text"]
    if text != expected:
        result.wrong.append(f"{what}: {text!r} != colocated {expected!r}")


def run_stale(model: str, mode: str, count: int, log_dir: Path, reference: Reference,
              quarantine_s: float | None = None, max_attempts: int | None = None) -> StaleResult:
    """Force `count` late transfers (or stop after `max_attempts` requests) with background load."""
    result = StaleResult(mode)
    start = time.monotonic()
    lock = threading.Lock()

    def colocated(p: list[int], max_tokens: int) -> str:  # the reference engine is not thread-safe
        with lock:
            return reference(p, max_tokens)

    dep = Deployment(model, mode, log_dir, quarantine_s)
    try:
        late = 'kvpush_kv_transfer_failures_total{reason="posted_late"}'
        with Background(dep, mode, colocated, result) as bg:
            while result.forced_late < count and result.attempts < (max_attempts or 3 * count):
                result.attempts += 1
                p = prompt(3 * BS, result.attempts)
                status, out = post(dep.proxy.url + "/v1/completions", _body(p, 8))
                with bg.lock:
                    record(result, f"forced {result.attempts}", 8, colocated(p, 8), status, out)
                # the posting side is done with it (push: P's stall may outlast D's answer)
                wait_until(lambda: live_transfers(dep.poster.url) == 0, 10)
                result.forced_late = int(metric(dep.poster.url, late))
        result.fallbacks = metric(dep.d.url, "kvpush_kv_local_fallbacks_total")
        servers = (dep.p, dep.d)
        wait_until(lambda: all(metric(s.url, "kvpush_kv_blocks_used") == 0 and live_transfers(s.url) == 0
                               for s in servers), 30 if quarantine_s is None else quarantine_s + 30)
        for s in servers:
            for name, value in (("blocks_used", metric(s.url, "kvpush_kv_blocks_used")),
                                ("live_transfers", live_transfers(s.url)),
                                ("quarantined", metric(s.url, "kvpush_kv_quarantined_blocks"))):
                if value:
                    result.leftovers[f"{'P' if s is dep.p else 'D'} {name}"] = value
    finally:
        dep.stop()
    result.elapsed_s = time.monotonic() - start
    return result
