"""Typed messages between the API process and the engine-core process (msgpack over a pipe).

    API -> core:  AddRequest, AbortRequest, RefuseLeg, ResetPrefixCache, Shutdown
    core -> API:  CoreReady (once, after the model is loaded), StepOutputs (deltas + stats),
                  CoreFailed (the core could not start or crashed; carries the reason)
"""

from __future__ import annotations

import msgspec

from kvpush.emulate.lateness import EmulationStats
from kvpush.engine.sampling_params import SamplingParams
from kvpush.protocol.kv_params import PrefillResult, RequestLegParams
from kvpush.protocol.trace import Trace
from kvpush.transfer.stats import TransferStats


class LogprobEntry(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    kv_transfer_params: RequestLegParams | None = None  # checked against the role by its KV connector


class AbortRequest(msgspec.Struct, tag=True):
    request_id: str


class RefuseLeg(msgspec.Struct, tag=True):
    """The API process shed a leg before it reached the engine: its KV connector tells the peer."""

    kv_transfer_params: RequestLegParams


class ResetPrefixCache(msgspec.Struct, tag=True):
    """Forget every cached prefix block (POST /reset_prefix_cache). The pipe keeps the order: a request
    the API process sends after it finds no prefix from before."""


class ResetEmulationWindow(msgspec.Struct, tag=True):
    """--emulate: start the lateness window afresh (POST /emulation/reset_window; emulate/lateness.py)."""


class Shutdown(msgspec.Struct, tag=True):
    pass


class RequestDelta(msgspec.Struct):
    request_id: str
    new_token_ids: list[int]
    logprobs: list[LogprobEntry] = []
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    error_status: int = 500  # HTTP status the API answers with when finish_reason is "error"
    shed: str | None = None  # refused for lack of capacity (a ShedReason; error_status 429)
    kv_transfer_params: PrefillResult | None = None  # P's answer for the proxy
    trace: Trace | None = None


class EngineStats(msgspec.Struct):
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_for_kv: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    steps: int = 0
    compiled_graphs: int = 0
    num_added: int = 0  # AddRequests the core has taken in (admitted or not): the API's in-transit count
    kv_reserved_blocks: int = 0  # blocks unfinished requests still need for their prompt and next token
    transfer: TransferStats | None = None
    emulation: EmulationStats | None = None  # --emulate: the profile, steps and their lateness


class StepOutputs(msgspec.Struct, tag=True):
    deltas: list[RequestDelta]
    stats: EngineStats | None = None


class CoreReady(msgspec.Struct, tag=True):
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    kv_address: str | None = None  # host:port of the KV side channel (prefill/decode roles)
    engine_id: str = ""
    role: str = "colocated"
    kv_mode: str | None = None
    emulated_profile: str | None = None  # --emulate: the profile's name; None: the real model


class CoreFailed(msgspec.Struct, tag=True):
    reason: str


ToCore = AddRequest | AbortRequest | RefuseLeg | ResetPrefixCache | ResetEmulationWindow | Shutdown
FromCore = StepOutputs | CoreReady | CoreFailed

_encoder = msgspec.msgpack.Encoder()
to_core_decoder = msgspec.msgpack.Decoder(ToCore)
from_core_decoder = msgspec.msgpack.Decoder(FromCore)


def encode(msg: ToCore | FromCore) -> bytes:
    return _encoder.encode(msg)
