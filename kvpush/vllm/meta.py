"""What the scheduler half tells the worker half each engine step (``StepMeta``, inside vLLM's
connector metadata), and what the worker half reports back besides vLLM's own sets (``WorkerReport``).

Block ids are this instance's own (vLLM's KV cache group 0); P's ids travel in a pull leg's params.
All of it crosses vLLM's executor boundary, so it is plain, picklable data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpush.protocol.kv_params import DecodeLegParams, PrefillLegParams


@dataclass(frozen=True)
class RecvJob:
    """D: receive the KV of prompt tokens [num_prefix_tokens, num_tokens) into ``block_ids`` (push: register
    them with P; pull: READ P's blocks from the same block index on)."""

    request_id: str
    leg: DecodeLegParams
    block_ids: tuple[int, ...]
    num_prefix_tokens: int
    num_tokens: int
    deadline: float


@dataclass(frozen=True)
class HoldJob:
    """P: a prefill leg finished; its blocks are held for the transfer until the worker reports the
    request in ``finished_sending`` (written, read, released, aborted or leased out)."""

    request_id: str
    leg: PrefillLegParams
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token_id: int | None
    lease_expiry: float


@dataclass(frozen=True)
class NotifyJob:
    """D: tell P about a transfer that never started here: Release (D's prefix cache holds every block)
    or Abort (the request ended, or its deadline passed, before blocks were allocated)."""

    leg: DecodeLegParams
    release: bool
    fallback: bool = False  # the request is computed here instead (its deadline passed): counted


@dataclass(frozen=True)
class CancelJob:
    """Either side: the request of a started transfer ended (P: aborted prefill; D: aborted while its KV
    was arriving). D's blocks stay out of use until nothing can land in them."""

    role: str
    transfer_id: str
    reason: str
    peer_engine_id: str | None


@dataclass(frozen=True)
class LayerJob:
    """P, push-layerwise: this step's forward pass computes a prefill leg's KV for these blocks (the blocks
    its scheduled tokens complete; the last chunk also its partial last block; blocks P's prefix cache
    held are handed with the first chunk). After each layer, the worker hands that layer of them to the
    transfer thread, which writes it to D once D has registered. A block is never handed twice."""

    transfer_id: str
    indices: tuple[int, ...]  # the blocks' positions in the request's block table
    block_ids: tuple[int, ...]


@dataclass
class StepMeta:
    recv: list[RecvJob] = field(default_factory=list)
    hold: list[HoldJob] = field(default_factory=list)
    notify: list[NotifyJob] = field(default_factory=list)
    cancel: list[CancelJob] = field(default_factory=list)
    layers: list[LayerJob] = field(default_factory=list)  # handed over layer by layer during this step
    idle: bool = False  # no tokens scheduled this step: the worker may wait a little for transfer events
    waiting: bool = False  # some transfer's outcome is awaited (what an idle step waits for)

    def __bool__(self) -> bool:
        return bool(self.recv or self.hold or self.notify or self.cancel or self.layers)


@dataclass
class WorkerReport:
    """Worker -> scheduler: D requests whose transfer blocks nothing can write any more (landed, or
    failed and out of quarantine): the scheduler drops the reference it took on them."""

    released: set[str] = field(default_factory=set)

    def merge(self, other: WorkerReport) -> WorkerReport:
        return WorkerReport(self.released | other.released)
