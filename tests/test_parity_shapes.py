"""Every request shape answers the same through the proxy as from a colocated instance.

One colocated instance and 1P1D in pull, push, push-layerwise and auto, each behind two proxies (first
token recomputed by D, or taken from P): the same requests go to all nine, and the whole answers
are compared (status, choices, text, logprobs, finish reasons, usage, stream framing; ids, timestamps
and cached_tokens aside). Then a seeded fuzz of random bodies through the proxy: the same status as
colocated, never a 5xx; afterwards every instance is healthy, holds no block and no live transfer.
"""

from __future__ import annotations

import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvpush_testing import BS, prompt_of, wait_for
from parity import FIRST_TOKENS, MAX_MODEL_LEN, MODES, assert_same, call, normal, start_world
from request_bodies import chat_bodies, completion_bodies

pytestmark = pytest.mark.integration
C, H = "/v1/completions", "/v1/chat/completions"
TEXT = "The quick brown fox jumps over the lazy dog and"
IDS, IDS2, IDS3 = prompt_of(3 * BS + 5, 1), prompt_of(BS, 2), prompt_of(1, 3)
LONGEST = prompt_of(MAX_MODEL_LEN - 1, 4)  # the longest prompt that fits (one generated token)
TOO_LONG = prompt_of(MAX_MODEL_LEN, 5)
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"}]
DEPLOYMENTS = [f"{m}/{ft}" for m in MODES for ft in FIRST_TOKENS]


@pytest.fixture(scope="module")
def world(tiny_model, tmp_path_factory):
    w = start_world(tiny_model, tmp_path_factory.mktemp("parity"))
    try:
        yield w
    finally:
        w.stop()


@pytest.fixture(scope="module")
def greedy(tiny_model) -> list[int]:
    """The colocated engine's greedy tokens for IDS: stop ids and strings that do occur in the output."""
    from kvpush import LLM, SamplingParams

    out = LLM(tiny_model, block_size=BS, num_blocks=64).generate([IDS], SamplingParams(max_tokens=8, temperature=0,
                                                                                         ignore_eos=True))[0]
    return out.token_ids


def greedy_body(**kw) -> dict:
    return {"max_tokens": 8, "temperature": 0, **kw}


def cases(model: str, out: list[int], stop_text: str) -> dict[str, tuple[str, object, str | None]]:
    """name -> (path, body, what the colocated answer must show: a finish reason, or the error status)."""
    seeded = {"temperature": 0.9, "seed": 1234, "max_tokens": 8}
    return {
        # ---- completions
        "text": (C, greedy_body(model=model, prompt=TEXT), None),
        "text-no-model": (C, greedy_body(prompt=TEXT, max_tokens=6), None),
        "token-ids": (C, greedy_body(prompt=IDS, ignore_eos=True), "length"),
        "one-token-prompt": (C, greedy_body(prompt=IDS3, ignore_eos=True), "length"),
        "longest-prompt-fills-context": (C, {"prompt": LONGEST, "temperature": 0, "ignore_eos": True}, "length"),
        "batch-text": (C, greedy_body(prompt=[TEXT, "Hello", "a b c"], max_tokens=6), None),
        "batch-ids": (C, greedy_body(prompt=[IDS, IDS2, IDS3], ignore_eos=True), "length"),
        "batch-mixed-logprobs": (C, greedy_body(prompt=[TEXT, IDS2], logprobs=2, max_tokens=5), None),
        "batch-of-one": (C, greedy_body(prompt=[TEXT]), None),
        "batch-same-prompt-twice": (C, greedy_body(prompt=[IDS, IDS], ignore_eos=True), "length"),
        "batch-stream": (C, greedy_body(prompt=[TEXT, IDS, "x"], stream=True, ignore_eos=True), "length"),
        "batch-stream-usage": (C, greedy_body(prompt=[IDS2, TEXT], stream=True, logprobs=1, ignore_eos=True,
                                              stream_options={"include_usage": True}), "length"),
        "stream": (C, greedy_body(prompt=TEXT, stream=True), None),
        "stream-usage-logprobs": (C, greedy_body(prompt=IDS, stream=True, logprobs=1, ignore_eos=True,
                                                 stream_options={"include_usage": True}), "length"),
        "stream-no-usage": (C, greedy_body(prompt=IDS, stream=True, stream_options={"include_usage": False}), None),
        "stop-string": (C, greedy_body(prompt=IDS, stop=[stop_text], max_tokens=8, ignore_eos=True), "stop"),
        "stop-string-batch-stream": (C, greedy_body(prompt=[IDS, TEXT], stop=[stop_text, "zzz"], stream=True),
                                     "stop"),
        "stop-id": (C, greedy_body(prompt=IDS, stop_token_ids=[out[2]]), "stop"),
        "stop-id-first-token": (C, greedy_body(prompt=IDS, stop_token_ids=[out[0]]), "stop"),
        "stop-id-first-token-stream": (C, greedy_body(prompt=IDS, stop_token_ids=[out[0]], stream=True), "stop"),
        "min-tokens-masks-stop-id": (C, greedy_body(prompt=IDS, stop_token_ids=[out[0], out[1]], min_tokens=3),
                                     None),
        "min-tokens-above-max": (C, greedy_body(prompt=IDS, min_tokens=20, max_tokens=4), "length"),
        "max-tokens-reached": (C, greedy_body(prompt=IDS, max_tokens=3, ignore_eos=True), "length"),
        "ignore-eos-false": (C, greedy_body(prompt=IDS2, ignore_eos=False), None),
        "default-max-tokens": (C, {"prompt": IDS2, "temperature": 0, "ignore_eos": True}, "length"),
        "logprobs-0": (C, greedy_body(prompt=IDS, logprobs=0, ignore_eos=True), "length"),
        "logprobs-5": (C, greedy_body(prompt=TEXT, logprobs=5, max_tokens=5), None),
        "seed": (C, {**seeded, "prompt": TEXT}, None),
        "seed-top-k-top-p": (C, {**seeded, "prompt": IDS, "temperature": 1.3, "top_k": 20, "top_p": 0.9,
                                 "ignore_eos": True}, "length"),
        "seed-batch-stream": (C, {**seeded, "prompt": [TEXT, IDS], "stream": True, "ignore_eos": True}, "length"),
        "unknown-fields-ignored": (C, greedy_body(prompt=TEXT, user="u1", best_effort={"x": 1}), None),
        # ---- chat
        "chat": (H, greedy_body(model=model, messages=CHAT), None),
        "chat-content-parts": (H, greedy_body(messages=[{"role": "user", "content": [
            {"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]), None),
        "chat-no-generation-prompt": (H, greedy_body(messages=CHAT, add_generation_prompt=False), None),
        "chat-logprobs": (H, greedy_body(messages=CHAT, logprobs=True, top_logprobs=3), None),
        "chat-stream-usage": (H, greedy_body(messages=CHAT, stream=True, stream_options={"include_usage": True}),
                              None),
        "chat-stream": (H, greedy_body(messages=CHAT[:2], stream=True, logprobs=True), None),
        "chat-seed": (H, {**seeded, "messages": CHAT}, None),
        "chat-max-completion-tokens": (H, greedy_body(messages=CHAT, max_completion_tokens=3, ignore_eos=True),
                                       "length"),
        "chat-default-max-tokens": (H, {"messages": CHAT, "temperature": 0, "ignore_eos": True}, "length"),
        # ---- client mistakes: the same 4xx on both paths
        "unknown-model": (C, greedy_body(model="no-such-model", prompt=TEXT), "404"),
        "unknown-model-chat": (H, greedy_body(model="no-such-model", messages=CHAT), "404"),
        "n-2": (C, greedy_body(prompt=TEXT, n=2), "400"),
        "n-2-chat": (H, greedy_body(messages=CHAT, n=2), "400"),
        "temperature-negative": (C, greedy_body(prompt=TEXT, temperature=-0.5), "400"),
        "top-p-above-1": (C, greedy_body(prompt=TEXT, top_p=1.5), "400"),
        "max-tokens-0": (C, greedy_body(prompt=TEXT, max_tokens=0), "400"),
        "max-tokens-string": (C, greedy_body(prompt=TEXT, max_tokens="ten"), "400"),
        "logprobs-negative": (C, greedy_body(prompt=TEXT, logprobs=-1), "400"),
        "logprobs-too-many": (C, greedy_body(prompt=TEXT, logprobs=21), "400"),
        "seed-negative": (C, greedy_body(prompt=TEXT, seed=-1), "400"),
        "min-tokens-negative": (C, greedy_body(prompt=TEXT, min_tokens=-1), "400"),
        "stop-id-negative": (C, greedy_body(prompt=TEXT, stop_token_ids=[-1]), "400"),
        "stop-empty-string": (C, greedy_body(prompt=TEXT, stop=[""]), "400"),
        "presence-penalty": (C, greedy_body(prompt=TEXT, presence_penalty=0.5), "400"),
        "echo": (C, greedy_body(prompt=TEXT, echo=True), "400"),
        "echo-batch": (C, greedy_body(prompt=[TEXT, IDS], echo=True), "400"),
        "suffix": (C, greedy_body(prompt=TEXT, suffix="end"), "400"),
        "prompt-too-long": (C, greedy_body(prompt=TOO_LONG), "400"),
        "prompt-plus-max-tokens-too-long": (C, greedy_body(prompt=LONGEST, max_tokens=2), "400"),
        "batch-one-prompt-too-long": (C, greedy_body(prompt=[IDS, TOO_LONG]), "400"),
        "batch-stream-one-prompt-too-long": (C, greedy_body(prompt=[IDS, IDS2, TOO_LONG], stream=True), "400"),
        "empty-string-prompt": (C, greedy_body(prompt=""), "400"),
        "empty-list-prompt": (C, greedy_body(prompt=[]), "400"),
        "empty-prompt-in-batch": (C, greedy_body(prompt=["a", []]), "400"),
        "empty-string-in-batch": (C, greedy_body(prompt=[TEXT, ""]), "400"),
        "missing-prompt": (C, greedy_body(), "400"),
        "prompt-number": (C, greedy_body(prompt=5), "400"),
        "prompt-mixed-list": (C, greedy_body(prompt=["a", 5]), "400"),
        "token-id-outside-vocab": (C, greedy_body(prompt=[1, 99999]), "400"),
        "token-id-outside-vocab-in-batch": (C, greedy_body(prompt=[IDS, [5000]]), "400"),
        "stream-not-bool": (C, greedy_body(prompt=TEXT, stream="yes"), "400"),
        "stream-options-not-object": (C, greedy_body(prompt=TEXT, stream=True, stream_options="x"), "400"),
        "malformed-json": (C, b'{"prompt": "a",', "400"),
        "body-not-object": (C, [1, 2], "400"),
        "chat-no-messages": (H, greedy_body(messages=[]), "400"),
        "chat-unknown-role": (H, greedy_body(messages=[{"role": "bot", "content": "hi"}]), "400"),
        "chat-image-part": (H, greedy_body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "400"),
        "chat-top-logprobs-without-logprobs": (H, greedy_body(messages=CHAT, top_logprobs=2), "400"),
        "chat-too-long": (H, greedy_body(messages=[{"role": "user", "content": "word " * MAX_MODEL_LEN}]), "400"),
        "chat-max-completion-tokens-too-long": (H, greedy_body(messages=CHAT, max_completion_tokens=MAX_MODEL_LEN),
                                                "400"),
    }


@pytest.fixture(scope="module")
def case_table(tiny_model, greedy):
    from kvpush.models.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(tiny_model)
    stop_text = next(t for t in (tok.decode([i]) for i in greedy[2:]) if t.strip())
    return cases(tiny_model, greedy, stop_text)


@pytest.fixture(scope="module")
def colocated_answers(world, case_table):
    """Each case asked once of the colocated instance, lazily."""
    answers: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in answers:
            path, body, expect = case_table[name]
            answer = call(world.colocated.url, path, body)
            answers[name] = normal(answer)
            _check_case_exercised(name, answer, expect)
        return answers[name]

    return get


def _check_case_exercised(name: str, answer: dict, expect: str | None) -> None:
    """Cases that name an outcome show it on the colocated path (so the case tests what it says)."""
    if expect is None:
        assert answer["status"] == 200, (name, answer)
    elif expect.isdigit():
        assert answer["status"] == int(expect), (name, answer)
    else:
        assert answer["status"] == 200, (name, answer)
        events = answer.get("events") or [answer["json"]]
        reasons = [c.get("finish_reason") for ev in events if isinstance(ev, dict) for c in ev.get("choices") or []]
        assert expect in reasons, (name, reasons)


CASE_NAMES = list(cases("m", [0, 1, 2], "s"))


@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_same_answer_as_colocated(world, case_table, colocated_answers, deployment, case):
    path, body, _ = case_table[case]
    disagg = normal(call(world.proxies[deployment].url, path, body))
    assert disagg["status"] < 500, disagg
    assert_same(colocated_answers(case), disagg)


# ---- fuzz --------------------------------------------------------------------------------------
@settings(max_examples=240, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), deployment=st.sampled_from(DEPLOYMENTS))
def test_fuzz_same_status_never_5xx(world, tiny_model, data, deployment):
    path, body = data.draw(st.one_of(st.tuples(st.just(C), completion_bodies(tiny_model)),
                                     st.tuples(st.just(H), chat_bodies(tiny_model))))
    disagg = call(world.proxies[deployment].url, path, body)
    assert disagg["status"] < 500, (body, disagg)
    colocated = call(world.colocated.url, path, body)
    assert disagg["status"] == colocated["status"], (body, colocated, disagg)


def test_healthy_and_nothing_leaked_afterwards(world):
    for proc in [*world.instances, *world.proxies.values()]:
        with urllib.request.urlopen(proc.url + "/health", timeout=5) as r:
            assert r.status == 200, proc.url
    try:
        # D quarantines a cancelled transfer's blocks until its deadline (arrival + kv-timeout-s) passed
        wait_for(lambda: not leaks(world), 60, "every block free and no live transfer")
    except AssertionError:
        assert leaks(world) == {}


def leaks(world) -> dict[str, dict[str, float]]:
    """Per instance, blocks in use, requests anywhere and transfers in a live state, where not zero."""
    out = {}
    for server, name in world.names().items():
        found = {key: value for key, value in metrics(server.url).items()
                 if value and key in LIVE}
        if found:
            out[name] = found
    return out


LIVE = {"kvpush_kv_blocks_used", "kvpush_kv_quarantined_blocks", "kvpush_num_requests_running", "kvpush_num_requests_waiting",
        "kvpush_num_requests_waiting_for_kv", "kvpush_num_requests_in_flight",
        *(f'kvpush_kv_transfers{{state="{state}"}}' for state in ("prefilled", "registered", "matched", "posted"))}


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return {name: float(value) for name, _, value in
                (line.rpartition(" ") for line in r.read().decode().splitlines() if not line.startswith("#"))}
