"""Whether a bench run was served by emulated instances, and whether it is valid (issue 37, docs/emulation.md).

Before each run `kvpush bench` asks every emulated instance behind its target to start its lateness window
afresh (POST /emulation/reset_window), and after it reads their /metrics: the target itself, and where the target is a kvpush proxy, the instances it lists
(`kvpush_proxy_instance_served{role,url}`). An emulated instance exports `kvpush_emulated{profile,time_scale}
1` and, over its window (the run's steps, its warm-ups included, at most the last 4,096:
emulate/lateness.py), the lateness
p50/p99 of its steps and their median modelled duration. An instance whose window could not be reset
is listed (`window_not_reset`): its verdict may carry steps of earlier runs. A run is
**valid** when on every emulated instance the lateness p99 is at most VALID_FRACTION of the median step:
the host kept the emulated clock. With one time scale S the report also gives the run's latencies in
emulated time (wall-clock / S). The report goes into the run's JSON (`emulation`, None for a real run)
and its summary line; `kvpush bench compare` names the profile and the verdict in its tables.
Where at least one instance says it is emulated, one that does not answer its /metrics is listed as
unreachable and the run is not valid either (where none answers, nothing says the run was emulated: it
has no report). An instance with no steps in its window (it served nothing) counts as valid.
"""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvpush.config import TransferConfig

VALID_FRACTION = 0.05  # lateness p99 over the median modelled step
GAUGES = {"kvpush_emulated_step_lateness_p50_seconds": "lateness_p50_s",
          "kvpush_emulated_step_lateness_p99_seconds": "lateness_p99_s",
          "kvpush_emulated_step_p50_seconds": "step_p50_s",
          "kvpush_emulated_window_steps": "window_steps"}


def _metrics(url: str, timeout_s: float) -> list[Any] | None:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
            return list(text_string_to_metric_families(r.read().decode()))
    except (OSError, ValueError, urllib.error.URLError, http.client.HTTPException):
        return None


def instance_urls(families: list[Any], role: str | None = None) -> list[str]:
    """The instances a kvpush proxy's /metrics lists (none for an instance's); only those of `role`
    (prefill or decode) where given."""
    return sorted({s.labels["url"] for f in families if f.name == "kvpush_proxy_instance_served"
                   for s in f.samples if "url" in s.labels and role in (None, s.labels.get("role"))})


def emulated_serve_args(profile: str, time_scale: float) -> list[str]:
    """`kvpush serve` flags of an emulated instance: the profile, the time scale, and the transfer times
    (TransferConfig's defaults: the KV deadline and lease, D's quarantine, the ledger's tombstones)
    stretched by the time scale as every modelled time is: a 30 s deadline stands for 30 s of emulated
    time (a queue of 1.8 emulated seconds before P would otherwise outlast it at x20). Flags given after
    these override them."""
    t = TransferConfig()
    stretched = {"--kv-timeout-s": t.kv_timeout_s, "--kv-lease-s": t.kv_lease_s,
                 "--kv-quarantine-s": t.kv_quarantine_s, "--kv-tombstone-s": t.kv_tombstone_s}
    return ["--emulate", profile, "--time-scale", f"{time_scale:g}",
            *(x for flag, s in stretched.items() for x in (flag, f"{s * time_scale:g}"))]


def instance_report(url: str, families: list[Any] | None) -> dict[str, Any] | None:
    """One instance's emulation facts; None for a real instance; {"url", "unreachable": True} when its
    /metrics did not answer."""
    if families is None:
        return {"url": url, "unreachable": True, "valid": False}
    out: dict[str, Any] = {"url": url}
    for f in families:
        for s in f.samples:
            if s.name == "kvpush_emulated" and s.value == 1:
                out.update(profile=s.labels.get("profile"), time_scale=float(s.labels.get("time_scale", "nan")))
            elif s.name in GAUGES:
                out[GAUGES[s.name]] = s.value
    if "profile" not in out:
        return None
    p99, step = out.get("lateness_p99_s"), out.get("step_p50_s")
    idle = step == 0 and p99 == 0  # no steps in the window: nothing could be late
    out["valid"] = idle or (p99 is not None and step is not None and step > 0 and p99 <= VALID_FRACTION * step)
    return out


def _targets(target: str, timeout_s: float) -> list[str]:
    """The instances behind `target`: those a proxy lists, else the target itself."""
    return instance_urls(_metrics(target, timeout_s) or []) or [target]


def reset_windows(target: str, api_key: str | None = None, timeout_s: float = 10.0) -> list[str]:
    """Before a run: every emulated instance behind `target` (its /metrics says `kvpush_emulated`; a real
    one is not asked) starts its lateness window afresh. Returns the emulated instances that did not answer
    200."""
    failed = []
    for url in _targets(target, timeout_s):
        if instance_report(url, _metrics(url, timeout_s) or []) is None:
            continue  # real, or no /metrics (the report after the run says so)
        req = urllib.request.Request(url.rstrip("/") + "/emulation/reset_window", data=b"", method="POST",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s):
                pass
        except (OSError, http.client.HTTPException):  # HTTPError (a status other than 2xx) is an OSError
            failed.append(url)
    return failed


def emulation_report(target: str, timeout_s: float = 10.0, window_not_reset: list[str] | None = None
                     ) -> dict[str, Any] | None:
    """The run's emulation report (module docstring); None where no instance behind `target` is emulated."""
    families = _metrics(target, timeout_s)
    urls = instance_urls(families or [])
    reports = [instance_report(target, families)] if not urls else \
        [instance_report(u, _metrics(u, timeout_s)) for u in urls]
    emulated = [r for r in reports if r is not None and not r.get("unreachable")]
    if not emulated:
        return None
    unreachable = [r["url"] for r in reports if r is not None and r.get("unreachable")]
    profiles = sorted({str(r["profile"]) for r in emulated})
    return {"profiles": profiles, "time_scales": sorted({r["time_scale"] for r in emulated}),
            "rule": f"every instance's lateness p99 <= {VALID_FRACTION:.0%} of its median modelled step",
            "valid": not unreachable and all(r["valid"] for r in emulated),
            "instances": emulated, "unreachable": unreachable,
            "window_not_reset": sorted({*(window_not_reset or [])} & {str(r["url"]) for r in emulated})}


EMULATED_TIME = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "median_e2el_ms")


def add_emulated_time(report: dict[str, Any] | None, metrics: dict[str, Any]) -> None:
    """With one time scale S: the run's latencies in emulated time (wall-clock / S) into the report. The
    host's own costs (HTTP, Python, the pipes between processes) are real time: divided by S here, they
    count S times less than they would on the emulated hardware (docs/emulation.md)."""
    if report is None or len(report["time_scales"]) != 1:
        return
    s = report["time_scales"][0]
    report["emulated_time_ms"] = {k: metrics[k] / s for k in EMULATED_TIME if metrics.get(k) is not None}


def describe(report: dict[str, Any] | None) -> str:
    """A summary line's tail: '' for a real run, else the profile(s) and the verdict."""
    if report is None:
        return ""
    worst = max(report["instances"], key=lambda r: (r.get("lateness_p99_s") or 0) / max(r.get("step_p50_s") or 1e-12,
                                                                                          1e-12))
    verdict = "valid" if report["valid"] else "INVALID"
    detail = (f"worst lateness p99 {1e3 * (worst.get('lateness_p99_s') or 0):.2f} ms against a median step of "
              f"{1e3 * (worst.get('step_p50_s') or 0):.2f} ms")
    if report["unreachable"]:
        detail += f"; no /metrics from {', '.join(report['unreachable'])}"
    if report.get("window_not_reset"):
        detail += f"; window not reset (may span earlier runs) on {', '.join(report['window_not_reset'])}"
    scales = ", ".join(f"x{s:g}" for s in report["time_scales"])
    times = report.get("emulated_time_ms") or {}
    emulated = "" if "median_ttft_ms" not in times else (
        f"; emulated time: TTFT p50 {times['median_ttft_ms']:.1f} p99 {times.get('p99_ttft_ms', 0):.1f} ms, "
        f"TPOT p50 {times.get('median_tpot_ms', 0):.2f} ms")
    return f" EMULATED {', '.join(report['profiles'])} {scales} ({verdict}: {detail}){emulated}"
