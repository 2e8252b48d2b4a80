"""Event wake-ups for the transfer thread: it sleeps on a selector instead of polling on a timer.

NIXL (1.5) has no blocking wait: ``get_new_notifs`` and ``check_xfer_state`` only poll, and with
the progress thread off (nixl_agent.py) UCX moves data only inside those calls. Polling every
millisecond while a decode instance waits for its peers' prefills costs ~4% of a core (about 50 us
of CPU per round: measured with a bare agent, `get_new_notifs` + `time.sleep(0.001)`). So each
transfer thread owns a doorbell, and every instance rings its peer's after anything it sends:

    wake()   another thread of this process queued a command (a pipe write; the engine's
             commands, handshakes, stop)
    ring()   a peer sent us a control notification or posted / finished a transfer that carries
             one (one UDP datagram to the address the peer published in its HandshakeInfo)
    wait(t)  the thread sleeps until either happens or ``t`` passes

A ring is only a hint to look now: the notification itself still travels over NIXL and stays the
only source of truth, so a lost datagram costs latency (until the next safety poll, thread.py's
WAITING_POLL_S), never correctness. The datagram's payload is ignored.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket

log = logging.getLogger("kvpush.transfer")
_MAX_DRAIN = 64  # datagrams / pipe bytes read per wake-up (the rest wait for the next round)


class Doorbell:
    def __init__(self, host: str = "127.0.0.1") -> None:
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_DGRAM)[0][0]
        self._udp = socket.socket(family, socket.SOCK_DGRAM)
        self._udp.bind((host, 0))
        self._udp.setblocking(False)
        self.port: int = self._udp.getsockname()[1]
        self._out = {f: socket.socket(f, socket.SOCK_DGRAM) for f in (socket.AF_INET, socket.AF_INET6)
                     if socket.has_ipv6 or f is socket.AF_INET}
        for s in self._out.values():
            s.setblocking(False)
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._udp, selectors.EVENT_READ)
        self._selector.register(self._r, selectors.EVENT_READ)
        self.rings = 0  # datagrams received (a peer told us to look)
        self.ring_errors = 0

    @staticmethod
    def resolve(address: str) -> tuple[int, tuple] | None:
        """'host:port' -> (family, sockaddr) to ring, resolved once per peer; None if unusable."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            return None
        try:
            info = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_DGRAM)
        except (OSError, UnicodeError):
            return None
        return (info[0][0], info[0][4]) if info else None

    def wake(self) -> None:
        """Any thread: end the current or next wait at once."""
        try:
            os.write(self._w, b"\0")
        except BlockingIOError:  # the pipe is full: a wake-up is already pending
            pass
        except OSError:  # closed during shutdown
            pass

    def ring(self, target: tuple[int, tuple] | None) -> None:
        """Tell a peer to look at its notifications now (best effort, never blocks)."""
        if target is None:
            return
        sock = self._out.get(socket.AddressFamily(target[0]))
        if sock is None:
            return
        try:
            sock.sendto(b"\1", target[1])
        except OSError as e:
            self.ring_errors += 1
            if self.ring_errors == 1:
                log.warning("doorbell ring to %s failed: %s (the peer falls back to polling)", target[1], e)

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` s or until woken / rung. Returns True if a peer rang."""
        rang = False
        for key, _ in self._selector.select(timeout):
            if key.fileobj is self._udp:
                rang |= self._drain_udp()
            else:
                self._drain_pipe()
        return rang

    def _drain_udp(self) -> bool:
        n = 0
        for _ in range(_MAX_DRAIN):
            try:
                self._udp.recv(16)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # e.g. ICMP port unreachable reported on this socket
                continue
            n += 1
        self.rings += n
        return n > 0

    def _drain_pipe(self) -> None:
        try:
            os.read(self._r, _MAX_DRAIN)
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        self._selector.close()
        for s in (self._udp, *self._out.values()):
            s.close()
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
