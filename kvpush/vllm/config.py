"""The connector's options, read from vLLM's ``kv_connector_extra_config`` (never from the environment).

    {"mode": "push", "kv_host": "127.0.0.1", "kv_port": 0, "kv_lease_s": 30, "kv_timeout_s": 30,
     "on_kv_failure": "recompute", ...}

Unknown keys and bad values raise ``ConnectorConfigError`` at vLLM's start-up, naming the key.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvpush.config import Faults, KVMode, OnKVFailure, Role, TransferConfig
from kvpush.errors import KVPushError


class ConnectorConfigError(KVPushError):
    """``kv_connector_extra_config`` has an unknown key or a bad value."""


class ConnectorOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    mode: KVMode = KVMode.PUSH  # pull | push | push-layerwise | auto (legs of any; P and D must both run auto)
    role: Role | None = None  # prefill | decode; None: as vLLM's kv_role says (kv_both: either)
    kv_host: str = "127.0.0.1"  # the side channel binds here
    kv_advertise_host: str | None = None  # what peers are told to connect to (default: kv_host)
    kv_port: int = 0  # 0: a free port (each role's side channel has its own)
    kv_secret: str | None = None  # HMAC key of the handshake (set alike on P and D)
    kv_lease_s: float = 30.0  # P holds a finished prefill's blocks at most this long
    kv_timeout_s: float = 30.0  # D's deadline for its KV to arrive
    kv_quarantine_s: float = 10.0  # D keeps a failed transfer's blocks out of use this long past its deadline
    kv_writes_per_peer: int = 1  # P: whole-request WRITEs in flight to one D at a time (0: no limit)
    on_kv_failure: OnKVFailure = OnKVFailure.RECOMPUTE  # D: recompute locally, or fail the request
    idle_wait_ms: float = 10.0  # an empty engine step waits this long at most for a transfer event
    faults: tuple[str, ...] = ()  # testing only: kvpush's --fault-inject specs, e.g. ["delay-post:4"]

    def __post_init__(self) -> None:
        if self.role is Role.COLOCATED:
            raise ConnectorConfigError("role must be prefill or decode")
        if not 0 <= self.idle_wait_ms <= 1000:
            raise ConnectorConfigError(f"idle_wait_ms must be in [0, 1000], got {self.idle_wait_ms}")

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> ConnectorOptions:
        try:
            return msgspec.convert(extra or {}, cls)
        except (msgspec.ValidationError, ValueError) as e:
            raise ConnectorConfigError(f"kv_connector_extra_config: {e}") from e

    def roles(self, kv_role: str | None) -> tuple[Role, ...]:
        """The roles this instance takes legs for: ``role`` if set, else vLLM's kv_role's."""
        if self.role is not None:
            return (self.role,)
        by_kv_role = {"kv_producer": (Role.PREFILL,), "kv_consumer": (Role.DECODE,),
                      "kv_both": (Role.PREFILL, Role.DECODE)}
        if kv_role not in by_kv_role:
            raise ConnectorConfigError(f"kv_role must be kv_producer, kv_consumer or kv_both, got {kv_role!r}")
        return by_kv_role[kv_role]

    def transfer(self) -> TransferConfig:
        try:
            return TransferConfig(kv_mode=self.mode, kv_port=self.kv_port, kv_host=self.kv_host,
                                  kv_advertise_host=self.kv_advertise_host, kv_secret=self.kv_secret,
                                  kv_lease_s=self.kv_lease_s, kv_timeout_s=self.kv_timeout_s,
                                  kv_quarantine_s=self.kv_quarantine_s, on_kv_failure=self.on_kv_failure,
                                  kv_writes_per_peer=self.kv_writes_per_peer, faults=Faults.parse(self.faults))
        except ValueError as e:
            raise ConnectorConfigError(f"kv_connector_extra_config: {e}") from e
