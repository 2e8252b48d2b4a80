"""vLLM-shaped kv_transfer_params: detection, validation (400 naming the field), mapping to kvpush's
own leg parameters and back, and the vLLM-named metrics. No servers: see test_vllm_router.py."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvpush.errors import InvalidRequestError
from kvpush.instance import vllm_compat as V
from kvpush.instance.generation import EngineRequestError
from kvpush.instance.messages import EngineStats
from kvpush.instance.metrics import ServerMetrics
from kvpush.protocol import kv_params as kp


def _typed(leg: object, cls: type) -> Any:
    """translate_request's answer, checked to be of the leg type the test expects."""
    assert isinstance(leg, cls), leg
    return leg

P_LEG = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
         "remote_block_ids": None, "remote_host": None, "remote_port": None}


def d_leg(**over) -> dict:
    kv = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-0a1b2c3d4e5f",
          "remote_block_ids": [3, 4, 5], "remote_request_id": "9f2c", "remote_host": "10.0.0.1",
          "remote_port": 7100, "tp_size": 1, "remote_num_tokens": 20, "kvpush_lease_expiry": time.time() + 30}
    kv.update(over)
    return {k: v for k, v in kv.items() if v is not ...}


def translate(kv: dict, role: str = "decode", mode: str = "pull", n: int = 1, stream: bool = False):
    return V.translate_request(kv, role, mode, n, stream)


def bad(kv: dict, field: str | None, **kw) -> str:
    with pytest.raises(InvalidRequestError) as e:
        translate(kv, **kw)
    want = f"kv_transfer_params.{field}" if field else "kv_transfer_params"
    assert e.value.param == want and str(e.value).startswith(want), (e.value.param, str(e.value))
    return str(e.value)


def test_shapes_are_told_apart():
    own = kp.params_to_dict(kp.PrefillLegParams(transfer_id="t1", mode=kp.KVMode.PULL))
    assert not V.is_vllm_shaped(own) and not V.is_vllm_shaped(None) and not V.is_vllm_shaped({"x": 1})
    assert V.is_vllm_shaped(P_LEG) and V.is_vllm_shaped(d_leg())


def test_prefill_leg_becomes_a_pull_prefill_leg():
    leg = _typed(translate(P_LEG, role="prefill"), kp.PrefillLegParams)
    assert leg.mode is kp.KVMode.PULL and leg.do_remote_decode
    # every leg gets a fresh transfer id
    assert _typed(translate(P_LEG, role="prefill"), kp.PrefillLegParams).transfer_id != leg.transfer_id


def test_decode_leg_maps_every_field():
    leg = _typed(translate(d_leg()), kp.DecodeLegParams)
    assert (leg.transfer_id, leg.prefill_engine_id, leg.prefill_kv_host, leg.prefill_kv_port) == \
        ("9f2c", "prefill-0a1b2c3d4e5f", "10.0.0.1", 7100)
    assert leg.block_ids == [3, 4, 5] and leg.num_tokens == 20 and leg.mode is kp.KVMode.PULL
    # vLLM versions with a hybrid KV cache send one list per KV cache group
    assert _typed(translate(d_leg(remote_block_ids=[[3, 4]])), kp.DecodeLegParams).block_ids == [3, 4]


def test_prefill_result_round_trips_through_the_router():
    result = kp.PrefillResult(transfer_id="9f2c", mode=kp.KVMode.PULL, prefill_engine_id="prefill-0a1b2c3d4e5f",
                              prefill_kv_host="10.0.0.1", prefill_kv_port=7100, num_tokens=20, block_ids=[7, 8],
                              lease_expiry=time.time() + 30, first_token_id=5)
    out = V.vllm_response({"choices": [{"text": "x", "kv_transfer_params": result}]}, "prefill")
    kv = out["kv_transfer_params"]
    assert "kv_transfer_params" not in out["choices"][0]
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False and kv["remote_block_ids"] == [7, 8]
    leg = _typed(translate(kv), kp.DecodeLegParams)  # what D gets when a router forwards it verbatim
    assert (leg.transfer_id, leg.block_ids, leg.lease_expiry) == ("9f2c", [7, 8], result.lease_expiry)
    assert V.vllm_response({"choices": [{"text": "y"}]}, "decode")["kv_transfer_params"] is None  # D's answer
    with pytest.raises(EngineRequestError, match="without KV parameters") as e:  # P's leg without them
        V.vllm_response({"choices": [{"text": "y", "finish_reason": "abort"}]}, "prefill")
    assert e.value.status == 502


@pytest.mark.parametrize("field", ["remote_engine_id", "remote_host", "remote_port", "remote_request_id",
                                   "remote_block_ids", "remote_num_tokens", "kvpush_lease_expiry"])
def test_partial_decode_leg_names_the_missing_field(field):
    assert "missing" in bad(d_leg(**{field: ...}), field)
    assert "missing" in bad(d_leg(**{field: None}), field)


@pytest.mark.parametrize(("field", "value"), [("remote_port", "7100"), ("remote_port", True),
                                              ("remote_block_ids", []), ("remote_block_ids", [1, -2]),
                                              ("remote_block_ids", [[1], [2]]), ("remote_engine_id", 5),
                                              ("do_remote_prefill", "yes"), ("remote_num_tokens", 2.5)])
def test_wrong_types_name_the_field(field, value):
    bad(d_leg(**{field: value}), field)


def test_stale_parameters_are_refused():
    assert "stale" in bad(d_leg(kvpush_lease_expiry=time.time() - 5), "kvpush_lease_expiry")


def test_legs_sent_to_the_wrong_place():
    bad(P_LEG, "do_remote_decode", role="decode")
    bad(d_leg(), "do_remote_prefill", role="prefill")
    bad({"do_remote_decode": False, "do_remote_prefill": False}, "do_remote_decode", role="prefill")
    bad({**P_LEG, "do_remote_prefill": True}, None, role="prefill")
    assert "colocated" in bad(d_leg(), None, role="colocated")
    with pytest.raises(InvalidRequestError, match="one prompt"):
        translate(P_LEG, role="prefill", n=2)
    with pytest.raises(InvalidRequestError, match="must not stream"):
        translate(P_LEG, role="prefill", stream=True)


def test_push_legs_need_no_block_ids_and_keep_the_routers_transfer_id():
    p = _typed(translate({**P_LEG, "transfer_id": "xfer-1f2e"}, role="prefill", mode="push"),
                            kp.PrefillLegParams)
    assert (p.transfer_id, p.mode, p.decode_engine_id) == ("xfer-1f2e", kp.KVMode.PUSH, None)
    bad({**P_LEG, "transfer_id": "bad id!"}, "transfer_id", role="prefill", mode="push")
    d = _typed(translate(d_leg(remote_block_ids=..., remote_num_tokens=..., kvpush_lease_expiry=...),
                                      mode="push-layerwise"), kp.DecodeLegParams)
    assert (d.mode, d.block_ids, d.prefill_kv_port) == (kp.KVMode.PUSH_LAYERWISE, None, 7100)
    mooncake = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "xfer-9",
                "remote_engine_id": "prefill-0a1b2c3d4e5f", "remote_host": "10.0.0.1", "remote_port": 7100}
    assert _typed(translate(mooncake, mode="push"), kp.DecodeLegParams).transfer_id == "xfer-9"
    assert "missing" in bad({**mooncake, "remote_host": None}, "remote_host", mode="push")


def test_explicitly_local_request_on_decode_is_served_locally():
    assert translate({"do_remote_decode": False, "do_remote_prefill": False}) is None


def test_metrics_under_vllm_names():
    m = ServerMetrics("tiny")
    m.update_engine(EngineStats(num_running=2, num_waiting=1, num_waiting_for_kv=3, num_free_blocks=30,
                                num_total_blocks=40, num_preemptions=4), 6)
    m.observe_request(0.25, 1.0, 4, "length")
    m.prompt_tokens.inc(11)
    text = m.render().decode()
    lab = '{engine="0",model_name="tiny"}'
    for line in (f"vllm:num_requests_running{lab} 2.0", f"vllm:num_requests_waiting{lab} 4.0",
                 f"vllm:kv_cache_usage_perc{lab} 0.25", f"vllm:gpu_cache_usage_perc{lab} 0.25",
                 f"vllm:num_preemptions_total{lab} 4.0", f"vllm:prompt_tokens_total{lab} 11.0",
                 f"vllm:time_to_first_token_seconds_sum{lab} 0.25", f"vllm:e2e_request_latency_seconds_count{lab} 1.0",
                 f"vllm:time_per_output_token_seconds_sum{lab} 0.25",
                 'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 1.0',
                 "kvpush_num_requests_running 2.0"):
        assert line in text, line
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.25",model_name="tiny"} 1.0' in text


def test_up_behind_vllm_router_needs_the_binary(monkeypatch):
    from kvpush.errors import KVPushError
    from kvpush.launcher import up

    monkeypatch.setattr(up.shutil, "which", lambda name: None)
    monkeypatch.setattr(up.os, "access", lambda path, mode: False)
    with pytest.raises(KVPushError, match="pip install vllm-router"):
        up.Deployment("m", 1, 1, "pull", 8000, [], [], log_dir="/tmp", router="vllm-router")
    argv = up.vllm_router_argv(8000, {"prefill": ["http://p"], "decode": ["http://d1", "http://d2"]},
                               ["--policy", "least-loaded"])
    assert argv[argv.index("--policy") + 1] == "power_of_two"
    assert argv.count("--decode") == 2 and "--vllm-pd-disaggregation" in argv
    push = up.vllm_router_argv(8000, {"prefill": ["http://127.0.0.1:8100"], "decode": ["http://d"]}, [], "push")
    assert push[push.index("--kv-connector") + 1] == "mooncake"
    assert push[push.index("--prefill") + 1: push.index("--prefill") + 3] == ["http://127.0.0.1:8100", "8100"]
