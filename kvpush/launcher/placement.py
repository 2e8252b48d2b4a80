"""CPU placement: which cores an instance's processes and threads may run on.

`kvpush serve --cpus LIST` restricts the API process, its engine-core process and every thread of
both (aiohttp, the core reader, the KV transfer thread, torch's intra-op threads) to LIST; with
`--cpus` and no `--torch-threads`, torch gets one thread per listed core. `kvpush up --pin` splits
the cores this process may use into two halves: prefill instances share the first, decode
instances the second; the proxy stays unpinned.

What it emulates: P and D not competing for the same core, as they would not on separate hosts or
GPUs, so background work of one (D's registration and polling during P's prefill) cannot steal P's
core. What it does not: separate caches, memory bandwidth or NICs (the instances still share the
L3, the memory bus and loopback/shared-memory transport), nor isolation from processes outside
the deployment (the proxy, the load generator, anything else on the machine) - those run wherever
the kernel puts them, also on pinned cores.
"""

from __future__ import annotations

import os

from kvpush.errors import KVPushError


class PlacementError(KVPushError):
    """A CPU list that cannot be applied on this machine."""


def available_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on, ascending."""
    return tuple(sorted(os.sched_getaffinity(0)))


def parse_cpus(text: str, allowed: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """``"0-3,6"`` -> (0, 1, 2, 3, 6). Raises PlacementError for a malformed list or CPUs outside
    ``allowed`` (default: the CPUs this process may use)."""
    allowed = available_cpus() if allowed is None else allowed
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise PlacementError(f"bad CPU list {text!r}: {part!r} is not N or N-M") from None
        if first < 0 or last < first:
            raise PlacementError(f"bad CPU list {text!r}: {part!r} is not an ascending range of CPU numbers")
        cpus.update(range(first, last + 1))
    missing = sorted(cpus - set(allowed))
    if missing:
        raise PlacementError(f"CPU list {text!r} names CPUs {format_cpus(tuple(missing))} that this process "
                             f"cannot use (available: {format_cpus(allowed)})")
    return tuple(sorted(cpus))


def format_cpus(cpus: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> ``"0-2,5"``."""
    parts: list[str] = []
    for c in cpus:
        if parts and c == _last(parts) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{c}"
        else:
            parts.append(str(c))
    return ",".join(parts)


def _last(parts: list[str]) -> int:
    return int(parts[-1].split("-")[-1])


def apply_cpus(cpus: tuple[int, ...]) -> None:
    """Pin this process and all of its current threads to ``cpus``; threads and processes started
    later inherit it. No-op for an empty tuple."""
    if not cpus:
        return
    os.sched_setaffinity(0, cpus)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass  # the thread ended meanwhile


def split_halves(cpus: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(prefill half, decode half) of ``cpus``. Raises PlacementError with fewer than 2 CPUs."""
    if len(cpus) < 2:
        raise PlacementError(f"--pin needs at least 2 CPUs, this process may use {format_cpus(cpus) or 'none'}")
    half = len(cpus) // 2
    return cpus[:half], cpus[half:]
