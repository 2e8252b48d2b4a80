"""`kvpush up`: a local xPyD deployment (N prefill, M decode, kvpush's proxy or vllm-router) as children.

    STARTING (instances started, then waited for; then the proxy) -> UP (proxy URL printed)
    -> STOPPING (Ctrl-C / SIGTERM, or a child died: proxy first, then every instance, each with
       its engine core; SIGKILL for what does not stop in time) -> exit
Children run in their own process groups and get SIGTERM if `kvpush up` itself dies.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
from typing import TYPE_CHECKING

from kvpush.errors import KVPushError
from kvpush.launcher.launch import ServerProcess, free_port
from kvpush.launcher.placement import available_cpus, format_cpus, split_halves

if TYPE_CHECKING:
    from kvpush.launcher.netlink import RateLimitedLink


class Deployment:
    def __init__(self, model: str, num_prefill: int, num_decode: int, kv_mode: str, port: int,
                 serve_args: list[str], proxy_args: list[str], log_dir: str | None = None,
                 link: RateLimitedLink | None = None, router: str = "kvpush", pin: bool = False) -> None:
        """With `link`, prefill instances run in link.ns_p, decode instances and the proxy in link.ns_d,
        KV moves over UCX/TCP across the shaped veth, and `url` is the proxy's address on ns_d's
        link to the root namespace. With `pin`, prefill instances get the first half of this
        process's CPUs and decode instances the second (`--cpus`); raises PlacementError with < 2."""
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="kvpush-up-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.instances: list[ServerProcess] = []
        self.roles: list[str] = []  # each instance's role, in the order of `instances`
        self.placement: list[str] = []
        halves = dict(zip(("prefill", "decode"), split_halves(available_cpus()), strict=True)) if pin else {}
        urls: dict[str, list[str]] = {"prefill": [], "decode": []}
        for role, n in (("prefill", num_prefill), ("decode", num_decode)):
            cpus = ["--cpus", format_cpus(halves[role])] if pin else []
            for i in range(n):
                argv = ["serve", model, "--port", str(free_port()), "--role", role, "--kv-mode", kv_mode, *serve_args,
                        *cpus]
                self.placement.append(f"{role}-{i} on cpus {cpus[1] if cpus else 'any'}")
                log_path = os.path.join(self.log_dir, f"{role}-{i}.log")
                if link is None:
                    server = ServerProcess(argv, log_path=log_path)
                else:  # --link-gbps: this instance lives in its role's namespace
                    ns = link.ns_p if role == "prefill" else link.ns_d
                    host = link.host(ns)
                    server = ServerProcess([*argv, "--host", host, "--kv-host", host], host=host, log_path=log_path,
                                           prefix=link.wrap(ns, []),
                                           env={"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": link.device(ns)})
                self.instances.append(server)
                self.roles.append(role)
                urls[role].append(server.url)
        proxy_argv = ["proxy", "--port", str(port), "--kv-mode", kv_mode, "--prefill", *urls["prefill"],
                      "--decode", *urls["decode"], *proxy_args]
        if router == "vllm-router":
            if link is not None:
                raise KVPushError("--router vllm-router does not run across --link-gbps namespaces")
            self.proxy = ServerProcess(vllm_router_argv(port, urls, proxy_args, kv_mode), program=[find_vllm_router()],
                                       log_path=os.path.join(self.log_dir, "vllm-router.log"))
        elif link is None:
            self.proxy = ServerProcess(proxy_argv, log_path=os.path.join(self.log_dir, "proxy.log"))
        else:  # in ns_d: reaches D locally, P over the link, and the root namespace reaches it
            self.proxy = ServerProcess([*proxy_argv, "--host", link.host_d_root], host=link.host_d_root,
                                       log_path=os.path.join(self.log_dir, "proxy.log"), prefix=link.wrap(link.ns_d, []))

        self.placement.append("proxy on cpus any")

    @property
    def url(self) -> str:
        return self.proxy.url

    def of_role(self, role: str) -> list[ServerProcess]:
        """The instances of one role (prefill or decode), in the order they were made."""
        return [s for s, r in zip(self.instances, self.roles, strict=True) if r == role]

    def start(self, timeout_s: float = 300.0) -> Deployment:
        try:
            for s in self.instances:
                s.start()
            for s in self.instances:
                s.wait_healthy(timeout_s)
            self.proxy.start()
            self.proxy.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self.proxy.stop()
        for s in self.instances:
            s.stop()

    def alive(self) -> bool:
        return all(s.proc is not None and s.proc.poll() is None for s in [self.proxy, *self.instances])

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def find_vllm_router() -> str:
    """The vllm-router binary: on PATH or beside this Python (a venv's bin/)."""
    here = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    found = shutil.which("vllm-router") or (here if os.access(here, os.X_OK) else None)
    if found is None:
        raise KVPushError("--router vllm-router: no vllm-router binary on PATH or next to this Python; "
                          "install it with `pip install vllm-router==0.1.17`")
    return found


def vllm_router_argv(port: int, urls: dict[str, list[str]], proxy_args: list[str], kv_mode: str = "pull") -> list[str]:
    """vllm-router in P/D mode over the pools (pull: its NIXL mode; push: its mooncake mode, each P's HTTP
    port as its bootstrap port); kvpush's --policy mapped onto its policies."""
    policy = proxy_args[proxy_args.index("--policy") + 1] if "--policy" in proxy_args else "round-robin"
    argv = ["--vllm-pd-disaggregation", "--host", "127.0.0.1", "--port", str(port), "--prometheus-port",
            str(free_port()), "--policy", {"least-loaded": "power_of_two"}.get(policy, "round_robin"),
            "--kv-connector", "nixl" if kv_mode == "pull" else "mooncake"]
    for url in urls["prefill"]:
        argv += ["--prefill", url, *([] if kv_mode == "pull" else [url.rsplit(":", 1)[1]])]
    for url in urls["decode"]:
        argv += ["--decode", url]
    return argv


def run_up(model: str, num_prefill: int, num_decode: int, kv_mode: str, port: int, serve_args: list[str],
           proxy_args: list[str], link_gbps: float | None = None, router: str = "kvpush",
           pin: bool = False, link_delay_ms: float = 0.0, check_link: bool = False) -> int:
    """`check_link`: measure the link's TCP rate once it is up and say whether the host carries what was
    asked (an emulated link: cli.py's emulated_link)."""
    link = None
    if link_gbps is not None:  # P and D on two "hosts" joined by a link of link_gbps each way
        from kvpush.launcher.netlink import (
            LinkConfig,
            NoNetemError,
            RateLimitedLink,
            measure_tcp_gbps,
            require_root,
        )

        require_root()
        try:
            link = RateLimitedLink(LinkConfig(gbps=link_gbps, delay_ms=link_delay_ms)).start()
        except NoNetemError:  # the bandwidth still holds; the latency cannot be added here
            print(f"kvpush up: this kernel has no netem qdisc: the link's {link_delay_ms:g} ms one way are left out",
                  file=sys.stderr, flush=True)
            link = RateLimitedLink(LinkConfig(gbps=link_gbps)).start()
    try:
        if link is not None and check_link:
            measured = measure_tcp_gbps(link)
            short = measured < 0.9 * link.config.gbps
            print(f"kvpush up: link measured at {measured:.2f} Gbit/s (one TCP stream) against {link.config.gbps:g} "
                  "asked" + (": this host carries less than the emulated link, so transfers take longer than "
                             "modelled; raise --time-scale" if short else ""),
                  file=sys.stderr if short else sys.stdout, flush=True)
        return _run_up(model, num_prefill, num_decode, kv_mode, port, serve_args, proxy_args, link, router, pin)
    finally:
        if link is not None:
            link.close()


def _run_up(model: str, num_prefill: int, num_decode: int, kv_mode: str, port: int, serve_args: list[str],
            proxy_args: list[str], link: RateLimitedLink | None, router: str = "kvpush", pin: bool = False) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    dep = Deployment(model, num_prefill, num_decode, kv_mode, port, serve_args, proxy_args, link=link, router=router,
                     pin=pin)
    print(f"kvpush up: starting {num_prefill}P{num_decode}D ({kv_mode}) behind {router}; logs in {dep.log_dir}",
          flush=True)
    print(f"kvpush up: placement: {'; '.join(dep.placement)}", flush=True)
    if link is not None:
        print(f"kvpush up: link {link.describe()}", flush=True)
    dep.start()
    print(f"kvpush up: ready: {dep.url}", flush=True)
    code = 0
    try:
        while not stop.wait(1.0):
            if not dep.alive():
                print("kvpush up: a child process exited; stopping the deployment", file=sys.stderr)
                code = 1
                break
    finally:
        dep.stop()
        print("kvpush up: stopped", flush=True)
    return code
