"""P's first token first for vLLM decode instances (kvpush/proxy/first_token.py): which requests may,
what of P's answer is sent, and the relay's states against a fake D streaming over loopback (the
real vLLM pair is in test_vllm_connector.py)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from aiohttp import ClientSession, web

from kvpush.config import FirstToken, KVMode
from kvpush.launcher.launch import free_port
from kvpush.proxy.first_token import PrefillAnswer, State, check_first, eligible, relay_first_from_prefill
from kvpush.proxy.legs import Dispatch
from kvpush.proxy.metrics import ProxyMetrics
from kvpush.proxy.pool import Instance

GREEDY = {"stream": True, "temperature": 0}


@pytest.mark.parametrize("extra,ok", [
    ({}, True), ({"temperature": 0.0, "n": 1, "max_tokens": 5}, True),
    ({"stream_options": {"include_usage": True}}, True),
    ({"stream": False}, False), ({"temperature": 0.7}, False), ({"temperature": None}, False),
    ({"temperature": False}, False), ({"n": 2}, False), ({"best_of": 3}, False), ({"logprobs": 2}, False),
    ({"logprobs": True}, False), ({"logprobs": 0}, False), ({"top_logprobs": 0}, False), ({"prompt_logprobs": 0}, False),
    ({"logprobs": False}, True), ({"logprobs": None}, True), ({"use_beam_search": True}, False),
    ({"return_prompt_text": True}, False), ({"top_logprobs": 3}, False), ({"echo": True}, False), ({"stop": ["\n"]}, False),
    ({"stop": "x"}, False), ({"return_token_ids": True}, False), ({"tools": [{"type": "function"}]}, False),
    ({"stream_options": {"continuous_usage_stats": True}}, False)])
def test_which_requests_may_start_with_p_s_token(extra, ok):
    body = {"prompt": "hi", **GREEDY, **extra}
    assert eligible(body, bool(body.get("stream"))) is ok
    if ok:
        assert eligible({**body, "stop": []}, True)  # an empty stop list holds nothing back


def test_what_of_p_s_answer_is_usable():
    base = {"id": "cmpl-x", "created": 7, "model": "m"}
    done = {"index": 0, "finish_reason": "length"}
    assert PrefillAnswer.parse({**base, "choices": [{**done, "text": " a"}]}, chat=False) == \
        PrefillAnswer(" a", False, "cmpl-x", 7, "m")
    chat = PrefillAnswer.parse({**base, "choices": [{**done, "message": {"role": "helper", "content": "b"}}]}, chat=True)
    assert chat is not None and chat.text == "b" and chat.chunks()[0]["choices"][0]["delta"]["role"] == "helper"
    # a token ending inside a character: vLLM streams its chunk with empty text, and so does the proxy
    held = PrefillAnswer.parse({**base, "choices": [{**done, "text": ""}]}, chat=False)
    assert held is not None and held.text == "" and held.chunks()[0]["choices"][0]["text"] == ""
    invalid = PrefillAnswer.parse({**base, "choices": [{**done, "text": "\ufffd\ufffd"}]}, chat=False)
    assert invalid is not None and invalid.text == "\ufffd\ufffd"  # bytes that form no character: final
    for choice in ({"index": 0, "finish_reason": "stop", "text": "a"},
                   {**done, "text": None}):
        assert PrefillAnswer.parse({**base, "choices": [choice]}, chat=False) is None
    for message in ({"content": None, "tool_calls": [{"id": "t"}]}, {"content": "a", "reasoning_content": "r"}):
        assert PrefillAnswer.parse({**base, "choices": [{**done, "message": message}]}, chat=True) is None


def _line(choice: dict, **top) -> bytes:
    return b"data: " + json.dumps({"id": "d", "choices": [choice], **top}).encode() + b"\n\n"


def test_d_s_text_is_checked_against_p_s_then_dropped_as_far_as_it_was_sent():
    text = PrefillAnswer(" a", False, "i", 1, "m")

    def check(choice: dict, owed: str = " a", answer: PrefillAnswer = text, **top):
        state, owed_after, line = check_first(_line(choice, **top), answer, owed)
        return state, owed_after, None if line is None else json.loads(line[6:])["choices"][0]

    assert check({"index": 0, "text": " a", "finish_reason": None}) == (State.CHECKED, "", None)  # dropped
    assert check({"index": 0, "text": " b", "finish_reason": None})[0] is State.MISMATCH  # another token
    assert check({"index": 0, "text": " a b", "finish_reason": None}) == (  # two tokens in one chunk: the rest goes
        State.CHECKED, "", {"index": 0, "text": " b", "finish_reason": None})
    assert check({"index": 0, "text": " ", "finish_reason": None}) == (State.P_FIRST, "a", None)  # part: "a" owed
    assert check({"index": 0, "text": "a", "finish_reason": None}, owed="a") == (State.CHECKED, "", None)
    assert check({"index": 0, "text": " a", "finish_reason": "length"}) == (  # it also ends the answer
        State.CHECKED, "", {"index": 0, "text": "", "finish_reason": "length"})
    # D's answer ends before it gave all of P's text (say D's first token is EOS, or a shorter one)
    assert check({"index": 0, "text": "", "finish_reason": "stop"})[0] is State.MISMATCH
    assert check({"index": 0, "text": " ", "finish_reason": "length"})[0] is State.MISMATCH
    assert check_first(b"data: [DONE]\n", text, " a")[0] is State.MISMATCH
    error = b'data: {"error": {"message": "x"}}\n'
    assert check_first(error, text, " a") == (State.D_ERROR, " a", error)  # D's own error goes as it is
    usage = b'data: {"id": "d", "choices": [], "usage": {"completion_tokens": 3}}\n'
    assert check_first(usage, text, " a") == (State.P_FIRST, " a", usage)
    assert check_first(b"\n", text, " a") == (State.P_FIRST, " a", b"\n")
    chat = PrefillAnswer(" a", True, "i", 1, "m")
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    assert check(role, answer=chat) == (State.P_FIRST, " a", None)
    assert check({"index": 0, "delta": {"content": " a"}, "finish_reason": None}, answer=chat) == (State.CHECKED, "",
                                                                                                   None)
    assert check({"index": 0, "delta": {"reasoning_content": " a"}}, answer=chat)[0] is State.MISMATCH


class FakeD:
    """Streams the given chunks after `delay_s` (D's KV and its first step)."""

    def __init__(self, chunks: list[dict], delay_s: float) -> None:
        self.chunks, self.delay_s, self.port = chunks, delay_s, free_port()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await asyncio.sleep(self.delay_s)
        for c in self.chunks:
            await out.write(b"data: " + json.dumps({"id": "d", "choices": [c]}).encode() + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


async def _run(answer: PrefillAnswer, d_chunks: list[dict], d_delay_s: float, p_delay_s: float):
    """The client's data lines and the outcome counters, through relay_first_from_prefill."""
    fake_d = FakeD(d_chunks, d_delay_s)
    metrics = ProxyMetrics()
    proxy = SimpleNamespace(metrics=metrics)
    d_app = web.Application()
    d_app.router.add_post("/v1/completions", fake_d.handle)
    runners = [web.AppRunner(d_app)]

    async def front(request: web.Request) -> web.StreamResponse:
        dispatch = Dispatch(Instance("http://p", "prefill", vllm=True), Instance("http://d", "decode", vllm=True),
                            "t1", FirstToken.RECOMPUTE, KVMode.PUSH, first_from_prefill=True)

        async def p_leg() -> None:
            await asyncio.sleep(p_delay_s)
            dispatch.prefill_answer = answer

        dispatch.p_task = asyncio.create_task(p_leg())
        d_resp = await session.post(f"http://127.0.0.1:{fake_d.port}/v1/completions", json={})
        return await relay_first_from_prefill(proxy, request, d_resp, dispatch)  # type: ignore[arg-type]

    front_app = web.Application()
    front_app.router.add_post("/v1/completions", front)
    runners.append(web.AppRunner(front_app))
    ports = [fake_d.port, free_port()]
    async with ClientSession() as session:
        for runner, port in zip(runners, ports, strict=True):
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with session.post(f"http://127.0.0.1:{ports[1]}/v1/completions", json={}) as r:
                lines = [line.strip() for line in (await r.read()).split(b"\n") if line.strip()]
        finally:
            for runner in runners:
                await runner.cleanup()
    outcomes = dict.fromkeys(("relayed", "late", "mismatch"), 0.0)
    outcomes.update({s.labels["outcome"]: s.value for m in metrics.first_from_prefill.collect() for s in m.samples
                     if s.name.endswith("_total")})
    return lines, outcomes


def _texts(lines: list[bytes]) -> list[str]:
    out = []
    for line in lines:
        if line.startswith(b"data: {"):
            choice = (json.loads(line[6:]).get("choices") or [{}])[0]
            out.append(choice.get("text", (choice.get("delta") or {}).get("content")))
    return out


TOKENS = [{"index": 0, "text": t, "finish_reason": None} for t in (" a", " b")] + \
    [{"index": 0, "text": " c", "finish_reason": "length"}]


def test_p_answers_first_its_token_goes_first_and_d_s_is_dropped():
    answer = PrefillAnswer(" a", False, "cmpl-t1", 1, "m")
    lines, outcomes = asyncio.run(_run(answer, TOKENS, d_delay_s=0.3, p_delay_s=0.0))
    assert _texts(lines) == [" a", " b", " c"] and lines[-1] == b"data: [DONE]"
    assert json.loads(lines[0][6:])["id"] == "cmpl-t1"
    assert outcomes == {"relayed": 1.0, "late": 0.0, "mismatch": 0.0}


def test_d_answers_first_its_stream_goes_unchanged():
    answer = PrefillAnswer(" a", False, "cmpl-t1", 1, "m")
    lines, outcomes = asyncio.run(_run(answer, TOKENS, d_delay_s=0.0, p_delay_s=0.5))
    assert _texts(lines) == [" a", " b", " c"]
    assert json.loads(lines[0][6:])["id"] == "d"
    assert outcomes["late"] == 1.0 and outcomes["relayed"] == 0.0


def test_d_computing_another_first_token_ends_the_stream_with_an_error():
    answer = PrefillAnswer(" z", False, "cmpl-t1", 1, "m")
    lines, outcomes = asyncio.run(_run(answer, TOKENS, d_delay_s=0.3, p_delay_s=0.0))
    assert _texts(lines) == [" z", None]  # P's token, then the error event: nothing of D's after another token
    assert "another first token" in json.loads(lines[1][6:])["error"]["message"]
    assert lines[-1] == b"data: [DONE]" and outcomes["mismatch"] == 1.0


def test_a_token_ending_inside_a_character_goes_first_as_an_empty_chunk_then_all_of_d_s_text():
    """P's token is the first byte of "é": vLLM streams its chunk with empty text and the character with
    the next token. The client gets P's empty chunk at once, then D's text whole (D's empty chunk dropped)."""
    answer = PrefillAnswer("", False, "cmpl-t1", 1, "m")
    chunks = [{"index": 0, "text": "", "finish_reason": None}, {"index": 0, "text": "é", "finish_reason": None},
              {"index": 0, "text": " c", "finish_reason": "length"}]
    lines, outcomes = asyncio.run(_run(answer, chunks, d_delay_s=0.3, p_delay_s=0.0))
    assert _texts(lines) == ["", "é", " c"] and json.loads(lines[0][6:])["id"] == "cmpl-t1"
    assert outcomes["relayed"] == 1.0
    merged = [{"index": 0, "text": "é c", "finish_reason": "length"}]  # D's API server read behind its engine
    lines, _ = asyncio.run(_run(answer, merged, d_delay_s=0.3, p_delay_s=0.0))
    assert _texts(lines) == ["", "é c"]


def test_d_s_first_chunk_with_two_tokens():
    answer = PrefillAnswer(" a", False, "cmpl-t1", 1, "m")
    chunks = [{"index": 0, "text": " a b", "finish_reason": None}, {"index": 0, "text": " c", "finish_reason": "length"}]
    lines, outcomes = asyncio.run(_run(answer, chunks, d_delay_s=0.3, p_delay_s=0.0))
    assert _texts(lines) == [" a", " b", " c"] and outcomes["relayed"] == 1.0


def test_d_ending_short_of_p_s_text_ends_the_stream_with_an_error():
    answer = PrefillAnswer(" a", False, "cmpl-t1", 1, "m")
    eos_first = [{"index": 0, "text": "", "finish_reason": "stop"}]
    lines, outcomes = asyncio.run(_run(answer, eos_first, d_delay_s=0.3, p_delay_s=0.0))
    assert _texts(lines) == [" a", None] and outcomes["mismatch"] == 1.0
    lines, outcomes = asyncio.run(_run(answer, [], d_delay_s=0.3, p_delay_s=0.0))  # only [DONE]
    assert _texts(lines) == [" a", None] and outcomes["mismatch"] == 1.0


def test_chat_role_chunk_and_a_one_token_answer():
    answer = PrefillAnswer(" a", True, "chatcmpl-t1", 1, "m")
    chunks = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None},
              {"index": 0, "delta": {"content": " a"}, "finish_reason": "length"}]
    lines, outcomes = asyncio.run(_run(answer, chunks, d_delay_s=0.3, p_delay_s=0.0))
    choices = [json.loads(line[6:])["choices"][0] for line in lines if line.startswith(b"data: {")]
    assert [c["delta"] for c in choices] == [{"role": "assistant", "content": ""}, {"content": " a"}, {"content": ""}]
    assert choices[-1]["finish_reason"] == "length" and outcomes["relayed"] == 1.0
