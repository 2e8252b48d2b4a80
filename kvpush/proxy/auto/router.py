"""The proxy's side of `--kv-mode auto` (choice.py has the cost model): per instance, the prompts it
was sent (prefix trackers), the prompt tokens still queued for prefill there and the requests waiting
for it; each request's Decision from those, and learning from its answer. No I/O; instances are named
by URL.

A decision's lifecycle: decide (route chosen) -> dispatched (its tokens queued at P, or at D for local)
-> prefilled (P answered, D's first token, or the leg failed: no longer queued; idempotent) ->
[rerouted (pull: another D)] -> finished (the answer's trace teaches the cost model).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvpush.protocol.trace import Trace
from kvpush.proxy.auto.choice import (
    NEAR_TIE,
    RESIDUAL_ALPHA,
    STALL_WEIGHT,
    SWITCH_MARGIN,
    CostModel,
)
from kvpush.proxy.auto.fit import BusyMeter, LocalBudget
from kvpush.proxy.auto.prefix import PrefixTracker, PromptKey, PromptSource
from kvpush.proxy.auto.records import Decision, Route, outcome


class AutoRouter:
    """The proxy's side of --kv-mode auto: decides, keeps the per-instance prefix trackers and queued
    prefill tokens, and learns from answers. Instances are named by URL."""

    def __init__(self, stall_weight: float = STALL_WEIGHT, local_max_s: float = 0.064, local_share: float = 1.0,
                 local_window_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 near_tie: float = NEAR_TIE, residual_alpha: float = RESIDUAL_ALPHA,
                 switch_margin: float = SWITCH_MARGIN, busy_period: bool = False) -> None:
        self.model = CostModel(stall_weight=stall_weight, local_max_s=local_max_s, near_tie=near_tie,
                               residual_alpha=residual_alpha, switch_margin=switch_margin, busy_period=busy_period)
        self.budget = LocalBudget(local_share, local_window_s)
        self.busy = BusyMeter(local_window_s)  # P's busy fraction (the cost model's busy_period)
        self.clock = clock
        self.trackers: dict[str, PrefixTracker] = {}
        self.queued: dict[str, float] = {}  # url -> prompt tokens still to prefill there
        self.waiting: dict[str, int] = {}  # url -> requests whose prefill is still queued or running there
        self.pending: dict[str, int] = {}  # D url -> its requests whose prefill is not done yet

    def tracker(self, url: str) -> PrefixTracker:
        return self.trackers.setdefault(url, PrefixTracker())

    def forget(self, url: str) -> None:
        """The instance restarted: its prefix cache is empty."""
        self.trackers.pop(url, None)

    def decide(self, req: PromptSource, p_url: str | None, d_url: str, d_in_flight: int, block_size: int,
               forced: Route | None = None) -> Decision:
        """The route for this request on this (P, D) pair; no P (none usable): local. d_in_flight: the
        proxy's requests on D (this one not included)."""
        key = PromptKey.of(req, block_size)
        m = self.model
        p_prefix = m.prefix_tokens(key, self.tracker(p_url).matched(key)) if p_url else 0.0
        decoding = max(d_in_flight - self.pending.get(d_url, 0), 0)
        d = Decision(Route.LOCAL, m.tokens(key), p_prefix, m.prefix_tokens(key, self.tracker(d_url).matched(key)),
                     self.queued.get(p_url or "", 0.0), self.queued.get(d_url, 0.0), decoding,
                     (p_url or "", d_url), self.waiting.get(p_url or "", 0), key=key)
        d.local_s = m.local_s(d)
        d.p_busy = self.busy.fraction(p_url, self.clock()) if p_url else 0.0
        if forced is not None:
            d.forced = True
            return m.choose(d, (forced,))
        if not p_url:
            return m.choose(d, (Route.LOCAL,))
        spent = not self.budget.allows(d_url, d.local_s, self.clock())
        return m.choose(d, tuple(r for r in m.routes if r.remote) if spent else m.routes)

    def dispatched(self, d: Decision) -> None:
        """The legs are on their way: count the prefill they queue, remember what each instance holds."""
        p_url, d_url = d.pair
        url = p_url if d.route.remote else d_url
        self.queued[url] = self.queued.get(url, 0.0) + d.tokens
        self.waiting[url] = self.waiting.get(url, 0) + 1
        self.pending[d_url] = self.pending.get(d_url, 0) + 1
        self.busy.set(url, True, self.clock())
        if not d.route.remote:
            self.budget.charge(d_url, d.local_s, self.clock())
        if d.key is not None:
            self.tracker(d_url).record(d.key)
            if d.route.remote:
                self.tracker(p_url).record(d.key)

    def prefilled(self, d: Decision) -> None:
        """P answered (remote) or D's first token exists (local), or the leg failed or ended (the
        proxy's end_leg: a push answer D finished before P's HTTP answer arrived): not queued.
        Idempotent: a decision's tokens leave the queue once."""
        if d.prefilled:
            return
        d.prefilled = True
        url = d.pair[0] if d.route.remote else d.pair[1]
        left = self.queued.get(url, 0.0) - d.tokens
        self.queued[url] = left if left > 1e-6 else 0.0
        self.waiting[url] = max(self.waiting.get(url, 0) - 1, 0)
        self.pending[d.pair[1]] = max(self.pending.get(d.pair[1], 0) - 1, 0)
        self.busy.set(url, self.waiting[url] > 0, self.clock())

    def rerouted(self, d: Decision, d_url: str) -> None:
        """Pull: D refused the leg and another D takes it: learn and track for that one. (The proxy
        reroutes after P answered, so the decision is no longer pending; moving a pending count keeps
        the bookkeeping right for any caller that reroutes earlier.)"""
        if not d.prefilled:
            self.pending[d.pair[1]] = max(self.pending.get(d.pair[1], 0) - 1, 0)
            self.pending[d_url] = self.pending.get(d_url, 0) + 1
        d.pair = (d.pair[0], d_url)
        if d.key is not None:
            self.tracker(d_url).record(d.key)

    def finished(self, d: Decision, trace: Trace, prompt: dict | None) -> float | None:
        """Learn from the answer; measured / estimated TTFT, or None. An answer D recomputed after a
        failed transfer (kv_fallback_local) teaches nothing about its route."""
        if trace.kv_fallback_local is not None:
            return None
        return self.model.observe(d, outcome(trace, prompt))
