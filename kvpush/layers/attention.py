"""Attention over the paged KV cache.

Per layer: new K/V are written to their slots, then each sequence attends over its context
gathered from `kv[block_table, layer]`. Sequences whose query is a single token (decode) are
batched into one padded SDPA call; longer queries (prefill chunks) run one sequence at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpush.kv_cache import KVCache


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [T] block id of each new token
    slot_offsets: torch.Tensor  # [T] offset in its block
    query_lens: list[int]  # per sequence
    context_lens: list[int]  # per sequence, including the new tokens
    block_tables: list[torch.Tensor]  # per sequence, [nb]
    prefill_seqs: list[int]  # indices of sequences with query_len > 1
    decode_seqs: list[int]  # indices of sequences with query_len == 1
    query_starts: list[int]  # start row of each sequence in the flat token batch
    decode_rows: torch.Tensor | None = None  # [Bd] rows of decode tokens
    decode_block_tables: torch.Tensor | None = None  # [Bd, nb_max]
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, nb_max * bs] bool, True = attend


def paged_attention(
    q: torch.Tensor,  # [T, H, hd]
    k: torch.Tensor,  # [T, kvh, hd]
    v: torch.Tensor,  # [T, kvh, hd]
    layer: int,
    meta: AttentionMetadata,
    cache: KVCache,
    scale: float,
) -> torch.Tensor:  # [T, H, hd]
    cache.write(layer, meta.slot_blocks, meta.slot_offsets, k, v)
    out = torch.empty_like(q)
    for i in meta.prefill_seqs:
        _prefill_one(q, k, v, out, i, layer, meta, cache, scale)
    if meta.decode_seqs:
        _decode_batch(q, out, layer, meta, cache, scale)
    return out


def _prefill_one(q, k, v, out, i: int, layer: int, meta: AttentionMetadata, cache: KVCache, scale: float) -> None:
    start, qlen, ctx = meta.query_starts[i], meta.query_lens[i], meta.context_lens[i]
    qi = q[start : start + qlen].transpose(0, 1).unsqueeze(0)  # [1, H, q, hd]
    if ctx == qlen:  # no earlier context: attend over the fresh K/V directly
        ki, vi = k[start : start + qlen], v[start : start + qlen]
        mask = None
    else:
        ki, vi = cache.gather(layer, meta.block_tables[i])
        ki, vi = ki[:ctx], vi[:ctx]
        mask = _chunk_mask(qlen, ctx, q.device)
    ki = ki.transpose(0, 1).unsqueeze(0)  # [1, kvh, ctx, hd]
    vi = vi.transpose(0, 1).unsqueeze(0)
    o = F.scaled_dot_product_attention(
        qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )
    out[start : start + qlen] = o.squeeze(0).transpose(0, 1)


def _chunk_mask(qlen: int, ctx: int, device: torch.device) -> torch.Tensor:
    """[q, ctx] bool: query row r (position ctx - qlen + r) sees keys at positions <= its own."""
    rows = torch.arange(qlen, device=device).unsqueeze(1) + (ctx - qlen)
    cols = torch.arange(ctx, device=device).unsqueeze(0)
    return cols <= rows


def _decode_batch(q, out, layer: int, meta: AttentionMetadata, cache: KVCache, scale: float) -> None:
    assert meta.decode_rows is not None and meta.decode_block_tables is not None
    qd = q[meta.decode_rows].unsqueeze(2)  # [Bd, H, 1, hd]
    kd, vd = cache.gather_batch(layer, meta.decode_block_tables)  # [Bd, kvh, S, hd]
    o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
    out[meta.decode_rows] = o.squeeze(2)
