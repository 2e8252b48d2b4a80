"""Bootstrap confidence intervals for comparing modes, and the verdict they support.

- ``bootstrap_ci(values, stat)``: percentile bootstrap of ``stat`` over resamples of ``values``.
- ``ratio_ci(a, b, stat)``: interval of ``stat(a) / stat(b)``, resampling ``a`` and ``b``
  independently (unpaired: different requests), or jointly by index when ``paired`` (the same
  prompts sent to both modes, as the interleaved benchmark does).
- ``clustered_ratio_ci(groups, stat)``: the same ratio when requests come in paired groups (one
  group per prompt set both modes ran, e.g. one repeat of an alternating benchmark): each resample
  draws groups with replacement, then requests jointly by index within each drawn group, so the
  interval carries the drift between repeats as well as the spread of requests. Drawing requests
  within drawn groups counts their spread twice (wider, conservative, for that part), while the
  spread between repeats comes out narrower by about (G - 1) / G with G repeats. Percentile
  intervals of a p99 are rough at a few hundred requests (it rests on a handful of values; the
  estimate can sit at an edge of its interval).
- ``verdict(lo, hi, better_below=True)``: "A better" / "B better" when the interval excludes 1.0,
  "cannot tell" when it spans it.

Deterministic (seeded) so reports are reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Stat = Callable[[np.ndarray], float]
Values = Sequence[float] | np.ndarray
DEFAULT_RESAMPLES = 2000
DEFAULT_LEVEL = 0.95


def p50(x: np.ndarray) -> float:
    return float(np.median(x))


def p99(x: np.ndarray) -> float:
    return float(np.percentile(x, 99))


def _resample_indices(n: int, resamples: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, n, size=(resamples, n))


def _interval(samples: np.ndarray, level: float) -> tuple[float, float]:
    tail = (1.0 - level) / 2.0 * 100.0
    lo, hi = np.percentile(samples, [tail, 100.0 - tail])
    return float(lo), float(hi)


def bootstrap_ci(values: Values, stat: Stat = p50, resamples: int = DEFAULT_RESAMPLES,
                 level: float = DEFAULT_LEVEL, seed: int = 0) -> tuple[float, float, float]:
    """(estimate, low, high) of ``stat`` over ``values``. Raises ValueError if ``values`` is empty."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError("no values to bootstrap")
    idx = _resample_indices(x.size, resamples, np.random.default_rng(seed))
    boots = np.array([stat(x[i]) for i in idx])
    return (stat(x), *_interval(boots, level))


def ratio_ci(a: Values, b: Values, stat: Stat = p50, paired: bool = False,
             resamples: int = DEFAULT_RESAMPLES, level: float = DEFAULT_LEVEL,
             seed: int = 0) -> tuple[float, float, float]:
    """(estimate, low, high) of ``stat(a) / stat(b)``. ``paired`` needs equal lengths."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.size == 0 or y.size == 0:
        raise ValueError("no values to bootstrap")
    if paired and x.size != y.size:
        raise ValueError(f"paired samples need equal lengths, got {x.size} and {y.size}")
    rng = np.random.default_rng(seed)
    ix = _resample_indices(x.size, resamples, rng)
    iy = ix if paired else _resample_indices(y.size, resamples, rng)
    boots = np.array([stat(x[i]) / stat(y[j]) for i, j in zip(ix, iy, strict=True)])
    return (stat(x) / stat(y), *_interval(boots, level))


def clustered_ratio_ci(groups: Sequence[tuple[Values, Values]], stat: Stat = p50,
                       resamples: int = DEFAULT_RESAMPLES, level: float = DEFAULT_LEVEL,
                       seed: int = 0) -> tuple[float, float, float]:
    """(estimate, low, high) of ``stat(a) / stat(b)`` over the pooled pairs of ``groups``, a list of
    ``(a_values, b_values)`` paired by index (equal lengths). Raises ValueError if a group's sides
    differ in length or no group has values."""
    pairs = [(np.asarray(a, dtype=float), np.asarray(b, dtype=float)) for a, b in groups]
    if any(x.size != y.size for x, y in pairs):
        raise ValueError("paired groups need equal lengths on both sides")
    pairs = [(x, y) for x, y in pairs if x.size]
    if not pairs:
        raise ValueError("no values to bootstrap")
    rng = np.random.default_rng(seed)
    boots = np.empty(resamples)
    for k in range(resamples):
        drawn = [pairs[g] for g in rng.integers(0, len(pairs), size=len(pairs))]
        picks = [rng.integers(0, x.size, size=x.size) for x, _ in drawn]
        x = np.concatenate([x[i] for (x, _), i in zip(drawn, picks, strict=True)])
        y = np.concatenate([y[i] for (_, y), i in zip(drawn, picks, strict=True)])
        boots[k] = stat(x) / stat(y)
    x_all = np.concatenate([x for x, _ in pairs])
    y_all = np.concatenate([y for _, y in pairs])
    return (stat(x_all) / stat(y_all), *_interval(boots, level))


def verdict(lo: float, hi: float, a: str = "push", b: str = "pull", better_below: bool = True) -> str:
    """What a ratio interval of a/b says: which is better, or "cannot tell" if it spans 1.0."""
    if lo <= 1.0 <= hi:
        return "cannot tell"
    below = hi < 1.0
    return f"{a} better" if below == better_below else f"{b} better"


def fmt_ci(est: float, lo: float, hi: float, digits: int = 3) -> str:
    """``est [lo, hi]``."""
    return f"{est:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"
