"""Paged KV block allocation with reference counts and hash-based prefix caching.

Blocks are owned by requests through their `block_table`. A block's reference count is the number
of live requests that hold it. A full block gets a hash chained over its tokens and its parent's
hash; freed blocks keep their hash and stay findable until the allocator reuses them (LRU order).

No I/O and no tensor work: this module is plain Python.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvpush.engine.request import Request

BlockHash = int


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


def chain_hashes(token_ids: list[int], block_size: int, num_blocks: int) -> list[BlockHash]:
    """Hashes of the first `num_blocks` full blocks of `token_ids`, each chained on its parent."""
    hashes: list[BlockHash] = []
    parent: BlockHash = 0
    for i in range(num_blocks):
        parent = hash((parent, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        hashes.append(parent)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, least recently freed first; values unused.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        self.num_hits = 0
        self.num_queries = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids holding the longest cached prefix of the request's tokens.

        At least one token is always left to compute, so a full hit drops its last block.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in chain_hashes(request.all_token_ids, self.block_size, max_blocks):
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def count_lookup(self, hits: list[int]) -> None:
        """Count one request's prefix lookup (the prefix-cache gauges): once, when it is admitted with
        the hits found, not for each step a request waiting at the head is looked up again."""
        self.num_queries += 1
        self.num_hits += bool(hits)

    def find_cached_prefix_tokens(self, token_ids: list[int]) -> list[int]:
        """Block ids of the cached full-block prefix of `token_ids` (all full blocks may hit)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for h in chain_hashes(token_ids, self.block_size, len(token_ids) // self.block_size):
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # ---- allocation ----------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        """Grow the request's block table to cover its computed tokens plus num_new_tokens.

        `cached_blocks` (from find_cached_prefix) become the head of an empty block table; their
        tokens count as computed (the caller advances num_computed_tokens).
        Returns False and changes nothing when not enough free blocks exist.
        """
        cached_blocks = cached_blocks or []
        total = len(request.block_table) + len(cached_blocks)
        computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        need = self.blocks_needed(computed + num_new_tokens) - total
        reclaimable = sum(1 for b in cached_blocks if self.blocks[b].ref_cnt == 0)
        if max(need, 0) > self.num_free_blocks - reclaimable:
            return False
        for block_id in cached_blocks:
            self._touch(block_id)
        request.block_table.extend(cached_blocks)
        request.block_table.extend(self._pop_free() for _ in range(max(need, 0)))
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register hashes of the request's blocks that are full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_table))
        hashes = chain_hashes(request.all_token_ids, self.block_size, num_full)
        for block_id, h in zip(request.block_table[:num_full], hashes, strict=True):
            block = self.blocks[block_id]
            if block.block_hash is None and h not in self.cached:
                block.block_hash = h
                self.cached[h] = block_id

    def free(self, request: Request) -> None:
        """Drop the request's references; the tail is evicted first when blocks are reused."""
        self.free_blocks(list(reversed(request.block_table)))
        request.block_table = []

    def free_blocks(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise AssertionError(f"block {block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block_id] = None

    def uncache(self, block_ids: list[int]) -> None:
        """Forget the hashes of blocks whose content is not trustworthy (a failed transfer)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.block_hash is not None and self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> int:
        """Forget every block's hash, so that no later request finds a prefix cached before now (blocks
        a request still holds, a pull lease's included, too: a running request registers its full
        blocks again as it computes). Returns how many were forgotten."""
        ids = [b.block_id for b in self.blocks if b.block_hash is not None]
        self.uncache(ids)
        return len(ids)

    # ---- internals -----------------------------------------------------------------------
    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self.free_queue[block_id]
        block.ref_cnt += 1

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block_id

    def check_invariants(self) -> None:
        """Raise AssertionError if ref counts and the free queue disagree (used by tests)."""
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
            assert (block.ref_cnt == 0) == (block.block_id in self.free_queue), block
        for h, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == h
