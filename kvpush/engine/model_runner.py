"""Turns a scheduled batch into tensors, runs the model over the paged cache, samples.

Owns the model weights and the KV cache of the instance. Called only from the engine step loop.
The flat token batch is ordered decode-first (single-token queries, then prefill chunks), which is
the layout `paged_attention` expects; outputs are keyed by request id, so the order is internal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvpush.config import CompileMode
from kvpush.engine import compiler
from kvpush.engine.kv_cache import KVCache
from kvpush.engine.request import Request
from kvpush.engine.sampling_params import SamplingParams
from kvpush.layers.attention import AttentionMetadata, PrefillSeq
from kvpush.layers.cpu_kernels import PagedDecode, PrefillAttention
from kvpush.layers.sampler import SamplingRow, sample
from kvpush.models.decoder import CausalLM


def add_slots(request: Request, n: int, block_size: int, ids: list[int], positions: list[int],
              blocks: list[int]) -> None:
    """Append the ids, positions and blocks of the `n` tokens of `request` a step computes next."""
    start, table = request.num_computed_tokens, request.block_table
    ids.extend(request.token_ids_slice(start, start + n))
    positions.extend(range(start, start + n))
    blocks.extend(table[p // block_size] for p in range(start, start + n))


class StepRunner(Protocol):
    """What the engine steps: the model's runner, or the emulated one (kvpush/emulate/runner.py)."""

    layer_hook: Callable[[int], None] | None

    @property
    def num_compiled_graphs(self) -> int: ...

    def execute(self, scheduled: list[tuple[Request, int]]) -> dict[str, int]: ...


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # [S] rows whose logits are sampled
    sampled: list[Request]  # the request of each logit row


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, device: torch.device, seed: int = 0,
                 compile_mode: CompileMode = CompileMode.OFF, decode_kernel: PagedDecode | None = None,
                 prefill_kernel: PrefillAttention | None = None) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.block_size = cache.layout.block_size
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        # Called after each layer of the next forward wrote its K/V (set per step by a layer-wise KV connector).
        self.layer_hook: Callable[[int], None] | None = None
        # Decode rows attend in place over the cache with the C kernel, where given (--decode-attention:
        # engine/attention_choice.py); else gather + SDPA.
        self.decode_kernel = decode_kernel
        self.prefill_kernel = prefill_kernel  # likewise for prefill chunks (--prefill-attention)
        self.compiled = compiler.compile_model(model, compile_mode, self.warm_up)

    @property
    def num_compiled_graphs(self) -> int:
        """Graphs torch.compile built in this process (flat after warm-up: no recompiles)."""
        return compiler.num_graphs()

    @torch.inference_mode()
    def warm_up(self, tokens: int) -> None:
        """Compile the graph for batches like this one now: run a prefill of `tokens` tokens, then clear
        the cache it wrote to."""
        tokens = min(tokens, self.model.model.rotary.cos.shape[0])
        request = Request("warm-up", [0] * tokens, SamplingParams(max_tokens=1))
        num_blocks = self.cache.layout.num_blocks
        request.block_table = [i % num_blocks for i in range(-(-tokens // self.block_size))]
        inputs = self.prepare([(request, tokens)])
        self.model(inputs.input_ids, inputs.positions, inputs.meta, self.cache, inputs.logit_rows)
        self.cache.kv.zero_()

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]]) -> dict[str, int]:
        """Compute the scheduled tokens; sample for requests whose last scheduled token ends them.

        Returns request id -> sampled token for those requests (partial prefill chunks sample nothing).
        """
        batch = self.prepare(scheduled)
        logits, greedy = self.model(batch.input_ids, batch.positions, batch.meta, self.cache, batch.logit_rows,
                                    self.layer_hook)  # [S, vocab], [S]
        rows = [SamplingRow(r.sampling_params, r.num_output_tokens, r.generator) for r in batch.sampled]
        out = sample(logits.cpu(), rows, self.generator, greedy.cpu())
        for request, logprob in zip(batch.sampled, out.logprobs, strict=True):
            if logprob is not None:
                request.output_logprobs.append(logprob)
        return {r.request_id: t for r, t in zip(batch.sampled, out.tokens, strict=True)}

    def prepare(self, scheduled: list[tuple[Request, int]]) -> ModelInput:
        bs = self.block_size
        decodes = [s for s in scheduled if s[1] == 1]
        ordered = decodes + [s for s in scheduled if s[1] > 1]
        ids: list[int] = []
        positions: list[int] = []
        blocks: list[int] = []
        rows: list[int] = []
        sampled: list[Request] = []
        for request, n in ordered:
            add_slots(request, n, bs, ids, positions, blocks)
            if request.num_computed_tokens + n == request.num_tokens:
                rows.append(len(ids) - 1)
                sampled.append(request)
        # Each tensor its own storage: the compiled graph would guard on a view's storage offset.
        ids_t, positions_t, blocks_t = (torch.tensor(x, dtype=torch.long).to(self.device)  # [T] each
                                        for x in (ids, positions, blocks))
        meta = AttentionMetadata(slot_rows=self.cache.slot_rows(blocks_t, positions_t % bs))
        if decodes:
            self._decode_metadata(meta, decodes)
        self._prefill_metadata(meta, ordered[len(decodes):], len(decodes))
        if meta.decode_kernel is not None and not meta.prefills and self.cache.row_writer is not None:
            assert meta.decode_block_ids is not None and meta.decode_lens is not None
            meta.decode_step = meta.decode_kernel.bind(self.cache.kv, meta.slot_rows,
                                                       meta.decode_block_ids.view(len(decodes), -1), meta.decode_lens)
        logit_rows = torch.tensor(rows, dtype=torch.long, device=self.device)
        return ModelInput(ids_t, positions_t, meta, logit_rows, sampled)

    def _decode_metadata(self, meta: AttentionMetadata, decodes: list[tuple[Request, int]]) -> None:
        bs = self.block_size
        lens = [r.num_computed_tokens + 1 for r, _ in decodes]
        nb = -(-max(lens) // bs)
        block_ids: list[int] = []
        for (request, _), n in zip(decodes, lens, strict=True):
            used = -(-n // bs)
            block_ids.extend(request.block_table[:used])
            block_ids.extend([0] * (nb - used))
        dev = self.device
        meta.num_decode = len(decodes)
        meta.decode_block_ids = torch.tensor(block_ids, dtype=torch.long, device=dev)  # [Bd * nb]
        lens_t = torch.tensor(lens, dtype=torch.long, device=dev)  # [Bd]
        meta.decode_lens = lens_t
        if self.decode_kernel is not None:
            meta.decode_kernel = self.decode_kernel
            return
        mask = torch.arange(nb * bs, device=dev).unsqueeze(0) < lens_t.unsqueeze(1)  # [Bd, nb * bs]
        meta.decode_mask = mask[:, None, None, :]

    def _prefill_metadata(self, meta: AttentionMetadata, prefills: list[tuple[Request, int]], row: int) -> None:
        bs = self.block_size
        for request, n in prefills:
            ctx = request.num_computed_tokens + n
            table = torch.tensor(request.block_table[: -(-ctx // bs)], dtype=torch.long, device=self.device)
            meta.prefills.append(PrefillSeq(row, n, ctx, table))
            row += n
        meta.prefill_kernel = self.prefill_kernel
