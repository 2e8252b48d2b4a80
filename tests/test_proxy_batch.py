"""The proxy's pure helpers for batched prompts and the per-request first-token choice (no servers)."""

from __future__ import annotations

import pytest

from kvpush.config import FirstToken, KVMode
from kvpush.protocol import kv_params as kp
from kvpush.proxy.batch import sum_usage
from kvpush.proxy.request import ClientRequest

C = "/v1/completions"


@pytest.mark.parametrize(("prompt", "expected"), [
    (["a", "b"], ["a", "b"]),
    ([[1, 2], "b", [3]], [[1, 2], "b", [3]]),
    (["a"], None),  # one prompt: an ordinary request
    ([1, 2, 3], None),  # one token-id prompt
    ("a", None),
    (["a", 5], None),  # not a prompt shape: the instance answers the 400
    (["a", []], None),
    ([], None),
    (None, None),
])
def test_batched_prompts(prompt, expected):
    assert ClientRequest.of(C, {"prompt": prompt}).batch() == expected


def test_chat_is_never_split():
    assert ClientRequest.of("/v1/chat/completions", {"prompt": ["a", "b"]}).batch() is None


def test_usage_summed_field_by_field():
    a = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0}}
    b = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 4}}
    assert sum_usage([a, b]) == {"prompt_tokens": 8, "completion_tokens": 5, "total_tokens": 13,
                                 "prompt_tokens_details": {"cached_tokens": 4}}
    assert sum_usage([None, None]) is None


@pytest.mark.parametrize(("body", "expected"), [
    ({}, FirstToken.FROM_PREFILL),
    ({"temperature": 0, "seed": 3}, FirstToken.FROM_PREFILL),  # greedy: the seed changes nothing
    ({"seed": 3}, FirstToken.RECOMPUTE),  # default temperature 1: P's generator is not D's
    ({"temperature": 0.5, "seed": 0}, FirstToken.RECOMPUTE),
    ({"logprobs": 0}, FirstToken.RECOMPUTE),  # completions: the sampled token's logprob
    ({"logprobs": True}, FirstToken.RECOMPUTE),  # chat
    ({"logprobs": False}, FirstToken.FROM_PREFILL),
    ({"logprobs": None}, FirstToken.FROM_PREFILL),
])
def test_first_token_recomputed_where_p_cannot_match(body, expected):
    assert ClientRequest.of(C, body).first_token(FirstToken.FROM_PREFILL) is expected
    assert ClientRequest.of(C, body).first_token(FirstToken.RECOMPUTE) is FirstToken.RECOMPUTE


def test_prefill_leg_is_the_clients_body():
    body = {"prompt": "a", "max_tokens": 50, "stream": True, "logprobs": 2, "min_tokens": 3}
    params = kp.PrefillLegParams(transfer_id=kp.new_transfer_id(), mode=KVMode.PUSH)
    assert ClientRequest.of(C, body).leg(params) == {**body, "kv_transfer_params": kp.params_to_dict(params)}
