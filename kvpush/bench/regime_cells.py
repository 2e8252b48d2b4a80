"""A regime-map cell's runs beyond a plain `kvpush bench` run: prompts D already holds (prefixes "held"
and "held-both"), and the emulation facts of a cell whose instances were emulated (issue 37)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from kvpush.bench import cli as bench_cli
from kvpush.bench.modes import parse
from kvpush.bench.suite import Fleet, reset_prefix_caches


def hold_on_decode(fleet: Fleet, mode: str, args: argparse.Namespace, rate: float, model: str,
                   keep_on_prefill: bool = False) -> None:
    """Prefixes "held" and "held-both": the run's prompts served once first (a run of its own, not
    reported), so that the measured run finds every prompt on D (a colocated server: on itself). "held"
    then resets P's prefix cache (D holds the prompts, P none: pull waits for P's whole prefill);
    "held-both" keeps it (repeated prompts, vLLM PR #35264's 100% prefix hit: P's leg is short, pull
    still waits for it and the proxy's round trip)."""
    warm = argparse.Namespace(**{**vars(args), "result_dir": os.path.join(args.result_dir, "held-warm"),
                                 "mode_label": f"{args.mode_label}-warm"})
    bench_cli._one_run(warm, 0, rate, model)
    deployment = None if keep_on_prefill else fleet.deployments.get(parse(mode).deployment)
    for inst in deployment.of_role("prefill") if deployment is not None else ():
        reset_prefix_caches(inst.url)


def emulation_summary(runs: dict[str, list[dict]]) -> dict[str, Any] | None:
    """Where the cell's runs were emulated (bench/emulation.py's report in each): the profiles, the one
    time scale, how many runs were valid, and the worst instance's lateness p99 / median step. None for
    real runs. Raises ValueError for runs of several time scales (their times could not be pooled)."""
    reports = [d["emulation"] for docs in runs.values() for d in docs if d.get("emulation")]
    if not reports:
        return None
    scales = {s for r in reports for s in r["time_scales"]}
    if len(scales) != 1:
        raise ValueError(f"the cell's runs were emulated at several time scales: {sorted(scales)}")
    worst = max(((i.get("lateness_p99_s") or 0.0) / i["step_p50_s"] for r in reports for i in r["instances"]
                 if i.get("step_p50_s")), default=0.0)
    return {"profiles": sorted({p for r in reports for p in r["profiles"]}), "time_scale": scales.pop(),
            "runs": sum(len(docs) for docs in runs.values()), "valid_runs": sum(bool(r["valid"]) for r in reports),
            "worst_lateness_p99_of_step": worst}
