"""The sampler's batched greedy path picks what a per-row argmax picks: the first maximum of a row
(ties), and a NaN row's NaN, as the per-request path does."""

from __future__ import annotations

import torch

from kvpush.engine.sampling_params import SamplingParams
from kvpush.layers.sampler import SamplingRow, sample


def _requests(n: int, **params) -> list[SamplingRow]:
    return [SamplingRow(SamplingParams(temperature=0.0, **params), num_output_tokens=0) for _ in range(n)]


def test_batched_greedy_equals_per_row_argmax_with_ties_and_nan():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (6, 512), generator=gen).float()  # [6, 512] many ties per row
    logits[2, 7] = float("nan")
    logits[2, 300] = float("nan")
    logits[4] = float("-inf")
    expected = [int(torch.argmax(row)) for row in logits]
    assert sample(logits.clone(), _requests(6), gen).tokens == expected
    # The per-request path (taken when any request records logprobs) agrees with the batched one.
    with_logprobs = _requests(6)
    with_logprobs[0] = SamplingRow(SamplingParams(temperature=0.0, logprobs=0), num_output_tokens=0)
    out = sample(logits.clone(), with_logprobs, gen)
    assert out.tokens[1:] == expected[1:]
    assert out.logprobs[0] is not None and out.logprobs[0].token_id == out.tokens[0]
    assert out.logprobs[1:] == [None] * 5  # rows that ask for none get none
