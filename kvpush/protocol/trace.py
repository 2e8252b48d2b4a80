"""One request's trace: the wall-clock stamps (time.time(), several clocks) of its way through a
deployment, typed. It travels in the final choice of every answer as `kvpush_trace`, a JSON object of
the stamps that were set (docs/protocol.md section 6 says who sets each); the load generator adds the
client's own and reads the critical path from them (kvpush/bench/trace.py).
"""

from __future__ import annotations

from typing import Any

import msgspec

# P's stamps as the proxy carries them in D's trace: P's own name -> the merged trace's name.
PREFILL_NAMES = {"api_received": "p_api_received", "arrived": "p_admitted", "prefill_done": "p_prefill_done",
                 "api_answered": "p_answered"}


class Trace(msgspec.Struct, kw_only=True, omit_defaults=True):
    # the client (kvpush bench)
    client_sent: float | None = None
    client_first_chunk: float | None = None
    # the proxy
    proxy_received: float | None = None
    dispatched: float | None = None
    p_leg_sent: float | None = None
    d_leg_sent: float | None = None
    p_response: float | None = None
    local_prefilled: float | None = None  # auto's local route: D prefills the plain request
    proxy_first_chunk: float | None = None
    # P's, renamed by the proxy (PREFILL_NAMES)
    p_api_received: float | None = None
    p_admitted: float | None = None
    p_prefill_done: float | None = None
    p_answered: float | None = None
    # an instance: its API process
    api_received: float | None = None
    api_got: float | None = None  # the first token reached the API process
    api_dequeued: float | None = None  # ... and its handler took it
    api_first_chunk: float | None = None
    api_answered: float | None = None
    # an instance: its engine and KV connector
    arrived: float | None = None
    prefill_done: float | None = None
    d_registered: float | None = None  # push: D's blocks allocated and registered with P
    d_admitted: float | None = None  # pull: D's blocks allocated, READ to come
    reg_received: float | None = None  # P, carried in Done: D's registration applied
    write_posted: float | None = None  # P, carried in Done: just before the WRITE was posted
    read_posted: float | None = None
    kv_landed: float | None = None
    d_ready: float | None = None
    kv_fallback_local: float | None = None  # the KV did not arrive: D computed the prompt itself
    first_token: float | None = None
    core_sent: float | None = None  # the engine core sent the first token to the API process

    def set(self, name: str, t: float) -> None:
        """Stamp `name` (a field of Trace; AttributeError for any other) with `t`."""
        if name not in self.__struct_fields__:
            raise AttributeError(f"Trace has no stamp {name!r}")
        setattr(self, name, t)

    def set_once(self, name: str, t: float) -> None:
        """Stamp `name` unless it is stamped already."""
        if getattr(self, name) is None:
            self.set(name, t)

    def update(self, other: Trace) -> None:
        """Take every stamp `other` has."""
        for name, t in other.stamps().items():
            setattr(self, name, t)

    def merged(self, other: Trace) -> Trace:
        """A copy of this trace with `other`'s stamps over it."""
        out = msgspec.structs.replace(self)
        out.update(other)
        return out

    def stamps(self) -> dict[str, float]:
        """The stamps that are set, as `kvpush_trace` carries them."""
        return {name: t for name in self.__struct_fields__ if (t := getattr(self, name)) is not None}

    def as_prefill(self) -> Trace:
        """P's own trace as the proxy merges it into D's: P's stamps under their p_ names."""
        out = Trace()
        for mine, merged in PREFILL_NAMES.items():
            if (t := getattr(self, mine)) is not None:
                setattr(out, merged, t)
        return out

    @classmethod
    def from_json(cls, obj: Any) -> Trace:
        """A `kvpush_trace` as an answer carries it; what is not a known stamp with a number is left out."""
        out = cls()
        if isinstance(obj, dict):
            for name, t in obj.items():
                if name in cls.__struct_fields__ and isinstance(t, (int, float)) and not isinstance(t, bool):
                    setattr(out, name, float(t))
        return out
