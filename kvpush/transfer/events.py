"""Events from the transfer thread to the engine thread of one process (a queue, then a wake-up)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FreeBlocks:
    """These blocks of ours are no longer held by a transfer: back to the block manager. The transfer is
    named where one transfer's blocks come back (P's held blocks may be shared by several: prefix-cached);
    D's quarantine releases blocks of several transfers at once, unnamed (each block belongs to one)."""

    block_ids: list[int]
    transfer_id: str | None = None


@dataclass(frozen=True)
class KVReady:
    """D: the transfer's KV has fully landed in the request's blocks."""

    transfer_id: str
    request_id: str
    first_token_id: int | None
    trace: tuple[tuple[str, float], ...] = ()  # P's timestamps carried by Done / Commit


@dataclass(frozen=True)
class KVFailed:
    """D: the transfer failed; its blocks stay quarantined until a FreeBlocks."""

    transfer_id: str
    request_id: str
    reason: str


Event = FreeBlocks | KVReady | KVFailed
