"""P and D on two network namespaces joined by a rate-limited veth (root only; CI runs as root).

Every address used here lives inside namespaces the test creates (10.231.0.0/30, 10.231.1.0/30),
and each link is deleted when its test ends, passed or not.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import urllib.request

import pytest

from kvpush.launcher.netlink import LinkConfig, LinkError, RateLimitedLink, measure_tcp_gbps

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and tc need root (CI runs as root)"),
    pytest.mark.skipif(shutil.which("ip") is None or shutil.which("tc") is None,
                       reason="iproute2 (ip, tc) is not installed: apt-get install iproute2"),
]


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout


def test_link_limits_bandwidth_and_cleans_up() -> None:
    with RateLimitedLink(LinkConfig(gbps=0.5)) as link:
        names = (link.ns_p, link.ns_d)
        assert all(n in _namespaces() for n in names)
        limited = measure_tcp_gbps(link, seconds=1.0)
    assert not any(n in _namespaces() for n in names)
    with RateLimitedLink(LinkConfig(gbps=math.inf)) as link:
        unlimited = measure_tcp_gbps(link, seconds=1.0)
    assert 0.35 <= limited <= 0.65, f"0.5 Gbit/s link measured {limited:.3f} Gbit/s"
    assert unlimited > 3 * limited, f"unlimited veth {unlimited:.2f} Gbit/s vs limited {limited:.3f}"
    assert link.ns_p not in _namespaces() and link.ns_d not in _namespaces()
    assert link.dev_r not in subprocess.run(["ip", "link"], capture_output=True, text=True, timeout=10).stdout


def test_link_teardown_on_error_is_idempotent() -> None:
    link = RateLimitedLink(LinkConfig(gbps=1.0))
    with pytest.raises(RuntimeError), link:
        names = (link.ns_p, link.ns_d)
        raise RuntimeError("boom")
    assert not any(n in _namespaces() for n in names)
    link.close()  # again: nothing left to do
    with pytest.raises(LinkError):
        LinkConfig(gbps=0)


def test_push_deployment_over_limited_link(tmp_path) -> None:
    from kvpush.launcher.launch import free_port
    from kvpush.launcher.up import Deployment
    from kvpush.models.make_model import make_model

    model = make_model(str(tmp_path / "tiny"), preset="tiny", seed=0)
    serve_args = ["--block-size", "8", "--num-blocks", "256", "--torch-threads", "1"]
    with RateLimitedLink(LinkConfig(gbps=1.0)) as link:
        dep = Deployment(model, 1, 1, "push", free_port(), serve_args, [], log_dir=str(tmp_path / "logs"), link=link)
        try:
            dep.start(timeout_s=120)
            assert dep.url == f"http://{link.host_d_root}:{dep.proxy.port}"
            body = json.dumps({"model": model, "prompt": "the quick brown fox " * 8, "max_tokens": 8,
                               "temperature": 0}).encode()
            req = urllib.request.Request(dep.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                assert r.status == 200
                out = json.loads(r.read())
            assert out["usage"]["completion_tokens"] > 0
            decode = next(s for s in dep.instances if "decode" in s.argv)
            assert decode.host == link.host_d
            with urllib.request.urlopen(decode.url + "/metrics", timeout=10) as r:
                metrics = r.read().decode()
            m = re.search(r"^kvpush_kv_transfer_bytes_total (\S+)$", metrics, re.M)
            assert m is not None and float(m.group(1)) > 0, metrics
        finally:
            dep.stop()
    assert link.ns_p not in _namespaces() and link.ns_d not in _namespaces()
