"""What a request's ``kv_transfer_params`` ask of the connector inside vLLM.

    None / {}                      a plain request: computed here, no transfer
    {"kvpush": "kv_info"}          the proxy asks where this instance's side channels are (InfoQuery):
                                   P's answer carries them, nothing is held
    {"type": "PrefillLegParams"}   kvpush's proxy: a prefill leg  } kvpush's own leg parameters
    {"type": "DecodeLegParams"}    kvpush's proxy: a decode leg   } (protocol/kv_params.py)
    {"do_remote_decode": true}     vLLM-shaped (vllm-router, vLLM's proxies): a prefill leg
    {"do_remote_prefill": true,    vLLM-shaped: a decode leg, P's answer verbatim
     "remote_engine_id", ...}      (protocol/vllm_params.py translates both)

``parse`` raises InvalidRequestError (naming the field) for parameters the instance cannot honour:
a leg for a role it does not take, a mode other than its own, a malformed object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvpush.config import KVMode, Role
from kvpush.errors import InvalidRequestError, ProtocolError
from kvpush.protocol import kv_params as kp
from kvpush.protocol.vllm_params import INFO_QUERY, flag, is_vllm_shaped, translate_request


@dataclass(frozen=True)
class InfoQuery:
    """The proxy's question: this instance's engine ids and side-channel addresses, per role."""


@dataclass(frozen=True)
class Leg:
    params: kp.PrefillLegParams | kp.DecodeLegParams
    vllm_shaped: bool  # answer in vLLM's shape (top-level NIXL fields) rather than kvpush's PrefillResult

    @property
    def role(self) -> Role:
        return Role.PREFILL if isinstance(self.params, kp.PrefillLegParams) else Role.DECODE


def parse(kv: Any, roles: tuple[Role, ...], mode: KVMode) -> Leg | InfoQuery | None:
    if not kv:
        return None
    if not isinstance(kv, dict):
        raise InvalidRequestError("kv_transfer_params must be a JSON object", param="kv_transfer_params")
    if kv == INFO_QUERY:
        return InfoQuery()
    if is_vllm_shaped(kv):
        role = Role.PREFILL if flag(kv, "do_remote_decode") else Role.DECODE
        if not flag(kv, "do_remote_decode") and not flag(kv, "do_remote_prefill"):
            return None  # explicitly local, as vLLM's own connectors take it
        params = translate_request(kv, role.value if role in roles else "colocated", mode.value, 1, False)
        return None if params is None else Leg(params, True)
    try:
        params = msgspec.convert(kv, kp.PrefillLegParams | kp.DecodeLegParams)
    except (msgspec.ValidationError, ProtocolError, ValueError, TypeError) as e:
        raise InvalidRequestError(f"invalid kv_transfer_params: {e}", param="kv_transfer_params") from e
    leg = Leg(params, False)
    if leg.role not in roles:
        raise InvalidRequestError(f"a {leg.role.value} leg, but this instance takes "
                                  f"{' and '.join(r.value for r in roles)} legs", param="kv_transfer_params")
    if not mode.accepts(params.mode):
        raise InvalidRequestError(f"kv_transfer_params mode {params.mode.value!r} but this instance's connector "
                                  f"runs mode {mode.value!r}", param="kv_transfer_params")
    return leg
