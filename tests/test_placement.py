"""CPU placement: --cpus parsing and errors, --pin's split, and a real server confined to its CPUs."""

from __future__ import annotations

import os

import pytest

from kvpush.cli import main
from kvpush.launcher.placement import PlacementError, available_cpus, format_cpus, parse_cpus, split_halves


@pytest.mark.parametrize("text, expected", [("0", (0,)), ("0-2,5", (0, 1, 2, 5)), (" 3 , 1-2 ", (1, 2, 3)),
                                            ("1,1,0-1", (0, 1))])
def test_parse_cpus(text, expected):
    assert parse_cpus(text, allowed=tuple(range(8))) == expected


@pytest.mark.parametrize("text, message", [("", "is not N or N-M"), ("a", "is not N or N-M"),
                                           ("0-", "is not N or N-M"), ("3-1", "ascending"),
                                           ("-1", "is not N or N-M"), ("0-9", "cannot use")])
def test_parse_cpus_rejects(text, message):
    with pytest.raises(PlacementError, match=message):
        parse_cpus(text, allowed=tuple(range(8)))


def test_format_and_split():
    assert format_cpus((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    assert split_halves((0, 1, 2, 3, 4)) == ((0, 1), (2, 3, 4))
    with pytest.raises(PlacementError, match="at least 2"):
        split_halves((3,))


def test_cli_reports_a_bad_cpu_list(tiny_model):
    with pytest.raises(SystemExit, match="kvpush: --cpus: .*cannot use"):
        main(["serve", tiny_model, "--cpus", "100000"])
    with pytest.raises(SystemExit, match="kvpush: --cpus: .*not N or N-M"):
        main(["serve", tiny_model, "--cpus", "zero"])
    with pytest.raises(SystemExit, match="give one or the other"):
        main(["up", tiny_model, "--pin", "--cpus", "0"])


def _allowed(pid: int) -> set[str]:
    """Cpus_allowed_list of every thread of a process."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            out |= {line.split(":")[1].strip() for line in f if line.startswith("Cpus_allowed_list")}
    return out


def _children(pid: int) -> list[int]:
    kids = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            kids += [int(c) for c in f.read().split()]
    return kids


@pytest.mark.integration
def test_server_threads_and_engine_core_follow_cpus(server_factory, tiny_model):
    cpu = available_cpus()[-1]
    server = server_factory(tiny_model, "--cpus", str(cpu))
    assert server.proc is not None
    pids = [server.proc.pid, *_children(server.proc.pid)]
    assert len(pids) >= 2  # the API process and its engine core
    for pid in pids:
        assert _allowed(pid) == {str(cpu)}, pid
    assert len(list(server.stream_completion(tiny_model, "hello", max_tokens=2))) == 2
