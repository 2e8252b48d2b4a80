"""Start-up of `kvpush serve`: seconds from launch until /health answers, cold, calibrating and cached.

    python benchmarks/startup.py [--repeats 3] [--model DIR] [--compile auto] [--out DIR]

Three states of kvpush's caches (all under $XDG_CACHE_HOME/kvpush: inductor's graphs and kernels, the
C kernels, the linear backend's and the decode and prefill attention's choices, engine/linear_choice.py
and engine/attention_choice.py):
- `cold`: a fresh, empty cache directory and a fresh temporary directory ($TMPDIR: inductor keeps
  some of its build products there, outside the cache) each start (a new machine, or the first start
  after an upgrade): inductor compiles, the C kernels build, the linear backend and both attention paths
  are calibrated;
- `calibrate`: everything cached but the three choices (removed before each start);
- `cached`: everything cached (every later start).
Each repeat starts the server once per state, the order rotating between repeats, one core
(`taskset -c 0`), one torch thread; the warm states share one directory, filled by an unmeasured start
first. Prints per state the median, the range and issue 39's target (cold and calibrating under 30 s,
cached under 15 s). JSON in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from kvpush.argtypes import positive_int
from kvpush.bench.demo import ensure_model
from kvpush.bench.machine import facts, machine_line
from kvpush.config import default_model_dir
from kvpush.launcher.launch import ServerProcess, free_port

STATES = ("cold", "calibrate", "cached")
TARGET_S = {"cold": 30.0, "calibrate": 30.0, "cached": 15.0}  # issue 39
TIMEOUT_S = 300.0


def start_once(model: str, compile_mode: str, cache_home: str, log_path: str) -> float:
    """Seconds from launching `kvpush serve` until /health answers; the server is stopped after. Its
    temporary directory is `tmp` in `cache_home`."""
    tmp = os.path.join(cache_home, "tmp")
    os.makedirs(tmp, exist_ok=True)
    env = {"XDG_CACHE_HOME": cache_home, "TMPDIR": tmp}
    argv = ["serve", model, "--port", str(free_port()), "--torch-threads", "1", "--compile", compile_mode]
    server = ServerProcess(argv, env=env, log_path=log_path, prefix=["taskset", "-c", "0"])
    server.env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # inductor's cache follows XDG_CACHE_HOME
    t0 = time.monotonic()
    server.start()
    try:
        server.wait_healthy(TIMEOUT_S)
        return time.monotonic() - t0
    finally:
        server.stop()


def prepare(state: str, warm_home: str, scratch: Path, rep: int) -> str:
    """The XDG_CACHE_HOME a start in `state` uses."""
    if state == "cold":
        home = scratch / f"cold-{rep}"
        home.mkdir()
        return str(home)
    if state == "calibrate":
        shutil.rmtree(Path(warm_home) / "kvpush" / "linear", ignore_errors=True)
    return warm_home


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=positive_int, default=3, help="starts per state (default: 3)")
    ap.add_argument("--model", default=None, help="checkpoint (default: the bench preset, made if missing)")
    ap.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                    help="kvpush serve --compile (default: auto)")
    ap.add_argument("--out", default="bench-results/startup", help="JSON and server logs (default: %(default)s)")
    args = ap.parse_args()
    model = args.model or ensure_model(default_model_dir(), "bench")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, list[float]] = {s: [] for s in STATES}
    with tempfile.TemporaryDirectory(prefix="kvpush-startup-") as scratch:
        warm_home = os.path.join(scratch, "warm")
        start_once(model, args.compile, warm_home, str(out / "fill.log"))  # fills the warm caches
        for rep in range(args.repeats):
            for i in range(len(STATES)):
                state = STATES[(i + rep) % len(STATES)]
                home = prepare(state, warm_home, Path(scratch), rep)
                seconds[state].append(start_once(model, args.compile, home, str(out / f"{state}-{rep}.log")))
                print(f"repeat {rep + 1}: {state} {seconds[state][-1]:.1f} s", flush=True)
    print(f"\n{machine_line()}")
    print(f"`kvpush serve {model} --compile {args.compile} --torch-threads 1` on one core, {args.repeats} starts "
          "per state, order rotating\n")
    print("| state | median s | range s | target | verdict |")
    print("|---|---|---|---|---|")
    for state in STATES:
        xs = seconds[state]
        met = "met" if max(xs) < TARGET_S[state] else "not met"
        print(f"| {state} | {statistics.median(xs):.1f} | {min(xs):.1f}-{max(xs):.1f} | < {TARGET_S[state]:.0f} s | "
              f"{met} (every start) |")
    (out / "startup.json").write_text(json.dumps({"seconds": seconds, "compile": args.compile, "model": model,
                                                  "environment": {"machine": facts()}}, indent=1))


if __name__ == "__main__":
    main()
