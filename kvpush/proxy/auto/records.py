"""--kv-mode auto's records (choice.py has the cost model): the routes, a request's Decision (what the
proxy saw and chose) and its Outcome (what its answer said: the spans of its merged kvpush_trace, each
taken on one instance's clock or the proxy's, never across two)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from kvpush.protocol.trace import Trace
from kvpush.proxy.auto.prefix import PromptKey


class Route(StrEnum):
    PUSH = "push"
    PUSH_LAYERWISE = "push-layerwise"
    PULL = "pull"
    LOCAL = "local"

    @property
    def remote(self) -> bool:
        return self is not Route.LOCAL


@dataclass
class Decision:
    """One request's choice and what it was based on (kept until its answer teaches the model)."""

    route: Route
    tokens: float
    p_prefix: float
    d_prefix: float
    p_queue: float
    d_queue: float
    d_running: int
    pair: tuple[str, str]
    p_waiting: int = 0
    estimates_s: dict[str, float] = field(default_factory=dict)
    forced: bool = False
    key: PromptKey | None = None
    prefilled: bool = False  # its tokens have left the prefill queue they were counted in
    local_s: float = 0.0  # D's prefill time for it, were it local (the queue not included)
    costs_s: dict[str, float] = field(default_factory=dict)  # what the choice compared
    reason: str = "cheapest"  # cheapest | explore | near-tie | forced | only (no other route allowed)
    residuals: dict[str, float] = field(default_factory=dict)  # the log-ratio corrections in the estimates
    queue_s: dict[str, float] = field(default_factory=dict)  # the queue ahead, in each estimate (not corrected)
    p_busy: float = 0.0  # P's recent busy fraction (the proxy's BusyMeter); used with busy_period

    def to_json(self) -> dict:
        """What the request's answer says about it (`kvpush_route`)."""
        return {"route": self.route.value, "forced": self.forced, "reason": self.reason, "tokens": round(self.tokens),
                "d_prefix_tokens": round(self.d_prefix), "p_prefix_tokens": round(self.p_prefix),
                "p_waiting": self.p_waiting, "p_busy": round(self.p_busy, 3), "d_running": self.d_running,
                "p_queue_tokens": round(self.p_queue), "d_queue_tokens": round(self.d_queue),
                "estimates_ms": {r: round(s * 1e3, 2) for r, s in self.estimates_s.items()},
                "residuals": {r: round(v, 4) for r, v in self.residuals.items()},
                "costs_ms": {r: round(s * 1e3, 2) for r, s in self.costs_s.items()}}


@dataclass
class Outcome:
    """What a finished request's answer says (None: not stamped)."""

    ttft_s: float | None
    p_time_s: float | None  # P's api_received -> prefill done
    d_time_s: float | None  # D's api_received -> first token
    prompt_tokens: int | None
    d_cached_tokens: int | None
    p_after_s: float | None = None  # P's prefill done -> P's answer (P's clock)


def outcome(trace: Trace, prompt: dict | None) -> Outcome:
    """A finished request's Outcome from its merged kvpush_trace (the proxy's, P's p_-prefixed and D's
    stamps) and D's kvpush_prompt ({"tokens", "cached_tokens"}).

    p_after_s: P's prefill done -> P's answer, both on P's clock. P answers without waiting for the
    transfer, but on a core it shares with push's WRITE (on one host UCX's cma has the initiator copy,
    so P's core copies a WRITE and D's a READ): the span grows with what the transfer takes from P.
    """
    p = prompt if isinstance(prompt, dict) else {}

    def span(a: str, b: str) -> float | None:
        x, y = getattr(trace, a), getattr(trace, b)
        return y - x if x is not None and y is not None and y >= x else None

    proxy_part, d_part = span("proxy_received", "d_leg_sent"), span("api_received", "first_token")
    ttft = proxy_part + d_part if proxy_part is not None and d_part is not None else None
    tokens, cached = p.get("tokens"), p.get("cached_tokens")
    return Outcome(ttft, span("p_api_received", "p_prefill_done"), d_part,
                   tokens if isinstance(tokens, int) else None, cached if isinstance(cached, int) else None,
                   span("p_prefill_done", "p_answered"))


def residual_key(route: Route, d: Decision) -> tuple[bool, int, bool]:
    """Whose residual a request's estimate by `route` uses and teaches: remote routes together or local,
    the request's size class, and whether D holds a prefix of it (session turns apart from fresh prompts,
    as the rest fits). One residual for every remote route: per route, each followed only the route's
    own recent answers, taken under whatever load that route last met, and opened gaps of 20-40%
    between remote routes that the fixed modes never showed (replayed: regime_rows15's sessions cells)."""
    return route.remote, size_class(d), d.d_prefix > 0


def incumbent_key(d: Decision) -> tuple[int, bool]:
    """Which incumbent a request's choice between remote routes keeps (`cheapest`): its size class, and
    whether D holds a prefix of it. One for all sizes let the short prompts of a mixed service settle
    the long ones' route: in mixed_chunk19b 106 of 160 1,024-token prompts went by push-layerwise, the
    incumbent the 128-token ones had settled, where the fixed routes' runs had it 12% worse than pull
    on TTFT p99 and 7% on p50 (24 runs a route, ad hoc) and the model's own costs ranked it last."""
    return size_class(d), d.d_prefix > 0


def size_class(d: Decision) -> int:
    """The size class of a request for the residual corrections and the incumbents: the larger of its
    uncached parts (on P or on D) in tokens, to the nearest power of two (128, 512 and 2,048 tokens are
    two classes apart)."""
    return round(math.log2(max(d.tokens - min(d.p_prefix, d.d_prefix), 1.0)))
