"""One engine request as seen by the API process: token deltas in, text events out.

    submitted -> streaming events (text deltas) -> finished (stop | length | abort) or failed
A stop string found by the detokenizer finishes the request here and aborts it in the engine.
A caller that stops iterating (client gone) aborts the engine request in `finally`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field

from kvpush.engine.sampling_params import SamplingParams
from kvpush.errors import KVPushError
from kvpush.instance import messages as m
from kvpush.instance.engine_client import EngineClient
from kvpush.instance.metrics import ServerMetrics
from kvpush.models.tokenizer import IncrementalDetokenizer, Tokenizer
from kvpush.protocol.kv_params import PrefillResult, RequestLegParams
from kvpush.protocol.trace import Trace


class EngineRequestError(KVPushError):
    """The engine failed a request; `status` is the HTTP status to answer with, `shed` the reason
    when admission control refused it (engine/admission.py: 429 or 503 with Retry-After)."""

    def __init__(self, message: str, status: int, shed: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.shed = shed


@dataclass
class GenEvent:
    text: str
    token_ids: list[int]
    logprobs: list[m.LogprobEntry]
    finish_reason: str | None = None
    text_offset: int = 0  # where `text` starts in the choice's whole text


@dataclass
class GenState:
    """Accumulated result of one request (one choice)."""

    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[m.LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: PrefillResult | None = None
    trace: Trace | None = None  # the engine's, with the request's last output
    stamps: Trace = field(default_factory=Trace)  # the API process's own
    queue: asyncio.Queue | None = None  # set by submit(): the engine knows the request from then on
    submitted_at: float = 0.0


class Generator:
    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics

    def submit(self, state: GenState, params: SamplingParams, kv_transfer_params: RequestLegParams | None = None) -> None:
        """Hand the request to the engine now (synchronously, so admission control counts it at once)."""
        if state.queue is None:
            state.submitted_at = time.monotonic()
            state.queue = self.engine.add(m.AddRequest(state.request_id, state.prompt_token_ids, params,
                                                       kv_transfer_params))

    def release(self, states: list[GenState]) -> None:
        """Abort submitted requests whose stream never ran to its end (the handler was cancelled)."""
        for state in states:
            if state.queue is not None and state.finish_reason is None:
                self.engine.abort(state.request_id)
                state.finish_reason = "abort"

    async def stream(self, state: GenState, params: SamplingParams,
                     kv_transfer_params: RequestLegParams | None = None) -> AsyncGenerator[GenEvent, None]:
        """Yield text events until the request finishes. Raises EngineRequestError on failure."""
        self.submit(state, params, kv_transfer_params)
        queue = state.queue
        assert queue is not None
        detok = IncrementalDetokenizer(self.tokenizer, list(params.stop))
        start, first = state.submitted_at, None
        try:
            while state.finish_reason is None:
                delta = await queue.get()
                if delta.finish_reason == "error":
                    state.finish_reason = "error"
                    raise EngineRequestError(delta.error or "request failed", delta.error_status, delta.shed)
                if first is None and delta.new_token_ids:
                    first = time.monotonic()
                    state.stamps.api_got = self.engine.first_received.get(state.request_id, 0.0)
                    state.stamps.api_dequeued = time.time()
                yield self._apply(state, delta, detok)
        finally:
            self.engine.first_received.pop(state.request_id, None)
            if state.finish_reason is None:
                self.engine.abort(state.request_id)
                state.finish_reason = "abort"
            self._observe(state, start, first)

    def _apply(self, state: GenState, delta: m.RequestDelta, detok: IncrementalDetokenizer) -> GenEvent:
        state.token_ids += delta.new_token_ids
        state.logprobs += delta.logprobs
        state.num_cached_tokens = delta.num_cached_tokens
        state.kv_transfer_params = delta.kv_transfer_params or state.kv_transfer_params
        state.trace = delta.trace or state.trace
        text, stopped = detok.update(delta.new_token_ids)
        if stopped:
            self.engine.abort(state.request_id)
            state.finish_reason = "stop"
        elif delta.finish_reason is not None:
            text += detok.flush()
            state.finish_reason = delta.finish_reason
        offset = len(state.text)
        state.text += text
        return GenEvent(text, delta.new_token_ids, delta.logprobs, state.finish_reason, offset)

    def _observe(self, state: GenState, start: float, first: float | None) -> None:
        now = time.monotonic()
        self.metrics.prompt_tokens.inc(len(state.prompt_token_ids))
        self.metrics.generation_tokens.inc(len(state.token_ids))
        ttft = None if first is None else first - start
        self.metrics.observe_request(ttft, now - start, len(state.token_ids), state.finish_reason or "abort")

    async def run(self, state: GenState, params: SamplingParams, kv_transfer_params: RequestLegParams | None = None) -> GenState:
        async with aclosing(self.stream(state, params, kv_transfer_params)) as events:
            async for _ in events:
                pass
        return state
