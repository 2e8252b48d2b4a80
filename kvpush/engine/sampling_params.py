"""Sampling parameters of one request, validated at construction, and what sampling returns per token."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvpush.errors import InvalidRequestError

MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to sample one request. Travels between processes as msgpack, so it is a msgspec Struct.

    temperature 0 means greedy. top_k 0 or -1 means no top-k cut. seed makes sampling reproducible
    per request, independent of the batch it runs in.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per sampled token
    min_tokens: int = 0

    def __post_init__(self) -> None:
        _check(self.max_tokens >= 1, "max_tokens must be at least 1", "max_tokens")
        _check(0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]", "temperature")
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", "top_p")
        _check(self.top_k >= -1, "top_k must be -1, 0 (disabled) or positive", "top_k")
        _check(self.min_tokens >= 0, "min_tokens must be non-negative", "min_tokens")
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed must be in [0, 2**63)", "seed")
        if self.logprobs is not None:
            _check(0 <= self.logprobs <= MAX_LOGPROBS, f"logprobs must be in [0, {MAX_LOGPROBS}]", "logprobs")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty", "stop")
        _check(len(self.stop) <= 16, "at most 16 stop strings", "stop")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative", "stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)


@dataclass
class TokenLogprob:
    """One sampled token's log-probability and the top alternatives (OpenAI `logprobs`)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first
