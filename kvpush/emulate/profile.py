"""An emulation profile: the KV geometry per rank and the clock of one emulated accelerator.

A profile is a JSON file (format in docs/emulation.md). `load_profile` takes a path or the name of a
shipped profile (kvpush/emulate/profiles/NAME.json) and checks every field; a missing or malformed one
is a ProfileError that names it. Importing this module loads no torch (the CLI checks --emulate here).

The clock prices one engine step from what it computes:

    T      tokens computed in the step (prefill chunks and decodes)
    pairs  (query, key) pairs attended: a new token at position p attends p + 1 keys
    ctx    context tokens whose KV the step reads (each sequence's length after the step)

    step_s = step_overhead_s + prefill_overhead_s * [any sequence computes > 1 token]
             + combine(compute_s, memory_s)
    compute_s = per_token_s * T + per_pair_s * pairs
    memory_s  = per_step_s + per_context_token_s * ctx

`combine` is `max` (a roofline: the step is bound by arithmetic or by memory) or `sum` (a fit of a
machine where both add up, as kvpush's own CPU engine).

A measured profile (`kvpush profile`) also carries its grid (`clock.grid`: steps and their measured
times), and its clock follows the grid where the formula misses (grid.py): the formula's time times the
measured / formula ratio interpolated from the grid's steps nearest the step.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

from kvpush.emulate.grid import GridPoint, GridRatio

FORMAT = "kvpush-emulation-profile/1"
PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
COMBINES = ("max", "sum")


class ProfileError(ValueError):
    """A profile cannot be used: an unknown name, an unreadable file, a missing or malformed field."""


@dataclass(frozen=True)
class KVGeometry:
    """The KV cache of one rank of the emulated model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # float32 | bfloat16 | float16

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over every layer, on this rank."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class StepClock:
    step_overhead_s: float
    prefill_overhead_s: float
    per_token_s: float
    per_pair_s: float
    per_step_s: float
    per_context_token_s: float
    combine: str = "max"
    grid: tuple[GridPoint, ...] = ()  # measured steps the clock follows (measured profiles); () for none

    def step_time(self, seqs: Iterable[tuple[int, int]]) -> float:
        """Seconds of a step that computes, per sequence, `n` new tokens ending at context length `c`: the
        formula's, times the grid's measured / formula ratio near the step where the clock has a grid."""
        seqs = tuple(seqs)
        formula = self.formula_time(seqs)
        return formula * self._grid_ratio(seqs) if self.grid else formula

    @cached_property
    def _grid_ratio(self) -> GridRatio:
        return GridRatio(self.grid, self.formula_time)

    def formula_time(self, seqs: Iterable[tuple[int, int]]) -> float:
        """Seconds of the step by the formula alone (the module docstring's)."""
        tokens = pairs = ctx = 0
        prefill = False
        for n, c in seqs:
            tokens += n
            pairs += n * (c - n) + n * (n + 1) // 2
            ctx += c
            prefill |= n > 1
        compute = self.per_token_s * tokens + self.per_pair_s * pairs
        memory = self.per_step_s + self.per_context_token_s * ctx
        body = max(compute, memory) if self.combine == "max" else compute + memory
        return self.step_overhead_s + (self.prefill_overhead_s if prefill else 0.0) + body

    def prefill_time(self, tokens: int, context: int = 0) -> float:
        """One sequence's prefill of `tokens` after `context` cached ones, alone in its step."""
        return self.step_time([(tokens, context + tokens)])

    def decode_time(self, context_lens: Iterable[int]) -> float:
        """A decode step of one token for each sequence, given each one's context length after it."""
        return self.step_time([(1, c) for c in context_lens])


@dataclass(frozen=True)
class Link:
    """The emulated link of one rank to its peers (used by the shaped link, #37 item 3)."""

    bandwidth_gbps: float
    latency_s: float


@dataclass(frozen=True)
class Profile:
    name: str
    device: str  # the accelerator's kind, for choices that differ by device (engine.py: cpu | cuda)
    kv: KVGeometry
    clock: StepClock
    link: Link
    max_model_len: int
    description: str = ""
    sources: dict[str, str] = field(default_factory=dict)
    derivation: dict[str, Any] = field(default_factory=dict)

    @property
    def fingerprint(self) -> str:
        """A short hash of what shapes an emulated run (geometry, clock, link): the compatibility hash's."""
        shape = json.dumps([_fields(self.kv), _clock_json(self.clock), _fields(self.link)], sort_keys=True)
        return hashlib.sha256(shape.encode()).hexdigest()[:12]

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "name": self.name, "description": self.description, "device": self.device,
                "max_model_len": self.max_model_len, "kv": _fields(self.kv), "clock": _clock_json(self.clock),
                "link": _fields(self.link), "sources": dict(self.sources), "derivation": self.derivation}


def _fields(obj: object) -> dict[str, Any]:
    return dict(vars(obj))


def _clock_json(clock: StepClock) -> dict[str, Any]:
    """The clock's JSON object: its constants, and its grid where it has one."""
    out: dict[str, Any] = {f.name: getattr(clock, f.name) for f in fields(clock) if f.name != "grid"}
    if clock.grid:
        out["grid"] = [{"seqs": [list(s) for s in p.seqs], "measured_s": p.measured_s} for p in clock.grid]
    return out


def shipped_names() -> list[str]:
    return sorted(f.removesuffix(".json") for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))


def resolve(name_or_path: str) -> str:
    """The file of a profile: a path as given, else the shipped profile of that name."""
    if os.path.sep in name_or_path or name_or_path.endswith(".json"):
        if not os.path.isfile(name_or_path):
            raise ProfileError(f"profile file {name_or_path!r} does not exist")
        return name_or_path
    path = os.path.join(PROFILE_DIR, f"{name_or_path}.json")
    if not os.path.isfile(path):
        raise ProfileError(f"unknown profile {name_or_path!r}; shipped: {', '.join(shipped_names())} "
                           "(or give a path to a .json file)")
    return path


def load_profile(name_or_path: str) -> Profile:
    path = resolve(name_or_path)
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ProfileError(f"profile {path}: not readable JSON: {e}") from e
    return parse_profile(raw, where=path)


def parse_profile(raw: Any, where: str = "profile") -> Profile:
    """A Profile from its JSON object; ProfileError names the first field that is missing or wrong."""
    r = _Reader(raw, where)
    if r.get("format", str) != FORMAT:
        raise ProfileError(f"{where}: format must be {FORMAT!r}")
    kv = KVGeometry(r.get("kv.num_layers", int), r.get("kv.num_kv_heads", int), r.get("kv.head_dim", int),
                    r.get("kv.dtype", str))
    if kv.dtype not in DTYPE_BYTES:
        raise ProfileError(f"{where}: kv.dtype must be one of {', '.join(DTYPE_BYTES)}, got {kv.dtype!r}")
    c = "clock."
    times = {name: r.get(c + name, float) for name in _CLOCK_TIMES}
    grid = _grid(raw["clock"].get("grid", []) if isinstance(raw.get("clock"), dict) else [], where)
    clock = StepClock(**times, combine=r.get(c + "combine", str), grid=grid)
    if clock.combine not in COMBINES:
        raise ProfileError(f"{where}: clock.combine must be one of {', '.join(COMBINES)}, got {clock.combine!r}")
    link = Link(r.get("link.bandwidth_gbps", float), r.get("link.latency_s", float))
    device = r.get("device", str)
    if device not in ("cpu", "cuda"):
        raise ProfileError(f"{where}: device must be cpu or cuda, got {device!r}")
    sources = r.get("sources", dict)
    missing = [k for k in (*_SOURCED, *(("clock.grid",) if grid else ())) if k not in sources]
    if missing:
        raise ProfileError(f"{where}: sources names no source for {', '.join(missing)}")
    return Profile(r.get("name", str), device, kv, clock, link, r.get("max_model_len", int),
                   raw.get("description", ""), sources, raw.get("derivation", {}))


def _grid(raw: Any, where: str) -> tuple[GridPoint, ...]:
    """clock.grid: a list of {"seqs": [[n, c], ...], "measured_s": seconds}, each n >= 1 and c >= n."""
    if not isinstance(raw, list):
        raise ProfileError(f"{where}: field 'clock.grid' must be a list of measured steps")
    points = []
    for i, item in enumerate(raw):
        name = f"clock.grid[{i}]"
        seqs = item.get("seqs") if isinstance(item, dict) else None
        ok = isinstance(seqs, list) and len(seqs) > 0 and all(
            isinstance(s, list) and len(s) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in s)
            and 1 <= s[0] <= s[1] for s in seqs)
        if not ok or not isinstance(seqs, list):
            raise ProfileError(f"{where}: field '{name}.seqs' must be a non-empty list of [new tokens, context] "
                               "pairs with 1 <= new tokens <= context")
        measured = item.get("measured_s")
        if not isinstance(measured, int | float) or isinstance(measured, bool) or not measured > 0:
            raise ProfileError(f"{where}: field '{name}.measured_s' must be a positive number, got {measured!r}")
        points.append(GridPoint(tuple((n, c) for n, c in seqs), float(measured)))
    return tuple(points)


_CLOCK_TIMES = ("step_overhead_s", "prefill_overhead_s", "per_token_s", "per_pair_s", "per_step_s",
                "per_context_token_s")
# Every constant that shapes an emulated run must say where it comes from.
_SOURCED = (*(f"kv.{k}" for k in ("num_layers", "num_kv_heads", "head_dim", "dtype")),
            *(f"clock.{k}" for k in _CLOCK_TIMES), "link.bandwidth_gbps", "link.latency_s")


class _Reader:
    def __init__(self, raw: Any, where: str) -> None:
        if not isinstance(raw, dict):
            raise ProfileError(f"{where}: a profile is a JSON object")
        self.raw, self.where = raw, where

    def get(self, dotted: str, kind: type) -> Any:
        value: Any = self.raw
        for part in dotted.split("."):
            if not isinstance(value, dict) or part not in value:
                raise ProfileError(f"{self.where}: missing field {dotted!r}")
            value = value[part]
        ok = isinstance(value, kind) and not isinstance(value, bool)
        if kind is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok:
            raise ProfileError(f"{self.where}: field {dotted!r} must be {kind.__name__}, got {value!r}")
        if kind is float and value < 0:
            raise ProfileError(f"{self.where}: field {dotted!r} must not be negative, got {value!r}")
        if kind is int and value < 1:
            raise ProfileError(f"{self.where}: field {dotted!r} must be at least 1, got {value!r}")
        return float(value) if kind is float else value
