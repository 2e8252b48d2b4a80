"""free_port hands out loopback ports a server can bind, never twice, and below the kernel's ephemeral
range, where no outgoing connection or port-0 listener (UCX's) can take them before the server binds."""

from __future__ import annotations

import socket

from kvpush.launcher import launch


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low = launch._ephemeral_low()
    ports = [launch.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    if low - launch._PORT_FLOOR >= 1000:
        assert all(launch._PORT_FLOOR <= p < low for p in ports)
    for p in ports[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_skipped(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        draws = iter([taken, *range(20000, 20100)])  # the busy port first, then others
        monkeypatch.setattr(launch, "_ephemeral_low", lambda: 65536)
        monkeypatch.setattr(launch._rng, "randrange", lambda a, b: next(draws))
        monkeypatch.setattr(launch, "_given", set())
        assert launch.free_port() != taken
