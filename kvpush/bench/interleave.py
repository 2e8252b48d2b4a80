"""Paired comparison of deployments: the same prompts, modes alternating, one request at a time.

For prompt i the modes are visited in an order rotated by i, each request sent when the previous
one has ended (no queueing, so TTFT is the serving path itself). Machine noise that drifts over
the run hits every mode alike, and per-prompt differences cancel the prompt's own effect:
``paired_report`` gives each mode's TTFT p50 with a bootstrap interval, the p50 of per-prompt
differences against a reference mode, and paired ratios with a verdict.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import aiohttp
import numpy as np

from kvpush.bench.datasets import Sample
from kvpush.bench.loadgen import LoadConfig, _Client
from kvpush.bench.metrics import RequestRecord
from kvpush.bench.stats import bootstrap_ci, fmt_ci, ratio_ci, verdict
from kvpush.bench.trace import END, START, events_of, phases_of


async def run_interleaved(urls: dict[str, str], samples: Sequence[Sample], model: str,
                          warmups: Sequence[Sample] = (), timeout_s: float = 300.0) -> dict[str, list[RequestRecord]]:
    """One record per (mode, sample), in sample order; every mode sees every sample."""
    modes = list(urls)
    out: dict[str, list[RequestRecord]] = {m: [] for m in modes}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        clients = {m: _Client(session, LoadConfig(base_url=u, model=model, ignore_eos=True, timeout_s=timeout_s,
                                                  progress=False)) for m, u in urls.items()}
        for w in warmups:
            for m in modes:
                await clients[m].send(-1, w, 0.0)
        t0 = time.perf_counter()
        for i, sample in enumerate(samples):
            k = i % len(modes)
            for m in modes[k:] + modes[:k]:
                out[m].append(await clients[m].send(i, sample, t0))
    return out


def _ttfts(records: Sequence[RequestRecord]) -> np.ndarray:
    return np.array([r.ttft_s * 1000.0 if r.success and r.ttft_s is not None else np.nan for r in records])


def _overheads(records: Sequence[RequestRecord]) -> np.ndarray:
    """TTFT minus the request's own prefill phase (ms): the serving path's cost, without the
    prefill time that machine noise moves by far more than the path costs."""
    out = []
    for r in records:
        phases = None
        if r.success and r.ttft_s is not None and r.kvpush_trace and r.sent_unix and r.first_chunk_unix:
            phases = phases_of({**events_of(r.kvpush_trace), START: r.sent_unix, END: r.first_chunk_unix})
        out.append(r.ttft_s * 1000.0 - phases["prefill"] if phases is not None and r.ttft_s is not None else np.nan)
    return np.array(out)


def paired_report(results: dict[str, list[RequestRecord]], reference: str = "colocated",
                  pairs: Sequence[tuple[str, str]] = (("push", "pull"),)) -> str:
    """Markdown: TTFT and serving overhead (TTFT - prefill) per mode, per-prompt differences to
    `reference`, and paired ratios with a verdict."""
    ttft = {m: _ttfts(recs) for m, recs in results.items()}
    over = {m: _overheads(recs) for m, recs in results.items()}
    ok = np.logical_and.reduce([~np.isnan(v) for v in ttft.values()])
    ok_over = np.logical_and.reduce([~np.isnan(v) for v in over.values()])
    lines = ["| mode | requests | failed | TTFT p50 ms [95% CI] | TTFT p99 ms | p50 of (mode - "
             f"{reference}) ms [95% CI] |", "|---|---|---|---|---|---|"]
    for m, v in ttft.items():
        good = v[ok]
        diff = "-"
        if reference in ttft and m != reference and good.size:
            diff = fmt_ci(*bootstrap_ci(good - ttft[reference][ok]), digits=1)
        p50 = fmt_ci(*bootstrap_ci(good), digits=1) if good.size else "-"
        p99 = f"{np.percentile(good, 99):.1f}" if good.size else "-"
        lines.append(f"| {m} | {v.size} | {int(np.isnan(v).sum())} | {p50} | {p99} | {diff} |")
    lines += ["", f"| mode | overhead = TTFT - prefill, p50 ms [95% CI] | p50 of (mode - {reference}) ms [95% CI] |",
              "|---|---|---|"]
    for m, v in over.items():
        good = v[ok_over]
        if not good.size:
            continue
        diff = "-"
        if reference in over and m != reference:
            diff = fmt_ci(*bootstrap_ci(good - over[reference][ok_over]), digits=1)
        lines.append(f"| {m} | {fmt_ci(*bootstrap_ci(good), digits=1)} | {diff} |")
    for a, b in pairs:
        if a in ttft and b in ttft and ok.any():
            est, lo, hi = ratio_ci(ttft[a][ok], ttft[b][ok], paired=True)
            lines.append(f"\nTTFT p50 {a}/{b} (paired): {fmt_ci(est, lo, hi)} -> {verdict(lo, hi, a, b)}")
    return "\n".join(lines) + "\n"
