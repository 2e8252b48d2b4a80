"""Bootstrap confidence intervals for comparing modes, and the verdict they support.

- ``bootstrap_ci(values, stat)``: percentile bootstrap of ``stat`` over resamples of ``values``.
- ``ratio_ci(a, b, stat)``: interval of ``stat(a) / stat(b)``, resampling ``a`` and ``b``
  independently (unpaired: different requests), or jointly by index when ``paired`` (the same
  prompts sent to both modes, as the interleaved benchmark does).
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


def verdict(lo: float, hi: float, a: str = "push", b: str = "pull", better_below: bool = True) -> str:
    """What a ratio interval of a/b says: which is better, or "cannot tell" if it spans 1.0."""
    if lo <= 1.0 <= hi:
        return "cannot tell"
    below = hi < 1.0
    return f"{a} better" if below == better_below else f"{b} better"


def fmt_ci(est: float, lo: float, hi: float, digits: int = 3) -> str:
    """``est [lo, hi]``."""
    return f"{est:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"
