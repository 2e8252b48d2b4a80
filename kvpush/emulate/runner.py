"""The emulated model runner: the engine's ModelRunner with the forward replaced by a clock.

One step:
    start  = now; modelled = profile clock(step's (new tokens, context) per sequence) * time_scale
    write the KV pattern of every scheduled token into its blocks (kv_pattern.py), layer by layer; with a
    layer hook set (layer-wise push), layer l is written and handed to the hook at start + modelled * (l+1)/L
    for each request whose step ends its computed tokens: read its context back from the cache and choose
    its token (a request's digest is extended by the positions added since its last token, so each
    position is read once per run of the request; a request that missed a step is read in full)
    sleep until start + modelled; lateness = actual end - modelled end (lateness.py)
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvpush.emulate import kv_pattern
from kvpush.emulate.lateness import EmulationStats, LatenessLog
from kvpush.emulate.profile import Profile
from kvpush.engine.kv_cache import KVCache
from kvpush.engine.model_runner import add_slots
from kvpush.engine.request import Request
from kvpush.engine.sampling_params import TokenLogprob

EOS_PER_1024 = 1  # a context's token is an end of sequence with probability ~1/1024 (ignore_eos turns it off)


class EmulatedRunner:
    def __init__(self, cache: KVCache, profile: Profile, time_scale: float, vocab: list[int],
                 eos: int | None, vocab_size: int, max_positions: int) -> None:
        self.cache = cache
        self.pattern = kv_pattern.KVPattern(cache, vocab_size, max_positions)
        self.profile = profile
        self.time_scale = time_scale
        self.block_size = cache.layout.block_size
        self.vocab = vocab  # ordinary tokens (no special or end-of-sequence token), ascending
        self.eos = eos
        self.layer_hook: Callable[[int], None] | None = None
        self.lateness = LatenessLog(profile.name, time_scale)
        self.digests: dict[str, tuple[int, int]] = {}  # request id -> (positions read, digest)

    @property
    def num_compiled_graphs(self) -> int:
        return 0

    def stats(self) -> EmulationStats:
        return self.lateness.stats()

    def modelled_s(self, scheduled: list[tuple[Request, int]]) -> float:
        seqs = [(n, r.num_computed_tokens + n) for r, n in scheduled]
        return self.profile.clock.step_time(seqs) * self.time_scale

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]]) -> dict[str, int]:
        """Write the step's KV, choose tokens for requests whose step ends their tokens, wait for the
        modelled end. Returns request id -> token, as ModelRunner.execute."""
        start = time.monotonic()
        modelled = self.modelled_s(scheduled)
        rows, tokens, positions = self._slots(scheduled)
        layers = self.cache.layout.num_layers
        hook = self.layer_hook
        if hook is None:
            self.pattern.write(range(layers), rows, tokens, positions)
        else:
            for layer in range(layers):  # layer-wise push: each layer handed over at its modelled end
                self.pattern.write(range(layer, layer + 1), rows, tokens, positions)
                _sleep_until(start + modelled * (layer + 1) / layers)
                hook(layer)
        sampled = self._choose(scheduled)
        end = start + modelled
        _sleep_until(end)
        self.lateness.record(modelled, time.monotonic() - end)
        return sampled

    def _slots(self, scheduled: list[tuple[Request, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer 0's cache rows of every scheduled token ([2T]), and their tokens and positions ([T])."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        blocks: list[int] = []
        for request, n in scheduled:
            add_slots(request, n, bs, ids, positions, blocks)
        flat = torch.tensor([ids, positions, blocks], dtype=torch.long)  # [3, T]
        return self.cache.slot_rows(flat[2], flat[1] % bs), flat[0], flat[1]

    def _choose(self, scheduled: list[tuple[Request, int]]) -> dict[str, int]:
        ending = [(r, r.num_computed_tokens + n) for r, n in scheduled if r.num_computed_tokens + n == r.num_tokens]
        # a prefill chunk that does not end the prompt samples nothing
        known = [self._known(r, length) for r, length in ending]
        spans = [(r.block_table, read, length) for (r, length), (read, _) in zip(ending, known, strict=True)]
        added = self.pattern.digests(spans)
        out: dict[str, int] = {}
        self.digests = {}  # only requests that sampled this step keep theirs
        for (request, length), (_, value), more in zip(ending, known, added, strict=True):
            self.digests[request.request_id] = (length, value + more)
            token = kv_pattern.choose_token(value + more, length, self.vocab, self.eos, EOS_PER_1024)
            out[request.request_id] = token
            if request.sampling_params.logprobs is not None:
                request.output_logprobs.append(TokenLogprob(token, 0.0, [(token, 0.0)]))
        return out

    def _known(self, request: Request, length: int) -> tuple[int, int]:
        """(positions read, digest) kept from the request's last step, or (0, 0)."""
        read, value = self.digests.get(request.request_id, (0, 0))
        return (read, value) if read <= length else (0, 0)


def _sleep_until(deadline: float) -> None:
    """Sleep (never spin) until time.monotonic() reaches `deadline`."""
    left = deadline - time.monotonic()
    if left > 0:
        time.sleep(left)
