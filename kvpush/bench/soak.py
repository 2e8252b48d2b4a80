"""The soak: long steady load through disaggregated deployments, with every resource sampled over time.

    STARTING (one 1P1D deployment per mode, all up together) -> LOAD (per deployment: Poisson arrivals
       of a mixed workload - short and long prompts and multi-turn sessions - streamed, a share of the
       clients disconnecting after their first chunk; the arrival schedule repeats every `period_s`, see
       below) while SAMPLING every `sample_s` (per instance:
       RSS, open fds and threads of its process tree, free KV blocks, ledger records, quarantined
       blocks, handshakes; per deployment: TTFT of the requests answered since the last sample)
    -> DRAINED (load stopped; wait until every block is free and no transfer is live)
    -> SUMMARY (growth and flatness figures, the end state) -> STOPPED (also on error or Ctrl-C)

The load is periodic so that the server, not the dice, is what drifts: one period's schedule (Poisson
gaps, the kind and length of each prompt, which clients disconnect) is drawn once and replayed every
period, with fresh token contents each time (no prefix-cache hit across periods). At 70% of capacity
the queueing delay swings with the load of the last seconds, so two windows of independent Poisson
arrivals can differ by tens of percent in TTFT with nothing wrong; request j of period k meets the same
offered load as request j of every other period. The summary pairs them (late period against the
second one) and gives the median ratio with a bootstrap interval.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvpush.bench.datasets import Sample, mixed_samples
from kvpush.bench.machine import facts
from kvpush.bench.stats import ratio_ci
from kvpush.bench.suite import Fleet, SuiteConfig, process_tree

LIVE_STATES = ("prefilled", "registered", "matched", "posted")


@dataclass
class SoakConfig:
    model: str
    modes: tuple[str, ...] = ("push", "pull")
    duration_s: float = 1800.0
    rate: float = 1.0  # requests/s per deployment
    input_len: int = 256
    output_len: int = 32
    disconnect_share: float = 0.01
    period_s: float | None = None  # the schedule repeats every period; None: a sixth of the run
    sample_s: float = 5.0
    settle_s: float = 16.0  # after the drain; the proxy's client closes idle kept-alive connections after 15 s
    seed: int = 0
    pin: bool = True
    result_dir: str = "kvpush-results/soak"
    serve_args: list[str] = field(default_factory=lambda: ["--torch-threads", "1"])
    vocab_size: int = 1000


def process_figures(pid: int) -> dict[str, float]:
    """RSS (MiB), open fds and threads summed over a process and its descendants."""
    rss_kib = fds = threads = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss_kib += int(line.split()[1])
                    elif line.startswith("Threads:"):
                        threads += int(line.split()[1])
            fds += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:
            continue
    return {"rss_mib": rss_kib / 1024, "fds": fds, "threads": threads}


def instance_figures(url: str) -> dict[str, float]:
    """Free and used blocks, ledger records (live and all), quarantined blocks and handshakes."""
    out = {"blocks_free": 0.0, "blocks_used": 0.0, "ledger_live": 0.0, "ledger_records": 0.0, "quarantined": 0.0, "handshakes": 0.0}
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("#") or " " not in line:
                continue
            name, value = line.rsplit(" ", 1)
            v = float(value)
            if name == "kvpush_kv_blocks_free":
                out["blocks_free"] = v
            elif name == "kvpush_kv_blocks_used":
                out["blocks_used"] = v
            elif name.startswith("kvpush_kv_transfers{"):
                out["ledger_records"] += v
                out["ledger_live"] += v if name.split('state="', 1)[1].split('"', 1)[0] in LIVE_STATES else 0
            elif name == "kvpush_kv_quarantined_blocks":
                out["quarantined"] = v
            elif name == "kvpush_kv_handshakes_total":
                out["handshakes"] = v
    return out


@dataclass
class Outcomes:
    ttfts: list[tuple[float, float]] = field(default_factory=list)  # (answered at, TTFT s)
    by_slot: dict[tuple[int, int], float] = field(default_factory=dict)  # (period, position) -> TTFT s
    ok: int = 0
    disconnected: int = 0
    errors: list[str] = field(default_factory=list)


async def one(session: aiohttp.ClientSession, url: str, sample: Sample, disconnect: bool, out: Outcomes,
              slot: tuple[int, int]) -> None:
    body = {"prompt": sample.prompt, "max_tokens": sample.output_len, "temperature": 0, "ignore_eos": True,
            "stream": True}
    sent = time.monotonic()
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                out.errors.append(f"HTTP {r.status}: {(await r.read())[:200]!r}")
                return
            first = True
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                if "error" in json.loads(line[6:]):  # an error event (not a token whose text is "error")
                    out.errors.append(line[:200])
                    return
                if first:
                    out.ttfts.append((time.time(), time.monotonic() - sent))
                    out.by_slot[slot] = out.ttfts[-1][1]
                    first = False
                    if disconnect:
                        out.disconnected += 1
                        return  # leaving the context drops the connection mid-stream
            out.ok += 1
    except (TimeoutError, aiohttp.ClientError) as e:
        out.errors.append(repr(e))


def period_plan(rate: float, period_s: float, disconnect_share: float, seed: int) -> list[tuple[float, bool]]:
    """One period's arrivals: (offset from the period's start in s, whether that client disconnects)."""
    rng = random.Random(seed)
    plan, t = [], rng.expovariate(rate)
    while t < period_s:
        plan.append((t, rng.random() < disconnect_share))
        t += rng.expovariate(rate)
    return plan


def period_samples(cfg: SoakConfig, n: int, period: int) -> list[Sample]:
    """The prompts of one period: the same kinds and lengths at each position in every period (lengths
    depend only on the position), fresh token contents per period."""
    return mixed_samples(max(n, 3), cfg.input_len, cfg.output_len, vocab_size=cfg.vocab_size, avoid_ids=(0, 1, 2),
                         seed=cfg.seed * 1000 + 3 * period)


async def drive(url: str, plan: list[tuple[float, bool]], prompts: list[list[Sample]], period_s: float,
                until: float, out: Outcomes) -> None:
    """Replay `plan` every period (period k sends prompts[k]) until `until` (monotonic)."""
    tasks: set[asyncio.Task] = set()
    timeout = aiohttp.ClientTimeout(total=300)
    start = time.monotonic()
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        for k, samples in enumerate(prompts):
            for j, (offset, disconnect) in enumerate(plan):
                at = start + k * period_s + offset
                if at >= until:
                    break
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                t = asyncio.create_task(one(session, url, samples[j], disconnect, out, (k, j)))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks)


def sample_all(fleet: Fleet, start: float, outcomes: dict[str, Outcomes], since: float) -> dict[str, Any]:
    row: dict[str, Any] = {"t": time.time() - start, "instances": {}, "ttft_p50_ms": {}}
    for name, proc in fleet.instances().items():
        if proc.proc is None:
            continue
        row["instances"][name] = {**process_figures(proc.proc.pid), **instance_figures(proc.url)}
    for mode, out in outcomes.items():
        recent = [t for when, t in out.ttfts if when >= since]
        row["ttft_p50_ms"][mode] = _p50_ms(recent)
    return row


async def run_load(cfg: SoakConfig, fleet: Fleet, rows: list[dict], outcomes: dict[str, Outcomes]) -> None:
    period = cfg.period_s or cfg.duration_s / 6
    plans = [period_plan(cfg.rate, period, cfg.disconnect_share, cfg.seed + k) for k in range(len(cfg.modes))]
    n = max(len(p) for p in plans)
    prompts = [period_samples(cfg, n, k) for k in range(math.ceil(cfg.duration_s / period))]
    start, until = time.time(), time.monotonic() + cfg.duration_s
    drivers = [asyncio.create_task(drive(fleet.urls[m], plans[k], prompts, period, until, outcomes[m]))
               for k, m in enumerate(cfg.modes)]
    last = time.time()
    while not all(d.done() for d in drivers):
        await asyncio.sleep(cfg.sample_s)
        rows.append(await asyncio.to_thread(sample_all, fleet, start, outcomes, last))
        last = time.time()
    for d in drivers:
        d.result()


def drained(fleet: Fleet, timeout_s: float = 60.0) -> dict[str, dict[str, float]]:
    """Wait until no transfer is live, no block quarantined or used anywhere; the end state per instance."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = {n: instance_figures(p.url) for n, p in fleet.instances().items() if n != "colocated"}
        if all(s["ledger_live"] == 0 and s["quarantined"] == 0 and s["blocks_used"] == 0 for s in state.values()) \
                or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def _p50_ms(values: list[float]) -> float | None:
    return statistics.median(values) * 1e3 if values else None


def paired_drift(by_slot: dict[tuple[int, int], float], periods: int) -> dict[str, Any]:
    """TTFT of the last period against the second over the requests answered in both (same arrival offset,
    same prompt length): both p50s and their ratio with a 95% bootstrap interval, resampled in pairs."""
    late = periods - 1
    pairs = [(t, by_slot[(late, j)]) for (k, j), t in by_slot.items() if k == 1 and (late, j) in by_slot]
    if late < 2:  # the second period is the last (or there is none): nothing to compare
        return {"paired": 0}
    if len(pairs) < 2:
        return {"paired": len(pairs)}
    early_s, late_s = [a for a, _ in pairs], [b for _, b in pairs]
    ratio, low, high = ratio_ci(late_s, early_s, paired=True)
    return {"paired": len(pairs), "paired_early_p50_ms": _p50_ms(early_s),
            "paired_late_p50_ms": _p50_ms(late_s), "paired_ratio": ratio,
            "paired_ratio_ci95": (low, high)}


def summarize(rows: list[dict], end: dict[str, dict[str, float]], outcomes: dict[str, Outcomes],
              duration_s: float, periods: int = 6) -> dict[str, Any]:
    """Per instance: RSS growth from 1/6 of the run to its end, fd and thread ranges after warm-up;
    per mode: TTFT p50 of the last sixth against the second sixth, and of the last period against the
    second request by request; the end state."""
    warm = [r for r in rows if r["t"] >= duration_s / 6] or rows
    per: dict[str, Any] = {}
    for name in rows[-1]["instances"] if rows else []:
        series = [r["instances"][name] for r in warm if name in r["instances"]]
        rss = [s["rss_mib"] for s in series]
        per[name] = {"rss_first_mib": rss[0], "rss_last_mib": rss[-1], "rss_growth": rss[-1] / rss[0] - 1,
                     "fds_min_max": (min(s["fds"] for s in series), max(s["fds"] for s in series)),
                     "threads_min_max": (min(s["threads"] for s in series), max(s["threads"] for s in series))}
    ttft: dict[str, Any] = {}
    for mode, out in outcomes.items():
        if not out.ttfts:
            continue
        t0 = out.ttfts[0][0]
        early = [t for when, t in out.ttfts if duration_s / 6 <= when - t0 < duration_s / 3]
        late = [t for when, t in out.ttfts if when - t0 >= duration_s * 5 / 6]
        ttft[mode] = {"early_p50_ms": _p50_ms(early), "late_p50_ms": _p50_ms(late),
                      **paired_drift(out.by_slot, periods),
                      "period_p50_ms": [_p50_ms([t for (k, _), t in out.by_slot.items() if k == i])
                                        for i in range(periods)],
                      "ok": out.ok, "disconnected": out.disconnected, "errors": len(out.errors),
                      "first_errors": out.errors[:5]}
    return {"instances": per, "ttft": ttft, "end": end,
            "ledgers_empty": all(s["ledger_live"] == 0 for s in end.values()),
            "blocks_all_free": all(s["blocks_used"] == 0 and s["quarantined"] == 0 for s in end.values())}


def run_soak(cfg: SoakConfig) -> Path:
    Path(cfg.result_dir).mkdir(parents=True, exist_ok=True)
    log_dir = os.path.join(cfg.result_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    suite = SuiteConfig(model=cfg.model, modes=cfg.modes, serve_args=cfg.serve_args, pin=cfg.pin,
                        result_dir=cfg.result_dir)
    fleet = Fleet(suite, log_dir).start()
    rows: list[dict] = []
    outcomes = {m: Outcomes() for m in cfg.modes}
    path = Path(cfg.result_dir) / "soak.json"
    try:
        before = _processes(fleet)
        asyncio.run(run_load(cfg, fleet, rows, outcomes))
        end = drained(fleet)
        time.sleep(cfg.settle_s)  # idle kept-alive connections close before the idle sample
        after = _processes(fleet)
    finally:
        fleet.stop()
    periods = math.ceil(cfg.duration_s / (cfg.period_s or cfg.duration_s / 6))
    summary = summarize(rows, end, outcomes, cfg.duration_s, periods)
    summary["idle_before"], summary["idle_after"] = before, after
    path.write_text(json.dumps({"config": asdict(cfg), "machine": facts(), "summary": summary, "rows": rows}, indent=1))
    return path



def _processes(fleet: Fleet) -> dict[str, dict[str, float]]:
    """Every instance's process figures while idle (before the load, after the drain)."""
    return {n: process_figures(p.proc.pid) for n, p in fleet.instances().items() if p.proc is not None}


def plot(path: Path) -> Path | None:
    """Resources and TTFT over time, one panel each."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    panels = (("rss_mib", "RSS (MiB)"), ("fds", "open fds"), ("threads", "threads"), ("blocks_free", "free KV blocks"),
              ("ledger_records", "ledger records"))
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(4 * (len(panels) + 1), 3.2))
    t = [r["t"] / 60 for r in rows]
    names = sorted({n for r in rows for n in r["instances"]})
    for ax, (key, title) in zip(axes, panels, strict=False):
        for n in names:
            ax.plot(t, [r["instances"].get(n, {}).get(key) for r in rows], label=n)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("minutes", fontsize=8)
    axes[0].legend(fontsize=6)
    for mode in doc["config"]["modes"]:
        axes[-1].plot(t, [r["ttft_p50_ms"].get(mode) for r in rows], label=mode)
    axes[-1].set_title("TTFT p50 per sample (ms)", fontsize=9)
    axes[-1].legend(fontsize=6)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
