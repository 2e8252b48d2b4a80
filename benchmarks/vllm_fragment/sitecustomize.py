"""Fragments vLLM's KV cache for benchmarks/vllm_connector.py --fragment (on the vLLM processes' PYTHONPATH).

When vLLM imports ``vllm.v1.core.block_pool``, BlockPool's constructor is wrapped: after vLLM builds its
free block queue (block ids in order), the queue is rebuilt in the order 0, s, 2s, ... (mod n) for a
stride s coprime with n, so no two blocks handed out one after the other are adjacent in memory. vLLM
returns freed blocks to the queue's tail in their own order, so the cache stays fragmented. This is the
case behind vLLM PR #35264 (descriptors per transfer from 118 to 18,880). The same shim serves every
connector of a run; nothing else in vLLM changes. Benchmark-only: never on kvpush's own path.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import math
import sys

TARGET = "vllm.v1.core.block_pool"
STRIDE = 7


def stride_order(n: int, stride: int = STRIDE) -> list[int]:
    """Positions 0..n-1 visited with a stride coprime with n (each once; neighbours never adjacent)."""
    s = next(k for k in range(stride, n + stride) if math.gcd(k, n) == 1) if n > 1 else 1
    return [(i * s) % n for i in range(n)]


def fragment(pool) -> None:
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

    free = pool.free_block_queue.get_all_free_blocks()
    for block in free:
        block.prev_free_block = block.next_free_block = None
    pool.free_block_queue = FreeKVCacheBlockQueue([free[i] for i in stride_order(len(free))])


class _Patch(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        init = module.BlockPool.__init__

        def fragmented_init(pool, *args, **kwargs):
            init(pool, *args, **kwargs)
            fragment(pool)

        module.BlockPool.__init__ = fragmented_init


sys.meta_path.insert(0, _Patch())
