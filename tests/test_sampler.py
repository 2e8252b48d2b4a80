"""The sampler's batched greedy path picks what a per-row argmax picks: the first maximum of a row
(ties), and a NaN row's NaN, as the per-request path does."""

from __future__ import annotations

import torch

from kvpush.engine.request import Request
from kvpush.engine.sampling_params import SamplingParams
from kvpush.layers.sampler import sample


def _requests(n: int, **params) -> list[Request]:
    return [Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0.0, **params)) for i in range(n)]


def test_batched_greedy_equals_per_row_argmax_with_ties_and_nan():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (6, 512), generator=gen).float()  # [6, 512] many ties per row
    logits[2, 7] = float("nan")
    logits[2, 300] = float("nan")
    logits[4] = float("-inf")
    expected = [int(torch.argmax(row)) for row in logits]
    assert sample(logits.clone(), _requests(6), gen) == expected
    # The per-request path (taken when any request records logprobs) agrees with the batched one.
    with_logprobs = _requests(6)
    with_logprobs[0] = Request("lp", [1, 2, 3], SamplingParams(temperature=0.0, logprobs=0))
    assert sample(logits.clone(), with_logprobs, gen)[1:] == expected[1:]
