"""Admission control: whether an instance takes a new request now or sheds it at once.

An overloaded instance answers early and explicitly (HTTP 429 with Retry-After) instead of queueing
without bound. A request is shed when, counting it:

    queue_full        more requests would wait beyond a full running batch (`--max-num-seqs`) than
                      `max_waiting` (requests parked while their KV arrives from a peer do not count:
                      each holds its blocks, so the KV cache bounds them). Counted against a full
                      batch, not the batch of the moment, so that a burst into an idle instance is
                      not shed for what the next step would have run.
    queue_tokens_full more prompt tokens would wait for their first token than `max_waiting_tokens`:
                      the prefill work ahead of a new request, what its TTFT waits for (a decode
                      leg's prompt is its prefill peer's work and does not count; never shed when
                      nothing else waits: a single prompt is bounded by the model)
    kv_cache_full     the KV cache cannot hold it: its blocks (prompt + first token) exceed the free
                      blocks after the blocks every admitted request still needs for its prompt and
                      next token, less `kv_headroom` of the cache while requests are running (kept
                      for the running batch's growth)

The same decision runs twice: in the API process on its last engine stats plus what it sent since
(milliseconds, whatever the engine is doing), and in the engine core on its exact state when the
request arrives there (which bounds the engine's own queue). No I/O: plain Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from kvpush.config import AdmissionConfig


class ShedReason(StrEnum):
    """Why a request was refused; the error body's `code` and the shed counter's `reason` label."""

    QUEUE_FULL = "queue_full"
    QUEUE_TOKENS_FULL = "queue_tokens_full"
    KV_CACHE_FULL = "kv_cache_full"
    UNAVAILABLE = "unavailable"  # the instance cannot serve at all (engine not running): 503

    @property
    def status(self) -> int:
        return 503 if self is ShedReason.UNAVAILABLE else 429


@dataclass(frozen=True)
class Load:
    """What admission looks at: one instance's queue and KV cache."""

    num_waiting: int  # requests beyond a full running batch (not counting those parked for remote KV)
    waiting_tokens: int  # prompt tokens of requests that have no output token yet, computed here
    num_running: int
    free_blocks: int
    reserved_blocks: int  # blocks admitted requests still need for their prompt and next token
    total_blocks: int


@dataclass(frozen=True)
class Shed:
    reason: ShedReason
    message: str

    @property
    def status(self) -> int:
        return self.reason.status


def blocks_for(num_prompt_tokens: int, block_size: int) -> int:
    """Blocks a new request needs to start: its prompt and its first output token."""
    return -(-(num_prompt_tokens + 1) // block_size)


def decide(cfg: AdmissionConfig, load: Load, prompt_lens: list[int], block_size: int) -> Shed | None:
    """None to admit the request (its prompts, of these lengths); else why it is shed."""
    n, tokens = len(prompt_lens), sum(prompt_lens)
    if load.num_waiting + n > cfg.max_waiting:
        return Shed(ShedReason.QUEUE_FULL, f"server overloaded: {load.num_waiting} requests are waiting "
                    f"(--max-waiting {cfg.max_waiting})")
    if load.waiting_tokens > 0 and load.waiting_tokens + tokens > cfg.max_waiting_tokens:
        return Shed(ShedReason.QUEUE_TOKENS_FULL, f"server overloaded: {load.waiting_tokens} prompt tokens are "
                    f"waiting, this request adds {tokens} (--max-waiting-tokens {cfg.max_waiting_tokens})")
    need = sum(blocks_for(p, block_size) for p in prompt_lens)
    keep = math.ceil(cfg.kv_headroom * load.total_blocks) if load.num_running else 0
    room = load.free_blocks - load.reserved_blocks - keep
    if need > room:
        return Shed(ShedReason.KV_CACHE_FULL, f"KV cache full: this request needs {need} blocks, "
                    f"{max(room, 0)} of {load.total_blocks} are free for new requests (--kv-headroom {cfg.kv_headroom:g})")
    return None
