"""`kvpush profile MODEL -o FILE`: an emulation profile of kvpush's own engine on this machine.

Times what an emulated instance replaces, the model runner's step (its inputs, the forward pass and
sampling), on a grid: prefills of a few lengths with and without earlier context, decode batches of a
few sizes and context lengths, and a few mixed steps (a prefill beside decodes, as under load). Each
point is the median of `repeats` passes over the whole grid, each timed run after WARM_RUNS untimed
ones of the same step.
The KV in the cache is whatever was there (the timing does not depend on it). Then it fits the
profile's clock (profile.py, `combine: sum`) to the points by non-negative least squares on their
relative errors:

    step_s = step_overhead_s + prefill_overhead_s * [a prefill] + per_token_s * T + per_pair_s * pairs
             + per_context_token_s * ctx                          (per_step_s: 0, the same as the first)

and writes a profile whose geometry is the model's own, whose every constant names this command,
machine and date as its source, whose clock keeps the grid (`clock.grid`: grid.py follows it where the
formula misses), and whose `derivation` lists each point measured and by the formula.
The link is not measured: --link-gbps and --link-latency-us say what it is.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpush.emulate.grid import GridPoint, split
from kvpush.emulate.profile import KVGeometry, Link, Profile, StepClock

# (new tokens, context after the step) per sequence of one step
Step = tuple[tuple[int, int], ...]
PREFILLS = ((16, 0), (64, 0), (256, 0), (512, 0), (1024, 0), (2048, 0), (256, 1024), (512, 1536))  # (tokens, before)
DECODES = ((1, 64), (1, 256), (1, 1024), (4, 128), (4, 512), (8, 256), (16, 128), (16, 512), (16, 1024),
           (32, 512))  # (batch, context)
MIXED = ((512, 4, 512), (512, 16, 256), (256, 8, 128))  # (fresh prefill tokens, decode batch, decode context)
QUICK_PREFILLS = ((16, 0), (64, 0), (128, 0), (64, 64))
QUICK_DECODES = ((1, 32), (1, 128), (4, 64), (8, 128))
QUICK_MIXED = ((64, 4, 64),)
WARM_RUNS = 3  # untimed runs of a step before each timed one (time_steps)
FEATURES = ("step_overhead_s", "prefill_overhead_s", "per_token_s", "per_pair_s", "per_context_token_s")


@dataclass(frozen=True)
class Point:
    step: Step
    measured_s: float


def grid(max_len: int, quick: bool = False) -> list[Step]:
    """The steps to time: prefills, decode batches, then mixed steps, each within `max_len` tokens of context."""
    prefills = QUICK_PREFILLS if quick else PREFILLS
    decodes = QUICK_DECODES if quick else DECODES
    steps: list[Step] = [((n, before + n),) for n, before in prefills if before + n <= max_len]
    steps += [((1, c),) * b for b, c in decodes if c <= max_len]
    steps += [((n, n),) + ((1, c),) * b for n, b, c in (QUICK_MIXED if quick else MIXED) if max(n, c) <= max_len]
    return steps


def features(step: Step) -> list[float]:
    """The fit's columns for one step (profile.StepClock.step_time's quantities)."""
    tokens = sum(n for n, _ in step)
    pairs = sum(n * (c - n) + n * (n + 1) // 2 for n, c in step)
    ctx = sum(c for _, c in step)
    return [1.0, float(any(n > 1 for n, _ in step)), float(tokens), float(pairs), float(ctx)]


def nnls(a: np.ndarray, b: np.ndarray, iterations: int = 200) -> np.ndarray:
    """argmin ||a x - b|| over x >= 0 (Lawson and Hanson's active set; a few columns here)."""
    n = a.shape[1]
    x, free = np.zeros(n), np.zeros(n, dtype=bool)
    for _ in range(iterations):
        gradient = a.T @ (b - a @ x)
        if free.all() or gradient[~free].max(initial=0.0) <= 1e-12 * max(1.0, np.abs(gradient).max()):
            break
        free[int(np.argmax(np.where(free, -np.inf, gradient)))] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (z[free] > 0).all():
                x = z
                break
            bad = free & (z <= 0)
            alpha = np.min(x[bad] / (x[bad] - z[bad]))
            x = x + alpha * (z - x)
            free &= x > 1e-15
    return x


def fit(points: Sequence[Point]) -> StepClock:
    """The clock whose step times are nearest the points', relative to each point's own time."""
    weights = np.array([1.0 / p.measured_s for p in points])
    a = np.array([features(p.step) for p in points]) * weights[:, None]
    coef = nnls(a, np.ones(len(points)))
    step_overhead, prefill_overhead, per_token, per_pair, per_context_token = (float(c) for c in coef)  # FEATURES
    return StepClock(step_overhead_s=step_overhead, prefill_overhead_s=prefill_overhead, per_token_s=per_token,
                     per_pair_s=per_pair, per_step_s=0.0, per_context_token_s=per_context_token, combine="sum")


def time_steps(runner, block_size: int, num_blocks: int, vocab: int, steps: Sequence[Step],
               repeats: int) -> list[Point]:
    """Each step timed `repeats` times on `runner` (engine/model_runner.py), the median: in passes over the
    whole grid, so that a slow moment of the machine (it drifts by a fifth within minutes) touches every
    point a little rather than one point wholly (a 512-token prefill once measured 122.5 ms where a
    512-token prefill beside 4 decodes measured 100.4, its repeats back to back). Each timed run follows
    WARM_RUNS untimed runs of the same step, as a serving instance's steps follow steps like them: a
    one-sequence decode after a different grid step is slow to settle (2026-12-08, bench model, one core;
    decode 1 x 64 / 1 x 256 / 1 x 1,024 in ms: 6.17 / 5.09 / 5.47 after one untimed run, 5.29 / 4.51 / 5.38
    after three, ~4.1 at 550 tokens decoding one request in an engine's own loop)."""
    from kvpush.engine.request import Request
    from kvpush.engine.sampling_params import SamplingParams

    batches = []
    for k, step in enumerate(steps):
        scheduled, first_block = [], 0
        for i, (n, c) in enumerate(step):
            request = Request(f"profile-{k}-{i}", [(7 * i + j) % vocab for j in range(c)],
                              SamplingParams(max_tokens=1, temperature=0))
            used = math.ceil(c / block_size)
            request.block_table = [(first_block + b) % num_blocks for b in range(used)]
            first_block += used
            request.num_computed_tokens = c - n
            scheduled.append((request, n))
        batches.append(scheduled)
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for scheduled, seen in zip(batches, times, strict=True):
            for _ in range(WARM_RUNS):  # untimed: the step's weights and rows where its repeats find them
                runner.execute(scheduled)
            t = time.perf_counter()
            runner.execute(scheduled)
            seen.append(time.perf_counter() - t)
    return [Point(step, statistics.median(seen)) for step, seen in zip(steps, times, strict=True)]


def describe(step: Step) -> str:
    prefill, decode = split(step)
    parts = [f"prefill {n}" + (f" after {c - n}" if c > n else "") for n, c in prefill]
    parts += [f"decode {len(decode)} x {decode[0][1]}"] if decode else []
    return " + ".join(parts)


def make_profile(name: str, engine, points: Sequence[Point], link: Link, command: str, machine: str) -> Profile:
    """The profile of `engine` (engine/engine.py's LLMEngine) from its measured points: the fit, following
    the points (clock.grid)."""
    clock = dataclasses.replace(fit(points), grid=tuple(GridPoint(p.step, p.measured_s) for p in points))
    arch, layout = engine.arch, engine.layout
    dtype = str(layout.dtype).removeprefix("torch.")
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    measured = f"measured by `{command}` on {machine}, {when}: the grid in clock.grid and its fit"
    geometry = f"{engine.config.model.model}'s config.json ({dtype} as loaded)"
    sources = {**{f"kv.{k}": geometry for k in ("num_layers", "num_kv_heads", "head_dim", "dtype")},
               **{f"clock.{k}": measured for k in (*FEATURES, "per_step_s", "grid")},
               "link.bandwidth_gbps": f"given by --link-gbps, not measured ({command})",
               "link.latency_s": f"given by --link-latency-us, not measured ({command})"}
    rows = [{"step": describe(p.step), "seqs": [list(s) for s in p.step], "measured_s": p.measured_s,
             "formula_s": clock.formula_time(p.step)} for p in points]
    return Profile(name=name, device=engine.device.type,
                   kv=KVGeometry(arch.num_layers, arch.num_kv_heads, arch.head_dim, dtype),
                   clock=clock, link=link, max_model_len=engine.max_model_len,
                   description=f"kvpush's engine on {engine.config.model.model} ({machine})",
                   sources=sources, derivation={"command": command, "machine": machine, "grid": rows})
