"""`--kv-mode auto`: per request, the proxy picks how the prompt's KV reaches the decode instance.

Routes: push, push-layerwise, pull (P prefills, the KV moves to D), local (D prefills the prompt
itself; no P leg). The proxy picks P and D first (its --policy), then the route for that pair with
the lowest cost. Nothing here does I/O: the proxy feeds it what it sees and asks it to choose.

Signals (all free for the proxy; no extra round trip):
    tokens      the prompt's length: exact for token-id prompts; for text, characters times a
                tokens-per-character ratio learned from the instances' answers (prior 0.25)
    d_prefix    tokens of this prompt D probably holds in its prefix cache: a PrefixTracker per
                instance remembers the prompts it was sent (block-sized chunks of token ids, or
                CHARS_PER_UNIT-character chunks of text or chat messages), LRU-bounded
    p_prefix    the same for P (its prefix cache spares it those tokens)
    p_queue     prompt tokens P still has to prefill for legs dispatched before this one
    p_waiting   how many requests those are (the one P is prefilling included)
    p_busy      the share of recent time the proxy had a leg at P without P's answer (fit.BusyMeter)
    d_queue     prompt tokens D still has to prefill for local requests dispatched before this one
    d_running   requests decoding on D: in flight there, less those whose prefill is still pending
                (queued or running on P, or queued on D): a local prefill stalls each of them (once, or once
                per chunk: the same prefill time, plus a step's fixed cost per chunk).
                Requests waiting for their KV are not stalled by it (they wait on P), and in a burst
                at P they are many: counting them would keep D's prefill out exactly when it helps
Learned fits, from every finished request's trace (decayed least squares):
    prefill[route, P]   P's api_received -> prefill done: one fit over every remote route (fit.RouteFit),
                        a + b own + g queue + c[route] + k[route] own + h[route] queue + e[P], own = the
                        tokens P computes for this request, queue = P's queue ahead of it (in QUEUE_UNITs):
                        a queued token has a slope of its own (~0.6 of an own token's: the head of the
                        queue is partly prefilled by the time this request waits behind it; one slope for
                        both was too low for own tokens, which put push's estimates 4-9% under its TTFT
                        and pull's, whose route terms absorbed the difference, at or over it).
                        Push-layerwise's layer hooks and per-layer WRITEs (and push's WRITE) run on
                        P's core, so routes differ in P's time too; against push as
                        the baseline, so that a route seldom taken keeps its difference from push (pulled
                        towards its prior as strongly as 2 samples would; prior, measured on this machine:
                        push-layerwise +3.3 ms + 6.3 us per token, pull as push) instead of drifting with
                        whichever route is taken most. A route measured only by exploring (about
                        once in 100-160 decisions) stays mostly prior: on other hardware the prior matters
    local               D's api_received -> first token         vs tokens D computed (+ its queue)
    rest[route, P, D]   TTFT - P's part                       vs tokens moved (prompt - D's prefix):
                        and the requests decoding on D: one fit over every remote route,
                        a + b x + g d_running + c[route] + k[route] x + h[route] d_running + e[P, D]
                        (fit.RouteFit), so that D's load moves every route's estimate at once, routes
                        and pairs differ by what was measured of them, and pull (whose D admits the
                        request and posts its READ between its decode steps) can grow faster with D's
                        load than push (prior: +2 ms per decoding request). Two such fits: one for fresh
                        prompts, one for prompts D holds a prefix of (d_prefix > 0: session turns), whose
                        handover grows with D's load several times faster (regime_full15's 128/256 cells,
                        push's rest 12 -> 30 ms from 0-2 to 6-8 requests decoding on D, fresh: 3 -> 9): in
                        one fit the moved tokens and the load cannot tell them apart, and the turns of a
                        sessions cell set the load slope a fresh cell after it is priced by
    after[route]        P's prefill done -> its answer vs tokens moved: one fit over every remote route
                        (RouteFit without load or pairs; push the baseline, the others pulled towards their
                        priors). P answers without waiting for the transfer, but push's WRITE, which on one
                        host P's own core copies (UCX's cma: the initiator copies; pull's READ is copied by
                        D's), competes on that core with the answer and with the next prefill alike: the
                        span measures what the transfer takes from P, not the WRITE's own duration
    (TTFT = proxy received -> D's leg sent on the proxy's clock + D's api_received -> first token on
    D's: no two clocks are subtracted from each other, so it holds across hosts.)
Estimates and costs (seconds):
    remote r:  prefill[r, P](own, p_queue) + rest[r, P, D](tokens - d_prefix), own = tokens - p_prefix;
               its cost adds how long it keeps P from the requests behind it: (prefill[r, P](own, 0) +
               after[r](tokens - d_prefix)) x p_waiting (in a FIFO queue a request leaves as many behind
               as it found ahead, on average), with busy_period (--auto-busy-period) x 1 / (1 - min(p_busy,
               BUSY_MAX)): each request left behind passes the delay on to the rest of P's busy period. Local's cost
               charges the stall it inflicts on D's decoding requests (below), so both sides carry a
               delay to others (local's leaves out the locals queued behind it on D and the KV
               landing there meanwhile): a request that stays off a busy P spares the
               requests queueing there, which is where the TTFT tail forms (a short prompt behind a
               long one); routes that hold P longer (push-layerwise's hooks, push's WRITE) pay for it per
               waiting request: in the mixed cell's fixed-route runs P's part of the TTFT was 258 / 264 /
               276 ms at 1,024 tokens by pull / push / push-layerwise (medians, 24 runs a route, ad hoc).
               P's line includes its intercept: were the fit's queue slope to drop to 0, the
               intercept would hold P's queueing and this charge would overstate the delay
    local:     local(d_queue + tokens - d_prefix); its cost adds the stall it inflicts on D's running
               requests: local(tokens - d_prefix) x d_running x stall_weight. Local is not considered
               at all when that prefill would take longer than local_max_s (--auto-local-max-ms): the
               tail guard, as a prefill that long takes that much of D's time from its decoding requests
               and from the local requests queued behind it (in chunks on a CPU D, a landed KV waits
               one chunk, not the whole prefill) - unless
               P's queue alone would hold the request at least as long as D's local queue and its
               prefill would (a burst at P); nor when D's local budget is spent (--auto-local-share:
               a token bucket per D of the prefill time local requests may take, fit.LocalBudget,
               charged each local dispatch's estimate), which bounds what local prefills add to the
               TPOT of D's decoding requests
    residual   each route's estimate is the fits' queue ahead of it plus the fits' own part times
               exp(residual[residual_key]): the average of log(measured / fitted own part) over the
               recent answers of that size (uncached tokens to the nearest power of two; any pair) of
               every remote route together (local apart), fresh prompts and prompts D holds a prefix
               of apart, the newest weighted residual_alpha (fit.Residuals). The stall local
               charges and P's delay to others are not corrected
The cheapest route wins (`cheapest`): local when no remote route costs less; else among the remote
routes one other than the incumbent of the request's size class (incumbent_key: the remote route the
last free choice between remote routes settled on for that class; push at first; a forced, explored
or tied decision leaves it) counts switch_margin dearer: remote routes differ by less than the fits'
error where the link is fast, and the cheapest of noisy near-equal estimates is noise. Each class
settles its own (a mix of many prompt lengths has many classes, each starting from push). With
near_tie > 0 (off by default), a remote route whose cost is within near_tie of the cheapest's (a
remote route) and that no decision took for TIE_EVERY decisions takes this one (`tied`).
Every EXPLORE_EVERY-th decision (every EXPLORE_EVERY_LATER-th once each route has WELL_MEASURED
samples and none has gone STALE_AFTER decisions without being taken) takes another route instead:
the one with the fewest samples while some route has fewer than WELL_MEASURED, else the one taken
least recently (taken = dispatched by it: chosen, explored or named by the client). So a route that
looks worse at first is still measured, the lines follow the load, and no route allowed goes much
longer than STALE_AFTER decisions without a request, so the fits' picture of a route no longer taken
gets a fresh sample instead of resting only on samples decayed from another time. With one route
winning, each of the others is explored about once in 160 decisions (~2% of decisions for three,
where the old rule, the route with the fewest samples, explored ~1% and never a route with many:
in regime_full13 a test run beside the map slowed one cell, auto's push requests there took 1.8x
fixed push's TTFT, and auto then sent none by push for 7 cells, ~220 decisions, where push was the
best fixed mode in 6; what brings such a route back is mostly its slow samples decaying out of the
fits, which a fresh sample speeds up). Exploring local charges no stall: it happens only where local
is allowed (local_allowed, D's budget), at most as often as the other explorations. A route the
client named is never overridden.
Not used: descriptor count (pull's READ cost grows with fragmented KV; on one host it stayed small).
"""

from __future__ import annotations

import math

from kvpush.config import ProxyConfig
from kvpush.proxy.auto.fit import Line, Residuals, RouteFit
from kvpush.proxy.auto.prefix import CHARS_PER_UNIT, PromptKey
from kvpush.proxy.auto.records import Decision, Outcome, Route, incumbent_key, residual_key

EXPLORE_EVERY = 20  # while some route has fewer than WELL_MEASURED samples
EXPLORE_EVERY_LATER = 100
WELL_MEASURED = 8
STALE_AFTER = 150  # decisions: ~3-5 half-lives of the remote fits (30, 50 answers) while requests keep coming
TIE_EVERY = 10  # decisions: a near-tied remote route is taken at least this often
NEAR_TIE = ProxyConfig.auto_near_tie
RESIDUAL_ALPHA = ProxyConfig.auto_residual_alpha
SWITCH_MARGIN = ProxyConfig.auto_switch_margin
PRIOR_TOKENS_PER_CHAR = 0.25
STALL_WEIGHT = ProxyConfig.auto_stall_weight
QUEUE_UNIT = 100.0  # tokens: P's queue enters its prefill fit in these units (the fit's load column: its ridge
# weighs as RIDGE samples one unit apart, so small units keep the measured slope from the prior's pull)
BUSY_MAX = 0.8  # the busy fraction busy_factor takes at most (a factor of 5): near saturation the M/M/1 figure explodes

# P's prefill done -> answer (CostModel.after), the priors: push's line (s, s per token moved), and the other
# routes' differences from it (offset s, slope s per token)
AFTER_PUSH = (0.0017, 3.6e-6)
AFTER_OFFSETS = {Route.PUSH_LAYERWISE.value: -0.0005, Route.PULL.value: -0.0003}
AFTER_SLOPES = {Route.PUSH_LAYERWISE.value: -2.9e-6, Route.PULL.value: -3.4e-6}


class CostModel:
    def __init__(self, routes: tuple[Route, ...] = tuple(Route), stall_weight: float = STALL_WEIGHT,
                 local_max_s: float = 0.064, near_tie: float = NEAR_TIE, residual_alpha: float = RESIDUAL_ALPHA,
                 switch_margin: float = SWITCH_MARGIN, busy_period: bool = False) -> None:
        self.routes = routes
        self.busy_period = busy_period
        self.switch_margin = switch_margin
        # per size class (incumbent_key): the remote route the last free choice there settled on
        self.incumbents: dict[tuple[int, bool], Route] = {}
        self.stall_weight = stall_weight
        self.near_tie = near_tie
        self.residual = Residuals(residual_alpha)  # residual_key -> log(measured / fitted own part)
        self.local_max_s = local_max_s
        self.tokens_per_char = PRIOR_TOKENS_PER_CHAR
        remote = (Route.PUSH.value, Route.PUSH_LAYERWISE.value, Route.PULL.value)
        # P's prefill per route, per P (priors: what push-layerwise's hooks cost P here: medians of P's
        # admitted -> prefill done in regime_full11's fixed-mode runs, +4.1 / 8.4 / 16.2 ms at 128 / 512 / 2,048
        # tokens, read ad hoc).
        # x: the tokens P computes for the request, load: P's queue ahead of it in QUEUE_UNITs, each slope
        # its own: a queued token is worth less than an own one once measured (the head of the queue is partly
        # prefilled by the time this request waits behind it: 0.14 ms against 0.24 over mixed_class20b's
        # answers, replayed ad hoc); the prior counts it as one
        self.prefill = RouteFit(remote, {Route.PUSH_LAYERWISE.value: 0.0033}, 0.005, 0.0004, half_life=50.0,
                                slope_priors={Route.PUSH_LAYERWISE.value: 6.3e-6}, g0=0.0004 * QUEUE_UNIT)
        self.local = Line(0.005, 0.0004)
        # Priors: push first (its handover is the shortest measured), layer-wise, then pull; pull's grows
        # faster with D's load (it waits for D's steps to admit the request and post its READ): in
        # regime_full12b's auto runs its rest rose 3.4 ms per request decoding on D, push's 1.1 (ad hoc).
        self.rest, self.rest_hit = (RouteFit(remote, {Route.PUSH_LAYERWISE.value: 0.001, Route.PULL.value: 0.004},
                                             0.004, 1e-5, load_priors={Route.PULL.value: 0.002}) for _ in range(2))
        # P's prefill done -> its answer vs the tokens moved, one fit over the remote routes as for P's prefill
        # (records.outcome: it grows with push's WRITE, which P's core copies here). Priors: medians at 128
        # and 1,024 tokens of the mixed cell's fixed-route runs, 24 a route, mixed_chunk19 to mixed_share19b,
        # read ad hoc: push 2.2 / 5.4 ms, push-layerwise 1.3 / 1.9, pull 1.4 / 1.6
        self.after = RouteFit(remote, AFTER_OFFSETS, *AFTER_PUSH, slope_priors=AFTER_SLOPES)
        self.decisions = 0
        self.samples: dict[Route, int] = {r: 0 for r in Route}
        self.taken_at: dict[Route, int] = {r: 0 for r in Route}  # the decision that last took the route

    # ---- estimating ----------------------------------------------------------------------
    def tokens(self, key: PromptKey) -> float:
        return float(key.exact_tokens) if key.exact_tokens is not None else key.chars * self.tokens_per_char

    def prefix_tokens(self, key: PromptKey, units: int) -> float:
        if key.unit_tokens is not None:
            return float(units * key.unit_tokens)
        return units * CHARS_PER_UNIT * self.tokens_per_char

    def local_line(self) -> Line:
        """D's local prefill time; until D has measured a few, P's cost per token (the slope of P's
        line: its intercept holds P's queueing, which says nothing about D)."""
        if self.local.n >= self.local.min_samples:
            return self.local
        return Line(0.0, self.prefill.slope())

    def estimate(self, route: Route, d: Decision) -> float:
        """TTFT by `route`: the queue ahead of it (P's, or D's local one) as the fits put it, plus the
        request's own part corrected by the route's residual (the queue is shared by every route that
        waits in it: scaled by one route's error, a long queue would open a gap no route has)."""
        queue, own = self.parts(route, d)
        r = d.residuals[route.value] = self.residual(residual_key(route, d))
        d.queue_s[route.value] = queue
        return queue + own * math.exp(r)

    def parts(self, route: Route, d: Decision) -> tuple[float, float]:
        """The fits' (queue ahead, own part) of this request's TTFT by `route`."""
        if route is Route.LOCAL:
            line, uncached = self.local_line(), d.tokens - d.d_prefix
            alone = line(uncached)
            return max(line(d.d_queue + uncached) - alone, 0.0), alone
        own = self.p_time(route, d, 0.0) + self.rest_fit(d)(d.tokens - d.d_prefix, d.d_running, route.value, d.pair)
        return self.p_queue_delay(d, route), own

    def rest_fit(self, d: Decision) -> RouteFit:
        """The rest fit for this request: fresh, or D holds a prefix of it (by the proxy's tracker)."""
        return self.rest_hit if d.d_prefix > 0 else self.rest

    def p_time(self, route: Route, d: Decision, queue: float) -> float:
        """P's prefill of this request by `route` (a remote route) behind `queue` tokens."""
        own = d.tokens - d.p_prefix
        return self.prefill(own, queue / QUEUE_UNIT, route.value, (d.pair[0], ""), own)

    def cost(self, route: Route, d: Decision) -> float:
        est = d.estimates_s[route.value]
        if route is Route.LOCAL:
            est += self.local_s(d) * d.d_running * self.stall_weight
        elif d.p_waiting:
            est += self.p_busy_s(route, d) * d.p_waiting * self.busy_factor(d)
        return est

    def p_busy_s(self, route: Route, d: Decision) -> float:
        """How long this request by `route` (remote) keeps P from the requests behind it: its prefill, then
        P's time to answer it (`after_s`)."""
        return self.p_time(route, d, 0.0) + self.after_s(route, d)

    def after_s(self, route: Route, d: Decision) -> float:
        """P's prefill done -> its answer by `route` (remote). P answers without waiting for the transfer,
        but on P's core: push's WRITE, which that core copies on one host (UCX's cma: the initiator copies;
        pull's READ is copied by D's), competes with the answer and with the next prefill alike, so the span
        grows with it. A measure of what the transfer takes from P, not the WRITE's own duration."""
        moved = d.tokens - d.d_prefix
        return self.after(moved, 0.0, route.value, ("", ""), moved)

    def busy_factor(self, d: Decision) -> float:
        """With busy_period: 1 / (1 - P's busy fraction, at most BUSY_MAX): each request its prefill leaves
        behind at P delays, in a FIFO queue, every request of the rest of P's busy period, about 1 / (1 - rho)
        requests per request left behind (M/M/1); without it, 1 (the requests left behind alone)."""
        return 1.0 / (1.0 - min(d.p_busy, BUSY_MAX)) if self.busy_period else 1.0

    def p_queue_delay(self, d: Decision, route: Route = Route.PUSH) -> float:
        """How long P's queue alone would hold this request by `route` (remote): its prefill estimate with
        the tokens queued there before it, less the same without them (never below 0: the fit's queue
        slope is not bounded)."""
        return max(self.p_time(route, d, d.p_queue) - self.p_time(route, d, 0.0), 0.0)

    def local_s(self, d: Decision) -> float:
        """D's prefill of this prompt's uncached part, without D's queue."""
        return self.local_line()(d.tokens - d.d_prefix)

    def local_allowed(self, d: Decision) -> bool:
        """Local is a candidate when D's prefill of the uncached part takes at most local_max_s (longer,
        it would stall every request on D, and those arriving during it, that long), or when P's queue
        alone would hold this request at least as long as D's local queue and this prefill would: a
        burst at P, which D's stall then relieves (as Dynamo prefills locally when the prefill queue is
        long). D's queue counts, so that in a long burst D's local work stays below P's backlog. The
        cost still charges the stall."""
        burst = self.p_queue_delay(d) >= self.local_line()(d.d_queue + d.tokens - d.d_prefix)
        return self.local_s(d) <= self.local_max_s or burst

    def choose(self, d: Decision, allowed: tuple[Route, ...] | None = None) -> Decision:
        """Fill in the estimates of every allowed route and pick the cheapest (or explore). Local is
        left out when `local_allowed` says no, unless it is all there is."""
        allowed = allowed or self.routes
        if len(allowed) > 1 and not self.local_allowed(d):
            allowed = tuple(r for r in allowed if r is not Route.LOCAL)
        d.estimates_s = {r.value: self.estimate(r, d) for r in allowed}
        self.decisions += 1
        d.costs_s = {r.value: self.cost(r, d) for r in allowed}
        explore, tie = self.to_explore(allowed, d.costs_s), self.tied(allowed, d.costs_s)
        d.route = explore or tie or self.cheapest(allowed, d.costs_s, incumbent_key(d))
        d.reason = ("forced" if d.forced else "only" if len(allowed) == 1 else "explore" if explore
                    else "near-tie" if tie else "cheapest")
        self.taken_at[d.route] = self.decisions
        return d

    def cheapest(self, allowed: tuple[Route, ...], costs: dict[str, float], key: tuple[int, bool]) -> Route:
        """Local if it is allowed and no remote route is cheaper (the margin plays no part there); else the
        remote route to take: the cheapest, a remote route other than the incumbent of the request's
        size class (`key`, incumbent_key: the remote route the last free choice between remote routes
        for a request of that class settled on; push at first) counted switch_margin dearer, since the
        fits tell remote routes apart only to about their error. Only a choice between two or more remote
        routes settles the incumbent: a route the client forced (the only one allowed) never does."""
        remote = [r for r in allowed if r.remote]
        if Route.LOCAL in allowed and (not remote or costs["local"] <= min(costs[r.value] for r in remote)):
            return Route.LOCAL
        incumbent = self.incumbent(key)
        incumbent = incumbent if incumbent in remote else None

        def ranked(r: Route) -> float:
            return costs[r.value] * (1.0 + self.switch_margin if incumbent not in (None, r) else 1.0)
        best = min(remote, key=ranked)
        if len(remote) > 1:
            self.incumbents[key] = best
        return best

    def incumbent(self, key: tuple[int, bool]) -> Route | None:
        """The remote route requests of size class `key` settled on (push, the priors' first, until one did)."""
        return self.incumbents.get(key, Route.PUSH if Route.PUSH in self.routes else None)

    def tied(self, allowed: tuple[Route, ...], costs: dict[str, float]) -> Route | None:
        """A remote route whose cost is within near_tie of the cheapest's (a remote route) and that no
        decision took for TIE_EVERY decisions, the one taken least recently; else None. The fits know
        the differences between remote routes only to about that much (a route taken alone for a
        while is estimated 10-20% low, the others rest on older samples), so a near tie is settled by
        measuring both: each near-tied route gets a sample at least every TIE_EVERY decisions, and a
        wrong ranking corrects itself within a few of them instead of in ~160 (the explore rate)."""
        if self.near_tie <= 0 or len(allowed) < 2:
            return None
        best = min(allowed, key=lambda r: costs[r.value])
        limit = costs[best.value] * (1.0 + self.near_tie)
        ties = [r for r in allowed if r.remote and r is not best and costs[r.value] <= limit
                and self.decisions - self.taken_at[r] >= TIE_EVERY]
        if not best.remote or not ties:
            return None
        return min(ties, key=lambda r: (self.taken_at[r], costs[r.value]))

    def to_explore(self, allowed: tuple[Route, ...], costs: dict[str, float]) -> Route | None:
        """The route this decision explores, or None (see the module docstring); ties go to the cheaper."""
        if len(allowed) < 2:
            return None
        least = min(self.samples[r] for r in allowed)
        stale = self.decisions - min(self.taken_at[r] for r in allowed) > STALE_AFTER
        every = EXPLORE_EVERY if least < WELL_MEASURED or stale else EXPLORE_EVERY_LATER
        if self.decisions % every:
            return None
        if least < WELL_MEASURED:
            return min(allowed, key=lambda r: (self.samples[r], costs[r.value]))
        return min(allowed, key=lambda r: (self.taken_at[r], self.samples[r], costs[r.value]))

    # ---- learning ------------------------------------------------------------------------
    def observe(self, d: Decision, out: Outcome) -> float | None:
        """Learn from one finished request; returns measured / estimated TTFT (None if unmeasured)."""
        if out.prompt_tokens is not None and d.key is not None and d.key.exact_tokens is None and d.key.chars:
            ratio = out.prompt_tokens / d.key.chars
            self.tokens_per_char += 0.1 * (ratio - self.tokens_per_char)
        tokens = float(out.prompt_tokens) if out.prompt_tokens is not None else d.tokens
        moved = tokens - (out.d_cached_tokens if out.d_cached_tokens is not None else d.d_prefix)
        if out.ttft_s is None or not math.isfinite(out.ttft_s):
            return None
        self.samples[d.route] += 1
        if d.route is Route.LOCAL:
            if out.d_time_s is not None:
                self.local.add(d.d_queue + moved, out.d_time_s)
        elif out.p_time_s is not None:
            own = tokens - d.p_prefix
            self.prefill.add(own, d.p_queue / QUEUE_UNIT, out.p_time_s, d.route.value, (d.pair[0], ""), own)
            self.rest_fit(d).add(moved, d.d_running, max(out.ttft_s - out.p_time_s, 0.0), d.route.value, d.pair)
            if out.p_after_s is not None:
                self.after.add(moved, 0.0, out.p_after_s, d.route.value, ("", ""), moved)
        est = d.estimates_s.get(d.route.value)
        if not (est and math.isfinite(est) and est > 0):
            return None
        queue = d.queue_s.get(d.route.value, 0.0)
        own, measured_own = est - queue, out.ttft_s - queue
        if own > 0 and measured_own > 0:  # the fits' error on the own part, without the correction made then
            log_ratio = math.log(measured_own / own) + d.residuals.get(d.route.value, 0.0)
            self.residual.add(residual_key(d.route, d), log_ratio)
        return out.ttft_s / est
