"""The prefill side (P) of a disaggregated deployment: its KV connector.

Request lifecycle on P:
    admitted (kv_transfer_params = PrefillLegParams; max_tokens forced to 1)
    -> prefill computed, first token sampled -> FINISHED: blocks *held* (Hold sent to the transfer
       thread) and PrefillResult returned to the proxy (pull: P's block ids and lease)
    -> transfer DONE (push: WRITE done; pull: D's ReadDone; either: D's Release)
       or FAILED / EXPIRED (lease) -> FreeBlocks event -> blocks back to the block manager.
A request that ends without a prefill (aborted) frees its blocks at once and tells D (Cancel).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from kvpush.config import KVMode, TransferConfig
from kvpush.engine.device import synchronize
from kvpush.engine.kv_connector import Admission
from kvpush.engine.request import Request, RequestStatus
from kvpush.protocol.kv_params import PrefillLegParams, PrefillResult, RequestLegParams
from kvpush.transfer.commands import Cancel, Hold, LayersDone
from kvpush.transfer.events import FreeBlocks
from kvpush.transfer.layerwise import blocks_complete
from kvpush.transfer.runtime import RuntimeConnector, TransferRuntime


@dataclass
class PrefillState:
    params: PrefillLegParams
    handed: int = 0  # layer-wise: blocks [0, handed) were handed to the writer (every layer)
    result: PrefillResult | None = None  # set when the prefill finished and its blocks are held


class PrefillConnector(RuntimeConnector):
    def __init__(self, runtime: TransferRuntime, config: TransferConfig) -> None:
        super().__init__(runtime, config)
        self.host, self.port = runtime.kv_host, runtime.kv_port

    def on_add(self, request: Request, params: RequestLegParams | None) -> None:
        leg = self.leg(params, PrefillLegParams)
        # One token; min_tokens capped at 1 so that its sample masks stop tokens as D's or a colocated one would
        sp = request.sampling_params
        request.sampling_params = msgspec.structs.replace(sp, max_tokens=1, min_tokens=min(sp.min_tokens, 1))
        request.kv_state = PrefillState(leg)

    def before_forward(self, scheduled: list[tuple[Request, int]]) -> None:
        """Layer-wise push: after each layer, hand the writer the blocks this chunk completes (the last
        chunk also its partial last block). What was handed over is never handed again."""
        if self.runtime.mode not in (KVMode.PUSH_LAYERWISE, KVMode.AUTO):
            return
        bs = self.hooks.block_size
        items = []
        for request, n in scheduled:
            st = request.kv_state
            if not isinstance(st, PrefillState) or st.params.mode is not KVMode.PUSH_LAYERWISE:
                continue
            last = blocks_complete(request.num_computed_tokens + n, request.num_prompt_tokens, bs)
            if last > st.handed:
                indices = tuple(range(st.handed, last))
                items.append((st.params.transfer_id, indices, tuple(request.block_table[i] for i in indices)))
                st.handed = last
        self.hooks.set_layer_hook(self._layer_hook(tuple(items)) if items else None)

    def _layer_hook(self, batch: tuple) -> Callable[[int], None]:
        """Hand layer `layer` of `batch` to the writer. On a GPU the layer's K/V writes are only queued
        when the hook runs: wait for them first, or the WRITE could read the blocks before they hold it."""
        submit, device = self.runtime.thread.submit, self.hooks.kv_device
        if device.type == "cpu":
            return lambda layer: submit(LayersDone(layer, batch))

        def hook(layer: int) -> None:
            synchronize(device)
            submit(LayersDone(layer, batch))
        return hook

    def admit(self, request: Request) -> Admission:
        delay = self.config.faults.delay_prefill_s
        if delay <= 0 or time.time() >= (request.trace.arrived or 0.0) + delay:
            return Admission.RUN
        return Admission.WAIT

    def on_finished(self, request: Request) -> bool:
        st = request.kv_state
        if not isinstance(st, PrefillState):
            return False
        p = st.params
        if request.status not in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED) \
                or not request.output_token_ids:
            self.runtime.thread.submit(Cancel(p.transfer_id, f"prefill {request.status.value}", p.decode_engine_id))
            return False
        blocks = tuple(request.block_table)
        request.block_table = []
        now = time.time()
        lease = now + self.config.kv_lease_s
        first = request.output_token_ids[0]
        self.runtime.thread.submit(Hold(p.transfer_id, request.request_id, blocks, request.num_prompt_tokens,
                                        first, lease, p.decode_engine_id))
        pull = p.mode is KVMode.PULL
        st.result = PrefillResult(
            transfer_id=p.transfer_id, mode=p.mode, prefill_engine_id=self.engine_id, prefill_kv_host=self.host,
            prefill_kv_port=self.port, num_tokens=request.num_prompt_tokens,
            block_ids=list(blocks) if pull else [], lease_expiry=lease if pull else None, first_token_id=first)
        request.trace.prefill_done = now
        return True

    def result(self, request: Request) -> PrefillResult | None:
        st = request.kv_state
        return st.result if isinstance(st, PrefillState) else None

    def poll(self) -> list[Request]:
        for event in self.runtime.drain_events():
            if isinstance(event, FreeBlocks):
                self.hooks.free_blocks(event.block_ids)
        return []
