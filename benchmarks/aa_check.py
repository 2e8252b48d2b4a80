"""How often does one run against one run of the *same* mode come out "beyond the interval"? An A/A
check of the regime map's one-run verdicts, from maps that ran each mode more than once per cell.

    python benchmarks/aa_check.py kvpush-results/mixed_same16 kvpush-results/deploy16a

Per map, cell and mode with two or more runs: disjoint pairs of its runs (1st vs 2nd, 3rd vs 4th,
...), each compared as the map compares two modes from one run each (the TTFT p50, TTFT p99 and
TPOT p50 ratio with its 95% bootstrap interval over the requests, `regime._ratio`). The runs of a
pair are the same mode on the same processes, at the same rate, on other prompts of the same
kind (so the interval is unpaired, if anything wider than the map's paired one between two modes on
the same prompts): any verdict but "cannot tell" is a false positive, which a 95% interval should
give about 5% of the time. What it measures is the run-to-run variance that an interval over one run's requests
leaves out (those requests share one run's queue and batch dynamics).

Maps run with `--twin MODE` (MODE#2: MODE again in every repeat, on the same prompts and processes)
carry the map's own comparison of each twin with its mode: paired by prompt, runs resampled as well as
requests when there are several. Their count ("twins") checks the intervals the map's verdicts use.
`--subsets` recomputes every twin's comparison on each subset of its repeats (k of the R prompt sets
both ran, 1 <= k <= R, each as the map would compare k runs a side): how often a verdict on k runs a
side finds a difference where there is none - the evidence behind `regime.MIN_RUNS` (at most 20
subsets per twin and k, a fixed sample where there are more). Subsets of one twin share runs, so
they are not independent samples: a rate, not a test.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpush.bench.modes import base, is_twin  # noqa: E402
from kvpush.bench.regime import _ratio  # noqa: E402
from kvpush.bench.regime_report import aa_tally, tally_verdict  # noqa: E402
from kvpush.bench.report import _prompt_set  # noqa: E402
from kvpush.bench.stats import p50, p99  # noqa: E402

MAX_SUBSETS = 20  # per twin and k: C(R, k) grows fast with the repeats R
CHECKS = (("ttft_p50", "ttft", p50), ("ttft_p99", "ttft", p99), ("tpot_p50", "tpot", p50))


def runs_by_cell(result_dir: Path) -> dict[tuple, list[dict]]:
    """(link, input, output, dataset, rate, mode) -> that mode's runs there, in the order they ran."""
    out: dict[tuple, list[dict]] = defaultdict(list)
    for f in sorted(result_dir.glob("runs/*/*-rate*.json")):
        doc = json.loads(f.read_text())
        c = doc["config"]
        out[(f.parent.name, c["input_len"], c["output_len"], c["dataset"], round(float(c["request_rate"]), 4),
             c["mode_label"])].append(doc)
    for docs in out.values():
        docs.sort(key=lambda d: float((d.get("run") or {}).get("started_at_unix", 0.0)))
    return out


def check(result_dirs: list[Path]) -> dict[str, dict[str, int]]:
    """Per metric: {"pairs": n, "beyond": k} over every disjoint pair of same-mode runs."""
    out = {name: {"pairs": 0, "beyond": 0} for name, _, _ in CHECKS}
    for d in result_dirs:
        for docs in runs_by_cell(d).values():
            for a, b in zip(docs[0::2], docs[1::2], strict=False):
                for name, metric, stat in CHECKS:
                    r = _ratio([a], [b], metric, stat, "first", "second")
                    if r is None:
                        continue
                    out[name]["pairs"] += 1
                    out[name]["beyond"] += r["verdict"] != "cannot tell"
    return out


def twin_check(result_dirs: list[Path]) -> dict[tuple[str, int], list[int]]:
    """Per (metric, runs a side), [beyond the interval, compared] over the twins' comparisons in the maps'
    regime_map.json (a confirmation pools its screen's runs: give one of the two, not both)."""
    out: dict[tuple[str, int], list[int]] = {}
    for d in result_dirs:
        if (path := d / "regime_map.json").is_file():
            aa_tally(json.loads(path.read_text())["cells"], out)
    return dict(sorted(out.items()))


def subset_check(result_dirs: list[Path]) -> dict[tuple[str, int], list[int]]:
    """Per (metric, k runs a side), [beyond the interval, compared] over every twin and every k-subset of
    the prompt sets it and its mode both ran (the twin's run of a set against the mode's run of it)."""
    out: dict[tuple[str, int], list[int]] = {}
    for d in result_dirs:
        cells = runs_by_cell(d)
        for key, docs in cells.items():
            if not is_twin(key[-1]) or (*key[:-1], base(key[-1])) not in cells:
                continue
            mode_runs = {_prompt_set(r): r for r in cells[(*key[:-1], base(key[-1]))]}
            pairs = [(r, mode_runs[s]) for r in docs if (s := _prompt_set(r)) is not None and s in mode_runs]
            for k in range(1, len(pairs) + 1):
                combos = list(itertools.combinations(pairs, k))
                if len(combos) > MAX_SUBSETS:  # many repeats: a fixed sample of the subsets
                    combos = random.Random(k).sample(combos, MAX_SUBSETS)
                for combo in combos:
                    for name, metric, stat in CHECKS:
                        r = _ratio([a for a, _ in combo], [b for _, b in combo], metric, stat, "twin", "mode")
                        if r is not None:
                            tally_verdict(out, (name, k), r)
    return dict(sorted(out.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result_dirs", type=Path, nargs="+", metavar="result_dir")
    ap.add_argument("--subsets", action="store_true",
                    help="also compare every twin with its mode on each subset of their repeats (k runs a side)")
    args = ap.parse_args(argv)
    missing = [str(d) for d in args.result_dirs if not any(d.glob("runs/*/*-rate*.json"))]
    if missing:
        ap.error(f"no runs/*/*-rate*.json under {', '.join(missing)}")
    counts = check(args.result_dirs)
    for name, c in counts.items():
        share = c["beyond"] / c["pairs"] if c["pairs"] else float("nan")
        print(f"{name}: {c['beyond']} of {c['pairs']} same-mode run pairs beyond the 95% interval ({share:.0%}; "
              f"about 5% expected)")
    twins = twin_check(args.result_dirs)
    if not any(c["pairs"] for c in counts.values()) and not twins:
        print("no cell ran a mode twice: run the map with --repeats 2 or more, or --twin MODE")
    for (name, runs), (k, n) in twins.items():
        print(f"{name}: {k} of {n} twins with {runs} run(s) a side (MODE#2 vs MODE, the map's paired intervals) "
              f"beyond the 95% interval ({k / n:.0%}; about 5% expected)")
    if args.subsets:
        for (name, runs), (k, n) in subset_check(args.result_dirs).items():
            print(f"{name}: {k} of {n} twin comparisons on {runs} run(s) a side (every subset of the repeats) "
                  f"beyond the 95% interval ({k / n:.0%}; about 5% expected)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
