"""The idle heap trim of the engine core (kvpush/engine/native_memory.py)."""

from __future__ import annotations

import os
import platform

import pytest

from kvpush.engine import native_memory
from kvpush.engine.native_memory import IdleTrimmer, trim_heap


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

    from kvpush.engine.kv_cache import KVCache, KVLayout

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


def test_huge_page_arena_is_aligned_and_advised(monkeypatch) -> None:
    advised = []
    monkeypatch.setattr(native_memory, "advise_huge_pages", lambda addr, n: advised.append((addr, n)) or True)
    arena = native_memory.huge_page_arena(5 << 20)
    assert arena.numel() == 5 << 20 and arena.data_ptr() % native_memory.HUGE_PAGE == 0
    assert advised == [(arena.data_ptr(), 5 << 20)]


def test_weights_packed_on_huge_pages_keep_their_values(tiny_model) -> None:
    """Every parameter and buffer moves into one arena (64-byte aligned, values unchanged); the engine's
    greedy output is the same with and without packing."""
    import torch

    from kvpush.config import CacheConfig, EngineConfig, ModelConfig
    from kvpush.engine.engine import LLMEngine
    from kvpush.engine.sampling_params import SamplingParams
    from kvpush.models.loader import load_model

    packed, _, _ = load_model(tiny_model)
    plain, _, _ = load_model(tiny_model, huge_pages=False)
    tensors = [*packed.parameters(), *packed.buffers()]
    bases = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(bases) == 1 and min(t.data_ptr() for t in tensors) % native_memory.HUGE_PAGE == 0
    assert all(t.data_ptr() % 64 == 0 for t in tensors)
    assert len({t.untyped_storage().data_ptr() for t in plain.parameters()}) > 1  # not packed
    for (name, a), (_, b) in zip(packed.state_dict().items(), plain.state_dict().items(), strict=True):
        assert torch.equal(a, b), name

    def greedy(huge_pages: bool) -> list[int]:
        eng = LLMEngine(EngineConfig(ModelConfig(tiny_model, huge_pages=huge_pages), CacheConfig(num_blocks=64)))
        eng.add_request("r", [5, 9, 13, 200, 7, 1, 3], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        out: list[int] = []
        while eng.has_unfinished():
            out += [t for o in eng.step() for t in o.new_token_ids]
        return out

    tokens = greedy(True)
    assert len(tokens) == 12 and tokens == greedy(False)
