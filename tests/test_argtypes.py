"""argparse types shared by the kvpush commands and benchmarks."""

from __future__ import annotations

import argparse

import pytest

from kvpush.argtypes import non_negative_float, positive_float, positive_int, unit_fraction


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


@pytest.mark.parametrize("text", ["-0.1", "1.01", "nan", "inf", "x"])
def test_unit_fraction_refuses(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="from 0 to 1"):
        unit_fraction(text)


def test_the_proxy_takes_autos_near_tie_and_residual_flags() -> None:
    from kvpush.cli import build_parser

    args = build_parser().parse_args(["proxy", "--prefill", "http://p", "--decode", "http://d", "--kv-mode", "auto",
                                      "--auto-near-tie", "0", "--auto-residual-alpha", "0.5"])
    assert (args.auto_near_tie, args.auto_residual_alpha) == (0.0, 0.5)
    defaults = build_parser().parse_args(["proxy", "--prefill", "http://p", "--decode", "http://d"])
    assert (defaults.auto_near_tie, defaults.auto_residual_alpha, defaults.auto_switch_margin) == (0.0, 0.2, 0.2)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["proxy", "--prefill", "http://p", "--decode", "http://d", "--auto-residual-alpha", "2"])


def test_serve_takes_the_prefill_join_limit() -> None:
    from kvpush.cli import build_parser
    from kvpush.flags import engine_config_from_args

    def config(*flags: str):
        return engine_config_from_args(build_parser().parse_args(["serve", "m", *flags])).scheduler

    assert config().prefill_join_tokens is None  # by device (the engine resolves it)
    assert config("--prefill-join-tokens", "-1").prefill_join_tokens == -1
    assert config("--prefill-join-tokens", "64").prefill_join_tokens == 64
    with pytest.raises(SystemExit, match="prefill-join-tokens"):
        config("--prefill-join-tokens", "-3")
    assert config().long_prefill_token_threshold is None  # by role (the engine resolves it)
    assert config("--long-prefill-token-threshold", "0").long_prefill_token_threshold == 0
    assert config("--long-prefill-token-threshold", "128").long_prefill_token_threshold == 128
    with pytest.raises(SystemExit, match="long-prefill-token-threshold"):
        config("--long-prefill-token-threshold", "-1")
    with pytest.raises(SystemExit, match="no-chunked-prefill"):
        config("--long-prefill-token-threshold", "64", "--no-chunked-prefill")


def test_kvpush_proxy_builds_its_config_with_the_auto_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvpush.proxy.proxy as proxy
    from kvpush.cli import build_parser, cmd_proxy

    seen = []

    async def serve(config) -> None:
        seen.append(config)

    monkeypatch.setattr(proxy, "serve_proxy", serve)
    base = ["proxy", "--prefill", "http://p", "--decode", "http://d", "--kv-mode", "auto"]
    assert cmd_proxy(build_parser().parse_args([*base, "--auto-busy-period", "--auto-switch-margin", "0.1"])) == 0
    assert cmd_proxy(build_parser().parse_args(base)) == 0
    assert seen[0].auto_busy_period and seen[0].auto_switch_margin == 0.1 and not seen[1].auto_busy_period
