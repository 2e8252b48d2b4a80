"""TTFT of colocated, pull, push and push-layerwise across prompt lengths, at full link speed and
over a rate-limited link, and how much of the KV transfer each mode leaves on the critical path.

    sudo python benchmarks/layerwise_ttft.py [--lengths 512 2048 8192] [--link-gbps 0.25] [--repeats 3]
    python benchmarks/layerwise_ttft.py --device cuda --dtype bfloat16 --model models/gpu-1b \
        --link-gbps 0 --interleave --modes colocated pull push     # on a GPU: all modes up at once

Root is needed for the limited link (two network namespaces joined by a veth with tc tbf, UCX over
TCP); without root only the full-speed rows are measured. One request at a time (no queueing), bench
preset, first token from P. With --interleave every mode is up at once and the modes take turns on
each prompt (order rotated per repeat), so drift hits all alike. For every disaggregated request the
instances' timestamps give:
    exposed   = d_ready - p_prefill_done   (transfer time left on the critical path)
    transfer  = KV bytes of the prompt / link bandwidth measured on that link
    fraction  = exposed / transfer          (1.0: nothing hidden; 0: fully overlapped with prefill)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import aiohttp

from kvpush.bench.demo import ensure_model
from kvpush.config import default_model_dir
from kvpush.launcher.launch import ServerProcess, free_port
from kvpush.launcher.up import Deployment
from kvpush.models.arch import load_arch_config

MODES = ("colocated", "pull", "push", "push-layerwise")
SERVE = ["--kv-timeout-s", "120", "--kv-lease-s", "120"]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


async def one(url: str, prompt: list[int]) -> tuple[float, dict]:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    ttft, trace = None, {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        async with s.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:300]}")
            async for raw in r.content:
                if not raw.startswith(b"data: {"):
                    continue
                chunk = json.loads(raw[6:])
                for c in chunk.get("choices", []):
                    if ttft is None and c.get("text") is not None:
                        ttft = time.perf_counter() - t0
                    trace = c.get("kvpush_trace") or trace
    assert ttft is not None, "no token came back"
    return ttft * 1000, trace


VOCAB = [8003]  # token ids stay below this (set from the model in main)


def prompt(n: int, seed: int) -> list[int]:
    span = min(8000, VOCAB[0] - 3)
    return [(seed * 7919 + i * 104729) % span + 3 for i in range(n)]


def start(mode: str, model: str, link, log_dir: str, serve: list[str]):
    if mode == "colocated":
        s = ServerProcess(["serve", model, "--port", str(free_port()), *serve],
                          log_path=os.path.join(log_dir, "colocated.log")).start()
        s.wait_healthy(300)
        return s
    return Deployment(model, 1, 1, mode, free_port(), serve, ["--first-token", "from-prefill"],
                      log_dir=os.path.join(log_dir, mode), link=link).start()


def measure(mode: str, model: str, lengths: list[int], repeats: int, link, log_dir: str,
            serve: list[str]) -> dict[int, list]:
    server = start(mode, model, link, log_dir, serve)
    try:
        asyncio.run(one(server.url, prompt(64, 999)))  # warm-up (and handshake)
        return {n: [asyncio.run(one(server.url, prompt(n, r * 31 + n))) for r in range(repeats)] for n in lengths}
    finally:
        server.stop()


def measure_interleaved(modes: list[str], model: str, lengths: list[int], repeats: int, log_dir: str,
                        serve: list[str]) -> dict[str, dict[int, list]]:
    """Every mode up at once; for each prompt the modes take turns, in an order rotated per repeat."""
    servers: dict[str, object] = {}
    try:
        for mode in modes:
            servers[mode] = start(mode, model, None, log_dir, serve)
        for mode in modes:  # warm-up (and handshake), twice: the first pass compiles/loads kernels
            for _ in range(2):
                asyncio.run(one(servers[mode].url, prompt(64, 999)))  # type: ignore[attr-defined]
        out: dict[str, dict[int, list]] = {m: {n: [] for n in lengths} for m in modes}
        for n in lengths:
            for r in range(repeats):
                for k in range(len(modes)):
                    mode = modes[(k + r) % len(modes)]
                    out[mode][n].append(asyncio.run(one(servers[mode].url, prompt(n, r * 31 + n))))  # type: ignore[attr-defined]
        return out
    finally:
        for server in servers.values():
            server.stop()  # type: ignore[attr-defined]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--link-gbps", type=float, default=0.25)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--log-dir", default="kvpush-results/layerwise")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--interleave", action="store_true",
                    help="full link only: every mode up at once, modes alternating on the same prompts")
    ap.add_argument("--device", default="cpu", help="passed to every instance (cuda: model and KV on the GPU)")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES))
    ap.add_argument("--kv-cache-memory-mb", type=int, default=512, help="per instance")
    ap.add_argument("--torch-threads", type=int, default=1, help="per instance")
    args = ap.parse_args()
    model = args.model or ensure_model(default_model_dir(), "bench")
    os.makedirs(args.log_dir, exist_ok=True)
    arch = load_arch_config(model)
    VOCAB[0] = arch.vocab_size
    kv_bytes_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * DTYPE_BYTES[args.dtype]
    serve = [*SERVE, "--kv-cache-memory-mb", str(args.kv_cache_memory_mb), "--device", args.device,
             "--dtype", args.dtype, "--torch-threads", str(args.torch_threads)]
    if args.interleave:
        samples = measure_interleaved(args.modes, model, args.lengths, args.repeats, args.log_dir, serve)
        rows = [summarize("full", mode, n, s, n * kv_bytes_per_token, None)
                for mode in args.modes for n, s in samples[mode].items()]
        print_rows(rows)
        write_results(rows, args.log_dir)
        return
    links: list[tuple[str, float | None]] = [("full", None)]
    if args.link_gbps <= 0:
        print("--link-gbps 0: the limited-link rows are skipped")
    elif os.geteuid() == 0:
        links.append((f"{args.link_gbps} Gbit/s", args.link_gbps))
    else:
        print("not root: the limited-link rows are skipped")
    rows = []
    for link_name, gbps in links:
        link, bandwidth = None, None
        if gbps is not None:
            from kvpush.launcher.netlink import LinkConfig, RateLimitedLink, measure_tcp_gbps

            link = RateLimitedLink(LinkConfig(gbps=gbps)).start()
            bandwidth = measure_tcp_gbps(link) * 1e9 / 8
        try:
            for mode in args.modes:
                if mode == "colocated" and link is not None:
                    continue  # nothing crosses a link
                for n, samples in measure(mode, model, args.lengths, args.repeats, link, args.log_dir, serve).items():
                    rows.append(summarize(link_name, mode, n, samples, n * kv_bytes_per_token, bandwidth))
        finally:
            if link is not None:
                link.close()
        print_rows(rows)
    write_results(rows, args.log_dir)


def write_results(rows: list[dict], log_dir: str) -> None:
    with open(os.path.join(log_dir, "layerwise_ttft.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("plot:", plot(rows, os.path.join(log_dir, "layerwise_ttft.png")))


def plot(rows: list[dict], path: str) -> str:
    """TTFT against prompt length, one line per mode, one panel per link."""
    from matplotlib.figure import Figure

    links = list(dict.fromkeys(r["link"] for r in rows))
    fig = Figure(figsize=(6 * len(links), 4.5))
    for k, link in enumerate(links):
        ax = fig.add_subplot(1, len(links), k + 1)
        for mode in MODES:
            pts = sorted((r["tokens"], r["ttft_ms"]) for r in rows if r["link"] == link and r["mode"] == mode)
            if not pts and mode == "colocated":  # no link crossing: the full-speed line is the reference
                pts = sorted((r["tokens"], r["ttft_ms"]) for r in rows if r["mode"] == "colocated")
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT p50 (ms)")
        ax.set_title(f"link: {link}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def summarize(link: str, mode: str, n: int, samples: list, kv_bytes: int, bandwidth: float | None) -> dict:
    ttft = statistics.median(s[0] for s in samples)
    exposed = [(t["d_ready"] - t["p_prefill_done"]) * 1000 for _, t in samples
               if "d_ready" in t and "p_prefill_done" in t]
    prefill = [(t["p_prefill_done"] - t["p_admitted"]) * 1000 for _, t in samples
               if "p_prefill_done" in t and "p_admitted" in t]
    transfer = kv_bytes / bandwidth * 1000 if bandwidth else None
    row = {"link": link, "mode": mode, "tokens": n, "ttft_ms": ttft,
           "ttft_min_ms": min(s[0] for s in samples), "ttft_max_ms": max(s[0] for s in samples),
           "prefill_ms": statistics.median(prefill) if prefill else None,
           "exposed_ms": statistics.median(exposed) if exposed else None, "transfer_ms": transfer}
    row["fraction"] = row["exposed_ms"] / transfer if transfer and row["exposed_ms"] is not None else None
    return row


def print_rows(rows: list[dict]) -> None:
    def f(v, fmt="{:.0f}"):
        return "-" if v is None else fmt.format(v)

    print("\n| link | mode | prompt tokens | TTFT p50 ms | TTFT min-max ms | P prefill ms "
          "| transfer on critical path ms | link transfer time ms | fraction exposed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        spread = f"{f(r['ttft_min_ms'], '{:.1f}')}-{f(r['ttft_max_ms'], '{:.1f}')}"
        print(f"| {r['link']} | {r['mode']} | {r['tokens']} | {f(r['ttft_ms'], '{:.1f}')} | {spread} | {f(r['prefill_ms'])} | "
              f"{f(r['exposed_ms'], '{:.1f}')} | {f(r['transfer_ms'])} | {f(r['fraction'], '{:.2f}')} |")


if __name__ == "__main__":
    main()
