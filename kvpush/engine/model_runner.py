"""Turns a scheduled batch into tensors, runs the model over the paged cache, samples.

Owns the model weights and the KV cache of the instance. Called only from the engine step loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvpush.engine.request import Request
from kvpush.kv_cache import KVCache
from kvpush.layers.attention import AttentionMetadata
from kvpush.layers.sampler import sample
from kvpush.models.decoder import CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, device: torch.device, seed: int = 0) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.block_size = cache.layout.block_size
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        # Called after each layer of the next forward (set per step by a layer-wise KV connector).
        self.layer_hook: Callable[[int], None] | None = None

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]]) -> dict[str, int]:
        """Compute the scheduled tokens; sample for requests whose last scheduled token ends them.

        Returns request id -> sampled token for those requests (partial prefill chunks sample nothing).
        """
        ids, positions, meta, finishing = self.prepare(scheduled)
        rows = torch.tensor([meta.query_starts[i] + meta.query_lens[i] - 1 for i in finishing], device=self.device)
        if not finishing:
            rows = rows.long()  # nothing to sample, but the KV still has to be written
        logits = self.model(ids, positions, meta, self.cache, rows, self.layer_hook)  # [S, vocab]
        requests = [scheduled[i][0] for i in finishing]
        tokens = sample(logits.cpu(), requests, self.generator)
        return {r.request_id: t for r, t in zip(requests, tokens, strict=True)}

    def prepare(self, scheduled: list[tuple[Request, int]]):
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qlens, ctxs, starts, tables, finishing = [], [], [], [], []
        for i, (request, n) in enumerate(scheduled):
            start = request.num_computed_tokens
            starts.append(len(ids))
            ids.extend(request.token_ids_slice(start, start + n))
            positions.extend(range(start, start + n))
            slots.extend(self._slot(request.block_table, p) for p in range(start, start + n))
            qlens.append(n)
            ctxs.append(start + n)
            tables.append(request.block_table)
            if start + n == request.num_tokens:
                finishing.append(i)
        meta = self._metadata(slots, qlens, ctxs, starts, tables)
        dev = self.device
        return torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), meta, finishing

    def _slot(self, block_table: list[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _metadata(self, slots, qlens, ctxs, starts, tables) -> AttentionMetadata:
        dev, bs = self.device, self.block_size
        slot_t = torch.tensor(slots, dtype=torch.long, device=dev)
        decode = [i for i, q in enumerate(qlens) if q == 1]
        meta = AttentionMetadata(
            slot_blocks=slot_t // bs,
            slot_offsets=slot_t % bs,
            query_lens=qlens,
            context_lens=ctxs,
            block_tables=[torch.tensor(t[: -(-c // bs)], device=dev) for t, c in zip(tables, ctxs, strict=True)],
            prefill_seqs=[i for i, q in enumerate(qlens) if q > 1],
            decode_seqs=decode,
            query_starts=starts,
        )
        if decode:
            self._decode_metadata(meta, decode, tables, ctxs)
        return meta

    def _decode_metadata(self, meta: AttentionMetadata, decode: list[int], tables, ctxs) -> None:
        dev, bs = self.device, self.block_size
        nb = max(-(-ctxs[i] // bs) for i in decode)
        padded = [tables[i][:nb] + [0] * (nb - min(len(tables[i]), nb)) for i in decode]
        lens = torch.tensor([ctxs[i] for i in decode], device=dev)
        meta.decode_rows = torch.tensor([meta.query_starts[i] for i in decode], device=dev)
        meta.decode_block_tables = torch.tensor(padded, device=dev)  # [Bd, nb]
        mask = torch.arange(nb * bs, device=dev).unsqueeze(0) < lens.unsqueeze(1)  # [Bd, S]
        meta.decode_mask = mask[:, None, None, :]
