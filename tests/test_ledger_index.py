"""The ledger's index (kvpush/transfer/ledger_index.py) answers what a scan of every record would: random
writes, drops and collections against the brute-force rules the ledger used before it had the index."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvpush.config import Role
from kvpush.transfer.ledger_index import RecordIndex
from kvpush.transfer.records import TransferRecord, TransferState

TOMBSTONE_S = 5.0


def collectable_by_scan(records: dict[str, TransferRecord], now: float, tombstone_s: float) -> set[str]:
    return {tid for tid, r in records.items() if r.is_terminal and not r.is_quarantined
            and r.updated_at + tombstone_s <= now and (r.peer_deadline or 0.0) <= now}


def random_record(rng: random.Random, tid: str, now: float, old: TransferRecord | None) -> TransferRecord:
    states = list(TransferState) if old is None or not old.is_terminal else [s for s in TransferState if s.is_terminal]
    state = rng.choice(states)  # a terminal record stays terminal, as the ledger's transitions say
    quarantined = state.is_terminal and rng.random() < 0.3
    rec = TransferRecord(transfer_id=tid, side=Role.DECODE, state=state, request_id=tid, peer_engine_id="p",
                         deadline=now + rng.uniform(-1, 3), created_at=now,
                         updated_at=now if old is None or rng.random() < 0.7 else old.updated_at,
                         peer_deadline=now + rng.uniform(-2, 8) if rng.random() < 0.3 else None,
                         quarantine_until=now + 1 if quarantined else None,
                         quarantine_released=quarantined and rng.random() < 0.3)
    return rec


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("clock", ["forward", "unsteady"])
def test_the_index_agrees_with_a_scan(seed: int, clock: str) -> None:
    """`unsteady`: the clock sometimes steps back (explicit `now` values, a wall clock stepped) and tombstone_s
    changes between collections: no tombstone the scan would drop may be lost."""
    rng = random.Random(seed)
    index, records, now = RecordIndex(), {}, 0.0
    tombstone_s = TOMBSTONE_S
    for _ in range(600):
        now += rng.uniform(-1.5, 0.5) if clock == "unsteady" and rng.random() < 0.2 else rng.uniform(0, 0.5)
        op = rng.random()
        tid = f"t{rng.randrange(40)}"
        if op < 0.6:
            old = records.get(tid)
            rec = random_record(rng, tid, now, old)
            index.put(rec, old)
            records[tid] = rec
        elif op < 0.7 and tid in records:
            index.drop(records.pop(tid))
        elif op < 0.8 and tid in records and records[tid].is_quarantined:
            rec = dataclasses.replace(records[tid], quarantine_released=True)  # release, updated_at kept
            index.put(rec, records[tid])
            records[tid] = rec
        else:
            if clock == "unsteady" and rng.random() < 0.3:
                tombstone_s = rng.uniform(1.0, 10.0)
            expected = collectable_by_scan(records, now, tombstone_s)
            got = index.collectable(records, tombstone_s, now)
            assert len(got) == len(set(got)) and set(got) == expected
            for t in got:
                index.drop(records.pop(t))
        assert set(index.live) == {t for t, r in records.items() if not r.is_terminal}
        assert index.quarantined == {t for t, r in records.items() if r.is_quarantined}
        counts = dict.fromkeys(TransferState, 0)
        for r in records.values():
            counts[r.state] += 1
        assert index.by_state == counts
