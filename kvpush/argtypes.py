"""argparse types shared by the `kvpush` commands (argparse turns their errors into CLI messages)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def _number(text: str, ok: Callable[[float], bool], what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not ok(value) or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number above 0."""
    return _number(text, lambda v: v > 0, "a number above 0")


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    return _number(text, lambda v: v >= 0, "a number >= 0")


def unit_fraction(text: str) -> float:
    """A number from 0 to 1."""
    return _number(text, lambda v: 0 <= v <= 1, "a number from 0 to 1")


def positive_int(text: str) -> int:
    """A whole number above 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number above 0, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a whole number above 0, got {text!r}")
    return value
