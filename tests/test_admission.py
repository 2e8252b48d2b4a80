"""Admission control as plain Python: the decision, the scheduler's reserve, the API's view between
two engine stats (engine/admission.py, EngineClient.load)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvpush.config import AdmissionConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvpush.engine.admission import Load, ShedReason, blocks_for, decide
from kvpush.engine.block_manager import BlockManager
from kvpush.engine.request import Request
from kvpush.engine.sampling_params import SamplingParams
from kvpush.engine.scheduler import Scheduler
from kvpush.instance import messages as m
from kvpush.instance.engine_client import EngineClient

BS = 4
IDLE = Load(num_waiting=0, waiting_tokens=0, num_running=0, free_blocks=100, reserved_blocks=0, total_blocks=100)


def load(**kw) -> Load:
    return Load(**{**IDLE.__dict__, **kw})


def test_an_idle_instance_admits():
    assert decide(AdmissionConfig(), IDLE, [10], BS) is None
    assert blocks_for(7, BS) == 2 and blocks_for(8, BS) == 3  # the prompt and its first output token


def test_queue_depth_counts_every_prompt_of_the_request():
    cfg = AdmissionConfig(max_waiting=4)
    assert decide(cfg, load(num_waiting=3), [5], BS) is None
    shed = decide(cfg, load(num_waiting=3), [5, 5], BS)
    assert shed is not None and shed.reason is ShedReason.QUEUE_FULL and shed.status == 429
    assert "3 requests are waiting" in shed.message and "--max-waiting 4" in shed.message


def test_waiting_tokens_bound_spares_a_lone_prompt():
    cfg = AdmissionConfig(max_waiting_tokens=100)
    shed = decide(cfg, load(waiting_tokens=60), [50], BS)
    assert shed is not None and shed.reason is ShedReason.QUEUE_TOKENS_FULL
    assert decide(cfg, load(waiting_tokens=60), [40], BS) is None
    assert decide(cfg, load(waiting_tokens=0), [300], BS) is None  # nothing else waits: never shed for size


def test_kv_cache_counts_what_admitted_requests_still_need():
    cfg = AdmissionConfig()
    assert decide(cfg, load(free_blocks=10, reserved_blocks=7), [11], BS) is None  # 3 blocks fit in 10 - 7
    shed = decide(cfg, load(free_blocks=10, reserved_blocks=8), [11], BS)
    assert shed is not None and shed.reason is ShedReason.KV_CACHE_FULL and "needs 3 blocks" in shed.message
    shed = decide(cfg, load(free_blocks=10), [11, 11, 11, 11], BS)  # 4 x 3 blocks
    assert shed is not None and shed.reason is ShedReason.KV_CACHE_FULL


def test_headroom_is_kept_only_for_a_running_batch():
    cfg = AdmissionConfig(kv_headroom=0.5)
    busy = load(num_running=1, free_blocks=60)
    assert decide(cfg, busy, [4 * 9], BS) is None  # 10 blocks fit in 60 - 50
    assert decide(cfg, busy, [4 * 10], BS) is not None
    assert decide(cfg, load(num_running=0, free_blocks=60), [4 * 50], BS) is None  # nothing runs: all may be used


def test_reasons_map_to_statuses_and_config_is_checked():
    assert [r.status for r in ShedReason] == [429, 429, 429, 503]
    for bad in ({"max_waiting": 0}, {"max_waiting_tokens": 0}, {"kv_headroom": 1.0}, {"kv_headroom": -0.1},
                {"retry_after_s": -1}):
        with pytest.raises(ValueError):
            AdmissionConfig(**bad)


def test_scheduler_reserves_prompt_and_next_token_of_unfinished_requests():
    bm = BlockManager(32, BS)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=6), bm, max_model_len=256)
    a = Request("a", list(range(10)), SamplingParams(max_tokens=4))
    b = Request("b", list(range(7)), SamplingParams(max_tokens=4))
    s.add(a)
    s.add(b)
    assert s.num_blocks_to_start() == 3 + 2 and s.num_waiting_tokens() == 17
    out = s.schedule()  # a's first chunk of 6 tokens: 2 blocks taken, 1 more needed for its prompt + token
    assert out.scheduled == [(a, 6)] and len(a.block_table) == 2
    assert s.num_blocks_to_start() == 1 + 2 and bm.num_free_blocks == 30
    s.update(out, {})
    s.update(s.schedule(), {"a": 1})  # a's prompt done, its first token sampled
    assert s.num_waiting_tokens() == 7


def client() -> tuple[EngineClient, list[bytes]]:
    sent: list[bytes] = []
    c = EngineClient(EngineConfig(ModelConfig("unused"), scheduler=SchedulerConfig(max_num_seqs=1)))
    c.info = m.CoreReady(max_model_len=256, vocab_size=100, num_blocks=40, block_size=BS)
    c.stats = m.EngineStats(num_free_blocks=40, num_total_blocks=40)
    c.healthy = True
    c._to_core = SimpleNamespace(send_bytes=sent.append)  # type: ignore[assignment]
    return c, sent


def add(c: EngineClient, rid: str, n: int) -> None:
    c.add(m.AddRequest(rid, list(range(n)), SamplingParams(max_tokens=4)))


def test_api_view_counts_requests_sent_since_the_last_stats():
    """Between two stats the API counts what it sent itself, so a burst cannot overrun the cache."""
    c, sent = client()
    add(c, "a", 11)  # 3 blocks
    add(c, "b", 7)  # 2 blocks
    view = c.load()
    assert (view.num_waiting, view.waiting_tokens, view.reserved_blocks) == (1, 18, 5) and len(sent) == 2
    # The core took in "a" only; it runs, holding its 3 blocks
    c._dispatch(m.StepOutputs([], m.EngineStats(num_running=1, num_free_blocks=37, num_total_blocks=40,
                                                num_added=1)))
    view = c.load()
    assert (view.num_waiting, view.free_blocks, view.reserved_blocks) == (1, 37, 2)  # one beyond a batch of 1
    c._dispatch(m.StepOutputs([m.RequestDelta("a", [5])], m.EngineStats(num_running=1, num_free_blocks=37,
                                                                         num_total_blocks=40, num_added=2,
                                                                         kv_reserved_blocks=2)))
    view = c.load()
    assert (view.waiting_tokens, view.reserved_blocks) == (7, 2)  # a has its first token; b is the core's now
    c.abort("b")
    assert c.load().waiting_tokens == 0 and isinstance(m.to_core_decoder.decode(sent[-1]), m.AbortRequest)


def test_api_refuse_tells_the_core():
    from kvpush.config import KVMode
    from kvpush.protocol.kv_params import DecodeLegParams

    c, sent = client()
    leg = DecodeLegParams(transfer_id="t", mode=KVMode.PUSH, prefill_engine_id="prefill-0",
                          prefill_kv_host="127.0.0.1", prefill_kv_port=7000)
    c.refuse(leg)
    msg = m.to_core_decoder.decode(sent[-1])
    assert isinstance(msg, m.RefuseLeg) and msg.kv_transfer_params == leg


def test_engine_core_bounds_its_own_queue_and_refuses_the_leg():
    """The core decides again on its exact state: past the bound it answers 429 itself and its KV
    connector tells the peer, whatever the API process let through."""
    from kvpush.config import KVMode
    from kvpush.instance.engine_core import EngineCore
    from kvpush.protocol.kv_params import DecodeLegParams

    bm = BlockManager(32, BS)
    s = Scheduler(SchedulerConfig(max_num_seqs=1), bm, max_model_len=256)
    added, out, refused = [], [], []

    def add_request(rid, ids, params, kv):
        added.append(rid)
        s.add(Request(rid, ids, params))

    engine = SimpleNamespace(scheduler=s, block_manager=bm, add_request=add_request)
    core = EngineCore(engine, None, SimpleNamespace(send_bytes=out.append), None,  # type: ignore[arg-type]
                      connector=SimpleNamespace(refuse=refused.append), admission=AdmissionConfig(max_waiting=1))
    leg = DecodeLegParams(transfer_id="t", mode=KVMode.PUSH, prefill_engine_id="prefill-0",
                          prefill_kv_host="127.0.0.1", prefill_kv_port=7000)
    for rid in ("a", "b", "c"):  # a runs (a batch of 1), b waits, c is one too many
        core.handle(m.AddRequest(rid, [1, 2, 3], SamplingParams(max_tokens=4), leg))
    assert added == ["a", "b"] and refused == [leg]
    (step,) = [m.from_core_decoder.decode(b) for b in out]
    (delta,) = step.deltas
    assert (delta.request_id, delta.error_status, delta.shed) == ("c", 429, "queue_full")
    assert core.num_added == 3 and s.num_blocks_to_start() == 2  # what the next stats report


def test_a_decode_legs_prompt_is_not_prefill_work_here():
    from kvpush.config import KVMode
    from kvpush.protocol.kv_params import DecodeLegParams

    c, _ = client()
    leg = DecodeLegParams(transfer_id="t", mode=KVMode.PUSH, prefill_engine_id="prefill-0",
                          prefill_kv_host="127.0.0.1", prefill_kv_port=7000)
    c.add(m.AddRequest("leg", list(range(50)), SamplingParams(max_tokens=4), leg))
    add(c, "plain", 7)
    assert c.load().waiting_tokens == 7 and c.load().reserved_blocks == blocks_for(50, BS) + 2
    s = Scheduler(SchedulerConfig(), BlockManager(32, BS), max_model_len=256)
    s.add(Request("leg", list(range(50)), SamplingParams(max_tokens=4), remote_prefill=True))
    s.add(Request("plain", list(range(7)), SamplingParams(max_tokens=4)))
    assert s.num_waiting_tokens() == 7
