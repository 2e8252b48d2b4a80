"""A measured clock's grid: how far the clock's formula is off near a step, read off the measured steps.

The formula of profile.StepClock is linear in a step's tokens, attended pairs and context; kvpush's CPU
engine is not (a prefill's linears run faster per token at 256-512 tokens than at 2,048; a batch-1
decode step grows more slowly with its context than the fit says). A measured profile keeps the steps it
timed (`clock.grid`), and its clock multiplies the formula's time of a step by a ratio read off them:

    family    the grid's steps it reads            coordinates (log2)
    prefill   one sequence computing > 1 token     tokens computed, 1 + context before them
    decode    every sequence computing 1 token     sequences, their mean context
    mixed     prefill chunks beside decodes        prefill tokens, sequences decoding

A prefill or decode step takes the inverse-distance-weighted mean (weights 1 / d^2, exact at a grid
point) of its family's measured / formula ratios at its coordinates. A mixed step takes the mean of its
prefill part's and its decode part's ratios, weighted by their formula times, times what the grid's mixed
steps cost beyond that mean (interpolated the same way): a step that holds both costs more than its
parts. A family without grid points reads 1; beyond the grid the nearest points weigh most.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

Seqs = tuple[tuple[int, int], ...]  # (new tokens, context after the step) per sequence
Formula = Callable[[Seqs], float]


@dataclass(frozen=True)
class GridPoint:
    """One measured step of a profile's grid."""

    seqs: Seqs
    measured_s: float


def split(seqs: Seqs) -> tuple[Seqs, Seqs]:
    """(the sequences computing more than one token, those decoding one)"""
    return tuple(s for s in seqs if s[0] > 1), tuple(s for s in seqs if s[0] == 1)


def family(seqs: Seqs) -> str:
    prefill, decode = split(seqs)
    return "mixed" if prefill and decode else "prefill" if prefill else "decode"


def coordinates(seqs: Seqs) -> tuple[float, float]:
    """Where a step sits among its family's (module docstring)."""
    prefill, decode = split(seqs)
    if prefill and decode:
        return math.log2(sum(n for n, _ in prefill)), math.log2(len(decode))
    if prefill:
        return math.log2(sum(n for n, _ in prefill)), math.log2(1 + sum(c - n for n, c in prefill))
    return math.log2(len(decode)), math.log2(max(1.0, sum(c for _, c in decode) / len(decode)))


def _weighted(samples: list[tuple[tuple[float, float], float]], at: tuple[float, float]) -> float:
    """The inverse-square-distance mean of the samples' ratios at `at`; 1 without samples."""
    num = den = 0.0
    for (x, y), ratio in samples:
        d2 = (x - at[0]) ** 2 + (y - at[1]) ** 2
        if d2 < 1e-12:
            return ratio
        num += ratio / d2
        den += 1.0 / d2
    return num / den if den else 1.0


class GridRatio:
    """measured / formula near any step, from a grid (built once per clock: the samples are the grid's)."""

    def __init__(self, grid: tuple[GridPoint, ...], formula: Formula) -> None:
        self.formula = formula
        self.samples: dict[str, list[tuple[tuple[float, float], float]]] = {"prefill": [], "decode": [], "mixed": []}
        for point in grid:
            if family(point.seqs) != "mixed":
                self.samples[family(point.seqs)].append((coordinates(point.seqs), point.measured_s / formula(point.seqs)))
        for point in grid:  # the mixed steps' cost beyond their parts, now that the parts read the grid
            if family(point.seqs) == "mixed":
                beyond = point.measured_s / (formula(point.seqs) * self._parts(point.seqs))
                self.samples["mixed"].append((coordinates(point.seqs), beyond))

    def __call__(self, seqs: Seqs) -> float:
        kind = family(seqs)
        if kind != "mixed":
            return _weighted(self.samples[kind], coordinates(seqs))
        return self._parts(seqs) * _weighted(self.samples["mixed"], coordinates(seqs))

    def _parts(self, seqs: Seqs) -> float:
        """A mixed step's parts' ratios, weighted by the parts' formula times."""
        parts = [(self.formula(part), self(part)) for part in split(seqs)]
        return sum(t * r for t, r in parts) / sum(t for t, _ in parts)
