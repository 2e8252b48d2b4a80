r"""One request inside the engine and its lifecycle.

States (RequestStatus):

    WAITING -----------------> RUNNING -----> FINISHED_{STOPPED,LENGTH,ABORTED,ERROR}
       ^   \                    |   ^
       |    \-> WAITING_FOR_REMOTE_KV (decode role: blocks allocated, KV arriving from prefill)
       |                        |
       +------ PREEMPTED <------+   (blocks freed; recomputed from scratch on re-admission)

`num_computed_tokens` counts tokens whose KV is in the cache (computed here, found in the prefix
cache, or received from a prefill instance). The scheduler advances it; nothing else does.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kvpush.engine.sampling_params import SamplingParams, TokenLogprob
from kvpush.protocol.trace import Trace


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (or a remote prefill)
    num_preemptions: int = 0
    error: str | None = None
    remote_prefill: bool = False  # its prompt's KV is computed by a peer (decode role), not here
    shed: str | None = None  # the request was refused for lack of capacity (a ShedReason): HTTP 429, not a fault
    generator: torch.Generator | None = None
    # Timestamps (time.time()) of the request's handover breakdown; filled by roles that move KV.
    trace: Trace = field(default_factory=Trace)
    # Opaque per-request state of the KV connector (decode/prefill roles), owned by the connector.
    kv_state: object | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]
