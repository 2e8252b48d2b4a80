"""C kernels for the CPU path, built on first use with the system's C compiler and cached.

Three sources, one library:
- `paged_decode` (paged_decode.c) computes the attention of decode rows by reading K and V in place
  from the block-major cache, instead of gathering each sequence's blocks into a contiguous copy and
  running SDPA over it. `write_decode` first writes the new tokens' K and V rows (as `write_rows`,
  KVCache.write's fast path, does), for a forward whose every row decodes: one call a layer (DecodeStep).
- `prefill_attention` (prefill_attention.c) attends a prefill chunk's rows over their context in one call.
- `kv_digest` (kv_digest.c) serves the emulated runner (emulate/kv_pattern.py), not the model.
The library is built once per machine with `cc -O3 -march=native -ffast-math`, each source compiled
apart and then linked, into the user cache (`~/.cache/kvpush/kernels/paged_decode-<hash of the sources,
flags, compiler, CPU>.so`) and loaded with ctypes: no torch headers, so the build takes a few seconds.
Where it cannot be built or loaded (no C compiler, another OS), every getter below returns None and
attention keeps its SDPA paths, with one log line; a forward never mixes the two for the rows of one
batch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from kvpush.config import c_compiler, user_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
PREFILL_SOURCE = Path(__file__).with_name("prefill_attention.c")  # causal attention of prefill chunks
DIGEST_SOURCE = Path(__file__).with_name("kv_digest.c")  # the emulated runner's KV read-back (KVDigest)
SOURCES = (SOURCE, PREFILL_SOURCE, DIGEST_SOURCE)  # one library
HEADER = Path(__file__).with_name("cpu_vec.h")  # the vector types and helpers paged_decode.c and prefill_attention.c share
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-fPIC"]  # compile step
# Linked in a second step without -ffast-math: linking with it adds crtfastmath.o, whose constructor
# turns on flush-to-zero for the whole process when the library loads (found by a hypothesis test
# that saw subnormals become 0). libmvec serves the vectorised expf that -ffast-math calls.
LINK = ["-shared", "-lmvec", "-lm"]
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class PagedDecode:
    """The loaded kernel. Call with contiguous CPU fp32 q [B, H, hd], the cache's kv tensor, an int64
    block table [B, nb] and lengths [B]; returns [B, H, hd]."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.fn = lib.kvpush_paged_decode
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [_PTR] * 5 + [_I64] * 8 + [ctypes.c_float]
        # absent from a library built from an older source (benchmarks/decode_kernel.py --against REV)
        self.write_decode = getattr(lib, "kvpush_write_decode", None)
        if self.write_decode is not None:
            self.write_decode.restype = ctypes.c_int
            self.write_decode.argtypes = [_PTR] * 4 + [_I64] * 2 + [_PTR] * 4 + [_I64] * 8 + [ctypes.c_float]
        self._vector_path = getattr(lib, "kvpush_decode_vector_path", None)
        if self._vector_path is not None:
            self._vector_path.restype, self._vector_path.argtypes = ctypes.c_int, [_I64]

    def vector_path(self, head_dim: int) -> bool:
        """Whether heads of `head_dim` take the kernel's 16-token-tile path (AVX-512 builds, head sizes a
        multiple of 16 up to 128) rather than its plain loops (for tests)."""
        return self._vector_path is not None and bool(self._vector_path(head_dim))

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
                 layer: int, scale: float) -> torch.Tensor:
        b, h, d = q.shape
        _, num_layers, _, block_size, kvh, _ = kv.shape
        out = torch.empty_like(q)
        rc = self.fn(q.data_ptr(), kv.data_ptr(), table.data_ptr(), lens.data_ptr(), out.data_ptr(),
                     b, h, kvh, d, num_layers, block_size, table.shape[1], layer, scale)
        if rc != 0:
            raise MemoryError("paged_decode: no memory for its score rows")
        return out

    def declines(self, head_dim: int) -> str:
        """"": the decode kernel takes every head size (plain loops where no vector width divides it)."""
        return ""

    def bind(self, kv: torch.Tensor, rows: torch.Tensor, table: torch.Tensor,
             lens: torch.Tensor) -> DecodeStep | None:
        """The calls of one forward whose every row decodes (see DecodeStep), or None where the library lacks
        them."""
        return DecodeStep(self, kv, rows, table, lens) if self.write_decode is not None else None


class DecodeStep:
    """One forward's decode-only layers, each by one C call that writes the new K/V rows and attends
    (kvpush_write_decode): built by ModelRunner.prepare, called by layers/attention.py once per layer.

    kv: the cache [N, L, 2, bs, kvh, hd] fp32; rows: [2B] int64 (KVCache.slot_rows); table: [B, nb] int64;
    lens: [B] int64. What does not change between layers is converted once, here."""

    def __init__(self, kernel: PagedDecode, kv: torch.Tensor, rows: torch.Tensor, table: torch.Tensor,
                 lens: torch.Tensor) -> None:
        _, num_layers, _, block_size, kvh, d = kv.shape
        assert kernel.write_decode is not None
        self.fn = kernel.write_decode
        self.kv, self.rows, self.table, self.lens = kv, rows, table, lens  # held: the pointers below are theirs
        assert kv.dtype == torch.float32 and rows.numel() == 2 * table.shape[0] == 2 * lens.numel()
        self.ptrs = (kv.data_ptr(), rows.data_ptr())
        self.tail = (table.data_ptr(), lens.data_ptr())
        self.batch = table.shape[0]
        self.row_shape = (kvh, d)
        self.sizes = (kvh, d, num_layers, block_size, table.shape[1])

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor | None:
        """q: [B, H, hd], k, v: [B, kvh, hd] fp32 -> [B, H, hd], or None (nothing done) where these do not
        hold: B rows each, the cache's row shape, fp32, q contiguous, each K and V row contiguous (the
        caller takes the general path)."""
        if not (q.dtype == k.dtype == v.dtype == torch.float32 and q.shape[0] == k.shape[0] == v.shape[0] == self.batch
                and k.shape[1:] == v.shape[1:] == self.row_shape and q.shape[2] == self.row_shape[1]
                and q.is_contiguous() and _rows_contiguous(k) and _rows_contiguous(v)):
            return None
        out = torch.empty_like(q)
        rc = self.fn(*self.ptrs, k.data_ptr(), v.data_ptr(), k.stride(0) * 4, v.stride(0) * 4, q.data_ptr(), *self.tail,
                     out.data_ptr(), self.batch, q.shape[1], *self.sizes, layer, scale)  # strides in bytes (fp32)
        if rc != 0:
            raise MemoryError("paged_decode: no memory for its score rows")
        return out


class PrefillAttention:
    """The loaded causal prefill attention (prefill_attention.c): a chunk's query rows against their context
    in one C call (one thread), instead of SDPA."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        width = lib.kvpush_prefill_width
        width.restype, width.argtypes = ctypes.c_int, []
        self.width = int(width())  # floats a vector: head_dim must be a multiple of it
        self.fn = lib.kvpush_prefill_attention
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, ctypes.c_float]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
        """q: [T, H, hd], k, v: [ctx, kvh, hd] fp32 on the host, each token's heads contiguous; query row t
        at position ctx - T + t. -> [T, H, hd] contiguous, or None where the kernel does not take these
        (another dtype or layout, a head size `declines`)."""
        t, heads, hd = q.shape
        ctx, kvh = k.shape[0], k.shape[1]
        if not (q.dtype == k.dtype == v.dtype == torch.float32 and q.device.type == k.device.type == v.device.type
                == "cpu" and _rows_contiguous(q) and _rows_contiguous(k) and _rows_contiguous(v)
                and v.shape == k.shape and k.shape[2] == hd and 0 < t <= ctx and heads % kvh == 0
                and not self.declines(hd)):
            return None
        out = torch.empty((t, heads, hd), dtype=torch.float32)
        rc = self.fn(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                     out.data_ptr(), t, ctx, heads, kvh, hd, scale)
        if rc == -1:
            raise MemoryError("prefill_attention: no memory for its scratch rows")
        return out if rc == 0 else None


    def declines(self, head_dim: int) -> str:
        """Why this build cannot attend heads of `head_dim`, or "" where it can."""
        if head_dim % self.width:
            return f"the C prefill kernel needs head_dim a multiple of {self.width} here; this model's is {head_dim}"
        return ""


class RowWriter:
    """The loaded row copy (KVCache.write's fast path on CPU): new K and V rows into the cache with one
    C call, instead of three torch ops (~60 us a layer at one token, mostly dispatch)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.fn = lib.kvpush_write_rows
        self.fn.restype = None
        self.fn.argtypes = [_PTR] * 4 + [_I64] * 5

    def __call__(self, kv: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_rows: int) -> bool:
        """kv: the cache; rows: [2T] int64 (KVCache.slot_rows); k, v: [T, kvh, hd] of the cache's dtype,
        each token's row contiguous. Returns False (nothing written) where these do not hold."""
        row = k.shape[1] * k.shape[2]
        if not (k.dtype == v.dtype == kv.dtype and k.device.type == v.device.type == "cpu" and rows.is_contiguous()
                and rows.dtype == torch.int64 and _rows_contiguous(k) and _rows_contiguous(v)
                and rows.shape[0] == 2 * k.shape[0] == 2 * v.shape[0]):
            return False
        size = k.element_size()
        self.fn(kv.data_ptr(), rows.data_ptr(), k.data_ptr(), v.data_ptr(), k.shape[0], row * size,
                k.stride(0) * size, v.stride(0) * size, layer_rows)
        return True


class KVDigest:
    """The loaded read-back of kv_digest.c: KVPattern.digests' sum over one span in one pass."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.fn = lib.kvpush_kv_digest
        self.fn.restype = _I64
        self.fn.argtypes = [_PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR]

    def __call__(self, kv: torch.Tensor, table: torch.Tensor, start: int, end: int, w_pos: torch.Tensor,
                 w_end: torch.Tensor) -> int:
        """kv: a contiguous cache [N, L, 2, bs, kvh, hd] of 2- or 4-byte elements; table: the span's blocks
        (int64, contiguous, covering [0, end)); w_pos [>= end], w_end [L * 4]: int64. The sum, signed."""
        n, layers, _, bs = kv.shape[:4]
        if not (kv.is_contiguous() and kv.element_size() in (2, 4) and table.dtype == w_pos.dtype == w_end.dtype
                == torch.int64 and table.is_contiguous() and w_pos.is_contiguous() and w_end.is_contiguous()
                and table.numel() * bs >= end and w_pos.numel() >= end and w_end.numel() == 4 * layers
                and 0 <= start <= end and _within(table[:(end + bs - 1) // bs], n)):
            raise ValueError("kv_digest: cache, block table or weights do not fit the span")
        return int(self.fn(kv.data_ptr(), table.data_ptr(), start, end, layers, bs, kv[0, 0, 0, 0].numel(),
                           kv.element_size(), w_pos.data_ptr(), w_end.data_ptr()))


def _within(ids: torch.Tensor, n: int) -> bool:
    return ids.numel() == 0 or (int(ids.min()) >= 0 and int(ids.max()) < n)


def _rows_contiguous(x: torch.Tensor) -> bool:
    """[T, kvh, hd] whose every [kvh, hd] row is contiguous."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _cpu_signature() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def _build(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objs = [str(Path(tmp) / f"{source.stem}.o") for source in SOURCES]
        out = Path(tmp) / target.name
        steps = [[*FLAGS, "-c", str(source), "-o", obj] for source, obj in zip(SOURCES, objs, strict=True)]
        for argv in [*steps, [*objs, "-o", str(out), *LINK]]:
            subprocess.run([c_compiler(), *argv], check=True, capture_output=True, text=True, timeout=120)
        os.replace(out, target)  # atomic: processes building at once each install a whole file


def source_hash(source: Path = SOURCE) -> str:
    """A kernel's source (with the header it includes), hashed: a cached choice between that kernel and
    SDPA is for this source only."""
    return hashlib.sha256(source.read_bytes() + HEADER.read_bytes()).hexdigest()[:16]


def paged_decode_kernel() -> PagedDecode | None:
    """The decode kernel, built or loaded once per process; None where it cannot be (logged once)."""
    lib = _library()
    return PagedDecode(lib) if lib is not None else None


def row_writer() -> RowWriter | None:
    """The row copy, from the same library; None where it cannot be built."""
    lib = _library()
    return RowWriter(lib) if lib is not None else None


def prefill_attention() -> PrefillAttention | None:
    """The causal prefill attention, from the same library; None where it cannot be built."""
    lib = _library()
    return PrefillAttention(lib) if lib is not None else None


def kv_digest() -> KVDigest | None:
    """The emulated runner's KV read-back, from the same library; None where it cannot be built."""
    lib = _library()
    return KVDigest(lib) if lib is not None else None


@functools.cache
def _library() -> ctypes.CDLL | None:
    key = hashlib.sha256("\0".join([*(source.read_text() for source in (*SOURCES, HEADER)), *FLAGS, *LINK, c_compiler(), platform.machine(),
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    target = Path(user_cache_dir("kernels")) / f"paged_decode-{key}.so"
    try:
        if not target.exists():
            _build(target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        log.warning("CPU attention kernels unavailable (%s); decode attention gathers blocks instead, prefill "
                    "attention runs SDPA",
                    detail.strip().splitlines()[0] if detail.strip() else type(e).__name__)
        return None
