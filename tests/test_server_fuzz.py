"""Property-based fuzz of request bodies: the server never answers 5xx and stays healthy."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import request_bodies
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.integration
SERVER_ARGS = ["--num-blocks", "128", "--block-size", "4", "--max-model-len", "256"]

completion_bodies = request_bodies.completion_bodies("tiny")
chat_bodies = request_bodies.chat_bodies("tiny")


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
@given(body=st.one_of(completion_bodies, request_bodies.json_values))
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
