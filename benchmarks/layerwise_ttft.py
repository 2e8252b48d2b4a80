"""TTFT of colocated, pull, push and push-layerwise across prompt lengths, at full link speed and
over a rate-limited link, and how much of the KV transfer each mode leaves on the critical path.

    sudo python benchmarks/layerwise_ttft.py [--lengths 512 2048 8192] [--link-gbps 0.25] [--repeats 3]

Root is needed for the limited link (two network namespaces joined by a veth with tc tbf, UCX over
TCP); without root only the full-speed rows are measured. One request at a time (no queueing), bench
preset, first token from P. For every disaggregated request the instances' timestamps give:
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

from kvpush.config import default_model_dir
from kvpush.demo import ensure_model
from kvpush.launch import ServerProcess, free_port
from kvpush.models.arch import load_arch_config
from kvpush.server.up import Deployment

MODES = ("colocated", "pull", "push", "push-layerwise")
SERVE = ["--torch-threads", "1", "--kv-cache-memory-mb", "512", "--kv-timeout-s", "120", "--kv-lease-s", "120"]


async def one(url: str, prompt: list[int]) -> tuple[float, dict]:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    ttft, trace = None, {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        async with s.post(url + "/v1/completions", json=body) as r:
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


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 8000 + 3 for i in range(n)]


def start(mode: str, model: str, link, log_dir: str):
    if mode == "colocated":
        s = ServerProcess(["serve", model, "--port", str(free_port()), *SERVE],
                          log_path=os.path.join(log_dir, "colocated.log")).start()
        s.wait_healthy(300)
        return s
    return Deployment(model, 1, 1, mode, free_port(), SERVE, ["--first-token", "from-prefill"],
                      log_dir=os.path.join(log_dir, mode), link=link).start()


def measure(mode: str, model: str, lengths: list[int], repeats: int, link, log_dir: str) -> dict[int, list]:
    server = start(mode, model, link, log_dir)
    try:
        asyncio.run(one(server.url, prompt(64, 999)))  # warm-up (and handshake)
        return {n: [asyncio.run(one(server.url, prompt(n, r * 31 + n))) for r in range(repeats)] for n in lengths}
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--link-gbps", type=float, default=0.25)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--log-dir", default="kvpush-results/layerwise")
    args = ap.parse_args()
    model = args.model or ensure_model(default_model_dir(), "bench")
    os.makedirs(args.log_dir, exist_ok=True)
    arch = load_arch_config(model)
    kv_bytes_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 4
    links: list[tuple[str, float | None]] = [("full", None)]
    if os.geteuid() == 0:
        links.append((f"{args.link_gbps} Gbit/s", args.link_gbps))
    else:
        print("not root: the limited-link rows are skipped")
    rows = []
    for link_name, gbps in links:
        link, bandwidth = None, None
        if gbps is not None:
            from kvpush.netlink import LinkConfig, RateLimitedLink, measure_tcp_gbps

            link = RateLimitedLink(LinkConfig(gbps=gbps)).start()
            bandwidth = measure_tcp_gbps(link) * 1e9 / 8
        try:
            for mode in MODES:
                if mode == "colocated" and link is not None:
                    continue  # nothing crosses a link
                for n, samples in measure(mode, model, args.lengths, args.repeats, link, args.log_dir).items():
                    rows.append(summarize(link_name, mode, n, samples, n * kv_bytes_per_token, bandwidth))
        finally:
            if link is not None:
                link.close()
        print_rows(rows)
    with open(os.path.join(args.log_dir, "layerwise_ttft.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("plot:", plot(rows, os.path.join(args.log_dir, "layerwise_ttft.png")))


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
           "prefill_ms": statistics.median(prefill) if prefill else None,
           "exposed_ms": statistics.median(exposed) if exposed else None, "transfer_ms": transfer}
    row["fraction"] = row["exposed_ms"] / transfer if transfer and row["exposed_ms"] is not None else None
    return row


def print_rows(rows: list[dict]) -> None:
    def f(v, fmt="{:.0f}"):
        return "-" if v is None else fmt.format(v)

    print("\n| link | mode | prompt tokens | TTFT p50 ms | P prefill ms | transfer on critical path ms "
          "| link transfer time ms | fraction exposed |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['link']} | {r['mode']} | {r['tokens']} | {f(r['ttft_ms'])} | {f(r['prefill_ms'])} | "
              f"{f(r['exposed_ms'], '{:.1f}')} | {f(r['transfer_ms'])} | {f(r['fraction'], '{:.2f}')} |")


if __name__ == "__main__":
    main()
