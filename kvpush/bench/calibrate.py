"""Before a side-by-side run: no deployment may start on a slow process.

On this machine a server process sometimes runs its decode steps 30% slower than another process
of the same code on the same pinned core, idle, for its whole life (regime_full12: the auto
deployment's D at 5.0 ms a batch-1 step against 3.8 for the pull, push and push-layerwise D's and
the colocated server, probed after the grid; every auto cell's TPOT was worse). Comparing modes
across such processes measures the process, not the mode, so each deployment is probed first:

    PROBE   per deployment, `requests` sequential streamed requests of fresh random prompts through
            its endpoint (auto: route push forced, so that P and D both work): D's step = the median
            gap between tokens, P's prefill = the median of P's admitted -> prefill done stamps; then
            `batch` requests at once: D's batched step = the median gap between tokens there (what a
            loaded run's TPOT rests on; benchmarks/process_speed.py found processes of the same code up
            to 1.11x apart there from start to start, 1.06x alone)
    CHECK   a deployment is slow when its step, batched step (or P's prefill) exceeds `slow_ratio` x
            the median of every deployment's (P: of every disaggregated one; push-layerwise's P is not
            judged, its layer hooks make it slower by design)
    RESTART the slow deployments (stop, start on the same ports) and PROBE again, at most `tries` times
    DONE    every probe is kept (the map's JSON, printed); a deployment still slow after its tries is
            reported and measured as it is, never dropped

The probe is a check of the processes, not a measurement of the modes: its numbers are not compared.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpush.bench.datasets import Sample
from kvpush.bench.loadgen import LoadConfig, run_load_sync
from kvpush.bench.modes import is_auto, parse
from kvpush.errors import KVPushError

if TYPE_CHECKING:
    from kvpush.bench.suite import Fleet


@dataclass(frozen=True)
class CalibrationConfig:
    model: str  # the name the servers answer to (the checkpoint's path)
    requests: int = 3
    prompt_len: int = 256
    output_len: int = 48
    slow_ratio: float = 1.15
    batch: int = 8  # requests at once in the batched probe (0: none)
    tries: int = 2
    timeout_s: float = 60.0
    vocab_size: int = 8192

    @classmethod
    def for_prompts(cls, model: str, prompt_len: int, vocab_size: int) -> CalibrationConfig:
        """The probe of a deployment that serves prompts of `prompt_len` tokens (probes at most 256)."""
        return cls(model, prompt_len=min(cls.prompt_len, prompt_len), vocab_size=vocab_size)


@dataclass
class Probe:
    step_ms: float | None  # D's (or the colocated server's) median inter-token gap
    prefill_ms: float | None  # P's median admitted -> prefill done (disaggregated deployments)
    batch_step_ms: float | None = None  # the median inter-token gap with cfg.batch requests at once


def probe(url: str, route: str | None, cfg: CalibrationConfig, rng: np.random.Generator) -> Probe:
    """cfg.requests sequential streamed requests through the load generator (route: the route an auto proxy
    must take), then cfg.batch at once; raises KVPushError if one fails."""
    records = _load(url, route, cfg, rng, cfg.requests, 1)
    batched = _load(url, route, cfg, rng, cfg.batch, cfg.batch) if cfg.batch > 0 else []
    gaps = [g * 1e3 for r in records for g in r.itl_s]
    batch_gaps = [g * 1e3 for r in batched for g in r.itl_s]
    prefills = []
    for r in records:
        start, done = (r.kvpush_trace or {}).get("p_admitted"), (r.kvpush_trace or {}).get("p_prefill_done")
        if isinstance(start, (int, float)) and isinstance(done, (int, float)):
            prefills.append((done - start) * 1e3)
    return Probe(statistics.median(gaps) if gaps else None, statistics.median(prefills) if prefills else None,
                 statistics.median(batch_gaps) if batch_gaps else None)


def _load(url: str, route: str | None, cfg: CalibrationConfig, rng: np.random.Generator, n: int,
          concurrency: int) -> list:
    """n streamed requests of fresh random prompts (no prefix hit), `concurrency` at a time."""
    samples = [Sample([int(t) for t in rng.integers(3, cfg.vocab_size, cfg.prompt_len)], cfg.prompt_len,
                      cfg.output_len) for _ in range(n)]
    load = LoadConfig(base_url=url, model=cfg.model, max_concurrency=concurrency, ignore_eos=True,
                      timeout_s=cfg.timeout_s, progress=False, kv_route=route)
    records = run_load_sync(samples, load).records
    for r in records:
        if not r.success:
            raise KVPushError(f"process check: a probe of {url} failed: {r.error}")
    return records


def slow(probes: dict[str, Probe], ratio: float) -> dict[str, str]:
    """Deployment -> why it is slow (its step, batched step or P's prefill above ratio x the median of all)."""
    out: dict[str, str] = {}
    steps = {m: p.step_ms for m, p in probes.items() if p.step_ms is not None}
    batch_steps = {m: p.batch_step_ms for m, p in probes.items() if p.batch_step_ms is not None}
    prefills = {m: p.prefill_ms for m, p in probes.items() if p.prefill_ms is not None and m != "push-layerwise"}
    for name, judged in (("step", steps), ("batched step", batch_steps), ("prefill", prefills)):
        if len(judged) < 2:
            continue
        median = statistics.median(judged.values())
        for mode, v in judged.items():
            if v > ratio * median:
                out[mode] = f"{name} {v:.2f} ms > {ratio:g} x median {median:.2f}"
    return out


def calibrate(fleet: Fleet, cfg: CalibrationConfig, seed: int = 0) -> list[dict[str, Any]]:
    """Probe every endpoint of the fleet, restart the slow deployments, probe again (see the module
    docstring). Returns one record per round: {"probes": {mode: {step_ms, prefill_ms}}, "slow": {mode:
    why}, "restarted": [modes]}."""

    rng = np.random.default_rng(seed + 7_777)
    targets = [m for m in fleet.urls if parse(m).own_deployment]
    rounds: list[dict[str, Any]] = []
    for attempt in range(cfg.tries + 1):
        probes = {m: probe(fleet.urls[m], "push" if is_auto(m) else None, cfg, rng) for m in targets}
        found = slow(probes, cfg.slow_ratio)
        restart = list(found) if attempt < cfg.tries else []
        rounds.append({"probes": {m: vars(p) for m, p in probes.items()}, "slow": found, "restarted": restart})
        print("calibration: " + ", ".join(f"{m} step {_ms(p.step_ms)} batched {_ms(p.batch_step_ms)} "
                                          f"prefill {_ms(p.prefill_ms)}"
                                          for m, p in probes.items())
              + (f"; slow: {found}" if found else "; none slow"), flush=True)
        if not restart:
            break
        for mode in restart:
            print(f"calibration: restarting {mode} ({found[mode]})", flush=True)
            restart_endpoint(fleet, mode)
    return rounds


def restart_endpoint(fleet: Fleet, mode: str) -> None:
    """Stop and start a mode's processes on the same ports (its URL stays)."""
    if mode in fleet.deployments:
        fleet.deployments[mode].stop()
        fleet.deployments[mode].start()
    elif mode == "colocated" and fleet.colocated is not None:
        fleet.colocated.stop()
        fleet.colocated.start()
        fleet.colocated.wait_healthy(300)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} ms"
