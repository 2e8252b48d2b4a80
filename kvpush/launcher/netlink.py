"""Two "hosts" on one machine joined by a link of limited bandwidth (root only, Linux).

    root namespace                 ns_d                            ns_p
    <host_subnet>.1 --(dev_r/dev_h)-- <host_subnet>.2
                                    <subnet>.2 --(dev_d/dev_p)-- <subnet>.1
                                             tbf rate G both ways

A RateLimitedLink creates two network namespaces, one per role (prefill in ns_p, decode in ns_d),
joined by a veth pair whose two ends are each shaped by `tc ... tbf` (plus optional netem delay),
so that each direction carries at most `gbps`. A second, unshaped veth pair joins the root
namespace to ns_d; ns_d forwards between its two links, so a client in the root namespace (a
benchmark, curl, a health check) reaches every address inside, while P <-> D traffic crosses the
shaped link. Every address is inside namespaces this object created; deleting the namespaces
removes the veth pairs and their routes. Teardown is idempotent and runs from `__exit__`.

    with RateLimitedLink(LinkConfig(gbps=1.0)) as link:
        subprocess.run(link.wrap(link.ns_p, ["python", "-m", "kvpush.cli", "serve", ...]))
        print(measure_tcp_gbps(link))
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from kvpush.errors import KVPushError

_TIMEOUT_S = 10


class LinkError(KVPushError):
    """A rate-limited link cannot be created or used: not root, no iproute2, a failed `ip`/`tc` step."""


class NoNetemError(LinkError):
    """The kernel has no netem qdisc: a link can be shaped, but not delayed."""


@dataclass(frozen=True)
class LinkConfig:
    gbps: float  # per direction; math.inf: no shaping (a plain veth)
    name_prefix: str = "kvp"
    subnet: str = "10.231.0"  # the shaped P <-> D link: <subnet>.1 (P) and <subnet>.2 (D), a /30
    delay_ms: float = 0.0  # netem delay added on each end (one-way)
    host_subnet: str | None = None  # root <-> ns_d link, a /30; default: the next /24 after subnet

    def __post_init__(self) -> None:
        if not (self.gbps > 0):
            raise LinkError(f"link bandwidth must be positive, got {self.gbps} Gbit/s")
        if self.delay_ms < 0:
            raise LinkError(f"link delay must not be negative, got {self.delay_ms} ms")
        if not (1 <= len(self.name_prefix) <= 5 and self.name_prefix.replace("-", "").isalnum()):
            raise LinkError(f"name_prefix must be 1-5 letters/digits (interface names are short), "
                            f"got {self.name_prefix!r}")
        for net in (self.subnet, self.resolved_host_subnet):
            parts = net.split(".")
            if len(parts) != 3 or not all(p.isdigit() and 0 <= int(p) <= 255 for p in parts):
                raise LinkError(f"subnet must be the first three octets of an IPv4 address, got {net!r}")
        if self.subnet == self.resolved_host_subnet:
            raise LinkError("subnet and host_subnet must differ")

    @property
    def resolved_host_subnet(self) -> str:
        if self.host_subnet is not None:
            return self.host_subnet
        a, b, c = self.subnet.split(".")
        return f"{a}.{b}.{(int(c) + 1) % 256}"


def require_root() -> None:
    if os.geteuid() != 0:
        raise LinkError("--link-gbps needs root (network namespaces and tc); run as root or drop --link-gbps")


def require_iproute2() -> None:
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinkError(f"{' and '.join(missing)} not found: install iproute2 (apt-get install iproute2)")


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, check=True, capture_output=True, timeout=_TIMEOUT_S, text=True)
    except subprocess.CalledProcessError as e:
        raise LinkError(f"`{' '.join(argv)}` failed with exit code {e.returncode}: "
                        f"{(e.stderr or '').strip()}") from e
    except subprocess.TimeoutExpired as e:
        raise LinkError(f"`{' '.join(argv)}` did not finish in {_TIMEOUT_S} s") from e
    except OSError as e:
        raise LinkError(f"`{' '.join(argv)}` cannot run: {e}") from e
    return done.stdout


class RateLimitedLink:
    def __init__(self, config: LinkConfig) -> None:
        self.config = config
        tag = secrets.token_hex(2)
        pre = config.name_prefix
        self.ns_p = f"{pre}-p-{tag}"
        self.ns_d = f"{pre}-d-{tag}"
        self.dev_p = f"{pre}{tag}p"  # in ns_p, shaped
        self.dev_d = f"{pre}{tag}d"  # in ns_d, shaped
        self.dev_h = f"{pre}{tag}h"  # in ns_d, towards the root namespace
        self.dev_r = f"{pre}{tag}r"  # in the root namespace
        self.host_p = f"{config.subnet}.1"
        self.host_d = f"{config.subnet}.2"
        self.host_root = f"{config.resolved_host_subnet}.1"  # the root namespace's end
        self.host_d_root = f"{config.resolved_host_subnet}.2"  # ns_d's end towards the root namespace
        self._created: list[str] = []  # namespaces to delete
        self._up = False

    # -- the public API -------------------------------------------------------------------------------
    def wrap(self, ns: str, argv: list[str]) -> list[str]:
        """argv run inside network namespace ns."""
        return ["ip", "netns", "exec", ns, *argv]

    def device(self, ns: str) -> str:
        """The shaped veth end inside ns (for UCX_NET_DEVICES)."""
        return {self.ns_p: self.dev_p, self.ns_d: self.dev_d}[ns]

    def host(self, ns: str) -> str:
        """The address of ns on the shaped link."""
        return {self.ns_p: self.host_p, self.ns_d: self.host_d}[ns]

    def describe(self) -> str:
        rate = "unlimited" if math.isinf(self.config.gbps) else f"{self.config.gbps:g} Gbit/s"
        delay = f", +{self.config.delay_ms:g} ms each way" if self.config.delay_ms else ""
        return (f"{rate} each way{delay}: P in {self.ns_p} ({self.host_p}), D in {self.ns_d} ({self.host_d}), "
                f"root namespace reaches ns_d at {self.host_d_root}")

    def start(self) -> RateLimitedLink:
        require_root()
        require_iproute2()
        if self._up:
            return self
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        self._up = True
        return self

    def close(self) -> None:
        """Stop what still runs inside, delete both namespaces (and so the veth pairs). Idempotent."""
        errors = []
        for ns in reversed(self._created):
            _kill_namespace_processes(ns)
            try:
                _run(["ip", "netns", "delete", ns])
            except LinkError as e:
                errors.append(str(e))
        self._created = []
        self._up = False
        self._wait_routes_gone(5.0)  # the kernel frees a namespace's devices asynchronously
        if errors:
            raise LinkError("; ".join(errors))

    def _routed(self) -> list[str]:
        routes = _run(["ip", "-4", "route", "show"])
        return [net for net in (self.config.subnet, self.config.resolved_host_subnet)
                if re.search(rf"(^|[^0-9.]){re.escape(net)}\.", routes, re.M)]

    def _wait_routes_gone(self, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while (routed := self._routed()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return routed

    def __enter__(self) -> RateLimitedLink:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- setup ----------------------------------------------------------------------------------------
    def _setup(self) -> None:
        cfg = self.config
        for net in self._wait_routes_gone(5.0):  # a link just closed may still be going away
            raise LinkError(f"{net}.0/30 is already routed in the root namespace (another link still up?); "
                            f"pick another LinkConfig.subnet")
        for ns in (self.ns_p, self.ns_d):
            _run(["ip", "netns", "add", ns])
            self._created.append(ns)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        # the shaped link P <-> D
        _run(["ip", "link", "add", self.dev_p, "netns", self.ns_p, "type", "veth",
              "peer", "name", self.dev_d, "netns", self.ns_d])
        _run(["ip", "-n", self.ns_p, "addr", "add", f"{self.host_p}/30", "dev", self.dev_p])
        _run(["ip", "-n", self.ns_d, "addr", "add", f"{self.host_d}/30", "dev", self.dev_d])
        _run(["ip", "-n", self.ns_p, "link", "set", self.dev_p, "up"])
        _run(["ip", "-n", self.ns_d, "link", "set", self.dev_d, "up"])
        for ns, dev in ((self.ns_p, self.dev_p), (self.ns_d, self.dev_d)):
            self._shape(ns, dev)
        # the root namespace <-> ns_d (unshaped); created with its root end already in place, so
        # deleting ns_d removes it
        _run(["ip", "link", "add", self.dev_h, "netns", self.ns_d, "type", "veth", "peer", "name", self.dev_r])
        _run(["ip", "-n", self.ns_d, "addr", "add", f"{self.host_d_root}/30", "dev", self.dev_h])
        _run(["ip", "-n", self.ns_d, "link", "set", self.dev_h, "up"])
        _run(["ip", "addr", "add", f"{self.host_root}/30", "dev", self.dev_r])
        _run(["ip", "link", "set", self.dev_r, "up"])
        # routes: root -> P through ns_d, P -> root through ns_d (forwarding inside ns_d only)
        _run(["ip", "route", "add", f"{cfg.subnet}.0/30", "via", self.host_d_root, "dev", self.dev_r])
        _run(["ip", "-n", self.ns_p, "route", "add", f"{cfg.resolved_host_subnet}.0/30", "via", self.host_d])
        _run(self.wrap(self.ns_d, ["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"]))

    def _shape(self, ns: str, dev: str) -> None:
        cfg = self.config
        tc = self.wrap(ns, ["tc", "qdisc", "add", "dev", dev])
        parent = ["root"]
        if cfg.delay_ms > 0:
            try:
                _run([*tc, "root", "handle", "1:", "netem", "delay", f"{cfg.delay_ms:g}ms", "limit", "100000"])
            except LinkError as e:
                if "unknown" in str(e):
                    raise NoNetemError(f"{e} (this kernel has no netem qdisc: use delay_ms=0)") from e
                raise
            parent = ["parent", "1:1", "handle", "10:"]
        if math.isinf(cfg.gbps):
            return
        rate_bytes = cfg.gbps * 1e9 / 8
        # burst: 4 ms worth, at least 128 KiB (veth passes 64 KiB GSO packets); queue: 20 ms plus the delay
        burst = max(128 * 1024, int(rate_bytes * 0.004))
        latency_ms = 20 + 2 * cfg.delay_ms
        _run([*tc, *parent, "tbf", "rate", f"{cfg.gbps * 1000:.0f}mbit", "burst", str(burst),
              "latency", f"{latency_ms:g}ms"])


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILL what still runs inside ns (started through wrap()), so that deleting it frees the veth."""
    try:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=_TIMEOUT_S).stdout
    except (OSError, subprocess.TimeoutExpired):
        return
    for pid in out.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass


_RECEIVER = r"""
import json, socket, sys, time
host, port, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((host, port)); srv.listen(1); srv.settimeout(limit)
print(json.dumps({"port": srv.getsockname()[1]}), flush=True)
conn, _ = srv.accept(); conn.settimeout(limit)
buf = bytearray(1 << 20); n = 0; first = last = None
deadline = time.monotonic() + limit
while time.monotonic() < deadline:
    k = conn.recv_into(buf)
    if not k:
        break
    last = time.monotonic()
    if first is None:
        first = last
    n += k
print(json.dumps({"bytes": n, "seconds": (last - first) if first is not None else 0.0}), flush=True)
"""

_SENDER = r"""
import socket, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.create_connection((host, port), timeout=10)
chunk = b"\0" * (1 << 20); end = time.monotonic() + seconds
while time.monotonic() < end:
    s.sendall(chunk)
s.close()
"""


def measure_tcp_gbps(link: RateLimitedLink, seconds: float = 1.0) -> float:
    """Gbit/s of one TCP stream from ns_d to ns_p over the shaped link, measured by the receiver."""
    limit = seconds + 20.0
    recv = subprocess.Popen(link.wrap(link.ns_p, [sys.executable, "-c", _RECEIVER, link.host_p, "0", str(limit)]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert recv.stdout is not None
        line = recv.stdout.readline()  # the receiver listens (or died: empty line)
        if not line:
            raise LinkError(f"TCP receiver in {link.ns_p} failed: {recv.stderr.read() if recv.stderr else ''}")
        port = json.loads(line)["port"]
        try:
            subprocess.run(link.wrap(link.ns_d, [sys.executable, "-c", _SENDER, link.host_p, str(port), str(seconds)]),
                           check=True, capture_output=True, timeout=limit, text=True)
        except subprocess.CalledProcessError as e:
            raise LinkError(f"TCP sender in {link.ns_d} failed: {e.stderr.strip()}") from e
        except subprocess.TimeoutExpired as e:
            raise LinkError(f"TCP sender in {link.ns_d} did not finish in {limit:.0f} s") from e
        out, err = recv.communicate(timeout=limit)
        if recv.returncode != 0 or not out.strip():
            raise LinkError(f"TCP receiver in {link.ns_p} failed: {err.strip()}")
        result = json.loads(out.strip().splitlines()[-1])
        if result["seconds"] <= 0:
            raise LinkError("TCP measurement received no data")
        return result["bytes"] * 8 / result["seconds"] / 1e9
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait(5)
