"""The KV side channel: a tiny framed TCP request/response service for handshakes.

Every engine-core process of a prefill or decode instance listens on `--kv-port`. A peer connects,
sends one frame (a signed HandshakeInfo), receives one frame (ours, or an error), and closes.
Frames are a 4-byte big-endian length and a payload of at most MAX_FRAME bytes. Everything after
the handshake travels as NIXL notifications.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading
from collections.abc import Callable

from kvpush.errors import HandshakeError

log = logging.getLogger("kvpush.side_channel")
MAX_FRAME = 4 << 20
_LEN = struct.Struct(">I")
ERROR_PREFIX = b"ERR:"


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the side channel")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> bytes:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_FRAME:
        raise HandshakeError(f"side-channel frame of {n} bytes exceeds the limit of {MAX_FRAME}")
    return _recv_exact(sock, n)


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LEN.pack(len(payload)) + payload)


def request(host: str, port: int, payload: bytes, timeout_s: float) -> bytes:
    """Send one frame, return the answer. HandshakeError if unreachable, refused or answered with an error."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            send_frame(sock, payload)
            answer = recv_frame(sock)
    except (OSError, ConnectionError) as e:
        raise HandshakeError(f"side channel {host}:{port} unreachable: {e}") from e
    if answer.startswith(ERROR_PREFIX):
        raise HandshakeError(f"peer {host}:{port} refused the handshake: {answer[len(ERROR_PREFIX):].decode(errors='replace')}")
    return answer


Handler = Callable[[bytes], bytes]


class SideChannelServer:
    """Serves `handler(frame) -> answer` on host:port in a background thread. A handler raising
    HandshakeError answers with an error frame; the connection is then closed."""

    def __init__(self, host: str, port: int, handler: Handler, timeout_s: float = 10.0,
                 on_reject: Callable[[], None] | None = None) -> None:
        outer = self

        class _Handle(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve_one(self.request)

        self.handler = handler
        self.timeout_s = timeout_s
        self.rejected = 0
        self.on_reject = on_reject or (lambda: None)
        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer((host, port), _Handle)
        self.server.daemon_threads = True
        address = self.server.server_address
        self.host: str = str(address[0])
        self.port: int = int(address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.5},
                                       name="kvpush-side-channel", daemon=True)

    def start(self) -> SideChannelServer:
        self.thread.start()
        return self

    def _serve_one(self, sock: socket.socket) -> None:
        sock.settimeout(self.timeout_s)
        try:
            frame = recv_frame(sock)
            try:
                answer = self.handler(frame)
            except HandshakeError as e:
                self._reject()
                log.warning("side channel: rejected a handshake: %s", e)
                answer = ERROR_PREFIX + str(e).encode()
            send_frame(sock, answer)
        except (OSError, ConnectionError, HandshakeError) as e:
            self._reject()
            log.warning("side channel: bad connection: %s", e)

    def _reject(self) -> None:
        self.rejected += 1
        self.on_reject()

    def close(self) -> None:
        """Stop serving and close the socket; also for a server never started (socketserver's shutdown() would
        then wait forever for a serving loop that never ran)."""
        if self.thread.is_alive():
            self.server.shutdown()
        self.server.server_close()
