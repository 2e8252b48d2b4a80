"""The idle heap trim of the engine core (kvpush/native_memory.py)."""

from __future__ import annotations

import os
import platform

import pytest

from kvpush import native_memory
from kvpush.native_memory import IdleTrimmer, trim_heap


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def trimmer(after_s: float = 1.0) -> tuple[IdleTrimmer, Clock, list[float]]:
    clock, calls = Clock(), []

    def trim() -> bool:
        calls.append(clock.now)
        return True

    return IdleTrimmer(after_s, trim=trim, clock=clock), clock, calls


def test_no_trim_before_any_work() -> None:
    t, clock, calls = trimmer()
    clock.now += 60
    assert not t.idle() and calls == []


def test_trims_once_per_idle_period_after_the_delay() -> None:
    t, clock, calls = trimmer(after_s=1.0)
    t.worked()
    clock.now += 0.5
    assert not t.idle()  # idle, but not for long enough
    clock.now += 0.5
    assert t.idle() and calls == [101.0]
    clock.now += 10
    assert not t.idle() and len(calls) == 1  # nothing allocated since: no second trim
    t.worked()
    clock.now += 1.0
    assert t.idle() and len(calls) == 2 and t.trims == 2


def test_work_postpones_the_trim() -> None:
    t, clock, calls = trimmer(after_s=1.0)
    for _ in range(5):
        t.worked()
        clock.now += 0.9
        assert not t.idle()
    assert calls == []


def test_a_library_without_trim_is_not_counted() -> None:
    clock = Clock()
    t = IdleTrimmer(0.0, trim=lambda: False, clock=clock)
    t.worked()
    assert t.idle() and t.trims == 0 and not t.dirty


@pytest.mark.skipif(native_memory._MALLOC_TRIM is None or platform.libc_ver()[0] != "glibc"
                    or "LD_PRELOAD" in os.environ, reason="glibc's malloc and its malloc_trim")
def test_real_trim_returns_freed_heap_pages() -> None:
    """On glibc the real call runs: memory freed inside the heap (below a live chunk, so free() alone
    cannot give it back) returns to the OS."""
    def rss_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

    blocks = [bytearray(64 * 1024) for _ in range(2000)]  # ~128 MiB of heap chunks (below mmap size)
    keep = blocks[-1]
    del blocks
    before = rss_kib()
    assert trim_heap()
    assert before - rss_kib() > 64 * 1024  # most of the ~128 MiB freed
    assert keep[0] == 0


def test_native_cache_bounds_are_defaults_the_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpush.config import NATIVE_CACHE_DEFAULTS, apply_native_cache_environment

    monkeypatch.setenv("LRU_CACHE_CAPACITY", "x")  # recorded, so the variable is restored afterwards
    monkeypatch.delenv("LRU_CACHE_CAPACITY")
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
    apply_native_cache_environment()

    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"  # the operator's choice wins
    assert os.environ["LRU_CACHE_CAPACITY"] == NATIVE_CACHE_DEFAULTS["LRU_CACHE_CAPACITY"]


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages off or absent")
def test_kv_cache_is_advised_onto_huge_pages() -> None:
    """The KV buffer's mapping carries MADV_HUGEPAGE (VmFlags `hg`), set before its first touch, and
    the buffer is zeroed. (How many huge pages the kernel then grants depends on its free memory.)"""
    import torch

    from kvpush.kv_cache import KVCache, KVLayout

    cache = KVCache(KVLayout(256, 4, 16, 2, 64, torch.float32))  # 16 MiB
    assert not cache.kv.any()
    assert "hg" in _vm_flags(cache.kv.data_ptr() + cache.kv.numel() * 2)  # an address inside the buffer


def _vm_flags(address: int) -> list[str]:
    """VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")
