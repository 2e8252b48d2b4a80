"""kvpush bench's emulation report (bench/emulation.py) over /metrics pages served here: a real instance
gives none; an emulated one names its profile and is valid only while its lateness p99 stays within 5%
of its median step; behind a proxy every listed instance counts, an unreachable one makes the run
invalid; the summary line and `kvpush bench compare` say so."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvpush.bench.compare import emulated
from kvpush.bench.emulation import add_emulated_time, describe, emulation_report, reset_windows
from kvpush.launcher.launch import free_port

REAL = "kvpush_requests_total 3\n"


def emulated_page(p99_s: float, step_s: float, profile: str = "qwen3-8b-h100") -> str:
    return (f'kvpush_emulated{{profile="{profile}",time_scale="0.5"}} 1.0\n'
            f"kvpush_emulated_step_lateness_p50_seconds {p99_s / 4}\n"
            f"kvpush_emulated_step_lateness_p99_seconds {p99_s}\n"
            f"kvpush_emulated_step_p50_seconds {step_s}\n")


def proxy_page(urls: list[str]) -> str:
    return "".join(f'kvpush_proxy_instance_served{{role="decode",url="{u}"}} 2.0\n' for u in urls)


@pytest.fixture
def pages():
    """url -> the /metrics text it serves (set by the test); a missing one answers 500."""
    served: dict[str, str] = {}
    answers: dict[str, tuple[int, str]] = {}  # url -> what a POST gets (status, body); missing: 404 with no body
    servers = []

    def serve() -> str:
        port = free_port()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                text = served.get(f"http://127.0.0.1:{port}")
                self.send_response(200 if text is not None else 500)
                self.end_headers()
                self.wfile.write((text or "").encode())

            def do_POST(self) -> None:
                status, body = answers.get(f"http://127.0.0.1:{port}", (404, ""))
                self.send_response(status)
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{port}"

    serve.answers = answers  # type: ignore[attr-defined]
    yield served, serve
    for server in servers:
        server.shutdown()
        server.server_close()


def test_a_real_instance_has_no_report(pages):
    served, serve = pages
    url = serve()
    served[url] = REAL
    assert emulation_report(url) is None and describe(None) == ""


def test_an_emulated_instance_is_valid_while_its_lateness_stays_within_5_percent(pages):
    served, serve = pages
    url = serve()
    served[url] = emulated_page(p99_s=0.0004, step_s=0.010)
    report = emulation_report(url)
    assert report is not None and report["valid"] and report["profiles"] == ["qwen3-8b-h100"]
    assert report["time_scales"] == [0.5] and report["instances"][0]["lateness_p99_s"] == 0.0004
    assert describe(report).startswith(" EMULATED qwen3-8b-h100 x0.5 (valid: worst lateness p99 0.40 ms")
    add_emulated_time(report, {"median_ttft_ms": 100.0, "p99_ttft_ms": 200.0, "median_tpot_ms": 20.0,
                               "median_itl_ms": None})
    assert report["emulated_time_ms"] == {"median_ttft_ms": 200.0, "p99_ttft_ms": 400.0, "median_tpot_ms": 40.0}
    assert describe(report).endswith("; emulated time: TTFT p50 200.0 p99 400.0 ms, TPOT p50 40.00 ms")
    add_emulated_time(None, {"median_ttft_ms": 1.0})  # a real run: nothing to add
    served[url] = emulated_page(p99_s=0.0006, step_s=0.010)  # 6% of the step
    report = emulation_report(url)
    assert report is not None and not report["valid"] and "(INVALID:" in describe(report)


def test_behind_a_proxy_every_listed_instance_counts(pages):
    served, serve = pages
    proxy, p, d, gone = serve(), serve(), serve(), serve()
    served.update({proxy: proxy_page([p, d]), p: emulated_page(0.0001, 0.01), d: emulated_page(0.0001, 0.02)})
    report = emulation_report(proxy)
    assert report is not None and report["valid"] and {i["url"] for i in report["instances"]} == {p, d}
    served[d] = emulated_page(0.002, 0.02)  # 10%: the run is not valid
    assert not (emulation_report(proxy) or {})["valid"]
    served.update({proxy: proxy_page([p, d, gone]), d: emulated_page(0.0001, 0.02)})
    report = emulation_report(proxy)  # `gone` answers no /metrics
    assert report is not None and not report["valid"] and report["unreachable"] == [gone]
    assert f"no /metrics from {gone}" in describe(report)
    served.update({proxy: proxy_page([p, d]), d: emulated_page(0.0, 0.0)})  # D served nothing: not late
    assert (emulation_report(proxy) or {})["valid"]
    served.update({p: REAL, d: REAL})
    assert emulation_report(proxy) is None  # real instances (one unreachable): not an emulated run


def test_compare_names_emulated_runs():
    real = {"emulation": None}
    ok = {"emulation": {"profiles": ["qwen3-32b-h200-tp8"], "valid": True}}
    bad = {"emulation": {"profiles": ["qwen3-32b-h200-tp8"], "valid": False}}
    assert emulated([real, real]) == []
    [line] = emulated([real, ok, bad])
    assert line.startswith("**Emulated** (qwen3-32b-h200-tp8; emulated time") and "2 of 3 runs, 1 of them invalid" in line


def test_a_window_not_reset_is_named_in_the_report(pages):
    """reset_windows (before a run) asks the emulated instances only, and returns those that did not answer
    200; the report names them, and its summary says so."""
    served, serve = pages
    proxy, p, d, real = serve(), serve(), serve(), serve()
    served.update({proxy: proxy_page([p, d, real]), p: emulated_page(0.0001, 0.01), d: emulated_page(0.0001, 0.01),
                   real: REAL})
    serve.answers.update({p: (200, '{"reset": true}'), d: (200, '{"reset": true}')})  # `real` would answer 404
    assert reset_windows(proxy) == []
    serve.answers[d] = (404, "")  # an emulated instance from before the endpoint existed
    not_reset = reset_windows(proxy)
    assert not_reset == [d]
    report = emulation_report(proxy, window_not_reset=not_reset)
    assert report is not None and report["window_not_reset"] == [d]
    assert f"window not reset (may span earlier runs) on {d}" in describe(report)
    assert (emulation_report(proxy) or {})["window_not_reset"] == []
