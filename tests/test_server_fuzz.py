"""Property-based fuzz of request bodies: the server never answers 5xx and stays healthy."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.integration
SERVER_ARGS = ["--num-blocks", "128", "--block-size", "4", "--max-model-len", "256"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=False),
                    st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)
small_ints = st.integers(-5, 40)
completion_bodies = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["tiny", "other", None]),
    "prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 3000), max_size=20),
                        st.lists(st.text(max_size=10), max_size=3), json_values),
    "max_tokens": st.one_of(small_ints, json_values),
    "temperature": st.one_of(st.floats(-2, 3, allow_nan=False), json_values),
    "top_p": st.floats(-1, 2, allow_nan=False),
    "top_k": small_ints,
    "seed": st.one_of(st.integers(-3, 2**64), st.none()),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=20)),
    "n": st.integers(0, 3),
    "stream": st.booleans(),
    "logprobs": st.one_of(st.integers(-1, 30), st.none()),
    "ignore_eos": st.booleans(),
    "stream_options": json_values,
})
chat_bodies = st.fixed_dictionaries({"messages": st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bot", "assistant"]),
                                    "content": st.one_of(st.text(max_size=30), json_values)}), max_size=3),
    json_values)}, optional={"max_tokens": small_ints, "stream": st.booleans(), "logprobs": st.booleans(),
                             "top_logprobs": st.integers(-1, 25), "temperature": st.floats(-1, 3, allow_nan=False)})


def send(url: str, path: str, body: object) -> int:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(completion_bodies, json_values))
def test_completion_bodies_never_5xx(module_server, body):
    status = send(module_server.url, "/v1/completions", body)
    assert status < 500, body


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=chat_bodies)
def test_chat_bodies_never_5xx(module_server, body):
    status = send(module_server.url, "/v1/chat/completions", body)
    assert status < 500, body


def test_still_healthy_after_fuzz(module_server):
    with urllib.request.urlopen(module_server.url + "/health", timeout=5) as r:
        assert r.status == 200
