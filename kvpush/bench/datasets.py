"""Benchmark prompt sets: random token ids, multi-turn sessions, ShareGPT conversations, prompt files.

Every loader returns ``list[Sample]`` of exactly ``num_prompts`` samples and is deterministic for a
given ``seed``.

Token counting without a tokenizer: the load generator talks only HTTP, so prompts are either token
id lists (the random dataset; kvpush's server accepts them in ``/v1/completions``) or text whose
length is estimated as ``max(1, len(chars) // 4)`` unless an ``encode`` callable is given. The
server's ``usage.prompt_tokens`` is what the metrics use when it is reported.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import msgspec
import numpy as np

Encode = Callable[[str], Sequence[int]]
Decode = Callable[[list[int]], str]


class DatasetError(ValueError):
    """A dataset cannot be built: bad parameters, a missing or malformed file."""


class Sample(msgspec.Struct, frozen=True):
    """One benchmark request: the prompt (text or token ids) and its token lengths."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


def estimate_tokens(text: str, encode: Encode | None = None) -> int:
    """Token count of ``text``: ``len(encode(text))`` if given, else ``len(text) // 4`` (at least 1)."""
    if encode is not None:
        return max(1, len(encode(text)))
    return max(1, len(text) // 4)


def _length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive ``[floor(L*(1-r)), ceil(L*(1+r))]``, as in vLLM's random dataset (at least 1)."""
    low = max(1, math.floor(length * (1.0 - range_ratio)))
    high = max(low, math.ceil(length * (1.0 + range_ratio)))
    return low, high


def _allowed_ids(vocab_size: int, avoid_ids: Iterable[int]) -> np.ndarray:
    """Token ids in ``[0, vocab_size)`` minus ``avoid_ids``; raises if none are left."""
    if vocab_size < 1:
        raise DatasetError(f"vocab_size must be >= 1, got {vocab_size}")
    mask = np.ones(vocab_size, dtype=bool)
    avoid = [i for i in avoid_ids if 0 <= i < vocab_size]
    mask[avoid] = False
    allowed = np.flatnonzero(mask)
    if allowed.size == 0:
        raise DatasetError(f"every token id in [0, {vocab_size}) is in the avoid set")
    return allowed


def random_samples(
    num_prompts: int,
    input_len: int,
    output_len: int,
    *,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    vocab_size: int = 1000,
    avoid_ids: Iterable[int] = (),
    seed: int = 0,
    decode: Decode | None = None,
) -> list[Sample]:
    """Random prompts of token ids drawn uniformly from the allowed vocabulary.

    Each prompt is ``prefix_len`` tokens shared by all prompts followed by a per-prompt part whose
    length is uniform in ``[floor(input_len*(1-range_ratio)), ceil(input_len*(1+range_ratio))]``;
    ``prompt_len`` is the sum (vLLM's semantics, so the shared-prefix ratio is
    ``prefix_len / (prefix_len + input_len)``). Output lengths vary over the same relative range.
    With ``decode`` the prompt is ``decode(ids)`` (text; its re-tokenised length may differ a little
    from ``prompt_len``), otherwise the id list itself.
    """
    _check_random_args(num_prompts, input_len, output_len, range_ratio, prefix_len)
    rng = np.random.default_rng(seed)
    allowed = _allowed_ids(vocab_size, avoid_ids)
    prefix = allowed[rng.integers(0, allowed.size, size=prefix_len)].tolist()
    in_lo, in_hi = _length_range(input_len, range_ratio)
    out_lo, out_hi = _length_range(output_len, range_ratio)
    input_lens = rng.integers(in_lo, in_hi + 1, size=num_prompts)
    output_lens = rng.integers(out_lo, out_hi + 1, size=num_prompts)
    samples = []
    for n_in, n_out in zip(input_lens.tolist(), output_lens.tolist(), strict=True):
        ids = prefix + allowed[rng.integers(0, allowed.size, size=n_in)].tolist()
        prompt: str | list[int] = decode(ids) if decode is not None else ids
        samples.append(Sample(prompt=prompt, prompt_len=len(ids), output_len=int(n_out)))
    return samples


def session_samples(
    num_prompts: int,
    input_len: int,
    output_len: int,
    *,
    turns: int = 4,
    turn_len: int = 64,
    vocab_size: int = 1000,
    avoid_ids: Iterable[int] = (),
    seed: int = 0,
) -> list[Sample]:
    """Multi-turn sessions of token-id prompts, in the order a chat service sees them.

    A session's first prompt is ``input_len`` random tokens; each later turn's prompt is the previous
    one, then ``output_len`` tokens standing for the answer, then ``turn_len`` new tokens (the user's
    next message), so an instance that served the previous turn holds most of the prompt. Sessions are
    interleaved round-robin (turn 0 of every session, then turn 1, ...), which puts
    ``ceil(num_prompts / turns)`` requests between two turns of a session: at the benchmark's rates,
    time enough for the previous turn to finish.
    """
    _check_random_args(num_prompts, input_len, output_len, 0.0, 0)
    if turns < 1 or turn_len < 1:
        raise DatasetError(f"turns and turn_len must be >= 1, got {turns}, {turn_len}")
    rng = np.random.default_rng(seed)
    allowed = _allowed_ids(vocab_size, avoid_ids)

    def draw(n: int) -> list[int]:
        return allowed[rng.integers(0, allowed.size, size=n)].tolist()

    num_sessions = -(-num_prompts // turns)
    prompts = [draw(input_len) for _ in range(num_sessions)]
    samples: list[Sample] = []
    for _turn in range(turns):
        for s in range(num_sessions):
            if len(samples) == num_prompts:
                return samples
            samples.append(Sample(prompt=prompts[s], prompt_len=len(prompts[s]), output_len=output_len))
            prompts[s] = prompts[s] + draw(output_len) + draw(turn_len)
    return samples


def mixed_samples(
    num_prompts: int,
    input_len: int,
    output_len: int,
    *,
    turns: int = 4,
    turn_len: int = 64,
    vocab_size: int = 1000,
    avoid_ids: Iterable[int] = (),
    seed: int = 0,
) -> list[Sample]:
    """A mixed service: short prompts (input_len / 4), long ones (input_len x 2) and multi-turn sessions
    (starting at input_len), a third each, interleaved (each session's turns stay in order)."""
    third = -(-num_prompts // 3)
    avoid = list(avoid_ids)
    streams = [random_samples(third, max(1, input_len // 4), output_len, vocab_size=vocab_size, avoid_ids=avoid,
                              seed=seed),
               random_samples(third, input_len * 2, output_len, vocab_size=vocab_size, avoid_ids=avoid, seed=seed + 1),
               session_samples(third, input_len, output_len, turns=turns, turn_len=turn_len, vocab_size=vocab_size,
                               avoid_ids=avoid, seed=seed + 2)]
    mixed = [s[i] for i in range(third) for s in streams]
    return mixed[:num_prompts]


def _check_random_args(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float, prefix_len: int
) -> None:
    """Raise ``DatasetError`` for out-of-range random-dataset parameters."""
    if num_prompts < 1:
        raise DatasetError(f"num_prompts must be >= 1, got {num_prompts}")
    if input_len < 1 or output_len < 1:
        raise DatasetError(f"input_len and output_len must be >= 1, got {input_len}, {output_len}")
    if not 0.0 <= range_ratio < 1.0:
        raise DatasetError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if prefix_len < 0:
        raise DatasetError(f"prefix_len must be >= 0, got {prefix_len}")


def _fill(samples: list[Sample], num_prompts: int, source: str) -> list[Sample]:
    """First ``num_prompts`` samples, cycling when the source holds fewer."""
    if not samples:
        raise DatasetError(f"{source}: no usable prompts")
    if num_prompts < 1:
        raise DatasetError(f"num_prompts must be >= 1, got {num_prompts}")
    return [samples[i % len(samples)] for i in range(num_prompts)]


def _turn_text(turn: object) -> str | None:
    """The text of one ShareGPT turn (``value``, or ``content`` in some dumps), else None."""
    if not isinstance(turn, dict):
        return None
    value = turn.get("value", turn.get("content"))
    return value if isinstance(value, str) and value else None


def sharegpt_samples(
    path: str | Path,
    num_prompts: int,
    *,
    output_len: int | None = None,
    seed: int = 0,
    encode: Encode | None = None,
) -> list[Sample]:
    """Samples from a ShareGPT JSON file: a list of ``{"conversations": [{"from", "value"}, ...]}``.

    The prompt is ``conversations[0]`` (the human turn) and the output length is ``output_len`` if
    given, else the length of ``conversations[1]`` (the gpt turn) in tokens (see
    ``estimate_tokens``). Entries with fewer than two non-empty turns are skipped. The entries are
    shuffled with ``seed``; if fewer than ``num_prompts`` remain they are reused in order.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatasetError(f"cannot read ShareGPT file {path}: {exc}") from exc
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON list of conversations")
    samples = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        prompt, reply = _turn_text(turns[0]), _turn_text(turns[1])
        if prompt is None or reply is None:
            continue
        n_out = output_len if output_len is not None else estimate_tokens(reply, encode)
        samples.append(Sample(prompt=prompt, prompt_len=estimate_tokens(prompt, encode), output_len=n_out))
    random.Random(seed).shuffle(samples)
    return _fill(samples, num_prompts, str(path))


def file_samples(
    path: str | Path,
    num_prompts: int,
    *,
    output_len: int,
    encode: Encode | None = None,
) -> list[Sample]:
    """Samples from a text file with one prompt per line (blank lines skipped), in file order.

    Every sample asks for ``output_len`` tokens; prompts are reused in order if the file holds
    fewer than ``num_prompts``.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot read prompt file {path}: {exc}") from exc
    if output_len < 1:
        raise DatasetError(f"output_len must be >= 1, got {output_len}")
    samples = [
        Sample(prompt=line, prompt_len=estimate_tokens(line, encode), output_len=output_len)
        for line in (raw.strip() for raw in lines)
        if line
    ]
    return _fill(samples, num_prompts, str(path))
