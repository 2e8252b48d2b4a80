"""What one request's dispatch is made of in the proxy: the P and D legs (Dispatch, Leg), the ways a leg
fails (LegError, DecodeUnavailable, PrefillFailed), and the body and trace helpers around them."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp

from kvpush.config import FirstToken, KVMode
from kvpush.protocol.trace import Trace
from kvpush.proxy.auto.records import Decision
from kvpush.proxy.pool import Instance

if TYPE_CHECKING:
    from kvpush.proxy.first_token import PrefillAnswer

log = logging.getLogger("kvpush.proxy")
TRACE_WAIT_S = 1.0  # push: how long D's final chunk may wait for P's answer to merge P's stamps


class LegError(Exception):
    """One leg answered with an error; carries the status, body and Retry-After to give the client,
    and which instance answered it."""

    def __init__(self, status: int, body: bytes, instance: Instance | None = None,
                 retry_after: str | None = None) -> None:
        super().__init__(f"leg failed with {status}")
        self.status = status
        self.body = body
        self.instance = instance
        self.retry_after = retry_after

    @property
    def shed(self) -> bool:
        """The instance refused the request for lack of capacity (or is unavailable): another may not."""
        return self.status in (429, 503) and self.instance is not None


class DecodeUnavailable(Exception):
    """The decode instance refused the leg because it drains, or could not be connected to: nothing
    was sent to it, so another decode instance may serve the request."""

    def __init__(self, error: LegError, reason: str) -> None:
        super().__init__(str(error))
        self.error = error
        self.reason = reason


class PrefillFailed(Exception):
    """The prefill leg failed on the instance's side (unreachable, 5xx): worth another instance."""

    def __init__(self, error: LegError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class Dispatch:
    prefill: Instance | None  # None: D prefills the prompt itself (auto's local route)
    decode: Instance
    transfer_id: str
    first_token: FirstToken
    mode: KVMode  # how the KV moves (a leg's mode: never auto)
    trace: Trace = field(default_factory=Trace)
    p_task: asyncio.Task | None = None  # push: P's leg, possibly still running after D answered
    decision: Decision | None = None  # auto: the route chosen and why
    # vLLM D: P's first token goes to the client first (first_token.py); P's answer to send, once it came
    first_from_prefill: bool = False
    prefill_answer: PrefillAnswer | None = None

    def headers(self) -> dict[str, str] | None:
        """A first_from_prefill dispatch names both legs alike, so vLLM's two answers carry one id."""
        return {"X-Request-Id": self.transfer_id} if self.first_from_prefill else None


@dataclass
class Leg:
    """One prompt's dispatch whose D answered 200: its answer is still to be read."""

    dispatch: Dispatch
    response: aiohttp.ClientResponse


def seconds(retry_after: str | None) -> float:
    """A Retry-After in seconds (an HTTP date or garbage counts as 1 s)."""
    try:
        return max(0.0, float(retry_after)) if retry_after is not None else 1.0
    except ValueError:
        return 1.0


def merge_trace_json(data: bytes, annotate: Callable[[dict], None]) -> bytes:
    try:
        obj = json.loads(data)
        for choice in obj.get("choices", []):
            if isinstance(choice, dict):
                annotate(choice)
        return json.dumps(obj).encode()
    except (json.JSONDecodeError, AttributeError):
        return data


def merge_trace_line(line: bytes, annotate: Callable[[dict], None]) -> bytes:
    if not line.startswith(b"data: "):
        return line
    return b"data: " + merge_trace_json(line[6:].strip(), annotate) + b"\n"


async def wait_prefill(p_task: asyncio.Task | None) -> None:
    """Push: D may end before P's answer (with P's stamps) arrived; its final chunk, which carries
    the trace, waits for it at most TRACE_WAIT_S (the first token never waits)."""
    if p_task is not None and not p_task.done():
        await asyncio.wait({p_task}, timeout=TRACE_WAIT_S)


def retrieve(task: asyncio.Task) -> None:
    """A P leg that ends after D already answered: its outcome no longer matters to the client."""
    if not task.cancelled() and task.exception() is not None:
        log.info("prefill leg ended after decode answered: %s", task.exception())


async def cancel(*tasks: asyncio.Task) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        try:
            resp = await t
            if isinstance(resp, aiohttp.ClientResponse):
                resp.close()
        except (TimeoutError, asyncio.CancelledError, LegError, PrefillFailed, DecodeUnavailable, aiohttp.ClientError):
            pass  # the failure that made us cancel is reported by the caller

