"""The project's exceptions. Each one names what went wrong; none is a bare Exception."""

from __future__ import annotations


class KVPushError(Exception):
    """Base class of every kvpush error."""


class InvalidRequestError(KVPushError, ValueError):
    """A request or sampling parameter is invalid; the server answers HTTP 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelLoadError(KVPushError):
    """A checkpoint cannot be loaded: a missing file, an unsupported architecture or dtype."""


class CompileError(KVPushError):
    """`--compile on` and the model cannot be compiled here (no C++ compiler, inductor failure)."""


class QueueFullError(KVPushError):
    """The waiting queue is full; the server answers HTTP 503."""


class TransferError(KVPushError):
    """A KV transfer failed: a post, a poll, or the peer disconnected."""


class HandshakeError(KVPushError):
    """Two instances cannot talk: protocol version, compatibility hash or secret mismatch."""


class DeviceError(KVPushError, ValueError):
    """A device name is malformed, or names a device this machine does not have (e.g. cuda, no GPU)."""


class ProtocolError(TransferError):
    """A control message or leg parameter is malformed, oversized, or from another protocol version."""
