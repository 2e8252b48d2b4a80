"""Replay `--kv-mode auto`'s cost model over the answers of a regime map's auto runs: offline, seconds.

    python benchmarks/replay_auto.py kvpush-results/regime_full15
    python benchmarks/replay_auto.py kvpush-results/regime_full15 --mode auto_old --residual-alpha 0
    python benchmarks/replay_auto.py kvpush-results/regime_full15 --residual-alpha 0 --json replay.json

A way to compare cost-model settings without an hour of grid per setting. Every measured request of
the mode's runs (the regime map's run JSONs, `<mode>-rate*.json`, every cell) is fed to a fresh
CostModel in the order its proxy saw them: decided when the proxy received it, with the inputs its
answer recorded (`kvpush_route`: tokens, prefixes, the prompt tokens queued at P and at D, the
requests waiting at P and decoding on D) and the routes the proxy compared then; learned when its
answer ended, by the route it took, so that the model learns the same samples as the proxy did.
Per cell it reports:
    est err    median |log(measured / estimate)| of the taken route's TTFT: how well the settings
               predict what was measured (the proxy's own estimates in the column "as run")
    picks      the route the replayed model takes (CostModel.choose: its exploring and near ties too),
               against the cell's best fixed mode by TTFT p50 (regime_map.json's auto_vs_best)
    agree      the share of decisions whose pick is that best fixed mode
Counterfactual scores (where the map also ran the fixed modes, and colocated for local, on the same
prompts: every mode of a cell draws the same prompts and arrival times): the TTFT each pick would have
had is what the fixed deployment of that route measured for the same prompt, so a policy's choices are
scored without running it:
    chosen / best   TTFT p50 of the replayed model's picks (with its exploring and near ties,
                    `CostModel.choose`) over the best fixed mode's p50, on the same requests
    as run / best   the same for the routes the run took (auto's own TTFT / best: the column "auto")
    oracle / best   each request's fastest route (what no policy can beat)
With `--learn picked` the model learns from the answer of the route it picked (the fixed deployment's
trace) instead of the route the run took: a closed loop over the map's answers.
What a replay cannot tell: how the picks change the load (a fixed deployment served every request by
one route; auto's D also runs local prefills, its P hooks for some requests only), D's local budget
(--auto-local-share, not replayed), nor the calibration probes and warm-up requests the proxy also
learned from (they are not in the run JSONs), so even the settings of the run do not reproduce its
estimates exactly.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpush.argtypes import non_negative_float, unit_fraction  # noqa: E402
from kvpush.bench.regime import link_dir  # noqa: E402
from kvpush.protocol.trace import Trace  # noqa: E402
from kvpush.proxy.auto.choice import CostModel, Decision, Route  # noqa: E402
from kvpush.proxy.auto.records import Outcome, outcome  # noqa: E402

PAIR = ("p", "d")  # the regime map deploys 1P1D: one pair
ROUTE_MODE = {"push": "push", "push-layerwise": "push-layerwise", "pull": "pull", "local": "colocated"}
Answers = dict[tuple, dict[str, dict]]  # prompt_key -> {mode: its answer to that prompt}
LINK = "replay_link"  # the key read_run adds to a run's config


@dataclass
class CellReplay:
    name: str
    best: str | None
    errors: list[float] = field(default_factory=list)  # |log(measured / replayed estimate)|
    run_errors: list[float] = field(default_factory=list)  # |log(measured / the run's estimate)|
    picks: Counter = field(default_factory=Counter)
    cf: dict[str, list[float]] = field(default_factory=dict)  # chosen / as run / auto / oracle / mode -> TTFTs

    def summary(self) -> dict:
        n = sum(self.picks.values())
        best = self.cf.get(self.best or "")
        ratios = {k: _median(v) / _median(best) for k, v in self.cf.items()  # type: ignore[operator]
                  if best and k in ("chosen", "as run", "auto", "oracle")}
        return {"cell": self.name, "best": self.best, "decisions": n,
                "est_err": _median(self.errors), "est_err_as_run": _median(self.run_errors),
                "picks": dict(self.picks), "agree": self.picks[self.best] / n if n and self.best else None,
                "scored": len(best or ()), "vs_best": ratios}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def cell_key(config: dict) -> tuple[str, int, int, str, float]:
    """(link folder, input, output, prefix, rate) of a run (its config, the link added by load_runs)."""
    prefix = "none" if config.get("dataset") == "random" else str(config.get("dataset"))
    return (str(config.get(LINK, "full")), int(config["input_len"]), int(config["output_len"]), prefix,
            round(float(config["request_rate"]), 4))


def cells_of(result_dir: Path) -> dict[tuple[str, int, int, str, float], tuple[str, str | None]]:
    """cell_key -> (cell name, best fixed mode) from the map's regime_map.json."""
    doc = json.loads((result_dir / "regime_map.json").read_text())
    out = {}
    for c in doc.get("cells", []):
        cell = c["cell"]
        key = (link_dir(cell.get("link", "full")), int(cell["input_len"]), int(cell["output_len"]), cell["prefix"],
               round(float(c["rate"]), 4))
        out[key] = (c["name"], (c.get("auto_vs_best") or {}).get("best"))
    return out


def decision_of(route: dict) -> Decision:
    """The proxy's decision as its answer recorded it (kvpush_route), to be re-estimated."""
    d = Decision(Route(route["route"]), float(route["tokens"]), float(route.get("p_prefix_tokens", 0)),
                 float(route.get("d_prefix_tokens", 0)), float(route.get("p_queue_tokens", 0)),
                 float(route.get("d_queue_tokens", 0)), int(route.get("d_running", 0)), PAIR,
                 int(route.get("p_waiting", 0)))
    d.forced = bool(route.get("forced"))
    return d


def events(runs: list[dict]) -> list[tuple[float, int, dict, dict]]:
    """(time, 0 = decided / 1 = answered, request, run config), in the order the proxy saw them."""
    out = []
    for doc in runs:
        for q in doc.get("requests") or ():
            trace, route = q.get("kvpush_trace"), q.get("kvpush_route")
            if not q.get("success") or not isinstance(trace, dict) or not isinstance(route, dict):
                continue
            received = trace.get("proxy_received")
            if not isinstance(received, (int, float)) or q.get("e2el_s") is None:
                continue
            out.append((float(received), 0, q, doc["config"]))
            out.append((float(q["sent_unix"]) + float(q["e2el_s"]), 1, q, doc["config"]))
    out.sort(key=lambda e: (e[0], e[1]))
    return out


def prompt_key(config: dict, index: int) -> tuple:
    """What identifies one prompt of a map's cell across its modes: lengths, dataset, rate, the run's
    seed (its repeat), and the request's index in the run."""
    return (*cell_key(config), int(config.get("seed", 0)), index)


def load_answers(result_dir: Path) -> Answers:
    """Every answered request of the map's fixed-mode and colocated runs, by prompt_key."""
    out: Answers = {}
    for mode in set(ROUTE_MODE.values()):
        for f in result_dir.glob(f"runs/*/{mode}-rate*.json"):
            doc = read_run(f)
            for q in doc.get("requests") or ():
                if q.get("success") and q.get("ttft_s") is not None:
                    out.setdefault(prompt_key(doc["config"], int(q["index"])), {})[mode] = q
    return out


def answer_outcome(q: dict) -> Outcome:
    """What an answer teaches; a colocated server's has no proxy stamps: its client TTFT stands in."""
    out = outcome(Trace.from_json(q.get("kvpush_trace")), None)
    if out.ttft_s is None:
        out.ttft_s = float(q["ttft_s"])
    return out


def replay(runs: list[dict], cells: dict, model: CostModel, answers: Answers | None = None,
           learn_picked: bool = False) -> list[CellReplay]:
    results: dict[str, CellReplay] = {}
    pending: dict[int, tuple[Decision, Decision]] = {}
    for _, kind, q, config in events(runs):
        name, best = cells.get(cell_key(config), (f"{config[LINK]} {config['input_len']}/{config['output_len']} ?", None))
        cell = results.setdefault(name, CellReplay(name, best))
        route = q["kvpush_route"]
        fixed = (answers or {}).get(prompt_key(config, int(q["index"])), {})
        if kind == 0:
            d = decision_of(route)
            allowed = tuple(Route(r) for r in route.get("estimates_ms", {}) if Route(r) in model.routes) or (d.route,)
            picked = model.choose(copy.copy(d), allowed) if not d.forced else copy.copy(d)
            d.estimates_s, d.queue_s, d.residuals = picked.estimates_s, picked.queue_s, picked.residuals
            d.costs_s = {r: c for r, c in picked.costs_s.items()}
            cell.picks[picked.route.value] += 1
            score(cell, q, d.route, picked.route, fixed)
            pending[id(q)] = (d, picked)
            continue
        d, picked = pending.pop(id(q))
        measured, est = q.get("ttft_s"), d.estimates_s.get(d.route.value)
        as_run = route.get("estimates_ms", {}).get(d.route.value)
        if measured and est and est > 0:
            cell.errors.append(abs(math.log(measured / est)))
        if measured and as_run and as_run > 0:
            cell.run_errors.append(abs(math.log(measured * 1e3 / as_run)))
        if not learn_picked:
            model.observe(d, outcome(Trace.from_json(q["kvpush_trace"]), None))
        elif (a := fixed.get(ROUTE_MODE[picked.route.value])) is not None:
            model.observe(picked, answer_outcome(a))
    return list(results.values())


def score(cell: CellReplay, q: dict, taken: Route, picked: Route, fixed: dict[str, dict]) -> None:
    """The request's TTFT by every fixed mode, by the replayed pick and by the route the run took, on the
    same prompt; only where every mode answered it (else the cell's columns would cover other requests)."""
    if len(fixed) < len(set(ROUTE_MODE.values())):
        return
    ttft = {m: float(a["ttft_s"]) for m, a in fixed.items()}
    for key, value in (("chosen", ttft[ROUTE_MODE[picked.value]]), ("as run", ttft[ROUTE_MODE[taken.value]]),
                       ("auto", float(q["ttft_s"])), ("oracle", min(ttft.values())), *ttft.items()):
        cell.cf.setdefault(key, []).append(value)


def load_runs(result_dir: Path, mode: str) -> list[dict]:
    files = sorted(result_dir.glob(f"runs/*/{mode}-rate*.json"))
    if not files:
        raise SystemExit(f"replay_auto: no runs/*/{mode}-rate*.json under {result_dir}")
    return [read_run(f) for f in files]


def read_run(f: Path) -> dict:
    """A run JSON, its config told the link it ran over (the folder: runs/<link>/)."""
    doc = json.loads(f.read_text())
    doc["config"] = {**doc["config"], LINK: f.parent.name}
    return doc


def table(rows: list[dict]) -> str:
    lines = ["| cell | best fixed | decisions | est err (replay) | est err (as run) | replay's picks | agree "
             "| scored | chosen / best | as run / best | auto / best | oracle / best |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        picks = ", ".join(f"{k} {v}" for k, v in sorted(r["picks"].items(), key=lambda kv: -kv[1]))
        err = "-" if r["est_err"] is None else f"{r['est_err']:.3f}"
        run = "-" if r["est_err_as_run"] is None else f"{r['est_err_as_run']:.3f}"
        agree = "-" if r["agree"] is None else f"{r['agree']:.0%}"
        vs = [f"{r['vs_best'][k]:.3f}" if k in r["vs_best"] else "-" for k in ("chosen", "as run", "auto", "oracle")]
        lines.append(f"| {r['cell']} | {r['best'] or '-'} | {r['decisions']} | {err} | {run} | {picks} | {agree} "
                     f"| {r['scored']} | {' | '.join(vs)} |")
    return "\n".join(lines)


def geomean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result_dirs", type=Path, nargs="+", metavar="result_dir",
                    help="a regime map's --result-dir (its regime_map.json and runs/); several: each replayed "
                         "with a fresh model, the summary over all their cells")
    ap.add_argument("--mode", default="auto", help="whose runs: auto, or an auto variant's file prefix (auto_NAME)")
    ap.add_argument("--stall-weight", type=non_negative_float, default=None)
    ap.add_argument("--residual-alpha", type=unit_fraction, default=None)
    ap.add_argument("--near-tie", type=non_negative_float, default=None)
    ap.add_argument("--switch-margin", type=non_negative_float, default=None)
    ap.add_argument("--learn", choices=("taken", "picked"), default="taken",
                    help="learn from the route the run took (default) or from the fixed deployment's answer "
                         "for the route the replay picked")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    kwargs = {k: v for k, v in (("stall_weight", args.stall_weight), ("residual_alpha", args.residual_alpha),
                                ("near_tie", args.near_tie), ("switch_margin", args.switch_margin)) if v is not None}
    rows = [c.summary() for d in args.result_dirs
            for c in replay(load_runs(d, args.mode), cells_of(d), CostModel(**kwargs), load_answers(d),
                            args.learn == "picked")]
    print(table(rows))
    errs = [r["est_err"] for r in rows if r["est_err"] is not None]
    agree = [r["agree"] for r in rows if r["agree"] is not None]
    print(f"\nmedian over cells: est err {statistics.median(errs):.3f}" if errs else "")
    print(f"cells whose pick is the best fixed mode in most decisions: {sum(a > 0.5 for a in agree)} of {len(agree)}")
    if not any(r["scored"] for r in rows):
        print("no choice scored: counterfactual scores need every fixed mode's and colocated's runs on the same prompts")
    for k in ("chosen", "as run", "auto", "oracle"):
        vs = [r["vs_best"][k] for r in rows if k in r["vs_best"]]
        if vs:
            print(f"{k} / best fixed, TTFT p50 on the same prompts: geometric mean {geomean(vs):.3f} over {len(vs)} "
                  f"cells, worst {max(vs):.3f}, above 1.05 in {sum(v > 1.05 for v in vs)}")
    if args.json:
        args.json.write_text(json.dumps({"settings": kwargs, "cells": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
