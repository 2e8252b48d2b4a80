"""What start-up calibrations share (engine/linear_choice.py, engine/attention_choice.py).

A calibration times two implementations of one op on this machine, alternating (`alternate`), and caches
its choice in a JSON file per key (the CPU model, torch's version, the shapes timed, ...; `cache_path`,
`write_entry`, `read_json`), measuring under a file lock (`locked`), so that instances starting together
(kvpush up) measure once and the others read the first one's file. Both calibrations keep their files in
config.linear_cache_dir() (`linear-*.json`, `decode-attention-*.json`).
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

MIN_ROUNDS, MAX_ROUNDS = 3, 9  # alternating rounds per workload (both implementations each round)
BUDGET_S = 1.5  # per workload: rounds stop here once MIN_ROUNDS ran
SAMPLE_S = 0.01  # one timed sample repeats the call until it lasts about this long


def cpu_identity(cpu: dict[str, Any]) -> dict[str, Any]:
    """The facts of bench/machine.py's cpu() that name a CPU model."""
    return {k: cpu.get(k) for k in ("model", "vendor", "family", "model_number", "stepping", "arch", "vector_flags")}


def cache_path(cache_dir: str, prefix: str, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"{prefix}-{digest}.json"


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) else None


def write_entry(path: Path, entry: dict[str, Any]) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        json.dump(entry, f, indent=1, sort_keys=True)
    os.replace(f.name, path)  # atomic: engines starting at once each install a whole file


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Held while one process measures for `path`: the others wait, then read its file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def entries(cache_dir: str, prefix: str, here: dict[str, Any]) -> list[dict[str, Any]]:
    """Cached entries under `prefix` whose key holds `here` (e.g. this CPU model and torch), newest first."""
    found = [e for p in sorted(Path(cache_dir).glob(f"{prefix}-*.json")) if (e := read_json(p)) is not None]
    found = [e for e in found if all(e.get("key", {}).get(k) == v for k, v in here.items())]
    return sorted(found, key=lambda e: e.get("measured_at", ""), reverse=True)


def ratio(timings: dict[str, tuple[float, float]]) -> float:
    """Geometric mean over the workloads of the second implementation's time over the first's."""
    return math.exp(statistics.fmean(math.log(b / a) for a, b in timings.values()))


def measured_line(source: str, seconds: float, when: str, path: str | None, timings: dict[str, tuple[float, float]],
                  names: tuple[str, str], digits: int) -> str:
    """The part of a start-up log line after the choice, for a measured or cached one: how, where, the
    timings (ms, `names` first / second) and the ratio."""
    a, b = names
    how = f"measured in {seconds:.1f} s" if source == "measured" else f"cached from {when}"
    times = ", ".join(f"{w} {x:.{digits}f} / {y:.{digits}f}" for w, (x, y) in timings.items())
    return f"({how}, {path}); ms {a} / {b}: {times}; {b} / {a} {ratio(timings):.2f}"


def alternate(a: Callable[[], object], b: Callable[[], object]) -> tuple[float, float]:
    """Median ms of one call of a and of b, timed in alternating rounds."""
    reps = []
    for fn in (a, b):  # warm: first touch of every buffer, a library's primitive for this shape
        t = time.perf_counter()
        fn()
        reps.append(max(1, round(SAMPLE_S / max(time.perf_counter() - t, 1e-6))))
    n = min(reps)
    times: tuple[list[float], list[float]] = ([], [])
    start = time.perf_counter()
    for r in range(MAX_ROUNDS):
        if r >= MIN_ROUNDS and time.perf_counter() - start > BUDGET_S:
            break
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            fn = (a, b)[i]
            t = time.perf_counter()
            for _ in range(n):
                fn()
            times[i].append((time.perf_counter() - t) * 1e3 / n)
    return statistics.median(times[0]), statistics.median(times[1])
