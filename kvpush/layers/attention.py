"""Attention over the paged KV cache.

Per layer: new K/V are written to their slots, then each sequence attends over its context in
`kv[block_table, layer]`. The batch is ordered decode-first: rows [0, num_decode) are the single-token
queries of decoding sequences. On CPU in fp32 they attend with one C kernel call that reads their
K/V in place from the cache (layers/cpu_kernels.py; where every row of the batch decodes, the same C call
also writes the new K/V rows, one call a layer); elsewhere they are batched into one padded SDPA
call over their blocks (gathered with one contiguous-row copy per K and V). Longer queries (prefill chunks) follow: one C kernel
call a chunk where --prefill-attention chose it (CPU fp32; layers/prefill_attention.c), else SDPA (in
64-row pieces, or one causal call for fresh prompts outside QUERY_SPLIT); a chunk with no earlier context
attends over its fresh K/V without touching the cache.

The model calls `attend(q, k, v, layer, scale)`; what a forward attends with (metadata, cache, the
layer hook) is set once per forward by `forward_context`. Under torch.compile `attend` is one
opaque op (`kvpush::paged_attention`), so the whole forward compiles into one graph around it
(as vLLM's attention op reads its forward context). The op writes the cache, which is not a graph
input: it is declared without mutated arguments, and its calls keep their order because each
layer's q, k, v depend on the previous layer's output, which depends on that layer's op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvpush.engine.kv_cache import KVCache
from kvpush.layers.cpu_kernels import DecodeStep, PagedDecode, PrefillAttention


@dataclass
class PrefillSeq:
    start: int  # first row of the chunk in the flat token batch
    query_len: int
    context_len: int  # including the chunk's own tokens
    block_table: torch.Tensor  # [ceil(context_len / bs)]


@dataclass
class MaskCache:
    """Additive causal masks of prefill pieces (0 / -inf) by (query rows, context, dtype), built by the first
    layer that needs one and reused by the others in the forward. Before, every layer built each piece's
    bool mask and SDPA converted it on every call: ~4 ms of a ~114-ms 512-token prefill in torch's
    profiler. Up to BUDGET bytes a forward; past it a mask is built per call, as a bool one, as before (a
    2,048-token chunk after 14k tokens of context would otherwise hold ~120 MB of masks)."""

    BUDGET = 32 << 20
    masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = field(default_factory=dict)
    used: int = 0

    def get(self, rows: int, ctx: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[rows, ctx]: query row r (position ctx - rows + r) sees keys at positions <= its own."""
        key = (rows, ctx, dtype)
        mask = self.masks.get(key)
        if mask is not None:
            return mask
        bool_mask = _chunk_mask(rows, ctx, device)
        size = rows * ctx * torch.finfo(dtype).bits // 8
        if self.used + size > self.BUDGET:
            return bool_mask
        self.used += size
        mask = self.masks[key] = torch.zeros((rows, ctx), dtype=dtype, device=device).masked_fill_(~bool_mask,
                                                                                                   float("-inf"))
        return mask


@dataclass
class AttentionMetadata:
    slot_rows: torch.Tensor  # [2T] cache rows of the new tokens' K then V in layer 0 (KVCache.slot_rows)
    num_decode: int = 0  # rows [0, num_decode) are decode tokens, one per sequence
    decode_block_ids: torch.Tensor | None = None  # [Bd * nb] each sequence's blocks, padded with block 0
    decode_lens: torch.Tensor | None = None  # [Bd] int64 context length, the new token included
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, nb * bs] bool, True = attend (gather path only)
    decode_kernel: PagedDecode | None = None  # reads K/V in place (CPU fp32); None: gather + SDPA
    decode_step: DecodeStep | None = None  # every row decodes on the kernel: one C call a layer writes and attends
    prefills: list[PrefillSeq] = field(default_factory=list)
    prefill_kernel: PrefillAttention | None = None  # a chunk's rows in one C call (CPU fp32); None: SDPA pieces
    masks: MaskCache = field(default_factory=lambda: MaskCache())  # prefill pieces' masks, for this forward


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    cache: KVCache
    layer_hook: Callable[[int], None] | None = None  # runs after each layer wrote its K/V (layer-wise push)


_context: ForwardContext | None = None


@contextmanager
def forward_context(meta: AttentionMetadata, cache: KVCache,
                    layer_hook: Callable[[int], None] | None = None) -> Iterator[None]:
    """What `attend` works with during one forward (the engine runs one forward at a time)."""
    global _context
    _context = ForwardContext(meta, cache, layer_hook)
    try:
        yield
    finally:
        _context = None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    """q: [T, H, hd], k, v: [T, kvh, hd] -> [T, H, hd], in the current forward context."""
    if torch.compiler.is_compiling():
        return torch.ops.kvpush.paged_attention(q, k, v, layer, scale)
    return _attend(q, k, v, layer, scale)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    ctx = _context
    assert ctx is not None, "attend() outside forward_context()"
    o = paged_attention(q, k, v, layer, ctx.meta, ctx.cache, scale)
    if ctx.layer_hook is not None:
        ctx.layer_hook(layer)
    return o


def _attend_meta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# The low-level torch.library API rather than @custom_op: under torch.compile each call costs ~9 us
# less of Python wrapping (measured on a graph of 30 opaque calls at one row: 51.6 -> 42.5 us a call).
_lib = torch.library.Library("kvpush", "FRAGMENT")
_lib.define("paged_attention(Tensor q, Tensor k, Tensor v, int layer, float scale) -> Tensor")
_lib.impl("paged_attention", _attend, "CPU")
_lib.impl("paged_attention", _attend, "CUDA")
_lib.impl("paged_attention", _attend_meta, "Meta")


def paged_attention(
    q: torch.Tensor,  # [T, H, hd]
    k: torch.Tensor,  # [T, kvh, hd]
    v: torch.Tensor,  # [T, kvh, hd]
    layer: int,
    meta: AttentionMetadata,
    cache: KVCache,
    scale: float,
) -> torch.Tensor:  # [T, H, hd] contiguous
    if meta.decode_step is not None:
        o = meta.decode_step(q, k, v, layer, scale)
        if o is not None:
            return o
    cache.write(layer, meta.slot_rows, k, v)
    parts = [decode_batch(q, layer, meta, cache, scale)] if meta.num_decode else []
    parts += [prefill_one(q, k, v, seq, layer, cache, scale, meta) for seq in meta.prefills]
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).contiguous()


def prefill_one(q, k, v, seq: PrefillSeq, layer: int, cache: KVCache, scale: float,
                meta: AttentionMetadata) -> torch.Tensor:
    """One prefill chunk's attention (its K/V already in the cache) -> [query_len, H, hd]"""
    rows = slice(seq.start, seq.start + seq.query_len)
    if seq.context_len == seq.query_len:  # no earlier context: attend over the fresh K/V directly
        ki, vi = k[rows], v[rows]
    else:
        ki, vi = cache.gather(layer, seq.block_table)  # [nb * bs, kvh, hd]
        ki, vi = ki[: seq.context_len], vi[: seq.context_len]
    if meta.prefill_kernel is not None and (o := meta.prefill_kernel(q[rows], ki, vi, scale)) is not None:
        return o
    qi = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, q, hd]
    ki = ki.transpose(0, 1).unsqueeze(0)  # [1, kvh, ctx, hd]
    vi = vi.transpose(0, 1).unsqueeze(0)
    if seq.context_len == seq.query_len and not QUERY_SPLIT[0] <= seq.query_len < QUERY_SPLIT[1]:
        o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
    else:
        o = _causal_by_query_rows(qi, ki, vi, seq.context_len - seq.query_len, scale, meta.masks)
    return o.squeeze(0).transpose(0, 1)


# Fresh causal prefills of this many query rows attend in QUERY_ROWS-row pieces, each over the keys up
# to its last row; with earlier context (an explicit mask, which SDPA cannot skip) every length does.
# torch's CPU flash kernel skips the masked half of a causal product only in its query-split
# granularity; measured (one thread, 6 heads over 3, head size 64, alternating, medians of 7): 512
# fresh rows 3.49 -> 2.85 ms, 256 rows 0.86 -> 0.81; 1,024 rows 10.5 -> 11.7 (its own split wins).
QUERY_SPLIT = (256, 768)
QUERY_ROWS = 64


def _causal_by_query_rows(qi, ki, vi, offset: int, scale: float, masks: MaskCache) -> torch.Tensor:
    """qi: [1, H, q, hd], ki, vi: [1, kvh, offset + q, hd]; query row r sits at position offset + r.
    masks: the forward's. -> [1, H, q, hd]"""
    qlen, parts = qi.shape[2], []
    for s in range(0, qlen, QUERY_ROWS):
        e = min(s + QUERY_ROWS, qlen)
        mask = masks.get(e - s, offset + e, qi.dtype, qi.device)
        parts.append(F.scaled_dot_product_attention(qi[:, :, s:e], ki[:, :, : offset + e], vi[:, :, : offset + e],
                                                    attn_mask=mask, scale=scale, enable_gqa=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _chunk_mask(qlen: int, ctx: int, device: torch.device) -> torch.Tensor:
    """[q, ctx] bool: query row r (position ctx - qlen + r) sees keys at positions <= its own."""
    rows = torch.arange(qlen, device=device).unsqueeze(1) + (ctx - qlen)
    cols = torch.arange(ctx, device=device).unsqueeze(0)
    return cols <= rows


def decode_batch(q, layer: int, meta: AttentionMetadata, cache: KVCache, scale: float) -> torch.Tensor:
    """-> [Bd, H, hd]"""
    assert meta.decode_block_ids is not None
    n = meta.num_decode
    if meta.decode_kernel is not None:
        assert meta.decode_lens is not None
        return meta.decode_kernel(q[:n].contiguous(), cache.kv, meta.decode_block_ids.view(n, -1), meta.decode_lens,
                                  layer, scale)
    k, v = cache.gather(layer, meta.decode_block_ids)  # [Bd * nb * bs, kvh, hd]
    kd = k.view(n, -1, k.shape[1], k.shape[2]).transpose(1, 2)  # [Bd, kvh, nb * bs, hd]
    vd = v.view(n, -1, v.shape[1], v.shape[2]).transpose(1, 2)
    qd = q[:n].unsqueeze(2)  # [Bd, H, 1, hd]
    o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
    return o.squeeze(2)

