"""The KV connector interface: how an engine of a prefill or decode instance hands KV to its peer.

All methods are called by the engine thread (the step loop of the engine-core process); none of
them blocks on the network. NIXL work happens on the transfer thread, which the connector feeds
with commands and whose events it applies in `poll`.

Block ownership: the block manager owns every block. A connector may *hold* blocks (keep their
reference after the request that used them is gone): P holds a finished prefill's blocks until
its transfer is DONE, FAILED or EXPIRED; D holds the blocks of a failed transfer while they are
quarantined. Held blocks go back to the block manager only through `poll` (a FreeBlocks event).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from kvpush.engine.request import Request
from kvpush.transfer.stats import TransferStats

if TYPE_CHECKING:
    from kvpush.engine.engine import LLMEngine


class KVConnector(ABC):
    engine: LLMEngine

    def attach(self, engine: LLMEngine) -> None:
        """Called once by the engine's constructor, before any request."""
        self.engine = engine

    @abstractmethod
    def on_add(self, request: Request, kv_transfer_params: dict | None) -> None:
        """Called by `add_request` before the request is queued. Parses the leg's parameters into
        `request.kv_state`. Raises InvalidRequestError for bad or missing parameters."""

    def admit(self, request: Request) -> bool:
        """Called for the head of the waiting queue before it is scheduled. Returns False to keep it
        waiting (e.g. no blocks yet). May park the request (WAITING_FOR_REMOTE_KV) after
        allocating its blocks: the scheduler then moves on to the next waiting request."""
        return True

    def before_forward(self, scheduled: list[tuple[Request, int]]) -> None:
        """Called with each step's batch right before the forward pass (layer-wise push installs a
        per-layer hook on the model runner here). Must not block."""
        return None

    def on_finished(self, request: Request) -> bool:
        """Called when the request leaves the scheduler, before its blocks are freed. Returns True if
        the connector took over the request's blocks (then `request.block_table` is emptied by it)."""
        return False

    @abstractmethod
    def poll(self) -> list[Request]:
        """Called at the start of every engine step and when the step loop is woken. Applies the
        transfer thread's events; returns requests that got an output token or finished here."""

    def has_events(self) -> bool:
        """True if the transfer thread left events that `poll` has not applied yet."""
        return False

    @abstractmethod
    def stats(self) -> TransferStats:
        """A snapshot of the transfer metrics (called from the engine thread)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the transfer thread and the side channel; release NIXL resources."""

    @property
    def kv_address(self) -> str | None:
        """host:port of this instance's side channel, published to the proxy."""
        return None

    @property
    def engine_id(self) -> str:
        return ""
