"""Async load generator for any OpenAI-compatible ``/v1/completions`` server (streaming).

Arrivals follow vLLM's ``benchmark_serving``: the first request is sent at once and the gaps
between requests are gamma-distributed with ``shape=burstiness`` and
``scale=1/(request_rate*burstiness)`` (``burstiness=1`` is a Poisson process; ``request_rate=inf``
sends everything at once). ``max_concurrency`` caps requests in flight with a semaphore; a request
waiting for the semaphore starts its clock only when it is sent (``start_s``), its planned arrival is
``scheduled_s``.

Per request the generator records, relative to the send time:

- TTFT: arrival of the first SSE chunk that carries a token (non-empty ``text``, ``token_ids`` or
  ``logprobs.tokens``).
- ITL: for every later token-carrying chunk, the gap since the previous token-carrying chunk. A
  chunk may carry k > 1 tokens: k is ``len(logprobs.tokens)`` (or ``len(token_ids)``) when the
  server sends them, else 1; the gap is split evenly into k entries of gap/k. Extra tokens in the
  *first* chunk add no ITL entry. So ``sum(itl) = last token chunk - first token chunk``. A server
  that packs several tokens into a chunk without saying so yields one ITL entry per chunk; TPOT,
  which uses ``usage.completion_tokens``, stays exact.
- E2E: from send to ``data: [DONE]``; output/prompt tokens from the final ``usage`` chunk
  (``stream_options.include_usage``), falling back to the counted tokens and the sample's length.
- ``kvpush_trace``: the server-side timestamps dict from any chunk or choice (the last one wins), stored raw;
  with ``sent_unix`` and ``first_chunk_unix`` (the client's wall clock at send and at the first token
  chunk) it gives the request's critical path (``kvpush.bench.trace``); ``kvpush_route`` (an auto proxy's
  route and estimates) likewise.

A request succeeds when the server answers 200, streams at least one token and ends with
``[DONE]``; HTTP errors, error chunks, dropped connections and timeouts are recorded as failures
with their text, never raised. The run is bounded: a fixed number of requests, each with a timeout.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import aiohttp
import msgspec
import numpy as np
from tqdm import tqdm

from kvpush.bench.datasets import Sample
from kvpush.bench.metrics import RequestRecord

__all__ = [
    "BenchmarkAborted",
    "LoadConfig",
    "RequestRecord",
    "RunResult",
    "arrival_times",
    "chunk_tokens",
    "fetch_model",
    "request_body",
    "run_load",
    "run_load_sync",
]

COMPLETIONS_PATH = "/v1/completions"
MAX_ERROR_CHARS = 500


class BenchmarkAborted(RuntimeError):
    """The run cannot go on: every warm-up request failed (the text says why)."""


class RunResult(msgspec.Struct, kw_only=True):
    """All measured requests of one run (warm-ups excluded) and the run's wall duration."""

    records: list[RequestRecord]
    duration_s: float
    started_at_unix: float
    warmups: int = 0
    warmup_failed: int = 0


@dataclass(frozen=True)
class LoadConfig:
    """How to send the load; see the module docstring for the semantics."""

    base_url: str
    model: str
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    ignore_eos: bool = False
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 600.0
    progress: bool = True
    kv_route: str | None = None  # sent as X-KVPush-KV-Mode: a --kv-mode auto proxy then takes this route


class _StreamError(Exception):
    """The server reported an error inside the stream, or the stream was malformed."""


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Planned send offsets (s) of ``n`` requests: 0 for the first, then gamma-distributed gaps."""
    if n <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request_rate and burstiness must be > 0, got {request_rate}, {burstiness}")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def request_body(sample: Sample, cfg: LoadConfig) -> dict[str, Any]:
    """The JSON body of one streaming completion request."""
    return {
        "model": cfg.model,
        "prompt": sample.prompt,
        "max_tokens": sample.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": cfg.ignore_eos,
    }


def _headers(api_key: str | None, kv_route: str | None = None) -> dict[str, str]:
    """Request headers, with a bearer token when an API key is set, and the route an auto proxy must
    take when one is named."""
    headers = {"Content-Type": "application/json"}
    if kv_route:
        headers["X-KVPush-KV-Mode"] = kv_route
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def chunk_tokens(choice: Any) -> int:
    """Number of tokens one streamed choice carries (see the module docstring)."""
    if not isinstance(choice, dict):
        return 0
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):
        return len(logprobs["tokens"])
    if isinstance(choice.get("token_ids"), list):
        return len(choice["token_ids"])
    return 1 if choice.get("text") else 0


class _StreamState:
    """Accumulates the timing of one streamed response."""

    def __init__(self, record: RequestRecord, t_send: float) -> None:
        self.record = record
        self.t_send = t_send
        self.last_token_t: float | None = None
        self.counted = 0
        self.usage: dict[str, Any] = {}
        self.wall = 0.0  # time.time() read together with the current chunk's perf_counter()

    def on_chunk(self, chunk: Any, now: float) -> None:
        """Update the record from one decoded SSE ``data:`` payload received at ``now``."""
        if not isinstance(chunk, dict):
            raise _StreamError(f"unexpected SSE payload: {str(chunk)[:100]}")
        if chunk.get("error"):
            raise _StreamError(f"error in stream: {str(chunk['error'])[:MAX_ERROR_CHARS]}")
        for holder in [chunk, *(c for c in chunk.get("choices") or [] if isinstance(c, dict))]:
            if isinstance(holder.get("kvpush_trace"), dict):  # kvpush puts it in the final choice
                self.record.kvpush_trace = holder["kvpush_trace"]
            if isinstance(holder.get("kvpush_route"), dict):
                self.record.kvpush_route = holder["kvpush_route"]
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        tokens = sum(chunk_tokens(c) for c in chunk.get("choices") or [])
        if tokens:
            self._on_tokens(tokens, now)

    def _on_tokens(self, tokens: int, now: float) -> None:
        """Attribute TTFT or ITL entries to a chunk carrying ``tokens`` tokens."""
        if self.last_token_t is None:
            self.record.ttft_s = now - self.t_send
            self.record.first_chunk_unix = self.wall or time.time()
        else:
            gap = (now - self.last_token_t) / tokens
            self.record.itl_s.extend([gap] * tokens)
        self.last_token_t = now
        self.counted += tokens

    def finish(self, now: float) -> None:
        """Mark the record successful after ``[DONE]`` at ``now``."""
        rec = self.record
        if rec.ttft_s is None:
            raise _StreamError("stream ended without any token")
        rec.e2el_s = now - self.t_send
        rec.output_tokens = int(self.usage.get("completion_tokens") or self.counted)
        rec.prompt_tokens = int(self.usage.get("prompt_tokens") or rec.prompt_len)
        rec.success = True


async def _consume(resp: aiohttp.ClientResponse, state: _StreamState) -> None:
    """Read the SSE stream until ``[DONE]``; raise ``_StreamError`` if it ends early."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        now, state.wall = perf_counter(), time.time()
        if payload == b"[DONE]":
            state.finish(now)
            return
        state.on_chunk(msgspec.json.decode(payload), now)
    raise _StreamError("stream ended before data: [DONE]")


class _Client:
    """Sends requests over one aiohttp session and records them."""

    def __init__(self, session: aiohttp.ClientSession, cfg: LoadConfig) -> None:
        self.session = session
        self.cfg = cfg
        self.url = cfg.base_url.rstrip("/") + COMPLETIONS_PATH
        self.headers = _headers(cfg.api_key, cfg.kv_route)

    async def send(self, index: int, sample: Sample, t0: float, scheduled_s: float = 0.0) -> RequestRecord:
        """Send one request now and return its record; never raises for request failures."""
        rec = RequestRecord(index=index, prompt_len=sample.prompt_len, output_len=sample.output_len)
        rec.scheduled_s = scheduled_s
        rec.sent_unix = time.time()
        t_send = perf_counter()
        rec.start_s = t_send - t0
        try:
            await asyncio.wait_for(self._post(sample, rec, t_send), timeout=self.cfg.timeout_s)
        except TimeoutError:
            rec.error = f"timeout after {self.cfg.timeout_s:g} s"
        except Exception as exc:  # every failure is recorded, none ends the run
            rec.error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS] or type(exc).__name__
        if rec.error:
            rec.success = False
        return rec

    async def _post(self, sample: Sample, rec: RequestRecord, t_send: float) -> None:
        """POST the request and consume the stream into ``rec``."""
        body = request_body(sample, self.cfg)
        async with self.session.post(self.url, json=body, headers=self.headers) as resp:
            rec.status, rec.status_s = resp.status, perf_counter() - t_send
            if resp.status != 200:
                text = await resp.text(errors="replace")
                rec.error = f"HTTP {resp.status}: {text[:MAX_ERROR_CHARS]}"
                return
            await _consume(resp, _StreamState(rec, t_send))


async def _guarded(sem: asyncio.Semaphore | None, coro_fn: Any, *args: Any) -> RequestRecord:
    """Run ``coro_fn(*args)`` under the concurrency semaphore, if any."""
    if sem is None:
        return await coro_fn(*args)
    async with sem:
        return await coro_fn(*args)


async def _warmup(client: _Client, samples: list[Sample], sem: asyncio.Semaphore | None) -> int:
    """Send ``cfg.num_warmups`` requests cycling over ``samples``, all at once under the semaphore.

    They are excluded from the results; returns how many failed.
    """
    n = client.cfg.num_warmups
    if n <= 0:
        return 0
    t0 = perf_counter()
    tasks = [_guarded(sem, client.send, -1 - i, samples[i % len(samples)], t0) for i in range(n)]
    records = await asyncio.gather(*tasks)
    failed = [r for r in records if not r.success]
    if len(failed) == n:
        raise BenchmarkAborted(f"all {n} warm-up requests failed; first error: {failed[0].error}")
    return len(failed)


async def _measure(client: _Client, samples: list[Sample], sem: asyncio.Semaphore | None) -> RunResult:
    """Send every sample at its planned arrival time and wait for all of them."""
    cfg = client.cfg
    offsets = arrival_times(len(samples), cfg.request_rate, cfg.burstiness, cfg.seed)
    bar = tqdm(total=len(samples), disable=not cfg.progress, desc="requests", leave=False)

    async def one(i: int, sample: Sample, offset: float) -> RequestRecord:
        rec = await _guarded(sem, client.send, i, sample, t0, offset)
        bar.update(1)
        return rec

    started_at = time.time()
    t0 = perf_counter()
    tasks = []
    for i, (sample, offset) in enumerate(zip(samples, offsets, strict=True)):
        delay = t0 + offset - perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, sample, offset)))
    records = await asyncio.gather(*tasks)
    duration = perf_counter() - t0
    bar.close()
    return RunResult(records=list(records), duration_s=duration, started_at_unix=started_at)


async def run_load(
    samples: list[Sample], cfg: LoadConfig, warmup_samples: list[Sample] | None = None
) -> RunResult:
    """Run warm-ups, then the measured requests; raise ``BenchmarkAborted`` if all warm-ups fail.

    Warm-ups use ``warmup_samples`` (default: ``samples``; prompts distinct from the measured ones
    keep a prefix cache from flattering the first measured requests).
    """
    if not samples:
        raise ValueError("no samples to send")
    if cfg.max_concurrency is not None and cfg.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {cfg.max_concurrency}")
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    connector = aiohttp.TCPConnector(limit=cfg.max_concurrency or 0)
    no_timeout = aiohttp.ClientTimeout(total=None)  # each request has its own (cfg.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=no_timeout) as session:
        client = _Client(session, cfg)
        warmup_failed = await _warmup(client, warmup_samples or samples, sem)
        result = await _measure(client, samples, sem)
    result.warmups = cfg.num_warmups
    result.warmup_failed = warmup_failed
    return result


def run_load_sync(
    samples: list[Sample], cfg: LoadConfig, warmup_samples: list[Sample] | None = None
) -> RunResult:
    """``run_load`` in a fresh event loop."""
    return asyncio.run(run_load(samples, cfg, warmup_samples))


async def fetch_model(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """The first model id listed by ``GET /v1/models``; raises ``BenchmarkAborted`` on failure."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(url, headers=_headers(api_key)) as resp:
                if resp.status != 200:
                    raise BenchmarkAborted(f"GET {url} answered HTTP {resp.status}")
                data = await resp.json(content_type=None)
        return str(data["data"][0]["id"])
    except (aiohttp.ClientError, TimeoutError, KeyError, IndexError, TypeError, ValueError) as exc:
        raise BenchmarkAborted(f"cannot list models at {url}: {type(exc).__name__}: {exc}") from exc
