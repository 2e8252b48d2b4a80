"""The emulated forward's bytes: deterministic KV written into the real blocks, and a token chosen from
the KV read back.

Writing: every row of the cache (one token, one layer, K or V: `num_kv_heads * head_dim` values) gets one
value, 1 + code / 128 with code = (T[token] ^ P[position] ^ L[layer, K|V]) % 128 over tables of
pseudo-random words: exact in every dtype, finite, so a peer's bytes compare exactly and the corrupt-kv
fault (+1.0) moves every value it touches.

Reading: a context's digest is a weighted sum over each of its rows' first and last elements (their raw
bits), weights by (position, layer, K|V, end); the token is a mix of the digest and the context length.
A transfer that delivers a row wrong at either end, or misplaces a block, changes the token; a change
strictly inside a row goes unseen (reading every byte of a 32 KiB-per-token context each step would
cost more than the step it emulates). On the host the sum runs in C, one pass in cache order
(layers/kv_digest.c): torch's gather over a 16k context took 230 ms, longer than a decode step at
--time-scale 20; the torch path stays where the C library cannot be built, and gives the same sums.
"""

from __future__ import annotations

import torch

from kvpush.engine.kv_cache import KVCache
from kvpush.layers.cpu_kernels import KVDigest, kv_digest

P31 = (1 << 31) - 1
W24 = (1 << 24) - 1
INT_VIEW = {2: torch.int16, 4: torch.int32}


def _mix(x: torch.Tensor) -> torch.Tensor:
    """An int64 tensor of values < 2^40 -> pseudo-random values in [0, 2^31 - 1) (two Park-Miller rounds)."""
    x = x % P31
    x = (x * 48271) % P31
    return (x * 69621) % P31


def _table(n: int, salt: int) -> torch.Tensor:
    return _mix(torch.arange(n, dtype=torch.long) * 7_919 + salt)  # [n]


class KVPattern:
    """The pattern of one cache. Tables of pseudo-random words per token id, position and (layer, K|V)
    are made once; a row's code and a digest's weights are xors of table entries."""

    def __init__(self, cache: KVCache, vocab_size: int, max_positions: int, native: bool = True) -> None:
        self.cache = cache
        # digests' one-pass C read-back (layers/kv_digest.c) where it builds and the cache is on the host
        self.native: KVDigest | None = kv_digest() if native and cache.kv.device.type == "cpu" else None
        lay = cache.layout
        self.row = lay.num_kv_heads * lay.head_dim
        self.num_layers = lay.num_layers
        self.by_token = _table(vocab_size, 1)  # [V]
        self.by_position = _table(max_positions + 1, 2)  # [max + 1]
        self.by_layer = _table(2 * lay.num_layers, 3).view(lay.num_layers, 2)  # [L, 2]
        self.weight_by_position = _table(max_positions + 1, 4)  # [max + 1]
        self.weight_by_end = _table(4 * lay.num_layers, 5)  # [L * 4]: layer, K|V, first|last element

    def write(self, layers: range, rows: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Fill the rows of `layers` at `rows` (layer 0's, KVCache.slot_rows: [2T]) for tokens at positions [T]."""
        lay = self.cache.layout
        flat = self.cache.kv.view(-1, self.row)  # [N * L * 2 * bs, kvh * hd]
        ids = torch.arange(layers.start, layers.stop, dtype=torch.long)  # [L']
        word = self.by_token[tokens] ^ self.by_position[positions]  # [T]
        codes = (word[None, None, :] ^ self.by_layer[ids][:, :, None]) % 128  # [L', 2, T]
        values = (1.0 + codes.to(torch.float32) / 128).to(self.cache.kv.dtype)
        targets = rows[None, :] + ids[:, None] * (2 * lay.block_size)  # [L', 2T]: K rows then V rows
        flat[targets.flatten()] = values.flatten().unsqueeze(1)  # one value over each row

    def digests(self, spans: list[tuple[list[int], int, int]]) -> list[int]:
        """Per span (block table, start, end): the weighted sum over positions [start, end) of their rows'
        first and last elements' bits, every layer, K and V. Sums over adjacent spans add up."""
        if not spans:
            return []
        if self.native is not None:
            fn, kv = self.native, self.cache.kv
            return [fn(kv, torch.tensor(table, dtype=torch.long), start, end, self.weight_by_position,
                       self.weight_by_end) for table, start, end in spans]
        lay = self.cache.layout
        pos, blocks, owner = self._positions(spans)  # [P]
        layers = torch.arange(lay.num_layers, dtype=torch.long)
        kv = torch.arange(2, dtype=torch.long)
        block_rows = (blocks[:, None, None] * lay.num_layers + layers[None, :, None]) * 2 + kv[None, None, :]
        rows = (block_rows * lay.block_size + (pos % lay.block_size)[:, None, None]).flatten()  # [P * L * 2]
        flat = self.cache.kv.view(INT_VIEW[lay.element_size]).view(-1, self.row)
        ends = torch.stack([flat[:, 0].index_select(0, rows), flat[:, -1].index_select(0, rows)], 1)  # [P*L*2, 2]
        bits = ends.to(torch.int64).view(pos.numel(), -1) & 0xFFFFFFFF  # [P, L * 4]
        bits = (bits ^ (bits >> 16)) & 0xFFFF
        weights = (self.weight_by_position[pos][:, None] ^ self.weight_by_end[None, :]) & W24  # [P, L * 4]
        per_position = (bits * weights).sum(1)  # [P]
        sums = torch.zeros(len(spans), dtype=torch.int64).index_add_(0, owner, per_position)  # [S]
        return [int(v) for v in sums]

    def _positions(self, spans: list[tuple[list[int], int, int]]) -> tuple[torch.Tensor, ...]:
        """Every span's positions [P], the blocks holding them [P] and the span each belongs to [P]."""
        pos, blocks, owner = [], [], []
        bs = self.cache.layout.block_size
        for i, (table, start, end) in enumerate(spans):
            p = torch.arange(start, end, dtype=torch.long)
            pos.append(p)
            blocks.append(torch.tensor(table, dtype=torch.long)[p // bs])
            owner.append(torch.full((end - start,), i, dtype=torch.long))
        return torch.cat(pos), torch.cat(blocks), torch.cat(owner)


def choose_token(context_digest: int, length: int, vocab: list[int], eos: int | None, eos_per_1024: int) -> int:
    """The token after a context: from the ordinary `vocab`, or `eos` when the hash's low bits say so."""
    h = (context_digest * 0x9E3779B1 + length * 0x85EBCA77) % (1 << 61)
    h ^= h >> 29
    h = (h * 0xBF58476D1CE4E5B9) % (1 << 61)
    if eos is not None and h % 1024 < eos_per_1024:
        return eos
    return vocab[(h >> 10) % len(vocab)]
