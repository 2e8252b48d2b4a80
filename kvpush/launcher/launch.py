"""Start and stop kvpush processes (servers, proxies) as children, with no orphans left behind.

Used by `kvpush up`, the demo, benchmarks and tests. A ServerProcess runs `python -m kvpush.cli ...`
in its own process group, so that stopping it also stops the engine-core process it spawned.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import IO

_PORT_FLOOR = 10000  # lowest port free_port hands out
_given: set[int] = set()  # ports this process has handed out (never twice)
_given_lock = threading.Lock()
_rng = random.SystemRandom()  # not the global generator: a test seeding it must not make processes collide


def free_port() -> int:
    """A loopback TCP port that is free now, for a server about to start. Drawn at random from below the
    kernel's ephemeral range: a port the kernel picks itself (bind to 0) can be taken, between this check
    and the server's own bind, by any outgoing connection or by a listener UCX opens on port 0 (a race
    seen in CI with four servers starting at once). Falls back to a kernel-chosen port when the range
    below is too small."""
    low = _ephemeral_low()
    with _given_lock:
        for _ in range(200 if low - _PORT_FLOOR >= 1000 else 0):
            port = _rng.randrange(_PORT_FLOOR, low)
            if port not in _given and _bindable(port):
                _given.add(port)
                return port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        _given.add(port)
        return port


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; other systems start higher (49152)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class ServerProcess:
    def __init__(self, argv: list[str], host: str = "127.0.0.1", env: dict[str, str] | None = None,
                 log_path: str | None = None, prefix: list[str] | None = None,
                 program: list[str] | None = None) -> None:
        self.argv = argv
        self.program = program or [sys.executable, "-m", "kvpush.cli"]  # another server: its own command
        self.prefix = prefix or []  # e.g. ["ip", "netns", "exec", NS]: run the server inside a namespace
        self.host = host
        self.port = int(argv[argv.index("--port") + 1])
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerProcess:
        out: int | IO[bytes] = subprocess.DEVNULL
        if self.log_path:
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
            out = self._log
        self.proc = subprocess.Popen([*self.prefix, *self.program, *self.argv], env=self.env,
                                     stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        return self

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        """Block until GET /health answers 200; raise RuntimeError if the process dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.argv} exited with {self.proc.returncode}; log: {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server {self.argv} not healthy after {timeout_s} s; log: {self.log_path}")

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop now: SIGTERM and SIGINT to the process group (a second signal cuts a server's drain short:
        what still runs ends with an error and its peers are told), then SIGKILL what is left. Idempotent.
        For a graceful drain, send one SIGTERM and wait (`kvpush serve --shutdown-timeout`)."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        _signal_group(pgid, signal.SIGTERM)
        _signal_group(pgid, signal.SIGINT)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(pgid, signal.SIGKILL)  # stragglers (the engine core) go too
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        if self._log is not None:
            self._log.close()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL the whole process group at once (fault tests)."""
        if self.proc is not None:
            _signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            self.proc = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stream_completion(self, model: str, prompt: str, max_tokens: int = 16) -> Iterator[str]:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                           "temperature": 0}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[6:])["choices"][0]["text"]


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the parent dies (Linux), so no orphan survives.

    The kernel ties this to the *thread* that forked the child: start servers from a thread that
    lives as long as they should (the main thread), not from a short-lived worker thread."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
