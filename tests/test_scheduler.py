"""Scheduler: continuous batching, token budget, chunked prefill, preemption. Plain Python."""

from __future__ import annotations

import random

import pytest

from kvpush.config import SchedulerConfig
from kvpush.engine.block_manager import BlockManager
from kvpush.engine.kv_connector import Admission
from kvpush.engine.request import Request, RequestStatus
from kvpush.engine.sampling_params import SamplingParams
from kvpush.engine.scheduler import Scheduler


def make(num_blocks=64, block_size=4, budget=32, max_seqs=8, chunked=True) -> Scheduler:
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_seqs, budget, chunked), bm, max_model_len=1024)


def add(s: Scheduler, rid: str, n: int, max_tokens: int = 4) -> Request:
    r = Request(rid, list(range(1000 + n, 1000 + 2 * n)), SamplingParams(max_tokens=max_tokens))
    s.add(r)
    return r


def run_step(s: Scheduler):
    out = s.schedule()
    sampled = {r.request_id: 7 for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens}
    s.update(out, sampled)
    return out


def test_budget_and_chunked_prefill():
    s = make(budget=10)
    a = add(s, "a", 25)
    out = run_step(s)
    assert out.scheduled == [(a, 10)] and a.num_computed_tokens == 10 and a.output_token_ids == []
    run_step(s)
    out = run_step(s)
    assert out.scheduled == [(a, 5)] and a.output_token_ids == [7]


def test_no_chunking_waits_for_budget():
    s = make(budget=10, chunked=False)
    add(s, "a", 25)
    assert s.schedule().empty


def test_decode_first_then_new_prefill_in_same_step():
    s = make(budget=16)
    a = add(s, "a", 8)
    run_step(s)
    b = add(s, "b", 20)
    out = run_step(s)
    assert out.scheduled == [(a, 1), (b, 15)]


def test_max_num_seqs():
    s = make(max_seqs=2)
    for i in range(4):
        add(s, f"r{i}", 3)
    out = run_step(s)
    assert len(out.scheduled) == 2 and len(s.waiting) == 2


def test_preemption_frees_blocks_and_recomputes():
    s = make(num_blocks=4, block_size=4, budget=64)
    a = add(s, "a", 7, max_tokens=20)
    b = add(s, "b", 7, max_tokens=20)
    run_step(s)  # both prefilled: 2 blocks each, all 4 used
    run_step(s)  # a and b computed 8 tokens: still 2 blocks each
    run_step(s)  # the 9th token needs a third block: the later request is preempted
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert b in s.waiting and b.block_table == [] and b.num_computed_tokens == 0
    assert b.status is RequestStatus.PREEMPTED


def test_random_workload_frees_everything():
    rng = random.Random(0)
    s = make(num_blocks=12, block_size=4, budget=24, max_seqs=6)
    reqs = [add(s, f"r{i}", rng.randint(1, 20), max_tokens=rng.randint(1, 12)) for i in range(30)]
    for step in range(2000):
        if step == 5:
            s.finish(reqs[3], RequestStatus.FINISHED_ABORTED)
        if not s.num_unfinished():
            break
        run_step(s)
        owned = [b for r in s.running for b in r.block_table]
        assert len(owned) == len(set(owned)) or s.block_manager.enable_prefix_caching
        s.block_manager.check_invariants()
    assert s.num_unfinished() == 0
    assert s.block_manager.num_free_blocks == 12
    assert all(r.is_finished for r in reqs)


def make_joining(join: int, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(8, budget, True, join), BlockManager(64, 4), max_model_len=1024)


def test_prefills_join_a_step_one_at_a_time():
    """Two prefills larger than the join limit run in consecutive steps, in arrival order: the first
    ends after its own step instead of after both."""
    s = make_joining(join=4)
    a, b = add(s, "a", 10), add(s, "b", 20)
    assert run_step(s).scheduled == [(a, 10)] and a.output_token_ids == [7]
    assert run_step(s).scheduled == [(a, 1), (b, 20)]


def test_small_prefills_join_and_fifo_holds():
    """A prefill within the limit joins a step with another; a large one behind a blocked head waits too."""
    s = make_joining(join=4)
    a, b, c, d = add(s, "a", 10), add(s, "b", 3), add(s, "c", 12), add(s, "d", 2)
    assert run_step(s).scheduled == [(a, 10), (b, 3)]  # c waits; d (small) must not overtake it
    assert [r for r, _ in run_step(s).scheduled] == [a, b, c, d]  # c first in its step: d (2 tokens) joins


def test_running_chunk_counts_as_a_prefill():
    """A long prompt continuing in chunks keeps a large newcomer out of its steps."""
    s = make_joining(join=4, budget=16)
    a = add(s, "a", 40)
    run_step(s)
    b = add(s, "b", 8)
    assert run_step(s).scheduled == [(a, 16)]
    assert run_step(s).scheduled == [(a, 8)]  # a's last chunk: b still waits (the budget would allow it)
    assert run_step(s).scheduled == [(a, 1), (b, 8)]


def test_decodes_do_not_keep_a_prefill_out():
    s = make_joining(join=0)
    a = add(s, "a", 8)
    run_step(s)
    b = add(s, "b", 20)
    assert run_step(s).scheduled == [(a, 1), (b, 20)]


def test_join_limit_minus_one_packs_as_before():
    s = make_joining(join=-1)
    a, b = add(s, "a", 10), add(s, "b", 20)
    assert run_step(s).scheduled == [(a, 10), (b, 20)]
    assert make(budget=64).join_limit == -1  # None: a scheduler built alone packs (the engine resolves None)


def test_join_limit_below_minus_one_is_refused():
    with pytest.raises(ValueError, match="prefill-join-tokens"):
        SchedulerConfig(prefill_join_tokens=-2)


def test_requests_for_remote_kv_behind_a_waiting_prefill_are_still_parked():
    """A decode instance: a local prompt that may not join the step stays at the head, but a request
    behind it whose KV comes from a peer is offered to the admission hook (parking computes nothing and
    starts its transfer); a local one behind it keeps its place."""
    s = make_joining(join=4)
    a, b = add(s, "a", 10), add(s, "b", 20)
    c = add(s, "c", 6)
    r = add(s, "r", 30)
    r.remote_prefill = True
    offered: list[str] = []

    def admit(req: Request) -> Admission:  # as the decode connector: PARK once, then RUN when its KV landed
        first = req.request_id not in offered
        offered.append(req.request_id)
        return Admission.PARK if req.remote_prefill and first else Admission.RUN

    out = s.schedule(admit)
    assert out.scheduled == [(a, 10)] and offered == ["a", "b", "r"]
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KV and list(s.waiting) == [b, c]
    s.update(out, {"a": 7})
    s.resume_remote(r)  # its KV landed: one token to compute, at the front
    r.num_computed_tokens = r.num_tokens - 1
    s.block_manager.allocate(r, 1)
    out = s.schedule(admit)
    assert out.scheduled == [(a, 1), (r, 1), (b, 20)]  # a 1-token recompute joins; b is the step's prefill


def test_a_head_waiting_to_join_counts_one_prefix_lookup():
    s = make_joining(join=4)
    add(s, "a", 40)
    add(s, "b", 20)
    run_step(s)  # a: 32 of 40 (budget 64: b may not join)
    run_step(s)
    run_step(s)
    assert s.block_manager.num_queries == 2  # a and b once each, though b was looked up in every step


def test_by_device_resolves_the_join_limit():
    import torch

    from kvpush.engine.engine import CPU_PREFILL_JOIN_TOKENS, _by_device

    assert _by_device(SchedulerConfig(), torch.device("cpu")).prefill_join_tokens == CPU_PREFILL_JOIN_TOKENS
    assert _by_device(SchedulerConfig(), torch.device("cuda")).prefill_join_tokens == -1
    assert _by_device(SchedulerConfig(prefill_join_tokens=5), torch.device("cuda")).prefill_join_tokens == 5


def make_chunking(limit: int, join: int = 4, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(8, budget, True, join, limit), BlockManager(64, 4), max_model_len=1024)


def test_a_long_prefill_runs_in_chunks_beside_the_decodes():
    """Each step computes at most chunk_limit of the prompt; the decoding request gets a token after every
    chunk instead of waiting for the whole prefill; a prefill behind it does not join (one at a time)."""
    s = make_chunking(limit=8)
    d = add(s, "d", 4, max_tokens=20)
    run_step(s)
    a, b = add(s, "a", 30), add(s, "b", 6)
    steps = [run_step(s).scheduled for _ in range(4)]
    assert steps == [[(d, 1), (a, 8)], [(d, 1), (a, 8)], [(d, 1), (a, 8)], [(d, 1), (a, 6)]]
    assert len(d.output_token_ids) == 5 and a.output_token_ids == [7] and b.num_computed_tokens == 0
    assert run_step(s).scheduled == [(d, 1), (a, 1), (b, 6)]


def test_a_chunked_prefill_is_still_one_prefill_at_a_time_and_holds_all_its_blocks():
    """Chunks smaller than the join limit do not let a long prompt join a step that computes another
    prefill (the rule looks at the whole prompt); admission takes the blocks of every chunk at once."""
    s = make_chunking(limit=4, join=16)
    a, b = add(s, "a", 40), add(s, "b", 30)
    out = run_step(s)
    assert out.scheduled == [(a, 4)] and len(a.block_table) == 10  # 40 tokens in blocks of 4
    for _ in range(9):
        assert [r for r, _ in run_step(s).scheduled] == [a]  # b waits for a's last chunk
    assert a.output_token_ids == [7] and run_step(s).scheduled == [(a, 1), (b, 4)]


def test_a_request_whose_kv_landed_joins_between_chunks():
    s = make_chunking(limit=8)
    a = add(s, "a", 30)
    run_step(s)
    r = Request("r", list(range(40)), SamplingParams(max_tokens=4))
    r.remote_prefill = True
    s.add(r)
    s.waiting.remove(r)
    s.park_remote(r)
    s.block_manager.allocate(r, r.num_tokens)
    r.num_computed_tokens = r.num_tokens - 1  # its KV landed from a peer: one token to compute
    s.resume_remote(r)
    assert run_step(s).scheduled == [(a, 8), (r, 1)]


def test_chunk_limit_off_and_refused_values():
    assert make_chunking(limit=0).chunk_limit == 0 and make(budget=64).chunk_limit == 0  # None alone: off
    with pytest.raises(ValueError, match="long-prefill-token-threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="no-chunked-prefill"):
        SchedulerConfig(enable_chunked_prefill=False, long_prefill_token_threshold=64)
    SchedulerConfig(enable_chunked_prefill=False, long_prefill_token_threshold=0)  # off goes with anything


def test_the_engine_chunks_long_prefills_by_default_only_on_a_cpu_decode_instance():
    import torch

    from kvpush.engine.engine import CPU_LONG_PREFILL_TOKENS, _long_prefill_limit

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert _long_prefill_limit(SchedulerConfig(), cpu, decodes=True) == CPU_LONG_PREFILL_TOKENS
    assert _long_prefill_limit(SchedulerConfig(), cpu, decodes=False) == 0  # colocated, prefill: vLLM's default
    assert _long_prefill_limit(SchedulerConfig(), cuda, decodes=True) == 0
    assert _long_prefill_limit(SchedulerConfig(long_prefill_token_threshold=0), cpu, decodes=True) == 0
    assert _long_prefill_limit(SchedulerConfig(long_prefill_token_threshold=64), cuda, decodes=False) == 64
    assert _long_prefill_limit(SchedulerConfig(enable_chunked_prefill=False), cpu, decodes=True) == 0
