"""The OpenAI-compatible server against a real `kvpush serve` process on a loopback port."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration
SERVER_ARGS = ["--num-blocks", "256", "--block-size", "4", "--max-waiting", "64"]


def post(url: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("" if not s.labels else str(sorted(s.labels.items())))
            out[key] = s.value
    return out


@pytest.fixture(scope="module")
def client(module_server):
    return openai.OpenAI(base_url=module_server.url + "/v1", api_key="unused", max_retries=0)


def test_openai_client_completion_chat_and_streaming(client):
    c = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8, temperature=0)
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 8
    streamed = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6
    parts = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=6, temperature=0, stream=True))
    assert "".join(p.choices[0].delta.content or "" for p in parts) == chat.choices[0].message.content
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_logprobs_and_stop_strings(client):
    c = client.completions.create(model="tiny", prompt="abc", max_tokens=5, temperature=0, logprobs=3)
    lp = c.choices[0].logprobs
    assert len(lp.token_logprobs) == 5 and all(len(t) <= 3 for t in lp.top_logprobs)
    full = c.choices[0].text
    stop = full[2:4]
    if stop.strip():
        s = client.completions.create(model="tiny", prompt="abc", max_tokens=5, temperature=0, stop=[stop])
        assert s.choices[0].finish_reason == "stop" and stop not in s.choices[0].text
        assert full.startswith(s.choices[0].text)


def test_sixteen_concurrent_streams_equal_offline(module_server):
    from kvpush import LLM, SamplingParams

    prompts = [f"Request number {i} says" + " more" * i for i in range(16)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    offline = LLM(module_server.model_path, num_blocks=256, block_size=4).generate(prompts, params)

    async def one(session: aiohttp.ClientSession, prompt: str) -> list[int]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "stream": True, "logprobs": 0}
        tokens: list[str] = []
        async with session.post(module_server.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            async for line in r.content:
                text = line.decode().strip()
                if text.startswith("data: {"):
                    tokens += json.loads(text[6:])["choices"][0]["logprobs"]["tokens"]
        return tokens

    async def main() -> list[list[str]]:
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(one(s, p) for p in prompts))

    served = asyncio.run(main())
    from kvpush.models.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(module_server.model_path)
    expected = [[tok.decode([t], skip_special_tokens=False) for t in o.token_ids] for o in offline]
    assert served == expected


def test_disconnect_frees_blocks(module_server):
    async def main() -> None:
        body = {"model": "tiny", "prompt": "keep talking", "max_tokens": 2000, "ignore_eos": True,
                "stream": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(module_server.url + "/v1/completions", json=body) as r:
                for _ in range(3):
                    await r.content.readline()
                assert metrics(module_server.url)["kvpush_kv_blocks_used"] > 0
            # leaving the block drops the connection mid-stream

    asyncio.run(main())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = metrics(module_server.url)
        if m["kvpush_kv_blocks_used"] == 0 and m["kvpush_num_requests_in_flight"] == 0:
            break
        time.sleep(0.2)
    assert m["kvpush_kv_blocks_used"] == 0 and m["kvpush_num_requests_running"] == 0
    assert m["kvpush_requests_finished_total[('finish_reason', 'abort')]"] >= 1


def test_metrics_parse_and_move(module_server):
    before = metrics(module_server.url)
    status, _ = post(module_server.url + "/v1/completions", {"prompt": "x y z", "max_tokens": 4})
    assert status == 200
    after = metrics(module_server.url)
    assert after["kvpush_generation_tokens_total"] >= before["kvpush_generation_tokens_total"] + 4
    assert after["kvpush_prompt_tokens_total"] > before["kvpush_prompt_tokens_total"]
    assert after["kvpush_time_to_first_token_seconds_count"] > before["kvpush_time_to_first_token_seconds_count"]
    assert after["kvpush_e2e_request_latency_seconds_count"] > before["kvpush_e2e_request_latency_seconds_count"]
    assert after["kvpush_kv_blocks_total"] == 256


@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "malformed JSON"),
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -2}, 400, "temperature"),
    ({"prompt": "hi", "n": 2}, 400, "n=1"),
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": [[]]}, 400, "prompt"),
    ({"prompt": "hi", "model": "nope"}, 404, "does not exist"),
    ({"prompt": "word " * 5000}, 400, "maximum context length"),
    ({"prompt": [999999]}, 400, "vocabulary"),
    ({"messages": []}, 400, "messages"),
])
def test_bad_requests_get_openai_errors(module_server, body, status, needle):
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    got, err = post(module_server.url + path, body)
    assert got == status
    assert needle in err["error"]["message"] and err["error"]["type"]


def test_unknown_route_is_json_404(module_server):
    got, err = post(module_server.url + "/v1/embeddings", {"input": "x"})
    assert got == 404 and "error" in err


def test_api_key(server_factory, tiny_model):
    server = server_factory(tiny_model, "--api-key", "sekret", "--num-blocks", "64")
    got, err = post(server.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert got == 401 and err["error"]["type"] == "authentication_error"
    got, _ = post(server.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                  {"Authorization": "Bearer wrong"})
    assert got == 401
    got, _ = post(server.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                  {"Authorization": "Bearer sekret"})
    assert got == 200
    with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
        assert r.status == 200


def test_taken_port_exits_with_a_clear_message(tiny_model, tmp_path):
    """A port already in use ends `kvpush serve` at once with a CLI message; the engine core, already
    started, must not keep the process alive (it used to wait for it forever)."""
    import socket

    from kvpush.launcher.launch import ServerProcess, free_port

    taken = socket.socket()
    taken.bind(("127.0.0.1", free_port()))
    taken.listen()
    port = taken.getsockname()[1]
    log = tmp_path / "serve.log"
    server = ServerProcess(["serve", tiny_model, "--port", str(port), "--torch-threads", "1"], log_path=str(log))
    try:
        server.start()
        assert server.proc is not None
        assert server.proc.wait(timeout=120) != 0
        assert f"cannot listen on 127.0.0.1:{port}" in log.read_text()
    finally:
        server.stop()
        taken.close()
