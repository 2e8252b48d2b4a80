"""A transfer's record in the ledger (ledger.py): its states, the legal transitions, the record.

States and who moves a record between them (P = prefill side, D = decode side)::

    PREFILLED   P: prefill finished, blocks held under a lease; no registration yet (push) or
                   waiting for D's READ (pull)                               on_prefill_done
    REGISTERED  P: D's PushReg arrived before prefill finished               on_registration
                D: blocks allocated and registered with P, waiting for Done  register
    MATCHED     P: both halves present: the writer posts the WRITE, once     on_prefill_done / on_registration
                D (pull): P's blocks known, D posts the READ                 register(remote_block_ids=...)
    POSTED      the WRITE (P, push) or READ (D, pull) is in flight           mark_posted
    DONE        P: WRITE done / ReadDone / Release: free P's blocks          mark_done, on_notification
                D: Done received (push) or READ done (pull): decode
    FAILED      a local error (mark_failed) or the peer's Fail / Abort
    EXPIRED     the deadline (D) or lease (P) passed                         expire

``TRANSITIONS`` is the whole table; a record is an immutable snapshot. Every move to FAILED or
EXPIRED is counted by its ``FailureKind`` (``kvpush_kv_transfer_failures_total{reason}``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from kvpush.config import Role
from kvpush.errors import TransferError


class LedgerError(TransferError):
    """An internal caller asked for a transition the table does not allow."""


class TransferState(StrEnum):
    PREFILLED = "prefilled"
    REGISTERED = "registered"
    MATCHED = "matched"
    POSTED = "posted"
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL


class FailureKind(StrEnum):
    """Why a transfer ended FAILED or EXPIRED (the `reason` label of the failure counter)."""

    DEADLINE = "deadline"  # D's deadline or P's lease passed (EXPIRED, or matched too late)
    POSTED_LATE = "posted_late"  # our WRITE / READ was posted after the deadline (a stalled thread)
    PEER_FAIL = "peer_fail"  # the peer sent Fail
    PEER_ABORT = "peer_abort"  # the peer sent Abort
    CANCELLED = "cancelled"  # our request ended first (client gone, aborted, proxy cancelled it)
    ERROR = "error"  # a local error: handshake, post or transfer failure, bad registration
    SHUTDOWN = "shutdown"  # this instance shut down with the transfer still live (drain timeout)


S = TransferState
_TERMINAL = frozenset({S.DONE, S.FAILED, S.EXPIRED})
TRANSITIONS: dict[TransferState, frozenset[TransferState]] = {
    S.PREFILLED: frozenset({S.MATCHED, S.DONE, S.FAILED, S.EXPIRED}),
    S.REGISTERED: frozenset({S.MATCHED, S.DONE, S.FAILED, S.EXPIRED}),
    S.MATCHED: frozenset({S.POSTED, S.FAILED, S.EXPIRED}),
    S.POSTED: frozenset({S.DONE, S.FAILED, S.EXPIRED}),
    **dict.fromkeys(_TERMINAL, frozenset()),
}
INITIAL_STATES: dict[Role, frozenset[TransferState]] = {
    # DONE / FAILED: tombstones of a Release / Abort / Fail that came before the request.
    Role.PREFILL: frozenset({S.PREFILLED, S.REGISTERED, S.DONE, S.FAILED}),
    Role.DECODE: frozenset({S.REGISTERED, S.MATCHED}),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferRecord:
    transfer_id: str
    side: Role
    state: TransferState
    request_id: str | None
    peer_engine_id: str | None
    local_block_ids: tuple[int, ...] = ()
    remote_block_ids: tuple[int, ...] = ()
    has_local: bool = False  # P: prefill done; D: always
    has_remote: bool = False  # P: PushReg applied; D (pull): P's blocks known
    num_tokens: int | None = None
    num_prefix_tokens: int = 0
    deadline: float
    peer_deadline: float | None = None  # P: the PushReg's deadline; the tombstone outlives it
    created_at: float
    updated_at: float
    posted_at: float | None = None
    first_token_id: int | None = None
    num_bytes: int = 0
    num_descs: int = 0
    error: str | None = None
    in_flight_confirmed: bool = False  # D: nothing can still write into local_block_ids
    quarantine_until: float | None = None  # D: FAILED / EXPIRED only
    quarantine_released: bool = False

    @property
    def is_terminal(self) -> bool:
        return self.state in _TERMINAL

    @property
    def is_quarantined(self) -> bool:
        return self.quarantine_until is not None and not self.quarantine_released


@dataclass(slots=True)
class LedgerCounters:
    ignored_unknown: int = 0
    ignored_stale: int = 0
    ignored_foreign: int = 0
    ignored_unexpected: int = 0  # a message that makes no sense for this side or state
    duplicates: int = 0
    early: int = 0  # P: Release / Abort / Fail before the request was known
    confirmations: int = 0  # D: peer said nothing is in flight for a quarantined transfer
    failures: dict[FailureKind, int] = field(default_factory=lambda: dict.fromkeys(FailureKind, 0))
