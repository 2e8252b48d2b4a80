"""The prefill and decode connectors on the engine thread: a real scheduler and block manager
behind `EngineHooks`; the transfer runtime is replaced by a recorder of the commands the connector
submits and a queue of the events it would get (no agent, no thread, no sockets)."""

from __future__ import annotations

import queue
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvpush.config import FirstToken, KVMode, OnKVFailure, Role, SchedulerConfig, TransferConfig
from kvpush.engine.block_manager import BlockManager
from kvpush.engine.kv_connector import EngineHooks
from kvpush.engine.request import Request, RequestStatus
from kvpush.engine.sampling_params import SamplingParams
from kvpush.engine.scheduler import Scheduler
from kvpush.errors import InvalidRequestError
from kvpush.protocol.kv_params import DecodeLegParams, PrefillLegParams, PrefillResult
from kvpush.transfer import protocol as pr
from kvpush.transfer.commands import Cancel, Hold, LayersDone, Register, SendNotif
from kvpush.transfer.decode_connector import DecodeConnector
from kvpush.transfer.events import FreeBlocks, KVFailed, KVReady
from kvpush.transfer.prefill_connector import PrefillConnector

BS, NUM_BLOCKS = 4, 16
TID = "t0"


class Runtime:
    """What a connector uses of TransferRuntime: mode, role, the thread's submit, the event queue."""

    def __init__(self, role: Role, mode: KVMode) -> None:
        self.role, self.mode = role, mode
        self.engine_id, self.kv_host, self.kv_port = f"{role.value}-0", "127.0.0.1", 7000
        self.kv_address = f"{self.kv_host}:{self.kv_port}"
        self.submitted: list[Any] = []
        self.thread = SimpleNamespace(submit=self.submitted.append)
        self.events: queue.SimpleQueue = queue.SimpleQueue()

    def post(self, event: Any) -> None:
        self.events.put(event)

    def drain_events(self) -> list[Any]:
        out = []
        while not self.events.empty():
            out.append(self.events.get())
        return out


class Engine:
    def __init__(self) -> None:
        self.blocks = BlockManager(NUM_BLOCKS, BS)
        self.scheduler = Scheduler(SchedulerConfig(), self.blocks, max_model_len=256)
        self.runner = SimpleNamespace(layer_hook=None)
        self.hooks = EngineHooks(self.scheduler, self.blocks, self.runner, SimpleNamespace(kv=torch.zeros(1)),  # type: ignore[arg-type]
                                 on_token=lambda request: None)


def connect(cls, role: Role, mode: KVMode, **config: Any):
    runtime, engine = Runtime(role, mode), Engine()
    connector = cls(runtime, TransferConfig(kv_mode=mode, **config))
    connector.attach(engine.hooks)
    engine.scheduler.hold = connector.on_finished
    return connector, runtime, engine


def request(n: int, max_tokens: int = 4) -> Request:
    return Request(f"r{n}", list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, temperature=0.0))


def d_leg(mode: KVMode = KVMode.PUSH, first: FirstToken = FirstToken.FROM_PREFILL, **kw: Any) -> DecodeLegParams:
    return DecodeLegParams(transfer_id=TID, mode=mode, prefill_engine_id="prefill-0", prefill_kv_host="127.0.0.1",
                           prefill_kv_port=7000, first_token=first, **kw)


# ---- decode ------------------------------------------------------------------------------------


def test_decode_checks_the_leg():
    d, _, _ = connect(DecodeConnector, Role.DECODE, KVMode.PUSH)
    d.on_add(request(9), None)  # a plain request: computed locally
    with pytest.raises(InvalidRequestError, match="DecodeLegParams"):
        d.on_add(request(9), PrefillLegParams(transfer_id=TID, mode=KVMode.PULL))
    with pytest.raises(InvalidRequestError, match="--kv-mode push"):
        d.on_add(request(9), d_leg(KVMode.PULL, block_ids=[1, 2, 3], num_tokens=9, lease_expiry=time.time() + 9,
                                   first_token_id=5))


def test_decode_admit_parks_and_registers_then_kv_ready_resumes_with_p_token():
    d, rt, eng = connect(DecodeConnector, Role.DECODE, KVMode.PUSH)
    r = request(9)
    d.on_add(r, d_leg())
    eng.scheduler.add(r)
    out = eng.scheduler.schedule(d.admit)
    assert out.empty and r.status is RequestStatus.WAITING_FOR_REMOTE_KV and r.request_id in eng.scheduler.remote
    (reg,) = rt.submitted
    assert isinstance(reg, Register) and reg.block_ids == tuple(r.block_table[:3]) and reg.num_prefix_tokens == 0
    rt.post(KVReady(TID, r.request_id, 42))
    assert d.poll() == [r]
    assert r.output_token_ids == [42] and r.num_computed_tokens == 9 and eng.scheduler.waiting[0] is r


@pytest.mark.parametrize("mode", [KVMode.PUSH, KVMode.PULL])
def test_decode_without_free_blocks_refuses_and_tells_prefill(mode):
    """D registers nothing it has no blocks for: the request is shed (429, kv_cache_full), P hears Abort
    and frees its copy, and no block of D's stays taken."""
    d, rt, eng = connect(DecodeConnector, Role.DECODE, mode)
    hog = request(NUM_BLOCKS * BS - 2)  # a plain request holding all but one block
    eng.scheduler.add(hog)
    eng.scheduler.schedule(d.admit)
    free = eng.blocks.num_free_blocks
    r = request(9)
    pull = {"block_ids": [1, 2, 3], "num_tokens": 9, "lease_expiry": time.time() + 9, "first_token_id": 5}
    d.on_add(r, d_leg(mode, **(pull if mode is KVMode.PULL else {})))
    eng.scheduler.add(r)
    out = eng.scheduler.schedule(d.admit)
    assert out.rejected == [r] and r.status is RequestStatus.FINISHED_ERROR
    assert r.shed == "kv_cache_full" and "KV cache full" in (r.error or "")
    (abort,) = rt.submitted
    assert isinstance(abort, SendNotif) and abort.message == pr.Abort(TID) and abort.peer.engine_id == "prefill-0"
    assert d.requests == {} and eng.blocks.num_free_blocks == free and r.block_table == []


def test_decode_refuse_of_a_shed_leg_tells_prefill():
    d, rt, _ = connect(DecodeConnector, Role.DECODE, KVMode.PUSH)
    d.refuse(d_leg())
    (abort,) = rt.submitted
    assert isinstance(abort, SendNotif) and abort.message == pr.Abort(TID)
    d.refuse(PrefillLegParams(transfer_id=TID, mode=KVMode.PUSH))  # not a decode leg: nothing to tell
    d.refuse(d_leg(KVMode.PULL, FirstToken.RECOMPUTE, block_ids=[1], num_tokens=4, lease_expiry=time.time() + 9))
    assert len(rt.submitted) == 1


@pytest.mark.parametrize("policy", list(OnKVFailure))
def test_decode_late_request_is_rejected_or_computed_locally(policy):
    d, rt, eng = connect(DecodeConnector, Role.DECODE, KVMode.PUSH, kv_timeout_s=0.001, on_kv_failure=policy)
    r = request(9)
    d.on_add(r, d_leg())
    eng.scheduler.add(r)
    time.sleep(0.002)  # past the KV deadline: the point of the test, not a wait for another thread
    out = eng.scheduler.schedule(d.admit)
    (abort,) = rt.submitted
    assert isinstance(abort, SendNotif) and isinstance(abort.message, pr.Abort)
    if policy is OnKVFailure.ERROR:
        assert out.rejected == [r] and r.status is RequestStatus.FINISHED_ERROR and "deadline" in (r.error or "")
    else:
        assert out.scheduled == [(r, 9)] and r.kv_state is None and not r.remote_prefill and d.requests == {}
    assert d.requests == {}


@pytest.mark.parametrize("policy", list(OnKVFailure))
def test_decode_kv_failed(policy):
    d, rt, eng = connect(DecodeConnector, Role.DECODE, KVMode.PUSH, on_kv_failure=policy)
    r = request(9)
    d.on_add(r, d_leg())
    eng.scheduler.add(r)
    eng.scheduler.schedule(d.admit)
    held = list(r.block_table[:3])
    rt.post(KVFailed(TID, r.request_id, "P failed"))
    out = d.poll()
    assert not set(held) & set(r.block_table)  # detached: quarantined until a FreeBlocks
    if policy is OnKVFailure.ERROR:
        assert out == [r] and r.status is RequestStatus.FINISHED_ERROR and "P failed" in (r.error or "")
    else:
        assert out == [] and r.status is RequestStatus.WAITING and r.kv_state is None and r.block_table == []
    free = eng.blocks.num_free_blocks
    rt.post(FreeBlocks(held))
    d.poll()
    assert eng.blocks.num_free_blocks == free + len(held)


def test_decode_abort_while_receiving_cancels_the_transfer():
    d, rt, eng = connect(DecodeConnector, Role.DECODE, KVMode.PUSH)
    r = request(9)
    d.on_add(r, d_leg())
    eng.scheduler.add(r)
    eng.scheduler.schedule(d.admit)
    eng.scheduler.finish(r, RequestStatus.FINISHED_ABORTED)
    assert isinstance(rt.submitted[-1], Cancel) and rt.submitted[-1].transfer_id == TID
    rt.post(KVReady(TID, r.request_id, 42))
    assert d.poll() == [] and r.output_token_ids == []  # a late outcome is harmless


def test_decode_full_prefix_hit_releases_p():
    d, rt, eng = connect(DecodeConnector, Role.DECODE, KVMode.PUSH)
    first = request(9)
    eng.scheduler.add(first)
    eng.scheduler.update(eng.scheduler.schedule(), {})  # computed here: its full blocks are cached
    r = Request("again", list(first.prompt_token_ids), SamplingParams(max_tokens=4))
    d.on_add(r, d_leg(first=FirstToken.RECOMPUTE))
    eng.scheduler.add(r)
    eng.scheduler.schedule(d.admit)
    (release,) = rt.submitted
    assert isinstance(release, SendNotif) and isinstance(release.message, pr.Release)
    assert r.num_cached_tokens == 8 and d.poll() == []
    assert r.num_computed_tokens == 8 and eng.scheduler.waiting[0] is r  # only the last position to compute


@pytest.mark.parametrize("mode,first", [(KVMode.PUSH, FirstToken.RECOMPUTE), (KVMode.PUSH_LAYERWISE, FirstToken.RECOMPUTE),
                                        (KVMode.PULL, FirstToken.RECOMPUTE), (KVMode.PUSH, FirstToken.FROM_PREFILL)])
def test_decode_holding_all_but_a_partial_block_computes_the_tail_in_push_recompute(mode, first):
    """D holds 2 full blocks of an 11-token prompt (tail of 2 tokens before the last position): push with
    recompute computes them itself and releases P; pull and from-prefill still receive the partial block."""
    d, rt, eng = connect(DecodeConnector, Role.DECODE, mode)
    first_req = request(9)
    eng.scheduler.add(first_req)
    eng.scheduler.update(eng.scheduler.schedule(), {})  # computed here: its 2 full blocks are cached
    r = Request("longer", list(first_req.prompt_token_ids) + [50, 51], SamplingParams(max_tokens=4))
    pull = {"block_ids": [0, 1, 2], "num_tokens": 11, "lease_expiry": time.time() + 60} if mode is KVMode.PULL else {}
    d.on_add(r, d_leg(mode, first, **pull))
    eng.scheduler.add(r)
    eng.scheduler.schedule(d.admit)
    (cmd,) = rt.submitted
    local = mode.is_push and first is FirstToken.RECOMPUTE
    assert r.num_cached_tokens == 2 * BS
    if not local:
        assert not isinstance(cmd, SendNotif) and list(cmd.block_ids) == [r.block_table[2]]
        return
    assert isinstance(cmd, SendNotif) and isinstance(cmd.message, pr.Release)
    assert d.poll() == [] and r.num_computed_tokens == 2 * BS  # the tail (3 tokens) is computed on D
    assert (r, 3) in eng.scheduler.schedule().scheduled  # a prefill of the tail and the last position


# ---- prefill -----------------------------------------------------------------------------------


def test_prefill_holds_blocks_and_answers_with_its_result():
    p, rt, eng = connect(PrefillConnector, Role.PREFILL, KVMode.PULL, kv_lease_s=5.0)
    r = request(9, max_tokens=30)
    with pytest.raises(InvalidRequestError):
        p.on_add(r, None)
    p.on_add(r, PrefillLegParams(transfer_id=TID, mode=KVMode.PULL))
    assert r.sampling_params.max_tokens == 1
    eng.scheduler.add(r)
    out = eng.scheduler.schedule(p.admit)
    blocks = list(r.block_table)
    eng.scheduler.update(out, {r.request_id: 77})
    assert r.status is RequestStatus.FINISHED_LENGTH and r.block_table == []
    (hold,) = rt.submitted
    assert isinstance(hold, Hold) and list(hold.block_ids) == blocks and hold.first_token_id == 77
    result = p.result(r)
    assert isinstance(result, PrefillResult) and result.block_ids == blocks and result.first_token_id == 77
    assert eng.blocks.num_free_blocks == NUM_BLOCKS - len(blocks)  # held until the transfer ends
    rt.post(FreeBlocks(blocks))
    p.poll()
    assert eng.blocks.num_free_blocks == NUM_BLOCKS


def test_prefill_aborted_before_its_prefill_cancels():
    p, rt, eng = connect(PrefillConnector, Role.PREFILL, KVMode.PUSH)
    r = request(9)
    p.on_add(r, PrefillLegParams(transfer_id=TID, mode=KVMode.PUSH, decode_engine_id="decode-0"))
    eng.scheduler.add(r)
    eng.scheduler.finish(r, RequestStatus.FINISHED_ABORTED)
    (cancel,) = rt.submitted
    assert isinstance(cancel, Cancel) and cancel.peer_engine_id == "decode-0"


def test_prefill_layerwise_hands_each_block_once():
    p, rt, eng = connect(PrefillConnector, Role.PREFILL, KVMode.PUSH_LAYERWISE)
    r = request(10)
    p.on_add(r, PrefillLegParams(transfer_id=TID, mode=KVMode.PUSH_LAYERWISE, decode_engine_id="decode-0"))
    r.block_table = [5, 6, 7]
    p.before_forward([(r, 6)])  # first chunk: block 0 full, block 1 not yet
    eng.runner.layer_hook(0)
    p.before_forward([(r, 0)])
    assert eng.runner.layer_hook is None  # nothing new: no hook
    r.num_computed_tokens = 6
    p.before_forward([(r, 4)])  # last chunk: blocks 1 and the partial 2
    eng.runner.layer_hook(1)
    done = [c for c in rt.submitted if isinstance(c, LayersDone)]
    assert [(c.layer, c.items) for c in done] == [(0, ((TID, (0,), (5,)),)), (1, ((TID, (1, 2), (6, 7)),))]
