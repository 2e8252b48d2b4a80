"""The bench load generator and CLI against a tiny fake OpenAI-compatible SSE server."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from kvpush.bench.cli import add_bench_arguments, run_bench
from kvpush.bench.datasets import DatasetError, Sample, file_samples, random_samples, sharegpt_samples
from kvpush.bench.loadgen import LoadConfig, arrival_times, chunk_tokens, run_load_sync

CHUNKS = 4
DELAY_S = 0.01
TRACE = {"dispatched": 1.0, "p_admitted": 1.001, "first_token": 1.02}
ROUTE = {"route": "push", "forced": False, "estimates_ms": {"push": 20.0, "local": 25.0}}


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class FakeServer:
    """Streams CHUNKS chunks DELAY_S apart, then usage + kvpush_trace, then [DONE].

    Prompt "ERR500" answers HTTP 500, "DROP" closes the connection mid-stream, "SLOW" stalls,
    "MULTI" sends two tokens per chunk (known through logprobs).
    """

    def __init__(self) -> None:
        self.inflight = 0
        self.max_inflight = 0
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.2)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("Authorization"))
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        prompt = body["prompt"]
        if prompt == "ERR500":
            self.inflight -= 1
            return web.json_response({"error": {"message": "boom"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        per_chunk = 2 if prompt == "MULTI" else 1
        for i in range(CHUNKS):
            await asyncio.sleep(5.0 if prompt == "SLOW" else DELAY_S)
            choice: dict = {"index": 0, "text": f"t{i} ", "finish_reason": None}
            if per_chunk > 1:
                choice["logprobs"] = {"tokens": ["a", "b"]}
            await resp.write(_sse({"choices": [choice]}))
            if prompt == "DROP" and i == 1:
                self.inflight -= 1
                assert request.transport is not None
                request.transport.close()
                return resp
        usage = {"prompt_tokens": 7, "completion_tokens": CHUNKS * per_chunk, "total_tokens": 7 + CHUNKS}
        await resp.write(_sse({"choices": [], "usage": usage, "kvpush_trace": TRACE, "kvpush_route": ROUTE}))
        self.inflight -= 1  # before [DONE]: the client frees its slot only after reading it
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture
def server() -> Iterator[FakeServer]:
    fake = FakeServer()
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(fake.start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    yield fake
    assert fake.runner is not None
    asyncio.run_coroutine_threadsafe(fake.runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def _samples(prompts: list[str | list[int]]) -> list[Sample]:
    return [Sample(prompt=p, prompt_len=3, output_len=CHUNKS) for p in prompts]


def _cfg(url: str, **kw) -> LoadConfig:
    return LoadConfig(base_url=url, model="fake-model", progress=False, **kw)


def test_records_complete_and_concurrency_respected(server):
    samples = _samples([[1, 2, 3]] * 10)
    result = run_load_sync(samples, _cfg(server.url, max_concurrency=2, num_warmups=2, ignore_eos=True))
    assert len(result.records) == 10 and len(server.bodies) == 12  # warm-ups excluded
    assert (result.warmups, result.warmup_failed) == (2, 0)
    assert server.max_inflight == 2
    assert sorted(r.index for r in result.records) == list(range(10))
    for rec in result.records:
        assert rec.success and rec.status == 200 and rec.error == ""
        assert rec.ttft_s is not None and rec.ttft_s >= DELAY_S * 0.5
        assert rec.e2el_s is not None and rec.e2el_s >= rec.ttft_s
        assert len(rec.itl_s) == CHUNKS - 1
        assert (rec.output_tokens, rec.prompt_tokens) == (CHUNKS, 7)
        assert rec.kvpush_trace == TRACE and rec.kvpush_route == ROUTE
    body = server.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["temperature"], body["ignore_eos"]) == (CHUNKS, 0.0, True)
    assert body["prompt"] == [1, 2, 3] and body["model"] == "fake-model"
    assert result.duration_s >= 5 * CHUNKS * DELAY_S  # 10 requests, 2 at a time


def test_errors_are_failures_not_crashes(server):
    samples = _samples(["ok", "ERR500", "DROP", "SLOW", "ok"])
    result = run_load_sync(samples, _cfg(server.url, timeout_s=0.5))
    by_prompt = dict(zip(["ok0", "ERR500", "DROP", "SLOW", "ok4"], result.records, strict=True))
    assert by_prompt["ok0"].success and by_prompt["ok4"].success
    err = by_prompt["ERR500"]
    assert (err.success, err.status) == (False, 500) and "HTTP 500" in err.error and "boom" in err.error
    drop = by_prompt["DROP"]
    assert not drop.success and drop.status == 200 and drop.error
    slow = by_prompt["SLOW"]
    assert not slow.success and "timeout" in slow.error


def test_multi_token_chunks_split_itl(server):
    result = run_load_sync(_samples(["MULTI"]), _cfg(server.url))
    rec = result.records[0]
    assert rec.success and rec.output_tokens == 2 * CHUNKS
    # first chunk: TTFT (its second token adds no ITL); each later chunk: two entries of gap/2
    assert len(rec.itl_s) == 2 * (CHUNKS - 1)
    assert rec.itl_s[0] == rec.itl_s[1]


def test_poisson_arrivals_follow_schedule(server):
    samples = _samples(["ok"] * 8)
    result = run_load_sync(samples, _cfg(server.url, request_rate=100.0, seed=3))
    planned = arrival_times(8, 100.0, 1.0, seed=3)
    assert [r.scheduled_s for r in result.records] == planned
    assert all(r.start_s >= r.scheduled_s - 1e-3 for r in result.records)


def test_arrival_times():
    assert arrival_times(3, float("inf")) == [0.0, 0.0, 0.0]
    times = arrival_times(2000, 10.0, burstiness=1.0, seed=1)
    assert times[0] == 0.0 and times == sorted(times)
    assert 9.0 < 1999 / times[-1] < 11.0  # mean gap 1/rate
    assert arrival_times(5, 10.0, seed=1) == arrival_times(5, 10.0, seed=1)
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)


def test_chunk_tokens():
    assert chunk_tokens({"text": "hi"}) == 1
    assert chunk_tokens({"text": ""}) == 0
    assert chunk_tokens({"text": "ab", "logprobs": {"tokens": ["a", "b"]}}) == 2
    assert chunk_tokens({"text": "", "token_ids": [5, 6, 7]}) == 3
    assert chunk_tokens("junk") == 0


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvpush bench")
    add_bench_arguments(parser)
    return parser.parse_args(argv)


def test_run_bench_writes_one_json_per_rate(server, tmp_path: Path, capsys):
    argv = [
        "--base-url", server.url, "--result-dir", str(tmp_path), "--mode-label", "push",
        "--num-prompts", "5", "--num-warmups", "1", "--input-len", "6", "--output-len", "4",
        "--prefix-len", "2", "--request-rate", "inf", "200", "--max-concurrency", "3",
        "--ignore-eos", "--slo", "ttft:5000,tpot:1000", "--api-key", "s3cret", "--no-progress",
    ]
    assert run_bench(_parse(argv)) == 0
    files = sorted(tmp_path.glob("push-rate*.json"))
    assert [f.name.split("-")[1] for f in files] == ["rate200", "rateinf"]
    out = capsys.readouterr().out
    assert out.count("[push] rate") == 2 and "### request rate 200 req/s" in out
    assert all(a == "Bearer s3cret" for a in server.auth)
    for f in files:
        assert "s3cret" not in f.read_text()
        doc = json.loads(f.read_text())
        assert set(doc) == {"config", "environment", "run", "metrics", "requests", "emulation"}
        assert doc["emulation"] is None  # a real server (bench/emulation.py)
        cfg = doc["config"]
        assert cfg["mode"] == "push" and cfg["model"] == "fake-model" and cfg["api_key"] == "***"
        assert cfg["request_rate"] in ("inf", 200.0) and cfg["request_rates"] == ["inf", 200.0]
        assert {"kvpush_version", "git_commit", "cpu_count", "python", "torch", "nixl"} <= set(doc["environment"])
        machine = doc["environment"]["machine"]  # kvpush env's facts: the CPU the run was made on
        assert machine["cpu"]["model"] and machine["cores_usable"] >= 1 and machine["kernels"]["decode_attention"]
        m = doc["metrics"]
        assert (m["completed"], m["failed"], m["request_goodput"] > 0) == (5, 0, True)
        assert m["handover"][0]["name"] == "dispatched->p_admitted"
        assert len(doc["requests"]) == 5 and doc["requests"][0]["kvpush_trace"] == TRACE
        assert doc["run"]["warmups"] == 1
    prompts = [b["prompt"] for b in server.bodies]
    assert all(len(p) == 8 for p in prompts)  # prefix 2 + input 6 token ids


def test_bad_arguments_are_argparse_errors(capsys):
    for argv in (["--request-rate", "-1"], ["--slo", "itl:5"], ["--num-prompts", "zero"], ["--range-ratio", "1.5"]):
        with pytest.raises(SystemExit) as exc:
            _parse(argv)
        assert exc.value.code == 2
        assert "error: argument" in capsys.readouterr().err


def test_cli_errors_without_traceback(tmp_path: Path, capsys):
    args = _parse(["--dataset", "sharegpt", "--model", "m", "--result-dir", str(tmp_path)])
    assert run_bench(args) == 2
    assert "--dataset-path is required" in capsys.readouterr().err
    # nothing listens on port 9 of 127.0.0.1: every warm-up fails -> a clear abort
    args = _parse(["--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "2",
                   "--num-warmups", "1", "--result-dir", str(tmp_path), "--no-progress"])
    assert run_bench(args) == 1
    assert "warm-up requests failed" in capsys.readouterr().err
    args.num_warmups = 0
    assert run_bench(args) == 1  # the run is recorded, all requests failed
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert (doc["metrics"]["completed"], doc["metrics"]["failed"]) == (0, 2)


# -- datasets (the load generator's input) --


def test_random_samples():
    samples = random_samples(50, 20, 8, range_ratio=0.5, prefix_len=4, vocab_size=10, avoid_ids=[0, 3], seed=1)
    assert samples == random_samples(50, 20, 8, range_ratio=0.5, prefix_len=4, vocab_size=10, avoid_ids=[0, 3], seed=1)
    assert samples != random_samples(50, 20, 8, range_ratio=0.5, prefix_len=4, vocab_size=10, seed=2)
    prefix = samples[0].prompt[:4]
    for s in samples:
        assert isinstance(s.prompt, list) and s.prompt[:4] == prefix and len(s.prompt) == s.prompt_len
        assert 4 + 10 <= s.prompt_len <= 4 + 30 and 4 <= s.output_len <= 12
        assert not {0, 3} & set(s.prompt) and max(s.prompt) < 10
    fixed = random_samples(3, 5, 2, seed=0, decode=lambda ids: " ".join(map(str, ids)))
    assert [(s.prompt_len, s.output_len) for s in fixed] == [(5, 2)] * 3 and isinstance(fixed[0].prompt, str)
    with pytest.raises(DatasetError):
        random_samples(3, 5, 2, vocab_size=2, avoid_ids=[0, 1])


def test_session_samples_extend_the_previous_turn_round_robin():
    from kvpush.bench.datasets import session_samples

    samples = session_samples(10, 16, 4, turns=3, turn_len=5, vocab_size=50, avoid_ids=[0], seed=3)
    assert samples == session_samples(10, 16, 4, turns=3, turn_len=5, vocab_size=50, avoid_ids=[0], seed=3)
    assert len(samples) == 10  # 4 sessions of 3 turns, the last one cut short
    sessions = [samples[i::4] for i in range(4)]
    for turns in sessions:
        for prev, nxt in zip(turns, turns[1:], strict=False):
            assert nxt.prompt[: prev.prompt_len] == prev.prompt and nxt.prompt_len == prev.prompt_len + 4 + 5
        assert turns[0].prompt_len == 16 and all(s.output_len == 4 and 0 not in s.prompt for s in turns)
    assert len({tuple(t[0].prompt) for t in sessions}) == 4  # sessions do not share their first prompt
    with pytest.raises(DatasetError):
        session_samples(3, 5, 2, turns=0)


def test_mixed_samples_interleave_short_long_and_sessions():
    from kvpush.bench.datasets import mixed_samples

    samples = mixed_samples(12, 16, 4, turns=2, turn_len=3, vocab_size=50, seed=1)
    assert [s.prompt_len for s in samples[:3]] == [4, 32, 16]
    sessions = samples[2::3]  # two sessions of two turns: the second turn of the first extends it
    assert sessions[2].prompt[:16] == sessions[0].prompt and sessions[2].prompt_len == 16 + 4 + 3
    assert len(mixed_samples(7, 16, 4)) == 7


def test_sharegpt_and_file_samples(tmp_path: Path):
    convs = [
        {"conversations": [{"from": "human", "value": "a" * 40}, {"from": "gpt", "value": "b" * 80}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},
        {"conversations": [{"from": "human", "value": "c" * 8}, {"from": "gpt", "value": "d" * 4}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    samples = sharegpt_samples(path, 4, seed=0)
    assert len(samples) == 4 and {(s.prompt_len, s.output_len) for s in samples} == {(10, 20), (2, 1)}
    assert {s.output_len for s in sharegpt_samples(path, 2, output_len=7)} == {7}
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello world\n\n  second prompt  \n")
    got = file_samples(prompts, 3, output_len=5)
    assert [s.prompt for s in got] == ["hello world", "second prompt", "hello world"]
    assert got[0].prompt_len == 2 and got[0].output_len == 5
    with pytest.raises(DatasetError, match="cannot read"):
        file_samples(tmp_path / "nope.txt", 1, output_len=5)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DatasetError, match="JSON list"):
        sharegpt_samples(tmp_path / "bad.json", 1)
