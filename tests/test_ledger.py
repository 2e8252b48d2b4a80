"""The transfer ledger: matching in either order, peer input ignored and counted, quarantine, expiry."""

from __future__ import annotations

import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvpush.config import Role
from kvpush.errors import TransferError
from kvpush.transfer.ledger import TransferLedger
from kvpush.transfer.protocol import (
    Abort,
    Commit,
    Done,
    Fail,
    LeaseRenew,
    Message,
    PushReg,
    ReadDone,
    Release,
    new_transfer_id,
)
from kvpush.transfer.records import INITIAL_STATES, TRANSITIONS, LedgerError, TransferState

S = TransferState
D_ID, P_ID, EVIL = "decode-0", "prefill-0", "decode-evil"
T0 = 1000.0


def p_ledger() -> TransferLedger:
    return TransferLedger(Role.PREFILL, tombstone_s=100.0, quarantine_s=50.0, clock=lambda: T0)


def d_ledger() -> TransferLedger:
    return TransferLedger(Role.DECODE, tombstone_s=100.0, quarantine_s=50.0, clock=lambda: T0)


def reg(tid: str, blocks: list[int] | None = None, deadline: float = T0 + 30, engine: str = D_ID) -> PushReg:
    return PushReg(tid, engine, blocks or [10, 11], 0, 20, deadline)


# --- P side: matching ------------------------------------------------------------------------


def test_transition_table_is_closed() -> None:
    assert set(TRANSITIONS) == set(S)
    for state, targets in TRANSITIONS.items():
        assert state not in targets
        assert (not targets) == state.is_terminal
    assert all(states <= set(S) for states in INITIAL_STATES.values())


def test_registration_after_prefill_done_matches_once() -> None:
    led, tid = p_ledger(), new_transfer_id()
    rec = led.on_prefill_done(tid, "req-1", [1, 2], T0 + 30, peer_engine_id=D_ID)
    assert rec.state is S.PREFILLED and led.blocks_in_flight() == [1, 2]
    matched = led.on_registration(reg(tid, deadline=T0 + 20), peer=D_ID)
    assert matched is not None and matched.state is S.MATCHED
    assert matched.local_block_ids == (1, 2) and matched.remote_block_ids == (10, 11)
    assert matched.deadline == T0 + 20  # the earlier of the lease and D's deadline
    assert led.on_registration(reg(tid), peer=D_ID) is None
    assert led.on_notification(reg(tid), D_ID) is None
    assert led.counters.duplicates == 2
    assert led.count_by_state()[S.MATCHED] == 1


def test_registration_before_prefill_done_matches_once() -> None:
    led, tid = p_ledger(), new_transfer_id()
    first = led.on_notification(reg(tid), D_ID)
    assert first is not None and first.state is S.REGISTERED and first.request_id is None
    assert led.on_notification(reg(tid), D_ID) is None
    assert led.counters.duplicates == 1
    matched = led.on_prefill_done(tid, "req-1", [1, 2], T0 + 60)
    assert matched.state is S.MATCHED and matched.request_id == "req-1" and matched.deadline == T0 + 30
    with pytest.raises(LedgerError, match="twice"):
        led.on_prefill_done(tid, "req-1", [3], T0 + 60)


def test_full_push_lifecycle_on_p() -> None:
    led, tid = p_ledger(), new_transfer_id()
    led.on_prefill_done(tid, "r", [1, 2], T0 + 30)
    led.on_registration(reg(tid), D_ID)
    posted = led.mark_posted(tid, num_descs=1, num_bytes=4096, now=T0 + 1)
    assert (posted.state, posted.num_descs, posted.num_bytes, posted.posted_at) == (S.POSTED, 1, 4096, T0 + 1)
    done = led.mark_done(tid, now=T0 + 2)
    assert done.state is S.DONE and led.blocks_in_flight() == []
    with pytest.raises(LedgerError):
        led.mark_done(tid)


def test_pull_lifecycle_on_p_with_lease_renew() -> None:
    led, tid = p_ledger(), new_transfer_id()
    led.on_prefill_done(tid, "r", [5], T0 + 10)
    renewed = led.on_notification(LeaseRenew(tid, T0 + 50), D_ID)
    assert renewed is not None and renewed.deadline == T0 + 50 and renewed.peer_engine_id == D_ID
    capped = led.on_notification(LeaseRenew(tid, T0 + 10_000), D_ID)
    assert capped is not None and capped.deadline == T0 + led.max_lease_s
    assert led.on_notification(ReadDone(tid), EVIL) is None  # bound to D_ID by the renewal
    assert led.counters.ignored_foreign == 1
    done = led.on_notification(ReadDone(tid), D_ID)
    assert done is not None and done.state is S.DONE
    assert led.on_notification(ReadDone(tid), D_ID) is None
    assert led.counters.duplicates == 1


@pytest.mark.parametrize("msg_type", [Release, Abort])
def test_early_release_or_abort_leaves_a_tombstone(msg_type: type) -> None:
    led, tid = p_ledger(), new_transfer_id()
    tomb = led.on_notification(msg_type(tid), D_ID)
    assert tomb is not None and tomb.is_terminal and led.counters.early == 1
    rec = led.on_prefill_done(tid, "r", [1, 2], T0 + 30)
    assert rec.is_terminal and rec.local_block_ids == (1, 2)  # free them now
    assert led.blocks_in_flight() == [] and led.on_registration(reg(tid), D_ID) is None
    assert led.counters.ignored_stale == 1


def test_early_record_from_unexpected_decoder_is_foreign() -> None:
    led, tid = p_ledger(), new_transfer_id()
    led.on_notification(reg(tid, engine=EVIL), EVIL)
    rec = led.on_prefill_done(tid, "r", [1], T0 + 30, peer_engine_id=D_ID)
    assert rec.state is S.PREFILLED and led.counters.ignored_foreign == 1
    assert led.on_registration(reg(tid), D_ID).state is S.MATCHED  # type: ignore[union-attr]


def test_registration_whose_engine_differs_from_sender_is_foreign() -> None:
    led, tid = p_ledger(), new_transfer_id()
    assert led.on_notification(reg(tid, engine=D_ID), EVIL) is None
    led.on_prefill_done(tid, "r", [1], T0 + 30, peer_engine_id=D_ID)
    assert led.on_notification(reg(tid, engine=EVIL), EVIL) is None
    assert led.counters.ignored_foreign == 2 and led.get(tid).state is S.PREFILLED  # type: ignore[union-attr]


def test_registration_past_its_deadline_is_stale() -> None:
    led = p_ledger()
    assert led.on_registration(reg(new_transfer_id(), deadline=T0 - 1), D_ID) is None
    assert led.counters.ignored_stale == 1 and len(led) == 0


def test_abort_of_posted_write_fails_record_but_not_confirmed() -> None:
    led, tid = p_ledger(), new_transfer_id()
    led.on_prefill_done(tid, "r", [1], T0 + 30)
    led.on_registration(reg(tid), D_ID)
    led.mark_posted(tid)
    rec = led.on_notification(Abort(tid), D_ID)
    assert rec is not None and rec.state is S.FAILED and rec.posted_at is not None
    with pytest.raises(LedgerError, match="POSTED"):
        led.mark_done(tid)


# --- illegal transitions from internal callers -----------------------------------------------


def test_illegal_transitions_raise() -> None:
    assert issubclass(LedgerError, TransferError)
    led, tid = p_ledger(), new_transfer_id()
    with pytest.raises(LedgerError, match="unknown"):
        led.mark_posted(tid)
    led.on_prefill_done(tid, "r", [1], T0 + 30)
    with pytest.raises(LedgerError, match="prefilled -> posted"):
        led.mark_posted(tid)
    with pytest.raises(LedgerError, match="POSTED"):
        led.mark_done(tid)
    shared = led.on_prefill_done(new_transfer_id(), "r2", [1], T0 + 30)  # a prefix-cached block of P's, shared
    assert shared.state is S.PREFILLED and led.blocks_in_flight() == [1, 1]
    with pytest.raises(LedgerError, match="repeated"):
        led.on_prefill_done(new_transfer_id(), "r3", [7, 7], T0 + 30)
    with pytest.raises(LedgerError, match="decode-side"):
        led.register(new_transfer_id(), "r", [9], T0 + 30, peer_engine_id=P_ID)
    led.on_registration(reg(tid), D_ID)
    with pytest.raises(LedgerError, match="deadline passed"):
        led.mark_posted(tid, now=T0 + 30)
    led.mark_failed(tid, "boom")
    with pytest.raises(LedgerError, match="failed -> failed"):
        led.mark_failed(tid, "again")
    d = d_ledger()
    with pytest.raises(LedgerError, match="prefill-side"):
        d.on_prefill_done(tid, "r", [1], T0)
    d.register(tid, "r", [1], T0 + 30, peer_engine_id=P_ID)
    with pytest.raises(LedgerError, match="already registered"):
        d.register(tid, "r", [2], T0 + 30, peer_engine_id=P_ID)
    with pytest.raises(LedgerError, match="terminal"):
        d.confirm_nothing_in_flight(tid)


# --- D side ----------------------------------------------------------------------------------


def test_d_push_done_carries_first_token() -> None:
    led, tid = d_ledger(), new_transfer_id()
    rec = led.register(tid, "r", [3, 4], T0 + 30, peer_engine_id=P_ID, num_tokens=20)
    assert rec.state is S.REGISTERED and led.blocks_in_flight() == [3, 4]
    done = led.on_notification(Done(tid, 77), P_ID)
    assert done is not None and done.state is S.DONE and done.first_token_id == 77
    assert led.blocks_in_flight() == [] and led.quarantined_blocks() == []
    assert led.on_notification(Done(tid, 78), P_ID) is None
    assert led.get(tid).first_token_id == 77 and led.counters.duplicates == 1  # type: ignore[union-attr]
    led.register(new_transfer_id(), "r2", [3, 4], T0 + 30, peer_engine_id=P_ID)  # blocks reusable


def test_unknown_stale_foreign_and_unexpected_notifications_are_counted() -> None:
    led, tid = d_ledger(), new_transfer_id()
    led.register(tid, "r", [1], T0 + 30, peer_engine_id=P_ID)
    before = led.get(tid)
    assert led.on_notification(Done(new_transfer_id()), P_ID) is None
    assert led.on_notification(Done(tid), "prefill-9") is None
    assert led.on_notification(Fail(tid, "x"), "prefill-9") is None
    assert led.on_notification(ReadDone(tid), P_ID) is None
    assert led.on_notification(Commit(tid), "prefill-9") is None
    assert led.on_notification(reg(tid), P_ID) is None
    assert led.get(tid) == before
    led.on_notification(Done(tid), P_ID)
    assert led.on_notification(Fail(tid, "late"), P_ID) is None
    c = led.counters
    assert (c.ignored_unknown, c.ignored_foreign, c.ignored_unexpected, c.ignored_stale) == (1, 3, 2, 1)
    assert led.get(tid).state is S.DONE  # type: ignore[union-attr]


def test_stale_done_of_old_transfer_never_marks_new_one() -> None:
    led = d_ledger()
    old, new = new_transfer_id(), new_transfer_id()
    led.register(old, "req", [1, 2], T0 + 10, peer_engine_id=P_ID)
    led.mark_failed(old, "timeout", now=T0 + 5)
    assert led.release_quarantine(now=T0 + 100) == [1, 2]  # past max(5, 10) + 50
    led.register(new, "req", [1, 2], T0 + 200, peer_engine_id=P_ID)  # retry: same request and blocks
    assert led.on_notification(Done(old), P_ID) is None
    assert led.get(new).state is S.REGISTERED and led.counters.ignored_stale == 1  # type: ignore[union-attr]
    led.gc(now=T0 + 1000)
    assert led.get(old) is None and led.get(new) is not None
    assert led.on_notification(Done(old), P_ID) is None
    assert led.get(new).state is S.REGISTERED and led.counters.ignored_unknown == 1  # type: ignore[union-attr]


def test_quarantine_released_only_after_confirmation() -> None:
    led, tid = d_ledger(), new_transfer_id()
    led.register(tid, "r", [5, 6], T0 + 30, peer_engine_id=P_ID)
    led.mark_failed(tid, "client went away", now=T0 + 1)
    assert led.quarantined_blocks() == [5, 6] and led.release_quarantine(now=T0 + 2) == []
    with pytest.raises(LedgerError, match="belong to transfer"):
        led.register(new_transfer_id(), "r2", [6], T0 + 30, peer_engine_id=P_ID)
    assert led.gc(now=T0 + 10_000) == []  # a quarantined tombstone is kept
    assert led.confirm_nothing_in_flight(tid) is True
    assert led.release_quarantine(now=T0 + 3) == [5, 6]
    assert led.release_quarantine(now=T0 + 4) == [] and led.quarantined_blocks() == []
    assert led.confirm_nothing_in_flight(tid) is False


def test_quarantine_released_at_deadline() -> None:
    led, tid = d_ledger(), new_transfer_id()
    led.register(tid, "r", [5], T0 + 30, peer_engine_id=P_ID)
    (expired,) = led.expire(now=T0 + 30)
    assert expired.state is S.EXPIRED and expired.quarantine_until == T0 + 30 + 50
    assert led.release_quarantine(now=T0 + 79.9) == []
    assert led.release_quarantine(now=T0 + 80) == [5]


def test_quarantine_outlives_a_write_posted_just_before_the_deadline() -> None:
    """D aborts early; P has not seen the Abort and posts just before D's deadline. The WRITE may land
    until deadline + quarantine_s, so the blocks stay quarantined that long, not abort + quarantine_s."""
    led, tid = d_ledger(), new_transfer_id()
    led.register(tid, "r", [5], T0 + 30, peer_engine_id=P_ID)
    rec = led.mark_failed(tid, "client went away", now=T0 + 1)
    assert rec.quarantine_until == T0 + 30 + 50
    assert led.release_quarantine(now=T0 + 51) == []
    assert led.release_quarantine(now=T0 + 80) == [5]


@pytest.mark.parametrize("msg", [Fail("x", "write failed"), Abort("x"), Done("x")])
def test_peer_message_confirms_quarantine(msg: Message) -> None:
    led = d_ledger()
    led.register("x", "r", [5], T0 + 30, peer_engine_id=P_ID)
    led.mark_failed("x", "local timeout")
    assert led.on_notification(msg, EVIL) is None and led.release_quarantine() == []
    assert led.on_notification(msg, P_ID) is None
    assert led.counters.confirmations == 1 and led.release_quarantine() == [5]


def test_peer_fail_is_confirmed_at_once() -> None:
    led, tid = d_ledger(), new_transfer_id()
    led.register(tid, "r", [5], T0 + 30, peer_engine_id=P_ID)
    rec = led.on_notification(Fail(tid, "lease expired"), P_ID)
    assert rec is not None and rec.state is S.FAILED and "lease expired" in (rec.error or "")
    assert led.release_quarantine() == [5]


def test_d_pull_read_in_flight_needs_own_confirmation() -> None:
    led, tid = d_ledger(), new_transfer_id()
    rec = led.register(tid, "r", [5], T0 + 30, peer_engine_id=P_ID, remote_block_ids=[70])
    assert rec.state is S.MATCHED and rec.remote_block_ids == (70,)
    led.mark_posted(tid, num_descs=1)
    assert led.on_notification(Done(tid), P_ID) is None  # pull: D's own READ completes it
    led.on_notification(Fail(tid, "P shutting down"), P_ID)
    assert led.release_quarantine() == []  # our READ may still be landing
    led.confirm_nothing_in_flight(tid)
    assert led.release_quarantine() == [5]


def test_expire_and_gc() -> None:
    led = p_ledger()
    a, b = new_transfer_id(), new_transfer_id()
    led.on_prefill_done(a, "r", [1], T0 + 5)
    led.on_prefill_done(b, "r", [2], T0 + 50)
    assert [r.transfer_id for r in led.expire(now=T0 + 5)] == [a]
    assert led.blocks_in_flight() == [2] and led.expire(now=T0 + 6) == []
    assert led.on_notification(ReadDone(a), D_ID) is None and led.counters.ignored_stale == 1
    assert led.gc(now=T0 + 104) == [] and led.gc(now=T0 + 105) == [a]
    assert led.count_by_state() == {**dict.fromkeys(S, 0), S.PREFILLED: 1}


# --- state machine: a P and a D ledger over a lossy, reordering, duplicating channel ----------

QUARANTINE_S = 20.0  # writes are forced to complete within this, the assumption quarantine rests on


class PushPair(RuleBasedStateMachine):
    """Drives P and D ledgers the way push.py will (writer, notifications, expiry, aborts) and checks
    that D never hands out a block a WRITE can still land in."""

    @initialize()
    def setup(self) -> None:
        self.now = T0
        self.p = TransferLedger(Role.PREFILL, tombstone_s=30.0, max_lease_s=60.0, clock=lambda: self.now)
        self.d = TransferLedger(Role.DECODE, tombstone_s=30.0, quarantine_s=QUARANTINE_S,
                                clock=lambda: self.now)
        self.d_free, self.p_free = set(range(12)), set(range(12))
        self.tids: list[str] = []
        self.minted = 0
        self.prefilled: set[str] = set()
        self.d_done = 0
        self.to_p: list[Message] = []
        self.to_d: list[Message] = []
        self.writes: dict[str, tuple[tuple[int, ...], float]] = {}  # in flight: D blocks, posted at
        self.completed: set[str] = set()
        self.decoding: set[int] = set()  # D blocks owned by requests that got their KV

    def next_tid(self) -> str:
        """Ids in creation order: random ones would reorder `sorted(...)` between hypothesis's replays
        of one example (its draws must not depend on anything but earlier draws)."""
        self.minted += 1
        return f"t{self.minted:06d}"

    # D admits a request and registers; P finishes its prefill
    @rule(n=st.integers(1, 3), ttl=st.floats(2, 60))
    def d_register(self, n: int, ttl: float) -> None:
        if len(self.d_free) < n:
            return
        blocks = sorted(self.d_free)[:n]
        tid = self.next_tid()
        self.tids.append(tid)
        self.d_free -= set(blocks)
        self.d.register(tid, "r", blocks, self.now + ttl, peer_engine_id=P_ID)
        self.to_p.append(PushReg(tid, D_ID, blocks, 0, 16 * n, self.now + ttl))

    @rule(data=st.data(), lease=st.floats(2, 60))
    def p_prefill_done(self, data: st.DataObject, lease: float) -> None:
        waiting = [t for t in self.tids if t not in self.prefilled]
        if not waiting or not self.p_free:
            return
        tid = waiting[0] if data.draw(st.booleans()) else data.draw(st.sampled_from(waiting))
        self.prefilled.add(tid)
        block = min(self.p_free)
        self.p_free.discard(block)
        rec = self.p.on_prefill_done(tid, "r", [block], self.now + lease, peer_engine_id=D_ID)
        self.p_handle(rec)

    def p_handle(self, rec) -> None:  # type: ignore[no-untyped-def]
        if rec is None:
            return
        if rec.state is S.MATCHED:
            self.p.mark_posted(rec.transfer_id, num_descs=1)
            self.writes[rec.transfer_id] = (rec.remote_block_ids, self.now)
        elif rec.is_terminal:
            self.p_free |= set(rec.local_block_ids)
            if rec.state is not S.DONE and rec.transfer_id not in self.writes:
                self.to_d.append(Fail(rec.transfer_id, rec.error or "gone"))  # nothing of P's in flight

    @rule()
    def d_full_prefix_hit(self) -> None:
        tid = self.next_tid()
        self.tids.append(tid)
        self.to_p.append(Release(tid))

    @rule(data=st.data(), ok=st.booleans())
    def complete_write(self, data: st.DataObject, ok: bool) -> None:
        if self.writes:
            self.finish_write(data.draw(st.sampled_from(sorted(self.writes))), ok)

    def finish_write(self, tid: str, ok: bool = True) -> None:
        del self.writes[tid]
        rec = self.p.get(tid)
        live = rec is not None and rec.state is S.POSTED
        if ok:
            self.completed.add(tid)
            self.to_d.append(Done(tid, 1))  # the WRITE's own notification
            if live:
                self.p_handle(self.p.mark_done(tid))
        elif live:
            self.p_handle(self.p.mark_failed(tid, "WRITE failed"))
        else:
            self.to_d.append(Fail(tid, "WRITE failed"))

    @rule(data=st.data(), to_p=st.booleans(), keep=st.booleans())
    def deliver(self, data: st.DataObject, to_p: bool, keep: bool) -> None:
        queue = self.to_p if to_p else self.to_d
        if not queue:
            return
        i = data.draw(st.integers(0, len(queue) - 1))
        msg = queue[i] if keep else queue.pop(i)  # out of order, and sometimes twice
        if to_p:
            self.p_handle(self.p.on_notification(msg, D_ID))
        else:
            self.on_d_message(msg)

    def on_d_message(self, msg: Message) -> None:
        rec = self.d.on_notification(msg, P_ID)
        if rec is not None and rec.state is S.DONE:
            assert rec.transfer_id in self.completed, "D decodes from KV whose WRITE never finished"
            self.decoding |= set(rec.local_block_ids)
            self.d_done += 1

    @rule()
    def pump(self) -> None:
        """The common case: every queued message delivered in order, every WRITE completed."""
        while self.to_p or self.to_d or self.writes:
            while self.to_p:
                self.p_handle(self.p.on_notification(self.to_p.pop(0), D_ID))
            for tid in sorted(self.writes):
                self.finish_write(tid)
            while self.to_d:
                self.on_d_message(self.to_d.pop(0))

    @rule(data=st.data())
    def d_abort(self, data: st.DataObject) -> None:
        live = [t for t in self.tids if (r := self.d.get(t)) is not None and not r.is_terminal]
        if live:
            tid = data.draw(st.sampled_from(live))
            self.d.mark_failed(tid, "cancelled")
            self.to_p.append(Abort(tid))

    @rule(data=st.data())
    def forged_messages(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from([*self.tids, self.next_tid()]))
        before_p, before_d = self.p.records(), self.d.records()
        choices: list[Message] = [Abort(tid), ReadDone(tid), Release(tid), Done(tid), Fail(tid, "forged"),
                                  Commit(tid)]
        forged = data.draw(st.sampled_from(choices))
        self.p.on_notification(forged, EVIL)
        self.d.on_notification(forged, EVIL)
        assert self.d.records() == before_d
        assert [r for r in self.p.records() if r.peer_engine_id != EVIL] == \
            [r for r in before_p if r.peer_engine_id != EVIL]

    @rule(dt=st.floats(0.1, 15))
    def tick(self, dt: float) -> None:
        self.now += dt
        for tid, (_, posted) in sorted(self.writes.items()):
            if posted + QUARANTINE_S <= self.now:
                self.finish_write(tid)
        for rec in self.p.expire():
            self.p_handle(rec)
        for rec in self.d.expire():
            self.to_p.append(Abort(rec.transfer_id))
        self.d_free |= set(self.d.release_quarantine())
        self.p.gc()
        self.d.gc()

    @rule()
    def requests_finish(self) -> None:
        self.d_free |= self.decoding
        self.decoding = set()

    @invariant()
    def no_block_reused_while_written(self) -> None:
        for blocks, _ in self.writes.values():
            assert not set(blocks) & self.d_free, "a WRITE is in flight into a free block"

    @invariant()
    def blocks_are_accounted_once(self) -> None:
        for led, free in ((self.d, self.d_free), (self.p, self.p_free)):
            held = [b for r in led.records() if not r.is_terminal or r.is_quarantined for b in r.local_block_ids]
            assert len(held) == len(set(held)), "a block in two live records"
            assert not set(held) & free
        assert not self.decoding & self.d_free
        assert len(self.d_free) + len(self.decoding) + len(self.d.blocks_in_flight()) \
            + len(self.d.quarantined_blocks()) == 12

    @invariant()
    def counts_consistent(self) -> None:
        for led in (self.p, self.d):
            counts = led.count_by_state()
            assert sum(counts.values()) == len(led) == len(led.records())
            assert all(counts[s] == sum(r.state is s for r in led.records()) for s in S)

    def teardown(self) -> None:
        if not hasattr(self, "p"):
            return
        for led in (self.p, self.d):
            led.expire(now=math.inf)
            assert all(r.is_terminal for r in led.records())
            assert led.blocks_in_flight() == []


PushPair.TestCase.settings = settings(max_examples=600, stateful_step_count=60, deadline=None)
TestPushPair = PushPair.TestCase


@pytest.mark.parametrize("side", [Role.PREFILL, Role.DECODE])
def test_every_message_from_unknown_peer_on_empty_ledger(side: Role) -> None:
    led = TransferLedger(side)
    tid = new_transfer_id()
    for msg in (Done(tid), ReadDone(tid), LeaseRenew(tid, 1e10), Commit(tid)):
        assert led.on_notification(msg, EVIL) is None
    assert len(led) == 0


def test_commit_completes_a_registered_transfer_on_d_like_done() -> None:
    """Layer-wise push: P's Commit says every layer landed; D applies it as Done, never as unexpected."""
    led, tid = d_ledger(), new_transfer_id()
    led.register(tid, "r", [1, 2], T0 + 30, peer_engine_id=P_ID)
    rec = led.on_notification(Commit(tid, 5), P_ID)
    assert rec is not None and rec.state is TransferState.DONE and rec.first_token_id == 5
    assert led.on_notification(Commit(tid, 5), P_ID) is None
    c = led.counters
    assert (c.ignored_unexpected, c.duplicates) == (0, 1)
    assert p_ledger().on_notification(Commit(tid), P_ID) is None  # P never takes one
