"""Continuous batching with a per-step token budget, chunked prefill and preemption by recompute.

Each step the scheduler decides how many new tokens of each request to compute
(`num_scheduled_tokens`): running requests first (a decode step is one token, an unfinished prefill
continues in chunks), then waiting requests in arrival order while budget, sequence slots and
blocks last. When a running request cannot get a block, the most recently arrived running request
is preempted: its blocks are freed and it is recomputed later from scratch.

Prefills join a step one at a time (`prefill_join_tokens`): a waiting request that would compute
more than that many tokens does not join a step that already computes a prefill, and nothing behind
it is admitted but requests whose KV comes from a peer (parking them computes nothing). Where a
step's time grows with its tokens (a CPU), packing two prefills into one step delays the first by
the second's whole prefill and speeds neither: every request in the step ends when the step does.
Small joins (a request whose KV arrived from a peer recomputes one token) cost the others little and
save a step.

A long prefill runs in chunks (`long_prefill_token_threshold`, the scheduler's `chunk_limit`): at
most that many of one request's prompt tokens a step, so the requests decoding beside it get a token
after each chunk and a request whose KV landed joins the next one, instead of both waiting for the
whole prefill (a decode instance that prefills a prompt itself). The join rule looks at the whole
uncached prompt, not its first chunk (a chunked prefill is still one prefill at a time), and admission
takes the blocks of all its chunks up to the step's budget at once, so that requests parked for KV
between its chunks cannot leave it short of blocks halfway.

No I/O and no tensor work: this module is plain Python.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpush.config import SchedulerConfig
from kvpush.engine.block_manager import BlockManager
from kvpush.engine.kv_connector import Admission
from kvpush.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, num_new_tokens)
    preempted: list[Request] = field(default_factory=list)
    rejected: list[Request] = field(default_factory=list)  # finished by the admission hook's REJECT

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


# Called for the head of the waiting queue before it is admitted.
AdmissionHook = Callable[[Request], Admission]
# Called when a request finishes, before its blocks are freed; True if the caller took the blocks.
HoldHook = Callable[[Request], bool]


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int) -> None:
        self.config = config
        # None (by device) is resolved by the engine; a scheduler built alone packs as vLLM does
        self.join_limit = -1 if config.prefill_join_tokens is None else config.prefill_join_tokens
        # None (by role) is resolved by the engine once it knows its connector; alone: off
        self.chunk_limit = config.long_prefill_token_threshold or 0
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests whose KV is being received (decode role); they hold blocks but are not run.
        self.remote: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self.hold: HoldHook | None = None

    # ---- queue management ----------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.remote)

    def num_blocks_to_start(self) -> int:
        """Blocks the unfinished requests still need for their prompt and next token (what admission
        reserves for them before it admits another)."""
        bm = self.block_manager
        return sum(max(0, bm.blocks_needed(r.num_tokens + 1) - len(r.block_table)) for r in self.requests.values())

    def num_waiting_tokens(self) -> int:
        """Prompt tokens of the unfinished requests that have no output token yet and whose prompt is
        computed here (not by a prefill peer): the prefill work ahead of a new request."""
        return sum(r.num_prompt_tokens for r in self.requests.values()
                   if not r.output_token_ids and not r.remote_prefill)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Move a request to a finished status and free its blocks. Idempotent."""
        if request.is_finished:
            return
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.remote.pop(request.request_id, None)
        if self.hold is None or not self.hold(request):
            self.block_manager.free(request)
        self.requests.pop(request.request_id, None)

    def park_remote(self, request: Request) -> None:
        """Hold an admitted request (with its blocks) until its KV arrives from a peer."""
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.remote[request.request_id] = request

    def resume_remote(self, request: Request) -> None:
        """KV arrived: the request joins the front of the waiting queue to be run."""
        self.remote.pop(request.request_id, None)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    # ---- scheduling ----------------------------------------------------------------------
    def schedule(self, admit: AdmissionHook | None = None) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget, admit)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._chunk(min(request.num_tokens - request.num_computed_tokens, budget))
            while not self.block_manager.allocate(request, num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, num_new))
                budget -= num_new
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, admit: AdmissionHook | None) -> None:
        prefilling = any(n > 1 for _, n in out.scheduled)  # a running request's prefill chunk
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            decision = admit(request) if admit is not None else Admission.RUN
            if decision is Admission.WAIT:
                break
            if decision is not Admission.RUN:
                self._settle(request, decision, out)
                continue
            looked_up = not request.block_table  # _cached_prefix looks up only a request without KV in place
            cached = self._cached_prefix(request)
            num_new = request.num_tokens - request.num_computed_tokens - len(cached) * self.block_manager.block_size
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            if prefilling and not self._may_join(num_new):
                self._park_behind(out, admit)
                break
            num_new = min(num_new, budget)
            if not self.block_manager.allocate(request, num_new, cached):  # blocks for every chunk of this step's budget
                break
            num_new = self._chunk(num_new)
            if looked_up:
                self.block_manager.count_lookup(cached)
            self.waiting.popleft()
            if cached:
                request.num_computed_tokens = len(cached) * self.block_manager.block_size
                request.num_cached_tokens = max(request.num_cached_tokens, request.num_computed_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new
            prefilling = prefilling or num_new > 1

    def _park_behind(self, out: SchedulerOutput, admit: AdmissionHook | None) -> None:
        """The head waits for the next step (it may not join this one): requests behind it whose KV
        comes from a peer are still offered to the admission hook, since parking computes nothing and
        starts their transfer (a push registration, a pull READ) a step sooner; the others keep their
        order behind the head. Stops where the hook says WAIT."""
        if admit is None:
            return
        for request in [r for r in list(self.waiting)[1:] if r.remote_prefill]:
            decision = admit(request)
            if decision is Admission.WAIT:
                return
            if decision is not Admission.RUN:
                self._settle(request, decision, out)

    def _settle(self, request: Request, decision: Admission, out: SchedulerOutput) -> None:
        """A waiting request the admission hook parked (PARK: its KV comes from a peer) or refused (REJECT)."""
        self.waiting.remove(request)
        if decision is Admission.PARK:
            self.park_remote(request)
        else:
            self.finish(request, RequestStatus.FINISHED_ERROR)
            out.rejected.append(request)

    def _chunk(self, num_new: int) -> int:
        """The tokens of a prefill of num_new that one step computes (chunk_limit; 0: all)."""
        return min(num_new, self.chunk_limit) if self.chunk_limit > 0 else num_new

    def _may_join(self, num_new: int) -> bool:
        """Whether a prefill of num_new tokens joins a step that already computes another prefill."""
        return self.join_limit < 0 or num_new <= self.join_limit

    def _cached_prefix(self, request: Request) -> list[int]:
        if request.block_table:  # received or partially computed KV already in place
            return []
        return self.block_manager.find_cached_prefix(request)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    # ---- after the model ran -------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed tokens, append sampled tokens and finish requests that stop.

        `sampled` maps request id to the token sampled at its last scheduled position; requests
        whose prefill is still partial have none. Returns the requests that got a new token.
        """
        progressed: list[Request] = []
        for request, num_new in out.scheduled:
            request.num_computed_tokens += num_new
            self.block_manager.cache_full_blocks(request)
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.output_token_ids.append(token)
            progressed.append(request)
            status = self.check_stop(request)
            if status is not None:
                self.finish(request, status)
        return progressed

    def check_stop(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        token = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens and token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
