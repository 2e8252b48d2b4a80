"""How decode rows attend on this machine (`--decode-attention`, layers/attention.py).

`kernel`: the C kernel (layers/cpu_kernels.py: paged_decode) reads each sequence's K/V in place from the
cache; `sdpa`: each sequence's blocks are gathered into a contiguous copy and one padded SDPA call
attends over them. The kernel serves CPU fp32 caches where a C compiler builds it; SDPA serves
everywhere, and is the only path on a GPU (the flag is a CPU option there).

`auto` (the default) times both at start-up with the model's attention shapes (query heads, KV heads,
head_dim, block size) on one layer of a scratch cache whose blocks are scattered, as a busy cache hands
them out: decode batches of 1 x 512, 16 x 512 and 4 x 2,048 tokens of context, alternating, medians
(engine/calibration.py). SDPA is chosen when the geometric mean of its time over the kernel's is below
1 - MARGIN; otherwise, ties included, the kernel. The choice is cached per CPU model, torch version,
torch threads, dtype, shapes and workloads (one JSON file per key, next to the linear backend's) and
logged in one line. Both paths compute the same attention up to fp32 rounding (tests/test_attention_choice.py
runs the greedy parity with each forced); instances on one machine read the same cached choice. A
calibration that fails (an error from torch while timing) keeps the kernel, saying so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvpush.config import DecodeAttention, linear_cache_dir
from kvpush.engine import calibration as cal
from kvpush.engine.kv_cache import KVCache, KVLayout
from kvpush.errors import ModelLoadError
from kvpush.layers.attention import AttentionMetadata, decode_batch
from kvpush.layers.cpu_kernels import PagedDecode, paged_decode_kernel, source_hash

FORMAT = 1  # of the cache file; a new one invalidates old files
PREFIX = "decode-attention"
MARGIN = 0.03  # SDPA must be this much faster (geometric mean) to be chosen: noise keeps the kernel


@dataclass(frozen=True)
class Workload:
    name: str
    batch: int  # decode rows
    context: int  # tokens of context each (the new one included)


WORKLOADS = (Workload("decode 1x512", 1, 512), Workload("decode 16x512", 16, 512), Workload("decode 4x2048", 4, 2048))


@dataclass(frozen=True)
class Shapes:
    """What a decode attention call's cost depends on, besides batch and context."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


Timings = dict[str, tuple[float, float]]  # workload -> (kernel ms, sdpa ms), medians


@dataclass
class AttentionChoice:
    path: DecodeAttention  # KERNEL or SDPA
    source: str  # flag | measured | cached | device (not a CPU) | unavailable (the kernel cannot serve)
    kernel: PagedDecode | None = None  # the loaded kernel where path is KERNEL
    timings: Timings = field(default_factory=dict)
    file: str | None = None
    seconds: float = 0.0
    when: str = ""
    note: str = ""

    def line(self) -> str:
        """The start-up log line."""
        head = f"decode attention: {self.path.value}"
        if self.source == "flag":
            return f"{head} (forced by --decode-attention)"
        if self.source in ("device", "unavailable"):
            return f"{head} ({self.note})"
        return f"{head} " + cal.measured_line(self.source, self.seconds, self.when, self.file, self.timings,
                                              ("kernel", "sdpa"), 3)


def ratio(timings: Timings) -> float:
    """Geometric mean over the workloads of SDPA's time over the kernel's."""
    return cal.ratio(timings)


def decide(timings: Timings) -> DecodeAttention:
    return DecodeAttention.SDPA if ratio(timings) < 1 - MARGIN else DecodeAttention.KERNEL


def cache_key(cpu: dict[str, Any], shapes: Shapes, dtype: torch.dtype, threads: int) -> dict[str, Any]:
    return {"format": FORMAT, "cpu": cal.cpu_identity(cpu), "torch": str(torch.__version__), "threads": threads,
            "dtype": str(dtype).removeprefix("torch."),
            "shapes": [shapes.num_heads, shapes.num_kv_heads, shapes.head_dim, shapes.block_size],
            "workloads": [[w.name, w.batch, w.context] for w in WORKLOADS],
            "kernel": source_hash()}  # a new kernel is measured again


def cached_entries(cache_dir: str, cpu: dict[str, Any]) -> list[dict[str, Any]]:
    """Every cached choice made on this CPU model with this torch (for `kvpush env`), newest first."""
    here = {"cpu": cal.cpu_identity(cpu), "torch": str(torch.__version__), "format": FORMAT}
    return [e for e in cal.entries(cache_dir, PREFIX, here) if _valid(e)]


def _valid(entry: dict[str, Any] | None) -> bool:
    """A cache entry this module wrote: a path and a (kernel ms, sdpa ms) pair per workload, all positive."""
    if entry is None or entry.get("path") not in (DecodeAttention.KERNEL, DecodeAttention.SDPA):
        return False
    timings = entry.get("timings")
    return (isinstance(timings, dict) and bool(timings) and isinstance(entry.get("ratio"), int | float)
            and all(isinstance(t, list) and len(t) == 2 and all(isinstance(x, int | float) and x > 0 for x in t)
                    for t in timings.values()))


def choose(requested: DecodeAttention, shapes: Shapes, dtype: torch.dtype, device: torch.device, *,
           cpu: dict[str, Any], cache_dir: str, measure=None) -> AttentionChoice:
    """The decode attention path for a cache of `dtype` on `device`. ModelLoadError where `kernel` is
    asked for and cannot serve. ``measure(shapes, dtype, kernel) -> Timings`` replaces the timing (tests)."""
    if device.type != "cpu":
        return AttentionChoice(DecodeAttention.SDPA, "device",
                               note=f"SDPA on {device.type}: --decode-attention applies to CPU caches")
    if requested is DecodeAttention.SDPA:
        return AttentionChoice(DecodeAttention.SDPA, "flag")
    kernel, why = _kernel(dtype)
    if kernel is None:
        if requested is DecodeAttention.KERNEL:
            raise ModelLoadError(f"--decode-attention kernel: {why}")
        return AttentionChoice(DecodeAttention.SDPA, "unavailable", note=why)
    if requested is DecodeAttention.KERNEL:
        return AttentionChoice(DecodeAttention.KERNEL, "flag", kernel)
    key = cache_key(cpu, shapes, dtype, torch.get_num_threads())
    path = cal.cache_path(cache_dir, PREFIX, key)
    if (cached := _cached(path, key, kernel)) is not None:
        return cached
    with cal.locked(path):  # instances starting together (kvpush up) measure once
        if (cached := _cached(path, key, kernel)) is not None:
            return cached
        start = time.perf_counter()
        try:
            timings = (measure or measure_paths)(shapes, dtype, kernel)
        except RuntimeError as e:  # torch could not run one of the paths here: keep the kernel
            return AttentionChoice(DecodeAttention.KERNEL, "unavailable", kernel,
                                   note=f"kernel; calibration failed: {str(e).strip().splitlines()[0]}")
        seconds = time.perf_counter() - start
        chosen, when = decide(timings), cal.now()
        cal.write_entry(path, {"key": key, "path": chosen.value, "timings": timings, "ratio": ratio(timings),
                               "measured_at": when, "seconds": round(seconds, 2)})
    return AttentionChoice(chosen, "measured", kernel if chosen is DecodeAttention.KERNEL else None, timings,
                           str(path), seconds, when)


def _kernel(dtype: torch.dtype) -> tuple[PagedDecode | None, str]:
    if dtype != torch.float32:
        return None, f"the C kernel reads fp32 caches; this one is {str(dtype).removeprefix('torch.')}"
    kernel = paged_decode_kernel()
    return kernel, "" if kernel is not None else "the C kernel could not be built here (see the log line above)"


def _cached(path: Path, key: dict[str, Any], kernel: PagedDecode) -> AttentionChoice | None:
    entry = cal.read_json(path)
    if entry is None or not _valid(entry) or entry.get("key") != key:
        return None
    timings = {w: (float(k), float(s)) for w, (k, s) in entry["timings"].items()}
    chosen = DecodeAttention(entry["path"])
    return AttentionChoice(chosen, "cached", kernel if chosen is DecodeAttention.KERNEL else None, timings,
                           str(path), when=entry.get("measured_at", ""))


def choose_for(requested: DecodeAttention, layout: KVLayout, num_heads: int, device: torch.device,
               cpu: dict[str, Any]) -> AttentionChoice:
    """choose() for an engine's KV layout and its model's query heads."""
    shapes = Shapes(num_heads, layout.num_kv_heads, layout.head_dim, layout.block_size)
    return choose(requested, shapes, layout.dtype, device, cpu=cpu, cache_dir=linear_cache_dir())


def measure_paths(shapes: Shapes, dtype: torch.dtype, kernel: PagedDecode) -> Timings:
    """Median ms of one layer's decode attention, kernel and SDPA, per workload (alternating rounds)."""
    gen = torch.Generator().manual_seed(0)
    bs, scale = shapes.block_size, shapes.head_dim ** -0.5
    out: Timings = {}
    with torch.inference_mode():
        for w in WORKLOADS:
            nb = -(-w.context // bs)
            layout = KVLayout(w.batch * nb + 1, 1, bs, shapes.num_kv_heads, shapes.head_dim, dtype)
            cache = KVCache(layout)
            cache.kv.normal_(generator=gen)  # [N, 1, 2, bs, kvh, hd]
            table = torch.randperm(w.batch * nb, generator=gen) + 1  # [B * nb] scattered; block 0 unused
            lens = torch.full((w.batch,), w.context, dtype=torch.long)  # [B]
            q = torch.randn(w.batch, shapes.num_heads, shapes.head_dim, generator=gen, dtype=dtype)  # [B, H, hd]
            fast = AttentionMetadata(torch.empty(0, dtype=torch.long), w.batch, table, lens, decode_kernel=kernel)
            mask = (torch.arange(nb * bs).unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]  # [B, 1, 1, nb * bs]
            gather = AttentionMetadata(torch.empty(0, dtype=torch.long), w.batch, table, lens, mask)

            def kernel_call(meta=fast, q=q, cache=cache) -> None:
                decode_batch(q, 0, meta, cache, scale)

            def sdpa_call(meta=gather, q=q, cache=cache) -> None:
                decode_batch(q, 0, meta, cache, scale)

            out[w.name] = cal.alternate(kernel_call, sdpa_call)
    return out
