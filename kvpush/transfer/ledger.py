"""The transfer ledger: one record per transfer_id, with an explicit state, on each side.

States, transitions and the record: records.py. A transition ``TRANSITIONS`` does not allow,
asked by an internal caller, is a ``LedgerError``. Peer input never raises: a notification with an
unknown, stale (terminal) or foreign (another engine than recorded) transfer_id, or one that makes
no sense in the record's state, is ignored and counted in ``counters``. A duplicate never re-applies.
On D a Commit (layer-wise push: every layer landed) counts as Done.

On P, a PushReg, Release, Abort or Fail may arrive before P has seen the request at all (the proxy
dispatches both legs at once): PushReg creates a REGISTERED record; Release / Abort / Fail create a
terminal tombstone, so that the later ``on_prefill_done`` returns a terminal record and P frees its
blocks at once (counted as ``early``).

On D, the blocks of a FAILED or EXPIRED transfer are quarantined: a WRITE (push) or READ (pull) may
still land in them. They come back from ``release_quarantine`` once nothing can be in flight: the
peer's Fail / Abort / late Done says so (the sender of Fail/Abort has nothing in flight; a Done is
the end of the WRITE), or ``confirm_nothing_in_flight`` does (D's own READ ended), or the quarantine
deadline, max(failure time, transfer deadline) + ``quarantine_s``, passed: nobody posts after the
deadline (``mark_posted`` refuses, matching past it expires), so ``quarantine_s`` only has to cover
how long a posted WRITE / READ can take. Terminal records stay as tombstones for ``tombstone_s``
so a late message is recognized as stale rather than unknown; ``gc`` drops them afterwards.

Threads: the transfer thread owns the ledger, but every public method takes one lock, so reading
metrics from another thread is safe. Records are immutable snapshots. No I/O.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable

from kvpush.config import Role
from kvpush.transfer import protocol as pr
from kvpush.transfer.ledger_index import RecordIndex
from kvpush.transfer.records import (
    TRANSITIONS,
    FailureKind,
    LedgerCounters,
    LedgerError,
    TransferRecord,
    TransferState,
)

S = TransferState

_OUTCOME: dict[type, TransferState] = {pr.Done: S.DONE, pr.Commit: S.DONE, pr.ReadDone: S.DONE,
                                       pr.Release: S.DONE, pr.Fail: S.FAILED, pr.Abort: S.FAILED}
_PEER_KIND: dict[type, FailureKind] = {pr.Fail: FailureKind.PEER_FAIL, pr.Abort: FailureKind.PEER_ABORT}
_ACCEPTED: dict[Role, tuple[type, ...]] = {  # besides PushReg on P
    Role.PREFILL: (pr.Release, pr.Abort, pr.Fail, pr.ReadDone, pr.LeaseRenew),
    Role.DECODE: (pr.Done, pr.Commit, pr.Fail, pr.Abort),
}


class TransferLedger:
    def __init__(self, side: Role, *, tombstone_s: float = 300.0, quarantine_s: float = 60.0,
                 max_lease_s: float = 600.0, clock: Callable[[], float] = time.time) -> None:
        if side not in _ACCEPTED:
            raise ValueError(f"a transfer ledger is kept by a prefill or decode instance, not {side.value}")
        self.side = side
        self.tombstone_s = tombstone_s
        self.quarantine_s = quarantine_s
        self.max_lease_s = max_lease_s
        self._clock = clock
        self._lock = threading.Lock()
        self._records: dict[str, TransferRecord] = {}
        self._index = RecordIndex()  # live, quarantined and tombstone ids, for the timers (ledger_index.py)
        self._owner: dict[int, str] = {}  # D: local block -> transfer holding it (live or quarantined)
        self._counters = LedgerCounters()

    # --- queries ----------------------------------------------------------------------------

    @property
    def counters(self) -> LedgerCounters:
        with self._lock:
            return dataclasses.replace(self._counters, failures=dict(self._counters.failures))

    def get(self, transfer_id: str) -> TransferRecord | None:
        with self._lock:
            return self._records.get(transfer_id)

    def records(self) -> list[TransferRecord]:
        with self._lock:
            return list(self._records.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def count_by_state(self) -> dict[TransferState, int]:
        with self._lock:
            return dict(self._index.by_state)

    def blocks_in_flight(self) -> list[int]:
        """Local blocks of live (non-terminal) transfers."""
        with self._lock:
            return sorted(b for t in self._index.live for b in self._records[t].local_block_ids)

    def quarantined_blocks(self) -> list[int]:
        """D: local blocks of FAILED / EXPIRED transfers not yet released."""
        with self._lock:
            return sorted(b for t in self._index.quarantined for b in self._records[t].local_block_ids)

    # --- P side -----------------------------------------------------------------------------

    def on_prefill_done(self, transfer_id: str, request_id: str, block_ids: Iterable[int],
                        lease_deadline: float, *, peer_engine_id: str | None = None,
                        num_tokens: int | None = None, now: float | None = None) -> TransferRecord:
        """P: prefill finished. Returns PREFILLED (wait), MATCHED (post the WRITE now: only this call
        or one ``on_registration`` ever returns it) or a terminal tombstone (free the blocks now)."""
        now = self._now(now)
        blocks = tuple(block_ids)
        with self._lock:
            self._require_side(Role.PREFILL)
            rec = self._records.get(transfer_id)
            if (rec is not None and not rec.has_local and peer_engine_id is not None
                    and rec.peer_engine_id not in (None, peer_engine_id)):
                self._counters.ignored_foreign += 1  # an early record from another D than expected
                self._drop(transfer_id)
                rec = None
            if rec is None:
                self._claim(blocks, transfer_id)
                return self._put(TransferRecord(
                    transfer_id=transfer_id, side=self.side, state=S.PREFILLED, request_id=request_id,
                    peer_engine_id=peer_engine_id, local_block_ids=blocks, has_local=True,
                    num_tokens=num_tokens, deadline=lease_deadline, created_at=now, updated_at=now))
            if rec.has_local:
                raise LedgerError(f"transfer {transfer_id}: prefill reported done twice")
            if rec.is_terminal:  # tombstone: the peer already released or aborted; blocks are not held
                return self._put(dataclasses.replace(rec, request_id=request_id, local_block_ids=blocks,
                                                     has_local=True))
            self._claim(blocks, transfer_id)
            return self._match(rec, now, min(rec.deadline, lease_deadline), request_id=request_id,
                               local_block_ids=blocks, has_local=True, num_tokens=rec.num_tokens or num_tokens)

    def on_registration(self, msg: pr.PushReg, peer: str | None = None,
                        now: float | None = None) -> TransferRecord | None:
        """P: D's PushReg. Returns the record if applied (REGISTERED, or MATCHED: post now), else None."""
        now = self._now(now)
        with self._lock:
            self._require_side(Role.PREFILL)
            return self._registration(msg, peer, now)

    # --- D side -----------------------------------------------------------------------------

    def register(self, transfer_id: str, request_id: str, block_ids: Iterable[int], deadline: float, *,
                 peer_engine_id: str, remote_block_ids: Iterable[int] | None = None,
                 num_tokens: int | None = None, num_prefix_tokens: int = 0,
                 now: float | None = None) -> TransferRecord:
        """D: blocks allocated for a transfer. Push: REGISTERED (send PushReg). Pull
        (``remote_block_ids`` = P's blocks): MATCHED (post the READ)."""
        now = self._now(now)
        blocks = tuple(block_ids)
        with self._lock:
            self._require_side(Role.DECODE)
            if transfer_id in self._records:
                raise LedgerError(f"transfer {transfer_id} is already registered")
            self._claim(blocks, transfer_id)
            pull = remote_block_ids is not None
            return self._put(TransferRecord(
                transfer_id=transfer_id, side=self.side, state=S.MATCHED if pull else S.REGISTERED,
                request_id=request_id, peer_engine_id=peer_engine_id, local_block_ids=blocks,
                remote_block_ids=tuple(remote_block_ids or ()), has_local=True, has_remote=pull,
                num_tokens=num_tokens, num_prefix_tokens=num_prefix_tokens, deadline=deadline,
                created_at=now, updated_at=now))

    def confirm_nothing_in_flight(self, transfer_id: str) -> bool:
        """D: nothing can still land in a FAILED / EXPIRED transfer's blocks (e.g. D's own READ
        ended). Returns False if the record is DONE or already released."""
        with self._lock:
            rec = self._records.get(transfer_id)
            if rec is None or not rec.is_terminal:
                raise LedgerError(f"transfer {transfer_id}: confirm needs a terminal record, got "
                                  f"{rec.state.value if rec else 'unknown'}")
            if not rec.is_quarantined:
                return False
            self._put(dataclasses.replace(rec, in_flight_confirmed=True))
            return True

    def release_quarantine(self, now: float | None = None) -> list[int]:
        """D: blocks that may be reused now: confirmed, or past their quarantine deadline. Each once."""
        now = self._now(now)
        out: list[int] = []
        with self._lock:
            for rec in [self._records[t] for t in self._index.quarantined]:
                if rec.in_flight_confirmed or now >= (rec.quarantine_until or 0.0):
                    self._put(dataclasses.replace(rec, quarantine_released=True, updated_at=now))
                    self._unclaim(rec)
                    out.extend(rec.local_block_ids)
        return sorted(out)

    # --- both sides -------------------------------------------------------------------------

    def mark_posted(self, transfer_id: str, *, num_descs: int = 0, num_bytes: int = 0,
                    now: float | None = None) -> TransferRecord:
        """The WRITE (P) or READ (D, pull) was posted. MATCHED -> POSTED; refused past the deadline."""
        now = self._now(now)
        with self._lock:
            rec = self._known(transfer_id)
            if now >= rec.deadline:
                raise LedgerError(f"transfer {transfer_id}: deadline passed, expire it instead of posting")
            return self._move(rec, S.POSTED, now, posted_at=now,
                              num_descs=num_descs, num_bytes=num_bytes)

    def mark_done(self, transfer_id: str, *, first_token_id: int | None = None,
                  now: float | None = None) -> TransferRecord:
        """Our own posted WRITE / READ completed. POSTED -> DONE."""
        now = self._now(now)
        with self._lock:
            rec = self._known(transfer_id)
            if rec.state is not S.POSTED:
                raise LedgerError(f"transfer {transfer_id}: mark_done needs POSTED, got {rec.state.value}")
            return self._move(rec, S.DONE, now, first_token_id=first_token_id)

    def mark_failed(self, transfer_id: str, reason: str, *, confirmed: bool = False, posted: bool = False,
                    kind: FailureKind = FailureKind.ERROR, now: float | None = None) -> TransferRecord:
        """A local failure. ``confirmed`` (D): nothing of ours or the peer's can be in flight.
        ``posted``: a WRITE / READ of ours was posted (even if ``mark_posted`` refused it as too late)
        and may still be in flight, so no message of the peer's confirms the blocks free: only its end."""
        now = self._now(now)
        with self._lock:
            rec = self._known(transfer_id)
            changes: dict[str, object] = {"posted_at": rec.posted_at or now} if posted else {}
            return self._move(rec, S.FAILED, now, kind, error=reason, in_flight_confirmed=confirmed, **changes)

    def on_notification(self, msg: pr.Message, peer: str, now: float | None = None) -> TransferRecord | None:
        """A message from engine ``peer``. Returns the record if it was applied, else None (counted)."""
        now = self._now(now)
        with self._lock:
            if isinstance(msg, pr.PushReg) and self.side is Role.PREFILL:
                return self._registration(msg, peer, now)
            if not isinstance(msg, _ACCEPTED[self.side]):
                self._counters.ignored_unexpected += 1
                return None
            rec = self._records.get(msg.transfer_id)
            if rec is None:
                if self.side is Role.PREFILL and isinstance(msg, (pr.Release, pr.Abort, pr.Fail)):
                    self._counters.early += 1
                    if not isinstance(msg, pr.Release):
                        self._counters.failures[_PEER_KIND[type(msg)]] += 1
                    return self._put(TransferRecord(
                        transfer_id=msg.transfer_id, side=self.side, state=_OUTCOME[type(msg)],
                        request_id=None, peer_engine_id=peer, deadline=now, created_at=now, updated_at=now,
                        error=_reason(msg)))
                self._counters.ignored_unknown += 1
                return None
            if rec.peer_engine_id is not None and rec.peer_engine_id != peer:
                self._counters.ignored_foreign += 1
                return None
            if rec.is_terminal:
                if (self.side is Role.DECODE and rec.is_quarantined and not rec.in_flight_confirmed
                        and rec.posted_at is None):
                    self._counters.confirmations += 1  # P's Done / Fail / Abort ends its WRITE
                    self._put(dataclasses.replace(rec, in_flight_confirmed=True))
                elif _OUTCOME[type(msg)] is rec.state:
                    self._counters.duplicates += 1
                else:
                    self._counters.ignored_stale += 1
                return None
            return self._apply(rec, msg, peer, now)

    def expire(self, now: float | None = None) -> list[TransferRecord]:
        """Move live records past their deadline to EXPIRED; returns them (P: free; D: fail or recompute)."""
        now = self._now(now)
        with self._lock:
            due = [r for r in (self._records[t] for t in self._index.live) if r.deadline <= now]
            return [self._move(r, S.EXPIRED, now, FailureKind.DEADLINE, error=f"deadline passed ({r.state.value})")
                    for r in due]

    def gc(self, now: float | None = None) -> list[str]:
        """Drop terminal records older than ``tombstone_s`` whose blocks are not quarantined."""
        now = self._now(now)
        with self._lock:
            old = self._index.collectable(self._records, self.tombstone_s, now)
            for tid in old:
                self._drop(tid)
            return old

    # --- internals (lock held) ------------------------------------------------------------------

    def _now(self, now: float | None) -> float:
        return self._clock() if now is None else now

    def _require_side(self, side: Role) -> None:
        if self.side is not side:
            raise LedgerError(f"a {side.value}-side operation on the {self.side.value} ledger")

    def _known(self, transfer_id: str) -> TransferRecord:
        rec = self._records.get(transfer_id)
        if rec is None:
            raise LedgerError(f"transfer {transfer_id} is unknown")
        return rec

    def _put(self, rec: TransferRecord) -> TransferRecord:
        self._index.put(rec, self._records.get(rec.transfer_id))
        self._records[rec.transfer_id] = rec
        return rec

    def _drop(self, transfer_id: str) -> None:
        self._index.drop(self._records.pop(transfer_id))

    def _claim(self, blocks: tuple[int, ...], transfer_id: str) -> None:
        """D: a block receives one transfer's KV at a time. P's held blocks are only read, and two
        requests with a common prefix share P's prefix-cached blocks (one reference each), so several
        P transfers may hold the same block."""
        if len(set(blocks)) != len(blocks):
            raise LedgerError(f"transfer {transfer_id}: repeated block ids {list(blocks)}")
        if self.side is Role.PREFILL:
            return
        busy = sorted(b for b in blocks if b in self._owner)
        if busy:
            raise LedgerError(f"transfer {transfer_id}: blocks {busy} belong to transfer "
                              f"{self._owner[busy[0]]} (live or quarantined)")
        for b in blocks:
            self._owner[b] = transfer_id

    def _unclaim(self, rec: TransferRecord) -> None:
        for b in rec.local_block_ids:
            if self._owner.get(b) == rec.transfer_id:
                del self._owner[b]

    def _move(self, rec: TransferRecord, state: TransferState, now: float, kind: FailureKind | None = None, /,
              **changes: object) -> TransferRecord:
        """``kind``: why, for a move to FAILED or EXPIRED (counted)."""
        if state not in TRANSITIONS[rec.state]:
            raise LedgerError(f"transfer {rec.transfer_id}: illegal transition "
                              f"{rec.state.value} -> {state.value}")
        new = dataclasses.replace(rec, state=state, updated_at=now, **changes)  # type: ignore[arg-type]
        if state in (S.FAILED, S.EXPIRED):
            self._counters.failures[kind or FailureKind.ERROR] += 1
        if state is S.DONE or (state.is_terminal and self.side is Role.PREFILL):
            self._unclaim(new)  # P: the caller frees them; D: they now belong to the request
        elif state.is_terminal:
            # P posts only before the deadline, so anything it posted lands by deadline + quarantine_s.
            new = dataclasses.replace(new, quarantine_until=max(now, rec.deadline) + self.quarantine_s)
        return self._put(new)

    def _match(self, rec: TransferRecord, now: float, deadline: float, **changes: object) -> TransferRecord:
        # Both halves are here. Past the deadline the writer must not post: expire instead.
        if deadline <= now:
            return self._move(rec, S.EXPIRED, now, FailureKind.DEADLINE, deadline=deadline, error="deadline passed",
                              **changes)
        return self._move(rec, S.MATCHED, now, deadline=deadline, **changes)

    def _registration(self, msg: pr.PushReg, peer: str | None, now: float) -> TransferRecord | None:
        if peer is not None and peer != msg.decode_engine_id:
            self._counters.ignored_foreign += 1
            return None
        fields = dict(remote_block_ids=tuple(msg.block_ids), has_remote=True, num_tokens=msg.num_tokens,
                      num_prefix_tokens=msg.num_prefix_tokens, peer_engine_id=msg.decode_engine_id,
                      peer_deadline=msg.deadline)
        rec = self._records.get(msg.transfer_id)
        if rec is None:
            if msg.deadline <= now:
                self._counters.ignored_stale += 1
                return None
            return self._put(TransferRecord(
                transfer_id=msg.transfer_id, side=self.side, state=S.REGISTERED, request_id=None,
                deadline=msg.deadline, created_at=now, updated_at=now, **fields))  # type: ignore[arg-type]
        if rec.peer_engine_id is not None and rec.peer_engine_id != msg.decode_engine_id:
            self._counters.ignored_foreign += 1
        elif rec.has_remote:
            self._counters.duplicates += 1
        elif rec.is_terminal:
            self._counters.ignored_stale += 1
        elif rec.state is S.PREFILLED:
            return self._match(rec, now, min(rec.deadline, msg.deadline), **fields)
        else:
            self._counters.ignored_unexpected += 1
        return None

    def _apply(self, rec: TransferRecord, msg: pr.Message, peer: str, now: float) -> TransferRecord | None:
        state = rec.state
        if isinstance(msg, (pr.Fail, pr.Abort)):
            # The sender has nothing in flight; on D our own READ may still be (posted_at set).
            return self._move(rec, S.FAILED, now, _PEER_KIND[type(msg)], error=_reason(msg), peer_engine_id=peer,
                              in_flight_confirmed=rec.posted_at is None)
        if isinstance(msg, pr.LeaseRenew) and state is S.PREFILLED:
            until = min(msg.until, now + self.max_lease_s)
            return self._put(dataclasses.replace(rec, deadline=max(rec.deadline, until), updated_at=now,
                                                 peer_engine_id=peer))
        if ((isinstance(msg, pr.ReadDone) and state is S.PREFILLED)
                or (isinstance(msg, pr.Release) and state in (S.PREFILLED, S.REGISTERED))):
            return self._move(rec, S.DONE, now, peer_engine_id=peer)
        if isinstance(msg, pr.Done | pr.Commit) and state is S.REGISTERED:
            return self._move(rec, S.DONE, now, first_token_id=msg.first_token_id)
        self._counters.ignored_unexpected += 1
        return None


def _reason(msg: pr.Message) -> str | None:
    return f"peer failed: {msg.reason}" if isinstance(msg, pr.Fail) else None if isinstance(msg, pr.Release) \
        else "aborted by peer"
