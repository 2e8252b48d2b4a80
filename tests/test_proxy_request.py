"""The proxy's typed view of a client's request (kvpush/proxy/request.py): parsed once, forwarded as sent."""

from __future__ import annotations

import json

import msgspec
import pytest
from aiohttp import web

from kvpush.config import KVMode
from kvpush.protocol import kv_params as kp
from kvpush.protocol.trace import Trace
from kvpush.proxy.request import ClientRequest


def parse(body: object, path: str = "/v1/completions") -> ClientRequest:
    return ClientRequest.parse(path, json.dumps(body).encode())


@pytest.mark.parametrize("data, reason", [(b"{not json", "malformed JSON"), (b"[1, 2]", "JSON object"),
                                          (b'{"prompt": "x", "kv_transfer_params": {}}', "set by the proxy")])
def test_bad_bodies_are_400s_that_say_why(data: bytes, reason: str):
    with pytest.raises(web.HTTPBadRequest) as e:
        ClientRequest.parse("/v1/completions", data)
    assert reason in (e.value.reason or "")


def test_fields_the_proxy_reads():
    r = parse({"prompt": "hi", "stream": True, "max_tokens": 3, "unknown_field": [1]})
    assert (r.stream, r.prompt, r.messages, r.wants_logprobs, r.seeded) == (True, "hi", None, False, False)
    chat = parse({"messages": [{"role": "user", "content": "x"}], "prompt": "ignored"}, "/v1/chat/completions")
    assert chat.prompt is None and chat.messages == [{"role": "user", "content": "x"}]


def test_legs_forward_the_body_as_sent_plus_their_params():
    r = parse({"prompt": "hi", "unknown_field": [1], "max_tokens": 7})
    assert r.leg(None) == {"prompt": "hi", "unknown_field": [1], "max_tokens": 7}
    params = kp.PrefillLegParams(transfer_id=kp.new_transfer_id(), mode=KVMode.PUSH)
    leg = r.leg(params)
    assert leg["kv_transfer_params"] == kp.params_to_dict(params) and leg["unknown_field"] == [1]
    assert "kv_transfer_params" not in r.body  # the client's body is not changed


def test_batches_split_into_one_request_per_prompt():
    r = parse({"prompt": ["a", [1, 2]], "max_tokens": 2})
    assert r.batch() == ["a", [1, 2]]
    one = r.with_prompt([1, 2])
    assert one.prompt == [1, 2] and one.body == {"prompt": [1, 2], "max_tokens": 2} and one.batch() is None
    assert parse({"prompt": ["only one"]}).batch() is None
    assert parse({"messages": []}, "/v1/chat/completions").batch() is None


def test_a_trace_is_typed_and_travels_as_the_stamps_that_were_set():
    t = Trace(proxy_received=1.0)
    t.set("d_ready", 2.0)
    t.set_once("d_ready", 3.0)  # stamped already: kept
    with pytest.raises(AttributeError):
        t.set("no_such_stamp", 1.0)
    assert t.stamps() == {"proxy_received": 1.0, "d_ready": 2.0}
    assert json.loads(msgspec.json.encode(t)) == t.stamps()  # no nulls on the wire
    got = Trace.from_json({"api_received": 5, "arrived": "x", "unknown": 1.0, "first_token": True, "prefill_done": 6.5})
    assert got.stamps() == {"api_received": 5.0, "prefill_done": 6.5}  # numbers of known stamps only
    assert got.as_prefill().stamps() == {"p_api_received": 5.0, "p_prefill_done": 6.5}
    merged = got.merged(Trace(api_received=9.0))
    assert merged.api_received == 9.0 and got.api_received == 5.0  # a copy; the original unchanged
