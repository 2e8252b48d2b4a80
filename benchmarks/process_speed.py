"""How much do processes of the same code differ in speed? The side-by-side benchmarks compare
deployments, so a deployment that happens to run on a slow process looks like a slow mode.

    python benchmarks/process_speed.py                          # push, pull and auto, 3 starts each
    python benchmarks/process_speed.py --modes push auto --starts 4 --rounds 3 --batch 8

Per start (every deployment stopped and started again on the same pinned cores), `--rounds` probes of
each deployment (kvpush/bench/calibrate.py's probe: a few sequential requests, then `--batch` at once;
auto forced to push): D's median step alone and batched, P's prefill. Reported per deployment and
start: the medians over its rounds; then, per measure, how far the deployments of one start spread
(max / min) and how far one deployment moves from start to start. A spread between deployments that
stays within a start but changes from start to start is the process, not the mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpush.bench.calibrate import CalibrationConfig, probe  # noqa: E402
from kvpush.bench.demo import ensure_model  # noqa: E402
from kvpush.bench.machine import facts  # noqa: E402
from kvpush.bench.modes import is_auto  # noqa: E402
from kvpush.bench.suite import Fleet, SuiteConfig  # noqa: E402
from kvpush.config import default_model_dir  # noqa: E402

MEASURES = ("step_ms", "batch_step_ms", "prefill_ms")


def measure(fleet: Fleet, cfg: CalibrationConfig, rounds: int, seed: int) -> dict[str, dict[str, float | None]]:
    """Per deployment, the median over `rounds` probes of each measure."""
    rng = np.random.default_rng(seed)
    got: dict[str, dict[str, list[float]]] = {m: {k: [] for k in MEASURES} for m in fleet.urls}
    for _ in range(rounds):
        for mode, url in fleet.urls.items():
            p = probe(url, "push" if is_auto(mode) else None, cfg, rng)
            for k in MEASURES:
                if (v := getattr(p, k)) is not None:
                    got[mode][k].append(v)
    return {m: {k: statistics.median(v) if v else None for k, v in ks.items()} for m, ks in got.items()}


def spread(values: list[float]) -> float | None:
    return max(values) / min(values) if len(values) > 1 and min(values) > 0 else None


def report(starts: list[dict[str, dict[str, float | None]]]) -> str:
    modes = list(starts[0])
    lines = ["| start | deployment | step alone (ms) | step batched (ms) | P prefill (ms) |", "|---|---|---|---|---|"]
    for i, s in enumerate(starts):
        for m in modes:
            cells = [f"{v:.2f}" if (v := s[m][k]) is not None else "-" for k in MEASURES]
            lines.append(f"| {i} | {m} | " + " | ".join(cells) + " |")
    lines.append("")
    for k in MEASURES:
        within = [x for s in starts if (x := spread([v for m in modes if (v := s[m][k]) is not None]))]
        across = [x for m in modes if (x := spread([v for s in starts if (v := s[m][k]) is not None]))]
        if within:
            lines.append(f"- {k}: between deployments of one start, max/min {', '.join(f'{x:.2f}' for x in within)}; "
                         f"one deployment from start to start {', '.join(f'{x:.2f}' for x in across)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the bench preset, made if missing)")
    ap.add_argument("--modes", nargs="+", default=["push", "pull", "auto"])
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.starts < 1 or args.rounds < 1 or args.batch < 0:
        ap.error("--starts and --rounds must be >= 1, --batch >= 0")
    model = args.model or ensure_model(default_model_dir(), "bench")
    cfg = CalibrationConfig(model, prompt_len=args.prompt_len, batch=args.batch)
    starts = []
    with tempfile.TemporaryDirectory() as logs:
        for i in range(args.starts):
            fleet = Fleet(SuiteConfig(model=model, modes=tuple(args.modes), serve_args=["--torch-threads", "1"], pin=True),
                          logs).start()
            try:
                starts.append(measure(fleet, cfg, args.rounds, seed=i))
            finally:
                fleet.stop()
            print(f"start {i}: " + json.dumps(starts[-1]), flush=True)
    print(report(starts))
    if args.json:
        args.json.write_text(json.dumps({"machine": facts(), "modes": args.modes, "batch": args.batch, "starts": starts}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
