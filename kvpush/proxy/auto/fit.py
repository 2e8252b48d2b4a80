"""Online fits for --kv-mode auto's cost model (choice.py): plain Python and numpy, no I/O.

    Line        y = a + b x, decayed least squares (prefill time vs tokens, and the like)
    RouteFit    y = a + b x + g load + c[route] + k[route] xr + h[route] load + e[pair]: one decayed ridge
                least squares over every route's samples, for P's prefill (x = xr: the request's tokens,
                load: P's queue ahead of it, pair: P alone), for P's time to answer after it (x = xr:
                tokens moved) and for the rest of a remote route's TTFT (x: tokens moved, load: the
                requests decoding on D), so that a rising load raises every route's
                estimate, not only the one measured under it, and c, k, h, e are the differences between
                routes and pairs, measured side by side against a fixed baseline route
    Residuals   log(measured / fitted) per key (auto: per route and prompt size class), an
                exponentially weighted average over that key's own answers
    LocalBudget a token bucket per D of the time its local prefills may take (auto's local route)
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import numpy as np

RIDGE = 2.0
PAIR_RIDGE = 0.1  # pairs differ by their links: barely pulled towards the first pair
SLOPE_SCALE = 512.0  # tokens: the slope's prior weighs as much as RIDGE samples this far apart
LOAD_SCALE = 4.0  # the same for a route's load slope: RIDGE samples this many load units apart


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


class RouteFit:
    """y = a + b x + g load + c[route] + k[route] xr + h[route] load + e[pair]: one decayed ridge least
    squares over the samples of every route, so that what all routes share (the line in x, the load)
    is learned from all of them, and c, k, h are the differences between routes measured side by
    side. `routes[0]` is the baseline (c = k = h = 0): a route seldom taken keeps its prior difference
    from it instead of drifting with whichever route is taken most. The load column is the caller's:
    requests decoding on D for the rest fits, P's queue ahead in choice.QUEUE_UNITs for P's prefill
    fit (where x = xr = the tokens P computes for this request). xr (default x) is what the route's own
    effect grows with; h is how much more the route grows with the load (pull's D admits the request
    and posts its READ between two of its decode steps, push's D registered during the prefill: pull
    waits for D's steps more). Ridge: b and g pulled towards b0 and g0 as strongly as RIDGE samples
    SLOPE_SCALE tokens and one load unit apart, c, k, h towards their priors as RIDGE samples (k
    SLOPE_SCALE tokens apart, h LOAD_SCALE load units apart), e towards the first pair only as
    PAIR_RIDGE samples would (pairs differ by their links). Before min_samples samples it answers its
    priors. b is kept >= 0 (refitted without it); g is not: callers clamp what they derive from it."""

    def __init__(self, routes: tuple[str, ...], priors: dict[str, float], a0: float, b0: float,
                 half_life: float = 30.0, min_samples: int = 4, slope_priors: dict[str, float] | None = None,
                 load_priors: dict[str, float] | None = None, g0: float = 0.0) -> None:
        """g0: the prior of the shared load slope g (0: a steady load has no effect until measured)."""
        self.routes, self.priors, self.a0, self.b0, self.min_samples = routes, priors, a0, b0, min_samples
        self.g0 = g0
        self.slope_priors = slope_priors or {}
        self.load_priors = load_priors or {}
        self.decay = 0.5 ** (1.0 / half_life)
        self.pairs: list[tuple[str, str]] = []
        self.n = 0
        self.pair_n: dict[tuple[str, str], int] = {}
        self.xtx = np.zeros((0, 0))
        self.xty = np.zeros(0)
        self._coef: np.ndarray | None = None

    @property
    def _slope0(self) -> int:  # first per-route slope column (after 1, x, load and the route offsets)
        return 2 + len(self.routes)

    @property
    def _load0(self) -> int:  # first per-route load slope column
        return self._slope0 + len(self.routes) - 1

    @property
    def _pair0(self) -> int:  # first pair column
        return self._load0 + len(self.routes) - 1

    def _features(self, x: float, load: float, route: str, pair: tuple[str, str], xr: float) -> np.ndarray:
        f = np.zeros(self._pair0 + max(len(self.pairs) - 1, 0))
        f[0], f[1], f[2] = 1.0, x, load
        if route != self.routes[0]:
            i = self.routes.index(route)
            f[2 + i], f[self._slope0 + i - 1], f[self._load0 + i - 1] = 1.0, xr / SLOPE_SCALE, load / LOAD_SCALE
        if pair in self.pairs[1:]:  # the first pair seen is the baseline (e = 0)
            f[self._pair0 + self.pairs.index(pair) - 1] = 1.0
        return f

    def _grow(self, pair: tuple[str, str]) -> None:
        if pair in self.pairs:
            return
        self.pairs.append(pair)
        k = self._pair0 + len(self.pairs) - 1
        xtx, xty = np.zeros((k, k)), np.zeros(k)
        m = self.xtx.shape[0]
        xtx[:m, :m], xty[:m] = self.xtx, self.xty
        self.xtx, self.xty = xtx, xty

    def add(self, x: float, load: float, y: float, route: str, pair: tuple[str, str], xr: float | None = None) -> None:
        if self.xtx.shape[0] == 0:
            self.xtx, self.xty = np.zeros((self._pair0, self._pair0)), np.zeros(self._pair0)
        self._grow(pair)
        f = self._features(x, load, route, pair, x if xr is None else xr)
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
            ridge[2], prior[2] = RIDGE, self.g0  # a steady load: its prior effect
            ridge[3 : self._pair0] = RIDGE
            ridge[self._pair0 :] = PAIR_RIDGE
            for i, r in enumerate(self.routes[1:]):
                prior[3 + i] = self.priors.get(r, 0.0)
                prior[self._slope0 + i] = self.slope_priors.get(r, 0.0) * SLOPE_SCALE
                prior[self._load0 + i] = self.load_priors.get(r, 0.0) * LOAD_SCALE
            a = self.xtx + np.diag(ridge) + np.eye(k) * 1e-12
            coef = np.linalg.solve(a, self.xty + ridge * prior)
            if coef[1] < 0:  # more tokens never take less time: refit without the slope
                keep = [i for i in range(k) if i != 1]
                sub = np.linalg.solve(a[np.ix_(keep, keep)], (self.xty + ridge * prior)[keep])
                coef = np.insert(sub, 1, 0.0)
            self._coef = coef
        return self._coef

    def slope(self) -> float:
        """b: seconds per unit of x, shared by every route."""
        return float(self._solve()[1]) if self.n >= self.min_samples else self.b0

    def __call__(self, x: float, load: float, route: str, pair: tuple[str, str], xr: float | None = None) -> float:
        xr = max(x if xr is None else xr, 0.0)
        if self.n < self.min_samples:
            prior = (self.priors.get(route, 0.0) + self.slope_priors.get(route, 0.0) * xr
                     + self.load_priors.get(route, 0.0) * max(load, 0.0))
            shared = self.a0 + self.b0 * max(x, 0.0) + self.g0 * max(load, 0.0)
            return shared + (0.0 if route == self.routes[0] else prior)
        coef = self._solve()
        f = self._features(max(x, 0.0), load, route, pair, xr)
        if self.pair_n.get(pair, 0) < 2:  # an unmeasured pair: as the first pair
            f[self._pair0 :] = 0.0
        return max(float(f @ coef), 0.0)


class Residuals:
    """How far a fit's estimates fell from what was measured, per key: log(measured / fitted), averaged
    over the key's own answers with the newest weighted `alpha` (0: always 0); each answer's log-ratio
    and the average are bounded to +-log 2 (one stalled answer moves it at most alpha x log 2), and a
    ratio that is not a finite number is ignored.

    Why auto needs it: its fits are decayed least squares (RouteFit, half-life 30-50 answers of any
    route) and follow a new load slowly, so their estimates ran 8-20% off over whole cells of the
    regime map; the correction follows what the latest answers measured, and fades as the fits catch
    up. Auto keys it by remote (every remote route together) or local, size class and D prefix hit
    (choice.residual_key): keyed per route, a route's correction followed only its own answers,
    taken under whatever load it last met, and opened gaps between remote routes that were not there."""

    LIMIT = math.log(2.0)

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.values: dict[Hashable, float] = {}

    def __call__(self, key: Hashable) -> float:
        return self.values.get(key, 0.0)

    def add(self, key: Hashable, log_ratio: float) -> None:
        if self.alpha <= 0 or not math.isfinite(log_ratio):
            return
        old = self.values.get(key, 0.0)
        x = min(max(log_ratio, -self.LIMIT), self.LIMIT)
        self.values[key] = min(max(old + self.alpha * (x - old), -self.LIMIT), self.LIMIT)


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


class BusyMeter:
    """The fraction of recent time each instance was busy (had a prefill queued or running), as the proxy
    sees it: an exponentially weighted average of the busy state over about `window_s`. The proxy's span
    of a leg (dispatch -> P's answer) includes its HTTP hops, so this reads a little above P's own."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.state: dict[str, tuple[float, bool, float]] = {}  # url -> (fraction, busy since then, as of when)

    def fraction(self, url: str, now: float) -> float:
        value, busy, since = self.state.get(url, (0.0, False, now))
        keep = math.exp(-max(now - since, 0.0) / self.window_s) if self.window_s > 0 else 0.0
        return value * keep + (1.0 - keep) * float(busy)

    def set(self, url: str, busy: bool, now: float) -> None:
        self.state[url] = (self.fraction(url, now), busy, now)
