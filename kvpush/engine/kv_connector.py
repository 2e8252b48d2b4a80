"""The KV connector interface: how the engine of a prefill or decode instance hands KV to its peer,
and the hooks (the only part of the engine) a connector may use.

All methods are called by the engine thread (the step loop of the engine-core process); none of
them blocks on the network. Transfers happen on the connector's transfer thread, which the
connector feeds with commands and whose events it applies in `poll`.

Block ownership: the block manager owns every block. A connector may *hold* blocks (keep their
reference after the request that used them is gone): P holds a finished prefill's blocks until
its transfer is DONE, FAILED or EXPIRED; D holds the blocks of a failed transfer while they are
quarantined. Held blocks go back to the block manager only through `EngineHooks.free_blocks`.

The engine imports nothing of kvpush.transfer: connectors implement this module's interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from enum import StrEnum
from typing import TYPE_CHECKING

import torch

from kvpush.engine.request import Request, RequestStatus
from kvpush.engine.sampling_params import TokenLogprob
from kvpush.protocol.kv_params import PrefillResult, RequestLegParams

if TYPE_CHECKING:  # EngineHooks wraps them; the scheduler imports Admission from here
    from kvpush.engine.block_manager import BlockManager
    from kvpush.engine.kv_cache import KVCache
    from kvpush.engine.model_runner import StepRunner
    from kvpush.engine.scheduler import Scheduler


class Admission(StrEnum):
    """What the admission hook decides for the head of the waiting queue."""

    RUN = "run"  # schedule it now (if budget and blocks allow)
    WAIT = "wait"  # not yet: it stays at the head, nothing behind it is admitted this step
    PARK = "park"  # its blocks are allocated and its KV comes from a peer: WAITING_FOR_REMOTE_KV
    REJECT = "reject"  # it cannot run (request.error says why): finished with an error


class EngineHooks:
    """What a connector may do to its engine: allocate, park-free resume, finish, free."""

    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, runner: StepRunner, cache: KVCache,
                 on_token: Callable[[Request], None]) -> None:
        self._scheduler = scheduler
        self._blocks = block_manager
        self._runner = runner
        self._cache = cache
        self._on_token = on_token
        self.block_size = block_manager.block_size

    def cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Blocks of the prefix cache holding the longest full-block prefix of `token_ids`."""
        return self._blocks.find_cached_prefix_tokens(token_ids)

    def allocate(self, request: Request, num_tokens: int, cached: list[int]) -> bool:
        """Blocks for `num_tokens` more tokens of `request` after the `cached` ones; False if short."""
        return self._blocks.allocate(request, num_tokens, cached)

    def resume(self, request: Request) -> None:
        """A parked request (Admission.PARK) may run: front of the waiting queue."""
        self._scheduler.resume_remote(request)

    def append_token(self, request: Request, token: int) -> None:
        """An output token that was not sampled here (P's first token); finishes the request if it stops."""
        request.output_token_ids.append(token)
        if request.sampling_params.logprobs is not None:  # the logits stayed on the peer
            request.output_logprobs.append(TokenLogprob(token, float("nan"), []))
        self._on_token(request)
        status = self._scheduler.check_stop(request)
        if status is not None:
            self._scheduler.finish(request, status)

    def finish(self, request: Request, status: RequestStatus) -> None:
        self._scheduler.finish(request, status)

    def free(self, request: Request) -> None:
        """Give back every block of the request (it will be computed again from scratch)."""
        self._blocks.free(request)

    def free_blocks(self, block_ids: list[int]) -> None:
        """Held blocks go back to the block manager."""
        self._blocks.free_blocks(block_ids)

    def uncache(self, block_ids: list[int]) -> None:
        """These blocks' contents are not trustworthy: drop them from the prefix cache."""
        self._blocks.uncache(block_ids)

    def set_layer_hook(self, hook: Callable[[int], None] | None) -> None:
        """Called with each layer index as the next forward pass finishes it (layer-wise push)."""
        self._runner.layer_hook = hook

    @property
    def kv_device(self) -> torch.device:
        """Where the KV cache lives (a GPU's K/V writes are queued, not done, when a layer hook runs)."""
        return self._cache.kv.device

    def corrupt_block(self, block_id: int) -> None:
        """Testing only (the corrupt-kv fault): perturb one block, so that wrong KV changes output."""
        self._cache.kv[block_id].add_(1.0)


class KVConnector(ABC):
    hooks: EngineHooks
    # True for a decode instance's connector (KV arrives from a peer while this engine decodes): its engine
    # chunks long prefills by default (engine._long_prefill_limit).
    decodes: bool = False

    def attach(self, hooks: EngineHooks) -> None:
        """Called once by the engine's constructor, before any request."""
        self.hooks = hooks

    @abstractmethod
    def on_add(self, request: Request, params: RequestLegParams | None) -> None:
        """Called by `add_request` before the request is queued. Checks the leg's parameters and
        keeps its state in `request.kv_state`. Raises InvalidRequestError for bad or missing ones."""

    def admit(self, request: Request) -> Admission:
        """Called for the head of the waiting queue before it is scheduled (see `Admission`). May
        allocate the request's blocks before it answers PARK."""
        return Admission.RUN

    def refuse(self, params: RequestLegParams) -> None:
        """Called when the instance sheds a leg before it reached the engine (admission control).
        Tells the peer what it needs to know so that nothing stays held for the transfer (D: Abort
        to P). Must not block."""
        return None

    def before_forward(self, scheduled: list[tuple[Request, int]]) -> None:
        """Called with each step's batch right before the forward pass. Must not block."""
        return None

    def on_finished(self, request: Request) -> bool:
        """Called when the request leaves the scheduler, before its blocks are freed. Returns True if
        the connector took over the request's blocks (then it emptied `request.block_table`)."""
        return False

    def result(self, request: Request) -> PrefillResult | None:
        """Called by the engine as it reports a finished request (after `on_finished`): what goes back
        to the caller as the request's kv_transfer_params (P: where its held KV is). None: nothing."""
        return None

    @abstractmethod
    def poll(self) -> list[Request]:
        """Called at the start of every engine step and when the step loop is woken. Applies the
        transfer thread's events; returns requests that got an output token or finished here."""

    def has_events(self) -> bool:
        """True if the transfer thread left events that `poll` has not applied yet."""
        return False
