"""Lateness of emulated steps: how far past its modelled end each step actually ended.

A step sleeps until its modelled end; what the host does in the step (writing the KV pattern, reading the
context back, Python) and the sleep's own overshoot make it late. Each instance keeps a histogram over its
life and a window of recent steps for percentiles: its last RECENT_STEPS steps, or fewer since the window
was last reset (POST /emulation/reset_window, which `kvpush bench` sends before each run, so that a run's
verdict is over its own steps, not the runs before it on the same processes). Both go out with the
engine's stats (EmulationStats) and on /metrics, labelled with the profile.
"""

from __future__ import annotations

import bisect
from collections import deque

import msgspec

LATENESS_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
RECENT_STEPS = 4096


class EmulationStats(msgspec.Struct):
    """What an emulated engine reports (engine-core stats, /metrics)."""

    profile: str
    time_scale: float
    steps: int = 0
    modelled_s: float = 0.0  # sum of the steps' modelled durations (scaled)
    lateness_bounds: list[float] = []
    lateness_counts: list[int] = []  # per bucket, the last one +Inf
    lateness_sum_s: float = 0.0
    lateness_max_s: float = 0.0
    lateness_p50_s: float = 0.0  # over the last RECENT_STEPS steps
    lateness_p99_s: float = 0.0
    step_p50_s: float = 0.0  # modelled step duration, same window
    window_steps: int = 0  # steps in the window


class LatenessLog:
    def __init__(self, profile: str, time_scale: float) -> None:
        self.profile, self.time_scale = profile, time_scale
        self.counts = [0] * (len(LATENESS_BUCKETS) + 1)
        self.steps = 0
        self.modelled_s = self.sum_s = self.max_s = 0.0
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self.recent_steps: deque[float] = deque(maxlen=RECENT_STEPS)

    def record(self, modelled_s: float, lateness_s: float) -> None:
        self.counts[bisect.bisect_left(LATENESS_BUCKETS, lateness_s)] += 1
        self.steps += 1
        self.modelled_s += modelled_s
        self.sum_s += lateness_s
        self.max_s = max(self.max_s, lateness_s)
        self.recent.append(lateness_s)
        self.recent_steps.append(modelled_s)

    def reset_window(self) -> None:
        """Start the percentiles' window afresh (the life-long counts stay)."""
        self.recent.clear()
        self.recent_steps.clear()

    def stats(self) -> EmulationStats:
        return EmulationStats(self.profile, self.time_scale, self.steps, self.modelled_s, list(LATENESS_BUCKETS),
                              list(self.counts), self.sum_s, self.max_s, quantile(self.recent, 0.5),
                              quantile(self.recent, 0.99), quantile(self.recent_steps, 0.5), len(self.recent))


def quantile(values: deque[float] | list[float], q: float) -> float:
    """The q-quantile (nearest rank) of `values`; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.5) - 1))]
