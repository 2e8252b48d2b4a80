"""Rolling restart under streaming load: start a second instance, drain the first (SIGTERM), for the
decode and then for the prefill instance; count failed, truncated, wrong and locally recomputed requests.

    python benchmarks/rolling_restart.py [--modes push pull] [--rate 1] [--max-tokens 128] [--phase-s 8]

One proxy knows both slots of each role from the start (the second instance of each answers only once
started). Timeline per mode: load for a phase; start D2, wait until the proxy uses it, SIGTERM D1 and
wait for it to exit; a phase; start P2, SIGTERM P1; a phase; stop the load. Every request streams
greedy tokens and is compared with the offline engine (colocated) byte for byte; D runs with
`--on-kv-failure recompute`, so a transfer that fails shows up as a local fallback (its response's
`kvpush_trace` has `kv_fallback_local`) rather than an error. Targets: 0 failed, 0 truncated,
0 local fallbacks, every drained instance exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from kvpush import LLM, SamplingParams
from kvpush.bench.demo import ensure_model
from kvpush.config import default_model_dir
from kvpush.launcher.launch import ServerProcess, free_port

BS = 16


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    failed: list[str] = field(default_factory=list)  # non-200, or an error event
    truncated: list[str] = field(default_factory=list)  # no finish_reason or no [DONE]
    wrong: list[str] = field(default_factory=list)  # text differs from colocated
    fallbacks: int = 0  # kv_fallback_local in the trace
    complete: list[tuple[str, list[int], str]] = field(default_factory=list)  # (tag, prompt, text) to compare


class Deployment:
    def __init__(self, model: str, mode: str, log_dir: Path, shutdown_timeout: float) -> None:
        self.model, self.mode, self.log_dir = model, mode, log_dir
        self.flags = ["--kv-mode", mode, "--block-size", str(BS), "--torch-threads", "1",
                      "--shutdown-timeout", str(shutdown_timeout)]
        self.ports = {name: free_port() for name in ("p1", "p2", "d1", "d2")}
        self.procs: dict[str, ServerProcess] = {}
        for name in ("p1", "d1"):
            self.start(name)
        for proc in self.procs.values():
            proc.wait_healthy(180)
        port = free_port()
        url = {n: f"http://127.0.0.1:{p}" for n, p in self.ports.items()}
        self.proxy = ServerProcess(["proxy", "--port", str(port), "--kv-mode", mode, "--prefill", url["p1"],
                                    url["p2"], "--decode", url["d1"], url["d2"]],
                                   log_path=str(log_dir / "proxy.log")).start()
        self.proxy.wait_healthy(60)

    def start(self, name: str) -> ServerProcess:
        role = "prefill" if name.startswith("p") else "decode"
        extra = ["--on-kv-failure", "recompute"] if role == "decode" else []
        proc = ServerProcess(["serve", self.model, "--port", str(self.ports[name]), "--role", role, *self.flags,
                              *extra], log_path=str(self.log_dir / f"{name}.log")).start()
        self.procs[name] = proc
        return proc

    def stop(self) -> None:
        self.proxy.stop()
        for proc in self.procs.values():
            proc.stop()


async def stream_one(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int,
                     tally: Tally) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    text, finish, done, tag = "", None, False, f"#{tally.sent}"
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                tally.failed.append(f"{tag}: HTTP {r.status} {(await r.text())[:200]}")
                return
            async for raw in r.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        tally.failed.append(f"{tag}: error event {event['error']}")
                        return
                    choice = event["choices"][0]
                    text += choice["text"]
                    finish = choice["finish_reason"] or finish
                    tally.fallbacks += "kv_fallback_local" in (choice.get("kvpush_trace") or {})
    except aiohttp.ClientError as e:
        tally.failed.append(f"{tag}: {type(e).__name__}: {e}")
        return
    if finish is None or not done:
        tally.truncated.append(f"{tag}: {len(text)} chars, finish {finish}, [DONE] {done}")
    else:
        tally.complete.append((tag, prompt, text))


def compare(tally: Tally, llm: LLM, max_tokens: int) -> None:
    """Every complete stream against the offline engine's greedy text (after the run: off the load's clock)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([prompt for _, prompt, _ in tally.complete], params) if tally.complete else []
    for (tag, _, text), out in zip(tally.complete, outs, strict=True):
        if text == out.text:
            tally.ok += 1
        else:
            tally.wrong.append(f"{tag}: {text[:40]!r} != {out.text[:40]!r}")


async def drain(dep: Deployment, old: str, new: str, events: list[str]) -> None:
    """Start `new`, wait until the proxy sees it, SIGTERM `old`, wait for its exit."""
    t0 = time.monotonic()
    proc = dep.start(new)
    await asyncio.to_thread(proc.wait_healthy, 180)
    async with aiohttp.ClientSession() as s:
        while True:  # the proxy probes every second
            async with s.get(dep.proxy.url + "/metrics") as r:
                text = await r.text()
            if f'url="{proc.url}"}} 1.0' in text.split("kvpush_proxy_instance_healthy", 1)[1].split("# HELP")[0]:
                break
            await asyncio.sleep(0.2)
    started = time.monotonic()
    old_proc = dep.procs[old]
    assert old_proc.proc is not None
    os.killpg(old_proc.proc.pid, signal.SIGTERM)
    code = await asyncio.to_thread(old_proc.proc.wait, 120)
    old_proc.proc = None
    log = (dep.log_dir / f"{old}.log").read_text()
    in_flight = next((ln.split("draining: ", 1)[1] for ln in log.splitlines() if "draining: " in ln), "?")
    events.append(f"{new} up after {started - t0:.1f} s; {old} drained in {time.monotonic() - started:.1f} s "
                  f"(at SIGTERM: {in_flight}), exit code {code}")


async def run_mode(model: str, mode: str, args: argparse.Namespace, llm: LLM) -> tuple[Tally, list[str]]:
    tally, events = Tally(), []
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix=f"kvpush-rolling-{mode}-") as logs:
        dep = await asyncio.to_thread(Deployment, model, mode, Path(logs), args.shutdown_timeout)
        try:
            stop = asyncio.Event()
            tasks: list[asyncio.Task] = []

            async def load(session: aiohttp.ClientSession) -> None:
                while not stop.is_set():
                    prompt = [rng.randrange(3, 1000) for _ in range(args.input_len)]
                    tally.sent += 1
                    tasks.append(asyncio.create_task(stream_one(session, dep.proxy.url, prompt, args.max_tokens, tally)))
                    try:
                        await asyncio.wait_for(stop.wait(), rng.expovariate(args.rate))
                    except TimeoutError:
                        pass

            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
                loader = asyncio.create_task(load(session))
                await asyncio.sleep(args.phase_s)
                await drain(dep, "d1", "d2", events)
                await asyncio.sleep(args.phase_s)
                await drain(dep, "p1", "p2", events)
                await asyncio.sleep(args.phase_s)
                stop.set()
                await loader
                await asyncio.gather(*tasks)
        finally:
            dep.stop()
    compare(tally, llm, args.max_tokens)
    return tally, events


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the tiny preset under $KVPUSH_MODEL_DIR")
    ap.add_argument("--modes", nargs="+", default=["push", "pull"], choices=["push", "pull", "push-layerwise"])
    ap.add_argument("--rate", type=float, default=1.0, help="streaming requests per second (Poisson)")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--phase-s", type=float, default=8.0, help="load before, between and after the drains")
    ap.add_argument("--shutdown-timeout", type=float, default=30.0)
    args = ap.parse_args()
    model = args.model or ensure_model(default_model_dir(), "tiny")
    llm = LLM(model, block_size=BS, num_blocks=1024)
    bad = False
    for mode in args.modes:
        tally, events = asyncio.run(run_mode(model, mode, args, llm))
        print(f"{mode}: {tally.sent} streamed, {tally.ok} complete and equal to colocated, {len(tally.failed)} failed, "
              f"{len(tally.truncated)} truncated, {len(tally.wrong)} wrong, {tally.fallbacks} local fallbacks")
        for line in events + tally.failed[:5] + tally.truncated[:5] + tally.wrong[:5]:
            print("  ", line)
        bad |= bool(tally.failed or tally.truncated or tally.wrong or tally.fallbacks) or tally.ok != tally.sent
        bad |= any(not e.endswith("exit code 0") for e in events)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
