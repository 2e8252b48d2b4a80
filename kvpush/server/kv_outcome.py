"""What a finished auto request's answer tells the cost model (kv_choice.CostModel.observe): its TTFT,
P's and D's parts of it, and the prompt's tokens and D's cached ones, from the answer's merged trace."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Outcome:
    """What a finished request's answer says (None: not stamped)."""

    ttft_s: float | None
    p_time_s: float | None
    d_time_s: float | None  # D's api_received -> first token
    prompt_tokens: int | None
    d_cached_tokens: int | None


def outcome(trace: dict | None, prompt: dict | None) -> Outcome:
    """A finished request's Outcome from its merged kvpush_trace (the proxy's, P's p_-prefixed and D's
    stamps) and D's kvpush_prompt ({"tokens", "cached_tokens"})."""
    t = trace if isinstance(trace, dict) else {}
    p = prompt if isinstance(prompt, dict) else {}

    def span(a: str, b: str) -> float | None:
        x, y = t.get(a), t.get(b)
        ok = isinstance(x, (int, float)) and isinstance(y, (int, float)) and y >= x
        return float(y - x) if ok else None  # type: ignore[operator]

    proxy_part, d_part = span("proxy_received", "d_leg_sent"), span("api_received", "first_token")
    ttft = proxy_part + d_part if proxy_part is not None and d_part is not None else None
    tokens, cached = p.get("tokens"), p.get("cached_tokens")
    return Outcome(ttft, span("p_api_received", "p_prefill_done"), d_part,
                   tokens if isinstance(tokens, int) else None, cached if isinstance(cached, int) else None)
