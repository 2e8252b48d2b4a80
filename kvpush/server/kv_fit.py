"""Online fits for --kv-mode auto's cost model (kv_choice.py): plain Python and numpy, no I/O.

    Line        y = a + b x, decayed least squares (prefill time vs tokens, and the like)
    RestModel   the rest of a remote route's TTFT: y = a + b x + g load + c[route] + e[P, D] (load: the
                requests decoding on D), one decayed least squares over every remote sample, so that
                a rising load raises every route's estimate, not only the one measured under it,
                and c, e are the differences between routes and pairs measured side by side (ridge: c
                pulled towards its prior as strongly as RIDGE samples would, e towards the first pair
                seen only as PAIR_RIDGE samples would: pairs differ by their links)
    RouteSlope  what a route adds per token to P's prefill time (residuals of the shared prefill line)
    LocalBudget a token bucket per D of the time its local prefills may take (auto's local route)
"""

from __future__ import annotations

import numpy as np

RIDGE = 2.0
PAIR_RIDGE = 0.1  # pairs differ by their links: barely pulled towards the first pair
SLOPE_SCALE = 512.0  # tokens: the slope's prior weighs as much as RIDGE samples this far apart


class Line:
    """y = a + b x by least squares over samples whose weight halves every `half_life` samples;
    before `min_samples` it answers its prior (a0, b0). The slope is kept >= 0."""

    def __init__(self, a0: float, b0: float, half_life: float = 50.0, min_samples: int = 4) -> None:
        self.a0, self.b0, self.min_samples = a0, b0, min_samples
        self.decay = 0.5 ** (1.0 / half_life)
        self.n = 0
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.w, self.sx, self.sy = self.w * d + 1, self.sx * d + x, self.sy * d + y
        self.sxx, self.sxy = self.sxx * d + x * x, self.sxy * d + x * y
        self.n += 1

    def coefficients(self) -> tuple[float, float]:
        if self.n < self.min_samples:
            return self.a0, self.b0
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        b = max((self.sxy / self.w - mx * my) / var, 0.0) if var > 1e-9 * max(mx * mx, 1.0) else self.b0
        return max(my - b * mx, 0.0), b

    def __call__(self, x: float) -> float:
        a, b = self.coefficients()
        return a + b * max(x, 0.0)


class RestModel:
    def __init__(self, routes: tuple[str, ...], priors: dict[str, float], a0: float, b0: float,
                 half_life: float = 30.0, min_samples: int = 4) -> None:
        """`routes[0]` is the baseline (c = 0); `priors` the other routes' c before any sample."""
        self.routes, self.priors, self.a0, self.b0, self.min_samples = routes, priors, a0, b0, min_samples
        self.decay = 0.5 ** (1.0 / half_life)
        self.pairs: list[tuple[str, str]] = []
        self.n = 0
        self.pair_n: dict[tuple[str, str], int] = {}
        self.xtx = np.zeros((0, 0))
        self.xty = np.zeros(0)
        self._coef: np.ndarray | None = None

    def _features(self, x: float, load: float, route: str, pair: tuple[str, str]) -> np.ndarray:
        r = len(self.routes)
        f = np.zeros(2 + r + max(len(self.pairs) - 1, 0))
        f[0], f[1], f[2] = 1.0, x, load
        if route != self.routes[0]:
            f[2 + self.routes.index(route)] = 1.0
        if pair in self.pairs[1:]:  # the first pair seen is the baseline (e = 0)
            f[1 + r + self.pairs.index(pair)] = 1.0
        return f

    def _grow(self, pair: tuple[str, str]) -> None:
        if pair in self.pairs:
            return
        self.pairs.append(pair)
        k = 2 + len(self.routes) + len(self.pairs) - 1
        xtx, xty = np.zeros((k, k)), np.zeros(k)
        m = self.xtx.shape[0]
        xtx[:m, :m], xty[:m] = self.xtx, self.xty
        self.xtx, self.xty = xtx, xty

    def add(self, x: float, load: float, y: float, route: str, pair: tuple[str, str]) -> None:
        if self.xtx.shape[0] == 0:
            k = 2 + len(self.routes)
            self.xtx, self.xty = np.zeros((k, k)), np.zeros(k)
        self._grow(pair)
        f = self._features(x, load, route, pair)
        self.xtx = self.xtx * self.decay + np.outer(f, f)
        self.xty = self.xty * self.decay + f * y
        self.n += 1
        self.pair_n[pair] = self.pair_n.get(pair, 0) + 1
        self._coef = None

    def _solve(self) -> np.ndarray:
        if self._coef is None:
            k = self.xtx.shape[0]
            ridge, prior = np.zeros(k), np.zeros(k)
            ridge[1], prior[1] = RIDGE * SLOPE_SCALE**2, self.b0  # all samples of one length: the prior slope
            ridge[2] = RIDGE  # a steady load: no load effect
            ridge[3 : 2 + len(self.routes)] = RIDGE
            ridge[2 + len(self.routes) :] = PAIR_RIDGE
            for i, r in enumerate(self.routes[1:]):
                prior[3 + i] = self.priors.get(r, 0.0)
            a = self.xtx + np.diag(ridge) + np.eye(k) * 1e-12
            coef = np.linalg.solve(a, self.xty + ridge * prior)
            if coef[1] < 0:  # more tokens never take less time: refit without the slope
                keep = [i for i in range(k) if i != 1]
                sub = np.linalg.solve(a[np.ix_(keep, keep)], (self.xty + ridge * prior)[keep])
                coef = np.insert(sub, 1, 0.0)
            self._coef = coef
        return self._coef

    def __call__(self, x: float, load: float, route: str, pair: tuple[str, str]) -> float:
        if self.n < self.min_samples:
            return self.a0 + self.b0 * max(x, 0.0) + (0.0 if route == self.routes[0] else self.priors.get(route, 0.0))
        coef = self._solve()
        f = self._features(max(x, 0.0), load, route, pair)
        if self.pair_n.get(pair, 0) < 2:  # an unmeasured pair: as the first pair
            f[2 + len(self.routes) :] = 0.0
        return max(float(f @ coef), 0.0)


class RouteSlope:
    """What a route adds per token to a time every route shares (P's prefill: push-layerwise's layer
    hooks and per-layer WRITEs, push's WRITE run on P's core): k[route] seconds per token, a decayed
    least squares through the origin of (tokens, residual of the shared line) per route, pulled
    towards 0 as strongly as RIDGE samples of SLOPE_SCALE tokens would. Relative: the shared line
    fits every route's samples, so the most taken route sits near 0 and the others differ from it."""

    def __init__(self, half_life: float = 50.0) -> None:
        self.decay = 0.5 ** (1.0 / half_life)
        self.sums: dict[str, tuple[float, float]] = {}  # route -> (sum w x^2, sum w x y)

    def add(self, route: str, tokens: float, residual: float) -> None:
        sxx, sxy = self.sums.get(route, (0.0, 0.0))
        self.sums[route] = (sxx * self.decay + tokens * tokens, sxy * self.decay + tokens * residual)

    def slope(self, route: str) -> float:
        sxx, sxy = self.sums.get(route, (0.0, 0.0))
        return sxy / (sxx + RIDGE * SLOPE_SCALE**2)

    def __call__(self, route: str, tokens: float) -> float:
        return self.slope(route) * max(tokens, 0.0)


class LocalBudget:
    """How much of each D's time local prefills may take: a token bucket per D, in seconds of D's
    prefill. It fills at `share` seconds per second up to `share * window_s`; a local prefill is
    allowed while the bucket holds its estimated time (or the bucket is full: one prefill longer
    than the whole bucket still gets through, and leaves it in debt), and is charged that time.
    Over any long stretch D then spends at most about `share` of its time prefilling for auto's
    local route, which bounds what those prefills add to the TPOT of D's decoding requests, while
    the bucket's depth lets a burst at P use D's saved-up time at once. share >= 1: no limit; share 0:
    no local prefill (but where it is the only route)."""

    def __init__(self, share: float, window_s: float) -> None:
        self.share, self.capacity = share, share * window_s
        self.level: dict[str, tuple[float, float]] = {}  # D url -> (seconds in the bucket, as of when)

    @property
    def unlimited(self) -> bool:
        return self.share >= 1.0

    def available(self, url: str, now: float) -> float:
        level, since = self.level.get(url, (self.capacity, now))
        return min(self.capacity, level + self.share * max(now - since, 0.0))

    def allows(self, url: str, seconds: float, now: float) -> bool:
        if self.unlimited:
            return True
        left = self.available(url, now)
        return left >= seconds or 0 < self.capacity <= left

    def charge(self, url: str, seconds: float, now: float) -> None:
        if not self.unlimited:
            self.level[url] = (self.available(url, now) - max(seconds, 0.0), now)
