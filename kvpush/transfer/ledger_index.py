"""What the ledger's timers need to look at, kept beside its records so that a timer's pass costs what
is live, not what the ledger remembers.

The transfer thread runs the ledger's housekeeping every 10 ms: expiry (live records past their
deadline), D's quarantine release (quarantined records) and the collection of tombstones (terminal
records older than ``tombstone_s``). Each of those used to scan every record, and terminal records
stay for ``tombstone_s`` (300 s by default, longer where an emulated instance stretches it): at a
steady rate of transfers the scans grew with rate x tombstone_s, every 10 ms, on the thread that posts
transfers. Here:

- ``by_state``: how many records are in each state (metrics, the thread's pacing);
- ``live``: ids of non-terminal records, in creation order (expiry scans these);
- ``quarantined``: ids of D's quarantined records (release scans these);
- ``tombstones``: a heap of (updated_at, seq, id), one entry per write of a terminal record; an entry
  whose record has been written again since (a newer ``updated_at``) or dropped is stale and skipped;
- ``held``: tombstones old enough to go that ``gc`` could not drop yet (quarantined, or a peer deadline
  ahead), looked at again on each pass: few, and only on D.

No I/O, no lock: the ledger calls it with its own lock held.
"""

from __future__ import annotations

import heapq
import itertools

from kvpush.transfer.records import TransferRecord, TransferState


class RecordIndex:
    def __init__(self) -> None:
        self.by_state: dict[TransferState, int] = dict.fromkeys(TransferState, 0)
        self.live: dict[str, None] = {}
        self.quarantined: set[str] = set()
        self._tombstones: list[tuple[float, int, str]] = []
        self._held: set[str] = set()
        self._seq = itertools.count()

    def put(self, rec: TransferRecord, old: TransferRecord | None) -> None:
        """After every write of `rec` into the ledger's records, over `old` (None: a new id)."""
        tid = rec.transfer_id
        if old is not None:
            self.by_state[old.state] -= 1
        self.by_state[rec.state] += 1
        if rec.is_terminal:
            self.live.pop(tid, None)
            heapq.heappush(self._tombstones, (rec.updated_at, next(self._seq), tid))
        else:
            self.live.setdefault(tid, None)
        if rec.is_quarantined:
            self.quarantined.add(tid)
        else:
            self.quarantined.discard(tid)

    def drop(self, rec: TransferRecord) -> None:
        """After `rec` left the ledger's records."""
        tid = rec.transfer_id
        self.by_state[rec.state] -= 1
        self.live.pop(tid, None)
        self.quarantined.discard(tid)
        self._held.discard(tid)

    def collectable(self, records: dict[str, TransferRecord], tombstone_s: float, now: float) -> list[str]:
        """Ids of terminal records that may go now: not quarantined, written at least `tombstone_s` ago,
        and past their peer deadline (the ledger's gc rule). The caller drops them."""
        out = [tid for tid in list(self._held) if self._check(tid, records.get(tid), tombstone_s, now)]
        while self._tombstones and self._tombstones[0][0] + tombstone_s <= now:
            at, _, tid = heapq.heappop(self._tombstones)
            rec = records.get(tid)
            if rec is None or not rec.is_terminal or rec.updated_at != at or tid in self._held:
                continue  # stale: dropped, or written again (its newer entry decides)
            self._held.add(tid)
            if self._check(tid, rec, tombstone_s, now):
                out.append(tid)
        return out

    def _check(self, tid: str, rec: TransferRecord | None, tombstone_s: float, now: float) -> bool:
        """A held tombstone: True if it may go now. Forgotten here if it was dropped; back on the heap if it is
        not old enough (any more: written again since, `now` went back, or tombstone_s grew)."""
        if rec is None or not rec.is_terminal:
            self._held.discard(tid)
            return False
        if rec.updated_at + tombstone_s > now:
            self._held.discard(tid)
            heapq.heappush(self._tombstones, (rec.updated_at, next(self._seq), tid))
            return False
        return not rec.is_quarantined and (rec.peer_deadline or 0.0) <= now
