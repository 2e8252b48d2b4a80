"""argparse types shared by the kvpush commands and benchmarks."""

from __future__ import annotations

import argparse

import pytest

from kvpush.argtypes import non_negative_float, positive_float, positive_int


@pytest.mark.parametrize("text", ["0", "-1", "1.5", "x", ""])
def test_positive_int_refuses(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="whole number above 0"):
        positive_int(text)


def test_positive_int_accepts() -> None:
    assert positive_int("3") == 3


@pytest.mark.parametrize("text", ["0", "-0.5", "inf", "nan", "x"])
def test_positive_float_refuses(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        positive_float(text)


def test_floats_accept() -> None:
    assert positive_float("0.1") == 0.1 and non_negative_float("0") == 0.0
