"""`kvpush up` starts a 1P1D deployment, serves through its proxy, and stops with no process left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from kvpush.launcher.launch import free_port

pytestmark = pytest.mark.integration


def parents() -> dict[int, int]:
    out = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":  # zombies are dead
                    out[int(pid)] = int(fields[1])
            except OSError:
                continue
    return out


def descendants(root: int) -> set[int]:
    ppid = parents()
    found, frontier = set(), {root}
    while frontier:
        frontier = {p for p, pp in ppid.items() if pp in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    return pids & set(parents())


@pytest.mark.parametrize(("sig", "mode"), [(signal.SIGTERM, "push"), (signal.SIGINT, "auto"), (signal.SIGKILL, "pull")])
def test_up_starts_serves_and_stops_cleanly(tiny_model, tmp_path, sig, mode):
    port = free_port()
    up = subprocess.Popen([sys.executable, "-m", "kvpush.cli", "up", tiny_model, "--kv-mode", mode, "--port", str(port),
                           "--num-blocks", "256", "--block-size", "8"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    children: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        lines = []
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            lines.append(line)
            if "ready:" in line or not line:
                break
        assert any("ready:" in ln for ln in lines), lines
        children = descendants(up.pid)
        assert len(children) >= 5  # P and D (each with its engine core) and the proxy
        body = json.dumps({"prompt": "hello", "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
        assert out["usage"]["completion_tokens"] == 4
        assert ("kvpush_route" in out["choices"][0]) == (mode == "auto")  # auto says which route it took
        up.send_signal(sig)
        # SIGKILL: `up` cannot clean up; its children get SIGTERM from the kernel (parent-death signal)
        assert up.wait(60) == (-signal.SIGKILL if sig == signal.SIGKILL else 0)
        assert gone(children, 20) == set()
    finally:
        kill_all(up, children)


def gone(pids: set[int], timeout_s: float) -> set[int]:
    """Waits until none of `pids` is alive, or `timeout_s`; -> those still alive."""
    deadline = time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(pids)


def kill_all(up: subprocess.Popen, children: set[int]) -> None:
    """A test's teardown: `up` and everything it started, killed whatever happened."""
    if up.poll() is None:
        up.kill()
    for pid in alive(children | descendants(up.pid)):
        os.kill(pid, signal.SIGKILL)


def test_up_hands_the_auto_flags_to_its_proxy(monkeypatch: pytest.MonkeyPatch):
    """`kvpush up --auto-...` goes to the proxy (every other unknown flag goes to each `kvpush serve`)."""
    import kvpush.launcher.up as up
    from kvpush import cli, flags

    seen: dict[str, list[str]] = {}
    monkeypatch.setattr(up, "run_up", lambda model, p, d, mode, port, serve_args, proxy_args, **kw:
                        seen.update(serve=serve_args, proxy=proxy_args) or 0)
    args, serve_args = flags.up_parser().parse_known_args(
        ["m", "--kv-mode", "auto", "--auto-local-share", "0.1", "--auto-stall-weight", "2", "--torch-threads", "1"])
    assert cli.cmd_up(args, serve_args) == 0
    proxy = seen["proxy"]
    assert proxy[proxy.index("--auto-local-share") + 1] == "0.1" and proxy[proxy.index("--auto-stall-weight") + 1] == "2.0"
    assert seen["serve"] == ["--torch-threads", "1"]
    assert cli.build_parser().parse_args(["proxy", "--prefill", "u", "--decode", "v", *proxy]).auto_local_share == 0.1
    assert "--auto-busy-period" not in proxy  # a switch left off is not passed
    args, serve_args = flags.up_parser().parse_known_args(["m", "--kv-mode", "auto", "--auto-busy-period"])
    assert cli.cmd_up(args, serve_args) == 0
    assert cli.build_parser().parse_args(["proxy", "--prefill", "u", "--decode", "v", *seen["proxy"]]).auto_busy_period
