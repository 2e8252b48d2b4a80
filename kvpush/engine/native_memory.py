"""Native memory of the engine process: hand freed heap memory back to the OS once the engine is idle,
and put the long-lived buffers (weights, KV cache) on transparent huge pages.

Why: every step allocates activation tensors whose sizes follow the batch (a prefill of 1,100 tokens,
then one of 260, ...). glibc's malloc keeps what such bursts freed inside its heaps, so a prefill
instance's RSS climbs in steps with every new largest burst and never comes back down, although
nothing is leaked (measured: a prefill engine fed batches of varying length grew ~100 MB in 120
batches; with a trim after each it stayed ~60 MB lower, the same throughput). `malloc_trim(0)`
returns those free pages; it takes a few ms (5 ms p50, 10 ms max measured on the bench preset), so
the engine core calls it only after it has been idle for a while, never between two steps.

States of an IdleTrimmer: CLEAN (nothing allocated since the last trim) -> DIRTY (`worked()`: the engine
stepped) -> trimmed by `idle()` once DIRTY and idle for `after_s` -> CLEAN.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvpush.engine.native_memory")


def _libc() -> ctypes.CDLL | None:
    """The process's C library (its symbols are in the main program's namespace), or None."""
    try:
        return ctypes.CDLL(None, use_errno=True)
    except (OSError, TypeError):  # TypeError: platforms where CDLL needs a name (Windows)
        return None


def _function(name: str, argtypes: list, restype: type) -> Callable[..., int] | None:
    fn = getattr(_LIBC, name, None) if _LIBC is not None else None
    if fn is not None:
        fn.argtypes, fn.restype = argtypes, restype
    return fn


_LIBC = _libc()
_MALLOC_TRIM = _function("malloc_trim", [ctypes.c_size_t], ctypes.c_int)  # glibc only (not musl, macOS)
_MADVISE = _function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int)


def trim_heap() -> bool:
    """Return the heaps' free pages to the OS. True if the C library could (glibc), False otherwise."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


class IdleTrimmer:
    """Trims once per idle period: after the engine stepped, and then did nothing for `after_s`."""

    def __init__(self, after_s: float, trim: Callable[[], bool] = trim_heap,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.after_s = after_s
        self._trim = trim
        self._clock = clock
        self.dirty = False
        self.last_work = clock()
        self.trims = 0

    def worked(self) -> None:
        """Called by the step loop after every step that did work."""
        self.dirty = True
        self.last_work = self._clock()

    def idle(self) -> bool:
        """Called by the step loop while it has nothing to do; trims if due. True if it trimmed."""
        if not self.dirty or self._clock() - self.last_work < self.after_s:
            return False
        self.dirty = False
        start = self._clock()
        if self._trim():
            self.trims += 1
            log.debug("heap trimmed in %.1f ms", (self._clock() - start) * 1e3)
        return True


MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)  # linux/mman.h


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """Ask Linux for transparent huge pages under [address, address + nbytes) (madvise
    MADV_HUGEPAGE on the page-aligned interior). Call before the memory is first touched. True if
    the kernel accepted the advice; False where it cannot (no madvise, THP off, not Linux)."""
    page = mmap.PAGESIZE
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    if end <= start or _MADVISE is None:
        return False
    return _MADVISE(start, end - start, MADV_HUGEPAGE) == 0


HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) transparent huge page size


def huge_page_arena(nbytes: int) -> torch.Tensor:
    """A uint8 CPU buffer of `nbytes` whose start is huge-page aligned, advised for transparent huge
    pages before the caller writes it (Linux grants them to pages first touched after the advice, so
    a large buffer, which malloc maps fresh, gets them; a small one may come from reused heap pages;
    4 KiB pages otherwise, with the same contents). Carve tensors out of it with views; the views keep
    the allocation alive."""
    import torch  # not at module level: the engine core's step loop imports this module too

    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # [nbytes + 2 MiB]
    start = -(-raw.data_ptr() // HUGE_PAGE) * HUGE_PAGE - raw.data_ptr()
    arena = raw[start:start + nbytes]  # [nbytes]
    if not advise_huge_pages(arena.data_ptr(), nbytes):
        log.debug("no transparent huge pages here: 4 KiB pages")
    return arena
