"""Prefill pieces' causal masks (layers/attention.py MaskCache): built once a forward within a byte budget,
per call past it, and the attention the same either way."""

from __future__ import annotations

import torch

from kvpush.layers import attention


def test_masks_are_reused_within_the_budget_and_built_per_call_past_it():
    cache = attention.MaskCache()
    first = cache.get(4, 10, torch.float32, torch.device("cpu"))
    assert cache.get(4, 10, torch.float32, torch.device("cpu")) is first and cache.used == 4 * 10 * 4
    allowed = first == 0  # query row r (position 6 + r) sees keys at positions <= its own
    assert torch.equal(allowed, torch.arange(10)[None, :] <= torch.arange(4)[:, None] + 6)
    assert torch.isinf(first[~allowed]).all() and first[~allowed].max() < 0
    small = attention.MaskCache(used=attention.MaskCache.BUDGET - 100)
    over = small.get(4, 10, torch.float32, torch.device("cpu"))
    assert over.dtype == torch.bool and torch.equal(over, allowed) and not small.masks


def test_attention_over_pieces_is_the_same_within_and_past_the_budget():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 200, 64, generator=g)  # 200 rows after 300 of context: four pieces of 64 rows or fewer
    k, v = torch.randn(1, 3, 500, 64, generator=g), torch.randn(1, 3, 500, 64, generator=g)
    cached = attention._causal_by_query_rows(q, k, v, 300, 0.125, attention.MaskCache())
    uncached = attention._causal_by_query_rows(q, k, v, 300, 0.125, attention.MaskCache(used=attention.MaskCache.BUDGET))
    assert torch.equal(cached, uncached)
