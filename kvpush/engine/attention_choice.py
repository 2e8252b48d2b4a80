"""How decode rows (`--decode-attention`) and prefill chunks (`--prefill-attention`) attend on this machine
(layers/attention.py). Two choices, one mechanism (an `Op` each).

Decode, `kernel`: the C kernel (layers/cpu_kernels.py: paged_decode) reads each sequence's K/V in place
from the cache; `sdpa`: each sequence's blocks are gathered into a contiguous copy and one padded SDPA
call attends over them. Prefill, `kernel`: one C call a chunk (prefill_attention, one thread) attends its
rows over their context; `sdpa`: torch's SDPA (fresh prompts of 256-767 rows and chunks after context in
64-row pieces with additive causal masks, other fresh prompts in one causal call). The kernels serve CPU
fp32 caches where a C compiler builds them (the prefill one: head sizes a multiple of its vector width);
SDPA serves everywhere, and is the only path on a GPU (the flags are CPU options there).

`auto` (the default) times both at start-up with the model's attention shapes (query heads, KV heads,
head_dim, block size) on one layer of a scratch cache whose blocks are scattered, as a busy cache hands
them out: decode batches of 1 x 512, 16 x 512 and 4 x 2,048 tokens of context; prefill chunks of 512
fresh rows, 1,024 fresh rows and 256 rows after 1,792 of context; alternating, medians
(engine/calibration.py). SDPA is chosen when the geometric mean of its time over the kernel's is below
1 - MARGIN; otherwise, ties included, the kernel. The choice is cached per CPU model, torch version,
torch threads, dtype, shapes and workloads (one JSON file per key, next to the linear backend's) and
logged in one line. Both paths compute the same attention up to fp32 rounding (tests/test_attention_choice.py
runs the greedy parity with each forced); instances on one machine read the same cached choice. A
calibration that fails (an error from torch while timing) keeps the kernel, saying so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvpush.config import AttentionPath, linear_cache_dir
from kvpush.engine import calibration as cal
from kvpush.engine.kv_cache import KVCache, KVLayout
from kvpush.errors import ModelLoadError
from kvpush.layers import cpu_kernels
from kvpush.layers.attention import AttentionMetadata, PrefillSeq, decode_batch, prefill_one
from kvpush.layers.cpu_kernels import (
    PagedDecode,
    PrefillAttention,
    paged_decode_kernel,
    prefill_attention,
    source_hash,
)

DecodeAttention = AttentionPath  # the name the tests and benchmarks know this choice's values by
FORMAT = 1  # of the cache file; a new one invalidates old files
PREFIX = "decode-attention"
MARGIN = 0.03  # SDPA must be this much faster (geometric mean) to be chosen: noise keeps the kernel


@dataclass(frozen=True)
class Workload:
    name: str
    batch: int  # decode: sequences of one row each; prefill: the chunk's rows
    context: int  # tokens of context each (the new ones included)


WORKLOADS = (Workload("decode 1x512", 1, 512), Workload("decode 16x512", 16, 512), Workload("decode 4x2048", 4, 2048))
PREFILL_WORKLOADS = (Workload("prefill 512", 512, 512), Workload("prefill 1024", 1024, 1024),
                     Workload("prefill 256 after 1792", 256, 2048))


@dataclass(frozen=True)
class Shapes:
    """What an attention call's cost depends on, besides batch and context."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


Timings = dict[str, tuple[float, float]]  # workload -> (kernel ms, sdpa ms), medians
Kernel = PagedDecode | PrefillAttention


@dataclass(frozen=True)
class Op:
    """One of the two choices: which rows, its flag, its cache files, its workloads and its kernel."""

    name: str  # decode | prefill
    flag: str
    prefix: str  # of its cache files
    workloads: tuple[Workload, ...]
    load: Callable[[], Kernel | None]  # the kernel, or None where it cannot be built
    measure: Callable[[Shapes, torch.dtype, Any], Timings]  # (shapes, dtype, kernel) -> Timings
    source: Path  # the kernel's C file: a new version is measured again


def _decode_op() -> Op:
    return Op("decode", "--decode-attention", PREFIX, WORKLOADS, paged_decode_kernel, measure_paths,
              cpu_kernels.SOURCE)


def _prefill_op() -> Op:
    return Op("prefill", "--prefill-attention", "prefill-attention", PREFILL_WORKLOADS, prefill_attention,
              measure_prefill, cpu_kernels.PREFILL_SOURCE)


@dataclass
class AttentionChoice:
    path: AttentionPath  # KERNEL or SDPA
    source: str  # flag | measured | cached | device (not a CPU) | unavailable (the kernel cannot serve)
    kernel: Any = None  # the loaded kernel (PagedDecode | PrefillAttention) where path is KERNEL
    timings: Timings = field(default_factory=dict)
    file: str | None = None
    seconds: float = 0.0
    when: str = ""
    note: str = ""
    op: str = "decode"  # decode | prefill

    def line(self) -> str:
        """The start-up log line."""
        head = f"{self.op} attention: {self.path.value}"
        if self.source == "flag":
            return f"{head} (forced by --{self.op}-attention)"
        if self.source in ("device", "unavailable"):
            return f"{head} ({self.note})"
        return f"{head} " + cal.measured_line(self.source, self.seconds, self.when, self.file, self.timings,
                                              ("kernel", "sdpa"), 3)


def ratio(timings: Timings) -> float:
    """Geometric mean over the workloads of SDPA's time over the kernel's."""
    return cal.ratio(timings)


def decide(timings: Timings) -> AttentionPath:
    return AttentionPath.SDPA if ratio(timings) < 1 - MARGIN else AttentionPath.KERNEL


def cache_key(cpu: dict[str, Any], shapes: Shapes, dtype: torch.dtype, threads: int,
              op: Op | None = None) -> dict[str, Any]:
    op = op or _decode_op()
    return {"format": FORMAT, "cpu": cal.cpu_identity(cpu), "torch": str(torch.__version__), "threads": threads,
            "dtype": str(dtype).removeprefix("torch."),
            "shapes": [shapes.num_heads, shapes.num_kv_heads, shapes.head_dim, shapes.block_size],
            "workloads": [[w.name, w.batch, w.context] for w in op.workloads],
            "kernel": source_hash(op.source)}  # a new kernel is measured again


def cached_entries(cache_dir: str, cpu: dict[str, Any], op: str = "decode") -> list[dict[str, Any]]:
    """Every cached choice of `op` made on this CPU model with this torch and this kernel's source (for
    `kvpush env`), newest first."""
    spec = _decode_op() if op == "decode" else _prefill_op()
    here = {"cpu": cal.cpu_identity(cpu), "torch": str(torch.__version__), "format": FORMAT,
            "kernel": source_hash(spec.source)}
    return [e for e in cal.entries(cache_dir, spec.prefix, here) if _valid(e)]


def _valid(entry: dict[str, Any] | None) -> bool:
    """A cache entry this module wrote: a path and a (kernel ms, sdpa ms) pair per workload, all positive."""
    if entry is None or entry.get("path") not in (AttentionPath.KERNEL, AttentionPath.SDPA):
        return False
    timings = entry.get("timings")
    return (isinstance(timings, dict) and bool(timings) and isinstance(entry.get("ratio"), int | float)
            and all(isinstance(t, list) and len(t) == 2 and all(isinstance(x, int | float) and x > 0 for x in t)
                    for t in timings.values()))


def choose(requested: AttentionPath, shapes: Shapes, dtype: torch.dtype, device: torch.device, *,
           cpu: dict[str, Any], cache_dir: str, measure=None, op: Op | None = None) -> AttentionChoice:
    """The attention path of `op` (decode rows by default) for a cache of `dtype` on `device`. ModelLoadError
    where `kernel` is asked for and cannot serve. ``measure(shapes, dtype, kernel) -> Timings`` replaces the
    timing (tests)."""
    op = op or _decode_op()
    if device.type != "cpu":
        return AttentionChoice(AttentionPath.SDPA, "device", op=op.name,
                               note=f"SDPA on {device.type}: {op.flag} applies to CPU caches")
    if requested is AttentionPath.SDPA:
        return AttentionChoice(AttentionPath.SDPA, "flag", op=op.name)
    kernel, why = _kernel(op, dtype, shapes.head_dim)
    if kernel is None:
        if requested is AttentionPath.KERNEL:
            raise ModelLoadError(f"{op.flag} kernel: {why}")
        return AttentionChoice(AttentionPath.SDPA, "unavailable", op=op.name, note=why)
    if requested is AttentionPath.KERNEL:
        return AttentionChoice(AttentionPath.KERNEL, "flag", kernel, op=op.name)
    key = cache_key(cpu, shapes, dtype, torch.get_num_threads(), op)
    path = cal.cache_path(cache_dir, op.prefix, key)
    if (cached := _cached(path, key, kernel, op)) is not None:
        return cached
    with cal.locked(path):  # instances starting together (kvpush up) measure once
        if (cached := _cached(path, key, kernel, op)) is not None:
            return cached
        start = time.perf_counter()
        try:
            timings = (measure or op.measure)(shapes, dtype, kernel)
        except RuntimeError as e:  # torch could not run one of the paths here: keep the kernel
            return AttentionChoice(AttentionPath.KERNEL, "unavailable", kernel, op=op.name,
                                   note=f"kernel; calibration failed: {str(e).strip().splitlines()[0]}")
        seconds = time.perf_counter() - start
        chosen, when = decide(timings), cal.now()
        cal.write_entry(path, {"key": key, "path": chosen.value, "timings": timings, "ratio": ratio(timings),
                               "measured_at": when, "seconds": round(seconds, 2)})
    return AttentionChoice(chosen, "measured", kernel if chosen is AttentionPath.KERNEL else None, timings,
                           str(path), seconds, when, op=op.name)


def _kernel(op: Op, dtype: torch.dtype, head_dim: int) -> tuple[Kernel | None, str]:
    if dtype != torch.float32:
        return None, f"the C kernel reads fp32 caches; this one is {str(dtype).removeprefix('torch.')}"
    kernel = op.load()
    if kernel is None:
        return None, "the C kernel could not be built here (see the log line above)"
    why = kernel.declines(head_dim)
    return (None, why) if why else (kernel, "")


def _cached(path: Path, key: dict[str, Any], kernel: Kernel, op: Op) -> AttentionChoice | None:
    entry = cal.read_json(path)
    if entry is None or not _valid(entry) or entry.get("key") != key:
        return None
    timings = {w: (float(k), float(s)) for w, (k, s) in entry["timings"].items()}
    chosen = AttentionPath(entry["path"])
    return AttentionChoice(chosen, "cached", kernel if chosen is AttentionPath.KERNEL else None, timings,
                           str(path), when=entry.get("measured_at", ""), op=op.name)


def choose_for(requested: AttentionPath, layout: KVLayout, num_heads: int, device: torch.device,
               cpu: dict[str, Any], op: str = "decode") -> AttentionChoice:
    """choose() of `op` (decode | prefill) for an engine's KV layout and its model's query heads."""
    shapes = Shapes(num_heads, layout.num_kv_heads, layout.head_dim, layout.block_size)
    return choose(requested, shapes, layout.dtype, device, cpu=cpu, cache_dir=linear_cache_dir(),
                  op=_decode_op() if op == "decode" else _prefill_op())


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
            out[w.name] = cal.alternate(partial(decode_batch, q, 0, fast, cache, scale),
                                        partial(decode_batch, q, 0, gather, cache, scale))
    return out


def measure_prefill(shapes: Shapes, dtype: torch.dtype, kernel: PrefillAttention) -> Timings:
    """Median ms of one layer's attention of a prefill chunk, kernel and SDPA, per workload (alternating)."""
    gen = torch.Generator().manual_seed(0)
    bs, scale = shapes.block_size, shapes.head_dim ** -0.5
    out: Timings = {}
    with torch.inference_mode():
        for w in PREFILL_WORKLOADS:
            nb = -(-w.context // bs)
            cache = KVCache(KVLayout(nb + 1, 1, bs, shapes.num_kv_heads, shapes.head_dim, dtype))
            cache.kv.normal_(generator=gen)  # [N, 1, 2, bs, kvh, hd]
            seq = PrefillSeq(0, w.batch, w.context, torch.randperm(nb, generator=gen) + 1)  # scattered blocks
            q = torch.randn(w.batch, shapes.num_heads, shapes.head_dim, generator=gen, dtype=dtype)  # [T, H, hd]
            k, v = (torch.randn(w.batch, shapes.num_kv_heads, shapes.head_dim, generator=gen, dtype=dtype)
                    for _ in range(2))  # [T, kvh, hd]
            fast = AttentionMetadata(torch.empty(0, dtype=torch.long), prefill_kernel=kernel)
            plain = AttentionMetadata(torch.empty(0, dtype=torch.long))
            out[w.name] = cal.alternate(partial(prefill_one, q, k, v, seq, 0, cache, scale, fast),
                                        partial(prefill_one, q, k, v, seq, 0, cache, scale, plain))
    return out
